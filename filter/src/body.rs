//! The filter's read of a request body: [`kvmesh_core::openai::peek`]'s answer, for most chat
//! bodies without a serde pass over the whole body.
//!
//! `peek` reads a body in one streaming serde pass; for an 8k-token chat continuation (~50 KB)
//! that pass was most of the filter's per-request work (0.63 M of 0.74 M instructions under
//! callgrind), almost all of it spent stepping through message text the decision never looks at;
//! with this scan the whole flow takes 0.27 M instead of 0.71 M on the overhead bench's shape
//! (`examples/body_path.rs`). Here a byte scanner reads the common shape instead: it checks the
//! body is JSON with a strict grammar (strings skipped eight bytes at a time, UTF-8 checked only
//! where a string has a non-ASCII byte), reads `stream` and the types `parse` checks (`model`,
//! `max_tokens`, each later message's `role` and `content`) from borrowed spans, and hands only
//! the conversation anchor — the messages up to the first user message, usually a system prompt
//! and one question — to `peek`, as a body of its own, for the anchor's checks and digest (or
//! nothing at all when no derived session key is needed: then the scan checks those messages too).
//!
//! It accepts a subset of valid bodies and declines everything else (returns `None`: then `peek`
//! reads the whole body and decides, errors included): escapes in keys, a repeated key routing
//! reads, a surrogate `\u` escape, a number with an exponent or over 100 bytes, content parts in
//! a later message, nesting over 100 deep, a type `parse` refuses. So when it answers, the body is
//! valid JSON that `parse` accepts, and the answer is `peek`'s (a test holds them equal on
//! generated and mutated bodies).
//!
//! A long conversation's turn repeats its earlier messages byte for byte. Once the anchor is read,
//! the scan asks its caller ([`Skip`]) whether the body starts with a body base the indexer holds
//! (`kvmesh_core::body_base`; the caller hashes the base's bytes); if so, it goes on from the
//! base's end and takes the messages before it as read. Why that keeps the answer `peek`'s: the
//! indexer names a base only for a body it read `Ok`, with exactly one top-level `messages` list,
//! no escaped key, and the base ending right after that list's last element; the same bytes put
//! this scan in that list, right after an element, at the same offset; the anchor and every
//! top-level field before the list are read here, and nothing after it is skipped. A 300 KB turn
//! is then scanned over its head and its new messages only.

use kvmesh_core::openai::{self, Endpoint, ParseError, RequestPeek};

/// Nesting the scanner follows at most (serde_json's limit is 128; deeper bodies go to `peek`).
const MAX_DEPTH: usize = 100;

/// Longest number the scanner accepts (no exponent: such a number is finite as an `f64`).
const MAX_NUMBER_BYTES: usize = 100;

/// Asked once by the scan of a chat body, right after the conversation anchor's last message
/// (right after the first message when the anchor was not asked for), with the anchor's digest
/// (`None` when not asked for): the end of a body base the body starts with — checked by the
/// caller, by its hash — to go on from, or `None` to read on.
pub type Skip<'s> = dyn FnMut(Option<u64>) -> Option<usize> + 's;

/// Reads `body` as a request to `endpoint`: exactly [`openai::peek`]'s result — without the
/// conversation anchor when `anchor` is false (the caller has no use for it: the request sent a
/// session header, or key derivation is off), which spares digesting it: `conversation_anchor`
/// is then `None`. A chat body's scan may go on from where `skip` says (module docs); a body the
/// scan declines is read whole by `peek`, `skip` asked or not.
pub fn read(
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
    openai::peek(endpoint, body).map(|p| {
        if anchor {
            p
        } else {
            RequestPeek { conversation_anchor: None, ..p }
        }
    })
}

/// The scan of a chat body: `Some` only for a body `peek` accepts, with its answer (the anchor
/// only when `anchor`).
pub(crate) fn fast_chat(body: &[u8], anchor: bool, skip: &mut Skip<'_>) -> Option<RequestPeek> {
    let mut s = Scanner { b: body, i: 0, depth: 0, anchor, skip: Some(skip), digest: None };
    let stream = s.top()?;
    Some(RequestPeek { stream, conversation_anchor: s.digest })
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
    openai::peek(Endpoint::ChatCompletions, &anchor).ok().map(|p| p.conversation_anchor)
}

/// A message's `role`, as far as the scan needs it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Absent,
    User,
    Other,
}

struct Scanner<'a, 's> {
    b: &'a [u8],
    i: usize,
    depth: usize,
    /// Whether the anchor is left to `peek` (for its digest); without, every message is checked
    /// here as a later one is.
    anchor: bool,
    /// Asked once where the scan may go on from ([`Skip`]), when the anchor is read; `None` after.
    skip: Option<&'s mut Skip<'s>>,
    /// The anchor's digest, once read (`None` without the anchor).
    digest: Option<u64>,
}

