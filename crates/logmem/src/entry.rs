//! Byte layout of in-memory log entries (documented in docs/formats.md, "In-memory log").
//!
//! ```text
//! u8      kind_flags   bits 0-2 kind (1 object, 2 tombstone), bit 3 has-expiry,
//!                      bits 4-6 state (mutable, see below), bit 7 zero
//! varint  version      LEB128, 1-10 bytes: the version that wrote it (its valid-from)
//! varint  key_len      LEB128, 1-3 bytes (<= 65536)
//! varint  value_len    LEB128, 1-4 bytes (objects only; < 2^28)
//! u64 LE  expire_at_ms only when has-expiry (unix milliseconds)
//! u32 LE  crc32c       CRC32C of the key, then the value, then every header byte before this field
//!                      (state bits taken as 0); for a RETAINED entry, its valid-to instead (see
//!                      below). The key and value come first so that a writer can checksum them
//!                      before it takes the tablet's write lock, which the version needs.
//! [key_len]   key
//! [value_len] value    (objects only)
//! ```
//! A 13-byte key with a 100-byte value and a 3-byte version takes 10 header bytes (123 in all).
//! Entries are unaligned and may straddle seglets; they never straddle segments.
//!
//! The state bits make the log self-describing for scans (TellStore's valid-from/valid-to, without
//! its 40-byte header). They change in place, under the tablet's write lock, and only ever get set:
//! - SUPERSEDED: a newer version (or a delete) replaced this object. Without RETAINED, no snapshot
//!   can see it: it is garbage.
//! - RETAINED (with SUPERSEDED): an open snapshot may still read it. The CRC field then holds
//!   `valid_to - version` (u32 LE; `u32::MAX` means "too far, ask the tablet's far-valid-to table"),
//!   written before the flag is set. The entry is visible to snapshot s iff version <= s < valid_to.
//! - MOVED: not the live copy. Set on a cleaner's copy until its reference is swapped to it, and on
//!   the original once the swap is done; exactly one of the two lacks it at any time.

use ramlog_common::varint;
use thiserror::Error;

pub const KIND_OBJECT: u8 = 1;
pub const KIND_TOMBSTONE: u8 = 2;
const KIND_MASK: u8 = 0x07;
const FLAG_EXPIRY: u8 = 0x08;
/// A newer version or a delete replaced this object.
pub const STATE_SUPERSEDED: u8 = 0x10;
/// Superseded but kept for an open snapshot; the CRC field holds the valid-to delta.
pub const STATE_RETAINED: u8 = 0x20;
/// Not the live copy (a cleaner copy not yet swapped in, or an original that was swapped out).
pub const STATE_MOVED: u8 = 0x40;
/// Every mutable state bit.
pub const STATE_MASK: u8 = 0x70;
const FLAGS_RESERVED: u8 = 0x80;
/// Valid-to delta meaning "does not fit in 32 bits".
pub const VALID_TO_FAR: u32 = u32::MAX;

/// Longest possible header: 1 + 10 + 3 + 4 + 8 + 4.
pub const HEADER_BYTES_MAX: usize = 30;
/// Largest key the format can carry.
pub const KEY_BYTES_FORMAT_MAX: usize = ramlog_common::KEY_SIZE_FORMAT_MAX_BYTES;
/// Largest value the format can carry (a 4-byte varint).
pub const VALUE_BYTES_FORMAT_MAX: usize = (1 << 28) - 1;

#[derive(Debug, Error, PartialEq, Eq, Clone)]
pub enum DecodeError {
    #[error("entry header truncated")]
    Truncated,
    #[error("unknown entry kind {0}")]
    BadKind(u8),
    #[error("reserved flag bits set: {0:#04x}")]
    ReservedFlags(u8),
    #[error("malformed varint in entry header")]
    BadVarint,
    #[error("key length {0} exceeds the format's maximum")]
    KeyTooLong(u64),
    #[error("value length {0} exceeds the format's maximum")]
    ValueTooLong(u64),
    #[error("checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum { stored: u32, computed: u32 },
}

