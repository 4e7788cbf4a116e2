//! The coordinator's durable Raft storage: openraft's log store and state machine over files in
//! the data directory.
//!
//! Owns the data directory's files:
//! - `raft-log`: append-only records (see [`crate::files`]) of log entries, truncations and
//!   purges, replayed in order on opening; compacted when purged records dominate.
//! - `raft-meta`: the vote and the committed log id, replaced atomically on every change.
//! - `snapshot`: the last snapshot (its meta and the [`ClusterState`]), replaced atomically.
//!
//! Everything is fsynced before openraft hears it is persisted. Hides: the file formats, the
//! in-memory copy of the log, and how the state machine is restored from the snapshot at start
//! (openraft then re-applies the committed entries after it).

// openraft's traits return its error types, which are large; boxing them is not an option.
#![allow(clippy::result_large_err)]

use crate::files::{read_records, replace_file, AppendFile};
use crate::{Applied, TypeConfig};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    AnyError, BasicNode, Entry, EntryPayload, LogId, RaftLogReader, RaftSnapshotBuilder,
    SnapshotMeta, StorageError, StorageIOError, StoredMembership, Vote,
};
use ramlog_cluster::ClusterState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

type NodeId = u64;
type SError = StorageError<NodeId>;

const LOG_FILE: &str = "raft-log";
const META_FILE: &str = "raft-meta";
const SNAPSHOT_FILE: &str = "snapshot";

#[derive(Serialize, Deserialize)]
enum LogRecord {
    Entry(Entry<TypeConfig>),
    /// Entries from this index on are gone.
    Truncate(u64),
    /// Entries up to and including this log id are gone.
    Purge(LogId<NodeId>),
}

#[derive(Default, Serialize, Deserialize)]
struct Meta {
    vote: Option<Vote<NodeId>>,
    committed: Option<LogId<NodeId>>,
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    state: ClusterState,
}

/// Opens (creating) the storage in `dir`: the log store and the state machine for
/// `openraft::Raft::new`.
pub fn open(dir: &Path) -> anyhow::Result<(LogStore, StateMachine)> {
    std::fs::create_dir_all(dir)
        .map_err(|e| anyhow::anyhow!("cannot create the data directory {}: {e}", dir.display()))?;
    let log = LogStore::open(dir).map_err(anyhow::Error::msg)?;
    let sm = StateMachine::open(dir).map_err(anyhow::Error::msg)?;
    Ok((log, sm))
}

struct LogInner {
    dir: PathBuf,
    file: AppendFile,
    records_in_file: usize,
    entries: BTreeMap<u64, Entry<TypeConfig>>,
    last_purged: Option<LogId<NodeId>>,
    meta: Meta,
}

/// openraft's log store (and log reader: clones share the same log).
#[derive(Clone)]
pub struct LogStore {
    inner: Arc<Mutex<LogInner>>,
}

fn io_err(text: impl ToString) -> AnyError {
    AnyError::error(text)
}

impl LogStore {
    /// Opens the log and the meta file in `dir`.
    pub fn open(dir: &Path) -> Result<LogStore, String> {
        let path = dir.join(LOG_FILE);
        let records = read_records(&path)?;
        if records.torn {
            tracing::warn!(
                file = %path.display(),
                valid_bytes = records.valid_len,
                "dropping a torn last record (a write that a crash interrupted)"
            );
        }
        let mut entries = BTreeMap::new();
        let mut last_purged = None;
        for (i, body) in records.bodies.iter().enumerate() {
            let record: LogRecord = serde_json::from_slice(body).map_err(|e| {
                format!(
                    "{} is corrupt: record {i} does not decode: {e}",
                    path.display()
                )
            })?;
            match record {
                LogRecord::Entry(entry) => {
                    entries.insert(entry.log_id.index, entry);
                }
                LogRecord::Truncate(index) => {
                    entries.split_off(&index);
                }
                LogRecord::Purge(log_id) => {
                    entries = entries.split_off(&(log_id.index + 1));
                    last_purged = Some(log_id);
                }
            }
        }
        let file = AppendFile::open(&path, records.valid_len)?;
        let meta_path = dir.join(META_FILE);
        let meta_records = read_records(&meta_path)?;
        let meta = match meta_records.bodies.last() {
            Some(body) if !meta_records.torn => serde_json::from_slice(body).map_err(|e| {
                format!(
                    "{} is corrupt: it does not decode: {e}",
                    meta_path.display()
                )
            })?,
            None if !meta_records.torn => Meta::default(),
            _ => {
                return Err(format!(
                    "{} is corrupt: it is cut short or fails its checksum",
                    meta_path.display()
                ))
            }
        };
        Ok(LogStore {
            inner: Arc::new(Mutex::new(LogInner {
                dir: dir.to_path_buf(),
                file,
                records_in_file: records.bodies.len(),
                entries,
                last_purged,
                meta,
            })),
        })
    }

