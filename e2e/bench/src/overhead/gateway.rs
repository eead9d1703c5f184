//! One Envoy, three ways in (pure): the kvmesh bootstrap plus a filter-less twin listener and
//! an ext_proc listener.
//!
//! The overhead is kvmesh against *the same* Envoy without the filter, so every path shares the
//! process, its worker threads, the buffer filter, the body limit, the route timeout and the
//! simulators. [`add_plain_path`] takes the kvmesh bootstrap as the harness renders it
//! (`envoy/bootstrap.yaml.j2` with `edge = wasm`, parsed to JSON) and adds, without touching the
//! kvmesh path's filter chain:
//! - `plain_listener`: a copy of the kvmesh listener without the wasm filter, routing to
//!   `engines_plain` — the same endpoints with Envoy's least_request (kvmesh's own fallback LB);
//! - on both listeners a first route, selected by `x-kvmesh-bench-upstream: none`, that answers
//!   with a canned SSE stream instead of forwarding: the requests/s phase measures the gateway,
//!   not the engines (the filter and the indexer still do all their work on the kvmesh side);
//! - a JSON access log on both listeners, for requests tagged `x-kvmesh-bench-id`, with Envoy's
//!   own timestamps per request (µs):
//!   `req_us` = last request byte received → first byte sent upstream (the filter's body work,
//!   the indexer round trip with tokenization, host selection), `resp_us` = first upstream
//!   response byte → first byte sent to the client (the response-header callbacks). Their sum is
//!   the time the gateway holds a request, and the engine's time is in neither.

use super::cases::{BENCH_ID_HEADER, UPSTREAM_HEADER, UPSTREAM_NONE};
use serde_json::{json, Value};

/// Route name of the forwarding route on the kvmesh listener.
pub const ROUTE_KVMESH: &str = "kvmesh";
/// Route name of the forwarding route on the plain listener.
pub const ROUTE_PLAIN: &str = "plain";
/// Route name of the canned-response routes.
pub const ROUTE_CANNED: &str = "canned";
/// Name of the cluster the plain listener forwards to.
pub const PLAIN_CLUSTER: &str = "engines_plain";
/// Route name of the forwarding route on the ext_proc listener.
pub const ROUTE_EXT_PROC: &str = "ext_proc";
/// Name of the cluster the ext_proc listener forwards to.
pub const EXT_PROC_CLUSTER: &str = "engines_ext_proc";
/// The engines cluster of the harness's bootstrap.
const ENGINES_CLUSTER: &str = "engines";
/// Envoy's name of the wasm HTTP filter.
const WASM_FILTER: &str = "envoy.filters.http.wasm";
/// Envoy's name of the ext_proc HTTP filter.
const EXT_PROC_FILTER: &str = "envoy.filters.http.ext_proc";
/// The canned response: one content chunk, usage, done (what a `max_tokens: 1` stream looks like).
pub const CANNED_SSE: &str = "data: {\"id\":\"canned\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" ok\"},\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n";

/// Why the bootstrap could not be extended (its shape is not the harness's).
#[derive(Debug, thiserror::Error)]
#[error("kvmesh bootstrap has no {0}")]
pub struct ShapeError(&'static str);

fn hcm_mut(listener: &mut Value) -> Result<&mut Value, ShapeError> {
    listener
        .pointer_mut("/filter_chains/0/filters/0/typed_config")
        .filter(|v| v.get("http_filters").is_some())
        .ok_or(ShapeError("http_connection_manager on its listener"))
}

fn routes_mut(hcm: &mut Value) -> Result<&mut Vec<Value>, ShapeError> {
    hcm.pointer_mut("/route_config/virtual_hosts/0/routes")
        .and_then(Value::as_array_mut)
        .ok_or(ShapeError("routes"))
}

fn access_log(path: &str) -> Value {
    json!([{
        "name": "envoy.access_loggers.file",
        // Only tagged requests: the requests/s rounds would add ~10^5 untagged lines.
        "filter": {"header_filter": {"header": {"name": BENCH_ID_HEADER, "present_match": true}}},
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path,
            "log_format": {"json_format": {
                "id": format!("%REQ({})%", BENCH_ID_HEADER.to_ascii_uppercase()),
                "route": "%ROUTE_NAME%",
                "status": "%RESPONSE_CODE%",
                "req_us": "%COMMON_DURATION(DS_RX_END:US_TX_BEG:us)%",
                "resp_us": "%COMMON_DURATION(US_RX_BEG:DS_TX_BEG:us)%",
                "upstream": "%UPSTREAM_HOST%"
            }}
        }
    }])
}

