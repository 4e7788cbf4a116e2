//! What the commands of the collection types share: reading a key as a hash, list, set or sorted
//! set, an optimistic read-modify-write of one key, and writing a whole collection.
//!
//! A collection is one object whose value is its encoding (`ramlog_proto::types`,
//! docs/formats.md "Typed values"), so replication, the backups, recovery, mirrors and migration
//! carry it as they carry a string. A command that changes it reads the object, changes the
//! decoded collection, and writes it back on the condition that the version it read is still the
//! newest (a concurrent writer makes it read again), keeping the key's expiry. A collection left
//! empty is deleted, as Redis deletes empty collections.

use super::large_list;
use super::large_table;
use super::large_zset;
use super::*;
use ramlog_proto::types::{self, Kind, List, TypedError};
use std::sync::atomic::AtomicU64;

pub(super) const ERR_WRONGTYPE: &str =
    "WRONGTYPE Operation against a key holding the wrong kind of value";

/// A collection type as the commands use it.
pub(super) trait Collection: Default + Sized + 'static {
    const KIND: Kind;
    fn decode(stored: &[u8]) -> Result<Self, TypedError>;
    fn encode(&self) -> Vec<u8>;
    fn len(&self) -> usize;

    /// The members and values of a hash or set (the entries of its large form); None for the
    /// other types.
    fn table_entries(&self) -> Option<Vec<(&[u8], &[u8])>> {
        None
    }

    /// A hash or set built from the entries of its large form.
    fn from_table(_entries: Vec<(Vec<u8>, Vec<u8>)>) -> Self {
        Self::default()
    }

    /// Whether this hash or set belongs in the large form on this server.
    fn wants_table(&self, _ctx: &Ctx<'_>) -> bool {
        false
    }
}

/// Whether a hash or set's large form exists for `kind`.
fn has_table(kind: Kind) -> bool {
    matches!(kind, Kind::Hash | Kind::Set)
}

/// Whether a hash of these fields belongs in the large form: Redis's limits for its listpack
/// encoding (`hash-max-listpack-entries` and `-value`), and never past half the value limit.
pub(super) fn hash_wants_table(ctx: &Ctx<'_>, fields: &[(Vec<u8>, Vec<u8>)]) -> bool {
    let entries = ctx.node.settings.value("hash-max-listpack-entries").max(0) as usize;
    let value = ctx.node.settings.value("hash-max-listpack-value").max(0) as usize;
    let mut size = 0usize;
    for (f, v) in fields {
        if f.len() > value || v.len() > value {
            return true;
        }
        size += f.len() + v.len() + 4;
    }
    fields.len() > entries || size as u64 > ctx.node.config.value_size_max_bytes / 2
}

