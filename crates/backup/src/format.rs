//! Byte layouts of everything the backup writes: log entries, blocks, primary-log runs,
//! version-log blocks and the manifest. Encoders write into caller-owned buffers; decoders take
//! untrusted bytes and never panic, never index out of bounds and never allocate by a length read
//! from disk (they are fuzzed by `fuzz/fuzz_targets/decode.rs`). `docs/formats.md` mirrors this file.

use ramlog_common::varint::{len as varint_len, put as put_varint};
use thiserror::Error;

/// Page size for O_DIRECT alignment: every block starts and ends on a page boundary.
pub const PAGE_BYTES: usize = 4096;

/// Kind byte of a put entry. 0 is never a valid kind: it marks the end of data.
pub const KIND_PUT: u8 = 1;
/// Kind byte of a delete record (only in the write buffer and the primary log).
pub const KIND_DELETE: u8 = 2;

/// Entry header: kind u8 | crc32c u32 | key_len varint | value_len varint | version varint |
/// expiry varint (LEB128: 7 bits a byte, low bits first). The CRC covers everything after it.
/// 100 B keys and values at version 10^6 without expiry: 1 + 4 + 1 + 1 + 3 + 1 = 11 bytes.
pub const ENTRY_HEADER_MIN_BYTES: usize = 9;
/// Longest header: a key length up to 64 KiB takes 3 bytes, a value length (u32) 5, version and
/// expiry (u64) 10 each.
pub const ENTRY_HEADER_MAX_BYTES: usize = 1 + 4 + 3 + 5 + 10 + 10;
/// Largest key the backup accepts (DESIGN.md: keys up to 64 KiB).
pub const KEY_MAX_BYTES: usize = ramlog_common::KEY_SIZE_FORMAT_MAX_BYTES;

/// Block header size; the body follows at this offset.
pub const BLOCK_HEADER_BYTES: usize = 48;
/// "RLBK" little-endian.
pub const BLOCK_MAGIC: u32 = 0x4B42_4C52;
/// Block kinds.
pub const BLOCK_SECONDARY: u8 = 1;
pub const BLOCK_PRIMARY: u8 = 2;
pub const BLOCK_COMPACTED: u8 = 3;

/// Primary-log run header: tablet u64 | body_len u32 | flags u32.
pub const RUN_HEADER_BYTES: usize = 16;
/// Run flag: the tablet was dropped at this block's sequence number (body is empty).
pub const RUN_FLAG_DROP: u32 = 1;

/// Write-buffer batch record header: tablet u64 | body_len u32 | count u32.
pub const BATCH_HEADER_BYTES: usize = 16;

/// Version-log block header: magic u32 | crc u32 | count u32 | copy u32 | seq u64.
pub const VERSION_BLOCK_HEADER_BYTES: usize = 24;
/// `copy` of a version block: the block, and the mirror of its delete records that follows it. A
/// delete lives only in the version log, so one damaged block must not let deleted keys come back;
/// a lost put record alone loses nothing (the data entry carries its version).
pub const VERSION_COPY_FIRST: u32 = 0;
pub const VERSION_COPY_MIRROR: u32 = 1;
/// "RLVL" little-endian.
pub const VERSION_MAGIC: u32 = 0x4C56_4C52;
/// Version record: hash u128 | version u64 | flags u8.
pub const VERSION_RECORD_BYTES: usize = 25;
/// Upper bound on records per version block (bounds decoder work and writer buffers).
pub const VERSION_BLOCK_RECORDS_MAX: usize = 1 << 16;

/// Errors of the decoders. Each says what was wrong; none carries untrusted data.
#[derive(Debug, Error, PartialEq, Eq, Clone, Copy)]
pub enum DecodeError {
    #[error("end of data (zero kind byte or not enough bytes for a header)")]
    End,
    #[error("entry header is truncated")]
    TruncatedHeader,
    #[error("entry kind byte {0} is unknown")]
    BadKind(u8),
    #[error("entry length fields point past the end of the buffer")]
    TruncatedBody,
    #[error("entry key is longer than the 64 KiB limit")]
    KeyTooLong,
    #[error("entry header field is an overlong or overflowing varint")]
    BadVarint,
    #[error("entry checksum mismatch")]
    BadChecksum,
    #[error("block magic mismatch")]
    BadMagic,
    #[error("written by an earlier ramlog whose entry format (fixed 29-byte headers) this version does not read")]
    OldFormat,
    #[error("block header checksum mismatch")]
    BadHeaderChecksum,
    #[error("block body length exceeds the space available")]
    BadLength,
    #[error("version block checksum mismatch")]
    BadVersionChecksum,
    #[error("version block copy number is neither 0 (block) nor 1 (mirror)")]
    BadVersionCopy,
}

#[inline]
fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

#[inline]
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Rounds up to the next page boundary.
#[inline]
pub fn page_align_up(n: usize) -> usize {
    n.div_ceil(PAGE_BYTES) * PAGE_BYTES
}

