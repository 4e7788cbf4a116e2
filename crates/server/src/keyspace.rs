//! The keyspace one server serves: table 0 of the engine, split into tablets by slot range.
//!
//! Hides which tablet a key lives in (CRC16 slot → tablet, a 16384-entry table) and how a SCAN
//! cursor walks all tablets: the cursor packs the tablet's index in its low bits and the engine's
//! per-tablet cursor above them, so a client holds one opaque number, as with Redis.

/// Redis's glob matching (SCAN MATCH, KEYS) and its case-insensitive form (CONFIG GET patterns).
pub use ramlog_common::{glob_match, glob_match_nocase};
use ramlog_common::{key_slot, TableId, SLOT_COUNT};
use ramlog_logmem::{Engine, EngineError, TabletId};
use std::sync::Arc;

/// The table that RESP clients see (Redis has one keyspace per database; ramlog serves db 0).
pub const RESP_TABLE: TableId = 0;

pub struct Keyspace {
    engine: Arc<Engine>,
    /// Tablets in slot order.
    tablets: Vec<TabletId>,
    slot_to_tablet: Vec<TabletId>,
    /// Bits of a SCAN cursor that hold the tablet index.
    tablet_bits: u32,
}

impl Keyspace {
    /// Creates table 0 as `tablet_count` tablets of equal slot ranges.
    pub fn create(engine: Arc<Engine>, tablet_count: u16) -> Result<Keyspace, EngineError> {
        assert!(
            (1..=SLOT_COUNT).contains(&tablet_count),
            "tablet count {tablet_count}"
        );
        let per = SLOT_COUNT.div_ceil(tablet_count);
        let mut tablets = Vec::with_capacity(tablet_count as usize);
        let mut slot_to_tablet = vec![0; SLOT_COUNT as usize];
        let mut first: u16 = 0;
        while first < SLOT_COUNT {
            let last = first.saturating_add(per - 1).min(SLOT_COUNT - 1);
            let id = engine.create_tablet(RESP_TABLE, first, last)?;
            for slot in first..=last {
                slot_to_tablet[slot as usize] = id;
            }
            tablets.push(id);
            first = last + 1;
        }
        let tablet_bits = usize::BITS - (tablets.len().max(2) - 1).leading_zeros();
        Ok(Keyspace {
            engine,
            tablets,
            slot_to_tablet,
            tablet_bits,
        })
    }

    /// The tablets of the RESP table, in slot order.
    pub fn tablet_ids(&self) -> &[TabletId] {
        &self.tablets
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    pub fn tablets(&self) -> &[TabletId] {
        &self.tablets
    }

    /// The tablet holding `key`.
    #[inline]
    pub fn tablet_of(&self, key: &[u8]) -> TabletId {
        self.slot_to_tablet[key_slot(key) as usize]
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
        let mask = (1u64 << self.tablet_bits) - 1;
        let mut index = (cursor & mask) as usize;
        let mut inner = cursor >> self.tablet_bits;
        if index >= self.tablets.len() {
            return Ok(None);
        }
        let mut visited = 0;
        let mut batch = Vec::new();
        loop {
            batch.clear();
            let next =
                self.engine
                    .scan_keys(self.tablets[index], inner, count.max(1), &mut batch)?;
            visited += batch.len().max(1);
            for key in batch.drain(..) {
                if pattern.is_none_or(|p| glob_match(p, &key)) {
                    out.push(key);
                }
            }
            if next == 0 {
                index += 1;
                inner = 0;
                if index == self.tablets.len() {
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
            return Err(EngineError::NoSuchTablet(self.tablets[index]));
        }
        Ok(Some((inner << self.tablet_bits) | index as u64))
    }
}
