//! The one thread that writes the index.
//!
//! Every mutation — event batches from the listeners, worker registration and removal, resyncs,
//! approximate-mode inserts from route decisions, new limits after a reload — arrives as an
//! [`ApplierMsg`] on one bounded channel, so per-worker order is the order the listener saw and a
//! removal is applied after everything its listener queued before it. The applier takes the write
//! lock for a drained batch of messages (not per message, not across any wait), so route queries
//! under the read lock see the index change in small steps.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_core::hashing::SequenceHash;
use parking_lot::{Mutex, RwLock};

use super::apply::{apply_batch, ApplyReport};
use super::budget::QueuePermit;
use super::decode::EventBatch;
use super::listener::ListenerStats;
use crate::approx::ApproxTracker;
use crate::index::{KvIndex, WorkerSlot};
use crate::metrics::Metrics;

/// A change for the index.
pub enum ApplierMsg {
    /// `slot` now belongs to worker `label` (its metrics label) with the listener's `stats`.
    AddWorker { slot: WorkerSlot, label: Arc<str>, stats: Arc<ListenerStats> },
    /// `slot` leaves: its blocks go, and the slot is returned to the pool afterwards.
    RemoveWorker { slot: WorkerSlot },
    /// One live or replayed batch, in order.
    Batch { slot: WorkerSlot, seq: u64, batch: EventBatch },
    /// Forget what `slot` holds (a gap replay could not cover, an engine restart, rewiring).
    Clear { slot: WorkerSlot, reason: &'static str },
    /// Approximate mode: `slot` was routed these blocks at `at` (the indexer's clock).
    Approx { slot: WorkerSlot, chains: Vec<SequenceHash>, at: Instant },
    /// Approximate mode: drop the blocks routed `approx_ttl` or longer before `now` (sent by the
    /// service's expiry ticker, on the indexer's clock: `crate::clock`).
    Expire { now: Instant },
    /// New bounds and block size after a reload.
    Configure(ApplierConfig),
    /// Answered once everything queued before it is applied (tests, orderly reloads).
    Barrier(SyncSender<()>),
    /// `msg` holding bytes of the event queue's byte budget, returned when it is dropped (applied).
    Permitted { permit: QueuePermit, msg: Box<ApplierMsg> },
}

/// What the applier needs from the configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ApplierConfig {
    pub block_size: u32,
    pub max_entries: usize,
    pub max_blocks_per_worker: usize,
    pub approx_ttl: Duration,
    pub approx_max_blocks_per_worker: usize,
}

/// Numbers the API reads without taking the index lock.
#[derive(Debug, Default)]
pub struct IndexGauges {
    pub blocks: AtomicU64,
    pub entries: AtomicU64,
    pub bytes: AtomicU64,
}

struct Slot {
    label: Arc<str>,
    stats: Arc<ListenerStats>,
}

/// The applier thread's state.
pub struct Applier {
    index: Arc<RwLock<KvIndex>>,
    metrics: Arc<Metrics>,
    gauges: Arc<IndexGauges>,
    free_slots: Arc<Mutex<Vec<WorkerSlot>>>,
    config: ApplierConfig,
    approx: ApproxTracker,
    slots: HashMap<WorkerSlot, Slot>,
    last_mismatch_log: HashMap<WorkerSlot, Instant>,
    last_bytes_at: Option<Instant>,
}

/// Messages taken per write-lock acquisition.
const DRAIN: usize = 256;

impl Applier {
    /// An applier over `index`; removed slots are pushed to `free_slots` once applied.
    pub fn new(
        index: Arc<RwLock<KvIndex>>,
        metrics: Arc<Metrics>,
        gauges: Arc<IndexGauges>,
        free_slots: Arc<Mutex<Vec<WorkerSlot>>>,
        config: ApplierConfig,
    ) -> Self {
        Self {
            index,
            metrics,
            gauges,
            free_slots,
            config,
            approx: ApproxTracker::new(config.approx_ttl, config.approx_max_blocks_per_worker),
            slots: HashMap::new(),
            last_mismatch_log: HashMap::new(),
            last_bytes_at: None,
        }
    }

    /// Runs until every sender is gone.
    pub fn run(mut self, rx: Receiver<ApplierMsg>) {
        loop {
            match rx.recv() {
                Ok(first) => {
                    let mut barriers = Vec::new();
                    {
                        let lock = self.index.clone();
                        let mut index = lock.write();
                        let mut next = Some(first);
                        let mut n = 0;
                        while let Some(msg) = next {
                            self.handle(&mut index, msg, &mut barriers);
                            n += 1;
                            next = if n < DRAIN { rx.try_recv().ok() } else { None };
                        }
                        self.publish_gauges(&index, false);
                    }
                    for b in barriers {
                        let _ = b.send(());
                    }
                }
                Err(RecvError) => return,
            }
        }
    }