/// Reads a varint of at most `max_bytes` bytes at `*pos`, whose value must be at most `max`.
#[inline]
fn get_varint(buf: &[u8], pos: &mut usize, max_bytes: usize, max: u64) -> Result<u64, DecodeError> {
    let mut value: u64 = 0;
    for i in 0..max_bytes {
        let Some(&b) = buf.get(*pos) else {
            return Err(DecodeError::TruncatedHeader);
        };
        *pos += 1;
        let bits = (b & 0x7F) as u64;
        // The tenth byte of a u64 carries its top bit only.
        if i == 9 && bits > 1 {
            return Err(DecodeError::BadVarint);
        }
        value |= bits << (7 * i);
        if b & 0x80 == 0 {
            // One encoding per value (a trailing zero byte is not one), so an entry's length
            // is always `entry_bytes` of its fields.
            return if value > max || (i > 0 && b == 0) {
                Err(DecodeError::BadVarint)
            } else {
                Ok(value)
            };
        }
    }
    Err(DecodeError::BadVarint)
}

/// Header length of an entry with these fields.
#[inline]
pub fn entry_header_bytes(key_len: usize, value_len: usize, version: u64, expiry: u64) -> usize {
    5 + varint_len(key_len as u64)
        + varint_len(value_len as u64)
        + varint_len(version)
        + varint_len(expiry)
}

/// Encoded size of one entry.
#[inline]
pub fn entry_bytes(key_len: usize, value_len: usize, version: u64, expiry: u64) -> usize {
    entry_header_bytes(key_len, value_len, version, expiry) + key_len + value_len
}

/// Largest encoded size of an entry with this key and value, whatever its version and expiry.
#[inline]
pub fn entry_bytes_max(key_len: usize, value_len: usize) -> usize {
    entry_bytes(key_len, value_len, u64::MAX, u64::MAX)
}

/// One decoded entry, borrowing key and value from the buffer it was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryRef<'a> {
    pub kind: u8,
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub version: u64,
    pub expiry: u64,
}

impl EntryRef<'_> {
    pub fn is_delete(&self) -> bool {
        self.kind == KIND_DELETE
    }
    pub fn encoded_len(&self) -> usize {
        entry_bytes(self.key.len(), self.value.len(), self.version, self.expiry)
    }
}

/// Appends one entry (header with CRC32C, key, value) to `out`.
pub fn encode_entry(
    out: &mut Vec<u8>,
    kind: u8,
    key: &[u8],
    value: &[u8],
    version: u64,
    expiry: u64,
) {
    debug_assert!(kind == KIND_PUT || kind == KIND_DELETE);
    debug_assert!(key.len() <= KEY_MAX_BYTES);
    let start = out.len();
    let mut h = [0u8; ENTRY_HEADER_MAX_BYTES];
    h[0] = kind;
    let mut n = 5;
    n = put_varint(&mut h, n, key.len() as u64);
    n = put_varint(&mut h, n, value.len() as u64);
    n = put_varint(&mut h, n, version);
    n = put_varint(&mut h, n, expiry);
    out.extend_from_slice(&h[..n]);
    out.extend_from_slice(key);
    out.extend_from_slice(value);
    let crc = crc32c::crc32c(&out[start + 5..]);
    out[start + 1..start + 5].copy_from_slice(&crc.to_le_bytes());
}

/// Parses the entry at the start of `buf`, checking its checksum if `verify`.
#[inline]
fn parse_entry(buf: &[u8], verify: bool) -> Result<(EntryRef<'_>, usize), DecodeError> {
    let Some(&kind) = buf.first() else {
        return Err(DecodeError::End);
    };
    if kind == 0 {
        return Err(DecodeError::End);
    }
    if buf.len() < ENTRY_HEADER_MIN_BYTES {
        return Err(DecodeError::TruncatedHeader);
    }
    if kind != KIND_PUT && kind != KIND_DELETE {
        return Err(DecodeError::BadKind(kind));
    }
    let crc = u32_at(buf, 1);
    let mut at = 5usize;
    let key_len = get_varint(buf, &mut at, 3, u64::MAX)? as usize;
    if key_len > KEY_MAX_BYTES {
        return Err(DecodeError::KeyTooLong);
    }
    let value_len = get_varint(buf, &mut at, 5, u32::MAX as u64)? as usize;
    let version = get_varint(buf, &mut at, 10, u64::MAX)?;
    let expiry = get_varint(buf, &mut at, 10, u64::MAX)?;
    let total = at
        .checked_add(key_len)
        .and_then(|n| n.checked_add(value_len))
        .ok_or(DecodeError::TruncatedBody)?;
    if total > buf.len() {
        return Err(DecodeError::TruncatedBody);
    }
    if verify && crc32c::crc32c(&buf[5..total]) != crc {
        return Err(DecodeError::BadChecksum);
    }
    let entry = EntryRef {
        kind,
        key: &buf[at..at + key_len],
        value: &buf[at + key_len..total],
        version,
        expiry,
    };
    Ok((entry, total))
}

