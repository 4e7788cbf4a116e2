//! Redis's glob patterns (`stringmatchlen` in Redis's util.c), as KEYS, SCAN MATCH, CONFIG GET
//! and the scan key filters match them.

/// Redis's glob matching (`stringmatchlen`): `*` (any run), `?` (any byte), `[abc]`, `[^a-z]`,
/// `\x` (a literal `x`), byte-wise with no case folding.
///
/// Redis's corner cases are kept: `[b-a]` is the range `a-b`; `[a-]` is the range from `a` to
/// `]` (it reads the `]` as the range's end, leaving the class unterminated); an unterminated
/// class runs to the end of the pattern; `\` inside a class escapes the next byte; a trailing `\`
/// is a literal backslash. One deliberate difference: a pattern made only of `*` matches the empty
/// text (Redis's KEYS and SCAN special-case `*` to get the same result).
///
/// Iterative with one backtrack point (the last `*`), so the work is O(pattern × text) whatever
/// the pattern; no recursion.
pub fn glob_match(pattern: &[u8], text: &[u8]) -> bool {
    glob::<false>(pattern, text)
}

/// [`glob_match`] ignoring ASCII case (Redis's `nocase`, used by CONFIG GET). As in Redis, an
/// escaped byte inside a class (`[\A]`) still compares case-sensitively.
pub fn glob_match_nocase(pattern: &[u8], text: &[u8]) -> bool {
    glob::<true>(pattern, text)
}

#[inline(always)]
fn fold<const NOCASE: bool>(c: u8) -> u8 {
    if NOCASE {
        c.to_ascii_lowercase()
    } else {
        c
    }
}

