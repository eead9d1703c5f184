//! Unit tests of `crate::splice`.

use super::*;
use serde_json::json;

const KEY: &str = "kv_transfer_params";

fn splice(body: &str, value: Value) -> Result<String, SpliceError> {
    splice_top_level(body.as_bytes(), KEY, &value).map(|b| String::from_utf8(b).unwrap())
}

#[test]
fn table() {
    let v = json!({"remote_host": "10.0.0.1", "do_remote_prefill": true});
    let vt = r#"{"do_remote_prefill":true,"remote_host":"10.0.0.1"}"#;
    let cases: Vec<(&str, String)> = vec![
        // insert
        (r#"{}"#, format!(r#"{{"{KEY}":{vt}}}"#)),
        ("{ \n }", format!("{{\"{KEY}\":{vt} \n }}")),
        (r#"{"a":1}"#, format!(r#"{{"{KEY}":{vt},"a":1}}"#)),
        ("  {\"a\" : 1.50e3 , \"b\":[1,{\"c\":\"}\"}]}\n", format!("  {{\"{KEY}\":{vt},\"a\" : 1.50e3 , \"b\":[1,{{\"c\":\"}}\"}}]}}\n")),
        // a nested key of the same name is not top level
        (r#"{"x":{"kv_transfer_params":1}}"#, format!(r#"{{"{KEY}":{vt},"x":{{"kv_transfer_params":1}}}}"#)),
        // a string value mentioning the key is not a key
        (r#"{"p":"\"kv_transfer_params\":2"}"#, format!(r#"{{"{KEY}":{vt},"p":"\"kv_transfer_params\":2"}}"#)),
        // replace, keeping surrounding whitespace and order
        (r#"{"a":1,"kv_transfer_params":null,"b":2}"#, format!(r#"{{"a":1,"{KEY}":{vt},"b":2}}"#)),
        (r#"{"kv_transfer_params" :  {"old":[1,2,{"}":"]"}]}  ,"b":2}"#, format!(r#"{{"{KEY}" :  {vt}  ,"b":2}}"#)),
        (r#"{"a":"x","kv_transfer_params":"s\"}"}"#, format!(r#"{{"a":"x","{KEY}":{vt}}}"#)),
        (r#"{"kv_transfer_params":true}"#, format!(r#"{{"{KEY}":{vt}}}"#)),
        // escaped spelling of the same key
        (r#"{"kv\u005ftransfer_params":0}"#, format!(r#"{{"kv\u005ftransfer_params":{vt}}}"#)),
        // duplicates: both replaced
        (r#"{"kv_transfer_params":1,"kv_transfer_params":2}"#, format!(r#"{{"{KEY}":{vt},"{KEY}":{vt}}}"#)),
    ];
    for (body, want) in cases {
        assert_eq!(splice(body, v.clone()).as_deref(), Ok(want.as_str()), "{body}");
    }
}

#[test]
fn errors() {
    // The filter parsed the body as JSON before asking the indexer; these only must not splice.
    for body in ["", "[1]", "\"s\"", "{", "{\"a\"", "{\"a\":}", "{\"a\":[1,2}", "{\"a\":1 2}", "{}x", "{\"a\":1}{}"] {
        assert!(splice(body, json!(1)).is_err(), "{body}");
    }
    assert_eq!(splice("[1]", json!(1)), Err(SpliceError::NotAnObject));
}

#[test]
fn never_panics_on_prefixes_of_valid_json() {
    let body = r#"{"model":"m","messages":[{"role":"user","content":"a \"quoted\" {brace}"}],"kv_transfer_params":{"a":[1,2]},"n":-1.5e-3}"#;
    for end in 0..=body.len() {
        let _ = splice_top_level(&body.as_bytes()[..end], KEY, &json!(null));
    }
    let mut noisy = body.as_bytes().to_vec();
    for i in 0..noisy.len() {
        noisy[i] ^= 0x5a;
        let _ = splice_top_level(&noisy, KEY, &json!(null));
        noisy[i] ^= 0x5a;
    }
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

#[test]
fn unicode_is_copied_byte_for_byte() {
    let body = "{\"prompt\":\"héllo ✓ \\ud83d\\ude00\"}";
    let out = splice(body, json!(null)).unwrap();
    assert!(out.ends_with("\"prompt\":\"héllo ✓ \\ud83d\\ude00\"}"));
}
