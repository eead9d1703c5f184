//! Where the indexer last placed each session, for routing without it.
//!
//! The indexer places a new conversation by cost and moves a session when its home is slower, so
//! a session's worker is generally not the rendezvous pin the local fallback ([`crate::fallback`])
//! computes: falling back to the pin recomputes the conversation's history there, on every turn
//! the indexer is away and again when it returns. The filter therefore remembers the indexer's
//! last placement of each session key and the fallback pins that worker while it is in the fleet.
//!
//! The memory is a table of session slots in Envoy's shared data ([`crate::session_slots`]), each
//! the worker id, so a collision falls back to the pin, never to another session's worker. Bounded
//! by `placement_memory_slots` entries of at most 8 + [`MAX_WORKER_ID_BYTES`] bytes. Pure encoding
//! here; the host calls are in `crate::shared`.

use kvmesh_core::session::SessionKey;

use crate::session_slots;

/// Shared-data key prefix of the table's slots.
const SLOT_KEY_PREFIX: &str = "kvmesh.placed.";

/// Longest worker id remembered (longer ones are not: the fallback then pins by rendezvous).
pub const MAX_WORKER_ID_BYTES: usize = 256;

/// The shared-data key of `key`'s slot in a table of `slots` (> 0) slots.
pub fn slot_key(key: SessionKey, slots: usize) -> String {
    session_slots::slot_key(SLOT_KEY_PREFIX, key, slots)
}

/// A slot's value: the session key, then the worker id. `None` for an empty or over-long id.
pub fn encode(key: SessionKey, worker: &str) -> Option<Vec<u8>> {
    if worker.is_empty() || worker.len() > MAX_WORKER_ID_BYTES {
        return None;
    }
    let mut value = session_slots::value(key, worker.len());
    value.extend_from_slice(worker.as_bytes());
    Some(value)
}

/// The worker a slot's `value` remembers for `key`: `None` when the slot holds another session,
/// or is empty or unreadable.
pub fn decode(value: &[u8], key: SessionKey) -> Option<&str> {
    let worker = session_slots::payload(value, key)?;
    if worker.is_empty() || worker.len() > MAX_WORKER_ID_BYTES {
        return None;
    }
    std::str::from_utf8(worker).ok()
}

#[cfg(test)]
#[path = "tests/placement.rs"]
mod tests;
