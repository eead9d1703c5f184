//! LoRA adapters as vLLM serves them: the served-model registry (base names and loaded
//! adapters, `model` resolution, load/unload) and the GPU slots adapters occupy while they run.
//!
//! vLLM facts this follows (`entrypoints/openai/models/serving.py`, `lora/worker_manager.py`,
//! `v1/core/sched/scheduler.py`):
//! - A request's `model` is a base name (any `--served-model-name`), a loaded adapter, or a 404
//!   "The model `x` does not exist." with `param: "model"`; an absent or empty `model` is the base.
//! - Each loaded adapter gets an int id from a counter starting at 1 (`lora_int_id`, published as
//!   `lora_id` in `BlockStored`); reloading in place keeps the id, unload + load takes a new one.
//! - `--lora-modules` are loaded at start in order, like `POST /v1/load_lora_adapter`; a duplicate
//!   name is refused ("has already been loaded"), an unknown one on unload is a 404.
//! - At most `max_loras` distinct adapters run in one batch (a waiting request whose adapter would
//!   exceed it is skipped, not blocking the queue); an adapter not in a GPU slot is loaded into one
//!   when its batch runs, evicting the least recently used adapter the batch does not need.
//!   Loading an adapter (`add_lora`) also activates it into a slot.
//!
//! Pure: no I/O, no clock. The registry is bounded by [`MAX_ADAPTERS`].

use std::str::FromStr;
use std::sync::Arc;

/// Most adapters registered at once (a load past it is a 400). vLLM has no such bound; the
/// simulator keeps every structure bounded.
pub const MAX_ADAPTERS: usize = 1024;

/// An adapter as a request carries it (and `BlockStored` publishes it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapter {
    /// vLLM's `lora_int_id` (≥ 1), published as `lora_id`.
    pub id: u32,
    /// The adapter name: the request's `model`, `lora_name` in events, the hash extra key.
    pub name: Arc<str>,
}

/// One `--lora-modules` entry: `name=path` or vLLM's JSON `{"name", "path", "base_model_name"}`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct LoraModule {
    /// Adapter name.
    pub name: String,
    /// Adapter directory (not read: the simulator has no weights).
    pub path: String,
    /// The base model it extends (`parent` in `/v1/models`) [default: the first served name].
    #[serde(default)]
    pub base_model_name: Option<String>,
}

impl FromStr for LoraModule {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let m = if s.trim_start().starts_with('{') {
            serde_json::from_str::<LoraModule>(s).map_err(|e| format!("invalid JSON: {e}"))?
        } else {
            let (name, path) = s
                .split_once('=')
                .ok_or_else(|| format!("{s:?}: expected name=path or a JSON object"))?;
            LoraModule { name: name.to_owned(), path: path.to_owned(), base_model_name: None }
        };
        if m.name.is_empty() || m.path.is_empty() {
            return Err(format!("{s:?}: name and path must not be empty"));
        }
        Ok(m)
    }
}

/// A loaded adapter as `/v1/models` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Id and name.
    pub adapter: Adapter,
    /// `root` in `/v1/models`.
    pub path: String,
    /// `parent` in `/v1/models`: the base model it was loaded for.
    pub parent: String,
}

/// Why a load, an unload or a request's `model` was refused (vLLM's messages).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoraError {
    /// `lora_name` or `lora_path` missing or empty (400).
    #[error("Both 'lora_name' and 'lora_path' must be provided.")]
    MissingFields,
    /// Unload without `lora_name` (400).
    #[error("'lora_name' needs to be provided to unload a LoRA adapter.")]
    MissingName,
    /// A second load of a loaded name without `load_inplace` (400).
    #[error("The lora adapter '{0}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.")]
    AlreadyLoaded(String),
    /// Unload of a name that is not loaded (404).
    #[error("The lora adapter '{0}' cannot be found.")]
    NotFound(String),
    /// The registry holds [`MAX_ADAPTERS`] adapters (400).
    #[error("cannot load more than {0} LoRA adapters into vllm-sim")]
    Full(usize),
    /// A request named a model that is neither a base name nor a loaded adapter (404).
    #[error("The model `{0}` does not exist.")]
    UnknownModel(String),
}

/// The served models: base names (the first is the default and the metrics' `model_name`) and
/// the loaded adapters, in load order.
#[derive(Debug, Clone)]
pub struct Registry {
    base: Vec<String>,
    adapters: Vec<Entry>,
    next_id: u32,
    capacity: usize,
}

impl Registry {
    /// `base` non-empty (validated by `config`); `capacity` adapters at most.
    pub fn new(base: Vec<String>, capacity: usize) -> Self {
        Self { base, adapters: Vec::new(), next_id: 1, capacity }
    }

    /// The served base names.
    pub fn base_names(&self) -> &[String] {
        &self.base
    }

