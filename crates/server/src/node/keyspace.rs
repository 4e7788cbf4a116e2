//! The keyspace one server serves: table 0 of the engine, split into tablets by slot range.
//!
//! Hides which tablet a key lives in (CRC16 slot → tablet, a 16384-entry table) and how a SCAN
//! cursor walks all tablets: the cursor packs the tablet's index in its low bits and the engine's
//! per-tablet cursor above them, so a client holds one opaque number, as with Redis.

/// Redis's glob matching (SCAN MATCH, KEYS) and its case-insensitive form (CONFIG GET patterns).
pub use ramlog_common::{glob_match, glob_match_nocase};
use ramlog_common::{key_slot, TableId, SLOT_COUNT};
use ramlog_logmem::{Engine, EngineError, SplitCopy, TabletId};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// The table that RESP clients see (Redis has one keyspace per database; ramlog serves db 0).
pub const RESP_TABLE: TableId = 0;

pub struct Keyspace {
    engine: Arc<Engine>,
    /// Tablets in the order they were added (slot order for a standalone server).
    tablets: parking_lot::RwLock<Arc<Vec<TabletId>>>,
    /// The tablet of each slot, or [`NO_TABLET`] where this server holds none.
    slot_to_tablet: Box<[AtomicU32]>,
    /// Bits of a SCAN cursor that hold the tablet index.
    tablet_bits: u32,
    /// Tablets this server holds but does not master (mirrors, of any table): SCAN, KEYS and
    /// DBSIZE leave them out, as they describe the keys a node masters.
    hidden: parking_lot::RwLock<std::collections::HashSet<TabletId>>,
}

/// A slot this server holds no tablet for.
pub const NO_TABLET: TabletId = TabletId::MAX;

/// Bits of a SCAN cursor for the tablet index in a cluster, where tablets are added as the map
/// gives them (at most 1024 tablets of table 0 on one server).
const CLUSTER_TABLET_BITS: u32 = 10;

impl Keyspace {
    /// Creates table 0 as `tablet_count` tablets of equal slot ranges.
    pub fn create(engine: Arc<Engine>, tablet_count: u16) -> Result<Keyspace, EngineError> {
        assert!(
            (1..=SLOT_COUNT).contains(&tablet_count),
            "tablet count {tablet_count}"
        );
        let per = SLOT_COUNT.div_ceil(tablet_count);
        let tablet_bits = usize::BITS - (usize::from(tablet_count).max(2) - 1).leading_zeros();
        let keyspace = Keyspace::with_bits(engine, tablet_bits);
        let mut first: u16 = 0;
        while first < SLOT_COUNT {
            let last = first.saturating_add(per - 1).min(SLOT_COUNT - 1);
            keyspace.add_tablet(first, last)?;
            first = last + 1;
        }
        Ok(keyspace)
    }

    /// A keyspace with no tablets yet: a cluster server adds the ones the map gives it.
    pub fn empty(engine: Arc<Engine>) -> Keyspace {
        Keyspace::with_bits(engine, CLUSTER_TABLET_BITS)
    }

    fn with_bits(engine: Arc<Engine>, tablet_bits: u32) -> Keyspace {
        Keyspace {
            engine,
            tablets: parking_lot::RwLock::new(Arc::new(Vec::new())),
            slot_to_tablet: (0..SLOT_COUNT).map(|_| AtomicU32::new(NO_TABLET)).collect(),
            tablet_bits,
            hidden: parking_lot::RwLock::new(std::collections::HashSet::new()),
        }
    }

    /// Creates a tablet of table 0 for `first..=last` in the engine and routes its slots to it.
    pub fn add_tablet(&self, first: u16, last: u16) -> Result<TabletId, EngineError> {
        let mut tablets = self.tablets.write();
        if tablets.len() >= 1 << self.tablet_bits {
            return Err(EngineError::TooManyTablets(1 << self.tablet_bits));
        }
        let id = self.engine.create_tablet(RESP_TABLE, first, last)?;
        for slot in first..=last {
            self.slot_to_tablet[slot as usize].store(id, Ordering::Release);
        }
        let mut next = Vec::clone(&tablets);
        next.push(id);
        *tablets = Arc::new(next);
        Ok(id)
    }

    /// A split's first step for tablet `tablet` of table 0 (the engine's `split_prepare`):
    /// refused when this keyspace has no room for one more tablet.
    pub fn split_prepare(&self, tablet: TabletId, at: u16) -> Result<SplitCopy, EngineError> {
        if self.tablets.read().len() >= 1 << self.tablet_bits {
            return Err(EngineError::TooManyTablets(1 << self.tablet_bits));
        }
        self.engine.split_prepare(tablet, at)
    }