fn canned_route() -> Value {
    json!({
        "name": ROUTE_CANNED,
        "match": {"prefix": "/", "headers": [{"name": UPSTREAM_HEADER, "string_match": {"exact": UPSTREAM_NONE}}]},
        "direct_response": {"status": 200, "body": {"inline_string": CANNED_SSE}}
    })
}

/// Names the forwarding route, optionally points every route to the engines at another cluster,
/// and puts the canned route first.
fn prepare_routes(hcm: &mut Value, name: &str, cluster: Option<&str>) -> Result<(), ShapeError> {
    let routes = routes_mut(hcm)?;
    let forward = routes.first_mut().ok_or(ShapeError("forwarding route"))?;
    forward["name"] = json!(name);
    if forward.pointer("/route/cluster").is_none() {
        return Err(ShapeError("route cluster"));
    }
    if let Some(c) = cluster {
        for target in routes.iter_mut().filter_map(|r| r.pointer_mut("/route/cluster")) {
            if *target == ENGINES_CLUSTER {
                *target = json!(c);
            }
        }
    }
    routes.insert(0, canned_route());
    Ok(())
}

fn filter_names(hcm: &Value) -> Vec<&str> {
    hcm["http_filters"]
        .as_array()
        .map(|f| f.iter().filter_map(|f| f["name"].as_str()).collect())
        .unwrap_or_default()
}

fn engines_twin(clusters: &[Value], name: &str) -> Result<Value, ShapeError> {
    let engines = clusters
        .iter()
        .find(|c| c["name"] == ENGINES_CLUSTER)
        .ok_or(ShapeError("engines cluster"))?;
    let mut twin = engines.clone();
    twin["name"] = json!(name);
    twin["load_assignment"]["cluster_name"] = json!(name);
    Ok(twin)
}

/// Adds the plain listener on `plain_port`, its cluster, the canned routes and the access log
/// (written to `access_log_path`) to the rendered kvmesh bootstrap.
pub fn add_plain_path(
    bootstrap: &Value,
    plain_port: u16,
    access_log_path: &str,
) -> Result<Value, ShapeError> {
    let mut b = bootstrap.clone();
    let listeners = b
        .pointer_mut("/static_resources/listeners")
        .and_then(Value::as_array_mut)
        .ok_or(ShapeError("listeners"))?;
    let kvmesh = listeners.first_mut().ok_or(ShapeError("listener"))?;
    let mut plain = kvmesh.clone();
    {
        let hcm = hcm_mut(kvmesh)?;
        hcm["access_log"] = access_log(access_log_path);
        prepare_routes(hcm, ROUTE_KVMESH, None)?;
    }
    plain["name"] = json!("plain_listener");
    *plain
        .pointer_mut("/address/socket_address/port_value")
        .ok_or(ShapeError("listener port"))? = json!(plain_port);
    {
        let hcm = hcm_mut(&mut plain)?;
        hcm["stat_prefix"] = json!("plain");
        hcm["access_log"] = access_log(access_log_path);
        prepare_routes(hcm, ROUTE_PLAIN, Some(PLAIN_CLUSTER))?;
        let filters = hcm["http_filters"].as_array_mut().ok_or(ShapeError("http_filters"))?;
        let before = filters.len();
        filters.retain(|f| f["name"] != WASM_FILTER);
        if filters.len() == before {
            return Err(ShapeError("wasm filter to remove (is this the kvmesh policy?)"));
        }
    }
    listeners.push(plain);

    let clusters = b
        .pointer_mut("/static_resources/clusters")
        .and_then(Value::as_array_mut)
        .ok_or(ShapeError("clusters"))?;
    let mut twin = engines_twin(clusters, PLAIN_CLUSTER)?;
    twin["load_balancing_policy"] = json!({"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.least_request",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"}
    }}]});
    clusters.push(twin);
    Ok(b)
}

