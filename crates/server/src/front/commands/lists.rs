//! List commands (Redis's `t_list.c`): LPUSH, RPUSH, LPUSHX, RPUSHX, LPOP, RPOP, LLEN, LRANGE,
//! LINDEX, LSET, LREM, LTRIM, LINSERT, LPOS, LMOVE, RPOPLPUSH.

use super::large_list::{self, Large, LargeError, Place};
use super::typed::*;
use super::*;
use ramlog_proto::types::{self, List};

/// The key's large list, if it holds one (None: absent, small, or another type).
fn large_of(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<Option<Large>, Replied> {
    if !large_list::holds_large(ctx, key)? {
        return Ok(None);
    }
    match read(ctx, key) {
        Ok(Some(o)) if types::large_kind(&o.value) == Some(types::Kind::List) => {
            match Large::decode(&o) {
                Ok(l) => Ok(Some(l)),
                Err(e) => {
                    large_list::reply_error(ctx, e);
                    Err(Replied)
                }
            }
        }
        Ok(_) => Ok(None),
        Err(e) => {
            engine_error(ctx, &e);
            Err(Replied)
        }
    }
}

/// Runs `op` on the key's large list while it holds one, again while the list changes under it;
/// None when the key holds no large list (the caller takes the compact path).
fn on_large<R>(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    mut op: impl FnMut(&mut Ctx<'_>, Place<'_>, Large) -> Result<R, LargeError>,
) -> Result<Option<R>, Replied> {
    for _ in 0..64 {
        let Some(large) = large_of(ctx, key)? else {
            return Ok(None);
        };
        let place = Place::of(ctx, key);
        match op(ctx, place, large) {
            Ok(r) => return Ok(Some(r)),
            Err(LargeError::Changed) => continue,
            Err(e) => {
                large_list::reply_error(ctx, e);
                return Err(Replied);
            }
        }
    }
    large_list::reply_error(ctx, LargeError::Changed);
    Err(Replied)
}

/// Pushes `items` at one end; the new length, or 0 if `only_existing` and the key is absent.
fn push_items(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    left: bool,
    only_existing: bool,
    items: &[&[u8]],
) -> Result<i64, Replied> {
    {
        let _serialized = ctx.node.rmw_lock(key);
        let pushed = on_large(ctx, key, |ctx, place, large| {
            large_list::push(ctx, place, large, left, items)
        })?;
        if let Some(n) = pushed {
            ctx.node.waiters.wake(key);
            return Ok(n as i64);
        }
    }
    if let Some(n) = push_compact(ctx, key, left, items)? {
        return Ok(n);
    }
    update::<List, i64>(ctx, key, |l, existed| {
        if only_existing && !existed {
            return Ok((0, false));
        }
        for item in items {
            if left {
                l.items.push_front(item.to_vec());
            } else {
                l.items.push_back(item.to_vec());
            }
        }
        Ok((l.items.len() as i64, true))
    })
}

/// Runs `edit` on the key's compact list as stored (no element decoded, as Redis's listpack
/// takes a push or a pop in place) under the key's read-modify-write lock, and writes the bytes
/// it makes (None: the list is left empty, and deleted) if the list is still as read. None when
/// the key holds no compact list (absent, large, another type, bytes that do not decode), when
/// `edit` declines, or when the list changed meanwhile: the general path then does it.
fn edit_compact<R>(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    edit: impl FnOnce(&Ctx<'_>, types::RawList<'_>) -> Option<(R, Option<Vec<u8>>)>,
) -> Result<Option<R>, Replied> {
    let node = ctx.node;
    let tablet = node.tablet_of(key);
    let _serialized = node.rmw_lock(key);
    let found = node.get(tablet, key, &mut ctx.session.acks).map_err(|e| {
        engine_error(ctx, &e);
        Replied
    })?;
    let Some(o) = found else {
        return Ok(None);
    };
    if types::kind_of(&o.value) != Ok(types::Kind::List) || types::is_large(&o.value) {
        return Ok(None);
    }
    let Ok(raw) = types::RawList::decode(&o.value) else {
        return Ok(None);
    };
    let Some((result, bytes)) = edit(ctx, raw) else {
        return Ok(None);
    };
    let condition = Condition::IfVersion(o.version);
    let done = match bytes {
        None => node
            .delete(tablet, key, condition, &mut ctx.session.acks)
            .map(|d| d.is_some()),
        Some(bytes) => {
            let opts = PutOptions {
                condition,
                keep_ttl: true,
                ..Default::default()
            };
            node.put(tablet, key, &bytes, &opts, &mut ctx.session.acks)
                .map(|_| true)
        }
    };
    match done {
        Ok(true) => Ok(Some(result)),
        Ok(false) | Err(NodeError::Engine(EngineError::ConditionFailed { .. })) => Ok(None),
        Err(e) => {
            engine_error(ctx, &e);
            Err(Replied)
        }
    }
}

/// A push onto a compact list that stays compact, made on its stored bytes; the new length, or
/// None when the key holds no compact list or the list leaves the compact form.
fn push_compact(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    left: bool,
    items: &[&[u8]],
) -> Result<Option<i64>, Replied> {
    let pushed = edit_compact(ctx, key, |ctx, raw| {
        let added: usize = items
            .iter()
            .map(|i| i.len() + ramlog_common::varint::len(i.len() as u64))
            .sum();
        let count = raw.count + items.len();
        if large_list::wants_large_sized(ctx, count, raw.items.len() + added + 8) {
            return None;
        }
        let bytes = raw.pushed(left, items);
        let limit = ctx.node.config.value_size_max_bytes + types::TAG_BYTES as u64;
        (bytes.len() as u64 <= limit).then_some((count as i64, Some(bytes)))
    })?;
    if pushed.is_some() {
        ctx.node.waiters.wake(key);
    }
    Ok(pushed)
}

/// A pop from a compact list, made on its stored bytes; None when the key holds no compact list.
fn pop_compact(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    left: bool,
    count: usize,
) -> Result<Option<Vec<Vec<u8>>>, Replied> {
    edit_compact(ctx, key, |_, raw| Some(raw.popped(left, count)))
}

/// Pops up to `count` items from one end (with `expect`, one item only if it is that one); None
/// when the key is absent.
fn pop_items(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    left: bool,
    count: usize,
    expect: Option<&[u8]>,
) -> Result<Option<Vec<Vec<u8>>>, Replied> {
    {
        let _serialized = ctx.node.rmw_lock(key);
        let popped = on_large(ctx, key, |ctx, place, large| {
            large_list::pop(ctx, place, large, left, count, expect)
        })?;
        if popped.is_some() {
            return Ok(popped);
        }
    }
    if expect.is_none() && count > 0 {
        if let Some(popped) = pop_compact(ctx, key, left, count)? {
            return Ok(Some(popped));
        }
    }
    update::<List, Option<Vec<Vec<u8>>>>(ctx, key, |l, existed| {
        if !existed {
            return Ok((None, false));
        }
        if let Some(e) = expect {
            let end = if left {
                l.items.front()
            } else {
                l.items.back()
            };
            if end.map(Vec::as_slice) != Some(e) {
                return Ok((Some(Vec::new()), false));
            }
        }
        let out = l.pop(left, count);
        let changed = !out.is_empty();
        Ok((Some(out), changed))
    })
}

fn push(ctx: &mut Ctx<'_>, args: &[&[u8]], left: bool, only_existing: bool) {
    if let Ok(n) = push_items(ctx, args[1], left, only_existing, &args[2..]) {
        ctx.enc.integer(n)
    }
}

pub(super) fn cmd_lpush(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    push(ctx, args, true, false)
}
pub(super) fn cmd_rpush(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    push(ctx, args, false, false)
}
pub(super) fn cmd_lpushx(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    push(ctx, args, true, true)
}
pub(super) fn cmd_rpushx(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    push(ctx, args, false, true)
}

/// LPOP/RPOP key [count]
fn pop(ctx: &mut Ctx<'_>, args: &[&[u8]], left: bool) {
    let count = match args.get(2) {
        None => None,
        Some(c) => match parse_i64(c) {
            Some(n) if n >= 0 => Some(n as usize),
            _ => return ctx.enc.error("ERR value is out of range, must be positive"),
        },
    };
    if args.len() > 3 {
        let name = String::from_utf8_lossy(args[0]).to_ascii_lowercase();
        return ctx.enc.error(&format!(
            "ERR wrong number of arguments for '{name}' command"
        ));
    }
    let popped = pop_items(ctx, args[1], left, count.unwrap_or(1), None);
    let Ok(popped) = popped else {
        return;
    };
    match (popped, count) {
        (None, None) => ctx.enc.null(),
        (None, Some(_)) => ctx.enc.null_array(),
        (Some(items), None) => ctx.enc.bulk_or_null(items.first().map(|i| i.as_slice())),
        (Some(items), Some(_)) => {
            ctx.enc.array(items.len());
            for i in &items {
                ctx.enc.bulk(i);
            }
        }
    }
}

pub(super) fn cmd_lpop(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    pop(ctx, args, true)
}
pub(super) fn cmd_rpop(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    pop(ctx, args, false)
}

pub(super) fn cmd_llen(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match on_large(ctx, args[1], |_, _, large| Ok(large.header.len)) {
        Ok(Some(n)) => return ctx.enc.integer(n as i64),
        Ok(None) => {}
        Err(Replied) => return,
    }
    if let Ok(l) = load_or_empty::<List>(ctx, args[1]) {
        ctx.enc.integer(l.items.len() as i64)
    }
}

/// Items `start..=stop` (Redis's index rules) of a large list; None if the key holds none.
fn large_range(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    start: i64,
    stop: i64,
) -> Result<Option<Vec<Vec<u8>>>, Replied> {
    on_large(ctx, key, |ctx, place, large| {
        match index_range(start, stop, large.header.len as usize) {
            None => Ok(Vec::new()),
            Some((a, b)) => large_list::range(ctx, place, large, a as u64, b as u64),
        }
    })
}

pub(super) fn cmd_lrange(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (Some(start), Some(stop)) = (parse_i64(args[2]), parse_i64(args[3])) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    match large_range(ctx, args[1], start, stop) {
        Ok(Some(items)) => {
            ctx.enc.array(items.len());
            for i in &items {
                ctx.enc.bulk(i);
            }
            return;
        }
        Ok(None) => {}
        Err(Replied) => return,
    }
    let Ok(l) = load_or_empty::<List>(ctx, args[1]) else {
        return;
    };
    match index_range(start, stop, l.items.len()) {
        None => ctx.enc.array(0),
        Some((a, b)) => {
            ctx.enc.array(b - a + 1);
            for i in l.items.range(a..=b) {
                ctx.enc.bulk(i);
            }
        }
    }
}

/// A list index with Redis's negative indexes; None when out of range.
fn list_index(index: i64, len: usize) -> Option<usize> {
    let i = if index < 0 { index + len as i64 } else { index };
    (0..len as i64).contains(&i).then_some(i as usize)
}

pub(super) fn cmd_lindex(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Some(index) = parse_i64(args[2]) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    match large_range(ctx, args[1], index, index) {
        Ok(Some(items)) => return ctx.enc.bulk_or_null(items.first().map(Vec::as_slice)),
        Ok(None) => {}
        Err(Replied) => return,
    }
    if let Ok(l) = load_or_empty::<List>(ctx, args[1]) {
        ctx.enc
            .bulk_or_null(list_index(index, l.items.len()).map(|i| l.items[i].as_slice()))
    }
}

pub(super) fn cmd_lset(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Some(index) = parse_i64(args[2]) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    let value = args[3];
    {
        let _serialized = ctx.node.rmw_lock(args[1]);
        let done = on_large(ctx, args[1], |ctx, place, large| {
            match list_index(index, large.header.len as usize) {
                None => Ok(Err(())),
                Some(i) => large_list::set(ctx, place, large, i as u64, value).map(Ok),
            }
        });
        match done {
            Ok(Some(Ok(true))) => return ctx.enc.ok(),
            Ok(Some(Err(()))) => return ctx.enc.error("ERR index out of range"),
            // Not large, or an element too large for its chunk: the general path below.
            Ok(None) | Ok(Some(Ok(false))) => {}
            Err(Replied) => return,
        }
    }
    if update_growing::<List, ()>(ctx, args[1], Some(value), |l, existed| {
        if !existed {
            return Err("ERR no such key".into());
        }
        let i = list_index(index, l.items.len()).ok_or("ERR index out of range")?;
        l.items[i] = value.to_vec();
        Ok(((), true))
    })
    .is_ok()
    {
        ctx.enc.ok()
    }
}

/// LREM key count element: count > 0 from the head, < 0 from the tail, 0 all.
pub(super) fn cmd_lrem(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let Some(count) = parse_i64(args[2]) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    let element = args[3];
    if let Ok(n) = update::<List, i64>(ctx, args[1], |l, _| {
        let limit = if count == 0 {
            usize::MAX
        } else {
            count.unsigned_abs().min(usize::MAX as u64) as usize
        };
        let mut removed = 0usize;
        let positions: Vec<usize> = if count < 0 {
            (0..l.items.len()).rev().collect()
        } else {
            (0..l.items.len()).collect()
        };
        let mut drop = vec![false; l.items.len()];
        for i in positions {
            if removed == limit {
                break;
            }
            if l.items[i] == element {
                drop[i] = true;
                removed += 1;
            }
        }
        let mut i = 0;
        l.items.retain(|_| {
            i += 1;
            !drop[i - 1]
        });
        Ok((removed as i64, removed > 0))
    }) {
        ctx.enc.integer(n)
    }
}

pub(super) fn cmd_ltrim(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (Some(start), Some(stop)) = (parse_i64(args[2]), parse_i64(args[3])) else {
        return ctx.enc.error(ERR_NOT_INTEGER);
    };
    {
        let _serialized = ctx.node.rmw_lock(args[1]);
        let done = on_large(ctx, args[1], |ctx, place, large| {
            match index_range(start, stop, large.header.len as usize) {
                None => large_list::delete(ctx, place, large),
                Some((a, b)) if a == 0 && b + 1 == large.header.len as usize => Ok(()),
                Some((a, b)) => large_list::trim(ctx, place, large, a as u64, b as u64),
            }
        });
        match done {
            Ok(Some(())) => return ctx.enc.ok(),
            Ok(None) => {}
            Err(Replied) => return,
        }
    }
    if update::<List, ()>(ctx, args[1], |l, existed| {
        if !existed {
            return Ok(((), false));
        }
        let before = l.items.len();
        match index_range(start, stop, before) {
            None => l.items.clear(),
            Some((a, b)) => {
                l.items.truncate(b + 1);
                l.items.drain(..a);
            }
        }
        Ok(((), l.items.len() != before))
    })
    .is_ok()
    {
        ctx.enc.ok()
    }
}

/// LINSERT key BEFORE|AFTER pivot element
pub(super) fn cmd_linsert(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let after = if eq_ignore_case(args[2], "after") {
        true
    } else if eq_ignore_case(args[2], "before") {
        false
    } else {
        return ctx.enc.error(ERR_SYNTAX);
    };
    let (pivot, element) = (args[3], args[4]);
    if let Ok(n) = update::<List, i64>(ctx, args[1], |l, existed| {
        if !existed {
            return Ok((0, false));
        }
        match l.items.iter().position(|i| i == pivot) {
            None => Ok((-1, false)),
            Some(p) => {
                l.items
                    .insert(if after { p + 1 } else { p }, element.to_vec());
                Ok((l.items.len() as i64, true))
            }
        }
    }) {
        ctx.enc.integer(n)
    }
}

/// LPOS key element [RANK rank] [COUNT num-matches] [MAXLEN len]
pub(super) fn cmd_lpos(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let mut rank: i64 = 1;
    let mut count: Option<usize> = None;
    let mut maxlen: usize = 0;
    let mut i = 3;
    while i < args.len() {
        if i + 1 >= args.len() {
            return ctx.enc.error(ERR_SYNTAX);
        }
        let Some(n) = parse_i64(args[i + 1]) else {
            return ctx.enc.error(ERR_NOT_INTEGER);
        };
        if eq_ignore_case(args[i], "rank") {
            if n == i64::MIN {
                return ctx.enc.error("ERR value is out of range, value must be between -9223372036854775807 and 9223372036854775807");
            }
            if n == 0 {
                return ctx.enc.error("ERR RANK can't be zero: use 1 to start from the first match, 2 from the second ... or use negative to start from the end of the list");
            }
            rank = n;
        } else if eq_ignore_case(args[i], "count") {
            if n < 0 {
                return ctx.enc.error("ERR COUNT can't be negative");
            }
            count = Some(n as usize);
        } else if eq_ignore_case(args[i], "maxlen") {
            if n < 0 {
                return ctx.enc.error("ERR MAXLEN can't be negative");
            }
            maxlen = n as usize;
        } else {
            return ctx.enc.error(ERR_SYNTAX);
        }
        i += 2;
    }
    let Ok(l) = load_or_empty::<List>(ctx, args[1]) else {
        return;
    };
    let element = args[2];
    let len = l.items.len();
    let order: Box<dyn Iterator<Item = usize>> = if rank > 0 {
        Box::new(0..len)
    } else {
        Box::new((0..len).rev())
    };
    let limit = if maxlen == 0 { len } else { maxlen.min(len) };
    let want = match count {
        Some(0) => usize::MAX,
        Some(n) => n,
        None => 1,
    };
    let mut skip = rank.unsigned_abs() - 1;
    let mut found = Vec::new();
    for i in order.take(limit) {
        if l.items[i] == element {
            if skip > 0 {
                skip -= 1;
                continue;
            }
            found.push(i as i64);
            if found.len() >= want {
                break;
            }
        }
    }
    match count {
        None => match found.first() {
            Some(&p) => ctx.enc.integer(p),
            None => ctx.enc.null(),
        },
        Some(_) => {
            ctx.enc.array(found.len());
            for p in found {
                ctx.enc.integer(p);
            }
        }
    }
}

fn side(arg: &[u8]) -> Option<bool> {
    if eq_ignore_case(arg, "left") {
        Some(true)
    } else if eq_ignore_case(arg, "right") {
        Some(false)
    } else {
        None
    }
}

/// Moves one element from `src` to `dst`: pushed on the destination first, then popped from the
/// source only if it is still the element at that end (otherwise the destination's push is
/// taken back and it starts again). A crash between the two leaves the element in both lists,
/// never in neither. A compact list moved within itself is one atomic change; a large one moves
/// as two lists do.
fn lmove(ctx: &mut Ctx<'_>, src: &[u8], dst: &[u8], from_left: bool, to_left: bool) {
    for _ in 0..64 {
        let end = if from_left { 0 } else { -1 };
        let element = match large_range(ctx, src, end, end) {
            Ok(Some(mut items)) => items.pop(),
            Ok(None) => match load::<List>(ctx, src) {
                Ok(source) => source.and_then(|l| {
                    if from_left {
                        l.items.front().cloned()
                    } else {
                        l.items.back().cloned()
                    }
                }),
                Err(Replied) => return,
            },
            Err(Replied) => return,
        };
        let Some(element) = element else {
            return ctx.enc.null();
        };
        let large_src = match large_of(ctx, src) {
            Ok(l) => l.is_some(),
            Err(Replied) => return,
        };
        if src == dst && !large_src {
            let moved = update::<List, bool>(ctx, src, |l, _| {
                let e = if from_left {
                    l.items.pop_front()
                } else {
                    l.items.pop_back()
                };
                match e {
                    Some(e) if e == element => {
                        if to_left {
                            l.items.push_front(e);
                        } else {
                            l.items.push_back(e);
                        }
                        Ok((true, true))
                    }
                    _ => Ok((false, false)),
                }
            });
            match moved {
                Ok(true) => return ctx.enc.bulk(&element),
                Ok(false) => continue,
                Err(Replied) => return,
            }
        }
        // The destination must be a list (or absent) before anything moves.
        if !list_or_absent(ctx, dst) {
            return;
        }
        if push_items(ctx, dst, to_left, false, &[&element]).is_err() {
            return;
        }
        match pop_items(ctx, src, from_left, 1, Some(&element)) {
            Ok(Some(popped)) if !popped.is_empty() => return ctx.enc.bulk(&element),
            Ok(_) => {
                // Someone took the element first: take the copy back from the destination.
                let undone = update::<List, ()>(ctx, dst, |l, _| {
                    let at = if to_left {
                        l.items.iter().position(|e| *e == element)
                    } else {
                        l.items.iter().rposition(|e| *e == element)
                    };
                    match at {
                        Some(i) => {
                            l.items.remove(i);
                            Ok(((), true))
                        }
                        None => Ok(((), false)),
                    }
                });
                if undone.is_err() {
                    return;
                }
            }
            Err(Replied) => return,
        }
    }
    ctx.enc
        .error("ERR too much contention on the key, try again")
}

/// Whether the key holds a list or nothing (else WRONGTYPE, or the read's error, is answered).
fn list_or_absent(ctx: &mut Ctx<'_>, key: &[u8]) -> bool {
    let node = ctx.node;
    let kind = node.read_with(
        node.tablet_of(key),
        key,
        &mut ctx.session.acks,
        |v, _, _| types::kind_of(v),
    );
    match kind {
        Ok(None) | Ok(Some(Ok(types::Kind::List))) => true,
        Ok(Some(Ok(_))) => {
            ctx.enc.error(ERR_WRONGTYPE);
            false
        }
        Ok(Some(Err(e))) => {
            ctx.enc
                .error(&format!("ERR the stored value of this key is damaged: {e}"));
            false
        }
        Err(e) => {
            engine_error(ctx, &e);
            false
        }
    }
}

/// LMOVE source destination LEFT|RIGHT LEFT|RIGHT
pub(super) fn cmd_lmove(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (Some(from_left), Some(to_left)) = (side(args[3]), side(args[4])) else {
        return ctx.enc.error(ERR_SYNTAX);
    };
    lmove(ctx, args[1], args[2], from_left, to_left)
}

/// RPOPLPUSH source destination
pub(super) fn cmd_rpoplpush(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    lmove(ctx, args[1], args[2], false, true)
}

/// A blocking command's timeout in seconds (0 = for ever), as Redis parses it.
pub(crate) fn parse_timeout(arg: &[u8]) -> Result<f64, &'static str> {
    // Redis reads it with strtold, which takes hexadecimal too (`0x7FFFFFFFFFFFFF`).
    let hex = std::str::from_utf8(arg)
        .ok()
        .and_then(|t| t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")))
        .and_then(|digits| u128::from_str_radix(digits, 16).ok());
    if let Some(seconds) = hex {
        return if seconds as f64 <= 1e12 {
            Ok(seconds as f64)
        } else {
            Err("ERR timeout is out of range")
        };
    }
    match parse_f64(arg) {
        Some(t) if t < 0.0 => Err("ERR timeout is negative"),
        Some(t) if t.is_finite() && t <= 1e12 => Ok(t),
        Some(_) => Err("ERR timeout is out of range"),
        None => Err("ERR timeout is not a float or out of range"),
    }
}

/// BLPOP/BRPOP key [key ...] timeout, one try: the first non-empty list's end element as
/// [key, element], or a null array. The connection blocks and tries again
/// (`front::blocking`); inside MULTI it answers at once.
fn bpop(ctx: &mut Ctx<'_>, args: &[&[u8]], left: bool) {
    if let Err(e) = parse_timeout(args[args.len() - 1]) {
        return ctx.enc.error(e);
    }
    for key in &args[1..args.len() - 1] {
        let popped = pop_items(ctx, key, left, 1, None).map(|p| p.and_then(|mut p| p.pop()));
        match popped {
            Ok(Some(e)) => {
                ctx.enc.array(2);
                ctx.enc.bulk(key);
                ctx.enc.bulk(&e);
                return;
            }
            Ok(None) => {}
            Err(Replied) => return,
        }
    }
    ctx.enc.null_array()
}

pub(super) fn cmd_blpop(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    bpop(ctx, args, true)
}
pub(super) fn cmd_brpop(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    bpop(ctx, args, false)
}

/// BLMOVE source destination LEFT|RIGHT LEFT|RIGHT timeout, one try.
pub(super) fn cmd_blmove(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (Some(from_left), Some(to_left)) = (side(args[3]), side(args[4])) else {
        return ctx.enc.error(ERR_SYNTAX);
    };
    if let Err(e) = parse_timeout(args[5]) {
        return ctx.enc.error(e);
    }
    lmove(ctx, args[1], args[2], from_left, to_left)
}

/// BRPOPLPUSH source destination timeout, one try.
pub(super) fn cmd_brpoplpush(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Err(e) = parse_timeout(args[3]) {
        return ctx.enc.error(e);
    }
    lmove(ctx, args[1], args[2], false, true)
}

/// LMPOP/BLMPOP from `at` (the numkeys argument): pops up to COUNT elements from the first
/// non-empty list, answering [key, [element, ...]], or a null array.
fn lmpop(ctx: &mut Ctx<'_>, args: &[&[u8]], at: usize) {
    let Ok(n) = parse_numkeys(
        ctx,
        args,
        at,
        "ERR numkeys should be greater than 0",
        ERR_SYNTAX,
    ) else {
        return;
    };
    let Some(which) = args.get(at + 1 + n) else {
        return ctx.enc.error(ERR_SYNTAX);
    };
    let left = if eq_ignore_case(which, "left") {
        true
    } else if eq_ignore_case(which, "right") {
        false
    } else {
        return ctx.enc.error(ERR_SYNTAX);
    };
    let Ok(count) = parse_mpop_count(ctx, &args[at + 2 + n..]) else {
        return;
    };
    for key in &args[at + 1..at + 1 + n] {
        let popped = pop_items(ctx, key, left, count, None).map(Option::unwrap_or_default);
        match popped {
            Ok(out) if out.is_empty() => {}
            Ok(out) => {
                ctx.enc.array(2);
                ctx.enc.bulk(key);
                ctx.enc.array(out.len());
                for e in &out {
                    ctx.enc.bulk(e);
                }
                return;
            }
            Err(Replied) => return,
        }
    }
    ctx.enc.null_array()
}

/// LMPOP numkeys key [key ...] LEFT|RIGHT [COUNT count]
pub(super) fn cmd_lmpop(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    lmpop(ctx, args, 1)
}

/// BLMPOP timeout numkeys key [key ...] LEFT|RIGHT [COUNT count], one try (see `bpop`).
pub(super) fn cmd_blmpop(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if let Err(e) = parse_timeout(args[1]) {
        return ctx.enc.error(e);
    }
    lmpop(ctx, args, 2)
}
