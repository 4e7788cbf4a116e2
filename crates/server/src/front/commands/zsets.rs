//! Sorted-set commands (Redis's `t_zset.c`): ZADD (NX/XX/GT/LT/CH/INCR), ZINCRBY, ZSCORE,
//! ZMSCORE, ZCARD, ZCOUNT, ZLEXCOUNT, ZRANK, ZREVRANK, ZREM, ZRANGE (BYSCORE/BYLEX/REV/LIMIT/
//! WITHSCORES) and its older forms, ZRANGESTORE, ZPOPMIN, ZPOPMAX, ZREMRANGEBY{RANK,SCORE,LEX},
//! ZRANDMEMBER, ZSCAN.

use super::large_list::LargeError;
use super::large_zset::{self, Large, Tree};
use super::typed::*;
use super::*;
use ramlog_proto::types::{ZEntry, ZSet};

const ERR_FLOAT: &str = "ERR value is not a valid float";
const ERR_MINMAX_FLOAT: &str = "ERR min or max is not a float";
const ERR_MINMAX_LEX: &str = "ERR min or max not valid string range item";

/// Runs a read `op` on the key's large sorted set; None when it holds none (the compact path).
fn on_large<R>(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    mut op: impl FnMut(&mut Ctx<'_>, &mut Tree<'_>, Large) -> Result<R, LargeError>,
) -> Result<Option<R>, Replied> {
    large_zset::on_large(ctx, key, false, |ctx, place, large| {
        large_zset::read(ctx, place, large, |ctx, tree| op(ctx, tree, large))
    })
}

/// Changes the key's large sorted set (see `large_zset::change`), with `reset` called before
/// each attempt; None when it holds none. Errors are answered.
fn change_large(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    members: &[&[u8]],
    mut reset: impl FnMut(),
    mut edit: impl FnMut(usize, Option<f64>) -> Result<Option<Option<f64>>, String>,
) -> Result<Option<u64>, Replied> {
    let done = large_zset::on_large(ctx, key, true, |ctx, place, large| {
        reset();
        large_zset::change(ctx, place, large, members, &mut edit)
    })?;
    match done {
        None => Ok(None),
        Some(Ok(len)) => Ok(Some(len)),
        Some(Err(message)) => {
            ctx.enc.error(&message);
            Err(Replied)
        }
    }
}

/// Pops up to `count` entries from the low end (the high end when `max`), in pop order.
fn pop(ctx: &mut Ctx<'_>, key: &[u8], count: usize, max: bool) -> Result<Vec<ZEntry>, Replied> {
    let large = large_zset::on_large(ctx, key, true, |ctx, place, large| {
        if count == 0 {
            return Ok(Ok(Vec::new()));
        }
        let picked = large_zset::read(ctx, place, large, |ctx, tree| {
            tree.ranks(ctx, 0, count as u64 - 1, max)
        })?;
        if picked.is_empty() {
            return Ok(Ok(picked));
        }
        let members: Vec<&[u8]> = picked.iter().map(|e| e.1.as_slice()).collect();
        Ok(
            large_zset::change(ctx, place, large, &members, |_, _| Ok(Some(None)))?
                .map(|_| picked.clone()),
        )
    })?;
    match large {
        Some(Ok(out)) => return Ok(out),
        Some(Err(message)) => {
            ctx.enc.error(&message);
            return Err(Replied);
        }
        None => {}
    }
    update::<ZSet, Vec<ZEntry>>(ctx, key, |z, _| {
        let n = count.min(z.entries.len());
        let out: Vec<ZEntry> = if max {
            let at = z.entries.len() - n;
            z.entries.drain(at..).rev().collect()
        } else {
            z.entries.drain(..n).collect()
        };
        let changed = !out.is_empty();
        Ok((out, changed))
    })
}

/// ZADD key [NX|XX] [GT|LT] [CH] [INCR] score member [score member ...]
pub(super) fn cmd_zadd(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (mut nx, mut xx, mut gt, mut lt, mut ch, mut incr) =
        (false, false, false, false, false, false);
    let mut i = 2;
    while i < args.len() {
        let o = args[i];
        if eq_ignore_case(o, "nx") {
            nx = true;
        } else if eq_ignore_case(o, "xx") {
            xx = true;
        } else if eq_ignore_case(o, "gt") {
            gt = true;
        } else if eq_ignore_case(o, "lt") {
            lt = true;
        } else if eq_ignore_case(o, "ch") {
            ch = true;
        } else if eq_ignore_case(o, "incr") {
            incr = true;
        } else {
            break;
        }
        i += 1;
    }
    let pairs = &args[i..];
    if pairs.is_empty() || !pairs.len().is_multiple_of(2) {
        return ctx.enc.error(ERR_SYNTAX);
    }
    if nx && xx {
        return ctx
            .enc
            .error("ERR XX and NX options at the same time are not compatible");
    }
    if ((gt || lt) && nx) || (gt && lt) {
        return ctx
            .enc
            .error("ERR GT, LT, and/or NX options at the same time are not compatible");
    }
    if incr && pairs.len() > 2 {
        return ctx
            .enc
            .error("ERR INCR option supports a single increment-element pair");
    }
    let mut scores = Vec::with_capacity(pairs.len() / 2);
    for p in pairs.chunks_exact(2) {
        match parse_f64(p[0]) {
            Some(s) => scores.push((s, p[1])),
            None => return ctx.enc.error(ERR_FLOAT),
        }
    }
    // (added, changed, the INCR result: None when NX/XX/GT/LT held it back)
    type Out = (i64, i64, Option<f64>);
    let members: Vec<&[u8]> = scores.iter().map(|(_, m)| *m).collect();
    let out: std::cell::Cell<Out> = std::cell::Cell::new((0, 0, None));
    let large = change_large(
        ctx,
        args[1],
        &members,
        || out.set((0, 0, None)),
        |i, current| {
            let score = scores[i].0;
            if (nx && current.is_some()) || (xx && current.is_none()) {
                return Ok(None);
            }
            let new = match (incr, current) {
                (true, Some(c)) => c + score,
                _ => score,
            };
            if new.is_nan() {
                return Err("ERR resulting score is not a number (NaN)".into());
            }
            let (mut added, mut changed, _) = out.get();
            if let Some(c) = current {
                if (gt && new <= c) || (lt && new >= c) {
                    return Ok(None);
                }
                if new == c {
                    out.set((added, changed, Some(new)));
                    return Ok(None);
                }
                changed += 1;
            } else {
                added += 1;
            }
            out.set((added, changed, Some(new)));
            Ok(Some(Some(new)))
        },
    );
    let done = match large {
        Err(Replied) => return,
        Ok(Some(_)) => Ok(out.get()),
        Ok(None) => update::<ZSet, Out>(ctx, args[1], |z, _| {
            let (mut added, mut changed, mut last) = (0, 0, None);
            for &(score, member) in &scores {
                let current = z.score(member);
                if (nx && current.is_some()) || (xx && current.is_none()) {
                    continue;
                }
                let new = match (incr, current) {
                    (true, Some(c)) => c + score,
                    _ => score,
                };
                if new.is_nan() {
                    return Err("ERR resulting score is not a number (NaN)".into());
                }
                if let Some(c) = current {
                    if (gt && new <= c) || (lt && new >= c) {
                        continue;
                    }
                    if new != c {
                        z.insert(new, member);
                        changed += 1;
                    }
                } else {
                    z.insert(new, member);
                    added += 1;
                }
                last = Some(new);
            }
            Ok(((added, changed, last), added + changed > 0))
        }),
    };
    let Ok((added, changed, last)) = done else {
        return;
    };
    if incr {
        match last {
            Some(s) => ctx.enc.double(s),
            None => ctx.enc.null(),
        }
    } else {
        ctx.enc.integer(if ch { added + changed } else { added })
    }
}

