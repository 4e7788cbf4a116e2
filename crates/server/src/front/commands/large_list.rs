//! The large form of a list (docs/architecture.md, "The large form"; docs/formats.md, "Large
//! collections"). A list past `list-max-listpack-size` becomes a header at the user's key
//! ([`LargeList`]) and chunks of about [`CHUNK_BYTES`] at internal keys in the same tablet
//! ([`types::chunk_key`]), linked head to tail. A push or a pop rewrites the end chunk and the
//! header in one atomic unit ([`Node::multi_write_if`], conditional on the header's version), so
//! its cost does not grow with the list; LLEN reads the header alone, LINDEX and LRANGE read the
//! chunks they need.
//!
//! Readers take no lock: they read the header, the chunks, and the header again, and start over
//! if its version moved (every change rewrites the header in the unit that changes chunks).
//! Writers hold the key's read-modify-write lock; a write of the key by a command that does not
//! (DEL, SET, EXPIRE) fails the header's condition and the change starts again.
//!
//! Chunks carry no expiry: the header's governs the list. Chunks that no header names any more
//! (the list was overwritten or expired, or a server stopped in the middle of rewriting a list
//! larger than one unit) are found and deleted by [`sweep`].

use super::*;
use parking_lot::Mutex;
use ramlog_logmem::{MultiOp, MultiWrite, TabletId};
use ramlog_proto::types::{self, LargeList, List, ListChunk, RawChunk};
use std::collections::{HashMap, HashSet, VecDeque};

/// Item bytes a chunk takes before the next item starts a new chunk (an item larger than this
/// has a chunk of its own).
pub(super) const CHUNK_BYTES: usize = 2048;

/// The item bytes of one chunk on this server: [`CHUNK_BYTES`], or less under a small value
/// size limit (a chunk is one object).
fn chunk_bytes(ctx: &Ctx<'_>) -> usize {
    CHUNK_BYTES.min(ctx.node.config.value_size_max_bytes as usize / 2)
}

/// The most bytes one atomic unit of a large list's change writes; a rewrite of a larger list
/// writes its new chunks in several units before the one that switches the header.
pub(super) const UNIT_BYTES: usize = 4 << 20;

/// A collection's key and generation.
pub(super) type Generation = (Vec<u8>, u64);

/// Collections being rewritten in several units: [`sweep`] leaves their chunks.
pub(super) static BUILDING: LazyLock<Mutex<HashSet<Generation>>> =
    LazyLock::new(|| Mutex::new(HashSet::new()));

/// Why a large list's operation did not complete.
pub(super) enum LargeError {
    Node(NodeError),
    /// The list changed under the operation (its header's version moved): start again.
    Changed,
    /// A chunk the header names is missing or does not decode.
    Damaged(String),
    /// The change cannot be made (the error to answer); nothing was written.
    Refused(String),
}

impl From<NodeError> for LargeError {
    fn from(e: NodeError) -> Self {
        match e {
            NodeError::Engine(EngineError::ConditionFailed { .. }) => LargeError::Changed,
            e => LargeError::Node(e),
        }
    }
}

/// Answers a [`LargeError`] that is not [`LargeError::Changed`].
pub(super) fn reply_error(ctx: &mut Ctx<'_>, e: LargeError) {
    match e {
        LargeError::Node(e) => engine_error(ctx, &e),
        LargeError::Changed => ctx
            .enc
            .error("ERR too much contention on the key, try again"),
        LargeError::Damaged(m) => ctx
            .enc
            .error(&format!("ERR the stored value of this key is damaged: {m}")),
        LargeError::Refused(m) => ctx.enc.error(&m),
    }
}

/// A large list as read: its header and the header's version.
#[derive(Clone, Copy)]
pub(super) struct Large {
    pub header: LargeList,
    pub version: u64,
}

impl Large {
    pub fn decode(stored: &Object) -> Result<Large, LargeError> {
        let header =
            LargeList::decode(&stored.value).map_err(|e| LargeError::Damaged(e.to_string()))?;
        Ok(Large {
            header,
            version: stored.version,
        })
    }
}

/// Whether a list of these items belongs in the large form.
pub(super) fn wants_large(
    ctx: &Ctx<'_>,
    items: &VecDeque<Vec<u8>>,
    growing: Option<&[u8]>,
) -> bool {
    let extra = growing.map_or(0, |g| g.len() + varint_len(g.len()));
    let count = items.len() + usize::from(growing.is_some());
    wants_large_sized(ctx, count, encoded_size(items) + extra)
}

/// [`wants_large`] of a list of `count` items whose compact encoding takes about `size` bytes
/// (its items' encoded bytes and 8).
pub(super) fn wants_large_sized(ctx: &Ctx<'_>, count: usize, size: usize) -> bool {
    use crate::node::settings::ListLimit;
    // Never past what one object may hold, whatever the setting.
    if size as u64 > ctx.node.config.value_size_max_bytes / 2 {
        return true;
    }
    match ctx.node.settings.list_limit() {
        // Redis's count limit comes with a size limit of 8 KiB as well.
        ListLimit::Entries(n) => count > n || size > SIZE_SAFETY_LIMIT,
        ListLimit::Bytes(b) => size > b,
    }
}

/// The bytes past which a list counted by entries takes the large form anyway.
const SIZE_SAFETY_LIMIT: usize = 8192;

/// Whether a large list of `h` may go back to the compact form: one or two chunks under half the limit
/// (Redis converts back at half, so that a list at the limit does not flip at every change).
fn fits_small(ctx: &Ctx<'_>, h: &LargeList) -> bool {
    use crate::node::settings::ListLimit;
    h.chunks <= 2
        && h.bytes + 3 * h.len + 8 <= ctx.node.config.value_size_max_bytes / 4
        && match ctx.node.settings.list_limit() {
            ListLimit::Entries(n) => {
                h.len <= (n / 2) as u64 && h.bytes + 3 * h.len + 8 <= (SIZE_SAFETY_LIMIT / 2) as u64
            }
            ListLimit::Bytes(b) => h.bytes + 3 * h.len + 8 <= (b / 2) as u64,
        }
}

