//! The Envoy bootstrap, rendered from `envoy/bootstrap.yaml.j2`.
//!
//! One template serves every setup: `policy = "kvmesh"` gives the `override_host` load balancer and
//! a front door that picks its destination ([`Edge`]): the wasm filter and its singleton service,
//! the indexer's endpoint picker over ext_proc (no wasm), or both; the other policies give plain
//! Envoy with one of its own load balancers (the benchmark baselines). Rendering is a pure
//! function of [`BootstrapVars`] (and the edge's [`EppTarget`]) — the same worker list the
//! indexer's fleet file is written from — so the two never disagree. Variables are checked before rendering (a STATIC cluster needs IPs, a header
//! name must be a token) and any variable the template uses but the caller did not give is an
//! error, not an empty string. The filter configuration is read into the filter's own typed
//! [`FilterConfig`] (`kvmesh_core::filter_config`) and validated exactly as the filter's
//! `on_configure` will: a typo or a bad bound fails here, naming the key, not when Envoy loads the
//! file. The JSON embedded in the bootstrap is written back from the typed value, every default
//! spelled out.
//!
//! Over 600 lines: one renderer for every edge (wasm, ext_proc, both) and policy of the bootstrap
//! template, with the render and `envoy --mode validate` tests beside it.

use std::net::IpAddr;

use kvmesh_core::filter_config::{ConfigError, FilterConfig};
use serde::Serialize;

/// The template, compiled into the binary so a test or tool never depends on the working directory.
pub const TEMPLATE: &str = include_str!("../../envoy/bootstrap.yaml.j2");

/// The header naming the requested model that the baseline policies route by when workers name
/// their models (the template's `model_subsets`): the client sets it, or a body-based router in
/// front (the Gateway API Inference Extension's sets this very header from the body's `model`).
pub const MODEL_HEADER: &str = "x-gateway-model-name";

/// The policies the template knows.
pub const POLICIES: [&str; 4] = ["kvmesh", "round_robin", "least_request", "ring_hash"];

/// One engine endpoint of the `engines` cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BootstrapWorker {
    pub id: String,
    /// An IP address (the cluster is STATIC).
    pub host: String,
    pub port: u16,
    /// The names (base model, aliases, adapters) it serves; empty in a one-model fleet. When
    /// workers name them, the baseline policies balance within the workers serving the request's
    /// `x-gateway-model-name` (template variable `model_subsets`).
    pub models: Vec<String>,
}

/// Everything the template needs; field names are the template's variable names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BootstrapVars {
    pub listen_host: String,
    pub listen_port: u16,
    pub admin_port: u16,
    pub indexer_host: String,
    pub indexer_port: u16,
    /// Path of `kvmesh_filter.wasm` (used by the `kvmesh` policy only).
    pub wasm_path: String,
    /// The filter's plugin configuration, a JSON object as a string (`kvmesh` policy only):
    /// parsed into [`FilterConfig`] and rendered back from it.
    pub filter_config_json: String,
    pub workers: Vec<BootstrapWorker>,
    /// Request body limit in bytes; bigger bodies get 413.
    pub max_body_bytes: u64,
    /// One of [`POLICIES`].
    pub policy: String,
    /// Header holding the client's session id (ring_hash hashes it; the filter reads it).
    pub session_header: String,
    /// Route timeout of a whole response, seconds; 0 = none.
    pub upstream_timeout_s: u64,
    /// Circuit breaker of cluster `kvmesh_indexer`: connections, pending and active calls
    /// (usually [`DEFAULT_INDEXER_MAX_CONNECTIONS`]).
    pub indexer_max_connections: u32,
    /// The wasm filter's `failure_policy`: one of [`WASM_FAILURE_POLICIES`] (usually
    /// [`DEFAULT_WASM_FAILURE_POLICY`]).
    pub wasm_failure_policy: String,
}

/// Which front door picks the endpoint under the `kvmesh` policy (the template's `edge`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Edge {
    /// The wasm filter asks the indexer's `/v1/route` (the default; keeps routing, on the
    /// filter's local fallback, while the indexer is down).
    #[default]
    Wasm,
    /// Envoy's ext_proc filter asks the indexer's endpoint picker (`[epp]`, GIE's endpoint-picker
    /// protocol); no wasm. `failure_mode_allow`: a request goes on unpicked (the cluster's
    /// fallback LB) when the picker cannot be reached or fails, instead of failing.
    ExtProc { failure_mode_allow: bool },
    /// The endpoint picker picks; the wasm filter after it is the fallback for a request the
    /// picker left without a destination (`failure_mode_allow` as for [`Edge::ExtProc`]).
    Both { failure_mode_allow: bool },
}

impl Edge {
    /// The template's name of it: `wasm`, `ext_proc`, `both`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Wasm => "wasm",
            Self::ExtProc { .. } => "ext_proc",
            Self::Both { .. } => "both",
        }
    }

    /// Whether Envoy calls the endpoint picker (the indexer needs `[epp] listen`).
    pub fn uses_epp(self) -> bool {
        !matches!(self, Self::Wasm)
    }

    /// Whether Envoy loads the wasm filter.
    pub fn uses_wasm(self) -> bool {
        !matches!(self, Self::ExtProc { .. })
    }

    /// ext_proc's `failure_mode_allow` (false without ext_proc).
    pub fn failure_mode_allow(self) -> bool {
        match self {
            Self::Wasm => false,
            Self::ExtProc { failure_mode_allow } | Self::Both { failure_mode_allow } => {
                failure_mode_allow
            }
        }
    }

    /// The edge named `name` (`wasm`, `ext_proc`, `both`), with `failure_mode_allow` for the two
    /// that call the picker.
    pub fn parse(name: &str, failure_mode_allow: bool) -> Option<Self> {
        match name {
            "wasm" => Some(Self::Wasm),
            "ext_proc" => Some(Self::ExtProc { failure_mode_allow }),
            "both" => Some(Self::Both { failure_mode_allow }),
            _ => None,
        }
    }
}