pub(super) fn cmd_zincrby(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Some(delta) = parse_f64(args[2]) else {
        return ctx.enc.error(ERR_FLOAT);
    };
    let member = args[3];
    let mut result = 0.0;
    match change_large(
        ctx,
        args[1],
        &[member],
        || {},
        |_, current| {
            let new = current.unwrap_or(0.0) + delta;
            if new.is_nan() {
                return Err("ERR resulting score is not a number (NaN)".into());
            }
            result = new;
            Ok(Some(Some(new)))
        },
    ) {
        Err(Replied) => return,
        Ok(Some(_)) => return ctx.enc.double(result),
        Ok(None) => {}
    }
    if let Ok(s) = update::<ZSet, f64>(ctx, args[1], |z, _| {
        let new = z.score(member).unwrap_or(0.0) + delta;
        if new.is_nan() {
            return Err("ERR resulting score is not a number (NaN)".into());
        }
        z.insert(new, member);
        Ok((new, true))
    }) {
        ctx.enc.double(s)
    }
}

/// The scores of `members` in the key's large sorted set; None when it holds none.
fn large_scores(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    members: &[&[u8]],
) -> Result<Option<Vec<Option<f64>>>, Replied> {
    large_zset::on_large(ctx, key, false, |ctx, place, large| {
        large_zset::scores(ctx, place, large, members)
    })
}

pub(super) fn cmd_zscore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match large_scores(ctx, args[1], &args[2..3]) {
        Err(Replied) => return,
        Ok(Some(found)) => {
            return match found[0] {
                Some(s) => ctx.enc.double(s),
                None => ctx.enc.null(),
            }
        }
        Ok(None) => {}
    }
    if let Ok(z) = load_or_empty::<ZSet>(ctx, args[1]) {
        match z.score(args[2]) {
            Some(s) => ctx.enc.double(s),
            None => ctx.enc.null(),
        }
    }
}

pub(super) fn cmd_zmscore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match large_scores(ctx, args[1], &args[2..]) {
        Err(Replied) => return,
        Ok(Some(found)) => {
            ctx.enc.array(found.len());
            for s in found {
                match s {
                    Some(s) => ctx.enc.double(s),
                    None => ctx.enc.null(),
                }
            }
            return;
        }
        Ok(None) => {}
    }
    if let Ok(z) = load_or_empty::<ZSet>(ctx, args[1]) {
        ctx.enc.array(args.len() - 2);
        for m in &args[2..] {
            match z.score(m) {
                Some(s) => ctx.enc.double(s),
                None => ctx.enc.null(),
            }
        }
    }
}

pub(super) fn cmd_zcard(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match large_zset::on_large(ctx, args[1], false, |_, _, large| Ok(large.header.len())) {
        Err(Replied) => return,
        Ok(Some(n)) => return ctx.enc.integer(n as i64),
        Ok(None) => {}
    }
    if let Ok(z) = load_or_empty::<ZSet>(ctx, args[1]) {
        ctx.enc.integer(z.entries.len() as i64)
    }
}

pub(super) fn cmd_zrem(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let members = &args[2..];
    let removed = std::cell::Cell::new(0);
    match change_large(
        ctx,
        args[1],
        members,
        || removed.set(0),
        |_, current| {
            if current.is_some() {
                removed.set(removed.get() + 1);
            }
            Ok(Some(None))
        },
    ) {
        Err(Replied) => return,
        Ok(Some(_)) => return ctx.enc.integer(removed.get()),
        Ok(None) => {}
    }
    if let Ok(n) = update::<ZSet, i64>(ctx, args[1], |z, _| {
        let removed = members.iter().filter(|m| z.remove(m)).count();
        Ok((removed as i64, removed > 0))
    }) {
        ctx.enc.integer(n)
    }
}

