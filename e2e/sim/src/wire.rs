//! vLLM's KV-event wire encoding (msgpack), in both generations.
//!
//! A batch is the positional array `[ts, events, data_parallel_rank]` (msgspec `array_like`, so
//! the rank is always present). Events are either maps tagged by a `"type"` key — the current
//! layout since vLLM PR #42892, with fields that still hold their default omitted — or the legacy
//! tagged arrays `["BlockStored", f1, f2, …]` that always carry every field, padded with nil (12
//! elements for `BlockStored`, as vLLM 0.23 sends). Encoding is hand-written with `rmp` straight
//! into one buffer: no intermediate value tree, no per-token allocation, so an 8k-token
//! `BlockStored` costs one pass over its ids.
//!
//! Over 600 lines: both wire layouts (map and legacy array) of every event kind stand side by side,
//! so a field added to one is seen beside the other, with the byte-for-byte tests against vLLM's
//! encoding.

use crate::events::{EventBatch, KvEvent};
use crate::lora::Adapter;

/// Which event encoding to emit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Events as msgpack maps with a `"type"` key (vLLM after PR #42892, SGLang newer).
    Current,
    /// Events as tagged arrays, every field present (vLLM before PR #42892, e.g. 0.23).
    Legacy,
}

/// How replayed batches are framed on the ROUTER socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayFraming {
    /// `topic` for the current layout, `plain` for legacy (what vLLM of each generation does).
    Auto,
    /// `[topic, seq, payload]`, end marker `["", -1, ""]` (vLLM ≥ 0.26).
    Topic,
    /// `[seq, payload]`, end marker `[-1, ""]` (vLLM ≤ 0.25).
    Plain,
}

impl ReplayFraming {
    /// Resolves `Auto` for `layout`.
    pub fn resolve(self, layout: Layout) -> Self {
        match (self, layout) {
            (Self::Auto, Layout::Current) => Self::Topic,
            (Self::Auto, Layout::Legacy) => Self::Plain,
            (other, _) => other,
        }
    }
}

/// The storage medium of the GPU pool's blocks.
pub const MEDIUM_GPU: &str = "GPU";

/// The storage medium of the CPU offload tier's blocks (vLLM's `MEDIUM_CPU`).
pub const MEDIUM_CPU: &str = "CPU";

/// `kv_cache_spec_kind` of the offload tier's stores: the one full-attention group simulated
/// (vLLM's `KVCacheSpecKind.FULL_ATTENTION`).
pub const KIND_FULL_ATTENTION: &str = "full_attention";

/// `kv_cache_spec_kind` of a hybrid model's sliding-window group (`crate::window`; vLLM's
/// `KVCacheSpecKind.SLIDING_WINDOW`).
pub const KIND_SLIDING_WINDOW: &str = "sliding_window";

/// The replay end marker's sequence bytes: `(-1).to_bytes(8, "big", signed=True)`.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// Encoding failed (only possible if the writer fails; a `Vec` never does).
#[derive(Debug, thiserror::Error)]
#[error("msgpack encoding: {0}")]
pub struct WireError(String);

trait Wire<T> {
    fn wire(self) -> Result<T, WireError>;
}

impl<T, E: std::fmt::Display> Wire<T> for Result<T, E> {
    fn wire(self) -> Result<T, WireError> {
        self.map_err(|e| WireError(e.to_string()))
    }
}

/// Encodes `batch` as vLLM's `KVEventBatch` payload for data-parallel rank `dp_rank`.
pub fn encode_batch(
    batch: &EventBatch,
    dp_rank: u32,
    layout: Layout,
) -> Result<Vec<u8>, WireError> {
    let cap = 32 + batch.events.iter().map(encoded_size).sum::<usize>();
    let mut w = Vec::with_capacity(cap);
    rmp::encode::write_array_len(&mut w, 3).wire()?;
    rmp::encode::write_f64(&mut w, batch.ts).wire()?;
    rmp::encode::write_array_len(&mut w, len32(batch.events.len())?).wire()?;
    for e in &batch.events {
        match layout {
            Layout::Current => encode_map_event(&mut w, e)?,
            Layout::Legacy => encode_array_event(&mut w, e)?,
        }
    }
    rmp::encode::write_uint(&mut w, u64::from(dp_rank)).wire()?;
    Ok(w)
}

