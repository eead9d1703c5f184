//! The ways into one gateway side by side (pure): plain Envoy, the wasm filter and the ext_proc
//! endpoint picker per case, as the report's Markdown, with the picker's targets (issue 45).
//!
//! Reads one run's overhead rows (`RunManifest::overhead`): a case's wasm row (`edge` absent) and
//! its ext_proc row (`<case>_ext_proc`, `edge = "ext_proc"`). Both were measured against the same
//! plain samples (interleaved, one request at a time) and the same plain requests/s rounds, so
//! every figure here is a difference or ratio within one run.

use super::targets::{overhead_verdict, rps_ratio};
use crate::manifest::{OverheadCase, ProcessCpu};
use crate::overhead::summary::{EXT_PROC_EDGE, EXT_PROC_SUFFIX};
use std::fmt::Write as _;

/// The ext_proc path's latency targets (issue 45): the case, the added p50 bound and the added
/// p99 bound, ms — half of [`LLMD_REFERENCE`]'s figures at 100k tokens, and the wasm filter's
/// p50 target at 8k.
pub const EXT_PROC_TARGETS: [(&str, f64, Option<f64>); 2] =
    [("chat_8k_continuation", 1.0, None), ("chat_100k_continuation", 1.0, Some(2.5))];

/// The field's published per-request figure for an endpoint picker (issue 45).
pub const LLMD_REFERENCE: &str =
    "llm-d's precise prefix-cache scorer at 100k tokens: 2.05 ms p50 / 4.82 ms p95 per request";

fn is_ext_proc(c: &OverheadCase) -> bool {
    c.edge.as_deref() == Some(EXT_PROC_EDGE)
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "n/a".into(), |x| format!("{x:.digits$}"))
}

fn pair(a: Option<f64>, b: Option<f64>) -> String {
    format!("{} / {}", num(a, 3), num(b, 3))
}

fn added(c: Option<&OverheadCase>) -> String {
    let Some(c) = c else { return "n/a".into() };
    let pinned = match c.fallbacks {
        Some(n) if n > 0 => format!(" ({n} without the indexer)"),
        _ => String::new(),
    };
    format!("**{:.3}** / {}{pinned}", c.p50_added_ms, num(c.p99_added_ms, 3))
}

fn ratio(c: Option<&OverheadCase>) -> String {
    let Some(c) = c else { return "n/a".into() };
    match (rps_ratio(c), c.rps_kvmesh_fallback_share) {
        (Some(r), Some(f)) if f > 0.0 => format!("{r:.3} ({:.0}% without the indexer)", f * 100.0),
        (r, _) => num(r, 3),
    }
}

fn cpu(p: Option<ProcessCpu>) -> String {
    p.map_or_else(
        || "n/a".into(),
        |p| format!("{:.3} / {:.3} / {:.3}", p.envoy_ms, p.indexer_ms, p.client_ms),
    )
}

