//! The throttle that keeps a log's utilisation bounded when writes outpace reorganization.

mod common;
use common::*;
use ramlog_backup::{Backup, Config, Entry};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Sequential overwrites that hand each flush to one tablet (as when a client rewrites one tablet's
/// keys in order): a flush that would carry the log past the prompt threshold waits for the
/// cleaner, also when the garbage it needs was made by flushes still being written.
#[test]
fn sequential_overwrites_keep_every_log_under_the_prompt_threshold() {
    let dir = temp_dir("throttle");
    let capacity = 4u64 << 20;
    let cfg = Config {
        segment_bytes: 64 << 10,
        tablet_log_capacity_bytes: capacity,
        write_buffer_bytes: 512 << 10,
        write_buffer_chunks: 2,
        flush_threshold_bytes: 256 << 10,
        secondary_buffer_bytes: 16 << 10,
        direct_threshold_bytes: 16 << 10,
        primary_log_bytes: 8 << 20,
        version_buffer_entries: 1 << 12,
        ..Config::default()
    };
    let prompt = cfg.reorg_prompt;
    let opened = std::time::Instant::now();
    let b = Arc::new(Backup::open(dir.path(), cfg).unwrap());
    let tablets = 4u64;
    let value = [0x11u8; 48];
    // Live data: 45% of each log (entries of 16 B key + 48 B value + header).
    let per_tablet = capacity * 45 / 100 / 96 / 10 * 10;
    let write_pass = |version: &mut u64| {
        for t in 0..tablets {
            let mut k = 0;
            while k < per_tablet {
                let keys: Vec<[u8; 16]> = (k..k + 10)
                    .map(|i| {
                        let mut key = [0u8; 16];
                        key[..8].copy_from_slice(&t.to_be_bytes());
                        key[8..].copy_from_slice(&i.to_be_bytes());
                        key
                    })
                    .collect();
                let entries: Vec<Entry<'_>> = keys
                    .iter()
                    .map(|key| {
                        *version += 1;
                        Entry {
                            key,
                            value: Some(&value),
                            version: *version,
                            expiry: 0,
                        }
                    })
                    .collect();
                b.append(t, &entries).unwrap();
                k += 10;
            }
        }
    };
    let mut version = 0;
    write_pass(&mut version);
    b.flush().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (b, stop) = (b.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut max = 0.0f64;
            while !stop.load(Ordering::Relaxed) {
                max = max.max(b.stats().max_utilisation);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            max
        })
    };
    for _ in 0..3 {
        write_pass(&mut version);
    }
    b.flush().unwrap();
    stop.store(true, Ordering::Relaxed);
    let max = sampler.join().unwrap().max(b.stats().max_utilisation);
    let s = b.stats();
    assert!(s.throttle_waits > 0, "the throttle never engaged: {s:?}");
    // One processor places flushes, so its waits never overlap: their total fits the run.
    assert!(
        u128::from(s.throttle_wait_ms) <= opened.elapsed().as_millis(),
        "throttle waits of {} ms in a run of {:?}",
        s.throttle_wait_ms,
        opened.elapsed()
    );
    assert!(
        max <= prompt + 0.02,
        "a log reached {max:.3} of its capacity (prompt threshold {prompt}): {s:?}"
    );
    // Everything written is still there, at its newest version.
    let (state, report) = replay_state(&b);
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(state.len() as u64, tablets * per_tablet);
    assert!(state
        .values()
        .all(|(_, v, _)| *v > 3 * tablets * per_tablet));
}
