//! Keyspace notifications (Redis's `notify.c`): with `notify-keyspace-events` set, a write
//! command publishes `__keyspace@0__:<key>` with its event's name and `__keyevent@0__:<event>`
//! with the key, to this server's subscribers (as in Redis Cluster, where each node publishes
//! its own keys' events and nothing is broadcast); a cluster server also sends them to the
//! routing-port subscribers of the other servers (a routing port stands for the whole cluster). The events, their names and their classes are
//! Redis 7's; an event is published after the command succeeds, in the order Redis publishes
//! them: `new` (a key the command created), the command's own events, then `del` for a key the
//! command left absent (DEL and UNLINK, the last element popped or removed, an empty *STORE
//! result). `expired` comes from the engine, whenever it removes an expired key.

use super::{Ctx, Spec};
use crate::node::pubsub::PubSub;
use crate::node::settings::RuntimeSettings;
use crate::node::Node;
use std::sync::Arc;

pub use crate::node::keyspace_events::*;

/// Publishes event `name` of `class` on `key`, if the settings ask for it.
pub fn emit(settings: &RuntimeSettings, pubsub: &PubSub, class: u32, name: &str, key: &[u8]) {
    emit_to(settings, pubsub, class, name, key, true)
}

/// [`emit`]; `forward`: also to the other servers' routing-port subscribers (this server
/// masters the key; a mirror's copy does not).
fn emit_to(
    settings: &RuntimeSettings,
    pubsub: &PubSub,
    class: u32,
    name: &str,
    key: &[u8],
    forward: bool,
) {
    let flags = settings.notify();
    if flags & class == 0 {
        return;
    }
    let publish = |channel: &[u8], payload: &[u8]| {
        if forward {
            pubsub.publish_key_event(channel, payload);
        } else {
            pubsub.publish(channel, payload, false);
        }
    };
    if flags & KEYSPACE != 0 {
        let mut channel = b"__keyspace@0__:".to_vec();
        channel.extend_from_slice(key);
        publish(&channel, name.as_bytes());
    }
    if flags & KEYEVENT != 0 {
        let channel = format!("__keyevent@0__:{name}");
        publish(channel.as_bytes(), key);
    }
}

/// Publishes `expired` for every key the engine removes when it expires (internal keys aside);
/// a mirror's copies to this server's subscribers only (the master forwards its own).
pub fn watch_expiry(node: &Arc<Node>) {
    let (settings, pubsub) = (Arc::clone(&node.settings), Arc::clone(&node.pubsub));
    let weak = Arc::downgrade(node);
    node.engine().on_expired(Box::new(move |table, key| {
        if ramlog_common::is_internal(key) {
            return;
        }
        let mirrored = weak.upgrade().is_some_and(|node| {
            node.locate(table, key)
                .is_some_and(|tablet| node.keyspace.is_hidden(tablet))
        });
        emit_to(&settings, &pubsub, EXPIRED, "expired", key, !mirrored);
    }));
}

/// What the keys of a write command were before it ran, when the settings ask for `new` or
/// `del` events (one index lookup per key; nothing when they do not).
pub(super) struct Before {
    existed: Vec<bool>,
}

/// Whether each key exists now.
fn existence(ctx: &mut Ctx<'_>, keys: &[&[u8]]) -> Vec<bool> {
    let node = ctx.node;
    keys.iter()
        .map(|k| {
            node.read_with(node.tablet_of(k), k, &mut ctx.session.acks, |_, _, _| ())
                .is_ok_and(|found| found.is_some())
        })
        .collect()
}

pub(super) fn before(ctx: &mut Ctx<'_>, spec: &Spec, args: &[&[u8]]) -> Option<Before> {
    let flags = ctx.node.settings.notify();
    if flags & (NEW | GENERIC) == 0 || flags & (KEYSPACE | KEYEVENT) == 0 {
        return None;
    }
    let keys: Vec<&[u8]> = super::command_keys(spec, args).collect();
    Some(Before {
        existed: existence(ctx, &keys),
    })
}

/// When a command's event fires, judged by its reply.
#[derive(Clone, Copy)]
enum When {
    /// Any reply but an error.
    Done,
    /// An integer reply above 0.
    Positive,
    /// A reply that is not null (nor an empty array).
    Found,
}

/// Which key an event names.
#[derive(Clone, Copy)]
enum Which {
    Arg(usize),
    /// Every other argument from this one (MSET's keys).
    Pairs(usize),
    /// The key the reply names first (BLPOP, LMPOP, BZPOPMIN, ZMPOP).
    Replied,
}

struct Event {
    class: u32,
    name: &'static str,
    which: Which,
    when: When,
}

const fn ev(class: u32, name: &'static str, which: Which, when: When) -> Event {
    Event {
        class,
        name,
        which,
        when,
    }
}

fn has_option(args: &[&[u8]], from: usize, names: &[&str]) -> bool {
    args.iter()
        .skip(from)
        .any(|a| names.iter().any(|n| a.eq_ignore_ascii_case(n.as_bytes())))
}

