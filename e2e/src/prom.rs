//! Prometheus text exposition → samples, for tests, `make run` and the benchmark.
//!
//! The parser is the project's one ([`kvmesh_core::prom`], re-exported here): strict, so a line
//! that is not a sample is an error with its line number, not a guess. [`Metrics`] adds
//! label-matching sums for assertions.

pub use kvmesh_core::prom::{parse, sum, PromError, Sample};

/// A parsed exposition with label-matching lookups.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    pub samples: Vec<Sample>,
}

impl Metrics {
    pub fn parse(text: &str) -> Result<Self, PromError> {
        Ok(Self { samples: parse(text)? })
    }

    /// Sum of `name` over samples whose labels include every `(key, value)` in `matching`
    /// (0 when there is none).
    pub fn sum(&self, name: &str, matching: &[(&str, &str)]) -> f64 {
        self.select(name, matching).map(|s| s.value).sum()
    }

    /// Samples of `name` matching the labels.
    pub fn select<'a>(
        &'a self,
        name: &'a str,
        matching: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples
            .iter()
            .filter(move |s| s.name == name && matching.iter().all(|(k, v)| s.label(k) == Some(v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_sum_by_labels() {
        let m = Metrics::parse("a_total{model_name=\"m\",engine=\"0\"} 12\na_total{model_name=\"n\",engine=\"0\"} 3.5\nb 7\n").unwrap();
        assert_eq!(m.sum("a_total", &[]), 15.5);
        assert_eq!(m.sum("a_total", &[("model_name", "m")]), 12.0);
        assert_eq!(m.sum("b", &[]), 7.0);
        assert!(Metrics::parse("b 7\nnot a sample\n").is_err(), "tests read exporters strictly");
    }
}