/// Where Envoy's ext_proc filter finds the endpoint picker (edges other than [`Edge::Wasm`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EppTarget {
    /// An IP address (the `kvmesh_epp` cluster is STATIC).
    pub host: String,
    pub port: u16,
    /// The longest wait for the picker: ext_proc's `message_timeout` (one answer of a STREAMED
    /// request body or a STREAMED response) and, on the ext_proc edge, whose FULL_DUPLEX_STREAMED
    /// messages Envoy 1.40 does not time, the idle timeout of the route a request is on until the
    /// picker answers (`kvmesh_picking`). Capped on the `both` edge ([`epp_wait_ms`]).
    pub message_timeout_ms: u64,
    /// Whether a request's `x-gateway-destination-endpoint-subset` header becomes GIE's subset
    /// hint (`envoy.lb.subset_hint` metadata, which the picker honours), as a gateway in front
    /// would set it. Off: the header is stripped — a client could otherwise pin itself to one
    /// engine, so turn it on only where the header comes from a trusted hop (the conformance
    /// harness does).
    pub subset_from_header: bool,
}

/// The shipped [`EppTarget::message_timeout_ms`]: the picker's own route deadline (the indexer's
/// `routing.request_timeout_ms`, 15 s by default) plus time for the upload. Istio's InferencePool
/// filter waits 1000 s; a hung picker would hold requests that long.
pub const DEFAULT_EPP_MESSAGE_TIMEOUT_MS: u64 = 30_000;

/// Longest accepted [`EppTarget::message_timeout_ms`] (Istio's value).
pub const MAX_EPP_MESSAGE_TIMEOUT_MS: u64 = 1_000_000;

/// Envoy's overload manager settings (template variables of their own, so callers that build
/// [`BootstrapVars`] need not spell them out: [`render_bootstrap`] uses the defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EnvoyLimits {
    /// The fixed heap budget, bytes (tcmalloc's heap; the wasm VMs' memory is outside it).
    pub max_heap_bytes: u64,
    /// The bound on client connections.
    pub max_downstream_connections: u64,
    /// Requests announcing a body over 1 MiB admitted per second (the local rate limit in front of
    /// the buffer filter); more are answered 503 at their headers.
    pub large_bodies_per_s: u64,
}

impl Default for EnvoyLimits {
    fn default() -> Self {
        Self {
            max_heap_bytes: DEFAULT_MAX_HEAP_BYTES,
            max_downstream_connections: DEFAULT_MAX_DOWNSTREAM_CONNECTIONS,
            large_bodies_per_s: DEFAULT_LARGE_BODIES_PER_S,
        }
    }
}

/// Envoy's heap budget in the shipped Kubernetes config: 768 MiB of a 1 GiB container limit (the
/// wasm VMs' memory, stacks and the binary are outside the heap the monitor reads).
pub const DEFAULT_MAX_HEAP_BYTES: u64 = 768 << 20;

/// The shipped rate of large uploads (bodies over 1 MiB) per Envoy: 16 near-8 MiB bodies a second,
/// each held until its response ends, stay well inside the 768 MiB heap budget.
pub const DEFAULT_LARGE_BODIES_PER_S: u64 = 16;

/// The shipped bound on client connections per Envoy.
pub const DEFAULT_MAX_DOWNSTREAM_CONNECTIONS: u64 = 4096;

/// The failure policies the template accepts.
pub const WASM_FAILURE_POLICIES: [&str; 2] = ["FAIL_RELOAD", "FAIL_OPEN"];

/// Recover a trapped VM (see the template for the trade-off).
pub const DEFAULT_WASM_FAILURE_POLICY: &str = "FAIL_RELOAD";

/// The default bound on connections (and on pending and active calls) to the indexer.
pub const DEFAULT_INDEXER_MAX_CONNECTIONS: u32 = 256;

