//! The client's typed errors: one variant per thing a caller may want to act on.

use ramlog_common::Version;
use ramlog_proto::native::{ErrorReply, Status};
use std::time::Duration;

/// Everything a client call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("handshake with {addr} failed: {reason}")]
    Handshake { addr: String, reason: String },
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The connection broke before the reply arrived. The request may or may not have been applied.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
    /// The server sent bytes that do not follow the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The request would exceed the server's frame limit; it was not sent.
    #[error("request of {bytes} bytes exceeds the server's frame limit of {max_bytes} bytes")]
    RequestTooLarge { bytes: usize, max_bytes: usize },
    /// A PUT/DELETE condition did not hold. `current_version` is None if the key is absent.
    #[error("condition failed ({})", describe_current(*.current_version))]
    ConditionFailed { current_version: Option<Version> },
    #[error("value is not an integer or out of range")]
    NotAnInteger,
    #[error("increment or decrement would overflow")]
    IncrementOverflow,
    #[error("key too large: {0}")]
    KeyTooLarge(String),
    #[error("value too large: {0}")]
    ValueTooLarge(String),
    #[error("server out of memory: {0}")]
    OutOfMemory(String),
    #[error("keys span more than one tablet: {0}")]
    CrossTablet(String),
    #[error("frame too large for the server (limit {limit_bytes} bytes): {message}")]
    FrameTooLarge { limit_bytes: u64, message: String },
    #[error("server busy: {0}")]
    Busy(String),
    #[error("authentication required: {0}")]
    NoAuth(String),
    #[error("authentication failed: {0}")]
    AuthFailed(String),
    /// The snapshot was released by the server (past its age or retained-bytes bound).
    #[error("{message}")]
    SnapshotTooOld { version: Version, message: String },
    /// No snapshot with this id on the connection (released, or the connection was replaced).
    #[error("no such snapshot {0}")]
    NoSuchSnapshot(u64),
    /// No paged scan with this id on the connection (finished, closed, or failed).
    #[error("no such paged scan {0}")]
    NoSuchCursor(u64),
    /// The connection holds as many snapshots or paged scans as the server allows.
    #[error("too many open (limit {limit}): {message}")]
    TooManyOpen { limit: u64, message: String },
    /// A query that cannot be sent (checked locally).
    #[error("invalid query: {0}")]
    InvalidQuery(String),
    /// The server cannot log writes to disk (disk full, I/O error) and refuses writes; reads go
    /// on. A write answered with it was not acknowledged (it may or may not have been applied).
    #[error("writes refused: {0}")]
    WritesRefused(String),
    /// Any other error status.
    #[error("server error {status:?}: {message}")]
    Server { status: Status, message: String },
}

impl Error {
    /// True when a retry on a fresh connection may succeed (the connection, not the request, failed).
    pub fn is_connection_error(&self) -> bool {
        matches!(
            self,
            Error::Connect { .. } | Error::ConnectionLost(_) | Error::Handshake { .. }
        )
    }
}

impl From<ErrorReply> for Error {
    fn from(e: ErrorReply) -> Self {
        let m = e.message;
        match e.status {
            Status::ConditionFailed => Error::ConditionFailed {
                current_version: (e.detail != 0).then_some(e.detail),
            },
            Status::NotAnInteger => Error::NotAnInteger,
            Status::IncrementOverflow => Error::IncrementOverflow,
            Status::KeyTooLarge => Error::KeyTooLarge(m),
            Status::ValueTooLarge => Error::ValueTooLarge(m),
            Status::OutOfMemory => Error::OutOfMemory(m),
            Status::CrossTablet => Error::CrossTablet(m),
            Status::FrameTooLarge => Error::FrameTooLarge {
                limit_bytes: e.detail,
                message: m,
            },
            Status::Busy => Error::Busy(m),
            Status::NoAuth => Error::NoAuth(m),
            Status::WritesRefused => Error::WritesRefused(m),
            Status::AuthFailed => Error::AuthFailed(m),
            Status::SnapshotTooOld => Error::SnapshotTooOld {
                version: e.detail,
                message: m,
            },
            Status::NoSuchSnapshot => Error::NoSuchSnapshot(e.detail),
            Status::NoSuchCursor => Error::NoSuchCursor(e.detail),
            Status::TooManyOpen => Error::TooManyOpen {
                limit: e.detail,
                message: m,
            },
            status => Error::Server { status, message: m },
        }
    }
}

fn describe_current(version: Option<Version>) -> String {
    match version {
        Some(v) => format!("current version {v}"),
        None => "key absent".to_string(),
    }
}
