//! ramlog's native binary protocol: handshake, frames, requests and responses.
//!
//! Owns the byte layout documented in `docs/protocol.md` ("Native protocol") and nothing else: no I/O,
//! no routing, no storage. Every length read from the wire is checked against the bytes actually present
//! (and against the caller's frame limit) before anything is allocated, so a decoder fed arbitrary bytes
//! returns an error and never panics or over-allocates.
//!
//! All integers are little-endian. A connection starts with a client hello ([`ClientHello`], 8 bytes) and a
//! server hello ([`ServerHello`], 24 bytes); after that both sides exchange frames of a 16-byte header
//! ([`FrameHeader`]) and a body. Requests carry a request id that the reply echoes, so a client may keep many
//! requests in flight on one connection and the server may answer them in any order.

use bytes::{BufMut, Bytes, BytesMut};
use ramlog_common::{TableId, Version};

/// The first four bytes of both hellos.
pub const MAGIC: [u8; 4] = *b"RLOG";
/// The protocol version this code speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// Size of the client hello.
pub const CLIENT_HELLO_LEN: usize = 8;
/// Size of the server hello.
pub const SERVER_HELLO_LEN: usize = 24;
/// Size of a frame header, including the 4-byte length field.
pub const HEADER_LEN: usize = 16;
/// Bytes of the header counted by the length field (everything after the length itself).
pub const HEADER_LEN_AFTER_LENGTH: u32 = 12;
/// Hard upper bound on any frame, whatever a configuration says (1 GiB).
pub const FRAME_BYTES_HARD_MAX: usize = 1 << 30;
/// Largest item count in one MULTI-GET or MULTI-PUT.
pub const BATCH_ITEMS_MAX: u32 = 65_536;
/// Most commands in one RESP_BATCH, and most arguments of one command in it.
pub const RESP_BATCH_MAX: u32 = 1 << 20;
/// Largest SCAN-KEYS count hint the server honours (larger hints are clamped).
pub const SCAN_COUNT_MAX: u32 = 65_536;
/// Most records a SCAN_FILTERED / SCAN_NEXT page may carry (larger requests are clamped).
pub const SCAN_PAGE_RECORDS_MAX: u32 = 10_000;

/// Server hello flag: the server requires AUTH before data operations.
pub const HELLO_FLAG_AUTH_REQUIRED: u16 = 0x0001;
/// Server hello flag: the server refuses this connection (for example too many connections). One error
/// frame with request id 0 follows, then the server closes.
pub const HELLO_FLAG_REFUSED: u16 = 0x0002;
/// Largest body of the error frame that follows a refusing hello.
pub const REFUSAL_BODY_MAX_BYTES: usize = 4096;

/// The longest hold a SNAPSHOT_CUT may ask for, microseconds (writes wait that long).
pub const SNAPSHOT_CUT_HOLD_MAX_US: u32 = 200_000;

/// Opcodes (byte 12 of a frame header).
pub mod opcode {
    pub const PING: u8 = 0x01;
    pub const AUTH: u8 = 0x02;
    pub const STATS: u8 = 0x03;
    pub const GET: u8 = 0x10;
    pub const PUT: u8 = 0x11;
    pub const DELETE: u8 = 0x12;
    pub const INCREMENT: u8 = 0x13;
    pub const MULTI_GET: u8 = 0x14;
    pub const MULTI_PUT: u8 = 0x15;
    pub const SCAN_KEYS: u8 = 0x16;
    pub const EXPIRE: u8 = 0x17;
    /// Open a read snapshot (MVCC) held by the connection.
    pub const SNAPSHOT_OPEN: u8 = 0x20;
    /// Release a read snapshot.
    pub const SNAPSHOT_RELEASE: u8 = 0x21;
    /// Scan a table's objects with a key filter, predicates, projection or aggregates.
    pub const SCAN_FILTERED: u8 = 0x22;
    /// Read one key at a snapshot.
    pub const GET_AT: u8 = 0x23;
    /// The next page of a paged SCAN_FILTERED.
    pub const SCAN_NEXT: u8 = 0x24;
    /// Close a paged scan before its end.
    pub const SCAN_CLOSE: u8 = 0x25;
    /// Set (or remove) a table's schema.
    pub const SET_SCHEMA: u8 = 0x26;
    /// Read a table's schema.
    pub const GET_SCHEMA: u8 = 0x27;
    /// A cluster scan's part on one tablet: SCAN_FILTERED of the slots of one tablet on its
    /// master, refused (WRONG_SERVER) unless this server masters that tablet at that epoch.
    pub const SCAN_TABLET: u8 = 0x28;
    /// A cluster snapshot's part on one server: at a wall-clock instant, hold every write of
    /// this server for a moment and open a snapshot held by the connection (see
    /// `docs/architecture.md`, "Cluster snapshots").
    pub const SNAPSHOT_CUT: u8 = 0x29;
    /// The cluster map this server holds (JSON, `ramlog_cluster::ClusterMap`); empty when the
    /// server is standalone.
    pub const CLUSTER_MAP: u8 = 0x04;
    /// Server to server: RESP commands a routing port forwards to the server that masters their
    /// keys, executed in order; the reply carries each command's RESP reply.
    pub const RESP_BATCH: u8 = 0x30;
    /// Server to server: RESP commands as a client sent them (their RESP bytes passed through, not
    /// re-encoded), executed in order; the reply is RESP_BATCH's.
    pub const RESP_PASS: u8 = 0x35;

    /// Server to server: replication (see [`crate::repl`]). Only `REPL_HELLO` is a request a
    /// native connection answers; it turns the connection into a replication stream.
    pub const REPL_HELLO: u8 = crate::repl::REPL_HELLO;
    pub const REPL_BATCH: u8 = crate::repl::REPL_BATCH;
    pub const REPL_ACK: u8 = crate::repl::REPL_ACK;
    pub const REPL_REFUSED: u8 = crate::repl::REPL_REFUSED;

    /// True for opcodes the protocol reserves for later versions (0x36..=0x3F for server-to-server
    /// traffic).
    pub fn is_reserved(op: u8) -> bool {
        matches!(op, 0x36..=0x3F)
    }

    /// A readable name, for messages and logs.
    pub fn name(op: u8) -> &'static str {
        match op {
            PING => "PING",
            AUTH => "AUTH",
            STATS => "STATS",
            GET => "GET",
            PUT => "PUT",
            DELETE => "DELETE",
            INCREMENT => "INCREMENT",
            MULTI_GET => "MULTI_GET",
            MULTI_PUT => "MULTI_PUT",
            SCAN_KEYS => "SCAN_KEYS",
            EXPIRE => "EXPIRE",
            SNAPSHOT_OPEN => "SNAPSHOT_OPEN",
            SNAPSHOT_RELEASE => "SNAPSHOT_RELEASE",
            SCAN_FILTERED => "SCAN_FILTERED",
            GET_AT => "GET_AT",
            SCAN_NEXT => "SCAN_NEXT",
            SCAN_CLOSE => "SCAN_CLOSE",
            SET_SCHEMA => "SET_SCHEMA",
            GET_SCHEMA => "GET_SCHEMA",
            SCAN_TABLET => "SCAN_TABLET",
            SNAPSHOT_CUT => "SNAPSHOT_CUT",
            CLUSTER_MAP => "CLUSTER_MAP",
            RESP_BATCH => "RESP_BATCH",
            RESP_PASS => "RESP_PASS",
            REPL_HELLO => "REPL_HELLO",
            REPL_BATCH => "REPL_BATCH",
            REPL_ACK => "REPL_ACK",
            REPL_REFUSED => "REPL_REFUSED",
            _ => "UNKNOWN",
        }
    }
}

