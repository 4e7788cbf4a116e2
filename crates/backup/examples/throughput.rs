//! A quick logging-throughput probe for development and profiling (the full suite is
//! `ramlog bench backup`): `throughput DIR SIZE TABLETS MIB [random]`. Settings from the
//! environment: WB_MB, WB_CHUNKS, FLUSH_MB or FLUSH_KB, SLB_KB, IO_THREADS, DIRECT_KB,
//! SYNC (1 periodic, 0 on demand), TWO_LEVEL (1 on, 0 off).

use ramlog_backup::{Backup, Config, Entry};
use rand::{Rng, SeedableRng};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(&a[1]);
    let size: usize = a[2].parse()?;
    let tablets: u64 = a[3].parse()?;
    let mib: u64 = a[4].parse()?;
    let random = a.get(5).is_some_and(|s| s == "random");
    let _ = std::fs::remove_dir_all(&dir);
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let cfg = Config {
        reorg_enabled: false,
        tablet_log_capacity_bytes: 8 << 30,
        write_buffer_bytes: env("WB_MB", 32) << 20,
        write_buffer_chunks: env("WB_CHUNKS", 8),
        flush_threshold_bytes: env("FLUSH_KB", env("FLUSH_MB", 16) << 10) << 10,
        two_level: env("TWO_LEVEL", 1) == 1,
        secondary_buffer_bytes: env("SLB_KB", 128) << 10,
        io_threads: env("IO_THREADS", 8),
        direct_threshold_bytes: env("DIRECT_KB", 32).min(env("SLB_KB", 128)) << 10,
        sync: if env("SYNC", 1) == 1 {
            ramlog_backup::SyncPolicy::Periodic
        } else {
            ramlog_backup::SyncPolicy::OnDemand
        },
        ..Config::default()
    };
    let b = Backup::open(&dir, cfg)?;
    b.open_tablets(0..tablets)?;
    let value = vec![0x5Au8; size - 16];
    let count = (mib << 20) / size as u64 / 10 * 10;
    let mut keys = [[0u8; 16]; 10];
    let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
    let start = Instant::now();
    let mut id = 0u64;
    let mut n = 0u64;
    while id < count {
        let tablet = if random {
            rng.gen_range(0..tablets)
        } else {
            n % tablets
        };
        for (i, k) in keys.iter_mut().enumerate() {
            k[..8].copy_from_slice(&(id + i as u64).to_be_bytes());
        }
        let entries: [Entry<'_>; 10] = std::array::from_fn(|i| Entry {
            key: &keys[i],
            value: Some(&value),
            version: id + i as u64 + 1,
            expiry: 0,
        });
        b.append(tablet, &entries)?;
        id += 10;
        n += 1;
    }
    b.flush()?;
    let secs = start.elapsed().as_secs_f64();
    let s = b.stats();
    println!(
        "{size}B x {count} over {tablets} tablets: {:.0} entries/s, {:.1} MB/s payload; {} flushes, primary {} writes {} MiB, secondary {} writes {} MiB, {} syncs, {} version spills; {}",
        count as f64 / secs,
        count as f64 * size as f64 / secs / 1e6,
        s.flushes,
        s.primary_writes,
        s.primary_bytes >> 20,
        s.secondary_writes,
        s.secondary_bytes >> 20,
        s.syncs,
        s.version_spills,
        s.io_mode
    );
    println!(
        "  time: producer blocked {} ms, process {} ms, write {} ms, versions {} ms, sync {} ms",
        s.producer_wait_ms, s.process_ms, s.write_ms, s.version_ms, s.sync_ms
    );
    b.close()?;
    if std::env::var_os("REPLAY").is_some() {
        let _ = std::fs::write("/proc/sys/vm/drop_caches", "1");
        let t = Instant::now();
        let b = Backup::open(
            &dir,
            Config {
                reorg_enabled: false,
                tablet_log_capacity_bytes: 8 << 30,
                ..Config::default()
            },
        )?;
        let opened = t.elapsed();
        let cpu = || {
            // SAFETY: rusage is plain integers, for which all-zero bytes are a valid value.
            let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
            // SAFETY: getrusage fills the struct we own.
            unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
            (ru.ru_utime.tv_sec as f64 + ru.ru_utime.tv_usec as f64 / 1e6)
                + (ru.ru_stime.tv_sec as f64 + ru.ru_stime.tv_usec as f64 / 1e6)
        };
        let c0 = cpu();
        let t = Instant::now();
        let mut n = 0u64;
        let r = b.replay_all(|_| n += 1)?;
        println!(
            "  reopen {:?}, replay {:?} wall, {:.2} s CPU: {n} keys, {:?}",
            opened,
            t.elapsed(),
            cpu() - c0,
            r
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
