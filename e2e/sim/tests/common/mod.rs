//! Test harness: spawn the real `vllm-sim` binary, read its READY line, kill it on drop; poll
//! with a deadline (the harness's patience, `KVMESH_TEST_PATIENCE_S`); decode KV events like a router.
//! Set `KVMESH_TEST_SIM_LOG=1` to see the simulators' logs.

// Test harness: a failed unwrap is a failed test (clippy.toml allows this in #[test] fns only).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long any wait may take: the harness's one patience (`KVMESH_TEST_PATIENCE_S`).
pub use kvmesh_e2e::poll::patience;

/// Polls `f` until it returns `Some`, panicking with `what` after the patience.
pub fn poll<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + patience();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running simulator, killed when dropped.
pub struct Sim {
    child: Child,
    /// Worker id.
    pub id: String,
    /// `ip:port`.
    pub http: String,
    /// PUB endpoint.
    pub kv_events: Option<String>,
    /// ROUTER endpoint.
    pub replay: Option<String>,
}

impl Sim {
    /// Starts `vllm-sim` with `args` and waits for READY.
    pub fn spawn(args: &[&str]) -> Sim {
        let log = std::env::var_os("KVMESH_TEST_SIM_LOG").is_some();
        let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(if log { Stdio::inherit() } else { Stdio::null() })
            .spawn()
            .expect("spawn vllm-sim");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut sim =
            Sim { child, id: String::new(), http: String::new(), kv_events: None, replay: None };
        let line = match rx.recv_timeout(patience()) {
            Ok(line) => line,
            Err(e) => {
                let status = sim.child.try_wait();
                panic!("no READY line from vllm-sim {args:?}: {e} (exit status {status:?})");
            }
        };
        let fields: HashMap<&str, &str> = line
            .strip_prefix("READY ")
            .expect("READY line")
            .split(' ')
            .filter_map(|kv| kv.split_once('='))
            .collect();
        sim.id = fields["id"].to_owned();
        sim.http = fields["http"].to_owned();
        sim.kv_events = fields.get("kv_events").map(|s| s.to_string());
        sim.replay = fields.get("replay").map(|s| s.to_string());
        sim
    }

    /// `http://ip:port<path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.http.rsplit(':').next().and_then(|p| p.parse().ok()).expect("port")
    }

    /// POSTs JSON, returns (status, body).
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let resp = client().post(self.url(path)).json(body).send().expect("POST");
        let status = resp.status().as_u16();
        let text = resp.text().expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// GETs JSON.
    pub fn get(&self, path: &str) -> Value {
        client().get(self.url(path)).send().expect("GET").json().expect("JSON")
    }

    /// The value of a metric series (all series of `name` summed), 0 if absent.
    pub fn metric(&self, name: &str) -> f64 {
        let text =
            client().get(self.url("/metrics")).send().expect("metrics").text().expect("text");
        metric_value(&text, name)
    }

    /// The cached blocks as (hash, parent, tokens), from `GET /admin/cache`.
    pub fn cache(&self) -> Model {
        let dump = self.get("/admin/cache");
        let mut m = Model::default();
        for b in dump["blocks"].as_array().expect("blocks") {
            let tokens = b["token_ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|t| t.as_u64().expect("id") as u32)
                .collect();
            m.blocks.insert(
                b["block_hash"].as_u64().expect("hash"),
                (b["parent_block_hash"].as_u64(), tokens),
            );
        }
        m
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A blocking HTTP client with a deadline.
pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(patience()).build().expect("client")
}

/// Sums the series of `name` in Prometheus text (the project's one parser, strict: a line the
/// simulator emits that is not a sample fails the test), 0 if absent.
pub fn metric_value(text: &str, name: &str) -> f64 {
    let samples =
        kvmesh_core::prom::parse(text).expect("the simulator's /metrics is valid exposition");
    kvmesh_core::prom::sum(&samples, name).unwrap_or(0.0)
}

/// A decoded KV event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ev {
    /// `lora`: `(lora_id, lora_name)` of an adapter's blocks, `None` for the base model's.
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: usize,
        lora: Option<(u64, String)>,
    },
    Removed {
        hashes: Vec<u64>,
    },
    Cleared,
}

fn u64s(v: &rmpv::Value) -> Vec<u64> {
    v.as_array().expect("array").iter().map(|h| h.as_u64().expect("u64")).collect()
}

