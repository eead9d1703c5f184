//! The sweep's gateway-replica section (pure; issue 47, points 1 and 2): per workload, every
//! policy at N gateway replicas against its own one-gateway point at the same rate — the replica
//! curve's table and its plot series — and the lost-events points (a replica's indexer stalled or
//! restarted: time to recover, hits lost).
//!
//! Issue 47's bar, judged on `kvmesh_precise` at every N > 1 against its one-gateway point at the
//! same rate, valid points only: hit ≥ [`MIN_HIT_VS_ONE`] × the one-gateway hit, TTFT p90 ≤
//! [`MAX_P90_VS_ONE`] × the one-gateway p90, load max/mean ≤ [`MAX_LOAD_MAX_OVER_MEAN`].

use super::plots::RateSeries;
use super::sweep::{SweepReport, WorkloadSweep};
use super::targets::POLICY_KVMESH_PRECISE;
use crate::sweep::PointResult;
use std::fmt::Write;

/// Hit at N replicas ÷ hit at one gateway, at least.
pub const MIN_HIT_VS_ONE: f64 = 0.95;
/// TTFT p90 at N replicas ÷ at one gateway, at most.
pub const MAX_P90_VS_ONE: f64 = 1.15;
/// Load max/mean at N replicas, at most.
pub const MAX_LOAD_MAX_OVER_MEAN: f64 = 1.25;

/// Plot file names of a workload's replica curve: (hit × ceiling vs N, TTFT p90 vs N).
pub fn plot_files(workload: &str) -> (String, String) {
    (format!("sweep_{workload}_replicas_hit.png"), format!("sweep_{workload}_replicas_ttft.png"))
}

/// The replica-curve points of a workload (the lost-events points are not on the curve).
fn curve_points(w: &WorkloadSweep) -> impl Iterator<Item = &PointResult> {
    w.replica_points.iter().filter(|p| p.lost_events.is_none())
}

/// `policy`'s one-gateway point at `rate`, if measured.
pub fn one_gateway<'a>(w: &'a WorkloadSweep, policy: &str, rate: f64) -> Option<&'a PointResult> {
    w.points.iter().find(|p| {
        p.policy == policy && p.replicas.single() && (p.rate - rate).abs() <= 1e-6 * rate.max(1e-9)
    })
}

