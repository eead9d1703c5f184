//! Unit tests of `crate::request`.

use super::*;
use kvmesh_core::openai::parse;

fn pairs(list: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    list.iter().map(|(n, v)| ((*n).to_owned(), v.to_vec())).collect()
}

#[test]
fn reads_headers() {
    let head = RequestHead::from_headers(
        &pairs(&[
            (":method", b"POST"),
            (":path", b"/v1/chat/completions"),
            ("x-request-id", b" abc "),
            ("x-session-id", b"conv-1"),
            ("x-kvmesh-worker", b"w1"),
            ("x-kvmesh-mode", b""),
            ("content-length", b"12"),
            ("x-gateway-destination-endpoint", b"6.6.6.6:80"),
            ("x-kvmesh-override-secret", b" s\xff "),
        ]),
        "x-session-id",
    );
    assert_eq!(head.method, "POST");
    assert_eq!(head.request_id.as_deref(), Some("abc"));
    assert_eq!(head.session_id.as_deref(), Some("conv-1"));
    assert_eq!(head.override_worker.as_deref(), Some("w1"));
    assert_eq!(head.override_mode, None);
    assert!(head.has_content_length && head.client_destination && head.has_overrides());
    assert_eq!(head.destination.as_deref(), Some("6.6.6.6:80"));
    assert_eq!(
        head.override_secret.as_deref(),
        Some(&b" s\xff "[..]),
        "the secret is compared byte for byte, untrimmed"
    );
    assert!(head.sent_override_secret);
}

#[test]
fn override_trust_table() {
    let secret = b"0123456789abcdef".to_vec();
    let on = FilterConfig {
        allow_overrides: true,
        override_secret: String::from_utf8(secret.clone()).unwrap(),
        ..FilterConfig::default()
    };
    let off = FilterConfig::default();
    let overrides = RequestHead { override_mode: Some("disagg".into()), ..Default::default() };
    let with = |s: Option<&[u8]>| RequestHead {
        override_secret: s.map(<[u8]>::to_vec),
        sent_override_secret: true,
        ..overrides.clone()
    };
    let long = vec![b'a'; MAX_OVERRIDE_SECRET_BYTES + 1];
    let cases: Vec<(&FilterConfig, RequestHead, OverrideTrust)> = vec![
        (&on, RequestHead::default(), OverrideTrust::NoneSent),
        (
            &on,
            RequestHead {
                sent_override_secret: true,
                override_secret: Some(secret.clone()),
                ..Default::default()
            },
            OverrideTrust::NoneSent,
        ),
        (&on, with(Some(&secret)), OverrideTrust::Honoured),
        (&on, overrides.clone(), OverrideTrust::Refused(OverrideRefusal::NoSecret)),
        (&on, with(Some(b"0123456789abcdeF")), OverrideTrust::Refused(OverrideRefusal::BadSecret)),
        (&on, with(None), OverrideTrust::Refused(OverrideRefusal::BadSecret)),
        (&off, with(Some(&secret)), OverrideTrust::Refused(OverrideRefusal::Disabled)),
        (&off, overrides.clone(), OverrideTrust::Refused(OverrideRefusal::Disabled)),
    ];
    for (config, head, want) in cases {
        assert_eq!(override_trust(config, &head), want, "{head:?}");
    }
    let read = RequestHead::from_headers(
        &pairs(&[("x-kvmesh-mode", b"disagg"), ("x-kvmesh-override-secret", &long)]),
        "x-session-id",
    );
    assert_eq!(
        (read.sent_override_secret, read.override_secret.clone()),
        (true, None),
        "an over-long secret is kept as sent but unreadable"
    );
    assert_eq!(override_trust(&on, &read), OverrideTrust::Refused(OverrideRefusal::BadSecret));
}

#[test]
fn odd_values_do_not_break_reading() {
    let long = vec![b'a'; MAX_META_VALUE_BYTES + 1];
    let head = RequestHead::from_headers(
        &pairs(&[("x-session-id", &[0xff, 0xfe, b'x']), ("x-request-id", &long)]),
        "x-session-id",
    );
    assert_eq!(head.session_id.as_deref(), Some("\u{fffd}\u{fffd}x"));
    assert_eq!(head.request_id, None);
}

#[test]
fn session_header_wins_over_the_derived_key() {
    let req = parse(
        Endpoint::ChatCompletions,
        br#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"q"}]}"#,
    )
    .unwrap();
    let mut head = RequestHead::default();
    assert_eq!(session_key(&head, &req, false), None, "derivation off");
    let (k, s) = session_key(&head, &req, true).unwrap();
    assert_eq!(s, SessionSource::Prefix);
    assert_eq!(Some(k), session::derived_key(&req));
    head.session_id = Some("abc".into());
    let by_header = Some((session::from_header_value("abc"), SessionSource::Header));
    assert_eq!(session_key(&head, &req, true), by_header);
    assert_eq!(
        session_key(&head, &req, false),
        by_header,
        "an explicit id counts with derivation off"
    );
}

