//! Single-server persistence: every tablet's writes go to this server's own backup log store
//! (`ramlog-backup`), and a restart replays them into memory.
//!
//! The engine hands each atomic unit of writes to [`Persistence`] (its [`WriteObserver`]) in version
//! order, under the tablet's write lock; `on_writes` only appends to the store's write buffer. The
//! store writes them within `flush_interval_ms` (100 ms) and fdatasyncs them within about the
//! same time, which is Redis's `appendfsync everysec` at a finer grain (`async` mode). In
//! `durable` mode the service layer holds each reply in [`Persistence::wait_durable_blocking`]
//! until everything appended so far is on disk.
//!
//! **When the store fails** (disk full, I/O error) the server refuses writes, as Redis answers
//! `-MISCONF` when it cannot persist: [`Persistence::refusal`] says why, and a `durable` wait that
//! cannot complete is an error, so no reply claims what did not happen. Memory still holds every
//! write, including those the failed store lost. A recovery thread retries about once a second to
//! **rewrite** memory into a fresh store: a new directory `backup.<generation>` receives every
//! live object of every tablet, is fdatasync'd, and only then becomes current (the `STORE` file
//! names it, replaced atomically); the old directory is removed after. Writes are accepted again
//! once the switch is made. A crash at any point leaves `STORE` naming a complete store, the old
//! one or the new; a start removes the other generation's leftovers.
//!
//! The backup's tablet ids are the engine's tablet ids, so the tablet layout (the number of tablets
//! of table 0) is recorded in the data directory and must not change between runs: a server whose
//! configuration names no count adopts the recorded one, and one that names another count refuses
//! to start.

use crate::node::config::{PersistenceMode, ServerConfig, TABLETS_DEFAULT, TABLETS_MAX};
use arc_swap::ArcSwapOption;
use parking_lot::{Condvar, Mutex};
use ramlog_backup::{Backup, Config as BackupConfig, Entry, Stage, Ticket};
use ramlog_common::TableId;
use ramlog_logmem::{Engine, LoggedWrite, TabletId, WriteObserver};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Why persistence could not start or replay.
#[derive(Debug, thiserror::Error)]
pub enum PersistenceError {
    #[error("backup store in {path}: {source}")]
    Backup {
        path: PathBuf,
        source: ramlog_backup::Error,
    },
    #[error("data directory {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("schema file {path} is unreadable ({reason}); remove it and set the schema again")]
    CorruptSchema { path: PathBuf, reason: String },
    #[error("{path} is corrupt ({reason}); it names the current backup store directory")]
    CorruptStoreFile { path: PathBuf, reason: String },
    #[error(
        "data directory {path} was written with {found} tablets but the configuration asks for {wanted}; \
         start with tablets = {found} or use an empty data directory"
    )]
    LayoutChanged {
        path: PathBuf,
        found: u16,
        wanted: u16,
    },
}

/// The state of persistence, as `INFO persistence` and `/metrics` report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// Writes are logged; the store works.
    Ok,
    /// The store failed; writes are refused until a rewrite succeeds.
    Failed,
    /// A rewrite of memory into a fresh store is under way; writes are still refused.
    Rewriting,
}

impl Health {
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Ok => "ok",
            Health::Failed => "failed",
            Health::Rewriting => "rewriting",
        }
    }

    fn from_u8(v: u8) -> Health {
        match v {
            0 => Health::Ok,
            1 => Health::Failed,
            _ => Health::Rewriting,
        }
    }

    fn to_u8(self) -> u8 {
        match self {
            Health::Ok => 0,
            Health::Failed => 1,
            Health::Rewriting => 2,
        }
    }
}

/// Figures for `INFO persistence` and `/metrics`.
#[derive(Clone, Debug)]
pub struct PersistenceFigures {
    pub health: Health,
    /// Why the store last failed ("" if it never did).
    pub last_error: String,
    /// Times the store failed since start.
    pub failures: u64,
    /// Rewrites that completed (each one resumed writes).
    pub rewrites: u64,
    /// The current store's generation (0: `backup`, n: `backup.n`).
    pub generation: u64,
}

/// One open backup store and what was appended to it.
struct Store {
    backup: Backup,
    generation: u64,
    /// Highest ticket this store handed out; waiting for it covers every write appended so far.
    last_ticket: AtomicU64,
}

