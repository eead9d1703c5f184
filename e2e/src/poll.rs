//! Waiting for a condition with a deadline. Patience comes from `KVMESH_TEST_PATIENCE_S` so a slow CI
//! machine can be given more time without touching the tests.

use std::future::Future;
use std::time::{Duration, Instant};

/// Environment variable: seconds to wait for any one condition (default 30).
pub const PATIENCE_ENV: &str = "KVMESH_TEST_PATIENCE_S";

/// How long to wait for one condition.
pub fn patience() -> Duration {
    std::env::var(PATIENCE_ENV)
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .map_or(Duration::from_secs(30), Duration::from_secs_f64)
}

/// Polls `check` until it returns `Some`, or fails after [`patience`] with `what` in the error.
pub async fn until<T, F, Fut>(what: &str, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + patience();
    let mut delay = Duration::from_millis(5);
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            anyhow::bail!("timed out after {:?} waiting for {what}", patience());
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(200));
    }
}
