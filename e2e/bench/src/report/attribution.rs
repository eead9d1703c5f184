//! The sweep report's attribution table (issue 46): per workload and policy at the load point,
//! where the prompts' tokens went — served from cache (delivered), or lost to the workload (no
//! eligible worker held them), to routing (another worker held more) or to prediction (predicted
//! on the chosen worker, not served from its cache) — as shares of the attributed prompt tokens.
//! kvmesh policies read it from the indexer's counters (`counters::AttributionCounters`); the
//! baselines have no router view of the workers' caches, so available, captured and the split are
//! n/a there and only delivered (the responses' usage) is shown. Pure: Markdown out.

use std::fmt::Write;

use crate::sweep::PointResult;

fn pct(v: Option<f64>) -> String {
    v.map(|x| format!("{:.1}%", x * 100.0)).unwrap_or_else(|| "—".into())
}

const NA: &str = "n/a";

/// One row's cells after the workload and policy columns.
fn cells(p: &PointResult) -> [String; 8] {
    let Some(a) = p.attribution.filter(|a| a.prompt > 0.0) else {
        // No router view (a baseline, or no usage reached the indexer): the engines' answer only.
        let delivered = pct(p.usage_hit_rate);
        let reason = if p.attribution.is_some() { "no request attributed" } else { NA };
        return [
            reason.into(),
            NA.into(),
            NA.into(),
            delivered,
            NA.into(),
            NA.into(),
            NA.into(),
            NA.into(),
        ];
    };
    [
        format!("{:.0}", a.requests),
        pct(a.share(a.available)),
        pct(a.share(a.captured)),
        pct(a.share(a.delivered)),
        pct(a.share(a.workload)),
        pct(a.share(a.routing)),
        pct(a.share(a.not_delivered)),
        pct(a.share(a.unpredicted)),
    ]
}

/// The attribution section: one row per (workload, its load point's result of a policy).
pub fn render<'a>(md: &mut String, rows: impl IntoIterator<Item = (&'a str, &'a PointResult)>) {
    let _ = writeln!(md, "\n### Where the hit rate goes at the load point (attribution)\n");
    let _ = writeln!(
        md,
        "Shares of the attributed requests' prompt tokens (the engines' `usage.prompt_tokens`), token sums like the engines' \
         own hit rate: **available** = the most any eligible worker was predicted to hold at decision time, **captured** = \
         predicted on the worker chosen, **delivered** = served from the engine's cache (`cached_tokens`). Lost: **workload** \
         (nobody held it) + **routing** (another worker held more) + **not delivered** (predicted, not served) − \
         **unpredicted** (served beyond the prediction) = 1 − delivered. Baselines have no router view: n/a, delivered from \
         the responses' usage.\n"
    );
    let _ = writeln!(md, "| workload | policy | attributed requests | available | captured | delivered | lost: workload | lost: routing | lost: not delivered | unpredicted |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|");
    for (workload, p) in rows {
        let _ = writeln!(md, "| {workload} | {} | {} |", p.policy, cells(p).join(" | "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counters::AttributionCounters;

    #[test]
    fn kvmesh_rows_split_the_prompt_and_baselines_say_na() {
        let a = AttributionCounters {
            requests: 40.0,
            prompt: 1000.0,
            available: 800.0,
            captured: 700.0,
            delivered: 650.0,
            workload: 200.0,
            routing: 100.0,
            not_delivered: 60.0,
            unpredicted: 10.0,
        };
        let point = |policy: &str, attribution| PointResult {
            policy: policy.into(),
            rate: 4.0,
            usage_hit_rate: Some(0.3),
            attribution,
            ..Default::default()
        };
        let (rr, kv) = (point("round_robin", None), point("kvmesh_precise", Some(a)));
        let mut md = String::new();
        render(&mut md, [("trace", &rr), ("trace", &kv)]);
        assert!(
            md.contains(
                "| trace | round_robin | n/a | n/a | n/a | 30.0% | n/a | n/a | n/a | n/a |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| trace | kvmesh_precise | 40 | 80.0% | 70.0% | 65.0% | 20.0% | 10.0% | 6.0% | 1.0% |"),
            "{md}"
        );
    }
}
