//! The indexer's microbenchmark figures as a report section (pure).
//!
//! `cargo bench -p kvmesh-indexer --bench index --bench route` appends one JSON object per figure
//! to the file named by `KVMESH_BENCH_FIGURES` (`make bench` sets it); this module turns those
//! lines into a Markdown table with the indexer issue's targets beside them. Lines look like:
//!
//! ```text
//! {"bench":"index","figure":"apply","name":"decoded_block_ops_cache_resident","block_ops_per_s":6.0e6,...}
//! {"bench":"index","figure":"find_matches","name":"512_blocks/1000_workers","p50_us":5.4,"p99_us":15.6,...}
//! {"bench":"index","figure":"memory","name":"1 holder per block","bytes_per_entry":147.0,...}
//! {"bench":"route","figure":"route","name":"continuation","tokens":9500,"p50_ms":0.83,"p99_ms":1.27,...}
//! ```
//!
//! Unknown figures are listed as they are, so a new benchmark shows up before this module knows
//! its name; a malformed line is reported in the section, never fatal.

use crate::manifest::ExtraSection;
use serde_json::Value;
use std::fmt::Write as _;

/// Environment variable the indexer's benches read: append figures as JSON lines to this file.
pub const FIGURES_ENV: &str = "KVMESH_BENCH_FIGURES";
/// Section title.
pub const TITLE: &str = "Indexer microbenchmarks";

/// Targets from the indexer issue.
const APPLY_TARGET: f64 = 5.0e6;
const FIND_P99_TARGET_US: f64 = 10.0;
const FIND_TARGET_CASE: &str = "512_blocks/1000_workers";
const ROUTE_P50_TARGET_MS: f64 = 1.0;
/// Issue 16: a cold chat of any size routes in at most this p50.
const COLD_ROUTE_P50_TARGET_MS: f64 = 3.0;

/// A route figure's p50 target: its label and bound, ms.
type RouteTarget = (&'static str, f64);

/// Parsed figure lines and the lines that did not parse.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Figures {
    /// One JSON object per figure, in file order.
    pub lines: Vec<Value>,
    /// 1-based numbers of lines that were not JSON objects.
    pub bad_lines: Vec<usize>,
}

/// Parses the figures file's text.
pub fn parse(text: &str) -> Figures {
    let mut f = Figures::default();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(line) {
            Ok(v @ Value::Object(_)) => f.lines.push(v),
            _ => f.bad_lines.push(i + 1),
        }
    }
    f
}

fn get<'a>(f: &'a Figures, figure: &str, name: &str) -> Option<&'a Value> {
    f.lines.iter().rev().find(|v| v["figure"] == figure && v["name"] == name)
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v[key].as_f64().filter(|x| x.is_finite())
}

/// `met`/`missed` with measured ÷ bound.
fn verdict(measured: Option<f64>, bound: f64, at_least: bool) -> String {
    match measured {
        Some(m) if bound > 0.0 => {
            let ok = if at_least { m >= bound } else { m <= bound };
            format!("**{}** ({:.2}× the bound)", if ok { "met" } else { "missed" }, m / bound)
        }
        _ => "not measured".into(),
    }
}

fn fmt3(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |x| format!("{x:.3}"))
}

/// Whether cold routes drag warm ones up under 64 callers: warm p99 there against the same warm
/// routes from one caller, and against the cold routes' p50 (a warm route queued behind cold
/// tokenizations would take about as long as they do).
fn concurrency_note(
    warm: Option<&Value>,
    cold: Option<&Value>,
    solo: Option<&Value>,
    alone: Option<&Value>,
) -> Option<String> {
    let w99 = num(warm?, "p99_ms")?;
    let mut parts = vec![format!("Under 64 concurrent callers warm routes' p99 is {w99:.3} ms")];
    if let Some(a99) = alone.and_then(|v| num(v, "p99_ms")).filter(|x| *x > 0.0) {
        parts.push(format!(
            "{:.2}× the same 48 warm callers' without the cold ones (p99 {a99:.3} ms: what the cold routes drag up)",
            w99 / a99
        ));
    }
    if let Some(s99) = solo.and_then(|v| num(v, "p99_ms")).filter(|x| *x > 0.0) {
        parts.push(format!(
            "{:.2}× the same warm routes from one caller (p99 {s99:.3} ms)",
            w99 / s99
        ));
    }
    if let Some(c50) = cold.and_then(|v| num(v, "p50_ms")).filter(|x| *x > 0.0) {
        parts.push(format!("{:.2}× the cold routes' p50 ({c50:.3} ms) beside them", w99 / c50));
    }
    Some(format!(
        "{}. Both callers share the machine's 2 cores, so some rise is contention, not queueing.",
        parts.join(", ")
    ))
}

