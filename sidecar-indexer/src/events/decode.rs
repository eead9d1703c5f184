//! Decoding vLLM / SGLang KV event batches (msgpack) into typed events.
//!
//! Two generations share the wire: events as tagged arrays `["BlockStored", f1, f2, …]` (vLLM before
//! PR #42892, older SGLang) and as maps with a `"type"` key (current vLLM). Fields were only ever
//! appended, so arrays are read by position and anything past the known fields is ignored; maps are
//! read by name and unknown keys ignored. Hashes arrive as unsigned u64 (possibly above i64::MAX),
//! signed i64 (SGLang, older vLLM) or raw digest bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`);
//! all become a u64: integers bit-for-bit, bytes as their last 8 bytes big-endian (vLLM's rule).
//! The batch is `[ts, events, dp_rank]`, `[ts, events]` (v0.9) or a map with those names.
//! Decoding is pure: bytes in, [`EventBatch`] or a typed [`DecodeError`] out. A store's
//! `extra_keys` become per-block seed terms here ([`super::extra_keys`]).
//!
//! Over 600 lines: one streaming msgpack decoder for both event layouts and every field; its oracle
//! tests are in `decode_tests.rs`.

use super::extra_keys::{self, ExtraKeys};
use super::msgpack::{Head, MsgpackError, Reader, MAX_DEPTH};

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
        /// The group's `kv_cache_spec_kind` (`"full_attention"`, `"sliding_window"`, …).
        spec_kind: Option<String>,
        /// The group's `kv_cache_spec_sliding_window` (tokens), for a sliding-window kind.
        sliding_window: Option<u32>,
        /// Per block, the seed term of its `extra_keys` (media keys; `UNUSABLE_TERM` for keys
        /// that cannot be reproduced); empty when no block has such keys ([`super::extra_keys`]).
        extra_terms: Vec<u64>,
    },
    /// Blocks evicted from the cache.
    Removed { block_hashes: Vec<u64>, medium: Option<String>, group_idx: Option<u32> },
    /// `reset_prefix_cache`: everything is gone.
    Cleared,
    /// A tag this decoder does not know (newer engines); counted and skipped.
    Unknown { tag: String },
}

impl EventBatch {
    /// Heap bytes the decoded batch holds (what it costs while queued for the applier).
    pub fn heap_bytes(&self) -> usize {
        let strings = |s: &Option<String>| s.as_ref().map_or(0, String::capacity);
        let events: usize = self
            .events
            .iter()
            .map(|e| match e {
                KvEvent::Stored {
                    block_hashes,
                    token_ids,
                    lora_name,
                    cache_salt,
                    medium,
                    spec_kind,
                    extra_terms,
                    ..
                } => {
                    block_hashes.capacity() * 8
                        + token_ids.capacity() * 4
                        + extra_terms.capacity() * 8
                        + strings(lora_name)
                        + strings(cache_salt)
                        + strings(medium)
                        + strings(spec_kind)
                }
                KvEvent::Removed { block_hashes, medium, .. } => {
                    block_hashes.capacity() * 8 + strings(medium)
                }
                KvEvent::Cleared => 0,
                KvEvent::Unknown { tag } => tag.capacity(),
            })
            .sum();
        self.events.capacity() * std::mem::size_of::<KvEvent>() + events
    }
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
///
/// Straight from the bytes into the event types ([`msgpack::Reader`]), without a value tree. The
/// result equals what reading the payload into an `rmpv::Value` and picking fields from it gives
/// (the previous decoder, kept as the oracle of `decode_tests.rs`), errors included: a payload that
/// is not msgpack anywhere inside its top value is [`DecodeError::Msgpack`] whatever else is wrong;
/// otherwise the first problem in field order (ts, events, dp rank, then each event's fields in
/// declaration order), whatever order a map's keys came in; the first of duplicated keys counts.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut rd = Reader::new(payload);
    match read_batch(&mut rd) {
        Ok(Ok(batch)) => Ok(batch),
        Err(e) => Err(DecodeError::Msgpack(e.to_string())),
        // A field problem: reported only if the whole top value is msgpack.
        Ok(Err(field)) => match Reader::new(payload).skip(MAX_DEPTH) {
            Err(e) => Err(DecodeError::Msgpack(e.to_string())),
            Ok(()) => Err(field),
        },
    }
}

