//! What each engine serves, from its own `GET /v1/models`: the adapters it lists with its base
//! model as `parent` (vLLM's LoRA entries) join the catalog (`crate::catalog`), so requests naming
//! them resolve without configuring each one. Polled every `routing.served_models_poll_ms` (0 =
//! off), not every scrape: adapters change far less often than queues. Pure parsing
//! ([`parse_models`], [`adapters_of`]) here, the poll loop beside it.
//!
//! Bounds: an answer is read up to [`MODELS_MAX_BODY_BYTES`] and its first [`MAX_LISTED`] entries;
//! a model knows at most `crate::config::MAX_ADAPTERS_PER_MODEL` adapters. An engine whose list does
//! not name the worker's configured model is counted (`kvmesh_served_models_polls_total{result=
//! "base_mismatch"}`), logged, and none of its adapters are taken: the fleet file (or the pod's
//! model label) says what it serves — except a discovered worker whose pod has no model label:
//! when its engine serves exactly one model of the fleet, it moves to that model
//! (`result="model_learned"`). An adapter whose name another entry of the catalog uses is
//! refused, logged and counted (`kvmesh_served_adapters_refused_total`). A failed poll keeps what
//! the worker reported last.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use crate::service::Service;

/// Largest `/v1/models` answer read.
pub const MODELS_MAX_BODY_BYTES: usize = 1024 * 1024;

/// Entries of one answer looked at (the rest ignored).
pub const MAX_LISTED: usize = 1024;

/// One engine's `/v1/models`: the base models it serves (entries without `parent`) and its
/// adapters with their parent, in its order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineModels {
    pub bases: Vec<String>,
    pub adapters: Vec<(String, String)>,
}

/// Parses vLLM's `{"object": "list", "data": [{"id", "parent", …}]}`.
pub fn parse_models(body: &[u8]) -> Result<EngineModels, String> {
    #[derive(serde::Deserialize)]
    struct Entry {
        id: String,
        #[serde(default)]
        parent: Option<String>,
    }
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<serde_json::Value>,
    }
    let list: List = serde_json::from_slice(body).map_err(|e| format!("not a model list: {e}"))?;
    let mut out = EngineModels::default();
    for v in list.data.into_iter().take(MAX_LISTED) {
        let Ok(e) = serde_json::from_value::<Entry>(v) else { continue };
        match e.parent.filter(|p| !p.is_empty()) {
            Some(parent) => out.adapters.push((e.id, parent)),
            None => out.bases.push(e.id),
        }
    }
    Ok(out)
}

/// The adapters `listed` serves on base model `model` (parent = `model`, or another name the
/// engine serves its base under), each once; `None` when the engine does not list `model`.
pub fn adapters_of(listed: &EngineModels, model: &str) -> Option<Vec<String>> {
    if !listed.bases.iter().any(|b| b == model) {
        return None;
    }
    let mut out: Vec<String> = Vec::new();
    for (name, parent) in &listed.adapters {
        if listed.bases.contains(parent) && !out.contains(name) {
            out.push(name.clone());
        }
    }
    Some(out)
}

/// The fleet's models (`names`) that `listed` serves.
pub fn fleet_models<'n>(listed: &EngineModels, names: &'n [String]) -> Vec<&'n str> {
    names.iter().filter(|n| listed.bases.contains(n)).map(String::as_str).collect()
}

/// `GET http://{endpoint}/v1/models`, at most [`MODELS_MAX_BODY_BYTES`], within `timeout`.
async fn fetch(
    client: &reqwest::Client,
    endpoint: &str,
    timeout: Duration,
) -> Result<Vec<u8>, String> {
    let work = async {
        let resp = client
            .get(format!("http://{endpoint}/v1/models"))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| e.to_string())?;
        let mut body = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| e.to_string())?;
            if body.len() + chunk.len() > MODELS_MAX_BODY_BYTES {
                return Err(format!("answer above {MODELS_MAX_BODY_BYTES} bytes"));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    };
    tokio::time::timeout(timeout, work).await.map_err(|_| "timed out".to_owned())?
}

