//! Lower KV tiers in the decision: a prompt's blocks in CPU memory or on disk are credited at
//! their load cost (`routing.cpu_load_tokens_per_s`, `disk_load_tokens_per_s`: 100k and 25k
//! tokens/s by default), between a GPU hit (free) and a recompute (the test workers prefill 10k
//! tokens/s).

use super::tests::{view, TPS};
use super::*;
use crate::index::TierBlocks;
use proptest::prelude::*;
use rand::{rngs::StdRng, SeedableRng};

/// 640 tokens = 40 full blocks of 16 (at most 39 cached).
fn input(tokens: usize) -> RouteInput<'static> {
    RouteInput {
        isl_tokens: tokens,
        block_size: 16,
        session: None,
        override_worker: None,
        override_mode: None,
        continuation: false,
        kv_home: None,
        opens_conversation: false,
        adapter: None,
    }
}

fn tiered(id: &'static str, overlap: u32, cpu: u32, disk: u32) -> WorkerView<'static> {
    WorkerView { tier_blocks: TierBlocks { cpu, disk }, ..view(id, overlap, 0) }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

#[test]
fn predicted_ttft_splits_gpu_lower_tier_and_uncached_tokens() {
    let on = RoutingConfig::default();
    let off = RoutingConfig { kv_tiers: false, ..RoutingConfig::default() };
    // (overlap, speculative, cpu, disk, config, want ms, want uncached tokens, want loaded)
    let cases = [
        (0, 0, 0, 0, &on, 64.0, 640, (0, 0)),        // cold
        (39, 0, 0, 0, &on, 1.6, 16, (0, 0)),         // on the GPU
        (0, 0, 39, 0, &on, 6.24 + 1.6, 16, (39, 0)), // 624 tokens loaded at 100k/s
        (20, 0, 19, 0, &on, 3.04 + 1.6, 16, (19, 0)),
        (20, 0, 0, 19, &on, 12.16 + 1.6, 16, (0, 19)), // from disk at 25k/s
        (20, 0, 10, 9, &on, 1.6 + 5.76 + 1.6, 16, (10, 9)),
        (20, 0, 30, 0, &on, 3.04 + 1.6, 16, (19, 0)), // capped by the last-block rule
        (20, 0, 5, 0, &on, 0.8 + (640.0 - 400.0) / 10.0, 240, (5, 0)), // the run ends at 25
        (0, 10, 39, 0, &on, 4.64 + 1.6, 16, (29, 0)), // speculative blocks cover the first 10
        (0, 39, 39, 0, &on, 1.6, 16, (0, 0)),         // ... or all of it
        (0, 0, 39, 0, &off, 64.0, 640, (0, 0)),       // kv_tiers = false: GPU residency alone
    ];
    for (overlap, spec, cpu, disk, cfg, want_ms, want_uncached, (want_cpu, want_disk)) in cases {
        let mut w = tiered("w0", overlap, cpu, disk);
        w.speculative_blocks = spec;
        let plan = decide(&input(640), &[w], cfg, &mut StdRng::seed_from_u64(1)).unwrap();
        let case =
            format!("overlap {overlap} spec {spec} cpu {cpu} disk {disk} tiers {}", cfg.kv_tiers);
        assert!(close(plan.predicted_ttft_ms, want_ms), "{case}: {} ms", plan.predicted_ttft_ms);
        assert_eq!(plan.uncached_tokens, want_uncached, "{case}");
        assert_eq!(plan.tier_blocks, TierBlocks { cpu: want_cpu, disk: want_disk }, "{case}");
        assert_eq!(plan.overlap_blocks, overlap.min(39), "{case}: overlap is GPU residency");
    }
}

#[test]
fn a_prefix_in_cpu_memory_beats_a_recompute_and_loses_to_the_gpu() {
    let cfg = RoutingConfig::default();
    let mut rng = StdRng::seed_from_u64(7);
    let cold = view("w1", 0, 0);
    let plan =
        decide(&input(640), &[cold.clone(), tiered("w2", 0, 39, 0)], &cfg, &mut rng).unwrap();
    assert_eq!(plan.worker, "w2", "{}", plan.reason);
    assert!(plan.reason.contains("(+39 from cpu)"), "{}", plan.reason);
    let plan = decide(
        &input(640),
        &[cold, tiered("w2", 0, 39, 0), tiered("w3", 39, 0, 0)],
        &cfg,
        &mut rng,
    )
    .unwrap();
    assert_eq!(plan.worker, "w3", "{}", plan.reason);
    // The uncached tokens booked as prefill on the chosen worker exclude what it loads.
    let plan = decide(&input(640), &[tiered("w2", 10, 29, 0)], &cfg, &mut rng).unwrap();
    assert_eq!((plan.uncached_tokens, plan.tier_blocks.cpu), (16, 29));
}

proptest! {
    /// With a tier that loads faster than the worker prefills, holding more of the prompt in a
    /// lower tier never makes a worker's predicted TTFT longer, and never shorter than holding the
    /// same blocks on the GPU.
    #[test]
    fn lower_tier_blocks_price_between_gpu_and_recompute(
        tokens in 17usize..4000, overlap in 0u32..300, cpu in 0u32..300, extra in 1u32..50,
        queued in 0u64..20_000, load_x in 1.0f64..40.0,
    ) {
        let cfg = RoutingConfig {
            cpu_load_tokens_per_s: TPS * load_x,
            disk_load_tokens_per_s: TPS * load_x,
            ..RoutingConfig::default()
        };
        let ttft = |w: WorkerView<'static>| {
            decide(&input(tokens), &[w], &cfg, &mut StdRng::seed_from_u64(1)).unwrap().predicted_ttft_ms
        };
        let mut base = view("w0", overlap, queued);
        base.tier_blocks = TierBlocks { cpu, disk: 0 };
        let mut more = base.clone();
        more.tier_blocks.cpu += extra;
        let on_gpu = WorkerView { tier_blocks: TierBlocks::default(), overlap_blocks: overlap + cpu + extra, ..base.clone() };
        let (a, b, g) = (ttft(base), ttft(more), ttft(on_gpu));
        prop_assert!(b <= a + 1e-9, "{a} -> {b}");
        prop_assert!(g <= b + 1e-9, "gpu {g} > tiered {b}");
    }
}
