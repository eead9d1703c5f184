//! The set of worker slots holding one block, packed into one 64-bit word, and the shrinking
//! "still matching" set of a query.
//!
//! Most blocks are held by one or two workers, a few (shared system prompts) by much of the fleet.
//! A block's holders therefore live in the block's table slot itself — up to three 20-bit slot
//! numbers, no allocation, no pointer to chase — and beyond three in a bitmap in one shared arena
//! ([`Bitmaps`], fixed stride, free list) that the word points into, so a query over 512 blocks
//! held by 1,000 workers intersects 16 words per block. The same word carries the block's CLOCK
//! age (two bits), which queries refresh through an atomic under the read lock.
//!
//! Word layout: bits 0..60 three slot fields (unused = all ones) or, with [`BITMAP`], the arena
//! index (bits 0..32) and holder count (bits 32..53); bits 60..62 the age; bit 62 [`BITMAP`]. An
//! occupied word is never 0 (an inline word has at least one unused all-ones field or three
//! distinct slots), so 0 marks an empty table slot. [`Active`] is the query side.

/// A dense worker number (index into bitmaps). Slots are reused after a worker leaves.
pub type WorkerSlot = u32;

/// Highest slot the index accepts (slot numbers are packed in 20 bits).
pub const MAX_SLOT: WorkerSlot = (1 << 20) - 2;

const FIELD: u32 = 20;
const NONE: u64 = (1 << FIELD) - 1;
const INLINE: usize = 3;
const INLINE_MASK: u64 = (1 << 60) - 1;
pub(crate) const AGE_SHIFT: u32 = 60;
pub(crate) const AGE_MASK: u64 = 3 << AGE_SHIFT;
/// The holders are a bitmap in the arena.
pub(crate) const BITMAP: u64 = 1 << 62;
const COUNT_SHIFT: u32 = 32;
const COUNT_MASK: u64 = ((1 << 21) - 1) << COUNT_SHIFT;

/// The word of a block held by `slot` alone, with age `age`.
pub(crate) fn single(slot: WorkerSlot, age: u64) -> u64 {
    u64::from(slot) | NONE << FIELD | NONE << (2 * FIELD) | age << AGE_SHIFT
}

fn field(word: u64, i: usize) -> u64 {
    (word >> (FIELD * i as u32)) & NONE
}

/// Bitmaps of worker slots, `stride` words each, in one vector.
#[derive(Default)]
pub(crate) struct Bitmaps {
    words: Vec<u64>,
    stride: usize,
    free: Vec<u32>,
}

impl Bitmaps {
    /// Makes room for slots below `slots` (re-lays the arena when the stride grows; rare).
    pub(crate) fn ensure_slots(&mut self, slots: usize) {
        let stride = slots.div_ceil(64).max(1);
        if stride <= self.stride {
            return;
        }
        let count = self.words.len() / self.stride.max(1);
        let mut words = vec![0u64; count * stride];
        for i in 0..count {
            words[i * stride..i * stride + self.stride]
                .copy_from_slice(&self.words[i * self.stride..(i + 1) * self.stride]);
        }
        self.words = words;
        self.stride = stride;
    }

    /// The words of bitmap `i`.
    #[inline]
    pub(crate) fn get(&self, i: u32) -> &[u64] {
        let at = i as usize * self.stride;
        self.words.get(at..at + self.stride).unwrap_or(&[])
    }

    fn get_mut(&mut self, i: u32) -> &mut [u64] {
        let at = i as usize * self.stride;
        self.words.get_mut(at..at + self.stride).unwrap_or(&mut [])
    }

    /// Loads bitmap `i`'s first line (see `Table::touch`).
    #[inline]
    pub(crate) fn touch(&self, i: u32) -> u64 {
        self.words.get(i as usize * self.stride).copied().unwrap_or(0)
    }

    fn alloc(&mut self) -> u32 {
        if let Some(i) = self.free.pop() {
            return i;
        }
        let i = (self.words.len() / self.stride.max(1)) as u32;
        self.words.resize(self.words.len() + self.stride.max(1), 0);
        i
    }

    fn release(&mut self, i: u32) {
        self.get_mut(i).fill(0);
        self.free.push(i);
        if self.free.len() * self.stride.max(1) == self.words.len() {
            // Every bitmap is free: give the memory back.
            self.words = Vec::new();
            self.free = Vec::new();
        }
    }

    /// Heap bytes allocated.
    pub(crate) fn bytes(&self) -> usize {
        self.words.capacity() * 8 + self.free.capacity() * 4
    }
}

/// A read-only view of one block's holders.
#[derive(Clone, Copy)]
pub(crate) enum Holders<'a> {
    /// The block word itself: up to three slot fields, unused ones all ones (never a valid slot,
    /// so a slot is looked up by comparing all three fields without decoding).
    Inline(u64),
    Bits {
        words: &'a [u64],
        count: u32,
    },
}

