//! The index mirrors real engines exactly: real `vllm-sim` processes publish KV events over ZMQ,
//! the real indexer binary consumes them, and after a mixed workload that forces evictions the set
//! of blocks the index holds for each worker equals the set the simulator's cache holds — engine
//! hashes *and* the chain hashes recomputed from the simulator's token ids — also after a forced
//! sequence gap (replayed), after `reset_prefix_cache`, and, when the engine's replay buffer is too
//! short for a gap, the index resyncs and never claims a block the engine no longer has.

// Test helpers fail by panicking; the production lints on panics and unwraps do not apply.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use common::{eventually, indexer_binary, route, sim_binary, Proc};
use kvmesh_core::hashing::{chain, local_block_hash, SequenceHash, XXH3_SEED};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::{json, Value};

const BLOCK: usize = 16;

struct Sim {
    id: String,
    http: String,
    proc: Proc,
}

fn start_sim(id: &str, dir: &std::path::Path, extra: &[&str]) -> Sim {
    let mut cmd = Command::new(sim_binary());
    cmd.args([
        "--port",
        "0",
        "--id",
        id,
        "--block-size",
        "16",
        "--num-gpu-blocks",
        "48",
        "--speedup",
        "200",
    ])
    .args([
        "--kv-events-endpoint",
        "tcp://127.0.0.1:*",
        "--kv-events-replay-endpoint",
        "tcp://127.0.0.1:*",
    ])
    .args(extra);
    let proc = Proc::start(id, cmd, dir);
    Sim { id: id.to_owned(), http: proc.field("http"), proc }
}

fn fleet_toml(sims: &[&Sim]) -> String {
    let mut s = String::from("listen = \"127.0.0.1:0\"\n[model]\nname = \"deepseek-v4\"\nblock_size = 16\n[routing]\nscrape_interval_ms = 200\nscrape_timeout_ms = 200\n");
    for sim in sims {
        s.push_str(&format!(
            "[[workers]]\nid = \"{}\"\nrole = \"both\"\nendpoint = \"{}\"\nkv_events = \"{}\"\nkv_replay = \"{}\"\n",
            sim.id,
            sim.http,
            sim.proc.field("kv_events"),
            sim.proc.field("replay")
        ));
    }
    s
}

/// (engine hash → chain hash) of every block the simulator caches, chain hashes recomputed from
/// its token ids with kvmesh-core's hashing.
async fn sim_blocks(http: &reqwest::Client, sim: &Sim) -> Result<BTreeMap<u64, u64>, String> {
    let v: Value = http
        .get(format!("http://{}/admin/cache", sim.http))
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    let blocks = v["blocks"].as_array().ok_or("no blocks array")?;
    let mut chains: BTreeMap<u64, u64> = BTreeMap::new();
    // Ordered by position: parents come first.
    for b in blocks {
        let hash = b["block_hash"].as_u64().ok_or("block_hash")?;
        let tokens: Vec<u32> = b["token_ids"]
            .as_array()
            .ok_or("token_ids")?
            .iter()
            .map(|t| t.as_u64().unwrap_or(0) as u32)
            .collect();
        let parent = match b["parent_block_hash"].as_u64() {
            None => None,
            Some(p) => Some(SequenceHash(
                *chains.get(&p).ok_or_else(|| format!("parent {p} listed after its child"))?,
            )),
        };
        chains.insert(hash, chain(parent, local_block_hash(&tokens, XXH3_SEED)).0);
    }
    Ok(chains)
}

/// (engine hash → chain hash) of every block the index holds for `worker`.
async fn index_blocks(
    http: &reqwest::Client,
    indexer: &str,
    worker: &str,
) -> Result<BTreeMap<u64, u64>, String> {
    let v: Value = http
        .get(format!("http://{indexer}/debug/blocks?worker={worker}"))
        .send()
        .await
        .map_err(|e| e.to_string())?
        .json()
        .await
        .map_err(|e| e.to_string())?;
    let mut out = BTreeMap::new();
    for b in v[0]["blocks"].as_array().ok_or("no blocks")? {
        if b["indexed"].as_bool() != Some(true) {
            return Err(format!(
                "block {b} is mapped but not indexed (evicted by the memory bound?)"
            ));
        }
        out.insert(
            b["engine_hash"].as_u64().ok_or("engine_hash")?,
            b["chain_hash"].as_u64().ok_or("chain_hash")?,
        );
    }
    Ok(out)
}

