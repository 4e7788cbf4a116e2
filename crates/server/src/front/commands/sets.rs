//! Set commands (Redis's `t_set.c`): SADD, SREM, SMEMBERS, SISMEMBER, SMISMEMBER, SCARD, SPOP,
//! SRANDMEMBER, SMOVE, SINTER, SUNION, SDIFF and their STORE forms, SINTERCARD, SSCAN.

use super::large_list::{LargeError, Place};
use super::large_table::{self, Edit, Table};
use super::typed::*;
use super::*;
use ramlog_proto::types::{Kind, Set};
use std::collections::HashSet;

/// Runs a read on the key's large set; None when it holds none (the compact path answers).
fn read_large<R>(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    op: impl FnMut(&mut Ctx<'_>, Place<'_>, Table) -> Result<R, LargeError>,
) -> Result<Option<R>, Replied> {
    large_table::on_table(ctx, key, Kind::Set, false, op)
}

/// Adds members to the key's set; how many were new.
fn add(ctx: &mut Ctx<'_>, key: &[u8], members: &[&[u8]]) -> Result<i64, Replied> {
    let mut added = 0i64;
    let large = large_table::change_at(ctx, key, Kind::Set, members, |i, current| {
        added = if i == 0 { 0 } else { added } + i64::from(current.is_none());
        Ok(Edit::Set(Vec::new()))
    })?;
    if large.is_some() {
        return Ok(added);
    }
    update::<Set, i64>(ctx, key, |s, _| {
        let added = members.iter().filter(|m| s.add(m)).count();
        Ok((added as i64, added > 0))
    })
}

/// Removes members from the key's set; how many were there.
fn remove(ctx: &mut Ctx<'_>, key: &[u8], members: &[&[u8]]) -> Result<i64, Replied> {
    let mut removed = 0i64;
    let large = large_table::change_at(ctx, key, Kind::Set, members, |i, current| {
        removed = if i == 0 { 0 } else { removed } + i64::from(current.is_some());
        Ok(Edit::Remove)
    })?;
    if large.is_some() {
        return Ok(removed);
    }
    update::<Set, i64>(ctx, key, |s, _| {
        let removed = members.iter().filter(|m| s.remove(m)).count();
        Ok((removed as i64, removed > 0))
    })
}

/// Whether each of `members` is in the key's set (false for all when the key is absent).
fn contains(ctx: &mut Ctx<'_>, key: &[u8], members: &[&[u8]]) -> Result<Vec<bool>, Replied> {
    if let Some(found) = large_table::get_at(ctx, key, Kind::Set, members)? {
        return Ok(found.iter().map(Option::is_some).collect());
    }
    let s = load_or_empty::<Set>(ctx, key)?;
    Ok(members.iter().map(|m| s.contains(m)).collect())
}

pub(super) fn cmd_sadd(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Ok(n) = add(ctx, args[1], &args[2..]) {
        ctx.enc.integer(n)
    }
}

pub(super) fn cmd_srem(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Ok(n) = remove(ctx, args[1], &args[2..]) {
        ctx.enc.integer(n)
    }
}

fn reply_set(ctx: &mut Ctx<'_>, members: &[Vec<u8>]) {
    ctx.enc.set(members.len());
    for m in members {
        ctx.enc.bulk(m);
    }
}

pub(super) fn cmd_smembers(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Ok(s) = load_or_empty::<Set>(ctx, args[1]) {
        reply_set(ctx, &s.members)
    }
}

pub(super) fn cmd_sismember(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Ok(found) = contains(ctx, args[1], &args[2..3]) {
        ctx.enc.integer(i64::from(found[0]))
    }
}

pub(super) fn cmd_smismember(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Ok(found) = contains(ctx, args[1], &args[2..]) {
        ctx.enc.array(found.len());
        for f in found {
            ctx.enc.integer(i64::from(f));
        }
    }
}

pub(super) fn cmd_scard(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match read_large(ctx, args[1], |_, _, table| Ok(table.header.len)) {
        Err(Replied) => return,
        Ok(Some(len)) => return ctx.enc.integer(len as i64),
        Ok(None) => {}
    }
    if let Ok(s) = load_or_empty::<Set>(ctx, args[1]) {
        ctx.enc.integer(s.members.len() as i64)
    }
}

