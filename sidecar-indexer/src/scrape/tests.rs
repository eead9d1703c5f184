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
    let s = parse_engine_metrics(
        "vllm:gpu_prefix_cache_hits_total 5\nvllm:gpu_prefix_cache_queries_total 10\n",
    );
    assert_eq!((s.hits, s.queries), (Some(5.0), Some(10.0)));
    assert_eq!(parse_engine_metrics(""), EngineSample::default());
}

#[test]
fn parses_the_timing_series() {
    let text = "vllm:prompt_tokens_total{engine=\"0\"} 5000\nvllm:request_prefill_time_seconds_sum{engine=\"0\"} 0.5\n\
vllm:request_prefill_time_seconds_count{engine=\"0\"} 3\nvllm:request_queue_time_seconds_sum 0.1\n\
vllm:time_to_first_token_seconds_sum 0.7\nvllm:time_per_output_token_seconds_sum 2\nvllm:time_per_output_token_seconds_count 100\n";
    let s = parse_engine_metrics(text);
    assert_eq!(
        (s.prompt_tokens, s.prefill_time_sum, s.queue_time_sum, s.ttft_sum),
        (Some(5000.0), Some(0.5), Some(0.1), Some(0.7))
    );
    assert_eq!((s.itl_sum, s.itl_count), (Some(2.0), Some(100.0)));
    let new = parse_engine_metrics("vllm:inter_token_latency_seconds_sum 1\nvllm:inter_token_latency_seconds_count 10\nvllm:time_per_output_token_seconds_sum 2\n");
    assert_eq!((new.itl_sum, new.itl_count), (Some(1.0), Some(10.0)));
}

fn sample(
    prompt: f64,
    hits: f64,
    prefill: Option<f64>,
    ttft: f64,
    queue: f64,
    itl: (f64, f64),
) -> EngineSample {
    EngineSample {
        prompt_tokens: Some(prompt),
        hits: Some(hits),
        prefill_time_sum: prefill,
        ttft_sum: Some(ttft),
        queue_time_sum: Some(queue),
        itl_sum: Some(itl.0),
        itl_count: Some(itl.1),
        ..EngineSample::default()
    }
}

/// A 60 s peak hold trusting windows of at least `min_tokens`.
fn hold(min_tokens: f64) -> MeterHold {
    MeterHold { min_tokens, hold: Duration::from_secs(60) }
}

#[test]
fn meter_reports_the_peak_of_its_hold_and_forgets_older_readings() {
    let t0 = Instant::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let mut m = PrefillMeter::default();
    let mut tokens = 0.0;
    let mut busy = 0.0;
    let mut feed = |m: &mut PrefillMeter, s: u64, tps: f64| {
        // 1 s intervals computing 4,000 tokens at `tps` (busy time 4000 / tps).
        tokens += 4000.0;
        busy += 4000.0 / tps;
        m.observe(&sample(tokens, 0.0, Some(busy), 0.0, 0.0, (0.0, 0.0)), at(s), hold(1.0));
    };
    m.observe(&sample(0.0, 0.0, Some(0.0), 0.0, 0.0, (0.0, 0.0)), at(0), hold(1.0));
    for s in 1..=20 {
        feed(&mut m, s, 20_000.0); // prefills one at a time: the true rate
    }
    assert_eq!(m.prefill_tokens_per_s().map(f64::round), Some(20_000.0));
    for s in 21..=70 {
        feed(&mut m, s, 5_000.0); // four prefills batched together: each counts the whole step
    }
    assert_eq!(
        m.prefill_tokens_per_s().map(f64::round),
        Some(20_000.0),
        "within the hold, overlapping prefills do not lower the rate"
    );
    for s in 71..=100 {
        feed(&mut m, s, 5_000.0);
    }
    assert_eq!(
        m.prefill_tokens_per_s().map(f64::round),
        Some(5_000.0),
        "a reading older than the hold is forgotten (the engine may really have slowed)"
    );
}

