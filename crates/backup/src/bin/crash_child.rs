//! Child process for kill -9 crash tests: appends the deterministic crash workload to a backup
//! directory and prints `B n` before appending batch n and `A n` once it is written (on disk).
//! Usage: ramlog-backup-crash-child DIR SEED ROUND

use ramlog_backup::testkit;
use ramlog_backup::{Backup, Stage};
use std::io::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        return Err("usage: ramlog-backup-crash-child DIR SEED ROUND".into());
    }
    let dir = std::path::PathBuf::from(&args[1]);
    let seed: u64 = args[2].parse()?;
    let round: u64 = args[3].parse()?;
    let backup = Backup::open(&dir, testkit::crash_config())?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "OPEN {}", backup.io_mode().name())?;
    out.flush()?;
    for n in 0..1_000_000u64 {
        let (tablet, entries) = testkit::crash_batch(seed, round, n);
        let refs: Vec<_> = entries.iter().map(|e| e.as_entry()).collect();
        writeln!(out, "B {n}")?;
        out.flush()?;
        let ticket = backup.append(tablet, &refs)?;
        // Every other batch waits for the disk; the rest pile up in the write buffer.
        if n % 2 == 0 {
            backup.wait(ticket, Stage::Written)?;
            writeln!(out, "A {n}")?;
            out.flush()?;
        }
    }
    Ok(())
}
