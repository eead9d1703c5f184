#!/usr/bin/env python3
"""Fails if a shipped manifest exposes the kvmesh indexer's API (/v1/*, no authentication) beyond
its pod (run by envoy/validate.sh, so by `make test`).

Rules, for every indexer configuration shipped in a ConfigMap (`indexer.toml`) under envoy/k8s,
envoy/istio and their gie/ directories (the GIE endpoint picker):
  1. `listen` is a loopback address (the filter calls it on 127.0.0.1);
  2. `metrics_listen`, if set, is another port (it serves /metrics, /healthz, /readyz only);
  3. `debug_endpoints = true` only with a loopback `listen` (it is, by rule 1);
and for every Kubernetes object in those directories (strategic-merge patches included):
  4. no container declares the API port as a containerPort;
  5. no probe (httpGet/tcpSocket) targets the API port;
  6. no Service targets the API port;
  7. no NetworkPolicy admits the API port.
`--self-test` breaks a copy of the shipped files in each of those ways and checks that each break is
caught (so this check cannot silently pass everything).
"""
import copy
import ipaddress
import pathlib
import sys
import tomllib

import yaml

ROOT = pathlib.Path(__file__).resolve().parent
DIRS = [ROOT / "k8s", ROOT / "istio", ROOT / "k8s" / "gie", ROOT / "istio" / "gie"]


def host_port(addr):
    host, port = addr.rsplit(":", 1)
    return host.strip("[]"), int(port)


def load_docs():
    """[(path, doc)] for every YAML document under DIRS."""
    out = []
    for d in DIRS:
        for p in sorted(d.glob("*.yaml")):
            for doc in yaml.safe_load_all(p.read_text()):
                if isinstance(doc, dict):
                    out.append((p.relative_to(ROOT.parent), doc))
    return out


def walk(node):
    """Every dict nested in node."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def problems(docs):
    errs = []
    api_ports = set()
    for path, doc in docs:
        data = doc.get("data") if doc.get("kind") == "ConfigMap" else None
        if not data or "indexer.toml" not in data:
            continue
        cfg = tomllib.loads(data["indexer.toml"])
        host, port = host_port(cfg["listen"])
        api_ports.add(port)
        if not ipaddress.ip_address(host).is_loopback:
            errs.append(f"{path}: indexer listen = {cfg['listen']!r} is not loopback: /v1/* would be reachable from outside the pod")
        if "metrics_listen" in cfg and host_port(cfg["metrics_listen"])[1] == port:
            errs.append(f"{path}: metrics_listen {cfg['metrics_listen']!r} uses the API port")
        if cfg.get("debug_endpoints") is True and not ipaddress.ip_address(host).is_loopback:
            errs.append(f"{path}: debug_endpoints = true on a non-loopback listen")
    if not api_ports:
        errs.append("no indexer.toml found in any ConfigMap")
    for path, doc in docs:
        kind = doc.get("kind")
        for node in walk(doc):
            for c in node.get("containers", []) if isinstance(node.get("containers"), list) else []:
                named = {}
                for p in c.get("ports", []) or []:
                    named[p.get("name")] = p.get("containerPort")
                    if p.get("containerPort") in api_ports:
                        errs.append(f"{path}: container {c.get('name')} declares the indexer API port {p['containerPort']}")
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                    action = (c.get(probe) or {})
                    for k in ("httpGet", "tcpSocket"):
                        port = (action.get(k) or {}).get("port")
                        port = named.get(port, port)
                        if port in api_ports:
                            errs.append(f"{path}: {c.get('name')} {probe} targets the indexer API port {port}")
        if kind == "Service":
            for p in doc.get("spec", {}).get("ports", []):
                if p.get("targetPort", p.get("port")) in api_ports:
                    errs.append(f"{path}: Service {doc['metadata']['name']} targets the indexer API port")
        if kind == "NetworkPolicy":
            for rule in doc.get("spec", {}).get("ingress", []) or []:
                for p in rule.get("ports", []) or []:
                    if p.get("port") in api_ports:
                        errs.append(f"{path}: NetworkPolicy {doc['metadata']['name']} admits the indexer API port {p['port']}")
    return errs


def self_test(docs):
    """Each way of exposing the API, applied to a copy, must be caught."""

    def broken(edit):
        d = copy.deepcopy(docs)
        edit(d)
        return problems(d)

    def configmap(d):
        return next(doc for _, doc in d if doc.get("kind") == "ConfigMap" and "indexer.toml" in doc.get("data", {}))

    def first(d, kind):
        return next(doc for _, doc in d if doc.get("kind") == kind)

    def indexer_container(d):
        for _, doc in d:
            for node in walk(doc):
                for c in node.get("containers", []) if isinstance(node.get("containers"), list) else []:
                    if "indexer" in c.get("name", ""):
                        return c
        raise AssertionError("no indexer container")

    cases = {
        "listen on 0.0.0.0": lambda d: configmap(d)["data"].update({"indexer.toml": configmap(d)["data"]["indexer.toml"].replace('listen = "127.0.0.1:9100"', 'listen = "0.0.0.0:9100"', 1)}),
        "API containerPort": lambda d: indexer_container(d)["ports"].append({"name": "api", "containerPort": 9100}),
        "probe on the API": lambda d: indexer_container(d).update({"readinessProbe": {"httpGet": {"path": "/readyz", "port": 9100}}}),
        "Service to the API": lambda d: first(d, "Service")["spec"]["ports"].append({"name": "x", "port": 9100, "targetPort": 9100}),
        "NetworkPolicy admits the API": lambda d: first(d, "NetworkPolicy")["spec"]["ingress"].append({"ports": [{"port": 9100, "protocol": "TCP"}]}),
    }
    missed = [name for name, edit in cases.items() if not broken(edit)]
    if missed:
        print(f"check_exposure --self-test: NOT caught: {missed}", file=sys.stderr)
        return 1
    print(f"validate: check_exposure --self-test: all {len(cases)} exposures caught")
    return 0


def main():
    docs = load_docs()
    if "--self-test" in sys.argv:
        return self_test(docs)
    errs = problems(docs)
    for e in errs:
        print(f"check_exposure: {e}", file=sys.stderr)
    if errs:
        return 1
    print("validate: the indexer API is loopback-only in every shipped manifest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
