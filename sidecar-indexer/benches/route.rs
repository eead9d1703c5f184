//! `/v1/route` latency for an ~8k-token chat (README "Benchmarks"), through the whole axum stack
//! in-process (no loopback socket): a continuation whose earlier turns were routed before (warm
//! tokenization cache) and a cold conversation, beside plain `tokenizers` encoding of the same text,
//! and continuations right after a burst of 200 cold ~32k-token chats (shed beyond
//! `routing.max_concurrent_routes`).
//! Prints `FIGURE …` lines with p50/p99. `cargo bench -p kvmesh-indexer --bench route`.
//! `KVMESH_ROUTE_BENCH_ONLY=<case>[,<case>…]` runs only the named cases (`continuation`, `cold`,
//! `after_burst`, `cold_chat_1k`, `cold_chat_32k`, `cold_chat_128k`, `cold_document_32k`, `cold_document_128k`,
//! `shared_prefix_48k`, `concurrent_64`) and `KVMESH_ROUTE_BENCH_SAMPLES=<n>` takes n samples of
//! each: instruction counts under `valgrind --tool=callgrind` (repeatable on a loaded machine) are
//! read as the difference of two runs with different n. `KVMESH_ROUTE_BENCH_MEMO=0` turns the
//! tokenization prefix memo off (`routing.tokenize_memo_bytes = 0`), `KVMESH_ROUTE_BENCH_BODY_MEMO=0`
//! the body memo (`routing.body_memo_bytes = 0`), for their before/after.
//! With `KVMESH_BENCH_FIGURES=<file>` each figure is also appended to that file as one JSON line,
//! for the benchmark report (`make bench`).
//!
//! Over 600 lines: one bench binary holds every route case with its set-up, so that `make bench`
//! runs them in one process with one warmed tokenizer; each case is a function of its own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Request;
use criterion::black_box;
use kvmesh_core::api::RouteDecision;
use kvmesh_core::body_base::BodyBase;
use kvmesh_core::headers;
use kvmesh_core::openai::ChatMessage;
use kvmesh_indexer::config::{Config, MapEnv};
use kvmesh_indexer::http::router;
use kvmesh_indexer::service::Service;
use kvmesh_indexer::tokenize::PromptTokenizer;
use rand::{rngs::StdRng, Rng, SeedableRng};
use tower::ServiceExt;

const WORDS: &[&str] = &[
    "the",
    "model",
    "router",
    "cache",
    "block",
    "token",
    "request",
    "latency",
    "worker",
    "prefix",
    "session",
    "mesh",
    "envoy",
    "filter",
    "index",
    "event",
    "replay",
    "gap",
    "decode",
    "prefill",
    "throughput",
    "percentile",
    "memory",
    "bound",
    "queue",
    "metric",
    "histogram",
    "12",
    "345",
    "6789",
    ",",
    ".",
    "?",
    "!",
    "(",
    ")",
    "\n",
    "—",
    "你好",
    "数据",
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
    let mut m = vec![ChatMessage { role: "system".into(), content: text(rng, 400).into() }];
    let mut approx = 400;
    while approx < tokens {
        m.push(ChatMessage { role: "user".into(), content: text(rng, 150).into() });
        m.push(ChatMessage { role: "assistant".into(), content: text(rng, 250).into() });
        approx += 400;
    }
    m
}

fn body(messages: &[ChatMessage]) -> String {
    let msgs: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    serde_json::json!({"model": "deepseek-v4", "messages": msgs, "stream": true}).to_string()
}

fn fleet() -> String {
    let mut s = String::from("listen = \"127.0.0.1:0\"\n[model]\nname = \"deepseek-v4\"\nblock_size = 16\n[routing]\nunhealthy_after_failures = 0\n");
    for i in 0..16 {
        s.push_str(&format!(
            "[[workers]]\nid = \"w{i}\"\nrole = \"decode\"\nendpoint = \"127.0.0.1:{}\"\n",
            10_000 + i
        ));
    }
    s
}

async fn route(app: &axum::Router, body: String) -> anyhow::Result<Duration> {
    Ok(route_with(app, body, &[]).await?.0)
}

