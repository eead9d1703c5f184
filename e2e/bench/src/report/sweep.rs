//! The load sweep's section of the report (pure): the headline table at the load point with the
//! placement issue's targets, and per workload the saturation search and every measured point.
//!
//! The headline never uses an invalid point: a row whose load-point measurement is invalid shows
//! why and its targets are *not judged*. Targets (issue 11) are judged on `kvmesh_precise` (as
//! shipped: default configuration, no session header):
//!
//! | workload | engine hit rate | TTFT p90 at the load point | load max/mean |
//! |---|---|---|---|
//! | trace | ≥ 0.90 × ceiling | ≤ 0.5 × round_robin, ≤ 0.8 × kvmesh_approximate | ≤ 1.25 |
//! | agentic | ≥ ring_hash's and ≥ 0.90 × ceiling | ≤ 0.5 × round_robin | ≤ 1.25 |
//! | cold | — | ≤ 1.05 × least_request | ≤ 1.25 |
//! | models (issue 44), each base model | ≥ 0.90 × its own ceiling | ≤ 0.5 × round_robin's for the model | ≤ 1.25 over its workers |
//!
//! and for `models` no cross-model request (an engine's 404) at all.
//!
//! Over 600 lines: every table of the sweep section (headline, per point, attribution, models,
//! replicas) renders from one point type; split, one table's columns would sit in several files.

use super::targets::{
    POLICY_KVMESH_APPROXIMATE, POLICY_KVMESH_PRECISE, POLICY_LEAST_REQUEST, POLICY_RING_HASH,
    POLICY_ROUND_ROBIN,
};
use crate::sweep::{MeasureWindow, PointResult, Saturation};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// One workload's sweep.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkloadSweep {
    /// Workload name.
    pub workload: String,
    /// One line saying what it is.
    pub describe: String,
    /// Unit of the rates.
    pub rate_unit: String,
    /// The simulated engines' timing of this workload's points (empty: real engines, or an
    /// older `sweep.json`).
    #[serde(default)]
    pub fleet: String,
    /// The points' warm-up and measured window.
    #[serde(default)]
    pub window: MeasureWindow,
    /// round_robin's saturation, when found.
    pub saturation: Option<Saturation>,
    /// What happened in the search (e.g. gave up after N steps).
    pub note: String,
    /// Every measured point, in measurement order.
    pub points: Vec<PointResult>,
    /// The points behind several gateway replicas (`--replicas`), and the lost-events points
    /// (`--lose-events`): their own section (`report::replicas`), not in the tables above.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replica_points: Vec<PointResult>,
}

impl WorkloadSweep {
    /// The load point, when saturation was found.
    pub fn load_point(&self) -> Option<f64> {
        self.saturation.map(|s| s.load_point())
    }

    /// `policy`'s point at the load point.
    pub fn at_load(&self, policy: &str) -> Option<&PointResult> {
        let lp = self.load_point()?;
        self.points
            .iter()
            .find(|p| p.policy == policy && (p.rate - lp).abs() <= 1e-6 * lp.max(1e-9))
    }

    /// Policies in first-measured order.
    pub fn policies(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for p in &self.points {
            if !out.contains(&p.policy) {
                out.push(p.policy.clone());
            }
        }
        out
    }
}

/// The whole sweep (`sweep.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SweepReport {
    /// Settings, one Markdown bullet each.
    pub settings: Vec<String>,
    /// The workloads, in run order.
    pub workloads: Vec<WorkloadSweep>,
}

/// A target's verdict on one number.
#[derive(Debug, Clone, PartialEq)]
pub struct Judged {
    /// What the target says.
    pub target: String,
    /// `Some(true)` met, `Some(false)` missed, `None` not judged.
    pub met: Option<bool>,
    /// The measured ratio or value, formatted.
    pub measured: String,
}

fn judge(target: String, value: Option<f64>, bound: f64, at_least: bool) -> Judged {
    match value {
        Some(v) if v.is_finite() => Judged {
            target,
            met: Some(if at_least { v >= bound } else { v <= bound }),
            measured: format!("{v:.2}"),
        },
        _ => Judged { target, met: None, measured: "n/a".into() },
    }
}

fn valid_at<'a>(w: &'a WorkloadSweep, policy: &str) -> Option<&'a PointResult> {
    w.at_load(policy).filter(|p| p.valid())
}

