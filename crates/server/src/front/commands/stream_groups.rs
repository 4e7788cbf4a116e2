//! Stream consumer groups (Redis's `t_stream.c`): XGROUP, XREADGROUP (BLOCK through
//! `front::blocking`), XACK, XPENDING, XCLAIM, XAUTOCLAIM, XSETID, and XINFO.
//!
//! A stream's groups, consumers and pending entries live in the stream's own value
//! ([`ramlog_proto::types::Group`]), so every command here that changes them rewrites the stream
//! as one write, replicated, recovered, copied and moved as any value.

use super::streams::{id_text, parse_bound, parse_id, reply_entries, ERR_ID};
use super::typed::*;
use super::*;
use crate::node::keyspace_events::STREAM;
use ramlog_proto::types::{Consumer, Fields, Group, Pending, Stream, StreamEntry, StreamId};
use std::collections::BTreeMap;

fn nogroup(key: &[u8], group: &[u8], tail: &str) -> String {
    format!(
        "NOGROUP No such key '{}' or consumer group '{}'{tail}",
        String::from_utf8_lossy(key),
        String::from_utf8_lossy(group)
    )
}

fn next_id(id: StreamId) -> Option<StreamId> {
    match id.1.checked_add(1) {
        Some(seq) => Some((id.0, seq)),
        None => id.0.checked_add(1).map(|ms| (ms, 0)),
    }
}

/// Publishes `event` for `key` (class `t`), as the command's own events are.
fn notify(ctx: &Ctx<'_>, event: &str, key: &[u8]) {
    super::notify::emit(&ctx.node.settings, &ctx.node.pubsub, STREAM, event, key);
}

/// A group's lag: entries not yet delivered to it, when that can be known.
fn lag(s: &Stream, g: &Group) -> Option<u64> {
    if s.entries_added == 0 {
        return Some(0);
    }
    if let Some(read) = g.entries_read {
        if !s.has_tombstones_from(g.last_delivered) {
            return Some(s.entries_added.saturating_sub(read));
        }
    }
    s.entries_up_to(g.last_delivered)
        .map(|read| s.entries_added.saturating_sub(read))
}

fn integer_or_null(ctx: &mut Ctx<'_>, v: Option<u64>) {
    match v {
        Some(n) => ctx.enc.integer(n as i64),
        None => ctx.enc.null(),
    }
}

/// Adds the consumer if the group lacks it; whether it did.
fn ensure_consumer(g: &mut Group, name: &[u8], now: u64) -> bool {
    if g.consumers.contains_key(name) {
        return false;
    }
    g.consumers.insert(
        name.to_vec(),
        Consumer {
            seen_ms: now,
            active_ms: None,
        },
    );
    true
}

/// Answers `<command> HELP` (true), or its arity error when more arguments follow.
fn answered_help(ctx: &mut Ctx<'_>, command: &str, args: &[&[u8]], lines: &[&str]) -> bool {
    if !eq_ignore_case(args[1], "help") {
        return false;
    }
    if args.len() > 2 {
        ctx.enc.error(&format!(
            "ERR wrong number of arguments for '{command}|help' command"
        ));
    } else {
        help(ctx, lines);
    }
    true
}

fn help(ctx: &mut Ctx<'_>, lines: &[&str]) {
    ctx.enc.array(lines.len() + 2);
    for l in lines {
        ctx.enc.simple(l);
    }
    ctx.enc.simple("HELP");
    ctx.enc.simple("    Print this help.");
}

fn subcommand_syntax(ctx: &mut Ctx<'_>, command: &str, sub: &[u8]) {
    ctx.enc.error(&format!(
        "ERR unknown subcommand or wrong number of arguments for '{}'. Try {command} HELP.",
        String::from_utf8_lossy(sub)
            .chars()
            .take(128)
            .collect::<String>()
    ));
}