/// `lora_id` and `lora_name`: both set (an adapter) or both nil (the base model).
fn lora_of(id: &rmpv::Value, name: &rmpv::Value) -> Option<(u64, String)> {
    match (id.as_u64(), name.as_str()) {
        (Some(id), Some(name)) => Some((id, name.to_owned())),
        _ => {
            assert!(id.is_nil() && name.is_nil(), "lora_id {id} and lora_name {name} disagree");
            None
        }
    }
}

/// Decodes a batch payload, checking it uses the expected layout (`maps`: current).
pub fn decode_batch(payload: &[u8], maps: bool) -> (f64, Vec<Ev>, u64) {
    let v = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack");
    let top = v.as_array().expect("batch array");
    assert_eq!(top.len(), 3, "[ts, events, dp_rank]");
    let ts = top[0].as_f64().expect("ts");
    let rank = top[2].as_u64().expect("dp rank");
    let events = top[1]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| {
            if maps {
                let map = e.as_map().expect("current layout: map events");
                let get = |k: &str| {
                    map.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v.clone())
                };
                match get("type").and_then(|t| t.as_str().map(str::to_owned)).as_deref() {
                    Some("BlockStored") => {
                        assert_eq!(
                            get("medium").and_then(|m| m.as_str().map(str::to_owned)).as_deref(),
                            Some("GPU")
                        );
                        Ev::Stored {
                            hashes: u64s(&get("block_hashes").expect("hashes")),
                            parent: get("parent_block_hash").and_then(|p| p.as_u64()),
                            tokens: u64s(&get("token_ids").expect("ids"))
                                .into_iter()
                                .map(|t| t as u32)
                                .collect(),
                            block_size: get("block_size")
                                .and_then(|b| b.as_u64())
                                .expect("block size")
                                as usize,
                            lora: lora_of(
                                &get("lora_id").expect("lora_id is always present"),
                                &get("lora_name").expect("lora_name is always present"),
                            ),
                        }
                    }
                    Some("BlockRemoved") => {
                        Ev::Removed { hashes: u64s(&get("block_hashes").expect("hashes")) }
                    }
                    Some("AllBlocksCleared") => Ev::Cleared,
                    other => panic!("unknown event type {other:?}"),
                }
            } else {
                let a = e.as_array().expect("legacy layout: array events");
                match a[0].as_str() {
                    Some("BlockStored") => {
                        assert_eq!(a.len(), 12);
                        assert_eq!(a[6].as_str(), Some("GPU"));
                        Ev::Stored {
                            hashes: u64s(&a[1]),
                            parent: a[2].as_u64(),
                            tokens: u64s(&a[3]).into_iter().map(|t| t as u32).collect(),
                            block_size: a[4].as_u64().expect("block size") as usize,
                            lora: lora_of(&a[5], &a[7]),
                        }
                    }
                    Some("BlockRemoved") => Ev::Removed { hashes: u64s(&a[1]) },
                    Some("AllBlocksCleared") => Ev::Cleared,
                    other => panic!("unknown event tag {other:?}"),
                }
            }
        })
        .collect();
    (ts, events, rank)
}

/// A router's view of one worker's cache, rebuilt from events: hash → (parent, tokens).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Model {
    pub blocks: HashMap<u64, (Option<u64>, Vec<u32>)>,
}

impl Model {
    /// Applies one event, checking it is consistent with what came before.
    pub fn apply(&mut self, ev: &Ev) {
        match ev {
            Ev::Stored { hashes, parent, tokens, block_size, .. } => {
                assert_eq!(tokens.len(), hashes.len() * block_size, "token_ids cover the blocks");
                if let Some(p) = parent {
                    assert!(self.blocks.contains_key(p), "parent {p} of a stored block is unknown");
                }
                let mut parent = *parent;
                for (i, h) in hashes.iter().enumerate() {
                    let toks = tokens[i * block_size..(i + 1) * block_size].to_vec();
                    assert!(
                        self.blocks.insert(*h, (parent, toks)).is_none(),
                        "block {h} stored twice"
                    );
                    parent = Some(*h);
                }
            }
            Ev::Removed { hashes } => {
                for h in hashes {
                    assert!(self.blocks.remove(h).is_some(), "removed block {h} was not stored");
                }
            }
            Ev::Cleared => self.blocks.clear(),
        }
    }
}

