//! Single-server persistence: every tablet's writes go to this server's own backup log store
//! (`ramlog-backup`), and a restart replays them into memory.
//!
//! The engine hands each atomic unit of writes to [`Persistence`] (its [`WriteObserver`]) in version
//! order, under the tablet's write lock; `on_writes` only appends to the store's write buffer. The
//! store writes them within `flush_interval_ms` (100 ms) and fdatasyncs them within about the
//! same time, which is Redis's `appendfsync everysec` at a finer grain (`async` mode). In `durable` mode a connection's replies
//! wait in [`Persistence::wait_durable`] until everything appended so far is on disk.
//!
//! The backup's tablet ids are the engine's tablet ids, so the tablet layout (the number of tablets
//! of table 0) is recorded in the data directory and must not change between runs: a server whose
//! configuration names no count adopts the recorded one, and one that names another count refuses
//! to start.

use crate::config::{PersistenceMode, ServerConfig, TABLETS_DEFAULT, TABLETS_MAX};
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
    /// Tablets of table 0, as recorded in the data directory.
    tablets: u16,
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
        let tablets = check_layout(&config.data_dir, config.tablets)?;
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
            tablets,
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

    /// The tablet count of table 0 this data directory was written with (or now records).
    pub fn tablets(&self) -> u16 {
        self.tablets
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