/// About the bytes `e` encodes to (the buffer's initial capacity).
fn encoded_size(e: &KvEvent) -> usize {
    match e {
        KvEvent::BlockStored { block_hashes, token_ids, lora, extra_keys, .. } => {
            96 + 9 * block_hashes.len()
                + 5 * token_ids.len()
                + lora.as_ref().map_or(0, |a| 8 + a.name.len())
                + extra_keys.iter().flatten().flatten().map(|(id, _)| 16 + id.len()).sum::<usize>()
        }
        KvEvent::BlockRemoved { block_hashes } => 48 + 9 * block_hashes.len(),
        KvEvent::AllBlocksCleared => 24,
        KvEvent::OffloadStored { token_ids, lora, .. } => {
            160 + 5 * token_ids.len() + lora.as_ref().map_or(0, |a| 8 + a.name.len())
        }
        KvEvent::OffloadRemoved { block_hashes } => 64 + 9 * block_hashes.len(),
        KvEvent::Grouped { event, .. } => 80 + encoded_size(event),
    }
}

fn len32(n: usize) -> Result<u32, WireError> {
    u32::try_from(n)
        .map_err(|_| WireError(format!("array of {n} elements is too long for msgpack")))
}

fn encode_map_event(w: &mut Vec<u8>, e: &KvEvent) -> Result<(), WireError> {
    match e {
        KvEvent::BlockStored { .. } | KvEvent::BlockRemoved { .. } => map_gpu_event(w, e, None)?,
        KvEvent::Grouped { group_idx, sliding_window, event } => {
            map_gpu_event(w, event, Some((*group_idx, *sliding_window)))?
        }
        KvEvent::AllBlocksCleared => {
            rmp::encode::write_map_len(w, 1).wire()?;
            key_str(w, "type", "AllBlocksCleared")?;
        }
        KvEvent::OffloadStored { block_hash, parent_block_hash, token_ids, block_size, lora } => {
            // vLLM's offloading tracker's store, `omit_defaults`: extra_keys, the sliding
            // window, locality, ownership and session_id are None (left out); group_idx 0 and
            // the spec kind are set.
            let store = Store {
                block_hashes: &[*block_hash],
                parent: *parent_block_hash,
                token_ids,
                block_size: *block_size,
                lora: lora.as_ref(),
            };
            map_store_head(w, 10, &store, MEDIUM_CPU)?;
            rmp::encode::write_str(w, "group_idx").wire()?;
            rmp::encode::write_uint(w, 0).wire()?;
            key_str(w, "kv_cache_spec_kind", KIND_FULL_ATTENTION)?;
        }
        KvEvent::OffloadRemoved { block_hashes } => {
            rmp::encode::write_map_len(w, 4).wire()?;
            key_str(w, "type", "BlockRemoved")?;
            rmp::encode::write_str(w, "block_hashes").wire()?;
            hashes(w, block_hashes)?;
            key_str(w, "medium", MEDIUM_CPU)?;
            rmp::encode::write_str(w, "group_idx").wire()?;
            rmp::encode::write_uint(w, 0).wire()?;
        }
    }
    Ok(())
}

/// The fields every `BlockStored` carries, GPU or offload tier.
struct Store<'a> {
    block_hashes: &'a [u64],
    parent: Option<u64>,
    token_ids: &'a [u32],
    block_size: u32,
    lora: Option<&'a Adapter>,
}

