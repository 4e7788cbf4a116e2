#![allow(dead_code)]
use ramlog_backup::{Backup, ReplayReport};
use std::collections::BTreeMap;
use std::path::Path;

/// A temporary directory on the target directory's disk (O_DIRECT capable, unlike tmpfs).
pub fn temp_dir(name: &str) -> tempfile::TempDir {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(base).expect("create target tmp dir");
    tempfile::Builder::new()
        .prefix(name)
        .tempdir_in(base)
        .expect("temp dir")
}

pub type Key = (u64, Vec<u8>);
/// (value, version, expiry) of each live key.
pub type State = BTreeMap<Key, (Vec<u8>, u64, u64)>;

pub fn replay_state(b: &Backup) -> (State, ReplayReport) {
    let mut out = State::new();
    let report = b
        .replay_all(|e| {
            let prev = out.insert(
                (e.tablet, e.key.to_vec()),
                (e.value.to_vec(), e.version, e.expiry),
            );
            assert!(prev.is_none(), "replay yielded a key twice");
        })
        .expect("replay");
    (out, report)
}

/// (value, version, expiry) of each key of one tablet.
pub type KeyState = BTreeMap<Vec<u8>, (Vec<u8>, u64, u64)>;

/// A taker of a streamed replay that keeps the newest version of each key, as an engine tablet
/// does: (value, version, expiry) by key. Counts the batches it took and whether it was started.
#[derive(Default)]
pub struct NewestModel {
    pub keys: std::sync::Mutex<KeyState>,
    pub started: std::sync::atomic::AtomicBool,
    pub taken: std::sync::atomic::AtomicU64,
}

impl ramlog_backup::ReplaySink for NewestModel {
    fn start(&self, _expected: u64) {
        self.started
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
    fn take(&self, batch: &[ramlog_backup::ReplayEntry<'_>]) -> bool {
        let mut keys = self.keys.lock().unwrap();
        for e in batch {
            let newer = keys.get(e.key).is_none_or(|c| c.1 < e.version);
            if newer {
                keys.insert(e.key.to_vec(), (e.value.to_vec(), e.version, e.expiry));
            }
        }
        self.taken
            .fetch_add(batch.len() as u64, std::sync::atomic::Ordering::Relaxed);
        true
    }
}

/// The streamed replay of `tablets` (keys `keep` keeps) into a [`NewestModel`].
pub fn streamed_state(
    b: &Backup,
    tablets: &[u64],
    keep: Option<ramlog_backup::KeyFilter<'_>>,
) -> (NewestModel, ramlog_backup::Streamed) {
    let model = NewestModel::default();
    let streamed = b.replay_streamed(tablets, keep, &model).expect("replay");
    (model, streamed)
}
