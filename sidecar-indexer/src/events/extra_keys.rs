//! A `BlockStored`'s `extra_keys`: what the engine keyed each block by besides its tokens, read
//! into the per-block seed terms the index hashes with ([`kvmesh_core::hashing::media_term`]).
//!
//! vLLM publishes one entry per block (`to_event_extra_keys`, `vllm/v1/core/kv_cache_utils.py`):
//! nil, or a tuple of the block's keys in the order `generate_block_hash_extra_keys` builds them —
//! the LoRA name (every block of an adapter request), `(mm identifier, offset)` for each multimodal
//! item overlapping the block, the `cache_salt` (first block of a request only) and the SHA-256 of
//! the block's prompt embeddings. Read here:
//!
//! * a string equal to the event's `lora_name`: already in the seed ([`block_seed`]), skipped;
//! * any other string on the first block of a root store (no parent): the request's cache salt —
//!   the index seeds the whole chain with it, as a request with that salt is seeded (the salt's
//!   seed flows down to later stores through their parents);
//! * `[identifier, offset]`: a media key ([`MediaKey`]);
//! * anything else (prompt-embeds bytes, a string elsewhere, other shapes, a list whose length is
//!   not the block count, keys past [`MAX_EXTRA_KEY_BYTES`]): the block is [`UNUSABLE_TERM`] —
//!   indexed, never matched, and counted.
//!
//! An event with no keys (absent, nil, or every entry nil) has no terms: its chains are exactly
//! those of a text-only event. Reading never fails a batch: the worst a malformed `extra_keys`
//! does is make its blocks unmatchable.
//!
//! [`block_seed`]: kvmesh_core::hashing::block_seed

use kvmesh_core::hashing::{media_term, MediaKey, UNUSABLE_TERM};

use super::msgpack::{Head, MsgpackError, Reader};

/// Most bytes of key text (strings and identifiers, 16 more per key) one event's `extra_keys` may
/// hold; past it every block of the event is unusable. A block overlaps few media items, so real
/// events stay far below (a 4k-token store with an image per block and 64-byte ids: ~20 KiB).
pub const MAX_EXTRA_KEY_BYTES: usize = 64 * 1024;

/// One element of a block's key tuple, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// A bare string: the LoRA name or the cache salt.
    Text(String),
    /// `(identifier, offset)`: a multimodal item.
    Media { identifier: String, offset: i64 },
    /// Prompt-embeds bytes or a shape this reader does not know.
    Other,
}

/// The `extra_keys` field as read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ExtraKeys {
    /// Absent or nil.
    #[default]
    Absent,
    /// One entry per block (nil: no keys).
    Blocks(Vec<Option<Vec<ExtraKey>>>),
    /// Not a list of entries, or over [`MAX_EXTRA_KEY_BYTES`].
    Unusable,
}

/// What the keys mean for the index.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Terms {
    /// Per block, the seed term ([`media_term`], or [`UNUSABLE_TERM`]); empty when no block has
    /// keys the seed does not already hold.
    pub terms: Vec<u64>,
    /// The cache salt the first block carried (a root store only).
    pub cache_salt: Option<String>,
}

/// The seed terms of an event's `blocks` blocks from its `keys`; `lora` is the event's
/// `lora_name`, `root` whether it has no parent (module docs for the rules).
pub fn terms(keys: &ExtraKeys, blocks: usize, lora: Option<&str>, root: bool) -> Terms {
    let entries = match keys {
        ExtraKeys::Absent => return Terms::default(),
        ExtraKeys::Unusable => {
            return Terms { terms: vec![UNUSABLE_TERM; blocks], cache_salt: None }
        }
        ExtraKeys::Blocks(entries) if entries.len() != blocks => {
            return Terms { terms: vec![UNUSABLE_TERM; blocks], cache_salt: None }
        }
        ExtraKeys::Blocks(entries) => entries,
    };
    let mut out = Terms { terms: Vec::with_capacity(blocks), cache_salt: None };
    for (i, entry) in entries.iter().enumerate() {
        let Some(keys) = entry else {
            out.terms.push(0);
            continue;
        };
        let mut media = Vec::new();
        let mut usable = true;
        for k in keys {
            match k {
                ExtraKey::Text(s) if lora.is_some_and(|l| l == s) => {}
                ExtraKey::Text(s) if i == 0 && root && out.cache_salt.is_none() => {
                    out.cache_salt = Some(s.clone());
                }
                ExtraKey::Media { identifier, offset } => {
                    media.push(MediaKey { identifier, offset: *offset })
                }
                ExtraKey::Text(_) | ExtraKey::Other => usable = false,
            }
        }
        out.terms.push(if usable { media_term(&media) } else { UNUSABLE_TERM });
    }
    if out.terms.iter().all(|&t| t == 0) {
        out.terms.clear();
    }
    out
}

