//! What the real binary exposes where: the API (`/v1/*`) on `listen`, a `metrics_listen` that
//! serves only `/metrics` (with process memory), `/healthz` and `/readyz`, and `/debug/*` only when
//! allowed (by default: `listen` on loopback; `debug_endpoints = false` turns it off).

// Test helpers fail by panicking; the production lints on panics and unwraps do not apply.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::Command;

use common::{indexer_binary, Proc};

fn fleet(extra: &str) -> String {
    format!(
        "listen = \"127.0.0.1:0\"\nmetrics_listen = \"127.0.0.1:0\"\n{extra}[model]\nname = \"m\"\nblock_size = 16\n[routing]\nunhealthy_after_failures = 0\n[[workers]]\nid = \"w0\"\nrole = \"decode\"\nendpoint = \"127.0.0.1:1\"\n"
    )
}

async fn status(http: &reqwest::Client, addr: &str, path: &str) -> u16 {
    http.get(format!("http://{addr}{path}")).send().await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_listener_serves_metrics_and_probes_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.toml");
    std::fs::write(&path, fleet("")).unwrap();
    let mut cmd = Command::new(indexer_binary());
    cmd.arg("--config").arg(&path);
    let p = Proc::start("indexer", cmd, dir.path());
    let (api, metrics) = (p.field("http"), p.field("metrics"));
    assert_ne!(api, metrics);
    let http = reqwest::Client::new();
    for probe in ["/metrics", "/healthz", "/readyz"] {
        assert_eq!(status(&http, &metrics, probe).await, 200, "{probe} on metrics_listen");
    }
    for hidden in ["/v1/fleet", "/debug/workers", "/debug/blocks?worker=w0"] {
        assert_eq!(
            status(&http, &metrics, hidden).await,
            404,
            "{hidden} must not be on metrics_listen"
        );
    }
    let post = http.post(format!("http://{metrics}/v1/done")).body("{}").send().await.unwrap();
    assert_eq!(post.status().as_u16(), 404, "/v1/done must not be on metrics_listen");
    let text =
        http.get(format!("http://{metrics}/metrics")).send().await.unwrap().text().await.unwrap();
    for family in [
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "kvmesh_kv_event_limits_total",
    ] {
        assert!(text.contains(&format!("# TYPE {family} ")), "{family} missing from /metrics");
    }
    let rss = text
        .lines()
        .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap();
    assert!(rss > 1e6, "resident memory {rss} bytes");
    // The API listener is on loopback: it serves /v1/* and, by default, /debug/*.
    assert_eq!(status(&http, &api, "/v1/fleet").await, 200);
    assert_eq!(status(&http, &api, "/debug/workers").await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_endpoints_can_be_turned_off() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.toml");
    std::fs::write(&path, fleet("debug_endpoints = false\n")).unwrap();
    let mut cmd = Command::new(indexer_binary());
    cmd.arg("--config").arg(&path);
    let p = Proc::start("indexer", cmd, dir.path());
    let api = p.field("http");
    let http = reqwest::Client::new();
    assert_eq!(status(&http, &api, "/debug/workers").await, 404);
    assert_eq!(status(&http, &api, "/debug/blocks?worker=w0").await, 404);
    assert_eq!(status(&http, &api, "/v1/fleet").await, 200);
}
