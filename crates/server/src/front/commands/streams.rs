//! Stream commands (Redis's `t_stream.c`): XADD, XLEN, XRANGE, XREVRANGE, XDEL, XTRIM, XREAD
//! (BLOCK through `front::blocking`); consumer groups are in `stream_groups`.

use super::typed::*;
use super::*;
use ramlog_proto::types::{Stream, StreamEntry, StreamId};

impl Collection for Stream {
    const KIND: ramlog_proto::types::Kind = ramlog_proto::types::Kind::Stream;
    fn decode(stored: &[u8]) -> Result<Self, ramlog_proto::types::TypedError> {
        Stream::decode(stored)
    }
    fn encode(&self) -> Vec<u8> {
        Stream::encode(self)
    }
    fn len(&self) -> usize {
        // A stream with no entries stays (its last id matters), unlike other collections.
        self.entries.len().max(1)
    }
}

pub(super) const ERR_ID: &str = "ERR Invalid stream ID specified as stream command argument";

pub(super) fn id_text(id: StreamId) -> String {
    format!("{}-{}", id.0, id.1)
}

/// `ms[-seq]`; a missing seq is `missing_seq`.
pub(super) fn parse_id(arg: &[u8], missing_seq: u64) -> Option<StreamId> {
    let text = std::str::from_utf8(arg).ok()?;
    let (ms, seq) = match text.split_once('-') {
        Some((ms, seq)) => (ms.parse().ok()?, seq.parse().ok()?),
        None => (text.parse().ok()?, missing_seq),
    };
    Some((ms, seq))
}

/// A range bound: `-`, `+`, an id, or `(id` (exclusive); (id, exclusive).
pub(super) fn parse_bound(arg: &[u8], start: bool) -> Option<StreamId> {
    match arg {
        b"-" => Some((0, 0)),
        b"+" => Some((u64::MAX, u64::MAX)),
        [b'(', rest @ ..] => {
            let id = parse_id(rest, if start { 0 } else { u64::MAX })?;
            if start {
                // The next id after it.
                match id.1.checked_add(1) {
                    Some(seq) => Some((id.0, seq)),
                    None => id.0.checked_add(1).map(|ms| (ms, 0)),
                }
            } else {
                match id.1.checked_sub(1) {
                    Some(seq) => Some((id.0, seq)),
                    None => id.0.checked_sub(1).map(|ms| (ms, u64::MAX)),
                }
            }
        }
        _ => parse_id(arg, if start { 0 } else { u64::MAX }),
    }
}

pub(super) fn reply_entries(ctx: &mut Ctx<'_>, entries: &[&StreamEntry]) {
    ctx.enc.array(entries.len());
    for (id, fields) in entries {
        ctx.enc.array(2);
        ctx.enc.bulk(id_text(*id).as_bytes());
        ctx.enc.array(fields.len() * 2);
        for (f, v) in fields {
            ctx.enc.bulk(f);
            ctx.enc.bulk(v);
        }
    }
}

/// MAXLEN|MINID [=|~] threshold [LIMIT count]
#[derive(Clone, Copy)]
enum TrimBy {
    MaxLen(u64),
    MinId(StreamId),
}

#[derive(Clone, Copy)]
struct Trim {
    by: TrimBy,
    /// `~`: whole runs of `stream-node-max-entries` entries only, at most `limit` entries (0:
    /// no limit).
    approx: Option<u64>,
}

/// The entries in one node of a stream as Redis lays it out (`stream-node-max-entries`; 0,
/// no bound there but bytes, counts as 100). ramlog keeps a stream as one value; approximate
/// trims and XINFO's node counts use runs of this many entries from the head.
pub(super) fn node_entries(ctx: &Ctx<'_>) -> usize {
    match ctx.node.settings.value("stream-node-max-entries") {
        n if n > 0 => n as usize,
        _ => 100,
    }
}