/// SPOP key [count]
pub(super) fn cmd_spop(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let count = match args.get(2) {
        None => None,
        Some(c) => match parse_i64(c) {
            Some(n) if n >= 0 => Some(n as u64),
            _ => return ctx.enc.error("ERR value is out of range, must be positive"),
        },
    };
    if args.len() > 3 {
        return ctx.enc.error(ERR_SYNTAX);
    }
    // A large set: members drawn at random, then removed, under the key's lock.
    let large = large_table::on_table(ctx, args[1], Kind::Set, true, |ctx, place, table| {
        let want = count.unwrap_or(1).min(table.header.len);
        let picks = large_table::random(ctx, place, table, want as i64)?;
        let members: Vec<&[u8]> = picks.iter().map(|(m, _)| m.as_slice()).collect();
        large_table::change(ctx, place, table, &members, |_, _| Ok(Edit::Remove))?
            .map_err(LargeError::Damaged)?;
        Ok(picks.into_iter().map(|(m, _)| m).collect::<Vec<_>>())
    });
    let popped = match large {
        Err(Replied) => return,
        Ok(Some(popped)) => Ok(popped),
        Ok(None) => pop_compact(ctx, args[1], count),
    };
    let Ok(popped) = popped else {
        return;
    };
    match count {
        None => ctx.enc.bulk_or_null(popped.first().map(|m| m.as_slice())),
        Some(_) => reply_set(ctx, &popped),
    }
}

fn pop_compact(ctx: &mut Ctx<'_>, key: &[u8], count: Option<u64>) -> Result<Vec<Vec<u8>>, Replied> {
    update::<Set, Vec<Vec<u8>>>(ctx, key, |s, _| {
        let want = count.unwrap_or(1).min(s.members.len() as u64) as i64;
        let mut picks = random_picks(s.members.len(), want);
        // Remove from the highest index down so that swap_remove keeps the others in place.
        picks.sort_unstable_by(|a, b| b.cmp(a));
        let out: Vec<Vec<u8>> = picks
            .into_iter()
            .map(|i| s.members.swap_remove(i))
            .collect();
        let changed = !out.is_empty();
        Ok((out, changed))
    })
}

/// SRANDMEMBER key [count]
pub(super) fn cmd_srandmember(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let count = match args.get(2) {
        None => None,
        Some(c) => match parse_i64(c) {
            Some(n) if n.unsigned_abs() <= (i64::MAX as u64) / 2 => Some(n),
            Some(_) => return ctx.enc.error("ERR value is out of range"),
            None => return ctx.enc.error(ERR_NOT_INTEGER),
        },
    };
    if args.len() > 3 {
        return ctx.enc.error(ERR_SYNTAX);
    }
    let large = read_large(ctx, args[1], |ctx, place, table| {
        large_table::random(ctx, place, table, count.unwrap_or(1))
    });
    let picks: Vec<Vec<u8>> = match large {
        Err(Replied) => return,
        Ok(Some(picks)) => picks.into_iter().map(|(m, _)| m).collect(),
        Ok(None) => {
            let Ok(s) = load_or_empty::<Set>(ctx, args[1]) else {
                return;
            };
            random_picks(s.members.len(), count.unwrap_or(1))
                .into_iter()
                .map(|i| s.members[i].clone())
                .collect()
        }
    };
    match count {
        None => ctx.enc.bulk_or_null(picks.first().map(|m| m.as_slice())),
        Some(_) => {
            ctx.enc.array(picks.len());
            for m in &picks {
                ctx.enc.bulk(m);
            }
        }
    }
}

/// SMOVE source destination member. The member is added to the destination first, then removed
/// from the source: a crash between the two leaves it in both, never in neither.
pub(super) fn cmd_smove(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (src, dst, member) = (args[1], args[2], args[3]);
    // As Redis: an absent source answers 0 before the destination's type is checked.
    let Ok(source) = kind_at(ctx, src) else {
        return;
    };
    match source {
        None => return ctx.enc.integer(0),
        Some(Kind::Set) => {}
        Some(_) => return ctx.enc.error(ERR_WRONGTYPE),
    }
    match kind_at(ctx, dst) {
        Err(Replied) => return,
        Ok(None | Some(Kind::Set)) => {}
        Ok(Some(_)) => return ctx.enc.error(ERR_WRONGTYPE),
    }
    match contains(ctx, src, &[member]) {
        Err(Replied) => return,
        Ok(found) if !found[0] => return ctx.enc.integer(0),
        Ok(_) => {}
    }
    if src == dst {
        return ctx.enc.integer(1);
    }
    if add(ctx, dst, &[member]).is_err() {
        return;
    }
    if let Ok(removed) = remove(ctx, src, &[member]) {
        ctx.enc.integer(removed)
    }
}

