use super::*;

fn fixture(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

const BIG: u64 = u64::MAX - 4;

fn expected_events() -> Vec<KvEvent> {
    vec![
        KvEvent::Stored {
            block_hashes: vec![BIG, 7],
            parent: None,
            token_ids: (1..9).collect(),
            block_size: 4,
            lora_name: None,
            cache_salt: None,
            medium: Some("GPU".into()),
            group_idx: None,
        },
        KvEvent::Stored {
            block_hashes: vec![(-3i64) as u64],
            parent: Some(7),
            token_ids: vec![9, 10, 11, 12],
            block_size: 4,
            lora_name: Some("adapter".into()),
            cache_salt: None,
            medium: Some("GPU".into()),
            group_idx: Some(0),
        },
        KvEvent::Removed { block_hashes: vec![BIG], medium: Some("GPU".into()), group_idx: None },
        KvEvent::Cleared,
    ]
}

// Both fixtures were written by msgspec from vLLM's own struct declarations (gen_fixtures.py).
#[test]
fn legacy_array_layout() {
    let b = decode_batch(&fixture("batch_array.msgpack")).unwrap();
    assert_eq!(b.ts, 1_789_095_808.5);
    assert_eq!(b.dp_rank, Some(1));
    assert_eq!(b.events, expected_events());
}

#[test]
fn current_map_layout() {
    let b = decode_batch(&fixture("batch_map.msgpack")).unwrap();
    assert_eq!(b.dp_rank, Some(1));
    assert_eq!(b.events, expected_events());
}

#[test]
fn v09_batch_without_rank_and_short_store() {
    let b = decode_batch(&fixture("batch_v09.msgpack")).unwrap();
    assert_eq!(b.dp_rank, None);
    assert_eq!(
        b.events,
        vec![KvEvent::Stored {
            block_hashes: vec![5],
            parent: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            lora_name: None,
            cache_salt: None,
            medium: None,
            group_idx: None
        }]
    );
}

#[test]
fn byte_hashes_unknown_fields_and_unknown_events() {
    let b = decode_batch(&fixture("batch_bytes.msgpack")).unwrap();
    assert_eq!(b.dp_rank, None);
    let KvEvent::Stored { block_hashes, .. } = &b.events[0] else { panic!("{:?}", b.events[0]) };
    // Last 8 bytes of 0..32, big-endian.
    assert_eq!(block_hashes, &vec![u64::from_be_bytes([24, 25, 26, 27, 28, 29, 30, 31])]);
    assert_eq!(b.events[1], KvEvent::Unknown { tag: "SomethingNew".into() });
}

#[test]
fn malformed_payloads_are_typed_errors() {
    let cases: &[(&[u8], &str)] = &[
        (b"", "not msgpack"),
        (&[0x92, 0x01], "not msgpack"),
        (&[0x05], "batch: not an array or map"),
        (&[0x92, 0xa1, b'x', 0x90], "batch: ts must be a number"),
        (&[0x92, 0x01, 0x01], "batch: events must be an array"),
        // [1, [["BlockStored", 5]]]: block_hashes is not an array
        (&[0x92, 0x01, 0x91, 0x92, 0xab, b'B', b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r', b'e', b'd', 0x05], "BlockStored.block_hashes: must be an array"),
        // [1, [[7]]]: no tag
        (&[0x92, 0x01, 0x91, 0x91, 0x07], "batch: event without a type tag"),
    ];
    for (bytes, want) in cases {
        let err = decode_batch(bytes).unwrap_err().to_string();
        assert!(err.starts_with(want), "{bytes:x?}: {err}");
    }
}

#[test]
fn store_with_negative_token_is_refused() {
    // [1, [["BlockStored", [1], nil, [-1], 1]]]
    let bytes = [
        0x92, 0x01, 0x91, 0x95, 0xab, b'B', b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r', b'e', b'd', 0x91, 0x01, 0xc0, 0x91, 0xff, 0x01,
    ];
    assert_eq!(
        decode_batch(&bytes).unwrap_err(),
        DecodeError::Field { event: "BlockStored", field: "token_ids", reason: "must be token ids in 0..2^32" }
    );
}
