//! Replay: rebuilds the newest version of every live key of a tablet from its secondary log, its
//! secondary-log buffer (the primary log's share, restored at open), its version log and version
//! buffer.
//!
//! Several threads read whole segments (O_DIRECT, so from the disk, not the page cache) and parse
//! them; every entry is checked against its CRC32C. The newest version of each key wins across all
//! sources — data entries, put records and delete records of the version log — which is correct
//! even when the version log lags the data after a crash (DXRAM §4.12). A key whose newest known
//! version has no intact entry is reported as lost and not returned: an older version is never
//! resurrected in its place.

use crate::engine::Shared;
use crate::format::{self, BLOCK_HEADER_BYTES};
use crate::io::{self, AlignedBuf};
use crate::tablet::{HashMapU128, Tablet};
use crate::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// What phase 1 of a replay returns: per-worker outputs, (damaged version-log bytes, version
/// blocks recovered from their mirror), and the version-log records (key hash, version, deleted)
/// per shard.
type PhaseOneOut = (Vec<WorkerOut>, (u64, u64), Vec<Vec<(u128, u64, bool)>>);

/// One live key as replay yields it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayEntry<'a> {
    pub tablet: u64,
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub version: u64,
    pub expiry: u64,
}

/// What a replay found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReplayReport {
    /// Keys yielded (live, newest version).
    pub live_keys: u64,
    /// Keys whose newest version is a delete (not yielded).
    pub deleted_keys: u64,
    /// Older versions seen and skipped.
    pub stale_entries: u64,
    /// Entries whose checksum failed (never yielded).
    pub corrupt_entries: u64,
    /// Bytes that could not be parsed (a damaged length field ends a block).
    pub unreadable_bytes: u64,
    /// Keys whose newest known version had no intact entry (reported, not yielded).
    pub lost_keys: u64,
    /// Version-log bytes that failed their checksum. Every version block is stored twice
    /// (`docs/formats.md`): when one copy of a block is damaged its mirror stands in
    /// (`recovered_version_blocks`) and nothing is lost. When both are, the deletes recorded there
    /// are unknown and keys deleted in them may come back: reported so that the caller can
    /// restore from a replica.
    pub damaged_version_bytes: u64,
    /// Version blocks read from their mirror copy because the first copy was damaged.
    pub recovered_version_blocks: u64,
    /// Highest version seen, deletes included (a restarted master continues above it).
    pub max_version: u64,
    pub bytes_read: u64,
    pub segments_read: u64,
}

impl ReplayReport {
    pub fn add(&mut self, o: &ReplayReport) {
        self.live_keys += o.live_keys;
        self.deleted_keys += o.deleted_keys;
        self.stale_entries += o.stale_entries;
        self.corrupt_entries += o.corrupt_entries;
        self.unreadable_bytes += o.unreadable_bytes;
        self.lost_keys += o.lost_keys;
        self.damaged_version_bytes += o.damaged_version_bytes;
        self.recovered_version_blocks += o.recovered_version_blocks;
        self.max_version = self.max_version.max(o.max_version);
        self.bytes_read += o.bytes_read;
        self.segments_read += o.segments_read;
    }

    /// True if nothing damaged was found.
    pub fn is_clean(&self) -> bool {
        self.corrupt_entries == 0
            && self.unreadable_bytes == 0
            && self.lost_keys == 0
            && self.damaged_version_bytes == 0
    }
}

const LOC_DELETE: u64 = u64::MAX;
const LOC_KNOWN_PUT: u64 = u64::MAX - 1;
const SHARDS: usize = 64;

type Shard = HashMapU128<(u64, u64)>;

#[inline]
fn shard_of(hash: u128) -> usize {
    (hash >> 122) as usize & (SHARDS - 1)
}

/// Merges one candidate (version, location) for a key: the newest version wins; at equal
/// versions a delete beats data, and data beats a bare "known put" record.
#[inline]
fn merge(map: &mut Shard, hash: u128, version: u64, loc: u64) -> bool {
    match map.entry(hash) {
        std::collections::hash_map::Entry::Vacant(v) => {
            v.insert((version, loc));
            false
        }
        std::collections::hash_map::Entry::Occupied(mut o) => {
            let (bv, bl) = *o.get();
            let replace = version > bv
                || (version == bv
                    && (loc == LOC_DELETE || (bl == LOC_KNOWN_PUT && loc < LOC_KNOWN_PUT)));
            if replace {
                o.insert((version, loc));
            }
            true
        }
    }
}

