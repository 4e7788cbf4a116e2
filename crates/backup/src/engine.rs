//! The flush pipeline: a processor thread drains the write buffer, sorts entries by tablet and
//! decides primary vs secondary (two-level logging); a writer thread issues the block writes to
//! its I/O threads (`iopool`); a finisher thread applies versions to the version buffers, spills
//! them, syncs, and publishes progress. Sorting of one flush overlaps with the disk writes of the previous one (DXRAM's
//! BufferProcessingThread and WriterThread), and the writes of one flush with the sync and version
//! spills of the previous one.

use crate::format::{self, BlockHeader, BLOCK_HEADER_BYTES, PAGE_BYTES};
use crate::io::{self, AlignedBuf, IoMode};
use crate::iopool::IoPool;
use crate::tablet::{BlockBuf, BlockWrite, Blocks, Tablet};
use crate::wbuf::{Chunk, Taken, WriteBuffer};
use crate::{Config, Error, Result, SyncPolicy};
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A pool of page-aligned buffers in power-of-two size classes, so that steady-state flushes
/// neither allocate nor zero fresh memory. Bounded by `limit_bytes` (`Config::pool_bytes`).
pub struct BufPool {
    free: Mutex<(Vec<Vec<AlignedBuf>>, usize)>,
    limit_bytes: usize,
    /// Bytes of buffers handed out by `get` and not yet put back (flushes in flight).
    lent_bytes: AtomicU64,
    /// New buffers of 2 MiB and more are backed by transparent huge pages (`AlignedBuf::huge`).
    huge: bool,
}

impl BufPool {
    pub fn new(limit_bytes: usize) -> BufPool {
        BufPool {
            free: Mutex::new(((0..40).map(|_| Vec::new()).collect(), 0)),
            limit_bytes,
            lent_bytes: AtomicU64::new(0),
            huge: true,
        }
    }

    /// A pool whose new buffers have 4 KiB pages: for buffers that may be used only once or a
    /// few times (a replay's segments), whose first touch costs more with fresh huge pages on
    /// this virtual machine (see `AlignedBuf::huge`).
    pub fn with_small_pages(limit_bytes: usize) -> BufPool {
        BufPool {
            huge: false,
            ..BufPool::new(limit_bytes)
        }
    }
    fn class(len: usize) -> usize {
        len.max(PAGE_BYTES).next_power_of_two().trailing_zeros() as usize
    }
    pub fn get(&self, len: usize) -> AlignedBuf {
        let c = Self::class(len);
        self.lent_bytes.fetch_add(1 << c, Ordering::Relaxed);
        let mut g = self.free.lock();
        if let Some(mut b) = g.0[c].pop() {
            g.1 -= b.capacity();
            b.set_len(0);
            return b;
        }
        drop(g);
        if self.huge {
            AlignedBuf::huge(1usize << c)
        } else {
            AlignedBuf::new(1usize << c)
        }
    }

    /// Fills the pool with `count` buffers for blocks of up to `len` bytes, touched now, so that
    /// the first flushes find memory already faulted in (DXRAM allocates its pooled buffers at
    /// start). Stops at the pool's bound.
    pub fn warm(&self, len: usize, count: usize) {
        let cap = 1usize << Self::class(len);
        let room = self.limit_bytes.saturating_sub(self.free.lock().1) / cap;
        for _ in 0..count.min(room) {
            let mut buf = AlignedBuf::huge(cap);
            buf.touch();
            self.lent_bytes.fetch_add(cap as u64, Ordering::Relaxed);
            self.put(buf);
        }
    }

    pub fn put(&self, buf: AlignedBuf) {
        let c = Self::class(buf.capacity());
        if buf.capacity() != 1usize << c {
            return;
        }
        // Saturating: a buffer the pool did not hand out may come back (never in this crate).
        let _ = self
            .lent_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
                Some(l.saturating_sub(buf.capacity() as u64))
            });
        let mut g = self.free.lock();
        if g.1 + buf.capacity() <= self.limit_bytes {
            g.1 += buf.capacity();
            g.0[c].push(buf);
        }
    }

    /// Frees pooled buffers, smallest first (the arenas warmed at open are the largest), until
    /// the pool keeps at most `keep_bytes`.
    pub fn trim(&self, keep_bytes: usize) {
        let mut dropped = Vec::new();
        {
            let mut g = self.free.lock();
            for c in 0..g.0.len() {
                while g.1 > keep_bytes {
                    let Some(b) = g.0[c].pop() else { break };
                    g.1 -= b.capacity();
                    dropped.push(b);
                }
            }
        }
        drop(dropped);
    }

    /// Bytes the pool holds: free buffers plus those handed out.
    pub fn held_bytes(&self) -> u64 {
        self.free.lock().1 as u64 + self.lent_bytes.load(Ordering::Relaxed)
    }
}

/// Counters published through `Backup::stats`.
#[derive(Default)]
pub struct Counters {
    pub appended_entries: AtomicU64,
    pub flushes: AtomicU64,
    pub primary_writes: AtomicU64,
    pub primary_bytes: AtomicU64,
    pub secondary_writes: AtomicU64,
    pub secondary_bytes: AtomicU64,
    pub version_spills: AtomicU64,
    /// Spills of version buffers because the store-wide bound was exceeded.
    pub version_spills_over_bound: AtomicU64,
    /// Times the store came to rest (idle checkpoint and release of memory).
    pub rests: AtomicU64,
    /// Version tables dropped: over their bound, or at rest.
    pub version_caches_dropped: AtomicU64,
    pub version_bytes: AtomicU64,
    pub syncs: AtomicU64,
    /// Sync rounds done with one syncfs instead of a fdatasync per file.
    pub syncfs_calls: AtomicU64,
    pub reorg_runs: AtomicU64,
    pub reorg_overlapping_rounds: AtomicU64,
    pub reorg_segments: AtomicU64,
    pub reorg_bytes_freed: AtomicU64,
    pub reorg_bytes_read: AtomicU64,
    pub reorg_segments_unread: AtomicU64,
    pub reorg_live_mismatches: AtomicU64,
    pub reorg_dead_verify_failures: AtomicU64,
    pub reorg_bytes_written: AtomicU64,
    pub urgent_requests: AtomicU64,
    pub prompt_requests: AtomicU64,
    pub throttle_waits: AtomicU64,
    pub throttle_wait_ns: AtomicU64,
    pub reorg_corrupt_entries: AtomicU64,
    pub open_version_bytes_cut: AtomicU64,
    /// Time spent (ns): sorting/copying in the processor, writing, syncing, applying versions.
    pub process_ns: AtomicU64,
    pub write_ns: AtomicU64,
    pub sync_ns: AtomicU64,
    pub version_ns: AtomicU64,
    pub open_version_bytes_damaged: AtomicU64,
    /// Bytes of the primary log written through ahead of use (`run_prewriter`).
    pub primary_prewritten_bytes: AtomicU64,
}

pub struct Progress {
    pub written_lsn: u64,
    pub durable_lsn: u64,
    pub failed: Option<String>,
}

pub struct PrimaryLog {
    pub file: Arc<File>,
    pub path: PathBuf,
    pub size: u64,
    pub offset: u64,
    /// Where the pre-writer zeroes next (`run_prewriter`).
    pub prewrite_next: u64,
    /// The range the pre-writer is zeroing now: no block is placed in it until it is done.
    pub prewrite_busy: Option<(u64, u64)>,
    /// The log has wrapped since it was opened: every block of it has been written through.
    pub lapped: bool,
}

pub struct Shared {
    pub dir: PathBuf,
    pub cfg: Config,
    pub io_mode: IoMode,
    pub wb: WriteBuffer,
    /// Next sequence number: flush cycles and block writes draw from it.
    pub seq: AtomicU64,
    pub tablets: RwLock<BTreeMap<u64, Arc<Tablet>>>,
    pub primary: Mutex<PrimaryLog>,
    pub progress: Mutex<Progress>,
    pub progress_cv: Condvar,
    pub written_lsn: AtomicU64,
    pub durable_lsn: AtomicU64,
    pub sync_requested: AtomicBool,
    pub checkpoint_requested: AtomicBool,
    pub pool: BufPool,
    pub counters: Counters,
    pub reorg_queue: Mutex<VecDeque<(u64, bool)>>,
    pub reorg_cv: Condvar,
    /// Tablets a reorganizer thread is working on (taken with `reorg_queue` held when both are).
    pub reorg_busy: Mutex<HashSet<u64>>,
    /// The reorganizers' version caches of the tablets none of them holds.
    pub reorg_caches: Mutex<HashMap<u64, crate::reorg::VersionCache>>,
    /// Bumped after each urgent reorganization; the processor waits on it.
    pub reorg_done: Mutex<u64>,
    pub reorg_done_cv: Condvar,
    pub shutdown: AtomicBool,
    /// Ticket of the last flush the processor handed to the writer: once `written_lsn` reaches
    /// it, every placed entry's version is visible to reorganization.
    pub sent_lsn: AtomicU64,
    /// Sequence of the last flush whose writes are done: the reorganizer takes placement notes
    /// up to it (`TabletState::take_notes`).
    pub notes_visible_seq: AtomicU64,
    /// Placement notes waiting over all tablets (`tablet::NOTES_MAX`).
    pub notes_pending: Arc<std::sync::atomic::AtomicUsize>,
    /// Reorganizer threads in a round (`Stats::reorg_overlapping_rounds`).
    pub reorg_rounds_active: AtomicU64,
    /// When the processor last took entries from the write buffer (`reorg::clean_level`).
    pub last_data_flush: Mutex<Option<Instant>>,
    pub dropped: Mutex<HashMap<u64, u64>>,
    /// Memory gauges (`Backup::memory`).
    pub mem: Arc<crate::tablet::MemGauges>,
    /// Segment buffers of replays, in flight and kept for the next (`Config::replay_pool_bytes`).
    pub replay_pool: Arc<BufPool>,
    /// The finisher's helpers for sync rounds of several files (`run_parallel`).
    pub syncers: IoPool,
    /// Set by the first wait for `Stage::Durable`: the pre-writer starts (`run_prewriter`).
    pub prewrite_wanted: AtomicBool,
    /// Signalled (with `primary` held) when the pre-writer is wanted or ends a range, and when
    /// the primary log's offset moves on.
    pub primary_cv: Condvar,
}

