//! A real Prometheus beside a running stack: for the dashboard-query test and `make run PROMETHEUS=1`.
//!
//! It scrapes every second under the job names the shipped rules and dashboard expect
//! (`kvmesh-gateway` = Envoy's `/stats/prometheus`, `kvmesh-indexer`, `engines`; see
//! envoy/prometheus/kvmesh-rules.yaml) and loads those rules. Everything it writes lives in the
//! stack's work dir (`prometheus.yml`, `prometheus.log`, storage in `prometheus/`), with absolute
//! paths in the config because Prometheus resolves `rule_files` against the config file's
//! directory, not its own working directory. The process is a [`Proc`], so it dies with its owner.
//! The binary is Debian's `prometheus` package, which `make setup` installs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::Value;

use crate::procs::{free_port, repo_root, Proc};
use crate::stack::Stack;

/// Environment variable: the Prometheus binary to run instead of `prometheus` on `PATH`.
pub const PROMETHEUS_ENV: &str = "KVMESH_PROMETHEUS";

/// The shipped recording rules and alerts, relative to the repository root.
pub const RULES_PATH: &str = "envoy/prometheus/kvmesh-rules.yaml";

/// The rules' shipped evaluation interval, replaced by `1s` when [`Options::fast_rules`] is set.
const SHIPPED_RULE_INTERVAL: &str = "interval: 30s";

/// The queries an operator needs most, as `(what it answers, PromQL)`. Each is a line of the
/// "queries an operator needs most" block in envoy/README.md, verbatim (a test keeps it so).
pub const OPERATOR_QUERIES: &[(&str, &str)] = &[
    (
        "router KV hit rate, block-weighted",
        r#"sum(rate(router_kv_overlap_blocks_total{job="kvmesh-gateway"}[5m])) / sum(rate(router_kv_isl_blocks_total{job="kvmesh-gateway"}[5m]))"#,
    ),
    (
        "engine prefix-cache hit rate, block-weighted (should be within a few points of the router's)",
        "sum(rate(vllm:prefix_cache_hits_total[5m])) / sum(rate(vllm:prefix_cache_queries_total[5m]))",
    ),
    ("routing decisions by mode and outcome", "sum by (mode, outcome) (rate(kvmesh_filter_requests_total[5m]))"),
    ("why the filter routed without the indexer (all 0: it never had to)", "sum by (reason) (rate(kvmesh_filter_fallbacks_total[5m]))"),
    (
        "router KV hit rate per base model (several models behind one gateway)",
        r#"sum by (model) (rate(router_kv_overlap_blocks_total{job="kvmesh-gateway"}[5m])) / sum by (model) (rate(router_kv_isl_blocks_total{job="kvmesh-gateway"}[5m]))"#,
    ),
    (
        "engine prefix-cache hit rate per served model",
        "sum by (model_name) (rate(vllm:prefix_cache_hits_total[5m])) / sum by (model_name) (rate(vllm:prefix_cache_queries_total[5m]))",
    ),
];

/// How to start Prometheus.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Listen port on 127.0.0.1; `None` picks a free one.
    pub port: Option<u16>,
    /// Evaluate the rules every second (a copy of the rule file in the work dir) instead of at the
    /// shipped 30 s, so a test need not wait for recorded series.
    pub fast_rules: bool,
}

/// What Prometheus scrapes: the stack's ports and engine addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrapeTargets {
    pub admin_port: u16,
    pub indexer_port: u16,
    /// `ip:port` of each engine's OpenAI server (which serves `/metrics`).
    pub engines: Vec<String>,
}

impl ScrapeTargets {
    /// The targets of a running stack.
    pub fn of(stack: &Stack) -> Self {
        Self {
            admin_port: stack.admin_port,
            indexer_port: stack.indexer_port,
            engines: stack.workers.iter().map(|w| w.http.clone()).collect(),
        }
    }
}

/// The scrape configuration: 1 s scrapes and rule evaluation, `rules` loaded (an absolute path).
pub fn config(targets: &ScrapeTargets, rules: &Path) -> String {
    let quote = |s: &str| serde_json::Value::from(s).to_string();
    let engines: Vec<String> = targets.engines.iter().map(|e| quote(e)).collect();
    format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
         rule_files:\n  - {rules}\n\
         scrape_configs:\n\
         - job_name: kvmesh-gateway\n  metrics_path: /stats/prometheus\n  static_configs:\n  - targets: [\"127.0.0.1:{admin}\"]\n\
         - job_name: kvmesh-indexer\n  static_configs:\n  - targets: [\"127.0.0.1:{indexer}\"]\n\
         - job_name: engines\n  static_configs:\n  - targets: [{engines}]\n",
        rules = quote(&rules.display().to_string()),
        admin = targets.admin_port,
        indexer = targets.indexer_port,
        engines = engines.join(", "),
    )
}

