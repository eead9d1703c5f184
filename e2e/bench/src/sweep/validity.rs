//! Which points are valid: the machine's CPU (outside the engines, on real engines) and the
//! client's lateness.

/// A point is invalid when the machine's mean CPU use over it is above this (0..1).
pub const MAX_CPU_BUSY: f64 = 0.85;
/// A point is invalid when the client's lateness p90 is above this, ms.
pub const MAX_LATENESS_P90_MS: f64 = 10.0;
/// Real engines: a point is invalid when everything except the engines used more than this
/// fraction of the machine on average (0..1; 0.25 = half a core of two).
pub const MAX_OTHER_CPU_BUSY: f64 = 0.25;

/// Why a point is invalid (empty: valid).
pub fn invalid_reasons(cpu_busy_mean: Option<f64>, lateness_p90_ms: Option<f64>) -> Vec<String> {
    [cpu_invalid_reason(cpu_busy_mean), lateness_invalid_reason(lateness_p90_ms)]
        .into_iter()
        .flatten()
        .collect()
}

/// The machine-CPU rule of [`invalid_reasons`] (simulators: the whole machine's busy share).
pub fn cpu_invalid_reason(cpu_busy_mean: Option<f64>) -> Option<String> {
    match cpu_busy_mean {
        Some(c) if c > MAX_CPU_BUSY => {
            Some(format!("CPU {:.0}% > {:.0}%", c * 100.0, MAX_CPU_BUSY * 100.0))
        }
        None => Some("CPU not sampled".into()),
        _ => None,
    }
}

pub(super) fn lateness_invalid_reason(lateness_p90_ms: Option<f64>) -> Option<String> {
    match lateness_p90_ms {
        Some(l) if l > MAX_LATENESS_P90_MS => {
            Some(format!("lateness p90 {l:.1} ms > {MAX_LATENESS_P90_MS} ms"))
        }
        None => Some("no request sent".into()),
        _ => None,
    }
}

/// Why a point over real engines is invalid (empty: valid). `engine_cpu_s`: CPU seconds of the
/// engines' processes over the point's `wall_s` on a machine of `cores` cores; the rest of the
/// machine's busy share (`cpu_busy_mean` − engines' share, floored at 0) is what the rule bounds.
pub fn invalid_reasons_real_engines(
    cpu_busy_mean: Option<f64>,
    engine_cpu_s: Option<f64>,
    wall_s: f64,
    cores: usize,
    lateness_p90_ms: Option<f64>,
) -> Vec<String> {
    [
        cpu_invalid_reason_real_engines(cpu_busy_mean, engine_cpu_s, wall_s, cores),
        lateness_invalid_reason(lateness_p90_ms),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The machine-CPU rule of [`invalid_reasons_real_engines`]: the busy share outside the engines.
pub fn cpu_invalid_reason_real_engines(
    cpu_busy_mean: Option<f64>,
    engine_cpu_s: Option<f64>,
    wall_s: f64,
    cores: usize,
) -> Option<String> {
    let machine_s = wall_s * cores as f64;
    match (cpu_busy_mean, engine_cpu_s) {
        (Some(busy), Some(eng)) if machine_s > 0.0 => {
            let other = (busy - eng / machine_s).max(0.0);
            (other > MAX_OTHER_CPU_BUSY).then(|| {
                format!(
                    "CPU outside the engines {:.0}% > {:.0}%",
                    other * 100.0,
                    MAX_OTHER_CPU_BUSY * 100.0
                )
            })
        }
        (None, _) => Some("CPU not sampled".into()),
        _ => Some("engine CPU not measured".into()),
    }
}
