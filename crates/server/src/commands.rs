//! RESP commands: the table of supported commands and their Redis 7 semantics on top of the engine.
//!
//! [`execute`] takes one decoded request and appends its reply. It checks, in Redis's order, that
//! the command exists, that its arity fits, and that the client is authenticated; then the
//! command's handler runs directly against the engine (no lock of the server's own). Replies,
//! error strings and types follow Redis 7 so that clients and their tests cannot tell the difference.

use crate::keyspace::glob_match_nocase;
use crate::metrics::{Metrics, Op};
use crate::server::Shared;
use ramlog_common::{key_slot, SLOT_COUNT};
use ramlog_logmem::{Condition, EngineError, Object, PutOptions};
use ramlog_proto::resp::ReplyEncoder;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::LazyLock;
use std::time::Instant;

/// Per-connection state that commands read and change.
#[derive(Debug)]
pub struct Session {
    pub id: u64,
    /// RESP protocol version, 2 or 3 (HELLO changes it).
    pub protocol: u8,
    pub authenticated: bool,
    pub name: Option<Vec<u8>>,
    pub lib_name: Option<Vec<u8>>,
    pub lib_ver: Option<Vec<u8>>,
    /// Set by QUIT: close once the reply is written.
    pub closing: bool,
    /// Whether this connection wrote since the last durability wait (for `durable` persistence).
    pub wrote: bool,
    /// Commands queued since MULTI (None outside a transaction).
    pub multi: Option<Vec<Vec<Vec<u8>>>>,
    /// A command queued after MULTI was refused: EXEC will discard the transaction.
    pub multi_failed: bool,
}

impl Session {
    pub fn new(id: u64, password_required: bool) -> Session {
        Session {
            id,
            protocol: 2,
            authenticated: !password_required,
            name: None,
            lib_name: None,
            lib_ver: None,
            closing: false,
            wrote: false,
            multi: None,
            multi_failed: false,
        }
    }
}

struct Ctx<'a> {
    shared: &'a Shared,
    session: &'a mut Session,
    enc: ReplyEncoder<'a>,
}

type Handler = fn(&mut Ctx<'_>, &[&[u8]]);

/// One supported command, as `COMMAND INFO` describes it.
pub struct Spec {
    pub name: &'static str,
    /// Redis arity: `n` exactly n arguments (name included), `-n` at least n.
    pub arity: i32,
    pub flags: &'static [&'static str],
    pub first_key: i32,
    pub last_key: i32,
    pub step: i32,
    pub categories: &'static [&'static str],
    op: Op,
    handler: Handler,
    /// Allowed before authentication.
    no_auth: bool,
}

const W: &[&str] = &["write", "denyoom"];
const R: &[&str] = &["readonly", "fast"];
const F: &[&str] = &["fast"];
const A: &[&str] = &["admin", "noscript", "loading", "stale"];

macro_rules! spec {
    ($name:expr, $arity:expr, $flags:expr, $fk:expr, $lk:expr, $st:expr, $cat:expr, $op:expr, $h:expr) => {
        Spec {
            name: $name,
            arity: $arity,
            flags: $flags,
            first_key: $fk,
            last_key: $lk,
            step: $st,
            categories: $cat,
            op: $op,
            handler: $h,
            no_auth: false,
        }
    };
}