fn side(arg: Option<&&[u8]>, left: &'static str, right: &'static str) -> &'static str {
    match arg {
        Some(a) if a.eq_ignore_ascii_case(b"right") || a.eq_ignore_ascii_case(b"max") => right,
        _ => left,
    }
}

/// The events a write command publishes on success (Redis 7's names and classes).
fn events(name: &str, args: &[&[u8]]) -> Vec<Event> {
    use When::*;
    use Which::*;
    let one = |class, event, when| vec![ev(class, event, Arg(1), when)];
    match name {
        "set" => {
            let conditional = has_option(args, 3, &["nx", "xx"]) && !has_option(args, 3, &["get"]);
            let mut out = vec![ev(
                STRING,
                "set",
                Arg(1),
                if conditional { Found } else { Done },
            )];
            if has_option(args, 3, &["ex", "px", "exat", "pxat"]) {
                out.push(ev(
                    GENERIC,
                    "expire",
                    Arg(1),
                    if conditional { Found } else { Done },
                ));
            }
            out
        }
        "setex" | "psetex" => vec![
            ev(STRING, "set", Arg(1), Done),
            ev(GENERIC, "expire", Arg(1), Done),
        ],
        "getset" => one(STRING, "set", Done),
        "setnx" => one(STRING, "set", Positive),
        "mset" => vec![ev(STRING, "set", Pairs(1), Done)],
        "msetnx" => vec![ev(STRING, "set", Pairs(1), Positive)],
        "append" => one(STRING, "append", Done),
        "setrange" => one(STRING, "setrange", Done),
        "incr" | "decr" | "incrby" | "decrby" => one(STRING, "incrby", Done),
        "incrbyfloat" => one(STRING, "incrbyfloat", Done),
        "expire" | "pexpire" | "expireat" | "pexpireat" => one(GENERIC, "expire", Positive),
        "persist" => one(GENERIC, "persist", Positive),
        "getex" if has_option(args, 2, &["persist"]) => one(GENERIC, "persist", Found),
        "getex" if args.len() > 2 => one(GENERIC, "expire", Found),
        "rename" | "renamenx" => {
            let when = if name == "rename" { Done } else { Positive };
            vec![
                ev(GENERIC, "rename_from", Arg(1), when),
                ev(GENERIC, "rename_to", Arg(2), when),
            ]
        }
        "copy" => vec![ev(GENERIC, "copy_to", Arg(2), Positive)],
        "restore" => one(GENERIC, "restore", Done),
        "lpush" => one(LIST, "lpush", Done),
        "rpush" => one(LIST, "rpush", Done),
        "lpushx" => one(LIST, "lpush", Positive),
        "rpushx" => one(LIST, "rpush", Positive),
        "linsert" => one(LIST, "linsert", Positive),
        "lset" => one(LIST, "lset", Done),
        "lrem" => one(LIST, "lrem", Positive),
        "ltrim" => one(LIST, "ltrim", Done),
        "lpop" => one(LIST, "lpop", Found),
        "rpop" => one(LIST, "rpop", Found),
        "blpop" => vec![ev(LIST, "lpop", Replied, Found)],
        "brpop" => vec![ev(LIST, "rpop", Replied, Found)],
        "rpoplpush" | "brpoplpush" => vec![
            ev(LIST, "rpop", Arg(1), Found),
            ev(LIST, "lpush", Arg(2), Found),
        ],
        "lmove" | "blmove" => vec![
            ev(LIST, side(args.get(3), "lpop", "rpop"), Arg(1), Found),
            ev(LIST, side(args.get(4), "lpush", "rpush"), Arg(2), Found),
        ],
        "lmpop" | "blmpop" => {
            let at = if name == "lmpop" { 1 } else { 2 };
            let n = args
                .get(at)
                .and_then(|a| std::str::from_utf8(a).ok()?.parse::<usize>().ok())
                .unwrap_or(0);
            vec![ev(
                LIST,
                side(args.get(at + 1 + n), "lpop", "rpop"),
                Replied,
                Found,
            )]
        }
        "sadd" => one(SET, "sadd", Positive),
        "srem" => one(SET, "srem", Positive),
        "spop" => one(SET, "spop", Found),
        "smove" => vec![
            ev(SET, "srem", Arg(1), Positive),
            ev(SET, "sadd", Arg(2), Positive),
        ],
        "sinterstore" => one(SET, "sinterstore", Positive),
        "sunionstore" => one(SET, "sunionstore", Positive),
        "sdiffstore" => one(SET, "sdiffstore", Positive),
        "hset" | "hmset" => one(HASH, "hset", Done),
        "hsetnx" => one(HASH, "hset", Positive),
        "hdel" => one(HASH, "hdel", Positive),
        "hincrby" => one(HASH, "hincrby", Done),
        "hincrbyfloat" => one(HASH, "hincrbyfloat", Done),
        "zadd" if has_option(args, 2, &["incr"]) => one(ZSET, "zincr", Found),
        "zadd" => one(ZSET, "zadd", Found),
        "zincrby" => one(ZSET, "zincr", Done),
        "zrem" => one(ZSET, "zrem", Positive),
        "zremrangebyscore" => one(ZSET, "zremrangebyscore", Positive),
        "zremrangebyrank" => one(ZSET, "zremrangebyrank", Positive),
        "zremrangebylex" => one(ZSET, "zremrangebylex", Positive),
        "zpopmin" => one(ZSET, "zpopmin", Found),
        "zpopmax" => one(ZSET, "zpopmax", Found),
        "bzpopmin" => vec![ev(ZSET, "zpopmin", Replied, Found)],
        "bzpopmax" => vec![ev(ZSET, "zpopmax", Replied, Found)],
        "zmpop" | "bzmpop" => {
            let at = if name == "zmpop" { 1 } else { 2 };
            let n = args
                .get(at)
                .and_then(|a| std::str::from_utf8(a).ok()?.parse::<usize>().ok())
                .unwrap_or(0);
            vec![ev(
                ZSET,
                side(args.get(at + 1 + n), "zpopmin", "zpopmax"),
                Replied,
                Found,
            )]
        }
        "zunionstore" => one(ZSET, "zunionstore", Positive),
        "zinterstore" => one(ZSET, "zinterstore", Positive),
        "zdiffstore" => one(ZSET, "zdiffstore", Positive),
        "zrangestore" => one(ZSET, "zrangestore", Positive),
        "xadd" => one(STREAM, "xadd", Found),
        "xtrim" => one(STREAM, "xtrim", Positive),
        "xdel" => one(STREAM, "xdel", Positive),
        "xsetid" => one(STREAM, "xsetid", Done),
        "sort" => super::sort::store_position(args)
            .map(|at| vec![ev(LIST, "sortstore", Arg(at), Positive)])
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// The first bulk string of an array reply (`*2 $3 key ...`), as RESP2 and RESP3 write it.
fn first_bulk(reply: &[u8]) -> Option<Vec<u8>> {
    let mut lines = reply.split(|b| *b == b'\n');
    let head = lines.next()?;
    if !matches!(head.first(), Some(b'*' | b'>')) {
        return None;
    }
    let len_line = lines.next()?;
    if len_line.first() != Some(&b'$') {
        return None;
    }
    let len: usize = std::str::from_utf8(&len_line[1..len_line.len().saturating_sub(1)])
        .ok()?
        .parse()
        .ok()?;
    let start = head.len() + 1 + len_line.len() + 1;
    reply.get(start..start + len).map(<[u8]>::to_vec)
}

/// Publishes a write command's events once it has run; `reply` is what it answered.
pub(super) fn after(
    ctx: &mut Ctx<'_>,
    spec: &Spec,
    args: &[&[u8]],
    reply: &[u8],
    before: Option<Before>,
) {
    let node = ctx.node;
    let flags = node.settings.notify();
    if flags & (KEYSPACE | KEYEVENT) == 0 || reply.first() == Some(&b'-') {
        return;
    }
    let (settings, pubsub) = (&node.settings, &node.pubsub);
    let keys: Vec<&[u8]> = super::command_keys(spec, args).collect();
    let now = before.as_ref().map(|_| existence(ctx, &keys));
    if let (Some(before), Some(now)) = (&before, &now) {
        for (i, key) in keys.iter().enumerate() {
            if !before.existed[i] && now[i] {
                emit(settings, pubsub, NEW, "new", key);
            }
        }
    }
    let integer = (reply.first() == Some(&b':'))
        .then(|| {
            std::str::from_utf8(&reply[1..reply.len().saturating_sub(2)])
                .ok()?
                .parse::<i64>()
                .ok()
        })
        .flatten();
    let null = matches!(
        reply,
        [b'_', ..]
            | [b'$', b'-', ..]
            | [b'*', b'-', ..]
            | [b'*', b'0', b'\r', ..]
            | [b'~', b'0', b'\r', ..]
    );
    for e in events(spec.name, args) {
        let fires = match e.when {
            When::Done => true,
            When::Positive => integer.is_some_and(|n| n > 0),
            When::Found => !null,
        };
        if !fires {
            continue;
        }
        match e.which {
            Which::Arg(i) => {
                if let Some(key) = args.get(i) {
                    emit(settings, pubsub, e.class, e.name, key);
                }
            }
            Which::Pairs(from) => {
                for key in args.iter().skip(from).step_by(2) {
                    emit(settings, pubsub, e.class, e.name, key);
                }
            }
            Which::Replied => {
                if let Some(key) = first_bulk(reply) {
                    emit(settings, pubsub, e.class, e.name, &key);
                }
            }
        }
    }
    if let (Some(before), Some(now)) = (&before, &now) {
        if matches!(spec.name, "rename" | "renamenx" | "move") {
            return;
        }
        for (i, key) in keys.iter().enumerate() {
            if before.existed[i] && !now[i] {
                emit(settings, pubsub, GENERIC, "del", key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_a_blocking_pop_answered_is_found() {
        assert_eq!(
            first_bulk(b"*2\r\n$5\r\nqueue\r\n$1\r\nx\r\n"),
            Some(b"queue".to_vec())
        );
        assert_eq!(first_bulk(b"*-1\r\n"), None);
        assert_eq!(first_bulk(b"$3\r\nabc\r\n"), None);
    }
}