/// ZRANK/ZREVRANK key member [WITHSCORE]
fn rank(ctx: &mut Ctx<'_>, args: &[&[u8]], rev: bool) {
    let with_score = match args.get(3) {
        None => false,
        Some(o) if eq_ignore_case(o, "withscore") && args.len() == 4 => true,
        Some(_) => return ctx.enc.error(ERR_SYNTAX),
    };
    let large = large_zset::on_large(ctx, args[1], false, |ctx, place, large| {
        let found = large_zset::rank(ctx, place, large, args[2])?;
        Ok(found.map(|(r, s)| {
            let r = if rev { large.header.len() - 1 - r } else { r };
            (r, s)
        }))
    });
    match large {
        Err(Replied) => return,
        Ok(Some(None)) if with_score => return ctx.enc.null_array(),
        Ok(Some(None)) => return ctx.enc.null(),
        Ok(Some(Some((r, score)))) => {
            if with_score {
                ctx.enc.array(2);
                ctx.enc.integer(r as i64);
                ctx.enc.double(score);
            } else {
                ctx.enc.integer(r as i64)
            }
            return;
        }
        Ok(None) => {}
    }
    let Ok(z) = load_or_empty::<ZSet>(ctx, args[1]) else {
        return;
    };
    match z.position(args[2]) {
        None if with_score => ctx.enc.null_array(),
        None => ctx.enc.null(),
        Some(i) => {
            let r = if rev { z.entries.len() - 1 - i } else { i };
            if with_score {
                ctx.enc.array(2);
                ctx.enc.integer(r as i64);
                ctx.enc.double(z.entries[i].0);
            } else {
                ctx.enc.integer(r as i64)
            }
        }
    }
}

pub(super) fn cmd_zrank(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    rank(ctx, args, false)
}
pub(super) fn cmd_zrevrank(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    rank(ctx, args, true)
}

#[derive(Clone, Copy)]
struct ScoreBound {
    value: f64,
    exclusive: bool,
}

fn parse_score_bound(arg: &[u8]) -> Option<ScoreBound> {
    let (exclusive, rest) = match arg.first() {
        Some(b'(') => (true, &arg[1..]),
        _ => (false, arg),
    };
    parse_f64(rest).map(|value| ScoreBound { value, exclusive })
}

fn above(s: f64, min: ScoreBound) -> bool {
    if min.exclusive {
        s > min.value
    } else {
        s >= min.value
    }
}

fn below(s: f64, max: ScoreBound) -> bool {
    if max.exclusive {
        s < max.value
    } else {
        s <= max.value
    }
}

#[derive(Clone)]
enum LexBound {
    Least,
    Most,
    Inclusive(Vec<u8>),
    Exclusive(Vec<u8>),
}

fn parse_lex_bound(arg: &[u8]) -> Option<LexBound> {
    match arg {
        b"-" => Some(LexBound::Least),
        b"+" => Some(LexBound::Most),
        [b'[', rest @ ..] => Some(LexBound::Inclusive(rest.to_vec())),
        [b'(', rest @ ..] => Some(LexBound::Exclusive(rest.to_vec())),
        _ => None,
    }
}

fn lex_above(m: &[u8], min: &LexBound) -> bool {
    match min {
        LexBound::Least => true,
        LexBound::Most => false,
        LexBound::Inclusive(b) => m >= b.as_slice(),
        LexBound::Exclusive(b) => m > b.as_slice(),
    }
}

fn lex_below(m: &[u8], max: &LexBound) -> bool {
    match max {
        LexBound::Least => false,
        LexBound::Most => true,
        LexBound::Inclusive(b) => m <= b.as_slice(),
        LexBound::Exclusive(b) => m < b.as_slice(),
    }
}

/// Redis's first test of a lex range (`zzlIsInLexRange`): not empty, the last member at or
/// above the minimum and the first at or below the maximum.
fn lex_range_reachable(z: &ZSet, min: &LexBound, max: &LexBound) -> bool {
    use std::cmp::Ordering;
    let (lo, lo_ex) = match min {
        LexBound::Least => (None, false),
        LexBound::Most => return false,
        LexBound::Inclusive(b) => (Some(b.as_slice()), false),
        LexBound::Exclusive(b) => (Some(b.as_slice()), true),
    };
    let (hi, hi_ex) = match max {
        LexBound::Most => (None, false),
        LexBound::Least => return false,
        LexBound::Inclusive(b) => (Some(b.as_slice()), false),
        LexBound::Exclusive(b) => (Some(b.as_slice()), true),
    };
    if let (Some(a), Some(b)) = (lo, hi) {
        match a.cmp(b) {
            Ordering::Greater => return false,
            Ordering::Equal if lo_ex || hi_ex => return false,
            _ => {}
        }
    }
    match (z.entries.first(), z.entries.last()) {
        (Some(first), Some(last)) => lex_above(&last.1, min) && lex_below(&first.1, max),
        _ => false,
    }
}

enum By {
    Rank(i64, i64),
    Score(ScoreBound, ScoreBound),
    Lex(LexBound, LexBound),
}

