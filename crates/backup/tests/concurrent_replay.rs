//! A replay taken while appends go on sees every entry appended before it began: in particular
//! the entries a concurrent flush is moving from a tablet's secondary-log buffer into a segment
//! whose block is placed but not yet written (a mirror or a migration's target builds its
//! memory this way while the master's stream keeps arriving).

mod common;
use common::*;
use ramlog_backup::{Backup, Config, Entry, Replayed, Stage};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn replay_during_appends_misses_nothing_appended_before_it() {
    let dir = temp_dir("concurrent-replay");
    // A small secondary-log buffer and frequent flushes: the buffer moves into segments often.
    let cfg = Config {
        secondary_buffer_bytes: 4 << 10,
        direct_threshold_bytes: 2 << 10,
        flush_threshold_bytes: 1 << 10,
        flush_interval: Duration::from_millis(1),
        ..Config::default()
    };
    let b = Arc::new(Backup::open(dir.path(), cfg).expect("open"));
    let appended = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    const TABLET: u64 = 7;
    let writer = {
        let (b, appended, stop) = (b.clone(), appended.clone(), stop.clone());
        std::thread::spawn(move || {
            let value = vec![b'v'; 90];
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let keys: Vec<Vec<u8>> = (n..n + 2).map(|i| format!("k{i}").into_bytes()).collect();
                let entries: Vec<Entry<'_>> = keys
                    .iter()
                    .enumerate()
                    .map(|(i, k)| Entry {
                        key: k,
                        value: Some(&value),
                        version: n + i as u64 + 1,
                        expiry: 0,
                    })
                    .collect();
                let t = b.append(TABLET, &entries).expect("append");
                n += 2;
                appended.store(n, Ordering::SeqCst);
                if n.is_multiple_of(64) {
                    b.wait(t, Stage::Written).expect("written");
                }
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut replays = 0u64;
    let mut worst: Option<(u64, u64)> = None;
    while Instant::now() < deadline {
        let before = appended.load(Ordering::SeqCst);
        let mut seen: HashSet<Vec<u8>> = HashSet::new();
        let report = b
            .replay_merged_filtered(&[TABLET], None, |r| {
                if let Replayed::Entry(e) = r {
                    seen.insert(e.key.to_vec());
                }
            })
            .expect("replay");
        replays += 1;
        let missing = (0..before)
            .filter(|i| !seen.contains(format!("k{i}").as_bytes()))
            .count() as u64;
        if missing > 0 && worst.is_none_or(|(m, _)| missing > m) {
            worst = Some((missing, before));
        }
        assert!(report.is_clean(), "replay {replays}: {report:?}");
    }
    stop.store(true, Ordering::SeqCst);
    writer.join().expect("writer");
    assert!(replays > 10, "only {replays} replays ran");
    assert!(
        worst.is_none(),
        "a replay missed {:?} (missing, appended before it) of {replays} replays",
        worst
    );
}
