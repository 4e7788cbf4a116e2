//! Replication frames: what a master sends its backups, and what they answer (DESIGN.md "The
//! backup"; docs/protocol.md "Replication").
//!
//! A replication connection is a native-protocol connection (client hello, server hello, AUTH when
//! the server has a password) whose first request is `REPL_HELLO`; after the backup's OK the
//! connection carries only these frames, each with the native 16-byte header:
//! - master to backup: `REPL_BATCH` requests, request id 0;
//! - backup to master: `REPL_ACK` responses (status OK), or one error response before it closes.
//!
//! A master's writes to one backup form one **stream** of units; a stream offset counts the bytes
//! of the units (their length field included) since the stream began. A **unit** is one atomic
//! group of writes of one tablet (one write, or every key of a multi-put): the backup appends it
//! whole or not at all. Layouts (all integers little-endian):
//!
//! ```text
//! REPL_HELLO body   cluster_id u64 | master u64 | master_epoch u64 | map_version u64 | stream u64
//! REPL_BATCH body   crc32c u32 (of everything after it) | start u64 | flags u8 | units...
//! unit              len u32 (bytes after this field) | table u32 | first_slot u16 | last_slot u16
//!                   | epoch u64 | count u32 | entries...
//! entry             kind u8 (0 put, 1 delete) | key_len u32 | value_len u32 | version u64
//!                   | expiry u64 | key | value
//! REPL_ACK body     buffered u64 | durable u64   (stream offsets: everything before is held)
//! REPL_REFUSED body start u64 | end u64 | message (UTF-8, the rest)   status byte: why
//! ```
//! The decoder checks every length against what is left and against the caller's limits before
//! it trusts it; it never panics on any input (fuzz target `repl_frame`).
//!
//! **Refusals.** A unit whose bounds are sound but whose content the backup refuses (an entry
//! over the limits of `ramlog_common::limits`, a malformed entry inside a well-framed unit) is
//! refused alone: the backup answers `REPL_REFUSED` with the unit's stream range, skips it, and
//! goes on with the rest of the stream ([`UnitError::Refused`]). Only what cannot be tied to one
//! unit (a checksum mismatch, a unit length that overruns its batch) ends the connection
//! ([`UnitError::Frame`]); the master then reconnects and resends.

use crate::native::{DecodeError, Status};

/// Opcodes of replication (in the range the native protocol reserves for server-to-server use).
pub const REPL_HELLO: u8 = 0x31;
pub const REPL_BATCH: u8 = 0x32;
pub const REPL_ACK: u8 = 0x33;
/// Backup to master: one unit is refused for its content (the rest of the stream goes on).
pub const REPL_REFUSED: u8 = 0x34;

/// Batch flag: some unit belongs to a `durable` table, so the backup syncs at once.
pub const FLAG_DURABLE: u8 = 0x01;

pub const HELLO_LEN: usize = 40;
pub const ACK_LEN: usize = 16;
/// Bytes before the first unit of a batch body.
pub const BATCH_HEAD_LEN: usize = 13;
/// Bytes of a unit's header after its length field.
pub const UNIT_HEAD_LEN: usize = 20;
/// Bytes of an entry before its key.
pub const ENTRY_HEAD_LEN: usize = 25;
/// Bytes of a REPL_REFUSED body before its message.
pub const REFUSED_HEAD_LEN: usize = 16;
/// Longest message a REPL_REFUSED carries.
pub const REFUSED_MESSAGE_MAX: usize = 1024;

const KIND_PUT: u8 = 0;
const KIND_DELETE: u8 = 1;

/// The first request of a replication connection: who is sending.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub cluster_id: u64,
    pub master: u64,
    pub master_epoch: u64,
    pub map_version: u64,
    /// Names the stream within the master process: offsets count from 0 for each new one.
    pub stream: u64,
}

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[..8].copy_from_slice(&self.cluster_id.to_le_bytes());
        b[8..16].copy_from_slice(&self.master.to_le_bytes());
        b[16..24].copy_from_slice(&self.master_epoch.to_le_bytes());
        b[24..32].copy_from_slice(&self.map_version.to_le_bytes());
        b[32..40].copy_from_slice(&self.stream.to_le_bytes());
        b
    }

    pub fn decode(body: &[u8]) -> Result<Hello, DecodeError> {
        if body.len() != HELLO_LEN {
            return Err(bad(format!(
                "REPL_HELLO body is {} bytes, not {HELLO_LEN}",
                body.len()
            )));
        }
        Ok(Hello {
            cluster_id: u64_at(body, 0),
            master: u64_at(body, 8),
            master_epoch: u64_at(body, 16),
            map_version: u64_at(body, 24),
            stream: u64_at(body, 32),
        })
    }
}