/// What a range query selects: the entries' indexes, in reply order.
fn select(z: &ZSet, by: &By, rev: bool, limit: Option<(i64, i64)>) -> Vec<usize> {
    let len = z.entries.len();
    let mut out: Vec<usize> = match by {
        By::Rank(start, stop) => {
            return match index_range(*start, *stop, len) {
                None => Vec::new(),
                Some((a, b)) if rev => (a..=b).map(|r| len - 1 - r).collect(),
                Some((a, b)) => (a..=b).collect(),
            };
        }
        By::Score(min, max) => (0..len)
            .filter(|&i| above(z.entries[i].0, *min) && below(z.entries[i].0, *max))
            .collect(),
        // As Redis, which assumes that the members of a lex query all have one score: from the
        // first member at or above the minimum (the last at or below the maximum, reversed),
        // on while the members stay in range.
        By::Lex(min, max) if !lex_range_reachable(z, min, max) => Vec::new(),
        By::Lex(min, max) if rev => {
            let mut out = Vec::new();
            if let Some(last) = (0..len).rev().find(|&i| lex_below(&z.entries[i].1, max)) {
                for i in (0..=last).rev() {
                    if !lex_above(&z.entries[i].1, min) {
                        break;
                    }
                    out.push(i);
                }
            }
            out
        }
        By::Lex(min, max) => {
            let mut out = Vec::new();
            if let Some(first) = (0..len).find(|&i| lex_above(&z.entries[i].1, min)) {
                for i in first..len {
                    if !lex_below(&z.entries[i].1, max) {
                        break;
                    }
                    out.push(i);
                }
            }
            out
        }
    };
    if rev && !matches!(by, By::Lex(..)) {
        out.reverse();
    }
    if let Some((offset, count)) = limit {
        if offset < 0 {
            return Vec::new();
        }
        let skip = (offset as u64).min(out.len() as u64) as usize;
        out.drain(..skip);
        if count >= 0 {
            out.truncate(count as usize);
        }
    }
    out
}

/// The ranks (from the lowest) of the entries a score or lex range holds in a large sorted
/// set: `lo..hi`.
fn bounds(ctx: &mut Ctx<'_>, tree: &mut Tree<'_>, by: &By) -> Result<(u64, u64), LargeError> {
    let (lo, hi) = match by {
        By::Rank(..) => (0, tree.len()),
        By::Score(min, max) => (
            tree.count_before(ctx, |e| !above(e.0, *min))?,
            tree.count_before(ctx, |e| below(e.0, *max))?,
        ),
        // As Redis, which assumes that the members of a lex query all have one score.
        By::Lex(min, max) => (
            tree.count_before(ctx, |e| !lex_above(&e.1, min))?,
            tree.count_before(ctx, |e| lex_below(&e.1, max))?,
        ),
    };
    Ok((lo, hi.max(lo)))
}

/// [`select`] on a large sorted set: the entries, in reply order.
fn select_large(
    ctx: &mut Ctx<'_>,
    tree: &mut Tree<'_>,
    by: &By,
    rev: bool,
    limit: Option<(i64, i64)>,
) -> Result<Vec<ZEntry>, LargeError> {
    let len = tree.len();
    if let By::Rank(start, stop) = by {
        return match index_range(*start, *stop, len as usize) {
            None => Ok(Vec::new()),
            Some((a, b)) => tree.ranks(ctx, a as u64, b as u64, rev),
        };
    }
    let (lo, hi) = bounds(ctx, tree, by)?;
    let (offset, count) = limit.unwrap_or((0, -1));
    if offset < 0 || lo == hi {
        return Ok(Vec::new());
    }
    // Ranks in reply order: from the lowest (from the highest when `rev`).
    let (first, last) = if rev {
        (len - hi, len - 1 - lo)
    } else {
        (lo, hi - 1)
    };
    let first = first.saturating_add(offset as u64);
    let last = if count >= 0 {
        if count == 0 {
            return Ok(Vec::new());
        }
        last.min(first.saturating_add(count as u64 - 1))
    } else {
        last
    };
    if first > last {
        return Ok(Vec::new());
    }
    tree.ranks(ctx, first, last, rev)
}

/// Entries as a range's reply.
fn reply_owned(ctx: &mut Ctx<'_>, entries: &[ZEntry], with_scores: bool) {
    if with_scores && ctx.enc.resp3() {
        ctx.enc.array(entries.len());
        for (s, m) in entries {
            ctx.enc.array(2);
            ctx.enc.bulk(m);
            ctx.enc.double(*s);
        }
        return;
    }
    ctx.enc
        .array(entries.len() * if with_scores { 2 } else { 1 });
    for (s, m) in entries {
        ctx.enc.bulk(m);
        if with_scores {
            ctx.enc.double(*s);
        }
    }
}

/// The entries a range query selects from the key's sorted set, in reply order.
fn selected(ctx: &mut Ctx<'_>, key: &[u8], q: &RangeQuery) -> Result<Vec<ZEntry>, Replied> {
    if let Some(out) = on_large(ctx, key, |ctx, tree, _| {
        select_large(ctx, tree, &q.by, q.rev, q.limit)
    })? {
        return Ok(out);
    }
    let z = load_or_empty::<ZSet>(ctx, key)?;
    let picks = select(&z, &q.by, q.rev, q.limit);
    Ok(picks.into_iter().map(|i| z.entries[i].clone()).collect())
}