/// About what the compact encoding of these items takes.
fn encoded_size(items: &VecDeque<Vec<u8>>) -> usize {
    items
        .iter()
        .map(|i| i.len() + varint_len(i.len()))
        .sum::<usize>()
        + 8
}

fn varint_len(n: usize) -> usize {
    ramlog_common::varint::len(n as u64)
}

/// A generation unlikely to have been used at any key before: the fast generator mixed with
/// the time and the process. Never 0.
pub(super) fn random_gen() -> u64 {
    let mixed = super::typed::random_u64()
        ^ ramlog_common::unix_ns().rotate_left(17)
        ^ (u64::from(std::process::id()) << 40);
    mixed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

/// Where a large list lives, for building its chunk keys.
#[derive(Clone, Copy)]
pub(super) struct Place<'k> {
    pub tablet: TabletId,
    pub slot: u16,
    pub key: &'k [u8],
}

impl<'k> Place<'k> {
    pub fn of(ctx: &Ctx<'_>, key: &'k [u8]) -> Place<'k> {
        Place {
            tablet: ctx.node.tablet_of(key),
            slot: key_slot(key),
            key,
        }
    }

    pub(super) fn chunk_key(&self, gen: u64, id: u64) -> Vec<u8> {
        types::chunk_key(self.slot, self.key, gen, id)
    }
}

/// Reads chunk `id`.
fn read_chunk(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    gen: u64,
    id: u64,
) -> Result<ListChunk, LargeError> {
    read_decoded(ctx, place, gen, id, ListChunk::decode)
}

/// Reads chunk `id` through `decode` (decoded, or kept encoded).
pub(super) fn read_decoded<T>(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    gen: u64,
    id: u64,
    decode: impl FnOnce(&[u8]) -> Result<T, types::TypedError>,
) -> Result<T, LargeError> {
    let key = place.chunk_key(gen, id);
    let found = ctx
        .node
        .read_with(place.tablet, &key, &mut ctx.session.acks, |v, _, _| {
            decode(v)
        })?;
    match found {
        Some(Ok(c)) => Ok(c),
        Some(Err(e)) => Err(LargeError::Damaged(format!("chunk {id}: {e}"))),
        // A writer changed the list between the header and this read; the caller checks.
        None => Err(LargeError::Changed),
    }
}

/// The header's current version (None if the key is gone).
pub(super) fn header_version(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
) -> Result<Option<u64>, LargeError> {
    Ok(ctx.node.read_with(
        place.tablet,
        place.key,
        &mut ctx.session.acks,
        |_, version, _| version,
    )?)
}

