//! DUMP and RESTORE (Redis's `cluster.c`): a key's value as a payload in RDB's encoding
//! ([`ramlog_proto::rdb`]), and a key made from one. Payloads DUMP writes load in Redis 5 to 7.2,
//! and RESTORE takes what those write, so keys move between ramlog and Redis both ways.
//! Large collections are read whole and written in whichever form their size calls for.

use super::large_list::{self, Place};
use super::large_table;
use super::typed::{self, Collection, Replied};
use super::*;
use ramlog_proto::rdb::{self, RdbValue};
use ramlog_proto::types::{self, Kind};
use std::collections::HashSet;

/// DUMP key: the payload, or nil when the key is absent.
pub(super) fn cmd_dump(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let key = args[1];
    let found = match read(ctx, key) {
        Ok(f) => f,
        Err(e) => return engine_error(ctx, &e),
    };
    let Some(object) = found else {
        return ctx.enc.null();
    };
    let kind =
        match types::large_kind(&object.value).map_or_else(|| types::kind_of(&object.value), Ok) {
            Ok(k) => k,
            Err(_) => return ctx.enc.error("ERR the stored value is damaged"),
        };
    let value = match value_of(ctx, key, kind, &object) {
        Ok(Some(v)) => v,
        // Deleted between the two reads.
        Ok(None) => return ctx.enc.null(),
        Err(Replied) => return,
    };
    ctx.enc.bulk(&rdb::dump(&value));
}

fn value_of(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    kind: Kind,
    object: &Object,
) -> Result<Option<RdbValue>, Replied> {
    Ok(match kind {
        Kind::String => match types::string_of(&object.value) {
            Some(s) => Some(RdbValue::String(s.to_vec())),
            None => {
                ctx.enc.error("ERR the stored value is damaged");
                return Err(Replied);
            }
        },
        Kind::List => typed::load::<types::List>(ctx, key)?
            .map(|l| RdbValue::List(l.items.into_iter().collect())),
        Kind::Hash => typed::load::<types::Hash>(ctx, key)?.map(|h| RdbValue::Hash(h.fields)),
        Kind::Set => typed::load::<types::Set>(ctx, key)?.map(|s| RdbValue::Set(s.members)),
        Kind::ZSet => typed::load::<types::ZSet>(ctx, key)?
            .map(|z| RdbValue::ZSet(z.entries.into_iter().map(|(s, m)| (m, s)).collect())),
        Kind::Stream => typed::load::<types::Stream>(ctx, key)?.map(RdbValue::Stream),
    })
}

/// RESTORE key ttl serialized-value [REPLACE] [ABSTTL] [IDLETIME seconds] [FREQ frequency]
pub(super) fn cmd_restore(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let key = args[1];
    let (mut replace, mut absolute) = (false, false);
    let (mut idle, mut freq) = (false, false);
    let mut i = 4;
    while i < args.len() {
        let more = i + 1 < args.len();
        if eq_ignore_case(args[i], "replace") {
            replace = true;
        } else if eq_ignore_case(args[i], "absttl") {
            absolute = true;
        } else if eq_ignore_case(args[i], "idletime") && more && !freq {
            match parse_i64(args[i + 1]) {
                Some(v) if v >= 0 => idle = true,
                Some(_) => return ctx.enc.error("ERR Invalid IDLETIME value, must be >= 0"),
                None => return ctx.enc.error(ERR_NOT_INTEGER),
            }
            i += 1;
        } else if eq_ignore_case(args[i], "freq") && more && !idle {
            match parse_i64(args[i + 1]) {
                Some(v) if (0..=255).contains(&v) => freq = true,
                Some(_) => {
                    return ctx
                        .enc
                        .error("ERR Invalid FREQ value, must be >= 0 and <= 255")
                }
                None => return ctx.enc.error(ERR_NOT_INTEGER),
            }
            i += 1;
        } else {
            return ctx.enc.error(ERR_SYNTAX);
        }
        i += 1;
    }
    if !replace {
        match read(ctx, key) {
            Ok(Some(_)) => return ctx.enc.error("BUSYKEY Target key name already exists."),
            Ok(None) => {}
            Err(e) => return engine_error(ctx, &e),
        }
    }
    let Some(ttl) = parse_i64(args[2]) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    if ttl < 0 {
        return ctx.enc.error("ERR Invalid TTL value, must be >= 0");
    }
    let limits = rdb::Limits {
        string_bytes: ctx.node.config.value_size_max_bytes as usize,
        elements: usize::MAX >> 8,
    };
    let value = match rdb::restore(args[3], limits) {
        Ok(v) => v,
        Err(e) => return ctx.enc.error(&format!("ERR {e}")),
    };
    let now = now_ms();
    let expire_at_ms = match (ttl, absolute) {
        (0, _) => 0,
        (t, true) => t as u64,
        (t, false) => now.saturating_add(t as u64),
    };
    if expire_at_ms != 0 && expire_at_ms <= now {
        // Already expired: the key is not created (and one it replaces goes), as in Redis.
        if replace {
            if let Err(Replied) = large_list::delete_if_large(ctx, key) {
                return;
            }
            let node = ctx.node;
            if let Err(e) = node.delete(
                node.tablet_of(key),
                key,
                Condition::None,
                &mut ctx.session.acks,
            ) {
                return engine_error(ctx, &e);
            }
        }
        return ctx.enc.ok();
    }
    let condition = if replace {
        Condition::None
    } else {
        Condition::IfAbsent
    };
    match write(ctx, key, value, condition, expire_at_ms) {
        Ok(true) => {
            ctx.node.waiters.wake(key);
            ctx.enc.ok()
        }
        Ok(false) => ctx.enc.error("BUSYKEY Target key name already exists."),
        Err(Replied) => {}
    }
}