/// XGROUP CREATE|SETID|DESTROY|CREATECONSUMER|DELCONSUMER|HELP
pub(super) fn cmd_xgroup(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1].to_ascii_lowercase();
    if answered_help(
        ctx,
        "xgroup",
        args,
        &[
            "XGROUP <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "CREATE <key> <groupname> <id|$> [option]",
            "    Create a new consumer group. Options are:",
            "    * MKSTREAM",
            "      Create the empty stream if it does not exist.",
            "    * ENTRIESREAD entries_read",
            "      Set the group's entries_read counter (internal use).",
            "CREATECONSUMER <key> <groupname> <consumer>",
            "    Create a new consumer in the specified group.",
            "DELCONSUMER <key> <groupname> <consumer>",
            "    Remove the specified consumer.",
            "DESTROY <key> <groupname>",
            "    Remove the specified group.",
            "SETID <key> <groupname> <id|$> [ENTRIESREAD entries_read]",
            "    Set the current group ID and entries_read counter.",
        ],
    ) {
        return;
    }
    let arity_ok = match sub.as_slice() {
        b"create" => (5..=8).contains(&args.len()),
        b"setid" => args.len() == 5 || args.len() == 7,
        b"destroy" => args.len() == 4,
        b"createconsumer" | b"delconsumer" => args.len() == 5,
        _ => false,
    };
    if args.len() < 4 || !arity_ok {
        return subcommand_syntax(ctx, "XGROUP", args[1]);
    }
    let (key, group) = (args[2], args[3]);
    let mut mkstream = false;
    let mut entries_read: Option<u64> = None;
    let mut i = 5;
    while i < args.len() {
        if sub == b"create" && eq_ignore_case(args[i], "mkstream") {
            mkstream = true;
            i += 1;
        } else if (sub == b"create" || sub == b"setid")
            && eq_ignore_case(args[i], "entriesread")
            && i + 1 < args.len()
        {
            match parse_i64(args[i + 1]) {
                Some(-1) => entries_read = None,
                Some(n) if n >= 0 => entries_read = Some(n as u64),
                Some(_) => {
                    return ctx
                        .enc
                        .error("ERR value for ENTRIESREAD must be positive or -1")
                }
                None => return ctx.enc.error(ERR_NOT_INTEGER),
            }
            i += 2;
        } else {
            return subcommand_syntax(ctx, "XGROUP", args[1]);
        }
    }
    // None: `$` (the stream's last id). SETID also takes `-` and `+`, as Redis parses it.
    let id: Option<StreamId> = match args.get(4) {
        Some(a) if (sub == b"create" || sub == b"setid") && *a == b"$" => None,
        Some(&b"-") if sub == b"setid" => Some((0, 0)),
        Some(&b"+") if sub == b"setid" => Some((u64::MAX, u64::MAX)),
        Some(a) if sub == b"create" || sub == b"setid" => match parse_id(a, 0) {
            Some(id) => Some(id),
            None => return ctx.enc.error(ERR_ID),
        },
        _ => None,
    };
    let now = now_ms();
    let missing = "ERR The XGROUP subcommand requires the key to exist. Note that for CREATE you may want to use the MKSTREAM option to create an empty stream automatically.";
    let no_such_group = || {
        format!(
            "NOGROUP No such consumer group '{}' for key name '{}'",
            String::from_utf8_lossy(group),
            String::from_utf8_lossy(key)
        )
    };
    enum Out {
        Ok,
        Int(i64),
    }
    let mut created_consumer = false;
    let mut event: Option<&str> = None;
    let done = update::<Stream, Out>(ctx, key, |s, existed| {
        created_consumer = false;
        event = None;
        if !existed && !mkstream {
            return Err(missing.into());
        }
        match sub.as_slice() {
            b"create" => {
                if s.groups.contains_key(group) {
                    return Err("BUSYGROUP Consumer Group name already exists".into());
                }
                s.groups.insert(
                    group.to_vec(),
                    Group {
                        last_delivered: id.unwrap_or(s.last),
                        entries_read,
                        ..Default::default()
                    },
                );
                event = Some("xgroup-create");
                Ok((Out::Ok, true))
            }
            b"setid" => {
                let last = s.last;
                let g = s.groups.get_mut(group).ok_or_else(no_such_group)?;
                g.last_delivered = id.unwrap_or(last);
                g.entries_read = entries_read;
                event = Some("xgroup-setid");
                Ok((Out::Ok, true))
            }
            b"destroy" => {
                if s.groups.remove(group).is_none() {
                    return Ok((Out::Int(0), false));
                }
                event = Some("xgroup-destroy");
                Ok((Out::Int(1), true))
            }
            b"createconsumer" => {
                let g = s.groups.get_mut(group).ok_or_else(no_such_group)?;
                created_consumer = ensure_consumer(g, args[4], now);
                Ok((Out::Int(created_consumer as i64), created_consumer))
            }
            _ => {
                let g = s.groups.get_mut(group).ok_or_else(no_such_group)?;
                if g.consumers.remove(args[4]).is_none() {
                    return Ok((Out::Int(0), false));
                }
                let before = g.pending.len();
                g.pending.retain(|_, p| p.consumer != args[4]);
                event = Some("xgroup-delconsumer");
                Ok((Out::Int((before - g.pending.len()) as i64), true))
            }
        }
    });
    if let Ok(out) = done {
        if created_consumer {
            notify(ctx, "xgroup-createconsumer", key);
        }
        if let Some(e) = event {
            notify(ctx, e, key);
        }
        match out {
            Out::Ok => ctx.enc.simple("OK"),
            Out::Int(n) => ctx.enc.integer(n),
        }
    }
}

/// XSETID key last-id [ENTRIESADDED entries-added] [MAXDELETEDID max-deleted-id]
pub(super) fn cmd_xsetid(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Some(id) = parse_id(args[2], 0) else {
        return ctx.enc.error(ERR_ID);
    };
    let mut entries_added: Option<u64> = None;
    let mut max_deleted: StreamId = (0, 0);
    let mut i = 3;
    while i < args.len() {
        let more = i + 1 < args.len();
        if eq_ignore_case(args[i], "entriesadded") && more {
            match parse_i64(args[i + 1]) {
                Some(n) if n >= 0 => entries_added = Some(n as u64),
                Some(_) => return ctx.enc.error("ERR entries_added must be positive"),
                None => return ctx.enc.error(ERR_NOT_INTEGER),
            }
        } else if eq_ignore_case(args[i], "maxdeletedid") && more {
            match parse_id(args[i + 1], 0) {
                Some(m) if id < m => {
                    return ctx.enc.error(
                        "ERR The ID specified in XSETID is smaller than the provided max_deleted_entry_id",
                    )
                }
                Some(m) => max_deleted = m,
                None => return ctx.enc.error(ERR_ID),
            }
        } else {
            return ctx.enc.error(ERR_SYNTAX);
        }
        i += 2;
    }
    let done = update::<Stream, ()>(ctx, args[1], |s, existed| {
        if !existed {
            return Err("ERR no such key".into());
        }
        if id < s.max_deleted {
            return Err(
                "ERR The ID specified in XSETID is smaller than current max_deleted_entry_id"
                    .into(),
            );
        }
        if let Some((top, _)) = s.entries.last() {
            if id < *top {
                return Err(
                    "ERR The ID specified in XSETID is smaller than the target stream top item"
                        .into(),
                );
            }
            if entries_added.is_some_and(|n| (s.entries.len() as u64) > n) {
                return Err(
                    "ERR The entries_added specified in XSETID is smaller than the target stream length"
                        .into(),
                );
            }
        }
        s.last = id;
        if let Some(n) = entries_added {
            s.entries_added = n;
        }
        if max_deleted != (0, 0) {
            s.max_deleted = max_deleted;
        }
        Ok(((), true))
    });
    if done.is_ok() {
        ctx.enc.simple("OK");
    }
}

