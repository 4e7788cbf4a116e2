//! Snapshots (MVCC): a snapshot is a read version; superseded versions stay readable while an open
//! snapshot may need them, and no longer.
//!
//! Opening a snapshot takes every tablet's write lock for a moment, reads the clock and registers the
//! version. Versions are handed out under a tablet's write lock, so afterwards every write with a
//! version at or below the snapshot is complete, and every later writer sees the snapshot when it
//! decides whether the object it replaces must be kept (RETAINED, see `entry`).
//!
//! Bounds: a snapshot older than `snapshot_max_age_ms`, or one since whose opening more than
//! `snapshot_max_retained_bytes` of superseded versions were kept, is released ("snapshot too old"):
//! it stops holding memory, and using it fails with [`EngineError::SnapshotTooOld`]. When writers run
//! out of memory, the oldest snapshot is released before a write fails.

use crate::engine::{now_ms, Inner};
use crate::error::EngineError;
use crate::TableId;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Segments a scan has pinned and not yet released.
#[derive(Default)]
pub(crate) struct PinSet {
    pub segments: Mutex<Vec<u32>>,
}

pub(crate) struct SnapshotEntry {
    pub id: u64,
    pub version: u64,
    /// Set for the snapshot of one scan of this table (`Engine::scan_now`): nobody reads
    /// through it but that scan, so it keeps superseded versions only in this table, and in a
    /// tablet only until the scan's pass has read the segment holding them.
    pub scan_table: Option<TableId>,
    /// Set once the scan a `scan_table` snapshot serves has started; a second use is refused.
    pub scan_used: std::sync::atomic::AtomicBool,
    /// Wall-clock time of the snapshot: objects that expired before it are not visible.
    pub wall_ms: u64,
    opened: Instant,
    retained_at_open: u64,
    /// Why it was released early; None while valid.
    released: Mutex<Option<String>>,
    /// Pins of the scans reading at this snapshot; dropped when the snapshot is released.
    pinsets: Mutex<Vec<Arc<PinSet>>>,
}

impl SnapshotEntry {
    pub fn released_reason(&self) -> Option<String> {
        self.released.lock().clone()
    }
}

#[derive(Default)]
pub(crate) struct Snapshots {
    open: Mutex<BTreeMap<(u64, u64), Arc<SnapshotEntry>>>,
    /// Newest open snapshot version + 1; 0 when none is open. Read by writers.
    newest_plus1: AtomicU64,
    /// The same over snapshots that are not a single scan's (`SnapshotEntry::scan_table`).
    general_newest_plus1: AtomicU64,
    /// Oldest open snapshot version + 1; 0 when none is open.
    oldest_plus1: AtomicU64,
    next_id: AtomicU64,
}

impl Snapshots {
    /// Whether an open snapshot may read an object of version `version` (it is at or above it).
    #[inline]
    pub fn any_at_or_above(&self, version: u64) -> bool {
        self.newest_plus1.load(Ordering::Acquire) > version
    }

    /// Whether an open snapshot that is not a single scan's may read an object of `version`.
    #[inline]
    pub fn general_at_or_above(&self, version: u64) -> bool {
        self.general_newest_plus1.load(Ordering::Acquire) > version
    }

    /// The oldest open snapshot's version, if any (lock-free).
    #[inline]
    pub fn oldest_open(&self) -> Option<u64> {
        self.oldest_plus1.load(Ordering::Acquire).checked_sub(1)
    }

    /// Whether an open snapshot s has `from <= s < to` (a retained version is still needed).
    pub fn any_within(&self, from: u64, to: u64) -> bool {
        if from >= to {
            return false;
        }
        self.open.lock().range((from, 0)..(to, 0)).next().is_some()
    }

    /// (version, id) of the open scan snapshots of `table`.
    pub fn scan_snapshots_of(&self, table: TableId) -> Vec<(u64, u64)> {
        self.open
            .lock()
            .values()
            .filter(|e| e.scan_table == Some(table))
            .map(|e| (e.version, e.id))
            .collect()
    }

    pub fn open_count(&self) -> usize {
        self.open.lock().len()
    }

    /// Versions of the open snapshots, sorted.
    pub fn open_versions(&self) -> Vec<u64> {
        self.open.lock().keys().map(|(v, _)| *v).collect()
    }

    fn refresh_newest(&self, open: &BTreeMap<(u64, u64), Arc<SnapshotEntry>>) {
        let newest = open.keys().next_back().map(|(v, _)| v + 1).unwrap_or(0);
        self.newest_plus1.store(newest, Ordering::Release);
        let general = open
            .values()
            .rev()
            .find(|e| e.scan_table.is_none())
            .map(|e| e.version + 1)
            .unwrap_or(0);
        self.general_newest_plus1.store(general, Ordering::Release);
        let oldest = open.keys().next().map(|(v, _)| v + 1).unwrap_or(0);
        self.oldest_plus1.store(oldest, Ordering::Release);
    }

    /// Registers a snapshot at `version` (of one scan of `scan_table`, if given). The caller holds
    /// every tablet's write lock.
    pub fn register(
        &self,
        version: u64,
        retained_total: u64,
        scan_table: Option<TableId>,
    ) -> Arc<SnapshotEntry> {
        let entry = Arc::new(SnapshotEntry {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            version,
            scan_table,
            scan_used: std::sync::atomic::AtomicBool::new(false),
            wall_ms: now_ms(),
            opened: Instant::now(),
            retained_at_open: retained_total,
            released: Mutex::new(None),
            pinsets: Mutex::new(Vec::new()),
        });
        let mut open = self.open.lock();
        open.insert((version, entry.id), entry.clone());
        self.refresh_newest(&open);
        entry
    }

