//! A minimal zero-copy msgpack reader over a byte slice, for the typed event decoder.
//!
//! It reads one value head at a time (a scalar, or a container's length) and skips values without
//! building anything, so decoding a batch allocates only the event vectors it returns. Nesting is
//! bounded exactly like `rmpv::decode::read_value` (the decoder the indexer used before, kept as the
//! test oracle): every value costs one unit of a 1024 budget, entering a container one more, a
//! string two, binary one, an extension two; the reserved marker `0xc1` reads as nil. So the typed
//! decoder accepts and refuses the same payloads. No length from the wire sizes an allocation
//! beyond the bytes that remain.

/// Depth budget of one payload (rmpv's `MAX_DEPTH`).
pub const MAX_DEPTH: u16 = 1024;

/// Why bytes are not msgpack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgpackError {
    /// The payload ends inside a value.
    Truncated,
    /// Nested deeper than [`MAX_DEPTH`] allows.
    TooDeep,
}

impl std::fmt::Display for MsgpackError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Truncated => "truncated value",
            Self::TooDeep => "nested too deep",
        })
    }
}

/// The head of one value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Head<'a> {
    Nil,
    Bool(bool),
    /// Any integer ≥ 0, whatever its marker.
    Uint(u64),
    /// Any integer < 0.
    Int(i64),
    F32(f32),
    F64(f64),
    /// String bytes (not checked for UTF-8 here).
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext,
    /// An array of this many values; they follow, read at the returned child depth.
    Array(usize),
    /// A map of this many key-value pairs.
    Map(usize),
}

/// A cursor over one payload.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn dec(depth: u16) -> Result<u16, MsgpackError> {
    depth.checked_sub(1).ok_or(MsgpackError::TooDeep)
}

impl<'a> Reader<'a> {
    /// A reader at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or(MsgpackError::Truncated)?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], MsgpackError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, MsgpackError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, MsgpackError> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, MsgpackError> {
        Ok(u32::from_be_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, MsgpackError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn int(v: i64) -> Head<'a> {
        if v < 0 {
            Head::Int(v)
        } else {
            Head::Uint(v as u64)
        }
    }

    /// Reads the head of the value at `depth`; returns it with the depth its children (if a
    /// container) are read at.
    pub fn head(&mut self, depth: u16) -> Result<(Head<'a>, u16), MsgpackError> {
        let d = dec(depth)?;
        let marker = self.u8()?;
        let len32 = |r: &mut Self| r.u32().map(|n| n as usize);
        let head = match marker {
            0x00..=0x7f => Head::Uint(u64::from(marker)),
            0xe0..=0xff => Head::Int(i64::from(marker as i8)),
            0x80..=0x8f => return Ok((Head::Map(usize::from(marker & 0x0f)), dec(d)?)),
            0x90..=0x9f => return Ok((Head::Array(usize::from(marker & 0x0f)), dec(d)?)),
            0xdc => return Ok((Head::Array(usize::from(self.u16()?)), dec(d)?)),
            0xdd => return Ok((Head::Array(len32(self)?), dec(d)?)),
            0xde => return Ok((Head::Map(usize::from(self.u16()?)), dec(d)?)),
            0xdf => return Ok((Head::Map(len32(self)?), dec(d)?)),
            0xa0..=0xbf => self.str(usize::from(marker & 0x1f), d)?,
            0xd9 => {
                let n = usize::from(self.u8()?);
                self.str(n, d)?
            }
            0xda => {
                let n = usize::from(self.u16()?);
                self.str(n, d)?
            }
            0xdb => {
                let n = len32(self)?;
                self.str(n, d)?
            }
            0xc4..=0xc6 => {
                let n = match marker {
                    0xc4 => usize::from(self.u8()?),
                    0xc5 => usize::from(self.u16()?),
                    _ => len32(self)?,
                };
                dec(d)?;
                Head::Bin(self.take(n)?)
            }
            0xc0 | 0xc1 => Head::Nil, // 0xc1 is reserved; rmpv reads it as nil
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xca => Head::F32(f32::from_bits(self.u32()?)),
            0xcb => Head::F64(f64::from_bits(self.u64()?)),
            0xcc => Head::Uint(u64::from(self.u8()?)),
            0xcd => Head::Uint(u64::from(self.u16()?)),
            0xce => Head::Uint(u64::from(self.u32()?)),
            0xcf => Head::Uint(self.u64()?),
            0xd0 => Self::int(i64::from(self.u8()? as i8)),
            0xd1 => Self::int(i64::from(self.u16()? as i16)),
            0xd2 => Self::int(i64::from(self.u32()? as i32)),
            0xd3 => Self::int(self.u64()? as i64),
            // Extensions: fixext 1/2/4/8/16, ext 8/16/32 (type byte, then data).
            0xd4..=0xd8 | 0xc7 | 0xc8 | 0xc9 => {
                let n = match marker {
                    0xd4 => 1,
                    0xd5 => 2,
                    0xd6 => 4,
                    0xd7 => 8,
                    0xd8 => 16,
                    0xc7 => usize::from(self.u8()?),
                    0xc8 => usize::from(self.u16()?),
                    _ => len32(self)?,
                };
                let d = dec(d)?;
                self.u8()?;
                dec(d)?;
                self.take(n)?;
                Head::Ext
            }
        };
        Ok((head, d))
    }

