//! The OpenAI surface of a real `vllm-sim` process: malformed requests get vLLM-style 400s and
//! never kill it; streaming is chunk-by-chunk over time with usage and `[DONE]`; a client that
//! disconnects mid-stream frees its blocks; headers, determinism, re-encodable replies; fault
//! injection (fail next N, fail prefill, vanish and come back); prefix-cache reset.

// Test code: a failed unwrap is a failed test (clippy.toml allows this in #[test] fns only).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Read;
use std::time::{Duration, Instant};

use common::{client, patience, poll, Sim};
use serde_json::{json, Value};

#[test]
fn malformed_requests_get_400_json_and_the_worker_lives_on() {
    let sim = Sim::spawn(&["--max-model-len", "64", "--speedup", "100"]);
    let long: Vec<u32> = (0..80).collect();
    let cases: &[(&str, &str, u16, &str)] = &[
        ("/v1/completions", "{not json", 400, "not valid JSON"),
        ("/v1/completions", "[1,2]", 400, "not a JSON object"),
        ("/v1/completions", r#"{"model":"deepseek-v4"}"#, 400, "missing field `prompt`"),
        ("/v1/completions", r#"{"prompt":5}"#, 400, "prompt"),
        ("/v1/completions", r#"{"prompt":[1,-2]}"#, 400, "token ids"),
        ("/v1/completions", r#"{"prompt":["a","b"]}"#, 400, "batched"),
        ("/v1/completions", r#"{"prompt":""}"#, 400, "empty"),
        ("/v1/completions", r#"{"prompt":[4000000]}"#, 400, "out of vocabulary"),
        ("/v1/completions", r#"{"prompt":"hi","max_tokens":0}"#, 400, "max_tokens"),
        ("/v1/completions", r#"{"prompt":"hi","max_tokens":"x"}"#, 400, "max_tokens"),
        ("/v1/completions", r#"{"prompt":"hi","n":3}"#, 400, "n > 1"),
        ("/v1/completions", r#"{"prompt":"hi","seed":"x"}"#, 400, "seed"),
        (
            "/v1/completions",
            r#"{"prompt":"hi","stream":true,"kv_transfer_params":{"do_remote_decode":true}}"#,
            400,
            "cannot stream",
        ),
        (
            "/v1/completions",
            r#"{"prompt":"hi","kv_transfer_params":{"do_remote_prefill":true}}"#,
            400,
            "kv_transfer_params",
        ),
        ("/v1/completions", r#"{"prompt":"hi","model":"gpt-4"}"#, 404, "does not exist"),
        ("/v1/chat/completions", r#"{"messages":[]}"#, 400, "messages"),
        ("/v1/chat/completions", r#"{"messages":[{"content":"x"}]}"#, 400, "role"),
        ("/v1/chat/completions", r#"{"messages":"hi"}"#, 400, "messages"),
    ];
    let http = client();
    for (path, body, status, needle) in cases {
        let resp = http
            .post(sim.url(path))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .unwrap();
        assert_eq!(resp.status().as_u16(), *status, "{path} {body}");
        assert_eq!(resp.headers()["x-sim-worker"], sim.id.as_str());
        let v: Value = resp.json().unwrap();
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{body}: {msg:?} lacks {needle:?}");
        assert_eq!(v["error"]["code"], *status);
        assert!(v["error"]["type"].as_str().is_some_and(|t| t.ends_with("Error")));
    }
    let (status, v) = sim.post("/v1/completions", &json!({"prompt": long, "max_tokens": 1}));
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("maximum context length is 64"));
    assert!(sim.metric("kvmesh_sim_requests_rejected_total") >= cases.len() as f64);

    assert_eq!(http.get(sim.url("/health")).send().unwrap().status(), 200);
    let (status, ok) =
        sim.post("/v1/completions", &json!({"prompt": "still alive?", "max_tokens": 2}));
    assert_eq!(status, 200, "{ok}");
}

/// Reads an SSE body chunk by chunk, timestamping every `data:` event.
fn read_events(mut resp: reqwest::blocking::Response) -> Vec<(Instant, String)> {
    let mut events = Vec::new();
    let mut pending = String::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = resp.read(&mut buf).unwrap();
        if n == 0 {
            return events;
        }
        let now = Instant::now();
        pending.push_str(std::str::from_utf8(&buf[..n]).unwrap());
        while let Some(end) = pending.find("\n\n") {
            let ev: String = pending.drain(..end + 2).collect();
            events.push((now, ev.trim_end().strip_prefix("data: ").unwrap().to_owned()));
        }
    }
}

#[test]
fn streaming_is_chunk_by_chunk_with_usage_and_done() {
    let sim = Sim::spawn(&["--itl-ms", "100", "--speedup", "1"]);
    let resp = client()
        .post(sim.url("/v1/chat/completions"))
        .header("x-request-id", "req-42")
        .json(&json!({"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 5, "stream": true,
            "stream_options": {"include_usage": true}}))
        .send()
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert_eq!(resp.headers()["x-request-id"], "req-42");
    assert_eq!(resp.headers()["x-sim-worker"], sim.id.as_str());
    let events = read_events(resp);
    assert_eq!(events.len(), 1 + 5 + 1 + 1, "role, 5 tokens, usage, [DONE]");
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let json: Vec<Value> =
        events[..7].iter().map(|(_, e)| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(json[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(json
        .iter()
        .all(|c| c["id"] == "chatcmpl-req-42" && c["object"] == "chat.completion.chunk"));
    let text: String = json[1..6]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap().to_owned())
        .collect();
    assert!(!text.is_empty());
    assert!(json[1..5].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
    assert_eq!(json[5]["choices"][0]["finish_reason"], "length");
    assert_eq!(json[6]["choices"], json!([]));
    assert_eq!(json[6]["usage"]["completion_tokens"], 5);
    // Four inter-token latencies of 100 ms separate the first token from the last: the body
    // was streamed as produced, not buffered.
    let spread = events[5].0 - events[1].0;
    assert!(spread >= Duration::from_millis(250), "tokens arrived within {spread:?}");

    // Without include_usage there is no usage chunk; completions chunks carry text.
    let resp = client()
        .post(sim.url("/v1/completions"))
        .json(&json!({"prompt": "once upon", "max_tokens": 2, "stream": true}))
        .send()
        .unwrap();
    let events = read_events(resp);
    assert_eq!(events.len(), 3);
    let last: Value = serde_json::from_str(&events[1].1).unwrap();
    assert_eq!(last["object"], "text_completion");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(last.get("usage").is_none());
}

#[test]
fn a_client_disconnect_mid_stream_cancels_and_frees_blocks() {
    let sim = Sim::spawn(&["--itl-ms", "20", "--speedup", "1"]);
    let mut resp = client()
        .post(sim.url("/v1/completions"))
        .json(&json!({"prompt": (100..400).collect::<Vec<u32>>(), "max_tokens": 5000, "stream": true}))
        .send()
        .unwrap();
    let mut buf = [0u8; 1024];
    assert!(resp.read(&mut buf).unwrap() > 0);
    poll("the request to run", || (sim.metric("vllm:num_requests_running") == 1.0).then_some(()));
    assert!(sim.metric("vllm:kv_cache_usage_perc") > 0.0);
    drop(resp);
    poll("the request to be cancelled", || {
        (sim.metric("vllm:num_requests_running") == 0.0
            && sim.metric("vllm:kv_cache_usage_perc") == 0.0)
            .then_some(())
    });
    assert_eq!(sim.metric("kvmesh_sim_requests_aborted_total"), 1.0);
    // Its prompt blocks stay cached (free, evictable).
    let cache = sim.get("/admin/cache");
    assert!(cache["blocks"].as_array().unwrap().len() >= 300 / 16);
    assert!(cache["blocks"].as_array().unwrap().iter().all(|b| b["ref_cnt"] == 0));
}

#[test]
fn replies_are_deterministic_and_re_encode_to_the_same_tokens() {
    let sim = Sim::spawn(&["--speedup", "100"]);
    let body =
        json!({"prompt": "The capital of France is", "max_tokens": 12, "return_token_ids": true});
    let (_, a) = sim.post("/v1/completions", &body);
    let (_, b) = sim.post("/v1/completions", &body);
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "a 5-token prompt fills no block"
    );
    let (_, c) = sim
        .post("/v1/completions", &json!({"prompt": "The capital of Spain is", "max_tokens": 12}));
    assert_ne!(a["choices"][0]["text"], c["choices"][0]["text"]);

    let tok = kvmesh_tokens::Tokenizer::from_file(kvmesh_tokens::default_tokenizer_path()).unwrap();
    let ids: Vec<u32> = a["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(tok.encode(a["choices"][0]["text"].as_str().unwrap()).unwrap(), ids);
    let specials: Vec<u32> =
        ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
            .iter()
            .filter_map(|t| tok.token_to_id(t))
            .collect();
    assert!(ids.iter().all(|id| !specials.contains(id)));

    // A chat turn: the second turn's prompt (history + reply + new question) hits the blocks of
    // the first turn's prompt, which is what a multi-turn client relies on.
    let mut messages = vec![
        json!({"role": "user", "content": "Write a long answer about the history of the Roman Empire, please."}),
    ];
    let (_, r1) =
        sim.post("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 20}));
    messages.push(json!({"role": "assistant", "content": r1["choices"][0]["message"]["content"]}));
    messages.push(json!({"role": "user", "content": "And then?"}));
    let (_, r2) = sim.post("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 5}));
    let p1 = r1["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        r2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() >= p1 / 16 * 16
    );
}

#[test]
fn fault_injection_and_reset() {
    let sim =
        Sim::spawn(&["--speedup", "100", "--fail-next-count", "1", "--fail-next-status", "503"]);
    let plain = json!({"prompt": [5000, 5001, 5002, 5003], "max_tokens": 1});
    assert_eq!(sim.post("/v1/completions", &plain).0, 503, "start-up fault");
    assert_eq!(sim.post("/v1/completions", &plain).0, 200);

    let (status, f) = sim.post(
        "/admin/faults",
        &json!({"fail_next_count": 2, "fail_next_status": 429, "fail_prefill_status": 500}),
    );
    assert_eq!(status, 200);
    assert_eq!(f["fail_prefill_status"], 500);
    assert_eq!(sim.get("/admin/faults")["fail_next_count"], 2);
    assert_eq!(sim.post("/v1/completions", &plain).0, 429);
    assert_eq!(sim.post("/v1/completions", &plain).0, 429);
    assert_eq!(sim.post("/v1/completions", &plain).0, 200);
    let prefill = json!({"prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    assert_eq!(sim.post("/v1/completions", &prefill).0, 500);
    assert_eq!(sim.post("/admin/faults", &json!({"fail_prefill_status": null})).0, 200);
    assert_eq!(sim.post("/v1/completions", &prefill).0, 200);
    assert_eq!(sim.post("/admin/faults", &json!({"fail_prefill_status": 200})).0, 400);
    assert_eq!(sim.post("/admin/faults", &json!({"bogus": 1})).0, 400);

    assert!(sim.metric("kvmesh_sim_faults_injected_total") >= 4.0);

    // Vanish: connections are refused, then the worker is back on the same port.
    let (status, _) = sim.post("/admin/faults", &json!({"vanish_ms": 1500}));
    assert_eq!(status, 200);
    let quick =
        reqwest::blocking::Client::builder().timeout(Duration::from_millis(500)).build().unwrap();
    poll("the worker to vanish", || quick.get(sim.url("/health")).send().is_err().then_some(()));
    let gone_at = Instant::now();
    poll("the worker to come back", || {
        quick.get(sim.url("/health")).send().ok().filter(|r| r.status() == 200)
    });
    assert!(gone_at.elapsed() < patience());
    assert_eq!(sim.post("/v1/completions", &plain).0, 200);
}

#[test]
fn reset_prefix_cache_clears_the_cache() {
    let sim = Sim::spawn(&["--speedup", "100"]);
    let (status, _) = sim.post(
        "/v1/completions",
        &json!({"prompt": (7000..7040).collect::<Vec<u32>>(), "max_tokens": 1}),
    );
    assert_eq!(status, 200);
    assert_eq!(sim.get("/admin/cache")["blocks"].as_array().unwrap().len(), 2);
    assert_eq!(sim.post("/reset_prefix_cache", &json!({})).0, 200);
    assert!(sim.get("/admin/cache")["blocks"].as_array().unwrap().is_empty());
    let models = sim.get("/v1/models");
    assert_eq!(models["data"][0]["id"], "deepseek-v4");
    let info = sim.get("/admin/info");
    assert_eq!(
        (info["id"].as_str(), info["role"].as_str(), info["block_size"].as_u64()),
        (Some(sim.id.as_str()), Some("both"), Some(16))
    );
}