/// Runs a read of a large list again while the list changes under it (at most 64 times).
fn consistent<R>(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    mut read: impl FnMut(&mut Ctx<'_>, Large) -> Result<R, LargeError>,
) -> Result<R, LargeError> {
    let mut large = large;
    for _ in 0..64 {
        match read(ctx, large) {
            Ok(r) if header_version(ctx, place)? == Some(large.version) => return Ok(r),
            Ok(_) | Err(LargeError::Changed) => {}
            Err(e) => return Err(e),
        }
        match super::read(ctx, place.key)? {
            Some(o) if types::is_large(&o.value) => large = Large::decode(&o)?,
            // It is no longer a large list: the caller reads it again from the start.
            _ => return Err(LargeError::Changed),
        }
    }
    Err(LargeError::Changed)
}

/// Items `from..=to` (0-based from the head), walking from the nearer end.
pub(super) fn range(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    from: u64,
    to: u64,
) -> Result<Vec<Vec<u8>>, LargeError> {
    consistent(ctx, place, large, |ctx, large| {
        let h = large.header;
        let mut out = Vec::with_capacity((to - from + 1).min(1 << 16) as usize);
        if from >= h.len || from > to {
            return Ok(out);
        }
        let to = to.min(h.len - 1);
        if h.len - 1 - to < from {
            // Nearer the tail: walk back to the chunk holding `to`, then collect backwards.
            let mut id = h.tail;
            let mut last = h.len; // index after the current chunk's last item
            let mut rev = Vec::new();
            while id != 0 && last > from {
                let c = read_chunk(ctx, place, h.gen, id)?;
                let first = last - c.items.len() as u64;
                for (i, item) in c.items.iter().enumerate().rev() {
                    let at = first + i as u64;
                    if at >= from && at <= to {
                        rev.push(item.clone());
                    }
                }
                last = first;
                id = c.prev;
            }
            rev.reverse();
            return Ok(rev);
        }
        let mut id = h.head;
        let mut first = 0u64;
        while id != 0 && first <= to {
            let c = read_chunk(ctx, place, h.gen, id)?;
            let end = first + c.items.len() as u64;
            if end > from {
                for (i, item) in c.items.iter().enumerate() {
                    let at = first + i as u64;
                    if at >= from && at <= to {
                        out.push(item.clone());
                    }
                }
            }
            first = end;
            id = c.next;
        }
        Ok(out)
    })
}

/// Every item, head first, and the ids of its chunks.
pub(super) fn materialize(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
) -> Result<(List, Vec<u64>), LargeError> {
    consistent(ctx, place, large, |ctx, large| {
        let h = large.header;
        let mut items = VecDeque::with_capacity(h.len.min(1 << 20) as usize);
        let mut ids = Vec::with_capacity(h.chunks.min(1 << 20) as usize);
        let mut id = h.head;
        while id != 0 {
            if ids.len() as u64 > h.chunks {
                return Err(LargeError::Damaged("the chunks form a loop".into()));
            }
            let c = read_chunk(ctx, place, h.gen, id)?;
            ids.push(id);
            items.extend(c.items);
            id = c.next;
        }
        if items.len() as u64 != h.len {
            return Err(LargeError::Damaged(format!(
                "the header counts {} items, the chunks hold {}",
                h.len,
                items.len()
            )));
        }
        Ok((List { items }, ids))
    })
}

/// What becomes of the header in a change.
pub(super) enum HeaderWrite {
    Large(LargeList),
    Small(Vec<u8>),
    Delete,
}

/// One atomic change of a large list: the header, chunks written and chunks deleted, on the
/// condition that the header is still at `condition`.
pub(super) struct Change {
    pub header: HeaderWrite,
    /// The header's expiry: None keeps the key's.
    pub expire: Option<u64>,
    pub condition: Condition,
    pub gen: u64,
    /// Chunks written: id and encoded chunk.
    pub puts: Vec<(u64, Vec<u8>)>,
    pub deletes: Vec<u64>,
}

/// Writes a change as one unit; returns the header's new version (None if nothing was written).
pub(super) fn commit(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    change: &Change,
) -> Result<Option<u64>, LargeError> {
    let header_bytes = match &change.header {
        HeaderWrite::Large(h) => Some(h.encode()),
        HeaderWrite::Small(b) => Some(b.clone()),
        HeaderWrite::Delete => None,
    };
    let chunk_keys: Vec<Vec<u8>> = change
        .puts
        .iter()
        .map(|(id, _)| place.chunk_key(change.gen, *id))
        .collect();
    let chunk_values: Vec<&[u8]> = change.puts.iter().map(|(_, c)| c.as_slice()).collect();
    let delete_keys: Vec<Vec<u8>> = change
        .deletes
        .iter()
        .map(|id| place.chunk_key(change.gen, *id))
        .collect();
    let mut items = Vec::with_capacity(1 + chunk_keys.len() + delete_keys.len());
    items.push(MultiWrite {
        key: place.key,
        op: match &header_bytes {
            Some(b) => MultiOp::Put {
                value: b,
                expire_at_ms: change.expire,
            },
            None => MultiOp::Delete,
        },
        condition: change.condition,
    });
    for (k, v) in chunk_keys.iter().zip(&chunk_values) {
        items.push(MultiWrite {
            key: k,
            op: MultiOp::Put {
                value: v,
                expire_at_ms: Some(0),
            },
            condition: Condition::None,
        });
    }
    for k in &delete_keys {
        items.push(MultiWrite {
            key: k,
            op: MultiOp::Delete,
            condition: Condition::None,
        });
    }
    let version = ctx
        .node
        .multi_write_if(place.tablet, &items, &mut ctx.session.acks)?;
    Ok(version)
}

pub(super) fn unit_bytes(puts: &[(u64, Vec<u8>)]) -> usize {
    puts.iter().map(|(_, c)| c.len() + 64).sum()
}

/// Most elements a chunk holds (a pop from the tail scans its elements' lengths).
const CHUNK_ITEMS_MAX: u64 = 256;

/// Reads chunk `id` encoded.
fn read_raw(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    gen: u64,
    id: u64,
) -> Result<RawChunk, LargeError> {
    read_decoded(ctx, place, gen, id, RawChunk::decode)
}

/// Pushes `items` at one end (each in turn, as LPUSH and RPUSH do); returns the new length. A
/// push of more than one unit's bytes is written in steps of a unit.
pub(super) fn push(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    left: bool,
    items: &[&[u8]],
) -> Result<u64, LargeError> {
    let mut h = large.header;
    let mut version = large.version;
    let mut cur_id = if left { h.head } else { h.tail };
    let mut cur = read_raw(ctx, place, h.gen, cur_id)?;
    let mut puts: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut pending = 0usize;
    let chunk = chunk_bytes(ctx);
    for (n, item) in items.iter().enumerate() {
        let full = cur.encoded_len() + item.len() > chunk || cur.count >= CHUNK_ITEMS_MAX;
        if full && cur.count > 0 {
            let id = h.next_id;
            h.next_id += 1;
            h.chunks += 1;
            let mut fresh = RawChunk::default();
            if left {
                fresh.next = cur_id;
                cur.prev = id;
                h.head = id;
            } else {
                fresh.prev = cur_id;
                cur.next = id;
                h.tail = id;
            }
            let done = std::mem::replace(&mut cur, fresh).encode();
            pending += done.len();
            puts.push((cur_id, done));
            cur_id = id;
        }
        if left {
            cur.push_front(item);
        } else {
            cur.push_back(item);
        }
        h.len += 1;
        h.bytes += item.len() as u64;
        if pending + cur.encoded_len() > UNIT_BYTES && n + 1 < items.len() {
            puts.push((cur_id, cur.encode()));
            let change = Change {
                header: HeaderWrite::Large(h),
                expire: None,
                condition: Condition::IfVersion(version),
                gen: h.gen,
                puts: std::mem::take(&mut puts),
                deletes: Vec::new(),
            };
            version = commit(ctx, place, &change)?.expect("a push writes");
            pending = 0;
        }
    }
    puts.push((cur_id, cur.encode()));
    let change = Change {
        header: HeaderWrite::Large(h),
        expire: None,
        condition: Condition::IfVersion(version),
        gen: h.gen,
        puts,
        deletes: Vec::new(),
    };
    commit(ctx, place, &change)?;
    Ok(h.len)
}

/// Pops up to `count` items from one end, nearest first. With `expect`, pops one item only if
/// it is that one (else nothing, and an empty answer). A list left empty is deleted; one left
/// small goes back to the compact form.
pub(super) fn pop(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    left: bool,
    count: usize,
    expect: Option<&[u8]>,
) -> Result<Vec<Vec<u8>>, LargeError> {
    let mut h = large.header;
    let mut cur_id = if left { h.head } else { h.tail };
    let mut cur = read_raw(ctx, place, h.gen, cur_id)?;
    if let Some(e) = expect {
        if cur.end(left) != Some(e) {
            return Ok(Vec::new());
        }
    }
    let mut out = Vec::with_capacity(count.min(1 << 16));
    let mut deletes = Vec::new();
    while out.len() < count && h.len > 0 {
        if cur.count == 0 {
            deletes.push(cur_id);
            h.chunks -= 1;
            cur_id = if left { cur.next } else { cur.prev };
            if cur_id == 0 {
                return Err(LargeError::Damaged(
                    "the chunks end before the header's count".into(),
                ));
            }
            cur = read_raw(ctx, place, h.gen, cur_id)?;
            continue;
        }
        let want = (count - out.len()).min(h.len as usize);
        let got = if left {
            cur.pop_front(want)
        } else {
            cur.pop_back(want)
        };
        for item in got {
            h.len -= 1;
            h.bytes = h.bytes.saturating_sub(item.len() as u64);
            out.push(item);
        }
    }
    let mut puts = Vec::new();
    let header = if h.len == 0 {
        deletes.push(cur_id);
        HeaderWrite::Delete
    } else {
        if cur.count == 0 {
            // Never leave an empty chunk: unlink it from its neighbour.
            deletes.push(cur_id);
            h.chunks -= 1;
            cur_id = if left { cur.next } else { cur.prev };
            cur = read_raw(ctx, place, h.gen, cur_id)?;
            if left {
                cur.prev = 0;
                h.head = cur_id;
            } else {
                cur.next = 0;
                h.tail = cur_id;
            }
        } else if left {
            h.head = cur_id;
            cur.prev = 0;
        } else {
            h.tail = cur_id;
            cur.next = 0;
        }
        if fits_small(ctx, &h) {
            deletes.push(cur_id);
            let mut items = ListChunk::decode(&cur.encode())
                .map_err(|e| LargeError::Damaged(e.to_string()))?
                .items;
            if h.chunks == 2 {
                // The other chunk's elements join them (it lies beyond this end's chunk).
                let other_id = if left { cur.next } else { cur.prev };
                let other = read_chunk(ctx, place, h.gen, other_id)?;
                deletes.push(other_id);
                if left {
                    items.extend(other.items);
                } else {
                    let mut all = other.items;
                    all.extend(items);
                    items = all;
                }
            }
            HeaderWrite::Small(List { items }.encode())
        } else {
            puts.push((cur_id, cur.encode()));
            HeaderWrite::Large(h)
        }
    };
    let change = Change {
        header,
        expire: None,
        condition: Condition::IfVersion(large.version),
        gen: h.gen,
        puts,
        deletes,
    };
    commit(ctx, place, &change)?;
    Ok(out)
}

/// Writes `list` at the key in whichever form its size calls for, replacing what the key holds
/// at `condition` (the chunks `old` of a large list there are deleted; `growing` as for
/// [`wants_large`]). A list larger than one
/// unit is written as new chunks first and switched to by a last unit with the header.
pub(super) fn write(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    list: &List,
    condition: Condition,
    expire: Option<u64>,
    old: Option<(u64, Vec<u64>)>,
    growing: Option<&[u8]>,
) -> Result<(), LargeError> {
    let (old_gen, old_ids) = old.unwrap_or((0, Vec::new()));
    if !wants_large(ctx, &list.items, growing) {
        let mut change = Change {
            header: if list.items.is_empty() {
                HeaderWrite::Delete
            } else {
                HeaderWrite::Small(list.encode())
            },
            expire,
            condition,
            gen: old_gen,
            puts: Vec::new(),
            deletes: old_ids,
        };
        return delete_in_units(ctx, place, &mut change);
    }
    let gen = random_gen();
    let mut h = LargeList {
        gen,
        len: list.items.len() as u64,
        ..LargeList::default()
    };
    let mut chunks: Vec<ListChunk> = Vec::new();
    let mut cur = ListChunk::default();
    let mut cur_bytes = 0usize;
    let chunk = chunk_bytes(ctx);
    for item in &list.items {
        let full = cur_bytes + item.len() > chunk || cur.items.len() as u64 >= CHUNK_ITEMS_MAX;
        if full && !cur.items.is_empty() {
            chunks.push(std::mem::take(&mut cur));
            cur_bytes = 0;
        }
        cur.items.push_back(item.clone());
        cur_bytes += item.len();
        h.bytes += item.len() as u64;
    }
    chunks.push(cur);
    let n = chunks.len() as u64;
    h.chunks = n;
    h.head = 1;
    h.tail = n;
    h.next_id = n + 1;
    let puts: Vec<(u64, Vec<u8>)> = chunks
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            let id = i as u64 + 1;
            c.prev = id - 1;
            c.next = if id == n { 0 } else { id + 1 };
            (id, c.encode())
        })
        .collect();
    if unit_bytes(&puts) <= UNIT_BYTES {
        // One unit: the new chunks and header; the old chunks go in the same unit or after it.
        let change = Change {
            header: HeaderWrite::Large(h),
            expire,
            condition,
            gen,
            puts,
            deletes: Vec::new(),
        };
        commit(ctx, place, &change)?;
    } else {
        let building = (place.key.to_vec(), gen);
        BUILDING.lock().insert(building.clone());
        let written = write_chunks(ctx, place, gen, &puts);
        let switched = written.and_then(|()| {
            let change = Change {
                header: HeaderWrite::Large(h),
                expire,
                condition,
                gen,
                puts: Vec::new(),
                deletes: Vec::new(),
            };
            commit(ctx, place, &change)
        });
        BUILDING.lock().remove(&building);
        if let Err(e) = switched {
            // Nothing names the new chunks: take them back (the sweep would, later).
            let ids: Vec<u64> = puts.iter().map(|(id, _)| *id).collect();
            delete_chunks(ctx, place, gen, &ids);
            return Err(e);
        }
    }
    if !old_ids.is_empty() {
        delete_chunks(ctx, place, old_gen, &old_ids);
    }
    Ok(())
}

