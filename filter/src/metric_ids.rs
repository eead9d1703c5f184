//! Metric ids of one VM and the updates applied to them, over [`Host`].
//!
//! Every metric of [`Metric::all`] is defined once per root context (the host returns the same stat
//! for the same name, so roots of one VM share series); a [`Metric::by_model`] family is defined
//! per `model` label ([`ModelLabels`]): for `unknown` at once, for a base model when a request
//! first carries it (up to `max_model_labels`, then `other`). A metric the host refused to define
//! is skipped on update; a failed update is logged at debug, never fatal.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

use crate::host_api::{Host, HostError};
use crate::metrics::{InternalError, Metric, MetricUpdate, ModelLabels, OTHER_SLOT, UNKNOWN_SLOT};

/// Metric ids of this VM, with the host that updates them.
pub struct MetricIds {
    host: Rc<dyn Host>,
    ids: HashMap<Metric, u32>,
    by_model: RefCell<ModelIds>,
}

/// The `model` labels handed out and the ids of the model-labelled families, by label slot.
struct ModelIds {
    labels: ModelLabels,
    ids: HashMap<(Metric, usize), u32>,
    /// Slots whose series are defined.
    defined: HashSet<usize>,
}

impl MetricIds {
    /// Defines every metric of [`Metric::all`] (model-labelled families for `unknown`); at most
    /// `max_model_labels` base models get a label of their own.
    pub fn define(host: Rc<dyn Host>, max_model_labels: usize) -> Self {
        let mut ids = HashMap::new();
        for metric in Metric::all().into_iter().filter(|m| !m.by_model()) {
            if let Some(id) = define_one(host.as_ref(), metric, &metric.stat_name()) {
                ids.insert(metric, id);
            }
        }
        let by_model = RefCell::new(ModelIds {
            labels: ModelLabels::new(max_model_labels),
            ids: HashMap::new(),
            defined: HashSet::new(),
        });
        let this = Self { host, ids, by_model };
        this.define_model_slot(UNKNOWN_SLOT);
        this
    }

    /// Applies one update with no model known (`model="unknown"` on model-labelled families).
    pub fn apply(&self, update: MetricUpdate) {
        self.apply_for(update, None);
    }

    /// Applies one update of a request for base model `model` (None: not known); counters skip
    /// zero (Envoy refuses non-positive increments).
    pub fn apply_for(&self, update: MetricUpdate, model: Option<&str>) {
        let metric = update.metric();
        let id = if metric.by_model() {
            self.model_id(metric, model)
        } else {
            self.ids.get(&metric).copied()
        };
        let Some(id) = id else { return };
        let result = match update {
            MetricUpdate::Add(_, 0) => Ok(()),
            MetricUpdate::Add(_, n) => {
                self.host.increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX))
            }
            MetricUpdate::Record(_, v) => self.host.record_metric(id, v),
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

    /// The id of `metric` (model-labelled) for `model`, labelling the model first if it is new.
    fn model_id(&self, metric: Metric, model: Option<&str>) -> Option<u32> {
        let (slot, defined) = {
            let mut by_model = self.by_model.try_borrow_mut().ok()?;
            let (slot, fresh) = by_model.labels.slot(model);
            if fresh {
                log::info!(
                    "metrics: base model {:?} labelled model=\"{}\" ({} of max_model_labels {})",
                    model.unwrap_or_default(),
                    by_model.labels.name(slot),
                    by_model.labels.labelled(),
                    by_model.labels.max()
                );
            } else if slot == OTHER_SLOT && !by_model.defined.contains(&slot) {
                log::warn!(
                    "metrics: max_model_labels {} reached: base model {:?} and later ones counted as model=\"other\"",
                    by_model.labels.max(),
                    model.unwrap_or_default()
                );
            }
            (slot, by_model.defined.contains(&slot))
        };
        if !defined {
            self.define_model_slot(slot);
        }
        self.by_model.try_borrow().ok()?.ids.get(&(metric, slot)).copied()
    }

    /// Defines every model-labelled family for label `slot` (once: a stat the host refused is
    /// not asked for again).
    fn define_model_slot(&self, slot: usize) {
        let Ok(mut by_model) = self.by_model.try_borrow_mut() else { return };
        let value = by_model.labels.name(slot).to_owned();
        for metric in Metric::all().into_iter().filter(|m| m.by_model()) {
            if let Some(id) = define_one(self.host.as_ref(), metric, &metric.stat_name_for(&value))
            {
                by_model.ids.insert((metric, slot), id);
            }
        }
        by_model.defined.insert(slot);
    }
}

/// Defines one stat; None (logged) when the host refuses.
fn define_one(host: &dyn Host, metric: Metric, name: &str) -> Option<u32> {
    match host.define_metric(metric.kind(), name) {
        Ok(id) => Some(id),
        Err(status) => {
            log::warn!("define_metric {name} failed: {status}");
            None
        }
    }
}

impl std::fmt::Debug for MetricIds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let models = self.by_model.try_borrow().map_or(0, |m| m.labels.labelled());
        f.debug_struct("MetricIds")
            .field("defined", &self.ids.len())
            .field("model_labels", &models)
            .finish()
    }
}

#[cfg(test)]
#[path = "tests/metric_ids.rs"]
mod tests;
