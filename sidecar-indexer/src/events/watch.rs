//! Noticing that libzmq gave up a connection for good.
//!
//! libzmq answers a frame above `ZMQ_MAXMSGSIZE` (or bytes it cannot decode as ZMTP) with a
//! protocol error: it closes the connection and, unlike a lost connection (which a connecting
//! socket redials every `ZMQ_RECONNECT_IVL`), never dials again (libzmq 4.3.4,
//! `session_base_t::engine_error`: `protocol_error` → `terminate`). Nothing reaches the socket's
//! owner: a SUB then receives nothing, ever, without an error — the listener sat blind to its
//! worker, every counter at 0 (issue 43, point 5). The one trace is on the socket monitor:
//! `ZMQ_EVENT_DISCONNECTED`, which for a lost connection is followed at once by
//! `ZMQ_EVENT_CONNECT_RETRIED` (the reconnect timer starting, on the same I/O thread) and for a
//! refused frame by nothing. [`DropJudge`] reads that sequence (pure, the clock passed in);
//! [`Watch`] is the monitor socket feeding it. Only connecting sockets are watched: an accepted
//! connection is never redialled by us, its peer dials again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long after `ZMQ_EVENT_DISCONNECTED` a reconnect must show (`ZMQ_EVENT_CONNECT_RETRIED`
/// comes within microseconds on an idle machine) before the connection counts as given up. Too
/// short only misreads a lost connection as a refused frame: the socket is reopened and the worker
/// cleared, which is safe.
pub const RECONNECT_GRACE: Duration = Duration::from_millis(500);

/// What a monitor event says about the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// The connection closed (`ZMQ_EVENT_DISCONNECTED`).
    Disconnected,
    /// libzmq is dialling or connected again (`CONNECT_RETRIED`, `CONNECT_DELAYED`, `CONNECTED`).
    Dialling,
    /// Anything else.
    Other,
}

impl Seen {
    /// Classifies a raw event number (`zmq_socket_monitor`).
    pub fn of(event: u16) -> Self {
        let event = u32::from(event);
        if event == zmq::SocketEvent::DISCONNECTED as u32 {
            Seen::Disconnected
        } else if event == zmq::SocketEvent::CONNECT_RETRIED as u32
            || event == zmq::SocketEvent::CONNECT_DELAYED as u32
            || event == zmq::SocketEvent::CONNECTED as u32
        {
            Seen::Dialling
        } else {
            Seen::Other
        }
    }
}

/// Whether a connecting socket's connection was given up, from its monitor events.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DropJudge {
    /// When the last disconnect not followed by a redial was seen.
    disconnected_at: Option<Instant>,
}

impl DropJudge {
    /// Records one monitor event seen at `now`.
    pub fn on_event(&mut self, seen: Seen, now: Instant) {
        match seen {
            Seen::Disconnected => self.disconnected_at = Some(now),
            Seen::Dialling => self.disconnected_at = None,
            Seen::Other => {}
        }
    }

    /// True once a disconnect is [`RECONNECT_GRACE`] old without a redial: libzmq will not dial
    /// again, the caller must reopen the socket. Answers true once per disconnect.
    pub fn given_up(&mut self, now: Instant) -> bool {
        match self.disconnected_at {
            Some(at) if now.saturating_duration_since(at) >= RECONNECT_GRACE => {
                self.disconnected_at = None;
                true
            }
            _ => false,
        }
    }

    /// When [`DropJudge::given_up`] may next turn true (a poll should wake by then), if pending.
    pub fn deadline(&self) -> Option<Instant> {
        self.disconnected_at.map(|at| at + RECONNECT_GRACE)
    }
}

/// Distinct monitor endpoints within the process.
static WATCHES: AtomicU64 = AtomicU64::new(0);

/// The monitor of one connecting socket, and its [`DropJudge`]. Create it before the socket
/// connects; drop it with the socket.
pub struct Watch {
    pair: zmq::Socket,
    judge: DropJudge,
}

impl Watch {
    /// Starts monitoring `socket` (of context `ctx`) for disconnects and redials.
    pub fn on(ctx: &zmq::Context, socket: &zmq::Socket) -> Result<Self, zmq::Error> {
        let n = WATCHES.fetch_add(1, Ordering::Relaxed);
        let endpoint = format!("inproc://kvmesh-watch-{}-{n}", std::process::id());
        let events = zmq::SocketEvent::DISCONNECTED as i32
            | zmq::SocketEvent::CONNECT_RETRIED as i32
            | zmq::SocketEvent::CONNECT_DELAYED as i32
            | zmq::SocketEvent::CONNECTED as i32;
        socket.monitor(&endpoint, events)?;
        let pair = ctx.socket(zmq::PAIR)?;
        pair.set_linger(0)?;
        pair.connect(&endpoint)?;
        Ok(Self { pair, judge: DropJudge::default() })
    }