/// A `BlockStored` map of `fields` entries, up to `lora_name`: the fields without a default
/// (always present, possibly nil) in vLLM's declaration order; the caller adds the rest.
fn map_store_head(
    w: &mut Vec<u8>,
    fields: u32,
    store: &Store<'_>,
    medium: &str,
) -> Result<(), WireError> {
    rmp::encode::write_map_len(w, fields).wire()?;
    key_str(w, "type", "BlockStored")?;
    rmp::encode::write_str(w, "block_hashes").wire()?;
    hashes(w, store.block_hashes)?;
    rmp::encode::write_str(w, "parent_block_hash").wire()?;
    opt_u64(w, store.parent)?;
    rmp::encode::write_str(w, "token_ids").wire()?;
    tokens(w, store.token_ids)?;
    rmp::encode::write_str(w, "block_size").wire()?;
    rmp::encode::write_uint(w, u64::from(store.block_size)).wire()?;
    rmp::encode::write_str(w, "lora_id").wire()?;
    lora_id(w, store.lora)?;
    key_str(w, "medium", medium)?;
    rmp::encode::write_str(w, "lora_name").wire()?;
    lora_name(w, store.lora)
}

/// A GPU pool's `BlockStored` / `BlockRemoved` as a map; with `group` = (group_idx, window), a
/// sliding-window group's: `group_idx`, and on a store the group's spec (vLLM's KV cache manager
/// annotates stores only). `omit_defaults`: the other defaulted fields are left out.
fn map_gpu_event(w: &mut Vec<u8>, e: &KvEvent, group: Option<(u32, u32)>) -> Result<(), WireError> {
    let extra = u32::from(group.is_some());
    match e {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora,
            extra_keys,
        } => {
            // `omit_defaults`: `extra_keys` only when some block has keys.
            let with_keys = !extra_keys.is_empty();
            let store = Store {
                block_hashes,
                parent: *parent_block_hash,
                token_ids,
                block_size: *block_size,
                lora: lora.as_ref(),
            };
            map_store_head(w, 8 + u32::from(with_keys) + 3 * extra, &store, MEDIUM_GPU)?;
            if with_keys {
                rmp::encode::write_str(w, "extra_keys").wire()?;
                keys(w, extra_keys)?;
            }
            if let Some((group_idx, window)) = group {
                rmp::encode::write_str(w, "group_idx").wire()?;
                rmp::encode::write_uint(w, u64::from(group_idx)).wire()?;
                key_str(w, "kv_cache_spec_kind", KIND_SLIDING_WINDOW)?;
                rmp::encode::write_str(w, "kv_cache_spec_sliding_window").wire()?;
                rmp::encode::write_uint(w, u64::from(window)).wire()?;
            }
        }
        KvEvent::BlockRemoved { block_hashes } => {
            rmp::encode::write_map_len(w, 3 + extra).wire()?;
            key_str(w, "type", "BlockRemoved")?;
            rmp::encode::write_str(w, "block_hashes").wire()?;
            hashes(w, block_hashes)?;
            key_str(w, "medium", MEDIUM_GPU)?;
            if let Some((group_idx, _)) = group {
                rmp::encode::write_str(w, "group_idx").wire()?;
                rmp::encode::write_uint(w, u64::from(group_idx)).wire()?;
            }
        }
        // Only the GPU pool's stores and removals are grouped (`crate::window`).
        other => encode_map_event(w, other)?,
    }
    Ok(())
}

