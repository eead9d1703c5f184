//! Index benchmarks (README "Benchmarks"): block events applied per second on one core,
//! `find_matches` latency percentiles, and memory per (block, worker) entry.
//!
//! Criterion measures the throughput; latency percentiles (p50/p99) and bytes per entry are measured
//! by hand in the same run (criterion reports means) and printed as `FIGURE …` lines.
//! Short measurement times: the machine is shared. `cargo bench -p kvmesh-indexer --bench index`.
//! With `KVMESH_BENCH_FIGURES=<file>` every figure (the apply rates from criterion's own samples)
//! is also appended to that file as one JSON line, for the benchmark report (`make bench`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, Criterion, Throughput};
use kvmesh_core::hashing::{sequence_hashes, XXH3_SEED};
use kvmesh_indexer::events::apply::apply_batch;
use kvmesh_indexer::events::decode::{decode_batch, EventBatch, KvEvent};
use kvmesh_indexer::index::{KvIndex, Tier};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// Counts live heap bytes, to measure what the index really allocates.
struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts sizes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const BS: usize = 16;
/// Criterion samples per benchmark (see `config`).
const SAMPLE_SIZE: usize = 20;
#[path = "common/figures.rs"]
mod figures;
use figures::emit;

/// The loop criterion's `iter` times, run through `iter_custom` so the `(iterations, time)`
/// samples can be kept for [`slope_s`].
fn timed_loop(
    samples: &mut Vec<(u64, Duration)>,
    iters: u64,
    mut routine: impl FnMut(),
) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        routine();
    }
    let elapsed = start.elapsed();
    samples.push((iters, elapsed));
    elapsed
}

/// Criterion's slope estimate over its measurement samples (the last `SAMPLE_SIZE` calls; the
/// earlier ones are warm-up): Σ(iterations · time) / Σ(iterations²), seconds per iteration.
fn slope_s(samples: &[(u64, Duration)]) -> Option<f64> {
    let m = &samples[samples.len().saturating_sub(SAMPLE_SIZE)..];
    let xy: f64 = m.iter().map(|(i, d)| *i as f64 * d.as_secs_f64()).sum();
    let xx: f64 = m.iter().map(|(i, _)| (*i as f64).powi(2)).sum();
    (xx > 0.0).then(|| xy / xx)
}

fn random_tokens(rng: &mut StdRng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.gen_range(0..100_000)).collect()
}

fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
    KvEvent::Stored {
        block_hashes: hashes,
        parent,
        token_ids: tokens,
        block_size: BS as u32,
        lora_name: None,
        cache_salt: None,
        medium: Some("GPU".into()),
        group_idx: None,
        spec_kind: None,
        sliding_window: None,
        extra_terms: vec![],
    }
}

/// One worker's store-then-evict round: `chains` chains of `len` blocks, stored in batches of 16
/// blocks chained by parent, then removed. Applying a round leaves the index as it found it.
fn round(rng: &mut StdRng, worker: u64, chains: usize, len: usize) -> Vec<EventBatch> {
    let mut batches = Vec::new();
    let mut all = Vec::new();
    for c in 0..chains {
        let tokens = random_tokens(rng, len * BS);
        for (i, chunk) in tokens.chunks(16 * BS).enumerate() {
            let hashes: Vec<u64> = (0..chunk.len() / BS)
                .map(|b| (worker << 48) | ((c as u64) << 24) | (i * 16 + b) as u64 | (1 << 47))
                .collect();
            let p = if i == 0 {
                None
            } else {
                Some((worker << 48) | ((c as u64) << 24) | (i * 16 - 1) as u64 | (1 << 47))
            };
            all.extend(hashes.iter().copied());
            batches.push(EventBatch {
                ts: 0.0,
                events: vec![stored(hashes, p, chunk.to_vec())],
                dp_rank: None,
            });
        }
    }
    for chunk in all.chunks(64) {
        batches.push(EventBatch {
            ts: 0.0,
            events: vec![KvEvent::Removed {
                block_hashes: chunk.to_vec(),
                medium: None,
                group_idx: None,
            }],
            dp_rank: None,
        });
    }
    batches
}

