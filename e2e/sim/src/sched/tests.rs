//! Scheduler tests: timing, batching, chunked prefill, generated-token blocks, preemption,
//! cancellation, NIXL holds and pulls, reset, admission limits. Time is a plain `Duration`.

use super::*;
use crate::hash::chain;

const BS: usize = 4;
const MS: Duration = Duration::from_millis(1);

fn vocab() -> Arc<OutputVocab> {
    Arc::new(
        OutputVocab::from_words((0..32).map(|i| (1000 + i, format!(" w{i}"))).collect()).unwrap(),
    )
}

fn cfg(blocks: u32) -> SchedulerConfig {
    SchedulerConfig {
        block_size: BS,
        num_gpu_blocks: blocks,
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
        sliding_window: None,
    }
}

fn req(id: ReqId, prompt: &[u32], max_tokens: u32) -> NewRequest {
    NewRequest {
        id,
        prompt: prompt.to_vec(),
        hashes: chain(prompt, BS, None),
        salt: None,
        media: Vec::new(),
        lora: None,
        max_tokens,
        finish_reason: FinishReason::Length,
        seed: 7,
        kv: KvRole::Plain,
    }
}

/// Everything that happened, with the time it happened at.
#[derive(Default)]
struct Log {
    emits: Vec<(Duration, Emit)>,
    batches: Vec<(Duration, Vec<KvEvent>)>,
}

impl Log {
    fn tokens(&self, id: ReqId) -> Vec<(Duration, u32)> {
        self.emits
            .iter()
            .filter_map(|(t, e)| match e {
                Emit::Token { id: i, token } if *i == id => Some((*t, *token)),
                _ => None,
            })
            .collect()
    }
    fn finished(&self, id: ReqId) -> Option<Finished> {
        self.emits.iter().find_map(|(_, e)| match e {
            Emit::Finished { id: i, done } if *i == id => Some(done.clone()),
            _ => None,
        })
    }
    fn events(&self) -> Vec<KvEvent> {
        self.batches.iter().flat_map(|(_, b)| b.clone()).collect()
    }
}

/// Steps from `t` until the engine idles (or `until`), like the driver with a perfect clock.
fn run(s: &mut Scheduler, mut t: Duration, until: Duration, log: &mut Log) -> Duration {
    loop {
        let mut out = StepOutput::default();
        let wake = s.step(t, &mut out);
        if !out.events.is_empty() {
            log.batches.push((t, out.events));
        }
        log.emits.extend(out.emits.into_iter().map(|e| (t, e)));
        match wake {
            Some(w) if w <= until => t = w.max(t),
            _ => return t,
        }
    }
}

#[test]
fn prefill_then_decode_with_generated_token_blocks() {
    let mut s = Scheduler::new(cfg(16), vocab());
    let prompt: Vec<u32> = (0..10).collect();
    s.submit(req(1, &prompt, 3)).unwrap();
    let mut log = Log::default();
    run(&mut s, Duration::ZERO, Duration::from_secs(10), &mut log);

    let toks = log.tokens(1);
    // 10 prompt tokens at 1000/s, then one 10 ms decode step per further token.
    assert_eq!(toks.iter().map(|(t, _)| *t).collect::<Vec<_>>(), [10 * MS, 20 * MS, 30 * MS]);
    let done = log.finished(1).unwrap();
    assert_eq!(
        (done.prompt_tokens, done.completion_tokens, done.cached_tokens, done.reason),
        (10, 3, 0, FinishReason::Length)
    );
    assert_eq!(
        done.created_cache_tokens, 8,
        "the two full prompt blocks were computed and cached here"
    );

    // The prompt's two full blocks, then the block completed by two generated tokens (the third
    // token is sampled last and never computed).
    let h = chain(&prompt, BS, None);
    let g: Vec<u32> = toks.iter().map(|(_, t)| *t).collect();
    let seq: Vec<u32> = prompt.iter().copied().chain(g[..2].iter().copied()).collect();
    let hs = chain(&seq, BS, None);
    assert_eq!(
        log.events(),
        vec![
            KvEvent::BlockStored {
                block_hashes: h.clone(),
                parent_block_hash: None,
                token_ids: prompt[..8].to_vec(),
                block_size: 4,
                lora: None,
                extra_keys: Vec::new(),
            },
            KvEvent::BlockStored {
                block_hashes: vec![hs[2]],
                parent_block_hash: Some(h[1]),
                token_ids: seq[8..12].to_vec(),
                block_size: 4,
                lora: None,
                extra_keys: Vec::new(),
            },
        ]
    );
    assert_eq!(s.num_running() + s.num_waiting(), 0);
    assert_eq!(s.kv_usage(), 0.0);
}

