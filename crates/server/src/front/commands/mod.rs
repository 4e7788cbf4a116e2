//! RESP commands: the table of supported commands and their Redis 7 semantics on top of the engine.
//!
//! [`execute`] takes one decoded request and appends its reply. It checks, in Redis's order, that
//! the command exists, that its arity fits, that the client is authenticated, and (for a write
//! command) that the node accepts writes; then the command's handler runs against the service
//! layer ([`Node`]; no lock of the server's own). Replies, error strings and types follow Redis 7
//! so that clients and their tests cannot tell the difference.
//!
//! The handlers are split by command family, as Redis splits its sources: [`strings`]
//! (`t_string.c`), [`keys`] (keyspace and expiry: `db.c`, `expire.c`), [`connection`] and
//! [`admin`]. This module holds the command table, the dispatch and what the families share.

use crate::node::keyspace::glob_match_nocase;
use crate::node::metrics::{Metrics, Op};
use crate::node::{now_ms, Node, NodeError};
use ramlog_common::{key_slot, SLOT_COUNT};
use ramlog_logmem::{Condition, EngineError, Object, PutOptions};
use ramlog_proto::resp::{Reply as RespReply, ReplyEncoder};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::LazyLock;
use std::time::Instant;

mod admin;
mod bitfield;
mod connection;
mod dump;
mod hashes;
mod keys;
mod large_list;
mod large_table;
mod large_zset;
mod lists;
mod lua_libs;
pub(crate) mod notify;
pub(crate) mod pubsub;
pub(crate) mod scripting;
mod sets;
mod sort;
pub(crate) mod stream_groups;
pub(crate) mod streams;
mod strings;
pub(crate) mod typed;
mod zsets;

use admin::*;
use connection::*;
use hashes::*;
use keys::*;
pub(crate) use large_list::start_sweeper;
pub(crate) use lists::parse_timeout;
use lists::*;
use pubsub::{
    cmd_psubscribe, cmd_publish, cmd_pubsub, cmd_punsubscribe, cmd_ramlog_keyevent, cmd_spublish,
    cmd_ssubscribe, cmd_subscribe, cmd_sunsubscribe, cmd_unsubscribe,
};
use scripting::{cmd_eval, cmd_evalsha, cmd_script};
use sets::*;
use stream_groups::{
    cmd_xack, cmd_xautoclaim, cmd_xclaim, cmd_xgroup, cmd_xinfo, cmd_xpending, cmd_xreadgroup,
    cmd_xsetid,
};
use streams::{cmd_xadd, cmd_xdel, cmd_xlen, cmd_xrange, cmd_xread, cmd_xrevrange, cmd_xtrim};
use strings::*;
use typed::cmd_type;
use zsets::*;

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
    /// Replies to write commands in the connection's reply buffer that are not written out yet,
    /// as byte ranges with the replication units of their writes: they wait for
    /// [`Node::acknowledge`] and are replaced by `-MISCONF` errors if it fails, or by an error
    /// of their own if a backup refused one of their writes (inside an EXEC reply too: an array
    /// element may be an error).
    pub write_replies: Vec<crate::node::HeldReply>,
    /// What this connection's replies wait for (the replication of its writes on a cluster
    /// server): the node's data calls add to it, [`Node::acknowledge`] waits for it.
    pub acks: crate::node::Acks,
    /// A cluster server's roles (None when standalone): where keys live.
    pub cluster: Option<std::sync::Arc<crate::cluster::Roles>>,
    /// Commands queued since MULTI (None outside a transaction).
    pub multi: Option<Vec<Vec<Vec<u8>>>>,
    /// A command queued after MULTI was refused: EXEC will discard the transaction.
    pub multi_failed: bool,
    /// The connection reaches the whole key space through this server (the routing port, or
    /// commands a routing port forwarded here): no `-MOVED`/`-CROSSSLOT` checks, and CLUSTER
    /// answers describe one server that holds every slot.
    pub routed: bool,
    /// Commands a routing port forwarded here: keys may span slots (the router split them by
    /// server), but each must be served here; one that is not (the router's map was newer or
    /// older than this server's) gets `-TRYAGAIN`.
    pub forwarded: bool,
    /// A script's `redis.call` is running this session's commands (a subscribed connection's
    /// limits are the client's, not its script's, as in Redis).
    pub scripting: bool,
    /// Forwarded commands: the slots a command of this batch was refused for (`-TRYAGAIN`, or
    /// `-CLUSTERDOWN` past the lease). Later commands of the batch for them are refused too, so
    /// that the router, which sends refused commands again once the map names their master,
    /// never applies a later command for a key before an earlier one.
    pub refused_slots: std::collections::HashSet<u16>,
    /// READONLY was sent (replica reads; mirrors serve them).
    pub readonly: bool,
    /// WATCHed keys with the version each had when watched (None: absent).
    pub watched: Vec<(Vec<u8>, Option<u64>)>,
    /// The connection's subscriptions and the messages waiting for it (once it subscribed).
    pub mailbox: Option<crate::node::pubsub::Mailbox>,
    /// The client's address and the server's, as CLIENT INFO and CLIENT LIST show them.
    pub addr: Option<std::net::SocketAddr>,
    pub laddr: Option<std::net::SocketAddr>,
    pub connected: std::time::Instant,
    /// CLIENT REPLY: replies are off (OFF), or the next command's is skipped (SKIP).
    pub replies_off: bool,
    pub skip_next_reply: bool,
    /// A blocking command tries again (after a wake or at its timeout): INFO commandstats
    /// counts its call once, at its first try.
    pub blocked_retry: bool,
}

impl Session {
    /// In RESP2, a connection with subscriptions accepts only the pub/sub commands.
    pub fn subscribed(&self) -> bool {
        self.mailbox
            .as_ref()
            .is_some_and(|m| m.count() + m.shard_channels.len() > 0)
    }
}

impl Session {
    /// This cluster server's membership (None when standalone).
    #[inline]
    pub fn member(&self) -> Option<&std::sync::Arc<crate::cluster::Member>> {
        self.cluster.as_ref().and_then(|c| c.member())
    }

    pub fn new(
        id: u64,
        password_required: bool,
        cluster: Option<std::sync::Arc<crate::cluster::Roles>>,
    ) -> Session {
        Session {
            id,
            protocol: 2,
            authenticated: !password_required,
            name: None,
            lib_name: None,
            lib_ver: None,
            closing: false,
            write_replies: Vec::new(),
            acks: Default::default(),
            cluster,
            multi: None,
            multi_failed: false,
            routed: false,
            forwarded: false,
            scripting: false,
            refused_slots: std::collections::HashSet::new(),
            readonly: false,
            watched: Vec::new(),
            mailbox: None,
            addr: None,
            laddr: None,
            connected: std::time::Instant::now(),
            replies_off: false,
            skip_next_reply: false,
            blocked_retry: false,
        }
    }
}

struct Ctx<'a> {
    node: &'a Node,
    session: &'a mut Session,
    enc: ReplyEncoder<'a>,
}

impl Ctx<'_> {
    /// The connection speaks to a Redis Cluster node: a cluster server's own RESP port (not its
    /// routing port, nor commands a routing port forwarded here, which answer as a standalone
    /// Redis).
    fn cluster_node(&self) -> bool {
        self.session.member().is_some() && !self.session.routed
    }
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

impl Spec {
    /// Whether the command names keys (at fixed positions, or movable ones).
    pub fn has_keys(&self) -> bool {
        self.first_key > 0 || self.flags.contains(&"movablekeys")
    }