/// [`map_gpu_event`] as a legacy tagged array: every field, nil where unset.
fn array_gpu_event(
    w: &mut Vec<u8>,
    e: &KvEvent,
    group: Option<(u32, u32)>,
) -> Result<(), WireError> {
    match e {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora,
            extra_keys,
        } => {
            // tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name,
            // extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
            rmp::encode::write_array_len(w, 12).wire()?;
            rmp::encode::write_str(w, "BlockStored").wire()?;
            hashes(w, block_hashes)?;
            opt_u64(w, *parent_block_hash)?;
            tokens(w, token_ids)?;
            rmp::encode::write_uint(w, u64::from(*block_size)).wire()?;
            lora_id(w, lora.as_ref())?;
            rmp::encode::write_str(w, MEDIUM_GPU).wire()?;
            lora_name(w, lora.as_ref())?;
            if extra_keys.is_empty() {
                rmp::encode::write_nil(w).wire()?;
            } else {
                keys(w, extra_keys)?;
            }
            match group {
                Some((group_idx, window)) => {
                    rmp::encode::write_uint(w, u64::from(group_idx)).wire()?;
                    rmp::encode::write_str(w, KIND_SLIDING_WINDOW).wire()?;
                    rmp::encode::write_uint(w, u64::from(window)).wire()?;
                }
                None => {
                    for _ in 0..3 {
                        rmp::encode::write_nil(w).wire()?;
                    }
                }
            }
        }
        KvEvent::BlockRemoved { block_hashes } => {
            // tag, block_hashes, medium, group_idx
            rmp::encode::write_array_len(w, 4).wire()?;
            rmp::encode::write_str(w, "BlockRemoved").wire()?;
            hashes(w, block_hashes)?;
            rmp::encode::write_str(w, MEDIUM_GPU).wire()?;
            match group {
                Some((group_idx, _)) => {
                    rmp::encode::write_uint(w, u64::from(group_idx)).map(|_| ()).wire()?
                }
                None => rmp::encode::write_nil(w).wire()?,
            }
        }
        other => encode_array_event(w, other)?,
    }
    Ok(())
}

fn encode_array_event(w: &mut Vec<u8>, e: &KvEvent) -> Result<(), WireError> {
    match e {
        KvEvent::BlockStored { .. } | KvEvent::BlockRemoved { .. } => array_gpu_event(w, e, None)?,
        KvEvent::Grouped { group_idx, sliding_window, event } => {
            array_gpu_event(w, event, Some((*group_idx, *sliding_window)))?
        }
        KvEvent::AllBlocksCleared => {
            rmp::encode::write_array_len(w, 1).wire()?;
            rmp::encode::write_str(w, "AllBlocksCleared").wire()?;
        }
        KvEvent::OffloadStored { block_hash, parent_block_hash, token_ids, block_size, lora } => {
            rmp::encode::write_array_len(w, 12).wire()?;
            rmp::encode::write_str(w, "BlockStored").wire()?;
            hashes(w, &[*block_hash])?;
            opt_u64(w, *parent_block_hash)?;
            tokens(w, token_ids)?;
            rmp::encode::write_uint(w, u64::from(*block_size)).wire()?;
            lora_id(w, lora.as_ref())?;
            rmp::encode::write_str(w, MEDIUM_CPU).wire()?;
            lora_name(w, lora.as_ref())?;
            rmp::encode::write_nil(w).wire()?; // extra_keys
            rmp::encode::write_uint(w, 0).wire()?; // group_idx
            rmp::encode::write_str(w, KIND_FULL_ATTENTION).wire()?;
            rmp::encode::write_nil(w).wire()?; // kv_cache_spec_sliding_window
        }
        KvEvent::OffloadRemoved { block_hashes } => {
            rmp::encode::write_array_len(w, 4).wire()?;
            rmp::encode::write_str(w, "BlockRemoved").wire()?;
            hashes(w, block_hashes)?;
            rmp::encode::write_str(w, MEDIUM_CPU).wire()?;
            rmp::encode::write_uint(w, 0).wire()?;
        }
    }
    Ok(())
}

/// vLLM's `lora_id` (`lora_request.adapter_id`, the adapter's int id), nil for the base model.
fn lora_id(w: &mut Vec<u8>, lora: Option<&Adapter>) -> Result<(), WireError> {
    match lora {
        Some(a) => rmp::encode::write_uint(w, u64::from(a.id)).map(|_| ()).wire(),
        None => rmp::encode::write_nil(w).wire(),
    }
}

