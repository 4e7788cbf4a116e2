//! Damage injection: bit flips and truncations in log files are detected and reported, never
//! returned; a full disk makes appends fail with a clear error and damages nothing written.

mod common;
use common::*;
use ramlog_backup::testkit::{crash_config, OwnedEntry};
use ramlog_backup::{Backup, Config, Entry, Error, Stage};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Writes a workload with updates and deletes, closes, and returns the oracle of live keys.
fn fill(dir: &Path, cfg: &Config, seed: u64) -> State {
    let b = Backup::open(dir, cfg.clone()).unwrap();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut oracle: BTreeMap<Key, Option<(Vec<u8>, u64, u64)>> = BTreeMap::new();
    let mut version = 0;
    for _ in 0..2000 {
        let tablet = rng.gen_range(0..4u64);
        let mut batch = Vec::new();
        for _ in 0..rng.gen_range(1..20) {
            version += 1;
            let key = format!("key{}", rng.gen_range(0..600)).into_bytes();
            let value = if rng.gen_bool(0.1) {
                None
            } else {
                Some(vec![rng.gen::<u8>(); rng.gen_range(1..200)])
            };
            batch.push(OwnedEntry {
                key,
                value,
                version,
                expiry: 0,
            });
        }
        let entries: Vec<Entry<'_>> = batch.iter().map(|e| e.as_entry()).collect();
        b.append(tablet, &entries).unwrap();
        for e in batch {
            oracle.insert((tablet, e.key), e.value.map(|v| (v, e.version, 0)));
        }
    }
    b.close().unwrap();
    oracle
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v)))
        .collect()
}

fn files(dir: &Path, ext: &str) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    v.sort();
    v
}

/// Every key replay returns must be exactly the oracle's newest version; missing keys must be
/// accounted for by the report.
fn check_subset(state: &State, oracle: &State, report: &ramlog_backup::ReplayReport) -> usize {
    for (k, v) in state {
        assert_eq!(
            oracle.get(k),
            Some(v),
            "replay returned something not current for {k:?}"
        );
    }
    let missing = oracle.keys().filter(|k| !state.contains_key(*k)).count();
    assert!(
        missing as u64 <= report.lost_keys,
        "{missing} keys missing but only {} reported lost: {report:?}",
        report.lost_keys
    );
    missing
}

#[test]
fn bit_flips_in_secondary_logs_are_reported_never_returned() {
    let dir = temp_dir("flip");
    let cfg = crash_config();
    let oracle = fill(dir.path(), &cfg, 11);
    let flips = flip_secondary_bits(dir.path(), &cfg, 5, 6);
    assert!(flips > 0);
    let b = Backup::open(dir.path(), cfg).unwrap();
    let (state, report) = replay_state(&b);
    assert!(!report.is_clean(), "damage went unnoticed: {report:?}");
    assert!(
        report.corrupt_entries + report.unreadable_bytes > 0,
        "{report:?}"
    );
    let missing = check_subset(&state, &oracle, &report);
    assert!(
        missing < oracle.len() / 2,
        "too much lost to a few bit flips: {missing}"
    );
}

/// Flips `per_file` random bits in the data of every secondary log under `dir`; how many.
fn flip_secondary_bits(dir: &Path, cfg: &Config, seed: u64, per_file: usize) -> usize {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut flips = 0;
    for p in files(dir, "sec") {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        let len = f.metadata().unwrap().len();
        let segs = len / cfg.segment_bytes;
        for _ in 0..per_file {
            // Flip a bit inside the first 8 KiB of a random segment (where data is).
            let seg = rng.gen_range(0..segs.max(1));
            let at = seg * cfg.segment_bytes + rng.gen_range(64..8192);
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, at).unwrap();
            if b[0] == 0 {
                continue;
            }
            b[0] ^= 1 << rng.gen_range(0..8);
            f.write_all_at(&b, at).unwrap();
            flips += 1;
        }
    }
    flips
}

