//! Stored values of the Redis data types (docs/formats.md, "Typed values").
//!
//! The engine, replication, the backups, recovery, mirrors and migration carry an object's value
//! as opaque bytes. The type of a Redis key lives in those bytes, so that a hash or a sorted set is
//! replicated, recovered, migrated and scanned exactly like a string, with no format of its own
//! on any of those paths:
//!
//! ```text
//! first byte != 0xFF          a string, stored as is (every UTF-8 text, every schema record)
//! 0xFF 0x00 bytes             a string that begins with 0xFF (escaped: 2 more bytes)
//! 0xFF 0x40 bytes             a string of at most 44 bytes changed in place (APPEND, SETRANGE,
//!                             SETBIT, BITFIELD), whose OBJECT ENCODING is `raw` as in Redis
//! 0xFF kind count items...    a collection: kind 1 hash, 2 list, 3 set, 4 sorted set
//! 0xFF 5 last_ms last_seq count entries...   a stream
//! ```
//!
//! `count` is a LEB128 varint; then `count` items, each:
//! - hash: field, value (each a varint length and its bytes), in insertion order;
//! - list: element (varint length, bytes), head first;
//! - set: member (varint length, bytes), in insertion order;
//! - sorted set: score (f64, little-endian IEEE-754, never NaN), member (varint length, bytes),
//!   ordered by score, then by member bytes;
//! - stream (its header also holds the last id it generated, as varints `last_ms`, `last_seq`):
//!   id (varints `ms`, `seq`), a varint field count, then each field and value (varint length,
//!   bytes); ids strictly increasing and none above the last id.
//!
//! Nothing may follow the last item. The decoders take untrusted bytes (a damaged value, or a
//! value a native client wrote with a leading 0xFF): they never panic, never read out of bounds
//! and never allocate by a count read from the bytes beyond what the bytes can hold (fuzz target
//! `typed_value`).

use ramlog_common::varint;
use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};
use thiserror::Error;

/// First byte of every value that is not a plain string.
pub const TAG: u8 = 0xFF;
/// Bytes an escaped string or a collection's header adds in front.
pub const TAG_BYTES: usize = 2;

/// The second byte of a short string changed in place (see the module comment): Redis keeps such
/// a string `raw` until it is set again, where a value set whole would be `int` or `embstr`.
pub const RAW_STRING: u8 = 0x40;
/// The longest string Redis stores `embstr` (longer ones are `raw` whatever made them).
pub const EMBSTR_MAX_BYTES: usize = 44;

/// The Redis type of a stored value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    String = 0,
    Hash = 1,
    List = 2,
    Set = 3,
    ZSet = 4,
    Stream = 5,
}

impl Kind {
    /// The name TYPE answers.
    pub fn name(self) -> &'static str {
        match self {
            Kind::String => "string",
            Kind::Hash => "hash",
            Kind::List => "list",
            Kind::Set => "set",
            Kind::ZSet => "zset",
            Kind::Stream => "stream",
        }
    }

    fn from_byte(b: u8) -> Option<Kind> {
        Some(match b {
            0 => Kind::String,
            1 => Kind::Hash,
            2 => Kind::List,
            3 => Kind::Set,
            4 => Kind::ZSet,
            5 => Kind::Stream,
            _ => return None,
        })
    }
}

#[derive(Debug, Error, PartialEq, Eq, Clone, Copy)]
pub enum TypedError {
    #[error("stored value has an unknown type tag {0:#04x}")]
    UnknownKind(u8),
    #[error("stored value is truncated")]
    Truncated,
    #[error("stored value has a malformed varint")]
    BadVarint,
    #[error("stored value has bytes after its last item")]
    Trailing,
    #[error("stored sorted set has a NaN score or is out of order")]
    BadOrder,
    #[error("stored value is of another type")]
    WrongKind,
}

/// The type of a stored value. A lone 0xFF byte, or an unknown kind, is an error. The header of a
/// large collection ([`LARGE`]) is of its collection's type.
pub fn kind_of(stored: &[u8]) -> Result<Kind, TypedError> {
    match stored {
        [TAG, k, ..] if k & LARGE != 0 => match Kind::from_byte(k & !LARGE) {
            Some(kind @ (Kind::List | Kind::Hash | Kind::Set | Kind::ZSet)) => Ok(kind),
            _ => Err(TypedError::UnknownKind(*k)),
        },
        [TAG, k, ..] if *k == Kind::Set as u8 | SET_LISTPACK => Ok(Kind::Set),
        [TAG, RAW_STRING, ..] => Ok(Kind::String),
        [TAG, k, ..] => Kind::from_byte(*k).ok_or(TypedError::UnknownKind(*k)),
        [TAG] => Err(TypedError::Truncated),
        _ => Ok(Kind::String),
    }
}

/// Whether a stored value is the header of a large collection (its items live in chunks).
#[inline]
pub fn is_large(stored: &[u8]) -> bool {
    matches!(stored, [TAG, k, ..] if k & LARGE != 0)
}

/// The string a stored value holds; None if it holds another type (or is damaged).
#[inline]
pub fn string_of(stored: &[u8]) -> Option<&[u8]> {
    match stored.first() {
        Some(&TAG) => match stored.get(1) {
            Some(0 | &RAW_STRING) => Some(&stored[2..]),
            _ => None,
        },
        _ => Some(stored),
    }
}

/// What to store for the string `value`: itself, or escaped when it begins with 0xFF.
#[inline]
pub fn store_string(value: &[u8]) -> Cow<'_, [u8]> {
    if value.first() == Some(&TAG) {
        let mut out = Vec::with_capacity(value.len() + TAG_BYTES);
        out.extend_from_slice(&[TAG, 0]);
        out.extend_from_slice(value);
        Cow::Owned(out)
    } else {
        Cow::Borrowed(value)
    }
}

/// What to store for the string `value` made by changing a string in place: marked
/// [`RAW_STRING`] when it is short enough that Redis would otherwise call it `int` or `embstr`,
/// else as [`store_string`] stores it.
pub fn store_string_in_place(value: &[u8]) -> Cow<'_, [u8]> {
    if value.len() <= EMBSTR_MAX_BYTES {
        let mut out = Vec::with_capacity(value.len() + TAG_BYTES);
        out.extend_from_slice(&[TAG, RAW_STRING]);
        out.extend_from_slice(value);
        Cow::Owned(out)
    } else {
        store_string(value)
    }
}

/// Whether a stored string was marked `raw` by a change in place.
#[inline]
pub fn is_raw_string(stored: &[u8]) -> bool {
    matches!(stored, [TAG, RAW_STRING, ..])
}

/// Reads the parts of a collection's encoding.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn varint(&mut self) -> Result<u64, TypedError> {
        let mut value: u64 = 0;
        for i in 0..10 {
            let b = *self.buf.get(self.pos).ok_or(TypedError::Truncated)?;
            self.pos += 1;
            if i == 9 && b > 1 {
                return Err(TypedError::BadVarint);
            }
            value |= u64::from(b & 0x7F) << (7 * i);
            if b & 0x80 == 0 {
                // Only the shortest form: every value has one encoding.
                if b == 0 && i > 0 {
                    return Err(TypedError::BadVarint);
                }
                return Ok(value);
            }
        }
        Err(TypedError::BadVarint)
    }

    fn bytes(&mut self) -> Result<&'a [u8], TypedError> {
        let len = self.varint()?;
        let rest = self.buf.len() - self.pos;
        if len > rest as u64 {
            return Err(TypedError::Truncated);
        }
        let out = &self.buf[self.pos..self.pos + len as usize];
        self.pos += len as usize;
        Ok(out)
    }

    fn f64(&mut self) -> Result<f64, TypedError> {
        let raw = self
            .buf
            .get(self.pos..self.pos + 8)
            .ok_or(TypedError::Truncated)?;
        self.pos += 8;
        Ok(f64::from_le_bytes(raw.try_into().expect("8 bytes")))
    }

    /// A count, bounded by what the remaining bytes can hold at `min_item` bytes an item.
    fn count(&mut self, min_item: usize) -> Result<usize, TypedError> {
        let n = self.varint()?;
        let room = (self.buf.len() - self.pos) / min_item.max(1);
        if n > room as u64 {
            return Err(TypedError::Truncated);
        }
        Ok(n as usize)
    }

    fn end(&self) -> Result<(), TypedError> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(TypedError::Trailing)
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

fn put_varint(out: &mut Vec<u8>, v: u64) {
    let at = out.len();
    out.resize(at + varint::len(v), 0);
    varint::put(out, at, v);
}

/// The payload of a stored collection of `kind`, after its header.
fn payload(stored: &[u8], kind: Kind) -> Result<Reader<'_>, TypedError> {
    if kind_of(stored)? != kind || is_large(stored) {
        return Err(TypedError::WrongKind);
    }
    Ok(Reader {
        buf: stored,
        pos: TAG_BYTES,
    })
}

