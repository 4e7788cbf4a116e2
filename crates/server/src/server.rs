//! One server process: the engine, its keyspace, and the listeners (RESP, admin HTTP).
//!
//! [`Server::start`] binds every listener first (so that a port in use is reported before anything
//! runs), then spawns one accept loop per listener on the current tokio runtime. Connections are
//! tasks of their own; the connection limit is one atomic counter shared by all listeners.
//! [`Server::shutdown`] stops accepting, ends every connection and stops the engine.

use crate::config::{PersistenceMode, ServerConfig, TABLETS_DEFAULT};
use crate::keyspace::Keyspace;
use crate::metrics::{EngineFigures, Metrics, Op, ProcessInfo, Snapshot};
use crate::native::{refuse_native_connection, serve_native_connection, NativeConfig};
use crate::persistence::Persistence;
use crate::{admin, resp_conn};
use ramlog_logmem::{Engine, EngineConfig, EngineError};
use ramlog_proto::resp::RequestLimits;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        addr: SocketAddr,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    #[error("persistence: {0}")]
    Persistence(#[from] crate::persistence::PersistenceError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// The addresses a running server listens on.
#[derive(Debug, Clone, Copy)]
pub struct Addresses {
    pub resp: SocketAddr,
    pub native: Option<SocketAddr>,
    pub admin: Option<SocketAddr>,
}

/// State every connection of one server shares. Nothing in it is locked on the request path.
pub struct Shared {
    pub config: ServerConfig,
    pub keyspace: Keyspace,
    pub metrics: Metrics,
    pub started: Instant,
    pub limits: RequestLimits,
    addresses: Addresses,
    node_id: String,
    persistence: Option<Arc<Persistence>>,
    next_client_id: AtomicU64,
    shutdown_requested: tokio::sync::Notify,
}

impl Shared {
    pub fn resp_port(&self) -> u16 {
        self.addresses.resp.port()
    }

    pub fn addresses(&self) -> Addresses {
        self.addresses
    }

    /// A 40-hex-digit node id, stable for the life of the process (Redis Cluster's form).
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Asks the process running this server to stop (the SHUTDOWN command).
    pub fn request_shutdown(&self) {
        self.shutdown_requested.notify_one();
    }

    /// Waits until every write acknowledged so far is on disk (`durable` persistence).
    pub async fn wait_durable(&self) {
        if let Some(p) = &self.persistence {
            if p.mode() == PersistenceMode::Durable {
                let p = p.clone();
                let _ = tokio::task::spawn_blocking(move || p.wait_durable_blocking()).await;
            }
        }
    }

    /// All figures at this moment, for `/metrics`, `/status` and `INFO`.
    pub fn snapshot(&self) -> Snapshot {
        let engine = self.keyspace.engine();
        let stats = engine.stats();
        let figures = EngineFigures {
            objects: engine.object_count(),
            objects_expiring: stats.expiring_objects,
            objects_expiring_avg_ttl_ms: stats
                .expiring_mean_expire_at_ms
                .saturating_sub(crate::commands::now_ms()),
            memory_bytes_total: stats.total_bytes,
            memory_bytes_live: stats.live_bytes,
            memory_utilisation: stats.utilisation,
            cleaner_bytes_copied: stats.cleaner_copied_bytes,
            cleaner_bytes_freed: stats.cleaner_freed_bytes,
            write_cost: stats.write_cost,
            tablets: self.keyspace.tablets().len() as u64,
            memory_waits: stats.memory_waits,
            memory_wait_secs: stats.memory_wait_secs,
            memory_bytes_untouched: stats.untouched_seglets * ramlog_logmem::SEGLET_BYTES as u64,
        };
        let process = ProcessInfo {
            version: env!("CARGO_PKG_VERSION"),
            pid: std::process::id(),
            uptime_secs: self.started.elapsed().as_secs(),
            resp_port: self.addresses.resp.port(),
            native_port: self.addresses.native.map(|a| a.port()).unwrap_or(0),
            admin_port: self.addresses.admin.map(|a| a.port()).unwrap_or(0),
            connections_max: self.config.connections_max,
            rss_bytes: rss_bytes(),
            persistence: self.config.persistence.to_string(),
        };
        Snapshot::take(&self.metrics, process, figures)
    }
}

/// Resident set size of this process (from /proc/self/statm; 0 where that does not exist).
pub fn rss_bytes() -> u64 {
    let text = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// A running server.
pub struct Server {
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl Server {
    /// Binds the listeners, creates the engine and table 0, and starts serving. Must run inside a
    /// multi-threaded tokio runtime.
    pub async fn start(config: ServerConfig) -> Result<Server, ServerError> {
        config.validate()?;
        let bind = |port: u16, what: &'static str| {
            let addr = SocketAddr::new(config.bind, port);
            async move {
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| ServerError::Bind { addr, what, source })
            }
        };
        let resp_listener = bind(config.resp_port, "RESP").await?;
        let native_listener = if config.native_port != 0 {
            Some(bind(config.native_port, "native protocol").await?)
        } else {
            None
        };
        let admin_listener = if config.admin_port != 0 {
            Some(bind(config.admin_port, "admin HTTP").await?)
        } else {
            None
        };
        let addresses = Addresses {
            resp: resp_listener.local_addr()?,
            native: native_listener
                .as_ref()
                .map(|l| l.local_addr())
                .transpose()?,
            admin: admin_listener
                .as_ref()
                .map(|l| l.local_addr())
                .transpose()?,
        };

        let persistence = match config.persistence {
            PersistenceMode::Off => None,
            _ => Some(Persistence::open(&config)?),
        };
        let engine = Engine::new(EngineConfig {
            write_observer: persistence
                .clone()
                .map(|p| p as Arc<dyn ramlog_logmem::WriteObserver>),
            memory_bytes: config.memory_bytes,
            key_size_max_bytes: config.key_size_max_bytes as usize,
            value_size_max_bytes: config.value_size_max_bytes as usize,
            snapshot_max_age_ms: config.snapshot_max_age_ms,
            snapshot_max_retained_bytes: config.snapshot_max_retained_bytes,
            scan_threads: config.scan_threads,
            ..EngineConfig::default()
        })?;
        let tablets = match &persistence {
            Some(p) => p.tablets(),
            None => config.tablets.unwrap_or(TABLETS_DEFAULT),
        };
        let keyspace = Keyspace::create(engine, tablets)?;
        let keyspace = match &persistence {
            None => keyspace,
            Some(p) => {
                let replaying = p.clone();
                let (keyspace, restored) = tokio::task::spawn_blocking(move || {
                    let restored = replaying.replay(|key, value, version, expire_at_ms| {
                        let tablet = keyspace.tablet_of(key);
                        keyspace
                            .engine()
                            .restore(tablet, key, Some(value), version, expire_at_ms)
                    });
                    (keyspace, restored)
                })
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))?;
                let restored = restored?;
                tracing::info!(objects = restored, "replayed the data directory");
                for (table, path, bytes) in p.load_schemas()? {
                    let schema = ramlog_logmem::query::Schema::from_bytes(&bytes).map_err(|e| {
                        crate::persistence::PersistenceError::CorruptSchema {
                            path,
                            reason: e.to_string(),
                        }
                    })?;
                    keyspace.engine().set_schema(table, Some(schema));
                }
                p.open_tablets(keyspace.tablet_ids())?;
                keyspace
            }
        };
        let limits = RequestLimits {
            bulk_len_max: config.request_arg_size_max_bytes as usize,
            array_len_max: config.request_args_max,
            inline_len_max: 64 * 1024,
            request_len_max: config.request_size_max_bytes as usize,
        };
        let node_id = {
            let seed =
                (std::process::id() as u64) << 32 ^ addresses.resp.port() as u64 ^ now_nanos();
            let a = ramlog_common::slot::crc16_xmodem(&seed.to_le_bytes());
            format!(
                "{:016x}{:016x}{:08x}",
                seed.rotate_left(17).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                seed,
                a
            )
        };
        let shared = Arc::new(Shared {
            config,
            keyspace,
            metrics: Metrics::default(),
            started: Instant::now(),
            limits,
            addresses,
            node_id,
            persistence,
            next_client_id: AtomicU64::new(1),
            shutdown_requested: tokio::sync::Notify::new(),
        });
        let (shutdown, _) = watch::channel(false);
        let mut tasks = JoinSet::new();
        tasks.spawn(accept_resp(
            resp_listener,
            shared.clone(),
            shutdown.subscribe(),
        ));
        if let Some(listener) = native_listener {
            let native_config = Arc::new(native_config(&shared));
            tasks.spawn(accept_native(
                listener,
                shared.clone(),
                native_config,
                shutdown.subscribe(),
            ));
        }
        if let Some(listener) = admin_listener {
            tasks.spawn(admin::serve(listener, shared.clone(), shutdown.subscribe()));
        }
        tracing::info!(resp = %addresses.resp, native = ?addresses.native, admin = ?addresses.admin, "server started");
        Ok(Server {
            shared,
            shutdown,
            tasks,
        })
    }

    pub fn addresses(&self) -> Addresses {
        self.shared.addresses
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Ends when a client sent SHUTDOWN.
    pub async fn shutdown_requested(&self) {
        self.shared.shutdown_requested.notified().await
    }

    /// Stops accepting, closes every connection, and stops the engine's background threads.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        while self.tasks.join_next().await.is_some() {}
        self.shared.keyspace.engine().shutdown();
        if let Some(p) = self.shared.persistence.clone() {
            let _ = tokio::task::spawn_blocking(move || p.flush()).await;
        }
        tracing::info!("server stopped");
    }
}

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Counts a connection for as long as it lives.
struct ConnectionGuard(Arc<Shared>);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0
            .metrics
            .connections_current
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// Takes a connection slot, or refuses the connection with Redis's error when all are taken.
fn admit(shared: &Arc<Shared>) -> Option<ConnectionGuard> {
    let current = shared
        .metrics
        .connections_current
        .fetch_add(1, Ordering::Relaxed);
    if current >= shared.config.connections_max as u64 {
        shared
            .metrics
            .connections_current
            .fetch_sub(1, Ordering::Relaxed);
        Metrics::add(&shared.metrics.connections_rejected, 1);
        return None;
    }
    Metrics::add(&shared.metrics.connections_total, 1);
    Some(ConnectionGuard(shared.clone()))
}

