//! Log-order scans (TellStore): a scan reads a tablet's segments sequentially and decides each
//! entry's visibility from the entry itself (its version, state bits and, when RETAINED, valid-to),
//! with no hash-index probe per entry.
//!
//! Consistency with the cleaner: a scan captures the tablet's segments and their lengths under the
//! tablet's write lock and pins them. The cleaner does not clean pinned segments, and does not swap
//! in copies that lie inside a pinned range, so while a scan runs no entry it has still to read
//! changes between live and MOVED. Entries written after the capture have versions above every
//! snapshot the pass serves, so nothing visible lies beyond the captured lengths. A segment is
//! unpinned as soon as it has been read; readers also hold an epoch guard per segment, so memory
//! stays valid even if a snapshot is released (and its pins dropped) mid-read.
//!
//! Shared scans: one pass at a time per tablet. Scans arriving while a pass runs queue up and the
//! next pass serves all of them, reading the data once (TellStore's batching); a pass also waits
//! `scan_batch_wait_us` before it starts, so scans that arrive together share the first pass.
//!
//! Garbage collection in scans: each pass measures every segment's live bytes; a closed segment
//! below half full is handed to the cleaner, which compacts it even when memory is not short.

use crate::engine::{Inner, Tablet};
use crate::entry::{
    decode_header, decode_header_into, DecodeError, Header, HEADER_BYTES_MAX, KIND_OBJECT,
    STATE_MASK, STATE_MOVED, STATE_RETAINED, STATE_SUPERSEDED,
};
use crate::error::EngineError;
use crate::index::{make_loc, Loc};
use crate::mvcc::{PinSet, SnapshotEntry};
use crate::pool::{NO_SEGLET, SEGLET_BYTES};
use crate::segment::SegmentState;
use crate::TabletId;
use crate::{ScanOutput, ScanRecord};
use crossbeam_epoch as epoch;
use parking_lot::{Condvar, Mutex};
use ramlog_query::{
    AggState, Aggregate, BatchGroup, CompiledQuery, GroupMember, Value, BATCH_RECORDS,
};
use std::sync::atomic::AtomicU8;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Share of the memory budget in use above which scans hand sparse segments to the cleaner.
pub(crate) const SCAN_GC_MEMORY_USED: f64 = 0.5;

/// One entry as a scan sees it.
pub(crate) struct ScanEntry<'a> {
    pub header: &'a Header,
    /// State bits, read atomically before the header.
    pub state: u8,
    pub key: &'a [u8],
    pub value: &'a [u8],
    /// The key and value lie in segment memory (not in the walk's scratch buffer), so they stay
    /// valid until the walk leaves the segment.
    pub stable: bool,
}

/// Visibility of one entry at a snapshot.
#[inline(always)]
pub(crate) fn visible_at(
    inner: &Inner,
    tablet: &Tablet,
    e: &ScanEntry<'_>,
    version: u64,
    wall_ms: u64,
) -> bool {
    let h = e.header;
    if h.kind != KIND_OBJECT || e.state & STATE_MOVED != 0 || h.version > version {
        return false;
    }
    if e.state & STATE_SUPERSEDED != 0 {
        if e.state & STATE_RETAINED == 0 {
            return false;
        }
        if version >= inner.retained_valid_to(tablet, h, e.key) {
            return false;
        }
    }
    h.expire_at_ms == 0 || h.expire_at_ms > wall_ms
}

/// Whether an entry still holds memory someone needs: a current object, or a retained version
/// that one of the `open` snapshot versions (sorted) can read. Used for the scan's garbage count.
#[inline(always)]
fn needed(inner: &Inner, tablet: &Tablet, e: &ScanEntry<'_>, open: &[u64]) -> bool {
    let h = e.header;
    if h.kind != KIND_OBJECT || e.state & STATE_MOVED != 0 {
        return false;
    }
    if e.state & STATE_SUPERSEDED == 0 {
        return true;
    }
    if e.state & STATE_RETAINED == 0 {
        return false;
    }
    let to = inner.retained_valid_to(tablet, h, e.key);
    let i = open.partition_point(|&s| s < h.version);
    i < open.len() && open[i] < to
}

/// A captured segment: the bytes a scan reads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Captured {
    pub segment: u32,
    pub used: u32,
}

/// The segments of a tablet, pinned, as of one instant under its write lock.
pub(crate) struct Capture {
    pub segments: Vec<Captured>,
    pub pins: Arc<PinSet>,
}

/// Captures and pins a tablet's segments. Every snapshot registered before this call sees, within
/// the captured ranges, exactly the versions it can read.
///
/// Single-scan snapshots among `serving` (those of the jobs this capture reads for) stop waiting
/// for this tablet: from now on only the pins keep what they need.
pub(crate) fn capture(
    inner: &Inner,
    tablet_id: TabletId,
    serving: &[&SnapshotEntry],
) -> Result<Capture, EngineError> {
    let tablet = inner.tablet(tablet_id)?;
    let pins = Arc::new(PinSet::default());
    let mut segments = Vec::new();
    {
        let _head = tablet.head.lock();
        if serving.iter().any(|s| s.scan_table.is_some()) {
            tablet
                .scan_uncaptured
                .lock()
                .retain(|&(_, id)| !serving.iter().any(|s| s.id == id));
        }
        for (id, slot) in inner.segments.iter() {
            let state = slot.state();
            if !matches!(
                state,
                SegmentState::Open | SegmentState::Closed | SegmentState::Cleaning
            ) || slot.tablet.load(Ordering::Acquire) != tablet_id
            {
                continue;
            }
            let used = slot.used_bytes.load(Ordering::Acquire);
            if used == 0 {
                continue;
            }
            slot.pins.fetch_add(1, Ordering::AcqRel);
            slot.pinned_upto.fetch_max(used, Ordering::AcqRel);
            segments.push(Captured { segment: id, used });
        }
        pins.segments
            .lock()
            .extend(segments.iter().map(|c| c.segment));
    }
    // Oldest data first: segments were created in clock order, survivors carry their data's age.
    segments.sort_by_key(|c| {
        inner
            .segments
            .get(c.segment)
            .created
            .load(Ordering::Relaxed)
    });
    Ok(Capture { segments, pins })
}

/// Releases one segment's pin if the pin set still holds it.
pub(crate) fn unpin_one(inner: &Inner, pins: &PinSet, segment: u32) {
    let had = {
        let mut p = pins.segments.lock();
        match p.iter().position(|&s| s == segment) {
            Some(i) => {
                p.swap_remove(i);
                true
            }
            None => false,
        }
    };
    if had {
        inner.unpin(segment);
    }
}

/// How far ahead of its position a walk asks for cache lines.
const PREFETCH_AHEAD: usize = 1536;

/// Asks for every cache line up to `PREFETCH_AHEAD` past `off` not asked for yet (`prefetched`),
/// so the next entries' first bytes, on which the walk's progress depends, are in L1 when it
/// reaches them. Entries are often longer than a line: one prefetch per entry would skip lines.
#[inline(always)]
fn prefetch_ahead(base: *const u8, prefetched: &mut usize, off: usize) {
    #[cfg(target_arch = "x86_64")]
    while *prefetched < off + PREFETCH_AHEAD {
        // SAFETY: a prefetch is a hint and never faults.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                base.wrapping_add(*prefetched) as *const i8,
            );
        }
        *prefetched += 64;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (base, prefetched, off);
}

