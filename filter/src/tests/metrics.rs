//! Unit tests of `crate::metrics`.

use super::*;
use std::collections::HashSet;

#[test]
fn stat_names_are_unique_and_shaped_for_stats_tags() {
    let all = Metric::all();
    let names: HashSet<String> = all.iter().map(|m| m.stat_name()).collect();
    assert_eq!(names.len(), all.len());
    for m in &all {
        let name = m.stat_name();
        assert!(name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_' || b == b'.'), "{name}");
        assert!(ALL_NAMES.contains(&m.base()));
        for (label, _) in m.labels() {
            assert!(LABELS.contains(&label));
        }
    }
    assert_eq!(
        Metric::Requests(RouteLabel::Disagg, OutcomeLabel::Success).stat_name(),
        "kvmesh_filter_requests_total.mode.disagg.outcome.success"
    );
    assert_eq!(Metric::OverlapBlocks.stat_name(), "router_kv_overlap_blocks_total");
}

#[test]
fn every_base_name_is_defined() {
    let bases: HashSet<&str> = Metric::all().iter().map(|m| m.base()).collect();
    assert_eq!(bases.len(), ALL_NAMES.len());
}

#[test]
fn counters_end_in_total() {
    for m in Metric::all() {
        assert_eq!(m.kind() == MetricKind::Counter, m.base().ends_with("_total"), "{}", m.base());
    }
}

/// Drift guard: the README's metrics table names every metric and every label value.
#[test]
fn readme_documents_every_metric() {
    let readme = include_str!("../../README.md");
    for name in ALL_NAMES {
        assert!(readme.contains(&format!("`{name}")), "README misses metric {name}");
    }
    for m in Metric::all() {
        for (label, value) in m.labels() {
            assert!(readme.contains(&format!("`{value}`")), "README misses {label}={value}");
        }
    }
}

/// Drift guard: the bootstrap turns every label into a Prometheus label and buckets the histograms
/// (`envoy/check_configs.py` keeps the k8s and Istio copies of its `stats_config` identical).
#[test]
fn bootstrap_extracts_every_label() {
    let template = include_str!("../../../envoy/bootstrap.yaml.j2");
    for label in LABELS {
        assert!(
            template.contains(&format!("tag_name: {label}")),
            "bootstrap misses stats_tags for {label}"
        );
    }
    for hist in [KV_HIT_RATE, ROUTE_LATENCY, TTFT, TTFT_PREDICTED, TTFT_RATIO] {
        assert!(
            template.contains(&format!("wasmcustom.{hist}")),
            "bootstrap misses buckets for {hist}"
        );
    }
}

#[test]
fn model_labels_are_bounded_first_come() {
    let mut l = ModelLabels::new(2);
    assert_eq!(l.slot(None), (UNKNOWN_SLOT, false));
    assert_eq!(l.slot(Some("b")), (2, true));
    assert_eq!(l.slot(Some("a")), (3, true));
    assert_eq!(l.slot(Some("b")), (2, false));
    assert_eq!(l.slot(Some("c")), (OTHER_SLOT, false), "past the bound");
    assert_eq!(l.slot(Some("a")), (3, false), "labelled ones keep their label");
    assert_eq!(l.labelled(), 2);
    assert_eq!(
        (l.name(UNKNOWN_SLOT), l.name(OTHER_SLOT), l.name(2), l.name(3)),
        ("unknown", "other", "b", "a")
    );
    assert_eq!(l.name(99), "unknown");
    // Names that reduce to the same value share it; `unknown` / `other` are those buckets.
    let mut l = ModelLabels::new(4);
    assert_eq!(l.slot(Some("m.1")), (2, true));
    assert_eq!(l.slot(Some("m/1")), (2, false));
    assert_eq!(l.slot(Some("other")), (OTHER_SLOT, false));
    assert_eq!(l.slot(Some("")), (UNKNOWN_SLOT, false));
    assert_eq!(ModelLabels::new(0).slot(Some("m")), (OTHER_SLOT, false));
}

#[test]
fn model_label_values_are_one_stat_name_segment() {
    assert_eq!(model_label_value("deepseek-v4"), "deepseek-v4");
    assert_eq!(model_label_value("Qwen/Qwen2.5-7B"), "Qwen_Qwen2_5-7B");
    assert_eq!(model_label_value("é x"), "__x");
    assert_eq!(model_label_value(""), "unknown");
    assert_eq!(model_label_value(&"x".repeat(100)).len(), MAX_MODEL_LABEL_BYTES);
    assert_eq!(
        Metric::Requests(RouteLabel::Pinned, OutcomeLabel::Error).stat_name_for("m-1"),
        "kvmesh_filter_requests_total.mode.pinned.outcome.error.model.m-1"
    );
    assert_eq!(Metric::HitRate.stat_name_for("m"), "router_kv_hit_rate.model.m");
    assert_eq!(
        Metric::DoneReports(DoneResult::Sent).stat_name_for("m"),
        "kvmesh_filter_done_reports_total.result.sent",
        "no model label on a per-VM metric"
    );
}

/// The bootstrap's `model` rule takes the label off the end of every model-labelled stat name.
#[test]
fn the_bootstrap_model_rule_is_the_last_pair() {
    let template = include_str!("../../../envoy/bootstrap.yaml.j2");
    assert!(template.contains(
        r"regex: '^wasmcustom\.(?:kvmesh_filter|router_kv)_[a-z_]+(?:\.[a-z_]+\.[a-z_]+)*(\.model\.([A-Za-z0-9_-]+))$'"
    ));
    for m in Metric::all().into_iter().filter(|m| m.by_model()) {
        let base = m.base();
        assert!(
            base.starts_with("kvmesh_filter_") || base.starts_with("router_kv_"),
            "{base} outside the model rule's prefixes"
        );
    }
}
