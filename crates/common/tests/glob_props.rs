//! Property test of the iterative glob against Redis's `stringmatchlen` (util.c), ported here in
//! its recursive form as the reference.

use proptest::prelude::*;
use ramlog_common::{glob_match, glob_match_nocase};

/// Redis's `stringmatchlen` (util.c), recursive as in Redis, plus the documented rule that an
/// empty text matches a pattern made only of `*`.
fn redis_glob(pattern: &[u8], text: &[u8], nocase: bool) -> bool {
    if text.is_empty() {
        return pattern.iter().all(|&c| c == b'*');
    }
    let mut skip = false;
    redis_impl(pattern, text, nocase, &mut skip)
}

fn redis_impl(mut p: &[u8], mut s: &[u8], nocase: bool, skip: &mut bool) -> bool {
    let low = |c: u8| if nocase { c.to_ascii_lowercase() } else { c };
    while !p.is_empty() && !s.is_empty() {
        match p[0] {
            b'*' => {
                while p.len() > 1 && p[1] == b'*' {
                    p = &p[1..];
                }
                if p.len() == 1 {
                    return true;
                }
                while !s.is_empty() {
                    if redis_impl(&p[1..], s, nocase, skip) {
                        return true;
                    }
                    if *skip {
                        return false;
                    }
                    s = &s[1..];
                }
                *skip = true;
                return false;
            }
            b'?' => s = &s[1..],
            b'[' => {
                p = &p[1..];
                let not = p.first() == Some(&b'^');
                if not {
                    p = &p[1..];
                }
                let mut matched = false;
                loop {
                    if p.len() >= 2 && p[0] == b'\\' {
                        p = &p[1..];
                        if p[0] == s[0] {
                            matched = true;
                        }
                    } else if p.first() == Some(&b']') {
                        break;
                    } else if p.is_empty() {
                        // Redis steps back so that the common `pattern++` lands at the end.
                        break;
                    } else if p.len() >= 3 && p[1] == b'-' {
                        let (mut a, mut b) = (p[0], p[2]);
                        if a > b {
                            std::mem::swap(&mut a, &mut b);
                        }
                        let c = low(s[0]);
                        if c >= low(a) && c <= low(b) {
                            matched = true;
                        }
                        p = &p[2..];
                    } else if low(p[0]) == low(s[0]) {
                        matched = true;
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
                if p.is_empty() {
                    // Unterminated class: the pattern is used up.
                    if s.is_empty() {
                        return true;
                    }
                    return false;
                }
            }
            b'\\' if p.len() >= 2 => {
                p = &p[1..];
                if low(p[0]) != low(s[0]) {
                    return false;
                }
                s = &s[1..];
            }
            c => {
                if low(c) != low(s[0]) {
                    return false;
                }
                s = &s[1..];
            }
        }
        p = &p[1..];
        if s.is_empty() {
            while p.first() == Some(&b'*') {
                p = &p[1..];
            }
            break;
        }
    }
    p.is_empty() && s.is_empty()
}

fn glob_pattern() -> impl Strategy<Value = Vec<u8>> {
    // Single bytes plus whole class shapes, so that Redis's corner cases come up often.
    let tokens: Vec<&'static [u8]> = vec![
        b"a", b"b", b"A", b"*", b"?", b"\\", b"[", b"]", b"^", b"-", b"[a-b]", b"[^a]", b"[a-]",
        b"[\\]]", b"[b-a", b"[]", b"[^]", b"[-a]", b"[A-b]", b"[^", b"[\\A]", b"[\\a",
    ];
    prop::collection::vec(prop::sample::select(tokens), 0..5).prop_map(|t| t.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    /// Iterative glob == Redis's recursive algorithm, with and without case folding.
    #[test]
    fn glob_agrees_with_redis(pattern in glob_pattern(), text in prop::collection::vec(prop::sample::select(b"abA]-^\\*?[".to_vec()), 0..7)) {
        prop_assert_eq!(glob_match(&pattern, &text), redis_glob(&pattern, &text, false), "{:?} {:?}", String::from_utf8_lossy(&pattern), String::from_utf8_lossy(&text));
        prop_assert_eq!(glob_match_nocase(&pattern, &text), redis_glob(&pattern, &text, true));
    }
}