/// The state bits of the entry at `base + off`, read atomically (see `Inner::entry_state`).
///
/// # Safety
/// `base + off` must lie in a seglet the caller may read.
#[inline(always)]
unsafe fn entry_state_at(base: *const u8, off: usize) -> u8 {
    AtomicU8::from_ptr(base.add(off) as *mut u8).load(Ordering::Acquire) & STATE_MASK
}

/// A resumable position inside one captured segment.
pub(crate) struct SegmentWalk {
    pub segment: u32,
    used: usize,
    seglet: u32,
    /// Offset of `seglet` inside the segment.
    seglet_start: usize,
    off: usize,
    /// Bytes of entries some snapshot or reader still needs, and of all entries, seen so far.
    pub needed_bytes: u64,
    pub seen_bytes: u64,
}

impl SegmentWalk {
    pub fn new(inner: &Inner, c: Captured) -> Self {
        SegmentWalk {
            segment: c.segment,
            used: c.used as usize,
            seglet: inner
                .segments
                .get(c.segment)
                .first_seglet
                .load(Ordering::Acquire),
            seglet_start: 0,
            off: 0,
            needed_bytes: 0,
            seen_bytes: 0,
        }
    }

    pub fn done(&self) -> bool {
        self.seglet_start + self.off >= self.used
    }

    /// The walk's fast path for one snapshot (`version`, `wall_ms`): visits entries in log order,
    /// calling `f(header, key, value)` for each one visible at the snapshot, until `f` returns false
    /// (after that entry), the segment ends, or an entry needs the general walk: a RETAINED
    /// version (its valid-to lives elsewhere), an entry across seglets, or a header the short
    /// decoder does not take. The caller then moves one entry with [`SegmentWalk::walk`].
    /// Returns true when `f` stopped it.
    /// Every entry it passes is counted as [`SegmentWalk::walk`] counts it, and the keys and
    /// values lie in segment memory (`stable`). The caller holds an epoch guard.
    #[inline(always)]
    pub fn walk_plain(
        &mut self,
        inner: &Inner,
        version: u64,
        wall_ms: u64,
        mut f: impl FnMut(&Header, &[u8], &[u8]) -> bool,
    ) -> bool {
        loop {
            if self.done() || self.seglet == NO_SEGLET {
                return false;
            }
            let limit = (self.used - self.seglet_start).min(SEGLET_BYTES);
            // SAFETY: as in `walk`.
            let base = unsafe { inner.pool.seglet_tail(self.seglet, 0) };
            let base = &base[..limit];
            let base_ptr = base.as_ptr();
            let mut off = self.off;
            let mut prefetched = off & !63;
            let (mut seen, mut needed) = (0u64, 0u64);
            let mut h = Header::default();
            let mut stopped = false;
            while let Some(head) = base.get(off..off + HEADER_BYTES_MAX) {
                prefetch_ahead(base_ptr, &mut prefetched, off);
                // SAFETY: off < limit <= the seglet's length.
                let state = unsafe { entry_state_at(base_ptr, off) };
                if state & STATE_RETAINED != 0
                    || !decode_header_into(&mut h, head.try_into().expect("header-sized"))
                {
                    break;
                }
                let total = h.total_len();
                if off + total > limit {
                    break;
                }
                seen += total as u64;
                // Current objects are needed and may be visible; tombstones, superseded
                // (not retained) and MOVED entries are neither.
                if h.kind == KIND_OBJECT && state & (STATE_SUPERSEDED | STATE_MOVED) == 0 {
                    needed += total as u64;
                    if h.version <= version && (h.expire_at_ms == 0 || h.expire_at_ms > wall_ms) {
                        let (hl, kl) = (h.header_len as usize, h.key_len as usize);
                        let key = &base[off + hl..off + hl + kl];
                        if !f(&h, key, &base[off + hl + kl..off + total]) {
                            off += total;
                            stopped = true;
                            break;
                        }
                    }
                }
                off += total;
            }
            self.off = off;
            self.seen_bytes += seen;
            self.needed_bytes += needed;
            if stopped || off < limit || limit < SEGLET_BYTES {
                self.normalise(inner);
                return stopped;
            }
            self.normalise(inner);
        }
    }