    /// Whether the command may change data (Redis's `write` flag).
    pub fn is_write(&self) -> bool {
        self.flags.contains(&"write")
    }
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
    let b = &["@bitmap"][..];
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
        spec!("msetnx", -3, W, 1, -1, 2, s, Op::Mset, cmd_msetnx),
        spec!("lcs", -3, &["readonly"], 1, 2, 1, s, Op::Get, cmd_lcs),
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
        spec!("incrbyfloat", 3, W, 1, 1, 1, s, Op::Incr, cmd_incrbyfloat),
        spec!("setrange", 4, W, 1, 1, 1, s, Op::Set, cmd_setrange),
        spec!("getbit", 3, R, 1, 1, 1, b, Op::Get, cmd_getbit),
        spec!("setbit", 4, W, 1, 1, 1, b, Op::Set, cmd_setbit),
        spec!(
            "bitcount",
            -2,
            &["readonly"],
            1,
            1,
            1,
            b,
            Op::Get,
            cmd_bitcount
        ),
        spec!("bitpos", -3, &["readonly"], 1, 1, 1, b, Op::Get, cmd_bitpos),
        spec!("bitop", -4, W, 2, -1, 1, b, Op::Set, cmd_bitop),
        spec!("rename", 3, &["write"], 1, 2, 1, k, Op::Set, cmd_rename),
        spec!(
            "renamenx",
            3,
            &["write", "fast"],
            1,
            2,
            1,
            k,
            Op::Set,
            cmd_renamenx
        ),
        spec!("copy", -3, W, 1, 2, 1, k, Op::Set, cmd_copy),
        spec!("dump", 2, R, 1, 1, 1, k, Op::Get, dump::cmd_dump),
        spec!("restore", -4, W, 1, 1, 1, k, Op::Set, dump::cmd_restore),
        spec!(
            "restore-asking",
            -4,
            &["write", "denyoom", "asking"],
            1,
            1,
            1,
            k,
            Op::Set,
            dump::cmd_restore
        ),
        spec!(
            "migrate",
            -6,
            &["write", "movablekeys"],
            3,
            3,
            1,
            k,
            Op::Other,
            dump::cmd_migrate
        ),
        spec!(
            "randomkey",
            1,
            &["readonly"],
            0,
            0,
            0,
            k,
            Op::Other,
            cmd_randomkey
        ),
        spec!(
            "object",
            -2,
            &["readonly"],
            2,
            2,
            1,
            k,
            Op::Other,
            cmd_object
        ),
        spec!(
            "memory",
            -2,
            &["readonly"],
            2,
            2,
            1,
            &[],
            Op::Other,
            cmd_memory
        ),
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
            "eval",
            -3,
            &["noscript", "movablekeys"],
            0,
            0,
            0,
            &["@scripting"],
            Op::Other,
            cmd_eval
        ),
        spec!(
            "evalsha",
            -3,
            &["noscript", "movablekeys"],
            0,
            0,
            0,
            &["@scripting"],
            Op::Other,
            cmd_evalsha
        ),
        spec!(
            "eval_ro",
            -3,
            &["noscript", "readonly", "movablekeys"],
            0,
            0,
            0,
            &["@scripting"],
            Op::Other,
            cmd_eval
        ),
        spec!(
            "evalsha_ro",
            -3,
            &["noscript", "readonly", "movablekeys"],
            0,
            0,
            0,
            &["@scripting"],
            Op::Other,
            cmd_evalsha
        ),
        spec!(
            "script",
            -2,
            &["noscript"],
            0,
            0,
            0,
            &["@scripting"],
            Op::Other,
            cmd_script
        ),
        spec!(
            "function",
            -2,
            &["noscript"],
            0,
            0,
            0,
            &["@scripting"],
            Op::Other,
            cmd_function
        ),
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
            "save",
            1,
            &["admin", "noscript", "no_async_loading", "no_multi"],
            0,
            0,
            0,
            &["@admin", "@slow", "@dangerous"],
            Op::Other,
            cmd_save
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
            cmd_readonly
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
            cmd_readwrite
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
            "watch",
            -2,
            &["noscript", "loading", "stale", "fast", "allow_busy"],
            1,
            -1,
            1,
            &["@transaction"],
            Op::Other,
            cmd_watch
        ),
        spec!(
            "ramlog.versions",
            -2,
            &["readonly", "fast"],
            1,
            -1,
            1,
            &["@transaction"],
            Op::Other,
            cmd_ramlog_versions
        ),
        spec!(
            "unwatch",
            1,
            &["noscript", "loading", "stale", "fast"],
            0,
            0,
            0,
            &["@transaction"],
            Op::Other,
            cmd_unwatch
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
            &["admin", "noscript", "loading", "stale", "no_multi"],
            0,
            0,
            0,
            a,
            Op::Other,
            cmd_shutdown
        ),
    ];
    v.extend(collection_specs());
    let x = &["@stream"][..];
    v.extend([
        spec!("xadd", -5, W, 1, 1, 1, x, Op::Other, cmd_xadd),
        spec!("xlen", 2, R, 1, 1, 1, x, Op::Other, cmd_xlen),
        spec!(
            "xrange",
            -4,
            &["readonly"],
            1,
            1,
            1,
            x,
            Op::Other,
            cmd_xrange
        ),
        spec!(
            "xrevrange",
            -4,
            &["readonly"],
            1,
            1,
            1,
            x,
            Op::Other,
            cmd_xrevrange
        ),
        spec!(
            "xdel",
            -3,
            &["write", "fast"],
            1,
            1,
            1,
            x,
            Op::Other,
            cmd_xdel
        ),
        spec!("xtrim", -4, &["write"], 1, 1, 1, x, Op::Other, cmd_xtrim),
        // Movable keys: `command_keys` finds them after STREAMS.
        spec!(
            "xread",
            -4,
            &["readonly", "blocking", "movablekeys"],
            0,
            0,
            0,
            x,
            Op::Other,
            cmd_xread
        ),
        spec!(
            "xreadgroup",
            -7,
            &["write", "blocking", "movablekeys"],
            0,
            0,
            0,
            x,
            Op::Other,
            cmd_xreadgroup
        ),
        // XGROUP's and XINFO's key follows the subcommand (none for HELP).
        spec!("xgroup", -2, &["write"], 2, 2, 1, x, Op::Other, cmd_xgroup),
        spec!("xinfo", -2, &["readonly"], 2, 2, 1, x, Op::Other, cmd_xinfo),
        spec!(
            "xack",
            -4,
            &["write", "fast"],
            1,
            1,
            1,
            x,
            Op::Other,
            cmd_xack
        ),
        spec!(
            "xpending",
            -3,
            &["readonly"],
            1,
            1,
            1,
            x,
            Op::Other,
            cmd_xpending
        ),
        spec!(
            "xclaim",
            -6,
            &["write", "fast"],
            1,
            1,
            1,
            x,
            Op::Other,
            cmd_xclaim
        ),
        spec!(
            "xautoclaim",
            -6,
            &["write", "fast"],
            1,
            1,
            1,
            x,
            Op::Other,
            cmd_xautoclaim
        ),
        spec!("xsetid", -3, W, 1, 1, 1, x, Op::Other, cmd_xsetid),
    ]);
    let ps = &["@pubsub"][..];
    let psf: &[&str] = &["pubsub", "noscript", "loading", "stale"];
    v.extend([
        spec!("subscribe", -2, psf, 0, 0, 0, ps, Op::Other, cmd_subscribe),
        spec!(
            "unsubscribe",
            -1,
            psf,
            0,
            0,
            0,
            ps,
            Op::Other,
            cmd_unsubscribe
        ),
        spec!(
            "psubscribe",
            -2,
            psf,
            0,
            0,
            0,
            ps,
            Op::Other,
            cmd_psubscribe
        ),
        spec!(
            "punsubscribe",
            -1,
            psf,
            0,
            0,
            0,
            ps,
            Op::Other,
            cmd_punsubscribe
        ),
        spec!(
            "ssubscribe",
            -2,
            psf,
            1,
            -1,
            1,
            ps,
            Op::Other,
            cmd_ssubscribe
        ),
        spec!(
            "sunsubscribe",
            -1,
            psf,
            1,
            -1,
            1,
            ps,
            Op::Other,
            cmd_sunsubscribe
        ),
        spec!(
            "publish",
            3,
            &["pubsub", "loading", "stale", "fast"],
            0,
            0,
            0,
            ps,
            Op::Other,
            cmd_publish
        ),
        spec!(
            "ramlog.keyevent",
            3,
            &["pubsub", "loading", "stale", "fast"],
            0,
            0,
            0,
            ps,
            Op::Other,
            cmd_ramlog_keyevent
        ),
        spec!(
            "spublish",
            3,
            &["pubsub", "loading", "stale", "fast"],
            1,
            1,
            1,
            ps,
            Op::Other,
            cmd_spublish
        ),
        spec!(
            "pubsub",
            -2,
            &["pubsub", "loading", "stale"],
            0,
            0,
            0,
            ps,
            Op::Other,
            cmd_pubsub
        ),
    ]);
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