/// A streamed replay leaves the merge to its taker, which cannot tell an older version from a
/// lost newer one: over damaged logs it says it is not to be trusted, and over intact ones what
/// its taker keeps is exactly the current state.
#[test]
fn a_streamed_replay_of_damaged_logs_is_not_trusted() {
    let dir = temp_dir("flip-streamed");
    let cfg = crash_config();
    let oracle = fill(dir.path(), &cfg, 13);
    {
        let b = Backup::open(dir.path(), cfg.clone()).unwrap();
        for tablet in 0..4u64 {
            let (model, streamed) = streamed_state(&b, &[tablet], None);
            assert!(streamed.trusted, "tablet {tablet}: {:?}", streamed.report);
            let got: State = model
                .keys
                .into_inner()
                .unwrap()
                .into_iter()
                .map(|(k, v)| ((tablet, k), v))
                .collect();
            let want: State = oracle
                .iter()
                .filter(|(k, _)| k.0 == tablet)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            assert_eq!(got, want, "tablet {tablet}");
        }
        b.close().unwrap();
    }
    assert!(flip_secondary_bits(dir.path(), &cfg, 5, 6) > 0);
    let b = Backup::open(dir.path(), cfg).unwrap();
    let mut untrusted = 0;
    for tablet in 0..4u64 {
        let (_, streamed) = streamed_state(&b, &[tablet], None);
        if !streamed.trusted {
            assert!(!streamed.report.is_clean(), "{:?}", streamed.report);
            untrusted += 1;
        }
    }
    assert!(untrusted > 0, "damage went unnoticed");
}

#[test]
fn truncated_secondary_log_is_reported() {
    let dir = temp_dir("trunc");
    let cfg = crash_config();
    let oracle = fill(dir.path(), &cfg, 12);
    let sec = files(dir.path(), "sec");
    // Cut the largest log into its data, two segments and a bit before the end of the last
    // segment that holds any (the writer preallocates empty segments past it).
    let p = sec
        .iter()
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap();
    let bytes = std::fs::read(p).unwrap();
    let last = bytes.iter().rposition(|&b| b != 0).unwrap() as u64;
    let data_end = (last / cfg.segment_bytes + 1) * cfg.segment_bytes;
    assert!(data_end > cfg.segment_bytes * 2 + 5000);
    std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(data_end - cfg.segment_bytes * 2 - 5000)
        .unwrap();
    let b = Backup::open(dir.path(), cfg).unwrap();
    let (state, report) = replay_state(&b);
    let missing = check_subset(&state, &oracle, &report);
    assert!(
        missing > 0 && report.lost_keys > 0,
        "truncation not detected: {report:?}"
    );
}

#[test]
fn damaged_version_log_is_reported_and_torn_tail_cut() {
    let dir = temp_dir("verdmg");
    let cfg = crash_config();
    let oracle = fill(dir.path(), &cfg, 13);
    let ver = files(dir.path(), "ver");
    // A torn tail on one version log: cut silently at open, counted in the stats.
    let p = &ver[0];
    let len = std::fs::metadata(p).unwrap().len();
    {
        let f = std::fs::OpenOptions::new().append(true).open(p).unwrap();
        f.write_all_at(b"RLVLgarbage-torn-tail", len).unwrap();
    }
    // A bit flip inside another version log.
    let q = &ver[1];
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(q)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, 40).unwrap();
    b[0] ^= 0x10;
    f.write_all_at(&b, 40).unwrap();
    let backup = Backup::open(dir.path(), cfg).unwrap();
    let stats = backup.stats();
    assert!(stats.open_version_bytes_cut > 0, "{stats:?}");
    let (_state, report) = replay_state(&backup);
    // The flipped block is either skipped (something intact follows it: reported by replay) or, if
    // it was the last one, cut at open like a torn tail (reported in the stats).
    let garbage = b"RLVLgarbage-torn-tail".len() as u64;
    let at_open = stats.open_version_bytes_cut + stats.open_version_bytes_damaged;
    assert!(
        report.damaged_version_bytes > 0 || at_open > garbage,
        "version log damage not reported: {report:?} {stats:?}"
    );
    drop(oracle);
}