impl Shared {
    pub fn tablet(&self, id: u64) -> Option<Arc<Tablet>> {
        self.tablets.read().get(&id).cloned()
    }

    pub fn get_or_create_tablet(&self, id: u64) -> Result<Arc<Tablet>> {
        if let Some(t) = self.tablet(id) {
            return Ok(t);
        }
        let mut g = self.tablets.write();
        if let Some(t) = g.get(&id) {
            return Ok(t.clone());
        }
        let (t, scan) = Tablet::open(&self.dir, id, self.io_mode, &self.cfg)?;
        self.counters
            .open_version_bytes_cut
            .fetch_add(scan.version_log_truncated_bytes, Ordering::Relaxed);
        self.counters
            .open_version_bytes_damaged
            .fetch_add(scan.version_log_damaged_bytes, Ordering::Relaxed);
        {
            let mut st = t.state.lock();
            st.notes_pending = self.notes_pending.clone();
            st.mem = self.mem.clone();
            st.account();
        }
        let t = Arc::new(t);
        g.insert(id, t.clone());
        Ok(t)
    }

    pub fn fail(&self, err: &Error) {
        let msg = err.to_string();
        tracing::error!("backup failed: {msg}");
        self.wb.fail(msg.clone());
        let mut p = self.progress.lock();
        if p.failed.is_none() {
            p.failed = Some(msg);
        }
        self.progress_cv.notify_all();
    }

    pub fn failed(&self) -> Option<String> {
        self.progress.lock().failed.clone()
    }

    /// Asks for a partial reorganization of `tablet` ahead of everything but urgent requests.
    pub fn request_reorg_front(&self, tablet: u64) {
        let mut q = self.reorg_queue.lock();
        if !q.iter().any(|(t, _)| *t == tablet) {
            let at = q.iter().take_while(|(_, urgent)| *urgent).count();
            q.insert(at, (tablet, false));
        }
        self.reorg_cv.notify_all();
    }

    pub fn request_reorg(&self, tablet: u64, urgent: bool) {
        let mut q = self.reorg_queue.lock();
        if urgent {
            q.push_front((tablet, true));
        } else if !q.iter().any(|(t, _)| *t == tablet) {
            q.push_back((tablet, false));
        }
        self.reorg_cv.notify_all();
    }
}

/// Versions learned in one flush (copied out of the write buffer, in arrival order), applied by
/// the writer after the data is on disk.
pub struct VersionBatch {
    pub tablet: Arc<Tablet>,
    pub records: Vec<format::VersionRecord>,
}

/// One flush cycle, handed from the processor to the writer.
pub struct Job {
    pub seq: u64,
    pub lsn: u64,
    /// When the job's oldest entry was appended (None if it carries none).
    pub oldest: Option<Instant>,
    pub writes: Vec<(Arc<Tablet>, BlockWrite)>,
    /// The buffer most of `writes` lie in (see `tablet::Blocks`).
    pub arena: Option<AlignedBuf>,
    pub primary: Option<(u64, AlignedBuf)>,
    /// The primary write wraps to offset 0: every SLB has been flushed in `writes`, and all
    /// version buffers must be spilled before the primary block is written.
    pub wrap: bool,
    /// Flush every SLB and spill every version buffer (close, or a requested checkpoint).
    pub checkpoint: bool,
    pub versions: Vec<VersionBatch>,
    pub force_sync: bool,
    pub closing: bool,
}

/// Processor thread body.
pub fn run_processor(sh: Arc<Shared>, tx: SyncSender<Job>) {
    loop {
        let Taken {
            chunks,
            lsn,
            oldest,
            closed: closing,
        } = sh.wb.take();
        if oldest.is_some() {
            *sh.last_data_flush.lock() = Some(Instant::now());
        }
        let checkpoint = sh.checkpoint_requested.swap(false, Ordering::SeqCst) || closing;
        let force_sync = sh.sync_requested.swap(false, Ordering::SeqCst) || closing;
        let t0 = Instant::now();
        let job = if sh.failed().is_some() {
            Ok(Job {
                seq: 0,
                lsn,
                oldest,
                writes: Vec::new(),
                arena: None,
                primary: None,
                wrap: false,
                checkpoint: false,
                versions: Vec::new(),
                force_sync: false,
                closing,
            })
        } else {
            build_job(&sh, &chunks, lsn, oldest, checkpoint, force_sync, closing)
        };
        // Everything the job needs is copied out of the chunks (entries into its blocks, version
        // records into its batches): the producers may refill them while the job is written.
        sh.wb.release(chunks);
        sh.counters
            .process_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        match job {
            Ok(job) => {
                let lsn = job.lsn;
                if tx.send(job).is_err() {
                    return;
                }
                sh.sent_lsn.fetch_max(lsn, Ordering::SeqCst);
            }
            Err(e) => sh.fail(&e),
        }
        if closing {
            return;
        }
    }
}