    /// For `zmq::poll` beside the watched socket: readable when an event is waiting.
    pub fn poll_item(&self) -> zmq::PollItem<'_> {
        self.pair.as_poll_item(zmq::POLLIN)
    }

    /// Reads the waiting events and answers whether libzmq gave the connection up (see
    /// [`DropJudge::given_up`]).
    pub fn given_up(&mut self, now: Instant) -> bool {
        while let Ok(frames) = self.pair.recv_multipart(zmq::DONTWAIT) {
            // Frame 1: event number (u16) and value (u32), native order; frame 2: the endpoint.
            let event = frames
                .first()
                .and_then(|f| f.get(..2))
                .and_then(|b| <[u8; 2]>::try_from(b).ok())
                .map(u16::from_ne_bytes);
            if let Some(event) = event {
                self.judge.on_event(Seen::of(event), now);
            }
        }
        self.judge.given_up(now)
    }

    /// How long a poll may wait before [`Watch::given_up`] must be asked again, at most `cap`.
    pub fn wait(&self, now: Instant, cap: Duration) -> Duration {
        self.judge.deadline().map_or(cap, |d| d.saturating_duration_since(now).min(cap))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disconnect_followed_by_a_redial_is_not_given_up() {
        let t0 = Instant::now();
        let mut j = DropJudge::default();
        j.on_event(Seen::Disconnected, t0);
        j.on_event(Seen::Dialling, t0 + Duration::from_millis(1));
        assert!(!j.given_up(t0 + 10 * RECONNECT_GRACE));
        assert_eq!(j.deadline(), None);
    }

    #[test]
    fn a_disconnect_without_a_redial_is_given_up_once_after_the_grace() {
        let t0 = Instant::now();
        let mut j = DropJudge::default();
        j.on_event(Seen::Other, t0);
        assert!(!j.given_up(t0 + RECONNECT_GRACE));
        j.on_event(Seen::Disconnected, t0);
        assert_eq!(j.deadline(), Some(t0 + RECONNECT_GRACE));
        assert!(!j.given_up(t0 + RECONNECT_GRACE - Duration::from_millis(1)));
        assert!(j.given_up(t0 + RECONNECT_GRACE));
        assert!(!j.given_up(t0 + 2 * RECONNECT_GRACE), "answered once per disconnect");
    }

    #[test]
    fn event_numbers_are_classified() {
        assert_eq!(Seen::of(zmq::SocketEvent::DISCONNECTED as u16), Seen::Disconnected);
        assert_eq!(Seen::of(zmq::SocketEvent::CONNECT_RETRIED as u16), Seen::Dialling);
        assert_eq!(Seen::of(zmq::SocketEvent::CONNECTED as u16), Seen::Dialling);
        assert_eq!(Seen::of(zmq::SocketEvent::ACCEPTED as u16), Seen::Other);
    }

    /// Real libzmq over TCP: a frame above `ZMQ_MAXMSGSIZE` closes a connecting SUB's connection
    /// and it is not dialled again (the fact this module exists for); a publisher going away is.
    #[test]
    fn libzmq_gives_up_after_a_refused_frame_and_redials_after_a_lost_connection() {
        let ctx = zmq::Context::new();
        let publisher = ctx.socket(zmq::PUB).unwrap();
        publisher.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_maxmsgsize(100).unwrap();
        sub.set_subscribe(b"").unwrap();
        let mut watch = Watch::on(&ctx, &sub).unwrap();
        sub.connect(&endpoint).unwrap();
        // Join (slow-joiner), then send a frame over the bound.
        loop {
            publisher.send(&b"hi"[..], 0).unwrap();
            if sub.poll(zmq::POLLIN, 20).unwrap() > 0 {
                break;
            }
        }
        publisher.send(vec![0u8; 1000], 0).unwrap();
        let start = Instant::now();
        let given_up = loop {
            if watch.given_up(Instant::now()) {
                break true;
            }
            if start.elapsed() > Duration::from_secs(10) {
                break false;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(given_up, "no disconnect without redial seen");
        // A publisher restart: the connection is lost and dialled again, never given up.
        let ctx2 = zmq::Context::new();
        let publisher2 = ctx2.socket(zmq::PUB).unwrap();
        publisher2.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint2 = publisher2.get_last_endpoint().unwrap().unwrap();
        let sub2 = ctx.socket(zmq::SUB).unwrap();
        sub2.set_subscribe(b"").unwrap();
        let mut watch2 = Watch::on(&ctx, &sub2).unwrap();
        sub2.connect(&endpoint2).unwrap();
        loop {
            publisher2.send(&b"hi"[..], 0).unwrap();
            if sub2.poll(zmq::POLLIN, 20).unwrap() > 0 {
                break;
            }
        }
        drop(publisher2);
        drop(ctx2);
        let start = Instant::now();
        while start.elapsed() < 3 * RECONNECT_GRACE {
            assert!(!watch2.given_up(Instant::now()), "a lost connection is redialled by libzmq");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