fn apply_trim(s: &mut Stream, trim: Trim, node: usize) -> usize {
    let before = s.entries.len();
    match (trim.by, trim.approx) {
        (TrimBy::MaxLen(n), None) => {
            let drop = s.entries.len().saturating_sub(n as usize);
            s.entries.drain(..drop);
        }
        (TrimBy::MinId(id), None) => s.entries.retain(|(e, _)| *e >= id),
        (by, Some(limit)) => {
            // Whole runs from the head, as Redis removes whole nodes. Nodes hold entries in
            // the order they were added, so the head's node started entries_added - len
            // entries ago (exactly so while only the head was ever trimmed).
            let removed = s.entries_added.saturating_sub(before as u64);
            let mut drop = 0;
            let mut first = true;
            loop {
                let run = if first {
                    node - (removed % node as u64) as usize
                } else {
                    node
                }
                .min(before - drop);
                first = false;
                if run == 0 || (limit > 0 && (drop + run) as u64 > limit) {
                    break;
                }
                let fits = match by {
                    TrimBy::MaxLen(n) => (before - drop - run) as u64 >= n,
                    TrimBy::MinId(id) => s.entries[drop + run - 1].0 < id,
                };
                if !fits {
                    break;
                }
                drop += run;
            }
            s.entries.drain(..drop);
        }
    }
    before - s.entries.len()
}

/// Parses a trim spec at `args[i..]`; returns it and the next index. `node`: the entries of
/// a node, for `~`'s default LIMIT (100 nodes).
fn parse_trim(args: &[&[u8]], i: usize, node: usize) -> Result<(Trim, usize), &'static str> {
    let max = eq_ignore_case(args[i], "maxlen");
    let mut j = i + 1;
    let mut approx = false;
    if j < args.len() && (args[j] == b"=" || args[j] == b"~") {
        approx = args[j] == b"~";
        j += 1;
    }
    let arg = args.get(j).ok_or(ERR_SYNTAX)?;
    let by = if max {
        match parse_i64(arg) {
            Some(n) if n >= 0 => TrimBy::MaxLen(n as u64),
            _ => return Err("ERR The MAXLEN argument must be >= 0."),
        }
    } else {
        TrimBy::MinId(parse_id(arg, 0).ok_or(ERR_ID)?)
    };
    j += 1;
    let mut limit = None;
    if j + 1 < args.len() && eq_ignore_case(args[j], "limit") {
        match parse_i64(args[j + 1]) {
            Some(n) if n >= 0 => limit = Some(n as u64),
            Some(_) => return Err("ERR The LIMIT argument must be >= 0."),
            None => return Err(ERR_NOT_INTEGER),
        }
        if !approx {
            return Err("ERR syntax error, LIMIT cannot be used without the special ~ option");
        }
        j += 2;
    }
    let approx = approx.then(|| limit.unwrap_or(100 * node as u64));
    Ok((Trim { by, approx }, j))
}

/// XADD key [NOMKSTREAM] [MAXLEN|MINID [=|~] threshold [LIMIT count]] *|id field value ...
pub(super) fn cmd_xadd(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let node = node_entries(ctx);
    let mut i = 2;
    let mut nomkstream = false;
    let mut trim = None;
    loop {
        let Some(a) = args.get(i) else {
            return ctx.enc.error(ERR_SYNTAX);
        };
        if eq_ignore_case(a, "nomkstream") {
            nomkstream = true;
            i += 1;
        } else if eq_ignore_case(a, "maxlen") || eq_ignore_case(a, "minid") {
            match parse_trim(args, i, node) {
                Ok((t, next)) => {
                    trim = Some(t);
                    i = next;
                }
                Err(e) => return ctx.enc.error(e),
            }
        } else {
            break;
        }
    }
    let id_arg = args[i];
    let fields = &args[i + 1..];
    if fields.is_empty() || !fields.len().is_multiple_of(2) {
        return ctx
            .enc
            .error("ERR wrong number of arguments for 'xadd' command");
    }
    // None: "*"; Some((ms, None)): "ms-*"; Some((ms, Some(seq))): explicit.
    let wanted: Option<(u64, Option<u64>)> = if id_arg == b"*" {
        None
    } else if let Some(ms) = id_arg.strip_suffix(b"-*") {
        match std::str::from_utf8(ms).ok().and_then(|m| m.parse().ok()) {
            Some(ms) => Some((ms, None)),
            None => return ctx.enc.error(ERR_ID),
        }
    } else {
        match parse_id(id_arg, 0) {
            Some((ms, seq)) => Some((ms, Some(seq))),
            None => return ctx.enc.error(ERR_ID),
        }
    };
    if wanted == Some((0, Some(0))) {
        return ctx
            .enc
            .error("ERR The ID specified in XADD must be greater than 0-0");
    }
    let now = now_ms();
    let added = update::<Stream, Option<StreamId>>(ctx, args[1], |s, existed| {
        if nomkstream && !existed {
            return Ok((None, false));
        }
        let last = s.last;
        let top = || {
            "ERR The ID specified in XADD is equal or smaller than the target stream top item"
                .to_string()
        };
        let id = match wanted {
            None if now > last.0 => (now, 0),
            // After the greatest sequence of a millisecond comes the next millisecond's first.
            None => match last.1.checked_add(1) {
                Some(seq) => (last.0, seq),
                None => (last.0.checked_add(1).ok_or_else(top)?, 0),
            },
            Some((ms, None)) if ms == last.0 => (ms, last.1.checked_add(1).ok_or_else(top)?),
            Some((ms, None)) => (ms, 0),
            Some((ms, Some(seq))) => (ms, seq),
        };
        if id <= last {
            return Err(
                "ERR The ID specified in XADD is equal or smaller than the target stream top item"
                    .into(),
            );
        }
        s.last = id;
        s.entries_added += 1;
        let entry: Vec<(Vec<u8>, Vec<u8>)> = fields
            .chunks_exact(2)
            .map(|p| (p[0].to_vec(), p[1].to_vec()))
            .collect();
        s.entries.push((id, entry));
        if let Some(t) = trim {
            apply_trim(s, t, node);
        }
        Ok((Some(id), true))
    });
    match added {
        Ok(Some(id)) => ctx.enc.bulk(id_text(id).as_bytes()),
        Ok(None) => ctx.enc.null(),
        Err(Replied) => {}
    }
}

