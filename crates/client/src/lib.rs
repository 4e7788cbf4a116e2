//! ramlog-client: the async Rust client for ramlog's native protocol (`docs/protocol.md`).
//!
//! Owns: a cloneable [`Client`] handle over a small pool of connections, each multiplexing many concurrent
//! requests (request ids, replies in any order), pipelining, per-request timeouts, reconnection, and
//! typed errors ([`Error`]); and [`ClusterClient`], which routes each key to the server that masters it
//! using the cluster map. Hides: framing, the handshake, the writer/reader tasks and the map from request
//! id to waiter.
//!
//! ```no_run
//! # async fn demo() -> Result<(), ramlog_client::Error> {
//! use ramlog_client::{Client, ClientConfig, Condition};
//! let client = Client::connect(ClientConfig::new("127.0.0.1:7380")).await?;
//! let version = client.put(b"user:1", b"alice").await?;
//! let object = client.get(b"user:1").await?.expect("present");
//! assert_eq!(object.version, version);
//! // Compare-and-set on the version just read.
//! client.put_with(b"user:1", b"bob", ramlog_client::PutOptions {
//!     condition: Condition::IfVersion(version),
//!     ..Default::default()
//! }).await?;
//! # Ok(()) }
//! ```

#[cfg(feature = "cli")]
pub mod cli;
mod cluster;
mod connection;
mod error;
mod scan;

pub use cluster::{join_all, ClusterClient, ClusterSnapshot};
pub use error::Error;
pub use ramlog_cluster::ClusterMap;
pub use ramlog_proto::native::{
    Condition, Expiry, Object, Record, Request, Response, ServerHello, Status,
};
/// Queries, schemas and values of filtered scans, and their wire forms (the `ramlog-query` crate,
/// which the server's engine evaluates).
pub use ramlog_query as query;
pub use scan::{PagedScan, ScanAggregates, ScanAt, ScanResult, Snapshot, TabletScan};

use bytes::Bytes;
use connection::Connection;
use ramlog_common::{TableId, Version};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// The native port a server listens on unless configured otherwise.
pub const NATIVE_PORT_DEFAULT: u16 = 7380;

/// [`ClientConfig::recovery_wait`] unless configured otherwise: a master's failure is detected
/// and its tablets restored well within it.
pub const RECOVERY_WAIT_DEFAULT: Duration = Duration::from_secs(10);

/// How to reach a server and how patient to be.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// `host:port` of the server's native listener.
    pub addr: String,
    /// Sent with AUTH right after the handshake when set.
    pub password: Option<Vec<u8>>,
    /// Connections in the pool; requests are spread over them round-robin.
    pub connections: usize,
    /// Time for connecting plus the handshake.
    pub connect_timeout: Duration,
    /// Default per-request timeout (override per handle with [`Client::with_timeout`]).
    pub request_timeout: Duration,
    /// Cap on requests in flight per connection (the server's advertised limit also applies).
    pub max_in_flight: usize,
    /// Largest reply frame accepted; a larger one closes the connection as a protocol violation.
    pub reply_frame_max_bytes: usize,
    /// Retry idempotent requests (GET, MULTI_GET, SCAN_KEYS, PING, STATS) once on a new connection when
    /// the connection breaks under them.
    pub retry_idempotent: bool,
    /// [`ClusterClient`]: how long a request whose tablet's master failed or moved (refused
    /// unapplied, not sent, or being recovered) keeps being retried after map refreshes before
    /// its last error is returned. Zero returns it after the first attempt.
    pub recovery_wait: Duration,
}

impl ClientConfig {
    pub fn new(addr: impl Into<String>) -> Self {
        ClientConfig {
            addr: addr.into(),
            password: None,
            connections: 1,
            connect_timeout: Duration::from_secs(3),
            request_timeout: connection::REQUEST_TIMEOUT_DEFAULT,
            max_in_flight: 4096,
            reply_frame_max_bytes: 256 << 20,
            retry_idempotent: true,
            recovery_wait: RECOVERY_WAIT_DEFAULT,
        }
    }
}

/// Options of [`Client::put_with`].
#[derive(Clone, Copy, Debug, Default)]
pub struct PutOptions {
    pub condition: Condition,
    pub expiry: Expiry,
    /// Return the object the put replaced.
    pub return_old: bool,
}

/// What a put did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutResult {
    pub version: Version,
    /// The replaced object, when `return_old` was asked and there was one.
    pub old: Option<Object>,
}

struct Slot {
    current: parking_lot::Mutex<Option<Arc<Connection>>>,
    connecting: tokio::sync::Mutex<()>,
}

struct Inner {
    config: ClientConfig,
    slots: Vec<Slot>,
    next_slot: AtomicUsize,
}