#[test]
fn completions_get_no_derived_key() {
    // Requests sharing a long prefix must not share a key: with none, overlap and load place them.
    let head = RequestHead::default();
    for body in [
        &br#"{"prompt":[1,2,3,4,5,6,7,8]}"#[..],
        br#"{"prompt":"a shared preamble and a question"}"#,
    ] {
        let req = parse(Endpoint::Completions, body).unwrap();
        assert_eq!(session_key(&head, &req, true), None);
    }
}

#[test]
fn route_call_carries_metadata_and_body() {
    let config = FilterConfig::default();
    let head = RequestHead {
        override_worker: Some("w9".into()),
        override_mode: Some("disagg".into()),
        ..Default::default()
    };
    let key = session::from_header_value("s");
    let call = route_call(
        &config,
        "rid",
        Endpoint::ChatCompletions,
        Some((key, SessionSource::Header)),
        &head,
        b"{}".to_vec().into(),
        None,
    );
    assert_eq!(call.upstream, "kvmesh_indexer");
    assert_eq!(call.header(":path"), Some("/v1/route"));
    assert_eq!(call.header(":method"), Some("POST"));
    assert_eq!(call.header(":authority"), Some("kvmesh-indexer"));
    assert_eq!(call.header("x-request-id"), Some("rid"));
    assert_eq!(call.header("x-kvmesh-path"), Some("/v1/chat/completions"));
    assert_eq!(
        call.header("x-kvmesh-session"),
        Some(session::encode_header(key, SessionSource::Header).as_str())
    );
    assert_eq!(call.header("content-length"), Some("2"));
    assert_eq!(call.header("x-kvmesh-worker"), None, "overrides are off by default");
    assert_eq!(call.body(), Some(&b"{}"[..]));
    assert_eq!(call.timeout_ms, 100);

    let config = FilterConfig {
        allow_overrides: true,
        override_secret: "0123456789abcdef".into(),
        ..config
    };
    let call =
        route_call(&config, "rid", Endpoint::Completions, None, &head, Default::default(), None);
    assert_eq!(
        call.header("x-kvmesh-worker"),
        None,
        "overrides on, but this request sent no secret"
    );
    let head = RequestHead {
        override_secret: Some(b"0123456789abcdef".to_vec()),
        sent_override_secret: true,
        ..head
    };
    let call =
        route_call(&config, "rid", Endpoint::Completions, None, &head, Default::default(), None);
    assert_eq!(call.header("x-kvmesh-worker"), Some("w9"));
    assert_eq!(call.header("x-kvmesh-mode"), Some("disagg"));
    assert_eq!(call.header("x-kvmesh-session"), None);
}

#[test]
fn a_route_call_after_a_body_base_sends_only_what_follows_it() {
    let config = FilterConfig::default();
    let body = br#"{"messages":[{"role":"user","content":"one"},{"role":"user","content":"two"}]}"#
        .to_vec();
    let base = kvmesh_core::body_base::BodyBase::of(9, &body[..44]);
    let call = route_call(
        &config,
        "rid",
        Endpoint::ChatCompletions,
        None,
        &RequestHead::default(),
        body.clone().into(),
        Some(base),
    );
    assert_eq!(call.body(), Some(&body[44..]));
    assert_eq!(call.header("content-length"), Some((body.len() - 44).to_string().as_str()));
    assert_eq!(call.header("x-kvmesh-body-base"), Some(base.to_string().as_str()));
    let whole = route_call(
        &config,
        "rid",
        Endpoint::ChatCompletions,
        None,
        &RequestHead::default(),
        body.clone().into(),
        None,
    );
    assert_eq!((whole.body(), whole.header("x-kvmesh-body-base")), (Some(&body[..]), None));
}

#[test]
fn background_calls() {
    let config = FilterConfig::default();
    let fleet = fleet_call(&config);
    assert_eq!(
        (fleet.header(":method"), fleet.header(":path"), fleet.body.is_none()),
        (Some("GET"), Some("/v1/fleet"), true)
    );
    let done = done_call(&config, b"{\"x\":1}".to_vec());
    assert_eq!(
        (done.header(":path"), done.header("content-type")),
        (Some("/v1/done"), Some("application/json"))
    );
    assert_eq!(done.timeout_ms, config.background_timeout_ms);
}