    /// The default (first) base name.
    pub fn default_name(&self) -> &str {
        self.base.first().map_or("", String::as_str)
    }

    /// Loaded adapters, in load order.
    pub fn adapters(&self) -> &[Entry] {
        &self.adapters
    }

    /// vLLM's `_check_model` + the adapter lookup: `Ok(None)` = the base model.
    pub fn resolve(&self, model: Option<&str>) -> Result<Option<Adapter>, LoraError> {
        let Some(m) = model.filter(|m| !m.is_empty()) else { return Ok(None) };
        if self.base.iter().any(|b| b == m) {
            return Ok(None);
        }
        match self.adapters.iter().find(|e| &*e.adapter.name == m) {
            Some(e) => Ok(Some(e.adapter.clone())),
            None => Err(LoraError::UnknownModel(m.to_owned())),
        }
    }

    /// `POST /v1/load_lora_adapter`: registers `name` (or, with `inplace`, re-registers it under
    /// its old id). `base_model_name` sets `parent` when it is a served base name.
    pub fn load(
        &mut self,
        name: &str,
        path: &str,
        base_model_name: Option<&str>,
        inplace: bool,
    ) -> Result<Adapter, LoraError> {
        if name.is_empty() || path.is_empty() {
            return Err(LoraError::MissingFields);
        }
        let parent = base_model_name
            .filter(|b| self.base.iter().any(|n| n == b))
            .unwrap_or_else(|| self.default_name())
            .to_owned();
        if let Some(e) = self.adapters.iter_mut().find(|e| &*e.adapter.name == name) {
            if !inplace {
                return Err(LoraError::AlreadyLoaded(name.to_owned()));
            }
            e.path = path.to_owned();
            e.parent = parent;
            return Ok(e.adapter.clone());
        }
        if self.adapters.len() >= self.capacity {
            return Err(LoraError::Full(self.capacity));
        }
        let adapter = Adapter { id: self.next_id, name: Arc::from(name) };
        self.next_id = self.next_id.saturating_add(1);
        self.adapters.push(Entry { adapter: adapter.clone(), path: path.to_owned(), parent });
        Ok(adapter)
    }

    /// `POST /v1/unload_lora_adapter`.
    pub fn unload(&mut self, name: &str) -> Result<Adapter, LoraError> {
        if name.is_empty() {
            return Err(LoraError::MissingName);
        }
        let i = self
            .adapters
            .iter()
            .position(|e| &*e.adapter.name == name)
            .ok_or_else(|| LoraError::NotFound(name.to_owned()))?;
        Ok(self.adapters.remove(i).adapter)
    }
}

/// The GPU's `max_loras` adapter slots, least recently used first out.
#[derive(Debug, Clone)]
pub struct Slots {
    max: usize,
    /// (adapter id, last use), at most `max`.
    resident: Vec<(u32, u64)>,
    clock: u64,
}

impl Slots {
    /// `max` slots (≥ 1), all empty.
    pub fn new(max: usize) -> Self {
        Self { max: max.max(1), resident: Vec::new(), clock: 0 }
    }

    /// The slot count (`max_loras`).
    pub fn capacity(&self) -> usize {
        self.max
    }

    /// Adapter ids in a slot.
    pub fn resident(&self) -> Vec<u32> {
        self.resident.iter().map(|&(id, _)| id).collect()
    }

    /// Makes every adapter of a batch resident and returns how many had to be loaded. A load
    /// evicts the least recently used adapter the batch does not use (the batch holds at most
    /// `max` distinct adapters, so there is always one when the slots are full).
    pub fn activate(&mut self, batch: &[u32]) -> usize {
        self.clock += 1;
        let mut loads = 0;
        for &id in batch {
            if let Some(slot) = self.resident.iter_mut().find(|(r, _)| *r == id) {
                slot.1 = self.clock;
                continue;
            }
            loads += 1;
            self.make_room(batch);
            if self.resident.len() < self.max {
                self.resident.push((id, self.clock));
            }
        }
        loads
    }

    /// An adapter loaded through the API is activated at once (vLLM's `add_lora`), evicting the
    /// least recently used one if the slots are full.
    pub fn preload(&mut self, id: u32) {
        self.activate(&[id]);
    }

    /// An unloaded adapter leaves its slot.
    pub fn remove(&mut self, id: u32) {
        self.resident.retain(|&(r, _)| r != id);
    }

    fn make_room(&mut self, keep: &[u32]) {
        if self.resident.len() < self.max {
            return;
        }
        let victim = self
            .resident
            .iter()
            .enumerate()
            .filter(|(_, (id, _))| !keep.contains(id))
            .min_by_key(|(_, (_, used))| *used)
            .map(|(i, _)| i);
        if let Some(i) = victim {
            self.resident.remove(i);
        }
    }
}