/// What XREADGROUP read from one stream: entries (None: a pending entry no longer in the
/// stream).
type Read = Vec<(StreamId, Option<Fields>)>;

/// Where XREADGROUP's parts are.
struct ReadGroup<'a> {
    group: &'a [u8],
    consumer: &'a [u8],
    count: Option<usize>,
    noack: bool,
    /// Index of the first key and the number of keys.
    first: usize,
    n: usize,
}

/// Parses XREADGROUP's options (as Redis does, in order up to STREAMS).
fn parse_readgroup<'a>(args: &[&'a [u8]]) -> Result<ReadGroup<'a>, String> {
    let mut out = ReadGroup {
        group: &[],
        consumer: &[],
        count: None,
        noack: false,
        first: 0,
        n: 0,
    };
    let mut has_group = false;
    let mut i = 1;
    while i < args.len() {
        let more = args.len() - i - 1;
        let a = args[i];
        if eq_ignore_case(a, "block") && more > 0 {
            match parse_i64(args[i + 1]) {
                Some(ms) if ms >= 0 => {}
                Some(_) => return Err("ERR timeout is negative".into()),
                None => return Err("ERR timeout is not an integer or out of range".into()),
            }
            i += 2;
        } else if eq_ignore_case(a, "count") && more > 0 {
            match parse_i64(args[i + 1]) {
                Some(c) if c > 0 => out.count = Some(c as usize),
                Some(_) => out.count = None,
                None => return Err(ERR_NOT_INTEGER.into()),
            }
            i += 2;
        } else if eq_ignore_case(a, "streams") && more > 0 {
            if !more.is_multiple_of(2) {
                return Err("ERR Unbalanced 'xreadgroup' list of streams: for each stream key an ID or '>' must be specified.".into());
            }
            out.first = i + 1;
            out.n = more / 2;
            break;
        } else if eq_ignore_case(a, "group") && more >= 2 {
            out.group = args[i + 1];
            out.consumer = args[i + 2];
            has_group = true;
            i += 3;
        } else if eq_ignore_case(a, "noack") {
            out.noack = true;
            i += 1;
        } else {
            return Err(ERR_SYNTAX.into());
        }
    }
    if out.first == 0 {
        return Err(ERR_SYNTAX.into());
    }
    if !has_group {
        return Err("ERR Missing GROUP option for XREADGROUP".into());
    }
    Ok(out)
}

/// Where XREADGROUP's keys are: (index of the first key, number of keys).
pub(crate) fn xreadgroup_streams(args: &[&[u8]]) -> Option<(usize, usize)> {
    parse_readgroup(args).ok().map(|r| (r.first, r.n))
}

/// Delivers the entries after the group's last delivered id to `consumer` (Redis's
/// `streamReplyWithRange` with a group).
fn deliver_new(
    s: &mut Stream,
    group: &[u8],
    consumer: &[u8],
    count: Option<usize>,
    noack: bool,
    now: u64,
) -> Read {
    let after = s.groups[group].last_delivered;
    let start = s.entries.partition_point(|e| e.0 <= after);
    let end = count.map_or(s.entries.len(), |c| (start + c).min(s.entries.len()));
    let mut out = Vec::with_capacity(end - start);
    for i in start..end {
        let id = s.entries[i].0;
        let tombstones = s.has_tombstones_from(id);
        let estimate = s.entries_up_to(id);
        let added = s.entries_added;
        let g = s.groups.get_mut(group).expect("checked");
        if id > g.last_delivered {
            if g.entries_read.is_some() && !tombstones {
                g.entries_read = g.entries_read.map(|n| n + 1);
            } else if added > 0 {
                g.entries_read = estimate;
            }
            g.last_delivered = id;
        }
        if !noack {
            g.pending.insert(
                id,
                Pending {
                    consumer: consumer.to_vec(),
                    delivered_ms: now,
                    deliveries: 1,
                },
            );
            if let Some(c) = g.consumers.get_mut(consumer) {
                c.active_ms = Some(now);
            }
        }
        out.push((id, Some(s.entries[i].1.clone())));
    }
    out
}

/// The consumer's own pending entries after `after` (Redis's
/// `streamReplyWithRangeFromConsumerPEL`); each one still in the stream counts a delivery.
fn deliver_history(
    s: &mut Stream,
    group: &[u8],
    consumer: &[u8],
    after: StreamId,
    count: Option<usize>,
    now: u64,
) -> Read {
    let Some(start) = next_id(after) else {
        return Vec::new();
    };
    let ids: Vec<StreamId> = s.groups[group]
        .pending
        .range(start..)
        .filter(|(_, p)| p.consumer == consumer)
        .map(|(id, _)| *id)
        .take(count.unwrap_or(usize::MAX))
        .collect();
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        let fields = s.entry(id).map(|e| e.1.clone());
        if fields.is_some() {
            let p = s
                .groups
                .get_mut(group)
                .expect("checked")
                .pending
                .get_mut(&id);
            if let Some(p) = p {
                p.delivered_ms = now;
                p.deliveries += 1;
            }
        }
        out.push((id, fields));
    }
    out
}