/// Why a bootstrap could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("bootstrap variable `{name}` = {value:?}: {reason}")]
    InvalidVar { name: &'static str, value: String, reason: &'static str },
    #[error("bootstrap template: {0}")]
    Template(#[from] minijinja::Error),
    #[error("bootstrap variable `filter_config_json`: {0}")]
    FilterConfig(#[from] ConfigError),
}

/// The typed, validated filter configuration of `filter_config_json`.
pub fn filter_config(json: &str) -> Result<FilterConfig, RenderError> {
    Ok(FilterConfig::from_bytes(Some(json.as_bytes()))?)
}

/// Shortest stream idle timeout of a request the filter holds (the template's `kvmesh_held`
/// route): a client's body may pause this long between chunks.
pub const MIN_HELD_IDLE_TIMEOUT_MS: u64 = 4000;

/// The stream idle timeout of a request the filter holds: longer than its longest pause (two
/// route calls, when the first one's body base was unknown, each bounded by `indexer_timeout_ms`),
/// at least [`MIN_HELD_IDLE_TIMEOUT_MS`]. What answers a request held in a VM that traps.
pub fn held_idle_timeout_ms(filter: &FilterConfig) -> u64 {
    (2 * filter.indexer_timeout_ms + 1000).max(MIN_HELD_IDLE_TIMEOUT_MS)
}

/// How long Envoy waits for the picker on `edge` ([`EppTarget::message_timeout_ms`]), in ms. On
/// the `both` edge with the held route (`FAIL_RELOAD`), a request ext_proc holds has not been
/// released by the wasm filter yet, so the held route's idle timeout ([`held_idle_timeout_ms`])
/// would answer it 504 before a longer wait ended: there the wait is capped a second below it, so
/// a hung picker is given up (failure_mode_allow) in time for the filter to route the request.
pub fn epp_wait_ms(
    edge: Edge,
    message_timeout_ms: u64,
    filter: &FilterConfig,
    wasm_failure_policy: &str,
) -> u64 {
    if matches!(edge, Edge::Both { .. }) && wasm_failure_policy == "FAIL_RELOAD" {
        message_timeout_ms.min(held_idle_timeout_ms(filter) - 1000)
    } else {
        message_timeout_ms
    }
}

/// Renders the bootstrap YAML with the default [`EnvoyLimits`].
pub fn render_bootstrap(vars: &BootstrapVars) -> Result<String, RenderError> {
    render_bootstrap_with(vars, &EnvoyLimits::default())
}

/// Renders the bootstrap YAML with the overload manager's `limits` (the wasm filter's edge).
pub fn render_bootstrap_with(
    vars: &BootstrapVars,
    limits: &EnvoyLimits,
) -> Result<String, RenderError> {
    render_bootstrap_edge(vars, limits, Edge::Wasm, None)
}

/// Renders the bootstrap YAML with the overload manager's `limits` and `edge` as the kvmesh
/// policy's front door; `epp` is where the endpoint picker listens (needed by every edge but
/// [`Edge::Wasm`]).
pub fn render_bootstrap_edge(
    vars: &BootstrapVars,
    limits: &EnvoyLimits,
    edge: Edge,
    epp: Option<&EppTarget>,
) -> Result<String, RenderError> {
    validate(vars, edge)?;
    let epp = validate_epp(vars, edge, epp)?;
    if limits.max_heap_bytes < 64 << 20
        || limits.max_downstream_connections == 0
        || limits.large_bodies_per_s == 0
    {
        return Err(RenderError::InvalidVar {
            name: "max_heap_bytes",
            value: format!("{limits:?}"),
            reason: "the heap budget must be at least 64 MiB, connections and large bodies a second at least 1",
        });
    }
    let mut env = minijinja::Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    // minijinja would JSON-escape every `{{ }}` of a `*.yaml.j2`; the template quotes with `tojson` itself.
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_keep_trailing_newline(true);
    env.add_template("bootstrap.yaml.j2", TEMPLATE)?;
    let filter = if vars.policy == "kvmesh" {
        filter_config(&vars.filter_config_json)?
    } else {
        FilterConfig::default()
    };
    let typed = BootstrapVars { filter_config_json: filter.to_json(), ..vars.clone() };
    // The client's override headers are stripped outside wasm too unless the filter honours them.
    let ctx = minijinja::context! {
        strip_overrides => !filter.allow_overrides,
        model_subsets => vars.policy != "kvmesh" && vars.workers.iter().any(|w| !w.models.is_empty()),
        max_heap_bytes => limits.max_heap_bytes,
        max_downstream_connections => limits.max_downstream_connections,
        large_bodies_per_s => limits.large_bodies_per_s,
        // A protobuf Duration: seconds ("4.000s"), never "ms".
        held_idle_timeout => format!("{:.3}s", held_idle_timeout_ms(&filter) as f64 / 1000.0),
        edge => edge.as_str(),
        epp_host => epp.host,
        epp_port => epp.port,
        epp_failure_mode_allow => edge.failure_mode_allow(),
        epp_subset_from_header => epp.subset_from_header,
        epp_message_timeout => format!(
            "{:.3}s",
            epp_wait_ms(edge, epp.message_timeout_ms, &filter, &vars.wasm_failure_policy) as f64
                / 1000.0
        ),
        ..minijinja::Value::from_serialize(&typed)
    };
    Ok(env.get_template("bootstrap.yaml.j2")?.render(ctx)?)
}

/// The picker's address for the template: `epp` checked (an IP, a port, a bounded timeout) when
/// `edge` calls the picker; unused placeholders for [`Edge::Wasm`].
fn validate_epp(
    v: &BootstrapVars,
    edge: Edge,
    epp: Option<&EppTarget>,
) -> Result<EppTarget, RenderError> {
    let bad = |name: &'static str, value: String, reason: &'static str| {
        Err(RenderError::InvalidVar { name, value, reason })
    };
    if !edge.uses_epp() {
        return Ok(EppTarget {
            host: String::new(),
            port: 0,
            message_timeout_ms: DEFAULT_EPP_MESSAGE_TIMEOUT_MS,
            subset_from_header: false,
        });
    }
    if v.policy != "kvmesh" {
        return bad(
            "edge",
            edge.as_str().to_owned(),
            "the endpoint picker needs the kvmesh policy",
        );
    }
    let Some(epp) = epp else {
        return bad("epp_host", String::new(), "the ext_proc edges need the picker's address");
    };
    if epp.host.parse::<IpAddr>().is_err() {
        return bad("epp_host", epp.host.clone(), "must be an IP address (STATIC cluster)");
    }
    if epp.port == 0 {
        return bad("epp_port", "0".to_owned(), "must be the picker's bound port");
    }
    if !(1..=MAX_EPP_MESSAGE_TIMEOUT_MS).contains(&epp.message_timeout_ms) {
        return bad(
            "epp_message_timeout",
            format!("{} ms", epp.message_timeout_ms),
            "must be 1 ms to 1000 s",
        );
    }
    Ok(epp.clone())
}

fn validate(v: &BootstrapVars, edge: Edge) -> Result<(), RenderError> {
    let bad = |name: &'static str, value: &str, reason: &'static str| RenderError::InvalidVar {
        name,
        value: value.to_owned(),
        reason,
    };
    if !POLICIES.contains(&v.policy.as_str()) {
        return Err(bad(
            "policy",
            &v.policy,
            "must be kvmesh, round_robin, least_request or ring_hash",
        ));
    }
    for (name, host) in [("listen_host", &v.listen_host), ("indexer_host", &v.indexer_host)] {
        if host.parse::<IpAddr>().is_err() {
            return Err(bad(name, host, "must be an IP address"));
        }
    }
    if v.workers.is_empty() {
        return Err(bad("workers", "[]", "needs at least one worker"));
    }
    for w in &v.workers {
        if w.host.parse::<IpAddr>().is_err() {
            return Err(bad("workers[].host", &w.host, "must be an IP address (STATIC cluster)"));
        }
        if w.port == 0 {
            return Err(bad("workers[].port", "0", "must be a port"));
        }
    }
    let token = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    };
    if !token(&v.session_header) {
        return Err(bad("session_header", &v.session_header, "must be a lowercase header name"));
    }
    if v.max_body_bytes == 0 {
        return Err(bad("max_body_bytes", "0", "must be positive"));
    }
    if !WASM_FAILURE_POLICIES.contains(&v.wasm_failure_policy.as_str()) {
        return Err(bad(
            "wasm_failure_policy",
            &v.wasm_failure_policy,
            "must be FAIL_RELOAD or FAIL_OPEN",
        ));
    }
    if v.indexer_max_connections == 0 {
        return Err(bad("indexer_max_connections", "0", "must be positive"));
    }
    if v.policy == "kvmesh" && edge.uses_wasm() && v.wasm_path.is_empty() {
        return Err(bad("wasm_path", "", "needed by the kvmesh policy's wasm filter"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procs::repo_root;
    use std::path::PathBuf;
    use std::process::Command;

    fn vars(policy: &str, wasm_path: &str) -> BootstrapVars {
        BootstrapVars {
            listen_host: "127.0.0.1".into(),
            listen_port: 18080,
            admin_port: 19901,
            indexer_host: "127.0.0.1".into(),
            indexer_port: 19100,
            wasm_path: wasm_path.into(),
            filter_config_json: r#"{"session_header":"x-session-id","debug_headers":true,"derive_session_keys":true}"#.into(),
            workers: (0..3).map(|i| BootstrapWorker { id: format!("w{i}"), host: "127.0.0.1".into(), port: 18001 + i, models: Vec::new() }).collect(),
            max_body_bytes: 8 << 20,
            policy: policy.into(),
            session_header: "x-session-id".into(),
            upstream_timeout_s: 300,
            indexer_max_connections: DEFAULT_INDEXER_MAX_CONNECTIONS,
            wasm_failure_policy: DEFAULT_WASM_FAILURE_POLICY.into(),
        }
    }

    /// `$KVMESH_ENVOY`, else `.tools/bin/envoy`.
    fn envoy() -> Option<PathBuf> {
        let path = std::env::var_os("KVMESH_ENVOY")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo_root().join(".tools/bin/envoy"));
        path.exists().then_some(path)
    }

    /// `$KVMESH_WASM` or the `make wasm` artifact; built into a private target dir when absent
    /// (`envoy --mode validate` instantiates the wasm VM, so the module must be real).
    fn wasm() -> PathBuf {
        let made = std::env::var_os("KVMESH_WASM")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo_root().join("target/wasm32-wasip1/wasm/kvmesh_filter.wasm"));
        if made.exists() {
            return made;
        }
        crate::procs::build_filter_wasm(&repo_root().join("target/validate-wasm"), &[])
            .expect("build the wasm filter")
    }

    #[test]
    fn every_policy_renders_and_envoy_accepts_it() {
        let Some(envoy) = envoy() else {
            crate::skip_or_fail_in_ci(
                "no Envoy binary (set KVMESH_ENVOY or run `make setup`); rendering only",
            )
            .unwrap();
            for policy in POLICIES {
                render_bootstrap(&vars(policy, "/nonexistent.wasm")).unwrap();
            }
            return;
        };
        let wasm = wasm();
        let dir = tempfile::tempdir().unwrap();
        let several = POLICIES.map(|p| (p, true));
        for (policy, models) in POLICIES.map(|p| (p, false)).into_iter().chain(several) {
            let mut v = vars(policy, &wasm.display().to_string());
            if models {
                v = with_models(v);
            }
            let yaml = render_bootstrap(&v).unwrap();
            let path = dir.path().join(format!("{policy}-{models}.yaml"));
            assert_envoy_accepts(&envoy, &path, &yaml, policy);
        }
    }

    /// Writes `yaml` to `path` and asserts `envoy --mode validate` accepts it (`what` names it).
    fn assert_envoy_accepts(
        envoy: &std::path::Path,
        path: &std::path::Path,
        yaml: &str,
        what: &str,
    ) {
        std::fs::write(path, yaml).unwrap();
        let out =
            Command::new(envoy).args(["--mode", "validate", "-c"]).arg(path).output().unwrap();
        assert!(
            out.status.success(),
            "envoy rejected the {what} bootstrap:\n{}\n{}\n---\n{yaml}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn epp() -> EppTarget {
        EppTarget {
            host: "127.0.0.1".into(),
            port: 19002,
            message_timeout_ms: DEFAULT_EPP_MESSAGE_TIMEOUT_MS,
            subset_from_header: false,
        }
    }

    /// Every edge that calls the endpoint picker, with each failure mode.
    const EPP_EDGES: [Edge; 4] = [
        Edge::ExtProc { failure_mode_allow: false },
        Edge::ExtProc { failure_mode_allow: true },
        Edge::Both { failure_mode_allow: false },
        Edge::Both { failure_mode_allow: true },
    ];

    fn render_edge(v: &BootstrapVars, edge: Edge) -> String {
        render_bootstrap_edge(v, &EnvoyLimits::default(), edge, Some(&epp())).unwrap()
    }

    #[test]
    fn every_edge_renders_and_envoy_accepts_it() {
        let Some(envoy) = envoy() else {
            crate::skip_or_fail_in_ci(
                "no Envoy binary (set KVMESH_ENVOY or run `make setup`); rendering only",
            )
            .unwrap();
            for edge in EPP_EDGES {
                render_edge(&vars("kvmesh", "/nonexistent.wasm"), edge);
            }
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        for (i, edge) in EPP_EDGES.into_iter().enumerate() {
            // Pure ext_proc loads no wasm: no module at all, so Envoy would refuse a wasm filter.
            let wasm = if edge.uses_wasm() { wasm().display().to_string() } else { String::new() };
            for models in [false, true] {
                let mut v = vars("kvmesh", &wasm);
                if models {
                    v = with_models(v);
                }
                let yaml = render_edge(&v, edge);
                let path = dir.path().join(format!("{}-{i}-{models}.yaml", edge.as_str()));
                assert_envoy_accepts(&envoy, &path, &yaml, &format!("{edge:?}"));
            }
        }
    }

    /// The HTTP filters of the rendered listener, by name, in order.
    fn http_filters(yaml: &str) -> Vec<serde_json::Value> {
        let doc: serde_json::Value = serde_yaml::from_str(yaml).unwrap();
        doc.pointer(
            "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/http_filters",
        )
        .and_then(serde_json::Value::as_array)
        .cloned()
        .unwrap_or_default()
    }

    fn filter_names(yaml: &str) -> Vec<String> {
        http_filters(yaml)
            .iter()
            .filter_map(|f| {
                f["name"].as_str().map(|n| n.trim_start_matches("envoy.filters.http.").to_owned())
            })
            .collect()
    }

    fn cluster(yaml: &str, name: &str) -> Option<serde_json::Value> {
        let doc: serde_json::Value = serde_yaml::from_str(yaml).unwrap();
        doc.pointer("/static_resources/clusters")?
            .as_array()?
            .iter()
            .find(|c| c["name"] == name)
            .cloned()
    }

    #[test]
    fn the_ext_proc_edge_picks_with_no_wasm_and_no_buffer() {
        let edge = Edge::ExtProc { failure_mode_allow: false };
        let yaml = render_edge(&vars("kvmesh", ""), edge);
        assert_eq!(
            filter_names(&yaml),
            ["local_ratelimit", "header_mutation", "ext_proc", "router"],
            "large uploads limited, the client's destination stripped, then the picker:\n{yaml}"
        );
        assert!(!yaml.contains("envoy.bootstrap.wasm") && !yaml.contains("kvmesh_held"));
        assert!(cluster(&yaml, "kvmesh_indexer").is_none(), "nothing calls /v1/route");
        let ext_proc = http_filters(&yaml)
            .into_iter()
            .find(|f| f["name"] == "envoy.filters.http.ext_proc")
            .unwrap();
        let c = &ext_proc["typed_config"];
        assert_eq!(c["grpc_service"]["envoy_grpc"]["cluster_name"], "kvmesh_epp");
        let mode = &c["processing_mode"];
        for (field, want) in [
            ("request_header_mode", "SEND"),
            ("response_header_mode", "SEND"),
            ("request_body_mode", "FULL_DUPLEX_STREAMED"),
            ("response_body_mode", "STREAMED"),
            ("request_trailer_mode", "SEND"),
            ("response_trailer_mode", "SEND"),
        ] {
            assert_eq!(mode[field], want, "{field}");
        }
        assert_eq!(c["failure_mode_allow"], false);
        assert_eq!(c["message_timeout"], "30.000s");
        // Envoy times no FULL_DUPLEX_STREAMED message: a request the picker has not answered
        // (no destination header yet) is on a route with a short idle timeout; the picker's
        // answer moves it to the normal route.
        let routes = serde_yaml::from_str::<serde_json::Value>(&yaml)
            .unwrap()
            .pointer("/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/route_config/virtual_hosts/0/routes")
            .cloned()
            .unwrap();
        assert_eq!(routes[0]["name"], "kvmesh_picking");
        assert_eq!(routes[0]["match"]["headers"][0]["name"], "x-gateway-destination-endpoint");
        assert_eq!(routes[0]["route"]["idle_timeout"], "30.000s");
        assert_eq!(routes[1]["route"]["idle_timeout"], "300s");
        assert_eq!(routes[0]["route"]["retry_policy"], routes[1]["route"]["retry_policy"]);
        let md = &c["metadata_options"];
        assert_eq!(
            md["forwarding_namespaces"]["untyped"],
            serde_json::json!(["envoy.lb", "envoy.lb.subset_hint"])
        );
        assert_eq!(md["receiving_namespaces"]["untyped"], serde_json::json!(["envoy.lb"]));
        let open = render_edge(&vars("kvmesh", ""), Edge::ExtProc { failure_mode_allow: true });
        assert!(open.contains("failure_mode_allow: true"));

        let epp = cluster(&yaml, "kvmesh_epp").expect("the picker's cluster");
        assert_eq!(epp["type"], "STATIC");
        let options = &epp["typed_extension_protocol_options"]
            ["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"];
        assert!(
            options["explicit_http_config"]["http2_protocol_options"].is_object(),
            "gRPC needs HTTP/2"
        );
        let address = &epp
            .pointer("/load_assignment/endpoints/0/lb_endpoints/0/endpoint/address/socket_address")
            .cloned()
            .unwrap();
        assert_eq!(
            (address["address"].as_str(), address["port_value"].as_u64()),
            (Some("127.0.0.1"), Some(19002))
        );
        // A picker its health check marked down is not called (no panic mode).
        assert_eq!(
            epp["health_checks"][0]["grpc_health_check"]["service_name"],
            "envoy.service.ext_proc.v3.ExternalProcessor"
        );
        assert_eq!(epp["common_lb_config"]["healthy_panic_threshold"]["value"], 0);

        let engines = cluster(&yaml, "engines").unwrap();
        let lb = engines
            .pointer("/load_balancing_policy/policies/0/typed_extension_config/typed_config")
            .cloned()
            .unwrap();
        assert_eq!(
            lb["override_host_sources"],
            serde_json::json!([
                {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}},
                {"header": "x-gateway-destination-endpoint"}
            ]),
            "the picker's metadata first, then the header"
        );
        assert_eq!(
            lb["selected_host_key"],
            serde_json::json!({"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint-served"}]})
        );
        // The overload manager and the router's retries are the same as the wasm edge's.
        assert!(yaml.contains("overload_manager:") && yaml.contains("num_retries: 2"));
        assert!(yaml.contains("request_body_buffer_limit: 8388608"));
    }

    #[test]
    fn both_edges_put_the_picker_before_the_filter() {
        let yaml = render_edge(&vars("kvmesh", "/x.wasm"), Edge::Both { failure_mode_allow: true });
        assert_eq!(
            filter_names(&yaml),
            ["local_ratelimit", "buffer", "header_mutation", "ext_proc", "wasm", "router"],
            "{yaml}"
        );
        assert!(yaml.contains("envoy.bootstrap.wasm") && yaml.contains("kvmesh_held"));
        assert!(
            cluster(&yaml, "kvmesh_indexer").is_some() && cluster(&yaml, "kvmesh_epp").is_some()
        );
        assert!(yaml.contains("failure_mode_allow: true"));
        // The buffer filter holds the body already: STREAMED (Envoy keeps its copy), so the picker's failure falls open
        // to the filter, and Envoy times the picker — within the held route's idle timeout.
        let ext_proc = http_filters(&yaml)
            .into_iter()
            .find(|f| f["name"] == "envoy.filters.http.ext_proc")
            .unwrap();
        let c = &ext_proc["typed_config"];
        assert_eq!(c["processing_mode"]["request_body_mode"], "STREAMED");
        assert_eq!(c["send_body_without_waiting_for_header_response"], true);
        assert_eq!(c["message_timeout"], "3.000s", "4 s held idle timeout, less a second");
        assert!(!yaml.contains("- name: kvmesh_picking"), "timed by message_timeout instead");
        let mut open = vars("kvmesh", "/x.wasm");
        open.wasm_failure_policy = "FAIL_OPEN".into();
        let no_held = render_edge(&open, Edge::Both { failure_mode_allow: true });
        assert!(no_held.contains("message_timeout: 30.000s"), "no held route, no cap");
    }

    #[test]
    fn the_subset_header_becomes_the_hint_only_when_asked() {
        let edge = Edge::ExtProc { failure_mode_allow: false };
        let v = vars("kvmesh", "");
        let off = render_edge(&v, edge);
        assert!(off.contains("- remove: x-gateway-destination-endpoint-subset"), "{off}");
        assert!(!filter_names(&off).contains(&"header_to_metadata".to_owned()));
        let on = EppTarget { subset_from_header: true, ..epp() };
        let yaml = render_bootstrap_edge(&v, &EnvoyLimits::default(), edge, Some(&on)).unwrap();
        assert_eq!(
            filter_names(&yaml),
            ["local_ratelimit", "header_mutation", "header_to_metadata", "ext_proc", "router"]
        );
        assert!(!yaml.contains("- remove: x-gateway-destination-endpoint-subset"));
        assert!(yaml.contains("metadata_namespace: envoy.lb.subset_hint"), "{yaml}");
    }

    #[test]
    fn the_picker_wait_is_capped_only_under_the_held_route() {
        let f = FilterConfig::default();
        let both = Edge::Both { failure_mode_allow: true };
        let ext_proc = Edge::ExtProc { failure_mode_allow: true };
        assert_eq!(epp_wait_ms(both, 30_000, &f, "FAIL_RELOAD"), held_idle_timeout_ms(&f) - 1000);
        assert_eq!(epp_wait_ms(both, 2_000, &f, "FAIL_RELOAD"), 2_000);
        assert_eq!(epp_wait_ms(both, 30_000, &f, "FAIL_OPEN"), 30_000);
        assert_eq!(epp_wait_ms(ext_proc, 30_000, &f, "FAIL_RELOAD"), 30_000);
    }

    #[test]
    fn the_wasm_edge_renders_without_the_picker() {
        let v = vars("kvmesh", "/x.wasm");
        let yaml = render_bootstrap(&v).unwrap();
        assert_eq!(
            yaml,
            render_bootstrap_edge(&v, &EnvoyLimits::default(), Edge::Wasm, Some(&epp())).unwrap(),
            "the picker's address is unused by the wasm edge"
        );
        assert_eq!(
            filter_names(&yaml),
            ["local_ratelimit", "buffer", "header_mutation", "wasm", "router"]
        );
        for absent in ["ext_proc", "kvmesh_epp", "selected_host_key", "envoy.lb", "edge:"] {
            assert!(!yaml.contains(absent), "{absent}");
        }
    }

    #[test]
    fn bad_edge_vars_are_refused() {
        let ext_proc = Edge::ExtProc { failure_mode_allow: false };
        let err = |v: &BootstrapVars, edge: Edge, epp: Option<&EppTarget>| {
            render_bootstrap_edge(v, &EnvoyLimits::default(), edge, epp).unwrap_err().to_string()
        };
        assert!(err(&vars("round_robin", ""), ext_proc, Some(&epp())).contains("`edge`"));
        assert!(err(&vars("kvmesh", ""), ext_proc, None).contains("`epp_host`"));
        let mut e = epp();
        e.host = "localhost".into();
        assert!(err(&vars("kvmesh", ""), ext_proc, Some(&e)).contains("`epp_host`"));
        let e = EppTarget { port: 0, ..epp() };
        assert!(err(&vars("kvmesh", ""), ext_proc, Some(&e)).contains("`epp_port`"));
        let e = EppTarget { message_timeout_ms: 0, ..epp() };
        assert!(err(&vars("kvmesh", ""), ext_proc, Some(&e)).contains("`epp_message_timeout`"));
        // The wasm filter needs its module; the picker alone does not.
        let both = Edge::Both { failure_mode_allow: false };
        assert!(err(&vars("kvmesh", ""), both, Some(&epp())).contains("`wasm_path`"));
        assert!(render_bootstrap_edge(
            &vars("kvmesh", ""),
            &EnvoyLimits::default(),
            ext_proc,
            Some(&epp())
        )
        .is_ok());
        assert_eq!(Edge::parse("ext_proc", true), Some(Edge::ExtProc { failure_mode_allow: true }));
        assert_eq!(Edge::parse("grpc", true), None);
    }

    /// `v` over two models: w0 and w1 serve `a` and its adapter, w2 serves `b`.
    fn with_models(mut v: BootstrapVars) -> BootstrapVars {
        for (i, w) in v.workers.iter_mut().enumerate() {
            w.models = if i < 2 { vec!["a".into(), "a-sql".into()] } else { vec!["b".into()] };
        }
        v
    }

    #[test]
    fn baselines_route_by_model_when_workers_name_theirs() {
        for policy in ["round_robin", "least_request", "ring_hash"] {
            let one = render_bootstrap(&vars(policy, "")).unwrap();
            assert!(!one.contains("subset") && !one.contains("x-gateway-model-name"), "{policy}");
            let yaml = render_bootstrap(&with_models(vars(policy, ""))).unwrap();
            assert!(yaml.contains("envoy.load_balancing_policies.subset"), "{policy}");
            assert!(yaml.contains(&format!("header: {MODEL_HEADER}")), "{policy}");
            assert!(yaml.contains(r#"envoy.lb: { model: ["a","a-sql"] }"#), "{yaml}");
            assert!(yaml.contains(&format!("envoy.load_balancing_policies.{policy}")), "{policy}");
        }
        // kvmesh resolves the body's model itself: no subsets.
        let kvmesh = render_bootstrap(&with_models(vars("kvmesh", "/x.wasm"))).unwrap();
        assert!(!kvmesh.contains("subset") && !kvmesh.contains("x-gateway-model-name"));
    }

    #[test]
    fn policies_differ_where_they_should() {
        let kvmesh = render_bootstrap(&vars("kvmesh", "/x.wasm")).unwrap();
        assert!(
            kvmesh.contains("envoy.filters.http.wasm") && kvmesh.contains("envoy.bootstrap.wasm")
        );
        assert!(
            kvmesh.contains("allow_on_headers_stop_iteration: true")
                && kvmesh.contains("failure_policy: FAIL_RELOAD")
        );
        assert!(kvmesh.contains("reload_config:"));
        assert!(kvmesh.contains("override_host") && kvmesh.contains("name: kvmesh_indexer"));
        assert!(
            kvmesh.contains("max_request_bytes: 8388608"),
            "the buffer filter enforces the body limit"
        );
        let rate_limit =
            kvmesh.find("envoy.filters.http.local_ratelimit").expect("large uploads limited");
        assert!(
            rate_limit < kvmesh.find("envoy.filters.http.buffer").unwrap(),
            "large uploads are refused at their headers, before the buffer filter holds a body"
        );
        assert!(kvmesh.contains("max_tokens: 16, tokens_per_fill: 16"));
        let none = EnvoyLimits { large_bodies_per_s: 0, ..EnvoyLimits::default() };
        assert!(render_bootstrap_with(&vars("kvmesh", "/x.wasm"), &none).is_err());
        let strip = kvmesh
            .find("remove: x-gateway-destination-endpoint")
            .expect("the destination header is stripped outside wasm");
        assert!(
            strip < kvmesh.find("envoy.filters.http.wasm").unwrap(),
            "the strip runs before the wasm filter"
        );
        assert!(
            kvmesh.contains("remove: x-kvmesh-worker"),
            "overrides off: stripped outside wasm too"
        );
        assert!(
            kvmesh.contains("max_connections: 256, max_pending_requests: 256"),
            "the indexer cluster is bounded"
        );
        assert!(kvmesh.contains("outlier_detection:"));
        assert!(
            kvmesh.contains("remove: x-kvmesh-override-secret"),
            "overrides off: no secret reaches the filter or an engine"
        );
        let mut with_overrides = vars("kvmesh", "/x.wasm");
        with_overrides.filter_config_json =
            r#"{"allow_overrides":true,"override_secret":"0123456789abcdef-e2e"}"#.into();
        let yaml = render_bootstrap(&with_overrides).unwrap();
        assert!(
            yaml.contains("remove: x-gateway-destination-endpoint")
                && !yaml.contains("remove: x-kvmesh-worker")
        );
        assert!(
            !yaml.contains("remove: x-kvmesh-override-secret"),
            "the filter reads the secret (and strips it)"
        );
        for (policy, lb) in [
            ("round_robin", "round_robin.v3.RoundRobin"),
            ("least_request", "least_request.v3.LeastRequest"),
            ("ring_hash", "ring_hash.v3.RingHash"),
        ] {
            let yaml = render_bootstrap(&vars(policy, "")).unwrap();
            assert!(yaml.contains(lb), "{policy}");
            assert!(
                !yaml.contains("envoy.filters.http.wasm")
                    && !yaml.contains("policies.override_host")
                    && !yaml.contains("name: kvmesh_indexer"),
                "{policy}"
            );
            assert!(
                yaml.contains("max_request_bytes: 8388608"),
                "{policy}: the buffer filter enforces the body limit"
            );
            assert_eq!(
                yaml.contains("header_name: \"x-session-id\""),
                policy == "ring_hash",
                "{policy}"
            );
        }
    }

    #[test]
    fn requests_the_filter_holds_get_a_short_idle_timeout_under_fail_reload_only() {
        let mut v = vars("kvmesh", "/x.wasm");
        v.filter_config_json = r#"{"indexer_timeout_ms": 2500}"#.into();
        let yaml = render_bootstrap(&v).unwrap();
        let held = yaml.find("name: kvmesh_held").expect("the held route");
        assert!(held < yaml.find("retry_policy:").unwrap(), "the held route comes first");
        assert!(yaml.contains("idle_timeout: 6.000s"), "2 x 2.5 s + 1 s:\n{yaml}");
        assert!(
            yaml.contains("idle_timeout: 300s") && yaml.contains("- remove: x-kvmesh-released")
        );
        assert_eq!(held_idle_timeout_ms(&FilterConfig::default()), MIN_HELD_IDLE_TIMEOUT_MS);
        // FAIL_OPEN: a bypassed VM releases nothing, so no held route; nor without the filter.
        v.wasm_failure_policy = "FAIL_OPEN".into();
        assert!(!render_bootstrap(&v).unwrap().contains("kvmesh_held"));
        assert!(!render_bootstrap(&vars("round_robin", "")).unwrap().contains("kvmesh_held"));
    }

    #[test]
    fn filter_config_is_embedded_as_a_string() {
        let mut v = vars("kvmesh", "/x.wasm");
        v.filter_config_json =
            r#"{"session_header":"X-S","indexer_authority":"it's-<\"quoted\">"}"#.into();
        let yaml = render_bootstrap(&v).unwrap();
        let line = yaml.lines().find(|l| l.contains("google.protobuf.StringValue")).unwrap();
        let start = line.find("value: ").unwrap() + "value: ".len();
        let end = line.rfind(" }").unwrap();
        // A YAML double-quoted scalar written by tojson is a JSON string literal.
        let decoded: String = serde_json::from_str(&line[start..end]).unwrap();
        let typed = filter_config(&v.filter_config_json).unwrap();
        assert_eq!(decoded, typed.to_json(), "rendered from the typed configuration");
        assert_eq!(typed.session_header, "x-s");
        assert_eq!(
            FilterConfig::from_bytes(Some(decoded.as_bytes())).unwrap(),
            typed,
            "the filter reads back what was typed"
        );
    }

    #[test]
    fn a_bad_filter_config_is_refused_naming_the_key() {
        for (json, needle) in [
            ("not json", "expected"),
            ("[1]", "invalid type"),
            (r#"{"debug_header":true}"#, "unknown field `debug_header`"),
            (r#"{"indexer_timeout_ms":0}"#, "`indexer_timeout_ms`"),
            (r#"{"allow_overrides":true}"#, "`allow_overrides`"),
        ] {
            let mut v = vars("kvmesh", "/x.wasm");
            v.filter_config_json = json.into();
            let err = render_bootstrap(&v).unwrap_err().to_string();
            assert!(err.contains("filter_config_json") && err.contains(needle), "{json}: {err}");
        }
        // Other policies have no filter: its configuration is not read.
        let mut v = vars("round_robin", "");
        v.filter_config_json = "not json".into();
        assert!(render_bootstrap(&v).is_ok());
    }

    #[test]
    fn bad_vars_are_refused() {
        type Mutation = fn(&mut BootstrapVars);
        let cases: Vec<(Mutation, &str)> = vec![
            (|v| v.policy = "random".into(), "policy"),
            (|v| v.workers[0].host = "localhost".into(), "workers[].host"),
            (|v| v.workers.clear(), "workers"),
            (|v| v.listen_host = "0.0.0.0\nadmin: x".into(), "listen_host"),
            (|v| v.session_header = "X Session".into(), "session_header"),
            (|v| v.max_body_bytes = 0, "max_body_bytes"),
            (|v| v.indexer_max_connections = 0, "indexer_max_connections"),
            (|v| v.wasm_failure_policy = "FAIL_CLOSED".into(), "wasm_failure_policy"),
        ];
        for (mutate, field) in cases {
            let mut v = vars("kvmesh", "/x.wasm");
            mutate(&mut v);
            let err = render_bootstrap(&v).unwrap_err().to_string();
            assert!(err.contains(&format!("`{field}`")), "{field}: {err}");
        }
    }
}
