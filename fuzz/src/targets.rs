//! The fuzz targets: one function per parser of outside bytes, `fn(&[u8])`, that panics only when
//! the code under test panics or breaks a property stated here. Each is called by the proptest
//! runner (`make test`, `make fuzz`) and by a libFuzzer entry point (`fuzz_targets/`, cargo-fuzz).
//!
//! Properties beyond "does not panic": a decoded KV batch costs at most a bounded multiple of its
//! frame in memory (the byte budgets count decoded bytes); the sequencer's verdicts agree with its
//! state; a session header that parses re-encodes to itself; a splice into a valid JSON object
//! yields a valid object with the key set and every other key unchanged; a fleet file that loads
//! prints (as `--check` does) to a file that loads to the same configuration.

use kvmesh_core::openai::{self, Endpoint};
use kvmesh_core::session;
use kvmesh_filter::config::FilterConfig;
use kvmesh_filter::request::{self, RequestHead, MAX_META_VALUE_BYTES};
use kvmesh_filter::splice::splice_top_level;
use kvmesh_indexer::config::{Config, MapEnv};
use kvmesh_indexer::events::apply::apply_batch;
use kvmesh_indexer::events::decode::decode_batch;
use kvmesh_indexer::events::frames::{replay_frames, split_frames};
use kvmesh_indexer::events::sequencer::{Sequencer, Verdict};
use kvmesh_indexer::index::KvIndex;
use kvmesh_indexer::scrape::parse_engine_metrics;
use serde_json::Value;

/// Heap bytes a decoded batch may hold per byte of its frame (plus a constant): an event of two
/// wire bytes is one ~180-byte `KvEvent`, and vectors grow by doubling.
pub const MAX_DECODED_BYTES_PER_FRAME_BYTE: usize = 512;

/// A KV event payload: decode it; if it decodes, its size is bounded and it applies to an index
/// (block sizes 4 and 16: matching and mismatching stores) without panicking.
pub fn kv_batch(data: &[u8]) {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    let bytes = batch.heap_bytes();
    assert!(
        bytes <= MAX_DECODED_BYTES_PER_FRAME_BYTE * data.len() + 4096,
        "{} frame bytes decoded to {bytes} heap bytes",
        data.len()
    );
    let mut index = KvIndex::new(1 << 12, 1 << 10);
    index.add_worker(0);
    for block_size in [4, 16] {
        let _ = apply_batch(&mut index, 0, &batch, block_size);
    }
}

/// Length-prefixed frames (`len u8, bytes…` repeated), as a multipart ZMQ message.
fn frames(data: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut rest = data;
    while let Some((&len, tail)) = rest.split_first() {
        let n = usize::from(len).min(tail.len());
        out.push(tail[..n].to_vec());
        rest = &tail[n..];
    }
    out
}

/// A sequence number near the expected one: `v` as a signed delta, or the extremes.
fn seq_near(next: u64, v: u8) -> u64 {
    match v {
        0xff => u64::MAX,
        0xfe => u64::MAX - 1,
        0xfd => 0,
        _ => next.saturating_add_signed(i64::from(v as i8)),
    }
}

/// Live and replay framing, then the sequencer driven by the bytes. Layout: message length (u16
/// BE), the message (length-prefixed frames), then ops of two bytes (`op % 4` = live, replayed
/// through, empty replay, skip; the other byte picks the number).
pub fn kv_frames(data: &[u8]) {
    let (len, rest) = match data {
        [hi, lo, rest @ ..] => (usize::from(u16::from_be_bytes([*hi, *lo])), rest),
        _ => (0, data),
    };
    let (head, ops) = rest.split_at(len.min(rest.len()));
    let message = frames(head);
    if let Some((_, payload)) = split_frames(&message) {
        kv_batch(payload);
    }
    if let Ok(Some((_, payload))) = replay_frames(&message) {
        kv_batch(payload);
    }
    let mut s = Sequencer::new();
    for op in ops.chunks(2) {
        let [op, v] = op else { break };
        let next = s.next();
        let n = seq_near(next, *v);
        match op % 4 {
            0 => match s.on_live(n) {
                Verdict::Apply => {
                    assert_eq!(n, next, "applied out of order");
                    assert_eq!(s.next(), n.saturating_add(1));
                }
                Verdict::Gap { from, to } => {
                    assert!(
                        from < to && from == next && to == n,
                        "gap {from}..{to} for {n} expecting {next}"
                    );
                    assert_eq!(s.next(), next, "a gap changes nothing until recovered");
                }
                Verdict::Duplicate => assert!(n < next),
                Verdict::Restart { seq } => {
                    assert!(seq == n && n < next);
                    assert_eq!(s.next(), n.saturating_add(1));
                }
            },
            1 => {
                s.replayed(Some(n));
                assert!(s.next() > n || n == u64::MAX);
            }
            2 => {
                s.replayed(None);
                assert_eq!(s.next(), next);
            }
            _ => {
                s.skip_to(n);
                assert_eq!(s.next(), n.saturating_add(1));
            }
        }
    }
}

/// Header names the filter reads, picked by a byte (any other byte: a name from the bytes).
const HEADER_NAMES: [&str; 9] = [
    ":method",
    ":path",
    "content-length",
    "x-request-id",
    "x-session-id",
    "x-kvmesh-worker",
    "x-kvmesh-mode",
    "x-gateway-destination-endpoint",
    "x-other",
];