/// Reads the `extra_keys` value at `rd` (its shape never fails the batch: see [`ExtraKeys`]).
pub fn read(rd: &mut Reader<'_>, depth: u16) -> Result<ExtraKeys, MsgpackError> {
    let (head, child) = rd.head(depth)?;
    let n = match head {
        Head::Nil => return Ok(ExtraKeys::Absent),
        Head::Array(n) => n,
        other => {
            rd.skip_rest(other, child)?;
            return Ok(ExtraKeys::Unusable);
        }
    };
    let mut budget = MAX_EXTRA_KEY_BYTES;
    let mut entries = Vec::with_capacity(n.min(rd.remaining()).min(4096));
    let mut usable = true;
    for _ in 0..n {
        if !usable {
            rd.skip(child)?;
            continue;
        }
        match read_entry(rd, child, &mut budget)? {
            Some(entry) => entries.push(entry),
            None => usable = false,
        }
    }
    Ok(if usable { ExtraKeys::Blocks(entries) } else { ExtraKeys::Unusable })
}

/// One block's entry: `Some(None)` for nil, `Some(Some(keys))` for a tuple, `None` when the entry
/// is not one of those or the budget ran out (the event's keys are then unusable).
#[allow(clippy::option_option)]
fn read_entry(
    rd: &mut Reader<'_>,
    depth: u16,
    budget: &mut usize,
) -> Result<Option<Option<Vec<ExtraKey>>>, MsgpackError> {
    let (head, child) = rd.head(depth)?;
    let n = match head {
        Head::Nil => return Ok(Some(None)),
        Head::Array(n) => n,
        other => {
            rd.skip_rest(other, child)?;
            return Ok(None);
        }
    };
    let mut keys = Vec::with_capacity(n.min(rd.remaining()).min(64));
    let mut ok = true;
    for _ in 0..n {
        if !ok {
            rd.skip(child)?;
            continue;
        }
        match read_key(rd, child, budget)? {
            Some(k) => keys.push(k),
            None => ok = false,
        }
    }
    Ok(ok.then_some(Some(keys)))
}

/// One key; `None` when the budget ran out.
fn read_key(
    rd: &mut Reader<'_>,
    depth: u16,
    budget: &mut usize,
) -> Result<Option<ExtraKey>, MsgpackError> {
    let mut spend = |bytes: usize| {
        let cost = bytes + 16;
        let ok = cost <= *budget;
        *budget = budget.saturating_sub(cost);
        ok
    };
    let (head, child) = rd.head(depth)?;
    match head {
        Head::Str(b) => {
            if !spend(b.len()) {
                return Ok(None);
            }
            Ok(Some(std::str::from_utf8(b).map_or(ExtraKey::Other, |s| ExtraKey::Text(s.into()))))
        }
        Head::Array(2) => {
            let (id, id_child) = rd.head(child)?;
            let identifier = match id {
                Head::Str(b) => std::str::from_utf8(b).ok().map(str::to_owned),
                other => {
                    rd.skip_rest(other, id_child)?;
                    None
                }
            };
            let (off, off_child) = rd.head(child)?;
            let offset = match off {
                Head::Uint(u) => i64::try_from(u).ok(),
                Head::Int(i) => Some(i),
                other => {
                    rd.skip_rest(other, off_child)?;
                    None
                }
            };
            match (identifier, offset) {
                (Some(identifier), Some(offset)) => {
                    if !spend(identifier.len()) {
                        return Ok(None);
                    }
                    Ok(Some(ExtraKey::Media { identifier, offset }))
                }
                _ => Ok(Some(ExtraKey::Other)),
            }
        }
        other => {
            rd.skip_rest(other, child)?;
            Ok(Some(ExtraKey::Other))
        }
    }
}