/// Reads only the lengths of the entry at the start of `buf` (no checksum check). Used on data
/// this process wrote itself (the write buffer) where the checksum was computed moments ago.
#[inline]
pub fn entry_len_unchecked(buf: &[u8]) -> Result<usize, DecodeError> {
    parse_entry(buf, false).map(|(_, len)| len)
}

/// Decodes the entry at the start of `buf` without checking its checksum: for bytes this process
/// wrote itself or verified already (a replay's second pass over what its first pass checked).
#[inline]
pub fn decode_entry_unchecked(buf: &[u8]) -> Result<(EntryRef<'_>, usize), DecodeError> {
    parse_entry(buf, false)
}

/// Decodes and verifies the entry at the start of `buf`; returns it and its encoded length.
pub fn decode_entry(buf: &[u8]) -> Result<(EntryRef<'_>, usize), DecodeError> {
    parse_entry(buf, true)
}

/// What a walk over a run of entries found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WalkStats {
    /// Entries whose checksum failed (skipped; never returned).
    pub corrupt_entries: u64,
    /// Bytes that could not be parsed at all (a damaged length field ends the run).
    pub unreadable_bytes: u64,
}

/// Calls `f(offset, entry)` for every valid entry in `body` (a block body or a run body).
/// A checksum failure skips just that entry when its lengths are plausible and the next entry
/// verifies (resynchronisation); otherwise the rest of the body is counted unreadable.
pub fn walk_entries<'a>(body: &'a [u8], mut f: impl FnMut(usize, EntryRef<'a>)) -> WalkStats {
    let mut stats = WalkStats::default();
    let mut at = 0usize;
    while at < body.len() {
        match decode_entry(&body[at..]) {
            Ok((e, len)) => {
                f(at, e);
                at += len;
            }
            Err(DecodeError::End) => break,
            Err(DecodeError::BadChecksum) => {
                stats.corrupt_entries += 1;
                // The lengths passed the bounds check; trust them only if what follows verifies.
                let len = entry_len_unchecked(&body[at..]).unwrap_or(body.len() - at);
                let next = at + len;
                if next >= body.len() || decode_entry(&body[next..]).is_ok() {
                    at = next;
                } else {
                    stats.unreadable_bytes += (body.len() - next) as u64;
                    break;
                }
            }
            Err(_) => {
                stats.corrupt_entries += 1;
                stats.unreadable_bytes += (body.len() - at) as u64;
                break;
            }
        }
    }
    stats
}

/// A block header (every write to a primary or secondary log is one block at a page boundary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    pub kind: u8,
    pub body_len: u32,
    /// Strictly increasing over every block this backup ever writes (across restarts).
    pub write_seq: u64,
    /// The newest flush sequence number whose data the block holds.
    pub data_seq: u64,
    /// Owning tablet for secondary blocks; 0 in the primary log.
    pub tablet: u64,
    pub entry_count: u32,
}

impl BlockHeader {
    /// Bytes the block occupies on disk, padded to a page.
    pub fn padded_len(&self) -> usize {
        page_align_up(BLOCK_HEADER_BYTES + self.body_len as usize)
    }

    pub fn encode(&self, out: &mut [u8]) {
        assert!(out.len() >= BLOCK_HEADER_BYTES);
        out[0..4].copy_from_slice(&BLOCK_MAGIC.to_le_bytes());
        out[8] = self.kind;
        out[9..12].copy_from_slice(&[0, 0, 0]);
        out[12..16].copy_from_slice(&self.body_len.to_le_bytes());
        out[16..24].copy_from_slice(&self.write_seq.to_le_bytes());
        out[24..32].copy_from_slice(&self.data_seq.to_le_bytes());
        out[32..40].copy_from_slice(&self.tablet.to_le_bytes());
        out[40..44].copy_from_slice(&self.entry_count.to_le_bytes());
        out[44..48].copy_from_slice(&0u32.to_le_bytes());
        let crc = crc32c::crc32c(&out[8..BLOCK_HEADER_BYTES]);
        out[4..8].copy_from_slice(&crc.to_le_bytes());
    }

    /// Decodes a header from `buf`; `space` is how many bytes the block may span from its start
    /// (to the end of the segment or file).
    pub fn decode(buf: &[u8], space: usize) -> Result<BlockHeader, DecodeError> {
        if buf.len() < BLOCK_HEADER_BYTES {
            return Err(DecodeError::End);
        }
        if u32_at(buf, 0) != BLOCK_MAGIC {
            return Err(DecodeError::BadMagic);
        }
        if crc32c::crc32c(&buf[8..BLOCK_HEADER_BYTES]) != u32_at(buf, 4) {
            return Err(DecodeError::BadHeaderChecksum);
        }
        let h = BlockHeader {
            kind: buf[8],
            body_len: u32_at(buf, 12),
            write_seq: u64_at(buf, 16),
            data_seq: u64_at(buf, 24),
            tablet: u64_at(buf, 32),
            entry_count: u32_at(buf, 40),
        };
        if BLOCK_HEADER_BYTES + h.body_len as usize > space {
            return Err(DecodeError::BadLength);
        }
        Ok(h)
    }
}