async fn assert_mirrors(http: &reqwest::Client, indexer: &str, sim: &Sim, when: &str) {
    eventually(&format!("{when}: index mirrors {}", sim.id), || async {
        let want = sim_blocks(http, sim).await?;
        let got = index_blocks(http, indexer, &sim.id).await?;
        if want == got {
            return Ok(());
        }
        let missing = want.keys().filter(|k| !got.contains_key(k)).count();
        let extra = got.keys().filter(|k| !want.contains_key(k)).count();
        let wrong_chain = want.iter().filter(|(k, v)| got.get(k).is_some_and(|g| g != *v)).count();
        Err(format!("sim {} blocks, index {}: {missing} missing, {extra} extra, {wrong_chain} with another chain hash", want.len(), got.len()))
    })
    .await;
}

/// A mixed workload on one simulator: token prompts sharing a few prefixes (so blocks are reused and
/// branch), chat requests, generation that fills blocks — more than the cache holds, so it evicts.
async fn workload(http: &reqwest::Client, sim: &Sim, seed: u64, requests: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let prefixes: Vec<Vec<u32>> =
        (0..3).map(|p| (0..(BLOCK * 3) as u32).map(|i| 1000 + p * 1000 + i).collect()).collect();
    for i in 0..requests {
        let body = if i % 5 == 4 {
            json!({"model": "deepseek-v4", "max_tokens": rng.gen_range(1..20),
                   "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": format!("question {} about {}", i, rng.gen_range(0..4))}]})
        } else {
            let mut prompt = prefixes[rng.gen_range(0..prefixes.len())].clone();
            let extra = rng.gen_range(0..(BLOCK * 6));
            prompt.extend((0..extra).map(|_| rng.gen_range(5000..9000u32)));
            json!({"model": "deepseek-v4", "prompt": prompt, "max_tokens": rng.gen_range(1..24)})
        };
        let path =
            if body.get("messages").is_some() { "/v1/chat/completions" } else { "/v1/completions" };
        let resp =
            http.post(format!("http://{}{path}", sim.http)).json(&body).send().await.unwrap();
        assert!(
            resp.status().is_success(),
            "{}: {}",
            resp.status(),
            resp.text().await.unwrap_or_default()
        );
        let _ = resp.bytes().await;
    }
}

