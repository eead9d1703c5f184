//! Faults of the endpoint picker on real Envoy (issue 45, point 5), beside the wasm path; and the
//! `both` edge, where the wasm filter routes what the picker did not (point 4).
//!
//! The picker is the indexer process serving `[epp]`. Each fault is injected into a running stack
//! and one request is sent through the gateway over a plain HTTP/1.1 connection, so that a fault
//! can land between two parts of the body:
//!
//! - `dead_before`: SIGKILL, then — on the edges with the picker — until Envoy's gRPC health check
//!   has marked it down (`cluster.kvmesh_epp.membership_healthy` 0), then the request.
//! - `killed_mid_body`: the client sends the headers and half the body; once Envoy has sent the
//!   first body chunk on the ext_proc stream (its `stream_msgs_sent` counter) the test SIGKILLs the
//!   picker; then the client sends the rest. On the `both` edge a buffer filter in front of
//!   ext_proc holds the body until it is whole, so there the first chunk reaching the picker is
//!   the whole body: the picker is stopped before the upload ends (so it cannot answer first) and
//!   killed once Envoy has sent it the body. On the wasm edge likewise, the indexer once the
//!   filter's `/v1/route` call (the whole body) is out to it.
//! - `terminated_mid_body`: the same with SIGTERM — a rolling restart, the picker draining the
//!   streams it holds.
//! - `hung`: SIGSTOP before the request (the picker keeps its sockets and answers nothing).
//! - `nothing_eligible`: the request's GIE subset hint names no endpoint of the pool (the
//!   `x-gateway-destination-endpoint-subset` header, which these stacks' Envoy turns into the
//!   `envoy.lb.subset_hint` metadata), so the picker answers an immediate 503 — a picker that
//!   answers an error while it stays healthy. (A picker whose fleet is empty is not ready: its
//!   health says NOT_SERVING and Envoy stops calling it, as for a dead one.)
//!
//! The stacks wait [`PICKER_WAIT_MS`] for the picker (ext_proc's `message_timeout`, and the idle
//! timeout of the ext_proc edge's `kvmesh_picking` route) so that a hung picker's row is measured
//! in seconds.
//!
//! Each row records what the client got (status, how long after its last byte, whether an
//! engine served it) and Envoy's ext_proc counters, and is printed (`FAULT-ROW`) before anything
//! is asserted, so one run gives the whole table (`e2e/README.md`, "Faults of the endpoint
//! picker"). The assertions are what the shipped configuration does, not what one would like:
//! where ext_proc cannot fail open (a body already streamed to the picker) the test says so.
//!
//! The wasm path's own fault tests go deeper — `indexer_down_fallback.rs` (sessions keep their
//! worker), `hung_indexer.rs` (the breaker, bounded connections), `fail_open.rs` (indexer errors)
//! — so its rows here are the same single request, for the table's side-by-side times.

use std::time::{Duration, Instant};

use kvmesh_core::headers;
use kvmesh_e2e::client::{chat_body, filler, post_json, SIM_WORKER};
use kvmesh_e2e::poll;
use kvmesh_e2e::procs::Paused;
use kvmesh_e2e::stack::{Edge, Stack, StackSpec};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long Envoy waits for the picker in these stacks (`StackSpec::epp_message_timeout_ms`): a
/// hung picker's request is answered — or goes on without it — after one or two such waits.
const PICKER_WAIT_MS: u64 = 2_000;
/// How long the client waits for an answer before it counts as none.
const CLIENT_PATIENCE: Duration = Duration::from_secs(30);
/// The bound on an answer to a request whose picker failed, hung included: it says "bounded", not
/// how fast (a loaded 2-core machine; the measured times are in the README).
const FAULT_BOUND: Duration = Duration::from_secs(10);
/// Words of filler in each request's chat message: a ~20 KB body, so half of it is a chunk of its
/// own on the ext_proc stream.
const WORDS: usize = 3000;
/// GIE's subset hint as a request header (these stacks' Envoy turns it into the metadata).
const SUBSET_HINT: &str = "x-gateway-destination-endpoint-subset";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    DeadBefore,
    KilledMidBody,
    TerminatedMidBody,
    Hung,
    NothingEligible,
}