/// Request flags (byte 13 of a request header).
pub mod flag {
    /// The body starts with a u64 table id; without it the table is 0.
    pub const TABLE: u8 = 0x01;
    /// PUT only: return the previous object.
    pub const RETURN_OLD: u8 = 0x02;
    /// Reserved: GET, MULTI_GET and SCAN_KEYS read from a snapshot (u64 snapshot id after the table).
    /// Snapshot reads are GET_AT and SCAN_FILTERED today.
    pub const SNAPSHOT: u8 = 0x04;
    /// Reserved: SCAN_KEYS carries a filter after the pattern.
    pub const FILTER: u8 = 0x08;
    /// Every bit this version defines (the others must be zero).
    pub const KNOWN: u8 = TABLE | RETURN_OLD | SNAPSHOT | FILTER;
}

/// Reply status (byte 13 of a response header). 0 is success; anything else is an error frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Ok,
    /// The PUT/DELETE condition did not hold. Detail: the current version, 0 if the key is absent.
    ConditionFailed,
    /// INCREMENT on a value that is not an ASCII decimal i64.
    NotAnInteger,
    /// INCREMENT would overflow an i64.
    IncrementOverflow,
    KeyTooLarge,
    ValueTooLarge,
    /// The server's memory budget is exhausted. The write was not applied.
    OutOfMemory,
    /// A MULTI-PUT's keys live on more than one tablet.
    CrossTablet,
    /// This server owns no tablet for the key (routing is stale).
    WrongServer,
    NoSuchTable,
    /// The snapshot was released by the server because it passed its age or retained-bytes bound.
    /// Detail: the snapshot's version.
    SnapshotTooOld,
    /// No snapshot with this id is open on this connection. Detail: the id.
    NoSuchSnapshot,
    /// No paged scan with this id is open on this connection. Detail: the id.
    NoSuchCursor,
    /// The connection holds as many snapshots or paged scans as allowed. Detail: the limit.
    TooManyOpen,
    /// The key holds a collection (a hash, list, set or sorted set written through RESP), which
    /// the native data operations do not read or change as a string.
    WrongType,
    /// The body does not follow the layout of its opcode.
    BadRequest,
    UnknownOpcode,
    /// A reserved opcode or flag that this server does not implement yet.
    Unsupported,
    /// The frame is larger than the server's limit. Detail: the limit in bytes.
    FrameTooLarge,
    /// Too many requests in flight on this connection. Detail: the limit.
    Busy,
    /// A data operation before a successful AUTH on a server with a password.
    NoAuth,
    /// Wrong password.
    AuthFailed,
    /// The server cannot log writes to its data directory (disk full, I/O error): writes are
    /// refused until it can again, reads go on. Also answers a write that was applied in memory
    /// but whose promised durability could not be reached; such a write is not acknowledged.
    WritesRefused,
    /// Replication: the sender's epoch for this tablet is older than one the backup has seen
    /// (its master was replaced), or the sender is not who the backup serves. Nothing of the
    /// frame is appended.
    Fenced,
    /// No server can serve the key's slot now: its master failed and no live backup has the
    /// memory to restore its tablet (the message says what is missing). Nothing was run; the
    /// tablet comes back by itself once a backup has room.
    ClusterDown,
    /// Anything else that went wrong inside the server.
    Internal,
    /// A status this version does not know (a newer server).
    Unknown(u8),
}

impl Status {
    pub fn to_u8(self) -> u8 {
        match self {
            Status::Ok => 0x00,
            Status::ConditionFailed => 0x01,
            Status::NotAnInteger => 0x02,
            Status::IncrementOverflow => 0x03,
            Status::KeyTooLarge => 0x04,
            Status::ValueTooLarge => 0x05,
            Status::OutOfMemory => 0x06,
            Status::CrossTablet => 0x07,
            Status::WrongServer => 0x08,
            Status::NoSuchTable => 0x09,
            Status::SnapshotTooOld => 0x0A,
            Status::NoSuchSnapshot => 0x0B,
            Status::NoSuchCursor => 0x0C,
            Status::TooManyOpen => 0x0D,
            Status::WrongType => 0x0E,
            Status::BadRequest => 0x10,
            Status::UnknownOpcode => 0x11,
            Status::Unsupported => 0x12,
            Status::FrameTooLarge => 0x13,
            Status::Busy => 0x14,
            Status::NoAuth => 0x15,
            Status::AuthFailed => 0x16,
            Status::WritesRefused => 0x17,
            Status::Fenced => 0x18,
            Status::ClusterDown => 0x19,
            Status::Internal => 0x1F,
            Status::Unknown(code) => code,
        }
    }

    pub fn from_u8(code: u8) -> Status {
        match code {
            0x00 => Status::Ok,
            0x01 => Status::ConditionFailed,
            0x02 => Status::NotAnInteger,
            0x03 => Status::IncrementOverflow,
            0x04 => Status::KeyTooLarge,
            0x05 => Status::ValueTooLarge,
            0x06 => Status::OutOfMemory,
            0x07 => Status::CrossTablet,
            0x08 => Status::WrongServer,
            0x09 => Status::NoSuchTable,
            0x0A => Status::SnapshotTooOld,
            0x0B => Status::NoSuchSnapshot,
            0x0C => Status::NoSuchCursor,
            0x0D => Status::TooManyOpen,
            0x0E => Status::WrongType,
            // 0x0E (SNAPSHOT_IN_USE) is reserved: no longer sent, and not to be reused.
            0x10 => Status::BadRequest,
            0x11 => Status::UnknownOpcode,
            0x12 => Status::Unsupported,
            0x13 => Status::FrameTooLarge,
            0x14 => Status::Busy,
            0x15 => Status::NoAuth,
            0x16 => Status::AuthFailed,
            0x17 => Status::WritesRefused,
            0x18 => Status::Fenced,
            0x19 => Status::ClusterDown,
            0x1F => Status::Internal,
            other => Status::Unknown(other),
        }
    }
}

/// Why bytes could not be decoded. For a request, `status` is what the server answers.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{status:?}: {message}")]
pub struct DecodeError {
    pub status: Status,
    pub message: String,
}

impl DecodeError {
    fn bad(message: impl Into<String>) -> Self {
        DecodeError {
            status: Status::BadRequest,
            message: message.into(),
        }
    }
}

/// Errors in the frame header itself, before the body is looked at.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length field is smaller than the header: the stream cannot be resynchronised.
    #[error("frame length {frame_len} is shorter than the 12-byte header")]
    TooShort { frame_len: u32 },
    /// The frame is larger than the limit. The stream can be resynchronised by skipping `skip_bytes`
    /// bytes after the header.
    #[error("frame of {frame_bytes} bytes exceeds the limit of {max_bytes} bytes")]
    TooLarge {
        frame_bytes: usize,
        max_bytes: usize,
        request_id: u64,
        opcode: u8,
        skip_bytes: usize,
    },
}

/// The fixed 16-byte header that starts every frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Bytes of body after the 16-byte header.
    pub body_len: usize,
    pub request_id: u64,
    pub opcode: u8,
    /// Request flags, or the status byte of a response.
    pub flags_or_status: u8,
    /// Bytes 14..16; zero in this version.
    pub reserved: u16,
}

impl FrameHeader {
    /// Total frame size including the header.
    pub fn frame_bytes(&self) -> usize {
        HEADER_LEN + self.body_len
    }
}

