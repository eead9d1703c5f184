#!/usr/bin/env bash
# Dev-only manual experiment: real Envoy + the built wasm + Python stubs (engines, indexer).
# Starts everything on fixed loopback ports under $DIR and leaves it running; `stop` kills it.
#   filter/dev/experiment.sh start [filter-config-json]   |   filter/dev/experiment.sh stop
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
DIR=${DIR:-/tmp/kvmesh-filter-dev}
ENVOY=${KVMESH_ENVOY:-$repo/.tools/bin/envoy}
WASM=${KVMESH_WASM:-$repo/target/wasm32-wasip1/wasm/kvmesh_filter.wasm}
P_LISTEN=${P_LISTEN:-18080}; P_ADMIN=${P_ADMIN:-19901}; P_INDEXER=${P_INDEXER:-19100}; P_W0=${P_W0:-18001}; P_W1=${P_W1:-18002}

stop() {
  for f in "$DIR"/*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true; rm -f "$f"; done
}

case "${1:-start}" in
stop) stop; exit 0 ;;
indexer-down) kill "$(cat "$DIR/indexer.pid")"; rm -f "$DIR/indexer.pid"; exit 0 ;;
indexer-up)
  python3 "$here/stubs.py" indexer "$P_INDEXER" "$DIR/indexer.log" "$DIR/fleet.json" & echo $! > "$DIR/indexer.pid"; exit 0 ;;
esac

stop
mkdir -p "$DIR"
CONFIG=${2:-'{"session_header":"x-session-id","debug_headers":true,"session_prefix_units":64,"fleet_refresh_ms":200}'}
cat > "$DIR/fleet.json" <<JSON
{"generation":1,"block_size":16,"workers":[
 {"id":"w0","endpoint":"127.0.0.1:$P_W0","role":"decode","healthy":true},
 {"id":"w1","endpoint":"127.0.0.1:$P_W1","role":"decode","healthy":true}]}
JSON
python3 - "$DIR/vars.json" <<PY
import json, sys
json.dump(dict(listen_host="127.0.0.1", listen_port=$P_LISTEN, admin_port=$P_ADMIN, indexer_host="127.0.0.1",
  indexer_port=$P_INDEXER, wasm_path="$WASM", filter_config_json='''$CONFIG''',
  workers=[dict(id="w0", host="127.0.0.1", port=$P_W0), dict(id="w1", host="127.0.0.1", port=$P_W1)],
  max_body_bytes=${MAX_BODY:-65536}, policy="${POLICY:-kvmesh}", session_header="x-session-id", upstream_timeout_s=300),
  open(sys.argv[1], "w"))
PY
python3 "$here/render.py" "$DIR/vars.json" > "$DIR/envoy.yaml"
: > "$DIR/indexer.log"
python3 "$here/stubs.py" engine "$P_W0" w0 & echo $! > "$DIR/w0.pid"
python3 "$here/stubs.py" engine "$P_W1" w1 & echo $! > "$DIR/w1.pid"
python3 "$here/stubs.py" indexer "$P_INDEXER" "$DIR/indexer.log" "$DIR/fleet.json" & echo $! > "$DIR/indexer.pid"
"$ENVOY" -c "$DIR/envoy.yaml" --disable-hot-restart --concurrency 2 -l "${LOG_LEVEL:-info}" --component-log-level wasm:debug \
  > "$DIR/envoy.log" 2>&1 & echo $! > "$DIR/envoy.pid"
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$P_ADMIN/ready" >/dev/null && break; sleep 0.1; done
curl -sf "http://127.0.0.1:$P_ADMIN/ready" >/dev/null || { tail -20 "$DIR/envoy.log"; exit 1; }
echo "envoy ready: http://127.0.0.1:$P_LISTEN (admin $P_ADMIN), logs in $DIR"