/// Resident background: each worker holds `blocks` blocks in chains of 32.
fn background(index: &mut KvIndex, rng: &mut StdRng, workers: u32, blocks: usize) {
    for w in 0..workers {
        index.add_worker(w);
        for c in 0..blocks / 32 {
            let tokens = random_tokens(rng, 32 * BS);
            let hashes: Vec<u64> =
                (0..32).map(|b| (u64::from(w) << 40) | ((c as u64) << 8) | b).collect();
            index.store(w, None, &hashes, &tokens, BS, XXH3_SEED);
        }
    }
}

fn bench_apply(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(1);
    let mut index = KvIndex::new(100_000_000, 10_000_000);
    background(&mut index, &mut rng, 16, 50_000);
    let rounds: Vec<(u32, Vec<EventBatch>)> =
        (0..16u32).map(|w| (w, round(&mut rng, u64::from(w), 4, 64))).collect();
    let ops: u64 = rounds
        .iter()
        .flat_map(|(_, b)| b)
        .flat_map(|b| &b.events)
        .map(|e| match e {
            KvEvent::Stored { block_hashes, .. } | KvEvent::Removed { block_hashes, .. } => {
                block_hashes.len() as u64
            }
            _ => 0,
        })
        .sum();
    let mut g = c.benchmark_group("apply");
    g.throughput(Throughput::Elements(ops));
    let mut samples: [Vec<(u64, Duration)>; 5] = Default::default();
    let [resident, msgpack, cached, decode_only, tree_only] = &mut samples;
    g.bench_function("decoded_block_ops_800k_resident", |b| {
        b.iter_custom(|iters| {
            timed_loop(resident, iters, || {
                for (w, batches) in &rounds {
                    for batch in batches {
                        black_box(apply_batch(&mut index, *w, batch, BS as u32));
                    }
                }
            })
        })
    });
    // The same rounds from msgpack bytes (what the listener thread decodes) for comparison.
    let encoded: Vec<(u32, Vec<Vec<u8>>)> =
        rounds.iter().map(|(w, bs)| (*w, bs.iter().map(encode).collect())).collect();
    g.bench_function("msgpack_decode_and_apply_block_ops_800k_resident", |b| {
        b.iter_custom(|iters| {
            timed_loop(msgpack, iters, || {
                for (w, batches) in &encoded {
                    for bytes in batches {
                        if let Ok(batch) = decode_batch(bytes) {
                            black_box(apply_batch(&mut index, *w, &batch, BS as u32));
                        }
                    }
                }
            })
        })
    });
    // Decoding alone: the typed decoder, and for comparison only the first step of the decoder it
    // replaced (reading each payload into an rmpv::Value tree, before any field was picked).
    g.bench_function("msgpack_decode_only_block_ops", |b| {
        b.iter_custom(|iters| {
            timed_loop(decode_only, iters, || {
                for (_, batches) in &encoded {
                    for bytes in batches {
                        let _ = black_box(decode_batch(bytes));
                    }
                }
            })
        })
    });
    g.bench_function("rmpv_value_tree_only_block_ops", |b| {
        b.iter_custom(|iters| {
            timed_loop(tree_only, iters, || {
                for (_, batches) in &encoded {
                    for bytes in batches {
                        let _ = black_box(rmpv::decode::read_value(&mut &bytes[..]));
                    }
                }
            })
        })
    });
    // The same rounds against an otherwise empty index (tables stay in cache).
    let mut small = KvIndex::new(100_000_000, 10_000_000);
    for w in 0..16 {
        small.add_worker(w);
    }
    g.bench_function("decoded_block_ops_cache_resident", |b| {
        b.iter_custom(|iters| {
            timed_loop(cached, iters, || {
                for (w, batches) in &rounds {
                    for batch in batches {
                        black_box(apply_batch(&mut small, *w, batch, BS as u32));
                    }
                }
            })
        })
    });
    g.finish();
    let names = [
        "decoded_block_ops_800k_resident",
        "msgpack_decode_and_apply_block_ops_800k_resident",
        "decoded_block_ops_cache_resident",
        "msgpack_decode_only_block_ops",
        "rmpv_value_tree_only_block_ops",
    ];
    for (name, s) in names.into_iter().zip(&samples) {
        if let Some(per_iter) = slope_s(s) {
            emit(
                serde_json::json!({"bench": "index", "figure": "apply", "name": name, "block_ops_per_s": ops as f64 / per_iter, "block_ops_per_iter": ops, "s_per_iter": per_iter}),
            );
        }
    }
}

