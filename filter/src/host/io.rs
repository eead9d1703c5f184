//! Small wrappers over `proxy_wasm::hostcalls`: read plain data out of Envoy, execute effects, and
//! turn every error status into a log line plus a metric instead of a panic.

use std::collections::HashMap;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType};

use crate::metrics::{InternalError, Metric, MetricKind, MetricUpdate};
use crate::request::HttpCall;

/// Metric ids of this VM, defined once per root context.
#[derive(Debug, Default)]
pub struct MetricIds(HashMap<Metric, u32>);

impl MetricIds {
    /// Defines every metric of [`Metric::all`] (Envoy returns the same stat for the same name).
    pub fn define() -> Self {
        let mut ids = HashMap::new();
        for metric in Metric::all() {
            let kind = match metric.kind() {
                MetricKind::Counter => MetricType::Counter,
                MetricKind::Gauge => MetricType::Gauge,
                MetricKind::Histogram => MetricType::Histogram,
            };
            match hostcalls::define_metric(kind, &metric.stat_name()) {
                Ok(id) => {
                    ids.insert(metric, id);
                }
                Err(status) => log::warn!("define_metric {} failed: {status:?}", metric.stat_name()),
            }
        }
        Self(ids)
    }

    /// Applies one update; counters skip zero (Envoy refuses non-positive increments).
    pub fn apply(&self, update: MetricUpdate) {
        let result = match update {
            MetricUpdate::Add(_, 0) => Ok(()),
            MetricUpdate::Add(m, n) => match self.0.get(&m) {
                Some(&id) => hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX)),
                None => Ok(()),
            },
            MetricUpdate::Record(m, v) => match self.0.get(&m) {
                Some(&id) => hostcalls::record_metric(id, v),
                None => Ok(()),
            },
        };
        if let Err(status) = result {
            log::debug!("metric update {update:?} failed: {status:?}");
        }
    }

    /// Counts a failed host call.
    pub fn host_call_failed(&self, what: &str, status: proxy_wasm::types::Status) {
        log::warn!("host call {what} failed: {status:?}");
        self.apply(MetricUpdate::Add(Metric::InternalErrors(InternalError::HostCall), 1));
    }
}

/// Wall-clock nanoseconds from the host (0 if unavailable; only used for durations).
pub fn now_ns() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

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

/// Dispatches `call`; the token identifies its answer.
pub fn dispatch(call: &HttpCall) -> Result<u32, proxy_wasm::types::Status> {
    let headers: Vec<(&str, &str)> = call.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
    hostcalls::dispatch_http_call(
        &call.upstream,
        headers,
        call.body.as_deref(),
        Vec::new(),
        Duration::from_millis(call.timeout_ms),
    )
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
