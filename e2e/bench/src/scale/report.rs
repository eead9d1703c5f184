//! The scale run's figures (pure): what was measured, fitted and projected, as JSON and as the
//! Markdown table of `scale.md`. Histogram quantiles come from two readings of an indexer
//! histogram (its buckets' increase between them, interpolated within a bucket as Prometheus'
//! `histogram_quantile` does).

use serde::Serialize;

use super::model::ModelParams;
use super::procfs::ProcSample;

/// Linux's user-space clock tick (`/proc/<pid>/stat` CPU times).
pub const TICKS_PER_S: f64 = 100.0;

/// The targets at 1,000 workers × 64k blocks each.
pub const TARGET_INDEX_BYTES: f64 = 4.0 * 1024.0 * 1024.0 * 1024.0;
pub const TARGET_APPLY_OPS_PER_CPU_S: f64 = 5.0e6;
pub const TARGET_FIND_MATCHES_P99_US: f64 = 10.0;
pub const TARGET_ROUTE_P99_MS: f64 = 2.0;

#[derive(Debug, Clone, Default, Serialize)]
pub struct Startup {
    /// Spawn to `/readyz` 200 (start-up replays done), seconds.
    pub ready_s: f64,
    pub at_ready: ProcSample,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Idle {
    pub seconds: f64,
    /// CPU of the whole process, its listeners and its applier, in cores.
    pub cpu_cores: f64,
    pub listener_cores: f64,
    pub applier_cores: f64,
    pub sample: ProcSample,
    /// Size of the indexer's own `/metrics` answer.
    pub metrics_bytes: usize,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Stage {
    /// Blocks each worker was filled to.
    pub target_blocks: u32,
    /// The index's own gauges: (block, worker) entries, unique blocks, estimated bytes.
    pub entries: f64,
    pub blocks: f64,
    pub index_bytes: f64,
    pub sample: ProcSample,
    pub fill_s: f64,
    pub block_ops: u64,
    pub cpu_s: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Blast {
    pub name: String,
    pub batches: u64,
    pub block_ops: u64,
    pub bytes: u64,
    pub wall_s: f64,
    pub cpu_s: f64,
    pub applier_s: f64,
    pub listener_s: f64,
}

impl Blast {
    pub fn ops_per_s(&self) -> f64 {
        per(self.block_ops as f64, self.wall_s)
    }
    pub fn ops_per_cpu_s(&self) -> f64 {
        per(self.block_ops as f64, self.cpu_s)
    }
    pub fn ops_per_applier_s(&self) -> f64 {
        per(self.block_ops as f64, self.applier_s)
    }
}

fn per(x: f64, s: f64) -> f64 {
    if s > 0.0 {
        x / s
    } else {
        0.0
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Routes {
    pub name: String,
    pub samples: usize,
    /// Client-side (request sent → answer read), ms.
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Continuations whose best overlap covered the held history.
    pub matched: usize,
    pub history_blocks_min: usize,
    /// `kvmesh_match_duration_seconds` (hashing + `find_matches`) and
    /// `kvmesh_route_duration_seconds` over the samples, from their buckets.
    pub match_p50_us: Option<f64>,
    pub match_p99_us: Option<f64>,
    pub route_p50_ms: Option<f64>,
    pub route_p99_ms: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Storm {
    pub replicas: usize,
    /// Each replica's spawn → `/readyz` 200, seconds (`None`: not ready within the patience).
    pub ready_s: Vec<Option<f64>>,
    pub replay_requests: u64,
    pub replayed_batches: u64,
    pub replayed_bytes: u64,
    /// Summed over the replicas: replays by outcome, replay rounds asked again.
    pub replays_complete: f64,
    pub replays_truncated: f64,
    pub replays_failed: f64,
    pub rounds_again: f64,
    pub peak_rss_bytes: u64,
}

/// Everything one run measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScaleReport {
    pub workers: u32,
    pub params: Option<ModelParams>,
    pub ring_batches: usize,
    pub metrics_body_bytes: usize,
    pub indexer: String,
    pub startup: Startup,
    pub idle: Idle,
    pub stages: Vec<Stage>,
    pub blasts: Vec<Blast>,
    pub routes: Vec<Routes>,
    pub storms: Vec<Storm>,
    pub notes: Vec<String>,
}

/// Cumulative bucket counts of one histogram, `(upper bound, count)`, ascending (`+Inf` last).
pub type Buckets = Vec<(f64, f64)>;

/// The `q` quantile of what fell into the histogram between readings `before` and `after`
/// (same bounds), interpolated within its bucket; `None` when nothing fell in.
pub fn quantile(before: &Buckets, after: &Buckets, q: f64) -> Option<f64> {
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, n)| {
            let was = before.iter().find(|(b, _)| b == le).map_or(0.0, |(_, c)| *c);
            (*le, n - was)
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, n) in &delta {
        if n >= rank {
            if le.is_infinite() {
                return Some(lower.0);
            }
            let span = n - lower.1;
            let frac = if span > 0.0 { (rank - lower.1) / span } else { 1.0 };
            return Some(lower.0 + (le - lower.0) * frac);
        }
        lower = (le, n);
    }
    Some(lower.0)
}

/// Least-squares line `y = a + b·x`: `(a, b)`; `None` with fewer than two distinct x.
pub fn fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let (sx, sy) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx).powi(2)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let b = sxy / sxx;
    Some((my - b * mx, b))
}

const MIB: f64 = 1024.0 * 1024.0;

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".into(), |x| format!("{x:.digits$}"))
}

impl ScaleReport {
    /// RSS against (block, worker) entries and against unique blocks over the fill stages:
    /// `(bytes per entry, bytes per unique block)` (each from its own one-variable fit).
    pub fn memory_slopes(&self) -> (Option<f64>, Option<f64>) {
        let by = |f: fn(&Stage) -> f64| {
            let pts: Vec<(f64, f64)> =
                self.stages.iter().map(|s| (f(s), s.sample.rss_bytes as f64)).collect();
            fit(&pts).map(|(_, b)| b)
        };
        (by(|s| s.entries), by(|s| s.blocks))
    }