/// vLLM's admission rule: a request for adapter `id` joins a batch already running the adapters
/// `scheduled` only if that keeps at most `max_loras` distinct adapters.
pub fn fits(max_loras: usize, scheduled: &[u32], id: u32) -> bool {
    scheduled.len() < max_loras || scheduled.contains(&id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry() -> Registry {
        Registry::new(vec!["base".into(), "alias".into()], 3)
    }

    #[test]
    fn modules_parse_as_vllm_takes_them() {
        let m: LoraModule = "sql=/a/sql".parse().unwrap();
        assert_eq!((m.name.as_str(), m.path.as_str(), m.base_model_name), ("sql", "/a/sql", None));
        let j: LoraModule =
            r#"{"name":"chat","path":"/a/c","base_model_name":"alias"}"#.parse().unwrap();
        assert_eq!(j.base_model_name.as_deref(), Some("alias"));
        for bad in ["noequals", "=p", "n=", r#"{"name":"x"}"#, "{bad json"] {
            assert!(bad.parse::<LoraModule>().is_err(), "{bad}");
        }
    }

    #[test]
    fn resolve_base_alias_adapter_and_unknown() {
        let mut r = registry();
        let a = r.load("a1", "/p/a1", None, false).unwrap();
        assert_eq!(a.id, 1);
        assert_eq!(r.resolve(None), Ok(None));
        assert_eq!(r.resolve(Some("")), Ok(None));
        assert_eq!(r.resolve(Some("alias")), Ok(None));
        assert_eq!(r.resolve(Some("a1")), Ok(Some(a)));
        let e = r.resolve(Some("gpt-4")).unwrap_err();
        assert_eq!(e.to_string(), "The model `gpt-4` does not exist.");
    }

    #[test]
    fn load_unload_ids_and_errors_follow_vllm() {
        let mut r = registry();
        assert_eq!(r.load("", "/p", None, false), Err(LoraError::MissingFields));
        assert_eq!(r.load("a", "", None, false), Err(LoraError::MissingFields));
        let a = r.load("a", "/p/a", Some("alias"), false).unwrap();
        assert_eq!(r.adapters()[0].parent, "alias");
        assert!(matches!(r.load("a", "/p/a", None, false), Err(LoraError::AlreadyLoaded(_))));
        // In place: same id, new path; an unknown base_model_name falls back to the first name.
        let again = r.load("a", "/p/a2", Some("nope"), true).unwrap();
        assert_eq!(again.id, a.id);
        assert_eq!(
            (r.adapters()[0].path.as_str(), r.adapters()[0].parent.as_str()),
            ("/p/a2", "base")
        );
        let b = r.load("b", "/p/b", None, false).unwrap();
        assert_eq!(b.id, 2);
        assert_eq!(r.unload("a").unwrap().id, 1);
        assert_eq!(r.unload("a"), Err(LoraError::NotFound("a".into())));
        assert_eq!(r.unload(""), Err(LoraError::MissingName));
        // Reloaded after an unload: a new id.
        assert_eq!(r.load("a", "/p/a", None, false).unwrap().id, 3);
        r.load("c", "/p/c", None, false).unwrap();
        assert_eq!(r.load("d", "/p/d", None, false), Err(LoraError::Full(3)));
        let names: Vec<&str> = r.adapters().iter().map(|e| &*e.adapter.name).collect();
        assert_eq!(names, ["b", "a", "c"], "load order");
    }

    #[test]
    fn slots_load_once_and_evict_the_least_recently_used_idle_adapter() {
        let mut s = Slots::new(2);
        assert_eq!(s.activate(&[1]), 1);
        assert_eq!(s.activate(&[1]), 0, "resident: no second load");
        assert_eq!(s.activate(&[2, 1]), 1);
        assert_eq!(s.activate(&[1]), 0);
        // 2 is the least recently used: 3 takes its slot.
        assert_eq!(s.activate(&[3]), 1);
        let mut r = s.resident();
        r.sort_unstable();
        assert_eq!(r, [1, 3]);
        // A batch's own adapters are never evicted for each other.
        assert_eq!(s.activate(&[2, 3]), 1);
        let mut r = s.resident();
        r.sort_unstable();
        assert_eq!(r, [2, 3]);
        s.remove(2);
        assert_eq!(s.resident(), [3]);
        s.preload(4);
        assert_eq!(s.activate(&[4, 3]), 0);
        assert_eq!(s.capacity(), 2);
    }

    #[test]
    fn at_most_max_loras_distinct_adapters_per_batch() {
        assert!(fits(1, &[], 5));
        assert!(fits(1, &[5], 5));
        assert!(!fits(1, &[5], 6));
        assert!(fits(2, &[5], 6));
        assert!(!fits(2, &[5, 6], 7));
    }
}
