//! A real client: the official `openai` Python package (installed by `make setup`) runs chat and
//! completions, streaming and not, through the gateway.

use kvmesh_e2e::procs::repo_root;
use kvmesh_e2e::stack::{Stack, StackSpec};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_openai_client_works_through_the_gateway() -> anyhow::Result<()> {
    let stack = Stack::start(StackSpec::aggregate(2)).await?;
    let python = repo_root().join(".tools/venv/bin/python");
    anyhow::ensure!(python.exists(), "{} missing: run `make setup`", python.display());
    let script = repo_root().join("e2e/tests/openai_client.py");
    let out =
        tokio::process::Command::new(python).arg(script).arg(stack.gateway("")).output().await?;
    assert!(
        out.status.success(),
        "openai client failed:\nstdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
