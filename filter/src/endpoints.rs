//! Passive health of the engine endpoints the filter names, per worker thread.
//!
//! Envoy's outlier detection ejects a failing host from the cluster's load-balancing set, but the
//! `override_host` policy looks hosts up by address and does not re-check their health (Envoy
//! 1.40, shown by `e2e/tests/failing_worker.rs`): a worker answering every request 500 keeps its
//! place at the head of `x-gateway-destination-endpoint`. Worse, it looks idle to the indexer (it
//! releases its load at once), so it attracts traffic. So the filter keeps its own ledger: after
//! `endpoint_failures` consecutive failed attempts (a 5xx, or a retry that moved the request off
//! the primary) an endpoint is ejected for `endpoint_ejection_ms`, and while ejected it moves to
//! the end of every destination list (kept as a last resort, never removed: if every candidate is
//! ejected the order is unchanged). When the window ends one more failure ejects it again.
//!
//! Bounded: at most [`MAX_TRACKED`] endpoints (a fleet is far smaller; beyond it the healthiest
//! entry is forgotten). Pure: the clock is passed in.

use std::collections::HashMap;

/// Most endpoints tracked per worker thread.
pub const MAX_TRACKED: usize = 4096;

#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    failures: u32,
    ejected_until_ns: u64,
}

/// What a recorded outcome changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthEvent {
    /// The endpoint is ejected from now on.
    Ejected,
}

/// Consecutive-failure ejection per endpoint.
#[derive(Debug, Clone)]
pub struct EndpointHealth {
    threshold: u32,
    ejection_ns: u64,
    entries: HashMap<String, Entry>,
}

impl EndpointHealth {
    /// Ejects after `threshold` consecutive failures (0 = never) for `ejection_ms`.
    pub fn new(threshold: u32, ejection_ms: u64) -> Self {
        Self {
            threshold,
            ejection_ns: ejection_ms.saturating_mul(1_000_000),
            entries: HashMap::new(),
        }
    }

    /// Records one attempt's outcome on `endpoint`.
    pub fn record(&mut self, endpoint: &str, ok: bool, now_ns: u64) -> Option<HealthEvent> {
        if self.threshold == 0 {
            return None;
        }
        if ok {
            if let Some(e) = self.entries.get_mut(endpoint) {
                e.failures = 0;
            }
            return None;
        }
        if !self.entries.contains_key(endpoint) && self.entries.len() >= MAX_TRACKED {
            self.forget_one(now_ns);
        }
        let threshold = self.threshold;
        let ejection_ns = self.ejection_ns;
        let e = self.entries.entry(endpoint.to_owned()).or_default();
        if now_ns < e.ejected_until_ns {
            // Attempts already under way when it was ejected: no news.
            return None;
        }
        e.failures = e.failures.saturating_add(1);
        if e.failures >= threshold {
            e.ejected_until_ns = now_ns.saturating_add(ejection_ns);
            // After the window one more failure ejects again; a success clears the count.
            e.failures = threshold - 1;
            return Some(HealthEvent::Ejected);
        }
        None
    }

    /// Whether `endpoint` is ejected at `now_ns`.
    pub fn is_ejected(&self, endpoint: &str, now_ns: u64) -> bool {
        self.entries.get(endpoint).is_some_and(|e| now_ns < e.ejected_until_ns)
    }

    /// `list` (`ip:port[,ip:port…]`) with ejected endpoints moved to the end, order otherwise
    /// kept; and how many were moved. Unchanged when none or all are ejected.
    pub fn reorder(&self, list: &str, now_ns: u64) -> (String, usize) {
        let (healthy, ejected): (Vec<&str>, Vec<&str>) =
            list.split(',').partition(|e| !self.is_ejected(e, now_ns));
        if ejected.is_empty() || healthy.is_empty() {
            return (list.to_owned(), 0);
        }
        let moved = ejected.len();
        (healthy.into_iter().chain(ejected).collect::<Vec<_>>().join(","), moved)
    }

    fn forget_one(&mut self, now_ns: u64) {
        let victim = self
            .entries
            .iter()
            .min_by_key(|(_, e)| (now_ns < e.ejected_until_ns, e.failures))
            .map(|(k, _)| k.clone());
        if let Some(k) = victim {
            self.entries.remove(&k);
        }
    }
}

/// What one finished request says about the endpoints it used: `primary` is the first endpoint
/// the filter named (None when Envoy's LB chose), `served` the host of the last attempt
/// (`upstream.address`), `status` the final response status. Returns `(endpoint, ok)` pairs.
pub fn attempt_outcomes(
    primary: Option<&str>,
    served: Option<&str>,
    status: Option<u16>,
) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let Some(status) = status else { return out };
    let failed = (500..=599).contains(&status);
    if let Some(served) = served {
        if failed || (200..300).contains(&status) {
            out.push((served.to_owned(), !failed));
        }
    }
    // Envoy moved the request off the primary: the primary's attempt failed.
    if let (Some(p), Some(s)) = (primary, served) {
        if p != s {
            out.push((p.to_owned(), false));
        }
    }
    out
}

#[cfg(test)]
#[path = "tests/endpoints.rs"]
mod tests;
