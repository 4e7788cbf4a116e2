//! Hash commands (Redis's `t_hash.c`): HSET, HSETNX, HMSET, HGET, HMGET, HGETALL, HKEYS, HVALS,
//! HLEN, HEXISTS, HSTRLEN, HDEL, HINCRBY, HINCRBYFLOAT, HRANDFIELD, HSCAN.

use super::large_list::{LargeError, Place};
use super::large_table::{self, Edit, Table};
use super::typed::*;
use super::*;
use ramlog_proto::types::{Hash, Kind};

/// Runs a read on the key's large hash; None when it holds none (the compact path answers).
fn read_large<R>(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    op: impl FnMut(&mut Ctx<'_>, Place<'_>, Table) -> Result<R, LargeError>,
) -> Result<Option<R>, Replied> {
    large_table::on_table(ctx, key, Kind::Hash, false, op)
}

fn change_large(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    fields: &[&[u8]],
    edit: impl FnMut(usize, Option<&[u8]>) -> Result<Edit, String>,
) -> Result<Option<()>, Replied> {
    large_table::change_at(ctx, key, Kind::Hash, fields, edit)
}

fn get_large(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    fields: &[&[u8]],
) -> Result<Option<Vec<Option<Vec<u8>>>>, Replied> {
    large_table::get_at(ctx, key, Kind::Hash, fields)
}

pub(super) fn cmd_hset(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    hset(ctx, args, true)
}

pub(super) fn cmd_hmset(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    hset(ctx, args, false)
}

fn hset(ctx: &mut Ctx<'_>, args: &[&[u8]], count_reply: bool) {
    if !(args.len() - 2).is_multiple_of(2) {
        let name = if count_reply { "hset" } else { "hmset" };
        return ctx.enc.error(&format!(
            "ERR wrong number of arguments for '{name}' command"
        ));
    }
    let pairs = &args[2..];
    let fields: Vec<&[u8]> = pairs.chunks_exact(2).map(|p| p[0]).collect();
    let mut new = 0i64;
    let large = change_large(ctx, args[1], &fields, |i, current| {
        new = if i == 0 { 0 } else { new } + i64::from(current.is_none());
        Ok(Edit::Set(pairs[2 * i + 1].to_vec()))
    });
    let added = match large {
        Err(Replied) => return,
        Ok(Some(())) => Ok(new),
        Ok(None) => hset_compact(ctx, args[1], pairs),
    };
    if let Ok(n) = added {
        if count_reply {
            ctx.enc.integer(n)
        } else {
            ctx.enc.ok()
        }
    }
}

fn hset_compact(ctx: &mut Ctx<'_>, key: &[u8], pairs: &[&[u8]]) -> Result<i64, Replied> {
    update::<Hash, i64>(ctx, key, |h, _| {
        let added = pairs.chunks_exact(2).filter(|p| h.set(p[0], p[1])).count();
        Ok((added as i64, true))
    })
}

pub(super) fn cmd_hsetnx(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (field, value) = (args[2], args[3]);
    let mut set = false;
    match change_large(ctx, args[1], &[field], |_, current| {
        set = current.is_none();
        Ok(if set {
            Edit::Set(value.to_vec())
        } else {
            Edit::Keep
        })
    }) {
        Err(Replied) => return,
        Ok(Some(())) => return ctx.enc.integer(i64::from(set)),
        Ok(None) => {}
    }
    if let Ok(set) = update::<Hash, bool>(ctx, args[1], |h, _| {
        if h.get(field).is_some() {
            return Ok((false, false));
        }
        h.set(field, value);
        Ok((true, true))
    }) {
        ctx.enc.integer(i64::from(set))
    }
}

pub(super) fn cmd_hget(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match get_large(ctx, args[1], &args[2..3]) {
        Err(Replied) => return,
        Ok(Some(values)) => return ctx.enc.bulk_or_null(values[0].as_deref()),
        Ok(None) => {}
    }
    if let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) {
        ctx.enc.bulk_or_null(h.get(args[2]))
    }
}