fn reply_read(ctx: &mut Ctx<'_>, read: &Read) {
    ctx.enc.array(read.len());
    for (id, fields) in read {
        ctx.enc.array(2);
        ctx.enc.bulk(id_text(*id).as_bytes());
        match fields {
            Some(fv) => {
                ctx.enc.array(fv.len() * 2);
                for (f, v) in fv {
                    ctx.enc.bulk(f);
                    ctx.enc.bulk(v);
                }
            }
            None => ctx.enc.null_array(),
        }
    }
}

/// XREADGROUP GROUP group consumer [COUNT count] [BLOCK ms] [NOACK] STREAMS key ... id ...:
/// one try (with BLOCK and `>`, the connection blocks and tries again, see `front::blocking`).
pub(super) fn cmd_xreadgroup(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let rg = match parse_readgroup(args) {
        Ok(r) => r,
        Err(e) => return ctx.enc.error(&e),
    };
    let mut ids: Vec<Option<StreamId>> = Vec::with_capacity(rg.n);
    for k in 0..rg.n {
        let key = args[rg.first + k];
        let id_arg = args[rg.first + rg.n + k];
        let Ok(s) = load::<Stream>(ctx, key) else {
            return;
        };
        if !s.is_some_and(|s| s.groups.contains_key(rg.group)) {
            return ctx
                .enc
                .error(&nogroup(key, rg.group, " in XREADGROUP with GROUP option"));
        }
        ids.push(match id_arg {
            b"$" => return ctx.enc.error("ERR The $ ID is meaningless in the context of XREADGROUP: you want to read the history of this consumer by specifying a proper ID, or use the > ID to get new messages. The $ ID would just return an empty result set."),
            b">" => None,
            a => match parse_id(a, 0) {
                Some(id) => Some(id),
                None => return ctx.enc.error(ERR_ID),
            },
        });
    }
    let now = now_ms();
    let quiet = ctx.session.blocked_retry;
    let mut served: Vec<(&[u8], Read)> = Vec::new();
    for (k, id) in ids.iter().enumerate() {
        let key = args[rg.first + k];
        let mut created = false;
        let read = update::<Stream, Option<Read>>(ctx, key, |s, existed| {
            created = false;
            if !existed || !s.groups.contains_key(rg.group) {
                return Err(nogroup(key, rg.group, " in XREADGROUP with GROUP option"));
            }
            let g = s.groups.get_mut(rg.group).expect("checked");
            created = ensure_consumer(g, rg.consumer, now);
            if let Some(c) = g.consumers.get_mut(rg.consumer) {
                c.seen_ms = now;
            }
            let read = match id {
                Some(after) => Some(deliver_history(
                    s,
                    rg.group,
                    rg.consumer,
                    *after,
                    rg.count,
                    now,
                )),
                None => {
                    let last = s.groups[rg.group].last_delivered;
                    if s.entries.last().is_some_and(|e| e.0 > last) {
                        Some(deliver_new(
                            s,
                            rg.group,
                            rg.consumer,
                            rg.count,
                            rg.noack,
                            now,
                        ))
                    } else {
                        None
                    }
                }
            };
            // A blocked client's tries that read nothing leave the stream as it was (its seen
            // time is the first try's).
            let changed = read.is_some() || created || !quiet;
            Ok((read, changed))
        });
        match read {
            Ok(r) => {
                if created {
                    notify(ctx, "xgroup-createconsumer", key);
                }
                if let Some(r) = r {
                    served.push((key, r));
                }
            }
            Err(Replied) => return,
        }
    }
    if served.is_empty() {
        return ctx.enc.null_array();
    }
    let resp3 = ctx.enc.resp3();
    if resp3 {
        ctx.enc.map(served.len());
    } else {
        ctx.enc.array(served.len());
    }
    for (key, read) in &served {
        if !resp3 {
            ctx.enc.array(2);
        }
        ctx.enc.bulk(key);
        reply_read(ctx, read);
    }
}

/// Whether the stream at `args[1]` has the group `args[2]` (Err: answered, WRONGTYPE).
fn has_group(ctx: &mut Ctx<'_>, args: &[&[u8]]) -> Result<bool, Replied> {
    Ok(load::<Stream>(ctx, args[1])?.is_some_and(|s| s.groups.contains_key(args[2])))
}

/// XACK key group id [id ...]
pub(super) fn cmd_xack(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match has_group(ctx, args) {
        Ok(true) => {}
        Ok(false) => return ctx.enc.integer(0),
        Err(Replied) => return,
    }
    let mut ids = Vec::with_capacity(args.len() - 3);
    for a in &args[3..] {
        match parse_id(a, 0) {
            Some(id) => ids.push(id),
            None => return ctx.enc.error(ERR_ID),
        }
    }
    let done = update::<Stream, i64>(ctx, args[1], |s, _| {
        let Some(g) = s.groups.get_mut(args[2]) else {
            return Ok((0, false));
        };
        let n = ids
            .iter()
            .filter(|id| g.pending.remove(id).is_some())
            .count() as i64;
        Ok((n, n > 0))
    });
    if let Ok(n) = done {
        ctx.enc.integer(n)
    }
}

