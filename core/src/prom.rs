//! The one Prometheus text-exposition parser: the indexer's engine scrape and every test and
//! benchmark that reads `/metrics` (engines, the indexer, Envoy's `/stats/prometheus`) go through it.
//!
//! Line-based, per the text format (version 0.0.4): `name{label="value",…} value [timestamp]`;
//! comments (`# HELP`, `# TYPE`) and blank lines carry no sample. Label values may hold escaped
//! quotes, commas and braces (`a="q\"u,o}te"`); values may be `NaN`, `+Inf`, `-Inf`; names may hold
//! colons (`vllm:num_requests_running`). vLLM's `_created` lines are ordinary samples (callers
//! look names up exactly, so they never add to a `_total`). Two entry points: [`parse`] refuses
//! the first line that is not a sample (tests: a broken exporter must fail loudly), and
//! [`parse_lossy`] skips such lines and counts them (the indexer: one odd line from an engine must
//! not blind routing to the rest of the scrape).
//!
//! A maintained crate was considered: `prometheus-parse` 0.3 matches names with `\w+` (no colons,
//! so no vLLM series), splits labels on `,`/`=` without honouring quotes, and brings regex and
//! chrono. Pure, no I/O.

use std::fmt;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name, including any `_total`/`_sum`/`_bucket`/`_created` suffix.
    pub name: String,
    /// Labels in the order written, values unescaped.
    pub labels: Vec<(String, String)>,
    /// The value (`NaN` and infinities included).
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, when present.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// A line that is not a sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub reason: String,
}

impl fmt::Display for PromError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "metrics line {}: {}", self.line, self.reason)
    }
}

impl std::error::Error for PromError {}

/// Every sample of `text`; the first line that is neither a sample, a comment nor blank is an error.
pub fn parse(text: &str) -> Result<Vec<Sample>, PromError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        if let Some(s) = parse_line(raw).map_err(|reason| PromError { line: i + 1, reason })? {
            out.push(s);
        }
    }
    Ok(out)
}

/// Every sample of `text`, skipping lines that are not samples; also how many were skipped.
pub fn parse_lossy(text: &str) -> (Vec<Sample>, usize) {
    parse_lossy_where(text, |_| true)
}

/// [`parse_lossy`] of the lines whose metric name `wanted` accepts; the others are passed over
/// unparsed (an engine's histogram buckets are most of its exposition, and a reader that sums
/// values by name needs none of them).
pub fn parse_lossy_where(text: &str, wanted: impl Fn(&str) -> bool) -> (Vec<Sample>, usize) {
    let mut out = Vec::new();
    let mut bad = 0;
    for raw in text.lines() {
        if metric_name(raw).is_some_and(|name| !wanted(name)) {
            continue;
        }
        match parse_line(raw) {
            Ok(Some(s)) => out.push(s),
            Ok(None) => {}
            Err(_) => bad += 1,
        }
    }
    (out, bad)
}

/// The metric name a sample line starts with (`None` for comments, blank lines and lines with
/// nothing after the name).
fn metric_name(raw: &str) -> Option<&str> {
    let line = raw.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    line.find(|c: char| c == '{' || c.is_whitespace()).map(|end| &line[..end])
}

/// One line: `Ok(None)` for a comment or a blank line, the reason when it is not a sample.
pub fn parse_line(raw: &str) -> Result<Option<Sample>, String> {
    let line = raw.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let name = metric_name(line).ok_or("no value")?;
    if name.is_empty() {
        return Err("empty metric name".into());
    }
    let mut rest = &line[name.len()..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, tail) = parse_labels(after)?;
        labels = parsed;
        rest = tail;
    }
    let value_text = rest.split_whitespace().next().ok_or("no value")?;
    let value = parse_value(value_text).ok_or_else(|| format!("bad value {value_text:?}"))?;
    Ok(Some(Sample { name: name.to_owned(), labels, value }))
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
        labels.push((key.trim().to_owned(), value));
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
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
        assert_eq!(s[1].name, "vllm:prefix_cache_queries_created");
        assert_eq!(sum(&s, "vllm:prefix_cache_hits_total"), Some(1536.0));
        assert_eq!(
            sum(&s, "vllm:prefix_cache_queries_total"),
            Some(4096.0),
            "_created is not added"
        );
        assert_eq!(sum(&s, "vllm:absent_total"), None);
    }

    #[test]
    fn line_table() {
        type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], f64);
        let cases: &[Case] = &[
            ("router_kv_overlap_blocks_total 12", "router_kv_overlap_blocks_total", &[], 12.0),
            ("a_total{} 1 1700000000000", "a_total", &[], 1.0),
            (r#"x{a="q\"uote",b="c,d"} 2.5"#, "x", &[("a", "q\"uote"), ("b", "c,d")], 2.5),
            (r#"x{weird="a}b"} 2"#, "x", &[("weird", "a}b")], 2.0),
            (r#"h_bucket{le="+Inf"} +Inf"#, "h_bucket", &[("le", "+Inf")], f64::INFINITY),
            (r#"x{a="1",} 3"#, "x", &[("a", "1")], 3.0),
            ("  y\t-Inf  ", "y", &[], f64::NEG_INFINITY),
            (
                r#"envoy_cluster_x{envoy_cluster_name="engines"} 7"#,
                "envoy_cluster_x",
                &[("envoy_cluster_name", "engines")],
                7.0,
            ),
        ];
        for (line, name, labels, value) in cases {
            let s = parse(line).unwrap();
            assert_eq!(s[0].name, *name, "{line}");
            let want: Vec<(String, String)> =
                labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            assert_eq!(s[0].labels, want, "{line}");
            assert_eq!(s[0].value, *value, "{line}");
        }
        assert!(parse("nan_metric NaN").unwrap()[0].value.is_nan());
    }

    #[test]
    fn bad_lines_are_errors_with_line_numbers_or_skipped() {
        for bad in
            ["x", "x{a=\"1\"", "x{a=1} 2", "x{a=\"1} 2", "x abc", "garbage line", "{a=\"1\"} 2"]
        {
            let err = parse(&format!("# ok\n{bad}\n")).unwrap_err();
            assert_eq!(err.line, 2, "{bad}");
            let (samples, skipped) = parse_lossy(&format!("# ok\nok_total 1\n{bad}\nok_total 2\n"));
            assert_eq!((sum(&samples, "ok_total"), skipped), (Some(3.0), 1), "{bad}");
        }
        assert_eq!(parse("x abc").unwrap_err().to_string(), "metrics line 1: bad value \"abc\"");
    }

    #[test]
    fn unwanted_names_are_passed_over_unparsed() {
        let text = format!("{VLLM}h_bucket{{le=\"1\" 2\nh_sum 3\nbroken abc\n");
        let wanted = |n: &str| !n.ends_with("_bucket") && !n.ends_with("_created");
        let (samples, skipped) = parse_lossy_where(&text, wanted);
        // The malformed bucket line is not read (not counted); a wanted malformed line is.
        assert_eq!(skipped, 1);
        let names: Vec<&str> = samples.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_hits_total",
                "vllm:prefix_cache_hits_total",
                "h_sum"
            ]
        );
        // Wanted lines parse exactly as `parse_lossy` parses them.
        let (all, _) = parse_lossy(&text);
        let kept: Vec<&Sample> = all.iter().filter(|s| wanted(&s.name)).collect();
        assert_eq!(samples.iter().collect::<Vec<_>>(), kept);
    }
}
