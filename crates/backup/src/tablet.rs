//! One tablet's on-disk state: its secondary log (segments), its secondary-log buffer (SLB), its
//! version buffer and version log. Placement of a buffer into segments follows DXRAM (digest 000
//! §4.10): ≥ 75% of a segment → a fresh segment; else the best-fitting used segment; else a fresh
//! segment; else split over the segments with the most free space. One segment is kept in reserve
//! for reorganization, which copies survivors out of the segments it cleans.

use crate::format::{self, BlockHeader, VersionRecord, BLOCK_HEADER_BYTES, PAGE_BYTES};
use crate::io::{self, AlignedBuf, IoMode};
use crate::{Error, Result};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fs::File;
use std::hash::{BuildHasherDefault, Hasher};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Hasher for keys that are already 128-bit hashes: takes the low 64 bits.
#[derive(Default)]
pub struct HashedKey(u64);

impl Hasher for HashedKey {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

pub type HashMapU128<V> = HashMap<u128, V, BuildHasherDefault<HashedKey>>;

/// The latest version of a key known to the version buffer / log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionInfo {
    pub version: u64,
    pub deleted: bool,
}

/// In-memory metadata of one segment (positions are not persisted; open rebuilds them).
#[derive(Debug, Clone)]
pub struct SegMeta {
    /// Page-aligned end of the last block.
    pub used: u64,
    /// Writes placed but not yet executed; reorganization leaves such segments alone.
    pub pending: u32,
    /// Being cleaned, or being filled by the cleaner.
    pub reorganizing: bool,
    /// Mean write time of the segment's bytes (weighted by size; a cleaned segment's survivors
    /// count as written when they were copied), for the age in segment selection.
    pub stamp: Instant,
    pub data_seq: u64,
    /// Estimated dead bytes (entries superseded or deleted since they were written), kept by
    /// the reorganizer from placement notes; 0 when unknown. Only guides segment selection.
    pub dead: u64,
    /// Entries placed in the segment (by flushes or by the cleaner) that the reorganizer has not
    /// yet seen superseded or deleted: +1 when an entry is placed, -1 when a placement note moves
    /// the entry's key away from this segment. With `tracked`, 0 means every entry is dead, and
    /// the segment is freed without being read.
    pub live: u32,
    /// Every entry in the segment was placed by this process since the segment was last empty,
    /// and the reorganizer has lost no key location since, so `live` and `dead` are exact. False
    /// for segments found with data at open, and for segments with data when locations are lost
    /// (a reorganization failed midway, a version cache was evicted or rebuilt, notes were
    /// dropped); true again once the segment is freed.
    pub tracked: bool,
}

impl SegMeta {
    fn empty() -> SegMeta {
        SegMeta {
            used: 0,
            pending: 0,
            reorganizing: false,
            stamp: Instant::now(),
            data_seq: 0,
            dead: 0,
            live: 0,
            tracked: true,
        }
    }
}

