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
            spec_kind: None,
            sliding_window: None,
            extra_terms: vec![],
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
            spec_kind: None,
            sliding_window: None,
            extra_terms: vec![],
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
            group_idx: None,
            spec_kind: None,
            sliding_window: None,
            extra_terms: vec![],
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
        (
            &[
                0x92, 0x01, 0x91, 0x92, 0xab, b'B', b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r',
                b'e', b'd', 0x05,
            ],
            "BlockStored.block_hashes: must be an array",
        ),
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
        0x92, 0x01, 0x91, 0x95, 0xab, b'B', b'l', b'o', b'c', b'k', b'S', b't', b'o', b'r', b'e',
        b'd', 0x91, 0x01, 0xc0, 0x91, 0xff, 0x01,
    ];
    assert_eq!(
        decode_batch(&bytes).unwrap_err(),
        DecodeError::Field {
            event: "BlockStored",
            field: "token_ids",
            reason: "must be token ids in 0..2^32"
        }
    );
}

/// A hybrid model's group store, as vLLM publishes it since #40984: `group_idx`,
/// `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`, in the map layout by name and in the
/// legacy array layout at positions 8, 9 and 10 after the tag; a removal's `group_idx`.
#[test]
fn group_spec_fields_in_both_layouts() {
    use rmpv::Value;
    let stored = |kind: Value, window: Value| KvEvent::Stored {
        block_hashes: vec![11],
        parent: Some(10),
        token_ids: vec![1, 2, 3, 4],
        block_size: 4,
        lora_name: None,
        cache_salt: None,
        medium: Some("GPU".into()),
        group_idx: Some(1),
        spec_kind: kind.as_str().map(str::to_owned),
        sliding_window: window.as_u64().map(|w| w as u32),
        extra_terms: vec![],
    };
    let encode = |v: Value| {
        let batch = Value::Array(vec![Value::from(1.5), Value::Array(vec![v]), Value::Nil]);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &batch).unwrap();
        out
    };
    let fields = |kind: &Value, window: &Value| {
        vec![
            ("type", Value::from("BlockStored")),
            ("block_hashes", Value::Array(vec![Value::from(11)])),
            ("parent_block_hash", Value::from(10)),
            ("token_ids", Value::Array((1..=4).map(Value::from).collect())),
            ("block_size", Value::from(4)),
            ("lora_id", Value::Nil),
            ("medium", Value::from("GPU")),
            ("lora_name", Value::Nil),
            ("extra_keys", Value::Nil),
            ("group_idx", Value::from(1)),
            ("kv_cache_spec_kind", kind.clone()),
            ("kv_cache_spec_sliding_window", window.clone()),
        ]
    };
    for (kind, window) in [
        (Value::from("sliding_window"), Value::from(4096)),
        (Value::from("full_attention"), Value::Nil),
        (Value::from("mamba"), Value::Nil),
    ] {
        let want = stored(kind.clone(), window.clone());
        // Map layout, keys in reverse order (read by name) and an unknown one.
        let mut pairs: Vec<(Value, Value)> =
            fields(&kind, &window).into_iter().map(|(k, v)| (Value::from(k), v)).collect();
        pairs.reverse();
        pairs.push((Value::from("locality"), Value::from("LOCAL")));
        let b = decode_batch(&encode(Value::Map(pairs))).unwrap();
        assert_eq!(b.events, vec![want.clone()], "map {kind}");
        // Legacy array layout: the tag, then every field in declaration order, and a trailing one.
        let mut items: Vec<Value> = fields(&kind, &window).into_iter().map(|(_, v)| v).collect();
        items.push(Value::from("LOCAL"));
        let b = decode_batch(&encode(Value::Array(items))).unwrap();
        assert_eq!(b.events, vec![want], "array {kind}");
    }
    // A window that is not a small integer is a typed error, like any integer field.
    let bad = fields(&Value::from("sliding_window"), &Value::from("wide"));
    let pairs = bad.into_iter().map(|(k, v)| (Value::from(k), v)).collect();
    assert_eq!(
        decode_batch(&encode(Value::Map(pairs))).unwrap_err(),
        DecodeError::Field {
            event: "BlockStored",
            field: "kv_cache_spec_sliding_window",
            reason: "must be a small integer"
        }
    );
    // A removal of group 2, both layouts.
    let removed =
        KvEvent::Removed { block_hashes: vec![11], medium: Some("GPU".into()), group_idx: Some(2) };
    let map = Value::Map(vec![
        (Value::from("type"), Value::from("BlockRemoved")),
        (Value::from("block_hashes"), Value::Array(vec![Value::from(11)])),
        (Value::from("medium"), Value::from("GPU")),
        (Value::from("group_idx"), Value::from(2)),
    ]);
    let array = Value::Array(vec![
        Value::from("BlockRemoved"),
        Value::Array(vec![Value::from(11)]),
        Value::from("GPU"),
        Value::from(2),
    ]);
    for v in [map, array] {
        assert_eq!(decode_batch(&encode(v)).unwrap().events, vec![removed.clone()]);
    }
}

