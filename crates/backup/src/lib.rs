//! ramlog-backup: the backup log store (DXRAM's two-level logging, digest 000; DESIGN.md "The
//! backup"). It keeps tablets durable on this server's disk — other masters' tablets, or the single
//! server's own — and replays them after a crash.
//!
//! What it hides: a bounded ring write buffer; a flush pipeline that sorts entries by tablet and
//! sends large batches straight to the tablet's secondary log and small batches of many tablets in
//! one write to the primary log plus per-tablet secondary-log buffers; 8 MiB segments placed as in
//! DXRAM, preallocated, written with O_DIRECT when the file system allows it (checked at run time;
//! otherwise buffered writes + fdatasync); CRC32C on every entry; version buffers spilled to
//! version logs; deletes recorded as versions (never as tombstones in secondary logs); a background
//! reorganizer; parallel replay. Byte layouts are in `docs/formats.md` ("Backup logs").
//!
//! # API
//! ```no_run
//! use ramlog_backup::{Backup, Config, Entry, Stage};
//! let backup = Backup::open("/var/lib/ramlog/backup".as_ref(), Config::default())?;
//! // Entries of one tablet, in version order; `value: None` is a delete.
//! let ticket = backup.append(7, &[
//!     Entry { key: b"k1", value: Some(b"v1"), version: 1, expiry: 0 },
//!     Entry { key: b"k0", value: None, version: 2, expiry: 0 },
//! ])?;
//! assert!(backup.poll(ticket)? >= Stage::Buffered);   // cheap: atomics only
//! backup.wait(ticket, Stage::Written)?;                // survives a process crash
//! backup.wait(ticket, Stage::Durable)?;                // fdatasync'd: survives a power cut
//! let report = backup.replay(7, |e| println!("{:?} = {:?} @{}", e.key, e.value, e.version))?;
//! assert_eq!(report.lost_keys, 0);
//! backup.drop_tablet(7)?;
//! println!("{:?}", backup.stats());
//! backup.close()?;
//! # Ok::<(), ramlog_backup::Error>(())
//! ```
//!
//! # Durability semantics (single-server persistence)
//! * `append` returns once the entries are in the write buffer ([`Stage::Buffered`]); it blocks
//!   while the buffer is full (back-pressure) and fails with a clear error once the store failed
//!   (for example [`Error::DiskFull`]) or was closed.
//! * A flush starts every `flush_interval` (100 ms by default) or when `flush_threshold_bytes` are
//!   buffered. With the default [`SyncPolicy::Periodic`] the finisher syncs (fdatasync) once the
//!   oldest written but unsynced entry is half an interval old, at the end of a flush or by
//!   itself when idle, so an appended entry is durable within about one interval plus the write
//!   time: Redis's `appendfsync everysec`, with a 100 ms period. Back-to-back flushes of a busy
//!   store share one sync, and its syncs stay half an interval apart unless an entry would
//!   otherwise pass a whole interval unsynced. [`Stage::Written`] (in the files; survives kill -9) comes first and
//!   [`Stage::Durable`] (fdatasync done; survives power loss) follows within that bound.
//! * `durable` mode: call [`Backup::wait`] with [`Stage::Durable`]; it triggers a flush at once
//!   and returns only after fdatasync, so acknowledging after it is power-loss safe.
//! * After a restart, [`Backup::replay`] returns every entry that had reached `Written`, with the
//!   newest version per live key; nothing deleted or stale comes back, and nothing unwritten is
//!   invented. Entries only `Buffered` at the crash may or may not be present.
//!
//! # Threads and back-pressure
//! Four kinds of thread per store: the flusher (drains the write buffer, sorts by tablet, routes to the
//! primary or secondary logs, places buffers in segments), the writer (issues one flush's writes
//! on `io_threads` threads), the finisher (applies the written flush's versions, spills version
//! buffers, syncs with fdatasync or, over many files, one syncfs, and publishes progress while
//! the writer goes on with the next flush; a wrapping primary log, a checkpoint or the close
//! waits for it) and the reorganizers (`reorg_threads`, two by default, each on a different log;
//! activation 60%, prompt 75%, urgent when a log is full; while writes arrive a log is cleaned
//! only above `reorg_busy_target`, 68%; a flush into a log above `reorg_throttle`, 72%, first
//! waits for it). Appends block only on a full write buffer.
//! A failed write (for example a full disk) makes the store refuse appends with that error; what
//! was written before stays intact and replays after a reopen.
//!
//! # Memory
//! [`Backup::memory`] counts what the store holds, by part ([`MemoryUsage`]). Fixed buffers are
//! sized by the [`Config`] ([`Config::for_memory_budget`] sizes them from a budget); version
//! buffers, placement notes, the reorganizer's version tables and the secondary-log buffers are
//! bounded store-wide; and once nothing has been appended for `idle_after` the store comes to
//! rest: every version buffer is spilled to its version log, and the version tables, notes and
//! reorganizer buffers are dropped, so that nothing it keeps grows with
//! the keys it has logged (docs/architecture.md, "Memory of the backup store").
//!
//! # Limits
//! Keys ≤ 64 KiB, values ≤ `value_max_bytes` (1 MiB) and ≤ half a segment. A key is identified in
//! version buffers and logs by a 128-bit hash (xxh3-128). The version log keeps one record per key
//! ever written to a tablet (deletes included) until the tablet is dropped.

