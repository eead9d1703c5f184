//! Smoke run of the whole benchmark (issue 6, item 6): `kvmesh-bench policies` replays the first
//! 200 requests of the conversation trace through two policies (Envoy round_robin and kvmesh
//! precise) on real processes — vllm-sim workers, the indexer, Envoy with the filter — then
//! `kvmesh-bench overhead` measures the router overhead on a few ~1k-token samples (kvmesh's wasm
//! filter, its ext_proc endpoint picker and the plain twin listener of the same Envoy) into the
//! same directory, and `kvmesh-bench report`
//! writes one report of both with an indexer-figures section read from a small file. It checks that the tool works end to end, not how fast anything is: no timing
//! assertions.
//!
//! A second run exercises the load sweep (`kvmesh-bench sweep`): two workloads (sibling bursts and
//! agentic chat), round_robin's two-step ladder and kvmesh precise, 4-second points, and checks
//! that every point ran, was recorded, sampled and marked, and that the sweep section, the
//! headline and the plots were written. A third runs the replica curve at one rate behind two
//! gateways, each spread. The runs take turns (a lock), never two stacks at once.
//!
//! Needs the workspace binaries, Envoy and the wasm filter (`make build`), like the other
//! end-to-end tests. The child is stopped with SIGTERM on failure or deadline, so it tears its
//! stack down before exiting.

// An integration-test crate: a panic is how a helper fails the test, as in #[test] bodies.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvmesh_bench::counters::PolicyCounters;
use kvmesh_bench::manifest::RunManifest;
use kvmesh_bench::record::read_all;
use kvmesh_bench::report::sweep::SweepReport;
use serde_json::Value;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const REQUESTS: usize = 200;
const OVERHEAD_SAMPLES: u64 = 5;
/// One benchmark child at a time: each starts whole stacks.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The benchmark child; SIGTERM (then SIGKILL) on drop so its stack is torn down.
struct Bench(Child);

