//! The set of worker slots holding one block, and the shrinking "still matching" set of a query.
//!
//! Most blocks are held by one or two workers, a few (shared system prompts) by most of the fleet.
//! [`WorkerSet`] therefore keeps up to three slots inline (16 bytes, no allocation) and switches to
//! a bitmap beyond that, so that a query walking 512 blocks held by 1,000 workers intersects 16
//! words per block instead of 1,000 ids. [`Active`] is the query side of the same idea.

/// A dense worker number (index into bitmaps). Slots are reused after a worker leaves.
pub type WorkerSlot = u32;

const INLINE: usize = 3;

/// Which workers hold one block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerSet {
    /// Up to three slots, sorted, `len` of them valid.
    Few { len: u8, ids: [WorkerSlot; INLINE] },
    /// A bitmap over slots with its population count.
    Many(Box<Bitmap>),
}

/// A bitmap over worker slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bitmap {
    pub(crate) count: u32,
    pub(crate) words: Vec<u64>,
}

impl Bitmap {
    fn contains(&self, slot: WorkerSlot) -> bool {
        let (w, b) = split(slot);
        self.words.get(w).is_some_and(|word| word & (1u64 << b) != 0)
    }
}

fn split(slot: WorkerSlot) -> (usize, u32) {
    ((slot / 64) as usize, slot % 64)
}

impl Default for WorkerSet {
    fn default() -> Self {
        Self::Few { len: 0, ids: [0; INLINE] }
    }
}

impl WorkerSet {
    /// A set holding only `slot`.
    pub fn single(slot: WorkerSlot) -> Self {
        Self::Few { len: 1, ids: [slot, 0, 0] }
    }

    /// Number of slots in the set.
    pub fn len(&self) -> usize {
        match self {
            Self::Few { len, .. } => *len as usize,
            Self::Many(b) => b.count as usize,
        }
    }

    /// Whether no worker holds the block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `slot` is in the set.
    #[inline]
    pub fn contains(&self, slot: WorkerSlot) -> bool {
        match self {
            Self::Few { len, ids } => ids[..*len as usize].contains(&slot),
            Self::Many(b) => b.contains(slot),
        }
    }

    /// Adds `slot`; true when it was not there.
    pub fn insert(&mut self, slot: WorkerSlot) -> bool {
        match self {
            Self::Few { len, ids } => {
                let n = *len as usize;
                if ids[..n].contains(&slot) {
                    return false;
                }
                if n < INLINE {
                    ids[n] = slot;
                    *len += 1;
                    ids[..=n].sort_unstable();
                    return true;
                }
                let mut bitmap = Bitmap { count: 0, words: Vec::new() };
                for s in ids.iter().copied().chain(std::iter::once(slot)) {
                    set_bit(&mut bitmap, s);
                }
                *self = Self::Many(Box::new(bitmap));
                true
            }
            Self::Many(b) => {
                if b.contains(slot) {
                    return false;
                }
                set_bit(b, slot);
                true
            }
        }
    }

    /// Removes `slot`; true when it was there. A bitmap that shrinks to three goes back inline.
    pub fn remove(&mut self, slot: WorkerSlot) -> bool {
        match self {
            Self::Few { len, ids } => {
                let n = *len as usize;
                let Some(pos) = ids[..n].iter().position(|&s| s == slot) else { return false };
                ids.copy_within(pos + 1..n, pos);
                *len -= 1;
                true
            }
            Self::Many(b) => {
                if !b.contains(slot) {
                    return false;
                }
                let (w, bit) = split(slot);
                b.words[w] &= !(1u64 << bit);
                b.count -= 1;
                if b.count as usize <= INLINE {
                    let mut ids = [0; INLINE];
                    let mut len = 0u8;
                    for s in bits(&b.words) {
                        ids[len as usize] = s;
                        len += 1;
                    }
                    *self = Self::Few { len, ids };
                }
                true
            }
        }
    }

    /// The slots, ascending.
    pub fn iter(&self) -> SetIter<'_> {
        match self {
            Self::Few { len, ids } => SetIter::Few(ids[..*len as usize].iter()),
            Self::Many(b) => SetIter::Many(Box::new(bits(&b.words))),
        }
    }

    /// Heap bytes owned by this set (for the memory figure).
    pub fn heap_bytes(&self) -> usize {
        match self {
            Self::Few { .. } => 0,
            Self::Many(b) => std::mem::size_of::<Bitmap>() + b.words.capacity() * 8,
        }
    }
}

/// Iterator over a [`WorkerSet`] (no allocation for inline sets).
pub enum SetIter<'a> {
    Few(std::slice::Iter<'a, WorkerSlot>),
    Many(Box<dyn Iterator<Item = WorkerSlot> + 'a>),
}

impl Iterator for SetIter<'_> {
    type Item = WorkerSlot;
    fn next(&mut self) -> Option<WorkerSlot> {
        match self {
            Self::Few(it) => it.next().copied(),
            Self::Many(it) => it.next(),
        }
    }
}

fn set_bit(b: &mut Bitmap, slot: WorkerSlot) {
    let (w, bit) = split(slot);
    if b.words.len() <= w {
        b.words.resize(w + 1, 0);
    }
    b.words[w] |= 1u64 << bit;
    b.count += 1;
}

/// Set bits of `words` as slots, ascending.
pub(crate) fn bits(words: &[u64]) -> impl Iterator<Item = WorkerSlot> + '_ {
    words.iter().enumerate().flat_map(|(i, &word)| {
        let mut w = word;
        std::iter::from_fn(move || {
            if w == 0 {
                return None;
            }
            let b = w.trailing_zeros();
            w &= w - 1;
            Some(i as u32 * 64 + b)
        })
    })
}

