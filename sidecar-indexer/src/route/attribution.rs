//! Attribution of a routed request's prefix-cache hit, in tokens (issue 46, point 4): when the hit
//! rate is low, is it the workload, the routing or the prediction?
//!
//! At decision time the plan step keeps, with the request's booking, what the router saw
//! ([`Predicted`], built by [`predicted`] from the decision's worker views):
//! - **available**: the most cached tokens any eligible worker (healthy, decode-capable, of the
//!   request's model, allowed by the front door) was predicted to hold;
//! - **captured**: the cached tokens predicted on the chosen worker.
//!
//! "Predicted to hold" is what the decision ranks by: the index's overlap or the speculative one
//! (recent decisions, an answer that just finished there: `crate::speculative`), whichever is
//! longer, capped by the engine's last-block rule. When `/v1/done` reports the engine's `usage`
//! ([`kvmesh_core::usage`]), [`attribute`] adds **delivered** — the engine's `cached_tokens` —
//! and splits what the prompt did not get from cache by cause, against the engine's own
//! `prompt_tokens` (P), available (A), captured (C) and delivered (D), each clamped so that
//! P ≥ A ≥ C:
//!
//! | cause | tokens | meaning |
//! |---|---|---|
//! | `workload` | P − A | no eligible worker held it: a cold or unique prompt |
//! | `routing` | A − C | a worker held more, the router chose another (load, balance, a pin) |
//! | `not_delivered` | max(C − D, 0) | predicted on the chosen worker, not served from its cache (evicted before the request ran, or a misprediction) |
//!
//! and **unpredicted** = max(D − C, 0), served from cache beyond the prediction (the index lagged
//! the engine). Then `P − D = workload + routing + not_delivered − unpredicted` exactly, per
//! request and so for the counters' sums. Pure: no locks, no clock.
//!
//! Not attributed (counted by result, never silently): responses that were not a whole success,
//! served by another host than booked (a retry: the prediction was for the booked one), with a
//! KV transfer (`disagg`, `migrate`: the engine's `cached_tokens` then counts the pulled KV), or
//! whose usage (or its `cached_tokens`) did not reach the indexer.

use kvmesh_core::api::EngineUsage;
use kvmesh_core::hashing::SequenceHash;

use crate::decide::WorkerView;

/// What the decision predicted for a request's cache, kept with its booking until `/v1/done`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Predicted {
    /// The base model's `model` label (`crate::metrics::model_label`).
    pub model: String,
    /// Tokens per block of the model.
    pub block_size: u32,
    /// Most predicted cached tokens on any eligible worker.
    pub available_tokens: u64,
    /// Predicted cached tokens on the chosen worker.
    pub captured_tokens: u64,
    /// The engine gets the prompt's KV over NIXL (`kv_transfer_params` in the decision).
    pub kv_transfer: bool,
    /// The prompt's last block the router hashed and how many blocks lead to it (its index + 1):
    /// what the answer's blocks extend (`crate::speculative`, the answer credit).
    pub anchor: Option<(u32, SequenceHash)>,
}

/// The decision's prediction from its worker views (`views[chosen]` chosen), for a prompt whose
/// engine can serve at most `cap` blocks from cache. Filled in by the settle step (`model`,
/// `kv_transfer`, `anchor`).
pub fn predicted(views: &[WorkerView<'_>], chosen: usize, cap: u32, block_size: u32) -> Predicted {
    let cached = |w: &WorkerView<'_>| u64::from(w.cached_blocks().min(cap));
    let captured = views.get(chosen).map_or(0, cached);
    let available = views
        .iter()
        .filter(|w| w.healthy && w.role.decodes())
        .map(cached)
        .max()
        .unwrap_or(0)
        .max(captured);
    let bs = u64::from(block_size.max(1));
    Predicted {
        model: String::new(),
        block_size: block_size.max(1),
        available_tokens: available * bs,
        captured_tokens: captured * bs,
        kv_transfer: false,
        anchor: None,
    }
}

/// One request's attribution, in tokens (module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Attributed {
    pub prompt: u64,
    pub available: u64,
    pub captured: u64,
    pub delivered: u64,
    pub lost_workload: u64,
    pub lost_routing: u64,
    pub lost_not_delivered: u64,
    pub unpredicted: u64,
}

/// Why a done report was or was not attributed (`kvmesh_kv_attribution_requests_total{result}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Attributed,
    /// The response was not a whole success (error, aborted).
    NotServed,
    /// Another host than the booked one served (a retry).
    ServedElsewhere,
    /// The engine got the prompt's KV over NIXL.
    KvTransfer,
    /// The done report carried no usage (a stream without `include_usage`, a reader that does
    /// not scan, a usage beyond the scanned tail).
    NoUsage,
    /// The usage had no `prompt_tokens_details.cached_tokens`.
    NoCachedTokens,
}

impl Verdict {
    pub const ALL: [Self; 6] = [
        Self::Attributed,
        Self::NotServed,
        Self::ServedElsewhere,
        Self::KvTransfer,
        Self::NoUsage,
        Self::NoCachedTokens,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Attributed => "attributed",
            Self::NotServed => "not_served",
            Self::ServedElsewhere => "served_elsewhere",
            Self::KvTransfer => "kv_transfer",
            Self::NoUsage => "no_usage",
            Self::NoCachedTokens => "no_cached_tokens",
        }
    }
}

