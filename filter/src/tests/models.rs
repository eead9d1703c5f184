//! Unit tests of `crate::models`.

use super::*;
use kvmesh_core::api::{ErrorBody, FleetWorker, Role, WorkerLoad};
use kvmesh_core::models::FleetModel;

pub(crate) fn two_models() -> FleetSnapshot {
    let model = |name: &str, aliases: &[&str], adapters: &[&str]| FleetModel {
        name: name.into(),
        aliases: aliases.iter().map(|a| (*a).to_owned()).collect(),
        adapters: adapters.iter().map(|a| (*a).to_owned()).collect(),
        block_size: 16,
    };
    let worker = |id: &str, model: &str| FleetWorker {
        id: id.into(),
        endpoint: format!("10.0.0.{}:8000", &id[1..]),
        role: Role::Decode,
        model: model.into(),
        healthy: true,
        load: WorkerLoad::default(),
    };
    FleetSnapshot {
        generation: 1,
        block_size: 16,
        models: vec![
            model("base-a", &["a"], &["a-sql", "a-chat"]),
            model("base-b", &[], &["b-code"]),
        ],
        workers: vec![worker("w1", "base-a"), worker("w2", "base-b"), worker("w3", "base-a")],
    }
}

#[test]
fn only_get_on_exactly_the_models_path_is_the_model_list() {
    assert!(is_models_list("GET", "/v1/models"));
    assert!(is_models_list("GET", "/v1/models?limit=5"));
    for (method, path) in [
        ("POST", "/v1/models"),
        ("HEAD", "/v1/models"),
        ("get", "/v1/models"),
        ("GET", "/v1/models/"),
        ("GET", "/v1/models/base-a"),
        ("GET", "/v1/model"),
        ("GET", "/v2/models"),
        ("GET", ""),
    ] {
        assert!(!is_models_list(method, path), "{method} {path}");
    }
}

#[test]
fn base_model_follows_core_resolution_and_keeps_old_snapshots_working() {
    let f = two_models();
    assert_eq!(base_model(&f, Some("base-a")), Ok("base-a"));
    assert_eq!(base_model(&f, Some("a")), Ok("base-a"), "alias");
    assert_eq!(base_model(&f, Some("b-code")), Ok("base-b"), "adapter → its base");
    assert_eq!(base_model(&f, None), Ok("base-a"), "no model: the default (first)");
    assert_eq!(base_model(&f, Some("")), Ok("base-a"));
    assert_eq!(base_model(&f, Some("gpt-4")).map_err(|e| e.0), Err("gpt-4".to_owned()));
    // An indexer that predates `models`: every request pins among its (model-less) workers.
    let old = FleetSnapshot { models: Vec::new(), ..two_models() };
    assert_eq!(base_model(&old, Some("anything")), Ok(""));
    assert_eq!(base_model(&old, None), Ok(""));
}

#[test]
fn the_metrics_label_is_the_base_model_or_none() {
    let f = two_models();
    assert_eq!(label_model(Some(&f), Some("a-chat"), 16).as_deref(), Some("base-a"));
    assert_eq!(label_model(Some(&f), None, 16).as_deref(), Some("base-a"));
    assert_eq!(label_model(Some(&f), Some("b-code"), 16).as_deref(), Some("base-b"));
    assert_eq!(label_model(Some(&f), Some("gpt-4"), 16), None, "unknown model");
    assert_eq!(label_model(None, Some("base-a"), 16), None, "no snapshot");
    let old = FleetSnapshot { models: Vec::new(), ..two_models() };
    assert_eq!(label_model(Some(&old), Some("base-a"), 16), None, "snapshot without models");
    // The bound follows the fleet's order (the same everywhere), not the order requests come in.
    assert_eq!(label_model(Some(&f), Some("b-code"), 1).as_deref(), Some("other"));
    assert_eq!(label_model(Some(&f), Some("a"), 1).as_deref(), Some("base-a"));
    assert_eq!(label_model(Some(&f), Some("a"), 0).as_deref(), Some("other"));
}

#[test]
fn not_found_is_vllms_404_with_kvmeshs_reason() {
    let Effect::SendResponse { status, headers, body } = not_found("gpt-\"4\"", "rid-9") else {
        panic!()
    };
    assert_eq!(status, 404);
    assert!(headers.contains(&("content-type", "application/json".to_owned())));
    assert!(headers.contains(&("x-request-id", "rid-9".to_owned())));
    assert!(headers.contains(&("x-kvmesh-error", "unknown_model".to_owned())));
    let sent: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(sent, models::not_found("gpt-\"4\""));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["message"], "The model `gpt-\"4\"` does not exist.");
    assert_eq!(v["error"]["type"], "NotFoundError");
    assert_eq!(v["error"]["param"], "model");
    assert_eq!(v["error"]["code"], 404);
}

#[test]
fn the_model_list_is_cores_rendering_of_the_snapshot() {
    let f = two_models();
    let Some(Effect::SendResponse { status, headers, body }) = models_list(&f, 1_700_000_000, "r")
    else {
        panic!()
    };
    assert_eq!(status, 200);
    assert!(headers.contains(&("content-type", "application/json".to_owned())));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v, models::models_list(&f.models, 1_700_000_000));
    let ids: Vec<&str> =
        v["data"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["base-a", "a", "a-sql", "a-chat", "base-b", "b-code"]);
    assert_eq!(v["data"][5]["parent"], "base-b");
    // No models in the snapshot: nothing to answer from (the request goes to an engine).
    assert_eq!(models_list(&FleetSnapshot { models: Vec::new(), ..f }, 1, "r"), None);
}
