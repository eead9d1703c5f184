//! Decoding vLLM / SGLang KV event batches (msgpack) into typed events.
//!
//! Two generations share the wire: events as tagged arrays `["BlockStored", f1, f2, …]` (vLLM before
//! PR #42892, older SGLang) and as maps with a `"type"` key (current vLLM). Fields were only ever
//! appended, so arrays are read by position and anything past the known fields is ignored; maps are
//! read by name and unknown keys ignored. Hashes arrive as unsigned u64 (possibly above i64::MAX),
//! signed i64 (SGLang, older vLLM) or raw digest bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`);
//! all become a u64: integers bit-for-bit, bytes as their last 8 bytes big-endian (vLLM's rule).
//! The batch is `[ts, events, dp_rank]`, `[ts, events]` (v0.9) or a map with those names.
//! Decoding is pure: bytes in, [`EventBatch`] or a typed [`DecodeError`] out.

use rmpv::Value;

/// One decoded `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Engine wall-clock time of the batch (seconds since the epoch).
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub dp_rank: Option<u32>,
}

/// One KV cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Newly cached full blocks of one request, chained after `parent`.
    Stored {
        block_hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_name: Option<String>,
        /// Not a vLLM field; read when a publisher sends it (Dynamo's wire has it).
        cache_salt: Option<String>,
        /// `"GPU"` (or absent) for device memory; offload tiers name others.
        medium: Option<String>,
        /// KV cache group (hybrid models); absent or 0 for the main group.
        group_idx: Option<u32>,
    },
    /// Blocks evicted from the cache.
    Removed { block_hashes: Vec<u64>, medium: Option<String>, group_idx: Option<u32> },
    /// `reset_prefix_cache`: everything is gone.
    Cleared,
    /// A tag this decoder does not know (newer engines); counted and skipped.
    Unknown { tag: String },
}

impl KvEvent {
    /// The metric label of the event type.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Stored { .. } => "stored",
            Self::Removed { .. } => "removed",
            Self::Cleared => "cleared",
            Self::Unknown { .. } => "unknown",
        }
    }
}

/// Why a payload is not a batch.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("batch: {0}")]
    Batch(&'static str),
    #[error("{event}.{field}: {reason}")]
    Field { event: &'static str, field: &'static str, reason: &'static str },
}

/// Decodes one PUB payload (or one replayed payload).
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut cursor = payload;
    let value = rmpv::decode::read_value(&mut cursor).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    let (ts, events, rank) = match &value {
        Value::Array(items) => (items.first(), items.get(1), items.get(2)),
        Value::Map(_) => (get(&value, "ts"), get(&value, "events"), get(&value, "data_parallel_rank")),
        _ => return Err(DecodeError::Batch("not an array or map")),
    };
    let ts = match ts {
        Some(Value::F64(f)) => *f,
        Some(Value::F32(f)) => f64::from(*f),
        Some(v) if v.as_i64().is_some() => v.as_i64().unwrap_or(0) as f64,
        _ => return Err(DecodeError::Batch("ts must be a number")),
    };
    let Some(Value::Array(raw_events)) = events else { return Err(DecodeError::Batch("events must be an array")) };
    let dp_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(v) => Some(v.as_u64().and_then(|r| u32::try_from(r).ok()).ok_or(DecodeError::Batch("dp rank must be an integer"))?),
    };
    let events = raw_events.iter().map(decode_event).collect::<Result<Vec<_>, _>>()?;
    Ok(EventBatch { ts, events, dp_rank })
}

fn get<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
    match map {
        Value::Map(pairs) => pairs.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v),
        _ => None,
    }
}

/// Field access for both layouts: by position (after the tag) in arrays, by name in maps.
struct Fields<'a> {
    value: &'a Value,
    event: &'static str,
}

impl<'a> Fields<'a> {
    fn field(&self, position: usize, name: &str) -> Option<&'a Value> {
        let v = match self.value {
            Value::Array(items) => items.get(position + 1),
            _ => get(self.value, name),
        };
        v.filter(|v| !v.is_nil())
    }

    fn err(&self, field: &'static str, reason: &'static str) -> DecodeError {
        DecodeError::Field { event: self.event, field, reason }
    }

    fn hashes(&self, position: usize, field: &'static str) -> Result<Vec<u64>, DecodeError> {
        match self.field(position, field) {
            Some(Value::Array(items)) => {
                items.iter().map(|h| hash(h).ok_or_else(|| self.err(field, "hash must be an integer or bytes"))).collect()
            }
            _ => Err(self.err(field, "must be an array")),
        }
    }

    fn opt_string(&self, position: usize, field: &'static str) -> Option<String> {
        self.field(position, field).and_then(Value::as_str).map(str::to_owned)
    }

    fn opt_u32(&self, position: usize, field: &'static str) -> Result<Option<u32>, DecodeError> {
        match self.field(position, field) {
            None => Ok(None),
            Some(v) => v.as_u64().and_then(|n| u32::try_from(n).ok()).map(Some).ok_or_else(|| self.err(field, "must be a small integer")),
        }
    }
}

/// A block hash as u64: integers bit-for-bit (signed ones reinterpreted), bytes by their last 8
/// bytes big-endian (shorter byte strings left-padded with zeros).
pub fn hash(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|s| s as u64)),
        Value::Binary(b) => {
            let tail = &b[b.len().saturating_sub(8)..];
            let mut buf = [0u8; 8];
            buf[8 - tail.len()..].copy_from_slice(tail);
            Some(u64::from_be_bytes(buf))
        }
        _ => None,
    }
}

fn decode_event(v: &Value) -> Result<KvEvent, DecodeError> {
    let tag = match v {
        Value::Array(items) => items.first().and_then(Value::as_str),
        Value::Map(_) => get(v, "type").and_then(Value::as_str),
        _ => None,
    }
    .ok_or(DecodeError::Batch("event without a type tag"))?;
    match tag {
        "BlockStored" => {
            let f = Fields { value: v, event: "BlockStored" };
            let block_hashes = f.hashes(0, "block_hashes")?;
            let parent = match f.field(1, "parent_block_hash") {
                None => None,
                Some(p) => Some(hash(p).ok_or_else(|| f.err("parent_block_hash", "must be an integer or bytes"))?),
            };
            let token_ids = match f.field(2, "token_ids") {
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| f.err("token_ids", "must be token ids in 0..2^32"))?,
                _ => return Err(f.err("token_ids", "must be an array")),
            };
            let block_size = f.opt_u32(3, "block_size")?.ok_or_else(|| f.err("block_size", "is required"))?;
            // Positions after the tag: 4 lora_id, 5 medium, 6 lora_name, 7 extra_keys, 8 group_idx.
            Ok(KvEvent::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size,
                medium: f.opt_string(5, "medium"),
                lora_name: f.opt_string(6, "lora_name"),
                cache_salt: get(v, "cache_salt").and_then(Value::as_str).map(str::to_owned),
                group_idx: f.opt_u32(8, "group_idx")?,
            })
        }
        "BlockRemoved" => {
            let f = Fields { value: v, event: "BlockRemoved" };
            Ok(KvEvent::Removed {
                block_hashes: f.hashes(0, "block_hashes")?,
                medium: f.opt_string(1, "medium"),
                group_idx: f.opt_u32(2, "group_idx")?,
            })
        }
        "AllBlocksCleared" => Ok(KvEvent::Cleared),
        other => Ok(KvEvent::Unknown { tag: other.to_owned() }),
    }
}

#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;