/// Parse the header at the start of `buf`. `Ok(None)` means fewer than 16 bytes are available.
/// `max_frame_bytes` bounds the whole frame (header included); it is clamped to [`FRAME_BYTES_HARD_MAX`].
pub fn parse_header(buf: &[u8], max_frame_bytes: usize) -> Result<Option<FrameHeader>, FrameError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let frame_len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if frame_len < HEADER_LEN_AFTER_LENGTH {
        return Err(FrameError::TooShort { frame_len });
    }
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let mut id = [0u8; 8];
    id.copy_from_slice(&buf[4..12]);
    let request_id = u64::from_le_bytes(id);
    let opcode = buf[12];
    let flags_or_status = buf[13];
    let reserved = u16::from_le_bytes([buf[14], buf[15]]);
    let body_len = (frame_len - HEADER_LEN_AFTER_LENGTH) as usize;
    let frame_bytes = HEADER_LEN + body_len;
    let max_bytes = max_frame_bytes.min(FRAME_BYTES_HARD_MAX);
    if frame_bytes > max_bytes {
        return Err(FrameError::TooLarge {
            frame_bytes,
            max_bytes,
            request_id,
            opcode,
            skip_bytes: body_len,
        });
    }
    Ok(Some(FrameHeader {
        body_len,
        request_id,
        opcode,
        flags_or_status,
        reserved,
    }))
}

/// Write a header whose length is patched by [`finish_frame`]; returns the frame's start offset.
fn begin_frame(out: &mut BytesMut, request_id: u64, opcode: u8, flags_or_status: u8) -> usize {
    let start = out.len();
    out.put_u32_le(0);
    out.put_u64_le(request_id);
    out.put_u8(opcode);
    out.put_u8(flags_or_status);
    out.put_u16_le(0);
    start
}

fn finish_frame(out: &mut BytesMut, start: usize) {
    let frame_len = out.len() - start - 4;
    debug_assert!(frame_len >= HEADER_LEN_AFTER_LENGTH as usize);
    let frame_len = u32::try_from(frame_len).unwrap_or(u32::MAX);
    out[start..start + 4].copy_from_slice(&frame_len.to_le_bytes());
}

fn put_bytes(out: &mut BytesMut, bytes: &[u8]) {
    // Lengths above u32::MAX cannot be framed; callers bound sizes far below that.
    assert!(
        bytes.len() <= u32::MAX as usize,
        "byte string too long to frame"
    );
    out.put_u32_le(bytes.len() as u32);
    out.put_slice(bytes);
}

/// A bounds-checked cursor over a body.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::bad(format!("body truncated in {what}")));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, DecodeError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn bytes(&mut self, what: &str) -> Result<&'a [u8], DecodeError> {
        let len = self.u32(what)? as usize;
        self.take(len, what)
    }
    /// A count of items that each take at least `min_item_bytes`; rejected before any allocation if the
    /// remaining body could not hold that many.
    fn count(&mut self, what: &str, min_item_bytes: usize, max: u32) -> Result<usize, DecodeError> {
        let count = self.u32(what)?;
        if count > max {
            return Err(DecodeError::bad(format!(
                "{what}: {count} items exceeds the limit of {max}"
            )));
        }
        let count = count as usize;
        if count.saturating_mul(min_item_bytes) > self.buf.len() {
            return Err(DecodeError::bad(format!(
                "{what}: {count} items cannot fit in the body"
            )));
        }
        Ok(count)
    }
    fn finish(&self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::bad(format!(
                "{} trailing bytes after the body",
                self.buf.len()
            )))
        }
    }
}

/// The write condition of PUT and DELETE.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Condition {
    #[default]
    None,
    IfAbsent,
    IfExists,
    IfVersion(Version),
}

impl Condition {
    fn encode(self, out: &mut BytesMut) {
        let (kind, version) = match self {
            Condition::None => (0u8, 0u64),
            Condition::IfAbsent => (1, 0),
            Condition::IfExists => (2, 0),
            Condition::IfVersion(v) => (3, v),
        };
        out.put_u8(kind);
        out.put_u64_le(version);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let kind = r.u8("condition")?;
        let version = r.u64("condition version")?;
        match kind {
            0 => Ok(Condition::None),
            1 => Ok(Condition::IfAbsent),
            2 => Ok(Condition::IfExists),
            3 => Ok(Condition::IfVersion(version)),
            other => Err(DecodeError::bad(format!("unknown condition kind {other}"))),
        }
    }
}

/// The expiry of PUT and EXPIRE.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Expiry {
    /// No expiry (a PUT clears any previous one).
    #[default]
    None,
    /// Expire this many milliseconds after the server receives the request.
    AfterMs(u64),
    /// Expire at this unix time in milliseconds.
    AtUnixMs(u64),
    /// Keep the previous object's expiry (PUT only).
    Keep,
}

impl Expiry {
    fn encode(self, out: &mut BytesMut) {
        let (kind, ms) = match self {
            Expiry::None => (0u8, 0u64),
            Expiry::AfterMs(ms) => (1, ms),
            Expiry::AtUnixMs(ms) => (2, ms),
            Expiry::Keep => (3, 0),
        };
        out.put_u8(kind);
        out.put_u64_le(ms);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let kind = r.u8("expiry")?;
        let ms = r.u64("expiry time")?;
        match kind {
            0 => Ok(Expiry::None),
            1 => Ok(Expiry::AfterMs(ms)),
            2 => Ok(Expiry::AtUnixMs(ms)),
            3 => Ok(Expiry::Keep),
            other => Err(DecodeError::bad(format!("unknown expiry kind {other}"))),
        }
    }
}

/// A request, borrowing keys and values from the frame it was decoded from (or from the caller).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request<'a> {
    Ping {
        payload: &'a [u8],
    },
    Auth {
        password: &'a [u8],
    },
    Stats,
    Get {
        table: TableId,
        key: &'a [u8],
    },
    Put {
        table: TableId,
        key: &'a [u8],
        value: &'a [u8],
        condition: Condition,
        expiry: Expiry,
        return_old: bool,
    },
    Delete {
        table: TableId,
        key: &'a [u8],
        condition: Condition,
    },
    Increment {
        table: TableId,
        key: &'a [u8],
        delta: i64,
    },
    Expire {
        table: TableId,
        key: &'a [u8],
        expiry: Expiry,
    },
    MultiGet {
        table: TableId,
        keys: Vec<&'a [u8]>,
    },
    MultiPut {
        table: TableId,
        items: Vec<(&'a [u8], &'a [u8])>,
    },
    ScanKeys {
        table: TableId,
        cursor: u64,
        count: u32,
        pattern: &'a [u8],
    },
    /// Open a snapshot held by this connection.
    SnapshotOpen,
    SnapshotRelease {
        snapshot: u64,
    },
    /// `snapshot` 0 = a fresh snapshot for this scan. `query` is `ramlog_query::Query::to_bytes`.
    ScanFiltered {
        table: TableId,
        snapshot: u64,
        max_records: u32,
        query: &'a [u8],
    },
    GetAt {
        table: TableId,
        snapshot: u64,
        key: &'a [u8],
    },
    /// SCAN_FILTERED of the tablet of `table` that covers exactly `first_slot..=last_slot` at
    /// `epoch`, on its master (objects of other slots the server holds are left out): at a
    /// fresh snapshot (`snapshot` 0), or at a snapshot of this connection that SNAPSHOT_CUT took
    /// while this server mastered that tablet at that epoch. `query` is
    /// `ramlog_query::Query::to_bytes`.
    ScanTablet {
        table: TableId,
        first_slot: u16,
        last_slot: u16,
        epoch: u64,
        snapshot: u64,
        /// Read the tablet on its mirror (this server must be it, its memory complete) rather
        /// than on its master; `snapshot` must be 0.
        from_mirror: bool,
        /// Only keys of these slots (within the tablet's): one step of a resumable scan.
        only_slots: (u16, u16),
        max_records: u32,
        query: &'a [u8],
    },
    /// At `at_unix_ns` (wall clock, nanoseconds since the Unix epoch; at once if past), hold
    /// every write of this server for `hold_us` microseconds and open a snapshot, held by the
    /// connection, at the version the clock shows while they are held; then wait until the
    /// backups of `table`'s tablets here acknowledged every write the snapshot sees.
    SnapshotCut {
        table: TableId,
        at_unix_ns: u64,
        hold_us: u32,
    },
    ScanNext {
        cursor: u64,
        max_records: u32,
    },
    ScanClose {
        cursor: u64,
    },
    /// `schema` is `ramlog_query::Schema::to_bytes`; empty removes the table's schema.
    SetSchema {
        table: TableId,
        schema: &'a [u8],
    },
    GetSchema {
        table: TableId,
    },
    ClusterMap,
    /// RESP commands (each a list of arguments, the name first) to run in order with RESP
    /// protocol version `protocol` (2 or 3).
    RespBatch {
        protocol: u8,
        commands: Vec<Vec<&'a [u8]>>,
    },
    /// `count` RESP commands, as RESP arrays of bulk strings back to back in `resp`, to run in
    /// order with RESP protocol version `protocol` (2 or 3); [`resp_pass_commands`] splits them.
    RespPass {
        protocol: u8,
        count: u32,
        resp: &'a [u8],
    },
}

