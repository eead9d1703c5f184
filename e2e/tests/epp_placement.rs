//! The endpoint picker through real Envoy with no wasm filter (issue 45, points 5 and 6): Envoy's
//! ext_proc filter (FULL_DUPLEX_STREAMED, as Istio's InferencePool filter) calls the indexer's
//! picker, the `engines` cluster's override_host follows the `envoy.lb` metadata it answers.
//!
//! - The placements of the wasm path hold: a conversation's turns stay on one worker and reuse its
//!   cache (the engine's own `cached_tokens`), conversations behind one shared system prompt spread
//!   over the workers and keep theirs; a long cold prompt is disaggregated and the decode engine
//!   pulls the prefill worker's KV (`kv_transfer_params` reached it through the picker's body
//!   rewrite); a failing prefill leg falls back to the decode worker; an overloaded one is the
//!   client's 429 with `retry-after`.
//! - The gateway answers `GET /v1/models` and an unknown model's 404 (vLLM's body) itself; no
//!   engine sees either.
//! - GIE's conformance behaviours (`[epp] conformance = true`): `test-epp-endpoint-selection`
//!   steers each request to the endpoint it names, and the served endpoint comes back in
//!   `x-conformance-test-served-endpoint` (override_host's `selected_host_key` writes it into
//!   `envoy.lb`, ext_proc forwards it with the response). Every worker listens on 127.0.0.1 on its
//!   own port — GIE's several ports per pod — so steering and echo name `ip:port`, not a host.
//!   The subset hint (`envoy.lb.subset_hint`, set by Envoy from a header in this stack) confines
//!   the pick to the endpoints it names.
//! - The `both` edge (body STREAMED before the headers' answer) carries a disaggregated request's
//!   spliced body to the decode engine, and its wasm filter defers to the picker.
//!
//! Each stack is on free loopback ports, and dropping it (also on a failed assertion) kills its
//! processes.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Context;
use futures::future::join_all;
use kvmesh_core::api::ReasonCode;
use kvmesh_core::models;
use kvmesh_e2e::client::{chat_body, filler, post_json, Reply, SIM_WORKER};
use kvmesh_e2e::prom::Metrics;
use kvmesh_e2e::stack::{Edge, Stack, StackSpec};
use serde_json::{json, Value};

/// Tokens per KV block in these fleets.
const BLOCK: u64 = 16;
/// GIE's conformance headers (the picker's `epp::head` names them too).
const SELECTION: &str = "test-epp-endpoint-selection";
const SERVED: &str = "x-conformance-test-served-endpoint";
/// GIE's subset hint as a request header, which the conformance stack's Envoy turns into the
/// `envoy.lb.subset_hint` metadata the picker reads.
const SUBSET_HINT: &str = "x-gateway-destination-endpoint-subset";
const EPP_RESULTS: &str = "kvmesh_epp_requests_total";

/// `spec` with the picker as the only front door (fail-closed) and the decision headers on.
fn through_the_picker(mut spec: StackSpec, filter: Value) -> StackSpec {
    spec.edge = Edge::ExtProc { failure_mode_allow: false };
    spec.filter_config = filter;
    spec
}

async fn indexer_metrics(stack: &Stack) -> anyhow::Result<Metrics> {
    stack.scrape(&stack.indexer_url("/metrics")).await
}

/// No wasm anywhere: the rendered bootstrap has no wasm filter or service and Envoy counts no
/// filter decision; the picker's READY address is what Envoy calls.
async fn assert_no_wasm(stack: &Stack) -> anyhow::Result<()> {
    let bootstrap = std::fs::read_to_string(stack.dir().join("envoy.yaml"))?;
    assert!(
        !bootstrap.contains("envoy.filters.http.wasm")
            && !bootstrap.contains("envoy.bootstrap.wasm"),
        "the ext_proc edge loads no wasm"
    );
    let epp = stack.epp_addr.as_deref().context("the picker's address from the READY line")?;
    let port = epp.rsplit_once(':').map(|(_, p)| p).unwrap_or_default();
    assert!(bootstrap.contains(&format!("port_value: {port} ")), "kvmesh_epp names {epp}");
    let envoy = stack.envoy_metrics().await?;
    assert_eq!(envoy.sum("kvmesh_filter_requests_total", &[]), 0.0, "no filter decided anything");
    Ok(())
}

