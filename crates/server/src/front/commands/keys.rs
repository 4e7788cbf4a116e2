//! Keyspace and expiry commands (Redis's `db.c` and `expire.c`): DEL/UNLINK, EXISTS, TYPE, SCAN,
//! KEYS, DBSIZE, TTL/PTTL/EXPIRETIME/PEXPIRETIME, EXPIRE/PEXPIRE/EXPIREAT/PEXPIREAT, PERSIST, FLUSHALL.

use super::large_list;
use super::typed::Replied;
use super::*;

pub(super) fn cmd_del(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let node = ctx.node;
    let mut deleted = 0;
    for key in &args[1..] {
        match large_list::delete_if_large(ctx, key) {
            Ok(true) => {
                deleted += 1;
                continue;
            }
            Ok(false) => {}
            Err(Replied) => return,
        }
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
        .key_count()
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

/// Writes `value` (a stored value of any type) with `expire_at_ms` at `key`, on `condition`;
/// false when the condition failed.
pub(super) fn put_stored(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    value: &[u8],
    expire_at_ms: u64,
    condition: Condition,
) -> Result<bool, NodeError> {
    let node = ctx.node;
    let opts = PutOptions {
        condition,
        expire_at_ms,
        ..Default::default()
    };
    match node.put(
        node.tablet_of(key),
        key,
        value,
        &opts,
        &mut ctx.session.acks,
    ) {
        Ok(_) => Ok(true),
        Err(NodeError::Engine(EngineError::ConditionFailed { .. })) => Ok(false),
        Err(e) => Err(e),
    }
}

/// RENAME/RENAMENX: the value (of any type) and its expiry go to the new name, which is
/// written first; the old name is then deleted if it still holds what was read (a crash in
/// between leaves both names, never neither).
fn rename(ctx: &mut Ctx<'_>, args: &[&[u8]], only_new: bool) {
    let (src, dst) = (args[1], args[2]);
    let node = ctx.node;
    for _ in 0..64 {
        let found = match node.get(node.tablet_of(src), src, &mut ctx.session.acks) {
            Ok(f) => f,
            Err(e) => return engine_error(ctx, &e),
        };
        let Some(object) = found else {
            return ctx.enc.error("ERR no such key");
        };
        if src == dst {
            return if only_new {
                ctx.enc.integer(0)
            } else {
                ctx.enc.ok()
            };
        }
        let condition = if only_new {
            Condition::IfAbsent
        } else {
            Condition::None
        };
        if ramlog_proto::types::is_large(&object.value) {
            match large_list::copy_to(ctx, src, &object, dst, condition).and_then(|written| {
                if !written {
                    return Ok(None);
                }
                large_list::delete_at_version(ctx, src, &object).map(Some)
            }) {
                Ok(None) => return ctx.enc.integer(0),
                Ok(Some(true)) => {
                    node.waiters.wake(dst);
                    return if only_new {
                        ctx.enc.integer(1)
                    } else {
                        ctx.enc.ok()
                    };
                }
                Ok(Some(false)) | Err(large_list::LargeError::Changed) => continue,
                Err(e) => return large_list::reply_error(ctx, e),
            }
        }
        match put_stored(ctx, dst, &object.value, object.expire_at_ms, condition) {
            Ok(true) => {}
            Ok(false) => return ctx.enc.integer(0),
            Err(e) => return engine_error(ctx, &e),
        }
        match node.delete(
            node.tablet_of(src),
            src,
            Condition::IfVersion(object.version),
            &mut ctx.session.acks,
        ) {
            Ok(Some(_)) => {
                node.waiters.wake(dst);
                return if only_new {
                    ctx.enc.integer(1)
                } else {
                    ctx.enc.ok()
                };
            }
            // The source changed after it was read: read it again (the new name is rewritten).
            Ok(None) | Err(NodeError::Engine(EngineError::ConditionFailed { .. })) => continue,
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc
        .error("ERR too much contention on the key, try again")
}

pub(super) fn cmd_rename(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    rename(ctx, args, false)
}

pub(super) fn cmd_renamenx(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    rename(ctx, args, true)
}

/// COPY source destination [DB 0] [REPLACE]
pub(super) fn cmd_copy(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let mut replace = false;
    let mut i = 3;
    while i < args.len() {
        if eq_ignore_case(args[i], "replace") {
            replace = true;
        } else if eq_ignore_case(args[i], "db") && i + 1 < args.len() {
            match parse_i64(args[i + 1]) {
                Some(0) => {}
                Some(_) => return ctx.enc.error("ERR DB index is out of range"),
                None => return ctx.enc.error(ERR_NOT_INTEGER),
            }
            i += 1;
        } else {
            return ctx.enc.error(ERR_SYNTAX);
        }
        i += 1;
    }
    let (src, dst) = (args[1], args[2]);
    if src == dst {
        return ctx
            .enc
            .error("ERR source and destination objects are the same");
    }
    let found = match read(ctx, src) {
        Ok(f) => f,
        Err(e) => return engine_error(ctx, &e),
    };
    let Some(object) = found else {
        return ctx.enc.integer(0);
    };
    let condition = if replace {
        Condition::None
    } else {
        Condition::IfAbsent
    };
    if ramlog_proto::types::is_large(&object.value) {
        return match large_list::copy_to(ctx, src, &object, dst, condition) {
            Ok(done) => {
                if done {
                    ctx.node.waiters.wake(dst);
                }
                ctx.enc.integer(i64::from(done))
            }
            Err(e) => large_list::reply_error(ctx, e),
        };
    }
    match put_stored(ctx, dst, &object.value, object.expire_at_ms, condition) {
        Ok(done) => {
            if done {
                ctx.node.waiters.wake(dst);
            }
            ctx.enc.integer(i64::from(done))
        }
        Err(e) => engine_error(ctx, &e),
    }
}

/// RANDOMKEY: a key of a random tablet (nil when there is none).
pub(super) fn cmd_randomkey(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    let tablets = ctx.node.keyspace.tablet_ids().len().max(1) as u64;
    let start = super::typed::random_u64() % tablets;
    let mut keys = Vec::new();
    // From a random tablet on, the first that holds keys; then a random one of its first keys.
    for step in 0..tablets {
        let cursor = (start + step) % tablets;
        keys.clear();
        match ctx.node.keyspace.scan(cursor, 64, None, &mut keys) {
            Ok(_) => {}
            Err(e) => return engine_error(ctx, &e.into()),
        }
        if !keys.is_empty() {
            let pick = (super::typed::random_u64() % keys.len() as u64) as usize;
            return ctx.enc.bulk(&keys[pick]);
        }
    }
    ctx.enc.null()
}

/// The encoding OBJECT ENCODING names: Redis's for the same value (a compact collection is
/// Redis's listpack, or intset for a set of integers; a large list its quicklist, a large hash
/// or set its hashtable).
fn encoding_of(ctx: &Ctx<'_>, stored: &[u8]) -> &'static str {
    use ramlog_proto::types::{kind_of, large_kind, string_of, Kind, Set};
    match large_kind(stored) {
        Some(Kind::List) => return "quicklist",
        Some(Kind::ZSet) => return "skiplist",
        Some(_) => return "hashtable",
        None => {}
    }
    match kind_of(stored) {
        Ok(Kind::String) => {
            let s = string_of(stored).unwrap_or_default();
            if ramlog_proto::types::is_raw_string(stored) {
                "raw"
            } else if s.len() <= 20 && parse_i64(s).is_some() {
                "int"
            } else if s.len() <= ramlog_proto::types::EMBSTR_MAX_BYTES {
                "embstr"
            } else {
                "raw"
            }
        }
        Ok(Kind::Stream) => "stream",
        Ok(Kind::Set) => Set::decode(stored)
            .ok()
            .and_then(|set| super::typed::set_compact_encoding(ctx, &set))
            .unwrap_or("listpack"),
        Ok(_) => "listpack",
        Err(_) => "unknown",
    }
}

/// OBJECT ENCODING|REFCOUNT|IDLETIME|FREQ|HELP key
pub(super) fn cmd_object(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1];
    if eq_ignore_case(sub, "help") {
        let lines = [
            "OBJECT <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "ENCODING <key>",
            "    Return the kind of internal representation used in order to store the value",
            "    associated with a <key>.",
            "FREQ <key>",
            "IDLETIME <key>",
            "REFCOUNT <key>",
            "HELP",
            "    Print this help.",
        ];
        ctx.enc.array(lines.len());
        for l in lines {
            ctx.enc.simple(l);
        }
        return;
    }
    if args.len() != 3 {
        return unknown_subcommand(ctx, "object", sub);
    }
    let found = match read(ctx, args[2]) {
        Ok(f) => f,
        Err(e) => return engine_error(ctx, &e),
    };
    let Some(object) = found else {
        return ctx.enc.null();
    };
    if eq_ignore_case(sub, "encoding") {
        ctx.enc.bulk(encoding_of(ctx, &object.value).as_bytes())
    } else if eq_ignore_case(sub, "refcount") {
        ctx.enc.integer(1)
    } else if eq_ignore_case(sub, "idletime") || eq_ignore_case(sub, "freq") {
        ctx.enc.integer(0)
    } else {
        unknown_subcommand(ctx, "object", sub)
    }
}

/// MEMORY USAGE key [SAMPLES n]: the bytes the key takes in the log (its entry: header, key and
/// value, a collection's encoded elements included) and its hash-index slot.
pub(super) fn cmd_memory(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1];
    if eq_ignore_case(sub, "usage") && args.len() >= 3 {
        let key = args[2];
        let node = ctx.node;
        let found = node.read_with(
            node.tablet_of(key),
            key,
            &mut ctx.session.acks,
            |v, version, expiry| {
                ramlog_logmem::entry::encoded_len(
                    ramlog_logmem::entry::KIND_OBJECT,
                    version,
                    key.len(),
                    v.len(),
                    expiry,
                )
            },
        );
        let chunks = match large_list::memory_of(ctx, key) {
            Ok(bytes) => bytes,
            Err(Replied) => return,
        };
        match found {
            Ok(Some(bytes)) => ctx
                .enc
                .integer((bytes + INDEX_SLOT_BYTES) as i64 + chunks as i64),
            Ok(None) => ctx.enc.null(),
            Err(e) => engine_error(ctx, &e),
        }
    } else if eq_ignore_case(sub, "help") {
        ctx.enc.array(1);
        ctx.enc.simple("MEMORY USAGE <key> [SAMPLES <count>]");
    } else {
        unknown_subcommand(ctx, "memory", sub)
    }
}

/// What one object's slot in the hash index takes (docs/formats.md, "Hash index").
const INDEX_SLOT_BYTES: usize = 8;