/// Keys read per step while a rewrite copies memory into a fresh store ...
const REWRITE_BATCH_OBJECTS: usize = 512;
/// ... and the bytes of keys and values it holds before appending them to the store: the copy
/// held outside the budget is at most this plus one object.
const REWRITE_BATCH_BYTES: usize = 1 << 20;
/// Time between a failure and the first rewrite attempt, and between failed attempts.
const REWRITE_RETRY: Duration = Duration::from_secs(1);
/// How often the recovery thread checks a store that nobody waits on (async mode) for failure.
const HEALTH_POLL: Duration = Duration::from_millis(100);

pub struct Persistence {
    /// The store writes go to. None only between a failed rewrite attempt and the next one.
    store: ArcSwapOption<Store>,
    /// The generation that `STORE` names: the store a restart would open.
    committed: AtomicU64,
    data_dir: PathBuf,
    backup_config: BackupConfig,
    /// `<data_dir>/schemas`: one file per table with a schema (see [`Persistence::store_schema`]).
    schemas_dir: PathBuf,
    /// Tablets of table 0, as recorded in the data directory.
    tablets: u16,
    mode: PersistenceMode,
    /// A [`Health`] as u8: read on every write's admission, so an atomic.
    health: AtomicU8,
    last_error: Mutex<String>,
    failures: AtomicU64,
    rewrites: AtomicU64,
    /// Wakes the recovery thread (a failure, or shutdown).
    wake: Condvar,
    wake_lock: Mutex<()>,
    stopping: AtomicBool,
    recovery: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Persistence {
    /// Opens (or creates) the current store of `data_dir` (see the module comment), checking the
    /// recorded tablet layout and removing what an interrupted rewrite left.
    pub fn open(config: &ServerConfig) -> Result<Arc<Persistence>, PersistenceError> {
        debug_assert!(config.persistence != PersistenceMode::Off);
        std::fs::create_dir_all(&config.data_dir).map_err(io_error(&config.data_dir))?;
        let tablets = check_layout(&config.data_dir, config.tablets)?;
        let generation = read_store_file(&config.data_dir)?;
        remove_other_generations(&config.data_dir, generation);
        // The store's buffers are sized from the server's budget, which they are charged to.
        let backup_config = BackupConfig {
            flush_interval: Duration::from_millis(config.flush_interval_ms),
            value_max_bytes: config.stored_value_max_bytes() as usize,
            ..BackupConfig::for_memory_budget(config.memory_bytes)
        };
        let dir = store_dir(&config.data_dir, generation);
        std::fs::create_dir_all(&dir).map_err(io_error(&dir))?;
        let backup = Backup::open(&dir, backup_config.clone()).map_err(|source| {
            PersistenceError::Backup {
                path: dir.clone(),
                source,
            }
        })?;
        let schemas_dir = config.data_dir.join("schemas");
        std::fs::create_dir_all(&schemas_dir).map_err(io_error(&schemas_dir))?;
        Ok(Arc::new(Persistence {
            store: ArcSwapOption::from_pointee(Store {
                backup,
                generation,
                last_ticket: AtomicU64::new(0),
            }),
            committed: AtomicU64::new(generation),
            data_dir: config.data_dir.clone(),
            backup_config,
            schemas_dir,
            tablets,
            mode: config.persistence,
            health: AtomicU8::new(Health::Ok.to_u8()),
            last_error: Mutex::new(String::new()),
            failures: AtomicU64::new(0),
            rewrites: AtomicU64::new(0),
            wake: Condvar::new(),
            wake_lock: Mutex::new(()),
            stopping: AtomicBool::new(false),
            recovery: Mutex::new(None),
        }))
    }

    /// Feeds every live key the store holds to `restore` (key, value, version, expiry); returns the count.
    pub fn replay(
        &self,
        mut restore: impl FnMut(&[u8], &[u8], u64, u64) -> Result<(), ramlog_logmem::EngineError>,
    ) -> Result<u64, PersistenceError> {
        let mut restored = 0u64;
        let mut first_error = None;
        let store = self.current()?;
        store
            .backup
            .replay_all(|e| match restore(e.key, e.value, e.version, e.expiry) {
                Ok(()) => restored += 1,
                Err(err) => {
                    if first_error.is_none() {
                        first_error = Some(err);
                    }
                }
            })
            .map_err(|source| PersistenceError::Backup {
                path: store_dir(&self.data_dir, store.generation),
                source,
            })?;
        if let Some(err) = first_error {
            tracing::error!(error = %err, "some replayed objects could not be restored");
        }
        Ok(restored)
    }

    /// What the current store holds in memory, by part (None between a failed rewrite attempt
    /// and the next one, when no store is open).
    pub fn memory(&self) -> Option<ramlog_backup::MemoryUsage> {
        self.store.load().as_ref().map(|s| s.backup.memory())
    }

    /// The store writes go to now.
    fn current(&self) -> Result<Arc<Store>, PersistenceError> {
        self.store.load_full().ok_or_else(|| PersistenceError::Io {
            path: self.data_dir.clone(),
            source: std::io::Error::other("no backup store is open"),
        })
    }

    /// Records (or with None removes) a table's schema durably; see [`store_schema`].
    pub fn store_schema(
        &self,
        table: TableId,
        schema: Option<&[u8]>,
    ) -> Result<(), PersistenceError> {
        store_schema(&self.schemas_dir, table, schema)
    }

    /// Every recorded schema; see [`load_schemas`].
    pub fn load_schemas(&self) -> Result<Vec<(TableId, PathBuf, Vec<u8>)>, PersistenceError> {
        load_schemas(&self.schemas_dir)
    }

    /// Opens (creating if missing) the backup logs of these tablets ahead of their first write.
    pub fn open_tablets(&self, tablets: &[TabletId]) -> Result<(), PersistenceError> {
        let store = self.current()?;
        store
            .backup
            .open_tablets(tablets.iter().map(|&t| u64::from(t)))
            .map_err(|source| PersistenceError::Backup {
                path: store_dir(&self.data_dir, store.generation),
                source,
            })
    }

    /// The tablet count of table 0 this data directory was written with (or now records).
    pub fn tablets(&self) -> u16 {
        self.tablets
    }

    pub fn mode(&self) -> PersistenceMode {
        self.mode
    }

    pub fn health(&self) -> Health {
        Health::from_u8(self.health.load(Ordering::Acquire))
    }

    /// Why writes are refused now (the store failed and no rewrite has completed yet), or None
    /// when they are accepted.
    pub fn refusal(&self) -> Option<String> {
        if self.health.load(Ordering::Acquire) == Health::Ok.to_u8() {
            return None;
        }
        let reason = self.last_error.lock().clone();
        Some(match self.health() {
            Health::Rewriting => format!("{reason}; rewriting memory into a fresh store"),
            _ => reason,
        })
    }

    pub fn figures(&self) -> PersistenceFigures {
        PersistenceFigures {
            health: self.health(),
            last_error: self.last_error.lock().clone(),
            failures: self.failures.load(Ordering::Relaxed),
            rewrites: self.rewrites.load(Ordering::Relaxed),
            generation: self.committed.load(Ordering::Relaxed),
        }
    }

    /// Blocks until every write appended so far is fdatasync'd. Run it off the async workers.
    /// An error means the writes could not be made durable: they must not be acknowledged.
    pub fn wait_durable_blocking(&self) -> Result<(), String> {
        if let Some(reason) = self.refusal() {
            return Err(reason);
        }
        let Some(store) = self.store.load_full() else {
            return Err(self
                .refusal()
                .unwrap_or_else(|| "no backup store is open".into()));
        };
        let ticket = store.last_ticket.load(Ordering::Acquire);
        if ticket == 0 {
            return Ok(());
        }
        match store.backup.wait(Ticket(ticket), Stage::Durable) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.fail(&e.to_string());
                Err(self.refusal().unwrap_or_else(|| e.to_string()))
            }
        }
    }

    /// Writes everything buffered and fdatasyncs it (at shutdown), and stops the recovery thread.
    pub fn flush(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        {
            let _g = self.wake_lock.lock();
            self.wake.notify_all();
        }
        if let Some(handle) = self.recovery.lock().take() {
            let _ = handle.join();
        }
        if self.health() != Health::Ok {
            tracing::warn!("persistence had failed; writes since the failure were refused");
            return;
        }
        if let Some(store) = self.store.load_full() {
            if let Err(e) = store.backup.flush() {
                self.fail(&e.to_string());
            }
        }
    }

    /// Marks the store failed (once per failure): writes are refused from now on, and the
    /// recovery thread starts rewriting.
    fn fail(&self, reason: &str) {
        let ok = Health::Ok.to_u8();
        let failed = Health::Failed.to_u8();
        *self.last_error.lock() = reason.to_string();
        let was = self
            .health
            .compare_exchange(ok, failed, Ordering::AcqRel, Ordering::Acquire);
        if was.is_ok() {
            self.failures.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                error = %reason,
                "persistence failed: writes are refused until memory is rewritten into a fresh store"
            );
            let _g = self.wake_lock.lock();
            self.wake.notify_all();
        }
    }

    /// Starts the thread that watches the store and, after a failure, rewrites `engine`'s
    /// tablets (`tablets`, table 0) into a fresh store until one succeeds.
    pub fn start_recovery(self: &Arc<Self>, engine: Arc<Engine>, tablets: Vec<TabletId>) {
        let me = self.clone();
        let handle = std::thread::Builder::new()
            .name("persistence-recovery".into())
            .spawn(move || me.recovery_loop(&engine, &tablets))
            .expect("spawn the persistence recovery thread");
        *self.recovery.lock() = Some(handle);
    }

    fn recovery_loop(&self, engine: &Engine, tablets: &[TabletId]) {
        while !self.stopping.load(Ordering::SeqCst) {
            if self.health() == Health::Ok {
                // Nobody waits on the store in async mode: notice a failed background flush here.
                let failure = self.store.load().as_ref().and_then(|s| s.backup.failure());
                if let Some(reason) = failure {
                    self.fail(&reason);
                    continue;
                }
                let mut g = self.wake_lock.lock();
                self.wake.wait_for(&mut g, HEALTH_POLL);
                continue;
            }
            {
                let mut g = self.wake_lock.lock();
                self.wake.wait_for(&mut g, REWRITE_RETRY);
            }
            if self.stopping.load(Ordering::SeqCst) {
                break;
            }
            match self.rewrite(engine, tablets) {
                Ok(objects) => {
                    self.rewrites.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(
                        objects,
                        generation = self.committed.load(Ordering::Relaxed),
                        "persistence resumed: memory rewritten into a fresh store; writes are accepted again"
                    );
                }
                Err(e) => {
                    self.health.store(Health::Failed.to_u8(), Ordering::Release);
                    tracing::warn!(error = %e, "rewrite into a fresh store failed; retrying");
                }
            }
        }
    }

    /// Copies every live object in memory into a fresh store, makes it durable, and makes it the
    /// current one. Writes stay refused throughout; the few that were admitted just before the
    /// failure and are still being applied append to the new store as soon as it is installed,
    /// and the store keeps the newest version of each key, so their order against the copy does
    /// not matter. Returns the objects copied.
    fn rewrite(&self, engine: &Engine, tablets: &[TabletId]) -> Result<u64, String> {
        self.health
            .store(Health::Rewriting.to_u8(), Ordering::Release);
        let committed = self.committed.load(Ordering::Acquire);
        let generation = committed + 1;
        let dir = store_dir(&self.data_dir, generation);
        // A store that an earlier attempt installed but could not complete: close it, and remove
        // every directory but the committed store's, so attempts do not pile up on the disk.
        if self
            .store
            .load()
            .as_ref()
            .is_some_and(|s| s.generation != committed)
        {
            self.store.store(None);
        }
        remove_other_generations(&self.data_dir, committed);
        let describe =
            |what: &str, e: &dyn std::fmt::Display| format!("{what} {}: {e}", dir.display());
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(describe("removing", &e)),
        }
        let backup =
            Backup::open(&dir, self.backup_config.clone()).map_err(|e| describe("opening", &e))?;
        backup
            .open_tablets(tablets.iter().map(|&t| u64::from(t)))
            .map_err(|e| describe("opening tablets in", &e))?;
        let store = Arc::new(Store {
            backup,
            generation,
            last_ticket: AtomicU64::new(0),
        });
        drop(self.store.swap(Some(store.clone())));
        let mut copied = 0u64;
        let mut keys = Vec::new();
        let mut batch: Vec<(Vec<u8>, Vec<u8>, u64, u64)> =
            Vec::with_capacity(REWRITE_BATCH_OBJECTS);
        for &tablet in tablets {
            let mut cursor = 0;
            loop {
                if self.stopping.load(Ordering::SeqCst) {
                    return Err("the server is stopping".into());
                }
                keys.clear();
                cursor = engine
                    .scan_keys(tablet, cursor, REWRITE_BATCH_OBJECTS, &mut keys)
                    .map_err(|e| format!("reading tablet {tablet}: {e}"))?;
                batch.clear();
                let mut batch_bytes = 0;
                let last = keys.len();
                for (i, key) in keys.drain(..).enumerate() {
                    let found = engine
                        .read_with(tablet, &key, |value, version, expire_at_ms| {
                            (value.to_vec(), version, expire_at_ms)
                        })
                        .map_err(|e| format!("reading tablet {tablet}: {e}"))?;
                    if let Some((value, version, expiry)) = found {
                        batch_bytes += key.len() + value.len();
                        batch.push((key, value, version, expiry));
                    }
                    if batch_bytes >= REWRITE_BATCH_BYTES || i + 1 == last {
                        copied += append_copies(&store, tablet, &mut batch)
                            .map_err(|e| describe("writing", &e))?;
                        batch_bytes = 0;
                    }
                }
                if cursor == 0 {
                    break;
                }
            }
        }
        store.backup.flush().map_err(|e| describe("syncing", &e))?;
        write_store_file(&self.data_dir, generation).map_err(|e| e.to_string())?;
        self.committed.store(generation, Ordering::Release);
        remove_other_generations(&self.data_dir, generation);
        self.health.store(Health::Ok.to_u8(), Ordering::Release);
        Ok(copied)
    }
}