/// The commands of the collection types: hashes, lists, sets, sorted sets.
fn collection_specs() -> Vec<Spec> {
    let h = &["@hash"][..];
    let l = &["@list"][..];
    let st = &["@set"][..];
    let z = &["@sortedset"][..];
    let rs: &[&str] = &["readonly"];
    let wf: &[&str] = &["write", "denyoom", "fast"];
    let wr: &[&str] = &["write"];
    let bl: &[&str] = &["write", "blocking"];
    let rm: &[&str] = &["readonly", "movablekeys"];
    let wm: &[&str] = &["write", "movablekeys"];
    let blm: &[&str] = &["write", "blocking", "movablekeys"];
    vec![
        spec!("hset", -4, wf, 1, 1, 1, h, Op::Hash, cmd_hset),
        spec!("hmset", -4, wf, 1, 1, 1, h, Op::Hash, cmd_hmset),
        spec!("hsetnx", 4, wf, 1, 1, 1, h, Op::Hash, cmd_hsetnx),
        spec!("hget", 3, R, 1, 1, 1, h, Op::Hash, cmd_hget),
        spec!("hmget", -3, R, 1, 1, 1, h, Op::Hash, cmd_hmget),
        spec!("hgetall", 2, rs, 1, 1, 1, h, Op::Hash, cmd_hgetall),
        spec!("hkeys", 2, rs, 1, 1, 1, h, Op::Hash, cmd_hkeys),
        spec!("hvals", 2, rs, 1, 1, 1, h, Op::Hash, cmd_hvals),
        spec!("hlen", 2, R, 1, 1, 1, h, Op::Hash, cmd_hlen),
        spec!("hexists", 3, R, 1, 1, 1, h, Op::Hash, cmd_hexists),
        spec!("hstrlen", 3, R, 1, 1, 1, h, Op::Hash, cmd_hstrlen),
        spec!(
            "hdel",
            -3,
            &["write", "fast"],
            1,
            1,
            1,
            h,
            Op::Hash,
            cmd_hdel
        ),
        spec!("hincrby", 4, wf, 1, 1, 1, h, Op::Hash, cmd_hincrby),
        spec!(
            "hincrbyfloat",
            4,
            wf,
            1,
            1,
            1,
            h,
            Op::Hash,
            cmd_hincrbyfloat
        ),
        spec!("hrandfield", -2, rs, 1, 1, 1, h, Op::Hash, cmd_hrandfield),
        spec!("hscan", -3, rs, 1, 1, 1, h, Op::Hash, cmd_hscan),
        spec!("lpush", -3, wf, 1, 1, 1, l, Op::List, cmd_lpush),
        spec!("rpush", -3, wf, 1, 1, 1, l, Op::List, cmd_rpush),
        spec!("lpushx", -3, wf, 1, 1, 1, l, Op::List, cmd_lpushx),
        spec!("rpushx", -3, wf, 1, 1, 1, l, Op::List, cmd_rpushx),
        spec!(
            "lpop",
            -2,
            &["write", "fast"],
            1,
            1,
            1,
            l,
            Op::List,
            cmd_lpop
        ),
        spec!(
            "rpop",
            -2,
            &["write", "fast"],
            1,
            1,
            1,
            l,
            Op::List,
            cmd_rpop
        ),
        spec!("llen", 2, R, 1, 1, 1, l, Op::List, cmd_llen),
        spec!("lrange", 4, rs, 1, 1, 1, l, Op::List, cmd_lrange),
        spec!("lindex", 3, rs, 1, 1, 1, l, Op::List, cmd_lindex),
        spec!("lset", 4, W, 1, 1, 1, l, Op::List, cmd_lset),
        spec!("lrem", 4, wr, 1, 1, 1, l, Op::List, cmd_lrem),
        spec!("ltrim", 4, wr, 1, 1, 1, l, Op::List, cmd_ltrim),
        spec!("linsert", 5, W, 1, 1, 1, l, Op::List, cmd_linsert),
        spec!("lpos", -3, rs, 1, 1, 1, l, Op::List, cmd_lpos),
        spec!(
            "bitfield",
            -2,
            W,
            1,
            1,
            1,
            &["@bitmap"][..],
            Op::Other,
            bitfield::cmd_bitfield
        ),
        spec!(
            "bitfield_ro",
            -2,
            R,
            1,
            1,
            1,
            &["@bitmap"][..],
            Op::Other,
            bitfield::cmd_bitfield_ro
        ),
        spec!("sort", -2, W, 1, 1, 1, l, Op::List, sort::cmd_sort),
        spec!("sort_ro", -2, rs, 1, 1, 1, l, Op::List, sort::cmd_sort_ro),
        spec!("lmove", 5, W, 1, 2, 1, l, Op::List, cmd_lmove),
        spec!("rpoplpush", 3, W, 1, 2, 1, l, Op::List, cmd_rpoplpush),
        spec!("sadd", -3, wf, 1, 1, 1, st, Op::SetType, cmd_sadd),
        spec!(
            "srem",
            -3,
            &["write", "fast"],
            1,
            1,
            1,
            st,
            Op::SetType,
            cmd_srem
        ),
        spec!("smembers", 2, rs, 1, 1, 1, st, Op::SetType, cmd_smembers),
        spec!("sismember", 3, R, 1, 1, 1, st, Op::SetType, cmd_sismember),
        spec!(
            "smismember",
            -3,
            R,
            1,
            1,
            1,
            st,
            Op::SetType,
            cmd_smismember
        ),
        spec!("scard", 2, R, 1, 1, 1, st, Op::SetType, cmd_scard),
        spec!(
            "spop",
            -2,
            &["write", "fast"],
            1,
            1,
            1,
            st,
            Op::SetType,
            cmd_spop
        ),
        spec!(
            "srandmember",
            -2,
            rs,
            1,
            1,
            1,
            st,
            Op::SetType,
            cmd_srandmember
        ),
        spec!(
            "smove",
            4,
            &["write", "fast"],
            1,
            2,
            1,
            st,
            Op::SetType,
            cmd_smove
        ),
        spec!("sinter", -2, rs, 1, -1, 1, st, Op::SetType, cmd_sinter),
        spec!("sunion", -2, rs, 1, -1, 1, st, Op::SetType, cmd_sunion),
        spec!("sdiff", -2, rs, 1, -1, 1, st, Op::SetType, cmd_sdiff),
        spec!(
            "sinterstore",
            -3,
            W,
            1,
            -1,
            1,
            st,
            Op::SetType,
            cmd_sinterstore
        ),
        spec!(
            "sunionstore",
            -3,
            W,
            1,
            -1,
            1,
            st,
            Op::SetType,
            cmd_sunionstore
        ),
        spec!(
            "sdiffstore",
            -3,
            W,
            1,
            -1,
            1,
            st,
            Op::SetType,
            cmd_sdiffstore
        ),
        spec!("sscan", -3, rs, 1, 1, 1, st, Op::SetType, cmd_sscan),
        spec!("zadd", -4, wf, 1, 1, 1, z, Op::ZSet, cmd_zadd),
        spec!("zincrby", 4, wf, 1, 1, 1, z, Op::ZSet, cmd_zincrby),
        spec!("zscore", 3, R, 1, 1, 1, z, Op::ZSet, cmd_zscore),
        spec!("zmscore", -3, R, 1, 1, 1, z, Op::ZSet, cmd_zmscore),
        spec!("zcard", 2, R, 1, 1, 1, z, Op::ZSet, cmd_zcard),
        spec!("zcount", 4, R, 1, 1, 1, z, Op::ZSet, cmd_zcount),
        spec!("zlexcount", 4, R, 1, 1, 1, z, Op::ZSet, cmd_zlexcount),
        spec!("zrank", -3, R, 1, 1, 1, z, Op::ZSet, cmd_zrank),
        spec!("zrevrank", -3, R, 1, 1, 1, z, Op::ZSet, cmd_zrevrank),
        spec!(
            "zrem",
            -3,
            &["write", "fast"],
            1,
            1,
            1,
            z,
            Op::ZSet,
            cmd_zrem
        ),
        spec!("zrange", -4, rs, 1, 1, 1, z, Op::ZSet, cmd_zrange),
        spec!("zrevrange", -4, rs, 1, 1, 1, z, Op::ZSet, cmd_zrevrange),
        spec!(
            "zrangebyscore",
            -4,
            rs,
            1,
            1,
            1,
            z,
            Op::ZSet,
            cmd_zrangebyscore
        ),
        spec!(
            "zrevrangebyscore",
            -4,
            rs,
            1,
            1,
            1,
            z,
            Op::ZSet,
            cmd_zrevrangebyscore
        ),
        spec!("zrangebylex", -4, rs, 1, 1, 1, z, Op::ZSet, cmd_zrangebylex),
        spec!(
            "zrevrangebylex",
            -4,
            rs,
            1,
            1,
            1,
            z,
            Op::ZSet,
            cmd_zrevrangebylex
        ),
        spec!("zrangestore", -5, W, 1, 2, 1, z, Op::ZSet, cmd_zrangestore),
        spec!(
            "zremrangebyrank",
            4,
            wr,
            1,
            1,
            1,
            z,
            Op::ZSet,
            cmd_zremrangebyrank
        ),
        spec!(
            "zremrangebyscore",
            4,
            wr,
            1,
            1,
            1,
            z,
            Op::ZSet,
            cmd_zremrangebyscore
        ),
        spec!(
            "zremrangebylex",
            4,
            wr,
            1,
            1,
            1,
            z,
            Op::ZSet,
            cmd_zremrangebylex
        ),
        spec!(
            "zpopmin",
            -2,
            &["write", "fast"],
            1,
            1,
            1,
            z,
            Op::ZSet,
            cmd_zpopmin
        ),
        spec!(
            "zpopmax",
            -2,
            &["write", "fast"],
            1,
            1,
            1,
            z,
            Op::ZSet,
            cmd_zpopmax
        ),
        spec!("zrandmember", -2, rs, 1, 1, 1, z, Op::ZSet, cmd_zrandmember),
        spec!("zscan", -3, rs, 1, 1, 1, z, Op::ZSet, cmd_zscan),
        spec!("blpop", -3, bl, 1, -2, 1, l, Op::List, cmd_blpop),
        spec!("brpop", -3, bl, 1, -2, 1, l, Op::List, cmd_brpop),
        spec!("blmove", 6, bl, 1, 2, 1, l, Op::List, cmd_blmove),
        spec!("brpoplpush", 4, bl, 1, 2, 1, l, Op::List, cmd_brpoplpush),
        spec!("bzpopmin", -3, bl, 1, -2, 1, z, Op::ZSet, cmd_bzpopmin),
        spec!("bzpopmax", -3, bl, 1, -2, 1, z, Op::ZSet, cmd_bzpopmax),
        // `numkeys` commands: their keys are found by `key_positions`.
        spec!(
            "sintercard",
            -3,
            rm,
            0,
            0,
            0,
            st,
            Op::SetType,
            cmd_sintercard
        ),
        spec!("zintercard", -3, rm, 0, 0, 0, z, Op::ZSet, cmd_zintercard),
        spec!("zunion", -3, rm, 0, 0, 0, z, Op::ZSet, cmd_zunion),
        spec!("zinter", -3, rm, 0, 0, 0, z, Op::ZSet, cmd_zinter),
        spec!("zdiff", -3, rm, 0, 0, 0, z, Op::ZSet, cmd_zdiff),
        spec!("zunionstore", -4, wm, 0, 0, 0, z, Op::ZSet, cmd_zunionstore),
        spec!("zinterstore", -4, wm, 0, 0, 0, z, Op::ZSet, cmd_zinterstore),
        spec!("zdiffstore", -4, wm, 0, 0, 0, z, Op::ZSet, cmd_zdiffstore),
        spec!("lmpop", -4, wm, 0, 0, 0, l, Op::List, cmd_lmpop),
        spec!("zmpop", -4, wm, 0, 0, 0, z, Op::ZSet, cmd_zmpop),
        spec!("blmpop", -5, blm, 0, 0, 0, l, Op::List, cmd_blmpop),
        spec!("bzmpop", -5, blm, 0, 0, 0, z, Op::ZSet, cmd_bzmpop),
    ]
}

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