impl Fault {
    const ALL: [Fault; 5] = [
        Fault::NothingEligible,
        Fault::DeadBefore,
        Fault::KilledMidBody,
        Fault::TerminatedMidBody,
        Fault::Hung,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::DeadBefore => "dead_before",
            Self::KilledMidBody => "killed_mid_body",
            Self::TerminatedMidBody => "terminated_mid_body",
            Self::Hung => "hung",
            Self::NothingEligible => "nothing_eligible",
        }
    }
}

/// What the client got for one request.
#[derive(Debug, Clone, Default)]
struct Seen {
    /// None: no answer within [`CLIENT_PATIENCE`] (or the connection closed without one).
    status: Option<u16>,
    headers: Vec<(String, String)>,
    body: String,
    /// From the client's last body byte to the answer's first byte (zero when the answer came
    /// first: see `early`).
    waited: Duration,
    /// The answer came before the client had sent its whole body.
    early: bool,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The engine that served the request (vllm-sim's own header).
    fn engine(&self) -> Option<&str> {
        self.header(SIM_WORKER)
    }

    fn status_text(&self) -> String {
        self.status.map_or_else(|| "none".to_owned(), |s| s.to_string())
    }
}

/// One measured fault on one edge.
#[derive(Debug, Clone)]
struct Row {
    edge: &'static str,
    fault: Fault,
    seen: Seen,
    /// Requests the engines finished or refused meanwhile (their counters, summed).
    engine_requests: f64,
    /// Envoy's ext_proc counters that moved (`streams_failed`, `failure_mode_allowed`, …).
    ext_proc: Vec<(String, u64)>,
}

impl Row {
    fn print(&self) {
        let moved: Vec<String> = self.ext_proc.iter().map(|(k, v)| format!("{k}+{v}")).collect();
        eprintln!(
            "FAULT-ROW | {} | {} | status {} | {} {} ms | engine {} (engine requests +{}) | ext_proc {} | {}",
            self.edge,
            self.fault.name(),
            self.seen.status_text(),
            if self.seen.early { "answered before the body ended," } else { "after the last byte" },
            self.seen.waited.as_millis(),
            self.seen.engine().unwrap_or("-"),
            self.engine_requests,
            if moved.is_empty() { "-".to_owned() } else { moved.join(" ") },
            self.seen.body.chars().take(160).collect::<String>().replace('\n', " "),
        );
    }

