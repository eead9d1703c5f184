//! NIXL semantics between real simulator processes: a producer answers a prefill-leg request
//! with `kv_transfer_params` and holds its blocks; a consumer pulls them, counts them as prefix
//! hits and publishes them as stored blocks; a consumed hold cannot be pulled twice (policy
//! `fail` → 500, `recompute` → served locally); a decode worker acts as a migration source.

// Test code: a failed unwrap is a failed test (clippy.toml allows this in #[test] fns only).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{poll, Ev, Sim, Subscriber};
use kvmesh_sim::hash::chain;
use serde_json::{json, Value};

const BS: usize = 16;

fn prompt(n: u32) -> Vec<u32> {
    (0..n).map(|i| 10_000 + i * 7 % 5000).collect()
}

fn holds(sim: &Sim) -> u64 {
    sim.get("/admin/cache")["num_transfer_holds"].as_u64().unwrap()
}

#[test]
fn producer_to_consumer_transfer() {
    let producer = Sim::spawn(&["--role", "prefill", "--speedup", "100"]);
    let consumer = Sim::spawn(&[
        "--role",
        "decode",
        "--speedup",
        "100",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:*",
    ]);
    let recomputer = Sim::spawn(&[
        "--role",
        "decode",
        "--speedup",
        "100",
        "--kv-load-failure-policy",
        "recompute",
    ]);
    let mut sub = Subscriber::connect(consumer.kv_events.as_deref().unwrap(), None, "", true);
    poll("the consumer's event stream", || {
        assert_eq!(consumer.post("/reset_prefix_cache", &json!({})).0, 200);
        sub.pump().then_some(())
    });

    // Prefill leg, shaped like vLLM's toy proxy.
    let ids = prompt(100);
    let (status, p) = producer.post(
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 1, "stream": false, "kv_transfer_params": {
            "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null}}),
    );
    assert_eq!(status, 200, "{p}");
    assert_eq!(p["usage"]["completion_tokens"], 1);
    let params = p["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_engine_id"], producer.id.as_str());
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], producer.port());
    assert_eq!(params["tp_size"], 1);
    assert!(params["remote_request_id"].is_string());
    assert_eq!(params["remote_block_ids"].as_array().unwrap().len(), 7, "ceil(100 / 16) blocks");
    assert_eq!(holds(&producer), 1);

    // Decode leg: the consumer pulls the 100 tokens' blocks instead of computing them.
    let hits_before = consumer.metric("vllm:prefix_cache_hits_total");
    let (status, d) = consumer.post(
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 4, "kv_transfer_params": params}),
    );
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["usage"]["completion_tokens"], 4);
    assert_eq!(
        d["usage"]["prompt_tokens_details"]["cached_tokens"], 99,
        "all but the last prompt token"
    );
    assert_eq!(consumer.metric("vllm:prefix_cache_hits_total") - hits_before, 99.0);
    assert_eq!(consumer.metric("vllm:external_prefix_cache_hits_total"), 100.0);
    assert_eq!(consumer.metric("kvmesh_sim_nixl_pulls_total"), 1.0);
    assert_eq!(holds(&producer), 0, "the pull released the producer's hold");
    assert_eq!(producer.metric("kvmesh_sim_nixl_transfers_total"), 1.0);

    // The consumer caches the pulled full blocks as its own and says so.
    let h = chain(&ids, BS, None);
    sub.until("the consumer's BlockStored for the pulled blocks", |s| {
        s.model.blocks.contains_key(&h[5])
    });
    let stored: Vec<Ev> = sub
        .applied
        .iter()
        .flat_map(|(_, e, _)| e.clone())
        .filter(|e| matches!(e, Ev::Stored { .. }))
        .collect();
    assert_eq!(
        stored[0],
        Ev::Stored {
            hashes: h[..6].to_vec(),
            parent: None,
            tokens: ids[..96].to_vec(),
            block_size: BS,
            lora: None,
        }
    );

    // The hold is gone: pulling again fails. Policy `fail` → 500; `recompute` → computed locally.
    let (status, again) = consumer.post(
        "/v1/completions",
        &json!({"prompt": prompt(60), "max_tokens": 2, "kv_transfer_params": params}),
    );
    assert_eq!(status, 500, "{again}");
    assert_eq!(consumer.metric("kvmesh_sim_kv_load_failures_total"), 1.0);
    let (status, local) = recomputer.post(
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 2, "kv_transfer_params": params}),
    );
    assert_eq!(status, 200, "{local}");
    assert_eq!(local["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(recomputer.metric("vllm:external_prefix_cache_hits_total"), 0.0);
}

#[test]
fn a_decode_worker_is_a_migration_source_for_one_step() {
    let source = Sim::spawn(&["--role", "decode", "--speedup", "100"]);
    let target = Sim::spawn(&["--role", "decode", "--speedup", "100"]);
    let turn1 = prompt(100);
    let (status, _) = source.post("/v1/completions", &json!({"prompt": turn1, "max_tokens": 3}));
    assert_eq!(status, 200);

    // The handshake: one step on the source, whatever max_tokens says; it holds the blocks.
    let (status, m) = source.post(
        "/v1/completions",
        &json!({"prompt": turn1, "max_tokens": 50, "kv_migration_source": true}),
    );
    assert_eq!(status, 200, "{m}");
    assert_eq!(m["usage"]["completion_tokens"], 1);
    assert_eq!(
        m["usage"]["prompt_tokens_details"]["cached_tokens"], 96,
        "the source already cached the conversation"
    );
    let params: Value = m["kv_transfer_params"].clone();
    assert_eq!(params["remote_engine_id"], source.id.as_str());
    assert_eq!(holds(&source), 1);

    // The target's next turn is longer than what the source holds: it pulls the 100 tokens and
    // computes only the new ones.
    let mut turn2 = turn1.clone();
    turn2.extend(20_000..20_020);
    let (status, t) = target.post(
        "/v1/completions",
        &json!({"prompt": turn2, "max_tokens": 2, "kv_transfer_params": params}),
    );
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["usage"]["prompt_tokens_details"]["cached_tokens"], 100);
    assert_eq!(holds(&source), 0);

    // A failing migration source (injected) answers with the configured status.
    let (status, _) = source.post("/admin/faults", &json!({"fail_migration_source_status": 503}));
    assert_eq!(status, 200);
    let (status, _) = source.post(
        "/v1/completions",
        &json!({"prompt": turn1, "max_tokens": 1, "kv_migration_source": true}),
    );
    assert_eq!(status, 503);
}