pub(super) fn cmd_hmget(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match get_large(ctx, args[1], &args[2..]) {
        Err(Replied) => return,
        Ok(Some(values)) => {
            ctx.enc.array(values.len());
            for v in values {
                ctx.enc.bulk_or_null(v.as_deref());
            }
            return;
        }
        Ok(None) => {}
    }
    if let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) {
        ctx.enc.array(args.len() - 2);
        for f in &args[2..] {
            ctx.enc.bulk_or_null(h.get(f));
        }
    }
}

pub(super) fn cmd_hgetall(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) {
        ctx.enc.map(h.fields.len());
        for (f, v) in &h.fields {
            ctx.enc.bulk(f);
            ctx.enc.bulk(v);
        }
    }
}

pub(super) fn cmd_hkeys(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) {
        ctx.enc.array(h.fields.len());
        for (f, _) in &h.fields {
            ctx.enc.bulk(f);
        }
    }
}

pub(super) fn cmd_hvals(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) {
        ctx.enc.array(h.fields.len());
        for (_, v) in &h.fields {
            ctx.enc.bulk(v);
        }
    }
}

pub(super) fn cmd_hlen(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match read_large(ctx, args[1], |_, _, table| Ok(table.header.len)) {
        Err(Replied) => return,
        Ok(Some(len)) => return ctx.enc.integer(len as i64),
        Ok(None) => {}
    }
    if let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) {
        ctx.enc.integer(h.fields.len() as i64)
    }
}

pub(super) fn cmd_hexists(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match get_large(ctx, args[1], &args[2..3]) {
        Err(Replied) => return,
        Ok(Some(values)) => return ctx.enc.integer(i64::from(values[0].is_some())),
        Ok(None) => {}
    }
    if let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) {
        ctx.enc.integer(i64::from(h.get(args[2]).is_some()))
    }
}

pub(super) fn cmd_hstrlen(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match get_large(ctx, args[1], &args[2..3]) {
        Err(Replied) => return,
        Ok(Some(values)) => {
            return ctx
                .enc
                .integer(values[0].as_ref().map_or(0, |v| v.len() as i64))
        }
        Ok(None) => {}
    }
    if let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) {
        ctx.enc
            .integer(h.get(args[2]).map(|v| v.len() as i64).unwrap_or(0))
    }
}

pub(super) fn cmd_hdel(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let fields = &args[2..];
    let mut removed = 0i64;
    match change_large(ctx, args[1], fields, |i, current| {
        removed = if i == 0 { 0 } else { removed } + i64::from(current.is_some());
        Ok(Edit::Remove)
    }) {
        Err(Replied) => return,
        Ok(Some(())) => return ctx.enc.integer(removed),
        Ok(None) => {}
    }
    if let Ok(n) = update::<Hash, i64>(ctx, args[1], |h, _| {
        let removed = fields.iter().filter(|f| h.remove(f)).count();
        Ok((removed as i64, removed > 0))
    }) {
        ctx.enc.integer(n)
    }
}

pub(super) fn cmd_hincrby(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Some(delta) = parse_i64(args[3]) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    let field = args[2];
    let incr = |current: Option<&[u8]>| -> Result<i64, String> {
        let current = match current {
            Some(v) => parse_i64(v).ok_or("ERR hash value is not an integer")?,
            None => 0,
        };
        Ok(current.checked_add(delta).ok_or(ERR_OVERFLOW)?)
    };
    let mut result = 0i64;
    match change_large(ctx, args[1], &[field], |_, current| {
        result = incr(current)?;
        Ok(Edit::Set(result.to_string().into_bytes()))
    }) {
        Err(Replied) => return,
        Ok(Some(())) => return ctx.enc.integer(result),
        Ok(None) => {}
    }
    if let Ok(n) = update::<Hash, i64>(ctx, args[1], |h, _| {
        let next = incr(h.get(field))?;
        h.set(field, next.to_string().as_bytes());
        Ok((next, true))
    }) {
        ctx.enc.integer(n)
    }
}