/// A handle to a ramlog server. Cheap to clone; clones share the connection pool. Any number of tasks may
/// call it at once: their requests are pipelined on the pooled connections.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
    table: TableId,
    timeout: Duration,
}

impl Client {
    /// Connect the first pooled connection now (so that a wrong address fails here); the others connect
    /// when first used.
    pub async fn connect(config: ClientConfig) -> Result<Client, Error> {
        let connections = config.connections.max(1);
        let timeout = config.request_timeout;
        let slots = (0..connections)
            .map(|_| Slot {
                current: parking_lot::Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
            })
            .collect();
        let client = Client {
            inner: Arc::new(Inner {
                config,
                slots,
                next_slot: AtomicUsize::new(0),
            }),
            table: 0,
            timeout,
        };
        client.connection(0).await?;
        Ok(client)
    }

    /// A handle on the same pool that uses another per-request timeout.
    pub fn with_timeout(&self, timeout: Duration) -> Client {
        Client {
            timeout,
            ..self.clone()
        }
    }

    /// A handle on the same pool that addresses another table.
    pub fn with_table(&self, table: TableId) -> Client {
        Client {
            table,
            ..self.clone()
        }
    }

    /// The limits the server announced in its hello.
    pub async fn server_hello(&self) -> Result<ServerHello, Error> {
        Ok(self.connection(0).await?.server_hello())
    }

    async fn connection(&self, index: usize) -> Result<Arc<Connection>, Error> {
        let slot = &self.inner.slots[index % self.inner.slots.len()];
        if let Some(c) = slot.current.lock().as_ref() {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        let _guard = slot.connecting.lock().await;
        if let Some(c) = slot.current.lock().as_ref() {
            if !c.is_closed() {
                return Ok(c.clone());
            }
        }
        let conn = Connection::open(&self.inner.config).await?;
        *slot.current.lock() = Some(conn.clone());
        Ok(conn)
    }

    /// A connection of the pool (round-robin), for state that lives on one connection.
    async fn pooled_connection(&self) -> Result<Arc<Connection>, Error> {
        let slot = self.pick_slot();
        match tokio::time::timeout(self.timeout, self.connection(slot)).await {
            Ok(c) => c,
            Err(_) => Err(Error::Timeout(self.timeout)),
        }
    }

    fn pick_slot(&self) -> usize {
        self.inner.next_slot.fetch_add(1, Ordering::Relaxed) % self.inner.slots.len()
    }

    /// Send any request and return the raw reply (error replies included as `Response::Error`).
    pub async fn request(&self, request: &Request<'_>) -> Result<Response, Error> {
        let deadline = Instant::now() + self.timeout;
        let slot = self.pick_slot();
        let idempotent = matches!(
            request,
            Request::Get { .. }
                | Request::MultiGet { .. }
                | Request::ScanKeys { .. }
                | Request::Ping { .. }
                | Request::Stats
        );
        let mut attempt = 0;
        loop {
            attempt += 1;
            let conn = match tokio::time::timeout_at(deadline, self.connection(slot)).await {
                Ok(c) => c?,
                Err(_) => return Err(Error::Timeout(self.timeout)),
            };
            match conn.call(request, deadline).await {
                Err(Error::ConnectionLost(_))
                    if attempt == 1 && idempotent && self.inner.config.retry_idempotent =>
                {
                    continue
                }
                other => return other,
            }
        }
    }

    /// Send many requests in one write and wait for all their replies, returned in request order.
    /// The outer error is for the connection; each reply may still be an error of its own.
    pub async fn pipeline(
        &self,
        requests: &[Request<'_>],
    ) -> Result<Vec<Result<Response, Error>>, Error> {
        let deadline = Instant::now() + self.timeout;
        let conn = match tokio::time::timeout_at(deadline, self.connection(self.pick_slot())).await
        {
            Ok(c) => c?,
            Err(_) => return Err(Error::Timeout(self.timeout)),
        };
        conn.call_many(requests, deadline).await
    }

    async fn call(&self, request: &Request<'_>) -> Result<Response, Error> {
        match self.request(request).await? {
            Response::Error(e) => Err(e.into()),
            reply => Ok(reply),
        }
    }

    pub async fn ping(&self, payload: &[u8]) -> Result<Bytes, Error> {
        match self.call(&Request::Ping { payload }).await? {
            Response::Pong(p) => Ok(p),
            other => Err(unexpected("PING", other)),
        }
    }

    /// The server's figures as a JSON text.
    pub async fn stats(&self) -> Result<String, Error> {
        match self.call(&Request::Stats).await? {
            Response::Stats(json) => String::from_utf8(json.to_vec())
                .map_err(|_| Error::Protocol("STATS reply is not UTF-8".into())),
            other => Err(unexpected("STATS", other)),
        }
    }

    /// The object stored under `key` with its version, or None.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Object>, Error> {
        match self
            .call(&Request::Get {
                table: self.table,
                key,
            })
            .await?
        {
            Response::Get(object) => Ok(object),
            other => Err(unexpected("GET", other)),
        }
    }

    /// Store `value` under `key` unconditionally; returns the new version.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<Version, Error> {
        Ok(self
            .put_with(key, value, PutOptions::default())
            .await?
            .version)
    }

