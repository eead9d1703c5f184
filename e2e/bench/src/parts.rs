//! A `kvmesh-bench` run's parts and how they make one report (pure).
//!
//! Each subcommand (`sweep`, `policies`, `overhead`, `aiperf`) runs one part and writes what it
//! would report alone — a [`RunManifest`] — to `<out>/parts/<part>.json` ([`PartResult`]), then
//! renders the report of that part. `kvmesh-bench report --parts a,b` renders one report from
//! several such files in the same `--out` ([`compose`]); a part alone composes to its own
//! manifest. The rules are the ones of the single binary that ran several parts in one process:
//! sections in part order (sweep, policies, overhead, aiperf); the policies replay, when present,
//! owns the header (workload, window, ceiling, speed-up, cache); otherwise the sweep's header
//! wins, then the overhead's title, workload and window; aiperf's header only when it is alone.

use crate::manifest::RunManifest;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The report's title when the policies replay is one of the parts.
pub const SIDE_BY_SIDE_TITLE: &str = "kvmesh routing policies, side by side";
/// Where the part files live, under `--out`.
pub const PARTS_DIR: &str = "parts";

/// One part of a run, in report order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Part {
    /// The load sweep: every workload × policy × rate.
    Sweep,
    /// One replay of the trace (or the chat workload) under every policy.
    Policies,
    /// The router overhead: kvmesh against the same Envoy without the filter.
    Overhead,
    /// NVIDIA's aiperf as the client of every policy's gateway.
    Aiperf,
}

impl Part {
    /// Every part, in report order.
    pub const ALL: [Part; 4] = [Part::Sweep, Part::Policies, Part::Overhead, Part::Aiperf];

    /// The subcommand's (and the part file's) name.
    pub fn name(self) -> &'static str {
        match self {
            Part::Sweep => "sweep",
            Part::Policies => "policies",
            Part::Overhead => "overhead",
            Part::Aiperf => "aiperf",
        }
    }

    /// Parses a comma-separated list of part names.
    pub fn parse_list(s: &str) -> Result<Vec<Part>, String> {
        let mut parts = Vec::new();
        for name in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let part = Part::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
                format!("unknown part {name:?} (sweep, policies, overhead, aiperf)")
            })?;
            if !parts.contains(&part) {
                parts.push(part);
            }
        }
        if parts.is_empty() {
            return Err("no part named".into());
        }
        Ok(parts)
    }

    /// `<out>/parts/<part>.json`.
    pub fn path(self, out: &Path) -> PathBuf {
        out.join(PARTS_DIR).join(format!("{}.json", self.name()))
    }
}

/// What one part produced: its manifest as it would be reported alone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartResult {
    pub part: Part,
    /// What ran (policies, points, overhead runs, aiperf policies); 0 means nothing.
    pub ran: usize,
    /// The command line that ran it.
    pub command: String,
    pub manifest: RunManifest,
}

