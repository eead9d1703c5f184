//! What the part writes and says: every case's summary, the setup notes above the table, and
//! the samples file.

use super::*;

/// Every case's rows (per case: the wasm filter's, then the picker's when `ways` has it), and the
/// names of the rows without usable samples.
pub(super) fn case_summaries(
    all_cases: &[Case],
    ways: &[Way],
    samples: &[Sample],
    rates: &HashMap<(String, &'static str), Rate>,
) -> (Vec<OverheadCase>, Vec<String>) {
    let mut out_cases = Vec::new();
    let mut missing = Vec::new();
    for case in all_cases {
        let name = case.name();
        let p = rates.get(&(name.clone(), Way::Plain.tag())).copied();
        for &way in ways.iter().filter(|w| **w != Way::Plain) {
            let k = rates.get(&(name.clone(), way.tag())).copied();
            match summarize(&name, way, samples, k, p) {
                Some(c) => out_cases.push(c),
                None => missing.push(way.row_name(&name)),
            }
        }
    }
    (out_cases, missing)
}

/// The report's notes on the setup: the stack, the latency and requests/s phases, the shared
/// prefixes.
pub(super) fn setup_notes(
    args: &OverheadSettings,
    fleet: &Fleet,
    shape: &Shape,
    prime_fallbacks: u64,
    latency_s: f64,
    rates: &HashMap<(String, &'static str), Rate>,
) -> String {
    let rps_fallbacks: u64 =
        rates.iter().filter(|((_, w), _)| *w != Way::Plain.tag()).map(|(_, r)| r.fallbacks).sum();
    let rps_failed: u64 = rates.values().map(|r| r.failed).sum();
    let ext_proc = if args.ext_proc {
        ", the ext_proc listener (Envoy's ext_proc filter calling the indexer's endpoint picker, no wasm, \
         `failure_mode_allow: false`; rows `<case>_ext_proc`)"
    } else {
        ""
    };
    let mut notes = format!(
        "{} vllm-sim workers (`--speedup {}`, KV capacity {} blocks, KV events on), the indexer in precise mode, one Envoy \
         (`--concurrency 2`) with {} listeners: kvmesh (the filter with `debug_headers: true`{}){ext_proc} and the same \
         listener without the filter, routing to the same workers with least_request. Requests: streaming chat, \
         `max_tokens: 1`, no session header. Latency: {} samples per case and path, one request at a time, the paths \
         interleaved (order rotating), {} continuation bases per size primed through kvmesh in steps of ≤ {} tokens ({} \
         priming requests routed without the indexer); {:.0} s. Requests/s: {} closed-loop clients, {} round(s) × {} s per \
         path and case, order rotating, against a canned-response route (nothing forwarded, so the engines do not cap the \
         rate; the filter, the picker and the indexer do all their work){}. Per-request samples: `{}/samples.jsonl`.",
        fleet.workers,
        args.sim_speedup,
        fleet.num_gpu_blocks,
        if args.ext_proc { "three" } else { "two" },
        args.indexer_timeout_ms.map_or(", default `indexer_timeout_ms`".to_string(), |t| format!(", `indexer_timeout_ms: {t}`"))
            + &args.local_route_max_body_bytes.map_or(String::new(), |b| format!(", `local_route_max_body_bytes: {b}`")),
        args.samples,
        args.bases.max(1),
        shape.prime_step_tokens,
        prime_fallbacks,
        latency_s,
        args.rps_concurrency,
        args.rps_rounds,
        args.rps_seconds,
        if rps_fallbacks + rps_failed > 0 {
            format!(" ({rps_fallbacks} kvmesh requests routed without the indexer, {rps_failed} failed)")
        } else {
            String::new()
        },
        args.dir,
    );
    if !args.shared_prefixes.is_empty() {
        notes.push_str(&format!(
            " Shared prefix (`chat_<size>_shared_prefix`): one prefix per size (a conversation primed like a base), shared \
             by {} interleaved conversations, each growing on it by one turn per request (a reply and a new user message, \
             ≈ {:.0} tokens) for {} turns, then a new set starts; every request's last turn is new text. Route throughput \
             per indexer core = routes the indexer answered ÷ its CPU-seconds (`/proc/<pid>/stat`), read around each kvmesh \
             requests/s round until the indexer was idle again.",
            args.bases.max(1),
            shape.tail_tokens(),
            shape.shared_turns,
        ));
    }
    notes
}

/// The report's notes on samples left out.
pub(super) fn missing_notes(missing_log: usize, missing: &[String]) -> String {
    let mut notes = String::new();
    if missing_log > 0 {
        notes
            .push_str(&format!(" {missing_log} samples had no access-log line and were left out."));
    }
    if !missing.is_empty() {
        notes.push_str(&format!(" No usable samples for: {}.", missing.join(", ")));
    }
    notes
}

/// Writes one JSON line per sample.
pub(super) fn write_jsonl(path: &Path, samples: &[Sample]) -> Result<()> {
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    for s in samples {
        writeln!(f, "{}", serde_json::to_string(s)?)?;
    }
    f.flush()?;
    Ok(())
}
