//! ramlog's master memory: log-structured storage for a server's tablets (RAMCloud's design).
//!
//! What it owns: a fixed memory budget cut into 64 KiB seglets, of which the hash indexes and an
//! external charge (memory the server holds for data elsewhere) are deducted; one log per tablet
//! made of segments of up to 128 seglets, head segments sized so that all tablets' heads hold at
//! most 1/16 of the budget; per-tablet hash indexes whose references are the only pointers to objects;
//! the two-level cleaner (compaction and cost-benefit combined cleaning) running beside readers and
//! writers; epoch-based reclamation of cleaned memory.
//!
//! What it hides: entry layout (docs/formats.md), seglet chains and straddling entries, index growth
//! (linear hashing, no stop-the-world rehash), cleaner scheduling and its memory reserve.
//!
//! The interface: [`Engine`] with get / put (conditional, with expiry) / delete / increment /
//! atomic multi-put per tablet, each write returning its version; versions come from one engine-wide
//! clock, so they grow per key across delete and re-create. A [`WriteObserver`] sees every tablet's
//! writes in version order (for replication and persistence). When memory is really full, writes fail
//! with [`EngineError::OutOfMemory`]; reads keep working.

mod bulk;
pub use bulk::BulkRestore;
mod cleaner;
mod config;
mod engine;
pub mod entry;
mod error;
mod index;
mod mvcc;
mod pool;
mod scan;
mod segment;
mod stats;

pub use config::{Balancer, EngineConfig};
pub use engine::{units_logged_on_this_thread, unix_ns, ExpiredObserver, RestoreItem, TABLETS_MAX};
pub use error::EngineError;
pub use mvcc::Snapshot;
pub use pool::SEGLET_BYTES;
pub use ramlog_common::{TableId, Version};
/// Scan queries, schemas and values (the `ramlog-query` crate), at their earlier path.
pub use ramlog_query as query;
pub use scan::ScanCursor;
pub use stats::EngineStats;

use engine::Inner;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

/// Index of a tablet inside one engine.
pub type TabletId = u32;

/// Receives every tablet's writes in version order, one call per atomic unit (a multi-put is one
/// call with all its records). Called under the tablet's write lock, before the writes become
/// visible to readers (a reader that sees a write can rely on the observer having it): it must not
/// block for long.
pub trait WriteObserver: Send + Sync {
    fn on_writes(&self, tablet: TabletId, records: &[LoggedWrite<'_>]);
}

/// One write as the observer sees it.
#[derive(Debug, Clone, Copy)]
pub struct LoggedWrite<'a> {
    pub version: Version,
    pub key: &'a [u8],
    /// None for a delete.
    pub value: Option<&'a [u8]>,
    /// Unix milliseconds; 0 means no expiry.
    pub expire_at_ms: u64,
}

/// An object as read: its value, version and expiry (unix ms, 0 = none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Object {
    pub value: Vec<u8>,
    pub version: Version,
    pub expire_at_ms: u64,
}

/// A split whose copy is made ([`Engine::split_prepare`]), to finish or cancel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitCopy {
    /// The tablet that splits, and the new one of its slots `at..=last`.
    pub tablet: TabletId,
    pub new: TabletId,
    pub at: u16,
    pub last: u16,
    /// Objects the copy put in the new tablet.
    pub objects: u64,
}

/// A write's precondition.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Condition {
    #[default]
    None,
    IfAbsent,
    IfExists,
    IfVersion(Version),
}

/// What one key of an atomic multi-key write ([`Engine::multi_write_if`]) does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MultiOp<'a> {
    /// Writes `value`; `expire_at_ms` None keeps the key's current expiry (none if absent).
    Put {
        value: &'a [u8],
        expire_at_ms: Option<u64>,
    },
    /// Deletes the key (nothing is written when it is absent).
    Delete,
    /// Writes nothing: the item is there for its condition only.
    Check,
}

/// One key of an atomic multi-key write: what it does, on what condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MultiWrite<'a> {
    pub key: &'a [u8],
    pub op: MultiOp<'a>,
    pub condition: Condition,
}