/// A decoded entry header. `header_len` counts every byte before the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    pub kind: u8,
    pub version: u64,
    pub key_len: u32,
    pub value_len: u32,
    pub expire_at_ms: u64,
    pub crc: u32,
    pub header_len: u32,
    /// State bits (SUPERSEDED, RETAINED, MOVED) as read; they may change after the read.
    pub state: u8,
}

impl Header {
    #[inline]
    pub fn total_len(&self) -> usize {
        self.header_len as usize + self.key_len as usize + self.value_len as usize
    }
    #[inline]
    pub fn is_object(&self) -> bool {
        self.kind == KIND_OBJECT
    }
    /// Offset of the CRC (or valid-to delta) field from the start of the entry.
    #[inline]
    pub fn crc_offset(&self) -> usize {
        self.header_len as usize - 4
    }
    /// The valid-to of a RETAINED entry: Some(exclusive end) when it fits the delta, None when far.
    #[inline]
    pub fn retained_valid_to(&self) -> Option<u64> {
        (self.crc != VALID_TO_FAR).then(|| self.version + self.crc as u64)
    }
}

#[inline]
fn get_varint(buf: &[u8], pos: &mut usize, max_bytes: usize) -> Result<u64, DecodeError> {
    let mut value: u64 = 0;
    for i in 0..max_bytes {
        let Some(&b) = buf.get(*pos) else {
            return Err(DecodeError::Truncated);
        };
        *pos += 1;
        value |= ((b & 0x7F) as u64) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(DecodeError::BadVarint)
}

/// Length of an encoded entry, without encoding it.
#[inline]
pub fn encoded_len(
    kind: u8,
    version: u64,
    key_len: usize,
    value_len: usize,
    expire_at_ms: u64,
) -> usize {
    let mut n = 1 + varint::len(version) + varint::len(key_len as u64) + 4;
    if kind == KIND_OBJECT {
        n += varint::len(value_len as u64) + value_len;
    }
    if expire_at_ms != 0 {
        n += 8;
    }
    n + key_len
}

/// Encodes a header (including the CRC over key and value) into `out`; returns its length.
pub fn encode_header(
    out: &mut [u8; HEADER_BYTES_MAX],
    kind: u8,
    version: u64,
    key: &[u8],
    value: &[u8],
    expire_at_ms: u64,
) -> usize {
    let body_crc = body_crc(key, value);
    encode_header_with_body_crc(out, kind, version, key, value, expire_at_ms, body_crc)
}

/// The CRC32C of an entry's key and value: the start of its checksum (see the layout above).
pub fn body_crc(key: &[u8], value: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(key), value)
}

/// As [`encode_header`], with `body_crc` = [`body_crc`]`(key, value)` computed beforehand.
pub fn encode_header_with_body_crc(
    out: &mut [u8; HEADER_BYTES_MAX],
    kind: u8,
    version: u64,
    key: &[u8],
    value: &[u8],
    expire_at_ms: u64,
    body_crc: u32,
) -> usize {
    debug_assert_eq!(body_crc, self::body_crc(key, value));
    debug_assert!(kind == KIND_OBJECT || kind == KIND_TOMBSTONE);
    debug_assert!(key.len() <= KEY_BYTES_FORMAT_MAX && value.len() <= VALUE_BYTES_FORMAT_MAX);
    debug_assert!(kind == KIND_OBJECT || value.is_empty());
    out[0] = kind | if expire_at_ms != 0 { FLAG_EXPIRY } else { 0 };
    let mut pos = varint::put(out, 1, version);
    pos = varint::put(out, pos, key.len() as u64);
    if kind == KIND_OBJECT {
        pos = varint::put(out, pos, value.len() as u64);
    }
    if expire_at_ms != 0 {
        out[pos..pos + 8].copy_from_slice(&expire_at_ms.to_le_bytes());
        pos += 8;
    }
    let crc = crc32c::crc32c_append(body_crc, &out[..pos]);
    out[pos..pos + 4].copy_from_slice(&crc.to_le_bytes());
    pos + 4
}