#[test]
fn shared_prefix_hits_shorten_prefill_and_count_in_tokens() {
    let mut s = Scheduler::new(cfg(16), vocab());
    let prompt: Vec<u32> = (0..10).collect();
    let mut log = Log::default();
    s.submit(req(1, &prompt, 1)).unwrap();
    let t = run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
    s.submit(req(2, &prompt, 1)).unwrap();
    run(&mut s, t, Duration::from_secs(2), &mut log);
    let done = log.finished(2).unwrap();
    assert_eq!(done.cached_tokens, 8, "two full blocks hit; the tail is computed");
    assert_eq!(done.created_cache_tokens, 0, "vLLM: nothing new cached by the second request");
    // Only the 2 uncached tokens are prefilled.
    assert_eq!(log.tokens(2)[0].0 - t, 2 * MS);
    assert_eq!(log.tokens(1)[0].1, log.tokens(2)[0].1, "same content, same reply");
    let st = s.stats();
    assert_eq!((st.prefix_queries, st.prefix_hits), (20, 8));
}

#[test]
fn chunked_prefill_within_the_token_budget() {
    let mut c = cfg(16);
    c.max_num_batched_tokens = 4;
    let mut s = Scheduler::new(c, vocab());
    s.submit(req(1, &(0..10).collect::<Vec<_>>(), 1)).unwrap();
    let mut log = Log::default();
    run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
    assert_eq!(s.stats().steps, 3);
    assert_eq!(log.tokens(1)[0].0, 10 * MS);
    // Blocks are stored as the chunks fill them: one batch per step.
    assert_eq!(log.batches.len(), 2);
}

#[test]
fn max_num_seqs_bounds_the_batch_and_the_rest_wait() {
    let mut c = cfg(64);
    c.max_num_seqs = 2;
    let mut s = Scheduler::new(c, vocab());
    for id in 1..=3 {
        s.submit(req(id, &[id as u32 * 100; 4], 2)).unwrap();
    }
    let mut out = StepOutput::default();
    s.step(Duration::ZERO, &mut out);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
    let mut log = Log::default();
    run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
    assert!(
        log.tokens(3)[0].0 > log.tokens(1)[1].0,
        "the third starts after one of the first two ends"
    );
    assert!((1..=3).all(|id| log.finished(id).is_some()));
}

#[test]
fn a_full_pool_preempts_the_newest_request_which_resumes_later() {
    // 6 blocks; two 8-token prompts (2 blocks each) generating 12 tokens each need 5 blocks each.
    let mut s = Scheduler::new(cfg(6), vocab());
    s.submit(req(1, &[1; 8], 12)).unwrap();
    s.submit(req(2, &[2; 8], 12)).unwrap();
    let mut log = Log::default();
    run(&mut s, Duration::ZERO, Duration::from_secs(10), &mut log);
    assert!(s.stats().preemptions > 0);
    for id in [1, 2] {
        assert_eq!(log.finished(id).unwrap().completion_tokens, 12);
        assert_eq!(log.tokens(id).len(), 12);
    }
    assert_eq!(s.kv_usage(), 0.0);
}

#[test]
fn cancel_frees_blocks_and_silences_the_request() {
    let mut s = Scheduler::new(cfg(16), vocab());
    s.submit(req(1, &(0..10).collect::<Vec<_>>(), 5)).unwrap();
    let mut out = StepOutput::default();
    s.step(Duration::ZERO, &mut out);
    assert!(s.kv_usage() > 0.0);
    s.cancel(1);
    assert_eq!(s.kv_usage(), 0.0);
    let mut log = Log::default();
    run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
    assert!(log.emits.is_empty());
    assert_eq!(s.stats().aborted, 1);
    // The blocks stay cached: a new request hits them.
    assert_eq!(s.dump_cache().len(), 2);
}