pub struct TabletState {
    pub segments: Vec<SegMeta>,
    pub slb: Vec<u8>,
    pub slb_data_seq: u64,
    /// Version buffer: version records of this tablet not yet in the version log, appended as
    /// they come (cheap); the newest record per key wins wherever they are read.
    pub vbuf: Vec<VersionRecord>,
    /// Records taken from the version buffer and not yet appended to the version log. Readers of
    /// the buffer and the log (version gathering, replay) read these too: between the take and
    /// the append they are in neither, and a delete missed there would let its key come back.
    pub vbuf_spilling: Option<Arc<Vec<VersionRecord>>>,
    /// Bumped whenever the version buffer is taken, so reorganization can tell if it changed.
    pub vbuf_epoch: u64,
    /// Flush sequence up to which the version buffer (and log) is complete.
    pub vbuf_seq: u64,
    /// Highest flush sequence whose data reached the secondary log.
    pub data_wm: u64,
    /// Highest flush sequence covered by the version log on disk.
    pub ver_wm: u64,
    pub prompt_requested: bool,
    /// Reorganization rounds completed on this tablet (requested or periodic), so that a writer
    /// throttled on this log waits for a round of this log, not of another.
    pub reorg_rounds: u64,
    /// Commits of cleaned segments (each frees some), so that a throttled writer goes on as soon
    /// as the log is back under the threshold, without waiting for the rest of the round.
    pub reorg_commits: u64,
    /// When a flush last waited for this log's cleaning (throttle): while that is recent, the
    /// reorganizers put off rewriting its version log (`reorg::VERSION_LOG_GROWTH_PRESSED`).
    pub throttled_at: Option<std::time::Instant>,
    /// Placement notes (entry key hash → segment, or a delete) since the reorganizer last
    /// took them, in write order. Beyond `NOTES_MAX` waiting in the whole store they are counted
    /// and dropped: the dead-byte estimate gets coarser, and segments holding the entries whose
    /// notes were lost are read before they are freed.
    pub notes: Vec<Note>,
    pub notes_dropped: u64,
    /// Notes waiting over all tablets of the store (shared by every tablet's state).
    pub notes_pending: Arc<AtomicUsize>,
    /// Whether placements in this log are noted (on at start while reorganization is on).
    /// Always with cost-benefit selection; otherwise the reorganizer turns it off once it has
    /// read and cleaned `reorg::NOTING_OFF_SEGMENTS` segments without meeting an all-dead one
    /// (noting costs a table update per entry, which updates spread over every segment never
    /// repay), and on again when it reads all-dead segments (notes would have let it free them
    /// unread).
    pub noting: bool,
    /// Segments read and cleaned, with noting on, since an all-dead segment was last met.
    pub segments_without_all_dead: u64,
    /// No tracked segment has gained data since `untrack_all` last ran: a dropped note then
    /// needs no new pass over the segments (drops come by the thousand once the bound is hit).
    pub all_untracked: bool,
    /// Notes the store keeps waiting for the reorganizer before dropping new ones
    /// (`Config::notes_max_bytes` / 32). A log taking 7 M entries/s fills 128 Ki notes in under
    /// 20 ms, so the reorganizer takes a log's notes between the segments of a visit, and an
    /// idle reorganizer is woken once an eighth of this waits.
    pub notes_max: usize,
    /// The store's memory gauges, and what this tablet last added to them (`account`).
    pub mem: Arc<MemGauges>,
    accounted: [u64; 4],
}

impl Drop for TabletState {
    fn drop(&mut self) {
        self.notes_pending
            .fetch_sub(self.notes.len(), Ordering::Relaxed);
        let [v, s, n, m] = self.accounted;
        self.mem.version_buffers.fetch_sub(v, Ordering::Relaxed);
        self.mem.secondary_buffers.fetch_sub(s, Ordering::Relaxed);
        self.mem.notes.fetch_sub(n, Ordering::Relaxed);
        self.mem.tablet_metadata.fetch_sub(m, Ordering::Relaxed);
    }
}

/// Bytes held by the parts of a store that many threads change, for `Backup::memory`: each
/// tablet adds what its buffers hold (`TabletState::account`), the version tables and the
/// reorganizer threads what they hold.
#[derive(Default, Debug)]
pub struct MemGauges {
    pub version_buffers: AtomicU64,
    pub secondary_buffers: AtomicU64,
    pub notes: AtomicU64,
    pub tablet_metadata: AtomicU64,
    pub version_caches: AtomicU64,
    pub reorg_buffers: AtomicU64,
}

/// Bytes of one version-buffer record and of one placement note.
pub const VERSION_RECORD_MEM_BYTES: usize = std::mem::size_of::<VersionRecord>();
pub const NOTE_MEM_BYTES: usize = std::mem::size_of::<Note>();
/// Capacity a tablet's notes vector keeps once emptied, at most (32 bytes a note: 4 MiB), and
/// at most a 64th of the store-wide bound.
const NOTES_KEPT_PER_TABLET: usize = 1 << 17;

