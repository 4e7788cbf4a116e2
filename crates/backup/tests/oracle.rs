//! Replay against a BTreeMap oracle after random appends, updates and deletes across many tablets,
//! with reorganization forced to run often; then again after close and reopen.

mod common;
use common::*;
use ramlog_backup::testkit::{crash_config, OwnedEntry};
use ramlog_backup::{Backup, Config, Entry, SegmentStrategy, Stage};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;

/// Returns the store's stats at the end of the run (before the reopen).
fn run_oracle(cfg: Config, seed: u64, ops: usize) -> ramlog_backup::Stats {
    // Every segment the live counts call all dead is read and checked before it is freed.
    let cfg = Config {
        reorg_verify_dead: true,
        ..cfg
    };
    let dir = temp_dir("oracle");
    let mut oracle: BTreeMap<Key, Option<(Vec<u8>, u64, u64)>> = BTreeMap::new();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut version = 0u64;
    let tablets = 16u64;
    let b = Backup::open(dir.path(), cfg.clone()).expect("open");
    let mut done = 0usize;
    let mut checks = 0;
    while done < ops {
        let tablet = rng.gen_range(0..tablets);
        let n = rng.gen_range(1..40);
        let mut batch = Vec::new();
        for _ in 0..n {
            version += 1;
            let key = format!("k{}", rng.gen_range(0..300)).into_bytes();
            let value = if rng.gen_bool(0.15) {
                None
            } else {
                let len = rng.gen_range(0..400);
                Some((0..len).map(|_| rng.gen::<u8>()).collect::<Vec<u8>>())
            };
            batch.push(OwnedEntry {
                key,
                value,
                version,
                expiry: version * 3,
            });
        }
        let entries: Vec<Entry<'_>> = batch.iter().map(|e| e.as_entry()).collect();
        let t = b.append(tablet, &entries).expect("append");
        for e in &batch {
            oracle.insert(
                (tablet, e.key.clone()),
                e.value.clone().map(|v| (v, e.version, e.expiry)),
            );
        }
        done += n;
        if rng.gen_bool(0.05) {
            b.wait(t, Stage::Written).expect("wait");
        }
        if rng.gen_bool(0.02) {
            b.reorganize(rng.gen_range(0..tablets)).expect("reorganize");
        }
        if rng.gen_bool(0.01) || done >= ops {
            checks += 1;
            let (state, report) = replay_state(&b);
            assert!(report.is_clean(), "{report:?}");
            let expected: State = oracle
                .iter()
                .filter_map(|(k, v)| v.clone().map(|v| (k.clone(), v)))
                .collect();
            assert_eq!(state.len(), expected.len());
            assert!(
                state == expected,
                "replay differs from the oracle after {done} ops"
            );
        }
    }
    assert!(checks > 0);
    let stats = b.stats();
    assert!(
        stats.reorg_segments_cleaned > 0,
        "reorganization never ran: {stats:?}"
    );
    assert!(
        stats.primary_writes > 0,
        "two-level logging never used the primary log: {stats:?}"
    );
    assert_live_counts_held(&stats);
    b.close().expect("close");
    let b = Backup::open(dir.path(), cfg).expect("reopen");
    let (state, report) = replay_state(&b);
    assert!(report.is_clean(), "{report:?}");
    let expected: State = oracle
        .iter()
        .filter_map(|(k, v)| v.clone().map(|v| (k.clone(), v)))
        .collect();
    assert!(
        state == expected,
        "replay differs from the oracle after reopen"
    );
    assert!(report.max_version >= version - 40);
    stats
}

#[test]
fn oracle_age_times_utilisation() {
    run_oracle(crash_config(), 1, 60_000);
}

/// Four reorganizer threads on 16 tablets: rounds on different tablets overlap, and replay still
/// matches the oracle. With one thread, no two rounds ever overlap.
#[test]
fn oracle_with_parallel_reorganizers() {
    let stats = run_oracle(
        Config {
            reorg_threads: 4,
            ..crash_config()
        },
        4,
        40_000,
    );
    assert!(
        stats.reorg_overlapping_rounds > 0,
        "reorganization rounds never overlapped: {stats:?}"
    );
    let stats = run_oracle(
        Config {
            reorg_threads: 1,
            ..crash_config()
        },
        5,
        20_000,
    );
    assert_eq!(stats.reorg_overlapping_rounds, 0, "{stats:?}");
}

#[test]
fn oracle_cost_benefit_and_random() {
    run_oracle(
        Config {
            reorg_strategy: SegmentStrategy::CostBenefit,
            ..crash_config()
        },
        2,
        25_000,
    );
    run_oracle(
        Config {
            reorg_strategy: SegmentStrategy::Random,
            ..crash_config()
        },
        3,
        25_000,
    );
}

