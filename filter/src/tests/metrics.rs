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
