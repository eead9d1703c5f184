//! Growing the index's tables off the write lock: a store that would grow a table (rehashing
//! every entry, a second at the default bound) has the grown copy built from `&self` under a read
//! lock, route queries going on beside it, and only swapped in under the write lock (the applier
//! is the one writer, so nothing changes in between; `events/applier.rs`). A lower tier's tables
//! ([`super::tiers`]) grow the same way: [`Growth`] names the tier.

use super::slots::{BlockSlot, RefSlot};
use super::table::Table;
use super::{KvIndex, Tier, WorkerSlot};

/// Which tables storing more blocks would grow, to how many lines ([`KvIndex::growth`]).
pub struct Growth {
    tier: Tier,
    blocks: Option<usize>,
    map: Option<(WorkerSlot, usize)>,
}

/// Tables grown ahead of stores: built from `&self` ([`KvIndex::room_for`], while route queries
/// go on under the read lock) and swapped in under the write lock ([`KvIndex::make_room`]).
pub struct Room {
    tier: Tier,
    blocks: Option<Table<BlockSlot, 4>>,
    map: Option<(WorkerSlot, Table<RefSlot, 2>)>,
}

impl KvIndex {
    /// How storing `blocks` more blocks on `slot` would grow the GPU tables (`None`: they fit).
    /// Cheap; the growth itself rehashes every entry, O(entries): milliseconds at a few hundred
    /// thousand blocks, a second at the default bound — [`KvIndex::room_for`] does it off the
    /// write lock.
    pub fn growth(&self, slot: WorkerSlot, blocks: usize) -> Option<Growth> {
        self.growth_in(Tier::Gpu, slot, blocks)
    }

    /// [`KvIndex::growth`] for the tables of `tier` (`None` too for a tier not created yet: its
    /// first store grows empty tables, which costs nothing).
    pub fn growth_in(&self, tier: Tier, slot: WorkerSlot, blocks: usize) -> Option<Growth> {
        let own = self.tier(tier)?;
        let growth = Growth {
            tier,
            blocks: own.blocks.lines_for(blocks),
            map: own
                .workers
                .get(slot as usize)
                .and_then(|w| w.map.lines_for(blocks))
                .map(|lines| (slot, lines)),
        };
        (growth.blocks.is_some() || growth.map.is_some()).then_some(growth)
    }

    /// Copies of the tables `growth` names, already grown. O(entries), from `&self`: the caller
    /// (the one writer) changes nothing until [`KvIndex::make_room`]; readers go on meanwhile.
    pub fn room_for(&self, growth: Growth) -> Room {
        let mut room = Room { tier: growth.tier, blocks: None, map: None };
        let Some(own) = self.tier(growth.tier) else { return room };
        room.blocks = growth.blocks.map(|lines| own.blocks.rehashed(lines));
        room.map = growth.map.and_then(|(slot, lines)| {
            own.workers.get(slot as usize).map(|w| (slot, w.map.rehashed(lines)))
        });
        room
    }

    /// Swaps in the tables of `room`, which [`KvIndex::room_for`] built from this very state (no
    /// write in between); returns the replaced tables, for the caller to free after it unlocks.
    pub fn make_room(&mut self, room: Room) -> Room {
        let mut old = Room { tier: room.tier, blocks: None, map: None };
        let Some(own) = self.tier_mut(room.tier) else { return old };
        if let Some(t) = room.blocks {
            debug_assert_eq!(t.len(), own.blocks.len(), "the block table changed after room_for");
            old.blocks = Some(std::mem::replace(&mut own.blocks, t));
        }
        if let Some((slot, t)) = room.map {
            if let Some(w) = own.workers.get_mut(slot as usize) {
                debug_assert_eq!(t.len(), w.map.len(), "the worker's map changed after room_for");
                old.map = Some((slot, std::mem::replace(&mut w.map, t)));
            }
        }
        old
    }
}
