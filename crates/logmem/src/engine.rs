//! The engine: tablets (one log and one hash index each) over a shared seglet pool.
//!
//! Write path (per tablet, under the tablet's write lock): look the key up, check the condition,
//! take a version from the engine clock, append the entry to the tablet's head segment, tell the
//! write observer, swing the index reference, count the old entry's bytes dead. Readers take no lock:
//! they pin an epoch, follow the index reference and copy the value out.

use crate::config::EngineConfig;
use crate::entry::{
    self, decode_header, encode_header, encoded_len, Header, HEADER_BYTES_MAX, KIND_OBJECT,
    KIND_TOMBSTONE, STATE_RETAINED, STATE_SUPERSEDED, VALID_TO_FAR,
};
use crate::error::EngineError;
use crate::index::{loc_offset, loc_seglet, HashIndex, Loc, SlotRef};
use crate::mvcc::{PinSet, Snapshots};
use crate::pool::{AllocClass, SegletPool, NO_SEGLET, SEGLET_BYTES};
use crate::segment::{AppendError, SegmentTable, SegmentWriter};
use crate::stats::Counters;
use crate::{
    Condition, LoggedWrite, MultiOp, MultiWrite, Object, PutOptions, PutOutcome, TabletId,
    TabletInfo,
};
use crossbeam_epoch as epoch;
use crossbeam_utils::CachePadded;
use parking_lot::{Condvar, Mutex, RwLock};
use ramlog_common::{key_slot, parse_redis_i64, TableId, Version, SLOT_COUNT};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

thread_local! {
    /// Writes (atomic units: a put, a delete, a multi-write) this thread has logged.
    static UNITS_LOGGED_HERE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many writes (atomic units) the calling thread has logged so far: a caller compares the
/// count before and after a request to learn whether it changed anything. Restores, replays and
/// the cleaner's relocations are not writes and do not count.
pub fn units_logged_on_this_thread() -> u64 {
    UNITS_LOGGED_HERE.with(|c| c.get())
}

fn count_unit_logged() {
    UNITS_LOGGED_HERE.with(|c| c.set(c.get() + 1));
}

/// Upper bound on tablets per engine (one per slot of one table is the finest split).
pub const TABLETS_MAX: usize = SLOT_COUNT as usize;

/// The head segments of all tablets together may grow to at most 1/16 of the budget (see
/// `Inner::head_segment_seglets`).
const HEAD_SHARE_DIVISOR: usize = 16;

#[inline]
/// The index hash of `key`. Its tag bits (`index::tag_of`) are 0 exactly for internal keys
/// (`ramlog_common::is_internal`: the chunks of large collections), so that the index counts
/// them apart and DBSIZE stays O(1).
pub(crate) fn hash_key(key: &[u8]) -> u64 {
    let hash = xxhash_rust::xxh3::xxh3_64(key);
    if ramlog_common::is_internal(key) {
        hash & !crate::index::TAG_BITS
    } else if hash & crate::index::TAG_BITS == 0 {
        hash | crate::index::TAG_LOWEST
    } else {
        hash
    }
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub use ramlog_common::unix_ns;

#[inline]
fn expired(expire_at_ms: u64, now: &mut Option<u64>) -> bool {
    if expire_at_ms == 0 {
        return false;
    }
    let now = *now.get_or_insert_with(now_ms);
    now >= expire_at_ms
}

pub(crate) struct Tablet {
    pub table: TableId,
    pub first_slot: u16,
    /// Lowers when the tablet splits ([`Inner::split_tablet`]).
    pub last_slot: std::sync::atomic::AtomicU16,
    pub index: HashIndex,
    /// The write lock: serialises this tablet's appends and index changes.
    pub head: Mutex<Option<SegmentWriter>>,
    /// Shared log scans of this tablet (one pass at a time; arrivals join the next pass).
    pub scans: crate::scan::ScanQueue,
    /// Valid-to of RETAINED entries whose delta does not fit in 32 bits: (key, version) -> valid-to.
    pub far_valid_to: Mutex<HashMap<(Vec<u8>, u64), u64>>,
    /// (version, id) of the open single-scan snapshots of this tablet's table whose pass has
    /// not yet captured this tablet: until it has, they need every version they can read here.
    pub scan_uncaptured: Mutex<Vec<(u64, u64)>>,
    /// Current objects that carry an expiry time (expired ones not yet removed included, as
    /// Redis counts its `expires`), and the sum of their expiry times in whole seconds, each
    /// taken as at most `EXPIRY_SUM_SECS_MAX` so that the sum stays below 2^64 for any object
    /// count a tablet can hold. Changed only under the write lock, where the current reference
    /// of a key changes.
    pub expiring_objects: AtomicU64,
    pub expiring_sum_secs: AtomicU64,
    /// Writes are refused ([`EngineError::Frozen`]): the tablet is moving to another server.
    /// Set and read under the write lock, so once it is set every write the tablet took has
    /// reached the write observer.
    pub frozen: std::sync::atomic::AtomicBool,
    /// Writes that would grow the tablet are refused ([`EngineError::TabletFull`]): it holds as
    /// much as one tablet may (set by the server from its size, see `Engine::set_tablet_limit`).
    /// Deletes, and overwrites no larger than what they replace, go on.
    pub full_limit: AtomicU64,
    /// While the tablet's upper slots are copied for a split ([`Inner::split_begin`]): the
    /// first slot of the upper half (`NO_SPLIT` otherwise). Writes of its slots then note their
    /// keys in `split_dirty`, under the write lock, so that the split's last step redoes them.
    pub split_watch: AtomicU32,
    pub split_dirty: Mutex<SplitDirty>,
    /// While the next tablet is copied into this one for a merge ([`Inner::merge_begin`] to
    /// its finish or cancel): the copies lie above `last_slot`, and a split's cleanup running
    /// on this tablet meanwhile must leave them ([`Inner::split_cleanup`]).
    pub merging_into: std::sync::atomic::AtomicBool,
    /// Reads and writes of the tablet since it was created (its load, which the cluster
    /// balances by).
    pub ops: AtomicU64,
}

/// No split watches the tablet.
pub(crate) const NO_SPLIT: u32 = u32::MAX;
/// Bytes of keys (and their list entries) a split notes at most while it copies: heap memory
/// outside the engine's budget, bounded by this; past it, the split's last step compares the
/// two tablets whole instead (see [`Inner::split_finish`]).
pub(crate) const SPLIT_DIRTY_BYTES_MAX: usize = 16 << 20;

/// Keys of the upper slots written while a split copies them.
#[derive(Default)]
pub struct SplitDirty {
    pub keys: Vec<Vec<u8>>,
    /// Heap bytes `keys` holds (keys and their `Vec` headers).
    pub bytes: usize,
    /// More than [`SPLIT_DIRTY_BYTES_MAX`] would have been noted: `keys` stopped growing.
    pub overflowed: bool,
}

/// Expiry times later than this (2^32 s after the epoch, in 2106) enter the expiry sum as this.
const EXPIRY_SUM_SECS_MAX: u64 = u32::MAX as u64;

impl Tablet {
    /// Counts a current object with expiry time `expire_at_ms` (0: none) in or out of
    /// `expiring_objects`. Caller holds the write lock.
    pub(crate) fn count_expiry(&self, expire_at_ms: u64, added: bool) {
        if expire_at_ms == 0 {
            return;
        }
        let secs = (expire_at_ms / 1000).min(EXPIRY_SUM_SECS_MAX);
        if added {
            self.expiring_objects.fetch_add(1, Ordering::Relaxed);
            self.expiring_sum_secs.fetch_add(secs, Ordering::Relaxed);
        } else {
            let was = self.expiring_objects.fetch_sub(1, Ordering::Relaxed);
            debug_assert!(was > 0, "an expiring object leaves that was never counted");
            self.expiring_sum_secs.fetch_sub(secs, Ordering::Relaxed);
        }
    }
}

/// How a superseded version must be kept (see `Inner::keep_for_snapshots`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Keep {
    /// No snapshot can read it: garbage at once.
    No,
    /// A snapshot may read it anywhere, by key or by scan: RETAINED with a HISTORIC reference.
    Indexed,
    /// Only scans that pinned its segment and have still to read it: RETAINED, without a reference.
    InPlace,
}

/// One record for [`Inner::restore_batch`]: a key with its value (None: a delete), original
/// version and expiry.
#[derive(Clone, Copy, Debug)]
pub struct RestoreItem<'a> {
    pub key: &'a [u8],
    pub value: Option<&'a [u8]>,
    pub version: Version,
    pub expire_at_ms: u64,
}

/// Items a batch restore installs under one hold of the tablet's lock (the cleaner and other
/// holders of the lock wait for at most this many installs).
pub const RESTORE_LOCK_ITEMS: usize = 64;
/// How many items ahead of the one it installs a batch restore prefetches the index bucket of
/// (as the bulk restore does).
const RESTORE_PREFETCH_AHEAD: usize = 8;

pub(crate) struct Inner {
    pub config: EngineConfig,
    pub pool: SegletPool,
    pub segments: SegmentTable,
    tablets: Box<[OnceLock<Box<Tablet>>]>,
    tablet_count: AtomicU32,
    tablet_create: Mutex<()>,
    routes: RwLock<HashMap<TableId, Arc<[AtomicU32]>>>,
    /// The engine clock: every write takes the next value as its version.
    pub clock: CachePadded<AtomicU64>,
    pub live_bytes: crate::stats::ShardedCounter,
    pub counters: Counters,
    pub shutdown: AtomicBool,
    pub cleaner_wake: Mutex<bool>,
    pub cleaner_cv: Condvar,
    pub memory_lock: Mutex<()>,
    pub memory_cv: Condvar,
    /// Completed cleaner passes, and whether the last one found nothing it could free.
    pub pass_seq: AtomicU64,
    pub last_pass_idle: AtomicBool,
    pub segment_capacity: usize,
    /// Bytes of memory outside the engine charged to its budget (`Engine::set_external_bytes`).
    pub external_bytes: AtomicU64,
    /// The tablets' hash-index bytes as last summed by `refresh_charge`.
    pub index_bytes: AtomicU64,
    /// Segments whose epoch grace period has passed; their seglets can go back to the pool.
    pub reclaimable: Arc<Mutex<Vec<u32>>>,
    /// Seglets of retired segments still waiting for their grace period.
    pub limbo_seglets: AtomicU64,
    /// Set when a writer's write failed with out-of-memory: the live and charged bytes then (-1
    /// when not full). Until a seglet comes free or those bytes drop (a delete, an overwrite by a
    /// smaller value, a smaller charge), further writes that need memory fail at once instead of
    /// each waiting for cleaner passes that can only squeeze segment tails.
    pub full_at: AtomicI64,
    /// Open snapshots (MVCC).
    pub snapshots: Snapshots,
    /// Bytes of RETAINED entries not yet reclaimed (included in `live_bytes`).
    pub retained_bytes: CachePadded<AtomicI64>,
    /// Set when a snapshot closes while retained bytes exist: the cleaner looks for segments that
    /// became sparse.
    pub retention_released: AtomicBool,
    /// Segments a scan (or a snapshot release) found mostly garbage: the cleaner compacts them next.
    pub sparse: Mutex<Vec<u32>>,
    /// Victims whose every live entry was relocated but that a scan pinned before they could be
    /// freed: they stay Cleaning (scans still read them; nothing in them is live) and are retired
    /// once unpinned.
    pub retire_when_unpinned: Mutex<Vec<u32>>,
    /// Spreads table scans over tablets: each scan starts at the next tablet, so concurrent scans
    /// of a table run different tablets' passes on different cores instead of queueing behind one.
    pub scan_rotation: AtomicU64,
    /// Optional per-table schemas (scans filter, project and aggregate by field).
    pub schemas: RwLock<HashMap<TableId, Arc<ramlog_query::Schema>>>,
    /// Told the key of every expired object the engine removes (`Engine::on_expired`).
    pub expired_observer: OnceLock<ExpiredObserver>,
}

/// A function told the key of each expired object the engine removes, with its table. It runs
/// under the tablet's write lock: it must be quick and must not call the engine.
pub type ExpiredObserver = Box<dyn Fn(TableId, &[u8]) + Send + Sync>;

/// A contiguous view of an entry: borrowed from the log, or gathered when it straddles seglets.
pub(crate) struct EntryBytes<'a> {
    pub header: Header,
    pub key: &'a [u8],
    pub value: &'a [u8],
}