/// Flips one byte in the records of every version block that holds a delete record and whose
/// copy number is `copy` (0: the blocks, 1: their mirrors) in the version log at `path`. Returns
/// how many it flipped.
fn flip_version_copies(path: &Path, copy: u32) -> usize {
    let mut data = std::fs::read(path).unwrap();
    let mut at = 0;
    let mut flipped = 0;
    while at + ramlog_backup::format::VERSION_BLOCK_HEADER_BYTES <= data.len() {
        // Blocks are walked by their count field, so damaged ones are stepped over too.
        let count = u32::from_le_bytes(data[at + 8..at + 12].try_into().unwrap()) as usize;
        let records_len = count * ramlog_backup::format::VERSION_RECORD_BYTES;
        let len = ramlog_backup::format::VERSION_BLOCK_HEADER_BYTES + records_len;
        let this = u32::from_le_bytes(data[at + 12..at + 16].try_into().unwrap());
        let body = ramlog_backup::format::VERSION_BLOCK_HEADER_BYTES;
        let has_delete = (0..count)
            .any(|r| data[at + body + r * ramlog_backup::format::VERSION_RECORD_BYTES + 24] != 0);
        if this == copy && has_delete {
            data[at + ramlog_backup::format::VERSION_BLOCK_HEADER_BYTES + records_len / 2] ^= 0x20;
            flipped += 1;
        }
        at += len;
    }
    std::fs::write(path, data).unwrap();
    flipped
}

/// Puts 200 keys, deletes every even one, then puts 300 more keys (so the blocks with the deletes
/// are not at the end of the version log, where damage would look like a torn tail and the
/// primary log would restore them), and closes. Returns the store, its configuration and the live
/// keys in order.
fn puts_then_deletes(name: &str) -> (tempfile::TempDir, Config, Vec<Vec<u8>>) {
    let dir = temp_dir(name);
    let cfg = Config {
        reorg_enabled: false,
        ..crash_config()
    };
    let b = Backup::open(dir.path(), cfg.clone()).unwrap();
    let put = |key: &[u8], version: u64| {
        let value = vec![version as u8; 40];
        b.append(
            0,
            &[Entry {
                key,
                value: Some(&value),
                version,
                expiry: 0,
            }],
        )
        .unwrap();
    };
    let keys: Vec<Vec<u8>> = (0..200).map(|i| format!("k{i:03}").into_bytes()).collect();
    for (i, k) in keys.iter().enumerate() {
        put(k, i as u64 + 1);
    }
    b.checkpoint().unwrap();
    for (i, k) in keys.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
        b.append(
            0,
            &[Entry {
                key: k,
                value: None,
                version: 1000 + i as u64,
                expiry: 0,
            }],
        )
        .unwrap();
    }
    // A checkpoint spills the version buffer: the deletes get blocks of their own.
    b.checkpoint().unwrap();
    let later: Vec<Vec<u8>> = (0..300).map(|i| format!("z{i:03}").into_bytes()).collect();
    for (i, k) in later.iter().enumerate() {
        put(k, 2000 + i as u64);
    }
    b.close().unwrap();
    let kept = keys.into_iter().skip(1).step_by(2).chain(later).collect();
    (dir, cfg, kept)
}

#[test]
fn deletes_survive_a_damaged_version_block_through_its_mirror() {
    let (dir, cfg, kept) = puts_then_deletes("vermirror");
    let ver = files(dir.path(), "ver");
    assert_eq!(ver.len(), 1);
    assert!(
        flip_version_copies(&ver[0], 0) > 0,
        "no version block to damage"
    );
    let b = Backup::open(dir.path(), cfg.clone()).unwrap();
    let (state, report) = replay_state(&b);
    let live: Vec<Vec<u8>> = state.keys().map(|(_, k)| k.clone()).collect();
    assert_eq!(
        live, kept,
        "a deleted key came back or a live one is missing"
    );
    assert!(
        report.damaged_version_bytes > 0,
        "damage not reported: {report:?}"
    );
    assert!(report.recovered_version_blocks > 0, "{report:?}");
    drop(b);

    // Damaged mirrors alone lose nothing either.
    let (dir, cfg, kept) = puts_then_deletes("vermirror2");
    let ver = files(dir.path(), "ver");
    assert!(flip_version_copies(&ver[0], 1) > 0);
    let b = Backup::open(dir.path(), cfg).unwrap();
    let stats = b.stats();
    let (state, report) = replay_state(&b);
    let live: Vec<Vec<u8>> = state.keys().map(|(_, k)| k.clone()).collect();
    assert_eq!(live, kept);
    // A damaged mirror at the very end of the log looks like a torn tail: cut at open, counted
    // in the stats.
    assert!(
        report.damaged_version_bytes + stats.open_version_bytes_cut > 0,
        "damage not reported: {report:?} {stats:?}"
    );
}