fn header(kind: Kind, count: usize, capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(capacity + TAG_BYTES + 10);
    out.extend_from_slice(&[TAG, kind as u8]);
    put_varint(&mut out, count as u64);
    out
}

/// A hash: fields and values in insertion order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hash {
    pub fields: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Hash {
    pub fn decode(stored: &[u8]) -> Result<Hash, TypedError> {
        let mut r = payload(stored, Kind::Hash)?;
        let n = r.count(2)?;
        let mut fields = Vec::with_capacity(n);
        for _ in 0..n {
            let f = r.bytes()?.to_vec();
            let v = r.bytes()?.to_vec();
            fields.push((f, v));
        }
        r.end()?;
        Ok(Hash { fields })
    }

    pub fn encode(&self) -> Vec<u8> {
        let size: usize = self.fields.iter().map(|(f, v)| f.len() + v.len() + 4).sum();
        let mut out = header(Kind::Hash, self.fields.len(), size);
        for (f, v) in &self.fields {
            put_bytes(&mut out, f);
            put_bytes(&mut out, v);
        }
        out
    }

    pub fn position(&self, field: &[u8]) -> Option<usize> {
        self.fields.iter().position(|(f, _)| f == field)
    }

    pub fn get(&self, field: &[u8]) -> Option<&[u8]> {
        self.position(field).map(|i| self.fields[i].1.as_slice())
    }

    /// Sets a field; true if it is new.
    pub fn set(&mut self, field: &[u8], value: &[u8]) -> bool {
        match self.position(field) {
            Some(i) => {
                self.fields[i].1 = value.to_vec();
                false
            }
            None => {
                self.fields.push((field.to_vec(), value.to_vec()));
                true
            }
        }
    }

    /// Removes a field; true if it was there.
    pub fn remove(&mut self, field: &[u8]) -> bool {
        match self.position(field) {
            Some(i) => {
                self.fields.remove(i);
                true
            }
            None => false,
        }
    }
}

/// A list, head first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct List {
    pub items: VecDeque<Vec<u8>>,
}

impl List {
    /// Removes and returns up to `n` elements from the head (`left`) or the tail, in the order
    /// they come off.
    pub fn pop(&mut self, left: bool, n: usize) -> Vec<Vec<u8>> {
        let n = n.min(self.items.len());
        if left {
            self.items.drain(..n).collect()
        } else {
            let at = self.items.len() - n;
            self.items.drain(at..).rev().collect()
        }
    }

    pub fn decode(stored: &[u8]) -> Result<List, TypedError> {
        let mut r = payload(stored, Kind::List)?;
        let n = r.count(1)?;
        let mut items = VecDeque::with_capacity(n);
        for _ in 0..n {
            items.push_back(r.bytes()?.to_vec());
        }
        r.end()?;
        Ok(List { items })
    }

    pub fn encode(&self) -> Vec<u8> {
        let size: usize = self.items.iter().map(|e| e.len() + 2).sum();
        let mut out = header(Kind::List, self.items.len(), size);
        for e in &self.items {
            put_bytes(&mut out, e);
        }
        out
    }
}

/// A compact list as stored, read without copying its elements: a push or a pop edits its
/// bytes ([`RawList::pushed`], [`RawList::popped`]) rather than decoding every element.
#[derive(Debug, Clone, Copy)]
pub struct RawList<'a> {
    /// Its elements.
    pub count: usize,
    /// The elements, each a varint length and its bytes, head first.
    pub items: &'a [u8],
}

impl<'a> RawList<'a> {
    /// Parses a stored compact list, checking every element's length (as [`List::decode`] does).
    pub fn decode(stored: &'a [u8]) -> Result<RawList<'a>, TypedError> {
        let mut r = payload(stored, Kind::List)?;
        let count = r.count(1)?;
        let start = r.pos;
        for _ in 0..count {
            r.bytes()?;
        }
        r.end()?;
        Ok(RawList {
            count,
            items: &stored[start..],
        })
    }

    /// The stored bytes of this list with `items` pushed at one end, each in turn (LPUSH's
    /// and RPUSH's order).
    pub fn pushed(&self, left: bool, items: &[&[u8]]) -> Vec<u8> {
        let added: usize = items
            .iter()
            .map(|i| i.len() + varint::len(i.len() as u64))
            .sum();
        let mut out = header(
            Kind::List,
            self.count + items.len(),
            self.items.len() + added,
        );
        if left {
            for i in items.iter().rev() {
                put_bytes(&mut out, i);
            }
            out.extend_from_slice(self.items);
        } else {
            out.extend_from_slice(self.items);
            for i in items {
                put_bytes(&mut out, i);
            }
        }
        out
    }

    /// Up to `n` elements popped from one end, nearest first, and the stored bytes of what is
    /// left (None when nothing is).
    pub fn popped(&self, left: bool, n: usize) -> (Vec<Vec<u8>>, Option<Vec<u8>>) {
        let n = n.min(self.count);
        let mut r = Reader {
            buf: self.items,
            pos: 0,
        };
        // Where each element starts (checked at decode).
        let mut starts = Vec::with_capacity(if left { n + 1 } else { self.count + 1 });
        let wanted = if left { n } else { self.count };
        while starts.len() < wanted {
            starts.push(r.pos);
            if r.bytes().is_err() {
                break;
            }
        }
        starts.push(if left { r.pos } else { self.items.len() });
        let element = |at: usize| {
            let mut r = Reader {
                buf: self.items,
                pos: at,
            };
            r.bytes().map(<[u8]>::to_vec).unwrap_or_default()
        };
        let (out, rest): (Vec<Vec<u8>>, &[u8]) = if left {
            let cut = starts[n];
            (
                starts[..n].iter().map(|&a| element(a)).collect(),
                &self.items[cut..],
            )
        } else {
            let first = starts.len() - 1 - n;
            (
                starts[first..starts.len() - 1]
                    .iter()
                    .rev()
                    .map(|&a| element(a))
                    .collect(),
                &self.items[..starts[first]],
            )
        };
        let left_count = self.count - n;
        if left_count == 0 {
            return (out, None);
        }
        let mut stored = header(Kind::List, left_count, rest.len());
        stored.extend_from_slice(rest);
        (out, Some(stored))
    }
}

/// A set, in insertion order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Set {
    pub members: Vec<Vec<u8>>,
    /// The set has held a member that is not an integer while compact, so Redis would keep it
    /// in its listpack encoding even when only integers are left (its intset encoding is never
    /// taken back). Written as the kind byte [`SET_LISTPACK`].
    pub listpack: bool,
}

/// The kind byte of a compact set that has held a member that is not an integer: 0x03 with this
/// flag (0x23).
pub const SET_LISTPACK: u8 = 0x20;

/// Whether a member is an integer as Redis's intset takes it: the canonical text of an i64.
pub fn is_integer_member(m: &[u8]) -> bool {
    if m.is_empty() || m.len() > 20 {
        return false;
    }
    let Ok(text) = std::str::from_utf8(m) else {
        return false;
    };
    text.parse::<i64>().is_ok_and(|v| v.to_string() == text)
}

impl Set {
    pub fn decode(stored: &[u8]) -> Result<Set, TypedError> {
        let mut r = payload(stored, Kind::Set)?;
        let n = r.count(1)?;
        let mut members = Vec::with_capacity(n);
        for _ in 0..n {
            members.push(r.bytes()?.to_vec());
        }
        r.end()?;
        Ok(Set {
            members,
            listpack: stored.get(1) == Some(&(Kind::Set as u8 | SET_LISTPACK)),
        })
    }

    /// The compact encoding; the kind byte carries [`Set::listpack`].
    pub fn encode(&self) -> Vec<u8> {
        let size: usize = self.members.iter().map(|e| e.len() + 2).sum();
        let mut out = header(Kind::Set, self.members.len(), size);
        if self.listpack {
            out[1] |= SET_LISTPACK;
        }
        for e in &self.members {
            put_bytes(&mut out, e);
        }
        out
    }

    pub fn contains(&self, member: &[u8]) -> bool {
        self.members.iter().any(|m| m == member)
    }

    /// Adds a member; true if it is new.
    pub fn add(&mut self, member: &[u8]) -> bool {
        if self.contains(member) {
            return false;
        }
        self.listpack |= !is_integer_member(member);
        self.members.push(member.to_vec());
        true
    }

    /// Removes a member; true if it was there.
    pub fn remove(&mut self, member: &[u8]) -> bool {
        match self.members.iter().position(|m| m == member) {
            Some(i) => {
                self.members.swap_remove(i);
                true
            }
            None => false,
        }
    }
}

/// A sorted set: (score, member) ordered by score, then member.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ZSet {
    pub entries: Vec<(f64, Vec<u8>)>,
}

/// Redis's order of sorted-set entries.
pub fn zset_order(a: &(f64, Vec<u8>), b: &(f64, Vec<u8>)) -> std::cmp::Ordering {
    a.0.partial_cmp(&b.0)
        .unwrap_or(std::cmp::Ordering::Equal)
        .then_with(|| a.1.cmp(&b.1))
}