    /// The Markdown of `scale.md`.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let p = self.params;
        s.push_str(&format!(
            "# Scale: {} workers, one indexer\n\nIndexer `{}`; {} blocks per worker when full, block size {}; replay rings of {} batches; `/metrics` bodies of {} bytes.\n\n",
            self.workers,
            self.indexer,
            p.map_or(0, |p| p.capacity),
            p.map_or(0, |p| p.block_size),
            self.ring_batches,
            self.metrics_body_bytes,
        ));
        let st = &self.startup;
        let i = &self.idle;
        s.push_str(&format!(
            "## Subscriptions\n\n| ready after | fds | threads | RSS MiB | idle CPU (cores) | of which listeners | applier | own /metrics |\n|---|---|---|---|---|---|---|---|\n| {:.1} s | {} | {} | {:.0} | {:.3} | {:.3} | {:.3} | {:.1} MiB |\n\n",
            st.ready_s,
            i.sample.fds,
            i.sample.threads,
            i.sample.rss_bytes as f64 / MIB,
            i.cpu_cores,
            i.listener_cores,
            i.applier_cores,
            i.metrics_bytes as f64 / MIB,
        ));
        s.push_str("## Memory\n\n| blocks per worker | entries (block, worker) | unique blocks | entries / block | index gauge MiB | RSS MiB | fill s | fill block-ops/s | per indexer CPU-s |\n|---|---|---|---|---|---|---|---|---|\n");
        for g in &self.stages {
            s.push_str(&format!(
                "| {} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |\n",
                g.target_blocks,
                g.entries,
                g.blocks,
                per(g.entries, g.blocks),
                g.index_bytes / MIB,
                g.sample.rss_bytes as f64 / MIB,
                g.fill_s,
                per(g.block_ops as f64, g.fill_s),
                per(g.block_ops as f64, g.cpu_s),
            ));
        }
        let (per_entry, per_block) = self.memory_slopes();
        s.push_str(&format!(
            "\nRSS slope: {} bytes per (block, worker) entry, {} bytes per unique block (each a least-squares line over the stages).\n\n",
            opt(per_entry, 1),
            opt(per_block, 1)
        ));
        s.push_str("## Apply throughput (prepared batches sent at once, decoding included)\n\n| blast | batches | block-ops | MB | wall s | block-ops/s | per indexer CPU-s | per applier CPU-s | listeners CPU-s |\n|---|---|---|---|---|---|---|---|---|\n");
        for b in &self.blasts {
            s.push_str(&format!(
                "| {} | {} | {} | {:.1} | {:.2} | {:.0} | {:.0} | {:.0} | {:.2} |\n",
                b.name,
                b.batches,
                b.block_ops,
                b.bytes as f64 / 1e6,
                b.wall_s,
                b.ops_per_s(),
                b.ops_per_cpu_s(),
                b.ops_per_applier_s(),
                b.listener_s,
            ));
        }
        s.push_str("\n## Routes (8k continuations, POST /v1/route)\n\n| case | samples | client p50 / p99 ms | server p50 / p99 ms | match (hash + find_matches) p50 / p99 µs | full overlap found |\n|---|---|---|---|---|---|\n");
        for r in &self.routes {
            s.push_str(&format!(
                "| {} | {} | {:.2} / {:.2} | {} / {} | {} / {} | {} of {} (≥ {} blocks) |\n",
                r.name,
                r.samples,
                r.p50_ms,
                r.p99_ms,
                opt(r.route_p50_ms, 2),
                opt(r.route_p99_ms, 2),
                opt(r.match_p50_us, 1),
                opt(r.match_p99_us, 1),
                r.matched,
                r.samples,
                r.history_blocks_min,
            ));
        }
        if !self.storms.is_empty() {
            s.push_str("\n## Replay storm (R fresh indexers started at once on the same publishers)\n\n| R | ready s (slowest) | replay requests | batches replayed | MB replayed | complete / truncated / failed | rounds asked again | peak RSS MiB |\n|---|---|---|---|---|---|---|---|\n");
            for m in &self.storms {
                let slowest =
                    m.ready_s.iter().map(|r| r.unwrap_or(f64::INFINITY)).fold(0.0, f64::max);
                s.push_str(&format!(
                    "| {} | {:.1} | {} | {} | {:.1} | {:.0} / {:.0} / {:.0} | {:.0} | {:.0} |\n",
                    m.replicas,
                    slowest,
                    m.replay_requests,
                    m.replayed_batches,
                    m.replayed_bytes as f64 / 1e6,
                    m.replays_complete,
                    m.replays_truncated,
                    m.replays_failed,
                    m.rounds_again,
                    m.peak_rss_bytes as f64 / MIB,
                ));
            }
        }
        if !self.notes.is_empty() {
            s.push_str("\n## Notes\n\n");
            for n in &self.notes {
                s.push_str(&format!("- {n}\n"));
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_the_bucket_of_the_increase() {
        let before = vec![(1.0, 10.0), (2.0, 10.0), (4.0, 10.0), (f64::INFINITY, 10.0)];
        let after = vec![(1.0, 10.0), (2.0, 60.0), (4.0, 110.0), (f64::INFINITY, 110.0)];
        // 100 new observations: 50 in (1, 2], 50 in (2, 4].
        assert_eq!(quantile(&before, &after, 0.5), Some(2.0));
        assert_eq!(quantile(&before, &after, 0.25), Some(1.5));
        assert_eq!(quantile(&before, &after, 0.99), Some(2.0 + 2.0 * 49.0 / 50.0));
        assert_eq!(quantile(&after, &after, 0.5), None);
        let inf = vec![(1.0, 0.0), (f64::INFINITY, 5.0)];
        assert_eq!(quantile(&Vec::new(), &inf, 0.9), Some(1.0), "+Inf bucket: its lower bound");
    }

    #[test]
    fn fits_a_line() {
        let (a, b) = fit(&[(1.0, 12.0), (2.0, 22.0), (4.0, 42.0)]).unwrap();
        assert!((a - 2.0).abs() < 1e-9 && (b - 10.0).abs() < 1e-9);
        assert_eq!(fit(&[(1.0, 1.0)]), None);
        assert_eq!(fit(&[(1.0, 1.0), (1.0, 2.0)]), None);
    }

    #[test]
    fn markdown_has_every_section() {
        let r = ScaleReport {
            workers: 10,
            stages: vec![Stage {
                target_blocks: 5,
                entries: 50.0,
                blocks: 40.0,
                ..Default::default()
            }],
            blasts: vec![Blast {
                name: "a".into(),
                block_ops: 10,
                wall_s: 2.0,
                ..Default::default()
            }],
            routes: vec![Routes { name: "idle".into(), samples: 3, ..Default::default() }],
            storms: vec![Storm {
                replicas: 2,
                ready_s: vec![Some(1.0), Some(2.5)],
                ..Default::default()
            }],
            ..Default::default()
        };
        let md = r.markdown();
        for part in [
            "## Subscriptions",
            "## Memory",
            "| 5 | 50 | 40 | 1.25 |",
            "| a | 0 | 10 |",
            "## Routes",
            "| 2 | 2.5 |",
        ] {
            assert!(md.contains(part), "{part} in\n{md}");
        }
    }
}