    fn str(&mut self, n: usize, d: u16) -> Result<Head<'a>, MsgpackError> {
        // rmpv: read_str_data and the read_bin_data inside it each take one unit.
        let d = dec(d)?;
        dec(d)?;
        Ok(Head::Str(self.take(n)?))
    }

    /// Fast path for the common element of token and hash arrays: a non-negative integer in a
    /// fixint, u8, u16, u32 or u64 marker, read without the general dispatch. None (nothing
    /// consumed) for any other marker or a truncated value; the caller then reads the head. Depth:
    /// the caller checks once that its elements' depth allows a scalar (`depth >= 1`).
    #[inline]
    pub fn uint_fast(&mut self) -> Option<u64> {
        let at = self.pos;
        let marker = *self.buf.get(at)?;
        let (v, len) = match marker {
            0x00..=0x7f => (u64::from(marker), 1),
            0xcc => (u64::from(*self.buf.get(at + 1)?), 2),
            0xcd => {
                let b = self.buf.get(at + 1..at + 3)?;
                (u64::from(u16::from_be_bytes([b[0], b[1]])), 3)
            }
            0xce => {
                let b = self.buf.get(at + 1..at + 5)?;
                (u64::from(u32::from_be_bytes([b[0], b[1], b[2], b[3]])), 5)
            }
            0xcf => {
                let b = self.buf.get(at + 1..at + 9)?;
                let mut w = [0u8; 8];
                w.copy_from_slice(b);
                (u64::from_be_bytes(w), 9)
            }
            _ => return None,
        };
        self.pos = at + len;
        Some(v)
    }

    /// Skips the rest of a value whose head was `head` (children at `child`): nothing for scalars,
    /// every element for containers.
    pub fn skip_rest(&mut self, head: Head<'a>, child: u16) -> Result<(), MsgpackError> {
        match head {
            Head::Array(n) => {
                for _ in 0..n {
                    self.skip(child)?;
                }
            }
            Head::Map(n) => {
                for _ in 0..n {
                    self.skip(child)?;
                    self.skip(child)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Skips one whole value at `depth`.
    pub fn skip(&mut self, depth: u16) -> Result<(), MsgpackError> {
        let (head, child) = self.head(depth)?;
        self.skip_rest(head, child)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_of_every_marker_family() {
        let cases: &[(&[u8], Head)] = &[
            (&[0x05], Head::Uint(5)),
            (&[0xff], Head::Int(-1)),
            (&[0xd0, 0x05], Head::Uint(5)),
            (&[0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe], Head::Int(-2)),
            (&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfb], Head::Uint(u64::MAX - 4)),
            (&[0xa2, b'h', b'i'], Head::Str(b"hi")),
            (&[0xc4, 0x01, 0x07], Head::Bin(&[7])),
            (&[0xc1], Head::Nil),
            (&[0xd4, 0x01, 0x00], Head::Ext),
            (&[0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0], Head::F64(1.0)),
            (&[0xdd, 0, 0, 0, 3], Head::Array(3)),
            (&[0x81], Head::Map(1)),
        ];
        for (bytes, want) in cases {
            assert_eq!(Reader::new(bytes).head(MAX_DEPTH).map(|h| h.0), Ok(*want), "{bytes:x?}");
        }
    }

    #[test]
    fn truncation_and_depth_are_errors() {
        assert_eq!(Reader::new(&[0xa5, b'a']).skip(MAX_DEPTH), Err(MsgpackError::Truncated));
        assert_eq!(Reader::new(&[0x92, 0x01]).skip(MAX_DEPTH), Err(MsgpackError::Truncated));
        // A huge announced length never allocates: it runs out of bytes.
        assert_eq!(
            Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).skip(MAX_DEPTH),
            Err(MsgpackError::Truncated)
        );
        let deep = vec![0x91u8; 600];
        assert_eq!(Reader::new(&deep).skip(MAX_DEPTH), Err(MsgpackError::TooDeep));
    }
}