static SPECS: LazyLock<Vec<Spec>> = LazyLock::new(|| {
    let s = &["@string"][..];
    let k = &["@keyspace"][..];
    let c = &["@connection"][..];
    let a = &["@admin", "@dangerous"][..];
    let mut v = vec![
        spec!("get", 2, R, 1, 1, 1, s, Op::Get, cmd_get),
        spec!("set", -3, W, 1, 1, 1, s, Op::Set, cmd_set),
        spec!("setnx", 3, W, 1, 1, 1, s, Op::Set, cmd_setnx),
        spec!("setex", 4, W, 1, 1, 1, s, Op::Set, cmd_setex),
        spec!("psetex", 4, W, 1, 1, 1, s, Op::Set, cmd_psetex),
        spec!("getset", 3, W, 1, 1, 1, s, Op::Set, cmd_getset),
        spec!("getdel", 2, W, 1, 1, 1, s, Op::Del, cmd_getdel),
        spec!("append", 3, W, 1, 1, 1, s, Op::Set, cmd_append),
        spec!("mget", -2, R, 1, -1, 1, s, Op::Mget, cmd_mget),
        spec!("mset", -3, W, 1, -1, 2, s, Op::Mset, cmd_mset),
        spec!("del", -2, &["write"], 1, -1, 1, k, Op::Del, cmd_del),
        spec!(
            "unlink",
            -2,
            &["write", "fast"],
            1,
            -1,
            1,
            k,
            Op::Del,
            cmd_del
        ),
        spec!("exists", -2, R, 1, -1, 1, k, Op::Exists, cmd_exists),
        spec!("incr", 2, W, 1, 1, 1, s, Op::Incr, cmd_incr),
        spec!("decr", 2, W, 1, 1, 1, s, Op::Incr, cmd_decr),
        spec!("incrby", 3, W, 1, 1, 1, s, Op::Incr, cmd_incrby),
        spec!("decrby", 3, W, 1, 1, 1, s, Op::Incr, cmd_decrby),
        spec!("strlen", 2, R, 1, 1, 1, s, Op::Strlen, cmd_strlen),
        spec!(
            "getrange",
            4,
            &["readonly"],
            1,
            1,
            1,
            s,
            Op::Get,
            cmd_getrange
        ),
        spec!(
            "substr",
            4,
            &["readonly"],
            1,
            1,
            1,
            s,
            Op::Get,
            cmd_getrange
        ),
        spec!(
            "getex",
            -2,
            &["write", "fast"],
            1,
            1,
            1,
            s,
            Op::Get,
            cmd_getex
        ),
        spec!("type", 2, R, 1, 1, 1, k, Op::Exists, cmd_type),
        spec!("scan", -2, &["readonly"], 0, 0, 0, k, Op::Scan, cmd_scan),
        spec!("keys", 2, &["readonly"], 0, 0, 0, k, Op::Scan, cmd_keys),
        spec!("dbsize", 1, R, 0, 0, 0, k, Op::Other, cmd_dbsize),
        spec!("ttl", 2, R, 1, 1, 1, k, Op::Ttl, cmd_ttl),
        spec!("pttl", 2, R, 1, 1, 1, k, Op::Ttl, cmd_pttl),
        spec!("expiretime", 2, R, 1, 1, 1, k, Op::Ttl, cmd_expiretime),
        spec!("pexpiretime", 2, R, 1, 1, 1, k, Op::Ttl, cmd_pexpiretime),
        spec!(
            "expire",
            -3,
            &["write", "fast"],
            1,
            1,
            1,
            k,
            Op::Expire,
            cmd_expire
        ),
        spec!(
            "pexpire",
            -3,
            &["write", "fast"],
            1,
            1,
            1,
            k,
            Op::Expire,
            cmd_pexpire
        ),
        spec!(
            "expireat",
            -3,
            &["write", "fast"],
            1,
            1,
            1,
            k,
            Op::Expire,
            cmd_expireat
        ),
        spec!(
            "pexpireat",
            -3,
            &["write", "fast"],
            1,
            1,
            1,
            k,
            Op::Expire,
            cmd_pexpireat
        ),
        spec!(
            "persist",
            2,
            &["write", "fast"],
            1,
            1,
            1,
            k,
            Op::Expire,
            cmd_persist
        ),
        spec!(
            "flushall",
            -1,
            &["write"],
            0,
            0,
            0,
            a,
            Op::Other,
            cmd_flushall
        ),
        spec!(
            "flushdb",
            -1,
            &["write"],
            0,
            0,
            0,
            a,
            Op::Other,
            cmd_flushall
        ),
        spec!("ping", -1, F, 0, 0, 0, c, Op::Other, cmd_ping),
        spec!("echo", 2, F, 0, 0, 0, c, Op::Other, cmd_echo),
        spec!(
            "select",
            2,
            &["loading", "stale", "fast"],
            0,
            0,
            0,
            c,
            Op::Other,
            cmd_select
        ),
        spec!(
            "info",
            -1,
            &["loading", "stale"],
            0,
            0,
            0,
            &["@dangerous"],
            Op::Other,
            cmd_info
        ),
        spec!("config", -2, A, 0, 0, 0, a, Op::Other, cmd_config),
        spec!(
            "command",
            -1,
            &["loading", "stale"],
            0,
            0,
            0,
            c,
            Op::Other,
            cmd_command
        ),
        spec!(
            "client",
            -2,
            &["loading", "stale"],
            0,
            0,
            0,
            c,
            Op::Other,
            cmd_client
        ),
        spec!("cluster", -2, &[], 0, 0, 0, &[], Op::Other, cmd_cluster),
        spec!(
            "time",
            1,
            &["loading", "stale", "fast"],
            0,
            0,
            0,
            &[],
            Op::Other,
            cmd_time
        ),
        spec!(
            "lastsave",
            1,
            &["loading", "stale", "fast"],
            0,
            0,
            0,
            &[],
            Op::Other,
            cmd_lastsave
        ),
        spec!(
            "readonly",
            1,
            &["loading", "stale", "fast"],
            0,
            0,
            0,
            c,
            Op::Other,
            cmd_ok
        ),
        spec!(
            "readwrite",
            1,
            &["loading", "stale", "fast"],
            0,
            0,
            0,
            c,
            Op::Other,
            cmd_ok
        ),
        spec!(
            "multi",
            1,
            &["noscript", "loading", "stale", "fast"],
            0,
            0,
            0,
            &["@transaction"],
            Op::Other,
            cmd_multi
        ),
        spec!(
            "exec",
            1,
            &["noscript", "loading", "stale"],
            0,
            0,
            0,
            &["@transaction"],
            Op::Other,
            cmd_exec
        ),
        spec!(
            "discard",
            1,
            &["noscript", "loading", "stale", "fast"],
            0,
            0,
            0,
            &["@transaction"],
            Op::Other,
            cmd_discard
        ),
        spec!(
            "shutdown",
            -1,
            &["admin", "noscript", "loading", "stale"],
            0,
            0,
            0,
            a,
            Op::Other,
            cmd_shutdown
        ),
    ];
    let mut auth = spec!(
        "auth",
        -2,
        &["noscript", "loading", "stale", "fast"],
        0,
        0,
        0,
        c,
        Op::Other,
        cmd_auth
    );
    auth.no_auth = true;
    let mut hello = spec!(
        "hello",
        -1,
        &["noscript", "loading", "stale", "fast"],
        0,
        0,
        0,
        c,
        Op::Other,
        cmd_hello
    );
    hello.no_auth = true;
    let mut quit = spec!(
        "quit",
        -1,
        &["noscript", "loading", "stale", "fast"],
        0,
        0,
        0,
        c,
        Op::Other,
        cmd_quit
    );
    quit.no_auth = true;
    v.extend([auth, hello, quit]);
    v
});

/// FNV-1a: command names are a few bytes and fixed at start-up, so the table needs neither
/// SipHash's cost (about 190 instructions a lookup, 5% of a pipelined SET's work in the server)
/// nor its resistance to chosen keys: a name from a client only probes a table it cannot grow.
#[derive(Clone, Copy)]
struct NameHasher(u64);

impl Default for NameHasher {
    fn default() -> Self {
        NameHasher(0xcbf2_9ce4_8422_2325)
    }
}

impl std::hash::Hasher for NameHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

type NameMap = HashMap<&'static [u8], usize, std::hash::BuildHasherDefault<NameHasher>>;

static BY_NAME: LazyLock<NameMap> = LazyLock::new(|| {
    SPECS
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_bytes(), i))
        .collect()
});

/// All supported commands.
pub fn specs() -> &'static [Spec] {
    &SPECS
}

fn lookup(name: &[u8]) -> Option<&'static Spec> {
    let mut lower = [0u8; 24];
    if name.len() > lower.len() {
        return None;
    }
    for (d, s) in lower.iter_mut().zip(name) {
        *d = s.to_ascii_lowercase();
    }
    BY_NAME.get(&lower[..name.len()]).map(|&i| &SPECS[i])
}

const ERR_SYNTAX: &str = "ERR syntax error";
const ERR_NOT_INTEGER: &str = "ERR value is not an integer or out of range";
const ERR_OVERFLOW: &str = "ERR increment or decrement would overflow";
const ERR_NOAUTH: &str = "NOAUTH Authentication required.";
const ERR_WRONGPASS: &str = "WRONGPASS invalid username-password pair or user is disabled.";

