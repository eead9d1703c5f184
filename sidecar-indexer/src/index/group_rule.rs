//! How far a hybrid model's prompt is served from cache: the prefix every KV cache group of the
//! model can serve, each group by the rule of its kind — vLLM's `HybridKVCacheCoordinator`
//! (`vllm/v1/core/kv_cache_coordinator.py`) over its single-type managers
//! (`vllm/v1/core/single_type_kv_cache_manager.py`). Pure: a group's residency is a predicate over
//! block positions of the prompt, so every rule is unit-tested on plain sets.
//!
//! * **Full attention** (`full_attention`, `mla_attention`, `sink_full_attention`): the leading
//!   run, blocks `0..e` all held (`FullAttentionManager`).
//! * **Sliding window** of `W` tokens (`sliding_window`, `sliding_window_mla`): the first token
//!   computed attends to the `W − 1` tokens before it, so a hit of `e` blocks needs the
//!   `c = ⌈(W − 1) / block_size⌉` blocks before `e`, `[e − c, e)`, and nothing earlier (vLLM frees
//!   those). vLLM scans from the cap down and takes the first `e` whose `c` blocks are held; with no
//!   such run, the run held from block 0 (shorter than `c`) still counts (`SlidingWindowManager`).
//! * **Anything else** — Mamba, chunked local attention, a kind newer than this code, a group whose
//!   events name no kind: its leading run, as for full attention. Every kind vLLM implements can
//!   serve a prefix whose every block it holds (Mamba needs only the last one, chunked local
//!   attention only those of the last chunk), so this never claims more than the engine serves for
//!   them; it can claim less (a Mamba group holds only its checkpoint blocks). A kind for which even
//!   that is not true would be over-predicted: such events are counted
//!   (`kvmesh_kv_unknown_group_kind_events_total`).
//!
//! The groups are applied in turn, each capped by the answer so far, until none lowers it: vLLM's
//! fixed point (one pass for one full-attention and one window group, its "simple hybrid").
//! Not modelled: EAGLE's dropped last block, and groups of different block sizes (vLLM then aligns
//! the hit to their least common multiple; the indexer refuses stores of another block size).

/// A KV cache group's kind, as its events name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    /// Full attention: serves its leading run.
    Full,
    /// Sliding-window attention over `tokens` tokens.
    Window { tokens: u32 },
    /// A kind this code does not model (served as its leading run; see the module docs).
    Unknown,
}

/// `kv_cache_spec_kind` values of full-attention groups (vLLM's `KVCacheSpecKind`).
const FULL_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];
/// `kv_cache_spec_kind` values of sliding-window groups.
const WINDOW_KINDS: [&str; 2] = ["sliding_window", "sliding_window_mla"];

impl GroupKind {
    /// The kind an event's `kv_cache_spec_kind` and `kv_cache_spec_sliding_window` name. A window
    /// kind without a window (or a zero one) is unknown: its rule cannot be applied.
    pub fn of(kind: Option<&str>, sliding_window: Option<u32>) -> Self {
        match kind {
            Some(k) if FULL_KINDS.contains(&k) => Self::Full,
            Some(k) if WINDOW_KINDS.contains(&k) => match sliding_window {
                Some(tokens) if tokens > 0 => Self::Window { tokens },
                _ => Self::Unknown,
            },
            _ => Self::Unknown,
        }
    }

    /// Blocks `[e − c, e)` a hit of `e` blocks needs held (`None`: the whole leading run).
    pub fn window_blocks(self, block_size: u32) -> Option<usize> {
        match self {
            Self::Window { tokens } => {
                // vLLM: cdiv(sliding_window - 1, block_size); a window of one token needs the
                // block before the hit all the same (its scan stops at the first held block).
                Some(
                    (tokens.saturating_sub(1) as usize).div_ceil(block_size.max(1) as usize).max(1),
                )
            }
            Self::Full | Self::Unknown => None,
        }
    }
}