    /// Removes a snapshot (closed by its owner, or released early with `reason`) and drops its pins.
    /// Returns whether it was still open.
    pub fn release(&self, inner: &Inner, entry: &SnapshotEntry, reason: Option<String>) -> bool {
        let was_open = {
            let mut open = self.open.lock();
            let was = open.remove(&(entry.version, entry.id)).is_some();
            self.refresh_newest(&open);
            was
        };
        if let Some(reason) = reason {
            let mut released = entry.released.lock();
            if released.is_none() {
                *released = Some(reason);
            }
        }
        let pinsets: Vec<Arc<PinSet>> = std::mem::take(&mut *entry.pinsets.lock());
        for p in pinsets {
            inner.unpin_all(&p);
        }
        if entry.scan_table.is_some() {
            inner.forget_scan_snapshot(entry);
        }
        if was_open && inner.retained_bytes.load(Ordering::Relaxed) > 0 {
            inner.note_retention_released();
        }
        was_open
    }

    /// Attaches a scan's pins to its snapshot, so that releasing the snapshot releases them.
    pub fn attach_pins(&self, entry: &SnapshotEntry, pins: Arc<PinSet>) {
        entry.pinsets.lock().push(pins);
    }

    /// Fails if the snapshot was released or is past a bound (then releases it).
    pub fn check(&self, inner: &Inner, entry: &SnapshotEntry) -> Result<(), EngineError> {
        if let Some(reason) = overdue(inner, entry) {
            if self.release(inner, entry, Some(reason)) {
                inner
                    .counters
                    .snapshots_too_old
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        match entry.released_reason() {
            Some(reason) => Err(EngineError::SnapshotTooOld {
                version: entry.version,
                reason,
            }),
            None => Ok(()),
        }
    }

    /// Releases every snapshot past its age or retained-bytes bound (the cleaner calls this).
    pub fn release_overdue(&self, inner: &Inner) {
        let entries: Vec<Arc<SnapshotEntry>> = self.open.lock().values().cloned().collect();
        for e in entries {
            let _ = self.check(inner, &e);
        }
    }

    /// Whether an open snapshot's scans pin segments (which the cleaner then cannot free).
    pub fn any_pinning(&self) -> bool {
        self.open.lock().values().any(|e| {
            e.pinsets
                .lock()
                .iter()
                .any(|p| !p.segments.lock().is_empty())
        })
    }

    /// Releases the oldest open snapshot (memory is needed); false if none is open.
    pub fn release_oldest(&self, inner: &Inner, reason: &str) -> bool {
        let oldest = self.open.lock().values().next().cloned();
        match oldest {
            Some(e) => {
                if self.release(inner, &e, Some(reason.to_string())) {
                    inner
                        .counters
                        .snapshots_too_old
                        .fetch_add(1, Ordering::Relaxed);
                }
                true
            }
            None => false,
        }
    }
}

fn overdue(inner: &Inner, entry: &SnapshotEntry) -> Option<String> {
    let age_ms = entry.opened.elapsed().as_millis() as u64;
    if age_ms > inner.config.snapshot_max_age_ms {
        return Some(format!(
            "it is {age_ms} ms old (limit {} ms)",
            inner.config.snapshot_max_age_ms
        ));
    }
    let retained = inner
        .counters
        .retained_total
        .load(Ordering::Relaxed)
        .saturating_sub(entry.retained_at_open);
    let limit = inner.snapshot_retained_limit();
    if retained > limit {
        return Some(format!(
            "{retained} bytes of superseded versions were kept for it (limit {limit})"
        ));
    }
    None
}

/// An open snapshot: a read version. Reads and scans through it see exactly the objects visible
/// at that version. Clones share it; dropping the last one releases what it kept alive.
#[derive(Clone)]
pub struct Snapshot {
    held: Arc<Held>,
}

/// The registration behind a snapshot and its clones.
struct Held {
    inner: Arc<Inner>,
    entry: Arc<SnapshotEntry>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.inner.snapshots.release(&self.inner, &self.entry, None);
    }
}

impl Snapshot {
    pub(crate) fn new(inner: Arc<Inner>, entry: Arc<SnapshotEntry>) -> Snapshot {
        Snapshot {
            held: Arc::new(Held { inner, entry }),
        }
    }

    pub(crate) fn entry(&self) -> &Arc<SnapshotEntry> {
        &self.held.entry
    }

    /// The read version: every write with a version at or below it is visible, nothing newer.
    pub fn version(&self) -> u64 {
        self.held.entry.version
    }

    /// Wall-clock time (unix ms) the snapshot was taken; objects expired by then are not visible.
    pub fn wall_ms(&self) -> u64 {
        self.held.entry.wall_ms
    }

    /// Fails with "snapshot too old" if the snapshot was released or is past a bound.
    pub fn check(&self) -> Result<(), EngineError> {
        let h = &self.held;
        h.inner.snapshots.check(&h.inner, &h.entry)
    }
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("version", &self.held.entry.version)
            .field("id", &self.held.entry.id)
            .finish()
    }
}