/// The workers still matching every block so far during one `find_matches` walk.
pub(crate) enum Active {
    List(Vec<WorkerSlot>),
    Bits { words: Vec<u64>, count: u32 },
}

/// Below this many workers a bitmap query set becomes a list (cheaper per block).
const LIST_BELOW: u32 = 8;

impl Active {
    pub(crate) fn from_set(set: &WorkerSet) -> Self {
        match set {
            WorkerSet::Few { len, ids } => Self::List(ids[..*len as usize].to_vec()),
            WorkerSet::Many(b) => Self::Bits { words: b.words.clone(), count: b.count },
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        match self {
            Self::List(l) => l.is_empty(),
            Self::Bits { count, .. } => *count == 0,
        }
    }

    /// Keeps only the workers in `set`; calls `dropped` for each one that leaves.
    pub(crate) fn intersect(&mut self, set: &WorkerSet, mut dropped: impl FnMut(WorkerSlot)) {
        match self {
            Self::List(list) => list.retain(|&s| {
                let keep = set.contains(s);
                if !keep {
                    dropped(s);
                }
                keep
            }),
            Self::Bits { words, count } => {
                match set {
                    WorkerSet::Many(b) => {
                        // Fast path: the block's holders are a superset of the active set.
                        let mut same = true;
                        for (i, w) in words.iter().enumerate() {
                            let other = b.words.get(i).copied().unwrap_or(0);
                            same &= w & !other == 0;
                        }
                        if same {
                            return;
                        }
                        for (i, w) in words.iter_mut().enumerate() {
                            let other = b.words.get(i).copied().unwrap_or(0);
                            let gone = *w & !other;
                            for s in bits(std::slice::from_ref(&gone)) {
                                dropped(i as u32 * 64 + s);
                            }
                            *count -= gone.count_ones();
                            *w &= other;
                        }
                    }
                    WorkerSet::Few { .. } => {
                        let keep: Vec<WorkerSlot> = set.iter().filter(|&s| bit(words, s)).collect();
                        for s in bits(words) {
                            if !keep.contains(&s) {
                                dropped(s);
                            }
                        }
                        *self = Self::List(keep);
                        return;
                    }
                }
                if *count < LIST_BELOW {
                    *self = Self::List(bits(words).collect());
                }
            }
        }
    }

    /// Whether every active worker is in `set`.
    pub(crate) fn subset_of(&self, set: &WorkerSet) -> bool {
        match (self, set) {
            (Self::List(l), _) => l.iter().all(|&s| set.contains(s)),
            (Self::Bits { words, .. }, WorkerSet::Many(b)) => {
                words.iter().enumerate().all(|(i, w)| w & !b.words.get(i).copied().unwrap_or(0) == 0)
            }
            (Self::Bits { count, words }, WorkerSet::Few { .. }) => {
                *count as usize <= set.len() && bits(words).all(|s| set.contains(s))
            }
        }
    }

    /// Whether any active worker's bit is set in `words`.
    pub(crate) fn any_in(&self, words: &[u64]) -> bool {
        match self {
            Self::List(l) => l.iter().any(|&s| bit(words, s)),
            Self::Bits { words: mine, .. } => mine.iter().zip(words).any(|(a, b)| a & b != 0),
        }
    }

    pub(crate) fn for_each(&self, mut f: impl FnMut(WorkerSlot)) {
        match self {
            Self::List(l) => l.iter().copied().for_each(f),
            Self::Bits { words, .. } => bits(words).for_each(&mut f),
        }
    }
}

fn bit(words: &[u64], slot: WorkerSlot) -> bool {
    let (w, b) = split(slot);
    words.get(w).is_some_and(|word| word & (1u64 << b) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn grows_to_a_bitmap_and_back() {
        let mut s = WorkerSet::default();
        let mut model = BTreeSet::new();
        let ops: &[(bool, u32)] =
            &[(true, 5), (true, 1), (true, 5), (true, 900), (true, 64), (false, 1), (true, 2), (false, 900), (false, 64), (false, 7)];
        for &(insert, slot) in ops {
            let changed = if insert { s.insert(slot) } else { s.remove(slot) };
            let model_changed = if insert { model.insert(slot) } else { model.remove(&slot) };
            assert_eq!(changed, model_changed, "{insert} {slot}");
            assert_eq!(s.iter().collect::<BTreeSet<_>>(), model);
            assert_eq!(s.len(), model.len());
        }
        assert!(matches!(s, WorkerSet::Few { .. }));
    }

    #[test]
    fn active_set_intersects_and_reports_drops() {
        let mut big = WorkerSet::default();
        for s in 0..100 {
            big.insert(s);
        }
        let mut smaller = big.clone();
        for s in (0..100).step_by(2) {
            smaller.remove(s);
        }
        let mut active = Active::from_set(&big);
        let mut dropped = Vec::new();
        active.intersect(&big, |s| dropped.push(s));
        assert!(dropped.is_empty());
        active.intersect(&smaller, |s| dropped.push(s));
        assert_eq!(dropped, (0..100).step_by(2).collect::<Vec<_>>());
        dropped.clear();
        let mut few = WorkerSet::single(3);
        few.insert(4);
        active.intersect(&few, |s| dropped.push(s));
        let mut left = Vec::new();
        active.for_each(|s| left.push(s));
        assert_eq!(left, vec![3]);
        assert_eq!(dropped.len(), 49);
    }
}
