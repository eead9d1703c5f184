//! Prometheus text exposition → samples, for tests, `make run` and the benchmark (pure).
//!
//! Parsing is line-based and tolerant of what real exporters emit (comments, timestamps, escaped
//! label values, `NaN`/`+Inf`); a line that is not a sample is an error with its line number, not
//! a guess. [`Metrics`] adds label-matching sums for assertions.

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name, including any `_total`/`_sum`/`_bucket` suffix.
    pub name: String,
    /// Labels in the order written.
    pub labels: Vec<(String, String)>,
    /// The value.
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, when present.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// A line that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("metrics line {line}: {reason}")]
pub struct PromError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub reason: String,
}

/// Parses a whole exposition.
pub fn parse(text: &str) -> Result<Vec<Sample>, PromError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        out.push(parse_line(line).map_err(|reason| PromError { line: i + 1, reason })?);
    }
    Ok(out)
}

fn parse_line(line: &str) -> Result<Sample, String> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).ok_or("no value")?;
    let name = line[..name_end].to_string();
    if name.is_empty() {
        return Err("empty metric name".into());
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, tail) = parse_labels(after)?;
        labels = parsed;
        rest = tail;
    }
    let value_text = rest.split_whitespace().next().ok_or("no value")?;
    let value = parse_value(value_text).ok_or_else(|| format!("bad value {value_text:?}"))?;
    Ok(Sample { name, labels, value })
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

/// Label pairs in the order written.
type Labels = Vec<(String, String)>;

/// Parses `k="v",k2="v2"}` and returns the labels and the text after `}`.
fn parse_labels(s: &str) -> Result<(Labels, &str), String> {
    let mut labels = Vec::new();
    let mut chars = s.char_indices().peekable();
    loop {
        while chars.peek().is_some_and(|(_, c)| c.is_whitespace() || *c == ',') {
            chars.next();
        }
        match chars.peek() {
            Some(&(i, '}')) => return Ok((labels, &s[i + 1..])),
            None => return Err("unterminated labels".into()),
            _ => {}
        }
        let mut key = String::new();
        for (_, c) in chars.by_ref() {
            if c == '=' {
                break;
            }
            key.push(c);
        }
        if chars.next().map(|(_, c)| c) != Some('"') {
            return Err(format!("label {key:?} value is not quoted"));
        }
        let mut value = String::new();
        let mut closed = false;
        while let Some((_, c)) = chars.next() {
            match c {
                '\\' => match chars.next().map(|(_, c)| c) {
                    Some('n') => value.push('\n'),
                    Some(other) => value.push(other),
                    None => break,
                },
                '"' => {
                    closed = true;
                    break;
                }
                c => value.push(c),
            }
        }
        if !closed {
            return Err(format!("label {key:?} value is not terminated"));
        }
        labels.push((key.trim().to_string(), value));
    }
}

/// Sum of all samples named `name` (over every label set); `None` when there is none, so a
/// metric the exporter does not have is not mistaken for a zero.
pub fn sum(samples: &[Sample], name: &str) -> Option<f64> {
    let mut found = false;
    let mut total = 0.0;
    for s in samples.iter().filter(|s| s.name == name) {
        found = true;
        total += s.value;
    }
    found.then_some(total)
}

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
    pub fn select<'a>(&'a self, name: &'a str, matching: &'a [(&'a str, &'a str)]) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples
            .iter()
            .filter(move |s| s.name == name && matching.iter().all(|(k, v)| s.label(k) == Some(v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="deepseek"} 4096.0
vllm:prefix_cache_queries_created{engine="0",model_name="deepseek"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="deepseek"} 1024.0
vllm:prefix_cache_hits_total{engine="1",model_name="deepseek"} 512
"#;

    #[test]
    fn parses_vllm_counters() {
        let s = parse(VLLM).unwrap();
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].label("engine"), Some("0"));
        assert_eq!(sum(&s, "vllm:prefix_cache_hits_total"), Some(1536.0));
        assert_eq!(sum(&s, "vllm:prefix_cache_queries_total"), Some(4096.0));
        assert_eq!(sum(&s, "vllm:absent_total"), None);
    }

    #[test]
    fn line_table() {
        type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], f64);
        let cases: &[Case] = &[
            ("router_kv_overlap_blocks_total 12", "router_kv_overlap_blocks_total", &[], 12.0),
            ("a_total{} 1 1700000000000", "a_total", &[], 1.0),
            (r#"x{a="q\"uote",b="c,d"} 2.5"#, "x", &[("a", "q\"uote"), ("b", "c,d")], 2.5),
            (r#"h_bucket{le="+Inf"} +Inf"#, "h_bucket", &[("le", "+Inf")], f64::INFINITY),
            (r#"x{a="1",} 3"#, "x", &[("a", "1")], 3.0),
            (r#"envoy_cluster_x{envoy_cluster_name="engines"} 7"#, "envoy_cluster_x", &[("envoy_cluster_name", "engines")], 7.0),
        ];
        for (line, name, labels, value) in cases {
            let s = parse(line).unwrap();
            assert_eq!(s[0].name, *name, "{line}");
            let want: Vec<(String, String)> = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            assert_eq!(s[0].labels, want, "{line}");
            assert_eq!(s[0].value, *value, "{line}");
        }
        assert!(parse("nan_metric NaN").unwrap()[0].value.is_nan());
    }

    #[test]
    fn bad_lines_are_errors_with_line_numbers() {
        for bad in ["x", "x{a=\"1\"", "x{a=1} 2", "x{a=\"1} 2", "x abc"] {
            let err = parse(&format!("# ok\n{bad}\n")).unwrap_err();
            assert_eq!(err.line, 2, "{bad}");
        }
    }

    #[test]
    fn metrics_sum_by_labels() {
        let m = Metrics::parse("a_total{model_name=\"m\",engine=\"0\"} 12\na_total{model_name=\"n\",engine=\"0\"} 3.5\nb 7\n").unwrap();
        assert_eq!(m.sum("a_total", &[]), 15.5);
        assert_eq!(m.sum("a_total", &[("model_name", "m")]), 12.0);
        assert_eq!(m.sum("b", &[]), 7.0);
    }
}
