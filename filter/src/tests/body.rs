//! Unit tests of `crate::body`: the scan answers as `peek` does, and answers the common shapes.

use super::*;
use serde_json::json;

/// `read` must equal `peek` on every body, with and without the anchor; returns whether the scan
/// itself answered (with the anchor: without it, it answers at least as often).
fn agrees(body: &[u8]) -> bool {
    let want = openai::peek(Endpoint::ChatCompletions, body);
    let unanchored = want.clone().map(|p| RequestPeek { conversation_anchor: None, ..p });
    assert_eq!(
        read(Endpoint::ChatCompletions, body, true, &mut |_| None),
        want,
        "{}",
        String::from_utf8_lossy(body)
    );
    assert_eq!(
        read(Endpoint::ChatCompletions, body, false, &mut |_| None),
        unanchored,
        "without the anchor: {}",
        String::from_utf8_lossy(body)
    );
    let fast = fast_chat(body, true, &mut |_| None);
    if let Some(p) = &fast {
        assert_eq!(
            Ok(p),
            want.as_ref(),
            "the scan answered a body peek refuses: {}",
            String::from_utf8_lossy(body)
        );
    }
    if let Some(p) = fast_chat(body, false, &mut |_| None) {
        assert_eq!(
            Ok(&p),
            unanchored.as_ref(),
            "the scan without the anchor answered a body peek refuses: {}",
            String::from_utf8_lossy(body)
        );
    }
    fast.is_some()
}

fn chat(turns: usize) -> serde_json::Value {
    let mut messages = vec![
        json!({"role": "system", "content": "You are terse. ünïcødé ✓"}),
        json!({"role": "user", "content": "first"}),
    ];
    for t in 0..turns {
        messages.push(json!({"role": "assistant", "content": format!("reply {t} \"quoted\" \\ back\nslash \u{1F600}")}));
        messages.push(json!({"role": "user", "content": format!("question {t}"), "name": "u"}));
    }
    json!({"model": "m", "messages": messages, "stream": true, "max_tokens": 16, "temperature": 0.5, "tools": [{"a": [1, -2.5, null, true, false, {}]}]})
}

