//! `ramlog bench backup`: the backup log store (DXRAM two-level logging) on this machine's disk.
//!
//! Every throughput is compared with raw sequential O_DIRECT write bandwidth (the better of 8 MiB
//! writes one at a time and 1 MiB writes four in flight, into a preallocated file) measured on
//! the same disk in the same run. Four groups of rows:
//! 1. logging throughput for 64 B, 128 B, 512 B and 4 KiB entries (key + value) over 1 tablet and
//!    over 256 tablets (round-robin and random), batches of 10 entries; each row alternates raw
//!    writes of the same size with logging runs (3 pairs in a full run) and reports the pair
//!    with the median ratio;
//! 2. two-level logging on vs off for small scattered batches over 256 tablets, with a 512 KiB
//!    write buffer (DXRAM's Fig. 16 regime, the target) and with a 4 MiB one;
//! 3. reorganization under sequential, uniform, zipf and hot-and-cold updates (digest 000 §9.5,
//!    §11.4): maximum log utilisation (over all runs), throughput relative to the same updates
//!    without reorganization (median of 3 alternating pairs in a full run), bytes freed per
//!    segment cleaned;
//! 4. replay of one tablet log of 256 MiB of 64 B entries (10% superseded, 1% deleted) from a cold
//!    cache (segments are read with O_DIRECT);
//! 5. memory (run first, while the process heap is fresh): the fixed RSS of an empty store over
//!    64 tablets opened with `Config::for_memory_budget(256 MiB)` and with `Config::default()`,
//!    and the RAM per logged key once the store is at rest after logging N distinct keys (2 M;
//!    quick: 200 k) with 100 B values over 64 tablets: (RSS at rest − RSS of the same store
//!    before logging) / N, and the same from `Backup::memory().total()`. Target ≤ 16 B/key,
//!    judged in a full run only.
//! 6. durable group commits (`commit`): 1 and 4 appenders, each appending 100 entries of 16 B
//!    keys and 100 B values to a tablet of its own and waiting for `Stage::Durable`, in a loop,
//!    with a store opened as a 1 GiB server opens it; against the disk's own bound in the same
//!    run: a bare loop of one O_DIRECT write of the store's mean primary block and one fdatasync,
//!    appending through a file written through once (and, for the record, through a
//!    preallocated one, whose unwritten extents cost a journal commit per sync). Store and bare
//!    runs alternate (3 pairs in a full run); the pair with the median ratio is reported.
//!
//! Data lives under `$RAMLOG_BENCH_DIR` (default `target/bench-data` in the working directory)
//! and is removed afterwards.

use crate::report::{Report, Row, Target};
use crate::util::{rss_bytes, scramble, Zipf};
use anyhow::{Context, Result};
use ramlog_backup::io::{open_log, preallocate, AlignedBuf, IoMode};
use ramlog_backup::{Backup, Config, Entry, MemoryUsage, Stage};
use rand::{Rng, SeedableRng};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const KEY_BYTES: usize = 16;

/// A scratch directory that is removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(root: &Path, name: &str) -> Result<Scratch> {
        let p = root.join(name);
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).with_context(|| format!("create {}", p.display()))?;
        Ok(Scratch(p))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn bench_root() -> Result<PathBuf> {
    let root = match std::env::var_os("RAMLOG_BENCH_DIR") {
        Some(d) => PathBuf::from(d),
        None => std::env::current_dir()?.join("target").join("bench-data"),
    };
    let root = root.join(format!("backup-{}", std::process::id()));
    std::fs::create_dir_all(&root).with_context(|| format!("create {}", root.display()))?;
    Ok(root)
}

/// What `memory_run` measured.
struct MemoryRun {
    /// RSS the empty store added to the process (open, 64 tablets, at rest).
    fixed_rss: u64,
    /// Process RSS and the store's accounted memory before logging and at rest after it.
    before_rss: u64,
    rest_rss: u64,
    before: MemoryUsage,
    at_rest: MemoryUsage,
    /// The accounted memory with the largest total seen while logging.
    busy_peak: MemoryUsage,
}

/// Opens a store over 64 tablets, waits until it is at rest, logs `keys` distinct keys with
/// 100 B values (batches of 100 entries, tablets in turn), waits until everything is durable and
/// the store is at rest again, and measures RSS and accounted memory at both points.
fn memory_run(dir: &Path, cfg: Config, keys: u64) -> Result<MemoryRun> {
    const TABLETS: u64 = 64;
    const BATCH: u64 = 100;
    ramlog_backup::io::return_free_memory();
    let empty_rss = rss_bytes();
    let b = Backup::open(dir, cfg)?;
    b.open_tablets(0..TABLETS)?;
    let before = wait_at_rest(&b, 1)?;
    let before_rss = rss_bytes();
    let mut busy_peak = MemoryUsage::default();
    let mut key = [0u8; KEY_BYTES];
    let value = [0x5au8; 100];
    let mut last = None;
    for (n, start) in (0..keys).step_by(BATCH as usize).enumerate() {
        let tablet = n as u64 % TABLETS;
        let mut owned: Vec<[u8; KEY_BYTES]> = Vec::with_capacity(BATCH as usize);
        for i in start..(start + BATCH).min(keys) {
            fill_key(&mut key, i);
            owned.push(key);
        }
        let entries: Vec<Entry<'_>> = owned
            .iter()
            .map(|k| Entry {
                key: k,
                value: Some(&value),
                version: 1,
                expiry: 0,
            })
            .collect();
        last = Some(b.append(tablet, &entries)?);
        if n % 256 == 0 {
            let m = b.memory();
            if m.total() > busy_peak.total() {
                busy_peak = m;
            }
        }
    }
    if let Some(t) = last {
        b.wait(t, Stage::Durable)?;
    }
    let rests = b.stats().rests;
    let at_rest = wait_at_rest(&b, rests + 1)?;
    let rest_rss = rss_bytes();
    b.close()?;
    Ok(MemoryRun {
        fixed_rss: before_rss.saturating_sub(empty_rss),
        before_rss,
        rest_rss,
        before,
        at_rest,
        busy_peak,
    })
}

