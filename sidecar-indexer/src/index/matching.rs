//! `find_matches`: per worker, how many leading blocks of a prompt it holds.
//!
//! The index is far bigger than the cache, so a query's cost is its DRAM round trips, not its
//! instructions. Lookups are therefore issued in waves ([`Wave`]): every block a step needs is
//! touched first, so the misses overlap, and only then examined. Clean workers (see the module
//! docs of [`super`]) are matched by galloping (one wave: blocks lo+1, lo+2, lo+4, … to the end)
//! then a many-way search of the bracket found (waves of up to [`WAYS`] evenly spaced blocks), so a
//! drop-out depth costs two or three round trips instead of one per bisection step. Dirty
//! workers are walked block by block, stopping when none is left, with the next [`LOOKAHEAD`]
//! blocks' lines fetched while the current ones are examined.

use std::sync::atomic::Ordering;

use kvmesh_core::hashing::SequenceHash;

use super::workers::{self, Active, Holders, AGE_MASK, AGE_SHIFT, BITMAP};
use super::{KvIndex, OverlapScores, AGE_USED};

/// Blocks looked up together when walking block by block.
const LOOKAHEAD: usize = 16;

/// Blocks probed together per step of the many-way search.
const WAYS: usize = 8;

/// Most probes in one wave (a gallop over 2^63 blocks fits).
const WAVE: usize = 64;

/// One round of lookups: positions in the prompt and the block words found (0 = absent).
struct Wave {
    at: [usize; WAVE],
    words: [u64; WAVE],
    len: usize,
}

impl Wave {
    fn new() -> Self {
        Self { at: [0; WAVE], words: [0; WAVE], len: 0 }
    }

    fn push(&mut self, j: usize) {
        if self.len < WAVE {
            self.at[self.len] = j;
            self.len += 1;
        }
    }

    fn clear(&mut self) {
        self.len = 0;
    }
}

/// Adds the gallop from `lo` to `wave`: lo+1, lo+2, lo+4, … and the last block.
fn gallop(wave: &mut Wave, lo: usize, n: usize) {
    let mut step = 1;
    let mut j = lo;
    while j + 1 < n {
        j = (lo + step).min(n - 1);
        wave.push(j);
        step *= 2;
    }
}

impl KvIndex {
    /// Per worker slot, how many leading blocks of `chains` it holds (workers holding none of the
    /// first block are absent). Stops as soon as no worker matches the prefix so far.
    ///
    /// Exact in every case. When every worker holding block 0 is *clean* — its holdings are
    /// prefix-closed: no block was removed while a child stayed, no index eviction touched it —
    /// holding block j implies holding blocks 0..j (a chain hash names its whole prefix), so the
    /// holder sets shrink monotonically along the prompt and the drop-out points are found by
    /// galloping and many-way search: O(drops × log blocks) lookups in O(drops × few) round trips
    /// instead of one lookup per block. Otherwise every block is checked ([`KvIndex::walk`]).
    /// vLLM-style eviction (children before parents) keeps workers clean.
    pub fn find_matches(&self, chains: &[SequenceHash]) -> OverlapScores {
        let n = chains.len();
        if n == 0 {
            return OverlapScores::new();
        }
        // With no dirty worker anywhere, every holder of a block j is a clean worker holding
        // blocks 0..=j, hence still active: "every active worker holds j" is then a comparison of
        // counts, and the search reads no bitmap until a worker drops out.
        let counts = self.dirty_words.iter().all(|w| *w == 0);
        let mut wave = Wave::new();
        // Block 0 and the first gallop from it in one round trip.
        wave.push(0);
        gallop(&mut wave, 0, n);
        self.probe(chains, &mut wave, !counts);
        let first = wave.words[0];
        if first == 0 {
            return OverlapScores::new();
        }
        // The active set (block 0's holders, minus drop-outs) is materialised when a worker drops
        // out, or at once when dirty workers exist and may be among it.
        let mut active: Option<Active> = None;
        if !counts {
            let a = Active::from_holders(&Holders::of(first, &self.bitmaps));
            if a.any_in(&self.dirty_words) {
                return self.walk(chains);
            }
            active = Some(a);
        }
        let mut scores = OverlapScores::with_capacity(workers::count(first));
        // Every active worker holds blocks 0..=lo.
        let mut lo = 0usize;
        let mut from = 1;
        while let Some((mut hi, mut hi_word)) =
            self.bracket(&wave, from, active.as_ref(), first, counts, &mut lo)
        {
            while hi - lo > 1 {
                wave.clear();
                let gap = hi - lo;
                let ways = (gap - 1).min(WAYS);
                for i in 1..=ways {
                    wave.push(lo + gap * i / (ways + 1));
                }
                self.probe(chains, &mut wave, !counts);
                if let Some((h, w)) =
                    self.bracket(&wave, 0, active.as_ref(), first, counts, &mut lo)
                {
                    (hi, hi_word) = (h, w);
                }
            }
            // Block `hi` is the first some active worker lacks: those hold exactly `hi` blocks.
            std::hint::black_box(self.bitmap_touch(first) ^ self.bitmap_touch(hi_word));
            let a = active
                .get_or_insert_with(|| Active::from_holders(&Holders::of(first, &self.bitmaps)));
            if hi_word == 0 {
                a.for_each(|s| scores.push((s, hi as u32)));
                return scores;
            }
            a.intersect(&Holders::of(hi_word, &self.bitmaps), |s| scores.push((s, hi as u32)));
            if a.is_empty() {
                return scores;
            }
            lo = hi;
            wave.clear();
            gallop(&mut wave, lo, n);
            self.probe(chains, &mut wave, !counts);
            from = 0;
        }
        match &active {
            Some(a) => a.for_each(|s| scores.push((s, n as u32))),
            None => Holders::of(first, &self.bitmaps).for_each(|s| scores.push((s, n as u32))),
        }
        scores
    }

