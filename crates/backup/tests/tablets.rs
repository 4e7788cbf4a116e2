//! Opening tablet logs ahead of their first write, and producers that keep appending while the
//! writer is busy.

mod common;
use common::*;
use ramlog_backup::{Backup, Config, Entry};
use std::collections::BTreeMap;

#[test]
fn tablets_opened_ahead_exist_on_disk_take_writes_and_survive_a_reopen() {
    let dir = temp_dir("open-ahead");
    let files = |d: &std::path::Path| std::fs::read_dir(d).unwrap().count();
    {
        let b = Backup::open(dir.path(), Config::default()).unwrap();
        let before = files(dir.path());
        b.open_tablets([3, 5, 9]).unwrap();
        let mut ids = b.tablets();
        ids.sort_unstable();
        assert_eq!(ids, vec![3, 5, 9]);
        assert!(
            files(dir.path()) >= before + 3,
            "each opened tablet has its log file"
        );
        // Opening again is a no-op.
        b.open_tablets([5]).unwrap();
        assert_eq!(b.tablets().len(), 3);
        b.append(
            5,
            &[Entry {
                key: b"k",
                value: Some(b"v"),
                version: 1,
                expiry: 0,
            }],
        )
        .unwrap();
        b.close().unwrap();
    }
    let b = Backup::open(dir.path(), Config::default()).unwrap();
    let mut ids = b.tablets();
    ids.sort_unstable();
    assert_eq!(ids, vec![3, 5, 9]);
    let (state, _) = replay_state(&b);
    assert_eq!(state.len(), 1);
    assert_eq!(state[&(5, b"k".to_vec())], (b"v".to_vec(), 1, 0));
}

/// A write buffer of two small chunks, many times smaller than the data: every chunk is reused
/// many times, while earlier flushes are still being written. Everything replays intact.
#[test]
fn chunks_reused_while_flushes_are_written_lose_nothing() {
    let dir = temp_dir("chunk-reuse");
    let cfg = Config {
        write_buffer_bytes: 256 << 10,
        write_buffer_chunks: 2,
        flush_threshold_bytes: 64 << 10,
        value_max_bytes: 1024,
        ..Config::default()
    };
    let value = vec![0x42u8; 200];
    let mut keys = 0u64;
    {
        let b = Backup::open(dir.path(), cfg.clone()).unwrap();
        for round in 0..2_000u64 {
            let ks: Vec<[u8; 8]> = (0..10).map(|i| (round * 10 + i).to_be_bytes()).collect();
            let entries: Vec<Entry<'_>> = ks
                .iter()
                .enumerate()
                .map(|(i, k)| Entry {
                    key: k,
                    value: Some(&value),
                    version: round * 10 + i as u64 + 1,
                    expiry: 0,
                })
                .collect();
            b.append(round % 7, &entries).unwrap();
            keys += 10;
        }
        let flushes = b.stats().flushes;
        // 4.5 MB through a 256 KiB buffer: at least 17 flushes, all but the last counted by now.
        assert!(flushes >= 10, "the buffer was flushed {flushes} times");
        b.close().unwrap();
    }
    let b = Backup::open(dir.path(), cfg).unwrap();
    let (state, _) = replay_state(&b);
    assert_eq!(state.len() as u64, keys);
    for ((tablet, key), (v, version, _)) in &state {
        let id = u64::from_be_bytes(key[..].try_into().unwrap());
        assert_eq!(*tablet, (id / 10) % 7);
        assert_eq!(*version, id + 1);
        assert_eq!(v, &value);
    }
}

/// A tablet whose log continues in another (a new epoch): the merged replay yields the newest
/// version of each key over both, and a delete in the newer log hides the key's older data.
#[test]
fn merged_replay_takes_the_newest_version_over_tablets_deletes_included() {
    let dir = temp_dir("merged");
    let b = Backup::open(dir.path(), Config::default()).unwrap();
    let put = |key: &'static [u8], value: &'static [u8], version: u64| Entry {
        key,
        value: Some(value),
        version,
        expiry: 0,
    };
    b.append(
        1,
        &[
            put(b"a", b"a1", 1),
            put(b"b", b"b1", 2),
            put(b"c", b"c1", 3),
        ],
    )
    .unwrap();
    b.append(
        2,
        &[
            put(b"a", b"a2", 10),
            Entry {
                key: b"b",
                value: None,
                version: 11,
                expiry: 0,
            },
        ],
    )
    .unwrap();
    // Unrelated: another tablet's data is not yielded.
    b.append(3, &[put(b"z", b"z", 99)]).unwrap();
    let mut seen = Vec::new();
    let report = b
        .replay_merged(&[1, 2, 7], |e| {
            seen.push((e.tablet, e.key.to_vec(), e.value.to_vec(), e.version))
        })
        .unwrap();
    seen.sort();
    assert_eq!(
        seen,
        vec![
            (1, b"c".to_vec(), b"c1".to_vec(), 3),
            (2, b"a".to_vec(), b"a2".to_vec(), 10),
        ]
    );
    assert_eq!((report.live_keys, report.deleted_keys), (2, 1));
    assert_eq!(report.max_version, 11);
    // The same after the logs reach the disk.
    b.checkpoint().unwrap();
    let mut again = 0;
    b.replay_merged(&[2, 1], |_| again += 1).unwrap();
    assert_eq!(again, 2);
}

