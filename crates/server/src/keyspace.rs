//! The keyspace one server serves: table 0 of the engine, split into tablets by slot range.
//!
//! Hides which tablet a key lives in (CRC16 slot → tablet, a 16384-entry table) and how a SCAN
//! cursor walks all tablets: the cursor packs the tablet's index in its low bits and the engine's
//! per-tablet cursor above them, so a client holds one opaque number, as with Redis.

use ramlog_common::{key_slot, TableId, SLOT_COUNT};
use ramlog_logmem::{Engine, EngineError, TabletId};
use std::sync::Arc;

/// The table that RESP clients see (Redis has one keyspace per database; ramlog serves db 0).
pub const RESP_TABLE: TableId = 0;

pub struct Keyspace {
    engine: Arc<Engine>,
    /// Tablets in slot order.
    tablets: Vec<TabletId>,
    slot_to_tablet: Vec<TabletId>,
    /// Bits of a SCAN cursor that hold the tablet index.
    tablet_bits: u32,
}

impl Keyspace {
    /// Creates table 0 as `tablet_count` tablets of equal slot ranges.
    pub fn create(engine: Arc<Engine>, tablet_count: u16) -> Result<Keyspace, EngineError> {
        assert!(
            (1..=SLOT_COUNT).contains(&tablet_count),
            "tablet count {tablet_count}"
        );
        let per = SLOT_COUNT.div_ceil(tablet_count);
        let mut tablets = Vec::with_capacity(tablet_count as usize);
        let mut slot_to_tablet = vec![0; SLOT_COUNT as usize];
        let mut first: u16 = 0;
        while first < SLOT_COUNT {
            let last = first.saturating_add(per - 1).min(SLOT_COUNT - 1);
            let id = engine.create_tablet(RESP_TABLE, first, last)?;
            for slot in first..=last {
                slot_to_tablet[slot as usize] = id;
            }
            tablets.push(id);
            first = last + 1;
        }
        let tablet_bits = usize::BITS - (tablets.len().max(2) - 1).leading_zeros();
        Ok(Keyspace {
            engine,
            tablets,
            slot_to_tablet,
            tablet_bits,
        })
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    pub fn tablets(&self) -> &[TabletId] {
        &self.tablets
    }

    /// The tablet holding `key`.
    #[inline]
    pub fn tablet_of(&self, key: &[u8]) -> TabletId {
        self.slot_to_tablet[key_slot(key) as usize]
    }

    /// One SCAN step: appends keys matching `pattern` (after visiting about `count` keys) and returns
    /// the next cursor (0 = done). `None` if the cursor is not one this keyspace handed out.
    pub fn scan(
        &self,
        cursor: u64,
        count: usize,
        pattern: Option<&[u8]>,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<Option<u64>, EngineError> {
        let mask = (1u64 << self.tablet_bits) - 1;
        let mut index = (cursor & mask) as usize;
        let mut inner = cursor >> self.tablet_bits;
        if index >= self.tablets.len() {
            return Ok(None);
        }
        let mut visited = 0;
        let mut batch = Vec::new();
        loop {
            batch.clear();
            let next =
                self.engine
                    .scan_keys(self.tablets[index], inner, count.max(1), &mut batch)?;
            visited += batch.len().max(1);
            for key in batch.drain(..) {
                if pattern.is_none_or(|p| glob_match(p, &key)) {
                    out.push(key);
                }
            }
            if next == 0 {
                index += 1;
                inner = 0;
                if index == self.tablets.len() {
                    return Ok(Some(0));
                }
            } else {
                inner = next;
            }
            if visited >= count {
                break;
            }
        }
        // The engine's cursor must leave room for the tablet bits; it is well below 2^56 in practice.
        if inner.leading_zeros() < self.tablet_bits {
            return Err(EngineError::NoSuchTablet(self.tablets[index]));
        }
        Ok(Some((inner << self.tablet_bits) | index as u64))
    }
}

/// Redis's glob matching (`stringmatchlen`): `*`, `?`, `[abc]`, `[^a-z]`, `\x`; optionally ASCII-case-insensitive.
pub fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    glob_inner(pattern, text, false, &mut false, 0)
}

/// [`glob_match`] ignoring ASCII case (CONFIG GET patterns).
pub fn glob_match_nocase(pattern: &[u8], text: &[u8]) -> bool {
    glob_inner(pattern, text, true, &mut false, 0)
}

/// `skip_longer` is Redis's cut-off: once a `*` has tried every suffix of the text and failed,
/// no enclosing `*` can succeed by consuming more, so the search stops (linear, not exponential).
fn glob_inner(
    mut p: &[u8],
    mut s: &[u8],
    nocase: bool,
    skip_longer: &mut bool,
    depth: usize,
) -> bool {
    // Bound recursion (Redis does the same against pathological patterns).
    if depth > 1000 {
        return false;
    }
    let eq = |a: u8, b: u8| {
        if nocase {
            a.eq_ignore_ascii_case(&b)
        } else {
            a == b
        }
    };
    while !p.is_empty() && !s.is_empty() {
        match p[0] {
            b'*' => {
                while p.len() > 1 && p[1] == b'*' {
                    p = &p[1..];
                }
                if p.len() == 1 {
                    return true;
                }
                for i in 0..s.len() {
                    if glob_inner(&p[1..], &s[i..], nocase, skip_longer, depth + 1) {
                        return true;
                    }
                    if *skip_longer {
                        return false;
                    }
                }
                *skip_longer = true;
                return false;
            }
            b'?' => {
                s = &s[1..];
                p = &p[1..];
            }
            b'[' => {
                p = &p[1..];
                let not = p.first() == Some(&b'^');
                if not {
                    p = &p[1..];
                }
                let mut matched = false;
                loop {
                    match p.first() {
                        None => break,
                        Some(b'\\') if p.len() >= 2 => {
                            p = &p[1..];
                            if eq(p[0], s[0]) {
                                matched = true;
                            }
                        }
                        Some(b']') => break,
                        Some(_) if p.len() >= 3 && p[1] == b'-' => {
                            let (mut lo, mut hi) = (p[0], p[2]);
                            let mut c = s[0];
                            if lo > hi {
                                std::mem::swap(&mut lo, &mut hi);
                            }
                            if nocase {
                                lo = lo.to_ascii_lowercase();
                                hi = hi.to_ascii_lowercase();
                                c = c.to_ascii_lowercase();
                            }
                            p = &p[2..];
                            if c >= lo && c <= hi {
                                matched = true;
                            }
                        }
                        Some(&c) => {
                            if eq(c, s[0]) {
                                matched = true;
                            }
                        }
                    }
                    p = &p[1..];
                }
                if not {
                    matched = !matched;
                }
                if !matched {
                    return false;
                }
                s = &s[1..];
                // p is at ']' (or empty for an unterminated class).
                if !p.is_empty() {
                    p = &p[1..];
                }
            }
            b'\\' if p.len() >= 2 => {
                if !eq(p[1], s[0]) {
                    return false;
                }
                p = &p[2..];
                s = &s[1..];
            }
            c => {
                if !eq(c, s[0]) {
                    return false;
                }
                p = &p[1..];
                s = &s[1..];
            }
        }
    }
    if s.is_empty() {
        while p.first() == Some(&b'*') {
            p = &p[1..];
        }
    }
    p.is_empty() && s.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glob_like_redis() {
        assert!(glob_match(b"*", b""));
        assert!(glob_match(b"h?llo", b"hello"));
        assert!(glob_match(b"h*llo", b"heeeello"));
        assert!(glob_match(b"h[ae]llo", b"hallo"));
        assert!(!glob_match(b"h[ae]llo", b"hillo"));
        assert!(glob_match(b"h[^e]llo", b"hallo"));
        assert!(!glob_match(b"h[^e]llo", b"hello"));
        assert!(glob_match(b"h[a-b]llo", b"hbllo"));
        assert!(glob_match(b"h[b-a]llo", b"hallo"));
        assert!(glob_match(b"key:\\*", b"key:*"));
        assert!(!glob_match(b"key:\\*", b"key:x"));
        assert!(glob_match(b"user:*:name", b"user:42:name"));
        assert!(!glob_match(b"user:*:name", b"user:42:nam"));
        assert!(!glob_match(b"HELLO", b"hello"));
        assert!(glob_match_nocase(b"HELLO", b"hello"));
        assert!(glob_match_nocase(b"max*", b"MAXCLIENTS"));
        assert!(!glob_match(b"a", b""));
        assert!(glob_match(b"a**", b"a"));
    }

    #[test]
    fn pathological_pattern_terminates() {
        let p = b"*a*a*a*a*a*a*a*a*a*a*a*a*b".to_vec();
        let s = vec![b'a'; 40];
        assert!(!glob_match(&p, &s));
        assert!(glob_match(&p[..p.len() - 1], &s));
    }
}
