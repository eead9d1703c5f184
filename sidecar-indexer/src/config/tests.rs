//! Unit tests of the configuration: parsing, overrides, validation, warnings and the shipped fleets.

use super::*;
use kvmesh_core::api::Role;

const FLEET: &str = r#"
listen = "127.0.0.1:9100"
[model]
name = "deepseek-v4"
block_size = 16
[gateway]
listen = "127.0.0.1:8080"
admin = "127.0.0.1:9901"
cluster = "engines"
[routing]
mode = "precise"
overlap_credit = 1.5
[[workers]]
id = "w0"
role = "decode"
endpoint = "127.0.0.1:8100"
kv_events = "tcp://127.0.0.1:5557"
kv_replay = "tcp://127.0.0.1:5558"
dp_ranks = 2
[[workers]]
id = "p0"
role = "prefill"
endpoint = "127.0.0.1:8200"
"#;

fn env<const N: usize>(pairs: [(&str, &str); N]) -> MapEnv {
    MapEnv::new(pairs)
}

#[test]
fn parses_the_contract_example() {
    let c = Config::from_toml_str(FLEET, &env([])).unwrap();
    assert_eq!(c.listen, "127.0.0.1:9100");
    assert_eq!(c.model().block_size, 16);
    assert_eq!(c.gateway.listen.as_deref(), Some("127.0.0.1:8080"));
    assert_eq!(c.gateway.extra.get("cluster").and_then(|v| v.as_str()), Some("engines"));
    assert_eq!(c.routing.overlap_credit, 1.5);
    assert_eq!(c.routing.prefill_load_scale, 1.0);
    assert_eq!(c.workers.len(), 2);
    assert_eq!(c.workers[0].events_endpoint(1).as_deref(), Some("tcp://127.0.0.1:5558"));
    assert_eq!(c.workers[0].replay_endpoint(1).as_deref(), Some("tcp://127.0.0.1:5559"));
    assert_eq!(c.workers[1].role, Role::Prefill);
    assert_eq!(c.workers[1].dp_ranks, 1);
}

#[test]
fn env_overrides_file_values_with_typing() {
    let e = env([
        ("KVMESH_LISTEN", "127.0.0.1:0"),
        ("KVMESH_MODEL_NAME", "123"),
        ("KVMESH_ROUTING_TEMPERATURE", "0.5"),
        ("KVMESH_ROUTING_MODE", "approximate"),
        ("KVMESH_ROUTING_MAX_FALLBACKS", "4"),
        ("KVMESH_TOKENIZER", "/elsewhere"), // another tool's variable: ignored here
    ]);
    let c = Config::from_toml_str(FLEET, &e).unwrap();
    assert_eq!(c.listen, "127.0.0.1:0");
    assert_eq!(c.model().name, "123");
    assert_eq!(c.routing.temperature, 0.5);
    assert_eq!(c.routing.mode, IndexMode::Approximate);
    assert_eq!(c.routing.max_fallbacks, 4);
}

#[test]
fn bad_env_values_are_named() {
    let err =
        Config::from_toml_str(FLEET, &env([("KVMESH_ROUTING_MAX_FALLBACKS", "many")])).unwrap_err();
    assert!(
        matches!(err, ConfigError::Env { ref var, .. } if var == "KVMESH_ROUTING_MAX_FALLBACKS"),
        "{err}"
    );
    let err =
        Config::from_toml_str(FLEET, &env([("KVMESH_ROUTING_NO_SUCH_KNOB", "1")])).unwrap_err();
    assert!(err.to_string().contains("no_such_knob"), "{err}");
}