/// Where an entry was placed (`segment == NOTE_DELETE`: the key was deleted), by the flush with
/// sequence `seq`. The reorganizer takes a note only once that flush's writes are done
/// (`Shared::notes_visible_seq`): a segment it then frees as all dead holds nothing whose newer
/// entry is still unwritten.
#[derive(Debug, Clone, Copy)]
pub struct Note {
    pub hash: u128,
    pub segment: u32,
    pub len: u32,
    pub seq: u64,
}

pub const NOTE_DELETE: u32 = u32::MAX;

impl TabletState {
    /// Appends a placement note unless the bound is reached.
    pub fn push_note(&mut self, note: Note) {
        if self.notes_pending.load(Ordering::Relaxed) < self.notes_max {
            self.notes.push(note);
            self.notes_pending.fetch_add(1, Ordering::Relaxed);
        } else {
            self.notes_dropped += 1;
            // The entry's location and its key's previous entry's death go unrecorded.
            if !self.all_untracked {
                self.untrack_all();
            }
            if let Some(m) = self.segments.get_mut(note.segment as usize) {
                m.tracked = false;
            }
        }
    }

    /// After key locations are lost: every segment with data is read before it is freed, and
    /// its counts are no longer taken as exact, until it has been emptied once more.
    pub fn untrack_all(&mut self) {
        for m in self.segments.iter_mut().filter(|m| m.used > 0) {
            m.tracked = false;
        }
        self.all_untracked = true;
    }

    /// Counts `entries` placed in segment `i` (by a flush or by the cleaner) in its live count.
    pub fn count_placed(&mut self, i: usize, entries: u32) {
        let m = &mut self.segments[i];
        m.live += entries;
        if m.tracked {
            self.all_untracked = false;
        }
    }

    /// Moves the notes of flushes up to `visible_seq` into `out` (notes are pushed in flush
    /// order). The tablet keeps its vector's capacity, up to `NOTES_KEPT_PER_TABLET`.
    pub fn take_notes(&mut self, visible_seq: u64, out: &mut Vec<Note>) {
        let k = self.notes.partition_point(|n| n.seq <= visible_seq);
        self.notes_pending.fetch_sub(k, Ordering::Relaxed);
        out.extend(self.notes.drain(..k));
        let kept = NOTES_KEPT_PER_TABLET.min(self.notes_max / 64);
        if self.notes.is_empty() && self.notes.capacity() > kept {
            self.notes = Vec::new();
        }
        self.account();
    }

    /// Brings the store's memory gauges up to date with what this tablet's buffers hold now
    /// (capacities, not lengths). Called after the buffers change; cheap.
    pub fn account(&mut self) {
        let spilling = self.vbuf_spilling.as_ref().map_or(0, |v| v.capacity());
        let now = [
            ((self.vbuf.capacity() + spilling) * VERSION_RECORD_MEM_BYTES) as u64,
            self.slb.capacity() as u64,
            (self.notes.capacity() * NOTE_MEM_BYTES) as u64,
            (self.segments.capacity() * std::mem::size_of::<SegMeta>()
                + std::mem::size_of::<TabletState>()) as u64,
        ];
        let gauges = [
            &self.mem.version_buffers,
            &self.mem.secondary_buffers,
            &self.mem.notes,
            &self.mem.tablet_metadata,
        ];
        for ((g, new), old) in gauges.iter().zip(now).zip(self.accounted) {
            if new >= old {
                g.fetch_add(new - old, Ordering::Relaxed);
            } else {
                g.fetch_sub(old - new, Ordering::Relaxed);
            }
        }
        self.accounted = now;
    }

    /// Releases the memory of emptied buffers (at rest: the notes vector, the secondary-log
    /// buffer and the version buffer keep no capacity once empty).
    pub fn release_empty(&mut self) {
        if self.notes.is_empty() {
            self.notes = Vec::new();
        }
        if self.slb.is_empty() {
            self.slb = Vec::new();
        }
        if self.vbuf.is_empty() {
            self.vbuf = Vec::new();
        }
        self.account();
    }

