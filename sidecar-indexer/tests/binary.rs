//! The real binary on a real socket: READY line with the bound port, probes, a route, and reloads
//! by SIGHUP and by file change (a bad file changes nothing).

// Test helpers fail by panicking; the production lints on panics and unwraps do not apply.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::Command;

use common::{eventually, indexer_binary, route, Proc};
use serde_json::Value;

fn fleet(workers: &[&str]) -> String {
    let mut s = String::from(
        "listen = \"127.0.0.1:9\"\n[model]\nname = \"m\"\nblock_size = 16\n[gateway]\nlisten = \"127.0.0.1:8080\"\n[routing]\nunhealthy_after_failures = 0\nreload_poll_ms = 100\nscrape_interval_ms = 200\nscrape_timeout_ms = 100\n",
    );
    for (i, w) in workers.iter().enumerate() {
        s.push_str(&format!(
            "[[workers]]\nid = \"{w}\"\nrole = \"decode\"\nendpoint = \"127.0.0.1:{}\"\n",
            1 + i
        ));
    }
    s
}

async fn fleet_ids(http: &reqwest::Client, ix: &str) -> Result<Vec<String>, String> {
    let v: Value = http
        .get(format!("http://{ix}/v1/fleet"))
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    Ok(v["workers"]
        .as_array()
        .ok_or("no workers")?
        .iter()
        .map(|w| w["id"].as_str().unwrap_or("").to_owned())
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_and_reloads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.toml");
    std::fs::write(&path, fleet(&["w0", "w1"])).unwrap();

    // --check validates and prints the normalised configuration.
    let out =
        Command::new(indexer_binary()).arg("--config").arg(&path).arg("--check").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("overlap_credit = 1.0"));

    let mut cmd = Command::new(indexer_binary());
    cmd.arg("--config").arg(&path).args(["--listen", "127.0.0.1:0"]);
    let p = Proc::start("indexer", cmd, dir.path());
    let ix = p.field("http");
    assert!(!ix.ends_with(":0"), "READY reports the bound port: {ix}");
    assert_eq!(p.ready, format!("READY http={ix}"));
    // Transparent huge pages are off for the process (src/main.rs: they made RSS move in 2 MiB steps
    // in the soak). Kernels before 5.0 do not report the flag.
    let status = std::fs::read_to_string(format!("/proc/{}/status", p.pid())).unwrap();
    match status.lines().find_map(|l| l.strip_prefix("THP_enabled:")) {
        Some(v) => assert_eq!(v.trim(), "0", "THP_enabled in /proc/<pid>/status"),
        None => eprintln!("this kernel does not report THP_enabled; not checked"),
    }
    let http = reqwest::Client::new();
    for probe in ["/healthz", "/readyz", "/metrics", "/debug/workers"] {
        assert!(
            http.get(format!("http://{ix}{probe}")).send().await.unwrap().status().is_success(),
            "{probe}"
        );
    }
    let d: Value =
        route(&http, &ix, r#"{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#).await;
    assert_eq!(d["mode"], "aggregate");
    assert_eq!(d["isl_blocks"], 1);
    let bad = http
        .post(format!("http://{ix}/v1/route"))
        .header("x-kvmesh-path", "/v1/completions")
        .body("nope")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status().as_u16(), 400);

    // SIGHUP: w1 leaves, w2 joins.
    std::fs::write(&path, fleet(&["w0", "w2"])).unwrap();
    assert!(Command::new("kill").args(["-HUP", &p.pid().to_string()]).status().unwrap().success());
    eventually("reload by SIGHUP", || async {
        let ids = fleet_ids(&http, &ix).await?;
        if ids == ["w0", "w2"] {
            Ok(())
        } else {
            Err(format!("{ids:?}"))
        }
    })
    .await;

    // A broken file changes nothing and is counted.
    std::fs::write(&path, "listen = \n").unwrap();
    eventually("bad reload counted", || async {
        let text = http
            .get(format!("http://{ix}/metrics"))
            .send()
            .await
            .map_err(|e| e.to_string())?
            .text()
            .await
            .map_err(|e| e.to_string())?;
        if text.contains("kvmesh_config_reloads_total{result=\"error\"}") {
            Ok(())
        } else {
            Err("no error reload yet".into())
        }
    })
    .await;
    assert_eq!(fleet_ids(&http, &ix).await.unwrap(), ["w0", "w2"]);

    // A plain file change is picked up without a signal.
    std::fs::write(&path, fleet(&["w0", "w2", "w3"])).unwrap();
    eventually("reload on file change", || async {
        let ids = fleet_ids(&http, &ix).await?;
        if ids == ["w0", "w2", "w3"] {
            Ok(())
        } else {
            Err(format!("{ids:?}"))
        }
    })
    .await;
}