impl ZSet {
    pub fn decode(stored: &[u8]) -> Result<ZSet, TypedError> {
        let mut r = payload(stored, Kind::ZSet)?;
        let n = r.count(9)?;
        let mut entries: Vec<(f64, Vec<u8>)> = Vec::with_capacity(n);
        for _ in 0..n {
            let score = r.f64()?;
            if score.is_nan() {
                return Err(TypedError::BadOrder);
            }
            let member = r.bytes()?.to_vec();
            let entry = (score, member);
            if let Some(last) = entries.last() {
                if zset_order(last, &entry) != std::cmp::Ordering::Less {
                    return Err(TypedError::BadOrder);
                }
            }
            entries.push(entry);
        }
        r.end()?;
        Ok(ZSet { entries })
    }

    pub fn encode(&self) -> Vec<u8> {
        let size: usize = self.entries.iter().map(|(_, m)| m.len() + 10).sum();
        let mut out = header(Kind::ZSet, self.entries.len(), size);
        for (score, member) in &self.entries {
            out.extend_from_slice(&score.to_le_bytes());
            put_bytes(&mut out, member);
        }
        out
    }

    pub fn position(&self, member: &[u8]) -> Option<usize> {
        self.entries.iter().position(|(_, m)| m == member)
    }

    pub fn score(&self, member: &[u8]) -> Option<f64> {
        self.position(member).map(|i| self.entries[i].0)
    }

    /// Sets a member's score (inserting it in order); true if it is new.
    pub fn insert(&mut self, score: f64, member: &[u8]) -> bool {
        let new = match self.position(member) {
            Some(i) => {
                self.entries.remove(i);
                false
            }
            None => true,
        };
        let entry = (score, member.to_vec());
        let at = self
            .entries
            .binary_search_by(|e| zset_order(e, &entry))
            .unwrap_or_else(|i| i);
        self.entries.insert(at, entry);
        new
    }

    /// Removes a member; true if it was there.
    pub fn remove(&mut self, member: &[u8]) -> bool {
        match self.position(member) {
            Some(i) => {
                self.entries.remove(i);
                true
            }
            None => false,
        }
    }
}

/// A stream entry's id: milliseconds and sequence.
pub type StreamId = (u64, u64);
/// A stream entry's fields and values, in order.
pub type Fields = Vec<(Vec<u8>, Vec<u8>)>;
/// A stream entry.
pub type StreamEntry = (StreamId, Fields);

/// A stream: entries in id order, the last id it generated (which deletes do not lower), how
/// many entries were ever added, the greatest id XDEL removed, and its consumer groups.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stream {
    pub last: StreamId,
    pub entries: Vec<StreamEntry>,
    /// Entries ever added (XADD counts each; deletes and trims do not lower it).
    pub entries_added: u64,
    /// The greatest id an XDEL removed ((0, 0): none).
    pub max_deleted: StreamId,
    /// Consumer groups by name.
    pub groups: BTreeMap<Vec<u8>, Group>,
}

/// A stream's consumer group (Redis's `streamCG`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Group {
    /// The last id delivered to any of its consumers.
    pub last_delivered: StreamId,
    /// Entries the group has read, when known (Redis's `entries_read`; None: -1).
    pub entries_read: Option<u64>,
    /// Consumers by name.
    pub consumers: BTreeMap<Vec<u8>, Consumer>,
    /// Entries delivered and not yet acknowledged, by id.
    pub pending: BTreeMap<StreamId, Pending>,
}

/// A consumer of a group.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Consumer {
    /// When it last tried to read or claim (ms since the epoch).
    pub seen_ms: u64,
    /// When it last read or claimed something (ms since the epoch); None: never.
    pub active_ms: Option<u64>,
}

/// An entry delivered and not yet acknowledged.
#[derive(Debug, Clone, PartialEq)]
pub struct Pending {
    /// The consumer it was delivered to (always one of the group's consumers).
    pub consumer: Vec<u8>,
    /// When it was last delivered (ms since the epoch).
    pub delivered_ms: u64,
    /// How many times it was delivered.
    pub deliveries: u64,
}

impl Stream {
    /// The id of its first entry ((0, 0) when it has none).
    pub fn first_id(&self) -> StreamId {
        self.entries.first().map_or((0, 0), |e| e.0)
    }

    /// Whether XDEL removed an entry at or after `start` that lies within the stream (Redis's
    /// `streamRangeHasTombstones` to the end).
    pub fn has_tombstones_from(&self, start: StreamId) -> bool {
        !self.entries.is_empty()
            && self.max_deleted != (0, 0)
            && self.first_id() <= self.max_deleted
            && start <= self.max_deleted
    }

    /// How many entries the stream had added up to `id`, when that can be known (Redis's
    /// `streamEstimateDistanceFromFirstEverEntry`).
    pub fn entries_up_to(&self, id: StreamId) -> Option<u64> {
        if self.entries_added == 0 {
            return Some(0);
        }
        if self.entries.is_empty() && id <= self.last {
            return Some(self.entries_added);
        }
        match id.cmp(&self.last) {
            std::cmp::Ordering::Equal => return Some(self.entries_added),
            std::cmp::Ordering::Greater => return None,
            std::cmp::Ordering::Less => {}
        }
        let first = self.first_id();
        if self.max_deleted == (0, 0) || self.max_deleted < first {
            let before = self.entries_added - self.entries.len() as u64;
            if id < first {
                return Some(before);
            }
            if id == first {
                return Some(before + 1);
            }
        }
        None
    }

    /// The entry with id `id`, if the stream holds it.
    pub fn entry(&self, id: StreamId) -> Option<&StreamEntry> {
        self.entries
            .binary_search_by(|e| e.0.cmp(&id))
            .ok()
            .map(|i| &self.entries[i])
    }

    pub fn decode(stored: &[u8]) -> Result<Stream, TypedError> {
        let mut r = payload(stored, Kind::Stream)?;
        let last = (r.varint()?, r.varint()?);
        let n = r.count(3)?;
        let mut entries: Vec<StreamEntry> = Vec::with_capacity(n);
        for _ in 0..n {
            let id = (r.varint()?, r.varint()?);
            if id > last || entries.last().is_some_and(|(prev, _)| *prev >= id) {
                return Err(TypedError::BadOrder);
            }
            let fields = r.count(2)?;
            let mut fv = Vec::with_capacity(fields);
            for _ in 0..fields {
                let f = r.bytes()?.to_vec();
                let v = r.bytes()?.to_vec();
                fv.push((f, v));
            }
            entries.push((id, fv));
        }
        let mut s = Stream {
            last,
            entries_added: n as u64,
            entries,
            ..Default::default()
        };
        if r.pos == r.buf.len() {
            // Written before streams had consumer groups: no groups, and the entries it holds
            // are all it is known to have added.
            return Ok(s);
        }
        s.entries_added = r.varint()?;
        s.max_deleted = (r.varint()?, r.varint()?);
        if s.entries_added < n as u64 || s.max_deleted > last {
            return Err(TypedError::BadOrder);
        }
        let groups = r.count(4)?;
        for _ in 0..groups {
            let name = r.bytes()?.to_vec();
            let mut g = Group {
                last_delivered: (r.varint()?, r.varint()?),
                entries_read: r.varint()?.checked_sub(1),
                ..Default::default()
            };
            let consumers = r.count(3)?;
            let mut names = Vec::with_capacity(consumers);
            for _ in 0..consumers {
                let cname = r.bytes()?.to_vec();
                let c = Consumer {
                    seen_ms: r.varint()?,
                    active_ms: r.varint()?.checked_sub(1),
                };
                if names.last().is_some_and(|prev: &Vec<u8>| *prev >= cname) {
                    return Err(TypedError::BadOrder);
                }
                names.push(cname.clone());
                g.consumers.insert(cname, c);
            }
            let pending = r.count(5)?;
            let mut prev: Option<StreamId> = None;
            for _ in 0..pending {
                let id = (r.varint()?, r.varint()?);
                let who = r.varint()?;
                let consumer = names
                    .get(usize::try_from(who).unwrap_or(usize::MAX))
                    .ok_or(TypedError::BadOrder)?
                    .clone();
                if prev.is_some_and(|p| p >= id) {
                    return Err(TypedError::BadOrder);
                }
                prev = Some(id);
                g.pending.insert(
                    id,
                    Pending {
                        consumer,
                        delivered_ms: r.varint()?,
                        deliveries: r.varint()?,
                    },
                );
            }
            if s.groups.last_key_value().is_some_and(|(k, _)| *k >= name) {
                return Err(TypedError::BadOrder);
            }
            s.groups.insert(name, g);
        }
        r.end()?;
        Ok(s)
    }

