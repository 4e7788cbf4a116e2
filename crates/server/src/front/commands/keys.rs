//! Keyspace and expiry commands (Redis's `db.c` and `expire.c`): DEL/UNLINK, EXISTS, TYPE, SCAN,
//! KEYS, DBSIZE, TTL/PTTL/EXPIRETIME/PEXPIRETIME, EXPIRE/PEXPIRE/EXPIREAT/PEXPIREAT, PERSIST, FLUSHALL.

use super::*;

pub(super) fn cmd_del(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let node = ctx.node;
    let mut deleted = 0;
    for key in &args[1..] {
        match node.delete(
            node.tablet_of(key),
            key,
            Condition::None,
            &mut ctx.session.acks,
        ) {
            Ok(Some(_)) => deleted += 1,
            Ok(None) => {}
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc.integer(deleted);
}

pub(super) fn cmd_exists(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let node = ctx.node;
    let mut found = 0;
    for key in &args[1..] {
        match node.get(node.tablet_of(key), key, &mut ctx.session.acks) {
            Ok(Some(_)) => found += 1,
            Ok(None) => {}
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc.integer(found);
}

/// SCAN cursor [MATCH pattern] [COUNT count] [TYPE type]
pub(super) fn cmd_scan(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let cursor = match std::str::from_utf8(args[1])
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        Some(c) => c,
        None => return ctx.enc.error("ERR invalid cursor"),
    };
    let mut count: usize = 10;
    let mut pattern: Option<&[u8]> = None;
    let mut type_wanted: Option<&[u8]> = None;
    let mut i = 2;
    while i < args.len() {
        if i + 1 >= args.len() {
            return ctx.enc.error(ERR_SYNTAX);
        }
        let value = args[i + 1];
        if eq_ignore_case(args[i], "count") {
            match parse_i64(value) {
                None => return ctx.enc.error(ERR_NOT_INTEGER),
                Some(n) if n < 1 => return ctx.enc.error(ERR_SYNTAX),
                Some(n) => count = n.min(100_000) as usize,
            }
        } else if eq_ignore_case(args[i], "match") {
            // "*" matches everything: skip the matcher, as Redis does.
            pattern = if value == b"*" { None } else { Some(value) };
        } else if eq_ignore_case(args[i], "type") {
            type_wanted = Some(value);
        } else {
            return ctx.enc.error(ERR_SYNTAX);
        }
        i += 2;
    }
    let mut keys = Vec::new();
    let next = match ctx.node.keyspace.scan(cursor, count, pattern, &mut keys) {
        Ok(Some(next)) => next,
        Ok(None) => 0, // a cursor we never handed out: Redis answers an empty last page
        Err(e) => return engine_error(ctx, &e.into()),
    };
    if let Some(wanted) = type_wanted {
        // The type is in each key's value (docs/formats.md, "Typed values"): read it.
        let node = ctx.node;
        keys.retain(|key| {
            node.read_with(
                node.tablet_of(key),
                key,
                &mut ctx.session.acks,
                |v, _, _| {
                    ramlog_proto::types::kind_of(v).is_ok_and(|k| eq_ignore_case(wanted, k.name()))
                },
            )
            .ok()
            .flatten()
            .unwrap_or(false)
        });
    }
    let mut digits = Vec::with_capacity(20);
    ramlog_proto::resp::push_decimal(&mut digits, next as i64);
    if next > i64::MAX as u64 {
        digits = next.to_string().into_bytes();
    }
    ctx.enc.array(2);
    ctx.enc.bulk(&digits);
    ctx.enc.array(keys.len());
    for key in &keys {
        ctx.enc.bulk(key);
    }
}

pub(super) fn cmd_keys(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let pattern = if args[1] == b"*" { None } else { Some(args[1]) };
    let mut keys = Vec::new();
    let mut cursor = 0;
    loop {
        match ctx.node.keyspace.scan(cursor, 1024, pattern, &mut keys) {
            Ok(Some(0)) | Ok(None) => break,
            Ok(Some(next)) => cursor = next,
            Err(e) => return engine_error(ctx, &e.into()),
        }
    }
    keys.sort();
    keys.dedup();
    ctx.enc.array(keys.len());
    for key in &keys {
        ctx.enc.bulk(key);
    }
}

pub(super) fn cmd_dbsize(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    let n = ctx
        .node
        .engine()
        .object_count()
        .saturating_sub(ctx.node.keyspace.hidden_objects());
    ctx.enc.integer(n as i64);
}

/// Remaining time to live: -2 no key, -1 no expiry.
pub(super) fn ttl_common(ctx: &mut Ctx<'_>, key: &[u8], unit_ms: u64, absolute: bool) {
    let node = ctx.node;
    match node.get(node.tablet_of(key), key, &mut ctx.session.acks) {
        Ok(None) => ctx.enc.integer(-2),
        Ok(Some(o)) if o.expire_at_ms == 0 => ctx.enc.integer(-1),
        Ok(Some(o)) => {
            let value = if absolute {
                o.expire_at_ms / unit_ms
            } else {
                let left = o.expire_at_ms.saturating_sub(now_ms());
                // TTL rounds to the nearest second, as Redis does.
                (left + unit_ms / 2) / unit_ms
            };
            ctx.enc.integer(value as i64)
        }
        Err(e) => engine_error(ctx, &e),
    }
}

pub(super) fn cmd_ttl(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    ttl_common(ctx, args[1], 1000, false)
}

pub(super) fn cmd_pttl(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    ttl_common(ctx, args[1], 1, false)
}

pub(super) fn cmd_expiretime(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    ttl_common(ctx, args[1], 1000, true)
}

pub(super) fn cmd_pexpiretime(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    ttl_common(ctx, args[1], 1, true)
}

/// EXPIRE family: `unit_ms` scales the number, `absolute` says it is a unix time.
pub(super) fn expire_common(
    ctx: &mut Ctx<'_>,
    args: &[&[u8]],
    unit_ms: i64,
    absolute: bool,
    name: &str,
) {
    let Some(n) = parse_i64(args[2]) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    let (mut nx, mut xx, mut gt, mut lt) = (false, false, false, false);
    for o in &args[3..] {
        if eq_ignore_case(o, "nx") {
            nx = true;
        } else if eq_ignore_case(o, "xx") {
            xx = true;
        } else if eq_ignore_case(o, "gt") {
            gt = true;
        } else if eq_ignore_case(o, "lt") {
            lt = true;
        } else {
            let o = String::from_utf8_lossy(o);
            return ctx.enc.error(&format!("ERR Unsupported option {o}"));
        }
    }
    if nx && (xx || gt || lt) {
        return ctx
            .enc
            .error("ERR NX and XX, GT or LT options at the same time are not compatible");
    }
    if gt && lt {
        return ctx
            .enc
            .error("ERR GT and LT options at the same time are not compatible");
    }
    let base = if absolute { 0 } else { now_ms() as i64 };
    let Some(at) = n.checked_mul(unit_ms).and_then(|ms| ms.checked_add(base)) else {
        return ctx
            .enc
            .error(&format!("ERR invalid expire time in '{name}' command"));
    };
    let key = args[1];
    let node = ctx.node;
    let tablet = node.tablet_of(key);
    for _ in 0..64 {
        let object = match node.get(tablet, key, &mut ctx.session.acks) {
            Ok(Some(o)) => o,
            Ok(None) => return ctx.enc.integer(0),
            Err(e) => return engine_error(ctx, &e),
        };
        // A key without expiry counts as an infinite TTL for GT and LT.
        let current = if object.expire_at_ms == 0 {
            None
        } else {
            Some(object.expire_at_ms as i64)
        };
        let allowed = (!nx || current.is_none())
            && (!xx || current.is_some())
            && (!gt || current.is_some_and(|c| at > c))
            && (!lt || current.is_none_or(|c| at < c));
        if !allowed {
            return ctx.enc.integer(0);
        }
        if at <= now_ms() as i64 {
            // An expiry in the past deletes the key.
            return match node.delete(
                tablet,
                key,
                Condition::IfVersion(object.version),
                &mut ctx.session.acks,
            ) {
                Ok(Some(_)) => ctx.enc.integer(1),
                Ok(None) | Err(NodeError::Engine(EngineError::ConditionFailed { .. })) => continue,
                Err(e) => engine_error(ctx, &e),
            };
        }
        return match node.set_expiry(tablet, key, at as u64, &mut ctx.session.acks) {
            Ok(Some(_)) => ctx.enc.integer(1),
            Ok(None) => ctx.enc.integer(0),
            Err(e) => engine_error(ctx, &e),
        };
    }
    ctx.enc
        .error("ERR too much contention on the key, try again")
}

pub(super) fn cmd_expire(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    expire_common(ctx, args, 1000, false, "expire")
}

pub(super) fn cmd_pexpire(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    expire_common(ctx, args, 1, false, "pexpire")
}

pub(super) fn cmd_expireat(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    expire_common(ctx, args, 1000, true, "expireat")
}

pub(super) fn cmd_pexpireat(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    expire_common(ctx, args, 1, true, "pexpireat")
}

pub(super) fn cmd_persist(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let key = args[1];
    let node = ctx.node;
    let tablet = node.tablet_of(key);
    match node.get(tablet, key, &mut ctx.session.acks) {
        Ok(Some(o)) if o.expire_at_ms != 0 => {
            match node.set_expiry(tablet, key, 0, &mut ctx.session.acks) {
                Ok(Some(_)) => ctx.enc.integer(1),
                Ok(None) => ctx.enc.integer(0),
                Err(e) => engine_error(ctx, &e),
            }
        }
        Ok(_) => ctx.enc.integer(0),
        Err(e) => engine_error(ctx, &e),
    }
}

pub(super) fn cmd_flushall(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if args.len() > 2
        || (args.len() == 2
            && !eq_ignore_case(args[1], "sync")
            && !eq_ignore_case(args[1], "async"))
    {
        return ctx.enc.error(ERR_SYNTAX);
    }
    let node = ctx.node;
    let mut keys = Vec::new();
    for &tablet in node.keyspace.tablets().iter() {
        // A mirror's copy follows its master; only the master's tablets are flushed here.
        if node.keyspace.is_hidden(tablet) {
            continue;
        }
        let mut cursor = 0;
        loop {
            keys.clear();
            let next = match node.engine().scan_keys(tablet, cursor, 1024, &mut keys) {
                Ok(n) => n,
                Err(e) => return engine_error(ctx, &e.into()),
            };
            for key in &keys {
                if let Err(e) = node.delete(tablet, key, Condition::None, &mut ctx.session.acks) {
                    return engine_error(ctx, &e);
                }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    ctx.enc.ok();
}