pub(super) fn cmd_hincrbyfloat(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Some(delta) = parse_f64(args[3]) else {
        return ctx.enc.error("ERR value is not a valid float");
    };
    if !delta.is_finite() {
        return ctx.enc.error("ERR value is NaN or Infinity");
    }
    let field = args[2];
    let incr = |current: Option<&[u8]>| -> Result<String, String> {
        let current = match current {
            Some(v) => parse_f64(v).ok_or("ERR hash value is not a float")?,
            None => 0.0,
        };
        let next = current + delta;
        if !next.is_finite() {
            return Err("ERR increment would produce NaN or Infinity".into());
        }
        Ok(float_text(next))
    };
    let mut result = String::new();
    match change_large(ctx, args[1], &[field], |_, current| {
        result = incr(current)?;
        Ok(Edit::Set(result.clone().into_bytes()))
    }) {
        Err(Replied) => return,
        Ok(Some(())) => return ctx.enc.bulk(result.as_bytes()),
        Ok(None) => {}
    }
    if let Ok(text) = update::<Hash, String>(ctx, args[1], |h, _| {
        let text = incr(h.get(field))?;
        h.set(field, text.as_bytes());
        Ok((text, true))
    }) {
        ctx.enc.bulk(text.as_bytes())
    }
}

/// HRANDFIELD key [count [WITHVALUES]]
pub(super) fn cmd_hrandfield(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let count = match args.get(2) {
        None => None,
        Some(c) => match parse_i64(c) {
            Some(n) => Some(n),
            None => return ctx.enc.error(ERR_NOT_INTEGER),
        },
    };
    let with_values = match args.get(3) {
        None => false,
        Some(o) if eq_ignore_case(o, "withvalues") && args.len() == 4 => true,
        Some(_) => return ctx.enc.error(ERR_SYNTAX),
    };
    if count.is_some_and(|n| n.unsigned_abs() > (i64::MAX as u64) / 2) {
        return ctx.enc.error("ERR value is out of range");
    }
    let large = read_large(ctx, args[1], |ctx, place, table| {
        large_table::random(ctx, place, table, count.unwrap_or(1))
    });
    let picks: Vec<(Vec<u8>, Vec<u8>)> = match large {
        Err(Replied) => return,
        Ok(Some(picks)) => picks,
        Ok(None) => {
            let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) else {
                return;
            };
            random_picks(h.fields.len(), count.unwrap_or(1))
                .into_iter()
                .map(|i| h.fields[i].clone())
                .collect()
        }
    };
    let Some(_) = count else {
        return ctx
            .enc
            .bulk_or_null(picks.first().map(|(f, _)| f.as_slice()));
    };
    if with_values && ctx.enc.resp3() {
        ctx.enc.array(picks.len());
        for (f, v) in &picks {
            ctx.enc.array(2);
            ctx.enc.bulk(f);
            ctx.enc.bulk(v);
        }
        return;
    }
    ctx.enc.array(picks.len() * if with_values { 2 } else { 1 });
    for (f, v) in &picks {
        ctx.enc.bulk(f);
        if with_values {
            ctx.enc.bulk(v);
        }
    }
}

/// HSCAN key cursor [MATCH pattern] [COUNT count] [NOVALUES]
pub(super) fn cmd_hscan(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Ok(opts) = parse_scan_options(ctx, args, true) else {
        return;
    };
    let large = read_large(ctx, args[1], |ctx, place, table| {
        large_table::scan(ctx, place, table, opts.cursor, opts.count)
    });
    match large {
        Err(Replied) => return,
        Ok(Some((next, found))) => {
            let hits: Vec<&(Vec<u8>, Vec<u8>)> = found
                .iter()
                .filter(|(f, _)| scan_matches(opts.pattern, f))
                .collect();
            return reply_scan(ctx, next, &hits, opts.novalues);
        }
        Ok(None) => {}
    }
    let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) else {
        return;
    };
    let hits: Vec<&(Vec<u8>, Vec<u8>)> = h
        .fields
        .iter()
        .filter(|(f, _)| scan_matches(opts.pattern, f))
        .collect();
    reply_scan(ctx, 0, &hits, opts.novalues)
}

fn reply_scan(ctx: &mut Ctx<'_>, cursor: u64, hits: &[&(Vec<u8>, Vec<u8>)], novalues: bool) {
    ctx.enc.array(2);
    ctx.enc.bulk(cursor.to_string().as_bytes());
    ctx.enc.array(hits.len() * if novalues { 1 } else { 2 });
    for (f, v) in hits {
        ctx.enc.bulk(f);
        if !novalues {
            ctx.enc.bulk(v);
        }
    }
}