/// Appends a rewrite's copies of one tablet's objects to the store, in version order (the store
/// wants each call's entries in version order), and empties `batch`; returns how many.
fn append_copies(
    store: &Store,
    tablet: TabletId,
    batch: &mut Vec<(Vec<u8>, Vec<u8>, u64, u64)>,
) -> Result<u64, ramlog_backup::Error> {
    if batch.is_empty() {
        return Ok(0);
    }
    batch.sort_by_key(|e| e.2);
    let entries: Vec<Entry<'_>> = batch
        .iter()
        .map(|(key, value, version, expiry)| Entry {
            key,
            value: Some(value),
            version: *version,
            expiry: *expiry,
        })
        .collect();
    let ticket = store.backup.append(u64::from(tablet), &entries)?;
    store.last_ticket.fetch_max(ticket.0, Ordering::AcqRel);
    let n = entries.len() as u64;
    drop(entries);
    batch.clear();
    Ok(n)
}

impl WriteObserver for Persistence {
    fn on_writes(&self, tablet: TabletId, records: &[LoggedWrite<'_>]) {
        if self.health.load(Ordering::Acquire) == Health::Failed.to_u8() {
            // The store is broken; memory keeps these writes and the rewrite will log them.
            return;
        }
        let entries: Vec<Entry<'_>> = records
            .iter()
            .map(|r| Entry {
                key: r.key,
                value: r.value,
                version: r.version,
                expiry: r.expire_at_ms,
            })
            .collect();
        let store = self.store.load();
        let Some(store) = store.as_ref() else {
            return; // between rewrite attempts: writes are refused, memory keeps these
        };
        match store.backup.append(u64::from(tablet), &entries) {
            Ok(ticket) => {
                store.last_ticket.fetch_max(ticket.0, Ordering::AcqRel);
            }
            Err(e) => self.fail(&e.to_string()),
        }
    }
}

/// The directory of store generation `generation`: `backup` for 0 (the first store of a data
/// directory), `backup.<n>` for the stores rewrites made.
fn store_dir(data_dir: &Path, generation: u64) -> PathBuf {
    match generation {
        0 => data_dir.join("backup"),
        n => data_dir.join(format!("backup.{n}")),
    }
}

/// The current store generation that `<data_dir>/STORE` names; 0 when there is no such file (no
/// rewrite ever completed). A file that is present but not exactly one valid line is an error
/// naming it.
fn read_store_file(data_dir: &Path) -> Result<u64, PersistenceError> {
    let path = data_dir.join("STORE");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            return Err(PersistenceError::CorruptStoreFile {
                path,
                reason: "not UTF-8 text".into(),
            })
        }
        Err(source) => return Err(PersistenceError::Io { path, source }),
    };
    let generation = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.trim())
        .collect::<Vec<_>>();
    match generation.as_slice() {
        [line] => line
            .strip_prefix("store = backup.")
            .and_then(|n| n.parse::<u64>().ok())
            .filter(|&n| n > 0 && text.ends_with('\n'))
            .ok_or_else(|| PersistenceError::CorruptStoreFile {
                path: path.clone(),
                reason: format!("expected `store = backup.N` (N > 0), found {line:?}"),
            }),
        _ => Err(PersistenceError::CorruptStoreFile {
            path,
            reason: "expected exactly one `store = backup.N` line".into(),
        }),
    }
}

