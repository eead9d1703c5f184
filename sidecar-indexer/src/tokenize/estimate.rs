//! The token count of text that was not tokenized, estimated from its bytes (pure, O(bytes) with no
//! branch per byte): a prior by byte class, calibrated on the text that was tokenized.
//!
//! A prompt tokenized only as far as a cache can match it (`tokens_until`) still needs its length:
//! the cost model's inputs (`isl_blocks`, the booked load, the predicted TTFT) use it. The sample
//! the prompt's tokenized part gives is small (a cold prompt stops after its first chunk, a few
//! hundred bytes) and its kind of text may differ from the rest's (an English system prompt before
//! a Chinese document), so its ratio alone is a poor estimate. The prior counts ASCII bytes, digits
//! (the DeepSeek-V4 pre-tokenizer cuts digit runs in threes) and non-ASCII chars (a CJK char is
//! most of a token) with per-class weights measured on this repository's texts and generated
//! ones; the sample's tokens against its own prior scale it, with a pseudo-count so a sample of a
//! few dozen tokens moves it only part of the way. The error is measured in `tokenize_tests`.

/// Tokens per ASCII byte that is not a digit (prose and code: 0.22–0.30 with the DeepSeek-V4 tokenizer).
const PER_ASCII: f64 = 0.26;
/// Tokens per ASCII digit (runs of up to three digits are one pre-token).
const PER_DIGIT: f64 = 0.4;
/// Tokens per non-ASCII char (CJK ≈ 0.8, accented letters and emoji ≈ 1).
const PER_WIDE: f64 = 0.8;
/// Pseudo-tokens of the prior in the calibration: a sample of this many tokens moves the
/// estimate halfway from the prior's ratio to its own.
const PRIOR_WEIGHT: f64 = 16.0;

/// Byte classes of some text: what the prior needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shape {
    /// Bytes (all of them).
    pub bytes: usize,
    /// ASCII bytes, digits included.
    pub ascii: usize,
    pub digits: usize,
    /// Non-ASCII chars (UTF-8 lead bytes).
    pub wide: usize,
}

impl Shape {
    /// Adds `text`'s classes.
    pub fn add(&mut self, text: &str) {
        let b = text.as_bytes();
        self.bytes += b.len();
        // Per 128-byte block into u8 lanes (no overflow), so the compare-and-add vectorizes.
        let count = |block: &[u8]| {
            let (mut ascii, mut digits, mut wide) = (0u8, 0u8, 0u8);
            for &c in block {
                ascii += u8::from(c < 0x80);
                digits += u8::from(c.wrapping_sub(b'0') < 10);
                wide += u8::from(c >= 0xC0);
            }
            (usize::from(ascii), usize::from(digits), usize::from(wide))
        };
        let blocks = b.chunks_exact(128);
        let tail = blocks.remainder();
        for (a, d, w) in blocks.map(count).chain([count(tail)]) {
            self.ascii += a;
            self.digits += d;
            self.wide += w;
        }
    }

    /// The classes of several texts.
    pub fn of<'a>(texts: impl IntoIterator<Item = &'a str>) -> Self {
        let mut s = Self::default();
        for t in texts {
            s.add(t);
        }
        s
    }

    /// The prior's token count.
    fn prior(&self) -> f64 {
        (self.ascii - self.digits) as f64 * PER_ASCII
            + self.digits as f64 * PER_DIGIT
            + self.wide as f64 * PER_WIDE
    }
}

/// Estimated tokens of `rest`, given a `sample` that was tokenized into `sample_tokens`; at least
/// 1 for non-empty text, 0 for none.
pub fn estimate(sample: Shape, sample_tokens: usize, rest: Shape) -> usize {
    if rest.bytes == 0 {
        return 0;
    }
    let scale = (sample_tokens as f64 + PRIOR_WEIGHT) / (sample.prior() + PRIOR_WEIGHT);
    ((rest.prior() * scale).round() as usize).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_are_counted_per_byte_and_char() {
        let s = Shape::of(["ab 12", "你好é", ""]);
        assert_eq!(s, Shape { bytes: 5 + 6 + 2, ascii: 5, digits: 2, wide: 3 });
    }

    #[test]
    fn the_sample_scales_the_prior() {
        let rest = Shape::of(["x".repeat(4000).as_str()]);
        let sample = Shape::of(["y".repeat(400).as_str()]);
        let prior = (4000.0 * PER_ASCII) as usize;
        let at_prior = (400.0 * PER_ASCII) as usize;
        // No sample: the prior.
        assert_eq!(estimate(Shape::default(), 0, rest), prior);
        // A sample at the prior's ratio keeps it; one at half of it pulls most of the way there.
        assert_eq!(estimate(sample, at_prior, rest), prior);
        let half = estimate(sample, at_prior / 2, rest);
        assert!((prior / 2..prior * 6 / 10).contains(&half), "{half}");
        // Nothing left: nothing estimated; a little text: at least one token.
        assert_eq!(estimate(sample, at_prior, Shape::default()), 0);
        assert_eq!(estimate(sample, at_prior, Shape::of(["a"])), 1);
    }

    #[test]
    fn a_different_kind_of_rest_is_weighed_by_its_own_classes() {
        // An English sample at the prior's ratio, then CJK: the rest is estimated per char.
        let sample = Shape::of(["y".repeat(400).as_str()]);
        let cjk = Shape::of(["你".repeat(1000).as_str()]);
        let at_prior = (400.0 * PER_ASCII) as usize;
        assert_eq!(estimate(sample, at_prior, cjk), (1000.0 * PER_WIDE) as usize);
    }

    #[test]
    fn long_text_is_counted_like_byte_by_byte() {
        let text = "a1你é ".repeat(300);
        let by_byte = text.bytes().fold(Shape::default(), |mut s, c| {
            s.bytes += 1;
            s.ascii += usize::from(c < 0x80);
            s.digits += usize::from(c.is_ascii_digit());
            s.wide += usize::from(c >= 0xC0);
            s
        });
        assert_eq!(Shape::of([text.as_str()]), by_byte);
    }
}