/// Candidates buffered per shard before taking the shard's lock (amortises locking).
struct Batcher<'a> {
    shards: &'a [parking_lot::Mutex<Shard>],
    pending: Vec<Vec<(u128, u64, u64)>>,
    superseded: u64,
}

impl<'a> Batcher<'a> {
    fn new(shards: &'a [parking_lot::Mutex<Shard>]) -> Self {
        Batcher {
            shards,
            pending: (0..SHARDS).map(|_| Vec::with_capacity(256)).collect(),
            superseded: 0,
        }
    }
    #[inline]
    fn push(&mut self, hash: u128, version: u64, loc: u64) {
        let s = shard_of(hash);
        self.pending[s].push((hash, version, loc));
        if self.pending[s].len() >= 256 {
            self.drain(s);
        }
    }
    fn drain(&mut self, s: usize) {
        let mut map = self.shards[s].lock();
        for &(h, v, l) in &self.pending[s] {
            if merge(&mut map, h, v, l) {
                self.superseded += 1;
            }
        }
        self.pending[s].clear();
    }
    fn finish(mut self) -> u64 {
        for s in 0..SHARDS {
            self.drain(s);
        }
        self.superseded
    }
}

#[derive(Default)]
struct WorkerOut {
    buffers: Vec<(usize, AlignedBuf)>,
    corrupt: u64,
    unreadable: u64,
    bytes: u64,
    data_entries: u64,
}

