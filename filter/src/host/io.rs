//! Small wrappers over `proxy_wasm::hostcalls` that read plain data of one stream out of Envoy
//! (headers, buffers, properties); an error status reads as "absent", never a panic. The root-level
//! host calls are [`crate::host_api::Host`]'s (`super::adapter`).

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType};

/// All pairs of a header map, values as bytes (the `String` variant panics on non-UTF-8).
pub fn header_pairs(map: MapType) -> Vec<(String, Vec<u8>)> {
    hostcalls::get_map_bytes(map).unwrap_or_default()
}

/// `:status` of a header map, if present and numeric.
pub fn status_of(map: MapType) -> Option<u16> {
    let bytes = hostcalls::get_map_value_bytes(map, ":status").ok()??;
    std::str::from_utf8(&bytes).ok()?.trim().parse().ok()
}

/// Up to `max` bytes of a buffer.
pub fn read_buffer(buffer: BufferType, max: usize) -> Option<Vec<u8>> {
    hostcalls::get_buffer(buffer, 0, max).ok().flatten()
}

/// A string property of the calling context (e.g. `plugin_root_id`, `plugin_vm_id`).
pub fn property_string(name: &str) -> Option<String> {
    let bytes = hostcalls::get_property(vec![name]).ok()??;
    String::from_utf8(bytes).ok()
}

/// A string property at `path` (e.g. `upstream.address`), if present and UTF-8.
pub fn property_text(path: &[&str]) -> Option<String> {
    let bytes = hostcalls::get_property(path.to_vec()).ok()??;
    String::from_utf8(bytes).ok().filter(|s| !s.is_empty())
}

/// A numeric property (Envoy encodes integers as 8 little-endian bytes), e.g. `response.code`.
pub fn property_u64(path: &[&str]) -> Option<u64> {
    let bytes = hostcalls::get_property(path.to_vec()).ok()??;
    Some(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?))
}