#[test]
fn reset_is_refused_while_blocks_are_in_use() {
    let mut s = Scheduler::new(cfg(16), vocab());
    s.submit(req(1, &(0..10).collect::<Vec<_>>(), 2)).unwrap();
    let mut out = StepOutput::default();
    s.step(Duration::ZERO, &mut out);
    assert!(s.reset_prefix_cache(&mut out).is_err());
    let mut log = Log::default();
    run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
    let mut out = StepOutput::default();
    s.reset_prefix_cache(&mut out).unwrap();
    assert_eq!(out.events, vec![KvEvent::AllBlocksCleared]);
    assert!(s.dump_cache().is_empty());
}

#[test]
fn admission_limits() {
    let mut c = cfg(16);
    c.max_waiting = 1;
    let mut s = Scheduler::new(c, vocab());
    assert_eq!(s.submit(req(1, &[], 1)), Err(RequestError::EmptyPrompt));
    assert!(matches!(
        s.submit(req(1, &[1; 250], 10)),
        Err(RequestError::TooLong { requested: 260, .. })
    ));
    s.submit(req(1, &[1; 4], 1)).unwrap();
    assert_eq!(s.submit(req(2, &[1; 4], 1)), Err(RequestError::QueueFull { limit: 1 }));
}

fn producer(id: ReqId, prompt: &[u32]) -> NewRequest {
    NewRequest { kv: KvRole::Producer { transfer_id: format!("xfer-{id}") }, ..req(id, prompt, 1) }
}

#[test]
fn a_producer_holds_its_blocks_until_pulled() {
    let mut s = Scheduler::new(cfg(16), vocab());
    let prompt: Vec<u32> = (0..10).collect();
    s.submit(producer(1, &prompt)).unwrap();
    let mut log = Log::default();
    run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
    let xfer = log.finished(1).unwrap().transfer.unwrap();
    assert_eq!(
        (xfer.transfer_id.as_str(), xfer.block_ids.len(), xfer.num_tokens),
        ("xfer-1", 3, 10)
    );
    assert_eq!(s.num_holds(), 1);
    assert!(s.kv_usage() > 0.0);
    let got = s.serve_pull("xfer-1", &xfer.block_ids).unwrap();
    assert_eq!(got, vec![prompt[0..4].to_vec(), prompt[4..8].to_vec(), prompt[8..10].to_vec()]);
    assert_eq!(s.kv_usage(), 0.0);
    assert_eq!(
        s.serve_pull("xfer-1", &xfer.block_ids),
        Err(nixl::PullError::UnknownTransfer("xfer-1".into()))
    );
}

#[test]
fn an_unpulled_hold_expires() {
    let mut s = Scheduler::new(cfg(16), vocab());
    s.submit(producer(1, &[5; 8])).unwrap();
    let mut log = Log::default();
    let t = run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
    assert_eq!(s.num_holds(), 1);
    // The hold's expiry is the next wake-up.
    let mut out = StepOutput::default();
    assert_eq!(s.step(t, &mut out), Some(t + Duration::from_secs(5)));
    s.step(t + Duration::from_secs(5), &mut out);
    assert_eq!((s.num_holds(), s.stats().transfers_expired), (0, 1));
    assert_eq!(s.kv_usage(), 0.0);
    let bad = s.serve_pull("xfer-1", &[0]);
    assert!(bad.is_err());
}

fn consumer(id: ReqId, prompt: &[u32], block_ids: Vec<u32>) -> NewRequest {
    let source = RemoteSource {
        host: "h".into(),
        port: 1,
        engine_id: "p".into(),
        request_id: "xfer".into(),
        block_ids,
    };
    NewRequest { kv: KvRole::Consumer { source }, ..req(id, prompt, 2) }
}

fn pull_of(log: &Log) -> (ReqId, usize, Vec<u32>) {
    log.emits
        .iter()
        .find_map(|(_, e)| match e {
            Emit::Pull { id, first_block, block_ids, .. } => {
                Some((*id, *first_block, block_ids.clone()))
            }
            _ => None,
        })
        .expect("a pull")
}

