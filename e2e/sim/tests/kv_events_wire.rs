//! KV events on the wire, in both layouts: a Rust ZMQ SUB client receives batches whose decoded
//! content matches the cache operations performed (checked against `GET /admin/cache` and
//! against hashes computed here), and a dropped sequence range is recovered through the replay
//! socket with a DEALER.

// Test code: a failed unwrap is a failed test (clippy.toml allows this in #[test] fns only).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{poll, Arrival, Ev, Sim, Subscriber};
use kvmesh_sim::hash::chain;
use serde_json::{json, Value};

const BS: usize = 4;
const TOPIC: &str = "kv@test@deepseek-v4";

fn start(layout: &str) -> (Sim, Subscriber) {
    let sim = Sim::spawn(&[
        "--block-size",
        "4",
        "--num-gpu-blocks",
        "10",
        "--speedup",
        "1000",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:*",
        "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:*",
        "--kv-events-topic",
        TOPIC,
        "--kv-events-layout",
        layout,
        "--dp-rank",
        "2",
    ]);
    let mut sub = Subscriber::connect(
        sim.kv_events.as_deref().unwrap(),
        sim.replay.as_deref(),
        TOPIC,
        layout == "current",
    );
    // PUB drops messages until the subscription has propagated: probe with resets (each one
    // publishes an AllBlocksCleared batch and changes nothing) until one arrives.
    poll("the first KV event batch", || {
        let (status, _) = sim.post("/reset_prefix_cache", &json!({}));
        assert_eq!(status, 200);
        sub.pump().then_some(())
    });
    (sim, sub)
}

fn complete(sim: &Sim, prompt: &[u32], max_tokens: u32) -> Value {
    let (status, body) = sim.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": max_tokens, "return_token_ids": true}),
    );
    assert_eq!(status, 200, "{body}");
    body
}

/// Pumps until the event-built model equals the engine's own dump.
fn converge(sim: &Sim, sub: &mut Subscriber) {
    let want = sim.cache();
    sub.until("the event stream to match /admin/cache", |s| s.model == want);
}

fn stored_since(sub: &Subscriber, from: usize) -> Vec<Ev> {
    sub.applied[from..]
        .iter()
        .flat_map(|(_, evs, _)| evs.clone())
        .filter(|e| matches!(e, Ev::Stored { .. }))
        .collect()
}

fn run(layout: &str) {
    let (sim, mut sub) = start(layout);

    // A prompt of 10 tokens: two full blocks stored, chain root has no parent.
    let a: Vec<u32> = (1000..1010).collect();
    let mark = sub.applied.len();
    complete(&sim, &a, 1);
    converge(&sim, &mut sub);
    let ha = chain(&a, BS, None);
    assert_eq!(
        stored_since(&sub, mark),
        vec![Ev::Stored {
            hashes: ha.clone(),
            parent: None,
            tokens: a[..8].to_vec(),
            block_size: BS,
            lora: None,
        }]
    );

    // A prompt sharing A's two blocks: only its new blocks are stored, under A's second block;
    // two generated tokens complete a fourth block, stored with them.
    let b: Vec<u32> = a[..8].iter().copied().chain(2000..2006).collect();
    let mark = sub.applied.len();
    let body = complete(&sim, &b, 3);
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
    let generated: Vec<u32> = body["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    converge(&sim, &mut sub);
    let seq: Vec<u32> = b.iter().copied().chain(generated[..2].iter().copied()).collect();
    let hb = chain(&seq, BS, None);
    assert_eq!(hb[..2], ha[..]);
    assert_eq!(
        stored_since(&sub, mark),
        vec![
            Ev::Stored {
                hashes: vec![hb[2]],
                parent: Some(hb[1]),
                tokens: seq[8..12].to_vec(),
                block_size: BS,
                lora: None,
            },
            Ev::Stored {
                hashes: vec![hb[3]],
                parent: Some(hb[2]),
                tokens: seq[12..16].to_vec(),
                block_size: BS,
                lora: None,
            },
        ]
    );

    // A 32-token prompt needs 8 of the 10 blocks: freed cached blocks are evicted, oldest
    // freed first, each reported as BlockRemoved when its slot is reused.
    let c: Vec<u32> = (3000..3032).collect();
    let mark = sub.applied.len();
    complete(&sim, &c, 1);
    converge(&sim, &mut sub);
    let removed: Vec<u64> = sub.applied[mark..]
        .iter()
        .flat_map(|(_, evs, _)| evs.clone())
        .flat_map(|e| if let Ev::Removed { hashes } = e { hashes } else { vec![] })
        .collect();
    assert!(!removed.is_empty(), "the cache is full: something was evicted");
    assert!(removed.iter().all(|h| hb.contains(h)), "only A/B blocks were cached before");

    // Drop the next two sequence numbers from the PUB stream: the subscriber sees a gap and
    // replays them (they were kept in the replay buffer).
    let last = sub.last_seq.unwrap();
    let (status, faults) =
        sim.post("/admin/faults", &json!({"drop_seqs": {"start": last + 1, "end": last + 3}}));
    assert_eq!(status, 200, "{faults}");
    assert_eq!(faults["drop_seqs"], json!({"start": last + 1, "end": last + 3}));
    for base in [4000u32, 5000, 6000] {
        complete(&sim, &(base..base + 8).collect::<Vec<_>>(), 1);
    }
    converge(&sim, &mut sub);
    let arrivals: Vec<(u64, Arrival)> =
        sub.applied.iter().filter(|(s, _, _)| *s > last).map(|(s, _, a)| (*s, *a)).collect();
    assert_eq!(
        arrivals[..3],
        [(last + 1, Arrival::Replay), (last + 2, Arrival::Replay), (last + 3, Arrival::Pub)]
    );

    // Every batch carries the configured DP rank; the replay of the whole history from 0
    // reproduces the same cache.
    assert!(sub.ranks.iter().all(|&r| r == 2));
    let mut fresh = Subscriber::connect(
        sim.kv_events.as_deref().unwrap(),
        sim.replay.as_deref(),
        TOPIC,
        layout == "current",
    );
    fresh.replay_from(0, u64::MAX);
    assert_eq!(fresh.model, sim.cache());
    assert_eq!(fresh.applied.first().map(|(s, _, _)| *s), Some(0), "sequence numbers start at 0");
}

#[test]
fn current_layout_matches_the_cache_and_replays_dropped_batches() {
    run("current");
}

#[test]
fn legacy_layout_matches_the_cache_and_replays_dropped_batches() {
    run("legacy");
}
