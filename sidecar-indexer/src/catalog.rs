//! The fleet's models at run time: per base model its configuration and tokenizer
//! ([`ModelRuntime`]), the catalog requests resolve against (configured models plus the adapters
//! the engines report serving, [`catalog`]) and what a request resolved to ([`RouteModel`]).
//!
//! One index for every model: the [`crate::index::KvIndex`] is keyed by chain hash with values per
//! worker slot, and every slot belongs to one worker, which serves one base model. Two models with
//! the same tokenizer and block size hash the same prompt to the same chains, so a lookup can name
//! slots of another model: the route pipeline reads matches only for the resolved model's workers
//! (`crate::route::plan` builds views of those workers only; `held_prefix` counts only their
//! slots), and never places a request elsewhere. One index keeps one memory bound
//! (`routing.index_max_entries`) and one writer for the whole fleet instead of a bound per model.
//!
//! Adapters: a request naming adapter A is hashed with `block_seed(Some(A), cache_salt)`, the seed
//! the event side gives a `BlockStored` with `lora_name = A` (`crate::events::apply`), so its chain
//! never equals the base model's or another adapter's chain for the same tokens.
//!
//! Discovered adapters ([`Served`], from each worker's `GET /v1/models`, `crate::service::served`)
//! join their worker's base model in [`catalog`]; a name already used by another entry (a base, an
//! alias, another model's adapter) is refused, and at most
//! [`crate::config::MAX_ADAPTERS_PER_MODEL`] adapters are known per model.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvmesh_core::hashing::block_seed;
use kvmesh_core::models::{self, FleetModel, UnknownModel};

use crate::config::{Config, ModelConfig, MAX_ADAPTERS_PER_MODEL};
use crate::tokenize::PromptTokenizer;

/// One base model at run time.
pub struct ModelRuntime {
    pub cfg: ModelConfig,
    /// Its tokenizer and chat template, with caches bounded by `routing.tokenize_cache_bytes` and
    /// `routing.tokenize_memo_bytes` (each model its own: token ids of one tokenizer are never
    /// served for another).
    pub tokenizer: Arc<PromptTokenizer>,
}

impl ModelRuntime {
    pub fn name(&self) -> &str {
        &self.cfg.name
    }

    pub fn block_size(&self) -> u32 {
        self.cfg.block_size
    }
}

/// The models of the running indexer: runtimes in configuration order (the default first) and
/// the catalog they resolve against.
pub struct Models {
    runtimes: Vec<Arc<ModelRuntime>>,
    catalog: Vec<FleetModel>,
}

impl Models {
    /// `runtimes` (config order) with the catalog built from them and `served`.
    pub fn new(runtimes: Vec<Arc<ModelRuntime>>, served: &Served) -> (Self, Vec<Refused>) {
        let cfgs: Vec<&ModelConfig> = runtimes.iter().map(|r| &r.cfg).collect();
        let (catalog, refused) = catalog(&cfgs, served);
        (Self { runtimes, catalog }, refused)
    }

    /// Base models with aliases and adapters (configured, then discovered), the default first.
    pub fn catalog(&self) -> &[FleetModel] {
        &self.catalog
    }

    pub fn runtimes(&self) -> &[Arc<ModelRuntime>] {
        &self.runtimes
    }

    /// The runtime of base model `name`.
    pub fn runtime(&self, name: &str) -> Option<&Arc<ModelRuntime>> {
        self.runtimes.iter().find(|r| r.name() == name)
    }

    /// What a request's `model` selects ([`models::resolve`] against the catalog).
    pub fn resolve(&self, requested: Option<&str>) -> Result<RouteModel, UnknownModel> {
        let r = models::resolve(&self.catalog, requested)?;
        let runtime = self
            .runtime(r.base)
            .cloned()
            .ok_or_else(|| UnknownModel(requested.unwrap_or_default().to_owned()))?;
        Ok(RouteModel { runtime, adapter: r.adapter.map(Arc::from) })
    }
}

