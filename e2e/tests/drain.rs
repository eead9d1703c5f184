//! Rollouts must not cut streams. Envoy exits at once on SIGTERM, so before the kubelet sends it
//! the Envoy container's preStop hook asks Envoy for a graceful listener drain. This test runs that
//! hook — the command in `envoy/k8s/deployment.yaml`, read from the file, only its admin port
//! pointed at this stack's Envoy — while 20 long streaming requests are in flight: every stream
//! completes, and the listener stops accepting connections (after the harness's `--drain-time-s`)
//! while Envoy is still running, before the SIGTERM that follows the hook.

use std::process::Command;
use std::time::Duration;

use futures::StreamExt;
use kvmesh_e2e::client::filler;
use kvmesh_e2e::manifests::{envoy_prestop_command, SHIPPED_ENVOY_ADMIN_PORT};
use kvmesh_e2e::poll;
use kvmesh_e2e::procs::Proc;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const STREAMS: u64 = 20;

/// The shipped preStop command with its admin address pointed at `admin_port`.
fn prestop_hook(admin_port: u16) -> anyhow::Result<Command> {
    let shipped = envoy_prestop_command()?;
    let (from, to) =
        (format!("127.0.0.1/{SHIPPED_ENVOY_ADMIN_PORT}"), format!("127.0.0.1/{admin_port}"));
    anyhow::ensure!(
        shipped.iter().any(|a| a.contains(&from)),
        "the shipped preStop hook no longer talks to {from}: {shipped:?}"
    );
    let argv: Vec<String> = shipped.iter().map(|a| a.replace(&from, &to)).collect();
    let (program, args) = argv.split_first().ok_or_else(|| anyhow::anyhow!("empty preStop"))?;
    let mut cmd = Command::new(program);
    cmd.args(args);
    Ok(cmd)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_prestop_hook_lets_every_stream_finish() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    // Real-time decoding: 80 tokens at 20 ms each keep every stream open well into the drain.
    spec.sim_args = vec!["--itl-ms".into(), "20".into(), "--speedup".into(), "1".into()];
    let mut stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/completions");

    let (started_tx, mut started_rx) = tokio::sync::mpsc::channel::<()>(STREAMS as usize);
    let mut streams = Vec::new();
    for i in 0..STREAMS {
        // A client per stream: a connection per stream, as separate clients of a gateway have.
        let c = reqwest::Client::new();
        let (url, started) = (url.clone(), started_tx.clone());
        let body = json!({"model": "deepseek-v4", "prompt": filler(3000 + i, 60), "max_tokens": 80, "stream": true});
        streams.push(tokio::spawn(async move {
            let resp = c.post(&url).json(&body).send().await?;
            anyhow::ensure!(resp.status() == 200, "stream {i}: status {}", resp.status());
            let mut text = Vec::new();
            let mut chunks = resp.bytes_stream();
            let mut first = true;
            while let Some(chunk) = chunks.next().await {
                text.extend_from_slice(&chunk?);
                if std::mem::take(&mut first) {
                    let _ = started.send(()).await;
                }
            }
            Ok::<String, anyhow::Error>(String::from_utf8(text)?)
        }));
    }
    for _ in 0..STREAMS {
        started_rx
            .recv()
            .await
            .ok_or_else(|| anyhow::anyhow!("a stream ended before its first chunk"))?;
    }

    // Every stream is mid-flight: the kubelet runs the preStop hook (its process group is killed
    // when the test ends; the hook's trailing sleep only holds off the SIGTERM).
    let hook = Proc::spawn_group("prestop", prestop_hook(stack.admin_port)?, stack.dir())?;
    for (i, s) in streams.into_iter().enumerate() {
        let text = s.await??;
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "stream {i} was cut:\n{}",
            &text[text.len().saturating_sub(300)..]
        );
    }
    // The hook drained the listener: it stops accepting connections while Envoy still runs.
    let gateway = format!("127.0.0.1:{}", stack.gateway_port);
    poll::until("the gateway listener to stop accepting after the preStop hook", || {
        let gateway = gateway.clone();
        async move { tokio::net::TcpStream::connect(&gateway).await.is_err().then_some(()) }
    })
    .await?;
    let envoy = stack.envoy.as_mut().ok_or_else(|| anyhow::anyhow!("no envoy"))?;
    assert!(envoy.is_running(), "Envoy exited during the hook:\n{}", envoy.log_tail(40));
    drop(hook);
    // Then the kubelet's SIGTERM.
    envoy.terminate(Duration::from_secs(5));
    Ok(())
}