    pub fn encode(&self) -> Vec<u8> {
        let size: usize = self
            .entries
            .iter()
            .map(|(_, fv)| 24 + fv.iter().map(|(f, v)| f.len() + v.len() + 4).sum::<usize>())
            .sum();
        let mut out = Vec::with_capacity(size + 48);
        out.extend_from_slice(&[TAG, Kind::Stream as u8]);
        put_varint(&mut out, self.last.0);
        put_varint(&mut out, self.last.1);
        put_varint(&mut out, self.entries.len() as u64);
        for ((ms, seq), fv) in &self.entries {
            put_varint(&mut out, *ms);
            put_varint(&mut out, *seq);
            put_varint(&mut out, fv.len() as u64);
            for (f, v) in fv {
                put_bytes(&mut out, f);
                put_bytes(&mut out, v);
            }
        }
        put_varint(&mut out, self.entries_added);
        put_varint(&mut out, self.max_deleted.0);
        put_varint(&mut out, self.max_deleted.1);
        put_varint(&mut out, self.groups.len() as u64);
        for (name, g) in &self.groups {
            put_bytes(&mut out, name);
            put_varint(&mut out, g.last_delivered.0);
            put_varint(&mut out, g.last_delivered.1);
            put_varint(&mut out, g.entries_read.map_or(0, |n| n + 1));
            put_varint(&mut out, g.consumers.len() as u64);
            for (cname, c) in &g.consumers {
                put_bytes(&mut out, cname);
                put_varint(&mut out, c.seen_ms);
                put_varint(&mut out, c.active_ms.map_or(0, |t| t + 1));
            }
            put_varint(&mut out, g.pending.len() as u64);
            let names: Vec<&Vec<u8>> = g.consumers.keys().collect();
            for (id, p) in &g.pending {
                // The consumer by its place among the group's (every pending entry has one).
                let who = names.binary_search(&&p.consumer).ok();
                put_varint(&mut out, id.0);
                put_varint(&mut out, id.1);
                put_varint(&mut out, who.unwrap_or(0) as u64);
                put_varint(&mut out, p.delivered_ms);
                put_varint(&mut out, p.deliveries);
            }
        }
        out
    }
}

/// The flag on a collection's kind byte that marks the header of its large form.
pub const LARGE: u8 = 0x10;

/// The header of a large list, at the user's key; its items live in chunk objects at internal
/// keys ([`chunk_key`]), linked head to tail (docs/formats.md, "Large collections"):
///
/// ```text
/// 0xFF 0x12 gen(8, little-endian) len head tail next_id chunks bytes   (varints after gen)
/// ```
///
/// `gen` is drawn at random when the large form is made, so that the chunks of an earlier
/// collection at the same key are never taken for this one's. Chunk ids start at 1; 0 is none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LargeList {
    pub gen: u64,
    /// Items.
    pub len: u64,
    /// The first and last chunk's ids.
    pub head: u64,
    pub tail: u64,
    /// The id the next new chunk takes.
    pub next_id: u64,
    /// Chunks.
    pub chunks: u64,
    /// The items' bytes.
    pub bytes: u64,
}

impl LargeList {
    pub fn decode(stored: &[u8]) -> Result<LargeList, TypedError> {
        match stored {
            [TAG, k, ..] if *k == Kind::List as u8 | LARGE => {}
            [TAG, k, ..] => return Err(TypedError::UnknownKind(*k)),
            _ => return Err(TypedError::WrongKind),
        }
        let gen = stored
            .get(TAG_BYTES..TAG_BYTES + 8)
            .ok_or(TypedError::Truncated)?;
        let mut r = Reader {
            buf: stored,
            pos: TAG_BYTES + 8,
        };
        let h = LargeList {
            gen: u64::from_le_bytes(gen.try_into().expect("8 bytes")),
            len: r.varint()?,
            head: r.varint()?,
            tail: r.varint()?,
            next_id: r.varint()?,
            chunks: r.varint()?,
            bytes: r.varint()?,
        };
        r.end()?;
        Ok(h)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(&[TAG, Kind::List as u8 | LARGE]);
        out.extend_from_slice(&self.gen.to_le_bytes());
        for v in [
            self.len,
            self.head,
            self.tail,
            self.next_id,
            self.chunks,
            self.bytes,
        ] {
            put_varint(&mut out, v);
        }
        out
    }
}

/// One chunk of a large list: its neighbours' ids (0 at an end) and its items, head first.
///
/// ```text
/// prev next count items...   (varints; each item a varint length and its bytes)
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListChunk {
    pub prev: u64,
    pub next: u64,
    pub items: VecDeque<Vec<u8>>,
}

impl ListChunk {
    pub fn decode(stored: &[u8]) -> Result<ListChunk, TypedError> {
        let mut r = Reader {
            buf: stored,
            pos: 0,
        };
        let prev = r.varint()?;
        let next = r.varint()?;
        let n = r.count(1)?;
        let mut items = VecDeque::with_capacity(n);
        for _ in 0..n {
            items.push_back(r.bytes()?.to_vec());
        }
        r.end()?;
        Ok(ListChunk { prev, next, items })
    }

    pub fn encode(&self) -> Vec<u8> {
        let size: usize = self.items.iter().map(|i| i.len() + 3).sum();
        let mut out = Vec::with_capacity(size + 24);
        put_varint(&mut out, self.prev);
        put_varint(&mut out, self.next);
        put_varint(&mut out, self.items.len() as u64);
        for i in &self.items {
            put_bytes(&mut out, i);
        }
        out
    }

    /// The items' bytes (what the header's `bytes` counts).
    pub fn item_bytes(&self) -> u64 {
        self.items.iter().map(|i| i.len() as u64).sum()
    }
}

/// A list chunk kept encoded: its links and count parsed, its elements as their encoded bytes,
/// so that a push or a pop at an end copies bytes instead of decoding every element.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawChunk {
    pub prev: u64,
    pub next: u64,
    pub count: u64,
    /// The elements, each a varint length and its bytes, head first.
    pub items: Vec<u8>,
}

impl RawChunk {
    /// Parses a stored chunk, checking every element's length (as [`ListChunk::decode`] does,
    /// without copying the elements one by one).
    pub fn decode(stored: &[u8]) -> Result<RawChunk, TypedError> {
        let mut r = Reader {
            buf: stored,
            pos: 0,
        };
        let prev = r.varint()?;
        let next = r.varint()?;
        let count = r.count(1)?;
        let start = r.pos;
        for _ in 0..count {
            r.bytes()?;
        }
        r.end()?;
        Ok(RawChunk {
            prev,
            next,
            count: count as u64,
            items: stored[start..].to_vec(),
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.items.len() + 30);
        put_varint(&mut out, self.prev);
        put_varint(&mut out, self.next);
        put_varint(&mut out, self.count);
        out.extend_from_slice(&self.items);
        out
    }

    /// The encoded size ([`RawChunk::encode`]'s length).
    pub fn encoded_len(&self) -> usize {
        varint::len(self.prev) + varint::len(self.next) + varint::len(self.count) + self.items.len()
    }

    pub fn push_front(&mut self, item: &[u8]) {
        let mut enc = Vec::with_capacity(item.len() + 10);
        put_bytes(&mut enc, item);
        self.items.splice(0..0, enc);
        self.count += 1;
    }

    pub fn push_back(&mut self, item: &[u8]) {
        put_bytes(&mut self.items, item);
        self.count += 1;
    }

    /// The start of each element in `items` (they were checked at decode).
    fn offsets(&self) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.count as usize);
        let mut r = Reader {
            buf: &self.items,
            pos: 0,
        };
        while r.pos < self.items.len() {
            out.push(r.pos);
            if r.bytes().is_err() {
                break;
            }
        }
        out
    }

    /// Removes up to `n` elements from the head, returned head first.
    pub fn pop_front(&mut self, n: usize) -> Vec<Vec<u8>> {
        let mut out = Vec::with_capacity(n.min(self.count as usize));
        let mut r = Reader {
            buf: &self.items,
            pos: 0,
        };
        while out.len() < n && r.pos < self.items.len() {
            match r.bytes() {
                Ok(b) => out.push(b.to_vec()),
                Err(_) => break,
            }
        }
        let end = r.pos;
        self.items.drain(..end);
        self.count -= out.len() as u64;
        out
    }

    /// Removes up to `n` elements from the tail, returned tail first.
    pub fn pop_back(&mut self, n: usize) -> Vec<Vec<u8>> {
        let offsets = self.offsets();
        let keep = offsets.len().saturating_sub(n);
        let cut = offsets.get(keep).copied().unwrap_or(self.items.len());
        let mut out = Vec::with_capacity(offsets.len() - keep);
        for &at in offsets[keep..].iter().rev() {
            let mut r = Reader {
                buf: &self.items,
                pos: at,
            };
            if let Ok(b) = r.bytes() {
                out.push(b.to_vec());
            }
        }
        self.items.truncate(cut);
        self.count -= out.len() as u64;
        out
    }

    /// The element at the head (or tail), if any.
    pub fn end(&self, front: bool) -> Option<&[u8]> {
        let at = if front {
            (!self.items.is_empty()).then_some(0)?
        } else {
            *self.offsets().last()?
        };
        let mut r = Reader {
            buf: &self.items,
            pos: at,
        };
        r.bytes().ok()
    }
}

