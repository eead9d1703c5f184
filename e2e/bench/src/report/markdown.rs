//! The Markdown report (pure: data in, text out).
//!
//! Order follows what a reader asks first: what was run and how to rerun it, then cache hits
//! against the ceiling, latency, throughput, balance, the targets, then details (per-worker
//! counts, failures, overhead, extra sections). Absent numbers print as `n/a`, never as 0.

use super::summary::{PolicySummary, RateSource, SourcedRate};
use super::targets::{
    overhead_verdict, rps_ratio, TargetResult, Verdict, OVERHEAD_P99_TARGET_MS,
    OVERHEAD_TARGET_CASE, OVERHEAD_TARGET_MS, RPS_RATIO_TARGET,
};
use crate::manifest::OverheadCase;
use crate::manifest::RunManifest;
use std::fmt::Write as _;

/// Plot files the report links to (relative to the report), `None` when not drawn.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PlotLinks {
    /// TTFT CDF per policy.
    pub ttft_cdf: Option<String>,
    /// Hit rate vs ceiling per policy.
    pub hit_rate: Option<String>,
    /// Requests per worker per policy.
    pub requests_per_worker: Option<String>,
    /// Why plots are missing, when they are.
    pub note: Option<String>,
}

fn pct(v: Option<f64>) -> String {
    v.map(|x| format!("{:.1}%", x * 100.0)).unwrap_or_else(|| "n/a".into())
}

fn ms(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.1}")).unwrap_or_else(|| "n/a".into())
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map(|x| format!("{x:.digits$}")).unwrap_or_else(|| "n/a".into())
}

fn sourced(v: Option<SourcedRate>) -> String {
    match v {
        Some(SourcedRate { value, source: RateSource::Counters }) => pct(Some(value)),
        Some(SourcedRate { value, source: RateSource::DebugHeaders }) => {
            format!("{} ᵈ", pct(Some(value)))
        }
        None => "n/a".into(),
    }
}

fn verdict(v: &Verdict) -> String {
    match v {
        Verdict::Met { ratio } => format!("**met** (ratio {ratio:.3})"),
        Verdict::Missed { ratio } => format!("**missed** (ratio {ratio:.3})"),
        Verdict::NotMeasured => "not measured".into(),
    }
}

/// Renders the whole report.
pub fn render(
    m: &RunManifest,
    summaries: &[PolicySummary],
    targets: &[TargetResult],
    plots: &PlotLinks,
) -> String {
    let mut s = String::new();
    // Writing to a String cannot fail; the results are ignored on purpose.
    let _ = writeln!(s, "# {}\n", m.title.as_deref().unwrap_or("kvmesh benchmark report"));
    let _ = writeln!(s, "| | |\n|---|---|");
    let _ = writeln!(s, "| workload | {} |", m.workload.as_deref().unwrap_or("not stated"));
    let _ = writeln!(s, "| window | {} |", m.window.as_deref().unwrap_or("not stated"));
    let _ = writeln!(s, "| speed-up | {} |", num(m.speedup, 2));
    let fleet = if m.workers.is_empty() {
        "not stated".to_string()
    } else {
        format!("{} workers ({})", m.workers.len(), m.workers.join(", "))
    };
    let _ = writeln!(s, "| fleet | {fleet} |");
    let cap = match (m.cache_capacity_blocks, m.engine_block_size) {
        (Some(c), Some(b)) => {
            format!("{c} blocks × {b} tokens = {} tokens per worker", c * u64::from(b))
        }
        (Some(c), None) => format!("{c} blocks per worker"),
        _ => "not stated".into(),
    };
    let _ = writeln!(s, "| KV capacity | {cap} |");
    if let Some(c) = &m.ceiling {
        let _ = writeln!(
            s,
            "| intrinsic ceiling | {} block-weighted ({} of {} blocks seen earlier in the window), {} token-weighted, {} requests |",
            pct(Some(c.block_rate())),
            c.blocks_reused,
            c.blocks_total,
            pct(Some(c.token_rate())),
            c.requests
        );
    }
    if !m.commands.is_empty() {
        let _ = writeln!(s, "\nRerun with:\n\n```sh\n{}\n```", m.commands.join("\n"));
    }

    if summaries.is_empty() {
        let _ = writeln!(s, "\nNo single-replay policy comparison in this run (`--only` without `policies`); the load sweep, when run, has its own headline and targets below.");
    } else {
        render_policies(&mut s, m, summaries, plots);
    }

    // Without a single-replay comparison only the overhead target can be judged here.
    let shown: Vec<&TargetResult> = targets
        .iter()
        .filter(|t| !summaries.is_empty() || t.target.starts_with("router overhead"))
        .collect();
    if !summaries.is_empty() || !m.overhead.is_empty() {
        let _ = writeln!(s, "\n## Targets\n\nGoals from the issue, reported, never asserted. What limits the missed ones on the reference run is analysed in e2e/bench/README.md (\"Latest results, and why targets are missed\").\n");
        let _ = writeln!(
            s,
            "| target | measured | reference | verdict | note |\n|---|---|---|---|---|"
        );
        for t in shown {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} |",
                t.target,
                t.measured,
                t.reference,
                verdict(&t.verdict),
                t.note
            );
        }
    }

    render_details(&mut s, m, summaries);
    s
}