#[test]
fn meter_measures_computed_tokens_over_busy_time() {
    let t0 = Instant::now();
    let at = |ms| t0 + std::time::Duration::from_millis(ms);
    let mut m = PrefillMeter::default();
    m.observe(&sample(0.0, 0.0, Some(0.0), 0.0, 0.0, (0.0, 0.0)), at(0), hold(1.0));
    assert_eq!(m.window_rate(1.0), None, "one sample is no interval");
    // 12k prompt tokens, 2k of them cached: 10k computed in 0.4 s of prefill.
    m.observe(&sample(12_000.0, 2_000.0, Some(0.4), 9.0, 9.0, (1.0, 50.0)), at(500), hold(1.0));
    assert_eq!(m.window_rate(20_000.0), None, "not enough measured yet");
    assert_eq!(m.window_rate(4096.0), Some(25_000.0));
    assert_eq!(m.window_step(16.0), Some(0.02));
    // Overlapping prefills (sum 3.4 s in 1 s of wall time) are bounded by the wall time.
    m.observe(&sample(22_000.0, 2_000.0, Some(3.4), 9.0, 9.0, (1.0, 50.0)), at(1000), hold(1.0));
    assert_eq!(m.window_rate(1.0), Some(20_000.0));
    // A reset (engine restart) says nothing for that interval.
    m.observe(&sample(10.0, 0.0, Some(0.0), 0.0, 0.0, (0.0, 0.0)), at(1500), hold(1.0));
    assert_eq!(m.window_rate(1.0), Some(20_000.0));
}

#[test]
fn requests_that_prefilled_before_the_window_do_not_over_read() {
    // Two 20k-token requests prefilled one after the other at 20k tokens/s (2 s in all), then
    // decoded, and both finished within one 1 s interval: recorded at once, their prefill time
    // exceeds the interval's wall time, though nothing overlapped.
    let t0 = Instant::now();
    let mut m = PrefillMeter::default();
    let mut a = sample(0.0, 0.0, Some(0.0), 0.0, 0.0, (0.0, 0.0));
    (a.inference_time_sum, a.inference_count) = (Some(0.0), Some(0.0));
    let mut b = sample(40_000.0, 0.0, Some(2.0), 0.0, 0.0, (0.0, 0.0));
    (b.inference_time_sum, b.inference_count) = (Some(7.0), Some(2.0));
    m.observe(&a, t0, hold(1.0));
    m.observe(&b, t0 + Duration::from_secs(1), hold(1.0));
    assert_eq!(
        m.window_rate(1.0),
        Some(20_000.0),
        "bounded by 1 s + their mean 3.5 s, not by 1 s (40k)"
    );
    assert_eq!(parse_engine_metrics("vllm:request_inference_time_seconds_sum 7\nvllm:request_inference_time_seconds_count 2\n").inference_count, Some(2.0));
}

#[test]
fn a_prefill_straddling_scrapes_is_not_cut() {
    // 1500 tokens prefilled in 0.3 s, recorded in the second of two 0.2 s intervals.
    let t0 = Instant::now();
    let at = |ms| t0 + std::time::Duration::from_millis(ms);
    let mut m = PrefillMeter::default();
    m.observe(&sample(0.0, 0.0, Some(0.0), 0.0, 0.0, (0.0, 0.0)), at(0), hold(1.0));
    m.observe(&sample(0.0, 0.0, Some(0.0), 0.0, 0.0, (0.0, 0.0)), at(200), hold(1.0));
    m.observe(&sample(1500.0, 0.0, Some(0.3), 0.0, 0.0, (0.0, 0.0)), at(400), hold(1.0));
    assert_eq!(m.window_rate(1.0), Some(5000.0));
    // Idle scrapes push the measurement out of the window (it reaches back at most
    // MAX_WINDOW intervals); the last trusted one stays.
    for k in 3..(MAX_WINDOW as u64 + 10) {
        m.observe(&sample(1500.0, 0.0, Some(0.3), 0.0, 0.0, (0.0, 0.0)), at(200 * k), hold(1000.0));
    }
    assert_eq!((m.window_rate(1000.0), m.prefill_tokens_per_s()), (None, Some(5000.0)));
}