/// The header of a large hash or set, at the user's key; its members live in buckets at
/// internal keys ([`chunk_key`], bucket `b` at id `b + 1`), addressed by linear hashing
/// (docs/formats.md, "Large collections"):
///
/// ```text
/// 0xFF 0x11|0x13 gen(8, little-endian) len bytes level split   (varints after gen)
/// ```
///
/// There are `2^level + split` buckets. A member whose hash ([`member_hash`]) is `h` lives in
/// bucket `h mod 2^level`, or `h mod 2^(level+1)` when that is below `split` (those buckets
/// have split already). `gen` is random per large form and also seeds the member hash, so a
/// client cannot choose members that crowd one bucket without knowing it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LargeTable {
    /// [`Kind::Hash`] or [`Kind::Set`].
    pub kind: Kind,
    pub gen: u64,
    /// Members.
    pub len: u64,
    /// The buckets' encoded member (and value) bytes, all buckets together.
    pub bytes: u64,
    pub level: u32,
    pub split: u64,
}

/// The most levels a large table has (2^40 buckets).
const TABLE_LEVEL_MAX: u64 = 40;

impl LargeTable {
    pub fn new(kind: Kind, gen: u64) -> LargeTable {
        LargeTable {
            kind,
            gen,
            len: 0,
            bytes: 0,
            level: 0,
            split: 0,
        }
    }

    pub fn decode(stored: &[u8]) -> Result<LargeTable, TypedError> {
        let kind = match stored {
            [TAG, k, ..] if *k == Kind::Hash as u8 | LARGE => Kind::Hash,
            [TAG, k, ..] if *k == Kind::Set as u8 | LARGE => Kind::Set,
            [TAG, k, ..] => return Err(TypedError::UnknownKind(*k)),
            _ => return Err(TypedError::WrongKind),
        };
        let gen = stored
            .get(TAG_BYTES..TAG_BYTES + 8)
            .ok_or(TypedError::Truncated)?;
        let mut r = Reader {
            buf: stored,
            pos: TAG_BYTES + 8,
        };
        let len = r.varint()?;
        let bytes = r.varint()?;
        let level = r.varint()?;
        let split = r.varint()?;
        r.end()?;
        if level > TABLE_LEVEL_MAX || split >= 1u64 << level {
            return Err(TypedError::BadOrder);
        }
        Ok(LargeTable {
            kind,
            gen: u64::from_le_bytes(gen.try_into().expect("8 bytes")),
            len,
            bytes,
            level: level as u32,
            split,
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(TAG_BYTES + 8 + 30);
        out.extend_from_slice(&[TAG, self.kind as u8 | LARGE]);
        out.extend_from_slice(&self.gen.to_le_bytes());
        for v in [self.len, self.bytes, u64::from(self.level), self.split] {
            put_varint(&mut out, v);
        }
        out
    }

    /// The number of buckets.
    pub fn buckets(&self) -> u64 {
        (1u64 << self.level) + self.split
    }

    /// The bucket of a member whose [`member_hash`] is `hash`.
    pub fn bucket_of(&self, hash: u64) -> u64 {
        let low = hash & ((1u64 << self.level) - 1);
        if low < self.split {
            hash & ((1u64 << (self.level + 1)) - 1)
        } else {
            low
        }
    }

    /// The hash bits that address bucket `b` (it holds the members whose hash ends in `b`'s
    /// low bits).
    pub fn bucket_bits(&self, b: u64) -> u32 {
        if b < self.split || b >= 1u64 << self.level {
            self.level + 1
        } else {
            self.level
        }
    }

    /// Splits the next bucket: returns (the bucket split, the new bucket). Members of the first
    /// whose hash has bit `level` set move to the second.
    pub fn grow(&mut self) -> Option<(u64, u64)> {
        if u64::from(self.level) >= TABLE_LEVEL_MAX {
            return None;
        }
        let from = self.split;
        let to = (1u64 << self.level) + self.split;
        self.split += 1;
        if self.split == 1u64 << self.level {
            self.level += 1;
            self.split = 0;
        }
        Some((from, to))
    }

    /// Undoes the last split: returns (the bucket that takes the members, the last bucket,
    /// which goes). None with one bucket.
    pub fn shrink(&mut self) -> Option<(u64, u64)> {
        if self.split == 0 {
            if self.level == 0 {
                return None;
            }
            self.level -= 1;
            self.split = 1u64 << self.level;
        }
        self.split -= 1;
        Some((self.split, (1u64 << self.level) + self.split))
    }
}

/// The hash of a member of a large hash or set of generation `gen`.
#[inline]
pub fn member_hash(gen: u64, member: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(member, gen)
}

/// The position of a member in the order HSCAN and SSCAN walk a large table: its hash with the
/// bits reversed, so that every bucket is one interval of positions whatever the table's size
/// (a split halves an interval, a merge joins two), and a cursor that is a position neither
/// repeats nor misses a member present throughout the scan.
#[inline]
pub fn scan_position(hash: u64) -> u64 {
    hash.reverse_bits()
}

/// One bucket of a large hash or set, kept encoded. Its bytes are exactly a compact hash's or
/// set's ([`Hash::encode`], [`Set::encode`]), so a bucket is checked as one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawBucket {
    pub kind: Kind,
    pub count: u64,
    /// The members (each a varint length and bytes, followed for a hash by its value the same
    /// way).
    pub items: Vec<u8>,
}

impl RawBucket {
    pub fn empty(kind: Kind) -> RawBucket {
        RawBucket {
            kind,
            count: 0,
            items: Vec::new(),
        }
    }

    /// Parses a stored bucket of `kind`, checking every length.
    pub fn decode(stored: &[u8], kind: Kind) -> Result<RawBucket, TypedError> {
        let mut r = payload(stored, kind)?;
        let per = if kind == Kind::Hash { 2 } else { 1 };
        let count = r.count(per)?;
        let start = r.pos;
        for _ in 0..count * per {
            r.bytes()?;
        }
        r.end()?;
        Ok(RawBucket {
            kind,
            count: count as u64,
            items: stored[start..].to_vec(),
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = header(self.kind, self.count as usize, self.items.len());
        out.extend_from_slice(&self.items);
        out
    }

    /// The encoded size ([`RawBucket::encode`]'s length).
    pub fn encoded_len(&self) -> usize {
        TAG_BYTES + varint::len(self.count) + self.items.len()
    }

    fn pairs(&self) -> bool {
        self.kind == Kind::Hash
    }

    /// Every member and its value (empty for a set), with each entry's byte range.
    pub fn entries(&self) -> BucketEntries<'_> {
        BucketEntries {
            r: Reader {
                buf: &self.items,
                pos: 0,
            },
            pairs: self.pairs(),
        }
    }

    /// The member's value (empty for a set) and its entry's range; None if it is not here.
    pub fn find(&self, member: &[u8]) -> Option<(&[u8], std::ops::Range<usize>)> {
        self.entries()
            .find(|(m, _, _)| *m == member)
            .map(|(_, v, range)| (v, range))
    }

    pub fn get(&self, member: &[u8]) -> Option<&[u8]> {
        self.find(member).map(|(v, _)| v)
    }

    /// Sets a member (and its value, for a hash): the encoded bytes of its entry before and
    /// after; the first is 0 when the member is new.
    pub fn set(&mut self, member: &[u8], value: &[u8]) -> (usize, usize) {
        let mut entry = Vec::with_capacity(member.len() + value.len() + 10);
        put_bytes(&mut entry, member);
        if self.pairs() {
            put_bytes(&mut entry, value);
        }
        let added = entry.len();
        match self.find(member).map(|(_, r)| r) {
            Some(range) => {
                let before = range.len();
                self.items.splice(range, entry);
                (before, added)
            }
            None => {
                self.items.extend_from_slice(&entry);
                self.count += 1;
                (0, added)
            }
        }
    }

    /// Removes a member: the encoded bytes its entry took, or None if it was not here.
    pub fn remove(&mut self, member: &[u8]) -> Option<usize> {
        let range = self.find(member)?.1;
        let len = range.len();
        self.items.drain(range);
        self.count -= 1;
        Some(len)
    }

    /// Appends an entry's encoded bytes (taken from another bucket's [`RawBucket::entries`]).
    pub fn push_encoded(&mut self, entry: &[u8]) {
        self.items.extend_from_slice(entry);
        self.count += 1;
    }
}

/// The entries of a [`RawBucket`]: (member, value, the entry's byte range).
pub struct BucketEntries<'a> {
    r: Reader<'a>,
    pairs: bool,
}

impl<'a> Iterator for BucketEntries<'a> {
    type Item = (&'a [u8], &'a [u8], std::ops::Range<usize>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.r.pos >= self.r.buf.len() {
            return None;
        }
        let start = self.r.pos;
        let member = self.r.bytes().ok()?;
        let value = if self.pairs {
            self.r.bytes().ok()?
        } else {
            &[]
        };
        Some((member, value, start..self.r.pos))
    }
}

/// The header of a large sorted set: a member table (buckets as a large hash's, each member's
/// value its score as 8 little-endian bytes) and a B+-tree of score-ordered nodes (docs/formats.md,
/// "Large collections"). `table.kind` is [`Kind::Hash`] (the buckets' encoding) and `table.gen`
/// is `gen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LargeZSet {
    pub gen: u64,
    pub table: LargeTable,
    /// The root node's number.
    pub root: u64,
    /// Inner levels above the leaves (0: the root is a leaf).
    pub height: u32,
    /// The number the next new node takes (node numbers are never reused within a generation).
    pub next_node: u64,
}