fn reply_entries(ctx: &mut Ctx<'_>, z: &ZSet, picks: &[usize], with_scores: bool) {
    if with_scores && ctx.enc.resp3() {
        ctx.enc.array(picks.len());
        for &i in picks {
            ctx.enc.array(2);
            ctx.enc.bulk(&z.entries[i].1);
            ctx.enc.double(z.entries[i].0);
        }
        return;
    }
    ctx.enc.array(picks.len() * if with_scores { 2 } else { 1 });
    for &i in picks {
        ctx.enc.bulk(&z.entries[i].1);
        if with_scores {
            ctx.enc.double(z.entries[i].0);
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum RangeForm {
    /// ZRANGE (and ZRANGESTORE): BYSCORE/BYLEX/REV/LIMIT as options.
    General,
    /// ZREVRANGE, ZRANGEBYSCORE, ZREVRANGEBYSCORE, ZRANGEBYLEX, ZREVRANGEBYLEX.
    RankRev,
    ScoreFwd,
    ScoreRev,
    LexFwd,
    LexRev,
}

struct RangeQuery {
    by: By,
    rev: bool,
    limit: Option<(i64, i64)>,
    with_scores: bool,
}

/// Parses `min max [options]` (args from the range's first bound on) for a range form.
fn parse_range(args: &[&[u8]], form: RangeForm, store: bool) -> Result<RangeQuery, &'static str> {
    let (mut by_score, mut by_lex, mut rev) = match form {
        RangeForm::General => (false, false, false),
        RangeForm::RankRev => (false, false, true),
        RangeForm::ScoreFwd => (true, false, false),
        RangeForm::ScoreRev => (true, false, true),
        RangeForm::LexFwd => (false, true, false),
        RangeForm::LexRev => (false, true, true),
    };
    let mut limit = None;
    let mut with_scores = false;
    let mut i = 2;
    while i < args.len() {
        let o = args[i];
        if eq_ignore_case(o, "withscores")
            && !store
            && !matches!(form, RangeForm::LexFwd | RangeForm::LexRev)
        {
            with_scores = true;
        } else if eq_ignore_case(o, "limit") && form != RangeForm::RankRev && i + 2 < args.len() {
            let (Some(off), Some(cnt)) = (parse_i64(args[i + 1]), parse_i64(args[i + 2])) else {
                return Err(ERR_NOT_INTEGER);
            };
            limit = Some((off, cnt));
            i += 2;
        } else if form == RangeForm::General && eq_ignore_case(o, "byscore") {
            by_score = true;
        } else if form == RangeForm::General && eq_ignore_case(o, "bylex") {
            by_lex = true;
        } else if form == RangeForm::General && eq_ignore_case(o, "rev") {
            rev = true;
        } else {
            return Err(ERR_SYNTAX);
        }
        i += 1;
    }
    if by_score && by_lex {
        return Err(ERR_SYNTAX);
    }
    if limit.is_some() && !by_score && !by_lex {
        return Err(
            "ERR syntax error, LIMIT is only supported in combination with either BYSCORE or BYLEX",
        );
    }
    if with_scores && by_lex {
        return Err("ERR syntax error, WITHSCORES not supported in combination with BYLEX");
    }
    // In the REV forms the first bound is the maximum.
    let (lo, hi) = if rev && (by_score || by_lex) {
        (args[1], args[0])
    } else {
        (args[0], args[1])
    };
    let by = if by_score {
        match (parse_score_bound(lo), parse_score_bound(hi)) {
            (Some(a), Some(b)) => By::Score(a, b),
            _ => return Err(ERR_MINMAX_FLOAT),
        }
    } else if by_lex {
        match (parse_lex_bound(lo), parse_lex_bound(hi)) {
            (Some(a), Some(b)) => By::Lex(a, b),
            _ => return Err(ERR_MINMAX_LEX),
        }
    } else {
        match (parse_i64(lo), parse_i64(hi)) {
            (Some(a), Some(b)) => By::Rank(a, b),
            _ => return Err(ERR_NOT_INTEGER),
        }
    };
    Ok(RangeQuery {
        by,
        rev,
        limit,
        with_scores,
    })
}

fn range(ctx: &mut Ctx<'_>, args: &[&[u8]], form: RangeForm) {
    let q = match parse_range(&args[2..], form, false) {
        Ok(q) => q,
        Err(e) => return ctx.enc.error(e),
    };
    if let Some(out) = match on_large(ctx, args[1], |ctx, tree, _| {
        select_large(ctx, tree, &q.by, q.rev, q.limit)
    }) {
        Err(Replied) => return,
        Ok(found) => found,
    } {
        return reply_owned(ctx, &out, q.with_scores);
    }
    let Ok(z) = load_or_empty::<ZSet>(ctx, args[1]) else {
        return;
    };
    let picks = select(&z, &q.by, q.rev, q.limit);
    reply_entries(ctx, &z, &picks, q.with_scores)
}

pub(super) fn cmd_zrange(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    range(ctx, args, RangeForm::General)
}
pub(super) fn cmd_zrevrange(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    range(ctx, args, RangeForm::RankRev)
}
pub(super) fn cmd_zrangebyscore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    range(ctx, args, RangeForm::ScoreFwd)
}
pub(super) fn cmd_zrevrangebyscore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    range(ctx, args, RangeForm::ScoreRev)
}
pub(super) fn cmd_zrangebylex(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    range(ctx, args, RangeForm::LexFwd)
}
pub(super) fn cmd_zrevrangebylex(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    range(ctx, args, RangeForm::LexRev)
}

/// ZRANGESTORE dst src min max [BYSCORE|BYLEX] [REV] [LIMIT offset count]
pub(super) fn cmd_zrangestore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let q = match parse_range(&args[3..], RangeForm::General, true) {
        Ok(q) => q,
        Err(e) => return ctx.enc.error(e),
    };
    let Ok(mut entries) = selected(ctx, args[2], &q) else {
        return;
    };
    entries.sort_by(ramlog_proto::types::zset_order);
    let out = ZSet { entries };
    if store(ctx, args[1], &out).is_ok() {
        ctx.enc.integer(out.entries.len() as i64)
    }
}

/// ZCOUNT key min max
pub(super) fn cmd_zcount(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (Some(min), Some(max)) = (parse_score_bound(args[2]), parse_score_bound(args[3])) else {
        return ctx.enc.error(ERR_MINMAX_FLOAT);
    };
    count(ctx, args[1], By::Score(min, max))
}

/// ZLEXCOUNT key min max
pub(super) fn cmd_zlexcount(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (Some(min), Some(max)) = (parse_lex_bound(args[2]), parse_lex_bound(args[3])) else {
        return ctx.enc.error(ERR_MINMAX_LEX);
    };
    count(ctx, args[1], By::Lex(min, max))
}

/// ZCOUNT and ZLEXCOUNT.
fn count(ctx: &mut Ctx<'_>, key: &[u8], by: By) {
    match on_large(ctx, key, |ctx, tree, _| bounds(ctx, tree, &by)) {
        Err(Replied) => return,
        Ok(Some((lo, hi))) => return ctx.enc.integer((hi - lo) as i64),
        Ok(None) => {}
    }
    if let Ok(z) = load_or_empty::<ZSet>(ctx, key) {
        let n = select(&z, &by, false, None).len();
        ctx.enc.integer(n as i64)
    }
}

