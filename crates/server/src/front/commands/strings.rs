//! String commands (Redis's `t_string.c`): GET, SET and its options, SETNX/SETEX/PSETEX, GETSET,
//! GETDEL, GETEX, APPEND, MGET, MSET, INCR/DECR/INCRBY/DECRBY, STRLEN, GETRANGE.
//!
//! A string is stored as is unless it begins with the typed-value tag (escaped, see
//! `ramlog_proto::types`); the commands here store through [`Node::stored_string`], read through
//! `types::string_of`, and answer WRONGTYPE for a key that holds a collection.

use super::typed::{string_or_wrongtype, Replied, ERR_WRONGTYPE};
use super::*;
use ramlog_proto::types;

/// The string stored for a client's value, or the error answered.
fn stored<'v>(ctx: &mut Ctx<'_>, value: &'v [u8]) -> Result<std::borrow::Cow<'v, [u8]>, Replied> {
    ctx.node.stored_string(value).map_err(|e| {
        engine_error(ctx, &e);
        Replied
    })
}

/// How a string command writes its result: set whole (SET, INCRBYFLOAT) or changed in place
/// (APPEND, SETRANGE, SETBIT, BITFIELD: `raw` for OBJECT ENCODING, as in Redis).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Change {
    Whole,
    InPlace,
}

fn stored_as<'v>(
    ctx: &mut Ctx<'_>,
    value: &'v [u8],
    change: Change,
) -> Result<std::borrow::Cow<'v, [u8]>, Replied> {
    let made = match change {
        Change::Whole => ctx.node.stored_string(value),
        Change::InPlace => ctx.node.stored_string_in_place(value),
    };
    made.map_err(|e| {
        engine_error(ctx, &e);
        Replied
    })
}