/// Capacity to reserve for `n` announced elements: never more than the bytes left (each element
/// takes at least one) nor a page's worth; the vector grows by doubling past it, so a hostile length
/// cannot make a small frame allocate much (a decoded batch stays within ~2× its element count).
fn prealloc(n: usize, rd: &Reader<'_>) -> usize {
    n.min(rd.remaining()).min(4096)
}

/// A field read in stream order, judged in declaration order later.
type Deferred<T> = Result<T, DecodeError>;

/// Outer error: not msgpack (stop at once). Inner: the batch, or its first field problem.
fn read_batch(rd: &mut Reader<'_>) -> Result<Deferred<EventBatch>, MsgpackError> {
    let (head, child) = rd.head(MAX_DEPTH)?;
    let mut ts: Option<Deferred<f64>> = None;
    let mut events: Option<Deferred<Deferred<Vec<KvEvent>>>> = None;
    let mut rank: Option<Deferred<Option<u32>>> = None;
    match head {
        Head::Array(n) => {
            for i in 0..n {
                match i {
                    0 => ts = Some(read_ts(rd, child)?),
                    1 => events = Some(read_events(rd, child)?),
                    2 => rank = Some(read_rank(rd, child)?),
                    _ => rd.skip(child)?,
                }
            }
        }
        Head::Map(n) => {
            for _ in 0..n {
                match read_key(rd, child)? {
                    Some("ts") if ts.is_none() => ts = Some(read_ts(rd, child)?),
                    Some("events") if events.is_none() => events = Some(read_events(rd, child)?),
                    Some("data_parallel_rank") if rank.is_none() => {
                        rank = Some(read_rank(rd, child)?)
                    }
                    _ => rd.skip(child)?,
                }
            }
        }
        _ => return Ok(Err(DecodeError::Batch("not an array or map"))),
    }
    let assemble = || -> Deferred<EventBatch> {
        let ts = ts.unwrap_or(Err(DecodeError::Batch("ts must be a number")))?;
        let events = events.unwrap_or(Err(DecodeError::Batch("events must be an array")))?;
        let dp_rank = rank.unwrap_or(Ok(None))?;
        Ok(EventBatch { ts, events: events?, dp_rank })
    };
    Ok(assemble())
}

/// A map key: its text when it is a UTF-8 string (other keys are skipped and never match).
fn read_key<'a>(rd: &mut Reader<'a>, depth: u16) -> Result<Option<&'a str>, MsgpackError> {
    let (head, child) = rd.head(depth)?;
    match head {
        Head::Str(b) => Ok(std::str::from_utf8(b).ok()),
        other => {
            rd.skip_rest(other, child)?;
            Ok(None)
        }
    }
}

/// Reads one value that must be a scalar for `f`; containers are skipped and give `f(None)`.
fn scalar<'a, T>(
    rd: &mut Reader<'a>,
    depth: u16,
    f: impl FnOnce(Option<Head<'a>>) -> T,
) -> Result<T, MsgpackError> {
    let (head, child) = rd.head(depth)?;
    match head {
        Head::Array(_) | Head::Map(_) => {
            rd.skip_rest(head, child)?;
            Ok(f(None))
        }
        h => Ok(f(Some(h))),
    }
}

fn read_ts(rd: &mut Reader<'_>, depth: u16) -> Result<Deferred<f64>, MsgpackError> {
    scalar(rd, depth, |h| match h {
        Some(Head::F64(f)) => Ok(f),
        Some(Head::F32(f)) => Ok(f64::from(f)),
        Some(Head::Int(i)) => Ok(i as f64),
        Some(Head::Uint(u)) if i64::try_from(u).is_ok() => Ok(u as f64),
        _ => Err(DecodeError::Batch("ts must be a number")),
    })
}

fn read_rank(rd: &mut Reader<'_>, depth: u16) -> Result<Deferred<Option<u32>>, MsgpackError> {
    scalar(rd, depth, |h| match h {
        Some(Head::Nil) => Ok(None),
        Some(Head::Uint(u)) if u32::try_from(u).is_ok() => Ok(Some(u as u32)),
        _ => Err(DecodeError::Batch("dp rank must be an integer")),
    })
}

/// The events array: outer Deferred = "must be an array", inner = the first bad event.
fn read_events(
    rd: &mut Reader<'_>,
    depth: u16,
) -> Result<Deferred<Deferred<Vec<KvEvent>>>, MsgpackError> {
    let (head, child) = rd.head(depth)?;
    let Head::Array(n) = head else {
        rd.skip_rest(head, child)?;
        return Ok(Err(DecodeError::Batch("events must be an array")));
    };
    let mut out = Vec::with_capacity(prealloc(n, rd));
    let mut first_err = None;
    for _ in 0..n {
        if first_err.is_some() {
            rd.skip(child)?;
            continue;
        }
        match read_event(rd, child)? {
            Ok(e) => out.push(e),
            Err(e) => first_err = Some(e),
        }
    }
    Ok(Ok(first_err.map_or(Ok(out), Err)))
}