impl Bench {
    fn wait(&mut self, deadline: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + deadline;
        while Instant::now() < end {
            if let Ok(Some(status)) = self.0.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        None
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = Command::new("kill").args(["-TERM", &self.0.id().to_string()]).status();
            // Longer than the harness patience a blocking stack start may hold the signal for.
            if self.wait(kvmesh_e2e::poll::patience() + Duration::from_secs(15)).is_none() {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
    }
}

/// The bound on one whole bench run (not a wait for one condition: that is the harness patience).
fn run_timeout() -> Duration {
    std::env::var("KVMESH_BENCH_SMOKE_TIMEOUT_S")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .map_or(Duration::from_secs(900), Duration::from_secs_f64)
}

/// Runs `kvmesh-bench` with `args` into `out`; panics with the log tail unless it succeeds.
fn run_bench(tag: &str, out: &PathBuf, args: &[&str]) {
    let log_path =
        std::env::temp_dir().join(format!("kvmesh-bench-smoke-{tag}-{}.log", std::process::id()));
    let log = std::fs::File::create(&log_path).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvmesh-bench"));
    cmd.arg("--out").arg(out).args(args).stdout(log.try_clone().unwrap()).stderr(log);
    let mut bench = Bench(cmd.spawn().unwrap());
    let status = bench.wait(run_timeout());
    let log_text = std::fs::read_to_string(&log_path).unwrap_or_default();
    let tail: String = log_text
        .lines()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n");
    let status = status
        .unwrap_or_else(|| panic!("kvmesh-bench did not finish in {:?}:\n{tail}", run_timeout()));
    assert!(status.success(), "kvmesh-bench failed ({status}):\n{tail}");
}

#[test]
fn a_small_sweep_measures_marks_and_reports_every_point() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out: PathBuf =
        std::env::temp_dir().join(format!("kvmesh-bench-sweep-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    run_bench(
        "sweep",
        &out,
        &[
            "sweep",
            "--workloads",
            "siblings,agentic",
            "--policies",
            "round_robin,kvmesh_precise",
            "--max-steps",
            "2",
            "--factor",
            "3",
            "--fractions",
            "0.8",
            "--duration-s",
            "4",
            "--start-rate",
            "0.5",
            "--workers",
            "2",
            "--sim-speedup",
            "20",
            "--request-timeout-s",
            "60",
        ],
    );
    let report: SweepReport =
        serde_json::from_str(&std::fs::read_to_string(out.join("sweep/sweep.json")).unwrap())
            .unwrap();
    let names: Vec<&str> = report.workloads.iter().map(|w| w.workload.as_str()).collect();
    assert_eq!(names, ["siblings", "agentic"]);
    for w in &report.workloads {
        assert_eq!(w.policies(), ["round_robin", "kvmesh_precise"], "{}", w.workload);
        let rr = w.points.iter().filter(|p| p.policy == "round_robin").count();
        assert!(rr >= 2, "{}: the ladder measured round_robin twice at least", w.workload);
        for p in &w.points {
            assert_eq!(p.error, None, "{} {} {}", w.workload, p.policy, p.rate);
            let recs = read_all(std::io::BufReader::new(
                std::fs::File::open(out.join("sweep").join(&p.dir).join("results.jsonl")).unwrap(),
            ))
            .unwrap();
            assert_eq!(
                recs.len(),
                p.requests + p.warmup_requests,
                "{}: every request recorded",
                p.dir
            );
            if w.workload == "agentic" {
                // Steady state: a warm-up before the window, whose requests are sent and not counted.
                assert!(
                    p.window.steady && p.window.warmup_s > 0.0 && p.warmup_requests > 0,
                    "{}: {:?} {}",
                    p.dir,
                    p.window,
                    p.warmup_requests
                );
                assert!(
                    p.turns_per_s.is_some_and(|t| t > 0.0)
                        && p.ceiling_counts.is_some_and(|c| c.requests as usize == p.requests),
                    "{}",
                    p.dir
                );
            }
            assert!(
                p.requests > 0 && p.ok * 10 >= p.requests * 9,
                "{}: {} of {} ok",
                p.dir,
                p.ok,
                p.requests
            );
            assert!(
                p.ceiling.is_some() && p.engine_hit_rate.is_some() && p.usage_hit_rate.is_some(),
                "{}",
                p.dir
            );
            assert!(
                p.machine.cpu_busy_mean.is_some() && p.machine.sim_cpu_s.is_some(),
                "{}: machine sampled",
                p.dir
            );
            assert!(p.lateness_p90_ms.is_some(), "{}", p.dir);
            assert_eq!(p.valid(), p.invalid.is_empty(), "{}", p.dir);
        }
    }
    let siblings = &report.workloads[0];
    assert!(
        siblings.points.iter().all(|p| p.ceiling.is_some_and(|c| c > 0.5)),
        "bursts of ≥ 4 identical prompts reuse ≥ 3/4"
    );
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        md.contains("## Load sweep")
            && md.contains("### Headline at the load point")
            && md.contains("### Workload `agentic`"),
        "{md}"
    );
    for png in
        ["sweep_siblings_ttft_p90.png", "sweep_siblings_hit_rate.png", "sweep_agentic_ttft_p90.png"]
    {
        assert!(out.join(png).exists(), "{png} written");
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_replica_curve_runs_every_policy_behind_two_gateways_each_spread() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out: PathBuf =
        std::env::temp_dir().join(format!("kvmesh-bench-replicas-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    run_bench(
        "replicas",
        &out,
        &[
            "sweep",
            "--workloads",
            "agentic",
            "--policies",
            "round_robin,kvmesh_precise",
            "--rates",
            "0.5",
            "--duration-s",
            "4",
            "--warmup-s",
            "2",
            "--workers",
            "2",
            "--sim-speedup",
            "20",
            "--request-timeout-s",
            "60",
            "--replicas",
            "1,2",
            "--replica-spread",
            "per-connection,per-request",
        ],
    );
    let report: SweepReport =
        serde_json::from_str(&std::fs::read_to_string(out.join("sweep/sweep.json")).unwrap())
            .unwrap();
    let w = &report.workloads[0];
    assert_eq!(w.points.len(), 2, "one gateway: both policies at the rate");
    // kvmesh under both spreads, round_robin under the first only.
    let ran: Vec<(&str, usize, &str)> = w
        .replica_points
        .iter()
        .map(|p| (p.policy.as_str(), p.replicas.count, p.replicas.spread.name()))
        .collect();
    assert_eq!(
        ran,
        [
            ("round_robin", 2, "per-connection"),
            ("kvmesh_precise", 2, "per-connection"),
            ("kvmesh_precise", 2, "per-request")
        ]
    );
    for p in &w.replica_points {
        assert_eq!(p.error, None, "{}", p.dir);
        assert!(
            p.requests > 0 && p.ok * 10 >= p.requests * 9,
            "{}: {} of {} ok",
            p.dir,
            p.ok,
            p.requests
        );
        assert!(p.session_moves.is_some() && p.load_cov.is_some(), "{}", p.dir);
        // A second gateway ran (and, the spreads sending it every other session or request, the
        // ok count above says it served).
        let replica = out.join("sweep").join(&p.dir).join("stack-replica1/envoy.yaml");
        assert!(replica.exists(), "{}: no second gateway ({})", p.dir, replica.display());
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("### Gateway replicas: `agentic`"), "{md}");
    for png in ["sweep_agentic_replicas_hit.png", "sweep_agentic_replicas_ttft.png"] {
        assert!(out.join(png).exists(), "{png} written");
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn two_policies_replay_the_trace_and_write_the_report() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out: PathBuf =
        std::env::temp_dir().join(format!("kvmesh-bench-smoke-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let figures = std::env::temp_dir()
        .join(format!("kvmesh-bench-smoke-{}-figures.jsonl", std::process::id()));
    std::fs::write(&figures, "{\"bench\":\"route\",\"figure\":\"route\",\"name\":\"continuation\",\"p50_ms\":0.5,\"p99_ms\":0.9}\n").unwrap();
    // Two parts into one `--out`, then one report of both (as `make bench` does with the sweep).
    run_bench(
        "policies",
        &out,
        &[
            "policies",
            "--policies",
            "round_robin,kvmesh_precise",
            "--first",
            &REQUESTS.to_string(),
            "--workers",
            "2",
            "--speedup",
            "50",
            "--num-gpu-blocks",
            "16384",
            "--request-timeout-s",
            "120",
        ],
    );
    run_bench(
        "overhead",
        &out,
        &[
            "overhead",
            "--workers",
            "2",
            "--num-gpu-blocks",
            "16384",
            "--request-timeout-s",
            "120",
            "--sizes",
            "1k",
            "--shared-prefixes",
            "1k",
            "--samples",
            &OVERHEAD_SAMPLES.to_string(),
            "--bases",
            "1",
            "--rps-seconds",
            "0.5",
            "--rps-rounds",
            "1",
            "--rps-concurrency",
            "2",
        ],
    );
    let figures_arg = figures.to_string_lossy().into_owned();
    run_bench(
        "report",
        &out,
        &["report", "--parts", "policies,overhead", "--indexer-figures", &figures_arg],
    );

    let manifest = RunManifest::load(&out.join("run.json")).unwrap();
    assert_eq!(manifest.workers.len(), 2);
    assert_eq!(manifest.ceiling.map(|c| c.requests), Some(REQUESTS as u64));
    let names: Vec<&str> = manifest.policies.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["round_robin", "kvmesh_precise"]);
    for p in &manifest.policies {
        let file = std::fs::File::open(out.join(&p.results)).unwrap();
        let recs = read_all(std::io::BufReader::new(file)).unwrap();
        assert_eq!(recs.len(), REQUESTS, "{}: every request is recorded", p.name);
        let ok = recs.iter().filter(|r| r.ok()).count();
        assert!(ok * 10 >= REQUESTS * 9, "{}: only {ok} of {REQUESTS} succeeded", p.name);
        assert!(
            recs.iter().filter(|r| r.ok()).all(|r| r.worker.is_some() && r.prompt_tokens.is_some()),
            "{}",
            p.name
        );
        let counters: PolicyCounters = serde_json::from_str(
            &std::fs::read_to_string(out.join(p.counters.as_ref().unwrap())).unwrap(),
        )
        .unwrap();
        let queried: f64 = counters.engines.iter().map(|e| e.prefix_cache_queries).sum();
        assert!(queried > 0.0, "{}: engines counted prefix-cache queries", p.name);
        assert_eq!(
            counters.router.is_some(),
            p.name == "kvmesh_precise",
            "{}: router counters only for kvmesh",
            p.name
        );
    }
    let names: Vec<&str> = manifest.overhead.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "chat_1k_cold",
            "chat_1k_cold_ext_proc",
            "chat_1k_continuation",
            "chat_1k_continuation_ext_proc",
            "chat_1k_shared_prefix",
            "chat_1k_shared_prefix_ext_proc",
            "chat_1k_cold_local_route",
            "chat_1k_continuation_local_route"
        ],
        "{:?}",
        manifest.overhead_notes
    );
    for c in &manifest.overhead {
        assert_eq!(
            c.samples,
            Some(OVERHEAD_SAMPLES),
            "{}: every sample measured on both paths",
            c.name
        );
        assert!(c.prompt_tokens.is_some_and(|t| t > 500.0), "{}: ~1k-token prompts", c.name);
        assert!(c.rps_kvmesh.is_some() && c.rps_plain.is_some(), "{}: requests/s measured", c.name);
        if !c.name.ends_with("_local_route") {
            assert!(
                c.routes_per_indexer_core.is_some(),
                "{}: the indexer's CPU read around its requests/s round",
                c.name
            );
            assert!(
                c.cpu_ms_per_request.is_some() && c.plain_cpu_ms_per_request.is_some(),
                "{}: CPU per request per process read around the requests/s rounds",
                c.name
            );
        }
    }
    let samples = std::fs::read_to_string(out.join("overhead/samples.jsonl")).unwrap();
    assert_eq!(
        samples.lines().count() as u64,
        3 * 3 * OVERHEAD_SAMPLES,
        "three cases × three paths (wasm, ext_proc, plain)"
    );
    // Through real Envoy's ext_proc filter: every picker sample was answered and routed by the
    // indexer's pipeline (a decision in its debug headers, the indexer's timers moved).
    let picker: Vec<Value> = samples
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|s| s["path"] == "ext_proc")
        .collect();
    assert_eq!(picker.len() as u64, 3 * OVERHEAD_SAMPLES);
    assert!(
        picker
            .iter()
            .all(|s| s["status"] == 200 && s["fallback"].is_null() && !s["gateway_ms"].is_null()),
        "the picker routed every sample: {picker:?}"
    );
    // Through real Envoy: with `local_route_max_body_bytes` the filter answered every 1k request
    // itself (its debug reason says so, and the indexer's timers never moved for them).
    let local = std::fs::read_to_string(out.join("local-route/overhead/samples.jsonl")).unwrap();
    let kvmesh: Vec<Value> = local
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|s| s["path"] == "kvmesh")
        .collect();
    assert_eq!(kvmesh.len() as u64, 2 * OVERHEAD_SAMPLES, "two cases on the kvmesh path");
    assert!(
        kvmesh.iter().all(|s| s["indexer_ms"].is_null()),
        "routed without the indexer: {kvmesh:?}"
    );
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("| kvmesh_precise |") && md.contains("## Targets"), "{md}");
    assert!(md.contains("## Router overhead") && md.contains("| chat_1k_continuation |"), "{md}");
    assert!(
        md.contains("### Side by side") && md.matches("| chat_1k_continuation |").count() == 2,
        "the picker beside the filter: {md}"
    );
    assert!(md.contains("## Indexer microbenchmarks") && md.contains("p50 ≤ 1 ms"), "{md}");
    for png in ["ttft_cdf.png", "hit_rate.png", "requests_per_worker.png"] {
        assert!(out.join(png).exists(), "{png} written");
    }
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_file(&figures);
}