fn glob<const NOCASE: bool>(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0usize, 0usize);
    // (pattern index just after the last star run, text index that star's match ends at).
    let mut star: Option<(usize, usize)> = None;
    // Star runs passed: Redis gives up on a pattern past 1 000 of them (its recursion's guard
    // against abusive patterns), so the same patterns match nothing here.
    let mut runs = 0u32;
    while t < text.len() {
        if p < pattern.len() {
            let c = text[t];
            match pattern[p] {
                b'*' => {
                    while p < pattern.len() && pattern[p] == b'*' {
                        p += 1;
                    }
                    if p == pattern.len() {
                        return true;
                    }
                    runs += 1;
                    if runs > STAR_RUNS_MAX {
                        return false;
                    }
                    star = Some((p, t));
                    continue;
                }
                b'?' => {
                    p += 1;
                    t += 1;
                    continue;
                }
                b'[' => {
                    let (matched, next) = class_match::<NOCASE>(pattern, p, c);
                    if matched {
                        p = next;
                        t += 1;
                        continue;
                    }
                }
                b'\\' if p + 1 < pattern.len() => {
                    if fold::<NOCASE>(pattern[p + 1]) == fold::<NOCASE>(c) {
                        p += 2;
                        t += 1;
                        continue;
                    }
                }
                literal => {
                    if fold::<NOCASE>(literal) == fold::<NOCASE>(c) {
                        p += 1;
                        t += 1;
                        continue;
                    }
                }
            }
        }
        // Mismatch: let the last star swallow one more byte, or fail.
        match star {
            Some((sp, st)) => {
                p = sp;
                t = st + 1;
                star = Some((sp, st + 1));
            }
            None => return false,
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

/// The most star runs a pattern may pass before it matches nothing (Redis's nesting limit).
const STAR_RUNS_MAX: u32 = 1000;

/// Matches byte `c` against the class opening at `pattern[p] == b'['`; returns (matched, index
/// just after the class). Follows Redis's loop step for step (escape, `]`, end, range, literal).
fn class_match<const NOCASE: bool>(pattern: &[u8], p: usize, c: u8) -> (bool, usize) {
    let mut i = p + 1;
    let negate = pattern.get(i) == Some(&b'^');
    if negate {
        i += 1;
    }
    let mut matched = false;
    while i < pattern.len() {
        let rest = pattern.len() - i;
        let pc = pattern[i];
        if pc == b'\\' && rest >= 2 {
            matched |= pattern[i + 1] == c;
            i += 2;
        } else if pc == b']' {
            i += 1;
            break;
        } else if rest >= 3 && pattern[i + 1] == b'-' {
            let (mut lo, mut hi) = (pc, pattern[i + 2]);
            if lo > hi {
                std::mem::swap(&mut lo, &mut hi);
            }
            let cc = fold::<NOCASE>(c);
            matched |= cc >= fold::<NOCASE>(lo) && cc <= fold::<NOCASE>(hi);
            i += 3;
        } else {
            matched |= fold::<NOCASE>(pc) == fold::<NOCASE>(c);
            i += 1;
        }
    }
    (matched != negate, i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_past_a_thousand_star_runs_match_nothing_as_in_redis() {
        let text = vec![b'a'; 50_000];
        assert!(!glob_match(&b"*?".repeat(50_000), &text));
        assert!(glob_match(&b"*a".repeat(1000), &text));
        assert!(!glob_match(&b"*a".repeat(1001), &text));
        // A trailing star matches before Redis's guard is reached.
        let mut last = b"*a".repeat(1000);
        last.push(b'*');
        assert!(glob_match(&last, &text));
    }

    #[test]
    fn glob_like_redis() {
        assert!(glob_match(b"*", b""));
        assert!(glob_match(b"**", b""));
        assert!(glob_match(b"", b""));
        assert!(!glob_match(b"", b"a"));
        assert!(!glob_match(b"a", b""));
        assert!(!glob_match(b"?", b""));
        assert!(glob_match(b"*", b"anything"));
        assert!(glob_match(b"user:*", b"user:1"));
        assert!(!glob_match(b"user:*", b"usr:1"));
        assert!(glob_match(b"h?llo", b"hello"));
        assert!(glob_match(b"h?llo", b"hallo"));
        assert!(!glob_match(b"h?llo", b"hllo"));
        assert!(glob_match(b"h*llo", b"hllo"));
        assert!(glob_match(b"h*llo", b"heeeello"));
        assert!(!glob_match(b"h*llo", b"heeeelo"));
        assert!(glob_match(b"h[ae]llo", b"hallo"));
        assert!(glob_match(b"h[ae]llo", b"hello"));
        assert!(!glob_match(b"h[ae]llo", b"hillo"));
        assert!(glob_match(b"h[^e]llo", b"hallo"));
        assert!(!glob_match(b"h[^e]llo", b"hello"));
        assert!(glob_match(b"h[a-b]llo", b"hallo"));
        assert!(glob_match(b"h[a-b]llo", b"hbllo"));
        assert!(!glob_match(b"h[a-b]llo", b"hcllo"));
        assert!(
            glob_match(b"h[b-a]llo", b"hallo"),
            "reversed ranges are swapped"
        );
        assert!(glob_match(b"key:\\*", b"key:*"));
        assert!(!glob_match(b"key:\\*", b"key:x"));
        assert!(glob_match(b"h\\*llo", b"h*llo"));
        assert!(!glob_match(b"h\\*llo", b"hello"));
        assert!(glob_match(b"\\?", b"?"));
        assert!(!glob_match(b"\\?", b"a"));
        assert!(glob_match(b"user:*:name", b"user:42:name"));
        assert!(!glob_match(b"user:*:name", b"user:42:nam"));
        assert!(glob_match(b"*a*b*c", b"xxaxxbxxc"));
        assert!(!glob_match(b"*a*b*c", b"xxaxxbxx"));
        assert!(glob_match(b"a**", b"a"));
        assert!(!glob_match(b"HELLO", b"hello"), "no case folding");
        assert!(glob_match_nocase(b"HELLO", b"hello"));
        assert!(glob_match_nocase(b"max*", b"MAXCLIENTS"));
        assert!(glob_match_nocase(b"[A-C]x", b"bX"));
        assert!(
            !glob_match_nocase(b"[\\A]", b"a"),
            "an escape in a class keeps case (Redis)"
        );
    }

    #[test]
    fn glob_corner_cases_follow_redis() {
        // A trailing backslash is a literal backslash.
        assert!(glob_match(b"a\\", b"a\\"));
        assert!(!glob_match(b"a\\", b"a"));
        // `[a-]` is a range from 'a' to ']' (Redis reads three bytes), unterminated: it covers
        // ']' ..= 'a', and not '-'.
        assert!(glob_match(b"[a-]", b"a"));
        assert!(glob_match(b"[a-]", b"_"));
        assert!(glob_match(b"[a-]", b"]"));
        assert!(!glob_match(b"[a-]", b"-"));
        assert!(!glob_match(b"[a-]", b"b"));
        // A `-` first in a class is a literal.
        assert!(glob_match(b"[-a]", b"-"));
        // An escaped `]` inside a class.
        assert!(glob_match(b"[\\]]", b"]"));
        assert!(glob_match(b"x[\\]]y", b"x]y"));
        // An unterminated class runs to the end of the pattern.
        assert!(glob_match(b"a[bc", b"ab"));
        assert!(glob_match(b"a[bc", b"ac"));
        assert!(!glob_match(b"a[bc", b"abc"));
        assert!(!glob_match(b"[", b"["));
        assert!(
            glob_match(b"[^", b"x"),
            "an open negated empty class matches any byte"
        );
        // Empty classes.
        assert!(!glob_match(b"[]", b"a"));
        assert!(glob_match(b"[^]", b"a"));
        assert!(!glob_match(b"[]]", b"]"));
        // Bytes outside ASCII.
        assert!(glob_match(b"\xff*", b"\xff\x00"));
        assert!(glob_match(b"[\x80-\xff]", b"\x90"));
    }

    #[test]
    fn pathological_glob_patterns_finish() {
        let p = b"*a*a*a*a*a*a*a*a*a*a*a*a*b".to_vec();
        let s = vec![b'a'; 40];
        assert!(!glob_match(&p, &s));
        assert!(glob_match(&p[..p.len() - 1], &s));
        let text = vec![b'a'; 5000];
        let pattern = [b"*a".repeat(40), b"b".to_vec()].concat();
        assert!(!glob_match(&pattern, &text));
        let stars = vec![b'*'; 5000];
        assert!(glob_match(&stars, &text));
    }
}
