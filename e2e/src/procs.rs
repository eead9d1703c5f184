//! Child processes that cannot outlive the test that started them.
//!
//! A [`Proc`] owns a child process, writes its stdout and stderr to a log file in the test's
//! directory, and kills it when dropped. When the drop happens during a panic (a failing test), the
//! tail of the log is printed so the failure explains itself. Readiness is the child's own word: the
//! first stdout line starting with `READY` (vllm-sim and the indexer print one with their bound
//! addresses), or an HTTP probe for programs that print none (Envoy).

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// A running child process, killed on drop.
pub struct Proc {
    name: String,
    child: Child,
    log_path: PathBuf,
    ready_line: String,
    ready_rx: Option<mpsc::Receiver<String>>,
    /// The child leads its own process group, and killing it kills the group (programs that fork
    /// helpers, like vLLM's engine core and worker).
    group: bool,
}

impl Proc {
    /// Starts `cmd`, logging to `<log_dir>/<name>.log`. Call [`Self::wait_ready`] for programs that
    /// print a `READY` line.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> anyhow::Result<Self> {
        let log_path = log_dir.join(format!("{name}.log"));
        let log =
            File::create(&log_path).with_context(|| format!("create {}", log_path.display()))?;
        let stderr = log.try_clone()?;
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::from(stderr));
        let mut child = cmd.spawn().with_context(|| format!("start {name}: {cmd:?}"))?;
        let stdout = child.stdout.take().context("child stdout")?;
        let (tx, rx) = mpsc::channel::<String>();
        let mut log_out = log;
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("READY") {
                    let _ = tx.send(line.clone());
                }
                let _ = writeln!(log_out, "{line}");
            }
        });
        Ok(Self {
            name: name.to_owned(),
            child,
            log_path,
            ready_line: String::new(),
            ready_rx: Some(rx),
            group: false,
        })
    }

    /// Like [`Self::spawn`], with the child in a new process group that [`Self::kill`] (and drop)
    /// kills as a whole.
    pub fn spawn_group(name: &str, mut cmd: Command, log_dir: &Path) -> anyhow::Result<Self> {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
        let mut p = Self::spawn(name, cmd, log_dir)?;
        p.group = true;
        Ok(p)
    }

    /// Waits for the child's `READY` line (once; later calls return at once).
    pub fn wait_ready(&mut self) -> anyhow::Result<()> {
        let Some(rx) = self.ready_rx.take() else { return Ok(()) };
        let deadline = Instant::now() + crate::poll::patience();
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(line) => {
                    self.ready_line = line;
                    return Ok(());
                }
                Err(mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {
                    if let Some(status) = self.child.try_wait()? {
                        bail!(
                            "{} exited with {status} before it was ready:\n{}",
                            self.name,
                            self.log_tail(40)
                        );
                    }
                }
                Err(_) => {
                    bail!("{} did not print READY in time:\n{}", self.name, self.log_tail(40))
                }
            }
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The child's process id (e.g. to read its CPU time from `/proc`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The `READY …` line the child printed.
    pub fn ready_line(&self) -> &str {
        &self.ready_line
    }

    /// The value of `key=` in the READY line.
    pub fn ready_field(&self, key: &str) -> Option<&str> {
        self.ready_line.split_whitespace().find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The last `lines` lines of the child's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let Ok(mut f) = File::open(&self.log_path) else { return String::new() };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
        let mut text = String::new();
        let _ = f.read_to_string(&mut text);
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub fn terminate(&mut self, grace: Duration) {
        if !self.is_running() {
            return;
        }
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if !self.is_running() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }

    /// SIGKILL (the whole group for [`Self::spawn_group`]) and reap.
    pub fn kill(&mut self) {
        if self.group {
            if let Ok(pid) = i32::try_from(self.child.id()) {
                let _ = nix::sys::signal::killpg(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "---- {} log tail ({}) ----\n{}",
                self.name,
                self.log_path.display(),
                self.log_tail(60)
            );
        }
    }
}

/// A process stopped by SIGSTOP (it keeps its sockets and answers nothing: a hung peer), resumed
/// by SIGCONT when dropped, so a failing test or benchmark never leaves it stopped.
pub struct Paused(u32);

impl Paused {
    /// Stops process `pid`.
    pub fn stop(pid: u32) -> anyhow::Result<Self> {
        kill(Pid::from_raw(i32::try_from(pid)?), Signal::SIGSTOP)
            .with_context(|| format!("SIGSTOP {pid}"))?;
        Ok(Self(pid))
    }

    /// Resumes it now (SIGCONT).
    pub fn resume(self) {}
}

impl Drop for Paused {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGCONT);
        }
    }
}