/// XPENDING key group [[IDLE min-idle-time] start end count [consumer]]
pub(super) fn cmd_xpending(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if args.len() != 3 && !(6..=9).contains(&args.len()) {
        return ctx.enc.error(ERR_SYNTAX);
    }
    let mut range = None;
    if args.len() >= 6 {
        let mut at = 3;
        let mut min_idle = 0;
        if eq_ignore_case(args[3], "idle") {
            match parse_i64(args[4]) {
                Some(n) => min_idle = n,
                None => return ctx.enc.error(ERR_NOT_INTEGER),
            }
            if args.len() < 8 {
                return ctx.enc.error(ERR_SYNTAX);
            }
            at += 2;
        }
        let Some(count) = args.get(at + 2).and_then(|a| parse_i64(a)) else {
            return ctx.enc.error(ERR_NOT_INTEGER);
        };
        let (Some(start), Some(end)) = (
            parse_bound(args[at], true),
            parse_bound(args[at + 1], false),
        ) else {
            return ctx.enc.error(ERR_ID);
        };
        let consumer = args.get(at + 3).copied();
        if at + 4 < args.len() {
            return ctx.enc.error(ERR_SYNTAX);
        }
        range = Some((min_idle, start, end, count.max(0) as usize, consumer));
    }
    let Ok(found) = load::<Stream>(ctx, args[1]) else {
        return;
    };
    let Some(g) = found.as_ref().and_then(|s| s.groups.get(args[2])) else {
        return ctx.enc.error(&nogroup(args[1], args[2], ""));
    };
    let Some((min_idle, start, end, count, consumer)) = range else {
        ctx.enc.array(4);
        ctx.enc.integer(g.pending.len() as i64);
        let (Some(first), Some(last)) = (g.pending.keys().next(), g.pending.keys().next_back())
        else {
            ctx.enc.null();
            ctx.enc.null();
            ctx.enc.null_array();
            return;
        };
        ctx.enc.bulk(id_text(*first).as_bytes());
        ctx.enc.bulk(id_text(*last).as_bytes());
        let mut per: BTreeMap<&[u8], u64> = BTreeMap::new();
        for p in g.pending.values() {
            *per.entry(&p.consumer).or_default() += 1;
        }
        ctx.enc.array(per.len());
        for (name, n) in per {
            ctx.enc.array(2);
            ctx.enc.bulk(name);
            ctx.enc.bulk(n.to_string().as_bytes());
        }
        return;
    };
    if consumer.is_some_and(|c| !g.consumers.contains_key(c)) || start > end {
        return ctx.enc.array(0);
    }
    let now = now_ms();
    let picked: Vec<(&StreamId, &Pending)> = g
        .pending
        .range(start..=end)
        .filter(|(_, p)| consumer.is_none_or(|c| p.consumer == c))
        .filter(|(_, p)| min_idle <= 0 || now.saturating_sub(p.delivered_ms) as i64 >= min_idle)
        .take(count)
        .collect();
    ctx.enc.array(picked.len());
    for (id, p) in picked {
        ctx.enc.array(4);
        ctx.enc.bulk(id_text(*id).as_bytes());
        ctx.enc.bulk(&p.consumer);
        ctx.enc.integer(now.saturating_sub(p.delivered_ms) as i64);
        ctx.enc.integer(p.deliveries as i64);
    }
}

/// XCLAIM key group consumer min-idle-time id [id ...] [IDLE ms] [TIME ms-unix-time]
/// [RETRYCOUNT count] [FORCE] [JUSTID] [LASTID lastid]
pub(super) fn cmd_xclaim(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match has_group(ctx, args) {
        Ok(true) => {}
        Ok(false) => return ctx.enc.error(&nogroup(args[1], args[2], "")),
        Err(Replied) => return,
    }
    let Some(min_idle) = parse_i64(args[4]) else {
        return ctx
            .enc
            .error("ERR Invalid min-idle-time argument for XCLAIM");
    };
    let min_idle = min_idle.max(0) as u64;
    let mut ids = Vec::new();
    let mut j = 5;
    while j < args.len() {
        match parse_id(args[j], 0) {
            Some(id) => ids.push(id),
            None => break,
        }
        j += 1;
    }
    let now = now_ms();
    let (mut force, mut justid) = (false, false);
    let mut delivered: Option<i64> = None;
    let mut retrycount: Option<u64> = None;
    let mut last_id: StreamId = (0, 0);
    while j < args.len() {
        let more = j + 1 < args.len();
        let opt = args[j];
        if eq_ignore_case(opt, "force") {
            force = true;
        } else if eq_ignore_case(opt, "justid") {
            justid = true;
        } else if eq_ignore_case(opt, "idle") && more {
            j += 1;
            match parse_i64(args[j]) {
                Some(ms) => delivered = Some(now as i64 - ms),
                None => return ctx.enc.error("ERR Invalid IDLE option argument for XCLAIM"),
            }
        } else if eq_ignore_case(opt, "time") && more {
            j += 1;
            match parse_i64(args[j]) {
                Some(t) => delivered = Some(t),
                None => return ctx.enc.error("ERR Invalid TIME option argument for XCLAIM"),
            }
        } else if eq_ignore_case(opt, "retrycount") && more {
            j += 1;
            match parse_i64(args[j]) {
                Some(n) => retrycount = (n >= 0).then_some(n as u64),
                None => {
                    return ctx
                        .enc
                        .error("ERR Invalid RETRYCOUNT option argument for XCLAIM")
                }
            }
        } else if eq_ignore_case(opt, "lastid") && more {
            j += 1;
            match parse_id(args[j], 0) {
                Some(id) => last_id = id,
                None => return ctx.enc.error(ERR_ID),
            }
        } else {
            return ctx.enc.error(&format!(
                "ERR Unrecognized XCLAIM option '{}'",
                String::from_utf8_lossy(opt)
            ));
        }
        j += 1;
    }
    let delivered = match delivered {
        Some(t) if t >= 0 && (t as u64) <= now => t as u64,
        _ => now,
    };
    let (group, consumer) = (args[2], args[3]);
    let mut created = false;
    let done = update::<Stream, Vec<(StreamId, Option<Fields>)>>(ctx, args[1], |s, _| {
        created = false;
        let Some(g) = s.groups.get_mut(group) else {
            return Err(nogroup(args[1], group, ""));
        };
        if last_id > g.last_delivered {
            g.last_delivered = last_id;
        }
        created = ensure_consumer(g, consumer, now);
        if let Some(c) = g.consumers.get_mut(consumer) {
            c.seen_ms = now;
        }
        let mut out = Vec::new();
        for id in &ids {
            let fields = s.entry(*id).map(|e| e.1.clone());
            let g = s.groups.get_mut(group).expect("checked");
            let Some(fields) = fields else {
                g.pending.remove(id);
                continue;
            };
            let fresh = !g.pending.contains_key(id);
            if fresh && !force {
                continue;
            }
            if fresh {
                g.pending.insert(
                    *id,
                    Pending {
                        consumer: consumer.to_vec(),
                        delivered_ms: now,
                        deliveries: 1,
                    },
                );
            }
            let p = g.pending.get_mut(id).expect("present");
            if !fresh && min_idle > 0 && now.saturating_sub(p.delivered_ms) < min_idle {
                continue;
            }
            p.consumer = consumer.to_vec();
            p.delivered_ms = delivered;
            match retrycount {
                Some(n) => p.deliveries = n,
                None if !justid => p.deliveries += 1,
                None => {}
            }
            if let Some(c) = g.consumers.get_mut(consumer) {
                c.active_ms = Some(now);
            }
            out.push((*id, (!justid).then_some(fields)));
        }
        Ok((out, true))
    });
    let Ok(claimed) = done else {
        return;
    };
    if created {
        notify(ctx, "xgroup-createconsumer", args[1]);
    }
    reply_claimed(ctx, &claimed);
}

