//! The engine's own block hashes: the ids the simulator publishes in KV events.
//!
//! vLLM keys its prefix cache by a chained hash of (parent hash, block token ids, extra keys) and
//! publishes the low 64 bits of the SHA-256 digest. The simulator does the same, deliberately
//! unlike the router's XXH3 chain (`kvmesh_core::hashing`): engine hashes are opaque ids on the
//! wire, and nothing downstream may lean on them being equal to its own. The chain input is
//! `be_u64(parent) ‖ le_u32(token)…`, then the block's extra keys in vLLM's order
//! (`generate_block_hash_extra_keys`): the LoRA adapter's name on every block of an adapter
//! request, then `(identifier, offset)` for each media item overlapping the block
//! ([`crate::media`]), then the request's `cache_salt` on the first block only (it flows down the
//! chain). So an adapter's blocks never share a hash with another adapter's or the base model's,
//! nor blocks of equal tokens with different images.
//! The root parent is a fixed constant (vLLM's `NONE_HASH` with a fixed `PYTHONHASHSEED`), so
//! every run and every simulator instance agrees.

use sha2::{Digest, Sha256};

use crate::media::{block_keys, BlockKeys, MediaSpan};

/// A published engine block hash (low 64 bits of a SHA-256 digest, as vLLM publishes with
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`).
pub type BlockHash = u64;

/// The parent of the first block of every chain (never published: the first block's
/// `parent_block_hash` is nil on the wire).
pub const ROOT_PARENT: BlockHash = 0x6b76_6d65_7368_5f73; // "kvmesh_s"

/// The hash of one block given its parent, its tokens, the adapter (every block) and the cache
/// salt (pass it for the first block only).
pub fn block_hash(
    parent: BlockHash,
    tokens: &[u32],
    lora: Option<&str>,
    salt: Option<&str>,
) -> BlockHash {
    block_hash_keyed(parent, tokens, lora, salt, &[])
}

/// [`block_hash`] of a block overlapping media items (`media`: its keys, [`block_keys`]).
pub fn block_hash_keyed(
    parent: BlockHash,
    tokens: &[u32],
    lora: Option<&str>,
    salt: Option<&str>,
    media: &[(std::sync::Arc<str>, i64)],
) -> BlockHash {
    let mut h = Sha256::new();
    h.update(parent.to_be_bytes());
    // One update per block rather than per token: the digest sees the same byte string.
    let mut buf = [0u8; 4 * 64];
    for chunk in tokens.chunks(64) {
        let n = chunk.len() * 4;
        for (dst, t) in buf[..n].chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..n]);
    }
    if let Some(lora) = lora.filter(|s| !s.is_empty()) {
        h.update(b"\x00lora\x00");
        h.update(lora.as_bytes());
    }
    for (identifier, offset) in media {
        h.update(b"\x00mm\x00");
        h.update((identifier.len() as u64).to_le_bytes());
        h.update(identifier.as_bytes());
        h.update(offset.to_le_bytes());
    }
    if let Some(salt) = salt.filter(|s| !s.is_empty()) {
        h.update(b"\x00salt\x00");
        h.update(salt.as_bytes());
    }
    low64(&h.finalize())
}

/// The last 8 bytes of a digest read big-endian, i.e. `int.from_bytes(d, "big") & (2**64-1)`.
fn low64(digest: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = digest.len();
    b.copy_from_slice(&digest[n - 8..]);
    u64::from_be_bytes(b)
}

/// Appends to `out` the hashes of the full blocks of `tokens[from_block * block_size..]`,
/// continuing the chain whose hashes are already in `out[..from_block]`.
///
/// `out.len()` must equal `from_block`; `lora` keys every block, the salt block 0 only. Hashes
/// are computed once per block, so extending a request's chain as it generates tokens is
/// O(new blocks).
pub fn extend_chain(
    out: &mut Vec<BlockHash>,
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) {
    extend_chain_keyed(out, tokens, block_size, lora, salt, &[])
}

/// [`extend_chain`] of a prompt with media items (`media`: their token spans).
pub fn extend_chain_keyed(
    out: &mut Vec<BlockHash>,
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
    media: &[MediaSpan],
) {
    let full = tokens.len() / block_size;
    for i in out.len()..full {
        let parent = if i == 0 { ROOT_PARENT } else { out[i - 1] };
        let (start, end) = (i * block_size, (i + 1) * block_size);
        let keys: BlockKeys = block_keys(media, start, end);
        let salt = if i == 0 { salt } else { None };
        out.push(block_hash_keyed(parent, &tokens[start..end], lora, salt, &keys));
    }
}

/// The hashes of every full block of an adapter's (`lora`) or the base model's (`None`) prompt.
pub fn chain_for(
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
) -> Vec<BlockHash> {
    chain_for_keyed(tokens, block_size, lora, salt, &[])
}

/// [`chain_for`] of a prompt with media items (`media`: their token spans).
pub fn chain_for_keyed(
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    salt: Option<&str>,
    media: &[MediaSpan],
) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    if block_size > 0 {
        extend_chain_keyed(&mut out, tokens, block_size, lora, salt, media);
    }
    out
}

/// The hashes of every full block of a base-model prompt.
pub fn chain(tokens: &[u32], block_size: usize, salt: Option<&str>) -> Vec<BlockHash> {
    chain_for(tokens, block_size, None, salt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn low_64_bits_of_sha256_over_parent_and_tokens() {
        // sha256(be_u64(ROOT_PARENT) ‖ le_u32(1) ‖ le_u32(2)), last 8 bytes big-endian.
        let mut bytes = ROOT_PARENT.to_be_bytes().to_vec();
        bytes.extend_from_slice(&[1, 0, 0, 0, 2, 0, 0, 0]);
        let d = Sha256::digest(&bytes);
        let want = u64::from_be_bytes(d[24..32].try_into().unwrap());
        assert_eq!(block_hash(ROOT_PARENT, &[1, 2], None, None), want);
    }

    #[test]
    fn chained_full_blocks_only() {
        let toks: Vec<u32> = (0..10).collect();
        let h = chain(&toks, 4, None);
        assert_eq!(h.len(), 2);
        assert_eq!(h[0], block_hash(ROOT_PARENT, &[0, 1, 2, 3], None, None));
        assert_eq!(h[1], block_hash(h[0], &[4, 5, 6, 7], None, None));
    }

    #[test]
    fn extend_continues_the_chain() {
        let toks: Vec<u32> = (0..20).collect();
        let mut h = chain(&toks[..9], 4, Some("s"));
        extend_chain(&mut h, &toks, 4, None, Some("s"));
        assert_eq!(h, chain(&toks, 4, Some("s")));
    }

    #[test]
    fn media_key_the_blocks_they_overlap_and_everything_after() {
        let toks: Vec<u32> = (0..48).collect();
        let span = |id: &str| MediaSpan { identifier: id.into(), offset: 20, len: 8 };
        let plain = chain(&toks, 16, None);
        let a = chain_for_keyed(&toks, 16, None, None, &[span("a")]);
        let b = chain_for_keyed(&toks, 16, None, None, &[span("b")]);
        assert_eq!(a[0], plain[0]);
        assert_ne!(a[1], plain[1]);
        assert_ne!(a[1], b[1]);
        assert_ne!(a[2], b[2]);
        assert_eq!(chain_for_keyed(&toks, 16, None, None, &[span("a")]), a);
    }

    #[test]
    fn salt_changes_every_block_through_the_chain() {
        let toks: Vec<u32> = (0..8).collect();
        let a = chain(&toks, 4, None);
        let b = chain(&toks, 4, Some("tenant"));
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
    }

    #[test]
    fn adapters_key_every_block_apart_from_each_other_and_the_base() {
        let toks: Vec<u32> = (0..8).collect();
        let base = chain(&toks, 4, None);
        let a = chain_for(&toks, 4, Some("a1"), None);
        let b = chain_for(&toks, 4, Some("a2"), None);
        for i in 0..2 {
            assert!(base[i] != a[i] && a[i] != b[i] && base[i] != b[i], "block {i}");
        }
        // Block 1 differs by the adapter key itself, not only through its parent.
        assert_ne!(block_hash(base[0], &toks[4..], Some("a1"), None), base[1]);
        // The adapter key comes first, then the salt (on block 0 only).
        let salted = chain_for(&toks, 4, Some("a1"), Some("s"));
        assert_eq!(salted[0], block_hash(ROOT_PARENT, &toks[..4], Some("a1"), Some("s")));
        assert_eq!(salted[1], block_hash(salted[0], &toks[4..], Some("a1"), None));
        assert_ne!(salted[0], a[0]);
    }

    #[test]
    fn unlike_the_router_hash() {
        let toks: Vec<u32> = (0..16).collect();
        let seed = kvmesh_core::hashing::block_seed(None, None);
        let router: Vec<u64> =
            kvmesh_core::hashing::sequence_hashes(&toks, 16, seed).iter().map(|h| h.0).collect();
        assert_ne!(chain(&toks, 16, None), router);
    }
}
