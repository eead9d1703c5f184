//! The sliding-window group alone and inside the scheduler: vLLM's hit rule, the blocks a request
//! frees as its window moves, and what a hybrid model serves from cache.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::hash::chain;
use crate::output::OutputVocab;
use crate::sched::{
    Emit, FinishReason, KvLoadFailurePolicy, KvRole, NewRequest, Scheduler, SchedulerConfig,
    StepOutput,
};
use crate::timing::TimingModel;

const BS: usize = 4;
/// 9 tokens: a hit needs the ⌈8/4⌉ = 2 blocks before it.
const WINDOW: usize = 9;

fn group(blocks: u32) -> WindowGroup {
    WindowGroup::new(SlidingWindow { tokens: WINDOW, blocks }, BS)
}

/// Caches `tokens` in `g` as request `id` computing them in one go, then finishes it.
fn serve(g: &mut WindowGroup, id: ReqId, tokens: &[u32]) {
    let hashes = chain(tokens, BS, None);
    assert!(g.admit(id, &hashes, 0, tokens.len()));
    g.prepare(id, tokens, (0, tokens.len()), &hashes, None);
    g.free(id);
}

#[test]
fn the_hit_needs_the_blocks_before_it_only() {
    let mut g = group(32);
    let a: Vec<u32> = (0..32).collect();
    let h = chain(&a, BS, None);
    serve(&mut g, 1, &a);
    assert_eq!((g.hit(&h, 8), g.hit(&h, 5), g.hit(&h, 0)), (8, 5, 0));
    assert_eq!(SlidingWindow { tokens: WINDOW, blocks: 1 }.need(BS), 2);
    // Blocks 3 and 4 alone cached: a request computed blocks 0..5, its window moved past 0..2
    // (freed), and another request's allocation took those slots.
    let mut g = group(6);
    assert!(g.admit(2, &h, 0, 20));
    g.prepare(2, &a, (0, 20), &h, None);
    assert!(g.grow(2, 20, 20));
    let other: Vec<u32> = (500..516).collect();
    let ho = chain(&other, BS, None);
    assert!(g.admit(3, &ho, 0, 16));
    let cached: Vec<bool> = h[..5].iter().map(|x| g.is_cached(*x)).collect();
    assert_eq!(cached, [false, false, false, true, true]);
    // A hit of 5 stands (blocks 3 and 4 before it), none of 8; below 5, no run of two and no run
    // from block 0.
    assert_eq!((g.hit(&h, 8), g.hit(&h, 5), g.hit(&h, 4)), (5, 5, 0));
}

#[test]
fn a_moving_window_frees_the_blocks_before_it() {
    let mut g = group(16);
    let a: Vec<u32> = (0..32).collect();
    let h = chain(&a, BS, None);
    assert!(g.admit(1, &h, 0, 16));
    g.prepare(1, &a, (0, 16), &h, None);
    assert_eq!(g.num_free(), 12);
    // 16 computed: the next token attends to tokens 8..16, blocks 0 and 1 are freed; blocks for
    // tokens up to 24 are taken.
    assert!(g.grow(1, 16, 24));
    assert_eq!(g.num_free(), 16 - 4);
    g.prepare(1, &a, (16, 24), &h, None);
    // Freed blocks stay cached until their slot is reused.
    assert!(g.is_cached(h[0]) && g.is_cached(h[5]));
    let stored: Vec<KvEvent> = g.take_events();
    assert!(stored.iter().all(|e| matches!(
        e,
        KvEvent::Grouped { group_idx: GROUP_IDX, sliding_window: 9, event }
            if matches!(**event, KvEvent::BlockStored { .. })
    )));
    // A pool too small for the next chunk refuses it, with nothing taken.
    assert!(!g.grow(1, 24, 24 + 4 * 16));
    g.free(1);
    assert_eq!(g.num_free(), 16);
}

fn cfg(window_blocks: u32) -> SchedulerConfig {
    SchedulerConfig {
        block_size: BS,
        num_gpu_blocks: 64,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_waiting: 16,
        max_model_len: 256,
        timing: TimingModel {
            prefill_tokens_per_s: 1000.0,
            itl_s: 0.010,
            contention: 0.0,
            max_num_seqs: 8,
            speedup: 1.0,
        },
        kv_load_failure_policy: KvLoadFailurePolicy::Fail,
        kv_transfer_timeout: Duration::from_secs(5),
        max_loras: None,
        lora_load_ms: 0.0,
        cpu_offload_blocks: 0,
        cpu_load_tokens_per_s: 100_000.0,
        sliding_window: Some(SlidingWindow { tokens: WINDOW, blocks: window_blocks }),
    }
}