    pub fn used_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.used).sum()
    }

    /// Records a version (put or delete) in the version buffer.
    pub fn note_version(&mut self, hash: u128, version: u64, deleted: bool) {
        self.vbuf.push(VersionRecord {
            hash,
            version,
            deleted,
        });
    }

    /// Takes the version buffer to spill it. Records are not deduplicated here (that would cost
    /// a sort per spill); the version log is compacted, newest record per key, at every
    /// reorganization. Until the spiller clears `vbuf_spilling` (once the records are in the
    /// version log) they stay visible there.
    pub fn take_versions(&mut self) -> Arc<Vec<VersionRecord>> {
        self.vbuf_epoch += 1;
        let records = Arc::new(std::mem::take(&mut self.vbuf));
        self.vbuf_spilling = Some(records.clone());
        records
    }
}

/// Sorts by key hash and keeps the newest record of each key.
pub fn dedup_newest(v: &mut Vec<VersionRecord>) {
    v.sort_unstable_by(|a, b| a.hash.cmp(&b.hash).then(b.version.cmp(&a.version)));
    v.dedup_by_key(|r| r.hash);
}

pub struct VerLog {
    pub file: File,
    pub len: u64,
}

pub struct Tablet {
    pub id: u64,
    pub sec_path: PathBuf,
    pub ver_path: PathBuf,
    pub file: File,
    pub state: Mutex<TabletState>,
    /// Held by reorganization and replay (they must not interleave on one tablet).
    pub reorg_lock: Mutex<()>,
    pub verlog: Mutex<VerLog>,
    pub segment_bytes: u64,
    pub max_segments: usize,
    pub reserve_segments: usize,
}

pub fn sec_name(id: u64) -> String {
    format!("t{id:016x}.sec")
}
pub fn ver_name(id: u64) -> String {
    format!("t{id:016x}.ver")
}

/// What `Tablet::open` found on disk.
#[derive(Debug, Default, Clone, Copy)]
pub struct OpenScan {
    pub max_write_seq: u64,
    pub version_log_truncated_bytes: u64,
    pub version_log_damaged_bytes: u64,
}