#[test]
fn both_copies_of_a_version_block_damaged_is_reported() {
    let (dir, cfg, _kept) = puts_then_deletes("verboth");
    let ver = files(dir.path(), "ver");
    assert!(flip_version_copies(&ver[0], 0) > 0);
    assert!(flip_version_copies(&ver[0], 1) > 0);
    let b = Backup::open(dir.path(), cfg).unwrap();
    let stats = b.stats();
    let (_state, report) = replay_state(&b);
    assert!(
        report.damaged_version_bytes > 0
            || stats.open_version_bytes_damaged + stats.open_version_bytes_cut > 0,
        "damage not reported: {report:?} {stats:?}"
    );
    // Deletes may be lost with the block: a streamed replay, which applies only the deletes it
    // knows, hands nothing over and is not trusted (its caller then replays with the merge).
    if report.damaged_version_bytes > 0 {
        let tablets = b.tablets();
        let mut untrusted = 0;
        for t in tablets {
            let (model, streamed) = streamed_state(&b, &[t], None);
            if !streamed.trusted {
                untrusted += 1;
                assert!(!model.started.load(std::sync::atomic::Ordering::Relaxed));
                assert_eq!(model.taken.load(std::sync::atomic::Ordering::Relaxed), 0);
            }
        }
        assert!(untrusted > 0);
    }
}