    /// Visits entries in log order until `f` returns false (after that entry) or the segment ends.
    /// Returns Ok(true) when the segment is finished. The caller holds an epoch guard.
    #[inline(always)]
    pub fn walk(
        &mut self,
        inner: &Inner,
        tablet: &Tablet,
        open: &[u64],
        scratch: &mut Vec<u8>,
        mut f: impl FnMut(&ScanEntry<'_>) -> bool,
    ) -> Result<bool, EngineError> {
        loop {
            if self.done() {
                return Ok(true);
            }
            if self.seglet == NO_SEGLET {
                return Err(self.corrupt("segment ends before its used length".into()));
            }
            let limit = (self.used - self.seglet_start).min(SEGLET_BYTES);
            // SAFETY: the segment is pinned or the caller holds an epoch guard, so the seglet is
            // not reused; the bytes below `used` were published before the capture.
            let base = unsafe { inner.pool.seglet_tail(self.seglet, 0) };
            let base = &base[..limit];
            let base_ptr = base.as_ptr();
            let mut h = Header::default();
            let mut prefetched = self.off & !63;
            // Fast path: entries wholly inside this seglet.
            while self.off < limit {
                let off = self.off;
                // SAFETY: off < limit <= the seglet's length.
                let state = unsafe { entry_state_at(base_ptr, off) };
                prefetch_ahead(base_ptr, &mut prefetched, off);
                let fast = match base.get(off..off + HEADER_BYTES_MAX) {
                    Some(b) => decode_header_into(&mut h, b.try_into().expect("header-sized")),
                    None => false,
                };
                if !fast {
                    h = match decode_header(&base[off..]) {
                        Ok(h) => h,
                        Err(DecodeError::Truncated) => break,
                        Err(e) => return Err(self.corrupt(e.to_string())),
                    };
                }
                let total = h.total_len();
                if off + total > limit {
                    break;
                }
                let hl = h.header_len as usize;
                let kl = h.key_len as usize;
                let e = ScanEntry {
                    header: &h,
                    state,
                    key: &base[off + hl..off + hl + kl],
                    value: &base[off + hl + kl..off + total],
                    stable: true,
                };
                self.account(inner, tablet, &e, open, total);
                self.off += total;
                if !f(&e) {
                    self.normalise(inner);
                    return Ok(self.done());
                }
            }
            if self.off >= limit {
                if limit < SEGLET_BYTES {
                    return Ok(true);
                }
                self.normalise(inner);
                continue;
            }
            // Slow path: an entry that straddles seglets.
            let loc = make_loc(self.seglet, self.off);
            let state = inner.entry_state(loc).load(Ordering::Acquire) & STATE_MASK;
            gather(inner, self.seglet, self.off, HEADER_BYTES_MAX, scratch);
            let h = decode_header(scratch).map_err(|e| self.corrupt(e.to_string()))?;
            let total = h.total_len();
            if self.seglet_start + self.off + total > self.used {
                return Err(self.corrupt("entry runs past the captured length".into()));
            }
            gather(inner, self.seglet, self.off, total, scratch);
            if scratch.len() < total {
                return Err(self.corrupt("entry runs past the end of its segment".into()));
            }
            let hl = h.header_len as usize;
            let kl = h.key_len as usize;
            let e = ScanEntry {
                header: &h,
                state,
                key: &scratch[hl..hl + kl],
                value: &scratch[hl + kl..total],
                stable: false,
            };
            self.account(inner, tablet, &e, open, total);
            self.off += total;
            let go_on = f(&e);
            self.normalise(inner);
            if !go_on {
                return Ok(self.done());
            }
        }
    }

    #[inline]
    fn account(
        &mut self,
        inner: &Inner,
        tablet: &Tablet,
        e: &ScanEntry<'_>,
        open: &[u64],
        total: usize,
    ) {
        self.seen_bytes += total as u64;
        if needed(inner, tablet, e, open) {
            self.needed_bytes += total as u64;
        }
    }

    /// Moves to the next seglet while the offset is past the current one.
    fn normalise(&mut self, inner: &Inner) {
        while self.off >= SEGLET_BYTES && self.seglet != NO_SEGLET {
            self.seglet = inner.pool.next_seglet(self.seglet);
            self.seglet_start += SEGLET_BYTES;
            self.off -= SEGLET_BYTES;
        }
    }

    fn corrupt(&self, reason: String) -> EngineError {
        EngineError::Corrupt {
            seglet: self.seglet,
            offset: self.off,
            reason: format!("segment {}: {reason}", self.segment),
        }
    }
}

fn gather(inner: &Inner, mut seglet: u32, mut off: usize, len: usize, out: &mut Vec<u8>) {
    out.clear();
    while out.len() < len && seglet != NO_SEGLET {
        // SAFETY: as in `SegmentWalk::walk`.
        let tail = unsafe { inner.pool.seglet_tail(seglet, off) };
        let n = tail.len().min(len - out.len());
        out.extend_from_slice(&tail[..n]);
        seglet = inner.pool.next_seglet(seglet);
        off = 0;
    }
}

/// After a segment was read in full: hands it to the cleaner if it is mostly garbage.
pub(crate) fn report_garbage(inner: &Inner, walk: &SegmentWalk) {
    let slot = inner.segments.get(walk.segment);
    if slot.state() != SegmentState::Closed {
        return;
    }
    // Compacting costs the writers CPU; it is worth it once memory is half used, not before (the
    // ordinary cleaner takes over when memory runs short).
    let total = inner.pool.seglet_count();
    let used = total.saturating_sub(inner.pool.free_count());
    if (used as f64) < SCAN_GC_MEMORY_USED * total as f64 {
        return;
    }
    let capacity = slot.seglet_count.load(Ordering::Relaxed) as u64 * SEGLET_BYTES as u64;
    if capacity == 0
        || (walk.needed_bytes as f64) >= crate::cleaner::SPARSE_UTILISATION * capacity as f64
    {
        return;
    }
    let mut q = inner.sparse.lock();
    if !q.contains(&walk.segment) {
        q.push(walk.segment);
        inner
            .counters
            .scan_sparse_segments
            .fetch_add(1, Ordering::Relaxed);
        drop(q);
        if inner.config.cleaner_threads > 0 {
            inner.wake_cleaner();
        }
    }
}

/// Sorted versions of the open snapshots (for garbage accounting).
pub(crate) fn open_versions(inner: &Inner) -> Vec<u64> {
    inner.snapshots.open_versions()
}

// ---------------------------------------------------------------------------------------------
// Shared passes

/// One scan request waiting for (or served by) a pass.
pub(crate) struct Job {
    pub snapshot: Arc<SnapshotEntry>,
    pub sink: Mutex<Option<QuerySink>>,
    result: Mutex<Option<Result<(), EngineError>>>,
    done: Condvar,
}

impl Job {
    pub fn new(snapshot: Arc<SnapshotEntry>, sink: QuerySink) -> Arc<Job> {
        Arc::new(Job {
            snapshot,
            sink: Mutex::new(Some(sink)),
            result: Mutex::new(None),
            done: Condvar::new(),
        })
    }

    fn finish(&self, r: Result<(), EngineError>) {
        *self.result.lock() = Some(r);
        self.done.notify_all();
    }

    /// Blocks until a pass has served the job; its result.
    fn wait(&self) -> Result<(), EngineError> {
        let mut res = self.result.lock();
        while res.is_none() {
            self.done.wait(&mut res);
        }
        res.take().expect("set above")
    }

