//! One wasm trap must neither fail requests nor re-open header spoofing. A test-only build of the
//! filter (`--features test-trap`, built here into its own target dir) traps on a request
//! carrying `x-kvmesh-test-trap`. After the trap on both Envoy worker threads:
//! - requests are still served (the VM is bypassed or reloaded, never a 5xx for a healthy engine);
//! - a client's `x-gateway-destination-endpoint` is still ignored: Envoy's header_mutation filter
//!   strips it outside the VM (without the strip every spoofed request lands on the named worker);
//! - Envoy's wasm stats show the failure (what the `KvmeshWasmFilterFailed` alert reads);
//! - the VM comes back (FAIL_RELOAD) and requests are routed by the indexer again.
//!
//! Issue 43 T5: requests paused in the VM when it traps (waiting for a stopped indexer, on the one
//! worker thread of an Envoy run with `--concurrency 1`) are all answered within 5 s and leave no
//! booking. Envoy never resumes a stream whose VM failed (the dead VM's call answers are dropped);
//! what answers them is the short stream idle timeout of the `kvmesh_held` route, the route of a
//! request the filter has not let go (no `x-kvmesh-released` yet). The filter's route calls carry
//! their deadline, so the indexer, resumed, books nothing for the abandoned calls. And the short
//! timeout ends where the filter lets a request go: a response slower than it to its first byte —
//! routed, or not routable by the filter — is not cut.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvmesh_core::headers;
use kvmesh_e2e::client::{filler, post_json, SIM_WORKER};
use kvmesh_e2e::poll;
use kvmesh_e2e::procs::{build_filter_wasm, repo_root, Paused};
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const SPOOFED: usize = 12;

/// Builds the trapping filter into `target/test-trap` (never over the shipped artifact).
fn trap_wasm() -> anyhow::Result<PathBuf> {
    build_filter_wasm(&repo_root().join("target/test-trap"), &["test-trap"])
}

/// Points the harness at the trapping filter, built once per test binary (the harness reads the
/// module path from the environment; every test here wants the same module).
fn use_trap_wasm() -> anyhow::Result<()> {
    static BUILT: Mutex<bool> = Mutex::new(false);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !*built {
        std::env::set_var("KVMESH_WASM", trap_wasm()?);
        *built = true;
    }
    Ok(())
}

/// Envoy's stats whose name mentions wasm, as `name: value` lines.
async fn wasm_stats(stack: &Stack) -> anyhow::Result<String> {
    Ok(stack.client().get(stack.admin("/stats?filter=^wasm\\.")).send().await?.text().await?)
}

/// Traps the VM behind the test client's connection (one keep-alive connection: one Envoy
/// worker thread); the trapping requests themselves may fail.
async fn trap(stack: &Stack, c: &reqwest::Client, url: &str) {
    for i in 0..3u64 {
        let r = post_json(
            c,
            url,
            &json!({"prompt": filler(100 + i, 20), "max_tokens": 1}),
            &[("x-kvmesh-test-trap", "1")],
        )
        .await;
        eprintln!("trap request {i}: {:?}", r.as_ref().map(|r| r.status));
    }
    eprintln!("wasm stats after the traps:\n{}", wasm_stats(stack).await.unwrap_or_default());
}

async fn start(policy: &str) -> anyhow::Result<Stack> {
    let mut spec = StackSpec::aggregate(3);
    spec.filter_config = json!({"debug_headers": true});
    spec.wasm_failure_policy = policy.to_owned();
    Stack::start(spec).await
}