/// The fields of one event, each as read (first occurrence), judged when the event is assembled.
#[derive(Default)]
struct RawEvent {
    tag: Option<Option<String>>,
    block_hashes: Option<Deferred<Vec<u64>>>,
    parent: Option<Deferred<Option<u64>>>,
    token_ids: Option<Deferred<Vec<u32>>>,
    block_size: Option<Deferred<Option<u32>>>,
    medium: Option<Option<String>>,
    lora_name: Option<Option<String>>,
    cache_salt: Option<Option<String>>,
    group_idx: Option<Deferred<Option<u32>>>,
    spec_kind: Option<Option<String>>,
    sliding_window: Option<Deferred<Option<u32>>>,
    extra_keys: Option<ExtraKeys>,
}

/// Which field a position (after the tag) or a key names.
#[derive(Clone, Copy)]
enum Field {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    Medium,
    LoraName,
    CacheSalt,
    GroupIdx,
    SpecKind,
    SlidingWindow,
    ExtraKeys,
}

fn field_by_name(name: &str) -> Option<Field> {
    Some(match name {
        "block_hashes" => Field::BlockHashes,
        "parent_block_hash" => Field::Parent,
        "token_ids" => Field::TokenIds,
        "block_size" => Field::BlockSize,
        "medium" => Field::Medium,
        "lora_name" => Field::LoraName,
        "cache_salt" => Field::CacheSalt,
        "group_idx" => Field::GroupIdx,
        "kv_cache_spec_kind" => Field::SpecKind,
        "kv_cache_spec_sliding_window" => Field::SlidingWindow,
        "extra_keys" => Field::ExtraKeys,
        _ => return None,
    })
}

/// Positions after the tag: BlockStored 0 block_hashes, 1 parent, 2 token_ids, 3 block_size,
/// 4 lora_id, 5 medium, 6 lora_name, 7 extra_keys, 8 group_idx, 9 kv_cache_spec_kind,
/// 10 kv_cache_spec_sliding_window; BlockRemoved 0 block_hashes, 1 medium, 2 group_idx.
/// (`cache_salt` is a map-only field.)
fn field_by_position(tag: &str, position: usize) -> Option<Field> {
    match (tag, position) {
        (_, 0) => Some(Field::BlockHashes),
        ("BlockStored", 1) => Some(Field::Parent),
        ("BlockStored", 2) => Some(Field::TokenIds),
        ("BlockStored", 3) => Some(Field::BlockSize),
        ("BlockStored", 5) | ("BlockRemoved", 1) => Some(Field::Medium),
        ("BlockStored", 6) => Some(Field::LoraName),
        ("BlockStored", 7) => Some(Field::ExtraKeys),
        ("BlockStored", 8) | ("BlockRemoved", 2) => Some(Field::GroupIdx),
        ("BlockStored", 9) => Some(Field::SpecKind),
        ("BlockStored", 10) => Some(Field::SlidingWindow),
        _ => None,
    }
}

fn read_event(rd: &mut Reader<'_>, depth: u16) -> Result<Deferred<KvEvent>, MsgpackError> {
    let (head, child) = rd.head(depth)?;
    let mut raw = RawEvent::default();
    match head {
        Head::Array(n) => {
            let mut tag: Option<String> = None;
            for i in 0..n {
                if i == 0 {
                    tag = read_opt_string(rd, child)?;
                    raw.tag = Some(tag.clone());
                    continue;
                }
                match tag.as_deref().and_then(|t| field_by_position(t, i - 1)) {
                    Some(f) => raw.read(f, rd, child)?,
                    None => rd.skip(child)?,
                }
            }
        }
        Head::Map(n) => {
            for _ in 0..n {
                let key = read_key(rd, child)?;
                match key {
                    Some("type") if raw.tag.is_none() => {
                        raw.tag = Some(read_opt_string(rd, child)?)
                    }
                    Some(k) => match field_by_name(k) {
                        Some(f) if !raw.has(f) => raw.read(f, rd, child)?,
                        _ => rd.skip(child)?,
                    },
                    None => rd.skip(child)?,
                }
            }
        }
        other => {
            rd.skip_rest(other, child)?;
        }
    }
    Ok(raw.assemble())
}

