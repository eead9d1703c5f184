//! Block hashing compatible with NVIDIA Dynamo's KV router.
//!
//! A block's *local* hash is XXH3-64 over its token ids as little-endian `u32`, seeded with 1337
//! (plus LoRA / cache-salt terms). The *sequence* hash chains it to its parent so that a block is
//! identified by its whole prefix: `seq[0] = local[0]`, `seq[i] = XXH3-64(le(seq[i-1]) ‖ le(local[i]), 1337)`.
//! Only full blocks are hashed. Engine block hashes are opaque and never compared with these.
//!
//! **Media keys.** vLLM keys a block that overlaps a multimodal item (an image …) by the item's
//! identifier and its start relative to the block (`(mm_feature.identifier, offset)`, one pair per
//! overlapping item: `generate_block_hash_extra_keys`), so equal placeholder tokens with different
//! images are different blocks. kvmesh does the same in its own hash: such a block's local hash is
//! seeded with `seed + media_term(keys)` ([`media_term`], [`keyed_seed`]); a block without media
//! keys has term 0 and hashes exactly as before, so text-only chains never change. A block whose
//! extra keys the indexer cannot reproduce (prompt embeddings, shapes it does not know) gets
//! [`UNUSABLE_TERM`], which no request ever produces: it and every block chained after it are
//! indexed but can never match.

use std::hash::Hasher;
use twox_hash::XxHash3_64;

/// Dynamo's `XXH3_SEED` / `CHAIN_XXH3_SEED`.
pub const XXH3_SEED: u64 = 1337;

/// The content hash of one full block of tokens (no parent).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct LocalBlockHash(pub u64);

/// The hash of a block together with every block before it; the index key.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct SequenceHash(pub u64);

/// The seed for local block hashes: 1337, plus `XXH3(lora_name, 0)` and `XXH3(cache_salt, 1)`
/// (wrapping) when present. Empty strings count as absent, as in Dynamo.
pub fn block_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut seed = XXH3_SEED;
    if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(XxHash3_64::oneshot_with_seed(0, lora.as_bytes()));
    }
    if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(XxHash3_64::oneshot_with_seed(1, salt.as_bytes()));
    }
    seed
}

/// XXH3-64 of `tokens` as little-endian u32, with `seed`.
pub fn local_block_hash(tokens: &[u32], seed: u64) -> LocalBlockHash {
    // Hash through a small stack buffer: no allocation, and byte order is explicit on every host.
    let mut hasher = XxHash3_64::with_seed(seed);
    let mut buf = [0u8; 256];
    for chunk in tokens.chunks(buf.len() / 4) {
        for (slot, token) in buf.chunks_exact_mut(4).zip(chunk) {
            slot.copy_from_slice(&token.to_le_bytes());
        }
        hasher.write(&buf[..chunk.len() * 4]);
    }
    LocalBlockHash(hasher.finish())
}

/// The sequence hash of a block whose parent chain hash is `parent` (None at the root).
pub fn chain(parent: Option<SequenceHash>, local: LocalBlockHash) -> SequenceHash {
    match parent {
        None => SequenceHash(local.0),
        Some(parent) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
            bytes[8..].copy_from_slice(&local.0.to_le_bytes());
            SequenceHash(XxHash3_64::oneshot_with_seed(XXH3_SEED, &bytes))
        }
    }
}

/// Local hashes of every full block of `tokens`. `block_size == 0` gives none.
pub fn local_block_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<LocalBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    tokens.chunks_exact(block_size).map(|block| local_block_hash(block, seed)).collect()
}

/// Sequence hashes of every full block of `tokens`, continuing the chain from `parent`.
pub fn sequence_hashes_from(
    parent: Option<SequenceHash>,
    tokens: &[u32],
    block_size: usize,
    seed: u64,
) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    let mut prev = parent;
    for local in local_block_hashes(tokens, block_size, seed) {
        let seq = chain(prev, local);
        out.push(seq);
        prev = Some(seq);
    }
    out
}

/// Sequence hashes of every full block of a prompt, from the root.
pub fn sequence_hashes(tokens: &[u32], block_size: usize, seed: u64) -> Vec<SequenceHash> {
    sequence_hashes_from(None, tokens, block_size, seed)
}

/// One multimodal item overlapping a block, as vLLM keys it: the item's identifier
/// (`mm_feature.identifier`: the client's `uuid` when it sent one and the engine adds no hash
/// factors, else the engine's hash of the media) and where the item starts relative to the
/// block's first token (negative when it started in an earlier block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaKey<'a> {
    pub identifier: &'a str,
    pub offset: i64,
}

/// Seed of [`media_term`]'s hash (LoRA names hash with 0, cache salts with 1).
const MEDIA_SEED: u64 = 2;

/// The seed term of a block whose extra keys cannot be reproduced from a request: [`media_term`]
/// never returns it, so such a block never matches a request's chain.
pub const UNUSABLE_TERM: u64 = 0x756e_7573_6162_6c65; // "unusable"

