//! The body memo: recent long chat bodies' read prefixes ([`ChatPrefix`]: the bytes through their
//! last message, and those messages read), so the next turn of a conversation is read from where
//! the last one ended and its read costs its new messages, not the conversation
//! (`kvmesh_core::openai::Body::request_from`; issue 16.3: reading a 48k-token conversation's body was
//! two thirds of its route).
//!
//! Keys are the hash of the route's session key (the filter's: the client's session header or
//! the conversation's anchor) and the body's first [`HEAD_BYTES`] bytes: the bodies of one
//! conversation share them, conversations that only share a system prompt do not. A key keeps its
//! [`PER_KEY`] most recently used prefixes; a lookup takes the longest one whose last
//! [`TAIL_BYTES`] bytes the body repeats at the same place (an O(1) check; the read compares the
//! whole prefix and reads the body whole when it differs). A prefix read whole is a *root*:
//! conversations that branch from it (many conversations on one long shared prefix) each continue
//! it. A continued read replaces the prefix it continued unless that is a root, so a conversation
//! holds its root and its latest turn however many turns it has. Bounded in bytes
//! (`routing.body_memo_bytes`): the copied prefix bytes plus the messages read; least recently
//! used keys go first.
//!
//! Each kept prefix is also a [`BodyBase`] the route's answer names: the filter's next call for
//! the conversation may send only the bytes after it, and [`BodyMemo::base`] gives them back — to
//! a call of the session it was kept under only: a base named under another session is refused
//! ([`BaseRefusal::OtherSession`], answered 409 as an unknown base), so one session's call can
//! never be joined to another's bytes (issue 43.4).
//!
//! Models (issue 44): the memo keeps the JSON read, never tokens, so nothing in it belongs to a
//! model. A body's `model` is read from its own bytes on every call — inside a kept prefix it is
//! compared byte for byte, after it it is read anew — so a continued read or a joined base resolves
//! exactly the model a whole read would; tokens and their prefix memo are per model (each model has
//! its own tokenizer and caches: `crate::catalog`).

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use axum::body::Bytes;
use kvmesh_core::body_base::BodyBase;
use kvmesh_core::openai::{self, ChatPrefix, Endpoint, OpenAiRequest, ParseError};
use kvmesh_core::session::SessionKey;
use parking_lot::Mutex;

/// Default bound of the memo's bytes (`routing.body_memo_bytes`): ~80 conversations of 48k tokens
/// (≈ 200 KB of body and as much read text each), thousands of short ones.
pub const DEFAULT_BODY_MEMO_BYTES: usize = 32 * 1024 * 1024;

pub use kvmesh_core::body_base::MIN_BODY_BYTES;

/// Leading bytes of a body that its key hashes (with the session).
const HEAD_BYTES: usize = 256;

/// Bytes at the end of a prefix compared before it is offered.
const TAIL_BYTES: usize = 64;

/// Prefixes kept per key (conversations on one anchor), most recent first.
const PER_KEY: usize = 8;

/// Bookkeeping bytes charged per prefix on top of its bytes and messages.
const ENTRY_OVERHEAD: usize = 128;

/// A kept prefix: the body it was read from (shared with the route call, not copied: a copy of a
/// 200 KB body costs as much as reading the new turn), and what its first
/// [`ChatPrefix::len`] bytes read to.
#[derive(Debug, Clone)]
pub struct Held {
    pub body: Bytes,
    pub prefix: Arc<ChatPrefix>,
    /// Read whole, not continued from another prefix: never replaced by a continuation.
    root: bool,
    /// Its name as the answer gives it: under `key`, the prefix's length and hash.
    name: BodyBase,
    /// The session of the route call it was kept for: the only one it is given back to.
    session: Option<SessionKey>,
}

