//! Root contexts: the proxy-wasm glue of [`crate::roles`]. A root reads its configuration bytes and
//! its `plugin_root_id` / `plugin_vm_id`, lets [`configure_from_bytes`] decide its role and state,
//! and forwards ticks and call callbacks to the [`crate::tasks::BackgroundTasks`] it runs.

use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType};

use super::adapter::ProxyWasmHost;
use super::http::HttpFilter;
use super::io;
use crate::roles::{configure_from_bytes, RootState};

/// A root context of either kind.
pub struct Root {
    context_id: u32,
    state: Option<RootState>,
}

impl Root {
    pub fn new(context_id: u32) -> Self {
        Self { context_id, state: None }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(tasks) = self.state.as_mut().and_then(|s| s.tasks.as_mut()) {
            tasks.on_http_call_response(token_id, num_headers, body_size);
        }
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        true
    }

    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let bytes = if plugin_configuration_size == 0 {
            None
        } else {
            hostcalls::get_buffer(BufferType::PluginConfiguration, 0, plugin_configuration_size)
                .ok()
                .flatten()
        };
        let root_id = io::property_string("plugin_root_id").unwrap_or_default();
        let vm_id = io::property_string("plugin_vm_id").unwrap_or_default();
        match configure_from_bytes(
            Rc::new(ProxyWasmHost),
            bytes.as_deref(),
            self.context_id,
            &root_id,
            &vm_id,
        ) {
            Some(state) => {
                self.state = Some(state);
                true
            }
            None => false,
        }
    }

    fn on_tick(&mut self) {
        if let Some(tasks) = self.state.as_mut().and_then(|s| s.tasks.as_mut()) {
            tasks.on_tick();
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None; an unconfigured root (never expected) gets a pass-through context.
        Some(match self.state.as_ref().and_then(|s| s.shared.as_ref()) {
            Some(shared) => Box::new(HttpFilter::new(context_id, Rc::clone(shared))),
            None => Box::new(PassThrough),
        })
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Does nothing: every callback continues.
struct PassThrough;

impl Context for PassThrough {}

impl HttpContext for PassThrough {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        Action::Continue
    }
}
