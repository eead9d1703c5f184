//! Reading an engine's Prometheus `/metrics`: the load and prefix-cache counters routing needs.
//!
//! Pure parsing of the text exposition (sums over label sets, so a DP engine's per-rank series add
//! up), plus the counter mirror that turns successive raw engine counter values into increments that
//! survive engine restarts (a value going down is a reset: the new value is the increment).

/// What one scrape says.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineSample {
    pub running: f64,
    pub waiting: f64,
    /// `vllm:prefix_cache_hits_total` (tokens), when exported.
    pub hits: Option<f64>,
    /// `vllm:prefix_cache_queries_total` (tokens), when exported.
    pub queries: Option<f64>,
    pub kv_usage: Option<f64>,
}

/// Parses the metrics routing reads from a vLLM-compatible exposition.
pub fn parse_engine_metrics(text: &str) -> EngineSample {
    let mut s = EngineSample::default();
    let mut old_hits = None;
    let mut old_queries = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => line.split_at(i),
            None => continue,
        };
        let value_part = match rest.strip_prefix('{') {
            Some(r) => r.rsplit_once('}').map_or("", |(_, v)| v),
            None => rest,
        };
        let Some(value) = value_part.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        if !value.is_finite() {
            continue;
        }
        let add = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0) + value);
        match name {
            "vllm:num_requests_running" => s.running += value,
            "vllm:num_requests_waiting" => s.waiting += value,
            "vllm:prefix_cache_hits_total" => add(&mut s.hits),
            "vllm:prefix_cache_queries_total" => add(&mut s.queries),
            "vllm:gpu_prefix_cache_hits_total" => add(&mut old_hits),
            "vllm:gpu_prefix_cache_queries_total" => add(&mut old_queries),
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => s.kv_usage = Some(s.kv_usage.unwrap_or(0.0).max(value)),
            _ => {}
        }
    }
    if s.hits.is_none() {
        s.hits = old_hits;
    }
    if s.queries.is_none() {
        s.queries = old_queries;
    }
    s
}

/// Turns raw engine counter values into increments since the first scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CounterMirror {
    last: Option<f64>,
}

impl CounterMirror {
    /// The increment since the previous value (0 on the first, the whole value after a reset).
    pub fn advance(&mut self, value: f64) -> f64 {
        let inc = match self.last {
            None => 0.0,
            Some(prev) if value >= prev => value - prev,
            Some(_) => value,
        };
        self.last = Some(value);
        inc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1200.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4000.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
garbage line
vllm:num_requests_waiting{weird="a}b"} 2
"#;

    #[test]
    fn parses_vllm_exposition() {
        let s = parse_engine_metrics(VLLM);
        assert_eq!(s.running, 5.0);
        assert_eq!(s.waiting, 3.0);
        assert_eq!(s.hits, Some(1200.0));
        assert_eq!(s.queries, Some(4000.0));
        assert_eq!(s.kv_usage, Some(0.5));
    }

    #[test]
    fn falls_back_to_deprecated_names_and_tolerates_absence() {
        let s = parse_engine_metrics("vllm:gpu_prefix_cache_hits_total 5\nvllm:gpu_prefix_cache_queries_total 10\n");
        assert_eq!((s.hits, s.queries), (Some(5.0), Some(10.0)));
        assert_eq!(parse_engine_metrics(""), EngineSample::default());
    }

    #[test]
    fn mirror_handles_resets() {
        let mut m = CounterMirror::default();
        assert_eq!(m.advance(100.0), 0.0);
        assert_eq!(m.advance(150.0), 50.0);
        assert_eq!(m.advance(20.0), 20.0);
        assert_eq!(m.advance(20.0), 0.0);
    }
}
