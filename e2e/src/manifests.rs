//! What the shipped Kubernetes manifests tell a pod to do, read from `envoy/k8s/deployment.yaml`,
//! so that end-to-end tests exercise the manifests' own probes and hooks rather than a copy of
//! them that could drift (the readiness probe each container uses, the Envoy preStop command).

use anyhow::Context;
use serde_yaml::Value;

use crate::procs::repo_root;

/// The gateway Deployment, relative to the repository root.
pub const GATEWAY_DEPLOYMENT: &str = "envoy/k8s/deployment.yaml";

fn containers() -> anyhow::Result<Vec<Value>> {
    let path = repo_root().join(GATEWAY_DEPLOYMENT);
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    let doc: Value = serde_yaml::from_str(&text).with_context(|| format!("{}", path.display()))?;
    doc["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .cloned()
        .with_context(|| format!("{GATEWAY_DEPLOYMENT}: no containers"))
}

fn container(name: &str) -> anyhow::Result<Value> {
    containers()?
        .into_iter()
        .find(|c| c["name"].as_str() == Some(name))
        .with_context(|| format!("{GATEWAY_DEPLOYMENT}: no container {name}"))
}

/// The `httpGet` path of container `name`'s `probe` (`readinessProbe`, `livenessProbe`, …).
pub fn probe_path(name: &str, probe: &str) -> anyhow::Result<String> {
    container(name)?[probe]["httpGet"]["path"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("{GATEWAY_DEPLOYMENT}: container {name} has no {probe}.httpGet"))
}

/// The Envoy container's preStop `exec` command (argv).
pub fn envoy_prestop_command() -> anyhow::Result<Vec<String>> {
    container("envoy")?["lifecycle"]["preStop"]["exec"]["command"]
        .as_sequence()
        .with_context(|| format!("{GATEWAY_DEPLOYMENT}: envoy has no preStop exec command"))?
        .iter()
        .map(|v| v.as_str().map(str::to_owned).context("a non-string preStop argument"))
        .collect()
}

/// Envoy's admin port in the shipped config (the preStop hook talks to it on loopback).
pub const SHIPPED_ENVOY_ADMIN_PORT: u16 = 9901;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deployment_names_its_probes_and_hook() {
        assert_eq!(probe_path("envoy", "readinessProbe").unwrap(), "/ready");
        assert_eq!(probe_path("indexer", "readinessProbe").unwrap(), "/readyz");
        let hook = envoy_prestop_command().unwrap().join(" ");
        assert!(hook.contains(&format!("127.0.0.1/{SHIPPED_ENVOY_ADMIN_PORT}")), "{hook}");
    }
}
