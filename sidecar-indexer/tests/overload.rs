//! Overload protection of the real binary (issue 14 item 7): a burst of 200 concurrent cold
//! 32k-token chats, all sent at once to an indexer bounded to one route call at a time
//! (`max_concurrent_routes = 1`, so the shedding does not depend on how fast this machine
//! tokenizes), is partly shed with a fast 503 `overloaded_shed` (the filter routes those without
//! the indexer), memory stays bounded (peak RSS < 1 GB), and once the admitted work has drained —
//! including tokenizations whose callers gave up — warm continuations are admitted again.
//! The latency target after the burst (route p99 < 5 ms) is a benchmark figure, not asserted here.

// Test helpers fail by panicking; the production lints on panics and unwraps do not apply.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::Command;

use common::{eventually, indexer_binary, Proc};
use serde_json::{json, Value};

const VOCAB: &[&str] = &[
    "router", "cache", "prefix", "block", "worker", "engine", "token", "mesh", "envoy", "latency",
    "session", "decode", "prefill", "index",
];

/// About `words` words of deterministic text, different for each `seed`.
fn text(seed: u64, words: usize) -> String {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::with_capacity(words * 8);
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(' ');
        }
        out.push_str(VOCAB[(x % VOCAB.len() as u64) as usize]);
        if x.is_multiple_of(7) {
            out.push_str(&(x % 1000).to_string());
        }
    }
    out
}

fn chat(messages: &[(&str, String)]) -> String {
    let msgs: Vec<Value> = messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect();
    json!({"model": "m", "messages": msgs}).to_string()
}

async fn post(http: &reqwest::Client, ix: &str, body: String) -> (u16, Option<String>) {
    match http
        .post(format!("http://{ix}/v1/route"))
        .header("x-kvmesh-path", "/v1/chat/completions")
        .body(body)
        .send()
        .await
    {
        Ok(r) => (
            r.status().as_u16(),
            r.headers().get("x-kvmesh-error").and_then(|v| v.to_str().ok()).map(str::to_owned),
        ),
        Err(e) => panic!("route call failed: {e}"),
    }
}

fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
}

fn peak_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_cold_long_chats_is_shed_and_memory_stays_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.toml");
    let fleet = "listen = \"127.0.0.1:9\"\n[model]\nname = \"m\"\nblock_size = 16\n[routing]\nunhealthy_after_failures = 0\nmax_concurrent_routes = 1\n\
        [[workers]]\nid = \"w0\"\nrole = \"decode\"\nendpoint = \"127.0.0.1:1\"\n[[workers]]\nid = \"w1\"\nrole = \"decode\"\nendpoint = \"127.0.0.1:2\"\n";
    std::fs::write(&path, fleet).unwrap();
    let mut cmd = Command::new(indexer_binary());
    cmd.arg("--config").arg(&path).args(["--listen", "127.0.0.1:0"]);
    let p = Proc::start("indexer", cmd, dir.path());
    let ix = p.field("http");
    let http = reqwest::Client::builder().pool_max_idle_per_host(256).build().unwrap();

    // ~32k tokens each: a system prompt and a question, all different (cold).
    let conversation =
        |i: u64| vec![("system", text(i * 2 + 1, 26_000)), ("user", text(i * 2 + 2, 200))];
    let probe: Value =
        common::route_path(&http, &ix, "/v1/chat/completions", chat(&conversation(1_000_000)))
            .await;
    let tokens = probe["isl_blocks"].as_u64().unwrap() * 16;
    assert!((30_000..40_000).contains(&tokens), "a chat of {tokens} tokens");
    let burst: Vec<_> = (0..200u64)
        .map(|i| {
            let (http, ix, body) = (http.clone(), ix.clone(), chat(&conversation(i)));
            // All at once: 200 concurrent clients (well within the 5 s).
            tokio::spawn(async move { (i, post(&http, &ix, body).await) })
        })
        .collect();
    let mut served = Vec::new();
    let mut shed = 0;
    for t in burst {
        let (i, (status, reason)) = t.await.unwrap();
        match (status, reason.as_deref()) {
            (200, _) => served.push(i),
            (503, Some("overloaded_shed")) => shed += 1,
            other => panic!("chat {i}: unexpected answer {other:?}"),
        }
    }
    assert!(shed > 0, "the burst was never shed ({} served)", served.len());
    assert!(!served.is_empty(), "nothing was admitted");
    let metrics =
        http.get(format!("http://{ix}/metrics")).send().await.unwrap().text().await.unwrap();
    assert_eq!(
        metric(&metrics, "kvmesh_route_errors_total{model=\"m\",reason=\"overloaded_shed\"}"),
        Some(f64::from(shed)),
        "{metrics}"
    );
    let rss = peak_rss_bytes(p.pid());
    assert!(rss < 1 << 30, "peak RSS {rss} bytes");

    // Drained (abandoned tokenizations included), warm continuations are admitted again.
    eventually("the route work to drain", || async {
        let m = http
            .get(format!("http://{ix}/metrics"))
            .send()
            .await
            .map_err(|e| e.to_string())?
            .text()
            .await
            .map_err(|e| e.to_string())?;
        match metric(&m, "kvmesh_route_inflight") {
            Some(0.0) => Ok(()),
            v => Err(format!("in flight: {v:?}")),
        }
    })
    .await;
    for &i in served.iter().take(10) {
        let mut turns = conversation(i);
        turns.push(("assistant", text(10_000 + i, 30)));
        turns.push(("user", text(20_000 + i, 30)));
        let (status, reason) = post(&http, &ix, chat(&turns)).await;
        assert_eq!((status, reason), (200, None), "continuation of chat {i}");
    }
    eprintln!("burst: {} served, {shed} shed; peak RSS {} MiB", served.len(), rss >> 20);
}