/// The compact encoding Redis would give this set: intset when every member is an integer,
/// it has never held another, and they are at most `set-max-intset-entries`; listpack when they
/// are at most `set-max-listpack-entries` of at most `set-max-listpack-value` bytes; None for
/// its hashtable (ramlog's large form).
pub(super) fn set_compact_encoding(ctx: &Ctx<'_>, set: &types::Set) -> Option<&'static str> {
    let settings = &ctx.node.settings;
    let members = &set.members;
    let size: usize = members.iter().map(|m| m.len() + 2).sum();
    if size as u64 > ctx.node.config.value_size_max_bytes / 2 {
        return None;
    }
    let intset = settings.value("set-max-intset-entries").max(0) as usize;
    if !set.listpack
        && members.len() <= intset
        && members.iter().all(|m| types::is_integer_member(m))
    {
        return Some("intset");
    }
    let entries = settings.value("set-max-listpack-entries").max(0) as usize;
    let value = settings.value("set-max-listpack-value").max(0) as usize;
    (members.len() <= entries && members.iter().all(|m| m.len() <= value)).then_some("listpack")
}

impl Collection for types::Hash {
    const KIND: Kind = Kind::Hash;
    fn decode(stored: &[u8]) -> Result<Self, TypedError> {
        types::Hash::decode(stored)
    }
    fn encode(&self) -> Vec<u8> {
        types::Hash::encode(self)
    }
    fn len(&self) -> usize {
        self.fields.len()
    }
    fn table_entries(&self) -> Option<Vec<(&[u8], &[u8])>> {
        Some(
            self.fields
                .iter()
                .map(|(f, v)| (f.as_slice(), v.as_slice()))
                .collect(),
        )
    }
    fn from_table(entries: Vec<(Vec<u8>, Vec<u8>)>) -> Self {
        types::Hash { fields: entries }
    }
    fn wants_table(&self, ctx: &Ctx<'_>) -> bool {
        hash_wants_table(ctx, &self.fields)
    }
}

impl Collection for types::List {
    const KIND: Kind = Kind::List;
    fn decode(stored: &[u8]) -> Result<Self, TypedError> {
        types::List::decode(stored)
    }
    fn encode(&self) -> Vec<u8> {
        types::List::encode(self)
    }
    fn len(&self) -> usize {
        self.items.len()
    }
}

impl Collection for types::Set {
    const KIND: Kind = Kind::Set;
    fn decode(stored: &[u8]) -> Result<Self, TypedError> {
        types::Set::decode(stored)
    }
    fn encode(&self) -> Vec<u8> {
        types::Set::encode(self)
    }
    fn len(&self) -> usize {
        self.members.len()
    }
    fn table_entries(&self) -> Option<Vec<(&[u8], &[u8])>> {
        Some(
            self.members
                .iter()
                .map(|m| (m.as_slice(), &[][..]))
                .collect(),
        )
    }
    fn from_table(entries: Vec<(Vec<u8>, Vec<u8>)>) -> Self {
        types::Set {
            members: entries.into_iter().map(|(m, _)| m).collect(),
            listpack: true,
        }
    }
    fn wants_table(&self, ctx: &Ctx<'_>) -> bool {
        set_compact_encoding(ctx, self).is_none()
    }
}

impl Collection for types::ZSet {
    const KIND: Kind = Kind::ZSet;
    fn decode(stored: &[u8]) -> Result<Self, TypedError> {
        types::ZSet::decode(stored)
    }
    fn encode(&self) -> Vec<u8> {
        types::ZSet::encode(self)
    }
    fn len(&self) -> usize {
        self.entries.len()
    }
}

/// The reply already written: the command ends.
pub(super) struct Replied;

fn damaged(ctx: &mut Ctx<'_>, e: TypedError) -> Replied {
    ctx.enc
        .error(&format!("ERR the stored value of this key is damaged: {e}"));
    Replied
}

/// Decodes a stored value as `C`, or answers WRONGTYPE (or that it is damaged).
pub(super) fn decode_as<C: Collection>(ctx: &mut Ctx<'_>, stored: &[u8]) -> Result<C, Replied> {
    match types::kind_of(stored) {
        Ok(k) if k == C::KIND => C::decode(stored).map_err(|e| damaged(ctx, e)),
        Ok(_) => {
            ctx.enc.error(ERR_WRONGTYPE);
            Err(Replied)
        }
        Err(e) => Err(damaged(ctx, e)),
    }
}

/// The key's collection of type `C`; None if the key is absent. A large list is read whole.
pub(super) fn load<C: Collection>(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<Option<C>, Replied> {
    for _ in 0..64 {
        match read(ctx, key) {
            Ok(None) => return Ok(None),
            Ok(Some(o))
                if types::large_kind(&o.value) == Some(C::KIND) && C::KIND == Kind::List =>
            {
                match read_large(ctx, key, &o) {
                    Ok((list, _)) => return Ok(Some(from_list(list))),
                    Err(large_list::LargeError::Changed) => continue,
                    Err(e) => {
                        large_list::reply_error(ctx, e);
                        return Err(Replied);
                    }
                }
            }
            Ok(Some(o)) if types::large_kind(&o.value) == Some(C::KIND) && has_table(C::KIND) => {
                match read_table(ctx, key, &o) {
                    Ok((entries, _)) => return Ok(Some(C::from_table(entries))),
                    Err(large_list::LargeError::Changed) => continue,
                    Err(e) => {
                        large_list::reply_error(ctx, e);
                        return Err(Replied);
                    }
                }
            }
            Ok(Some(o))
                if types::large_kind(&o.value) == Some(Kind::ZSet) && C::KIND == Kind::ZSet =>
            {
                let place = large_list::Place::of(ctx, key);
                match large_zset::decode(&o).and_then(|l| large_zset::entries(ctx, place, l)) {
                    Ok(entries) => return Ok(Some(cast(types::ZSet { entries }))),
                    Err(large_list::LargeError::Changed) => continue,
                    Err(e) => {
                        large_list::reply_error(ctx, e);
                        return Err(Replied);
                    }
                }
            }
            Ok(Some(o)) => return decode_as::<C>(ctx, &o.value).map(Some),
            Err(e) => {
                engine_error(ctx, &e);
                return Err(Replied);
            }
        }
    }
    large_list::reply_error(ctx, large_list::LargeError::Changed);
    Err(Replied)
}

/// A large list read whole, with its generation and chunk ids (to delete when it is rewritten).
fn read_large(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    stored: &Object,
) -> Result<(List, (u64, Vec<u64>)), large_list::LargeError> {
    let large = large_list::Large::decode(stored)?;
    let place = large_list::Place::of(ctx, key);
    let (list, ids) = large_list::materialize(ctx, place, large)?;
    Ok((list, (large.header.gen, ids)))
}

/// A large hash or set read whole, with its table (whose buckets go when it is rewritten).
fn read_table(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    stored: &Object,
) -> Result<(Vec<large_table::Entry>, large_table::Table), large_list::LargeError> {
    let table = large_table::decode(stored)?;
    let place = large_list::Place::of(ctx, key);
    Ok((large_table::entries(ctx, place, table)?, table))
}

/// `list` as the collection type `C` (which is `List`).
fn from_list<C: Collection>(list: List) -> C {
    cast(list)
}

/// `value` as the collection type `C`, which the caller has checked it is.
fn cast<C: Collection, T: 'static>(value: T) -> C {
    let boxed: Box<dyn std::any::Any> = Box::new(value);
    *boxed.downcast::<C>().expect("the caller checked the type")
}

/// `c` as a list, when `C` is `List`.
fn as_list<C: Collection>(c: &C) -> Option<&List> {
    (c as &dyn std::any::Any).downcast_ref::<List>()
}

/// `c` as a sorted set, when `C` is `ZSet`.
fn as_zset<C: Collection>(c: &C) -> Option<&types::ZSet> {
    (c as &dyn std::any::Any).downcast_ref::<types::ZSet>()
}

/// The key's collection of type `C`, empty if the key is absent.
pub(super) fn load_or_empty<C: Collection>(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<C, Replied> {
    load::<C>(ctx, key).map(Option::unwrap_or_default)
}

/// The string a stored value holds, or WRONGTYPE.
pub(super) fn string_or_wrongtype<'v>(
    ctx: &mut Ctx<'_>,
    stored: &'v [u8],
) -> Result<&'v [u8], Replied> {
    match types::string_of(stored) {
        Some(s) => Ok(s),
        None => {
            ctx.enc.error(ERR_WRONGTYPE);
            Err(Replied)
        }
    }
}