/// A backup's acknowledgement: every unit that ends at or before `buffered` is in its write
/// buffer, and every one that ends at or before `durable` is fdatasynced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ack {
    pub buffered: u64,
    pub durable: u64,
}

impl Ack {
    pub fn encode(&self) -> [u8; ACK_LEN] {
        let mut b = [0u8; ACK_LEN];
        b[..8].copy_from_slice(&self.buffered.to_le_bytes());
        b[8..].copy_from_slice(&self.durable.to_le_bytes());
        b
    }

    pub fn decode(body: &[u8]) -> Result<Ack, DecodeError> {
        if body.len() != ACK_LEN {
            return Err(bad(format!(
                "REPL_ACK body is {} bytes, not {ACK_LEN}",
                body.len()
            )));
        }
        let ack = Ack {
            buffered: u64_at(body, 0),
            durable: u64_at(body, 8),
        };
        if ack.durable > ack.buffered {
            return Err(bad("REPL_ACK says more is durable than buffered"));
        }
        Ok(ack)
    }
}

/// The tablet a unit belongs to, as the map names it, with the epoch of its master's tenure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct UnitHead {
    pub table: u32,
    pub first_slot: u16,
    pub last_slot: u16,
    pub epoch: u64,
    pub count: u32,
}

/// One write inside a unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplEntry<'a> {
    pub key: &'a [u8],
    /// None for a delete.
    pub value: Option<&'a [u8]>,
    pub version: u64,
    /// Unix milliseconds; 0 = none.
    pub expiry: u64,
}

/// Bytes a unit of these entries takes in the stream (its length field included).
pub fn unit_bytes<'a>(entries: impl IntoIterator<Item = &'a ReplEntry<'a>>) -> usize {
    4 + UNIT_HEAD_LEN
        + entries
            .into_iter()
            .map(|e| ENTRY_HEAD_LEN + e.key.len() + e.value.map_or(0, <[u8]>::len))
            .sum::<usize>()
}