/// What a block's media keys add to its local-hash seed: 0 for none (text-only blocks hash as
/// they always did), else XXH3-64 (seed 2) over each key as `le_u64(len) ‖ identifier ‖
/// le_i64(offset)`, in the engine's order; never 0 nor [`UNUSABLE_TERM`] for a non-empty list.
pub fn media_term(keys: &[MediaKey<'_>]) -> u64 {
    if keys.is_empty() {
        return 0;
    }
    let mut h = XxHash3_64::with_seed(MEDIA_SEED);
    for k in keys {
        h.write(&(k.identifier.len() as u64).to_le_bytes());
        h.write(k.identifier.as_bytes());
        h.write(&k.offset.to_le_bytes());
    }
    match h.finish() {
        0 | UNUSABLE_TERM => 1,
        t => t,
    }
}

/// The local-hash seed of a block with media term `term` under the request's `seed`.
pub fn keyed_seed(seed: u64, term: u64) -> u64 {
    seed.wrapping_add(term)
}

/// Rebuilds an XXH3 hasher's one-shot API for callers that want raw hashes of bytes (session keys,
/// rendezvous) without depending on twox-hash themselves.
pub fn xxh3(bytes: &[u8], seed: u64) -> u64 {
    XxHash3_64::oneshot_with_seed(seed, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The vector DESIGN.md quotes (from Dynamo's protocols.rs).
    #[test]
    fn design_vector() {
        assert_eq!(xxh3(b"test data", XXH3_SEED), 13_226_331_709_069_118_873);
    }

    // Vectors derived with Python xxhash for tokens 0..8 at block size 4 (dynamo.md §1).
    #[test]
    fn chain_vectors() {
        let tokens: Vec<u32> = (0..8).collect();
        let local = local_block_hashes(&tokens, 4, XXH3_SEED);
        assert_eq!(
            local,
            vec![
                LocalBlockHash(9_143_094_415_614_847_814),
                LocalBlockHash(12_124_091_508_212_882_195)
            ]
        );
        let seq = sequence_hashes(&tokens, 4, XXH3_SEED);
        assert_eq!(seq[0].0, local[0].0);
        assert_eq!(seq[1].0, 9_510_318_385_840_434_533);
    }

    #[test]
    fn partial_blocks_are_not_hashed() {
        for bs in [11usize, 32, 64] {
            let t: Vec<u32> = (0..(2 * bs as u32 + 1)).collect();
            assert_eq!(sequence_hashes(&t[..bs], bs, XXH3_SEED).len(), 1);
            assert_eq!(sequence_hashes(&t[..bs + 1], bs, XXH3_SEED).len(), 1);
            assert_eq!(sequence_hashes(&t, bs, XXH3_SEED).len(), 2);
        }
        assert!(sequence_hashes(&[1, 2, 3], 0, XXH3_SEED).is_empty());
    }

    #[test]
    fn salts_change_the_seed_and_empty_is_absent() {
        assert_eq!(block_seed(None, None), XXH3_SEED);
        assert_eq!(block_seed(Some(""), Some("")), XXH3_SEED);
        let lora = block_seed(Some("adapter"), None);
        let salt = block_seed(None, Some("tenant"));
        assert_ne!(lora, XXH3_SEED);
        assert_ne!(salt, XXH3_SEED);
        assert_eq!(
            block_seed(Some("adapter"), Some("tenant")),
            lora.wrapping_add(salt).wrapping_sub(XXH3_SEED)
        );
        assert_ne!(
            local_block_hash(&[1, 2, 3, 4], lora),
            local_block_hash(&[1, 2, 3, 4], XXH3_SEED)
        );
    }

    #[test]
    fn chain_continues_from_a_parent() {
        let t: Vec<u32> = (0..64).collect();
        let all = sequence_hashes(&t, 16, XXH3_SEED);
        let tail = sequence_hashes_from(Some(all[1]), &t[32..], 16, XXH3_SEED);
        assert_eq!(&all[2..], &tail[..]);
    }

    #[test]
    fn media_terms_key_identifier_and_offset_and_leave_text_alone() {
        let key = |identifier, offset| MediaKey { identifier, offset };
        assert_eq!(media_term(&[]), 0);
        assert_eq!(keyed_seed(XXH3_SEED, media_term(&[])), XXH3_SEED);
        let a = media_term(&[key("img-a", 0)]);
        let cases = [
            media_term(&[key("img-b", 0)]),
            media_term(&[key("img-a", 1)]),
            media_term(&[key("img-a", -3)]),
            media_term(&[key("img-a", 0), key("img-b", 8)]),
            media_term(&[key("img-b", 8), key("img-a", 0)]),
            // Length-prefixed: the identifier cannot run into the offset.
            media_term(&[key("img-a\0", 0)]),
        ];
        for (i, t) in cases.iter().enumerate() {
            assert_ne!(*t, a, "case {i}");
            assert_ne!(*t, 0);
            assert_ne!(*t, UNUSABLE_TERM);
        }
        assert_eq!(a, media_term(&[key("img-a", 0)]));
        assert_ne!(
            local_block_hash(&[1, 2, 3, 4], keyed_seed(XXH3_SEED, a)),
            local_block_hash(&[1, 2, 3, 4], XXH3_SEED)
        );
    }

    proptest::proptest! {
        #[test]
        fn long_blocks_hash_like_one_shot(tokens in proptest::collection::vec(proptest::prelude::any::<u32>(), 0..300)) {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            proptest::prop_assert_eq!(local_block_hash(&tokens, XXH3_SEED).0, xxh3(&bytes, XXH3_SEED));
        }
    }
}
