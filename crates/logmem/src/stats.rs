//! Engine statistics: counters updated on the hot paths, and the snapshot the server exports.

use crossbeam_utils::CachePadded;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};

/// Shards of a [`ShardedCounter`]: more than the threads that write at once on the machines
/// this runs on, so that each writer mostly has a cache line of its own.
const COUNTER_SHARDS: usize = 16;

/// A counter that many threads add to on their hot paths and few read: each thread adds to its
/// own cache-line-sized shard (no line bouncing between cores on every write), and a read sums
/// the shards. Sums are exact once the writers are quiet; meanwhile a read may miss additions
/// in flight, as a relaxed load of a single atomic would.
#[derive(Default)]
pub(crate) struct ShardedCounter {
    shards: [CachePadded<AtomicI64>; COUNTER_SHARDS],
}

impl ShardedCounter {
    #[inline]
    pub fn add(&self, delta: i64) {
        self.shards[shard_of_this_thread()].fetch_add(delta, Ordering::Relaxed);
    }

    pub fn sum(&self) -> i64 {
        self.shards.iter().map(|s| s.load(Ordering::Relaxed)).sum()
    }
}

#[inline]
fn shard_of_this_thread() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % COUNTER_SHARDS;
    }
    SHARD.with(|s| *s)
}

#[derive(Default)]
pub(crate) struct Counters {
    /// Bytes appended by writers (objects and tombstones).
    pub new_bytes: ShardedCounter,
    pub tombstone_bytes: CachePadded<AtomicU64>,
    /// Bytes of live entries the cleaner copied into survivors.
    pub cleaner_copied_bytes: AtomicU64,
    /// Bytes of seglets the cleaner returned to the pool.
    pub cleaner_freed_bytes: AtomicU64,
    pub compaction_passes: AtomicU64,
    pub combined_passes: AtomicU64,
    pub compaction_failures: AtomicU64,
    /// Head segments the cleaner closed early to clean them (`cleaner::close_wasteful_heads`).
    pub heads_closed: AtomicU64,
    pub segments_cleaned: AtomicU64,
    pub expired_reclaimed: AtomicU64,
    /// Superseded versions kept for snapshots, ever (bytes); drives the retained-bytes bound.
    pub retained_total: CachePadded<AtomicU64>,
    /// Retained versions the cleaner dropped once no snapshot needed them (bytes).
    pub retained_reclaimed: AtomicU64,
    /// Superseded versions kept in place for pinned scans only (no HISTORIC reference), ever.
    pub kept_in_place: AtomicU64,
    pub snapshots_too_old: AtomicU64,
    pub scan_passes: AtomicU64,
    pub scan_queries: AtomicU64,
    pub scan_sparse_segments: AtomicU64,
    /// Writes that waited for the cleaner to free memory, and the time they waited (ns).
    pub memory_waits: AtomicU64,
    pub memory_wait_ns: AtomicU64,
}

/// A point-in-time view of the engine, for metrics and benchmarks.
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    /// The memory budget (whole seglets).
    pub total_bytes: u64,
    /// Bytes of entries the index references (headers included).
    pub live_bytes: u64,
    /// live_bytes / log_capacity_bytes: how full the log is of what it may hold.
    pub utilisation: f64,
    /// The utilisation up to which overwrite loads are accepted: 0.9 × (log capacity − cleaner
    /// reserve − half a seglet per tablet) / log capacity (docs/architecture.md, "Utilisation
    /// limit"). Writes may fail with out-of-memory above it.
    pub utilisation_limit: f64,
    /// Memory outside the engine charged to the budget (`Engine::set_external_bytes`).
    pub external_bytes: u64,
    /// What the log may use: total_bytes − index_bytes − external_bytes (0 at least).
    pub log_capacity_bytes: u64,
    /// Seglets in use (holding entries, or freed and waiting for readers' grace period), in bytes.
    pub log_used_bytes: u64,
    /// Resident memory of the log: seglets ever touched, and the few MiB beyond them that the
    /// prefaulter populated ahead of use.
    pub log_resident_bytes: u64,
    /// Allocated but unwritten bytes of open segments: the partly written last seglet of each
    /// tablet's head (and of a cleaner's survivor while a pass runs). At most one seglet per
    /// tablet; the cleaner reclaims it once the segment closes.
    pub head_waste_bytes: u64,
    pub total_seglets: u64,
    pub free_seglets: u64,
    /// Free seglets whose memory was never touched (not yet part of the resident set).
    pub untouched_seglets: u64,
    pub reserve_seglets: u64,
    /// Segments holding data (open or closed).
    pub segments: u64,
    pub objects: u64,
    /// Objects among `objects` that carry an expiry time (Redis's `expires`).
    pub expiring_objects: u64,
    /// Their mean expiry time, Unix milliseconds at a resolution of one second (0 when none).
    pub expiring_mean_expire_at_ms: u64,
    pub tablets: u64,
    /// Bytes of hash-index buckets (charged to the budget).
    pub index_bytes: u64,
    pub new_bytes: u64,
    pub tombstone_bytes: u64,
    pub cleaner_copied_bytes: u64,
    pub cleaner_freed_bytes: u64,
    /// (new + copied) / new: bytes the log writes per byte of new data.
    pub write_cost: f64,
    pub compaction_passes: u64,
    pub combined_passes: u64,
    pub compaction_failures: u64,
    /// Head segments the cleaner closed before they were full, to clean them when memory was
    /// low and no closed segment was worth cleaning.
    pub heads_closed: u64,
    pub segments_cleaned: u64,
    pub expired_reclaimed: u64,
    /// Closed segments by utilisation (live / allocated seglet bytes), in tenths: [0,10%), ..., [90%,100%].
    pub segment_utilisation_histogram: [u64; 10],
    /// The engine clock: the newest version handed out.
    pub version_clock: u64,
    /// Bytes of superseded versions currently kept for snapshots (or not yet reclaimed).
    pub retained_bytes: u64,
    pub retained_reclaimed_bytes: u64,
    /// Superseded versions currently kept (HISTORIC index references).
    pub retained_versions: u64,
    /// Superseded versions ever kept in place for scans that had still to read them (RETAINED in
    /// the log, no index reference; garbage once those scans have read their segment).
    pub kept_in_place_versions: u64,
    pub snapshots_open: u64,
    pub snapshots_too_old: u64,
    /// Log-scan passes over a tablet, and the queries they served (shared scans: queries > passes).
    pub scan_passes: u64,
    pub scan_queries: u64,
    /// Segments scans found at least half garbage and handed to the cleaner.
    pub scan_sparse_segments: u64,
    /// Times a write waited for the cleaner to free memory, and the seconds spent waiting (a write
    /// that waits twice counts twice).
    pub memory_waits: u64,
    pub memory_wait_secs: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharded_counter_sums_every_thread_s_additions() {
        let c = ShardedCounter::default();
        std::thread::scope(|s| {
            for t in 0..24i64 {
                let c = &c;
                s.spawn(move || {
                    for i in 0..10_000i64 {
                        c.add(if i % 3 == 0 { -t } else { t + 1 });
                    }
                });
            }
        });
        let expected: i64 = (0..24i64)
            .map(|t| {
                (0..10_000i64)
                    .map(|i| if i % 3 == 0 { -t } else { t + 1 })
                    .sum::<i64>()
            })
            .sum();
        assert_eq!(c.sum(), expected);
    }
}
