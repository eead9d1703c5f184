//! KV event framing: a live message `[topic, seq, payload]` and a replay reply `["", seq, payload]`
//! or the `0xFF×8` end marker (engines.md §1.3). Pure, and a fuzz target (`kv_frames`).

/// The sequence frame that ends a replay.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// One replay reply → `(seq, payload)`, or None for the end marker. A ROUTER reply to a DEALER
/// starts with an empty delimiter (dropped); then `[seq, payload]`, `[topic, seq, payload]` or the
/// end marker `[0xFF×8]` (with or without a payload frame).
pub fn replay_frames(frames: &[Vec<u8>]) -> Result<Option<(u64, &[u8])>, String> {
    let frames: Vec<&[u8]> =
        frames.iter().map(Vec::as_slice).skip_while(|f| f.is_empty()).collect();
    let (seq_bytes, payload) = match frames.as_slice() {
        [seq, payload] => (*seq, *payload),
        [_topic, seq, payload] => (*seq, *payload),
        [seq] => (*seq, &b""[..]),
        _ => return Err(format!("unexpected replay frame count {}", frames.len())),
    };
    if seq_bytes == END_SEQ {
        return Ok(None);
    }
    let seq: [u8; 8] =
        seq_bytes.try_into().map_err(|_| "replay sequence is not 8 bytes".to_owned())?;
    Ok(Some((u64::from_be_bytes(seq), payload)))
}

/// `[topic, seq, payload]` (or `[seq, payload]`) → (seq, payload).
pub fn split_frames(frames: &[Vec<u8>]) -> Option<(u64, &[u8])> {
    let (seq, payload) = match frames {
        [_topic, seq, payload] => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => return None,
    };
    let seq: [u8; 8] = seq.as_slice().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames() {
        let f = vec![b"topic".to_vec(), 7u64.to_be_bytes().to_vec(), vec![1, 2]];
        assert_eq!(split_frames(&f), Some((7, &[1u8, 2][..])));
        assert_eq!(split_frames(&f[1..]), Some((7, &[1u8, 2][..])));
        assert_eq!(split_frames(&[vec![1]]), None);
        assert_eq!(split_frames(&[vec![], vec![1, 2, 3], vec![]]), None);
    }
}
