//! Configuration of a backup store. Defaults follow DXRAM (digest 000, Appendix A) except where
//! noted; every size is in bytes and every fraction is of a tablet log's capacity.

use std::time::Duration;

/// How reorganization picks segments of a log (digest 000 §6.4–6.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentStrategy {
    /// DXRAM's default: the largest age × fill degree.
    AgeTimesUtilisation,
    /// RAMCloud/LFS cost-benefit, `(1 − u) · age / (1 + u)`, with u the estimated live fraction
    /// (fill minus the dead bytes that placement notes reveal; see `Config::tracks_locations`).
    CostBenefit,
    /// Uniformly random among used segments (the baseline).
    Random,
}

/// When written data is made durable with fdatasync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPolicy {
    /// Default: a flush ends with fdatasync once the oldest written but unsynced entry was
    /// appended half a `flush_interval` ago, and an idle writer syncs at that moment by itself.
    /// An entry is thus durable within about one interval of its append plus the write time,
    /// like Redis's `appendfsync everysec` with a 100 ms period; when flushes follow each other
    /// faster (a busy store flushes by size), several share one sync, and syncs stay half an
    /// interval apart unless an entry would otherwise pass a whole interval unsynced.
    Periodic,
    /// Only when a caller waits for [`crate::Stage::Durable`] (or at close). Written data
    /// survives a process crash but not a power cut until then.
    OnDemand,
}