fn bad_format(ctx: &mut Ctx<'_>, what: &str) -> Replied {
    ctx.enc.error(&format!("ERR Bad data format: {what}"));
    Replied
}

/// Writes the restored value at `key`; false when `condition` failed (the key exists).
fn write(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    value: RdbValue,
    condition: Condition,
    expire_at_ms: u64,
) -> Result<bool, Replied> {
    let stored: Vec<u8> = match value {
        RdbValue::String(s) => types::store_string(&s).into_owned(),
        RdbValue::List(items) => {
            if items.is_empty() {
                return Err(bad_format(ctx, "empty list"));
            }
            let list = types::List {
                items: items.into(),
            };
            let place = Place::of(ctx, key);
            let done =
                large_list::write(ctx, place, &list, condition, Some(expire_at_ms), None, None);
            return large_result(ctx, done);
        }
        RdbValue::Set(members) => {
            if members.is_empty() || !distinct(members.iter().map(Vec::as_slice)) {
                return Err(bad_format(ctx, "empty set or duplicate members"));
            }
            let listpack = !members.iter().all(|m| types::is_integer_member(m));
            let set = types::Set { members, listpack };
            if set.wants_table(ctx) {
                let entries: Vec<(&[u8], &[u8])> = set
                    .members
                    .iter()
                    .map(|m| (m.as_slice(), &b""[..]))
                    .collect();
                return write_table(ctx, key, Kind::Set, &entries, condition, expire_at_ms);
            }
            set.encode()
        }
        RdbValue::Hash(fields) => {
            if fields.is_empty() || !distinct(fields.iter().map(|(f, _)| f.as_slice())) {
                return Err(bad_format(ctx, "empty hash or duplicate fields"));
            }
            let hash = types::Hash { fields };
            if hash.wants_table(ctx) {
                let entries: Vec<(&[u8], &[u8])> = hash
                    .fields
                    .iter()
                    .map(|(f, v)| (f.as_slice(), v.as_slice()))
                    .collect();
                return write_table(ctx, key, Kind::Hash, &entries, condition, expire_at_ms);
            }
            hash.encode()
        }
        RdbValue::ZSet(entries) => {
            if entries.is_empty() || !distinct(entries.iter().map(|(m, _)| m.as_slice())) {
                return Err(bad_format(ctx, "empty sorted set or duplicate members"));
            }
            let mut entries: Vec<(f64, Vec<u8>)> =
                entries.into_iter().map(|(m, s)| (s, m)).collect();
            entries.sort_by(types::zset_order);
            if super::large_zset::wants_large(ctx, &entries) {
                let place = Place::of(ctx, key);
                let done = super::large_zset::write(
                    ctx,
                    place,
                    &entries,
                    condition,
                    Some(expire_at_ms),
                    None,
                );
                return large_result(ctx, done);
            }
            types::ZSet { entries }.encode()
        }
        RdbValue::Stream(st) => {
            let bytes = st.encode();
            let max = ctx.node.config.value_size_max_bytes + types::TAG_BYTES as u64;
            if bytes.len() as u64 > max {
                return Err(typed::too_large(ctx, Kind::Stream, bytes.len()));
            }
            bytes
        }
    };
    match super::keys::put_stored(ctx, key, &stored, expire_at_ms, condition) {
        Ok(done) => Ok(done),
        Err(e) => {
            engine_error(ctx, &e);
            Err(Replied)
        }
    }
}