/// Waits until the store has come to rest `rests` times and the reorganizer has let go of its
/// tables and buffers; then a little longer, so that freed memory has gone back to the system.
fn wait_at_rest(b: &Backup, rests: u64) -> Result<MemoryUsage> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let m = b.memory();
        if b.stats().rests >= rests
            && m.version_buffers == 0
            && m.version_caches == 0
            && m.notes == 0
            && m.reorg_buffers == 0
        {
            std::thread::sleep(Duration::from_millis(300));
            return Ok(b.memory());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the store did not come to rest: {m:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Raw sequential write bandwidth in bytes/s: the best of (a) 8 MiB O_DIRECT writes one at a
/// time and (b) 1 MiB O_DIRECT writes with four in flight, each into a preallocated file and
/// followed by fdatasync, best of `runs`. Virtual and flash disks often need queue depth to
/// reach their bandwidth, and the backup issues its writes several at a time, so the baseline is
/// whichever pattern the disk serves faster.
fn raw_bandwidth(dir: &Path, total_bytes: u64, runs: usize) -> Result<(f64, IoMode)> {
    let mode = ramlog_backup::io::probe_direct(dir);
    let path = dir.join("raw.bin");
    let block = 8usize << 20;
    let buf = filled_buffer(block);
    let mut best = 0.0f64;
    for _ in 0..runs {
        for (piece, in_flight) in [(block, 1usize), (1usize << 20, 4usize)] {
            let _ = std::fs::remove_file(&path);
            let f = open_log(&path, mode, true)?;
            preallocate(&f, 0, total_bytes)?;
            let start = Instant::now();
            write_in_parallel(in_flight, total_bytes.div_ceil(piece as u64), |i| {
                let off = i * piece as u64;
                let len = piece.min((total_bytes - off) as usize);
                f.write_all_at(&buf.as_slice()[..len], off)
            })?;
            f.sync_data()?;
            best = best.max(total_bytes as f64 / start.elapsed().as_secs_f64());
        }
    }
    let _ = std::fs::remove_file(&path);
    Ok((best, mode))
}

/// What [`commit_run`] measured.
struct CommitRun {
    commits_per_s: f64,
    mean_wait_us: f64,
    /// Entries per sync the store issued (its group commits' size).
    entries_per_sync: f64,
    /// The mean primary block the store wrote.
    block_bytes: usize,
}

/// `appenders` threads, each appending 100 entries (16 B keys, 100 B values) to a tablet of its
/// own and waiting until they are durable, in a loop for `secs`, on a store opened as a server
/// with a 1 GiB budget opens it.
fn commit_run(dir: &Path, appenders: usize, secs: f64) -> Result<CommitRun> {
    use std::sync::atomic::{AtomicU64, Ordering};
    const ENTRIES: u64 = 100;
    let b = Backup::open(dir, Config::for_memory_budget(1 << 30))?;
    let value = [0x5au8; 100];
    let commits = AtomicU64::new(0);
    let wait_ns = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let mut handles = Vec::new();
        for t in 0..appenders as u64 {
            let (b, commits, wait_ns) = (&b, &commits, &wait_ns);
            handles.push(s.spawn(move || -> Result<()> {
                let keys: Vec<[u8; KEY_BYTES]> = (0..ENTRIES)
                    .map(|i| {
                        let mut k = [0u8; KEY_BYTES];
                        fill_key(&mut k, t << 32 | i);
                        k
                    })
                    .collect();
                let mut version = 1u64;
                while start.elapsed().as_secs_f64() < secs {
                    let entries: Vec<Entry<'_>> = keys
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
                    let ticket = b.append(t + 1, &entries)?;
                    b.wait(ticket, Stage::Durable)?;
                    wait_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    commits.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }));
        }
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("an appender panicked"))??;
        }
        Ok(())
    })?;
    let elapsed = start.elapsed().as_secs_f64();
    let n = commits.load(Ordering::Relaxed).max(1);
    let st = b.stats();
    b.close()?;
    Ok(CommitRun {
        commits_per_s: n as f64 / elapsed,
        mean_wait_us: wait_ns.load(Ordering::Relaxed) as f64 / n as f64 / 1e3,
        entries_per_sync: st.appended_entries as f64 / st.syncs.max(1) as f64,
        block_bytes: (st.primary_bytes / st.primary_writes.max(1)) as usize,
    })
}

/// The disk's bound on a durable group commit: O_DIRECT writes of `bytes` (whole pages)
/// appended through a 256 MiB file, each followed by fdatasync, for `secs`; the file written
/// through once first (`written`), or only preallocated (its extents unwritten). Syncs per second.
fn bare_commits(root: &Path, bytes: usize, secs: f64, written: bool) -> Result<f64> {
    let mode = ramlog_backup::io::probe_direct(root);
    let path = root.join("bare-commit.bin");
    let _ = std::fs::remove_file(&path);
    let size: u64 = 256 << 20;
    let f = open_log(&path, mode, true)?;
    preallocate(&f, 0, size)?;
    if written {
        let fill = filled_buffer(8 << 20);
        for i in 0..size / (8 << 20) {
            f.write_all_at(fill.as_slice(), i * (8 << 20))?;
        }
        f.sync_all()?;
    }
    let len = bytes.max(1).next_multiple_of(4096);
    let block = filled_buffer(len);
    let start = Instant::now();
    let (mut n, mut at) = (0u64, 0u64);
    while start.elapsed().as_secs_f64() < secs {
        if at + len as u64 > size {
            at = 0;
        }
        f.write_all_at(block.as_slice(), at)?;
        f.sync_data()?;
        at += len as u64;
        n += 1;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    drop(f);
    let _ = std::fs::remove_file(&path);
    Ok(rate)
}

/// An O_DIRECT-ready buffer of `len` bytes (huge pages) filled with a non-zero pattern.
fn filled_buffer(len: usize) -> AlignedBuf {
    let mut buf = AlignedBuf::huge(len);
    for (i, b) in buf.full_mut().iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    buf.set_len(len);
    buf
}

/// Runs `write(0)` .. `write(requests - 1)` on `in_flight` threads, each taking the next request
/// number as it finishes one.
fn write_in_parallel(
    in_flight: usize,
    requests: u64,
    write: impl Fn(u64) -> std::io::Result<()> + Sync,
) -> Result<()> {
    let next = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = (0..in_flight)
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= requests {
                            return Ok(());
                        }
                        write(i)?;
                    }
                })
            })
            .collect();
        for w in workers {
            w.join()
                .map_err(|_| anyhow::anyhow!("a raw writer panicked"))??;
        }
        Ok(())
    })
}