/// Appends one unit to `out`; returns its bytes (length field included).
pub fn encode_unit(out: &mut Vec<u8>, head: &UnitHead, entries: &[ReplEntry<'_>]) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(&head.table.to_le_bytes());
    out.extend_from_slice(&head.first_slot.to_le_bytes());
    out.extend_from_slice(&head.last_slot.to_le_bytes());
    out.extend_from_slice(&head.epoch.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for e in entries {
        let (kind, value) = match e.value {
            Some(v) => (KIND_PUT, v),
            None => (KIND_DELETE, &[][..]),
        };
        out.push(kind);
        out.extend_from_slice(&(e.key.len() as u32).to_le_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        out.extend_from_slice(&e.version.to_le_bytes());
        out.extend_from_slice(&e.expiry.to_le_bytes());
        out.extend_from_slice(e.key);
        out.extend_from_slice(value);
    }
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    out.len() - start
}

/// The length of the unit that starts at `at` in `units` (its length field included), if the
/// field is there.
pub fn unit_len_at(units: &[u8], at: usize) -> Option<usize> {
    let b = units.get(at..at + 4)?;
    Some(4 + u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
}

/// Appends a REPL_BATCH body carrying `units` (whole encoded units) that start at stream offset
/// `start`.
pub fn encode_batch_body(out: &mut Vec<u8>, start: u64, flags: u8, units: &[u8]) {
    let at = out.len();
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(&start.to_le_bytes());
    out.push(flags);
    out.extend_from_slice(units);
    let crc = crc32c::crc32c(&out[at + 4..]);
    out[at..at + 4].copy_from_slice(&crc.to_le_bytes());
}

/// A backup's refusal of one unit: its stream range and why (the frame's status byte).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    pub start: u64,
    pub end: u64,
    pub status: Status,
    pub message: String,
}

impl Refused {
    /// Appends the whole REPL_REFUSED frame (a response: request id 0, the status byte).
    pub fn encode_frame(&self, out: &mut Vec<u8>) {
        let message = self.message.as_bytes();
        let message = &message[..message.len().min(REFUSED_MESSAGE_MAX)];
        let mut body = Vec::with_capacity(REFUSED_HEAD_LEN + message.len());
        body.extend_from_slice(&self.start.to_le_bytes());
        body.extend_from_slice(&self.end.to_le_bytes());
        body.extend_from_slice(message);
        encode_frame(out, 0, REPL_REFUSED, self.status.to_u8(), &body);
    }

    /// Decodes a REPL_REFUSED body with the status byte of its frame.
    pub fn decode(status: Status, body: &[u8]) -> Result<Refused, DecodeError> {
        if body.len() < REFUSED_HEAD_LEN || body.len() > REFUSED_HEAD_LEN + REFUSED_MESSAGE_MAX {
            return Err(bad(format!(
                "REPL_REFUSED body of {} bytes (its head is {REFUSED_HEAD_LEN}, its message at most {REFUSED_MESSAGE_MAX})",
                body.len()
            )));
        }
        let refused = Refused {
            start: u64_at(body, 0),
            end: u64_at(body, 8),
            status,
            message: String::from_utf8_lossy(&body[REFUSED_HEAD_LEN..]).into_owned(),
        };
        if refused.end <= refused.start {
            return Err(bad("REPL_REFUSED names an empty stream range"));
        }
        if status == Status::Ok {
            return Err(bad("REPL_REFUSED with status OK"));
        }
        Ok(refused)
    }
}

/// Why a unit of a batch could not be taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UnitError {
    /// Its bounds cannot be trusted (a length that overruns the batch): nothing after it can be
    /// decoded, and the connection must start over.
    Frame(DecodeError),
    /// The unit from `start` to `end` is refused for its content; the units after it decode on.
    Refused {
        start: u64,
        end: u64,
        error: DecodeError,
    },
}

impl UnitError {
    pub fn decode_error(&self) -> &DecodeError {
        match self {
            UnitError::Frame(e) | UnitError::Refused { error: e, .. } => e,
        }
    }
}

/// What the backup checks each entry against: the one definition of a valid entry
/// (`ramlog_common::limits`), which the master's engine and admission check with too.
pub use ramlog_common::EntryLimits as Limits;

/// A decoded REPL_BATCH body: where it starts in the stream and its units, not yet decoded.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    pub start: u64,
    pub flags: u8,
    units: &'a [u8],
}

/// Checks a REPL_BATCH body's checksum and head.
pub fn decode_batch(body: &[u8]) -> Result<Batch<'_>, DecodeError> {
    if body.len() < BATCH_HEAD_LEN {
        return Err(bad("REPL_BATCH body is shorter than its head"));
    }
    let crc = u32::from_le_bytes([body[0], body[1], body[2], body[3]]);
    if crc32c::crc32c(&body[4..]) != crc {
        return Err(bad("REPL_BATCH checksum mismatch: the frame is corrupt"));
    }
    let start = u64_at(body, 4);
    let flags = body[12];
    if flags & !FLAG_DURABLE != 0 {
        return Err(bad(format!("REPL_BATCH has unknown flags {flags:#04x}")));
    }
    let units = &body[BATCH_HEAD_LEN..];
    if start.checked_add(units.len() as u64).is_none() {
        return Err(bad("REPL_BATCH stream offset overflows"));
    }
    Ok(Batch {
        start,
        flags,
        units,
    })
}

impl<'a> Batch<'a> {
    /// The stream offset just past the batch's last unit.
    pub fn end(&self) -> u64 {
        self.start + self.units.len() as u64
    }

    /// The units in order, each with the stream offset where it ends.
    pub fn units(&self, limits: Limits) -> Units<'a> {
        Units {
            rest: self.units,
            offset: self.start,
            limits,
        }
    }
}

/// Decodes units from `bytes`, the stream's bytes from offset `start` (as a batch's units).
pub fn decode_units(bytes: &[u8], start: u64, limits: Limits) -> Units<'_> {
    Units {
        rest: bytes,
        offset: start,
        limits,
    }
}

/// Iterator over a batch's units: a unit refused for its content is an `Err` and the ones after
/// it follow; a unit whose bounds are broken is the last item.
pub struct Units<'a> {
    rest: &'a [u8],
    offset: u64,
    limits: Limits,
}