/// `512_blocks/1000_workers/all_dirty` → `512 blocks × 1000 workers, all dirty`.
fn scenario(name: &str) -> String {
    let mut parts = name.split('/').map(|p| p.replace('_', " "));
    let head: Vec<String> = parts.by_ref().take(2).collect();
    let rest: Vec<String> = parts.collect();
    let mut out = head.join(" × ");
    if !rest.is_empty() {
        out.push_str(", ");
        out.push_str(&rest.join(", "));
    }
    out
}

fn row(s: &mut String, what: &str, figure: String, target: &str, verdict: String) {
    let _ = writeln!(s, "| {what} | {figure} | {target} | {verdict} |");
}

/// Renders the section; `source` says where the figures came from (shown under the table).
pub fn section(f: &Figures, source: &str) -> ExtraSection {
    let mut s = String::new();
    let _ = writeln!(s, "| what | figure | target | verdict |\n|---|---|---|---|");
    let mut used = Vec::new();
    let apply = [
        (
            "decoded_block_ops_cache_resident",
            "block events applied, one core, index otherwise empty (tables in cache)",
            true,
        ),
        (
            "decoded_block_ops_800k_resident",
            "block events applied, one core, 800k blocks resident",
            true,
        ),
        (
            "msgpack_decode_and_apply_block_ops_800k_resident",
            "same, msgpack decoding included",
            false,
        ),
    ];
    for (name, what, targeted) in apply {
        let Some(v) = get(f, "apply", name) else {
            continue;
        };
        used.push(v);
        let rate = num(v, "block_ops_per_s");
        let fig = rate.map_or("n/a".into(), |r| format!("**{:.2} M block-ops/s**", r / 1e6));
        if targeted {
            row(&mut s, what, fig, "≥ 5 M/s", verdict(rate, APPLY_TARGET, true));
        } else {
            row(&mut s, what, fig, "", String::new());
        }
    }
    for v in f.lines.iter().filter(|v| v["figure"] == "find_matches") {
        used.push(v);
        let name = v["name"].as_str().unwrap_or("?");
        let (p50, p99) = (num(v, "p50_us"), num(v, "p99_us"));
        let fig = format!(
            "p50 {} µs, p99 {} µs",
            p50.map_or("n/a".into(), |x| format!("{x:.2}")),
            p99.map_or("n/a".into(), |x| format!("{x:.2}"))
        );
        let what = format!("`find_matches` {}", scenario(name));
        if name == FIND_TARGET_CASE {
            row(&mut s, &what, fig, "p99 ≤ 10 µs", verdict(p99, FIND_P99_TARGET_US, false));
        } else {
            row(&mut s, &what, fig, "", String::new());
        }
    }
    for v in f.lines.iter().filter(|v| v["figure"] == "memory") {
        used.push(v);
        let fig = match (num(v, "bytes_per_entry"), num(v, "estimated_bytes_per_entry")) {
            (Some(a), Some(e)) => {
                format!("**{a:.0} B** per (block, worker) entry ({e:.0} B estimated)")
            }
            (Some(a), None) => format!("**{a:.0} B** per (block, worker) entry"),
            _ => "n/a".into(),
        };
        row(
            &mut s,
            &format!("memory, {}", v["name"].as_str().unwrap_or("?")),
            fig,
            "",
            String::new(),
        );
    }
    // `(figure, what, p50 target)`. Issue 16 added the long cold prompts (tokenize only what can
    // match; the ~8k-token cold chat is `cold`); the 48k shared prefix and 64 concurrent callers
    // follow below.
    let route: [(&str, &str, Option<RouteTarget>); 7] = [
        (
            "continuation",
            "`/v1/route`, chat continuation whose earlier turns were routed",
            Some(("p50 ≤ 1 ms", ROUTE_P50_TARGET_MS)),
        ),
        (
            "cold",
            "`/v1/route`, the same size cold (nothing cached)",
            Some(("p50 ≤ 3 ms", COLD_ROUTE_P50_TARGET_MS)),
        ),
        ("plain_tokenizers", "plain `tokenizers` encode of the same cold text, same run", None),
        ("cold_chat_32k", "`/v1/route`, cold chat", Some(("p50 ≤ 3 ms", COLD_ROUTE_P50_TARGET_MS))),
        (
            "cold_chat_128k",
            "`/v1/route`, cold chat",
            Some(("p50 ≤ 3 ms", COLD_ROUTE_P50_TARGET_MS)),
        ),
        ("cold_document_32k", "`/v1/route`, cold one-message document", None),
        ("cold_document_128k", "`/v1/route`, cold one-message document", None),
    ];
    for (name, what, target) in route {
        let Some(v) = get(f, "route", name) else {
            continue;
        };
        used.push(v);
        let p50 = num(v, "p50_ms");
        let tokens = num(v, "tokens").map_or(String::new(), |t| format!(" (~{t:.0} tokens)"));
        let fig = format!("p50 **{}** ms, p99 {} ms", fmt3(p50), fmt3(num(v, "p99_ms")));
        let (label, verdict) = target
            .map_or(("", String::new()), |(label, bound)| (label, verdict(p50, bound, false)));
        row(&mut s, &format!("{what}{tokens}"), fig, label, verdict);
    }
    let solo = get(f, "route", "shared_prefix_48k");
    if let Some(v) = solo {
        used.push(v);
        let tokens = num(v, "tokens").map_or(String::new(), |t| format!(" (~{t:.0} tokens held)"));
        let rate = num(v, "routes_per_s")
            .map_or(String::new(), |r| format!(", {r:.0} routes/s from one caller"));
        let fig = format!(
            "p50 **{}** ms, p99 {} ms{rate}",
            fmt3(num(v, "p50_ms")),
            fmt3(num(v, "p99_ms"))
        );
        row(
            &mut s,
            &format!("`/v1/route`, 48k-token shared prefix + a new turn{tokens}"),
            fig,
            "",
            String::new(),
        );
    }
    let warm = get(f, "route", "concurrent_64_warm");
    let cold = get(f, "route", "concurrent_64_cold");
    for (v, what) in [(warm, "warm 48k continuations"), (cold, "cold 8k chats")] {
        let Some(v) = v else { continue };
        used.push(v);
        let failed = num(v, "failed").map_or(String::new(), |n| format!(", {n:.0} shed or failed"));
        let fig = format!(
            "p50 **{}** ms, p99 **{}** ms{failed}",
            fmt3(num(v, "p50_ms")),
            fmt3(num(v, "p99_ms"))
        );
        row(
            &mut s,
            &format!("`/v1/route` under 64 concurrent callers (¾ warm, ¼ cold): {what}"),
            fig,
            "",
            String::new(),
        );
    }
    let alone = get(f, "route", "concurrent_48_warm_alone");
    if let Some(v) = alone {
        used.push(v);
        let fig =
            format!("p50 **{}** ms, p99 **{}** ms", fmt3(num(v, "p50_ms")), fmt3(num(v, "p99_ms")));
        row(
            &mut s,
            "`/v1/route` under the same 48 warm callers alone (no cold ones)",
            fig,
            "",
            String::new(),
        );
    }
    if let Some(line) = concurrency_note(warm, cold, solo, alone) {
        let _ = writeln!(s, "\n{line}\n");
    }
    for v in f.lines.iter().filter(|v| !used.iter().any(|u| std::ptr::eq(*u, *v))) {
        let what = format!(
            "{} {} {}",
            v["bench"].as_str().unwrap_or("?"),
            v["figure"].as_str().unwrap_or("?"),
            v["name"].as_str().unwrap_or("?")
        );
        row(&mut s, &what, format!("`{v}`"), "", String::new());
    }
    if f.lines.is_empty() {
        let _ = writeln!(s, "| no figures | — | | not measured |");
    }
    let _ = writeln!(
        s,
        "\nFrom `cargo bench -p kvmesh-indexer --bench index --bench route` ({source}). Apply rates are criterion's \
         estimate (slope of time over iterations); percentiles are hand-timed in the same run; route latencies go \
         through the indexer's axum router in-process (no socket). Targets are the indexer issue's. Performance is \
         reported, never asserted; on a shared 2-core machine figures vary by ±30% run to run."
    );
    if !f.bad_lines.is_empty() {
        let _ = writeln!(s, "\nLines that were not figures (ignored): {:?}.", f.bad_lines);
    }
    ExtraSection { title: TITLE.into(), markdown: s }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"{"bench":"index","figure":"apply","name":"decoded_block_ops_cache_resident","block_ops_per_s":6000000.0}
{"bench":"index","figure":"apply","name":"decoded_block_ops_800k_resident","block_ops_per_s":1500000.0}
{"bench":"index","figure":"find_matches","name":"512_blocks/1000_workers","p50_us":5.4,"p99_us":15.6}
{"bench":"index","figure":"find_matches","name":"64_blocks/16_workers","p50_us":0.9,"p99_us":3.3}
{"bench":"index","figure":"find_matches","name":"512_blocks/1000_workers/all_dirty","p50_us":45.0,"p99_us":70.0}
{"bench":"index","figure":"memory","name":"1 holder per block","bytes_per_entry":147.2,"estimated_bytes_per_entry":130.0}
not json
{"bench":"route","figure":"route","name":"continuation","tokens":9500,"p50_ms":0.83,"p99_ms":1.27}
{"bench":"route","figure":"route","name":"cold","tokens":9500,"p50_ms":49.6,"p99_ms":73.6}
{"bench":"route","figure":"new_thing","name":"x","value":1}
{"bench":"route","figure":"route","name":"cold_chat_32k","tokens":32100,"p50_ms":2.5,"p99_ms":4.0}
{"bench":"route","figure":"route","name":"cold_chat_128k","tokens":128400,"p50_ms":6.0,"p99_ms":9.0}
{"bench":"route","figure":"route","name":"cold_document_32k","tokens":32000,"p50_ms":2.0,"p99_ms":3.0}
{"bench":"route","figure":"route","name":"shared_prefix_48k","tokens":48100,"p50_ms":1.0,"p99_ms":2.0,"routes_per_s":900.0}
{"bench":"route","figure":"route","name":"concurrent_64_warm","p50_ms":3.0,"p99_ms":8.0,"failed":0}
{"bench":"route","figure":"route","name":"concurrent_64_cold","p50_ms":16.0,"p99_ms":40.0,"failed":0}
{"bench":"route","figure":"route","name":"concurrent_48_warm_alone","p50_ms":2.5,"p99_ms":5.0,"failed":0}
"#;

    #[test]
    fn renders_every_figure_with_its_target() {
        let f = parse(SAMPLE);
        assert_eq!(f.lines.len(), 16);
        assert_eq!(f.bad_lines, [7]);
        let md = section(&f, "bench-out/indexer/figures.jsonl").markdown;
        for want in [
            "| block events applied, one core, index otherwise empty (tables in cache) | **6.00 M block-ops/s** | ≥ 5 M/s | **met** (1.20× the bound) |",
            "| block events applied, one core, 800k blocks resident | **1.50 M block-ops/s** | ≥ 5 M/s | **missed** (0.30× the bound) |",
            "| `find_matches` 512 blocks × 1000 workers | p50 5.40 µs, p99 15.60 µs | p99 ≤ 10 µs | **missed** (1.56× the bound) |",
            "| `find_matches` 64 blocks × 16 workers | p50 0.90 µs, p99 3.30 µs |  |  |",
            "**147 B** per (block, worker) entry (130 B estimated)",
            "(~9500 tokens) | p50 **0.830** ms, p99 1.270 ms | p50 ≤ 1 ms | **met** (0.83× the bound) |",
            "route new_thing x",
            "bench-out/indexer/figures.jsonl",
            "| `find_matches` 512 blocks × 1000 workers, all dirty | p50 45.00 µs, p99 70.00 µs |  |  |",
            "not figures (ignored): [7]",
            "| `/v1/route`, the same size cold (nothing cached) (~9500 tokens) | p50 **49.600** ms, p99 73.600 ms | p50 ≤ 3 ms | **missed** (16.53× the bound) |",
            "| `/v1/route`, cold chat (~32100 tokens) | p50 **2.500** ms, p99 4.000 ms | p50 ≤ 3 ms | **met** (0.83× the bound) |",
            "| `/v1/route`, cold chat (~128400 tokens) | p50 **6.000** ms, p99 9.000 ms | p50 ≤ 3 ms | **missed** (2.00× the bound) |",
            "| `/v1/route`, cold one-message document (~32000 tokens) | p50 **2.000** ms, p99 3.000 ms |  |  |",
            "| `/v1/route`, 48k-token shared prefix + a new turn (~48100 tokens held) | p50 **1.000** ms, p99 2.000 ms, 900 routes/s from one caller |  |  |",
            "| `/v1/route` under 64 concurrent callers (¾ warm, ¼ cold): warm 48k continuations | p50 **3.000** ms, p99 **8.000** ms, 0 shed or failed |  |  |",
            "cold 8k chats | p50 **16.000** ms, p99 **40.000** ms",
            "| `/v1/route` under the same 48 warm callers alone (no cold ones) | p50 **2.500** ms, p99 **5.000** ms |  |  |",
            "Under 64 concurrent callers warm routes' p99 is 8.000 ms, 1.60× the same 48 warm callers' without the cold ones (p99 5.000 ms: what the cold routes drag up), 4.00× the same warm routes from one caller (p99 2.000 ms), 0.50× the cold routes' p50 (16.000 ms) beside them.",
        ] {
            assert!(md.contains(want), "missing {want:?} in\n{md}");
        }
        assert!(!md.contains("concurrent_64_warm"), "known figures are not listed raw: {md}");
    }

    #[test]
    fn empty_file_says_so() {
        let md = section(&parse(""), "x").markdown;
        assert!(md.contains("no figures"), "{md}");
    }
}