/// The previous decoder (an `rmpv::Value` tree per batch), the oracle of the equivalence tests.
mod reference {
    use super::{DecodeError, EventBatch, KvEvent};
    use rmpv::Value;

    /// The decoder before the typed one: the whole payload read into an `rmpv::Value`, fields picked
    /// from it. Kept as the oracle the typed decoder must equal.
    pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
        let mut cursor = payload;
        let value = rmpv::decode::read_value(&mut cursor)
            .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
        let (ts, events, rank) = match &value {
            Value::Array(items) => (items.first(), items.get(1), items.get(2)),
            Value::Map(_) => {
                (get(&value, "ts"), get(&value, "events"), get(&value, "data_parallel_rank"))
            }
            _ => return Err(DecodeError::Batch("not an array or map")),
        };
        let ts = match ts {
            Some(Value::F64(f)) => *f,
            Some(Value::F32(f)) => f64::from(*f),
            Some(v) if v.as_i64().is_some() => v.as_i64().unwrap_or(0) as f64,
            _ => return Err(DecodeError::Batch("ts must be a number")),
        };
        let Some(Value::Array(raw_events)) = events else {
            return Err(DecodeError::Batch("events must be an array"));
        };
        let dp_rank = match rank {
            None | Some(Value::Nil) => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|r| u32::try_from(r).ok())
                    .ok_or(DecodeError::Batch("dp rank must be an integer"))?,
            ),
        };
        let events = raw_events.iter().map(decode_event).collect::<Result<Vec<_>, _>>()?;
        Ok(EventBatch { ts, events, dp_rank })
    }

    fn get<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
        match map {
            Value::Map(pairs) => {
                pairs.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
            }
            _ => None,
        }
    }

    /// Field access for both layouts: by position (after the tag) in arrays, by name in maps.
    struct Fields<'a> {
        value: &'a Value,
        event: &'static str,
    }

    impl<'a> Fields<'a> {
        fn field(&self, position: usize, name: &str) -> Option<&'a Value> {
            let v = match self.value {
                Value::Array(items) => items.get(position + 1),
                _ => get(self.value, name),
            };
            v.filter(|v| !v.is_nil())
        }

        fn err(&self, field: &'static str, reason: &'static str) -> DecodeError {
            DecodeError::Field { event: self.event, field, reason }
        }

        fn hashes(&self, position: usize, field: &'static str) -> Result<Vec<u64>, DecodeError> {
            match self.field(position, field) {
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|h| {
                        hash(h).ok_or_else(|| self.err(field, "hash must be an integer or bytes"))
                    })
                    .collect(),
                _ => Err(self.err(field, "must be an array")),
            }
        }

        fn opt_string(&self, position: usize, field: &'static str) -> Option<String> {
            self.field(position, field).and_then(Value::as_str).map(str::to_owned)
        }

        fn opt_u32(
            &self,
            position: usize,
            field: &'static str,
        ) -> Result<Option<u32>, DecodeError> {
            match self.field(position, field) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .map(Some)
                    .ok_or_else(|| self.err(field, "must be a small integer")),
            }
        }
    }

    /// A block hash as u64: integers bit-for-bit (signed ones reinterpreted), bytes by their last 8
    /// bytes big-endian (shorter byte strings left-padded with zeros).
    fn hash(v: &Value) -> Option<u64> {
        match v {
            Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|s| s as u64)),
            Value::Binary(b) => {
                let tail = &b[b.len().saturating_sub(8)..];
                let mut buf = [0u8; 8];
                buf[8 - tail.len()..].copy_from_slice(tail);
                Some(u64::from_be_bytes(buf))
            }
            _ => None,
        }
    }

    fn decode_event(v: &Value) -> Result<KvEvent, DecodeError> {
        let tag = match v {
            Value::Array(items) => items.first().and_then(Value::as_str),
            Value::Map(_) => get(v, "type").and_then(Value::as_str),
            _ => None,
        }
        .ok_or(DecodeError::Batch("event without a type tag"))?;
        match tag {
            "BlockStored" => {
                let f = Fields { value: v, event: "BlockStored" };
                let block_hashes = f.hashes(0, "block_hashes")?;
                let parent = match f.field(1, "parent_block_hash") {
                    None => None,
                    Some(p) => Some(hash(p).ok_or_else(|| {
                        f.err("parent_block_hash", "must be an integer or bytes")
                    })?),
                };
                let token_ids = match f.field(2, "token_ids") {
                    Some(Value::Array(items)) => items
                        .iter()
                        .map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok()))
                        .collect::<Option<Vec<u32>>>()
                        .ok_or_else(|| f.err("token_ids", "must be token ids in 0..2^32"))?,
                    _ => return Err(f.err("token_ids", "must be an array")),
                };
                let block_size = f
                    .opt_u32(3, "block_size")?
                    .ok_or_else(|| f.err("block_size", "is required"))?;
                // Positions after the tag: 4 lora_id, 5 medium, 6 lora_name, 7 extra_keys,
                // 8 group_idx, 9 kv_cache_spec_kind, 10 kv_cache_spec_sliding_window.
                let group_idx = f.opt_u32(8, "group_idx")?;
                let lora_name = f.opt_string(6, "lora_name");
                let keys = super::super::extra_keys::from_value(f.field(7, "extra_keys"));
                let terms = super::super::extra_keys::terms(
                    &keys,
                    block_hashes.len(),
                    lora_name.as_deref(),
                    parent.is_none(),
                );
                Ok(KvEvent::Stored {
                    block_hashes,
                    parent,
                    token_ids,
                    block_size,
                    medium: f.opt_string(5, "medium"),
                    lora_name,
                    cache_salt: get(v, "cache_salt")
                        .and_then(Value::as_str)
                        .map(str::to_owned)
                        .or(terms.cache_salt),
                    group_idx,
                    spec_kind: f.opt_string(9, "kv_cache_spec_kind"),
                    sliding_window: f.opt_u32(10, "kv_cache_spec_sliding_window")?,
                    extra_terms: terms.terms,
                })
            }
            "BlockRemoved" => {
                let f = Fields { value: v, event: "BlockRemoved" };
                Ok(KvEvent::Removed {
                    block_hashes: f.hashes(0, "block_hashes")?,
                    medium: f.opt_string(1, "medium"),
                    group_idx: f.opt_u32(2, "group_idx")?,
                })
            }
            "AllBlocksCleared" => Ok(KvEvent::Cleared),
            other => Ok(KvEvent::Unknown { tag: other.to_owned() }),
        }
    }
}