/// Sorts a flush's batches by tablet, routes them (two-level logging) into block buffers, and
/// copies their version records: the job needs nothing of the chunks afterwards.
fn build_job(
    sh: &Shared,
    chunks: &[Chunk],
    lsn: u64,
    oldest: Option<Instant>,
    checkpoint: bool,
    force_sync: bool,
    closing: bool,
) -> Result<Job> {
    let cfg = &sh.cfg;
    let seq = sh.seq.fetch_add(1, Ordering::SeqCst);
    // 1. Sort batches by tablet, keeping arrival order within each tablet (side tables only).
    let mut groups: BTreeMap<u64, Vec<(usize, usize)>> = BTreeMap::new();
    let mut appended = 0u64;
    for (c, chunk) in chunks.iter().enumerate() {
        for (b, meta) in chunk.batches.iter().enumerate() {
            groups.entry(meta.tablet).or_default().push((c, b));
            appended += meta.rec_count as u64;
        }
    }
    // One arena for the flush's secondary blocks, of a fixed size so that the pool keeps
    // handing out the same buffers (a block that does not fit gets a buffer of its own).
    let flush_bytes: usize = chunks.iter().map(|c| c.data.len()).sum();
    let mut blocks = Blocks::new(&sh.pool, if flush_bytes > 0 { arena_bytes(cfg) } else { 0 });
    let mut writes: Vec<(Arc<Tablet>, BlockWrite)> = Vec::new();
    let mut primary_runs: Vec<(u64, Vec<&[u8]>, usize)> = Vec::new();
    let mut versions: Vec<VersionBatch> = Vec::new();
    for (tablet_id, batches) in groups {
        let tablet = sh.get_or_create_tablet(tablet_id)?;
        let mut puts: Vec<&[u8]> = Vec::with_capacity(batches.len());
        let mut deletes: Vec<&[u8]> = Vec::new();
        let mut put_bytes = 0usize;
        let mut delete_bytes = 0usize;
        for &(c, b) in &batches {
            let meta = &chunks[c].batches[b];
            let bytes = chunks[c].batch_bytes(meta);
            if meta.deletes {
                deletes.push(bytes);
                delete_bytes += bytes.len();
            } else {
                puts.push(bytes);
                put_bytes += bytes.len();
            }
        }
        // 2. Route: small batches to the primary log + SLB, large ones straight to the secondary log.
        let mut st = tablet.state.lock();
        // The flush's deletes are noted before its puts are placed. A put noted after a delete of
        // its key must be the newer of the two: the reorganizer frees a segment whose entries
        // the notes call all dead without reading it. Puts placed later than the flush they came
        // in (from the SLB) may follow a newer delete in the notes; such an entry is then
        // counted live until its key's next note, never dead while current.
        if cfg.tracks_locations() && st.noting && !deletes.is_empty() {
            for &(c, b) in &batches {
                let meta = &chunks[c].batches[b];
                if meta.deletes {
                    for r in chunks[c].batch_records(meta) {
                        st.push_note(crate::tablet::Note {
                            hash: r.hash,
                            segment: crate::tablet::NOTE_DELETE,
                            len: 0,
                            seq,
                        });
                    }
                }
            }
        }
        let mut run: Vec<&[u8]> = Vec::new();
        let mut run_bytes = 0usize;
        if put_bytes > 0 {
            let small = cfg.two_level && put_bytes < cfg.direct_threshold_bytes;
            // Within the tablet's buffer and the store-wide bound (`put_bytes` more may cost
            // up to twice that in capacity while the buffer grows).
            let room = sh.mem.secondary_buffers.load(Ordering::Relaxed) as usize + 2 * put_bytes
                <= cfg.secondary_buffers_max_bytes;
            if small && st.slb.len() + put_bytes <= cfg.secondary_buffer_bytes && room {
                for p in &puts {
                    st.slb.extend_from_slice(p);
                }
                st.slb_data_seq = seq;
                run.extend_from_slice(&puts);
                run_bytes += put_bytes;
            } else {
                let slb = std::mem::take(&mut st.slb);
                let mut slices: Vec<&[u8]> = Vec::with_capacity(puts.len() + 1);
                if !slb.is_empty() {
                    slices.push(&slb);
                }
                slices.extend_from_slice(&puts);
                let placed = place_with_urgent(sh, &tablet, &mut st, &slices, seq, &mut blocks)?;
                for w in placed {
                    writes.push((tablet.clone(), w));
                }
                // The emptied buffer's memory goes back (it is allocated again when needed).
                drop(slb);
            }
        }
        st.account();
        drop(st);
        // Deletes are versions: they go to the primary log (durable now) and the version buffer,
        // never to the secondary log.
        run.extend_from_slice(&deletes);
        run_bytes += delete_bytes;
        if run_bytes > 0 {
            primary_runs.push((tablet_id, run, run_bytes));
        }
        let mut records = Vec::with_capacity(
            batches
                .iter()
                .map(|&(c, b)| chunks[c].batches[b].rec_count)
                .sum(),
        );
        for &(c, b) in &batches {
            records.extend_from_slice(chunks[c].batch_records(&chunks[c].batches[b]));
        }
        versions.push(VersionBatch { tablet, records });
    }
    sh.counters
        .appended_entries
        .fetch_add(appended, Ordering::Relaxed);
    // 3. The primary block: one write for all small batches of this flush.
    let mut wrap = false;
    let mut primary = None;
    if !primary_runs.is_empty() {
        let body_len: usize = primary_runs
            .iter()
            .map(|r| format::RUN_HEADER_BYTES + r.2)
            .sum();
        let padded = format::page_align_up(BLOCK_HEADER_BYTES + body_len);
        let mut pl = sh.primary.lock();
        if padded as u64 > pl.size {
            return Err(Error::Corrupt(
                "primary block larger than the primary log".into(),
            ));
        }
        if pl.offset + padded as u64 > pl.size {
            wrap = true;
            pl.offset = 0;
            pl.lapped = true;
        }
        // Never into a range the pre-writer is zeroing (it keeps ahead of the offset, so this
        // waits only when a burst of flushes catches up with it).
        while let Some((from, to)) = pl.prewrite_busy {
            if pl.offset >= to || pl.offset + padded as u64 <= from {
                break;
            }
            sh.primary_cv.wait(&mut pl);
        }
        let mut buf = sh.pool.get(padded);
        {
            let out = buf.full_mut();
            let mut at = BLOCK_HEADER_BYTES;
            for (tablet, slices, bytes) in &primary_runs {
                let mut hdr = Vec::with_capacity(format::RUN_HEADER_BYTES);
                format::encode_run_header(&mut hdr, *tablet, *bytes as u32, 0);
                out[at..at + hdr.len()].copy_from_slice(&hdr);
                at += hdr.len();
                for s in slices {
                    out[at..at + s.len()].copy_from_slice(s);
                    at += s.len();
                }
            }
            debug_assert_eq!(at, BLOCK_HEADER_BYTES + body_len);
            out[at..padded].fill(0);
            BlockHeader {
                kind: format::BLOCK_PRIMARY,
                body_len: body_len as u32,
                write_seq: sh.seq.fetch_add(1, Ordering::SeqCst),
                data_seq: seq,
                tablet: 0,
                entry_count: 0,
            }
            .encode(out);
        }
        buf.set_len(padded);
        primary = Some((pl.offset, buf));
        pl.offset += padded as u64;
        if sh.prewrite_wanted.load(Ordering::Relaxed) {
            sh.primary_cv.notify_all();
        }
    }
    // 4. Before the primary log wraps (or at a checkpoint), every SLB goes to its secondary log.
    if wrap || checkpoint {
        let all: Vec<Arc<Tablet>> = sh.tablets.read().values().cloned().collect();
        for tablet in all {
            let mut st = tablet.state.lock();
            if st.slb.is_empty() {
                continue;
            }
            let slb = std::mem::take(&mut st.slb);
            let data_seq = st.slb_data_seq.max(1);
            let placed = place_with_urgent(sh, &tablet, &mut st, &[&slb], data_seq, &mut blocks)?;
            for w in placed {
                writes.push((tablet.clone(), w));
            }
            st.account();
        }
    }
    Ok(Job {
        seq,
        lsn,
        oldest,
        writes,
        arena: blocks.finish(),
        primary,
        wrap,
        checkpoint,
        versions,
        force_sync,
        closing,
    })
}

/// Size of a flush's block arena: the write buffer's size as a power of two, at most 32 MiB.
pub fn arena_bytes(cfg: &crate::Config) -> usize {
    // At most a quarter of the pool's bound, so the arenas of the flushes in flight go back to
    // the pool and are reused; a larger flush puts its overflow in buffers of their own.
    cfg.write_buffer_bytes
        .next_power_of_two()
        .min(cfg.pool_bytes / 4)
        .max(PAGE_BYTES)
}

/// Waits (at most `limit`) until a round of reorganization of `tablet` ends after the tablet had
/// seen `rounds` of them, or (if `commits` is given) a round frees some of its segments after it
/// had seen that many such commits: rounds of other tablets ending meanwhile say nothing about
/// this one. The caller holds no lock.
fn wait_for_round(
    sh: &Shared,
    tablet: &Tablet,
    (rounds, commits): (u64, Option<u64>),
    limit: Duration,
) {
    let deadline = Instant::now() + limit;
    loop {
        // Read the completion count before the check, so a round ending between the check and
        // the wait is not slept through (and never hold both locks).
        let done = *sh.reorg_done.lock();
        let progressed = {
            let st = tablet.state.lock();
            st.reorg_rounds != rounds || commits.is_some_and(|c| st.reorg_commits != c)
        };
        if progressed
            || Instant::now() >= deadline
            || sh.shutdown.load(Ordering::SeqCst)
            || sh.failed().is_some()
        {
            return;
        }
        let mut g = sh.reorg_done.lock();
        if *g == done {
            sh.reorg_done_cv.wait_for(&mut g, Duration::from_millis(20));
        }
    }
}

/// Waits (at most 5 s) until every flush up to ticket `lsn` is written and its versions applied.
fn wait_written(sh: &Shared, lsn: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut p = sh.progress.lock();
    while p.written_lsn < lsn
        && p.failed.is_none()
        && Instant::now() < deadline
        && !sh.shutdown.load(Ordering::SeqCst)
    {
        sh.progress_cv.wait_for(&mut p, Duration::from_millis(20));
    }
}

/// Places data, asking for an urgent reorganization (and waiting for it) if the log is full.
fn place_with_urgent(
    sh: &Shared,
    tablet: &Arc<Tablet>,
    st: &mut parking_lot::MutexGuard<'_, crate::tablet::TabletState>,
    slices: &[&[u8]],
    data_seq: u64,
    blocks: &mut Blocks<'_>,
) -> Result<Vec<BlockWrite>> {
    // Throttle: a log above the throttle threshold waits for the cleaner first, so utilisation
    // stays bounded when writes outpace reorganization.
    // A large batch also waits if it would carry the log past the prompt threshold. A round of
    // reorganization that frees nothing ends the wait (the placement then proceeds, or asks for
    // an urgent reorganization if it does not fit).
    if sh.cfg.reorg_enabled {
        let incoming: u64 = slices.iter().map(|s| s.len() as u64).sum();
        let capacity = tablet.capacity_bytes() as f64;
        for _ in 0..100 {
            let used = st.used_bytes();
            let calm = used as f64 <= sh.cfg.reorg_throttle * capacity
                && (used + incoming) as f64
                    <= sh.cfg.reorg_prompt.max(sh.cfg.reorg_throttle) * capacity;
            if calm || sh.shutdown.load(Ordering::SeqCst) {
                break;
            }
            sh.counters.throttle_waits.fetch_add(1, Ordering::Relaxed);
            st.throttled_at = Some(Instant::now());
            // Wait for a round of reorganization of this log: a round of another log ending
            // meanwhile says nothing about this one. The round can only drop what it knows to be
            // superseded: if earlier flushes are still being written, their versions are not yet
            // visible (the finisher applies them), so a round that frees nothing then is
            // followed by another once they are.
            let seen = (st.reorg_rounds, Some(st.reorg_commits));
            let sent = sh.sent_lsn.load(Ordering::SeqCst);
            let versions_visible = sh.written_lsn.load(Ordering::SeqCst) >= sent;
            sh.request_reorg_front(tablet.id);
            let t0 = Instant::now();
            parking_lot::MutexGuard::unlocked(st, || {
                wait_for_round(sh, tablet, seen, Duration::from_secs(5))
            });
            if st.used_bytes() >= used && !versions_visible {
                parking_lot::MutexGuard::unlocked(st, || wait_written(sh, sent));
            }
            sh.counters
                .throttle_wait_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if st.used_bytes() >= used && versions_visible {
                break;
            }
        }
    }
    for attempt in 0..3 {
        let notes = sh.cfg.tracks_locations() && st.noting;
        if let Some(w) = tablet.place(
            st,
            slices,
            data_seq,
            &sh.seq,
            blocks,
            sh.cfg.new_segment_fraction,
            notes,
        )? {
            return Ok(w);
        }
        if !sh.cfg.reorg_enabled || attempt == 2 {
            break;
        }
        sh.counters.urgent_requests.fetch_add(1, Ordering::Relaxed);
        let rounds = st.reorg_rounds;
        sh.request_reorg(tablet.id, true);
        // The reorganizer needs the tablet state lock: release it while waiting.
        parking_lot::MutexGuard::unlocked(st, || {
            wait_for_round(sh, tablet, (rounds, None), Duration::from_secs(60))
        });
    }
    Err(Error::LogFull {
        tablet: tablet.id,
        capacity_bytes: tablet.capacity_bytes(),
    })
}