async fn debug_rank(http: &reqwest::Client, indexer: &str, worker: &str) -> Value {
    let v: Value = http
        .get(format!("http://{indexer}/debug/workers"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v.as_array().unwrap().iter().find(|w| w["id"] == worker).unwrap()["ranks"][0].clone()
}

async fn sim_evictions(http: &reqwest::Client, indexer: &str) -> u64 {
    let text =
        http.get(format!("http://{indexer}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with("kvmesh_kv_blocks_total") && l.contains("op=\"removed\""))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum::<f64>() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_mirrors_real_simulators() {
    let dir = tempfile::tempdir().unwrap();
    let s0 = start_sim("s0", dir.path(), &[]);
    let s1 = start_sim("s1", dir.path(), &["--kv-events-layout", "legacy"]);
    // s2 keeps only 4 batches for replay: a longer gap cannot be replayed.
    let s2 = start_sim("s2", dir.path(), &["--kv-events-buffer-steps", "4"]);
    let http = reqwest::Client::new();
    // Blocks cached before the indexer starts must be learned from the start-up replay.
    workload(&http, &s0, 1, 5).await;

    let fleet = dir.path().join("fleet.toml");
    std::fs::write(&fleet, fleet_toml(&[&s0, &s1, &s2])).unwrap();
    let mut cmd = Command::new(indexer_binary());
    cmd.arg("--config").arg(&fleet).args(["--listen", "127.0.0.1:0"]);
    let indexer = Proc::start("indexer", cmd, dir.path());
    let ix = indexer.field("http");
    eventually("indexer ready", || async {
        let r = http.get(format!("http://{ix}/readyz")).send().await.map_err(|e| e.to_string())?;
        if r.status().is_success() {
            Ok(())
        } else {
            Err(r.status().to_string())
        }
    })
    .await;
    assert_mirrors(&http, &ix, &s0, "after start-up replay").await;

    // 1. Mixed workload with evictions, both layouts.
    let (a, b, c) = tokio::join!(
        workload(&http, &s0, 2, 40),
        workload(&http, &s1, 3, 40),
        workload(&http, &s2, 4, 10)
    );
    let _ = (a, b, c);
    for sim in [&s0, &s1, &s2] {
        assert_mirrors(&http, &ix, sim, "after the mixed workload").await;
    }
    assert!(sim_evictions(&http, &ix).await > 0, "the workload must force evictions");

    // 2. A forced sequence gap: s0 numbers and buffers three batches but does not publish them.
    let last = debug_rank(&http, &ix, "s0").await["last_seq"].as_u64().unwrap();
    let faults = json!({"drop_seqs": {"start": last + 1, "end": last + 4}});
    let r =
        http.post(format!("http://{}/admin/faults", s0.http)).json(&faults).send().await.unwrap();
    assert!(r.status().is_success());
    workload(&http, &s0, 5, 12).await;
    assert_mirrors(&http, &ix, &s0, "after a replayed gap").await;
    let rank = debug_rank(&http, &ix, "s0").await;
    assert!(rank["gaps"].as_u64().unwrap() >= 1, "{rank}");
    assert!(rank["replays"].as_u64().unwrap() >= 2, "{rank}");
    assert_eq!(rank["resyncs"], 0, "{rank}");

    // 3. reset_prefix_cache on s1 (409 while blocks are in use, as vLLM).
    eventually("reset_prefix_cache accepted", || async {
        let r = http
            .post(format!("http://{}/reset_prefix_cache", s1.http))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if r.status().is_success() {
            Ok(())
        } else {
            Err(r.status().to_string())
        }
    })
    .await;
    assert_mirrors(&http, &ix, &s1, "after reset_prefix_cache").await;
    assert!(index_blocks(&http, &ix, "s1").await.unwrap().is_empty());
    workload(&http, &s1, 6, 10).await;
    assert_mirrors(&http, &ix, &s1, "after reset and more traffic").await;

    // 4. A gap longer than s2's replay buffer: resync, then never a block the engine lacks.
    let last = debug_rank(&http, &ix, "s2").await["last_seq"].as_u64().unwrap();
    let faults = json!({"drop_seqs": {"start": last + 1, "end": last + 9}});
    assert!(http
        .post(format!("http://{}/admin/faults", s2.http))
        .json(&faults)
        .send()
        .await
        .unwrap()
        .status()
        .is_success());
    workload(&http, &s2, 7, 14).await;
    eventually("s2 resynced after an unreplayable gap", || async {
        let rank = debug_rank(&http, &ix, "s2").await;
        if rank["resyncs"].as_u64().unwrap_or(0) >= 1 {
            Ok(())
        } else {
            Err(rank.to_string())
        }
    })
    .await;
    eventually("s2's index is a subset of its cache", || async {
        let want = sim_blocks(&http, &s2).await?;
        let got = index_blocks(&http, &ix, "s2").await?;
        let extra: BTreeSet<_> = got.iter().filter(|(k, v)| want.get(k) != Some(v)).collect();
        if extra.is_empty() {
            Ok(())
        } else {
            Err(format!("{} blocks claimed that the engine lacks", extra.len()))
        }
    })
    .await;
    // Everything s2 caches from now on is indexed again.
    let r = http.post(format!("http://{}/reset_prefix_cache", s2.http)).send().await.unwrap();
    if r.status().is_success() {
        workload(&http, &s2, 8, 8).await;
        assert_mirrors(&http, &ix, &s2, "after resync and reset").await;
    }

    // Routing sees it too: the deepest chain s0 caches, sent as a prompt, overlaps fully but for
    // the last block (an exact multiple of the block size: the engine computes the last token).
    let v: Value = http
        .get(format!("http://{}/admin/cache", s0.http))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let blocks = v["blocks"].as_array().unwrap();
    let by_hash: BTreeMap<u64, &Value> =
        blocks.iter().map(|b| (b["block_hash"].as_u64().unwrap(), b)).collect();
    let deepest = blocks.iter().max_by_key(|b| b["position"].as_u64()).unwrap();
    let mut chain_blocks = vec![deepest];
    while let Some(p) = chain_blocks.last().unwrap()["parent_block_hash"].as_u64() {
        chain_blocks.push(by_hash[&p]);
    }
    let prompt: Vec<u64> = chain_blocks
        .iter()
        .rev()
        .flat_map(|b| b["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()))
        .collect();
    let d: Value = route(&http, &ix, json!({"prompt": prompt}).to_string()).await;
    assert_eq!(d["best_overlap_blocks"].as_u64(), Some(chain_blocks.len() as u64 - 1), "{d}");
    assert_eq!(d["isl_blocks"].as_u64(), Some(chain_blocks.len() as u64), "{d}");
    // And the engine agrees: serving that prompt, s0 reports exactly the predicted blocks cached.
    let served: Value = http
        .post(format!("http://{}/v1/completions", s0.http))
        .json(&json!({"model": "deepseek-v4", "prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let predicted_tokens = d["best_overlap_blocks"].as_u64().map(|b| b * 16);
    assert_eq!(
        served["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        predicted_tokens,
        "{served}"
    );
    drop(indexer);
}
