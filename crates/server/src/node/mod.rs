//! The service layer: what every front end of a server calls (RESP, the native protocol, and the
//! routing port and replication the cluster adds).
//!
//! A [`Node`] owns the engine and the keyspace it serves, persistence, the metrics registry, the
//! clock and the settings that apply to every request. Front ends decode a request, call the node,
//! and encode what it returns; the checks that must hold on every path live here, once:
//! - **routing**: a key to its tablet ([`Node::tablet_of`] for the RESP table, [`Node::locate`]
//!   for any table);
//! - **auth**: [`Node::password_ok`];
//! - **the clock and expiry conversion**: [`now_ms`], [`Node::expire_at_ms`];
//! - **write admission**: every write goes through [`Node::put`], [`Node::delete`], ... which refuse
//!   it with [`NodeError::WritesRefused`] while persistence cannot log writes (Redis's `-MISCONF`);
//! - **the acknowledgement point** of the table's durability: a front end that ran writes calls
//!   [`Node::acknowledge`] before it sends their replies; in `durable` mode that waits for
//!   fdatasync, and an error means the replies must not claim success;
//! - **metrics**: [`Node::record`].
//!
//! What it hides: the engine's tablet ids behind keys, how persistence is wired to the engine (its
//! write observer), and the recovery of a failed store.
//!
//! A cluster server's roles (replication, the backup duty, membership) sit above the node and
//! call it; the node reaches them only through the [`ClusterHooks`] they register: the
//! acknowledgement waits that each data call adds to its caller's [`Acks`], the memory they hold,
//! their figures, and their stop.

pub mod acks;
pub mod admin;
pub mod config;
pub mod figures;
pub mod keyspace;
pub mod keyspace_events;
pub mod metrics;
pub mod persistence;
pub mod pubsub;
pub mod scripts;
pub mod settings;
pub mod waiters;

pub use acks::{refused_replies, Acks, ClusterHooks, HeldReply, RefusedWrite, RolesMemory};

use crate::node::config::{PersistenceMode, ServerConfig, TABLETS_DEFAULT};
use crate::node::keyspace::Keyspace;
use crate::node::metrics::{EngineFigures, MemoryBreakdown, Metrics, Op, ProcessInfo, Snapshot};
use crate::node::persistence::{Persistence, PersistenceError};
use ramlog_common::TableId;
use ramlog_logmem::{
    Condition, Engine, EngineConfig, EngineError, Object, PutOptions, PutOutcome, TabletId,
};
use ramlog_proto::native::Expiry;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why the service layer refused or could not complete a request.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Persistence cannot log writes (disk full, I/O error): writes are refused, reads go on.
    #[error("writes are refused: {reason}")]
    WritesRefused { reason: String },
}

/// The addresses a running server listens on (0 ports for a listener that is off).
#[derive(Debug, Clone, Copy)]
pub struct Addresses {
    pub resp: SocketAddr,
    pub native: Option<SocketAddr>,
    pub admin: Option<SocketAddr>,
    /// The routing port (cluster mode).
    pub routing: Option<SocketAddr>,
}

impl Addresses {
    /// No listener: a node used without a network (tests, embedding).
    pub fn none() -> Addresses {
        Addresses {
            resp: SocketAddr::from(([127, 0, 0, 1], 0)),
            native: None,
            admin: None,
            routing: None,
        }
    }
}