/// The replica curve's series of one value (`value` of a valid point; invalid points are drawn
/// hollow): one line per (policy, spread), x = replicas, starting from the policy's one-gateway
/// point at the same rate.
pub fn curve_series(
    w: &WorkloadSweep,
    value: &dyn Fn(&PointResult) -> Option<f64>,
) -> Vec<RateSeries> {
    let mut keys: Vec<(String, String, f64)> = Vec::new();
    for p in curve_points(w) {
        let key = (p.policy.clone(), p.replicas.spread.name().to_owned(), p.rate);
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    keys.into_iter()
        .map(|(policy, spread, rate)| {
            let one = one_gateway(w, &policy, rate).into_iter();
            let many = curve_points(w).filter(|p| {
                p.policy == policy && p.replicas.spread.name() == spread && p.rate == rate
            });
            RateSeries {
                points: one
                    .chain(many)
                    .filter_map(|p| value(p).map(|v| (p.replicas.count as f64, v, p.valid())))
                    .collect(),
                label: format!("{policy} ({spread})"),
            }
        })
        .filter(|s| !s.points.is_empty())
        .collect()
}

/// Issue 47's bar for one kvmesh_precise point at N > 1 (`None`: not judged — an invalid point or
/// no valid one-gateway point).
pub fn verdict(w: &WorkloadSweep, p: &PointResult) -> Option<String> {
    if p.policy != POLICY_KVMESH_PRECISE || p.replicas.single() || !p.valid() {
        return None;
    }
    let one = one_gateway(w, &p.policy, p.rate).filter(|o| o.valid())?;
    let hit = ratio(p.engine_hit_rate, one.engine_hit_rate)?;
    let p90 = ratio(p.ttft_p90_ms, one.ttft_p90_ms)?;
    let load = p.load_max_over_mean?;
    let mark = |ok: bool| if ok { "met" } else { "**missed**" };
    Some(format!(
        "hit ÷ 1 gw {hit:.2} (≥ {MIN_HIT_VS_ONE}: {}); p90 ÷ 1 gw {p90:.2} (≤ {MAX_P90_VS_ONE}: {}); max/mean {load:.2} (≤ {MAX_LOAD_MAX_OVER_MEAN}: {})",
        mark(hit >= MIN_HIT_VS_ONE),
        mark(p90 <= MAX_P90_VS_ONE),
        mark(load <= MAX_LOAD_MAX_OVER_MEAN)
    ))
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn f(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "n/a".into(), |x| format!("{x:.digits$}"))
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".into(), |x| format!("{:.1}%", x * 100.0))
}

fn status(p: &PointResult) -> String {
    match (&p.error, p.invalid.is_empty()) {
        (Some(e), _) => format!("did not run: {e}"),
        (None, true) => "valid".into(),
        (None, false) => format!("**invalid**: {}", p.invalid.join(", ")),
    }
}

fn moves(p: &PointResult) -> String {
    match p.session_moves {
        Some(m) => format!("{} / {} ({})", m.moves, m.follow_ups, pct(m.rate())),
        None => "n/a".into(),
    }
}

/// One row of the curve's table.
fn curve_row(md: &mut String, w: &WorkloadSweep, p: &PointResult) {
    let one = one_gateway(w, &p.policy, p.rate);
    let vs_one = |v: &dyn Fn(&PointResult) -> Option<f64>| {
        if p.replicas.single() {
            return f(v(p).map(|_| 1.0), 2);
        }
        f(ratio(v(p), one.and_then(v)), 2)
    };
    let _ = writeln!(
        md,
        "| {} | {} | {} | {:.3} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
        p.replicas.count,
        if p.replicas.single() { "—" } else { p.replicas.spread.name() },
        p.policy,
        p.rate,
        pct(p.engine_hit_rate),
        f(p.hit_over_ceiling(), 2),
        vs_one(&|x: &PointResult| x.engine_hit_rate),
        f(p.ttft_p90_ms, 0),
        vs_one(&|x: &PointResult| x.ttft_p90_ms),
        f(p.load_max_over_mean, 3),
        f(p.load_cov, 3),
        moves(p),
        status(p),
        verdict(w, p).unwrap_or_default()
    );
}

/// The replica section (Markdown), empty when no workload ran replicas. `plots`: the curve's plot
/// files were written.
pub fn render(r: &SweepReport, plots: bool) -> String {
    let mut md = String::new();
    for w in r.workloads.iter().filter(|w| !w.replica_points.is_empty()) {
        let _ = writeln!(md, "\n### Gateway replicas: `{}`\n", w.workload);
        let curve: Vec<&PointResult> = curve_points(w).collect();
        if !curve.is_empty() {
            let _ = writeln!(
                md,
                "Each policy at N gateway replicas (each an Envoy with the filter and, under kvmesh, its own indexer subscribed to \
                 every engine's events and scraping every engine) over the same engines, against its own one-gateway point at the \
                 same rate (N = 1). Spread: per-connection = every turn of a session to one replica (sessions round robin in start \
                 order), per-request = requests round robin in send order. Session moves = follow-up turns served by another worker \
                 than the session's previous turn. Load = prompt tokens per worker (max/mean, CoV). Bar (issue 47, `kvmesh_precise`, \
                 valid points): hit ≥ {MIN_HIT_VS_ONE} × and TTFT p90 ≤ {MAX_P90_VS_ONE} × the one-gateway point's, max/mean ≤ \
                 {MAX_LOAD_MAX_OVER_MEAN}.\n"
            );
            if plots {
                let (a, b) = plot_files(&w.workload);
                let _ = writeln!(
                    md,
                    "![hit × ceiling vs replicas]({a}) ![TTFT p90 vs replicas]({b})\n"
                );
            }
            let _ = writeln!(md, "| N | spread | policy | rate | hit (counters) | × ceiling | hit ÷ 1 gw | TTFT p90 ms | p90 ÷ 1 gw | load max/mean | load CoV | session moves | point | bar |");
            let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
            let mut shown: Vec<(&str, f64)> = Vec::new();
            for p in &curve {
                if shown.iter().any(|(pol, r)| *pol == p.policy && *r == p.rate) {
                    continue;
                }
                shown.push((p.policy.as_str(), p.rate));
                if let Some(one) = one_gateway(w, &p.policy, p.rate) {
                    curve_row(&mut md, w, one);
                }
                for q in curve.iter().filter(|q| q.policy == p.policy && q.rate == p.rate) {
                    curve_row(&mut md, w, q);
                }
            }
        }
        render_lost(&mut md, w);
    }
    md
}

/// A stall after which the indexer counted no sequence gap lost no event: its row measures
/// nothing but the stall (raise `--stall-s` or the rate).
fn no_loss(l: &crate::sweep::lost_events::LostEvents) -> &'static str {
    let gaps = l.indexer.iter().find(|(k, _)| k == "gaps").map(|(_, v)| *v);
    if l.fault == "stall" && gaps == Some(0.0) {
        "; **no gap: the stall lost no event**"
    } else {
        ""
    }
}

