//! The seed table: local-hash seeds (one per LoRA × `cache_salt` combination) by small id.
//!
//! A block's chain hash is computed with its chain's seed, and a child store inherits its parent's
//! seed, so every engine-hash mapping keeps the 20-bit id of its seed ([`super::BlockRef`]). Seeds
//! come from KV events, and an event's `cache_salt` is whatever the client sent the engine: one
//! client cycling salts would, with a table that only grows, fill it for good, after which every
//! salted store is refused (issue 43, point 6). So the table counts the mappings that use each id
//! and reclaims ids no mapping uses: when the table is full and a new seed comes, one pass over
//! the counts frees every unused id (only if some count fell to 0 since the last pass, so a table
//! full of live seeds refuses in O(1)). A refused seed is counted
//! (`kvmesh_index_seed_refusals_total`) and its store not applied.
//!
//! Route queries never come here: a request's chain hashes are computed from its own seed
//! ([`kvmesh_core::hashing::block_seed`]) and looked up in the block table, so an unknown salt in a
//! request simply matches nothing and cannot insert a seed. Id 0 is the unsalted seed, never
//! reclaimed (approximate-mode chains use it).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use kvmesh_core::hashing;

use super::slots::U64Hasher;

/// Most distinct seeds in use at once. Ids are 20 bits in [`super::BlockRef`].
pub const MAX_SEEDS: usize = 1 << 20;

/// Seeds by id, with the number of engine-hash mappings using each.
pub(super) struct SeedTable {
    /// id → seed (an unused id keeps its old seed until reused).
    seeds: Vec<u64>,
    /// id → mappings using it (id 0 is not counted: never reclaimed).
    users: Vec<u32>,
    ids: HashMap<u64, u32, BuildHasherDefault<U64Hasher>>,
    /// Ids free for reuse.
    free: Vec<u32>,
    max: usize,
    /// Counts that reached 0 (or ids interned unused) since the last reclaim pass.
    idle: usize,
    refusals: u64,
}

impl SeedTable {
    /// A table holding at most `max` seeds (at least the unsalted one).
    pub(super) fn new(max: usize) -> Self {
        let mut ids = HashMap::default();
        ids.insert(hashing::XXH3_SEED, 0);
        Self {
            seeds: vec![hashing::XXH3_SEED],
            users: vec![0],
            ids,
            free: Vec::new(),
            max: max.clamp(1, MAX_SEEDS),
            idle: 0,
            refusals: 0,
        }
    }

    /// The id of an event's `seed`, added if new; None (counted) when the table is full of seeds
    /// in use. The caller must [`SeedTable::retain`] the id for each mapping it creates with it.
    pub(super) fn intern(&mut self, seed: u64) -> Option<u32> {
        if let Some(&id) = self.ids.get(&seed) {
            return Some(id);
        }
        if self.ids.len() >= self.max {
            self.reclaim();
        }
        if self.ids.len() >= self.max {
            self.refusals += 1;
            return None;
        }
        let id = match self.free.pop() {
            Some(id) => {
                self.seeds[id as usize] = seed;
                id
            }
            None => {
                let id = u32::try_from(self.seeds.len()).ok()?;
                self.seeds.push(seed);
                self.users.push(0);
                id
            }
        };
        self.ids.insert(seed, id);
        // Unused until retained: reclaimable if the store that asked adds no mapping.
        self.idle += 1;
        Some(id)
    }

    /// The seed of `id`.
    pub(super) fn seed(&self, id: u32) -> u64 {
        self.seeds.get(id as usize).copied().unwrap_or(hashing::XXH3_SEED)
    }

    /// A mapping now uses `id`.
    pub(super) fn retain(&mut self, id: u32) {
        if id != 0 {
            if let Some(u) = self.users.get_mut(id as usize) {
                *u = u.saturating_add(1);
            }
        }
    }

    /// A mapping using `id` is gone.
    pub(super) fn release(&mut self, id: u32) {
        if id != 0 {
            if let Some(u) = self.users.get_mut(id as usize) {
                *u = u.saturating_sub(1);
                if *u == 0 {
                    self.idle += 1;
                }
            }
        }
    }

    /// Frees every id no mapping uses (one pass; skipped when no count fell to 0 since the last).
    fn reclaim(&mut self) {
        if self.idle == 0 {
            return;
        }
        self.idle = 0;
        for id in 1..self.seeds.len() {
            let seed = self.seeds[id];
            let live = self.ids.get(&seed) == Some(&(id as u32));
            if live && self.users[id] == 0 {
                self.ids.remove(&seed);
                self.free.push(id as u32);
            }
        }
    }

    /// Seeds held (the unsalted one included).
    pub(super) fn len(&self) -> usize {
        self.ids.len()
    }

    /// New seeds refused because the table was full of seeds in use, since start.
    pub(super) fn refusals(&self) -> u64 {
        self.refusals
    }

    /// Heap bytes held.
    pub(super) fn bytes(&self) -> usize {
        // hashbrown: one control byte plus the (key, value) slot per bucket.
        self.seeds.capacity() * 8
            + self.users.capacity() * 4
            + self.free.capacity() * 4
            + self.ids.capacity() * 13
    }

    /// Mappings counted per id (consistency checks).
    #[cfg(test)]
    pub(super) fn users(&self, id: u32) -> u32 {
        self.users.get(id as usize).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_table_reclaims_unused_seeds_and_refuses_only_when_all_are_in_use() {
        let mut t = SeedTable::new(3);
        let a = t.intern(11).unwrap();
        let b = t.intern(12).unwrap();
        t.retain(a);
        t.retain(b);
        assert_eq!(t.intern(11), Some(a), "known seeds keep their id");
        assert_eq!(t.intern(13), None, "full of seeds in use");
        assert_eq!(t.refusals(), 1);
        t.release(b);
        let c = t.intern(13).unwrap();
        assert_eq!(c, b, "the unused id is reused");
        t.retain(c);
        assert_eq!((t.seed(c), t.seed(a), t.len()), (13, 11, 3));
        assert_eq!(t.intern(12), None);
        assert_eq!(t.refusals(), 2);
    }

    #[test]
    fn a_seed_interned_but_never_used_is_reclaimed() {
        let mut t = SeedTable::new(2);
        t.intern(21).unwrap();
        assert!(t.intern(22).is_some(), "21 was never retained");
        assert_eq!(t.seed(0), hashing::XXH3_SEED, "the unsalted seed stays");
    }
}