impl<'a> Request<'a> {
    pub fn opcode(&self) -> u8 {
        match self {
            Request::Ping { .. } => opcode::PING,
            Request::Auth { .. } => opcode::AUTH,
            Request::Stats => opcode::STATS,
            Request::Get { .. } => opcode::GET,
            Request::Put { .. } => opcode::PUT,
            Request::Delete { .. } => opcode::DELETE,
            Request::Increment { .. } => opcode::INCREMENT,
            Request::Expire { .. } => opcode::EXPIRE,
            Request::MultiGet { .. } => opcode::MULTI_GET,
            Request::MultiPut { .. } => opcode::MULTI_PUT,
            Request::ScanKeys { .. } => opcode::SCAN_KEYS,
            Request::SnapshotOpen => opcode::SNAPSHOT_OPEN,
            Request::SnapshotRelease { .. } => opcode::SNAPSHOT_RELEASE,
            Request::ScanFiltered { .. } => opcode::SCAN_FILTERED,
            Request::ScanTablet { .. } => opcode::SCAN_TABLET,
            Request::SnapshotCut { .. } => opcode::SNAPSHOT_CUT,
            Request::GetAt { .. } => opcode::GET_AT,
            Request::ScanNext { .. } => opcode::SCAN_NEXT,
            Request::ScanClose { .. } => opcode::SCAN_CLOSE,
            Request::SetSchema { .. } => opcode::SET_SCHEMA,
            Request::GetSchema { .. } => opcode::GET_SCHEMA,
            Request::ClusterMap => opcode::CLUSTER_MAP,
            Request::RespBatch { .. } => opcode::RESP_BATCH,
            Request::RespPass { .. } => opcode::RESP_PASS,
        }
    }

    fn table(&self) -> Option<TableId> {
        match self {
            Request::Ping { .. }
            | Request::Auth { .. }
            | Request::Stats
            | Request::SnapshotOpen
            | Request::SnapshotRelease { .. }
            | Request::ScanNext { .. }
            | Request::ScanClose { .. }
            | Request::ClusterMap
            | Request::RespBatch { .. }
            | Request::RespPass { .. } => None,
            Request::Get { table, .. }
            | Request::Put { table, .. }
            | Request::Delete { table, .. }
            | Request::Increment { table, .. }
            | Request::Expire { table, .. }
            | Request::MultiGet { table, .. }
            | Request::MultiPut { table, .. }
            | Request::ScanKeys { table, .. }
            | Request::ScanFiltered { table, .. }
            | Request::ScanTablet { table, .. }
            | Request::SnapshotCut { table, .. }
            | Request::GetAt { table, .. }
            | Request::SetSchema { table, .. }
            | Request::GetSchema { table } => Some(*table),
        }
    }

    /// Append this request as one frame to `out`.
    pub fn encode(&self, request_id: u64, out: &mut BytesMut) {
        let table = self.table().filter(|&t| t != 0);
        let mut flags = if table.is_some() { flag::TABLE } else { 0 };
        if let Request::Put {
            return_old: true, ..
        } = self
        {
            flags |= flag::RETURN_OLD;
        }
        let start = begin_frame(out, request_id, self.opcode(), flags);
        if let Some(table) = table {
            out.put_u64_le(table);
        }
        match self {
            Request::Ping { payload } => put_bytes(out, payload),
            Request::Auth { password } => put_bytes(out, password),
            Request::Stats => {}
            Request::Get { key, .. } => put_bytes(out, key),
            Request::Put {
                key,
                value,
                condition,
                expiry,
                ..
            } => {
                put_bytes(out, key);
                put_bytes(out, value);
                condition.encode(out);
                expiry.encode(out);
            }
            Request::Delete { key, condition, .. } => {
                put_bytes(out, key);
                condition.encode(out);
            }
            Request::Increment { key, delta, .. } => {
                put_bytes(out, key);
                out.put_i64_le(*delta);
            }
            Request::Expire { key, expiry, .. } => {
                put_bytes(out, key);
                expiry.encode(out);
            }
            Request::MultiGet { keys, .. } => {
                out.put_u32_le(keys.len() as u32);
                for key in keys {
                    put_bytes(out, key);
                }
            }
            Request::MultiPut { items, .. } => {
                out.put_u32_le(items.len() as u32);
                for (key, value) in items {
                    put_bytes(out, key);
                    put_bytes(out, value);
                }
            }
            Request::ScanKeys {
                cursor,
                count,
                pattern,
                ..
            } => {
                out.put_u64_le(*cursor);
                out.put_u32_le(*count);
                put_bytes(out, pattern);
            }
            Request::SnapshotOpen | Request::GetSchema { .. } => {}
            Request::SnapshotRelease { snapshot } => out.put_u64_le(*snapshot),
            Request::ScanFiltered {
                snapshot,
                max_records,
                query,
                ..
            } => {
                out.put_u64_le(*snapshot);
                out.put_u32_le(*max_records);
                put_bytes(out, query);
            }
            Request::GetAt { snapshot, key, .. } => {
                out.put_u64_le(*snapshot);
                put_bytes(out, key);
            }
            Request::ScanTablet {
                first_slot,
                last_slot,
                epoch,
                snapshot,
                from_mirror,
                only_slots,
                max_records,
                query,
                ..
            } => {
                out.put_u16_le(*first_slot);
                out.put_u16_le(*last_slot);
                out.put_u64_le(*epoch);
                out.put_u64_le(*snapshot);
                out.put_u8(u8::from(*from_mirror));
                out.put_u16_le(only_slots.0);
                out.put_u16_le(only_slots.1);
                out.put_u32_le(*max_records);
                put_bytes(out, query);
            }
            Request::SnapshotCut {
                at_unix_ns,
                hold_us,
                ..
            } => {
                out.put_u64_le(*at_unix_ns);
                out.put_u32_le(*hold_us);
            }
            Request::ScanNext {
                cursor,
                max_records,
            } => {
                out.put_u64_le(*cursor);
                out.put_u32_le(*max_records);
            }
            Request::ScanClose { cursor } => out.put_u64_le(*cursor),
            Request::SetSchema { schema, .. } => put_bytes(out, schema),
            Request::ClusterMap => {}
            Request::RespBatch { protocol, commands } => {
                out.put_u8(*protocol);
                out.put_u32_le(commands.len() as u32);
                for args in commands {
                    out.put_u32_le(args.len() as u32);
                    for arg in args {
                        put_bytes(out, arg);
                    }
                }
            }
            Request::RespPass {
                protocol,
                count,
                resp,
            } => {
                out.put_u8(*protocol);
                out.put_u32_le(*count);
                out.put_slice(resp);
            }
        }
        finish_frame(out, start);
    }

