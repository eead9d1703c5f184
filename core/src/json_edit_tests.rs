//! Unit and property tests of `crate::json_edit`.

use super::*;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

const KEY: &str = "kv_transfer_params";

fn set(key: &str, value: &str) -> Edit<'static> {
    Edit::Set {
        key: Box::leak(key.to_owned().into_boxed_str()),
        value: Cow::Owned(value.to_owned()),
    }
}

fn run(body: &str, edits: &[Edit<'_>]) -> Result<String, EditError> {
    edit(body.as_bytes(), edits).map(|b| String::from_utf8(b).unwrap())
}

#[test]
fn set_table() {
    let vt = r#"{"do_remote_prefill":true,"remote_host":"10.0.0.1"}"#;
    let cases: Vec<(&str, String)> = vec![
        // insert
        (r#"{}"#, format!(r#"{{"{KEY}":{vt}}}"#)),
        ("{ \n }", format!("{{\"{KEY}\":{vt} \n }}")),
        (r#"{"a":1}"#, format!(r#"{{"{KEY}":{vt},"a":1}}"#)),
        (
            "  {\"a\" : 1.50e3 , \"b\":[1,{\"c\":\"}\"}]}\n",
            format!("  {{\"{KEY}\":{vt},\"a\" : 1.50e3 , \"b\":[1,{{\"c\":\"}}\"}}]}}\n"),
        ),
        // a nested key of the same name is not top level
        (
            r#"{"x":{"kv_transfer_params":1}}"#,
            format!(r#"{{"{KEY}":{vt},"x":{{"kv_transfer_params":1}}}}"#),
        ),
        // a string value mentioning the key is not a key
        (
            r#"{"p":"\"kv_transfer_params\":2"}"#,
            format!(r#"{{"{KEY}":{vt},"p":"\"kv_transfer_params\":2"}}"#),
        ),
        // replace, keeping surrounding whitespace and order
        (r#"{"a":1,"kv_transfer_params":null,"b":2}"#, format!(r#"{{"a":1,"{KEY}":{vt},"b":2}}"#)),
        (
            r#"{"kv_transfer_params" :  {"old":[1,2,{"}":"]"}]}  ,"b":2}"#,
            format!(r#"{{"{KEY}" :  {vt}  ,"b":2}}"#),
        ),
        (r#"{"a":"x","kv_transfer_params":"s\"}"}"#, format!(r#"{{"a":"x","{KEY}":{vt}}}"#)),
        (r#"{"kv_transfer_params":true}"#, format!(r#"{{"{KEY}":{vt}}}"#)),
        // escaped spelling of the same key: the spelling stays
        (r#"{"kv\u005ftransfer_params":0}"#, format!(r#"{{"kv\u005ftransfer_params":{vt}}}"#)),
        // duplicates: both replaced
        (
            r#"{"kv_transfer_params":1,"kv_transfer_params":2}"#,
            format!(r#"{{"{KEY}":{vt},"{KEY}":{vt}}}"#),
        ),
    ];
    for (body, want) in cases {
        assert_eq!(run(body, &[set(KEY, vt)]).as_deref(), Ok(want.as_str()), "{body}");
    }
}

#[test]
fn replace_and_remove_table() {
    let rm = |k: &'static str| Edit::Remove { key: k };
    let rep = |k: &'static str, v: &'static str| Edit::Replace { key: k, value: Cow::Borrowed(v) };
    let cases: Vec<(&str, Vec<Edit<'static>>, &str)> = vec![
        (r#"{"a":1,"b":2,"c":3}"#, vec![rm("a")], r#"{"b":2,"c":3}"#),
        (r#"{"a":1,"b":2,"c":3}"#, vec![rm("b")], r#"{"a":1,"c":3}"#),
        (r#"{"a":1,"b":2,"c":3}"#, vec![rm("c")], r#"{"a":1,"b":2}"#),
        (r#"{ "a" : 1 , "b" : 2 }"#, vec![rm("a")], r#"{ "b" : 2 }"#),
        (r#"{ "a" : 1 , "b" : 2 }"#, vec![rm("b")], r#"{ "a" : 1 }"#),
        (r#"{"a":1}"#, vec![rm("a")], r#"{}"#),
        (r#"{"a":1,"a":2,"b":3}"#, vec![rm("a")], r#"{"b":3}"#),
        (r#"{"a":1}"#, vec![rm("zz")], r#"{"a":1}"#),
        (r#"{"a":1}"#, vec![rep("b", "2")], r#"{"a":1}"#),
        (r#"{"a":1,"b":1.0e0}"#, vec![rep("b", "2")], r#"{"a":1,"b":2}"#),
        // the last edit of a key counts
        (r#"{"a":1}"#, vec![rm("a"), set("a", "5")], r#"{"a":5}"#),
        (r#"{"a":1}"#, vec![set("a", "5"), rm("a")], r#"{}"#),
        (r#"{"a":1}"#, vec![set("x", "5"), rm("x")], r#"{"a":1}"#),
        // inserts in edit order, then the kept members
        (
            r#"{"a":1,"s":true}"#,
            vec![set("x", "1"), set("y", "2"), rm("s")],
            r#"{"x":1,"y":2,"a":1}"#,
        ),
        (r#"{"s":true}"#, vec![set("x", "1"), rm("s")], r#"{"x":1}"#),
        // numbers and escapes elsewhere are copied as written
        (
            r#"{"n":1e3,"big":123456789012345678901234567890,"t":"\u00e9\n","s":1}"#,
            vec![rm("s")],
            r#"{"n":1e3,"big":123456789012345678901234567890,"t":"\u00e9\n"}"#,
        ),
    ];
    for (body, edits, want) in cases {
        assert_eq!(run(body, &edits).as_deref(), Ok(want), "{body} {edits:?}");
    }
}

#[test]
fn no_edit_is_the_identity() {
    for body in ["{}", " { } ", "{\"a\" :[1, {\"b\":\"}\"}] ,\"c\":null }\n", "{\"a\":1,\"a\":2}"] {
        assert_eq!(run(body, &[]).as_deref(), Ok(body));
        assert_eq!(run(body, &[Edit::Remove { key: "zz" }]).as_deref(), Ok(body));
    }
}

#[test]
fn errors() {
    type IsError = fn(&EditError) -> bool;
    let cases: &[(&str, IsError)] = &[
        ("", |e| matches!(e, EditError::NotJson { .. })),
        ("[1]", |e| *e == EditError::NotAnObject),
        ("\"s\"", |e| *e == EditError::NotAnObject),
        ("7", |e| *e == EditError::NotAnObject),
        ("{", |e| matches!(e, EditError::NotJson { .. })),
        ("{\"a\"", |e| matches!(e, EditError::NotJson { .. })),
        ("{\"a\":}", |e| matches!(e, EditError::NotJson { .. })),
        ("{\"a\":[1,2}", |e| matches!(e, EditError::NotJson { .. })),
        ("{\"a\":1 2}", |e| matches!(e, EditError::NotJson { .. })),
        ("{}x", |e| matches!(e, EditError::NotJson { .. })),
        ("{\"a\":1}{}", |e| matches!(e, EditError::NotJson { .. })),
        ("{\"a\":1,}", |e| matches!(e, EditError::NotJson { .. })),
        ("{\"a\":\"\u{1}\"}", |e| matches!(e, EditError::NotJson { .. })),
    ];
    for (body, ok) in cases {
        let e = run(body, &[set(KEY, "1")]).unwrap_err();
        assert!(ok(&e), "{body}: {e}");
    }
    assert_eq!(run("{}", &[set(KEY, "1 2")]), Err(EditError::BadValue));
    assert_eq!(run("{}", &[set(KEY, "")]), Err(EditError::BadValue));
    assert_eq!(
        run("{}", &[Edit::Replace { key: KEY, value: Cow::Borrowed("{") }]),
        Err(EditError::BadValue)
    );
    assert!(TopLevel::scan(b"\xff").is_err());
}

#[test]
fn never_panics_on_prefixes_and_noise() {
    let body = r#"{"model":"m","messages":[{"role":"user","content":"a \"quoted\" {brace}"}],"kv_transfer_params":{"a":[1,2]},"n":-1.5e-3}"#;
    let edits = [set(KEY, "null"), Edit::Remove { key: "n" }];
    for end in 0..=body.len() {
        let _ = edit(&body.as_bytes()[..end], &edits);
    }
    let mut noisy = body.as_bytes().to_vec();
    for i in 0..noisy.len() {
        noisy[i] ^= 0x5a;
        let _ = edit(&noisy, &edits);
        noisy[i] ^= 0x5a;
    }
}

#[test]
fn reads_keys_and_raw_values() {
    let t = TopLevel::scan(br#" {"a" : [1, 2] ,"b\u0021":"x","a":3} "#).unwrap();
    assert_eq!((t.len(), t.is_empty()), (3, false));
    assert_eq!(t.get("a"), Some("3"), "the last occurrence, as Value keeps");
    assert_eq!(t.get("b!"), Some("\"x\""));
    assert!(t.contains("b!") && !t.contains("c"));
    assert!(TopLevel::scan(b"{}").unwrap().is_empty());
}

#[test]
fn unicode_is_copied_byte_for_byte() {
    let body = "{\"prompt\":\"héllo ✓ \\ud83d\\ude00\"}";
    let out = run(body, &[set(KEY, "null")]).unwrap();
    assert!(out.ends_with("\"prompt\":\"héllo ✓ \\ud83d\\ude00\"}"));
}

// === edit then parse == parse then edit ===

fn json_tree() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        "[a-z\"\\\\{}\\[\\],:é ]{0,4}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            proptest::collection::btree_map("[a-c]{1,2}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Top-level keys are drawn from a small set, so edits hit, miss and nest alike.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("a".to_owned()),
        Just("b".to_owned()),
        Just(KEY.to_owned()),
        Just("k\"q".to_owned()),
        Just("é".to_owned())
    ]
}

#[derive(Debug, Clone)]
enum Op {
    Set(String, Value),
    Replace(String, Value),
    Remove(String),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (key(), json_tree()).prop_map(|(k, v)| Op::Set(k, v)),
        (key(), json_tree()).prop_map(|(k, v)| Op::Replace(k, v)),
        key().prop_map(Op::Remove),
    ]
}

/// The edits on a parsed object: the meaning the byte editor must have. Only the last op of a key
/// counts, as in [`TopLevel::apply`].
fn edit_map(mut obj: Map<String, Value>, ops: &[Op]) -> Map<String, Value> {
    let last = |k: &str| {
        ops.iter()
            .rev()
            .find(|o| matches!(o, Op::Set(x, _) | Op::Replace(x, _) | Op::Remove(x) if x == k))
    };
    let mut done = std::collections::HashSet::new();
    for o in ops.iter().rev() {
        let k = match o {
            Op::Set(k, _) | Op::Replace(k, _) | Op::Remove(k) => k,
        };
        if !done.insert(k.clone()) {
            continue;
        }
        match last(k) {
            Some(Op::Set(k, v)) => {
                obj.insert(k.clone(), v.clone());
            }
            Some(Op::Replace(k, v)) if obj.contains_key(k) => {
                obj.insert(k.clone(), v.clone());
            }
            Some(Op::Remove(k)) => {
                obj.remove(k);
            }
            _ => {}
        }
    }
    obj
}

fn to_edits(ops: &[Op]) -> Vec<Edit<'_>> {
    ops.iter()
        .map(|o| match o {
            Op::Set(k, v) => Edit::set_value(k, v),
            Op::Replace(k, v) => Edit::Replace { key: k, value: Cow::Owned(v.to_string()) },
            Op::Remove(k) => Edit::Remove { key: k },
        })
        .collect()
}

proptest! {
    #[test]
    fn edit_then_parse_is_parse_then_edit(
        members in proptest::collection::vec((key(), json_tree()), 0..5),
        ops in proptest::collection::vec(op(), 0..5),
        pretty in any::<bool>(),
    ) {
        let obj: Map<String, Value> = members.into_iter().collect();
        let value = Value::Object(obj);
        let body = if pretty { serde_json::to_vec_pretty(&value).unwrap() } else { serde_json::to_vec(&value).unwrap() };
        let edits = to_edits(&ops);
        let out = edit(&body, &edits).unwrap();
        let parsed: Value = serde_json::from_slice(&out).unwrap();
        // Parse then edit: the body as a parser reads it, the new values as a parser reads their
        // text (serde_json's float parsing is not round-trip exact, on both sides alike).
        let Ok(Value::Object(before)) = serde_json::from_slice::<Value>(&body) else { unreachable!("an object") };
        let reparse = |v: &Value| serde_json::from_str::<Value>(&v.to_string()).unwrap();
        let read_ops: Vec<Op> = ops
            .iter()
            .map(|o| match o {
                Op::Set(k, v) => Op::Set(k.clone(), reparse(v)),
                Op::Replace(k, v) => Op::Replace(k.clone(), reparse(v)),
                Op::Remove(k) => Op::Remove(k.clone()),
            })
            .collect();
        prop_assert_eq!(parsed, Value::Object(edit_map(before, &read_ops)));
        if ops.is_empty() {
            prop_assert_eq!(out, body);
        }
    }

    #[test]
    fn untouched_members_keep_their_bytes(members in proptest::collection::vec((key(), json_tree()), 1..5)) {
        let obj: Map<String, Value> = members.into_iter().collect();
        let body = serde_json::to_vec_pretty(&Value::Object(obj)).unwrap();
        let out = edit(&body, &[Edit::Set { key: "zz", value: Cow::Borrowed("1") }]).unwrap();
        // Inserted after the brace; everything after it is the original text.
        let tail = &body[1..];
        prop_assert!(out.ends_with(tail));
        prop_assert_eq!(&out[..7], b"{\"zz\":1".as_slice());
    }
}

#[test]
fn duplicates_and_set_agree_with_value_semantics() {
    // With duplicates, a parser keeps the last occurrence: after a set every occurrence holds the value.
    let out = run(r#"{"a":1,"b":2,"a":3}"#, &[set("a", "[9]")]).unwrap();
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), json!({"a": [9], "b": 2}));
    assert_eq!(out, r#"{"a":[9],"b":2,"a":[9]}"#);
}