/// A string value when it is UTF-8 (anything else, nil included, is none).
fn read_opt_string(rd: &mut Reader<'_>, depth: u16) -> Result<Option<String>, MsgpackError> {
    scalar(rd, depth, |h| match h {
        Some(Head::Str(b)) => std::str::from_utf8(b).ok().map(str::to_owned),
        _ => None,
    })
}

/// An optional small integer: nil is none, anything but an integer in u32 range an error.
fn read_opt_u32(
    rd: &mut Reader<'_>,
    depth: u16,
    event: &'static str,
    field: &'static str,
) -> Result<Deferred<Option<u32>>, MsgpackError> {
    scalar(rd, depth, |h| match h {
        Some(Head::Nil) => Ok(None),
        Some(Head::Uint(u)) if u32::try_from(u).is_ok() => Ok(Some(u as u32)),
        _ => Err(DecodeError::Field { event, field, reason: "must be a small integer" }),
    })
}

/// A block hash from a head: integers bit-for-bit (signed ones reinterpreted), bytes by their
/// last 8 bytes big-endian (shorter byte strings left-padded with zeros).
fn hash_of(head: Head<'_>) -> Option<u64> {
    match head {
        Head::Uint(u) => Some(u),
        Head::Int(i) => Some(i as u64),
        Head::Bin(b) => {
            let tail = &b[b.len().saturating_sub(8)..];
            let mut buf = [0u8; 8];
            buf[8 - tail.len()..].copy_from_slice(tail);
            Some(u64::from_be_bytes(buf))
        }
        _ => None,
    }
}