/// One unit: its tablet, where it ends in the stream, and its entries (checked).
#[derive(Clone, Debug)]
pub struct Unit<'a> {
    pub head: UnitHead,
    /// Stream offsets where the unit starts (its length field) and ends.
    pub start: u64,
    pub end: u64,
    pub entries: Vec<ReplEntry<'a>>,
}

impl<'a> Iterator for Units<'a> {
    type Item = Result<Unit<'a>, UnitError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let Some(total) = unit_len_at(self.rest, 0) else {
            self.rest = &[];
            return Some(Err(UnitError::Frame(bad("truncated unit length"))));
        };
        if total > self.rest.len() {
            let error = bad(format!(
                "unit of {total} bytes overruns the batch ({} left)",
                self.rest.len()
            ));
            self.rest = &[];
            return Some(Err(UnitError::Frame(error)));
        }
        if total < 4 + UNIT_HEAD_LEN {
            self.rest = &[];
            return Some(Err(UnitError::Frame(bad("unit shorter than its head"))));
        }
        // The unit's bounds are sound from here: whatever is wrong inside is its own.
        let start = self.offset;
        let result = self.decode_one(total);
        self.rest = &self.rest[total..];
        self.offset += total as u64;
        Some(result.map_err(|error| UnitError::Refused {
            start,
            end: self.offset,
            error,
        }))
    }
}

impl<'a> Units<'a> {
    /// Decodes the unit of `total` bytes (length field included) at the front of `rest`.
    fn decode_one(&self, total: usize) -> Result<Unit<'a>, DecodeError> {
        let unit = &self.rest[4..total];
        let head = UnitHead {
            table: u32_at(unit, 0),
            first_slot: u16::from_le_bytes([unit[4], unit[5]]),
            last_slot: u16::from_le_bytes([unit[6], unit[7]]),
            epoch: u64_at(unit, 8),
            count: u32_at(unit, 16),
        };
        if head.first_slot > head.last_slot || head.last_slot >= ramlog_common::SLOT_COUNT {
            return Err(bad(format!(
                "unit names slots {}..={}, not a slot range",
                head.first_slot, head.last_slot
            )));
        }
        if head.count == 0 {
            return Err(bad("unit with no entries"));
        }
        let mut body = &unit[UNIT_HEAD_LEN..];
        // Each entry takes at least its head: a count larger than that is a lie.
        if head.count as usize > body.len() / ENTRY_HEAD_LEN {
            return Err(bad(format!(
                "unit claims {} entries in {} bytes",
                head.count,
                body.len()
            )));
        }
        let mut entries = Vec::with_capacity(head.count as usize);
        for _ in 0..head.count {
            if body.len() < ENTRY_HEAD_LEN {
                return Err(bad("truncated entry head"));
            }
            let kind = body[0];
            let key_len = u32_at(body, 1) as usize;
            let value_len = u32_at(body, 5) as usize;
            let version = u64_at(body, 9);
            let expiry = u64_at(body, 17);
            if let Err(e) = self.limits.check(key_len, value_len) {
                return Err(DecodeError {
                    status: match e {
                        ramlog_common::LimitError::KeyTooLarge { .. } => Status::KeyTooLarge,
                        ramlog_common::LimitError::ValueTooLarge { .. } => Status::ValueTooLarge,
                    },
                    message: format!("entry {e}"),
                });
            }
            let need = ENTRY_HEAD_LEN + key_len + value_len;
            if need > body.len() {
                return Err(bad("entry overruns its unit"));
            }
            let key = &body[ENTRY_HEAD_LEN..ENTRY_HEAD_LEN + key_len];
            let value = &body[ENTRY_HEAD_LEN + key_len..need];
            let value = match kind {
                KIND_PUT => Some(value),
                KIND_DELETE if value_len == 0 => None,
                KIND_DELETE => return Err(bad("a delete entry with a value")),
                other => return Err(bad(format!("unknown entry kind {other}"))),
            };
            if version == 0 {
                return Err(bad("entry with version 0"));
            }
            entries.push(ReplEntry {
                key,
                value,
                version,
                expiry,
            });
            body = &body[need..];
        }
        if !body.is_empty() {
            return Err(bad(format!(
                "{} bytes after the unit's last entry",
                body.len()
            )));
        }
        Ok(Unit {
            head,
            start: self.offset,
            end: self.offset + total as u64,
            entries,
        })
    }
}