fn write_table(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    kind: Kind,
    entries: &[(&[u8], &[u8])],
    condition: Condition,
    expire_at_ms: u64,
) -> Result<bool, Replied> {
    let place = Place::of(ctx, key);
    let done = large_table::write(
        ctx,
        place,
        kind,
        entries,
        condition,
        Some(expire_at_ms),
        None,
    );
    large_result(ctx, done)
}

fn large_result(
    ctx: &mut Ctx<'_>,
    done: Result<(), large_list::LargeError>,
) -> Result<bool, Replied> {
    match done {
        Ok(()) => Ok(true),
        // The only condition RESTORE writes with is that the key is absent.
        Err(large_list::LargeError::Changed) => Ok(false),
        Err(e) => {
            large_list::reply_error(ctx, e);
            Err(Replied)
        }
    }
}

fn distinct<'a>(items: impl Iterator<Item = &'a [u8]>) -> bool {
    let mut seen = HashSet::new();
    items.into_iter().all(|i| seen.insert(i))
}

/// The positions of MIGRATE's keys (first, end): the key argument, or what follows KEYS when
/// it is empty (AUTH and AUTH2 arguments skipped, as Redis's `migrateGetKeys` does).
pub(super) fn migrate_keys(args: &[&[u8]]) -> Option<(usize, usize)> {
    if args.len() < 6 {
        return None;
    }
    if !args[3].is_empty() {
        return Some((3, 4));
    }
    let mut i = 6;
    while i < args.len() {
        if eq_ignore_case(args[i], "auth") {
            i += 1;
        } else if eq_ignore_case(args[i], "auth2") {
            i += 2;
        } else if eq_ignore_case(args[i], "keys") {
            return Some((i + 1, args.len()));
        }
        i += 1;
    }
    None
}

/// MIGRATE's options after `host port key db timeout`.
struct MigrateOptions<'a> {
    copy: bool,
    replace: bool,
    auth: Option<(Option<&'a [u8]>, &'a [u8])>,
    keys: Vec<&'a [u8]>,
}

fn parse_migrate<'a>(args: &[&'a [u8]]) -> Result<MigrateOptions<'a>, &'static str> {
    let mut o = MigrateOptions {
        copy: false,
        replace: false,
        auth: None,
        keys: Vec::new(),
    };
    let mut i = 6;
    while i < args.len() {
        let rest = args.len() - i - 1;
        if eq_ignore_case(args[i], "copy") {
            o.copy = true;
        } else if eq_ignore_case(args[i], "replace") {
            o.replace = true;
        } else if eq_ignore_case(args[i], "auth") && rest >= 1 {
            o.auth = Some((None, args[i + 1]));
            i += 1;
        } else if eq_ignore_case(args[i], "auth2") && rest >= 2 {
            o.auth = Some((Some(args[i + 1]), args[i + 2]));
            i += 2;
        } else if eq_ignore_case(args[i], "keys") {
            if !args[3].is_empty() {
                return Err("ERR When using MIGRATE KEYS option, the key argument must be set to the empty string");
            }
            o.keys = args[i + 1..].to_vec();
            break;
        } else {
            return Err(ERR_SYNTAX);
        }
        i += 1;
    }
    if !args[3].is_empty() {
        o.keys = vec![args[3]];
    }
    Ok(o)
}