fn p90_ratio(w: &WorkloadSweep, other: &str) -> Option<f64> {
    let me = valid_at(w, POLICY_KVMESH_PRECISE)?.ttft_p90_ms?;
    let them = valid_at(w, other)?.ttft_p90_ms?;
    (them > 0.0).then(|| me / them)
}

/// Issue 11's targets for this workload, judged on kvmesh_precise at the load point (valid points only).
pub fn targets(w: &WorkloadSweep) -> Vec<Judged> {
    let me = valid_at(w, POLICY_KVMESH_PRECISE);
    let hit_x = me.and_then(PointResult::hit_over_ceiling);
    let load = me.and_then(|p| p.load_max_over_mean);
    let mut out = Vec::new();
    match w.workload.as_str() {
        "trace" => {
            out.push(judge("hit ≥ 0.90 × ceiling".into(), hit_x, 0.90, true));
            out.push(judge(
                "TTFT p90 ≤ 0.5 × round_robin".into(),
                p90_ratio(w, POLICY_ROUND_ROBIN),
                0.5,
                false,
            ));
            out.push(judge(
                "TTFT p90 ≤ 0.8 × approximate".into(),
                p90_ratio(w, POLICY_KVMESH_APPROXIMATE),
                0.8,
                false,
            ));
        }
        "agentic" => {
            let ring = valid_at(w, POLICY_RING_HASH).and_then(|p| p.engine_hit_rate);
            let mine = me.and_then(|p| p.engine_hit_rate);
            let vs_ring = match (mine, ring) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            out.push(judge("hit ≥ ring_hash's".into(), vs_ring, 1.0, true));
            out.push(judge("hit ≥ 0.90 × ceiling".into(), hit_x, 0.90, true));
            out.push(judge(
                "TTFT p90 ≤ 0.5 × round_robin".into(),
                p90_ratio(w, POLICY_ROUND_ROBIN),
                0.5,
                false,
            ));
        }
        "models" => return models_targets(w),
        "cold" => out.push(judge(
            "TTFT p90 ≤ 1.05 × least_request".into(),
            p90_ratio(w, POLICY_LEAST_REQUEST),
            1.05,
            false,
        )),
        _ => return out,
    }
    out.push(judge("load max/mean ≤ 1.25".into(), load, 1.25, false));
    out
}

/// Issue 44's targets for the `models` workload, judged on kvmesh_precise at the load point
/// (valid points only), each model on its own and the worst model reported: hit ≥ 0.9 × its own
/// ceiling, TTFT p90 ≤ 0.5 × round_robin's for the same model, load max/mean over its own workers
/// ≤ 1.25, and no cross-model request (404 from an engine) at all.
fn models_targets(w: &WorkloadSweep) -> Vec<Judged> {
    let me = valid_at(w, POLICY_KVMESH_PRECISE);
    let rr = valid_at(w, POLICY_ROUND_ROBIN);
    let models = me.map(|p| p.per_model.as_slice()).unwrap_or_default();
    // The worst model's value; `None` when any model lacks it (not judged on part of the fleet).
    let worst = |v: &dyn Fn(&crate::sweep::models::ModelPoint) -> Option<f64>, min: bool| {
        let vals: Option<Vec<f64>> = models.iter().map(v).collect();
        vals.filter(|v| !v.is_empty()).map(|v| {
            v.into_iter().fold(if min { f64::INFINITY } else { f64::NEG_INFINITY }, |a, b| {
                if min {
                    a.min(b)
                } else {
                    a.max(b)
                }
            })
        })
    };
    let vs_rr = |m: &crate::sweep::models::ModelPoint| {
        let theirs = rr?.per_model.iter().find(|x| x.model == m.model)?.ttft_p90_ms;
        ratio(m.ttft_p90_ms, theirs)
    };
    vec![
        judge(
            "hit ≥ 0.90 × its ceiling, every model".into(),
            worst(&|m| m.hit_over_ceiling(), true),
            0.90,
            true,
        ),
        judge("TTFT p90 ≤ 0.5 × round_robin, every model".into(), worst(&vs_rr, false), 0.5, false),
        judge(
            "load max/mean ≤ 1.25, every model".into(),
            worst(&|m| m.load_max_over_mean, false),
            1.25,
            false,
        ),
        judge(
            "no cross-model request".into(),
            me.and_then(|p| p.cross_model).map(|n| n as f64),
            0.0,
            false,
        ),
    ]
}