/// Claimed entries: each an entry as XRANGE writes it, or its id alone (JUSTID).
fn reply_claimed(ctx: &mut Ctx<'_>, claimed: &[(StreamId, Option<Fields>)]) {
    ctx.enc.array(claimed.len());
    for (id, fields) in claimed {
        match fields {
            None => ctx.enc.bulk(id_text(*id).as_bytes()),
            Some(fv) => reply_entries_raw(ctx, &(*id, fv.clone())),
        }
    }
}

/// One entry as XRANGE writes it (id, then fields and values).
fn reply_entries_raw(ctx: &mut Ctx<'_>, entry: &StreamEntry) {
    ctx.enc.array(2);
    ctx.enc.bulk(id_text(entry.0).as_bytes());
    ctx.enc.array(entry.1.len() * 2);
    for (f, v) in &entry.1 {
        ctx.enc.bulk(f);
        ctx.enc.bulk(v);
    }
}

/// XAUTOCLAIM key group consumer min-idle-time start [COUNT count] [JUSTID]
pub(super) fn cmd_xautoclaim(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Some(min_idle) = parse_i64(args[4]) else {
        return ctx
            .enc
            .error("ERR Invalid min-idle-time argument for XAUTOCLAIM");
    };
    let min_idle = min_idle.max(0) as u64;
    let Some(start) = parse_bound(args[5], true) else {
        return ctx.enc.error(ERR_ID);
    };
    let mut count: usize = 100;
    let mut justid = false;
    let mut j = 6;
    while j < args.len() {
        if eq_ignore_case(args[j], "count") && j + 1 < args.len() {
            // Redis's bound: LONG_MAX / 10 (its attempts are ten times the count).
            match parse_i64(args[j + 1]) {
                Some(n) if (1..=i64::MAX / 10).contains(&n) => count = n as usize,
                _ => return ctx.enc.error("ERR COUNT must be > 0"),
            }
            j += 2;
        } else if eq_ignore_case(args[j], "justid") {
            justid = true;
            j += 1;
        } else {
            return ctx.enc.error(ERR_SYNTAX);
        }
    }
    match has_group(ctx, args) {
        Ok(true) => {}
        Ok(false) => return ctx.enc.error(&nogroup(args[1], args[2], "")),
        Err(Replied) => return,
    }
    let (group, consumer) = (args[2], args[3]);
    let now = now_ms();
    let mut created = false;
    type Out = (StreamId, Vec<(StreamId, Option<Fields>)>, Vec<StreamId>);
    let done = update::<Stream, Out>(ctx, args[1], |s, _| {
        created = false;
        let Some(g) = s.groups.get_mut(group) else {
            return Err(nogroup(args[1], group, ""));
        };
        created = ensure_consumer(g, consumer, now);
        if let Some(c) = g.consumers.get_mut(consumer) {
            c.seen_ms = now;
        }
        let candidates: Vec<StreamId> = g.pending.range(start..).map(|(id, _)| *id).collect();
        let mut left = count;
        let mut attempts = count.saturating_mul(10);
        let mut claimed = Vec::new();
        let mut deleted = Vec::new();
        let mut next = (0, 0);
        let mut iter = candidates.into_iter().peekable();
        while attempts > 0 && left > 0 {
            let Some(id) = iter.next() else {
                break;
            };
            attempts -= 1;
            let fields = s.entry(id).map(|e| e.1.clone());
            let g = s.groups.get_mut(group).expect("checked");
            let Some(fields) = fields else {
                g.pending.remove(&id);
                deleted.push(id);
                left -= 1;
                continue;
            };
            let p = g.pending.get_mut(&id).expect("listed");
            if min_idle > 0 && now.saturating_sub(p.delivered_ms) < min_idle {
                continue;
            }
            p.consumer = consumer.to_vec();
            p.delivered_ms = now;
            if !justid {
                p.deliveries += 1;
            }
            if let Some(c) = g.consumers.get_mut(consumer) {
                c.active_ms = Some(now);
            }
            claimed.push((id, (!justid).then_some(fields)));
            left -= 1;
        }
        if let Some(id) = iter.next() {
            next = id;
        }
        Ok(((next, claimed, deleted), true))
    });
    let Ok((next, claimed, deleted)) = done else {
        return;
    };
    if created {
        notify(ctx, "xgroup-createconsumer", args[1]);
    }
    ctx.enc.array(3);
    ctx.enc.bulk(id_text(next).as_bytes());
    reply_claimed(ctx, &claimed);
    ctx.enc.array(deleted.len());
    for id in deleted {
        ctx.enc.bulk(id_text(id).as_bytes());
    }
}

