//! Unit tests of `crate::placement`.

use super::*;

#[test]
fn a_slot_remembers_its_session_and_nothing_else() {
    let key = SessionKey(0x1234_5678_9abc_def0);
    let Some(value) = encode(key, "w3") else { panic!("encodable") };
    assert_eq!(decode(&value, key), Some("w3"));
    assert_eq!(decode(&value, SessionKey(key.0 + 1)), None, "another session in the same slot");
    for bad in [&[][..], &value[..7], &value[..8], &[0xff; 12][..]] {
        assert_eq!(decode(bad, key), None, "{bad:?}");
    }
    let mut not_utf8 = key.0.to_le_bytes().to_vec();
    not_utf8.extend_from_slice(&[0xff, 0xfe]);
    assert_eq!(decode(&not_utf8, key), None);
    assert_eq!(encode(key, ""), None);
    assert_eq!(encode(key, &"w".repeat(MAX_WORKER_ID_BYTES + 1)), None);
    assert!(encode(key, &"w".repeat(MAX_WORKER_ID_BYTES)).is_some());
}

#[test]
fn slots_are_bounded_by_the_table_size() {
    let slots = 16;
    let keys: std::collections::BTreeSet<String> = (0..1000u64)
        .map(|k| slot_key(SessionKey(k.wrapping_mul(0x9e37_79b9_7f4a_7c15)), slots))
        .collect();
    assert_eq!(keys.len(), slots);
    assert_eq!(slot_key(SessionKey(17), slots), "kvmesh.placed.1");
    assert_eq!(
        slot_key(SessionKey(5), 0),
        "kvmesh.placed.0",
        "a zero-sized table is one slot, never a division by zero"
    );
}