/// Decodes a header from the start of `buf`. `buf` may hold more than the header.
pub fn decode_header(buf: &[u8]) -> Result<Header, DecodeError> {
    let Some(&kind_flags) = buf.first() else {
        return Err(DecodeError::Truncated);
    };
    let kind = kind_flags & KIND_MASK;
    if kind != KIND_OBJECT && kind != KIND_TOMBSTONE {
        return Err(DecodeError::BadKind(kind));
    }
    if kind_flags & FLAGS_RESERVED != 0 {
        return Err(DecodeError::ReservedFlags(kind_flags));
    }
    let state = kind_flags & STATE_MASK;
    if state != 0 && state & STATE_SUPERSEDED == 0 && state != STATE_MOVED {
        return Err(DecodeError::ReservedFlags(kind_flags));
    }
    let mut pos = 1;
    let version = get_varint(buf, &mut pos, 10)?;
    let key_len = get_varint(buf, &mut pos, 3)?;
    if key_len > KEY_BYTES_FORMAT_MAX as u64 {
        return Err(DecodeError::KeyTooLong(key_len));
    }
    let value_len = if kind == KIND_OBJECT {
        get_varint(buf, &mut pos, 4)?
    } else {
        0
    };
    if value_len > VALUE_BYTES_FORMAT_MAX as u64 {
        return Err(DecodeError::ValueTooLong(value_len));
    }
    let mut expire_at_ms = 0;
    if kind_flags & FLAG_EXPIRY != 0 {
        let bytes = buf.get(pos..pos + 8).ok_or(DecodeError::Truncated)?;
        expire_at_ms = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
        pos += 8;
    }
    let crc_bytes = buf.get(pos..pos + 4).ok_or(DecodeError::Truncated)?;
    let crc = u32::from_le_bytes(crc_bytes.try_into().expect("4 bytes"));
    pos += 4;
    Ok(Header {
        kind,
        version,
        key_len: key_len as u32,
        value_len: value_len as u32,
        expire_at_ms,
        crc,
        header_len: pos as u32,
        state,
    })
}

/// `decode_header` for the common case of a buffer holding at least `HEADER_BYTES_MAX` bytes: the
/// same result, without per-byte length checks, written field by field into `out` (the scan's hot
/// path keeps the header in place instead of moving a `Result` around). Returns false, leaving
/// `out` unspecified, for anything unusual: the caller then asks `decode_header` for the error.
#[inline(always)]
pub fn decode_header_into(out: &mut Header, buf: &[u8; HEADER_BYTES_MAX]) -> bool {
    let kind_flags = buf[0];
    let kind = kind_flags & KIND_MASK;
    let state = kind_flags & STATE_MASK;
    if (kind != KIND_OBJECT && kind != KIND_TOMBSTONE)
        || kind_flags & FLAGS_RESERVED != 0
        || (state != 0 && state & STATE_SUPERSEDED == 0 && state != STATE_MOVED)
    {
        return false;
    }
    let mut pos = 1usize;
    macro_rules! varint {
        ($max:expr) => {{
            let mut v: u64 = 0;
            let mut i = 0u32;
            loop {
                let b = buf[pos];
                pos += 1;
                v |= ((b & 0x7F) as u64) << (7 * i);
                if b & 0x80 == 0 {
                    break v;
                }
                i += 1;
                if i == $max {
                    return false;
                }
            }
        }};
    }
    let version = varint!(10);
    let key_len = varint!(3);
    let value_len = if kind == KIND_OBJECT { varint!(4) } else { 0 };
    if key_len > KEY_BYTES_FORMAT_MAX as u64 || value_len > VALUE_BYTES_FORMAT_MAX as u64 {
        return false;
    }
    let mut expire_at_ms = 0;
    if kind_flags & FLAG_EXPIRY != 0 {
        expire_at_ms = u64::from_le_bytes(buf[pos..pos + 8].try_into().expect("8 bytes"));
        pos += 8;
    }
    out.kind = kind;
    out.version = version;
    out.key_len = key_len as u32;
    out.value_len = value_len as u32;
    out.expire_at_ms = expire_at_ms;
    out.crc = u32::from_le_bytes(buf[pos..pos + 4].try_into().expect("4 bytes"));
    out.header_len = pos as u32 + 4;
    out.state = state;
    true
}

