//! The `router_kv_*` metrics, defined once for both exporters: the filter (Envoy stats) and the
//! indexer (Prometheus) count the same blocks the same way and record the hit rate in the same unit.
//!
//! - ISL blocks are the prompt's **full** blocks, `⌊tokens / block_size⌋` ([`isl_blocks`]): what the
//!   route response's `isl_blocks` carries and what an engine can store as cached blocks (a partial
//!   last block is never hashed or published). The last-block rule (`⌊(tokens − 1) / block_size⌋`,
//!   the most an engine can *hit*) caps the predicted overlap, not this denominator.
//! - `router_kv_hit_rate` is per-mille ([`HIT_RATE_SCALE`]): Envoy stats are integers and its
//!   custom histograms have no unit, so the indexer records the same per-mille values into the same
//!   buckets ([`HIT_RATE_BUCKETS`], also set in the Envoy bootstrap's `histogram_bucket_settings`).
//!   The request-weighted mean hit rate is `_sum / _count / 1000` on both sides.

/// Counter: predicted leading cached blocks on the chosen worker, summed over routed requests.
pub const OVERLAP_BLOCKS_TOTAL: &str = "router_kv_overlap_blocks_total";
/// Counter: [`isl_blocks`] of routed requests; overlap / isl = the block-weighted hit rate.
pub const ISL_BLOCKS_TOTAL: &str = "router_kv_isl_blocks_total";
/// Histogram: per-request overlap / isl in per-mille (its mean is the request-weighted hit rate).
pub const HIT_RATE: &str = "router_kv_hit_rate";

/// [`HIT_RATE`] records `overlap × HIT_RATE_SCALE / isl`.
pub const HIT_RATE_SCALE: u64 = 1000;

/// [`HIT_RATE`]'s bucket bounds (per-mille). Bounds must be > 0 in Envoy: 0.5 is the "nothing
/// cached" bucket (samples are integers).
pub const HIT_RATE_BUCKETS: [f64; 13] =
    [0.5, 100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0, 800.0, 900.0, 950.0, 990.0, 1000.0];

/// The prompt's full blocks: the `isl_blocks` of a route decision and of [`ISL_BLOCKS_TOTAL`].
pub fn isl_blocks(tokens: usize, block_size: u32) -> u32 {
    u32::try_from(tokens / block_size.max(1) as usize).unwrap_or(u32::MAX)
}

/// `overlap / isl` in per-mille, clamped to 0..=1000; None when the prompt has no full block (such
/// a request adds nothing to either counter and records no [`HIT_RATE`] sample).
pub fn hit_rate_permille(overlap_blocks: u32, isl_blocks: u32) -> Option<u64> {
    if isl_blocks == 0 {
        return None;
    }
    let overlap = u64::from(overlap_blocks.min(isl_blocks));
    Some(overlap * HIT_RATE_SCALE / u64::from(isl_blocks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isl_blocks_counts_full_blocks() {
        for (tokens, bs, want) in [
            (0, 16, 0),
            (15, 16, 0),
            (16, 16, 1),
            (17, 16, 1),
            (640, 16, 40),
            (655, 16, 40),
            (5, 0, 5),
        ] {
            assert_eq!(isl_blocks(tokens, bs), want, "tokens {tokens} block {bs}");
        }
    }

    #[test]
    fn hit_rate_is_per_mille_and_clamped() {
        for (overlap, isl, want) in [
            (0, 0, None),
            (0, 4, Some(0)),
            (3, 4, Some(750)),
            (4, 4, Some(1000)),
            (9, 4, Some(1000)),
            (1, 3, Some(333)),
        ] {
            assert_eq!(hit_rate_permille(overlap, isl), want, "{overlap}/{isl}");
        }
    }

    /// The Envoy configs must bucket the histogram where the indexer does.
    #[test]
    fn envoy_configs_use_the_same_buckets() {
        for (name, text) in [
            ("envoy/bootstrap.yaml.j2", include_str!("../../envoy/bootstrap.yaml.j2")),
            (
                "envoy/k8s/envoy-configmap.yaml",
                include_str!("../../envoy/k8s/envoy-configmap.yaml"),
            ),
        ] {
            let after = text
                .split("prefix: wasmcustom.router_kv_hit_rate")
                .nth(1)
                .unwrap_or_else(|| panic!("{name}: no hit-rate buckets"));
            let list = after
                .split_once("buckets: [")
                .and_then(|(_, rest)| rest.split_once(']'))
                .map(|(l, _)| l)
                .unwrap_or_else(|| panic!("{name}: no buckets list"));
            let got: Vec<f64> = list.split(',').map(|b| b.trim().parse().unwrap()).collect();
            assert_eq!(got, HIT_RATE_BUCKETS, "{name}");
        }
    }
}