#[test]
fn a_consumer_pulls_caches_and_counts_the_blocks_as_hits() {
    let mut s = Scheduler::new(cfg(16), vocab());
    let prompt: Vec<u32> = (0..10).collect();
    s.submit(consumer(1, &prompt, vec![7, 8, 9])).unwrap();
    let mut log = Log::default();
    run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
    assert_eq!(pull_of(&log), (1, 0, vec![7, 8, 9]));
    assert_eq!((s.num_waiting(), s.num_running()), (1, 0));
    assert!(log.tokens(1).is_empty(), "nothing runs before the KV arrives");

    let mut out = StepOutput::default();
    s.pull_done(
        1,
        Ok(vec![prompt[0..4].to_vec(), prompt[4..8].to_vec(), prompt[8..10].to_vec()]),
        &mut out,
    );
    let t = Duration::from_millis(100);
    run(&mut s, t, Duration::from_secs(2), &mut log);
    // One token (the last prompt token) is computed before the first output token.
    assert_eq!(log.tokens(1)[0].0 - t, MS);
    let done = log.finished(1).unwrap();
    assert_eq!(done.cached_tokens, 9);
    let h = chain(&prompt, BS, None);
    assert_eq!(
        log.events()[0],
        KvEvent::BlockStored {
            block_hashes: h,
            parent_block_hash: None,
            token_ids: prompt[..8].to_vec(),
            block_size: 4,
            lora: None,
            extra_keys: Vec::new(),
        }
    );
    let st = s.stats();
    assert_eq!(
        (st.prefix_queries, st.prefix_hits, st.external_queries, st.external_hits),
        (10, 9, 10, 10)
    );
    // By source, as vLLM's prompt_tokens_by_source: 1 computed, 0 local hits, 9 pulled.
    assert_eq!((st.prompt_tokens, st.prompt_tokens_cached, st.prompt_tokens_external), (10, 9, 9));
}

#[test]
fn a_consumer_pulls_only_what_it_does_not_cache() {
    let mut s = Scheduler::new(cfg(16), vocab());
    let prompt: Vec<u32> = (0..10).collect();
    s.submit(req(1, &prompt[..6], 1)).unwrap();
    let mut log = Log::default();
    let t = run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
    s.submit(consumer(2, &prompt, vec![7, 8, 9])).unwrap();
    run(&mut s, t, Duration::from_secs(1), &mut log);
    assert_eq!(pull_of(&log), (2, 1, vec![8, 9]));
}

#[test]
fn failed_pulls_follow_the_policy() {
    let prompt: Vec<u32> = (0..10).collect();
    let wrong = vec![vec![9, 9, 9, 9]];
    for (policy, result) in [
        (KvLoadFailurePolicy::Fail, Err("connection refused".to_string())),
        (KvLoadFailurePolicy::Fail, Ok(wrong.clone())),
        (KvLoadFailurePolicy::Recompute, Err("connection refused".to_string())),
        (KvLoadFailurePolicy::Recompute, Ok(wrong)),
    ] {
        let mut c = cfg(16);
        c.kv_load_failure_policy = policy;
        let mut s = Scheduler::new(c, vocab());
        s.submit(consumer(1, &prompt, vec![1, 2, 3])).unwrap();
        let mut log = Log::default();
        run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
        let mut out = StepOutput::default();
        s.pull_done(1, result, &mut out);
        log.emits.extend(out.emits.into_iter().map(|e| (Duration::ZERO, e)));
        run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
        assert_eq!(s.stats().kv_load_failures, 1);
        match policy {
            KvLoadFailurePolicy::Fail => {
                assert!(log.emits.iter().any(|(_, e)| matches!(
                    e,
                    Emit::Failed { id: 1, error: RequestError::KvLoadFailed(_) }
                )));
                assert_eq!(s.kv_usage(), 0.0);
                assert_eq!(
                    s.stats().finished_error,
                    1,
                    "counted as vLLM's finished_reason=\"error\""
                );
            }
            KvLoadFailurePolicy::Recompute => {
                let done = log.finished(1).unwrap();
                assert_eq!((done.cached_tokens, done.completion_tokens), (0, 2));
                assert_eq!(s.stats().prefix_hits, 0);
                assert_eq!(s.stats().finished_error, 0);
            }
        }
    }
}

#[test]
fn a_migration_source_tail_shorter_than_the_consumer_prompt_is_used_up_to_its_end() {
    let mut s = Scheduler::new(cfg(16), vocab());
    let prompt: Vec<u32> = (0..14).collect();
    s.submit(consumer(1, &prompt, vec![1, 2, 3])).unwrap();
    let mut log = Log::default();
    run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
    let mut out = StepOutput::default();
    // The producer's conversation was 10 tokens: its third block holds 2 tokens.
    s.pull_done(
        1,
        Ok(vec![prompt[0..4].to_vec(), prompt[4..8].to_vec(), prompt[8..10].to_vec()]),
        &mut out,
    );
    run(&mut s, Duration::ZERO, Duration::from_secs(1), &mut log);
    assert_eq!(log.finished(1).unwrap().cached_tokens, 10);
}