/// Redis 7.2's subcommands of the container commands ramlog serves: INFO commandstats counts a
/// call under `command|subcommand`, as Redis does (a subcommand not listed counts under its
/// command).
const SUBCOMMANDS: &[(&str, &[&str])] = &[
    ("config", &["get", "set", "resetstat", "rewrite", "help"]),
    (
        "client",
        &[
            "caching",
            "getname",
            "getredir",
            "id",
            "info",
            "kill",
            "list",
            "no-evict",
            "no-touch",
            "pause",
            "reply",
            "setinfo",
            "setname",
            "tracking",
            "trackinginfo",
            "unblock",
            "unpause",
            "help",
        ],
    ),
    (
        "cluster",
        &[
            "addslots",
            "addslotsrange",
            "bumpepoch",
            "count-failure-reports",
            "countkeysinslot",
            "delslots",
            "delslotsrange",
            "failover",
            "flushslots",
            "forget",
            "getkeysinslot",
            "info",
            "keyslot",
            "links",
            "meet",
            "myid",
            "myshardid",
            "nodes",
            "replicas",
            "replicate",
            "reset",
            "saveconfig",
            "set-config-epoch",
            "setslot",
            "shards",
            "slaves",
            "slots",
            "help",
        ],
    ),
    (
        "command",
        &[
            "count",
            "docs",
            "getkeys",
            "getkeysandflags",
            "info",
            "list",
            "help",
        ],
    ),
    (
        "memory",
        &["doctor", "malloc-stats", "purge", "stats", "usage", "help"],
    ),
    (
        "object",
        &["encoding", "freq", "idletime", "refcount", "help"],
    ),
    (
        "pubsub",
        &[
            "channels",
            "numpat",
            "numsub",
            "shardchannels",
            "shardnumsub",
            "help",
        ],
    ),
    (
        "script",
        &["exists", "flush", "kill", "load", "debug", "help"],
    ),
    (
        "xgroup",
        &[
            "create",
            "createconsumer",
            "delconsumer",
            "destroy",
            "setid",
            "help",
        ],
    ),
    ("xinfo", &["consumers", "groups", "stream", "help"]),
    (
        "function",
        &[
            "delete", "dump", "flush", "kill", "list", "load", "restore", "stats", "help",
        ],
    ),
];