impl Held {
    /// `body`'s prefix, kept under `key` for a call of `session`; `root` when the body was read
    /// whole (`None`: too short to be kept).
    pub fn new(
        key: u64,
        session: Option<SessionKey>,
        body: &Bytes,
        prefix: ChatPrefix,
        root: bool,
    ) -> Option<Self> {
        let bytes = body.get(..prefix.len()).filter(|b| b.len() >= HEAD_BYTES)?;
        let name = BodyBase::of(key, bytes);
        Some(Self { body: body.clone(), prefix: Arc::new(prefix), root, name, session })
    }

    /// The prefix's bytes.
    pub fn bytes(&self) -> &[u8] {
        self.body.get(..self.prefix.len()).unwrap_or_default()
    }

    fn cost(&self) -> usize {
        self.body.len() + self.prefix.heap_bytes() + ENTRY_OVERHEAD
    }
}

/// A chat body read through the memo ([`read_chat`]).
#[derive(Debug)]
pub struct BodyRead {
    pub request: Result<OpenAiRequest, ParseError>,
    /// Bytes at the body's start its read continued from a held prefix (0: read whole).
    pub continued: usize,
    /// The body's own prefix, kept for the next turn, as the answer names it.
    pub kept: Option<BodyBase>,
}

/// A chat body read from the longest prefix `memo` holds for it (or whole), routed with `session`;
/// its own prefix is kept for the next turn within `max_bytes`. A body `joined` to a held base
/// ([`super::request::with_base`]) starts with that base's bytes: it continues that prefix without
/// a search, and its bytes, just copied from it, are not compared again.
pub fn read_chat(
    memo: &Mutex<BodyMemo>,
    body: &Bytes,
    session: Option<SessionKey>,
    max_bytes: usize,
    joined: Option<Held>,
) -> BodyRead {
    let key = BodyMemo::key(body, session);
    let joined = joined.filter(|h| h.name.memo_key == key);
    let based = joined.is_some();
    let held = joined.or_else(|| memo.lock().find(key, body));
    let read = openai::Body::new(Endpoint::ChatCompletions, body).request_from(
        held.as_ref().map(|h| (if based { body.as_ref() } else { h.bytes() }, &*h.prefix)),
    );
    let kept =
        read.prefix.and_then(|p| Held::new(key, session, body, p, !read.resumed)).and_then(|new| {
            let name = new.name;
            memo.lock()
                .keep(key, new, held.as_ref().filter(|_| read.resumed), max_bytes)
                .then_some(name)
        });
    let continued = held.filter(|_| read.resumed).map_or(0, |h| h.prefix.len());
    BodyRead { request: read.request, continued, kept }
}

/// Why [`BodyMemo::base`] gives no prefix; both are answered `409` `body_base_unknown` (the
/// filter then sends the whole body) and counted apart
/// (`kvmesh_body_memo_total{result="base_unknown"|"base_other_session"}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BaseRefusal {
    /// No held prefix has that name: never kept, evicted, or the indexer restarted.
    Unknown,
    /// The named prefix was kept for a route call of another session.
    OtherSession,
}

/// Byte-bounded LRU of keys ([`BodyMemo::key`]) → their most recent prefixes.
pub struct BodyMemo {
    heads: lru::LruCache<u64, Vec<Held>>,
    bytes: usize,
}

impl Default for BodyMemo {
    fn default() -> Self {
        Self::new()
    }
}

impl BodyMemo {
    pub fn new() -> Self {
        Self { heads: lru::LruCache::unbounded(), bytes: 0 }
    }

