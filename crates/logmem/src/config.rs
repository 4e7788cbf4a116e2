//! Engine configuration.

use crate::WriteObserver;
use std::sync::Arc;

/// How the cleaner chooses between compaction (one segment, in place) and combined cleaning (several
/// segments by cost-benefit, survivors sorted by age).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Balancer {
    /// RAMCloud's default: combined cleaning when tombstones not known to be dead are at least this
    /// share of the freeable space, `T / (1 - L) >= ratio`; compaction otherwise.
    TombstoneRatio(f64),
    /// The combined cleaner runs this percentage of passes (0..=100); compaction the rest.
    FixedDuty(u8),
}

impl Default for Balancer {
    fn default() -> Self {
        Balancer::TombstoneRatio(0.40)
    }
}

#[derive(Clone)]
pub struct EngineConfig {
    /// Fixed memory budget for the log, split into 64 KiB seglets.
    pub memory_bytes: u64,
    /// Seglets per full segment (128 gives RAMCloud's 8 MiB segments). Tests use small segments.
    pub segment_seglets: usize,
    pub key_size_max_bytes: usize,
    pub value_size_max_bytes: usize,
    /// Background cleaner threads (0 disables background cleaning; writers then clean inline).
    pub cleaner_threads: usize,
    pub balancer: Balancer,
    /// Seglets writers may not take, kept for cleaner survivors. None picks max(one segment + 4, 1%).
    pub cleaner_reserve_seglets: Option<usize>,
    /// Live data a combined pass may copy, in full segments (RAMCloud: 10).
    pub combined_pass_segments_max: usize,
    /// How long a writer waits for the cleaner to free memory before failing with out-of-memory.
    pub oom_wait_ms: u64,
    /// Receives every tablet's writes in version order.
    pub write_observer: Option<Arc<dyn WriteObserver>>,
    /// A snapshot older than this fails with "snapshot too old" and stops holding memory.
    pub snapshot_max_age_ms: u64,
    /// A snapshot fails with "snapshot too old" once more than this many bytes of superseded
    /// versions were kept since it was taken. None picks 1/8 of the memory budget.
    pub snapshot_max_retained_bytes: Option<u64>,
    /// How long a shared scan waits for other scans of the same tablet to join its pass.
    pub scan_batch_wait_us: u64,
    /// Threads one scan pass over a tablet may use: its segments are split among them (0 = one per
    /// core). Passes that return records in log order with a record limit stay on one thread.
    pub scan_threads: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            memory_bytes: 1 << 30,
            segment_seglets: 128,
            key_size_max_bytes: ramlog_common::KEY_SIZE_MAX_BYTES_DEFAULT,
            value_size_max_bytes: ramlog_common::VALUE_SIZE_MAX_BYTES_DEFAULT,
            cleaner_threads: 1,
            balancer: Balancer::default(),
            cleaner_reserve_seglets: None,
            combined_pass_segments_max: 10,
            oom_wait_ms: 2000,
            write_observer: None,
            snapshot_max_age_ms: 60_000,
            snapshot_max_retained_bytes: None,
            scan_batch_wait_us: 200,
            scan_threads: 0,
        }
    }
}

impl std::fmt::Debug for EngineConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineConfig")
            .field("memory_bytes", &self.memory_bytes)
            .field("segment_seglets", &self.segment_seglets)
            .field("key_size_max_bytes", &self.key_size_max_bytes)
            .field("value_size_max_bytes", &self.value_size_max_bytes)
            .field("cleaner_threads", &self.cleaner_threads)
            .field("balancer", &self.balancer)
            .field("cleaner_reserve_seglets", &self.cleaner_reserve_seglets)
            .field("write_observer", &self.write_observer.is_some())
            .field("snapshot_max_age_ms", &self.snapshot_max_age_ms)
            .field(
                "snapshot_max_retained_bytes",
                &self.snapshot_max_retained_bytes,
            )
            .field("scan_batch_wait_us", &self.scan_batch_wait_us)
            .field("scan_threads", &self.scan_threads)
            .finish()
    }
}