/// XINFO STREAM key [FULL [COUNT count]] | GROUPS key | CONSUMERS key group | HELP
pub(super) fn cmd_xinfo(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1].to_ascii_lowercase();
    if answered_help(
        ctx,
        "xinfo",
        args,
        &[
            "XINFO <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "CONSUMERS <key> <groupname>",
            "    Show consumers of <groupname>.",
            "GROUPS <key>",
            "    Show the stream consumer groups.",
            "STREAM <key> [FULL [COUNT <count>]",
            "    Show information about the stream.",
        ],
    ) {
        return;
    }
    if args.len() < 3 {
        return subcommand_syntax(ctx, "XINFO", args[1]);
    }
    let key = args[2];
    let Ok(found) = load::<Stream>(ctx, key) else {
        return;
    };
    let Some(s) = found else {
        return ctx.enc.error("ERR no such key");
    };
    let now = now_ms();
    match sub.as_slice() {
        b"consumers" if args.len() == 4 => {
            let Some(g) = s.groups.get(args[3]) else {
                return ctx.enc.error(&format!(
                    "NOGROUP No such consumer group '{}' for key name '{}'",
                    String::from_utf8_lossy(args[3]),
                    String::from_utf8_lossy(key)
                ));
            };
            ctx.enc.array(g.consumers.len());
            for (name, c) in &g.consumers {
                ctx.enc.map(4);
                ctx.enc.bulk(b"name");
                ctx.enc.bulk(name);
                ctx.enc.bulk(b"pending");
                ctx.enc
                    .integer(g.pending.values().filter(|p| p.consumer == *name).count() as i64);
                ctx.enc.bulk(b"idle");
                ctx.enc.integer(now.saturating_sub(c.seen_ms) as i64);
                ctx.enc.bulk(b"inactive");
                ctx.enc
                    .integer(c.active_ms.map_or(-1, |t| now as i64 - t as i64));
            }
        }
        b"groups" if args.len() == 3 => {
            ctx.enc.array(s.groups.len());
            for (name, g) in &s.groups {
                ctx.enc.map(6);
                ctx.enc.bulk(b"name");
                ctx.enc.bulk(name);
                ctx.enc.bulk(b"consumers");
                ctx.enc.integer(g.consumers.len() as i64);
                ctx.enc.bulk(b"pending");
                ctx.enc.integer(g.pending.len() as i64);
                ctx.enc.bulk(b"last-delivered-id");
                ctx.enc.bulk(id_text(g.last_delivered).as_bytes());
                ctx.enc.bulk(b"entries-read");
                integer_or_null(ctx, g.entries_read);
                ctx.enc.bulk(b"lag");
                integer_or_null(ctx, lag(&s, g));
            }
        }
        b"stream" => {
            let opts = &args[3..];
            let full = match opts.len() {
                0 => None,
                1 if eq_ignore_case(opts[0], "full") => Some(10),
                3 if eq_ignore_case(opts[0], "full") && eq_ignore_case(opts[1], "count") => {
                    match parse_i64(opts[2]) {
                        Some(n) if n < 0 => Some(10),
                        Some(n) => Some(n as usize),
                        None => return ctx.enc.error(ERR_NOT_INTEGER),
                    }
                }
                _ => return subcommand_syntax(ctx, "XINFO", args[1]),
            };
            let node = super::streams::node_entries(ctx);
            stream_info(ctx, &s, full, node);
        }
        _ => subcommand_syntax(ctx, "XINFO", args[1]),
    }
}