/// The loss causes (`kvmesh_kv_lost_tokens_total{cause}`), in the table's order.
pub const CAUSES: [&str; 3] = ["workload", "routing", "not_delivered"];

/// Attributes a served request: `p` its prediction, `usage` what the engine reported.
pub fn attribute(p: &Predicted, usage: Option<&EngineUsage>) -> Result<Attributed, Verdict> {
    if p.kv_transfer {
        return Err(Verdict::KvTransfer);
    }
    let usage = usage.ok_or(Verdict::NoUsage)?;
    let cached = usage.cached_tokens.ok_or(Verdict::NoCachedTokens)?;
    let prompt = usage.prompt_tokens;
    let available = p.available_tokens.min(prompt);
    let captured = p.captured_tokens.min(available);
    let delivered = cached.min(prompt);
    Ok(Attributed {
        prompt,
        available,
        captured,
        delivered,
        lost_workload: prompt - available,
        lost_routing: available - captured,
        lost_not_delivered: captured.saturating_sub(delivered),
        unpredicted: delivered.saturating_sub(captured),
    })
}

impl Attributed {
    /// Tokens lost per cause, in [`CAUSES`] order.
    pub fn lost(&self) -> [u64; 3] {
        [self.lost_workload, self.lost_routing, self.lost_not_delivered]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_core::api::Role;

    use crate::decide::tests::view;

    fn p(available: u64, captured: u64) -> Predicted {
        Predicted {
            model: "m".into(),
            block_size: 16,
            available_tokens: available,
            captured_tokens: captured,
            kv_transfer: false,
            anchor: None,
        }
    }

    fn usage(prompt: u64, cached: Option<u64>) -> EngineUsage {
        EngineUsage { prompt_tokens: prompt, completion_tokens: 5, cached_tokens: cached }
    }

    #[test]
    fn the_split_sums_to_what_the_prompt_did_not_get_from_cache() {
        // (P, A, C, D) → (workload, routing, not_delivered, unpredicted)
        let cases = [
            ((1000, 960, 960, 960), (40, 0, 0, 0)),
            ((1000, 960, 640, 640), (40, 320, 0, 0)),
            ((1000, 960, 640, 320), (40, 320, 320, 0)),
            // The real vLLM case of issue 46: predicted 896, the engine cached 960.
            ((1000, 896, 896, 960), (104, 0, 0, 64)),
            ((1000, 0, 0, 0), (1000, 0, 0, 0)),
            // Clamped: a prediction beyond the engine's prompt (an estimated tail).
            ((500, 800, 700, 480), (0, 0, 20, 0)),
            // The engine reported more cached than its prompt: clamped to the prompt.
            ((100, 96, 96, 200), (4, 0, 0, 4)),
        ];
        for ((pr, a, c, d), (w, r, nd, un)) in cases {
            let x = attribute(&p(a, c), Some(&usage(pr, Some(d)))).unwrap();
            assert_eq!(
                (x.lost_workload, x.lost_routing, x.lost_not_delivered, x.unpredicted),
                (w, r, nd, un),
                "{pr} {a} {c} {d}"
            );
            assert!(x.prompt >= x.available && x.available >= x.captured, "{x:?}");
            assert_eq!(
                x.prompt - x.delivered,
                x.lost().iter().sum::<u64>() - x.unpredicted,
                "the split sums: {x:?}"
            );
        }
    }

    #[test]
    fn what_cannot_be_attributed_says_why() {
        let transfer = Predicted { kv_transfer: true, ..p(64, 64) };
        assert_eq!(attribute(&transfer, Some(&usage(100, Some(99)))), Err(Verdict::KvTransfer));
        assert_eq!(attribute(&p(64, 64), None), Err(Verdict::NoUsage));
        assert_eq!(attribute(&p(64, 64), Some(&usage(100, None))), Err(Verdict::NoCachedTokens));
        let labels: std::collections::BTreeSet<_> =
            Verdict::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels.len(), Verdict::ALL.len());
    }

    #[test]
    fn available_is_the_best_eligible_worker_and_never_below_captured() {
        let mut views = vec![view("a", 2, 0), view("b", 5, 0), view("c", 9, 0), view("d", 4, 0)];
        views[2].healthy = false; // holds the most, not eligible
        views[3].role = Role::Prefill; // not a decode candidate
        views[0].speculative_blocks = 3; // a recent decision's credit counts as predicted
        let x = predicted(&views, 0, 100, 16);
        assert_eq!((x.available_tokens, x.captured_tokens), (5 * 16, 3 * 16));
        // The engine's last-block rule caps both.
        let x = predicted(&views, 1, 4, 16);
        assert_eq!((x.available_tokens, x.captured_tokens), (4 * 16, 4 * 16));
        // An override onto an unhealthy worker: available still covers what was captured.
        let x = predicted(&views, 2, 100, 16);
        assert_eq!((x.available_tokens, x.captured_tokens), (9 * 16, 9 * 16));
    }
}