/// With cost-benefit selection the reorganizer learns where every entry was placed and counts
/// the bytes that an overwrite or a delete makes dead, per segment: the estimate matches the
/// exact figure here because no reorganization runs (thresholds at 100%).
#[test]
fn dead_bytes_are_estimated_from_placements() {
    let dir = temp_dir("dead");
    let cfg = Config {
        reorg_strategy: SegmentStrategy::CostBenefit,
        reorg_activation: 1.0,
        reorg_prompt: 1.0,
        reorg_throttle: 1.0,
        secondary_buffer_bytes: 4 << 10,
        direct_threshold_bytes: 4 << 10,
        ..crash_config()
    };
    let b = Backup::open(dir.path(), cfg).expect("open");
    let value = [7u8; 100];
    let key = |i: u32| format!("key{i:05}").into_bytes();
    let mut version = 0u64;
    let mut write = |ids: std::ops::Range<u32>, delete: bool| {
        let keys: Vec<Vec<u8>> = ids.map(key).collect();
        for chunk in keys.chunks(100) {
            let entries: Vec<Entry<'_>> = chunk
                .iter()
                .map(|k| {
                    version += 1;
                    Entry {
                        key: k,
                        value: (!delete).then_some(&value[..]),
                        version,
                        expiry: 0,
                    }
                })
                .collect();
            b.append(0, &entries).expect("append");
        }
        b.flush().expect("flush");
    };
    write(0..1000, false);
    write(0..400, false); // 400 overwrites
    write(900..1000, true); // 100 deletes
                            // The superseded entries: keys 0..400 (versions 1..=400) and the deleted keys 900..1000
                            // (versions 901..=1000), each as long as its own header makes it.
    let want: u64 = (1..=400u64)
        .chain(901..=1000)
        .map(|v| ramlog_backup::format::entry_bytes(8, 100, v, 0) as u64)
        .sum();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut seen = 0;
    while std::time::Instant::now() < deadline {
        seen = b.stats().dead_bytes_estimate;
        if seen == want {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(seen, want, "estimated dead bytes");
    assert_eq!(b.stats().notes_dropped, 0);
}

#[test]
fn oracle_without_two_level_logging() {
    run_oracle(
        Config {
            two_level: false,
            ..crash_config()
        },
        4,
        20_000,
    );
}

#[test]
fn drop_tablet_forgets_it_across_reopen() {
    let dir = temp_dir("drop");
    let cfg = crash_config();
    let b = Backup::open(dir.path(), cfg.clone()).unwrap();
    for t in 0..3u64 {
        b.append(
            t,
            &[Entry {
                key: b"a",
                value: Some(b"1"),
                version: 1,
                expiry: 0,
            }],
        )
        .unwrap();
    }
    b.flush().unwrap();
    b.drop_tablet(1).unwrap();
    assert_eq!(b.tablets(), vec![0, 2]);
    drop(b);
    let b = Backup::open(dir.path(), cfg).unwrap();
    let (state, _) = replay_state(&b);
    let tablets: Vec<u64> = state.keys().map(|k| k.0).collect();
    assert_eq!(tablets, vec![0, 2]);
}

type Oracle = BTreeMap<Key, Option<(Vec<u8>, u64, u64)>>;

/// Appends `batch` to `tablet` and records it in the oracle.
fn append_recorded(b: &Backup, tablet: u64, batch: &[OwnedEntry], oracle: &mut Oracle) {
    let entries: Vec<Entry<'_>> = batch.iter().map(|e| e.as_entry()).collect();
    b.append(tablet, &entries).expect("append");
    for e in batch {
        oracle.insert(
            (tablet, e.key.clone()),
            e.value.clone().map(|v| (v, e.version, e.expiry)),
        );
    }
}

/// No segment counted all dead held a current entry, and no note contradicted a count.
fn assert_live_counts_held(stats: &ramlog_backup::Stats) {
    assert_eq!(stats.reorg_dead_verify_failures, 0, "{stats:?}");
    assert_eq!(stats.reorg_live_mismatches, 0, "{stats:?}");
}

/// The live keys the oracle expects replay to return.
fn expected_state(oracle: &Oracle) -> State {
    oracle
        .iter()
        .filter_map(|(k, v)| v.clone().map(|v| (k.clone(), v)))
        .collect()
}

/// Sequential overwrites (with deletes and re-creates) leave whole segments superseded: the
/// reorganizer frees them from their live counts, without reading them. With the cross-check on,
/// every such segment is read first and must hold no current entry; with it off (as in
/// production), replay must still match the oracle exactly, before and after a reopen.
#[test]
fn segments_known_all_dead_are_freed_unread() {
    for verify in [true, false] {
        let dir = temp_dir("unread");
        let cfg = Config {
            reorg_verify_dead: verify,
            ..crash_config()
        };
        let b = Backup::open(dir.path(), cfg.clone()).expect("open");
        let mut oracle: Oracle = BTreeMap::new();
        let mut version = 0u64;
        for round in 0..40u64 {
            for first in (0..1000u32).step_by(50) {
                let batch: Vec<OwnedEntry> = (first..first + 50)
                    .map(|i| {
                        version += 1;
                        let key = format!("seq{i:04}").into_bytes();
                        // Every fifth round deletes a tenth of the keys; the next re-creates them.
                        let delete = round % 5 == 4 && i % 10 == 3;
                        OwnedEntry {
                            value: (!delete)
                                .then(|| ramlog_backup::testkit::value_for(&key, version)),
                            key,
                            version,
                            expiry: 0,
                        }
                    })
                    .collect();
                append_recorded(&b, 7, &batch, &mut oracle);
            }
            if round % 8 == 7 {
                b.reorganize(7).expect("reorganize");
            }
        }
        b.flush().expect("flush");
        let expected = expected_state(&oracle);
        let (state, report) = replay_state(&b);
        assert!(report.is_clean(), "{report:?}");
        assert!(
            state == expected,
            "replay differs from the oracle (verify {verify})"
        );
        let stats = b.stats();
        assert!(
            stats.reorg_segments_unread > 0,
            "no segment was freed unread: {stats:?}"
        );
        assert_live_counts_held(&stats);
        b.close().expect("close");
        let b = Backup::open(dir.path(), cfg).expect("reopen");
        let (state, report) = replay_state(&b);
        assert!(report.is_clean(), "{report:?}");
        assert!(
            state == expected,
            "replay differs after reopen (verify {verify})"
        );
    }
}

/// Noting placements costs a table update per entry, so a log whose segments never die whole
/// stops noting, and starts again once the reorganizer reads segments that did. Replay matches
/// the oracle throughout.
#[test]
fn logs_note_placements_only_while_segments_die_whole() {
    let dir = temp_dir("noting");
    let cfg = Config {
        reorg_verify_dead: true,
        ..crash_config()
    };
    let b = Backup::open(dir.path(), cfg).expect("open");
    let mut oracle: Oracle = BTreeMap::new();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
    let mut version = 0u64;
    let mut cold = 0u32;
    let mut append = |keys: Vec<Vec<u8>>, oracle: &mut Oracle| {
        let batch: Vec<OwnedEntry> = keys
            .into_iter()
            .map(|key| {
                version += 1;
                OwnedEntry {
                    value: Some(ramlog_backup::testkit::value_for(&key, version)),
                    key,
                    version,
                    expiry: 0,
                }
            })
            .collect();
        append_recorded(&b, 3, &batch, oracle);
    };
    let noting = |b: &Backup| b.stats().logs_noting;
    // Phase A: random updates of 200 hot keys, each batch with one key written once and never
    // again, so every segment keeps a current entry.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while noting(&b) > 0 && std::time::Instant::now() < deadline {
        for _ in 0..50 {
            let mut keys: Vec<Vec<u8>> = (0..20)
                .map(|_| format!("hot{:03}", rng.gen_range(0..200)).into_bytes())
                .collect();
            cold += 1;
            keys.push(format!("cold{cold:06}").into_bytes());
            append(keys, &mut oracle);
        }
        b.flush().expect("flush");
        b.reorganize(3).expect("reorganize");
    }
    let stats = b.stats();
    assert_eq!(stats.logs_noting, 0, "noting never stopped: {stats:?}");
    // Phase B: the hot keys rewritten in order: whole segments die.
    let unread_before = stats.reorg_segments_unread;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while (noting(&b) == 0 || b.stats().reorg_segments_unread == unread_before)
        && std::time::Instant::now() < deadline
    {
        for first in (0..200u32).step_by(20) {
            append(
                (first..first + 20)
                    .map(|i| format!("hot{i:03}").into_bytes())
                    .collect(),
                &mut oracle,
            );
        }
        b.flush().expect("flush");
        b.reorganize(3).expect("reorganize");
    }
    let stats = b.stats();
    assert_eq!(stats.logs_noting, 1, "noting never resumed: {stats:?}");
    assert!(stats.reorg_segments_unread > unread_before, "{stats:?}");
    assert_live_counts_held(&stats);
    let (state, report) = replay_state(&b);
    assert!(report.is_clean(), "{report:?}");
    assert!(
        state == expected_state(&oracle),
        "replay differs from the oracle"
    );
}
