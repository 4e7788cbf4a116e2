//! kill -9 crash tests with a real child process (`ramlog-backup-crash-child`): the child appends
//! a deterministic workload and reports which batches reached `Written`; the parent kills it at a
//! random moment, reopens the directory and checks the replay against what was acknowledged.

mod common;
use common::*;
use ramlog_backup::testkit::{crash_batch, crash_config, crash_config_resting, value_for};
use ramlog_backup::{Backup, Config};
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default, Clone, Copy)]
struct RoundLog {
    /// Highest batch the child started to append (it may or may not have landed).
    began: Option<u64>,
    /// Highest batch acknowledged as written (every batch before it is written too).
    acked: Option<u64>,
    /// In the `rest` mode, the child's last report: rests, store-wide version spills, version
    /// tables dropped, notes dropped, primary log bytes written ahead.
    rest: [u64; 5],
}

fn run_child(
    dir: &std::path::Path,
    seed: u64,
    round: u64,
    kill_after: Duration,
    resting: bool,
) -> RoundLog {
    let exe = env!("CARGO_BIN_EXE_ramlog-backup-crash-child");
    let mut cmd = Command::new(exe);
    cmd.arg(dir).arg(seed.to_string()).arg(round.to_string());
    if resting {
        cmd.arg("rest");
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn crash child");
    let stdout = child.stdout.take().expect("stdout");
    let log = Arc::new(Mutex::new(RoundLog::default()));
    let opened = Arc::new(Mutex::new(false));
    let (log2, opened2) = (log.clone(), opened.clone());
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let mut it = line.split_whitespace();
            match (it.next(), it.next().and_then(|n| n.parse::<u64>().ok())) {
                (Some("B"), Some(n)) => log2.lock().unwrap().began = Some(n),
                (Some("A"), Some(n)) => log2.lock().unwrap().acked = Some(n),
                (Some("OPEN"), _) => *opened2.lock().unwrap() = true,
                (Some("R"), Some(rests)) => {
                    let rest: Vec<u64> = line
                        .split_whitespace()
                        .skip(1)
                        .filter_map(|n| n.parse().ok())
                        .collect();
                    if let [_, spills, tables, notes, prewritten] = rest[..] {
                        log2.lock().unwrap().rest = [rests, spills, tables, notes, prewritten];
                    }
                }
                _ => {}
            }
        }
    });
    // Wait for the child to open the store, then let it run for a while and kill it.
    for _ in 0..3000 {
        if *opened.lock().unwrap() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        *opened.lock().unwrap(),
        "crash child did not open the store"
    );
    std::thread::sleep(kill_after);
    child.kill().expect("kill -9");
    let _ = child.wait();
    reader.join().unwrap();
    let l = *log.lock().unwrap();
    l
}

/// What a key may look like after the crash: every put and delete that may have landed, and the
/// newest version that was acknowledged.
#[derive(Default)]
struct KeyHistory {
    maybe: BTreeMap<u64, Option<u64>>, // version -> Some(expiry) for put, None for delete
    acked_max: u64,
}

#[test]
fn kill_minus_nine_at_random_points() {
    let rounds = kill_rounds("crash", 0xC0FFEE, 8, 50..500, false, crash_config);
    let total_acked: u64 = rounds.iter().map(|l| l.acked.map_or(0, |a| a + 1)).sum();
    assert!(
        total_acked > 5,
        "the child acknowledged too little to test anything ({total_acked} batches)"
    );
}

/// Kills a child that pauses until its store has come to rest (version buffers spilled, version tables and notes dropped, buffers released) every 16 durable batches, and
/// spills version buffers and drops tables over tiny bounds all the time: every acknowledged
/// write replays, and no deleted key comes back.
#[test]
fn kill_minus_nine_after_rests_and_store_wide_spills() {
    let rounds = kill_rounds(
        "crash-rest",
        0xBEEF,
        6,
        400..1200,
        true,
        crash_config_resting,
    );
    let total_acked: u64 = rounds.iter().map(|l| l.acked.map_or(0, |a| a + 1)).sum();
    assert!(
        total_acked > 32,
        "the child acknowledged too little to test anything ({total_acked} batches)"
    );
    let most = |i: usize| rounds.iter().map(|l| l.rest[i]).max().unwrap_or(0);
    assert!(most(0) > 1, "the store never came to rest after writes");
    assert!(most(1) > 0, "no store-wide version spill happened");
    assert!(most(2) > 0, "no version table was dropped");
    // Its durable waits had the primary log written through ahead of the flushes (and the kills
    // met the pre-writer at work).
    assert!(most(4) > 0, "the primary log was never written ahead");
}

/// Runs `count` rounds of the crash child on one directory, each killed after a random time in
/// `kill_ms`, and after each checks the replay against what may have landed and what was
/// acknowledged.
fn kill_rounds(
    name: &str,
    seed: u64,
    count: u64,
    kill_ms: std::ops::Range<u64>,
    resting: bool,
    config: fn() -> Config,
) -> Vec<RoundLog> {
    let dir = temp_dir(name);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(99);
    let mut rounds: Vec<RoundLog> = Vec::new();
    for round in 0..count {
        let kill_after = Duration::from_millis(rng.gen_range(kill_ms.clone()));
        let log = run_child(dir.path(), seed, round, kill_after, resting);
        rounds.push(log);

        // Rebuild what may have landed and what was acknowledged.
        let mut hist: HashMap<(u64, Vec<u8>), KeyHistory> = HashMap::new();
        for (r, l) in rounds.iter().enumerate() {
            let Some(began) = l.began else { continue };
            for n in 0..=began {
                let (tablet, entries) = crash_batch(seed, r as u64, n);
                let acked = l.acked.is_some_and(|a| n <= a);
                for e in entries {
                    let h = hist.entry((tablet, e.key.clone())).or_default();
                    h.maybe
                        .insert(e.version, e.value.as_ref().map(|_| e.expiry));
                    if acked {
                        h.acked_max = h.acked_max.max(e.version);
                    }
                }
            }
        }
        let b = Backup::open(dir.path(), config()).expect("reopen after kill -9");
        let (state, report) = replay_state(&b);
        assert_eq!(
            report.corrupt_entries, 0,
            "kill -9 cannot tear writes: {report:?}"
        );
        assert_eq!(report.lost_keys, 0, "{report:?}");
        assert_eq!(report.damaged_version_bytes, 0, "{report:?}");
        for ((tablet, key), (value, version, expiry)) in &state {
            let h = hist
                .get(&(*tablet, key.clone()))
                .unwrap_or_else(|| panic!("invented key {key:?}"));
            match h.maybe.get(version) {
                Some(Some(exp)) => {
                    assert_eq!(expiry, exp);
                    assert_eq!(
                        value,
                        &value_for(key, *version),
                        "value of {key:?}@{version} differs"
                    );
                }
                _ => panic!("invented version {version} of {key:?}"),
            }
            assert!(
                *version >= h.acked_max,
                "stale {key:?}: {version} < acknowledged {}",
                h.acked_max
            );
        }
        for ((tablet, key), h) in &hist {
            if h.acked_max == 0 || state.contains_key(&(*tablet, key.clone())) {
                continue;
            }
            // Absent: something at or after the acknowledged version must be a delete.
            let deleted = h.maybe.range(h.acked_max..).any(|(_, v)| v.is_none());
            assert!(
                deleted,
                "acknowledged key {key:?} (version {}) is missing after round {round}",
                h.acked_max
            );
        }
        b.close().expect("close");
    }
    rounds
}