#[test]
fn a_preempted_requests_readmission_is_counted_apart_from_prefix_cache_queries_and_hits() {
    // As in vLLM's `PrefixCacheStats.record(preempted=…)`: the first admission of each request is
    // a query; the re-admission of a preempted one (which re-hits its own blocks) is not.
    let mut s = Scheduler::new(cfg(6), vocab());
    s.submit(req(1, &[1; 8], 12)).unwrap();
    s.submit(req(2, &[2; 8], 12)).unwrap();
    let mut log = Log::default();
    run(&mut s, Duration::ZERO, Duration::from_secs(10), &mut log);
    let st = s.stats();
    assert!(st.preemptions > 0, "the workload must preempt");
    assert_eq!(
        (st.prefix_queries, st.prefix_hits),
        (16, 0),
        "two first admissions of 8 tokens, nothing cached yet"
    );
    assert_eq!(st.preempted_admissions, st.preemptions, "every preempted request came back once");
    assert!(
        st.preempted_queries > 8,
        "a re-admission looks up its prompt and the tokens it generated"
    );
    assert!(
        st.preempted_hits > 0 && st.preempted_hits.is_multiple_of(BS as u64),
        "it re-hits its own blocks: {st:?}"
    );
    assert!(st.preempted_hits < st.preempted_queries);
    // cached_tokens in usage is the first admission's, as vLLM's `num_cached_tokens`.
    for id in [1, 2] {
        assert_eq!(log.finished(id).unwrap().cached_tokens, 0);
    }
    // Prompt tokens are counted once per request, when its prefill yields the first token.
    assert_eq!((st.prompt_tokens, st.prompt_tokens_cached), (16, 0));
}

#[test]
fn phase_times_follow_vllms_definitions() {
    // One running sequence at a time: the second request queues behind the first.
    let mut c = cfg(16);
    c.max_num_seqs = 1;
    let mut s = Scheduler::new(c, vocab());
    let prompt: Vec<u32> = (0..10).collect();
    s.submit_at(req(1, &prompt, 3), Duration::ZERO).unwrap();
    s.submit_at(req(2, &[7; 6], 2), Duration::ZERO).unwrap();
    let mut log = Log::default();
    run(&mut s, Duration::ZERO, Duration::from_secs(10), &mut log);
    // 1: scheduled at 0, 10 prompt tokens at 1000/s → first token at 10 ms, two 10 ms decodes.
    let p1 = log.finished(1).unwrap().phases;
    assert_eq!(
        p1,
        PhaseTimes {
            queued: Duration::ZERO,
            prefill: 10 * MS,
            decode: 20 * MS,
            inference: 30 * MS
        }
    );
    // 2: waits for 1 to finish (30 ms), 6 tokens (6 ms), one decode (10 ms).
    let p2 = log.finished(2).unwrap().phases;
    assert_eq!(
        p2,
        PhaseTimes { queued: 30 * MS, prefill: 6 * MS, decode: 10 * MS, inference: 16 * MS }
    );
}

#[test]
fn steps_report_iteration_tokens_and_finishes_report_prefill_computed_tokens() {
    let mut s = Scheduler::new(cfg(16), vocab());
    let prompt: Vec<u32> = (0..10).collect();
    s.submit(req(1, &prompt, 2)).unwrap();
    let mut t = Duration::ZERO;
    let mut seen = Vec::new();
    let mut computed = Vec::new();
    for _ in 0..10 {
        let mut out = StepOutput::default();
        let wake = s.step(t, &mut out);
        seen.push(out.iteration_tokens);
        computed.extend(out.emits.iter().filter_map(|e| match e {
            Emit::Finished { done, .. } => Some(done.prefill_computed_tokens),
            _ => None,
        }));
        match wake {
            Some(w) => t = w,
            None => break,
        }
    }
    // Scheduling only; the prefill step (10 computed + 1 generated); the decode step (1).
    assert_eq!(seen, vec![None, Some(11), Some(1)]);
    // Like vLLM's FinishedRequestStats: counted once, at the finish, beside the prefill time.
    assert_eq!(computed, vec![10]);
    // A second request with the same prompt hits 2 blocks (8 tokens) and computes 2.
    s.submit(req(2, &prompt, 1)).unwrap();
    let mut log = Log::default();
    run(&mut s, t, t + Duration::from_secs(1), &mut log);
    assert_eq!(log.finished(2).map(|d| d.prefill_computed_tokens), Some(2));
    let st = s.stats();
    assert_eq!((st.prompt_tokens, st.prompt_tokens_cached), (20, 8));
    assert_eq!(st.prompt_tokens_external, 0, "local hits are not external");
}