/// A request's resolved model: the base model's runtime, and the adapter it names.
#[derive(Clone)]
pub struct RouteModel {
    pub runtime: Arc<ModelRuntime>,
    /// The LoRA adapter, when the request names one (its chains are seeded with it).
    pub adapter: Option<Arc<str>>,
}

impl RouteModel {
    /// The base model's name (the `model` metric label; workers serving it are the candidates).
    pub fn base(&self) -> &str {
        self.runtime.name()
    }

    pub fn block_size(&self) -> u32 {
        self.runtime.block_size()
    }

    /// The chain seed of the request's blocks: the adapter's and the `cache_salt`'s, as the
    /// engine keys them (`kvmesh_core::hashing::block_seed`, the event side's function).
    pub fn seed(&self, cache_salt: Option<&str>) -> u64 {
        block_seed(self.adapter.as_deref(), cache_salt)
    }
}

/// What each worker's engine reports serving (`GET /v1/models`): per worker id, its base model (as
/// the fleet configures it) and the adapters it lists with that model as `parent`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Served {
    pub by_worker: BTreeMap<String, (String, Vec<String>)>,
}

/// A discovered adapter left out of the catalog, and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Refused {
    pub adapter: String,
    pub model: String,
    pub reason: RefusedReason,
}

/// Why a discovered adapter was left out (the `reason` label of
/// `kvmesh_served_adapters_refused_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RefusedReason {
    /// Its name is another entry's (a base model, an alias, another model's adapter).
    Collision,
    /// Its model already knows [`MAX_ADAPTERS_PER_MODEL`] adapters.
    TooMany,
}

impl RefusedReason {
    pub const ALL: [Self; 2] = [Self::Collision, Self::TooMany];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Collision => "collision",
            Self::TooMany => "too_many",
        }
    }
}

/// The catalog: each configured model with its configured adapters, then the adapters its workers
/// report (sorted, each once) unless the name is taken elsewhere or the model is full. Pure.
pub fn catalog(models: &[&ModelConfig], served: &Served) -> (Vec<FleetModel>, Vec<Refused>) {
    let mut out: Vec<FleetModel> = models.iter().map(|m| m.fleet_model(&[])).collect();
    let mut refused = Vec::new();
    let mut reported: BTreeMap<&str, std::collections::BTreeSet<&str>> = BTreeMap::new();
    for (base, adapters) in served.by_worker.values() {
        reported.entry(base).or_default().extend(adapters.iter().map(String::as_str));
    }
    for (base, adapters) in reported {
        let Some(at) = out.iter().position(|m| m.name == base) else { continue };
        for a in adapters {
            if out[at].adapters.iter().any(|known| known == a) {
                continue;
            }
            let taken = out.iter().any(|m| {
                m.name == a || m.aliases.iter().any(|n| n == a) || m.adapters.iter().any(|n| n == a)
            });
            let reason = if taken {
                RefusedReason::Collision
            } else if out[at].adapters.len() >= MAX_ADAPTERS_PER_MODEL {
                RefusedReason::TooMany
            } else {
                out[at].adapters.push(a.to_owned());
                continue;
            };
            refused.push(Refused { adapter: a.to_owned(), model: base.to_owned(), reason });
        }
    }
    (out, refused)
}