/// vLLM's current (map) layout, written with rmpv.
fn encode(batch: &EventBatch) -> Vec<u8> {
    use rmpv::Value;
    let s = |x: &str| Value::from(x);
    let events: Vec<Value> = batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::Stored { block_hashes, parent, token_ids, .. } => Value::Map(vec![
                (s("type"), s("BlockStored")),
                (
                    s("block_hashes"),
                    Value::Array(block_hashes.iter().map(|h| Value::from(*h)).collect()),
                ),
                (s("parent_block_hash"), parent.map_or(Value::Nil, Value::from)),
                (s("token_ids"), Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect())),
                (s("block_size"), Value::from(BS as u64)),
                (s("lora_id"), Value::Nil),
                (s("medium"), s("GPU")),
                (s("lora_name"), Value::Nil),
            ]),
            KvEvent::Removed { block_hashes, .. } => Value::Map(vec![
                (s("type"), s("BlockRemoved")),
                (
                    s("block_hashes"),
                    Value::Array(block_hashes.iter().map(|h| Value::from(*h)).collect()),
                ),
                (s("medium"), s("GPU")),
            ]),
            _ => Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
        })
        .collect();
    let mut out = Vec::new();
    let _ = rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::from(1.0), Value::Array(events), Value::from(0)]),
    );
    out
}

struct MatchScenario {
    name: String,
    index: KvIndex,
    queries: Vec<Vec<kvmesh_core::hashing::SequenceHash>>,
}

/// `workers` workers with ~1M resident blocks between them; each query of `len` blocks shares an
/// 8-block system prompt with a quarter of the fleet, is held whole by one worker and half by two.
fn realistic(workers: u32, len: usize) -> MatchScenario {
    let mut rng = StdRng::seed_from_u64(u64::from(workers) * 7 + len as u64);
    let mut index = KvIndex::new(100_000_000, 10_000_000);
    background(&mut index, &mut rng, workers, (1_000_000 / workers as usize).max(32));
    let system = random_tokens(&mut rng, 8 * BS);
    let sys_hashes: Vec<u64> = (0..8).map(|b| (1 << 62) | b).collect();
    for w in (0..workers).step_by(4) {
        index.store(w, None, &sys_hashes, &system, BS, XXH3_SEED);
    }
    let mut queries = Vec::new();
    for q in 0..64u64 {
        let mut tokens = system.clone();
        tokens.extend(random_tokens(&mut rng, (len - 8) * BS));
        let holders =
            [(q as u32 * 4) % workers, (q as u32 * 4 + 1) % workers, (q as u32 * 4 + 2) % workers];
        for (i, &w) in holders.iter().enumerate() {
            let n = if i == 0 { len } else { len / 2 };
            let hashes: Vec<u64> =
                (0..n as u64).map(|b| (1 << 61) | (q << 32) | (u64::from(w) << 16) | b).collect();
            index.store(w, None, &hashes, &tokens[..n * BS], BS, XXH3_SEED);
        }
        queries.push(sequence_hashes(&tokens, BS, XXH3_SEED));
    }
    MatchScenario { name: format!("{len}_blocks/{workers}_workers"), index, queries }
}

/// Worst case: every worker holds every block of every query (one shared 512-block document).
fn everyone_holds_everything(workers: u32, len: usize) -> MatchScenario {
    let mut rng = StdRng::seed_from_u64(99);
    let mut index = KvIndex::new(100_000_000, 10_000_000);
    let tokens = random_tokens(&mut rng, len * BS);
    for w in 0..workers {
        index.add_worker(w);
        let hashes: Vec<u64> = (0..len as u64).map(|b| (u64::from(w) << 32) | b).collect();
        index.store(w, None, &hashes, &tokens, BS, XXH3_SEED);
    }
    MatchScenario {
        name: format!("{len}_blocks/{workers}_workers_all_hold_all"),
        index,
        queries: vec![sequence_hashes(&tokens, BS, XXH3_SEED)],
    }
}

