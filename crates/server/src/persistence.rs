//! Single-server persistence: every tablet's writes go to this server's own backup log store
//! (`ramlog-backup`), and a restart replays them into memory.
//!
//! The engine hands each atomic unit of writes to [`Persistence`] (its [`WriteObserver`]) in version
//! order, under the tablet's write lock; `on_writes` only appends to the store's write buffer. The
//! store writes them within `flush_interval_ms` (100 ms) and fdatasyncs them within about the
//! same time, which is Redis's `appendfsync everysec` at a finer grain (`async` mode). In
//! `durable` mode a connection's replies wait in [`Persistence::wait_durable`] until everything
//! appended so far is on disk.
//!
//! The backup's tablet ids are the engine's tablet ids, so the tablet layout (the number of tablets
//! of table 0) is recorded in the data directory and must not change between runs: a server whose
//! configuration names no count adopts the recorded one, and one that names another count refuses
//! to start.

use crate::config::{PersistenceMode, ServerConfig, TABLETS_DEFAULT, TABLETS_MAX};
use ramlog_backup::{Backup, Config as BackupConfig, Entry, Stage, Ticket};
use ramlog_common::TableId;
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
    #[error("schema file {path} is unreadable ({reason}); remove it and set the schema again")]
    CorruptSchema { path: PathBuf, reason: String },
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
    /// The backup store's directory (for errors).
    backup_dir: PathBuf,
    /// `<data_dir>/schemas`: one file per table with a schema (see [`Persistence::store_schema`]).
    schemas_dir: PathBuf,
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
        std::fs::create_dir_all(&dir).map_err(io_error(&dir))?;
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
        let schemas_dir = config.data_dir.join("schemas");
        std::fs::create_dir_all(&schemas_dir).map_err(io_error(&schemas_dir))?;
        Ok(Arc::new(Persistence {
            backup,
            backup_dir: dir,
            schemas_dir,
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
                path: self.backup_dir.clone(),
                source,
            })?;
        if let Some(err) = first_error {
            tracing::error!(error = %err, "some replayed objects could not be restored");
        }
        Ok(restored)
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
        self.backup
            .open_tablets(tablets.iter().map(|&t| u64::from(t)))
            .map_err(|source| PersistenceError::Backup {
                path: self.backup_dir.clone(),
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