    /// The key of `body` routed with `session`.
    pub fn key(body: &[u8], session: Option<SessionKey>) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        session.hash(&mut h);
        body.get(..HEAD_BYTES).unwrap_or(body).hash(&mut h);
        h.finish()
    }

    /// Bytes held (≤ the bound last given to [`Self::keep`]).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The held prefix `base` names, for a route call of `session`, now its key's most recently
    /// used. Refused when no held prefix has that key, length and hash, or when the one that has
    /// was kept for another session (then it is left as it was).
    pub fn base(
        &mut self,
        base: &BodyBase,
        session: Option<SessionKey>,
    ) -> Result<Held, BaseRefusal> {
        let list = self.heads.peek_mut(&base.memo_key).ok_or(BaseRefusal::Unknown)?;
        let at = list.iter().position(|h| h.name == *base).ok_or(BaseRefusal::Unknown)?;
        if list[at].session != session {
            return Err(BaseRefusal::OtherSession);
        }
        self.heads.promote(&base.memo_key);
        let list = self.heads.get_mut(&base.memo_key).ok_or(BaseRefusal::Unknown)?;
        Ok(to_front(list, at).clone())
    }

    /// The longest kept prefix `body` may continue (its head and last bytes agree; the reader
    /// compares the rest), now the key's most recently used.
    pub fn find(&mut self, key: u64, body: &[u8]) -> Option<Held> {
        let list = self.heads.get_mut(&key)?;
        let (at, _) = list
            .iter()
            .enumerate()
            .filter(|(_, h)| {
                let end = h.prefix.len();
                body.get(end - TAIL_BYTES.min(end)..end)
                    == h.bytes().get(end - TAIL_BYTES.min(end)..)
            })
            .max_by_key(|(_, h)| h.prefix.len())?;
        Some(to_front(list, at).clone())
    }

    /// Keeps `new` under `key`, in place of `continued` (the prefix its read continued, if any)
    /// unless that is a root, within `max_bytes` (0: keeps nothing and drops all). A prefix of
    /// more than a quarter of the bound is not kept. Whether it was.
    pub fn keep(
        &mut self,
        key: u64,
        new: Held,
        continued: Option<&Held>,
        max_bytes: usize,
    ) -> bool {
        let cost = new.cost();
        if cost > max_bytes / 4 {
            self.shrink_to(max_bytes);
            return false;
        }
        let list = self.heads.get_or_insert_mut(key, Vec::new);
        let mut freed = 0;
        if let Some(old) = continued.filter(|c| !c.root) {
            list.retain(|h| {
                let same = Arc::ptr_eq(&h.prefix, &old.prefix);
                freed += if same { h.cost() } else { 0 };
                !same
            });
        }
        list.insert(0, new);
        for dropped in list.drain(PER_KEY.min(list.len())..) {
            freed += dropped.cost();
        }
        self.bytes = self.bytes + cost - freed;
        self.shrink_to(max_bytes);
        self.heads.contains(&key)
    }

    /// Drops least recently used keys until at most `max_bytes` are held.
    pub fn shrink_to(&mut self, max_bytes: usize) {
        while self.bytes > max_bytes {
            match self.heads.pop_lru() {
                Some((_, list)) => self.bytes -= list.iter().map(Held::cost).sum::<usize>(),
                None => break,
            }
        }
    }
}

