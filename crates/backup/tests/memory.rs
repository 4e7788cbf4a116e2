//! Memory of the backup store: every part is counted (`Backup::memory`), stays within its
//! bound while keys are logged, and what grows with the keys is released once the store is at
//! rest, without losing an acknowledged write or bringing a deleted key back.

mod common;
use common::*;
use ramlog_backup::{Backup, Config, Entry, MemoryUsage, Stage};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn key(i: u64) -> Vec<u8> {
    format!("key-{i:09}").into_bytes()
}

fn value(i: u64, version: u64) -> Vec<u8> {
    let mut v = format!("{i}:{version}:").into_bytes();
    v.resize(100, b'v');
    v
}

/// Logs `keys` keys over `tablets` tablets at `version`, every `delete_every`-th as a delete
/// (0: none), in batches of 64; returns the expected state. Waits until all is durable.
fn log_keys(
    b: &Backup,
    tablets: u64,
    keys: u64,
    version: u64,
    delete_every: u64,
    expect: &mut BTreeMap<(u64, Vec<u8>), Vec<u8>>,
    mut each_batch: impl FnMut(&Backup),
) {
    let mut last = None;
    for start in (0..keys).step_by(64) {
        let tablet = (start / 64) % tablets;
        let owned: Vec<(Vec<u8>, Option<Vec<u8>>)> = (start..(start + 64).min(keys))
            .map(|i| {
                let del = delete_every > 0 && i % delete_every == 0;
                (key(i), (!del).then(|| value(i, version)))
            })
            .collect();
        let entries: Vec<Entry<'_>> = owned
            .iter()
            .map(|(k, v)| Entry {
                key: k,
                value: v.as_deref(),
                version,
                expiry: 0,
            })
            .collect();
        last = Some(b.append(tablet, &entries).expect("append"));
        for (k, v) in owned {
            match v {
                Some(v) => expect.insert((tablet, k), v),
                None => expect.remove(&(tablet, k)),
            };
        }
        each_batch(b);
    }
    if let Some(t) = last {
        b.wait(t, Stage::Durable).expect("durable");
    }
}

fn assert_replays(b: &Backup, expect: &BTreeMap<(u64, Vec<u8>), Vec<u8>>) {
    let (state, report) = replay_state(b);
    assert_eq!(report.lost_keys, 0, "{report:?}");
    assert_eq!(state.len(), expect.len(), "live keys after replay");
    for ((tablet, k), v) in expect {
        let got = state
            .get(&(*tablet, k.clone()))
            .unwrap_or_else(|| panic!("key {k:?} of tablet {tablet} missing"));
        assert_eq!(&got.0, v, "value of {k:?}");
    }
}