/// Successful requests per worker, from each engine's own counter.
async fn engine_successes(stack: &Stack) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    for w in &stack.workers {
        let m = stack.scrape(&w.url("/metrics")).await?;
        out.insert(w.id.clone(), m.sum("vllm:request_success_total", &[]));
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_places_chats_answers_the_catalog_and_follows_the_conformance_header(
) -> anyhow::Result<()> {
    let mut spec = through_the_picker(StackSpec::aggregate(4), json!({"debug_headers": true}));
    spec.epp_conformance = true;
    let stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let url = stack.gateway("/v1/chat/completions");
    assert_no_wasm(&stack).await?;
    let served_before = engine_successes(&stack).await?;

    // The catalog and an unknown model: answered by the gateway (the picker), no engine involved.
    let r = c.get(stack.gateway("/v1/models")).send().await?;
    assert_eq!(r.status(), 200);
    assert!(!r.headers().contains_key(SIM_WORKER), "an engine answered /v1/models");
    let list: Value = r.json().await?;
    let ids: Vec<&str> =
        list["data"].as_array().into_iter().flatten().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!((list["object"].as_str(), ids), (Some("list"), vec!["deepseek-v4"]), "{list}");
    let mut body = chat_body(&[("user".to_owned(), filler(1, 30))], 4);
    body["model"] = json!("gpt-4o");
    let r = post_json(&c, &url, &body, &[]).await?;
    assert_eq!((r.status, r.worker()), (404, None), "{}", r.text);
    assert_eq!(r.json(), serde_json::to_value(models::not_found("gpt-4o"))?, "vLLM's 404 body");
    assert_eq!(engine_successes(&stack).await?, served_before, "an engine saw a gateway answer");

    // One conversation, six turns, its history resent each turn (derived session key, no
    // session header): one worker, and from turn 2 on the engine reuses the previous turn.
    let mut history =
        vec![("system".to_owned(), filler(2, 300)), ("user".to_owned(), filler(3, 120))];
    let (mut home, mut previous_isl) = (None::<String>, 0u64);
    for turn in 0..6u64 {
        let r = post_json(&c, &url, &chat_body(&history, 16), &[]).await?;
        assert_eq!(r.status, 200, "turn {turn}: {}", r.text);
        let worker = r.worker().expect("x-sim-worker").to_owned();
        assert_eq!(
            r.header(kvmesh_core::headers::DEBUG_WORKER),
            Some(worker.as_str()),
            "turn {turn}: the picker's decision is the worker that served"
        );
        match &home {
            None => home = Some(worker),
            Some(h) => {
                assert_eq!(&worker, h, "turn {turn} moved off its worker ({:?})", r.reason());
                let cached = r.cached_tokens().unwrap_or(0);
                assert!(
                    cached * 10 >= previous_isl * BLOCK * 9,
                    "turn {turn}: the engine reused {cached} tokens of the previous turn's {} ({:?})",
                    previous_isl * BLOCK,
                    r.reason()
                );
            }
        }
        previous_isl = r.isl_blocks().expect("x-kvmesh-decision-isl-blocks");
        history.push(("assistant".to_owned(), r.chat_content().unwrap_or_default()));
        history.push(("user".to_owned(), filler(10 + turn, 40)));
    }

    // Eight conversations behind one new system prompt, concurrently, two turns each: not all on
    // one worker, and each keeps its worker on its second turn.
    let system = filler(9_000, 1_000);
    let conversations = (0..8u64).map(|n| {
        let (system, url, c) = (system.clone(), url.clone(), c.clone());
        async move {
            let mut history =
                vec![("system".to_owned(), system), ("user".to_owned(), filler(9_100 + n, 60))];
            let mut workers = Vec::new();
            for turn in 0..2u64 {
                let r = post_json(&c, &url, &chat_body(&history, 8), &[]).await?;
                anyhow::ensure!(r.status == 200, "conversation {n} turn {turn}: {}", r.text);
                workers.push(r.worker().unwrap_or("?").to_owned());
                history.push(("assistant".to_owned(), r.chat_content().unwrap_or_default()));
                history.push(("user".to_owned(), filler(9_200 + n * 2 + turn, 30)));
            }
            Ok::<_, anyhow::Error>(workers)
        }
    });
    let served: Vec<Vec<String>> =
        join_all(conversations).await.into_iter().collect::<anyhow::Result<_>>()?;
    let first_turns: BTreeSet<&str> = served.iter().map(|w| w[0].as_str()).collect();
    assert!(first_turns.len() >= 2, "every conversation on one worker: {served:?}");
    let stayed = served.iter().filter(|w| w[0] == w[1]).count();
    assert!(stayed >= 7, "only {stayed} of 8 conversations kept their worker: {served:?}");

    // Every request so far was routed by the picker, none pinned for a failed route call.
    let m = indexer_metrics(&stack).await?;
    let result = |r: &str| m.sum(EPP_RESULTS, &[("result", r)]);
    assert_eq!(
        result("routed"),
        6.0 + 16.0,
        "{:?}",
        m.select(EPP_RESULTS, &[]).collect::<Vec<_>>()
    );
    assert_eq!((result("models_list"), result("unknown_model")), (1.0, 1.0));
    assert_eq!(result("fallback") + result("protocol_error"), 0.0);

    // Conformance: every worker is 127.0.0.1 on its own port (several ports per pod), and the
    // selection header names one `ip:port`: that worker serves, and the echo names it.
    let hosts: BTreeSet<&str> =
        stack.workers.iter().filter_map(|w| w.http.rsplit_once(':').map(|(h, _)| h)).collect();
    assert_eq!(hosts, BTreeSet::from(["127.0.0.1"]), "one IP, one port per worker");
    for (i, w) in stack.workers.iter().enumerate() {
        // A prompt another worker may hold: only the header makes it this one's.
        let history = [
            ("system".to_owned(), system.clone()),
            ("user".to_owned(), filler(9_300 + i as u64, 40)),
        ];
        let r = post_json(&c, &url, &chat_body(&history, 4), &[(SELECTION, &w.http)]).await?;
        assert_eq!((r.status, r.worker()), (200, Some(w.id.as_str())), "{SELECTION}: {}", w.http);
        assert_eq!(r.header(SERVED), Some(w.http.as_str()), "the served endpoint echoed");
    }
    // Two named: one of them. A bare IP allows every port of it.
    let pair = format!("{},{}", stack.workers[1].http, stack.workers[2].http);
    let r = post_json(
        &c,
        &url,
        &chat_body(&[("user".to_owned(), filler(9_400, 40))], 4),
        &[(SELECTION, &pair)],
    )
    .await?;
    assert!(
        r.status == 200 && matches!(r.worker(), Some("w1" | "w2")),
        "{pair}: {} served by {:?}",
        r.status,
        r.worker()
    );
    let r = post_json(
        &c,
        &url,
        &chat_body(&[("user".to_owned(), filler(9_401, 40))], 4),
        &[(SELECTION, "127.0.0.1")],
    )
    .await?;
    assert_eq!(r.status, 200, "a bare IP: {}", r.text);
    // An endpoint outside the pool: nothing is eligible, the picker's 503, no engine sees it.
    let before = engine_successes(&stack).await?;
    let r = post_json(
        &c,
        &url,
        &chat_body(&[("user".to_owned(), filler(9_402, 40))], 4),
        &[(SELECTION, "127.0.0.1:1")],
    )
    .await?;
    assert_eq!((r.status, r.worker()), (503, None), "{}", r.text);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(engine_successes(&stack).await?, before);

    // GIE's subset hint, set by the hop in front: here Envoy itself, from the subset header
    // (`EppTarget::subset_from_header`, on for the conformance stack) into the
    // `envoy.lb.subset_hint` metadata ext_proc forwards. The picker chooses only among the
    // endpoints it names, and says so in its decision.
    let subset = format!("{},{}", stack.workers[2].http, stack.workers[3].http);
    for n in 0..6u64 {
        let body = chat_body(&[("user".to_owned(), filler(9_500 + n, 40))], 4);
        let r = post_json(&c, &url, &body, &[(SUBSET_HINT, &subset)]).await?;
        assert!(
            r.status == 200 && matches!(r.worker(), Some("w2" | "w3")),
            "subset {subset}: {} served by {:?}",
            r.status,
            r.worker()
        );
        assert_eq!(r.header(kvmesh_core::headers::DEBUG_WORKER), r.worker(), "the picker's pick");
    }
    // A subset with nothing of the pool in it: nothing eligible, never the whole pool.
    let body = chat_body(&[("user".to_owned(), filler(9_510, 40))], 4);
    let r = post_json(&c, &url, &body, &[(SUBSET_HINT, "127.0.0.1:1")]).await?;
    assert_eq!((r.status, r.worker()), (503, None), "{}", r.text);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_disaggregates_falls_back_to_decode_and_relays_overload() -> anyhow::Result<()> {
    let spec = through_the_picker(
        StackSpec::disaggregated(1, 2),
        // The indexer bounds a prefill leg by the filter's deadline too.
        json!({"debug_headers": true, "indexer_timeout_ms": 8000}),
    );
    // Prefill failures must not mark the worker unhealthy here: each leg has to reach it.
    let spec = StackSpec {
        routing_toml:
            "min_remote_prefill_tokens = 256\nprefill_timeout_ms = 2500\nunhealthy_after_failures = 0\n"
                .into(),
        ..spec
    };
    let stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let url = stack.gateway("/v1/chat/completions");
    assert_no_wasm(&stack).await?;
    let metric = |name: &'static str, labels: &'static [(&'static str, &'static str)]| {
        let stack = &stack;
        async move {
            let mut out = BTreeMap::new();
            for w in &stack.workers {
                out.insert(w.id.clone(), stack.scrape(&w.url("/metrics")).await?.sum(name, labels));
            }
            Ok::<_, anyhow::Error>(out)
        }
    };
    let cold = |seed: u64, stream: bool| {
        let mut body = chat_body(&[("user".to_owned(), filler(seed, 500))], 6);
        body["stream"] = json!(stream);
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        body
    };

    // A long cold prompt: the prefill worker computes its KV (one token), the decode worker pulls
    // it with the kv_transfer_params the picker spliced into the body.
    let generated0 = metric("vllm:generation_tokens_total", &[]).await?;
    let r = post_json(&c, &url, &cold(1, true), &[]).await?;
    assert_eq!((r.status, r.mode()), (200, Some("disagg")), "{} {:?}", r.text, r.reason());
    let home = r.worker().unwrap_or_default().to_owned();
    assert!(home.starts_with('d'), "disagg served by {home}");
    assert!(r.reason_codes().contains(&ReasonCode::DisaggUncached), "{:?}", r.reason());
    let generated = metric("vllm:generation_tokens_total", &[]).await?;
    assert_eq!(generated["p0"] - generated0["p0"], 1.0, "the prefill leg generates one token");
    let pulls = metric("kvmesh_sim_nixl_pulls_total", &[("outcome", "ok")]).await?;
    assert_eq!(pulls[&home], 1.0, "{home} pulled the prompt's KV: {pulls:?}");
    let isl = r.isl_blocks().unwrap_or(0);
    assert!(
        r.stream_cached_tokens().unwrap_or(0) >= (isl - 1) * BLOCK,
        "the decode engine reports the pulled prompt as cached ({isl} blocks): {:?}",
        r.stream_cached_tokens()
    );
    assert!(!r.stream_text().is_empty(), "the stream came through the picker whole");

    // The prefill worker fails its leg: the decode worker prefills itself.
    let faults = stack.worker("p0")?.url("/admin/faults");
    c.post(&faults).json(&json!({"fail_prefill_status": 500})).send().await?.error_for_status()?;
    let r = post_json(&c, &url, &cold(2, false), &[]).await?;
    assert_eq!((r.status, r.mode()), (200, Some("decode_fallback")), "{} {:?}", r.text, r.reason());
    assert_eq!(r.reason_codes().last(), Some(&ReasonCode::PrefillLegFailed), "{:?}", r.reason());
    assert!(r.worker().is_some_and(|w| w.starts_with('d')), "served by {:?}", r.worker());

    // Overloaded: the client is told to back off, and no engine answers.
    c.post(&faults)
        .json(&json!({"clear": true, "fail_prefill_status": 429}))
        .send()
        .await?
        .error_for_status()?;
    let r: Reply = post_json(&c, &url, &cold(3, false), &[]).await?;
    assert_eq!((r.status, r.worker()), (429, None), "{}", r.text);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json()["error"]["reason"], "prefill_overloaded", "{}", r.text);

    let m = indexer_metrics(&stack).await?;
    let legs = |o: &str| m.sum("kvmesh_prefill_legs_total", &[("outcome", o)]);
    assert_eq!((legs("ok"), legs("fallback"), legs("overloaded")), (1.0, 1.0, 1.0));
    let result = |r: &str| m.sum(EPP_RESULTS, &[("result", r)]);
    assert_eq!((result("routed"), result("shed"), result("fallback")), (2.0, 1.0, 0.0));
    Ok(())
}

/// The `both` edge sends the body STREAMED before the headers' answer (so that it can fail open
/// to the wasm filter): a disaggregated request's spliced body reaches the decode engine there too
/// — the picker replaces the body's one chunk — and the filter lets the picker's decision go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_both_edge_carries_the_spliced_body_to_the_decode_engine() -> anyhow::Result<()> {
    let mut spec = StackSpec::disaggregated(1, 2);
    spec.edge = Edge::Both { failure_mode_allow: true };
    spec.filter_config =
        json!({"debug_headers": true, "defer_to_picker": true, "indexer_timeout_ms": 8000});
    spec.routing_toml = "min_remote_prefill_tokens = 256\nprefill_timeout_ms = 2500\n".into();
    let stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let body = chat_body(&[("user".to_owned(), filler(77, 500))], 6);
    let r = post_json(&c, &stack.gateway("/v1/chat/completions"), &body, &[]).await?;
    assert_eq!((r.status, r.mode()), (200, Some("disagg")), "{} {:?}", r.text, r.reason());
    let home = r.worker().unwrap_or_default().to_owned();
    assert!(home.starts_with('d'), "disagg served by {home}");
    let pulls = stack
        .scrape(&stack.worker(&home)?.url("/metrics"))
        .await?
        .sum("kvmesh_sim_nixl_pulls_total", &[("outcome", "ok")]);
    assert_eq!(pulls, 1.0, "{home} pulled the prompt's KV with the spliced kv_transfer_params");
    let envoy = stack.envoy_metrics().await?;
    let deferred = envoy.sum("kvmesh_filter_picker_destinations_total", &[("result", "deferred")]);
    assert_eq!(deferred, 1.0, "the filter let the picker's decision go");
    Ok(())
}
