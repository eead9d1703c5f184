//! Metric ids of one VM and the updates applied to them, over [`Host`].
//!
//! Every metric of [`Metric::all`] is defined once per root context (the host returns the same stat
//! for the same name, so roots of one VM share series). A metric the host refused to define is
//! skipped on update; a failed update is logged at debug, never fatal.

use std::collections::HashMap;
use std::rc::Rc;

use crate::host_api::{Host, HostError};
use crate::metrics::{InternalError, Metric, MetricUpdate};

/// Metric ids of this VM, with the host that updates them.
pub struct MetricIds {
    host: Rc<dyn Host>,
    ids: HashMap<Metric, u32>,
}

impl MetricIds {
    /// Defines every metric of [`Metric::all`].
    pub fn define(host: Rc<dyn Host>) -> Self {
        let mut ids = HashMap::new();
        for metric in Metric::all() {
            match host.define_metric(metric.kind(), &metric.stat_name()) {
                Ok(id) => {
                    ids.insert(metric, id);
                }
                Err(status) => log::warn!("define_metric {} failed: {status}", metric.stat_name()),
            }
        }
        Self { host, ids }
    }

    /// Applies one update; counters skip zero (Envoy refuses non-positive increments).
    pub fn apply(&self, update: MetricUpdate) {
        let result = match update {
            MetricUpdate::Add(_, 0) => Ok(()),
            MetricUpdate::Add(m, n) => match self.ids.get(&m) {
                Some(&id) => self.host.increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX)),
                None => Ok(()),
            },
            MetricUpdate::Record(m, v) => match self.ids.get(&m) {
                Some(&id) => self.host.record_metric(id, v),
                None => Ok(()),
            },
        };
        if let Err(status) = result {
            log::debug!("metric update {update:?} failed: {status}");
        }
    }

    /// Counts a failed host call (`internal_errors{kind="host_call"}`) and logs it.
    pub fn host_call_failed(&self, what: &str, status: &HostError) {
        log::warn!("host call {what} failed: {status}");
        self.apply(MetricUpdate::Add(Metric::InternalErrors(InternalError::HostCall), 1));
    }
}

impl std::fmt::Debug for MetricIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricIds").field("defined", &self.ids.len()).finish()
    }
}
