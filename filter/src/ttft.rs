//! Time to first token as the gateway sees it, against the indexer's prediction.
//!
//! The indexer places a request where its predicted TTFT is lowest and says what it predicted
//! (`RouteDecision::predicted_ttft_ms`). Whether that model is calibrated is only visible where
//! the first token arrives, so the filter measures it: from the request's arrival at the filter
//! (its headers) to the first response body byte — for a streamed completion the first SSE event,
//! which vLLM sends with the first token. Non-streaming responses are not measured: their first
//! byte comes after the last token. Only 2xx responses count (an error body is not a token).
//!
//! Three histograms, recorded once per request at its first byte:
//! [`crate::metrics::TTFT`] (every measured request, decided by the indexer or not),
//! [`crate::metrics::TTFT_PREDICTED`] and [`crate::metrics::TTFT_RATIO`] (measured requests whose
//! decision carried a prediction). The ratio, actual / predicted in per-mille, is the calibration
//! an operator reads: its median near 1000 is a calibrated model, its spread the model's error.
//! The measurement includes the `/v1/route` round trip (`kvmesh_filter_route_latency_microseconds`),
//! which the prediction does not; at ≈ 1 ms it matters only for predictions of a few ms.

use crate::effects::Effect;
use crate::metrics::{Metric, MetricUpdate};

/// [`crate::metrics::TTFT_RATIO`] records `actual / predicted × RATIO_SCALE`.
pub const RATIO_SCALE: f64 = 1000.0;

/// Predictions below this many milliseconds count as this much in the ratio (a fully cached
/// request's prediction can be near zero; the ratio must stay finite and meaningful).
pub const MIN_RATIO_PREDICTION_MS: f64 = 1.0;

/// Largest recorded ratio (per-mille): 1000× slower than predicted.
pub const MAX_RATIO_PERMILLE: u64 = 1_000_000;

/// Largest accepted prediction, milliseconds (an hour); larger or non-finite ones are ignored.
pub const MAX_PREDICTION_MS: f64 = 3_600_000.0;

/// One request's TTFT measurement.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TtftProbe {
    arrived_ns: Option<u64>,
    stream: bool,
    predicted_ms: Option<f64>,
    measured: bool,
}

impl TtftProbe {
    /// The request's headers arrived at `now_ns`.
    pub fn arrived(&mut self, now_ns: u64) {
        self.arrived_ns = Some(now_ns);
    }

    /// The parsed request asks for a streamed response.
    pub fn set_stream(&mut self, stream: bool) {
        self.stream = stream;
    }

    /// The decision's prediction; a negative, non-finite or absurd value is ignored.
    pub fn set_prediction(&mut self, predicted_ms: Option<f64>) {
        self.predicted_ms =
            predicted_ms.filter(|p| p.is_finite() && (0.0..=MAX_PREDICTION_MS).contains(p));
    }

    /// The prediction as kept (for the debug header and tests).
    pub fn prediction(&self) -> Option<f64> {
        self.predicted_ms
    }

    /// Whether a response byte can still record the TTFT (a streamed request whose first byte has
    /// not come yet): the host reads its clock for a response chunk only then.
    pub fn pending(&self) -> bool {
        self.arrived_ns.is_some() && self.stream && !self.measured
    }

    /// Response body bytes arrived at `now_ns`; `status` is the response's. The first non-empty
    /// chunk of a streamed 2xx response records the histograms; everything else records nothing.
    pub fn on_response_bytes(
        &mut self,
        status: Option<u16>,
        bytes: usize,
        now_ns: u64,
    ) -> Vec<Effect> {
        let Some(arrived) = self.arrived_ns else { return Vec::new() };
        if self.measured
            || bytes == 0
            || !self.stream
            || !status.is_some_and(|s| (200..300).contains(&s))
        {
            return Vec::new();
        }
        self.measured = true;
        let actual_ms = now_ns.saturating_sub(arrived) as f64 / 1e6;
        let mut effects =
            vec![Effect::Metric(MetricUpdate::Record(Metric::Ttft, actual_ms.round() as u64))];
        if let Some(predicted) = self.predicted_ms {
            effects.push(Effect::Metric(MetricUpdate::Record(
                Metric::TtftPredicted,
                predicted.round() as u64,
            )));
            effects.push(Effect::Metric(MetricUpdate::Record(
                Metric::TtftRatio,
                ratio_permille(actual_ms, predicted),
            )));
        }
        effects
    }
}

