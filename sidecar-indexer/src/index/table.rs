//! A flat open-addressing hash table for 64-bit keys, the storage under both index maps.
//!
//! Why not `std`'s `HashMap`: its control bytes and its slots live in two separate arrays, so
//! every lookup in a table bigger than the cache pays two dependent DRAM misses, and it offers no
//! way to fetch the slots of many keys at once. Here a slot holds its key and value together in
//! 64-byte lines (`N` slots per line), a key's home is the start of a line chosen by the high bits
//! of a multiplicative hash, and collisions probe linearly into the next slots, so a lookup is
//! normally one cache line. [`Table::touch`] loads a key's home line without looking at it: callers
//! touch the lines of a whole batch first so the CPU overlaps their misses, then do the real work
//! on lines already in cache. Deletion shifts later entries back (no tombstones), so a probe
//! always stops at the first empty slot.
//!
//! Emptiness is the slot's own business ([`Slot::occupied`]): every 64-bit key, 0 included, is a
//! valid key. The table grows at 3/4 load, to 5/8 load ([`grown_lines`]), and shrinks only when
//! asked ([`Table::shrink_if_sparse`]). Growing rehashes every entry, O(len): a caller that must not
//! do that while others wait asks [`Table::lines_for`] before inserting, builds the grown table
//! from `&self` ([`Table::rehashed`], so readers may go on meanwhile) and swaps it in.

/// One slot's contents.
pub(crate) trait Slot: Default {
    /// The key of an occupied slot.
    fn key(&self) -> u64;
    /// Whether the slot holds an entry (a `Default` slot must not).
    fn occupied(&self) -> bool;
    /// A copy of the slot, read through `&self` (for [`Table::rehashed`]).
    fn duplicate(&self) -> Self;
}

/// `N` slots filling (at most) one cache line.
#[repr(C, align(64))]
struct Line<S, const N: usize>([S; N]);

impl<S: Slot, const N: usize> Default for Line<S, N> {
    fn default() -> Self {
        Self(std::array::from_fn(|_| S::default()))
    }
}

/// Fewest lines a non-empty table has.
const MIN_LINES: usize = 2;