pub mod config;
mod engine;
pub mod error;
pub mod format;
pub mod io;
mod iopool;
mod reorg;
mod replay;
pub use replay::{GroupedReplay, KeyFilter, KeyGroups, ReplaySink, Streamed};
mod tablet;
#[doc(hidden)]
pub mod testkit;
mod vtable;
mod wbuf;

pub use config::{Config, SegmentStrategy, SyncPolicy};
pub use error::{Error, Result};
pub use io::IoMode;
pub use reorg::ReorgOutcome;
pub use replay::{ReplayEntry, ReplayReport};

use engine::Shared;
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One entry to log: a put (`value: Some`) or a delete (`value: None`) at a version. `expiry` is
/// carried opaquely and returned by replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry<'a> {
    pub key: &'a [u8],
    pub value: Option<&'a [u8]>,
    pub version: u64,
    pub expiry: u64,
}

/// What [`Backup::replay_merged_counted`] hands its callback: first the count, then each entry.
#[derive(Debug, Clone, Copy)]
pub enum Replayed<'a> {
    /// How many keys the replay found (an upper bound on the entries that follow).
    Count(u64),
    Entry(ReplayEntry<'a>),
}

/// Identifies an append; compare with [`Backup::poll`] or wait with [`Backup::wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(pub u64);

/// How far an append has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// In the write buffer (lost if the process dies).
    Buffered,
    /// Written to the log files (survives a process crash).
    Written,
    /// Written and fdatasync'd (survives a power cut).
    Durable,
}

/// Counters and gauges of a backup store.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub io_mode: &'static str,
    pub tablets: usize,
    pub appended_entries: u64,
    pub flushes: u64,
    pub primary_writes: u64,
    pub primary_bytes: u64,
    pub secondary_writes: u64,
    pub secondary_bytes: u64,
    pub version_spills: u64,
    /// Of `version_spills`, those because the version buffers held more than
    /// `Config::version_buffers_max_bytes` store-wide.
    pub version_spills_over_bound: u64,
    pub version_bytes: u64,
    /// Times the store came to rest (`Config::idle_after`): version buffers spilled, the version
    /// tables, notes and reorganizer buffers dropped and the flush-arena pool trimmed.
    pub rests: u64,
    /// Reorganizer version tables dropped (over `Config::version_caches_max_bytes`, or at rest).
    pub version_caches_dropped: u64,
    /// Files synced (each counts, also when a sync round used one syncfs).
    pub syncs: u64,
    /// Sync rounds done with one syncfs(2) because many files were dirty.
    pub syncfs_calls: u64,
    pub reorg_runs: u64,
    /// Reorganization rounds that began while another reorganizer thread was in a round.
    pub reorg_overlapping_rounds: u64,
    pub reorg_segments_cleaned: u64,
    pub reorg_bytes_freed: u64,
    /// Bytes of segments the reorganizers read, including any read ahead that a visit then did
    /// not need.
    pub reorg_bytes_read: u64,
    /// Segments freed without being read: the placement notes showed every entry in them
    /// superseded or deleted (included in `reorg_segments_cleaned`).
    pub reorg_segments_unread: u64,
    /// Segments whose live count the notes contradicted (more entries dead than counted in); they
    /// are read before being freed. Expected 0.
    pub reorg_live_mismatches: u64,
    /// With `Config::reorg_verify_dead`: segments counted all dead that held a current entry
    /// (left in place). Expected 0.
    pub reorg_dead_verify_failures: u64,
    /// Bytes the reorganizers wrote to secondary logs: survivors' segments and the zero pages
    /// that free cleaned segments (version-log compactions count in `version_bytes`).
    pub reorg_bytes_written: u64,
    pub reorg_corrupt_entries: u64,
    /// Torn version-log tails cut off at open, and damaged version-log bytes found at open.
    pub open_version_bytes_cut: u64,
    pub open_version_bytes_damaged: u64,
    /// Bytes of the primary log written through ahead of its use, once durable writes were
    /// asked for (so that their syncs find no unwritten extents to convert).
    pub primary_prewritten_bytes: u64,
    pub urgent_requests: u64,
    pub prompt_requests: u64,
    /// Times a flush waited for the cleaner because a log was above `reorg_throttle`.
    pub throttle_waits: u64,
    /// Time flushes spent in those waits.
    pub throttle_wait_ms: u64,
    /// Sum of used bytes over all secondary logs.
    pub used_bytes: u64,
    /// Highest fill degree (used / capacity) of any tablet log.
    pub max_utilisation: f64,
    /// Dead bytes in the secondary logs as the reorganizer estimates them from placement notes
    /// (logs noting placements only), and notes dropped because too many were waiting.
    pub dead_bytes_estimate: u64,
    pub notes_dropped: u64,
    /// Tablet logs whose placements are being noted (`TabletState::noting`).
    pub logs_noting: usize,
    pub written_lsn: u64,
    pub durable_lsn: u64,
    /// Milliseconds spent: producers blocked on a full write buffer, sorting and copying,
    /// writing, applying versions, syncing.
    pub producer_wait_ms: u64,
    pub process_ms: u64,
    pub write_ms: u64,
    pub version_ms: u64,
    pub sync_ms: u64,
    pub failed: Option<String>,
}

