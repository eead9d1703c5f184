//! The index's bookkeeping checked from inside (tests only): what the soak watches from outside.

use std::sync::atomic::Ordering;

use super::workers::Holders;
use super::KvIndex;

impl KvIndex {
    /// The bookkeeping the soak watches from outside (kvmesh_index_entries against the summed
    /// kvmesh_worker_blocks), checked from inside (tests): `entries` is the number of (block,
    /// worker) pairs in the table, and every pair is backed by a mapping of a registered worker —
    /// nothing is held that no worker lists.
    pub(crate) fn check_consistent(&self) -> Result<(), String> {
        let mut pairs = 0;
        let mut err = None;
        for s in self.blocks.iter() {
            Holders::of(s.word.load(Ordering::Relaxed), &self.bitmaps).for_each(|slot| {
                pairs += 1;
                let listed = self
                    .workers
                    .get(slot as usize)
                    .is_some_and(|w| w.active && w.map.iter().any(|r| r.r.chain.0 == s.key));
                if !listed && err.is_none() {
                    err = Some(format!(
                        "block {:#x} is held by slot {slot}, which does not list it",
                        s.key
                    ));
                }
            });
        }
        if let Some(e) = err {
            return Err(e);
        }
        let mut users: std::collections::HashMap<u32, u32> = Default::default();
        for w in self.workers.iter() {
            for s in w.map.iter() {
                *users.entry(s.r.seed_id()).or_default() += 1;
            }
        }
        for (id, n) in users {
            if id != 0 && self.seeds.users(id) != n {
                return Err(format!(
                    "seed {id} is used by {n} mappings but counted {}",
                    self.seeds.users(id)
                ));
            }
        }
        if pairs != self.entries {
            return Err(format!(
                "entries = {} but the table holds {pairs} (block, worker) pairs",
                self.entries
            ));
        }
        Ok(())
    }
}
