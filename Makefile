# kvmesh — one entry point for developers and CI. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

CARGO        ?= cargo
PROFILE      ?= debug
WASM         := target/wasm32-wasip1/wasm/kvmesh_filter.wasm
FLEET        ?=
export KVMESH_TOKENIZER ?= $(CURDIR)/.tools/tokenizer/tokenizer.json
export KVMESH_ENVOY     ?= $(CURDIR)/.tools/bin/envoy
export KVMESH_WASM      ?= $(CURDIR)/$(WASM)

ifeq ($(PROFILE),release)
CARGO_PROFILE_FLAG := --release
else
CARGO_PROFILE_FLAG :=
endif

.PHONY: help setup build wasm test run demo bench lint validate clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: ## Install the wasm target, Envoy 1.40, the DeepSeek tokenizer and test tools into .tools/
	@scripts/setup.sh

wasm: setup ## Build the proxy-wasm filter (target/wasm32-wasip1/wasm/kvmesh_filter.wasm)
	$(CARGO) build -p kvmesh-filter --target wasm32-wasip1 --profile wasm

build: setup wasm ## Build every binary (PROFILE=debug|release)
	$(CARGO) build $(CARGO_PROFILE_FLAG) --bins

test: build ## Run every unit, integration and end-to-end test, and validate every config
	$(CARGO) test --workspace --no-fail-fast -- --test-threads=$${KVMESH_TEST_THREADS:-2}
	envoy/validate.sh

validate: build ## Validate Envoy, Istio, Kubernetes and Prometheus configs offline
	envoy/validate.sh

# `make run` is what a newcomer judges kvmesh by: release binaries (the build is paid once); tests stay on debug.
RUN_PROFILE ?= release
run: setup wasm ## Serve a KV-aware gateway on 127.0.0.1:8080 over local simulated workers, release build (FLEET=<file> for another fleet, PROMETHEUS=1 for Prometheus on :9090, RUN_PROFILE=debug for debug binaries)
	@echo "make run: building $(RUN_PROFILE) binaries (the first build takes a few minutes)"
	$(MAKE) --no-print-directory build PROFILE=$(RUN_PROFILE)
	target/$(RUN_PROFILE)/kvmesh-stack $(if $(filter release,$(RUN_PROFILE)),--release,) $(if $(FLEET),--fleet $(FLEET),) $(if $(filter 1,$(PROMETHEUS)),--prometheus,)

demo: ## `make run` on the disaggregated example fleet (2 prefill + 2 decode workers, disaggregation, local continuations, KV migration)
	$(MAKE) run FLEET=envoy/fleets/disagg.toml

bench: ## Replay the trace through every routing policy, measure router overhead and the indexer microbenchmarks, write bench-out/report.md
	$(MAKE) build PROFILE=release
	mkdir -p bench-out/indexer
	rm -f bench-out/indexer/figures.jsonl
	KVMESH_BENCH_FIGURES=$(CURDIR)/bench-out/indexer/figures.jsonl $(CARGO) bench -p kvmesh-indexer --bench index --bench route
	target/release/kvmesh-bench --out bench-out --indexer-figures bench-out/indexer/figures.jsonl $(BENCH_ARGS)

lint: ## clippy with the workspace lints, wasm included
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p kvmesh-filter --target wasm32-wasip1 -- -D warnings

clean: ## Remove build output (keeps .tools/)
	$(CARGO) clean
	rm -rf bench-out