#[derive(Clone, Copy, Debug)]
enum Spread {
    One,
    RoundRobin,
    Random,
}

impl Spread {
    fn name(self) -> &'static str {
        match self {
            Spread::One => "1tablet",
            Spread::RoundRobin => "256tablets_rr",
            Spread::Random => "256tablets_random",
        }
    }
}

fn fill_key(buf: &mut [u8], id: u64) {
    buf[..8].copy_from_slice(&id.to_be_bytes());
    buf[8..16].copy_from_slice(&scramble(id).to_le_bytes());
}

/// Raw O_DIRECT writes in the pattern of a store's flushes over many tablets: `files` fresh
/// preallocated files written round-robin in requests of `write_bytes` (rounded up to pages),
/// `in_flight` at a time, `total_bytes` in all, then synced with one syncfs. Returns bytes/s.
fn pattern_bandwidth(
    dir: &Path,
    files: usize,
    write_bytes: usize,
    total_bytes: u64,
    in_flight: usize,
) -> Result<f64> {
    let mode = ramlog_backup::io::probe_direct(dir);
    let piece = write_bytes.next_multiple_of(4096).max(4096);
    let per_file = (total_bytes / files as u64).next_multiple_of(piece as u64);
    let rounds = per_file / piece as u64;
    let sub = dir.join("pattern");
    let _ = std::fs::remove_dir_all(&sub);
    std::fs::create_dir_all(&sub)?;
    let handles: Vec<std::fs::File> = (0..files)
        .map(|i| -> Result<std::fs::File> {
            let f = open_log(&sub.join(format!("f{i}")), mode, true)?;
            preallocate(&f, 0, per_file)?;
            Ok(f)
        })
        .collect::<Result<_>>()?;
    let buf = filled_buffer(piece);
    let start = Instant::now();
    write_in_parallel(in_flight, rounds * files as u64, |i| {
        let (file, round) = ((i % files as u64) as usize, i / files as u64);
        handles[file].write_all_at(buf.as_slice(), round * piece as u64)
    })?;
    // As the store does for many files: one syncfs rather than an fdatasync per file.
    if let Some(f) = handles.first() {
        // SAFETY: syncfs on a valid open descriptor.
        if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
    }
    let secs = start.elapsed().as_secs_f64();
    drop(handles);
    let _ = std::fs::remove_dir_all(&sub);
    Ok((rounds * files as u64 * piece as u64) as f64 / secs)
}

/// Seconds this disk takes to read `read_bytes` and write `write_bytes` at the same time: O_DIRECT
/// requests of 1 MiB, `in_flight` reads and `in_flight` writes outstanding, then one fdatasync.
/// Both go to one file written in full beforehand (not timed), as a store that reuses its
/// segments reads and writes blocks written before. The reads and writes overlap perfectly here,
/// so no program doing this I/O on this disk finishes sooner (within the disk's drift).
fn mixed_io_seconds(
    dir: &Path,
    read_bytes: u64,
    write_bytes: u64,
    in_flight: usize,
) -> Result<f64> {
    const PIECE: u64 = 1 << 20;
    let mode = ramlog_backup::io::probe_direct(dir);
    let path = dir.join("mixed.bin");
    let _ = std::fs::remove_file(&path);
    let reads = read_bytes.div_ceil(PIECE).max(1);
    let writes = write_bytes.div_ceil(PIECE).max(1);
    let f = open_log(&path, mode, true)?;
    preallocate(&f, 0, (reads + writes) * PIECE)?;
    let buf = filled_buffer(PIECE as usize);
    write_in_parallel(4, reads + writes, |i| {
        f.write_all_at(buf.as_slice(), i * PIECE)
    })?;
    f.sync_data()?;
    // One read buffer per reader: a reader takes whichever is free.
    let read_bufs: Vec<std::sync::Mutex<AlignedBuf>> = (0..in_flight)
        .map(|_| std::sync::Mutex::new(filled_buffer(PIECE as usize)))
        .collect();
    let start = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let reader = s.spawn(|| {
            write_in_parallel(in_flight, reads, |i| {
                let mut b = loop {
                    if let Some(g) = read_bufs.iter().find_map(|m| m.try_lock().ok()) {
                        break g;
                    }
                    std::thread::yield_now();
                };
                let n = ramlog_backup::io::read_exact_at(
                    &f,
                    &mut b.full_mut()[..PIECE as usize],
                    i * PIECE,
                )?;
                if n as u64 != PIECE {
                    return Err(std::io::Error::other("short read in the mixed probe"));
                }
                Ok(())
            })
        });
        write_in_parallel(in_flight, writes, |i| {
            f.write_all_at(buf.as_slice(), (reads + i) * PIECE)
        })?;
        f.sync_data()?;
        reader
            .join()
            .map_err(|_| anyhow::anyhow!("the probe's reader panicked"))??;
        Ok(())
    })?;
    let secs = start.elapsed().as_secs_f64();
    drop(f);
    let _ = std::fs::remove_file(&path);
    Ok(secs)
}

/// Logs `count` entries of `size` bytes (key + value) in batches of 10; returns entries/s,
/// measured until everything is durable, and the mean secondary-log write in bytes. The tablets'
/// files are created before the clock starts, as the raw baseline's file is (a server opens its
/// tablets at start).
fn log_throughput(
    dir: &Path,
    cfg: Config,
    size: usize,
    spread: Spread,
    count: u64,
) -> Result<(f64, f64)> {
    let b = Backup::open(dir, cfg)?;
    b.open_tablets(match spread {
        Spread::One => 0..1,
        Spread::RoundRobin | Spread::Random => 0..256,
    })?;
    let value = vec![0x5Au8; size - KEY_BYTES];
    let mut keys = [[0u8; KEY_BYTES]; 10];
    let mut rng = rand::rngs::SmallRng::seed_from_u64(size as u64);
    let start = Instant::now();
    let mut id = 0u64;
    let mut batch_no = 0u64;
    while id < count {
        let tablet = match spread {
            Spread::One => 0,
            Spread::RoundRobin => batch_no % 256,
            Spread::Random => rng.gen_range(0..256),
        };
        for (i, k) in keys.iter_mut().enumerate() {
            fill_key(k, id + i as u64);
        }
        let entries: [Entry<'_>; 10] = std::array::from_fn(|i| Entry {
            key: &keys[i],
            value: Some(&value),
            version: id + i as u64 + 1,
            expiry: 0,
        });
        b.append(tablet, &entries)?;
        id += 10;
        batch_no += 1;
    }
    b.flush()?;
    let secs = start.elapsed().as_secs_f64();
    let stats = b.stats();
    drop(b);
    let mean_write = stats.secondary_bytes as f64 / stats.secondary_writes.max(1) as f64;
    Ok((count as f64 / secs, mean_write))
}