/// The names of INFO commandstats' counters: each command's, then each subcommand's
/// (`config|get`), in the order of [`stat_index`].
static STAT_NAMES: LazyLock<Vec<&'static str>> = LazyLock::new(|| {
    let mut names: Vec<&'static str> = SPECS.iter().map(|s| s.name).collect();
    for (command, subs) in SUBCOMMANDS {
        for sub in *subs {
            names.push(Box::leak(format!("{command}|{sub}").into_boxed_str()));
        }
    }
    names
});

/// The counter of each (command index, subcommand).
static BY_SUBCOMMAND: LazyLock<HashMap<(usize, &'static str), usize>> = LazyLock::new(|| {
    let mut at = SPECS.len();
    let mut map = HashMap::new();
    for (command, subs) in SUBCOMMANDS {
        let index = lookup_at(command.as_bytes()).map(|(i, _)| i);
        for sub in *subs {
            if let Some(i) = index {
                map.insert((i, *sub), at);
            }
            at += 1;
        }
    }
    map
});

/// Whether each command (by index) is a container counted per subcommand.
static IS_CONTAINER: LazyLock<Vec<bool>> = LazyLock::new(|| {
    SPECS
        .iter()
        .map(|spec| SUBCOMMANDS.iter().any(|(c, _)| *c == spec.name))
        .collect()
});

/// INFO commandstats' counter names (see [`stat_index`]).
pub fn stat_names() -> &'static [&'static str] {
    &STAT_NAMES
}

/// The INFO commandstats counter of a call of command `index` with `args`: its subcommand's
/// for a container command (CONFIG GET: `config|get`), else the command's.
pub fn stat_index(index: usize, args: &[&[u8]]) -> usize {
    if !IS_CONTAINER.get(index).copied().unwrap_or(false) {
        return index;
    }
    let Some(sub) = args.get(1).filter(|s| s.len() <= 24) else {
        return index;
    };
    let mut lower = [0u8; 24];
    for (d, s) in lower.iter_mut().zip(sub.iter()) {
        *d = s.to_ascii_lowercase();
    }
    std::str::from_utf8(&lower[..sub.len()])
        .ok()
        .and_then(|name| BY_SUBCOMMAND.get(&(index, name)).copied())
        .unwrap_or(index)
}

/// The command named `name` (any case).
pub fn lookup(name: &[u8]) -> Option<&'static Spec> {
    lookup_at(name).map(|(_, spec)| spec)
}

/// The command named `name` and its index in the command table ([`specs`]).
pub fn lookup_at(name: &[u8]) -> Option<(usize, &'static Spec)> {
    let mut lower = [0u8; 24];
    if name.len() > lower.len() {
        return None;
    }
    for (d, s) in lower.iter_mut().zip(name) {
        *d = s.to_ascii_lowercase();
    }
    BY_NAME.get(&lower[..name.len()]).map(|&i| (i, &SPECS[i]))
}

const ERR_SYNTAX: &str = "ERR syntax error";
const ERR_NOT_INTEGER: &str = "ERR value is not an integer or out of range";
const ERR_OVERFLOW: &str = "ERR increment or decrement would overflow";
const ERR_NOAUTH: &str = "NOAUTH Authentication required.";
const ERR_WRONGPASS: &str = "WRONGPASS invalid username-password pair or user is disabled.";

/// Redis's error when it cannot persist (`-MISCONF`), with ramlog's reason.
pub fn misconf(reason: &str) -> String {
    let reason: String = reason
        .replace(['\r', '\n'], " ")
        .chars()
        .take(400)
        .collect();
    format!(
        "MISCONF Errors writing to the data directory: {reason}. Commands that may modify the data set are refused until ramlog can write again; reads go on (see INFO persistence)"
    )
}

/// Runs `f`, which may block for long (a script, a wait for the gate), off the async runtime: on a
/// worker of the multi-threaded runtime the worker's other tasks and the polling of connections
/// move to another thread for the time (`block_in_place`); anywhere else `f` just runs.
pub(super) fn off_the_runtime<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

// Which hold of the server's script gate this thread has (0: none, 1: shared, 2: alone).
thread_local! {
    static GATE_HELD: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
}

/// A command's hold of [`Node::script_gate`]: scripts and EXEC run alone (exclusive), every
/// other command shares it, so that nothing runs between a script's (or a transaction's)
/// commands, as in Redis. A command run from inside one (redis.call, EXEC's queue) is already
/// covered and takes nothing.
struct Gate<'a> {
    _shared: Option<parking_lot::RwLockReadGuard<'a, ()>>,
    _alone: Option<parking_lot::RwLockWriteGuard<'a, ()>>,
    entered: bool,
    /// Not entered: a script has held the gate past `busy-reply-threshold` (the command answers
    /// `-BUSY`, as Redis's do while a script runs long).
    busy: bool,
}

/// How long a command waits for the gate before it looks again at how long the running
/// script has run.
const GATE_LOOK: std::time::Duration = std::time::Duration::from_millis(10);

const ERR_BUSY: &str =
    "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.";

impl<'a> Gate<'a> {
    fn none(busy: bool) -> Gate<'a> {
        Gate {
            _shared: None,
            _alone: None,
            entered: false,
            busy,
        }
    }

    fn enter(node: &'a Node, alone: bool) -> Gate<'a> {
        if GATE_HELD.with(|g| g.get()) != 0 {
            return Gate::none(false);
        }
        // The fast way: the gate is free (or only shared), or a transaction or short script
        // lets it go within a few milliseconds.
        let first = if alone {
            node.script_gate
                .try_write_for(GATE_LOOK)
                .map(|g| (None, Some(g)))
        } else {
            node.script_gate
                .try_read_recursive_for(GATE_LOOK)
                .map(|g| (Some(g), None))
        };
        let waited = || loop {
            if alone {
                if let Some(g) = node.script_gate.try_write_for(GATE_LOOK) {
                    break Some((None, Some(g)));
                }
            } else if let Some(g) = node.script_gate.try_read_recursive_for(GATE_LOOK) {
                break Some((Some(g), None));
            }
            if script_busy(node) {
                return None;
            }
        };
        // Waiting blocks this thread: a runtime worker hands its other tasks (and the polling of
        // connections) to another thread meanwhile, or a long script would stall every client.
        let (shared, exclusive) = match first {
            Some(held) => held,
            None => match off_the_runtime(waited) {
                Some(held) => held,
                None => return Gate::none(true),
            },
        };
        GATE_HELD.with(|g| g.set(if alone { 2 } else { 1 }));
        Gate {
            _shared: shared,
            _alone: exclusive,
            entered: true,
            busy: false,
        }
    }
}

impl Drop for Gate<'_> {
    fn drop(&mut self) {
        if self.entered {
            GATE_HELD.with(|g| g.set(0));
        }
    }
}

/// Whether a command is served while a script runs long (Redis's `allow-busy` commands): it
/// touches no data (SCRIPT KILL and SHUTDOWN stop the script; the transaction and connection
/// commands go on).
pub(crate) fn allows_busy(spec: Option<&Spec>, args: &[&[u8]]) -> bool {
    spec.is_some_and(|s| {
        matches!(
            s.name,
            "shutdown"
                | "multi"
                | "discard"
                | "watch"
                | "unwatch"
                | "auth"
                | "hello"
                | "quit"
                | "reset"
        ) || (s.name == "script" && args.get(1).is_some_and(|a| a.eq_ignore_ascii_case(b"kill")))
    })
}

/// Whether a script on this server has run past `busy-reply-threshold` (other commands then
/// answer `-BUSY`).
pub(crate) fn script_busy(node: &Node) -> bool {
    let threshold = node.settings.value("busy-reply-threshold").max(0) as u64;
    node.scripts
        .running
        .running_for_ms(now_ms())
        .is_some_and(|ms| ms >= threshold)
}

