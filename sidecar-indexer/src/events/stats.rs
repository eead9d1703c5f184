//! Per (worker, rank) listener counters, shared by the listener (writes gaps, replays, resyncs), the
//! applier (writes what it applied) and the API (`/debug/workers`, `/readyz`). Its own module so
//! the applier and the listener both depend on it and not on each other.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::apply::ApplyReport;

/// "No sequence number yet" in [`ListenerStats::last_seq`].
const NONE: u64 = u64::MAX;

/// Per (worker, rank) counters shared with the API (`/debug/workers`, `/readyz`).
#[derive(Debug)]
pub struct ListenerStats {
    pub last_seq: AtomicU64,
    pub batches: AtomicU64,
    pub gaps: AtomicU64,
    pub replays: AtomicU64,
    pub resyncs: AtomicU64,
    pub orphan_stores: AtomicU64,
    pub decode_errors: AtomicU64,
    /// Engine timestamp (f64 bits) of the last applied batch.
    pub last_ts_bits: AtomicU64,
    /// The start-up replay finished (or there is no replay socket): the index reflects the engine.
    pub synced: AtomicBool,
}

impl Default for ListenerStats {
    fn default() -> Self {
        Self {
            last_seq: AtomicU64::new(NONE),
            batches: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            orphan_stores: AtomicU64::new(0),
            decode_errors: AtomicU64::new(0),
            last_ts_bits: AtomicU64::new(0),
            synced: AtomicBool::new(false),
        }
    }
}

impl ListenerStats {
    /// Called by the applier after applying batch `seq`.
    pub fn record_applied(&self, seq: u64, ts: f64, r: &ApplyReport) {
        self.last_seq.store(seq, Ordering::Relaxed);
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.last_ts_bits.store(ts.to_bits(), Ordering::Relaxed);
        self.orphan_stores.fetch_add(r.orphan_stores, Ordering::Relaxed);
    }
    /// The last applied sequence number.
    pub fn last_seq(&self) -> Option<u64> {
        Some(self.last_seq.load(Ordering::Relaxed)).filter(|s| *s != NONE)
    }
    /// Engine timestamp of the last applied batch.
    pub fn last_ts(&self) -> Option<f64> {
        Some(f64::from_bits(self.last_ts_bits.load(Ordering::Relaxed))).filter(|t| *t > 0.0)
    }
}