/// The lost-events table of a workload (nothing when it has no such point).
fn render_lost(md: &mut String, w: &WorkloadSweep) {
    let lost: Vec<(&PointResult, &crate::sweep::lost_events::LostEvents)> =
        w.replica_points.iter().filter_map(|p| Some((p, p.lost_events.as_ref()?))).collect();
    if lost.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "\n**Lost events.** One replica's indexer stalled (SIGSTOP past the engines' PUB high-water mark, then SIGCONT) or \
         restarted (SIGKILL, a new process, its start-up replay) mid-window; the other replicas are the control. Recovered: the \
         first bin after the fault's end (bins aligned there) where the faulted replica's hit rate (usage, token-weighted) is ≥ \
         {} × the control's, the next bin too; recovery = that bin's start − the fault's end. Hits lost: from the fault's start to \
         the recovery, the faulted replica's prompt tokens × the control's hit rate − its cached tokens. Indexer: its own counters \
         over the point (after a restart, the new process's).\n",
        crate::sweep::lost_events::RECOVERED_SHARE
    );
    let _ = writeln!(md, "| fault | policy | N | spread | rate | fault s (start–end) | hit before: faulted / control | recovery s (bin) | hits lost tokens (share) | requests in span | indexer | point |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (p, l) in lost {
        let indexer =
            l.indexer.iter().map(|(k, v)| format!("{k} {v:.0}")).collect::<Vec<_>>().join(", ");
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.3} | {:.1}–{:.1} | {} / {} | {} | {:.0} ({}) | {} | {} | {} |",
            l.fault,
            p.policy,
            p.replicas.count,
            p.replicas.spread.name(),
            p.rate,
            l.times.start_ms / 1000.0,
            l.times.end_ms / 1000.0,
            pct(l.before_faulted),
            pct(l.before_control),
            match l.recovery_s {
                Some(s) => format!("{s:.0} ({:.0})", l.bin_ms / 1000.0),
                None => "**not recovered** in the window".into(),
            },
            l.hits_lost_tokens,
            pct(l.lost_share()),
            l.span_requests,
            if indexer.is_empty() { "n/a".into() } else { indexer },
            status(p) + no_loss(l)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sweep::lost_events::{FaultTimes, LostEvents};
    use crate::sweep::replicas::{ReplicaSetup, SessionMoves, Spread};

    fn point(
        policy: &str,
        n: usize,
        spread: Spread,
        hit: f64,
        p90: f64,
        valid: bool,
    ) -> PointResult {
        PointResult {
            policy: policy.into(),
            rate: 2.0,
            engine_hit_rate: Some(hit),
            ceiling: Some(0.8),
            ttft_p90_ms: Some(p90),
            load_max_over_mean: Some(1.1),
            load_cov: Some(0.05),
            session_moves: Some(SessionMoves { follow_ups: 100, moves: 3, sessions_moved: 2 }),
            replicas: ReplicaSetup { count: n, spread },
            invalid: if valid { Vec::new() } else { vec!["CPU 95% > 85%".into()] },
            ..Default::default()
        }
    }

    fn workload() -> WorkloadSweep {
        let pc = Spread::PerConnection;
        WorkloadSweep {
            workload: "agentic".into(),
            points: vec![
                point(POLICY_KVMESH_PRECISE, 1, pc, 0.76, 100.0, true),
                point("ring_hash", 1, pc, 0.70, 200.0, true),
            ],
            replica_points: vec![
                point(POLICY_KVMESH_PRECISE, 2, pc, 0.74, 110.0, true),
                point(POLICY_KVMESH_PRECISE, 8, pc, 0.60, 130.0, true),
                point(POLICY_KVMESH_PRECISE, 8, Spread::PerRequest, 0.75, 100.0, false),
                point("ring_hash", 8, pc, 0.70, 210.0, true),
            ],
            ..Default::default()
        }
    }

    #[test]
    fn the_curve_starts_at_the_one_gateway_point_per_policy_and_spread() {
        let w = workload();
        let s = curve_series(&w, &|p: &PointResult| p.hit_over_ceiling());
        let labels: Vec<&str> = s.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "kvmesh_precise (per-connection)",
                "kvmesh_precise (per-request)",
                "ring_hash (per-connection)"
            ]
        );
        let xs: Vec<f64> = s[0].points.iter().map(|p| p.0).collect();
        assert_eq!(xs, [1.0, 2.0, 8.0]);
        assert!((s[0].points[2].1 - 0.75).abs() < 1e-12, "0.60 / 0.80");
        assert_eq!(s[1].points.len(), 2);
        assert!(!s[1].points[1].2, "the invalid point is drawn hollow");
    }

    #[test]
    fn the_bar_is_judged_on_valid_kvmesh_points_against_one_gateway() {
        let w = workload();
        let v2 = verdict(&w, &w.replica_points[0]).unwrap();
        assert!(v2.contains("hit ÷ 1 gw 0.97 (≥ 0.95: met)"), "{v2}");
        assert!(v2.contains("p90 ÷ 1 gw 1.10 (≤ 1.15: met)"), "{v2}");
        let v8 = verdict(&w, &w.replica_points[1]).unwrap();
        assert!(v8.contains("0.79 (≥ 0.95: **missed**)"), "{v8}");
        assert!(v8.contains("1.30 (≤ 1.15: **missed**)"), "{v8}");
        assert_eq!(verdict(&w, &w.replica_points[2]), None, "invalid");
        assert_eq!(verdict(&w, &w.replica_points[3]), None, "a baseline");
        assert_eq!(verdict(&w, &w.points[0]), None, "one gateway");
    }

    #[test]
    fn the_section_has_the_curve_table_and_the_lost_events_table() {
        let mut w = workload();
        let mut lost = point(POLICY_KVMESH_PRECISE, 2, Spread::PerConnection, 0.7, 120.0, true);
        lost.lost_events = Some(LostEvents {
            fault: "stall".into(),
            replica: 1,
            times: FaultTimes { start_ms: 40_000.0, end_ms: 60_000.0 },
            bin_ms: 5_000.0,
            before_faulted: Some(0.75),
            before_control: Some(0.76),
            recovery_s: Some(5.0),
            hits_lost_tokens: 12_345.0,
            span_prompt_tokens: 100_000.0,
            span_requests: 40,
            bins: Vec::new(),
            indexer: vec![("gaps".into(), 4.0)],
        });
        w.replica_points.push(lost);
        let md = render(&SweepReport { settings: Vec::new(), workloads: vec![w] }, true);
        assert!(md.contains("### Gateway replicas: `agentic`"), "{md}");
        assert!(md.contains("sweep_agentic_replicas_hit.png"), "{md}");
        assert!(
            md.contains("| 1 | — | kvmesh_precise | 2.000 | 76.0% | 0.95 | 1.00 | 100 | 1.00 | 1.100 | 0.050 | 3 / 100 (3.0%) | valid |"),
            "{md}"
        );
        assert!(md.contains("| 8 | per-connection | kvmesh_precise | 2.000 | 60.0% | 0.75 | 0.79 | 130 | 1.30 |"), "{md}");
        assert!(
            md.contains("| stall | kvmesh_precise | 2 | per-connection | 2.000 | 40.0–60.0 | 75.0% / 76.0% | 5 (5) | 12345 (12.3%) | 40 | gaps 4 | valid |"),
            "{md}"
        );
        // The lost-events point is not on the curve.
        assert_eq!(md.matches("| 2 | per-connection | kvmesh_precise |").count(), 1, "{md}");
        assert!(render(&SweepReport::default(), true).is_empty());
    }
}