/// Runs one request and appends its reply to `out`.
pub fn execute(shared: &Shared, session: &mut Session, args: &[&[u8]], out: &mut Vec<u8>) {
    debug_assert!(!args.is_empty());
    let before = out.len();
    let started = Instant::now();
    let spec = lookup(args[0]);
    let op = spec.map(|s| s.op).unwrap_or(Op::Other);
    {
        let protocol = session.protocol;
        let mut ctx = Ctx {
            shared,
            session,
            enc: ReplyEncoder::new(out, protocol),
        };
        let in_multi = ctx.session.multi.is_some();
        match spec {
            None if in_multi => {
                ctx.session.multi_failed = true;
                ctx.enc.error(&unknown_command(args))
            }
            None => ctx.enc.error(&unknown_command(args)),
            Some(spec) if in_multi && !arity_ok(spec.arity, args.len()) => {
                ctx.session.multi_failed = true;
                ctx.enc.error(&format!(
                    "ERR wrong number of arguments for '{}' command",
                    spec.name
                ))
            }
            Some(spec) if !arity_ok(spec.arity, args.len()) => ctx.enc.error(&format!(
                "ERR wrong number of arguments for '{}' command",
                spec.name
            )),
            Some(spec) if !ctx.session.authenticated && !spec.no_auth => ctx.enc.error(ERR_NOAUTH),
            Some(spec)
                if in_multi && !matches!(spec.name, "exec" | "discard" | "multi" | "quit") =>
            {
                if let Some(queue) = ctx.session.multi.as_mut() {
                    queue.push(args.iter().map(|a| a.to_vec()).collect());
                }
                ctx.enc.simple("QUEUED")
            }
            Some(spec) => (spec.handler)(&mut ctx, args),
        }
    }
    shared.metrics.record(op, started.elapsed());
    if out.get(before) == Some(&b'-') {
        Metrics::add(&shared.metrics.errors, 1);
    }
}

fn arity_ok(arity: i32, argc: usize) -> bool {
    if arity >= 0 {
        argc == arity as usize
    } else {
        argc >= arity.unsigned_abs() as usize
    }
}

/// Redis's form: `unknown command 'foo', with args beginning with: 'a' 'b' `.
fn unknown_command(args: &[&[u8]]) -> String {
    let mut tail = String::new();
    for arg in &args[1..] {
        if tail.len() >= 128 {
            break;
        }
        let room = 128 - tail.len();
        let text = String::from_utf8_lossy(arg);
        let cut: String = text.chars().take(room).collect();
        tail.push_str(&format!("'{cut}' "));
    }
    let name: String = String::from_utf8_lossy(args[0]).chars().take(128).collect();
    format!("ERR unknown command '{name}', with args beginning with: {tail}")
}

fn unknown_subcommand(ctx: &mut Ctx<'_>, command: &str, sub: &[u8]) {
    let sub: String = String::from_utf8_lossy(sub).chars().take(128).collect();
    ctx.enc.error(&format!(
        "ERR unknown subcommand '{sub}'. Try {} HELP.",
        command.to_ascii_uppercase()
    ));
}

fn engine_error(ctx: &mut Ctx<'_>, e: &EngineError) {
    let message = match e {
        EngineError::KeyTooLarge { len, max } => {
            format!("ERR key too large ({len} bytes, limit {max})")
        }
        EngineError::ValueTooLarge { len, max } => {
            format!("ERR value too large ({len} bytes, limit {max})")
        }
        EngineError::OutOfMemory { .. } => {
            "OOM command not allowed when used memory > 'maxmemory'.".to_string()
        }
        EngineError::NotAnInteger => ERR_NOT_INTEGER.to_string(),
        EngineError::IncrementOverflow => ERR_OVERFLOW.to_string(),
        other => format!("ERR {other}"),
    };
    ctx.enc.error(&message);
}

/// Redis's `string2ll`: optional '-', digits, no '+', no spaces, no leading zeros, fits in i64.
pub use ramlog_common::parse_redis_i64 as parse_i64;

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn eq_ignore_case(a: &[u8], b: &str) -> bool {
    a.eq_ignore_ascii_case(b.as_bytes())
}