/// XINFO STREAM's reply; `full`: FULL with this COUNT (0: all). `node`: the entries of a node
/// as Redis lays a stream out (ramlog keeps it as one value; the node counts are those runs).
fn stream_info(ctx: &mut Ctx<'_>, s: &Stream, full: Option<usize>, node: usize) {
    let limit = |n: usize| match full {
        Some(0) | None => n,
        Some(c) => c.min(n),
    };
    ctx.enc.map(if full.is_some() { 9 } else { 10 });
    ctx.enc.bulk(b"length");
    ctx.enc.integer(s.entries.len() as i64);
    let nodes = s.entries.len().div_ceil(node) as i64;
    ctx.enc.bulk(b"radix-tree-keys");
    ctx.enc.integer(nodes);
    ctx.enc.bulk(b"radix-tree-nodes");
    ctx.enc.integer(nodes + 1);
    ctx.enc.bulk(b"last-generated-id");
    ctx.enc.bulk(id_text(s.last).as_bytes());
    ctx.enc.bulk(b"max-deleted-entry-id");
    ctx.enc.bulk(id_text(s.max_deleted).as_bytes());
    ctx.enc.bulk(b"entries-added");
    ctx.enc.integer(s.entries_added as i64);
    ctx.enc.bulk(b"recorded-first-entry-id");
    ctx.enc.bulk(id_text(s.first_id()).as_bytes());
    let Some(_) = full else {
        ctx.enc.bulk(b"groups");
        ctx.enc.integer(s.groups.len() as i64);
        for (name, entry) in [
            (&b"first-entry"[..], s.entries.first()),
            (b"last-entry", s.entries.last()),
        ] {
            ctx.enc.bulk(name);
            match entry {
                Some(e) => reply_entries_raw(ctx, e),
                None => ctx.enc.null(),
            }
        }
        return;
    };
    ctx.enc.bulk(b"entries");
    let shown: Vec<&StreamEntry> = s.entries.iter().take(limit(s.entries.len())).collect();
    reply_entries(ctx, &shown);
    ctx.enc.bulk(b"groups");
    ctx.enc.array(s.groups.len());
    for (name, g) in &s.groups {
        ctx.enc.map(7);
        ctx.enc.bulk(b"name");
        ctx.enc.bulk(name);
        ctx.enc.bulk(b"last-delivered-id");
        ctx.enc.bulk(id_text(g.last_delivered).as_bytes());
        ctx.enc.bulk(b"entries-read");
        integer_or_null(ctx, g.entries_read);
        ctx.enc.bulk(b"lag");
        integer_or_null(ctx, lag(s, g));
        ctx.enc.bulk(b"pel-count");
        ctx.enc.integer(g.pending.len() as i64);
        ctx.enc.bulk(b"pending");
        let n = limit(g.pending.len());
        ctx.enc.array(n);
        for (id, p) in g.pending.iter().take(n) {
            ctx.enc.array(4);
            ctx.enc.bulk(id_text(*id).as_bytes());
            ctx.enc.bulk(&p.consumer);
            ctx.enc.integer(p.delivered_ms as i64);
            ctx.enc.integer(p.deliveries as i64);
        }
        ctx.enc.bulk(b"consumers");
        ctx.enc.array(g.consumers.len());
        for (cname, c) in &g.consumers {
            let own: Vec<(&StreamId, &Pending)> = g
                .pending
                .iter()
                .filter(|(_, p)| p.consumer == *cname)
                .collect();
            ctx.enc.map(5);
            ctx.enc.bulk(b"name");
            ctx.enc.bulk(cname);
            ctx.enc.bulk(b"seen-time");
            ctx.enc.integer(c.seen_ms as i64);
            ctx.enc.bulk(b"active-time");
            ctx.enc.integer(c.active_ms.map_or(-1, |t| t as i64));
            ctx.enc.bulk(b"pel-count");
            ctx.enc.integer(own.len() as i64);
            ctx.enc.bulk(b"pending");
            let n = limit(own.len());
            ctx.enc.array(n);
            for (id, p) in own.into_iter().take(n) {
                ctx.enc.array(3);
                ctx.enc.bulk(id_text(*id).as_bytes());
                ctx.enc.integer(p.delivered_ms as i64);
                ctx.enc.integer(p.deliveries as i64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(ids: &[u64]) -> Stream {
        Stream {
            last: (*ids.last().unwrap_or(&0), 0),
            entries: ids.iter().map(|&ms| ((ms, 0), Vec::new())).collect(),
            entries_added: ids.len() as u64,
            ..Default::default()
        }
    }

    #[test]
    fn lag_is_known_until_a_deletion_lies_ahead_as_redis_counts_it() {
        let mut s = stream(&[1, 2, 3, 4, 5]);
        s.groups.insert(b"g".to_vec(), Group::default());
        let g = s.groups[&b"g"[..]].clone();
        // Before the first entry: all five are ahead.
        assert_eq!(lag(&s, &g), Some(5));
        let read = deliver_new(&mut s, b"g", b"c", Some(1), false, 7);
        assert_eq!(read.len(), 1);
        let g = &s.groups[&b"g"[..]];
        assert_eq!((g.entries_read, lag(&s, g)), (Some(1), Some(4)));
        assert_eq!(g.pending[&(1, 0)].consumer, b"c".to_vec());

        // A deletion between the group and the end: unknown until the group passes it.
        let mut s = stream(&[1, 2, 3, 4, 5]);
        s.entries.remove(2);
        s.max_deleted = (3, 0);
        s.groups.insert(b"g".to_vec(), Group::default());
        let g = s.groups[&b"g"[..]].clone();
        assert_eq!(lag(&s, &g), None);
        deliver_new(&mut s, b"g", b"c", None, true, 7);
        let g = &s.groups[&b"g"[..]];
        assert_eq!(
            (g.entries_read, lag(&s, g), g.pending.len()),
            (Some(5), Some(0), 0)
        );
    }

    #[test]
    fn history_shows_deleted_entries_without_fields_and_counts_deliveries() {
        let mut s = stream(&[1, 2]);
        s.groups.insert(b"g".to_vec(), Group::default());
        deliver_new(&mut s, b"g", b"c", None, false, 7);
        s.entries.remove(0);
        let read = deliver_history(&mut s, b"g", b"c", (0, 0), None, 9);
        assert_eq!(read, vec![((1, 0), None), ((2, 0), Some(Vec::new()))]);
        let g = &s.groups[&b"g"[..]];
        assert_eq!(g.pending[&(1, 0)].deliveries, 1);
        assert_eq!(
            (
                g.pending[&(2, 0)].deliveries,
                g.pending[&(2, 0)].delivered_ms
            ),
            (2, 9)
        );
        assert!(deliver_history(&mut s, b"g", b"other", (0, 0), None, 9).is_empty());
    }
}