// === the typed decoder equals the reference ===

mod equivalence {
    use super::*;
    use proptest::prelude::*;
    use rmpv::Value;

    fn enc(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    /// Same outcome: equal batches (NaN-safe), or errors of the same kind and, below the msgpack
    /// level, the same text.
    fn same(bytes: &[u8]) -> Result<(), TestCaseError> {
        let new = decode_batch(bytes);
        let old = reference::decode_batch(bytes);
        match (&new, &old) {
            (Ok(a), Ok(b)) => prop_assert_eq!(format!("{a:?}"), format!("{b:?}")),
            (Err(DecodeError::Msgpack(_)), Err(DecodeError::Msgpack(_))) => {}
            (a, b) => prop_assert_eq!(format!("{a:?}"), format!("{b:?}"), "bytes {:x?}", bytes),
        }
        Ok(())
    }

    fn scalar() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Nil),
            any::<bool>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (0u64..5000).prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            any::<f32>().prop_map(Value::from),
            "[a-zA-Z_]{0,6}".prop_map(Value::from),
            proptest::collection::vec(any::<u8>(), 0..12).prop_map(Value::from),
            Just(Value::Ext(1, vec![0, 1])),
            Just(Value::String(rmpv::Utf8String::from(
                String::from_utf8_lossy(&[0xff, 0xfe]).into_owned()
            ))),
        ]
    }

    fn hash_value() -> impl Strategy<Value = Value> {
        prop_oneof![
            8 => any::<u64>().prop_map(Value::from),
            3 => any::<i64>().prop_map(Value::from),
            3 => proptest::collection::vec(any::<u8>(), 0..40).prop_map(Value::from),
            1 => scalar(),
        ]
    }

    fn hashes() -> impl Strategy<Value = Value> {
        prop_oneof![8 => proptest::collection::vec(hash_value(), 0..5).prop_map(Value::Array), 1 => scalar()]
    }

    fn tokens() -> impl Strategy<Value = Value> {
        let token = prop_oneof![20 => (0u64..200_000).prop_map(Value::from), 1 => scalar(), 1 => Just(Value::from(u64::from(u32::MAX) + 1))];
        prop_oneof![8 => proptest::collection::vec(token, 0..40).prop_map(Value::Array), 1 => scalar()]
    }

    fn small() -> impl Strategy<Value = Value> {
        prop_oneof![6 => (0u64..64).prop_map(Value::from), 1 => scalar()]
    }

    fn tag() -> impl Strategy<Value = Value> {
        prop_oneof![
            5 => Just(Value::from("BlockStored")),
            3 => Just(Value::from("BlockRemoved")),
            1 => Just(Value::from("AllBlocksCleared")),
            1 => Just(Value::from("SomethingNew")),
            1 => scalar(),
        ]
    }

    /// `extra_keys` as vLLM sends them (per block nil or a tuple of names, media pairs and
    /// digests), or anything else.
    fn extra() -> impl Strategy<Value = Value> {
        let key = prop_oneof![
            Just(Value::from("adapter")),
            "[a-c]{0,3}".prop_map(Value::from),
            ("[a-c]{1,3}", -20i64..40)
                .prop_map(|(id, off)| Value::Array(vec![Value::from(id), Value::from(off)])),
            proptest::collection::vec(any::<u8>(), 0..4).prop_map(Value::from),
            scalar(),
        ];
        let entry = prop_oneof![
            2 => Just(Value::Nil),
            3 => proptest::collection::vec(key, 0..3).prop_map(Value::Array),
            1 => scalar(),
        ];
        prop_oneof![4 => proptest::collection::vec(entry, 0..5).prop_map(Value::Array), 1 => scalar()]
    }

    fn maybe_str() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::from("GPU")),
            Just(Value::from("CPU")),
            Just(Value::from("sliding_window")),
            Just(Value::Nil),
            scalar()
        ]
    }

    /// Positional fields (tag first), cut to any length: SGLang and older vLLM send fewer.
    fn array_event() -> impl Strategy<Value = Value> {
        (
            tag(),
            hashes(),
            hash_value(),
            tokens(),
            small(),
            small(),
            maybe_str(),
            maybe_str(),
            extra(),
            small(),
            (maybe_str(), small(), scalar()),
            0usize..14,
        )
            .prop_map(
                |(tag, bh, parent, tok, bs, lora_id, medium, lora, extra, group, spec, len)| {
                    let (kind, window, tail) = spec;
                    let removed_like =
                        vec![tag.clone(), bh.clone(), medium.clone(), group.clone(), kind.clone()];
                    let stored_like = vec![
                        tag, bh, parent, tok, bs, lora_id, medium, lora, extra, group, kind,
                        window, tail,
                    ];
                    let mut v = if len % 3 == 0 { removed_like } else { stored_like };
                    v.truncate(len);
                    Value::Array(v)
                },
            )
    }

    /// Named fields in any order, with duplicates and unknown keys.
    fn map_event() -> impl Strategy<Value = Value> {
        let pair = prop_oneof![
            Just("block_hashes").prop_flat_map(|k| hashes().prop_map(move |v| (k, v))),
            Just("parent_block_hash").prop_flat_map(|k| hash_value().prop_map(move |v| (k, v))),
            Just("token_ids").prop_flat_map(|k| tokens().prop_map(move |v| (k, v))),
            Just("block_size").prop_flat_map(|k| small().prop_map(move |v| (k, v))),
            Just("medium").prop_flat_map(|k| maybe_str().prop_map(move |v| (k, v))),
            Just("lora_name").prop_flat_map(|k| maybe_str().prop_map(move |v| (k, v))),
            Just("cache_salt").prop_flat_map(|k| maybe_str().prop_map(move |v| (k, v))),
            Just("group_idx").prop_flat_map(|k| small().prop_map(move |v| (k, v))),
            Just("kv_cache_spec_kind").prop_flat_map(|k| maybe_str().prop_map(move |v| (k, v))),
            Just("kv_cache_spec_sliding_window")
                .prop_flat_map(|k| small().prop_map(move |v| (k, v))),
            Just("extra_keys").prop_flat_map(|k| extra().prop_map(move |v| (k, v))),
        ];
        (tag(), proptest::collection::vec(pair, 0..10), any::<bool>(), any::<usize>()).prop_map(
            |(tag, pairs, typed, at)| {
                let mut m: Vec<(Value, Value)> =
                    pairs.into_iter().map(|(k, v)| (Value::from(k), v)).collect();
                if typed {
                    let at = at % (m.len() + 1);
                    m.insert(at, (Value::from("type"), tag));
                }
                Value::Map(m)
            },
        )
    }

    fn event() -> impl Strategy<Value = Value> {
        prop_oneof![4 => array_event(), 4 => map_event(), 1 => scalar()]
    }

    fn batch() -> impl Strategy<Value = Value> {
        let ts = prop_oneof![6 => any::<f64>().prop_map(Value::from), 1 => scalar()];
        let events = prop_oneof![8 => proptest::collection::vec(event(), 0..6).prop_map(Value::Array), 1 => scalar()];
        let rank =
            prop_oneof![4 => (0u64..4).prop_map(Value::from), 2 => Just(Value::Nil), 1 => scalar()];
        (ts, events, rank, 0usize..5, any::<bool>(), any::<usize>()).prop_map(
            |(ts, events, rank, len, map, rot)| {
                if map {
                    let mut pairs = vec![
                        (Value::from("ts"), ts),
                        (Value::from("events"), events),
                        (Value::from("data_parallel_rank"), rank),
                        (Value::from("x"), Value::Nil),
                    ];
                    pairs.truncate(len.max(2));
                    let n = pairs.len();
                    pairs.rotate_left(rot % n);
                    Value::Map(pairs)
                } else {
                    let mut items = vec![ts, events, rank, Value::from("extra")];
                    items.truncate(len);
                    Value::Array(items)
                }
            },
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn generated_batches(b in batch()) {
            same(&enc(&b))?;
        }

        #[test]
        fn cut_and_flipped_batches(b in batch(), cut in any::<usize>(), flip in any::<(usize, u8)>()) {
            let bytes = enc(&b);
            let cut_at = cut % (bytes.len() + 1);
            same(&bytes[..cut_at])?;
            let mut flipped = bytes.clone();
            let i = flip.0 % flipped.len();
            flipped[i] ^= flip.1 | 1;
            same(&flipped)?;
        }

        #[test]
        fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            same(&bytes)?;
        }
    }

    #[test]
    fn the_fixtures_decode_the_same() {
        for f in
            ["batch_array.msgpack", "batch_map.msgpack", "batch_v09.msgpack", "batch_bytes.msgpack"]
        {
            same(&fixture(f)).unwrap();
        }
    }

    /// Found by this test: rmpv's recursive reader overflowed the 2 MiB stack of a test thread (a
    /// listener thread has the same) on ~500 nested arrays, a 520-byte frame that aborted the
    /// process. The oracle gets a big stack here; the typed decoder runs on a small one.
    #[test]
    fn deep_nesting_is_refused_alike() {
        let big_stack = std::thread::Builder::new().stack_size(256 << 20);
        big_stack.spawn(deep_nesting_cases).unwrap().join().unwrap();
    }

    #[test]
    fn deep_nesting_needs_little_stack() {
        let small_stack = std::thread::Builder::new().stack_size(256 << 10);
        let run = || {
            for depth in [600usize, 100_000] {
                let mut bytes = vec![0x92u8, 0x01];
                bytes.extend(std::iter::repeat_n(0x91u8, depth));
                assert!(matches!(decode_batch(&bytes), Err(DecodeError::Msgpack(_))));
            }
        };
        small_stack.spawn(run).unwrap().join().unwrap();
    }

    fn deep_nesting_cases() {
        for depth in [100usize, 509, 510, 511, 512, 513, 600] {
            let mut bytes = vec![0x92u8, 0x01];
            bytes.extend(std::iter::repeat_n(0x91u8, depth));
            bytes.push(0x01);
            same(&bytes).unwrap();
            let mut s = vec![0x92u8, 0x01];
            s.extend(std::iter::repeat_n(0x91u8, depth));
            s.extend([0xa1, b'x']);
            same(&s).unwrap();
        }
    }
}