    fn handle(&mut self, index: &mut KvIndex, msg: ApplierMsg, barriers: &mut Vec<SyncSender<()>>) {
        match msg {
            ApplierMsg::AddWorker { slot, label, stats } => {
                index.add_worker(slot);
                self.slots.insert(slot, Slot { label, stats });
            }
            ApplierMsg::RemoveWorker { slot } => {
                index.remove_worker(slot);
                self.approx.forget_worker(slot);
                self.slots.remove(&slot);
                self.free_slots.lock().push(slot);
            }
            ApplierMsg::Batch { slot, seq, batch } => self.apply(index, slot, seq, &batch),
            ApplierMsg::Clear { slot, reason } => {
                index.clear_worker(slot);
                self.approx.forget_worker(slot);
                if let Some(s) = self.slots.get(&slot) {
                    tracing::info!(worker = %s.label, reason, "worker index state cleared");
                }
            }
            ApplierMsg::Approx { slot, chains, at } => {
                if !self.slots.contains_key(&slot) {
                    return;
                }
                index.insert_chain(slot, &chains);
                let evicted = self.approx.record(slot, &chains, at);
                if !evicted.is_empty() {
                    index.remove(slot, &evicted);
                    self.metrics.approx_expired.inc_by(evicted.len() as u64);
                }
            }
            ApplierMsg::Expire { now } => self.expire_approx(index, now),
            ApplierMsg::Configure(c) => {
                self.config = c;
                index.set_limits(c.max_entries, c.max_blocks_per_worker);
                self.approx.set_limits(c.approx_ttl, c.approx_max_blocks_per_worker);
            }
            ApplierMsg::Barrier(tx) => barriers.push(tx),
            ApplierMsg::Permitted { permit, msg } => {
                self.handle(index, *msg, barriers);
                drop(permit);
            }
        }
    }

    fn apply(&mut self, index: &mut KvIndex, slot: WorkerSlot, seq: u64, batch: &EventBatch) {
        let Some(s) = self.slots.get(&slot) else { return };
        let r = apply_batch(index, slot, batch, self.config.block_size);
        let label = s.label.clone();
        s.stats.record_applied(seq, batch.ts, &r);
        self.report(&label, slot, &r);
    }

    fn report(&mut self, w: &str, slot: WorkerSlot, r: &ApplyReport) {
        let m = &self.metrics;
        m.kv_batches.with_label_values(&[w]).inc();
        for (kind, n) in [("stored", r.stored_events), ("removed", r.removed_events), ("cleared", r.cleared_events), ("unknown", r.unknown_events)] {
            if n > 0 {
                m.kv_events.with_label_values(&[w, kind]).inc_by(n);
            }
        }
        if r.stored_blocks > 0 {
            m.kv_blocks.with_label_values(&[w, "stored"]).inc_by(r.stored_blocks);
        }
        if r.removed_blocks > 0 {
            m.kv_blocks.with_label_values(&[w, "removed"]).inc_by(r.removed_blocks);
        }
        if r.unknown_removes > 0 {
            m.kv_unknown_removes.with_label_values(&[w]).inc_by(r.unknown_removes);
        }
        if r.ignored_events > 0 {
            m.kv_ignored.with_label_values(&[w, "tier"]).inc_by(r.ignored_events);
        }
        if r.malformed_stores > 0 {
            m.kv_ignored.with_label_values(&[w, "malformed"]).inc_by(r.malformed_stores);
            tracing::warn!(worker = w, stores = r.malformed_stores, "BlockStored with token ids not covering its block hashes; skipped");
        }
        if r.recovered_orphans > 0 {
            m.kv_orphan_recovered.with_label_values(&[w]).inc_by(r.recovered_orphans);
            tracing::info!(worker = w, stores = r.recovered_orphans, "BlockStored with unknown parent indexed: parent chain learned from a prompt routed to the worker");
        }
        if r.orphan_stores > 0 {
            m.kv_orphan_stores.with_label_values(&[w]).inc_by(r.orphan_stores);
            tracing::debug!(worker = w, stores = r.orphan_stores, "BlockStored with unknown parent; not indexed");
        }
        if r.block_size_mismatches > 0 {
            m.kv_block_size_mismatch.with_label_values(&[w]).inc_by(r.block_size_mismatches);
            let now = Instant::now();
            let due = self.last_mismatch_log.get(&slot).is_none_or(|t| now.duration_since(*t) >= Duration::from_secs(10));
            if due {
                self.last_mismatch_log.insert(slot, now);
                tracing::error!(
                    worker = w,
                    engine_block_size = r.mismatched_block_size.unwrap_or(0),
                    configured_block_size = self.config.block_size,
                    refused = r.block_size_mismatches,
                    "BLOCK SIZE MISMATCH: the engine's KV blocks do not match model.block_size; its events are refused and KV routing to it is blind"
                );
            }
        }
        if r.resynced {
            m.kv_resyncs.with_label_values(&[w, "too_many_blocks"]).inc();
            tracing::warn!(worker = w, limit = self.config.max_blocks_per_worker, "worker claims more blocks than routing.max_blocks_per_worker (lost removals?); cleared");
        }
    }

    fn publish_gauges(&mut self, index: &KvIndex, force_bytes: bool) {
        self.gauges.blocks.store(index.blocks() as u64, Ordering::Relaxed);
        self.gauges.entries.store(index.entries() as u64, Ordering::Relaxed);
        let evictions = index.evictions();
        let seen = self.metrics.index_evictions.get();
        if evictions > seen {
            self.metrics.index_evictions.inc_by(evictions - seen);
        }
        // The byte estimate walks every entry: at most every 10 s.
        let now = Instant::now();
        if force_bytes || self.last_bytes_at.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(10)) {
            self.last_bytes_at = Some(now);
            self.gauges.bytes.store(index.approx_bytes() as u64, Ordering::Relaxed);
        }
    }

    fn expire_approx(&mut self, index: &mut KvIndex, now: Instant) {
        for (slot, chains) in self.approx.expire(now) {
            index.remove(slot, &chains);
            self.metrics.approx_expired.inc_by(chains.len() as u64);
        }
    }
}