/// Moves a key's prefix `at` to the front of its list (most recently used) and returns it.
fn to_front(list: &mut [Held], at: usize) -> &Held {
    list[..=at].rotate_right(1);
    &list[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chat body: a long system prompt, then `turns` user/assistant pairs of conversation `c`.
    fn chat(c: usize, turns: usize) -> Vec<u8> {
        branch(0, c, turns)
    }

    /// [`chat`] after `shared` turns of conversation 999 (a prefix conversations branch from).
    fn branch(shared: usize, c: usize, turns: usize) -> Vec<u8> {
        let mut m = vec![serde_json::json!({"role": "system", "content": "s".repeat(10_000)})];
        for t in 0..shared {
            m.push(serde_json::json!({"role": "user", "content": format!("c999 t{t}")}));
            m.push(serde_json::json!({"role": "assistant", "content": format!("reply {t}")}));
        }
        for t in 0..turns {
            m.push(serde_json::json!({"role": "user", "content": format!("c{c} t{t}")}));
            m.push(serde_json::json!({"role": "assistant", "content": format!("reply {t}")}));
        }
        serde_json::to_vec(&serde_json::json!({"messages": m, "stream": true})).unwrap_or_default()
    }

    /// Reads `body` through the memo as the route does; whether it continued a kept prefix.
    fn read(memo: &mut BodyMemo, body: &[u8], max_bytes: usize) -> bool {
        let shared = Mutex::new(std::mem::take(memo));
        let read =
            read_chat(&shared, &Bytes::copy_from_slice(body), Some(SessionKey(7)), max_bytes, None);
        *memo = shared.into_inner();
        read.continued > 0
    }

    #[test]
    fn conversations_on_one_system_prompt_each_continue_their_own_prefix() {
        let mut memo = BodyMemo::new();
        let bound = 1 << 20;
        // Four conversations, interleaved turn by turn: each first turn is read whole, the rest continue.
        let resumed: Vec<bool> = (1..5)
            .flat_map(|t| (0..4).map(move |c| (c, t)))
            .map(|(c, t)| read(&mut memo, &chat(c, t), bound))
            .collect();
        assert_eq!(resumed.iter().filter(|r| !**r).count(), 4, "{resumed:?}");
        assert!(resumed[4..].iter().all(|r| *r), "{resumed:?}");
        // Two entries per conversation however many turns: its root and its latest.
        let held: usize = memo.heads.iter().map(|(_, l)| l.len()).sum();
        assert_eq!(held, 8);
        assert!(memo.bytes() <= bound);
        // A short body is not the memo's business; one that differs inside every held prefix (not
        // in their last bytes, which the lookup checks) is read whole.
        let short = b"{\"messages\":[]}";
        assert!(memo.find(BodyMemo::key(short, None), short).is_none());
        let mut other = chat(0, 4);
        other[1000] = b'X';
        assert!(!read(&mut memo, &other, bound));
    }

    #[test]
    fn conversations_branching_from_one_prefix_each_continue_it() {
        let mut memo = BodyMemo::new();
        let bound = 1 << 20;
        assert!(!read(&mut memo, &branch(3, 0, 0), bound), "the shared prefix is read whole once");
        for c in 0..12 {
            for t in 1..4 {
                assert!(read(&mut memo, &branch(3, c, t), bound), "conversation {c} turn {t}");
            }
        }
    }

    #[test]
    fn a_base_is_given_back_to_its_own_session_only() {
        let memo = Mutex::new(BodyMemo::new());
        let body = Bytes::from(chat(0, 2));
        let mine = Some(SessionKey(7));
        let read = read_chat(&memo, &body, mine, 1 << 20, None);
        let Some(base) = read.kept else { panic!("a long chat body's prefix is kept") };
        let mut memo = memo.into_inner();
        for other in [Some(SessionKey(8)), None] {
            assert_eq!(
                memo.base(&base, other).map(|h| h.name),
                Err(BaseRefusal::OtherSession),
                "{other:?}"
            );
        }
        assert_eq!(memo.base(&base, mine).map(|h| h.name), Ok(base));
        let unknown = BodyBase { len: base.len + 1, ..base };
        assert_eq!(memo.base(&unknown, mine).map(|h| h.name), Err(BaseRefusal::Unknown));
    }

    #[test]
    fn the_memo_stays_within_its_byte_bound() {
        let mut memo = BodyMemo::new();
        let one = chat(0, 1).len();
        let bound = one * 6;
        for c in 0..40 {
            read(&mut memo, &chat(c, 1), bound);
            assert!(memo.bytes() <= bound, "{} > {bound}", memo.bytes());
        }
        // More than a quarter of the bound: not kept.
        read(&mut memo, &chat(99, 1), one);
        assert!(memo.bytes() <= one);
        read(&mut memo, &chat(1, 1), 0);
        assert_eq!(memo.bytes(), 0);
    }
}