/// The same reading from an `rmpv` value (the decoder's reference in `decode_tests.rs`).
#[cfg(test)]
pub fn from_value(v: Option<&rmpv::Value>) -> ExtraKeys {
    use rmpv::Value;
    let Some(v) = v.filter(|v| !v.is_nil()) else { return ExtraKeys::Absent };
    let Value::Array(entries) = v else { return ExtraKeys::Unusable };
    let mut budget = MAX_EXTRA_KEY_BYTES;
    let mut spend = |bytes: usize| {
        let cost = bytes + 16;
        let ok = cost <= budget;
        budget = budget.saturating_sub(cost);
        ok
    };
    let mut out = Vec::new();
    for e in entries {
        let keys = match e {
            Value::Nil => None,
            Value::Array(keys) => {
                let mut read = Vec::new();
                for k in keys {
                    let key = match k {
                        Value::String(s) => {
                            if !spend(s.as_bytes().len()) {
                                return ExtraKeys::Unusable;
                            }
                            s.as_str().map_or(ExtraKey::Other, |s| ExtraKey::Text(s.into()))
                        }
                        Value::Array(pair) if pair.len() == 2 => {
                            let offset = match &pair[1] {
                                Value::Integer(i) => i.as_i64(),
                                _ => None,
                            };
                            match (pair[0].as_str(), offset) {
                                (Some(id), Some(offset)) => {
                                    if !spend(id.len()) {
                                        return ExtraKeys::Unusable;
                                    }
                                    ExtraKey::Media { identifier: id.into(), offset }
                                }
                                _ => ExtraKey::Other,
                            }
                        }
                        _ => ExtraKey::Other,
                    };
                    read.push(key);
                }
                Some(read)
            }
            _ => return ExtraKeys::Unusable,
        };
        out.push(keys);
    }
    ExtraKeys::Blocks(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_core::hashing::{media_term, MediaKey};
    use rmpv::Value;

    fn read_bytes(v: &Value) -> ExtraKeys {
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, v).unwrap();
        let got = read(&mut Reader::new(&bytes), 64).unwrap();
        assert_eq!(got, from_value(Some(v)), "{v}");
        got
    }

    fn mm(id: &str, offset: i64) -> Value {
        Value::Array(vec![Value::from(id), Value::from(offset)])
    }

    #[test]
    fn reads_vllm_shapes() {
        let v = Value::Array(vec![
            Value::Array(vec![Value::from("adapter"), mm("img", 3), Value::from("salt")]),
            Value::Nil,
            Value::Array(vec![mm("img", -13)]),
            Value::Array(vec![Value::Binary(vec![1, 2, 3])]),
        ]);
        let keys = read_bytes(&v);
        let t = terms(&keys, 4, Some("adapter"), true);
        assert_eq!(t.cache_salt.as_deref(), Some("salt"));
        assert_eq!(
            t.terms,
            vec![
                media_term(&[MediaKey { identifier: "img", offset: 3 }]),
                0,
                media_term(&[MediaKey { identifier: "img", offset: -13 }]),
                UNUSABLE_TERM,
            ]
        );

        // Not a root store: a bare string other than the LoRA name cannot be a salt.
        let t = terms(&keys, 4, Some("adapter"), false);
        assert_eq!((t.terms[0], t.cache_salt), (UNUSABLE_TERM, None));
    }

    #[test]
    fn no_keys_means_no_terms() {
        for v in [Value::Nil, Value::Array(vec![Value::Nil, Value::Nil])] {
            let keys = read_bytes(&v);
            assert_eq!(terms(&keys, 2, None, true), Terms::default(), "{v}");
        }
        assert_eq!(terms(&ExtraKeys::Absent, 3, None, true), Terms::default());
        // Only the LoRA name, which the seed holds already.
        let v = Value::Array(vec![Value::Array(vec![Value::from("a")])]);
        assert_eq!(terms(&read_bytes(&v), 1, Some("a"), false), Terms::default());
    }

    #[test]
    fn malformed_or_oversized_keys_make_every_block_unusable() {
        let big = "x".repeat(MAX_EXTRA_KEY_BYTES);
        for v in [
            Value::from(5),
            Value::Array(vec![Value::from(7)]),
            Value::Array(vec![Value::Array(vec![mm(&big, 0)])]),
        ] {
            let keys = read_bytes(&v);
            assert_eq!(keys, ExtraKeys::Unusable, "{v}");
            assert_eq!(terms(&keys, 2, None, true).terms, vec![UNUSABLE_TERM; 2]);
        }
        // One entry for two blocks.
        let keys = read_bytes(&Value::Array(vec![Value::Array(vec![mm("i", 0)])]));
        assert_eq!(terms(&keys, 2, None, true).terms, vec![UNUSABLE_TERM; 2]);
    }

    /// Stores of equal tokens with different media never share a chain; a store without keys
    /// chains as before; unusable keys are indexed but never match.
    #[test]
    fn media_keyed_stores_match_only_their_own_media() {
        use super::super::apply::apply_batch;
        use super::super::decode::{EventBatch, KvEvent};
        use crate::index::KvIndex;
        use kvmesh_core::hashing::{
            chain, keyed_seed, local_block_hash, sequence_hashes, SequenceHash, XXH3_SEED,
        };
        let t: Vec<u32> = (0..8).collect();
        let term = |id| media_term(&[MediaKey { identifier: id, offset: 2 }]);
        let store = |hashes: Vec<u64>, extra_terms: Vec<u64>| EventBatch {
            ts: 0.0,
            events: vec![KvEvent::Stored {
                block_hashes: hashes,
                parent: None,
                token_ids: t.clone(),
                block_size: 4,
                lora_name: None,
                cache_salt: None,
                medium: None,
                group_idx: None,
                spec_kind: None,
                sliding_window: None,
                extra_terms,
            }],
            dp_rank: None,
        };
        let mut index = KvIndex::new(1000, 1000);
        for w in 0..4 {
            index.add_worker(w);
        }
        apply_batch(&mut index, 0, &store(vec![1, 2], vec![]), 4);
        apply_batch(&mut index, 1, &store(vec![3, 4], vec![0, term("a")]), 4);
        apply_batch(&mut index, 2, &store(vec![5, 6], vec![0, term("b")]), 4);
        let r = apply_batch(&mut index, 3, &store(vec![7, 8], vec![0, UNUSABLE_TERM]), 4);
        assert_eq!(r.unusable_extra_keys, 1);
        assert_eq!(r.stored_blocks, 2);
        // A request's chains: block 1 keyed by its image (the request side's function).
        let keyed = |term: u64| {
            let c0 = chain(None, local_block_hash(&t[..4], XXH3_SEED));
            vec![c0, chain(Some(c0), local_block_hash(&t[4..], keyed_seed(XXH3_SEED, term)))]
        };
        let depths = |chains: &[SequenceHash]| {
            let mut m = index.find_matches(chains);
            m.sort();
            m
        };
        let text = sequence_hashes(&t, 4, XXH3_SEED);
        assert_eq!(depths(&text), vec![(0, 2), (1, 1), (2, 1), (3, 1)]);
        assert_eq!(depths(&keyed(term("a"))), vec![(0, 1), (1, 2), (2, 1), (3, 1)]);
        assert_eq!(depths(&keyed(term("b"))), vec![(0, 1), (1, 1), (2, 2), (3, 1)]);
        assert_eq!(depths(&keyed(term("c"))), vec![(0, 1), (1, 1), (2, 1), (3, 1)]);
    }

    /// A batch vLLM 0.32's own classes wrote (`tests/fixtures/gen_mm_fixture.py`): keys converted
    /// by its `to_event_extra_keys`, encoded as its publisher encodes.
    #[test]
    fn reads_what_vllm_publishes() {
        use super::super::decode::{decode_batch, KvEvent};
        let path = format!("{}/tests/fixtures/batch_mm.msgpack", env!("CARGO_MANIFEST_DIR"));
        let batch = decode_batch(&std::fs::read(&path).unwrap()).unwrap();
        let KvEvent::Stored { extra_terms, cache_salt, lora_name, .. } = &batch.events[0] else {
            panic!("{:?}", batch.events[0])
        };
        let img = |offset| media_term(&[MediaKey { identifier: "img-1", offset }]);
        assert_eq!(extra_terms, &vec![img(3), img(-13), 0, UNUSABLE_TERM]);
        assert_eq!(
            (cache_salt.as_deref(), lora_name.as_deref()),
            (Some("tenant"), Some("adapter"))
        );
        let KvEvent::Stored { extra_terms, cache_salt, .. } = &batch.events[1] else {
            panic!("{:?}", batch.events[1])
        };
        assert!(extra_terms.is_empty() && cache_salt.is_none());
    }
}