/// Sizes, thresholds and policies of a store. [`Config::default`] sizes the buffers for
/// throughput (the benches use it: 32 MiB write buffer, 96 MiB of flush arenas warmed at open);
/// a server sizes them from its memory budget with [`Config::for_memory_budget`].
#[derive(Debug, Clone)]
pub struct Config {
    /// Write buffer (ring of `write_buffer_chunks` chunks). Appends block when it is full.
    pub write_buffer_bytes: usize,
    pub write_buffer_chunks: usize,
    /// A flush starts when this much is buffered ...
    pub flush_threshold_bytes: usize,
    /// ... or when the oldest buffered entry is this old.
    pub flush_interval: Duration,
    /// Two-level logging: small per-tablet batches go to the primary log and the tablet's
    /// secondary-log buffer. When false every batch goes straight to its secondary log.
    pub two_level: bool,
    /// Size of each tablet's secondary-log buffer (DXRAM: 128 KiB). A small batch that would
    /// overflow it goes straight to the secondary log together with the buffer's content.
    pub secondary_buffer_bytes: usize,
    /// A tablet's batch of at least this many bytes goes straight to its secondary log instead of
    /// the primary log + buffer. DXRAM ties it to the buffer size (128 KiB, 32 flash pages); here
    /// it is lower because the writes of one flush are issued `io_threads` at a time, and with
    /// several requests in flight 32 KiB writes already run at the disk's sequential bandwidth
    /// (docs/benchmarks/history/backup.md), so writing such a batch twice would only halve throughput.
    pub direct_threshold_bytes: usize,
    /// Primary log size (a circular file).
    pub primary_log_bytes: u64,
    /// Segment size of secondary logs (no entry spans two segments).
    pub segment_bytes: u64,
    /// Capacity of one tablet's secondary log (DXRAM: 2 × 256 MiB zone).
    pub tablet_log_capacity_bytes: u64,
    /// A buffer this full of a segment opens a fresh segment (DXRAM: 75%).
    pub new_segment_fraction: f64,
    /// Keys per version buffer before it is spilled to the version log.
    pub version_buffer_entries: usize,
    /// Spill when the version buffer is this full (DXRAM: 65%).
    pub version_spill_fraction: f64,
    /// Reorganization thresholds, fractions of the log capacity.
    pub reorg_activation: f64,
    pub reorg_prompt: f64,
    /// Placing data into a log fuller than this first waits for a reorganization of it
    /// (back-pressure that keeps utilisation bounded when writes outpace the cleaner).
    pub reorg_throttle: f64,
    /// While flushes carry data, a visit cleans a log only above this fill and only down to it,
    /// not down to `reorg_activation`: a segment cleaned later holds more garbage, so each
    /// segment read frees more (DXRAM measured 2.98 MB freed per 8 MB segment with activation
    /// at 55% and 3.95 MB at 65%; here the bench's uniform updates read 17–20% less, see
    /// docs/architecture.md "Cleaning late while writes arrive"). Once no flush has carried data
    /// for `reorg_quiet_after`, logs are cleaned down to the activation threshold again, which
    /// restores the headroom for bursts. Taken as at most `reorg_prompt` and `reorg_throttle`
    /// and at least `reorg_activation` (so 0 cleans down to the activation threshold always).
    pub reorg_busy_target: f64,
    /// See `reorg_busy_target`.
    pub reorg_quiet_after: Duration,
    pub reorg_enabled: bool,
    pub reorg_strategy: SegmentStrategy,
    /// Fraction of a log's segments cleaned per periodic visit (DXRAM: 33%).
    pub reorg_segments_per_visit: f64,
    /// Read every segment the placement notes show all dead and check that it holds no current
    /// entry before freeing it (tests; off by default, as the point of the counts is to skip
    /// those reads).
    pub reorg_verify_dead: bool,
    /// Reorganizer threads. Each works on a different tablet log at a time (DXRAM has one per
    /// backup). See docs/architecture.md for the measurements behind the default of 2.
    pub reorg_threads: usize,
    /// Threads that read and parse segments during replay. Each reads a segment, then parses
    /// it; with more threads than cores, reads stay in flight while the others parse. On two
    /// cores, six alternating replays of 256 MiB took 0.745–1.117 s (median 0.81) with 4 threads
    /// against 0.756–1.125 s (median 1.03) with 2.
    pub replay_threads: usize,
    pub sync: SyncPolicy,
    /// Threads that issue the writes and fdatasyncs of one flush concurrently.
    pub io_threads: usize,
    /// Largest value accepted (DESIGN.md default 1 MiB); bounded by half a segment.
    pub value_max_bytes: usize,
    /// Use O_DIRECT when the file system allows it.
    pub direct_io: bool,
    /// Bytes of flush arenas (each the write buffer's size, rounded up to a power of two; a
    /// flush's blocks are laid out in one) allocated and touched at open, as DXRAM fills its
    /// buffer pool at start. Buffers of 2 MiB and more are backed by transparent huge pages, and
    /// first touching fresh huge pages in the middle of a flush costs more than the writes gain:
    /// in alternating bench rows, one tablet's 4 KiB entries logged at 0.72 of raw bandwidth
    /// with 40 MiB of buffers filled at open against 0.46–0.54 without. The default is the three
    /// arenas a busy pipeline holds at once (one being filled by the processor, one queued, one
    /// being written): with two, the first busy second faulted in a third, and 256 tablets'
    /// 512 B entries logged at 1210–1283 MB/s against 1324–1356 MB/s with three (three
    /// alternating rounds). The pool keeps the third arena once used, so this only moves that
    /// memory to the open. Only used when an arena is at least 2 MiB; at most the pool's bound
    /// (`pool_bytes`).
    pub pool_warm_bytes: usize,
    /// Bound of the pool of flush arenas and block buffers (free buffers kept for reuse). A
    /// flush's arena is the write buffer's size rounded up to a power of two, at most a quarter
    /// of this. Once the store is at rest (`idle_after`) the pool keeps only `pool_warm_bytes`.
    pub pool_bytes: usize,
    /// Bound of the pool of replay buffers: the segments a replay read are kept for the next
    /// replay (a recovery's restores follow one another), so that each does not fault in and
    /// zero fresh memory for the logs it reads. Replays in flight hold their logs besides. Freed
    /// once the store is at rest (`idle_after`).
    pub replay_pool_bytes: usize,
    /// Store-wide bound of the version buffers (32 bytes a record, counted by the capacity the
    /// buffers hold). When a flush leaves them above it, the largest buffers are spilled to
    /// their version logs until they hold at most half of it, besides each buffer's own
    /// threshold (`version_buffer_entries` × `version_spill_fraction`).
    pub version_buffers_max_bytes: usize,
    /// Store-wide bound of the placement notes waiting for the reorganizer (32 bytes each).
    /// Notes beyond it are counted and dropped (`Stats::notes_dropped`): the dead-byte estimate
    /// gets coarser and the segments involved are read before they are freed.
    pub notes_max_bytes: usize,
    /// Bound of the reorganizer's version tables (32-byte slots, at most three quarters full)
    /// kept between visits. After a visit, tables are dropped, largest first, until the rest fit;
    /// the table of the tablet being reorganized is held in full while it is, whatever its size,
    /// and then dropped too if it alone exceeds the bound. A dropped table costs the next visit
    /// of its log a read of the whole version log, and the log's segments are read before they
    /// are freed until emptied once more.
    pub version_caches_max_bytes: usize,
    /// Store-wide bound of the secondary-log buffers. A small batch that would take them above
    /// it goes straight to its secondary log with its tablet's buffer. A buffer's memory is
    /// released when it is emptied.
    pub secondary_buffers_max_bytes: usize,
    /// Segment-sized buffers each reorganizer thread uses while it cleans: 4 (two to read,
    /// so that the next segment is read while one is cleaned, and two for survivors, so that
    /// one is written while the other fills) or 2 (one of each: reads and writes of survivors
    /// are not overlapped with cleaning). Released once the store is at rest.
    pub reorg_segment_buffers: usize,
    /// The store is at rest once no entry has been appended for this long. It then spills every
    /// version buffer to its version log, drops the reorganizer's version tables, notes and
    /// segment buffers, and trims the flush-arena pool to `pool_warm_bytes`, so that what it
    /// keeps in memory no longer grows with the keys it has logged. (Secondary-log buffers keep
    /// their entries: they are bounded store-wide by `secondary_buffers_max_bytes`.)
    pub idle_after: Duration,
    /// Test knob: while this file exists, the store does not sync (nothing becomes
    /// [`crate::Stage::Durable`]; writes still reach the files). Lets a test hold a backup's disk
    /// sync back. None in every real configuration.
    pub sync_hold_file: Option<std::path::PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            write_buffer_bytes: 32 << 20,
            write_buffer_chunks: 8,
            flush_threshold_bytes: 16 << 20,
            flush_interval: Duration::from_millis(100),
            two_level: true,
            secondary_buffer_bytes: 128 << 10,
            direct_threshold_bytes: 32 << 10,
            primary_log_bytes: 256 << 20,
            segment_bytes: 8 << 20,
            tablet_log_capacity_bytes: 512 << 20,
            new_segment_fraction: 0.75,
            version_buffer_entries: 1 << 16,
            version_spill_fraction: 0.65,
            reorg_activation: 0.60,
            reorg_prompt: 0.75,
            reorg_throttle: 0.72,
            reorg_busy_target: 0.68,
            reorg_quiet_after: Duration::from_millis(500),
            reorg_enabled: true,
            reorg_strategy: SegmentStrategy::AgeTimesUtilisation,
            reorg_segments_per_visit: 0.33,
            reorg_verify_dead: false,
            reorg_threads: 2,
            replay_threads: 4,
            sync: SyncPolicy::Periodic,
            io_threads: 8,
            value_max_bytes: ramlog_common::VALUE_SIZE_MAX_BYTES_DEFAULT,
            direct_io: true,
            pool_warm_bytes: 96 << 20,
            pool_bytes: 128 << 20,
            replay_pool_bytes: 128 << 20,
            version_buffers_max_bytes: 64 << 20,
            notes_max_bytes: 64 << 20,
            version_caches_max_bytes: 512 << 20,
            secondary_buffers_max_bytes: 64 << 20,
            reorg_segment_buffers: 4,
            idle_after: Duration::from_secs(1),
            sync_hold_file: None,
        }
    }
}