fn wait_for_rest(b: &Backup, rests: u64) -> MemoryUsage {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = b.memory();
        let at_rest = b.stats().rests >= rests
            && m.version_caches == 0
            && m.notes == 0
            && m.reorg_buffers == 0;
        if at_rest {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "the store did not come to rest: {m:?} {:?}",
            b.stats()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn budget_config(budget: u64) -> Config {
    Config {
        idle_after: Duration::from_millis(300),
        ..Config::for_memory_budget(budget)
    }
}

#[test]
fn what_grows_with_the_keys_is_released_at_rest() {
    let dir = temp_dir("mem-rest");
    let cfg = budget_config(256 * MIB);
    let b = Backup::open(dir.path(), cfg.clone()).expect("open");
    b.open_tablets(0..16).expect("tablets");
    let before = wait_for_rest(&b, 1);
    let mut expect = BTreeMap::new();
    log_keys(&b, 16, 60_000, 1, 0, &mut expect, |_| {});
    // Overwrite a third and delete some, so that reorganization has work and deletes to honour.
    log_keys(&b, 16, 20_000, 2, 7, &mut expect, |_| {});
    let busy = b.memory();
    assert!(
        busy.version_buffers + busy.version_caches + busy.notes + busy.secondary_buffers > 0,
        "logging keys held nothing per key: {busy:?}"
    );
    let rests = b.stats().rests;
    let m = wait_for_rest(&b, rests + 1);
    assert_eq!(m.version_buffers, 0, "{m:?}");
    assert!(
        m.secondary_buffers <= cfg.secondary_buffers_max_bytes as u64,
        "{m:?}"
    );
    assert_eq!(m.version_caches, 0, "{m:?}");
    assert_eq!(m.notes, 0, "{m:?}");
    assert_eq!(m.reorg_buffers, 0, "{m:?}");
    assert!(m.flush_arenas <= cfg.pool_warm_bytes as u64, "{m:?}");
    // Only segment metadata and the secondary-log buffers (bounded) grew.
    assert!(
        m.total() <= before.total() + 64 * 1024 + m.secondary_buffers,
        "at rest after logging: {m:?}, before: {before:?}"
    );
    assert_replays(&b, &expect);
    b.close().expect("close");
    let b = Backup::open(dir.path(), cfg).expect("reopen");
    assert_replays(&b, &expect);
}

#[test]
fn version_buffers_stay_within_their_store_wide_bound() {
    let dir = temp_dir("mem-vbuf");
    let bound = 256 << 10;
    let cfg = Config {
        version_buffers_max_bytes: bound,
        idle_after: Duration::from_secs(600),
        ..Config::for_memory_budget(256 * MIB)
    };
    let b = Backup::open(dir.path(), cfg).expect("open");
    let mut expect = BTreeMap::new();
    let mut worst = 0u64;
    log_keys(&b, 32, 40_000, 1, 0, &mut expect, |b| {
        worst = worst.max(b.memory().version_buffers);
    });
    log_keys(&b, 32, 40_000, 2, 5, &mut expect, |b| {
        worst = worst.max(b.memory().version_buffers);
    });
    let s = b.stats();
    assert!(s.version_spills_over_bound > 0, "{s:?}");
    // Between two flushes the buffers gain at most one flush's records (and a vector may
    // double): the bound holds up to that.
    let flush_records = (b.config().write_buffer_bytes / 100 * 32) as u64;
    assert!(
        worst <= bound as u64 + 2 * flush_records,
        "version buffers held {worst} bytes, bound {bound}"
    );
    assert_replays(&b, &expect);
}

#[test]
fn version_tables_stay_within_their_bound_and_deleted_keys_stay_deleted() {
    let dir = temp_dir("mem-cache");
    let bound = 64 << 10;
    let cfg = Config {
        version_caches_max_bytes: bound,
        segment_bytes: 64 << 10,
        secondary_buffer_bytes: 16 << 10,
        direct_threshold_bytes: 16 << 10,
        tablet_log_capacity_bytes: 8 << 20,
        idle_after: Duration::from_secs(600),
        ..Config::for_memory_budget(256 * MIB)
    };
    let b = Backup::open(dir.path(), cfg).expect("open");
    let mut expect = BTreeMap::new();
    for round in 1..=3 {
        log_keys(&b, 8, 12_000, round, 3 + round, &mut expect, |_| {});
        for t in 0..8 {
            b.reorganize(t).expect("reorganize");
            let m = b.memory();
            assert!(m.version_caches <= bound as u64, "round {round}: {m:?}");
        }
    }
    let s = b.stats();
    assert!(s.version_caches_dropped > 0, "{s:?}");
    assert!(s.reorg_segments_cleaned > 0, "{s:?}");
    assert_replays(&b, &expect);
}

#[test]
fn notes_stay_within_their_store_wide_bound() {
    let dir = temp_dir("mem-notes");
    let bound = 64 << 10;
    let cfg = Config {
        notes_max_bytes: bound,
        idle_after: Duration::from_secs(600),
        ..Config::for_memory_budget(256 * MIB)
    };
    let b = Backup::open(dir.path(), cfg).expect("open");
    let mut expect = BTreeMap::new();
    let mut worst = 0u64;
    log_keys(&b, 8, 40_000, 1, 0, &mut expect, |b| {
        worst = worst.max(b.memory().notes);
    });
    // Waiting notes are bounded; each tablet may keep up to a 64th of the bound of capacity
    // besides, and a vector may double.
    assert!(
        worst <= 2 * bound as u64 + 8 * 2 * (bound as u64 / 64),
        "notes held {worst}"
    );
    let s = b.stats();
    assert!(s.notes_dropped > 0, "the bound was never reached: {s:?}");
    assert_replays(&b, &expect);
}

#[test]
fn budgets_size_the_fixed_buffers_as_a_small_share() {
    let default = Config::default();
    for budget in [64 * MIB, 256 * MIB, 1 << 30] {
        let c = Config::for_memory_budget(budget);
        c.validate().expect("valid");
        let fixed = (c.write_buffer_bytes
            + c.pool_bytes
            + c.secondary_buffers_max_bytes
            + c.version_buffers_max_bytes
            + c.notes_max_bytes
            + c.version_caches_max_bytes) as u64;
        // Each part at most the default's.
        assert!(c.write_buffer_bytes <= default.write_buffer_bytes);
        assert!(c.pool_bytes <= default.pool_bytes);
        assert!(c.pool_warm_bytes <= default.pool_warm_bytes);
        assert!(c.version_caches_max_bytes <= default.version_caches_max_bytes);
        assert!(c.reorg_threads * c.reorg_segment_buffers <= default.reorg_threads * 4);
        assert_eq!(c.segment_bytes, default.segment_bytes);
        assert_eq!(c.primary_log_bytes, default.primary_log_bytes);
        if budget >= 256 * MIB {
            assert!(fixed * 100 <= budget * 8, "{budget}: {fixed} bytes fixed");
        } else {
            assert!(fixed * 100 <= budget * 12, "{budget}: {fixed} bytes fixed");
        }
    }
}

#[test]
fn the_smallest_budget_takes_the_largest_value() {
    let dir = temp_dir("mem-small");
    let cfg = Config::for_memory_budget(64 * MIB);
    let b = Backup::open(dir.path(), cfg.clone()).expect("open");
    let big = vec![7u8; cfg.value_max_bytes];
    let t = b
        .append(
            1,
            &[Entry {
                key: b"big",
                value: Some(&big),
                version: 1,
                expiry: 0,
            }],
        )
        .expect("append a value of value_max_bytes");
    b.wait(t, Stage::Durable).expect("durable");
    let mut seen = 0;
    b.replay(1, |e| {
        assert_eq!(e.value, &big[..]);
        seen += 1;
    })
    .expect("replay");
    assert_eq!(seen, 1);
}