/// p50, p99 and the most workers matched over `samples` queries. With `flush`, the caches (and TLB)
/// are flushed before every query by an untimed read of `flush` (bigger than the L3): repeated
/// queries otherwise find their blocks in cache, while in production an index of ~1M blocks is in
/// DRAM and other work runs between queries. The query's own hashes are then read back, as the
/// caller has just computed them.
fn percentiles(
    s: &MatchScenario,
    samples: usize,
    flush: Option<&[u64]>,
) -> (Duration, Duration, usize) {
    let mut times = Vec::with_capacity(samples);
    let mut matched = 0;
    for i in 0..samples {
        let q = &s.queries[i % s.queries.len()];
        if let Some(flush) = flush {
            black_box(flush.iter().step_by(8).fold(0u64, |a, x| a ^ x));
            black_box(q.iter().fold(0u64, |a, c| a ^ c.0));
        }
        let t = Instant::now();
        let m = black_box(s.index.find_matches(black_box(q)));
        times.push(t.elapsed());
        matched = matched.max(m.len());
    }
    times.sort_unstable();
    (times[samples / 2], times[samples * 99 / 100], matched)
}

/// Makes every worker dirty (a block removed while its child stays), so queries walk block by block.
fn make_dirty(index: &mut KvIndex, workers: u32) {
    for w in 0..workers {
        index.remove(w, &[(u64::from(w) << 40) | 16]);
    }
}

fn bench_find_matches(c: &mut Criterion) {
    let mut g = c.benchmark_group("find_matches");
    let mut figures = Vec::new();
    let flush: Vec<u64> = (0..(32u64 << 20) / 8).collect();
    for (workers, len) in [(16, 64), (16, 512), (1000, 64), (1000, 512)] {
        let mut s = realistic(workers, len);
        g.bench_function(&s.name, |b| {
            let mut i = 0;
            b.iter(|| {
                i += 1;
                black_box(s.index.find_matches(&s.queries[i % s.queries.len()]))
            })
        });
        figures.push((s.name.clone(), percentiles(&s, 20_000, None)));
        figures.push((format!("{}/cold", s.name), percentiles(&s, 1_000, Some(&flush))));
        if len == 512 {
            make_dirty(&mut s.index, workers);
            figures.push((format!("{}/all_dirty", s.name), percentiles(&s, 2_000, None)));
            figures
                .push((format!("{}/all_dirty_cold", s.name), percentiles(&s, 500, Some(&flush))));
        }
    }
    let worst = everyone_holds_everything(1000, 512);
    g.bench_function(&worst.name, |b| {
        b.iter(|| black_box(worst.index.find_matches(&worst.queries[0])))
    });
    figures.push((worst.name.clone(), percentiles(&worst, 5_000, None)));
    g.finish();
    for (name, (p50, p99, workers)) in figures {
        println!(
            "FIGURE find_matches {name}: p50 {:.2} µs, p99 {:.2} µs ({workers} workers matched)",
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6
        );
        emit(
            serde_json::json!({"bench": "index", "figure": "find_matches", "name": name, "p50_us": p50.as_secs_f64() * 1e6, "p99_us": p99.as_secs_f64() * 1e6, "workers_matched": workers}),
        );
    }
}

