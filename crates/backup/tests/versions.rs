//! When the reorganizer rewrites a tablet's version log compactly: at twice its compacted size when
//! no log needs cleaning, at four times while some log is above the activation threshold.

mod common;
use common::*;
use ramlog_backup::testkit::crash_config;
use ramlog_backup::{Backup, Entry, Stage};
use std::time::{Duration, Instant};

/// Bytes of one version record (format.md "Version log block").
const RECORD: u64 = 25;
const KEYS: u64 = 4000;

fn version_log_len(dir: &std::path::Path) -> u64 {
    std::fs::metadata(dir.join("t0000000000000000.ver"))
        .expect("version log of tablet 0")
        .len()
}

/// Writes keys `key0..key{keys}` to `tablet`, `rounds` times over (one version per round, versions
/// after `version`), and waits until it is all durable; returns the last version written.
fn write_rounds(b: &Backup, tablet: u64, keys: u64, rounds: u64, mut version: u64) -> u64 {
    let value = vec![9u8; 60];
    let mut last = None;
    for _ in 0..rounds {
        for k in 0..keys {
            version += 1;
            let key = format!("key{k:06}");
            let entry = Entry {
                key: key.as_bytes(),
                value: Some(&value),
                version,
                expiry: 0,
            };
            last = Some(b.append(tablet, &[entry]).unwrap());
        }
    }
    b.wait(last.unwrap(), Stage::Durable).unwrap();
    version
}

/// `write_rounds` of the `KEYS` keys to tablet 0.
fn update_all(b: &Backup, rounds: u64, version: u64) -> u64 {
    write_rounds(b, 0, KEYS, rounds, version)
}

