//! Decode-to-decode KV migration through real Envoy, the indexer and `vllm-sim` decode workers:
//! a session whose home worker is overloaded moves to another worker, which pulls the history's
//! blocks from the home over NIXL instead of recomputing them; a failing source falls back to
//! recompute; `dry` mode only counts. Answers stay what the engine would answer anyway.

use futures::StreamExt;
use kvmesh_core::api::{FleetSnapshot, ReasonCode};
use kvmesh_core::headers::DEFAULT_SESSION_HEADER;
use kvmesh_core::{rendezvous, session};
use kvmesh_e2e::client::{filler, post_json, Reply};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::{json, Value};

const BS: u64 = 16;
// Sessions' homes are their rendezvous workers here, so three sessions can be made to share one.
const ROUTING_ON: &str = "kv_migration = \"on\"\nkv_migration_min_tokens = 256\noverload_active_requests = 2\noverload_waiting_requests = 0\nreload_poll_ms = 100\nsession_placement = \"rendezvous\"\n";

fn chat(messages: &[(String, String)], max_tokens: u32, stream: bool) -> Value {
    let msgs: Vec<Value> = messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect();
    let mut body = json!({"model": "deepseek-v4", "messages": msgs, "max_tokens": max_tokens, "stream": stream});
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

fn mode(r: &Reply) -> &str {
    r.mode().unwrap_or("-")
}

/// `vllm-sim` `kvmesh_sim_nixl_transfers_total{outcome="served"}` of one worker.
async fn served(stack: &Stack, id: &str) -> anyhow::Result<f64> {
    Ok(stack
        .scrape(&stack.worker(id)?.url("/metrics"))
        .await?
        .sum("kvmesh_sim_nixl_transfers_total", &[("outcome", "served")]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_home_hands_its_blocks_to_the_new_worker() -> anyhow::Result<()> {
    let mut spec = StackSpec::disaggregated(0, 3);
    spec.filter_config = json!({"debug_headers": true, "indexer_timeout_ms": 4000});
    spec.routing_toml = ROUTING_ON.into();
    // Real-time decoding, so the streams that overload the home stay open while we look.
    spec.sim_args = vec!["--itl-ms".into(), "20".into(), "--speedup".into(), "1".into()];
    let mut stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let url = stack.gateway("/v1/chat/completions");
    let ids: Vec<String> = stack.workers.iter().map(|w| w.id.clone()).collect();

    // Three sessions pinned to the same home.
    let pin = |s: &str| {
        rendezvous::pick(session::from_header_value(s).0, ids.iter().map(String::as_str))
            .map(str::to_owned)
    };
    let home = pin("mig-0").unwrap_or_default();
    let sessions: Vec<String> = (0..500)
        .map(|i| format!("mig-{i}"))
        .filter(|s| pin(s).as_deref() == Some(home.as_str()))
        .take(3)
        .collect();
    anyhow::ensure!(sessions.len() == 3, "no three sessions share a pin");

    // Turn 1 of each, at home.
    let mut histories = Vec::new();
    for (i, s) in sessions.iter().enumerate() {
        let h = vec![
            ("system".to_owned(), filler(10 + i as u64, 700)),
            ("user".to_owned(), filler(20 + i as u64, 30)),
        ];
        let r = post_json(&c, &url, &chat(&h, 4, false), &[(DEFAULT_SESSION_HEADER, s.as_str())])
            .await?;
        assert_eq!((r.status, r.worker()), (200, Some(home.as_str())), "{:?}", r.reason());
        let mut h = h;
        h.push(("assistant".to_owned(), r.chat_content().unwrap_or_default()));
        h.push(("user".to_owned(), filler(30 + i as u64, 20)));
        histories.push(h);
    }

    // The indexer restarts between turns: it knows the home's blocks again only from replay.
    stack.restart_indexer().await?;

    // Two long streams of the first session overload the home (overload_active_requests = 2).
    let mut holds = Vec::new();
    for k in 0..2u64 {
        let body = chat(&[("user".to_owned(), filler(900 + k, 20))], 1500, true);
        let resp = c
            .post(&url)
            .header(DEFAULT_SESSION_HEADER, sessions[0].as_str())
            .json(&body)
            .send()
            .await?;
        assert_eq!(resp.status(), 200);
        let mut stream = resp.bytes_stream();
        let _first = stream.next().await;
        holds.push(stream);
    }
    let fleet_url = stack.indexer_url("/v1/fleet");
    poll::until("the home carries two in-flight requests", || {
        let (c, u, home) = (c.clone(), fleet_url.clone(), home.clone());
        async move {
            let f: FleetSnapshot = c.get(&u).send().await.ok()?.json().await.ok()?;
            f.workers.iter().any(|w| w.id == home && w.load.active_requests >= 2).then_some(())
        }
    })
    .await?;

    // Session 0, turn 2: moves, and the new worker pulls the history from home.
    let before = served(&stack, &home).await?;
    let body = chat(&histories[0], 6, true);
    let r = post_json(&c, &url, &body, &[(DEFAULT_SESSION_HEADER, sessions[0].as_str())]).await?;
    assert_eq!((r.status, mode(&r)), (200, "migrate"), "{} {:?}", r.text, r.reason());
    let target = r.worker().unwrap_or_default().to_owned();
    assert_ne!(target, home);
    assert_eq!(
        r.reason_codes(),
        [ReasonCode::PinOverloaded, ReasonCode::Migrate],
        "{:?}",
        r.reason()
    );
    assert!(
        r.reason().is_some_and(|m| m.contains(&format!("home {home} overloaded"))),
        "{:?}",
        r.reason()
    );
    assert_eq!(served(&stack, &home).await? - before, 1.0, "the home served one producer step");
    let pulls = stack
        .scrape(&stack.worker(&target)?.url("/metrics"))
        .await?
        .sum("kvmesh_sim_nixl_pulls_total", &[("outcome", "ok")]);
    assert_eq!(pulls, 1.0, "{target} pulled");
    let history_blocks = r.isl_blocks().unwrap_or(0).saturating_sub(4);
    assert!(
        r.stream_cached_tokens().unwrap_or(0) >= history_blocks * BS,
        "cached {:?} of {history_blocks} history blocks",
        r.stream_cached_tokens()
    );
    let third = ids.iter().find(|w| **w != home && **w != target).cloned().unwrap_or_default();
    let direct = |body: &Value| {
        let mut b = body.clone();
        b["stream"] = json!(false);
        b.as_object_mut().map(|o| o.remove("stream_options"));
        b
    };
    let reference =
        post_json(&c, &stack.worker(&third)?.url("/v1/chat/completions"), &direct(&body), &[])
            .await?;
    assert_eq!(Some(r.stream_text()), reference.chat_content(), "migration changed the answer");

    // Session 1: the source fails the handshake, the target recomputes.
    c.post(stack.worker(&home)?.url("/admin/faults"))
        .json(&json!({"fail_migration_source_status": 500}))
        .send()
        .await?
        .error_for_status()?;
    let body = chat(&histories[1], 6, true);
    let r = post_json(&c, &url, &body, &[(DEFAULT_SESSION_HEADER, sessions[1].as_str())]).await?;
    assert_eq!((r.status, mode(&r)), (200, "aggregate"), "{:?}", r.reason());
    assert_eq!(r.reason_codes().last(), Some(&ReasonCode::MigrationFailed), "{:?}", r.reason());
    assert!(
        r.reason().is_some_and(|m| m.contains("failed (handshake_failed)")),
        "{:?}",
        r.reason()
    );
    assert_ne!(r.worker(), Some(home.as_str()));
    let other = ids
        .iter()
        .find(|w| Some(w.as_str()) != r.worker() && **w != home)
        .cloned()
        .unwrap_or_default();
    let reference =
        post_json(&c, &stack.worker(&other)?.url("/v1/chat/completions"), &direct(&body), &[])
            .await?;
    assert_eq!(Some(r.stream_text()), reference.chat_content(), "recompute changed the answer");
    c.post(stack.worker(&home)?.url("/admin/faults"))
        .json(&json!({"clear": true}))
        .send()
        .await?
        .error_for_status()?;

    // Dry mode: counted and logged, nothing sent.
    stack.rewrite_fleet(|_| true, &ROUTING_ON.replace("\"on\"", "\"dry\"")).await?;
    let before = served(&stack, &home).await?;
    let r = post_json(
        &c,
        &url,
        &chat(&histories[2], 6, false),
        &[(DEFAULT_SESSION_HEADER, sessions[2].as_str())],
    )
    .await?;
    assert_eq!((r.status, mode(&r)), (200, "aggregate"), "{:?}", r.reason());
    assert!(r.reason_codes().contains(&ReasonCode::MigrateDryRun), "{:?}", r.reason());
    assert!(
        r.reason().is_some_and(|m| m.contains(&format!("dry-run migration {home}->"))),
        "{:?}",
        r.reason()
    );
    assert_eq!(served(&stack, &home).await?, before, "dry mode contacted the source");

    let m = stack.scrape(&stack.indexer_url("/metrics")).await?;
    let outcome = |o: &str| m.sum("kvmesh_migrations_total", &[("outcome", o)]);
    assert_eq!((outcome("ok"), outcome("handshake_failed"), outcome("dry_run")), (1.0, 1.0, 1.0));
    assert_eq!(m.sum("kvmesh_migration_opportunities_total", &[]), 3.0);
    let envoy = stack.envoy_metrics().await?;
    assert_eq!(envoy.sum("kvmesh_filter_requests_total", &[("mode", "migrate")]), 1.0);
    drop(holds);
    Ok(())
}