fn lora_cfg(max_loras: usize) -> SchedulerConfig {
    SchedulerConfig { max_loras: Some(max_loras), lora_load_ms: 50.0, ..cfg(64) }
}

fn adapter(id: u32) -> Adapter {
    Adapter { id, name: format!("a{id}").into() }
}

/// A request for adapter `lora` (`None`: the base model), its hashes keyed by the adapter.
fn lora_req(id: ReqId, prompt: &[u32], lora: Option<u32>) -> NewRequest {
    let lora = lora.map(adapter);
    let hashes = crate::hash::chain_for(prompt, BS, lora.as_ref().map(|a| &*a.name), None);
    NewRequest { hashes, lora, ..req(id, prompt, 1) }
}

#[test]
fn max_loras_bounds_the_batch_and_a_swap_costs_the_load_time() {
    let mut s = Scheduler::new(lora_cfg(1), vocab());
    let p: Vec<u32> = (0..8).collect();
    s.submit(lora_req(1, &p, Some(1))).unwrap();
    s.submit(lora_req(2, &p, Some(2))).unwrap();
    s.submit(lora_req(3, &p, None)).unwrap();
    let mut log = Log::default();
    let mut out = StepOutput::default();
    s.step(Duration::ZERO, &mut out);
    // Request 2's adapter has no slot in this batch: it waits, and the base request behind it
    // goes first. Running: a1 only; waiting: a2.
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
    let (running, waiting) = s.lora_adapters();
    assert_eq!((running, waiting), (vec![Arc::from("a1")], vec![Arc::from("a2")]));
    let t0 = run(&mut s, Duration::ZERO, Duration::from_secs(10), &mut log);

    // Step 1: 16 prompt tokens (16 ms) + loading a1 (50 ms). Step 2: 8 tokens + loading a2.
    let t = |id| log.tokens(id)[0].0;
    assert_eq!((t(1), t(3)), (66 * MS, 66 * MS));
    assert_eq!(t(2), 66 * MS + 58 * MS);
    assert_eq!(s.stats().lora_loads, 2);
    assert_eq!(s.resident_adapters(), [2], "a2 took a1's only slot");
    // Same prompt, three keys: nothing was shared, though 1 and 3 ran in one step.
    for id in 1..=3 {
        assert_eq!(log.finished(id).unwrap().cached_tokens, 0, "request {id}");
    }
    let stored: Vec<(Option<Adapter>, Vec<u64>)> = log
        .events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored { lora, block_hashes, .. } => Some((lora, block_hashes)),
            _ => None,
        })
        .collect();
    let want = |l: Option<u32>| {
        let a = l.map(adapter);
        let h = crate::hash::chain_for(&p, BS, a.as_ref().map(|a| &*a.name), None);
        (a, h)
    };
    assert_eq!(stored, [want(Some(1)), want(None), want(Some(2))]);

    // Each key hits only its own blocks; a resident adapter costs nothing, an evicted one reloads.
    s.submit(lora_req(4, &p, Some(2))).unwrap();
    let end = run(&mut s, t0, Duration::from_secs(10), &mut log);
    assert_eq!(end - t0, 4 * MS, "4 uncached tokens, a2 resident");
    assert_eq!(log.finished(4).unwrap().cached_tokens, 4);
    s.submit(lora_req(5, &p, Some(1))).unwrap();
    let t1 = run(&mut s, end, Duration::from_secs(10), &mut log);
    assert_eq!(t1 - end, 54 * MS, "a1 reloaded");
    assert_eq!(log.finished(5).unwrap().cached_tokens, 4);
    assert_eq!(s.stats().lora_loads, 3);
}

