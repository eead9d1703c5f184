//! The scheduler's LoRA side: which adapters run and wait (`vllm:lora_requests_info`), and the
//! GPU slots adapters enter when loaded through the API or needed by a batch.

use std::sync::Arc;

use super::{ReqId, Scheduler};
use crate::lora::Slots;

impl Scheduler {
    /// vLLM's `running_lora_adapters` and `waiting_lora_adapters`: the distinct adapter names of
    /// the running and the waiting requests, in queue order.
    pub fn lora_adapters(&self) -> (Vec<Arc<str>>, Vec<Arc<str>>) {
        let names = |ids: &mut dyn Iterator<Item = &ReqId>| {
            let mut out: Vec<Arc<str>> = Vec::new();
            for a in ids.filter_map(|id| self.reqs.get(id)?.lora.as_ref()) {
                if !out.contains(&a.name) {
                    out.push(a.name.clone());
                }
            }
            out
        };
        (names(&mut self.running.iter()), names(&mut self.waiting.iter()))
    }

    /// An adapter was loaded through the API: vLLM's `add_lora` also activates it into a slot.
    pub fn adapter_loaded(&mut self, id: u32) {
        if let Some(slots) = &mut self.slots {
            slots.preload(id);
        }
    }

    /// An adapter was unloaded: it leaves its slot (requests already queued keep running it).
    pub fn adapter_unloaded(&mut self, id: u32) {
        if let Some(slots) = &mut self.slots {
            slots.remove(id);
        }
    }

    /// Adapter ids in a GPU slot (empty without LoRA).
    pub fn resident_adapters(&self) -> Vec<u32> {
        self.slots.as_ref().map(Slots::resident).unwrap_or_default()
    }

    /// The distinct adapters of the requests already in this step's work.
    pub(super) fn running_adapters(&self, work: &[(ReqId, usize)]) -> Vec<u32> {
        let mut out = Vec::new();
        for (id, _) in work {
            if let Some(a) = self.reqs.get(id).and_then(|r| r.lora.as_ref()) {
                if !out.contains(&a.id) {
                    out.push(a.id);
                }
            }
        }
        out
    }
}