/// Writer thread body.
/// What the writer hands the finisher once a job's writes are done (or skipped after a failure).
pub struct WrittenJob {
    seq: u64,
    lsn: u64,
    oldest: Option<Instant>,
    /// The job's block writes (none if the store had failed when the writer took the job).
    in_flight: Option<Arc<WriteLatch>>,
    versions: Vec<VersionBatch>,
    /// A wrapping job's primary block, still to be written by the finisher.
    wrap_primary: Option<(u64, AlignedBuf)>,
    checkpoint: bool,
    force_sync: bool,
    closing: bool,
    /// Set for jobs the writer must not run ahead of (wrap, checkpoint, close): the finisher
    /// answers once it is done with the job.
    done: Option<SyncSender<()>>,
}

/// Writer thread body: issues each job's block writes and hands the job to the finisher, then
/// goes on with the next job while the finisher applies versions, syncs and publishes. The disk
/// thus keeps receiving writes during syncs and version spills.
pub fn run_writer(sh: Arc<Shared>, rx: Receiver<Job>, tx: SyncSender<WrittenJob>) {
    let pool = IoPool::new(sh.cfg.io_threads.max(1), "ramlog-backup-io");
    let mut issued: VecDeque<Arc<WriteLatch>> = VecDeque::new();
    loop {
        // Room for one more job in flight before taking it, so that no job (and its arena)
        // waits here as well as in the channel.
        while issued.len() >= JOBS_IN_FLIGHT {
            if let Some(l) = issued.pop_front() {
                l.wait();
            }
        }
        let Ok(job) = rx.recv() else { break };
        let Job {
            seq,
            lsn,
            oldest,
            writes,
            arena,
            primary,
            wrap,
            checkpoint,
            versions,
            force_sync,
            closing,
        } = job;
        // A wrapping job's primary block is written by the finisher, after the spills.
        let (primary, wrap_primary) = if wrap {
            (None, primary)
        } else {
            (primary, None)
        };
        let in_flight = if sh.failed().is_none() {
            let latch = issue_writes(&sh, &pool, writes, arena, primary);
            issued.push_back(latch.clone());
            Some(latch)
        } else {
            for (_, w) in writes {
                if let BlockBuf::Own(b) = w.buf {
                    sh.pool.put(b);
                }
            }
            for b in arena.into_iter().chain(primary.map(|p| p.1)) {
                sh.pool.put(b);
            }
            None
        };
        let wrap_primary = match wrap_primary {
            Some(p) if sh.failed().is_none() => Some(p),
            Some((_, b)) => {
                sh.pool.put(b);
                None
            }
            None => None,
        };
        // A wrap, a checkpoint or the close must be finished (versions spilled, synced) before
        // anything later is written.
        let (done, finished) = if wrap || checkpoint || closing {
            let (d, f) = std::sync::mpsc::sync_channel(1);
            (Some(d), Some(f))
        } else {
            (None, None)
        };
        let handed = tx.send(WrittenJob {
            seq,
            lsn,
            oldest,
            in_flight,
            versions,
            wrap_primary,
            checkpoint: checkpoint || wrap,
            force_sync: force_sync || wrap,
            closing,
            done,
        });
        if handed.is_err() {
            return;
        }
        if let Some(f) = finished {
            let _ = f.recv();
        }
        if closing {
            return;
        }
    }
}

/// A job's block writes, owned until every piece of them is done (the pieces run on the
/// writer's I/O threads and share it; the last one to finish takes it back).
struct WriteSet {
    writes: Vec<(Arc<Tablet>, BlockWrite)>,
    arena: Option<AlignedBuf>,
    /// The job's primary block: where it goes, its bytes, the primary log's file and path.
    primary: Option<(u64, AlignedBuf, Arc<File>, PathBuf)>,
    issued: Instant,
}

/// Completion of one job's writes: the finisher waits for it before it publishes, syncs or
/// applies anything of the job; the writer waits for it to bound the jobs in flight.
pub struct WriteLatch {
    state: Mutex<LatchState>,
    completed: Condvar,
}

#[derive(Default)]
struct LatchState {
    /// The first error of any piece.
    error: Option<Error>,
    /// Every piece is done.
    done: bool,
    /// Then: the tablets written and whether a primary block was (until the finisher takes it).
    outcome: Option<(Vec<Arc<Tablet>>, bool)>,
}

impl WriteLatch {
    fn fail(&self, e: Error) {
        self.state.lock().error.get_or_insert(e);
    }

    fn failed(&self) -> bool {
        self.state.lock().error.is_some()
    }

    fn complete(&self, outcome: Result<(Vec<Arc<Tablet>>, bool)>) {
        let mut g = self.state.lock();
        match outcome {
            Ok(o) => g.outcome = Some(o),
            Err(e) => {
                g.error.get_or_insert(e);
            }
        }
        g.done = true;
        self.completed.notify_all();
    }

    /// Waits until every piece is done.
    fn wait(&self) {
        let mut g = self.state.lock();
        while !g.done {
            self.completed.wait(&mut g);
        }
    }

    /// Waits until every piece is done; returns the tablets written and whether a primary block
    /// was, or the first error.
    fn take(&self) -> Result<(Vec<Arc<Tablet>>, bool)> {
        let mut g = self.state.lock();
        while !g.done {
            self.completed.wait(&mut g);
        }
        match g.error.take() {
            Some(e) => Err(e),
            None => Ok(g.outcome.take().unwrap_or_default()),
        }
    }
}

/// Jobs whose writes may be in flight at once. Two (the next flush's writes issued while the
/// last pieces of the previous one complete) measured the same as one on the development disk:
/// one tablet's 512 B entries at 0.683-0.742 of raw bandwidth against 0.720 twice, 256 tablets'
/// at 0.568-0.595 against 0.605-0.614 (alternating bench rows), and a second flush in flight
/// holds a fourth 32 MiB arena. So one: the writer takes the next job once the previous one's
/// writes are done.
const JOBS_IN_FLIGHT: usize = 1;

/// Which bytes of a [`WriteSet`] one write request carries.
#[derive(Clone, Copy)]
enum Piece {
    /// `writes[i]`, bytes `at..end` of its block.
    Secondary {
        i: usize,
        at: usize,
        end: usize,
    },
    Primary,
}

/// Issues a job's secondary writes (as pieces of at most `WRITE_PIECE_BYTES`, so that one
/// tablet's large block is still several requests in flight) and its primary write on the I/O
/// threads, and returns without waiting for them. Nothing is acknowledged before all of them
/// (and the sync) complete, so their order does not matter; a crash may tear a block either way,
/// and replay detects a torn block by its entries' CRCs and end-of-data.
fn issue_writes(
    sh: &Arc<Shared>,
    pool: &IoPool,
    writes: Vec<(Arc<Tablet>, BlockWrite)>,
    arena: Option<AlignedBuf>,
    primary: Option<(u64, AlignedBuf)>,
) -> Arc<WriteLatch> {
    let primary = primary.map(|(offset, buf)| {
        let pl = sh.primary.lock();
        (offset, buf, pl.file.clone(), pl.path.clone())
    });
    let mut pieces = Vec::with_capacity(writes.len() + 1);
    for (i, (_, w)) in writes.iter().enumerate() {
        let len = w.len();
        let mut at = 0usize;
        while at < len {
            let end = (at + WRITE_PIECE_BYTES).min(len);
            pieces.push(Piece::Secondary { i, at, end });
            at = end;
        }
    }
    if primary.is_some() {
        pieces.push(Piece::Primary);
    }
    let set = Arc::new(WriteSet {
        writes,
        arena,
        primary,
        issued: Instant::now(),
    });
    let latch = Arc::new(WriteLatch {
        state: Mutex::new(LatchState::default()),
        completed: Condvar::new(),
    });
    // A lone write (a durable group commit's primary block, most often) is issued here: handing
    // it to an I/O thread would add a thread hop to every commit and keep nothing else in flight.
    let inline = pieces.len() == 1;
    for piece in pieces {
        let (sh, set, latch) = (sh.clone(), set.clone(), latch.clone());
        let task = move || {
            if let Err(e) = write_piece(&set, piece) {
                latch.fail(e);
            }
            // Whichever holder of the set lets go of it last completes the job.
            if let Some(set) = Arc::into_inner(set) {
                let ok = !latch.failed();
                latch.complete(complete_writes(&sh, set, ok));
            }
        };
        if inline {
            task();
        } else {
            pool.submit(task);
        }
    }
    if let Some(set) = Arc::into_inner(set) {
        let ok = !latch.failed();
        latch.complete(complete_writes(sh, set, ok));
    }
    latch
}