/// Adds the ext_proc listener on `port` to `bootstrap` (the result of [`add_plain_path`]):
/// `ext_proc_bootstrap` is the same template rendered with `edge = ext_proc` for the same stack.
/// Its listener is taken whole (its ext_proc filter, its header handling), renamed, moved to
/// `port`, given the canned route and the access log (`access_log_path`), and pointed at
/// [`EXT_PROC_CLUSTER`] (its own copy of the engines cluster, as that rendering defines it); its
/// clusters the kvmesh bootstrap does not have (the picker's) are added.
pub fn add_ext_proc_path(
    bootstrap: &Value,
    ext_proc_bootstrap: &Value,
    port: u16,
    access_log_path: &str,
) -> Result<Value, ShapeError> {
    let mut listener = ext_proc_bootstrap
        .pointer("/static_resources/listeners/0")
        .cloned()
        .ok_or(ShapeError("listener in the ext_proc rendering"))?;
    listener["name"] = json!("ext_proc_listener");
    *listener
        .pointer_mut("/address/socket_address/port_value")
        .ok_or(ShapeError("listener port"))? = json!(port);
    {
        let hcm = hcm_mut(&mut listener)?;
        let names = filter_names(hcm);
        if !names.contains(&EXT_PROC_FILTER) || names.contains(&WASM_FILTER) {
            return Err(ShapeError(
                "listener with the ext_proc filter and no wasm filter (render it with edge = ext_proc)",
            ));
        }
        hcm["stat_prefix"] = json!("ext_proc");
        hcm["access_log"] = access_log(access_log_path);
        prepare_routes(hcm, ROUTE_EXT_PROC, Some(EXT_PROC_CLUSTER))?;
    }
    let theirs = ext_proc_bootstrap
        .pointer("/static_resources/clusters")
        .and_then(Value::as_array)
        .ok_or(ShapeError("clusters in the ext_proc rendering"))?;
    let twin = engines_twin(theirs, EXT_PROC_CLUSTER)?;

    let mut b = bootstrap.clone();
    b.pointer_mut("/static_resources/listeners")
        .and_then(Value::as_array_mut)
        .ok_or(ShapeError("listeners"))?
        .push(listener);
    let clusters = b
        .pointer_mut("/static_resources/clusters")
        .and_then(Value::as_array_mut)
        .ok_or(ShapeError("clusters"))?;
    let missing: Vec<Value> = theirs
        .iter()
        .filter(|c| {
            c["name"] != ENGINES_CLUSTER && !clusters.iter().any(|m| m["name"] == c["name"])
        })
        .cloned()
        .collect();
    clusters.extend(missing);
    clusters.push(twin);
    Ok(b)
}

/// One access-log line.
#[derive(Debug, Clone, PartialEq)]
pub struct AccessEntry {
    /// The request's [`BENCH_ID_HEADER`].
    pub id: String,
    /// Route name ([`ROUTE_KVMESH`], [`ROUTE_PLAIN`], [`ROUTE_CANNED`]).
    pub route: String,
    /// Last request byte received → first byte sent upstream, µs.
    pub req_us: Option<f64>,
    /// First upstream response byte → first byte to the client, µs.
    pub resp_us: Option<f64>,
}

impl AccessEntry {
    /// Time the gateway held the request, ms (`None` unless both halves were measured).
    pub fn gateway_ms(&self) -> Option<f64> {
        Some((self.req_us? + self.resp_us?) / 1000.0)
    }
}

fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
    .filter(|x: &f64| x.is_finite() && *x >= 0.0)
}