/// Runs one request and appends its reply to `out`.
pub fn execute(node: &Node, session: &mut Session, args: &[&[u8]], out: &mut Vec<u8>) {
    debug_assert!(!args.is_empty());
    let before = out.len();
    let started = Instant::now();
    let skip_this = std::mem::take(&mut session.skip_next_reply);
    let at = lookup_at(args[0]);
    let spec = at.map(|(_, spec)| spec);
    // Whether the command ran (INFO commandstats' calls), or was refused before (its
    // rejected calls).
    let mut ran = false;
    // Scripts and transactions run alone: EVAL outside MULTI (inside, it is only queued), and
    // EXEC of a transaction.
    let alone = spec.is_some_and(|s| match s.name {
        "eval" | "evalsha" | "eval_ro" | "evalsha_ro" => session.multi.is_none(),
        "exec" => session.multi.is_some(),
        _ => false,
    });
    // Commands that touch no data take no part in the gate, so that they are served while a
    // script runs long (Redis's `allow-busy` commands): SCRIPT KILL and SHUTDOWN stop the script,
    // the transaction and connection commands go on.
    let allow_busy = allows_busy(spec, args);
    let gate = if allow_busy {
        Gate::none(false)
    } else {
        Gate::enter(node, alone)
    };
    let op = spec.map(|s| s.op).unwrap_or(Op::Other);
    let units_before = ramlog_logmem::units_logged_on_this_thread();
    let mut wrote = false;
    let (changes_before, units_from) = (session.acks.changes(), session.acks.units_len());
    {
        let protocol = session.protocol;
        let mut ctx = Ctx {
            node,
            session,
            enc: ReplyEncoder::new(out, protocol),
        };
        let in_multi = ctx.session.multi.is_some();
        match spec {
            // As Redis: a command refused during a long script fails the transaction it is
            // queued in, and EXEC discards the transaction.
            _ if gate.busy && in_multi && spec.is_some_and(|s| s.name == "exec") => {
                ctx.session.multi = None;
                ctx.session.multi_failed = false;
                ctx.session.watched.clear();
                ctx.enc.error(&format!(
                    "EXECABORT Transaction discarded because of: {ERR_BUSY}"
                ))
            }
            _ if gate.busy => {
                if in_multi {
                    ctx.session.multi_failed = true;
                }
                ctx.enc.error(ERR_BUSY)
            }
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
            // Keys with the internal keys' prefix would name a slot of their own.
            Some(spec)
                if spec.has_keys() && command_keys(spec, args).any(ramlog_common::is_reserved) =>
            {
                if in_multi {
                    ctx.session.multi_failed = true;
                }
                ctx.enc.error(ERR_RESERVED_KEY)
            }
            // Redis Cluster: keys in another server's slots get -MOVED, keys in several slots
            // -CROSSSLOT (inside MULTI too, which EXEC then aborts).
            Some(spec)
                if (!ctx.session.routed || ctx.session.forwarded)
                    && spec.has_keys()
                    && ctx.session.member().is_some() =>
            {
                match cluster_check(
                    ctx.session.member(),
                    spec,
                    args,
                    ctx.session.forwarded,
                    ctx.session.readonly,
                    &ctx.session.refused_slots,
                ) {
                    Ok(()) => {
                        ran = true;
                        run_checked(&mut ctx, spec, args, in_multi, &mut wrote)
                    }
                    Err(e) => {
                        if in_multi {
                            ctx.session.multi_failed = true;
                        }
                        if ctx.session.forwarded {
                            ctx.session
                                .refused_slots
                                .extend(command_keys(spec, args).map(key_slot));
                        }
                        ctx.enc.error(&e)
                    }
                }
            }
            Some(spec) => {
                ran = true;
                run_checked(&mut ctx, spec, args, in_multi, &mut wrote)
            }
        }
    }
    count_change(node, units_before);
    // One clock read for the command's stats and its latency sample.
    let elapsed = started.elapsed();
    if let Some((index, _)) = at {
        let stats = &node.metrics.command_stats;
        let index = stat_index(index, args);
        if ran {
            let failed = out.get(before) == Some(&b'-');
            stats.ran(index, elapsed, !session.blocked_retry, failed);
        } else {
            stats.rejected(index);
        }
    }
    // CLIENT REPLY OFF or SKIP: the reply is dropped (subscription confirmations are pushes,
    // and still go out, as in Redis 7.2).
    let silent = session.replies_off || skip_this || session.skip_next_reply;
    let push = spec.is_some_and(|s| {
        matches!(
            s.name,
            "subscribe"
                | "unsubscribe"
                | "psubscribe"
                | "punsubscribe"
                | "ssubscribe"
                | "sunsubscribe"
        )
    });
    if silent && !push {
        out.truncate(before);
        node.record(op, elapsed, true);
        return;
    }
    let failed = out.get(before) == Some(&b'-');
    // A read that waits for replication is withdrawn like a write if the wait fails. (Even a
    // failed command may have written: a partial MSET across tablets cannot; EXEC can.)
    let read_waits = session.acks.changes() != changes_before;
    if (wrote || read_waits) && !failed {
        session.write_replies.push(crate::node::HeldReply {
            start: before,
            end: out.len(),
            units_from,
            units_to: session.acks.units_len(),
        });
    }
    if failed {
        node.metrics.error_stats.count(&out[before..]);
    }
    node.record(op, elapsed, !failed);
}

/// The most pipelined requests [`execute_run`] runs as one.
pub const RUN_MAX: usize = 64;
/// The most element bytes a run of pushes carries (well within one atomic unit of a large
/// list's change, so that the run applies whole or not at all).
const RUN_MAX_BYTES: usize = 64 << 10;

/// Whether `args` may begin a run of pipelined requests that [`execute_run`] runs as one:
/// LPUSH or RPUSH (of any number of elements), or LPOP or RPOP without a count.
pub fn starts_run(args: &[&[u8]]) -> bool {
    let name = args[0];
    (args.len() >= 3
        && (name.eq_ignore_ascii_case(b"lpush") || name.eq_ignore_ascii_case(b"rpush")))
        || (args.len() == 2
            && (name.eq_ignore_ascii_case(b"lpop") || name.eq_ignore_ascii_case(b"rpop")))
}

/// Whether `next` continues the run `first` begins: the same command on the same key.
pub fn continues_run(first: &[&[u8]], next: &[&[u8]]) -> bool {
    next.len() >= 2
        && next[0].eq_ignore_ascii_case(first[0])
        && next[1] == first[1]
        && (next.len() >= 3) == (first.len() >= 3)
        && (first.len() >= 3 || next.len() == 2)
}

