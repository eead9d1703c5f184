//! Index == engine after an evicting workload, on two real vLLM CPU engines (`make test-vllm`).
//!
//! Each engine gets a cache of 96 blocks (`--num-gpu-blocks-override`; the smallest
//! `VLLM_CPU_KVCACHE_SPACE`, 1 GiB, holds 65,536 blocks of the dummy model), then ~8 times that many
//! distinct blocks go through the gateway (families of prompts sharing prefixes, token ids, the
//! generated ids returned), so both engines evict and report `BlockRemoved`. Then, for every
//! sequence the test sent, on both workers: once the indexer has applied everything the engine
//! published, the index's overlap for that worker × block size must equal the engine's own
//! `cached_tokens` for the same prompt. A block the index holds but the engine evicted, or the
//! reverse, is a mismatch.

mod vllm_common;

use std::collections::BTreeSet;

use kvmesh_core::headers;
use kvmesh_e2e::client::post_json;
use kvmesh_e2e::vllm::{VllmOptions, MODEL_NAME};
use serde_json::{json, Value};
use vllm_common::{index_overlap, index_view, settle, start, usage, EventWatch, Rng, BLOCK};

const CACHE_BLOCKS: u32 = 96;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_matches_evicting_real_engines() -> anyhow::Result<()> {
    let stack = start(VllmOptions {
        num_gpu_blocks: Some(CACHE_BLOCKS),
        max_model_len: 2048,
        ..VllmOptions::default()
    })
    .await?;
    let watches: Vec<(String, EventWatch)> = stack
        .workers
        .iter()
        .map(|w| Ok((w.id.clone(), EventWatch::start(w.kv_events.as_deref().unwrap_or_default())?)))
        .collect::<anyhow::Result<_>>()?;
    let watch_refs: Vec<(&str, &EventWatch)> =
        watches.iter().map(|(id, w)| (id.as_str(), w)).collect();

    // 24 families × 4 prompts: a 4-block family prefix, then 3–6 blocks of their own (plain word ids).
    let mut rng = Rng::new(99);
    let url = stack.gateway("/v1/completions");
    let mut sequences: Vec<Vec<u32>> = Vec::new();
    let mut distinct = BTreeSet::new();
    for family in 0..24u32 {
        let prefix: Vec<u32> = (0..4 * BLOCK).map(|_| 1000 + rng.below(20_000) as u32).collect();
        for member in 0..4 {
            let mut prompt = prefix.clone();
            let own = (3 + rng.below(4)) * BLOCK + rng.below(BLOCK);
            prompt.extend((0..own).map(|_| 1000 + rng.below(20_000) as u32));
            let body = json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4 + rng.below(40), "return_token_ids": true, "ignore_eos": true});
            let r = post_json(
                stack.client(),
                &url,
                &body,
                &[(headers::DEFAULT_SESSION_HEADER, &format!("family-{family}-{member}"))],
            )
            .await?;
            anyhow::ensure!(r.status == 200, "{} {}", r.status, r.text);
            let generated: Vec<u32> = r
                .json()
                .pointer("/choices/0/token_ids")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(|v| v.as_u64().map(|x| x as u32)).collect())
                .unwrap_or_default();
            anyhow::ensure!(!generated.is_empty(), "no token_ids in the answer: {}", r.text);
            // The engine computed the prompt and every generated token but the last.
            let mut seq = prompt;
            seq.extend_from_slice(&generated[..generated.len() - 1]);
            for k in 1..=seq.len() / BLOCK as usize {
                distinct.insert(seq[..k * BLOCK as usize].to_vec());
            }
            sequences.push(seq);
        }
    }
    settle(&stack, &watch_refs).await?;
    let mut held = Vec::new();
    for (id, _) in &watch_refs {
        let v = index_view(&stack, id).await?;
        assert_eq!((v.decode_errors, v.gaps), (0, 0), "{id}: {v:?}");
        held.push((id.to_string(), v.blocks_held));
    }
    let preemptions = stack.engine_sum("vllm:num_preemptions_total").await?;
    eprintln!(
        "workload: {} requests, {} distinct blocks over 2 engines of {CACHE_BLOCKS} blocks; index holds {held:?}; engine preemptions {preemptions}",
        sequences.len(),
        distinct.len()
    );
    assert!(distinct.len() > 4 * CACHE_BLOCKS as usize, "the workload must evict");
    assert!(
        held.iter().all(|(_, n)| *n <= u64::from(CACHE_BLOCKS)),
        "the index holds more than an engine can: {held:?}"
    );

    // Every sequence, on every worker: the index's overlap == the engine's hit.
    let (mut probes, mut equal, mut indexed_blocks) = (0, 0, 0);
    let mut mismatches = Vec::new();
    for (i, seq) in sequences.iter().enumerate().rev() {
        for w in &stack.workers {
            let full = seq.len() / BLOCK as usize;
            let mut prompt = seq[..full * BLOCK as usize].to_vec();
            prompt.push(999); // one more token: the whole chain can hit (the last token is computed)
            let body = json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1});
            settle(&stack, &watch_refs).await?;
            let predicted = index_overlap(&stack, &w.id, "/v1/completions", &body).await?;
            let r = post_json(stack.client(), &w.url("/v1/completions"), &body, &[]).await?;
            anyhow::ensure!(r.status == 200, "{} {}", r.status, r.text);
            let (_, cached) = usage(&r.json()).unwrap_or_default();
            probes += 1;
            indexed_blocks += predicted;
            if predicted * BLOCK == cached {
                equal += 1;
            } else {
                mismatches.push((i, w.id.clone(), predicted * BLOCK, cached));
            }
        }
    }
    eprintln!("index == engine: {equal}/{probes} probes equal ({indexed_blocks} indexed blocks confirmed by engine hits)");
    for (i, w, p, c) in mismatches.iter().take(10) {
        eprintln!("  sequence {i} on {w}: index {p} tokens, engine cached {c}");
    }
    assert!(indexed_blocks > 0, "some probes must hit");
    assert!(mismatches.is_empty(), "{} of {probes} probes differ", mismatches.len());
    Ok(())
}
