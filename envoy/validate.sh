#!/usr/bin/env bash
# Offline validation of every deployment file under envoy/ (run by `make test`):
#   1. kubernetes-validate (strict schemas, two Kubernetes versions) on every Kubernetes manifest;
#   2. envoy/check_configs.py: `envoy --mode validate` on every Envoy config (plain and assembled from
#      Istio patches), Istio CR fields, cross-references, `kvmesh-indexer --check`, the wasm OCI
#      layout, dashboard and rule metric names;
#   3. promtool check rules + promtool test rules (check_configs.py also runs promtool check config);
#   4. `kubectl kustomize envoy/k8s` (and envoy/k8s/gie) when kubectl is installed (optional);
#   5. envoy/check_exposure.py: the indexer API is loopback-only in every manifest (and the check
#      catches each way of breaking that, --self-test).
# Needs: `make setup` (venv, Envoy, promtool) and `make build` (wasm, kvmesh-indexer).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVMESH_TOOLS:-$PWD/.tools}/venv"
say() { printf 'validate: %s\n' "$*"; }

command -v promtool >/dev/null || { echo "promtool missing: run make setup" >&2; exit 1; }
[ -x "$VENV/bin/kubernetes-validate" ] || { echo "kubernetes-validate missing: run make setup" >&2; exit 1; }

# Kubernetes manifests (not kustomization.yaml, not the strategic-merge patch: neither is a resource).
manifests=(envoy/k8s/rbac.yaml envoy/k8s/envoy-configmap.yaml envoy/k8s/indexer-configmap.yaml
           envoy/k8s/deployment.yaml envoy/k8s/service.yaml envoy/k8s/pdb.yaml envoy/k8s/networkpolicy.yaml
           envoy/k8s/example-vllm.yaml envoy/istio/rbac.yaml envoy/istio/indexer-configmap.yaml
           envoy/istio/networkpolicy.yaml envoy/istio/gateway-bootstrap.yaml
           envoy/k8s/gie/rbac.yaml envoy/k8s/gie/epp-configmap.yaml envoy/k8s/gie/epp.yaml
           envoy/k8s/gie/networkpolicy.yaml)
# Not resources, or custom resources without an offline schema (check_configs.py checks those field
# by field: Istio's, and the GIE InferencePool, Gateways, HTTPRoutes and IstioOperator).
for f in envoy/k8s/*.yaml envoy/istio/*.yaml envoy/k8s/gie/*.yaml envoy/istio/gie/*.yaml; do
  case " ${manifests[*]} " in *" $f "*) ;; *)
    case "$f" in envoy/k8s/kustomization.yaml|envoy/istio/gateway-indexer-patch.yaml|envoy/istio/envoyfilter-*.yaml|envoy/istio/wasmplugin.yaml|envoy/istio/virtualservice.yaml) ;;
      envoy/k8s/gie/kustomization.yaml|envoy/k8s/gie/inferencepool.yaml|envoy/k8s/gie/gateway-agentgateway.yaml|envoy/istio/gie/*.yaml) ;;
      *) echo "validate: $f is not covered by envoy/validate.sh" >&2; exit 1 ;; esac ;;
  esac
done
for k in 1.30.0 1.37.0; do
  "$VENV/bin/kubernetes-validate" --strict --quiet -k "$k" "${manifests[@]}"
  say "kubernetes-validate --strict (Kubernetes $k): ${#manifests[@]} files OK"
done

"$VENV/bin/python" envoy/check_configs.py
# The indexer's API (/v1/*, no authentication) must not be reachable beyond its pod.
"$VENV/bin/python" envoy/check_exposure.py
"$VENV/bin/python" envoy/check_exposure.py --self-test

promtool check rules envoy/prometheus/kvmesh-rules.yaml
promtool test rules envoy/prometheus/kvmesh-rules.test.yaml

if command -v kubectl >/dev/null 2>&1; then
  out=$(mktemp); trap 'rm -f "$out"' EXIT
  kubectl kustomize envoy/k8s > "$out"
  "$VENV/bin/kubernetes-validate" --strict --quiet -k 1.37.0 "$out"
  say "kubectl kustomize envoy/k8s renders valid manifests"
  kubectl kustomize envoy/k8s/gie > /dev/null
  say "kubectl kustomize envoy/k8s/gie renders"
fi
say "all deployment files valid"
