//! The engine task on tokio's paused clock, with events collected by a [`MemorySink`]: steps
//! take their modelled time, events are published before the tokens they belong to, streams
//! and whole responses are delivered, a dropped stream cancels its request.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::events::{KvEvent, MemorySink};
use crate::hash::chain;
use crate::output::OutputVocab;
use crate::sched::{FinishReason, KvLoadFailurePolicy, KvRole, NewRequest, SchedulerConfig};
use crate::timing::TimingModel;

fn engine(sink: MemorySink) -> (EngineHandle, Arc<Metrics>) {
    let vocab = Arc::new(
        OutputVocab::from_words((0..32).map(|i| (1000 + i, format!(" w{i}"))).collect()).unwrap(),
    );
    let cfg = SchedulerConfig {
        block_size: 16,
        num_gpu_blocks: 64,
        max_num_seqs: 8,
        max_num_batched_tokens: 512,
        max_waiting: 8,
        max_model_len: 1024,
        timing: TimingModel {
            prefill_tokens_per_s: 1000.0,
            itl_s: 0.010,
            contention: 0.0,
            max_num_seqs: 8,
            speedup: 1.0,
        },
        kv_load_failure_policy: KvLoadFailurePolicy::Fail,
        kv_transfer_timeout: Duration::from_secs(30),
        max_loras: None,
        lora_load_ms: 0.0,
        cpu_offload_blocks: 0,
        cpu_load_tokens_per_s: 100_000.0,
        sliding_window: None,
    };
    let metrics = Arc::new(Metrics::new("m", 0, 16, 64, 1024));
    let parts = EngineParts {
        sink: Box::new(sink),
        metrics: metrics.clone(),
        pull_client: PullClient::new(Duration::from_secs(1), 16).unwrap(),
        nixl_us_per_block: 0.0,
        queue: 16,
    };
    (spawn(Scheduler::new(cfg, vocab), parts), metrics)
}

fn req(h: &EngineHandle, prompt: &[u32], max_tokens: u32) -> NewRequest {
    NewRequest {
        id: h.next_id(),
        prompt: prompt.to_vec(),
        hashes: chain(prompt, 16, None),
        salt: None,
        media: Vec::new(),
        lora: None,
        max_tokens,
        finish_reason: FinishReason::Length,
        seed: 1,
        kv: KvRole::Plain,
    }
}

#[tokio::test(start_paused = true)]
async fn steps_take_their_modelled_time_and_events_come_first() {
    let sink = MemorySink::new();
    let (h, metrics) = engine(sink.clone());
    let prompt: Vec<u32> = (0..32).collect();
    let t0 = tokio::time::Instant::now();
    let mut s = h.submit(req(&h, &prompt, 3), true, std::time::Instant::now()).await.unwrap();

    // 32 prompt tokens at 1000/s: the first token after 32 ms, its blocks already published.
    assert!(matches!(s.next().await, Some(ReqEvent::Token(_))));
    let first = t0.elapsed();
    assert!(first >= Duration::from_millis(31) && first <= Duration::from_millis(33), "{first:?}");
    let batches = sink.take();
    assert_eq!(batches.len(), 1);
    assert_eq!(
        batches[0].events,
        vec![KvEvent::BlockStored {
            block_hashes: chain(&prompt, 16, None),
            parent_block_hash: None,
            token_ids: prompt.clone(),
            block_size: 16,
            lora: None,
            extra_keys: Vec::new(),
        }]
    );

    // Two decode steps of 10 ms each.
    assert!(matches!(s.next().await, Some(ReqEvent::Token(_))));
    let Some(ReqEvent::Last(_, done)) = s.next().await else { panic!("last token") };
    let total = t0.elapsed();
    assert!(total >= Duration::from_millis(51) && total <= Duration::from_millis(53), "{total:?}");
    assert_eq!((done.completion_tokens, done.cached_tokens), (3, 0));
    assert_eq!(metrics.sched().generation_tokens, 3);

    // A whole (non-streaming) response arrives in one event; the prompt now hits the cache.
    let mut s = h.submit(req(&h, &prompt, 2), false, std::time::Instant::now()).await.unwrap();
    let Some(ReqEvent::Done(tokens, done)) = s.next().await else { panic!("done") };
    assert_eq!((tokens.len(), done.cached_tokens), (2, 16));
}

#[tokio::test(start_paused = true)]
async fn dropping_a_stream_cancels_the_request() {
    let (h, metrics) = engine(MemorySink::new());
    let mut s = h.submit(req(&h, &[7; 40], 500), true, std::time::Instant::now()).await.unwrap();
    assert!(matches!(s.next().await, Some(ReqEvent::Token(_))));
    assert!(h.dump().await.unwrap().blocks.iter().all(|b| b.ref_cnt == 1));
    drop(s);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let dump = h.dump().await.unwrap();
    assert_eq!(dump.num_free_blocks, dump.num_gpu_blocks);
    assert_eq!(metrics.sched().aborted, 1);
}

#[tokio::test(start_paused = true)]
async fn refusals_and_reset() {
    let sink = MemorySink::new();
    let (h, _) = engine(sink.clone());
    let mut s = h.submit(req(&h, &[1; 1100], 1), false, std::time::Instant::now()).await.unwrap();
    assert!(matches!(s.next().await, Some(ReqEvent::Failed(RequestError::TooLong { .. }))));
    let mut s = h.submit(req(&h, &[1; 20], 1), false, std::time::Instant::now()).await.unwrap();
    assert!(matches!(s.next().await, Some(ReqEvent::Done(..))));
    sink.take();
    assert!(h.reset().await.unwrap().is_ok());
    assert_eq!(sink.take().last().map(|b| b.events.clone()), Some(vec![KvEvent::AllBlocksCleared]));
    assert!(h.dump().await.unwrap().blocks.is_empty());
}
