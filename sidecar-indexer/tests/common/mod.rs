//! Test support: child processes that die with the test, READY-line parsing, patient polling.

// Test-only support: failing loudly (panics) is how a test reports, so the production lints on
// panics and unwraps do not apply here.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long to wait for anything: the harness's one patience (`KVMESH_TEST_PATIENCE_S`).
pub use kvmesh_e2e::poll::patience;

/// A child process killed when dropped (also when the test panics), its stderr kept in a file.
pub struct Proc {
    pub name: String,
    child: Child,
    pub ready: String,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `cmd` and waits for its `READY …` stdout line.
    pub fn start(name: &str, mut cmd: Command, dir: &Path) -> Proc {
        let log = dir.join(format!("{name}.log"));
        let err = std::fs::File::create(&log).unwrap();
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(err));
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("start {name}: {e}"));
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("READY") {
                    let _ = tx.send(line);
                }
            }
        });
        let mut p = Proc { name: name.to_owned(), child, ready: String::new(), log };
        let deadline = Instant::now() + patience();
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => {
                    p.ready = line;
                    return p;
                }
                Err(_) if Instant::now() < deadline => {
                    if let Ok(Some(status)) = p.child.try_wait() {
                        panic!("{name} exited with {status} before READY:\n{}", p.log_tail());
                    }
                }
                Err(_) => panic!("{name} printed no READY line in time:\n{}", p.log_tail()),
            }
        }
    }

    /// `key=value` from the READY line.
    pub fn field(&self, key: &str) -> String {
        self.ready
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("{}: no {key}= in {:?}", self.name, self.ready))
            .to_owned()
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- {} log tail ----\n{}", self.name, self.log_tail());
        }
    }
}

/// The `vllm-sim` binary: `$KVMESH_SIM_BIN`, else `<target dir>/debug/vllm-sim`. `make test` (or
/// `cargo build -p kvmesh-sim`) builds it; tests cannot build another package's binary themselves.
pub fn sim_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("KVMESH_SIM_BIN") {
        return PathBuf::from(p);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let path = target.join("debug/vllm-sim");
    assert!(
        path.exists(),
        "{} not found: build the simulator first (`cargo build -p kvmesh-sim`, which `make test` does) or set KVMESH_SIM_BIN",
        path.display()
    );
    path
}

/// The indexer binary of this package.
pub fn indexer_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kvmesh-indexer"))
}

/// Polls `check` until it returns Ok or patience runs out; panics with the last error.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + patience();
    let mut last = String::new();
    while Instant::now() < deadline {
        match check().await {
            Ok(()) => return,
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not true within {:?}: {last}", patience());
}

/// `POST /v1/route` on the indexer at `ix` for a `/v1/completions` body, as request `req-1`; the
/// answer decoded as `T` (a `RouteDecision` or a JSON `Value`).
pub async fn route<T: serde::de::DeserializeOwned>(
    http: &reqwest::Client,
    ix: impl std::fmt::Display,
    body: impl Into<reqwest::Body>,
) -> T {
    route_path(http, ix, "/v1/completions", body).await
}

/// [`route`] for a body sent to the OpenAI `path`.
#[allow(dead_code)]
pub async fn route_path<T: serde::de::DeserializeOwned>(
    http: &reqwest::Client,
    ix: impl std::fmt::Display,
    path: &str,
    body: impl Into<reqwest::Body>,
) -> T {
    http.post(format!("http://{ix}{}", kvmesh_core::api::ROUTE_PATH))
        .header(kvmesh_core::headers::KVMESH_PATH, path)
        .header(kvmesh_core::headers::REQUEST_ID, "req-1")
        .body(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}