fn remove_range(ctx: &mut Ctx<'_>, key: &[u8], by: By) {
    let large = large_zset::on_large(ctx, key, true, |ctx, place, large| {
        let picked = large_zset::read(ctx, place, large, |ctx, tree| {
            select_large(ctx, tree, &by, false, None)
        })?;
        if picked.is_empty() {
            return Ok(Ok(0));
        }
        let members: Vec<&[u8]> = picked.iter().map(|e| e.1.as_slice()).collect();
        Ok(
            large_zset::change(ctx, place, large, &members, |_, _| Ok(Some(None)))?
                .map(|_| picked.len() as i64),
        )
    });
    match large {
        Err(Replied) => return,
        Ok(Some(Ok(n))) => return ctx.enc.integer(n),
        Ok(Some(Err(message))) => return ctx.enc.error(&message),
        Ok(None) => {}
    }
    if let Ok(n) = update::<ZSet, i64>(ctx, key, |z, _| {
        let mut picks = select(z, &by, false, None);
        picks.sort_unstable();
        for &i in picks.iter().rev() {
            z.entries.remove(i);
        }
        Ok((picks.len() as i64, !picks.is_empty()))
    }) {
        ctx.enc.integer(n)
    }
}

pub(super) fn cmd_zremrangebyrank(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (Some(a), Some(b)) = (parse_i64(args[2]), parse_i64(args[3])) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    remove_range(ctx, args[1], By::Rank(a, b))
}

pub(super) fn cmd_zremrangebyscore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (Some(min), Some(max)) = (parse_score_bound(args[2]), parse_score_bound(args[3])) else {
        return ctx.enc.error(ERR_MINMAX_FLOAT);
    };
    remove_range(ctx, args[1], By::Score(min, max))
}

pub(super) fn cmd_zremrangebylex(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (Some(min), Some(max)) = (parse_lex_bound(args[2]), parse_lex_bound(args[3])) else {
        return ctx.enc.error(ERR_MINMAX_LEX);
    };
    remove_range(ctx, args[1], By::Lex(min, max))
}

/// ZPOPMIN/ZPOPMAX key [count]
fn zpop(ctx: &mut Ctx<'_>, args: &[&[u8]], max: bool) {
    let count = match args.get(2) {
        None => None,
        Some(c) => match parse_i64(c) {
            Some(n) if n >= 0 => Some(n as usize),
            _ => return ctx.enc.error("ERR value is out of range, must be positive"),
        },
    };
    if args.len() > 3 {
        return ctx.enc.error(ERR_SYNTAX);
    }
    let Ok(popped) = pop(ctx, args[1], count.unwrap_or(1), max) else {
        return;
    };
    if count.is_some() && ctx.enc.resp3() {
        ctx.enc.array(popped.len());
        for (s, m) in &popped {
            ctx.enc.array(2);
            ctx.enc.bulk(m);
            ctx.enc.double(*s);
        }
        return;
    }
    ctx.enc.array(popped.len() * 2);
    for (s, m) in &popped {
        ctx.enc.bulk(m);
        ctx.enc.double(*s);
    }
}

pub(super) fn cmd_zpopmin(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    zpop(ctx, args, false)
}
pub(super) fn cmd_zpopmax(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    zpop(ctx, args, true)
}

/// ZRANDMEMBER key [count [WITHSCORES]]
pub(super) fn cmd_zrandmember(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let count = match args.get(2) {
        None => None,
        Some(c) => match parse_i64(c) {
            Some(n) if n.unsigned_abs() <= (i64::MAX as u64) / 2 => Some(n),
            Some(_) => return ctx.enc.error("ERR value is out of range"),
            None => return ctx.enc.error(ERR_NOT_INTEGER),
        },
    };
    let with_scores = match args.get(3) {
        None => false,
        Some(o) if eq_ignore_case(o, "withscores") && args.len() == 4 => true,
        Some(_) => return ctx.enc.error(ERR_SYNTAX),
    };
    let large = large_zset::on_large(ctx, args[1], false, |ctx, place, large| {
        large_zset::random(ctx, place, large, count.unwrap_or(1))
    });
    match large {
        Err(Replied) => return,
        Ok(Some(picked)) => {
            return match count {
                None => ctx.enc.bulk_or_null(picked.first().map(|e| e.1.as_slice())),
                Some(_) => reply_owned(ctx, &picked, with_scores),
            }
        }
        Ok(None) => {}
    }
    let Ok(z) = load_or_empty::<ZSet>(ctx, args[1]) else {
        return;
    };
    match count {
        None => {
            let pick = random_picks(z.entries.len(), 1);
            ctx.enc
                .bulk_or_null(pick.first().map(|&i| z.entries[i].1.as_slice()))
        }
        Some(n) => {
            let picks = random_picks(z.entries.len(), n);
            reply_entries(ctx, &z, &picks, with_scores)
        }
    }
}

/// ZSCAN key cursor [MATCH pattern] [COUNT count]
pub(super) fn cmd_zscan(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Ok(opts) = parse_scan_options(ctx, args, false) else {
        return;
    };
    let large = large_zset::on_large(ctx, args[1], false, |ctx, place, large| {
        large_zset::scan(ctx, place, large, opts.cursor, opts.count)
    });
    match large {
        Err(Replied) => return,
        Ok(Some((next, found))) => {
            let hits: Vec<&ZEntry> = found
                .iter()
                .filter(|(_, m)| scan_matches(opts.pattern, m))
                .collect();
            ctx.enc.array(2);
            ctx.enc.bulk(next.to_string().as_bytes());
            ctx.enc.array(hits.len() * 2);
            for (s, m) in hits {
                ctx.enc.bulk(m);
                ctx.enc.bulk(float_text(*s).as_bytes());
            }
            return;
        }
        Ok(None) => {}
    }
    let Ok(z) = load_or_empty::<ZSet>(ctx, args[1]) else {
        return;
    };
    let hits: Vec<&(f64, Vec<u8>)> = z
        .entries
        .iter()
        .filter(|(_, m)| scan_matches(opts.pattern, m))
        .collect();
    ctx.enc.array(2);
    ctx.enc.bulk(b"0");
    ctx.enc.array(hits.len() * 2);
    for (s, m) in hits {
        ctx.enc.bulk(m);
        // ZSCAN's scores are bulk strings in both protocols.
        ctx.enc.bulk(float_text(*s).as_bytes());
    }
}

