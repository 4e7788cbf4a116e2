//! Types and small pure functions shared by every ramlog crate.
//!
//! Owns: the key → slot rule (Redis Cluster's CRC16/XMODEM with `{hash tags}`),
//! what a valid entry is (key and value limits), human-readable byte sizes (`2GiB`), Redis's integer syntax and glob patterns, and the
//! identifiers that cross crate boundaries (table ids, versions). Nothing here does I/O or
//! allocates per call.

pub mod glob;
pub mod int;
pub mod limits;
pub mod size;
pub mod slot;
pub mod varint;

pub use glob::{glob_match, glob_match_nocase};
pub use int::parse_redis_i64;
pub use limits::{EntryLimits, LimitError, KEY_SIZE_FORMAT_MAX_BYTES};
pub use size::{parse_size_bytes, SizeParseError};
pub use slot::{is_internal, is_reserved, key_slot, INTERNAL_PREFIX, SLOT_COUNT};

/// A table's 64-bit identifier.
pub type TableId = u64;

/// A write's version. Versions only grow per key, also across delete and re-create.
pub type Version = u64;

/// Default limit on key size (DESIGN.md: keys up to 64 KiB).
pub const KEY_SIZE_MAX_BYTES_DEFAULT: usize = 64 * 1024;

/// Default limit on value size (DESIGN.md: values up to 1 MiB).
pub const VALUE_SIZE_MAX_BYTES_DEFAULT: usize = 1024 * 1024;

/// Wall clock, nanoseconds since the Unix epoch (0 if the clock is before it).
pub fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