impl Inner {
    pub fn new(config: EngineConfig) -> Result<Self, EngineError> {
        if config.segment_seglets == 0 || config.segment_seglets > 128 {
            return Err(EngineError::Config(format!(
                "segment_seglets must be 1..=128, got {}",
                config.segment_seglets
            )));
        }
        if config.key_size_max_bytes > entry::KEY_BYTES_FORMAT_MAX {
            return Err(EngineError::Config(format!(
                "key_size_max_bytes above {}",
                entry::KEY_BYTES_FORMAT_MAX
            )));
        }
        let segment_capacity = config.segment_seglets * SEGLET_BYTES;
        let largest_entry =
            HEADER_BYTES_MAX + config.key_size_max_bytes + config.value_size_max_bytes;
        if largest_entry > segment_capacity / 2 {
            return Err(EngineError::Config(format!(
                "the largest entry ({largest_entry} bytes) must fit twice in a segment ({segment_capacity} bytes)"
            )));
        }
        let seglets = (config.memory_bytes / SEGLET_BYTES as u64) as usize;
        // One full segment and 4 seglets, as RAMCloud's cleaner keeps, but no more than 1/64 of a
        // small budget (1 MiB of 64 MiB: passes are smaller there), and at least 1%.
        let reserve = config
            .cleaner_reserve_seglets
            .unwrap_or_else(|| {
                (config.segment_seglets + 4)
                    .min(seglets / 64)
                    .max(seglets / 100)
                    .max(8)
            })
            .min(seglets / 4);
        let pool = SegletPool::new(config.memory_bytes, reserve)
            .map_err(|e| EngineError::Config(e.to_string()))?;
        let segments = SegmentTable::new(pool.seglet_count());
        Ok(Inner {
            pool,
            segments,
            tablets: (0..TABLETS_MAX).map(|_| OnceLock::new()).collect(),
            tablet_count: AtomicU32::new(0),
            tablet_create: Mutex::new(()),
            routes: RwLock::new(HashMap::new()),
            clock: CachePadded::new(AtomicU64::new(0)),
            live_bytes: Default::default(),
            counters: Counters::default(),
            shutdown: AtomicBool::new(false),
            cleaner_wake: Mutex::new(false),
            cleaner_cv: Condvar::new(),
            memory_lock: Mutex::new(()),
            memory_cv: Condvar::new(),
            pass_seq: AtomicU64::new(0),
            last_pass_idle: AtomicBool::new(false),
            segment_capacity,
            external_bytes: AtomicU64::new(0),
            index_bytes: AtomicU64::new(0),
            reclaimable: Arc::new(Mutex::new(Vec::new())),
            limbo_seglets: AtomicU64::new(0),
            full_at: AtomicI64::new(-1),
            snapshots: Snapshots::default(),
            retained_bytes: CachePadded::new(AtomicI64::new(0)),
            retention_released: AtomicBool::new(false),
            sparse: Mutex::new(Vec::new()),
            retire_when_unpinned: Mutex::new(Vec::new()),
            scan_rotation: AtomicU64::new(0),
            schemas: RwLock::new(HashMap::new()),
            expired_observer: OnceLock::new(),
            config,
        })
    }

    pub fn total_bytes(&self) -> u64 {
        (self.pool.seglet_count() * SEGLET_BYTES) as u64
    }

    /// Bytes of the budget charged to memory outside the log: the hash indexes (as last summed)
    /// and the external charge.
    /// Live bytes plus the charge: what a delete or a smaller charge lowers.
    fn used_bytes(&self) -> i64 {
        (self.live_bytes.sum().max(0) as u64).saturating_add(self.charged_bytes()) as i64
    }

    pub fn charged_bytes(&self) -> u64 {
        self.index_bytes
            .load(Ordering::Relaxed)
            .saturating_add(self.external_bytes.load(Ordering::Relaxed))
    }

    /// What the log may use: the budget less the charge (0 when the charge exceeds it).
    pub fn log_capacity_bytes(&self) -> u64 {
        self.total_bytes().saturating_sub(self.charged_bytes())
    }

    /// Live bytes as a share of the log capacity (above 1 when the charge grew past what the
    /// log holds).
    pub fn utilisation(&self) -> f64 {
        self.live_bytes.sum().max(0) as f64 / self.log_capacity_bytes().max(1) as f64
    }

    /// The utilisation up to which overwrite loads are accepted: 90% of what the log capacity
    /// leaves once the cleaner's reserve and the heads' unwritten tails (half a seglet per tablet
    /// on average) are set aside. The last 10% is garbage the cleaner needs to work with (its
    /// write cost grows as 1 / (1 − u) of the segments it cleans). Above it writes may still be
    /// accepted (a single tablet in 1 GiB keeps up at 98%), but they may fail with out-of-memory.
    /// 64 MiB with 64 tablets: 0.85; 64 MiB with 256 tablets: 0.76 (each tablet's head takes a
    /// seglet of its own, 16 MiB in all, half of it unwritten on average).
    pub fn utilisation_limit(&self) -> f64 {
        let capacity = self.log_capacity_bytes() as f64;
        if capacity <= 0.0 {
            return 0.0;
        }
        let reserve = (self.pool.reserve_seglets() * SEGLET_BYTES) as f64;
        let head_tails = self.tablet_count() as f64 * SEGLET_BYTES as f64 / 2.0;
        (0.9 * (capacity - reserve - head_tails) / capacity).max(0.0)
    }

    /// Sums the tablets' hash-index bytes and charges them, with the external bytes, to the
    /// pool, in whole seglets rounded up. Writers call it whenever they take a seglet, and the
    /// cleaner thread on every round, so the charge follows index growth within a seglet of
    /// writes. Costs two atomic loads per tablet.
    pub fn refresh_charge(&self) {
        let index: u64 = (0..self.tablet_count())
            .filter_map(|id| self.tablet(id).ok())
            .map(|t| t.index.memory_bytes())
            .sum();
        self.index_bytes.store(index, Ordering::Relaxed);
        let seglets = self.charged_bytes().div_ceil(SEGLET_BYTES as u64);
        self.pool
            .set_charged_seglets(usize::try_from(seglets).unwrap_or(usize::MAX));
    }

    /// Sets the external charge (absolute) and wakes the cleaner if memory is now short.
    pub fn set_external_bytes(&self, bytes: u64) {
        self.external_bytes.store(bytes, Ordering::Relaxed);
        self.refresh_charge();
        self.wake_cleaner_if_needed();
    }

    /// The size, in seglets, of a head segment opened now: the budget's share for heads
    /// (1/16) split among the tablets, within 1..=`segment_seglets`.
    ///
    /// Only closed segments can be cleaned, and a head closes when it is full. With
    /// full-size heads, 64 tablets of 8 MiB heads hold 512 MiB: in a 256 MiB budget every byte
    /// ends up in heads that never fill, the cleaner finds nothing to clean, and writes fail at
    /// 40% utilisation. Sized this way, heads hold at most 1/16 of the budget (tablets created
    /// later make later heads smaller, and `append` closes an older head at the new size), and
    /// each keeps at most one partly written seglet. With one seglet per head (256 tablets in
    /// 64 MiB) the heads' unwritten tails average half a seglet per tablet: the utilisation
    /// limit counts them (docs/architecture.md, "Full memory").
    pub fn head_segment_seglets(&self) -> usize {
        let tablets = (self.tablet_count() as usize).max(1);
        (self.pool.seglet_count() / (HEAD_SHARE_DIVISOR * tablets))
            .clamp(1, self.config.segment_seglets)
    }

    pub fn tablet(&self, id: TabletId) -> Result<&Tablet, EngineError> {
        self.tablets
            .get(id as usize)
            .and_then(|t| t.get())
            .map(|t| &**t)
            .ok_or(EngineError::NoSuchTablet(id))
    }

    pub fn tablet_count(&self) -> u32 {
        self.tablet_count.load(Ordering::Acquire)
    }

    pub fn create_tablet(
        &self,
        table: TableId,
        first_slot: u16,
        last_slot: u16,
    ) -> Result<TabletId, EngineError> {
        self.create_tablet_with(table, first_slot, last_slot, false, true)
    }

    /// Creates a tablet, frozen or not, and routes its slots to it or leaves them where they
    /// are (a split routes them once the tablet is filled).
    fn create_tablet_with(
        &self,
        table: TableId,
        first_slot: u16,
        last_slot: u16,
        frozen: bool,
        route_now: bool,
    ) -> Result<TabletId, EngineError> {
        if first_slot > last_slot || last_slot >= SLOT_COUNT {
            return Err(EngineError::Config(format!(
                "bad slot range {first_slot}..={last_slot}"
            )));
        }
        let _g = self.tablet_create.lock();
        let id = self.tablet_count.load(Ordering::Acquire);
        if id as usize >= TABLETS_MAX {
            return Err(EngineError::TooManyTablets(TABLETS_MAX));
        }
        let tablet = Tablet {
            table,
            first_slot,
            last_slot: std::sync::atomic::AtomicU16::new(last_slot),
            index: HashIndex::new(),
            head: Mutex::new(None),
            scans: crate::scan::ScanQueue::default(),
            far_valid_to: Mutex::new(HashMap::new()),
            // Scans of this table already under way may come to this tablet too (its entries
            // may be old: a restore keeps their versions), so they wait for it like the others.
            scan_uncaptured: Mutex::new(self.snapshots.scan_snapshots_of(table)),
            expiring_objects: AtomicU64::new(0),
            expiring_sum_secs: AtomicU64::new(0),
            frozen: std::sync::atomic::AtomicBool::new(frozen),
            full_limit: AtomicU64::new(0),
            split_watch: AtomicU32::new(NO_SPLIT),
            merging_into: std::sync::atomic::AtomicBool::new(false),
            split_dirty: Mutex::new(SplitDirty::default()),
            ops: AtomicU64::new(0),
        };
        if self.tablets[id as usize].set(Box::new(tablet)).is_err() {
            return Err(EngineError::Config("tablet slot already taken".into()));
        }
        self.tablet_count.store(id + 1, Ordering::Release);
        if route_now {
            self.route(table, first_slot, last_slot, id);
        }
        Ok(id)
    }

    /// Routes `table`'s slots `first_slot..=last_slot` to tablet `id`.
    fn route(&self, table: TableId, first_slot: u16, last_slot: u16, id: TabletId) {
        let mut routes = self.routes.write();
        let route = routes.entry(table).or_insert_with(|| {
            (0..SLOT_COUNT)
                .map(|_| AtomicU32::new(u32::MAX))
                .collect::<Vec<_>>()
                .into()
        });
        for slot in first_slot..=last_slot {
            route[slot as usize].store(id, Ordering::Release);
        }
    }

    pub fn locate(&self, table: TableId, key: &[u8]) -> Option<TabletId> {
        let slot = key_slot(key);
        let routes = self.routes.read();
        let id = routes.get(&table)?[slot as usize].load(Ordering::Acquire);
        (id != u32::MAX).then_some(id)
    }

    /// Copies up to `len` bytes starting at `loc`, following the seglet chain.
    fn gather(&self, loc: Loc, len: usize, out: &mut Vec<u8>) {
        out.clear();
        let mut seglet = loc_seglet(loc);
        let mut off = loc_offset(loc);
        while out.len() < len && seglet != NO_SEGLET {
            // SAFETY: the caller holds an epoch guard or owns the segment, so the seglet is not reused.
            let tail = unsafe { self.pool.seglet_tail(seglet, off) };
            let n = tail.len().min(len - out.len());
            out.extend_from_slice(&tail[..n]);
            seglet = self.pool.next_seglet(seglet);
            off = 0;
        }
    }

