//! Unit tests of `crate::splice`: the adapter from a decision's `Value` to the core's JSON editor.
//! The editor itself (insert / replace / duplicates / escaped keys, every error, prefixes and
//! noise, bytes copied as written, edit-then-parse) is tested once, in `core/src/json_edit_tests.rs`.

use super::*;
use serde_json::json;

const KEY: &str = "kv_transfer_params";

fn splice(body: &str, value: Value) -> Result<String, SpliceError> {
    splice_top_level(body.as_bytes(), KEY, &value).map(|b| String::from_utf8(b).unwrap())
}

#[test]
fn a_value_is_written_compactly_inserted_or_replacing() {
    let v = json!({"remote_host": "10.0.0.1", "do_remote_prefill": true});
    let vt = r#"{"do_remote_prefill":true,"remote_host":"10.0.0.1"}"#;
    for (body, want) in [
        (r#"{"a":1}"#, format!(r#"{{"{KEY}":{vt},"a":1}}"#)),
        (r#"{"a":1,"kv_transfer_params":null,"b":2}"#, format!(r#"{{"a":1,"{KEY}":{vt},"b":2}}"#)),
    ] {
        assert_eq!(splice(body, v.clone()).as_deref(), Ok(want.as_str()), "{body}");
    }
}

#[test]
fn a_body_that_is_no_object_is_not_spliced() {
    assert_eq!(splice("[1]", json!(1)), Err(SpliceError::NotAnObject));
    assert!(matches!(splice("{\"a\":", json!(1)), Err(SpliceError::NotJson { .. })));
}

#[test]
fn result_parses_to_the_original_plus_the_key() {
    let bodies = [
        r#"{"model":"m","prompt":[1,2,3],"stream":true}"#,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"kv_transfer_params":{"x":1}}"#,
        "{\n  \"prompt\": \"tab\\there\",\n  \"max_tokens\": 16\n}\n",
        "{}",
    ];
    let params = json!({"do_remote_decode": false, "do_remote_prefill": true, "remote_block_ids": [1, 2], "remote_engine_id": "e"});
    for body in bodies {
        let out = splice_top_level(body.as_bytes(), KEY, &params).unwrap();
        let mut want: Value = serde_json::from_str(body).unwrap();
        want[KEY] = params.clone();
        assert_eq!(serde_json::from_slice::<Value>(&out).unwrap(), want, "{body}");
    }
}