/// The hash behind a key's home line. Keys may be well-mixed hashes (chain hashes) or small
/// structured numbers (engine ids), so fold the high half in before multiplying; the line is taken
/// from the high bits of the product.
#[inline]
fn mix(key: u64) -> u64 {
    (key ^ (key >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

/// The line count a table of `lines` lines grows to for `entries` entries: enough for them at 5/8
/// load (at least one line more). Grown at 3/4 and back to 5/8, a table's load stays in 5/8..3/4
/// as it grows; doubling left it anywhere in 3/8..3/4, and a worker's map of 65,536 blocks (a
/// power of two, like many engines' block counts) at exactly 1/2 — its mappings took 64 bytes
/// each instead of at most 51 (`kvmesh-bench scale`, e2e/bench/HISTORY.md). The price is more
/// rehashing while a table grows (an entry is moved about six times on its way up instead of
/// twice), off the write lock ([`super::growth`]); none once the table is at its size.
fn grown_lines(lines: usize, entries: usize, per_line: usize) -> usize {
    (entries * 8).div_ceil(5 * per_line.max(1)).max(lines + 1).max(MIN_LINES)
}

/// An open-addressing table of `S` slots, `N` to a 64-byte line.
pub(crate) struct Table<S, const N: usize> {
    lines: Vec<Line<S, N>>,
    len: usize,
}

impl<S: Slot, const N: usize> Default for Table<S, N> {
    fn default() -> Self {
        Self { lines: Vec::new(), len: 0 }
    }
}

impl<S: Slot, const N: usize> Table<S, N> {
    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Slots allocated (positions for [`Table::at`]).
    pub(crate) fn slots(&self) -> usize {
        self.lines.len() * N
    }

    /// Heap bytes allocated.
    pub(crate) fn bytes(&self) -> usize {
        self.lines.capacity() * std::mem::size_of::<Line<S, N>>()
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        // Lemire's multiply-shift range reduction: the high bits of the mixed key, any line count.
        ((u128::from(mix(key)) * self.lines.len() as u128) >> 64) as usize * N
    }

    #[inline]
    fn slot(&self, pos: usize) -> &S {
        &self.lines[pos / N].0[pos % N]
    }

    #[inline]
    fn slot_mut(&mut self, pos: usize) -> &mut S {
        &mut self.lines[pos / N].0[pos % N]
    }

    /// Loads `key`'s home line and returns a word of it, so a batch of independent touches
    /// overlaps its cache misses. Feed the results to `std::hint::black_box`.
    #[inline]
    pub(crate) fn touch(&self, key: u64) -> u64 {
        if self.lines.is_empty() {
            return 0;
        }
        self.slot(self.home(key)).key()
    }

    /// Position of `key`, if present.
    #[inline]
    pub(crate) fn find(&self, key: u64) -> Option<usize> {
        if self.lines.is_empty() {
            return None;
        }
        let lines = self.lines.len();
        let mut line = self.home(key) / N;
        // A whole line is compared without branching on each slot: a key is usually in its home
        // line, so the one branch per line is predicted right even before the line arrives, and
        // the CPU goes on to the next lookup instead of stalling on a mispredicted slot test.
        // Correct because no empty slot ever lies between a key's home and the key (insertion
        // takes the first empty slot, deletion shifts back): a line with an empty slot and
        // without the key ends the search. The table is never full, so the probe ends.
        loop {
            let mut hit = N;
            let mut empty = false;
            for (k, s) in self.lines[line].0.iter().enumerate() {
                let occupied = s.occupied();
                hit = if occupied && s.key() == key { k } else { hit };
                empty |= !occupied;
            }
            if hit < N {
                return Some(line * N + hit);
            }
            if empty {
                return None;
            }
            line += 1;
            if line == lines {
                line = 0;
            }
        }
    }

    /// The entry for `key`.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<&S> {
        self.find(key).map(|p| self.slot(p))
    }

    /// The entry for `key`, mutably.
    #[inline]
    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut S> {
        self.find(key).map(|p| self.slot_mut(p))
    }

    /// The slot at `pos`, mutably. Callers must leave an occupied slot occupied with its key.
    pub(crate) fn at_mut(&mut self, pos: usize) -> &mut S {
        self.slot_mut(pos)
    }

    /// The entry for `key`, inserting `make()` (which must be occupied, with that key) if absent.
    /// Returns the slot and whether it was inserted.
    pub(crate) fn get_or_insert_with(
        &mut self,
        key: u64,
        make: impl FnOnce() -> S,
    ) -> (&mut S, bool) {
        if (self.len + 1) * 4 > self.slots() * 3 {
            if let Some(p) = self.find(key) {
                return (self.slot_mut(p), false);
            }
            self.resize(grown_lines(self.lines.len(), self.len + 1, N));
        }
        let total = self.slots();
        let mut pos = self.home(key);
        loop {
            let s = self.slot(pos);
            if !s.occupied() {
                break;
            }
            if s.key() == key {
                return (self.slot_mut(pos), false);
            }
            pos += 1;
            if pos == total {
                pos = 0;
            }
        }
        self.len += 1;
        let s = self.slot_mut(pos);
        *s = make();
        (s, true)
    }

    /// Removes and returns the entry at `pos` (occupied). Later entries of the probe run shift
    /// back into the hole, so an entry from further on may now sit at `pos`.
    pub(crate) fn remove_at(&mut self, pos: usize) -> S {
        let total = self.slots();
        let out = std::mem::take(self.slot_mut(pos));
        self.len -= 1;
        let mut hole = pos;
        let mut j = pos;
        loop {
            j += 1;
            if j == total {
                j = 0;
            }
            let s = self.slot(j);
            if !s.occupied() {
                break;
            }
            // The entry at j may fill the hole if the hole lies on its probe path (home..j).
            let home = self.home(s.key());
            let from_home = (j + total - home) % total;
            let from_hole = (j + total - hole) % total;
            if from_home >= from_hole {
                let moved = std::mem::take(self.slot_mut(j));
                *self.slot_mut(hole) = moved;
                hole = j;
            }
        }
        out
    }

    /// Gives memory back after mass removals: halves the table while it is under 1/8 full. Not
    /// done on every removal, so a table that empties and refills (churn) is not rebuilt each time.
    pub(crate) fn shrink_if_sparse(&mut self) {
        let mut lines = self.lines.len();
        while lines > MIN_LINES && self.len * 8 < lines * N {
            lines /= 2;
        }
        if lines < self.lines.len() {
            self.resize(lines.max(MIN_LINES));
        }
    }

    /// Removes and returns the entry for `key`.
    #[cfg(test)]
    pub(crate) fn remove(&mut self, key: u64) -> Option<S> {
        self.find(key).map(|p| self.remove_at(p))
    }

    /// The occupied slots, in table order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &S> + '_ {
        self.lines.iter().flat_map(|l| l.0.iter()).filter(|s| s.occupied())
    }

    /// Empties the table and frees its memory, returning the old contents.
    pub(crate) fn take(&mut self) -> Self {
        std::mem::take(self)
    }

    /// The line count `additional` more entries would grow the table to, or `None` when they fit
    /// (the test of [`Table::get_or_insert_with`] for the last of them: 3/4 load).
    pub(crate) fn lines_for(&self, additional: usize) -> Option<usize> {
        let entries = self.len + additional;
        (entries * 4 > self.slots() * 3).then(|| grown_lines(self.lines.len(), entries, N))
    }

    /// A copy of the table with `lines` lines (≥ what its entries need), built from `&self`.
    pub(crate) fn rehashed(&self, lines: usize) -> Self {
        let mut t = Self { lines: (0..lines).map(|_| Line::default()).collect(), len: 0 };
        for s in self.iter() {
            t.place(s.duplicate());
        }
        t
    }

    fn resize(&mut self, lines: usize) {
        let old = std::mem::replace(&mut self.lines, (0..lines).map(|_| Line::default()).collect());
        self.len = 0;
        for line in old {
            for s in line.0 {
                if s.occupied() {
                    self.place(s);
                }
            }
        }
    }

    /// Puts `s` (occupied, its key absent) at the first empty slot from its home.
    fn place(&mut self, s: S) {
        let total = self.slots();
        let mut pos = self.home(s.key());
        while self.slot(pos).occupied() {
            pos += 1;
            if pos == total {
                pos = 0;
            }
        }
        *self.slot_mut(pos) = s;
        self.len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[derive(Default, Debug, Clone, Copy, PartialEq)]
    struct Kv {
        key: u64,
        val: u64,
    }

    impl Slot for Kv {
        fn key(&self) -> u64 {
            self.key
        }
        fn occupied(&self) -> bool {
            self.val != 0
        }
        fn duplicate(&self) -> Self {
            *self
        }
    }

    fn check(t: &Table<Kv, 4>, model: &BTreeMap<u64, u64>) {
        assert_eq!(t.len(), model.len());
        for (k, v) in model {
            assert_eq!(t.get(*k).map(|s| s.val), Some(*v), "key {k}");
        }
        assert_eq!(t.iter().count(), model.len());
        if t.slots() > 0 {
            assert!(t.len() * 4 <= t.slots() * 3, "over 3/4 load");
        }
    }

    #[test]
    fn key_zero_and_colliding_keys_are_ordinary_keys() {
        let mut t: Table<Kv, 4> = Table::default();
        assert!(t.get(0).is_none());
        assert!(t.remove(0).is_none());
        // Keys differing only in high bits, and 0.
        let keys: Vec<u64> = (0..64).map(|i| i << 58).chain([0, 1, u64::MAX]).collect();
        let mut model = BTreeMap::new();
        for (i, k) in keys.iter().enumerate() {
            let (s, new) = t.get_or_insert_with(*k, || Kv { key: *k, val: i as u64 + 1 });
            assert_eq!(new, !model.contains_key(k));
            model.entry(*k).or_insert(s.val);
        }
        check(&t, &model);
        for k in keys.iter().step_by(3) {
            assert_eq!(t.remove(*k).map(|s| s.val), model.remove(k));
        }
        check(&t, &model);
    }

    #[test]
    fn a_growing_table_stays_between_five_eighths_and_three_quarters_full() {
        let mut t: Table<Kv, 2> = Table::default();
        let mut lowest: f64 = 1.0;
        for key in 1..=65_536u64 {
            t.get_or_insert_with(key, || Kv { key, val: key });
            if key >= 64 {
                lowest = lowest.min(t.len() as f64 / t.slots() as f64);
            }
        }
        // Doubling left 65,536 entries at exactly 1/2.
        assert!(lowest >= 0.6, "load fell to {lowest}");
        assert!(t.len() * 4 <= t.slots() * 3);
        assert_eq!(grown_lines(0, 1, 2), MIN_LINES);
        assert_eq!(grown_lines(10, 1, 4), 11, "at least one line more");
    }

    #[test]
    fn a_table_grown_ahead_by_a_copy_takes_that_many_inserts_without_growing() {
        let mut t: Table<Kv, 4> = Table::default();
        let mut model = BTreeMap::new();
        let mut key = 0u64;
        for additional in [1usize, 5, 6, 7, 100, 1000, 3] {
            match t.lines_for(additional) {
                Some(lines) => {
                    let copy = t.rehashed(lines);
                    check(&copy, &model);
                    t = copy;
                }
                None => {
                    assert!((t.len() + additional) * 4 <= t.slots() * 3, "fits without growing")
                }
            }
            let slots = t.slots();
            for _ in 0..additional {
                key += 1;
                t.get_or_insert_with(key * 0x9e37_79b9, || Kv { key: key * 0x9e37_79b9, val: key });
                model.insert(key * 0x9e37_79b9, key);
            }
            assert_eq!(
                t.slots(),
                slots,
                "{additional} inserts after room was made did not grow the table"
            );
            check(&t, &model);
        }
        assert_eq!(t.lines_for(0), None);
    }

    proptest::proptest! {
        // Random inserts and removals (small key space: long probe runs, wrap-around, shifting
        // deletion, growth and shrinking) always agree with a BTreeMap.
        #[test]
        fn agrees_with_a_btreemap(ops in proptest::collection::vec((proptest::bool::weighted(0.6), 0u64..300), 1..2000)) {
            let mut t: Table<Kv, 4> = Table::default();
            let mut model = BTreeMap::new();
            for (insert, k) in ops {
                // Clustered keys stress probing: many share few home lines in a small table.
                let key = k.wrapping_mul(0x1_0000_0000);
                if insert {
                    let (s, new) = t.get_or_insert_with(key, || Kv { key, val: k + 1 });
                    proptest::prop_assert_eq!(new, !model.contains_key(&key));
                    proptest::prop_assert_eq!(s.val, k + 1);
                    model.insert(key, k + 1);
                } else {
                    proptest::prop_assert_eq!(t.remove(key).map(|s| s.val), model.remove(&key));
                    if k % 7 == 0 {
                        t.shrink_if_sparse();
                    }
                }
            }
            check(&t, &model);
        }
    }
}