impl<'a> Holders<'a> {
    /// Views `word` (an occupied block word).
    #[inline]
    pub(crate) fn of(word: u64, bitmaps: &'a Bitmaps) -> Self {
        if word & BITMAP != 0 {
            return Self::Bits {
                words: bitmaps.get(word as u32),
                count: ((word & COUNT_MASK) >> COUNT_SHIFT) as u32,
            };
        }
        Self::Inline(word)
    }

    /// Number of holders.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Inline(word) => count(*word),
            Self::Bits { count, .. } => *count as usize,
        }
    }

    /// Whether `slot` holds the block.
    #[inline]
    pub(crate) fn contains(&self, slot: WorkerSlot) -> bool {
        match self {
            Self::Inline(word) => {
                let s = u64::from(slot);
                field(*word, 0) == s || field(*word, 1) == s || field(*word, 2) == s
            }
            Self::Bits { words, .. } => bit(words, slot),
        }
    }

    /// Calls `f` for every holder, ascending for bitmaps.
    pub(crate) fn for_each(&self, mut f: impl FnMut(WorkerSlot)) {
        match self {
            Self::Inline(word) => (0..INLINE)
                .map(|i| field(*word, i))
                .take_while(|&x| x != NONE)
                .for_each(|x| f(x as WorkerSlot)),
            Self::Bits { words, .. } => for_each_bit(words, &mut f),
        }
    }
}

/// Adds `slot` to the holders in `word`; true when it was not there. Keeps the age bits.
pub(crate) fn insert(word: &mut u64, slot: WorkerSlot, bitmaps: &mut Bitmaps) -> bool {
    if *word & BITMAP != 0 {
        let i = *word as u32;
        let words = bitmaps.get_mut(i);
        let (w, b) = split(slot);
        let Some(cell) = words.get_mut(w) else { return false };
        if *cell & (1 << b) != 0 {
            return false;
        }
        *cell |= 1 << b;
        *word += 1 << COUNT_SHIFT;
        return true;
    }
    let mut free = None;
    for i in 0..INLINE {
        let f = field(*word, i);
        if f == u64::from(slot) {
            return false;
        }
        if f == NONE {
            free = Some(i);
            break;
        }
    }
    if let Some(i) = free {
        let shift = FIELD * i as u32;
        *word = (*word & !(NONE << shift)) | u64::from(slot) << shift;
        return true;
    }
    // Three inline already: move to a bitmap.
    let i = bitmaps.alloc();
    let words = bitmaps.get_mut(i);
    for s in (0..INLINE).map(|f| field(*word, f) as WorkerSlot).chain(std::iter::once(slot)) {
        let (w, b) = split(s);
        if let Some(cell) = words.get_mut(w) {
            *cell |= 1 << b;
        }
    }
    *word = (*word & AGE_MASK) | BITMAP | (INLINE as u64 + 1) << COUNT_SHIFT | u64::from(i);
    true
}

/// Removes `slot` from the holders in `word`; true when it was there. A bitmap shrinking to three
/// goes back inline (its arena bitmap is released). Leaves an inline word with no holder at all
/// ones in its fields: check [`count`] and drop the block.
pub(crate) fn remove(word: &mut u64, slot: WorkerSlot, bitmaps: &mut Bitmaps) -> bool {
    if *word & BITMAP != 0 {
        let i = *word as u32;
        let words = bitmaps.get_mut(i);
        let (w, b) = split(slot);
        let Some(cell) = words.get_mut(w) else { return false };
        if *cell & (1 << b) == 0 {
            return false;
        }
        *cell &= !(1 << b);
        *word -= 1 << COUNT_SHIFT;
        if count(*word) <= INLINE {
            let mut inline = NONE | NONE << FIELD | NONE << (2 * FIELD);
            let mut n = 0;
            for_each_bit(words, |s| {
                let shift = FIELD * n;
                inline = (inline & !(NONE << shift)) | u64::from(s) << shift;
                n += 1;
            });
            bitmaps.release(i);
            *word = (*word & AGE_MASK) | inline;
        }
        return true;
    }
    let fields: [u64; INLINE] = std::array::from_fn(|i| field(*word, i));
    if !fields.contains(&u64::from(slot)) {
        return false;
    }
    let mut kept = fields.iter().copied().filter(|&f| f != u64::from(slot) && f != NONE);
    let mut inline = 0;
    for i in 0..INLINE {
        inline |= kept.next().unwrap_or(NONE) << (FIELD * i as u32);
    }
    *word = (*word & !INLINE_MASK) | inline;
    true
}

/// Number of holders in `word`.
#[inline]
pub(crate) fn count(word: u64) -> usize {
    if word & BITMAP != 0 {
        return ((word & COUNT_MASK) >> COUNT_SHIFT) as usize;
    }
    (0..INLINE).take_while(|&i| field(word, i) != NONE).count()
}

/// Releases the arena bitmap of `word`, if it has one (the block leaves the index).
pub(crate) fn release(word: u64, bitmaps: &mut Bitmaps) {
    if word & BITMAP != 0 {
        bitmaps.release(word as u32);
    }
}

