//! On a skewed mix (many short unique prompts, a few long ones sharing a prefix) the router's
//! block-weighted hit rate, read from Envoy's own metrics, matches the engines' prefix-cache hit
//! rate within 5%, while the request-weighted mean is a visibly different number.

use kvmesh_e2e::client::{filler, post_json};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

/// The filter records per-request overlap/isl in `router_kv_hit_rate` scaled by this factor
/// (Envoy histograms hold integers); see filter/README.md.
const HIT_RATE_SCALE: f64 = 1000.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_weighted_router_rate_matches_the_engines() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(4);
    spec.filter_config = json!({"debug_headers": true});
    let stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/completions");
    let c = stack.client().clone();
    let shared = filler(42, 2500);
    for i in 0..48u64 {
        let prompt =
            if i % 4 == 0 { format!("{shared} {}", filler(i, 40)) } else { filler(10_000 + i, 60) };
        let r = post_json(
            &c,
            &url,
            &json!({"model": "deepseek-v4", "prompt": prompt, "max_tokens": 2}),
            &[],
        )
        .await?;
        assert_eq!(r.status, 200, "{}", r.text);
    }

    // Envoy merges wasm histograms on its stats flush: wait until all 48 samples are in.
    let envoy = poll::until("router_kv_hit_rate histogram flushed", || async {
        let m = stack.envoy_metrics().await.ok()?;
        (m.sum("router_kv_hit_rate_count", &[]) >= 48.0).then_some(m)
    })
    .await?;
    let overlap = envoy.sum("router_kv_overlap_blocks_total", &[]);
    let isl = envoy.sum("router_kv_isl_blocks_total", &[]);
    let router_block_weighted = overlap / isl;
    let request_weighted = envoy.sum("router_kv_hit_rate_sum", &[])
        / envoy.sum("router_kv_hit_rate_count", &[])
        / HIT_RATE_SCALE;
    let hits = stack.engine_sum("vllm:prefix_cache_hits_total").await?;
    let queries = stack.engine_sum("vllm:prefix_cache_queries_total").await?;
    let engine = hits / queries;
    eprintln!("router block-weighted {router_block_weighted:.3}, request-weighted {request_weighted:.3}, engine {engine:.3}");

    assert!(isl > 0.0 && queries > 0.0);
    assert!(
        (router_block_weighted - engine).abs() <= 0.05 * engine,
        "router {router_block_weighted:.3} vs engine {engine:.3}"
    );
    assert!(
        (request_weighted - router_block_weighted).abs() > 0.2,
        "on this skewed mix the request-weighted mean ({request_weighted:.3}) should differ clearly from the block-weighted rate ({router_block_weighted:.3})"
    );
    Ok(())
}