fn f(v: Option<f64>, digits: usize) -> String {
    v.map(|x| format!("{x:.digits$}")).unwrap_or_else(|| "—".into())
}

fn pct(v: Option<f64>) -> String {
    v.map(|x| format!("{:.1}%", x * 100.0)).unwrap_or_else(|| "—".into())
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn verdicts(j: &[Judged]) -> String {
    if j.is_empty() {
        return "no target".into();
    }
    j.iter()
        .map(|t| {
            let v = match t.met {
                Some(true) => "**met**",
                Some(false) => "**missed**",
                None => "not judged",
            };
            format!("{} ({}): {v}", t.target, t.measured)
        })
        .collect::<Vec<_>>()
        .join("<br>")
}

/// Plot file names of a workload: (TTFT p90 vs rate, hit rate vs rate).
pub fn plot_files(workload: &str) -> (String, String) {
    (format!("sweep_{workload}_ttft_p90.png"), format!("sweep_{workload}_hit_rate.png"))
}

/// The sweep section (Markdown). `plots` says whether the plot files were written.
pub fn render(r: &SweepReport, plots: bool) -> String {
    let mut md = String::new();
    for s in &r.settings {
        let _ = writeln!(md, "- {s}");
    }
    let _ =
        writeln!(md, "\n### Headline at the load point (0.8 × round_robin's saturation rate)\n");
    let _ = writeln!(
        md,
        "Hit rates are the engines' own: counters (Σ `vllm:prefix_cache_hits_total` / Σ `…queries_total`) and, per request, \
         Σ `usage.prompt_tokens_details.cached_tokens` / Σ `prompt_tokens`. × ceiling uses the counters. Targets (issue 11) are judged on \
         `kvmesh_precise` (as shipped) and only on valid points. × fleet LRU (token workloads on simulators): the counters' hit rate ÷ \
         what one LRU cache of the whole fleet's capacity would hit of the same prompts in the same order — the ceiling's cache is \
         infinite, the engines' is not; near 1.0 the cache, not the placement, limits the hit rate (a reference, not a bound). \
         TTFT floor (token workloads on simulators): p90 over the point's requests of each one's uncached tokens on an engine \
         holding everything the ceiling counts as reused, prefilled alone at the engines' throughput — no router gives less.\n"
    );
    let _ = writeln!(md, "| workload | load point | policy | hit (counters) | hit (usage) | × ceiling | × fleet LRU | TTFT p90 ms | ÷ round_robin | ÷ approximate | ÷ floor (floor ms) | load max/mean | rejected | point | targets |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for w in &r.workloads {
        let Some(lp) = w.load_point() else {
            let _ = writeln!(
                md,
                "| {} | not found ({}) | | | | | | | | | | | | | |",
                w.workload, w.note
            );
            continue;
        };
        let rr = valid_at(w, POLICY_ROUND_ROBIN).and_then(|p| p.ttft_p90_ms);
        let ap = valid_at(w, POLICY_KVMESH_APPROXIMATE).and_then(|p| p.ttft_p90_ms);
        for policy in w.policies() {
            let Some(p) = w.at_load(&policy) else {
                continue;
            };
            let valid = p.valid();
            let (vp90, vhit) =
                if valid { (p.ttft_p90_ms, p.engine_hit_rate) } else { (None, None) };
            let status = if valid {
                "valid".to_string()
            } else {
                format!("**invalid**: {}", p.error.clone().unwrap_or_else(|| p.invalid.join(", ")))
            };
            let t =
                if policy == POLICY_KVMESH_PRECISE { verdicts(&targets(w)) } else { String::new() };
            let rejected =
                if p.requests > 0 { Some(p.rejected as f64 / p.requests as f64) } else { None };
            let at = match p.turns_per_s.filter(|_| p.window.has_warmup()) {
                Some(t) => format!("{lp:.3} {} ({t:.1} turns/s)", w.rate_unit),
                None => format!("{lp:.3} {}", w.rate_unit),
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                w.workload,
                at,
                policy,
                pct(vhit),
                pct(p.usage_hit_rate.filter(|_| valid)),
                f(vhit.and_then(|_| p.hit_over_ceiling()), 2),
                f(vhit.and_then(|_| p.hit_over_fleet_lru()), 2),
                f(vp90, 0),
                f(ratio(vp90, rr), 2),
                f(ratio(vp90, ap), 2),
                match p.ttft_floor_p90_ms {
                    Some(floor) => format!("{} ({floor:.0})", f(ratio(vp90, Some(floor)), 2)),
                    None => f(None, 0),
                },
                f(p.load_max_over_mean.filter(|_| valid), 3),
                pct(rejected),
                status,
                t
            );
        }
    }
    let at_load = r.workloads.iter().flat_map(|w| {
        w.policies()
            .into_iter()
            .filter_map(move |policy| Some((w.workload.as_str(), w.at_load(&policy)?)))
    });
    super::attribution::render(&mut md, at_load);
    for w in &r.workloads {
        let _ = writeln!(md, "\n### Workload `{}`\n\n{}.\n", w.workload, w.describe);
        if !w.fleet.is_empty() {
            let _ = writeln!(md, "Engines: {}.\n", w.fleet);
        }
        if w.window.has_warmup() {
            let _ = writeln!(
                md,
                "Steady state: sessions arrive at the rate ({}) from the start of a **{:.0}-s warm-up**, then a **{:.0}-s window**; \
                 only requests scheduled in the window count (requests = the window's; warm-up = sent before it, history for the \
                 caches and the ceiling), engine counters and CPU are deltas over the window, turns due after it are cut.\n",
                w.rate_unit, w.window.warmup_s, w.window.window_s
            );
        }
        match &w.saturation {
            Some(s) => {
                let _ = writeln!(
                    md,
                    "round_robin light-load TTFT p90 {:.0} ms; saturation (p90 > 3 × light) at **{:.3} {}**{}; load point **{:.3} {}**.",
                    s.light_p90_ms,
                    s.rate,
                    w.rate_unit,
                    if s.from_invalid_points { " (from invalid points: fewer than two valid ones)" } else { "" },
                    s.load_point(),
                    w.rate_unit
                );
            }
            None => {
                let _ = writeln!(md, "No saturation found: {}.", w.note);
            }
        }
        if plots {
            let (a, b) = plot_files(&w.workload);
            let _ = writeln!(md, "\n![TTFT p90 vs rate]({a}) ![engine hit rate vs rate]({b})");
        }
        let _ = writeln!(md, "\n| policy | rate | requests (warm-up / cut) | turns/s | ok | rejected | failed | TTFT p50/p90/p99 ms | ITL p50/p90 ms | out tok/s | hit counters / usage / ceiling / fleet LRU | preempt | load max/mean | CPU mean/max | lateness p90 ms | sim CPU-s / 1k req | point |");
        let _ =
            writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
        for p in &w.points {
            let mut status = match (&p.error, p.invalid.is_empty()) {
                (Some(e), _) => format!("did not run: {e}"),
                (None, true) => "valid".into(),
                (None, false) => format!("invalid: {}", p.invalid.join(", ")),
            };
            if p.above_ceiling() {
                status.push_str("; **engine hit rate above the ceiling** (token-weighted)");
            }
            let _ = writeln!(
                md,
                "| {} | {:.3} | {} | {} | {} | {} | {} | {} / {} / {} | {} / {} | {:.0} | {} / {} / {} / {} | {} | {} | {} / {} | {} | {} | {} |",
                p.policy,
                p.rate,
                if p.window.has_warmup() {
                    format!("{} ({} / {})", p.requests, p.warmup_requests, p.cut_turns)
                } else {
                    p.requests.to_string()
                },
                f(p.turns_per_s, 1),
                p.ok,
                p.rejected,
                p.failed,
                f(p.ttft_p50_ms, 0),
                f(p.ttft_p90_ms, 0),
                f(p.ttft_p99_ms, 0),
                f(p.itl_p50_ms, 1),
                f(p.itl_p90_ms, 1),
                p.output_tokens_per_s,
                pct(p.engine_hit_rate),
                pct(p.usage_hit_rate),
                pct(p.ceiling),
                pct(p.fleet_lru),
                f(p.preemptions, 0),
                f(p.load_max_over_mean, 3),
                pct(p.machine.cpu_busy_mean),
                pct(p.machine.cpu_busy_max),
                f(p.lateness_p90_ms, 1),
                f(p.sim_cpu_s_per_1k, 1),
                status
            );
        }
        render_per_model(&mut md, w);
    }
    md
}

/// The per-model table of a multi-model workload (nothing for the others).
fn render_per_model(md: &mut String, w: &WorkloadSweep) {
    if w.points.iter().all(|p| p.per_model.is_empty()) {
        return;
    }
    let _ = writeln!(
        md,
        "\nPer base model (its adapters' requests included; hit rates from its own workers' counters and its responses, \
         against the ceiling of its own sessions; load over its own workers; cross-model = its requests an engine answered \
         404, i.e. sent to a worker of another model):\n"
    );
    let _ = writeln!(md, "| policy | rate | model | workers | requests | ok | cross-model | hit counters / usage / ceiling | × ceiling | TTFT p90 ms | load max/mean |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|");
    for p in &w.points {
        for m in &p.per_model {
            let _ = writeln!(
                md,
                "| {} | {:.3} | {} | {} | {} | {} | {} | {} / {} / {} | {} | {} | {} |",
                p.policy,
                p.rate,
                m.model,
                m.workers.join(", "),
                m.requests,
                m.ok,
                m.cross_model,
                pct(m.engine_hit_rate),
                pct(m.usage_hit_rate),
                pct(m.ceiling),
                f(m.hit_over_ceiling(), 2),
                f(m.ttft_p90_ms, 0),
                f(m.load_max_over_mean, 3),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sweep::models::ModelPoint;
    use crate::sweep::MachineSample;

    fn point(policy: &str, rate: f64, p90: f64, hit: f64, valid: bool) -> PointResult {
        PointResult {
            workload: "trace".into(),
            policy: policy.into(),
            rate,
            requests: 100,
            ok: 100,
            ttft_p90_ms: Some(p90),
            engine_hit_rate: Some(hit),
            usage_hit_rate: Some(hit),
            ceiling: Some(0.30),
            fleet_lru: Some(0.25),
            ttft_floor_p90_ms: Some(150.0),
            load_max_over_mean: Some(1.1),
            machine: MachineSample { cpu_busy_mean: Some(0.5), ..Default::default() },
            invalid: if valid { vec![] } else { vec!["CPU 95% > 85%".into()] },
            ..Default::default()
        }
    }

    fn sweep(precise_valid: bool) -> WorkloadSweep {
        WorkloadSweep {
            workload: "trace".into(),
            describe: "d".into(),
            rate_unit: "requests/s".into(),
            fleet: "vllm-sim `--speedup 8`".into(),
            window: MeasureWindow::default(),
            saturation: Some(Saturation {
                rate: 5.0,
                light_p90_ms: 100.0,
                from_invalid_points: false,
            }),
            note: String::new(),
            points: vec![
                point(POLICY_ROUND_ROBIN, 1.0, 100.0, 0.1, true),
                point(POLICY_ROUND_ROBIN, 4.0, 400.0, 0.1, true),
                point(POLICY_KVMESH_APPROXIMATE, 4.0, 300.0, 0.2, true),
                point(POLICY_KVMESH_PRECISE, 4.0, 180.0, 0.28, precise_valid),
            ],
            replica_points: Vec::new(),
        }
    }

    #[test]
    fn targets_are_judged_at_the_load_point_on_valid_points_only() {
        let w = sweep(true);
        assert_eq!(w.load_point(), Some(4.0));
        let t = targets(&w);
        assert_eq!(t.len(), 4);
        // 0.28 / 0.30 = 0.93 ≥ 0.90; 180/400 = 0.45 ≤ 0.5; 180/300 = 0.6 ≤ 0.8; 1.1 ≤ 1.25.
        assert!(t.iter().all(|j| j.met == Some(true)), "{t:?}");
        let t = targets(&sweep(false));
        assert!(t.iter().all(|j| j.met.is_none()), "an invalid point is not judged: {t:?}");
        let mut cold = sweep(true);
        cold.workload = "cold".into();
        assert_eq!(targets(&cold)[0].met, None, "least_request not measured");
        cold.workload = "siblings".into();
        assert!(targets(&cold).is_empty());
    }

    fn model(name: &str, p90: f64, hit: f64, load: f64, cross: usize) -> ModelPoint {
        ModelPoint {
            model: name.into(),
            workers: vec!["w0".into(), "w1".into()],
            requests: 50,
            ok: 50 - cross,
            ttft_p90_ms: Some(p90),
            engine_hit_rate: Some(hit),
            usage_hit_rate: Some(hit),
            ceiling: Some(0.9),
            load_max_over_mean: Some(load),
            cross_model: cross,
        }
    }

    #[test]
    fn models_targets_take_the_worst_model_and_count_cross_model_requests() {
        let mut w = sweep(true);
        w.workload = "models".into();
        let (rr, precise) = (1, 3);
        w.points[rr].per_model =
            vec![model("a", 1000.0, 0.3, 1.0, 0), model("b", 800.0, 0.3, 1.0, 0)];
        w.points[precise].per_model =
            vec![model("a", 400.0, 0.85, 1.1, 0), model("b", 300.0, 0.80, 1.3, 0)];
        w.points[precise].cross_model = Some(0);
        let t = targets(&w);
        let met: Vec<Option<bool>> = t.iter().map(|j| j.met).collect();
        // b: 0.80 / 0.9 = 0.89 < 0.90; worst TTFT ratio 400/1000 = 0.4 (b: 0.375); b's load 1.3.
        assert_eq!(met, vec![Some(false), Some(true), Some(false), Some(true)], "{t:?}");
        assert_eq!(t[0].measured, "0.89");
        w.points[precise].cross_model = Some(3);
        assert_eq!(targets(&w)[3].met, Some(false));
        // A point without per-model numbers is not judged.
        w.points[precise].per_model.clear();
        assert!(targets(&w)[..3].iter().all(|j| j.met.is_none()));
        w.points[precise].per_model = vec![model("a", 400.0, 0.85, 1.1, 2)];
        let md = render(&SweepReport { settings: vec![], workloads: vec![w] }, false);
        assert!(md.contains("Per base model"), "{md}");
        assert!(md.contains("| kvmesh_precise | 4.000 | a | w0, w1 | 50 | 48 | 2 | 85.0% / 85.0% / 90.0% | 0.94 | 400 | 1.100 |"), "{md}");
        assert!(!render(&SweepReport { settings: vec![], workloads: vec![sweep(true)] }, false)
            .contains("Per base model"));
    }

    #[test]
    fn render_shows_headline_points_and_invalid_marks() {
        let r = SweepReport {
            settings: vec!["speed-up 1".into()],
            workloads: vec![
                sweep(false),
                WorkloadSweep {
                    workload: "cold".into(),
                    note: "gave up after 3 steps".into(),
                    ..Default::default()
                },
            ],
        };
        let md = render(&r, true);
        assert!(md.contains("- speed-up 1"));
        assert!(md.contains("| trace | 4.000 requests/s | round_robin |"), "{md}");
        // approximate's hit 20.0 % ÷ ceiling 30 %, ÷ fleet LRU 25 %; the invalid point shows neither.
        assert!(md.contains("| kvmesh_approximate | 20.0% | 20.0% | 0.67 | 0.80 | 300 | 0.75 | 1.00 | 2.00 (150) |"), "{md}");
        assert!(md.contains("| 10.0% / 10.0% / 30.0% / 25.0% |"), "{md}");
        assert!(md.contains("**invalid**: CPU 95% > 85%"), "{md}");
        assert!(md.contains("not found (gave up after 3 steps)"));
        assert!(md.contains("sweep_trace_ttft_p90.png"));
        // The workload's engine timing is stated in its section; none for the one without.
        assert_eq!(md.matches("Engines: vllm-sim `--speedup 8`.").count(), 1, "{md}");
        assert_eq!(md.matches("Engines:").count(), 1);
        // Every point is listed, invalid ones marked.
        assert_eq!(md.matches("| kvmesh_precise | 4.000 |").count(), 1);
        assert!(md.contains("invalid: CPU 95% > 85%"));
        assert!(!md.contains("Steady state"), "no warm-up on the plain workloads");
    }

    #[test]
    fn steady_state_points_state_their_window_and_turns() {
        let win = MeasureWindow { warmup_s: 24.0, window_s: 20.0, steady: true };
        let mut w = sweep(true);
        w.workload = "agentic".into();
        w.rate_unit = "sessions/s".into();
        w.window = win;
        w.points = w
            .points
            .into_iter()
            .map(|p| PointResult { requests: 300, ..p }.with_window(win, 120, 45))
            .collect();
        let md = render(&SweepReport { settings: vec![], workloads: vec![w] }, false);
        assert!(md.contains("**24-s warm-up**, then a **20-s window**"), "{md}");
        // The headline's load point states turns/s (300 requests / 20 s); each point its counts.
        assert!(md.contains("| agentic | 4.000 sessions/s (15.0 turns/s) | round_robin |"), "{md}");
        assert!(md.contains("| kvmesh_precise | 4.000 | 300 (120 / 45) | 15.0 |"), "{md}");
    }
}