/// The leading run: the largest `e ≤ cap` with blocks `0..e` all held.
pub fn leading_hit(cap: usize, held: impl Fn(usize) -> bool) -> usize {
    (0..cap).find(|&i| !held(i)).unwrap_or(cap)
}

/// vLLM's sliding-window hit: scanning down from `cap`, the first `e` whose `need` blocks before
/// it, `[e − need, e)`, are held; with none, the run held from block 0 (shorter than `need`).
pub fn window_hit(cap: usize, need: usize, held: impl Fn(usize) -> bool) -> usize {
    let need = need.max(1);
    let mut run = 0;
    for i in (0..cap).rev() {
        if held(i) {
            run += 1;
            if run >= need {
                return i + need;
            }
        } else {
            run = 0;
        }
    }
    run
}

/// One group's hit, at most `cap` blocks: its kind's rule over its residency `held`.
pub fn group_hit(
    kind: GroupKind,
    block_size: u32,
    cap: usize,
    held: impl Fn(usize) -> bool,
) -> usize {
    match kind.window_blocks(block_size) {
        Some(need) => window_hit(cap, need, held),
        None => leading_hit(cap, held),
    }
}

/// The prefix every group can serve, at most `cap` blocks (`cap`: the main group's leading match,
/// already cut by the last-token rule): each group's hit capped by the answer so far, until none
/// lowers it. `groups`: each group's (kind, block size); `held(g, i)`: whether `groups[g]` holds
/// block `i` of the prompt.
pub fn hybrid_hit(
    cap: usize,
    groups: &[(GroupKind, u32)],
    held: impl Fn(usize, usize) -> bool,
) -> usize {
    let mut hit = cap;
    loop {
        let before = hit;
        for (g, (kind, block_size)) in groups.iter().enumerate() {
            hit = group_hit(*kind, *block_size, hit, |i| held(g, i));
        }
        if hit >= before || hit == 0 {
            return hit;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A residency from a picture: `x` held, `.` not, position by position.
    fn held(picture: &str) -> impl Fn(usize) -> bool + '_ {
        move |i| picture.as_bytes().get(i) == Some(&b'x')
    }

    #[test]
    fn kinds_are_read_as_vllm_names_them() {
        let cases = [
            (Some("full_attention"), None, GroupKind::Full),
            (Some("mla_attention"), None, GroupKind::Full),
            (Some("sink_full_attention"), Some(7), GroupKind::Full),
            (Some("sliding_window"), Some(4096), GroupKind::Window { tokens: 4096 }),
            (Some("sliding_window_mla"), Some(128), GroupKind::Window { tokens: 128 }),
            (Some("sliding_window"), None, GroupKind::Unknown),
            (Some("sliding_window"), Some(0), GroupKind::Unknown),
            (Some("mamba"), None, GroupKind::Unknown),
            (Some("chunked_local_attention"), None, GroupKind::Unknown),
            (Some("unknown"), None, GroupKind::Unknown),
            (None, None, GroupKind::Unknown),
        ];
        for (kind, window, want) in cases {
            assert_eq!(GroupKind::of(kind, window), want, "{kind:?} {window:?}");
        }
    }

    #[test]
    fn window_blocks_follow_vllms_arithmetic() {
        // cdiv(W - 1, block_size): the first computed token is itself in its window.
        let cases = [(64, 16, 4), (65, 16, 4), (66, 16, 5), (17, 16, 1), (16, 16, 1), (1, 16, 1)];
        for (tokens, bs, want) in cases {
            assert_eq!(GroupKind::Window { tokens }.window_blocks(bs), Some(want), "W {tokens}");
        }
        assert_eq!(GroupKind::Full.window_blocks(16), None);
    }

    #[test]
    fn the_leading_rule_stops_at_the_first_hole() {
        let cases = [("xxxx", 4, 4), ("xxxx", 2, 2), ("xx.x", 4, 2), (".xxx", 4, 0), ("", 3, 0)];
        for (picture, cap, want) in cases {
            assert_eq!(leading_hit(cap, held(picture)), want, "{picture} cap {cap}");
        }
    }

    /// The window rule's table, with vLLM's own example among the rows: block size 4, window 8
    /// tokens needs ⌈7/4⌉ = 2 blocks (the docstring's `[NULL, NULL, 7, 8]`).
    #[test]
    fn the_window_rule_needs_the_blocks_before_the_hit_only() {
        let cases = [
            // (residency, cap, need, hit)
            ("..xx", 4, 2, 4), // the docstring's example: blocks 0 and 1 freed, still a hit of 4
            ("xxxxxxxx", 8, 2, 8), // everything held
            ("xxxxxx..", 8, 2, 6), // the tail evicted: the hit ends where the window is held
            ("xxx.x.xx", 8, 2, 8), // holes before the window do not matter
            ("xxx.x.x.", 8, 2, 3), // the nearest held 2-run ends at 3
            ("x.x.x.x.", 8, 2, 1), // no 2-run: the run held from block 0
            (".x.x.x.x", 8, 2, 0), // nothing at all
            ("xxxxxxxx", 5, 2, 5), // capped by the main group's match
            ("xxxx.xxx", 5, 3, 4), // the cap's window broken: the next window down
            ("xx", 8, 3, 2),   // a prompt shorter than the window: its leading run
        ];
        for (picture, cap, need, want) in cases {
            assert_eq!(
                window_hit(cap, need, held(picture)),
                want,
                "{picture} cap {cap} need {need}"
            );
        }
    }

    proptest::proptest! {
        /// Against the rule read literally (the largest e ≤ cap whose [max(0, e − c), e) is held):
        /// vLLM's scan finds exactly that.
        #[test]
        fn the_window_scan_is_the_largest_servable_end(
            bits in proptest::collection::vec(proptest::bool::ANY, 0..40),
            cap in 0usize..45,
            need in 1usize..6,
        ) {
            let cap = cap.min(bits.len());
            let held = |i: usize| bits.get(i).copied().unwrap_or(false);
            let literal = (0..=cap)
                .rev()
                .find(|&e| (e.saturating_sub(need)..e).all(held))
                .unwrap_or(0);
            proptest::prop_assert_eq!(window_hit(cap, need, held), literal);
        }
    }

    /// `hybrid_hit` over groups given as (kind, picture), block size 4.
    fn hybrid(cap: usize, groups: &[(GroupKind, &str)]) -> usize {
        let kinds: Vec<(GroupKind, u32)> = groups.iter().map(|(k, _)| (*k, 4)).collect();
        hybrid_hit(cap, &kinds, |g, i| held(groups[g].1)(i))
    }

    #[test]
    fn the_hybrid_hit_is_what_every_group_can_serve() {
        let window = GroupKind::Window { tokens: 9 }; // 2 blocks of 4
                                                      // One window group: the main group's match cut where the window is held.
        assert_eq!(hybrid(8, &[(window, "xxxxxxxx")]), 8);
        assert_eq!(hybrid(8, &[(window, "xxxxx...")]), 5);
        assert_eq!(hybrid(7, &[(window, "xx.xxx.x")]), 6);
        // A full-attention group beside it cuts at its first hole, and the window then again.
        assert_eq!(hybrid(8, &[(GroupKind::Full, "xxxxxx.x"), (window, "xx.xxx.x")]), 6);
        // The window's answer (8) is re-checked after a later group lowers it (to 3).
        assert_eq!(hybrid(8, &[(window, "xxxxxxxx"), (GroupKind::Unknown, "xxx.....")]), 3);
        // Two windows: the fixed point (window B's 5 breaks window A's run, A settles lower).
        let wide = GroupKind::Window { tokens: 13 }; // 3 blocks
        assert_eq!(hybrid(8, &[(wide, "xxx.xxxx"), (window, "xxxxx...")]), 3);
        assert_eq!(hybrid(0, &[(window, "xxxxxxxx")]), 0);
        // No group: the cap.
        assert_eq!(hybrid(5, &[]), 5);
    }
}