    /// The job's sink, once it is done.
    fn take_sink(&self) -> QuerySink {
        self.sink
            .lock()
            .take()
            .expect("a finished job still holds its sink")
    }
}

/// Per-tablet scheduler of shared passes.
#[derive(Default)]
pub(crate) struct ScanQueue {
    state: Mutex<QueueState>,
}

#[derive(Default)]
struct QueueState {
    pending: Vec<Arc<Job>>,
    running: bool,
}

/// Runs `job` over one tablet, sharing the pass with whatever other scans of the tablet arrive.
/// Blocks until the job is done.
pub(crate) fn run_shared(
    inner: &Inner,
    tablet_id: TabletId,
    job: Arc<Job>,
) -> Result<(), EngineError> {
    let tablet = inner.tablet(tablet_id)?;
    tablet.scans.state.lock().pending.push(job.clone());
    lead_if_idle(inner, tablet_id, tablet);
    job.wait()
}

/// Runs one job per tablet (same order), sharing passes. All jobs are queued first, then the
/// tablets are visited in order, running the passes of those nobody is running yet. Scans of a
/// whole table that start together thus land in the same pass on every tablet, and threads that
/// start on different tablets run those passes in parallel.
pub(crate) fn run_shared_many(
    inner: &Inner,
    jobs: &[(TabletId, Arc<Job>)],
) -> Result<(), EngineError> {
    let mut tablets = Vec::with_capacity(jobs.len());
    for (id, job) in jobs {
        let tablet = inner.tablet(*id)?;
        tablet.scans.state.lock().pending.push(job.clone());
        tablets.push((*id, tablet));
    }
    for (id, tablet) in tablets {
        lead_if_idle(inner, id, tablet);
    }
    for (_, job) in jobs {
        job.wait()?;
    }
    Ok(())
}

/// If no pass runs over the tablet, runs passes for its pending jobs until none is left.
fn lead_if_idle(inner: &Inner, tablet_id: TabletId, tablet: &Tablet) {
    {
        let mut st = tablet.scans.state.lock();
        if st.running || st.pending.is_empty() {
            return;
        }
        st.running = true;
    }
    if inner.config.scan_batch_wait_us > 0 {
        std::thread::sleep(Duration::from_micros(inner.config.scan_batch_wait_us));
    }
    loop {
        let batch = {
            let mut st = tablet.scans.state.lock();
            if st.pending.is_empty() {
                st.running = false;
                return;
            }
            std::mem::take(&mut st.pending)
        };
        let r = run_pass(inner, tablet_id, tablet, &batch);
        for j in &batch {
            let own = match &r {
                Ok(()) => inner.snapshots.check(inner, &j.snapshot),
                Err(e) => Err(e.clone()),
            };
            j.finish(own);
        }
    }
}

/// One pass over a tablet for a batch of jobs. Large passes of jobs that keep no record limit
/// split the tablet's segments among `scan_threads` threads, each with its own sinks, merged in
/// log order at the end.
fn run_pass(
    inner: &Inner,
    tablet_id: TabletId,
    tablet: &Tablet,
    batch: &[Arc<Job>],
) -> Result<(), EngineError> {
    inner.counters.scan_passes.fetch_add(1, Ordering::Relaxed);
    inner
        .counters
        .scan_queries
        .fetch_add(batch.len() as u64, Ordering::Relaxed);
    let serving: Vec<&SnapshotEntry> = batch.iter().map(|j| &*j.snapshot).collect();
    let cap = capture(inner, tablet_id, &serving)?;
    for j in batch {
        inner.snapshots.attach_pins(&j.snapshot, cap.pins.clone());
    }
    let open = open_versions(inner);
    let mut guards: Vec<_> = batch.iter().map(|j| j.sink.lock()).collect();
    let mut sinks: Vec<&mut QuerySink> = guards
        .iter_mut()
        .map(|g| g.as_mut().expect("a queued job holds its sink"))
        .collect();
    let snaps: Vec<(u64, u64)> = batch
        .iter()
        .map(|j| (j.snapshot.version, j.snapshot.wall_ms))
        .collect();
    // Several aggregates over one schema: evaluated together, reading each record once.
    let group = (sinks.len() > 1 && sinks.len() <= 64)
        .then(|| {
            let queries: Vec<&CompiledQuery> = sinks.iter().map(|s| &*s.query).collect();
            BatchGroup::new(&queries)
        })
        .flatten()
        .filter(|_| sinks.iter().all(|s| s.batching));
    let pass = Pass {
        inner,
        tablet,
        batch,
        pins: &cap.pins,
        open: &open,
        snaps: &snaps,
        group: group.as_ref(),
    };
    let unlimited = sinks
        .iter()
        .all(|s| s.agg.is_some() || s.count_only || s.max_records == usize::MAX);
    // Aggregates do not care in which order segments are read: threads then take the next
    // unread segment until none is left, which keeps them all busy to the end of the pass.
    let unordered = sinks.iter().all(|s| s.agg.is_some() || s.count_only);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let claim = || {
        std::iter::from_fn(|| {
            let i = next.fetch_add(1, Ordering::Relaxed);
            cap.segments.get(i).copied()
        })
    };
    let parts = split_by_bytes(&cap.segments, scan_threads(inner));
    let result = if parts.len() > 1 && unlimited {
        // Each helper thread fills fresh sinks of the same queries; the first part uses the jobs'.
        let helpers: Vec<Vec<QuerySink>> = parts[1..]
            .iter()
            .map(|_| sinks.iter().map(|s| s.sibling()).collect())
            .collect();
        let (first, rest) = std::thread::scope(|scope| {
            let handles: Vec<_> = parts[1..]
                .iter()
                .zip(helpers)
                .map(|(part, mut own)| {
                    let (pass, claim) = (&pass, &claim);
                    scope.spawn(move || {
                        let mut refs: Vec<&mut QuerySink> = own.iter_mut().collect();
                        let r = if unordered {
                            pass.walk_segments(claim(), &mut refs)
                        } else {
                            pass.walk_segments(part.iter().copied(), &mut refs)
                        };
                        (r, own)
                    })
                })
                .collect();
            let first = if unordered {
                pass.walk_segments(claim(), &mut sinks)
            } else {
                pass.walk_segments(parts[0].iter().copied(), &mut sinks)
            };
            let rest: Vec<_> = handles
                .into_iter()
                .map(|h| match h.join() {
                    Ok(done) => done,
                    Err(_) => (
                        Err(EngineError::Corrupt {
                            seglet: 0,
                            offset: 0,
                            reason: "a scan thread panicked".into(),
                        }),
                        Vec::new(),
                    ),
                })
                .collect();
            (first, rest)
        });
        let mut result = first;
        for (r, own) in rest {
            if result.is_ok() {
                result = r;
            }
            for (sink, part) in sinks.iter_mut().zip(own) {
                sink.merge(part);
            }
        }
        result
    } else {
        pass.walk_segments(cap.segments.iter().copied(), &mut sinks)
    };
    inner.unpin_all(&cap.pins);
    result
}

/// Evaluates the group's pending values for every sink and adds the counts to the sinks.
fn flush_group(
    group: &BatchGroup,
    sinks: &mut [&mut QuerySink],
    pending: &mut Vec<(*const u8, usize, u64)>,
) {
    if pending.is_empty() {
        return;
    }
    let mut values: [&[u8]; BATCH_RECORDS] = [&[]; BATCH_RECORDS];
    // At most 64 sinks form a group (one bit each in an entry's mask).
    let mut masks = [0u64; 64];
    for (i, &(ptr, len, mut seen_by)) in pending.iter().enumerate() {
        // SAFETY: the addresses point into the segment being walked, still pinned and guarded
        // (see `walk_segments`).
        values[i] = unsafe { std::slice::from_raw_parts(ptr, len) };
        while seen_by != 0 {
            masks[seen_by.trailing_zeros() as usize] |= 1 << i;
            seen_by &= seen_by - 1;
        }
    }
    let n = pending.len();
    pending.clear();
    let mut members: Vec<GroupMember<'_>> = sinks
        .iter_mut()
        .zip(&masks)
        .map(|(sink, &mask)| {
            let QuerySink { query, agg, .. } = &mut **sink;
            GroupMember {
                query,
                agg: agg.as_mut().expect("a batching sink aggregates"),
                mask,
                matched: 0,
                malformed: 0,
            }
        })
        .collect();
    group.aggregate(&mut members, &values[..n]);
    let mut counts = [(0u64, 0u64); 64];
    for (c, m) in counts.iter_mut().zip(&members) {
        *c = (m.matched, m.malformed);
    }
    drop(members);
    for (sink, (matched, malformed)) in sinks.iter_mut().zip(counts) {
        sink.out.matched += matched;
        sink.out.malformed += malformed;
    }
}

/// The threads a pass may use.
fn scan_threads(inner: &Inner) -> usize {
    match inner.config.scan_threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// Cuts `segments` into at most `parts` runs of consecutive segments with about the same bytes.
/// A run is at least one segment; a single segment is never split.
fn split_by_bytes(segments: &[Captured], parts: usize) -> Vec<&[Captured]> {
    let total: u64 = segments.iter().map(|c| c.used as u64).sum();
    let parts = parts.clamp(1, segments.len().max(1));
    let mut out = Vec::with_capacity(parts);
    let (mut start, mut acc) = (0usize, 0u64);
    for (i, c) in segments.iter().enumerate() {
        acc += c.used as u64;
        let cut = total * (out.len() as u64 + 1) / parts as u64;
        if acc >= cut && out.len() + 1 < parts && i + 1 < segments.len() {
            out.push(&segments[start..=i]);
            start = i + 1;
        }
    }
    out.push(&segments[start..]);
    out
}

/// What every thread of one pass shares.
struct Pass<'a> {
    inner: &'a Inner,
    tablet: &'a Tablet,
    batch: &'a [Arc<Job>],
    pins: &'a PinSet,
    open: &'a [u64],
    snaps: &'a [(u64, u64)],
    group: Option<&'a BatchGroup>,
}

impl Pass<'_> {
    /// Walks `segments` in order, feeding every visible entry to the sinks (one per job, in batch
    /// order), and unpins and reports each segment once read.
    fn walk_segments(
        &self,
        segments: impl Iterator<Item = Captured>,
        sinks: &mut [&mut QuerySink],
    ) -> Result<(), EngineError> {
        let (inner, tablet) = (self.inner, self.tablet);
        let mut active: Vec<bool> = vec![true; sinks.len()];
        let mut scratch = Vec::new();
        // Values for the group: address, length, and the sinks (bits) that see the entry. They
        // point into the segment being walked and are evaluated before the walk leaves it.
        let mut shared: Vec<(*const u8, usize, u64)> = Vec::with_capacity(BATCH_RECORDS);
        for c in segments {
            if !active.iter().any(|&a| a) {
                break;
            }
            let mut walk = SegmentWalk::new(inner, c);
            let guard = epoch::pin();
            let r = if let ([sink], [(version, wall_ms)]) = (&mut sinks[..], self.snaps) {
                // One query: the common case, without the per-query loop. The plain walk takes
                // the entries it can; the general walk moves over each one it stops at.
                loop {
                    let sink = &mut **sink;
                    if walk.walk_plain(inner, *version, *wall_ms, |h, key, value| {
                        sink.accept_parts(h, key, value, true)
                    }) {
                        active[0] = false;
                    }
                    if !active[0] || walk.done() {
                        break Ok(walk.done());
                    }
                    let step = walk.walk(inner, tablet, self.open, &mut scratch, |e| {
                        if visible_at(inner, tablet, e, *version, *wall_ms) {
                            active[0] = sink.accept_entry(e);
                        }
                        false
                    });
                    if !matches!(step, Ok(false)) || !active[0] {
                        break step;
                    }
                }
            } else if let Some(group) = self.group {
                // The plain walk with the most permissive of the snapshots (the newest version,
                // the earliest clock), then each query's own test.
                let newest = self.snaps.iter().map(|s| s.0).max().unwrap_or(0);
                let earliest = self.snaps.iter().map(|s| s.1).min().unwrap_or(0);
                // The queries (bits) still running, and those with a key filter to apply.
                let running = active
                    .iter()
                    .enumerate()
                    .fold(0u64, |m, (i, &a)| m | (a as u64) << i);
                let filtered = sinks
                    .iter()
                    .enumerate()
                    .fold(0u64, |m, (i, s)| m | (!s.all_keys as u64) << i);
                loop {
                    walk.walk_plain(inner, newest, earliest, |h, key, value| {
                        // Which snapshots see the version, then expiry and key filters only
                        // where they apply.
                        let mut mask = 0u64;
                        for (i, &(version, _)) in self.snaps.iter().enumerate() {
                            mask |= ((h.version <= version) as u64) << i;
                        }
                        mask &= running;
                        if h.expire_at_ms != 0 {
                            for (i, &(_, wall_ms)) in self.snaps.iter().enumerate() {
                                mask &= !(((h.expire_at_ms <= wall_ms) as u64) << i);
                            }
                        }
                        let mut check = mask & filtered;
                        while check != 0 {
                            let i = check.trailing_zeros() as usize;
                            check &= check - 1;
                            if !sinks[i].key_passes(key) {
                                mask &= !(1 << i);
                            }
                        }
                        if mask != 0 {
                            shared.push((value.as_ptr(), value.len(), mask));
                            if shared.len() == BATCH_RECORDS {
                                flush_group(group, sinks, &mut shared);
                            }
                        }
                        true
                    });
                    if walk.done() {
                        break Ok(true);
                    }
                    let step = walk.walk(inner, tablet, self.open, &mut scratch, |e| {
                        if e.header.kind != KIND_OBJECT || e.state & STATE_MOVED != 0 {
                            return false;
                        }
                        let mut mask = 0u64;
                        for (i, sink) in sinks.iter_mut().enumerate() {
                            if active[i]
                                && visible_at(inner, tablet, e, self.snaps[i].0, self.snaps[i].1)
                            {
                                if !e.stable {
                                    sink.accept_entry(e);
                                } else if sink.key_passes(e.key) {
                                    mask |= 1 << i;
                                }
                            }
                        }
                        if mask != 0 {
                            shared.push((e.value.as_ptr(), e.value.len(), mask));
                            if shared.len() == BATCH_RECORDS {
                                flush_group(group, sinks, &mut shared);
                            }
                        }
                        false
                    });
                    if !matches!(step, Ok(false)) {
                        break step;
                    }
                }
            } else {
                walk.walk(inner, tablet, self.open, &mut scratch, |e| {
                    if e.header.kind != KIND_OBJECT || e.state & STATE_MOVED != 0 {
                        return true;
                    }
                    for (i, sink) in sinks.iter_mut().enumerate() {
                        if active[i]
                            && visible_at(inner, tablet, e, self.snaps[i].0, self.snaps[i].1)
                        {
                            active[i] = sink.accept_entry(e);
                        }
                    }
                    true
                })
            };
            // Deferred values point into this segment: evaluate them while it is pinned.
            if let Some(group) = self.group {
                flush_group(group, sinks, &mut shared);
            }
            for sink in sinks.iter_mut() {
                sink.flush_deferred();
            }
            drop(guard);
            if let Err(e) = r {
                tracing::error!(error = %e, "scan stopped at a corrupt entry");
                return Err(e);
            }
            unpin_one(inner, self.pins, c.segment);
            report_garbage(inner, &walk);
            // Jobs whose snapshot was released mid-pass stop here; they fail when the pass ends.
            for (i, j) in self.batch.iter().enumerate() {
                if active[i] && j.snapshot.released_reason().is_some() {
                    active[i] = false;
                }
            }
        }
        Ok(())
    }
}

