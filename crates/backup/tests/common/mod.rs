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
