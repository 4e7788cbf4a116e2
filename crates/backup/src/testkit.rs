//! Deterministic workloads shared by the crash-test child process and the tests that check it.
//! Not part of the stable API.

use rand::{Rng, SeedableRng};

/// An owned entry (`value: None` is a delete).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedEntry {
    pub key: Vec<u8>,
    pub value: Option<Vec<u8>>,
    pub version: u64,
    pub expiry: u64,
}

impl OwnedEntry {
    pub fn as_entry(&self) -> crate::Entry<'_> {
        crate::Entry {
            key: &self.key,
            value: self.value.as_deref(),
            version: self.version,
            expiry: self.expiry,
        }
    }
}

/// The value a crash workload writes for (key, version): checkable without storing it.
pub fn value_for(key: &[u8], version: u64) -> Vec<u8> {
    let h = crate::format::key_hash(key) as u64 ^ version.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let len = 1 + (h % 300) as usize;
    (0..len)
        .map(|i| (h >> (i % 8 * 8)) as u8 ^ i as u8)
        .collect()
}

/// Batch `n` of round `round` of the crash workload: (tablet, entries).
pub fn crash_batch(seed: u64, round: u64, n: u64) -> (u64, Vec<OwnedEntry>) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(
        seed ^ (round << 48) ^ n.wrapping_mul(0x2545_F491_4F6C_DD1D),
    );
    let tablet = rng.gen_range(0..4u64);
    let count = rng.gen_range(1..24u64);
    let entries = (0..count)
        .map(|i| {
            let key = format!("key-{}", rng.gen_range(0..400u32)).into_bytes();
            let version = (round << 40) | (n << 6) | i;
            let value = if rng.gen_bool(0.1) {
                None
            } else {
                Some(value_for(&key, version))
            };
            OwnedEntry {
                key,
                value,
                version,
                expiry: version ^ 0xFF,
            }
        })
        .collect();
    (tablet, entries)
}

/// The small configuration crash tests use: tiny segments so that reorganization runs often.
pub fn crash_config() -> crate::Config {
    crate::Config {
        write_buffer_bytes: 1 << 20,
        write_buffer_chunks: 4,
        flush_threshold_bytes: 256 << 10,
        flush_interval: std::time::Duration::from_millis(5),
        secondary_buffer_bytes: 16 << 10,
        direct_threshold_bytes: 16 << 10,
        primary_log_bytes: 4 << 20,
        segment_bytes: 64 << 10,
        tablet_log_capacity_bytes: 4 << 20,
        version_buffer_entries: 256,
        reorg_activation: 0.05,
        reorg_prompt: 0.3,
        // Clean down to the activation threshold while writes arrive too.
        reorg_busy_target: 0.0,
        ..crate::Config::default()
    }
}

/// The crash configuration with tiny memory bounds and a short rest delay, so that store-wide
/// spills of version buffers, dropped version tables and notes, and rests happen all the time.
pub fn crash_config_resting() -> crate::Config {
    crate::Config {
        version_buffers_max_bytes: 4 << 10,
        version_caches_max_bytes: 16 << 10,
        notes_max_bytes: 4 << 10,
        secondary_buffers_max_bytes: 32 << 10,
        reorg_segment_buffers: 2,
        reorg_threads: 1,
        pool_bytes: 2 << 20,
        pool_warm_bytes: 0,
        idle_after: std::time::Duration::from_millis(20),
        ..crash_config()
    }
}
