//! The payload of Redis's `DUMP` and `RESTORE`: one value in RDB's encoding, then the RDB
//! version (2 bytes, little-endian) and a CRC-64 (Jones polynomial, reflected, 8 bytes
//! little-endian) of everything before it.
//!
//! [`dump`] writes the plain encodings every Redis since 2.x loads (string, list, set, hash,
//! and sorted sets with binary scores), marked RDB version 9 so that Redis 5 to 7.2 take them,
//! and a stream as Redis 7.2 writes it (listpack nodes, consumer groups with their pending
//! entries and consumers' active times: RDB version 11, which Redis 7.2 takes).
//! [`restore`] reads those and the compact encodings Redis 7.x writes: integer and LZF strings,
//! intsets, ziplists, listpacks and quicklists, and streams of RDB types 15, 19 and 21 (Redis 5
//! to 7.2). Modules and the ancient zipmap are refused with a clear error. Every length is checked against the bytes there are and against
//! [`Limits`], so untrusted payloads cannot make it allocate past them.

/// The RDB version [`dump`] writes.
pub const DUMP_VERSION: u16 = 9;
/// The RDB version of a stream's DUMP (its type, 21, is Redis 7.2's).
pub const STREAM_DUMP_VERSION: u16 = 11;
/// The newest RDB version [`restore`] reads (Redis 7.2's).
pub const MAX_VERSION: u16 = 11;

use crate::types::{Consumer, Group, Pending, Stream, StreamEntry, StreamId};
use std::collections::BTreeMap;

const TYPE_STRING: u8 = 0;
const TYPE_LIST: u8 = 1;
const TYPE_SET: u8 = 2;
const TYPE_ZSET: u8 = 3;
const TYPE_HASH: u8 = 4;
const TYPE_ZSET_2: u8 = 5;
const TYPE_HASH_ZIPMAP: u8 = 9;
const TYPE_LIST_ZIPLIST: u8 = 10;
const TYPE_SET_INTSET: u8 = 11;
const TYPE_ZSET_ZIPLIST: u8 = 12;
const TYPE_HASH_ZIPLIST: u8 = 13;
const TYPE_LIST_QUICKLIST: u8 = 14;
const TYPE_STREAM_LISTPACKS: u8 = 15;
const TYPE_HASH_LISTPACK: u8 = 16;
const TYPE_ZSET_LISTPACK: u8 = 17;
const TYPE_LIST_QUICKLIST_2: u8 = 18;
const TYPE_STREAM_LISTPACKS_2: u8 = 19;
const TYPE_SET_LISTPACK: u8 = 20;
const TYPE_STREAM_LISTPACKS_3: u8 = 21;

/// One value, as the key's type holds it.
#[derive(Debug, Clone, PartialEq)]
pub enum RdbValue {
    String(Vec<u8>),
    List(Vec<Vec<u8>>),
    Set(Vec<Vec<u8>>),
    /// Members with their scores, in any order.
    ZSet(Vec<(Vec<u8>, f64)>),
    Hash(Vec<(Vec<u8>, Vec<u8>)>),
    Stream(crate::types::Stream),
}

/// Why a payload was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RdbError {
    /// The footer's version is newer than [`MAX_VERSION`], or the checksum does not match.
    #[error("DUMP payload version or checksum are wrong")]
    VersionOrChecksum,
    /// The value's encoding is malformed or truncated.
    #[error("Bad data format")]
    BadFormat,
    /// A well-formed value of a kind this server does not restore.
    #[error("{0}")]
    Unsupported(&'static str),
    /// Past the limits given.
    #[error("{0}")]
    TooLarge(&'static str),
}

/// A string past [`Limits::string_bytes`].
const TOO_LONG: RdbError = RdbError::TooLarge("a string of the payload is larger than allowed");
/// A collection past [`Limits::elements`].
const TOO_MANY: RdbError = RdbError::TooLarge("the collection has more elements than allowed");

/// Bounds on what a payload may make [`restore`] build.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The largest string (a value, a member, a field) in bytes.
    pub string_bytes: usize,
    /// The most elements one collection may hold.
    pub elements: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            string_bytes: 512 << 20,
            elements: 1 << 32,
        }
    }
}

