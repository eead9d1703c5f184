//! The free-block queue: vLLM's `FreeKVCacheBlockQueue`, an intrusive doubly linked list.
//!
//! Freed blocks go to the tail; allocation takes from the head. A freed block keeps its cached
//! hash until its slot is taken from the head, which is what makes eviction LRU: the least
//! recently freed cached block is the first to lose its contents. A cached block that a new
//! request hits is unlinked from the middle in O(1). Links are `u32` indices into two arrays
//! (no allocation after construction); `NIL` marks the ends.

/// Index of a physical KV block.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// O(1) push-back / pop-front / remove over block ids `0..n`.
#[derive(Debug, Clone)]
pub struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// A queue holding every block `0..n` in id order (all free at start).
    pub fn full(n: u32) -> Self {
        let mut q = Self {
            prev: vec![NIL; n as usize],
            next: vec![NIL; n as usize],
            linked: vec![false; n as usize],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for id in 0..n {
            q.push_back(id);
        }
        q
    }

    /// Number of blocks in the queue.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no block is free.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when `id` is in the queue.
    pub fn contains(&self, id: BlockId) -> bool {
        self.linked.get(id as usize).copied().unwrap_or(false)
    }

    /// Appends `id` at the tail (most recently freed). No-op if already queued.
    pub fn push_back(&mut self, id: BlockId) {
        let i = id as usize;
        if i >= self.linked.len() || self.linked[i] {
            return;
        }
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.linked[i] = true;
        self.len += 1;
    }

    /// Takes the head (least recently freed) block.
    pub fn pop_front(&mut self) -> Option<BlockId> {
        if self.head == NIL {
            return None;
        }
        let id = self.head;
        self.remove(id);
        Some(id)
    }

    /// Unlinks `id` wherever it is. No-op if not queued.
    pub fn remove(&mut self, id: BlockId) {
        let i = id as usize;
        if i >= self.linked.len() || !self.linked[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.linked[i] = false;
        self.len -= 1;
    }

    /// Blocks from head to tail (tests and the cache dump).
    pub fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let id = cur;
            cur = self.next[id as usize];
            Some(id)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_with_removal_from_the_middle() {
        let mut q = FreeQueue::full(4);
        assert_eq!(q.iter().collect::<Vec<_>>(), [0, 1, 2, 3]);
        q.remove(2);
        q.push_back(2);
        q.remove(0);
        assert_eq!(q.iter().collect::<Vec<_>>(), [1, 3, 2]);
        assert_eq!(q.pop_front(), Some(1));
        assert_eq!(q.pop_front(), Some(3));
        assert_eq!(q.pop_front(), Some(2));
        assert_eq!(q.pop_front(), None);
        assert!(q.is_empty());
        q.push_back(3);
        q.push_back(3);
        assert_eq!(q.len(), 1);
        assert!(q.contains(3) && !q.contains(0));
        q.remove(7); // out of range: ignored
        q.push_back(9);
        assert_eq!(q.len(), 1);
    }
}