impl Config {
    /// A configuration whose buffers are sized from `budget_bytes`, the memory the server may
    /// use in all (its `--memory`), so that the store keeps a small share of it: the write
    /// buffer (1/128 of the budget), the flush-arena pool (1/128) and the store-wide bounds of
    /// secondary-log buffers, version buffers and placement notes (1/256 each) and version
    /// tables (1/128) add up to about 3.6% of the budget from 256 MiB up (10.5% at 64 MiB,
    /// where minimum sizes apply), plus the reorganizer's segment buffers while it cleans (two
    /// 8 MiB segments with one thread below 4 GiB, four per thread with two threads from
    /// 4 GiB). At rest only the write buffer and the warmed part of the pool (half of it, from
    /// 1 GiB) remain. Every part is at most what [`Config::default`] uses. On-disk parameters
    /// (`segment_bytes`, `primary_log_bytes`, `tablet_log_capacity_bytes`) are the default's, so
    /// a directory opens under any budget. The write buffer always holds an entry with a value
    /// of the default `value_max_bytes` (1 MiB); a caller that raises `value_max_bytes` must
    /// raise `write_buffer_bytes` with it (`validate` says so). The sizes for three budgets are
    /// in docs/architecture.md ("Memory of the backup store").
    pub fn for_memory_budget(budget_bytes: u64) -> Config {
        const MIB: usize = 1 << 20;
        let base = Config::default();
        let budget = usize::try_from(budget_bytes).unwrap_or(usize::MAX);
        let share = |divisor: usize, min: usize, max: usize| (budget / divisor).clamp(min, max);
        // Each write-buffer chunk holds the largest entry; two chunks at least.
        let entry_max = base.entry_max_bytes();
        let write_buffer_bytes = share(128, 2 * entry_max.next_multiple_of(64 << 10), 32 * MIB);
        let write_buffer_chunks = (write_buffer_bytes / entry_max).clamp(2, 8);
        let pool_bytes = share(128, 2 * MIB, 128 * MIB);
        // Warmed arenas from 1 GiB; two reorganizer threads with read-ahead from 4 GiB (one
        // thread cleans faster than a server's network path fills the logs below that).
        let warm = budget >= 1 << 30;
        let large = budget >= 4 << 30;
        let secondary_buffer_bytes = share(2048, 16 << 10, base.secondary_buffer_bytes);
        Config {
            write_buffer_bytes,
            write_buffer_chunks,
            flush_threshold_bytes: write_buffer_bytes / 2,
            pool_bytes,
            pool_warm_bytes: if warm { pool_bytes / 2 } else { 0 },
            replay_pool_bytes: share(16, 8 * MIB, 256 * MIB),
            secondary_buffer_bytes,
            direct_threshold_bytes: base.direct_threshold_bytes.min(secondary_buffer_bytes),
            secondary_buffers_max_bytes: share(256, 512 << 10, base.secondary_buffers_max_bytes),
            version_buffers_max_bytes: share(256, 512 << 10, base.version_buffers_max_bytes),
            notes_max_bytes: share(256, 512 << 10, base.notes_max_bytes),
            version_caches_max_bytes: share(128, MIB, base.version_caches_max_bytes),
            reorg_threads: if large { base.reorg_threads } else { 1 },
            reorg_segment_buffers: if large { 4 } else { 2 },
            ..base
        }
    }