/// A SUB client that detects sequence gaps and repairs them through the replay socket, the
/// way a router must.
pub struct Subscriber {
    ctx: zmq::Context,
    sub: zmq::Socket,
    replay: Option<String>,
    maps: bool,
    /// Last sequence number applied.
    pub last_seq: Option<u64>,
    /// The rebuilt cache.
    pub model: Model,
    /// Every batch applied, by sequence number, with how it arrived.
    pub applied: Vec<(u64, Vec<Ev>, Arrival)>,
    pub topic: Vec<u8>,
    pub ranks: Vec<u64>,
}

/// How a batch reached the subscriber.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    Pub,
    Replay,
}

impl Subscriber {
    /// Connects a SUB socket to `endpoint` with `topic`.
    pub fn connect(endpoint: &str, replay: Option<&str>, topic: &str, maps: bool) -> Self {
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB).expect("SUB");
        sub.set_subscribe(topic.as_bytes()).expect("subscribe");
        sub.set_rcvtimeo(100).expect("rcvtimeo");
        sub.connect(endpoint).expect("connect");
        Self {
            ctx,
            sub,
            replay: replay.map(str::to_owned),
            maps,
            last_seq: None,
            model: Model::default(),
            applied: Vec::new(),
            topic: topic.as_bytes().to_vec(),
            ranks: Vec::new(),
        }
    }

    /// Receives whatever arrives within ~100 ms; true if something was applied.
    pub fn pump(&mut self) -> bool {
        let Ok(frames) = self.sub.recv_multipart(0) else { return false };
        assert_eq!(frames.len(), 3, "[topic, seq, payload]");
        assert_eq!(frames[0], self.topic);
        let seq = u64::from_be_bytes(frames[1].as_slice().try_into().expect("8-byte seq"));
        if let Some(last) = self.last_seq {
            if seq <= last {
                return false; // already applied through replay
            }
            if seq > last + 1 {
                self.replay_from(last + 1, seq);
            }
        }
        self.apply(seq, &frames[2], Arrival::Pub);
        true
    }

    fn apply(&mut self, seq: u64, payload: &[u8], how: Arrival) {
        let (_, events, rank) = decode_batch(payload, self.maps);
        assert!(!events.is_empty(), "batches are never empty");
        for e in &events {
            self.model.apply(e);
        }
        self.ranks.push(rank);
        self.last_seq = Some(seq);
        self.applied.push((seq, events, how));
    }

    /// Replays `[from, until)` through a DEALER and applies it.
    pub fn replay_from(&mut self, from: u64, until: u64) {
        let ep = self.replay.clone().expect("a gap without a replay endpoint");
        let dealer = self.ctx.socket(zmq::DEALER).expect("DEALER");
        dealer
            .set_rcvtimeo(i32::try_from(patience().as_millis()).unwrap_or(i32::MAX))
            .expect("rcvtimeo");
        dealer.connect(&ep).expect("connect replay");
        dealer.send_multipart([&b""[..], &from.to_be_bytes()], 0).expect("replay request");
        loop {
            let frames = dealer.recv_multipart(0).expect("replay reply");
            assert!(frames[0].is_empty(), "delimiter first");
            // [""?, topic?, seq, payload]: topic framing has 4 frames, plain 3.
            let (seq_bytes, payload) = (&frames[frames.len() - 2], &frames[frames.len() - 1]);
            if frames.len() == 4 {
                assert!(frames[1] == self.topic || (frames[1].is_empty() && payload.is_empty()));
            }
            if seq_bytes.as_slice() == [0xff; 8] {
                assert!(payload.is_empty(), "end marker has an empty payload");
                break;
            }
            let seq = u64::from_be_bytes(seq_bytes.as_slice().try_into().expect("8-byte seq"));
            if seq < until && self.last_seq.is_none_or(|l| seq > l) {
                assert_eq!(seq, self.last_seq.map_or(from, |l| l + 1), "replay is gap-free");
                self.apply(seq, payload, Arrival::Replay);
            }
        }
    }

    /// Pumps until `cond(self)` holds (deadline: patience).
    pub fn until(&mut self, what: &str, mut cond: impl FnMut(&Self) -> bool) {
        let deadline = Instant::now() + patience();
        while !cond(self) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            self.pump();
        }
    }
}
