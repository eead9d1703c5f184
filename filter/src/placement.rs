//! Where the indexer last placed each session, for routing without it.
//!
//! The indexer places a new conversation by cost and moves a session when its home is slower, so
//! a session's worker is generally not the rendezvous pin the local fallback ([`crate::fallback`])
//! computes: falling back to the pin recomputes the conversation's history there, on every turn
//! the indexer is away and again when it returns. The filter therefore remembers the indexer's
//! last placement of each session key and the fallback pins that worker while it is in the fleet.
//!
//! The memory is a direct-mapped table in Envoy's shared data (one table for every worker thread
//! of the process, so a turn handled by another thread finds it): slot `key mod slots` holds the
//! key and the worker id, a newer session in the same slot overwrites it, and a slot's key is
//! compared before use, so a collision falls back to the pin, never to another session's worker.
//! Bounded by `placement_memory_slots` entries of at most 8 + [`MAX_WORKER_ID_BYTES`] bytes.
//! Pure encoding here; the host calls are in `crate::shared`.

use kvmesh_core::session::SessionKey;

/// Shared-data key prefix of the table's slots.
const SLOT_KEY_PREFIX: &str = "kvmesh.placed.";

/// Longest worker id remembered (longer ones are not: the fallback then pins by rendezvous).
pub const MAX_WORKER_ID_BYTES: usize = 256;

/// The shared-data key of `key`'s slot in a table of `slots` (> 0) slots.
pub fn slot_key(key: SessionKey, slots: usize) -> String {
    let slot = key.0 % (slots.max(1) as u64);
    format!("{SLOT_KEY_PREFIX}{slot}")
}

/// A slot's value: the session key (8 bytes, little-endian), then the worker id. `None` for an
/// empty or over-long id.
pub fn encode(key: SessionKey, worker: &str) -> Option<Vec<u8>> {
    if worker.is_empty() || worker.len() > MAX_WORKER_ID_BYTES {
        return None;
    }
    let mut value = Vec::with_capacity(8 + worker.len());
    value.extend_from_slice(&key.0.to_le_bytes());
    value.extend_from_slice(worker.as_bytes());
    Some(value)
}

/// The worker a slot's `value` remembers for `key`: `None` when the slot holds another session,
/// or is empty or unreadable.
pub fn decode(value: &[u8], key: SessionKey) -> Option<&str> {
    let (stored, worker) = value.split_at_checked(8)?;
    let stored = u64::from_le_bytes(stored.try_into().ok()?);
    if stored != key.0 || worker.is_empty() || worker.len() > MAX_WORKER_ID_BYTES {
        return None;
    }
    std::str::from_utf8(worker).ok()
}

#[cfg(test)]
#[path = "tests/placement.rs"]
mod tests;
