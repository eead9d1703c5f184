#!/usr/bin/env python3
"""Dev-only stubs for poking the filter in real Envoy (not used by any shipped test).

  stubs.py engine  PORT NAME          echo server: answers with the headers/body it received (SSE when "stream": true)
  stubs.py indexer PORT LOG FLEET     /v1/route, /v1/done, /v1/fleet; behaviour chosen by the request's "model":
                                      disagg | reject | slow | garbage | error500 | anything else = aggregate
"""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def read_body(h):
    if h.headers.get("transfer-encoding", "").lower() == "chunked":
        out = b""
        while True:
            size = int(h.rfile.readline().strip(), 16)
            if size == 0:
                h.rfile.readline()
                return out
            out += h.rfile.read(size)
            h.rfile.readline()
    n = int(h.headers.get("content-length") or 0)
    return h.rfile.read(n) if n else b""


class Base(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def send(self, status, obj, ctype="application/json"):
        body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def engine(port, name):
    class H(Base):
        def handle_any(self):
            raw = read_body(self)
            try:
                parsed = json.loads(raw)
            except Exception:
                parsed = None
            echo = {"worker": name, "method": self.command, "path": self.path,
                    "headers": {k.lower(): v for k, v in self.headers.items()},
                    "body_len": len(raw), "body_raw": raw.decode("utf-8", "replace"), "body": parsed}
            if isinstance(parsed, dict) and parsed.get("stream"):
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                chunks = [f"data: {json.dumps({'worker': name, 'i': i})}\n\n" for i in range(int(parsed.get("max_tokens") or 3))]
                chunks.append("data: [DONE]\n\n")
                for c in chunks:
                    b = c.encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
                    self.wfile.flush()
                    time.sleep(float(parsed.get("chunk_delay", 0.05)))
                self.wfile.write(b"0\r\n\r\n")
                return
            status = 400 if parsed is None and self.command == "POST" else 200
            self.send(status, echo)
        do_GET = do_POST = handle_any
    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()


def indexer(port, log_path, fleet_path):
    log = open(log_path, "a", buffering=1)

    class H(Base):
        def do_GET(self):
            if self.path == "/v1/fleet":
                log.write(json.dumps({"kind": "fleet"}) + "\n")
                return self.send(200, json.load(open(fleet_path)))
            self.send(404, {"error": "no"})

        def do_POST(self):
            raw = read_body(self)
            hdrs = {k.lower(): v for k, v in self.headers.items()}
            if self.path == "/v1/done":
                log.write(json.dumps({"kind": "done", "report": json.loads(raw)}) + "\n")
                return self.send(200, {"ok": True})
            if self.path != "/v1/route":
                return self.send(404, {"error": "no"})
            body = json.loads(raw)
            model = body.get("model", "")
            log.write(json.dumps({"kind": "route", "headers": hdrs, "body_len": len(raw), "model": model}) + "\n")
            fleet = json.load(open(fleet_path))["workers"]
            target = fleet[1]
            decision = {"endpoint": target["endpoint"], "fallbacks": [fleet[0]["endpoint"]], "worker": target["id"],
                        "mode": "aggregate", "overlap_blocks": 3, "isl_blocks": 4, "kv_transfer_params": None,
                        "reason": "stub: always the second worker"}
            if model == "disagg":
                decision.update(mode="disagg", overlap_blocks=0, isl_blocks=8,
                                kv_transfer_params={"do_remote_prefill": True, "do_remote_decode": False,
                                                    "remote_engine_id": "prefill-0", "remote_block_ids": [1, 2, 3]})
            elif model == "reject":
                return self.send(429, {"error": {"message": "prefill capacity exhausted", "type": "rate_limit_exceeded", "code": 429}})
            elif model == "slow":
                time.sleep(0.5)
            elif model == "garbage":
                return self.send(200, b"this is not json", "text/plain")
            elif model == "error500":
                return self.send(500, {"oops": 1})
            self.send(200, decision)
    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()


if __name__ == "__main__":
    if sys.argv[1] == "engine":
        engine(int(sys.argv[2]), sys.argv[3])
    else:
        indexer(int(sys.argv[2]), sys.argv[3], sys.argv[4])