/// The most inner levels of a large sorted set's tree.
const ZTREE_HEIGHT_MAX: u64 = 32;

impl LargeZSet {
    pub fn new(gen: u64) -> LargeZSet {
        LargeZSet {
            gen,
            table: LargeTable::new(Kind::Hash, gen),
            root: 0,
            height: 0,
            next_node: 1,
        }
    }

    pub fn len(&self) -> u64 {
        self.table.len
    }

    pub fn is_empty(&self) -> bool {
        self.table.len == 0
    }

    pub fn decode(stored: &[u8]) -> Result<LargeZSet, TypedError> {
        match stored {
            [TAG, k, ..] if *k == Kind::ZSet as u8 | LARGE => {}
            [TAG, k, ..] => return Err(TypedError::UnknownKind(*k)),
            _ => return Err(TypedError::WrongKind),
        }
        let gen = stored
            .get(TAG_BYTES..TAG_BYTES + 8)
            .ok_or(TypedError::Truncated)?;
        let gen = u64::from_le_bytes(gen.try_into().expect("8 bytes"));
        let mut r = Reader {
            buf: stored,
            pos: TAG_BYTES + 8,
        };
        let mut v = [0u64; 7];
        for x in &mut v {
            *x = r.varint()?;
        }
        r.end()?;
        let [len, bytes, level, split, root, height, next_node] = v;
        if level > TABLE_LEVEL_MAX
            || split >= 1u64 << level
            || height > ZTREE_HEIGHT_MAX
            || root >= next_node
        {
            return Err(TypedError::BadOrder);
        }
        Ok(LargeZSet {
            gen,
            table: LargeTable {
                kind: Kind::Hash,
                gen,
                len,
                bytes,
                level: level as u32,
                split,
            },
            root,
            height: height as u32,
            next_node,
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(TAG_BYTES + 8 + 50);
        out.extend_from_slice(&[TAG, Kind::ZSet as u8 | LARGE]);
        out.extend_from_slice(&self.gen.to_le_bytes());
        let t = &self.table;
        for v in [
            t.len,
            t.bytes,
            u64::from(t.level),
            t.split,
            self.root,
            u64::from(self.height),
            self.next_node,
        ] {
            put_varint(&mut out, v);
        }
        out
    }
}

/// A sorted-set entry: score and member.
pub type ZEntry = (f64, Vec<u8>);

/// A child of an inner node of a large sorted set's tree: its node number, the entries below
/// it, and the first (least) entry below it.
#[derive(Debug, Clone, PartialEq)]
pub struct ZChild {
    pub node: u64,
    pub count: u64,
    pub first: ZEntry,
}

/// A node of a large sorted set's tree: a leaf of entries, or an inner node of children, each
/// in Redis's order (score, then member), strictly increasing.
#[derive(Debug, Clone, PartialEq)]
pub enum ZNode {
    Leaf(Vec<ZEntry>),
    Inner(Vec<ZChild>),
}

impl ZNode {
    pub fn decode(stored: &[u8]) -> Result<ZNode, TypedError> {
        let mut r = Reader {
            buf: stored,
            pos: 1,
        };
        let node = match stored.first() {
            Some(0) => {
                let n = r.count(9)?;
                let mut entries: Vec<ZEntry> = Vec::with_capacity(n);
                for _ in 0..n {
                    let e = (r.f64()?, r.bytes()?.to_vec());
                    check_next(entries.last(), &e)?;
                    entries.push(e);
                }
                ZNode::Leaf(entries)
            }
            Some(1) => {
                let n = r.count(11)?;
                let mut children: Vec<ZChild> = Vec::with_capacity(n);
                for _ in 0..n {
                    let node = r.varint()?;
                    let count = r.varint()?;
                    let first = (r.f64()?, r.bytes()?.to_vec());
                    check_next(children.last().map(|c| &c.first), &first)?;
                    if count == 0 {
                        return Err(TypedError::BadOrder);
                    }
                    children.push(ZChild { node, count, first });
                }
                ZNode::Inner(children)
            }
            Some(k) => return Err(TypedError::UnknownKind(*k)),
            None => return Err(TypedError::Truncated),
        };
        r.end()?;
        Ok(node)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        match self {
            ZNode::Leaf(entries) => {
                out.push(0);
                put_varint(&mut out, entries.len() as u64);
                for (s, m) in entries {
                    out.extend_from_slice(&s.to_le_bytes());
                    put_bytes(&mut out, m);
                }
            }
            ZNode::Inner(children) => {
                out.push(1);
                put_varint(&mut out, children.len() as u64);
                for c in children {
                    put_varint(&mut out, c.node);
                    put_varint(&mut out, c.count);
                    out.extend_from_slice(&c.first.0.to_le_bytes());
                    put_bytes(&mut out, &c.first.1);
                }
            }
        }
        out
    }

    /// The bytes [`ZNode::encode`] writes.
    pub fn encoded_len(&self) -> usize {
        let items = self.items();
        1 + varint::len(items as u64)
            + match self {
                ZNode::Leaf(entries) => entries.iter().map(zentry_len).sum::<usize>(),
                ZNode::Inner(children) => children
                    .iter()
                    .map(|c| varint::len(c.node) + varint::len(c.count) + zentry_len(&c.first))
                    .sum(),
            }
    }

    /// Entries (a leaf) or children (an inner node).
    pub fn items(&self) -> usize {
        match self {
            ZNode::Leaf(e) => e.len(),
            ZNode::Inner(c) => c.len(),
        }
    }

    /// The entries below this node.
    pub fn count(&self) -> u64 {
        match self {
            ZNode::Leaf(e) => e.len() as u64,
            ZNode::Inner(c) => c.iter().map(|c| c.count).sum(),
        }
    }

    /// The least entry below this node (None if it is empty).
    pub fn first(&self) -> Option<&ZEntry> {
        match self {
            ZNode::Leaf(e) => e.first(),
            ZNode::Inner(c) => c.first().map(|c| &c.first),
        }
    }
}

/// The bytes one entry takes in a leaf.
pub fn zentry_len(e: &ZEntry) -> usize {
    8 + varint::len(e.1.len() as u64) + e.1.len()
}

fn check_next(last: Option<&ZEntry>, next: &ZEntry) -> Result<(), TypedError> {
    if next.0.is_nan() {
        return Err(TypedError::BadOrder);
    }
    match last {
        Some(l) if zset_order(l, next) != std::cmp::Ordering::Less => Err(TypedError::BadOrder),
        _ => Ok(()),
    }
}

/// The kind of a large collection's header; None if `stored` is not one.
pub fn large_kind(stored: &[u8]) -> Option<Kind> {
    match stored {
        [TAG, k, ..] if k & LARGE != 0 => Kind::from_byte(k & !LARGE),
        _ => None,
    }
}

/// The generation of a large collection's header (every kind keeps it at the same place).
pub fn large_gen(stored: &[u8]) -> Option<u64> {
    large_kind(stored)?;
    let gen = stored.get(TAG_BYTES..TAG_BYTES + 8)?;
    Some(u64::from_le_bytes(gen.try_into().ok()?))
}

/// Bytes a chunk key adds to its collection's key.
pub const CHUNK_KEY_OVERHEAD: usize = 3 + 2 + 10 + 8 + 8;

/// The internal key of chunk `id` of generation `gen` of the collection at `key` (in `slot`):
/// `FF 'r' 00`, the slot (big-endian), the key's length (varint) and bytes, `gen` and `id`
/// (big-endian). `ramlog_common::key_slot` reads the slot back, so a chunk lives in its
/// collection's tablet.
pub fn chunk_key(slot: u16, key: &[u8], gen: u64, id: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + CHUNK_KEY_OVERHEAD);
    out.extend_from_slice(&ramlog_common::INTERNAL_PREFIX);
    out.extend_from_slice(&slot.to_be_bytes());
    put_bytes(&mut out, key);
    out.extend_from_slice(&gen.to_be_bytes());
    out.extend_from_slice(&id.to_be_bytes());
    out
}

/// A chunk key's parts: (slot, collection key, gen, id); None if `key` is not one.
pub fn parse_chunk_key(key: &[u8]) -> Option<(u16, &[u8], u64, u64)> {
    if !ramlog_common::is_internal(key) {
        return None;
    }
    let at = ramlog_common::INTERNAL_PREFIX.len();
    let slot = u16::from_be_bytes([key[at], key[at + 1]]);
    let mut r = Reader {
        buf: key,
        pos: at + 2,
    };
    let user = r.bytes().ok()?;
    let rest = key.get(r.pos..)?;
    if rest.len() != 16 {
        return None;
    }
    let gen = u64::from_be_bytes(rest[..8].try_into().ok()?);
    let id = u64::from_be_bytes(rest[8..].try_into().ok()?);
    Some((slot, user, gen, id))
}

/// Decodes any stored value fully (what the fuzz target drives): its kind and item count.
pub fn check(stored: &[u8]) -> Result<(Kind, usize), TypedError> {
    let kind = kind_of(stored)?;
    let count = match kind {
        Kind::String => {
            string_of(stored).ok_or(TypedError::WrongKind)?;
            1
        }
        Kind::List if is_large(stored) => {
            let h = LargeList::decode(stored)?;
            usize::try_from(h.len).map_err(|_| TypedError::Truncated)?
        }
        Kind::Hash | Kind::Set if is_large(stored) => {
            let h = LargeTable::decode(stored)?;
            usize::try_from(h.len).map_err(|_| TypedError::Truncated)?
        }
        Kind::ZSet if is_large(stored) => {
            let h = LargeZSet::decode(stored)?;
            usize::try_from(h.len()).map_err(|_| TypedError::Truncated)?
        }
        Kind::Hash => Hash::decode(stored)?.fields.len(),
        Kind::List => List::decode(stored)?.items.len(),
        Kind::Set => Set::decode(stored)?.members.len(),
        Kind::ZSet => ZSet::decode(stored)?.entries.len(),
        Kind::Stream => Stream::decode(stored)?.entries.len(),
    };
    Ok((kind, count))
}

#[cfg(test)]
mod tests {
    #[test]
    fn raw_list_pushes_and_pops_as_the_decoded_list_does() {
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        for _ in 0..300 {
            let n = (next() % 40) as usize;
            let mut list = List::default();
            for i in 0..n {
                let len = (next() % 200) as usize;
                list.items.push_back(vec![i as u8; len]);
            }
            let stored = list.encode();
            let raw = RawList::decode(&stored).unwrap();
            assert_eq!(raw.count, n);
            let left = next() % 2 == 0;
            let items: Vec<Vec<u8>> = (0..(next() % 5) as usize)
                .map(|k| vec![b'x'; k * 70])
                .collect();
            let refs: Vec<&[u8]> = items.iter().map(|i| i.as_slice()).collect();
            let mut want = list.clone();
            for i in &items {
                if left {
                    want.items.push_front(i.clone());
                } else {
                    want.items.push_back(i.clone());
                }
            }
            assert_eq!(List::decode(&raw.pushed(left, &refs)).unwrap(), want);
            let k = (next() % 45) as usize;
            let (popped, rest) = raw.popped(left, k);
            let mut want = list.clone();
            let want_popped = want.pop(left, k);
            assert_eq!(popped, want_popped);
            match rest {
                None => assert!(want.items.is_empty()),
                Some(r) => assert_eq!(List::decode(&r).unwrap(), want),
            }
        }
        assert!(RawList::decode(&[TAG, Kind::List as u8, 2, 1, b'a']).is_err());
    }

