//! Unit tests of `crate::body_bases`.

use super::*;

/// A conversation's body after `turns` turns: a long system prompt, then one message per turn.
fn body(conversation: usize, turns: usize) -> Vec<u8> {
    let mut b =
        format!("{{\"messages\":[{{\"role\":\"system\",\"content\":\"{}\"}}", "s".repeat(9000));
    for t in 0..turns {
        b.push_str(&format!(
            ",{{\"role\":\"user\",\"content\":\"conversation {conversation} turn {t}\"}}"
        ));
    }
    b.push_str("],\"stream\":true}");
    b.into_bytes()
}

/// The base the indexer would name for `b`: its bytes through the last message.
fn base_of(b: &[u8], memo_key: u64) -> Remembered {
    let end = b.len() - "],\"stream\":true}".len();
    let base = BodyBase::of(memo_key, &b[..end]);
    Remembered::new(base, b).unwrap_or_else(|| panic!("a base within its body"))
}

#[test]
fn a_slot_remembers_its_session_and_nothing_else() {
    let key = SessionKey(0xfeed_0000_0000_0001);
    let bases = vec![base_of(&body(1, 2), 1), base_of(&body(2, 3), 2)];
    let value = encode(key, &bases);
    assert!(value.len() <= MAX_SLOT_BYTES);
    assert_eq!(decode(&value, key), bases);
    assert!(decode(&value, SessionKey(key.0 + 1)).is_empty(), "another session in the same slot");
    for bad in [&[][..], &value[..7], &value[..8 + BASE_BYTES - 1], &value[..value.len() - 1]] {
        assert!(
            decode(bad, key).is_empty(),
            "a torn value of {} bytes reads as nothing",
            bad.len()
        );
    }
    let five: Vec<Remembered> = (0..5).map(|c| base_of(&body(c, 1), c as u64)).collect();
    assert_eq!(decode(&encode(key, &five), key).len(), BASES_PER_SLOT, "bounded");
    assert_eq!(slot_key(SessionKey(17), 16), "kvmesh.bodybase.1");
    assert_eq!(slot_key(SessionKey(5), 0), "kvmesh.bodybase.0");
}

#[test]
fn a_body_is_sent_after_the_base_of_its_own_conversation_only() {
    // Four conversations on one anchor, each remembered at turn 2.
    let bases: Vec<Remembered> = (0..4).map(|c| base_of(&body(c, 2), c as u64)).collect();
    for c in 0..4 {
        let next = body(c, 3);
        assert_eq!(choose(&bases, &next), Some(bases[c].base), "conversation {c}");
        assert!(bases[c].base.prefixes(&next));
    }
    // A body that is the base itself and no more, a new conversation, an edit inside the base
    // (the tail agrees, the hash does not): whole.
    let mut edited = body(1, 3);
    edited[100] = b'X';
    let just_the_base = body(0, 2)[..bases[0].base.len].to_vec();
    for whole in [just_the_base, b"{}".to_vec(), body(9, 3), edited] {
        assert_eq!(choose(&bases, &whole), None);
    }
    // A malformed remembered base (shorter than its tail) is skipped, never a panic.
    let mut short = bases[0];
    short.base.len = 3;
    assert_eq!(choose(&[short], &body(0, 3)), None);
}

#[test]
fn an_answer_puts_its_base_first_and_drops_the_one_it_replaced() {
    let old: Vec<Remembered> = (0..4).map(|c| base_of(&body(c, 2), c as u64)).collect();
    let new = base_of(&body(2, 3), 2);
    let after = remember(old.clone(), Some(new), Some(old[2].base));
    assert_eq!(after, vec![new, old[0], old[1], old[3]]);
    // A fifth conversation pushes out the oldest; an unknown base is only dropped.
    let fifth = base_of(&body(4, 2), 4);
    assert_eq!(remember(after.clone(), Some(fifth), None), vec![fifth, new, old[0], old[1]]);
    assert_eq!(remember(after, None, Some(new.base)), vec![old[0], old[1], old[3]]);
    // The same base named twice is kept once.
    assert_eq!(remember(vec![new], Some(new), None), vec![new]);
}