    /// Decode a request body. `opcode` and `flags` come from the header.
    pub fn decode(opcode: u8, flags: u8, body: &'a [u8]) -> Result<Request<'a>, DecodeError> {
        if opcode::is_reserved(opcode) {
            return Err(DecodeError {
                status: Status::Unsupported,
                message: format!(
                    "opcode 0x{opcode:02x} ({}) is reserved",
                    opcode::name(opcode)
                ),
            });
        }
        if flags & !flag::KNOWN != 0 {
            return Err(DecodeError::bad(format!(
                "unknown flag bits 0x{:02x}",
                flags & !flag::KNOWN
            )));
        }
        if flags & (flag::SNAPSHOT | flag::FILTER) != 0 {
            return Err(DecodeError {
                status: Status::Unsupported,
                message: "snapshot and filter flags are reserved".into(),
            });
        }
        if flags & flag::RETURN_OLD != 0 && opcode != opcode::PUT {
            return Err(DecodeError::bad("RETURN_OLD is valid on PUT only"));
        }
        let mut r = Reader { buf: body };
        let keyed = matches!(
            opcode,
            opcode::GET
                | opcode::PUT
                | opcode::DELETE
                | opcode::INCREMENT
                | opcode::EXPIRE
                | opcode::MULTI_GET
                | opcode::MULTI_PUT
                | opcode::SCAN_KEYS
                | opcode::SCAN_FILTERED
                | opcode::SCAN_TABLET
                | opcode::SNAPSHOT_CUT
                | opcode::GET_AT
                | opcode::SET_SCHEMA
                | opcode::GET_SCHEMA
        );
        let table = if flags & flag::TABLE != 0 {
            if !keyed {
                return Err(DecodeError::bad(
                    "TABLE flag on an operation without a table",
                ));
            }
            r.u64("table")?
        } else {
            0
        };
        let request = match opcode {
            opcode::PING => Request::Ping {
                payload: r.bytes("payload")?,
            },
            opcode::AUTH => Request::Auth {
                password: r.bytes("password")?,
            },
            opcode::STATS => Request::Stats,
            opcode::GET => Request::Get {
                table,
                key: r.bytes("key")?,
            },
            opcode::PUT => {
                let key = r.bytes("key")?;
                let value = r.bytes("value")?;
                let condition = Condition::decode(&mut r)?;
                let expiry = Expiry::decode(&mut r)?;
                Request::Put {
                    table,
                    key,
                    value,
                    condition,
                    expiry,
                    return_old: flags & flag::RETURN_OLD != 0,
                }
            }
            opcode::DELETE => {
                let key = r.bytes("key")?;
                Request::Delete {
                    table,
                    key,
                    condition: Condition::decode(&mut r)?,
                }
            }
            opcode::INCREMENT => {
                let key = r.bytes("key")?;
                Request::Increment {
                    table,
                    key,
                    delta: r.u64("delta")? as i64,
                }
            }
            opcode::EXPIRE => {
                let key = r.bytes("key")?;
                let expiry = Expiry::decode(&mut r)?;
                if expiry == Expiry::Keep {
                    return Err(DecodeError::bad("EXPIRE cannot keep the expiry"));
                }
                Request::Expire { table, key, expiry }
            }
            opcode::MULTI_GET => {
                let count = r.count("keys", 4, BATCH_ITEMS_MAX)?;
                let mut keys = Vec::with_capacity(count);
                for _ in 0..count {
                    keys.push(r.bytes("key")?);
                }
                Request::MultiGet { table, keys }
            }
            opcode::MULTI_PUT => {
                let count = r.count("items", 8, BATCH_ITEMS_MAX)?;
                let mut items = Vec::with_capacity(count);
                for _ in 0..count {
                    let key = r.bytes("key")?;
                    let value = r.bytes("value")?;
                    items.push((key, value));
                }
                Request::MultiPut { table, items }
            }
            opcode::SCAN_KEYS => {
                let cursor = r.u64("cursor")?;
                let count = r.u32("count")?;
                Request::ScanKeys {
                    table,
                    cursor,
                    count,
                    pattern: r.bytes("pattern")?,
                }
            }
            opcode::SNAPSHOT_OPEN => Request::SnapshotOpen,
            opcode::SNAPSHOT_RELEASE => Request::SnapshotRelease {
                snapshot: r.u64("snapshot id")?,
            },
            opcode::SCAN_FILTERED => {
                let snapshot = r.u64("snapshot id")?;
                let max_records = r.u32("max records")?;
                Request::ScanFiltered {
                    table,
                    snapshot,
                    max_records,
                    query: r.bytes("query")?,
                }
            }
            opcode::GET_AT => {
                let snapshot = r.u64("snapshot id")?;
                Request::GetAt {
                    table,
                    snapshot,
                    key: r.bytes("key")?,
                }
            }
            opcode::SCAN_TABLET => {
                let first_slot = r.u16("first slot")?;
                let last_slot = r.u16("last slot")?;
                if first_slot > last_slot || last_slot >= 16384 {
                    return Err(DecodeError::bad(format!(
                        "slots {first_slot}..={last_slot} are not a slot range"
                    )));
                }
                let epoch = r.u64("epoch")?;
                let snapshot = r.u64("snapshot id")?;
                let from_mirror = match r.u8("from mirror")? {
                    0 => false,
                    1 if snapshot == 0 => true,
                    1 => {
                        return Err(DecodeError::bad(
                            "a scan on a mirror reads at a fresh snapshot (snapshot id 0)",
                        ))
                    }
                    other => {
                        return Err(DecodeError::bad(format!(
                            "from-mirror is {other}, not 0 or 1"
                        )))
                    }
                };
                let only = (r.u16("first slot scanned")?, r.u16("last slot scanned")?);
                if only.0 < first_slot || only.0 > only.1 || only.1 > last_slot {
                    return Err(DecodeError::bad(format!(
                        "slots {}..={} are not a range of the tablet's {first_slot}..={last_slot}",
                        only.0, only.1
                    )));
                }
                let max_records = r.u32("max records")?;
                Request::ScanTablet {
                    table,
                    first_slot,
                    last_slot,
                    epoch,
                    snapshot,
                    from_mirror,
                    only_slots: only,
                    max_records,
                    query: r.bytes("query")?,
                }
            }
            opcode::SNAPSHOT_CUT => {
                let at_unix_ns = r.u64("instant")?;
                let hold_us = r.u32("hold")?;
                if hold_us > SNAPSHOT_CUT_HOLD_MAX_US {
                    return Err(DecodeError::bad(format!(
                        "a hold of {hold_us} us is longer than the limit of {SNAPSHOT_CUT_HOLD_MAX_US} us"
                    )));
                }
                Request::SnapshotCut {
                    table,
                    at_unix_ns,
                    hold_us,
                }
            }
            opcode::SCAN_NEXT => {
                let cursor = r.u64("cursor id")?;
                Request::ScanNext {
                    cursor,
                    max_records: r.u32("max records")?,
                }
            }
            opcode::SCAN_CLOSE => Request::ScanClose {
                cursor: r.u64("cursor id")?,
            },
            opcode::SET_SCHEMA => Request::SetSchema {
                table,
                schema: r.bytes("schema")?,
            },
            opcode::GET_SCHEMA => Request::GetSchema { table },
            opcode::CLUSTER_MAP => Request::ClusterMap,
            opcode::RESP_BATCH => {
                let protocol = r.u8("protocol")?;
                if !(2..=3).contains(&protocol) {
                    return Err(DecodeError::bad(format!("RESP protocol {protocol}")));
                }
                let count = r.count("commands", 4, RESP_BATCH_MAX)?;
                let mut commands = Vec::with_capacity(count);
                for _ in 0..count {
                    let argc = r.count("arguments", 4, RESP_BATCH_MAX)?;
                    if argc == 0 {
                        return Err(DecodeError::bad("a command without a name"));
                    }
                    let mut args = Vec::with_capacity(argc);
                    for _ in 0..argc {
                        args.push(r.bytes("argument")?);
                    }
                    commands.push(args);
                }
                Request::RespBatch { protocol, commands }
            }
            opcode::RESP_PASS => {
                let protocol = r.u8("protocol")?;
                if !(2..=3).contains(&protocol) {
                    return Err(DecodeError::bad(format!("RESP protocol {protocol}")));
                }
                // Each command takes at least `*1\r\n$0\r\n\r\n`.
                let count = r.count("commands", 10, RESP_BATCH_MAX)?;
                let resp = r.take(r.buf.len(), "commands")?;
                Request::RespPass {
                    protocol,
                    count: count as u32,
                    resp,
                }
            }
            other => {
                return Err(DecodeError {
                    status: Status::UnknownOpcode,
                    message: format!("unknown opcode 0x{other:02x}"),
                })
            }
        };
        r.finish()?;
        Ok(request)
    }
}

/// A stored object as the protocol carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Object {
    pub value: Bytes,
    pub version: Version,
    /// Unix milliseconds; 0 = no expiry.
    pub expire_at_ms: u64,
}

