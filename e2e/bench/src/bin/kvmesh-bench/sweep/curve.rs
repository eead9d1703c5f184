//! The sweep's gateway-replica points: the replica curve after a workload's points, the
//! lost-events points instead of them, and the curve's plots.

use super::point::{measure, PointSpec, Progress};
use super::{runs_on, save, SweepSettings};
use anyhow::Result;
use kvmesh_bench::report::sweep::{SweepReport, WorkloadSweep};
use kvmesh_bench::sweep::replicas::ReplicaSetup;
use kvmesh_bench::sweep::PointResult;
use kvmesh_bench::workload::WorkloadKind;
use std::path::Path;

/// The replica curve of one workload: every policy at each `rates` rate behind every replica count
/// above 1 of `--replicas`, kvmesh's policies per spread, the baselines (whose choice reads no
/// replica's state) under the first spread only.
#[allow(clippy::too_many_arguments)]
pub(super) async fn run_replica_curve(
    a: &SweepSettings,
    spec: &PointSpec<'_>,
    kind: WorkloadKind,
    rates: &[f64],
    out: &Path,
    progress: &mut Progress,
    report: &mut SweepReport,
    wi: usize,
) -> Result<()> {
    for &count in a.replicas.iter().filter(|&&n| n > 1) {
        for (si, &spread) in a.spreads.iter().enumerate() {
            for &policy in a.policies.iter().filter(|&&p| runs_on(kind, p)) {
                if si > 0 && !policy.is_kvmesh() {
                    continue;
                }
                let spec = spec.behind(ReplicaSetup { count, spread }, None);
                for &rate in rates {
                    let p = measure(a, &spec, kind, policy, rate, out, progress).await;
                    report.workloads[wi].replica_points.push(p);
                    save(report, out)?;
                }
            }
        }
    }
    Ok(())
}

/// Lost-events points of one workload: each kvmesh policy at each `--rates` rate behind the
/// largest `--replicas` count, per spread and per fault, the last replica's indexer faulted.
pub(super) async fn run_lost_events(
    a: &SweepSettings,
    spec: &PointSpec<'_>,
    kind: WorkloadKind,
    out: &Path,
    progress: &mut Progress,
    report: &mut SweepReport,
    wi: usize,
) -> Result<()> {
    let count = a.replicas.iter().copied().max().unwrap_or(2).max(2);
    for &plan in &a.lose_events {
        for &spread in &a.spreads {
            for &policy in a.policies.iter().filter(|&&p| p.is_kvmesh() && runs_on(kind, p)) {
                let spec = spec.behind(ReplicaSetup { count, spread }, Some(plan));
                for &rate in &a.fixed_rates {
                    let p = measure(a, &spec, kind, policy, rate, out, progress).await;
                    report.workloads[wi].replica_points.push(p);
                    save(report, out)?;
                }
            }
        }
    }
    Ok(())
}

/// The replica curve's plots of one workload: hit × ceiling and TTFT p90 against the replicas.
pub(super) fn draw_replicas(
    w: &WorkloadSweep,
    out: &Path,
) -> Result<Vec<std::path::PathBuf>, String> {
    use kvmesh_bench::report::plots::vs_rate;
    use kvmesh_bench::report::replicas::{curve_series, plot_files};
    let (hit, ttft) = plot_files(&w.workload);
    let (h, t) = (out.join(hit), out.join(ttft));
    vs_rate(
        &h,
        &format!("{}: engine hit ÷ ceiling vs gateway replicas (hollow = invalid)", w.workload),
        "gateway replicas",
        "engine hit rate ÷ ceiling",
        &curve_series(w, &|p: &PointResult| p.hit_over_ceiling()),
        false,
        None,
    )
    .map_err(|e| e.to_string())?;
    vs_rate(
        &t,
        &format!("{}: TTFT p90 vs gateway replicas (hollow = invalid)", w.workload),
        "gateway replicas",
        "TTFT p90 (ms)",
        &curve_series(w, &|p: &PointResult| p.ttft_p90_ms),
        false,
        None,
    )
    .map_err(|e| e.to_string())?;
    Ok(vec![h, t])
}