#[test]
fn the_scan_answers_common_chat_bodies_as_peek() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("compact", serde_json::to_vec(&chat(3)).unwrap_or_default()),
        ("pretty", serde_json::to_vec_pretty(&chat(3)).unwrap_or_default()),
        ("one message", br#"{"messages":[{"role":"user","content":"hi"}]}"#.to_vec()),
        ("no user yet", br#"{"messages":[{"role":"system","content":"s"},{"role":"assistant","content":null}]}"#.to_vec()),
        ("user first", br#"{"messages":[{"content":"q","role":"user"},{"role":"assistant"}],"stream":false}"#.to_vec()),
        ("nulls", br#"{"model":null,"stream":null,"max_tokens":null,"max_completion_tokens":7,"messages":[{"role":"user","content":"x"}]}"#.to_vec()),
        ("anchor parts", br#"{"messages":[{"role":"system","content":[{"type":"text","text":"s"}]},{"role":"user","content":"x"}]}"#.to_vec()),
        ("escapes", br#"{"messages":[{"role":"user","content":"\u00e9\n\t\"\\\/\b\f\r"}],"x":"\u0041"}"#.to_vec()),
        ("whitespace", b" \r\n\t{ \"messages\" : [ { \"role\" : \"user\" , \"content\" : \"x\" } ] } \n".to_vec()),
        ("numbers", br#"{"messages":[{"role":"user"}],"a":[0,-0,1.25,-10.0,123456789012345678901234567890]}"#.to_vec()),
    ];
    for (name, body) in cases {
        assert!(agrees(&body), "{name}: the scan declined a common body");
        // Without the anchor every message is checked by the scan, so parts decline there.
        assert_eq!(
            fast_chat(&body, false, &mut |_| None).is_some(),
            name != "anchor parts",
            "{name}: without the anchor"
        );
    }
}

#[test]
fn the_scan_declines_what_it_does_not_know_and_peek_decides() {
    let cases: &[(&str, &[u8])] = &[
        ("not json", b"{\"messages\":"),
        ("trailing", br#"{"messages":[{"role":"user"}]} x"#),
        ("two documents", br#"{"messages":[{"role":"user"}]}{}"#),
        ("not an object", br#"[{"role":"user"}]"#),
        ("empty object", b"{}"),
        ("no messages", br#"{"model":"m"}"#),
        ("empty messages", br#"{"messages":[]}"#),
        ("messages not a list", br#"{"messages":{"role":"user"}}"#),
        ("message not an object", br#"{"messages":[{"role":"user"},"x"]}"#),
        ("later role missing", br#"{"messages":[{"role":"user"},{"content":"x"}]}"#),
        ("later role not a string", br#"{"messages":[{"role":"user"},{"role":1}]}"#),
        ("later content a number", br#"{"messages":[{"role":"user"},{"role":"assistant","content":5}]}"#),
        ("later content parts", br#"{"messages":[{"role":"user"},{"role":"user","content":[{"type":"text","text":"t"}]}]}"#),
        ("bad later parts", br#"{"messages":[{"role":"user"},{"role":"user","content":[{"type":"text"}]}]}"#),
        ("anchor role missing", br#"{"messages":[{"content":"s"},{"role":"user"}]}"#),
        ("escaped role", br#"{"messages":[{"role":"\u0075ser","content":"x"},{"role":"user"}]}"#),
        ("escaped key", br#"{"mod\u0065l":5,"messages":[{"role":"user"}]}"#),
        ("repeated messages", br#"{"messages":5,"messages":[{"role":"user"}]}"#),
        ("repeated stream", br#"{"stream":1,"stream":true,"messages":[{"role":"user"}]}"#),
        ("repeated role", br#"{"messages":[{"role":"user"},{"role":1,"role":"a"}]}"#),
        ("model a number", br#"{"model":1,"messages":[{"role":"user"}]}"#),
        ("stream a string", br#"{"stream":"yes","messages":[{"role":"user"}]}"#),
        ("max_tokens negative", br#"{"max_tokens":-1,"messages":[{"role":"user"}]}"#),
        ("max_tokens a float", br#"{"max_tokens":1.5,"messages":[{"role":"user"}]}"#),
        ("max_tokens huge", br#"{"max_tokens":123456789012345678901,"messages":[{"role":"user"}]}"#),
        ("exponent", br#"{"a":1e400,"messages":[{"role":"user"}]}"#),
        ("small exponent", br#"{"a":1E5,"messages":[{"role":"user"}]}"#),
        ("leading zero", br#"{"a":01,"messages":[{"role":"user"}]}"#),
        ("bare minus", br#"{"a":-,"messages":[{"role":"user"}]}"#),
        ("dot without digits", br#"{"a":1.,"messages":[{"role":"user"}]}"#),
        ("lone surrogate", br#"{"messages":[{"role":"user","content":"\ud800"}]}"#),
        ("surrogate pair", br#"{"messages":[{"role":"user","content":"\ud83d\ude00"}]}"#),
        ("bad escape", br#"{"messages":[{"role":"user","content":"\x"}]}"#),
        ("short unicode escape", br#"{"messages":[{"role":"user","content":"\u12"}]}"#),
        ("signed unicode escape", br#"{"messages":[{"role":"user","content":"\u+123"}]}"#),
        ("control character", b"{\"messages\":[{\"role\":\"user\",\"content\":\"a\x01b\"}]}"),
        ("invalid utf-8", b"{\"messages\":[{\"role\":\"user\",\"content\":\"ab\xff\xfe cdefgh\"}]}"),
        ("utf-8 outside strings", "{\"messages\":[{\"role\":\"user\"}],\"a\":é}".as_bytes()),
        ("bom", "\u{feff}{\"messages\":[{\"role\":\"user\"}]}".as_bytes()),
        ("trailing comma", br#"{"messages":[{"role":"user"},]}"#),
        ("bad literal", br#"{"messages":[{"role":"user"}],"a":nul}"#),
        ("unterminated string", br#"{"messages":[{"role":"user","content":"abcdefghijklmnop"#),
    ];
    for (name, body) in cases {
        assert!(!agrees(body), "{name}: the scan should have left this body to peek");
    }
    let deep = format!(
        "{{\"messages\":[{{\"role\":\"user\"}}],\"a\":{}{}}}",
        "[".repeat(MAX_DEPTH),
        "]".repeat(MAX_DEPTH)
    );
    assert!(!agrees(deep.as_bytes()), "nesting past MAX_DEPTH");
    let shallow = format!(
        "{{\"messages\":[{{\"role\":\"user\"}}],\"a\":{}{}}}",
        "[".repeat(MAX_DEPTH - 1),
        "]".repeat(MAX_DEPTH - 1)
    );
    assert!(agrees(shallow.as_bytes()), "nesting within MAX_DEPTH");
}

#[test]
fn other_endpoints_are_peeks() {
    for body in [&br#"{"prompt":[1,2,3]}"#[..], br#"{"prompt":"hi","stream":true}"#, b"nope"] {
        assert_eq!(
            read(Endpoint::Completions, body, true, &mut |_| None),
            openai::peek(Endpoint::Completions, body)
        );
    }
}

/// SplitMix64: the mutation test's deterministic randomness.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Bytes a mutation inserts: JSON's structural and escape characters, and some that break it.
const ALPHABET: &[u8] = b"{}[]:,\"\\ \t\nu0aeE.-+9tfnlr\x01\x7f\xc3\xa9\xff/";

#[test]
fn the_scan_equals_peek_on_mutated_bodies() {
    let mut rng = Rng(16);
    let seeds: Vec<Vec<u8>> = vec![
        serde_json::to_vec(&chat(2)).unwrap_or_default(),
        serde_json::to_vec_pretty(&chat(1)).unwrap_or_default(),
        br#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"\u00e9"},{"role":"assistant","content":null}],"stream":false,"max_tokens":3}"#.to_vec(),
    ];
    let (mut answered, mut total) = (0, 0);
    for round in 0..6000 {
        let mut body = seeds[round % seeds.len()].clone();
        for _ in 0..=rng.below(3) {
            let at = rng.below(body.len() + 1);
            match rng.below(3) {
                0 => body.insert(at, ALPHABET[rng.below(ALPHABET.len())]),
                1 if at < body.len() => {
                    body.remove(at);
                }
                _ if at < body.len() => body[at] = ALPHABET[rng.below(ALPHABET.len())],
                _ => {}
            }
        }
        total += 1;
        answered += usize::from(agrees(&body));
    }
    // Most single-byte edits land in message text: the scan must still answer those itself.
    assert!(answered * 5 > total, "the scan answered only {answered} of {total} mutated bodies");
}

#[test]
fn a_skip_to_a_body_base_end_reads_on_from_there_with_peeks_answer() {
    // Turn 1 has a later message with content parts, which the scan declines to read itself;
    // turn 2 repeats turn 1's messages byte for byte, and the base ends after its last message.
    let mut messages = vec![
        json!({"role": "system", "content": "s"}),
        json!({"role": "user", "content": "first"}),
        json!({"role": "assistant", "content": [{"type": "text", "text": "parts"}]}),
        json!({"role": "user", "content": "second"}),
    ];
    let turn1 = serde_json::to_vec(&json!({"model": "m", "messages": messages, "stream": true}))
        .unwrap_or_default();
    let base_end = turn1.iter().rposition(|&c| c == b']').unwrap_or_default();
    messages.push(json!({"role": "assistant", "content": "reply"}));
    messages.push(json!({"role": "user", "content": "third"}));
    let body = serde_json::to_vec(&json!({"model": "m", "messages": messages, "stream": true}))
        .unwrap_or_default();
    assert_eq!(body.get(..base_end), turn1.get(..base_end), "turn 2 starts with turn 1's base");
    let want = openai::peek(Endpoint::ChatCompletions, &body);
    assert!(
        fast_chat(&body, true, &mut |_| None).is_none(),
        "read whole, the scan declines the parts"
    );

    for anchor in [true, false] {
        let want = want.clone().map(|p| {
            if anchor {
                p
            } else {
                RequestPeek { conversation_anchor: None, ..p }
            }
        });
        // Asked once, with the anchor's digest: the scan goes on from the base's end and answers.
        let mut asked = Vec::new();
        let got = fast_chat(&body, anchor, &mut |digest| {
            asked.push(digest);
            Some(base_end)
        });
        assert_eq!(got.as_ref(), want.as_ref().ok(), "anchor {anchor}");
        assert_eq!(
            asked,
            vec![want.as_ref().ok().and_then(|p| p.conversation_anchor)],
            "anchor {anchor}"
        );
        // An offset not after an element declines (then `peek` reads it whole); one not past the
        // scan's place is not taken.
        assert_eq!(fast_chat(&body, anchor, &mut |_| Some(base_end - 1)), None, "anchor {anchor}");
        assert_eq!(
            read(Endpoint::ChatCompletions, &body, anchor, &mut |_| Some(base_end - 1)),
            want,
            "anchor {anchor}"
        );
        assert_eq!(
            fast_chat(&body, anchor, &mut |_| Some(1)),
            None,
            "anchor {anchor}: read on, the parts declined"
        );
    }
}

/// `model` (issue 44: it selects the workers) comes out of the scan as `parse` reads it, wherever
/// it stands and however it is escaped, without sending the body to `peek`.
#[test]
fn the_scan_reads_the_model() {
    let msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
    let cases: [(String, Option<&str>); 6] = [
        (format!(r#"{{"model":"base-a",{msgs}}}"#), Some("base-a")),
        (format!(r#"{{{msgs},"model":"a-sql","stream":true}}"#), Some("a-sql")),
        (format!(r#"{{"model":"q\/w\u00e9\"n",{msgs}}}"#), Some("q/wé\"n")),
        (format!(r#"{{"model":null,{msgs}}}"#), None),
        (format!(r#"{{"model":"",{msgs}}}"#), Some("")),
        (format!(r#"{{{msgs}}}"#), None),
    ];
    for (body, model) in cases {
        assert!(agrees(body.as_bytes()), "the scan answers {body}");
        let read = read(Endpoint::ChatCompletions, body.as_bytes(), true, &mut |_| None).unwrap();
        assert_eq!(read.model.as_deref(), model, "{body}");
        let parsed =
            openai::Body::new(Endpoint::ChatCompletions, body.as_bytes()).request().unwrap();
        assert_eq!(read.model, parsed.model);
    }
    // A model that is not a string is `parse`'s error, as before.
    let wrong = format!(r#"{{"model":7,{msgs}}}"#);
    assert!(!agrees(wrong.as_bytes()));
    assert!(read(Endpoint::ChatCompletions, wrong.as_bytes(), true, &mut |_| None).is_err());
    // Completions bodies are read by `peek`, `model` included.
    let completion = br#"{"model":"b-code","prompt":[1,2,3]}"#;
    let read = read(Endpoint::Completions, completion, false, &mut |_| None).unwrap();
    assert_eq!(read.model.as_deref(), Some("b-code"));
}