/// Why a node could not open.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    #[error("persistence: {0}")]
    Persistence(#[from] PersistenceError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// One server's service layer; see the module comment. Shared by every connection, and nothing
/// in it is locked on the request path.
pub struct Node {
    pub config: ServerConfig,
    pub keyspace: Keyspace,
    pub metrics: Metrics,
    pub started: Instant,
    /// When SAVE last completed (seconds since the epoch; 0: never).
    pub last_save_secs: std::sync::atomic::AtomicU64,
    /// Commands that changed data since the last SAVE (or the start): INFO's
    /// `rdb_changes_since_last_save`, Redis's dirty counter.
    pub changes_since_save: std::sync::atomic::AtomicU64,
    addresses: Addresses,
    node_id: String,
    persistence: Option<Arc<Persistence>>,
    /// What this server's cluster roles give the node (cluster servers only), registered once.
    hooks: std::sync::OnceLock<Arc<dyn ClusterHooks>>,
    next_client_id: AtomicU64,
    shutdown_requested: tokio::sync::Notify,
    /// Why the server stops on its own after a failure it cannot serve through (the process then
    /// exits with an error).
    failure: parking_lot::Mutex<Option<String>>,
    /// Anonymous resident memory before the engine and the store existed (the runtime, the
    /// configuration); with the resident code and libraries, the `process` part.
    process_base_bytes: u64,
    stopping: std::sync::atomic::AtomicBool,
    /// Clients blocked on keys (BLPOP and the other blocking commands).
    pub waiters: waiters::KeyWaiters,
    /// Routing-port clients blocked on keys, in the order they blocked: only the first on a key
    /// tries the key's master again (front/routing.rs), so this server's clients are served in
    /// that order.
    pub routed_waiters: waiters::KeyWaiters,
    /// Publish/subscribe on this server.
    pub pubsub: std::sync::Arc<pubsub::PubSub>,
    /// Striped locks that serialize this server's read-modify-writes of one key (collection
    /// changes, APPEND, SETRANGE, ...), so that writers of a hot key queue instead of retrying
    /// each other's conditional writes. Writes that do not read first do not take them; the
    /// conditional write still guards against those.
    rmw_locks: Vec<parking_lot::Mutex<()>>,
    /// A cluster server's PUBLISHes on their way to the other servers (started on the first).
    /// What CONFIG SET may change at run time.
    pub settings: std::sync::Arc<settings::RuntimeSettings>,
    /// The Lua scripts this server knows (EVAL, SCRIPT LOAD).
    pub scripts: scripts::Scripts,
    /// Held alone by a running script or EXEC, shared by every other command.
    pub script_gate: parking_lot::RwLock<()>,
}

/// Stripes of [`Node::rmw_lock`].
const RMW_LOCK_STRIPES: usize = 1024;

fn rmw_stripe(key: &[u8]) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in key {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h % RMW_LOCK_STRIPES as u64) as usize
}