impl Tablet {
    /// Opens (or creates) a tablet's files and rebuilds segment metadata by walking block headers.
    pub fn open(
        dir: &Path,
        id: u64,
        mode: IoMode,
        cfg: &crate::Config,
    ) -> Result<(Tablet, OpenScan)> {
        let sec_path = dir.join(sec_name(id));
        let ver_path = dir.join(ver_name(id));
        let file = io::open_log(&sec_path, mode, true).map_err(|e| Error::io(&sec_path, e))?;
        let seg = cfg.segment_bytes;
        let max_segments = (cfg.tablet_log_capacity_bytes / seg) as usize;
        let file_len = file.metadata().map_err(|e| Error::io(&sec_path, e))?.len();
        let allocated = ((file_len / seg) as usize).min(max_segments);
        let mut scan = OpenScan::default();
        let mut segments = Vec::with_capacity(allocated);
        let mut data_wm = 0u64;
        let mut page = AlignedBuf::new(PAGE_BYTES);
        for i in 0..allocated {
            let base = i as u64 * seg;
            let mut at = 0u64;
            let mut last_seq = 0u64;
            let mut meta = SegMeta::empty();
            while at + BLOCK_HEADER_BYTES as u64 <= seg {
                let n = io::read_exact_at(&file, page.full_mut(), base + at)
                    .map_err(|e| Error::io(&sec_path, e))?;
                if n < BLOCK_HEADER_BYTES {
                    break;
                }
                let Ok(h) = BlockHeader::decode(&page.full_mut()[..n], (seg - at) as usize) else {
                    break;
                };
                if h.write_seq <= last_seq || h.tablet != id {
                    break;
                }
                last_seq = h.write_seq;
                meta.data_seq = meta.data_seq.max(h.data_seq);
                scan.max_write_seq = scan.max_write_seq.max(h.write_seq);
                at += h.padded_len() as u64;
            }
            meta.used = at;
            // Entries from before the restart are not counted in `live`.
            meta.tracked = at == 0;
            data_wm = data_wm.max(meta.data_seq);
            segments.push(meta);
        }
        // Version log: keep the valid prefix, cut a torn tail.
        let vfile = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&ver_path)
            .map_err(|e| Error::io(&ver_path, e))?;
        let bytes = std::fs::read(&ver_path).map_err(|e| Error::io(&ver_path, e))?;
        let walk = format::walk_version_log(&bytes, |_, _| {});
        let ver_wm = walk.max_seq;
        let at = walk.valid_end;
        scan.version_log_damaged_bytes = walk.damaged_bytes;
        if walk.tail_bytes > 0 {
            // Nothing intact follows: a torn tail (or damage at the end). Cut it off.
            scan.version_log_truncated_bytes = walk.tail_bytes;
            vfile
                .set_len(at as u64)
                .map_err(|e| Error::io(&ver_path, e))?;
        }
        let reserve = usize::from(cfg.reorg_enabled);
        let tablet = Tablet {
            id,
            sec_path,
            ver_path,
            file,
            state: Mutex::new(TabletState {
                segments,
                slb: Vec::new(),
                slb_data_seq: 0,
                vbuf: Vec::new(),
                vbuf_spilling: None,
                vbuf_epoch: 0,
                vbuf_seq: 0,
                notes: Vec::new(),
                notes_dropped: 0,
                notes_pending: Arc::default(),
                noting: cfg.reorg_enabled,
                segments_without_all_dead: 0,
                all_untracked: false,
                notes_max: cfg.notes_max_bytes / NOTE_MEM_BYTES,
                mem: Arc::default(),
                accounted: [0; 4],
                data_wm,
                ver_wm,
                prompt_requested: false,
                reorg_rounds: 0,
                reorg_commits: 0,
                throttled_at: None,
            }),
            reorg_lock: Mutex::new(()),
            verlog: Mutex::new(VerLog {
                file: vfile,
                len: at as u64,
            }),
            segment_bytes: seg,
            max_segments,
            reserve_segments: reserve,
        };
        Ok((tablet, scan))
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.segment_bytes * self.max_segments as u64
    }

    /// Makes sure segment `i` exists on disk (preallocated).
    pub fn ensure_segment(&self, st: &mut TabletState, i: usize) -> Result<()> {
        while st.segments.len() <= i {
            let idx = st.segments.len() as u64;
            io::preallocate(&self.file, idx * self.segment_bytes, self.segment_bytes)
                .map_err(|e| Error::io(&self.sec_path, e))?;
            st.segments.push(SegMeta::empty());
        }
        Ok(())
    }

    /// Preallocates fresh segments so that at least `want_empty` allocated segments stand empty
    /// (within capacity). The writer calls this between flushes for tablets that take a segment
    /// or more per flush: extending the file takes the inode lock exclusively, which waits for
    /// every O_DIRECT write in flight on the file and holds up new ones, so extending it during
    /// placement, while the previous flush's writes are in flight, stalls both the processor and
    /// the writer. Running out of disk here is not an error: placement reports it if the space
    /// is really needed.
    pub fn preallocate_ahead(&self, want_empty: usize) -> Result<()> {
        let (from, to) = {
            let st = self.state.lock();
            let empty = st
                .segments
                .iter()
                .filter(|s| s.used == 0 && s.pending == 0 && !s.reorganizing)
                .count();
            let len = st.segments.len();
            let to = (len + want_empty.saturating_sub(empty)).min(self.max_segments);
            (len, to)
        };
        if to <= from {
            return Ok(());
        }
        let seg = self.segment_bytes;
        match io::preallocate(&self.file, from as u64 * seg, (to - from) as u64 * seg) {
            Ok(()) => {}
            Err(e) if io::is_no_space(&e) => return Ok(()),
            Err(e) => return Err(Error::io(&self.sec_path, e)),
        }
        // Placement may have added segments meanwhile (each preallocated by its own call);
        // every index below `to` is now backed by disk space.
        let mut st = self.state.lock();
        while st.segments.len() < to {
            st.segments.push(SegMeta::empty());
        }
        Ok(())
    }

    /// Index of a free segment (allocating a new one within capacity), honouring the reserve unless
    /// `use_reserve`.
    pub fn free_segment(&self, st: &mut TabletState, use_reserve: bool) -> Result<Option<usize>> {
        let free_now: Vec<usize> = st
            .segments
            .iter()
            .enumerate()
            .filter(|(_, s)| s.used == 0 && s.pending == 0 && !s.reorganizing)
            .map(|(i, _)| i)
            .collect();
        let unallocated = self.max_segments - st.segments.len();
        let total_free = free_now.len() + unallocated;
        let reserve = if use_reserve {
            0
        } else {
            self.reserve_segments
        };
        if total_free <= reserve {
            return Ok(None);
        }
        if let Some(&i) = free_now.first() {
            return Ok(Some(i));
        }
        let i = st.segments.len();
        self.ensure_segment(st, i)?;
        Ok(Some(i))
    }

    /// Places `total` bytes of whole entries (given as slices) into segments and builds the block
    /// writes. Returns None if the log has no room (the caller asks for urgent reorganization).
    #[allow(clippy::too_many_arguments)]
    pub fn place(
        &self,
        st: &mut TabletState,
        slices: &[&[u8]],
        data_seq: u64,
        seq: &std::sync::atomic::AtomicU64,
        blocks: &mut Blocks<'_>,
        new_segment_fraction: f64,
        notes: bool,
    ) -> Result<Option<Vec<BlockWrite>>> {
        let seg = self.segment_bytes as usize;
        let total: usize = slices.iter().map(|s| s.len()).sum();
        // Each slice is a run of whole entries; entries are walked only where a cut is needed.
        // (segment, ranges (slice, from, to) to copy, body bytes)
        let mut plan: Vec<(usize, Vec<Range3>, usize)> = Vec::new();
        let (mut si, mut off) = (0usize, 0usize);
        let mut remaining = total;
        // Work on a scratch copy of `used` so that a failed placement changes nothing.
        let mut used: Vec<u64> = st.segments.iter().map(|s| s.used).collect();
        let mut fresh: Vec<usize> = Vec::new();
        while remaining > 0 {
            let want = BLOCK_HEADER_BYTES + remaining;
            let usable = |i: usize, used: &[u64], st: &TabletState| -> usize {
                if st.segments[i].reorganizing {
                    0
                } else {
                    (seg - used[i] as usize).saturating_sub(BLOCK_HEADER_BYTES)
                }
            };
            let mut choice: Option<usize> = None;
            if (want as f64) < new_segment_fraction * seg as f64 {
                // Best fit among used segments.
                choice = (0..st.segments.len())
                    .filter(|&i| used[i] > 0 && usable(i, &used, st) >= remaining)
                    .min_by_key(|&i| usable(i, &used, st));
            }
            if choice.is_none() {
                // A fresh segment (not one already picked in this placement), keeping the reserve.
                let free_count = st
                    .segments
                    .iter()
                    .enumerate()
                    .filter(|(i, s)| used[*i] == 0 && !s.reorganizing && s.pending == 0)
                    .count()
                    + (self.max_segments - st.segments.len());
                if free_count > self.reserve_segments {
                    let mut found = (0..st.segments.len()).find(|&i| {
                        let s = &st.segments[i];
                        used[i] == 0 && s.pending == 0 && !s.reorganizing && !fresh.contains(&i)
                    });
                    if found.is_none() {
                        let i = st.segments.len();
                        self.ensure_segment(st, i)?;
                        used.push(0);
                        found = Some(i);
                    }
                    choice = found;
                }
            }
            if choice.is_none() {
                // Split: the used segment with the most free space (free ones are the reserve).
                choice = (0..st.segments.len())
                    .filter(|&i| used[i] > 0 && usable(i, &used, st) > 0)
                    .max_by_key(|&i| usable(i, &used, st));
            }
            let Some(i) = choice else { return Ok(None) };
            let room = usable(i, &used, st);
            let mut ranges = Vec::new();
            let mut body = 0usize;
            while si < slices.len() {
                let s = slices[si];
                if body + (s.len() - off) <= room {
                    ranges.push((si, off, s.len()));
                    body += s.len() - off;
                    si += 1;
                    off = 0;
                    continue;
                }
                // Cut inside this slice at the last entry that fits.
                let mut end = off;
                while end < s.len() {
                    let len = format::entry_len_unchecked(&s[end..])
                        .map_err(|e| Error::Corrupt(format!("write buffer: {e}")))?;
                    if body + (end - off) + len > room {
                        break;
                    }
                    end += len;
                }
                if end > off {
                    ranges.push((si, off, end));
                    body += end - off;
                    off = end;
                }
                break;
            }
            if body == 0 {
                return Ok(None);
            }
            if used[i] == 0 {
                fresh.push(i);
            }
            remaining -= body;
            used[i] += format::page_align_up(BLOCK_HEADER_BYTES + body) as u64;
            plan.push((i, ranges, body));
        }
        // Commit: build the buffers and update the metadata.
        let mut writes = Vec::with_capacity(plan.len());
        let now = Instant::now();
        for (i, ranges, body) in plan {
            let padded = format::page_align_up(BLOCK_HEADER_BYTES + body);
            let mut buf = blocks.take(padded);
            {
                let out = blocks.bytes_mut(&mut buf);
                let mut at = BLOCK_HEADER_BYTES;
                for &(si, from, to) in &ranges {
                    out[at..at + (to - from)].copy_from_slice(&slices[si][from..to]);
                    at += to - from;
                }
                out[at..padded].fill(0);
                let h = BlockHeader {
                    kind: format::BLOCK_SECONDARY,
                    body_len: body as u32,
                    write_seq: seq.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
                    data_seq,
                    tablet: self.id,
                    entry_count: 0,
                };
                h.encode(out);
            }
            if notes {
                let mut placed = 0u32;
                for &(si, from, to) in &ranges {
                    placed += note_entries(st, &slices[si][from..to], i as u32, data_seq);
                }
                st.count_placed(i, placed);
            } else {
                // Entries without notes: the segment's counts no longer cover it.
                st.segments[i].tracked = false;
            }
            let m = &mut st.segments[i];
            let offset = i as u64 * self.segment_bytes + m.used;
            m.stamp = mean_stamp(m.stamp, m.used, now, padded as u64);
            m.used += padded as u64;
            m.pending += 1;
            m.data_seq = m.data_seq.max(data_seq);
            writes.push(BlockWrite {
                segment: i,
                offset,
                buf,
            });
        }
        st.data_wm = st.data_wm.max(data_seq);
        Ok(Some(writes))
    }

    /// Appends version blocks (each followed by the mirror of its deletes) with the given records
    /// to the version log (caller syncs).
    pub fn append_versions(&self, seq: u64, records: &[VersionRecord]) -> Result<u64> {
        let mut g = self.verlog.lock();
        let mut buf = Vec::with_capacity(records.len() * format::VERSION_RECORD_BYTES + 64);
        format::encode_version_blocks(&mut buf, seq, records);
        let at = g.len;
        g.file
            .write_all_at(&buf, at)
            .map_err(|e| Error::io(&self.ver_path, e))?;
        g.len += buf.len() as u64;
        Ok(buf.len() as u64)
    }
}

