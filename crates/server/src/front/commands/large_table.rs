//! The large form of hashes and sets (docs/architecture.md, "The large form"; docs/formats.md,
//! "Large collections"). A hash or set past its compact limits becomes a header at the user's
//! key ([`LargeTable`]) and buckets at internal keys in the same tablet, addressed by linear
//! hashing: a member's bucket is its hash modulo the bucket count, rounded as linear hashing
//! rounds. A bucket is a compact hash or set of about [`BUCKET_BYTES`].
//!
//! A change of some members reads their buckets, edits them in place (no member decoded but the
//! ones it looks for), and writes the header and those buckets in one atomic unit conditional
//! on the header's version, so HSET or SADD costs the same at a million members as at a
//! hundred. When the average bucket passes its size the next bucket in order splits in two, in
//! the same unit; when it falls to a quarter the last split is undone.
//!
//! Readers take no lock: they read the header, the buckets and the header again, and start
//! over when its version moved (every change rewrites the header). Writers hold the key's
//! read-modify-write lock. A large hash or set does not go back to the compact form (neither
//! does Redis's hashtable encoding).

use super::large_list::{self, Change, HeaderWrite, LargeError, Place};
use super::typed::{random_u64, Replied};
use super::*;
use ramlog_proto::types::{self, member_hash, scan_position, Kind, LargeTable, RawBucket};
use std::collections::{HashMap, HashSet};

/// A member and its value (empty for a set's), as read.
pub(super) type Entry = (Vec<u8>, Vec<u8>);

/// Encoded member bytes per bucket, on average, before the next bucket splits.
pub(super) const BUCKET_BYTES: u64 = 1024;
/// Members per bucket, on average, before the next bucket splits (small members).
const BUCKET_ITEMS: u64 = 48;

/// A large hash or set as read: its header and the header's version.
#[derive(Clone, Copy)]
pub(super) struct Table {
    pub header: LargeTable,
    pub version: u64,
}

/// The chunk id of bucket `b` (chunk ids start at 1).
fn bucket_id(b: u64) -> u64 {
    b + 1
}

fn damaged(e: ramlog_proto::types::TypedError) -> LargeError {
    LargeError::Damaged(e.to_string())
}

/// The key's large table of `kind`: one index lookup, no value copied. None when it holds
/// anything else (absent, compact, another type).
fn table_of(ctx: &mut Ctx<'_>, key: &[u8], kind: Kind) -> Result<Option<Table>, LargeError> {
    let node = ctx.node;
    let found = node.read_with(
        node.tablet_of(key),
        key,
        &mut ctx.session.acks,
        |v, version, _| {
            (types::large_kind(v) == Some(kind))
                .then(|| LargeTable::decode(v).map(|header| Table { header, version }))
        },
    )?;
    match found {
        Some(Some(t)) => t.map(Some).map_err(damaged),
        _ => Ok(None),
    }
}