#[test]
fn a_filtered_merged_replay_yields_only_the_kept_keys_newest_first_deletes_included() {
    let dir = temp_dir("filtered");
    let b = Backup::open(dir.path(), Config::default()).unwrap();
    let put = |key: &'static [u8], value: &'static [u8], version: u64| Entry {
        key,
        value: Some(value),
        version,
        expiry: 0,
    };
    let del = |key: &'static [u8], version: u64| Entry {
        key,
        value: None,
        version,
        expiry: 0,
    };
    // Keys starting with "k" are kept; "o" keys belong to another part of the tablet.
    b.append(
        1,
        &[
            put(b"k1", b"old", 1),
            put(b"k2", b"k2", 2),
            put(b"k3", b"k3", 3),
            put(b"o1", b"o1", 4),
            put(b"o2", b"o2", 5),
        ],
    )
    .unwrap();
    b.append(2, &[put(b"k1", b"new", 10), del(b"k3", 11), del(b"o1", 12)])
        .unwrap();
    let keep = |key: &[u8]| key.starts_with(b"k");
    for round in 0..2 {
        let mut seen = Vec::new();
        let mut counted = None;
        let report = b
            .replay_merged_filtered(&[1, 2], Some(&keep), |r| match r {
                ramlog_backup::Replayed::Count(n) => counted = Some(n),
                ramlog_backup::Replayed::Entry(e) => {
                    seen.push((e.key.to_vec(), e.value.to_vec(), e.version))
                }
            })
            .unwrap();
        seen.sort();
        assert_eq!(
            seen,
            vec![
                (b"k1".to_vec(), b"new".to_vec(), 10),
                (b"k2".to_vec(), b"k2".to_vec(), 2),
            ],
            "round {round}"
        );
        // Only kept keys are merged: k1, k2, k3 (deleted).
        assert_eq!(counted, Some(3), "round {round}");
        assert_eq!(
            (report.live_keys, report.deleted_keys),
            (2, 1),
            "round {round}"
        );
        assert_eq!(report.lost_keys, 0, "round {round}");
        // Unfiltered, the other part is there too.
        let mut all = 0;
        b.replay_merged(&[1, 2], |_| all += 1).unwrap();
        assert_eq!(all, 3, "round {round}");
        // Again once the logs reach the disk (the version log then ranks the keys).
        b.checkpoint().unwrap();
    }
}

