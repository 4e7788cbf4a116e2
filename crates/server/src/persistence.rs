//! Single-server persistence: every tablet's writes go to this server's own backup log store
//! (`ramlog-backup`), and a restart replays them into memory.
//!
//! The engine hands each atomic unit of writes to [`Persistence`] (its [`WriteObserver`]) in version
//! order, under the tablet's write lock; `on_writes` only appends to the store's write buffer. The
//! store flushes every `flush_interval_ms` (100 ms) with fdatasync, which is Redis's
//! `appendfsync everysec` at a finer grain (`async` mode). In `durable` mode a connection's replies
//! wait in [`Persistence::wait_durable`] until everything appended so far is on disk.
//!
//! The backup's tablet ids are the engine's tablet ids, so the tablet layout (the number of tablets
//! of table 0) is recorded in the data directory and must not change between runs.

use crate::config::{PersistenceMode, ServerConfig};
use ramlog_backup::{Backup, Config as BackupConfig, Entry, Stage, Ticket};
use ramlog_logmem::{LoggedWrite, TabletId, WriteObserver};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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

pub struct Persistence {
    backup: Backup,
    mode: PersistenceMode,
    /// Highest ticket handed out by the store; waiting for it covers every write acknowledged so far.
    last_ticket: AtomicU64,
    /// Set once an append failed (disk full, I/O error): writes then report the failure in logs
    /// and `durable` waits return at once rather than hang.
    failed: AtomicBool,
}

impl Persistence {
    /// Opens (or creates) the store under `data_dir/backup`, checking the recorded tablet layout.
    pub fn open(config: &ServerConfig) -> Result<Arc<Persistence>, PersistenceError> {
        debug_assert!(config.persistence != PersistenceMode::Off);
        let dir = config.data_dir.join("backup");
        std::fs::create_dir_all(&dir).map_err(|source| PersistenceError::Io {
            path: dir.clone(),
            source,
        })?;
        check_layout(&config.data_dir, config.tablets)?;
        let backup_config = BackupConfig {
            flush_interval: Duration::from_millis(config.flush_interval_ms),
            value_max_bytes: config.value_size_max_bytes as usize,
            ..BackupConfig::default()
        };
        let backup =
            Backup::open(&dir, backup_config).map_err(|source| PersistenceError::Backup {
                path: dir.clone(),
                source,
            })?;
        Ok(Arc::new(Persistence {
            backup,
            mode: config.persistence,
            last_ticket: AtomicU64::new(0),
            failed: AtomicBool::new(false),
        }))
    }

    /// Feeds every live key the store holds to `restore` (key, value, version, expiry); returns the count.
    pub fn replay(
        &self,
        mut restore: impl FnMut(&[u8], &[u8], u64, u64) -> Result<(), ramlog_logmem::EngineError>,
    ) -> Result<u64, PersistenceError> {
        let mut restored = 0u64;
        let mut first_error = None;
        self.backup
            .replay_all(|e| match restore(e.key, e.value, e.version, e.expiry) {
                Ok(()) => restored += 1,
                Err(err) => {
                    if first_error.is_none() {
                        first_error = Some(err);
                    }
                }
            })
            .map_err(|source| PersistenceError::Backup {
                path: PathBuf::from("backup"),
                source,
            })?;
        if let Some(err) = first_error {
            tracing::error!(error = %err, "some replayed objects could not be restored");
        }
        Ok(restored)
    }

    pub fn mode(&self) -> PersistenceMode {
        self.mode
    }

    /// Blocks until every write appended so far is fdatasync'd. Run it off the async workers.
    pub fn wait_durable_blocking(&self) {
        let ticket = self.last_ticket.load(Ordering::Acquire);
        if ticket == 0 || self.failed.load(Ordering::Relaxed) {
            return;
        }
        if let Err(e) = self.backup.wait(Ticket(ticket), Stage::Durable) {
            self.fail(&e);
        }
    }

    /// Writes everything buffered and fdatasyncs it (at shutdown).
    pub fn flush(&self) {
        if let Err(e) = self.backup.flush() {
            self.fail(&e);
        }
    }

    fn fail(&self, e: &ramlog_backup::Error) {
        if !self.failed.swap(true, Ordering::Relaxed) {
            tracing::error!(error = %e, "persistence failed; writes are no longer logged to disk");
        }
    }
}

impl WriteObserver for Persistence {
    fn on_writes(&self, tablet: TabletId, records: &[LoggedWrite<'_>]) {
        if self.failed.load(Ordering::Relaxed) {
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
        match self.backup.append(u64::from(tablet), &entries) {
            Ok(ticket) => {
                self.last_ticket.fetch_max(ticket.0, Ordering::AcqRel);
            }
            Err(e) => self.fail(&e),
        }
    }
}

fn check_layout(data_dir: &Path, tablets: u16) -> Result<(), PersistenceError> {
    let path = data_dir.join("layout");
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let found = text
                .lines()
                .find_map(|l| l.strip_prefix("tablets = "))
                .and_then(|v| v.trim().parse::<u16>().ok())
                .unwrap_or(0);
            if found != tablets {
                return Err(PersistenceError::LayoutChanged {
                    path: data_dir.to_path_buf(),
                    found,
                    wanted: tablets,
                });
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::write(
            &path,
            format!("# written by ramlog server; do not edit\ntablets = {tablets}\n"),
        )
        .map_err(|source| PersistenceError::Io { path, source }),
        Err(source) => Err(PersistenceError::Io { path, source }),
    }
}