/// Memory a backup store holds, in bytes, by part: what is allocated (capacities of vectors,
/// buffers handed out or pooled), not configured maxima. [`Backup::memory`] reads it from
/// atomics and two short locks, cheap enough to call every 100 ms.
///
/// Fixed parts, sized by the [`Config`] ([`Config::for_memory_budget`] sizes them from a
/// budget); parts bounded store-wide; and none that grows with the keys logged once the store
/// is at rest (`Config::idle_after`), where only the fixed parts and `tablet_metadata` remain.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// The write buffer's chunks (`write_buffer_bytes`, allocated at open) and their side
    /// tables (batch descriptors and a 32-byte version record per buffered entry; freed at rest).
    pub write_buffer: u64,
    /// Flush arenas and block buffers, pooled or in flight. The pool keeps at most `pool_bytes`,
    /// `pool_warm_bytes` of it from the open, and is trimmed to `pool_warm_bytes` at rest. The
    /// flushes in flight (at most three: one being built, one being written, one queued) hold
    /// their buffers besides: each up to twice its data (buffers come in powers of two), and a
    /// flush carries at most the write buffer's content plus the secondary-log buffers it
    /// writes out.
    pub flush_arenas: u64,
    /// The reorganizer threads' buffers: `reorg_segment_buffers` segments per thread while it
    /// cleans, its work lists, and its version-log and notes read buffers. Freed at rest. (A
    /// thread counts what it keeps between visits, at the end of each visit.)
    pub reorg_buffers: u64,
    /// Secondary-log buffers: at most `secondary_buffer_bytes` of entries per tablet and
    /// `secondary_buffers_max_bytes` store-wide; an emptied buffer is freed. (Kept at rest: a
    /// buffer written out at every pause would put a padded block into its log each time.)
    pub secondary_buffers: u64,
    /// Version buffers (32 bytes a record), bounded store-wide by `version_buffers_max_bytes`
    /// (over it the largest are spilled to their version logs) and per tablet by
    /// `version_buffer_entries`; all spilled and freed at rest.
    pub version_buffers: u64,
    /// The reorganizer's version tables (32-byte slots, at most three quarters full): at most
    /// `version_caches_max_bytes` between visits, plus, during a visit, the table of the log
    /// being reorganized (one entry per key of that tablet). Dropped at rest.
    pub version_caches: u64,
    /// Placement notes waiting for the reorganizer (32 bytes each): at most `notes_max_bytes` of
    /// notes wait store-wide; counted by capacity, which a growing vector may double, plus what
    /// a tablet keeps between absorptions (a 64th of the bound each); dropped at rest.
    pub notes: u64,
    /// Per-tablet state: segment metadata (about 70 bytes per allocated segment) and the
    /// tablet's state record. Grows with the tablets and their logs' segments, not with keys.
    pub tablet_metadata: u64,
    /// Segment buffers of replays: the logs each replay in flight read (a restore holds its
    /// tablet's logs until it is done; a shared replay until its last partition took its keys),
    /// and up to `replay_pool_bytes` kept for the next replay; freed at rest. Not in
    /// [`MemoryUsage::total`].
    pub replay_buffers: u64,
}

