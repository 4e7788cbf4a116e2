//! Reorganization (DXRAM's log cleaning, digest 000 §6), run by background threads local to the
//! backup (`Config::reorg_threads`, each on a different log at a time). A thread picks a log
//! (urgent requests, then prompt requests, then the largest log above the activation threshold,
//! every third time a random eligible one), gathers the current versions
//! (version log + version buffer), then picks segments by the configured strategy and keeps only
//! entries that are current. After the round it rewrites the log's version log compactly if it
//! has grown too much (see `VERSION_LOG_GROWTH`).
//!
//! Survivors are copied into a free segment (the log keeps one in reserve) and the cleaned
//! segments are zeroed only after that copy is synced, so a crash at any point loses nothing: at
//! worst a survivor exists twice, which replay resolves by version.

use crate::engine::Shared;
use crate::format::{self, BlockHeader, VersionRecord, BLOCK_HEADER_BYTES, PAGE_BYTES};
use crate::io::{self, AlignedBuf};
use crate::tablet::{Tablet, VersionInfo, NOTE_DELETE};
use crate::vtable::{Location, VersionTable};
use crate::{Error, Result, SegmentStrategy};
use rand::{Rng, SeedableRng};
use std::collections::{HashSet, VecDeque};
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

thread_local! {
    /// The reorganizing thread's output buffers and read buffers (two and two, or one and one:
    /// `Config::reorg_segment_buffers`), reused between visits.
    static BUFFERS: std::cell::RefCell<Option<SegmentBuffers>> =
        const { std::cell::RefCell::new(None) };
    /// The reorganizing thread's per-segment work lists, reused between segments and visits.
    static SCRATCH: std::cell::RefCell<CleanScratch> =
        std::cell::RefCell::new(CleanScratch::default());
}

/// Output buffers and read buffers of a reorganizing thread, each a segment.
type SegmentBuffers = (Vec<AlignedBuf>, Vec<AlignedBuf>);

/// `clean_one`'s work lists. Allocated afresh for each segment they were fresh memory every time
/// (about 0.8 MiB for a 1 MiB segment of 64 B entries, beyond the allocator's mmap threshold):
/// page faults and page zeroing for every segment cleaned.
#[derive(Default)]
struct CleanScratch {
    /// Every intact non-delete entry: key hash, version, offset and length in the segment.
    cands: Vec<(u128, u64, u32, u32)>,
    /// The current ones among them: offset and length, and key hash.
    keep: Vec<(usize, usize)>,
    kept_hashes: Vec<u128>,
}

/// What one reorganization of one log did.
#[derive(Debug, Default, Clone, Copy)]
pub struct ReorgOutcome {
    pub segments_cleaned: u64,
    pub bytes_freed: u64,
    pub bytes_read: u64,
    pub corrupt_entries: u64,
    /// Of `segments_cleaned`, those freed without being read (every entry known dead).
    pub segments_unread: u64,
    /// Of `segments_cleaned`, those read and found to hold nothing current.
    pub segments_all_dead: u64,
}

