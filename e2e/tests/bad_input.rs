//! Requests kvmesh cannot read still reach an engine, which answers them; oversized bodies get 413;
//! a client cannot steer itself with `x-gateway-destination-endpoint`; nothing crashes.

use kvmesh_core::api::ReasonCode;
use kvmesh_core::headers;
use kvmesh_e2e::client::{filler, post_json, post_raw};
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_requests_reach_an_engine_and_nothing_crashes() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(3);
    spec.filter_config = json!({"debug_headers": true});
    spec.max_body_bytes = 64 * 1024;
    let mut stack = Stack::start(spec).await?;
    let completions = stack.gateway("/v1/completions");
    let chat = stack.gateway("/v1/chat/completions");
    let c = stack.client().clone();

    let cases: Vec<(&str, &str, Vec<u8>, u16)> = vec![
        ("not json", completions.as_str(), b"this is not json".to_vec(), 400),
        (
            "truncated json",
            completions.as_str(),
            br#"{"model":"deepseek-v4","prompt":"hel"#.to_vec(),
            400,
        ),
        (
            "no prompt",
            completions.as_str(),
            br#"{"model":"deepseek-v4","max_tokens":3}"#.to_vec(),
            400,
        ),
        (
            "prompt of the wrong type",
            completions.as_str(),
            br#"{"model":"deepseek-v4","prompt":7}"#.to_vec(),
            400,
        ),
        (
            "messages of the wrong type",
            chat.as_str(),
            br#"{"model":"deepseek-v4","messages":"hi"}"#.to_vec(),
            400,
        ),
        (
            "max_tokens of the wrong type",
            chat.as_str(),
            br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":"many"}"#.to_vec(),
            400,
        ),
    ];
    for (what, url, body, want) in cases {
        let r = post_raw(&c, url, body, &[]).await?;
        assert_eq!(r.status, want, "{what}: {}", r.text);
        assert!(r.worker().is_some(), "{what}: answered by Envoy, not by an engine: {}", r.text);
        assert!(
            r.json().pointer("/error/message").is_some() || r.json().get("message").is_some(),
            "{what}: engine error JSON expected, got {}",
            r.text
        );
    }

    // An unknown path goes to an engine too.
    let r =
        post_raw(&c, &stack.gateway("/v1/embeddings"), br#"{"input":"x"}"#.to_vec(), &[]).await?;
    assert!(
        r.worker().is_some(),
        "unknown path not answered by an engine: {} {}",
        r.status,
        r.text
    );

    // Over the body limit: Envoy answers 413 itself.
    let big = json!({"model": "deepseek-v4", "prompt": "x ".repeat(64 * 1024)});
    let r = post_json(&c, &completions, &big, &[]).await?;
    assert_eq!(r.status, 413, "{}", r.text);

    // A client-sent destination header is stripped: the request goes where kvmesh decides.
    let spoof_target = stack.workers[0].http.clone();
    let mut steered_elsewhere = 0;
    for i in 0..12u64 {
        let body = json!({"model": "deepseek-v4", "prompt": filler(500 + i, 200), "max_tokens": 2});
        let r = post_json(
            &c,
            &completions,
            &body,
            &[(headers::DESTINATION_ENDPOINT, spoof_target.as_str())],
        )
        .await?;
        assert_eq!(r.status, 200, "{}", r.text);
        let decided = r.header(headers::DEBUG_WORKER).expect("decision worker header").to_owned();
        assert_eq!(
            r.worker(),
            Some(decided.as_str()),
            "served by {:?} but kvmesh chose {decided}",
            r.worker()
        );
        if decided != stack.workers[0].id {
            steered_elsewhere += 1;
        }
    }
    assert!(
        steered_elsewhere > 0,
        "every decision happened to pick the spoofed worker; the test proved nothing"
    );

    // Everyone is still up and a normal request works.
    assert!(stack.envoy.as_mut().is_some_and(|p| p.is_running()), "envoy died");
    assert!(stack.indexer.as_mut().is_some_and(|p| p.is_running()), "indexer died");
    let r = post_json(
        &c,
        &completions,
        &json!({"model": "deepseek-v4", "prompt": "hello", "max_tokens": 2}),
        &[],
    )
    .await?;
    assert_eq!(r.status, 200, "{}", r.text);
    Ok(())
}