fn write_piece(set: &WriteSet, piece: Piece) -> Result<()> {
    match piece {
        Piece::Secondary { i, at, end } => {
            let (t, w) = &set.writes[i];
            let bytes = &w.bytes(set.arena.as_ref())[at..end];
            t.file
                .write_all_at(bytes, w.offset + at as u64)
                .map_err(|e| Error::io(&t.sec_path, e))
        }
        Piece::Primary => match &set.primary {
            Some((offset, buf, file, path)) => file
                .write_all_at(buf.as_slice(), *offset)
                .map_err(|e| Error::io(path, e)),
            None => Ok(()),
        },
    }
}

/// Once every piece of a job is written (`ok`: without error): releases the segment pins,
/// returns the buffers to the pool at once (so the processor finds them there) and preallocates
/// segments ahead for tablets that fill them quickly. Returns the tablets written and whether a
/// primary block was.
fn complete_writes(sh: &Shared, set: WriteSet, ok: bool) -> Result<(Vec<Arc<Tablet>>, bool)> {
    sh.counters
        .write_ns
        .fetch_add(set.issued.elapsed().as_nanos() as u64, Ordering::Relaxed);
    if let Some((_, buf, ..)) = &set.primary {
        sh.counters.primary_writes.fetch_add(1, Ordering::Relaxed);
        sh.counters
            .primary_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
    }
    sh.counters
        .secondary_writes
        .fetch_add(set.writes.len() as u64, Ordering::Relaxed);
    sh.counters.secondary_bytes.fetch_add(
        set.writes.iter().map(|(_, w)| w.len() as u64).sum::<u64>(),
        Ordering::Relaxed,
    );
    // Release segment pins whatever happened (a failed backup refuses further writes anyway).
    for (tablet, w) in &set.writes {
        let mut st = tablet.state.lock();
        if let Some(m) = st.segments.get_mut(w.segment) {
            m.pending = m.pending.saturating_sub(1);
        }
    }
    let primary_written = set.primary.is_some();
    let mut touched: Vec<Arc<Tablet>> = Vec::with_capacity(set.writes.len());
    let mut per_tablet: Vec<(Arc<Tablet>, usize)> = Vec::new();
    for (tablet, w) in set.writes {
        // A tablet's writes are adjacent (the processor groups by tablet).
        match per_tablet.last_mut() {
            Some((t, bytes)) if Arc::ptr_eq(t, &tablet) => *bytes += w.len(),
            _ => per_tablet.push((tablet.clone(), w.len())),
        }
        if let BlockBuf::Own(b) = w.buf {
            sh.pool.put(b);
        }
        touched.push(tablet);
    }
    for b in set.arena.into_iter().chain(set.primary.map(|p| p.1)) {
        sh.pool.put(b);
    }
    if ok {
        // Tablets that take a large share of a segment per flush get their next segments
        // preallocated now: enough empty segments for two more flushes like this one.
        let seg = sh.cfg.segment_bytes as usize;
        for (tablet, bytes) in per_tablet {
            if bytes >= seg / 4 {
                tablet.preallocate_ahead((2 * bytes).div_ceil(seg))?;
            }
        }
    }
    Ok((touched, primary_written))
}

/// Finisher thread body: for each written job, in order, applies its versions, spills version
/// buffers, syncs when due, and publishes progress; syncs by itself when an unsynced entry is
/// due and no job comes along.
pub fn run_finisher(sh: Arc<Shared>, rx: Receiver<WrittenJob>) {
    let mut dirty: HashMap<u64, Arc<Tablet>> = HashMap::new();
    let mut dirty_versions: HashMap<u64, Arc<Tablet>> = HashMap::new();
    let mut primary_dirty = false;
    // Written but not yet synced (periodic policy): when the oldest such entry was appended, and
    // the ticket up to which everything is written.
    let mut unsynced: Option<(Instant, u64)> = None;
    let periodic = sh.cfg.sync == SyncPolicy::Periodic;
    let sync_after = sh.cfg.flush_interval / 2;
    // When the last sync ended (or the finisher started).
    let mut last_sync = Instant::now();
    // Coming to rest (`Config::idle_after`): when a flush last carried entries, and whether the
    // store has come to rest since.
    let mut last_data = Instant::now();
    let mut rest = Rest::Waiting;
    // A written job taken early to share the sync of the one before it (see below).
    let mut pending: Option<WrittenJob> = None;
    loop {
        let sync_at = match unsynced {
            Some((oldest, _)) if periodic => Some(periodic_sync_at(oldest, last_sync, sync_after)),
            _ => None,
        };
        // Coming to rest waits for the periodic sync (it syncs the version logs itself).
        let rest_at =
            (rest == Rest::Waiting && sync_at.is_none()).then(|| last_data + sh.cfg.idle_after);
        let job = match pending.take() {
            Some(job) => job,
            None => match sync_at.or(rest_at) {
                Some(at) => match rx.recv_timeout(at.saturating_duration_since(Instant::now())) {
                    Ok(job) => job,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                        if let (Some((_, lsn)), Some(_)) = (unsynced, sync_at) {
                            // No flush came along in time: sync what is written.
                            let t0 = Instant::now();
                            let r =
                                sync_all(&sh, &mut dirty, &mut dirty_versions, &mut primary_dirty);
                            sh.counters
                                .sync_ns
                                .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                            match r {
                                Ok(()) => publish(&sh, lsn, false, true),
                                Err(e) => sh.fail(&e),
                            }
                            last_sync = Instant::now();
                            unsynced = None;
                        } else {
                            // Nothing appended for `idle_after`: come to rest.
                            rest = Rest::Done;
                            let r = come_to_rest(
                                &sh,
                                &mut dirty,
                                &mut dirty_versions,
                                &mut primary_dirty,
                            );
                            if let Err(e) = r {
                                sh.fail(&e);
                            }
                        }
                        continue;
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                },
                None => match rx.recv() {
                    Ok(job) => job,
                    Err(_) => return,
                },
            },
        };
        let closing = job.closing;
        // Group commit across flushes (`finish`): a job may leave its sync to the next one.
        let defer_to = (job.done.is_none() && !closing).then_some((&rx, &mut pending));
        let lsn = job.lsn;
        let done = job.done.clone();
        if job.oldest.is_some() {
            last_data = Instant::now();
            rest = Rest::Waiting;
        }
        let oldest = match (unsynced.map(|u| u.0), job.oldest) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let sync_due = periodic
            && oldest.is_some_and(|t| Instant::now() >= periodic_sync_at(t, last_sync, sync_after));
        let result = finish(
            &sh,
            job,
            sync_due,
            defer_to,
            &mut dirty,
            &mut dirty_versions,
            &mut primary_dirty,
        );
        match result {
            Ok(synced) => {
                if synced {
                    last_sync = Instant::now();
                }
                sh.counters.flushes.fetch_add(1, Ordering::Relaxed);
                // Nothing written and nothing pending: everything up to `lsn` is durable.
                let durable = synced || (oldest.is_none() && periodic);
                publish(&sh, lsn, true, durable);
                unsynced = match oldest {
                    Some(t) if !durable => Some((t, lsn)),
                    _ => None,
                };
            }
            Err(e) => sh.fail(&e),
        }
        if let Some(d) = done {
            let _ = d.send(());
        }
        if closing {
            return;
        }
    }
}

/// Where the finisher is in coming to rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rest {
    /// Entries were appended within `idle_after`: not at rest yet.
    Waiting,
    /// At rest: nothing appended since the store came to rest.
    Done,
}

/// Nothing has been appended for `Config::idle_after`: spills every version buffer to its
/// version log (synced at once under the periodic policy, with the next sync otherwise, as any
/// spill), frees the emptied buffers and the write buffer's side tables, trims the flush-arena
/// pool to `pool_warm_bytes`, hands freed heap memory back to the system, and tells the
/// reorganizers (they drop their version tables, notes and segment buffers). Secondary-log
/// buffers keep their entries (bounded store-wide): writing them out at every pause would put a
/// padded block per tablet into the secondary logs each time.
fn come_to_rest(
    sh: &Shared,
    dirty: &mut HashMap<u64, Arc<Tablet>>,
    dirty_versions: &mut HashMap<u64, Arc<Tablet>>,
    primary_dirty: &mut bool,
) -> Result<()> {
    let tablets: Vec<Arc<Tablet>> = sh.tablets.read().values().cloned().collect();
    for t in &tablets {
        spill_versions(sh, t, dirty_versions)?;
    }
    if sh.cfg.sync == SyncPolicy::Periodic {
        let t0 = Instant::now();
        let r = sync_all(sh, dirty, dirty_versions, primary_dirty);
        sh.counters
            .sync_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r?;
    }
    for t in &tablets {
        let mut st = t.state.lock();
        // The notes are the reorganizers' to drop.
        if st.slb.is_empty() {
            st.slb = Vec::new();
        }
        if st.vbuf.is_empty() {
            st.vbuf = Vec::new();
        }
        st.account();
    }
    sh.wb.release_spare_records();
    sh.pool.trim(sh.cfg.pool_warm_bytes);
    sh.replay_pool.trim(0);
    sh.counters.rests.fetch_add(1, Ordering::SeqCst);
    sh.reorg_cv.notify_all();
    crate::io::return_free_memory();
    Ok(())
}

