//! Summary statistics used by the report: percentiles, empirical CDFs, load balance (pure).
//!
//! Percentiles use the nearest-rank definition (the smallest sample with at least p% of the
//! samples at or below it): always an observed value, no interpolation, well defined for one
//! sample. NaNs never enter: callers pass finite latencies only, and the functions drop
//! non-finite values defensively rather than panic in a sort.

use std::collections::BTreeMap;

/// Sorted finite copy of `values`.
pub fn sorted(values: &[f64]) -> Vec<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// Nearest-rank percentile `p` (0..=100) of already sorted values; `None` when empty.
pub fn percentile_sorted(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let p = p.clamp(0.0, 100.0);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    let i = rank.saturating_sub(1).min(sorted.len() - 1);
    sorted.get(i).copied()
}

/// Nearest-rank percentile of unsorted values.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    percentile_sorted(&sorted(values), p)
}

/// Empirical CDF as `(value, fraction ≤ value)` points, at most `max_points` of them (evenly
/// spaced in rank, always including the last), so plots stay small for long runs.
pub fn cdf(values: &[f64], max_points: usize) -> Vec<(f64, f64)> {
    let s = sorted(values);
    let n = s.len();
    if n == 0 || max_points == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(max_points).max(1);
    let mut out: Vec<(f64, f64)> =
        (0..n).step_by(step).map(|i| (s[i], (i + 1) as f64 / n as f64)).collect();
    if out.last().map(|&(_, f)| f < 1.0).unwrap_or(true) {
        out.push((s[n - 1], 1.0));
    }
    out
}

/// Load balance over a fleet: per-worker totals and the max/mean ratio.
#[derive(Debug, Clone, PartialEq)]
pub struct Balance {
    /// Totals per worker, including fleet workers that got nothing (they count as 0).
    pub per_worker: BTreeMap<String, f64>,
    /// Mean over the workers in `per_worker`.
    pub mean: f64,
    /// Largest per-worker total.
    pub max: f64,
}

impl Balance {
    /// `max / mean`; 1.0 is perfect balance. `None` when nothing was served.
    pub fn max_over_mean(&self) -> Option<f64> {
        (self.mean > 0.0).then(|| self.max / self.mean)
    }
}

/// Balance of `(worker, amount)` samples over `fleet` (workers that served nothing count as 0;
/// workers seen in the samples but not in `fleet` are added, so nothing is hidden).
pub fn balance<'a, I>(samples: I, fleet: &[String]) -> Balance
where
    I: IntoIterator<Item = (&'a str, f64)>,
{
    let mut per_worker: BTreeMap<String, f64> = fleet.iter().map(|w| (w.clone(), 0.0)).collect();
    for (w, x) in samples {
        *per_worker.entry(w.to_string()).or_insert(0.0) += x;
    }
    let n = per_worker.len();
    let total: f64 = per_worker.values().sum();
    let mean = if n == 0 { 0.0 } else { total / n as f64 };
    let max = per_worker.values().copied().fold(0.0, f64::max);
    Balance { per_worker, mean, max }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_table() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        let cases = [
            (0.0, 1.0),
            (10.0, 1.0),
            (50.0, 5.0),
            (90.0, 9.0),
            (99.0, 10.0),
            (100.0, 10.0),
            (55.0, 6.0),
        ];
        for (p, want) in cases {
            assert_eq!(percentile(&v, p), Some(want), "p{p}");
        }
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
        assert_eq!(percentile(&[f64::NAN, 2.0, f64::INFINITY], 100.0), Some(2.0));
        // Order does not matter.
        assert_eq!(percentile(&[5.0, 1.0, 3.0], 50.0), Some(3.0));
    }

    #[test]
    fn cdf_is_monotone_and_ends_at_one() {
        let v: Vec<f64> = (0..1000).rev().map(f64::from).collect();
        let c = cdf(&v, 50);
        assert!(c.len() <= 51);
        assert_eq!(*c.last().unwrap(), (999.0, 1.0));
        assert!(c.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
        assert_eq!(cdf(&[2.0, 1.0], 10), vec![(1.0, 0.5), (2.0, 1.0)]);
        assert!(cdf(&[], 10).is_empty());
    }

    #[test]
    fn balance_counts_idle_workers() {
        let fleet: Vec<String> = ["w0", "w1", "w2", "w3"].iter().map(|s| s.to_string()).collect();
        let b = balance([("w0", 3.0), ("w1", 1.0), ("w0", 2.0)], &fleet);
        assert_eq!(b.per_worker["w2"], 0.0);
        assert_eq!(b.mean, 1.5);
        assert_eq!(b.max, 5.0);
        assert!((b.max_over_mean().unwrap() - 5.0 / 1.5).abs() < 1e-12);
        let b = balance([("stranger", 2.0)], &fleet);
        assert_eq!(b.per_worker.len(), 5);
        assert_eq!(balance(std::iter::empty(), &fleet).max_over_mean(), None);
    }
}