type Range3 = (usize, usize, usize);

/// Notes the placement of every entry of `run` (whole entries from the write buffer) in segment
/// `segment`.
/// Notes every entry of `run`, placed in `segment` by flush `seq`; returns how many.
fn note_entries(st: &mut TabletState, run: &[u8], segment: u32, seq: u64) -> u32 {
    let mut at = 0usize;
    let mut count = 0u32;
    while at < run.len() {
        let Ok((e, len)) = format::decode_entry_unchecked(&run[at..]) else {
            break;
        };
        st.push_note(Note {
            hash: format::key_hash(e.key),
            segment,
            len: len as u32,
            seq,
        });
        count += 1;
        at += len;
    }
    count
}

/// The byte-weighted mean of two write times: `old_bytes` written at `old`, `new_bytes` at `now`.
/// Appending fresh data to an old segment makes it look only as much younger as the share of
/// fresh bytes (DXRAM's per-append age update, digest 000 §6.5 eq. 8), not brand new.
pub fn mean_stamp(old: Instant, old_bytes: u64, now: Instant, new_bytes: u64) -> Instant {
    let total = old_bytes + new_bytes;
    if old_bytes == 0 || total == 0 || now <= old {
        return now;
    }
    old + (now - old).mul_f64(new_bytes as f64 / total as f64)
}