/// Makes `generation` the current store: `STORE` is written to a temporary file, fdatasync'd,
/// renamed over the old one, and the directory synced.
fn write_store_file(data_dir: &Path, generation: u64) -> Result<(), PersistenceError> {
    debug_assert!(generation > 0);
    let tmp = data_dir.join("STORE.tmp");
    let path = data_dir.join("STORE");
    {
        let mut f = std::fs::File::create(&tmp).map_err(io_error(&tmp))?;
        let text = format!(
            "# written by ramlog server: the current backup store directory; do not edit\nstore = backup.{generation}\n"
        );
        std::io::Write::write_all(&mut f, text.as_bytes()).map_err(io_error(&tmp))?;
        f.sync_data().map_err(io_error(&tmp))?;
    }
    std::fs::rename(&tmp, &path).map_err(io_error(&path))?;
    ramlog_backup::io::sync_dir(data_dir).map_err(io_error(data_dir))
}

/// Removes the store directories of every generation but `current` (what a completed rewrite
/// replaced, or what an interrupted one left). Failures are logged: they cost space, not data.
fn remove_other_generations(data_dir: &Path, current: u64) {
    let Ok(entries) = std::fs::read_dir(data_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let generation = match name {
            "backup" => 0,
            _ => match name
                .strip_prefix("backup.")
                .and_then(|n| n.parse::<u64>().ok())
            {
                Some(n) if n > 0 => n,
                _ => continue,
            },
        };
        if generation != current && entry.path().is_dir() {
            match std::fs::remove_dir_all(entry.path()) {
                Ok(()) => {
                    tracing::info!(dir = %entry.path().display(), "removed a replaced backup store")
                }
                Err(e) => {
                    tracing::warn!(dir = %entry.path().display(), error = %e, "could not remove a replaced backup store")
                }
            }
        }
    }
}

