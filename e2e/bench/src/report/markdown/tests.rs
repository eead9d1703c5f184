//! Unit tests of the report's Markdown rendering.

use super::super::summary::summarize;
use super::super::targets::evaluate;
use super::*;
use crate::ceiling::Ceiling;
use crate::manifest::{ExtraSection, PolicyEntry};
use crate::record::RequestRecord;

#[test]
fn report_states_the_run_and_every_policy() {
    let recs = vec![
        RequestRecord {
            index: 0,
            ttft_ms: Some(12.0),
            e2e_ms: 40.0,
            status: Some(200),
            worker: Some("w0".into()),
            ..Default::default()
        },
        RequestRecord {
            index: 1,
            e2e_ms: 3.0,
            error: Some("timeout after 1s".into()),
            ..Default::default()
        },
    ];
    let m = RunManifest {
        workload: Some("trace.jsonl".into()),
        window: Some("first 2 requests".into()),
        speedup: Some(8.0),
        workers: vec!["w0".into(), "w1".into()],
        cache_capacity_blocks: Some(1000),
        engine_block_size: Some(16),
        ceiling: Some(Ceiling {
            requests: 2,
            blocks_total: 10,
            blocks_reused: 3,
            tokens_total: 10,
            tokens_reused: 3,
        }),
        commands: vec!["kvmesh-bench --first 2".into()],
        policies: vec![PolicyEntry {
            name: "round_robin".into(),
            notes: Some("envoy rr".into()),
            ..Default::default()
        }],
        extra_sections: vec![ExtraSection {
            title: "Microbenchmarks".into(),
            markdown: "none yet".into(),
        }],
        ..Default::default()
    };
    let sums = vec![summarize("round_robin", &recs, None, &m.workers)];
    let targets = evaluate(&sums, m.ceiling.as_ref(), &m.overhead);
    let plots = PlotLinks {
        ttft_cdf: Some("ttft_cdf.png".into()),
        note: Some("font missing".into()),
        ..Default::default()
    };
    let md = render(&m, &sums, &targets, &plots);
    for want in [
        "| speed-up | 8.00 |",
        "2 workers (w0, w1)",
        "1000 blocks × 16 tokens = 16000 tokens per worker",
        "30.0% block-weighted",
        "kvmesh-bench --first 2",
        "| round_robin | 1 / 2 | 12.0 | 12.0 | 12.0 | 40.0 | 40.0 |",
        "![TTFT CDF](ttft_cdf.png)",
        "_Plots: font missing_",
        "1 × `timeout after 1s`",
        "not measured",
        "- **round_robin**: envoy rr",
        "## Microbenchmarks",
        "| round_robin | 1 | 0 |",
        "| round_robin | 2.000 | n/a | — | — |",
    ] {
        assert!(md.contains(want), "missing {want:?} in\n{md}");
    }
    assert!(!md.contains("NaN"));
}

#[test]
fn overhead_section_shows_every_case_and_the_target() {
    use crate::manifest::OverheadCase;
    let case = |name: &str, p50: f64| OverheadCase {
        name: name.into(),
        p50_added_ms: p50,
        p99_added_ms: Some(2.5),
        rps_kvmesh: Some(900.0),
        rps_plain: Some(1000.0),
        samples: Some(200),
        prompt_tokens: Some(8190.4),
        kvmesh_p50_ms: Some(0.8),
        plain_p50_ms: Some(0.1),
        fallbacks: Some(0),
        rps_kvmesh_fallback_share: (p50 > 1.0).then_some(0.25),
        ..Default::default()
    };
    let mut m = RunManifest {
        overhead: vec![case("chat_8k_cold", 40.0), case(OVERHEAD_TARGET_CASE, 0.7)],
        overhead_notes: Some("4 workers".into()),
        ..Default::default()
    };
    let md = render(&m, &[], &evaluate(&[], None, &m.overhead), &PlotLinks::default());
    assert!(
        md.contains("No single-replay policy comparison in this run")
            && !md.contains("## Cache hits"),
        "{md}"
    );
    assert!(
        !md.contains("precise engine hit rate"),
        "only the overhead target without a replay: {md}"
    );
    for want in [
        "## Router overhead",
        "4 workers",
        "| chat_8k_cold | 8190 | 200 | **40.000** | 2.500 | 0.800 / n/a | n/a / n/a / n/a / n/a | 0.100 / n/a | n/a / n/a | 0 | 900.0 (25% without the indexer) | 1000.0 | 0.900 **missed** (bought by routing without the indexer) | n/a |",
        "Target: requests/s per gateway ≥ 0.25× plain Envoy for every case: **missed** for 1 of 2 cases (`chat_8k_cold` 0.900× with 25% without the indexer).",
        "**met** — 0.700 ms, 0.300 ms under the bound (0.70× it)",
        "Target: added p99 ≤ 2 ms for `chat_8k_continuation`: **missed** — 2.500 ms, 0.500 ms over the bound (1.25× it)",
        "| 0.700 ms | 1 ms | **met** (ratio 0.700) | 0.300 ms under the bound |",
    ] {
        assert!(md.contains(want), "missing {want:?} in\n{md}");
    }
    m.overhead.pop();
    let md = render(&m, &[], &evaluate(&[], None, &m.overhead), &PlotLinks::default());
    assert!(md.contains("`chat_8k_continuation`: not measured in this run"), "{md}");
    assert!(overhead_verdict(1.3, OVERHEAD_TARGET_MS)
        .starts_with("**missed** — 1.300 ms, 0.300 ms over the bound (1.30× it)"));
    assert!(overhead_verdict(2.6, OVERHEAD_P99_TARGET_MS)
        .starts_with("**missed** — 2.600 ms, 0.600 ms over the bound (1.30× it)"));
    assert!(!md.contains("Shared prefix, cost per new turn"), "no shared-prefix case: {md}");
    let failed =
        RunManifest { overhead_notes: Some("**did not run**: boom".into()), ..Default::default() };
    assert!(render(&failed, &[], &[], &PlotLinks::default()).contains("**did not run**: boom"));
}