/// The side-by-side section's Markdown (no heading); `None` when the run has no ext_proc row.
pub fn side_by_side(cases: &[OverheadCase]) -> Option<String> {
    if !cases.iter().any(is_ext_proc) {
        return None;
    }
    // Every case of the main run in its order: the wasm rows (not the `_local_route` ones), then
    // any case only the picker measured.
    let mut names: Vec<&str> = cases
        .iter()
        .filter(|c| c.edge.is_none() && c.local_route_max_body_bytes.is_none())
        .map(|c| c.name.as_str())
        .collect();
    for c in cases.iter().filter(|c| is_ext_proc(c)) {
        let base = c.name.strip_suffix(EXT_PROC_SUFFIX).unwrap_or(&c.name);
        if !names.contains(&base) {
            names.push(base);
        }
    }
    let find = |name: &str, ext: bool| {
        cases.iter().find(|c| {
            is_ext_proc(c) == ext
                && c.local_route_max_body_bytes.is_none()
                && c.name.strip_suffix(if ext { EXT_PROC_SUFFIX } else { "" }) == Some(name)
        })
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Three ways into one Envoy, measured in the same run: **plain** (no kvmesh), **wasm** (the kvmesh filter calling \
         the indexer's `/v1/route`) and **ext_proc** (Envoy's ext_proc filter calling the indexer's endpoint picker over \
         gRPC, no wasm; the same route pipeline behind it). Columns: *plain gateway p50 / p99* — the gateway time of \
         plain Envoy (access-log timestamps, as above); *added p50 / p99* — that path's gateway time p50 / p99 minus \
         plain's, one request at a time, the three paths interleaved (requests the path routed without the indexer — \
         the filter's fallback, the picker's session pin — are counted beside and stay in); *of which indexer p50* — the \
         indexer's own timer for that path's route (the rest of the added time is Envoy's filter and the hop to the \
         indexer: HTTP/1 for wasm, the gRPC stream for ext_proc, whose response headers and body also pass through the \
         picker); *plain req/s* — one gateway, closed loop, canned response; *req/s ÷ plain* — that path's rate over \
         plain's in the same rounds; *CPU-ms per request* — CPU time (user + system, `/proc/<pid>/stat`) of Envoy, the \
         indexer and the bench client over that path's requests/s rounds (Envoy's and the indexer's until the indexer \
         was idle again: work a round left behind counts) ÷ the rounds' requests; plain's indexer figure is its \
         background work."
    );
    let _ = writeln!(
        s,
        "\n| case | prompt tokens | plain gateway p50 / p99 ms | added p50 / p99 ms: wasm | added p50 / p99 ms: ext_proc | of which indexer p50 ms: wasm / ext_proc | plain req/s | req/s ÷ plain: wasm | req/s ÷ plain: ext_proc | CPU-ms per request, Envoy / indexer / client: plain | … wasm | … ext_proc |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for name in names {
        let (w, e) = (find(name, false), find(name, true));
        let any = w.or(e);
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            num(any.and_then(|c| c.prompt_tokens), 0),
            pair(any.and_then(|c| c.plain_p50_ms), any.and_then(|c| c.plain_p99_ms)),
            added(w),
            added(e),
            pair(w.and_then(|c| c.indexer_p50_ms), e.and_then(|c| c.indexer_p50_ms)),
            num(any.and_then(|c| c.rps_plain), 1),
            ratio(w),
            ratio(e),
            cpu(any.and_then(|c| c.plain_cpu_ms_per_request)),
            cpu(w.and_then(|c| c.cpu_ms_per_request)),
            cpu(e.and_then(|c| c.cpu_ms_per_request)),
        );
    }
    let _ = writeln!(
        s,
        "\nTargets of the ext_proc path (issue 45; the 100k bounds are half of {LLMD_REFERENCE}, published for \
         another setup; the continuation is judged, as for the wasm filter):"
    );
    for (case, p50, p99) in EXT_PROC_TARGETS {
        let row = find(case, true);
        for (quantile, measured, bound) in [
            ("p50", row.map(|c| c.p50_added_ms), Some(p50)),
            ("p99", row.and_then(|c| c.p99_added_ms), p99),
        ] {
            let Some(bound) = bound else { continue };
            let verdict = measured
                .map_or_else(|| "not measured in this run.".into(), |m| overhead_verdict(m, bound));
            let _ = writeln!(s, "- added {quantile} ≤ {bound} ms at `{case}`: {verdict}");
        }
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, ext: bool, p50: f64) -> OverheadCase {
        OverheadCase {
            name: if ext { format!("{name}{EXT_PROC_SUFFIX}") } else { name.into() },
            edge: ext.then(|| EXT_PROC_EDGE.to_string()),
            p50_added_ms: p50,
            p99_added_ms: Some(p50 * 2.0),
            prompt_tokens: Some(8200.0),
            plain_p50_ms: Some(0.06),
            plain_p99_ms: Some(0.1),
            rps_kvmesh: Some(500.0),
            rps_plain: Some(2000.0),
            indexer_p50_ms: Some(0.3),
            cpu_ms_per_request: Some(ProcessCpu { envoy_ms: 0.4, indexer_ms: 0.3, client_ms: 0.1 }),
            plain_cpu_ms_per_request: Some(ProcessCpu {
                envoy_ms: 0.05,
                indexer_ms: 0.0,
                client_ms: 0.06,
            }),
            fallbacks: Some(0),
            ..Default::default()
        }
    }

    #[test]
    fn no_ext_proc_row_no_section() {
        assert_eq!(side_by_side(&[row("chat_8k_continuation", false, 0.8)]), None);
        assert_eq!(side_by_side(&[]), None);
    }

    #[test]
    fn one_line_per_case_with_both_paths_and_the_targets() {
        let mut local = row("chat_1k_cold", false, 0.1);
        local.name = "chat_1k_cold_local_route".into();
        local.local_route_max_body_bytes = Some(8192);
        let mut pinned = row("chat_100k_continuation", true, 1.2);
        pinned.fallbacks = Some(3);
        pinned.rps_kvmesh_fallback_share = Some(0.25);
        let cases = vec![
            row("chat_8k_continuation", false, 0.8),
            row("chat_8k_continuation", true, 0.6),
            row("chat_100k_continuation", false, 0.9),
            pinned,
            local,
            row("chat_32k_cold", true, 0.7),
        ];
        let md = side_by_side(&cases).unwrap();
        let lines: Vec<&str> = md.lines().filter(|l| l.starts_with("| chat_")).collect();
        assert_eq!(lines.len(), 3, "8k, 100k, then the picker-only 32k; no local-route row:\n{md}");
        assert!(lines[0].starts_with("| chat_8k_continuation | 8200 | 0.060 / 0.100 | **0.800** / 1.600 | **0.600** / 1.200 | 0.300 / 0.300 | 2000.0 | 0.250 | 0.250 | 0.050 / 0.000 / 0.060 | 0.400 / 0.300 / 0.100 | 0.400 / 0.300 / 0.100 |"), "{}", lines[0]);
        assert!(lines[1].contains("**1.200** / 2.400 (3 without the indexer)"), "{}", lines[1]);
        assert!(lines[1].contains("0.250 (25% without the indexer)"), "{}", lines[1]);
        assert!(
            lines[2].starts_with("| chat_32k_cold | 8200 |") && lines[2].contains("| n/a |"),
            "{}",
            lines[2]
        );
        let header = md.lines().find(|l| l.starts_with("| case |")).unwrap();
        assert_eq!(
            header.matches('|').count(),
            lines[0].matches('|').count(),
            "every column filled"
        );
        assert!(md.contains("- added p50 ≤ 1 ms at `chat_8k_continuation`: **met**"), "{md}");
        assert!(md.contains("- added p50 ≤ 1 ms at `chat_100k_continuation`: **missed**"), "{md}");
        assert!(md.contains("- added p99 ≤ 2.5 ms at `chat_100k_continuation`: **met**"), "{md}");
        assert!(md.contains("2.05 ms p50 / 4.82 ms p95"), "{md}");
        // A target case the run lacks says so.
        let md = side_by_side(&cases[..2]).unwrap();
        assert!(md.contains("`chat_100k_continuation`: not measured in this run."), "{md}");
    }
}