/// When the periodic policy syncs, given the append time of the oldest written but unsynced
/// entry and the end of the last sync (`sync_after` is half the flush interval): once that entry
/// is half an interval old, so that it is durable within about one interval of its append (as
/// when every flush synced) while fast flushes share their syncs. When the pipeline is backed up,
/// entries are already that old when they are written; then syncs stay half an interval apart,
/// unless the entry would pass a whole interval unsynced. Every sync flushes the device cache. On
/// the development disk, one tablet's 512 B entries logged 3-5% faster with no sync at all (two
/// alternating runs); this rule halves that run's fdatasyncs (from about 40 to 21 per 512 MiB),
/// with no throughput change measurable there.
fn periodic_sync_at(oldest: Instant, last_sync: Instant, sync_after: Duration) -> Instant {
    (oldest + sync_after)
        .max(last_sync + sync_after)
        .min(oldest + sync_after * 2)
}

/// Records that everything up to ticket `lsn` is written and/or durable (unless the store
/// failed), and wakes the waiters.
fn publish(sh: &Shared, lsn: u64, written: bool, durable: bool) {
    let mut p = sh.progress.lock();
    if p.failed.is_none() {
        if written {
            p.written_lsn = p.written_lsn.max(lsn);
            sh.written_lsn.store(p.written_lsn, Ordering::SeqCst);
        }
        if durable {
            p.durable_lsn = p.durable_lsn.max(lsn);
            sh.durable_lsn.store(p.durable_lsn, Ordering::SeqCst);
        }
    }
    sh.progress_cv.notify_all();
}

/// The rest of a job once its blocks are on disk: versions, spills, the sync when due, a
/// wrapping primary block, prompt reorganization requests. Returns whether it synced.
fn finish(
    sh: &Shared,
    job: WrittenJob,
    sync_due: bool,
    defer_to: Option<(&Receiver<WrittenJob>, &mut Option<WrittenJob>)>,
    dirty: &mut HashMap<u64, Arc<Tablet>>,
    dirty_versions: &mut HashMap<u64, Arc<Tablet>>,
    primary_dirty: &mut bool,
) -> Result<bool> {
    let WrittenJob {
        seq,
        in_flight,
        versions,
        wrap_primary,
        checkpoint,
        force_sync,
        ..
    } = job;
    let (touched, primary_written) = match in_flight {
        Some(latch) => latch.take()?,
        None => (Vec::new(), false),
    };
    if sh.failed().is_some() {
        if let Some((_, b)) = wrap_primary {
            sh.pool.put(b);
        }
        return Ok(false);
    }
    for tablet in &touched {
        dirty.entry(tablet.id).or_insert_with(|| tablet.clone());
    }
    *primary_dirty |= primary_written;
    let wrap = wrap_primary.is_some();
    let r = (|| -> Result<bool> {
        let t1 = Instant::now();
        // Versions become visible to reorganization only now that their data is on disk.
        for vb in &versions {
            let mut st = vb.tablet.state.lock();
            st.vbuf.extend_from_slice(&vb.records);
            st.vbuf_seq = seq;
            st.account();
        }
        let notes_waiting = sh.notes_pending.load(Ordering::Relaxed)
            >= sh.cfg.notes_max_bytes / crate::tablet::NOTE_MEM_BYTES / 8;
        // So do the flush's placement notes (jobs finish in sequence order). An idle
        // reorganizer takes them once many wait (it looks every 100 ms otherwise, and a log
        // can place more than `Config::notes_max_bytes` of notes in that time).
        sh.notes_visible_seq.fetch_max(seq, Ordering::SeqCst);
        if notes_waiting {
            sh.reorg_cv.notify_all();
        }
        let spill_at =
            (sh.cfg.version_buffer_entries as f64 * sh.cfg.version_spill_fraction) as usize;
        let candidates: Vec<Arc<Tablet>> = if checkpoint {
            sh.tablets.read().values().cloned().collect()
        } else {
            versions.iter().map(|v| v.tablet.clone()).collect()
        };
        for tablet in candidates {
            let due = {
                let st = tablet.state.lock();
                if checkpoint {
                    !st.vbuf.is_empty()
                } else {
                    st.vbuf.len() >= spill_at
                }
            };
            if due {
                spill_versions(sh, &tablet, dirty_versions)?;
            }
        }
        spill_over_bound(sh, dirty_versions)?;
        let t2 = Instant::now();
        sh.counters
            .version_ns
            .fetch_add((t2 - t1).as_nanos() as u64, Ordering::Relaxed);
        // Group commit across flushes: a sync asked for when the next flush is written already
        // (while this one waited for the previous sync) is left to that flush, whose sync then
        // covers both; the waiters of this one wait for it.
        let mut force_sync = force_sync;
        if force_sync && !checkpoint && !wrap {
            if let Some((rx, pending)) = defer_to {
                if let Ok(mut next) = rx.try_recv() {
                    next.force_sync = true;
                    *pending = Some(next);
                    force_sync = false;
                }
            }
        }
        // A wrap or checkpoint always syncs: the primary block of a wrap may overwrite the
        // previous lap only once everything the lap held is durable elsewhere.
        let must_sync = checkpoint || force_sync || sync_due;
        if must_sync {
            sync_all(sh, dirty, dirty_versions, primary_dirty)?;
        }
        if wrap {
            write_primary(sh, &wrap_primary, primary_dirty)?;
            if must_sync {
                sync_all(sh, dirty, dirty_versions, primary_dirty)?;
            }
        }
        sh.counters
            .sync_ns
            .fetch_add(t2.elapsed().as_nanos() as u64, Ordering::Relaxed);
        // Prompt reorganization requests for logs past the prompt threshold.
        if sh.cfg.reorg_enabled {
            for tablet in touched {
                let mut st = tablet.state.lock();
                let util = st.used_bytes() as f64 / tablet.capacity_bytes() as f64;
                if util >= sh.cfg.reorg_prompt && !st.prompt_requested {
                    st.prompt_requested = true;
                    drop(st);
                    sh.counters.prompt_requests.fetch_add(1, Ordering::Relaxed);
                    sh.request_reorg(tablet.id, false);
                }
            }
        }
        Ok(must_sync)
    })();
    if let Some((_, b)) = wrap_primary {
        sh.pool.put(b);
    }
    r
}

/// Spills a tablet's version buffer to its version log (the caller syncs the files in
/// `dirty_versions`). Only the finisher spills, so one spill of a tablet runs at a time.
fn spill_versions(
    sh: &Shared,
    tablet: &Arc<Tablet>,
    dirty_versions: &mut HashMap<u64, Arc<Tablet>>,
) -> Result<()> {
    let (records, vseq) = {
        let mut st = tablet.state.lock();
        if st.vbuf.is_empty() {
            st.vbuf = Vec::new();
            st.account();
            return Ok(());
        }
        let records = st.take_versions();
        st.account();
        (records, st.vbuf_seq)
    };
    let bytes = tablet.append_versions(vseq, &records)?;
    drop(records);
    {
        let mut st = tablet.state.lock();
        st.ver_wm = st.ver_wm.max(vseq);
        st.vbuf_spilling = None;
        st.account();
    }
    sh.counters.version_spills.fetch_add(1, Ordering::Relaxed);
    sh.counters
        .version_bytes
        .fetch_add(bytes, Ordering::Relaxed);
    dirty_versions.insert(tablet.id, tablet.clone());
    Ok(())
}