async fn refuse(mut stream: TcpStream, message: &'static [u8]) {
    let _ =
        tokio::time::timeout(std::time::Duration::from_secs(1), stream.write_all(message)).await;
}

async fn accept_resp(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => break,
        };
        while connections.try_join_next().is_some() {}
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: back off briefly instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(guard) = admit(&shared) else {
            tokio::spawn(refuse(stream, b"-ERR max number of clients reached\r\n"));
            continue;
        };
        let id = shared.next_client_id.fetch_add(1, Ordering::Relaxed);
        let conn_shared = shared.clone();
        connections.spawn(async move {
            let _guard = guard;
            let ending = resp_conn::serve_resp(stream, conn_shared, id).await;
            tracing::debug!(client = id, ?ending, "connection closed");
        });
    }
    connections.shutdown().await;
}

/// The native protocol's settings, from the server's configuration.
fn native_config(shared: &Arc<Shared>) -> NativeConfig {
    let config = &shared.config;
    let weak = Arc::downgrade(shared);
    let observed = Arc::downgrade(shared);
    NativeConfig {
        idle_timeout: std::time::Duration::from_secs(config.idle_timeout_secs),
        write_timeout: std::time::Duration::from_secs(config.write_timeout_secs.max(1)),
        password: config.password.clone(),
        key_size_max_bytes: config.key_size_max_bytes as usize,
        value_size_max_bytes: config.value_size_max_bytes as usize,
        status_json: Some(Arc::new(move || match weak.upgrade() {
            Some(shared) => serde_json::to_string(&shared.snapshot()).unwrap_or_default(),
            None => "{}".to_string(),
        })),
        request_observer: Some(Arc::new(move |opcode_byte, elapsed, ok| {
            if let Some(shared) = observed.upgrade() {
                shared.metrics.record(native_op(opcode_byte), elapsed);
                if !ok {
                    Metrics::add(&shared.metrics.errors, 1);
                }
            }
        })),
        schema_recorder: shared.persistence.clone().map(|p| {
            Arc::new(move |table, schema: Option<&[u8]>| {
                p.store_schema(table, schema).map_err(|e| e.to_string())
            }) as crate::native::SchemaRecorder
        }),
        ..NativeConfig::default()
    }
}

