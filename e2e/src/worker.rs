//! A fleet's workers: what to start ([`WorkerSpec`]) and what runs ([`Worker`]).
//!
//! Both the stack ([`crate::stack`]), which starts simulators, and the real-engine module
//! ([`crate::vllm`]), which starts vLLM or adopts external engines, build and hand back these, so
//! they live here, below both (the stack re-exports them under its own path).

use kvmesh_core::api::Role;

use crate::procs::Proc;

/// One worker of a fleet: a simulator, a real engine, or an external engine.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    pub id: String,
    pub role: Role,
    /// The base model it serves (a name in [`crate::stack::StackSpec::models`]); `None`: the
    /// stack's first (default) model.
    pub model: Option<String>,
    /// Extra `vllm-sim` (or vLLM) flags for this worker only.
    pub args: Vec<String>,
    /// An external engine's addresses (`Engines::External`; ignored otherwise).
    pub endpoint: Option<String>,
    pub kv_events: Option<String>,
    pub kv_replay: Option<String>,
}

impl WorkerSpec {
    pub fn new(id: impl Into<String>, role: Role) -> Self {
        Self {
            id: id.into(),
            role,
            model: None,
            args: Vec::new(),
            endpoint: None,
            kv_events: None,
            kv_replay: None,
        }
    }
}

/// A running worker.
pub struct Worker {
    pub id: String,
    pub role: Role,
    /// The base model it serves (`None`: the stack's first, default model).
    pub model: Option<String>,
    /// `ip:port` of its OpenAI server.
    pub http: String,
    pub kv_events: Option<String>,
    pub replay: Option<String>,
    /// The engine's process (`None` for an external engine, or a killed one).
    pub proc: Option<Proc>,
}

impl Worker {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// This running engine as an external worker of another stack (its addresses, nothing started).
    pub fn external_spec(&self) -> WorkerSpec {
        WorkerSpec {
            model: self.model.clone(),
            endpoint: Some(self.http.clone()),
            kv_events: self.kv_events.clone(),
            kv_replay: self.replay.clone(),
            ..WorkerSpec::new(self.id.clone(), self.role)
        }
    }
}