    /// Store with a condition, an expiry, and optionally get the replaced object back.
    pub async fn put_with(
        &self,
        key: &[u8],
        value: &[u8],
        options: PutOptions,
    ) -> Result<PutResult, Error> {
        let request = Request::Put {
            table: self.table,
            key,
            value,
            condition: options.condition,
            expiry: options.expiry,
            return_old: options.return_old,
        };
        match self.call(&request).await? {
            Response::Put { version, old } => Ok(PutResult { version, old }),
            other => Err(unexpected("PUT", other)),
        }
    }

    /// Delete `key`; returns the delete's version if the key existed.
    pub async fn delete(&self, key: &[u8]) -> Result<Option<Version>, Error> {
        self.delete_with(key, Condition::None).await
    }

    /// Delete `key` if `condition` holds.
    pub async fn delete_with(
        &self,
        key: &[u8],
        condition: Condition,
    ) -> Result<Option<Version>, Error> {
        match self
            .call(&Request::Delete {
                table: self.table,
                key,
                condition,
            })
            .await?
        {
            Response::Delete(version) => Ok(version),
            other => Err(unexpected("DELETE", other)),
        }
    }

    /// Add `delta` to the ASCII decimal integer under `key` (absent = 0); returns the new value and version.
    pub async fn increment(&self, key: &[u8], delta: i64) -> Result<(i64, Version), Error> {
        match self
            .call(&Request::Increment {
                table: self.table,
                key,
                delta,
            })
            .await?
        {
            Response::Increment { value, version } => Ok((value, version)),
            other => Err(unexpected("INCREMENT", other)),
        }
    }

    /// Set or clear `key`'s expiry; returns the new version if the key exists.
    pub async fn expire(&self, key: &[u8], expiry: Expiry) -> Result<Option<Version>, Error> {
        match self
            .call(&Request::Expire {
                table: self.table,
                key,
                expiry,
            })
            .await?
        {
            Response::Expire(version) => Ok(version),
            other => Err(unexpected("EXPIRE", other)),
        }
    }

    /// Read many keys in one request; one entry per key, in order.
    pub async fn multi_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Object>>, Error> {
        match self
            .call(&Request::MultiGet {
                table: self.table,
                keys: keys.to_vec(),
            })
            .await?
        {
            Response::MultiGet(objects) if objects.len() == keys.len() => Ok(objects),
            other => Err(unexpected("MULTI_GET", other)),
        }
    }

    /// Write many keys atomically under one version. All keys must live on one tablet (use a `{hash tag}`);
    /// otherwise the server answers [`Error::CrossTablet`] and writes nothing.
    pub async fn multi_put(&self, items: &[(&[u8], &[u8])]) -> Result<Version, Error> {
        match self
            .call(&Request::MultiPut {
                table: self.table,
                items: items.to_vec(),
            })
            .await?
        {
            Response::MultiPut { version } => Ok(version),
            other => Err(unexpected("MULTI_PUT", other)),
        }
    }

    /// One step of a key scan: start with cursor 0, continue with the returned cursor until it is 0.
    /// `pattern` is a Redis-style glob (`*`, `?`, `[a-z]`, `\` escapes); empty matches every key. Every key
    /// present for the whole iteration is returned at least once.
    pub async fn scan_keys(
        &self,
        cursor: u64,
        count: u32,
        pattern: &[u8],
    ) -> Result<(u64, Vec<Bytes>), Error> {
        match self
            .call(&Request::ScanKeys {
                table: self.table,
                cursor,
                count,
                pattern,
            })
            .await?
        {
            Response::ScanKeys { cursor, keys } => Ok((cursor, keys)),
            other => Err(unexpected("SCAN_KEYS", other)),
        }
    }

    /// Every key matching `pattern` (a full scan; keys may repeat if the key set changes meanwhile).
    pub async fn scan_all(&self, pattern: &[u8]) -> Result<Vec<Bytes>, Error> {
        let mut keys = Vec::new();
        let mut cursor = 0;
        loop {
            let (next, batch) = self.scan_keys(cursor, 1000, pattern).await?;
            keys.extend(batch);
            if next == 0 {
                return Ok(keys);
            }
            cursor = next;
        }
    }
}

fn unexpected(op: &str, reply: Response) -> Error {
    Error::Protocol(format!("unexpected reply to {op}: {reply:?}"))
}
