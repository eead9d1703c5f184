//! Machine CPU use during a sweep point: `/proc/stat` parsing (pure) and a sampler task (thin).
//!
//! The first `cpu` line of `/proc/stat` holds the machine's cumulative jiffies per state; busy is
//! everything except `idle` and `iowait`. The sampler reads it every `interval` while a point
//! runs and keeps the per-interval busy fractions; the point's validity uses their mean (over
//! the whole point, = Δbusy / Δtotal of the first and last reading) and the report shows the
//! highest interval too. Process CPU (the simulators') comes from
//! `overhead::drive::cpu_ticks` (`/proc/<pid>/stat`), the one reader of that file.

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Cumulative jiffies of the whole machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    /// Non-idle jiffies.
    pub busy: u64,
    /// All jiffies.
    pub total: u64,
}

/// Parses the aggregate `cpu` line of `/proc/stat`.
pub fn parse_proc_stat(text: &str) -> Option<CpuTimes> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> =
        line.split_whitespace().skip(1).map(|x| x.parse().ok()).collect::<Option<Vec<_>>>()?;
    if v.len() < 4 {
        return None;
    }
    // user nice system idle iowait irq softirq steal (guest is already inside user).
    let total: u64 = v.iter().take(8).sum();
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some(CpuTimes { busy: total.saturating_sub(idle), total })
}

/// Busy fraction between two readings (`None` when no time passed).
pub fn busy_between(a: CpuTimes, b: CpuTimes) -> Option<f64> {
    let dt = b.total.checked_sub(a.total)?;
    (dt > 0).then(|| b.busy.saturating_sub(a.busy) as f64 / dt as f64)
}

/// Reads `/proc/stat` (`None` off Linux).
pub fn read() -> Option<CpuTimes> {
    parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// A running sampler; [`Sampler::finish`] stops it and returns (mean, max) busy fractions.
pub struct Sampler {
    first: Option<CpuTimes>,
    samples: Arc<Mutex<Vec<f64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    /// Starts sampling every `interval`.
    pub fn start(interval: Duration) -> Self {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let first = read();
        let s = samples.clone();
        let task = tokio::spawn(async move {
            let mut prev = first;
            loop {
                tokio::time::sleep(interval).await;
                let now = read();
                if let (Some(a), Some(b)) = (prev, now) {
                    if let (Some(x), Ok(mut v)) = (busy_between(a, b), s.lock()) {
                        v.push(x);
                    }
                }
                prev = now;
            }
        });
        Self { first, samples, task }
    }

    /// Stops the sampler: `(mean over the whole span, highest interval)`.
    pub fn finish(self) -> (Option<f64>, Option<f64>) {
        self.task.abort();
        let mean = match (self.first, read()) {
            (Some(a), Some(b)) => busy_between(a, b),
            _ => None,
        };
        let max = self.samples.lock().ok().and_then(|v| v.iter().copied().reduce(f64::max));
        (mean, max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_table() {
        let text = "cpu  100 5 50 800 20 3 2 0 0 0\ncpu0 50 2 25 400 10 1 1 0 0 0\nintr 1\n";
        assert_eq!(parse_proc_stat(text), Some(CpuTimes { busy: 160, total: 980 }));
        assert_eq!(parse_proc_stat("cpu0 1 2 3 4\n"), None, "only the aggregate line");
        assert_eq!(parse_proc_stat("cpu  1 x 3 4\n"), None);
        assert_eq!(parse_proc_stat("cpu  1 2\n"), None);
        let a = CpuTimes { busy: 100, total: 1000 };
        assert_eq!(busy_between(a, CpuTimes { busy: 190, total: 1100 }), Some(0.9));
        assert_eq!(busy_between(a, a), None);
        assert_eq!(
            busy_between(CpuTimes { busy: 0, total: 5 }, CpuTimes { busy: 0, total: 1 }),
            None
        );
    }

    #[tokio::test]
    async fn sampler_reports_a_fraction() {
        let s = Sampler::start(Duration::from_millis(20));
        let spin = std::time::Instant::now();
        while spin.elapsed() < Duration::from_millis(120) {
            std::hint::black_box(0u64);
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        let (mean, max) = s.finish();
        assert!(mean.is_some_and(|m| (0.0..=1.0).contains(&m)), "{mean:?}");
        assert!(max.is_none_or(|m| (0.0..=1.0).contains(&m)), "{max:?}");
    }
}