    /// A split's last step (the engine's `split_finish`, `copy.tablet` frozen): the slots
    /// `copy.at..` route to the new tablet from the moment the engine routes them.
    pub fn split_finish(&self, copy: &SplitCopy) -> Result<u64, EngineError> {
        let mut tablets = self.tablets.write();
        let redone = self.engine.split_finish(copy, &mut |new| {
            for slot in copy.at..=copy.last {
                self.slot_to_tablet[slot as usize].store(new, Ordering::Release);
            }
        })?;
        let mut next = Vec::clone(&tablets);
        next.push(copy.new);
        *tablets = Arc::new(next);
        Ok(redone)
    }

    /// A merge's last step for tablets `lower` and `upper` of table 0 (the engine's
    /// `merge_finish`, both frozen): `upper`'s slots route to `lower` from the moment the engine
    /// routes them, and `upper` leaves the tablets SCAN walks.
    pub fn merge_finish(&self, lower: TabletId, upper: TabletId) -> Result<u64, EngineError> {
        let mut tablets = self.tablets.write();
        let range = self
            .engine
            .tablets()
            .into_iter()
            .find(|t| t.id == upper)
            .map(|t| (t.first_slot, t.last_slot))
            .ok_or(EngineError::NoSuchTablet(upper))?;
        let redone = self.engine.merge_finish(lower, upper, &mut || {
            for slot in range.0..=range.1 {
                self.slot_to_tablet[slot as usize].store(lower, Ordering::Release);
            }
        })?;
        let next: Vec<TabletId> = tablets.iter().copied().filter(|&t| t != upper).collect();
        *tablets = Arc::new(next);
        Ok(redone)
    }

    /// The tablets of the RESP table on this server.
    pub fn tablet_ids(&self) -> Arc<Vec<TabletId>> {
        self.tablets.read().clone()
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Hides `tablet` from SCAN, KEYS and DBSIZE (a mirror's copy) or shows it again.
    pub fn set_hidden(&self, tablet: TabletId, hidden: bool) {
        let mut set = self.hidden.write();
        if hidden {
            set.insert(tablet);
        } else {
            set.remove(&tablet);
        }
    }

    pub fn is_hidden(&self, tablet: TabletId) -> bool {
        self.hidden.read().contains(&tablet)
    }

    /// Objects in the hidden tablets.
    pub fn hidden_objects(&self) -> u64 {
        let hidden = self.hidden.read();
        if hidden.is_empty() {
            return 0;
        }
        self.engine
            .tablets()
            .iter()
            .filter(|t| hidden.contains(&t.id))
            .map(|t| {
                let internal = self.engine.internal_count(t.id).unwrap_or(0);
                t.objects.saturating_sub(internal)
            })
            .sum()
    }

    pub fn tablets(&self) -> Arc<Vec<TabletId>> {
        self.tablet_ids()
    }

    /// The tablet holding `key`, or [`NO_TABLET`] (which the engine answers with `NoSuchTablet`).
    #[inline]
    pub fn tablet_of(&self, key: &[u8]) -> TabletId {
        self.slot_to_tablet[key_slot(key) as usize].load(Ordering::Acquire)
    }

    /// One SCAN step: appends keys matching `pattern` (after visiting about `count` keys) and returns
    /// the next cursor (0 = done). `None` if the cursor is not one this keyspace handed out.
    pub fn scan(
        &self,
        cursor: u64,
        count: usize,
        pattern: Option<&[u8]>,
        out: &mut Vec<Vec<u8>>,
    ) -> Result<Option<u64>, EngineError> {
        let tablets = self.tablet_ids();
        let mask = (1u64 << self.tablet_bits) - 1;
        let mut index = (cursor & mask) as usize;
        let mut inner = cursor >> self.tablet_bits;
        if index >= tablets.len() {
            return Ok(None);
        }
        let mut visited = 0;
        let mut batch = Vec::new();
        loop {
            batch.clear();
            let next = if self.hidden.read().contains(&tablets[index]) {
                0
            } else {
                self.engine
                    .scan_keys(tablets[index], inner, count.max(1), &mut batch)?
            };
            visited += batch.len().max(1);
            for key in batch.drain(..) {
                // The chunks of large collections are not keys of their own.
                if ramlog_common::is_internal(&key) {
                    continue;
                }
                if pattern.is_none_or(|p| glob_match(p, &key)) {
                    out.push(key);
                }
            }
            if next == 0 {
                index += 1;
                inner = 0;
                if index == tablets.len() {
                    return Ok(Some(0));
                }
            } else {
                inner = next;
            }
            if visited >= count {
                break;
            }
        }
        // The engine's cursor must leave room for the tablet bits; it is well below 2^56 in practice.
        if inner.leading_zeros() < self.tablet_bits {
            return Err(EngineError::NoSuchTablet(tablets[index]));
        }
        Ok(Some((inner << self.tablet_bits) | index as u64))
    }
}