pub(super) fn cmd_xlen(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Ok(s) = load::<Stream>(ctx, args[1]) {
        ctx.enc.integer(s.map_or(0, |s| s.entries.len() as i64))
    }
}

fn range(ctx: &mut Ctx<'_>, args: &[&[u8]], rev: bool) {
    let (lo, hi) = if rev {
        (args[3], args[2])
    } else {
        (args[2], args[3])
    };
    let (Some(lo), Some(hi)) = (parse_bound(lo, true), parse_bound(hi, false)) else {
        return ctx.enc.error(ERR_ID);
    };
    let count = match args.len() {
        4 => None,
        6 if eq_ignore_case(args[4], "count") => match parse_i64(args[5]) {
            Some(n) => Some(n.max(0) as usize),
            None => return ctx.enc.error(ERR_NOT_INTEGER),
        },
        _ => return ctx.enc.error(ERR_SYNTAX),
    };
    let Ok(s) = load_or_empty::<Stream>(ctx, args[1]) else {
        return;
    };
    let mut picked: Vec<&StreamEntry> = s
        .entries
        .iter()
        .filter(|(id, _)| *id >= lo && *id <= hi)
        .collect();
    if rev {
        picked.reverse();
    }
    if let Some(n) = count {
        picked.truncate(n);
    }
    reply_entries(ctx, &picked)
}

pub(super) fn cmd_xrange(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    range(ctx, args, false)
}
pub(super) fn cmd_xrevrange(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    range(ctx, args, true)
}

pub(super) fn cmd_xdel(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let mut ids = Vec::new();
    for a in &args[2..] {
        match parse_id(a, 0) {
            Some(id) => ids.push(id),
            None => return ctx.enc.error(ERR_ID),
        }
    }
    if let Ok(n) = update::<Stream, i64>(ctx, args[1], |s, existed| {
        if !existed {
            return Ok((0, false));
        }
        let before = s.entries.len();
        let mut max_deleted = s.max_deleted;
        s.entries.retain(|(id, _)| {
            let gone = ids.contains(id);
            if gone {
                max_deleted = max_deleted.max(*id);
            }
            !gone
        });
        s.max_deleted = max_deleted;
        let n = (before - s.entries.len()) as i64;
        Ok((n, n > 0))
    }) {
        ctx.enc.integer(n)
    }
}

