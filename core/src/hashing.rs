//! Block hashing compatible with NVIDIA Dynamo's KV router.
//!
//! A block's *local* hash is XXH3-64 over its token ids as little-endian `u32`, seeded with 1337
//! (plus LoRA / cache-salt terms). The *sequence* hash chains it to its parent so that a block is
//! identified by its whole prefix: `seq[0] = local[0]`, `seq[i] = XXH3-64(le(seq[i-1]) ‖ le(local[i]), 1337)`.
//! Only full blocks are hashed. Engine block hashes are opaque and never compared with these.

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

    proptest::proptest! {
        #[test]
        fn long_blocks_hash_like_one_shot(tokens in proptest::collection::vec(proptest::prelude::any::<u32>(), 0..300)) {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            proptest::prop_assert_eq!(local_block_hash(&tokens, XXH3_SEED).0, xxh3(&bytes, XXH3_SEED));
        }
    }
}