    fn served(&self) -> bool {
        self.seen.status == Some(200) && self.seen.engine().is_some()
    }
}

/// One request on its own HTTP/1.1 connection, written in parts as a test chooses
/// ([`Conn::send`]), its answer read as it comes: a reader runs from the start, so an answer
/// Envoy sends before the body is complete (then closing) is not lost.
struct Conn {
    wr: tokio::net::tcp::OwnedWriteHalf,
    reader: tokio::task::JoinHandle<(Vec<u8>, Option<Instant>)>,
    last_sent: Instant,
}

impl Conn {
    /// Connects to the gateway and sends a chat POST's headers for a body of `len` bytes, with
    /// `extra` headers.
    async fn open(
        port: u16,
        session: &str,
        len: usize,
        extra: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let (mut rd, mut wr) = stream.into_split();
        let reader = tokio::spawn(async move {
            let (mut buf, mut first) = (Vec::new(), None);
            let mut chunk = vec![0u8; 16 * 1024];
            loop {
                match rd.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        first.get_or_insert_with(Instant::now);
                        buf.extend_from_slice(&chunk[..n]);
                    }
                }
            }
            (buf, first)
        });
        let extra: String = extra.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: kvmesh\r\ncontent-type: application/json\r\n\
             content-length: {len}\r\n{}: {session}\r\n{extra}connection: close\r\n\r\n",
            headers::DEFAULT_SESSION_HEADER
        );
        wr.write_all(head.as_bytes()).await?;
        wr.flush().await?;
        Ok(Self { wr, reader, last_sent: Instant::now() })
    }

    /// Sends more of the body. Envoy may have answered and closed already: the bytes then have
    /// nowhere to go, which is not the test's error.
    async fn send(&mut self, bytes: &[u8]) {
        let _ = self.wr.write_all(bytes).await;
        let _ = self.wr.flush().await;
        self.last_sent = Instant::now();
    }

    /// The answer, waited for up to [`CLIENT_PATIENCE`] after the last bytes sent.
    async fn answer(mut self) -> anyhow::Result<Seen> {
        let (buf, first) = match tokio::time::timeout(CLIENT_PATIENCE, &mut self.reader).await {
            Ok(r) => r?,
            Err(_) => {
                self.reader.abort();
                return Ok(Seen { waited: CLIENT_PATIENCE, ..Seen::default() });
            }
        };
        let mut seen = parse_response(&buf);
        if let Some(first) = first {
            seen.early = first < self.last_sent;
            seen.waited = first.saturating_duration_since(self.last_sent);
        }
        Ok(seen)
    }
}

/// One whole request with `extra` headers, sent at once.
async fn whole(
    port: u16,
    session: &str,
    body: &[u8],
    extra: &[(&str, &str)],
) -> anyhow::Result<Seen> {
    let mut conn = Conn::open(port, session, body.len(), extra).await?;
    conn.send(body).await;
    conn.answer().await
}

/// An HTTP/1.1 response as read off the wire (status line, headers; the body as text).
fn parse_response(buf: &[u8]) -> Seen {
    let text = String::from_utf8_lossy(buf);
    let Some((head, body)) = text.split_once("\r\n\r\n") else { return Seen::default() };
    let mut lines = head.lines();
    let status =
        lines.next().and_then(|l| l.split_whitespace().nth(1)).and_then(|s| s.parse().ok());
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Seen { status, headers, body: body.to_owned(), ..Seen::default() }
}

/// A chat request of about 20 KB for `session`, distinct per seed.
fn request_body(seed: u64) -> Vec<u8> {
    let body = chat_body(&[("user".into(), filler(seed, WORDS))], 2);
    serde_json::to_vec(&body).unwrap_or_default()
}

/// `name: value` lines of Envoy's admin `/stats` whose name matches `filter` (a regex).
async fn envoy_stats(stack: &Stack, filter: &str) -> anyhow::Result<Vec<(String, u64)>> {
    let text = stack
        .client()
        .get(stack.admin(&format!("/stats?filter={filter}")))
        .send()
        .await?
        .text()
        .await?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let (name, value) = l.split_once(": ")?;
            Some((name.trim().to_owned(), value.trim().parse().ok()?))
        })
        .collect())
}

/// Envoy's ext_proc counters and the connection manager's timeouts, by their last name segment
/// (summed over filter instances).
async fn ext_proc_counters(stack: &Stack) -> anyhow::Result<Vec<(String, u64)>> {
    let mut out: Vec<(String, u64)> = Vec::new();
    let filter = "\\.ext_proc\\.|^http\\.kvmesh\\.downstream_rq_(idle_)?timeout$";
    for (name, value) in envoy_stats(stack, filter).await? {
        let short = name.rsplit('.').next().unwrap_or(&name).to_owned();
        match out.iter_mut().find(|(n, _)| *n == short) {
            Some((_, v)) => *v += value,
            None => out.push((short, value)),
        }
    }
    Ok(out)
}

fn counter(counters: &[(String, u64)], name: &str) -> u64 {
    counters.iter().find(|(n, _)| n == name).map_or(0, |(_, v)| *v)
}

