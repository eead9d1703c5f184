//! Unit tests of `crate::metric_ids`: the `model` label's series against the test double.

use super::*;
use crate::host_api::fake::FakeHost;
use crate::metrics::{OutcomeLabel, RouteLabel};

fn ids(max: usize) -> (Rc<FakeHost>, MetricIds) {
    let host = Rc::new(FakeHost::new());
    let metrics = MetricIds::define(Rc::clone(&host) as Rc<dyn Host>, max);
    (host, metrics)
}

const PINNED_OK: Metric = Metric::Requests(RouteLabel::Pinned, OutcomeLabel::Success);

fn requests(host: &FakeHost, model: &str) -> i64 {
    host.value_named(&format!(
        "kvmesh_filter_requests_total.mode.pinned.outcome.success.model.{model}"
    ))
}

#[test]
fn unknown_series_exist_from_the_start_and_a_models_from_its_first_request() {
    let (host, m) = ids(16);
    let families = Metric::all().iter().filter(|m| m.by_model()).count();
    assert_eq!(host.stat_count(), Metric::all().len(), "one `unknown` series per family");
    assert!(host.defines("kvmesh_filter_requests_total.mode.pinned.outcome.success.model.unknown"));
    assert!(host.defines("router_kv_hit_rate.model.unknown"));
    assert!(
        host.defines("kvmesh_filter_done_reports_total.result.sent"),
        "no model on per-VM ones"
    );
    m.apply_for(MetricUpdate::Add(PINNED_OK, 2), Some("deepseek-v4"));
    assert_eq!(host.stat_count(), Metric::all().len() + families, "all of a model's at once");
    assert!(host.defines("kvmesh_filter_fallbacks_total.reason.timeout.model.deepseek-v4"));
    m.apply_for(MetricUpdate::Add(PINNED_OK, 1), Some("deepseek-v4"));
    m.apply_for(MetricUpdate::Add(PINNED_OK, 1), None);
    m.apply(MetricUpdate::Add(PINNED_OK, 4));
    assert_eq!(requests(&host, "deepseek-v4"), 3);
    assert_eq!(requests(&host, "unknown"), 5);
    // A family without the label ignores the model.
    m.apply_for(MetricUpdate::Add(Metric::EndpointEjections, 1), Some("deepseek-v4"));
    assert_eq!(host.value(Metric::EndpointEjections), 1);
}

#[test]
fn models_past_the_bound_share_other() {
    let (host, m) = ids(2);
    for model in ["m1", "m2", "m3", "m4", "m1", "m3"] {
        m.apply_for(MetricUpdate::Add(PINNED_OK, 1), Some(model));
    }
    assert_eq!(requests(&host, "m1"), 2);
    assert_eq!(requests(&host, "m2"), 1);
    assert_eq!(requests(&host, "other"), 3, "m3 twice, m4 once");
    assert!(!host.defines("kvmesh_filter_requests_total.mode.pinned.outcome.success.model.m3"));
    let families = Metric::all().iter().filter(|m| m.by_model()).count();
    assert_eq!(host.stat_count(), Metric::all().len() + 3 * families, "m1, m2, other");
    // No label at all: every model under `other`.
    let (host, m) = ids(0);
    m.apply_for(MetricUpdate::Record(Metric::Ttft, 12), Some("m1"));
    assert_eq!(host.samples_named("kvmesh_filter_ttft_milliseconds.model.other"), vec![12]);
}

#[test]
fn a_model_name_becomes_one_stat_name_segment() {
    let (host, m) = ids(16);
    m.apply_for(MetricUpdate::Add(PINNED_OK, 1), Some("Qwen/Qwen2.5-7B"));
    assert_eq!(requests(&host, "Qwen_Qwen2_5-7B"), 1);
}