/// Replays one tablet; `f` is called once per live key.
pub fn replay_tablet(
    sh: &Shared,
    t: &Arc<Tablet>,
    f: &mut dyn FnMut(ReplayEntry<'_>),
) -> Result<ReplayReport> {
    replay_merged(sh, std::slice::from_ref(t), None, &mut |_| {}, f)
}

/// Which keys a replay keeps: true for a key to merge and yield.
pub type KeyFilter<'a> = &'a (dyn Fn(&[u8]) -> bool + Sync);

/// Replays several tablets as one: the newest version of each key over all of them wins, a
/// delete in one hides older data in another, and `f` sees each live key once (with the id of
/// the tablet whose entry won). For a tablet whose log continues in another (a new epoch).
/// `count` hears, before the first entry, how many keys were found (an upper bound on the
/// entries `f` will see). With `keep`, only the data entries of the keys it keeps are merged
/// (a restore of part of the tablets' keys): version records then only rank keys some kept
/// entry holds, so a kept key none of whose data is left is not counted as lost.
pub fn replay_merged(
    sh: &Shared,
    ts: &[Arc<Tablet>],
    keep: Option<KeyFilter<'_>>,
    count: &mut dyn FnMut(u64),
    f: &mut dyn FnMut(ReplayEntry<'_>),
) -> Result<ReplayReport> {
    let mut m = merge_sources(sh, ts, keep)?;
    let t0 = std::time::Instant::now();
    count(m.keys());
    let winners = m.winners();
    let (mut live, mut lost) = (0u64, 0u64);
    for (source, offsets) in winners.into_iter().enumerate() {
        let src = m.source(source);
        for off in offsets {
            // Verified in phase 1; the bytes have not changed since.
            let Some(e) = entry_at(&src[off as usize..]) else {
                lost += 1;
                continue;
            };
            live += 1;
            f(ReplayEntry {
                tablet: m.tablet_of[source],
                key: e.0,
                value: e.1,
                version: e.2,
                expiry: e.3,
            });
        }
    }
    m.report.live_keys = live;
    m.report.lost_keys += lost;
    m.report.stale_entries = m.data_entries.saturating_sub(live);
    if tracing::enabled!(tracing::Level::DEBUG) {
        tracing::debug!("replay: phase 2 (yield) {:?}", t0.elapsed());
    }
    Ok(m.report)
}

/// Which group a key belongs to, if any (a grouped replay keeps only keys some group takes).
pub type KeyGroups<'a> = &'a (dyn Fn(&[u8]) -> Option<usize> + Sync);

/// A replay whose keys are divided into groups: the recovery partitions one restorer restores
/// from the same logs. The logs are read, checked and merged once, for every group; each group's
/// keys are then yielded on their own, in log order, when its turn comes
/// ([`GroupedReplay::take`]), so that a partition costs its restorer its share of the keys, not
/// another pass over the whole logs. Holds the logs in memory until dropped.
pub struct GroupedReplay {
    merged: Merged,
    /// Each group's winners (source << 32 | offset, in log order) until taken.
    groups: Vec<parking_lot::Mutex<Option<Vec<u64>>>>,
    sizes: Vec<u64>,
}

impl GroupedReplay {
    /// How many groups it was made for.
    pub fn groups(&self) -> usize {
        self.groups.len()
    }

    /// How many keys group `g` yields (0 for a group it does not have).
    pub fn len(&self, g: usize) -> u64 {
        self.sizes.get(g).copied().unwrap_or(0)
    }

    /// True if no group has a key.
    pub fn is_empty(&self) -> bool {
        self.sizes.iter().all(|&n| n == 0)
    }

    /// What the replay found, over every group: damage, deleted and lost keys, the highest
    /// version (deletes included).
    pub fn report(&self) -> ReplayReport {
        self.merged.report
    }

    /// Yields each live key of group `g` once, newest version, in log order; the number yielded,
    /// or None if the group was taken already (or does not exist).
    pub fn take(&self, g: usize, f: &mut dyn FnMut(ReplayEntry<'_>)) -> Option<u64> {
        let list = self.groups.get(g)?.lock().take()?;
        for &loc in &list {
            let source = (loc >> 32) as usize;
            let src = self.merged.source(source);
            // Verified in phase 1 and decoded once since; the bytes have not changed.
            if let Some(e) = entry_at(&src[(loc & 0xFFFF_FFFF) as usize..]) {
                f(ReplayEntry {
                    tablet: self.merged.tablet_of[source],
                    key: e.0,
                    value: e.1,
                    version: e.2,
                    expiry: e.3,
                });
            }
        }
        Some(list.len() as u64)
    }
}

/// Replays several tablets as one ([`replay_merged`]'s rules), keeping the keys `group_of` puts
/// in one of `groups` groups, and divides the winners among them.
pub fn replay_grouped(
    sh: &Shared,
    ts: &[Arc<Tablet>],
    group_of: KeyGroups<'_>,
    groups: usize,
) -> Result<GroupedReplay> {
    let keep = |key: &[u8]| group_of(key).is_some_and(|g| g < groups);
    let mut m = merge_sources(sh, ts, Some(&keep))?;
    let winners = m.winners();
    let mut lists: Vec<Vec<u64>> = vec![Vec::new(); groups];
    let mut lost = 0u64;
    for (source, offsets) in winners.into_iter().enumerate() {
        let src = m.source(source);
        for off in offsets {
            let group = entry_at(&src[off as usize..]).and_then(|e| group_of(e.0));
            match group.and_then(|g| lists.get_mut(g)) {
                Some(list) => list.push(((source as u64) << 32) | u64::from(off)),
                None => lost += 1,
            }
        }
    }
    let sizes: Vec<u64> = lists.iter().map(|l| l.len() as u64).collect();
    let live: u64 = sizes.iter().sum();
    m.report.live_keys = live;
    m.report.lost_keys += lost;
    m.report.stale_entries = m.data_entries.saturating_sub(live);
    Ok(GroupedReplay {
        merged: m,
        groups: lists
            .into_iter()
            .map(|l| parking_lot::Mutex::new(Some(l)))
            .collect(),
        sizes,
    })
}

/// The taker of a streamed replay ([`replay_streamed`]): called from several threads at once.
pub trait ReplaySink: Sync {
    /// Before the first batch: about how many keys may come (the version records: an upper
    /// bound unless the version log lags the data).
    fn start(&self, expected: u64);
    /// A batch of candidates, in no particular order: a key may come more than once, in any
    /// order of its versions, and the newest must win (an older one that comes later is
    /// dropped). An entry whose expiry has passed still counts as the key's version: it hides
    /// older ones. False stops the replay (the taker failed).
    fn take(&self, batch: &[ReplayEntry<'_>]) -> bool;
}

/// What a streamed replay did.
#[derive(Debug, Clone, Copy, Default)]
pub struct Streamed {
    /// What it found. `live_keys` counts the candidates given to the taker (the newest version
    /// of each key among them, and older ones), `deleted_keys` the entries a newer delete hid.
    pub report: ReplayReport,
    /// False when the logs are damaged (an entry failed its checksum, bytes could not be read,
    /// version-log blocks were lost): a version that failed its check may be newer than one the
    /// taker kept. Whatever the taker took must then be discarded and the logs replayed with
    /// [`replay_merged`], which never lets an older version stand in for a lost newer one.
    pub trusted: bool,
    /// The taker stopped the replay.
    pub stopped: bool,
}

/// Candidates a replay thread gives its taker at once.
const STREAM_BATCH: usize = 256;

/// A replay that merges in the taker instead of in a map of its own: for a restore into an
/// engine tablet, whose index finds a key's current version anyway. The version logs are read
/// first, keeping only deletes; then several threads read and check the segments and hand each
/// data entry that no newer delete hides straight to `sink`, which keeps the newest version of
/// each key. So nothing is held but the deletes and the segments being parsed, and the taker's
/// work overlaps the reading and checking instead of following it.
///
/// The map of [`replay_merged`] also ranks the version log's put records, so that a key whose
/// newest version was lost to damage is reported lost rather than restored at an older version.
/// A streamed replay trusts its candidates only when nothing was damaged
/// ([`Streamed::trusted`]); the caller replays with [`replay_merged`] otherwise. Version records
/// are checked before any candidate is handed over: damaged version logs hand over nothing.
pub fn replay_streamed(
    sh: &Shared,
    ts: &[Arc<Tablet>],
    keep: Option<KeyFilter<'_>>,
    sink: &dyn ReplaySink,
) -> Result<Streamed> {
    let _guards: Vec<_> = ts.iter().map(|t| t.reorg_lock.lock()).collect();
    let sources = Sources::collect(sh, ts)?;
    let mut report = ReplayReport {
        bytes_read: sources.ver_len,
        segments_read: sources.segments.len() as u64,
        ..Default::default()
    };
    // Deletes by key hash (the newest of each), and the highest version.
    let mut deletes: HashMapU128<u64> = HashMapU128::default();
    let mut max_version = 0u64;
    let mut note = |r: format::VersionRecord| {
        max_version = max_version.max(r.version);
        if r.deleted {
            let v = deletes.entry(r.hash).or_insert(r.version);
            *v = (*v).max(r.version);
        }
    };
    let (damaged, recovered) = sources.walk_version_logs(ts, &mut note)?;
    for r in &sources.vbuf {
        note(*r);
    }
    report.damaged_version_bytes = damaged;
    report.recovered_version_blocks = recovered;
    report.max_version = max_version;
    if damaged > 0 {
        return Ok(Streamed {
            report,
            trusted: false,
            stopped: false,
        });
    }
    sink.start(sources.version_records());

    /// One thread's share of the figures.
    #[derive(Default)]
    struct Share {
        given: u64,
        hidden: u64,
        max_version: u64,
        corrupt: u64,
        unreadable: u64,
        bytes: u64,
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    let deletes = &deletes;
    // Hands the data entries of one run of entries to the taker, in batches.
    let stream = |body: &[u8], tablet: u64, share: &mut Share| {
        let mut batch: Vec<ReplayEntry<'_>> = Vec::with_capacity(STREAM_BATCH);
        let stats = format::walk_entries(body, |_, e| {
            if e.is_delete() || keep.is_some_and(|keep| !keep(e.key)) {
                return;
            }
            share.max_version = share.max_version.max(e.version);
            if !deletes.is_empty()
                && deletes
                    .get(&format::key_hash(e.key))
                    .is_some_and(|&d| d >= e.version)
            {
                share.hidden += 1;
                return;
            }
            batch.push(ReplayEntry {
                tablet,
                key: e.key,
                value: e.value,
                version: e.version,
                expiry: e.expiry,
            });
            if batch.len() == STREAM_BATCH {
                if !stop.load(Ordering::Relaxed) && !sink.take(&batch) {
                    stop.store(true, Ordering::Relaxed);
                }
                share.given += batch.len() as u64;
                batch.clear();
            }
        });
        if !batch.is_empty() {
            if !stop.load(Ordering::Relaxed) && !sink.take(&batch) {
                stop.store(true, Ordering::Relaxed);
            }
            share.given += batch.len() as u64;
        }
        share.corrupt += stats.corrupt_entries;
        share.unreadable += stats.unreadable_bytes;
    };
    let next = AtomicUsize::new(0);
    let threads = sh.cfg.replay_threads.max(1);
    let shares = std::thread::scope(|s| -> Result<Vec<Share>> {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (sources, next, stream, stop) = (&sources, &next, &stream, &stop);
                s.spawn(move || -> Result<Share> {
                    let mut share = Share::default();
                    while !stop.load(Ordering::Relaxed) {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(ti, _, _)) = sources.segments.get(k) else {
                            break;
                        };
                        let buf = sources.read_segment(sh, ts, k)?;
                        share.bytes += buf.as_slice().len() as u64;
                        let tablet = ts[ti].id;
                        format::walk_blocks(buf.as_slice(), |_, h, body| {
                            if h.tablet == tablet {
                                stream(body, tablet, &mut share);
                            }
                        });
                        sh.replay_pool.put(buf);
                    }
                    Ok(share)
                })
            })
            .collect();
        // This thread: the secondary-log buffers.
        let mut mine = Share::default();
        for (slb, t) in sources.slbs.iter().zip(ts) {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            mine.bytes += slb.len() as u64;
            stream(slb, t.id, &mut mine);
        }
        let mut shares = vec![mine];
        for h in handles {
            shares.push(
                h.join()
                    .map_err(|_| Error::Corrupt("replay worker panicked".into()))??,
            );
        }
        Ok(shares)
    })?;
    for sh in &shares {
        report.live_keys += sh.given;
        report.deleted_keys += sh.hidden;
        report.max_version = report.max_version.max(sh.max_version);
        report.corrupt_entries += sh.corrupt;
        report.unreadable_bytes += sh.unreadable;
        report.bytes_read += sh.bytes;
    }
    Ok(Streamed {
        trusted: report.is_clean(),
        stopped: stop.load(Ordering::Relaxed),
        report,
    })
}

/// What phases 1 and 1b of a replay leave: the logs read (segments, then each tablet's SLB, by
/// source index) and the newest version and place of every key.
struct Merged {
    segments: Vec<AlignedBuf>,
    /// Where the segment buffers go back to when the replay is dropped.
    pool: Arc<crate::engine::BufPool>,
    slbs: Vec<Vec<u8>>,
    /// The tablet each source belongs to.
    tablet_of: Vec<u64>,
    shards: Vec<Shard>,
    /// Everything but the per-key figures, which [`Merged::winners`] and the yield add.
    report: ReplayReport,
    /// Data entries merged (kept ones only, with a filter).
    data_entries: u64,
}

impl Drop for Merged {
    fn drop(&mut self) {
        for b in self.segments.drain(..) {
            self.pool.put(b);
        }
    }
}

impl Merged {
    fn source(&self, i: usize) -> &[u8] {
        match self.segments.get(i) {
            Some(b) => b.as_slice(),
            None => &self.slbs[i - self.segments.len()],
        }
    }

    /// Keys found (deleted ones included): an upper bound on the entries a yield gives.
    fn keys(&self) -> u64 {
        self.shards.iter().map(|s| s.len() as u64).sum()
    }

    /// The winners' offsets, by source, each source's in ascending order (so that a yield reads
    /// the logs front to back, not at random in the map's order, a cache miss each). Counts
    /// deleted and lost keys and the highest version; empties the map.
    fn winners(&mut self) -> Vec<Vec<u32>> {
        let sources = self.segments.len() + self.slbs.len();
        let mut winners: Vec<Vec<u32>> = vec![Vec::new(); sources];
        for shard in std::mem::take(&mut self.shards) {
            for (_, (v, loc)) in shard {
                self.report.max_version = self.report.max_version.max(v);
                match loc {
                    LOC_DELETE => self.report.deleted_keys += 1,
                    LOC_KNOWN_PUT => self.report.lost_keys += 1,
                    _ => winners[(loc >> 32) as usize].push((loc & 0xFFFF_FFFF) as u32),
                }
            }
        }
        for w in &mut winners {
            w.sort_unstable();
        }
        winners
    }
}

/// The longest a replay waits for the blocks a flush placed in a tablet's segments to be
/// written before it reads them.
const PLACED_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The tablet's state once no block placed in its segments is still being written. A flush
/// places a block (the segment's used bytes grow, the secondary-log buffer it came from is
/// emptied) before its writer puts it on disk: a replay reading that region meanwhile would find
/// neither the buffer nor the block, and entries appended long before it began would be missing.
fn placed_blocks_written<'a>(
    sh: &Shared,
    t: &'a Tablet,
) -> Result<parking_lot::MutexGuard<'a, crate::tablet::TabletState>> {
    let deadline = std::time::Instant::now() + PLACED_WAIT;
    loop {
        // A failed store replays what is on disk (its writer stopped).
        let failed = sh.failed().is_some();
        let st = t.state.lock();
        if failed || st.segments.iter().all(|s| s.pending == 0) {
            return Ok(st);
        }
        drop(st);
        if std::time::Instant::now() >= deadline {
            return Err(Error::Busy(format!(
                "tablet {:#x}: blocks placed in its log are still not written after {} s",
                t.id,
                PLACED_WAIT.as_secs()
            )));
        }
        // Each flush's writes complete before it publishes its progress.
        let mut p = sh.progress.lock();
        sh.progress_cv
            .wait_for(&mut p, std::time::Duration::from_millis(2));
    }
}

/// What a replay of `ts` reads: every segment with data (tablet index, segment, used bytes),
/// each tablet's secondary-log buffer (one more source after the segments), the version
/// records still in buffers, and the version logs (a handle, the bytes written, the tablet
/// index). Taken while no block placed in the segments is still being written.
struct Sources {
    segments: Vec<(usize, usize, u64)>,
    slbs: Vec<Vec<u8>>,
    vbuf: Vec<format::VersionRecord>,
    ver_files: Vec<(std::fs::File, u64, usize)>,
    ver_len: u64,
}

impl Sources {
    fn collect(sh: &Shared, ts: &[Arc<Tablet>]) -> Result<Sources> {
        let mut src = Sources {
            segments: Vec::new(),
            slbs: Vec::new(),
            vbuf: Vec::new(),
            ver_files: Vec::new(),
            ver_len: 0,
        };
        for (ti, t) in ts.iter().enumerate() {
            {
                let st = placed_blocks_written(sh, t)?;
                src.segments.extend(
                    st.segments
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| s.used > 0)
                        .map(|(i, s)| (ti, i, s.used)),
                );
                src.vbuf.extend_from_slice(&st.vbuf);
                // Records being spilled: in neither the buffer nor (perhaps) the log read below.
                if let Some(sp) = &st.vbuf_spilling {
                    src.vbuf.extend_from_slice(sp);
                }
                src.slbs.push(st.slb.clone());
            }
            let vl = t.verlog.lock();
            src.ver_files.push((
                vl.file.try_clone().map_err(|e| Error::io(&t.ver_path, e))?,
                vl.len,
                ti,
            ));
            src.ver_len += vl.len;
        }
        Ok(src)
    }

    /// Reads the version logs and calls `f` for every intact record; (damaged bytes, blocks
    /// recovered from their mirror).
    fn walk_version_logs(
        &self,
        ts: &[Arc<Tablet>],
        mut f: impl FnMut(format::VersionRecord),
    ) -> Result<(u64, u64)> {
        let (mut damaged, mut recovered) = (0u64, 0u64);
        for (file, len, ti) in &self.ver_files {
            let mut ver_bytes = vec![0u8; *len as usize];
            let n = io::read_exact_at(file, &mut ver_bytes, 0)
                .map_err(|e| Error::io(&ts[*ti].ver_path, e))?;
            ver_bytes.truncate(n);
            let walk = format::walk_version_log(&ver_bytes, |_, recs| {
                for r in format::version_records(recs) {
                    f(r);
                }
            });
            damaged += walk.damaged_bytes + walk.tail_bytes;
            recovered += walk.recovered_blocks;
        }
        Ok((damaged, recovered))
    }

    /// Version records in the logs and buffers: about one per key written (a put or a delete),
    /// more for keys written again.
    fn version_records(&self) -> u64 {
        self.ver_len / format::VERSION_RECORD_BYTES as u64 + self.vbuf.len() as u64
    }

    /// Reads segment `k` into a buffer of the replay pool.
    fn read_segment(&self, sh: &Shared, ts: &[Arc<Tablet>], k: usize) -> Result<AlignedBuf> {
        let (ti, seg, used) = self.segments[k];
        let t = &ts[ti];
        let mut buf = sh.replay_pool.get(used as usize);
        let n = io::read_exact_at(
            &t.file,
            &mut buf.full_mut()[..used as usize],
            seg as u64 * t.segment_bytes,
        )
        .map_err(|e| Error::io(&t.sec_path, e))?;
        buf.set_len(n);
        Ok(buf)
    }
}

