//! Waiting for a condition with a deadline: the one patience of every test that waits (the e2e
//! tests, the bench, and — as a dev-dependency — the indexer's, the discovery watcher's and the
//! simulator's integration tests). Patience comes from `KVMESH_TEST_PATIENCE_S` so a slow CI
//! machine can be given more time without touching the tests.

use std::future::Future;
use std::time::{Duration, Instant};

/// Environment variable: seconds to wait for any one condition (default [`DEFAULT_PATIENCE`]).
pub const PATIENCE_ENV: &str = "KVMESH_TEST_PATIENCE_S";

/// Patience when [`PATIENCE_ENV`] is unset or not a positive number of seconds: 60 s, the most
/// the harnesses it replaced allowed (30 s in some, 60 s in the indexer's, which start several
/// processes each loading the tokenizer on a shared 2-core machine).
pub const DEFAULT_PATIENCE: Duration = Duration::from_secs(60);

/// The patience a [`PATIENCE_ENV`] value gives (pure): positive seconds, fractions allowed.
pub fn patience_from(value: Option<&str>) -> Duration {
    value
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(DEFAULT_PATIENCE, Duration::from_secs_f64)
}

/// How long to wait for one condition.
pub fn patience() -> Duration {
    patience_from(std::env::var(PATIENCE_ENV).ok().as_deref())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patience_values() {
        let cases: &[(Option<&str>, Duration)] = &[
            (None, DEFAULT_PATIENCE),
            (Some("90"), Duration::from_secs(90)),
            (Some(" 2.5 "), Duration::from_millis(2500)),
            (Some("0"), DEFAULT_PATIENCE),
            (Some("-3"), DEFAULT_PATIENCE),
            (Some("inf"), DEFAULT_PATIENCE),
            (Some("soon"), DEFAULT_PATIENCE),
        ];
        for (value, want) in cases {
            assert_eq!(patience_from(*value), *want, "{value:?}");
        }
    }
}
