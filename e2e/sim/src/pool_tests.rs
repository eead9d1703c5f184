//! Block pool unit tests: shared-prefix hits, LRU eviction order, references held by running
//! requests, duplicates, reset. (Generated-token blocks are covered in the scheduler tests,
//! where generation happens.)

use super::*;
use crate::hash::chain;

const BS: usize = 4;

/// Admits `tokens` like the scheduler does for a whole prompt: hit, take, allocate, write, cache.
fn admit(pool: &mut BlockPool, tokens: &[u32]) -> (Vec<BlockId>, usize) {
    let hashes = chain(tokens, BS, None);
    let hit = pool.lookup(&hashes);
    let mut blocks = Vec::new();
    pool.acquire_cached(&hashes[..hit.blocks], &mut blocks);
    let need = tokens.len().div_ceil(BS) - hit.blocks;
    assert!(pool.allocate(need, &mut blocks), "allocation");
    for (i, &id) in blocks.iter().enumerate().skip(hit.blocks) {
        let end = ((i + 1) * BS).min(tokens.len());
        pool.write_tokens(id, 0, &tokens[i * BS..end]);
    }
    pool.cache_blocks(&blocks, &hashes, hit.blocks, hashes.len(), None);
    (blocks, hit.blocks)
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: BS as u32,
        lora: None,
        extra_keys: Vec::new(),
    }
}

#[test]
fn shared_prefix_hits_and_stores_only_new_blocks() {
    let mut pool = BlockPool::new(16, BS);
    let a: Vec<u32> = (0..12).collect();
    let (blocks_a, hit) = admit(&mut pool, &a);
    assert_eq!(hit, 0);
    let ha = chain(&a, BS, None);
    assert_eq!(pool.take_events(), vec![stored(&ha, None, &a)]);

    // B shares A's first two blocks, then diverges; a partial tail block is never cached.
    let b: Vec<u32> = [&a[..8], &[100, 101, 102, 103, 104]].concat();
    let (blocks_b, hit) = admit(&mut pool, &b);
    assert_eq!(hit, 2);
    assert_eq!(blocks_b[..2], blocks_a[..2]);
    assert_eq!(pool.ref_cnt(blocks_a[0]), 2);
    let hb = chain(&b, BS, None);
    assert_eq!(pool.take_events(), vec![stored(&hb[2..3], Some(hb[1]), &[100, 101, 102, 103])]);
    assert_eq!(pool.num_cached(), 4);
    assert_eq!(pool.lookup(&hb), PrefixHit { blocks: 3, evictable: 0 });
}

#[test]
fn eviction_is_lru_in_free_order_and_only_on_reuse() {
    let mut pool = BlockPool::new(4, BS);
    let a: Vec<u32> = (0..8).collect();
    let b: Vec<u32> = (10..18).collect();
    let (blocks_a, _) = admit(&mut pool, &a);
    let (blocks_b, _) = admit(&mut pool, &b);
    pool.take_events();
    pool.free(&blocks_a);
    pool.free(&blocks_b);
    // Freed tail-first: A's last block is the least recently freed.
    assert_eq!(pool.free_order(), [blocks_a[1], blocks_a[0], blocks_b[1], blocks_b[0]]);
    // Freeing evicts nothing: every block is still cached.
    assert_eq!(pool.num_cached(), 4);
    assert!(pool.take_events().is_empty());

    let c: Vec<u32> = (20..28).collect();
    admit(&mut pool, &c);
    let ha = chain(&a, BS, None);
    let hc = chain(&c, BS, None);
    assert_eq!(
        pool.take_events(),
        vec![KvEvent::BlockRemoved { block_hashes: vec![ha[1], ha[0]] }, stored(&hc, None, &c),]
    );
    assert_eq!(pool.lookup(&chain(&b, BS, None)).blocks, 2);
    assert_eq!(pool.lookup(&ha).blocks, 0);
}

#[test]
fn a_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue() {
    let mut pool = BlockPool::new(4, BS);
    let a: Vec<u32> = (0..8).collect();
    let (blocks_a, _) = admit(&mut pool, &a);
    pool.free(&blocks_a);
    let ha = chain(&a, BS, None);
    assert_eq!(pool.lookup(&ha), PrefixHit { blocks: 2, evictable: 2 });
    let (again, hit) = admit(&mut pool, &a[..5]);
    assert_eq!(hit, 1);
    assert_eq!(again[0], blocks_a[0]);
    assert!(!pool.free_order().contains(&blocks_a[0]));
    assert_eq!(pool.num_free(), 2);
}

#[test]
fn running_requests_hold_their_blocks() {
    let mut pool = BlockPool::new(4, BS);
    let a: Vec<u32> = (0..12).collect();
    let (blocks_a, _) = admit(&mut pool, &a);
    pool.take_events();
    let mut out = Vec::new();
    assert!(!pool.allocate(2, &mut out), "only one block is free");
    assert!(out.is_empty());
    assert!(pool.allocate(1, &mut out));
    assert!(pool.take_events().is_empty(), "held blocks are never evicted");
    assert_eq!(pool.lookup(&chain(&a, BS, None)), PrefixHit { blocks: 3, evictable: 0 });
    assert!((pool.usage() - 1.0).abs() < 1e-9);
    pool.free(&blocks_a);
    pool.free(&out);
    assert!(pool.usage().abs() < 1e-9);
}

