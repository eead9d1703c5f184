//! The deployment files that configure discovery agree with this crate: the `[discovery.kubernetes]`
//! table shipped in envoy/k8s and envoy/istio parses into a valid [`DiscoveryConfig`], and the RBAC
//! grants exactly the list/watch calls the watcher makes; the GIE picker's table (envoy/k8s/gie)
//! names the shipped InferencePool, which this crate's parser follows.

// Test code: a broken manifest must fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvmesh_discovery::{DiscoveryConfig, PortRef};

fn repo_file(rel: &str) -> String {
    let path = format!("{}/../../{rel}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn docs(rel: &str) -> Vec<serde_yaml::Value> {
    serde_yaml::Deserializer::from_str(&repo_file(rel))
        .map(|d| serde_yaml::Value::deserialize(d).unwrap())
        .collect()
}

use serde::Deserialize;

fn discovery_table(configmap: &str) -> DiscoveryConfig {
    let cm = docs(configmap).into_iter().find(|d| d["kind"] == "ConfigMap").unwrap();
    let text = cm["data"]["indexer.toml"].as_str().unwrap();
    let doc: toml::Table = toml::from_str(text).unwrap();
    let table = doc["discovery"]["kubernetes"].clone();
    table.try_into::<DiscoveryConfig>().unwrap().validated().unwrap()
}

#[test]
fn shipped_discovery_config_is_valid_and_matches_the_example_fleet() {
    for cm in ["envoy/k8s/indexer-configmap.yaml", "envoy/istio/indexer-configmap.yaml"] {
        let cfg = discovery_table(cm);
        assert_eq!((cfg.namespace.as_str(), cfg.service.as_str()), ("llm", "vllm"), "{cm}");
        assert_eq!(cfg.kv_events_port, PortRef::Number(5557), "{cm}");
        assert_eq!(cfg.kv_replay_port, Some(PortRef::Number(5558)), "{cm}");
        // The example engines expose exactly these ports and labels.
        let example = repo_file("envoy/k8s/example-vllm.yaml");
        assert!(
            example.contains(&format!("name: {}, port: 8000", cfg.http_port)),
            "{cm}: http port name"
        );
        assert!(example.contains(&format!("{}: decode", cfg.role_label)), "{cm}: role label");
        assert!(example.contains(&cfg.pod_selector.replace('=', ": ")), "{cm}: pod selector");
    }
}

#[test]
fn rbac_grants_what_the_watcher_lists_and_watches() {
    for rbac in ["envoy/k8s/rbac.yaml", "envoy/istio/rbac.yaml"] {
        let role = docs(rbac).into_iter().find(|d| d["kind"] == "Role").unwrap();
        assert_eq!(role["metadata"]["namespace"], "llm", "{rbac}");
        let mut grants: Vec<(String, String, Vec<String>)> = Vec::new();
        for rule in role["rules"].as_sequence().unwrap() {
            let verbs: Vec<String> = rule["verbs"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_owned())
                .collect();
            for g in rule["apiGroups"].as_sequence().unwrap() {
                for r in rule["resources"].as_sequence().unwrap() {
                    grants.push((
                        g.as_str().unwrap().to_owned(),
                        r.as_str().unwrap().to_owned(),
                        verbs.clone(),
                    ));
                }
            }
        }
        grants.sort();
        let lw = vec!["list".to_owned(), "watch".to_owned()];
        assert_eq!(
            grants,
            vec![
                ("".into(), "pods".into(), lw.clone()),
                ("discovery.k8s.io".into(), "endpointslices".into(), lw)
            ],
            "{rbac}"
        );
    }
}

#[test]
fn the_gie_picker_discovers_the_shipped_inference_pool() {
    let cfg = discovery_table("envoy/k8s/gie/epp-configmap.yaml");
    assert!(cfg.pool_mode());
    let pool = docs("envoy/k8s/gie/inferencepool.yaml")
        .into_iter()
        .find(|d| d["kind"] == "InferencePool")
        .unwrap();
    assert_eq!(pool["metadata"]["name"].as_str(), Some(cfg.inference_pool.as_str()));
    assert_eq!(pool["metadata"]["namespace"].as_str(), Some(cfg.namespace.as_str()));
    assert_eq!(pool["apiVersion"].as_str(), Some("inference.networking.k8s.io/v1"));
    // kvmesh's own parser follows the shipped pool, and its selector picks the example engines.
    let obj: kube::core::DynamicObject =
        serde_json::from_value(serde_json::to_value(&pool).unwrap()).unwrap();
    let spec = kvmesh_discovery::pool::parse_pool(&obj).unwrap();
    let example = repo_file("envoy/k8s/example-vllm.yaml");
    for (k, v) in &spec.selector {
        assert!(example.contains(&format!("{k}: {v}")), "selector {k}={v} picks no example engine");
    }
    for port in &spec.target_ports {
        assert!(example.contains(&format!("containerPort: {port}")), "target port {port}");
    }
}