#[test]
fn loaded_adapters_take_a_slot_and_unloaded_ones_leave_it() {
    let mut s = Scheduler::new(lora_cfg(2), vocab());
    s.adapter_loaded(1);
    s.adapter_loaded(2);
    s.adapter_loaded(3); // evicts 1, the least recently used
    assert_eq!(s.resident_adapters(), [2, 3]);
    s.adapter_unloaded(2);
    assert_eq!(s.resident_adapters(), [3]);
    let p: Vec<u32> = (0..8).collect();
    s.submit(lora_req(1, &p, Some(3))).unwrap();
    s.submit(lora_req(2, &p, Some(4))).unwrap();
    let mut log = Log::default();
    let end = run(&mut s, Duration::ZERO, Duration::from_secs(10), &mut log);
    // Two slots: both in one step; only adapter 4 is loaded.
    assert_eq!(end, 16 * MS + 50 * MS);
    assert_eq!(s.stats().lora_loads, 1);
    // Without LoRA the calls are no-ops.
    let mut plain = Scheduler::new(cfg(8), vocab());
    plain.adapter_loaded(1);
    assert!(plain.resident_adapters().is_empty());
}

#[test]
fn blocks_evicted_to_the_cpu_tier_are_loaded_back_at_the_load_bandwidth() {
    let cfg = SchedulerConfig { cpu_offload_blocks: 8, cpu_load_tokens_per_s: 4000.0, ..cfg(6) };
    let mut s = Scheduler::new(cfg, vocab());
    let a: Vec<u32> = (0..17).collect();
    let b: Vec<u32> = (100..117).collect();
    let mut log = Log::default();
    s.submit(req(1, &a, 1)).unwrap();
    let t = run(&mut s, Duration::ZERO, Duration::from_secs(10), &mut log);
    // B needs 5 of the 6 blocks: A's blocks 3, 2, 1 are evicted (tail first) to the CPU tier.
    s.submit_at(req(2, &b, 1), t).unwrap();
    let t = run(&mut s, t, Duration::from_secs(10), &mut log);
    let ha = chain(&a, BS, None);
    let offloaded: Vec<u64> = log
        .events()
        .iter()
        .filter_map(|e| match e {
            KvEvent::OffloadStored { block_hash, .. } => Some(*block_hash),
            _ => None,
        })
        .collect();
    assert_eq!(offloaded, [ha[3], ha[2], ha[1]]);
    // A again: block 0 from the GPU, blocks 1..4 loaded from the CPU (12 tokens at 4 per ms:
    // 3 ms), the last token computed (1 ms).
    s.submit_at(req(3, &a, 1), t).unwrap();
    let mut again = Log::default();
    run(&mut s, t, t + Duration::from_secs(10), &mut again);
    let done = again.finished(3).unwrap();
    assert_eq!((done.cached_tokens, done.prefill_computed_tokens), (16, 1));
    assert_eq!(again.tokens(3)[0].0 - t, 4 * MS);
    // The loaded blocks are cached on the GPU again, and announced there.
    let reloaded = KvEvent::BlockStored {
        block_hashes: ha[1..4].to_vec(),
        parent_block_hash: Some(ha[0]),
        token_ids: a[4..16].to_vec(),
        block_size: 4,
        lora: None,
        extra_keys: Vec::new(),
    };
    assert!(again.events().contains(&reloaded), "{:?}", again.events());
    let stats = s.stats();
    assert_eq!(stats.offload_loaded_tokens, 12);
    assert_eq!((stats.external_hits, stats.prefix_hits), (12, 4), "GPU hits apart from loads");
}

#[test]
fn without_a_cpu_tier_an_evicted_prefix_is_recomputed() {
    let mut s = Scheduler::new(cfg(6), vocab());
    let a: Vec<u32> = (0..17).collect();
    let mut log = Log::default();
    s.submit(req(1, &a, 1)).unwrap();
    let t = run(&mut s, Duration::ZERO, Duration::from_secs(10), &mut log);
    s.submit_at(req(2, &(100..117).collect::<Vec<u32>>(), 1), t).unwrap();
    let t = run(&mut s, t, Duration::from_secs(10), &mut log);
    s.submit_at(req(3, &a, 1), t).unwrap();
    let mut again = Log::default();
    run(&mut s, t, t + Duration::from_secs(10), &mut again);
    assert_eq!(again.finished(3).unwrap().cached_tokens, 4);
    assert_eq!(again.tokens(3)[0].0 - t, 13 * MS);
    assert!(log.events().iter().all(|e| !matches!(e, KvEvent::OffloadStored { .. })));
}