/// Reads `key` as of a snapshot: the version visible at it, if any.
pub(crate) fn get_at(
    inner: &Inner,
    tablet: &Tablet,
    key: &[u8],
    version: u64,
    wall_ms: u64,
) -> Result<Option<crate::Object>, EngineError> {
    let hash = crate::engine::hash_key(key);
    let _guard = epoch::pin();
    let mut refs = Vec::new();
    // A reference read just before the cleaner swapped it may lead to the original, already
    // marked MOVED: then the index is read again (it points at the copy by now).
    loop {
        tablet.index.lookup_versions(hash, &mut refs);
        let mut moved = false;
        for &(loc, _) in &refs {
            let state = inner.entry_state(loc).load(Ordering::Acquire) & STATE_MASK;
            let found = inner.with_entry(loc, true, |e| {
                if e.key != key {
                    return None;
                }
                if state & STATE_MOVED != 0 {
                    moved = true;
                    return None;
                }
                let se = ScanEntry {
                    header: &e.header,
                    state,
                    key: e.key,
                    value: e.value,
                    stable: false,
                };
                visible_at(inner, tablet, &se, version, wall_ms).then(|| crate::Object {
                    value: e.value.to_vec(),
                    version: e.header.version,
                    expire_at_ms: e.header.expire_at_ms,
                })
            })?;
            if found.is_some() {
                return Ok(found);
            }
        }
        if !moved {
            return Ok(None);
        }
    }
}