#[test]
fn placement_knobs_are_validated_and_superseded_ones_warn() {
    let base = "listen = \"127.0.0.1:9100\"\n[model]\nname = \"m\"\nblock_size = 16\n[routing]\n";
    let load = |routing: &str| Config::from_toml_str(&format!("{base}{routing}\n"), &env([]));
    // (routing lines, the field refused)
    let refused = [
        ("prefill_tokens_per_s = 0.0", "routing.prefill_tokens_per_s"),
        ("prefill_tokens_per_s = 50.0", "routing.prefill_tokens_per_s"), // below the clamp's minimum
        ("prefill_tokens_per_s_max = 1000.0", "routing.prefill_tokens_per_s"),
        ("session_move_margin_ms = -1.0", "routing.session_move_margin_ms"),
        ("near_tie_fraction = inf", "routing.near_tie_fraction"),
        ("prefill_chunk_tokens = 0", "routing.prefill_chunk_tokens"),
        ("speculative_max_blocks_per_worker = 0", "routing.speculative_max_blocks_per_worker"),
    ];
    for (routing, want) in refused {
        match load(routing) {
            Err(ConfigError::InvalidValue { field, .. }) => assert_eq!(field, want, "{routing}"),
            other => panic!("{routing}: expected InvalidValue, got {other:?}"),
        }
    }
    let c = load("speculative_ttl_ms = 0\nsession_placement = \"rendezvous\"").unwrap();
    assert_eq!(
        (c.routing.speculative_ttl_ms, c.routing.session_placement),
        (0, SessionPlacement::Rendezvous)
    );
    assert!(c.warnings().is_empty());
    assert_eq!(load("").unwrap().routing.session_placement, SessionPlacement::Predicted);
    let old = load("session_placement = \"sticky\"\noverlap_credit = 2.0").unwrap();
    assert_eq!(old.warnings().len(), 2, "{:?}", old.warnings());
    assert!(old.warnings()[0].contains("deprecated"), "{:?}", old.warnings());
}

#[test]
fn invalid_values_are_refused_with_field_and_reason() {
    let cases: &[(&str, &str, &str)] = &[
        ("block_size = 16", "block_size = 0", "model.block_size"),
        ("listen = \"127.0.0.1:9100\"", "listen = \"nowhere\"", "listen"),
        ("endpoint = \"127.0.0.1:8100\"", "endpoint = \"localhost\"", "workers[0].endpoint"),
        ("id = \"p0\"", "id = \"w0\"", "workers[1].id"),
        ("dp_ranks = 2", "dp_ranks = 0", "workers[0].dp_ranks"),
        ("kv_events = \"tcp://127.0.0.1:5557\"", "kv_events = \"udp://x\"", "workers[0].kv_events"),
        ("overlap_credit = 1.5", "overlap_credit = -1.0", "routing.overlap_credit"),
        (
            "mode = \"precise\"",
            "mode = \"precise\"\nindex_max_entries = 0",
            "routing.index_max_entries",
        ),
    ];
    for (from, to, want_field) in cases {
        let text = FLEET.replacen(from, to, 1);
        match Config::from_toml_str(&text, &env([])) {
            Err(ConfigError::InvalidValue { field, .. }) => {
                assert_eq!(&field, want_field, "{to}")
            }
            other => panic!("{to}: expected InvalidValue, got {other:?}"),
        }
    }
}

#[test]
fn unknown_keys_are_errors_but_gateway_is_open() {
    let err = Config::from_toml_str(&FLEET.replace("overlap_credit", "overlap_credt"), &env([]))
        .unwrap_err();
    assert!(matches!(err, ConfigError::Parse(_)));
    let with_filter = format!("{FLEET}\n[filter]\nsession_header = \"x-conversation\"\n");
    let c = Config::from_toml_str(&with_filter, &env([])).unwrap();
    assert_eq!(c.filter.session_header, "x-conversation");
    assert_eq!(
        c.filter.indexer_timeout_ms,
        kvmesh_core::filter_config::DEFAULT_INDEXER_TIMEOUT_MS,
        "the filter's own default"
    );
}

