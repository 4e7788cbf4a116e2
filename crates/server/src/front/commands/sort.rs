//! SORT and SORT_RO (Redis's `sort.c`): the elements of a list, set or sorted set, ordered as
//! numbers (or bytes with ALPHA), by themselves or by weights read from other keys (BY), limited
//! (LIMIT), with other keys' values fetched (GET), and optionally stored as a list (STORE).
//!
//! BY and GET patterns name other keys: `*` in the pattern is replaced by the element, and
//! `key->field` reads a hash's field; `#` in GET is the element itself and BY `nosort` (a
//! pattern without `*`) keeps the source's order. On a cluster server, as in Redis Cluster,
//! patterns are refused unless they carry the key's own hash tag, so that every key they name
//! is in the key's slot.

use super::typed::*;
use super::*;
use ramlog_proto::types::{self, Hash, Kind, List, Set, ZSet};

/// A key's type and its elements in its own order.
type Source = (Kind, Vec<Vec<u8>>);

struct Options<'a> {
    by: Option<&'a [u8]>,
    offset: i64,
    count: i64,
    gets: Vec<&'a [u8]>,
    desc: bool,
    alpha: bool,
    store: Option<&'a [u8]>,
}

fn parse<'a>(
    ctx: &mut Ctx<'_>,
    args: &[&'a [u8]],
    read_only: bool,
) -> Result<Options<'a>, Replied> {
    let mut o = Options {
        by: None,
        offset: 0,
        count: -1,
        gets: Vec::new(),
        desc: false,
        alpha: false,
        store: None,
    };
    let mut i = 2;
    while i < args.len() {
        let left = args.len() - i - 1;
        let a = args[i];
        if eq_ignore_case(a, "asc") {
            o.desc = false;
        } else if eq_ignore_case(a, "desc") {
            o.desc = true;
        } else if eq_ignore_case(a, "alpha") {
            o.alpha = true;
        } else if eq_ignore_case(a, "limit") && left >= 2 {
            match (parse_i64(args[i + 1]), parse_i64(args[i + 2])) {
                (Some(off), Some(n)) => {
                    o.offset = off;
                    o.count = n;
                }
                _ => {
                    ctx.enc.error(ERR_NOT_INTEGER);
                    return Err(Replied);
                }
            }
            i += 2;
        } else if eq_ignore_case(a, "store") && left >= 1 && !read_only {
            o.store = Some(args[i + 1]);
            i += 1;
        } else if eq_ignore_case(a, "by") && left >= 1 {
            o.by = Some(args[i + 1]);
            i += 1;
        } else if eq_ignore_case(a, "get") && left >= 1 {
            o.gets.push(args[i + 1]);
            i += 1;
        } else {
            ctx.enc.error(ERR_SYNTAX);
            return Err(Replied);
        }
        i += 1;
    }
    Ok(o)
}

/// The position of SORT's STORE destination in `args`, if any (for the cluster's key check).
pub(super) fn store_position(args: &[&[u8]]) -> Option<usize> {
    let mut i = 2;
    while i < args.len() {
        let a = args[i];
        if eq_ignore_case(a, "limit") {
            i += 3;
        } else if eq_ignore_case(a, "by") || eq_ignore_case(a, "get") {
            i += 2;
        } else if eq_ignore_case(a, "store") {
            return (i + 1 < args.len()).then_some(i + 1);
        } else {
            i += 1;
        }
    }
    None
}

/// Whether a pattern names only keys in the slot of `key` (its hash tag is the key's).
fn pattern_in_slot(pattern: &[u8], key: &[u8]) -> bool {
    let key_part = pattern.split(|b| *b == b'-').next().unwrap_or(pattern);
    let tag = |k: &[u8]| -> Option<Vec<u8>> {
        let open = k.iter().position(|b| *b == b'{')?;
        let close = k[open + 1..].iter().position(|b| *b == b'}')?;
        (close > 0).then(|| k[open + 1..open + 1 + close].to_vec())
    };
    match (tag(key_part), tag(key)) {
        (Some(p), Some(k)) => p == k && !p.contains(&b'*'),
        _ => false,
    }
}

