//! What the index's tables store: the per-worker mapping ([`BlockRef`] in a [`RefSlot`]), the
//! block slot ([`BlockSlot`]: chain hash → holders and CLOCK age), and the one-shot block hash
//! used when applying stores.

use std::hash::Hasher;
use std::sync::atomic::{AtomicU64, Ordering};

use kvmesh_core::hashing::{self, SequenceHash};

use super::table::Slot;

/// A hasher for the small seed map (keys are already hashes).
#[derive(Default, Clone, Copy)]
pub(super) struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 =
                (self.0.rotate_left(5) ^ u64::from(*b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        self.0 ^= self.0 >> 32;
    }
}

/// What a worker's engine hash stands for (24 bytes: the per-worker maps dominate memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef {
    pub chain: SequenceHash,
    /// Engine hash of the parent mapping (meaningful when `seed & HAS_PARENT`).
    pub(super) parent: u64,
    /// Index into the seed table (the local-hash seed of the chain, inherited by children), with
    /// [`HAS_PARENT`] and [`MAPPED`] in the top bits.
    pub(super) seed: u32,
    /// Live stores of this engine hash not yet removed (saturating).
    pub refs: u16,
    /// Mapped children chained after this block (saturating; `u16::MAX` = unknown, treated as many).
    pub(super) kids: u16,
}

const HAS_PARENT: u32 = 1 << 31;
/// Set in every stored `BlockRef`: marks its table slot occupied.
const MAPPED: u32 = 1 << 30;

impl BlockRef {
    pub(super) fn new(chain: SequenceHash, parent: Option<u64>, seed: u32) -> Self {
        let flag = if parent.is_some() { HAS_PARENT } else { 0 };
        Self { chain, parent: parent.unwrap_or(0), seed: seed | flag | MAPPED, refs: 0, kids: 0 }
    }
    pub(super) fn parent(&self) -> Option<u64> {
        (self.seed & HAS_PARENT != 0).then_some(self.parent)
    }
    pub(super) fn seed_id(&self) -> u32 {
        self.seed & !(HAS_PARENT | MAPPED)
    }
}

/// A per-worker table slot: engine hash → mapping.
#[derive(Clone, Copy)]
pub(super) struct RefSlot {
    pub(super) key: u64,
    pub(super) r: BlockRef,
}

impl Default for RefSlot {
    fn default() -> Self {
        Self {
            key: 0,
            r: BlockRef { chain: SequenceHash(0), parent: 0, seed: 0, refs: 0, kids: 0 },
        }
    }
}

impl Slot for RefSlot {
    fn key(&self) -> u64 {
        self.key
    }
    fn occupied(&self) -> bool {
        self.r.seed & MAPPED != 0
    }
    fn duplicate(&self) -> Self {
        *self
    }
}

/// A block table slot: chain hash → holders and age ([`workers`] layout; 0 = empty).
#[derive(Default)]
pub(super) struct BlockSlot {
    pub(super) key: u64,
    pub(super) word: AtomicU64,
}

impl Slot for BlockSlot {
    fn key(&self) -> u64 {
        self.key
    }
    fn occupied(&self) -> bool {
        self.word.load(Ordering::Relaxed) != 0
    }
    /// Readers refresh the age under the read lock: a refresh racing the copy may be lost, which
    /// only makes the block one CLOCK turn older.
    fn duplicate(&self) -> Self {
        Self { key: self.key, word: AtomicU64::new(self.word.load(Ordering::Relaxed)) }
    }
}

/// CLOCK ages: a block stored for the first time, and one used (found by a query, stored again).
pub(super) const AGE_NEW: u64 = 1;
pub(super) const AGE_USED: u64 = 2;

/// [`hashing::local_block_hash`] (the same value: XXH3-64 of the tokens as little-endian u32)
/// one-shot over a stack buffer: the streaming hasher behind that function allocates and derives a
/// seeded secret on every call, a third of the cost of applying a block.
pub(crate) fn block_hash(tokens: &[u32], seed: u64) -> hashing::LocalBlockHash {
    let mut buf = [0u8; 1024];
    let Some(bytes) = buf.get_mut(..tokens.len() * 4) else {
        return hashing::local_block_hash(tokens, seed);
    };
    for (b, t) in bytes.chunks_exact_mut(4).zip(tokens) {
        b.copy_from_slice(&t.to_le_bytes());
    }
    hashing::LocalBlockHash(hashing::xxh3(bytes, seed))
}
