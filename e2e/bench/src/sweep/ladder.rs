//! Which rates to measure: round_robin's ladder, its saturation crossing, and every policy's
//! rates as fractions of it.

use serde::{Deserialize, Serialize};

/// round_robin saturates where its TTFT p90 exceeds this multiple of its light-load p90.
pub const SATURATION_FACTOR: f64 = 3.0;
/// The headline's load point, as a fraction of round_robin's saturation rate.
pub const LOAD_POINT_FRACTION: f64 = 0.8;

/// How a sweep chooses its rates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepConfig {
    /// First (light) rate of the round_robin ladder.
    pub start_rate: f64,
    /// Each ladder step multiplies the rate by this (> 1).
    pub factor: f64,
    /// Ladder steps at most (the light point included).
    pub max_steps: usize,
    /// Rates every policy is measured at, as fractions of the saturation rate; must contain
    /// [`LOAD_POINT_FRACTION`].
    pub fractions: Vec<f64>,
}

impl SweepConfig {
    /// Checks the bounds; the message names the offending setting.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.start_rate > 0.0 && self.start_rate.is_finite()) {
            return Err("--start-rate must be > 0".into());
        }
        if !(self.factor > 1.0 && self.factor.is_finite()) {
            return Err("--factor must be > 1".into());
        }
        if self.max_steps < 2 {
            return Err("--max-steps must be >= 2 (light load and one more)".into());
        }
        if !self.fractions.iter().any(|f| (f - LOAD_POINT_FRACTION).abs() < 1e-9) {
            return Err(format!("--fractions must contain the load point {LOAD_POINT_FRACTION}"));
        }
        if self.fractions.iter().any(|f| !(*f > 0.0 && f.is_finite())) {
            return Err("--fractions must be > 0".into());
        }
        Ok(())
    }
}

/// One measured `(rate, TTFT p90)` of round_robin, with its validity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RatePoint {
    /// Offered rate.
    pub rate: f64,
    /// TTFT p90, ms (`None`: nothing succeeded — counts as saturated).
    pub p90_ms: Option<f64>,
    /// Whether the point is valid.
    pub valid: bool,
}

/// Where round_robin saturates.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Saturation {
    /// The interpolated saturation rate.
    pub rate: f64,
    /// The light-load TTFT p90 it is measured against, ms.
    pub light_p90_ms: f64,
    /// True when fewer than two valid points existed and invalid ones were used.
    pub from_invalid_points: bool,
}

impl Saturation {
    /// The load point, [`LOAD_POINT_FRACTION`] × the saturation rate.
    pub fn load_point(&self) -> f64 {
        self.rate * LOAD_POINT_FRACTION
    }
}

pub(super) fn crossing(points: &[RatePoint]) -> Option<(f64, f64)> {
    let mut pts: Vec<RatePoint> = points.to_vec();
    pts.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    let light = pts.first()?.p90_ms?;
    let threshold = SATURATION_FACTOR * light;
    for w in 1..pts.len() {
        let (prev, cur) = (pts[w - 1], pts[w]);
        let over = cur.p90_ms.is_none_or(|p| p > threshold);
        if over {
            // Linear between the last point under the threshold and this one; a point with no
            // successful request is treated as saturated at its rate.
            let rate = match (prev.p90_ms, cur.p90_ms) {
                (Some(a), Some(b)) if b > a => {
                    prev.rate + (cur.rate - prev.rate) * ((threshold - a) / (b - a)).clamp(0.0, 1.0)
                }
                _ => cur.rate,
            };
            return Some((rate, light));
        }
    }
    None
}

/// round_robin's saturation rate from its measured points, or `None` when no point crossed.
pub fn saturation_rate(points: &[RatePoint]) -> Option<Saturation> {
    let valid: Vec<RatePoint> = points.iter().copied().filter(|p| p.valid).collect();
    if valid.len() >= 2 {
        if let Some((rate, light)) = crossing(&valid) {
            return Some(Saturation { rate, light_p90_ms: light, from_invalid_points: false });
        }
        if valid.len() == points.len() {
            return None;
        }
    }
    crossing(points).map(|(rate, light)| Saturation {
        rate,
        light_p90_ms: light,
        from_invalid_points: true,
    })
}

/// What the ladder does next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LadderStep {
    /// Measure round_robin at this rate.
    Measure(f64),
    /// Saturation found.
    Saturated(Saturation),
    /// The step bound was reached without crossing.
    GaveUp,
}

/// The next ladder step given round_robin's points so far (measured in ladder order).
pub fn next_ladder_rate(cfg: &SweepConfig, points: &[RatePoint]) -> LadderStep {
    if points.len() >= 2 {
        if let Some(s) = saturation_rate(points) {
            return LadderStep::Saturated(s);
        }
    }
    if points.len() >= cfg.max_steps {
        return LadderStep::GaveUp;
    }
    let last = points.iter().map(|p| p.rate).fold(0.0, f64::max);
    LadderStep::Measure(if points.is_empty() { cfg.start_rate } else { last * cfg.factor })
}

/// The rates every policy is measured at: the fractions of the saturation rate, ascending.
pub fn policy_rates(cfg: &SweepConfig, sat: &Saturation) -> Vec<f64> {
    let mut r: Vec<f64> = cfg.fractions.iter().map(|f| f * sat.rate).collect();
    r.sort_by(f64::total_cmp);
    r.dedup_by(|a, b| (*a - *b).abs() < 1e-9);
    r
}
