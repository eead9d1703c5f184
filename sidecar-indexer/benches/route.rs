//! `/v1/route` latency for an ~8k-token chat (README "Benchmarks"), through the whole axum stack
//! in-process (no loopback socket): a continuation whose earlier turns were routed before (warm
//! tokenization cache) and a cold conversation, beside plain `tokenizers` encoding of the same text.
//! Prints `FIGURE …` lines with p50/p99. `cargo bench -p kvmesh-indexer --bench route`.
//! With `KVMESH_BENCH_FIGURES=<file>` each figure is also appended to that file as one JSON line,
//! for the benchmark report (`make bench`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Request;
use criterion::black_box;
use kvmesh_core::openai::ChatMessage;
use kvmesh_indexer::config::{Config, MapEnv};
use kvmesh_indexer::http::router;
use kvmesh_indexer::service::Service;
use kvmesh_indexer::tokenize::PromptTokenizer;
use rand::{rngs::StdRng, Rng, SeedableRng};
use tower::ServiceExt;

const WORDS: &[&str] = &[
    "the", "model", "router", "cache", "block", "token", "request", "latency", "worker", "prefix", "session", "mesh", "envoy", "filter",
    "index", "event", "replay", "gap", "decode", "prefill", "throughput", "percentile", "memory", "bound", "queue", "metric", "histogram",
    "12", "345", "6789", ",", ".", "?", "!", "(", ")", "\n", "—", "你好", "数据",
];

fn text(rng: &mut StdRng, words: usize) -> String {
    let mut s = String::new();
    for _ in 0..words {
        s.push_str(WORDS[rng.gen_range(0..WORDS.len())]);
        s.push(' ');
    }
    s
}

/// A conversation of about `tokens` tokens: a system prompt and alternating turns.
fn conversation(rng: &mut StdRng, tokens: usize) -> Vec<ChatMessage> {
    let mut m = vec![ChatMessage { role: "system".into(), content: text(rng, 400) }];
    let mut approx = 400;
    while approx < tokens {
        m.push(ChatMessage { role: "user".into(), content: text(rng, 150) });
        m.push(ChatMessage { role: "assistant".into(), content: text(rng, 250) });
        approx += 400;
    }
    m
}

fn body(messages: &[ChatMessage]) -> String {
    let msgs: Vec<serde_json::Value> = messages.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect();
    serde_json::json!({"model": "deepseek-v4", "messages": msgs, "stream": true}).to_string()
}

fn fleet() -> String {
    let mut s = String::from("listen = \"127.0.0.1:0\"\n[model]\nname = \"deepseek-v4\"\nblock_size = 16\n[routing]\nunhealthy_after_failures = 0\n");
    for i in 0..16 {
        s.push_str(&format!("[[workers]]\nid = \"w{i}\"\nrole = \"decode\"\nendpoint = \"127.0.0.1:{}\"\n", 10_000 + i));
    }
    s
}

async fn route(app: &axum::Router, body: String) -> anyhow::Result<Duration> {
    let req = Request::post("/v1/route")
        .header("x-kvmesh-path", "/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body))?;
    let t = Instant::now();
    let resp = app.clone().oneshot(req).await?;
    anyhow::ensure!(resp.status().is_success(), "route answered {}", resp.status());
    let _ = axum::body::to_bytes(resp.into_body(), 1 << 20).await;
    Ok(t.elapsed())
}

#[path = "common/figures.rs"]
mod figures;
use figures::emit;

fn pcts(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (ms(v[v.len() / 2]), ms(v[(v.len() * 99 / 100).min(v.len() - 1)]))
}

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let path = kvmesh_tokens::default_tokenizer_path();
    let tok = PromptTokenizer::load(&path, None, "<｜begin▁of▁sentence｜>", 64 << 20)?;
    let plain = tokenizers::Tokenizer::from_file(&path).map_err(anyhow::Error::msg)?;
    let template = kvmesh_tokens::ChatTemplate::deepseek()?;
    let config = Config::from_toml_str(&fleet(), &MapEnv::default())?;
    let _guard = rt.enter();
    let svc = Service::start_with_tokenizer(config, None, Arc::new(MapEnv::default()), tok)?;
    let app = router(svc.state.clone());
    let mut rng = StdRng::seed_from_u64(42);
    let samples = 200;

    // Warm: one long conversation whose history was routed; each sample adds a new user turn.
    let history = conversation(&mut rng, 8000);
    let rendered = template.render(&history, true)?;
    let n_tokens = plain.encode_fast(rendered.as_str(), false).map(|e| e.len()).map_err(anyhow::Error::msg)?;
    rt.block_on(route(&app, body(&history)))?;
    let mut warm = Vec::new();
    for i in 0..samples {
        let mut m = history.clone();
        m.push(ChatMessage { role: "assistant".into(), content: text(&mut rng, 60) });
        m.push(ChatMessage { role: "user".into(), content: format!("follow-up {i}: {}", text(&mut rng, 40)) });
        warm.push(rt.block_on(route(&app, body(&m)))?);
    }

    // Cold: a fresh conversation each time (nothing cached), and plain tokenizers on the same text.
    let mut cold = Vec::new();
    let mut plain_times = Vec::new();
    for _ in 0..samples / 4 {
        let m = conversation(&mut rng, 8000);
        let text = template.render(&m, true)?;
        let t = Instant::now();
        black_box(plain.encode_fast(text.as_str(), false).map(|e| e.len()).unwrap_or(0));
        plain_times.push(t.elapsed());
        cold.push(rt.block_on(route(&app, body(&m)))?);
    }
    let (w50, w99) = pcts(warm);
    let (c50, c99) = pcts(cold);
    let (p50, p99) = pcts(plain_times);
    println!("FIGURE route chat continuation ~{n_tokens} tokens, earlier turns seen: p50 {w50:.3} ms, p99 {w99:.3} ms ({samples} samples)");
    println!("FIGURE route cold chat ~{n_tokens} tokens: p50 {c50:.3} ms, p99 {c99:.3} ms ({} samples)", samples / 4);
    println!("FIGURE plain tokenizers encode of the same cold text: p50 {p50:.3} ms, p99 {p99:.3} ms");
    for (name, p50, p99, n) in [("continuation", w50, w99, samples), ("cold", c50, c99, samples / 4), ("plain_tokenizers", p50, p99, samples / 4)] {
        emit(serde_json::json!({"bench": "route", "figure": "route", "name": name, "tokens": n_tokens, "p50_ms": p50, "p99_ms": p99, "samples": n}));
    }
    Ok(())
}