/// Runs pipelined requests that [`continues_run`] chains (at most [`RUN_MAX`]) as one command,
/// and answers each as if it had run alone, right after the one before it: `LPUSH k a`,
/// `LPUSH k b` run as `LPUSH k a b` (the same list, each answered the length it made), `LPOP k`
/// ×3 as `LPOP k 3` (each answered one element, or nil once the list ran out). Nothing else ran
/// between them, which is one order the server could have served them in. A push of many
/// small elements to one list then reads and rewrites its end chunk once, not once per request.
///
/// Each request is counted in INFO commandstats and in the changes since the last save as
/// alone, and its reply is held for the writes' acknowledgements as its own. An error (a wrong
/// type, `-MOVED`, memory full, a write not acknowledged) is every request's answer. False, with
/// nothing run, where a request would see what the others do differently: inside MULTI, on a
/// subscribed connection or one whose replies are off, while keyspace notifications are on (each
/// request publishes its own event) or while a client is blocked on a key of this server (a
/// blocked BLPOP is served between two pushes).
pub fn execute_run(
    node: &Node,
    session: &mut Session,
    run: &[Vec<&[u8]>],
    out: &mut Vec<u8>,
) -> bool {
    let first = &run[0];
    let push = first.len() >= 3;
    if run.len() < 2
        || session.multi.is_some()
        || session.subscribed()
        || !session.authenticated
        || session.scripting
        || session.blocked_retry
        || session.replies_off
        || session.skip_next_reply
        || node.settings.notify() != 0
        || node.waiters.keys() > 0
    {
        return false;
    }
    let mut combined: Vec<&[u8]> = vec![first[0], first[1]];
    let count = run.len().to_string();
    if push {
        for r in run {
            combined.extend_from_slice(&r[2..]);
        }
        if combined[2..].iter().map(|e| e.len()).sum::<usize>() > RUN_MAX_BYTES {
            return false;
        }
    } else {
        combined.push(count.as_bytes());
    }
    let started = Instant::now();
    let before = out.len();
    let held_before = session.write_replies.len();
    execute(node, session, &combined, out);
    let reply = out[before..].to_vec();
    out.truncate(before);
    let held = session.write_replies.get(held_before).copied();
    session.write_replies.truncate(held_before);
    let decoder = ramlog_proto::resp::ReplyDecoder {
        bulk_len_max: usize::MAX,
        aggregate_len_max: RUN_MAX,
        depth_max: 2,
    };
    let decoded = match decoder.decode(&reply) {
        Ok(Some((r, used))) if used == reply.len() => Some(r),
        _ => None,
    };
    let protocol = session.protocol;
    // Each request's reply, in order.
    let mut changed = 0u64;
    let mut starts = Vec::with_capacity(run.len() + 1);
    match decoded {
        Some(RespReply::Integer(len)) if push => {
            let mut after: i64 = run.iter().map(|r| (r.len() - 2) as i64).sum();
            for r in run {
                after -= (r.len() - 2) as i64;
                starts.push(out.len());
                ReplyEncoder::new(out, protocol).integer(len - after);
            }
            changed = run.len() as u64;
        }
        Some(RespReply::Array(items)) if !push => {
            for i in 0..run.len() {
                starts.push(out.len());
                match items.get(i) {
                    Some(RespReply::Bulk(b)) => ReplyEncoder::new(out, protocol).bulk(b),
                    _ => ReplyEncoder::new(out, protocol).null(),
                }
            }
            changed = items.len().min(run.len()) as u64;
        }
        Some(RespReply::Null) if !push => {
            for _ in run {
                starts.push(out.len());
                ReplyEncoder::new(out, protocol).null();
            }
        }
        _ => {
            // An error (or anything else): every request's answer.
            for _ in run {
                starts.push(out.len());
                out.extend_from_slice(&reply);
            }
        }
    }
    starts.push(out.len());
    if let Some(h) = held {
        for w in starts.windows(2) {
            session.write_replies.push(crate::node::HeldReply {
                start: w[0],
                end: w[1],
                ..h
            });
        }
    }
    Metrics::add(&node.metrics.requests_run_together, run.len() as u64 - 1);
    // The combined command counted one change and one call: the others are counted here.
    if changed > 1 {
        node.changes_since_save
            .fetch_add(changed - 1, std::sync::atomic::Ordering::Relaxed);
    }
    if let Some((index, spec)) = lookup_at(first[0]) {
        let failed = reply.first() == Some(&b'-');
        let share = started.elapsed() / run.len() as u32;
        let stats = &node.metrics.command_stats;
        let index = stat_index(index, first);
        for _ in 1..run.len() {
            stats.ran(index, share, true, failed);
            if failed {
                node.metrics.error_stats.count(&reply);
            }
            node.record(spec.op, share, !failed);
        }
    }
    true
}