/// Phases 1 and 1b of a replay: reads every segment of `ts` and merges the newest version of
/// each key (of the keys `keep` keeps). The tablets' reorganization waits meanwhile; the logs are
/// in memory afterwards.
fn merge_sources(sh: &Shared, ts: &[Arc<Tablet>], keep: Option<KeyFilter<'_>>) -> Result<Merged> {
    let _guards: Vec<_> = ts.iter().map(|t| t.reorg_lock.lock()).collect();
    let sources = Sources::collect(sh, ts)?;
    let (segments, slbs, ver_len) = (&sources.segments, &sources.slbs, sources.ver_len);
    let threads = sh.cfg.replay_threads.max(1);
    let trace = tracing::enabled!(tracing::Level::DEBUG);
    let t0 = std::time::Instant::now();
    let next = AtomicUsize::new(0);
    let slb_index = segments.len();
    let used_total: u64 = segments.iter().map(|s| s.2).sum::<u64>()
        + slbs.iter().map(|s| s.len() as u64).sum::<u64>();
    // Sized by the version records (every key has one in the version log or buffer, a put or a
    // delete, more for keys written again) and at most for the smallest entries the data could
    // hold (a 16 B key and nothing else). The version log lags the data after a crash; the map
    // grows if there are more keys than that. A map sized for small entries alone was five times
    // too large for 100 B values, and its fresh memory and cache misses showed in restores.
    let by_versions = sources.version_records();
    let by_data = used_total / format::entry_bytes(16, 0, 1 << 20, 0) as u64;
    let expect_keys = by_versions.min(by_data).max(1024) as usize;
    let shards: Vec<parking_lot::Mutex<Shard>> = (0..SHARDS)
        .map(|_| {
            parking_lot::Mutex::new(Shard::with_capacity_and_hasher(
                expect_keys / SHARDS + 16,
                Default::default(),
            ))
        })
        .collect();
    let mut report = ReplayReport {
        bytes_read: ver_len,
        ..Default::default()
    };

    // Phase 1: threads read segments (and one the version log) and merge candidates into the
    // sharded map of newest versions.
    let results = std::thread::scope(|s| -> Result<PhaseOneOut> {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (sources, next, shards) = (&sources, &next, &shards);
                s.spawn(move || -> Result<(WorkerOut, u64)> {
                    let mut out = WorkerOut::default();
                    let mut batch = Batcher::new(shards);
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(ti, _, _)) = sources.segments.get(k) else {
                            break;
                        };
                        let buf = sources.read_segment(sh, ts, k)?;
                        out.bytes += buf.as_slice().len() as u64;
                        parse_region(buf.as_slice(), k, ts[ti].id, keep, &mut out, &mut batch);
                        out.buffers.push((k, buf));
                    }
                    let superseded = batch.finish();
                    Ok((out, superseded))
                })
            })
            .collect();
        // This thread: the version log, the version buffer and the SLB.
        let mut batch = Batcher::new(&shards);
        // Version records are only bucketed here; they are checked against the data once the
        // segments are merged (phase 1b), one shard at a time.
        let mut vparts: Vec<Vec<(u128, u64, bool)>> = (0..SHARDS).map(|_| Vec::new()).collect();
        let (damaged, recovered) = sources.walk_version_logs(ts, |r| {
            vparts[shard_of(r.hash)].push((r.hash, r.version, r.deleted));
        })?;
        for r in &sources.vbuf {
            vparts[shard_of(r.hash)].push((r.hash, r.version, r.deleted));
        }
        let mut slb_out = WorkerOut::default();
        for (i, slb) in slbs.iter().enumerate() {
            let source = ((slb_index + i) as u64) << 32;
            let stats = format::walk_entries(slb, |off, e| {
                if keep.is_some_and(|keep| !keep(e.key)) {
                    return;
                }
                slb_out.data_entries += 1;
                batch.push(format::key_hash(e.key), e.version, source | off as u64);
            });
            slb_out.corrupt += stats.corrupt_entries;
            slb_out.unreadable += stats.unreadable_bytes;
        }
        batch.finish();
        let mut outs = vec![slb_out];
        for h in handles {
            let (o, _) = h
                .join()
                .map_err(|_| Error::Corrupt("replay worker panicked".into()))??;
            outs.push(o);
        }
        Ok((outs, (damaged, recovered), vparts))
    })?;
    let (outs, (version_damage, recovered_blocks), vparts) = results;
    let id = ts.first().map_or(0, |t| t.id);
    if trace {
        tracing::debug!("replay {:#x}: phase 1 (read+merge) {:?}", id, t0.elapsed());
    }
    // Phase 1b: version records, shard by shard (the shard's map stays in cache). Most put records
    // just confirm the data entry already merged; only deletes and puts without newer data merge.
    let next_shard = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let k = next_shard.fetch_add(1, Ordering::Relaxed);
                if k >= SHARDS {
                    break;
                }
                let mut map = shards[k].lock();
                for &(h, v, deleted) in &vparts[k] {
                    if keep.is_some() && !map.contains_key(&h) {
                        continue;
                    }
                    if deleted {
                        merge(&mut map, h, v, LOC_DELETE);
                    } else if map.get(&h).is_none_or(|&(bv, _)| bv < v) {
                        merge(&mut map, h, v, LOC_KNOWN_PUT);
                    }
                }
            });
        }
    });
    drop(vparts);
    let source_count = segments.len() + slbs.len();
    let mut bufs: Vec<Option<AlignedBuf>> = (0..segments.len()).map(|_| None).collect();
    let mut data_entries = 0u64;
    for o in outs {
        for (k, b) in o.buffers {
            bufs[k] = Some(b);
        }
        report.corrupt_entries += o.corrupt;
        report.unreadable_bytes += o.unreadable;
        report.bytes_read += o.bytes;
        data_entries += o.data_entries;
    }
    report.damaged_version_bytes = version_damage;
    report.recovered_version_blocks = recovered_blocks;
    report.segments_read = segments.len() as u64;
    let tablet_of: Vec<u64> = segments
        .iter()
        .map(|s| ts[s.0].id)
        .chain(ts.iter().map(|t| t.id))
        .collect();
    debug_assert_eq!(tablet_of.len(), source_count);
    Ok(Merged {
        // Every segment was read by some worker (a failed read returned above).
        segments: bufs
            .into_iter()
            .map(|b| b.unwrap_or_else(|| AlignedBuf::new(0)))
            .collect(),
        pool: sh.replay_pool.clone(),
        slbs: sources.slbs,
        tablet_of,
        shards: shards.into_iter().map(|s| s.into_inner()).collect(),
        report,
        data_entries,
    })
}

/// Fields of an entry already verified in phase 1.
#[inline]
fn entry_at(b: &[u8]) -> Option<(&[u8], &[u8], u64, u64)> {
    format::decode_entry_unchecked(b)
        .ok()
        .map(|(e, _)| (e.key, e.value, e.version, e.expiry))
}

fn parse_region(
    region: &[u8],
    source: usize,
    tablet: u64,
    keep: Option<KeyFilter<'_>>,
    out: &mut WorkerOut,
    batch: &mut Batcher<'_>,
) {
    let src = (source as u64) << 32;
    format::walk_blocks(region, |boff, h, body| {
        if h.tablet != tablet {
            return;
        }
        let body_at = boff + BLOCK_HEADER_BYTES;
        let stats = format::walk_entries(body, |off, e| {
            if e.is_delete() || keep.is_some_and(|keep| !keep(e.key)) {
                return;
            }
            out.data_entries += 1;
            batch.push(
                format::key_hash(e.key),
                e.version,
                src | (body_at + off) as u64,
            );
        });
        out.corrupt += stats.corrupt_entries;
        out.unreadable += stats.unreadable_bytes;
    });
}