/// One block write into a secondary log.
pub struct BlockWrite {
    pub segment: usize,
    pub offset: u64,
    pub buf: BlockBuf,
}

/// The bytes of one block write: a page-aligned range of its flush's arena, or a buffer of its
/// own when the arena is full.
pub enum BlockBuf {
    Arena { start: usize, len: usize },
    Own(AlignedBuf),
}

impl BlockWrite {
    /// The block's bytes (`arena` is the flush's, see [`Blocks`]).
    pub fn bytes<'a>(&'a self, arena: Option<&'a AlignedBuf>) -> &'a [u8] {
        match &self.buf {
            BlockBuf::Own(b) => b.as_slice(),
            BlockBuf::Arena { start, len } => {
                &arena.expect("an arena block without its arena").full()[*start..*start + *len]
            }
        }
    }

    pub fn len(&self) -> usize {
        match &self.buf {
            BlockBuf::Own(b) => b.len(),
            BlockBuf::Arena { len, .. } => *len,
        }
    }
}

/// Where a flush's block buffers come from: one arena per flush, taken from the pool (so it is
/// reused, and at 2 MiB or more backed by huge pages: 256 tablets' blocks of about 100 KiB each
/// are then written from huge pages too), with a pooled buffer of its own for a block that no
/// longer fits.
pub struct Blocks<'a> {
    pool: &'a crate::engine::BufPool,
    arena: Option<AlignedBuf>,
    used: usize,
}