/// Parses one access-log line; `None` for lines without an id (requests not sent by the bench).
pub fn parse_access_line(line: &str) -> Option<AccessEntry> {
    let v: Value = serde_json::from_str(line).ok()?;
    let id = v["id"].as_str().filter(|s| !s.is_empty() && *s != "-")?.to_string();
    Some(AccessEntry {
        id,
        route: v["route"].as_str().unwrap_or("").to_string(),
        req_us: number(&v["req_us"]),
        resp_us: number(&v["resp_us"]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_e2e::envoy_config::{
        render_bootstrap, render_bootstrap_edge, BootstrapVars, BootstrapWorker, Edge, EnvoyLimits,
        EppTarget,
    };

    fn vars(wasm: &str) -> BootstrapVars {
        BootstrapVars {
            listen_host: "127.0.0.1".into(),
            listen_port: 18080,
            admin_port: 19901,
            indexer_host: "127.0.0.1".into(),
            indexer_port: 19100,
            wasm_path: wasm.into(),
            filter_config_json: r#"{"session_header":"x-session-id","debug_headers":true}"#.into(),
            workers: (0..2)
                .map(|i| BootstrapWorker {
                    id: format!("w{i}"),
                    host: "127.0.0.1".into(),
                    port: 18001 + i,
                    models: Vec::new(),
                })
                .collect(),
            max_body_bytes: 8 << 20,
            policy: "kvmesh".into(),
            session_header: "x-session-id".into(),
            upstream_timeout_s: 300,
            indexer_max_connections: kvmesh_e2e::envoy_config::DEFAULT_INDEXER_MAX_CONNECTIONS,
            wasm_failure_policy: kvmesh_e2e::envoy_config::DEFAULT_WASM_FAILURE_POLICY.into(),
        }
    }

    fn kvmesh_bootstrap(wasm: &str) -> Value {
        serde_yaml::from_str(&render_bootstrap(&vars(wasm)).unwrap()).unwrap()
    }

    #[test]
    fn adds_a_filterless_twin_and_keeps_the_kvmesh_chain() {
        let before = kvmesh_bootstrap("/x.wasm");
        let b = add_plain_path(&before, 18081, "/tmp/a.log").unwrap();
        let listeners = b["static_resources"]["listeners"].as_array().unwrap();
        assert_eq!(listeners.len(), 2);
        let filters = |l: &Value| -> Vec<String> {
            l.pointer("/filter_chains/0/filters/0/typed_config/http_filters")
                .unwrap()
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f["name"].as_str().unwrap().to_string())
                .collect()
        };
        assert_eq!(
            filters(&listeners[0]),
            filters(&before["static_resources"]["listeners"][0]),
            "kvmesh chain untouched"
        );
        assert!(filters(&listeners[0]).contains(&"envoy.filters.http.wasm".to_string()));
        // The twin is the kvmesh chain (buffer, header stripping, …) minus the wasm filter.
        let mut want = filters(&listeners[0]);
        want.retain(|f| f != "envoy.filters.http.wasm");
        assert_eq!(filters(&listeners[1]), want);
        assert_eq!(want.last().map(String::as_str), Some("envoy.filters.http.router"));
        assert_eq!(listeners[1]["address"]["socket_address"]["port_value"], 18081);
        for (l, name, cluster) in
            [(&listeners[0], ROUTE_KVMESH, "engines"), (&listeners[1], ROUTE_PLAIN, PLAIN_CLUSTER)]
        {
            let routes = l
                .pointer(
                    "/filter_chains/0/filters/0/typed_config/route_config/virtual_hosts/0/routes",
                )
                .unwrap();
            assert_eq!(routes[0]["name"], ROUTE_CANNED);
            assert_eq!(routes[1]["name"], name);
            assert_eq!(routes[1]["route"]["cluster"], cluster);
            assert!(l.pointer("/filter_chains/0/filters/0/typed_config/access_log/0/typed_config/log_format/json_format/req_us").is_some());
        }
        let clusters = b["static_resources"]["clusters"].as_array().unwrap();
        let twin = clusters.iter().find(|c| c["name"] == PLAIN_CLUSTER).unwrap();
        let engines = clusters.iter().find(|c| c["name"] == "engines").unwrap();
        assert_eq!(
            twin["load_assignment"]["endpoints"], engines["load_assignment"]["endpoints"],
            "same simulators"
        );
        assert!(
            twin.to_string().contains("least_request")
                && !twin.to_string().contains("override_host")
        );
    }

    /// The same stack rendered with the picker's edge (`edge = ext_proc`).
    fn ext_proc_bootstrap() -> Value {
        let epp = EppTarget {
            host: "127.0.0.1".into(),
            port: 19002,
            message_timeout_ms: kvmesh_e2e::envoy_config::DEFAULT_EPP_MESSAGE_TIMEOUT_MS,
            subset_from_header: false,
        };
        let yaml = render_bootstrap_edge(
            &vars(""),
            &EnvoyLimits::default(),
            Edge::ExtProc { failure_mode_allow: false },
            Some(&epp),
        )
        .unwrap();
        serde_yaml::from_str(&yaml).unwrap()
    }

    #[test]
    fn adds_the_ext_proc_listener_with_its_own_engines_and_picker_clusters() {
        let wasm = kvmesh_bootstrap("/x.wasm");
        let two = add_plain_path(&wasm, 18081, "/tmp/a.log").unwrap();
        let b = add_ext_proc_path(&two, &ext_proc_bootstrap(), 18082, "/tmp/a.log").unwrap();
        let listeners = b["static_resources"]["listeners"].as_array().unwrap();
        assert_eq!(listeners.len(), 3);
        assert_eq!(listeners[..2], two["static_resources"]["listeners"].as_array().unwrap()[..]);
        let l = &listeners[2];
        assert_eq!(l["name"], "ext_proc_listener");
        assert_eq!(l["address"]["socket_address"]["port_value"], 18082);
        let hcm = l.pointer("/filter_chains/0/filters/0/typed_config").unwrap();
        assert_eq!(hcm["stat_prefix"], "ext_proc");
        assert!(filter_names(hcm).contains(&EXT_PROC_FILTER));
        let routes =
            hcm.pointer("/route_config/virtual_hosts/0/routes").unwrap().as_array().unwrap();
        assert_eq!(routes[0]["name"], ROUTE_CANNED);
        assert_eq!(routes[1]["name"], ROUTE_EXT_PROC);
        assert!(
            routes.iter().skip(1).all(|r| r["route"]["cluster"] == EXT_PROC_CLUSTER),
            "every forwarding route goes to the ext_proc twin: {routes:?}"
        );
        assert!(hcm.pointer("/access_log/0/typed_config/log_format/json_format/req_us").is_some());
        let clusters = b["static_resources"]["clusters"].as_array().unwrap();
        let names: Vec<&str> = clusters.iter().filter_map(|c| c["name"].as_str()).collect();
        assert_eq!(names.iter().filter(|n| **n == "kvmesh_epp").count(), 1, "{names:?}");
        assert_eq!(names.iter().filter(|n| **n == "kvmesh_indexer").count(), 1, "{names:?}");
        // The ext_proc rendering's engines cluster: override_host reads the picker's metadata.
        let twin = clusters.iter().find(|c| c["name"] == EXT_PROC_CLUSTER).unwrap();
        assert!(twin.to_string().contains("x-gateway-destination-endpoint-served"), "{twin}");
        assert_eq!(twin["load_assignment"]["cluster_name"], EXT_PROC_CLUSTER);
        let engines = clusters.iter().find(|c| c["name"] == ENGINES_CLUSTER).unwrap();
        assert!(
            !engines.to_string().contains("-served"),
            "the wasm path's engines cluster untouched"
        );
        // The wasm rendering is not an ext_proc one.
        let err = add_ext_proc_path(&two, &wasm, 18082, "/tmp/a.log").unwrap_err();
        assert!(err.to_string().contains("edge = ext_proc"), "{err}");
        assert!(add_ext_proc_path(&two, &json!({}), 18082, "/tmp/a.log").is_err());
    }

    #[test]
    fn refuses_a_bootstrap_without_the_filter() {
        let mut v = vars("");
        v.policy = "round_robin".into();
        let plain: Value = serde_yaml::from_str(&render_bootstrap(&v).unwrap()).unwrap();
        assert!(add_plain_path(&plain, 1, "/tmp/a.log")
            .unwrap_err()
            .to_string()
            .contains("wasm filter"));
        assert!(add_plain_path(&json!({}), 1, "/tmp/a.log").is_err());
    }

    /// Envoy itself accepts the result, all three listeners (skipped without an Envoy binary and
    /// the wasm filter).
    #[test]
    fn envoy_validates_the_extended_bootstrap() {
        let (Ok(envoy), Ok(wasm)) =
            (kvmesh_e2e::stack::envoy_binary(), kvmesh_e2e::stack::wasm_path())
        else {
            kvmesh_e2e::skip_or_fail_in_ci(
                "no Envoy binary or wasm filter (make setup && make wasm)",
            )
            .unwrap();
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("access.log");
        let log = log.display().to_string();
        let b =
            add_plain_path(&kvmesh_bootstrap(&wasm.display().to_string()), 18081, &log).unwrap();
        let b = add_ext_proc_path(&b, &ext_proc_bootstrap(), 18082, &log).unwrap();
        let path = dir.path().join("envoy.yaml");
        std::fs::write(&path, b.to_string()).unwrap();
        let out = std::process::Command::new(envoy)
            .args(["--mode", "validate", "-c"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn access_lines_parse() {
        let e = parse_access_line(r#"{"id":"c-1-k","route":"kvmesh","status":200,"req_us":812,"resp_us":"40","upstream":"127.0.0.1:1"}"#).unwrap();
        assert_eq!(e.id, "c-1-k");
        assert_eq!(e.route, ROUTE_KVMESH);
        assert_eq!(e.gateway_ms(), Some(0.852));
        let canned =
            parse_access_line(r#"{"id":"x","route":"canned","req_us":null,"resp_us":null}"#)
                .unwrap();
        assert_eq!(canned.gateway_ms(), None);
        assert!(parse_access_line(r#"{"id":null,"route":"kvmesh"}"#).is_none());
        assert!(parse_access_line(r#"{"id":"-"}"#).is_none());
        assert!(parse_access_line("not json").is_none());
    }
}
