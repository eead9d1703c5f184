//! The byte scan of a chat body for the filter's need ([`super::Body::peek`]):
//! [`super::peek`]'s answer, for most chat bodies without a serde pass over the whole body.
//!
//! `peek` reads a body in one streaming serde pass; for an 8k-token chat continuation (~50 KB)
//! that pass was most of the filter's per-request work (0.63 M of 0.74 M instructions under
//! callgrind), almost all of it spent stepping through message text the decision never looks at;
//! with this scan the whole flow takes 0.27 M instead of 0.71 M on the overhead bench's shape
//! (`filter/examples/body_path.rs`). Here the strict [`Cursor`] of the shared grammar
//! ([`super::grammar`]) reads the common shape instead: it checks the body is JSON, reads `stream`
//! and `model` and the types `parse` checks (`model`, `max_tokens`, each later message's `role` and `content`)
//! from borrowed spans, and hands only the conversation anchor — the messages up to the first user
//! message, usually a system prompt and one question — to `peek`, as a body of its own, for the
//! anchor's checks and digest (or nothing at all when no derived session key is needed: then the
//! scan checks those messages too).
//!
//! It accepts a subset of valid bodies and declines everything else (returns `None`: then `peek`
//! reads the whole body and decides, errors included): escapes in keys, a repeated key routing
//! reads, what the strict grammar declines (a surrogate `\u` escape, a number with an exponent or
//! over 100 bytes, nesting over [`MAX_DEPTH`]), content parts in a later message, a type `parse`
//! refuses. So when it answers, the body is valid JSON that `parse` accepts, and the answer is
//! `peek`'s (a test holds them equal on generated and mutated bodies).
//!
//! A long conversation's turn repeats its earlier messages byte for byte. Once the anchor is read,
//! the scan asks its caller ([`Skip`]) whether the body starts with a body base the indexer holds
//! ([`crate::body_base`]; the caller hashes the base's bytes); if so, it goes on from the base's
//! end and takes the messages before it as read. Why that keeps the answer `peek`'s: the indexer
//! names a base only for a body it read `Ok`, with exactly one top-level `messages` list, no
//! escaped key, and the base ending right after that list's last element (a [`super::ChatPrefix`]);
//! the same bytes put this scan in that list, right after an element, at the same offset; the
//! anchor and every top-level field before the list are read here, and nothing after it is
//! skipped. A 300 KB turn is then scanned over its head and its new messages only.

use super::fields::{self, Kind};
use super::grammar::Cursor;
use super::{peek, Endpoint, ParseError, RequestPeek};

/// Nesting the scanner follows at most (deeper bodies go to `peek`).
pub use super::grammar::MAX_DEPTH;

/// Asked once by the scan of a chat body, right after the conversation anchor's last message
/// (right after the first message when the anchor was not asked for), with the anchor's digest
/// (`None` when not asked for): the end of a body base the body starts with — checked by the
/// caller, by its hash — to go on from, or `None` to read on.
pub type Skip<'s> = dyn FnMut(Option<u64>) -> Option<usize> + 's;

/// Reads `body` as a request to `endpoint`: exactly [`super::peek`]'s result — without the
/// conversation anchor when `anchor` is false (the caller has no use for it: the request sent a
/// session header, or key derivation is off), which spares digesting it: `conversation_anchor`
/// is then `None`. A chat body's scan may go on from where `skip` says (module docs); a body the
/// scan declines is read whole by `peek`, `skip` asked or not.
pub(super) fn read(
    endpoint: Endpoint,
    body: &[u8],
    anchor: bool,
    skip: &mut Skip<'_>,
) -> Result<RequestPeek, ParseError> {
    if endpoint == Endpoint::ChatCompletions {
        if let Some(peek) = fast_chat(body, anchor, skip) {
            return Ok(peek);
        }
    }
    peek(endpoint, body).map(|p| {
        if anchor {
            p
        } else {
            RequestPeek { conversation_anchor: None, ..p }
        }
    })
}

/// The scan of a chat body: `Some` only for a body `peek` accepts, with its answer (the anchor
/// only when `anchor`).
pub fn fast_chat(body: &[u8], anchor: bool, skip: &mut Skip<'_>) -> Option<RequestPeek> {
    let mut s =
        Scanner { c: Cursor::new(body), anchor, skip: Some(skip), digest: None, model: None };
    let stream = s.top()?;
    Some(RequestPeek { stream, conversation_anchor: s.digest, model: s.model })
}

/// The digest of the anchor messages `body[start..end]` (the messages from the list's first
/// element to the end of the first user message, or of the last message when none is a user's),
/// as a body of their own: `peek` checks them as `parse` would and digests them (the digest reads
/// only these messages). `None` when `peek` refuses them.
fn anchor_digest(body: &[u8], start: usize, end: usize) -> Option<Option<u64>> {
    let mut anchor = Vec::with_capacity(end - start + 16);
    anchor.extend_from_slice(b"{\"messages\":[");
    anchor.extend_from_slice(body.get(start..end)?);
    anchor.extend_from_slice(b"]}");
    peek(Endpoint::ChatCompletions, &anchor).ok().map(|p| p.conversation_anchor)
}

/// A message's `role`, as far as the scan needs it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Absent,
    User,
    Other,
}

struct Scanner<'a, 's> {
    c: Cursor<'a>,
    /// Whether the anchor is left to `peek` (for its digest); without, every message is checked
    /// here as a later one is.
    anchor: bool,
    /// Asked once where the scan may go on from ([`Skip`]), when the anchor is read; `None` after.
    skip: Option<&'s mut Skip<'s>>,
    /// The anchor's digest, once read (`None` without the anchor).
    digest: Option<u64>,
    /// `model`, once read (a string; absent or null: none).
    model: Option<String>,
}