/// The counters that moved between two readings.
fn moved(before: &[(String, u64)], after: &[(String, u64)]) -> Vec<(String, u64)> {
    after
        .iter()
        .filter_map(|(n, v)| {
            let d = v.saturating_sub(counter(before, n));
            (d > 0).then(|| (n.clone(), d))
        })
        .collect()
}

/// Requests the engines finished, refused or saw aborted.
async fn engine_requests(stack: &Stack) -> anyhow::Result<f64> {
    Ok(stack.engine_sum("vllm:request_success_total").await?
        + stack.engine_sum("kvmesh_sim_requests_rejected_total").await?
        + stack.engine_sum("kvmesh_sim_requests_aborted_total").await?)
}

/// `kvmesh_epp_requests_total{result}` at the indexer (None while it is down).
async fn epp_requests(stack: &Stack, result: &str) -> Option<f64> {
    let m = stack.scrape(&stack.indexer_url("/metrics")).await.ok()?;
    Some(m.sum("kvmesh_epp_requests_total", &[("result", result)]))
}

/// Waits until a request through the gateway is routed the healthy way: by the picker on an
/// ext_proc edge (its `routed` count moves), by the indexer's decision on the wasm edge (no
/// fallback header; each Envoy worker thread's breaker may still be open after a fault).
async fn wait_routed(stack: &Stack, ext_proc: bool, seed: &mut u64) -> anyhow::Result<()> {
    let url = stack.gateway("/v1/chat/completions");
    poll::until("requests routed by the picker (or the indexer) again", || {
        *seed += 1;
        let (c, url) = (stack.client().clone(), url.clone());
        let body = chat_body(&[("user".into(), filler(*seed, 40))], 2);
        async move {
            let before = epp_requests(stack, "routed").await;
            let r = post_json(&c, &url, &body, &[]).await.ok()?;
            if r.status != 200 {
                return None;
            }
            if ext_proc {
                let after = epp_requests(stack, "routed").await?;
                (after > before?).then_some(())
            } else {
                r.header(headers::DEBUG_FALLBACK).is_none().then_some(())
            }
        }
    })
    .await
}

/// Waits until the request has reached the picker: Envoy has sent two more ext_proc messages
/// than `sent_before` (the headers and a body chunk) — or, on the wasm edge, the filter's
/// `/v1/route` call (which carries the whole body) is out to the indexer.
async fn wait_request_reached(stack: &Stack, edge: Edge, sent_before: u64) -> anyhow::Result<()> {
    poll::until("the request reaching the picker", move || async move {
        if edge.uses_epp() {
            let c = ext_proc_counters(stack).await.ok()?;
            (counter(&c, "stream_msgs_sent") >= sent_before + 2).then_some(())
        } else {
            let s =
                envoy_stats(stack, "^cluster\\.kvmesh_indexer\\.upstream_rq_active$").await.ok()?;
            (s.iter().map(|(_, v)| v).sum::<u64>() >= 1).then_some(())
        }
    })
    .await
}

/// Waits until Envoy's health check of `kvmesh_epp` has marked the picker down.
async fn wait_picker_marked_down(stack: &Stack) -> anyhow::Result<()> {
    poll::until("Envoy's health check marking the picker down", || async {
        let s = envoy_stats(stack, "^cluster\\.kvmesh_epp\\.membership_healthy$").await.ok()?;
        (s.first().map(|(_, v)| *v) == Some(0)).then_some(())
    })
    .await?;
    // The stat is the main thread's; each worker thread gets the new host set in a posted update.
    // A request a worker takes before that lands still picks the dead host, and its stream fails
    // after the body went out (a 500, seen once on a machine at load 12): give the post time.
    tokio::time::sleep(WORKER_HOST_SET_LAG).await;
    Ok(())
}

/// How long Envoy's workers may lag the main thread's host set on a busy machine.
const WORKER_HOST_SET_LAG: Duration = Duration::from_millis(500);