/// `$KVMESH_PROMETHEUS`, else `prometheus` on `PATH`; an error naming `make setup` when missing.
pub fn binary() -> anyhow::Result<PathBuf> {
    const HINT: &str = "run `make setup` (installs Debian's prometheus package)";
    if let Some(p) = std::env::var_os(PROMETHEUS_ENV) {
        let p = PathBuf::from(p);
        if !p.is_file() {
            bail!("{} (${PROMETHEUS_ENV}) not found: {HINT}", p.display());
        }
        return Ok(p);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("prometheus"))
        .find(|p| p.is_file())
        .with_context(|| format!("prometheus not found on PATH: {HINT}"))
}

/// A Prometheus scraping a stack, killed on drop.
pub struct Prometheus {
    proc: Proc,
    base: String,
    storage: PathBuf,
    http: reqwest::Client,
}

impl Prometheus {
    /// Writes the config (and, with `fast_rules`, the rule copy) into the stack's work dir, starts
    /// Prometheus and waits until it reports ready.
    pub async fn start(stack: &Stack, opts: Options) -> anyhow::Result<Self> {
        let bin = binary()?;
        let dir = std::fs::canonicalize(stack.dir())
            .with_context(|| format!("work dir {}", stack.dir().display()))?;
        let shipped = repo_root().join(RULES_PATH);
        let rules = if opts.fast_rules {
            let text = std::fs::read_to_string(&shipped)
                .with_context(|| format!("read {}", shipped.display()))?;
            let copy = dir.join("kvmesh-rules.yaml");
            std::fs::write(&copy, text.replace(SHIPPED_RULE_INTERVAL, "interval: 1s"))?;
            copy
        } else {
            shipped
        };
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config(&ScrapeTargets::of(stack), &rules))?;
        let storage = dir.join("prometheus");
        let port = opts.port.map_or_else(free_port, Ok)?;
        let mut cmd = Command::new(bin);
        cmd.arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", storage.display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"));
        let mut proc = Proc::spawn("prometheus", cmd, &dir)?;
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
        let ready = format!("{base}/-/ready");
        // An early exit (port taken, bad config) ends the wait at once, with the log to say why.
        let started = crate::poll::until("prometheus ready", || {
            let running = proc.is_running();
            let probe = http.get(&ready).send();
            async move {
                if !running {
                    return Some(false);
                }
                probe.await.ok()?.status().is_success().then_some(true)
            }
        })
        .await;
        match started {
            Ok(true) => Ok(Self { proc, base, storage, http }),
            Ok(false) => bail!("prometheus exited before it was ready:\n{}", proc.log_tail(20)),
            Err(e) => bail!("{e}:\n{}", proc.log_tail(20)),
        }
    }

    /// `http://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Where the TSDB lives.
    pub fn storage(&self) -> &Path {
        &self.storage
    }

    /// The process's log file.
    pub fn log_path(&self) -> &Path {
        self.proc.log_path()
    }

    /// Runs an instant query; Err on a parse or evaluation error, Ok(result array) otherwise.
    pub async fn query(&self, expr: &str) -> anyhow::Result<Vec<Value>> {
        let resp =
            self.http.get(self.url("/api/v1/query")).query(&[("query", expr)]).send().await?;
        let body: Value = resp.json().await?;
        if body["status"] != "success" {
            bail!("{}: {}", body["errorType"], body["error"]);
        }
        Ok(body["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// SIGTERM, so the TSDB is closed cleanly; SIGKILL after `grace`.
    pub fn stop(mut self, grace: Duration) {
        self.proc.terminate(grace);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operator_queries_are_the_ones_envoy_readme_shows() {
        let readme = std::fs::read_to_string(repo_root().join("envoy/README.md")).unwrap();
        let lines: Vec<&str> = readme.lines().map(str::trim).collect();
        for (what, expr) in OPERATOR_QUERIES {
            assert!(lines.contains(expr), "{what}: not a line of envoy/README.md: {expr}");
        }
    }

    #[test]
    fn config_names_every_job_and_quotes_the_rules_path() {
        let targets = ScrapeTargets {
            admin_port: 19901,
            indexer_port: 19100,
            engines: vec!["127.0.0.1:4001".into(), "127.0.0.1:4002".into()],
        };
        let cfg = config(&targets, Path::new("/tmp/run dir/kvmesh-rules.yaml"));
        for want in [
            "  - \"/tmp/run dir/kvmesh-rules.yaml\"\n",
            "- job_name: kvmesh-gateway\n  metrics_path: /stats/prometheus\n  static_configs:\n  - targets: [\"127.0.0.1:19901\"]\n",
            "- job_name: kvmesh-indexer\n  static_configs:\n  - targets: [\"127.0.0.1:19100\"]\n",
            "- job_name: engines\n  static_configs:\n  - targets: [\"127.0.0.1:4001\", \"127.0.0.1:4002\"]\n",
            "  scrape_interval: 1s\n",
        ] {
            assert!(cfg.contains(want), "missing {want:?} in\n{cfg}");
        }
    }
}