/// Like `decode_header`, through the fast path when `buf` holds a whole maximal header.
pub fn decode_header_fast(buf: &[u8; HEADER_BYTES_MAX]) -> Result<Header, DecodeError> {
    let mut h = Header::default();
    if decode_header_into(&mut h, buf) {
        Ok(h)
    } else {
        decode_header(buf)
    }
}

/// Checks an entry's CRC; `header_bytes` are the bytes before the CRC field. A RETAINED entry's CRC
/// field holds its valid-to, so it has no checksum left to check.
pub fn verify(
    header: &Header,
    header_bytes: &[u8],
    key: &[u8],
    value: &[u8],
) -> Result<(), DecodeError> {
    if header.state & STATE_RETAINED != 0 {
        return Ok(());
    }
    let Some((&first, rest)) = header_bytes.split_first() else {
        return Err(DecodeError::Truncated);
    };
    let mut crc = body_crc(key, value);
    crc = crc32c::crc32c_append(crc, &[first & !STATE_MASK]);
    crc = crc32c::crc32c_append(crc, rest);
    if crc != header.crc {
        return Err(DecodeError::Checksum {
            stored: header.crc,
            computed: crc,
        });
    }
    Ok(())
}

/// Decodes and verifies a whole entry held contiguously in `buf`; returns header, key and value.
/// This is the decoder the fuzz target drives.
pub fn decode_entry(buf: &[u8]) -> Result<(Header, &[u8], &[u8]), DecodeError> {
    let header = decode_header(buf)?;
    let key_start = header.header_len as usize;
    let key_end = key_start + header.key_len as usize;
    let value_end = key_end + header.value_len as usize;
    if buf.len() < value_end {
        return Err(DecodeError::Truncated);
    }
    let key = &buf[key_start..key_end];
    let value = &buf[key_end..value_end];
    verify(&header, &buf[..key_start - 4], key, value)?;
    Ok((header, key, value))
}