fn signal_picker(pid: u32, signal: Signal) -> anyhow::Result<()> {
    kill(Pid::from_raw(i32::try_from(pid)?), signal)?;
    Ok(())
}

fn picker_pid(stack: &Stack) -> anyhow::Result<u32> {
    stack.indexer.as_ref().map(|p| p.pid()).ok_or_else(|| anyhow::anyhow!("no picker running"))
}

/// Injects `fault`, sends one request through it, and heals the stack after.
async fn measure(
    stack: &mut Stack,
    name: &'static str,
    edge: Edge,
    fault: Fault,
    seed: &mut u64,
) -> anyhow::Result<Row> {
    // The edges with the wasm filter keep the buffer filter in front: the picker (or the
    // indexer's `/v1/route`) gets the body only once it is whole.
    let buffered = edge.uses_wasm();
    wait_routed(stack, edge.uses_epp(), seed).await?;
    *seed += 1;
    let body = request_body(*seed);
    let session = format!("fault-{}-{}", fault.name(), *seed);
    let port = stack.gateway_port;
    let engines_before = engine_requests(stack).await?;
    let ext_before = ext_proc_counters(stack).await?;
    let seen = match fault {
        Fault::DeadBefore => {
            stack.kill_indexer();
            if edge.uses_epp() {
                wait_picker_marked_down(stack).await?;
            }
            whole(port, &session, &body, &[]).await?
        }
        Fault::KilledMidBody | Fault::TerminatedMidBody => {
            let sent_before = counter(&ext_before, "stream_msgs_sent");
            let pid = picker_pid(stack)?;
            let signal =
                if fault == Fault::KilledMidBody { Signal::SIGKILL } else { Signal::SIGTERM };
            let half = body.len() / 2;
            let mut conn = Conn::open(port, &session, body.len(), &[]).await?;
            conn.send(&body[..half]).await;
            if buffered {
                // The picker's stream (the route call) starts once the whole body is in, and is
                // answered within milliseconds: stopped meanwhile, the picker holds the request
                // unanswered until the signal lands.
                let paused = Paused::stop(pid)?;
                conn.send(&body[half..]).await;
                wait_request_reached(stack, edge, sent_before).await?;
                signal_picker(pid, signal)?;
                paused.resume();
            } else {
                wait_request_reached(stack, edge, sent_before).await?;
                signal_picker(pid, signal)?;
                conn.send(&body[half..]).await;
            }
            conn.answer().await?
        }
        Fault::Hung => {
            let paused = Paused::stop(picker_pid(stack)?)?;
            let seen = whole(port, &session, &body, &[]).await?;
            paused.resume();
            seen
        }
        Fault::NothingEligible => {
            // No port 1 in the pool; the wasm edge passes the header on unread.
            whole(port, &session, &body, &[(SUBSET_HINT, "127.0.0.1:1")]).await?
        }
    };
    let ext_after = ext_proc_counters(stack).await?;
    // A served request is counted before its answer ends; a refused one at once.
    let engine_delta = engine_requests(stack).await? - engines_before;
    let row = Row {
        edge: name,
        fault,
        seen,
        engine_requests: engine_delta,
        ext_proc: moved(&ext_before, &ext_after),
    };
    row.print();
    match fault {
        Fault::DeadBefore | Fault::KilledMidBody | Fault::TerminatedMidBody => {
            stack.restart_indexer().await?;
        }
        Fault::NothingEligible | Fault::Hung => {}
    }
    Ok(row)
}