/// vLLM's `lora_name`, nil for the base model.
fn lora_name(w: &mut Vec<u8>, lora: Option<&Adapter>) -> Result<(), WireError> {
    match lora {
        Some(a) => rmp::encode::write_str(w, &a.name).wire(),
        None => rmp::encode::write_nil(w).wire(),
    }
}

/// vLLM's `extra_keys` (`to_event_extra_keys`): per block nil or a tuple of its keys, here the
/// media pairs `[identifier, offset]`.
fn keys(w: &mut Vec<u8>, blocks: &[Option<crate::media::BlockKeys>]) -> Result<(), WireError> {
    rmp::encode::write_array_len(w, len32(blocks.len())?).wire()?;
    for block in blocks {
        let Some(block) = block else {
            rmp::encode::write_nil(w).wire()?;
            continue;
        };
        rmp::encode::write_array_len(w, len32(block.len())?).wire()?;
        for (identifier, offset) in block {
            rmp::encode::write_array_len(w, 2).wire()?;
            rmp::encode::write_str(w, identifier).wire()?;
            rmp::encode::write_sint(w, *offset).wire()?;
        }
    }
    Ok(())
}

fn key_str(w: &mut Vec<u8>, key: &str, value: &str) -> Result<(), WireError> {
    rmp::encode::write_str(w, key).wire()?;
    rmp::encode::write_str(w, value).wire()
}

fn hashes(w: &mut Vec<u8>, hs: &[u64]) -> Result<(), WireError> {
    rmp::encode::write_array_len(w, len32(hs.len())?).wire()?;
    for &h in hs {
        // Unsigned, as vLLM publishes (values above i64::MAX stay positive).
        put_uint(w, h);
    }
    Ok(())
}

fn tokens(w: &mut Vec<u8>, ts: &[u32]) -> Result<(), WireError> {
    rmp::encode::write_array_len(w, len32(ts.len())?).wire()?;
    // The per-token loop of every BlockStored: write into a sized slice (at most 5 bytes per
    // id) instead of growing the vector id by id.
    let start = w.len();
    w.resize(start + ts.len() * 5, 0);
    let buf = &mut w[start..];
    let mut n = 0;
    for &t in ts {
        if t < 128 {
            buf[n] = t as u8;
            n += 1;
        } else if t <= 0xff {
            buf[n] = 0xcc;
            buf[n + 1] = t as u8;
            n += 2;
        } else if t <= 0xffff {
            buf[n] = 0xcd;
            buf[n + 1..n + 3].copy_from_slice(&(t as u16).to_be_bytes());
            n += 3;
        } else {
            buf[n] = 0xce;
            buf[n + 1..n + 5].copy_from_slice(&t.to_be_bytes());
            n += 5;
        }
    }
    w.truncate(start + n);
    Ok(())
}