/// Appends one frame with the native 16-byte header: `flags_or_status` is a request's flags (0)
/// or a response's status byte.
pub fn encode_frame(
    out: &mut Vec<u8>,
    request_id: u64,
    opcode: u8,
    flags_or_status: u8,
    body: &[u8],
) {
    out.extend_from_slice(
        &((crate::native::HEADER_LEN_AFTER_LENGTH as usize + body.len()) as u32).to_le_bytes(),
    );
    out.extend_from_slice(&request_id.to_le_bytes());
    out.push(opcode);
    out.push(flags_or_status);
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(body);
}

/// Appends a REPL_BATCH frame (header and body) carrying `units` from stream offset `start`.
pub fn encode_batch_frame(out: &mut Vec<u8>, start: u64, flags: u8, units: &[u8]) {
    let at = out.len();
    encode_frame(out, 0, REPL_BATCH, 0, &[]);
    encode_batch_body(out, start, flags, units);
    let frame_len = (out.len() - at - 4) as u32;
    out[at..at + 4].copy_from_slice(&frame_len.to_le_bytes());
}

/// Decodes a whole REPL_BATCH body (checksum, head and every unit) and re-encodes it, checking
/// that the encoding reproduces the body: what the fuzz target runs.
pub fn check_batch_roundtrip(body: &[u8], limits: Limits) -> Result<usize, DecodeError> {
    let batch = decode_batch(body)?;
    let mut units = Vec::new();
    let mut count = 0;
    let mut first_error = None;
    let mut refused = 0u64;
    for unit in batch.units(limits) {
        match unit {
            Ok(unit) => {
                encode_unit(&mut units, &unit.head, &unit.entries);
                count += 1;
            }
            Err(UnitError::Refused { start, end, error }) => {
                // A refused unit's range lies inside the batch, after the units before it.
                assert!(batch.start <= start && start < end && end <= batch.end());
                refused += end - start;
                first_error.get_or_insert(error);
            }
            Err(UnitError::Frame(e)) => return Err(e),
        }
    }
    if let Some(e) = first_error {
        assert!(refused > 0);
        return Err(e);
    }
    let mut again = Vec::new();
    encode_batch_body(&mut again, batch.start, batch.flags, &units);
    assert_eq!(again, body, "a decoded batch re-encodes to itself");
    Ok(count)
}