pub(super) fn too_large(ctx: &mut Ctx<'_>, kind: Kind, len: usize) -> Replied {
    let max = ctx.node.config.value_size_max_bytes;
    ctx.enc.error(&format!(
        "ERR the {} would take {len} bytes, more than the value size limit ({max} bytes); nothing was changed",
        kind.name()
    ));
    Replied
}

/// Reads the key's collection, lets `f` change it, and writes it back if `f` says it changed
/// (deleting the key when it is left empty). `f` gets the collection (empty if the key is
/// absent) and whether the key existed; it returns its result and whether it changed anything,
/// or an error to answer. A concurrent write of the key makes it start again.
pub(super) fn update<C: Collection, R>(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    f: impl FnMut(&mut C, bool) -> Result<(R, bool), String>,
) -> Result<R, Replied> {
    update_growing(ctx, key, None, f)
}

/// [`update`], where a list's form is decided as if `growing` were added to it (LSET: Redis
/// counts the new element as one more when it decides whether a list leaves its compact form).
pub(super) fn update_growing<C: Collection, R>(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    growing: Option<&[u8]>,
    mut f: impl FnMut(&mut C, bool) -> Result<(R, bool), String>,
) -> Result<R, Replied> {
    let node = ctx.node;
    let tablet = node.tablet_of(key);
    let _serialized = node.rmw_lock(key);
    for _ in 0..64 {
        let found = match node.get(tablet, key, &mut ctx.session.acks) {
            Ok(f) => f,
            Err(e) => {
                engine_error(ctx, &e);
                return Err(Replied);
            }
        };
        let mut old_large = None;
        let mut old_table = None;
        let mut old_zset = None;
        let (mut c, condition, existed) = match found {
            Some(o) if types::large_kind(&o.value) == Some(Kind::ZSet) && C::KIND == Kind::ZSet => {
                let place = large_list::Place::of(ctx, key);
                let read = large_zset::decode(&o)
                    .and_then(|l| large_zset::entries(ctx, place, l).map(|e| (l, e)));
                match read {
                    Ok((large, entries)) => {
                        old_zset = Some(large);
                        (
                            cast::<C, _>(types::ZSet { entries }),
                            Condition::IfVersion(o.version),
                            true,
                        )
                    }
                    Err(large_list::LargeError::Changed) => continue,
                    Err(e) => {
                        large_list::reply_error(ctx, e);
                        return Err(Replied);
                    }
                }
            }
            Some(o) if types::large_kind(&o.value) == Some(C::KIND) && has_table(C::KIND) => {
                match read_table(ctx, key, &o) {
                    Ok((entries, table)) => {
                        old_table = Some(table);
                        (
                            C::from_table(entries),
                            Condition::IfVersion(o.version),
                            true,
                        )
                    }
                    Err(large_list::LargeError::Changed) => continue,
                    Err(e) => {
                        large_list::reply_error(ctx, e);
                        return Err(Replied);
                    }
                }
            }
            Some(o) if types::large_kind(&o.value) == Some(C::KIND) && C::KIND == Kind::List => {
                match read_large(ctx, key, &o) {
                    Ok((list, old)) => {
                        old_large = Some(old);
                        (from_list::<C>(list), Condition::IfVersion(o.version), true)
                    }
                    Err(large_list::LargeError::Changed) => continue,
                    Err(e) => {
                        large_list::reply_error(ctx, e);
                        return Err(Replied);
                    }
                }
            }
            Some(o) => (
                decode_as::<C>(ctx, &o.value)?,
                Condition::IfVersion(o.version),
                true,
            ),
            None => (C::default(), Condition::IfAbsent, false),
        };
        let (result, changed) = match f(&mut c, existed) {
            Ok(r) => r,
            Err(message) => {
                ctx.enc.error(&message);
                return Err(Replied);
            }
        };
        if !changed || (!existed && c.len() == 0) {
            return Ok(result);
        }
        if let Some(list) = as_list(&c) {
            if old_large.is_some() || large_list::wants_large(ctx, &list.items, growing) {
                let place = large_list::Place::of(ctx, key);
                match large_list::write(ctx, place, list, condition, None, old_large, growing) {
                    Ok(()) => {
                        if c.len() > 0 {
                            node.waiters.wake(key);
                        }
                        return Ok(result);
                    }
                    Err(large_list::LargeError::Changed) => continue,
                    Err(e) => {
                        large_list::reply_error(ctx, e);
                        return Err(Replied);
                    }
                }
            }
        }
        if let Some(z) = as_zset(&c) {
            if old_zset.is_some() || (c.len() > 0 && large_zset::wants_large(ctx, &z.entries)) {
                let place = large_list::Place::of(ctx, key);
                let written = match old_zset {
                    Some(large) if c.len() == 0 => large_zset::delete(ctx, place, large),
                    old => large_zset::write(ctx, place, &z.entries, condition, None, old),
                };
                match written {
                    Ok(()) => {
                        if c.len() > 0 {
                            node.waiters.wake(key);
                        }
                        return Ok(result);
                    }
                    Err(large_list::LargeError::Changed) => continue,
                    Err(e) => {
                        large_list::reply_error(ctx, e);
                        return Err(Replied);
                    }
                }
            }
        }
        if old_table.is_some() || c.wants_table(ctx) {
            let place = large_list::Place::of(ctx, key);
            // An empty collection that was compact is deleted below, as any.
            let written = match (old_table, c.table_entries()) {
                (Some(table), _) if c.len() == 0 => Some(large_table::delete(ctx, place, table)),
                (old, Some(entries)) if c.len() > 0 => Some(large_table::write(
                    ctx,
                    place,
                    C::KIND,
                    &entries,
                    condition,
                    None,
                    old.map(|t| (t.header.gen, t.header.buckets())),
                )),
                _ => None,
            };
            match written {
                None => {}
                Some(Ok(())) => return Ok(result),
                Some(Err(large_list::LargeError::Changed)) => continue,
                Some(Err(e)) => {
                    large_list::reply_error(ctx, e);
                    return Err(Replied);
                }
            }
        }
        let done = if c.len() == 0 {
            match node.delete(tablet, key, condition, &mut ctx.session.acks) {
                Ok(Some(_)) => Ok(()),
                Ok(None) => Err(NodeError::Engine(EngineError::ConditionFailed {
                    current: None,
                })),
                Err(e) => Err(e),
            }
        } else {
            let bytes = c.encode();
            if bytes.len() as u64 > ctx.node.config.value_size_max_bytes + types::TAG_BYTES as u64 {
                return Err(too_large(ctx, C::KIND, bytes.len()));
            }
            let opts = PutOptions {
                condition,
                keep_ttl: true,
                ..Default::default()
            };
            node.put(tablet, key, &bytes, &opts, &mut ctx.session.acks)
                .map(|_| ())
        };
        match done {
            Ok(()) => {
                if c.len() > 0 {
                    node.waiters.wake(key);
                }
                return Ok(result);
            }
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

/// Replaces the key with the collection `c` (any type it held before; no expiry), or deletes it
/// when `c` is empty, as Redis's *STORE commands do.
pub(super) fn store<C: Collection>(ctx: &mut Ctx<'_>, key: &[u8], c: &C) -> Result<(), Replied> {
    let node = ctx.node;
    let tablet = node.tablet_of(key);
    if let Some(z) = as_zset(c).filter(|z| large_zset::wants_large(ctx, &z.entries)) {
        let place = large_list::Place::of(ctx, key);
        // What the key held goes (the chunks of a large collection there with it, now or by
        // the sweep).
        let done = large_zset::write(ctx, place, &z.entries, Condition::None, Some(0), None);
        if done.is_ok() {
            node.waiters.wake(key);
        }
        return done.map_err(|e| {
            large_list::reply_error(ctx, e);
            Replied
        });
    }
    if c.len() > 0 && c.wants_table(ctx) {
        let entries = c.table_entries().unwrap_or_default();
        let place = large_list::Place::of(ctx, key);
        // What the key held goes (the chunks of a large collection there with it, now or by
        // the sweep).
        return large_table::write(
            ctx,
            place,
            C::KIND,
            &entries,
            Condition::None,
            Some(0),
            None,
        )
        .map_err(|e| {
            large_list::reply_error(ctx, e);
            Replied
        });
    }
    let done = if c.len() == 0 {
        node.delete(tablet, key, Condition::None, &mut ctx.session.acks)
            .map(|_| ())
    } else {
        let bytes = c.encode();
        if bytes.len() as u64 > ctx.node.config.value_size_max_bytes + types::TAG_BYTES as u64 {
            return Err(too_large(ctx, C::KIND, bytes.len()));
        }
        node.put(
            tablet,
            key,
            &bytes,
            &PutOptions::default(),
            &mut ctx.session.acks,
        )
        .map(|_| ())
    };
    if done.is_ok() && c.len() > 0 {
        node.waiters.wake(key);
    }
    done.map_err(|e| {
        engine_error(ctx, &e);
        Replied
    })
}

/// TYPE key
pub(super) fn cmd_type(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let node = ctx.node;
    let found = node.read_with(
        node.tablet_of(args[1]),
        args[1],
        &mut ctx.session.acks,
        |value, _, _| types::kind_of(value),
    );
    match found {
        Ok(Some(Ok(kind))) => ctx.enc.simple(kind.name()),
        Ok(Some(Err(e))) => {
            damaged(ctx, e);
        }
        Ok(None) => ctx.enc.simple("none"),
        Err(e) => engine_error(ctx, &e),
    }
}

/// Redis's rules for a range of indexes `start..=stop` over `len` items (negative counts from the
/// end); None when it selects nothing.
pub(super) fn index_range(start: i64, stop: i64, len: usize) -> Option<(usize, usize)> {
    let len = len as i64;
    let mut start = if start < 0 { start + len } else { start };
    let mut stop = if stop < 0 { stop + len } else { stop };
    start = start.max(0);
    if start > stop || start >= len {
        return None;
    }
    stop = stop.min(len - 1);
    Some((start as usize, stop as usize))
}

/// A float argument as Redis's `getDoubleFromObject` takes it (no NaN).
pub(super) fn parse_f64(arg: &[u8]) -> Option<f64> {
    let text = std::str::from_utf8(arg).ok()?;
    if text.is_empty() || text.trim() != text {
        return None;
    }
    let v = match text.to_ascii_lowercase().as_str() {
        "inf" | "+inf" | "infinity" | "+infinity" => f64::INFINITY,
        "-inf" | "-infinity" => f64::NEG_INFINITY,
        other => other.parse::<f64>().ok()?,
    };
    (!v.is_nan()).then_some(v)
}

/// How INCRBYFLOAT and HINCRBYFLOAT write a float: the shortest text that reads back the same.
pub(super) fn float_text(v: f64) -> String {
    let text = format!("{v}");
    if text.contains('e') {
        format!("{v:.17}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    } else {
        text
    }
}

/// A small fast random generator for the RAND* and POP commands (no cryptographic use).
pub(crate) fn random_u64() -> u64 {
    static STATE: AtomicU64 = AtomicU64::new(0);
    let mut x = STATE.load(Ordering::Relaxed);
    if x == 0 {
        x = (now_ms() ^ 0x9E37_79B9_7F4A_7C15) | 1;
    }
    // xorshift64*
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    STATE.store(x, Ordering::Relaxed);
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// `count` indexes below `len` for RANDMEMBER/RANDFIELD: distinct when `count` is positive (at
/// most `len`), possibly repeated when negative (|count| of them).
pub(super) fn random_picks(len: usize, count: i64) -> Vec<usize> {
    if len == 0 {
        return Vec::new();
    }
    if count < 0 {
        return (0..count.unsigned_abs())
            .map(|_| (random_u64() % len as u64) as usize)
            .collect();
    }
    let want = (count as u64).min(len as u64) as usize;
    let mut all: Vec<usize> = (0..len).collect();
    for i in 0..want {
        let j = i + (random_u64() % (len - i) as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(want);
    all
}

/// The MATCH/COUNT (and NOVALUES for HSCAN) options of HSCAN, SSCAN and ZSCAN, checked as Redis
/// does. A collection is one object here, so one call returns all of it, with cursor 0 (as
/// Redis answers for its small encodings).
pub(super) struct ScanOptions<'a> {
    /// Where the scan resumes (0 at the start).
    pub cursor: u64,
    pub pattern: Option<&'a [u8]>,
    /// About how many members one call returns (10 unless COUNT says).
    pub count: usize,
    pub novalues: bool,
}

pub(super) fn parse_scan_options<'a>(
    ctx: &mut Ctx<'_>,
    args: &[&'a [u8]],
    allow_novalues: bool,
) -> Result<ScanOptions<'a>, Replied> {
    let Some(cursor) = std::str::from_utf8(args[2])
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    else {
        ctx.enc.error("ERR invalid cursor");
        return Err(Replied);
    };
    let mut out = ScanOptions {
        cursor,
        pattern: None,
        count: 10,
        novalues: false,
    };
    let mut i = 3;
    while i < args.len() {
        if allow_novalues && eq_ignore_case(args[i], "novalues") {
            out.novalues = true;
            i += 1;
            continue;
        }
        if i + 1 >= args.len() {
            ctx.enc.error(ERR_SYNTAX);
            return Err(Replied);
        }
        if eq_ignore_case(args[i], "match") {
            out.pattern = Some(args[i + 1]);
        } else if eq_ignore_case(args[i], "count") {
            match parse_i64(args[i + 1]) {
                Some(n) if n >= 1 => out.count = n.min(1 << 20) as usize,
                Some(_) => {
                    ctx.enc.error(ERR_SYNTAX);
                    return Err(Replied);
                }
                None => {
                    ctx.enc.error(ERR_NOT_INTEGER);
                    return Err(Replied);
                }
            }
        } else {
            ctx.enc.error(ERR_SYNTAX);
            return Err(Replied);
        }
        i += 2;
    }
    Ok(out)
}

/// Whether `item` passes a SCAN-family MATCH pattern (case-sensitive, as Redis).
pub(super) fn scan_matches(pattern: Option<&[u8]>, item: &[u8]) -> bool {
    pattern.is_none_or(|p| ramlog_common::glob::glob_match(p, item))
}

/// The key count of a `numkeys key [key ...]` command at `args[at]`: at least 1 (`nonpositive`
/// answers otherwise) and no more than the arguments after it (`too_many`).
pub(super) fn parse_numkeys(
    ctx: &mut Ctx<'_>,
    args: &[&[u8]],
    at: usize,
    nonpositive: &str,
    too_many: &str,
) -> Result<usize, Replied> {
    match parse_i64(args[at]) {
        Some(n) if n >= 1 => {
            if n as u64 > (args.len() - at - 1) as u64 {
                ctx.enc.error(too_many);
                Err(Replied)
            } else {
                Ok(n as usize)
            }
        }
        // Redis answers the same for a count that is not a number.
        _ => {
            ctx.enc.error(nonpositive);
            Err(Replied)
        }
    }
}

/// Parses `[COUNT count]` options from `args` (the only option allowed): Ok(count), 1 if absent.
pub(super) fn parse_mpop_count(ctx: &mut Ctx<'_>, args: &[&[u8]]) -> Result<usize, Replied> {
    let mut count = None;
    let mut i = 0;
    while i < args.len() {
        if eq_ignore_case(args[i], "count") && count.is_none() && i + 1 < args.len() {
            match parse_i64(args[i + 1]) {
                Some(n) if n >= 1 => count = Some(n as usize),
                _ => {
                    ctx.enc.error("ERR count should be greater than 0");
                    return Err(Replied);
                }
            }
            i += 2;
        } else {
            ctx.enc.error(ERR_SYNTAX);
            return Err(Replied);
        }
    }
    Ok(count.unwrap_or(1))
}

/// Parses a `LIMIT limit` tail (SINTERCARD, ZINTERCARD); 0 = no limit.
pub(super) fn parse_card_limit(ctx: &mut Ctx<'_>, args: &[&[u8]]) -> Result<usize, Replied> {
    match args {
        [] => Ok(0),
        [opt, n] if eq_ignore_case(opt, "limit") => match parse_i64(n) {
            Some(n) if n >= 0 => Ok(n as usize),
            _ => {
                ctx.enc.error("ERR LIMIT can't be negative");
                Err(Replied)
            }
        },
        _ => {
            ctx.enc.error(ERR_SYNTAX);
            Err(Replied)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_ranges_follow_redis() {
        assert_eq!(index_range(0, -1, 3), Some((0, 2)));
        assert_eq!(index_range(-100, 100, 3), Some((0, 2)));
        assert_eq!(index_range(2, 1, 3), None);
        assert_eq!(index_range(5, 10, 3), None);
        assert_eq!(index_range(0, -1, 0), None);
        assert_eq!(index_range(-1, -1, 3), Some((2, 2)));
    }

    #[test]
    fn floats_parse_and_print_like_redis() {
        assert_eq!(parse_f64(b"1.5"), Some(1.5));
        assert_eq!(parse_f64(b"-inf"), Some(f64::NEG_INFINITY));
        assert_eq!(parse_f64(b"+inf"), Some(f64::INFINITY));
        assert_eq!(parse_f64(b"nan"), None);
        assert_eq!(parse_f64(b" 1"), None);
        assert_eq!(parse_f64(b""), None);
        assert_eq!(float_text(10.5), "10.5");
        assert_eq!(float_text(3.0e3), "3000");
        assert_eq!(float_text(-0.1), "-0.1");
    }

    #[test]
    fn random_picks_are_distinct_when_asked() {
        for _ in 0..50 {
            let mut p = random_picks(10, 7);
            p.sort_unstable();
            p.dedup();
            assert_eq!(p.len(), 7);
            assert!(p.iter().all(|&i| i < 10));
        }
        assert_eq!(random_picks(3, 10).len(), 3);
        assert_eq!(random_picks(3, -10).len(), 10);
        assert!(random_picks(0, -10).is_empty());
    }
}