/// CRC-64/Jones as Redis computes it (reflected, initial 0, no final xor).
pub fn crc64(mut crc: u64, data: &[u8]) -> u64 {
    const POLY: u64 = 0x95ac_9329_ac4b_c9b5; // 0xad93d23594c935a9 reflected
    static TABLE: std::sync::OnceLock<[u64; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u64; 256];
        for (i, slot) in t.iter_mut().enumerate() {
            let mut c = i as u64;
            for _ in 0..8 {
                c = if c & 1 == 1 { (c >> 1) ^ POLY } else { c >> 1 };
            }
            *slot = c;
        }
        t
    });
    for &b in data {
        crc = table[((crc ^ u64::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    crc
}

fn put_len(out: &mut Vec<u8>, len: u64) {
    if len < 1 << 6 {
        out.push(len as u8);
    } else if len < 1 << 14 {
        out.push(0x40 | (len >> 8) as u8);
        out.push(len as u8);
    } else if len <= u64::from(u32::MAX) {
        out.push(0x80);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    } else {
        out.push(0x81);
        out.extend_from_slice(&len.to_be_bytes());
    }
}

fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    put_len(out, s.len() as u64);
    out.extend_from_slice(s);
}

/// The `DUMP` payload of `value`.
pub fn dump(value: &RdbValue) -> Vec<u8> {
    let mut out = Vec::new();
    match value {
        RdbValue::String(s) => {
            out.push(TYPE_STRING);
            put_string(&mut out, s);
        }
        RdbValue::List(items) => {
            out.push(TYPE_LIST);
            put_len(&mut out, items.len() as u64);
            for i in items {
                put_string(&mut out, i);
            }
        }
        RdbValue::Set(members) => {
            out.push(TYPE_SET);
            put_len(&mut out, members.len() as u64);
            for m in members {
                put_string(&mut out, m);
            }
        }
        RdbValue::ZSet(entries) => {
            out.push(TYPE_ZSET_2);
            put_len(&mut out, entries.len() as u64);
            for (m, score) in entries {
                put_string(&mut out, m);
                out.extend_from_slice(&score.to_le_bytes());
            }
        }
        RdbValue::Hash(fields) => {
            out.push(TYPE_HASH);
            put_len(&mut out, fields.len() as u64);
            for (f, v) in fields {
                put_string(&mut out, f);
                put_string(&mut out, v);
            }
        }
        RdbValue::Stream(st) => {
            out.push(TYPE_STREAM_LISTPACKS_3);
            put_stream(&mut out, st);
        }
    }
    let version = match value {
        RdbValue::Stream(_) => STREAM_DUMP_VERSION,
        _ => DUMP_VERSION,
    };
    out.extend_from_slice(&version.to_le_bytes());
    let crc = crc64(0, &out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// The value a `DUMP` payload holds, after its version and checksum are checked.
pub fn restore(payload: &[u8], limits: Limits) -> Result<RdbValue, RdbError> {
    if payload.len() < 10 {
        return Err(RdbError::VersionOrChecksum);
    }
    let (body, footer) = payload.split_at(payload.len() - 10);
    let version = u16::from_le_bytes([footer[0], footer[1]]);
    if version > MAX_VERSION {
        return Err(RdbError::VersionOrChecksum);
    }
    let crc = u64::from_le_bytes(footer[2..10].try_into().expect("8 bytes"));
    if crc64(0, &payload[..payload.len() - 8]) != crc {
        return Err(RdbError::VersionOrChecksum);
    }
    let mut r = Reader {
        buf: body,
        pos: 0,
        limits,
    };
    let kind = r.byte()?;
    let value = r.value(kind)?;
    if r.pos != body.len() {
        return Err(RdbError::BadFormat);
    }
    Ok(value)
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: Limits,
}

/// A length, or one of the special string encodings.
enum Len {
    Plain(u64),
    Int8,
    Int16,
    Int32,
    Lzf,
}

impl<'a> Reader<'a> {
    fn byte(&mut self) -> Result<u8, RdbError> {
        let b = *self.buf.get(self.pos).ok_or(RdbError::BadFormat)?;
        self.pos += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], RdbError> {
        let end = self.pos.checked_add(n).ok_or(RdbError::BadFormat)?;
        let s = self.buf.get(self.pos..end).ok_or(RdbError::BadFormat)?;
        self.pos = end;
        Ok(s)
    }

    fn len_or_special(&mut self) -> Result<Len, RdbError> {
        let b = self.byte()?;
        Ok(match b >> 6 {
            0 => Len::Plain(u64::from(b & 0x3f)),
            1 => Len::Plain((u64::from(b & 0x3f) << 8) | u64::from(self.byte()?)),
            2 => match b {
                0x80 => Len::Plain(u64::from(u32::from_be_bytes(
                    self.take(4)?.try_into().expect("4"),
                ))),
                0x81 => Len::Plain(u64::from_be_bytes(self.take(8)?.try_into().expect("8"))),
                _ => return Err(RdbError::BadFormat),
            },
            _ => match b & 0x3f {
                0 => Len::Int8,
                1 => Len::Int16,
                2 => Len::Int32,
                3 => Len::Lzf,
                _ => return Err(RdbError::BadFormat),
            },
        })
    }

    fn len(&mut self) -> Result<u64, RdbError> {
        match self.len_or_special()? {
            Len::Plain(n) => Ok(n),
            _ => Err(RdbError::BadFormat),
        }
    }

    /// A collection's element count, checked against the limit and against the bytes left
    /// (every element takes at least `min_bytes`).
    fn count(&mut self, min_bytes: usize) -> Result<usize, RdbError> {
        let n = self.len()?;
        if n > self.limits.elements as u64 {
            return Err(TOO_MANY);
        }
        let left = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_bytes as u64) > left {
            return Err(RdbError::BadFormat);
        }
        Ok(n as usize)
    }

    fn check_string(&self, n: u64) -> Result<usize, RdbError> {
        if n > self.limits.string_bytes as u64 {
            return Err(TOO_LONG);
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<Vec<u8>, RdbError> {
        match self.len_or_special()? {
            Len::Plain(n) => {
                let n = self.check_string(n)?;
                Ok(self.take(n)?.to_vec())
            }
            Len::Int8 => Ok((self.byte()? as i8).to_string().into_bytes()),
            Len::Int16 => Ok(i16::from_le_bytes(self.take(2)?.try_into().expect("2"))
                .to_string()
                .into_bytes()),
            Len::Int32 => Ok(i32::from_le_bytes(self.take(4)?.try_into().expect("4"))
                .to_string()
                .into_bytes()),
            Len::Lzf => {
                let clen = self.len()?;
                let ulen = self.len()?;
                let ulen = self.check_string(ulen)?;
                let clen = usize::try_from(clen).map_err(|_| RdbError::BadFormat)?;
                let compressed = self.take(clen)?;
                lzf_decompress(compressed, ulen)
            }
        }
    }

    fn double_text(&mut self) -> Result<f64, RdbError> {
        match self.byte()? {
            253 => Ok(f64::NAN),
            254 => Ok(f64::INFINITY),
            255 => Ok(f64::NEG_INFINITY),
            n => {
                let text = self.take(usize::from(n))?;
                std::str::from_utf8(text)
                    .ok()
                    .and_then(|s| s.trim().parse::<f64>().ok())
                    .ok_or(RdbError::BadFormat)
            }
        }
    }

    fn value(&mut self, kind: u8) -> Result<RdbValue, RdbError> {
        match kind {
            TYPE_STRING => Ok(RdbValue::String(self.string()?)),
            TYPE_LIST => {
                let n = self.count(1)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.string()?);
                }
                Ok(RdbValue::List(items))
            }
            TYPE_SET => {
                let n = self.count(1)?;
                let mut members = Vec::with_capacity(n);
                for _ in 0..n {
                    members.push(self.string()?);
                }
                Ok(RdbValue::Set(members))
            }
            TYPE_ZSET | TYPE_ZSET_2 => {
                let n = self.count(2)?;
                let mut entries = Vec::with_capacity(n);
                for _ in 0..n {
                    let m = self.string()?;
                    let score = if kind == TYPE_ZSET_2 {
                        f64::from_le_bytes(self.take(8)?.try_into().expect("8"))
                    } else {
                        self.double_text()?
                    };
                    if score.is_nan() {
                        return Err(RdbError::BadFormat);
                    }
                    entries.push((m, score));
                }
                Ok(RdbValue::ZSet(entries))
            }
            TYPE_HASH => {
                let n = self.count(2)?;
                let mut fields = Vec::with_capacity(n);
                for _ in 0..n {
                    let f = self.string()?;
                    let v = self.string()?;
                    fields.push((f, v));
                }
                Ok(RdbValue::Hash(fields))
            }
            TYPE_LIST_ZIPLIST => Ok(RdbValue::List(self.packed(Packing::Ziplist)?)),
            TYPE_SET_INTSET => {
                let blob = self.string()?;
                Ok(RdbValue::Set(intset(&blob, self.limits)?))
            }
            TYPE_SET_LISTPACK => Ok(RdbValue::Set(self.packed(Packing::Listpack)?)),
            TYPE_ZSET_ZIPLIST | TYPE_ZSET_LISTPACK => {
                let packing = if kind == TYPE_ZSET_ZIPLIST {
                    Packing::Ziplist
                } else {
                    Packing::Listpack
                };
                let flat = self.packed(packing)?;
                Ok(RdbValue::ZSet(
                    pairs(flat)?
                        .into_iter()
                        .map(score_of)
                        .collect::<Result<_, _>>()?,
                ))
            }
            TYPE_HASH_ZIPLIST | TYPE_HASH_LISTPACK => {
                let packing = if kind == TYPE_HASH_ZIPLIST {
                    Packing::Ziplist
                } else {
                    Packing::Listpack
                };
                Ok(RdbValue::Hash(pairs(self.packed(packing)?)?))
            }
            TYPE_LIST_QUICKLIST | TYPE_LIST_QUICKLIST_2 => {
                let nodes = self.count(1)?;
                let mut items = Vec::new();
                for _ in 0..nodes {
                    let container = if kind == TYPE_LIST_QUICKLIST_2 {
                        self.len()?
                    } else {
                        2
                    };
                    let blob = self.string()?;
                    match container {
                        // A plain node: one large element as is.
                        1 => items.push(blob),
                        2 => {
                            let packing = if kind == TYPE_LIST_QUICKLIST {
                                Packing::Ziplist
                            } else {
                                Packing::Listpack
                            };
                            let node = unpack(&blob, packing, self.limits)?;
                            if node.is_empty() {
                                return Err(RdbError::BadFormat);
                            }
                            items.extend(node);
                        }
                        _ => return Err(RdbError::BadFormat),
                    }
                    if items.len() > self.limits.elements {
                        return Err(TOO_MANY);
                    }
                }
                Ok(RdbValue::List(items))
            }
            TYPE_STREAM_LISTPACKS | TYPE_STREAM_LISTPACKS_2 | TYPE_STREAM_LISTPACKS_3 => {
                Ok(RdbValue::Stream(self.stream(kind)?))
            }
            TYPE_HASH_ZIPMAP => Err(RdbError::Unsupported(
                "RESTORE of a zipmap hash (RDB before version 4) is not supported",
            )),
            _ => Err(RdbError::BadFormat),
        }
    }

    fn id(&mut self) -> Result<StreamId, RdbError> {
        Ok((self.len()?, self.len()?))
    }

    /// A stream id as 16 raw bytes (big-endian milliseconds, then sequence).
    fn raw_id(&mut self) -> Result<StreamId, RdbError> {
        let b = self.take(16)?;
        Ok((
            u64::from_be_bytes(b[..8].try_into().expect("8")),
            u64::from_be_bytes(b[8..].try_into().expect("8")),
        ))
    }

    /// A time in milliseconds (8 bytes, little-endian, signed).
    fn ms(&mut self) -> Result<i64, RdbError> {
        Ok(i64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }

    /// A stream of RDB type `kind` (Redis's `rdbLoadObject` for streams).
    fn stream(&mut self, kind: u8) -> Result<Stream, RdbError> {
        let nodes = self.count(2)?;
        let mut entries: Vec<StreamEntry> = Vec::new();
        for _ in 0..nodes {
            let key = self.string()?;
            if key.len() != 16 {
                return Err(RdbError::BadFormat);
            }
            let master = (
                u64::from_be_bytes(key[..8].try_into().expect("8")),
                u64::from_be_bytes(key[8..].try_into().expect("8")),
            );
            let lp = self.string()?;
            stream_node(&listpack(&lp, self.limits)?, master, &mut entries)?;
            if entries.len() > self.limits.elements {
                return Err(TOO_MANY);
            }
        }
        if entries.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(RdbError::BadFormat);
        }
        if self.len()? != entries.len() as u64 {
            return Err(RdbError::BadFormat);
        }
        let last = self.id()?;
        if entries.last().is_some_and(|e| e.0 > last) {
            return Err(RdbError::BadFormat);
        }
        let mut s = Stream {
            last,
            entries_added: entries.len() as u64,
            entries,
            ..Default::default()
        };
        if kind >= TYPE_STREAM_LISTPACKS_2 {
            let _first = self.id()?;
            s.max_deleted = self.id()?;
            s.entries_added = self.len()?;
            if s.entries_added < s.entries.len() as u64 || s.max_deleted > s.last {
                return Err(RdbError::BadFormat);
            }
        }
        let groups = self.count(3)?;
        for _ in 0..groups {
            let name = self.string()?;
            let last_delivered = self.id()?;
            let entries_read = if kind >= TYPE_STREAM_LISTPACKS_2 {
                // -1 (unknown) as Redis saves it: the length encoding of 2^64 - 1.
                Some(self.len()?).filter(|&n| n != u64::MAX)
            } else {
                s.entries_up_to(last_delivered)
            };
            let mut pending: BTreeMap<StreamId, (Option<Vec<u8>>, u64, u64)> = BTreeMap::new();
            for _ in 0..self.count(18)? {
                let id = self.raw_id()?;
                let delivered = self.ms()?.max(0) as u64;
                let deliveries = self.len()?;
                if pending.insert(id, (None, delivered, deliveries)).is_some() {
                    return Err(RdbError::BadFormat);
                }
            }
            let mut consumers = BTreeMap::new();
            for _ in 0..self.count(10)? {
                let cname = self.string()?;
                let seen = self.ms()?.max(0) as u64;
                let active = if kind >= TYPE_STREAM_LISTPACKS_3 {
                    Some(self.ms()?).filter(|&t| t >= 0).map(|t| t as u64)
                } else {
                    Some(seen)
                };
                for _ in 0..self.count(16)? {
                    let id = self.raw_id()?;
                    match pending.get_mut(&id) {
                        Some(p) if p.0.is_none() => p.0 = Some(cname.clone()),
                        _ => return Err(RdbError::BadFormat),
                    }
                }
                let c = Consumer {
                    seen_ms: seen,
                    active_ms: active,
                };
                if consumers.insert(cname, c).is_some() {
                    return Err(RdbError::BadFormat);
                }
            }
            let mut pel = BTreeMap::new();
            for (id, (consumer, delivered_ms, deliveries)) in pending {
                // A pending entry every consumer disowns is refused, as Redis's check does.
                let consumer = consumer.ok_or(RdbError::BadFormat)?;
                pel.insert(
                    id,
                    Pending {
                        consumer,
                        delivered_ms,
                        deliveries,
                    },
                );
            }
            let g = Group {
                last_delivered,
                entries_read,
                consumers,
                pending: pel,
            };
            if s.groups.insert(name, g).is_some() {
                return Err(RdbError::BadFormat);
            }
        }
        Ok(s)
    }

    /// A ziplist or listpack held as an RDB string.
    fn packed(&mut self, packing: Packing) -> Result<Vec<Vec<u8>>, RdbError> {
        let blob = self.string()?;
        unpack(&blob, packing, self.limits)
    }
}

fn score_of((m, s): (Vec<u8>, Vec<u8>)) -> Result<(Vec<u8>, f64), RdbError> {
    let score = std::str::from_utf8(&s)
        .ok()
        .and_then(|t| match t {
            "inf" | "+inf" => Some(f64::INFINITY),
            "-inf" => Some(f64::NEG_INFINITY),
            _ => t.parse::<f64>().ok(),
        })
        .filter(|v| !v.is_nan())
        .ok_or(RdbError::BadFormat)?;
    Ok((m, score))
}

/// Field and value (or member and score text) pairs.
type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

fn pairs(flat: Vec<Vec<u8>>) -> Result<Pairs, RdbError> {
    if !flat.len().is_multiple_of(2) {
        return Err(RdbError::BadFormat);
    }
    let mut out = Vec::with_capacity(flat.len() / 2);
    let mut it = flat.into_iter();
    while let (Some(a), Some(b)) = (it.next(), it.next()) {
        out.push((a, b));
    }
    Ok(out)
}

#[derive(Clone, Copy)]
enum Packing {
    Ziplist,
    Listpack,
}

fn unpack(blob: &[u8], packing: Packing, limits: Limits) -> Result<Vec<Vec<u8>>, RdbError> {
    match packing {
        Packing::Ziplist => ziplist(blob, limits),
        Packing::Listpack => listpack(blob, limits),
    }
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// A ziplist's elements (integers as their decimal text).
fn ziplist(z: &[u8], limits: Limits) -> Result<Vec<Vec<u8>>, RdbError> {
    if z.len() < 11 || le_u32(z) as usize != z.len() || z[z.len() - 1] != 0xff {
        return Err(RdbError::BadFormat);
    }
    let mut p = 10;
    let end = z.len() - 1;
    let mut out = Vec::new();
    let get = |from: usize, n: usize| {
        z.get(from..from.checked_add(n)?)
            .filter(|_| from + n <= end)
    };
    while p < end {
        // The previous entry's length: 1 byte, or 0xfe and 4 bytes.
        p += if z[p] == 0xfe { 5 } else { 1 };
        let enc = *z.get(p).filter(|_| p < end).ok_or(RdbError::BadFormat)?;
        p += 1;
        let item = match enc >> 6 {
            0 => {
                let n = usize::from(enc & 0x3f);
                let s = get(p, n).ok_or(RdbError::BadFormat)?;
                p += n;
                s.to_vec()
            }
            1 => {
                let b = get(p, 1).ok_or(RdbError::BadFormat)?;
                let n = (usize::from(enc & 0x3f) << 8) | usize::from(b[0]);
                p += 1;
                let s = get(p, n).ok_or(RdbError::BadFormat)?;
                p += n;
                s.to_vec()
            }
            2 => {
                let b = get(p, 4).ok_or(RdbError::BadFormat)?;
                let n = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
                p += 4;
                if n > limits.string_bytes {
                    return Err(TOO_LONG);
                }
                let s = get(p, n).ok_or(RdbError::BadFormat)?;
                p += n;
                s.to_vec()
            }
            _ => {
                let (width, v): (usize, i64) = match enc {
                    0xc0 => (2, 0),
                    0xd0 => (4, 0),
                    0xe0 => (8, 0),
                    0xf0 => (3, 0),
                    0xfe => (1, 0),
                    0xf1..=0xfd => (0, i64::from(enc & 0x0f) - 1),
                    _ => return Err(RdbError::BadFormat),
                };
                let v = if width == 0 {
                    v
                } else {
                    let b = get(p, width).ok_or(RdbError::BadFormat)?;
                    p += width;
                    signed_le(b)
                };
                v.to_string().into_bytes()
            }
        };
        out.push(item);
        if out.len() > limits.elements {
            return Err(TOO_MANY);
        }
    }
    Ok(out)
}

/// A little-endian two's-complement integer of 1 to 8 bytes.
fn signed_le(b: &[u8]) -> i64 {
    let mut v: u64 = 0;
    for (i, &byte) in b.iter().enumerate() {
        v |= u64::from(byte) << (8 * i);
    }
    let bits = 8 * b.len() as u32;
    if bits < 64 {
        let shift = 64 - bits;
        ((v << shift) as i64) >> shift
    } else {
        v as i64
    }
}

/// The bytes a listpack entry's back-length takes for an entry of `len` bytes.
fn backlen_bytes(len: usize) -> usize {
    match len {
        0..=127 => 1,
        128..=16383 => 2,
        16384..=2_097_151 => 3,
        2_097_152..=268_435_455 => 4,
        _ => 5,
    }
}

/// A listpack's elements (integers as their decimal text).
fn listpack(lp: &[u8], limits: Limits) -> Result<Vec<Vec<u8>>, RdbError> {
    if lp.len() < 7 || le_u32(lp) as usize != lp.len() || lp[lp.len() - 1] != 0xff {
        return Err(RdbError::BadFormat);
    }
    let end = lp.len() - 1;
    let mut p = 6;
    let mut out = Vec::new();
    let get = |from: usize, n: usize| {
        lp.get(from..from.checked_add(n)?)
            .filter(|_| from + n <= end)
    };
    while p < end {
        let start = p;
        let enc = lp[p];
        p += 1;
        let item = if enc & 0x80 == 0 {
            u64::from(enc & 0x7f).to_string().into_bytes()
        } else if enc & 0xc0 == 0x80 {
            let n = usize::from(enc & 0x3f);
            let s = get(p, n).ok_or(RdbError::BadFormat)?;
            p += n;
            s.to_vec()
        } else if enc & 0xe0 == 0xc0 {
            let b = get(p, 1).ok_or(RdbError::BadFormat)?;
            p += 1;
            let u = (i64::from(enc & 0x1f) << 8) | i64::from(b[0]);
            let v = if u >= 1 << 12 { u - (1 << 13) } else { u };
            v.to_string().into_bytes()
        } else if enc & 0xf0 == 0xe0 {
            let b = get(p, 1).ok_or(RdbError::BadFormat)?;
            p += 1;
            let n = (usize::from(enc & 0x0f) << 8) | usize::from(b[0]);
            let s = get(p, n).ok_or(RdbError::BadFormat)?;
            p += n;
            s.to_vec()
        } else {
            match enc {
                0xf0 => {
                    let b = get(p, 4).ok_or(RdbError::BadFormat)?;
                    p += 4;
                    let n = le_u32(b) as usize;
                    if n > limits.string_bytes {
                        return Err(TOO_LONG);
                    }
                    let s = get(p, n).ok_or(RdbError::BadFormat)?;
                    p += n;
                    s.to_vec()
                }
                0xf1..=0xf4 => {
                    let width = match enc {
                        0xf1 => 2,
                        0xf2 => 3,
                        0xf3 => 4,
                        _ => 8,
                    };
                    let b = get(p, width).ok_or(RdbError::BadFormat)?;
                    p += width;
                    signed_le(b).to_string().into_bytes()
                }
                _ => return Err(RdbError::BadFormat),
            }
        };
        p += backlen_bytes(p - start);
        if p > end {
            return Err(RdbError::BadFormat);
        }
        out.push(item);
        if out.len() > limits.elements {
            return Err(TOO_MANY);
        }
    }
    Ok(out)
}

/// Stream listpack entry flags (Redis's `STREAM_ITEM_FLAG_*`).
const ITEM_DELETED: i64 = 1;
const ITEM_SAMEFIELDS: i64 = 2;
/// Entries per listpack node of a dumped stream (Redis's default `stream-node-max-entries`).
const STREAM_NODE_ENTRIES: usize = 100;

fn int_of(item: Option<&Vec<u8>>) -> Result<i64, RdbError> {
    item.and_then(|b| std::str::from_utf8(b).ok()?.parse().ok())
        .ok_or(RdbError::BadFormat)
}

/// One listpack node of a stream whose master id is `master`: its live entries, appended to
/// `out` (Redis's node layout: the master entry, then each entry with its flags, id deltas,
/// fields or only values when they are the master's, and its element count).
fn stream_node(
    items: &[Vec<u8>],
    master: StreamId,
    out: &mut Vec<StreamEntry>,
) -> Result<(), RdbError> {
    let mut it = items.iter();
    let count = int_of(it.next())?;
    let deleted = int_of(it.next())?;
    let nfields = int_of(it.next())?;
    if count < 0 || deleted < 0 || nfields < 0 || nfields as usize > items.len() {
        return Err(RdbError::BadFormat);
    }
    let master_fields: Vec<&Vec<u8>> = (0..nfields)
        .map(|_| it.next().ok_or(RdbError::BadFormat))
        .collect::<Result<_, _>>()?;
    if int_of(it.next())? != 0 {
        return Err(RdbError::BadFormat);
    }
    let mut live = 0;
    for _ in 0..count.saturating_add(deleted) {
        let flags = int_of(it.next())?;
        let ms = int_of(it.next())? as u64;
        let seq = int_of(it.next())? as u64;
        let id = (master.0.wrapping_add(ms), master.1.wrapping_add(seq));
        let mut fields = Vec::new();
        let expected = if flags & ITEM_SAMEFIELDS != 0 {
            for f in &master_fields {
                let v = it.next().ok_or(RdbError::BadFormat)?;
                fields.push(((*f).clone(), v.clone()));
            }
            nfields + 3
        } else {
            let n = int_of(it.next())?;
            if n < 0 || n as usize > items.len() {
                return Err(RdbError::BadFormat);
            }
            for _ in 0..n {
                let f = it.next().ok_or(RdbError::BadFormat)?;
                let v = it.next().ok_or(RdbError::BadFormat)?;
                fields.push((f.clone(), v.clone()));
            }
            2 * n + 4
        };
        if int_of(it.next())? != expected {
            return Err(RdbError::BadFormat);
        }
        if flags & ITEM_DELETED == 0 {
            out.push((id, fields));
            live += 1;
        }
    }
    if it.next().is_some() || live != count {
        return Err(RdbError::BadFormat);
    }
    Ok(())
}

/// A listpack being written (Redis's encoding: the header, each element with its back-length,
/// the end byte).
struct Listpack {
    buf: Vec<u8>,
    count: usize,
}

impl Listpack {
    fn new() -> Self {
        Listpack {
            buf: vec![0; 6],
            count: 0,
        }
    }

    fn element(&mut self, encoded: &[u8]) {
        self.buf.extend_from_slice(encoded);
        let l = encoded.len();
        let back: &[u8] = match l {
            0..=127 => &[l as u8],
            128..=16382 => &[(l >> 7) as u8, (l & 127) as u8 | 128],
            16383..=2_097_150 => &[
                (l >> 14) as u8,
                ((l >> 7) & 127) as u8 | 128,
                (l & 127) as u8 | 128,
            ],
            2_097_151..=268_435_454 => &[
                (l >> 21) as u8,
                ((l >> 14) & 127) as u8 | 128,
                ((l >> 7) & 127) as u8 | 128,
                (l & 127) as u8 | 128,
            ],
            _ => &[
                (l >> 28) as u8,
                ((l >> 21) & 127) as u8 | 128,
                ((l >> 14) & 127) as u8 | 128,
                ((l >> 7) & 127) as u8 | 128,
                (l & 127) as u8 | 128,
            ],
        };
        self.buf.extend_from_slice(back);
        self.count += 1;
    }

    fn int(&mut self, v: i64) {
        let mut e = Vec::with_capacity(9);
        if (0..=127).contains(&v) {
            e.push(v as u8);
        } else if (-4096..=4095).contains(&v) {
            let u = (v as u16) & 0x1fff;
            e.extend_from_slice(&[0xc0 | (u >> 8) as u8, u as u8]);
        } else if i16::try_from(v).is_ok() {
            e.push(0xf1);
            e.extend_from_slice(&(v as i16).to_le_bytes());
        } else if (-(1 << 23)..(1 << 23)).contains(&v) {
            e.push(0xf2);
            e.extend_from_slice(&(v as i32).to_le_bytes()[..3]);
        } else if i32::try_from(v).is_ok() {
            e.push(0xf3);
            e.extend_from_slice(&(v as i32).to_le_bytes());
        } else {
            e.push(0xf4);
            e.extend_from_slice(&v.to_le_bytes());
        }
        self.element(&e);
    }

    fn string(&mut self, s: &[u8]) {
        let mut e = Vec::with_capacity(s.len() + 5);
        let n = s.len();
        if n < 64 {
            e.push(0x80 | n as u8);
        } else if n < 4096 {
            e.extend_from_slice(&[0xe0 | (n >> 8) as u8, n as u8]);
        } else {
            e.push(0xf0);
            e.extend_from_slice(&(n as u32).to_le_bytes());
        }
        e.extend_from_slice(s);
        self.element(&e);
    }

    fn finish(mut self) -> Vec<u8> {
        self.buf.push(0xff);
        let total = self.buf.len() as u32;
        self.buf[..4].copy_from_slice(&total.to_le_bytes());
        let count = self.count.min(65535) as u16;
        self.buf[4..6].copy_from_slice(&count.to_le_bytes());
        self.buf
    }
}

fn put_raw_id(out: &mut Vec<u8>, id: StreamId) {
    out.extend_from_slice(&id.0.to_be_bytes());
    out.extend_from_slice(&id.1.to_be_bytes());
}

/// A stream as Redis 7.2 saves it (RDB type 21): nodes of [`STREAM_NODE_ENTRIES`] entries.
fn put_stream(out: &mut Vec<u8>, s: &Stream) {
    let nodes: Vec<&[StreamEntry]> = s.entries.chunks(STREAM_NODE_ENTRIES).collect();
    put_len(out, nodes.len() as u64);
    for node in nodes {
        let master = node[0].0;
        let mut key = Vec::with_capacity(16);
        put_raw_id(&mut key, master);
        put_string(out, &key);
        let master_fields: Vec<&[u8]> = node[0].1.iter().map(|(f, _)| f.as_slice()).collect();
        let mut lp = Listpack::new();
        lp.int(node.len() as i64);
        lp.int(0);
        lp.int(master_fields.len() as i64);
        for f in &master_fields {
            lp.string(f);
        }
        lp.int(0);
        for (id, fields) in node {
            let same = fields.len() == master_fields.len()
                && fields.iter().zip(&master_fields).all(|((f, _), m)| f == m);
            lp.int(if same { ITEM_SAMEFIELDS } else { 0 });
            lp.int(id.0.wrapping_sub(master.0) as i64);
            lp.int(id.1.wrapping_sub(master.1) as i64);
            if same {
                for (_, v) in fields {
                    lp.string(v);
                }
                lp.int(fields.len() as i64 + 3);
            } else {
                lp.int(fields.len() as i64);
                for (f, v) in fields {
                    lp.string(f);
                    lp.string(v);
                }
                lp.int(2 * fields.len() as i64 + 4);
            }
        }
        put_string(out, &lp.finish());
    }
    put_len(out, s.entries.len() as u64);
    for id in [s.last, s.first_id(), s.max_deleted] {
        put_len(out, id.0);
        put_len(out, id.1);
    }
    put_len(out, s.entries_added);
    put_len(out, s.groups.len() as u64);
    for (name, g) in &s.groups {
        put_string(out, name);
        put_len(out, g.last_delivered.0);
        put_len(out, g.last_delivered.1);
        put_len(out, g.entries_read.unwrap_or(u64::MAX));
        put_len(out, g.pending.len() as u64);
        for (id, p) in &g.pending {
            put_raw_id(out, *id);
            out.extend_from_slice(&(p.delivered_ms as i64).to_le_bytes());
            put_len(out, p.deliveries);
        }
        put_len(out, g.consumers.len() as u64);
        for (cname, c) in &g.consumers {
            put_string(out, cname);
            out.extend_from_slice(&(c.seen_ms as i64).to_le_bytes());
            out.extend_from_slice(&c.active_ms.map_or(-1, |t| t as i64).to_le_bytes());
            let own: Vec<&StreamId> = g
                .pending
                .iter()
                .filter(|(_, p)| p.consumer == *cname)
                .map(|(id, _)| id)
                .collect();
            put_len(out, own.len() as u64);
            for id in own {
                put_raw_id(out, *id);
            }
        }
    }
}

/// An intset's members as decimal text.
fn intset(blob: &[u8], limits: Limits) -> Result<Vec<Vec<u8>>, RdbError> {
    if blob.len() < 8 {
        return Err(RdbError::BadFormat);
    }
    let width = le_u32(&blob[0..4]) as usize;
    let n = le_u32(&blob[4..8]) as usize;
    if !matches!(width, 2 | 4 | 8)
        || blob.len() - 8 != n.checked_mul(width).ok_or(RdbError::BadFormat)?
    {
        return Err(RdbError::BadFormat);
    }
    if n > limits.elements {
        return Err(TOO_MANY);
    }
    Ok(blob[8..]
        .chunks_exact(width)
        .map(|c| signed_le(c).to_string().into_bytes())
        .collect())
}

/// LZF's decompression into exactly `ulen` bytes.
fn lzf_decompress(input: &[u8], ulen: usize) -> Result<Vec<u8>, RdbError> {
    let mut out: Vec<u8> = Vec::with_capacity(ulen.min(input.len().saturating_mul(256)));
    let mut i = 0;
    while i < input.len() {
        let ctrl = usize::from(input[i]);
        i += 1;
        if ctrl < 32 {
            let n = ctrl + 1;
            let lit = input.get(i..i + n).ok_or(RdbError::BadFormat)?;
            if out.len() + n > ulen {
                return Err(RdbError::BadFormat);
            }
            out.extend_from_slice(lit);
            i += n;
        } else {
            let mut n = ctrl >> 5;
            if n == 7 {
                n += usize::from(*input.get(i).ok_or(RdbError::BadFormat)?);
                i += 1;
            }
            n += 2;
            let back =
                ((ctrl & 0x1f) << 8) + usize::from(*input.get(i).ok_or(RdbError::BadFormat)?) + 1;
            i += 1;
            if back > out.len() || out.len() + n > ulen {
                return Err(RdbError::BadFormat);
            }
            let from = out.len() - back;
            for k in 0..n {
                let b = out[from + k];
                out.push(b);
            }
        }
    }
    if out.len() != ulen {
        return Err(RdbError::BadFormat);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wrap(body: &[u8], version: u16) -> Vec<u8> {
        let mut p = body.to_vec();
        p.extend_from_slice(&version.to_le_bytes());
        let crc = crc64(0, &p);
        p.extend_from_slice(&crc.to_le_bytes());
        p
    }

    fn unhex(h: &str) -> Vec<u8> {
        (0..h.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
            .collect()
    }

    /// `DUMP s` of Redis 7.0.15 (RDB type 19, version 10) after XADD 1-1 a 1, 1-2 a 2, 2-0 b x c y,
    /// 3-0 a 3, XDEL 1-2, XGROUP CREATE s g 0, XREADGROUP GROUP g alice COUNT 2, XGROUP CREATE s
    /// empty $, XGROUP CREATECONSUMER s g bob.
    const REDIS_70_STREAM: &str = "130110000000000000000100000000000000014048480000001d000301010101018161020001020100010001010104010301000101010201040100010101dfff020201816202817802816302817902080102010201dfff0203010401ff03030001010102040205656d707479030081ffffffffffffffff00000167020081ffffffffffffffff020000000000000001000000000000000124ffb150a2010000010000000000000002000000000000000024ffb150a2010000010205616c69636524ffb150a201000002000000000000000100000000000000010000000000000002000000000000000003626f6224ffb150a2010000000a00276d896b7f45241f";

    #[test]
    fn a_redis_stream_with_groups_restores_and_dumps_back_to_itself() {
        let Ok(RdbValue::Stream(s)) = restore(&unhex(REDIS_70_STREAM), Limits::default()) else {
            panic!("the Redis 7.0 stream payload did not restore");
        };
        let f = |k: &str, v: &str| (k.as_bytes().to_vec(), v.as_bytes().to_vec());
        assert_eq!(
            s.entries,
            vec![
                ((1, 1), vec![f("a", "1")]),
                ((2, 0), vec![f("b", "x"), f("c", "y")]),
                ((3, 0), vec![f("a", "3")]),
            ]
        );
        assert_eq!(
            (s.last, s.max_deleted, s.entries_added),
            ((3, 0), (1, 2), 4)
        );
        let g = &s.groups[&b"g"[..]];
        assert_eq!((g.last_delivered, g.entries_read), ((2, 0), None));
        let alice = &g.consumers[&b"alice"[..]];
        // Type 19 has no active time: Redis takes the seen time.
        assert_eq!(alice.active_ms, Some(alice.seen_ms));
        assert!(g.consumers.contains_key(&b"bob"[..]));
        assert_eq!(
            g.pending.keys().copied().collect::<Vec<_>>(),
            vec![(1, 1), (2, 0)]
        );
        assert!(g
            .pending
            .values()
            .all(|p| p.consumer == b"alice" && p.deliveries == 1));
        assert_eq!(s.groups[&b"empty"[..]].last_delivered, (3, 0));
        // ramlog's DUMP (type 21, version 11) restores to the same stream.
        let payload = dump(&RdbValue::Stream(s.clone()));
        assert_eq!(
            u16::from_le_bytes([payload[payload.len() - 10], payload[payload.len() - 9]]),
            11
        );
        assert_eq!(
            restore(&payload, Limits::default()),
            Ok(RdbValue::Stream(s.clone()))
        );
        // More entries than a node holds, fields that differ from the node's first, a consumer
        // never active: still the same stream.
        let mut big = s;
        big.entries.clear();
        for i in 0..250u64 {
            let fields = if i % 7 == 0 {
                vec![f("x", "1"), f("y", "")]
            } else {
                vec![f("n", &i.to_string())]
            };
            big.entries.push(((10 + i, i % 3), fields));
        }
        big.last = (300, 0);
        big.entries_added = 400;
        big.groups
            .get_mut(&b"g"[..])
            .unwrap()
            .consumers
            .get_mut(&b"bob"[..])
            .unwrap()
            .active_ms = None;
        let back = restore(&dump(&RdbValue::Stream(big.clone())), Limits::default());
        assert_eq!(back, Ok(RdbValue::Stream(big)));
    }

    #[test]
    fn damaged_stream_payloads_are_refused() {
        let body = unhex(REDIS_70_STREAM);
        let body = &body[..body.len() - 10];
        // Every cut of the body fails, and so does a pending entry no consumer owns.
        for cut in 1..body.len() {
            assert!(
                restore(&wrap(&body[..cut], 10), Limits::default()).is_err(),
                "cut {cut}"
            );
        }
        let mut s = match restore(&unhex(REDIS_70_STREAM), Limits::default()) {
            Ok(RdbValue::Stream(s)) => s,
            other => panic!("{other:?}"),
        };
        s.groups
            .get_mut(&b"g"[..])
            .unwrap()
            .pending
            .get_mut(&(1, 1))
            .unwrap()
            .consumer = b"nobody".to_vec();
        assert_eq!(
            restore(&dump(&RdbValue::Stream(s)), Limits::default()),
            Err(RdbError::BadFormat)
        );
    }

    #[test]
    fn crc64_matches_redis_check_value() {
        assert_eq!(crc64(0, b"123456789"), 0xe9c6_d914_c4b8_d9ca);
    }

    #[test]
    fn redis_payloads_restore() {
        // DUMP of SET k "hello" in Redis 7.0.
        let p = b"\x00\x05hello\x0a\x00cr\xdfve4 \x0a";
        assert_eq!(
            restore(p, Limits::default()),
            Ok(RdbValue::String(b"hello".to_vec()))
        );
        // An integer-encoded string (SET n 12345).
        assert_eq!(
            restore(
                b"\x00\xc190\x0a\x00\x9d\x94\xea'\x93\xfc\x08\xb9",
                Limits::default()
            ),
            Ok(RdbValue::String(b"12345".to_vec()))
        );
    }

    #[test]
    fn every_value_round_trips() {
        let values = [
            RdbValue::String(Vec::new()),
            RdbValue::String(vec![0xff; 70_000]),
            RdbValue::List(vec![b"a".to_vec(), Vec::new(), vec![7; 300]]),
            RdbValue::Set(vec![b"1".to_vec(), b"x".to_vec()]),
            RdbValue::ZSet(vec![
                (b"m".to_vec(), 1.5),
                (b"n".to_vec(), f64::NEG_INFINITY),
            ]),
            RdbValue::Hash(vec![
                (b"f".to_vec(), b"v".to_vec()),
                (Vec::new(), Vec::new()),
            ]),
        ];
        for v in values {
            assert_eq!(restore(&dump(&v), Limits::default()), Ok(v));
        }
    }

    #[test]
    fn damaged_payloads_are_refused() {
        let mut p = dump(&RdbValue::String(b"abc".to_vec()));
        p[1] ^= 1;
        assert_eq!(
            restore(&p, Limits::default()),
            Err(RdbError::VersionOrChecksum)
        );
        let newer = wrap(b"\x00\x01a", MAX_VERSION + 1);
        assert_eq!(
            restore(&newer, Limits::default()),
            Err(RdbError::VersionOrChecksum)
        );
        assert_eq!(
            restore(&wrap(b"\x00\x05ab", 9), Limits::default()),
            Err(RdbError::BadFormat)
        );
        assert_eq!(
            restore(&wrap(b"\x00\x01ab", 9), Limits::default()),
            Err(RdbError::BadFormat)
        );
        // A list claiming a billion elements in a few bytes.
        assert_eq!(
            restore(&wrap(b"\x01\x80\x40\x00\x00\x00", 9), Limits::default()),
            Err(RdbError::BadFormat)
        );
        let tight = Limits {
            string_bytes: 2,
            elements: 1,
        };
        assert!(matches!(
            restore(&wrap(b"\x00\x03abc", 9), tight),
            Err(RdbError::TooLarge(_))
        ));
        assert!(matches!(
            restore(&wrap(b"\x02\x02\x01a\x01b", 9), tight),
            Err(RdbError::TooLarge(_))
        ));
    }

    #[test]
    fn compact_encodings_decode() {
        // intset of 16-bit members 1, -2.
        let mut is = vec![2, 0, 0, 0, 2, 0, 0, 0];
        is.extend_from_slice(&1i16.to_le_bytes());
        is.extend_from_slice(&(-2i16).to_le_bytes());
        let mut body = vec![TYPE_SET_INTSET];
        put_string(&mut body, &is);
        assert_eq!(
            restore(&wrap(&body, 10), Limits::default()),
            Ok(RdbValue::Set(vec![b"1".to_vec(), b"-2".to_vec()]))
        );
        // listpack: "ab", 5, -100 (13-bit), 1000000 (int24).
        let mut lp = vec![0, 0, 0, 0, 4, 0];
        lp.extend_from_slice(&[0x82, b'a', b'b', 3]);
        lp.extend_from_slice(&[5, 1]);
        let v = (-100i64 + (1 << 13)) as u16;
        lp.extend_from_slice(&[0xc0 | (v >> 8) as u8, v as u8, 2]);
        lp.extend_from_slice(&[0xf2, 0x40, 0x42, 0x0f, 4]);
        lp.push(0xff);
        let total = lp.len() as u32;
        lp[0..4].copy_from_slice(&total.to_le_bytes());
        let mut body = vec![TYPE_LIST_QUICKLIST_2, 1, 2];
        put_string(&mut body, &lp);
        assert_eq!(
            restore(&wrap(&body, 10), Limits::default()),
            Ok(RdbValue::List(vec![
                b"ab".to_vec(),
                b"5".to_vec(),
                b"-100".to_vec(),
                b"1000000".to_vec()
            ]))
        );
        // ziplist: "x", 12 (immediate), -3 (int8).
        let mut zl = vec![0; 10];
        zl.extend_from_slice(&[0, 0x01, b'x']);
        zl.extend_from_slice(&[3, 0xf1 + 12]);
        zl.extend_from_slice(&[2, 0xfe, 0xfd]);
        zl.push(0xff);
        let total = zl.len() as u32;
        zl[0..4].copy_from_slice(&total.to_le_bytes());
        let mut body = vec![TYPE_LIST_ZIPLIST];
        put_string(&mut body, &zl);
        assert_eq!(
            restore(&wrap(&body, 9), Limits::default()),
            Ok(RdbValue::List(vec![
                b"x".to_vec(),
                b"12".to_vec(),
                b"-3".to_vec()
            ]))
        );
    }

    #[test]
    fn lzf_strings_decode() {
        // "aaaaaaaaaa": a literal 'a' then a back-reference of 9 bytes at distance 1.
        let c = [0x00, b'a', 0xe0, 0x00, 0x00];
        assert_eq!(lzf_decompress(&c, 10), Ok(vec![b'a'; 10]));
        let mut body = vec![TYPE_STRING, 0xc3];
        put_len(&mut body, c.len() as u64);
        put_len(&mut body, 10);
        body.extend_from_slice(&c);
        assert_eq!(
            restore(&wrap(&body, 10), Limits::default()),
            Ok(RdbValue::String(vec![b'a'; 10]))
        );
        assert_eq!(lzf_decompress(&c, 11), Err(RdbError::BadFormat));
        assert_eq!(lzf_decompress(&[0x20, 0x05], 4), Err(RdbError::BadFormat));
    }
}
