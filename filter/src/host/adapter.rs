//! [`Host`] over `proxy_wasm::hostcalls`: the one real adapter. Every error status becomes a
//! [`HostError`] naming it; nothing here unwraps.

use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};

use super::io;
use crate::host_api::{Host, HostError, SharedData};
use crate::metrics::MetricKind;
use crate::request::HttpCall;

/// The running Envoy.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProxyWasmHost;

fn err(status: Status) -> HostError {
    HostError(format!("{status:?}"))
}

impl Host for ProxyWasmHost {
    fn now_ns(&self) -> u64 {
        hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }

    fn dispatch(&self, call: &HttpCall) -> Result<u32, HostError> {
        let headers: Vec<(&str, &str)> =
            call.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        hostcalls::dispatch_http_call(
            &call.upstream,
            headers,
            call.body(),
            Vec::new(),
            Duration::from_millis(call.timeout_ms),
        )
        .map_err(err)
    }

    fn call_response_status(&self) -> Option<u16> {
        io::status_of(MapType::HttpCallResponseHeaders)
    }

    fn call_response_body(&self, max: usize) -> Vec<u8> {
        io::read_buffer(BufferType::HttpCallResponseBody, max).unwrap_or_default()
    }

    fn get_shared_data(&self, key: &str) -> Result<SharedData, HostError> {
        hostcalls::get_shared_data(key).map_err(err)
    }

    fn set_shared_data(&self, key: &str, value: &[u8]) -> Result<(), HostError> {
        hostcalls::set_shared_data(key, Some(value), None).map_err(err)
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, HostError> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
            MetricKind::Histogram => MetricType::Histogram,
        };
        hostcalls::define_metric(kind, name).map_err(err)
    }

    fn increment_metric(&self, id: u32, by: i64) -> Result<(), HostError> {
        hostcalls::increment_metric(id, by).map_err(err)
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), HostError> {
        hostcalls::record_metric(id, value).map_err(err)
    }

    fn set_tick_period(&self, period_ms: u64) -> Result<(), HostError> {
        hostcalls::set_tick_period(Duration::from_millis(period_ms)).map_err(err)
    }
}