/// An error frame's contents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorReply {
    pub status: Status,
    /// Status-specific number: CONDITION_FAILED gives the current version (0 = absent), FRAME_TOO_LARGE
    /// and BUSY give the limit; otherwise 0.
    pub detail: u64,
    pub message: String,
}

/// A reply. Every variant but `Error` is sent with status OK.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    Pong(Bytes),
    AuthOk,
    /// A UTF-8 JSON object of server figures.
    Stats(Bytes),
    Get(Option<Object>),
    /// The new version, and the previous object if RETURN_OLD was asked and one existed.
    Put {
        version: Version,
        old: Option<Object>,
    },
    /// The delete's version if the key existed.
    Delete(Option<Version>),
    Increment {
        value: i64,
        version: Version,
    },
    /// The new version if the key existed.
    Expire(Option<Version>),
    MultiGet(Vec<Option<Object>>),
    MultiPut {
        version: Version,
    },
    /// The cursor to continue from (0 = done) and this batch of keys.
    ScanKeys {
        cursor: u64,
        keys: Vec<Bytes>,
    },
    /// A new snapshot: its id on this connection and its read version.
    SnapshotOpen {
        snapshot: u64,
        version: Version,
    },
    SnapshotReleased,
    /// A SNAPSHOT_CUT's snapshot (id on this connection, read version) and when this server
    /// held its writes (wall clock, nanoseconds since the Unix epoch): from when every write was
    /// held to when they went on.
    SnapshotCut {
        snapshot: u64,
        version: Version,
        held_from_ns: u64,
        held_to_ns: u64,
    },
    /// The key's object at the snapshot.
    GetAt(Option<Object>),
    /// A page of records (reply to SCAN_FILTERED of a record query, and to SCAN_NEXT). `cursor` is the
    /// paged scan to continue with SCAN_NEXT, 0 when this is the last page.
    ScanPage {
        cursor: u64,
        snapshot_version: Version,
        records: Vec<Record>,
    },
    /// The reply to SCAN_FILTERED of an aggregate query. `values` is the aggregates' values in query
    /// order, in `ramlog_query::encode_values` form.
    ScanAggregates {
        snapshot_version: Version,
        matched: u64,
        malformed: u64,
        values: Bytes,
    },
    ScanClosed,
    SchemaSet,
    /// The table's schema (`Schema::to_bytes`); empty when the table has none.
    Schema(Bytes),
    /// The cluster map as JSON; empty from a standalone server.
    ClusterMap(Bytes),
    /// Each command's RESP reply, in order.
    RespBatch(Vec<Bytes>),
    Error(ErrorReply),
}

/// One record of a scan page: the key, the value (projected when the query projects), its version and
/// expiry (unix ms, 0 = none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub key: Bytes,
    pub value: Bytes,
    pub version: Version,
    pub expire_at_ms: u64,
}

/// Kind byte of a scan reply.
pub const SCAN_REPLY_RECORDS: u8 = 0;
/// Kind byte of a scan reply.
pub const SCAN_REPLY_AGGREGATES: u8 = 1;

/// Bytes one record adds to a scan page.
pub fn record_wire_bytes(key_len: usize, value_len: usize) -> usize {
    4 + key_len + 8 + 8 + 4 + value_len
}

/// Append one record of a scan page (`bytes key`, `u64 version`, `u64 expire_at_ms`, `bytes value`).
pub fn put_record(
    out: &mut BytesMut,
    key: &[u8],
    value: &[u8],
    version: Version,
    expire_at_ms: u64,
) {
    put_bytes(out, key);
    out.put_u64_le(version);
    out.put_u64_le(expire_at_ms);
    put_bytes(out, value);
}

/// Append the start of a scan page frame (header, kind, cursor, snapshot version, record count); the
/// caller appends `count` records with [`put_record`] and then calls [`finish_reply_frame`].
pub fn begin_scan_page(
    out: &mut BytesMut,
    request_id: u64,
    opcode: u8,
    cursor: u64,
    snapshot_version: Version,
    count: u32,
) -> usize {
    let start = begin_frame(out, request_id, opcode, Status::Ok.to_u8());
    out.put_u8(SCAN_REPLY_RECORDS);
    out.put_u64_le(cursor);
    out.put_u64_le(snapshot_version);
    out.put_u32_le(count);
    start
}

/// Patch the length of a frame begun at `start` (see [`begin_scan_page`]).
pub fn finish_reply_frame(out: &mut BytesMut, start: usize) {
    finish_frame(out, start);
}

fn put_object(out: &mut BytesMut, object: &Option<Object>) {
    match object {
        None => out.put_u8(0),
        Some(o) => {
            out.put_u8(1);
            out.put_u64_le(o.version);
            out.put_u64_le(o.expire_at_ms);
            put_bytes(out, &o.value);
        }
    }
}

fn put_opt_version(out: &mut BytesMut, version: Option<Version>) {
    out.put_u8(version.is_some() as u8);
    out.put_u64_le(version.unwrap_or(0));
}

/// Append an error frame.
pub fn encode_error(
    out: &mut BytesMut,
    request_id: u64,
    opcode: u8,
    status: Status,
    detail: u64,
    message: &str,
) {
    debug_assert!(status != Status::Ok);
    let start = begin_frame(out, request_id, opcode, status.to_u8());
    out.put_u64_le(detail);
    put_bytes(out, message.as_bytes());
    finish_frame(out, start);
}