impl<'a> Scanner<'a, '_> {
    fn at(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.at(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.at()? == c).then(|| self.i += 1)
    }

    fn enter(&mut self) -> Option<()> {
        self.depth += 1;
        (self.depth <= MAX_DEPTH).then_some(())
    }

    /// Past the closing bracket of the object or list being read.
    fn close(&mut self) {
        self.i += 1;
        self.depth -= 1;
    }

    /// The `:` after a key, with the whitespace around it.
    fn colon(&mut self) -> Option<()> {
        self.ws();
        self.eat(b':')?;
        self.ws();
        Some(())
    }

    /// After a member or an element: a `,` (consumed, with the whitespace after it) → `true`; the
    /// closing `close` (left for the caller) → `false`; anything else declines.
    fn more(&mut self, close: u8) -> Option<bool> {
        self.ws();
        match self.at()? {
            b',' => {
                self.i += 1;
                self.ws();
                Some(true)
            }
            c if c == close => Some(false),
            _ => None,
        }
    }

    /// The top-level object (the body must end after it): its `stream`.
    fn top(&mut self) -> Option<bool> {
        self.ws();
        self.eat(b'{')?;
        self.enter()?;
        let (mut messages, mut stream) = (false, None);
        let (mut model, mut max_tokens, mut max_completion_tokens) = (false, false, false);
        self.ws();
        loop {
            let key = self.key()?;
            self.colon()?;
            match key {
                b"messages" if !messages => {
                    messages = true;
                    self.messages()?;
                }
                b"model" if !model => {
                    model = true;
                    match self.at()? {
                        b'"' => self.string()?,
                        _ => self.literal(b"null")?,
                    }
                }
                b"stream" if stream.is_none() => {
                    stream = Some(match self.at()? {
                        b't' => self.literal(b"true").map(|()| true)?,
                        b'f' => self.literal(b"false").map(|()| false)?,
                        _ => self.literal(b"null").map(|()| false)?,
                    });
                }
                b"max_tokens" if !max_tokens => {
                    max_tokens = true;
                    self.count_or_null()?;
                }
                b"max_completion_tokens" if !max_completion_tokens => {
                    max_completion_tokens = true;
                    self.count_or_null()?;
                }
                // A repeated key routing reads: `peek` knows which one wins.
                b"messages" | b"model" | b"stream" | b"max_tokens" | b"max_completion_tokens" => {
                    return None
                }
                _ => self.value()?,
            }
            if !self.more(b'}')? {
                break;
            }
        }
        self.i += 1;
        self.ws();
        if self.i != self.b.len() {
            return None;
        }
        messages.then_some(stream.unwrap_or(false))
    }

    /// A key without escapes, as its raw bytes (an escaped key could spell a key routing reads).
    fn key(&mut self) -> Option<&'a [u8]> {
        let start = self.i + 1;
        if self.string_span()? {
            return None;
        }
        self.b.get(start..self.i - 1)
    }

    /// The `messages` list: the anchor digested (when asked for); later messages checked as
    /// `parse` checks them, or taken as read up to where [`Skip`] says.
    fn messages(&mut self) -> Option<()> {
        self.eat(b'[')?;
        self.enter()?;
        self.ws();
        let start = self.i;
        let mut anchor_end = None;
        loop {
            let (role, content_ok) = self.message()?;
            match anchor_end {
                None if !self.anchor && (role == Role::Absent || !content_ok) => return None,
                None if role == Role::User => anchor_end = Some(self.i),
                // An anchor message: `peek` checks it with the anchor.
                None => {}
                Some(_) if role == Role::Absent || !content_ok => return None,
                Some(_) => {}
            }
            if anchor_end.is_some() || !self.anchor {
                self.skip_read_messages(start)?;
            }
            if !self.more(b']')? {
                break;
            }
        }
        if self.skip.is_some() && self.anchor {
            // No user message: the anchor is every message.
            self.digest = anchor_digest(self.b, start, self.i)?;
        }
        self.close();
        Some(())
    }

    /// Right after the anchor (the first message when it is not asked for), once: digests it and
    /// asks [`Skip`] where to go on from; goes there if it is past here (module docs).
    fn skip_read_messages(&mut self, start: usize) -> Option<()> {
        let Some(skip) = self.skip.take() else { return Some(()) };
        if self.anchor {
            self.digest = anchor_digest(self.b, start, self.i)?;
        }
        if let Some(to) = skip(self.digest).filter(|&to| to > self.i && to <= self.b.len()) {
            self.i = to;
        }
        Some(())
    }

    /// One message object: its role (a string without escapes, else the scan declines) and
    /// whether its content is what a later message may carry without a second look (absent,
    /// null or a string; content parts are left to `peek`).
    fn message(&mut self) -> Option<(Role, bool)> {
        self.eat(b'{')?;
        self.enter()?;
        let (mut role, mut content) = (None, None);
        self.ws();
        if self.at()? != b'}' {
            loop {
                let key = self.key()?;
                self.colon()?;
                match key {
                    b"role" if role.is_none() => {
                        let start = self.i;
                        if self.at()? != b'"' || self.string_span()? {
                            return None;
                        }
                        role = Some(if self.b.get(start..self.i)? == b"\"user\"" {
                            Role::User
                        } else {
                            Role::Other
                        });
                    }
                    b"content" if content.is_none() => {
                        content = Some(matches!(self.at()?, b'"' | b'n'));
                        self.value()?;
                    }
                    b"role" | b"content" => return None,
                    _ => self.value()?,
                }
                if !self.more(b'}')? {
                    break;
                }
            }
        }
        self.close();
        Some((role.unwrap_or(Role::Absent), content.unwrap_or(true)))
    }

    /// `null` or an integer `as_u64` reads (at most 19 digits, no sign, fraction or exponent).
    fn count_or_null(&mut self) -> Option<()> {
        if self.at()? == b'n' {
            return self.literal(b"null");
        }
        let start = self.i;
        self.number()?;
        let digits = self.b.get(start..self.i)?;
        (digits.len() <= 19 && digits.iter().all(u8::is_ascii_digit)).then_some(())
    }

    /// Any JSON value.
    fn value(&mut self) -> Option<()> {
        match self.at()? {
            b'"' => self.string(),
            b'{' => {
                self.i += 1;
                self.enter()?;
                self.ws();
                if self.at()? != b'}' {
                    loop {
                        if self.at()? != b'"' {
                            return None;
                        }
                        self.string()?;
                        self.colon()?;
                        self.value()?;
                        if !self.more(b'}')? {
                            break;
                        }
                    }
                }
                self.close();
                Some(())
            }
            b'[' => {
                self.i += 1;
                self.enter()?;
                self.ws();
                if self.at()? != b']' {
                    loop {
                        self.value()?;
                        if !self.more(b']')? {
                            break;
                        }
                    }
                }
                self.close();
                Some(())
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => self.number(),
        }
    }

    fn literal(&mut self, lit: &[u8]) -> Option<()> {
        let end = self.i + lit.len();
        (self.b.get(self.i..end)? == lit).then(|| self.i = end)
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?`, at most [`MAX_NUMBER_BYTES`].
    fn number(&mut self) -> Option<()> {
        let start = self.i;
        if self.at() == Some(b'-') {
            self.i += 1;
        }
        match self.at()? {
            b'0' => self.i += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.at() == Some(b'.') {
            self.i += 1;
            if !self.at()?.is_ascii_digit() {
                return None;
            }
            self.digits();
        }
        // An exponent can overflow `f64` (serde refuses the body then): `peek` decides.
        if matches!(self.at(), Some(b'e' | b'E')) || self.i - start > MAX_NUMBER_BYTES {
            return None;
        }
        Some(())
    }

    fn digits(&mut self) {
        while self.at().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
    }

    /// A string (at its opening quote).
    fn string(&mut self) -> Option<()> {
        self.string_span().map(|_| ())
    }

    /// Steps over a string from its opening quote to past its closing one; `Some(true)` when it
    /// holds an escape. Declines control characters, surrogate escapes and invalid UTF-8.
    fn string_span(&mut self) -> Option<bool> {
        const ONES: u64 = u64::MAX / 255;
        const HIGH: u64 = ONES << 7;
        self.eat(b'"')?;
        let start = self.i;
        let (mut escaped, mut non_ascii) = (false, 0u64);
        loop {
            // Eight bytes at a time to the next quote, backslash or control character
            // (serde_json's own trick; the lowest flagged byte is exact).
            let mut step = 0;
            for chunk in self.b.get(self.i..)?.chunks_exact(8) {
                let Ok(bytes) = <[u8; 8]>::try_from(chunk) else { return None };
                let x = u64::from_le_bytes(bytes);
                // Bytes past the stop may set it too: then UTF-8 is checked needlessly, not wrongly.
                non_ascii |= x;
                let ctrl = x.wrapping_sub(ONES * 0x20) & !x;
                let q = x ^ (ONES * u64::from(b'"'));
                let quote = q.wrapping_sub(ONES) & !q;
                let bs = x ^ (ONES * u64::from(b'\\'));
                let backslash = bs.wrapping_sub(ONES) & !bs;
                let stop = (ctrl | quote | backslash) & HIGH;
                if stop != 0 {
                    step += (stop.trailing_zeros() / 8) as usize;
                    break;
                }
                step += 8;
            }
            self.i += step;
            match self.at()? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    self.escape()?;
                }
                c if c < 0x20 => return None,
                c => {
                    non_ascii |= u64::from(c);
                    self.i += 1;
                }
            }
        }
        let end = self.i;
        self.i += 1;
        if non_ascii & HIGH != 0 {
            std::str::from_utf8(self.b.get(start..end)?).ok()?;
        }
        Some(escaped)
    }

    /// An escape (at its backslash); `\u` of a surrogate half is left to `peek`.
    fn escape(&mut self) -> Option<()> {
        match self.b.get(self.i + 1)? {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.i += 2,
            b'u' => {
                let hex = std::str::from_utf8(self.b.get(self.i + 2..self.i + 6)?).ok()?;
                if !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
                    return None;
                }
                let unit = u16::from_str_radix(hex, 16).ok()?;
                if (0xD800..=0xDFFF).contains(&unit) {
                    return None;
                }
                self.i += 6;
            }
            _ => return None,
        }
        Some(())
    }
}

#[cfg(test)]
#[path = "tests/body.rs"]
mod tests;
