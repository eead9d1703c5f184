//! The test double of [`Host`]: an in-memory host that behaves like the parts of Envoy the
//! root-level logic uses — tokens count up, shared data keeps a CAS that grows on every write,
//! the same metric name gives the same id — records every call made, and fails the calls a test
//! tells it to fail. One `FakeHost` stands for one Envoy: roots that share it share its data and
//! stats, as roots of one `vm_id` do.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use super::{Host, HostError, SharedData};
use crate::metrics::{Metric, MetricKind};
use crate::request::HttpCall;

/// Host calls a test can make fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fail {
    Dispatch,
    SetSharedData,
    SetTick,
}

#[derive(Debug)]
struct Stat {
    name: String,
    kind: MetricKind,
    /// Counter total, or the last gauge value.
    value: i64,
    /// Histogram samples.
    samples: Vec<u64>,
}

/// An in-memory Envoy.
#[derive(Debug)]
pub struct FakeHost {
    now_ns: Cell<u64>,
    next_token: Cell<u32>,
    calls: RefCell<Vec<(u32, HttpCall)>>,
    response: RefCell<(Option<u16>, Vec<u8>)>,
    shared: RefCell<BTreeMap<String, (Vec<u8>, u32)>>,
    stats: RefCell<Vec<Stat>>,
    tick_ms: Cell<Option<u64>>,
    failing: RefCell<Vec<Fail>>,
}

impl Default for FakeHost {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeHost {
    /// An Envoy at time 1 s.
    pub fn new() -> Self {
        Self {
            now_ns: Cell::new(1_000_000_000),
            next_token: Cell::new(1),
            calls: RefCell::new(Vec::new()),
            response: RefCell::new((None, Vec::new())),
            shared: RefCell::new(BTreeMap::new()),
            stats: RefCell::new(Vec::new()),
            tick_ms: Cell::new(None),
            failing: RefCell::new(Vec::new()),
        }
    }

    pub fn advance_ms(&self, ms: u64) {
        self.now_ns.set(self.now_ns.get() + ms * 1_000_000);
    }

    /// Makes `call` fail (true) or succeed again (false).
    pub fn set_failing(&self, call: Fail, failing: bool) {
        let mut f = self.failing.borrow_mut();
        f.retain(|c| *c != call);
        if failing {
            f.push(call);
        }
    }

    fn check(&self, call: Fail) -> Result<(), HostError> {
        if self.failing.borrow().contains(&call) {
            Err(HostError(format!("{call:?} failing (test)")))
        } else {
            Ok(())
        }
    }

    /// Every call dispatched so far: `(token, call)`.
    pub fn calls(&self) -> Vec<(u32, HttpCall)> {
        self.calls.borrow().clone()
    }

    /// Tokens of dispatched calls whose path header is `path`.
    pub fn tokens_to(&self, path: &str) -> Vec<u32> {
        self.calls
            .borrow()
            .iter()
            .filter(|(_, c)| c.headers.iter().any(|(n, v)| n == ":path" && v == path))
            .map(|(t, _)| *t)
            .collect()
    }

    /// The answer `call_response_status` / `call_response_body` deliver next.
    pub fn answer(&self, status: Option<u16>, body: &[u8]) {
        *self.response.borrow_mut() = (status, body.to_vec());
    }

    /// Shared data under `key` and its CAS.
    pub fn shared_data(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.shared.borrow().get(key).cloned()
    }

    /// A counter's total (or a gauge's value); 0 when never defined.
    pub fn value(&self, metric: Metric) -> i64 {
        let name = metric.stat_name();
        self.stats.borrow().iter().find(|s| s.name == name).map_or(0, |s| s.value)
    }

    /// The total of the stat named `name` (a counter; a gauge's value); 0 when never defined.
    pub fn value_named(&self, name: &str) -> i64 {
        self.stats.borrow().iter().find(|s| s.name == name).map_or(0, |s| s.value)
    }

    /// Whether a stat named `name` was defined.
    pub fn defines(&self, name: &str) -> bool {
        self.stats.borrow().iter().any(|s| s.name == name)
    }

    /// The samples of the histogram named `name`.
    pub fn samples_named(&self, name: &str) -> Vec<u64> {
        self.stats
            .borrow()
            .iter()
            .find(|s| s.name == name)
            .map_or_else(Vec::new, |s| s.samples.clone())
    }

    /// A histogram's samples.
    pub fn samples(&self, metric: Metric) -> Vec<u64> {
        let name = metric.stat_name();
        self.stats
            .borrow()
            .iter()
            .find(|s| s.name == name)
            .map_or_else(Vec::new, |s| s.samples.clone())
    }

    /// How many distinct stats were defined.
    pub fn stat_count(&self) -> usize {
        self.stats.borrow().len()
    }

    /// The tick period last set.
    pub fn tick_ms(&self) -> Option<u64> {
        self.tick_ms.get()
    }
}

impl Host for FakeHost {
    fn now_ns(&self) -> u64 {
        self.now_ns.get()
    }

    fn dispatch(&self, call: &HttpCall) -> Result<u32, HostError> {
        self.check(Fail::Dispatch)?;
        let token = self.next_token.get();
        self.next_token.set(token + 1);
        self.calls.borrow_mut().push((token, call.clone()));
        Ok(token)
    }

    fn call_response_status(&self) -> Option<u16> {
        self.response.borrow().0
    }

    fn call_response_body(&self, max: usize) -> Vec<u8> {
        let body = &self.response.borrow().1;
        body[..body.len().min(max)].to_vec()
    }

    fn get_shared_data(&self, key: &str) -> Result<SharedData, HostError> {
        Ok(match self.shared.borrow().get(key) {
            Some((bytes, cas)) => (Some(bytes.clone()), Some(*cas)),
            None => (None, None),
        })
    }

    fn set_shared_data(&self, key: &str, value: &[u8]) -> Result<(), HostError> {
        self.check(Fail::SetSharedData)?;
        let mut shared = self.shared.borrow_mut();
        let cas = shared.get(key).map_or(1, |(_, cas)| cas + 1);
        shared.insert(key.to_owned(), (value.to_vec(), cas));
        Ok(())
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, HostError> {
        let mut stats = self.stats.borrow_mut();
        if let Some(i) = stats.iter().position(|s| s.name == name) {
            return Ok(i as u32);
        }
        stats.push(Stat { name: name.to_owned(), kind, value: 0, samples: Vec::new() });
        Ok(stats.len() as u32 - 1)
    }

    fn increment_metric(&self, id: u32, by: i64) -> Result<(), HostError> {
        let mut stats = self.stats.borrow_mut();
        let stat = stats.get_mut(id as usize).ok_or_else(|| HostError("NotFound".into()))?;
        // Envoy refuses non-positive increments of a counter.
        if stat.kind != MetricKind::Counter || by <= 0 {
            return Err(HostError("BadArgument".into()));
        }
        stat.value += by;
        Ok(())
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), HostError> {
        let mut stats = self.stats.borrow_mut();
        let stat = stats.get_mut(id as usize).ok_or_else(|| HostError("NotFound".into()))?;
        match stat.kind {
            MetricKind::Gauge => stat.value = value as i64,
            MetricKind::Histogram => stat.samples.push(value),
            MetricKind::Counter => return Err(HostError("BadArgument".into())),
        }
        Ok(())
    }

    fn set_tick_period(&self, period_ms: u64) -> Result<(), HostError> {
        self.check(Fail::SetTick)?;
        self.tick_ms.set(Some(period_ms));
        Ok(())
    }
}