/// BZPOPMIN/BZPOPMAX key [key ...] timeout, one try: [key, member, score] of the first
/// non-empty sorted set, or a null array (the connection blocks and tries again).
fn bzpop(ctx: &mut Ctx<'_>, args: &[&[u8]], max: bool) {
    if let Err(e) = super::lists::parse_timeout(args[args.len() - 1]) {
        return ctx.enc.error(e);
    }
    for key in &args[1..args.len() - 1] {
        let popped = pop(ctx, key, 1, max).map(|mut out| out.pop());
        match popped {
            Ok(Some((score, member))) => {
                ctx.enc.array(3);
                ctx.enc.bulk(key);
                ctx.enc.bulk(&member);
                ctx.enc.double(score);
                return;
            }
            Ok(None) => {}
            Err(Replied) => return,
        }
    }
    ctx.enc.null_array()
}

pub(super) fn cmd_bzpopmin(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    bzpop(ctx, args, false)
}
pub(super) fn cmd_bzpopmax(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    bzpop(ctx, args, true)
}

#[derive(Clone, Copy, PartialEq)]
enum ZOp {
    Union,
    Inter,
    Diff,
}

#[derive(Clone, Copy)]
enum Aggregate {
    Sum,
    Min,
    Max,
}

fn aggregate(into: &mut f64, value: f64, how: Aggregate) {
    match how {
        Aggregate::Sum => {
            *into += value;
            // inf + -inf: Redis answers 0.
            if into.is_nan() {
                *into = 0.0;
            }
        }
        Aggregate::Min => *into = into.min(value),
        Aggregate::Max => *into = into.max(value),
    }
}

/// The entries of the set or sorted set at `key` (a set's members score 1), empty if absent;
/// WRONGTYPE for any other type.
fn load_scored(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<Vec<(f64, Vec<u8>)>, Replied> {
    let found = match read(ctx, key) {
        Ok(f) => f,
        Err(e) => {
            engine_error(ctx, &e);
            return Err(Replied);
        }
    };
    let Some(o) = found else {
        return Ok(Vec::new());
    };
    if ramlog_proto::types::kind_of(&o.value) == Ok(ramlog_proto::types::Kind::Set) {
        let s = load_or_empty::<ramlog_proto::types::Set>(ctx, key)?;
        return Ok(s.members.into_iter().map(|m| (1.0, m)).collect());
    }
    if ramlog_proto::types::is_large(&o.value) {
        return Ok(load_or_empty::<ZSet>(ctx, key)?.entries);
    }
    Ok(decode_as::<ZSet>(ctx, &o.value)?.entries)
}

/// ZUNION/ZINTER/ZDIFF and their STORE forms: `store` has the destination at args[1].
fn zalgebra(ctx: &mut Ctx<'_>, args: &[&[u8]], op: ZOp, store: bool) {
    let at = if store { 2 } else { 1 };
    let name = String::from_utf8_lossy(args[0]).to_ascii_lowercase();
    let n = match parse_i64(args[at]) {
        Some(n) if n >= 1 => n as u64,
        Some(_) => {
            return ctx.enc.error(&format!(
                "ERR at least 1 input key is needed for '{name}' command"
            ))
        }
        None => return ctx.enc.error(ERR_NOT_INTEGER),
    };
    if n > (args.len() - at - 1) as u64 {
        return ctx.enc.error(ERR_SYNTAX);
    }
    let n = n as usize;
    let keys = &args[at + 1..at + 1 + n];
    let mut weights = vec![1.0; n];
    let mut how = Aggregate::Sum;
    let mut with_scores = false;
    let mut i = at + 1 + n;
    while i < args.len() {
        let rest = args.len() - i - 1;
        if op != ZOp::Diff && eq_ignore_case(args[i], "weights") && rest >= n {
            for (w, arg) in weights.iter_mut().zip(&args[i + 1..i + 1 + n]) {
                match parse_f64(arg) {
                    Some(v) => *w = v,
                    None => return ctx.enc.error("ERR weight value is not a float"),
                }
            }
            i += 1 + n;
        } else if op != ZOp::Diff && eq_ignore_case(args[i], "aggregate") && rest >= 1 {
            how = if eq_ignore_case(args[i + 1], "sum") {
                Aggregate::Sum
            } else if eq_ignore_case(args[i + 1], "min") {
                Aggregate::Min
            } else if eq_ignore_case(args[i + 1], "max") {
                Aggregate::Max
            } else {
                return ctx.enc.error(ERR_SYNTAX);
            };
            i += 2;
        } else if !store && eq_ignore_case(args[i], "withscores") {
            with_scores = true;
            i += 1;
        } else {
            return ctx.enc.error(ERR_SYNTAX);
        }
    }
    let mut inputs = Vec::with_capacity(n);
    for k in keys {
        let Ok(entries) = load_scored(ctx, k) else {
            return;
        };
        inputs.push(entries);
    }
    let weighted = |score: f64, w: f64| {
        let v = score * w;
        if v.is_nan() {
            0.0
        } else {
            v
        }
    };
    let mut out: Vec<(f64, Vec<u8>)> = Vec::new();
    match op {
        ZOp::Union => {
            let mut acc: HashMap<Vec<u8>, f64> = HashMap::new();
            for (entries, &w) in inputs.iter().zip(&weights) {
                for (s, m) in entries {
                    let v = weighted(*s, w);
                    match acc.get_mut(m) {
                        Some(into) => aggregate(into, v, how),
                        None => {
                            acc.insert(m.clone(), v);
                        }
                    }
                }
            }
            out.extend(acc.into_iter().map(|(m, s)| (s, m)));
        }
        ZOp::Inter => {
            let maps: Vec<HashMap<&[u8], f64>> = inputs
                .iter()
                .map(|e| e.iter().map(|(s, m)| (m.as_slice(), *s)).collect())
                .collect();
            // Walk the smallest input, as Redis does.
            let smallest = (0..n).min_by_key(|&j| inputs[j].len()).unwrap_or(0);
            'members: for (s, m) in &inputs[smallest] {
                let mut score = weighted(*s, weights[smallest]);
                for j in (0..n).filter(|&j| j != smallest) {
                    match maps[j].get(m.as_slice()) {
                        Some(&other) => aggregate(&mut score, weighted(other, weights[j]), how),
                        None => continue 'members,
                    }
                }
                out.push((score, m.clone()));
            }
        }
        ZOp::Diff => {
            let others: std::collections::HashSet<&[u8]> = inputs[1..]
                .iter()
                .flat_map(|e| e.iter().map(|(_, m)| m.as_slice()))
                .collect();
            out.extend(
                inputs[0]
                    .iter()
                    .filter(|(_, m)| !others.contains(m.as_slice()))
                    .cloned(),
            );
        }
    }
    out.sort_by(ramlog_proto::types::zset_order);
    let z = ZSet { entries: out };
    if store {
        if super::typed::store(ctx, args[1], &z).is_ok() {
            ctx.enc.integer(z.entries.len() as i64)
        }
        return;
    }
    let picks: Vec<usize> = (0..z.entries.len()).collect();
    reply_entries(ctx, &z, &picks, with_scores)
}