/// The metrics family of a native request.
fn native_op(opcode_byte: u8) -> Op {
    use ramlog_proto::native::opcode;
    match opcode_byte {
        opcode::GET => Op::Get,
        opcode::PUT => Op::Set,
        opcode::DELETE => Op::Del,
        opcode::INCREMENT => Op::Incr,
        opcode::MULTI_GET => Op::Mget,
        opcode::MULTI_PUT => Op::Mset,
        opcode::SCAN_KEYS | opcode::SCAN_FILTERED | opcode::SCAN_NEXT => Op::Scan,
        opcode::GET_AT => Op::Get,
        opcode::EXPIRE => Op::Expire,
        _ => Op::Other,
    }
}

async fn accept_native(
    listener: TcpListener,
    shared: Arc<Shared>,
    native_config: Arc<NativeConfig>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => break,
        };
        while connections.try_join_next().is_some() {}
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(guard) = admit(&shared) else {
            tokio::spawn(refuse_native_connection(
                stream,
                "max number of clients reached",
            ));
            continue;
        };
        let engine = shared.keyspace.engine().clone();
        let native_config = native_config.clone();
        connections.spawn(async move {
            let _guard = guard;
            serve_native_connection(stream, engine, native_config).await;
        });
    }
    connections.shutdown().await;
}
