//! The one thread that writes the index.
//!
//! Every mutation — event batches from the listeners, worker registration and removal, resyncs,
//! approximate-mode inserts from route decisions, new limits after a reload — arrives as an
//! [`ApplierMsg`] on one bounded channel, so per-worker order is the order the listener saw and a
//! removal is applied after everything its listener queued before it.
//!
//! Route queries share the index's read lock, so the applier keeps them waiting only while it
//! actually holds the write lock, never while it waits for it ([`Writer`]):
//! * It takes the write lock only when no query holds the read lock (`try_write`, spinning, then
//!   yielding, then sleeping briefly; [`write_when_free`]). A parking_lot writer that *waits* for
//!   the lock marks it so that every new reader parks behind it until the writer has been
//!   scheduled, got the lock and let it go; on a busy machine that is the scheduler's latency,
//!   tens of milliseconds, once per hold (`kvmesh-bench scale`, e2e/bench/HISTORY.md). Only if
//!   queries keep the lock busy for [`WRITE_PATIENCE`] does it queue like any writer (it cannot
//!   starve).
//! * It holds it for one message, and at most [`HOLD_BLOCKS`] blocks at a stretch: a long store (a
//!   48k-token prompt is ~3,000 blocks) is applied in pieces ([`apply_step`]). Counting and
//!   logging what a batch did happens after the lock is let go. Letting go hands the lock to the
//!   queries that parked meanwhile (`unlock_fair`), so the applier cannot take it back before them.
//! * A table that must grow — rehashing every entry, a second at the default bound — is rebuilt
//!   under a read lock, with route queries going on (the applier is the only writer, so nothing
//!   changes meanwhile), and only swapped in under the write lock ([`KvIndex::room_for`]).
//!
//! A query can still wait behind a hold the scheduler interrupts; `kvmesh_index_write_hold_seconds`
//! shows the stretches, descheduled time included.
//!
//! Over 600 lines: the applier's lock protocol and the tests that pin it (readers never kept out,
//! short write stretches) belong in one file.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_core::hashing::SequenceHash;
use parking_lot::{Mutex, RwLock, RwLockWriteGuard};

use super::apply::{apply_step, step_blocks, step_tier, ApplyReport, Cursor};
use super::budget::QueuePermit;
use super::decode::EventBatch;
use super::stats::ListenerStats;
use crate::approx::ApproxTracker;
use crate::index::{KvIndex, Room, Tier, WorkerSlot};
use crate::metrics::Metrics;

/// A change for the index.
pub enum ApplierMsg {
    /// `slot` now belongs to worker `label` (its metrics label), serving base model `model` whose
    /// engines use `block_size` (its events are checked against it), with the listener's `stats`.
    AddWorker {
        slot: WorkerSlot,
        label: Arc<str>,
        model: Arc<str>,
        block_size: u32,
        stats: Arc<ListenerStats>,
    },
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
    /// New bounds after a reload (a model's new block size comes with its workers' new slots).
    Configure(ApplierConfig),
    /// Answered once everything queued before it is applied (tests, orderly reloads).
    Barrier(SyncSender<()>),
    /// `msg` holding bytes of the event queue's byte budget, returned when it is dropped (applied).
    Permitted { permit: QueuePermit, msg: Box<ApplierMsg> },
}

/// What the applier needs from the configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ApplierConfig {
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
    model: Arc<str>,
    block_size: u32,
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
    /// Slots already warned about placeholder offload stores (one warning per slot).
    warned_undescribed: std::collections::HashSet<WorkerSlot>,
    last_bytes_at: Option<Instant>,
}

/// Messages applied between two refreshes of the index gauges.
const DRAIN: usize = 256;

/// Blocks stored or removed in one hold of the write lock at most: ~0.1–0.3 ms of table work on
/// this machine's index (a 48k-token store took 1–4 ms in one hold before).
pub const HOLD_BLOCKS: usize = 256;

/// How long the applier waits for a moment when no route query holds the read lock before it
/// queues for the write lock like any writer (new queries then wait until it got and released it).
/// Queries hold the lock for microseconds, so only back-to-back queries for this long (or one
/// query descheduled that long while holding it) get here.
pub const WRITE_PATIENCE: Duration = Duration::from_millis(100);