impl Scanner<'_, '_> {
    /// The top-level object (the body must end after it): its `stream`. Each field routing checks
    /// ([`fields::KEYS`]) is checked for its [`fields::Kind`] on the bytes (a repeated one declines:
    /// `peek` knows which wins); a value `fields::scalars` would refuse declines too.
    fn top(&mut self) -> Option<bool> {
        self.c.ws();
        self.c.eat(b'{')?;
        self.c.enter()?;
        let (mut messages, mut stream) = (false, false);
        let mut seen = [false; fields::KEYS.len()];
        self.c.ws();
        loop {
            let key = self.c.key()?;
            self.c.colon()?;
            let checked = fields::index(key).filter(|&i| fields::KEYS[i].1 != Kind::Any);
            match (key, checked) {
                (b"messages", _) if !messages => {
                    messages = true;
                    self.messages()?;
                }
                (b"messages", _) => return None,
                (_, Some(i)) if !seen[i] => {
                    seen[i] = true;
                    let start = self.c.i;
                    let on = self.kind(fields::KEYS[i].1)?;
                    stream |= key == b"stream" && on;
                    if key == b"model" {
                        self.model = self.text(start)?;
                    }
                }
                (_, Some(_)) => return None,
                _ => self.c.value()?,
            }
            if !self.c.more(b'}')? {
                break;
            }
        }
        self.c.i += 1;
        self.c.ws();
        (self.c.i == self.c.b.len() && messages).then_some(stream)
    }

    /// A value of `kind` or `null`: whether it is `true`.
    fn kind(&mut self, kind: Kind) -> Option<bool> {
        let c = &mut self.c;
        match (kind, c.at()?) {
            (_, b'n') => c.literal(b"null").map(|()| false),
            (Kind::Text, b'"') => c.string().map(|()| false),
            (Kind::Flag, b't') => c.literal(b"true").map(|()| true),
            (Kind::Flag, b'f') => c.literal(b"false").map(|()| false),
            // At most 19 digits, no sign, fraction or exponent: `as_u64` reads it.
            (Kind::Count, _) => {
                let start = c.i;
                c.number()?;
                let digits = c.b.get(start..c.i)?;
                (digits.len() <= 19 && digits.iter().all(u8::is_ascii_digit)).then_some(false)
            }
            (Kind::Any, _) => c.value().map(|()| false),
            _ => None,
        }
    }

    /// The string (or `null`: none) [`Self::kind`] just stepped over from `start`, decoded; a
    /// model name is short, so serde decodes its escapes.
    fn text(&self, start: usize) -> Option<Option<String>> {
        let span = self.c.b.get(start..self.c.i)?;
        if span.first() == Some(&b'n') {
            return Some(None);
        }
        serde_json::from_slice::<String>(span).ok().map(Some)
    }

    /// The `messages` list: the anchor digested (when asked for); later messages checked as
    /// `parse` checks them, or taken as read up to where [`Skip`] says.
    fn messages(&mut self) -> Option<()> {
        self.c.eat(b'[')?;
        self.c.enter()?;
        self.c.ws();
        let start = self.c.i;
        let mut anchor_end = None;
        loop {
            let (role, content_ok) = self.message()?;
            match anchor_end {
                None if !self.anchor && (role == Role::Absent || !content_ok) => return None,
                None if role == Role::User => anchor_end = Some(self.c.i),
                // An anchor message: `peek` checks it with the anchor.
                None => {}
                Some(_) if role == Role::Absent || !content_ok => return None,
                Some(_) => {}
            }
            if anchor_end.is_some() || !self.anchor {
                self.skip_read_messages(start)?;
            }
            if !self.c.more(b']')? {
                break;
            }
        }
        if self.skip.is_some() && self.anchor {
            // No user message: the anchor is every message.
            self.digest = anchor_digest(self.c.b, start, self.c.i)?;
        }
        self.c.close();
        Some(())
    }

    /// Right after the anchor (the first message when it is not asked for), once: digests it and
    /// asks [`Skip`] where to go on from; goes there if it is past here (module docs).
    fn skip_read_messages(&mut self, start: usize) -> Option<()> {
        let Some(skip) = self.skip.take() else { return Some(()) };
        if self.anchor {
            self.digest = anchor_digest(self.c.b, start, self.c.i)?;
        }
        if let Some(to) = skip(self.digest).filter(|&to| to > self.c.i && to <= self.c.b.len()) {
            self.c.i = to;
        }
        Some(())
    }

    /// One message object: its role (a string without escapes, else the scan declines) and
    /// whether its content is what a later message may carry without a second look (absent,
    /// null or a string; content parts are left to `peek`).
    fn message(&mut self) -> Option<(Role, bool)> {
        self.c.eat(b'{')?;
        self.c.enter()?;
        let (mut role, mut content) = (None, None);
        self.c.ws();
        if self.c.at()? != b'}' {
            loop {
                let key = self.c.key()?;
                self.c.colon()?;
                match key {
                    b"role" if role.is_none() => {
                        let start = self.c.i;
                        if self.c.at()? != b'"' || self.c.string_span()? {
                            return None;
                        }
                        role = Some(if self.c.b.get(start..self.c.i)? == b"\"user\"" {
                            Role::User
                        } else {
                            Role::Other
                        });
                    }
                    b"content" if content.is_none() => {
                        content = Some(matches!(self.c.at()?, b'"' | b'n'));
                        self.c.value()?;
                    }
                    b"role" | b"content" => return None,
                    _ => self.c.value()?,
                }
                if !self.c.more(b'}')? {
                    break;
                }
            }
        }
        self.c.close();
        Some((role.unwrap_or(Role::Absent), content.unwrap_or(true)))
    }
}
