//! The two-level cleaner (RAMCloud ch. 4–5, 7).
//!
//! *Compaction* rewrites one segment into a fresh one holding only its live entries and frees the
//! difference in seglets; it picks greedily the segment that frees the most seglets per live byte.
//! *Combined cleaning* picks several segments by cost-benefit with segment age,
//! `(1 − u)·age / (1 + u)`, and rewrites their live entries into survivor segments sorted by version
//! (versions come from one clock, so version order is age order). A balancer chooses between them.
//!
//! Cleaning never blocks readers, and writers wait at most for one small batch of reference swaps:
//! entries are copied without locks, then swapped under the tablet's write lock in batches, checking
//! that the index still points at the old copy. Victim seglets are freed through crossbeam-epoch once
//! no reader can hold a reference into them.
//!
//! Deadlock freedom: writers cannot take the last `reserve` seglets, a combined pass copies at most
//! what the free seglets can hold, segments above 98% utilisation are never cleaned, and compaction
//! only runs when it frees at least one seglet.

use crate::config::Balancer;
use crate::engine::{hash_key, now_ms, Inner};
use crate::entry::{Header, STATE_MOVED, STATE_RETAINED, STATE_SUPERSEDED};
use crate::index::{loc_offset, loc_seglet, make_loc, Loc, SlotRef};
use crate::pool::{AllocClass, NO_SEGLET, SEGLET_BYTES};
use crate::segment::{AppendError, SegmentState, SegmentWriter};
use crossbeam_epoch as epoch;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Segments above this utilisation are never cleaned (each pass must free more than it uses).
const CLEANABLE_UTILISATION_MAX: f64 = 0.98;
/// See `memory_low`.
const FREE_TARGET_DIVISOR: f64 = 16.0;
/// Reference swaps done per acquisition of a tablet's write lock.
const SWAP_BATCH: usize = 128;
/// How long the cleaner waits before looking again for a segment to recycle after finding none.
const RECYCLE_RETRY: Duration = Duration::from_millis(10);
/// Segments below this utilisation found by scans are compacted even without memory pressure
/// (TellStore's 50% rule).
pub(crate) const SPARSE_UTILISATION: f64 = 0.5;

/// The trigger: clean when free seglets F <= min(10%, (1 - L) / 16), L the live fraction. RAMCloud
/// uses (1 - L) / 2; here F counts only seglets writers may take (the cleaner keeps its own reserve
/// besides), so a smaller free target suffices, and it lets segments decay longer before they are
/// cleaned: at 90% live, 100 B objects, the cleaner copies 5.1 bytes per new byte (uniform) and 2.9
/// (zipfian) instead of 12.2 and 6.1 with (1 - L) / 2, once cleaning itself became fast.
/// The cleaner still starts before writers reach the reserve and runs beside them. Memory charged
/// to the budget from outside the log (hash indexes, the external charge) is not free: F counts
/// what writers may take, and L is live bytes over the log's capacity.
pub(crate) fn memory_low(inner: &Inner) -> bool {
    let total = inner.pool.seglet_count() as f64;
    let writer_free = inner.pool.writer_free_count();
    let free = writer_free as f64 / total;
    let live = inner.utilisation().min(1.0);
    free <= 0.10f64.min((1.0 - live) / FREE_TARGET_DIVISOR) || writer_free <= 1
}

/// Whether the log is about to take memory it never touched while segments it already holds are
/// mostly garbage. The first touch of fresh memory costs a page fault and a zeroing per page (and
/// in a virtual machine the host's own fault: 4–8 ms per 2 MiB measured here), and it grows the
/// process's resident memory towards the whole budget. Compacting a segment below 50% live
/// (TellStore's rule, as for the sparse segments scans report) frees more than it copies, so the
/// cleaner recycles such segments first. Writers never wait for this: when it does not keep up,
/// they take fresh memory as before.
pub(crate) fn recycling_wanted(inner: &Inner) -> bool {
    let pool = &inner.pool;
    let fresh = pool.fresh_count();
    if fresh
        <= pool
            .reserve_seglets()
            .saturating_add(pool.charged_seglets())
    {
        // No fresh memory left for writers: the ordinary trigger (`memory_low`) governs.
        return false;
    }
    let recycled = pool.free_count().saturating_sub(fresh);
    if recycled >= inner.config.segment_seglets {
        return false;
    }
    let in_use = (pool.seglet_count() - pool.free_count()) as f64 * SEGLET_BYTES as f64;
    let live = inner.live_bytes.sum().max(0) as f64;
    live < in_use * SPARSE_UTILISATION
}

/// Moves deferred frees along: advances the epoch and runs reclaimable destructors.
pub(crate) fn collect_garbage() {
    for _ in 0..4 {
        epoch::pin().flush();
    }
}