/// Whether the key holds something other than a string (the error is answered if so).
fn holds_other_type(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<bool, Replied> {
    let node = ctx.node;
    match node.read_with(
        node.tablet_of(key),
        key,
        &mut ctx.session.acks,
        |v, _, _| types::string_of(v).is_none(),
    ) {
        Ok(Some(true)) => {
            ctx.enc.error(ERR_WRONGTYPE);
            Ok(true)
        }
        Ok(_) => Ok(false),
        Err(e) => {
            engine_error(ctx, &e);
            Err(Replied)
        }
    }
}

pub(super) fn cmd_get(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let key = args[1];
    let node = ctx.node;
    let metrics = &ctx.node.metrics;
    let enc = &mut ctx.enc;
    // Encode straight from the log: no copy of the value into a temporary.
    match node.read_with(
        node.tablet_of(key),
        key,
        &mut ctx.session.acks,
        |value, _, _| match types::string_of(value) {
            Some(s) => enc.bulk(s),
            None => enc.error(ERR_WRONGTYPE),
        },
    ) {
        Ok(Some(())) => {
            metrics.keyspace_hits.fetch_add(1, Ordering::Relaxed);
        }
        Ok(None) => {
            metrics.keyspace_misses.fetch_add(1, Ordering::Relaxed);
            enc.null();
        }
        Err(e) => engine_error(ctx, &e),
    }
}

/// Options of SET, parsed with Redis's conflict rules.
#[derive(Default)]
pub(super) struct SetArgs {
    pub(super) condition: Condition,
    pub(super) get: bool,
    pub(super) keep_ttl: bool,
    pub(super) expire_at_ms: u64,
}

pub(super) fn parse_set_options(options: &[&[u8]], command: &str) -> Result<SetArgs, String> {
    let mut out = SetArgs::default();
    let mut nx = false;
    let mut xx = false;
    let mut expire_seen = false;
    let mut i = 0;
    let syntax = || ERR_SYNTAX.to_string();
    while i < options.len() {
        let o = options[i];
        if eq_ignore_case(o, "nx") && !xx {
            nx = true;
        } else if eq_ignore_case(o, "xx") && !nx {
            xx = true;
        } else if eq_ignore_case(o, "get") {
            out.get = true;
        } else if eq_ignore_case(o, "keepttl") && !expire_seen {
            out.keep_ttl = true;
        } else if (eq_ignore_case(o, "ex")
            || eq_ignore_case(o, "px")
            || eq_ignore_case(o, "exat")
            || eq_ignore_case(o, "pxat"))
            && !expire_seen
            && !out.keep_ttl
            && i + 1 < options.len()
        {
            expire_seen = true;
            let n = parse_i64(options[i + 1]).ok_or_else(|| ERR_NOT_INTEGER.to_string())?;
            let invalid = || format!("ERR invalid expire time in '{command}' command");
            if n <= 0 {
                return Err(invalid());
            }
            let lower = o.to_ascii_lowercase();
            let at = match lower.as_slice() {
                b"ex" => n
                    .checked_mul(1000)
                    .and_then(|ms| ms.checked_add(now_ms() as i64)),
                b"px" => n.checked_add(now_ms() as i64),
                b"exat" => n.checked_mul(1000),
                _ => Some(n),
            };
            out.expire_at_ms = at.ok_or_else(invalid)? as u64;
            i += 1;
        } else {
            return Err(syntax());
        }
        i += 1;
    }
    out.condition = if nx {
        Condition::IfAbsent
    } else if xx {
        Condition::IfExists
    } else {
        Condition::None
    };
    Ok(out)
}

pub(super) fn cmd_set(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let set = match parse_set_options(&args[3..], "set") {
        Ok(s) => s,
        Err(message) => return ctx.enc.error(&message),
    };
    let opts = PutOptions {
        condition: set.condition,
        expire_at_ms: set.expire_at_ms,
        keep_ttl: set.keep_ttl,
        return_old: set.get,
    };
    let key = args[1];
    let Ok(value) = stored(ctx, args[2]) else {
        return;
    };
    // SET ... GET on a collection is refused before anything is written, as Redis does.
    if set.get && holds_other_type(ctx, key).unwrap_or(true) {
        return;
    }
    let node = ctx.node;
    let old_string = |o: &Option<Object>| -> Option<Vec<u8>> {
        o.as_ref()
            .and_then(|o| types::string_of(&o.value).map(<[u8]>::to_vec))
    };
    match node.put(
        node.tablet_of(key),
        key,
        &value,
        &opts,
        &mut ctx.session.acks,
    ) {
        Ok(outcome) => {
            if set.get {
                ctx.enc.bulk_or_null(old_string(&outcome.old).as_deref());
            } else {
                ctx.enc.ok();
            }
        }
        Err(NodeError::Engine(EngineError::ConditionFailed { current })) => {
            if set.get {
                ctx.enc.bulk_or_null(old_string(&current).as_deref());
            } else {
                ctx.enc.null();
            }
        }
        Err(e) => engine_error(ctx, &e),
    }
}

pub(super) fn set_with(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    value: &[u8],
    opts: PutOptions,
) -> Result<bool, NodeError> {
    let node = ctx.node;
    let value = node.stored_string(value)?;
    match node.put(
        node.tablet_of(key),
        key,
        &value,
        &opts,
        &mut ctx.session.acks,
    ) {
        Ok(_) => Ok(true),
        Err(NodeError::Engine(EngineError::ConditionFailed { .. })) => Ok(false),
        Err(e) => Err(e),
    }
}

pub(super) fn cmd_setnx(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let opts = PutOptions {
        condition: Condition::IfAbsent,
        ..Default::default()
    };
    match set_with(ctx, args[1], args[2], opts) {
        Ok(done) => ctx.enc.integer(i64::from(done)),
        Err(e) => engine_error(ctx, &e),
    }
}

pub(super) fn setex_common(ctx: &mut Ctx<'_>, args: &[&[u8]], unit_ms: i64, name: &str) {
    let Some(n) = parse_i64(args[2]) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    let at = if n <= 0 {
        None
    } else {
        n.checked_mul(unit_ms)
            .and_then(|ms| ms.checked_add(now_ms() as i64))
    };
    let Some(at) = at else {
        return ctx
            .enc
            .error(&format!("ERR invalid expire time in '{name}' command"));
    };
    match set_with(
        ctx,
        args[1],
        args[3],
        PutOptions {
            expire_at_ms: at as u64,
            ..Default::default()
        },
    ) {
        Ok(_) => ctx.enc.ok(),
        Err(e) => engine_error(ctx, &e),
    }
}

pub(super) fn cmd_setex(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    setex_common(ctx, args, 1000, "setex")
}

pub(super) fn cmd_psetex(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    setex_common(ctx, args, 1, "psetex")
}

pub(super) fn cmd_getset(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let node = ctx.node;
    let opts = PutOptions {
        return_old: true,
        ..Default::default()
    };
    let Ok(value) = stored(ctx, args[2]) else {
        return;
    };
    if holds_other_type(ctx, args[1]).unwrap_or(true) {
        return;
    }
    match node.put(
        node.tablet_of(args[1]),
        args[1],
        &value,
        &opts,
        &mut ctx.session.acks,
    ) {
        Ok(outcome) => ctx.enc.bulk_or_null(
            outcome
                .old
                .as_ref()
                .and_then(|o| types::string_of(&o.value)),
        ),
        Err(e) => engine_error(ctx, &e),
    }
}

pub(super) fn cmd_getdel(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let key = args[1];
    let node = ctx.node;
    let tablet = node.tablet_of(key);
    // Read, then delete only that version: a concurrent writer makes us retry.
    for _ in 0..64 {
        let found = match node.get(tablet, key, &mut ctx.session.acks) {
            Ok(f) => f,
            Err(e) => return engine_error(ctx, &e),
        };
        let Some(object) = found else {
            return ctx.enc.null();
        };
        let Ok(value) = string_or_wrongtype(ctx, &object.value) else {
            return;
        };
        let value = value.to_vec();
        match node.delete(
            tablet,
            key,
            Condition::IfVersion(object.version),
            &mut ctx.session.acks,
        ) {
            Ok(Some(_)) => {
                return ctx.enc.bulk(&value);
            }
            Ok(None) | Err(NodeError::Engine(EngineError::ConditionFailed { .. })) => continue,
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc
        .error("ERR too much contention on the key, try again")
}

pub(super) fn cmd_append(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (key, suffix) = (args[1], args[2]);
    let node = ctx.node;
    let tablet = node.tablet_of(key);
    let _serialized = node.rmw_lock(key);
    for _ in 0..64 {
        let found = match node.get(tablet, key, &mut ctx.session.acks) {
            Ok(f) => f,
            Err(e) => return engine_error(ctx, &e),
        };
        let (mut value, condition) = match found {
            Some(o) => match string_or_wrongtype(ctx, &o.value) {
                Ok(s) => (s.to_vec(), Condition::IfVersion(o.version)),
                Err(Replied) => return,
            },
            None => (Vec::new(), Condition::IfAbsent),
        };
        value.extend_from_slice(suffix);
        let opts = PutOptions {
            condition,
            keep_ttl: true,
            ..Default::default()
        };
        // APPEND to no key stores its argument as SET would (Redis encodes it afresh).
        let change = match condition {
            Condition::IfAbsent => Change::Whole,
            _ => Change::InPlace,
        };
        let Ok(bytes) = stored_as(ctx, &value, change) else {
            return;
        };
        match node.put(tablet, key, &bytes, &opts, &mut ctx.session.acks) {
            Ok(_) => {
                return ctx.enc.integer(value.len() as i64);
            }
            Err(NodeError::Engine(EngineError::ConditionFailed { .. })) => continue,
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc
        .error("ERR too much contention on the key, try again")
}

pub(super) fn cmd_mget(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let keys = &args[1..];
    let mut values = Vec::with_capacity(keys.len());
    for key in keys {
        match read(ctx, key) {
            Ok(found) => values.push(found),
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc.array(values.len());
    // A key holding a collection reads as nil, as in Redis.
    for v in &values {
        ctx.enc
            .bulk_or_null(v.as_ref().and_then(|o| types::string_of(&o.value)));
    }
}

/// Checks MSET/MSETNX's arguments: Err(reply) for a wrong count or an oversized key or value
/// (refused before anything is written, so that neither is ever half applied for that reason).
fn mset_check(ctx: &mut Ctx<'_>, args: &[&[u8]], name: &str) -> bool {
    if args.len().is_multiple_of(2) {
        ctx.enc.error(&format!(
            "ERR wrong number of arguments for '{name}' command"
        ));
        return false;
    }
    let config = &ctx.node.config;
    for pair in args[1..].chunks_exact(2) {
        let e = if pair[0].len() as u64 > config.key_size_max_bytes {
            EngineError::KeyTooLarge {
                len: pair[0].len(),
                max: config.key_size_max_bytes as usize,
            }
        } else if pair[1].len() as u64 > config.value_size_max_bytes {
            EngineError::ValueTooLarge {
                len: pair[1].len(),
                max: config.value_size_max_bytes as usize,
            }
        } else {
            continue;
        };
        engine_error(ctx, &NodeError::Engine(e));
        return false;
    }
    true
}

type Items<'a> = Vec<(&'a [u8], &'a [u8])>;

/// MSET's pairs grouped by tablet, values as stored. Redis keeps the last of repeated keys; so
/// does a multi-put applied in order.
fn mset_groups<'a>(
    node: &Node,
    args: &'a [&'a [u8]],
    values: &'a [std::borrow::Cow<'a, [u8]>],
) -> Vec<(u32, Items<'a>)> {
    let mut groups: Vec<(u32, Items<'a>)> = Vec::new();
    for (pair, value) in args[1..].chunks_exact(2).zip(values) {
        let tablet = node.tablet_of(pair[0]);
        match groups.iter_mut().find(|g| g.0 == tablet) {
            Some(g) => g.1.push((pair[0], value)),
            None => groups.push((tablet, vec![(pair[0], value)])),
        }
    }
    groups
}

fn stored_values<'a>(args: &'a [&'a [u8]]) -> Vec<std::borrow::Cow<'a, [u8]>> {
    args[2..]
        .iter()
        .step_by(2)
        .map(|v| types::store_string(v))
        .collect()
}

pub(super) fn cmd_mset(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if !mset_check(ctx, args, "mset") {
        return;
    }
    let node = ctx.node;
    let values = stored_values(args);
    // Each group is one atomic multi-put.
    for (tablet, items) in &mset_groups(node, args, &values) {
        if let Err(e) = node.multi_put(*tablet, items, &mut ctx.session.acks) {
            return engine_error(ctx, &e);
        }
    }
    ctx.enc.ok();
}

/// MSETNX: sets every pair if none of the keys exists (1), else nothing (0). Keys of one tablet
/// (always so in a cluster, where they share a slot) are checked and written as one atomic
/// conditional multi-put. Across tablets of a standalone server, the keys' read-modify-write
/// locks are held throughout, and a group refused because a plain SET raced in takes back the
/// groups already written.
pub(super) fn cmd_msetnx(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if !mset_check(ctx, args, "msetnx") {
        return;
    }
    let node = ctx.node;
    let keys: Vec<&[u8]> = args[1..].iter().step_by(2).copied().collect();
    let _locks = node.rmw_locks(&keys);
    let values = stored_values(args);
    let groups = mset_groups(node, args, &values);
    let mut written: Vec<(u32, u64, &Items<'_>)> = Vec::new();
    for (tablet, items) in &groups {
        let conditions = vec![Condition::IfAbsent; items.len()];
        // A key given twice is absent for its first copy only: check each key once.
        let mut seen = std::collections::HashSet::new();
        let conditions: Vec<Condition> = items
            .iter()
            .zip(conditions)
            .map(|((k, _), c)| if seen.insert(*k) { c } else { Condition::None })
            .collect();
        match node.multi_put_if(*tablet, items, &conditions, &mut ctx.session.acks) {
            Ok(version) => written.push((*tablet, version, items)),
            Err(NodeError::Engine(EngineError::ConditionFailed { .. })) => {
                for (tablet, version, items) in written {
                    for (k, _) in items.iter() {
                        // Only what this MSETNX wrote (a later writer's value stays).
                        let _ = node.delete(
                            tablet,
                            k,
                            Condition::IfVersion(version),
                            &mut ctx.session.acks,
                        );
                    }
                }
                return ctx.enc.integer(0);
            }
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc.integer(1);
}

pub(super) fn incr_by(ctx: &mut Ctx<'_>, key: &[u8], delta: i64) {
    let node = ctx.node;
    match node.increment(node.tablet_of(key), key, delta, &mut ctx.session.acks) {
        Ok((value, _)) => ctx.enc.integer(value),
        // A collection is not an integer to the engine: Redis answers WRONGTYPE.
        Err(e @ NodeError::Engine(EngineError::NotAnInteger)) => {
            if !holds_other_type(ctx, key).unwrap_or(true) {
                engine_error(ctx, &e)
            }
        }
        Err(e) => engine_error(ctx, &e),
    }
}

pub(super) fn cmd_incr(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    incr_by(ctx, args[1], 1)
}

pub(super) fn cmd_decr(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    incr_by(ctx, args[1], -1)
}

pub(super) fn cmd_incrby(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match parse_i64(args[2]) {
        Some(d) => incr_by(ctx, args[1], d),
        None => ctx.enc.error(ERR_NOT_INTEGER),
    }
}

pub(super) fn cmd_decrby(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match parse_i64(args[2]) {
        Some(i64::MIN) => ctx.enc.error("ERR decrement would overflow"),
        Some(d) => incr_by(ctx, args[1], -d),
        None => ctx.enc.error(ERR_NOT_INTEGER),
    }
}

pub(super) fn cmd_strlen(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match read(ctx, args[1]) {
        Ok(Some(o)) => {
            if let Ok(s) = string_or_wrongtype(ctx, &o.value) {
                ctx.enc.integer(s.len() as i64)
            }
        }
        Ok(None) => ctx.enc.integer(0),
        Err(e) => engine_error(ctx, &e),
    }
}

/// GETRANGE key start end, with Redis's index rules (negative counts from the end, clamped).
pub(super) fn cmd_getrange(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (Some(mut start), Some(mut end)) = (parse_i64(args[2]), parse_i64(args[3])) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    let found = match read(ctx, args[1]) {
        Ok(found) => found.map(|o| o.value).unwrap_or_default(),
        Err(e) => return engine_error(ctx, &e),
    };
    let Ok(value) = string_or_wrongtype(ctx, &found) else {
        return;
    };
    let len = value.len() as i64;
    if start < 0 && end < 0 && start > end {
        return ctx.enc.bulk(b"");
    }
    if start < 0 {
        start += len;
    }
    if end < 0 {
        end += len;
    }
    start = start.max(0);
    end = end.max(0);
    if end >= len {
        end = len - 1;
    }
    if len == 0 || start > end {
        return ctx.enc.bulk(b"");
    }
    ctx.enc.bulk(&value[start as usize..=end as usize]);
}

/// GETEX key [EX s | PX ms | EXAT s | PXAT ms | PERSIST]: the value, and a new expiry.
pub(super) fn cmd_getex(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    // None = leave the expiry alone; Some(0) = remove it.
    let mut expire_at: Option<u64> = None;
    let mut i = 2;
    while i < args.len() {
        let o = args[i];
        if eq_ignore_case(o, "persist") && expire_at.is_none() {
            expire_at = Some(0);
            i += 1;
            continue;
        }
        let unit = if eq_ignore_case(o, "ex") || eq_ignore_case(o, "exat") {
            1000
        } else if eq_ignore_case(o, "px") || eq_ignore_case(o, "pxat") {
            1
        } else {
            return ctx.enc.error(ERR_SYNTAX);
        };
        if expire_at.is_some() || i + 1 >= args.len() {
            return ctx.enc.error(ERR_SYNTAX);
        }
        let Some(n) = parse_i64(args[i + 1]) else {
            return ctx.enc.error(ERR_NOT_INTEGER);
        };
        let absolute = o.len() == 4;
        let base = if absolute { 0 } else { now_ms() as i64 };
        match n.checked_mul(unit).and_then(|ms| ms.checked_add(base)) {
            Some(at) if n > 0 => expire_at = Some(at as u64),
            _ => return ctx.enc.error("ERR invalid expire time in 'getex' command"),
        }
        i += 2;
    }
    let key = args[1];
    let found = match read(ctx, key) {
        Ok(f) => f,
        Err(e) => return engine_error(ctx, &e),
    };
    let Some(object) = found else {
        return ctx.enc.null();
    };
    if string_or_wrongtype(ctx, &object.value).is_err() {
        return;
    }
    if let Some(at) = expire_at {
        let node = ctx.node;
        let tablet = node.tablet_of(key);
        let result = if at != 0 && at <= now_ms() {
            node.delete(
                tablet,
                key,
                Condition::IfVersion(object.version),
                &mut ctx.session.acks,
            )
        } else if at == 0 && object.expire_at_ms == 0 {
            Ok(None) // PERSIST on a key without expiry: nothing to write
        } else {
            node.set_expiry(tablet, key, at, &mut ctx.session.acks)
        };
        match result {
            Ok(Some(_)) => {}
            Ok(None) | Err(NodeError::Engine(EngineError::ConditionFailed { .. })) => {}
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc
        .bulk(types::string_of(&object.value).unwrap_or_default());
}

/// Reads the key's string, lets `f` compute its result and the new string (None: no write),
/// and writes that on the condition that the key did not change since it was read (keeping its
/// expiry); a concurrent write makes it start again.
pub(super) fn update_string<R>(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    change: Change,
    mut f: impl FnMut(Option<&[u8]>) -> Result<(R, Option<Vec<u8>>), String>,
) -> Result<R, Replied> {
    let node = ctx.node;
    let tablet = node.tablet_of(key);
    let _serialized = node.rmw_lock(key);
    for _ in 0..64 {
        let found = node.get(tablet, key, &mut ctx.session.acks).map_err(|e| {
            engine_error(ctx, &e);
            Replied
        })?;
        let (current, condition) = match &found {
            Some(o) => (
                Some(string_or_wrongtype(ctx, &o.value)?),
                Condition::IfVersion(o.version),
            ),
            None => (None, Condition::IfAbsent),
        };
        let (result, new) = f(current).map_err(|m| {
            ctx.enc.error(&m);
            Replied
        })?;
        let Some(new) = new else {
            return Ok(result);
        };
        let bytes = stored_as(ctx, &new, change)?;
        let opts = PutOptions {
            condition,
            keep_ttl: true,
            ..Default::default()
        };
        match node.put(tablet, key, &bytes, &opts, &mut ctx.session.acks) {
            Ok(_) => return Ok(result),
            Err(NodeError::Engine(EngineError::ConditionFailed { .. })) => continue,
            Err(e) => {
                engine_error(ctx, &e);
                return Err(Replied);
            }
        }
    }
    ctx.enc
        .error("ERR too much contention on the key, try again");
    Err(Replied)
}

/// INCRBYFLOAT key increment
pub(super) fn cmd_incrbyfloat(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    // As Redis: the key's type is checked before the increment is parsed.
    let delta = super::typed::parse_f64(args[2]);
    if let Ok(text) = update_string(ctx, args[1], Change::Whole, |current| {
        let delta = delta.ok_or("ERR value is not a valid float")?;
        let base = match current {
            Some(v) => super::typed::parse_f64(v).ok_or("ERR value is not a valid float")?,
            None => 0.0,
        };
        let next = base + delta;
        if !next.is_finite() {
            return Err("ERR increment would produce NaN or Infinity".into());
        }
        let text = super::typed::float_text(next);
        Ok((text.clone(), Some(text.into_bytes())))
    }) {
        ctx.enc.bulk(text.as_bytes())
    }
}

/// SETRANGE key offset value: zero-padded as needed; the new length.
pub(super) fn cmd_setrange(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let offset = match parse_i64(args[2]) {
        Some(o) if o >= 0 => o as u64,
        Some(_) => return ctx.enc.error("ERR offset is out of range"),
        None => return ctx.enc.error(ERR_NOT_INTEGER),
    };
    let value = args[3];
    let max = ctx.node.config.value_size_max_bytes;
    if value.is_empty() {
        // Nothing to write: the length as it is (0 if absent).
        return match read(ctx, args[1]) {
            Ok(Some(o)) => {
                if let Ok(s) = string_or_wrongtype(ctx, &o.value) {
                    ctx.enc.integer(s.len() as i64)
                }
            }
            Ok(None) => ctx.enc.integer(0),
            Err(e) => engine_error(ctx, &e),
        };
    }
    if offset + value.len() as u64 > max {
        return ctx.enc.error(&format!(
            "ERR string exceeds maximum allowed size (the value size limit, {max} bytes)"
        ));
    }
    let offset = offset as usize;
    if let Ok(len) = update_string(ctx, args[1], Change::InPlace, |current| {
        let mut s = current.map(<[u8]>::to_vec).unwrap_or_default();
        if s.len() < offset + value.len() {
            s.resize(offset + value.len(), 0);
        }
        s[offset..offset + value.len()].copy_from_slice(value);
        Ok((s.len() as i64, Some(s)))
    }) {
        ctx.enc.integer(len)
    }
}

fn bit_offset(ctx: &mut Ctx<'_>, arg: &[u8]) -> Option<u64> {
    let max_bits = ctx.node.config.value_size_max_bytes * 8;
    match parse_i64(arg) {
        Some(o) if o >= 0 && (o as u64) < max_bits => Some(o as u64),
        _ => {
            ctx.enc
                .error("ERR bit offset is not an integer or out of range");
            None
        }
    }
}

/// GETBIT key offset
pub(super) fn cmd_getbit(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Some(bit) = bit_offset(ctx, args[2]) else {
        return;
    };
    let found = match read(ctx, args[1]) {
        Ok(f) => f,
        Err(e) => return engine_error(ctx, &e),
    };
    let Some(o) = found else {
        return ctx.enc.integer(0);
    };
    let Ok(s) = string_or_wrongtype(ctx, &o.value) else {
        return;
    };
    let byte = s.get((bit / 8) as usize).copied().unwrap_or(0);
    ctx.enc.integer(i64::from((byte >> (7 - (bit % 8))) & 1))
}

/// SETBIT key offset 0|1: the bit's previous value.
pub(super) fn cmd_setbit(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Some(bit) = bit_offset(ctx, args[2]) else {
        return;
    };
    let on = match args[3] {
        b"0" => false,
        b"1" => true,
        _ => return ctx.enc.error("ERR bit is not an integer or out of range"),
    };
    let (index, mask) = ((bit / 8) as usize, 1u8 << (7 - (bit % 8)));
    if let Ok(old) = update_string(ctx, args[1], Change::InPlace, |current| {
        let mut s = current.map(<[u8]>::to_vec).unwrap_or_default();
        if s.len() <= index {
            s.resize(index + 1, 0);
        }
        let old = s[index] & mask != 0;
        if on {
            s[index] |= mask;
        } else {
            s[index] &= !mask;
        }
        let changed = current.is_none_or(|c| c.len() != s.len() || old != on);
        Ok((old, changed.then_some(s)))
    }) {
        ctx.enc.integer(i64::from(old))
    }
}

/// BITCOUNT key [start end [BYTE|BIT]]
pub(super) fn cmd_bitcount(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let range = match args.len() {
        2 => None,
        4 | 5 => {
            let (Some(a), Some(b)) = (parse_i64(args[2]), parse_i64(args[3])) else {
                return ctx.enc.error(ERR_NOT_INTEGER);
            };
            let bits = match args.get(4) {
                None => false,
                Some(u) if eq_ignore_case(u, "byte") => false,
                Some(u) if eq_ignore_case(u, "bit") => true,
                Some(_) => return ctx.enc.error(ERR_SYNTAX),
            };
            Some((a, b, bits))
        }
        _ => return ctx.enc.error(ERR_SYNTAX),
    };
    let found = match read(ctx, args[1]) {
        Ok(f) => f,
        Err(e) => return engine_error(ctx, &e),
    };
    let Some(o) = found else {
        return ctx.enc.integer(0);
    };
    let Ok(s) = string_or_wrongtype(ctx, &o.value) else {
        return;
    };
    let count = match range {
        None => s.iter().map(|b| b.count_ones() as i64).sum(),
        Some((a, b, false)) => match super::typed::index_range(a, b, s.len()) {
            None => 0,
            Some((x, y)) => s[x..=y].iter().map(|b| b.count_ones() as i64).sum(),
        },
        Some((a, b, true)) => match super::typed::index_range(a, b, s.len() * 8) {
            None => 0,
            Some((x, y)) => (x..=y)
                .filter(|&i| s[i / 8] & (1 << (7 - i % 8)) != 0)
                .count() as i64,
        },
    };
    ctx.enc.integer(count)
}

/// Most bytes of LCS's table (4 bytes per pair of positions) a command may take; more answers an
/// error, as Redis refuses a table past its own bound (its proto-max-bulk-len).
const LCS_TABLE_BYTES_MAX: u64 = 256 << 20;

/// One match of LCS's IDX reply: the ranges (first and last index) in each string, and length.
#[derive(Debug, PartialEq)]
struct LcsMatch {
    a: (usize, usize),
    b: (usize, usize),
    len: usize,
}

/// The longest common subsequence of `a` and `b` and its matches (contiguous runs, found from
/// the strings' ends, those shorter than `min_match_len` left out), by Redis's dynamic program
/// and its walk back; `walk`: false for the length alone (then both are empty).
fn lcs(a: &[u8], b: &[u8], min_match_len: u64, walk: bool) -> (usize, Vec<u8>, Vec<LcsMatch>) {
    let (alen, blen) = (a.len(), b.len());
    let width = blen + 1;
    let mut dp = vec![0u32; (alen + 1) * width];
    for i in 1..=alen {
        for j in 1..=blen {
            dp[i * width + j] = if a[i - 1] == b[j - 1] {
                dp[(i - 1) * width + j - 1] + 1
            } else {
                dp[(i - 1) * width + j].max(dp[i * width + j - 1])
            };
        }
    }
    let total = dp[alen * width + blen] as usize;
    if !walk {
        return (total, Vec::new(), Vec::new());
    }
    let mut result = vec![0u8; total];
    let mut matches = Vec::new();
    // The current run, from its first index in each string to its last (None: no run).
    let mut run: Option<(usize, usize, usize, usize)> = None;
    let (mut i, mut j, mut idx) = (alen, blen, total);
    while i > 0 && j > 0 {
        let mut emit = false;
        if a[i - 1] == b[j - 1] {
            result[idx - 1] = a[i - 1];
            run = match run {
                None => Some((i - 1, i - 1, j - 1, j - 1)),
                // The run goes on backwards while the match is next to its start in both.
                Some((a0, a1, b0, b1)) if a0 == i && b0 == j => Some((a0 - 1, a1, b0 - 1, b1)),
                other => {
                    emit = true;
                    other
                }
            };
            // A match at the start of either string ends the walk: emit its run.
            if matches!(run, Some((a0, _, b0, _)) if a0 == 0 || b0 == 0) {
                emit = true;
            }
            idx -= 1;
            i -= 1;
            j -= 1;
        } else {
            if dp[(i - 1) * width + j] > dp[i * width + j - 1] {
                i -= 1;
            } else {
                j -= 1;
            }
            emit = run.is_some();
        }
        if emit {
            if let Some((a0, a1, b0, b1)) = run.take() {
                let len = a1 - a0 + 1;
                if len as u64 >= min_match_len {
                    matches.push(LcsMatch {
                        a: (a0, a1),
                        b: (b0, b1),
                        len,
                    });
                }
            }
        }
    }
    (total, result, matches)
}

/// LCS key1 key2 [LEN] [IDX] [MINMATCHLEN len] [WITHMATCHLEN]: the longest common subsequence of
/// two strings (absent keys are empty). As in Redis, the keys' types are checked before the
/// options are read, and a key of another type answers its own error, not WRONGTYPE.
pub(super) fn cmd_lcs(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let mut strings = Vec::with_capacity(2);
    for key in &args[1..3] {
        match read(ctx, key) {
            Ok(Some(o)) => strings.push(o.value),
            Ok(None) => strings.push(Vec::new()),
            Err(e) => return engine_error(ctx, &e),
        }
    }
    let (Some(a), Some(b)) = (types::string_of(&strings[0]), types::string_of(&strings[1])) else {
        return ctx
            .enc
            .error("ERR The specified keys must contain string values");
    };
    let (mut get_len, mut get_idx, mut with_match_len, mut min_match_len) =
        (false, false, false, 0u64);
    let mut i = 3;
    while i < args.len() {
        if eq_ignore_case(args[i], "idx") {
            get_idx = true;
        } else if eq_ignore_case(args[i], "len") {
            get_len = true;
        } else if eq_ignore_case(args[i], "withmatchlen") {
            with_match_len = true;
        } else if eq_ignore_case(args[i], "minmatchlen") && i + 1 < args.len() {
            match parse_i64(args[i + 1]) {
                Some(n) => min_match_len = n.max(0) as u64,
                None => return ctx.enc.error(ERR_NOT_INTEGER),
            }
            i += 1;
        } else {
            return ctx.enc.error(ERR_SYNTAX);
        }
        i += 1;
    }
    if get_len && get_idx {
        return ctx
            .enc
            .error("ERR If you want both the length and indexes, please just use IDX.");
    }
    if (a.len() as u64 + 1) * (b.len() as u64 + 1) * 4 > LCS_TABLE_BYTES_MAX {
        return ctx.enc.error(&format!(
            "ERR Insufficient memory, transient memory for LCS exceeds {LCS_TABLE_BYTES_MAX} bytes"
        ));
    }
    let (total, result, matches) = lcs(a, b, min_match_len, !get_len);
    if get_len {
        return ctx.enc.integer(total as i64);
    }
    if !get_idx {
        return ctx.enc.bulk(&result);
    }
    ctx.enc.map(2);
    ctx.enc.bulk(b"matches");
    ctx.enc.array(matches.len());
    for m in &matches {
        ctx.enc.array(if with_match_len { 3 } else { 2 });
        for (first, last) in [m.a, m.b] {
            ctx.enc.array(2);
            ctx.enc.integer(first as i64);
            ctx.enc.integer(last as i64);
        }
        if with_match_len {
            ctx.enc.integer(m.len as i64);
        }
    }
    ctx.enc.bulk(b"len");
    ctx.enc.integer(total as i64);
}

#[derive(Clone, Copy, PartialEq)]
enum BitOp {
    And,
    Or,
    Xor,
    Not,
}

/// BITOP's result over `sources` (absent keys are empty strings): as long as the longest, the
/// shorter ones read as padded with zero bytes.
fn bitop(op: BitOp, sources: &[&[u8]]) -> Vec<u8> {
    let len = sources.iter().map(|s| s.len()).max().unwrap_or(0);
    let byte = |s: &[u8], j: usize| s.get(j).copied().unwrap_or(0);
    let Some((first, rest)) = sources.split_first() else {
        return Vec::new();
    };
    (0..len)
        .map(|j| {
            let start = byte(first, j);
            match op {
                BitOp::Not => !start,
                BitOp::And => rest.iter().fold(start, |acc, s| acc & byte(s, j)),
                BitOp::Or => rest.iter().fold(start, |acc, s| acc | byte(s, j)),
                BitOp::Xor => rest.iter().fold(start, |acc, s| acc ^ byte(s, j)),
            }
        })
        .collect()
}

/// BITOP AND|OR|XOR|NOT destkey key [key ...]: the result's length. The destination is
/// replaced as by the *STORE commands (whatever it held, no expiry), or deleted when the result
/// is empty.
pub(super) fn cmd_bitop(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let op = if eq_ignore_case(args[1], "and") {
        BitOp::And
    } else if eq_ignore_case(args[1], "or") {
        BitOp::Or
    } else if eq_ignore_case(args[1], "xor") {
        BitOp::Xor
    } else if eq_ignore_case(args[1], "not") {
        BitOp::Not
    } else {
        return ctx.enc.error(ERR_SYNTAX);
    };
    if op == BitOp::Not && args.len() != 4 {
        return ctx
            .enc
            .error("ERR BITOP NOT must be called with a single source key.");
    }
    let mut found = Vec::with_capacity(args.len() - 3);
    for key in &args[3..] {
        match read(ctx, key) {
            Ok(Some(o)) => {
                if string_or_wrongtype(ctx, &o.value).is_err() {
                    return;
                }
                found.push(o.value);
            }
            Ok(None) => found.push(Vec::new()),
            Err(e) => return engine_error(ctx, &e),
        }
    }
    let sources: Vec<&[u8]> = found
        .iter()
        .map(|v| types::string_of(v).unwrap_or_default())
        .collect();
    let result = bitop(op, &sources);
    drop(found);
    let (node, dest) = (ctx.node, args[2]);
    let tablet = node.tablet_of(dest);
    let done = if result.is_empty() {
        node.delete(tablet, dest, Condition::None, &mut ctx.session.acks)
            .map(|_| ())
    } else {
        let Ok(value) = stored(ctx, &result) else {
            return;
        };
        node.put(
            tablet,
            dest,
            &value,
            &PutOptions::default(),
            &mut ctx.session.acks,
        )
        .map(|_| ())
    };
    match done {
        Ok(()) => ctx.enc.integer(result.len() as i64),
        Err(e) => engine_error(ctx, &e),
    }
}

/// The first bit equal to `bit` among bits `lo..=hi` of `s` (bit 0 is the first byte's most
/// significant bit).
fn first_bit(s: &[u8], lo: usize, hi: usize, bit: bool) -> Option<usize> {
    let (first, last) = (lo / 8, hi / 8);
    // The bits of a byte that are in the range and equal to `bit`.
    let hits = |i: usize| {
        let mut mask = 0xffu8;
        if i == first {
            mask &= 0xff >> (lo % 8);
        }
        if i == last {
            mask &= 0xff << (7 - hi % 8);
        }
        (if bit { s[i] } else { !s[i] }) & mask
    };
    if hits(first) != 0 {
        return Some(first * 8 + hits(first).leading_zeros() as usize);
    }
    if first == last {
        return None;
    }
    let miss = if bit { 0x00 } else { 0xff };
    let i = s[first + 1..last]
        .iter()
        .position(|&b| b != miss)
        .map_or(last, |p| first + 1 + p);
    let h = hits(i);
    (h != 0).then(|| i * 8 + h.leading_zeros() as usize)
}

/// BITPOS key bit [start [end [BYTE|BIT]]]: the first bit set (1) or clear (0) in the range, with
/// Redis's rules: an absent key is all zeros (0 for a clear bit, -1 for a set one); without an
/// end, a string of ones has its first clear bit just past its end; with one, -1.
pub(super) fn cmd_bitpos(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let bit = match parse_i64(args[2]) {
        Some(b @ (0 | 1)) => b == 1,
        Some(_) => return ctx.enc.error("ERR The bit argument must be 1 or 0."),
        None => return ctx.enc.error(ERR_NOT_INTEGER),
    };
    let found = match read(ctx, args[1]) {
        Ok(f) => f,
        Err(e) => return engine_error(ctx, &e),
    };
    let Some(o) = found else {
        return ctx.enc.integer(if bit { -1 } else { 0 });
    };
    let Ok(s) = string_or_wrongtype(ctx, &o.value) else {
        return;
    };
    let len = s.len() as i64;
    // The range in bits, first and last; whether an end was given.
    let (lo, hi, end_given) = match args.len() {
        3 => (0, len * 8 - 1, false),
        4..=6 => {
            let Some(mut start) = parse_i64(args[3]) else {
                return ctx.enc.error(ERR_NOT_INTEGER);
            };
            let in_bits = match args.get(5) {
                None => false,
                Some(u) if eq_ignore_case(u, "bit") => true,
                Some(u) if eq_ignore_case(u, "byte") => false,
                Some(_) => return ctx.enc.error(ERR_SYNTAX),
            };
            let total = if in_bits { len * 8 } else { len };
            let mut end = match args.get(4) {
                Some(e) => match parse_i64(e) {
                    Some(e) => e,
                    None => return ctx.enc.error(ERR_NOT_INTEGER),
                },
                None => total - 1,
            };
            // Redis's clamping: negative counts from the end, then at least 0 (the end too).
            if start < 0 {
                start += total;
            }
            if end < 0 {
                end += total;
            }
            start = start.max(0);
            end = end.max(0).min(total - 1);
            if start > end {
                return ctx.enc.integer(-1);
            }
            if in_bits {
                (start, end, args.len() >= 5)
            } else {
                (start * 8, end * 8 + 7, args.len() >= 5)
            }
        }
        _ => return ctx.enc.error(ERR_SYNTAX),
    };
    if lo > hi {
        return ctx.enc.integer(-1);
    }
    let pos = match first_bit(s, lo as usize, hi as usize, bit) {
        Some(p) => p as i64,
        // Past the end, the string reads as zeros, unless the range has an end.
        None if !bit && !end_given => (hi / 8 + 1) * 8,
        None => -1,
    };
    ctx.enc.integer(pos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lcs_matches_redis_examples() {
        let (total, s, m) = lcs(b"ohmytext", b"mynewtext", 0, true);
        assert_eq!((total, s.as_slice()), (6, &b"mytext"[..]));
        assert_eq!(
            m,
            vec![
                LcsMatch {
                    a: (4, 7),
                    b: (5, 8),
                    len: 4
                },
                LcsMatch {
                    a: (2, 3),
                    b: (0, 1),
                    len: 2
                },
            ]
        );
        assert_eq!(lcs(b"ohmytext", b"mynewtext", 4, true).2.len(), 1);
        assert_eq!(lcs(b"", b"abc", 0, true), (0, Vec::new(), Vec::new()));
        assert_eq!(lcs(b"abc", b"abc", 0, false).0, 3);
    }

    #[test]
    fn bitop_pads_shorter_strings_with_zeros() {
        let (a, b) = (&b"\xff\x0f"[..], &b"\xf0"[..]);
        assert_eq!(bitop(BitOp::And, &[a, b]), b"\xf0\x00");
        assert_eq!(bitop(BitOp::Or, &[a, b]), b"\xff\x0f");
        assert_eq!(bitop(BitOp::Xor, &[a, b]), b"\x0f\x0f");
        assert_eq!(bitop(BitOp::Not, &[b]), b"\x0f");
        assert_eq!(bitop(BitOp::And, &[b"", b""]), b"");
    }

    #[test]
    fn first_bit_respects_the_range() {
        let s = b"\x00\xff\xf0";
        assert_eq!(first_bit(s, 0, 23, true), Some(8));
        assert_eq!(first_bit(s, 0, 23, false), Some(0));
        assert_eq!(first_bit(s, 8, 15, false), None);
        assert_eq!(first_bit(s, 9, 22, false), Some(20));
        assert_eq!(first_bit(s, 17, 19, false), None);
        assert_eq!(first_bit(s, 3, 7, true), None);
        assert_eq!(first_bit(b"\x01", 7, 7, true), Some(7));
    }
}
