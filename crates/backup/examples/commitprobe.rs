//! A durable group-commit probe for development (the suite's rows are in `ramlog bench backup`):
//! `commitprobe DIR [SECONDS]`. `THREADS` appenders (default 1) each append `ENTRIES` entries
//! (default 100) of 16 B keys and 100 B values to a tablet of their own and wait until they are
//! durable, in a loop; beside it, the bare loops of the same bytes per commit: a buffered write
//! and fdatasync over one written block, and an O_DIRECT write and fdatasync that appends
//! through a preallocated (unwritten) file and through an already written one.

use ramlog_backup::io::{open_log, preallocate, AlignedBuf, IoMode};
use ramlog_backup::{Backup, Config, Entry, Stage};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

fn env(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn bare_buffered(dir: &std::path::Path, bytes: usize, secs: f64) -> f64 {
    let path = dir.join("bare-buffered");
    let f = std::fs::File::create(&path).unwrap();
    let block = vec![0x5au8; bytes];
    f.write_all_at(&block, 0).unwrap();
    f.sync_all().unwrap();
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed().as_secs_f64() < secs {
        f.write_all_at(&block, 0).unwrap();
        f.sync_data().unwrap();
        n += 1;
    }
    let _ = std::fs::remove_file(&path);
    n as f64 / t.elapsed().as_secs_f64()
}

/// O_DIRECT appends of `bytes` (page-aligned up) through a 256 MiB file: preallocated only
/// (`written` false), or written through once before (`written` true).
fn bare_direct(dir: &std::path::Path, bytes: usize, secs: f64, written: bool) -> f64 {
    let path = dir.join("bare-direct");
    let _ = std::fs::remove_file(&path);
    let size: u64 = 256 << 20;
    let f = open_log(&path, IoMode::Direct, true).unwrap();
    preallocate(&f, 0, size).unwrap();
    if written {
        let mut big = AlignedBuf::new(8 << 20);
        big.set_len(8 << 20);
        for i in 0..(size / (8 << 20)) {
            f.write_all_at(big.as_slice(), i * (8 << 20)).unwrap();
        }
        f.sync_all().unwrap();
    }
    let len = bytes.div_ceil(4096) * 4096;
    let mut buf = AlignedBuf::new(len);
    buf.full_mut().fill(0x5a);
    buf.set_len(len);
    let t = Instant::now();
    let mut n = 0u64;
    let mut at = 0u64;
    while t.elapsed().as_secs_f64() < secs {
        if at + len as u64 > size {
            at = 0;
        }
        f.write_all_at(buf.as_slice(), at).unwrap();
        f.sync_data().unwrap();
        at += len as u64;
        n += 1;
    }
    let _ = std::fs::remove_file(&path);
    n as f64 / t.elapsed().as_secs_f64()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(&a[1]);
    let secs: f64 = a.get(2).map(|s| s.parse().unwrap()).unwrap_or(3.0);
    let threads = env("THREADS", 1);
    let entries = env("ENTRIES", 100);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let cfg = Config::for_memory_budget((env("BUDGET_MIB", 1024) as u64) << 20);
    let store_dir = dir.join("store");
    if env("PREWRITE", 0) == 1 {
        // Development knob: the primary log's blocks written through once before the store opens.
        std::fs::create_dir_all(&store_dir)?;
        let f = std::fs::File::create(store_dir.join("primary.log"))?;
        let zeros = vec![0u8; 8 << 20];
        for i in 0..(cfg.primary_log_bytes / (8 << 20)) {
            f.write_all_at(&zeros, i * (8 << 20))?;
        }
        f.sync_all()?;
    }
    let b = Backup::open(&store_dir, cfg)?;
    let value = [0x5au8; 100];
    let start = Instant::now();
    let commits = std::sync::atomic::AtomicU64::new(0);
    let lat_ns = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (b, commits, lat_ns) = (&b, &commits, &lat_ns);
            s.spawn(move || {
                let keys: Vec<[u8; 16]> = (0..entries as u64)
                    .map(|i| {
                        let mut k = [0u8; 16];
                        k[..8].copy_from_slice(&(t as u64).to_le_bytes());
                        k[8..].copy_from_slice(&i.to_le_bytes());
                        k
                    })
                    .collect();
                let mut version = 1u64;
                while start.elapsed().as_secs_f64() < secs {
                    let es: Vec<Entry<'_>> = keys
                        .iter()
                        .map(|k| Entry {
                            key: k,
                            value: Some(&value),
                            version,
                            expiry: 0,
                        })
                        .collect();
                    version += 1;
                    let t0 = Instant::now();
                    let ticket = b.append(t as u64 + 1, &es).unwrap();
                    b.wait(ticket, Stage::Durable).unwrap();
                    lat_ns.fetch_add(
                        t0.elapsed().as_nanos() as u64,
                        std::sync::atomic::Ordering::Relaxed,
                    );
                    commits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    let el = start.elapsed().as_secs_f64();
    let n = commits.load(std::sync::atomic::Ordering::Relaxed);
    let st = b.stats();
    println!(
        "store: {threads} appenders x {entries} entries: {:.0} waits/s, mean wait {:.1} us; flushes {} syncs {} primary writes {} ({} B) secondary writes {}, prewritten {} MiB; process {:.1} write {:.1} sync {:.1} version {:.1} us/flush",
        n as f64 / el,
        lat_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 / n as f64 / 1e3,
        st.flushes,
        st.syncs,
        st.primary_writes,
        st.primary_bytes / st.primary_writes.max(1),
        st.secondary_writes,
        st.primary_prewritten_bytes >> 20,
        st.process_ms as f64 * 1e3 / st.flushes.max(1) as f64,
        st.write_ms as f64 * 1e3 / st.flushes.max(1) as f64,
        st.sync_ms as f64 * 1e3 / st.flushes.max(1) as f64,
        st.version_ms as f64 * 1e3 / st.flushes.max(1) as f64,
    );
    let bytes = (st.primary_bytes / st.primary_writes.max(1)) as usize;
    b.close()?;
    let _ = std::fs::remove_dir_all(&store_dir);
    std::thread::sleep(Duration::from_millis(200));
    println!(
        "bare buffered write+fdatasync of {bytes} B: {:.0}/s",
        bare_buffered(&dir, bytes, secs)
    );
    println!(
        "bare O_DIRECT append+fdatasync, preallocated file: {:.0}/s",
        bare_direct(&dir, bytes, secs, false)
    );
    println!(
        "bare O_DIRECT append+fdatasync, written file: {:.0}/s",
        bare_direct(&dir, bytes, secs, true)
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