/// An array whose elements each map through `item` (None = the element is refused).
fn read_array<T>(
    rd: &mut Reader<'_>,
    depth: u16,
    item: impl Fn(Head<'_>) -> Option<T>,
    not_array: DecodeError,
    bad_item: DecodeError,
) -> Result<Deferred<Vec<T>>, MsgpackError> {
    let (head, child) = rd.head(depth)?;
    let Head::Array(n) = head else {
        rd.skip_rest(head, child)?;
        return Ok(Err(not_array));
    };
    let mut out = Vec::with_capacity(prealloc(n, rd));
    let mut ok = true;
    // A scalar element needs one unit of depth; with it, plain unsigned integers (nearly every
    // token id and hash) skip the general head dispatch.
    let fast = child >= 1;
    for _ in 0..n {
        if fast {
            if let Some(u) = rd.uint_fast() {
                if ok {
                    match item(Head::Uint(u)) {
                        Some(v) => out.push(v),
                        None => ok = false,
                    }
                }
                continue;
            }
        }
        let (h, c) = rd.head(child)?;
        match h {
            Head::Array(_) | Head::Map(_) => {
                rd.skip_rest(h, c)?;
                ok = false;
            }
            h if ok => match item(h) {
                Some(v) => out.push(v),
                None => ok = false,
            },
            _ => {}
        }
    }
    Ok(if ok { Ok(out) } else { Err(bad_item) })
}

impl RawEvent {
    fn event(&self) -> &'static str {
        match self.tag.as_ref().and_then(Option::as_deref) {
            Some("BlockRemoved") => "BlockRemoved",
            _ => "BlockStored",
        }
    }

    fn has(&self, f: Field) -> bool {
        match f {
            Field::BlockHashes => self.block_hashes.is_some(),
            Field::Parent => self.parent.is_some(),
            Field::TokenIds => self.token_ids.is_some(),
            Field::BlockSize => self.block_size.is_some(),
            Field::Medium => self.medium.is_some(),
            Field::LoraName => self.lora_name.is_some(),
            Field::CacheSalt => self.cache_salt.is_some(),
            Field::GroupIdx => self.group_idx.is_some(),
            Field::SpecKind => self.spec_kind.is_some(),
            Field::SlidingWindow => self.sliding_window.is_some(),
            Field::ExtraKeys => self.extra_keys.is_some(),
        }
    }

    /// Reads field `f`. Error texts name the event the tag says (a map's tag may come later: the
    /// texts are fixed up in [`RawEvent::assemble`]).
    fn read(&mut self, f: Field, rd: &mut Reader<'_>, depth: u16) -> Result<(), MsgpackError> {
        let field_err = |field: &'static str, reason: &'static str| DecodeError::Field {
            event: "",
            field,
            reason,
        };
        match f {
            Field::BlockHashes => {
                self.block_hashes = Some(read_array(
                    rd,
                    depth,
                    hash_of,
                    field_err("block_hashes", "must be an array"),
                    field_err("block_hashes", "hash must be an integer or bytes"),
                )?);
            }
            Field::Parent => {
                self.parent = Some(scalar(rd, depth, |h| match h {
                    Some(Head::Nil) => Ok(None),
                    Some(h) => hash_of(h).map(Some).ok_or_else(|| {
                        field_err("parent_block_hash", "must be an integer or bytes")
                    }),
                    None => Err(field_err("parent_block_hash", "must be an integer or bytes")),
                })?);
            }
            Field::TokenIds => {
                let token = |h: Head<'_>| match h {
                    Head::Uint(u) => u32::try_from(u).ok(),
                    _ => None,
                };
                self.token_ids = Some(read_array(
                    rd,
                    depth,
                    token,
                    field_err("token_ids", "must be an array"),
                    field_err("token_ids", "must be token ids in 0..2^32"),
                )?);
            }
            Field::BlockSize => self.block_size = Some(read_opt_u32(rd, depth, "", "block_size")?),
            Field::GroupIdx => self.group_idx = Some(read_opt_u32(rd, depth, "", "group_idx")?),
            Field::SpecKind => self.spec_kind = Some(read_opt_string(rd, depth)?),
            Field::SlidingWindow => {
                let window = read_opt_u32(rd, depth, "", "kv_cache_spec_sliding_window")?;
                self.sliding_window = Some(window);
            }
            Field::Medium => self.medium = Some(read_opt_string(rd, depth)?),
            Field::LoraName => self.lora_name = Some(read_opt_string(rd, depth)?),
            Field::CacheSalt => self.cache_salt = Some(read_opt_string(rd, depth)?),
            Field::ExtraKeys => self.extra_keys = Some(extra_keys::read(rd, depth)?),
        }
        Ok(())
    }

    fn assemble(self) -> Deferred<KvEvent> {
        let event = self.event();
        let name = |e: DecodeError| match e {
            DecodeError::Field { field, reason, .. } => DecodeError::Field { event, field, reason },
            other => other,
        };
        let Some(Some(tag)) = self.tag else {
            return Err(DecodeError::Batch("event without a type tag"));
        };
        let string = |s: Option<Option<String>>| s.flatten();
        match tag.as_str() {
            "BlockStored" => {
                // A nil field counts as absent.
                let block_hashes = self
                    .block_hashes
                    .unwrap_or(Err(DecodeError::Field {
                        event,
                        field: "block_hashes",
                        reason: "must be an array",
                    }))
                    .map_err(name)?;
                let parent = self.parent.unwrap_or(Ok(None)).map_err(name)?;
                let token_ids = self
                    .token_ids
                    .unwrap_or(Err(DecodeError::Field {
                        event,
                        field: "token_ids",
                        reason: "must be an array",
                    }))
                    .map_err(name)?;
                let block_size = self.block_size.unwrap_or(Ok(None)).map_err(name)?.ok_or(
                    DecodeError::Field { event, field: "block_size", reason: "is required" },
                )?;
                let group_idx = self.group_idx.unwrap_or(Ok(None)).map_err(name)?;
                let lora_name = string(self.lora_name);
                let keys = self.extra_keys.unwrap_or_default();
                let terms = extra_keys::terms(
                    &keys,
                    block_hashes.len(),
                    lora_name.as_deref(),
                    parent.is_none(),
                );
                Ok(KvEvent::Stored {
                    block_hashes,
                    parent,
                    token_ids,
                    block_size,
                    medium: string(self.medium),
                    lora_name,
                    cache_salt: string(self.cache_salt).or(terms.cache_salt),
                    group_idx,
                    spec_kind: string(self.spec_kind),
                    sliding_window: self.sliding_window.unwrap_or(Ok(None)).map_err(name)?,
                    extra_terms: terms.terms,
                })
            }
            "BlockRemoved" => Ok(KvEvent::Removed {
                block_hashes: self
                    .block_hashes
                    .unwrap_or(Err(DecodeError::Field {
                        event,
                        field: "block_hashes",
                        reason: "must be an array",
                    }))
                    .map_err(name)?,
                medium: string(self.medium),
                group_idx: self.group_idx.unwrap_or(Ok(None)).map_err(name)?,
            }),
            "AllBlocksCleared" => Ok(KvEvent::Cleared),
            _ => Ok(KvEvent::Unknown { tag }),
        }
    }
}

#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;