/// Encodes a whole entry into a vector (tests, tools and the fuzz corpus).
pub fn encode_entry(
    kind: u8,
    version: u64,
    key: &[u8],
    value: &[u8],
    expire_at_ms: u64,
) -> Vec<u8> {
    let mut header = [0u8; HEADER_BYTES_MAX];
    let n = encode_header(&mut header, kind, version, key, value, expire_at_ms);
    let mut out = Vec::with_capacity(n + key.len() + value.len());
    out.extend_from_slice(&header[..n]);
    out.extend_from_slice(key);
    out.extend_from_slice(value);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_object_header_is_ten_bytes() {
        let e = encode_entry(KIND_OBJECT, 1_000_000, &[7u8; 13], &[1u8; 100], 0);
        assert_eq!(e.len(), 123);
        assert_eq!(encoded_len(KIND_OBJECT, 1_000_000, 13, 100, 0), 123);
    }

    #[test]
    fn detects_bit_flips() {
        let e = encode_entry(KIND_OBJECT, 42, b"key", b"value", 0);
        for byte in 0..e.len() {
            for bit in 0..8 {
                let mut bad = e.clone();
                bad[byte] ^= 1 << bit;
                if let Ok((h, k, v)) = decode_entry(&bad) {
                    // The state bits change in place and are outside the checksum by design; a flip
                    // there may decode, but only as a state change (a RETAINED flip is never valid
                    // alone, since RETAINED needs SUPERSEDED).
                    let state_bit = byte == 0 && (0x10..=0x40).contains(&(1u8 << bit));
                    assert!(
                        state_bit && h.state == 1 << bit && k == b"key" && v == b"value",
                        "flip at {byte}:{bit} decoded as {h:?} {k:?} {v:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn retained_entries_carry_valid_to_in_the_crc_field() {
        let mut e = encode_entry(KIND_OBJECT, 1000, b"key", b"value", 0);
        let h = decode_header(&e).unwrap();
        assert_eq!(h.state, 0);
        let off = h.crc_offset();
        e[off..off + 4].copy_from_slice(&25u32.to_le_bytes());
        e[0] |= STATE_SUPERSEDED | STATE_RETAINED;
        let (h, k, v) = decode_entry(&e).unwrap();
        assert_eq!((k, v), (&b"key"[..], &b"value"[..]));
        assert_eq!(h.state, STATE_SUPERSEDED | STATE_RETAINED);
        assert_eq!(h.retained_valid_to(), Some(1025));
        e[off..off + 4].copy_from_slice(&VALID_TO_FAR.to_le_bytes());
        assert_eq!(decode_header(&e).unwrap().retained_valid_to(), None);
        // RETAINED without SUPERSEDED is not a state the engine writes.
        e[0] &= !STATE_SUPERSEDED;
        assert!(decode_header(&e).is_err());
    }

    proptest! {
        #[test]
        fn round_trip(version: u64, key in proptest::collection::vec(any::<u8>(), 0..300),
                      value in proptest::collection::vec(any::<u8>(), 0..2000),
                      tomb: bool, expire in prop_oneof![Just(0u64), any::<u64>()]) {
            let kind = if tomb { KIND_TOMBSTONE } else { KIND_OBJECT };
            let value = if tomb { Vec::new() } else { value };
            let e = encode_entry(kind, version, &key, &value, expire);
            prop_assert_eq!(e.len(), encoded_len(kind, version, key.len(), value.len(), expire));
            let (h, k, v) = decode_entry(&e).unwrap();
            prop_assert_eq!(h.kind, kind);
            prop_assert_eq!(h.version, version);
            prop_assert_eq!(h.expire_at_ms, expire);
            prop_assert_eq!(k, &key[..]);
            prop_assert_eq!(v, &value[..]);
            prop_assert_eq!(h.total_len(), e.len());
        }

        /// The fast decoder agrees with the checked one on any 30 bytes.
        #[test]
        fn fast_decoder_agrees(bytes in proptest::collection::vec(any::<u8>(), HEADER_BYTES_MAX..=HEADER_BYTES_MAX),
                               version: u64, key_len in 0usize..70_000, value_len in 0usize..300_000,
                               expire in prop_oneof![Just(0u64), any::<u64>()], tomb: bool, real: bool) {
            let buf: [u8; HEADER_BYTES_MAX] = if real {
                let kind = if tomb { KIND_TOMBSTONE } else { KIND_OBJECT };
                let mut h = [0u8; HEADER_BYTES_MAX];
                let key = vec![0u8; key_len.min(KEY_BYTES_FORMAT_MAX)];
                let value = if tomb { Vec::new() } else { vec![0u8; value_len] };
                encode_header(&mut h, kind, version, &key, &value, expire);
                h
            } else {
                bytes.try_into().unwrap()
            };
            prop_assert_eq!(decode_header_fast(&buf), decode_header(&buf));
        }

        /// The decoder never panics and never reports an entry longer than its input.
        #[test]
        fn decoder_survives_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok((h, _, _)) = decode_entry(&bytes) {
                prop_assert!(h.total_len() <= bytes.len());
            }
        }

        #[test]
        fn decoder_survives_truncation(cut in 0usize..140) {
            let e = encode_entry(KIND_OBJECT, 99, b"0123456789abc", &[5u8; 100], 7);
            let cut = cut.min(e.len());
            let r = decode_entry(&e[..cut]);
            if cut < e.len() { prop_assert!(r.is_err()); } else { prop_assert!(r.is_ok()); }
        }
    }
}