/// The type of the value at the key; None if it is absent.
fn kind_at(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<Option<Kind>, Replied> {
    let node = ctx.node;
    match node.read_with(
        node.tablet_of(key),
        key,
        &mut ctx.session.acks,
        |v, _, _| ramlog_proto::types::kind_of(v),
    ) {
        Ok(None) => Ok(None),
        Ok(Some(Ok(kind))) => Ok(Some(kind)),
        Ok(Some(Err(e))) => {
            ctx.enc
                .error(&format!("ERR the stored value of this key is damaged: {e}"));
            Err(Replied)
        }
        Err(e) => {
            engine_error(ctx, &e);
            Err(Replied)
        }
    }
}

#[derive(Clone, Copy)]
enum Algebra {
    Inter,
    Union,
    Diff,
}

/// The members of `op` over the sets at `keys` (absent keys are empty sets); None if a reply
/// (WRONGTYPE) was written.
fn combine(ctx: &mut Ctx<'_>, op: Algebra, keys: &[&[u8]]) -> Option<Set> {
    let mut sets = Vec::with_capacity(keys.len());
    for k in keys {
        sets.push(load_or_empty::<Set>(ctx, k).ok()?);
    }
    let mut out = Set::default();
    let Some((first, rest)) = sets.split_first() else {
        return Some(out);
    };
    let rest: Vec<HashSet<&[u8]>> = rest.iter().map(members_of).collect();
    match op {
        Algebra::Inter => {
            out.members = first
                .members
                .iter()
                .filter(|m| rest.iter().all(|s| s.contains(m.as_slice())))
                .cloned()
                .collect();
        }
        Algebra::Union => {
            let mut seen: HashSet<&[u8]> = HashSet::new();
            for s in &sets {
                for m in &s.members {
                    if seen.insert(m) {
                        out.members.push(m.clone());
                    }
                }
            }
        }
        Algebra::Diff => {
            out.members = first
                .members
                .iter()
                .filter(|m| !rest.iter().any(|s| s.contains(m.as_slice())))
                .cloned()
                .collect();
        }
    }
    Some(out)
}

/// A set's members, for lookups in O(1).
fn members_of(s: &Set) -> HashSet<&[u8]> {
    s.members.iter().map(Vec::as_slice).collect()
}

fn algebra(ctx: &mut Ctx<'_>, args: &[&[u8]], op: Algebra) {
    if let Some(s) = combine(ctx, op, &args[1..]) {
        reply_set(ctx, &s.members)
    }
}

fn algebra_store(ctx: &mut Ctx<'_>, args: &[&[u8]], op: Algebra) {
    let Some(s) = combine(ctx, op, &args[2..]) else {
        return;
    };
    if store(ctx, args[1], &s).is_ok() {
        ctx.enc.integer(s.members.len() as i64)
    }
}

pub(super) fn cmd_sinter(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    algebra(ctx, args, Algebra::Inter)
}
pub(super) fn cmd_sunion(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    algebra(ctx, args, Algebra::Union)
}
pub(super) fn cmd_sdiff(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    algebra(ctx, args, Algebra::Diff)
}
pub(super) fn cmd_sinterstore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    algebra_store(ctx, args, Algebra::Inter)
}
pub(super) fn cmd_sunionstore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    algebra_store(ctx, args, Algebra::Union)
}
pub(super) fn cmd_sdiffstore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    algebra_store(ctx, args, Algebra::Diff)
}

/// SSCAN key cursor [MATCH pattern] [COUNT count]
pub(super) fn cmd_sscan(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Ok(opts) = parse_scan_options(ctx, args, false) else {
        return;
    };
    let large = read_large(ctx, args[1], |ctx, place, table| {
        large_table::scan(ctx, place, table, opts.cursor, opts.count)
    });
    let (cursor, members) = match large {
        Err(Replied) => return,
        Ok(Some((next, found))) => (next, found.into_iter().map(|(m, _)| m).collect()),
        Ok(None) => {
            let Ok(s) = load_or_empty::<Set>(ctx, args[1]) else {
                return;
            };
            (0, s.members)
        }
    };
    let hits: Vec<&Vec<u8>> = members
        .iter()
        .filter(|m| scan_matches(opts.pattern, m))
        .collect();
    ctx.enc.array(2);
    ctx.enc.bulk(cursor.to_string().as_bytes());
    ctx.enc.array(hits.len());
    for m in hits {
        ctx.enc.bulk(m);
    }
}

/// SINTERCARD numkeys key [key ...] [LIMIT limit]
pub(super) fn cmd_sintercard(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Ok(n) = parse_numkeys(
        ctx,
        args,
        1,
        "ERR numkeys should be greater than 0",
        "ERR Number of keys can't be greater than number of args",
    ) else {
        return;
    };
    let Ok(limit) = parse_card_limit(ctx, &args[2 + n..]) else {
        return;
    };
    let mut sets = Vec::with_capacity(n);
    for k in &args[2..2 + n] {
        let Ok(s) = load_or_empty::<Set>(ctx, k) else {
            return;
        };
        sets.push(s);
    }
    // Walk the smallest set, as Redis does.
    sets.sort_by_key(|s| s.members.len());
    let (first, rest) = sets.split_first().expect("numkeys >= 1");
    let rest: Vec<HashSet<&[u8]>> = rest.iter().map(members_of).collect();
    let mut count = 0usize;
    for m in &first.members {
        if rest.iter().all(|s| s.contains(m.as_slice())) {
            count += 1;
            if limit > 0 && count >= limit {
                break;
            }
        }
    }
    ctx.enc.integer(count as i64)
}