    fn lock(&self) -> MutexGuard<'_, LogInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl LogInner {
    fn write_meta(&self) -> Result<(), String> {
        let body = serde_json::to_vec(&self.meta).map_err(|e| e.to_string())?;
        replace_file(&self.dir.join(META_FILE), &[body])
    }

    fn append_records(&mut self, records: &[LogRecord]) -> Result<(), String> {
        let bodies = records
            .iter()
            .map(|r| serde_json::to_vec(r).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        self.file.append(&bodies)?;
        self.records_in_file += bodies.len();
        Ok(())
    }

    /// Rewrites the log file with just the live entries once it holds mostly dead records.
    fn maybe_compact(&mut self) -> Result<(), String> {
        if self.records_in_file <= 2 * self.entries.len() + 1024 {
            return Ok(());
        }
        let mut records = Vec::with_capacity(self.entries.len() + 1);
        if let Some(p) = self.last_purged {
            records.push(LogRecord::Purge(p));
        }
        records.extend(self.entries.values().cloned().map(LogRecord::Entry));
        let bodies = records
            .iter()
            .map(|r| serde_json::to_vec(r).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        self.file.rewrite(&bodies)?;
        self.records_in_file = bodies.len();
        Ok(())
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, SError> {
        let inner = self.lock();
        Ok(inner.entries.range(range).map(|(_, e)| e.clone()).collect())
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, SError> {
        let inner = self.lock();
        let last = inner
            .entries
            .values()
            .next_back()
            .map(|e| e.log_id)
            .or(inner.last_purged);
        Ok(LogState {
            last_purged_log_id: inner.last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), SError> {
        let mut inner = self.lock();
        inner.meta.vote = Some(*vote);
        inner
            .write_meta()
            .map_err(|e| StorageIOError::write_vote(io_err(e)).into())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, SError> {
        Ok(self.lock().meta.vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId<NodeId>>) -> Result<(), SError> {
        let mut inner = self.lock();
        if inner.meta.committed == committed {
            return Ok(());
        }
        inner.meta.committed = committed;
        inner
            .write_meta()
            .map_err(|e| StorageIOError::write(io_err(e)).into())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, SError> {
        Ok(self.lock().meta.committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), SError>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let entries: Vec<Entry<TypeConfig>> = entries.into_iter().collect();
        let mut inner = self.lock();
        let records: Vec<LogRecord> = entries.iter().cloned().map(LogRecord::Entry).collect();
        match inner.append_records(&records) {
            Ok(()) => {
                for e in entries {
                    inner.entries.insert(e.log_id.index, e);
                }
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.clone())));
                Err(StorageIOError::write_logs(io_err(e)).into())
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), SError> {
        let mut inner = self.lock();
        inner
            .append_records(&[LogRecord::Truncate(log_id.index)])
            .map_err(|e| SError::from(StorageIOError::write_logs(io_err(e))))?;
        inner.entries.split_off(&log_id.index);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), SError> {
        let mut inner = self.lock();
        inner
            .append_records(&[LogRecord::Purge(log_id)])
            .map_err(|e| SError::from(StorageIOError::write_logs(io_err(e))))?;
        inner.entries = inner.entries.split_off(&(log_id.index + 1));
        inner.last_purged = Some(log_id);
        inner
            .maybe_compact()
            .map_err(|e| StorageIOError::write_logs(io_err(e)).into())
    }
}

/// What the state machine holds; shared with the service, which reads the map from it.
#[derive(Default)]
pub struct Machine {
    pub last_applied: Option<LogId<NodeId>>,
    pub membership: StoredMembership<NodeId, BasicNode>,
    pub state: ClusterState,
}

/// openraft's state machine over [`ClusterState`], with its snapshot file.
#[derive(Clone)]
pub struct StateMachine {
    dir: PathBuf,
    machine: Arc<RwLock<Machine>>,
    snapshot: Arc<Mutex<Option<StoredSnapshot>>>,
}

impl StateMachine {
    /// Opens the snapshot in `dir` (if any) and restores the state from it.
    pub fn open(dir: &Path) -> Result<StateMachine, String> {
        let path = dir.join(SNAPSHOT_FILE);
        let records = read_records(&path)?;
        let snapshot: Option<StoredSnapshot> =
            match records.bodies.last() {
                Some(body) if !records.torn => Some(serde_json::from_slice(body).map_err(|e| {
                    format!("{} is corrupt: it does not decode: {e}", path.display())
                })?),
                None if !records.torn => None,
                _ => {
                    return Err(format!(
                        "{} is corrupt: it is cut short or fails its checksum",
                        path.display()
                    ))
                }
            };
        let machine = match &snapshot {
            Some(s) => Machine {
                last_applied: s.meta.last_log_id,
                membership: s.meta.last_membership.clone(),
                state: s.state.clone(),
            },
            None => Machine::default(),
        };
        Ok(StateMachine {
            dir: dir.to_path_buf(),
            machine: Arc::new(RwLock::new(machine)),
            snapshot: Arc::new(Mutex::new(snapshot)),
        })
    }

    /// The state the service reads.
    pub fn shared(&self) -> Arc<RwLock<Machine>> {
        self.machine.clone()
    }

    fn save_snapshot(&self, snapshot: StoredSnapshot) -> Result<(), String> {
        let body = serde_json::to_vec(&snapshot).map_err(|e| e.to_string())?;
        replace_file(&self.dir.join(SNAPSHOT_FILE), &[body])?;
        *self.snapshot.lock().unwrap_or_else(|p| p.into_inner()) = Some(snapshot);
        Ok(())
    }
}

fn to_snapshot(s: &StoredSnapshot) -> Result<Snapshot<TypeConfig>, SError> {
    let data = serde_json::to_vec(&s.state).map_err(|e| {
        SError::from(StorageIOError::read_snapshot(
            Some(s.meta.signature()),
            io_err(e),
        ))
    })?;
    Ok(Snapshot {
        meta: s.meta.clone(),
        snapshot: Box::new(Cursor::new(data)),
    })
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, SError> {
        let stored = {
            let m = self.machine.read().unwrap_or_else(|p| p.into_inner());
            let snapshot_id = match m.last_applied {
                Some(l) => format!("{}-{}", l.leader_id, l.index),
                None => "empty".to_string(),
            };
            StoredSnapshot {
                meta: SnapshotMeta {
                    last_log_id: m.last_applied,
                    last_membership: m.membership.clone(),
                    snapshot_id,
                },
                state: m.state.clone(),
            }
        };
        let snapshot = to_snapshot(&stored)?;
        let signature = stored.meta.signature();
        self.save_snapshot(stored)
            .map_err(|e| StorageIOError::write_snapshot(Some(signature), io_err(e)))?;
        Ok(snapshot)
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = StateMachine;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), SError> {
        let m = self.machine.read().unwrap_or_else(|p| p.into_inner());
        Ok((m.last_applied, m.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Applied>, SError>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let mut m = self.machine.write().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        for entry in entries {
            m.last_applied = Some(entry.log_id);
            let result = match entry.payload {
                EntryPayload::Blank => None,
                EntryPayload::Normal(command) => Some(m.state.apply(&command)),
                EntryPayload::Membership(membership) => {
                    m.membership = StoredMembership::new(Some(entry.log_id), membership);
                    None
                }
            };
            out.push(Applied {
                result,
                map: m.state.map.clone(),
            });
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, SError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), SError> {
        let state: ClusterState = serde_json::from_slice(snapshot.get_ref()).map_err(|e| {
            SError::from(StorageIOError::read_snapshot(
                Some(meta.signature()),
                io_err(format!("the received snapshot does not decode: {e}")),
            ))
        })?;
        let stored = StoredSnapshot {
            meta: meta.clone(),
            state: state.clone(),
        };
        self.save_snapshot(stored)
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), io_err(e)))?;
        let mut m = self.machine.write().unwrap_or_else(|p| p.into_inner());
        m.last_applied = meta.last_log_id;
        m.membership = meta.last_membership.clone();
        m.state = state;
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, SError> {
        let guard = self.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref() {
            Some(s) => to_snapshot(s).map(Some),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, RaftLogReader};
    use ramlog_cluster::Command;

    fn log_id(term: u64, index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(term, 1), index)
    }

    fn entry(term: u64, index: u64) -> Entry<TypeConfig> {
        Entry {
            log_id: log_id(term, index),
            payload: EntryPayload::Normal(Command::DropTable {
                name: format!("t{index}"),
            }),
        }
    }

    /// Appends through the file layer directly (openraft's flush callback cannot be built
    /// outside openraft), exactly as `append` does.
    fn append(store: &LogStore, entries: Vec<Entry<TypeConfig>>) {
        let mut inner = store.lock();
        let records: Vec<LogRecord> = entries.iter().cloned().map(LogRecord::Entry).collect();
        inner.append_records(&records).unwrap();
        for e in entries {
            inner.entries.insert(e.log_id.index, e);
        }
    }

    async fn indexes(store: &mut LogStore) -> Vec<u64> {
        store
            .try_get_log_entries(0..)
            .await
            .unwrap()
            .iter()
            .map(|e| e.log_id.index)
            .collect()
    }

    #[tokio::test]
    async fn entries_vote_and_committed_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = LogStore::open(dir.path()).unwrap();
        append(&store, (1..=5).map(|i| entry(1, i)).collect());
        store.save_vote(&Vote::new(3, 2)).await.unwrap();
        store.save_committed(Some(log_id(1, 4))).await.unwrap();
        store.truncate(log_id(1, 4)).await.unwrap();
        append(&store, vec![entry(2, 4)]);
        store.purge(log_id(1, 1)).await.unwrap();
        drop(store);

        let mut again = LogStore::open(dir.path()).unwrap();
        assert_eq!(indexes(&mut again).await, vec![2, 3, 4]);
        let four = again.try_get_log_entries(4..5).await.unwrap();
        assert_eq!(four[0].log_id, log_id(2, 4));
        assert_eq!(again.read_vote().await.unwrap(), Some(Vote::new(3, 2)));
        assert_eq!(again.read_committed().await.unwrap(), Some(log_id(1, 4)));
        let state = again.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id, Some(log_id(1, 1)));
        assert_eq!(state.last_log_id, Some(log_id(2, 4)));
    }

    #[tokio::test]
    async fn a_torn_last_record_is_dropped_and_appending_continues() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        append(&store, (1..=3).map(|i| entry(1, i)).collect());
        drop(store);
        let path = dir.path().join(LOG_FILE);
        let len = std::fs::metadata(&path).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(len - 5).unwrap();
        drop(f);

        let mut again = LogStore::open(dir.path()).unwrap();
        assert_eq!(indexes(&mut again).await, vec![1, 2]);
        append(&again, vec![entry(1, 3)]);
        drop(again);
        let mut third = LogStore::open(dir.path()).unwrap();
        assert_eq!(indexes(&mut third).await, vec![1, 2, 3]);
    }

    #[test]
    fn a_corrupt_record_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = LogStore::open(dir.path()).unwrap();
        append(&store, (1..=3).map(|i| entry(1, i)).collect());
        drop(store);
        let path = dir.path().join(LOG_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[12] ^= 0x55;
        std::fs::write(&path, &bytes).unwrap();
        let e = LogStore::open(dir.path()).err().unwrap();
        assert!(e.contains("raft-log") && e.contains("checksum"), "{e}");

        std::fs::write(dir.path().join(META_FILE), b"garbage!garbage!").unwrap();
        std::fs::remove_file(&path).unwrap();
        let e = LogStore::open(dir.path()).err().unwrap();
        assert!(e.contains("raft-meta"), "{e}");

        std::fs::write(dir.path().join(SNAPSHOT_FILE), b"\x05\0\0\0\0\0\0\0hello").unwrap();
        let e = StateMachine::open(dir.path()).err().unwrap();
        assert!(e.contains("snapshot"), "{e}");
    }

    #[tokio::test]
    async fn the_state_machine_restores_from_its_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let mut sm = StateMachine::open(dir.path()).unwrap();
        let init = Entry {
            log_id: log_id(1, 1),
            payload: EntryPayload::Normal(Command::Init {
                cluster_id: 7,
                initial_servers: 1,
                default_mode: None,
                default_replicas: None,
            }),
        };
        let applied = sm.apply(vec![init]).await.unwrap();
        assert_eq!(applied[0].map.cluster_id, 7);
        let mut builder = sm.get_snapshot_builder().await;
        let snapshot = builder.build_snapshot().await.unwrap();
        assert_eq!(snapshot.meta.last_log_id, Some(log_id(1, 1)));
        drop(sm);

        let mut again = StateMachine::open(dir.path()).unwrap();
        let (applied, _) = again.applied_state().await.unwrap();
        assert_eq!(applied, Some(log_id(1, 1)));
        assert!(again.shared().read().unwrap().state.initialized);
        let current = again.get_current_snapshot().await.unwrap().unwrap();
        assert_eq!(current.meta.snapshot_id, snapshot.meta.snapshot_id);
    }
}