/// Waits (briefly, yielding) until retired segments have passed their grace period and are back in
/// the pool. Readers pin for microseconds, so a few epoch advances suffice.
pub(crate) fn drain_limbo(inner: &Inner) {
    for round in 0..1000 {
        collect_garbage();
        inner.release_reclaimable();
        if inner.limbo_seglets.load(Ordering::Relaxed) == 0 {
            return;
        }
        if round < 100 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// The background cleaner thread's loop.
pub(crate) fn cleaner_thread(inner: Arc<Inner>, thread_index: usize) {
    let mut idle_rounds = 0u32;
    let mut recycle_retry_at: Option<Instant> = None;
    let mut sweep_at = Instant::now() + EXPIRY_SWEEP_INTERVAL;
    let mut sweep_cursor = 0u32;
    while !inner.shutdown.load(Ordering::Acquire) {
        if thread_index == 0 {
            // Follows the hash indexes' growth when writers take no seglet (overwrites that the
            // cleaner keeps up with, or new keys in the heads' last seglets).
            inner.refresh_charge();
        }
        if thread_index == 0 && Instant::now() >= sweep_at {
            sweep_expired(
                &inner,
                &mut sweep_cursor,
                Some(Instant::now() + EXPIRY_SWEEP_BUDGET),
                false,
            );
            sweep_at = Instant::now() + EXPIRY_SWEEP_INTERVAL;
        }
        if retire_unpinned(&inner) > 0 {
            collect_garbage();
            if inner.release_reclaimable() > 0 {
                inner.memory_cv.notify_all();
            }
        }
        if thread_index == 0 {
            inner.snapshots.release_overdue(&inner);
            queue_released_retention(&inner);
            if compact_sparse(&inner) {
                collect_garbage();
                if inner.release_reclaimable() > 0 {
                    inner.memory_cv.notify_all();
                }
            }
        }
        if memory_low(&inner) {
            // Only thread 0 may run combined cleaning (RAMCloud: one combined cleaner is enough).
            let mut progressed = run_pass(&inner, thread_index == 0);
            if !progressed && thread_index == 0 {
                // Nothing closed is worth cleaning: what can be freed sits in head segments.
                progressed = close_wasteful_heads(&inner) > 0;
            }
            collect_garbage();
            if inner.release_reclaimable() > 0 {
                inner.memory_cv.notify_all();
            }
            // Wait for the grace period only when writers are starved for memory.
            if inner.pool.writer_free_count() == 0 {
                drain_limbo(&inner);
            }
            inner.last_pass_idle.store(!progressed, Ordering::Release);
            inner.pass_seq.fetch_add(1, Ordering::AcqRel);
            inner.memory_cv.notify_all();
            if progressed {
                idle_rounds = 0;
                continue;
            }
            idle_rounds = idle_rounds.saturating_add(1);
        } else if recycle_retry_at.is_none_or(|at| Instant::now() >= at) && recycling_wanted(&inner)
        {
            if compact_best(&inner, SPARSE_UTILISATION) {
                recycle_retry_at = None;
                collect_garbage();
                inner.release_reclaimable();
                continue;
            }
            // Nothing sparse to recycle: look again a little later.
            recycle_retry_at = Some(Instant::now() + RECYCLE_RETRY);
        }
        collect_garbage();
        if inner.release_reclaimable() > 0 {
            inner.memory_cv.notify_all();
        }
        let mut wake = inner.cleaner_wake.lock();
        if !*wake {
            let wait = if idle_rounds > 0 {
                Duration::from_millis(2)
            } else {
                Duration::from_millis(10)
            };
            inner.cleaner_cv.wait_for(&mut wake, wait);
        }
        *wake = false;
    }
}

/// Closes the few head segments that hold the most the cleaner could free, so that it may clean
/// them. Called when memory is low and no closed segment is worth cleaning. What counts is a
/// head's garbage (bytes written and since overwritten or deleted) and the unwritten tail of its
/// last seglet, at least half a seglet of them: heads opened large (before tablets were added, or
/// for a large entry) can hold much of the garbage, and with hundreds of tablets in a small budget
/// the heads' tails are a good part of memory, which packing a closed head with its tablet's other
/// segments gets back. The tablet's next write opens a new head with a tail of its own, so closing
/// every such head at once would mostly copy live bytes around: it closes at most half the
/// cleaner's reserve of them, the most wasteful first. Returns how many it closed.
pub(crate) fn close_wasteful_heads(inner: &Inner) -> usize {
    let threshold = (SEGLET_BYTES / 2) as i64;
    let waste_of = |writer: &SegmentWriter| -> i64 {
        let allocated = (writer.seglet_count() * SEGLET_BYTES) as i64;
        let live = inner
            .segments
            .get(writer.segment)
            .live_bytes
            .load(Ordering::Relaxed)
            .max(0);
        if writer.used() == 0 {
            0
        } else {
            allocated - live
        }
    };
    let mut wasteful: Vec<(i64, u32)> = Vec::new();
    for id in 0..inner.tablet_count() {
        let Ok(tablet) = inner.tablet(id) else {
            continue;
        };
        let waste = tablet.head.lock().as_ref().map_or(0, &waste_of);
        if waste >= threshold {
            wasteful.push((waste, id));
        }
    }
    wasteful.sort_unstable_by_key(|&(waste, _)| std::cmp::Reverse(waste));
    wasteful.truncate((inner.pool.reserve_seglets() / 2).max(1));
    let mut closed = 0;
    for (_, id) in wasteful {
        let Ok(tablet) = inner.tablet(id) else {
            continue;
        };
        let mut head = tablet.head.lock();
        // Checked again: writers may have filled or replaced the head meanwhile.
        if head.as_ref().is_some_and(|w| waste_of(w) >= threshold) {
            head.take().expect("present").close(&inner.segments);
            closed += 1;
        }
    }
    inner
        .counters
        .heads_closed
        .fetch_add(closed as u64, Ordering::Relaxed);
    closed
}

enum Mode {
    Compaction,
    Combined,
}

/// Runs one cleaning pass. Returns whether it freed or moved anything.
pub(crate) fn run_pass(inner: &Inner, may_combine: bool) -> bool {
    // Relocated victims that scans have let go are the cheapest memory there is (also where no
    // cleaner thread runs and writers clean for themselves).
    if retire_unpinned(inner) > 0 {
        return true;
    }
    let passes = inner.counters.compaction_passes.load(Ordering::Relaxed)
        + inner.counters.combined_passes.load(Ordering::Relaxed);
    let mode = match inner.config.balancer {
        Balancer::TombstoneRatio(ratio) => {
            // Tombstones are dead from the start in the master (nothing replays its memory log), so
            // T is 0 unless that changes; the rule is kept so that the policy stays RAMCloud's.
            let total = inner.total_bytes() as f64;
            let live = inner.live_bytes.sum().max(0) as f64 / total;
            let undead_tombstones = 0.0;
            if may_combine && undead_tombstones / (1.0 - live).max(1e-9) >= ratio {
                Mode::Combined
            } else {
                Mode::Compaction
            }
        }
        Balancer::FixedDuty(pct) => {
            if may_combine && (passes % 100) < pct as u64 {
                Mode::Combined
            } else {
                Mode::Compaction
            }
        }
    };
    match mode {
        Mode::Compaction => {
            if compact_best(inner, 1.0) {
                return true;
            }
            inner
                .counters
                .compaction_failures
                .fetch_add(1, Ordering::Relaxed);
            // Compaction could not free a seglet: combined cleaning must run (RAMCloud rule 3).
            may_combine && combined_clean(inner)
        }
        Mode::Combined => combined_clean(inner) || compact_best(inner, 1.0),
    }
}

/// A live entry found in a victim segment.
#[derive(Clone, Copy)]
struct Survivor {
    loc: Loc,
    hash: u64,
    len: u32,
    version: u64,
    /// The victim segment it comes from.
    segment: u32,
}

/// Walks a closed segment's entries in log order. The header's `state` is read atomically before
/// the rest, so for a RETAINED entry the CRC field already holds its valid-to.
fn for_each_entry(inner: &Inner, segment: u32, f: impl FnMut(Loc, &Header, &[u8])) {
    for_each_entry_from(inner, segment, 0, f);
}

/// As `for_each_entry`, from byte `from` of the segment (an entry boundary) to the end of what
/// is published; returns that end.
fn for_each_entry_from(
    inner: &Inner,
    segment: u32,
    from: usize,
    mut f: impl FnMut(Loc, &Header, &[u8]),
) -> usize {
    let slot = inner.segments.get(segment);
    let used = slot.used_bytes.load(Ordering::SeqCst) as usize;
    let mut seglet = slot.first_seglet.load(Ordering::Acquire);
    let mut off = from;
    let mut pos = from;
    while off >= SEGLET_BYTES && seglet != NO_SEGLET {
        seglet = inner.pool.next_seglet(seglet);
        off -= SEGLET_BYTES;
    }
    while pos < used && seglet != NO_SEGLET {
        let loc = make_loc(seglet, off);
        let state = inner.entry_state(loc).load(Ordering::Acquire) & crate::entry::STATE_MASK;
        let Ok(len) = inner.with_entry(loc, false, |e| {
            let mut header = e.header;
            header.state = state;
            f(loc, &header, e.key);
            header.total_len()
        }) else {
            tracing::error!(
                segment,
                pos,
                "undecodable entry while cleaning; rest of segment skipped"
            );
            return used;
        };
        pos += len;
        off += len;
        while off >= SEGLET_BYTES && seglet != NO_SEGLET {
            seglet = inner.pool.next_seglet(seglet);
            off -= SEGLET_BYTES;
        }
    }
    used
}

/// Collects the live entries of a victim from their state bits alone (no index probe): current
/// objects and RETAINED versions some snapshot still needs. Expired objects no snapshot can read,
/// and retained versions no snapshot needs, are removed from the index on the way.
fn live_entries(inner: &Inner, segment: u32, out: &mut Vec<Survivor>) {
    let tablet_id = inner.segments.get(segment).tablet.load(Ordering::Relaxed);
    let Ok(tablet) = inner.tablet(tablet_id) else {
        return;
    };
    let mut now = None;
    let mut removable: Vec<(Loc, u64)> = Vec::new();
    for_each_entry(inner, segment, |loc, header, key| {
        if !header.is_object() || header.state & STATE_MOVED != 0 {
            return;
        }
        let hash = hash_key(key);
        if header.state & STATE_SUPERSEDED != 0 {
            if header.state & STATE_RETAINED == 0 {
                return;
            }
            let valid_to = inner.retained_valid_to(tablet, header, key);
            if !inner.snapshots.any_within(header.version, valid_to) {
                removable.push((loc, hash));
                return;
            }
        } else if header.expire_at_ms != 0
            && *now.get_or_insert_with(now_ms) >= header.expire_at_ms
            && !inner.snapshots.any_at_or_above(header.version)
        {
            removable.push((loc, hash));
            return;
        }
        out.push(Survivor {
            loc,
            hash,
            len: header.total_len() as u32,
            version: header.version,
            segment,
        });
    });
    if removable.is_empty() {
        return;
    }
    let _guard = epoch::pin();
    remove_all_dead(inner, tablet, segment, &removable, |kept| out.push(kept));
}

/// Removes the entries of `segment` a walk found dead (`(loc, hash)` pairs) with `remove_dead`,
/// handing `kept` those a snapshot opened since the walk may read. Removal happens under the write
/// lock, after checking again: a snapshot may have been opened, or the object replaced, since the
/// walk. As for relocation's swaps, each reference is found before the lock (the index probes are
/// cache misses) and the lock is held for one batch at a time, so a writer waits at most for a
/// batch. The caller holds an epoch pin.
fn remove_all_dead(
    inner: &Inner,
    tablet: &crate::engine::Tablet,
    segment: u32,
    removable: &[(Loc, u64)],
    mut kept: impl FnMut(Survivor),
) {
    let mut key_buf = Vec::new();
    let mut hints: Vec<Option<SlotRef>> = Vec::with_capacity(SWAP_BATCH);
    for batch in removable.chunks(SWAP_BATCH) {
        hints.clear();
        hints.extend(
            batch
                .iter()
                .map(|&(loc, hash)| tablet.index.find_loc(hash, loc)),
        );
        let _head = tablet.head.lock();
        for (&(loc, hash), &hint) in batch.iter().zip(&hints) {
            if let Some(s) = remove_dead(inner, tablet, (loc, hash, segment), hint, &mut key_buf) {
                kept(s);
            }
        }
    }
}

/// Removes from the index an entry `live_entries` found dead (a retained version no snapshot needs,
/// or an expired object no snapshot can read), after checking again under the tablet's write lock
/// (held by the caller). `hint` is its slot as found before the lock. Returns the entry as a
/// survivor when it is still referenced and a snapshot opened since the walk may read it: the
/// victim is freed afterwards, so it must be relocated like any live entry.
fn remove_dead(
    inner: &Inner,
    tablet: &crate::engine::Tablet,
    (loc, hash, segment): (Loc, u64, u32),
    hint: Option<SlotRef>,
    key_buf: &mut Vec<u8>,
) -> Option<Survivor> {
    let state = inner.entry_state(loc).load(Ordering::Acquire);
    let slot = match hint {
        Some(slot) if tablet.index.holds(slot, hash, loc) => slot,
        _ => tablet.index.find_loc(hash, loc)?,
    };
    let mut header = inner
        .with_entry(loc, false, |e| {
            key_buf.clear();
            key_buf.extend_from_slice(e.key);
            e.header
        })
        .ok()?;
    header.state = state & crate::entry::STATE_MASK;
    if state & STATE_RETAINED != 0 {
        let valid_to = inner.retained_valid_to(tablet, &header, key_buf);
        if !inner.snapshots.any_within(header.version, valid_to) {
            inner.drop_retained(tablet, slot, hash, loc, &header, key_buf);
            return None;
        }
    } else if state & STATE_SUPERSEDED != 0 {
        // Replaced or deleted since the walk, and no snapshot kept it: garbage.
        return None;
    } else if !inner.snapshots.any_at_or_above(header.version) {
        let by = inner.clock.load(Ordering::Relaxed) + 1;
        inner.supersede(tablet, hash, key_buf, (slot, loc, header), None, by);
        inner
            .counters
            .expired_reclaimed
            .fetch_add(1, Ordering::Relaxed);
        if let Some(observer) = inner.expired_observer.get() {
            observer(tablet.table, key_buf);
        }
        return None;
    }
    Some(Survivor {
        loc,
        hash,
        len: header.total_len() as u32,
        version: header.version,
        segment,
    })
}

/// Copies one entry's raw bytes (header, key, value, CRC unchanged) into a survivor, marked MOVED
/// until its reference is swapped to it.
fn copy_entry(
    inner: &Inner,
    loc: Loc,
    len: usize,
    writer: &mut SegmentWriter,
    scratch: &mut Vec<u8>,
) {
    let dest = writer.position();
    copy_bytes(inner, loc, len, writer, scratch);
    inner
        .entry_state(dest)
        .fetch_or(STATE_MOVED, Ordering::Release);
}

fn copy_bytes(
    inner: &Inner,
    loc: Loc,
    len: usize,
    writer: &mut SegmentWriter,
    scratch: &mut Vec<u8>,
) {
    let off = loc_offset(loc);
    if off + len <= SEGLET_BYTES {
        // SAFETY: the victim is claimed by this cleaner and not freed until after the pass.
        let tail = unsafe { inner.pool.seglet_tail(loc_seglet(loc), off) };
        writer.write(&inner.pool, &tail[..len]);
    } else {
        scratch.clear();
        let mut seglet = loc_seglet(loc);
        let mut o = off;
        while scratch.len() < len && seglet != NO_SEGLET {
            // SAFETY: as above.
            let tail = unsafe { inner.pool.seglet_tail(seglet, o) };
            let n = tail.len().min(len - scratch.len());
            scratch.extend_from_slice(&tail[..n]);
            seglet = inner.pool.next_seglet(seglet);
            o = 0;
        }
        debug_assert_eq!(scratch.len(), len);
        writer.write(&inner.pool, scratch);
    }
}

/// Writes `survivors` (all of one tablet) into survivor segments and swings the index to them.
/// Returns the bytes that ended up live in survivors and the survivor segments' seglets.
fn relocate(
    inner: &Inner,
    tablet_id: u32,
    survivors: &[Survivor],
    created: u64,
) -> Result<(u64, u64), ()> {
    let tablet = inner.tablet(tablet_id).map_err(|_| ())?;
    let mut writer: Option<SegmentWriter> = None;
    let mut moved: Vec<Moved> = Vec::with_capacity(survivors.len().min(4096));
    let mut scratch = Vec::new();
    let mut relocated_bytes = 0u64;
    let mut survivor_seglets = 0u64;
    let mut blocked = false;
    // Relocation moves bytes between segments and leaves the engine's live total unchanged, so only
    // segment counters change, once per batch (the victim's are reset when it is retired).
    let mut hints: Vec<Option<SlotRef>> = Vec::with_capacity(SWAP_BATCH);
    let mut flush = |moved: &mut Vec<Moved>, relocated: &mut u64| {
        let _guard = epoch::pin();
        // Find each reference before taking the lock, the way readers do: the index probes (cache
        // misses) then happen while writers may run, and under the lock each is one check.
        hints.clear();
        hints.extend(
            moved
                .iter()
                .map(|m| tablet.index.find_loc(m.survivor.hash, m.survivor.loc)),
        );
        let head = tablet.head.lock();
        let mut gained: Option<(u32, i64)> = None;
        for (m, hint) in moved.drain(..).zip(hints.iter()) {
            let Moved { survivor: s, to } = m;
            let seg = to.segment;
            if swap_in(inner, tablet, &s, to, *hint, &mut blocked) {
                *relocated += s.len as u64;
                match &mut gained {
                    Some((g, n)) if *g == seg => *n += s.len as i64,
                    _ => {
                        if let Some((g, n)) = gained.take() {
                            inner
                                .segments
                                .get(g)
                                .live_bytes
                                .fetch_add(n, Ordering::Relaxed);
                        }
                        gained = Some((seg, s.len as i64));
                    }
                }
            }
        }
        if let Some((g, n)) = gained {
            inner
                .segments
                .get(g)
                .live_bytes
                .fetch_add(n, Ordering::Relaxed);
        }
        drop(head);
    };
    for s in survivors {
        loop {
            if writer.is_none() {
                match SegmentWriter::open(
                    &inner.segments,
                    &inner.pool,
                    AllocClass::Cleaner,
                    tablet_id,
                    created,
                    inner.config.segment_seglets,
                ) {
                    Ok(w) => writer = Some(w),
                    Err(_) => {
                        flush(&mut moved, &mut relocated_bytes);
                        return Err(());
                    }
                }
            }
            let w = writer.as_mut().expect("opened above");
            match w.reserve(
                &inner.segments,
                &inner.pool,
                s.len as usize,
                AllocClass::Cleaner,
            ) {
                Ok(()) => {
                    let new_loc = w.position();
                    let offset = w.used() as u32;
                    copy_entry(inner, s.loc, s.len as usize, w, &mut scratch);
                    // The copy may carry an expiry: the survivor segment inherits the victim's
                    // bound (a lower bound still; the expiry sweep makes it exact).
                    let expire_min = inner
                        .segments
                        .get(s.segment)
                        .expire_min_ms
                        .load(Ordering::Acquire);
                    if expire_min != u64::MAX {
                        inner
                            .segments
                            .get(w.segment)
                            .expire_min_ms
                            .fetch_min(expire_min, Ordering::Release);
                    }
                    moved.push(Moved {
                        survivor: *s,
                        to: Destination {
                            loc: new_loc,
                            segment: w.segment,
                            offset,
                        },
                    });
                    // The swap probes this bucket again: start loading it now.
                    tablet.index.prefetch(s.hash);
                    break;
                }
                Err(AppendError::SegmentFull) => {
                    w.publish(&inner.segments);
                    flush(&mut moved, &mut relocated_bytes);
                    let full = writer.take().expect("present");
                    survivor_seglets += inner
                        .segments
                        .get(full.segment)
                        .seglet_count
                        .load(Ordering::Relaxed) as u64;
                    full.close(&inner.segments);
                }
                Err(AppendError::NoMemory) => {
                    w.publish(&inner.segments);
                    flush(&mut moved, &mut relocated_bytes);
                    let w = writer.take().expect("present");
                    w.close(&inner.segments);
                    return Err(());
                }
            }
        }
        if moved.len() >= SWAP_BATCH {
            writer.as_ref().expect("present").publish(&inner.segments);
            flush(&mut moved, &mut relocated_bytes);
        }
    }
    if let Some(w) = writer.take() {
        w.publish(&inner.segments);
        flush(&mut moved, &mut relocated_bytes);
        if w.used() == 0 {
            w.abandon(&inner.segments, &inner.pool);
        } else {
            survivor_seglets += inner
                .segments
                .get(w.segment)
                .seglet_count
                .load(Ordering::Relaxed) as u64;
            w.close(&inner.segments);
        }
    }
    if blocked {
        // A scan pinned a victim or this survivor's range meanwhile: what was not swapped stays in
        // the victim, which goes back to Closed.
        return Err(());
    }
    Ok((relocated_bytes, survivor_seglets))
}

/// A copy waiting for its reference swap.
struct Moved {
    survivor: Survivor,
    to: Destination,
}

/// Where a survivor's copy sits.
struct Destination {
    loc: Loc,
    /// Survivor segment and the copy's byte offset in it.
    segment: u32,
    offset: u32,
}

/// Swaps the index reference of one entry to its copy, carrying over the state bits (and a
/// RETAINED entry's valid-to) the original gained since it was copied. Returns false when the entry
/// died meanwhile (the copy stays MOVED, i.e. garbage) or a scan forbids the swap (`blocked`).
/// `hint` is the entry's slot as found before the lock (checked again here). Caller holds the
/// tablet's write lock.
fn swap_in(
    inner: &Inner,
    tablet: &crate::engine::Tablet,
    s: &Survivor,
    at: Destination,
    hint: Option<SlotRef>,
    blocked: &mut bool,
) -> bool {
    let src_byte = inner.entry_state(s.loc).load(Ordering::Acquire);
    if src_byte & STATE_MOVED != 0
        || (src_byte & STATE_SUPERSEDED != 0 && src_byte & STATE_RETAINED == 0)
    {
        return false;
    }
    // A scan reading the victim, or the range of the survivor the copy sits in, must see no entry
    // change between live and MOVED while it reads: such swaps wait for another pass.
    let src_pinned = inner.segments.get(s.segment).pins.load(Ordering::Acquire) != 0;
    let dest = inner.segments.get(at.segment);
    let dest_pinned = dest.pins.load(Ordering::Acquire) != 0
        && at.offset < dest.pinned_upto.load(Ordering::Acquire);
    if src_pinned || dest_pinned {
        *blocked = true;
        return false;
    }
    let slot = match hint {
        Some(slot) if tablet.index.holds(slot, s.hash, s.loc) => slot,
        // The reference moved (a split or a shorter chain) or was replaced since: look again.
        _ => match tablet.index.find_loc(s.hash, s.loc) {
            Some(slot) => slot,
            None => return false,
        },
    };
    if src_byte & STATE_RETAINED != 0 {
        let Ok(Some(())) = inner.with_entry(s.loc, false, |e| {
            let mut header = e.header;
            header.state = src_byte & crate::entry::STATE_MASK;
            let valid_to = inner.retained_valid_to(tablet, &header, e.key);
            if !inner.snapshots.any_within(header.version, valid_to) {
                inner.drop_retained(tablet, slot, s.hash, s.loc, &header, e.key);
                return None;
            }
            inner.write_in_entry(at.loc, header.crc_offset(), &header.crc.to_le_bytes());
            Some(())
        }) else {
            return false;
        };
        let len = s.len as i64;
        inner
            .segments
            .get(s.segment)
            .retained_bytes
            .fetch_sub(len, Ordering::Relaxed);
        dest.retained_bytes.fetch_add(len, Ordering::Relaxed);
        let valid_to = inner
            .segments
            .get(s.segment)
            .retained_valid_to_max
            .load(Ordering::Relaxed);
        dest.retained_valid_to_max
            .fetch_max(valid_to, Ordering::Relaxed);
    }
    inner
        .entry_state(at.loc)
        .store(src_byte & !STATE_MOVED, Ordering::Release);
    tablet.index.replace(slot, s.hash, at.loc);
    inner
        .entry_state(s.loc)
        .fetch_or(STATE_MOVED, Ordering::Release);
    true
}

/// Frees a victim once no reader can hold a reference into it, unless a scan pinned it meanwhile
/// (then it goes back to Closed). Returns whether it was retired.
fn retire(inner: &Inner, segment: u32) -> bool {
    let slot = inner.segments.get(segment);
    {
        // Scans pin under the tablet's write lock and skip Retired segments.
        let tablet = inner.tablet(slot.tablet.load(Ordering::Relaxed)).ok();
        let _head = tablet.map(|t| t.head.lock());
        if slot.pins.load(Ordering::Acquire) != 0 {
            return false;
        }
        slot.set_state(SegmentState::Retired);
    }
    slot.live_bytes.store(0, Ordering::Relaxed);
    let seglets = slot.seglet_count.load(Ordering::Relaxed) as u64;
    inner.limbo_seglets.fetch_add(seglets, Ordering::Relaxed);
    inner
        .counters
        .cleaner_freed_bytes
        .fetch_add(seglets * SEGLET_BYTES as u64, Ordering::Relaxed);
    inner
        .counters
        .segments_cleaned
        .fetch_add(1, Ordering::Relaxed);
    let queue = inner.reclaimable.clone();
    let guard = epoch::pin();
    guard.defer(move || queue.lock().push(segment));
    true
}

fn utilisation(inner: &Inner, segment: u32) -> f64 {
    let slot = inner.segments.get(segment);
    let cap = slot.seglet_count.load(Ordering::Relaxed) as f64 * SEGLET_BYTES as f64;
    (effective_live(inner, slot) as f64 / cap.max(1.0)).min(1.0)
}

/// Live bytes of a segment as the cleaner should weigh them: retained versions count as garbage
/// when no snapshot is open (they are, and the cleaner drops them when it meets them).
fn effective_live(inner: &Inner, slot: &crate::segment::SegmentSlot) -> i64 {
    let live = slot.live_bytes.load(Ordering::Relaxed).max(0);
    let retained = slot.retained_bytes.load(Ordering::Relaxed).max(0);
    if retained == 0 {
        return live;
    }
    // Every retained version here ended at or before valid_to_max: dead once no open snapshot is
    // older than that.
    let all_dead = match inner.snapshots.oldest_open() {
        None => true,
        Some(oldest) => slot.retained_valid_to_max.load(Ordering::Relaxed) <= oldest,
    };
    if all_dead {
        (live - retained).max(0)
    } else {
        live
    }
}

/// After snapshots were released: queues the segments that retained versions made mostly garbage,
/// so the cleaner compacts them even when memory is not short. A segment qualifies when the
/// versions the release left dead fill at least half of it: a long snapshot under writes leaves
/// such segments behind, and they hold memory the log would have reused long ago. Segments that
/// overwrites made sparse, with a few retained versions among their garbage (what short scan
/// snapshots leave), wait for the ordinary cleaner, which takes the emptiest first; compacting
/// them at 50% would copy a byte for every byte freed.
pub(crate) fn queue_released_retention(inner: &Inner) {
    if !inner.retention_released.swap(false, Ordering::AcqRel) {
        return;
    }
    let mut sparse = Vec::new();
    for (id, slot) in inner.segments.iter() {
        let cap = slot.seglet_count.load(Ordering::Relaxed) as f64 * SEGLET_BYTES as f64;
        if slot.state() == SegmentState::Closed
            && slot.retained_bytes.load(Ordering::Relaxed) as f64 >= cap * SPARSE_UTILISATION
            && utilisation(inner, id) < SPARSE_UTILISATION
        {
            sparse.push(id);
        }
    }
    if !sparse.is_empty() {
        let mut q = inner.sparse.lock();
        for id in sparse {
            if !q.contains(&id) {
                q.push(id);
            }
        }
    }
}

/// How often the background cleaner sweeps for expired objects (Redis's active expiry runs
/// ten times a second too).
pub(crate) const EXPIRY_SWEEP_INTERVAL: Duration = Duration::from_millis(100);
/// The longest one background sweep may run before it yields to cleaning (it resumes where it
/// stopped): at most a tenth of a core.
pub(crate) const EXPIRY_SWEEP_BUDGET: Duration = Duration::from_millis(10);
/// A segment is walked again once this share of the objects with an expiry that its last walk
/// left has expired (Redis's active expiry also accepts about 10% of stale keys), ...
const EXPIRY_STALE_SHARE_DIVISOR: usize = 10;
/// ... or once its earliest one has been expired this long, whichever comes first.
const EXPIRY_LAG_MAX_MS: u64 = 10_000;
/// A walk that found an expired object a snapshot may still read looks again after this.
const EXPIRY_SNAPSHOT_RETRY_MS: u64 = 1_000;

/// Active expiry: removes expired objects from the index (and their bytes from the live count),
/// so that they leave DBSIZE and the memory figures within about a sweep interval instead of
/// waiting for the cleaner to reach their segments, the way Redis's active expiry deletes
/// expired keys nobody reads. Only segments whose expiry bound (`expire_min_ms`) has passed are
/// walked; a walk sets the bound to when the segment is next worth walking (`next_expiry_bound`). Objects an open snapshot may still read are kept
/// (they go once it closes). Starts at segment `*cursor` and stops at `deadline`, leaving
/// `*cursor` where the next call resumes. `every_segment` walks every segment that may hold an
/// object with an expiry, whether or not its time has come. Returns the objects removed (counted from the
/// engine's `expired_reclaimed`, so other cleaner threads' reclaims meanwhile count too).
pub(crate) fn sweep_expired(
    inner: &Inner,
    cursor: &mut u32,
    deadline: Option<Instant>,
    every_segment: bool,
) -> u64 {
    let count = inner.segments.len() as u32;
    let expiring = (0..inner.tablet_count())
        .filter_map(|id| inner.tablet(id).ok())
        .any(|t| t.expiring_objects.load(Ordering::Relaxed) > 0);
    if count == 0 || !expiring {
        // No current object has an expiry time: no segment has anything to remove.
        return 0;
    }
    let now = now_ms();
    let reclaimed_before = inner.counters.expired_reclaimed.load(Ordering::Relaxed);
    let mut removable: Vec<(Loc, u64)> = Vec::new();
    let mut remaining: Vec<u64> = Vec::new();
    let mut visited = 0;
    let mut walked_any = false;
    while visited < count {
        // The clock is read only after walks: skipping a segment costs one load.
        if walked_any && deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        walked_any = false;
        let id = (*cursor + visited) % count;
        visited += 1;
        let slot = inner.segments.get(id);
        let bound = slot.expire_min_ms.load(Ordering::SeqCst);
        if bound == u64::MAX || (bound > now && !every_segment) {
            continue;
        }
        // The pin keeps the segment's memory from being freed while it is walked (the cleaner
        // retires segments through the epoch).
        let _guard = epoch::pin();
        let state = slot.state();
        if state != SegmentState::Closed && state != SegmentState::Open {
            continue;
        }
        let Ok(tablet) = inner.tablet(slot.tablet.load(Ordering::Relaxed)) else {
            continue;
        };
        walked_any = true;
        removable.clear();
        remaining.clear();
        let mut retry = false;
        let walked = for_each_entry_from(inner, id, 0, |loc, header, key| {
            if !header.is_object()
                || header.expire_at_ms == 0
                || header.state & STATE_SUPERSEDED != 0
            {
                return;
            }
            if header.state & STATE_MOVED == 0
                && header.expire_at_ms <= now
                && !inner.snapshots.any_at_or_above(header.version)
            {
                removable.push((loc, hash_key(key)));
            } else {
                // Not yet expired, a cleaner's copy or original in flight, or readable by a
                // snapshot: it keeps the bound down.
                remaining.push(header.expire_at_ms);
            }
        });
        // One a snapshot opened since the walk may read stays: look again later.
        remove_all_dead(inner, tablet, id, &removable, |_| retry = true);
        // Raise the bound to what the walk found. A closed segment takes no more entries. An
        // open one takes appends from its tablet's writers only under the write lock (held here
        // while the entries published since the walk join the bound) or, if it is a cleaner's
        // survivor segment, from the cleaner: its bound then stays until the segment is closed.
        let raise = |remaining: &mut Vec<u64>| {
            let mut next_bound = next_expiry_bound(remaining);
            if retry {
                next_bound = next_bound.min(now + EXPIRY_SNAPSHOT_RETRY_MS);
            }
            let _ = slot.expire_min_ms.compare_exchange(
                bound,
                next_bound,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
        };
        if slot.state() == SegmentState::Closed {
            raise(&mut remaining);
        } else {
            let head = tablet.head.lock();
            if head.as_ref().is_some_and(|w| w.segment == id) {
                for_each_entry_from(inner, id, walked, |_, h, _| {
                    if h.is_object() && h.expire_at_ms != 0 && h.state & STATE_SUPERSEDED == 0 {
                        remaining.push(h.expire_at_ms);
                    }
                });
                raise(&mut remaining);
            }
        }
    }
    *cursor = (*cursor + visited) % count;
    inner.counters.expired_reclaimed.load(Ordering::Relaxed) - reclaimed_before
}

/// The time a segment is next worth walking, given the expiry times of the objects its walk
/// left (reordered): when a tenth of them has expired, or `EXPIRY_LAG_MAX_MS` after the first
/// has; `u64::MAX` when none is left.
fn next_expiry_bound(remaining: &mut [u64]) -> u64 {
    let Some(&earliest) = remaining.iter().min() else {
        return u64::MAX;
    };
    let k = remaining.len() / EXPIRY_STALE_SHARE_DIVISOR;
    let (_, &mut kth, _) = remaining.select_nth_unstable(k);
    kth.min(earliest.saturating_add(EXPIRY_LAG_MAX_MS))
}

/// Compacts the segments queued as sparse (by scans, or after snapshots were released). Returns
/// whether it compacted any.
pub(crate) fn compact_sparse(inner: &Inner) -> bool {
    let mut any = false;
    let mut later = Vec::new();
    loop {
        let Some(id) = inner.sparse.lock().pop() else {
            // Segments a scan still pins are tried again on the next round.
            inner.sparse.lock().extend(later);
            return any;
        };
        let slot = inner.segments.get(id);
        if slot.state() != SegmentState::Closed || utilisation(inner, id) >= SPARSE_UTILISATION {
            continue;
        }
        if slot.pins.load(Ordering::Acquire) != 0 {
            later.push(id);
            continue;
        }
        let live = effective_live(inner, slot) as u64;
        if live.div_ceil(SEGLET_BYTES as u64) as usize + 1 >= inner.pool.free_count() {
            continue;
        }
        any |= compact_segment(inner, id);
    }
}

/// Compacts the closed segment that frees the most seglets per live byte, among those below
/// `max_utilisation`. False if none would free one.
fn compact_best(inner: &Inner, max_utilisation: f64) -> bool {
    let mut best: Option<(f64, u32)> = None;
    let free_now = inner.pool.free_count();
    for (id, slot) in inner.segments.iter() {
        // A segment a scan pins cannot be cleaned until the scan has read it: take the best of
        // the others rather than none.
        if slot.state() != SegmentState::Closed || slot.pins.load(Ordering::Acquire) != 0 {
            continue;
        }
        let seglets = slot.seglet_count.load(Ordering::Relaxed) as i64;
        let live = effective_live(inner, slot);
        if live as f64 >= max_utilisation * (seglets as f64 * SEGLET_BYTES as f64) {
            continue;
        }
        // Memory segments have no on-disk twin, so compaction packs them full (no 2% slack); the copy
        // must fit in the seglets that are free right now, since the victim is freed only afterwards.
        let needed = (live as u64).div_ceil(SEGLET_BYTES as u64) as i64;
        let freeable = seglets - needed;
        if freeable < 1 || needed as usize >= free_now {
            continue;
        }
        let score = if live == 0 {
            f64::INFINITY
        } else {
            freeable as f64 / live as f64
        };
        if best.is_none_or(|(s, _)| score > s) {
            best = Some((score, id));
        }
    }
    let Some((_, victim)) = best else {
        return false;
    };
    compact_segment(inner, victim)
}

/// Compacts one closed segment: its live entries move to a fresh segment and it is freed.
pub(crate) fn compact_segment(inner: &Inner, victim: u32) -> bool {
    if !inner.segments.get(victim).claim() {
        return false;
    }
    inner
        .counters
        .compaction_passes
        .fetch_add(1, Ordering::Relaxed);
    let slot = inner.segments.get(victim);
    let tablet = slot.tablet.load(Ordering::Relaxed);
    let created = slot.created.load(Ordering::Relaxed);
    let mut survivors = Vec::new();
    live_entries(inner, victim, &mut survivors);
    match relocate(inner, tablet, &survivors, created) {
        Ok((relocated, _)) => {
            inner
                .counters
                .cleaner_copied_bytes
                .fetch_add(relocated, Ordering::Relaxed);
            retire_or_defer(inner, victim);
            true
        }
        Err(()) => {
            // Out of cleaner memory mid-way: what moved is consistent; the rest stays in the victim.
            abort_victims(inner, &[victim]);
            false
        }
    }
}

/// Retires a victim whose relocation completed. Every entry it held is now MOVED or dead, so when
/// a scan pinned it meanwhile it needs no recount: it waits, still Cleaning, for the scan to let go
/// (see `retire_unpinned`).
fn retire_or_defer(inner: &Inner, victim: u32) {
    if !retire(inner, victim) {
        inner
            .segments
            .get(victim)
            .live_bytes
            .store(0, Ordering::Relaxed);
        inner.retire_when_unpinned.lock().push(victim);
    }
}

/// Retires the relocated victims whose scan pins are gone. Returns how many it retired.
pub(crate) fn retire_unpinned(inner: &Inner) -> usize {
    let waiting = std::mem::take(&mut *inner.retire_when_unpinned.lock());
    if waiting.is_empty() {
        return 0;
    }
    let total = waiting.len();
    let still: Vec<u32> = waiting.into_iter().filter(|&v| !retire(inner, v)).collect();
    let retired = total - still.len();
    inner.retire_when_unpinned.lock().extend(still);
    retired
}

/// After a failed relocation, victims with entries still referenced go back to Closed.
fn abort_victims(inner: &Inner, victims: &[u32]) {
    for &v in victims {
        let slot = inner.segments.get(v);
        // Relocations do not decrement victims as they go; count what is still referenced. The
        // walk runs without the tablet's lock (index probes are cache misses, and writers would
        // wait for all of them) and keeps the entries it found referenced. Nothing can become
        // live in a victim meanwhile, only die, and every death (`mark_dead`) happens under the
        // tablet's lock: so under the lock, the kept entries are checked again and the count is
        // stored, and no decrement made during the walk is lost.
        let tablet_id = slot.tablet.load(Ordering::Relaxed);
        let mut live = 0i64;
        if let Ok(tablet) = inner.tablet(tablet_id) {
            let _guard = epoch::pin();
            let mut referenced: Vec<(Loc, u64, i64)> = Vec::new();
            for_each_entry(inner, v, |loc, header, key| {
                let hash = hash_key(key);
                if header.is_object() && tablet.index.find_loc(hash, loc).is_some() {
                    referenced.push((loc, hash, header.total_len() as i64));
                }
            });
            let _head = tablet.head.lock();
            live = referenced
                .iter()
                .filter(|(loc, hash, _)| tablet.index.find_loc(*hash, *loc).is_some())
                .map(|(_, _, len)| len)
                .sum();
            slot.live_bytes.store(live, Ordering::Relaxed);
        }
        if live > 0 || !retire(inner, v) {
            slot.set_state(SegmentState::Closed);
        }
    }
}

/// A closed segment combined cleaning may take.
struct Candidate {
    score: f64,
    age: f64,
    id: u32,
    live: i64,
    seglets: u64,
}

/// Combined cleaning: several segments chosen by cost-benefit, survivors sorted by age.
///
/// Each tablet's survivors go to segments of their own, so a pass frees memory only where the
/// victims of one tablet together occupy more seglets than their live bytes need. With many
/// tablets in a small budget segments are small (down to one seglet: see
/// `Inner::head_segment_seglets`), and victims taken across tablets by score alone would each
/// need the seglet they free. So the pass is planned per tablet: each tablet's candidates in
/// cost-benefit order `(1 − u)·age/(1 + u)`, and of their prefixes that fit, the one that scores
/// best as a whole, `u` counting the whole seglets its survivors need; then the tablets' plans by
/// that score until the pass is full.
fn combined_clean(inner: &Inner) -> bool {
    let now = inner.clock.load(Ordering::Relaxed);
    let mut by_tablet: std::collections::HashMap<u32, Vec<Candidate>> = Default::default();
    for (id, slot) in inner.segments.iter() {
        if slot.state() != SegmentState::Closed || slot.pins.load(Ordering::Acquire) != 0 {
            continue;
        }
        let u = utilisation(inner, id);
        if u > CLEANABLE_UTILISATION_MAX {
            continue;
        }
        let age = now.saturating_sub(slot.created.load(Ordering::Relaxed)) as f64 + 1.0;
        let score = if u <= 0.0 {
            f64::INFINITY
        } else {
            (1.0 - u) * age / (1.0 + u)
        };
        by_tablet
            .entry(slot.tablet.load(Ordering::Relaxed))
            .or_default()
            .push(Candidate {
                score,
                age,
                id,
                live: effective_live(inner, slot),
                seglets: slot.seglet_count.load(Ordering::Relaxed) as u64,
            });
    }
    if by_tablet.is_empty() {
        return false;
    }
    // Copy no more than the cleaner is sure to get. Writers may take every free seglet above the
    // reserve while the pass runs, so only the reserve counts: a pass that ran out of memory
    // half-way would hold its survivors and its victims at once, leaving less free memory than
    // before it started.
    let guaranteed = inner.pool.free_count().min(inner.pool.reserve_seglets());
    let seglet_budget = (guaranteed.saturating_sub(2) as u64) * 9 / 10;
    let byte_limit = (inner.config.combined_pass_segments_max * inner.segment_capacity) as i64;
    // Seglets a tablet's survivors need: its live bytes, and the tail a survivor segment may
    // leave unfilled when the next entry does not fit in it.
    let segment_capacity = inner.segment_capacity as u64;
    let needs = |live: i64| -> u64 {
        let live = live.max(0) as u64;
        live.div_ceil(SEGLET_BYTES as u64) + live / segment_capacity
    };
    // (score, victims, live bytes, seglets their survivors need)
    let mut plans: Vec<(f64, Vec<u32>, i64, u64)> = Vec::new();
    for (_, mut candidates) in by_tablet {
        candidates.sort_by(|a, b| {
            b.score
                .partial_cmp(&a.score)
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        // The best prefix of the tablet's candidates, scored as one segment by cost-benefit,
        // with its utilisation counted in the whole seglets its survivors need.
        let (mut live, mut seglets, mut age_seglets) = (0i64, 0u64, 0f64);
        let mut best: Option<(f64, usize, i64, u64)> = None;
        for (k, c) in candidates.iter().enumerate() {
            let l = live + c.live;
            if l > byte_limit || needs(l) > seglet_budget {
                break;
            }
            live = l;
            seglets += c.seglets;
            age_seglets += c.age * c.seglets as f64;
            let needed = needs(live);
            if needed >= seglets {
                continue;
            }
            let u = needed as f64 / seglets as f64;
            let score = (1.0 - u) * (age_seglets / seglets as f64) / (1.0 + u);
            if best.is_none_or(|(s, ..)| score > s) {
                best = Some((score, k + 1, live, needed));
            }
        }
        if let Some((score, n, live, needed)) = best {
            let victims = candidates[..n].iter().map(|c| c.id).collect();
            plans.push((score, victims, live, needed));
        }
    }
    plans.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal));
    let mut chosen = Vec::new();
    let (mut chosen_live, mut chosen_needed) = (0i64, 0u64);
    for (_, victims, live, needed) in plans {
        if chosen_live + live > byte_limit || chosen_needed + needed > seglet_budget {
            continue;
        }
        let claimed: Vec<u32> = victims
            .iter()
            .copied()
            .filter(|&id| inner.segments.get(id).claim())
            .collect();
        if claimed.len() < victims.len() {
            // Another cleaner took some of them: this plan may free nothing now.
            for id in claimed {
                inner.segments.get(id).set_state(SegmentState::Closed);
            }
            continue;
        }
        chosen_live += live;
        chosen_needed += needed;
        chosen.extend(claimed);
    }
    if chosen.is_empty() {
        return false;
    }
    inner
        .counters
        .combined_passes
        .fetch_add(1, Ordering::Relaxed);
    // Group by tablet; sort each group's survivors by version (age).
    let mut by_tablet: std::collections::BTreeMap<u32, Vec<Survivor>> = Default::default();
    for &id in &chosen {
        let tablet = inner.segments.get(id).tablet.load(Ordering::Relaxed);
        live_entries(inner, id, by_tablet.entry(tablet).or_default());
    }
    let mut ok = true;
    for (tablet, mut survivors) in by_tablet {
        survivors.sort_unstable_by_key(|s| s.version);
        match relocate(inner, tablet, &survivors, now) {
            Ok((relocated, _)) => {
                inner
                    .counters
                    .cleaner_copied_bytes
                    .fetch_add(relocated, Ordering::Relaxed);
            }
            Err(()) => ok = false,
        }
    }
    if ok {
        for &id in &chosen {
            retire_or_defer(inner, id);
        }
    } else {
        abort_victims(inner, &chosen);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PutOptions;

    #[test]
    fn next_expiry_bound_waits_for_a_tenth_or_ten_seconds() {
        assert_eq!(next_expiry_bound(&mut []), u64::MAX);
        // Fewer than ten: the earliest.
        assert_eq!(next_expiry_bound(&mut [5_000, 3_000, 9_000]), 3_000);
        // A hundred, one per second: the eleventh earliest (a tenth expired)...
        let mut v: Vec<u64> = (0..100).rev().map(|i| 1_000_000 + i * 1_000).collect();
        assert_eq!(next_expiry_bound(&mut v), 1_010_000);
        // ... but never later than ten seconds after the earliest.
        let mut v: Vec<u64> = (0..100).map(|i| 1_000_000 + i * 60_000).collect();
        assert_eq!(next_expiry_bound(&mut v), 1_010_000);
        let mut v = vec![u64::MAX - 1; 20];
        assert_eq!(next_expiry_bound(&mut v), u64::MAX - 1);
    }

    /// A victim whose entries all moved but that a scan pinned before it could be freed waits,
    /// still Cleaning and counted empty, and is freed once the scan lets go; nothing is lost.
    #[test]
    fn a_relocated_victim_pinned_by_a_scan_is_freed_when_the_scan_lets_go() {
        let e = crate::test_support::small_engine_without_cleaner();
        let t = e.create_tablet(1, 0, 16383).unwrap();
        let keys: Vec<Vec<u8>> = (0..4000).map(|i| format!("k{i:05}").into_bytes()).collect();
        for k in &keys {
            e.put(t, k, &[1u8; 200], &PutOptions::default()).unwrap();
        }
        // Every other key overwritten: the first segments are about half live.
        for k in keys.iter().step_by(2) {
            e.put(t, k, &[2u8; 200], &PutOptions::default()).unwrap();
        }
        let inner = &e.inner;
        let victim = inner
            .segments
            .iter()
            .filter(|(_, s)| {
                s.state() == SegmentState::Closed && s.tablet.load(Ordering::Relaxed) == t
            })
            .min_by_key(|(_, s)| s.created.load(Ordering::Relaxed))
            .map(|(id, _)| id)
            .expect("a closed segment");
        let slot = inner.segments.get(victim);
        assert!(slot.claim());
        let mut survivors = Vec::new();
        live_entries(inner, victim, &mut survivors);
        assert!(!survivors.is_empty());
        let created = slot.created.load(Ordering::Relaxed);
        relocate(inner, t, &survivors, created).expect("relocation completes");
        // A scan captures (pins) the victim before the cleaner frees it.
        let cap = crate::scan::capture(inner, t, &[]).unwrap();
        assert!(cap.segments.iter().any(|c| c.segment == victim));
        retire_or_defer(inner, victim);
        assert_eq!(slot.state(), SegmentState::Cleaning);
        assert_eq!(slot.live_bytes.load(Ordering::Relaxed), 0);
        assert_eq!(*inner.retire_when_unpinned.lock(), vec![victim]);
        assert_eq!(retire_unpinned(inner), 0, "retired while a scan pins it");
        let check = || {
            for (i, k) in keys.iter().enumerate() {
                let want = if i % 2 == 0 { 2u8 } else { 1u8 };
                let got = e.get(t, k).unwrap().expect("a key went missing");
                assert_eq!(got.value, vec![want; 200], "key {i}");
            }
        };
        check();
        inner.unpin_all(&cap.pins);
        // The next cleaning pass frees it first (with no cleaner thread, writers run such passes).
        assert!(run_pass(inner, false));
        assert_eq!(slot.state(), SegmentState::Retired);
        assert!(inner.retire_when_unpinned.lock().is_empty());
        check();
    }
}