/// Writes chunks with no header change, a unit at a time.
pub(super) fn write_chunks(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    gen: u64,
    puts: &[(u64, Vec<u8>)],
) -> Result<(), LargeError> {
    let mut start = 0;
    while start < puts.len() {
        let mut end = start;
        let mut bytes = 0;
        while end < puts.len() && (end == start || bytes < UNIT_BYTES) {
            bytes += unit_bytes(&puts[end..end + 1]);
            end += 1;
        }
        let keys: Vec<Vec<u8>> = puts[start..end]
            .iter()
            .map(|(id, _)| place.chunk_key(gen, *id))
            .collect();
        let values: Vec<&[u8]> = puts[start..end].iter().map(|(_, c)| c.as_slice()).collect();
        let items: Vec<MultiWrite<'_>> = keys
            .iter()
            .zip(&values)
            .map(|(k, v)| MultiWrite {
                key: k,
                op: MultiOp::Put {
                    value: v,
                    expire_at_ms: Some(0),
                },
                condition: Condition::None,
            })
            .collect();
        ctx.node
            .multi_write_if(place.tablet, &items, &mut ctx.session.acks)?;
        start = end;
    }
    Ok(())
}

/// Tombstones (a key and a header) per unit of deletes.
pub(super) const DELETES_PER_UNIT: usize = 16 * 1024;