fn throughput_config() -> Config {
    Config {
        reorg_enabled: false,
        tablet_log_capacity_bytes: 8 << 30,
        ..Config::default()
    }
}

/// Write-buffer regime of a two-level run: the buffer and the size at which a flush starts.
#[derive(Clone, Copy)]
struct Scatter {
    /// Row-name prefix after `two_level/`.
    prefix: &'static str,
    buffer_bytes: usize,
    flush_bytes: usize,
    /// Whether the issue's ≥ 2× target applies to this regime.
    target: bool,
}

const SCATTER_REGIMES: [Scatter; 2] = [
    // DXRAM's Fig. 16 regime (B7(b)): a 512 KiB write buffer flushed from 256 KiB, so a flush
    // never holds more than 2 KiB per tablet, 1/64 of the secondary-log buffer.
    Scatter {
        prefix: "",
        buffer_bytes: 512 << 10,
        flush_bytes: 256 << 10,
        target: true,
    },
    // A 4 MiB buffer flushed from 512 KiB: flushes grow while the writer is busy, to about
    // 16 KiB per tablet, half the 32 KiB direct threshold (DXRAM's B7(a) side).
    Scatter {
        prefix: "buffer_4MiB/",
        buffer_bytes: 4 << 20,
        flush_bytes: 512 << 10,
        target: false,
    },
];

/// Small scattered batches over 256 tablets: 64 B entries, one batch of 10 per random tablet.
fn scattered(
    dir: &Path,
    two_level: bool,
    regime: Scatter,
    count: u64,
) -> Result<(f64, ramlog_backup::Stats)> {
    let cfg = Config {
        two_level,
        reorg_enabled: false,
        tablet_log_capacity_bytes: 1 << 30,
        write_buffer_bytes: regime.buffer_bytes,
        write_buffer_chunks: 2,
        flush_threshold_bytes: regime.flush_bytes,
        // A chunk of the small buffer must hold the largest entry: 64 KiB values (these are 56 B).
        value_max_bytes: 64 << 10,
        ..Config::default()
    };
    let b = Backup::open(dir, cfg)?;
    b.open_tablets(0..256)?;
    let value = vec![0x33u8; 64 - KEY_BYTES];
    let mut keys = [[0u8; KEY_BYTES]; 10];
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let start = Instant::now();
    let mut n = 0u64;
    while n < count {
        let tablet = rng.gen_range(0..256u64);
        let first = rng.gen_range(0..1u64 << 32);
        for (i, k) in keys.iter_mut().enumerate() {
            fill_key(k, first + i as u64);
        }
        let entries: [Entry<'_>; 10] = std::array::from_fn(|i| Entry {
            key: &keys[i],
            value: Some(&value),
            version: n + i as u64 + 1,
            expiry: 0,
        });
        b.append(tablet, &entries)?;
        n += 10;
    }
    b.flush()?;
    let secs = start.elapsed().as_secs_f64();
    let stats = b.stats();
    drop(b);
    Ok((count as f64 / secs, stats))
}

#[derive(Clone, Copy, Debug)]
enum Pattern {
    Sequential,
    Uniform,
    Zipf,
    HotCold,
}

impl Pattern {
    fn name(self) -> &'static str {
        match self {
            Pattern::Sequential => "sequential",
            Pattern::Uniform => "uniform",
            Pattern::Zipf => "zipf",
            Pattern::HotCold => "hotcold",
        }
    }
}

struct ReorgRun {
    entries_per_s: f64,
    max_utilisation: f64,
    mean_utilisation: f64,
    freed_per_segment: f64,
    segments_cleaned: u64,
    /// Of those, freed without being read (every entry known superseded or deleted).
    segments_unread: u64,
    /// Placement notes a tablet dropped because too many waited for the reorganizer.
    notes_dropped: u64,
    urgent: u64,
    /// Share of the measured phase the processor spent waiting for the cleaner (throttle).
    throttle_share: f64,
    /// Entries appended in the measured phase.
    updates: u64,
    /// Process CPU time (user + system, every thread) over the measured phase.
    cpu_secs: f64,
    /// Bytes the store read (reorganization) and wrote (logs, version logs, reorganization)
    /// during the measured phase.
    disk_read: u64,
    disk_written: u64,
    /// Of `disk_written`: version logs (spills and compactions), and the reorganizer's copies.
    version_written: u64,
    reorg_written: u64,
}