/// Waits (at most 30 s) until tablet 0's version log is at most `bound` bytes.
fn wait_for_version_log_at_most(b: &Backup, dir: &std::path::Path, bound: u64) {
    let t0 = Instant::now();
    while version_log_len(dir) > bound {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "version log never compacted: {} bytes, utilisation {:.3}, {:?}",
            version_log_len(dir),
            b.utilisation(0),
            b.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Reopens the store in `dir`: a clean replay returns every one of the `KEYS` keys of tablet 0,
/// each with a version above `min_version` (its newest).
fn assert_replays_newest(dir: &std::path::Path, cfg: ramlog_backup::Config, min_version: u64) {
    let b = Backup::open(dir, cfg).unwrap();
    let (state, report) = replay_state(&b);
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(state.len() as u64, KEYS);
    assert!(state.values().all(|(_, v, _)| *v > min_version));
}

/// The crash-test configuration with reorganization starting at 15% of a log: 4000 live keys
/// (about 10%) stay under it, three rounds of updates take a log over it.
fn activation_15() -> ramlog_backup::Config {
    ramlog_backup::Config {
        reorg_activation: 0.15,
        reorg_prompt: 0.5,
        ..crash_config()
    }
}

/// Waits until the background reorganizer has finished `rounds` more visits.
fn wait_for_visits(b: &Backup, rounds: u64) {
    let start = b.stats().reorg_runs;
    let t0 = Instant::now();
    while b.stats().reorg_runs < start + rounds {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "reorganizer idle: {:?}",
            b.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_busy_reorganizer_lets_the_version_log_grow_to_four_times_then_compacts_it() {
    let dir = temp_dir("versions-busy");
    // 4000 live keys of about 100 bytes keep the 4 MiB log above the 5% activation threshold:
    // the reorganizer is busy the whole time.
    let b = Backup::open(dir.path(), crash_config()).unwrap();
    let version = update_all(&b, 3, 0);
    // Spill what the version buffer holds, then let the reorganizer visit the log a few times.
    b.checkpoint().unwrap();
    wait_for_visits(&b, 3);
    let compacted = KEYS * RECORD;
    let busy_len = version_log_len(dir.path());
    // Three records per key: past twice the compacted size, short of four times. A busy
    // reorganizer leaves it alone.
    assert!(
        busy_len > 2 * compacted + compacted / 4,
        "version log was compacted while the reorganizer was busy: {busy_len} bytes"
    );
    assert!(busy_len < 4 * compacted, "{busy_len} bytes");
    // A fourth and fifth round pass four times: the busy reorganizer compacts it now.
    update_all(&b, 2, version);
    b.checkpoint().unwrap();
    wait_for_version_log_at_most(&b, dir.path(), 2 * compacted);
    b.close().unwrap();
    // Nothing was lost by the rewrite: every key replays with its newest version.
    assert_replays_newest(dir.path(), crash_config(), 4 * KEYS);
}

/// While flushes wait for a log's cleaning (throttle), its version log is left to grow to eight
/// times its compacted size: a rewrite holds the log, and the next throttled flush would wait for
/// it too. Once the pressure is over (a second without a throttled flush), it is compacted.
#[test]
fn a_log_whose_flushes_wait_for_cleaning_keeps_its_version_log_past_four_times() {
    let dir = temp_dir("versions-pressed");
    // 4000 live keys of about 100 bytes fill about 10% of the 4 MiB log: above a 9% throttle,
    // so every flush to it waits for a round first.
    let cfg = ramlog_backup::Config {
        reorg_throttle: 0.09,
        ..crash_config()
    };
    let b = Backup::open(dir.path(), cfg.clone()).unwrap();
    update_all(&b, 6, 0);
    b.checkpoint().unwrap();
    assert!(b.stats().throttle_waits > 0, "{:?}", b.stats());
    let compacted = KEYS * RECORD;
    let pressed_len = version_log_len(dir.path());
    // Six records per key: past four times the compacted size, which a busy reorganizer would
    // have compacted (a_busy_reorganizer_lets_the_version_log_grow_to_four_times...).
    assert!(
        pressed_len > 4 * compacted + compacted / 4,
        "version log was compacted while flushes waited for the log: {pressed_len} bytes"
    );
    assert!(pressed_len < 8 * compacted, "{pressed_len} bytes");
    // No more flushes: after a second the log is no longer pressed, and the busy reorganizer
    // (the log stays above the activation threshold) compacts it.
    wait_for_version_log_at_most(&b, dir.path(), 2 * compacted);
    b.close().unwrap();
    assert_replays_newest(dir.path(), cfg, 5 * KEYS);
}

#[test]
fn an_explicit_reorganization_compacts_a_version_log_past_twice_its_size() {
    let dir = temp_dir("versions-explicit");
    let cfg = ramlog_backup::Config {
        reorg_enabled: false,
        ..crash_config()
    };
    let b = Backup::open(dir.path(), cfg.clone()).unwrap();
    update_all(&b, 3, 0);
    b.checkpoint().unwrap();
    let compacted = KEYS * RECORD;
    let before = version_log_len(dir.path());
    assert!(before > 2 * compacted + compacted / 4, "{before} bytes");
    b.reorganize(0).unwrap();
    let after = version_log_len(dir.path());
    // One record per key plus block headers.
    assert!(
        after < compacted + compacted / 10,
        "not compacted: {before} -> {after} bytes"
    );
    b.close().unwrap();
    assert_replays_newest(dir.path(), cfg, 2 * KEYS);
}

#[test]
fn once_no_log_needs_cleaning_the_reorganizer_compacts_a_grown_version_log() {
    let dir = temp_dir("versions-idle");
    // 4000 live keys fill about 10% of the 4 MiB log; three rounds of updates take it past the
    // 15% activation threshold, and cleaning brings it back under: then nothing needs cleaning.
    let cfg = activation_15();
    let b = Backup::open(dir.path(), cfg.clone()).unwrap();
    update_all(&b, 3, 0);
    b.checkpoint().unwrap();
    let compacted = KEYS * RECORD;
    wait_for_version_log_at_most(&b, dir.path(), compacted + compacted / 10);
    assert!(b.utilisation(0) < 0.15, "{}", b.utilisation(0));
    b.close().unwrap();
    assert_replays_newest(dir.path(), cfg, 2 * KEYS);
}

#[test]
fn a_version_log_left_grown_while_another_log_needed_cleaning_is_compacted_later() {
    let dir = temp_dir("versions-later");
    let cfg = activation_15();
    let b = Backup::open(dir.path(), cfg).unwrap();
    // Tablet 1 holds only live data, 30% of its log: above the activation threshold, and no
    // cleaning can bring it under. The reorganizer stays busy.
    write_rounds(&b, 1, 12_000, 1, 0);
    // Tablet 0's updates take it past the threshold too; cleaning brings it back under, but its
    // version log (three records per key) is left alone while tablet 1 needs cleaning.
    update_all(&b, 3, 0);
    b.checkpoint().unwrap();
    let t0 = Instant::now();
    while b.utilisation(0) >= 0.15 {
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", b.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    wait_for_visits(&b, 3);
    let compacted = KEYS * RECORD;
    let busy_len = version_log_len(dir.path());
    assert!(
        busy_len > 2 * compacted + compacted / 4,
        "compacted while tablet 1 needed cleaning: {busy_len} bytes"
    );
    // Once no log needs cleaning, the idle reorganizer compacts it.
    b.drop_tablet(1).unwrap();
    wait_for_version_log_at_most(&b, dir.path(), compacted + compacted / 10);
    b.close().unwrap();
}

/// The background reorganizer merges only the version-buffer records a visit has not seen yet;
/// the records that arrive between visits must still reach its table. Three rounds of updates
/// stay in the version buffer (never spilled): cleaning must drop the two superseded rounds.
#[test]
fn versions_still_in_the_buffer_let_visit_after_visit_drop_superseded_entries() {
    let dir = temp_dir("versions-buffered");
    let cfg = ramlog_backup::Config {
        version_buffer_entries: 1 << 20,
        ..crash_config()
    };
    let b = Backup::open(dir.path(), cfg.clone()).unwrap();
    let mut version = update_all(&b, 1, 0);
    let live = b.utilisation(0);
    // Visits with only the first round merge it; each later round arrives between visits.
    wait_for_visits(&b, 2);
    for _ in 0..2 {
        version = update_all(&b, 1, version);
        wait_for_visits(&b, 2);
    }
    // Three rounds were written (about 3 × `live`); cleaning by the buffered versions brings the
    // log back near one round.
    let t0 = Instant::now();
    while b.utilisation(0) > 1.5 * live {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "superseded entries kept: utilisation {:.3} with one round at {live:.3}; {:?}",
            b.utilisation(0),
            b.stats()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(b.stats().version_spills, 0, "the buffer was spilled");
    b.close().unwrap();
    assert_replays_newest(dir.path(), cfg, 2 * KEYS);
}

/// The reorganizers' disk traffic adds up: every cleaned segment is read, its survivors are
/// written once, and freeing it writes one zero page. With half the keys superseded, cleaning
/// copies survivors, so more is written than the zero pages alone.
#[test]
fn reorganization_counts_the_bytes_it_reads_and_writes() {
    let dir = temp_dir("reorg-bytes");
    let b = Backup::open(dir.path(), activation_15()).unwrap();
    // Every key once, then the even ones again: odd keys survive in the first segments.
    let first = update_all(&b, 1, 0);
    let value = vec![3u8; 60];
    let mut last = None;
    for (i, k) in (0..KEYS).step_by(2).enumerate() {
        let key = format!("key{k:06}");
        let entry = Entry {
            key: key.as_bytes(),
            value: Some(&value),
            version: first + i as u64 + 1,
            expiry: 0,
        };
        last = Some(b.append(0, &[entry]).unwrap());
    }
    b.wait(last.unwrap(), Stage::Durable).unwrap();
    b.reorganize(0).unwrap();
    let s = b.stats();
    let page = ramlog_backup::format::PAGE_BYTES as u64;
    assert!(s.reorg_segments_cleaned > 0, "{s:?}");
    assert!(
        s.reorg_bytes_written > s.reorg_segments_cleaned * page,
        "survivors were copied, so more than the zero pages was written: {s:?}"
    );
    // read = cleaned segments' bytes + segments read and left alone; written = cleaned bytes -
    // freed bytes + one zero page per cleaned segment.
    assert!(
        s.reorg_bytes_written + s.reorg_bytes_freed
            <= s.reorg_bytes_read + s.reorg_segments_cleaned * page,
        "{s:?}"
    );
    assert!(s.reorg_bytes_read >= s.reorg_bytes_freed, "{s:?}");
}