#[derive(Clone, Debug, Default)]
pub struct PutOptions {
    pub condition: Condition,
    /// Unix milliseconds; 0 = no expiry.
    pub expire_at_ms: u64,
    /// Keep the previous object's expiry (Redis SET KEEPTTL).
    pub keep_ttl: bool,
    /// Return the previous object (Redis SET ... GET).
    pub return_old: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutOutcome {
    pub version: Version,
    pub old: Option<Object>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TabletInfo {
    pub id: TabletId,
    pub table: TableId,
    pub first_slot: u16,
    pub last_slot: u16,
    pub objects: u64,
    /// Reads and writes since the tablet was created.
    pub ops: u64,
}

/// One object a scan returns: its key, its value (projected when the query projects), version and
/// expiry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScanRecord {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub version: Version,
    pub expire_at_ms: u64,
}

/// What a scan produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ScanOutput {
    /// Matching records (empty for an aggregate query).
    pub records: Vec<ScanRecord>,
    /// The aggregates' values, in query order, for an aggregate query (empty for a grouped one).
    pub aggregates: Option<Vec<query::Value>>,
    /// A grouped query's groups: each group's value and its aggregates, in order of the values.
    pub groups: Option<Vec<(query::Value, Vec<query::Value>)>>,
    /// Records that matched the query.
    pub matched: u64,
    /// Values that are not records of the table's schema (skipped).
    pub malformed: u64,
    /// The record limit stopped the scan early.
    pub truncated: bool,
}

/// How a scan finds the objects (the hash-index walk is the benchmark's baseline).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanMethod {
    /// Sequential reads of the log, visibility from the entries (shared passes).
    Log,
    /// A walk of the hash index, following each reference into the log.
    HashIndex,
}

/// The log-structured memory engine. Share it as `Arc<Engine>`; every method takes `&self`.
pub struct Engine {
    inner: Arc<Inner>,
    cleaners: parking_lot::Mutex<Vec<JoinHandle<()>>>,
}