    /// Scans `wave` (ascending) from entry `from`: moves `lo` to the last position every active
    /// worker holds and returns the first one some active worker lacks (with its word), if any.
    /// The answers are monotone along the prompt for clean workers, so the first "no" ends the
    /// scan. With `counts` (no dirty worker anywhere, see `find_matches`) holder counts are
    /// compared — with block 0's (`first`) while `active` is not materialised, as no worker
    /// dropped out yet.
    fn bracket(
        &self,
        wave: &Wave,
        from: usize,
        active: Option<&Active>,
        first: u64,
        counts: bool,
        lo: &mut usize,
    ) -> Option<(usize, u64)> {
        let len = active.map_or(workers::count(first), Active::len);
        for i in from..wave.len {
            let word = wave.words[i];
            let all_hold = word != 0
                && match active {
                    Some(a) if !counts => a.subset_of(&Holders::of(word, &self.bitmaps)),
                    _ => workers::count(word) >= len,
                };
            if !all_hold {
                return Some((wave.at[i], word));
            }
            *lo = wave.at[i];
        }
        None
    }

    /// Loads the first line of `word`'s bitmap, if it has one (see `Table::touch`).
    fn bitmap_touch(&self, word: u64) -> u64 {
        if word & BITMAP != 0 {
            self.bitmaps.touch(word as u32)
        } else {
            0
        }
    }

    /// Looks up every block of `wave` with their cache misses overlapped: touch all home lines,
    /// then read the words (refreshing their CLOCK age), then (with `bitmaps`) touch the bitmaps
    /// they point to.
    fn probe(&self, chains: &[SequenceHash], wave: &mut Wave, bitmaps: bool) {
        let n = wave.len;
        std::hint::black_box(
            wave.at[..n].iter().fold(0, |a, &j| a ^ self.blocks.touch(chains[j].0)),
        );
        for i in 0..n {
            wave.words[i] = self.lookup(chains[wave.at[i]].0).unwrap_or(0);
        }
        if bitmaps {
            std::hint::black_box(wave.words[..n].iter().fold(0, |a, w| a ^ self.bitmap_touch(*w)));
        }
    }

    /// The word of block `chain`, marking the block used.
    #[inline(always)]
    pub(super) fn lookup(&self, chain: u64) -> Option<u64> {
        let s = self.blocks.get(chain)?;
        let word = s.word.load(Ordering::Relaxed);
        // Only the applier writes under the write lock; under the read lock every query writes the
        // same age, so a plain store cannot lose an update. Load first: writing a cache line every
        // query would make readers fight over it.
        if word & AGE_MASK != AGE_USED << AGE_SHIFT {
            s.word.store((word & !AGE_MASK) | AGE_USED << AGE_SHIFT, Ordering::Relaxed);
        }
        Some(word)
    }

    /// [`KvIndex::find_matches`] checking every block (for dirty workers, and as its test oracle).
    pub fn walk(&self, chains: &[SequenceHash]) -> OverlapScores {
        let mut scores = OverlapScores::new();
        let mut active: Option<Active> = None;
        let mut depth = 0u32;
        let n = chains.len();
        let touch = |from: usize| {
            chains[from..(from + LOOKAHEAD).min(n)]
                .iter()
                .fold(0, |a, c| a ^ self.blocks.touch(c.0))
        };
        std::hint::black_box(touch(0));
        let mut words = [0u64; LOOKAHEAD];
        for start in (0..n).step_by(LOOKAHEAD) {
            let end = (start + LOOKAHEAD).min(n);
            for (w, c) in words.iter_mut().zip(&chains[start..end]) {
                *w = self.lookup(c.0).unwrap_or(0);
            }
            // Fetch the next stretch while this one is examined.
            std::hint::black_box(
                words[..end - start]
                    .iter()
                    .fold(if end < n { touch(end) } else { 0 }, |a, w| a ^ self.bitmap_touch(*w)),
            );
            for &word in &words[..end - start] {
                if word == 0 {
                    if let Some(a) = &active {
                        a.for_each(|s| scores.push((s, depth)));
                    }
                    return scores;
                }
                let holders = Holders::of(word, &self.bitmaps);
                match &mut active {
                    None => {
                        let a = Active::from_holders(&holders);
                        scores.reserve(a.len());
                        active = Some(a);
                    }
                    Some(a) => {
                        a.intersect(&holders, |s| scores.push((s, depth)));
                        if a.is_empty() {
                            return scores;
                        }
                    }
                }
                depth += 1;
            }
        }
        if let Some(a) = &active {
            a.for_each(|s| scores.push((s, depth)));
        }
        scores
    }
}