#[test]
fn throughput_and_shared_prefix_verdicts() {
    use crate::manifest::OverheadCase;
    let case = |name: &str, k: Option<f64>, tokens: f64, added: f64, indexer: f64| OverheadCase {
        name: name.into(),
        p50_added_ms: added,
        rps_kvmesh: k,
        rps_plain: Some(1000.0),
        prompt_tokens: Some(tokens),
        indexer_p50_ms: Some(indexer),
        routes_per_indexer_core: Some(1234.4),
        indexer_cores: Some(0.456),
        ..Default::default()
    };
    let mut cases = vec![
        case("chat_8k_cold", Some(16.0), 8192.0, 30.0, 29.0),
        case("chat_48k_shared_prefix", Some(300.0), 49_500.0, 0.9, 0.5),
        case("chat_8k_shared_prefix", Some(400.0), 8300.0, 0.6, 0.4),
    ];
    assert_eq!(throughput_verdict(&cases), "**missed** for 1 of 3 cases (`chat_8k_cold` 0.016×).");
    cases[0].rps_kvmesh = Some(250.0);
    assert_eq!(throughput_verdict(&cases), "**met** for all 3 measured cases (lowest 0.250×).");
    cases[0].rps_kvmesh = None;
    assert_eq!(throughput_verdict(&cases), "**not judged** (cases missing), met for all 2 measured cases (lowest 0.300×); not measured: `chat_8k_cold`.");
    assert_eq!(throughput_verdict(&cases[..1]), "not measured in this run.");
    cases[1].rps_kvmesh_fallback_share = Some(0.99);
    assert_eq!(
        throughput_verdict(&cases),
        "**missed** for 1 of 2 cases (`chat_48k_shared_prefix` 0.300× with 99% without the indexer); not measured: `chat_8k_cold`."
    );
    assert!(!rps_met(&cases[1]) && rps_met(&cases[2]));
    let mut local = case("chat_1k_cold_local_route", Some(450.0), 1030.0, 0.1, 0.0);
    local.local_route_max_body_bytes = Some(8192);
    let mut with_local = cases.clone();
    with_local.push(local);
    assert_eq!(
        throughput_verdict(&with_local),
        "**missed** for 1 of 2 cases (`chat_48k_shared_prefix` 0.300× with 99% without the indexer); not measured: `chat_8k_cold`. \
         With `local_route_max_body_bytes: 8192` (the filter routes these bodies alone, not KV-aware; not judged): `chat_1k_cold_local_route` 0.450×."
    );
    cases[1].rps_kvmesh_fallback_share = Some(0.01);
    let line = prefix_scaling(&cases).unwrap();
    assert!(
        line.starts_with("Shared prefix, cost per new turn: added p50 `chat_8k_shared_prefix` 0.600 ms → `chat_48k_shared_prefix` 0.900 ms (1.50×) (6.0× the prompt); the indexer's own p50 0.400 → 0.500 ms (1.25×): **follows the turn** (flat = within 1.5× of the smallest prefix's)."),
        "{line}"
    );
    assert_eq!(prefix_scaling(&cases[..2]), None, "one shared-prefix case: nothing to compare");
    let mut grows = cases.clone();
    grows[1].p50_added_ms = 0.91;
    let line = prefix_scaling(&grows).unwrap();
    assert!(
        line.contains("0.910 ms (1.52×) (6.0× the prompt)")
            && line.contains(": **grows with the prefix**"),
        "{line}"
    );
    let m = RunManifest { overhead: cases, ..Default::default() };
    let md = render(&m, &[], &evaluate(&[], None, &m.overhead), &PlotLinks::default());
    assert!(
        md.contains("| 0.300 met | 1234 (0.46) |") && md.contains("| n/a | 1234 (0.46) |"),
        "{md}"
    );
    assert!(md.contains("Shared prefix, cost per new turn"), "{md}");
    let mut fell_back = m.clone();
    fell_back.overhead[1].rps_kvmesh_fallback_share = Some(0.5);
    let md = render(&fell_back, &[], &[], &PlotLinks::default());
    assert!(md.contains("| 0.300 **missed** (bought by routing without the indexer) |"), "{md}");
}