/// The filter's view of a request: header pairs (`name byte, len u8, value…` repeated) then the
/// body; the head, the session key and the `/v1/route` call built from them.
pub fn filter_request(data: &[u8]) {
    let mut pairs = Vec::new();
    let mut rest = data;
    while let [name, len, tail @ ..] = rest {
        if *name == b'{' {
            break; // the body starts
        }
        let n = usize::from(*len).min(tail.len());
        let name = HEADER_NAMES.get(usize::from(*name) % 12).map_or_else(
            || String::from_utf8_lossy(&tail[..n.min(8)]).to_lowercase(),
            |s| (*s).to_owned(),
        );
        pairs.push((name, tail[..n].to_vec()));
        rest = &tail[n..];
    }
    let head = RequestHead::from_headers(&pairs, "x-session-id");
    for v in [&head.request_id, &head.session_id, &head.override_worker, &head.override_mode]
        .into_iter()
        .flatten()
    {
        assert!(
            !v.is_empty() && v.len() <= MAX_META_VALUE_BYTES,
            "header value of {} bytes kept",
            v.len()
        );
    }
    let config = FilterConfig::default();
    for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
        // The filter's read; a skip to anywhere in the body must not panic either (the scan takes
        // only an offset right after an element, else reads on or declines).
        let body = openai::Body::new(endpoint, rest);
        let _ = body.peek(true, &mut |_| Some(rest.len() / 2));
        if let Ok(peeked) = body.peek(true, &mut |_| None) {
            let key = request::peeked_session_key(&head, &peeked, true);
            let call = request::route_call(
                &config,
                "id",
                endpoint,
                key,
                &head,
                std::rc::Rc::new(rest.to_vec()),
                None,
            );
            assert_eq!(
                call.body.as_deref().map(Vec::as_slice),
                Some(rest),
                "the route call carries the client's body unchanged"
            );
        }
    }
}

/// The body splice: first byte picks the key, the rest is the body.
pub fn filter_splice(data: &[u8]) {
    let Some((k, body)) = data.split_first() else {
        return;
    };
    let key = ["kv_transfer_params", "stream", "model", "", "a\"b"][usize::from(*k) % 5];
    let value = serde_json::json!({"do_remote_prefill": true, "remote_block_ids": [1, 2], "remote_host": "127.0.0.1"});
    let out = splice_top_level(body, key, &value);
    let Ok(Value::Object(before)) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    // A valid object must splice, to a valid object with the key set and the rest unchanged.
    let out = match out {
        Ok(o) => o,
        Err(e) => panic!("valid object refused: {e}"),
    };
    let Ok(Value::Object(after)) = serde_json::from_slice::<Value>(&out) else {
        panic!("splice made invalid JSON: {}", String::from_utf8_lossy(&out))
    };
    assert_eq!(after.get(key), Some(&value), "key not set");
    for (k, v) in &before {
        if k != key {
            assert_eq!(after.get(k), Some(v), "key {k:?} changed");
        }
    }
    assert_eq!(after.len(), before.len() + usize::from(!before.contains_key(key)));
}

/// The `/v1/route` request as the indexer reads it: the body for both paths (`openai::Body`'s
/// whole reads, raw fields, and a read resumed from the body's own prefix; the derived session key) and the first line as an `x-kvmesh-session` header.
pub fn route_request(data: &[u8]) {
    for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
        if let Ok(r) = openai::parse(endpoint, data) {
            let _ = session::derived_key(&r);
        }
        let body = openai::Body::new(endpoint, data);
        let _ = body.request_with_raw();
        // The body memo's read: whole, then a body continuing it from its own prefix.
        if let Some(prefix) = body.request_from(None).prefix {
            let _ = body.request_from(Some((data, &prefix)));
        }
    }
    let text = String::from_utf8_lossy(data);
    let line = text.lines().next().unwrap_or("");
    let _ = Endpoint::from_path(line);
    if let Some((key, source)) = session::parse_header(line) {
        let encoded = session::encode_header(key, source);
        assert_eq!(session::parse_header(&encoded), Some((key, source)), "{line:?} → {encoded:?}");
    }
}

/// An engine's `/metrics` text.
pub fn engine_metrics(data: &[u8]) {
    let _ = parse_engine_metrics(&String::from_utf8_lossy(data));
}

/// A fleet file, as TOML and as YAML; one that loads round-trips through its printed form.
pub fn fleet_file(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let env = MapEnv::default();
    if let Ok(config) = Config::from_toml_str(&text, &env) {
        let printed = match toml::to_string_pretty(&config) {
            Ok(p) => p,
            Err(e) => panic!("a loaded config does not print: {e}"),
        };
        match Config::from_toml_str(&printed, &env) {
            Ok(again) => assert_eq!(again, config, "printed:\n{printed}"),
            Err(e) => panic!("the printed config does not load: {e}\n{printed}"),
        }
    }
    let _ = Config::from_yaml_str(&text, &env);
}

/// The filter's plugin configuration bytes.
pub fn filter_config(data: &[u8]) {
    if let Ok(c) = FilterConfig::from_bytes(Some(data)) {
        let _ = c.tick_period_ms(true);
    }
}
