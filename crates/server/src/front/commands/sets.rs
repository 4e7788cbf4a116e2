//! Set commands (Redis's `t_set.c`): SADD, SREM, SMEMBERS, SISMEMBER, SMISMEMBER, SCARD, SPOP,
//! SRANDMEMBER, SMOVE, SINTER, SUNION, SDIFF and their STORE forms, SINTERCARD, SSCAN.

use super::typed::*;
use super::*;
use ramlog_proto::types::Set;

pub(super) fn cmd_sadd(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let members = &args[2..];
    if let Ok(n) = update::<Set, i64>(ctx, args[1], |s, _| {
        let added = members.iter().filter(|m| s.add(m)).count();
        Ok((added as i64, added > 0))
    }) {
        ctx.enc.integer(n)
    }
}

pub(super) fn cmd_srem(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let members = &args[2..];
    if let Ok(n) = update::<Set, i64>(ctx, args[1], |s, _| {
        let removed = members.iter().filter(|m| s.remove(m)).count();
        Ok((removed as i64, removed > 0))
    }) {
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
    if let Ok(s) = load_or_empty::<Set>(ctx, args[1]) {
        ctx.enc.integer(i64::from(s.contains(args[2])))
    }
}

pub(super) fn cmd_smismember(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Ok(s) = load_or_empty::<Set>(ctx, args[1]) {
        ctx.enc.array(args.len() - 2);
        for m in &args[2..] {
            ctx.enc.integer(i64::from(s.contains(m)));
        }
    }
}

pub(super) fn cmd_scard(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
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
    let popped = update::<Set, Vec<Vec<u8>>>(ctx, args[1], |s, _| {
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
    });
    let Ok(popped) = popped else {
        return;
    };
    match count {
        None => ctx.enc.bulk_or_null(popped.first().map(|m| m.as_slice())),
        Some(_) => reply_set(ctx, &popped),
    }
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
    let Ok(s) = load_or_empty::<Set>(ctx, args[1]) else {
        return;
    };
    match count {
        None => {
            let pick = random_picks(s.members.len(), 1);
            ctx.enc
                .bulk_or_null(pick.first().map(|&i| s.members[i].as_slice()))
        }
        Some(n) => {
            let picks = random_picks(s.members.len(), n);
            ctx.enc.array(picks.len());
            for i in picks {
                ctx.enc.bulk(&s.members[i]);
            }
        }
    }
}

/// SMOVE source destination member. The member is added to the destination first, then removed
/// from the source: a crash between the two leaves it in both, never in neither.
pub(super) fn cmd_smove(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (src, dst, member) = (args[1], args[2], args[3]);
    let Ok(source) = load::<Set>(ctx, src) else {
        return;
    };
    // As Redis: an absent source answers 0 before the destination's type is checked.
    if source.is_none() {
        return ctx.enc.integer(0);
    }
    if load::<Set>(ctx, dst).is_err() {
        return;
    }
    if !source.is_some_and(|s| s.contains(member)) {
        return ctx.enc.integer(0);
    }
    if src == dst {
        return ctx.enc.integer(1);
    }
    if update::<Set, ()>(ctx, dst, |s, _| Ok(((), s.add(member)))).is_err() {
        return;
    }
    if let Ok(removed) = update::<Set, bool>(ctx, src, |s, _| {
        let r = s.remove(member);
        Ok((r, r))
    }) {
        ctx.enc.integer(i64::from(removed))
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
    match op {
        Algebra::Inter => {
            for m in &first.members {
                if rest.iter().all(|s| s.contains(m)) {
                    out.add(m);
                }
            }
        }
        Algebra::Union => {
            for s in &sets {
                for m in &s.members {
                    out.add(m);
                }
            }
        }
        Algebra::Diff => {
            for m in &first.members {
                if !rest.iter().any(|s| s.contains(m)) {
                    out.add(m);
                }
            }
        }
    }
    Some(out)
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
    let Ok(s) = load_or_empty::<Set>(ctx, args[1]) else {
        return;
    };
    let hits: Vec<&Vec<u8>> = s
        .members
        .iter()
        .filter(|m| scan_matches(opts.pattern, m))
        .collect();
    ctx.enc.array(2);
    ctx.enc.bulk(b"0");
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
    let mut count = 0usize;
    for m in &first.members {
        if rest.iter().all(|s| s.contains(m)) {
            count += 1;
            if limit > 0 && count >= limit {
                break;
            }
        }
    }
    ctx.enc.integer(count as i64)
}