/// The write lock, taken at a moment when no query holds the read lock, without waiting in a way
/// that keeps new queries out (module docs); after [`WRITE_PATIENCE`], queued for like any writer.
fn write_when_free(lock: &RwLock<KvIndex>) -> RwLockWriteGuard<'_, KvIndex> {
    let mut tries = 0u32;
    let mut since: Option<Instant> = None;
    loop {
        // A load before the compare-and-swap: spinning on the swap would take the lock's cache
        // line away from the queries it waits for.
        if !lock.is_locked() {
            if let Some(g) = lock.try_write() {
                return g;
            }
        }
        tries += 1;
        if tries <= 64 {
            std::hint::spin_loop();
        } else if tries <= 96 {
            std::thread::yield_now();
        } else {
            let start = *since.get_or_insert_with(Instant::now);
            if start.elapsed() >= WRITE_PATIENCE {
                return lock.write();
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// The applier's hold on the index: the write lock taken when needed ([`write_when_free`]) and let
/// go after each message or [`HOLD_BLOCKS`] blocks (module docs).
struct Writer<'a> {
    lock: &'a RwLock<KvIndex>,
    /// The write lock, while held.
    guard: Option<RwLockWriteGuard<'a, KvIndex>>,
    /// Blocks applied since the lock was taken.
    spent: usize,
    since: Instant,
    hold: &'a prometheus::Histogram,
    /// Tables replaced by grown ones: freed after the lock is released.
    retired: Vec<Room>,
}

impl<'a> Writer<'a> {
    fn new(lock: &'a RwLock<KvIndex>, hold: &'a prometheus::Histogram) -> Self {
        Self { lock, guard: None, spent: 0, since: Instant::now(), hold, retired: Vec::new() }
    }

    /// The index, write-locked (taking the lock if it is not held).
    fn index(&mut self) -> &mut KvIndex {
        let (lock, since, spent) = (self.lock, &mut self.since, &mut self.spent);
        self.guard.get_or_insert_with(|| {
            let g = write_when_free(lock);
            (*since, *spent) = (Instant::now(), 0);
            g
        })
    }

    /// Reads the index: through the write lock if held, else under a read lock.
    fn read<R>(&self, f: impl FnOnce(&KvIndex) -> R) -> R {
        match &self.guard {
            Some(g) => f(g),
            None => f(&self.lock.read()),
        }
    }

    /// Counts `blocks` of work; past [`HOLD_BLOCKS`], lets the lock go.
    fn spend(&mut self, blocks: usize) {
        self.spent += blocks;
        if self.spent >= HOLD_BLOCKS {
            self.release();
        }
    }

    /// Lets the write lock go (to the queries that parked meanwhile, if any), then frees the
    /// tables grown ones replaced.
    fn release(&mut self) {
        if let Some(g) = self.guard.take() {
            self.hold.observe(self.since.elapsed().as_secs_f64());
            RwLockWriteGuard::unlock_fair(g);
        }
        self.spent = 0;
        self.retired.clear();
    }

    /// Makes room for `blocks` more blocks on `slot` in `tier` before they are stored, so no
    /// insert rehashes a table under the write lock: the grown copies are built under a read lock
    /// (route queries go on; the applier is the only writer, so nothing changes) and swapped in
    /// under the write lock.
    fn make_room(&mut self, tier: Tier, slot: WorkerSlot, blocks: usize) {
        let Some(growth) = self.read(|index| index.growth_in(tier, slot, blocks)) else { return };
        self.release();
        let room = self.lock.read().room_for(growth);
        let old = self.index().make_room(room);
        self.retired.push(old);
    }
}

impl Drop for Writer<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

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
            warned_undescribed: Default::default(),
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
                        let (lock, metrics) = (self.index.clone(), self.metrics.clone());
                        let mut w = Writer::new(&lock, &metrics.index_write_hold);
                        let mut next = Some(first);
                        let mut n = 0;
                        while let Some(msg) = next {
                            self.handle(&mut w, msg, &mut barriers);
                            w.release();
                            n += 1;
                            next = if n < DRAIN { rx.try_recv().ok() } else { None };
                        }
                        self.publish_gauges(&lock.read());
                    }
                    for b in barriers {
                        let _ = b.send(());
                    }
                }
                Err(RecvError) => return,
            }
        }
    }

    fn handle(&mut self, w: &mut Writer<'_>, msg: ApplierMsg, barriers: &mut Vec<SyncSender<()>>) {
        match msg {
            ApplierMsg::Batch { slot, seq, batch } => self.apply(w, slot, seq, &batch),
            ApplierMsg::Permitted { permit, msg } => {
                self.handle(w, *msg, barriers);
                w.release();
                drop(permit);
            }
            ApplierMsg::AddWorker { slot, label, model, block_size, stats } => {
                w.index().add_worker(slot);
                self.slots.insert(slot, Slot { label, model, block_size, stats });
            }
            ApplierMsg::RemoveWorker { slot } => {
                w.index().remove_worker(slot);
                self.approx.forget_worker(slot);
                self.slots.remove(&slot);
                self.warned_undescribed.remove(&slot);
                self.free_slots.lock().push(slot);
            }
            ApplierMsg::Clear { slot, reason } => {
                w.index().clear_worker(slot);
                self.approx.forget_worker(slot);
                if let Some(s) = self.slots.get(&slot) {
                    tracing::info!(worker = %s.label, reason, "worker index state cleared");
                }
            }
            ApplierMsg::Approx { slot, chains, at } => {
                if !self.slots.contains_key(&slot) {
                    return;
                }
                w.make_room(Tier::Gpu, slot, chains.len());
                let index = w.index();
                index.insert_chain(slot, &chains);
                let evicted = self.approx.record(slot, &chains, at);
                if !evicted.is_empty() {
                    index.remove(slot, &evicted);
                    self.metrics.approx_expired.inc_by(evicted.len() as u64);
                }
                w.spend(chains.len() + evicted.len());
            }
            ApplierMsg::Expire { now } => self.expire_approx(w.index(), now),
            ApplierMsg::Configure(c) => {
                self.config = c;
                w.index().set_limits(c.max_entries, c.max_blocks_per_worker);
                self.approx.set_limits(c.approx_ttl, c.approx_max_blocks_per_worker);
            }
            ApplierMsg::Barrier(tx) => barriers.push(tx),
        }
    }

    /// Applies one batch in steps ([`apply_step`]), making room before each store and letting
    /// route queries in between steps; counts and logs what it did after letting the lock go.
    fn apply(&mut self, w: &mut Writer<'_>, slot: WorkerSlot, seq: u64, batch: &EventBatch) {
        let Some(s) = self.slots.get(&slot) else { return };
        let mut r = ApplyReport::default();
        let mut at = Some(Cursor::default());
        while let Some(c) = at {
            w.make_room(step_tier(batch, c), slot, step_blocks(batch, c, HOLD_BLOCKS));
            let step = apply_step(w.index(), slot, batch, s.block_size, c, HOLD_BLOCKS, &mut r);
            w.spend(step.blocks);
            at = step.next;
        }
        w.release();
        let (label, model, block_size) = (s.label.clone(), s.model.clone(), s.block_size);
        s.stats.record_applied(seq, batch.ts, &r);
        self.report(&label, (&model, block_size), slot, &r);
    }

    /// Counts and logs what a batch of worker `w` (serving `model` with its block size) did.
    fn report(&mut self, w: &str, model: (&str, u32), slot: WorkerSlot, r: &ApplyReport) {
        let (model, block_size) = model;
        let m = &self.metrics;
        m.kv_batches.with_label_values(&[w]).inc();
        for (kind, n) in [
            ("stored", r.stored_events),
            ("removed", r.removed_events),
            ("cleared", r.cleared_events),
            ("unknown", r.unknown_events),
        ] {
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
        if r.tier_stored_blocks > 0 {
            m.kv_blocks.with_label_values(&[w, "tier_stored"]).inc_by(r.tier_stored_blocks);
        }
        if r.tier_removed_blocks > 0 {
            m.kv_blocks.with_label_values(&[w, "tier_removed"]).inc_by(r.tier_removed_blocks);
        }
        if r.ignored_events > 0 {
            m.kv_ignored.with_label_values(&[w, "tier"]).inc_by(r.ignored_events);
        }
        report_groups(m, w, r);
        if r.undescribed_stores > 0 {
            m.kv_ignored.with_label_values(&[w, "undescribed"]).inc_by(r.undescribed_stores);
            if self.warned_undescribed.insert(slot) {
                tracing::warn!(
                    worker = w,
                    stores = r.undescribed_stores,
                    "offload-tier BlockStored without token ids (vLLM's placeholder payload); skipped: set the offloading connector's kv_connector_extra_config self_describing_kv_events = true so its CPU/disk tiers can be routed to"
                );
            }
        }
        if r.unusable_extra_keys > 0 {
            m.kv_unusable_extra_keys.with_label_values(&[w]).inc_by(r.unusable_extra_keys);
            tracing::debug!(
                worker = w,
                stores = r.unusable_extra_keys,
                "BlockStored with extra_keys no request can reproduce; indexed, never matched"
            );
        }
        if r.malformed_stores > 0 {
            m.kv_ignored.with_label_values(&[w, "malformed"]).inc_by(r.malformed_stores);
            tracing::warn!(
                worker = w,
                stores = r.malformed_stores,
                "BlockStored with token ids not covering its block hashes; skipped"
            );
        }
        if r.seed_refusals > 0 {
            m.kv_ignored.with_label_values(&[w, "seed_table_full"]).inc_by(r.seed_refusals);
            tracing::warn!(
                worker = w,
                stores = r.seed_refusals,
                max_seeds = crate::index::MAX_SEEDS,
                "BlockStored with a new LoRA/cache_salt seed while the index's seed table is full of seeds in use; skipped"
            );
        }
        if r.recovered_orphans > 0 {
            m.kv_orphan_recovered.with_label_values(&[w]).inc_by(r.recovered_orphans);
            tracing::info!(worker = w, stores = r.recovered_orphans, "BlockStored with unknown parent indexed: parent chain learned from a prompt routed to the worker");
        }
        if r.orphan_stores > 0 {
            m.kv_orphan_stores.with_label_values(&[w]).inc_by(r.orphan_stores);
            tracing::debug!(
                worker = w,
                stores = r.orphan_stores,
                "BlockStored with unknown parent; not indexed"
            );
        }
        if r.block_size_mismatches > 0 {
            m.kv_block_size_mismatch
                .with_label_values(&[w, &crate::metrics::model_label(model)])
                .inc_by(r.block_size_mismatches);
            let now = Instant::now();
            let due = self
                .last_mismatch_log
                .get(&slot)
                .is_none_or(|t| now.duration_since(*t) >= Duration::from_secs(10));
            if due {
                self.last_mismatch_log.insert(slot, now);
                tracing::error!(
                    worker = w,
                    model,
                    engine_block_size = r.mismatched_block_size.unwrap_or(0),
                    configured_block_size = block_size,
                    refused = r.block_size_mismatches,
                    "BLOCK SIZE MISMATCH: the engine's KV blocks do not match its model's block_size; its events are refused and KV routing to it is blind"
                );
            }
        }
        if r.resynced {
            m.kv_resyncs.with_label_values(&[w, "too_many_blocks"]).inc();
            tracing::warn!(worker = w, limit = self.config.max_blocks_per_worker, "worker claims more blocks than routing.max_blocks_per_worker (lost removals?); cleared");
        }
    }

    fn publish_gauges(&mut self, index: &KvIndex) {
        self.gauges.blocks.store(index.blocks() as u64, Ordering::Relaxed);
        self.gauges.entries.store(index.entries() as u64, Ordering::Relaxed);
        let evictions = index.evictions();
        let seen = self.metrics.index_evictions.get();
        if evictions > seen {
            self.metrics.index_evictions.inc_by(evictions - seen);
        }
        // The byte estimate walks every entry: at most every 10 s.
        let now = Instant::now();
        if self.last_bytes_at.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(10)) {
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

/// Counts what a batch did to worker `w`'s KV cache groups beyond the main one (hybrid models).
fn report_groups(m: &Metrics, w: &str, r: &ApplyReport) {
    for (op, n) in
        [("group_stored", r.group_stored_blocks), ("group_removed", r.group_removed_blocks)]
    {
        if n > 0 {
            m.kv_blocks.with_label_values(&[w, op]).inc_by(n);
        }
    }
    if r.group_refused > 0 {
        m.kv_ignored.with_label_values(&[w, "group_full"]).inc_by(r.group_refused);
        tracing::warn!(worker = w, stores = r.group_refused, "KV cache group stores refused: the groups hold routing.index_max_entries blocks; the worker's hybrid overlap is under-predicted");
    }
    if r.unknown_kind_events > 0 {
        m.kv_unknown_group_kind.with_label_values(&[w]).inc_by(r.unknown_kind_events);
        tracing::debug!(worker = w, stores = r.unknown_kind_events, "BlockStored of a KV cache group kind the indexer does not model: served as the group's leading run");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::decode::KvEvent;
    use std::sync::mpsc::sync_channel;
    use std::thread::JoinHandle;

    /// An applier thread over a fresh index with room for 2^20 blocks.
    fn running_applier(
    ) -> (Arc<RwLock<KvIndex>>, Arc<Metrics>, SyncSender<ApplierMsg>, JoinHandle<()>) {
        let metrics = Arc::new(Metrics::new().expect("metrics"));
        let index = Arc::new(RwLock::new(KvIndex::new(1 << 20, 1 << 20)));
        let config = ApplierConfig {
            max_entries: 1 << 20,
            max_blocks_per_worker: 1 << 20,
            approx_ttl: Duration::from_secs(60),
            approx_max_blocks_per_worker: 1000,
        };
        let applier =
            Applier::new(index.clone(), metrics.clone(), Arc::default(), Arc::default(), config);
        let (tx, rx) = sync_channel(16);
        (index, metrics, tx, std::thread::spawn(move || applier.run(rx)))
    }

    /// Worker `w0` (block size 4) into slot 0.
    fn add_w0(tx: &SyncSender<ApplierMsg>) {
        tx.send(ApplierMsg::AddWorker {
            slot: 0,
            label: "w0".into(),
            model: "m".into(),
            block_size: 4,
            stats: Arc::default(),
        })
        .expect("send");
    }

    /// While a query holds the read lock, the applier waits for the write lock without keeping
    /// other queries out: a new reader gets in at once (a writer queued on the lock would make it
    /// wait until the writer had held and released the lock).
    #[test]
    fn queries_are_not_kept_out_while_the_applier_waits_for_the_lock() {
        let (index, _metrics, tx, thread) = running_applier();
        let long_query = index.read();
        add_w0(&tx);
        let (done_tx, done_rx) = sync_channel(1);
        tx.send(ApplierMsg::Barrier(done_tx)).expect("send");
        // The applier is now waiting for the write lock (well within WRITE_PATIENCE).
        std::thread::sleep(Duration::from_millis(20));
        assert!(WRITE_PATIENCE > Duration::from_millis(50));
        assert!(index.try_read().is_some(), "a new query got the read lock at once");
        assert!(done_rx.try_recv().is_err(), "nothing was applied while the query held the lock");
        drop(long_query);
        done_rx.recv_timeout(Duration::from_secs(30)).expect("applied once the query left");
        drop(tx);
        thread.join().expect("applier thread");
        assert_eq!(index.read().check_consistent(), Ok(()));
    }

    /// A long store through the applier thread: applied whole, in stretches of at most
    /// [`HOLD_BLOCKS`] blocks between points where route queries get in, tables grown off the lock.
    #[test]
    fn a_long_store_is_applied_in_short_write_stretches() {
        let (index, metrics, tx, thread) = running_applier();
        add_w0(&tx);
        let blocks = 3_000usize;
        let tokens: Vec<u32> = (0..blocks as u32 * 4).collect();
        let store = KvEvent::Stored {
            block_hashes: (1..=blocks as u64).collect(),
            parent: None,
            token_ids: tokens.clone(),
            block_size: 4,
            lora_name: None,
            cache_salt: None,
            medium: None,
            group_idx: None,
            spec_kind: None,
            sliding_window: None,
            extra_terms: vec![],
        };
        tx.send(ApplierMsg::Batch {
            slot: 0,
            seq: 0,
            batch: EventBatch { ts: 0.0, events: vec![store], dp_rank: None },
        })
        .expect("send");
        let (done_tx, done_rx) = sync_channel(1);
        tx.send(ApplierMsg::Barrier(done_tx)).expect("send");
        done_rx.recv_timeout(Duration::from_secs(30)).expect("applied");
        drop(tx);
        thread.join().expect("applier thread");

        let chains =
            kvmesh_core::hashing::sequence_hashes(&tokens, 4, kvmesh_core::hashing::XXH3_SEED);
        assert_eq!(
            index.read().find_matches(&chains),
            vec![(0, blocks as u32)],
            "the whole store is held"
        );
        // One stretch per HOLD_BLOCKS blocks, plus one per table growth (the empty tables grow
        // before the first piece and again as they fill), plus the worker's registration.
        let stretches = metrics.index_write_hold.get_sample_count() as usize;
        assert!(stretches > blocks / HOLD_BLOCKS, "{stretches} stretches for {blocks} blocks");
        assert_eq!(index.read().check_consistent(), Ok(()));
    }
}
