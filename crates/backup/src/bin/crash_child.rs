//! Child process for kill -9 crash tests: appends the deterministic crash workload to a backup
//! directory and prints `B n` before appending batch n and `A n` once it is written (on disk).
//! With the mode `rest`, it uses tiny memory bounds, waits for every batch to be durable, pauses
//! after every 16th batch until the store has come to rest, and then prints
//! `R rests spills_over_bound tables_dropped notes_dropped primary_prewritten_bytes`.
//! Usage: ramlog-backup-crash-child DIR SEED ROUND [rest]

use ramlog_backup::testkit;
use ramlog_backup::{Backup, Stage};
use std::io::Write;
use std::time::{Duration, Instant};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 && !(args.len() == 5 && args[4] == "rest") {
        return Err("usage: ramlog-backup-crash-child DIR SEED ROUND [rest]".into());
    }
    let dir = std::path::PathBuf::from(&args[1]);
    let seed: u64 = args[2].parse()?;
    let round: u64 = args[3].parse()?;
    let resting = args.len() == 5;
    let cfg = if resting {
        testkit::crash_config_resting()
    } else {
        testkit::crash_config()
    };
    let backup = Backup::open(&dir, cfg)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "OPEN {}", backup.io_mode().name())?;
    out.flush()?;
    for n in 0..1_000_000u64 {
        let (tablet, entries) = testkit::crash_batch(seed, round, n);
        let refs: Vec<_> = entries.iter().map(|e| e.as_entry()).collect();
        writeln!(out, "B {n}")?;
        out.flush()?;
        let ticket = backup.append(tablet, &refs)?;
        if resting {
            backup.wait(ticket, Stage::Durable)?;
            writeln!(out, "A {n}")?;
            out.flush()?;
            if n % 16 == 15 {
                let rests = backup.stats().rests;
                let deadline = Instant::now() + Duration::from_secs(5);
                while backup.stats().rests == rests && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
                let s = backup.stats();
                writeln!(
                    out,
                    "R {} {} {} {} {}",
                    s.rests,
                    s.version_spills_over_bound,
                    s.version_caches_dropped,
                    s.notes_dropped,
                    s.primary_prewritten_bytes
                )?;
                out.flush()?;
            }
        } else if n % 2 == 0 {
            // Every other batch waits for the disk; the rest pile up in the write buffer.
            backup.wait(ticket, Stage::Written)?;
            writeln!(out, "A {n}")?;
            out.flush()?;
        }
    }
    Ok(())
}