/// Starts a stack on `edge` and measures every fault on it.
async fn measure_edge(name: &'static str, edge: Edge) -> anyhow::Result<Vec<Row>> {
    let both = matches!(edge, Edge::Both { .. });
    let mut spec = StackSpec::aggregate(2);
    spec.edge = edge;
    spec.epp_message_timeout_ms = PICKER_WAIT_MS;
    // The subset hint from its header (`EppTarget::subset_from_header`): `nothing_eligible`.
    spec.epp_conformance = true;
    spec.filter_config = json!({"debug_headers": true, "defer_to_picker": both});
    let mut stack = Stack::start(spec).await?;
    let mut seed = 1_000;
    let mut rows = Vec::new();
    for fault in Fault::ALL {
        rows.push(measure(&mut stack, name, edge, fault, &mut seed).await?);
    }
    Ok(rows)
}

/// The row of `fault` ([`measure_edge`] measures every fault, in [`Fault::ALL`]'s order).
fn row(rows: &[Row], fault: Fault) -> &Row {
    &rows[Fault::ALL.iter().position(|f| *f == fault).unwrap_or_default()]
}

/// Every fault, a hung picker included: the client has its answer within [`FAULT_BOUND`].
fn assert_bounds(rows: &[Row]) {
    for r in rows {
        let bound = FAULT_BOUND;
        assert!(
            r.seen.status.is_some(),
            "{} {}: no answer in {CLIENT_PATIENCE:?}",
            r.edge,
            r.fault.name()
        );
        assert!(
            r.seen.waited <= bound,
            "{} {}: answered {:?} after the request, past {bound:?}",
            r.edge,
            r.fault.name(),
            r.seen.waited
        );
    }
}

/// A hung picker on the ext_proc edge: Envoy times no FULL_DUPLEX_STREAMED message, so the
/// request — without the picker's destination header yet — sits on the `kvmesh_picking` route,
/// whose idle timeout answers it 504. Failed (after the body, ext_proc cannot fail open), but in
/// bounded time.
fn assert_hung_picker_times_out(rows: &[Row]) {
    let r = row(rows, Fault::Hung);
    assert_eq!(r.seen.status, Some(504), "{r:?}");
    assert!(r.seen.engine().is_none() && r.engine_requests == 0.0, "{r:?}");
    assert!(counter(&r.ext_proc, "downstream_rq_idle_timeout") >= 1, "{r:?}");
}

fn assert_picker_answers_nothing_eligible(rows: &[Row]) {
    let r = row(rows, Fault::NothingEligible);
    assert_eq!(r.seen.status, Some(503), "{}: {r:?}", r.edge);
    assert_eq!(r.seen.header("retry-after"), Some("1"), "{}: {r:?}", r.edge);
    assert!(r.seen.body.contains("no_eligible_endpoint"), "{}: {}", r.edge, r.seen.body);
    assert!(r.seen.engine().is_none() && r.engine_requests == 0.0, "{}: {r:?}", r.edge);
}

/// The picker's failure `fault` answered by Envoy itself with a 500; no engine saw the request.
fn assert_failed_by_envoy(rows: &[Row], fault: Fault) -> &Row {
    let r = row(rows, fault);
    assert_eq!(r.seen.status, Some(500), "{r:?}");
    assert!(r.seen.engine().is_none() && r.engine_requests == 0.0, "{r:?}");
    r
}

