//! The body bases the indexer named for each session ([`kvmesh_core::body_base`]), so a long
//! conversation's next route call sends only the bytes after one instead of its whole body.
//!
//! Like the placement memory ([`crate::placement`]), a table of session slots in Envoy's shared
//! data ([`crate::session_slots`]), each up to [`BASES_PER_SLOT`] bases, most recent first —
//! several conversations can share a session key (a derived key is the conversation's anchor, and
//! conversations branching from one long prefix share it). Each base keeps the last
//! [`TAIL_BYTES`] bytes it covers: a body is hashed only against a base whose tail it repeats at
//! the same place (an O(1) check), so the choice costs one hash of the base's bytes (~20 µs for
//! 200 KB in the VM). Bounded by `body_base_slots` entries of at most [`MAX_SLOT_BYTES`] bytes.
//! Pure encoding and choice here; the host calls are in `crate::shared`.

use kvmesh_core::body_base::BodyBase;
use kvmesh_core::session::SessionKey;

use crate::session_slots;

/// Shared-data key prefix of the table's slots.
const SLOT_KEY_PREFIX: &str = "kvmesh.bodybase.";

/// Bases remembered per session key (conversations on one anchor), most recent first.
pub const BASES_PER_SLOT: usize = 4;

/// Bytes at the end of a base compared before a body is hashed against it.
pub const TAIL_BYTES: usize = 16;

/// Bytes of one encoded base: memo key, length, hash, tail.
const BASE_BYTES: usize = 8 + 8 + 16 + TAIL_BYTES;

/// Largest slot value: the session key and [`BASES_PER_SLOT`] bases.
pub const MAX_SLOT_BYTES: usize = 8 + BASES_PER_SLOT * BASE_BYTES;

/// A base as the filter remembers it: the indexer's name and the last bytes it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remembered {
    pub base: BodyBase,
    pub tail: [u8; TAIL_BYTES],
}

impl Remembered {
    /// `base`, which the indexer named for `body` (it covers `body`'s first `base.len` bytes);
    /// `None` when it does not fit in `body` or is too short to be worth a delta.
    pub fn new(base: BodyBase, body: &[u8]) -> Option<Self> {
        let start = base.len.checked_sub(TAIL_BYTES)?;
        let tail = body.get(start..base.len)?.try_into().ok()?;
        Some(Self { base, tail })
    }
}

/// The shared-data key of `key`'s slot in a table of `slots` (> 0) slots.
pub fn slot_key(key: SessionKey, slots: usize) -> String {
    session_slots::slot_key(SLOT_KEY_PREFIX, key, slots)
}

/// A slot's value: the session key, then each base (memo key, length, hash, little-endian; its
/// tail).
pub fn encode(key: SessionKey, bases: &[Remembered]) -> Vec<u8> {
    let mut value = session_slots::value(key, bases.len().min(BASES_PER_SLOT) * BASE_BYTES);
    for r in bases.iter().take(BASES_PER_SLOT) {
        value.extend_from_slice(&r.base.memo_key.to_le_bytes());
        value.extend_from_slice(&(r.base.len as u64).to_le_bytes());
        value.extend_from_slice(&r.base.hash.to_le_bytes());
        value.extend_from_slice(&r.tail);
    }
    value
}

/// The bases a slot's `value` remembers for `key`: none when the slot holds another session, or is
/// empty or unreadable.
pub fn decode(value: &[u8], key: SessionKey) -> Vec<Remembered> {
    let Some(rest) = session_slots::payload(value, key) else { return Vec::new() };
    if rest.len() % BASE_BYTES != 0 || rest.len() > BASES_PER_SLOT * BASE_BYTES {
        return Vec::new();
    }
    rest.chunks_exact(BASE_BYTES).filter_map(decode_one).collect()
}

fn decode_one(b: &[u8]) -> Option<Remembered> {
    let memo_key = u64::from_le_bytes(b.get(..8)?.try_into().ok()?);
    let len = usize::try_from(u64::from_le_bytes(b.get(8..16)?.try_into().ok()?)).ok()?;
    let hash = u128::from_le_bytes(b.get(16..32)?.try_into().ok()?);
    let tail = b.get(32..32 + TAIL_BYTES)?.try_into().ok()?;
    Some(Remembered { base: BodyBase { memo_key, len, hash }, tail })
}

/// The remembered base `body` continues: the most recent whose tail `body` repeats at its place
/// and whose bytes `body` starts with ([`BodyBase::prefixes`]: hashed). At most two are hashed:
/// a second tail match is rare (two conversations whose latest turns end alike).
pub fn choose(bases: &[Remembered], body: &[u8]) -> Option<BodyBase> {
    bases
        .iter()
        .filter(|r| {
            body.len() > r.base.len
                && r.base.len.checked_sub(TAIL_BYTES).and_then(|s| body.get(s..r.base.len))
                    == Some(&r.tail[..])
        })
        .take(2)
        .find(|r| r.base.prefixes(body))
        .map(|r| r.base)
}

/// The slot's bases after an answer: `new` (if any) first, without `used` (the base the call was
/// sent after: the indexer replaced it by `new`, or no longer holds it), at most [`BASES_PER_SLOT`].
pub fn remember(
    bases: Vec<Remembered>,
    new: Option<Remembered>,
    used: Option<BodyBase>,
) -> Vec<Remembered> {
    new.into_iter()
        .chain(
            bases
                .into_iter()
                .filter(|r| Some(r.base) != used && Some(r.base) != new.map(|n| n.base)),
        )
        .take(BASES_PER_SLOT)
        .collect()
}

#[cfg(test)]
#[path = "tests/body_bases.rs"]
mod tests;