fn memory_figures() {
    // The last case gives every worker exactly 65,536 blocks (a power of two, as engines' block
    // counts often are): where the tables' growth policy shows most (`index/table.rs`).
    for (label, workers, holders, total) in [
        ("1 holder per block", 16u32, 1u32, 1_000_000usize),
        ("2 holders per block", 16, 2, 1_000_000),
        ("8 holders per block (bitmap)", 1000, 8, 1_000_000),
        ("1 holder per block, 65,536 per worker", 16, 1, 16 << 16),
    ] {
        let mut rng = StdRng::seed_from_u64(5);
        let before = LIVE.load(Ordering::Relaxed);
        let mut index = KvIndex::new(100_000_000, 10_000_000);
        for w in 0..workers {
            index.add_worker(w);
        }
        let chains = total / (32 * holders as usize);
        for c in 0..chains {
            let tokens = random_tokens(&mut rng, 32 * BS);
            for h in 0..holders {
                let w = (c as u32 * 7 + h * 13) % workers;
                let hashes: Vec<u64> =
                    (0..32).map(|b| ((c as u64) << 16) | (u64::from(h) << 8) | b).collect();
                index.store(w, None, &hashes, &tokens, BS, XXH3_SEED);
            }
        }
        let used = LIVE.load(Ordering::Relaxed) - before;
        println!(
            "FIGURE memory {label}: {} entries, {} blocks, {:.1} bytes per (block, worker) entry (allocator), {:.1} by estimate",
            index.entries(),
            index.blocks(),
            used as f64 / index.entries() as f64,
            index.approx_bytes() as f64 / index.entries() as f64
        );
        emit(serde_json::json!({
            "bench": "index", "figure": "memory", "name": label, "entries": index.entries(), "blocks": index.blocks(),
            "bytes_per_entry": used as f64 / index.entries() as f64,
            "estimated_bytes_per_entry": index.approx_bytes() as f64 / index.entries() as f64
        }));
        drop(index);
    }
}

/// Offload tiers (issue 46): a route's match (`find_matches`, then `find_lower_matches` as
/// `route::plan` calls them) with no lower-tier entry (the lower-tier call returns at once), and
/// with each query's second half evicted from its holder's GPU to its CPU tier (the run is walked
/// block by block). `cargo bench -p kvmesh-indexer --bench index -- find_lower_matches`; under
/// `valgrind --tool=callgrind` for instruction counts when the machine is shared.
fn bench_tiers(c: &mut Criterion) {
    let mut g = c.benchmark_group("find_lower_matches");
    let mut rng = StdRng::seed_from_u64(46);
    let (workers, len) = (16u32, 512usize);
    let mut index = KvIndex::new(100_000_000, 10_000_000);
    background(&mut index, &mut rng, workers, 20_000);
    let mut queries = Vec::new();
    for q in 0..64u64 {
        let tokens = random_tokens(&mut rng, len * BS);
        let w = q as u32 % workers;
        let hashes: Vec<u64> =
            (0..len as u64).map(|b| (1 << 61) | (q << 32) | (u64::from(w) << 16) | b).collect();
        index.store(w, None, &hashes, &tokens, BS, XXH3_SEED);
        queries.push((sequence_hashes(&tokens, BS, XXH3_SEED), w, hashes, tokens));
    }
    let route = |index: &KvIndex, i: usize| {
        let q = &queries[i % queries.len()].0;
        let gpu = index.find_matches(q);
        (gpu.len(), index.find_lower_matches(q, &gpu).len())
    };
    assert_eq!(route(&index, 0), (1, 0));
    g.bench_function("512_blocks/16_workers/no_tier_entries", |b| {
        let mut i = 0;
        b.iter(|| {
            i += 1;
            black_box(route(&index, i))
        })
    });
    let half = len / 2;
    for (_, w, hashes, tokens) in &queries {
        let parent = Some(hashes[half - 1]);
        index.store_in(Tier::Cpu, *w, parent, &hashes[half..], &tokens[half * BS..], BS, XXH3_SEED);
        index.remove(*w, &hashes[half..]);
    }
    assert_eq!(route(&index, 0), (1, 1));
    g.bench_function("512_blocks/16_workers/256_gpu_256_cpu", |b| {
        let mut i = 0;
        b.iter(|| {
            i += 1;
            black_box(route(&index, i))
        })
    });
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(SAMPLE_SIZE)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args()
}

criterion_group! { name = benches; config = config(); targets = bench_apply, bench_find_matches, bench_tiers }

fn main() {
    benches();
    memory_figures();
    Criterion::default().configure_from_args().final_summary();
}
