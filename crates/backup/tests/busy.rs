//! While writes arrive, a log is cleaned only above `reorg_busy_target` (each segment read then
//! holds more garbage); once the store is quiet, down to the activation threshold.

mod common;
use common::*;
use ramlog_backup::testkit::crash_config;
use ramlog_backup::{Backup, Config, Entry, Stage};
use std::time::{Duration, Instant};

const KEYS: u64 = 4000;

/// The crash-test store (4 MiB logs of 64 KiB segments) with activation at 20% and the busy
/// level at `busy`. The store counts as quiet after 2 s without a flush carrying data, so a
/// slow test machine does not end the busy phase by accident.
fn config(busy: f64) -> Config {
    Config {
        reorg_activation: 0.2,
        reorg_prompt: 0.75,
        reorg_busy_target: busy,
        reorg_quiet_after: Duration::from_secs(2),
        ..crash_config()
    }
}

/// One version of each of keys `0..keys` of tablet 0 (all `KEYS` of them: about 10% of the
/// log), made durable.
fn write_round(b: &Backup, keys: u64, version: &mut u64, newest: &mut [u64]) {
    let value = [7u8; 60];
    let mut last = None;
    for k in 0..keys {
        *version += 1;
        newest[k as usize] = *version;
        let key = format!("key{k:06}");
        let entry = Entry {
            key: key.as_bytes(),
            value: Some(&value),
            version: *version,
            expiry: 0,
        };
        last = Some(b.append(0, &[entry]).unwrap());
    }
    b.wait(last.unwrap(), Stage::Durable).unwrap();
}

/// Writes whole rounds until the log is 40% full (all but a quarter of it garbage), then keeps
/// writes arriving for 1.5 s more (50 keys every 20 ms, about 0.1% of the log each time);
/// returns how many segments were cleaned meanwhile.
fn write_above_activation(b: &Backup, version: &mut u64, newest: &mut [u64]) -> u64 {
    let t0 = Instant::now();
    while b.utilisation(0) < 0.40 {
        assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", b.stats());
        write_round(b, KEYS, version, newest);
    }
    let t1 = Instant::now();
    while t1.elapsed() < Duration::from_millis(1500) {
        write_round(b, 50, version, newest);
        std::thread::sleep(Duration::from_millis(20));
    }
    b.stats().reorg_segments_cleaned
}

#[test]
fn logs_are_cleaned_late_while_writes_arrive_and_down_to_activation_once_quiet() {
    let dir = temp_dir("busy-level");
    let b = Backup::open(dir.path(), config(0.6)).unwrap();
    let (mut version, mut newest) = (0, vec![0; KEYS as usize]);
    // Between the activation threshold (20%) and the busy level (60%) while writes arrive:
    // nothing is cleaned.
    let cleaned = write_above_activation(&b, &mut version, &mut newest);
    assert_eq!(
        cleaned,
        0,
        "cleaned while busy below the busy level: {:?}",
        b.stats()
    );
    // Quiet: the log is cleaned down to the activation threshold.
    let t0 = Instant::now();
    while b.utilisation(0) > 0.22 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "never cleaned once quiet: utilisation {:.3}, {:?}",
            b.utilisation(0),
            b.stats()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(b.stats().reorg_segments_cleaned > 0);
    b.close().unwrap();
    // Every key replays with its newest version.
    let b = Backup::open(dir.path(), config(0.6)).unwrap();
    let (state, report) = replay_state(&b);
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(state.len() as u64, KEYS);
    for (k, want) in newest.iter().enumerate() {
        let key = (0, format!("key{k:06}").into_bytes());
        assert_eq!(state.get(&key).map(|s| s.1), Some(*want), "key {k}");
    }
}

#[test]
fn a_busy_level_at_the_activation_threshold_cleans_while_writes_arrive() {
    let dir = temp_dir("busy-level-eager");
    let b = Backup::open(dir.path(), config(0.0)).unwrap();
    let (mut version, mut newest) = (0, vec![0; KEYS as usize]);
    let cleaned = write_above_activation(&b, &mut version, &mut newest);
    assert!(
        cleaned > 0,
        "nothing cleaned above the activation threshold: {:?}",
        b.stats()
    );
    b.close().unwrap();
}