impl MemoryUsage {
    /// The sum of the parts a server charges to its budget: all but `replay_buffers`, which a
    /// recovery's restores need while they run (charging them would shrink the room the
    /// coordinator planned the restore by).
    pub fn total(&self) -> u64 {
        self.write_buffer
            + self.flush_arenas
            + self.reorg_buffers
            + self.secondary_buffers
            + self.version_buffers
            + self.version_caches
            + self.notes
            + self.tablet_metadata
    }
}

/// A backup log store in one directory. Cheap to share behind an `Arc`; every method takes `&self`.
pub struct Backup {
    sh: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    closed: AtomicBool,
}

impl Backup {
    /// Opens (or creates) the store in `dir`: reads the manifest, rebuilds segment positions from
    /// the block headers, cuts torn tails, and moves the primary log's share back into the
    /// tablets' secondary-log buffers. Starts the flush and reorganization threads.
    pub fn open(dir: &Path, config: Config) -> Result<Backup> {
        config.validate().map_err(Error::Config)?;
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let io_mode = if config.direct_io {
            io::probe_direct(dir)
        } else {
            io::IoMode::Buffered
        };
        // Read before the manifest is rewritten, so that a corrupt file leaves the directory as it was.
        let dropped = engine::read_dropped(dir)?;
        let seq_base = engine::open_manifest(dir, &config)?;
        let pool_bytes = config.pool_bytes;
        let replay_pool_bytes = config.replay_pool_bytes;
        let config_io_threads = config.io_threads;
        let sh = Arc::new(Shared {
            dir: dir.to_path_buf(),
            wb: wbuf::WriteBuffer::new(
                config.write_buffer_bytes,
                config.write_buffer_chunks,
                config.flush_threshold_bytes,
                config.flush_interval,
            ),
            cfg: config,
            io_mode,
            seq: AtomicU64::new(seq_base),
            tablets: RwLock::new(BTreeMap::new()),
            primary: Mutex::new(engine::PrimaryLog {
                file: Arc::new(std::fs::File::open(dir).map_err(|e| Error::io(dir, e))?),
                path: dir.join("primary.log"),
                size: 0,
                offset: 0,
                prewrite_next: 0,
                prewrite_busy: None,
                lapped: false,
            }),
            progress: Mutex::new(engine::Progress {
                written_lsn: 0,
                durable_lsn: 0,
                failed: None,
            }),
            progress_cv: Condvar::new(),
            written_lsn: AtomicU64::new(0),
            durable_lsn: AtomicU64::new(0),
            sync_requested: AtomicBool::new(false),
            checkpoint_requested: AtomicBool::new(false),
            pool: engine::BufPool::new(pool_bytes),
            counters: engine::Counters::default(),
            reorg_queue: Mutex::new(VecDeque::new()),
            reorg_cv: Condvar::new(),
            reorg_busy: Mutex::new(HashSet::new()),
            reorg_caches: Mutex::new(HashMap::new()),
            reorg_done: Mutex::new(0),
            reorg_done_cv: Condvar::new(),
            shutdown: AtomicBool::new(false),
            sent_lsn: AtomicU64::new(0),
            notes_visible_seq: AtomicU64::new(0),
            notes_pending: Arc::default(),
            reorg_rounds_active: AtomicU64::new(0),
            last_data_flush: Mutex::new(None),
            dropped: Mutex::new(dropped.clone()),
            mem: Arc::default(),
            replay_pool: Arc::new(engine::BufPool::with_small_pages(replay_pool_bytes)),
            prewrite_wanted: AtomicBool::new(false),
            primary_cv: Condvar::new(),
            syncers: iopool::IoPool::new(config_io_threads.saturating_sub(1), "ramlog-backup-sync"),
        });
        // Tablets with files on disk first (their watermarks decide the primary log's share).
        let mut ids = Vec::new();
        for ent in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
            let ent = ent.map_err(|e| Error::io(dir, e))?;
            let name = ent.file_name();
            let name = name.to_string_lossy();
            if let Some(hex) = name.strip_prefix('t').and_then(|n| n.strip_suffix(".sec")) {
                if let Ok(id) = u64::from_str_radix(hex, 16) {
                    ids.push(id);
                }
            }
        }
        for id in ids {
            sh.get_or_create_tablet(id)?;
        }
        engine::recover_primary(&sh, &dropped)?;
        let arena = engine::arena_bytes(&sh.cfg);
        if arena >= 2 << 20 {
            sh.pool.warm(arena, sh.cfg.pool_warm_bytes / arena);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let mut threads = Vec::new();
        let s1 = sh.clone();
        threads.push(spawn("ramlog-backup-flush", move || {
            engine::run_processor(s1, tx)
        })?);
        let (tx2, rx2) = std::sync::mpsc::sync_channel(1);
        let s2 = sh.clone();
        threads.push(spawn("ramlog-backup-write", move || {
            engine::run_writer(s2, rx, tx2)
        })?);
        let s4 = sh.clone();
        threads.push(spawn("ramlog-backup-finish", move || {
            engine::run_finisher(s4, rx2)
        })?);
        let s5 = sh.clone();
        threads.push(spawn("ramlog-backup-prewrite", move || {
            engine::run_prewriter(s5)
        })?);
        if sh.cfg.reorg_enabled {
            for i in 0..sh.cfg.reorg_threads {
                let s3 = sh.clone();
                threads.push(spawn(&format!("ramlog-backup-reorg-{i}"), move || {
                    reorg::run_reorganizer(s3, i)
                })?);
            }
        }
        tracing::info!(
            "backup opened in {} using {}",
            dir.display(),
            io_mode.name()
        );
        Ok(Backup {
            sh,
            threads: Mutex::new(threads),
            closed: AtomicBool::new(false),
        })
    }

