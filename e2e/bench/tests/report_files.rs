//! `report::generate` on real files: manifest + results + counters in, report.md + PNGs out.

// An integration-test crate: a panic is how a helper fails the test, as in #[test] bodies.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvmesh_bench::ceiling::Ceiling;
use kvmesh_bench::counters::{EngineCounters, PolicyCounters, RouterCounters};
use kvmesh_bench::manifest::{OverheadCase, PolicyEntry, RunManifest};
use kvmesh_bench::record::RequestRecord;
use kvmesh_bench::report::{generate, plots};
use kvmesh_bench::rng::SplitMix64;
use std::path::{Path, PathBuf};

const POLICIES: [(&str, f64, f64); 5] = [
    ("round_robin", 400.0, 0.05),
    ("least_request", 350.0, 0.06),
    ("ring_hash", 250.0, 0.20),
    ("kvmesh_approximate", 200.0, 0.22),
    ("kvmesh_precise", 150.0, 0.27),
];

fn write_run(dir: &Path) -> PathBuf {
    let workers: Vec<String> = (0..8).map(|i| format!("w{i}")).collect();
    let mut rng = SplitMix64::new(1);
    let mut entries = Vec::new();
    for (p, (name, ttft_mean, hit)) in POLICIES.iter().enumerate() {
        let pdir = dir.join(name);
        std::fs::create_dir_all(&pdir).unwrap();
        let mut lines = String::new();
        for i in 0..300u64 {
            let w = if p == 4 { i % 8 } else { rng.range_u64(0, 8) };
            let ttft = rng.exp(*ttft_mean) + 5.0;
            let rec = RequestRecord {
                index: i,
                scheduled_ms: i as f64 * 10.0,
                sent_ms: i as f64 * 10.0,
                ttft_ms: Some(ttft),
                e2e_ms: ttft + 300.0,
                status: Some(200),
                worker: Some(format!("w{w}")),
                input_tokens: Some(5000),
                max_tokens: 100,
                prompt_tokens: Some(5000),
                cached_tokens: Some((5000.0 * hit) as u64),
                output_tokens: Some(100),
                ..Default::default()
            };
            lines.push_str(&serde_json::to_string(&rec).unwrap());
            lines.push('\n');
        }
        std::fs::write(pdir.join("results.jsonl"), lines).unwrap();
        let counters = PolicyCounters {
            engines: workers
                .iter()
                .map(|w| EngineCounters {
                    worker: w.clone(),
                    endpoint: None,
                    prefix_cache_hits: hit * 1000.0,
                    prefix_cache_queries: 1000.0,
                    ..Default::default()
                })
                .collect(),
            router: name.starts_with("kvmesh").then(|| RouterCounters {
                overlap_blocks: hit * 1.05 * 100.0,
                isl_blocks: 100.0,
                hit_rate_sum: 30.0,
                hit_rate_count: 100.0,
                hit_rate_scale: 1.0,
                attribution: None,
            }),
        };
        std::fs::write(pdir.join("counters.json"), serde_json::to_string(&counters).unwrap())
            .unwrap();
        entries.push(PolicyEntry {
            name: name.to_string(),
            results: PathBuf::from(format!("{name}/results.jsonl")),
            counters: Some(PathBuf::from(format!("{name}/counters.json"))),
            notes: None,
        });
    }
    let manifest = RunManifest {
        title: Some("synthetic report".into()),
        workload: Some("synthetic".into()),
        window: Some("first 300 requests".into()),
        speedup: Some(10.0),
        workers,
        cache_capacity_blocks: Some(2048),
        engine_block_size: Some(16),
        ceiling: Some(Ceiling {
            requests: 300,
            blocks_total: 1000,
            blocks_reused: 284,
            tokens_total: 1000,
            tokens_reused: 289,
        }),
        commands: vec!["kvmesh-report --manifest run.json".into()],
        policies: entries,
        overhead: vec![OverheadCase {
            name: "chat_8k_continuation".into(),
            p50_added_ms: 0.7,
            ..Default::default()
        }],
        overhead_notes: None,
        extra_sections: vec![],
    };
    let path = dir.join("run.json");
    std::fs::write(&path, serde_json::to_string_pretty(&manifest).unwrap()).unwrap();
    path
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvmesh-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn report_with_plots() {
    let dir = scratch("report");
    let manifest = write_run(&dir);
    let out = generate(&manifest, &dir, Path::new(plots::DEFAULT_FONT)).unwrap();
    assert_eq!(out.plot_note, None, "fonts-dejavu-core is on the project's machine image");
    assert_eq!(out.plots.len(), 3);
    for p in &out.plots {
        let bytes = std::fs::read(p).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{}", p.display());
        assert!(bytes.len() > 10_000, "{} is suspiciously small", p.display());
    }
    let md = std::fs::read_to_string(&out.markdown).unwrap();
    for want in [
        "# synthetic report",
        "| kvmesh_precise | 27.0% | 0.95× |",
        "![TTFT CDF](ttft_cdf.png)",
        "![hit rate vs ceiling](hit_rate.png)",
        "![requests per worker](requests_per_worker.png)",
        "| precise max/mean tokens per worker ≤ 1.25 | 1.013 |",
        "| router overhead p50 ≤ 1 ms (8k-token chat continuation) | 0.700 ms |",
    ] {
        assert!(md.contains(want), "missing {want:?} in\n{md}");
    }
    if std::env::var_os("KVMESH_KEEP_REPORT").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn report_without_a_font_still_writes_markdown() {
    let dir = scratch("nofont");
    let manifest = write_run(&dir);
    let out = generate(&manifest, &dir, Path::new("/nonexistent/font.ttf")).unwrap();
    assert!(out.plots.is_empty());
    assert!(out.plot_note.unwrap().contains("fonts-dejavu-core"));
    let md = std::fs::read_to_string(&out.markdown).unwrap();
    assert!(md.contains("_Plots: not drawn: font /nonexistent/font.ttf"), "{md}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn missing_results_file_is_a_clear_error() {
    let dir = scratch("missing");
    let manifest = dir.join("run.json");
    std::fs::write(&manifest, r#"{"policies":[{"name":"x","results":"nope.jsonl"}]}"#).unwrap();
    let err = generate(&manifest, &dir, Path::new(plots::DEFAULT_FONT)).unwrap_err();
    assert!(err.to_string().contains("nope.jsonl"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