/// Phase 1 loads every key once (not measured); phase 2 applies 2× as many updates in batches of
/// 10 consecutive keys chosen by the pattern (DXRAM §9.5). Utilisation is sampled every 20 ms.
fn reorg_run(
    dir: &Path,
    pattern: Pattern,
    reorg: bool,
    tablets: u64,
    keys_per_tablet: u64,
    segment_bytes: u64,
    capacity: u64,
) -> Result<ReorgRun> {
    let cfg = Config {
        reorg_enabled: reorg,
        segment_bytes,
        tablet_log_capacity_bytes: if reorg { capacity } else { capacity * 8 },
        version_buffer_entries: 1 << 15,
        // About 1/64 of a log's capacity per tablet per flush.
        write_buffer_bytes: (capacity / 64 * tablets).max(4 << 20) as usize,
        write_buffer_chunks: 2,
        flush_threshold_bytes: (capacity / 64 * tablets / 2).max(1 << 20) as usize,
        secondary_buffer_bytes: 16 << 10,
        direct_threshold_bytes: 16 << 10,
        primary_log_bytes: 64 << 20,
        // RAMLOG_BENCH_BACKUP_STRATEGY=cost-benefit|random compares selection strategies.
        reorg_strategy: match std::env::var("RAMLOG_BENCH_BACKUP_STRATEGY").as_deref() {
            Ok("cost-benefit") => ramlog_backup::SegmentStrategy::CostBenefit,
            Ok("random") => ramlog_backup::SegmentStrategy::Random,
            _ => ramlog_backup::SegmentStrategy::AgeTimesUtilisation,
        },
        // RAMLOG_BENCH_BACKUP_REORG_THREADS=n overrides the number of reorganizer threads.
        reorg_threads: std::env::var("RAMLOG_BENCH_BACKUP_REORG_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(Config::default().reorg_threads),
        ..Config::default()
    };
    let b = std::sync::Arc::new(Backup::open(dir, cfg)?);
    let value = vec![0x77u8; 64 - KEY_BYTES];
    let total_keys = tablets * keys_per_tablet;
    let mut version = 0u64;
    let mut keys = [[0u8; KEY_BYTES]; 10];
    let mut append_batch = |b: &Backup, first: u64, version: &mut u64| -> Result<()> {
        let tablet = first / keys_per_tablet;
        let local = first % keys_per_tablet;
        let start = if local + 10 > keys_per_tablet {
            keys_per_tablet - 10
        } else {
            local
        };
        for (i, k) in keys.iter_mut().enumerate() {
            fill_key(k, tablet * keys_per_tablet + start + i as u64);
        }
        let base = *version;
        *version += 10;
        let entries: [Entry<'_>; 10] = std::array::from_fn(|i| Entry {
            key: &keys[i],
            value: Some(&value),
            version: base + i as u64 + 1,
            expiry: 0,
        });
        b.append(tablet, &entries)?;
        Ok(())
    };
    // Phase 1: load.
    let mut k = 0;
    while k < total_keys {
        append_batch(&b, k, &mut version)?;
        k += 10;
    }
    b.flush()?;
    // Phase 2: updates, with a utilisation sampler.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (b, stop) = (b.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                samples.push(b.stats().max_utilisation);
                std::thread::sleep(Duration::from_millis(20));
            }
            samples
        })
    };
    let before = b.stats();
    let zipf = Zipf::new(total_keys, 0.99);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(42);
    let hot: Vec<u64> = (0..total_keys)
        .filter(|&i| scramble(i ^ 0xABCD).is_multiple_of(10))
        .collect();
    let cold: Vec<u64> = (0..total_keys)
        .filter(|&i| !scramble(i ^ 0xABCD).is_multiple_of(10))
        .collect();
    let updates = 2 * total_keys;
    let cpu_started = crate::util::process_cpu_secs();
    let start = Instant::now();
    let mut done = 0u64;
    let mut seq = 0u64;
    while done < updates {
        let first = match pattern {
            Pattern::Sequential => {
                let f = seq % total_keys;
                seq += 10;
                f
            }
            Pattern::Uniform => rng.gen_range(0..total_keys),
            Pattern::Zipf => scramble(zipf.sample(&mut rng)) % total_keys,
            Pattern::HotCold => {
                if rng.gen_bool(0.9) {
                    hot[rng.gen_range(0..hot.len())]
                } else {
                    cold[rng.gen_range(0..cold.len())]
                }
            }
        };
        append_batch(&b, first, &mut version)?;
        done += 10;
    }
    b.flush()?;
    let secs = start.elapsed().as_secs_f64();
    let cpu_secs = crate::util::process_cpu_secs() - cpu_started;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let samples = sampler
        .join()
        .map_err(|_| anyhow::anyhow!("sampler panicked"))?;
    let after = b.stats();
    let written = |s: &ramlog_backup::Stats| {
        s.primary_bytes + s.secondary_bytes + s.version_bytes + s.reorg_bytes_written
    };
    let cleaned = after.reorg_segments_cleaned - before.reorg_segments_cleaned;
    let freed = after.reorg_bytes_freed - before.reorg_bytes_freed;
    let run = ReorgRun {
        entries_per_s: updates as f64 / secs,
        max_utilisation: samples
            .iter()
            .copied()
            .fold(after.max_utilisation, f64::max),
        mean_utilisation: if samples.is_empty() {
            after.max_utilisation
        } else {
            samples.iter().sum::<f64>() / samples.len() as f64
        },
        freed_per_segment: if cleaned > 0 {
            freed as f64 / cleaned as f64
        } else {
            0.0
        },
        segments_cleaned: cleaned,
        segments_unread: after.reorg_segments_unread - before.reorg_segments_unread,
        notes_dropped: after.notes_dropped - before.notes_dropped,
        urgent: after.urgent_requests - before.urgent_requests,
        throttle_share: (after.throttle_wait_ms - before.throttle_wait_ms) as f64 / 1e3 / secs,
        updates,
        cpu_secs,
        disk_read: after.reorg_bytes_read - before.reorg_bytes_read,
        disk_written: written(&after) - written(&before),
        version_written: after.version_bytes - before.version_bytes,
        reorg_written: after.reorg_bytes_written - before.reorg_bytes_written,
    };
    drop(b);
    Ok(run)
}

/// Builds one tablet log of about `log_bytes` of 64 B entries (10% superseded, 1% deleted),
/// reopens it and times a replay. Returns (seconds, live keys, bytes read).
fn replay_run(dir: &Path, log_bytes: u64) -> Result<(f64, u64, u64, bool)> {
    let cfg = Config {
        reorg_enabled: false,
        tablet_log_capacity_bytes: 2 * log_bytes + (64 << 20),
        ..Config::default()
    };
    // 64 B entries (key and value) at a version of about 2^22, no expiry.
    let entry_disk =
        ramlog_backup::format::entry_bytes(KEY_BYTES, 64 - KEY_BYTES, 1 << 22, 0) as u64;
    let total = log_bytes / entry_disk;
    let keys = total * 100 / 111; // keys + 10% updates + 1% deletes ≈ total
    {
        let b = Backup::open(dir, cfg.clone())?;
        let value = vec![0x42u8; 64 - KEY_BYTES];
        let mut key = [0u8; KEY_BYTES];
        let mut version = 0u64;
        let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
        let mut batch: Vec<([u8; KEY_BYTES], bool)> = Vec::with_capacity(10);
        let flush = |b: &Backup,
                     batch: &mut Vec<([u8; KEY_BYTES], bool)>,
                     version: &mut u64|
         -> Result<()> {
            let entries: Vec<Entry<'_>> = batch
                .iter()
                .map(|(k, del)| {
                    *version += 1;
                    Entry {
                        key: k,
                        value: if *del { None } else { Some(&value) },
                        version: *version,
                        expiry: 0,
                    }
                })
                .collect();
            b.append(0, &entries)?;
            batch.clear();
            Ok(())
        };
        for id in 0..keys {
            fill_key(&mut key, id);
            batch.push((key, false));
            // 10% of keys get a newer version, 1% are deleted (later, so the first copy is stale).
            if id >= 1000 && rng.gen_bool(0.10) {
                fill_key(&mut key, rng.gen_range(0..id));
                batch.push((key, false));
            }
            if id >= 1000 && rng.gen_bool(0.01) {
                fill_key(&mut key, rng.gen_range(0..id));
                batch.push((key, true));
            }
            if batch.len() >= 10 {
                flush(&b, &mut batch, &mut version)?;
            }
        }
        if !batch.is_empty() {
            flush(&b, &mut batch, &mut version)?;
        }
        b.close()?;
    }
    // Cold cache: segments are read with O_DIRECT; also ask the kernel to drop its caches.
    let dropped = std::fs::write("/proc/sys/vm/drop_caches", "1").is_ok();
    let b = Backup::open(dir, cfg)?;
    let start = Instant::now();
    let mut live = 0u64;
    let mut checksum = 0u64;
    let report = b.replay(0, |e| {
        live += 1;
        checksum = checksum.wrapping_add(e.version ^ e.value.len() as u64);
    })?;
    let secs = start.elapsed().as_secs_f64();
    anyhow::ensure!(
        report.is_clean() && report.live_keys == live,
        "replay was not clean: {report:?}"
    );
    std::hint::black_box(checksum);
    Ok((secs, live, report.bytes_read, dropped))
}

