//! Overload protection: at most `routing.max_concurrent_routes` route calls are worked on at once.
//!
//! A call beyond the bound is shed at once with 503 `overloaded_shed` (the filter routes it without
//! the indexer: a fast, cheap answer instead of a queue that grows while Envoy gives up). The
//! [`Permit`] travels with the work, not with the caller: a tokenization on the blocking pool keeps
//! its permit until it really ends, even after the route call was dropped, so abandoned work still
//! counts against the bound and can never pile up on the blocking pool. A [`Cancel`] flag, set when
//! the route call is dropped, lets queued work that has not started skip itself.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use super::record::RouteMetrics;
use super::ApiError;
use crate::metrics::Metrics;

/// One unit of admitted route work; releases its slot on drop.
pub struct Permit {
    inflight: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let now = self.inflight.fetch_sub(1, Ordering::AcqRel).saturating_sub(1);
        RouteMetrics(&self.metrics).inflight(now);
    }
}

/// Admits one call when fewer than `limit` are in flight, else sheds it.
pub fn admit(
    inflight: &Arc<AtomicUsize>,
    limit: usize,
    metrics: &Arc<Metrics>,
) -> Result<Permit, ApiError> {
    let prev = inflight.fetch_add(1, Ordering::AcqRel);
    let permit = Permit { inflight: inflight.clone(), metrics: metrics.clone() };
    if prev >= limit {
        drop(permit);
        return Err(ApiError::unavailable("overloaded_shed", format!("{limit} route calls in flight (routing.max_concurrent_routes): shed; route without the indexer")));
    }
    RouteMetrics(metrics).inflight(prev + 1);
    Ok(permit)
}

/// Set when the route call that owns it is dropped (client gone, filter timeout, request deadline).
#[derive(Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// Whether the caller is gone.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    /// A guard that sets the flag when dropped, unless [`CancelOnDrop::disarm`]ed first.
    pub fn on_drop(&self) -> CancelOnDrop {
        CancelOnDrop(Some(self.clone()))
    }
}

/// Sets its [`Cancel`] on drop.
pub struct CancelOnDrop(Option<Cancel>);

impl CancelOnDrop {
    /// The call finished: nothing to cancel.
    pub fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(c) = &self.0 {
            c.0.store(true, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_up_to_the_limit_and_sheds_beyond() {
        let m = Arc::new(Metrics::new().unwrap());
        let n = Arc::new(AtomicUsize::new(0));
        let a = admit(&n, 2, &m).unwrap();
        let b = admit(&n, 2, &m).unwrap();
        let shed = admit(&n, 2, &m).err().unwrap();
        assert_eq!((shed.status.as_u16(), shed.reason), (503, "overloaded_shed"));
        assert_eq!(n.load(Ordering::Relaxed), 2, "a shed call holds nothing");
        drop(a);
        let c = admit(&n, 2, &m).unwrap();
        drop((b, c));
        assert_eq!(n.load(Ordering::Relaxed), 0);
        assert_eq!(m.route_inflight.get(), 0);
    }

    #[test]
    fn dropping_the_guard_cancels_unless_disarmed() {
        let c = Cancel::default();
        c.on_drop().disarm();
        assert!(!c.is_cancelled());
        drop(c.on_drop());
        assert!(c.is_cancelled());
    }
}