/// One report from several parts (any order in, part order out) and how much ran in all.
/// `commands` starts with `make bench`, then each part's command line.
pub fn compose(parts: &[PartResult]) -> (RunManifest, usize) {
    let mut sorted: Vec<&PartResult> = parts.iter().collect();
    sorted.sort_by_key(|p| p.part);
    let has = |part: Part| sorted.iter().any(|p| p.part == part);
    let alone = sorted.len() == 1;
    let mut m = RunManifest {
        title: Some(SIDE_BY_SIDE_TITLE.into()),
        engine_block_size: sorted.iter().find_map(|p| p.manifest.engine_block_size),
        commands: std::iter::once("make bench".to_string())
            .chain(sorted.iter().map(|p| p.command.clone()))
            .collect(),
        ..RunManifest::default()
    };
    let mut ran = 0usize;
    for p in &sorted {
        let s = &p.manifest;
        ran += p.ran;
        m.extra_sections.extend(s.extra_sections.iter().cloned());
        match p.part {
            Part::Sweep | Part::Aiperf => {
                let leads = !has(Part::Policies) && (p.part == Part::Sweep || alone);
                if leads {
                    m.title.clone_from(&s.title);
                    m.workload.clone_from(&s.workload);
                    m.window.clone_from(&s.window);
                    m.workers.clone_from(&s.workers);
                    m.cache_capacity_blocks = s.cache_capacity_blocks;
                }
            }
            Part::Policies => {
                m.workload.clone_from(&s.workload);
                m.window.clone_from(&s.window);
                m.ceiling = s.ceiling;
                m.speedup = s.speedup;
                m.cache_capacity_blocks = s.cache_capacity_blocks;
                m.policies.extend(s.policies.iter().cloned());
            }
            Part::Overhead => {
                m.overhead.extend(s.overhead.iter().cloned());
                m.overhead_notes.clone_from(&s.overhead_notes);
                if !has(Part::Policies) {
                    m.title.clone_from(&s.title);
                    m.workload.clone_from(&s.workload);
                    m.window.clone_from(&s.window);
                }
            }
        }
        if m.workers.is_empty() {
            m.workers.clone_from(&s.workers);
        }
    }
    if m.cache_capacity_blocks.is_none() {
        m.cache_capacity_blocks = sorted.iter().find_map(|p| p.manifest.cache_capacity_blocks);
    }
    (m, ran)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{ExtraSection, OverheadCase, PolicyEntry};

    fn section(title: &str) -> ExtraSection {
        ExtraSection { title: title.into(), markdown: String::new() }
    }

    fn sweep() -> PartResult {
        PartResult {
            part: Part::Sweep,
            ran: 12,
            command: "kvmesh-bench sweep".into(),
            manifest: RunManifest {
                title: Some("kvmesh load sweep".into()),
                workload: Some("load sweep: trace".into()),
                window: Some("per point".into()),
                workers: vec!["w0".into(), "w1".into()],
                cache_capacity_blocks: Some(16_384),
                engine_block_size: Some(16),
                extra_sections: vec![section("Load sweep")],
                ..RunManifest::default()
            },
        }
    }

    fn overhead() -> PartResult {
        PartResult {
            part: Part::Overhead,
            ran: 1,
            command: "kvmesh-bench overhead".into(),
            manifest: RunManifest {
                title: Some("kvmesh router overhead".into()),
                workload: Some("router overhead only".into()),
                window: Some("no trace replay".into()),
                workers: (0..8).map(|i| format!("w{i}")).collect(),
                cache_capacity_blocks: Some(65_536),
                engine_block_size: Some(16),
                overhead: vec![OverheadCase { name: "chat_1k_cold".into(), ..Default::default() }],
                overhead_notes: Some("notes".into()),
                extra_sections: vec![section("Hung indexer")],
                ..RunManifest::default()
            },
        }
    }

    fn policies() -> PartResult {
        PartResult {
            part: Part::Policies,
            ran: 2,
            command: "kvmesh-bench policies".into(),
            manifest: RunManifest {
                title: Some(SIDE_BY_SIDE_TITLE.into()),
                workload: Some("Mooncake trace".into()),
                window: Some("first 200".into()),
                speedup: Some(50.0),
                workers: vec!["w0".into(), "w1".into()],
                cache_capacity_blocks: Some(4096),
                engine_block_size: Some(16),
                policies: vec![PolicyEntry { name: "round_robin".into(), ..Default::default() }],
                ..RunManifest::default()
            },
        }
    }

    #[test]
    fn a_part_alone_composes_to_its_own_manifest() {
        for p in [sweep(), overhead(), policies()] {
            let (m, ran) = compose(std::slice::from_ref(&p));
            let want = RunManifest {
                commands: vec!["make bench".into(), p.command.clone()],
                ..p.manifest.clone()
            };
            assert_eq!((m, ran), (want, p.ran), "{:?}", p.part);
        }
    }

    #[test]
    fn sweep_then_overhead_keeps_the_sweeps_fleet_and_the_overheads_title() {
        let (m, ran) = compose(&[overhead(), sweep()]);
        assert_eq!(ran, 13);
        assert_eq!(m.title.as_deref(), Some("kvmesh router overhead"));
        assert_eq!(m.workload.as_deref(), Some("router overhead only"));
        assert_eq!(m.workers.len(), 2, "the sweep's workers");
        assert_eq!(m.cache_capacity_blocks, Some(16_384), "the sweep's cache");
        assert_eq!(m.speedup, None);
        let titles: Vec<&str> = m.extra_sections.iter().map(|s| s.title.as_str()).collect();
        assert_eq!(titles, ["Load sweep", "Hung indexer"], "part order");
        assert_eq!(m.commands, ["make bench", "kvmesh-bench sweep", "kvmesh-bench overhead"]);
        assert_eq!(m.overhead.len(), 1);
    }

    #[test]
    fn the_policies_replay_owns_the_header() {
        let (m, _) = compose(&[policies(), overhead()]);
        assert_eq!(m.title.as_deref(), Some(SIDE_BY_SIDE_TITLE));
        assert_eq!(m.workload.as_deref(), Some("Mooncake trace"));
        assert_eq!((m.speedup, m.cache_capacity_blocks), (Some(50.0), Some(4096)));
        assert_eq!(m.workers.len(), 2);
        assert_eq!((m.policies.len(), m.overhead.len()), (1, 1));
    }

    #[test]
    fn part_lists_parse_in_any_order_without_repeats() {
        assert_eq!(
            Part::parse_list("overhead, sweep,overhead"),
            Ok(vec![Part::Overhead, Part::Sweep])
        );
        assert!(Part::parse_list("sweep,bogus").is_err());
        assert!(Part::parse_list(" , ").is_err());
        assert_eq!(Part::Overhead.path(Path::new("o")), Path::new("o/parts/overhead.json"));
    }
}
