//! The indexer's one clock and one source of randomness: every shell (the load-expiry ticker, the
//! scrape loop and its health tracking, the gauges' TTL sweeps, a route call's bookings and session
//! lookups) reads time through [`now`], and the service draws its randomness from the [`Entropy`]
//! it is started with, so tests can control both.
//!
//! Clock: [`now`] reads tokio's clock (`tokio::time::Instant::now`) and hands out the
//! `std::time::Instant` the pure modules take (`load`, `recent`, `speculative`, `approx`, `predict`
//! all get `now` passed in). In a normal build tokio's clock *is* `std::time::Instant::now()`. In a
//! test on a paused runtime (`#[tokio::test(start_paused = true)]`, tokio's `test-util`, a
//! dev-dependency only) it moves only by `tokio::time::advance` or when every task waits on a
//! timer, so a test can step the expiry ticker, TTLs and scrape timing by minutes without waiting.
//! Outside a runtime (the listener threads: the replay deadline) it is the system's monotonic
//! clock, which a paused test clock never runs behind. The applier thread reads no clock for the
//! approximate-mode TTL: blocks carry the route call's `now`, and the expiry ticker's pass sends
//! its `now` (`ApplierMsg::Expire`). Durations that only feed latency histograms, and the
//! applier's log and gauge throttles, keep `Instant::now()`: under a paused clock they would read 0.
//!
//! Randomness: [`Entropy::Os`] in production (a fresh booking-id nonce per process, an OS-seeded
//! tie-break RNG); [`Entropy::Seeded`] in tests, so a run's nonce and tie-breaks repeat.

use std::time::Instant;

use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

/// The current time on the indexer's clock (tokio's: paused in tests that pause it).
pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Where the service's randomness comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Entropy {
    /// The operating system's (production).
    #[default]
    Os,
    /// A fixed seed: the same nonce and tie-breaks on every run (tests).
    Seeded(u64),
}

impl Entropy {
    /// The RNG the service's decisions draw from (tie-breaks).
    pub fn rng(self) -> StdRng {
        match self {
            Self::Os => StdRng::from_entropy(),
            Self::Seeded(seed) => StdRng::seed_from_u64(seed),
        }
    }

    /// The nonce that keeps this process's booking ids apart from another process's.
    pub fn nonce(self) -> u32 {
        match self {
            Self::Os => rand::random(),
            // Drawn from a stream apart from `rng`'s, so the two do not mirror each other.
            Self::Seeded(seed) => StdRng::seed_from_u64(seed ^ 0x6e6f_6e63_6500_0000).next_u32(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rand::Rng;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn now_follows_a_paused_runtime_clock() {
        let t0 = now();
        tokio::time::advance(Duration::from_secs(600)).await;
        let moved = now().duration_since(t0);
        assert!(moved >= Duration::from_secs(600), "moved {moved:?}");
        assert!(moved < Duration::from_secs(601), "moved {moved:?}");
    }

    #[test]
    fn now_outside_a_runtime_is_monotonic() {
        let a = now();
        let b = now();
        assert!(b >= a);
    }

    #[test]
    fn a_seed_repeats_nonce_and_draws() {
        let (a, b) = (Entropy::Seeded(7), Entropy::Seeded(7));
        assert_eq!(a.nonce(), b.nonce());
        let draws = |e: Entropy| {
            let mut r = e.rng();
            (0..4).map(|_| r.gen::<u64>()).collect::<Vec<_>>()
        };
        assert_eq!(draws(a), draws(b));
        assert_ne!(draws(a), draws(Entropy::Seeded(8)));
        assert_ne!(a.nonce(), Entropy::Seeded(8).nonce());
    }
}