/// SIGTERM mid-body is a rolling restart, not a crash: the indexer drains the picker's streams
/// before it exits, so the request in flight is routed and served.
fn assert_terminated_picker_drains(rows: &[Row]) {
    let r = row(rows, Fault::TerminatedMidBody);
    assert!(r.served(), "{}: {r:?}", r.edge);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext_proc_failing_open() -> anyhow::Result<()> {
    let rows = measure_edge("ext_proc allow", Edge::ExtProc { failure_mode_allow: true }).await?;
    assert_bounds(&rows);
    assert_picker_answers_nothing_eligible(&rows);
    // A picker the health check marked down is not called: the stream fails as it opens, before
    // any body byte, and the request goes on to the engines' fallback LB.
    let r = row(&rows, Fault::DeadBefore);
    assert!(r.served(), "{r:?}");
    assert!(counter(&r.ext_proc, "failure_mode_allowed") >= 1, "{r:?}");
    // A picker that dies once the body streamed to it fails the request whatever
    // failure_mode_allow says: Envoy 1.40 fails open in FULL_DUPLEX_STREAMED only while no body
    // byte reached the filter.
    let r = assert_failed_by_envoy(&rows, Fault::KilledMidBody);
    assert_eq!(counter(&r.ext_proc, "failure_mode_allowed"), 0, "{r:?}");
    assert_eq!(counter(&r.ext_proc, "streams_failed"), 1, "{r:?}");
    assert_terminated_picker_drains(&rows);
    assert_hung_picker_times_out(&rows);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ext_proc_failing_closed() -> anyhow::Result<()> {
    let rows = measure_edge("ext_proc deny", Edge::ExtProc { failure_mode_allow: false }).await?;
    assert_bounds(&rows);
    assert_picker_answers_nothing_eligible(&rows);
    // Every failure of the picker is the client's 500, and no engine sees the request.
    for fault in [Fault::DeadBefore, Fault::KilledMidBody] {
        assert_failed_by_envoy(&rows, fault);
    }
    assert_terminated_picker_drains(&rows);
    assert_hung_picker_times_out(&rows);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wasm_path_in_the_same_faults() -> anyhow::Result<()> {
    let rows = measure_edge("wasm", Edge::Wasm).await?;
    assert_bounds(&rows);
    // The filter holds the whole body before it asks, so no fault of the indexer — whenever it
    // comes — fails a request: it falls back (indexer_down_fallback.rs, hung_indexer.rs,
    // fail_open.rs test what the fallback keeps).
    for r in &rows {
        assert!(r.served(), "{r:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_both_edge_fails_open_to_the_filter() -> anyhow::Result<()> {
    let rows = measure_edge("both allow", Edge::Both { failure_mode_allow: true }).await?;
    assert_bounds(&rows);
    // The picker's own answer reaches the client: the filter after it never sees the request.
    assert_picker_answers_nothing_eligible(&rows);
    // The body goes to the picker STREAMED (Envoy keeps its copy), so failure_mode_allow holds
    // whenever the picker fails:
    // dead (not called), killed with the request on its stream, or hung past message_timeout, the
    // request goes on to the wasm filter, which routes it (its own fallback: the indexer is the
    // same process) — served, not failed.
    for fault in [Fault::DeadBefore, Fault::KilledMidBody, Fault::Hung] {
        let r = row(&rows, fault);
        assert!(r.served(), "{r:?}");
        assert!(r.seen.header(headers::DEBUG_FALLBACK).is_some(), "the filter's fallback: {r:?}");
    }
    for fault in [Fault::KilledMidBody, Fault::Hung] {
        let r = row(&rows, fault);
        assert!(counter(&r.ext_proc, "failure_mode_allowed") >= 1, "{r:?}");
    }
    assert!(counter(&row(&rows, Fault::Hung).ext_proc, "message_timeouts") >= 1);
    assert_terminated_picker_drains(&rows);
    Ok(())
}

/// The `both` edge (issue 45 point 4): with the picker up every request is placed by it and the
/// filter only lets it go (no `/v1/route` call of its own); with the picker killed, ext_proc
/// fails open and the filter routes every request (on its own fallback: the indexer is the same
/// process); after the restart the picker places them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_both_edge_routes_by_the_picker_and_falls_back_to_the_filter() -> anyhow::Result<()> {
    const SESSIONS: u64 = 6;
    let mut spec = StackSpec::aggregate(3);
    spec.edge = Edge::Both { failure_mode_allow: true };
    spec.filter_config = json!({"debug_headers": true, "defer_to_picker": true});
    let mut stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let url = stack.gateway("/v1/chat/completions");
    let body = |s: u64, turn: u64| {
        chat_body(&[("user".into(), format!("{} {}", filler(s, 300), filler(500 + turn, 20)))], 2)
    };
    let filter = |m: &kvmesh_e2e::prom::Metrics, result: &str| {
        m.sum("kvmesh_filter_picker_destinations_total", &[("result", result)])
    };

    let before = stack.envoy_metrics().await?;
    let routed_before = epp_requests(&stack, "routed").await.unwrap_or(0.0);
    for s in 0..SESSIONS {
        let sid = format!("both-{s}");
        let r =
            post_json(&c, &url, &body(s, 1), &[(headers::DEFAULT_SESSION_HEADER, sid.as_str())])
                .await?;
        assert_eq!(r.status, 200, "{}", r.text);
        assert!(r.worker().is_some(), "not served by an engine: {:?}", r.headers);
        assert!(r.mode().is_some(), "the picker's decision headers: {:?}", r.headers);
        assert!(r.header(headers::DEBUG_FALLBACK).is_none(), "{:?}", r.headers);
    }
    let after = stack.envoy_metrics().await?;
    assert_eq!(
        filter(&after, "deferred") - filter(&before, "deferred"),
        SESSIONS as f64,
        "{:?} {:?}",
        after.select("kvmesh_filter_picker_destinations_total", &[]).collect::<Vec<_>>(),
        after.select("kvmesh_filter_requests_total", &[]).collect::<Vec<_>>()
    );
    assert_eq!(filter(&after, "absent") - filter(&before, "absent"), 0.0);
    let calls = |m: &kvmesh_e2e::prom::Metrics| m.sum("kvmesh_filter_route_bodies_total", &[]);
    assert_eq!(calls(&after) - calls(&before), 0.0, "the filter asked the indexer itself");
    let requests = |m: &kvmesh_e2e::prom::Metrics| {
        m.sum("kvmesh_filter_requests_total", &[("mode", "picker"), ("outcome", "success")])
    };
    assert_eq!(requests(&after) - requests(&before), SESSIONS as f64);
    let routed = epp_requests(&stack, "routed").await.unwrap_or(0.0) - routed_before;
    assert_eq!(routed, SESSIONS as f64, "the picker routed each request");

    // Picker killed: ext_proc fails open (STREAMED body), and every request reaches the filter
    // without the picker's destination; the filter routes it on its fallback and an engine serves
    // it. The first ones find the picker's connection refused; once Envoy's health check marked
    // it down, it is not called at all.
    stack.kill_indexer();
    let before = stack.envoy_metrics().await?;
    for s in 0..SESSIONS {
        let sid = format!("both-{s}");
        let r =
            post_json(&c, &url, &body(s, 2), &[(headers::DEFAULT_SESSION_HEADER, sid.as_str())])
                .await?;
        assert_eq!(r.status, 200, "picker down: {}", r.text);
        assert!(r.worker().is_some(), "not served by an engine: {:?}", r.headers);
        assert!(r.header(headers::DEBUG_FALLBACK).is_some(), "{:?}", r.headers);
    }
    let after = stack.envoy_metrics().await?;
    assert_eq!(filter(&after, "absent") - filter(&before, "absent"), SESSIONS as f64);
    assert_eq!(filter(&after, "deferred") - filter(&before, "deferred"), 0.0);

    stack.restart_indexer().await?;
    let mut seed = 9_000;
    wait_routed(&stack, true, &mut seed).await?;
    let m = stack.envoy_metrics().await?;
    assert!(
        filter(&m, "deferred") > filter(&after, "deferred"),
        "deferring again after the restart"
    );
    Ok(())
}

#[test]
fn a_response_read_off_the_wire() {
    let seen = parse_response(
        b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nx-sim-worker: w0\r\n\r\n{\"error\":1}",
    );
    assert_eq!(seen.status, Some(503));
    assert_eq!(seen.header("retry-after"), Some("1"));
    assert_eq!(seen.engine(), Some("w0"));
    assert_eq!(seen.body, "{\"error\":1}");
    assert_eq!(parse_response(b"").status, None, "no answer");
}