/// msgpack's smallest unsigned encoding (what `rmp::encode::write_uint` writes), inlined for the
/// per-token loop.
#[inline]
fn put_uint(w: &mut Vec<u8>, v: u64) {
    if v < 128 {
        w.push(v as u8);
    } else if v <= 0xff {
        w.extend_from_slice(&[0xcc, v as u8]);
    } else if v <= 0xffff {
        w.push(0xcd);
        w.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= 0xffff_ffff {
        w.push(0xce);
        w.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        w.push(0xcf);
        w.extend_from_slice(&v.to_be_bytes());
    }
}

fn opt_u64(w: &mut Vec<u8>, v: Option<u64>) -> Result<(), WireError> {
    match v {
        Some(v) => rmp::encode::write_uint(w, v).map(|_| ()).wire(),
        None => rmp::encode::write_nil(w).wire(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    fn decode(bytes: &[u8]) -> Value {
        rmpv::decode::read_value(&mut &bytes[..]).unwrap()
    }

    fn batch() -> EventBatch {
        EventBatch {
            ts: 1.5,
            events: vec![
                KvEvent::BlockStored {
                    block_hashes: vec![u64::MAX - 1, 7],
                    parent_block_hash: None,
                    token_ids: vec![1, 2, 3, 4, 5, 6, 7, 8],
                    block_size: 4,
                    lora: None,
                    extra_keys: Vec::new(),
                },
                KvEvent::BlockRemoved { block_hashes: vec![9] },
                KvEvent::AllBlocksCleared,
                KvEvent::BlockStored {
                    block_hashes: vec![11],
                    parent_block_hash: Some(7),
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 4,
                    lora: Some(Adapter { id: 3, name: "sql".into() }),
                    extra_keys: Vec::new(),
                },
            ],
        }
    }

    fn get<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
        map.as_map()?.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
    }

    #[test]
    fn current_layout_is_tagged_maps_in_a_positional_batch() {
        let v = decode(&encode_batch(&batch(), 3, Layout::Current).unwrap());
        let top = v.as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0].as_f64(), Some(1.5));
        assert_eq!(top[2].as_u64(), Some(3));
        let evs = top[1].as_array().unwrap();
        let stored = &evs[0];
        assert_eq!(stored.as_map().unwrap().len(), 8);
        assert_eq!(get(stored, "type").and_then(Value::as_str), Some("BlockStored"));
        let hs: Vec<u64> = get(stored, "block_hashes")
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        assert_eq!(hs, [u64::MAX - 1, 7]);
        assert!(get(stored, "parent_block_hash").unwrap().is_nil());
        assert_eq!(get(stored, "token_ids").unwrap().as_array().unwrap().len(), 8);
        assert_eq!(get(stored, "block_size").and_then(Value::as_u64), Some(4));
        assert!(get(stored, "lora_id").unwrap().is_nil());
        assert!(get(stored, "lora_name").unwrap().is_nil());
        assert_eq!(get(stored, "medium").and_then(Value::as_str), Some("GPU"));
        assert_eq!(get(&evs[1], "type").and_then(Value::as_str), Some("BlockRemoved"));
        assert_eq!(get(&evs[1], "medium").and_then(Value::as_str), Some("GPU"));
        assert_eq!(evs[2].as_map().unwrap().len(), 1);
        assert_eq!(get(&evs[2], "type").and_then(Value::as_str), Some("AllBlocksCleared"));
        let adapter = &evs[3];
        assert_eq!(adapter.as_map().unwrap().len(), 8);
        assert_eq!(get(adapter, "lora_id").and_then(Value::as_u64), Some(3));
        assert_eq!(get(adapter, "lora_name").and_then(Value::as_str), Some("sql"));
        assert_eq!(get(adapter, "parent_block_hash").and_then(Value::as_u64), Some(7));
    }

    #[test]
    fn legacy_layout_is_tagged_arrays_padded_with_nil() {
        let v = decode(&encode_batch(&batch(), 0, Layout::Legacy).unwrap());
        let top = v.as_array().unwrap();
        assert_eq!(top[2].as_u64(), Some(0));
        let evs = top[1].as_array().unwrap();
        let stored = evs[0].as_array().unwrap();
        assert_eq!(stored.len(), 12);
        assert_eq!(stored[0].as_str(), Some("BlockStored"));
        assert_eq!(stored[1].as_array().unwrap()[0].as_u64(), Some(u64::MAX - 1));
        assert!(stored[2].is_nil());
        assert_eq!(stored[3].as_array().unwrap()[7].as_u64(), Some(8));
        assert_eq!(stored[4].as_u64(), Some(4));
        assert!(stored[5].is_nil());
        assert_eq!(stored[6].as_str(), Some("GPU"));
        assert!(stored[7..].iter().all(Value::is_nil));
        let removed = evs[1].as_array().unwrap();
        assert_eq!(
            (removed.len(), removed[0].as_str(), removed[2].as_str()),
            (4, Some("BlockRemoved"), Some("GPU"))
        );
        assert_eq!(evs[2].as_array().unwrap().len(), 1);
        let adapter = evs[3].as_array().unwrap();
        assert_eq!(adapter.len(), 12);
        assert_eq!((adapter[5].as_u64(), adapter[6].as_str()), (Some(3), Some("GPU")));
        assert_eq!(adapter[7].as_str(), Some("sql"));
        assert!(adapter[8..].iter().all(Value::is_nil));
    }

    #[test]
    fn offload_events_are_vllms_self_describing_cpu_events() {
        let b = EventBatch {
            ts: 2.0,
            events: vec![
                KvEvent::OffloadRemoved { block_hashes: vec![5, 6] },
                KvEvent::OffloadStored {
                    block_hash: 9,
                    parent_block_hash: Some(8),
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 4,
                    lora: Some(Adapter { id: 2, name: "sql".into() }),
                },
            ],
        };
        // Byte for byte what vLLM 0.32's own classes encode for these events (`KVEventBatch`,
        // `BlockRemoved(block_hashes=[5, 6], medium=MEDIUM_CPU, group_idx=0)`, `BlockStored(…,
        // medium=MEDIUM_CPU, group_idx=0, kv_cache_spec_kind="full_attention")` as the
        // offloading connector's tracker fills them; `msgspec.msgpack.encode(batch).hex()` in
        // .tools/vllm's venv).
        const VLLM: &str = "93cb40000000000000009284a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573920506a66d656469756da3435055a967726f75705f696478008aa474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739109b1706172656e745f626c6f636b5f6861736808a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6504a76c6f72615f696402a66d656469756da3435055a96c6f72615f6e616d65a373716ca967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00";
        let bytes = encode_batch(&b, 0, Layout::Current).unwrap();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, VLLM);
        let v = decode(&bytes);
        let evs = v.as_array().unwrap()[1].as_array().unwrap();
        let removed = &evs[0];
        assert_eq!(removed.as_map().unwrap().len(), 4);
        assert_eq!(get(removed, "type").and_then(Value::as_str), Some("BlockRemoved"));
        assert_eq!(get(removed, "medium").and_then(Value::as_str), Some("CPU"));
        assert_eq!(get(removed, "group_idx").and_then(Value::as_u64), Some(0));
        let stored = &evs[1];
        assert_eq!(stored.as_map().unwrap().len(), 10);
        assert_eq!(get(stored, "medium").and_then(Value::as_str), Some("CPU"));
        assert_eq!(get(stored, "group_idx").and_then(Value::as_u64), Some(0));
        assert_eq!(
            get(stored, "kv_cache_spec_kind").and_then(Value::as_str),
            Some("full_attention")
        );
        assert_eq!(get(stored, "parent_block_hash").and_then(Value::as_u64), Some(8));
        assert_eq!(get(stored, "block_size").and_then(Value::as_u64), Some(4));
        assert_eq!(get(stored, "lora_name").and_then(Value::as_str), Some("sql"));
        let hs = get(stored, "block_hashes").unwrap().as_array().unwrap();
        assert_eq!((hs.len(), hs[0].as_u64()), (1, Some(9)));
        let v = decode(&encode_batch(&b, 0, Layout::Legacy).unwrap());
        let evs = v.as_array().unwrap()[1].as_array().unwrap();
        let removed = evs[0].as_array().unwrap();
        assert_eq!(
            (removed.len(), removed[2].as_str(), removed[3].as_u64()),
            (4, Some("CPU"), Some(0))
        );
        let stored = evs[1].as_array().unwrap();
        assert_eq!(stored.len(), 12);
        assert_eq!((stored[6].as_str(), stored[9].as_u64()), (Some("CPU"), Some(0)));
        assert_eq!(stored[10].as_str(), Some("full_attention"));
        assert!(stored[8].is_nil() && stored[11].is_nil());
    }

    #[test]
    fn window_group_events_carry_vllms_group_fields() {
        let grouped =
            |event| KvEvent::Grouped { group_idx: 1, sliding_window: 64, event: Box::new(event) };
        let b = EventBatch {
            ts: 3.0,
            events: vec![
                grouped(KvEvent::BlockStored {
                    block_hashes: vec![21, 22],
                    parent_block_hash: Some(20),
                    token_ids: (1..=8).collect(),
                    block_size: 4,
                    lora: None,
                    extra_keys: Vec::new(),
                }),
                grouped(KvEvent::BlockRemoved { block_hashes: vec![21] }),
            ],
        };
        // Byte for byte what vLLM 0.32's own classes encode (`BlockStored(…, medium=MEDIUM_GPU,
        // group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=64)` as
        // its KV cache manager annotates group 1's stores, `BlockRemoved(block_hashes=[21],
        // medium=MEDIUM_GPU, group_idx=1)`; `msgspec.msgpack.encode(batch).hex()` in .tools/vllm's
        // venv).
        const VLLM: &str = "93cb4008000000000000928ba474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573921516b1706172656e745f626c6f636b5f6861736814a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647801b26b765f63616368655f737065635f6b696e64ae736c6964696e675f77696e646f77bc6b765f63616368655f737065635f736c6964696e675f77696e646f774084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739115a66d656469756da3475055a967726f75705f6964780100";
        let bytes = encode_batch(&b, 0, Layout::Current).unwrap();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, VLLM);
        let v = decode(&encode_batch(&b, 0, Layout::Legacy).unwrap());
        let evs = v.as_array().unwrap()[1].as_array().unwrap();
        let stored = evs[0].as_array().unwrap();
        assert_eq!(stored.len(), 12);
        assert_eq!((stored[6].as_str(), stored[9].as_u64()), (Some("GPU"), Some(1)));
        assert_eq!((stored[10].as_str(), stored[11].as_u64()), (Some("sliding_window"), Some(64)));
        let removed = evs[1].as_array().unwrap();
        assert_eq!((removed.len(), removed[3].as_u64()), (4, Some(1)));
    }

    #[test]
    fn parent_hash_is_an_unsigned_integer() {
        let b = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored {
                block_hashes: vec![1],
                parent_block_hash: Some(u64::MAX),
                token_ids: vec![0],
                block_size: 1,
                lora: None,
                extra_keys: Vec::new(),
            }],
        };
        let v = decode(&encode_batch(&b, 0, Layout::Legacy).unwrap());
        assert_eq!(
            v.as_array().unwrap()[1].as_array().unwrap()[0].as_array().unwrap()[2].as_u64(),
            Some(u64::MAX)
        );
    }

    #[test]
    fn token_lists_match_rmp() {
        let ts: Vec<u32> = vec![0, 1, 127, 128, 255, 256, 65_535, 65_536, u32::MAX, 7];
        let mut a = Vec::new();
        tokens(&mut a, &ts).unwrap();
        let mut b = Vec::new();
        rmp::encode::write_array_len(&mut b, ts.len() as u32).unwrap();
        for &t in &ts {
            rmp::encode::write_uint(&mut b, u64::from(t)).unwrap();
        }
        assert_eq!(a, b);
    }

    #[test]
    fn put_uint_matches_rmp() {
        for v in [0, 1, 127, 128, 255, 256, 65_535, 65_536, 0xffff_ffff, 0x1_0000_0000, u64::MAX] {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            put_uint(&mut a, v);
            rmp::encode::write_uint(&mut b, v).unwrap();
            assert_eq!(a, b, "{v}");
        }
    }

    #[test]
    fn auto_framing_follows_the_layout() {
        assert_eq!(ReplayFraming::Auto.resolve(Layout::Current), ReplayFraming::Topic);
        assert_eq!(ReplayFraming::Auto.resolve(Layout::Legacy), ReplayFraming::Plain);
        assert_eq!(ReplayFraming::Plain.resolve(Layout::Current), ReplayFraming::Plain);
    }
}
