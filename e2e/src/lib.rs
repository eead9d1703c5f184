//! kvmesh-e2e: start real kvmesh stacks on loopback and talk to them.
//!
//! Every test and benchmark that needs Envoy, the indexer and simulated workers goes through
//! [`stack::Stack`]: it starts the processes on free ports, waits for each to say it is ready,
//! writes one fleet description that both the indexer and the Envoy bootstrap are made from, and
//! kills everything it started when dropped — also when the test panics. Waiting is always polling
//! with a deadline ([`poll`]), never a fixed sleep.

pub mod client;
pub mod envoy_config;
pub mod manifests;
pub mod poll;
pub mod procs;
pub mod prom;
pub mod prometheus;
pub mod stack;
pub mod vllm;
pub mod worker;

/// Whether this run is CI's (`CI` set and not `false`/`0`, as CI systems and `.ci/run` set it).
pub fn in_ci() -> bool {
    ci_value(std::env::var("CI").ok().as_deref())
}

fn ci_value(v: Option<&str>) -> bool {
    v.is_some_and(|v| !matches!(v.trim(), "" | "0" | "false"))
}

/// A test whose prerequisite (`what`: an Envoy binary, the wasm filter) is missing: skipped with a
/// `SKIPPED` line on a developer's machine, an error in CI, where no test may pass by not running.
pub fn skip_or_fail_in_ci(what: &str) -> anyhow::Result<()> {
    if in_ci() {
        anyhow::bail!(
            "{what}: missing in CI, where every test must run (`make setup` installs it)"
        );
    }
    eprintln!("SKIPPED: {what}");
    Ok(())
}

#[cfg(test)]
mod ci_tests {
    #[test]
    fn ci_is_any_value_but_empty_zero_or_false() {
        for (v, want) in [
            (None, false),
            (Some(""), false),
            (Some("0"), false),
            (Some("false"), false),
            (Some("true"), true),
            (Some("1"), true),
        ] {
            assert_eq!(super::ci_value(v), want, "{v:?}");
        }
    }
}
