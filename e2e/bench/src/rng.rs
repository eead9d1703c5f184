//! A tiny deterministic PRNG (SplitMix64) owned by the bench crate.
//!
//! Workloads must be byte-for-byte reproducible across machines, runs and dependency upgrades:
//! the same trace line must become the same token ids, the same chat seed the same sessions.
//! `rand::StdRng` explicitly does not promise a stable stream across versions, so the generators
//! here use SplitMix64 (Steele, Lea, Flood 2014), which is fixed by its definition. The RNG is a
//! plain value passed into pure code; nothing reads a global generator.

/// SplitMix64 state. Cheap to copy; every generator that needs independence derives its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `lo..hi` (half-open). `hi <= lo` returns `lo`. Uses the multiply-shift
    /// reduction, whose bias is below 2^-32 for the small ranges used here.
    pub fn range_u64(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        let span = hi - lo;
        let r = ((u128::from(self.next_u64()) * u128::from(span)) >> 64) as u64;
        lo + r
    }

    /// A float in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// An exponentially distributed sample with the given mean (think times, arrivals).
    /// A non-positive mean yields 0.
    pub fn exp(&mut self, mean: f64) -> f64 {
        if mean <= 0.0 || !mean.is_finite() {
            return 0.0;
        }
        // 1 - u is in (0, 1], so ln never sees 0.
        -mean * (1.0 - self.next_f64()).ln()
    }
}

/// Mix two values into one seed (derive independent streams, e.g. per hash id or per session).
pub fn mix(a: u64, b: u64) -> u64 {
    let mut g = SplitMix64::new(a ^ b.rotate_left(32) ^ 0xD1B5_4A32_D192_ED03);
    g.next_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_vector() {
        // First outputs of SplitMix64 seeded with 1234567 (reference C implementation).
        let mut g = SplitMix64::new(1_234_567);
        assert_eq!(g.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(g.next_u64(), 3_203_168_211_198_807_973);
        assert_eq!(g.next_u64(), 9_817_491_932_198_370_423);
    }

    #[test]
    fn range_stays_in_bounds_and_covers() {
        let mut g = SplitMix64::new(7);
        let mut seen_lo = false;
        let mut seen_hi = false;
        for _ in 0..10_000 {
            let v = g.range_u64(10, 14);
            assert!((10..14).contains(&v));
            seen_lo |= v == 10;
            seen_hi |= v == 13;
        }
        assert!(seen_lo && seen_hi);
        assert_eq!(g.range_u64(5, 5), 5);
        assert_eq!(g.range_u64(6, 5), 6);
    }

    #[test]
    fn exp_has_roughly_the_requested_mean() {
        let mut g = SplitMix64::new(42);
        let n = 20_000;
        let mean = (0..n).map(|_| g.exp(100.0)).sum::<f64>() / f64::from(n);
        assert!((90.0..110.0).contains(&mean), "mean {mean}");
        assert_eq!(g.exp(0.0), 0.0);
        assert_eq!(g.exp(-1.0), 0.0);
    }

    #[test]
    fn mix_separates_streams() {
        assert_ne!(mix(1, 2), mix(2, 1));
        assert_eq!(mix(1, 2), mix(1, 2));
    }
}
