//! One wasm trap must neither fail requests nor re-open header spoofing. A test-only build of the
//! filter (`--features test-trap`, built here into its own target dir) traps on a request
//! carrying `x-kvmesh-test-trap`. After the trap on both Envoy worker threads:
//! - requests are still served (the VM is bypassed or reloaded, never a 5xx for a healthy engine);
//! - a client's `x-gateway-destination-endpoint` is still ignored: Envoy's header_mutation filter
//!   strips it outside the VM (without the strip every spoofed request lands on the named worker);
//! - Envoy's wasm stats show the failure (what the `KvmeshWasmFilterFailed` alert reads);
//! - the VM comes back (FAIL_RELOAD) and requests are routed by the indexer again.

use std::path::PathBuf;
use std::process::Command;

use kvmesh_core::headers;
use kvmesh_e2e::client::{filler, post_json, SIM_WORKER};
use kvmesh_e2e::poll;
use kvmesh_e2e::procs::repo_root;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const SPOOFED: usize = 12;

/// Builds the trapping filter into `target/test-trap` (never over the shipped artifact).
fn trap_wasm() -> anyhow::Result<PathBuf> {
    let target_dir = repo_root().join("target/test-trap");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "build",
            "-p",
            "kvmesh-filter",
            "--target",
            "wasm32-wasip1",
            "--profile",
            "wasm",
            "--features",
            "test-trap",
            "--target-dir",
        ])
        .arg(&target_dir)
        .current_dir(repo_root())
        .status()?;
    anyhow::ensure!(status.success(), "building the test-trap filter failed");
    Ok(target_dir.join("wasm32-wasip1/wasm/kvmesh_filter.wasm"))
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
    let wasm = trap_wasm()?;
    // This test binary runs this one test: the harness reads the module path from the environment.
    std::env::set_var("KVMESH_WASM", &wasm);

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
