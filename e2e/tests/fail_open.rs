//! Routing is an optimisation: an indexer that answers with an error (other than the designed
//! prefill overload) must not fail the request. Two ways the indexer refuses every chat request:
//! a chat template it cannot render, and a fleet with no healthy decode worker. Through the
//! gateway every request is still served by an engine (200), the filter counts the fallback with
//! reason `indexer_error`, and `x-kvmesh-fallback` carries the indexer's error code.

use kvmesh_core::headers;
use kvmesh_e2e::client::{chat_body, filler, post_json};
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const REQUESTS: usize = 8;

/// Sends `REQUESTS` chats through the gateway; every one must be served, with a fallback header
/// starting `indexer_error`. Returns the headers seen.
async fn all_served_by_fallback(stack: &Stack, seed: u64) -> anyhow::Result<Vec<String>> {
    let url = stack.gateway("/v1/chat/completions");
    let mut seen = Vec::new();
    for i in 0..REQUESTS as u64 {
        let body = chat_body(&[("user".into(), filler(seed + i, 40))], 4);
        let r = post_json(stack.client(), &url, &body, &[]).await?;
        assert_eq!(r.status, 200, "request {i} not served: {}", r.text);
        assert!(r.worker().is_some(), "request {i} was not answered by an engine");
        let fallback = r.header(headers::DEBUG_FALLBACK).unwrap_or_default().to_owned();
        assert!(
            fallback.starts_with("indexer_error"),
            "request {i}: x-kvmesh-fallback = {fallback:?}"
        );
        seen.push(fallback);
    }
    Ok(seen)
}

async fn indexer_error_fallbacks(stack: &Stack) -> anyhow::Result<f64> {
    Ok(stack
        .envoy_metrics()
        .await?
        .sum("kvmesh_filter_fallbacks_total", &[("reason", "indexer_error")]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrenderable_chat_template_fails_open() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // A method no Jinja flavour has: the indexer fails at render time, on every chat request. The
    // engines keep their own (built-in) template, so they serve the same requests.
    let template = dir.path().join("broken.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m['content'].kvmesh_no_such_method() }}{% endfor %}",
    )?;
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({"debug_headers": true});
    spec.model_toml = format!("chat_template = {}", toml_string(&template.display().to_string()));
    let stack = Stack::start(spec).await?;

    // The indexer itself refuses the chat with a structured error.
    let direct = stack
        .client()
        .post(stack.indexer_url(kvmesh_core::api::ROUTE_PATH))
        .header(headers::KVMESH_PATH, "/v1/chat/completions")
        .json(&chat_body(&[("user".into(), "hello".into())], 4))
        .send()
        .await?;
    assert!(
        !direct.status().is_success(),
        "the indexer rendered a template it should not: {}",
        direct.status()
    );
    let _: kvmesh_core::api::ErrorBody = direct.json().await?;

    let before = indexer_error_fallbacks(&stack).await?;
    let seen = all_served_by_fallback(&stack, 100).await?;
    let after = indexer_error_fallbacks(&stack).await?;
    assert!(
        after - before >= REQUESTS as f64,
        "fallbacks{{reason=indexer_error}} went {before} → {after}"
    );
    assert!(seen.iter().all(|h| h.contains("code=")), "the indexer's code is reported: {seen:?}");

    // Completions (token ids need no template) are still routed by the indexer.
    let r = post_json(
        stack.client(),
        &stack.gateway("/v1/completions"),
        &json!({"prompt": filler(7, 60), "max_tokens": 2}),
        &[],
    )
    .await?;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(
        r.header(headers::DEBUG_FALLBACK).is_none(),
        "completions should not fall back: {:?}",
        r.header(headers::DEBUG_FALLBACK)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_healthy_decode_worker_fails_open() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({"debug_headers": true});
    let mut stack = Stack::start(spec).await?;
    // The indexer loses every worker (an empty discovered fleet); Envoy's cluster still has them.
    let routing = stack.spec.routing_toml.clone();
    stack.rewrite_fleet(|_| false, &routing).await?;

    let before = indexer_error_fallbacks(&stack).await?;
    let seen = all_served_by_fallback(&stack, 200).await?;
    let after = indexer_error_fallbacks(&stack).await?;
    assert!(
        after - before >= REQUESTS as f64,
        "fallbacks{{reason=indexer_error}} went {before} → {after}"
    );
    assert!(seen.iter().all(|h| h == "indexer_error; code=no_decode_worker"), "{seen:?}");
    Ok(())
}

/// A TOML basic string.
fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_owned()).to_string()
}