thread_local! {
    /// The thread's count of logged writes up to which commands were counted as changes: a
    /// command run inside another (EXEC's, a script's, a blocked command's retry) is counted
    /// once, by the innermost.
    static CHANGES_COUNTED_TO: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Counts the command that just ran as one change (Redis's dirty counter, INFO's
/// `rdb_changes_since_last_save`) if it logged a write that no command inside it counted: a
/// command that changed nothing (SETBIT of the bit already there, a DEL of no key) counts 0, one
/// that changed several keys or elements counts 1.
fn count_change(node: &Node, units_before: u64) {
    let now = ramlog_logmem::units_logged_on_this_thread();
    let counted = CHANGES_COUNTED_TO.with(|c| c.replace(now));
    if now > units_before.max(counted) {
        node.changes_since_save
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The answer to a key that begins with the internal keys' prefix (`ramlog_common::INTERNAL_PREFIX`).
const ERR_RESERVED_KEY: &str = "ERR keys that begin with the bytes 0xFF 0x72 0x00 are reserved for the chunks of large collections";

/// The keys of a command, by its key positions (Redis's first key, last key, step).
pub fn command_keys<'a, 'b>(
    spec: &Spec,
    args: &'b [&'a [u8]],
) -> impl Iterator<Item = &'a [u8]> + 'b {
    let (dest, first, end, step) = key_positions(spec, args);
    dest.into_iter()
        .chain((first..end).step_by(step))
        .map(move |i| args[i])
}

/// Where a command's keys are: a destination key's position, then `first..end` by `step` (an
/// empty range for none). Movable keys (XREAD's after STREAMS, and those counted by a
/// `numkeys` argument) are found in the arguments.
fn key_positions(spec: &Spec, args: &[&[u8]]) -> (Option<usize>, usize, usize, usize) {
    if spec.name == "sort" {
        return (sort::store_position(args), 1, 2.min(args.len()), 1);
    }
    if spec.name == "migrate" {
        return match dump::migrate_keys(args) {
            Some((first, end)) => (None, first, end, 1),
            None => (None, 0, 0, 1),
        };
    }
    if spec.name == "xread" {
        return match streams::xread_streams(args) {
            Ok((first, n)) => (None, first, first + n, 1),
            Err(_) => (None, 0, 0, 1),
        };
    }
    if spec.name == "xreadgroup" {
        return match stream_groups::xreadgroup_streams(args) {
            Some((first, n)) => (None, first, first + n, 1),
            None => (None, 0, 0, 1),
        };
    }
    // (destination, position of numkeys) of the `numkeys key [key ...]` commands.
    let numkeys = match spec.name {
        "sintercard" | "zintercard" | "zunion" | "zinter" | "zdiff" | "lmpop" | "zmpop" => {
            Some((None, 1))
        }
        "blmpop" | "bzmpop" | "eval" | "evalsha" | "eval_ro" | "evalsha_ro" => Some((None, 2)),
        "zunionstore" | "zinterstore" | "zdiffstore" => Some((Some(1), 2)),
        _ => None,
    };
    if let Some((dest, at)) = numkeys {
        let n = args
            .get(at)
            .and_then(|a| parse_i64(a))
            .filter(|&n| n > 0)
            .map_or(0, |n| (n as u64).min((args.len() - at - 1) as u64) as usize);
        return (dest.filter(|&d| d < args.len()), at + 1, at + 1 + n, 1);
    }
    let first = spec.first_key.max(0) as usize;
    let last = if spec.last_key < 0 {
        (args.len() as i64 + i64::from(spec.last_key)).max(0) as usize
    } else {
        spec.last_key as usize
    };
    let step = spec.step.max(1) as usize;
    let end = if first == 0 {
        0
    } else {
        (last + 1).min(args.len())
    };
    (None, first, end, step)
}

/// Redis Cluster's routing answer for a command's keys on a cluster server: Ok when every key is
/// in one slot that this server masters. `forwarded`: keys may span slots, each served here,
/// and none in `refused` (slots refused to an earlier command of the batch).
fn cluster_check(
    member: Option<&std::sync::Arc<crate::cluster::Member>>,
    spec: &Spec,
    args: &[&[u8]],
    forwarded: bool,
    readonly: bool,
    refused: &std::collections::HashSet<u16>,
) -> Result<(), String> {
    let Some(member) = member else {
        return Ok(());
    };
    if forwarded {
        let view = member.view();
        if spec.has_keys() {
            if let Some(refusal) = member.lease_refusal() {
                return Err(refusal);
            }
        }
        for key in command_keys(spec, args) {
            let slot = key_slot(key);
            if refused.contains(&slot) {
                return Err(format!(
                    "TRYAGAIN slot {slot} was refused to an earlier command of this batch; retry"
                ));
            }
            match view.route(slot) {
                crate::cluster::Route::Here => {}
                crate::cluster::Route::Waiting(why) => {
                    return Err(crate::cluster::Route::waiting_error(slot, &why))
                }
                crate::cluster::Route::Recovering => {
                    member.demand(&view, slot);
                    return Err(view.unavailable_error(slot));
                }
                _ => {
                    return Err(format!(
                    "TRYAGAIN slot {slot} is not served by this server at map version {}; retry",
                    view.map.version
                ))
                }
            }
        }
        return Ok(());
    }
    let mut keys = command_keys(spec, args);
    let Some(first) = keys.next() else {
        return Ok(());
    };
    let slot = key_slot(first);
    if keys.any(|k| key_slot(k) != slot) {
        return Err("CROSSSLOT Keys in request don't hash to the same slot".into());
    }
    if let Some(refusal) = member.lease_refusal() {
        return Err(refusal);
    }
    let view = member.view();
    match view.route(slot) {
        crate::cluster::Route::Here => Ok(()),
        // A READONLY connection reads from this server where it mirrors the slot and its
        // memory is complete (it applied every acknowledged write).
        crate::cluster::Route::Moved(_)
            if readonly
                && spec.flags.contains(&"readonly")
                && view.mirror_of(slot) == view.me
                && view
                    .map
                    .tablet_at(ramlog_cluster::DEFAULT_TABLE, slot)
                    .and_then(|t| member.mirrors.get(t.table, t.first_slot))
                    .is_some_and(|m| m.is_ready()) =>
        {
            Ok(())
        }
        crate::cluster::Route::Moved(addr) => Err(format!("MOVED {slot} {addr}")),
        crate::cluster::Route::Down => Err("CLUSTERDOWN Hash slot not served".into()),
        crate::cluster::Route::Recovering => {
            member.demand(&view, slot);
            Err(view.unavailable_error(slot))
        }
        crate::cluster::Route::Waiting(why) => {
            Err(crate::cluster::Route::waiting_error(slot, &why))
        }
    }
}

/// The checks after routing, then the command (or its queueing inside MULTI).
fn run_checked(
    ctx: &mut Ctx<'_>,
    spec: &'static Spec,
    args: &[&[u8]],
    in_multi: bool,
    wrote: &mut bool,
) {
    let node = ctx.node;
    // RESP2: a subscribed connection takes only the pub/sub commands, PING, QUIT and RESET.
    if ctx.session.subscribed()
        && ctx.session.protocol == 2
        && !ctx.session.scripting
        && !matches!(
            spec.name,
            "subscribe"
                | "unsubscribe"
                | "psubscribe"
                | "punsubscribe"
                | "ssubscribe"
                | "sunsubscribe"
                | "ping"
                | "quit"
                | "reset"
        )
    {
        return ctx.enc.error(&format!(
            "ERR Can't execute '{}': only (P|S)SUBSCRIBE / (P|S)UNSUBSCRIBE / PING / QUIT / RESET are allowed in this context",
            spec.name
        ));
    }
    if ctx.session.subscribed()
        && ctx.session.protocol == 2
        && !ctx.session.scripting
        && spec.name == "ping"
    {
        // A subscribed RESP2 connection's PING answers ["pong", message].
        ctx.enc.array(2);
        ctx.enc.bulk(b"pong");
        ctx.enc.bulk(args.get(1).copied().unwrap_or_default());
        return;
    }
    // Redis's CMD_NO_MULTI (SHUTDOWN): refused inside a transaction, which EXEC then aborts.
    if in_multi && spec.flags.contains(&"no_multi") {
        ctx.session.multi_failed = true;
        return ctx
            .enc
            .error("ERR Command not allowed inside a transaction");
    }
    // As Redis: while persistence is failing, write commands are refused before they run
    // (or are queued: the transaction is then aborted).
    if spec.is_write() {
        if let Some(refusal) = node.write_refusal() {
            if in_multi {
                ctx.session.multi_failed = true;
            }
            let reason = match &refusal {
                NodeError::WritesRefused { reason } => reason.as_str(),
                _ => "persistence failed",
            };
            return ctx.enc.error(&misconf(reason));
        }
    }
    // As Redis: WATCH inside MULTI is answered at once with an error, and the transaction goes on.
    if in_multi && spec.name == "watch" {
        return ctx.enc.error("ERR WATCH inside MULTI is not allowed");
    }
    if in_multi && !matches!(spec.name, "exec" | "discard" | "multi" | "quit") {
        if let Some(queue) = ctx.session.multi.as_mut() {
            queue.push(args.iter().map(|a| a.to_vec()).collect());
        }
        return ctx.enc.simple("QUEUED");
    }
    *wrote = spec.is_write();
    if !spec.is_write() || ctx.node.settings.notify() == 0 {
        return (spec.handler)(ctx, args);
    }
    // Keyspace notifications: the command's events, judged by its reply.
    let before = notify::before(ctx, spec, args);
    let start = ctx.enc.buffer().len();
    (spec.handler)(ctx, args);
    let reply = ctx.enc.buffer()[start..].to_vec();
    notify::after(ctx, spec, args, &reply, before);
}

pub(crate) fn arity_ok(arity: i32, argc: usize) -> bool {
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

fn engine_error(ctx: &mut Ctx<'_>, e: &NodeError) {
    let e = match e {
        NodeError::Engine(e) => e,
        NodeError::WritesRefused { reason } => return ctx.enc.error(&misconf(reason)),
    };
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
        EngineError::TabletFull { .. } => format!("OOM {e}"),
        EngineError::NotAnInteger => ERR_NOT_INTEGER.to_string(),
        EngineError::IncrementOverflow => ERR_OVERFLOW.to_string(),
        // A request that reached the tablet as it froze for its move: the client asks again
        // (Redis Cluster's answer while a slot cannot be served for a moment).
        EngineError::Frozen => format!("TRYAGAIN {e}"),
        other => format!("ERR {other}"),
    };
    ctx.enc.error(&message);
}

/// Redis's `string2ll`: optional '-', digits, no '+', no spaces, no leading zeros, fits in i64.
pub use ramlog_common::parse_redis_i64 as parse_i64;

fn eq_ignore_case(a: &[u8], b: &str) -> bool {
    a.eq_ignore_ascii_case(b.as_bytes())
}

/// Reads the key, counting a hit or a miss.
fn read(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<Option<Object>, NodeError> {
    let node = ctx.node;
    let found = node.get(node.tablet_of(key), key, &mut ctx.session.acks)?;
    let counter = if found.is_some() {
        &ctx.node.metrics.keyspace_hits
    } else {
        &ctx.node.metrics.keyspace_misses
    };
    counter.fetch_add(1, Ordering::Relaxed);
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_table_fits_the_command_stats() {
        assert!(stat_names().len() <= crate::node::metrics::COMMANDS_MAX);
        let (config, _) = lookup_at(b"config").unwrap();
        let at = stat_index(config, &[b"CONFIG", b"Get", b"x"]);
        assert_eq!(stat_names()[at], "config|get");
        assert_eq!(stat_index(config, &[b"config", b"nosuch"]), config);
        let (get, _) = lookup_at(b"get").unwrap();
        assert_eq!(stat_index(get, &[b"get", b"help"]), get);
        for (command, _) in SUBCOMMANDS {
            assert!(lookup(command.as_bytes()).is_some(), "{command}");
        }
    }

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