/// `actual / max(predicted, MIN_RATIO_PREDICTION_MS)` in per-mille, at most [`MAX_RATIO_PERMILLE`].
pub fn ratio_permille(actual_ms: f64, predicted_ms: f64) -> u64 {
    let ratio = actual_ms.max(0.0) / predicted_ms.max(MIN_RATIO_PREDICTION_MS) * RATIO_SCALE;
    // `as` saturates; the min keeps the histogram's range sane.
    (ratio.round() as u64).min(MAX_RATIO_PERMILLE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recorded(effects: &[Effect]) -> Vec<(Metric, u64)> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Metric(MetricUpdate::Record(m, v)) => Some((*m, *v)),
                _ => None,
            })
            .collect()
    }

    fn probe(stream: bool, predicted: Option<f64>) -> TtftProbe {
        let mut p = TtftProbe::default();
        p.arrived(1_000_000);
        p.set_stream(stream);
        p.set_prediction(predicted);
        p
    }

    #[test]
    fn the_first_streamed_bytes_record_actual_predicted_and_ratio_once() {
        let mut p = probe(true, Some(40.0));
        assert!(
            p.on_response_bytes(Some(200), 0, 20_000_000).is_empty(),
            "an empty chunk is no token"
        );
        assert!(p.pending());
        let first = recorded(&p.on_response_bytes(Some(200), 120, 51_000_000));
        assert_eq!(
            first,
            vec![(Metric::Ttft, 50), (Metric::TtftPredicted, 40), (Metric::TtftRatio, 1250)]
        );
        assert!(!p.pending(), "measured: later chunks need no clock");
        assert!(p.on_response_bytes(Some(200), 80, 90_000_000).is_empty(), "once per request");
        assert!(!probe(false, None).pending(), "a non-streamed response is not measured");
        assert!(!TtftProbe::default().pending(), "no arrival time, nothing to measure");
    }

    #[test]
    fn what_is_not_measured() {
        let cases: &[(&str, TtftProbe, Option<u16>)] = &[
            ("not streamed", probe(false, Some(5.0)), Some(200)),
            ("error status", probe(true, Some(5.0)), Some(503)),
            ("no status", probe(true, Some(5.0)), None),
            ("never arrived", TtftProbe { stream: true, ..TtftProbe::default() }, Some(200)),
        ];
        for (what, p, status) in cases {
            assert!(p.clone().on_response_bytes(*status, 10, 9_000_000).is_empty(), "{what}");
        }
    }

    #[test]
    fn without_a_prediction_only_the_actual_ttft() {
        let mut p = probe(true, None);
        assert_eq!(
            recorded(&p.on_response_bytes(Some(200), 1, 4_400_000)),
            vec![(Metric::Ttft, 3)]
        );
    }

    #[test]
    fn odd_predictions_are_ignored_or_bounded() {
        for bad in [f64::NAN, f64::INFINITY, -1.0, MAX_PREDICTION_MS * 2.0] {
            assert_eq!(probe(true, Some(bad)).prediction(), None, "{bad}");
        }
        assert_eq!(ratio_permille(10.0, 0.0), 10_000, "tiny predictions count as 1 ms");
        assert_eq!(ratio_permille(1e12, 1.0), MAX_RATIO_PERMILLE);
        assert_eq!(ratio_permille(-5.0, 10.0), 0);
        assert_eq!(ratio_permille(100.0, 100.0), 1000);
    }

    #[test]
    fn a_clock_going_backwards_records_zero() {
        let mut p = probe(true, Some(2.0));
        assert_eq!(
            recorded(&p.on_response_bytes(Some(200), 1, 0)),
            vec![(Metric::Ttft, 0), (Metric::TtftPredicted, 2), (Metric::TtftRatio, 0)]
        );
    }
}
