//! Setting the decision's `kv_transfer_params` in the body the serving worker receives.
//!
//! The decode worker must receive the client's request exactly as sent, plus the decision's
//! `kv_transfer_params`. The edit is the core's one JSON editor ([`kvmesh_core::json_edit`]): every
//! occurrence of the key has its value replaced (duplicates included: JSON parsers disagree on which
//! one wins), or `"key":value` is inserted right after the opening brace; every other byte is
//! copied unchanged. This module only adapts a decision's `Value` to it.

pub use kvmesh_core::json_edit::EditError as SpliceError;
use kvmesh_core::json_edit::{self, Edit};
use serde_json::Value;

/// Returns `body` with top-level `key` set to `value`; an error when `body` is not a JSON object
/// (the caller forwards the body unchanged and counts it).
pub fn splice_top_level(body: &[u8], key: &str, value: &Value) -> Result<Vec<u8>, SpliceError> {
    json_edit::edit(body, &[Edit::set_value(key, value)])
}

#[cfg(test)]
#[path = "tests/splice.rs"]
mod tests;