/// Runs `op` on the key's large table of `kind` while it holds one, again while the table
/// changes under it; None when it holds none (the caller takes the compact path). `serialize`
/// holds the key's read-modify-write lock throughout (writers).
pub(super) fn on_table<R>(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    kind: Kind,
    serialize: bool,
    mut op: impl FnMut(&mut Ctx<'_>, Place<'_>, Table) -> Result<R, LargeError>,
) -> Result<Option<R>, Replied> {
    let node = ctx.node;
    let _serialized = serialize.then(|| node.rmw_lock(key));
    for _ in 0..64 {
        let table = match table_of(ctx, key, kind) {
            Ok(Some(t)) => t,
            Ok(None) => return Ok(None),
            Err(e) => {
                large_list::reply_error(ctx, e);
                return Err(Replied);
            }
        };
        let place = Place::of(ctx, key);
        match op(ctx, place, table) {
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

/// Changes members of the key's large table of `kind`: `edit(i, current)` for each member in
/// turn (see [`change`]; a change that starts again calls it from member 0 again), under the
/// key's read-modify-write lock. None when the key holds no such table. An error `edit` returns
/// is answered.
pub(super) fn change_at(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    kind: Kind,
    members: &[&[u8]],
    mut edit: impl FnMut(usize, Option<&[u8]>) -> Result<Edit, String>,
) -> Result<Option<()>, Replied> {
    let done = on_table(ctx, key, kind, true, |ctx, place, table| {
        change(ctx, place, table, members, &mut edit)
    })?;
    match done {
        None => Ok(None),
        Some(Ok(_)) => Ok(Some(())),
        Some(Err(message)) => {
            ctx.enc.error(&message);
            Err(Replied)
        }
    }
}

/// The values of `members` in the key's large table of `kind` (None for those absent); None
/// when the key holds no such table.
pub(super) fn get_at(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    kind: Kind,
    members: &[&[u8]],
) -> Result<Option<Vec<Option<Vec<u8>>>>, Replied> {
    on_table(ctx, key, kind, false, |ctx, place, table| {
        get(ctx, place, table, members)
    })
}

/// Reads bucket `b`.
fn read_bucket(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    t: &LargeTable,
    b: u64,
) -> Result<RawBucket, LargeError> {
    let kind = t.kind;
    large_list::read_decoded(ctx, place, t.gen, bucket_id(b), |v| {
        RawBucket::decode(v, kind)
    })
}

/// Runs a read of a large table again while the table changes under it (at most 64 times).
fn consistent<R>(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    table: Table,
    mut read: impl FnMut(&mut Ctx<'_>, Table) -> Result<R, LargeError>,
) -> Result<R, LargeError> {
    let kind = table.header.kind;
    let mut table = table;
    for _ in 0..64 {
        match read(ctx, table) {
            Ok(r) if large_list::header_version(ctx, place)? == Some(table.version) => {
                return Ok(r)
            }
            Ok(_) | Err(LargeError::Changed) => {}
            Err(e) => return Err(e),
        }
        match table_of(ctx, place.key, kind)? {
            Some(t) => table = t,
            // It is no longer a large table: the caller reads it again from the start.
            None => return Err(LargeError::Changed),
        }
    }
    Err(LargeError::Changed)
}

/// The values of `members` (empty for a set's members), None for those absent.
pub(super) fn get(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    table: Table,
    members: &[&[u8]],
) -> Result<Vec<Option<Vec<u8>>>, LargeError> {
    consistent(ctx, place, table, |ctx, table| {
        get_in(ctx, place, &table.header, members)
    })
}

/// [`get`] of a table read as `t`, with no check that it stayed at its version (the caller's).
pub(super) fn get_in(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    t: &LargeTable,
    members: &[&[u8]],
) -> Result<Vec<Option<Vec<u8>>>, LargeError> {
    let mut buckets: HashMap<u64, RawBucket> = HashMap::new();
    let mut out = Vec::with_capacity(members.len());
    for m in members {
        let b = t.bucket_of(member_hash(t.gen, m));
        if let std::collections::hash_map::Entry::Vacant(e) = buckets.entry(b) {
            e.insert(read_bucket(ctx, place, t, b)?);
        }
        out.push(buckets[&b].get(m).map(<[u8]>::to_vec));
    }
    Ok(out)
}

/// Every member and value (empty for a set), bucket by bucket.
pub(super) fn entries(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    table: Table,
) -> Result<Vec<Entry>, LargeError> {
    consistent(ctx, place, table, |ctx, table| {
        entries_in(ctx, place, &table.header)
    })
}

/// [`entries`] of a table read as `t`, with no check that it stayed at its version.
pub(super) fn entries_in(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    t: &LargeTable,
) -> Result<Vec<Entry>, LargeError> {
    let mut out = Vec::with_capacity(t.len.min(1 << 22) as usize);
    for b in 0..t.buckets() {
        let bucket = read_bucket(ctx, place, t, b)?;
        out.extend(bucket.entries().map(|(m, v, _)| (m.to_vec(), v.to_vec())));
    }
    if out.len() as u64 != t.len {
        return Err(LargeError::Damaged(format!(
            "the header counts {} members, the buckets hold {}",
            t.len,
            out.len()
        )));
    }
    Ok(out)
}

/// HSCAN and SSCAN: members from scan position `cursor` on, a bucket at a time, until `count`
/// are collected; returns the next cursor (0 at the end). A cursor is a position in the
/// reversed-hash order ([`scan_position`]), in which each bucket is one interval whatever the
/// table's size, so a member present throughout a scan is returned exactly once.
pub(super) fn scan(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    table: Table,
    cursor: u64,
    count: usize,
) -> Result<(u64, Vec<Entry>), LargeError> {
    consistent(ctx, place, table, |ctx, table| {
        scan_in(ctx, place, &table.header, cursor, count)
    })
}

/// [`scan`] of a table read as `t`, with no check that it stayed at its version.
pub(super) fn scan_in(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    t: &LargeTable,
    cursor: u64,
    count: usize,
) -> Result<(u64, Vec<Entry>), LargeError> {
    {
        let t = *t;
        let mut out = Vec::new();
        let mut pos = cursor;
        let mut visited = 0usize;
        loop {
            // The bucket that holds position `pos` and the interval it covers.
            let b = t.bucket_of(pos.reverse_bits());
            let bits = t.bucket_bits(b);
            let start = if bits == 0 {
                0
            } else {
                pos & !(u64::MAX >> bits)
            };
            let end = if bits == 0 {
                None
            } else {
                start.checked_add(1u64 << (64 - bits))
            };
            let bucket = read_bucket(ctx, place, &t, b)?;
            for (m, v, _) in bucket.entries() {
                if scan_position(member_hash(t.gen, m)) >= pos {
                    out.push((m.to_vec(), v.to_vec()));
                }
            }
            visited += 1;
            match end {
                None => return Ok((0, out)),
                Some(e) => pos = e,
            }
            if out.len() >= count || visited >= count.saturating_mul(10) {
                return Ok((pos, out));
            }
        }
    }
}

/// `count` random members with their values: distinct when `count` is positive (at most all of
/// them), possibly repeated when negative (|count| of them). Each is as likely as any other.
pub(super) fn random(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    table: Table,
    count: i64,
) -> Result<Vec<Entry>, LargeError> {
    consistent(ctx, place, table, |ctx, table| {
        random_in(ctx, place, &table.header, count)
    })
}

/// [`random`] of a table read as `t`, with no check that it stayed at its version.
pub(super) fn random_in(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    t: &LargeTable,
    count: i64,
) -> Result<Vec<Entry>, LargeError> {
    let len = t.len;
    let want = count.unsigned_abs();
    // Many of them: read the whole table once and pick from it.
    if want.saturating_mul(4) >= len {
        let all = entries_in(ctx, place, t)?;
        let picks = super::typed::random_picks(all.len(), count);
        return Ok(picks.into_iter().map(|i| all[i].clone()).collect());
    }
    {
        let t = *t;
        let n = t.buckets();
        // Rejection sampling: a bucket drawn at random, then a slot of `cap`; a slot past the
        // bucket's members draws again. Uniform while no bucket holds more than `cap`.
        let cap = 2 * t.len / n + 16;
        let mut cache: HashMap<u64, RawBucket> = HashMap::new();
        let mut seen: HashSet<Vec<u8>> = HashSet::new();
        let mut out = Vec::with_capacity(want as usize);
        let mut draws = 0u64;
        while (out.len() as u64) < want {
            draws += 1;
            if draws > want.saturating_mul(64) + 1024 {
                return Err(LargeError::Damaged(
                    "no member found in the buckets the header names".into(),
                ));
            }
            let b = random_u64() % n;
            if let std::collections::hash_map::Entry::Vacant(e) = cache.entry(b) {
                e.insert(read_bucket(ctx, place, &t, b)?);
            }
            let bucket = &cache[&b];
            let slot = random_u64() % cap.max(bucket.count);
            let Some((m, v, _)) = bucket.entries().nth(slot as usize) else {
                continue;
            };
            if count > 0 && !seen.insert(m.to_vec()) {
                continue;
            }
            out.push((m.to_vec(), v.to_vec()));
        }
        Ok(out)
    }
}

/// What a change does to one member.
pub(super) enum Edit {
    Keep,
    Set(Vec<u8>),
    Remove,
}

/// Whether a table of `t`'s members wants more buckets.
fn overfull(t: &LargeTable) -> bool {
    let n = t.buckets();
    t.bytes > n.saturating_mul(BUCKET_BYTES) || t.len > n.saturating_mul(BUCKET_ITEMS)
}

/// Whether a table of `t`'s members would do with fewer buckets.
fn underfull(t: &LargeTable) -> bool {
    let n = t.buckets();
    n > 1
        && t.bytes.saturating_mul(4) < n.saturating_mul(BUCKET_BYTES)
        && t.len.saturating_mul(4) < n.saturating_mul(BUCKET_ITEMS)
}

/// A change of a large table's members prepared but not written: the header as it becomes,
/// the buckets to write and those to delete.
pub(super) struct Staged {
    pub t: LargeTable,
    pub puts: Vec<(u64, Vec<u8>)>,
    pub gone: Vec<u64>,
    /// Whether any member changed (nothing is to be written otherwise).
    pub changed: bool,
}

/// Changes members of a large table: `edit(i, current)` for each of `members` in turn (a
/// member named twice sees the first edit) says what becomes of it, or answers an error and
/// nothing is written. Splits or merges buckets as the load calls for, and writes the header
/// and every changed bucket in one unit conditional on the header's version; a table left empty
/// is deleted with its buckets. Returns the table's new length.
pub(super) fn change(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    table: Table,
    members: &[&[u8]],
    edit: impl FnMut(usize, Option<&[u8]>) -> Result<Edit, String>,
) -> Result<Result<u64, String>, LargeError> {
    let staged = match stage(ctx, place, table.header, members, edit)? {
        Ok(s) => s,
        Err(message) => return Ok(Err(message)),
    };
    let t = staged.t;
    if !staged.changed {
        return Ok(Ok(t.len));
    }
    if t.len == 0 {
        let mut change = Change {
            header: HeaderWrite::Delete,
            expire: None,
            condition: Condition::IfVersion(table.version),
            gen: t.gen,
            puts: Vec::new(),
            deletes: (0..table.header.buckets()).map(bucket_id).collect(),
        };
        large_list::delete_in_units(ctx, place, &mut change)?;
        return Ok(Ok(0));
    }
    let change = Change {
        header: HeaderWrite::Small(t.encode()),
        expire: None,
        condition: Condition::IfVersion(table.version),
        gen: t.gen,
        puts: staged.puts,
        deletes: staged.gone,
    };
    large_list::commit(ctx, place, &change)?;
    Ok(Ok(t.len))
}

/// Prepares a change of members of the table read as `t` (see [`change`]): the edits, then the
/// splits or merges of buckets the load calls for. A table left empty is staged with no
/// buckets to write (the caller deletes it whole).
pub(super) fn stage(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    t: LargeTable,
    members: &[&[u8]],
    mut edit: impl FnMut(usize, Option<&[u8]>) -> Result<Edit, String>,
) -> Result<Result<Staged, String>, LargeError> {
    let mut t = t;
    let mut buckets: HashMap<u64, (RawBucket, bool)> = HashMap::new();
    for (i, m) in members.iter().enumerate() {
        let b = t.bucket_of(member_hash(t.gen, m));
        if let std::collections::hash_map::Entry::Vacant(e) = buckets.entry(b) {
            e.insert((read_bucket(ctx, place, &t, b)?, false));
        }
        let (bucket, dirty) = buckets.get_mut(&b).expect("read above");
        let next = match edit(i, bucket.get(m)) {
            Ok(next) => next,
            Err(message) => return Ok(Err(message)),
        };
        match next {
            Edit::Keep => {}
            Edit::Set(value) => {
                let (before, after) = bucket.set(m, &value);
                if before == 0 {
                    t.len += 1;
                }
                t.bytes = (t.bytes + after as u64).saturating_sub(before as u64);
                *dirty = true;
            }
            Edit::Remove => {
                if let Some(n) = bucket.remove(m) {
                    t.len -= 1;
                    t.bytes = t.bytes.saturating_sub(n as u64);
                    *dirty = true;
                }
            }
        }
    }
    let changed = buckets.values().any(|(_, dirty)| *dirty);
    if !changed || t.len == 0 {
        return Ok(Ok(Staged {
            t,
            puts: Vec::new(),
            gone: Vec::new(),
            changed,
        }));
    }
    let mut gone = Vec::new();
    while overfull(&t) && split_next(ctx, place, &mut t, &mut buckets)? {}
    while underfull(&t) {
        let before = t;
        let Some((into, last)) = t.shrink() else {
            break;
        };
        let leaving = match buckets.remove(&last) {
            Some((b, _)) => b,
            None => read_bucket(ctx, place, &before, last)?,
        };
        if let std::collections::hash_map::Entry::Vacant(e) = buckets.entry(into) {
            e.insert((read_bucket(ctx, place, &before, into)?, false));
        }
        let (target, dirty) = buckets.get_mut(&into).expect("read above");
        for (_, _, range) in leaving.entries() {
            target.push_encoded(&leaving.items[range]);
        }
        *dirty = true;
        gone.push(bucket_id(last));
    }
    // A bucket past what one object may hold (large members that share their low hash bits):
    // buckets split in order until it is split enough (the split pointer reaches any bucket
    // within twice the bucket count, and each round halves it), at most OVERSIZE_SPLITS of
    // them in one change.
    let limit = bucket_limit(ctx);
    let mut rounds = OVERSIZE_SPLITS;
    while let Some((count, len)) = buckets
        .values()
        .filter(|(b, dirty)| *dirty && b.encoded_len() > limit)
        .map(|(b, _)| (b.count, b.encoded_len()))
        .next()
    {
        if count <= 1 || rounds == 0 || !split_next(ctx, place, &mut t, &mut buckets)? {
            return Ok(Err(too_large(ctx, t.kind, len)));
        }
        rounds -= 1;
    }
    let puts: Vec<(u64, Vec<u8>)> = buckets
        .into_iter()
        .filter(|(_, (_, dirty))| *dirty)
        .map(|(b, (bucket, _))| (bucket_id(b), bucket.encode()))
        .collect();
    // A bucket merged away and split off again in this change is written, not deleted.
    gone.retain(|id| !puts.iter().any(|(put, _)| put == id));
    Ok(Ok(Staged {
        t,
        puts,
        gone,
        changed: true,
    }))
}

/// Splits the next bucket in order (reading it unless `buckets` holds it); false when the table
/// cannot grow.
fn split_next(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    t: &mut LargeTable,
    buckets: &mut HashMap<u64, (RawBucket, bool)>,
) -> Result<bool, LargeError> {
    let before = *t;
    let Some((from, to)) = t.grow() else {
        return Ok(false);
    };
    let source = match buckets.remove(&from) {
        Some((b, _)) => b,
        None => read_bucket(ctx, place, &before, from)?,
    };
    let (mut stay, mut moved) = (RawBucket::empty(t.kind), RawBucket::empty(t.kind));
    for (m, _, range) in source.entries() {
        let entry = &source.items[range];
        if t.bucket_of(member_hash(t.gen, m)) == from {
            stay.push_encoded(entry);
        } else {
            moved.push_encoded(entry);
        }
    }
    buckets.insert(from, (stay, true));
    buckets.insert(to, (moved, true));
    Ok(true)
}

/// The most splits one change makes for a bucket past what one object may hold (each writes a
/// bucket of about [`BUCKET_BYTES`] in the change's unit). Only members and values of more than
/// a third of the value size limit sharing their low hash bits need them; when they do not
/// suffice, the change is refused with an error that names the limit.
const OVERSIZE_SPLITS: u64 = 4096;

/// The most bytes one bucket may take: what one object may hold.
fn bucket_limit(ctx: &Ctx<'_>) -> usize {
    (ctx.node.config.value_size_max_bytes as usize).saturating_add(types::TAG_BYTES)
}

/// The answer to a member (with its value) too large for one object.
fn too_large(ctx: &Ctx<'_>, kind: Kind, len: usize) -> String {
    let what = if kind == Kind::Hash {
        "hash field and its value"
    } else {
        "set member"
    };
    format!(
        "ERR a {what} would take {len} bytes, more than the value size limit ({} bytes); nothing was changed",
        ctx.node.config.value_size_max_bytes
    )
}

/// Writes `entries` (distinct members, with values for a hash) at the key as a large table of
/// `kind` under a new generation, replacing what the key holds at `condition` (`old`: the
/// generation and bucket count of a large table there, whose buckets are deleted after).
/// A table larger than one unit is written as buckets first and switched to by a last unit
/// with the header.
pub(super) fn write(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    kind: Kind,
    entries: &[(&[u8], &[u8])],
    condition: Condition,
    expire: Option<u64>,
    old: Option<(u64, u64)>,
) -> Result<(), LargeError> {
    let gen = large_list::random_gen();
    let (t, puts) = build(ctx, kind, gen, entries)?;
    let old = old.map(|(gen, buckets)| (gen, (0..buckets).map(bucket_id).collect()));
    commit_built(ctx, place, t.encode(), gen, puts, condition, expire, old)
}

/// The chunk ids of a table's buckets.
pub(super) fn bucket_ids(t: &LargeTable) -> impl Iterator<Item = u64> {
    (0..t.buckets()).map(bucket_id)
}

/// Chunks to write: id and encoded chunk.
pub(super) type Chunks = Vec<(u64, Vec<u8>)>;

/// The header and buckets of a new large table of `kind` holding `entries`, under `gen`.
pub(super) fn build(
    ctx: &Ctx<'_>,
    kind: Kind,
    gen: u64,
    entries: &[(&[u8], &[u8])],
) -> Result<(LargeTable, Chunks), LargeError> {
    let mut t = LargeTable::new(kind, gen);
    let mut encoded = Vec::with_capacity(entries.len());
    for (m, v) in entries {
        let mut entry = Vec::with_capacity(m.len() + v.len() + 6);
        put_entry(&mut entry, m);
        if kind == Kind::Hash {
            put_entry(&mut entry, v);
        }
        t.len += 1;
        t.bytes += entry.len() as u64;
        encoded.push((member_hash(gen, m), entry));
    }
    while overfull(&t) && t.grow().is_some() {}
    let limit = bucket_limit(ctx);
    let buckets = loop {
        let mut buckets: Vec<RawBucket> =
            (0..t.buckets()).map(|_| RawBucket::empty(kind)).collect();
        for (hash, entry) in &encoded {
            buckets[t.bucket_of(*hash) as usize].push_encoded(entry);
        }
        // A bucket past what one object may hold: twice the buckets, until none is.
        let Some(over) = buckets.iter().find(|b| b.encoded_len() > limit) else {
            break buckets;
        };
        if over.count <= 1 {
            return Err(LargeError::Refused(too_large(
                ctx,
                kind,
                over.encoded_len(),
            )));
        }
        let level = t.level;
        while t.level == level {
            if t.grow().is_none() {
                return Err(LargeError::Refused(too_large(
                    ctx,
                    kind,
                    over.encoded_len(),
                )));
            }
        }
    };
    let puts: Vec<(u64, Vec<u8>)> = buckets
        .iter()
        .enumerate()
        .map(|(b, bucket)| (bucket_id(b as u64), bucket.encode()))
        .collect();
    Ok((t, puts))
}

/// Writes a new large collection built under `gen` (its `header` at the key, its chunks
/// `puts`), replacing what the key holds at `condition`; `old`: the generation and chunk ids of
/// a large collection there, deleted after. A collection larger than one unit is written as
/// chunks first and switched to by a last unit with the header.
#[allow(clippy::too_many_arguments)]
pub(super) fn commit_built(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    header: Vec<u8>,
    gen: u64,
    puts: Vec<(u64, Vec<u8>)>,
    condition: Condition,
    expire: Option<u64>,
    old: Option<(u64, Vec<u64>)>,
) -> Result<(), LargeError> {
    let header = HeaderWrite::Small(header);
    if large_list::unit_bytes(&puts) <= large_list::UNIT_BYTES {
        let change = Change {
            header,
            expire,
            condition,
            gen,
            puts,
            deletes: Vec::new(),
        };
        large_list::commit(ctx, place, &change)?;
    } else {
        let building = (place.key.to_vec(), gen);
        large_list::BUILDING.lock().insert(building.clone());
        let written = large_list::write_chunks(ctx, place, gen, &puts);
        let switched = written.and_then(|()| {
            let change = Change {
                header,
                expire,
                condition,
                gen,
                puts: Vec::new(),
                deletes: Vec::new(),
            };
            large_list::commit(ctx, place, &change)
        });
        large_list::BUILDING.lock().remove(&building);
        if let Err(e) = switched {
            let ids: Vec<u64> = puts.iter().map(|(id, _)| *id).collect();
            large_list::delete_chunks(ctx, place, gen, &ids);
            return Err(e);
        }
    }
    if let Some((old_gen, ids)) = old {
        large_list::delete_chunks(ctx, place, old_gen, &ids);
    }
    Ok(())
}

/// A member or value as a bucket encodes it: a varint length and the bytes.
fn put_entry(out: &mut Vec<u8>, b: &[u8]) {
    let at = out.len();
    out.resize(at + ramlog_common::varint::len(b.len() as u64), 0);
    ramlog_common::varint::put(out, at, b.len() as u64);
    out.extend_from_slice(b);
}

/// Deletes a large table: its header (if still at its version) and its buckets.
pub(super) fn delete(ctx: &mut Ctx<'_>, place: Place<'_>, table: Table) -> Result<(), LargeError> {
    let mut change = Change {
        header: HeaderWrite::Delete,
        expire: None,
        condition: Condition::IfVersion(table.version),
        gen: table.header.gen,
        puts: Vec::new(),
        deletes: (0..table.header.buckets()).map(bucket_id).collect(),
    };
    large_list::delete_in_units(ctx, place, &mut change)
}

/// The bytes a large table's buckets take in the log (their entries and index slots).
pub(super) fn memory_usage(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    table: Table,
) -> Result<u64, LargeError> {
    consistent(ctx, place, table, |ctx, table| {
        let t = table.header;
        large_list::chunks_in_log(ctx, place, t.gen, (0..t.buckets()).map(bucket_id))
    })
}

/// The table at `stored` (a large hash's or set's header read by the caller).
pub(super) fn decode(stored: &Object) -> Result<Table, LargeError> {
    Ok(Table {
        header: LargeTable::decode(&stored.value).map_err(damaged)?,
        version: stored.version,
    })
}