/// The baseline: walks the hash index and follows every reference into the log (random access).
pub(crate) fn hash_index_scan(
    inner: &Inner,
    tablet: &Tablet,
    version: u64,
    wall_ms: u64,
    sink: &mut QuerySink,
) -> Result<(), EngineError> {
    // References must not move between buckets under the walk (that could show one twice).
    {
        let _head = tablet.head.lock();
        tablet.index.hold_splits();
    }
    struct Release<'a>(&'a Tablet);
    impl Drop for Release<'_> {
        fn drop(&mut self) {
            self.0.index.release_splits();
        }
    }
    let _release = Release(tablet);
    let mut cursor = 0u64;
    let mut locs: Vec<Loc> = Vec::with_capacity(1024);
    loop {
        let guard = epoch::pin();
        locs.clear();
        let next = tablet
            .index
            .scan_refs(cursor, 1024, |loc, _| locs.push(loc));
        for &loc in &locs {
            let state = inner.entry_state(loc).load(Ordering::Acquire) & STATE_MASK;
            let mut moved_key = None;
            let go_on = inner.with_entry(loc, true, |e| {
                if state & STATE_MOVED != 0 {
                    // Swapped to a copy after the bucket was read: follow the index to it.
                    moved_key = Some(e.key.to_vec());
                    return true;
                }
                let se = ScanEntry {
                    header: &e.header,
                    state,
                    key: e.key,
                    value: e.value,
                    stable: false,
                };
                if visible_at(inner, tablet, &se, version, wall_ms) {
                    sink.accept(e.key, e.value, e.header.version, e.header.expire_at_ms)
                } else {
                    true
                }
            })?;
            if !go_on {
                return Ok(());
            }
            if let Some(key) = moved_key {
                if let Some(o) = get_at(inner, tablet, &key, version, wall_ms)? {
                    // Only this reference's version: the key's other versions have their own.
                    let own = inner.with_entry(loc, false, |e| e.header.version)?;
                    if o.version == own && !sink.accept(&key, &o.value, o.version, o.expire_at_ms) {
                        return Ok(());
                    }
                }
            }
        }
        drop(guard);
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

// ---------------------------------------------------------------------------------------------
// Queries

/// A sink that evaluates a compiled query: filter, then projection into records or aggregation.
pub(crate) struct QuerySink {
    pub query: Arc<CompiledQuery>,
    pub max_records: usize,
    pub out: ScanOutput,
    pub agg: Option<AggState>,
    /// The query reads no field (a key filter and counts only): records are not decoded.
    count_only: bool,
    /// The key filter lets every key through.
    all_keys: bool,
    /// Whether visible values are evaluated in batches ([`CompiledQuery::aggregate_batch`]).
    batching: bool,
    deferred: Deferred,
}

/// Values waiting for batch evaluation: addresses in pinned segment memory, which the walker
/// evaluates (`QuerySink::flush_deferred`) before it leaves the segment. Always empty when a
/// sink changes threads or is merged.
struct Deferred {
    at: Box<[(*const u8, usize); BATCH_RECORDS]>,
    len: usize,
}

impl Default for Deferred {
    fn default() -> Deferred {
        Deferred {
            at: Box::new([(std::ptr::null(), 0); BATCH_RECORDS]),
            len: 0,
        }
    }
}

// SAFETY: the addresses are only dereferenced by the thread that deferred them, before the
// segment they point into is unpinned; a sink crosses threads only with none deferred.
unsafe impl Send for Deferred {}

impl QuerySink {
    pub fn new(query: Arc<CompiledQuery>, max_records: usize) -> QuerySink {
        let agg = query.is_aggregate().then(|| query.agg_state());
        let q = query.query();
        let count_only = q.predicate.clauses.is_empty()
            && q.projection.is_none()
            && q.group_by.is_none()
            && !q.aggregates.is_empty()
            && q.aggregates.iter().all(|a| *a == Aggregate::Count);
        let all_keys =
            matches!(q.key_filter, ramlog_query::KeyFilter::All) && query.slots().is_none();
        let batching = !count_only && query.batches();
        QuerySink {
            query,
            max_records,
            out: ScanOutput::default(),
            agg,
            count_only,
            all_keys,
            batching,
            deferred: Deferred::default(),
        }
    }

    /// An empty sink of the same query and limit (another thread's share of one pass).
    pub fn sibling(&self) -> QuerySink {
        QuerySink::new(self.query.clone(), self.max_records)
    }

    /// Folds another tablet's result into this one.
    pub fn merge(&mut self, other: QuerySink) {
        self.out.matched += other.out.matched;
        self.out.malformed += other.out.malformed;
        self.out.truncated |= other.out.truncated;
        let room = self.max_records.saturating_sub(self.out.records.len());
        if other.out.records.len() > room {
            self.out.truncated = true;
        }
        self.out
            .records
            .extend(other.out.records.into_iter().take(room));
        if let (Some(a), Some(b)) = (&mut self.agg, &other.agg) {
            a.merge(b);
        }
    }

    pub fn finish(mut self) -> Result<ScanOutput, EngineError> {
        if self.count_only {
            let n = self.out.matched as i64;
            self.out.aggregates = Some(vec![Value::I64(n); self.query.query().aggregates.len()]);
        } else if let Some(agg) = &self.agg {
            if agg.grouped() {
                self.out.groups = Some(
                    agg.finish_groups()
                        .map_err(|e| EngineError::Query(e.to_string()))?,
                );
                self.out.aggregates = Some(Vec::new());
            } else {
                self.out.aggregates = Some(
                    agg.try_finish()
                        .map_err(|e| EngineError::Query(e.to_string()))?,
                );
            }
        }
        Ok(self.out)
    }

    /// Handles one visible entry of a log walk: deferred for batch evaluation when the query
    /// batches and the bytes stay put, else at once. False once the record limit is reached.
    #[inline(always)]
    pub fn accept_entry(&mut self, e: &ScanEntry<'_>) -> bool {
        self.accept_parts(e.header, e.key, e.value, e.stable)
    }

    /// [`QuerySink::accept_entry`] from an entry's parts.
    #[inline(always)]
    pub fn accept_parts(&mut self, h: &Header, key: &[u8], value: &[u8], stable: bool) -> bool {
        if ramlog_common::is_internal(key) {
            // The chunks of large collections are not records.
            return true;
        }
        if !(self.batching && stable) {
            return self.accept(key, value, h.version, h.expire_at_ms);
        }
        if self.key_passes(key) {
            let d = &mut self.deferred;
            d.at[d.len] = (value.as_ptr(), value.len());
            d.len += 1;
            if d.len == BATCH_RECORDS {
                self.flush_deferred();
            }
        }
        true
    }

    /// Whether the key filter lets `key` through.
    #[inline]
    fn key_passes(&self, key: &[u8]) -> bool {
        self.all_keys || self.query.key_selected(key)
    }

    /// Evaluates the deferred values. The walker calls this before it leaves their segment.
    pub fn flush_deferred(&mut self) {
        let n = self.deferred.len;
        if n == 0 {
            return;
        }
        let mut values: [&[u8]; BATCH_RECORDS] = [&[]; BATCH_RECORDS];
        for (slot, &(ptr, len)) in values.iter_mut().zip(&self.deferred.at[..n]) {
            // SAFETY: see `Deferred`: the segment holding these bytes is still pinned.
            *slot = unsafe { std::slice::from_raw_parts(ptr, len) };
        }
        self.deferred.len = 0;
        let agg = self.agg.as_mut().expect("a batching sink aggregates");
        let (matched, malformed) = self.query.aggregate_batch(agg, &values[..n]);
        self.out.matched += matched;
        self.out.malformed += malformed;
    }

    /// Handles one visible object; false once the record limit is reached.
    #[inline]
    pub fn accept(&mut self, key: &[u8], value: &[u8], version: u64, expire_at_ms: u64) -> bool {
        if ramlog_common::is_internal(key) {
            return true;
        }
        if self.count_only {
            if self.key_passes(key) {
                self.out.matched += 1;
            }
            return true;
        }
        if let Some(agg) = &mut self.agg {
            // Sums are exact (128-bit) until the end; an overflow shows in `finish`.
            match self.query.matches_and_aggregate(agg, key, value) {
                Ok(true) => self.out.matched += 1,
                Ok(false) => {}
                Err(_) => self.out.malformed += 1,
            }
            return true;
        }
        match self.query.matches(key, value) {
            Ok(true) => {}
            Ok(false) => return true,
            Err(_) => {
                self.out.malformed += 1;
                return true;
            }
        }
        if self.out.records.len() >= self.max_records {
            self.out.truncated = true;
            return false;
        }
        let mut projected = Vec::new();
        if self.query.project(value, &mut projected).is_err() {
            self.out.malformed += 1;
            return true;
        }
        self.out.matched += 1;
        self.out.records.push(ScanRecord {
            key: key.to_vec(),
            value: projected,
            version,
            expire_at_ms,
        });
        true
    }
}

/// Runs a query over one tablet through the shared-pass scheduler.
pub(crate) fn query_tablet(
    inner: &Inner,
    tablet: TabletId,
    snapshot: &Arc<SnapshotEntry>,
    sink: QuerySink,
) -> Result<QuerySink, EngineError> {
    let job = Job::new(snapshot.clone(), sink);
    run_shared(inner, tablet, job.clone())?;
    Ok(job.take_sink())
}

/// Runs a query over several tablets at once through the shared-pass scheduler (one sink per
/// tablet, returned in the same order).
pub(crate) fn query_tablets(
    inner: &Inner,
    work: Vec<(TabletId, QuerySink)>,
    snapshot: &Arc<SnapshotEntry>,
) -> Result<Vec<QuerySink>, EngineError> {
    let jobs: Vec<(TabletId, Arc<Job>)> = work
        .into_iter()
        .map(|(t, sink)| (t, Job::new(snapshot.clone(), sink)))
        .collect();
    run_shared_many(inner, &jobs)?;
    Ok(jobs.iter().map(|(_, j)| j.take_sink()).collect())
}

/// Resumable paging through a table's log at one snapshot.
pub struct ScanCursor {
    pub(crate) inner: Arc<Inner>,
    pub(crate) snapshot: crate::Snapshot,
    pub(crate) query: Arc<CompiledQuery>,
    pub(crate) tablets: std::collections::VecDeque<TabletId>,
    pub(crate) current: Option<CursorTablet>,
    pub(crate) scratch: Vec<u8>,
    pub(crate) malformed: u64,
}

pub(crate) struct CursorTablet {
    tablet: TabletId,
    capture: Capture,
    next_segment: usize,
    walk: Option<SegmentWalk>,
    open: Vec<u64>,
}

impl ScanCursor {
    /// The snapshot the cursor reads at.
    pub fn snapshot(&self) -> &crate::Snapshot {
        &self.snapshot
    }

    /// Whether every tablet has been read.
    pub fn is_done(&self) -> bool {
        self.current.is_none() && self.tablets.is_empty()
    }

    /// Returns up to `max` more matching records (projected), in log order per tablet. An empty
    /// page with `is_done()` true means the scan is complete.
    pub fn next_page(&mut self, max: usize) -> Result<Vec<ScanRecord>, EngineError> {
        let max = max.max(1);
        let inner = self.inner.clone();
        let mut sink = QuerySink::new(self.query.clone(), max);
        self.snapshot.check()?;
        let (version, wall_ms) = (self.snapshot.version(), self.snapshot.wall_ms());
        while sink.out.records.len() < max {
            if self.current.is_none() {
                let Some(t) = self.tablets.pop_front() else {
                    break;
                };
                let capture = capture(&inner, t, &[self.snapshot.entry()])?;
                inner
                    .snapshots
                    .attach_pins(self.snapshot.entry(), capture.pins.clone());
                self.current = Some(CursorTablet {
                    tablet: t,
                    capture,
                    next_segment: 0,
                    walk: None,
                    open: open_versions(&inner),
                });
            }
            let cur = self.current.as_mut().expect("set above");
            let tablet = inner.tablet(cur.tablet)?;
            if cur.walk.is_none() {
                match cur.capture.segments.get(cur.next_segment) {
                    Some(c) => cur.walk = Some(SegmentWalk::new(&inner, *c)),
                    None => {
                        inner.unpin_all(&cur.capture.pins);
                        self.current = None;
                        continue;
                    }
                }
            }
            let walk = cur.walk.as_mut().expect("set above");
            let guard = epoch::pin();
            let finished = walk.walk(&inner, tablet, &cur.open, &mut self.scratch, |e| {
                if visible_at(&inner, tablet, e, version, wall_ms) {
                    sink.accept(e.key, e.value, e.header.version, e.header.expire_at_ms);
                }
                sink.out.records.len() < max
            })?;
            drop(guard);
            if finished {
                let walk = cur.walk.take().expect("present");
                unpin_one(&inner, &cur.capture.pins, walk.segment);
                report_garbage(&inner, &walk);
                cur.next_segment += 1;
            }
            self.snapshot.check()?;
        }
        // A page that ended exactly at the end of the tablet's data finishes the tablet now, so that
        // `is_done` does not promise another (empty) page.
        if let Some(cur) = &self.current {
            if cur.walk.is_none() && cur.next_segment >= cur.capture.segments.len() {
                inner.unpin_all(&cur.capture.pins);
                self.current = None;
            }
        }
        let out = sink.finish()?;
        self.malformed += out.malformed;
        Ok(out.records)
    }

    /// Values skipped so far because they are not records of the table's schema.
    pub fn malformed(&self) -> u64 {
        self.malformed
    }
}

impl Drop for ScanCursor {
    fn drop(&mut self) {
        if let Some(cur) = self.current.take() {
            self.inner.unpin_all(&cur.capture.pins);
        }
    }
}

impl std::fmt::Debug for ScanCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScanCursor")
            .field("snapshot", &self.snapshot.version())
            .field("tablets_left", &self.tablets.len())
            .field("done", &self.is_done())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segs(used: &[u32]) -> Vec<Captured> {
        used.iter()
            .enumerate()
            .map(|(i, &used)| Captured {
                segment: i as u32,
                used,
            })
            .collect()
    }

    #[test]
    fn passes_split_into_runs_of_about_equal_bytes() {
        let lens = |parts: Vec<&[Captured]>| parts.iter().map(|p| p.len()).collect::<Vec<_>>();
        let eight = segs(&[8; 8]);
        assert_eq!(lens(split_by_bytes(&eight, 2)), [4, 4]);
        assert_eq!(lens(split_by_bytes(&eight, 3)), [3, 3, 2]);
        assert_eq!(lens(split_by_bytes(&eight, 1)), [8]);
        // One big segment and small ones: the big one is a run of its own.
        assert_eq!(lens(split_by_bytes(&segs(&[100, 1, 1, 1]), 2)), [1, 3]);
        // Never more runs than segments, never an empty run.
        assert_eq!(lens(split_by_bytes(&segs(&[5, 5]), 8)), [1, 1]);
        assert_eq!(lens(split_by_bytes(&segs(&[5]), 2)), [1]);
        assert_eq!(lens(split_by_bytes(&[], 2)), [0]);
        // The runs cover every segment once, in order.
        let mixed = segs(&[3, 9, 1, 7, 7, 2, 8]);
        for parts in 1..=8 {
            let got: Vec<u32> = split_by_bytes(&mixed, parts)
                .concat()
                .iter()
                .map(|c| c.segment)
                .collect();
            assert_eq!(got, (0..7).collect::<Vec<_>>());
        }
    }
}