fn body(i: u64) -> serde_json::Value {
    json!({"model": "deepseek-v4", "prompt": filler(900 + i, 50), "max_tokens": 2})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trapped_vm_neither_fails_requests_nor_lets_clients_pick_hosts() -> anyhow::Result<()> {
    use_trap_wasm()?;

    // FAIL_OPEN: the trapped VM is bypassed, so only the strip outside wasm stands between a
    // client's destination header and the load balancer.
    let stack = start("FAIL_OPEN").await?;
    let c = reqwest::Client::builder().pool_max_idle_per_host(1).build()?;
    let url = stack.gateway("/v1/completions");
    let target = stack.worker("w2")?.http.clone();
    let r = post_json(&c, &url, &body(0), &[]).await?;
    assert!(
        r.status == 200 && r.mode().is_some(),
        "routed by the indexer before the trap: {} {}",
        r.status,
        r.text
    );
    trap(&stack, &c, &url).await;
    let (mut on_target, mut bypassed) = (0, 0);
    for i in 0..SPOOFED as u64 {
        let r = post_json(
            &c,
            &url,
            &body(200 + i),
            &[(headers::DESTINATION_ENDPOINT, target.as_str())],
        )
        .await?;
        assert_eq!(r.status, 200, "request {i} after the trap: {}", r.text);
        on_target += usize::from(r.header(SIM_WORKER) == Some("w2"));
        bypassed += usize::from(r.mode().is_none() && r.header(headers::DEBUG_FALLBACK).is_none());
    }
    eprintln!("FAIL_OPEN: {bypassed}/{SPOOFED} requests bypassed the VM, {on_target}/{SPOOFED} spoofed requests on w2");
    assert!(
        bypassed > 0,
        "no request bypassed the trapped VM: the test did not exercise the bypass"
    );
    assert!(
        on_target < SPOOFED,
        "every spoofed request went where the client said: the header reached the LB"
    );
    drop(stack);

    // FAIL_RELOAD (the shipped default): the VM comes back and routes again; Envoy counts it.
    let stack = start("FAIL_RELOAD").await?;
    let c = reqwest::Client::builder().pool_max_idle_per_host(1).build()?;
    let url = stack.gateway("/v1/completions");
    trap(&stack, &c, &url).await;
    let reloads = |stats: &str| -> u64 {
        stats
            .lines()
            .find_map(|l| l.strip_prefix("wasm.kvmesh.vm_reload_success: ")?.trim().parse().ok())
            .unwrap_or(0)
    };
    // A routed answer alone does not show the reload: a request that lands on the other worker
    // thread (a new connection after the trap's 503) meets that thread's healthy VM. So keep
    // sending until Envoy has counted a reload and the filter routes.
    let mut i = 1000;
    poll::until("a VM reload counted by Envoy, and the filter routing again", || {
        i += 1;
        let (c, url, b) = (c.clone(), url.clone(), body(i));
        let stack = &stack;
        async move {
            let r = post_json(&c, &url, &b, &[]).await.ok()?;
            let reloaded = reloads(&wasm_stats(stack).await.ok()?);
            (r.status == 200 && r.mode().is_some() && reloaded >= 1).then_some(())
        }
    })
    .await?;
    let stats = wasm_stats(&stack).await?;
    eprintln!("FAIL_RELOAD, at the end:\n{stats}");
    let prom = stack.client().get(stack.admin("/stats/prometheus")).send().await?.text().await?;
    eprintln!(
        "{}",
        prom.lines().filter(|l| l.contains("vm_reload")).collect::<Vec<_>>().join("\n")
    );
    assert!(reloads(&stats) >= 1, "Envoy did not report a VM reload:\n{stats}");
    Ok(())
}

/// Requests paused in the VM when it traps.
const PAUSED: usize = 8;
/// T5 (issue 43): every paused request is answered this soon after the trap — far below the
/// 300 s stream idle timeout that ended them before the `kvmesh_held` route.
const ANSWERED_WITHIN: Duration = Duration::from_secs(5);

/// One Envoy stat by its exact name, from the admin `/stats`.
async fn envoy_stat(stack: &Stack, name: &str) -> Option<u64> {
    let url = stack.admin(&format!("/stats?filter=^{}$", name.replace('.', "\\.")));
    let text = stack.client().get(url).send().await.ok()?.text().await.ok()?;
    text.lines().find_map(|l| l.split_once(": ").and_then(|(_, v)| v.trim().parse().ok()))
}

/// The indexer's bookings: in-flight routed requests summed over workers.
async fn bookings(stack: &Stack) -> Option<f64> {
    let m = stack.scrape(&stack.indexer_url("/metrics")).await.ok()?;
    Some(m.sum("kvmesh_worker_active_requests", &[]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_paused_in_a_trapping_vm_are_answered_fast_and_leak_no_booking(
) -> anyhow::Result<()> {
    use_trap_wasm()?;
    let mut spec = StackSpec::aggregate(2);
    // A route deadline long enough to trap the VM while the calls are out (1.5 s: the held
    // route's idle timeout stays at its 4 s floor), and a breaker that never opens.
    spec.filter_config =
        json!({"debug_headers": true, "indexer_timeout_ms": 1500, "breaker_failures": 1000});
    spec.envoy_concurrency = 1;
    let stack = &Stack::start(spec).await?;
    let url = stack.gateway("/v1/completions");
    // No client timeout: a hang shows as one.
    let c = reqwest::Client::new();
    let r = post_json(&c, &url, &body(0), &[]).await?;
    assert!(
        r.status == 200 && r.mode().is_some(),
        "routed before the trap: {} {}",
        r.status,
        r.text
    );
    // Its /v1/done has released its booking before the indexer stops.
    poll::until("the first request's booking released", || async move {
        (bookings(stack).await? == 0.0).then_some(())
    })
    .await?;

    let pid =
        stack.indexer.as_ref().map(|p| p.pid()).ok_or_else(|| anyhow::anyhow!("no indexer"))?;
    let paused = Paused::stop(pid)?;
    let calls_before =
        envoy_stat(stack, "cluster.kvmesh_indexer.upstream_rq_total").await.unwrap_or(0);
    let waiting: Vec<_> = (0..PAUSED as u64)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move {
                let r = post_json(&c, &url, &body(10 + i), &[]).await;
                (r, Instant::now())
            })
        })
        .collect();
    poll::until("every request paused on its route call to the stopped indexer", || async move {
        let now = envoy_stat(stack, "cluster.kvmesh_indexer.upstream_rq_total").await?;
        (now >= calls_before + PAUSED as u64).then_some(())
    })
    .await?;

    // One worker thread: the trap kills the VM those requests wait in.
    let trapped_at = Instant::now();
    let trap = tokio::spawn({
        let (c, url) = (reqwest::Client::new(), url.clone());
        async move {
            post_json(&c, &url, &body(99), &[("x-kvmesh-test-trap", "1")]).await.map(|r| r.status)
        }
    });
    let mut statuses = Vec::new();
    for (i, handle) in waiting.into_iter().enumerate() {
        let left = ANSWERED_WITHIN.saturating_sub(trapped_at.elapsed());
        let Ok(joined) = tokio::time::timeout(left, handle).await else {
            for stat in ["active", "timeout", "idle_timeout"] {
                let name = format!("http.kvmesh.downstream_rq_{stat}");
                eprintln!("{name} = {:?}", envoy_stat(stack, &name).await);
            }
            anyhow::bail!(
                "paused request {i} not answered {ANSWERED_WITHIN:?} after the trap (a stream \
                 paused in a dead VM is never resumed: it waits for the route's stream idle timeout)"
            );
        };
        let (reply, at) = joined?;
        let reply = reply?;
        eprintln!(
            "paused request {i}: {} after {:?} from the trap, {:?}",
            reply.status,
            at.saturating_duration_since(trapped_at),
            reply.text
        );
        statuses.push(reply.status);
    }
    eprintln!("the trapping request: {:?}", trap.await?);
    eprintln!("wasm stats after the trap:\n{}", wasm_stats(stack).await.unwrap_or_default());
    // Answered by an engine or with a fast error; which one is logged above.
    assert!(statuses.iter().all(|&s| s != 0), "answers: {statuses:?}");
    // The indexer resumes. It reads none, some or all of the calls Envoy gave up on (their
    // connections are closed: 0 and 7 of the 8 in the runs seen); past their deadline, each it
    // reads is refused (`caller_gone`) and books nothing. The reloaded VM routes again — a call
    // behind those in the indexer's accept queue — and then no booking is left.
    drop(paused);
    poll::until("the filter routing again after the reload", || {
        let (c, url) = (c.clone(), url.clone());
        async move {
            let r = post_json(&c, &url, &body(200), &[]).await.ok()?;
            (r.status == 200 && r.mode().is_some()).then_some(())
        }
    })
    .await?;
    poll::until("no booking left by the abandoned route calls", || async move {
        let m = stack.scrape(&stack.indexer_url("/metrics")).await.ok()?;
        let refused = m.sum("kvmesh_route_errors_total", &[("reason", "caller_gone")]);
        let booked = m.sum("kvmesh_worker_active_requests", &[]);
        eprintln!("indexer: {refused} abandoned calls refused, {booked} bookings");
        (booked == 0.0).then_some(())
    })
    .await?;
    Ok(())
}

/// Past the held route's idle timeout (4 s, see above) before the engine's first byte.
const SLOW_ENGINE_MS: u64 = 6000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_request_keeps_the_normal_idle_timeout() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    // Bodies over 2 KiB are too large for the filter to read: it lets them go unrouted.
    spec.filter_config = json!({"debug_headers": true, "max_body_bytes": 2048});
    let stack = &Stack::start(spec).await?;
    for w in &stack.workers {
        let r = stack
            .client()
            .post(w.url("/admin/faults"))
            .json(&json!({"extra_latency_ms": SLOW_ENGINE_MS}))
            .send()
            .await?;
        anyhow::ensure!(r.status().is_success(), "setting the slow engine fault");
    }
    let url = stack.gateway("/v1/completions");
    let c = reqwest::Client::new();
    // Not streamed: nothing reaches the client before the engine's whole answer. One request
    // routed by the indexer, one the filter could not read (it goes on without routing).
    let read = body(0);
    let routed = post_json(&c, &url, &read, &[]);
    let unread = json!({"model": "deepseek-v4", "prompt": filler(7, 400), "max_tokens": 2});
    let unrouted = post_json(&c, &url, &unread, &[]);
    let (routed, unrouted) = tokio::try_join!(routed, unrouted)?;
    eprintln!(
        "routed: {} {:?}; unrouted: {} {:?}",
        routed.status,
        routed.mode(),
        unrouted.status,
        unrouted.text
    );
    assert!(
        routed.status == 200 && routed.mode().is_some(),
        "a routed request slower than the held route's idle timeout: {} {}",
        routed.status,
        routed.text
    );
    assert!(
        unrouted.status == 200 && unrouted.mode().is_none(),
        "a request the filter could not read, slower than the held route's idle timeout: {} {}",
        unrouted.status,
        unrouted.text
    );
    Ok(())
}