    use super::*;

    #[test]
    fn strings_are_stored_as_is_unless_they_begin_with_the_tag() {
        assert!(matches!(store_string(b"abc"), Cow::Borrowed(_)));
        assert!(matches!(store_string(b""), Cow::Borrowed(_)));
        let escaped = store_string(b"\xffx");
        assert_eq!(&*escaped, b"\xff\x00\xffx");
        assert_eq!(string_of(&escaped), Some(&b"\xffx"[..]));
        assert_eq!(string_of(b"plain"), Some(&b"plain"[..]));
        assert_eq!(string_of(b""), Some(&b""[..]));
        assert_eq!(kind_of(&escaped), Ok(Kind::String));
        assert_eq!(kind_of(b"\xff"), Err(TypedError::Truncated));
        assert_eq!(kind_of(b"\xff\x09"), Err(TypedError::UnknownKind(9)));
    }

    #[test]
    fn short_strings_changed_in_place_are_marked_raw() {
        let marked = store_string_in_place(b"12");
        assert_eq!(&*marked, b"\xff\x4012");
        assert!(is_raw_string(&marked) && !is_raw_string(b"12"));
        assert_eq!(string_of(&marked), Some(&b"12"[..]));
        assert_eq!(kind_of(&marked), Ok(Kind::String));
        assert_eq!(check(&marked), Ok((Kind::String, 1)));
        let tagged = store_string_in_place(b"\xff");
        assert_eq!(string_of(&tagged), Some(&b"\xff"[..]));
        // Past Redis's embstr size a string is raw whatever made it: stored as SET stores it.
        let long = vec![b'x'; EMBSTR_MAX_BYTES + 1];
        assert!(matches!(store_string_in_place(&long), Cow::Borrowed(_)));
        assert_eq!(
            &*store_string_in_place(&[0xFF; 45]),
            &store_string(&[0xFF; 45])[..]
        );
    }

    #[test]
    fn large_lists_round_trip() {
        let h = LargeList {
            gen: 0xDEAD_BEEF_0123_4567,
            len: 1_000_000,
            head: 3,
            tail: 900,
            next_id: 901,
            chunks: 898,
            bytes: 100_000_000,
        };
        let stored = h.encode();
        assert!(is_large(&stored));
        assert_eq!(kind_of(&stored), Ok(Kind::List));
        assert_eq!(LargeList::decode(&stored), Ok(h));
        assert_eq!(check(&stored), Ok((Kind::List, 1_000_000)));
        // The small decoders refuse it, and it refuses a small list.
        assert_eq!(List::decode(&stored), Err(TypedError::WrongKind));
        let small = List::default().encode();
        assert!(!is_large(&small));
        assert!(LargeList::decode(&small).is_err());
        assert!(LargeList::decode(&stored[..stored.len() - 1]).is_err());
        // A large flag on a kind with no large form (a stream) is unknown; on a sorted set it
        // is the large sorted set's header.
        assert_eq!(kind_of(b"\xff\x15"), Err(TypedError::UnknownKind(0x15)));
        assert_eq!(kind_of(b"\xff\x14"), Ok(Kind::ZSet));

        let c = ListChunk {
            prev: 0,
            next: 7,
            items: [b"a".to_vec(), vec![], vec![0xff; 300]].into(),
        };
        assert_eq!(ListChunk::decode(&c.encode()), Ok(c.clone()));
        assert_eq!(c.item_bytes(), 301);

        // The encoded form takes the same pushes and pops.
        let mut raw = RawChunk::decode(&c.encode()).unwrap();
        assert_eq!((raw.prev, raw.next, raw.count), (0, 7, 3));
        raw.push_front(b"front");
        raw.push_back(&[1u8; 200]);
        assert_eq!(raw.end(true), Some(&b"front"[..]));
        assert_eq!(raw.end(false), Some(&[1u8; 200][..]));
        let mut model = c.clone();
        model.items.push_front(b"front".to_vec());
        model.items.push_back(vec![1u8; 200]);
        assert_eq!(ListChunk::decode(&raw.encode()), Ok(model.clone()));
        assert_eq!(raw.encoded_len(), raw.encode().len());
        assert_eq!(raw.pop_back(2), vec![vec![1u8; 200], vec![0xff; 300]]);
        assert_eq!(raw.pop_front(2), vec![b"front".to_vec(), b"a".to_vec()]);
        assert_eq!(raw.pop_front(5), vec![Vec::<u8>::new()]);
        assert_eq!((raw.count, raw.items.len()), (0, 0));
        assert_eq!(raw.end(true), None);
        assert!(RawChunk::decode(&[0, 0, 2, 1, 0]).is_err());

        for key in [&b""[..], b"k", &[0xffu8; 300][..]] {
            let ck = chunk_key(12182, key, 42, 9);
            assert_eq!(ramlog_common::key_slot(&ck), 12182);
            assert_eq!(parse_chunk_key(&ck), Some((12182, key, 42, 9)));
            assert!(ck.len() <= key.len() + CHUNK_KEY_OVERHEAD);
        }
        assert_eq!(parse_chunk_key(b"plain"), None);
    }