/// The runtimes of `config`'s models, reusing `old` ones whose tokenizer settings and caches'
/// bounds are unchanged and loading the others with `load`.
pub fn runtimes<E>(
    config: &Config,
    old: &[Arc<ModelRuntime>],
    mut load: impl FnMut(&ModelConfig) -> Result<PromptTokenizer, E>,
) -> Result<Vec<Arc<ModelRuntime>>, E> {
    config
        .models
        .iter()
        .map(|m| {
            let keep = old.iter().find(|o| o.cfg.name == m.name && !o.cfg.tokenizer_differs(m));
            let tokenizer = match keep {
                Some(o) => o.tokenizer.clone(),
                None => Arc::new(load(m)?),
            };
            Ok(Arc::new(ModelRuntime { cfg: m.clone(), tokenizer }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(name: &str, adapters: &[&str]) -> ModelConfig {
        ModelConfig {
            name: name.into(),
            aliases: vec![format!("{name}-alias")],
            block_size: 16,
            tokenizer: None,
            chat_template: None,
            bos_token: String::new(),
            adapters: adapters.iter().map(|a| (*a).to_owned()).collect(),
        }
    }

    #[test]
    fn served_adapters_join_their_model_unless_their_name_is_taken() {
        let (a, b) = (model("a", &["a-sql"]), model("b", &[]));
        let mut served = Served::default();
        let w = |base: &str, adapters: &[&str]| {
            (base.to_owned(), adapters.iter().map(|a| (*a).to_owned()).collect())
        };
        served.by_worker.insert("w0".into(), w("a", &["a-sql", "a-chat", "b"]));
        served.by_worker.insert("w1".into(), w("a", &["a-chat", "a-code"]));
        served.by_worker.insert("w2".into(), w("b", &["a-code", "b-alias", "b-x"]));
        served.by_worker.insert("w3".into(), w("gone", &["z"]));
        let (cat, refused) = catalog(&[&a, &b], &served);
        assert_eq!(cat[0].adapters, vec!["a-sql", "a-chat", "a-code"]);
        assert_eq!(cat[1].adapters, vec!["b-x"]);
        let names: Vec<_> = refused.iter().map(|r| (r.adapter.as_str(), r.reason)).collect();
        assert_eq!(
            names,
            vec![
                ("b", RefusedReason::Collision),
                ("a-code", RefusedReason::Collision),
                ("b-alias", RefusedReason::Collision),
            ]
        );
        assert!(models::duplicate_names(&cat).is_empty());
    }

    #[test]
    fn a_model_knows_a_bounded_number_of_adapters() {
        let a = model("a", &[]);
        let many: Vec<String> =
            (0..MAX_ADAPTERS_PER_MODEL + 3).map(|i| format!("x{i:04}")).collect();
        let mut served = Served::default();
        served.by_worker.insert("w0".into(), ("a".into(), many));
        let (cat, refused) = catalog(&[&a], &served);
        assert_eq!(cat[0].adapters.len(), MAX_ADAPTERS_PER_MODEL);
        assert_eq!(refused.len(), 3);
        assert!(refused.iter().all(|r| r.reason == RefusedReason::TooMany));
    }

    #[test]
    fn adapters_seed_their_chains_apart_from_the_base() {
        let tokenizer = Arc::new(
            PromptTokenizer::load(&kvmesh_tokens::default_tokenizer_path(), None, "", 0).unwrap(),
        );
        let runtime =
            |m: ModelConfig| Arc::new(ModelRuntime { cfg: m, tokenizer: tokenizer.clone() });
        let (models, _) = Models::new(
            vec![runtime(model("a", &["a1", "a2"])), runtime(model("b", &[]))],
            &Served::default(),
        );
        let seed = |n: Option<&str>| models.resolve(n).map(|r| (r.base().to_owned(), r.seed(None)));
        let base = seed(None).unwrap();
        assert_eq!(base, seed(Some("a-alias")).unwrap());
        let (a1, a2) = (seed(Some("a1")).unwrap(), seed(Some("a2")).unwrap());
        assert_eq!((a1.0.as_str(), a2.0.as_str()), ("a", "a"));
        assert!(base.1 != a1.1 && a1.1 != a2.1 && base.1 != a2.1);
        assert_eq!(a1.1, block_seed(Some("a1"), None));
        assert_eq!(seed(Some("b")).unwrap().0, "b");
        assert!(seed(Some("nope")).is_err());
    }
}