#[cfg(test)]
mod scan_snapshot_tests {
    use super::*;
    use crate::{Engine, EngineConfig, PutOptions};

    /// A single scan's snapshot keeps superseded versions only in its table, and in a tablet only
    /// until its pass has captured the tablet and read the segment; a general snapshot keeps them
    /// everywhere.
    #[test]
    fn single_scan_snapshots_keep_versions_only_in_their_table_and_until_read() {
        let e = crate::test_support::small_engine_without_cleaner();
        let a = e.create_tablet(1, 0, 16383).unwrap();
        let b = e.create_tablet(2, 0, 16383).unwrap();
        let keys: Vec<Vec<u8>> = (0..3000).map(|i| format!("k{i}").into_bytes()).collect();
        let value = vec![7u8; 500];
        let put = |t, k: &[u8]| {
            e.put(t, k, &value, &PutOptions::default()).unwrap();
        };
        for k in &keys {
            put(a, k);
            put(b, k);
        }
        let retained = || e.stats().retained_versions;
        let inner = &e.inner;
        let snap = inner.open_snapshot_of(Some(1));
        // Another table: nothing kept.
        put(b, &keys[0]);
        assert_eq!(retained(), 0, "a write to another table kept a version");
        // This table before the pass captured the tablet: kept.
        put(a, &keys[1]);
        assert_eq!(
            retained(),
            1,
            "a version the scan has still to capture was dropped"
        );
        let cap = capture(inner, a, &[snap.entry()]).unwrap();
        assert!(cap.segments.len() > 1, "the table fills several segments");
        // Captured and still to be read (pinned): kept where it is, for the scan only (no
        // HISTORIC reference), with its valid-to in the entry.
        let old_loc = inner
            .tablet(a)
            .unwrap()
            .index
            .lookup(crate::engine::hash_key(&keys[2]), |loc| {
                inner
                    .with_entry(loc, false, |e| e.key == &keys[2][..])
                    .unwrap_or(false)
            })
            .map(|(_, loc)| loc)
            .expect("the key is indexed");
        put(a, &keys[2]);
        assert_eq!(
            retained(),
            1,
            "a version kept for a pinned scan was indexed"
        );
        assert_eq!(e.stats().kept_in_place_versions, 1);
        let state = inner.entry_state(old_loc).load(Ordering::Acquire);
        assert_eq!(
            state & (STATE_SUPERSEDED | STATE_RETAINED),
            STATE_SUPERSEDED | STATE_RETAINED,
            "a version in a segment still to be read was dropped"
        );
        // Read (unpinned): the scan never comes back, nothing kept.
        inner.unpin_all(&cap.pins);
        put(a, &keys[3]);
        assert_eq!(retained(), 1, "a version behind the scan was kept");
        assert_eq!(e.stats().kept_in_place_versions, 1);
        // A general snapshot keeps versions in every table.
        let general = e.snapshot();
        put(b, &keys[4]);
        assert_eq!(retained(), 2, "a general snapshot did not keep a version");
        // A tablet of the table created while the scan runs waits for it too.
        let late = e.create_tablet(1, 0, 0).unwrap();
        assert_eq!(
            *inner.tablet(late).unwrap().scan_uncaptured.lock(),
            vec![(snap.version(), snap.entry().id)]
        );
        drop(general);
        drop(snap);
        for t in [a, late] {
            assert!(
                inner.tablet(t).unwrap().scan_uncaptured.lock().is_empty(),
                "a released scan snapshot still waits for tablet {t}"
            );
        }
    }