#[test]
fn a_slow_engine_is_measured_over_a_longer_window() {
    // 300 computed tokens per 500 ms interval in 0.1 s of prefill (3,000 tokens/s): 16
    // intervals hold 4,800 tokens, under the 8,192 a reading needs; the window reaches back
    // until it holds them (28 intervals), and a fast engine's window stays 16 intervals.
    let t0 = Instant::now();
    let at = |k: u64| t0 + Duration::from_millis(500 * k);
    let mut m = PrefillMeter::default();
    let fed = |m: &mut PrefillMeter, k: u64| {
        m.observe(
            &sample(300.0 * k as f64, 0.0, Some(0.1 * k as f64), 0.0, 0.0, (0.0, 0.0)),
            at(k),
            hold(8192.0),
        );
    };
    for k in 0..=16 {
        fed(&mut m, k);
    }
    assert_eq!(m.window_rate(8192.0), None, "16 intervals hold 4,800 tokens");
    for k in 17..=28 {
        fed(&mut m, k);
    }
    assert_eq!(m.window_rate(8192.0).map(f64::round), Some(3_000.0));
    assert_eq!(m.prefill_tokens_per_s().map(f64::round), Some(3_000.0));
    // A fast engine: the newest 16 intervals already hold enough, older ones do not count.
    let mut fast = PrefillMeter::default();
    for k in 0..=40u64 {
        let (tokens, busy) = if k <= 20 {
            (100.0 * k as f64, 0.1 * k as f64)
        } else {
            (2_000.0 + 1_000.0 * (k - 20) as f64, 2.0 + 0.05 * (k - 20) as f64)
        };
        fast.observe(&sample(tokens, 0.0, Some(busy), 0.0, 0.0, (0.0, 0.0)), at(k), hold(8192.0));
    }
    assert_eq!(
        fast.window_rate(8192.0).map(f64::round),
        Some(20_000.0),
        "the last 16 intervals only"
    );
}

#[test]
fn a_first_reading_stands_in_until_a_full_window() {
    // A slow engine: its first request, 2,600 tokens prefilled in 1.3 s (2,000 tokens/s,
    // warm-up included) within 2 s, then 600 tokens per 1 s interval in 0.2 s (3,000 tokens/s).
    let t0 = Instant::now();
    let at = |k: u64| t0 + Duration::from_secs(k);
    let mut m = PrefillMeter::default();
    let (mut tokens, mut busy) = (0.0, 0.0);
    m.observe(&sample(0.0, 0.0, Some(0.0), 0.0, 0.0, (0.0, 0.0)), at(0), hold(8192.0));
    assert_eq!(m.prefill_tokens_per_s(), None, "nothing measured");
    (tokens, busy) = (tokens + 2600.0, busy + 1.3);
    m.observe(&sample(tokens, 0.0, Some(busy), 0.0, 0.0, (0.0, 0.0)), at(2), hold(8192.0));
    assert_eq!(
        m.prefill_tokens_per_s().map(f64::round),
        Some(2_000.0),
        "one prompt of {FIRST_READING_MIN_TOKENS} tokens or more gives a first reading"
    );
    let mut k = 2;
    while m.window_rate(8192.0).is_none() {
        k += 1;
        (tokens, busy) = (tokens + 600.0, busy + 0.2);
        m.observe(&sample(tokens, 0.0, Some(busy), 0.0, 0.0, (0.0, 0.0)), at(k), hold(8192.0));
    }
    // The full window (first request included) replaces the first reading.
    let full = m.window_rate(8192.0);
    assert_eq!(m.prefill_tokens_per_s(), full);
    assert!(full.is_some_and(|r| r > 2_000.0 && r < 3_000.0), "{full:?}");
    // After a full reading, small windows never stand in again: a lower one, 1,200 tokens in
    // 1.2 s, after the hold forgot every reading, leaves the last full one.
    for j in 1..=70 {
        m.observe(&sample(tokens, 0.0, Some(busy), 0.0, 0.0, (0.0, 0.0)), at(k + j), hold(8192.0));
    }
    (tokens, busy) = (tokens + 1200.0, busy + 1.2);
    m.observe(&sample(tokens, 0.0, Some(busy), 0.0, 0.0, (0.0, 0.0)), at(k + 71), hold(8192.0));
    assert_eq!(m.prefill_tokens_per_s(), full);
    // A window under FIRST_READING_MIN_TOKENS gives no first reading.
    let mut fresh = PrefillMeter::default();
    fresh.observe(&sample(0.0, 0.0, Some(0.0), 0.0, 0.0, (0.0, 0.0)), at(0), hold(8192.0));
    fresh.observe(&sample(1000.0, 0.0, Some(0.5), 0.0, 0.0, (0.0, 0.0)), at(1), hold(8192.0));
    assert_eq!(fresh.prefill_tokens_per_s(), None);
}