/// One chat route call with `extra` headers: its time (answer read) and the answer's bytes.
async fn route_with(
    app: &axum::Router,
    body: String,
    extra: &[(&str, String)],
) -> anyhow::Result<(Duration, axum::body::Bytes)> {
    let mut req = Request::post("/v1/route")
        .header("x-kvmesh-path", "/v1/chat/completions")
        .header("content-type", "application/json");
    for (name, value) in extra {
        req = req.header(*name, value);
    }
    let req = req.body(Body::from(body))?;
    let t = Instant::now();
    let resp = app.clone().oneshot(req).await?;
    anyhow::ensure!(resp.status().is_success(), "route answered {}", resp.status());
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await?;
    Ok((t.elapsed(), bytes))
}

/// The status of one route call (a shed call is a 503).
async fn status(app: axum::Router, body: String) -> anyhow::Result<u16> {
    let req = Request::post("/v1/route")
        .header("x-kvmesh-path", "/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body))?;
    let resp = app.oneshot(req).await?;
    Ok(resp.status().as_u16())
}

#[path = "common/figures.rs"]
mod figures;
use figures::emit;

/// Whether case `name` runs (`KVMESH_ROUTE_BENCH_ONLY`, default all).
fn runs(name: &str) -> bool {
    std::env::var("KVMESH_ROUTE_BENCH_ONLY")
        .map_or(true, |only| only.split(',').any(|c| c.trim() == name))
}

/// The samples of a case: `default`, or `KVMESH_ROUTE_BENCH_SAMPLES`.
fn samples_or(default: usize) -> usize {
    std::env::var("KVMESH_ROUTE_BENCH_SAMPLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

fn pcts(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (ms(v[v.len() / 2]), ms(v[(v.len() * 99 / 100).min(v.len() - 1)]))
}

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let path = kvmesh_tokens::default_tokenizer_path();
    let mut tok = PromptTokenizer::load(&path, None, "<｜begin▁of▁sentence｜>", 64 << 20)?;
    if std::env::var("KVMESH_ROUTE_BENCH_MEMO").is_ok_and(|v| v == "0") {
        tok = tok.with_memo_bytes(0);
    }
    let plain = tokenizers::Tokenizer::from_file(&path).map_err(anyhow::Error::msg)?;
    let template = kvmesh_tokens::ChatTemplate::deepseek()?;
    let mut config = Config::from_toml_str(&fleet(), &MapEnv::default())?;
    if std::env::var("KVMESH_ROUTE_BENCH_BODY_MEMO").is_ok_and(|v| v == "0") {
        config.routing.body_memo_bytes = 0;
    }
    let _guard = rt.enter();
    let svc = Service::start_with_tokenizer(config, None, Arc::new(MapEnv::default()), tok)?;
    let app = router(svc.state.clone());
    let mut rng = StdRng::seed_from_u64(42);
    let samples = samples_or(200);

    // Warm: one long conversation whose history was routed; each sample adds a new user turn.
    let history = conversation(&mut rng, 8000);
    let rendered = template.render(&history, true)?;
    let n_tokens =
        plain.encode_fast(rendered.as_str(), false).map(|e| e.len()).map_err(anyhow::Error::msg)?;
    if runs("continuation") || runs("after_burst") {
        routed_whole(&rt, &app, &svc, body(&history))?;
        // As the engine's KV events would: worker w0 holds the routed history.
        hold(&svc, &plain, &template, &history)?;
    }
    if runs("continuation") {
        let mut warm = Vec::new();
        for i in 0..samples {
            let mut m = history.clone();
            m.push(ChatMessage { role: "assistant".into(), content: text(&mut rng, 60).into() });
            m.push(ChatMessage {
                role: "user".into(),
                content: format!("follow-up {i}: {}", text(&mut rng, 40)).into(),
            });
            warm.push(rt.block_on(route(&app, body(&m)))?);
        }
        let (w50, w99) = pcts(warm);
        println!("FIGURE route chat continuation ~{n_tokens} tokens, earlier turns seen: p50 {w50:.3} ms, p99 {w99:.3} ms ({samples} samples)");
        emit(
            serde_json::json!({"bench": "route", "figure": "route", "name": "continuation", "tokens": n_tokens, "p50_ms": w50, "p99_ms": w99, "samples": samples}),
        );
    }

    // Cold: a fresh conversation each time (nothing cached), and plain tokenizers on the same text.
    if runs("cold") {
        let n = samples_or(samples / 4);
        let mut cold = Vec::new();
        let mut plain_times = Vec::new();
        for _ in 0..n {
            let m = conversation(&mut rng, 8000);
            let text = template.render(&m, true)?;
            let t = Instant::now();
            black_box(plain.encode_fast(text.as_str(), false).map(|e| e.len()).unwrap_or(0));
            plain_times.push(t.elapsed());
            cold.push(rt.block_on(route(&app, body(&m)))?);
        }
        let (c50, c99) = pcts(cold);
        let (p50, p99) = pcts(plain_times);
        println!("FIGURE route cold chat ~{n_tokens} tokens: p50 {c50:.3} ms, p99 {c99:.3} ms ({n} samples)");
        println!("FIGURE plain tokenizers encode of the same cold text: p50 {p50:.3} ms, p99 {p99:.3} ms");
        for (name, p50, p99) in [("cold", c50, c99), ("plain_tokenizers", p50, p99)] {
            emit(
                serde_json::json!({"bench": "route", "figure": "route", "name": name, "tokens": n_tokens, "p50_ms": p50, "p99_ms": p99, "samples": n}),
            );
        }
    }
    if runs("after_burst") {
        after_burst(&rt, &app, &svc, &history, n_tokens, samples, &mut rng)?;
    }
    long_prompts(&rt, &app, &svc, &plain, &template, &mut rng)?;
    Ok(())
}

/// Issue 14 item 7: 200 cold ~32k-token chats at once, most shed; then the time until the admitted
/// (and abandoned) work has drained, and warm continuations of `history` again.
fn after_burst(
    rt: &tokio::runtime::Runtime,
    app: &axum::Router,
    svc: &Service,
    history: &[ChatMessage],
    n_tokens: usize,
    samples: usize,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    let burst: Vec<String> = (0..200).map(|_| body(&conversation(rng, 32_000))).collect();
    let burst_started = Instant::now();
    let answers = rt.block_on(async {
        let calls: Vec<_> =
            burst.into_iter().map(|b| tokio::spawn(status(app.clone(), b))).collect();
        let mut shed = 0;
        for c in calls {
            if c.await.ok().and_then(Result::ok) == Some(503) {
                shed += 1;
            }
        }
        shed
    });
    let answered = burst_started.elapsed();
    while svc.state.route_inflight.load(std::sync::atomic::Ordering::Acquire) > 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let drained = burst_started.elapsed();
    let mut after = Vec::new();
    for i in 0..samples {
        let mut m = history.to_vec();
        m.push(ChatMessage { role: "assistant".into(), content: text(rng, 60).into() });
        m.push(ChatMessage {
            role: "user".into(),
            content: format!("after the burst {i}: {}", text(rng, 40)).into(),
        });
        after.push(rt.block_on(route(app, body(&m)))?);
    }
    let (a50, a99) = pcts(after);
    println!(
        "FIGURE route after a burst of 200 cold ~32k-token chats: {answers} shed, all answered in {:.2} s, drained in {:.2} s; then continuations p50 {a50:.3} ms, p99 {a99:.3} ms (target p99 < 5 ms within 2 s)",
        answered.as_secs_f64(),
        drained.as_secs_f64()
    );
    emit(
        serde_json::json!({"bench": "route", "figure": "route", "name": "after_burst", "tokens": n_tokens, "p50_ms": a50, "p99_ms": a99, "samples": samples, "shed": answers, "drained_s": drained.as_secs_f64()}),
    );
    Ok(())
}

/// Routes `body` (cold: tokenized only as far as it can match) and waits until its tokenization
/// was finished off the request path, as it is long before the conversation's next turn arrives:
/// the prefix memo then holds the whole prompt. Earlier cases' completions are waited out first:
/// with the queue full, this one would be skipped (a 128k case's left the 48k prefix half
/// tokenized, and the shared-prefix case's first turn then encoded it whole: p99 10 ms, not 1).
fn routed_whole(
    rt: &tokio::runtime::Runtime,
    app: &axum::Router,
    svc: &Service,
    body: String,
) -> anyhow::Result<()> {
    let done = || svc.state.metrics.tokenize_background.with_label_values(&["done"]).get();
    let idle = || {
        let deadline = Instant::now() + Duration::from_secs(600);
        while svc.state.background.in_flight() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        svc.state.background.in_flight() == 0
    };
    anyhow::ensure!(idle(), "earlier background tokenizations did not finish");
    let before = done();
    rt.block_on(route(app, body))?;
    anyhow::ensure!(idle() && done() > before, "the background tokenization did not finish");
    Ok(())
}

/// Records in the index that worker w0 holds `messages`' rendered prompt (what its engine's
/// `BlockStored` events would say), so a continuation is warm in the index, not only in the cache.
fn hold(
    svc: &Service,
    plain: &tokenizers::Tokenizer,
    template: &kvmesh_tokens::ChatTemplate,
    messages: &[ChatMessage],
) -> anyhow::Result<usize> {
    let text = template.render(messages, true)?;
    let ids =
        plain.encode_fast(text.as_str(), false).map_err(anyhow::Error::msg)?.get_ids().to_vec();
    let chains = kvmesh_core::hashing::sequence_hashes(
        &ids,
        16,
        kvmesh_core::hashing::block_seed(None, None),
    );
    let slot = svc
        .state
        .fleet
        .read()
        .workers
        .first()
        .and_then(|w| w.ranks.first())
        .map(|r| r.slot)
        .ok_or_else(|| anyhow::anyhow!("no worker"))?;
    svc.state.index.write().insert_chain(slot, &chains);
    Ok(ids.len())
}

/// A cold document: one user message of about `tokens` tokens (one long piece between added
/// tokens, cut into chunks), each word tagged so no cache has seen it.
fn document(rng: &mut StdRng, tokens: usize) -> Vec<ChatMessage> {
    let tag: u32 = rng.gen();
    let mut doc = String::new();
    let mut words = 0;
    while words * 10 < tokens * 9 {
        doc.push_str(&text(rng, 50));
        doc.push_str(&format!("[{tag:08x}-{words}]\n"));
        words += 50;
    }
    vec![
        ChatMessage { role: "system".into(), content: "Answer from the document.".into() },
        ChatMessage { role: "user".into(), content: doc.into() },
    ]
}

/// Issue 16: cold 1k (the fixed per-route cost) / 32k / 128k-token chats (target p50 <= 3 ms), a 48k-token shared prefix with a new
/// turn (cost follows the turn; routes/s on one caller), and 64 concurrent callers mixing cold
/// and warm routes (warm p99 must not be dragged up by cold ones).
fn long_prompts(
    rt: &tokio::runtime::Runtime,
    app: &axum::Router,
    svc: &Service,
    plain: &tokenizers::Tokenizer,
    template: &kvmesh_tokens::ChatTemplate,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    let count = |m: &[ChatMessage]| -> anyhow::Result<usize> {
        Ok(plain
            .encode_fast(template.render(m, true)?.as_str(), false)
            .map_err(anyhow::Error::msg)?
            .len())
    };
    for (name, target, samples, doc) in [
        ("cold_chat_1k", 1_000, 50, false),
        ("cold_chat_32k", 32_000, 20, false),
        ("cold_chat_128k", 128_000, 10, false),
        ("cold_document_32k", 32_000, 20, true),
        ("cold_document_128k", 128_000, 10, true),
    ] {
        if !runs(name) {
            continue;
        }
        let samples = samples_or(samples);
        let convs: Vec<Vec<ChatMessage>> = (0..samples)
            .map(|_| if doc { document(rng, target) } else { conversation(rng, target) })
            .collect();
        let tokens = count(&convs[0])?;
        let bodies: Vec<String> = convs.iter().map(|m| body(m)).collect();
        let mut times = Vec::new();
        for b in bodies {
            times.push(rt.block_on(route(app, b))?);
        }
        let (p50, p99) = pcts(times);
        // Where a cold long route's time goes besides tokenizing: the body parse and the render.
        let b = body(&convs[0]);
        let t = Instant::now();
        let parsed = kvmesh_core::openai::parse(
            kvmesh_core::openai::Endpoint::ChatCompletions,
            b.as_bytes(),
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        let parse_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        black_box(template.render(&convs[0], true)?.len());
        let render_ms = t.elapsed().as_secs_f64() * 1e3;
        black_box(parsed);
        println!("FIGURE route {name} ~{tokens} tokens: p50 {p50:.3} ms, p99 {p99:.3} ms (target p50 <= 3 ms, {samples} samples); of which parsing the {} KB body {parse_ms:.2} ms, rendering the template {render_ms:.2} ms (one sample)", b.len() / 1024);
        emit(
            serde_json::json!({"bench": "route", "figure": "route", "name": name, "tokens": tokens, "p50_ms": p50, "p99_ms": p99, "samples": samples}),
        );
    }

    // 48k-token shared prefix (Dynamo's tokenizer-prefix-cache case): held by w0; each call adds a turn.
    if !runs("shared_prefix_48k") && !runs("concurrent_64") {
        return Ok(());
    }
    let prefix = conversation(rng, 48_000);
    routed_whole(rt, app, svc, body(&prefix))?;
    let tokens = hold(svc, plain, template, &prefix)?;
    if runs("shared_prefix_48k") {
        shared_prefix(rt, app, &prefix, tokens, rng)?;
    }
    if runs("concurrent_64") {
        concurrency(rt, app, &prefix, rng)?;
    }
    Ok(())
}

/// Turns each conversation of the shared-prefix case grows on the prefix before the next one
/// starts from it (as the overhead benchmark's `Shape::shared_turns`).
const SHARED_TURNS: usize = 8;

/// One route call as the filter makes it for a conversation's turn: its session key, and after
/// the first turn only the bytes after the body base the last answer named. The call's time and
/// the base this answer names.
async fn route_turn(
    app: &axum::Router,
    body: &str,
    session: u64,
    base: Option<BodyBase>,
) -> anyhow::Result<(Duration, Option<BodyBase>)> {
    let mut extra = vec![(headers::KVMESH_SESSION, format!("{session:016x};source=header"))];
    let sent = match base {
        Some(b) if b.prefixes(body.as_bytes()) => {
            extra.push((headers::KVMESH_BODY_BASE, b.to_string()));
            body.get(b.len..).unwrap_or_default()
        }
        _ => body,
    };
    let (took, bytes) = route_with(app, sent.to_owned(), &extra).await?;
    let decision: RouteDecision = serde_json::from_slice(&bytes)?;
    Ok((took, decision.body_base))
}

/// Conversations growing on the held 48k-token prefix, [`SHARED_TURNS`] turns each, sent as the
/// filter sends them ([`route_turn`]: the path the overhead benchmark's
/// `chat_48k_shared_prefix` takes through Envoy): latency and routes/s from one caller.
fn shared_prefix(
    rt: &tokio::runtime::Runtime,
    app: &axum::Router,
    prefix: &[ChatMessage],
    tokens: usize,
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    let samples = samples_or(96);
    let mut bodies = Vec::with_capacity(samples);
    let mut conversation = Vec::new();
    for i in 0..samples {
        if i % SHARED_TURNS == 0 {
            conversation = prefix.to_vec();
        }
        conversation.push(ChatMessage { role: "assistant".into(), content: text(rng, 60).into() });
        conversation.push(ChatMessage {
            role: "user".into(),
            content: format!("turn {i}: {}", text(rng, 40)).into(),
        });
        bodies.push((0x5eed_0000 + (i / SHARED_TURNS) as u64, body(&conversation)));
    }
    let started = Instant::now();
    let (mut times, mut base, mut deltas) = (Vec::new(), None, 0);
    for (i, (session, b)) in bodies.iter().enumerate() {
        let sent_after = if i % SHARED_TURNS == 0 { None } else { base };
        deltas += usize::from(sent_after.is_some());
        let (took, named) = rt.block_on(route_turn(app, b, *session, sent_after))?;
        times.push(took);
        base = named;
    }
    let rps = samples as f64 / started.elapsed().as_secs_f64();
    let (p50, p99) = pcts(times);
    println!("FIGURE route 48k shared prefix + new turn ~{tokens} tokens: p50 {p50:.3} ms, p99 {p99:.3} ms, {rps:.0} routes/s from one caller ({samples} samples, {SHARED_TURNS} turns per conversation, {deltas} sent after a body base)");
    emit(
        serde_json::json!({"bench": "route", "figure": "route", "name": "shared_prefix_48k", "tokens": tokens, "p50_ms": p50, "p99_ms": p99, "samples": samples, "routes_per_s": rps}),
    );

    Ok(())
}

/// Callers continuing the held 48k prefix in the concurrency case.
const WARM_CALLERS: usize = 48;
/// Callers sending cold 8k chats beside them: with [`WARM_CALLERS`], 64 in all.
const COLD_CALLERS: usize = 16;
/// Rounds of (warm callers alone, then with the cold ones): alternating spreads drift and
/// warm-up over both, which one round each did not (the first run was the slower as often as not).
const CONCURRENCY_ROUNDS: usize = 2;

/// Route latency under [`WARM_CALLERS`] + [`COLD_CALLERS`] concurrent callers, and of the same
/// warm callers alone, [`CONCURRENCY_ROUNDS`] times alternated: whether cold routes drag the warm
/// ones' p99 up is the ratio of the two warm figures. Emits `concurrent_64_warm`,
/// `concurrent_64_cold` and `concurrent_48_warm_alone`.
fn concurrency(
    rt: &tokio::runtime::Runtime,
    app: &axum::Router,
    prefix: &[ChatMessage],
    rng: &mut StdRng,
) -> anyhow::Result<()> {
    let (mut alone, mut warm, mut cold, mut failed) =
        (Vec::new(), Vec::new(), Vec::new(), [0usize; 2]);
    for _ in 0..CONCURRENCY_ROUNDS {
        let (w, _, f) = concurrent(rt, app, prefix, rng, WARM_CALLERS, 0)?;
        alone.extend(w);
        failed[0] += f;
        let (w, c, f) = concurrent(rt, app, prefix, rng, WARM_CALLERS, COLD_CALLERS)?;
        warm.extend(w);
        cold.extend(c);
        failed[1] += f;
    }
    anyhow::ensure!(
        !alone.is_empty() && !warm.is_empty() && !cold.is_empty(),
        "every concurrent route failed"
    );
    let (n_alone, n_mixed) = (alone.len() + failed[0], warm.len() + cold.len() + failed[1]);
    let (a50, a99) = pcts(alone);
    let (w50, w99) = pcts(warm);
    let (c50, c99) = pcts(cold);
    println!("FIGURE route under {WARM_CALLERS} concurrent callers, all warm 48k continuations: p50 {a50:.3} ms, p99 {a99:.3} ms; {} shed or failed", failed[0]);
    println!("FIGURE route under {} concurrent callers ({WARM_CALLERS} warm 48k continuations, {COLD_CALLERS} cold 8k chats): warm p50 {w50:.3} ms, p99 {w99:.3} ms; cold p50 {c50:.3} ms, p99 {c99:.3} ms; {} shed or failed", WARM_CALLERS + COLD_CALLERS, failed[1]);
    println!(
        "FIGURE warm routes with the cold callers beside them ÷ alone: p50 {:.2} ×, p99 {:.2} ×",
        w50 / a50,
        w99 / a99
    );
    emit(
        serde_json::json!({"bench": "route", "figure": "route", "name": "concurrent_48_warm_alone", "p50_ms": a50, "p99_ms": a99, "samples": n_alone, "failed": failed[0]}),
    );
    emit(
        serde_json::json!({"bench": "route", "figure": "route", "name": "concurrent_64_warm", "p50_ms": w50, "p99_ms": w99, "samples": n_mixed, "failed": failed[1]}),
    );
    emit(
        serde_json::json!({"bench": "route", "figure": "route", "name": "concurrent_64_cold", "p50_ms": c50, "p99_ms": c99, "samples": n_mixed, "failed": failed[1]}),
    );
    Ok(())
}

/// One concurrent run: `warm` callers continue the held 48k `prefix` while `cold` more send cold
/// 8k chats (every `(warm + cold) / cold`-th caller), all at once; the warm and the cold routes'
/// latencies and the number shed or failed.
fn concurrent(
    rt: &tokio::runtime::Runtime,
    app: &axum::Router,
    prefix: &[ChatMessage],
    rng: &mut StdRng,
    warm_callers: usize,
    cold_callers: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>, usize)> {
    let callers = warm_callers + cold_callers;
    let cold_every = callers / cold_callers.max(1);
    let per_caller = samples_or(8);
    let mut work: Vec<(bool, String)> = Vec::new();
    for c in 0..callers {
        for i in 0..per_caller {
            let cold = cold_callers > 0 && c % cold_every == 0 && c / cold_every < cold_callers;
            let m = if cold {
                conversation(rng, 8000)
            } else {
                let mut m = prefix.to_vec();
                m.push(ChatMessage { role: "assistant".into(), content: text(rng, 60).into() });
                m.push(ChatMessage {
                    role: "user".into(),
                    content: format!("caller {c} turn {i}: {}", text(rng, 40)).into(),
                });
                m
            };
            work.push((cold, body(&m)));
        }
    }
    let results = rt.block_on(async {
        let mut tasks = Vec::new();
        for chunk in work.chunks(per_caller) {
            let mine: Vec<(bool, String)> = chunk.to_vec();
            let app = app.clone();
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                for (cold, b) in mine {
                    out.push((cold, route(&app, b).await));
                }
                out
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap_or_default());
        }
        all
    });
    let (mut warm, mut cold, mut failed) = (Vec::new(), Vec::new(), 0);
    for (is_cold, r) in results {
        match (is_cold, r) {
            (true, Ok(d)) => cold.push(d),
            (false, Ok(d)) => warm.push(d),
            (_, Err(_)) => failed += 1,
        }
    }
    Ok((warm, cold, failed))
}