#[test]
fn the_filter_table_is_checked_by_the_filter_config() {
    // (table lines, what the error must name)
    let cases = [
        ("indexer_timout_ms = 5", "indexer_timout_ms"),
        ("debug_headers = \"yes\"", "debug_headers"),
        ("indexer_timeout_ms = 0", "filter.indexer_timeout_ms"),
        ("session_header = \"x-kvmesh-worker\"", "filter.session_header"),
        ("allow_overrides = true", "filter.allow_overrides"),
        ("override_secret = \"short\"", "filter.override_secret"),
        ("background = \"sometimes\"", "sometimes"),
    ];
    for (lines, needle) in cases {
        let err = Config::from_toml_str(&format!("{FLEET}\n[filter]\n{lines}\n"), &env([]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{lines}: {err}");
        assert!(!err.contains("short\""), "the secret is never echoed: {err}");
    }
    let secret = "0123456789abcdef-fleet";
    let ok = format!("{FLEET}\n[filter]\nallow_overrides = true\noverride_secret = \"{secret}\"\n");
    let c = Config::from_toml_str(&ok, &env([])).unwrap();
    assert_eq!(c.filter.override_secret, secret);
    let printed = toml::to_string_pretty(&c).unwrap();
    assert!(!printed.contains(secret) && printed.contains("(redacted)"), "{printed}");
}

#[test]
fn yaml_has_the_same_keys() {
    let yaml = "listen: 127.0.0.1:9100\nmodel: {name: m, block_size: 32}\nworkers:\n  - {id: a, role: both, endpoint: '127.0.0.1:1'}\n";
    let c = Config::from_yaml_str(yaml, &env([])).unwrap();
    assert_eq!(c.model().block_size, 32);
    assert_eq!(c.workers[0].role, Role::Both);
}

#[test]
fn load_reads_files_by_extension() {
    let dir = tempfile::tempdir().unwrap();
    let toml_path = dir.path().join("fleet.toml");
    std::fs::write(&toml_path, FLEET).unwrap();
    assert_eq!(Config::load(&toml_path, &env([])).unwrap().workers.len(), 2);
    let missing = Config::load(&dir.path().join("nope.toml"), &env([])).unwrap_err();
    assert!(matches!(missing, ConfigError::Io { .. }));
}

#[test]
fn the_shipped_fleets_load_without_warnings() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../envoy/fleets");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let c =
                Config::load(&path, &env([])).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(c.warnings(), Vec::<String>::new(), "{}", path.display());
            seen += 1;
        }
    }
    assert!(seen >= 2, "expected local.toml and disagg.toml in {}", dir.display());
}

#[test]
fn leg_deadlines_are_checked_against_the_filter_and_the_api() {
    let base = "listen = \"127.0.0.1:9100\"\n[model]\nname = \"m\"\nblock_size = 16\n";
    let with = |routing: &str, filter: &str| {
        Config::from_toml_str(
            &format!("{base}[routing]\n{routing}\n[filter]\n{filter}\n"),
            &env([]),
        )
    };
    let c = with("min_remote_prefill_tokens = 1", "").unwrap();
    assert_eq!(
        c.warnings().len(),
        1,
        "the filter's 100 ms default cannot cover a 10 s prefill leg"
    );
    assert!(with("min_remote_prefill_tokens = 1", "indexer_timeout_ms = 12000")
        .unwrap()
        .warnings()
        .is_empty());
    let migration =
        with("kv_migration = \"on\"\nkv_migration_timeout_ms = 500", "indexer_timeout_ms = 400")
            .unwrap();
    assert!(
        migration.warnings()[0].contains("routing.kv_migration_timeout_ms 500"),
        "{:?}",
        migration.warnings()
    );
    assert_eq!(with("local_continuations = true", "").unwrap().warnings().len(), 1);
    let too_long =
        with("min_remote_prefill_tokens = 1\nprefill_timeout_ms = 20000", "").unwrap_err();
    assert!(too_long.to_string().contains("routing.prefill_timeout_ms"), "{too_long}");
    let bad_mode = with("kv_migration = \"sometimes\"", "").unwrap_err();
    assert!(matches!(bad_mode, ConfigError::Parse(_)), "{bad_mode}");
}

#[test]
fn offsets_follow_vllm() {
    assert_eq!(offset_endpoint("tcp://10.0.0.1:5557", 3).as_deref(), Some("tcp://10.0.0.1:5560"));
    assert_eq!(offset_endpoint("ipc:///tmp/ev", 1).as_deref(), Some("ipc:///tmp/ev_dp1"));
    assert_eq!(offset_endpoint("tcp://h:65535", 1), None);
    assert_eq!(offset_endpoint("tcp://h:x", 0).as_deref(), Some("tcp://h:x"));
}

const MULTI: &str = r#"
listen = "127.0.0.1:9100"
[[models]]
name = "deepseek-v4"
aliases = ["ds4"]
block_size = 16
adapters = ["ds4-sql", "ds4-chat"]
[[models]]
name = "small-chat"
block_size = 32
[[workers]]
id = "w0"
model = "deepseek-v4"
role = "both"
endpoint = "127.0.0.1:8100"
[[workers]]
id = "w1"
model = "small-chat"
role = "both"
endpoint = "127.0.0.1:8101"
[[workers]]
id = "w2"
role = "decode"
endpoint = "127.0.0.1:8102"
"#;