#[test]
fn meter_prefers_the_per_request_computed_tokens() {
    let t0 = Instant::now();
    let mut m = PrefillMeter::default();
    let mut a = sample(0.0, 0.0, Some(0.0), 0.0, 0.0, (0.0, 0.0));
    a.kv_computed_sum = Some(0.0);
    a.prompt_tokens_cached = Some(0.0);
    let mut b = sample(9_000.0, 9_000.0, Some(0.3), 0.0, 0.0, (0.0, 0.0));
    b.kv_computed_sum = Some(6_000.0);
    b.prompt_tokens_cached = Some(1_000.0);
    m.observe(&a, t0, hold(1.0));
    m.observe(&b, t0 + std::time::Duration::from_secs(1), hold(1.0));
    assert_eq!(m.window_rate(1.0), Some(20_000.0));
    b.kv_computed_sum = None;
    let mut m = PrefillMeter::default();
    a.kv_computed_sum = None;
    m.observe(&a, t0, hold(1.0));
    m.observe(&b, t0 + std::time::Duration::from_secs(1), hold(1.0));
    assert_eq!(m.window_rate(1.0), Some(8_000.0 / 0.3), "prompt − cached");
}

#[test]
fn meter_falls_back_to_ttft_minus_queue_time() {
    let t0 = Instant::now();
    let mut m = PrefillMeter::default();
    m.observe(&sample(0.0, 0.0, None, 1.0, 0.5, (0.0, 0.0)), t0, hold(1.0));
    m.observe(
        &sample(8_000.0, 0.0, None, 1.6, 0.7, (0.0, 0.0)),
        t0 + std::time::Duration::from_secs(1),
        hold(1.0),
    );
    let tps = m.window_rate(1.0).unwrap();
    assert!((tps - 20_000.0).abs() < 1e-6, "{tps}");
    assert_eq!(m.window_step(1.0), None);
}

#[test]
fn mirror_handles_resets() {
    let mut m = CounterMirror::default();
    assert_eq!(m.advance(100.0), 0.0);
    assert_eq!(m.advance(150.0), 50.0);
    assert_eq!(m.advance(20.0), 20.0);
    assert_eq!(m.advance(20.0), 0.0);
}

/// A vLLM exposition with LoRA on (`--enable-lora --max-loras 2`), as its `/metrics` prints it: the
/// gauge is set to the current time under labels naming the adapters, so every state it went
/// through stays a series; the newest (largest value) is the current one — here the second line,
/// listed neither first nor last.
const VLLM_LORA: &str = r#"
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7886264546318772e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="adapter_ko,adapter_json",waiting_lora_adapters="adapter_sql"} 1.7886264577368872e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="adapter_json",waiting_lora_adapters="adapter_json"} 1.7886264547073758e+09
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"#;