pub(super) fn cmd_zunion(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    zalgebra(ctx, args, ZOp::Union, false)
}
pub(super) fn cmd_zinter(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    zalgebra(ctx, args, ZOp::Inter, false)
}
pub(super) fn cmd_zdiff(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    zalgebra(ctx, args, ZOp::Diff, false)
}
pub(super) fn cmd_zunionstore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    zalgebra(ctx, args, ZOp::Union, true)
}
pub(super) fn cmd_zinterstore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    zalgebra(ctx, args, ZOp::Inter, true)
}
pub(super) fn cmd_zdiffstore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    zalgebra(ctx, args, ZOp::Diff, true)
}

/// ZINTERCARD numkeys key [key ...] [LIMIT limit]
pub(super) fn cmd_zintercard(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let n = match parse_i64(args[1]) {
        Some(n) if n >= 1 => n as u64,
        Some(_) => {
            return ctx
                .enc
                .error("ERR at least 1 input key is needed for 'zintercard' command")
        }
        None => return ctx.enc.error(ERR_NOT_INTEGER),
    };
    if n > (args.len() - 2) as u64 {
        return ctx.enc.error(ERR_SYNTAX);
    }
    let n = n as usize;
    let Ok(limit) = parse_card_limit(ctx, &args[2 + n..]) else {
        return;
    };
    let mut inputs = Vec::with_capacity(n);
    for k in &args[2..2 + n] {
        let Ok(entries) = load_scored(ctx, k) else {
            return;
        };
        inputs.push(entries);
    }
    inputs.sort_by_key(|e| e.len());
    let others: Vec<std::collections::HashSet<&[u8]>> = inputs[1..]
        .iter()
        .map(|e| e.iter().map(|(_, m)| m.as_slice()).collect())
        .collect();
    let mut count = 0usize;
    for (_, m) in &inputs[0] {
        if others.iter().all(|o| o.contains(m.as_slice())) {
            count += 1;
            if limit > 0 && count >= limit {
                break;
            }
        }
    }
    ctx.enc.integer(count as i64)
}

/// ZMPOP/BZMPOP from `at` (the numkeys argument): pops up to COUNT entries from the first
/// non-empty sorted set, answering [key, [[member, score], ...]], or a null array.
fn zmpop(ctx: &mut Ctx<'_>, args: &[&[u8]], at: usize) {
    let Ok(n) = parse_numkeys(
        ctx,
        args,
        at,
        "ERR numkeys should be greater than 0",
        ERR_SYNTAX,
    ) else {
        return;
    };
    let Some(which) = args.get(at + 1 + n) else {
        return ctx.enc.error(ERR_SYNTAX);
    };
    let max = if eq_ignore_case(which, "max") {
        true
    } else if eq_ignore_case(which, "min") {
        false
    } else {
        return ctx.enc.error(ERR_SYNTAX);
    };
    let Ok(count) = parse_mpop_count(ctx, &args[at + 2 + n..]) else {
        return;
    };
    for key in &args[at + 1..at + 1 + n] {
        let popped = pop(ctx, key, count, max);
        match popped {
            Ok(out) if out.is_empty() => {}
            Ok(out) => {
                ctx.enc.array(2);
                ctx.enc.bulk(key);
                ctx.enc.array(out.len());
                for (s, m) in &out {
                    ctx.enc.array(2);
                    ctx.enc.bulk(m);
                    ctx.enc.double(*s);
                }
                return;
            }
            Err(Replied) => return,
        }
    }
    ctx.enc.null_array()
}

/// ZMPOP numkeys key [key ...] MIN|MAX [COUNT count]
pub(super) fn cmd_zmpop(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    zmpop(ctx, args, 1)
}

/// BZMPOP timeout numkeys key [key ...] MIN|MAX [COUNT count], one try (see `bzpop`).
pub(super) fn cmd_bzmpop(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Err(e) = super::lists::parse_timeout(args[1]) {
        return ctx.enc.error(e);
    }
    zmpop(ctx, args, 2)
}
