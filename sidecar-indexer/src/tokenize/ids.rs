//! A tokenization's ids: the prefix memo's ids it resumed from, shared (not copied: at 48k tokens
//! that copy, into freshly faulted pages, was a fifth of a warm route), then its own.

use std::borrow::Cow;
use std::sync::Arc;

/// Token ids: the first `shared_len` of `shared`, then `own`.
#[derive(Debug, Clone, Default)]
pub struct Ids {
    shared: Option<Arc<[u32]>>,
    shared_len: usize,
    own: Vec<u32>,
}

impl PartialEq for Ids {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.parts().eq(other.parts())
    }
}

impl Eq for Ids {}

impl From<Vec<u32>> for Ids {
    fn from(own: Vec<u32>) -> Self {
        Self { shared: None, shared_len: 0, own }
    }
}

impl Ids {
    /// `shared[..len]` (clamped), then nothing of its own yet.
    pub fn sharing(shared: Arc<[u32]>, len: usize) -> Self {
        let shared_len = len.min(shared.len());
        Self { shared: Some(shared), shared_len, own: Vec::new() }
    }

    pub fn len(&self) -> usize {
        self.shared_len + self.own.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ids this tokenization added (appended to by encoding).
    pub fn own_mut(&mut self) -> &mut Vec<u32> {
        &mut self.own
    }

    /// The two parts, shared first.
    fn parts(&self) -> impl Iterator<Item = &u32> {
        let shared =
            self.shared.as_deref().and_then(|s| s.get(..self.shared_len)).unwrap_or_default();
        shared.iter().chain(&self.own)
    }

    /// Ids `range` (within [`Self::len`]), borrowed unless it spans both parts.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Cow<'_, [u32]> {
        let shared =
            self.shared.as_deref().and_then(|s| s.get(..self.shared_len)).unwrap_or_default();
        if range.end <= shared.len() {
            return Cow::Borrowed(shared.get(range).unwrap_or_default());
        }
        if range.start >= shared.len() {
            return Cow::Borrowed(
                self.own
                    .get(range.start - shared.len()..range.end - shared.len())
                    .unwrap_or_default(),
            );
        }
        Cow::Owned(self.parts().skip(range.start).take(range.len()).copied().collect())
    }

    /// The first `len` ids as one shared slice: the shared part itself when they lie within it,
    /// else a copy of both parts.
    pub fn to_shared(&self, len: usize) -> Arc<[u32]> {
        match &self.shared {
            Some(s) if len <= self.shared_len && len == s.len() => s.clone(),
            _ => self.parts().take(len).copied().collect(),
        }
    }

    /// All ids in one vector (a copy of the shared part).
    pub fn to_vec(&self) -> Vec<u32> {
        self.parts().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_then_own_reads_as_one_sequence() {
        let mut ids = Ids::sharing(Arc::from(vec![1, 2, 3, 4, 5]), 3);
        ids.own_mut().extend([6, 7]);
        assert_eq!(ids.to_vec(), vec![1, 2, 3, 6, 7]);
        assert_eq!(ids.len(), 5);
        for (range, want) in [
            (0..2, vec![1, 2]),
            (3..5, vec![6, 7]),
            (1..4, vec![2, 3, 6]),
            (0..5, vec![1, 2, 3, 6, 7]),
        ] {
            assert_eq!(ids.slice(range.clone()).to_vec(), want, "{range:?}");
        }
        assert!(
            matches!(ids.slice(0..3), Cow::Borrowed(_))
                && matches!(ids.slice(3..5), Cow::Borrowed(_))
        );
        assert_eq!(&*ids.to_shared(4), &[1, 2, 3, 6]);
        assert_eq!(ids, Ids::from(vec![1, 2, 3, 6, 7]));
        let whole: Arc<[u32]> = Arc::from(vec![9, 8]);
        assert!(Arc::ptr_eq(&Ids::sharing(whole.clone(), 2).to_shared(2), &whole), "not copied");
    }
}