fn split(slot: WorkerSlot) -> (usize, u32) {
    ((slot / 64) as usize, slot % 64)
}

#[inline]
fn bit(words: &[u64], slot: WorkerSlot) -> bool {
    let (w, b) = split(slot);
    words.get(w).is_some_and(|word| word & (1u64 << b) != 0)
}

fn for_each_bit(words: &[u64], mut f: impl FnMut(WorkerSlot)) {
    for (i, &word) in words.iter().enumerate() {
        let mut w = word;
        while w != 0 {
            f(i as u32 * 64 + w.trailing_zeros());
            w &= w - 1;
        }
    }
}

/// Below this many workers a query's active set is a list (cheaper per block than a bitmap).
const LIST: usize = 8;

/// The workers still matching every block so far during one `find_matches` walk.
pub(crate) enum Active {
    List { ids: [WorkerSlot; LIST], len: usize },
    Bits { words: Vec<u64>, count: u32 },
}

impl Active {
    /// The holders of the first block.
    pub(crate) fn from_holders(h: &Holders<'_>) -> Self {
        match h {
            Holders::Bits { words, count } if *count as usize >= LIST => {
                Self::Bits { words: words.to_vec(), count: *count }
            }
            _ => {
                let mut ids = [0; LIST];
                let mut len = 0;
                h.for_each(|s| {
                    if len < LIST {
                        ids[len] = s;
                        len += 1;
                    }
                });
                Self::List { ids, len }
            }
        }
    }

    /// Workers in the set.
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::List { len, .. } => *len,
            Self::Bits { count, .. } => *count as usize,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps only the workers in `h`; calls `dropped` for each one that leaves.
    pub(crate) fn intersect(&mut self, h: &Holders<'_>, mut dropped: impl FnMut(WorkerSlot)) {
        match self {
            Self::List { ids, len } => {
                let mut kept = 0;
                for i in 0..*len {
                    let s = ids[i];
                    if h.contains(s) {
                        ids[kept] = s;
                        kept += 1;
                    } else {
                        dropped(s);
                    }
                }
                *len = kept;
            }
            Self::Bits { words, count } => {
                if let Holders::Bits { words: other, .. } = h {
                    let mut gone_any = 0;
                    for (i, w) in words.iter().enumerate() {
                        gone_any |= w & !other.get(i).copied().unwrap_or(0);
                    }
                    if gone_any == 0 {
                        // The block's holders are a superset of the active set (the common case).
                        return;
                    }
                }
                for (i, w) in words.iter_mut().enumerate() {
                    let gone = match h {
                        Holders::Bits { words: other, .. } => {
                            *w & !other.get(i).copied().unwrap_or(0)
                        }
                        Holders::Inline(_) => {
                            let mut keep = 0u64;
                            h.for_each(|s| {
                                if s / 64 == i as u32 {
                                    keep |= 1 << (s % 64);
                                }
                            });
                            *w & !keep
                        }
                    };
                    for_each_bit(std::slice::from_ref(&gone), |s| dropped(i as u32 * 64 + s));
                    *count -= gone.count_ones();
                    *w &= !gone;
                }
                if (*count as usize) < LIST {
                    let mut ids = [0; LIST];
                    let mut len = 0;
                    for_each_bit(words, |s| {
                        ids[len] = s;
                        len += 1;
                    });
                    *self = Self::List { ids, len };
                }
            }
        }
    }

    /// Whether every active worker is in `h`.
    #[inline]
    pub(crate) fn subset_of(&self, h: &Holders<'_>) -> bool {
        if self.len() > h.len() {
            return false;
        }
        match (self, h) {
            (Self::List { ids, len }, _) => ids[..*len].iter().all(|&s| h.contains(s)),
            (Self::Bits { words, .. }, Holders::Bits { words: other, .. }) => {
                words.iter().enumerate().all(|(i, w)| w & !other.get(i).copied().unwrap_or(0) == 0)
            }
            // A bitmap set has at least LIST members, more than an inline holder list.
            (Self::Bits { .. }, Holders::Inline(_)) => false,
        }
    }

    /// Whether any active worker's bit is set in `words`.
    pub(crate) fn any_in(&self, words: &[u64]) -> bool {
        match self {
            Self::List { ids, len } => ids[..*len].iter().any(|&s| bit(words, s)),
            Self::Bits { words: mine, .. } => mine.iter().zip(words).any(|(a, b)| a & b != 0),
        }
    }

    /// Calls `f` for every active worker.
    pub(crate) fn for_each(&self, mut f: impl FnMut(WorkerSlot)) {
        match self {
            Self::List { ids, len } => ids[..*len].iter().copied().for_each(f),
            Self::Bits { words, .. } => for_each_bit(words, &mut f),
        }
    }
}

#[cfg(test)]
#[path = "workers_tests.rs"]
mod tests;