/// Reads the key, counting a hit or a miss.
fn read(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<Option<Object>, EngineError> {
    let keyspace = &ctx.shared.keyspace;
    let found = keyspace.engine().get(keyspace.tablet_of(key), key)?;
    let counter = if found.is_some() {
        &ctx.shared.metrics.keyspace_hits
    } else {
        &ctx.shared.metrics.keyspace_misses
    };
    counter.fetch_add(1, Ordering::Relaxed);
    Ok(found)
}

fn cmd_get(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let key = args[1];
    let keyspace = &ctx.shared.keyspace;
    let metrics = &ctx.shared.metrics;
    let enc = &mut ctx.enc;
    // Encode straight from the log: no copy of the value into a temporary.
    match keyspace
        .engine()
        .read_with(keyspace.tablet_of(key), key, |value, _, _| enc.bulk(value))
    {
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
struct SetArgs {
    condition: Condition,
    get: bool,
    keep_ttl: bool,
    expire_at_ms: u64,
}

fn parse_set_options(options: &[&[u8]], command: &str) -> Result<SetArgs, String> {
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

fn cmd_set(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
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
    let (key, value) = (args[1], args[2]);
    let keyspace = &ctx.shared.keyspace;
    match keyspace
        .engine()
        .put(keyspace.tablet_of(key), key, value, &opts)
    {
        Ok(outcome) => {
            ctx.session.wrote = true;
            if set.get {
                ctx.enc
                    .bulk_or_null(outcome.old.as_ref().map(|o| o.value.as_slice()));
            } else {
                ctx.enc.ok();
            }
        }
        Err(EngineError::ConditionFailed { current }) => {
            if set.get {
                ctx.enc
                    .bulk_or_null(current.as_ref().map(|o| o.value.as_slice()));
            } else {
                ctx.enc.null();
            }
        }
        Err(e) => engine_error(ctx, &e),
    }
}

fn set_with(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    value: &[u8],
    opts: PutOptions,
) -> Result<bool, EngineError> {
    let keyspace = &ctx.shared.keyspace;
    match keyspace
        .engine()
        .put(keyspace.tablet_of(key), key, value, &opts)
    {
        Ok(_) => {
            ctx.session.wrote = true;
            Ok(true)
        }
        Err(EngineError::ConditionFailed { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

fn cmd_setnx(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let opts = PutOptions {
        condition: Condition::IfAbsent,
        ..Default::default()
    };
    match set_with(ctx, args[1], args[2], opts) {
        Ok(done) => ctx.enc.integer(i64::from(done)),
        Err(e) => engine_error(ctx, &e),
    }
}

fn setex_common(ctx: &mut Ctx<'_>, args: &[&[u8]], unit_ms: i64, name: &str) {
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

fn cmd_setex(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    setex_common(ctx, args, 1000, "setex")
}

fn cmd_psetex(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    setex_common(ctx, args, 1, "psetex")
}

fn cmd_getset(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let keyspace = &ctx.shared.keyspace;
    let opts = PutOptions {
        return_old: true,
        ..Default::default()
    };
    match keyspace
        .engine()
        .put(keyspace.tablet_of(args[1]), args[1], args[2], &opts)
    {
        Ok(outcome) => {
            ctx.session.wrote = true;
            ctx.enc
                .bulk_or_null(outcome.old.as_ref().map(|o| o.value.as_slice()))
        }
        Err(e) => engine_error(ctx, &e),
    }
}

fn cmd_getdel(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let key = args[1];
    let keyspace = &ctx.shared.keyspace;
    let tablet = keyspace.tablet_of(key);
    // Read, then delete only that version: a concurrent writer makes us retry.
    for _ in 0..64 {
        let found = match keyspace.engine().get(tablet, key) {
            Ok(f) => f,
            Err(e) => return engine_error(ctx, &e),
        };
        let Some(object) = found else {
            return ctx.enc.null();
        };
        match keyspace
            .engine()
            .delete(tablet, key, Condition::IfVersion(object.version))
        {
            Ok(Some(_)) => {
                ctx.session.wrote = true;
                return ctx.enc.bulk(&object.value);
            }
            Ok(None) | Err(EngineError::ConditionFailed { .. }) => continue,
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc
        .error("ERR too much contention on the key, try again")
}

fn cmd_append(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (key, suffix) = (args[1], args[2]);
    let keyspace = &ctx.shared.keyspace;
    let tablet = keyspace.tablet_of(key);
    for _ in 0..64 {
        let found = match keyspace.engine().get(tablet, key) {
            Ok(f) => f,
            Err(e) => return engine_error(ctx, &e),
        };
        let (mut value, condition) = match found {
            Some(o) => (o.value, Condition::IfVersion(o.version)),
            None => (Vec::new(), Condition::IfAbsent),
        };
        value.extend_from_slice(suffix);
        let opts = PutOptions {
            condition,
            keep_ttl: true,
            ..Default::default()
        };
        match keyspace.engine().put(tablet, key, &value, &opts) {
            Ok(_) => {
                ctx.session.wrote = true;
                return ctx.enc.integer(value.len() as i64);
            }
            Err(EngineError::ConditionFailed { .. }) => continue,
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc
        .error("ERR too much contention on the key, try again")
}

fn cmd_mget(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let keys = &args[1..];
    let mut values = Vec::with_capacity(keys.len());
    for key in keys {
        match read(ctx, key) {
            Ok(found) => values.push(found),
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc.array(values.len());
    for v in &values {
        ctx.enc.bulk_or_null(v.as_ref().map(|o| o.value.as_slice()));
    }
}

fn cmd_mset(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if args.len().is_multiple_of(2) {
        return ctx
            .enc
            .error("ERR wrong number of arguments for 'mset' command");
    }
    let config = &ctx.shared.config;
    // Refuse oversized items before writing anything, so that MSET is never half applied for that reason.
    for pair in args[1..].chunks_exact(2) {
        if pair[0].len() as u64 > config.key_size_max_bytes {
            return engine_error(
                ctx,
                &EngineError::KeyTooLarge {
                    len: pair[0].len(),
                    max: config.key_size_max_bytes as usize,
                },
            );
        }
        if pair[1].len() as u64 > config.value_size_max_bytes {
            return engine_error(
                ctx,
                &EngineError::ValueTooLarge {
                    len: pair[1].len(),
                    max: config.value_size_max_bytes as usize,
                },
            );
        }
    }
    let keyspace = &ctx.shared.keyspace;
    // Group by tablet: each group is one atomic multi-put. Redis keeps the last of repeated keys;
    // so does a multi-put applied in order.
    type Items<'a> = Vec<(&'a [u8], &'a [u8])>;
    let mut groups: Vec<(u32, Items<'_>)> = Vec::new();
    for pair in args[1..].chunks_exact(2) {
        let tablet = keyspace.tablet_of(pair[0]);
        match groups.iter_mut().find(|g| g.0 == tablet) {
            Some(g) => g.1.push((pair[0], pair[1])),
            None => groups.push((tablet, vec![(pair[0], pair[1])])),
        }
    }
    for (tablet, items) in &groups {
        if let Err(e) = keyspace.engine().multi_put(*tablet, items) {
            return engine_error(ctx, &e);
        }
    }
    ctx.session.wrote = true;
    ctx.enc.ok();
}

fn cmd_del(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let keyspace = &ctx.shared.keyspace;
    let mut deleted = 0;
    for key in &args[1..] {
        match keyspace
            .engine()
            .delete(keyspace.tablet_of(key), key, Condition::None)
        {
            Ok(Some(_)) => deleted += 1,
            Ok(None) => {}
            Err(e) => return engine_error(ctx, &e),
        }
    }
    if deleted > 0 {
        ctx.session.wrote = true;
    }
    ctx.enc.integer(deleted);
}

fn cmd_exists(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let keyspace = &ctx.shared.keyspace;
    let mut found = 0;
    for key in &args[1..] {
        match keyspace.engine().get(keyspace.tablet_of(key), key) {
            Ok(Some(_)) => found += 1,
            Ok(None) => {}
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc.integer(found);
}

fn cmd_type(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let keyspace = &ctx.shared.keyspace;
    match keyspace.engine().get(keyspace.tablet_of(args[1]), args[1]) {
        Ok(Some(_)) => ctx.enc.simple("string"),
        Ok(None) => ctx.enc.simple("none"),
        Err(e) => engine_error(ctx, &e),
    }
}

fn incr_by(ctx: &mut Ctx<'_>, key: &[u8], delta: i64) {
    let keyspace = &ctx.shared.keyspace;
    match keyspace
        .engine()
        .increment(keyspace.tablet_of(key), key, delta)
    {
        Ok((value, _)) => {
            ctx.session.wrote = true;
            ctx.enc.integer(value)
        }
        Err(e) => engine_error(ctx, &e),
    }
}

fn cmd_incr(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    incr_by(ctx, args[1], 1)
}

fn cmd_decr(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    incr_by(ctx, args[1], -1)
}

fn cmd_incrby(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match parse_i64(args[2]) {
        Some(d) => incr_by(ctx, args[1], d),
        None => ctx.enc.error(ERR_NOT_INTEGER),
    }
}

fn cmd_decrby(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match parse_i64(args[2]) {
        Some(i64::MIN) => ctx.enc.error("ERR decrement would overflow"),
        Some(d) => incr_by(ctx, args[1], -d),
        None => ctx.enc.error(ERR_NOT_INTEGER),
    }
}

fn cmd_strlen(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match read(ctx, args[1]) {
        Ok(found) => ctx
            .enc
            .integer(found.map(|o| o.value.len() as i64).unwrap_or(0)),
        Err(e) => engine_error(ctx, &e),
    }
}

/// GETRANGE key start end, with Redis's index rules (negative counts from the end, clamped).
fn cmd_getrange(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (Some(mut start), Some(mut end)) = (parse_i64(args[2]), parse_i64(args[3])) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    let value = match read(ctx, args[1]) {
        Ok(found) => found.map(|o| o.value).unwrap_or_default(),
        Err(e) => return engine_error(ctx, &e),
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
fn cmd_getex(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
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
    if let Some(at) = expire_at {
        let keyspace = &ctx.shared.keyspace;
        let tablet = keyspace.tablet_of(key);
        let result = if at != 0 && at <= now_ms() {
            keyspace
                .engine()
                .delete(tablet, key, Condition::IfVersion(object.version))
        } else if at == 0 && object.expire_at_ms == 0 {
            Ok(None) // PERSIST on a key without expiry: nothing to write
        } else {
            keyspace.engine().set_expiry(tablet, key, at)
        };
        match result {
            Ok(Some(_)) => ctx.session.wrote = true,
            Ok(None) | Err(EngineError::ConditionFailed { .. }) => {}
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc.bulk(&object.value);
}

/// SCAN cursor [MATCH pattern] [COUNT count] [TYPE type]
fn cmd_scan(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let cursor = match std::str::from_utf8(args[1])
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        Some(c) => c,
        None => return ctx.enc.error("ERR invalid cursor"),
    };
    let mut count: usize = 10;
    let mut pattern: Option<&[u8]> = None;
    let mut type_matches = true;
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
            type_matches = eq_ignore_case(value, "string");
        } else {
            return ctx.enc.error(ERR_SYNTAX);
        }
        i += 2;
    }
    let mut keys = Vec::new();
    let next = match ctx.shared.keyspace.scan(cursor, count, pattern, &mut keys) {
        Ok(Some(next)) => next,
        Ok(None) => 0, // a cursor we never handed out: Redis answers an empty last page
        Err(e) => return engine_error(ctx, &e),
    };
    if !type_matches {
        keys.clear();
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

fn cmd_keys(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let pattern = if args[1] == b"*" { None } else { Some(args[1]) };
    let mut keys = Vec::new();
    let mut cursor = 0;
    loop {
        match ctx.shared.keyspace.scan(cursor, 1024, pattern, &mut keys) {
            Ok(Some(0)) | Ok(None) => break,
            Ok(Some(next)) => cursor = next,
            Err(e) => return engine_error(ctx, &e),
        }
    }
    keys.sort();
    keys.dedup();
    ctx.enc.array(keys.len());
    for key in &keys {
        ctx.enc.bulk(key);
    }
}

fn cmd_dbsize(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    let n = ctx.shared.keyspace.engine().object_count();
    ctx.enc.integer(n as i64);
}

/// Remaining time to live: -2 no key, -1 no expiry.
fn ttl_common(ctx: &mut Ctx<'_>, key: &[u8], unit_ms: u64, absolute: bool) {
    let keyspace = &ctx.shared.keyspace;
    match keyspace.engine().get(keyspace.tablet_of(key), key) {
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

fn cmd_ttl(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    ttl_common(ctx, args[1], 1000, false)
}

fn cmd_pttl(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    ttl_common(ctx, args[1], 1, false)
}

fn cmd_expiretime(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    ttl_common(ctx, args[1], 1000, true)
}

fn cmd_pexpiretime(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    ttl_common(ctx, args[1], 1, true)
}

/// EXPIRE family: `unit_ms` scales the number, `absolute` says it is a unix time.
fn expire_common(ctx: &mut Ctx<'_>, args: &[&[u8]], unit_ms: i64, absolute: bool, name: &str) {
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
    let keyspace = &ctx.shared.keyspace;
    let tablet = keyspace.tablet_of(key);
    for _ in 0..64 {
        let object = match keyspace.engine().get(tablet, key) {
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
            return match keyspace
                .engine()
                .delete(tablet, key, Condition::IfVersion(object.version))
            {
                Ok(Some(_)) => {
                    ctx.session.wrote = true;
                    ctx.enc.integer(1)
                }
                Ok(None) | Err(EngineError::ConditionFailed { .. }) => continue,
                Err(e) => engine_error(ctx, &e),
            };
        }
        return match keyspace.engine().set_expiry(tablet, key, at as u64) {
            Ok(Some(_)) => {
                ctx.session.wrote = true;
                ctx.enc.integer(1)
            }
            Ok(None) => ctx.enc.integer(0),
            Err(e) => engine_error(ctx, &e),
        };
    }
    ctx.enc
        .error("ERR too much contention on the key, try again")
}

fn cmd_expire(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    expire_common(ctx, args, 1000, false, "expire")
}

fn cmd_pexpire(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    expire_common(ctx, args, 1, false, "pexpire")
}

fn cmd_expireat(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    expire_common(ctx, args, 1000, true, "expireat")
}

fn cmd_pexpireat(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    expire_common(ctx, args, 1, true, "pexpireat")
}

fn cmd_persist(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let key = args[1];
    let keyspace = &ctx.shared.keyspace;
    let tablet = keyspace.tablet_of(key);
    match keyspace.engine().get(tablet, key) {
        Ok(Some(o)) if o.expire_at_ms != 0 => match keyspace.engine().set_expiry(tablet, key, 0) {
            Ok(Some(_)) => {
                ctx.session.wrote = true;
                ctx.enc.integer(1)
            }
            Ok(None) => ctx.enc.integer(0),
            Err(e) => engine_error(ctx, &e),
        },
        Ok(_) => ctx.enc.integer(0),
        Err(e) => engine_error(ctx, &e),
    }
}

fn cmd_flushall(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if args.len() > 2
        || (args.len() == 2
            && !eq_ignore_case(args[1], "sync")
            && !eq_ignore_case(args[1], "async"))
    {
        return ctx.enc.error(ERR_SYNTAX);
    }
    let keyspace = &ctx.shared.keyspace;
    let mut keys = Vec::new();
    for &tablet in keyspace.tablets() {
        let mut cursor = 0;
        loop {
            keys.clear();
            let next = match keyspace.engine().scan_keys(tablet, cursor, 1024, &mut keys) {
                Ok(n) => n,
                Err(e) => return engine_error(ctx, &e),
            };
            for key in &keys {
                if let Err(e) = keyspace.engine().delete(tablet, key, Condition::None) {
                    return engine_error(ctx, &e);
                }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    ctx.session.wrote = true;
    ctx.enc.ok();
}

fn cmd_ping(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match args.len() {
        1 => ctx.enc.simple("PONG"),
        2 => ctx.enc.bulk(args[1]),
        _ => ctx
            .enc
            .error("ERR wrong number of arguments for 'ping' command"),
    }
}

fn cmd_echo(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    ctx.enc.bulk(args[1])
}

fn cmd_ok(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    ctx.enc.ok()
}

fn cmd_select(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match parse_i64(args[1]) {
        None => ctx.enc.error(ERR_NOT_INTEGER),
        Some(0) => ctx.enc.ok(),
        Some(_) => ctx.enc.error("ERR DB index is out of range"),
    }
}

fn cmd_quit(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    ctx.session.closing = true;
    ctx.enc.ok()
}

/// MULTI: queue the following commands until EXEC. EXEC runs them back to back on this connection
/// and answers an array of their replies. Each command is atomic on its own; the batch is not
/// isolated from other connections' writes (there is no WATCH), so it is a pipeline with Redis's
/// transaction framing, which is what clients such as redis-py use for their default pipelines.
fn cmd_multi(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    if ctx.session.multi.is_some() {
        return ctx.enc.error("ERR MULTI calls can not be nested");
    }
    ctx.session.multi = Some(Vec::new());
    ctx.session.multi_failed = false;
    ctx.enc.ok()
}

fn cmd_exec(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    let Some(queue) = ctx.session.multi.take() else {
        return ctx.enc.error("ERR EXEC without MULTI");
    };
    if std::mem::take(&mut ctx.session.multi_failed) {
        return ctx
            .enc
            .error("EXECABORT Transaction discarded because of previous errors.");
    }
    ctx.enc.array(queue.len());
    let out = ctx.enc.buffer();
    for command in &queue {
        let args: Vec<&[u8]> = command.iter().map(|a| a.as_slice()).collect();
        execute(ctx.shared, ctx.session, &args, out);
    }
}

fn cmd_discard(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    if ctx.session.multi.take().is_none() {
        return ctx.enc.error("ERR DISCARD without MULTI");
    }
    ctx.session.multi_failed = false;
    ctx.enc.ok()
}

/// SHUTDOWN [NOSAVE|SAVE] [NOW] [FORCE]: stops the server as Ctrl-C does (persistence is flushed
/// either way). As in Redis, a successful SHUTDOWN closes the connection without a reply.
fn cmd_shutdown(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    for a in &args[1..] {
        let known = ["nosave", "save", "now", "force"]
            .iter()
            .any(|o| eq_ignore_case(a, o));
        if !known {
            return ctx.enc.error(ERR_SYNTAX);
        }
    }
    ctx.shared.request_shutdown();
    ctx.session.closing = true;
}

fn cmd_time(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    ctx.enc.array(2);
    ctx.enc.bulk(now.as_secs().to_string().as_bytes());
    ctx.enc.bulk(now.subsec_micros().to_string().as_bytes());
}

fn cmd_lastsave(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    let started = std::time::SystemTime::now() - ctx.shared.started.elapsed();
    let secs = started
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    ctx.enc.integer(secs as i64)
}

/// Checks a username/password pair against the configured password (user `default` only).
fn credentials_ok(shared: &Shared, user: &[u8], pass: &[u8]) -> bool {
    if user != b"default" {
        return false;
    }
    match &shared.config.password {
        None => true,
        Some(p) => constant_time_eq(p.as_bytes(), pass),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn cmd_auth(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (user, pass) = match args.len() {
        2 => (&b"default"[..], args[1]),
        3 => (args[1], args[2]),
        _ => return ctx.enc.error(ERR_SYNTAX),
    };
    if args.len() == 2 && ctx.shared.config.password.is_none() {
        return ctx.enc.error("ERR AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?");
    }
    if credentials_ok(ctx.shared, user, pass) {
        ctx.session.authenticated = true;
        ctx.enc.ok()
    } else {
        ctx.enc.error(ERR_WRONGPASS)
    }
}

/// HELLO [protover [AUTH username password] [SETNAME clientname]]
fn cmd_hello(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let mut protocol = ctx.session.protocol;
    let mut i = 1;
    if args.len() >= 2 {
        match parse_i64(args[1]) {
            None => {
                return ctx
                    .enc
                    .error("ERR Protocol version is not an integer or out of range")
            }
            Some(v) if !(2..=3).contains(&v) => {
                return ctx.enc.error("NOPROTO unsupported protocol version")
            }
            Some(v) => protocol = v as u8,
        }
        i = 2;
    }
    let mut auth: Option<(&[u8], &[u8])> = None;
    let mut name: Option<&[u8]> = None;
    while i < args.len() {
        let more = args.len() - i - 1;
        if eq_ignore_case(args[i], "auth") && more >= 2 {
            auth = Some((args[i + 1], args[i + 2]));
            i += 3;
        } else if eq_ignore_case(args[i], "setname") && more >= 1 {
            name = Some(args[i + 1]);
            i += 2;
        } else {
            let o = String::from_utf8_lossy(args[i]);
            return ctx
                .enc
                .error(&format!("ERR Syntax error in HELLO option '{o}'"));
        }
    }
    if let Some((user, pass)) = auth {
        if !credentials_ok(ctx.shared, user, pass) {
            return ctx.enc.error(ERR_WRONGPASS);
        }
        ctx.session.authenticated = true;
    }
    if !ctx.session.authenticated {
        return ctx.enc.error("NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and select the RESP protocol version at the same time");
    }
    if let Some(n) = name {
        if !valid_client_name(n) {
            return ctx
                .enc
                .error("ERR Client names cannot contain spaces, newlines or special characters.");
        }
        ctx.session.name = if n.is_empty() { None } else { Some(n.to_vec()) };
    }
    ctx.session.protocol = protocol;
    ctx.enc.set_protocol(protocol);
    let enc = &mut ctx.enc;
    enc.map(7);
    enc.bulk(b"server");
    enc.bulk(b"redis");
    enc.bulk(b"version");
    enc.bulk(b"7.2.0");
    enc.bulk(b"proto");
    enc.integer(i64::from(protocol));
    enc.bulk(b"id");
    enc.integer(ctx.session.id as i64);
    enc.bulk(b"mode");
    enc.bulk(b"standalone");
    enc.bulk(b"role");
    enc.bulk(b"master");
    enc.bulk(b"modules");
    enc.array(0);
}

fn valid_client_name(name: &[u8]) -> bool {
    name.iter().all(|&c| (b'!'..=b'~').contains(&c))
}

fn cmd_info(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let section = args.get(1).map(|s| String::from_utf8_lossy(s).into_owned());
    let text = ctx.shared.snapshot().info(section.as_deref());
    ctx.enc.verbatim("txt", text.as_bytes());
}

/// The parameters CONFIG GET knows, with their current values.
fn config_params(shared: &Shared) -> Vec<(&'static str, String)> {
    use crate::config::PersistenceMode;
    let c = &shared.config;
    vec![
        ("bind", c.bind.to_string()),
        ("port", shared.resp_port().to_string()),
        ("databases", "1".into()),
        ("maxmemory", c.memory_bytes.to_string()),
        ("maxmemory-policy", "noeviction".into()),
        ("maxclients", c.connections_max.to_string()),
        ("timeout", c.idle_timeout_secs.to_string()),
        (
            "proto-max-bulk-len",
            c.request_arg_size_max_bytes.to_string(),
        ),
        ("save", String::new()),
        (
            "appendonly",
            if c.persistence == PersistenceMode::Off {
                "no"
            } else {
                "yes"
            }
            .into(),
        ),
        (
            "appendfsync",
            match c.persistence {
                PersistenceMode::Off => "no",
                PersistenceMode::Async => "everysec",
                PersistenceMode::Durable => "always",
            }
            .into(),
        ),
        ("cluster-enabled", "no".into()),
        ("dir", c.data_dir.display().to_string()),
    ]
}

fn cmd_config(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1];
    if eq_ignore_case(sub, "get") {
        if args.len() < 3 {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'config|get' command");
        }
        let params = config_params(ctx.shared);
        let matched: Vec<&(&str, String)> = params
            .iter()
            .filter(|(name, _)| {
                args[2..]
                    .iter()
                    .any(|p| glob_match_nocase(p, name.as_bytes()))
            })
            .collect();
        ctx.enc.map(matched.len());
        for (name, value) in matched {
            ctx.enc.bulk(name.as_bytes());
            ctx.enc.bulk(value.as_bytes());
        }
    } else if eq_ignore_case(sub, "set") {
        if args.len() < 4 || !args.len().is_multiple_of(2) {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'config|set' command");
        }
        let name = String::from_utf8_lossy(args[2]);
        ctx.enc.error(&format!(
            "ERR Unknown option or number of arguments for CONFIG SET - '{name}' (ramlog is configured by file, flags and environment at start)"
        ));
    } else if eq_ignore_case(sub, "resetstat") {
        ctx.enc.ok();
    } else if eq_ignore_case(sub, "help") {
        let lines = [
            "CONFIG <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "GET <pattern>",
            "    Return parameters matching the glob-like <pattern> and their values.",
        ];
        ctx.enc.array(lines.len());
        for l in lines {
            ctx.enc.simple(l);
        }
    } else {
        unknown_subcommand(ctx, "config", sub);
    }
}

fn command_info(enc: &mut ReplyEncoder<'_>, spec: &Spec) {
    enc.array(10);
    enc.bulk(spec.name.as_bytes());
    enc.integer(i64::from(spec.arity));
    enc.set(spec.flags.len());
    for f in spec.flags {
        enc.simple(f);
    }
    enc.integer(i64::from(spec.first_key));
    enc.integer(i64::from(spec.last_key));
    enc.integer(i64::from(spec.step));
    enc.set(spec.categories.len());
    for c in spec.categories {
        enc.simple(c);
    }
    enc.set(0); // tips
    enc.array(0); // key specs
    enc.array(0); // subcommands
}

fn cmd_command(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let specs = specs();
    if args.len() == 1 {
        ctx.enc.array(specs.len());
        for spec in specs {
            command_info(&mut ctx.enc, spec);
        }
        return;
    }
    let sub = args[1];
    if eq_ignore_case(sub, "count") {
        ctx.enc.integer(specs.len() as i64);
    } else if eq_ignore_case(sub, "info") {
        let names: Vec<&[u8]> = if args.len() == 2 {
            specs.iter().map(|s| s.name.as_bytes()).collect()
        } else {
            args[2..].to_vec()
        };
        ctx.enc.array(names.len());
        for name in names {
            match lookup(name) {
                Some(spec) => command_info(&mut ctx.enc, spec),
                None => ctx.enc.null_array(),
            }
        }
    } else if eq_ignore_case(sub, "docs") {
        // No documentation is served; clients treat an empty map as "no hints".
        ctx.enc.map(0);
    } else if eq_ignore_case(sub, "list") {
        ctx.enc.array(specs.len());
        for spec in specs {
            ctx.enc.bulk(spec.name.as_bytes());
        }
    } else if eq_ignore_case(sub, "getkeys") {
        if args.len() < 3 {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'command|getkeys' command");
        }
        let Some(spec) = lookup(args[2]) else {
            return ctx.enc.error("ERR Invalid command specified");
        };
        let cmd = &args[2..];
        if spec.first_key <= 0 || !arity_ok(spec.arity, cmd.len()) {
            return ctx.enc.error("ERR The command has no key arguments");
        }
        let last = if spec.last_key < 0 {
            cmd.len() as i32 + spec.last_key
        } else {
            spec.last_key
        };
        let keys: Vec<&[u8]> = (spec.first_key..=last)
            .step_by(spec.step.max(1) as usize)
            .filter_map(|i| cmd.get(i as usize).copied())
            .collect();
        ctx.enc.array(keys.len());
        for k in keys {
            ctx.enc.bulk(k);
        }
    } else {
        unknown_subcommand(ctx, "command", sub);
    }
}

fn client_info_line(shared: &Shared, session: &Session) -> String {
    let name = session
        .name
        .as_deref()
        .map(String::from_utf8_lossy)
        .unwrap_or_default();
    let lib_name = session
        .lib_name
        .as_deref()
        .map(String::from_utf8_lossy)
        .unwrap_or_default();
    let lib_ver = session
        .lib_ver
        .as_deref()
        .map(String::from_utf8_lossy)
        .unwrap_or_default();
    let _ = shared;
    format!(
        "id={} name={} db=0 resp={} lib-name={} lib-ver={}\n",
        session.id, name, session.protocol, lib_name, lib_ver
    )
}

fn cmd_client(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1];
    if eq_ignore_case(sub, "setname") {
        if args.len() != 3 {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'client|setname' command");
        }
        if !valid_client_name(args[2]) {
            return ctx
                .enc
                .error("ERR Client names cannot contain spaces, newlines or special characters.");
        }
        ctx.session.name = if args[2].is_empty() {
            None
        } else {
            Some(args[2].to_vec())
        };
        ctx.enc.ok();
    } else if eq_ignore_case(sub, "getname") {
        let name = ctx.session.name.clone();
        ctx.enc.bulk_or_null(name.as_deref());
    } else if eq_ignore_case(sub, "id") {
        ctx.enc.integer(ctx.session.id as i64);
    } else if eq_ignore_case(sub, "setinfo") {
        if args.len() != 4 {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'client|setinfo' command");
        }
        let attr = args[2];
        let is_name = eq_ignore_case(attr, "lib-name");
        if !is_name && !eq_ignore_case(attr, "lib-ver") {
            let a = String::from_utf8_lossy(attr);
            return ctx.enc.error(&format!("ERR Unrecognized option '{a}'"));
        }
        if !valid_client_name(args[3]) {
            let a = String::from_utf8_lossy(attr).to_ascii_lowercase();
            return ctx.enc.error(&format!(
                "ERR {a} cannot contain spaces, newlines or special characters."
            ));
        }
        let value = Some(args[3].to_vec());
        if is_name {
            ctx.session.lib_name = value;
        } else {
            ctx.session.lib_ver = value;
        }
        ctx.enc.ok();
    } else if eq_ignore_case(sub, "info") {
        let line = client_info_line(ctx.shared, ctx.session);
        ctx.enc.verbatim("txt", line.as_bytes());
    } else if eq_ignore_case(sub, "no-evict") || eq_ignore_case(sub, "no-touch") {
        ctx.enc.ok();
    } else if eq_ignore_case(sub, "help") {
        let lines = [
            "CLIENT <subcommand> [<arg> ...]. Subcommands are:",
            "ID",
            "GETNAME",
            "SETNAME <name>",
            "SETINFO <LIB-NAME|LIB-VER> <value>",
            "INFO",
        ];
        ctx.enc.array(lines.len());
        for l in lines {
            ctx.enc.simple(l);
        }
    } else {
        unknown_subcommand(ctx, "client", sub);
    }
}

fn cmd_cluster(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1];
    if eq_ignore_case(sub, "keyslot") {
        if args.len() != 3 {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'cluster|keyslot' command");
        }
        return ctx.enc.integer(i64::from(key_slot(args[2])));
    }
    let id = ctx.shared.node_id();
    let host = ctx.shared.config.bind.to_string();
    let port = ctx.shared.resp_port();
    if eq_ignore_case(sub, "myid") {
        ctx.enc.bulk(id.as_bytes());
    } else if eq_ignore_case(sub, "slots") {
        // One node owns every slot.
        ctx.enc.array(1);
        ctx.enc.array(3);
        ctx.enc.integer(0);
        ctx.enc.integer(i64::from(SLOT_COUNT - 1));
        ctx.enc.array(3);
        ctx.enc.bulk(host.as_bytes());
        ctx.enc.integer(i64::from(port));
        ctx.enc.bulk(id.as_bytes());
    } else if eq_ignore_case(sub, "shards") {
        ctx.enc.array(1);
        ctx.enc.map(2);
        ctx.enc.bulk(b"slots");
        ctx.enc.array(2);
        ctx.enc.integer(0);
        ctx.enc.integer(i64::from(SLOT_COUNT - 1));
        ctx.enc.bulk(b"nodes");
        ctx.enc.array(1);
        ctx.enc.map(7);
        ctx.enc.bulk(b"id");
        ctx.enc.bulk(id.as_bytes());
        ctx.enc.bulk(b"port");
        ctx.enc.integer(i64::from(port));
        ctx.enc.bulk(b"ip");
        ctx.enc.bulk(host.as_bytes());
        ctx.enc.bulk(b"endpoint");
        ctx.enc.bulk(host.as_bytes());
        ctx.enc.bulk(b"role");
        ctx.enc.bulk(b"master");
        ctx.enc.bulk(b"replication-offset");
        ctx.enc.integer(0);
        ctx.enc.bulk(b"health");
        ctx.enc.bulk(b"online");
    } else if eq_ignore_case(sub, "nodes") {
        let line = format!(
            "{id} {host}:{port}@0 myself,master - 0 0 1 connected 0-{}\n",
            SLOT_COUNT - 1
        );
        ctx.enc.verbatim("txt", line.as_bytes());
    } else if eq_ignore_case(sub, "info") {
        let text = "cluster_enabled:0\r\ncluster_state:ok\r\ncluster_slots_assigned:16384\r\ncluster_slots_ok:16384\r\ncluster_slots_pfail:0\r\ncluster_slots_fail:0\r\ncluster_known_nodes:1\r\ncluster_size:1\r\ncluster_current_epoch:1\r\ncluster_my_epoch:1\r\n";
        ctx.enc.verbatim("txt", text.as_bytes());
    } else {
        unknown_subcommand(ctx, "cluster", sub);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_i64_is_strict_like_redis() {
        assert_eq!(parse_i64(b"0"), Some(0));
        assert_eq!(parse_i64(b"-12"), Some(-12));
        assert_eq!(parse_i64(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(parse_i64(b"-9223372036854775808"), Some(i64::MIN));
        for bad in [
            &b"9223372036854775808"[..],
            b"+1",
            b" 1",
            b"01",
            b"-0",
            b"1.0",
            b"",
            b"-",
            b"abc",
        ] {
            assert_eq!(parse_i64(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn unknown_command_message_matches_redis() {
        assert_eq!(
            unknown_command(&[b"foo"]),
            "ERR unknown command 'foo', with args beginning with: "
        );
        assert_eq!(
            unknown_command(&[b"foo", b"a", b"b"]),
            "ERR unknown command 'foo', with args beginning with: 'a' 'b' "
        );
    }

    #[test]
    fn arity_rules() {
        assert!(arity_ok(2, 2) && !arity_ok(2, 3));
        assert!(arity_ok(-3, 3) && arity_ok(-3, 9) && !arity_ok(-3, 2));
    }

    #[test]
    fn set_option_conflicts() {
        let parse = |opts: &[&[u8]]| parse_set_options(opts, "set");
        assert!(parse(&[b"NX", b"GET"]).is_ok());
        assert_eq!(parse(&[b"NX", b"XX"]).err().as_deref(), Some(ERR_SYNTAX));
        assert_eq!(
            parse(&[b"EX", b"10", b"PX", b"5"]).err().as_deref(),
            Some(ERR_SYNTAX)
        );
        assert_eq!(
            parse(&[b"KEEPTTL", b"EX", b"5"]).err().as_deref(),
            Some(ERR_SYNTAX)
        );
        assert_eq!(parse(&[b"EX"]).err().as_deref(), Some(ERR_SYNTAX));
        assert_eq!(
            parse(&[b"EX", b"x"]).err().as_deref(),
            Some(ERR_NOT_INTEGER)
        );
        assert_eq!(
            parse(&[b"EX", b"0"]).err().as_deref(),
            Some("ERR invalid expire time in 'set' command")
        );
        assert_eq!(
            parse(&[b"EX", b"9223372036854775807"]).err().as_deref(),
            Some("ERR invalid expire time in 'set' command")
        );
        let ok = parse(&[b"px", b"1500", b"xx"]).unwrap();
        assert!(matches!(ok.condition, Condition::IfExists));
        assert!(ok.expire_at_ms > now_ms());
        assert_eq!(parse(&[b"pxat", b"123"]).unwrap().expire_at_ms, 123);
    }

    #[test]
    fn every_spec_is_found_case_insensitively() {
        for spec in specs() {
            assert!(lookup(spec.name.as_bytes()).is_some());
            assert!(lookup(spec.name.to_ascii_uppercase().as_bytes()).is_some());
        }
        assert!(lookup(b"nosuchcommand").is_none());
        assert!(lookup(&[b'x'; 100]).is_none());
    }
}