/// Records (or with None removes) a table's schema in `dir`, durably, before the caller applies
/// it: `<table>.schema` holds the schema's binary encoding, replaced atomically (written to a
/// temporary file, fdatasync'd, renamed, directory synced), so a crash leaves the old schema or
/// the new one. Rare (an administrative request), so it blocks the caller.
fn store_schema(dir: &Path, table: TableId, schema: Option<&[u8]>) -> Result<(), PersistenceError> {
    let path = dir.join(format!("{table}.schema"));
    match schema {
        Some(bytes) => {
            let tmp = dir.join(format!("{table}.schema.tmp"));
            {
                let mut f = std::fs::File::create(&tmp).map_err(io_error(&tmp))?;
                std::io::Write::write_all(&mut f, bytes).map_err(io_error(&tmp))?;
                f.sync_data().map_err(io_error(&tmp))?;
            }
            std::fs::rename(&tmp, &path).map_err(io_error(&path))?;
        }
        None => match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_error(&path)(e)),
        },
    }
    ramlog_backup::io::sync_dir(dir).map_err(io_error(dir))
}

/// Maps an I/O error on `path` to a [`PersistenceError`].
fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> PersistenceError {
    let path = path.to_path_buf();
    move |source| PersistenceError::Io { path, source }
}

/// Every recorded schema as (table, file, encoded schema). A name that is not `<table>.schema`
/// (a leftover temporary file) is skipped; the caller decodes the bytes and reports a
/// corrupt file by its path.
fn load_schemas(dir: &Path) -> Result<Vec<(TableId, PathBuf, Vec<u8>)>, PersistenceError> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let path = entry.map_err(io_error(dir))?.path();
        let Some(table) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".schema"))
            .and_then(|t| t.parse::<TableId>().ok())
        else {
            continue;
        };
        let bytes = std::fs::read(&path).map_err(io_error(&path))?;
        out.push((table, path, bytes));
    }
    out.sort_by_key(|e| e.0);
    Ok(out)
}

