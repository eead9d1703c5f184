//! Unit tests of `crate::config`.

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
}

#[test]
fn full_config_round_trips() {
    let cfg = FilterConfig {
        indexer_cluster: "idx".into(),
        derive_session_keys: false,
        allow_overrides: true,
        debug_headers: true,
        background: Background::PerWorker,
        ..FilterConfig::default()
    };
    let json = serde_json::to_string(&cfg).unwrap();
    assert_eq!(parse(&json), Ok(cfg));
}

#[test]
fn session_header_is_lowercased() {
    assert_eq!(parse(r#"{"session_header":" X-Conversation "}"#).unwrap().session_header, "x-conversation");
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
        (r#"{"background":"sometimes"}"#, "unknown variant"),
        ("[1]", "invalid type"),
        ("{", "EOF"),
        (r#"{"session_prefix_units":4096}"#, "replaced by `derive_session_keys`"),
        (r#"{"derive_session_keys":1}"#, "invalid type"),
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