#[test]
fn a_grouped_replay_yields_each_group_as_its_own_filtered_replay_does() {
    let dir = temp_dir("grouped");
    let b = Backup::open(dir.path(), Config::default()).unwrap();
    // Three groups by the key's first byte ("a", "b", "c"); "z" keys belong to none.
    let group_of = |key: &[u8]| match key.first() {
        Some(b'a') => Some(0),
        Some(b'b') => Some(1),
        Some(b'c') => Some(2),
        _ => None,
    };
    let mut version = 0u64;
    // The highest version of a key some group takes (the others are not merged).
    let mut kept_max = 0u64;
    for round in 0..3u64 {
        let mut entries = Vec::new();
        for i in 0..2_000u64 {
            version += 1;
            let key = format!("{}{}", ["a", "b", "c", "z"][(i % 4) as usize], i % 700).into_bytes();
            if group_of(&key).is_some() {
                kept_max = version;
            }
            entries.push((key, format!("v{round}-{i}").into_bytes(), version));
        }
        let batch: Vec<Entry> = entries
            .iter()
            .enumerate()
            .map(|(i, (k, v, ver))| Entry {
                key: k,
                // Every 13th write of a round is a delete.
                value: (i % 13 != 0).then_some(v.as_slice()),
                version: *ver,
                expiry: 0,
            })
            .collect();
        b.append(1 + round % 2, &batch).unwrap();
    }
    for pass in 0..2 {
        let grouped = b.replay_grouped(&[1, 2], &group_of, 3).unwrap();
        assert_eq!(grouped.groups(), 3);
        let mut total = 0;
        for g in 0..3 {
            let keep = |key: &[u8]| group_of(key) == Some(g);
            let mut want = Vec::new();
            b.replay_merged_filtered(&[1, 2], Some(&keep), |r| {
                if let ramlog_backup::Replayed::Entry(e) = r {
                    want.push((e.key.to_vec(), e.value.to_vec(), e.version));
                }
            })
            .unwrap();
            let mut got = Vec::new();
            let n = grouped
                .take(g, &mut |e| {
                    got.push((e.key.to_vec(), e.value.to_vec(), e.version))
                })
                .unwrap();
            assert_eq!(n, got.len() as u64);
            assert_eq!(n, grouped.len(g));
            // A group is yielded once.
            assert!(grouped.take(g, &mut |_| {}).is_none());
            want.sort();
            got.sort();
            assert!(!want.is_empty(), "pass {pass} group {g}");
            assert_eq!(got, want, "pass {pass} group {g}");
            total += n;
        }
        let report = grouped.report();
        assert_eq!(report.live_keys, total);
        assert!(report.deleted_keys > 0);
        assert_eq!(report.max_version, kept_max);
        assert!(report.is_clean(), "{report:?}");
        // Again once the logs reach the disk (the version log then ranks the keys).
        b.checkpoint().unwrap();
    }
}

/// A streamed replay leaves in its taker (which keeps the newest version of each key it is
/// given, in whatever order) exactly what the merged replay yields: deletes hide older versions
/// in either tablet, a key written again in the other tablet comes back at its newest version,
/// and a filter keeps the same keys. Before and after the logs reach the disk.
#[test]
fn a_streamed_replay_leaves_in_its_taker_what_the_merged_replay_yields() {
    let dir = temp_dir("streamed");
    let b = Backup::open(dir.path(), Config::default()).unwrap();
    let mut version = 0u64;
    for round in 0..4u64 {
        let mut entries = Vec::new();
        for i in 0..3_000u64 {
            version += 1;
            let key = format!("{}{}", ["a", "b", "c", "z"][(i % 4) as usize], i % 900).into_bytes();
            entries.push((key, format!("v{round}-{i}").into_bytes(), version));
        }
        let batch: Vec<Entry> = entries
            .iter()
            .enumerate()
            .map(|(i, (k, v, ver))| Entry {
                key: k,
                // Every 11th write of a round is a delete; some keys carry an expiry.
                value: (i % 11 != (round as usize % 3)).then_some(v.as_slice()),
                version: *ver,
                expiry: if i % 7 == 0 {
                    4_000_000_000_000 + *ver
                } else {
                    0
                },
            })
            .collect();
        b.append(1 + round % 2, &batch).unwrap();
    }
    let keep_ab = |key: &[u8]| matches!(key.first(), Some(b'a' | b'b'));
    for pass in 0..2 {
        for keep in [None, Some(&keep_ab as ramlog_backup::KeyFilter<'_>)] {
            let mut want = BTreeMap::new();
            let merged = b
                .replay_merged_filtered(&[1, 2], keep, |r| {
                    if let ramlog_backup::Replayed::Entry(e) = r {
                        want.insert(e.key.to_vec(), (e.value.to_vec(), e.version, e.expiry));
                    }
                })
                .unwrap();
            let (model, streamed) = streamed_state(&b, &[1, 2], keep);
            assert!(streamed.trusted && !streamed.stopped, "pass {pass}");
            assert!(model.started.load(std::sync::atomic::Ordering::Relaxed));
            let got = model.keys.into_inner().unwrap();
            assert_eq!(got, want, "pass {pass}, filtered {}", keep.is_some());
            assert!(!want.is_empty());
            // The highest version over every record (a filtered merge ranks only kept keys).
            if keep.is_none() {
                assert_eq!(
                    streamed.report.max_version, merged.max_version,
                    "pass {pass}"
                );
            } else {
                assert!(
                    streamed.report.max_version >= merged.max_version,
                    "pass {pass}"
                );
            }
            // Every data entry kept and not hidden by a delete went to the taker.
            assert!(streamed.report.live_keys >= want.len() as u64);
        }
        b.checkpoint().unwrap();
    }
}