/// A change whose deletes may not fit one unit: the first unit carries the header and as many
/// deletes as fit, the rest follow (chunks no header names any more).
pub(super) fn delete_in_units(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    change: &mut Change,
) -> Result<(), LargeError> {
    let rest = if change.deletes.len() > DELETES_PER_UNIT {
        change.deletes.split_off(DELETES_PER_UNIT)
    } else {
        Vec::new()
    };
    commit(ctx, place, change)?;
    delete_chunks(ctx, place, change.gen, &rest);
    Ok(())
}

/// Deletes chunks that no header names (best effort: what a failure leaves, [`sweep`] finds).
pub(super) fn delete_chunks(ctx: &mut Ctx<'_>, place: Place<'_>, gen: u64, ids: &[u64]) {
    for part in ids.chunks(DELETES_PER_UNIT) {
        let keys: Vec<Vec<u8>> = part.iter().map(|id| place.chunk_key(gen, *id)).collect();
        let items: Vec<MultiWrite<'_>> = keys
            .iter()
            .map(|k| MultiWrite {
                key: k,
                op: MultiOp::Delete,
                condition: Condition::None,
            })
            .collect();
        if let Err(e) = ctx
            .node
            .multi_write_if(place.tablet, &items, &mut ctx.session.acks)
        {
            tracing::warn!(error = %e, "deleting a large list's old chunks failed; the sweep will");
            return;
        }
    }
}

/// Deletes a large list: its header and chunks (DEL, UNLINK, and the commands that replace a
/// key). `condition` is the header's.
pub(super) fn delete(ctx: &mut Ctx<'_>, place: Place<'_>, large: Large) -> Result<(), LargeError> {
    let (_, ids) = materialize_ids(ctx, place, large)?;
    let mut change = Change {
        header: HeaderWrite::Delete,
        expire: None,
        condition: Condition::IfVersion(large.version),
        gen: large.header.gen,
        puts: Vec::new(),
        deletes: ids,
    };
    delete_in_units(ctx, place, &mut change)
}

/// The chunk ids of a large list, head first, read from the chunks' links (no items copied).
fn materialize_ids(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
) -> Result<(Large, Vec<u64>), LargeError> {
    consistent(ctx, place, large, |ctx, large| {
        let h = large.header;
        let mut ids = Vec::with_capacity(h.chunks.min(1 << 20) as usize);
        let mut id = h.head;
        while id != 0 {
            if ids.len() as u64 > h.chunks {
                return Err(LargeError::Damaged("the chunks form a loop".into()));
            }
            let key = place.chunk_key(h.gen, id);
            let next =
                ctx.node
                    .read_with(place.tablet, &key, &mut ctx.session.acks, |v, _, _| {
                        ListChunk::decode(v).map(|c| c.next)
                    })?;
            ids.push(id);
            id = match next {
                Some(Ok(n)) => n,
                Some(Err(e)) => return Err(LargeError::Damaged(format!("chunk {id}: {e}"))),
                None => return Err(LargeError::Changed),
            };
        }
        Ok((large, ids))
    })
}

/// The bytes a large list takes in the log: its header's entry and every chunk's.
pub(super) fn memory_usage(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
) -> Result<u64, LargeError> {
    let (large, ids) = materialize_ids(ctx, place, large)?;
    chunks_in_log(ctx, place, large.header.gen, ids)
}

/// The bytes chunks `ids` of generation `gen` take in the log: each entry and its index slot
/// (an absent chunk counts nothing).
pub(super) fn chunks_in_log(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    gen: u64,
    ids: impl IntoIterator<Item = u64>,
) -> Result<u64, LargeError> {
    let mut total = 0u64;
    for id in ids {
        let key = place.chunk_key(gen, id);
        let len = ctx.node.read_with(
            place.tablet,
            &key,
            &mut ctx.session.acks,
            |v, version, expiry| {
                ramlog_logmem::entry::encoded_len(
                    ramlog_logmem::entry::KIND_OBJECT,
                    version,
                    key.len(),
                    v.len(),
                    expiry,
                )
            },
        )?;
        total += len.unwrap_or(0) as u64 + 8;
    }
    Ok(total)
}