/// Returns the tablet count the data directory records, recording `configured` (or the default)
/// in a directory that has none yet; a configured count other than the recorded one is an error.
fn check_layout(data_dir: &Path, configured: Option<u16>) -> Result<u16, PersistenceError> {
    let path = data_dir.join("layout");
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let found = text
                .lines()
                .find_map(|l| l.strip_prefix("tablets = "))
                .and_then(|v| v.trim().parse::<u16>().ok())
                .filter(|t| (1..=TABLETS_MAX).contains(t))
                .ok_or_else(|| PersistenceError::Io {
                    path: path.clone(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "no valid `tablets = N` line (N in 1..=1024)",
                    ),
                })?;
            match configured {
                Some(wanted) if wanted != found => Err(PersistenceError::LayoutChanged {
                    path: data_dir.to_path_buf(),
                    found,
                    wanted,
                }),
                _ => Ok(found),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let tablets = configured.unwrap_or(TABLETS_DEFAULT);
            std::fs::write(
                &path,
                format!("# written by ramlog server; do not edit\ntablets = {tablets}\n"),
            )
            .map_err(|source| PersistenceError::Io { path, source })?;
            Ok(tablets)
        }
        Err(source) => Err(PersistenceError::Io { path, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemas_are_stored_replaced_removed_and_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        assert!(load_schemas(d).unwrap().is_empty());
        store_schema(d, 0, Some(b"first")).unwrap();
        store_schema(d, 7, Some(b"seven")).unwrap();
        store_schema(d, 0, Some(b"second")).unwrap();
        // A temporary file left by a crash mid-write and a foreign file are not schemas.
        std::fs::write(d.join("3.schema.tmp"), b"torn").unwrap();
        std::fs::write(d.join("notes.txt"), b"x").unwrap();
        let got: Vec<(TableId, Vec<u8>)> = load_schemas(d)
            .unwrap()
            .into_iter()
            .map(|(t, _, b)| (t, b))
            .collect();
        assert_eq!(got, vec![(0, b"second".to_vec()), (7, b"seven".to_vec())]);
        store_schema(d, 7, None).unwrap();
        // Removing an absent schema is not an error.
        store_schema(d, 9, None).unwrap();
        let tables: Vec<TableId> = load_schemas(d).unwrap().iter().map(|e| e.0).collect();
        assert_eq!(tables, vec![0]);
        // An unwritable directory is a clear error naming it.
        let missing = d.join("gone");
        let err = store_schema(&missing, 1, Some(b"x")).unwrap_err();
        assert!(err.to_string().contains("gone"), "{err}");
    }

    #[test]
    fn layout_is_recorded_then_adopted_or_enforced() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(check_layout(dir.path(), None).unwrap(), TABLETS_DEFAULT);
        assert_eq!(
            check_layout(dir.path(), None).unwrap(),
            TABLETS_DEFAULT,
            "an unset count adopts the recorded one"
        );
        assert_eq!(
            check_layout(dir.path(), Some(TABLETS_DEFAULT)).unwrap(),
            TABLETS_DEFAULT
        );
        let err = check_layout(dir.path(), Some(16)).unwrap_err();
        assert!(
            matches!(err, PersistenceError::LayoutChanged { found, wanted: 16, .. } if found == TABLETS_DEFAULT),
            "{err}"
        );

        let older = tempfile::tempdir().unwrap();
        assert_eq!(check_layout(older.path(), Some(16)).unwrap(), 16);
        assert_eq!(
            check_layout(older.path(), None).unwrap(),
            16,
            "a directory written with another count keeps it when the configuration names none"
        );

        let corrupt = tempfile::tempdir().unwrap();
        std::fs::write(corrupt.path().join("layout"), "tablets = 0\n").unwrap();
        assert!(check_layout(corrupt.path(), None).is_err());
        std::fs::write(corrupt.path().join("layout"), "garbage").unwrap();
        assert!(check_layout(corrupt.path(), Some(16)).is_err());
    }
}