/// Keeps the version buffers within `Config::version_buffers_max_bytes` store-wide: once they
/// hold more, the largest are spilled until they hold at most half of it (so that a store with
/// many small buffers does not spill on every flush).
fn spill_over_bound(sh: &Shared, dirty_versions: &mut HashMap<u64, Arc<Tablet>>) -> Result<()> {
    let bound = sh.cfg.version_buffers_max_bytes as u64;
    if sh.mem.version_buffers.load(Ordering::Relaxed) <= bound {
        return Ok(());
    }
    let mut sizes: Vec<(usize, Arc<Tablet>)> = sh
        .tablets
        .read()
        .values()
        .map(|t| (t.state.lock().vbuf.capacity(), t.clone()))
        .filter(|(c, _)| *c > 0)
        .collect();
    sizes.sort_unstable_by_key(|(c, _)| std::cmp::Reverse(*c));
    for (_, tablet) in sizes {
        if sh.mem.version_buffers.load(Ordering::Relaxed) <= bound / 2 {
            break;
        }
        spill_versions(sh, &tablet, dirty_versions)?;
        sh.counters
            .version_spills_over_bound
            .fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

fn write_primary(sh: &Shared, primary: &Option<(u64, AlignedBuf)>, dirty: &mut bool) -> Result<()> {
    if let Some((offset, buf)) = primary {
        let pl = sh.primary.lock();
        pl.file
            .write_all_at(buf.as_slice(), *offset)
            .map_err(|e| Error::io(&pl.path, e))?;
        sh.counters.primary_writes.fetch_add(1, Ordering::Relaxed);
        sh.counters
            .primary_bytes
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        *dirty = true;
    }
    Ok(())
}

fn sync_all(
    sh: &Shared,
    dirty: &mut HashMap<u64, Arc<Tablet>>,
    dirty_versions: &mut HashMap<u64, Arc<Tablet>>,
    primary_dirty: &mut bool,
) -> Result<()> {
    if let Some(hold) = &sh.cfg.sync_hold_file {
        while hold.exists() {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    let mut files: Vec<SyncFile> = dirty.drain().map(|(_, t)| SyncFile::Log(t)).collect();
    files.extend(dirty_versions.drain().map(|(_, t)| SyncFile::Versions(t)));
    if *primary_dirty {
        let g = sh.primary.lock();
        files.push(SyncFile::Primary(g.file.clone(), g.path.clone()));
    }
    sh.counters
        .syncs
        .fetch_add(files.len() as u64, Ordering::Relaxed);
    if files.len() >= SYNCFS_MIN_FILES && one_file_system(&files) {
        files[0].with_file(|file, path| {
            crate::io::sync_filesystem(file).map_err(|e| Error::io(path, e))
        })?;
        sh.counters.syncfs_calls.fetch_add(1, Ordering::Relaxed);
    } else {
        run_parallel(files, &sh.syncers)?;
    }
    *primary_dirty = false;
    Ok(())
}

/// From this many files to sync on, one syncfs(2) replaces their fdatasyncs: each fdatasync
/// ends with its own device cache flush: logging 1 GiB of 512 B entries over 256 tablets spent
/// 160-305 ms in fdatasync rounds and 47-87 ms in syncfs calls (three alternating probe runs).
/// The price is that other dirty data on the same file system is written back too; a data
/// directory of its own keeps that small.
const SYNCFS_MIN_FILES: usize = 16;

/// Whether every file of a sync round is on the same file system (so that one syncfs covers
/// them all); false if any is elsewhere or cannot be examined.
fn one_file_system(files: &[SyncFile]) -> bool {
    let mut first: Option<u64> = None;
    for f in files {
        let Ok(dev) = f.with_file(|file, _| Ok(crate::io::device_of(file).ok())) else {
            return false;
        };
        let Some(dev) = dev else { return false };
        match first {
            None => first = Some(dev),
            Some(d) if d == dev => {}
            Some(_) => return false,
        }
    }
    first.is_some()
}

/// Largest single write request; a multiple of the page size, so every piece of an aligned
/// buffer stays aligned for O_DIRECT. A busy one-tablet flush (16-28 MiB) is then 4 to 7
/// requests, all in flight at once on the `io_threads`: in six alternating rounds of the bench's
/// one-tablet 512 B row, 4 MiB pieces logged at 0.741-0.778 of raw bandwidth (median 0.756)
/// against 0.719-0.745 (median 0.740) with 1 MiB pieces; the 4 KiB row was the same with both
/// (0.83-0.87).
const WRITE_PIECE_BYTES: usize = 4 << 20;

/// One file of a sync round.
enum SyncFile {
    /// A tablet's secondary log.
    Log(Arc<Tablet>),
    /// A tablet's version log (synced under its lock, which a reorganization that rewrites the
    /// log also takes).
    Versions(Arc<Tablet>),
    /// The primary log.
    Primary(Arc<File>, PathBuf),
}

impl SyncFile {
    fn with_file<T>(&self, f: impl FnOnce(&File, &Path) -> Result<T>) -> Result<T> {
        match self {
            SyncFile::Log(t) => f(&t.file, &t.sec_path),
            SyncFile::Versions(t) => f(&t.verlog.lock().file, &t.ver_path),
            SyncFile::Primary(file, path) => f(file, path),
        }
    }

    fn sync(&self) -> Result<()> {
        self.with_file(|file, path| file.sync_data().map_err(|e| Error::io(path, e)))
    }
}

/// Syncs the files, the first on this thread and the others at once on the store's sync threads
/// (several requests in flight; concurrent fdatasyncs also share journal commits; threads
/// started for each round cost more than a small round's syncs). Returns the first error.
fn run_parallel(files: Vec<SyncFile>, syncers: &IoPool) -> Result<()> {
    let mut files = files.into_iter();
    let Some(first) = files.next() else {
        return Ok(());
    };
    let rest: Vec<SyncFile> = files.collect();
    let left = Arc::new((Mutex::new((rest.len(), None::<Error>)), Condvar::new()));
    for file in rest {
        let left = left.clone();
        syncers.submit(move || {
            let r = file.sync();
            let mut g = left.0.lock();
            g.0 -= 1;
            if let Err(e) = r {
                g.1.get_or_insert(e);
            }
            left.1.notify_all();
        });
    }
    let r = first.sync();
    let mut g = left.0.lock();
    while g.0 > 0 {
        left.1.wait(&mut g);
    }
    match (r, g.1.take()) {
        (Err(e), _) | (Ok(()), Some(e)) => Err(e),
        (Ok(()), None) => Ok(()),
    }
}

/// Reads the manifest (creating it on first open) and reserves this run's sequence range.
pub fn open_manifest(dir: &Path, cfg: &Config) -> Result<u64> {
    let path = dir.join("MANIFEST");
    let existing = match std::fs::read(&path) {
        Ok(bytes) => Some(
            format::Manifest::decode(&bytes)
                .map_err(|e| Error::Corrupt(format!("MANIFEST: {e}")))?,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io(&path, e)),
    };
    let base = match existing {
        Some(m) => {
            if m.segment_bytes != cfg.segment_bytes || m.primary_bytes != cfg.primary_log_bytes {
                return Err(Error::Config(format!(
                    "directory was created with segment_bytes {} and primary_log_bytes {}; the configuration says {} and {}",
                    m.segment_bytes, m.primary_bytes, cfg.segment_bytes, cfg.primary_log_bytes
                )));
            }
            m.seq_base
        }
        None => 1,
    };
    // Each run uses sequence numbers in [base, base + 2^32): the next run starts above them all.
    let next = format::Manifest {
        segment_bytes: cfg.segment_bytes,
        primary_bytes: cfg.primary_log_bytes,
        seq_base: base + (1 << 32),
    };
    let tmp = dir.join("MANIFEST.tmp");
    {
        let f = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        f.write_all_at(&next.encode(), 0)
            .map_err(|e| Error::io(&tmp, e))?;
        f.sync_all().map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
    io::sync_dir(dir).map_err(|e| Error::io(dir, e))?;
    Ok(base)
}

/// Dropped tablets: `(tablet, seq)` pairs; primary-log entries of a tablet older than its drop
/// are ignored on open. A missing file means no tablet was dropped. A file that is present but
/// unreadable, too short, of a length that is not a whole number of pairs, or whose checksum does
/// not match is an error naming it: reading it as empty would bring dropped tablets back.
pub fn read_dropped(dir: &Path) -> Result<HashMap<u64, u64>> {
    let path = dir.join("DROPPED");
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(e) => return Err(Error::io(&path, e)),
    };
    let corrupt = |why: String| {
        Err(Error::Corrupt(format!(
            "{}: {why}; the store was not opened and nothing was changed",
            path.display()
        )))
    };
    if bytes.len() < 4 || (bytes.len() - 4) % 16 != 0 {
        return corrupt(format!(
            "{} bytes is not a checksum followed by 16-byte (tablet, sequence) pairs",
            bytes.len()
        ));
    }
    let stored = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
    let computed = crc32c::crc32c(&bytes[4..]);
    if stored != computed {
        return corrupt(format!(
            "checksum {stored:#010x} does not match its contents ({computed:#010x})"
        ));
    }
    let mut out = HashMap::new();
    for pair in bytes[4..].chunks_exact(16) {
        let t = u64::from_le_bytes(pair[0..8].try_into().expect("8 bytes"));
        let s = u64::from_le_bytes(pair[8..16].try_into().expect("8 bytes"));
        out.insert(t, s);
    }
    Ok(out)
}

pub fn write_dropped(dir: &Path, dropped: &HashMap<u64, u64>) -> Result<()> {
    let mut body = Vec::with_capacity(4 + dropped.len() * 16);
    body.extend_from_slice(&[0u8; 4]);
    let mut pairs: Vec<_> = dropped.iter().collect();
    pairs.sort();
    for (t, s) in pairs {
        body.extend_from_slice(&t.to_le_bytes());
        body.extend_from_slice(&s.to_le_bytes());
    }
    let crc = crc32c::crc32c(&body[4..]);
    body[0..4].copy_from_slice(&crc.to_le_bytes());
    let tmp = dir.join("DROPPED.tmp");
    let path = dir.join("DROPPED");
    {
        let f = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        f.write_all_at(&body, 0).map_err(|e| Error::io(&tmp, e))?;
        f.sync_all().map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
    io::sync_dir(dir).map_err(|e| Error::io(dir, e))
}

/// Opens the primary log and moves its share back into the tablets' SLBs and version buffers:
/// entries newer than what each tablet's secondary log (or version log) already holds.
pub fn recover_primary(sh: &Shared, dropped: &HashMap<u64, u64>) -> Result<u64> {
    let path = sh.dir.join("primary.log");
    let file = io::open_log(&path, sh.io_mode, true).map_err(|e| Error::io(&path, e))?;
    let size = sh.cfg.primary_log_bytes;
    io::preallocate(&file, 0, size).map_err(|e| Error::io(&path, e))?;
    // Walk the chain block by block (reading only what it covers, not the whole file).
    let mut max_seq = 0u64;
    let mut err: Option<Error> = None;
    let mut at = 0u64;
    let mut last_seq = 0u64;
    let mut page = AlignedBuf::new(PAGE_BYTES);
    let mut block = AlignedBuf::new(PAGE_BYTES);
    while at + BLOCK_HEADER_BYTES as u64 <= size {
        let n = io::read_exact_at(&file, page.full_mut(), at).map_err(|e| Error::io(&path, e))?;
        let Ok(h) = BlockHeader::decode(&page.full_mut()[..n], (size - at) as usize) else {
            break;
        };
        if h.write_seq <= last_seq || h.kind != format::BLOCK_PRIMARY {
            break;
        }
        last_seq = h.write_seq;
        max_seq = max_seq.max(h.write_seq);
        let padded = h.padded_len();
        if block.capacity() < padded {
            block = AlignedBuf::new(padded);
        }
        let n = io::read_exact_at(&file, &mut block.full_mut()[..padded], at)
            .map_err(|e| Error::io(&path, e))?;
        block.set_len(n);
        let body = &block.as_slice()
            [BLOCK_HEADER_BYTES..(BLOCK_HEADER_BYTES + h.body_len as usize).min(n)];
        let seq = h.data_seq;
        format::walk_runs(body, |run, run_body| {
            if err.is_some() || dropped.get(&run.tablet).is_some_and(|&d| seq <= d) {
                return;
            }
            let tablet = match sh.get_or_create_tablet(run.tablet) {
                Ok(t) => t,
                Err(e) => {
                    err = Some(e);
                    return;
                }
            };
            let mut st = tablet.state.lock();
            let (data_wm, ver_wm) = (st.data_wm, st.ver_wm);
            format::walk_entries(run_body, |off, e| {
                if seq > ver_wm {
                    st.note_version(format::key_hash(e.key), e.version, e.is_delete());
                    st.vbuf_seq = st.vbuf_seq.max(seq);
                    if st.vbuf.len() > (1 << 20) {
                        crate::tablet::dedup_newest(&mut st.vbuf);
                        st.vbuf_epoch += 1;
                    }
                }
                if seq > data_wm && !e.is_delete() {
                    let len = e.encoded_len();
                    st.slb.extend_from_slice(&run_body[off..off + len]);
                    st.slb_data_seq = st.slb_data_seq.max(seq);
                }
            });
            st.account();
        });
        at += padded as u64;
    }
    let end = at as usize;
    if let Some(e) = err {
        return Err(e);
    }
    let mut pl = sh.primary.lock();
    pl.file = Arc::new(file);
    pl.path = path;
    pl.size = size;
    pl.offset = end as u64;
    pl.prewrite_next = end as u64;
    Ok(max_seq)
}

/// How far ahead of the primary log's offset the pre-writer keeps the log written through.
const PREWRITE_AHEAD_BYTES: u64 = 8 << 20;
/// One pre-write: written and synced at once.
const PREWRITE_CHUNK_BYTES: usize = 1 << 20;
/// The pre-writer starts at least this far past the offset, so that the flushes placed while it
/// writes rarely meet its range.
const PREWRITE_MARGIN_BYTES: u64 = 256 << 10;

/// Pre-writer thread body. The primary log is preallocated, so its blocks start out unwritten
/// extents; the first write of each makes the next fdatasync commit a journal transaction to
/// mark it written, which doubled a durable group commit's sync on ext4 (`commitprobe`: 148 µs
/// against 60-99 µs through a written log). Once a store is asked for a durable write, this
/// thread writes zeros, a synced chunk at a time, ahead of the offset the flushes place primary
/// blocks at (up to [`PREWRITE_AHEAD_BYTES`] ahead) until the log has been written through once
/// (it ends at the end of the file or when the log wraps). It writes only past the offset: the
/// blocks there belong to the previous lap, whose entries a wrap made durable in the secondary
/// logs first, and recovery reads the chain from offset 0 and stops where it ends. A store that
/// reopens starts again at its offset (it keeps no record of how far a previous run got).
pub fn run_prewriter(sh: Arc<Shared>) {
    let mut zeros: Option<AlignedBuf> = None;
    loop {
        let (from, to, file, path) = {
            let mut pl = sh.primary.lock();
            loop {
                if sh.shutdown.load(Ordering::SeqCst) || sh.failed().is_some() {
                    return;
                }
                if pl.lapped || pl.prewrite_next >= pl.size {
                    return;
                }
                if sh.prewrite_wanted.load(Ordering::SeqCst)
                    && pl.prewrite_next < pl.offset + PREWRITE_AHEAD_BYTES
                {
                    break;
                }
                sh.primary_cv.wait_for(&mut pl, Duration::from_millis(100));
            }
            let from = pl
                .prewrite_next
                .max(pl.offset + PREWRITE_MARGIN_BYTES)
                .next_multiple_of(PAGE_BYTES as u64);
            if from >= pl.size {
                return;
            }
            let to = (from + PREWRITE_CHUNK_BYTES as u64).min(pl.size);
            pl.prewrite_busy = Some((from, to));
            (from, to, pl.file.clone(), pl.path.clone())
        };
        let buf = zeros.get_or_insert_with(|| {
            let mut b = AlignedBuf::new(PREWRITE_CHUNK_BYTES);
            b.set_len(PREWRITE_CHUNK_BYTES);
            b
        });
        let r = file
            .write_all_at(&buf.as_slice()[..(to - from) as usize], from)
            .and_then(|()| file.sync_data());
        let mut pl = sh.primary.lock();
        pl.prewrite_busy = None;
        sh.primary_cv.notify_all();
        match r {
            Ok(()) => {
                pl.prewrite_next = to;
                sh.counters
                    .primary_prewritten_bytes
                    .fetch_add(to - from, Ordering::Relaxed);
            }
            Err(e) => {
                // Only a faster sync is lost: the flushes' own writes meet the error, if it lasts.
                tracing::warn!("pre-writing {} failed ({e}); stopped", path.display());
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periodic_syncs_are_half_an_interval_apart_within_one_interval_of_the_append() {
        let half = Duration::from_millis(50);
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        // Idle store: the entry is synced half an interval after its append.
        assert_eq!(periodic_sync_at(ms(100), ms(0), half), ms(150));
        // A sync just ended: the next waits half an interval after it ...
        assert_eq!(periodic_sync_at(ms(100), ms(120), half), ms(170));
        // ... unless the oldest unsynced entry would then be older than a whole interval.
        assert_eq!(periodic_sync_at(ms(100), ms(180), half), ms(200));
        // Backed-up pipeline: entries arrive already old; the sync still waits for the last
        // one's half interval, and never later than one interval after the append.
        assert_eq!(periodic_sync_at(ms(100), ms(130), half), ms(180));
        for last in 0..400 {
            let at = periodic_sync_at(ms(100), ms(last), half);
            assert!(at >= ms(150) && at <= ms(200), "last sync {last}: {at:?}");
        }
    }

    #[test]
    fn a_warmed_pool_hands_out_its_buffers_and_stops_at_its_bound() {
        let pool = BufPool::new(40 << 20);
        pool.warm(8 << 20, 8);
        // The bound (40 MiB) holds five 8 MiB buffers.
        assert_eq!(pool.free.lock().1, 40 << 20);
        assert_eq!(pool.free.lock().0[BufPool::class(8 << 20)].len(), 5);
        let b = pool.get((8 << 20) - 4096);
        assert_eq!(b.capacity(), 8 << 20);
        assert_eq!(pool.free.lock().1, 32 << 20);
        pool.put(b);
        assert_eq!(pool.free.lock().1, 40 << 20);
    }

    #[test]
    fn a_trimmed_pool_keeps_its_largest_buffers_and_counts_what_it_lends() {
        let pool = BufPool::new(64 << 20);
        pool.warm(8 << 20, 2);
        assert_eq!(pool.held_bytes(), 16 << 20);
        let small: Vec<AlignedBuf> = (0..4).map(|_| pool.get(1 << 20)).collect();
        let lent = pool.get(8 << 20);
        assert_eq!(pool.held_bytes(), (16 << 20) + (4 << 20));
        for b in small {
            pool.put(b);
        }
        pool.put(lent);
        assert_eq!(pool.held_bytes(), 20 << 20);
        pool.trim(16 << 20);
        assert_eq!(pool.held_bytes(), 16 << 20);
        assert_eq!(pool.free.lock().0[BufPool::class(8 << 20)].len(), 2);
        pool.trim(0);
        assert_eq!(pool.held_bytes(), 0);
    }
}