    /// A scan whose pins keep memory the writers need gives way: its snapshot is released (too
    /// old), its pins dropped, and the writes go through, even when every version it kept was
    /// kept in place (no retained bytes anywhere).
    #[test]
    fn a_scan_pinning_memory_writers_need_gives_way() {
        let e = Engine::new(EngineConfig {
            memory_bytes: 16 << 20,
            segment_seglets: 4,
            value_size_max_bytes: 4096,
            oom_wait_ms: 3000,
            snapshot_max_retained_bytes: Some(u64::MAX),
            ..Default::default()
        })
        .unwrap();
        let t = e.create_tablet(1, 0, 16383).unwrap();
        let keys: Vec<Vec<u8>> = (0..18_000)
            .map(|i| format!("p{i:06}").into_bytes())
            .collect();
        for k in &keys {
            e.put(t, k, &[1u8; 500], &PutOptions::default()).unwrap();
        }
        let inner = &e.inner;
        let snap = inner.open_snapshot_of(Some(1));
        let cap = capture(inner, t, &[snap.entry()]).unwrap();
        inner.snapshots.attach_pins(snap.entry(), cap.pins.clone());
        // Overwriting everything needs more memory than the pinned segments leave.
        for round in 2..5u8 {
            for k in &keys {
                e.put(t, k, &[round; 500], &PutOptions::default())
                    .unwrap_or_else(|err| panic!("round {round}: {err}"));
            }
        }
        assert_eq!(e.stats().retained_versions, 0);
        assert!(e.stats().kept_in_place_versions > 0);
        match inner.snapshots.check(inner, snap.entry()) {
            Err(EngineError::SnapshotTooOld { reason, .. }) => {
                assert!(reason.contains("memory is full"), "{reason}")
            }
            other => panic!("expected the scan's snapshot to be released, got {other:?}"),
        }
        assert!(cap.pins.segments.lock().is_empty(), "the scan still pins");
        assert_eq!(e.get(t, &keys[7]).unwrap().unwrap().value, vec![4u8; 500]);
    }

    /// A scan snapshot serves its one scan of its table; every other use is refused.
    #[test]
    fn scan_snapshots_serve_one_scan_of_their_table() {
        use crate::ScanMethod;
        use ramlog_query::{KeyFilter, Query};
        let e = Engine::new(EngineConfig {
            memory_bytes: 32 << 20,
            cleaner_threads: 0,
            ..Default::default()
        })
        .unwrap();
        let a = e.create_tablet(1, 0, 16383).unwrap();
        e.create_tablet(2, 0, 16383).unwrap();
        e.put(a, b"k", b"v", &PutOptions::default()).unwrap();
        let all = Query::keys(KeyFilter::All);
        let s = e.scan_snapshot(1);
        assert!(e.get_at(a, b"k", &s).is_err(), "a point read went through");
        assert!(
            e.scan(2, &s, &all, ScanMethod::Log, usize::MAX).is_err(),
            "a scan of another table went through"
        );
        let out = e.scan(1, &s, &all, ScanMethod::Log, usize::MAX).unwrap();
        assert_eq!(out.records.len(), 1);
        assert!(
            e.scan(1, &s, &all, ScanMethod::Log, usize::MAX).is_err(),
            "a second scan went through"
        );
        let (now, at) = e.scan_now(1, &all, ScanMethod::Log, usize::MAX).unwrap();
        assert_eq!((now.records.len(), at), (1, s.version()));
    }
}