/// Deletes the chunks in `tablet` that no header names: the key holds no large list of their
/// generation (it was deleted, overwritten or expired, or a rewrite stopped half way). Each
/// group is deleted in a unit conditional on the header's state as checked, so a list written
/// in between keeps its chunks. Returns the chunks deleted.
pub fn sweep(node: &Node, tablet: TabletId) -> Result<u64, NodeError> {
    let engine = node.engine();
    let mut acks = crate::node::Acks::default();
    let mut cursor = 0u64;
    let mut groups: HashMap<(Vec<u8>, u64, u16), Vec<Vec<u8>>> = HashMap::new();
    let mut batch = Vec::new();
    loop {
        batch.clear();
        cursor = engine.scan_keys(tablet, cursor, 1024, &mut batch)?;
        for k in batch.drain(..) {
            if let Some((slot, key, gen, _)) = types::parse_chunk_key(&k) {
                groups
                    .entry((key.to_vec(), gen, slot))
                    .or_default()
                    .push(k.clone());
            }
        }
        if cursor == 0 {
            break;
        }
    }
    let mut deleted = 0u64;
    for ((key, gen, _slot), chunks) in groups {
        let header = node.read_with(tablet, &key, &mut acks, |v, version, _| {
            let live = types::large_gen(v) == Some(gen);
            (live, version)
        })?;
        let condition = match header {
            Some((true, _)) => continue,
            Some((false, version)) => Condition::IfVersion(version),
            None => Condition::IfAbsent,
        };
        if BUILDING.lock().contains(&(key.clone(), gen)) {
            continue;
        }
        for part in chunks.chunks(DELETES_PER_UNIT) {
            let mut items = Vec::with_capacity(part.len() + 1);
            items.push(MultiWrite {
                key: &key,
                op: MultiOp::Check,
                condition,
            });
            items.extend(part.iter().map(|k| MultiWrite {
                key: k,
                op: MultiOp::Delete,
                condition: Condition::None,
            }));
            match node.multi_write_if(tablet, &items, &mut acks) {
                Ok(_) => deleted += part.len() as u64,
                Err(NodeError::Engine(EngineError::ConditionFailed { .. })) => break,
                Err(e) => return Err(e),
            }
        }
    }
    Ok(deleted)
}

