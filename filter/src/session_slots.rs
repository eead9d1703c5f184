//! A direct-mapped table of per-session values in Envoy's shared data: one table for every worker
//! thread of the process, so a turn handled by another thread finds it. Slot `key mod slots`; a
//! slot's value starts with the session key (8 bytes, little-endian), compared before use, so a
//! newer session in the same slot overwrites it and a reader never takes another session's value.
//! The placement memory ([`crate::placement`]) and the body bases ([`crate::body_bases`]) are two
//! such tables. Pure; the host calls are in `crate::shared`.

use kvmesh_core::session::SessionKey;

/// The shared-data key of `key`'s slot in `table` (a key prefix) of `slots` (> 0) slots.
pub fn slot_key(table: &str, key: SessionKey, slots: usize) -> String {
    let slot = key.0 % (slots.max(1) as u64);
    format!("{table}{slot}")
}

/// A slot value for `key`, its payload to follow (`capacity` bytes reserved for it).
pub fn value(key: SessionKey, capacity: usize) -> Vec<u8> {
    let mut value = Vec::with_capacity(8 + capacity);
    value.extend_from_slice(&key.0.to_le_bytes());
    value
}

/// The payload of a slot's `value` if the slot holds `key`.
pub fn payload(value: &[u8], key: SessionKey) -> Option<&[u8]> {
    let (stored, payload) = value.split_at_checked(8)?;
    (stored == key.0.to_le_bytes()).then_some(payload)
}