    /// The fill a visit cleans a log down to while writes arrive (`reorg_busy_target`, bounded
    /// by the other thresholds).
    pub fn reorg_busy_level(&self) -> f64 {
        self.reorg_busy_target
            .min(self.reorg_prompt)
            .min(self.reorg_throttle)
            .max(self.reorg_activation)
    }

    /// Checks the relations between the sizes; returns a description of the first violation.
    pub fn validate(&self) -> Result<(), String> {
        let page = crate::format::PAGE_BYTES as u64;
        if self.segment_bytes < 64 * 1024
            || !self.segment_bytes.is_multiple_of(page)
            || self.segment_bytes > (1 << 31)
        {
            return Err(
                "segment_bytes must be a multiple of 4 KiB between 64 KiB and 2 GiB".into(),
            );
        }
        if self.tablet_log_capacity_bytes < 2 * self.segment_bytes {
            return Err("tablet_log_capacity_bytes must hold at least two segments".into());
        }
        if self.primary_log_bytes < 4 * page || !self.primary_log_bytes.is_multiple_of(page) {
            return Err("primary_log_bytes must be a multiple of 4 KiB and at least 16 KiB".into());
        }
        if self.write_buffer_chunks < 2
            || self.write_buffer_bytes / self.write_buffer_chunks < 64 * 1024
        {
            return Err("write buffer needs at least two chunks of 64 KiB".into());
        }
        if self.entry_max_bytes() > self.write_buffer_bytes / self.write_buffer_chunks {
            return Err(
                "a write-buffer chunk must hold the largest entry (raise write_buffer_bytes)"
                    .into(),
            );
        }
        if self.flush_threshold_bytes == 0 || self.flush_threshold_bytes > self.write_buffer_bytes {
            return Err("flush_threshold_bytes must be in 1..=write_buffer_bytes".into());
        }
        if self.direct_threshold_bytes > self.secondary_buffer_bytes {
            return Err("direct_threshold_bytes must be at most secondary_buffer_bytes".into());
        }
        if (self.secondary_buffer_bytes as u64) > self.segment_bytes / 2 {
            return Err("secondary_buffer_bytes must be at most half a segment".into());
        }
        if (self.primary_log_bytes as usize)
            < 2 * self.flush_threshold_bytes.max(self.write_buffer_bytes)
        {
            return Err("primary_log_bytes must be at least twice the write buffer".into());
        }
        if ![
            self.reorg_activation,
            self.reorg_prompt,
            self.reorg_throttle,
            self.reorg_busy_target,
        ]
        .iter()
        .all(|f| (0.0..=1.0).contains(f))
        {
            return Err("reorganization thresholds are fractions in 0..=1".into());
        }
        if self.reorg_threads == 0 || self.reorg_threads > 64 {
            return Err("reorg_threads must be in 1..=64".into());
        }
        if self.reorg_segment_buffers != 2 && self.reorg_segment_buffers != 4 {
            return Err("reorg_segment_buffers must be 2 or 4".into());
        }
        if self.pool_warm_bytes > self.pool_bytes {
            return Err("pool_warm_bytes must be at most pool_bytes".into());
        }
        if self.version_buffer_entries < 16 {
            return Err("version_buffer_entries must be at least 16".into());
        }
        Ok(())
    }

    /// Whether placements may be noted (whenever reorganization is on; each log then notes only
    /// while it pays, `TabletState::noting`). The notes give each segment its count of entries
    /// not yet superseded, so that a segment with none is freed without being read, and the
    /// dead-byte estimate that cost-benefit selection weighs. Noting costs a key hash per entry
    /// on the write path and a table update in the reorganizer.
    pub fn tracks_locations(&self) -> bool {
        self.reorg_enabled
    }

    /// Largest encoded entry: bounded by half a segment (DXRAM) and by the value limit.
    pub fn entry_max_bytes(&self) -> usize {
        let by_segment =
            (self.segment_bytes as usize / 2).saturating_sub(crate::format::BLOCK_HEADER_BYTES);
        by_segment.min(crate::format::entry_bytes_max(
            crate::format::KEY_MAX_BYTES,
            self.value_max_bytes,
        ))
    }
}