impl Engine {
    /// Maps the memory budget and starts the cleaner threads.
    pub fn new(config: EngineConfig) -> Result<Arc<Engine>, EngineError> {
        let threads = config.cleaner_threads;
        let inner = Arc::new(Inner::new(config)?);
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let inner = inner.clone();
            let handle = std::thread::Builder::new()
                .name(format!("ramlog-cleaner-{i}"))
                .spawn(move || cleaner::cleaner_thread(inner, i))
                .map_err(|e| EngineError::Config(format!("cannot start cleaner thread: {e}")))?;
            handles.push(handle);
        }
        Ok(Arc::new(Engine {
            inner,
            cleaners: parking_lot::Mutex::new(handles),
        }))
    }

    /// Stops the cleaner threads (idempotent). Reads and writes keep working; writers clean inline.
    pub fn shutdown(&self) {
        self.inner.shutdown.store(true, Ordering::Release);
        self.inner.wake_cleaner();
        for h in self.cleaners.lock().drain(..) {
            let _ = h.join();
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Creates a tablet of `table` owning slots `first_slot..=last_slot`.
    pub fn create_tablet(
        &self,
        table: TableId,
        first_slot: u16,
        last_slot: u16,
    ) -> Result<TabletId, EngineError> {
        self.inner.create_tablet(table, first_slot, last_slot)
    }

    /// The tablet of `table` that owns `key`'s slot.
    pub fn locate(&self, table: TableId, key: &[u8]) -> Option<TabletId> {
        self.inner.locate(table, key)
    }

    pub fn tablets(&self) -> Vec<TabletInfo> {
        self.inner.tablet_infos()
    }

    /// The current object of `key`, or None if absent or expired.
    pub fn get(&self, tablet: TabletId, key: &[u8]) -> Result<Option<Object>, EngineError> {
        self.inner
            .read(tablet, key, |v, version, expire_at_ms| Object {
                value: v.to_vec(),
                version,
                expire_at_ms,
            })
    }

    /// Copies the value into `out` (cleared first) and returns the version, without allocating
    /// when `out` has room.
    pub fn get_into(
        &self,
        tablet: TabletId,
        key: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<Option<Version>, EngineError> {
        self.inner.read(tablet, key, |v, version, _| {
            out.clear();
            out.extend_from_slice(v);
            version
        })
    }

    /// Calls `f(value, version, expire_at_ms)` on the current object without copying it.
    pub fn read_with<R>(
        &self,
        tablet: TabletId,
        key: &[u8],
        f: impl FnOnce(&[u8], Version, u64) -> R,
    ) -> Result<Option<R>, EngineError> {
        self.inner.read(tablet, key, f)
    }

    /// Reads like [`Engine::read_with`], holding the tablet's write lock: no write of the tablet
    /// is half-applied meanwhile (its observer told, its index not yet pointed at it). For the
    /// rare reader that must see a write its observer was just told about (replication's repair
    /// of a unit a backup refused).
    pub fn read_settled<R>(
        &self,
        tablet: TabletId,
        key: &[u8],
        f: impl FnOnce(&[u8], Version, u64) -> R,
    ) -> Result<Option<R>, EngineError> {
        let t = self.inner.tablet(tablet)?;
        let _writes = t.head.lock();
        self.inner.read(tablet, key, f)
    }

    pub fn put(
        &self,
        tablet: TabletId,
        key: &[u8],
        value: &[u8],
        opts: &PutOptions,
    ) -> Result<PutOutcome, EngineError> {
        self.inner.put(tablet, key, value, opts)
    }

    /// Deletes `key`; returns the delete's version if the key existed, None if it was absent.
    pub fn delete(
        &self,
        tablet: TabletId,
        key: &[u8],
        condition: Condition,
    ) -> Result<Option<Version>, EngineError> {
        self.inner.delete(tablet, key, condition)
    }

    /// Adds `delta` to a decimal integer value (absent counts as 0), with Redis INCRBY's rules;
    /// keeps the object's expiry. Returns the new value and its version.
    pub fn increment(
        &self,
        tablet: TabletId,
        key: &[u8],
        delta: i64,
    ) -> Result<(i64, Version), EngineError> {
        self.inner.increment(tablet, key, delta)
    }

    /// Rewrites `key` with a new expiry (0 removes it). Returns None if the key is absent.
    pub fn set_expiry(
        &self,
        tablet: TabletId,
        key: &[u8],
        expire_at_ms: u64,
    ) -> Result<Option<Version>, EngineError> {
        self.inner.set_expiry(tablet, key, expire_at_ms)
    }

    /// Writes all items with one version in one append: all or nothing, visible as one version.
    pub fn multi_put(
        &self,
        tablet: TabletId,
        items: &[(&[u8], &[u8])],
    ) -> Result<Version, EngineError> {
        self.inner.multi_put(tablet, items)
    }

    /// [`Self::multi_put`] if each item's condition holds (`conditions[i]` for `items[i]`),
    /// checked atomically with the write; otherwise nothing is written
    /// ([`EngineError::ConditionFailed`]).
    pub fn multi_put_if(
        &self,
        tablet: TabletId,
        items: &[(&[u8], &[u8])],
        conditions: &[Condition],
    ) -> Result<Version, EngineError> {
        self.inner.multi_put_if(tablet, items, conditions)
    }

    /// Puts, deletes and checks of several keys of one tablet as one unit: every condition is
    /// checked under the tablet's write lock, then everything is written with one version in one
    /// append (all or nothing), and replication gets it as one unit. Keys must be distinct.
    /// Returns the version, or None when nothing needed writing (checks only, deletes of absent
    /// keys).
    pub fn multi_write_if(
        &self,
        tablet: TabletId,
        items: &[MultiWrite<'_>],
    ) -> Result<Option<Version>, EngineError> {
        self.inner.multi_write_if(tablet, items)
    }

    /// Moves the clock to at least `version`: every later write takes a higher version (a
    /// server that takes over a tablet continues above whatever its previous master gave out).
    pub fn advance_clock(&self, version: Version) {
        self.inner
            .clock
            .fetch_max(version, std::sync::atomic::Ordering::SeqCst);
    }

    /// The version the last write took.
    pub fn clock(&self) -> Version {
        self.inner.clock.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Installs a replayed record with its original version (restart, recovery). Keeps whichever
    /// version of the key is newer; `value` None removes an older object. The observer is not told.
    pub fn restore(
        &self,
        tablet: TabletId,
        key: &[u8],
        value: Option<&[u8]>,
        version: Version,
        expire_at_ms: u64,
    ) -> Result<(), EngineError> {
        self.inner
            .restore(tablet, key, value, version, expire_at_ms)
    }

    /// Installs replayed records in order, as [`Engine::restore`] does each, with one tablet
    /// lookup and lock per group of them and their index buckets prefetched ahead.
    pub fn restore_batch(
        &self,
        tablet: TabletId,
        items: &[RestoreItem<'_>],
    ) -> Result<(), EngineError> {
        self.inner.restore_batch(tablet, items)
    }

    /// Installs replayed records that come in no order of their versions (several threads of a
    /// replay that leaves the merge to the engine): for each key the newest version wins,
    /// whatever came before or comes after. Unlike [`Engine::restore_batch`], a record whose
    /// expiry has passed is installed (reads take it as absent and expiry removes it), so that
    /// an older version of its key that comes later does not come back. Safe to call from
    /// several threads for one tablet. The observer is not told.
    pub fn restore_newest(
        &self,
        tablet: TabletId,
        items: &[RestoreItem<'_>],
    ) -> Result<(), EngineError> {
        self.inner.restore_items(tablet, items, true)
    }

    /// Grows `tablet`'s index at once for `expected_objects` if the tablet holds nothing yet
    /// (a restore about to fill it; cheap while the index is empty, as no reference moves).
    /// False if it held objects (the index grows as they come instead).
    pub fn reserve_for_restore(
        &self,
        tablet: TabletId,
        expected_objects: u64,
    ) -> Result<bool, EngineError> {
        self.inner.reserve_for_restore(tablet, expected_objects)
    }

    /// A loader that fills `tablet` from a replay of its backup logs, which yields each key once
    /// with its newest version: batches under one lock hold each, no index lookup per object
    /// when the tablet is empty, and the index grown once for `expected_objects` (an upper bound;
    /// 0 when unknown). Into a tablet that holds objects it keeps [`Engine::restore`]'s rules.
    /// The observer is not told. Call [`BulkRestore::finish`] at the end.
    pub fn bulk_restore(
        &self,
        tablet: TabletId,
        expected_objects: u64,
    ) -> Result<BulkRestore<'_>, EngineError> {
        BulkRestore::new(&self.inner, tablet, expected_objects)
    }

    /// Removes every object of `tablet` (no tombstones: this log is in memory only), so that
    /// the memory they held comes back as the cleaner runs: for a tablet whose restore failed
    /// half-way. The tablet stays, empty. Returns how many objects were removed.
    pub fn clear_tablet(&self, tablet: TabletId) -> Result<u64, EngineError> {
        self.inner.clear_tablet(tablet)
    }

    /// A split's first step, while `tablet` takes writes: creates the tablet of the slots
    /// `at..=last` (frozen, not routed) and copies into it every current object of those slots,
    /// with its version and expiry time, at a snapshot; writes of those slots from the start of
    /// the copy are noted for [`Engine::split_finish`]. The memory of the copied objects is taken
    /// twice until [`Engine::split_cleanup`]. A copy that fails (out of memory) leaves `tablet`
    /// as it was (the new tablet's id stays used, empty and unrouted).
    pub fn split_prepare(&self, tablet: TabletId, at: u16) -> Result<SplitCopy, EngineError> {
        let (new, last) = self.inner.split_begin(tablet, at)?;
        let copied = (|| -> Result<u64, EngineError> {
            let guess = self.inner.tablet(tablet)?.index.len() / 2;
            let mut cursor = self.tablet_cursor(tablet)?;
            let mut load = self.bulk_restore(new, guess)?;
            while !cursor.is_done() {
                for r in cursor.next_page(1024)? {
                    if ramlog_common::key_slot(&r.key) >= at {
                        load.push(&r.key, &r.value, r.version, r.expire_at_ms)?;
                    }
                }
            }
            load.finish()
        })();
        match copied {
            Ok(objects) => Ok(SplitCopy {
                tablet,
                new,
                at,
                last,
                objects,
            }),
            Err(e) => {
                self.inner.split_cancel(tablet, new);
                Err(e)
            }
        }
    }

    /// A split's last step, with `copy.tablet` frozen: redoes the writes noted since the copy's
    /// snapshot, then routes the upper slots to the new tablet (calling `routed` with its id at
    /// that moment, for routes kept outside the engine) and ends the old tablet's range below
    /// them. The new tablet stays frozen for the caller to open. Returns how many keys were
    /// redone.
    pub fn split_finish(
        &self,
        copy: &SplitCopy,
        routed: &mut dyn FnMut(TabletId),
    ) -> Result<u64, EngineError> {
        self.inner.split_finish(copy.tablet, copy.new, routed)
    }

    /// Gives a prepared split up: the new tablet is emptied, the old one is as it was.
    pub fn split_cancel(&self, copy: &SplitCopy) {
        self.inner.split_cancel(copy.tablet, copy.new)
    }

    /// After [`Engine::split_finish`]: removes the copied objects from the old tablet (they are
    /// unreachable there already); writers may run meanwhile. Returns how many.
    pub fn split_cleanup(&self, tablet: TabletId) -> Result<u64, EngineError> {
        self.inner.split_cleanup(tablet)
    }

    /// A merge's first step, while both tablets take writes: `upper` (the tablet whose slots
    /// follow `lower`'s) is copied into `lower`, each object with its version and expiry time, at
    /// a snapshot; writes to `upper` from the start of the copy are noted for
    /// [`Engine::merge_finish`]. Until then `lower`'s readers do not see the copies (its range is
    /// unchanged). A copy that fails (out of memory) is removed again. Returns the objects copied.
    pub fn merge_prepare(&self, lower: TabletId, upper: TabletId) -> Result<u64, EngineError> {
        self.inner.merge_begin(lower, upper)?;
        let copied = (|| -> Result<u64, EngineError> {
            let mut cursor = self.tablet_cursor(upper)?;
            let mut load = self.bulk_restore(lower, 0)?;
            let mut n = 0;
            while !cursor.is_done() {
                for r in cursor.next_page(1024)? {
                    load.push(&r.key, &r.value, r.version, r.expire_at_ms)?;
                    n += 1;
                }
            }
            load.finish()?;
            Ok(n)
        })();
        if copied.is_err() {
            let _ = self.inner.merge_cancel(lower, upper);
        }
        copied
    }

    /// A merge's last step, both tablets frozen: redoes the writes to `upper` noted since the
    /// copy, routes `upper`'s slots to `lower` (calling `routed` at that moment) and extends
    /// `lower`'s range over them. `upper` keeps its objects, unreachable, until
    /// [`Engine::clear_tablet`]. Returns how many keys were redone.
    pub fn merge_finish(
        &self,
        lower: TabletId,
        upper: TabletId,
        routed: &mut dyn FnMut(),
    ) -> Result<u64, EngineError> {
        self.inner.merge_finish(lower, upper, routed)
    }

    /// Gives a prepared merge up: the copies leave `lower`, `upper` is as it was.
    pub fn merge_cancel(&self, lower: TabletId, upper: TabletId) -> Result<u64, EngineError> {
        self.inner.merge_cancel(lower, upper)
    }

    /// The three steps of a split at once, for a tablet that is frozen throughout: returns the
    /// new tablet (frozen) that holds the slots `at..` and their objects.
    pub fn split_tablet(&self, tablet: TabletId, at: u16) -> Result<TabletId, EngineError> {
        if !self.inner.tablet(tablet)?.frozen.load(Ordering::Acquire) {
            return Err(EngineError::Config(
                "a tablet must be frozen to be split at once".into(),
            ));
        }
        let copy = self.split_prepare(tablet, at)?;
        if let Err(e) = self.split_finish(&copy, &mut |_| {}) {
            self.split_cancel(&copy);
            return Err(e);
        }
        self.split_cleanup(tablet)?;
        Ok(copy.new)
    }

    /// Live bytes of each tablet, indexed by [`TabletId`] (headers included).
    pub fn live_bytes_by_tablet(&self) -> Vec<u64> {
        self.inner.live_bytes_by_tablet()
    }

    /// Live bytes the log can still take before it reaches its utilisation limit
    /// ([`EngineStats::utilisation_limit`] of the log capacity): what a restore may add without
    /// driving writes into out-of-memory. 0 when past it.
    pub fn room_bytes(&self) -> u64 {
        self.inner.room_bytes()
    }

    /// Cursor iteration over a tablet's keys with Redis SCAN's guarantee: every key present for the
    /// whole iteration is returned at least once. Start at 0; a returned cursor of 0 means done.
    pub fn scan_keys(
        &self,
        tablet: TabletId,
        cursor: u64,
        count: usize,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<u64, EngineError> {
        self.inner.scan_keys(tablet, cursor, count, out)
    }

    /// Objects in all tablets (expired objects count until they are reclaimed, as in Redis DBSIZE).
    pub fn object_count(&self) -> u64 {
        (0..self.inner.tablet_count())
            .filter_map(|id| self.inner.tablet(id).ok())
            .map(|t| t.index.len())
            .sum()
    }

    /// Keys in all tablets: [`Engine::object_count`] less the internal objects (the chunks of
    /// large collections; `ramlog_common::is_internal`). What DBSIZE answers.
    pub fn key_count(&self) -> u64 {
        (0..self.inner.tablet_count())
            .filter_map(|id| self.inner.tablet(id).ok())
            .map(|t| t.index.len().saturating_sub(t.index.internal_len()))
            .sum()
    }

    /// Internal objects (chunks of large collections) in `tablet`.
    pub fn internal_count(&self, tablet: TabletId) -> Result<u64, EngineError> {
        Ok(self.inner.tablet(tablet)?.index.internal_len())
    }

    pub fn stats(&self) -> EngineStats {
        self.inner.stats()
    }

    /// Charges `bytes` of memory held outside the engine (absolute: the current total, not a
    /// change) to the memory budget. With the hash indexes, which the engine charges itself, it
    /// is what the log may not use: writers stop taking seglets at `memory_bytes − charge −
    /// cleaner reserve`, the cleaner counts it as used when it decides that memory is low, and
    /// `utilisation` is live bytes over what is left (`log_capacity_bytes`). A charge above the
    /// budget makes writes fail with out-of-memory; deletes (through their half of the reserve)
    /// and reads keep working, and writes are accepted again once the charge drops.
    pub fn set_external_bytes(&self, bytes: u64) {
        self.inner.set_external_bytes(bytes);
    }

    /// Tells `observer` the key (and table) of every expired object the engine removes from
    /// then on (Redis's `expired` keyspace event). Set once; false if one was set already.
    pub fn on_expired(&self, observer: ExpiredObserver) -> bool {
        self.inner.expired_observer.set(observer).is_ok()
    }

    /// Sets (or with None removes) the schema of a table's records, used by scan queries.
    pub fn set_schema(&self, table: TableId, schema: Option<query::Schema>) {
        let mut schemas = self.inner.schemas.write();
        match schema {
            Some(s) => {
                schemas.insert(table, Arc::new(s));
            }
            None => {
                schemas.remove(&table);
            }
        }
    }

    /// The schema of a table, if it has one.
    pub fn schema(&self, table: TableId) -> Option<Arc<query::Schema>> {
        self.inner.schemas.read().get(&table).cloned()
    }

    /// Opens a snapshot at the current version: reads and scans through it see exactly the writes
    /// up to it. Superseded versions it can read stay in memory until it is dropped or too old.
    pub fn snapshot(&self) -> Snapshot {
        self.inner.open_snapshot()
    }

    /// Holds every write for `hold` and opens a snapshot at the version the clock shows while
    /// they are held; also returns when the hold began and ended (wall clock, nanoseconds since
    /// the Unix epoch). No write is applied between the two instants, so the snapshot is the
    /// engine's state at any instant between them (a cluster snapshot takes one on every master
    /// and checks that the holds overlap).
    pub fn cut_snapshot(&self, hold: std::time::Duration) -> (Snapshot, u64, u64) {
        self.inner.cut_snapshot(hold)
    }

    /// The object `key` had at the snapshot (None if absent, deleted or expired then).
    pub fn get_at(
        &self,
        tablet: TabletId,
        key: &[u8],
        snapshot: &Snapshot,
    ) -> Result<Option<Object>, EngineError> {
        snapshot.check()?;
        Self::check_scan_use(snapshot, None)?;
        let t = self.inner.tablet(tablet)?;
        let found = scan::get_at(&self.inner, t, key, snapshot.version(), snapshot.wall_ms())?;
        snapshot.check()?;
        Ok(found)
    }

    fn compile(
        &self,
        table: TableId,
        q: &query::Query,
    ) -> Result<Arc<query::CompiledQuery>, EngineError> {
        self.compile_in(table, q, None)
    }

    /// [`Engine::compile`], selecting only keys of the slots `slots` names (first, last).
    fn compile_in(
        &self,
        table: TableId,
        q: &query::Query,
        slots: Option<(u16, u16)>,
    ) -> Result<Arc<query::CompiledQuery>, EngineError> {
        let schema = self.schema(table);
        query::CompiledQuery::new(q.clone(), schema.as_deref())
            .map(|c| match slots {
                Some((first, last)) => c.with_slots(first, last),
                None => c,
            })
            .map(Arc::new)
            .map_err(|e| EngineError::Query(e.to_string()))
    }

    fn table_tablets(&self, table: TableId) -> Vec<TabletId> {
        self.tablets()
            .into_iter()
            .filter(|t| t.table == table)
            .map(|t| t.id)
            .collect()
    }

    /// Scans a whole table at a snapshot: filters, then projects (at most `max_records` records)
    /// or aggregates. With [`ScanMethod::Log`] concurrent scans of a tablet share passes. Records
    /// come tablet by tablet, each tablet's in log order; successive scans start at different
    /// tablets.
    pub fn scan(
        &self,
        table: TableId,
        snapshot: &Snapshot,
        q: &query::Query,
        method: ScanMethod,
        max_records: usize,
    ) -> Result<ScanOutput, EngineError> {
        snapshot.check()?;
        Self::check_scan_use(snapshot, Some(table))?;
        let compiled = self.compile(table, q)?;
        let mut total = scan::QuerySink::new(compiled.clone(), max_records);
        let mut tablets = self.table_tablets(table);
        if !tablets.is_empty() {
            let start = self.inner.scan_rotation.fetch_add(1, Ordering::Relaxed) as usize;
            let n = tablets.len();
            tablets.rotate_left(start % n);
        }
        if method == ScanMethod::Log && (compiled.is_aggregate() || max_records == usize::MAX) {
            // Every tablet is scanned in full (an aggregate, or no limit on records): queue all of
            // them at once and share passes (see `scan::run_shared_many`).
            let work = tablets
                .into_iter()
                .map(|t| (t, scan::QuerySink::new(compiled.clone(), max_records)))
                .collect();
            for sink in scan::query_tablets(&self.inner, work, snapshot.entry())? {
                total.merge(sink);
            }
        } else {
            for tablet in tablets {
                let room = max_records.saturating_sub(total.out.records.len());
                let sink = scan::QuerySink::new(compiled.clone(), room);
                total.merge(self.scan_into(tablet, snapshot, method, sink)?);
                if total.out.truncated {
                    break;
                }
            }
        }
        snapshot.check()?;
        total.finish()
    }

    /// Opens a snapshot at the current version for one scan of `table` ([`Engine::scan`],
    /// [`Engine::scan_cursor`]) and nothing else: superseded versions stay only as long as that
    /// scan may still read them: only in this table, and in each tablet only until the scan has
    /// read the segment holding them. Writers elsewhere, and behind the scan, keep no version for
    /// it. A second scan, a scan of another table or a `get_at` through it is refused.
    pub fn scan_snapshot(&self, table: TableId) -> Snapshot {
        self.inner.open_snapshot_of(Some(table))
    }

    /// A snapshot for one scan of one tablet at version `at` (or the clock if lower): for a
    /// tablet whose versions another server hands out (a mirror's), opened at the newest
    /// version applied to it while no write is applied, so that the scan sees exactly what was
    /// applied before (later writes carry higher versions). Superseded versions stay only in
    /// the segments the scan has still to read.
    pub fn scan_snapshot_of_tablet_at(
        &self,
        tablet: TabletId,
        at: Version,
    ) -> Result<Snapshot, EngineError> {
        self.inner.open_snapshot_of_tablet_at(tablet, at)
    }

    /// Scans a whole table as of now through a [`Engine::scan_snapshot`] of its own. Returns the
    /// output and the version the scan read at.
    pub fn scan_now(
        &self,
        table: TableId,
        q: &query::Query,
        method: ScanMethod,
        max_records: usize,
    ) -> Result<(ScanOutput, Version), EngineError> {
        let snapshot = self.scan_snapshot(table);
        let out = self.scan(table, &snapshot, q, method, max_records)?;
        Ok((out, snapshot.version()))
    }

    /// Refuses a use of a scan snapshot other than its one scan of its table (`table` None: a
    /// point read).
    fn check_scan_use(snapshot: &Snapshot, table: Option<TableId>) -> Result<(), EngineError> {
        let entry = snapshot.entry();
        let Some(own) = entry.scan_table else {
            return Ok(());
        };
        if table != Some(own) || entry.scan_used.swap(true, Ordering::AcqRel) {
            return Err(EngineError::Query(format!(
                "snapshot {} serves one scan of table {own}, and nothing else",
                entry.version
            )));
        }
        Ok(())
    }

    /// Scans one tablet at a snapshot (see [`Engine::scan`]).
    pub fn scan_tablet(
        &self,
        tablet: TabletId,
        snapshot: &Snapshot,
        q: &query::Query,
        method: ScanMethod,
        max_records: usize,
    ) -> Result<ScanOutput, EngineError> {
        snapshot.check()?;
        let table = self.inner.tablet(tablet)?.table;
        Self::check_scan_use(snapshot, Some(table))?;
        let compiled = self.compile(table, q)?;
        let sink = scan::QuerySink::new(compiled, max_records);
        let sink = self.scan_into(tablet, snapshot, method, sink)?;
        snapshot.check()?;
        sink.finish()
    }

    /// Scans the objects of the slots `first..=last` in one tablet at a snapshot of its table
    /// (the part of a cluster scan a tablet's master serves): aggregates, or at most
    /// `max_records` records. Objects of other slots the engine tablet holds for a while (a
    /// split's copies before their cleanup, a merge's while it copies) are left out.
    pub fn scan_tablet_slots(
        &self,
        tablet: TabletId,
        snapshot: &Snapshot,
        q: &query::Query,
        (first, last): (u16, u16),
        max_records: usize,
    ) -> Result<ScanOutput, EngineError> {
        snapshot.check()?;
        let table = self.inner.tablet(tablet)?.table;
        Self::check_scan_use(snapshot, Some(table))?;
        let compiled = self.compile_in(table, q, Some((first, last)))?;
        let sink = scan::QuerySink::new(compiled, max_records);
        let sink = self.scan_into(tablet, snapshot, ScanMethod::Log, sink)?;
        snapshot.check()?;
        sink.finish()
    }

    /// A resumable record scan of the slots `first..=last` in one tablet at `snapshot` (see
    /// [`Engine::scan_tablet_slots`] and [`Engine::scan_cursor`]).
    pub fn scan_cursor_slots(
        &self,
        tablet: TabletId,
        snapshot: Snapshot,
        q: &query::Query,
        (first, last): (u16, u16),
    ) -> Result<ScanCursor, EngineError> {
        let table = self.inner.tablet(tablet)?.table;
        self.record_cursor(table, vec![tablet], snapshot, q, Some((first, last)))
    }

    /// Runs one tablet's scan into `sink` by the chosen method.
    fn scan_into(
        &self,
        tablet: TabletId,
        snapshot: &Snapshot,
        method: ScanMethod,
        mut sink: scan::QuerySink,
    ) -> Result<scan::QuerySink, EngineError> {
        match method {
            ScanMethod::Log => scan::query_tablet(&self.inner, tablet, snapshot.entry(), sink),
            ScanMethod::HashIndex => {
                let t = self.inner.tablet(tablet)?;
                scan::hash_index_scan(
                    &self.inner,
                    t,
                    snapshot.version(),
                    snapshot.wall_ms(),
                    &mut sink,
                )?;
                Ok(sink)
            }
        }
    }

    /// Opens a resumable scan of a table at `snapshot` (the cursor keeps a handle on it; pass a
    /// clone to keep using the snapshot elsewhere), returning records page by page. Aggregates need [`Engine::scan`].
    pub fn scan_cursor(
        &self,
        table: TableId,
        snapshot: Snapshot,
        q: &query::Query,
    ) -> Result<ScanCursor, EngineError> {
        let tablets = self.table_tablets(table);
        self.record_cursor(table, tablets, snapshot, q, None)
    }

    /// A record cursor over `tablets` of `table` at `snapshot`, selecting only keys of `slots`
    /// when given ([`Engine::scan_cursor`], [`Engine::scan_cursor_slots`]).
    fn record_cursor(
        &self,
        table: TableId,
        tablets: Vec<TabletId>,
        snapshot: Snapshot,
        q: &query::Query,
        slots: Option<(u16, u16)>,
    ) -> Result<ScanCursor, EngineError> {
        snapshot.check()?;
        Self::check_scan_use(&snapshot, Some(table))?;
        let compiled = self.compile_in(table, q, slots)?;
        if compiled.is_aggregate() {
            return Err(EngineError::Query(
                "a paged scan returns records; aggregate with a one-shot scan".into(),
            ));
        }
        Ok(ScanCursor {
            inner: self.inner.clone(),
            snapshot,
            query: compiled,
            tablets: tablets.into(),
            current: None,
            scratch: Vec::new(),
            malformed: 0,
        })
    }

    /// Refuses writes to `tablet` with [`EngineError::Frozen`] (true), or takes them again
    /// (false). When it returns true, every write the tablet took before has reached the write
    /// observer (replication), and no later one will.
    pub fn set_frozen(&self, tablet: TabletId, frozen: bool) -> Result<(), EngineError> {
        self.inner.set_frozen(tablet, frozen)
    }

    /// Refuses writes that would grow `tablet` with [`EngineError::TabletFull`] (`limit` > 0,
    /// named in the error), or takes them again (0). Deletes, and overwrites no larger than
    /// what they replace, are always taken. A cluster server sets it from the tablet's size.
    pub fn set_tablet_full(&self, tablet: TabletId, limit: u64) -> Result<(), EngineError> {
        self.inner.set_tablet_full(tablet, limit)
    }

    /// Opens a cursor over one tablet's current objects in log order, for copying the tablet
    /// elsewhere in bulk (a new backup's copy after a recovery): segment by segment, with no
    /// index probe per object. It reads at a snapshot of that tablet alone, which keeps
    /// superseded versions only in the segments the cursor has still to read. Values come as
    /// stored, whatever the table's schema.
    pub fn tablet_cursor(&self, tablet: TabletId) -> Result<ScanCursor, EngineError> {
        let snapshot = self.inner.open_snapshot_of_tablet(tablet)?;
        let query = query::CompiledQuery::new(query::Query::default(), None)
            .map(Arc::new)
            .map_err(|e| EngineError::Query(e.to_string()))?;
        Ok(ScanCursor {
            inner: self.inner.clone(),
            snapshot,
            query,
            tablets: [tablet].into(),
            current: None,
            scratch: Vec::new(),
            malformed: 0,
        })
    }

    /// Runs one cleaning pass on the caller's thread (tests and tools); returns whether it did work.
    pub fn clean_now(&self) -> bool {
        let progressed = cleaner::run_pass(&self.inner, true);
        cleaner::drain_limbo(&self.inner);
        progressed
    }

    /// Removes every expired object no open snapshot can read, now (the background cleaner does
    /// it every 100 ms for the segments where enough has expired; this is for tests and engines
    /// without cleaner threads). Returns how many.
    pub fn expire_now(&self) -> u64 {
        let mut cursor = 0;
        cleaner::sweep_expired(&self.inner, &mut cursor, None, true)
    }

    /// Runs cleaning passes until a pass finds nothing to do or `max_passes` ran.
    pub fn clean_until_idle(&self, max_passes: usize) -> usize {
        let mut n = 0;
        while n < max_passes && self.clean_now() {
            n += 1;
        }
        cleaner::drain_limbo(&self.inner);
        n
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What unit tests of several modules share.
#[cfg(test)]
pub(crate) mod test_support {
    use crate::{Engine, EngineConfig};
    use std::sync::Arc;

    /// A 64 MiB engine of small (4-seglet) segments, values up to 4 KiB, and no cleaner thread:
    /// tests drive cleaning and scans step by step.
    pub(crate) fn small_engine_without_cleaner() -> Arc<Engine> {
        Engine::new(EngineConfig {
            memory_bytes: 64 << 20,
            segment_seglets: 4,
            value_size_max_bytes: 4096,
            cleaner_threads: 0,
            ..Default::default()
        })
        .expect("a valid configuration")
    }
}