    /// Which I/O mode is in use (O_DIRECT or the buffered fallback).
    pub fn io_mode(&self) -> IoMode {
        self.sh.io_mode
    }

    pub fn config(&self) -> &Config {
        &self.sh.cfg
    }

    /// Appends entries of one tablet (in version order). Returns when they are in the write
    /// buffer; blocks while it is full.
    pub fn append(&self, tablet: u64, entries: &[Entry<'_>]) -> Result<Ticket> {
        let limit = self.sh.cfg.entry_max_bytes();
        // The one definition of a valid entry (`ramlog_common::limits`), as the backup's
        // replication decoder checks it.
        let limits = ramlog_common::EntryLimits::for_backup(self.sh.cfg.value_max_bytes);
        for e in entries {
            let value_len = e.value.map_or(0, |v| v.len());
            match limits.check(e.key.len(), value_len) {
                Ok(()) => {}
                Err(ramlog_common::LimitError::KeyTooLarge { len, max }) => {
                    return Err(Error::KeyTooLarge {
                        bytes: len,
                        limit: max,
                    })
                }
                Err(ramlog_common::LimitError::ValueTooLarge { .. }) => {
                    let bytes = format::entry_bytes(e.key.len(), value_len, e.version, e.expiry);
                    return Err(Error::EntryTooLarge { bytes, limit });
                }
            }
            let len = format::entry_bytes(e.key.len(), value_len, e.version, e.expiry);
            if len > limit {
                return Err(Error::EntryTooLarge { bytes: len, limit });
            }
        }
        if let Some(msg) = self.sh.failed() {
            return Err(Error::Failed(msg));
        }
        let lsn = self.sh.wb.append(tablet, entries)?;
        Ok(Ticket(lsn))
    }

    /// Why the store failed (disk full, I/O error), once it has: it then refuses appends, and
    /// what it had written stays readable by a later open. None while it works.
    pub fn failure(&self) -> Option<String> {
        self.sh.failed()
    }

    /// How far `ticket` has come (atomics only). Fails if the store failed before reaching it.
    pub fn poll(&self, ticket: Ticket) -> Result<Stage> {
        if self.sh.durable_lsn.load(Ordering::SeqCst) >= ticket.0 {
            return Ok(Stage::Durable);
        }
        if self.sh.written_lsn.load(Ordering::SeqCst) >= ticket.0 {
            return Ok(Stage::Written);
        }
        if let Some(msg) = self.sh.failed() {
            return Err(Error::Failed(msg));
        }
        Ok(Stage::Buffered)
    }

    /// Blocks until `ticket` has reached `stage`. Waiting for `Durable` starts a flush at once.
    pub fn wait(&self, ticket: Ticket, stage: Stage) -> Result<()> {
        if stage == Stage::Durable {
            self.want_prewrite();
        }
        self.wait_for(ticket, stage)
    }

    fn wait_for(&self, ticket: Ticket, stage: Stage) -> Result<()> {
        if self.poll(ticket)? >= stage {
            return Ok(());
        }
        if stage == Stage::Durable {
            self.sh.sync_requested.store(true, Ordering::SeqCst);
        }
        if stage >= Stage::Written {
            self.sh.wb.request_flush();
        }
        let mut p = self.sh.progress.lock();
        loop {
            let reached = match stage {
                Stage::Buffered => true,
                Stage::Written => p.written_lsn >= ticket.0,
                Stage::Durable => p.durable_lsn >= ticket.0,
            };
            if reached {
                return Ok(());
            }
            if let Some(msg) = &p.failed {
                return Err(Error::Failed(msg.clone()));
            }
            if self.closed.load(Ordering::SeqCst) {
                return Err(Error::Closed);
            }
            if self
                .sh
                .progress_cv
                .wait_for(&mut p, Duration::from_millis(200))
                .timed_out()
            {
                // The flush may have been taken before our request: ask again.
                if stage == Stage::Durable {
                    self.sh.sync_requested.store(true, Ordering::SeqCst);
                }
                self.sh.wb.request_flush();
            }
        }
    }

    /// Starts the pre-writer (`engine::run_prewriter`) on the first wait for `Stage::Durable`:
    /// a store that makes writes durable on request is written through ahead of its primary
    /// log's offset, so that those requests' syncs convert no preallocated extents.
    fn want_prewrite(&self) {
        if !self.sh.prewrite_wanted.load(Ordering::Relaxed)
            && !self.sh.prewrite_wanted.swap(true, Ordering::SeqCst)
        {
            let _g = self.sh.primary.lock();
            self.sh.primary_cv.notify_all();
        }
    }

    /// Flushes everything appended so far and waits until it is durable (a flush at shutdown
    /// does not start the pre-writer, as a durable wait does).
    pub fn flush(&self) -> Result<()> {
        let t = Ticket(self.sh.wb.lsn());
        self.sh.sync_requested.store(true, Ordering::SeqCst);
        self.wait_for(t, Stage::Durable)
    }

    /// Writes every secondary-log buffer to its secondary log and spills every version buffer, so
    /// that a restart needs nothing from the primary log. Then waits until durable.
    pub fn checkpoint(&self) -> Result<()> {
        self.sh.checkpoint_requested.store(true, Ordering::SeqCst);
        self.flush()
    }

    /// Replays one tablet: `f` sees exactly the newest version of every live key. Everything
    /// appended before the call is included (it is flushed first).
    pub fn replay(&self, tablet: u64, mut f: impl FnMut(ReplayEntry<'_>)) -> Result<ReplayReport> {
        self.flush_for_replay()?;
        match self.sh.tablet(tablet) {
            Some(t) => replay::replay_tablet(&self.sh, &t, &mut f),
            None => Ok(ReplayReport::default()),
        }
    }

    /// Replays several tablets as one (a tablet whose log continues in others): the newest
    /// version of each key over all of them wins, deletes included, and `f` sees each live key
    /// once. Tablets this store does not hold are skipped.
    pub fn replay_merged(
        &self,
        tablets: &[u64],
        f: impl FnMut(ReplayEntry<'_>),
    ) -> Result<ReplayReport> {
        let mut f = f;
        self.replay_merged_counted(tablets, |r| {
            if let Replayed::Entry(e) = r {
                f(e)
            }
        })
    }

    /// [`Backup::replay_merged`], which first tells `f` how many keys it may yield at most
    /// ([`Replayed::Count`]: every key it found, deleted ones included), before the first entry:
    /// a restore sizes its index with it.
    pub fn replay_merged_counted(
        &self,
        tablets: &[u64],
        f: impl FnMut(Replayed<'_>),
    ) -> Result<ReplayReport> {
        self.replay_merged_filtered(tablets, None, f)
    }

    /// [`Backup::replay_merged_counted`] of only the keys `keep` keeps (a restore of some of the
    /// slots the tablets hold): the others are skipped before they are merged.
    pub fn replay_merged_filtered(
        &self,
        tablets: &[u64],
        keep: Option<KeyFilter<'_>>,
        mut f: impl FnMut(Replayed<'_>),
    ) -> Result<ReplayReport> {
        let ts = self.tablets_to_replay(tablets)?;
        if ts.is_empty() {
            return Ok(ReplayReport::default());
        }
        let f = std::cell::RefCell::new(&mut f);
        replay::replay_merged(
            &self.sh,
            &ts,
            keep,
            &mut |n| (f.borrow_mut())(Replayed::Count(n)),
            &mut |e| (f.borrow_mut())(Replayed::Entry(e)),
        )
    }

    /// A replay of the keys `keep` keeps whose merge is left to `sink`, for a restore into an
    /// engine tablet (see [`replay::replay_streamed`]): several threads hand it their checked
    /// entries as they read them. When [`Streamed::trusted`] is false (damaged logs), discard
    /// what `sink` took and use [`Backup::replay_merged_filtered`].
    pub fn replay_streamed(
        &self,
        tablets: &[u64],
        keep: Option<KeyFilter<'_>>,
        sink: &dyn ReplaySink,
    ) -> Result<Streamed> {
        let ts = self.tablets_to_replay(tablets)?;
        if ts.is_empty() {
            return Ok(Streamed {
                trusted: true,
                ..Default::default()
            });
        }
        replay::replay_streamed(&self.sh, &ts, keep, sink)
    }

    /// [`Backup::replay_merged_filtered`] for several groups of keys at once (the recovery
    /// partitions one restorer restores from the same logs): the logs are read and merged once,
    /// and each group is yielded on its own later ([`GroupedReplay::take`]).
    pub fn replay_grouped(
        &self,
        tablets: &[u64],
        group_of: KeyGroups<'_>,
        groups: usize,
    ) -> Result<GroupedReplay> {
        let ts = self.tablets_to_replay(tablets)?;
        replay::replay_grouped(&self.sh, &ts, group_of, groups)
    }

    /// The tablets of `tablets` this store holds, once everything appended so far is written.
    fn tablets_to_replay(&self, tablets: &[u64]) -> Result<Vec<Arc<tablet::Tablet>>> {
        self.flush_for_replay()?;
        Ok(tablets
            .iter()
            .filter_map(|&id| self.sh.tablet(id))
            .collect())
    }

    /// Replays every tablet, in tablet order.
    pub fn replay_all(&self, mut f: impl FnMut(ReplayEntry<'_>)) -> Result<ReplayReport> {
        self.flush_for_replay()?;
        let tablets: Vec<_> = self.sh.tablets.read().values().cloned().collect();
        let mut total = ReplayReport::default();
        for t in tablets {
            let r = replay::replay_tablet(&self.sh, &t, &mut f)?;
            total.add(&r);
        }
        Ok(total)
    }

    fn flush_for_replay(&self) -> Result<()> {
        let t = Ticket(self.sh.wb.lsn());
        if self.sh.failed().is_some() {
            // A failed store still replays what is on disk.
            return Ok(());
        }
        self.wait(t, Stage::Written)
    }

    /// Opens the logs of these tablets now, creating the missing ones, so that the first flush
    /// that reaches a new tablet does not create its files on the write path (appending to a
    /// tablet opens it anyway).
    pub fn open_tablets(&self, ids: impl IntoIterator<Item = u64>) -> Result<()> {
        for id in ids {
            self.sh.get_or_create_tablet(id)?;
        }
        Ok(())
    }

    /// Ids of the tablets this store holds.
    pub fn tablets(&self) -> Vec<u64> {
        self.sh.tablets.read().keys().copied().collect()
    }

    /// Removes a tablet and its files. The caller must not append to it concurrently; appending
    /// after this returns starts a new, empty tablet.
    pub fn drop_tablet(&self, tablet: u64) -> Result<()> {
        self.flush()?;
        let Some(t) = self.sh.tablet(tablet) else {
            return Ok(());
        };
        let _guard = t.reorg_lock.lock();
        self.sh.tablets.write().remove(&tablet);
        // Primary-log entries of this tablet older than `seq` are ignored from now on.
        let seq = self.sh.seq.fetch_add(1, Ordering::SeqCst);
        {
            let mut d = self.sh.dropped.lock();
            d.insert(tablet, seq);
            engine::write_dropped(&self.sh.dir, &d)?;
        }
        for p in [&t.sec_path, &t.ver_path] {
            match std::fs::remove_file(p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(p, e)),
            }
        }
        io::sync_dir(&self.sh.dir).map_err(|e| Error::io(&self.sh.dir, e))
    }

    /// Reorganizes one tablet log now (all segments), in the caller's thread. For tests and
    /// maintenance; the background thread does this on its own.
    pub fn reorganize(&self, tablet: u64) -> Result<ReorgOutcome> {
        self.flush()?;
        reorg::reorganize(&self.sh, tablet, true)
    }

    /// Fill degree (used / capacity) of one tablet log.
    pub fn utilisation(&self, tablet: u64) -> f64 {
        self.sh.tablet(tablet).map_or(0.0, |t| {
            t.state.lock().used_bytes() as f64 / t.capacity_bytes() as f64
        })
    }

    /// Memory the store holds now, by part (see [`MemoryUsage`]).
    pub fn memory(&self) -> MemoryUsage {
        let m = &self.sh.mem;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MemoryUsage {
            write_buffer: self.sh.wb.held_bytes(self.sh.cfg.write_buffer_bytes),
            flush_arenas: self.sh.pool.held_bytes(),
            reorg_buffers: l(&m.reorg_buffers),
            secondary_buffers: l(&m.secondary_buffers),
            version_buffers: l(&m.version_buffers),
            version_caches: l(&m.version_caches),
            notes: l(&m.notes),
            tablet_metadata: l(&m.tablet_metadata),
            replay_buffers: self.sh.replay_pool.held_bytes(),
        }
    }

    pub fn stats(&self) -> Stats {
        let c = &self.sh.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let tablets: Vec<_> = self.sh.tablets.read().values().cloned().collect();
        let mut used = 0u64;
        let mut max_util = 0.0f64;
        let (mut dead, mut dropped, mut noting) = (0u64, 0u64, 0usize);
        for t in &tablets {
            let st = t.state.lock();
            let u = st.used_bytes();
            dead += st.segments.iter().map(|s| s.dead).sum::<u64>();
            dropped += st.notes_dropped;
            noting += usize::from(st.noting);
            drop(st);
            used += u;
            max_util = max_util.max(u as f64 / t.capacity_bytes() as f64);
        }
        Stats {
            io_mode: self.sh.io_mode.name(),
            tablets: tablets.len(),
            appended_entries: l(&c.appended_entries),
            flushes: l(&c.flushes),
            primary_writes: l(&c.primary_writes),
            primary_bytes: l(&c.primary_bytes),
            secondary_writes: l(&c.secondary_writes),
            secondary_bytes: l(&c.secondary_bytes),
            version_spills: l(&c.version_spills),
            version_spills_over_bound: l(&c.version_spills_over_bound),
            rests: l(&c.rests),
            version_caches_dropped: l(&c.version_caches_dropped),
            version_bytes: l(&c.version_bytes),
            syncs: l(&c.syncs),
            syncfs_calls: l(&c.syncfs_calls),
            reorg_runs: l(&c.reorg_runs),
            reorg_overlapping_rounds: l(&c.reorg_overlapping_rounds),
            reorg_segments_cleaned: l(&c.reorg_segments),
            reorg_bytes_freed: l(&c.reorg_bytes_freed),
            reorg_bytes_read: l(&c.reorg_bytes_read),
            reorg_segments_unread: l(&c.reorg_segments_unread),
            reorg_live_mismatches: l(&c.reorg_live_mismatches),
            reorg_dead_verify_failures: l(&c.reorg_dead_verify_failures),
            reorg_bytes_written: l(&c.reorg_bytes_written),
            reorg_corrupt_entries: l(&c.reorg_corrupt_entries),
            open_version_bytes_cut: l(&c.open_version_bytes_cut),
            open_version_bytes_damaged: l(&c.open_version_bytes_damaged),
            primary_prewritten_bytes: l(&c.primary_prewritten_bytes),
            urgent_requests: l(&c.urgent_requests),
            prompt_requests: l(&c.prompt_requests),
            throttle_waits: l(&c.throttle_waits),
            throttle_wait_ms: l(&c.throttle_wait_ns) / 1_000_000,
            used_bytes: used,
            max_utilisation: max_util,
            dead_bytes_estimate: dead,
            notes_dropped: dropped,
            logs_noting: noting,
            written_lsn: self.sh.written_lsn.load(Ordering::SeqCst),
            durable_lsn: self.sh.durable_lsn.load(Ordering::SeqCst),
            producer_wait_ms: self.sh.wb.producer_wait_ns() / 1_000_000,
            process_ms: l(&c.process_ns) / 1_000_000,
            write_ms: l(&c.write_ns) / 1_000_000,
            version_ms: l(&c.version_ns) / 1_000_000,
            sync_ms: l(&c.sync_ns) / 1_000_000,
            failed: self.sh.failed(),
        }
    }

    /// Flushes everything (a checkpoint), stops the threads and closes the files.
    pub fn close(self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        // Closing the write buffer makes the processor run one last checkpoint flush and exit.
        self.sh.wb.close();
        let threads = std::mem::take(&mut *self.threads.lock());
        let mut it = threads.into_iter();
        // Processor, writer and finisher first (they finish the last flush), then the
        // reorganizer.
        let flush_threads: Vec<_> = it.by_ref().take(3).collect();
        for h in flush_threads {
            let _ = h.join();
        }
        self.sh.shutdown.store(true, Ordering::SeqCst);
        self.sh.reorg_cv.notify_all();
        self.sh.primary_cv.notify_all();
        for h in it {
            let _ = h.join();
        }
        let _ = deadline;
        match self.sh.failed() {
            Some(msg) => Err(Error::Failed(msg)),
            None => Ok(()),
        }
    }
}

impl Drop for Backup {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| Error::Io {
            path: name.into(),
            source: e,
        })
}
