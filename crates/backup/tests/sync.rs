//! When written data becomes durable under each sync policy, and the writer's preallocation of
//! segments ahead of placement.

mod common;
use common::*;
use ramlog_backup::testkit::crash_config;
use ramlog_backup::{Backup, Config, Entry, Stage, SyncPolicy};
use std::time::{Duration, Instant};

fn entry<'a>(key: &'a [u8], value: &'a [u8], version: u64) -> Entry<'a> {
    Entry {
        key,
        value: Some(value),
        version,
        expiry: 0,
    }
}

/// Polls `ticket` until it reaches `stage` or `limit` passes; returns whether it did.
fn reaches(b: &Backup, ticket: ramlog_backup::Ticket, stage: Stage, limit: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if b.poll(ticket).unwrap() >= stage {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// A store with `sync` and a flush interval of `interval_ms`, holding one appended entry.
fn one_entry(
    name: &str,
    sync: SyncPolicy,
    interval_ms: u64,
) -> (tempfile::TempDir, Backup, ramlog_backup::Ticket) {
    let dir = temp_dir(name);
    let cfg = Config {
        sync,
        flush_interval: Duration::from_millis(interval_ms),
        ..crash_config()
    };
    let b = Backup::open(dir.path(), cfg).unwrap();
    let t = b.append(1, &[entry(b"k", b"v", 1)]).unwrap();
    (dir, b, t)
}

/// Appends keys `key0..key{count}` with values of `value_len` bytes, one per batch, key `i` to
/// tablet `tablet_of(i)`; returns the last ticket.
fn append_keys(
    b: &Backup,
    count: u64,
    value_len: usize,
    tablet_of: impl Fn(u64) -> u64,
) -> ramlog_backup::Ticket {
    let value = vec![7u8; value_len];
    let mut last = ramlog_backup::Ticket(0);
    for i in 0..count {
        let key = format!("key{i}");
        last = b
            .append(tablet_of(i), &[entry(key.as_bytes(), &value, i + 1)])
            .unwrap();
    }
    last
}

/// Reopens the store in `dir` and checks that a clean replay yields `keys` live keys.
fn assert_replays(dir: &std::path::Path, keys: usize) {
    let b = Backup::open(dir, crash_config()).unwrap();
    let (state, report) = replay_state(&b);
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(state.len(), keys);
}

#[test]
fn periodic_policy_makes_an_idle_store_durable_without_a_wait() {
    let (_dir, b, t) = one_entry("periodic", SyncPolicy::Periodic, 50);
    // Nobody waits: the flusher writes the entry and the idle writer syncs it by itself.
    assert!(
        reaches(&b, t, Stage::Durable, Duration::from_secs(10)),
        "never became durable: {:?}",
        b.stats()
    );
    assert!(b.stats().syncs >= 1);
    b.close().unwrap();
}

#[test]
fn on_demand_policy_syncs_only_when_asked() {
    let (_dir, b, t) = one_entry("ondemand", SyncPolicy::OnDemand, 20);
    assert!(reaches(&b, t, Stage::Written, Duration::from_secs(10)));
    // Many flush intervals later it is still only written.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(b.poll(t).unwrap(), Stage::Written);
    let syncs = b.stats().syncs;
    b.wait(t, Stage::Durable).unwrap();
    assert_eq!(b.poll(t).unwrap(), Stage::Durable);
    assert!(b.stats().syncs > syncs);
    b.close().unwrap();
}

#[test]
fn back_to_back_flushes_share_syncs_and_a_wait_still_syncs() {
    let dir = temp_dir("shared");
    // Flushes go by size (16 KiB) long before the 20 s interval would sync.
    let cfg = Config {
        sync: SyncPolicy::Periodic,
        flush_interval: Duration::from_secs(20),
        flush_threshold_bytes: 16 << 10,
        ..crash_config()
    };
    let b = Backup::open(dir.path(), cfg).unwrap();
    let last = append_keys(&b, 4000, 500, |i| i % 4);
    b.wait(last, Stage::Written).unwrap();
    let s = b.stats();
    // Several flushes wrote, none synced: the oldest entry is far younger than half the interval.
    assert!(s.flushes >= 2, "expected size-driven flushes: {s:?}");
    assert_eq!(s.syncs, 0, "a flush synced early: {s:?}");
    assert_eq!(b.poll(last).unwrap(), Stage::Written);
    b.wait(last, Stage::Durable).unwrap();
    assert_eq!(b.poll(last).unwrap(), Stage::Durable);
    b.close().unwrap();
    assert_replays(dir.path(), 4000);
}

#[test]
fn writer_preallocates_segments_ahead_of_a_busy_tablet() {
    let dir = temp_dir("prealloc");
    let cfg = crash_config();
    let seg = cfg.segment_bytes;
    let b = Backup::open(dir.path(), cfg).unwrap();
    // One tablet, flushes of about 256 KiB: four segments each.
    let last = append_keys(&b, 1500, 1000, |_| 9);
    b.wait(last, Stage::Written).unwrap();
    let sec: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sec"))
        .collect();
    assert_eq!(sec.len(), 1, "{sec:?}");
    let bytes = std::fs::read(&sec[0]).unwrap();
    let last_data = bytes.iter().rposition(|&b| b != 0).unwrap() as u64;
    let data_segments = last_data / seg + 1;
    let file_segments = bytes.len() as u64 / seg;
    // The file reaches past the data by the empty segments the writer preallocated.
    assert!(
        file_segments >= data_segments + 2,
        "{file_segments} segments in the file, data in {data_segments}"
    );
    b.close().unwrap();
    assert_replays(dir.path(), 1500);
}

/// A sync round over many tablets' files uses one syncfs; over a few it fdatasyncs each file.
/// Either way everything acknowledged as durable replays after a reopen.
#[test]
fn many_dirty_tablets_sync_with_one_syncfs_and_few_with_fdatasync() {
    for (tablets, expect_syncfs) in [(40u64, true), (3, false)] {
        let dir = temp_dir("syncfs");
        // Without two-level logging every batch goes to its tablet's own log.
        let cfg = Config {
            sync: SyncPolicy::OnDemand,
            two_level: false,
            ..crash_config()
        };
        {
            let b = Backup::open(dir.path(), cfg.clone()).unwrap();
            let last = append_keys(&b, 400, 100, |i| i % tablets);
            b.wait(last, Stage::Durable).unwrap();
            let s = b.stats();
            assert!(s.syncs >= tablets, "every dirty log counts: {s:?}");
            assert_eq!(
                s.syncfs_calls > 0,
                expect_syncfs,
                "{tablets} tablets: {s:?}"
            );
            // No close: what Durable promised must already be on disk.
            std::mem::forget(b);
        }
        assert_replays(dir.path(), 400);
    }
}

/// The primary log is written through ahead of its offset only once durable writes are asked
/// for, and only until it wraps; the zeroing never touches a block the log still needs: with no
/// close (no checkpoint), every durable batch replays from the primary log after a reopen.
#[test]
fn durable_waits_write_the_primary_log_through_ahead_until_it_wraps() {
    let dir = temp_dir("prewrite");
    let cfg = Config {
        primary_log_bytes: 16 << 20,
        ..crash_config()
    };
    let size = cfg.primary_log_bytes;
    let b = Backup::open(dir.path(), cfg.clone()).unwrap();
    let value = vec![3u8; 200];
    let keys: Vec<Vec<u8>> = (0..20).map(|i| format!("key{i}").into_bytes()).collect();
    let batch = |version: u64, tablet: u64| {
        let es: Vec<Entry<'_>> = keys.iter().map(|k| entry(k, &value, version)).collect();
        b.append(tablet, &es).unwrap()
    };
    let t = batch(1, 1);
    b.wait(t, Stage::Written).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        b.stats().primary_prewritten_bytes,
        0,
        "written ahead without a durable wait"
    );
    b.wait(t, Stage::Durable).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.stats().primary_prewritten_bytes < 4 << 20 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let ahead = b.stats().primary_prewritten_bytes;
    assert!(ahead >= 4 << 20, "{ahead} bytes written ahead");
    // Small durable batches over 4 tablets, past a wrap of the primary log (about 4.5 KiB each).
    let mut version = 1;
    while b.stats().primary_bytes < size + (2 << 20) {
        version += 1;
        let t = batch(version, version % 4);
        b.wait(t, Stage::Durable).unwrap();
    }
    let s = b.stats();
    assert!(
        s.primary_prewritten_bytes <= size,
        "written ahead past the first lap: {s:?}"
    );
    std::mem::forget(b);
    let b = Backup::open(dir.path(), cfg).unwrap();
    let (state, report) = replay_state(&b);
    assert!(report.is_clean(), "{report:?}");
    for tablet in 0..4u64 {
        // The newest version each tablet was given: the largest v <= version with v % 4 == tablet.
        let newest = (2..=version).rev().find(|v| v % 4 == tablet).unwrap();
        for k in &keys {
            let (_, v, _) = state
                .get(&(tablet, k.clone()))
                .unwrap_or_else(|| panic!("tablet {tablet} lost {k:?}"));
            assert_eq!(*v, newest, "tablet {tablet} key {k:?}");
        }
    }
}

/// Appenders on several threads, each waiting for every batch to be durable: flushes that leave
/// their sync to the next one (a group commit across flushes) still answer only once synced, and
/// every acknowledged batch replays after a reopen without a close.
#[test]
fn concurrent_durable_waits_share_syncs_and_replay_without_a_close() {
    let dir = temp_dir("group-commit");
    let cfg = Config {
        sync: SyncPolicy::OnDemand,
        ..crash_config()
    };
    let b = Backup::open(dir.path(), cfg.clone()).unwrap();
    let value = vec![9u8; 100];
    const BATCHES: u64 = 300;
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (b, value) = (&b, &value);
            s.spawn(move || {
                let keys: Vec<Vec<u8>> =
                    (0..10).map(|i| format!("t{t}k{i}").into_bytes()).collect();
                for version in 1..=BATCHES {
                    let es: Vec<Entry<'_>> =
                        keys.iter().map(|k| entry(k, value, version)).collect();
                    let ticket = b.append(t, &es).unwrap();
                    b.wait(ticket, Stage::Durable).unwrap();
                    assert_eq!(b.poll(ticket).unwrap(), Stage::Durable);
                }
            });
        }
    });
    let s = b.stats();
    assert!(s.syncs >= 1 && s.syncs <= 4 * BATCHES, "{s:?}");
    std::mem::forget(b);
    let b = Backup::open(dir.path(), cfg).unwrap();
    let (state, report) = replay_state(&b);
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(state.len(), 40);
    assert!(
        state.values().all(|(_, v, _)| *v == BATCHES),
        "a batch acknowledged durable was lost"
    );
}