#[test]
fn lora_info_is_the_newest_series() {
    let s = parse_engine_metrics(VLLM_LORA);
    assert_eq!(s.running, 3.0, "the rest of the sample is parsed as before");
    let lora = s.lora.expect("LoRA on");
    assert_eq!(
        lora,
        LoraInfo {
            max_lora: Some(2),
            running: vec!["adapter_ko".into(), "adapter_json".into()],
            waiting: vec!["adapter_sql".into()],
        }
    );
    assert!(lora.holds("adapter_sql") && lora.holds("adapter_ko") && !lora.holds("other"));
    // The series order does not matter: the largest value wins.
    let reversed: String = VLLM_LORA.lines().rev().map(|l| format!("{l}\n")).collect();
    assert_eq!(parse_engine_metrics(&reversed).lora, Some(lora));
}

#[test]
fn lora_info_edge_cases() {
    // No LoRA: no gauge (vLLM v1), or v0's `max_lora="0"`: unknown, not zero slots.
    assert_eq!(parse_engine_metrics("vllm:num_requests_running 1\n").lora, None);
    let v0 = r#"vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""} 1.0"#;
    assert_eq!(parse_engine_metrics(v0).lora, None);
    // Idle with LoRA on: known, nothing running.
    let idle = r#"vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} 5.0"#;
    assert_eq!(
        parse_engine_metrics(idle).lora,
        Some(LoraInfo { max_lora: Some(1), running: vec![], waiting: vec![] })
    );
    // No max_lora label (or not a number): the adapters are known, the slots are not. Names are
    // trimmed, empty ones and repeats dropped; the other label order parses the same.
    let odd =
        r#"vllm:lora_requests_info{waiting_lora_adapters="c",running_lora_adapters="a, b,,a"} 2"#;
    assert_eq!(
        parse_engine_metrics(odd).lora,
        Some(LoraInfo {
            max_lora: None,
            running: vec!["a".into(), "b".into()],
            waiting: vec!["c".into()]
        })
    );
    // A non-finite value is no series.
    let nan = r#"vllm:lora_requests_info{max_lora="1",running_lora_adapters="x",waiting_lora_adapters=""} NaN"#;
    assert_eq!(parse_engine_metrics(nan).lora, None);
    // Bounded: at most MAX_LORA_NAMES names per list.
    let many: Vec<String> = (0..MAX_LORA_NAMES + 10).map(|i| format!("a{i}")).collect();
    let big = format!(
        "vllm:lora_requests_info{{max_lora=\"4\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"\"}} 1\n",
        many.join(",")
    );
    assert_eq!(parse_engine_metrics(&big).lora.map(|l| l.running.len()), Some(MAX_LORA_NAMES));
}

#[test]
fn meter_measures_the_mean_request_lifetime() {
    let t0 = Instant::now();
    let mut m = PrefillMeter::default();
    let with_lifetime = |sum: f64, count: f64| EngineSample {
        inference_time_sum: Some(sum),
        inference_count: Some(count),
        ..sample(0.0, 0.0, Some(0.0), 0.0, 0.0, (0.0, 0.0))
    };
    m.observe(&with_lifetime(0.0, 0.0), t0, hold(1.0));
    // Three finished (below MIN_LIFETIME_SAMPLES): not trusted yet.
    m.observe(&with_lifetime(9.0, 3.0), t0 + Duration::from_secs(1), hold(1.0));
    assert_eq!(m.request_lifetime_s(), None);
    // Two more, 2 s each: 13 s over 5 requests.
    m.observe(&with_lifetime(13.0, 5.0), t0 + Duration::from_secs(2), hold(1.0));
    assert_eq!(m.request_lifetime_s(), Some(13.0 / 5.0));
}