/// The value a BY or GET pattern names for `element`: None when the key (or field) is absent
/// or holds another type.
fn lookup(ctx: &mut Ctx<'_>, pattern: &[u8], element: &[u8]) -> Result<Option<Vec<u8>>, Replied> {
    if pattern == b"#" {
        return Ok(Some(element.to_vec()));
    }
    let Some(star) = pattern.iter().position(|b| *b == b'*') else {
        return Ok(None);
    };
    // `key->field`: the arrow after the star names a hash field.
    let arrow = pattern[star..]
        .windows(2)
        .position(|w| w == b"->")
        .map(|p| p + star)
        .filter(|&p| p + 2 < pattern.len());
    let key_end = arrow.unwrap_or(pattern.len());
    let mut key = pattern[..star].to_vec();
    key.extend_from_slice(element);
    key.extend_from_slice(&pattern[star + 1..key_end]);
    let found = match read(ctx, &key) {
        Ok(f) => f,
        Err(e) => {
            engine_error(ctx, &e);
            return Err(Replied);
        }
    };
    let Some(object) = found else {
        return Ok(None);
    };
    match arrow {
        None => Ok(types::string_of(&object.value).map(<[u8]>::to_vec)),
        Some(a) => {
            let field = &pattern[a + 2..];
            if types::kind_of(&object.value) != Ok(Kind::Hash) {
                return Ok(None);
            }
            let h = load_or_empty::<Hash>(ctx, &key)?;
            Ok(h.get(field).map(<[u8]>::to_vec))
        }
    }
}

