use crate::{Object, TabletId};

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum EngineError {
    #[error("key of {len} bytes exceeds the limit of {max} bytes")]
    KeyTooLarge { len: usize, max: usize },
    #[error("value of {len} bytes exceeds the limit of {max} bytes")]
    ValueTooLarge { len: usize, max: usize },
    #[error("out of memory: {live_bytes} bytes live of {total_bytes} bytes total")]
    OutOfMemory { live_bytes: u64, total_bytes: u64 },
    #[error("no such tablet: {0}")]
    NoSuchTablet(TabletId),
    #[error("too many tablets (at most {0})")]
    TooManyTablets(usize),
    #[error("condition failed")]
    ConditionFailed { current: Option<Object> },
    #[error("value is not an integer or out of range")]
    NotAnInteger,
    #[error("increment or decrement would overflow")]
    IncrementOverflow,
    #[error("atomic multi-put of {len} bytes exceeds one segment ({max} bytes)")]
    BatchTooLarge { len: usize, max: usize },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("snapshot too old: snapshot {version} was released because {reason}")]
    SnapshotTooOld { version: u64, reason: String },
    #[error("invalid scan query: {0}")]
    Query(String),
    #[error("the tablet is moving to another server; try again")]
    Frozen,
    #[error("the tablet holding this key is full: one tablet holds at most {limit_bytes} bytes (what a backup's log of one tablet takes); delete keys, or move some of its slots' keys elsewhere")]
    TabletFull { limit_bytes: u64 },
    #[error("corrupt log entry at seglet {seglet} offset {offset}: {reason}")]
    Corrupt {
        seglet: u32,
        offset: usize,
        reason: String,
    },
}

impl From<ramlog_common::LimitError> for EngineError {
    fn from(e: ramlog_common::LimitError) -> Self {
        match e {
            ramlog_common::LimitError::KeyTooLarge { len, max } => {
                EngineError::KeyTooLarge { len, max }
            }
            ramlog_common::LimitError::ValueTooLarge { len, max } => {
                EngineError::ValueTooLarge { len, max }
            }
        }
    }
}
