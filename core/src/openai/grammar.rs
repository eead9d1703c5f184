//! The one JSON grammar kvmesh's byte scans share: where a value, a string, a number ends, what
//! whitespace is. The filter's scan of a chat body ([`super::scan`]) and the indexer's spans
//! ([`super::fast`]: a flat token-id prompt, a chat's `messages` list for resuming a read) both step
//! through bodies with these functions, so they can never disagree about where something ends.
//!
//! Two strictnesses over the one grammar, because the two uses differ in who has the last word:
//! * **strict** ([`Cursor`]): the scan's answer is final (the filter does not read the body again
//!   when the scan answers), so it accepts only a subset of valid JSON it can vouch for and
//!   declines (`None`) everything else — a control character or invalid UTF-8 in a string, a
//!   surrogate `\u` escape, a number with an exponent or over [`MAX_NUMBER_BYTES`], nesting past
//!   [`MAX_DEPTH`] — leaving those bodies to serde.
//! * **lenient** ([`skip_string`], [`skip_value`]): a span is a hint that serde checks afterwards,
//!   so only where the value ends matters; a backslash escapes the next byte, whatever it is.
//!
//! For a string strict accepts, both give the same end (a property test holds it). They find it
//! differently for speed where each runs: strict steps eight bytes at a time to the next quote,
//! backslash or control character (serde_json's own trick, fast in the filter's wasm VM, where it
//! also spots the non-ASCII bytes whose UTF-8 it must check); lenient jumps to the next quote or
//! backslash with `memchr2`, vectorised natively ([`fast::messages_span`](super::fast) of a 564-KB
//! chat body: 26 µs, against 60 µs stepping eight bytes at a time).

/// Nesting the strict cursor follows at most (serde_json's limit is 128; deeper bodies go to serde).
pub const MAX_DEPTH: usize = 100;

/// Longest number the strict cursor accepts (no exponent: such a number is finite as an `f64`).
pub const MAX_NUMBER_BYTES: usize = 100;

/// The JSON whitespace after `i`: the index of the first other byte (or the end).
pub(crate) fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// Lenient: end of the string whose opening quote is at `i` (one past its closing quote).
pub(crate) fn skip_string(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        j += memchr::memchr2(b'"', b'\\', b.get(j..)?)?;
        match b.get(j)? {
            b'"' => return Some(j + 1),
            _ => j += 2, // a backslash and the byte it escapes
        }
    }
}

/// Lenient: end of the JSON value starting at `i`, if it nests less than `limit` deep (not
/// validated: serde checks the body afterwards).
pub(crate) fn skip_value(b: &[u8], i: usize, limit: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => skip_string(b, i),
        b'[' | b'{' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b.get(j)? {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'[' | b'{' => {
                        depth += 1;
                        if depth >= limit {
                            return None;
                        }
                    }
                    b']' | b'}' => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while let Some(c) = b.get(j) {
                if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// Strict: a position in a body, stepped through value by value; every method that returns
/// `None` declines the body (module docs). Never panics, whatever the bytes.
pub struct Cursor<'a> {
    pub b: &'a [u8],
    pub i: usize,
    depth: usize,
}

impl<'a> Cursor<'a> {
    /// At the start of `b`.
    pub fn new(b: &'a [u8]) -> Self {
        Self { b, i: 0, depth: 0 }
    }

    pub fn at(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    pub fn ws(&mut self) {
        self.i = skip_ws(self.b, self.i);
    }

    pub fn eat(&mut self, c: u8) -> Option<()> {
        (self.at()? == c).then(|| self.i += 1)
    }

    /// One level deeper (after an opening bracket); declines past [`MAX_DEPTH`].
    pub fn enter(&mut self) -> Option<()> {
        self.depth += 1;
        (self.depth <= MAX_DEPTH).then_some(())
    }

    /// Past the closing bracket of the object or list being read.
    pub fn close(&mut self) {
        self.i += 1;
        // Every close follows its enter.
        self.depth -= 1;
    }

    /// The `:` after a key, with the whitespace around it.
    pub fn colon(&mut self) -> Option<()> {
        self.ws();
        self.eat(b':')?;
        self.ws();
        Some(())
    }

    /// After a member or an element: a `,` (consumed, with the whitespace after it) → `true`; the
    /// closing `close` (left for the caller) → `false`; anything else declines.
    pub fn more(&mut self, close: u8) -> Option<bool> {
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

    /// A key without escapes, as its raw bytes (an escaped key could spell a key routing reads).
    pub fn key(&mut self) -> Option<&'a [u8]> {
        let start = self.i + 1;
        if self.string_span()? {
            return None;
        }
        self.b.get(start..self.i - 1)
    }

    /// Any JSON value.
    pub fn value(&mut self) -> Option<()> {
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

    pub fn literal(&mut self, lit: &[u8]) -> Option<()> {
        let end = self.i + lit.len();
        (self.b.get(self.i..end)? == lit).then(|| self.i = end)
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?`, at most [`MAX_NUMBER_BYTES`].
    pub fn number(&mut self) -> Option<()> {
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
        // An exponent can overflow `f64` (serde refuses the body then): serde decides.
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
    pub fn string(&mut self) -> Option<()> {
        self.string_span().map(|_| ())
    }

    /// Steps over a string from its opening quote to past its closing one; `Some(true)` when it
    /// holds an escape. Declines control characters, surrogate escapes and invalid UTF-8.
    pub fn string_span(&mut self) -> Option<bool> {
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

    /// An escape (at its backslash); `\u` of a surrogate half is left to serde.
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
mod tests {
    use super::*;

    /// A random byte string in a quote, from `state`: quotes, backslashes, escapes, multi-byte
    /// characters and control characters among plain bytes.
    fn random_string(state: &mut u64) -> Vec<u8> {
        let alphabet: &[&[u8]] =
            &[b"\"", b"\\", b"\\n", b"\\u00e9", b"\\ud800", "é".as_bytes(), b"\x01", b" ", b"\xff"];
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        let len = (*state % 40) as usize;
        let mut b = vec![b'"'];
        for k in 0..len {
            let r = (*state >> (k % 60)) as usize;
            if r.is_multiple_of(5) {
                b.extend_from_slice(alphabet[r / 5 % alphabet.len()]);
            } else {
                b.push(b'x');
            }
        }
        b.push(b'"');
        b
    }

    /// The two strictnesses are one grammar: where strict accepts a string, lenient ends it at the
    /// same byte, and strict accepts exactly the strings serde reads (no surrogate pairs here).
    #[test]
    fn strict_and_lenient_end_a_string_alike() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let (mut accepted, mut total) = (0, 0);
        for _ in 0..20_000 {
            let b = random_string(&mut state);
            let mut cursor = Cursor::new(&b);
            let strict = cursor.string().map(|()| cursor.i);
            // The only surrogate escape here is a lone leading one, which serde refuses too.
            let end = skip_string(&b, 0).unwrap_or(0);
            let serde_ok = serde_json::from_slice::<String>(&b[..end]).is_ok();
            if let Some(end) = strict {
                assert_eq!(Some(end), skip_string(&b, 0), "{:?}", String::from_utf8_lossy(&b));
                accepted += 1;
            }
            assert_eq!(strict.is_some(), serde_ok, "{:?}", String::from_utf8_lossy(&b));
            total += 1;
        }
        assert!(accepted * 10 > total, "only {accepted} of {total} strings accepted");
    }
}