fn req(id: ReqId, prompt: &[u32]) -> NewRequest {
    NewRequest {
        id,
        prompt: prompt.to_vec(),
        hashes: chain(prompt, BS, None),
        salt: None,
        lora: None,
        media: Vec::new(),
        max_tokens: 1,
        finish_reason: FinishReason::Length,
        seed: 7,
        kv: KvRole::Plain,
    }
}

/// Runs `id` to its end from `t`: (its cached tokens, the events, the end time).
fn serve_request(s: &mut Scheduler, id: ReqId, t: Duration) -> (u32, Vec<KvEvent>, Duration) {
    let (mut t, mut events, mut cached) = (t, Vec::new(), None);
    loop {
        let mut out = StepOutput::default();
        let wake = s.step(t, &mut out);
        events.extend(out.events);
        for e in out.emits {
            if let Emit::Finished { id: i, done } = e {
                if i == id {
                    cached = Some(done.cached_tokens);
                }
            }
        }
        if let Some(c) = cached {
            return (c, events, t);
        }
        t = wake.unwrap_or_else(|| panic!("request {id} never finished")).max(t);
    }
}

/// The e2e test's scenario at unit scale: a prompt whose window tail the group evicted is served
/// from cache only up to where its window is still held, though the full-attention group holds
/// it all; both groups' events say so.
#[test]
fn a_hybrid_model_serves_what_both_groups_can() {
    let vocab = Arc::new(
        OutputVocab::from_words((0..32).map(|i| (1000 + i, format!(" w{i}"))).collect()).unwrap(),
    );
    // The smallest pool a window of 9 and chunks of 64 tokens allow: 2 + 16 + 2 blocks.
    let window_blocks = SlidingWindow::min_blocks(WINDOW, BS, 64) as u32;
    assert_eq!(window_blocks, 20);
    let mut s = Scheduler::new(cfg(window_blocks), vocab);
    let a: Vec<u32> = (0..17).collect();
    let e: Vec<u32> = (100..172).collect();
    let (ha, he) = (chain(&a, BS, None), chain(&e, BS, None));
    s.submit(req(1, &a)).unwrap();
    let (cached, events, t) = serve_request(&mut s, 1, Duration::ZERO);
    assert_eq!(cached, 0);
    let window_store = KvEvent::Grouped {
        group_idx: GROUP_IDX,
        sliding_window: WINDOW as u32,
        event: Box::new(KvEvent::BlockStored {
            block_hashes: ha[..4].to_vec(),
            parent_block_hash: None,
            token_ids: a[..16].to_vec(),
            block_size: BS as u32,
            lora: None,
            extra_keys: Vec::new(),
        }),
    };
    assert!(events.contains(&window_store), "{events:?}");
    // E: its first chunk (64 tokens) takes the 15 unused blocks and A's partial one; its second
    // frees its blocks 0..14 (outside its window), then takes A's blocks 3 and 2 (freed tail
    // first when A finished).
    s.submit_at(req(2, &e), t).unwrap();
    let (_, events, t) = serve_request(&mut s, 2, t);
    let evicted = KvEvent::Grouped {
        group_idx: GROUP_IDX,
        sliding_window: WINDOW as u32,
        event: Box::new(KvEvent::BlockRemoved { block_hashes: vec![ha[3], ha[2]] }),
    };
    assert!(events.contains(&evicted), "{events:?}");
    assert!(!events.iter().any(|x| matches!(x, KvEvent::BlockRemoved { .. })), "the GPU kept A");
    // A again: the full-attention group holds its 4 blocks, the window group blocks 0 and 1
    // only: a hit of 2 blocks, not 4.
    s.submit_at(req(3, &a), t).unwrap();
    let (cached, events, t) = serve_request(&mut s, 3, t);
    assert_eq!(cached, 2 * BS as u32);
    let evicted = KvEvent::BlockRemoved { block_hashes: vec![he[13], he[12], he[11]] };
    assert!(events
        .iter()
        .any(|x| matches!(x, KvEvent::Grouped { event, .. } if **event == evicted)));
    // E again: A's admission took E's blocks 11..13 from the window group, but E's window tail
    // (blocks 15, 16 before the last-token cap of 17) is held: the whole hit.
    s.submit_at(req(4, &e), t).unwrap();
    let (cached, events, _) = serve_request(&mut s, 4, t);
    assert_eq!(cached, 17 * BS as u32);
    let evicted = KvEvent::BlockRemoved { block_hashes: vec![he[13], he[12], he[11]] };
    assert!(!events
        .iter()
        .any(|x| matches!(x, KvEvent::Grouped { event, .. } if **event == evicted)));
}
