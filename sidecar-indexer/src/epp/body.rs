//! A request body as the picker receives it, in chunks (pure): held without copying when it
//! comes in one message, joined into one buffer otherwise.

use prost::bytes::Bytes;

/// A request body as it arrives: the first chunk as decoded (a view of its gRPC frame: no copy
/// for a body that came in one message, the common case), copied into one buffer only once a
/// second chunk comes — memory stays the body's bytes however many chunks carry them.
#[derive(Default)]
pub struct BodyParts {
    first: Option<Bytes>,
    joined: Vec<u8>,
}

impl BodyParts {
    pub fn push(&mut self, chunk: Bytes) {
        if self.first.is_none() && self.joined.is_empty() {
            self.first = Some(chunk);
            return;
        }
        if let Some(first) = self.first.take() {
            self.joined.extend_from_slice(&first);
        }
        self.joined.extend_from_slice(&chunk);
    }

    /// The whole body so far (the parts are left empty).
    pub fn take(&mut self) -> Bytes {
        self.first.take().unwrap_or_else(|| Bytes::from(std::mem::take(&mut self.joined)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_in_one_chunk_is_not_copied_and_several_are_joined() {
        let one = Bytes::from_static(b"{\"a\":1}");
        let mut parts = BodyParts::default();
        parts.push(one.clone());
        let whole = parts.take();
        assert_eq!(whole.as_ptr(), one.as_ptr(), "the chunk itself");
        let mut parts = BodyParts::default();
        for c in ["", "{\"a\"", "", ":1}"] {
            parts.push(Bytes::from_static(c.as_bytes()));
        }
        assert_eq!(&parts.take()[..], b"{\"a\":1}");
        assert!(parts.take().is_empty(), "taken");
    }
}