#[test]
fn a_second_copy_of_a_cached_hash_stays_uncached() {
    let mut pool = BlockPool::new(8, BS);
    let a: Vec<u32> = (0..8).collect();
    let ha = chain(&a, BS, None);
    admit(&mut pool, &a);
    pool.take_events();
    // A request that could only hit the first block (vLLM never hits the whole prompt)
    // recomputes the second into a fresh slot: no event, one cached block per hash.
    let mut blocks = Vec::new();
    pool.acquire_cached(&ha[..1], &mut blocks);
    assert!(pool.allocate(1, &mut blocks));
    pool.write_tokens(blocks[1], 0, &a[4..8]);
    pool.cache_blocks(&blocks, &ha, 1, 2, None);
    assert!(pool.take_events().is_empty());
    assert_eq!(pool.num_cached(), 2);
    assert!(pool.dump().iter().all(|b| b.block_id != blocks[1]));
}

#[test]
fn reset_refuses_while_in_use_then_clears_everything() {
    let mut pool = BlockPool::new(4, BS);
    let a: Vec<u32> = (0..8).collect();
    let (blocks, _) = admit(&mut pool, &a);
    pool.take_events();
    assert_eq!(pool.reset(), Err(InUse { in_use: 2 }));
    assert!(pool.take_events().is_empty());
    pool.free(&blocks);
    assert_eq!(pool.reset(), Ok(()));
    assert_eq!(pool.take_events(), vec![KvEvent::AllBlocksCleared]);
    assert_eq!(pool.num_cached(), 0);
    assert_eq!(pool.lookup(&chain(&a, BS, None)).blocks, 0);
    assert_eq!(pool.num_free(), 4);
    // Reusing a slot after a reset records no removal: the hash is already gone.
    admit(&mut pool, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]);
    assert!(pool.take_events().iter().all(|e| matches!(e, KvEvent::BlockStored { .. })));
}

#[test]
fn dump_lists_cached_blocks_in_chain_order_with_parents() {
    let mut pool = BlockPool::new(8, BS);
    let a: Vec<u32> = (0..10).collect();
    let (blocks, _) = admit(&mut pool, &a);
    let ha = chain(&a, BS, None);
    let dump = pool.dump();
    assert_eq!(dump.len(), 2);
    assert_eq!(
        dump[0],
        CachedBlock {
            block_id: blocks[0],
            block_hash: ha[0],
            parent_block_hash: None,
            position: 0,
            token_ids: vec![0, 1, 2, 3],
            lora_name: None,
            ref_cnt: 1
        }
    );
    assert_eq!(
        (dump[1].parent_block_hash, dump[1].position, dump[1].token_ids.as_slice()),
        (Some(ha[0]), 1, &[4, 5, 6, 7][..])
    );
    // The partial third block is written but not cached.
    assert_eq!(pool.block_tokens(blocks[2]), &[8, 9]);
}

#[test]
fn an_evicted_block_goes_to_the_cpu_tier_announced_before_its_gpu_removal() {
    let mut pool = BlockPool::new(4, BS).with_offload(2);
    let a: Vec<u32> = (0..8).collect();
    let b: Vec<u32> = (10..18).collect();
    let (blocks_a, _) = admit(&mut pool, &a);
    let (blocks_b, _) = admit(&mut pool, &b);
    pool.free(&blocks_a);
    pool.free(&blocks_b);
    pool.take_events();
    let c: Vec<u32> = (20..28).collect();
    let (blocks_c, _) = admit(&mut pool, &c);
    let (ha, hc) = (chain(&a, BS, None), chain(&c, BS, None));
    let offloaded = |i: usize, parent| KvEvent::OffloadStored {
        block_hash: ha[i],
        parent_block_hash: parent,
        token_ids: a[i * BS..(i + 1) * BS].to_vec(),
        block_size: BS as u32,
        lora: None,
    };
    // A's blocks are evicted tail first; each is offloaded before the GPU removal says it left.
    assert_eq!(
        pool.take_events(),
        vec![
            offloaded(1, Some(ha[0])),
            offloaded(0, None),
            KvEvent::BlockRemoved { block_hashes: vec![ha[1], ha[0]] },
            stored(&hc, None, &c),
        ]
    );
    assert_eq!(pool.lookup(&ha).blocks, 0);
    assert_eq!(pool.offload_run(&ha), 2, "the CPU tier holds A whole");
    assert_eq!(pool.load_offloaded(&ha), vec![a[..4].to_vec(), a[4..].to_vec()]);
    // The tier holds 2: B's eviction pushes A out (least recently used first), announced first.
    let hb = chain(&b, BS, None);
    let d: Vec<u32> = (30..38).collect();
    let (blocks_d, _) = admit(&mut pool, &d);
    let events = pool.take_events();
    assert_eq!(events[0], KvEvent::OffloadRemoved { block_hashes: vec![ha[0]] });
    assert!(matches!(events[1], KvEvent::OffloadStored { block_hash, .. } if block_hash == hb[1]));
    assert_eq!(pool.offload_run(&hb), 2);
    // A reset empties the tier too (its one AllBlocksCleared says so).
    pool.free(&blocks_c);
    pool.free(&blocks_d);
    pool.reset().expect("nothing referenced");
    assert_eq!(pool.take_events(), vec![KvEvent::AllBlocksCleared]);
    assert_eq!(pool.offload_run(&hb), 0);
}