/// MIGRATE host port key|"" destination-db timeout [COPY] [REPLACE] [AUTH password]
/// [AUTH2 username password] [KEYS key [key ...]]: each key's DUMP payload is restored at the
/// target (`RESTORE`, or `RESTORE-ASKING` from a cluster server, as Redis sends them; with the
/// key's remaining TTL) over one connection, pipelined; the keys the target took are then
/// deleted here unless COPY. `+NOKEY` when none of the keys exists. The connection is opened
/// for each MIGRATE (Redis caches it for 10 s).
pub(super) fn cmd_migrate(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let o = match parse_migrate(args) {
        Ok(o) => o,
        Err(e) => return ctx.enc.error(e),
    };
    let (Some(port), Some(db), Some(timeout)) = (
        std::str::from_utf8(args[2])
            .ok()
            .and_then(|p| p.parse::<u16>().ok()),
        parse_i64(args[4]),
        parse_i64(args[5]),
    ) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    let timeout =
        std::time::Duration::from_millis(if timeout <= 0 { 1000 } else { timeout as u64 });
    let host = String::from_utf8_lossy(args[1]).into_owned();
    // The payloads, with each key's remaining TTL; absent keys are left out.
    let now = now_ms();
    let mut found: Vec<(&[u8], u64, Vec<u8>)> = Vec::new();
    for key in &o.keys {
        let object = match read(ctx, key) {
            Ok(Some(o)) => o,
            Ok(None) => continue,
            Err(e) => return engine_error(ctx, &e),
        };
        let kind = match types::large_kind(&object.value)
            .map_or_else(|| types::kind_of(&object.value), Ok)
        {
            Ok(k) => k,
            Err(_) => return ctx.enc.error("ERR the stored value is damaged"),
        };
        let Ok(value) = value_of(ctx, key, kind, &object) else {
            return;
        };
        let Some(value) = value else {
            continue;
        };
        let ttl = match object.expire_at_ms {
            0 => 0,
            at => at.saturating_sub(now).max(1),
        };
        found.push((key, ttl, rdb::dump(&value)));
    }
    if found.is_empty() {
        return ctx.enc.simple("NOKEY");
    }
    let restore: &[u8] = if ctx.session.member().is_some() {
        b"RESTORE-ASKING"
    } else {
        b"RESTORE"
    };
    let mut request = Vec::new();
    let mut preamble = 0;
    match o.auth {
        Some((None, password)) => {
            resp_command(&mut request, &[b"AUTH", password]);
            preamble += 1;
        }
        Some((Some(user), password)) => {
            resp_command(&mut request, &[b"AUTH", user, password]);
            preamble += 1;
        }
        None => {}
    }
    resp_command(&mut request, &[b"SELECT", db.to_string().as_bytes()]);
    preamble += 1;
    for (key, ttl, payload) in &found {
        let ttl = ttl.to_string();
        let mut cmd: Vec<&[u8]> = vec![restore, key, ttl.as_bytes(), payload];
        if o.replace {
            cmd.push(b"REPLACE");
        }
        resp_command(&mut request, &cmd);
    }
    let replies = match super::off_the_runtime(|| {
        exchange(&host, port, timeout, &request, preamble + found.len())
    }) {
        Ok(r) => r,
        Err(e) => {
            return ctx
                .enc
                .error(&format!("IOERR error or timeout {e} target instance"))
        }
    };
    for r in &replies[..preamble] {
        if let ramlog_proto::resp::Reply::Error(m) = r {
            return ctx
                .enc
                .error(&format!("ERR Target instance replied with error: {m}"));
        }
    }
    let mut error = None;
    let mut moved = Vec::new();
    for ((key, _, _), r) in found.iter().zip(&replies[preamble..]) {
        match r {
            ramlog_proto::resp::Reply::Error(m) => {
                error.get_or_insert_with(|| m.clone());
            }
            _ => moved.push(*key),
        }
    }
    if !o.copy {
        let node = ctx.node;
        for key in moved {
            match large_list::delete_if_large(ctx, key) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(Replied) => return,
            }
            if let Err(e) = node.delete(
                node.tablet_of(key),
                key,
                Condition::None,
                &mut ctx.session.acks,
            ) {
                return engine_error(ctx, &e);
            }
        }
    }
    match error {
        Some(m) => ctx
            .enc
            .error(&format!("ERR Target instance replied with error: {m}")),
        None => ctx.enc.ok(),
    }
}

/// Appends one RESP command.
fn resp_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

/// Sends `request` to host:port and reads `count` replies, each wait bounded by `timeout`.
/// The error says where it failed ("connecting to", "writing to", "reading from").
fn exchange(
    host: &str,
    port: u16,
    timeout: std::time::Duration,
    request: &[u8],
    count: usize,
) -> Result<Vec<ramlog_proto::resp::Reply>, &'static str> {
    use std::io::{Read, Write};
    use std::net::ToSocketAddrs;
    let addr = (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or("connecting to")?;
    let mut s =
        std::net::TcpStream::connect_timeout(&addr, timeout).map_err(|_| "connecting to")?;
    let _ = s.set_nodelay(true);
    s.set_write_timeout(Some(timeout))
        .map_err(|_| "writing to")?;
    s.set_read_timeout(Some(timeout))
        .map_err(|_| "reading from")?;
    s.write_all(request).map_err(|_| "writing to")?;
    let decoder = ramlog_proto::resp::ReplyDecoder::default();
    let mut buf = Vec::with_capacity(4096);
    let mut replies = Vec::with_capacity(count);
    let mut chunk = [0u8; 16 * 1024];
    while replies.len() < count {
        match decoder.decode(&buf) {
            Ok(Some((reply, used))) => {
                buf.drain(..used);
                replies.push(reply);
                continue;
            }
            Ok(None) => {}
            Err(_) => return Err("reading from"),
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return Err("reading from"),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    Ok(replies)
}