/// Body of one reorganizer thread (`Config::reorg_threads` of them). Each round works on one
/// tablet that no other reorganizer holds: requests first (urgent, then throttled and prompt
/// ones, skipping tablets another thread is on), else the fullest log above the activation
/// threshold (every third visit a random one). A tablet's version cache is taken out of the
/// shared map for the round and put back afterwards.
pub fn run_reorganizer(sh: Arc<Shared>, index: usize) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x5eed + index as u64);
    let mut visits = 0u64;
    let mut idle = false;
    // Bytes of this thread's buffers counted in the gauges, and the last rest it came to.
    let mut held = 0u64;
    let mut rested = 0u64;
    while !sh.shutdown.load(Ordering::SeqCst) {
        account_thread(&sh, &mut held);
        // At rest, and with nothing to clean on the last look: let go of what reorganization
        // keeps between visits, once after the store came to rest and whenever a visit since
        // has built a table or this thread holds buffers again.
        if idle && at_rest(&sh) {
            let rest = sh.counters.rests.load(Ordering::SeqCst);
            let holding = held > 0
                || !sh.reorg_caches.lock().is_empty()
                || sh.notes_pending.load(Ordering::Relaxed) > 0;
            if rest != rested || holding {
                rested = rest;
                come_to_rest(&sh, &mut held);
            }
        }
        let request = {
            let mut q = sh.reorg_queue.lock();
            // The first queued request for a tablet no other reorganizer holds.
            let takeable = |q: &VecDeque<(u64, bool)>, busy: &HashSet<u64>| {
                q.iter().position(|(t, _)| !busy.contains(t))
            };
            // Sleep only when the last look found nothing to do (DXRAM: 100 ms when idle).
            if idle && takeable(&q, &sh.reorg_busy.lock()).is_none() {
                sh.reorg_cv.wait_for(&mut q, Duration::from_millis(100));
            }
            let mut busy = sh.reorg_busy.lock();
            takeable(&q, &busy)
                .and_then(|i| q.remove(i))
                .inspect(|(t, _)| {
                    busy.insert(*t);
                })
        };
        idle = false;
        if sh.shutdown.load(Ordering::SeqCst) {
            if let Some((t, _)) = request {
                release(&sh, t, None);
            }
            break;
        }
        if sh.cfg.tracks_locations() && sh.notes_pending.load(Ordering::Relaxed) > 0 {
            absorb_all_notes(&sh);
        }
        if sh.failed().is_some() {
            if let Some((t, _)) = request {
                release(&sh, t, None);
            }
            bump_done(&sh);
            continue;
        }
        match request {
            Some((tablet, urgent)) => {
                note_round_start(&sh);
                let mut cache = take_cache(&sh, tablet);
                if let Err(e) = reorganize_cached(&sh, tablet, urgent, &mut cache) {
                    tracing::warn!("reorganization of tablet {tablet:#x} failed: {e}");
                }
                if let Some(t) = sh.tablet(tablet) {
                    let mut st = t.state.lock();
                    st.prompt_requested = false;
                    st.reorg_rounds += 1;
                }
                bump_done(&sh);
                compact_after_round(&sh, tablet, &mut cache);
                release(&sh, tablet, Some(cache));
                sh.reorg_rounds_active.fetch_sub(1, Ordering::SeqCst);
            }
            None => {
                // Lock order: a tablet's state before `reorg_queue` before `reorg_busy` (the
                // processor asks for reorganizations holding a tablet's state).
                let busy = sh.reorg_busy.lock().clone();
                let level = clean_level(&sh);
                let eligible: Vec<(u64, f64)> = {
                    sh.tablets
                        .read()
                        .values()
                        .filter(|t| !busy.contains(&t.id))
                        .map(|t| {
                            (
                                t.id,
                                t.state.lock().used_bytes() as f64 / t.capacity_bytes() as f64,
                            )
                        })
                        .filter(|(_, u)| *u > level)
                        .collect()
                };
                if eligible.is_empty() {
                    // Nothing to clean: rewrite a version log that grew past its bound while
                    // the reorganizer was busy.
                    idle = !compact_one_grown(&sh);
                    continue;
                }
                visits += 1;
                let pick = if visits.is_multiple_of(3) {
                    eligible[rng.gen_range(0..eligible.len())].0
                } else {
                    eligible
                        .iter()
                        .max_by(|a, b| a.1.total_cmp(&b.1))
                        .map(|e| e.0)
                        .unwrap_or(eligible[0].0)
                };
                // Another reorganizer may have taken it since the look.
                if !sh.reorg_busy.lock().insert(pick) {
                    continue;
                }
                note_round_start(&sh);
                let mut cache = take_cache(&sh, pick);
                match reorganize_cached(&sh, pick, false, &mut cache) {
                    // Nothing could be cleaned (every chosen segment is all current): wait
                    // rather than spin until new versions make garbage.
                    Ok(o) if o.segments_cleaned == 0 => idle = true,
                    Ok(_) => {}
                    Err(e) => tracing::warn!("reorganization of tablet {pick:#x} failed: {e}"),
                }
                if let Some(t) = sh.tablet(pick) {
                    t.state.lock().reorg_rounds += 1;
                }
                bump_done(&sh);
                compact_after_round(&sh, pick, &mut cache);
                release(&sh, pick, Some(cache));
                sh.reorg_rounds_active.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
    release_thread_buffers();
    account_thread(&sh, &mut held);
    bump_done(&sh);
}

/// The fill a periodic or requested visit cleans a log down to: the busy level while flushes
/// carry data, the activation threshold once none has for `Config::reorg_quiet_after`.
fn clean_level(sh: &Shared) -> f64 {
    let busy = sh
        .last_data_flush
        .lock()
        .is_some_and(|t| t.elapsed() < sh.cfg.reorg_quiet_after);
    if busy {
        sh.cfg.reorg_busy_level()
    } else {
        sh.cfg.reorg_activation
    }
}

/// Whether the store is at rest: it has come to rest once (`Stats::rests`) and nothing has been
/// appended for `Config::idle_after`.
fn at_rest(sh: &Shared) -> bool {
    sh.counters.rests.load(Ordering::SeqCst) > 0
        && sh
            .last_data_flush
            .lock()
            .is_none_or(|t| t.elapsed() >= sh.cfg.idle_after)
}

/// Counts a round that begins while another reorganizer holds another tablet.
fn note_round_start(sh: &Shared) {
    if sh.reorg_rounds_active.fetch_add(1, Ordering::SeqCst) > 0 {
        sh.counters
            .reorg_overlapping_rounds
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// Takes a tablet's version cache out of the shared map (an empty one if it has none); the
/// caller holds the tablet in `reorg_busy`.
fn take_cache(sh: &Shared, tablet: u64) -> VersionCache {
    sh.reorg_caches
        .lock()
        .remove(&tablet)
        .unwrap_or_else(|| VersionCache::new(sh))
}

/// Ends a reorganizer's hold on a tablet: its cache goes back into the shared map, and while the
/// caches hold more than `Config::version_caches_max_bytes` the largest are dropped (this one
/// too, if it alone is over the bound). Other reorganizers may pick the tablet again.
fn release(sh: &Shared, tablet: u64, cache: Option<VersionCache>) {
    let mut evicted = Vec::new();
    if let Some(cache) = cache {
        let mut caches = sh.reorg_caches.lock();
        caches.insert(tablet, cache);
        let bound = sh.cfg.version_caches_max_bytes;
        let mut total: usize = caches.values().map(|c| c.map.bytes()).sum();
        while total > bound {
            let victim = caches
                .iter()
                .max_by_key(|(_, c)| c.map.bytes())
                .map(|(t, _)| *t);
            let Some(v) = victim else { break };
            if let Some(c) = caches.remove(&v) {
                total -= c.map.bytes();
                evicted.push((v, c));
            }
        }
    }
    // An evicted cache takes its tablet's key locations with it (the caches' lock is not held
    // here: tablet state locks come first in the lock order). A log whose table cannot be kept
    // stops noting placements (unless cost-benefit selection needs them): the notes would only
    // rebuild a table that is dropped again. Reading all-dead segments turns it back on.
    for (v, c) in evicted {
        drop(c);
        sh.counters
            .version_caches_dropped
            .fetch_add(1, Ordering::Relaxed);
        if let Some(t) = sh.tablet(v) {
            let mut st = t.state.lock();
            st.untrack_all();
            if sh.cfg.reorg_strategy != SegmentStrategy::CostBenefit {
                st.noting = false;
            }
        }
    }
    sh.reorg_busy.lock().remove(&tablet);
    sh.reorg_cv.notify_all();
}

/// At rest (`Config::idle_after`, once the finisher has spilled the version buffers): drops
/// every idle tablet's version table and waiting placement notes (its segments are then read
/// before they are freed, until emptied once more), frees its emptied buffers, and frees this
/// thread's buffers. Nothing of what it keeps then grows with the keys logged.
fn come_to_rest(sh: &Shared, held: &mut u64) {
    let tablets: Vec<Arc<Tablet>> = sh.tablets.read().values().cloned().collect();
    for t in tablets {
        if !sh.reorg_busy.lock().insert(t.id) {
            continue;
        }
        let cache = sh.reorg_caches.lock().remove(&t.id);
        {
            let mut st = t.state.lock();
            if cache.is_some() || !st.notes.is_empty() {
                let mut notes = std::mem::take(&mut st.notes);
                st.notes_pending.fetch_sub(notes.len(), Ordering::Relaxed);
                notes.clear();
                st.untrack_all();
            }
            st.release_empty();
        }
        if cache.is_some() {
            sh.counters
                .version_caches_dropped
                .fetch_add(1, Ordering::Relaxed);
        }
        drop(cache);
        sh.reorg_busy.lock().remove(&t.id);
    }
    sh.reorg_cv.notify_all();
    release_thread_buffers();
    account_thread(sh, held);
    io::return_free_memory();
}

/// Frees the reorganizing thread's segment buffers and work lists.
pub fn release_thread_buffers() {
    BUFFERS.with(|b| b.borrow_mut().take());
    SCRATCH.with(|c| *c.borrow_mut() = CleanScratch::default());
    GATHER.with(|g| *g.borrow_mut() = (Vec::new(), Vec::new()));
    NOTES.with(|n| *n.borrow_mut() = Vec::new());
}

/// Bytes this thread's buffers hold (segment buffers, work lists, gather and notes buffers).
fn thread_buffer_bytes() -> u64 {
    let segments: usize = BUFFERS.with(|b| {
        b.borrow()
            .as_ref()
            .map_or(0, |(o, r)| o.iter().chain(r).map(|x| x.capacity()).sum())
    });
    let scratch = SCRATCH.with(|c| {
        let c = c.borrow();
        c.cands.capacity() * std::mem::size_of::<(u128, u64, u32, u32)>()
            + c.keep.capacity() * std::mem::size_of::<(usize, usize)>()
            + c.kept_hashes.capacity() * std::mem::size_of::<u128>()
    });
    let gather = GATHER.with(|g| {
        let g = g.borrow();
        g.0.capacity() + g.1.capacity() * std::mem::size_of::<(u128, VersionInfo)>()
    });
    let notes = NOTES.with(|n| n.borrow().capacity() * crate::tablet::NOTE_MEM_BYTES);
    (segments + scratch + gather + notes) as u64
}

/// Brings `MemGauges::reorg_buffers` up to date with this thread's buffers; `held` is what the
/// thread counted there last.
fn account_thread(sh: &Shared, held: &mut u64) {
    let now = thread_buffer_bytes();
    sh.mem.reorg_buffers.fetch_add(now, Ordering::Relaxed);
    sh.mem.reorg_buffers.fetch_sub(*held, Ordering::Relaxed);
    *held = now;
}

/// Turns every idle tablet's placement notes into dead-byte estimates (a tablet another
/// reorganizer holds absorbs its own at the start of its round).
fn absorb_all_notes(sh: &Shared) {
    let tablets: Vec<Arc<Tablet>> = sh.tablets.read().values().cloned().collect();
    for t in tablets {
        let has_notes = !t.state.lock().notes.is_empty();
        if !has_notes || !sh.reorg_busy.lock().insert(t.id) {
            continue;
        }
        let mut cache = take_cache(sh, t.id);
        absorb_notes(sh, &t, &mut cache);
        release(sh, t.id, Some(cache));
    }
}

fn compact_after_round(sh: &Shared, tablet: u64, cache: &mut VersionCache) {
    if sh.failed().is_some() {
        return;
    }
    let busy = sh.tablets.read().values().any(|t| {
        t.state.lock().used_bytes() as f64 >= sh.cfg.reorg_activation * t.capacity_bytes() as f64
    });
    let growth = if pressed(sh, tablet) {
        VERSION_LOG_GROWTH_PRESSED
    } else if busy {
        VERSION_LOG_GROWTH_BUSY
    } else {
        VERSION_LOG_GROWTH
    };
    if let Err(e) = compact_versions(sh, tablet, cache, growth) {
        tracing::warn!("version log compaction of tablet {tablet:#x} failed: {e}");
    }
}

/// Compacts the version log of one cached, idle tablet that has grown to `VERSION_LOG_GROWTH`
/// times its compacted size, if any; returns whether it did.
fn compact_one_grown(sh: &Shared) -> bool {
    // Candidates first (caches and busy set held), then the pressure check without them: it
    // takes tablet state locks, which come before `reorg_busy` in the lock order.
    let candidates: Vec<(Arc<Tablet>, u64, u64)> = {
        let caches = sh.reorg_caches.lock();
        let busy = sh.reorg_busy.lock();
        caches
            .iter()
            .filter(|(id, _)| !busy.contains(id))
            .filter_map(|(&id, c)| {
                let t = sh.tablet(id)?;
                let len = t.verlog.lock().len;
                let compacted = compacted_len(&c.map);
                (len > VERSION_LOG_GROWTH * compacted).then_some((t, len, compacted))
            })
            .collect()
    };
    let grown = candidates.into_iter().find_map(|(t, len, compacted)| {
        let growth = if pressed(sh, t.id) {
            VERSION_LOG_GROWTH_PRESSED
        } else {
            VERSION_LOG_GROWTH
        };
        (len > growth * compacted).then_some((t, len))
    });
    let Some((t, before)) = grown else {
        return false;
    };
    if !sh.reorg_busy.lock().insert(t.id) {
        return false;
    }
    let mut cache = take_cache(sh, t.id);
    compact_after_round(sh, t.id, &mut cache);
    release(sh, t.id, Some(cache));
    let after = t.verlog.lock().len;
    after < before
}

fn bump_done(sh: &Shared) {
    let mut g = sh.reorg_done.lock();
    *g += 1;
    sh.reorg_done_cv.notify_all();
}

/// The reorganizer's copy of one tablet's version map, kept between visits so that a visit reads
/// only what the version log gained since the last one.
#[derive(Default)]
pub struct VersionCache {
    tablet: Option<u64>,
    map: VersionTable,
    /// Version-log length already merged into `map`.
    log_len: u64,
    /// Identity of the version-log file (a rewrite or a drop invalidates the cache).
    inode: u64,
    /// The version buffer's epoch and how many of its records are already merged into `map`
    /// (the buffer only grows within an epoch).
    vbuf_epoch: u64,
    vbuf_merged: usize,
}

impl VersionCache {
    /// An empty cache whose table is counted in the store's memory gauges.
    pub fn new(sh: &Shared) -> VersionCache {
        VersionCache {
            map: VersionTable::counted(sh.mem.clone()),
            ..VersionCache::default()
        }
    }
}

fn inode_of(f: &std::fs::File) -> u64 {
    use std::os::unix::fs::MetadataExt;
    f.metadata().map(|m| m.ino()).unwrap_or(0)
}

/// Gathers the current versions of a tablet (version log + version buffer). With
/// `compact_at: Some(f)`, the version log is also rewritten compactly (newest record per key) when
/// it has grown to `f` times its compacted size.
pub fn gather_versions<'c>(
    sh: &Shared,
    t: &Tablet,
    cache: &'c mut VersionCache,
    compact_at: Option<u64>,
) -> Result<&'c mut VersionTable> {
    bind_cache(t, cache);
    let mut vl = t.verlog.lock();
    if cache.log_len > vl.len {
        // The log is shorter than what was merged: start over from its beginning (and without
        // the locations learnt so far).
        t.state.lock().untrack_all();
        cache.map.clear();
        cache.log_len = 0;
        cache.vbuf_merged = 0;
    }
    // Only the part of the log not merged yet.
    // The tail and the parsed records go through buffers this thread keeps: allocated afresh
    // every visit, they were a quarter of the reorganization rows' page faults.
    let (mut tail, mut records) = GATHER.with(|g| std::mem::take(&mut *g.borrow_mut()));
    tail.clear();
    records.clear();
    tail.resize((vl.len - cache.log_len) as usize, 0);
    let read = io::read_exact_at(&vl.file, &mut tail, cache.log_len);
    let n = match read {
        Ok(n) => n,
        Err(e) => {
            GATHER.with(|g| *g.borrow_mut() = (tail, records));
            return Err(Error::io(&t.ver_path, e));
        }
    };
    tail.truncate(n);
    let mut file_seq = 0u64;
    let walk = format::walk_version_log(&tail, |seq, recs| {
        file_seq = file_seq.max(seq);
        records.extend(format::version_records(recs).map(|r| version_pair(&r)));
    });
    cache.map.merge_all(&records);
    cache.log_len += walk.valid_end as u64;
    // Only the version-buffer records not merged by an earlier visit (merging is idempotent, so
    // records that meanwhile moved to the version log may be merged twice; none is missed).
    records.clear();
    let (vseq, vepoch, vlen) = {
        let st = t.state.lock();
        let from = if cache.vbuf_epoch == st.vbuf_epoch && cache.vbuf_merged <= st.vbuf.len() {
            cache.vbuf_merged
        } else {
            0
        };
        records.extend(st.vbuf[from..].iter().map(version_pair));
        // Records on their way to the version log, possibly after the tail read above.
        if let Some(sp) = &st.vbuf_spilling {
            records.extend(sp.iter().map(version_pair));
        }
        (st.vbuf_seq, st.vbuf_epoch, st.vbuf.len())
    };
    cache.map.merge_all(&records);
    cache.vbuf_epoch = vepoch;
    cache.vbuf_merged = vlen;
    if tail.capacity() <= GATHER_KEPT_BYTES {
        records.clear();
        if records.capacity() * std::mem::size_of::<(u128, VersionInfo)>() > GATHER_KEPT_BYTES {
            records = Vec::new();
        }
        GATHER.with(|g| *g.borrow_mut() = (tail, records));
    }
    if compact_at.is_none_or(|f| vl.len <= f * compacted_len(&cache.map)) {
        return Ok(&mut cache.map);
    }
    let seq = vseq.max(file_seq);
    let records: Vec<VersionRecord> = cache
        .map
        .iter()
        .map(|(h, v)| VersionRecord {
            hash: h,
            version: v.version,
            deleted: v.deleted,
        })
        .collect();
    let mut buf = Vec::with_capacity(records.len() * format::VERSION_RECORD_BYTES + 64);
    format::encode_version_blocks(&mut buf, seq, &records);
    let tmp = t.ver_path.with_extension("ver.tmp");
    {
        let f = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        f.write_all_at(&buf, 0).map_err(|e| Error::io(&tmp, e))?;
        f.sync_data().map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::rename(&tmp, &t.ver_path).map_err(|e| Error::io(&t.ver_path, e))?;
    if let Some(dir) = t.ver_path.parent() {
        io::sync_dir(dir).map_err(|e| Error::io(dir, e))?;
    }
    vl.file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&t.ver_path)
        .map_err(|e| Error::io(&t.ver_path, e))?;
    vl.len = buf.len() as u64;
    cache.inode = inode_of(&vl.file);
    cache.log_len = vl.len;
    sh.counters
        .version_bytes
        .fetch_add(buf.len() as u64, Ordering::Relaxed);
    let mut st = t.state.lock();
    // The records captured are in the compacted log now; drop them unless the buffer was taken
    // (spilled) meanwhile, in which case it no longer starts with them. The buffer then starts
    // with records no visit has merged: a new epoch.
    if st.vbuf_epoch == vepoch && st.vbuf.len() >= vlen {
        st.vbuf.drain(..vlen);
        st.vbuf_epoch += 1;
        if st.vbuf.len() < st.vbuf.capacity() / 4 {
            st.vbuf.shrink_to_fit();
        }
        st.account();
    }
    st.ver_wm = st.ver_wm.max(vseq);
    Ok(&mut cache.map)
}

/// About the size of a version log rewritten from `map` (one record per key, block headers).
fn compacted_len(map: &VersionTable) -> u64 {
    (map.len() * format::VERSION_RECORD_BYTES) as u64 + 64
}

fn version_pair(r: &VersionRecord) -> (u128, VersionInfo) {
    (
        r.hash,
        VersionInfo {
            version: r.version,
            deleted: r.deleted,
        },
    )
}

/// Binds a cache to tablet `t` (clearing it if it held another tablet or an older version log).
fn bind_cache(t: &Tablet, cache: &mut VersionCache) {
    let inode = inode_of(&t.verlog.lock().file);
    if cache.tablet != Some(t.id) || cache.inode != inode {
        if cache.tablet == Some(t.id) {
            // The locations learnt so far are lost.
            t.state.lock().untrack_all();
        }
        cache.tablet = Some(t.id);
        cache.map.clear();
        cache.log_len = 0;
        cache.vbuf_merged = 0;
        cache.inode = inode;
    }
}

/// Takes the tablet's placement notes and turns them into dead-byte estimates: each note moves
/// its key's location, and the bytes at the previous location are dead.
///
/// Returns the flush sequence up to which notes are now absorbed.
pub fn absorb_notes(sh: &Shared, t: &Tablet, cache: &mut VersionCache) -> u64 {
    bind_cache(t, cache);
    absorb_into(sh, t, &mut cache.map)
}

/// `absorb_notes` into a map already bound to `t`. A visit also calls this between segments, so
/// that a log taking all the updates while it is cleaned does not overflow its notes: notes
/// taken then are of flushes that placed nothing in the visit's chosen segments (those are
/// frozen), and a key they move out of the visit's output segment is already counted there.
fn absorb_into(sh: &Shared, t: &Tablet, map: &mut VersionTable) -> u64 {
    let visible = sh.notes_visible_seq.load(Ordering::SeqCst);
    // The notes are moved into a buffer this thread keeps (the tablet keeps its own capacity
    // too): taking the tablet's vector made it regrow from nothing after every visit.
    let mut notes = NOTES.with(|n| std::mem::take(&mut *n.borrow_mut()));
    let segments = {
        let mut st = t.state.lock();
        st.take_notes(visible, &mut notes);
        st.segments.len()
    };
    if notes.is_empty() {
        NOTES.with(|n| *n.borrow_mut() = notes);
        return visible;
    }
    // Per segment: (dead bytes, entries found dead).
    let mut dead: Vec<(u64, u32)> = vec![(0, 0); segments];
    for (i, n) in notes.iter().enumerate() {
        if let Some(ahead) = notes.get(i + 16) {
            map.prefetch(ahead.hash);
        }
        let loc = (n.segment != NOTE_DELETE).then_some(Location {
            segment: n.segment,
            len: n.len,
        });
        if let Some(old) = map.relocate(n.hash, loc) {
            if let Some(d) = dead.get_mut(old.segment as usize) {
                d.0 += u64::from(old.len);
                d.1 += 1;
            }
        }
    }
    notes.clear();
    if notes.capacity() > NOTES_KEPT {
        notes = Vec::new();
    }
    NOTES.with(|n| *n.borrow_mut() = notes);
    let mut st = t.state.lock();
    for (seg, &(bytes, entries)) in dead.iter().enumerate() {
        if entries == 0 {
            continue;
        }
        if let Some(m) = st.segments.get_mut(seg) {
            m.dead = (m.dead + bytes).min(m.used);
            if m.live >= entries {
                m.live -= entries;
            } else {
                // More entries dead than were counted in: the count is wrong, so the segment
                // must be read before it is freed. (Not expected; counted for the tests.)
                m.live = 0;
                if m.tracked {
                    m.tracked = false;
                    sh.counters
                        .reorg_live_mismatches
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
    visible
}

/// Largest version-log tail (and parsed-records) buffer a thread keeps between gathers.
const GATHER_KEPT_BYTES: usize = 16 << 20;

type GatherBuffers = (Vec<u8>, Vec<(u128, VersionInfo)>);

thread_local! {
    /// A thread's buffers for gathering versions (version-log tail, parsed records).
    static GATHER: std::cell::RefCell<GatherBuffers> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    /// A reorganizer thread's buffer for the notes it absorbs.
    static NOTES: std::cell::RefCell<Vec<crate::tablet::Note>> = const { std::cell::RefCell::new(Vec::new()) };
}
/// Largest notes buffer kept between absorptions (32 bytes a note: 8 MiB).
const NOTES_KEPT: usize = 1 << 18;

/// All-dead segments a visit must read (with noting off) to turn noting on for the log.
pub const NOTING_EVIDENCE: u64 = 2;
/// Segments read and cleaned without an all-dead one after which noting is turned off.
pub const NOTING_OFF_SEGMENTS: u64 = 16;

/// Is this entry current according to the gathered versions? Unknown keys are kept (their
/// versions arrived after the gather).
#[inline]
pub fn is_current(map: &VersionTable, hash: u128, version: u64) -> bool {
    match map.get(hash) {
        None => true,
        Some(v) if v.deleted => version > v.version,
        Some(v) => version >= v.version,
    }
}

/// Reorganizes one tablet log: all segments if `full` (urgent), else a share chosen by strategy,
/// then compacts its version log if due.
pub fn reorganize(sh: &Shared, tablet: u64, full: bool) -> Result<ReorgOutcome> {
    // Hold the tablet as a reorganizer thread does and work with its shared cache: the cache
    // holds the key locations that segments' live counts are kept by, and placement notes taken
    // into a second cache would leave the shared one's locations stale.
    loop {
        let mut q = sh.reorg_queue.lock();
        if sh.reorg_busy.lock().insert(tablet) {
            break;
        }
        sh.reorg_cv.wait_for(&mut q, Duration::from_millis(50));
    }
    let mut cache = take_cache(sh, tablet);
    let outcome = reorganize_cached(sh, tablet, full, &mut cache).and_then(|o| {
        compact_versions(sh, tablet, &mut cache, VERSION_LOG_GROWTH)?;
        Ok(o)
    });
    release(sh, tablet, Some(cache));
    // The caller's thread does not keep segment buffers between such calls.
    release_thread_buffers();
    outcome
}

/// A version log is rewritten compactly once it has grown to this many times its compacted size
/// ...
pub const VERSION_LOG_GROWTH: u64 = 2;
/// ... or, while some log is above the activation threshold (the reorganizer is busy freeing
/// space and writers may be waiting for it), to this many times. Each rewrite writes and syncs
/// the whole compacted log: with 8 tablets under sustained updates (bench `reorg/*`), the rewrites
/// at twice the size took a fifth of the reorganizer's time.
pub const VERSION_LOG_GROWTH_BUSY: u64 = 4;
/// ... or, while flushes are being throttled on this very log (within `PRESSED_FOR`), to this
/// many times: the rewrite holds the log, and the next throttled flush waits for it. Under
/// sequential updates one log at a time takes every write, drops under the activation threshold
/// after each round and was rewritten 7 to 12 times per bench run (`reorg/sequential`), 30-40 ms
/// each, while flushes queued behind it.
pub const VERSION_LOG_GROWTH_PRESSED: u64 = 8;
/// How long after a throttled flush a log counts as pressed.
pub const PRESSED_FOR: Duration = Duration::from_secs(1);

/// Whether a flush waited for this tablet's cleaning within the last `PRESSED_FOR`.
fn pressed(sh: &Shared, tablet: u64) -> bool {
    sh.tablet(tablet).is_some_and(|t| {
        t.state
            .lock()
            .throttled_at
            .is_some_and(|at| at.elapsed() < PRESSED_FOR)
    })
}

/// Rewrites a tablet's version log compactly if it has grown to `growth` times its compacted
/// size. The reorganizer does this after a visit's round is counted, so that placements waiting
/// for the round (the throttle) go on during the rewrite and its sync.
pub fn compact_versions(
    sh: &Shared,
    tablet: u64,
    cache: &mut VersionCache,
    growth: u64,
) -> Result<()> {
    let Some(t) = sh.tablet(tablet) else {
        return Ok(());
    };
    let _guard = t.reorg_lock.lock();
    gather_versions(sh, &t, cache, Some(growth)).map(|_| ())
}

pub fn reorganize_cached(
    sh: &Shared,
    tablet: u64,
    full: bool,
    cache: &mut VersionCache,
) -> Result<ReorgOutcome> {
    let Some(t) = sh.tablet(tablet) else {
        return Ok(ReorgOutcome::default());
    };
    let _guard = t.reorg_lock.lock();
    sh.counters.reorg_runs.fetch_add(1, Ordering::Relaxed);
    let absorbed = absorb_notes(sh, &t, cache);
    // A segment written by a flush whose notes are not absorbed yet is left for a later visit:
    // its keys' locations would be set to it after it was cleaned and freed, and a later note
    // would then count an entry dead in whatever the segment holds next.
    let tracking = sh.cfg.tracks_locations();
    let noted = |m: &crate::tablet::SegMeta| !tracking || m.data_seq <= absorbed;
    let seg_bytes = t.segment_bytes as usize;
    let now = Instant::now();
    // A segment the strategy may choose: it holds data, no write is pending, and (unless the
    // visit is urgent) the placement notes do not show it all live.
    let candidate = |m: &crate::tablet::SegMeta| {
        m.used > 0
            && m.pending == 0
            && !m.reorganizing
            && noted(m)
            // A tracked segment with no entry known dead has nothing to free: reading it would
            // be wasted (an urgent visit still takes every segment).
            && (full || !(tracking && m.tracked && m.dead == 0))
    };
    let score = |m: &crate::tablet::SegMeta| {
        let u = m.used as f64 / seg_bytes as f64;
        // Cost-benefit weighs the estimated live fraction (fill minus dead bytes the placement
        // notes revealed), as RAMCloud does with its exact live counts.
        let live = m.used.saturating_sub(m.dead) as f64 / seg_bytes as f64;
        let age = now.duration_since(m.stamp).as_secs_f64() + 1e-3;
        match sh.cfg.reorg_strategy {
            SegmentStrategy::AgeTimesUtilisation => age * u,
            SegmentStrategy::CostBenefit => (1.0 - live) * age / (1.0 + live),
            SegmentStrategy::Random => 0.0,
        }
    };
    // Segment-sized buffers are kept between visits (allocating and zeroing them per visit
    // showed up as a tenth of the reorganizer's time).
    let per_side = sh.cfg.reorg_segment_buffers / 2;
    let (mut outs, mut reads) = BUFFERS
        .with(|b| b.borrow_mut().take())
        .filter(|(o, r)| {
            o.len() == per_side
                && r.len() == per_side
                && o.iter().chain(r).all(|b| b.capacity() == seg_bytes)
        })
        .unwrap_or_else(|| {
            let new = || AlignedBuf::huge(seg_bytes);
            (
                (0..per_side).map(|_| new()).collect(),
                (0..per_side).map(|_| new()).collect(),
            )
        });
    let out_buf = outs.pop().expect("an output buffer");
    let out_spare = outs.pop();
    let read_b = reads.pop().expect("a read buffer");
    let mut bufs = reads;
    // The best segment of a periodic or requested visit to a log over its level is chosen now
    // and its read started, so that the read overlaps the gathering of versions: the first read
    // of a visit used to be waited for in full (with visits of a few segments each, a third of
    // the reorganizers' read waits in the bench's uniform updates).
    // (With one read buffer there is no read ahead: segments are read as they are cleaned.)
    let early = if full || bufs.is_empty() {
        None
    } else {
        let mut st = t.state.lock();
        let over = st.used_bytes() as f64 > clean_level(sh) * t.capacity_bytes() as f64;
        // Not one the notes show all dead: that is freed unread, after the gathering.
        let mut cands = st
            .segments
            .iter()
            .enumerate()
            .filter(|(_, m)| candidate(m) && !(tracking && m.tracked && m.live == 0));
        let best = if sh.cfg.reorg_strategy == SegmentStrategy::Random {
            let n = cands.clone().count();
            (n > 0)
                .then(|| rand::thread_rng().gen_range(0..n))
                .and_then(|k| cands.nth(k))
        } else {
            cands.max_by(|a, b| score(a.1).total_cmp(&score(b.1)))
        }
        .map(|(i, _)| i);
        best.filter(|_| over)
            .inspect(|&i| st.segments[i].reorganizing = true)
    };
    let mut ahead = match early {
        Some(s) => Some(Pending::start(&t, s, read_b)),
        None => {
            bufs.push(read_b);
            None
        }
    };
    let map = match gather_versions(sh, &t, cache, None) {
        Ok(map) => map,
        Err(e) => {
            if let Some(r) = ahead.take() {
                r.join();
            }
            if let Some(s) = early {
                t.state.lock().segments[s].reorganizing = false;
            }
            return Err(e);
        }
    };
    // Choose segments. Those whose every entry the placement notes show superseded or deleted
    // are freed first, whatever the strategy, and without being read: freeing them costs a zero
    // page each. The strategy chooses among the others.
    let (all_dead, chosen): (Vec<usize>, Vec<usize>) = {
        let mut st = t.state.lock();
        let all_dead: Vec<usize> = if tracking {
            st.segments
                .iter()
                .enumerate()
                .filter(|(_, s)| {
                    s.used > 0
                        && s.pending == 0
                        && !s.reorganizing
                        && noted(s)
                        && s.tracked
                        && s.live == 0
                })
                .map(|(i, _)| i)
                .collect()
        } else {
            Vec::new()
        };
        for &i in &all_dead {
            st.segments[i].reorganizing = true;
        }
        let mut cands: Vec<(usize, f64)> = st
            .segments
            .iter()
            .enumerate()
            .filter(|(_, m)| candidate(m))
            .map(|(i, m)| (i, score(m)))
            .collect();
        if !full {
            let budget = ((st.segments.len() as f64 * sh.cfg.reorg_segments_per_visit).ceil()
                as usize)
                .max(1);
            if sh.cfg.reorg_strategy == SegmentStrategy::Random {
                let mut rng = rand::thread_rng();
                for i in (1..cands.len()).rev() {
                    let j = rng.gen_range(0..=i);
                    cands.swap(i, j);
                }
            } else {
                cands.sort_by(|a, b| b.1.total_cmp(&a.1));
            }
            cands.truncate(budget);
        }
        let mut chosen: Vec<usize> = cands.into_iter().map(|c| c.0).collect();
        if full {
            chosen.sort_unstable();
        }
        for &i in &chosen {
            st.segments[i].reorganizing = true;
        }
        if let Some(s) = early {
            // Chosen before the versions were gathered, and first in line: its read is under
            // way. (It was not known all dead then, and only this visit's absorptions, which
            // come later, lower a segment's live count.)
            chosen.insert(0, s);
        }
        (all_dead, chosen)
    };
    let mut outcome = ReorgOutcome::default();
    let mut out = Output::new(out_buf, out_spare);
    let mut result = Ok(());
    let mut untouched: Vec<usize> = Vec::new();
    for (k, &s) in all_dead.iter().enumerate() {
        let used = t.state.lock().segments[s].used;
        if sh.cfg.reorg_verify_dead {
            // At most one read is in flight here, so a buffer is free.
            if let Err(e) = verify_all_dead(&t, &*map, s, &mut bufs[0]) {
                sh.counters
                    .reorg_dead_verify_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::error!("tablet {tablet:#x} segment {s}: {e}");
                untouched.extend_from_slice(&all_dead[k..]);
                result = Err(e);
                break;
            }
        }
        outcome.segments_cleaned += 1;
        outcome.segments_unread += 1;
        out.pending_free.push(s);
        out.pending_used += used;
        out.freed_estimate += used;
    }
    if result.is_ok() {
        if let Err(e) = out.commit(sh, &t, &mut outcome) {
            result = Err(e);
        }
    }
    if result.is_err() {
        untouched.append(&mut out.pending_free);
        untouched.extend_from_slice(&chosen);
    }
    // A periodic or prompt visit cleans, best first, only until the log is back under the
    // activation threshold: the fuller a log is kept, the more garbage each cleaned segment holds
    // and the less a freed byte costs in reads and copies. (Counted after the all-dead segments
    // are freed, so `freed_estimate` starts again from nothing.)
    let excess = {
        let used = t.state.lock().used_bytes() as f64;
        (used - clean_level(sh) * t.capacity_bytes() as f64).max(0.0) as u64
    };
    out.freed_estimate = 0;
    // Nothing to read if the log is under the level (the all-dead segments may have brought it
    // there).
    let enough = !full && excess == 0;
    if result.is_ok() && enough {
        untouched.extend_from_slice(&chosen);
    }
    let chosen: &[usize] = if result.is_ok() && !enough {
        &chosen
    } else {
        &[]
    };
    // The next chosen segment is read on a helper thread while this one is cleaned, so the
    // reads overlap the lookups and copies. Chosen segments are frozen: marked reorganizing with
    // no write pending, placement skips them.
    let mut scratch = SCRATCH.with(|c| std::mem::take(&mut *c.borrow_mut()));
    if ahead.is_none() {
        if let (Some(&s), Some(b)) = (chosen.first(), bufs.pop()) {
            ahead = Some(Pending::start(&t, s, b));
        }
    }
    for (k, &s) in chosen.iter().enumerate() {
        // This segment's read: issued ahead, or done now if the visit did not expect to need
        // it (with no read in flight, both buffers are free).
        let joined = match ahead.take() {
            Some(r) => r.join(),
            None => bufs.pop().map(|b| read_segment(&t, s, b)),
        };
        let Some((read, buf)) = joined else {
            untouched.extend_from_slice(&chosen[k..]);
            result = Err(Error::Corrupt("a segment read failed to run".into()));
            break;
        };
        outcome.bytes_read += buf.len() as u64;
        // Read the next segment while this one is cleaned, unless this one is expected to
        // bring the visit to its goal (freed bytes per segment so far as the guide): a read
        // the visit does not use costs the disk as much as one it does.
        let expected = if k == 0 {
            0
        } else {
            out.freed_estimate / k as u64
        };
        if full || out.freed_estimate + expected < excess {
            if let (Some(&next), Some(b)) = (chosen.get(k + 1), bufs.pop()) {
                ahead = Some(Pending::start(&t, next, b));
            }
        }
        let r = read.and_then(|()| {
            clean_one(
                sh,
                &t,
                &mut *map,
                s,
                buf.as_slice(),
                &mut scratch,
                &mut out,
                &mut outcome,
            )
        });
        bufs.push(buf);
        if tracking && sh.notes_pending.load(Ordering::Relaxed) > 0 {
            // Notes that arrived during the segment: this log's, and idle logs'.
            absorb_into(sh, &t, &mut *map);
            absorb_all_notes(sh);
        }
        match r {
            Ok(true) => {}
            Ok(false) => untouched.push(s),
            Err(e) => {
                untouched.extend_from_slice(&chosen[k..]);
                result = Err(e);
                break;
            }
        }
        if !full && out.freed_estimate >= excess {
            untouched.extend_from_slice(&chosen[k + 1..]);
            break;
        }
    }
    // A read still in flight (the visit stopped early or failed, or needed no read) hands its
    // buffer back; its bytes were read all the same.
    if let Some((_, buf)) = ahead.take().and_then(Pending::join) {
        outcome.bytes_read += buf.len() as u64;
        bufs.push(buf);
    }
    SCRATCH.with(|c| *c.borrow_mut() = scratch);
    if result.is_ok() {
        result = out.flush(sh, &t, &mut outcome);
    }
    if result.is_err() {
        // An output write still in flight is waited for; its sources stay where they were.
        let _ = out.finish_write(sh, &t);
        untouched.append(&mut out.sources);
        untouched.append(&mut out.pending_free);
        if let Some(o) = out.segment.take() {
            untouched.push(o);
        }
    }
    {
        let mut st = t.state.lock();
        for s in untouched {
            if let Some(m) = st.segments.get_mut(s) {
                m.reorganizing = false;
            }
        }
    }
    if tracing::enabled!(tracing::Level::DEBUG) {
        let util = t.state.lock().used_bytes() as f64 / t.capacity_bytes() as f64;
        tracing::debug!(
            "reorg {tablet:#x} full={full}: chose {} cleaned {} freed {} KiB read {} KiB -> util {util:.3}",
            chosen.len(),
            outcome.segments_cleaned,
            outcome.bytes_freed >> 10,
            outcome.bytes_read >> 10
        );
    }
    sh.counters
        .reorg_segments
        .fetch_add(outcome.segments_cleaned, Ordering::Relaxed);
    sh.counters
        .reorg_bytes_freed
        .fetch_add(outcome.bytes_freed, Ordering::Relaxed);
    sh.counters
        .reorg_bytes_read
        .fetch_add(outcome.bytes_read, Ordering::Relaxed);
    sh.counters
        .reorg_corrupt_entries
        .fetch_add(outcome.corrupt_entries, Ordering::Relaxed);
    sh.counters
        .reorg_segments_unread
        .fetch_add(outcome.segments_unread, Ordering::Relaxed);
    {
        let mut outs = vec![std::mem::replace(&mut out.buf, AlignedBuf::new(0))];
        outs.extend(out.spare.take());
        if outs.len() == per_side && bufs.len() == per_side {
            BUFFERS.with(|cell| *cell.borrow_mut() = Some((outs, bufs)));
        }
    }
    if result.is_ok() && tracking && sh.cfg.reorg_strategy != SegmentStrategy::CostBenefit {
        let mut st = t.state.lock();
        if !st.noting {
            if outcome.segments_all_dead >= NOTING_EVIDENCE {
                st.noting = true;
                st.segments_without_all_dead = 0;
            }
        } else if outcome.segments_unread + outcome.segments_all_dead > 0 {
            st.segments_without_all_dead = 0;
        } else {
            st.segments_without_all_dead += outcome.segments_cleaned;
            if st.segments_without_all_dead >= NOTING_OFF_SEGMENTS {
                st.noting = false;
                st.untrack_all();
            }
        }
    }
    if result.is_err() {
        // A visit that failed midway may have moved keys' locations to an output segment it
        // never wrote: start the locations afresh, and read every segment with data before
        // freeing it until it has been emptied once more.
        *cache = VersionCache::new(sh);
        for m in t.state.lock().segments.iter_mut() {
            m.tracked = m.used == 0;
            if m.used == 0 {
                m.live = 0;
            }
        }
    }
    result.map(|_| outcome)
}

/// Reads the `used` bytes of segment `s` of `t` into `buf`.
fn read_segment(t: &Tablet, s: usize, mut buf: AlignedBuf) -> ReadResult {
    let used = t.state.lock().segments[s].used as usize;
    let r = io::read_exact_at(
        &t.file,
        &mut buf.full_mut()[..used],
        s as u64 * t.segment_bytes,
    );
    match r {
        Ok(n) => {
            buf.set_len(n);
            (Ok(()), buf)
        }
        Err(e) => {
            buf.set_len(0);
            (Err(Error::io(&t.sec_path, e)), buf)
        }
    }
}

type ReadResult = (Result<()>, AlignedBuf);

/// A segment read issued ahead of its use: on a thread of its own, or done at once if no
/// thread could be started.
enum Pending {
    Thread(std::thread::JoinHandle<ReadResult>),
    Done(ReadResult),
}

impl Pending {
    fn start(t: &Arc<Tablet>, s: usize, buf: AlignedBuf) -> Pending {
        let tablet = t.clone();
        // The buffer comes back through the thread; if none can be started, the read is done
        // here (the closure, and the buffer in it, are then dropped: read into a new one).
        match std::thread::Builder::new().spawn(move || read_segment(&tablet, s, buf)) {
            Ok(h) => Pending::Thread(h),
            Err(e) => {
                tracing::warn!("no thread to read a segment ahead ({e}); reading it now");
                Pending::Done(read_segment(
                    t,
                    s,
                    AlignedBuf::huge(t.segment_bytes as usize),
                ))
            }
        }
    }

    /// The read's result, or None if its thread panicked (its buffer is lost with it).
    fn join(self) -> Option<ReadResult> {
        match self {
            Pending::Thread(h) => h.join().ok(),
            Pending::Done(r) => Some(r),
        }
    }
}

/// The segment survivors are copied into, filled in memory and written once. Cleaned segments
/// are zeroed (freed) in batches, after one fdatasync has made all copies of their survivors
/// durable.
struct Output {
    /// No second buffer: each output segment is written before cleaning goes on.
    inline: bool,
    buf: AlignedBuf,
    /// The other output buffer: free, or (taken) being written by `writing`.
    spare: Option<AlignedBuf>,
    /// The output segment written last, while survivors collect in `buf`.
    writing: Option<OutWrite>,
    len: usize,
    count: u32,
    data_seq: u64,
    segment: Option<usize>,
    /// Cleaned segments whose survivors sit in `buf`.
    sources: Vec<usize>,
    sources_used: u64,
    /// Cleaned segments whose survivors are written (not yet synced) or that had none.
    pending_free: Vec<usize>,
    pending_used: u64,
    pending_written: u64,
    /// Bytes this visit's cleaning has freed or will free once committed.
    freed_estimate: u64,
}

/// An output segment's write, on a thread of its own so that cleaning goes on meanwhile (written
/// in line, output segments were a sixth of the reorganizers' round time in the bench's uniform
/// updates). What `Output::finish_write` records once it is done.
/// A finished output write: its result and the buffer it wrote.
type WriteDone = Option<(std::io::Result<()>, AlignedBuf)>;
/// The thread running an output write.
type WriteHandle = std::thread::JoinHandle<(std::io::Result<()>, AlignedBuf)>;

struct OutWrite {
    handle: Option<WriteHandle>,
    done: WriteDone,
    segment: usize,
    padded: usize,
    sources: Vec<usize>,
    sources_used: u64,
    data_seq: u64,
}

impl Output {
    /// With no spare buffer, output segments are written in line (`Config::reorg_segment_buffers`).
    fn new(mut buf: AlignedBuf, spare: Option<AlignedBuf>) -> Output {
        buf.set_len(0);
        Output {
            inline: spare.is_none(),
            buf,
            spare,
            writing: None,
            len: BLOCK_HEADER_BYTES,
            count: 0,
            data_seq: 0,
            segment: None,
            sources: Vec::new(),
            sources_used: 0,
            pending_free: Vec::new(),
            pending_used: 0,
            pending_written: 0,
            freed_estimate: 0,
        }
    }

    /// Starts writing the output segment (no sync yet) and goes on collecting survivors in the
    /// other buffer; once the write is done (`finish_write`), its sources wait in `pending_free`.
    fn write_out(&mut self, sh: &Shared, t: &Tablet) -> Result<()> {
        if self.sources.is_empty() {
            if let Some(o) = self.segment.take() {
                t.state.lock().segments[o].reorganizing = false;
            }
            return Ok(());
        }
        // One write in flight at a time: the previous one gives its buffer back.
        self.finish_write(sh, t)?;
        let o = self
            .segment
            .expect("an output segment is taken before survivors are copied");
        let padded = format::page_align_up(self.len);
        {
            let out = self.buf.full_mut();
            out[self.len..padded].fill(0);
            BlockHeader {
                kind: format::BLOCK_COMPACTED,
                body_len: (self.len - BLOCK_HEADER_BYTES) as u32,
                write_seq: sh.seq.fetch_add(1, Ordering::SeqCst),
                data_seq: self.data_seq,
                tablet: t.id,
                entry_count: self.count,
            }
            .encode(out);
        }
        self.buf.set_len(padded);
        let base = o as u64 * t.segment_bytes;
        let (handle, done) = if self.inline {
            let r = t.file.write_all_at(self.buf.as_slice(), base);
            self.buf.set_len(0);
            (None, Some((r, AlignedBuf::new(0))))
        } else {
            self.write_in_background(t, base)
        };
        self.writing = Some(OutWrite {
            handle,
            done,
            segment: o,
            padded,
            sources: std::mem::take(&mut self.sources),
            sources_used: self.sources_used,
            data_seq: self.data_seq,
        });
        self.sources_used = 0;
        self.len = BLOCK_HEADER_BYTES;
        self.count = 0;
        self.data_seq = 0;
        self.segment = None;
        Ok(())
    }

    /// Hands the output buffer to a thread that writes it at `base` (taking the spare buffer,
    /// or a new one, for the next output); the write is done here if no thread or file handle
    /// can be had.
    fn write_in_background(&mut self, t: &Tablet, base: u64) -> (Option<WriteHandle>, WriteDone) {
        let next = self
            .spare
            .take()
            .unwrap_or_else(|| AlignedBuf::huge(self.buf.capacity()));
        let mut buf = std::mem::replace(&mut self.buf, next);
        self.buf.set_len(0);
        // The write runs on a thread with its own handle of the file; if either cannot be had,
        // it is done here.
        match t.file.try_clone() {
            Ok(file) => {
                let (tx, rx) = std::sync::mpsc::sync_channel(1);
                let spawned = std::thread::Builder::new().spawn(move || {
                    let buf: AlignedBuf = match rx.recv() {
                        Ok(b) => b,
                        Err(_) => return (Ok(()), AlignedBuf::new(0)),
                    };
                    let r = file.write_all_at(buf.as_slice(), base);
                    (r, buf)
                });
                match spawned {
                    Ok(h) => match tx.send(buf) {
                        Ok(()) => (Some(h), None),
                        Err(e) => {
                            buf = e.0;
                            let _ = h.join();
                            (None, Some((t.file.write_all_at(buf.as_slice(), base), buf)))
                        }
                    },
                    Err(_) => (None, Some((t.file.write_all_at(buf.as_slice(), base), buf))),
                }
            }
            Err(_) => (None, Some((t.file.write_all_at(buf.as_slice(), base), buf))),
        }
    }

    /// Waits for the output write in flight, if any, and records it: the output segment holds
    /// its bytes, and its sources wait in `pending_free` for the sync. If it failed, the sources
    /// go back to `sources` (left as they were by the caller's error path).
    fn finish_write(&mut self, sh: &Shared, t: &Tablet) -> Result<()> {
        let Some(mut w) = self.writing.take() else {
            return Ok(());
        };
        let (r, buf) = match (w.handle.take(), w.done.take()) {
            (Some(h), _) => h.join().unwrap_or_else(|_| {
                (
                    Err(std::io::Error::other("the output write's thread panicked")),
                    AlignedBuf::new(0),
                )
            }),
            (None, Some(d)) => d,
            (None, None) => (Ok(()), AlignedBuf::new(0)),
        };
        if buf.capacity() == self.buf.capacity() {
            self.spare = Some(buf);
        }
        if let Err(e) = r {
            t.state.lock().segments[w.segment].reorganizing = false;
            self.sources.append(&mut w.sources);
            return Err(Error::io(&t.sec_path, e));
        }
        sh.counters
            .reorg_bytes_written
            .fetch_add(w.padded as u64, Ordering::Relaxed);
        {
            let mut st = t.state.lock();
            let m = &mut st.segments[w.segment];
            m.used = w.padded as u64;
            m.reorganizing = false;
            m.stamp = Instant::now();
            m.data_seq = m.data_seq.max(w.data_seq);
        }
        self.pending_free.append(&mut w.sources);
        self.pending_used += w.sources_used;
        self.pending_written += w.padded as u64;
        Ok(())
    }

    /// Syncs the written outputs, then zeroes and frees the cleaned segments.
    fn commit(&mut self, sh: &Shared, t: &Tablet, outcome: &mut ReorgOutcome) -> Result<()> {
        self.finish_write(sh, t)?;
        if self.pending_free.is_empty() {
            return Ok(());
        }
        t.file.sync_data().map_err(|e| Error::io(&t.sec_path, e))?;
        zero_segments(t, &self.pending_free)?;
        sh.counters.reorg_bytes_written.fetch_add(
            (self.pending_free.len() * PAGE_BYTES) as u64,
            Ordering::Relaxed,
        );
        let mut st = t.state.lock();
        for &s in &self.pending_free {
            let m = &mut st.segments[s];
            m.used = 0;
            m.dead = 0;
            m.live = 0;
            m.tracked = true;
            m.reorganizing = false;
            m.stamp = Instant::now();
        }
        st.reorg_commits += 1;
        drop(st);
        // A writer throttled on this log may go on now.
        bump_done(sh);
        outcome.bytes_freed += self.pending_used.saturating_sub(self.pending_written);
        self.pending_free.clear();
        self.pending_used = 0;
        self.pending_written = 0;
        Ok(())
    }

    fn flush(&mut self, sh: &Shared, t: &Tablet, outcome: &mut ReorgOutcome) -> Result<()> {
        self.write_out(sh, t)?;
        self.commit(sh, t, outcome)
    }
}

/// Fallback when no segment is free: writes the survivors of `s` as one compacted block at the
/// end of another used segment that has room, then queues `s` to be freed.
#[allow(clippy::too_many_arguments)]
fn append_survivors_elsewhere(
    sh: &Shared,
    t: &Tablet,
    map: &mut VersionTable,
    s: usize,
    region: &[u8],
    keep: &[(usize, usize)],
    kept_hashes: &[u128],
    kept_bytes: usize,
    data_seq: u64,
    used: u64,
    out: &mut Output,
    outcome: &mut ReorgOutcome,
) -> Result<bool> {
    let padded = format::page_align_up(BLOCK_HEADER_BYTES + kept_bytes);
    let target = {
        let mut st = t.state.lock();
        let seg = t.segment_bytes;
        let found = (0..st.segments.len())
            .filter(|&i| {
                let m = &st.segments[i];
                i != s
                    && m.used > 0
                    && m.pending == 0
                    && !m.reorganizing
                    && seg - m.used >= padded as u64
            })
            .min_by_key(|&i| seg - st.segments[i].used);
        if let Some(i) = found {
            st.segments[i].reorganizing = true;
        }
        found.map(|i| (i, st.segments[i].used))
    };
    let Some((i, at)) = target else {
        return Ok(false);
    };
    let mut buf = AlignedBuf::new(padded);
    {
        let dst = buf.full_mut();
        let mut w = BLOCK_HEADER_BYTES;
        for &(off, len) in keep {
            dst[w..w + len].copy_from_slice(&region[off..off + len]);
            w += len;
        }
        BlockHeader {
            kind: format::BLOCK_COMPACTED,
            body_len: kept_bytes as u32,
            write_seq: sh.seq.fetch_add(1, Ordering::SeqCst),
            data_seq,
            tablet: t.id,
            entry_count: keep.len() as u32,
        }
        .encode(dst);
    }
    buf.set_len(padded);
    let r = t
        .file
        .write_all_at(buf.as_slice(), i as u64 * t.segment_bytes + at)
        .map_err(|e| Error::io(&t.sec_path, e));
    if r.is_ok() {
        sh.counters
            .reorg_bytes_written
            .fetch_add(padded as u64, Ordering::Relaxed);
    }
    {
        let mut st = t.state.lock();
        let m = &mut st.segments[i];
        m.reorganizing = false;
        if r.is_ok() {
            m.stamp = crate::tablet::mean_stamp(m.stamp, at, Instant::now(), padded as u64);
            m.used = at + padded as u64;
            m.data_seq = m.data_seq.max(data_seq);
            st.count_placed(i, keep.len() as u32);
        }
    }
    r?;
    for &h in kept_hashes {
        map.moved(h, s as u32, i as u32);
    }
    outcome.segments_cleaned += 1;
    out.pending_free.push(s);
    out.pending_used += used;
    out.pending_written += padded as u64;
    Ok(true)
}

/// Reads segment `s` and checks that it holds no current entry (`Config::reorg_verify_dead`: the
/// tests' cross-check of the live counts that let segments be freed unread).
fn verify_all_dead(t: &Tablet, map: &VersionTable, s: usize, buf: &mut AlignedBuf) -> Result<()> {
    let used = t.state.lock().segments[s].used as usize;
    let n = io::read_exact_at(
        &t.file,
        &mut buf.full_mut()[..used],
        s as u64 * t.segment_bytes,
    )
    .map_err(|e| Error::io(&t.sec_path, e))?;
    buf.set_len(n);
    let mut current = 0usize;
    format::walk_blocks(buf.as_slice(), |_, h, body| {
        if h.tablet != t.id {
            return;
        }
        format::walk_entries(body, |_, e| {
            if !e.is_delete() && is_current(map, format::key_hash(e.key), e.version) {
                current += 1;
            }
        });
    });
    if current > 0 {
        return Err(Error::Corrupt(format!(
            "segment {s} counted as all dead holds {current} current entries"
        )));
    }
    Ok(())
}

fn zero_segments(t: &Tablet, segments: &[usize]) -> Result<()> {
    if segments.is_empty() {
        return Ok(());
    }
    let mut zero = AlignedBuf::new(PAGE_BYTES);
    zero.set_len(PAGE_BYTES);
    for &s in segments {
        t.file
            .write_all_at(zero.as_slice(), s as u64 * t.segment_bytes)
            .map_err(|e| Error::io(&t.sec_path, e))?;
    }
    t.file.sync_data().map_err(|e| Error::io(&t.sec_path, e))
}

/// Cleans segment `s`; returns false if it was left as it was (nothing to drop, or no room).
#[allow(clippy::too_many_arguments)]
fn clean_one(
    sh: &Shared,
    t: &Tablet,
    map: &mut VersionTable,
    s: usize,
    region: &[u8],
    scratch: &mut CleanScratch,
    out: &mut Output,
    outcome: &mut ReorgOutcome,
) -> Result<bool> {
    let CleanScratch {
        cands,
        keep,
        kept_hashes,
    } = scratch;
    cands.clear();
    keep.clear();
    kept_hashes.clear();
    // The segment's bytes, read by the caller (up to its `used` length, which is frozen while
    // the segment is being reorganized).
    let used = region.len();
    // Pass 1: every intact entry's position and key hash, prefetching the table slot each
    // hash will probe. Pass 2: the lookups, by then mostly served from cache; with a table far
    // larger than the CPU caches this overlaps the misses instead of taking them one by one.
    let mut total_entries = 0usize;
    let mut data_seq = 0u64;
    let mut corrupt = 0u64;
    format::walk_blocks(region, |boff, h, body| {
        if h.tablet != t.id {
            return;
        }
        data_seq = data_seq.max(h.data_seq);
        let body_at = boff + BLOCK_HEADER_BYTES;
        let stats = format::walk_entries(body, |off, e| {
            total_entries += 1;
            if !e.is_delete() {
                let hash = format::key_hash(e.key);
                map.prefetch(hash);
                // Offsets and lengths within a segment (at most 2 GiB) fit in 32 bits.
                cands.push((
                    hash,
                    e.version,
                    (body_at + off) as u32,
                    e.encoded_len() as u32,
                ));
            }
        });
        corrupt += stats.corrupt_entries;
    });
    let mut kept_bytes = 0usize;
    for &(hash, version, off, len) in cands.iter() {
        let (off, len) = (off as usize, len as usize);
        if is_current(map, hash, version) {
            keep.push((off, len));
            kept_hashes.push(hash);
            kept_bytes += len;
        } else {
            // Dropped as superseded, possibly before the newer entry's placement note arrives:
            // the key's location must not stay pointing into a segment that is being freed.
            map.forget_at(hash, s as u32);
        }
    }
    outcome.corrupt_entries += corrupt;
    if keep.len() == total_entries && corrupt == 0 {
        // Everything is current: whatever dead bytes were estimated are not there (yet).
        t.state.lock().segments[s].dead = 0;
        return Ok(false);
    }
    out.freed_estimate += (used as u64).saturating_sub(kept_bytes as u64);
    if keep.is_empty() {
        outcome.segments_all_dead += 1;
        outcome.segments_cleaned += 1;
        out.pending_free.push(s);
        out.pending_used += used as u64;
        if out.pending_free.len() >= 4 {
            out.commit(sh, t, outcome)?;
        }
        return Ok(true);
    }
    if out.len + kept_bytes > out.buf.capacity() {
        out.write_out(sh, t)?;
    }
    for attempt in 0..2 {
        if out.segment.is_some() {
            break;
        }
        let got = {
            let mut st = t.state.lock();
            let got = t.free_segment(&mut st, true)?;
            if let Some(o) = got {
                st.segments[o].reorganizing = true;
            }
            got
        };
        match got {
            Some(o) => out.segment = Some(o),
            // No free segment: make the cleaned ones free first.
            None if attempt == 0 => out.commit(sh, t, outcome)?,
            None => {
                // Still none: append the survivors to a used segment with room for them.
                return append_survivors_elsewhere(
                    sh,
                    t,
                    map,
                    s,
                    region,
                    keep,
                    kept_hashes,
                    kept_bytes,
                    data_seq,
                    used as u64,
                    out,
                    outcome,
                );
            }
        }
    }
    if let Some(o) = out.segment {
        for &h in kept_hashes.iter() {
            map.moved(h, s as u32, o as u32);
        }
        // Counted now, before the output is written: notes absorbed later in the visit may move
        // these keys on. (A visit that fails resets every count.)
        t.state.lock().count_placed(o, keep.len() as u32);
    }
    let dst = out.buf.full_mut();
    for &(off, len) in keep.iter() {
        dst[out.len..out.len + len].copy_from_slice(&region[off..off + len]);
        out.len += len;
        out.count += 1;
    }
    out.data_seq = out.data_seq.max(data_seq);
    outcome.segments_cleaned += 1;
    out.sources.push(s);
    out.sources_used += used as u64;
    // Free cleaned segments every few segments, so the log's fill never balloons with copies.
    if out.pending_free.len() >= 4 {
        out.commit(sh, t, outcome)?;
    }
    Ok(true)
}
