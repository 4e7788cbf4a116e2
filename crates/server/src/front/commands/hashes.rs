//! Hash commands (Redis's `t_hash.c`): HSET, HSETNX, HMSET, HGET, HMGET, HGETALL, HKEYS, HVALS,
//! HLEN, HEXISTS, HSTRLEN, HDEL, HINCRBY, HINCRBYFLOAT, HRANDFIELD, HSCAN.

use super::typed::*;
use super::*;
use ramlog_proto::types::Hash;

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
    let added = update::<Hash, i64>(ctx, args[1], |h, _| {
        let added = pairs.chunks_exact(2).filter(|p| h.set(p[0], p[1])).count();
        Ok((added as i64, true))
    });
    if let Ok(n) = added {
        if count_reply {
            ctx.enc.integer(n)
        } else {
            ctx.enc.ok()
        }
    }
}

pub(super) fn cmd_hsetnx(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (field, value) = (args[2], args[3]);
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
    if let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) {
        ctx.enc.bulk_or_null(h.get(args[2]))
    }
}

pub(super) fn cmd_hmget(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
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
    if let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) {
        ctx.enc.integer(h.fields.len() as i64)
    }
}

pub(super) fn cmd_hexists(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) {
        ctx.enc.integer(i64::from(h.get(args[2]).is_some()))
    }
}

pub(super) fn cmd_hstrlen(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) {
        ctx.enc
            .integer(h.get(args[2]).map(|v| v.len() as i64).unwrap_or(0))
    }
}

pub(super) fn cmd_hdel(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let fields = &args[2..];
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
    if let Ok(n) = update::<Hash, i64>(ctx, args[1], |h, _| {
        let current = match h.get(field) {
            Some(v) => parse_i64(v).ok_or("ERR hash value is not an integer")?,
            None => 0,
        };
        let next = current.checked_add(delta).ok_or(ERR_OVERFLOW)?;
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
    let field = args[2];
    if let Ok(text) = update::<Hash, String>(ctx, args[1], |h, _| {
        let current = match h.get(field) {
            Some(v) => parse_f64(v).ok_or("ERR hash value is not a float")?,
            None => 0.0,
        };
        let next = current + delta;
        if !next.is_finite() {
            return Err("ERR increment would produce NaN or Infinity".into());
        }
        let text = float_text(next);
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
    let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) else {
        return;
    };
    let Some(count) = count else {
        let pick = random_picks(h.fields.len(), 1);
        return ctx
            .enc
            .bulk_or_null(pick.first().map(|&i| h.fields[i].0.as_slice()));
    };
    let picks = random_picks(h.fields.len(), count);
    if with_values && ctx.enc.resp3() {
        ctx.enc.array(picks.len());
        for i in picks {
            ctx.enc.array(2);
            ctx.enc.bulk(&h.fields[i].0);
            ctx.enc.bulk(&h.fields[i].1);
        }
        return;
    }
    ctx.enc.array(picks.len() * if with_values { 2 } else { 1 });
    for i in picks {
        ctx.enc.bulk(&h.fields[i].0);
        if with_values {
            ctx.enc.bulk(&h.fields[i].1);
        }
    }
}

/// HSCAN key cursor [MATCH pattern] [COUNT count] [NOVALUES]
pub(super) fn cmd_hscan(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Ok(opts) = parse_scan_options(ctx, args, true) else {
        return;
    };
    let Ok(h) = load_or_empty::<Hash>(ctx, args[1]) else {
        return;
    };
    let hits: Vec<&(Vec<u8>, Vec<u8>)> = h
        .fields
        .iter()
        .filter(|(f, _)| scan_matches(opts.pattern, f))
        .collect();
    ctx.enc.array(2);
    ctx.enc.bulk(b"0");
    ctx.enc
        .array(hits.len() * if opts.novalues { 1 } else { 2 });
    for (f, v) in hits {
        ctx.enc.bulk(f);
        if !opts.novalues {
            ctx.enc.bulk(v);
        }
    }
}
