//! Seed corpora from the project's real fixtures and shipped files: vLLM event batches written by
//! msgspec from vLLM's own structs (`sidecar-indexer/tests/fixtures/`), the shipped fleet files and
//! plugin configuration, request bodies in the shapes OpenAI clients send, and a vLLM `/metrics`
//! exposition with the families the indexer reads.

/// vLLM / SGLang event batches (both layouts, v0.9, byte hashes).
pub fn kv_batches() -> Vec<Vec<u8>> {
    vec![
        include_bytes!("../../sidecar-indexer/tests/fixtures/batch_array.msgpack").to_vec(),
        include_bytes!("../../sidecar-indexer/tests/fixtures/batch_map.msgpack").to_vec(),
        include_bytes!("../../sidecar-indexer/tests/fixtures/batch_v09.msgpack").to_vec(),
        include_bytes!("../../sidecar-indexer/tests/fixtures/batch_bytes.msgpack").to_vec(),
    ]
}

/// `len, bytes` framing of `frames`, the message part of the [`crate::targets::kv_frames`] input.
fn framed(frames: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        let f = &f[..f.len().min(255)];
        out.push(f.len() as u8);
        out.extend_from_slice(f);
    }
    out
}

/// Live messages `[topic, seq, payload]`, replay replies and end markers, then sequencer ops.
pub fn kv_frames() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for (i, b) in kv_batches().iter().enumerate() {
        let seq = (i as u64).to_be_bytes();
        for message in [framed(&[b"kv", &seq, b]), framed(&[b"", &seq, b]), framed(&[&[0xff; 8]])] {
            let mut input = (message.len() as u16).to_be_bytes().to_vec();
            input.extend(message);
            input
                .extend([0u8, 0, 0, 0, 0, 5, 1, 3, 0, 1, 0, 0xfd, 3, 0xff, 0, 0xff, 2, 0, 0, 0xfe]);
            out.push(input);
        }
    }
    out
}

/// OpenAI request bodies: chat (system/user/assistant turns, tool calls, content parts), completions
/// with a string, token ids and a batch, streaming options, cache salt.
pub fn route_bodies() -> Vec<Vec<u8>> {
    [
        r#"{"model":"deepseek-v4","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Hello"},{"role":"assistant","content":"Hi."},{"role":"user","content":"Tell me more"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":64}"#,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"part one"},{"type":"text","text":"part two"}]}],"temperature":0.2}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"weather?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get","arguments":"{\"city\":\"Paris\"}"}}]},{"role":"tool","tool_call_id":"c1","content":"sunny"}],"tools":[{"type":"function","function":{"name":"get","parameters":{"type":"object"}}}]}"#,
        r#"{"model":"m","prompt":"Once upon a time","max_tokens":16,"cache_salt":"tenant-a"}"#,
        r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"stream":false}"#,
        r#"{"model":"m","prompt":["a","b"],"n":2}"#,
        "0123456789abcdef;source=prefix",
        "00000000000000ff;source=header",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

/// Header blocks (`name byte, len, value`) followed by a body, for the filter's request parser.
pub fn filter_requests() -> Vec<Vec<u8>> {
    let headers: [(u8, &[u8]); 6] = [
        (0, b"POST"),
        (1, b"/v1/chat/completions"),
        (3, b"req-1"),
        (4, b"session-42"),
        (5, b"w1"),
        (6, b"disagg"),
    ];
    route_bodies()
        .into_iter()
        .map(|body| {
            let mut out = Vec::new();
            for (name, value) in headers {
                out.push(name);
                out.push(value.len() as u8);
                out.extend_from_slice(value);
            }
            out.extend(body);
            out
        })
        .collect()
}

/// Bodies for the splice, behind the key-choice byte.
pub fn splice_bodies() -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = route_bodies()
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            let mut v = vec![i as u8];
            v.extend(b);
            v
        })
        .collect();
    out.push(br#" {"kv_transfer_params":{"old":1},"a":"\"}","kv_transfer_params":null} "#.to_vec());
    out.push(b"{}".to_vec());
    out
}

/// A vLLM `/metrics` exposition (the families `scrape.rs` reads, two dp ranks, a histogram).
pub fn engine_metrics() -> Vec<Vec<u8>> {
    vec![br#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="deepseek-v4"} 3.0
vllm:num_requests_running{engine="1",model_name="deepseek-v4"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="deepseek-v4"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="deepseek-v4"} 0.25
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="deepseek-v4"} 12800.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="deepseek-v4"} 6400.0
vllm:prompt_tokens_total{engine="0",model_name="deepseek-v4"} 20000.0
vllm:prompt_tokens_cached_total{engine="0",model_name="deepseek-v4"} 6400.0
# TYPE vllm:request_prefill_kv_computed_tokens histogram
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="+Inf",model_name="deepseek-v4"} 10
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="deepseek-v4"} 13600.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="deepseek-v4"} 10
vllm:request_prefill_time_seconds_sum{engine="0",model_name="deepseek-v4"} 1.5
vllm:request_queue_time_seconds_sum{engine="0",model_name="deepseek-v4"} 0.25
vllm:time_to_first_token_seconds_sum{engine="0",model_name="deepseek-v4"} 2.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="deepseek-v4"} 3.2
vllm:inter_token_latency_seconds_count{engine="0",model_name="deepseek-v4"} 160
"#
    .to_vec()]
}

/// The shipped fleet files and the fleet embedded in the Kubernetes config map.
pub fn fleet_files() -> Vec<Vec<u8>> {
    vec![
        include_bytes!("../../envoy/fleets/local.toml").to_vec(),
        include_bytes!("../../envoy/fleets/disagg.toml").to_vec(),
        b"listen = \"127.0.0.1:9100\"\n[model]\nname = \"m\"\nblock_size = 16\n[discovery.kubernetes]\nservice = \"vllm\"\n".to_vec(),
        b"listen: 127.0.0.1:9100\nmodel:\n  name: m\n  block_size: 16\nworkers:\n  - id: w0\n    role: both\n    endpoint: 127.0.0.1:8100\n    kv_events: tcp://127.0.0.1:5557\n".to_vec(),
    ]
}

/// Plugin configurations as Envoy hands them to the filter.
pub fn filter_configs() -> Vec<Vec<u8>> {
    vec![
        br#"{"background":"per_worker","indexer_cluster":"kvmesh_indexer","indexer_timeout_ms":100,"derive_session_keys":true,"max_body_bytes":8388608}"#.to_vec(),
        br#"{"debug_headers":true,"session_header":"x-session-id","allow_overrides":false}"#.to_vec(),
        b"".to_vec(),
    ]
}
