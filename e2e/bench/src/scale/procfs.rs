//! What the indexer process costs, from `/proc/<pid>`: resident memory, open file descriptors,
//! threads, and CPU time split by thread name (the applier, the KV listeners, the rest). The
//! parsers are pure; [`sample`] reads the files.

use crate::overhead::drive::parse_stat_ticks;

/// One reading of a process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProcSample {
    pub rss_bytes: u64,
    pub fds: u64,
    pub threads: u64,
    /// CPU ticks (1/100 s) of the whole process, the `kv-applier` thread and the KV listener
    /// threads (`kv-<worker>-<rank>`).
    pub cpu_ticks: u64,
    pub applier_ticks: u64,
    pub listener_ticks: u64,
}

/// `VmRSS` of a `/proc/<pid>/status` text, bytes.
pub fn vm_rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The command name of a `/proc/<pid>/task/<tid>/stat` line (between the parentheses).
pub fn stat_comm(stat: &str) -> Option<&str> {
    Some(&stat[stat.find('(')? + 1..stat.rfind(')')?])
}

/// Which bucket a thread's CPU goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadKind {
    Applier,
    Listener,
    Other,
}

/// The indexer's thread names: `kv-applier`, listeners `kv-<worker>-<rank>` (cut to 15 bytes).
pub fn thread_kind(comm: &str) -> ThreadKind {
    if comm == "kv-applier" {
        ThreadKind::Applier
    } else if comm.starts_with("kv-") {
        ThreadKind::Listener
    } else {
        ThreadKind::Other
    }
}

fn count_dir(path: &str) -> u64 {
    std::fs::read_dir(path).map_or(0, |d| d.count() as u64)
}

/// Reads process `pid` (`None` when it is gone).
pub fn sample(pid: u32) -> Option<ProcSample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut s = ProcSample {
        rss_bytes: vm_rss_bytes(&status)?,
        fds: count_dir(&format!("/proc/{pid}/fd")),
        threads: count_dir(&format!("/proc/{pid}/task")),
        cpu_ticks: parse_stat_ticks(&stat)?,
        ..Default::default()
    };
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            let Ok(text) = std::fs::read_to_string(t.path().join("stat")) else { continue };
            let (Some(comm), Some(ticks)) = (stat_comm(&text), parse_stat_ticks(&text)) else {
                continue;
            };
            match thread_kind(comm) {
                ThreadKind::Applier => s.applier_ticks += ticks,
                ThreadKind::Listener => s.listener_ticks += ticks,
                ThreadKind::Other => {}
            }
        }
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status_and_thread_stat() {
        assert_eq!(vm_rss_bytes("Name:\tx\nVmRSS:\t  2048 kB\n"), Some(2048 * 1024));
        assert_eq!(vm_rss_bytes("Name:\tx\n"), None);
        let stat = "42 (kv-w1 2-0) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15";
        assert_eq!(stat_comm(stat), Some("kv-w1 2-0"));
        assert_eq!(parse_stat_ticks(stat), Some(11 + 12));
        assert_eq!(thread_kind("kv-applier"), ThreadKind::Applier);
        assert_eq!(thread_kind("kv-w17-0"), ThreadKind::Listener);
        assert_eq!(thread_kind("tokio-runtime-w"), ThreadKind::Other);
    }
}