/// The operator's override secret of the test below (16..=256 visible ASCII characters).
const OVERRIDE_SECRET: &str = "e2e-override-secret-0123456789";

/// Overrides count only from a request carrying the configured secret: without it (or with a
/// wrong one) `x-kvmesh-worker` is stripped and counted, and kvmesh decides; with it the indexer
/// pins the named worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_are_honoured_only_with_the_secret() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(3);
    spec.filter_config =
        json!({"debug_headers": true, "allow_overrides": true, "override_secret": OVERRIDE_SECRET});
    let stack = Stack::start(spec).await?;
    let completions = stack.gateway("/v1/completions");
    let c = stack.client().clone();
    let target = stack.workers[2].id.clone();

    // Untrusted: no secret, then a wrong one (same length, last byte differs).
    let wrong = format!("{}X", &OVERRIDE_SECRET[..OVERRIDE_SECRET.len() - 1]);
    let untrusted: [(&str, Option<&str>); 2] =
        [("no_secret", None), ("bad_secret", Some(wrong.as_str()))];
    const EACH: u64 = 6;
    for (n, (what, secret)) in untrusted.iter().enumerate() {
        for i in 0..EACH {
            let body = json!({"model": "deepseek-v4", "prompt": filler(700 + 10 * n as u64 + i, 120), "max_tokens": 2});
            let mut h = vec![(headers::OVERRIDE_WORKER, target.as_str())];
            if let Some(s) = secret {
                h.push((headers::OVERRIDE_SECRET, *s));
            }
            let r = post_json(&c, &completions, &body, &h).await?;
            assert_eq!(r.status, 200, "{what}: {}", r.text);
            let reason = r.header(headers::DEBUG_REASON).unwrap_or_default().to_owned();
            assert!(
                !r.reason_codes().contains(&ReasonCode::Override),
                "{what}: an untrusted override was honoured: {reason}"
            );
            assert!(
                !r.reason_codes().is_empty(),
                "{what}: the decision carries its codes: {reason}"
            );
            let decided =
                r.header(headers::DEBUG_WORKER).expect("decision worker header").to_owned();
            assert_eq!(
                r.worker(),
                Some(decided.as_str()),
                "{what}: served by {:?} but kvmesh chose {decided}",
                r.worker()
            );
        }
    }
    for (what, _) in untrusted {
        let want = EACH as f64;
        kvmesh_e2e::poll::until(
            &format!("kvmesh_filter_overrides_refused_total{{reason={what}}} = {want}"),
            || async {
                let m = stack.envoy_metrics().await.ok()?;
                (m.sum("kvmesh_filter_overrides_refused_total", &[("reason", what)]) == want)
                    .then_some(())
            },
        )
        .await?;
    }

    // Trusted: every worker can be pinned, whatever kvmesh would have chosen.
    for (i, w) in stack.workers.iter().enumerate() {
        let body =
            json!({"model": "deepseek-v4", "prompt": filler(800 + i as u64, 120), "max_tokens": 2});
        let h = [
            (headers::OVERRIDE_WORKER, w.id.as_str()),
            (headers::OVERRIDE_SECRET, OVERRIDE_SECRET),
        ];
        let r = post_json(&c, &completions, &body, &h).await?;
        assert_eq!(r.status, 200, "{}", r.text);
        let reason = r.header(headers::DEBUG_REASON).unwrap_or_default();
        assert_eq!(r.reason_codes().first(), Some(&ReasonCode::Override), "{}: {reason}", w.id);
        assert_eq!(
            r.worker(),
            Some(w.id.as_str()),
            "the trusted override to {} was not served there",
            w.id
        );
    }
    let m = stack.envoy_metrics().await?;
    assert_eq!(
        m.sum("kvmesh_filter_overrides_refused_total", &[]),
        2.0 * EACH as f64,
        "trusted overrides are not refusals"
    );
    Ok(())
}