/// The key's large list, if it holds one; Err(Changed) when it changed while being read.
fn large_at(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<Option<(Object, Large)>, LargeError> {
    match super::read(ctx, key)? {
        Some(o) if types::large_kind(&o.value) == Some(types::Kind::List) => {
            let large = Large::decode(&o)?;
            Ok(Some((o, large)))
        }
        _ => Ok(None),
    }
}

/// Runs `op` on the key's large list (again while it changes); None if it holds none. Errors
/// are answered.
fn with_large<R>(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    mut op: impl FnMut(&mut Ctx<'_>, Place<'_>, &Object, Large) -> Result<R, LargeError>,
) -> Result<Option<R>, super::typed::Replied> {
    for _ in 0..64 {
        let found = match large_at(ctx, key) {
            Ok(f) => f,
            Err(LargeError::Changed) => continue,
            Err(e) => {
                reply_error(ctx, e);
                return Err(super::typed::Replied);
            }
        };
        let Some((object, large)) = found else {
            return Ok(None);
        };
        let place = Place::of(ctx, key);
        match op(ctx, place, &object, large) {
            Ok(r) => return Ok(Some(r)),
            Err(LargeError::Changed) => continue,
            Err(e) => {
                reply_error(ctx, e);
                return Err(super::typed::Replied);
            }
        }
    }
    reply_error(ctx, LargeError::Changed);
    Err(super::typed::Replied)
}

/// Whether the key holds a large list: one index lookup, no value copied (the check the
/// commands make before taking a large list's path). A read error is answered.
pub(super) fn holds_large(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<bool, super::typed::Replied> {
    Ok(large_kind_at(ctx, key)? == Some(types::Kind::List))
}

/// The kind of the large collection at the key (None: absent, compact, or a string): one
/// index lookup, no value copied. A read error is answered.
pub(super) fn large_kind_at(
    ctx: &mut Ctx<'_>,
    key: &[u8],
) -> Result<Option<types::Kind>, super::typed::Replied> {
    let node = ctx.node;
    let large = node.read_with(
        node.tablet_of(key),
        key,
        &mut ctx.session.acks,
        |v, _, _| types::large_kind(v),
    );
    match large {
        Ok(found) => Ok(found.flatten()),
        Err(e) => {
            engine_error(ctx, &e);
            Err(super::typed::Replied)
        }
    }
}

/// DEL and UNLINK of a large collection: its header and chunks. False if the key holds none.
pub(super) fn delete_if_large(
    ctx: &mut Ctx<'_>,
    key: &[u8],
) -> Result<bool, super::typed::Replied> {
    match large_kind_at(ctx, key)? {
        None => Ok(false),
        Some(types::Kind::List) => {
            with_large(ctx, key, |ctx, place, _, large| delete(ctx, place, large))
                .map(|r| r.is_some())
        }
        Some(types::Kind::ZSet) => super::large_zset::on_large(ctx, key, false, |ctx, place, l| {
            super::large_zset::delete(ctx, place, l)
        })
        .map(|r| r.is_some()),
        Some(kind) => super::large_table::on_table(ctx, key, kind, false, |ctx, place, table| {
            super::large_table::delete(ctx, place, table)
        })
        .map(|r| r.is_some()),
    }
}

/// What a large collection's chunks take in the log (0 for any other value), for MEMORY USAGE.
pub(super) fn memory_of(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<u64, super::typed::Replied> {
    match large_kind_at(ctx, key)? {
        None => Ok(0),
        Some(types::Kind::List) => with_large(ctx, key, |ctx, place, _, large| {
            memory_usage(ctx, place, large)
        })
        .map(Option::unwrap_or_default),
        Some(types::Kind::ZSet) => super::large_zset::on_large(ctx, key, false, |ctx, place, l| {
            super::large_zset::memory_usage(ctx, place, l)
        })
        .map(Option::unwrap_or_default),
        Some(kind) => super::large_table::on_table(ctx, key, kind, false, |ctx, place, table| {
            super::large_table::memory_usage(ctx, place, table)
        })
        .map(Option::unwrap_or_default),
    }
}

/// RENAME and COPY of a large list: its items written at `dst` in the form their size calls
/// for, with `expire_at_ms`, on `condition` at `dst`. Some(false) when that condition failed,
/// None when `src` holds no large list.
pub(super) fn copy_to(
    ctx: &mut Ctx<'_>,
    src: &[u8],
    src_object: &Object,
    dst: &[u8],
    condition: Condition,
) -> Result<bool, LargeError> {
    let expire = Some(src_object.expire_at_ms);
    if condition == Condition::None {
        // What the destination held goes; a large collection there takes its chunks along.
        if let Some(o) = super::read(ctx, dst)? {
            match types::large_kind(&o.value) {
                None => {}
                Some(types::Kind::List) => delete(ctx, Place::of(ctx, dst), Large::decode(&o)?)?,
                Some(types::Kind::ZSet) => super::large_zset::delete(
                    ctx,
                    Place::of(ctx, dst),
                    super::large_zset::decode(&o)?,
                )?,
                Some(_) => super::large_table::delete(
                    ctx,
                    Place::of(ctx, dst),
                    super::large_table::decode(&o)?,
                )?,
            }
        }
    }
    if types::large_kind(&src_object.value) == Some(types::Kind::ZSet) {
        let large = super::large_zset::decode(src_object)?;
        let entries = super::large_zset::entries(ctx, Place::of(ctx, src), large)?;
        return match super::large_zset::write(
            ctx,
            Place::of(ctx, dst),
            &entries,
            condition,
            expire,
            None,
        ) {
            Ok(()) => Ok(true),
            Err(LargeError::Changed) if condition == Condition::IfAbsent => Ok(false),
            Err(e) => Err(e),
        };
    }
    if let Some(kind @ (types::Kind::Hash | types::Kind::Set)) =
        types::large_kind(&src_object.value)
    {
        let table = super::large_table::decode(src_object)?;
        let entries = super::large_table::entries(ctx, Place::of(ctx, src), table)?;
        let entries: Vec<(&[u8], &[u8])> = entries
            .iter()
            .map(|(m, v)| (m.as_slice(), v.as_slice()))
            .collect();
        return match super::large_table::write(
            ctx,
            Place::of(ctx, dst),
            kind,
            &entries,
            condition,
            expire,
            None,
        ) {
            Ok(()) => Ok(true),
            Err(LargeError::Changed) if condition == Condition::IfAbsent => Ok(false),
            Err(e) => Err(e),
        };
    }
    let large = Large::decode(src_object)?;
    let (list, _) = materialize(ctx, Place::of(ctx, src), large)?;
    match write(
        ctx,
        Place::of(ctx, dst),
        &list,
        condition,
        expire,
        None,
        None,
    ) {
        Ok(()) => Ok(true),
        Err(LargeError::Changed) if condition == Condition::IfAbsent => Ok(false),
        Err(e) => Err(e),
    }
}

/// Deletes the large list at `key` if it is still at `version` (RENAME's last step); false if
/// it changed.
pub(super) fn delete_at_version(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    object: &Object,
) -> Result<bool, LargeError> {
    let deleted = if types::large_kind(&object.value) == Some(types::Kind::List) {
        delete(ctx, Place::of(ctx, key), Large::decode(object)?)
    } else if types::large_kind(&object.value) == Some(types::Kind::ZSet) {
        super::large_zset::delete(ctx, Place::of(ctx, key), super::large_zset::decode(object)?)
    } else {
        super::large_table::delete(
            ctx,
            Place::of(ctx, key),
            super::large_table::decode(object)?,
        )
    };
    match deleted {
        Ok(()) => Ok(true),
        Err(LargeError::Changed) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Starts the thread that runs [`sweep`] every `large_sweep_interval_ms` over the tablets this server
/// serves as their master and that hold chunks (a mirror's copy follows its master; a tablet
/// being restored, moved, split or merged is left until it is served whole). It ends with the
/// node.
pub(crate) fn start_sweeper(
    node: &std::sync::Arc<Node>,
    roles: Option<std::sync::Arc<crate::cluster::Roles>>,
) {
    let weak = std::sync::Arc::downgrade(node);
    let interval = std::time::Duration::from_millis(node.config.large_sweep_interval_ms);
    let spawned = std::thread::Builder::new()
        .name("ramlog-sweep".into())
        .spawn(move || loop {
            std::thread::sleep(interval);
            let Some(node) = weak.upgrade() else {
                return;
            };
            for tablet in node.keyspace.tablets().iter().copied() {
                if node.keyspace.is_hidden(tablet)
                    || node.engine().internal_count(tablet).unwrap_or(0) == 0
                    || !served_whole(&node, roles.as_deref(), tablet)
                {
                    continue;
                }
                match sweep(&node, tablet) {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(tablet, chunks = n, "deleted chunks of large lists that no key names any more"),
                    Err(e) => tracing::warn!(tablet, error = %e, "the sweep of unnamed chunks failed; it runs again later"),
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the sweep of unnamed chunks; they stay until the key's tablet is rewritten");
    }
}

/// Whether this server masters `tablet` and serves it whole: standalone, always; in a cluster,
/// when the map names it master of exactly that range with no restore, move, split or merge
/// under way.
pub(super) fn served_whole(
    node: &Node,
    roles: Option<&crate::cluster::Roles>,
    tablet: TabletId,
) -> bool {
    let Some(roles) = roles else {
        return true;
    };
    let Some(member) = roles.member() else {
        return false;
    };
    let Some(info) = node.engine().tablets().into_iter().find(|t| t.id == tablet) else {
        return false;
    };
    let view = member.view();
    view.map.tablets.iter().any(|t| {
        t.table == info.table
            && t.first_slot == info.first_slot
            && t.last_slot == info.last_slot
            && t.master == view.me
            && !t.recovering
            && t.restorer.is_none()
            && t.migration.is_none()
            && t.split.is_none()
            && t.merge.is_none()
            && t.logs_from.is_none()
    })
}

/// A chunk found by an element's index: its id, the index of its first element, and the chunk.
struct Found {
    id: u64,
    first: u64,
    chunk: ListChunk,
}

/// The chunk that holds element `index` (< len), walking from the head or from the tail; the
/// chunks passed on the way (id, item bytes) are added to `passed`.
fn locate(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    h: &LargeList,
    index: u64,
    from_head: bool,
    passed: &mut Vec<(u64, u64)>,
) -> Result<Found, LargeError> {
    if from_head {
        let (mut id, mut first) = (h.head, 0u64);
        loop {
            let chunk = read_chunk(ctx, place, h.gen, id)?;
            let end = first + chunk.items.len() as u64;
            if index < end {
                return Ok(Found { id, first, chunk });
            }
            passed.push((id, chunk.item_bytes()));
            if chunk.next == 0 || passed.len() as u64 > h.chunks {
                return Err(LargeError::Damaged(
                    "the chunks end before the header's count".into(),
                ));
            }
            (id, first) = (chunk.next, end);
        }
    }
    let (mut id, mut end) = (h.tail, h.len);
    loop {
        let chunk = read_chunk(ctx, place, h.gen, id)?;
        let first = end.checked_sub(chunk.items.len() as u64).ok_or_else(|| {
            LargeError::Damaged("the chunks hold more than the header's count".into())
        })?;
        if index >= first {
            return Ok(Found { id, first, chunk });
        }
        passed.push((id, chunk.item_bytes()));
        if chunk.prev == 0 || passed.len() as u64 > h.chunks {
            return Err(LargeError::Damaged(
                "the chunks end before the header's count".into(),
            ));
        }
        (id, end) = (chunk.prev, first);
    }
}

/// LSET of a large list: rewrites the element's chunk and the header. False (nothing written)
/// when the new element would make its chunk larger than one object may be.
pub(super) fn set(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    index: u64,
    value: &[u8],
) -> Result<bool, LargeError> {
    let mut h = large.header;
    let from_head = index < h.len / 2;
    let mut found = locate(ctx, place, &h, index, from_head, &mut Vec::new())?;
    let at = (index - found.first) as usize;
    let old = std::mem::replace(&mut found.chunk.items[at], value.to_vec());
    if found.chunk.item_bytes() as usize + 3 * found.chunk.items.len() + 32
        > ctx.node.config.value_size_max_bytes as usize
    {
        return Ok(false);
    }
    h.bytes = h.bytes.saturating_sub(old.len() as u64) + value.len() as u64;
    let change = if h.chunks == 1 && fits_small(ctx, &h) {
        // Smaller now: back to the compact form (as Redis converts after LSET).
        Change {
            header: HeaderWrite::Small(
                List {
                    items: found.chunk.items,
                }
                .encode(),
            ),
            expire: None,
            condition: Condition::IfVersion(large.version),
            gen: h.gen,
            puts: Vec::new(),
            deletes: vec![found.id],
        }
    } else {
        Change {
            header: HeaderWrite::Large(h),
            expire: None,
            condition: Condition::IfVersion(large.version),
            gen: h.gen,
            puts: vec![(found.id, found.chunk.encode())],
            deletes: Vec::new(),
        }
    };
    commit(ctx, place, &change)?;
    Ok(true)
}

/// LTRIM of a large list to elements `a..=b` (a <= b < len): the chunks wholly outside are
/// deleted, the two at the edges cut, the rest untouched.
pub(super) fn trim(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    a: u64,
    b: u64,
) -> Result<(), LargeError> {
    let mut h = large.header;
    let mut before = Vec::new();
    let head = locate(ctx, place, &h, a, true, &mut before)?;
    // From the tail too, so that the chunks after `b` are deleted even when `b` is in the
    // head's chunk.
    let mut after = Vec::new();
    let tail = locate(ctx, place, &h, b, false, &mut after)?;
    let tail = (tail.id != head.id).then_some(tail);
    let mut deletes = Vec::with_capacity(before.len() + after.len());
    for (id, bytes) in before.iter().chain(&after) {
        deletes.push(*id);
        h.bytes = h.bytes.saturating_sub(*bytes);
        h.chunks -= 1;
    }
    let cut = |chunk: &mut ListChunk, keep_from: usize, keep_to: usize, bytes: &mut u64| {
        let dropped: u64 = chunk
            .items
            .iter()
            .enumerate()
            .filter(|(i, _)| *i < keep_from || *i > keep_to)
            .map(|(_, item)| item.len() as u64)
            .sum();
        *bytes = bytes.saturating_sub(dropped);
        chunk.items.truncate(keep_to + 1);
        chunk.items.drain(..keep_from);
    };
    let mut puts = Vec::new();
    let mut head_chunk = head.chunk;
    head_chunk.prev = 0;
    h.head = head.id;
    let mut tail_items = None;
    match tail {
        None => {
            let from = (a - head.first) as usize;
            let to = (b - head.first) as usize;
            cut(&mut head_chunk, from, to, &mut h.bytes);
            head_chunk.next = 0;
            h.tail = head.id;
        }
        Some(mut t) => {
            let last = head_chunk.items.len() - 1;
            cut(
                &mut head_chunk,
                (a - head.first) as usize,
                last,
                &mut h.bytes,
            );
            cut(&mut t.chunk, 0, (b - t.first) as usize, &mut h.bytes);
            t.chunk.next = 0;
            h.tail = t.id;
            tail_items = Some((t.id, t.chunk));
        }
    }
    h.len = b - a + 1;
    // The chunks between the two edges stay as they are; `h.chunks` counts what is left.
    let header = if fits_small(ctx, &h) {
        deletes.push(head.id);
        let mut items = head_chunk.items;
        if let Some((id, t)) = tail_items {
            deletes.push(id);
            items.extend(t.items);
        }
        HeaderWrite::Small(List { items }.encode())
    } else {
        if let Some((id, t)) = tail_items {
            puts.push((id, t.encode()));
        }
        puts.push((head.id, head_chunk.encode()));
        HeaderWrite::Large(h)
    };
    let mut change = Change {
        header,
        expire: None,
        condition: Condition::IfVersion(large.version),
        gen: h.gen,
        puts,
        deletes,
    };
    delete_in_units(ctx, place, &mut change)
}