impl<'a> Blocks<'a> {
    /// An arena of at least `bytes` (none if 0).
    pub fn new(pool: &'a crate::engine::BufPool, bytes: usize) -> Blocks<'a> {
        Blocks {
            pool,
            arena: (bytes > 0).then(|| pool.get(bytes)),
            used: 0,
        }
    }

    /// Room for a block of `padded` bytes (a multiple of the page size); its bytes are then
    /// reached with [`Blocks::bytes_mut`].
    fn take(&mut self, padded: usize) -> BlockBuf {
        if let Some(a) = &self.arena {
            if self.used + padded <= a.capacity() {
                let b = BlockBuf::Arena {
                    start: self.used,
                    len: padded,
                };
                self.used += padded;
                return b;
            }
        }
        let mut own = self.pool.get(padded);
        own.set_len(padded);
        BlockBuf::Own(own)
    }

    fn bytes_mut<'b>(&'b mut self, b: &'b mut BlockBuf) -> &'b mut [u8] {
        match b {
            BlockBuf::Own(own) => {
                let len = own.len();
                &mut own.full_mut()[..len]
            }
            BlockBuf::Arena { start, len } => {
                &mut self.arena.as_mut().expect("arena").full_mut()[*start..*start + *len]
            }
        }
    }

    /// The arena, to travel with the flush's writes; None if nothing was placed in it (it then
    /// goes back to the pool).
    pub fn finish(self) -> Option<AlignedBuf> {
        match self.arena {
            Some(a) if self.used > 0 => Some(a),
            Some(a) => {
                self.pool.put(a);
                None
            }
            None => None,
        }
    }
}