/// Walks the chain of blocks in `region` (a segment or the primary log) from offset 0: each block
/// must decode and have a larger `write_seq` than the one before; the first block that does not is
/// the end of data. Calls `f(offset, header, body)` for each block of the chain.
pub fn walk_blocks<'a>(
    region: &'a [u8],
    mut f: impl FnMut(usize, &BlockHeader, &'a [u8]),
) -> usize {
    let mut at = 0usize;
    let mut last_seq = 0u64;
    while at + BLOCK_HEADER_BYTES <= region.len() {
        let Ok(h) = BlockHeader::decode(&region[at..], region.len() - at) else {
            break;
        };
        if h.write_seq <= last_seq {
            break;
        }
        last_seq = h.write_seq;
        let body = &region[at + BLOCK_HEADER_BYTES..at + BLOCK_HEADER_BYTES + h.body_len as usize];
        f(at, &h, body);
        at += h.padded_len();
    }
    at
}

/// A decoded primary-log run header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunHeader {
    pub tablet: u64,
    pub body_len: u32,
    pub flags: u32,
}

pub fn encode_run_header(out: &mut Vec<u8>, tablet: u64, body_len: u32, flags: u32) {
    out.extend_from_slice(&tablet.to_le_bytes());
    out.extend_from_slice(&body_len.to_le_bytes());
    out.extend_from_slice(&flags.to_le_bytes());
}

/// Calls `f(run, run_body)` for each run of a primary block body; returns false if the runs do not
/// tile the body exactly (damage), in which case the runs already delivered were intact headers.
pub fn walk_runs<'a>(body: &'a [u8], mut f: impl FnMut(RunHeader, &'a [u8])) -> bool {
    let mut at = 0usize;
    while at < body.len() {
        if body.len() - at < RUN_HEADER_BYTES {
            return false;
        }
        let run = RunHeader {
            tablet: u64_at(body, at),
            body_len: u32_at(body, at + 8),
            flags: u32_at(body, at + 12),
        };
        let start = at + RUN_HEADER_BYTES;
        let Some(end) = start.checked_add(run.body_len as usize) else {
            return false;
        };
        if end > body.len() {
            return false;
        }
        f(run, &body[start..end]);
        at = end;
    }
    true
}

/// Write-buffer batch header (tablet, body length, entry count); trusted (in-process) data.
pub fn encode_batch_header(out: &mut [u8], tablet: u64, body_len: u32, count: u32) {
    out[0..8].copy_from_slice(&tablet.to_le_bytes());
    out[8..12].copy_from_slice(&body_len.to_le_bytes());
    out[12..16].copy_from_slice(&count.to_le_bytes());
}

pub fn decode_batch_header(buf: &[u8]) -> Option<(u64, usize, u32)> {
    if buf.len() < BATCH_HEADER_BYTES {
        return None;
    }
    let len = u32_at(buf, 8) as usize;
    if BATCH_HEADER_BYTES + len > buf.len() {
        return None;
    }
    Some((u64_at(buf, 0), len, u32_at(buf, 12)))
}

/// One version-log record: the latest version of a key (by its 128-bit hash), or its deletion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionRecord {
    pub hash: u128,
    pub version: u64,
    pub deleted: bool,
}

/// Encodes `records` as version blocks of at most [`VERSION_BLOCK_RECORDS_MAX`] records (one
/// empty block if there are none), each block with delete records followed by a mirror block
/// holding those deletes again.
pub fn encode_version_blocks(out: &mut Vec<u8>, seq: u64, records: &[VersionRecord]) {
    let mut chunks: Vec<&[VersionRecord]> = records.chunks(VERSION_BLOCK_RECORDS_MAX).collect();
    if chunks.is_empty() {
        chunks.push(&[]);
    }
    let mut deletes = Vec::new();
    for chunk in chunks {
        encode_version_block_copy(out, seq, chunk, VERSION_COPY_FIRST);
        deletes.clear();
        deletes.extend(chunk.iter().filter(|r| r.deleted));
        if !deletes.is_empty() {
            encode_version_block_copy(out, seq, &deletes, VERSION_COPY_MIRROR);
        }
    }
}