    #[test]
    fn collections_round_trip() {
        let mut h = Hash::default();
        assert!(h.set(b"f", b"1"));
        assert!(h.set(b"", b""));
        assert!(!h.set(b"f", b"2"));
        let back = Hash::decode(&h.encode()).unwrap();
        assert_eq!(back, h);
        assert_eq!(back.get(b"f"), Some(&b"2"[..]));
        assert_eq!(kind_of(&h.encode()), Ok(Kind::Hash));
        assert_eq!(string_of(&h.encode()), None);

        let l = List {
            items: [b"a".to_vec(), vec![], vec![0xff; 300]].into(),
        };
        assert_eq!(List::decode(&l.encode()).unwrap(), l);

        let mut s = Set::default();
        assert!(s.add(b"x") && s.add(b"y") && !s.add(b"x"));
        assert!(s.remove(b"x") && !s.remove(b"x"));
        // A set that held a member that is not an integer comes back flagged (Redis's listpack).
        let back = Set::decode(&s.encode()).unwrap();
        assert!(back.listpack && back.members == s.members);
        assert_eq!(Set::decode(&back.encode()).unwrap(), back);
        let ints = Set {
            members: vec![b"1".to_vec(), b"-20".to_vec()],
            listpack: false,
        };
        assert_eq!(Set::decode(&ints.encode()).unwrap(), ints);
        let mut sticky = Set::decode(&back.encode()).unwrap();
        sticky.members = vec![b"7".to_vec()];
        assert_eq!(sticky.encode()[1], Kind::Set as u8 | SET_LISTPACK);
        assert_eq!(kind_of(&sticky.encode()), Ok(Kind::Set));
        assert!(is_integer_member(b"-9223372036854775808") && !is_integer_member(b"01"));
        assert!(!is_integer_member(b"") && !is_integer_member(b"+1") && !is_integer_member(b"1 "));

        let mut z = ZSet::default();
        z.insert(2.0, b"b");
        z.insert(1.0, b"c");
        z.insert(1.0, b"a");
        z.insert(f64::NEG_INFINITY, b"low");
        assert!(!z.insert(3.0, b"a"));
        let order: Vec<&[u8]> = z.entries.iter().map(|e| e.1.as_slice()).collect();
        assert_eq!(order, [&b"low"[..], b"c", b"b", b"a"]);
        assert_eq!(ZSet::decode(&z.encode()).unwrap(), z);

        let mut st = Stream {
            last: (5, 1),
            entries: vec![
                ((1, 0), vec![(b"f".to_vec(), b"v".to_vec())]),
                ((5, 1), vec![]),
            ],
            entries_added: 3,
            max_deleted: (2, 0),
            ..Default::default()
        };
        assert_eq!(Stream::decode(&st.encode()).unwrap(), st);
        let mut g = Group {
            last_delivered: (1, 0),
            entries_read: Some(1),
            ..Default::default()
        };
        for (name, active) in [(&b"alice"[..], None), (b"", Some(7)), (b"bob", Some(0))] {
            g.consumers.insert(
                name.to_vec(),
                Consumer {
                    seen_ms: 9,
                    active_ms: active,
                },
            );
        }
        g.pending.insert(
            (1, 0),
            Pending {
                consumer: b"bob".to_vec(),
                delivered_ms: 5,
                deliveries: 2,
            },
        );
        g.pending.insert(
            (5, 1),
            Pending {
                consumer: b"".to_vec(),
                delivered_ms: 6,
                deliveries: 1,
            },
        );
        st.groups.insert(b"g".to_vec(), g);
        st.groups.insert(b"".to_vec(), Group::default());
        let bytes = st.encode();
        assert_eq!(Stream::decode(&bytes).unwrap(), st);
        // Cut right after the entries, it reads as a stream written before consumer groups.
        let old_end = Stream {
            groups: BTreeMap::new(),
            ..st.clone()
        }
        .encode()
        .len()
            - 4;
        for cut in (2..bytes.len()).filter(|&c| c != old_end) {
            assert!(Stream::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        // A stream written before consumer groups: its entries are all it is known to have added.
        let mut old = vec![TAG, Kind::Stream as u8, 5, 1, 1, 1, 0, 0];
        let s = Stream::decode(&old).unwrap();
        assert_eq!((s.entries_added, s.groups.len()), (1, 0));
        old.push(0);
        assert!(Stream::decode(&old).is_err());
        let mut bad = st.clone();
        bad.last = (4, 0);
        assert_eq!(Stream::decode(&bad.encode()), Err(TypedError::BadOrder));
    }

    #[test]
    fn damaged_values_are_errors() {
        let h = Hash {
            fields: vec![(b"f".to_vec(), b"v".to_vec())],
        }
        .encode();
        for cut in 2..h.len() {
            assert!(Hash::decode(&h[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = h.clone();
        long.push(0);
        assert_eq!(Hash::decode(&long), Err(TypedError::Trailing));
        assert_eq!(List::decode(&h), Err(TypedError::WrongKind));
        // A count far beyond the bytes is refused before anything is allocated.
        let huge = [TAG, Kind::List as u8, 0xff, 0xff, 0xff, 0xff, 0x0f];
        assert_eq!(List::decode(&huge), Err(TypedError::Truncated));
        let mut z = ZSet::default();
        z.insert(1.0, b"a");
        z.insert(2.0, b"b");
        let mut bytes = z.encode();
        // Swap the scores: out of order.
        bytes[3..11].copy_from_slice(&3.0f64.to_le_bytes());
        assert_eq!(ZSet::decode(&bytes), Err(TypedError::BadOrder));
        bytes[3..11].copy_from_slice(&f64::NAN.to_le_bytes());
        assert_eq!(ZSet::decode(&bytes), Err(TypedError::BadOrder));
    }
    #[test]
    fn a_large_table_addresses_every_member_through_splits_and_merges() {
        let mut t = LargeTable::new(Kind::Set, 77);
        let hashes: Vec<u64> = (0..2000u32)
            .map(|i| member_hash(77, &i.to_le_bytes()))
            .collect();
        let mut buckets: Vec<Vec<u64>> = vec![hashes.clone()];
        for _ in 0..300 {
            let (from, to) = t.grow().unwrap();
            assert_eq!(to as usize, buckets.len());
            let (stay, go): (Vec<u64>, Vec<u64>) = buckets[from as usize]
                .iter()
                .partition(|&&h| t.bucket_of(h) == from);
            assert!(go.iter().all(|&h| t.bucket_of(h) == to));
            buckets[from as usize] = stay;
            buckets.push(go);
            assert_eq!(t.buckets() as usize, buckets.len());
            for (b, members) in buckets.iter().enumerate() {
                assert!(members.iter().all(|&h| t.bucket_of(h) == b as u64));
            }
        }
        // Scan positions: each bucket is one interval of reversed hashes.
        for (b, members) in buckets.iter().enumerate() {
            let bits = t.bucket_bits(b as u64);
            let start = scan_position(b as u64) & !(u64::MAX >> bits);
            for &h in members {
                assert_eq!(scan_position(h) & !(u64::MAX >> bits), start);
            }
        }
        while let Some((into, last)) = t.shrink() {
            let moved = buckets.pop().unwrap();
            assert_eq!(last as usize, buckets.len());
            buckets[into as usize].extend(moved);
            for (b, members) in buckets.iter().enumerate() {
                assert!(members.iter().all(|&h| t.bucket_of(h) == b as u64));
            }
        }
        assert_eq!((t.level, t.split, t.buckets()), (0, 0, 1));
        let header = LargeTable {
            len: 5,
            bytes: 99,
            ..t
        };
        assert_eq!(LargeTable::decode(&header.encode()), Ok(header));
        assert_eq!(large_kind(&header.encode()), Some(Kind::Set));
        assert_eq!(large_gen(&header.encode()), Some(77));
        assert_eq!(check(&header.encode()), Ok((Kind::Set, 5)));
    }

    #[test]
    fn a_bucket_is_a_compact_hash_and_edits_in_place() {
        let mut b = RawBucket::empty(Kind::Hash);
        assert_eq!(b.set(b"f1", b"v1"), (0, 6));
        assert_eq!(b.set(b"", b"empty"), (0, 7));
        assert_eq!(b.set(b"f1", b"longer"), (6, 10));
        assert_eq!(b.get(b"f1"), Some(&b"longer"[..]));
        assert_eq!(b.get(b""), Some(&b"empty"[..]));
        let h = Hash::decode(&b.encode()).unwrap();
        assert_eq!(h.fields.len(), 2);
        assert_eq!(RawBucket::decode(&b.encode(), Kind::Hash), Ok(b.clone()));
        assert_eq!(b.remove(b"f1"), Some(10));
        assert_eq!(b.remove(b"f1"), None);
        assert_eq!(b.count, 1);
        let mut s = RawBucket::empty(Kind::Set);
        s.set(b"m", b"");
        assert_eq!(
            Set::decode(&s.encode()).unwrap().members,
            vec![b"m".to_vec()]
        );
        assert!(RawBucket::decode(&s.encode(), Kind::Hash).is_err());
    }
}
