//! A small reader of Prometheus text exposition, enough to sum a metric over label matches.

/// One sample: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// Parsed exposition text.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    pub samples: Vec<Sample>,
}

impl Metrics {
    pub fn parse(text: &str) -> Self {
        let samples = text.lines().filter_map(parse_line).collect();
        Self { samples }
    }

    /// Sum of `name` over samples whose labels include every `(key, value)` in `matching`.
    pub fn sum(&self, name: &str, matching: &[(&str, &str)]) -> f64 {
        self.select(name, matching).map(|s| s.value).sum()
    }

    /// Samples of `name` matching the labels.
    pub fn select<'a>(&'a self, name: &'a str, matching: &'a [(&'a str, &'a str)]) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples
            .iter()
            .filter(move |s| s.name == name && matching.iter().all(|(k, v)| s.label(k) == Some(v)))
    }

    pub fn has(&self, name: &str) -> bool {
        self.samples.iter().any(|s| s.name == name)
    }
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (head, value) = match line.find('{') {
        Some(open) => {
            let close = line.rfind('}')?;
            let name = &line[..open];
            let labels = parse_labels(&line[open + 1..close]);
            let value = line[close + 1..].split_whitespace().next()?;
            ((name.to_owned(), labels), value)
        }
        None => {
            let mut parts = line.split_whitespace();
            let name = parts.next()?;
            ((name.to_owned(), Vec::new()), parts.next()?)
        }
    };
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample { name: head.0, labels: head.1, value })
}

fn parse_labels(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim().trim_start_matches(',').trim().to_owned();
        let after = &rest[eq + 1..];
        let Some(after) = after.strip_prefix('"') else { break };
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(if n == 'n' { '\n' } else { n });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.push((key, value));
        rest = &after[end..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_and_values() {
        let m = Metrics::parse(
            "# HELP x y\n# TYPE a counter\na_total{model_name=\"m\",engine=\"0\"} 12\na_total{model_name=\"n\",engine=\"0\"} 3.5\nb 7\nc{x=\"a\\\"b\"} +Inf\n",
        );
        assert_eq!(m.sum("a_total", &[]), 15.5);
        assert_eq!(m.sum("a_total", &[("model_name", "m")]), 12.0);
        assert_eq!(m.sum("b", &[]), 7.0);
        assert_eq!(m.select("c", &[]).next().and_then(|s| s.label("x")), Some("a\"b"));
        assert!(!m.has("zz"));
    }
}