impl Response {
    /// Append this reply as one frame answering `request_id`, which was a request with `opcode`.
    pub fn encode(&self, request_id: u64, opcode: u8, out: &mut BytesMut) {
        if let Response::Error(e) = self {
            encode_error(out, request_id, opcode, e.status, e.detail, &e.message);
            return;
        }
        let start = begin_frame(out, request_id, opcode, Status::Ok.to_u8());
        match self {
            Response::Pong(payload) => put_bytes(out, payload),
            Response::AuthOk => {}
            Response::Stats(json) => put_bytes(out, json),
            Response::Get(object) => put_object(out, object),
            Response::Put { version, old } => {
                out.put_u64_le(*version);
                put_object(out, old);
            }
            Response::Delete(version) | Response::Expire(version) => put_opt_version(out, *version),
            Response::Increment { value, version } => {
                out.put_i64_le(*value);
                out.put_u64_le(*version);
            }
            Response::MultiGet(objects) => {
                out.put_u32_le(objects.len() as u32);
                for object in objects {
                    put_object(out, object);
                }
            }
            Response::MultiPut { version } => out.put_u64_le(*version),
            Response::ScanKeys { cursor, keys } => {
                out.put_u64_le(*cursor);
                out.put_u32_le(keys.len() as u32);
                for key in keys {
                    put_bytes(out, key);
                }
            }
            Response::SnapshotOpen { snapshot, version } => {
                out.put_u64_le(*snapshot);
                out.put_u64_le(*version);
            }
            Response::SnapshotCut {
                snapshot,
                version,
                held_from_ns,
                held_to_ns,
            } => {
                out.put_u64_le(*snapshot);
                out.put_u64_le(*version);
                out.put_u64_le(*held_from_ns);
                out.put_u64_le(*held_to_ns);
            }
            Response::SnapshotReleased | Response::ScanClosed | Response::SchemaSet => {}
            Response::GetAt(object) => put_object(out, object),
            Response::ScanPage {
                cursor,
                snapshot_version,
                records,
            } => {
                out.put_u8(SCAN_REPLY_RECORDS);
                out.put_u64_le(*cursor);
                out.put_u64_le(*snapshot_version);
                out.put_u32_le(records.len() as u32);
                for r in records {
                    put_record(out, &r.key, &r.value, r.version, r.expire_at_ms);
                }
            }
            Response::ScanAggregates {
                snapshot_version,
                matched,
                malformed,
                values,
            } => {
                out.put_u8(SCAN_REPLY_AGGREGATES);
                out.put_u64_le(*snapshot_version);
                out.put_u64_le(*matched);
                out.put_u64_le(*malformed);
                put_bytes(out, values);
            }
            Response::Schema(schema) | Response::ClusterMap(schema) => put_bytes(out, schema),
            Response::RespBatch(replies) => {
                out.put_u32_le(replies.len() as u32);
                for reply in replies {
                    put_bytes(out, reply);
                }
            }
            Response::Error(_) => unreachable!("handled above"),
        }
        finish_frame(out, start);
    }

    /// Decode a reply body. `opcode` and `status` come from the header; `body` is the frame's body
    /// (values are sliced out of it without copying).
    pub fn decode(opcode: u8, status: u8, body: Bytes) -> Result<Response, DecodeError> {
        let mut r = Reader { buf: &body };
        let status = Status::from_u8(status);
        if status != Status::Ok {
            let detail = r.u64("error detail")?;
            let message = String::from_utf8_lossy(r.bytes("error message")?).into_owned();
            r.finish()?;
            return Ok(Response::Error(ErrorReply {
                status,
                detail,
                message,
            }));
        }
        let slice = |s: &[u8]| body.slice_ref(s);
        let object = |r: &mut Reader<'_>| -> Result<Option<Object>, DecodeError> {
            match r.u8("object presence")? {
                0 => Ok(None),
                1 => {
                    let version = r.u64("version")?;
                    let expire_at_ms = r.u64("expiry")?;
                    let value = slice(r.bytes("value")?);
                    Ok(Some(Object {
                        value,
                        version,
                        expire_at_ms,
                    }))
                }
                other => Err(DecodeError::bad(format!("object presence byte {other}"))),
            }
        };
        let opt_version = |r: &mut Reader<'_>| -> Result<Option<Version>, DecodeError> {
            let present = r.u8("presence")?;
            let version = r.u64("version")?;
            match present {
                0 => Ok(None),
                1 => Ok(Some(version)),
                other => Err(DecodeError::bad(format!("presence byte {other}"))),
            }
        };
        let response = match opcode {
            opcode::PING => Response::Pong(slice(r.bytes("payload")?)),
            opcode::AUTH => Response::AuthOk,
            opcode::STATS => Response::Stats(slice(r.bytes("stats")?)),
            opcode::GET => Response::Get(object(&mut r)?),
            opcode::PUT => {
                let version = r.u64("version")?;
                Response::Put {
                    version,
                    old: object(&mut r)?,
                }
            }
            opcode::DELETE => Response::Delete(opt_version(&mut r)?),
            opcode::EXPIRE => Response::Expire(opt_version(&mut r)?),
            opcode::INCREMENT => {
                let value = r.u64("value")? as i64;
                Response::Increment {
                    value,
                    version: r.u64("version")?,
                }
            }
            opcode::MULTI_GET => {
                let count = r.count("objects", 1, BATCH_ITEMS_MAX)?;
                let mut objects = Vec::with_capacity(count);
                for _ in 0..count {
                    objects.push(object(&mut r)?);
                }
                Response::MultiGet(objects)
            }
            opcode::MULTI_PUT => Response::MultiPut {
                version: r.u64("version")?,
            },
            opcode::SCAN_KEYS => {
                let cursor = r.u64("cursor")?;
                let count = r.count("keys", 4, u32::MAX)?;
                let mut keys = Vec::with_capacity(count);
                for _ in 0..count {
                    keys.push(slice(r.bytes("key")?));
                }
                Response::ScanKeys { cursor, keys }
            }
            opcode::SNAPSHOT_OPEN => {
                let snapshot = r.u64("snapshot id")?;
                Response::SnapshotOpen {
                    snapshot,
                    version: r.u64("version")?,
                }
            }
            opcode::SNAPSHOT_CUT => {
                let snapshot = r.u64("snapshot id")?;
                let version = r.u64("version")?;
                let held_from_ns = r.u64("held from")?;
                Response::SnapshotCut {
                    snapshot,
                    version,
                    held_from_ns,
                    held_to_ns: r.u64("held to")?,
                }
            }
            opcode::SNAPSHOT_RELEASE => Response::SnapshotReleased,
            opcode::SCAN_CLOSE => Response::ScanClosed,
            opcode::SET_SCHEMA => Response::SchemaSet,
            opcode::GET_SCHEMA => Response::Schema(slice(r.bytes("schema")?)),
            opcode::CLUSTER_MAP => Response::ClusterMap(slice(r.bytes("map")?)),
            opcode::RESP_BATCH | opcode::RESP_PASS => {
                let count = r.count("replies", 4, RESP_BATCH_MAX)?;
                let mut replies = Vec::with_capacity(count);
                for _ in 0..count {
                    replies.push(slice(r.bytes("reply")?));
                }
                Response::RespBatch(replies)
            }
            opcode::GET_AT => Response::GetAt(object(&mut r)?),
            opcode::SCAN_FILTERED | opcode::SCAN_TABLET | opcode::SCAN_NEXT => {
                match r.u8("scan reply kind")? {
                    SCAN_REPLY_RECORDS => {
                        let cursor = r.u64("cursor id")?;
                        let snapshot_version = r.u64("snapshot version")?;
                        // Each record takes at least 24 bytes.
                        let count = r.count("records", 24, u32::MAX)?;
                        let mut records = Vec::with_capacity(count);
                        for _ in 0..count {
                            let key = slice(r.bytes("key")?);
                            let version = r.u64("version")?;
                            let expire_at_ms = r.u64("expiry")?;
                            let value = slice(r.bytes("value")?);
                            records.push(Record {
                                key,
                                value,
                                version,
                                expire_at_ms,
                            });
                        }
                        Response::ScanPage {
                            cursor,
                            snapshot_version,
                            records,
                        }
                    }
                    SCAN_REPLY_AGGREGATES if opcode != opcode::SCAN_NEXT => {
                        let snapshot_version = r.u64("snapshot version")?;
                        let matched = r.u64("matched")?;
                        let malformed = r.u64("malformed")?;
                        Response::ScanAggregates {
                            snapshot_version,
                            matched,
                            malformed,
                            values: slice(r.bytes("values")?),
                        }
                    }
                    other => return Err(DecodeError::bad(format!("scan reply kind {other}"))),
                }
            }
            other => {
                return Err(DecodeError::bad(format!(
                    "reply to unknown opcode 0x{other:02x}"
                )))
            }
        };
        r.finish()?;
        Ok(response)
    }
}