/// XTRIM key MAXLEN|MINID [=|~] threshold [LIMIT count]
pub(super) fn cmd_xtrim(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if !(eq_ignore_case(args[2], "maxlen") || eq_ignore_case(args[2], "minid")) {
        return ctx.enc.error(ERR_SYNTAX);
    }
    let node = node_entries(ctx);
    let trim = match parse_trim(args, 2, node) {
        Ok((t, next)) if next == args.len() => t,
        Ok(_) => return ctx.enc.error(ERR_SYNTAX),
        Err(e) => return ctx.enc.error(e),
    };
    if let Ok(n) = update::<Stream, i64>(ctx, args[1], |s, existed| {
        if !existed {
            return Ok((0, false));
        }
        let n = apply_trim(s, trim, node) as i64;
        Ok((n, n > 0))
    }) {
        ctx.enc.integer(n)
    }
}

/// Where XREAD's keys and ids are: (index of the first key, number of keys), or the error.
pub(crate) fn xread_streams(args: &[&[u8]]) -> Result<(usize, usize), &'static str> {
    let at = args
        .iter()
        .position(|a| eq_ignore_case(a, "streams"))
        .ok_or(ERR_SYNTAX)?;
    let rest = args.len() - at - 1;
    if rest == 0 || !rest.is_multiple_of(2) {
        return Err("ERR Unbalanced 'xread' list of streams: for each stream key an ID or '$' must be specified.");
    }
    Ok((at + 1, rest / 2))
}

/// XREAD [COUNT count] [BLOCK ms] STREAMS key ... id ...: one try (the connection blocks and
/// tries again with BLOCK, see `front::blocking`, which first turns `$` into each stream's last
/// id).
pub(super) fn cmd_xread(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (first, n) = match xread_streams(args) {
        Ok(x) => x,
        Err(e) => return ctx.enc.error(e),
    };
    let mut count = None;
    let mut i = 1;
    while i < first - 1 {
        if eq_ignore_case(args[i], "count") && i + 1 < first - 1 {
            match parse_i64(args[i + 1]) {
                Some(c) if c > 0 => count = Some(c as usize),
                Some(_) => {}
                None => return ctx.enc.error(ERR_NOT_INTEGER),
            }
        } else if eq_ignore_case(args[i], "block") && i + 1 < first - 1 {
            match parse_i64(args[i + 1]) {
                Some(ms) if ms >= 0 => {}
                Some(_) => return ctx.enc.error("ERR timeout is negative"),
                None => {
                    return ctx
                        .enc
                        .error("ERR timeout is not an integer or out of range")
                }
            }
        } else {
            return ctx.enc.error(ERR_SYNTAX);
        }
        i += 2;
    }
    let mut found: Vec<(&[u8], Stream, StreamId)> = Vec::new();
    for k in 0..n {
        let key = args[first + k];
        let id_arg = args[first + n + k];
        let Ok(s) = load::<Stream>(ctx, key) else {
            return;
        };
        let after = if id_arg == b"$" {
            s.as_ref().map_or((0, 0), |s| s.last)
        } else {
            match parse_id(id_arg, 0) {
                Some(id) => id,
                None => return ctx.enc.error(ERR_ID),
            }
        };
        if let Some(s) = s {
            if s.entries.last().is_some_and(|(id, _)| *id > after) {
                found.push((key, s, after));
            }
        }
    }
    if found.is_empty() {
        return ctx.enc.null_array();
    }
    // RESP3: a map of key to entries; RESP2: an array of [key, entries].
    let resp3 = ctx.enc.resp3();
    if resp3 {
        ctx.enc.map(found.len());
    } else {
        ctx.enc.array(found.len());
    }
    for (key, s, after) in &found {
        let mut picked: Vec<&StreamEntry> = s.entries.iter().filter(|(id, _)| id > after).collect();
        if let Some(c) = count {
            picked.truncate(c);
        }
        if !resp3 {
            ctx.enc.array(2);
        }
        ctx.enc.bulk(key);
        reply_entries(ctx, &picked);
    }
}

/// The last id of the stream at `key` as XREAD's `$` means it when a blocking XREAD starts
/// ("0-0" when there is none).
pub(crate) fn last_id_text(node: &Node, session: &mut Session, key: &[u8]) -> Vec<u8> {
    let last = node
        .get(node.tablet_of(key), key, &mut session.acks)
        .ok()
        .flatten()
        .and_then(|o| Stream::decode(&o.value).ok())
        .map_or((0, 0), |s| s.last);
    id_text(last).into_bytes()
}