/// Encodes one version block (header + records) with copy number `copy` onto `out`.
fn encode_version_block_copy(out: &mut Vec<u8>, seq: u64, records: &[VersionRecord], copy: u32) {
    assert!(records.len() <= VERSION_BLOCK_RECORDS_MAX);
    let start = out.len();
    out.extend_from_slice(&VERSION_MAGIC.to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(&(records.len() as u32).to_le_bytes());
    out.extend_from_slice(&copy.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    for r in records {
        out.extend_from_slice(&r.hash.to_le_bytes());
        out.extend_from_slice(&r.version.to_le_bytes());
        out.push(u8::from(r.deleted));
    }
    let crc = crc32c::crc32c(&out[start + 8..]);
    out[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

/// Decodes the version block at the start of `buf`: returns (seq, records bytes, total length).
/// Records are read with [`version_records`].
pub fn decode_version_block(buf: &[u8]) -> Result<(u64, &[u8], usize), DecodeError> {
    if buf.len() < VERSION_BLOCK_HEADER_BYTES {
        return Err(DecodeError::End);
    }
    if u32_at(buf, 0) != VERSION_MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let count = u32_at(buf, 8) as usize;
    if count > VERSION_BLOCK_RECORDS_MAX {
        return Err(DecodeError::BadLength);
    }
    let total = VERSION_BLOCK_HEADER_BYTES + count * VERSION_RECORD_BYTES;
    if total > buf.len() {
        return Err(DecodeError::BadLength);
    }
    if crc32c::crc32c(&buf[8..total]) != u32_at(buf, 4) {
        return Err(DecodeError::BadVersionChecksum);
    }
    if u32_at(buf, 12) > VERSION_COPY_MIRROR {
        return Err(DecodeError::BadVersionCopy);
    }
    Ok((
        u64_at(buf, 16),
        &buf[VERSION_BLOCK_HEADER_BYTES..total],
        total,
    ))
}

/// What a walk over a version log found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct VersionWalk {
    /// End of the last intact block.
    pub valid_end: usize,
    /// Bytes skipped between intact blocks (damage in the middle of the log).
    pub damaged_bytes: u64,
    /// Bytes after the last intact block (a torn tail, or damage at the end).
    pub tail_bytes: u64,
    pub max_seq: u64,
    /// Mirror copies whose records were used because the first copy before them was damaged.
    pub recovered_blocks: u64,
}

/// Calls `f(seq, records)` for every intact block of a version log. A damaged block is skipped by
/// searching for the next block that verifies; what cannot be read is counted, never guessed.
pub fn walk_version_log<'a>(data: &'a [u8], mut f: impl FnMut(u64, &'a [u8])) -> VersionWalk {
    let mut w = VersionWalk::default();
    let mut at = 0usize;
    // Sequence of the intact first copy that ends at `at`, if one does.
    let mut first: Option<u64> = None;
    while at < data.len() {
        match decode_version_block(&data[at..]) {
            Ok((seq, recs, len)) => {
                let mirror = u32_at(&data[at..], 12) == VERSION_COPY_MIRROR;
                // A mirror repeats deletes of the block right before it (written in the same
                // write): its records are used only when that block was not intact.
                let repeat = mirror && first == Some(seq);
                if !repeat {
                    if mirror {
                        w.recovered_blocks += 1;
                    }
                    f(seq, recs);
                }
                first = (!mirror).then_some(seq);
                w.max_seq = w.max_seq.max(seq);
                at += len;
                w.valid_end = at;
            }
            Err(_) => {
                // Resynchronise on the next magic that starts a verifying block.
                let magic = VERSION_MAGIC.to_le_bytes();
                let mut next = None;
                let mut k = at + 1;
                while k + 4 <= data.len() {
                    if data[k..k + 4] == magic && decode_version_block(&data[k..]).is_ok() {
                        next = Some(k);
                        break;
                    }
                    k += 1;
                }
                first = None;
                match next {
                    Some(k) => {
                        w.damaged_bytes += (k - at) as u64;
                        at = k;
                    }
                    None => break,
                }
            }
        }
    }
    w.tail_bytes = (data.len() - w.valid_end) as u64;
    w
}

/// Iterates the records of a verified version block body.
pub fn version_records(records: &[u8]) -> impl Iterator<Item = VersionRecord> + '_ {
    records.chunks_exact(VERSION_RECORD_BYTES).map(|r| {
        let mut h = [0u8; 16];
        h.copy_from_slice(&r[0..16]);
        VersionRecord {
            hash: u128::from_le_bytes(h),
            version: u64_at(r, 16),
            deleted: r[24] != 0,
        }
    })
}

/// The 128-bit key hash that stands for a key in version buffers, version logs and replay maps.
#[inline]
pub fn key_hash(key: &[u8]) -> u128 {
    xxhash_rust::xxh3::xxh3_128_with_seed(key, 0x5241_4D4C_4F47_4B56)
}

/// Manifest: magic "RLMF" u32 | crc u32 | segment_bytes u64 | primary_bytes u64 | seq_base u64.
pub const MANIFEST_BYTES: usize = 32;
/// "RLM2": a data directory whose entries have varint headers.
pub const MANIFEST_MAGIC: u32 = 0x324D_4C52;
/// "RLMF": the first format (fixed 29-byte entry headers), which this version cannot read.
pub const MANIFEST_MAGIC_V1: u32 = 0x464D_4C52;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Manifest {
    pub segment_bytes: u64,
    pub primary_bytes: u64,
    /// Every sequence number handed out by the next run is at least this.
    pub seq_base: u64,
}

impl Manifest {
    pub fn encode(&self) -> [u8; MANIFEST_BYTES] {
        let mut b = [0u8; MANIFEST_BYTES];
        b[0..4].copy_from_slice(&MANIFEST_MAGIC.to_le_bytes());
        b[8..16].copy_from_slice(&self.segment_bytes.to_le_bytes());
        b[16..24].copy_from_slice(&self.primary_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq_base.to_le_bytes());
        let crc = crc32c::crc32c(&b[8..]);
        b[4..8].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Manifest, DecodeError> {
        if b.len() < MANIFEST_BYTES {
            return Err(DecodeError::End);
        }
        match u32_at(b, 0) {
            MANIFEST_MAGIC => {}
            MANIFEST_MAGIC_V1 => return Err(DecodeError::OldFormat),
            _ => return Err(DecodeError::BadMagic),
        }
        if crc32c::crc32c(&b[8..MANIFEST_BYTES]) != u32_at(b, 4) {
            return Err(DecodeError::BadHeaderChecksum);
        }
        Ok(Manifest {
            segment_bytes: u64_at(b, 8),
            primary_bytes: u64_at(b, 16),
            seq_base: u64_at(b, 24),
        })
    }
}

/// Runs every decoder over arbitrary bytes; the fuzz target and the property test call this.
/// Returns the number of items decoded so that the work cannot be optimised away.
pub fn decode_everything(data: &[u8]) -> usize {
    let mut n = 0usize;
    let stats = walk_entries(data, |_, e| n += e.key.len() + 1);
    n += stats.corrupt_entries as usize;
    walk_blocks(data, |_, h, body| {
        n += 1;
        if h.kind == BLOCK_PRIMARY {
            walk_runs(body, |_, run| {
                walk_entries(run, |_, _| n += 1);
            });
        } else {
            walk_entries(body, |_, _| n += 1);
        }
    });
    let w = walk_version_log(data, |_, recs| n += version_records(recs).count());
    n += w.damaged_bytes as usize;
    if Manifest::decode(data).is_ok() {
        n += 1;
    }
    if let Some((_, len, _)) = decode_batch_header(data) {
        n += len;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn entry_round_trip_and_checksum() {
        let mut buf = Vec::new();
        encode_entry(&mut buf, KIND_PUT, b"key", b"value", 7, 99);
        encode_entry(&mut buf, KIND_DELETE, b"gone", b"", 8, 0);
        let (e, len) = decode_entry(&buf).unwrap();
        assert_eq!(
            (e.key, e.value, e.version, e.expiry),
            (&b"key"[..], &b"value"[..], 7, 99)
        );
        assert_eq!(len, entry_bytes(3, 5, 7, 99));
        let (e2, _) = decode_entry(&buf[len..]).unwrap();
        assert!(e2.is_delete());
        let header = entry_header_bytes(3, 5, 7, 99);
        assert_eq!(header, 9);
        buf[header + 1] ^= 1;
        assert_eq!(decode_entry(&buf), Err(DecodeError::BadChecksum));
    }

    #[test]
    fn header_fields_take_the_bytes_their_values_need() {
        for (key_len, value_len, version, expiry) in [
            (0usize, 0usize, 0u64, 0u64),
            (16, 48, 1 << 22, 0),
            (KEY_MAX_BYTES, u32::MAX as usize, u64::MAX, u64::MAX),
            (127, 128, 16_383, 16_384),
        ] {
            let key = vec![1u8; key_len.min(KEY_MAX_BYTES)];
            // At most 64 KiB of value (the largest header is checked below, by its fields).
            let value = vec![2u8; value_len.min(1 << 16)];
            let mut buf = Vec::new();
            encode_entry(&mut buf, KIND_PUT, &key, &value, version, expiry);
            let (e, len) = decode_entry(&buf).unwrap();
            assert_eq!((e.version, e.expiry), (version, expiry));
            assert_eq!(len, buf.len());
            assert_eq!(len, entry_bytes(key.len(), value.len(), version, expiry));
            assert!(len - key.len() - value.len() <= ENTRY_HEADER_MAX_BYTES);
        }
        assert_eq!(
            entry_header_bytes(KEY_MAX_BYTES, u32::MAX as usize, u64::MAX, u64::MAX),
            ENTRY_HEADER_MAX_BYTES
        );
    }

    #[test]
    fn overlong_and_overflowing_varints_are_rejected() {
        let mut buf = Vec::new();
        encode_entry(&mut buf, KIND_PUT, b"k", b"v", 5, 0);
        // Version 5 written as two bytes (0x85 0x00): not the one encoding of 5.
        let mut long = buf[..7].to_vec();
        long.extend_from_slice(&[0x85, 0x00]);
        long.extend_from_slice(&buf[8..]);
        assert_eq!(decode_entry(&long), Err(DecodeError::BadVarint));
        // An expiry of eleven bytes.
        let mut over = buf[..8].to_vec();
        over.extend_from_slice(&[0xFF; 10]);
        over.extend_from_slice(&[0x01, b'k', b'v']);
        assert_eq!(decode_entry(&over), Err(DecodeError::BadVarint));
        // A value length past u32.
        let mut big = buf[..6].to_vec();
        big.extend_from_slice(&[0xFF, 0xFF, 0xFF, 0xFF, 0x7F]);
        big.extend_from_slice(&[0u8; 16]);
        assert_eq!(decode_entry(&big), Err(DecodeError::BadVarint));
    }

    #[test]
    fn walk_skips_one_corrupt_entry_and_resyncs() {
        let mut buf = Vec::new();
        for i in 0..5u64 {
            encode_entry(
                &mut buf,
                KIND_PUT,
                format!("k{i}").as_bytes(),
                b"vvvv",
                i + 1,
                0,
            );
        }
        let one = entry_bytes(2, 4, 1, 0);
        // Versions 1..=5 all take one byte: every entry is `one` long.
        buf[one * 2 + entry_header_bytes(2, 4, 3, 0) + 3] ^= 0x40; // value byte of entry 2
        let mut seen = Vec::new();
        let stats = walk_entries(&buf, |_, e| seen.push(e.version));
        assert_eq!(seen, vec![1, 2, 4, 5]);
        assert_eq!(stats.corrupt_entries, 1);
    }

    #[test]
    fn block_header_round_trip_and_chain_end() {
        let mut region = vec![0u8; PAGE_BYTES * 4];
        let h = BlockHeader {
            kind: BLOCK_SECONDARY,
            body_len: 100,
            write_seq: 5,
            data_seq: 3,
            tablet: 9,
            entry_count: 1,
        };
        h.encode(&mut region);
        assert_eq!(BlockHeader::decode(&region, region.len()).unwrap(), h);
        // A second block with a lower write_seq is stale: the chain ends before it.
        let stale = BlockHeader { write_seq: 4, ..h };
        stale.encode(&mut region[PAGE_BYTES..]);
        let mut n = 0;
        let end = walk_blocks(&region, |_, _, _| n += 1);
        assert_eq!((n, end), (1, PAGE_BYTES));
        region[20] ^= 1;
        assert_eq!(
            BlockHeader::decode(&region, region.len()),
            Err(DecodeError::BadHeaderChecksum)
        );
    }

    #[test]
    fn version_block_round_trip() {
        let recs = vec![
            VersionRecord {
                hash: 1 << 100,
                version: 3,
                deleted: false,
            },
            VersionRecord {
                hash: 77,
                version: 9,
                deleted: true,
            },
        ];
        let mut buf = Vec::new();
        encode_version_block_copy(&mut buf, 42, &recs, VERSION_COPY_FIRST);
        let (seq, body, len) = decode_version_block(&buf).unwrap();
        assert_eq!((seq, len), (42, buf.len()));
        assert_eq!(version_records(body).collect::<Vec<_>>(), recs);
        let last = buf.len() - 1;
        buf[last] ^= 1;
        assert_eq!(
            decode_version_block(&buf),
            Err(DecodeError::BadVersionChecksum)
        );
    }

    fn records(from: u64, n: u64) -> Vec<VersionRecord> {
        (from..from + n)
            .map(|i| VersionRecord {
                hash: u128::from(i) * 0x9E37_79B9_7F4A_7C15,
                version: i,
                deleted: i % 3 == 0,
            })
            .collect()
    }

    /// Records a walk delivers, in order, and what it found.
    fn walked(data: &[u8]) -> (Vec<VersionRecord>, VersionWalk) {
        let mut got = Vec::new();
        let w = walk_version_log(data, |_, recs| got.extend(version_records(recs)));
        (got, w)
    }

    #[test]
    fn deletes_are_mirrored_and_survive_one_damaged_block() {
        let (a, b) = (records(0, 40), records(100, 7));
        let deletes_a: Vec<VersionRecord> = a.iter().filter(|r| r.deleted).copied().collect();
        let mut log = Vec::new();
        encode_version_blocks(&mut log, 5, &a);
        let block_a = VERSION_BLOCK_HEADER_BYTES + a.len() * VERSION_RECORD_BYTES;
        let mirror_a = VERSION_BLOCK_HEADER_BYTES + deletes_a.len() * VERSION_RECORD_BYTES;
        assert_eq!(log.len(), block_a + mirror_a);
        encode_version_blocks(&mut log, 6, &b);
        let all: Vec<VersionRecord> = a.iter().chain(&b).copied().collect();

        // Intact: every record once, nothing recovered or damaged.
        let (got, w) = walked(&log);
        assert_eq!(got, all);
        assert_eq!(
            (w.recovered_blocks, w.damaged_bytes, w.tail_bytes),
            (0, 0, 0)
        );
        assert_eq!((w.valid_end, w.max_seq), (log.len(), 6));

        // Block `a` damaged: its deletes come from the mirror, and the damage is reported.
        let mut first_hit = log.clone();
        first_hit[VERSION_BLOCK_HEADER_BYTES + 30] ^= 0x40;
        let (got, w) = walked(&first_hit);
        let expect: Vec<VersionRecord> = deletes_a.iter().chain(&b).copied().collect();
        assert_eq!(got, expect);
        assert_eq!(w.recovered_blocks, 1);
        assert_eq!(w.damaged_bytes, block_a as u64);

        // The mirror damaged: the block already delivered everything.
        let mut mirror_hit = log.clone();
        mirror_hit[block_a + VERSION_BLOCK_HEADER_BYTES + 3] ^= 0x01;
        let (got, w) = walked(&mirror_hit);
        assert_eq!(got, all);
        assert_eq!((w.recovered_blocks, w.damaged_bytes), (0, mirror_a as u64));

        // Both damaged: `a`'s records are gone (reported), `b` is intact.
        let mut both_hit = first_hit.clone();
        both_hit[block_a + VERSION_BLOCK_HEADER_BYTES + 3] ^= 0x01;
        let (got, w) = walked(&both_hit);
        assert_eq!(got, b);
        assert_eq!(w.damaged_bytes, (block_a + mirror_a) as u64);

        // A block without deletes has no mirror.
        let puts: Vec<VersionRecord> = b.iter().filter(|r| !r.deleted).copied().collect();
        let mut only_puts = Vec::new();
        encode_version_blocks(&mut only_puts, 7, &puts);
        assert_eq!(
            only_puts.len(),
            VERSION_BLOCK_HEADER_BYTES + puts.len() * VERSION_RECORD_BYTES
        );

        // A mirror after a block of another sequence is not taken for a repeat.
        let mut odd = Vec::new();
        encode_version_block_copy(&mut odd, 5, &a, VERSION_COPY_FIRST);
        encode_version_block_copy(&mut odd, 6, &b, VERSION_COPY_MIRROR);
        let (got, w) = walked(&odd);
        assert_eq!(got, all);
        assert_eq!(w.recovered_blocks, 1);

        // Copy numbers other than 0 and 1 are refused.
        let mut bad = Vec::new();
        encode_version_block_copy(&mut bad, 5, &a, 2);
        assert_eq!(decode_version_block(&bad), Err(DecodeError::BadVersionCopy));
    }

    #[test]
    fn manifest_round_trip() {
        let m = Manifest {
            segment_bytes: 8 << 20,
            primary_bytes: 256 << 20,
            seq_base: 1 << 32,
        };
        assert_eq!(Manifest::decode(&m.encode()).unwrap(), m);
        let mut old = m.encode();
        old[0..4].copy_from_slice(&MANIFEST_MAGIC_V1.to_le_bytes());
        assert_eq!(Manifest::decode(&old), Err(DecodeError::OldFormat));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// The decoders survive arbitrary bytes (the stable twin of the fuzz target).
        #[test]
        fn decoders_never_panic(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode_everything(&data);
        }

        /// Valid logs with random byte flips: decoding never panics, and no entry with a failed
        /// checksum is ever delivered.
        #[test]
        fn mutated_blocks_never_yield_bad_entries(
            n in 1usize..20, flips in proptest::collection::vec((any::<usize>(), 0u8..8), 1..6)
        ) {
            let mut body = Vec::new();
            for i in 0..n {
                encode_entry(&mut body, KIND_PUT, format!("key{i}").as_bytes(), &vec![i as u8; i * 3], i as u64 + 1, 0);
            }
            let mut region = vec![0u8; page_align_up(BLOCK_HEADER_BYTES + body.len())];
            BlockHeader { kind: BLOCK_SECONDARY, body_len: body.len() as u32, write_seq: 1, data_seq: 1, tablet: 1, entry_count: n as u32 }
                .encode(&mut region);
            region[BLOCK_HEADER_BYTES..BLOCK_HEADER_BYTES + body.len()].copy_from_slice(&body);
            for (pos, bit) in flips {
                let len = region.len();
                region[pos % len] ^= 1 << bit;
            }
            let _ = decode_everything(&region);
            walk_blocks(&region, |_, _, b| {
                walk_entries(b, |_, e| {
                    let i = (e.version - 1) as usize;
                    assert_eq!(e.key, format!("key{i}").as_bytes());
                    assert_eq!(e.value, &vec![i as u8; i * 3][..]);
                });
            });
        }
    }
}