#[test]
fn disk_full_fails_appends_and_keeps_written_data() {
    let base = temp_dir("diskfull");
    let mnt = base.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=12m", "tmpfs"])
        .arg(&mnt)
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    // The scenario needs a small file system that fills up; without one the test has not run,
    // so it fails rather than pass (CI and development machines run as root).
    assert!(
        ok,
        "cannot mount a 12 MiB tmpfs at {} (needs root): the disk-full scenario did not run",
        mnt.display()
    );
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _guard = Unmount(mnt.clone());
    let dir = mnt.join("store");
    std::fs::create_dir_all(&dir).unwrap();
    // Ballast, removed after the failure to give the reopen some room.
    std::fs::write(mnt.join("ballast"), vec![1u8; 1 << 20]).unwrap();
    let cfg = Config {
        tablet_log_capacity_bytes: 64 << 20,
        reorg_enabled: false,
        ..crash_config()
    };
    let b = Backup::open(&dir, cfg.clone()).unwrap();
    let mut acked: BTreeMap<(u64, Vec<u8>), (Vec<u8>, u64)> = BTreeMap::new();
    let mut maybe: BTreeMap<(u64, Vec<u8>), (Vec<u8>, u64)> = BTreeMap::new();
    let mut version = 0u64;
    let mut error = None;
    for n in 0..100_000u64 {
        let tablet = n % 8;
        let batch: Vec<OwnedEntry> = (0..16)
            .map(|i| {
                version += 1;
                OwnedEntry {
                    key: format!("k{n}-{i}").into_bytes(),
                    value: Some(vec![(n % 251) as u8; 1000]),
                    version,
                    expiry: 0,
                }
            })
            .collect();
        let entries: Vec<Entry<'_>> = batch.iter().map(|e| e.as_entry()).collect();
        let r = b
            .append(tablet, &entries)
            .and_then(|t| b.wait(t, Stage::Written));
        for e in &batch {
            maybe.insert(
                (tablet, e.key.clone()),
                (e.value.clone().unwrap(), e.version),
            );
        }
        match r {
            Ok(()) => {
                for e in &batch {
                    acked.insert(
                        (tablet, e.key.clone()),
                        (e.value.clone().unwrap(), e.version),
                    );
                }
            }
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    let error = error.expect("the disk never filled up");
    let msg = error.to_string();
    assert!(
        matches!(error, Error::Failed(_) | Error::DiskFull { .. }),
        "{error:?}"
    );
    assert!(msg.contains("disk full"), "unclear error: {msg}");
    // Further appends fail at once with the same clear error.
    let again = b
        .append(
            0,
            &[Entry {
                key: b"x",
                value: Some(b"y"),
                version: version + 1,
                expiry: 0,
            }],
        )
        .unwrap_err();
    assert!(again.to_string().contains("disk full"), "{again}");
    assert!(
        acked.len() > 1000,
        "too little written before the disk filled: {}",
        acked.len()
    );
    drop(b);
    std::fs::remove_file(mnt.join("ballast")).unwrap();
    let b = Backup::open(&dir, cfg).expect("reopen after freeing space");
    let (state, report) = replay_state(&b);
    assert!(report.is_clean(), "{report:?}");
    for (k, (v, ver)) in &acked {
        let got = state
            .get(k)
            .unwrap_or_else(|| panic!("acknowledged {k:?} lost after disk full"));
        assert_eq!((&got.0, got.1), (v, *ver));
    }
    for (k, got) in &state {
        let m = maybe.get(k).unwrap_or_else(|| panic!("invented {k:?}"));
        assert_eq!((&got.0, got.1), (&m.0, m.1));
    }
    drop(b);
}

#[test]
fn a_directory_in_the_earlier_entry_format_is_refused_by_name() {
    let dir = temp_dir("old-format");
    fill(dir.path(), &crash_config(), 9);
    // Give the manifest the first format's magic ("RLMF"), as a directory written before the
    // varint entry headers has it.
    let path = dir.path().join("MANIFEST");
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&ramlog_backup::format::MANIFEST_MAGIC_V1.to_le_bytes(), 0)
        .unwrap();
    drop(f);
    let err = match Backup::open(dir.path(), crash_config()) {
        Ok(_) => panic!("a directory in the earlier format opened"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("earlier ramlog"), "{err}");
    // Nothing was changed: the manifest still carries the old magic.
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(
        bytes[0..4],
        ramlog_backup::format::MANIFEST_MAGIC_V1.to_le_bytes()
    );
}

/// Every file under `dir` with its bytes, for checking that a refused open changed nothing.
fn directory_bytes(dir: &Path) -> BTreeMap<std::path::PathBuf, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect()
}

#[test]
fn a_corrupt_dropped_file_is_refused_by_name_and_changes_nothing() {
    let dir = temp_dir("dropped-corrupt");
    let cfg = crash_config();
    fill(dir.path(), &cfg, 21);
    {
        let b = Backup::open(dir.path(), cfg.clone()).unwrap();
        b.drop_tablet(2).unwrap();
        b.close().unwrap();
    }
    let path = dir.path().join("DROPPED");
    let good = std::fs::read(&path).unwrap();
    assert!(good.len() >= 20, "one dropped tablet is recorded");
    // A flipped bit, a torn length and an empty file are each refused.
    let mut flipped = good.clone();
    flipped[good.len() - 1] ^= 0x40;
    let torn = good[..good.len() - 3].to_vec();
    for (what, bytes) in [("flipped", flipped), ("torn", torn), ("empty", Vec::new())] {
        std::fs::write(&path, &bytes).unwrap();
        let before = directory_bytes(dir.path());
        let err = match Backup::open(dir.path(), cfg.clone()) {
            Ok(_) => panic!("a {what} DROPPED file was accepted"),
            Err(e) => e,
        };
        assert!(matches!(err, Error::Corrupt(_)), "{what}: {err:?}");
        assert!(err.to_string().contains("DROPPED"), "{what}: {err}");
        assert_eq!(
            directory_bytes(dir.path()),
            before,
            "{what}: a refused open changed the directory"
        );
    }
    // The intact file opens, and the dropped tablet stays dropped.
    std::fs::write(&path, &good).unwrap();
    let b = Backup::open(dir.path(), cfg).unwrap();
    let mut seen = 0;
    b.replay(2, |_| seen += 1).unwrap();
    assert_eq!(seen, 0, "a dropped tablet came back");
}