pub fn run(quick: bool, json: Option<&Path>) -> Result<()> {
    let root = bench_root()?;
    let _cleanup = Scratch(root.clone());
    let mut report = Report::new("backup", quick);

    // Baseline: raw sequential O_DIRECT write bandwidth on this disk.
    let raw_bytes: u64 = if quick { 256 << 20 } else { 1 << 30 };
    let (raw, mode) = raw_bandwidth(&root, raw_bytes, if quick { 2 } else { 3 })?;
    println!(
        "backup bench: data in {}; I/O mode {}",
        root.display(),
        mode.name()
    );
    report.push(Row::plain("raw_sequential_write_MBps", raw / 1e6, "MB/s"));
    let raw_mbps = raw / 1e6;

    // RAMLOG_BENCH_BACKUP_GROUPS=memory,log,two_level,reorg,replay,commit runs a subset (for
    // development).
    let groups = std::env::var("RAMLOG_BENCH_BACKUP_GROUPS")
        .unwrap_or_else(|_| "memory,log,two_level,reorg,replay,commit".into());
    let want = |g: &str| groups.split(',').any(|x| x.trim() == g);
    // RAMLOG_BENCH_BACKUP_ROWS=512B/1tablet keeps only logging rows whose name contains it.
    let rows = std::env::var("RAMLOG_BENCH_BACKUP_ROWS").unwrap_or_default();

    // 5. Memory, first: the rows compare RSS figures, best taken while the heap holds nothing
    // of earlier rows.
    if want("memory") {
        let keys: u64 = if quick { 200_000 } else { 2_000_000 };
        let budget = 256u64 << 20;
        for (label, cfg) in [
            ("budget_256MiB", Config::for_memory_budget(budget)),
            ("default", Config::default()),
        ] {
            let s = Scratch::new(&root, "memory")?;
            let m = memory_run(&s.0, cfg, keys)?;
            drop(s);
            println!(
                "memory/{label}: empty store {:.1} MiB RSS; before logging {:?}; busy peak {:?}; at rest after {keys} keys {:?}",
                m.fixed_rss as f64 / (1 << 20) as f64,
                m.before,
                m.busy_peak,
                m.at_rest
            );
            report.push(Row::plain(
                format!("memory/{label}/fixed_rss_MiB"),
                m.fixed_rss as f64 / (1 << 20) as f64,
                "MiB",
            ));
            report.push(Row::plain(
                format!("memory/{label}/accounted_fixed_MiB"),
                m.before.total() as f64 / (1 << 20) as f64,
                "MiB",
            ));
            report.push(Row::plain(
                format!("memory/{label}/busy_accounted_peak_MiB"),
                m.busy_peak.total() as f64 / (1 << 20) as f64,
                "MiB",
            ));
            let per_key = |delta: i64| delta as f64 / keys as f64;
            // The target is judged at 2 M keys: a quick run's 200 k keys spread what stays
            // bounded but not empty at rest (secondary-log buffers, up to 2 MiB at this budget,
            // and heap the allocator keeps) over too few keys to say anything per key.
            let judged = |row: Row| {
                if quick {
                    row
                } else {
                    row.with_target(Target::at_most(16.0))
                }
            };
            report.push(judged(Row::plain(
                format!("memory/{label}/rss_per_key_at_rest_B"),
                per_key(m.rest_rss as i64 - m.before_rss as i64),
                "B/key",
            )));
            report.push(judged(Row::plain(
                format!("memory/{label}/accounted_per_key_at_rest_B"),
                per_key(m.at_rest.total() as i64 - m.before.total() as i64),
                "B/key",
            )));
        }
    }

    // 6. Durable group commits against the bare write + fdatasync loop.
    if want("commit") {
        let secs = if quick { 1.0 } else { 2.0 };
        let reps = if quick { 1 } else { 3 };
        for appenders in [1usize, 4] {
            let mut pairs: Vec<(CommitRun, f64)> = Vec::new();
            for _ in 0..reps {
                let scratch = Scratch::new(&root, "commit")?;
                let run = commit_run(&scratch.0, appenders, secs)?;
                drop(scratch);
                let bare = bare_commits(&root, run.block_bytes, secs, true)?;
                pairs.push((run, bare));
            }
            pairs.sort_by(|a, b| (a.0.commits_per_s / a.1).total_cmp(&(b.0.commits_per_s / b.1)));
            let (run, bare) = pairs.swap_remove(pairs.len() / 2);
            let name = format!("commit/{appenders}_appenders");
            report.push(Row::versus(
                format!("{name}/durable_commits_per_s_vs_bare"),
                run.commits_per_s,
                "commits/s",
                bare,
            ));
            report.push(Row::plain(
                format!("{name}/mean_wait_us"),
                run.mean_wait_us,
                "us",
            ));
            report.push(Row::plain(
                format!("{name}/entries_per_sync"),
                run.entries_per_sync,
                "entries",
            ));
            report.push(Row::plain(
                format!("{name}/block_bytes"),
                run.block_bytes as f64,
                "bytes",
            ));
            if appenders == 1 {
                let unwritten = bare_commits(&root, run.block_bytes, secs, false)?;
                report.push(Row::versus(
                    "commit/bare_through_preallocated_per_s",
                    unwritten,
                    "syncs/s",
                    bare,
                ));
            }
        }
    }

    // 1. Logging throughput.
    let bytes_per_row: u64 = if quick { 48 << 20 } else { 512 << 20 };
    let log_reps = if quick { 1 } else { 3 };
    for size in [64usize, 128, 512, 4096] {
        if !want("log") {
            continue;
        }
        for spread in [Spread::One, Spread::RoundRobin, Spread::Random] {
            if !format!("log/{size}B/{}", spread.name()).contains(&rows) {
                continue;
            }
            // Raw writes and logging runs alternate, the same number of bytes each; the pair
            // with the median ratio is reported (this disk's bandwidth drifts by 2x within
            // minutes, so a baseline measured once at the start does not describe a later row).
            let count = (bytes_per_row / size as u64).max(1000) / 10 * 10;
            let mut pairs: Vec<(f64, f64, f64)> = Vec::new();
            // O_DIRECT writes whole pages: round the raw volume up to a MiB.
            let raw_bytes = (count * size as u64).next_multiple_of(1 << 20);
            for _ in 0..log_reps {
                let (raw_pair, _) = raw_bandwidth(&root, raw_bytes, 1)?;
                let scratch = Scratch::new(&root, "log")?;
                let (eps, mean_write) =
                    log_throughput(&scratch.0, throughput_config(), size, spread, count)?;
                pairs.push((raw_pair / 1e6, eps, mean_write));
            }
            pairs.sort_by(|a, b| (a.1 / a.0).total_cmp(&(b.1 / b.0)));
            let (raw_pair, eps, mean_write) = pairs[pairs.len() / 2];
            let name = format!("log/{size}B/{}", spread.name());
            let mbps = eps * size as f64 / 1e6;
            if size == 64 {
                report.push(
                    Row::plain(format!("{name}/entries_per_s"), eps, "ent/s")
                        .with_target(Target::at_least(1.5e6)),
                );
            } else {
                report.push(Row::plain(format!("{name}/entries_per_s"), eps, "ent/s"));
            }
            let row = Row::versus(format!("{name}/MBps_vs_raw"), mbps, "MB/s", raw_pair);
            report.push(if size >= 512 {
                row.with_target(Target::at_least(0.75))
            } else {
                row
            });
            if size >= 512 && !matches!(spread, Spread::One) {
                // The disk's own rate for this row's write pattern: 256 fresh files written
                // round-robin in requests of the row's mean secondary write, as many in flight as
                // the store's I/O threads, as many bytes as the row logged.
                let same = pattern_bandwidth(
                    &root,
                    256,
                    mean_write as usize,
                    raw_bytes,
                    throughput_config().io_threads,
                )?;
                report.push(Row::plain(
                    format!("{name}/mean_write_KiB"),
                    mean_write / 1024.0,
                    "KiB",
                ));
                report.push(Row::versus(
                    format!("{name}/MBps_vs_pattern_raw"),
                    mbps,
                    "MB/s",
                    same / 1e6,
                ));
            }
        }
    }

    // 2. Two-level logging on vs off, small scattered batches over 256 tablets, in two write-buffer
    // regimes. Off and on alternate (3 pairs in a full run); the pair with the median ratio is
    // reported.
    let scattered_count: u64 = if quick { 600_000 } else { 4_000_000 };
    let pairs_wanted = if quick { 1 } else { 3 };
    let regimes: &[Scatter] = if want("two_level") {
        &SCATTER_REGIMES
    } else {
        &[]
    };
    for &regime in regimes {
        let mut pairs = Vec::new();
        for _ in 0..pairs_wanted {
            let off = {
                let s = Scratch::new(&root, "off")?;
                scattered(&s.0, false, regime, scattered_count)?
            };
            let on = {
                let s = Scratch::new(&root, "on")?;
                scattered(&s.0, true, regime, scattered_count)?
            };
            pairs.push((off, on));
        }
        pairs.sort_by(|a, b| (a.1 .0 / a.0 .0).total_cmp(&(b.1 .0 / b.0 .0)));
        let ((off, off_stats), (on, on_stats)) = pairs.swap_remove(pairs.len() / 2);
        let name = |row: &str| format!("two_level/{}{row}", regime.prefix);
        for (mode, rate) in [("off", off), ("on", on)] {
            report.push(Row::versus(
                name(&format!("{mode}/entries_per_s")),
                rate,
                "ent/s",
                raw_mbps * 1e6 / 64.0,
            ));
        }
        let ratio = Row::versus(name("on_vs_off"), on, "ent/s", off);
        report.push(if regime.target {
            ratio.with_target(Target::at_least(2.0))
        } else {
            ratio
        });
        let avg_write = |s: &ramlog_backup::Stats| {
            (s.primary_bytes + s.secondary_bytes) as f64
                / (s.primary_writes + s.secondary_writes).max(1) as f64
                / 1024.0
        };
        for (mode, stats) in [("off", &off_stats), ("on", &on_stats)] {
            report.push(Row::plain(
                name(&format!("{mode}/avg_write_KiB")),
                avg_write(stats),
                "KiB",
            ));
        }
        // What each mode moved to the disk per second, against raw sequential writes of as many
        // bytes as "on" wrote, measured right after. "On" writes every entry to the primary log
        // and again to its secondary log, so even at the raw bandwidth it cannot log more than
        // raw / (its bytes per entry) entries per second: that over "off"'s rate bounds the
        // on/off ratio this disk allows, whatever the CPU does.
        let disk_bytes = |s: &ramlog_backup::Stats| {
            (s.primary_bytes + s.secondary_bytes + s.version_bytes) as f64
        };
        let (raw_now, _) = raw_bandwidth(
            &root,
            (disk_bytes(&on_stats) as u64).next_multiple_of(1 << 20),
            1,
        )?;
        let raw_now_mbps = raw_now / 1e6;
        for (mode, rate, stats) in [("off", off, &off_stats), ("on", on, &on_stats)] {
            let per_entry = disk_bytes(stats) / scattered_count as f64;
            report.push(Row::versus(
                name(&format!("{mode}/disk_MBps_vs_raw")),
                rate * per_entry / 1e6,
                "MB/s",
                raw_now_mbps,
            ));
        }
        let on_per_entry = disk_bytes(&on_stats) / scattered_count as f64;
        report.push(Row::plain(
            name("on_vs_off_disk_bound"),
            raw_now / on_per_entry / off,
            "ratio",
        ));
    }

    // 3. Reorganization under update patterns.
    let (tablets, segment, capacity) = if quick {
        (2u64, 256u64 << 10, 16u64 << 20)
    } else {
        (8u64, 1u64 << 20, 64u64 << 20)
    };
    // Live data ≈ 45% of the log capacity (DXRAM: a 256 MB zone in a 512 MB log).
    // 64 B entries (key and value) at a version of about 2^22, no expiry.
    let entry_disk =
        ramlog_backup::format::entry_bytes(KEY_BYTES, 64 - KEY_BYTES, 1 << 22, 0) as u64;
    let keys_per_tablet = capacity * 45 / 100 / entry_disk / 10 * 10;
    let reorg_reps = if quick { 1 } else { 3 };
    for pattern in [
        Pattern::Sequential,
        Pattern::Uniform,
        Pattern::Zipf,
        Pattern::HotCold,
    ] {
        if !want("reorg") || !format!("reorg/{}", pattern.name()).contains(&rows) {
            continue;
        }
        // Base and reorganizing runs alternate; the pair with the median ratio is reported
        // (the shared machine's speed drifts between runs).
        let mut pairs: Vec<(ReorgRun, ReorgRun)> = Vec::new();
        let one = |reorg: bool| -> Result<ReorgRun> {
            let s = Scratch::new(&root, if reorg { "reorg" } else { "noreorg" })?;
            reorg_run(
                &s.0,
                pattern,
                reorg,
                tablets,
                keys_per_tablet,
                segment,
                capacity,
            )
        };
        for _ in 0..reorg_reps {
            pairs.push((one(false)?, one(true)?));
        }
        pairs.sort_by(|a, b| {
            (a.1.entries_per_s / a.0.entries_per_s)
                .total_cmp(&(b.1.entries_per_s / b.0.entries_per_s))
        });
        let (base, run) = pairs.swap_remove(pairs.len() / 2);
        let max_utilisation = pairs
            .iter()
            .map(|p| p.1.max_utilisation)
            .fold(run.max_utilisation, f64::max);
        let name = format!("reorg/{}", pattern.name());
        report.push(
            Row::plain(format!("{name}/max_utilisation"), max_utilisation, "frac")
                .with_target(Target::at_most(0.80)),
        );
        report.push(Row::plain(
            format!("{name}/mean_utilisation"),
            run.mean_utilisation,
            "frac",
        ));
        report.push(
            Row::versus(
                format!("{name}/entries_per_s_vs_no_reorg"),
                run.entries_per_s,
                "ent/s",
                base.entries_per_s,
            )
            .with_target(Target::at_least(0.4)),
        );
        report.push(Row::versus(
            format!("{name}/MBps_vs_raw"),
            run.entries_per_s * 64.0 / 1e6,
            "MB/s",
            raw_mbps,
        ));
        report.push(Row::plain(
            format!("{name}/freed_per_segment_KiB"),
            run.freed_per_segment / 1024.0,
            "KiB",
        ));
        report.push(Row::plain(
            format!("{name}/segments_cleaned"),
            run.segments_cleaned as f64,
            "segs",
        ));
        report.push(Row::plain(
            format!("{name}/segments_unread"),
            run.segments_unread as f64,
            "segs",
        ));
        report.push(Row::plain(
            format!("{name}/notes_dropped"),
            run.notes_dropped as f64,
            "count",
        ));
        report.push(Row::plain(
            format!("{name}/urgent_requests"),
            run.urgent as f64,
            "count",
        ));
        report.push(Row::versus(
            format!("{name}/cpu_ns_per_entry"),
            run.cpu_secs * 1e9 / run.updates as f64,
            "ns",
            base.cpu_secs * 1e9 / base.updates as f64,
        ));
        report.push(Row::plain(
            format!("{name}/throttle_wait_share"),
            run.throttle_share,
            "frac",
        ));
        // The disk's own limit: the reported run's reads and writes, done by the disk at once
        // with nothing else to do, measured now. Its rate over the run without reorganization
        // bounds the ratio above on this disk, whatever the store's threads do.
        let io_secs = mixed_io_seconds(&root, run.disk_read, run.disk_written, 4)?;
        report.push(Row::plain(
            format!("{name}/disk_read_MiB"),
            run.disk_read as f64 / (1 << 20) as f64,
            "MiB",
        ));
        report.push(Row::plain(
            format!("{name}/disk_written_MiB"),
            run.disk_written as f64 / (1 << 20) as f64,
            "MiB",
        ));
        report.push(Row::plain(
            format!("{name}/version_written_MiB"),
            run.version_written as f64 / (1 << 20) as f64,
            "MiB",
        ));
        report.push(Row::plain(
            format!("{name}/reorg_written_MiB"),
            run.reorg_written as f64 / (1 << 20) as f64,
            "MiB",
        ));
        report.push(Row::versus(
            format!("{name}/disk_bound_vs_no_reorg"),
            run.updates as f64 / io_secs,
            "ent/s",
            base.entries_per_s,
        ));
    }

    // 4. Replay of one 256 MiB tablet log of 64 B entries, cold cache.
    let log_bytes: u64 = if quick { 48 << 20 } else { 256 << 20 };
    if want("replay") {
        let s = Scratch::new(&root, "replay")?;
        let (secs, live, bytes, dropped) = replay_run(&s.0, log_bytes)?;
        drop(s);
        if !dropped {
            println!(
                "note: could not drop the page cache; segment reads use O_DIRECT (cold) regardless"
            );
        }
        let label = if quick {
            "replay/48MiB_64B"
        } else {
            "replay/256MiB_64B"
        };
        report.push(
            Row::plain(format!("{label}/seconds"), secs, "s").with_target(Target::at_most(1.0)),
        );
        report.push(Row::plain(
            format!("{label}/live_keys"),
            live as f64,
            "keys",
        ));
        report.push(Row::versus(
            format!("{label}/read_MBps_vs_raw_write"),
            bytes as f64 / secs / 1e6,
            "MB/s",
            raw_mbps,
        ));
    }

    report.finish(json)
}
