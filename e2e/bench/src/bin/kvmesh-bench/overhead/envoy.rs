//! The overhead stack (step 1): its spec, and its Envoy replaced by one with the plain twin
//! listener (and the ext_proc listener), the canned routes and the access log.

use super::*;

pub(super) fn spec(args: &OverheadSettings, fleet: &Fleet, dir: &Path) -> StackSpec {
    let mut spec = StackSpec::aggregate(fleet.workers);
    spec.policy = EnvoyPolicy::Kvmesh;
    spec.block_size = fleet.block_size;
    spec.sim_args = vec![
        "--num-gpu-blocks".into(),
        fleet.num_gpu_blocks.to_string(),
        "--speedup".into(),
        args.sim_speedup.to_string(),
    ];
    spec.sim_args.extend(fleet.sim_args.iter().cloned());
    spec.kv_events = true;
    spec.routing_toml = Policy::KvmeshPrecise.routing_toml().to_string();
    let mut filter = serde_json::json!({ "debug_headers": true });
    if let Some(t) = args.indexer_timeout_ms {
        filter["indexer_timeout_ms"] = t.into();
    }
    if let Some(b) = args.local_route_max_body_bytes {
        filter["local_route_max_body_bytes"] = b.into();
    }
    spec.filter_config = filter;
    if args.ext_proc {
        // The indexer serves the picker; the harness renders the ext_proc bootstrap (its Envoy
        // starts on it) that `swap_envoy` takes the ext_proc listener from. Fail closed: a
        // picker failure must show as an error, not as plain Envoy's latency.
        spec.edge = Edge::ExtProc { failure_mode_allow: false };
    }
    spec.session_header = fleet.session_header.clone();
    spec.release = fleet.release;
    spec.work_dir = Some(dir.join("stack"));
    spec
}

/// The ports of the swapped Envoy's extra listeners.
pub(super) struct Swapped {
    pub(super) plain_port: u16,
    /// The ext_proc listener's (when the stack serves the picker).
    pub(super) ext_proc_port: Option<u16>,
    pub(super) access_log: std::path::PathBuf,
}

/// Replaces the stack's Envoy by one with the plain twin listener and, with `ext_proc`, the
/// ext_proc listener taken from the harness's own rendering (`<stack>/envoy.yaml`, rendered with
/// `edge = ext_proc`); the wasm path is rendered here with `edge = wasm`.
pub(super) async fn swap_envoy(stack: &mut Stack, ext_proc: bool) -> Result<Swapped> {
    let vars = BootstrapVars {
        listen_host: "127.0.0.1".into(),
        listen_port: stack.gateway_port,
        admin_port: stack.admin_port,
        indexer_host: "127.0.0.1".into(),
        indexer_port: stack.indexer_port,
        wasm_path: wasm_path()?.display().to_string(),
        filter_config_json: stack.filter_config().to_string(),
        workers: stack
            .workers
            .iter()
            .filter(|w| w.role.decodes())
            .map(|w| {
                let (host, port) =
                    w.http.rsplit_once(':').with_context(|| format!("bad address {}", w.http))?;
                Ok(BootstrapWorker {
                    id: w.id.clone(),
                    host: host.to_string(),
                    port: port.parse()?,
                    models: Vec::new(),
                })
            })
            .collect::<Result<_>>()?,
        max_body_bytes: stack.spec.max_body_bytes,
        policy: "kvmesh".into(),
        session_header: stack.spec.session_header.clone(),
        upstream_timeout_s: 300,
        indexer_max_connections: kvmesh_e2e::envoy_config::DEFAULT_INDEXER_MAX_CONNECTIONS,
        wasm_failure_policy: kvmesh_e2e::envoy_config::DEFAULT_WASM_FAILURE_POLICY.into(),
    };
    let rendered: serde_json::Value = serde_yaml::from_str(&render_bootstrap(&vars)?)
        .context("parsing the rendered bootstrap")?;
    let plain_port = free_port()?;
    let dir = stack.dir().to_path_buf();
    let log = dir.join("overhead-access.jsonl");
    let _ = std::fs::remove_file(&log);
    let mut bootstrap = add_plain_path(&rendered, plain_port, &log.display().to_string())?;
    let mut ext_proc_port = None;
    if ext_proc {
        let harness = dir.join("envoy.yaml");
        let text = std::fs::read_to_string(&harness)
            .with_context(|| format!("reading the harness's bootstrap {}", harness.display()))?;
        let theirs: serde_json::Value =
            serde_yaml::from_str(&text).context("parsing the harness's ext_proc bootstrap")?;
        let port = free_port()?;
        bootstrap = add_ext_proc_path(&bootstrap, &theirs, port, &log.display().to_string())?;
        ext_proc_port = Some(port);
    }
    let path = dir.join("envoy-overhead.yaml");
    std::fs::write(&path, bootstrap.to_string())?;

    if let Some(mut old) = stack.envoy.take() {
        old.kill();
    }
    let mut cmd = std::process::Command::new(envoy_binary()?);
    cmd.arg("-c")
        .arg(&path)
        .args(["--disable-hot-restart", "--concurrency"])
        .arg(ENVOY_CONCURRENCY.to_string())
        .args(["-l", "info"]);
    cmd.args(["--file-flush-interval-msec", "100"])
        .arg("--log-path")
        .arg(dir.join("envoy-overhead-app.log"));
    let mut proc = Proc::spawn("envoy-overhead", cmd, &dir)?;
    let client = stack.client().clone();
    let ready = stack.admin("/ready");
    let deadline = Instant::now() + kvmesh_e2e::poll::patience();
    loop {
        if matches!(client.get(&ready).send().await, Ok(r) if r.status().is_success()) {
            break;
        }
        if !proc.is_running() {
            bail!("envoy (overhead bootstrap) exited before it was ready:\n{}", proc.log_tail(60));
        }
        if Instant::now() > deadline {
            bail!("envoy (overhead bootstrap) not ready in time:\n{}", proc.log_tail(60));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stack.envoy = Some(proc);
    Ok(Swapped { plain_port, ext_proc_port, access_log: log })
}