/// Milliseconds since the Unix epoch: the one clock that expiry times are read against.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Node {
    /// Creates the engine and table 0, opens persistence and replays it (per the configuration).
    /// Runs blocking work (replay) on the blocking pool. A cluster server's writes are made
    /// durable by its backups instead: `replication` is the engine's write observer then (the
    /// replication role), and the roles register their [`ClusterHooks`] before serving.
    pub async fn open(
        config: ServerConfig,
        addresses: Addresses,
        replication: Option<Arc<dyn ramlog_logmem::WriteObserver>>,
    ) -> Result<Arc<Node>, OpenError> {
        let process_base_bytes = status_kib("RssAnon:") * 1024;
        // A cluster server's writes are made durable by its backups, not by a log of its own.
        let clustered = config.coordinator.is_some();
        let persistence = match config.persistence {
            _ if clustered => None,
            PersistenceMode::Off => None,
            _ => Some(Persistence::open(&config)?),
        };
        let write_observer: Option<Arc<dyn ramlog_logmem::WriteObserver>> =
            match (&persistence, replication) {
                (Some(p), _) => Some(p.clone()),
                (None, Some(r)) => Some(r),
                (None, None) => None,
            };
        let engine = Engine::new(EngineConfig {
            write_observer,
            memory_bytes: config.memory_bytes,
            key_size_max_bytes: config.key_size_max_bytes as usize,
            value_size_max_bytes: config.stored_value_max_bytes() as usize,
            snapshot_max_age_ms: config.snapshot_max_age_ms,
            snapshot_max_retained_bytes: config.snapshot_max_retained_bytes,
            scan_threads: config.scan_threads,
            ..EngineConfig::default()
        })?;
        let tablets = match &persistence {
            Some(p) => p.tablets(),
            None => config.tablets.unwrap_or(TABLETS_DEFAULT),
        };
        let keyspace = if clustered {
            Keyspace::empty(engine)
        } else {
            Keyspace::create(engine, tablets)?
        };
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
                        PersistenceError::CorruptSchema {
                            path,
                            reason: e.to_string(),
                        }
                    })?;
                    keyspace.engine().set_schema(table, Some(schema));
                }
                p.open_tablets(&keyspace.tablet_ids())?;
                p.start_recovery(keyspace.engine().clone(), keyspace.tablet_ids().to_vec());
                keyspace
            }
        };
        Ok(Node::assemble(
            config,
            keyspace,
            persistence,
            addresses,
            process_base_bytes,
        ))
    }

    /// A node over an engine the caller made, serving table 0 as `tablets` tablets, with no
    /// persistence and no listeners (tests and embedding). `config`'s persistence is ignored.
    pub fn with_engine(
        engine: Arc<Engine>,
        tablets: u16,
        mut config: ServerConfig,
    ) -> Result<Arc<Node>, EngineError> {
        config.persistence = PersistenceMode::Off;
        let process_base_bytes = status_kib("RssAnon:") * 1024;
        let keyspace = Keyspace::create(engine, tablets)?;
        Ok(Node::assemble(
            config,
            keyspace,
            None,
            Addresses::none(),
            process_base_bytes,
        ))
    }

    fn assemble(
        config: ServerConfig,
        keyspace: Keyspace,
        persistence: Option<Arc<Persistence>>,
        addresses: Addresses,
        process_base_bytes: u64,
    ) -> Arc<Node> {
        let node_id = {
            let seed = (std::process::id() as u64) << 32
                ^ addresses.resp.port() as u64
                ^ now_ms().wrapping_mul(1_000_003)
                ^ Instant::now().elapsed().as_nanos() as u64;
            let a = ramlog_common::slot::crc16_xmodem(&seed.to_le_bytes());
            format!(
                "{:016x}{:016x}{:08x}",
                seed.rotate_left(17).wrapping_mul(0x9E37_79B9_7F4A_7C15),
                seed,
                a
            )
        };
        let node = Arc::new(Node {
            config,
            keyspace,
            metrics: Metrics::default(),
            started: Instant::now(),
            last_save_secs: Default::default(),
            changes_since_save: Default::default(),
            addresses,
            node_id,
            persistence,
            hooks: std::sync::OnceLock::new(),
            next_client_id: AtomicU64::new(1),
            shutdown_requested: tokio::sync::Notify::new(),
            failure: parking_lot::Mutex::new(None),
            process_base_bytes,
            stopping: std::sync::atomic::AtomicBool::new(false),
            waiters: Default::default(),
            routed_waiters: Default::default(),
            pubsub: Default::default(),
            settings: Default::default(),
            scripts: Default::default(),
            script_gate: parking_lot::RwLock::new(()),
            rmw_locks: (0..RMW_LOCK_STRIPES)
                .map(|_| parking_lot::Mutex::new(()))
                .collect(),
        });
        node.charge_memory();
        start_memory_charger(&node);
        node
    }

    // ---- memory ----------------------------------------------------------------------------

    /// Memory held for data outside the engine's log and index: the backup store's buffers and
    /// per-key state, and client connections' buffers. The engine counts it against the budget.
    fn external_memory_bytes(&self) -> u64 {
        let roles = self.hooks().map(|h| h.memory());
        let backup = self
            .backup_store_memory(roles.as_ref())
            .map_or(0, |m| m.total());
        let streams = roles.map_or(0, |r| r.replication_buffers);
        backup + streams + self.metrics.connection_buffer_bytes.load(Ordering::Relaxed)
    }

    /// What the backup store holds in memory: this server's own log store (standalone
    /// persistence) or the store of its backup duty (cluster).
    fn backup_store_memory(
        &self,
        roles: Option<&RolesMemory>,
    ) -> Option<ramlog_backup::MemoryUsage> {
        match (&self.persistence, roles) {
            (Some(p), _) => p.memory(),
            (None, Some(r)) => Some(r.backup_store),
            (None, None) => None,
        }
    }

    /// The cluster roles' hooks; None for a standalone server (or before they registered).
    #[inline]
    fn hooks(&self) -> Option<&Arc<dyn ClusterHooks>> {
        self.hooks.get()
    }

    /// Registers what this server's cluster roles give the node (once, before it serves).
    pub fn set_cluster_hooks(&self, hooks: Arc<dyn ClusterHooks>) {
        let _ = self.hooks.set(hooks);
    }

    /// Charges the memory held outside the engine to its budget (see [`start_memory_charger`]).
    fn charge_memory(&self) {
        self.engine()
            .set_external_bytes(self.external_memory_bytes());
    }

    /// What the process holds, by part. The parts the budget bounds are the log, the index, the
    /// backup store's parts and connection buffers; `process` is the resident code and libraries
    /// and the anonymous memory resident before the engine and the store existed (the runtime);
    /// `allocator_free` is freed heap memory the C allocator keeps.
    pub fn memory_breakdown(&self, stats: &ramlog_logmem::EngineStats) -> MemoryBreakdown {
        let mut parts = vec![
            ("log", stats.log_resident_bytes),
            ("index", stats.index_bytes),
        ];
        let roles = self.hooks().map(|h| h.memory());
        if let Some(r) = &roles {
            parts.push(("replication_buffers", r.replication_buffers));
        }
        if let Some(backup) = self.backup_store_memory(roles.as_ref()) {
            parts.extend([
                ("backup_write_buffer", backup.write_buffer),
                ("backup_flush_arenas", backup.flush_arenas),
                ("backup_reorg_buffers", backup.reorg_buffers),
                ("backup_secondary_buffers", backup.secondary_buffers),
                ("backup_version_buffers", backup.version_buffers),
                ("backup_version_caches", backup.version_caches),
                ("backup_notes", backup.notes),
                ("backup_tablet_metadata", backup.tablet_metadata),
                ("backup_replay_buffers", backup.replay_buffers),
            ]);
        }
        parts.extend([
            (
                "connections",
                self.metrics.connection_buffer_bytes.load(Ordering::Relaxed),
            ),
            (
                "process",
                self.process_base_bytes + status_kib("RssFile:") * 1024,
            ),
            ("allocator_free", allocator_free_bytes()),
            ("scripts", self.scripts.bytes()),
        ]);
        MemoryBreakdown::new(parts, stats.total_bytes, stats.log_capacity_bytes)
    }

    pub fn engine(&self) -> &Arc<Engine> {
        self.keyspace.engine()
    }

    pub fn addresses(&self) -> Addresses {
        self.addresses
    }

    pub fn resp_port(&self) -> u16 {
        self.addresses.resp.port()
    }

    /// A 40-hex-digit node id, stable for the life of the process (Redis Cluster's form).
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// A new client id (CLIENT ID, CLIENT LIST).
    pub fn next_client_id(&self) -> u64 {
        self.next_client_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Asks the process running this server to stop (the SHUTDOWN command).
    pub fn request_shutdown(&self) {
        self.shutdown_requested.notify_one();
    }

    /// Stops the server because of `reason` (fail-stop): the process exits with an error naming
    /// it, and the cluster treats the server as crashed.
    pub fn fail_stop(&self, reason: String) {
        self.failure.lock().get_or_insert(reason);
        self.request_shutdown();
    }

    /// The reason given to [`Node::fail_stop`], if any.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().clone()
    }

    /// Ends when a client asked the server to stop.
    pub async fn shutdown_requested(&self) {
        self.shutdown_requested.notified().await
    }

    /// Stops the engine's background work and writes out what persistence holds.
    pub async fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        self.engine().shutdown();
        if let Some(p) = self.persistence.clone() {
            let _ = tokio::task::spawn_blocking(move || p.flush()).await;
        }
        if let Some(h) = self.hooks() {
            h.stop().await;
        }
    }

    /// Whether [`Node::stop`] ran.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    // ---- auth -------------------------------------------------------------------------------

    pub fn password_required(&self) -> bool {
        self.config.password.is_some()
    }

    /// Whether `password` (for the default user) opens this server. Compares in constant time.
    pub fn password_ok(&self, password: &[u8]) -> bool {
        match &self.config.password {
            None => true,
            Some(expected) => constant_time_eq(expected.as_bytes(), password),
        }
    }

    // ---- routing ----------------------------------------------------------------------------

    /// The tablet of the RESP table (table 0) holding `key`.
    #[inline]
    pub fn tablet_of(&self, key: &[u8]) -> TabletId {
        self.keyspace.tablet_of(key)
    }

    /// The tablet of `table` holding `key` on this server, if this server has it.
    pub fn locate(&self, table: TableId, key: &[u8]) -> Option<TabletId> {
        self.engine().locate(table, key)
    }

    // ---- the clock --------------------------------------------------------------------------

    /// The engine's absolute expiry (0 = none) for a protocol expiry; `Keep` is the caller's.
    pub fn expire_at_ms(&self, expiry: Expiry) -> u64 {
        match expiry {
            Expiry::None | Expiry::Keep => 0,
            // At least 1: an expiry in the past (or at the epoch) means "already expired", not "never".
            Expiry::AfterMs(ms) => now_ms().saturating_add(ms).max(1),
            Expiry::AtUnixMs(at) => at.max(1),
        }
    }

    // ---- write admission and acknowledgement ------------------------------------------------

    /// Why writes are refused now, or None while they are accepted. Counts the refusal.
    pub fn write_refusal(&self) -> Option<NodeError> {
        let reason = self.persistence.as_ref()?.refusal()?;
        Metrics::add(&self.metrics.writes_refused, 1);
        Some(NodeError::WritesRefused { reason })
    }

    #[inline]
    fn admit_write(&self) -> Result<(), NodeError> {
        match self.write_refusal() {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// Waits until every write applied so far (`acks`: what the calling connection's data calls
    /// added) has reached the point where its table's promise lets it be acknowledged: fdatasync
    /// for standalone `durable` persistence; for a cluster server, the table's replication mode
    /// (the replication role's), at most `replication_ack_timeout_ms`. At once
    /// otherwise. An error means that point cannot be reached: the writes were applied in memory,
    /// but their replies must not claim success. Ok lists the writes a backup refused (by their
    /// unit index in `acks`): those replies must fail, the others stand.
    pub async fn acknowledge(&self, acks: &mut Acks) -> Result<Vec<RefusedWrite>, NodeError> {
        let mut refused = Vec::new();
        if let Some(h) = self.hooks() {
            if !acks.is_empty() {
                refused = h
                    .wait(acks)
                    .await
                    .map_err(|reason| NodeError::WritesRefused { reason })?;
            }
        }
        let Some(p) = &self.persistence else {
            return Ok(refused);
        };
        if p.mode() != PersistenceMode::Durable {
            return Ok(refused);
        }
        let p = p.clone();
        let waited = tokio::task::spawn_blocking(move || p.wait_durable_blocking())
            .await
            .unwrap_or_else(|e| Err(format!("the durability wait failed: {e}")));
        waited.map_err(|reason| NodeError::WritesRefused { reason })?;
        Ok(refused)
    }

    /// SAVE: blocks until every write this server has taken is on its disk (the persistence
    /// log fdatasync'd), and records the time for LASTSAVE. Err when there is no disk to save
    /// to (persistence off) or the store failed. Run it off the async workers.
    pub fn save_blocking(&self) -> Result<(), String> {
        let Some(p) = &self.persistence else {
            return Err("this server keeps nothing on disk (persistence off); start it with --persistence async or durable".into());
        };
        // The changes the wait below makes durable: those counted before it starts.
        let changes = self
            .changes_since_save
            .load(std::sync::atomic::Ordering::Relaxed);
        p.wait_durable_blocking()?;
        self.changes_since_save
            .fetch_sub(changes, std::sync::atomic::Ordering::Relaxed);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        self.last_save_secs
            .store(now, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Whether [`Node::acknowledge`] has anything to wait for.
    #[inline]
    pub fn acknowledgement_waits(&self, acks: &Acks) -> bool {
        !acks.is_empty()
            || self
                .persistence
                .as_ref()
                .is_some_and(|p| p.mode() == PersistenceMode::Durable)
    }

    // ---- data operations --------------------------------------------------------------------
    //
    // Each takes the caller's `acks` and adds what its reply must wait for: the replication of
    // the writes it made, or of the writes in flight that a read may have seen.

    /// Moves what the data call that just ran on this thread waits for into `acks`.
    #[inline]
    fn collect(&self, acks: &mut Acks) {
        if let Some(h) = self.hooks() {
            h.collect(acks);
        }
    }

    /// After a read of `tablet`: its reply waits until what the read may have seen is
    /// replicated as the tablet's mode promises (the replication role decides how).
    #[inline]
    fn read_barrier(&self, tablet: TabletId, acks: &mut Acks) {
        if let Some(h) = self.hooks() {
            h.read_barrier(tablet);
            h.collect(acks);
        }
    }

    /// The read-modify-write lock of `key` (see `rmw_locks`).
    pub fn rmw_lock(&self, key: &[u8]) -> parking_lot::MutexGuard<'_, ()> {
        self.rmw_locks[rmw_stripe(key)].lock()
    }

    /// The read-modify-write locks of every key in `keys`, taken in stripe order (so that two
    /// multi-key writers never wait on each other in a cycle).
    pub fn rmw_locks(&self, keys: &[&[u8]]) -> Vec<parking_lot::MutexGuard<'_, ()>> {
        let mut stripes: Vec<usize> = keys.iter().map(|k| rmw_stripe(k)).collect();
        stripes.sort_unstable();
        stripes.dedup();
        stripes
            .into_iter()
            .map(|i| self.rmw_locks[i].lock())
            .collect()
    }

    /// What to store for a client's string `value`: checked against the value size limit, then
    /// escaped if it begins with the typed-value tag (docs/formats.md, "Typed values").
    pub fn stored_string<'v>(
        &self,
        value: &'v [u8],
    ) -> Result<std::borrow::Cow<'v, [u8]>, NodeError> {
        if value.len() as u64 > self.config.value_size_max_bytes {
            return Err(NodeError::Engine(EngineError::ValueTooLarge {
                len: value.len(),
                max: self.config.value_size_max_bytes as usize,
            }));
        }
        Ok(ramlog_proto::types::store_string(value))
    }

    /// [`Node::stored_string`] for a string changed in place (APPEND, SETRANGE, SETBIT,
    /// BITFIELD): a short one is marked so that OBJECT ENCODING answers `raw`, as Redis does.
    pub fn stored_string_in_place<'v>(
        &self,
        value: &'v [u8],
    ) -> Result<std::borrow::Cow<'v, [u8]>, NodeError> {
        self.stored_string(value)?;
        Ok(ramlog_proto::types::store_string_in_place(value))
    }

    pub fn get(
        &self,
        tablet: TabletId,
        key: &[u8],
        acks: &mut Acks,
    ) -> Result<Option<Object>, NodeError> {
        let found = self.engine().get(tablet, key)?;
        self.read_barrier(tablet, acks);
        Ok(found)
    }

    /// Runs `f` on the key's value, version and expiry in place (no copy), if present.
    pub fn read_with<R>(
        &self,
        tablet: TabletId,
        key: &[u8],
        acks: &mut Acks,
        f: impl FnOnce(&[u8], u64, u64) -> R,
    ) -> Result<Option<R>, NodeError> {
        let found = self.engine().read_with(tablet, key, f)?;
        self.read_barrier(tablet, acks);
        Ok(found)
    }

    pub fn put(
        &self,
        tablet: TabletId,
        key: &[u8],
        value: &[u8],
        options: &PutOptions,
        acks: &mut Acks,
    ) -> Result<PutOutcome, NodeError> {
        self.admit_write()?;
        let done = self.engine().put(tablet, key, value, options);
        self.collect(acks);
        Ok(done?)
    }

    /// Deletes the key if `condition` holds; Some(old version) if it existed.
    pub fn delete(
        &self,
        tablet: TabletId,
        key: &[u8],
        condition: Condition,
        acks: &mut Acks,
    ) -> Result<Option<u64>, NodeError> {
        self.admit_write()?;
        let done = self.engine().delete(tablet, key, condition);
        self.collect(acks);
        Ok(done?)
    }

    /// Adds `delta` to the key's integer value; (new value, version).
    pub fn increment(
        &self,
        tablet: TabletId,
        key: &[u8],
        delta: i64,
        acks: &mut Acks,
    ) -> Result<(i64, u64), NodeError> {
        self.admit_write()?;
        for _ in 0..64 {
            let done = self.engine().increment(tablet, key, delta);
            self.collect(acks);
            if !matches!(done, Err(EngineError::NotAnInteger)) {
                return Ok(done?);
            }
            // A short string changed in place is stored marked (`raw` for OBJECT ENCODING), which
            // the engine reads as no integer: its digits are incremented here and stored whole,
            // on the condition that it did not change meanwhile.
            let Some(o) = self.engine().get(tablet, key)? else {
                continue;
            };
            if !ramlog_proto::types::is_raw_string(&o.value) {
                return Ok(done?);
            }
            let digits = ramlog_proto::types::string_of(&o.value).unwrap_or_default();
            let n = ramlog_common::int::parse_redis_i64(digits).ok_or(EngineError::NotAnInteger)?;
            let next = n.checked_add(delta).ok_or(EngineError::IncrementOverflow)?;
            let options = PutOptions {
                condition: Condition::IfVersion(o.version),
                keep_ttl: true,
                ..Default::default()
            };
            let put = self
                .engine()
                .put(tablet, key, next.to_string().as_bytes(), &options);
            self.collect(acks);
            match put {
                Ok(outcome) => return Ok((next, outcome.version)),
                Err(EngineError::ConditionFailed { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(NodeError::Engine(EngineError::ConditionFailed {
            current: None,
        }))
    }

    /// Sets (0: removes) the key's expiry; None if the key is absent.
    pub fn set_expiry(
        &self,
        tablet: TabletId,
        key: &[u8],
        expire_at_ms: u64,
        acks: &mut Acks,
    ) -> Result<Option<u64>, NodeError> {
        self.admit_write()?;
        let done = self.engine().set_expiry(tablet, key, expire_at_ms);
        self.collect(acks);
        Ok(done?)
    }

    /// Writes every item to one tablet as one atomic unit; returns its version.
    pub fn multi_put(
        &self,
        tablet: TabletId,
        items: &[(&[u8], &[u8])],
        acks: &mut Acks,
    ) -> Result<u64, NodeError> {
        self.admit_write()?;
        let done = self.engine().multi_put(tablet, items);
        self.collect(acks);
        Ok(done?)
    }

    /// [`Self::multi_put`] if each item's condition holds, checked atomically with the write.
    pub fn multi_put_if(
        &self,
        tablet: TabletId,
        items: &[(&[u8], &[u8])],
        conditions: &[Condition],
        acks: &mut Acks,
    ) -> Result<u64, NodeError> {
        self.admit_write()?;
        let done = self.engine().multi_put_if(tablet, items, conditions);
        self.collect(acks);
        Ok(done?)
    }

    /// Puts, deletes and checks of several keys of one tablet as one atomic unit
    /// ([`Engine::multi_write_if`]); None when nothing needed writing.
    pub fn multi_write_if(
        &self,
        tablet: TabletId,
        items: &[ramlog_logmem::MultiWrite<'_>],
        acks: &mut Acks,
    ) -> Result<Option<u64>, NodeError> {
        self.admit_write()?;
        let done = self.engine().multi_write_if(tablet, items);
        self.collect(acks);
        Ok(done?)
    }

    /// Records a table's schema durably (when persistence is on), then applies it.
    pub fn set_schema(
        &self,
        table: TableId,
        schema: Option<ramlog_logmem::query::Schema>,
    ) -> Result<(), NodeError> {
        self.admit_write()?;
        if let Some(p) = &self.persistence {
            let bytes = schema.as_ref().map(|s| s.to_bytes());
            p.store_schema(table, bytes.as_deref())
                .map_err(|e| NodeError::WritesRefused {
                    reason: e.to_string(),
                })?;
        }
        self.engine().set_schema(table, schema);
        Ok(())
    }

    // ---- metrics ----------------------------------------------------------------------------

    /// Counts one answered request of family `op` that took `elapsed`.
    #[inline]
    pub fn record(&self, op: Op, elapsed: Duration, ok: bool) {
        self.metrics.record(op, elapsed);
        if !ok {
            Metrics::add(&self.metrics.errors, 1);
        }
    }

    /// All figures at this moment, for `/metrics`, `/status`, `INFO` and the native STATS.
    pub fn snapshot(&self) -> Snapshot {
        let engine = self.engine();
        let stats = engine.stats();
        let figures = EngineFigures {
            objects: engine.key_count(),
            chunks: engine.object_count().saturating_sub(engine.key_count()),
            objects_expiring: stats.expiring_objects,
            objects_expiring_avg_ttl_ms: stats.expiring_mean_expire_at_ms.saturating_sub(now_ms()),
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
        let persistence = self.persistence.as_ref().map(|p| p.figures());
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
            persistence_status: persistence.as_ref().map_or("ok", |f| f.health.as_str()),
            persistence_error: persistence
                .as_ref()
                .map(|f| f.last_error.clone())
                .unwrap_or_default(),
            persistence_failures: persistence.as_ref().map_or(0, |f| f.failures),
            persistence_rewrites: persistence.as_ref().map_or(0, |f| f.rewrites),
            changes_since_save: self
                .changes_since_save
                .load(std::sync::atomic::Ordering::Relaxed),
            last_save_secs: self
                .last_save_secs
                .load(std::sync::atomic::Ordering::Relaxed),
        };
        let memory = self.memory_breakdown(&stats);
        let mut snapshot = Snapshot::take(&self.metrics, process, figures, memory);
        (snapshot.blocking_keys, snapshot.blocking_keys_on_nokey) = self.waiters.blocking_keys();
        if let Some(h) = self.hooks() {
            let (replication, cluster) = h.figures();
            snapshot.replication = Some(replication);
            snapshot.cluster = cluster;
        }
        snapshot
    }

    /// The `/status` JSON (also the native STATS reply).
    pub fn status_json(&self) -> String {
        serde_json::to_string(&self.snapshot()).unwrap_or_default()
    }
}

/// How often the memory held outside the engine is charged to its budget.
const MEMORY_CHARGE_INTERVAL: Duration = Duration::from_millis(100);

/// Starts the thread that charges the memory held outside the engine (the backup store,
/// connection buffers) to the engine's budget every [`MEMORY_CHARGE_INTERVAL`], so that the log
/// gives way as they grow; it ends with the node.
fn start_memory_charger(node: &Arc<Node>) {
    let weak = Arc::downgrade(node);
    let spawned = std::thread::Builder::new()
        .name("ramlog-memory".into())
        .spawn(move || loop {
            std::thread::sleep(MEMORY_CHARGE_INTERVAL);
            match weak.upgrade() {
                Some(node) => node.charge_memory(),
                None => return,
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the memory accounting thread; the backup store's memory is charged to the budget only at start");
    }
}

/// Allocations of at least this size get pages of their own from the system, returned when freed.
const ALLOCATOR_MMAP_THRESHOLD: i32 = 64 << 10;

/// Fixes the C allocator's threshold for allocations served by their own mapping. glibc raises it
/// (up to 32 MiB) each time such a block is freed, after which the large, short-lived tables of
/// the index and the backup store (grown vectors, version tables) are carved from the heaps, and
/// what they leave when freed stays resident as free heap memory. Fixed, a freed large block goes
/// back to the system at once, so the memory account's parts track the resident set. Call once,
/// before the engine and the store allocate.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a tunable of glibc's allocator; it takes no pointers.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, ALLOCATOR_MMAP_THRESHOLD);
    }
}

/// Resident bytes the C allocator holds free in its heaps (freed by the program, not returned to
/// the system): the resident size of glibc's heaps less the bytes allocated in them
/// (`mallinfo2().uordblks`). The heaps are `[heap]` and the thread arenas' heaps, which glibc
/// reserves as 64 MiB regions at multiples of 64 MiB and opens for writing from the start as they
/// grow (a writable mapping followed by the inaccessible rest of its region). Blocks in mappings
/// of their own (the log, the backup store's buffers) are in neither figure. Reads
/// /proc/self/smaps: for reports, not hot paths. 0 where that is unknown.
pub fn allocator_free_bytes() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const ARENA_HEAP_BYTES: u64 = 64 << 20;
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
            return 0;
        };
        // (start, end, writable, inaccessible, named [heap], anonymous, rss in KiB)
        let mut maps: Vec<(u64, u64, bool, bool, bool, bool, u64)> = Vec::new();
        for line in smaps.lines() {
            let mut fields = line.split_whitespace();
            let first = fields.next().unwrap_or("");
            if first == "Rss:" {
                if let Some(m) = maps.last_mut() {
                    m.6 = fields.next().and_then(|v| v.parse().ok()).unwrap_or(0);
                }
                continue;
            }
            let Some((start, end)) = first.split_once('-') else {
                continue;
            };
            let (Ok(start), Ok(end)) =
                (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
            else {
                continue;
            };
            let perms = fields.next().unwrap_or("");
            let name = fields.nth(3).unwrap_or("");
            maps.push((
                start,
                end,
                perms.starts_with("rw"),
                perms.starts_with("---"),
                name == "[heap]",
                name.is_empty(),
                0,
            ));
        }
        let mut heap_rss_kib = 0;
        for (i, m) in maps.iter().enumerate() {
            let arena_heap = m.2
                && m.5
                && m.0 % ARENA_HEAP_BYTES == 0
                && maps.get(i + 1).is_some_and(|next| {
                    next.3 && next.5 && next.0 == m.1 && next.1 == m.0 + ARENA_HEAP_BYTES
                });
            if (m.2 && m.4) || arena_heap {
                heap_rss_kib += m.6;
            }
        }
        // SAFETY: mallinfo2 only reads the allocator's statistics (under its arena locks).
        let in_use = unsafe { libc::mallinfo2() }.uordblks as u64;
        (heap_rss_kib * 1024).saturating_sub(in_use)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        0
    }
}

/// A `kB` figure of /proc/self/status (0 where it does not exist).
fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
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

/// Compares two secrets in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_conversion() {
        let engine = Engine::new(EngineConfig {
            memory_bytes: 16 << 20,
            ..EngineConfig::default()
        })
        .unwrap();
        let node = Node::with_engine(engine, 4, ServerConfig::default()).unwrap();
        assert_eq!(node.expire_at_ms(Expiry::None), 0);
        assert_eq!(
            node.expire_at_ms(Expiry::AtUnixMs(0)),
            1,
            "the epoch is in the past, not 'never'"
        );
        assert_eq!(node.expire_at_ms(Expiry::AtUnixMs(123)), 123);
        let later = node.expire_at_ms(Expiry::AfterMs(10_000));
        assert!(later >= now_ms() + 9_000 && later <= now_ms() + 10_000);
        assert!(
            node.write_refusal().is_none(),
            "no persistence, nothing refused"
        );
        assert!(!node.acknowledgement_waits(&Default::default()));
    }

    #[test]
    fn passwords_compare_whole() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
    }
}
