//! The indexer's read of a request body, for instruction counts (callgrind) before and after a
//! change to the readers:
//!
//! `cargo build -p kvmesh-core --example body_read --profile wasm`, then
//! `valgrind --tool=callgrind target/wasm/examples/body_read <tokens> <requests> <how>`;
//! instructions per read = (total at `requests` − total at 1) ÷ (`requests` − 1).
//!
//! `how`: `whole` reads a chat continuation of about `tokens` tokens whole (a conversation's first
//! long turn, or any body without a held prefix); `resumed` reads it on from the prefix of the same
//! conversation one turn earlier (the body memo's hit). The body is the overhead bench's shape, as
//! `filter/examples/body_path.rs` builds it.

use kvmesh_core::openai::{self, Endpoint};

fn chat_messages(tokens: usize) -> Vec<serde_json::Value> {
    let words = [
        "kv", "cache", "routing", "prefix", "engine", "token", "block", "worker", "envoy", "filter",
    ];
    let text = |n: usize, seed: usize| {
        (0..n).map(|i| words[(i * 7 + seed) % words.len()]).collect::<Vec<_>>().join(" ")
    };
    let mut messages = vec![serde_json::json!({"role": "system", "content": text(250, 1)})];
    let (mut total, mut t) = (250, 0);
    while (total as f64) * 1.1 < tokens as f64 {
        let (role, n) = if t % 2 == 0 { ("user", 120) } else { ("assistant", 200) };
        messages.push(serde_json::json!({"role": role, "content": text(n, t)}));
        total += n;
        t += 1;
    }
    if t % 2 == 0 {
        messages.push(serde_json::json!({"role": "user", "content": "and now?"}));
    }
    messages
}

fn body(messages: &[serde_json::Value]) -> Vec<u8> {
    serde_json::to_vec(
        &serde_json::json!({"model": "m", "messages": messages, "stream": true, "max_tokens": 16}),
    )
    .unwrap_or_default()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let tokens = args.next().and_then(|a| a.parse().ok()).unwrap_or(8000);
    let requests: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(20);
    let how = args.next().unwrap_or_else(|| "whole".into());
    let messages = chat_messages(tokens);
    let now = body(&messages);
    let earlier = body(&messages[..messages.len().saturating_sub(2).max(1)]);
    let prefix = openai::read_chat_from(&earlier, None).prefix;
    let mut ok = 0;
    for _ in 0..requests {
        let read = match how.as_str() {
            "resumed" => {
                let r = openai::read_chat_from(&now, prefix.as_ref().map(|p| (&earlier[..], p)));
                ok += usize::from(r.resumed);
                r.request
            }
            _ => openai::parse(Endpoint::ChatCompletions, &now),
        };
        ok += usize::from(read.is_ok());
        std::hint::black_box(read).ok();
    }
    println!("{requests} {how} reads of {} body bytes, {ok} ok/resumed", now.len());
}