/// Cache hits, latency and throughput, load balance: the per-policy sections.
fn render_policies(
    s: &mut String,
    m: &RunManifest,
    summaries: &[PolicySummary],
    plots: &PlotLinks,
) {
    let _ = writeln!(s, "\n## Cache hits\n");
    let _ = writeln!(s, "| policy | engine hit rate (block-weighted) | vs ceiling | router predicted, block-weighted | router predicted, request-weighted | cached tokens from usage | engine preemptions |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    let ceil = m.ceiling.as_ref().map(|c| c.block_rate());
    for p in summaries {
        let vs = match (p.engine_hit_rate, ceil) {
            (Some(h), Some(c)) if c > 0.0 => format!("{:.2}×", h / c),
            _ => "n/a".into(),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {vs} | {} | {} | {} | {} |",
            p.name,
            pct(p.engine_hit_rate),
            sourced(p.router_block_rate),
            sourced(p.router_request_rate),
            pct(p.usage_cached_rate),
            num(p.preemptions, 0)
        );
    }
    let _ = writeln!(
        s,
        "\nEngine hit rate = Δ`vllm:prefix_cache_hits_total` / Δ`vllm:prefix_cache_queries_total` over the fleet (tokens). \
         Router rates from Envoy's `router_kv_*` metrics; ᵈ = computed from the `x-kvmesh-*` debug headers instead. \
         Cached tokens from usage = Σ`usage.prompt_tokens_details.cached_tokens` / Σ`usage.prompt_tokens` (hits at each request's \
         first admission). A preempted request is looked up again when re-admitted and finds its own computed blocks, so \
         preemptions raise the engine counters' rate (even above the ceiling) but not the usage-based one."
    );
    if let Some(f) = &plots.hit_rate {
        let _ = writeln!(s, "\n![hit rate vs ceiling]({f})");
    }

    let _ = writeln!(s, "\n## Latency and throughput\n");
    let _ = writeln!(s, "| policy | ok / all | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p50 ms | E2E p99 ms | req/s | output tok/s | send lag p99 ms |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for p in summaries {
        let _ = writeln!(
            s,
            "| {} | {} / {} | {} | {} | {} | {} | {} | {:.2} | {:.0} | {} |",
            p.name,
            p.ok,
            p.requests,
            ms(p.ttft.p50),
            ms(p.ttft.p90),
            ms(p.ttft.p99),
            ms(p.e2e.p50),
            ms(p.e2e.p99),
            p.requests_per_s,
            p.output_tokens_per_s,
            ms(p.send_lag.p99)
        );
    }
    let _ = writeln!(
        s,
        "\nSend lag = actual send time − the trace's send time (sped up); a large lag means `--max-concurrency` held \
         requests back because the fleet did not keep up, so later arrivals were compressed."
    );
    if let Some(f) = &plots.ttft_cdf {
        let _ = writeln!(s, "\n![TTFT CDF]({f})");
    }

    let _ = writeln!(s, "\n## Load balance\n");
    let _ = writeln!(s, "| policy | max/mean requests per worker | max/mean tokens per worker | decisions by mode | routed without the indexer |");
    let _ = writeln!(s, "|---|---|---|---|---|");
    let counts = |m: &std::collections::BTreeMap<String, usize>| {
        if m.is_empty() {
            "—".to_string()
        } else {
            m.iter().map(|(k, v)| format!("{k}: {v}")).collect::<Vec<_>>().join(", ")
        }
    };
    for p in summaries {
        let (modes, fallbacks) = (counts(&p.modes), counts(&p.fallbacks));
        let _ = writeln!(
            s,
            "| {} | {} | {} | {modes} | {fallbacks} |",
            p.name,
            num(p.requests_balance.max_over_mean(), 3),
            num(p.tokens_balance.max_over_mean(), 3)
        );
    }
    if let Some(f) = &plots.requests_per_worker {
        let _ = writeln!(s, "\n![requests per worker]({f})");
    }
    if let Some(n) = &plots.note {
        let _ = writeln!(s, "\n_Plots: {n}_");
    }
}

fn render_details(s: &mut String, m: &RunManifest, summaries: &[PolicySummary]) {
    let mut workers: Vec<&String> =
        summaries.iter().flat_map(|p| p.requests_balance.per_worker.keys()).collect();
    workers.sort();
    workers.dedup();
    if !workers.is_empty() {
        let _ = writeln!(s, "\n## Requests per worker\n");
        let _ = writeln!(
            s,
            "| policy | {} |",
            workers.iter().map(|w| w.as_str()).collect::<Vec<_>>().join(" | ")
        );
        let _ = writeln!(s, "|---|{}", "---|".repeat(workers.len()));
        for p in summaries {
            let cells: Vec<String> = workers
                .iter()
                .map(|w| {
                    format!("{:.0}", p.requests_balance.per_worker.get(*w).copied().unwrap_or(0.0))
                })
                .collect();
            let _ = writeln!(s, "| {} | {} |", p.name, cells.join(" | "));
        }
    }
    let failures: Vec<&PolicySummary> = summaries.iter().filter(|p| p.failed > 0).collect();
    if !failures.is_empty() {
        let _ = writeln!(s, "\n## Failed requests\n");
        for p in failures {
            let _ = writeln!(s, "- **{}**: {} failed", p.name, p.failed);
            for (msg, n) in &p.top_errors {
                let _ = writeln!(s, "  - {n} × `{}`", msg.replace('`', "'"));
            }
        }
    }
    render_overhead(s, m);
    let notes: Vec<_> =
        m.policies.iter().filter_map(|p| p.notes.as_ref().map(|n| (p.name.as_str(), n))).collect();
    if !notes.is_empty() {
        let _ = writeln!(s, "\n## Policy notes\n");
        for (name, n) in notes {
            let _ = writeln!(s, "- **{name}**: {n}");
        }
    }
    for e in &m.extra_sections {
        let _ = writeln!(s, "\n## {}\n\n{}", e.title, e.markdown.trim_end());
    }
}

fn render_overhead(s: &mut String, m: &RunManifest) {
    if m.overhead.is_empty() && m.overhead_notes.is_none() {
        return;
    }
    let _ = writeln!(s, "\n## Router overhead (kvmesh vs the same Envoy without the filter)\n");
    let _ = writeln!(
        s,
        "Added latency = p(kvmesh) − p(plain) of the **gateway time**: Envoy's own timestamps per request, last request byte \
         received → first byte sent upstream (the filter's body work, the indexer round trip with tokenization, host \
         selection) plus first upstream response byte → first byte to the client. The engine's time is in neither, so it \
         cannot drown the overhead. Both paths are one Envoy process measured in the same run, interleaved. The client's \
         TTFT difference is shown as a cross-check (it includes the engines tokenizing the whole prompt on both sides). \
         \"Of which indexer / tokenize / match / score\" is the indexer's own timer for answering `/v1/route` and, within \
         it, rendering + tokenizing (with hashing blocks and checking how far they are held), `find_matches` and \
         scoring (medians of per-request readings; outside the three: parsing the body, the hop to the tokenizing pool for bodies over 64 KiB, \
         the HTTP stack); the rest of the kvmesh time is the filter and the loopback hop to the indexer. \
         Requests/s: one gateway, closed loop, canned response (no engine); the ratio is judged against the target \
         ≥ {RPS_RATIO_TARGET}× plain for every case, with at most {:.0}% of the case's kvmesh requests routed without \
         the indexer (a rate reached by the filter's timeout gave up KV-aware routing). Routes per indexer CPU-s: routes the indexer answered during the \
         kvmesh rounds ÷ the CPU time it spent (how many requests/s one indexer core sustains), beside the indexer cores \
         it kept busy.",
        RPS_MAX_FALLBACK_SHARE * 100.0
    );
    if let Some(n) = &m.overhead_notes {
        let _ = writeln!(s, "\n{n}");
    }
    // The wasm filter's rows; the ext_proc picker's are in the side-by-side table below.
    let wasm: Vec<OverheadCase> = m.overhead.iter().filter(|c| c.edge.is_none()).cloned().collect();
    if wasm.is_empty() {
        side_by_side(s, m);
        return;
    }
    let _ = writeln!(
        s,
        "\n| case | prompt tokens | samples | **added p50 ms** | added p99 ms | kvmesh p50 / p99 ms | of which indexer / tokenize / match / score p50 ms | plain p50 / p99 ms | client TTFT added p50 / p99 ms | routed without indexer | req/s kvmesh | req/s plain | req/s ratio (≥ {RPS_RATIO_TARGET}) | routes per indexer CPU-s (cores busy) |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let pair = |a: Option<f64>, b: Option<f64>| format!("{} / {}", num(a, 3), num(b, 3));
    for c in &wasm {
        let ratio = match (rps_ratio(c), rps_met(c)) {
            (Some(r), _) if c.local_route_max_body_bytes.is_some() => {
                format!("{r:.3} (routed locally, not judged)")
            }
            (Some(r), true) => format!("{r:.3} met"),
            (Some(r), false) if r >= RPS_RATIO_TARGET => {
                format!("{r:.3} **missed** (bought by routing without the indexer)")
            }
            (Some(r), false) => format!("{r:.3} **missed**"),
            (None, _) => "n/a".into(),
        };
        let per_core = match (c.routes_per_indexer_core, c.indexer_cores) {
            (Some(r), Some(cores)) => format!("{r:.0} ({cores:.2})"),
            (r, _) => num(r, 0),
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | **{:.3}** | {} | {} | {} | {} | {} | {} | {} | {} | {ratio} | {per_core} |",
            c.name,
            num(c.prompt_tokens, 0),
            c.samples.map_or("n/a".into(), |n| n.to_string()),
            c.p50_added_ms,
            num(c.p99_added_ms, 3),
            pair(c.kvmesh_p50_ms, c.kvmesh_p99_ms),
            pair(c.indexer_p50_ms, c.tokenize_p50_ms) + " / " + &pair(c.match_p50_ms, c.score_p50_ms),
            pair(c.plain_p50_ms, c.plain_p99_ms),
            pair(c.client_p50_added_ms, c.client_p99_added_ms),
            c.fallbacks.map_or("n/a".into(), |n| n.to_string()),
            match c.rps_kvmesh_fallback_share {
                Some(f) if f > 0.0 => format!("{} ({:.0}% without the indexer)", num(c.rps_kvmesh, 1), f * 100.0),
                _ => num(c.rps_kvmesh, 1),
            },
            num(c.rps_plain, 1)
        );
    }
    let target = wasm.iter().find(|c| c.name == OVERHEAD_TARGET_CASE);
    let _ = match target {
        Some(c) => writeln!(
            s,
            "\nTarget: added p50 ≤ {OVERHEAD_TARGET_MS} ms for `{OVERHEAD_TARGET_CASE}`: {}\n\nTarget: added p99 ≤ {OVERHEAD_P99_TARGET_MS} ms for `{OVERHEAD_TARGET_CASE}`: {}",
            overhead_verdict(c.p50_added_ms, OVERHEAD_TARGET_MS),
            c.p99_added_ms.map_or_else(|| "not measured in this run.".to_string(), |p99| overhead_verdict(p99, OVERHEAD_P99_TARGET_MS))
        ),
        None => writeln!(s, "\nTarget: added p50 ≤ {OVERHEAD_TARGET_MS} ms and p99 ≤ {OVERHEAD_P99_TARGET_MS} ms for `{OVERHEAD_TARGET_CASE}`: not measured in this run."),
    };
    let _ = writeln!(
        s,
        "\nTarget: requests/s per gateway ≥ {RPS_RATIO_TARGET}× plain Envoy for every case: {}",
        throughput_verdict(&wasm)
    );
    if let Some(line) = prefix_scaling(&wasm) {
        let _ = writeln!(s, "\n{line}");
    }
    side_by_side(s, m);
}

/// The ext_proc picker's rows beside the wasm filter's (`report::paths`), when the run has them.
fn side_by_side(s: &mut String, m: &RunManifest) {
    if let Some(table) = super::paths::side_by_side(&m.overhead) {
        let _ = writeln!(
            s,
            "\n### Side by side: plain Envoy, the wasm filter, the ext_proc endpoint picker\n\n{table}"
        );
    }
}

/// Most of a case's kvmesh requests/s requests that may be routed without the indexer for its
/// rate to count: a rate reached by falling back (the filter's timeout) gave up KV-aware routing.
pub const RPS_MAX_FALLBACK_SHARE: f64 = 0.01;

/// Whether one case meets the throughput target: ratio ≥ [`RPS_RATIO_TARGET`] with at most
/// [`RPS_MAX_FALLBACK_SHARE`] of its requests routed without the indexer.
pub fn rps_met(c: &OverheadCase) -> bool {
    rps_ratio(c).is_some_and(|r| r >= RPS_RATIO_TARGET)
        && c.rps_kvmesh_fallback_share.unwrap_or(0.0) <= RPS_MAX_FALLBACK_SHARE
}

/// The throughput target over every case: met only when every case was measured and met it.
pub fn throughput_verdict(all: &[OverheadCase]) -> String {
    // Cases routed locally by configuration gave up KV-aware routing: shown, never judged.
    let (local, cases): (Vec<&OverheadCase>, Vec<&OverheadCase>) =
        all.iter().partition(|c| c.local_route_max_body_bytes.is_some());
    let local_line = local_route_line(&local);
    let measured: Vec<(&OverheadCase, f64)> =
        cases.iter().filter_map(|c| rps_ratio(c).map(|r| (*c, r))).collect();
    let unmeasured: Vec<&str> =
        cases.iter().filter(|c| rps_ratio(c).is_none()).map(|c| c.name.as_str()).collect();
    if measured.is_empty() {
        return format!("not measured in this run.{local_line}");
    }
    let missed: Vec<String> = measured
        .iter()
        .filter(|(c, _)| !rps_met(c))
        .map(|(c, r)| match c.rps_kvmesh_fallback_share {
            Some(f) if f > RPS_MAX_FALLBACK_SHARE => {
                format!("`{}` {r:.3}× with {:.0}% without the indexer", c.name, f * 100.0)
            }
            _ => format!("`{}` {r:.3}×", c.name),
        })
        .collect();
    let worst = measured.iter().map(|(_, r)| *r).fold(f64::INFINITY, f64::min);
    let mut out = if missed.is_empty() {
        format!("**met** for all {} measured cases (lowest {worst:.3}×)", measured.len())
    } else {
        format!(
            "**missed** for {} of {} cases ({})",
            missed.len(),
            measured.len(),
            missed.join(", ")
        )
    };
    if !unmeasured.is_empty() {
        out.push_str(&format!(
            "; not measured: {}",
            unmeasured.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
        ));
        if missed.is_empty() {
            out = out.replacen("**met**", "**not judged** (cases missing), met", 1);
        }
    }
    out.push('.');
    out.push_str(&local_line);
    out
}

/// The requests/s ratios of the cases run with `local_route_max_body_bytes`, as a sentence after
/// the verdict (empty without such cases).
fn local_route_line(local: &[&OverheadCase]) -> String {
    let ratios: Vec<String> = local
        .iter()
        .filter_map(|c| rps_ratio(c).map(|r| format!("`{}` {r:.3}×", c.name)))
        .collect();
    let Some(bytes) =
        local.iter().find_map(|c| c.local_route_max_body_bytes).filter(|_| !ratios.is_empty())
    else {
        return String::new();
    };
    format!(" With `local_route_max_body_bytes: {bytes}` (the filter routes these bodies alone, not KV-aware; not judged): {}.", ratios.join(", "))
}

/// The largest shared-prefix case's added p50 within this factor of the smallest's counts as flat
/// (the cost follows the new turn, not the prefix; issue 16.3).
pub const PREFIX_FLAT_FACTOR: f64 = 1.5;

/// Whether kvmesh's cost on a shared prefix follows the new turn, not the prefix: the added p50
/// (and the indexer's p50) of the smallest and the largest shared-prefix case side by side.
pub fn prefix_scaling(cases: &[OverheadCase]) -> Option<String> {
    let mut shared: Vec<&OverheadCase> =
        cases.iter().filter(|c| c.name.ends_with("_shared_prefix")).collect();
    shared
        .sort_by(|a, b| a.prompt_tokens.unwrap_or(0.0).total_cmp(&b.prompt_tokens.unwrap_or(0.0)));
    let (small, large) = (shared.first()?, shared.last()?);
    if std::ptr::eq(*small, *large) {
        return None;
    }
    let tokens = match (small.prompt_tokens, large.prompt_tokens) {
        (Some(a), Some(b)) if a > 0.0 => format!(" ({:.1}× the prompt)", b / a),
        _ => String::new(),
    };
    let factor = |a: f64, b: f64| {
        if a > 0.0 {
            format!("{:.2}×", b / a)
        } else {
            "n/a".into()
        }
    };
    let indexer = match (small.indexer_p50_ms, large.indexer_p50_ms) {
        (Some(a), Some(b)) => {
            format!("; the indexer's own p50 {a:.3} → {b:.3} ms ({})", factor(a, b))
        }
        _ => String::new(),
    };
    let judged = if small.p50_added_ms > 0.0
        && large.p50_added_ms / small.p50_added_ms <= PREFIX_FLAT_FACTOR + 1e-9
    {
        "**follows the turn**"
    } else {
        "**grows with the prefix**"
    };
    Some(format!(
        "Shared prefix, cost per new turn: added p50 `{}` {:.3} ms → `{}` {:.3} ms ({}){tokens}{indexer}: {judged} (flat = \
         within {PREFIX_FLAT_FACTOR}× of the smallest prefix's). Each request adds one turn; a cost that follows the turn \
         stays flat as the prefix grows.",
        small.name,
        small.p50_added_ms,
        large.name,
        large.p50_added_ms,
        factor(small.p50_added_ms, large.p50_added_ms)
    ))
}

#[cfg(test)]
mod tests;