/// Polls every worker's `/v1/models` each `routing.served_models_poll_ms` and rebuilds the
/// catalog when what they serve changed (bumping the fleet generation, so filters fetch it).
pub(crate) async fn poll_loop(svc: Arc<Service>) {
    let client = match reqwest::Client::builder().build() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the /v1/models client; only configured adapters are known");
            return;
        }
    };
    loop {
        let cfg = svc.state.config();
        let every = cfg.routing.served_models_poll_ms;
        if every == 0 {
            tokio::time::sleep(Duration::from_secs(5)).await;
            continue;
        }
        let timeout = Duration::from_millis(cfg.routing.scrape_timeout_ms);
        let targets: Vec<(String, String, String)> = svc
            .state
            .fleet
            .read()
            .workers
            .iter()
            .filter(|w| w.gets_traffic())
            .map(|w| (w.cfg.id.clone(), w.cfg.endpoint.clone(), w.model.clone()))
            .collect();
        let answers =
            futures::future::join_all(targets.into_iter().map(|(id, endpoint, model)| {
                let client = client.clone();
                async move {
                    let res =
                        fetch(&client, &endpoint, timeout).await.and_then(|b| parse_models(&b));
                    (id, model, res)
                }
            }))
            .await;
        apply(&svc, answers).await;
        tokio::time::sleep(Duration::from_millis(every)).await;
    }
}

/// Takes one round of answers: per worker, its adapters (or why none were taken). A discovered
/// worker whose pod has no model label and whose engine serves another model of the fleet (and
/// not the default) moves to that model (`discovery::learn_model`).
async fn apply(svc: &Arc<Service>, answers: Vec<(String, String, Result<EngineModels, String>)>) {
    let state = &svc.state;
    let names: Vec<String> = state.config().models.iter().map(|m| m.name.clone()).collect();
    let m = &state.metrics;
    let mut changed = false;
    for (id, model, res) in answers {
        let listed = match res {
            Ok(l) => l,
            Err(e) => {
                m.served_models_polls.with_label_values(&["error"]).inc();
                tracing::debug!(worker = %id, error = %e, "GET /v1/models failed; keeping its last answer");
                continue;
            }
        };
        let Some(adapters) = adapters_of(&listed, &model) else {
            if let [only] = fleet_models(&listed, &names)[..] {
                match super::discovery::learn_model(svc, &id, only).await {
                    Ok(true) => {
                        m.served_models_polls.with_label_values(&["model_learned"]).inc();
                        continue;
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::error!(worker = %id, error = %e, "moving a discovered worker to the model its engine serves failed")
                    }
                }
            }
            m.served_models_polls.with_label_values(&["base_mismatch"]).inc();
            tracing::warn!(worker = %id, model = %model, served = ?listed.bases, "the engine does not list the worker's model in /v1/models; its adapters are not taken (check the fleet's model or the pod's model label)");
            changed |= state.served.lock().served.by_worker.remove(&id).is_some();
            continue;
        };
        m.served_models_polls.with_label_values(&["ok"]).inc();
        let entry = (model, adapters);
        let mut served = state.served.lock();
        if served.served.by_worker.get(&id) != Some(&entry) {
            served.served.by_worker.insert(id, entry);
            changed = true;
        }
    }
    if changed && state.rebuild_catalog() {
        state.fleet.write().generation += 1;
        tracing::info!("the engines' adapters changed: catalog rebuilt");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_lists_base_models_and_adapters_with_their_parent() {
        let body = br#"{"object":"list","data":[
            {"id":"deepseek-v4","object":"model","root":"/m","parent":null,"max_model_len":4096},
            {"id":"ds4","object":"model","root":"/m","parent":null},
            {"id":"sql","object":"model","root":"/a/sql","parent":"deepseek-v4"},
            {"id":"chat","object":"model","root":"/a/chat","parent":"ds4"},
            {"id":"sql","object":"model","root":"/a/sql","parent":"deepseek-v4"},
            {"id":"stray","parent":"other-model"},
            {"no_id":true}
        ]}"#;
        let listed = parse_models(body).unwrap();
        assert_eq!(listed.bases, vec!["deepseek-v4", "ds4"]);
        assert_eq!(adapters_of(&listed, "deepseek-v4").unwrap(), vec!["sql", "chat"]);
        assert_eq!(adapters_of(&listed, "small-chat"), None);
        let names = ["small-chat".to_owned(), "ds4".to_owned(), "x".to_owned()];
        assert_eq!(fleet_models(&listed, &names), vec!["ds4"]);
        assert!(parse_models(b"<html>").is_err());
        assert!(parse_models(br#"{"data":{}}"#).is_err());
    }

    #[test]
    fn an_answer_is_read_up_to_its_bound() {
        let entries: Vec<String> =
            (0..MAX_LISTED + 10).map(|i| format!(r#"{{"id":"a{i}","parent":"m"}}"#)).collect();
        let body = format!(r#"{{"data":[{{"id":"m"}},{}]}}"#, entries.join(","));
        let listed = parse_models(body.as_bytes()).unwrap();
        assert_eq!(listed.adapters.len() + listed.bases.len(), MAX_LISTED);
    }
}