/// A free TCP port on 127.0.0.1, for programs that cannot bind port 0 themselves.
///
/// Chosen below the kernel's ephemeral range, never by binding port 0: a port from the ephemeral
/// range is free only until the kernel hands it out again, as the source port of any outgoing
/// connection or to a simulator's own bind of port 0, and a program started a moment later then
/// fails with "Address already in use" (CI saw Envoy do so). Nothing takes a port below that range
/// unasked. A port this process has handed out is not handed out again, so tests running in
/// parallel never share one; the scan starts at an offset that differs between processes.
pub fn free_port() -> anyhow::Result<u16> {
    static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let (low, high) = (FREE_PORT_LOW, ephemeral_port_low().max(FREE_PORT_LOW + 1));
    let span = u32::from(high - low);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let start = (std::process::id().wrapping_mul(7919) ^ nanos) % span;
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    for step in 0..span {
        let port = low + u16::try_from((start + step) % span).unwrap_or(0);
        if handed_out.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            handed_out.insert(port);
            return Ok(port);
        }
    }
    bail!("no free TCP port on 127.0.0.1 in {low}..{high} (below the ephemeral range)")
}

/// The lowest port [`free_port`] hands out: above the well-known and most registered service ports.
const FREE_PORT_LOW: u16 = 20000;

/// The first port of the kernel's ephemeral range (Linux's default when it cannot be read).
fn ephemeral_port_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// Where the workspace's binaries are: `$KVMESH_BIN_DIR`, else `<target>/debug` (or `release`
/// when `release` is true), honouring `CARGO_TARGET_DIR`.
pub fn bin_dir(release: bool) -> PathBuf {
    if let Some(dir) = std::env::var_os("KVMESH_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    target.join(if release { "release" } else { "debug" })
}

/// The repository root (this crate lives in `<root>/e2e`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

/// Builds the wasm filter with `features` into `target_dir` (never over the `make wasm` artifact),
/// returning the module's path: for tests that need a module of their own or none was built.
pub fn build_filter_wasm(target_dir: &Path, features: &[&str]) -> anyhow::Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-p", "kvmesh-filter", "--target", "wasm32-wasip1", "--profile", "wasm"]);
    if !features.is_empty() {
        cmd.arg("--features").arg(features.join(","));
    }
    let status = cmd.arg("--target-dir").arg(target_dir).current_dir(repo_root()).status()?;
    anyhow::ensure!(status.success(), "building kvmesh_filter.wasm ({features:?}) failed");
    Ok(target_dir.join("wasm32-wasip1/wasm/kvmesh_filter.wasm"))
}

/// A workspace binary, with a clear error when it has not been built.
pub fn binary(name: &str, release: bool) -> anyhow::Result<PathBuf> {
    let path = bin_dir(release).join(name);
    if !path.exists() {
        bail!("{} not found: run `make build` (or `cargo build --bins`) first", path.display());
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_bindable_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port().expect("a free port")).collect();
        let distinct: std::collections::BTreeSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice: {ports:?}");
        for p in ports {
            assert!(
                (FREE_PORT_LOW..ephemeral_port_low().max(FREE_PORT_LOW + 1)).contains(&p),
                "{p} is outside the range"
            );
            std::net::TcpListener::bind(("127.0.0.1", p)).expect("the port is bindable");
        }
    }
}
