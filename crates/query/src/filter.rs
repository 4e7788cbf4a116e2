//! Key filters: which keys a scan returns, decided from the key alone.

use ramlog_common::glob_match;
use std::ops::Bound;

/// Which keys a scan returns, decided from the key alone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum KeyFilter {
    /// Every key.
    #[default]
    All,
    /// Keys matching a Redis glob pattern ([`glob_match`]).
    Glob(Vec<u8>),
    /// Keys starting with these bytes.
    Prefix(Vec<u8>),
    /// Keys within the bounds, in byte-wise (memcmp) order.
    Range {
        start: Bound<Vec<u8>>,
        end: Bound<Vec<u8>>,
    },
}

impl KeyFilter {
    /// Whether `key` passes the filter. The no-filter case is inlined into the scan loops; the
    /// others are a call.
    #[inline(always)]
    pub fn matches(&self, key: &[u8]) -> bool {
        matches!(self, KeyFilter::All) || self.matches_filtered(key)
    }

    #[inline(never)]
    fn matches_filtered(&self, key: &[u8]) -> bool {
        match self {
            KeyFilter::All => true,
            KeyFilter::Glob(pattern) => glob_match(pattern, key),
            KeyFilter::Prefix(prefix) => key.starts_with(prefix),
            KeyFilter::Range { start, end } => {
                let above = match start {
                    Bound::Unbounded => true,
                    Bound::Included(s) => key >= s.as_slice(),
                    Bound::Excluded(s) => key > s.as_slice(),
                };
                above
                    && match end {
                        Bound::Unbounded => true,
                        Bound::Included(e) => key <= e.as_slice(),
                        Bound::Excluded(e) => key < e.as_slice(),
                    }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_filters() {
        assert!(KeyFilter::All.matches(b""));
        assert!(KeyFilter::Prefix(b"ab".to_vec()).matches(b"abc"));
        assert!(!KeyFilter::Prefix(b"ab".to_vec()).matches(b"a"));
        assert!(KeyFilter::Glob(b"a*".to_vec()).matches(b"abc"));
        let r = KeyFilter::Range {
            start: Bound::Included(b"b".to_vec()),
            end: Bound::Excluded(b"d".to_vec()),
        };
        assert!(!r.matches(b"a"));
        assert!(r.matches(b"b"));
        assert!(r.matches(b"c\xff"));
        assert!(!r.matches(b"d"));
        let r = KeyFilter::Range {
            start: Bound::Excluded(b"b".to_vec()),
            end: Bound::Included(b"d".to_vec()),
        };
        assert!(!r.matches(b"b"));
        assert!(r.matches(b"b\x00"));
        assert!(r.matches(b"d"));
        assert!(!r.matches(b"d\x00"));
    }
}