/// The client's first 8 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientHello {
    /// The highest protocol version the client speaks.
    pub version_max: u16,
    pub flags: u16,
}

impl ClientHello {
    pub fn encode(&self) -> [u8; CLIENT_HELLO_LEN] {
        let mut b = [0u8; CLIENT_HELLO_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version_max.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b
    }
    pub fn decode(b: &[u8; CLIENT_HELLO_LEN]) -> Result<ClientHello, DecodeError> {
        if b[..4] != MAGIC {
            return Err(DecodeError::bad("bad magic: not a ramlog native client"));
        }
        Ok(ClientHello {
            version_max: u16::from_le_bytes([b[4], b[5]]),
            flags: u16::from_le_bytes([b[6], b[7]]),
        })
    }
}

/// The server's 24-byte answer to the client hello; it carries the limits the client must respect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerHello {
    /// The version both sides will speak; 0 = none in common (the server then closes).
    pub version: u16,
    pub flags: u16,
    pub max_frame_bytes: u32,
    pub max_in_flight: u32,
    pub key_size_max_bytes: u32,
    pub value_size_max_bytes: u32,
}

impl ServerHello {
    pub fn encode(&self) -> [u8; SERVER_HELLO_LEN] {
        let mut b = [0u8; SERVER_HELLO_LEN];
        b[..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.max_frame_bytes.to_le_bytes());
        b[12..16].copy_from_slice(&self.max_in_flight.to_le_bytes());
        b[16..20].copy_from_slice(&self.key_size_max_bytes.to_le_bytes());
        b[20..24].copy_from_slice(&self.value_size_max_bytes.to_le_bytes());
        b
    }
    pub fn decode(b: &[u8; SERVER_HELLO_LEN]) -> Result<ServerHello, DecodeError> {
        if b[..4] != MAGIC {
            return Err(DecodeError::bad("bad magic: not a ramlog native server"));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Ok(ServerHello {
            version: u16::from_le_bytes([b[4], b[5]]),
            flags: u16::from_le_bytes([b[6], b[7]]),
            max_frame_bytes: u32_at(8),
            max_in_flight: u32_at(12),
            key_size_max_bytes: u32_at(16),
            value_size_max_bytes: u32_at(20),
        })
    }
}

/// Decode every complete frame at the start of `buf` as requests, the way a server does. Used by the fuzz
/// target and the random-bytes property test; returns how many frames decoded and how many were errors.
pub fn decode_request_stream(mut buf: &[u8], max_frame_bytes: usize) -> (usize, usize) {
    let (mut ok, mut errors) = (0, 0);
    loop {
        match parse_header(buf, max_frame_bytes) {
            Ok(Some(h)) => {
                let Some(frame) = buf.get(..h.frame_bytes()) else {
                    break;
                };
                match Request::decode(h.opcode, h.flags_or_status, &frame[HEADER_LEN..]) {
                    Ok(request) => {
                        // Re-encoding a decoded request must give the same bytes back, except that a
                        // TABLE flag with table 0 is dropped.
                        let mut again = BytesMut::new();
                        request.encode(h.request_id, &mut again);
                        let decoded_again = parse_header(&again, FRAME_BYTES_HARD_MAX)
                            .ok()
                            .flatten()
                            .and_then(|h2| {
                                Request::decode(h2.opcode, h2.flags_or_status, &again[HEADER_LEN..])
                                    .ok()
                            });
                        assert_eq!(
                            decoded_again.as_ref(),
                            Some(&request),
                            "request re-encoding is lossy"
                        );
                        if let Request::RespPass { count, resp, .. } = request {
                            if let Ok(commands) = resp_pass_commands(count, resp) {
                                assert_eq!(commands.len(), count as usize);
                                assert!(commands.iter().all(|c| !c.is_empty()));
                            }
                        }
                        ok += 1;
                    }
                    Err(_) => errors += 1,
                }
                buf = &buf[h.frame_bytes()..];
            }
            Ok(None) => break,
            Err(FrameError::TooLarge { skip_bytes, .. }) => {
                errors += 1;
                match buf.get(HEADER_LEN + skip_bytes..) {
                    Some(rest) => buf = rest,
                    None => break,
                }
            }
            Err(FrameError::TooShort { .. }) => {
                errors += 1;
                break;
            }
        }
    }
    (ok, errors)
}

/// The `count` commands of a RESP_PASS body: each a RESP array of one or more bulk strings (inline
/// commands and empty arrays are refused), back to back, filling `resp` exactly. The arguments are
/// slices of `resp`.
pub fn resp_pass_commands(count: u32, resp: &[u8]) -> Result<Vec<Vec<&[u8]>>, DecodeError> {
    let decoder = crate::resp::RequestDecoder::new(crate::resp::RequestLimits {
        bulk_len_max: resp.len(),
        array_len_max: RESP_BATCH_MAX as usize,
        inline_len_max: 0,
        request_len_max: resp.len(),
    });
    let mut request = crate::resp::Request::default();
    let mut commands = Vec::with_capacity((count as usize).min(resp.len() / 10 + 1));
    let mut pos = 0;
    for i in 0..count {
        let rest = &resp[pos..];
        if rest.first() != Some(&b'*') {
            return Err(DecodeError::bad(format!(
                "RESP_PASS command {i}: not a RESP array"
            )));
        }
        match decoder.decode(rest, &mut request) {
            Ok(Some(used)) if !request.is_empty() => {
                commands.push(request.spans().iter().map(|r| &rest[r.clone()]).collect());
                pos += used;
            }
            Ok(Some(_)) => {
                return Err(DecodeError::bad(format!(
                    "RESP_PASS command {i}: a command without a name"
                )))
            }
            Ok(None) => {
                return Err(DecodeError::bad(format!(
                    "RESP_PASS command {i}: truncated"
                )))
            }
            Err(e) => {
                return Err(DecodeError::bad(format!(
                    "RESP_PASS command {i}: {}",
                    e.message()
                )))
            }
        }
    }
    if pos != resp.len() {
        return Err(DecodeError::bad(format!(
            "RESP_PASS: {} bytes after its {count} commands",
            resp.len() - pos
        )));
    }
    Ok(commands)
}

/// Decode every complete frame at the start of `buf` as responses, the way a client does.
pub fn decode_response_stream(mut buf: &[u8], max_frame_bytes: usize) -> (usize, usize) {
    let (mut ok, mut errors) = (0, 0);
    while let Ok(Some(h)) = parse_header(buf, max_frame_bytes) {
        let Some(frame) = buf.get(..h.frame_bytes()) else {
            break;
        };
        let body = Bytes::copy_from_slice(&frame[HEADER_LEN..]);
        match Response::decode(h.opcode, h.flags_or_status, body) {
            Ok(response) => {
                let mut again = BytesMut::new();
                response.encode(h.request_id, h.opcode, &mut again);
                let body_again = Bytes::copy_from_slice(&again[HEADER_LEN..]);
                let status = again[13];
                assert_eq!(
                    Response::decode(h.opcode, status, body_again).ok(),
                    Some(response)
                );
                ok += 1;
            }
            Err(_) => errors += 1,
        }
        buf = &buf[h.frame_bytes()..];
    }
    (ok, errors)
}

#[cfg(test)]
#[path = "native_tests.rs"]
mod tests;