#[test]
fn several_models_parse_and_workers_default_to_the_first() {
    let c = Config::from_toml_str(MULTI, &env([])).unwrap();
    let names: Vec<_> = c.models.iter().map(|m| (m.name.as_str(), m.block_size)).collect();
    assert_eq!(names, vec![("deepseek-v4", 16), ("small-chat", 32)]);
    assert_eq!(c.model().name, "deepseek-v4");
    assert_eq!(c.models[0].aliases, vec!["ds4"]);
    assert_eq!(c.models[0].adapters, vec!["ds4-sql", "ds4-chat"]);
    let served: Vec<_> = c.workers.iter().map(|w| c.worker_model(w)).collect();
    assert_eq!(served, vec!["deepseek-v4", "small-chat", "deepseek-v4"]);
    // The single form is the same shape: one entry in `models`.
    let single = Config::from_toml_str(FLEET, &env([])).unwrap();
    assert_eq!(single.models.len(), 1);
    assert_eq!(single.worker_model(&single.workers[0]), "deepseek-v4");
    // What --check prints parses back to the same configuration.
    let printed = toml::to_string(&c).unwrap();
    assert_eq!(Config::from_toml_str(&printed, &env([])).unwrap(), c);
}

#[test]
fn model_overrides_apply_to_the_default_model_in_either_form() {
    let e = env([("KVMESH_MODEL_BLOCK_SIZE", "64")]);
    let c = Config::from_toml_str(MULTI, &e).unwrap();
    assert_eq!((c.models[0].block_size, c.models[1].block_size), (64, 32));
    let c = Config::from_toml_str(FLEET, &e).unwrap();
    assert_eq!(c.model().block_size, 64);
    // No model in the file: the environment alone names one, as before.
    let bare = "listen = \"127.0.0.1:9100\"\n";
    let c = Config::from_toml_str(
        bare,
        &env([("KVMESH_MODEL_NAME", "m"), ("KVMESH_MODEL_BLOCK_SIZE", "8")]),
    )
    .unwrap();
    assert_eq!((c.model().name.as_str(), c.model().block_size), ("m", 8));
}

#[test]
fn several_model_fleets_are_validated_naming_the_field() {
    let refused = |text: &str| match Config::from_toml_str(text, &env([])) {
        Err(ConfigError::InvalidValue { field, .. }) => field,
        other => panic!("expected InvalidValue, got {other:?}"),
    };
    let second_block = MULTI.replacen("block_size = 32", "block_size = 0", 1);
    assert_eq!(refused(&second_block), "models[1].block_size");
    let dup_alias = MULTI.replacen("aliases = [\"ds4\"]", "aliases = [\"small-chat\"]", 1);
    assert_eq!(refused(&dup_alias), "models");
    let dup_adapter =
        MULTI.replacen("block_size = 32", "block_size = 32\nadapters = [\"ds4-sql\"]", 1);
    assert_eq!(refused(&dup_adapter), "models");
    let unknown = MULTI.replacen("model = \"small-chat\"", "model = \"gpt-4\"", 1);
    assert_eq!(refused(&unknown), "workers[1].model");
    let alias_as_model = MULTI.replacen("model = \"small-chat\"", "model = \"ds4\"", 1);
    assert_eq!(refused(&alias_as_model), "workers[1].model");
    let both = format!("{MULTI}\n[model]\nname = \"x\"\nblock_size = 16\n");
    assert_eq!(refused(&both), "model");
    assert_eq!(refused("listen = \"127.0.0.1:9100\"\n"), "models");
    let spaced = MULTI.replacen("\"ds4-chat\"", "\"ds4 chat\"", 1);
    assert_eq!(refused(&spaced), "models[0].adapters");
    let mut many = String::from("listen = \"127.0.0.1:9100\"\n");
    for i in 0..=MAX_MODELS {
        many.push_str(&format!("[[models]]\nname = \"m{i}\"\nblock_size = 16\n"));
    }
    assert_eq!(refused(&many), "models");
}