fn bad(message: impl Into<String>) -> DecodeError {
    DecodeError {
        status: Status::BadRequest,
        message: message.into(),
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        key_max_bytes: 1024,
        value_max_bytes: 4096,
    };

    fn head(table: u32) -> UnitHead {
        UnitHead {
            table,
            first_slot: 0,
            last_slot: 1023,
            epoch: 3,
            count: 0,
        }
    }

    fn sample() -> (Vec<u8>, u64) {
        let mut units = Vec::new();
        let a = [ReplEntry {
            key: b"k1",
            value: Some(b"v1"),
            version: 7,
            expiry: 0,
        }];
        let b = [
            ReplEntry {
                key: b"k2",
                value: Some(b"two"),
                version: 8,
                expiry: 99,
            },
            ReplEntry {
                key: b"k3",
                value: None,
                version: 8,
                expiry: 0,
            },
        ];
        let n1 = encode_unit(&mut units, &head(0), &a);
        assert_eq!(n1, unit_bytes(&a));
        let n2 = encode_unit(&mut units, &head(5), &b);
        assert_eq!(n2, unit_bytes(&b));
        let mut body = Vec::new();
        encode_batch_body(&mut body, 1000, FLAG_DURABLE, &units);
        (body, 1000 + (n1 + n2) as u64)
    }

    #[test]
    fn batches_round_trip_with_unit_ends() {
        let (body, end) = sample();
        let batch = decode_batch(&body).unwrap();
        assert_eq!((batch.start, batch.flags, batch.end()), (1000, 1, end));
        let units: Vec<Unit<'_>> = batch.units(LIMITS).map(Result::unwrap).collect();
        assert_eq!(units.len(), 2);
        assert_eq!(units[1].end, end);
        assert_eq!(units[1].head.table, 5);
        assert_eq!(units[1].entries[1].value, None);
        assert_eq!(units[1].entries[0].expiry, 99);
        assert_eq!(check_batch_roundtrip(&body, LIMITS).unwrap(), 2);
    }

    #[test]
    fn corrupt_truncated_and_oversized_input_is_refused() {
        let (body, _) = sample();
        // Any flipped bit fails the checksum.
        for i in 0..body.len() {
            let mut b = body.clone();
            b[i] ^= 0x10;
            assert!(decode_batch(&b).is_err(), "flip at {i}");
        }
        // A truncated body with a recomputed checksum fails in the units (except where the cut
        // falls between the two units: that is a valid batch of one).
        let first_end = BATCH_HEAD_LEN + unit_len_at(&body[BATCH_HEAD_LEN..], 0).unwrap();
        for cut in (BATCH_HEAD_LEN + 1..body.len()).filter(|&c| c != first_end) {
            let mut b = Vec::new();
            encode_batch_body(&mut b, 1000, 0, &body[BATCH_HEAD_LEN..cut]);
            let batch = decode_batch(&b).unwrap();
            assert!(
                batch.units(LIMITS).any(|u| u.is_err()),
                "truncated at {cut} must not decode"
            );
        }
        let small = Limits {
            key_max_bytes: 1,
            value_max_bytes: 4096,
        };
        let batch = decode_batch(&body).unwrap();
        let err = batch.units(small).next().unwrap().unwrap_err();
        assert_eq!(err.decode_error().status, Status::KeyTooLarge);
        // A unit refused for its content is refused alone: the next one still decodes.
        assert!(matches!(err, UnitError::Refused { start: 1000, .. }));
        assert!(batch.units(small).nth(1).unwrap().is_err());
        let tiny = Limits {
            key_max_bytes: 1024,
            value_max_bytes: 2,
        };
        let mut units = batch.units(tiny);
        let first = units.next().unwrap().expect("the first unit's value fits");
        let err = units.next().unwrap().unwrap_err();
        assert_eq!(err.decode_error().status, Status::ValueTooLarge);
        match err {
            UnitError::Refused { start, end, .. } => {
                assert_eq!(start, first.end);
                assert!(end > start);
            }
            other => panic!("a content refusal is tied to its unit, not {other:?}"),
        }
        assert!(Hello::decode(&[0u8; 5]).is_err());
        assert!(Ack::decode(
            &Ack {
                buffered: 1,
                durable: 2
            }
            .encode()
        )
        .is_err());
    }

    #[test]
    fn refusals_round_trip_and_bad_ones_are_errors() {
        let r = Refused {
            start: 10,
            end: 42,
            status: Status::KeyTooLarge,
            message: "entry key of 9 bytes is over the limit".into(),
        };
        let mut frame = Vec::new();
        r.encode_frame(&mut frame);
        let header = crate::native::parse_header(&frame, 1 << 20)
            .unwrap()
            .unwrap();
        assert_eq!(header.opcode, REPL_REFUSED);
        let status = Status::from_u8(header.flags_or_status);
        let back = Refused::decode(status, &frame[crate::native::HEADER_LEN..]).unwrap();
        assert_eq!(back, r);
        assert!(Refused::decode(Status::Ok, &frame[crate::native::HEADER_LEN..]).is_err());
        assert!(Refused::decode(status, &[0u8; 8]).is_err());
        let mut empty = [0u8; REFUSED_HEAD_LEN];
        empty[..8].copy_from_slice(&5u64.to_le_bytes());
        empty[8..].copy_from_slice(&5u64.to_le_bytes());
        assert!(Refused::decode(status, &empty).is_err());
    }

    #[test]
    fn a_broken_unit_length_ends_the_batch() {
        let (body, _) = sample();
        let mut broken = body.clone();
        // The first unit claims more bytes than the batch holds.
        broken[BATCH_HEAD_LEN..BATCH_HEAD_LEN + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let crc = crc32c::crc32c(&broken[4..]);
        broken[..4].copy_from_slice(&crc.to_le_bytes());
        let batch = decode_batch(&broken).unwrap();
        let items: Vec<_> = batch.units(LIMITS).collect();
        assert_eq!(items.len(), 1);
        assert!(matches!(items[0], Err(UnitError::Frame(_))));
    }

    #[test]
    fn hello_and_ack_round_trip() {
        let h = Hello {
            cluster_id: 1,
            master: 2,
            master_epoch: 3,
            map_version: 4,
            stream: 5,
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let a = Ack {
            buffered: 10,
            durable: 9,
        };
        assert_eq!(Ack::decode(&a.encode()).unwrap(), a);
    }
}
