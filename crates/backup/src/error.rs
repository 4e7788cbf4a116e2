//! Errors of the backup store.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    #[error("invalid backup configuration: {0}")]
    Config(String),
    #[error("I/O error on {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("disk full while writing {path}: appends are refused; data already written is intact (free space and reopen)")]
    DiskFull { path: String },
    #[error("tablet {tablet:#x} log is full ({capacity_bytes} bytes of live data) even after reorganization")]
    LogFull { tablet: u64, capacity_bytes: u64 },
    #[error("entry too large: {bytes} bytes (limit {limit})")]
    EntryTooLarge { bytes: usize, limit: usize },
    #[error("key too large: {bytes} bytes (limit {limit})")]
    KeyTooLarge { bytes: usize, limit: usize },
    #[error("backup has failed and refuses appends: {0}")]
    Failed(String),
    #[error("backup is closed")]
    Closed,
    #[error("the log is being written: {0}")]
    Busy(String),
    #[error("on-disk state is inconsistent: {0}")]
    Corrupt(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Error {
        if crate::io::is_no_space(&source) {
            Error::DiskFull {
                path: path.display().to_string(),
            }
        } else {
            Error::Io {
                path: path.display().to_string(),
                source,
            }
        }
    }
}