    /// Starts loading the first bytes of the entry at `loc` (a hint: nothing is read).
    #[inline]
    pub fn prefetch_entry(&self, loc: Loc) {
        let ptr = self
            .pool
            .seglet_ptr(loc_seglet(loc))
            .wrapping_add(loc_offset(loc));
        #[cfg(target_arch = "x86_64")]
        // SAFETY: prefetching is a hint that never faults, whatever the address.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                ptr as *const i8,
            );
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = ptr;
    }

    /// Calls `f` with the entry at `loc` as contiguous slices. With `with_value` false the value
    /// slice may be empty (saves gathering large values when only the key is needed).
    /// The caller must hold an epoch guard or otherwise keep the segment alive.
    #[inline]
    pub fn with_entry<R>(
        &self,
        loc: Loc,
        with_value: bool,
        f: impl FnOnce(EntryBytes<'_>) -> R,
    ) -> Result<R, EngineError> {
        let seglet = loc_seglet(loc);
        let offset = loc_offset(loc);
        // SAFETY: guarded by the caller (see above).
        let tail = unsafe { self.pool.seglet_tail(seglet, offset) };
        let corrupt = |reason: String| EngineError::Corrupt {
            seglet,
            offset,
            reason,
        };
        // The fixed-size fast path reads the same bytes as `decode_header` (the fields, in order).
        let decoded = match tail.get(..HEADER_BYTES_MAX) {
            Some(b) => entry::decode_header_fast(b.try_into().expect("header-sized")),
            None => decode_header(tail),
        };
        let header = match decoded {
            Ok(h) => h,
            Err(entry::DecodeError::Truncated) => {
                let mut buf = Vec::with_capacity(HEADER_BYTES_MAX);
                self.gather(loc, HEADER_BYTES_MAX, &mut buf);
                decode_header(&buf).map_err(|e| corrupt(e.to_string()))?
            }
            Err(e) => return Err(corrupt(e.to_string())),
        };
        let hl = header.header_len as usize;
        let kl = header.key_len as usize;
        let vl = header.value_len as usize;
        let need = if with_value { hl + kl + vl } else { hl + kl };
        if need <= tail.len() {
            let key = &tail[hl..hl + kl];
            let value = if with_value {
                &tail[hl + kl..hl + kl + vl]
            } else {
                &[][..]
            };
            return Ok(f(EntryBytes { header, key, value }));
        }
        let mut buf = Vec::with_capacity(need);
        self.gather(loc, need, &mut buf);
        if buf.len() < need {
            return Err(corrupt("entry runs past the end of its segment".into()));
        }
        let key = &buf[hl..hl + kl];
        let value = if with_value {
            &buf[hl + kl..hl + kl + vl]
        } else {
            &[][..]
        };
        Ok(f(EntryBytes { header, key, value }))
    }

    #[inline]
    pub fn key_matches(&self, loc: Loc, key: &[u8]) -> bool {
        self.with_entry(loc, false, |e| e.key == key)
            .unwrap_or(false)
    }

    /// Hash of the key stored at `loc` (used by index splits).
    pub fn rehash(&self, loc: Loc) -> u64 {
        self.with_entry(loc, false, |e| hash_key(e.key))
            .unwrap_or(0)
    }

    /// Counts `len` bytes at `loc` as dead.
    pub fn mark_dead(&self, loc: Loc, len: usize) {
        let seg = self.pool.owner(loc_seglet(loc));
        debug_assert_ne!(seg, NO_SEGLET, "a referenced seglet has no owner");
        if seg != NO_SEGLET {
            self.segments
                .get(seg)
                .live_bytes
                .fetch_sub(len as i64, Ordering::Relaxed);
        }
        self.live_bytes.add(-(len as i64));
    }

    /// Lowers a segment's expiry bound for an object with expiry `expire_at_ms` (0: none).
    pub(crate) fn note_expiry(&self, segment: u32, expire_at_ms: u64) {
        if expire_at_ms != 0 {
            self.segments
                .get(segment)
                .expire_min_ms
                .fetch_min(expire_at_ms, Ordering::Release);
        }
    }

    pub fn mark_live(&self, segment: u32, len: usize) {
        self.segments
            .get(segment)
            .live_bytes
            .fetch_add(len as i64, Ordering::Relaxed);
        self.live_bytes.add(len as i64);
    }

    /// The first byte of the entry at `loc` (kind, flags and state bits), for atomic state changes.
    /// The caller keeps the entry's seglet alive (epoch guard, tablet lock, cleaner claim or pin).
    #[inline]
    pub fn entry_state(&self, loc: Loc) -> &AtomicU8 {
        // SAFETY: `loc` addresses a byte inside the pool mapping, which lives as long as `self`;
        // AtomicU8 has the size and alignment of u8; every concurrent access to this byte that may
        // race with a state change goes through an atomic.
        unsafe { AtomicU8::from_ptr(self.pool.seglet_ptr(loc_seglet(loc)).add(loc_offset(loc))) }
    }

    /// Overwrites `bytes` at `offset` inside the entry at `loc` (following its seglet chain).
    /// Only used for the CRC field of an entry that is becoming RETAINED, before the state bit
    /// that makes readers look at it is set. Caller holds the tablet's write lock.
    pub fn write_in_entry(&self, loc: Loc, offset: usize, bytes: &[u8]) {
        let mut at = self.advance(loc_seglet(loc), loc_offset(loc), offset);
        let mut rest = bytes;
        while !rest.is_empty() {
            let off = loc_offset(at);
            let n = rest.len().min(SEGLET_BYTES - off);
            // SAFETY: the bytes lie inside the entry, which the caller keeps alive; no reader
            // interprets them until the RETAINED bit is published afterwards with Release.
            unsafe { self.pool.write(loc_seglet(at), off, &rest[..n]) };
            rest = &rest[n..];
            if !rest.is_empty() {
                at = crate::index::make_loc(self.pool.next_seglet(loc_seglet(at)), 0);
            }
        }
    }

    /// The exclusive end of a RETAINED entry's validity.
    pub fn retained_valid_to(&self, tablet: &Tablet, header: &Header, key: &[u8]) -> u64 {
        match header.retained_valid_to() {
            Some(to) => to,
            None => tablet
                .far_valid_to
                .lock()
                .get(&(key.to_vec(), header.version))
                .copied()
                .unwrap_or(u64::MAX),
        }
    }

    /// Opens a snapshot at the current version (see `mvcc`).
    pub fn open_snapshot(self: &Arc<Inner>) -> crate::Snapshot {
        self.open_snapshot_of(None)
    }

    /// See [`crate::Engine::cut_snapshot`].
    pub fn cut_snapshot(
        self: &Arc<Inner>,
        hold: std::time::Duration,
    ) -> (crate::Snapshot, u64, u64) {
        let _creating = self.tablet_create.lock();
        let tablets: Vec<&Tablet> = (0..self.tablet_count())
            .filter_map(|id| self.tablet(id).ok())
            .collect();
        let heads: Vec<_> = tablets.iter().map(|t| t.head.lock()).collect();
        let from = unix_ns();
        let version = self.clock.load(Ordering::SeqCst);
        let entry = self.snapshots.register(
            version,
            self.counters.retained_total.load(Ordering::Relaxed),
            None,
        );
        std::thread::sleep(hold);
        let to = unix_ns();
        drop(heads);
        (crate::Snapshot::new(self.clone(), entry), from, to)
    }

    /// Opens a snapshot; with `scan_table`, one that only a single scan of that table reads
    /// through (see `SnapshotEntry::scan_table`).
    pub fn open_snapshot_of(self: &Arc<Inner>, scan_table: Option<TableId>) -> crate::Snapshot {
        let _creating = self.tablet_create.lock();
        let tablets: Vec<&Tablet> = (0..self.tablet_count())
            .filter_map(|id| self.tablet(id).ok())
            .collect();
        let heads: Vec<_> = tablets.iter().map(|t| t.head.lock()).collect();
        let version = self.clock.load(Ordering::SeqCst);
        let entry = self.snapshots.register(
            version,
            self.counters.retained_total.load(Ordering::Relaxed),
            scan_table,
        );
        if let Some(table) = scan_table {
            for t in tablets.iter().filter(|t| t.table == table) {
                t.scan_uncaptured.lock().push((version, entry.id));
            }
        }
        drop(heads);
        crate::Snapshot::new(self.clone(), entry)
    }

    /// Refuses (true) or takes again (false) writes to `tablet`. Once this returns true, every
    /// write the tablet took has been handed to the write observer.
    pub fn set_frozen(&self, tablet: TabletId, frozen: bool) -> Result<(), EngineError> {
        let t = self.tablet(tablet)?;
        let _head = t.head.lock();
        t.frozen.store(frozen, Ordering::Release);
        Ok(())
    }

    /// Refuses writes that would grow `tablet` (`limit` > 0: the limit its size reached, for
    /// the error), or takes them again (0).
    pub fn set_tablet_full(&self, tablet: TabletId, limit: u64) -> Result<(), EngineError> {
        self.tablet(tablet)?
            .full_limit
            .store(limit, Ordering::Release);
        Ok(())
    }

    /// Opens a single-scan snapshot for one scan of one tablet: as [`Inner::open_snapshot_of`],
    /// but only that tablet keeps superseded versions for it (until the scan has read the segment
    /// holding them); the table's other tablets keep nothing.
    pub fn open_snapshot_of_tablet(
        self: &Arc<Inner>,
        tablet: TabletId,
    ) -> Result<crate::Snapshot, EngineError> {
        self.open_snapshot_of_tablet_at(tablet, u64::MAX)
    }

    /// [`Inner::open_snapshot_of_tablet`] at `at` (or the clock if lower): for a tablet whose
    /// versions another server hands out (a mirror's), at the newest version applied to it, so
    /// that writes applied later (with higher versions) stay out of the scan.
    pub fn open_snapshot_of_tablet_at(
        self: &Arc<Inner>,
        tablet: TabletId,
        at: u64,
    ) -> Result<crate::Snapshot, EngineError> {
        let _creating = self.tablet_create.lock();
        let t = self.tablet(tablet)?;
        let head = t.head.lock();
        let version = self.clock.load(Ordering::SeqCst).min(at);
        let entry = self.snapshots.register(
            version,
            self.counters.retained_total.load(Ordering::Relaxed),
            Some(t.table),
        );
        t.scan_uncaptured.lock().push((version, entry.id));
        drop(head);
        Ok(crate::Snapshot::new(self.clone(), entry))
    }

    /// A single-scan snapshot is gone: no tablet of its table waits for its pass any more.
    pub fn forget_scan_snapshot(&self, entry: &crate::mvcc::SnapshotEntry) {
        for id in 0..self.tablet_count() {
            if let Ok(t) = self.tablet(id) {
                if Some(t.table) == entry.scan_table {
                    t.scan_uncaptured.lock().retain(|&(_, e)| e != entry.id);
                }
            }
        }
    }

    /// Whether a version `version` of an object in `tablet`, at `loc`, superseded now, must stay
    /// readable: a general snapshot may read it, or a single scan of this tablet's table that
    /// has not captured the tablet yet, or one whose pass has still to read its segment (the
    /// segment is pinned). A single scan never comes back to a segment it has read, and entries
    /// it has not captured are newer than it. Caller holds the tablet's write lock (pins are
    /// taken under it, and dropped under it).
    ///
    /// A version only pinned scans need is kept in place ([`Keep::InPlace`]): those scans read
    /// it where it is, and the cleaner cannot move it before they have.
    fn keep_for_snapshots(&self, tablet: &Tablet, loc: Loc, version: u64) -> Keep {
        if !self.snapshots.any_at_or_above(version) {
            return Keep::No;
        }
        if self.snapshots.general_at_or_above(version) {
            return Keep::Indexed;
        }
        if tablet
            .scan_uncaptured
            .lock()
            .iter()
            .any(|&(v, _)| v >= version)
        {
            return Keep::Indexed;
        }
        let seg = self.pool.owner(loc_seglet(loc));
        if seg == NO_SEGLET {
            Keep::Indexed
        } else if self.segments.get(seg).pins.load(Ordering::Acquire) > 0 {
            Keep::InPlace
        } else {
            Keep::No
        }
    }

    /// Bytes of superseded versions a snapshot may keep alive before it is too old.
    pub fn snapshot_retained_limit(&self) -> u64 {
        self.config
            .snapshot_max_retained_bytes
            .unwrap_or(self.total_bytes() / 8)
    }

    /// A snapshot closed while retained versions exist: have the cleaner look for sparse segments.
    pub fn note_retention_released(&self) {
        self.retention_released.store(true, Ordering::Release);
        if self.config.cleaner_threads > 0 {
            self.wake_cleaner();
        }
    }

    /// Drops every pin of a pin set.
    pub fn unpin_all(&self, pins: &PinSet) {
        let segments: Vec<u32> = std::mem::take(&mut *pins.segments.lock());
        for seg in segments {
            self.unpin(seg);
        }
    }

    /// Drops one scan pin of a segment.
    pub fn unpin(&self, seg: u32) {
        let slot = self.segments.get(seg);
        let tablet = self.tablet(slot.tablet.load(Ordering::Relaxed)).ok();
        let _head = tablet.map(|t| t.head.lock());
        if slot.pins.fetch_sub(1, Ordering::AcqRel) == 1 {
            slot.pinned_upto.store(0, Ordering::Release);
        }
    }

    /// Marks a key's current object replaced at version `by`, by a new object at `new_loc` or by a
    /// delete (None). If an open snapshot may still read it, it stays readable: RETAINED, with its
    /// valid-to in the entry and a HISTORIC index reference. Otherwise it is garbage at once.
    /// Caller holds the tablet's write lock.
    pub fn supersede(
        &self,
        tablet: &Tablet,
        hash: u64,
        key: &[u8],
        current: (SlotRef, Loc, Header),
        new_loc: Option<Loc>,
        by: Version,
    ) {
        let (slot, old_loc, h) = current;
        tablet.count_expiry(h.expire_at_ms, false);
        let len = h.total_len();
        let keep = if by > h.version {
            self.keep_for_snapshots(tablet, old_loc, h.version)
        } else {
            Keep::No
        };
        let delta = by.saturating_sub(h.version);
        if keep == Keep::InPlace && delta < VALID_TO_FAR as u64 {
            // Only scans that pinned this segment and have still to read it need this version:
            // it stays readable where it is (RETAINED, valid-to in the entry) and is garbage for
            // everything else at once, without a HISTORIC reference to add now and remove later.
            self.write_in_entry(old_loc, h.crc_offset(), &(delta as u32).to_le_bytes());
            self.entry_state(old_loc)
                .fetch_or(STATE_SUPERSEDED | STATE_RETAINED, Ordering::Release);
            match new_loc {
                Some(loc) => tablet.index.replace(slot, hash, loc),
                None => tablet.index.remove_and_compact(slot, hash),
            }
            self.mark_dead(old_loc, len);
            self.counters
                .retained_total
                .fetch_add(len as u64, Ordering::Relaxed);
            self.counters.kept_in_place.fetch_add(1, Ordering::Relaxed);
        } else if keep != Keep::No {
            // `slot` may move when the new reference goes in; the old one is found again below.
            let _ = slot;
            let field = if delta < VALID_TO_FAR as u64 {
                delta as u32
            } else {
                tablet
                    .far_valid_to
                    .lock()
                    .insert((key.to_vec(), h.version), by);
                VALID_TO_FAR
            };
            self.write_in_entry(old_loc, h.crc_offset(), &field.to_le_bytes());
            self.entry_state(old_loc)
                .fetch_or(STATE_SUPERSEDED | STATE_RETAINED, Ordering::Release);
            // The new reference goes in first, so a reader never finds the key missing; the insert
            // may move references (a split), so the old one is found again before it turns HISTORIC.
            if let Some(loc) = new_loc {
                tablet.index.insert(hash, loc, |l| self.rehash(l));
            }
            if let Some(old_slot) = tablet.index.find_loc(hash, old_loc) {
                tablet.index.make_historic(old_slot);
            }
            let seg = self.pool.owner(loc_seglet(old_loc));
            if seg != NO_SEGLET {
                let slot = self.segments.get(seg);
                slot.retained_bytes.fetch_add(len as i64, Ordering::Relaxed);
                slot.retained_valid_to_max.fetch_max(by, Ordering::Relaxed);
            }
            self.retained_bytes.fetch_add(len as i64, Ordering::Relaxed);
            self.counters
                .retained_total
                .fetch_add(len as u64, Ordering::Relaxed);
        } else {
            self.entry_state(old_loc)
                .fetch_or(STATE_SUPERSEDED, Ordering::Release);
            match new_loc {
                Some(loc) => tablet.index.replace(slot, hash, loc),
                None => tablet.index.remove_and_compact(slot, hash),
            }
            self.mark_dead(old_loc, len);
        }
    }

    /// Removes a RETAINED entry no snapshot needs any more: its HISTORIC reference, its bytes and
    /// its far valid-to. Caller holds the tablet's write lock.
    pub fn drop_retained(
        &self,
        tablet: &Tablet,
        slot: SlotRef,
        hash: u64,
        loc: Loc,
        h: &Header,
        key: &[u8],
    ) {
        debug_assert!(tablet.index.is_historic(slot));
        tablet.index.remove_and_compact(slot, hash);
        let len = h.total_len() as i64;
        self.mark_dead(loc, len as usize);
        let seg = self.pool.owner(loc_seglet(loc));
        if seg != NO_SEGLET {
            self.segments
                .get(seg)
                .retained_bytes
                .fetch_sub(len, Ordering::Relaxed);
        }
        self.retained_bytes.fetch_sub(len, Ordering::Relaxed);
        self.counters
            .retained_reclaimed
            .fetch_add(len as u64, Ordering::Relaxed);
        if h.retained_valid_to().is_none() {
            tablet
                .far_valid_to
                .lock()
                .remove(&(key.to_vec(), h.version));
        }
    }

    /// Appends `parts` (one or more whole entries, `total` bytes) to a tablet's head segment.
    pub(crate) fn append(
        &self,
        head: &mut Option<SegmentWriter>,
        tablet: TabletId,
        parts: &[&[u8]],
        total: usize,
        class: AllocClass,
    ) -> Result<(Loc, u32), AppendError> {
        // An entry larger than a head segment gets a head of its own size (entries are at most
        // half a full segment, a multi-put at most a full one).
        let head_seglets = self
            .head_segment_seglets()
            .max(total.div_ceil(SEGLET_BYTES));
        loop {
            if head.is_none() {
                let created = self.clock.load(Ordering::Relaxed);
                self.refresh_charge();
                *head = Some(SegmentWriter::open(
                    &self.segments,
                    &self.pool,
                    class,
                    tablet,
                    created,
                    head_seglets,
                )?);
            }
            let writer = head.as_mut().expect("opened above");
            // A head opened before tablets were added closes at today's head size.
            writer.limit_capacity(head_seglets);
            if writer.needs_seglet(total) {
                self.refresh_charge();
            }
            match writer.reserve(&self.segments, &self.pool, total, class) {
                Ok(()) => {
                    let loc = writer.position();
                    for p in parts {
                        writer.write(&self.pool, p);
                    }
                    writer.publish(&self.segments);
                    return Ok((loc, writer.segment));
                }
                Err(AppendError::SegmentFull) => {
                    let full = head.take().expect("present");
                    if full.used() == 0 {
                        full.abandon(&self.segments, &self.pool);
                    } else {
                        full.close(&self.segments);
                    }
                    self.wake_cleaner_if_needed();
                }
                Err(AppendError::NoMemory) => return Err(AppendError::NoMemory),
            }
        }
    }

    /// Whether open snapshots keep memory the cleaner could otherwise free: retained versions, or
    /// segments their scans pin (with the versions kept in place in them).
    fn snapshots_hold_memory(&self) -> bool {
        self.retained_bytes.load(Ordering::Relaxed) > 0 || self.snapshots.any_pinning()
    }

    pub fn out_of_memory(&self) -> EngineError {
        EngineError::OutOfMemory {
            live_bytes: self.live_bytes.sum().max(0) as u64,
            total_bytes: self.total_bytes(),
        }
    }

    /// Blocks (without any tablet lock) until the cleaner may have freed memory. Fails with
    /// out-of-memory when the deadline passes or the cleaner reports nothing left to clean, and
    /// a writer's write at once when no cleaning could make room (`log_cannot_grow`).
    /// `started` is when this write first had to wait (set on the first call).
    pub(crate) fn wait_for_memory(
        &self,
        started: &mut Option<Instant>,
        class: AllocClass,
    ) -> Result<(), EngineError> {
        let started = *started.get_or_insert_with(Instant::now);
        /// Counts the wait and its time, on every way out.
        struct Timed<'a>(&'a Inner, Instant);
        impl Drop for Timed<'_> {
            fn drop(&mut self) {
                let c = &self.0.counters;
                c.memory_waits.fetch_add(1, Ordering::Relaxed);
                c.memory_wait_ns
                    .fetch_add(self.1.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        }
        let _timed = Timed(self, Instant::now());
        let seq_at_start = self.pass_seq.load(Ordering::Acquire);
        // Snapshots must not hold memory until writes fail: past half the wait, or when the
        // cleaner has nothing left, the oldest snapshot is released first.
        // Segments already freed but waiting for readers' grace period are memory on its way back,
        // not memory a snapshot holds: while there are any, an idle cleaner is no reason.
        let give_up_soon = started.elapsed() >= Duration::from_millis(self.config.oom_wait_ms / 2)
            || (self.last_pass_idle.load(Ordering::Acquire)
                && self.limbo_seglets.load(Ordering::Relaxed) == 0);
        if give_up_soon
            && self.snapshots_hold_memory()
            && self
                .snapshots
                .release_oldest(self, "memory is full and it kept superseded versions alive")
        {
            // Its versions are garbage now: let the cleaner get at them, then retry the write.
            self.retention_released.store(true, Ordering::Release);
            if self.config.cleaner_threads == 0 {
                crate::cleaner::run_pass(self, true);
                crate::cleaner::drain_limbo(self);
            } else {
                self.wake_cleaner();
                let mut g = self.memory_lock.lock();
                self.memory_cv.wait_for(&mut g, Duration::from_millis(5));
            }
            return Ok(());
        }
        // Before failing a write, release a snapshot that keeps memory (then retry).
        let fail = || -> Result<(), EngineError> {
            if self.snapshots_hold_memory()
                && self
                    .snapshots
                    .release_oldest(self, "memory is full and it kept superseded versions alive")
            {
                self.retention_released.store(true, Ordering::Release);
                self.wake_cleaner();
                return Ok(());
            }
            if class == AllocClass::Writer {
                self.full_at.store(self.used_bytes(), Ordering::Release);
            }
            Err(self.out_of_memory())
        };
        self.refresh_charge();
        // Full already, and nothing freed since: fail at once (as a Redis at `maxmemory` does).
        if class == AllocClass::Writer {
            let full_at = self.full_at.load(Ordering::Acquire);
            if full_at >= 0 {
                if self.pool.writer_free_count() == 0 && self.used_bytes() >= full_at {
                    return fail();
                }
                self.full_at.store(-1, Ordering::Release);
            }
        }
        // A delete waits for the cleaner as before: its tombstone needs little, and the cleaner
        // may free it from the reserve's share of garbage.
        if class == AllocClass::Writer && self.log_cannot_grow() {
            return fail();
        }
        if self.config.cleaner_threads == 0 {
            let mut progressed = crate::cleaner::run_pass(self, true);
            if !progressed && crate::cleaner::close_wasteful_heads(self) > 0 {
                progressed = crate::cleaner::run_pass(self, true);
            }
            crate::cleaner::drain_limbo(self);
            if !progressed && self.pool.writer_free_count() == 0 {
                return fail();
            }
            return Ok(());
        }
        self.wake_cleaner();
        {
            let mut g = self.memory_lock.lock();
            self.memory_cv.wait_for(&mut g, Duration::from_millis(5));
        }
        if self.pool.writer_free_count() > 0 {
            return Ok(());
        }
        let passes_since = self
            .pass_seq
            .load(Ordering::Acquire)
            .saturating_sub(seq_at_start);
        let nothing_pending = self.limbo_seglets.load(Ordering::Relaxed) == 0;
        if passes_since >= 2 && nothing_pending && self.last_pass_idle.load(Ordering::Acquire) {
            return fail();
        }
        if started.elapsed() >= Duration::from_millis(self.config.oom_wait_ms) {
            return fail();
        }
        Ok(())
    }

    /// Whether no cleaning can make room for a writer: the live bytes, the charge and the
    /// cleaner's reserve fill the budget (the charge grew, or live data did).
    fn log_cannot_grow(&self) -> bool {
        let live = self.live_bytes.sum().max(0) as u64;
        let reserve = (self.pool.reserve_seglets() * SEGLET_BYTES) as u64;
        live.saturating_add(self.charged_bytes())
            .saturating_add(reserve)
            >= self.total_bytes()
    }

    pub fn wake_cleaner(&self) {
        let mut w = self.cleaner_wake.lock();
        *w = true;
        self.cleaner_cv.notify_all();
    }

    pub fn wake_cleaner_if_needed(&self) {
        if self.config.cleaner_threads > 0
            && (crate::cleaner::memory_low(self) || crate::cleaner::recycling_wanted(self))
        {
            self.wake_cleaner();
        }
    }

    /// The entry limits of this engine (`ramlog_common::limits`: the one definition that the
    /// node's admission and the backups' decoders share).
    pub fn entry_limits(&self) -> ramlog_common::EntryLimits {
        ramlog_common::EntryLimits {
            key_max_bytes: self.config.key_size_max_bytes,
            value_max_bytes: self.config.value_size_max_bytes,
        }
    }

    pub(crate) fn check_sizes(&self, key: &[u8], value: &[u8]) -> Result<(), EngineError> {
        Ok(self.entry_limits().check(key.len(), value.len())?)
    }

    /// Points a key's index reference at a newly appended object: replaces the current reference
    /// (counting the old entry dead) or inserts a new one. Caller holds the tablet's write lock.
    #[allow(clippy::too_many_arguments)]
    fn point_index_at(
        &self,
        tablet: &Tablet,
        hash: u64,
        key: &[u8],
        current: Option<(SlotRef, Loc, Header)>,
        loc: Loc,
        version: Version,
        expire_at_ms: u64,
    ) {
        tablet.count_expiry(expire_at_ms, true);
        match current {
            Some(c) => self.supersede(tablet, hash, key, c, Some(loc), version),
            None => tablet.index.insert(hash, loc, |l| self.rehash(l)),
        }
    }

    /// Looks a key up for a writer: the slot, the location and the entry's header, ignoring expired objects
    /// only when `include_expired` is false (they are still returned so they can be replaced).
    fn find(&self, tablet: &Tablet, hash: u64, key: &[u8]) -> Option<(SlotRef, Loc, Header)> {
        // The header of the matching entry is kept from the key comparison (one decode, not two).
        let mut matched: Option<(Loc, Header)> = None;
        let (slot, loc) = tablet.index.lookup(hash, |loc| {
            self.with_entry(loc, false, |e| {
                let hit = e.key == key;
                if hit {
                    matched = Some((loc, e.header));
                }
                hit
            })
            .unwrap_or(false)
        })?;
        let header = match matched {
            Some((at, h)) if at == loc => h,
            _ => self.with_entry(loc, false, |e| e.header).ok()?,
        };
        Some((slot, loc, header))
    }

    /// A writer's `find` under the tablet lock, given `early`, the result of `find` before the lock
    /// was taken (with the caller's epoch guard already pinned): the index probe and the key
    /// comparison, a cache miss each, then happen while other writers may hold the lock. Keeps
    /// `early` when its slot still holds the same current reference (nothing can change an entry's
    /// key, and its state bits are read again), and looks again otherwise. A lock held for less
    /// time also leaves less to wait for when its holder is descheduled.
    #[inline]
    fn find_locked(
        &self,
        tablet: &Tablet,
        hash: u64,
        key: &[u8],
        early: Option<(SlotRef, Loc, Header)>,
    ) -> Option<(SlotRef, Loc, Header)> {
        match early {
            Some((slot, loc, mut header)) if tablet.index.holds_current(slot, hash, loc) => {
                header.state =
                    self.entry_state(loc).load(Ordering::Acquire) & crate::entry::STATE_MASK;
                Some((slot, loc, header))
            }
            _ => self.find(tablet, hash, key),
        }
    }

    fn object_at(&self, loc: Loc) -> Option<Object> {
        self.with_entry(loc, true, |e| Object {
            value: e.value.to_vec(),
            version: e.header.version,
            expire_at_ms: e.header.expire_at_ms,
        })
        .ok()
    }

    /// Reads a key's current object through `f`, without copying when the entry is contiguous.
    pub fn read<R>(
        &self,
        tablet: TabletId,
        key: &[u8],
        f: impl FnOnce(&[u8], Version, u64) -> R,
    ) -> Result<Option<R>, EngineError> {
        let tablet = self.tablet(tablet)?;
        tablet.ops.fetch_add(1, Ordering::Relaxed);
        let hash = hash_key(key);
        let _guard = epoch::pin();
        let Some((_, loc)) = tablet.index.lookup(hash, |loc| self.key_matches(loc, key)) else {
            return Ok(None);
        };
        self.with_entry(loc, true, |e| {
            let mut now = None;
            if expired(e.header.expire_at_ms, &mut now) {
                None
            } else {
                Some(f(e.value, e.header.version, e.header.expire_at_ms))
            }
        })
    }

    /// The one write path: `build` decides, from the current object, what to write (or fails).
    fn write_one<'v>(
        &self,
        tablet_id: TabletId,
        key: &[u8],
        mut decide: impl FnMut(Option<(&Header, Loc)>) -> Result<WriteAction<'v>, EngineError>,
    ) -> Result<WriteResult, EngineError> {
        let tablet = self.tablet(tablet_id)?;
        tablet.ops.fetch_add(1, Ordering::Relaxed);
        let hash = hash_key(key);
        let mut started = None;
        loop {
            let guard = epoch::pin();
            let early = self.find(tablet, hash, key);
            let mut head = tablet.head.lock();
            if tablet.frozen.load(Ordering::Acquire) {
                return Err(EngineError::Frozen);
            }
            let mut now = None;
            let current = self.find_locked(tablet, hash, key, early);
            let visible = current
                .as_ref()
                .filter(|(_, _, h)| !expired(h.expire_at_ms, &mut now));
            let old_object = |want: bool| -> Option<Object> {
                if want {
                    visible.and_then(|(_, loc, _)| self.object_at(*loc))
                } else {
                    None
                }
            };
            let action = decide(visible.map(|(_, loc, h)| (h, *loc)))?;
            let (kind, value, body_crc, expire_at_ms, return_old) = match action {
                WriteAction::Put {
                    value,
                    body_crc,
                    expire_at_ms,
                    return_old,
                } => {
                    let full = tablet.full_limit.load(Ordering::Acquire);
                    if full > 0
                        && visible.is_none_or(|(_, _, h)| value.len() > h.value_len as usize)
                    {
                        return Err(EngineError::TabletFull { limit_bytes: full });
                    }
                    (KIND_OBJECT, value, body_crc, expire_at_ms, return_old)
                }
                WriteAction::Delete => {
                    if visible.is_none() {
                        // Nothing to delete; an expired leftover is removed quietly (a snapshot taken
                        // before it expired may keep it).
                        if let Some(c) = current {
                            let by = self.clock.load(Ordering::Relaxed) + 1;
                            self.supersede(tablet, hash, key, c, None, by);
                        }
                        return Ok(WriteResult {
                            version: None,
                            old: None,
                        });
                    }
                    (KIND_TOMBSTONE, Cow::Borrowed(&[][..]), None, 0, false)
                }
                WriteAction::Nothing { return_old } => {
                    return Ok(WriteResult {
                        version: None,
                        old: old_object(return_old),
                    });
                }
            };
            let old = old_object(return_old);
            let version = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
            let mut header = [0u8; HEADER_BYTES_MAX];
            let body_crc = body_crc.unwrap_or_else(|| entry::body_crc(key, &value));
            let hl = entry::encode_header_with_body_crc(
                &mut header,
                kind,
                version,
                key,
                &value,
                expire_at_ms,
                body_crc,
            );
            let total = hl + key.len() + value.len();
            debug_assert_eq!(
                total,
                encoded_len(kind, version, key.len(), value.len(), expire_at_ms)
            );
            let class = if kind == KIND_TOMBSTONE {
                AllocClass::Delete
            } else {
                AllocClass::Writer
            };
            let (loc, segment) = match self.append(
                &mut head,
                tablet_id,
                &[&header[..hl], key, &value],
                total,
                class,
            ) {
                Ok(placed) => placed,
                Err(AppendError::NoMemory) => {
                    drop(head);
                    drop(guard);
                    self.wait_for_memory(&mut started, class)?;
                    continue;
                }
                Err(AppendError::SegmentFull) => {
                    unreachable!("append retries on a new segment")
                }
            };
            self.note_for_split(tablet, key);
            count_unit_logged();
            // The observer (replication) takes the write before readers can see it: a reader that
            // finds it can then wait for whatever the observer holds of it.
            if let Some(obs) = &self.config.write_observer {
                let value = (kind == KIND_OBJECT).then_some(&value[..]);
                obs.on_writes(
                    tablet_id,
                    &[LoggedWrite {
                        version,
                        key,
                        value,
                        expire_at_ms,
                    }],
                );
            }
            self.counters.new_bytes.add(total as i64);
            if kind == KIND_OBJECT {
                self.mark_live(segment, total);
                self.note_expiry(segment, expire_at_ms);
                self.point_index_at(tablet, hash, key, current, loc, version, expire_at_ms);
            } else {
                // A tombstone records the delete in the tablet's version-ordered log; nothing in the
                // master replays it, so its bytes are dead from the start.
                self.counters
                    .tombstone_bytes
                    .fetch_add(total as u64, Ordering::Relaxed);
                let c = current.expect("deletes only reach here for a visible key");
                self.supersede(tablet, hash, key, c, None, version);
            }
            return Ok(WriteResult {
                version: Some(version),
                old,
            });
        }
    }

    pub fn put(
        &self,
        tablet: TabletId,
        key: &[u8],
        value: &[u8],
        opts: &PutOptions,
    ) -> Result<PutOutcome, EngineError> {
        self.check_sizes(key, value)?;
        // Checksummed before the write lock is taken: the lock is held only for what needs it.
        let body_crc = entry::body_crc(key, value);
        let mut failed = false;
        let result = self.write_one(tablet, key, |current| {
            let ok = match opts.condition {
                Condition::None => true,
                Condition::IfAbsent => current.is_none(),
                Condition::IfExists => current.is_some(),
                Condition::IfVersion(v) => current.map(|(h, _)| h.version) == Some(v),
            };
            if !ok {
                failed = true;
                return Ok(WriteAction::Nothing { return_old: true });
            }
            let expire_at_ms = if opts.keep_ttl {
                current.map(|(h, _)| h.expire_at_ms).unwrap_or(0)
            } else {
                opts.expire_at_ms
            };
            Ok(WriteAction::Put {
                value: Cow::Borrowed(value),
                body_crc: Some(body_crc),
                expire_at_ms,
                return_old: opts.return_old,
            })
        })?;
        if failed {
            return Err(EngineError::ConditionFailed {
                current: if opts.return_old { result.old } else { None },
            });
        }
        Ok(PutOutcome {
            version: result.version.expect("a put writes"),
            old: result.old,
        })
    }

    pub fn delete(
        &self,
        tablet: TabletId,
        key: &[u8],
        condition: Condition,
    ) -> Result<Option<Version>, EngineError> {
        self.check_sizes(key, &[])?;
        let mut failed = false;
        let result = self.write_one(tablet, key, |current| {
            let ok = match condition {
                Condition::None | Condition::IfExists => true,
                Condition::IfAbsent => current.is_none(),
                Condition::IfVersion(v) => current.map(|(h, _)| h.version) == Some(v),
            };
            if !ok {
                failed = true;
                return Ok(WriteAction::Nothing { return_old: false });
            }
            Ok(WriteAction::Delete)
        })?;
        if failed {
            return Err(EngineError::ConditionFailed { current: None });
        }
        Ok(result.version)
    }

    pub fn increment(
        &self,
        tablet: TabletId,
        key: &[u8],
        delta: i64,
    ) -> Result<(i64, Version), EngineError> {
        self.check_sizes(key, b"")?;
        let mut new_value = 0i64;
        let result = self.write_one(tablet, key, |current| {
            let (old, expire_at_ms) = match current {
                None => (0i64, 0u64),
                Some((h, loc)) => {
                    let parsed = self.with_entry(loc, true, |e| parse_redis_i64(e.value))?;
                    (parsed.ok_or(EngineError::NotAnInteger)?, h.expire_at_ms)
                }
            };
            new_value = old
                .checked_add(delta)
                .ok_or(EngineError::IncrementOverflow)?;
            Ok(WriteAction::Put {
                value: Cow::Owned(new_value.to_string().into_bytes()),
                body_crc: None,
                expire_at_ms,
                return_old: false,
            })
        })?;
        Ok((new_value, result.version.expect("an increment writes")))
    }

    pub fn set_expiry(
        &self,
        tablet: TabletId,
        key: &[u8],
        expire_at_ms: u64,
    ) -> Result<Option<Version>, EngineError> {
        self.check_sizes(key, b"")?;
        let result = self.write_one(tablet, key, |current| match current {
            None => Ok(WriteAction::Nothing { return_old: false }),
            Some((_, loc)) => {
                let value = self.with_entry(loc, true, |e| e.value.to_vec())?;
                Ok(WriteAction::Put {
                    value: Cow::Owned(value),
                    body_crc: None,
                    expire_at_ms,
                    return_old: false,
                })
            }
        })?;
        Ok(result.version)
    }

    /// Writes several objects of one tablet as one unit: one version, one append, all or nothing.
    pub fn multi_put(
        &self,
        tablet_id: TabletId,
        items: &[(&[u8], &[u8])],
    ) -> Result<Version, EngineError> {
        self.multi_put_if(tablet_id, items, &[])
    }

    /// [`Self::multi_put`] if every item's condition holds (`conditions[i]` for `items[i]`;
    /// missing ones are [`Condition::None`]), checked under the tablet's write lock; nothing is
    /// written otherwise ([`EngineError::ConditionFailed`]).
    pub fn multi_put_if(
        &self,
        tablet_id: TabletId,
        items: &[(&[u8], &[u8])],
        conditions: &[Condition],
    ) -> Result<Version, EngineError> {
        let writes: Vec<MultiWrite<'_>> = items
            .iter()
            .enumerate()
            .map(|(i, (key, value))| MultiWrite {
                key,
                op: MultiOp::Put {
                    value,
                    expire_at_ms: Some(0),
                },
                condition: conditions.get(i).copied().unwrap_or_default(),
            })
            .collect();
        let version = self.multi_write_if(tablet_id, &writes)?;
        Ok(version.expect("a multi-put writes every item"))
    }

    /// Puts, deletes and checks of several distinct keys of one tablet as one unit
    /// ([`crate::Engine::multi_write_if`]).
    pub fn multi_write_if(
        &self,
        tablet_id: TabletId,
        items: &[MultiWrite<'_>],
    ) -> Result<Option<Version>, EngineError> {
        let tablet = self.tablet(tablet_id)?;
        for item in items {
            match item.op {
                MultiOp::Put { value, .. } => self.check_sizes(item.key, value)?,
                MultiOp::Delete | MultiOp::Check => self.check_sizes(item.key, b"")?,
            }
        }
        let puts = items.iter().any(|i| matches!(i.op, MultiOp::Put { .. }));
        let hashes: Vec<u64> = items.iter().map(|i| hash_key(i.key)).collect();
        let mut current = Vec::with_capacity(items.len());
        let mut written: Vec<(usize, u8, u64)> = Vec::with_capacity(items.len());
        let mut started = None;
        loop {
            let guard = epoch::pin();
            // Each key's current object, looked up before the lock (see `find_locked`).
            current.clear();
            current.extend(
                items
                    .iter()
                    .zip(&hashes)
                    .map(|(i, &hash)| self.find(tablet, hash, i.key)),
            );
            let mut head = tablet.head.lock();
            if tablet.frozen.load(Ordering::Acquire) {
                return Err(EngineError::Frozen);
            }
            let full = tablet.full_limit.load(Ordering::Acquire);
            if full > 0 && puts {
                return Err(EngineError::TabletFull { limit_bytes: full });
            }
            let mut now = None;
            written.clear();
            for (i, item) in items.iter().enumerate() {
                let found = self.find_locked(tablet, hashes[i], item.key, current[i].take());
                current[i] = found;
                let visible = current[i]
                    .as_ref()
                    .filter(|(_, _, h)| !expired(h.expire_at_ms, &mut now))
                    .map(|(_, _, h)| (h.version, h.expire_at_ms));
                let ok = match item.condition {
                    Condition::None => true,
                    Condition::IfAbsent => visible.is_none(),
                    Condition::IfExists => visible.is_some(),
                    Condition::IfVersion(v) => visible.map(|(version, _)| version) == Some(v),
                };
                if !ok {
                    return Err(EngineError::ConditionFailed { current: None });
                }
                match item.op {
                    MultiOp::Put { expire_at_ms, .. } => {
                        let expire =
                            expire_at_ms.unwrap_or_else(|| visible.map_or(0, |(_, expire)| expire));
                        written.push((i, KIND_OBJECT, expire));
                    }
                    MultiOp::Delete if visible.is_some() => {
                        written.push((i, KIND_TOMBSTONE, 0));
                    }
                    MultiOp::Delete | MultiOp::Check => {}
                }
            }
            if written.is_empty() {
                return Ok(None);
            }
            let version = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
            let mut bytes = Vec::new();
            let mut offsets = Vec::with_capacity(written.len());
            for &(i, kind, expire) in &written {
                let key = items[i].key;
                let value = match items[i].op {
                    MultiOp::Put { value, .. } => value,
                    _ => &[][..],
                };
                let mut header = [0u8; HEADER_BYTES_MAX];
                let hl = encode_header(&mut header, kind, version, key, value, expire);
                offsets.push((bytes.len(), hl + key.len() + value.len()));
                bytes.extend_from_slice(&header[..hl]);
                bytes.extend_from_slice(key);
                bytes.extend_from_slice(value);
            }
            if bytes.len() > self.segment_capacity {
                return Err(EngineError::BatchTooLarge {
                    len: bytes.len(),
                    max: self.segment_capacity,
                });
            }
            let class = if puts {
                AllocClass::Writer
            } else {
                AllocClass::Delete
            };
            let (start, segment) =
                match self.append(&mut head, tablet_id, &[&bytes], bytes.len(), class) {
                    Ok(placed) => placed,
                    Err(AppendError::NoMemory) => {
                        drop(head);
                        drop(guard);
                        self.wait_for_memory(&mut started, class)?;
                        continue;
                    }
                    Err(AppendError::SegmentFull) => {
                        unreachable!("append retries on a new segment")
                    }
                };
            for &(i, _, _) in &written {
                self.note_for_split(tablet, items[i].key);
            }
            if !written.is_empty() {
                count_unit_logged();
            }
            // As in `write`: the observer first, then the index.
            if let Some(obs) = &self.config.write_observer {
                let records: Vec<LoggedWrite<'_>> = written
                    .iter()
                    .map(|&(i, kind, expire)| LoggedWrite {
                        version,
                        key: items[i].key,
                        value: match items[i].op {
                            MultiOp::Put { value, .. } if kind == KIND_OBJECT => Some(value),
                            _ => None,
                        },
                        expire_at_ms: expire,
                    })
                    .collect();
                obs.on_writes(tablet_id, &records);
            }
            self.counters.new_bytes.add(bytes.len() as i64);
            let start_seglet = loc_seglet(start);
            let start_offset = loc_offset(start);
            for (&(i, kind, expire), &(off, len)) in written.iter().zip(&offsets) {
                let key = items[i].key;
                // The items before this one may have moved references (an insert splits a
                // bucket, a removal shortens a chain): find the key's again (cheap when its slot
                // still holds it).
                let now_current = self.find_locked(tablet, hashes[i], key, current[i].take());
                if kind == KIND_OBJECT {
                    let loc = self.advance(start_seglet, start_offset, off);
                    self.mark_live(segment, len);
                    self.note_expiry(segment, expire);
                    self.point_index_at(tablet, hashes[i], key, now_current, loc, version, expire);
                } else {
                    // As a single delete's tombstone: dead from the start.
                    self.counters
                        .tombstone_bytes
                        .fetch_add(len as u64, Ordering::Relaxed);
                    let c = now_current.expect("a delete is written for a visible key");
                    self.supersede(tablet, hashes[i], key, c, None, version);
                }
            }
            return Ok(Some(version));
        }
    }

    /// The location `delta` bytes after (seglet, offset) within one segment.
    fn advance(&self, mut seglet: u32, offset: usize, delta: usize) -> Loc {
        let mut pos = offset + delta;
        while pos >= SEGLET_BYTES {
            seglet = self.pool.next_seglet(seglet);
            pos -= SEGLET_BYTES;
        }
        crate::index::make_loc(seglet, pos)
    }

    /// See [`crate::Engine::reserve_for_restore`]: true if the tablet was empty (its index is
    /// grown for `expected_objects` when that is above 0).
    pub fn reserve_for_restore(
        &self,
        tablet: TabletId,
        expected_objects: u64,
    ) -> Result<bool, EngineError> {
        let t = self.tablet(tablet)?;
        let _head = t.head.lock();
        let empty = t.index.len() == 0 && t.index.historic_len() == 0;
        if empty && expected_objects > 0 {
            t.index.reserve(expected_objects, |l| self.rehash(l));
        }
        Ok(empty)
    }

    /// Installs a replayed record with its original version; keeps whichever version is newer.
    pub fn restore(
        &self,
        tablet: TabletId,
        key: &[u8],
        value: Option<&[u8]>,
        version: Version,
        expire_at_ms: u64,
    ) -> Result<(), EngineError> {
        self.restore_batch(
            tablet,
            &[RestoreItem {
                key,
                value,
                version,
                expire_at_ms,
            }],
        )
    }

    /// [`Inner::restore`] for each item, in order: the tablet is looked up once and its lock
    /// taken once per [`RESTORE_LOCK_ITEMS`] items, and the index bucket of the item
    /// [`RESTORE_PREFETCH_AHEAD`] ahead is prefetched, so that the lookups' misses overlap (a
    /// mirror applies each replicated unit this way). Every item is checked before any is
    /// installed; an item that finds no memory waits for it, as a write does, and the batch goes
    /// on from there.
    pub fn restore_batch(
        &self,
        tablet: TabletId,
        items: &[RestoreItem<'_>],
    ) -> Result<(), EngineError> {
        self.restore_items(tablet, items, false)
    }

    /// [`Inner::restore_batch`] with `keep_expired`: an object whose expiry has passed is
    /// installed as any other (reads take it as absent, and expiry removes it), so that it still
    /// hides older versions of its key that arrive after it (a replay that hands over versions
    /// in no order); without it, it only removes an older object already there.
    pub fn restore_items(
        &self,
        tablet: TabletId,
        items: &[RestoreItem<'_>],
        keep_expired: bool,
    ) -> Result<(), EngineError> {
        for it in items {
            self.check_sizes(it.key, it.value.unwrap_or(b""))?;
        }
        let Some(newest) = items.iter().map(|it| it.version).max() else {
            return Ok(());
        };
        self.clock.fetch_max(newest, Ordering::Relaxed);
        let tablet_ref = self.tablet(tablet)?;
        // One item (a lone restore) needs no table of hashes to prefetch from.
        let hashes: Vec<u64> = if items.len() > 1 {
            items.iter().map(|it| hash_key(it.key)).collect()
        } else {
            Vec::new()
        };
        for &h in hashes.iter().take(RESTORE_PREFETCH_AHEAD) {
            tablet_ref.index.prefetch(h);
        }
        let mut started = None;
        let mut now = None;
        let mut i = 0;
        'locked: while i < items.len() {
            let guard = epoch::pin();
            let mut head = tablet_ref.head.lock();
            let end = (i + RESTORE_LOCK_ITEMS).min(items.len());
            while i < end {
                // Two stages: the bucket of the item far ahead, and the entries that the (now
                // cached) bucket of the item half as far ahead names, whose keys its lookup
                // compares.
                if let Some(&ahead) = hashes.get(i + RESTORE_PREFETCH_AHEAD) {
                    tablet_ref.index.prefetch(ahead);
                }
                if let Some(&near) = hashes.get(i + RESTORE_PREFETCH_AHEAD / 2) {
                    tablet_ref
                        .index
                        .tag_matches(near, |loc| self.prefetch_entry(loc));
                }
                let it = &items[i];
                let key = it.key;
                let hash = hashes.get(i).copied().unwrap_or_else(|| hash_key(key));
                let current = self.find(tablet_ref, hash, key);
                if current.as_ref().is_some_and(|c| c.2.version >= it.version) {
                    i += 1;
                    continue;
                }
                // A record that expired while it was away is replayed as the delete it has become.
                let Some(value) = it
                    .value
                    .filter(|_| keep_expired || !expired(it.expire_at_ms, &mut now))
                else {
                    if let Some(c) = current {
                        self.supersede(tablet_ref, hash, key, c, None, it.version);
                    }
                    i += 1;
                    continue;
                };
                let mut header = [0u8; HEADER_BYTES_MAX];
                let hl = encode_header(
                    &mut header,
                    KIND_OBJECT,
                    it.version,
                    key,
                    value,
                    it.expire_at_ms,
                );
                let total = hl + key.len() + value.len();
                let (loc, segment) = match self.append(
                    &mut head,
                    tablet,
                    &[&header[..hl], key, value],
                    total,
                    AllocClass::Writer,
                ) {
                    Ok(placed) => placed,
                    Err(AppendError::NoMemory) => {
                        drop(head);
                        drop(guard);
                        self.wait_for_memory(&mut started, AllocClass::Writer)?;
                        continue 'locked;
                    }
                    Err(AppendError::SegmentFull) => {
                        unreachable!("append retries on a new segment")
                    }
                };
                self.counters.new_bytes.add(total as i64);
                self.mark_live(segment, total);
                self.note_expiry(segment, it.expire_at_ms);
                self.point_index_at(
                    tablet_ref,
                    hash,
                    key,
                    current,
                    loc,
                    it.version,
                    it.expire_at_ms,
                );
                i += 1;
            }
        }
        Ok(())
    }

    pub fn scan_keys(
        &self,
        tablet: TabletId,
        cursor: u64,
        count: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<u64, EngineError> {
        let tablet = self.tablet(tablet)?;
        let _guard = epoch::pin();
        let mut now = None;
        // A tablet that split holds copies of its former upper slots until they are cleaned up.
        let last = tablet.last_slot.load(Ordering::Acquire);
        let mine = |key: &[u8]| last == SLOT_COUNT - 1 || key_slot(key) <= last;
        let next = tablet.index.scan(cursor, count.max(1), |loc| {
            if let Ok(Some(k)) = self.with_entry(loc, false, |e| {
                (!expired(e.header.expire_at_ms, &mut now) && mine(e.key)).then(|| e.key.to_vec())
            }) {
                out.push(k);
            }
        });
        Ok(next)
    }

    /// Removes every current object of `tablet` without writing tombstones, as a replayed delete
    /// does (see `restore`): the tablet's log is in memory only, so nothing reads it after a
    /// crash. The objects' bytes become garbage for the cleaner at once; versions an open
    /// snapshot may read stay readable through it until it closes. Writers of the tablet may
    /// run meanwhile (what they write after a key's removal stays). Returns how many objects
    /// were removed.
    pub fn clear_tablet(&self, tablet: TabletId) -> Result<u64, EngineError> {
        /// Keys collected per index walk step (copied out, then removed one by one).
        const KEYS_PER_STEP: usize = 256;
        /// A removal compacts its bucket chain, which may move a reference behind the walk's
        /// cursor: passes repeat until none is left, at most this many times.
        const PASSES_MAX: usize = 8;
        let t = self.tablet(tablet)?;
        let mut removed = 0u64;
        let mut keys: Vec<Vec<u8>> = Vec::with_capacity(KEYS_PER_STEP);
        for _ in 0..PASSES_MAX {
            let mut cursor = 0;
            loop {
                keys.clear();
                {
                    let _guard = epoch::pin();
                    cursor = t.index.scan(cursor, KEYS_PER_STEP, |loc| {
                        if let Ok(key) = self.with_entry(loc, false, |e| e.key.to_vec()) {
                            keys.push(key);
                        }
                    });
                }
                for key in &keys {
                    let hash = hash_key(key);
                    let _guard = epoch::pin();
                    let _head = t.head.lock();
                    if let Some(current) = self.find(t, hash, key) {
                        let by = self.clock.load(Ordering::Relaxed) + 1;
                        self.supersede(t, hash, key, current, None, by);
                        removed += 1;
                    }
                }
                if cursor == 0 {
                    break;
                }
            }
            if t.index.len() == 0 {
                break;
            }
        }
        self.wake_cleaner_if_needed();
        Ok(removed)
    }

    /// Notes `key` for a split that copies its slot (caller holds `tablet`'s write lock).
    #[inline]
    fn note_for_split(&self, tablet: &Tablet, key: &[u8]) {
        let at = tablet.split_watch.load(Ordering::Relaxed);
        if at == NO_SPLIT || u32::from(key_slot(key)) < at {
            return;
        }
        let mut dirty = tablet.split_dirty.lock();
        let cost = key.len() + std::mem::size_of::<Vec<u8>>();
        if dirty.bytes + cost <= SPLIT_DIRTY_BYTES_MAX {
            dirty.keys.push(key.to_vec());
            dirty.bytes += cost;
        } else {
            dirty.overflowed = true;
        }
    }

    /// A split's first step: checks the split point, creates the tablet of the upper slots
    /// (frozen, not routed) and starts noting the keys of those slots that writers change from
    /// here on. Returns the new tablet and the old one's last slot. The caller then copies the
    /// upper slots' objects at a snapshot taken after this (`Engine::split_prepare`).
    pub fn split_begin(&self, tablet: TabletId, at: u16) -> Result<(TabletId, u16), EngineError> {
        let t = self.tablet(tablet)?;
        let last = t.last_slot.load(Ordering::Acquire);
        if at <= t.first_slot || at > last {
            return Err(EngineError::Config(format!(
                "cannot split tablet {}..={} at slot {at}",
                t.first_slot, last
            )));
        }
        let _head = t.head.lock();
        if t.split_watch.load(Ordering::Acquire) != NO_SPLIT {
            return Err(EngineError::Config(
                "the tablet is splitting already".into(),
            ));
        }
        let new = self.create_tablet_with(t.table, at, last, true, false)?;
        *t.split_dirty.lock() = SplitDirty::default();
        t.split_watch.store(u32::from(at), Ordering::Release);
        Ok((new, last))
    }

    /// Ends a split that will not happen: stops the noting and empties the new tablet (its id
    /// stays used, empty and unrouted).
    pub fn split_cancel(&self, tablet: TabletId, new: TabletId) {
        if let Ok(t) = self.tablet(tablet) {
            let _head = t.head.lock();
            t.split_watch.store(NO_SPLIT, Ordering::Release);
            *t.split_dirty.lock() = SplitDirty::default();
        }
        let _ = self.clear_tablet(new);
    }

    /// A split's last step, with `tablet` frozen (no writer changes it): the keys written since
    /// the copy's snapshot are brought over (the newer version wins; a key gone from `tablet` goes
    /// from the new tablet too), then the upper slots are routed to the new tablet (`routed` is
    /// called at that moment) and the old tablet's range ends below them. The copies still in
    /// the old tablet are unreachable from here on; [`Inner::split_cleanup`] removes them.
    pub fn split_finish(
        &self,
        tablet: TabletId,
        new: TabletId,
        routed: &mut dyn FnMut(TabletId),
    ) -> Result<u64, EngineError> {
        let t = self.tablet(tablet)?;
        let n = self.tablet(new)?;
        let at = t.split_watch.load(Ordering::Acquire);
        if at == NO_SPLIT || !t.frozen.load(Ordering::Acquire) {
            return Err(EngineError::Config(
                "a split ends on a frozen tablet whose copy has begun".into(),
            ));
        }
        let at = at as u16;
        let moves = |key: &[u8]| key_slot(key) >= at;
        let dirty = {
            let _head = t.head.lock();
            t.split_watch.store(NO_SPLIT, Ordering::Release);
            std::mem::take(&mut *t.split_dirty.lock())
        };
        let mut keys = dirty.keys;
        if dirty.overflowed {
            // Too many writes to note: every key of either tablet is compared.
            keys = self.index_keys(t, &moves);
            keys.extend(self.index_keys(n, &|_| true));
        }
        keys.sort_unstable();
        keys.dedup();
        let redone = keys.len() as u64;
        for key in &keys {
            let current = self.read(tablet, key, |v, version, expire_at_ms| {
                (v.to_vec(), version, expire_at_ms)
            })?;
            match current {
                Some((value, version, expire_at_ms)) => {
                    self.restore(new, key, Some(&value), version, expire_at_ms)?
                }
                None => {
                    self.remove_key(n, key);
                }
            }
        }
        self.route(t.table, at, n.last_slot.load(Ordering::Acquire), new);
        t.last_slot.store(at - 1, Ordering::Release);
        routed(new);
        Ok(redone)
    }

    /// After a split: removes from `tablet` the objects of the slots past its range (the copies
    /// its split made) without tombstones, as [`Inner::clear_tablet`] does; writers of its own
    /// slots may run meanwhile. Returns how many were removed.
    pub fn split_cleanup(&self, tablet: TabletId) -> Result<u64, EngineError> {
        const PASSES_MAX: usize = 8;
        let t = self.tablet(tablet)?;
        // Read again under the write lock for each key: a merge may extend the range, or copy
        // the next tablet's objects above it, while this runs; those stay.
        let outside = |key: &[u8]| {
            !t.merging_into.load(Ordering::Acquire)
                && key_slot(key) > t.last_slot.load(Ordering::Acquire)
        };
        let mut removed = 0;
        for _ in 0..PASSES_MAX {
            let keys = self.index_keys(t, &outside);
            if keys.is_empty() {
                break;
            }
            for key in &keys {
                removed += u64::from(self.remove_key_if(t, key, &outside));
            }
        }
        self.wake_cleaner_if_needed();
        Ok(removed)
    }

    /// A merge's first step: checks that `upper` follows `lower` (same table, adjacent slots)
    /// and starts noting the keys of `upper` that writers change from here on. The caller then
    /// copies `upper`'s objects into `lower` at a snapshot taken after this
    /// (`Engine::merge_prepare`).
    pub fn merge_begin(&self, lower: TabletId, upper: TabletId) -> Result<(), EngineError> {
        let l = self.tablet(lower)?;
        let u = self.tablet(upper)?;
        let l_last = l.last_slot.load(Ordering::Acquire);
        if l.table != u.table || u32::from(l_last) + 1 != u32::from(u.first_slot) {
            return Err(EngineError::Config(format!(
                "tablets {}..={l_last} and {}..={} are not adjacent tablets of one table",
                l.first_slot,
                u.first_slot,
                u.last_slot.load(Ordering::Acquire)
            )));
        }
        for t in [l, u] {
            if t.split_watch.load(Ordering::Acquire) != NO_SPLIT {
                return Err(EngineError::Config(
                    "a tablet splits or merges already".into(),
                ));
            }
        }
        if l.merging_into.swap(true, Ordering::AcqRel) {
            return Err(EngineError::Config(
                "a tablet is merged into already".into(),
            ));
        }
        let _head = u.head.lock();
        *u.split_dirty.lock() = SplitDirty::default();
        u.split_watch
            .store(u32::from(u.first_slot), Ordering::Release);
        Ok(())
    }

    /// A merge's last step, both tablets frozen: the keys written to `upper` since the copy's
    /// snapshot are redone in `lower`, then `upper`'s slots are routed to `lower` (`routed` is
    /// called at that moment) and `lower`'s range ends where `upper`'s did. `upper` keeps its
    /// objects, unreachable, until the caller clears it.
    pub fn merge_finish(
        &self,
        lower: TabletId,
        upper: TabletId,
        routed: &mut dyn FnMut(),
    ) -> Result<u64, EngineError> {
        let l = self.tablet(lower)?;
        let u = self.tablet(upper)?;
        if u.split_watch.load(Ordering::Acquire) != u32::from(u.first_slot)
            || !l.frozen.load(Ordering::Acquire)
            || !u.frozen.load(Ordering::Acquire)
        {
            return Err(EngineError::Config(
                "a merge ends on frozen tablets whose copy has begun".into(),
            ));
        }
        let dirty = {
            let _head = u.head.lock();
            u.split_watch.store(NO_SPLIT, Ordering::Release);
            std::mem::take(&mut *u.split_dirty.lock())
        };
        let first = u.first_slot;
        let mut keys = dirty.keys;
        if dirty.overflowed {
            keys = self.index_keys(u, &|_| true);
            keys.extend(self.index_keys(l, &|k| key_slot(k) >= first));
        }
        keys.sort_unstable();
        keys.dedup();
        let redone = keys.len() as u64;
        for key in &keys {
            let current = self.read(upper, key, |v, version, expire_at_ms| {
                (v.to_vec(), version, expire_at_ms)
            })?;
            match current {
                Some((value, version, expire_at_ms)) => {
                    self.restore(lower, key, Some(&value), version, expire_at_ms)?
                }
                None => {
                    self.remove_key(l, key);
                }
            }
        }
        let last = u.last_slot.load(Ordering::Acquire);
        self.route(l.table, first, last, lower);
        {
            let _head = l.head.lock();
            l.last_slot.store(last, Ordering::Release);
            l.merging_into.store(false, Ordering::Release);
        }
        routed();
        Ok(redone)
    }

    /// Ends a merge that will not happen: stops the noting in `upper` and removes the copies
    /// from `lower` (whose range never changed).
    pub fn merge_cancel(&self, lower: TabletId, upper: TabletId) -> Result<u64, EngineError> {
        if let Ok(u) = self.tablet(upper) {
            let _head = u.head.lock();
            u.split_watch.store(NO_SPLIT, Ordering::Release);
            *u.split_dirty.lock() = SplitDirty::default();
        }
        if let Ok(l) = self.tablet(lower) {
            l.merging_into.store(false, Ordering::Release);
        }
        self.split_cleanup(lower)
    }

    /// The keys of `tablet`'s index that `keep` accepts (one walk, in steps).
    fn index_keys(&self, tablet: &Tablet, keep: &dyn Fn(&[u8]) -> bool) -> Vec<Vec<u8>> {
        const KEYS_PER_STEP: usize = 256;
        let mut out = Vec::new();
        let mut cursor = 0;
        loop {
            let _guard = epoch::pin();
            cursor = tablet.index.scan(cursor, KEYS_PER_STEP, |loc| {
                if let Ok(Some(key)) =
                    self.with_entry(loc, false, |e| keep(e.key).then(|| e.key.to_vec()))
                {
                    out.push(key);
                }
            });
            if cursor == 0 {
                return out;
            }
        }
    }

    /// Removes `key`'s current object from `tablet` without a tombstone; true if there was one.
    fn remove_key(&self, tablet: &Tablet, key: &[u8]) -> bool {
        self.remove_key_if(tablet, key, &|_| true)
    }

    /// [`Inner::remove_key`] if `still` holds for `key` under the tablet's write lock.
    fn remove_key_if(&self, tablet: &Tablet, key: &[u8], still: &dyn Fn(&[u8]) -> bool) -> bool {
        let hash = hash_key(key);
        let _guard = epoch::pin();
        let _head = tablet.head.lock();
        if !still(key) {
            return false;
        }
        match self.find(tablet, hash, key) {
            Some(current) => {
                let by = self.clock.load(Ordering::Relaxed) + 1;
                self.supersede(tablet, hash, key, current, None, by);
                true
            }
            None => false,
        }
    }

    /// Live bytes of each tablet (by tablet id): the live bytes of the segments its log holds,
    /// headers and versions kept for snapshots included. One walk over the segment table.
    pub fn live_bytes_by_tablet(&self) -> Vec<u64> {
        let mut out = vec![0u64; self.tablet_count() as usize];
        for (_, slot) in self.segments.iter() {
            match slot.state() {
                crate::segment::SegmentState::Free | crate::segment::SegmentState::Retired => {}
                _ => {
                    let tablet = slot.tablet.load(Ordering::Relaxed) as usize;
                    let live = slot.live_bytes.load(Ordering::Relaxed).max(0) as u64;
                    if let Some(sum) = out.get_mut(tablet) {
                        *sum += live;
                    }
                }
            }
        }
        out
    }

    /// Live bytes the log can still take before it reaches its utilisation limit: what a load
    /// (a restore) may add and leave the cleaner the garbage it needs. 0 when past it.
    pub fn room_bytes(&self) -> u64 {
        let limit = self.utilisation_limit() * self.log_capacity_bytes() as f64;
        let live = self.live_bytes.sum().max(0) as u64;
        (limit as u64).saturating_sub(live)
    }

    pub fn tablet_infos(&self) -> Vec<TabletInfo> {
        (0..self.tablet_count())
            .filter_map(|id| {
                let t = self.tablet(id).ok()?;
                Some(TabletInfo {
                    id,
                    table: t.table,
                    first_slot: t.first_slot,
                    last_slot: t.last_slot.load(Ordering::Acquire),
                    objects: t.index.len(),
                    ops: t.ops.load(Ordering::Relaxed),
                })
            })
            .collect()
    }

    /// Returns retired segments whose grace period ended to the pool; returns how many.
    pub fn release_reclaimable(&self) -> usize {
        let ready: Vec<u32> = std::mem::take(&mut *self.reclaimable.lock());
        for &segment in &ready {
            let seglets = self
                .segments
                .get(segment)
                .seglet_count
                .load(Ordering::Relaxed) as u64;
            self.segments.release(&self.pool, segment);
            self.limbo_seglets.fetch_sub(seglets, Ordering::Relaxed);
        }
        ready.len()
    }

    pub fn stats(&self) -> crate::EngineStats {
        let c = &self.counters;
        let mut histogram = [0u64; 10];
        let mut segments = 0u64;
        let mut head_waste_bytes = 0u64;
        for (_, slot) in self.segments.iter() {
            match slot.state() {
                crate::segment::SegmentState::Free | crate::segment::SegmentState::Retired => {}
                crate::segment::SegmentState::Open => {
                    segments += 1;
                    let allocated =
                        slot.seglet_count.load(Ordering::Relaxed) as u64 * SEGLET_BYTES as u64;
                    let used = slot.used_bytes.load(Ordering::Acquire) as u64;
                    head_waste_bytes += allocated.saturating_sub(used);
                }
                crate::segment::SegmentState::Closed => {
                    segments += 1;
                    let cap =
                        slot.seglet_count.load(Ordering::Relaxed) as f64 * SEGLET_BYTES as f64;
                    let u = slot.live_bytes.load(Ordering::Relaxed).max(0) as f64 / cap.max(1.0);
                    histogram[((u * 10.0) as usize).min(9)] += 1;
                }
                _ => segments += 1,
            }
        }
        let mut objects = 0;
        let mut index_bytes = 0;
        let mut retained_versions = 0;
        let mut expiring_objects = 0u64;
        let mut expiring_sum_secs = 0u128;
        for id in 0..self.tablet_count() {
            if let Ok(t) = self.tablet(id) {
                expiring_objects += t.expiring_objects.load(Ordering::Relaxed);
                expiring_sum_secs += t.expiring_sum_secs.load(Ordering::Relaxed) as u128;
                objects += t.index.len();
                retained_versions += t.index.historic_len();
                index_bytes += t.index.memory_bytes();
            }
        }
        let total = self.total_bytes();
        let live = self.live_bytes.sum().max(0) as u64;
        let external_bytes = self.external_bytes.load(Ordering::Relaxed);
        let log_capacity_bytes = total
            .saturating_sub(index_bytes)
            .saturating_sub(external_bytes);
        let seglet_bytes = SEGLET_BYTES as u64;
        let new_bytes = c.new_bytes.sum() as u64;
        let copied = c.cleaner_copied_bytes.load(Ordering::Relaxed);
        crate::EngineStats {
            total_bytes: total,
            live_bytes: live,
            utilisation: live as f64 / log_capacity_bytes.max(1) as f64,
            utilisation_limit: self.utilisation_limit(),
            external_bytes,
            log_capacity_bytes,
            log_used_bytes: (self.pool.seglet_count() - self.pool.free_count()) as u64
                * seglet_bytes,
            log_resident_bytes: self.pool.resident_bytes() as u64,
            head_waste_bytes,
            total_seglets: self.pool.seglet_count() as u64,
            free_seglets: self.pool.free_count() as u64,
            untouched_seglets: self.pool.fresh_count() as u64,
            reserve_seglets: self.pool.reserve_seglets() as u64,
            segments,
            objects,
            expiring_objects,
            expiring_mean_expire_at_ms: if expiring_objects == 0 {
                0
            } else {
                (expiring_sum_secs * 1000 / expiring_objects as u128) as u64
            },
            tablets: self.tablet_count() as u64,
            index_bytes,
            new_bytes,
            tombstone_bytes: c.tombstone_bytes.load(Ordering::Relaxed),
            cleaner_copied_bytes: copied,
            cleaner_freed_bytes: c.cleaner_freed_bytes.load(Ordering::Relaxed),
            write_cost: if new_bytes == 0 {
                1.0
            } else {
                (new_bytes + copied) as f64 / new_bytes as f64
            },
            compaction_passes: c.compaction_passes.load(Ordering::Relaxed),
            combined_passes: c.combined_passes.load(Ordering::Relaxed),
            compaction_failures: c.compaction_failures.load(Ordering::Relaxed),
            heads_closed: c.heads_closed.load(Ordering::Relaxed),
            segments_cleaned: c.segments_cleaned.load(Ordering::Relaxed),
            expired_reclaimed: c.expired_reclaimed.load(Ordering::Relaxed),
            segment_utilisation_histogram: histogram,
            version_clock: self.clock.load(Ordering::Relaxed),
            retained_bytes: self.retained_bytes.load(Ordering::Relaxed).max(0) as u64,
            retained_versions,
            kept_in_place_versions: c.kept_in_place.load(Ordering::Relaxed),
            retained_reclaimed_bytes: c.retained_reclaimed.load(Ordering::Relaxed),
            snapshots_open: self.snapshots.open_count() as u64,
            snapshots_too_old: c.snapshots_too_old.load(Ordering::Relaxed),
            scan_passes: c.scan_passes.load(Ordering::Relaxed),
            scan_queries: c.scan_queries.load(Ordering::Relaxed),
            scan_sparse_segments: c.scan_sparse_segments.load(Ordering::Relaxed),
            memory_waits: c.memory_waits.load(Ordering::Relaxed),
            memory_wait_secs: c.memory_wait_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }
}

pub(crate) enum WriteAction<'v> {
    Put {
        /// The caller's bytes, or bytes the decision computed (an increment's result).
        value: Cow<'v, [u8]>,
        /// `entry::body_crc(key, value)` when the caller computed it before the lock.
        body_crc: Option<u32>,
        expire_at_ms: u64,
        return_old: bool,
    },
    Delete,
    Nothing {
        return_old: bool,
    },
}

pub(crate) struct WriteResult {
    version: Option<Version>,
    old: Option<Object>,
}

#[cfg(test)]
mod tests {
    use crate::segment::SegmentState;
    use crate::{Engine, EngineConfig, PutOptions};

    /// A head opened when the engine had one tablet may grow to 1/16 of the budget; once tablets
    /// are added, it closes at the smaller size when it next needs a seglet.
    #[test]
    fn heads_shrink_to_a_share_of_the_budget_when_tablets_are_added() {
        let e = Engine::new(EngineConfig {
            memory_bytes: 64 << 20,
            cleaner_threads: 0,
            ..Default::default()
        })
        .unwrap();
        let inner = &e.inner;
        let t = e.create_tablet(1, 0, 16383).unwrap();
        assert_eq!(inner.head_segment_seglets(), 1024 / 16);
        let put = |i: u32| {
            e.put(
                t,
                format!("k{i}").as_bytes(),
                &[1u8; 1000],
                &PutOptions::default(),
            )
            .unwrap();
        };
        // About four seglets of entries: one head segment.
        for i in 0..250 {
            put(i);
        }
        let head = |t| {
            let g = inner.tablet(t).unwrap().head.lock();
            let w = g.as_ref().expect("a head");
            (w.segment, w.seglet_count())
        };
        let (first, seglets) = head(t);
        assert!(seglets >= 3, "{seglets} seglets");
        for i in 0..63u16 {
            e.create_tablet(2, i * 256, i * 256 + 255).unwrap();
        }
        assert_eq!(inner.head_segment_seglets(), 1);
        // The next seglet the head needs is not taken: the head closes and a new one opens.
        let mut i = 250;
        while head(t).0 == first {
            put(i);
            i += 1;
            assert!(i < 400, "the old head kept growing");
        }
        let old = inner.segments.get(first);
        assert_eq!(old.state(), SegmentState::Closed);
        assert_eq!(
            old.seglet_count.load(std::sync::atomic::Ordering::Relaxed) as usize,
            seglets
        );
        // New heads are one seglet long.
        for j in i..i + 200 {
            put(j);
            assert_eq!(head(t).1, 1);
        }
        for j in 0..i + 200 {
            assert!(e.get(t, format!("k{j}").as_bytes()).unwrap().is_some());
        }
    }
}
