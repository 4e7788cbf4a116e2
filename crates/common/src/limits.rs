//! What a valid entry is: the one definition of key and value limits that every layer checks
//! with, so that a write the master admits is one that every backup accepts.
//!
//! The engine (`ramlog-logmem`), a server's write admission, the replication decoder on a
//! backup (`ramlog-proto::repl`) and the backup log store (`ramlog-backup`) all call
//! [`EntryLimits::check`]. Keys may be empty (the empty string is a valid Redis key) and hold
//! any bytes; values may be empty. Nothing else about an entry's content is ever refused.

/// Largest key any ramlog format can hold (DESIGN.md: keys up to 64 KiB). A configured key limit
/// may be lower, never higher.
pub const KEY_SIZE_FORMAT_MAX_BYTES: usize = 64 * 1024;

/// Why an entry is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitError {
    KeyTooLarge { len: usize, max: usize },
    ValueTooLarge { len: usize, max: usize },
}

impl std::fmt::Display for LimitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LimitError::KeyTooLarge { len, max } => {
                write!(f, "key of {len} bytes is over the limit of {max} bytes")
            }
            LimitError::ValueTooLarge { len, max } => {
                write!(f, "value of {len} bytes is over the limit of {max} bytes")
            }
        }
    }
}

impl std::error::Error for LimitError {}

/// The limits an entry is checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryLimits {
    /// Longest key in bytes (at most [`KEY_SIZE_FORMAT_MAX_BYTES`]).
    pub key_max_bytes: usize,
    /// Longest value in bytes.
    pub value_max_bytes: usize,
}

impl Default for EntryLimits {
    fn default() -> Self {
        EntryLimits {
            key_max_bytes: crate::KEY_SIZE_MAX_BYTES_DEFAULT,
            value_max_bytes: crate::VALUE_SIZE_MAX_BYTES_DEFAULT,
        }
    }
}

impl EntryLimits {
    /// Checks one entry: a put's key and value length, or a delete's key (`value_len` 0).
    #[inline]
    pub fn check(&self, key_len: usize, value_len: usize) -> Result<(), LimitError> {
        if key_len > self.key_max_bytes {
            return Err(LimitError::KeyTooLarge {
                len: key_len,
                max: self.key_max_bytes,
            });
        }
        if value_len > self.value_max_bytes {
            return Err(LimitError::ValueTooLarge {
                len: value_len,
                max: self.value_max_bytes,
            });
        }
        Ok(())
    }

    /// The limits a backup decodes with: what any master of the cluster may admit. Keys up to the
    /// format's maximum whatever the masters' configured key limit (the largest any master can
    /// be configured with), values up to this server's value limit (servers of one cluster share
    /// it: `ramlog up` starts them with one configuration, and registration checks it).
    pub fn for_backup(value_max_bytes: usize) -> EntryLimits {
        EntryLimits {
            key_max_bytes: KEY_SIZE_FORMAT_MAX_BYTES,
            value_max_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_keys_and_values_are_valid_and_limits_are_inclusive() {
        let l = EntryLimits {
            key_max_bytes: 4,
            value_max_bytes: 8,
        };
        assert_eq!(l.check(0, 0), Ok(()));
        assert_eq!(l.check(4, 8), Ok(()));
        assert_eq!(
            l.check(5, 0),
            Err(LimitError::KeyTooLarge { len: 5, max: 4 })
        );
        assert_eq!(
            l.check(0, 9),
            Err(LimitError::ValueTooLarge { len: 9, max: 8 })
        );
    }
}