/// The elements of the key's list, set or sorted set (in its own order); None if absent.
fn elements(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<Option<Source>, Replied> {
    let kind = match read(ctx, key) {
        Ok(None) => return Ok(None),
        Ok(Some(o)) => types::kind_of(&o.value),
        Err(e) => {
            engine_error(ctx, &e);
            return Err(Replied);
        }
    };
    Ok(Some(match kind {
        Ok(Kind::List) => (Kind::List, load_or_empty::<List>(ctx, key)?.items.into()),
        Ok(Kind::Set) => (Kind::Set, load_or_empty::<Set>(ctx, key)?.members),
        Ok(Kind::ZSet) => (
            Kind::ZSet,
            load_or_empty::<ZSet>(ctx, key)?
                .entries
                .into_iter()
                .map(|(_, m)| m)
                .collect(),
        ),
        _ => {
            ctx.enc.error(ERR_WRONGTYPE);
            return Err(Replied);
        }
    }))
}

pub(super) fn cmd_sort(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    sort(ctx, args, false)
}

pub(super) fn cmd_sort_ro(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    sort(ctx, args, true)
}

enum Weight {
    Number(f64),
    Bytes(Vec<u8>),
    Missing,
}

fn sort(ctx: &mut Ctx<'_>, args: &[&[u8]], read_only: bool) {
    let key = args[1];
    let Ok(o) = parse(ctx, args, read_only) else {
        return;
    };
    let clustered = ctx.session.member().is_some() || ctx.session.routed;
    if clustered {
        let patterns = o.by.iter().chain(o.gets.iter().filter(|g| **g != b"#"));
        for p in patterns {
            let nosort = o.by == Some(*p) && !p.contains(&b'*');
            if !nosort && !pattern_in_slot(p, key) {
                let which = if o.by == Some(*p) { "BY" } else { "GET" };
                return ctx.enc.error(&format!(
                    "ERR {which} option of SORT denied in Cluster mode when keys formed by the pattern may be in different slots."
                ));
            }
        }
    }
    let Ok(found) = elements(ctx, key) else {
        return;
    };
    let (kind, mut items) = found.unwrap_or((Kind::List, Vec::new()));
    let mut dont_sort = o.by.is_some_and(|b| !b.contains(&b'*'));
    let mut o = o;
    // As Redis: a set kept in no order is sorted anyway when it is stored, so that the stored
    // list does not depend on the set's layout.
    if dont_sort && kind == Kind::Set && o.store.is_some() {
        dont_sort = false;
        o.alpha = true;
        o.by = None;
    }
    if !dont_sort {
        let mut weighted: Vec<(Weight, Vec<u8>)> = Vec::with_capacity(items.len());
        for item in items.drain(..) {
            let w = match o.by {
                Some(pattern) => match lookup(ctx, pattern, &item) {
                    Ok(Some(v)) => Some(v),
                    Ok(None) => None,
                    Err(Replied) => return,
                },
                None => Some(item.clone()),
            };
            let weight = match w {
                // A missing weight counts as 0, or sorts first with ALPHA.
                None if !o.alpha => Weight::Number(0.0),
                None => Weight::Missing,
                Some(v) if o.alpha => Weight::Bytes(v),
                Some(v) => match std::str::from_utf8(&v)
                    .ok()
                    .and_then(|s| s.trim().parse::<f64>().ok())
                    .filter(|f| !f.is_nan())
                {
                    Some(f) => Weight::Number(f),
                    None => {
                        return ctx
                            .enc
                            .error("ERR One or more scores can't be converted into double")
                    }
                },
            };
            weighted.push((weight, item));
        }
        weighted.sort_by(|(wa, a), (wb, b)| {
            let by_weight = match (wa, wb) {
                (Weight::Number(x), Weight::Number(y)) => {
                    x.partial_cmp(y).unwrap_or(std::cmp::Ordering::Equal)
                }
                (Weight::Bytes(x), Weight::Bytes(y)) => x.cmp(y),
                (Weight::Missing, Weight::Missing) => std::cmp::Ordering::Equal,
                (Weight::Missing, _) => std::cmp::Ordering::Less,
                (_, Weight::Missing) => std::cmp::Ordering::Greater,
                _ => std::cmp::Ordering::Equal,
            };
            let order = by_weight.then_with(|| a.cmp(b));
            if o.desc {
                order.reverse()
            } else {
                order
            }
        });
        items = weighted.into_iter().map(|(_, item)| item).collect();
    } else if o.desc && kind == Kind::ZSet {
        // A sorted set kept in its order: DESC walks it from the end, as Redis does.
        items.reverse();
    }
    // LIMIT: an offset past the end selects nothing; a negative count, everything after it.
    let len = items.len() as i64;
    let start = o.offset.clamp(0, len) as usize;
    let end = if o.count < 0 {
        len as usize
    } else {
        (start as i64 + o.count).min(len) as usize
    };
    let selected = &items[start..end.max(start)];
    let mut out: Vec<Option<Vec<u8>>> = Vec::with_capacity(selected.len() * o.gets.len().max(1));
    for item in selected {
        if o.gets.is_empty() {
            out.push(Some(item.clone()));
        }
        for g in &o.gets {
            match lookup(ctx, g, item) {
                Ok(v) => out.push(v),
                Err(Replied) => return,
            }
        }
    }
    match o.store {
        None => {
            ctx.enc.array(out.len());
            for v in &out {
                ctx.enc.bulk_or_null(v.as_deref());
            }
        }
        Some(dst) => {
            let list = List {
                items: out.into_iter().map(Option::unwrap_or_default).collect(),
            };
            if store(ctx, dst, &list).is_ok() {
                ctx.enc.integer(list.items.len() as i64)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_destination_is_found_past_the_other_options() {
        let args: Vec<&[u8]> = vec![
            b"SORT", b"k", b"LIMIT", b"0", b"5", b"BY", b"w_*", b"STORE", b"dst",
        ];
        assert_eq!(store_position(&args), Some(8));
        let args: Vec<&[u8]> = vec![b"SORT", b"k", b"GET", b"store", b"ALPHA"];
        assert_eq!(store_position(&args), None);
    }

    #[test]
    fn patterns_must_carry_the_keys_hash_tag_on_a_cluster() {
        assert!(pattern_in_slot(b"{user}:w_*", b"{user}:list"));
        assert!(pattern_in_slot(b"{user}:h_*->field", b"{user}:list"));
        assert!(!pattern_in_slot(b"w_*", b"{user}:list"));
        assert!(!pattern_in_slot(b"{other}:w_*", b"{user}:list"));
    }
}
