//! Unit tests of `crate::filter_config`.

use super::*;

fn parse(json: &str) -> Result<FilterConfig, ConfigError> {
    FilterConfig::from_bytes(Some(json.as_bytes()))
}

#[test]
fn empty_and_absent_mean_defaults() {
    assert_eq!(FilterConfig::from_bytes(None), Ok(FilterConfig::default()));
    assert_eq!(parse(""), Ok(FilterConfig::default()));
    assert_eq!(parse("  \n"), Ok(FilterConfig::default()));
    assert_eq!(parse("{}"), Ok(FilterConfig::default()));
    let d = FilterConfig::default();
    assert_eq!(d.indexer_cluster, "kvmesh_indexer");
    assert_eq!(d.indexer_timeout_ms, 100);
    assert_eq!(d.session_header, "x-session-id");
    assert!(d.derive_session_keys, "derived session keys are on by default");
    assert!(!d.allow_overrides && !d.debug_headers);
    assert_eq!(d.max_model_labels, 16);
    assert_eq!(d.held_body_budget_bytes, DEFAULT_HELD_BODY_BUDGET_BYTES);
    assert!(!d.defer_to_picker, "the wasm-only edge routes every request itself");
}

#[test]
fn deferring_to_a_picker_is_a_switch() {
    assert!(parse(r#"{"defer_to_picker":true}"#).unwrap().defer_to_picker);
    assert!(!parse(r#"{"defer_to_picker":false}"#).unwrap().defer_to_picker);
    let err = parse(r#"{"defer_to_picker":"yes"}"#).unwrap_err().to_string();
    assert!(err.contains("invalid type"), "{err}");
    let err = parse(r#"{"defer_to_pickers":true}"#).unwrap_err().to_string();
    assert!(err.contains("unknown field `defer_to_pickers`"), "{err}");
}

#[test]
fn model_labels_can_be_none_up_to_the_limit() {
    assert_eq!(parse(r#"{"max_model_labels":0}"#).unwrap().max_model_labels, 0);
    assert_eq!(parse(r#"{"max_model_labels":256}"#).unwrap().max_model_labels, 256);
}

#[test]
fn the_held_body_budget_may_equal_the_largest_body() {
    let cfg = parse(r#"{"max_body_bytes":8388608,"held_body_budget_bytes":8388608}"#).unwrap();
    assert_eq!(cfg.held_body_budget_bytes, cfg.max_body_bytes);
}

#[test]
fn full_config_round_trips() {
    let cfg = FilterConfig {
        indexer_cluster: "idx".into(),
        derive_session_keys: false,
        allow_overrides: true,
        override_secret: "0123456789abcdef-secret".into(),
        debug_headers: true,
        background: Background::PerWorker,
        local_route_max_body_bytes: 8192,
        max_model_labels: 3,
        defer_to_picker: true,
        ..FilterConfig::default()
    };
    let json = serde_json::to_string(&cfg).unwrap();
    assert_eq!(parse(&json), Ok(cfg));
}

#[test]
fn session_header_is_lowercased() {
    assert_eq!(
        parse(r#"{"session_header":" X-Conversation "}"#).unwrap().session_header,
        "x-conversation"
    );
}

#[test]
fn refusals_name_the_field() {
    let cases: &[(&str, &str)] = &[
        (r#"{"indexer_timout_ms":5}"#, "unknown field"),
        (r#"{"indexer_timeout_ms":"5"}"#, "invalid type"),
        (r#"{"indexer_timeout_ms":0}"#, "indexer_timeout_ms"),
        (r#"{"indexer_cluster":" "}"#, "indexer_cluster"),
        (r#"{"indexer_authority":"a b"}"#, "indexer_authority"),
        (r#"{"session_header":"x session"}"#, "session_header"),
        (r#"{"session_header":""}"#, "session_header"),
        (r#"{"session_header":"x-gateway-destination-endpoint"}"#, "session_header"),
        (r#"{"max_body_bytes":0}"#, "max_body_bytes"),
        (r#"{"fleet_refresh_ms":5}"#, "fleet_refresh_ms"),
        (r#"{"done_queue_capacity":0}"#, "done_queue_capacity"),
        (r#"{"done_max_in_flight":0}"#, "done_max_in_flight"),
        (r#"{"max_model_labels":257}"#, "max_model_labels"),
        (r#"{"max_model_labels":-1}"#, "invalid value"),
        (
            r#"{"max_body_bytes":4096,"local_route_max_body_bytes":4097}"#,
            "local_route_max_body_bytes",
        ),
        (r#"{"max_body_bytes":4096,"held_body_budget_bytes":4095}"#, "held_body_budget_bytes"),
        (r#"{"held_body_budget_bytes":4294967296}"#, "held_body_budget_bytes"),
        (r#"{"background":"sometimes"}"#, "unknown variant"),
        ("[1]", "invalid type"),
        ("{", "EOF"),
        (r#"{"session_prefix_units":4096}"#, "replaced by `derive_session_keys`"),
        (r#"{"derive_session_keys":1}"#, "invalid type"),
        (r#"{"allow_overrides":true}"#, "`allow_overrides`"),
        (r#"{"override_secret":"short"}"#, "`override_secret`"),
        (r#"{"override_secret":"has a space in it, 32 bytes long"}"#, "`override_secret`"),
        (r#"{"session_header":"x-kvmesh-override-secret"}"#, "session_header"),
        (r#"{"overide_secret":"0123456789abcdef"}"#, "unknown field `overide_secret`"),
    ];
    for (json, needle) in cases {
        let err = parse(json).unwrap_err().to_string();
        assert!(err.contains(needle), "{json}: {err}");
    }
    assert_eq!(FilterConfig::from_bytes(Some(&[0xff, 0xfe])), Err(ConfigError::NotUtf8));
}

#[test]
fn fleet_poll_can_be_off() {
    assert_eq!(parse(r#"{"fleet_refresh_ms":0}"#).unwrap().fleet_refresh_ms, 0);
}

#[test]
fn tick_period() {
    let cfg = FilterConfig::default();
    assert_eq!(cfg.tick_period_ms(false), Some(MAX_TICK_MS));
    let slow = FilterConfig { fleet_refresh_ms: 100, ..cfg.clone() };
    assert_eq!(slow.tick_period_ms(false), Some(100));
    assert_eq!(cfg.tick_period_ms(true), Some(20));
    let off = FilterConfig { fleet_refresh_ms: 0, ..cfg };
    assert_eq!(off.tick_period_ms(false), None);
    assert_eq!(off.tick_period_ms(true), Some(20));
}

const SECRET: &str = "0123456789abcdef-secret";

#[test]
fn an_override_secret_is_never_echoed_in_an_error() {
    let err = parse(r#"{"override_secret":"tiny secret!"}"#).unwrap_err().to_string();
    assert!(!err.contains("tiny"), "{err}");
    assert!(err.contains("12 bytes"), "{err}");
}

#[test]
fn overrides_are_trusted_only_with_the_configured_secret() {
    let on = parse(&format!(r#"{{"allow_overrides":true,"override_secret":"{SECRET}"}}"#)).unwrap();
    let cases: &[(Option<&[u8]>, bool)] = &[
        (Some(SECRET.as_bytes()), true),
        (None, false),
        (Some(b""), false),
        (Some(b"0123456789abcdef-secreT"), false),
        (Some(b"0123456789abcdef-secret-and-more"), false),
        (Some(b"0123456789abcdef-secre"), false),
    ];
    for (sent, want) in cases {
        assert_eq!(on.overrides_trusted(*sent), *want, "{sent:?}");
    }
    // A secret configured but overrides off: nothing is trusted.
    let off = FilterConfig { allow_overrides: false, ..on };
    assert!(!off.overrides_trusted(Some(SECRET.as_bytes())));
    assert!(!FilterConfig::default().overrides_trusted(Some(b"")));
}

#[test]
fn secret_comparison_is_equality() {
    let cases: &[(&[u8], &[u8], bool)] = &[
        (b"abc", b"abc", true),
        (b"", b"", true),
        (b"abd", b"abc", false),
        (b"ab", b"abc", false),
        (b"abcd", b"abc", false),
        (b"", b"abc", false),
        (b"abc", b"", false),
    ];
    for (sent, expected, want) in cases {
        assert_eq!(secret_matches(sent, expected), *want, "{sent:?} vs {expected:?}");
    }
}

#[test]
fn to_json_is_read_back_unchanged() {
    let cfg = FilterConfig { debug_headers: true, fleet_refresh_ms: 0, ..FilterConfig::default() };
    assert_eq!(parse(&cfg.to_json()), Ok(cfg));
    assert_eq!(DEFAULT_INDEXER_TIMEOUT_MS, FilterConfig::default().indexer_timeout_ms);
}
