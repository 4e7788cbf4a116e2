//! The reorganizer's table of current versions: 128-bit key hash → (version, deleted), plus the
//! segment and length of the key's newest entry when known (its *location*).
//!
//! Cleaning a segment looks up every entry it holds, and the table of a large tablet does not fit
//! in the CPU caches, so each lookup is a cache miss. An open-addressing table with linear probing
//! lets the cleaner compute the slots of a whole block's entries first and prefetch them, so that
//! many misses are in flight at once instead of one after the other.
//!
//! Locations let the reorganizer estimate each segment's dead bytes: when a key's newer entry is
//! placed (or the key deleted), the bytes of its previous entry are dead in the segment that holds
//! them. The estimate drives cost-benefit segment selection; correctness never depends on it.

use crate::tablet::VersionInfo;

/// One slot: 32 bytes, two per cache line. `flags` is 0 for an empty slot.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
struct Slot {
    lo: u64,
    hi: u64,
    version: u64,
    flags: u64,
}

const OCCUPIED: u64 = 1;
const DELETED: u64 = 2;
/// `version` holds a version from the version log or buffer (not only a location).
const VERSIONED: u64 = 4;
/// Bits 8..32 hold the entry length (saturated), bits 32..64 the segment index.
const LOCATED: u64 = 8;
const LEN_SHIFT: u32 = 8;
const LEN_MAX: u64 = (1 << 24) - 1;
const SEG_SHIFT: u32 = 32;

/// Where a key's newest entry lies: segment index and encoded length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub segment: u32,
    pub len: u32,
}

#[inline]
fn location_of(flags: u64) -> Option<Location> {
    if flags & LOCATED == 0 {
        return None;
    }
    Some(Location {
        segment: (flags >> SEG_SHIFT) as u32,
        len: ((flags >> LEN_SHIFT) & LEN_MAX) as u32,
    })
}

#[inline]
fn with_location(flags: u64, loc: Option<Location>) -> u64 {
    let base = flags & (OCCUPIED | DELETED | VERSIONED);
    match loc {
        None => base,
        Some(l) => {
            base | LOCATED
                | (u64::from(l.len).min(LEN_MAX) << LEN_SHIFT)
                | (u64::from(l.segment) << SEG_SHIFT)
        }
    }
}
const MIN_SLOTS: usize = 64;

/// `n` empty slots from zeroed memory, in one allocation of exactly `n` slots. (With the slots'
/// 32-byte alignment the system allocator zeroes the memory with stores rather than handing out
/// fresh zero pages; at three keys per four slots a table touches nearly every page anyway.)
fn zeroed_slots(n: usize) -> Vec<Slot> {
    let layout = std::alloc::Layout::array::<Slot>(n).expect("slot table size");
    // SAFETY: the layout has a non-zero size (n >= MIN_SLOTS); an all-zero Slot is a valid
    // (empty) Slot; the Vec owns an allocation of exactly `layout` (length = capacity = n), which
    // is how it will free it.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout).cast::<Slot>();
        if p.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Vec::from_raw_parts(p, n, n)
    }
}
const PREFETCH_AHEAD: usize = 16;

#[derive(Default)]
pub struct VersionTable {
    slots: Vec<Slot>,
    len: usize,
    /// The store's gauges, whose `version_caches` counts this table's slots while it has them.
    gauges: Option<std::sync::Arc<crate::tablet::MemGauges>>,
}

impl Drop for VersionTable {
    fn drop(&mut self) {
        self.set_slots(Vec::new());
    }
}

impl VersionTable {
    /// An empty table whose memory is counted in `gauges.version_caches`.
    pub fn counted(gauges: std::sync::Arc<crate::tablet::MemGauges>) -> VersionTable {
        VersionTable {
            slots: Vec::new(),
            len: 0,
            gauges: Some(gauges),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes of the table's slots.
    pub fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
    }

    /// Replaces the slots, keeping the gauge in step.
    fn set_slots(&mut self, slots: Vec<Slot>) -> Vec<Slot> {
        if let Some(g) = &self.gauges {
            let (old, new) = (
                self.bytes() as u64,
                (slots.capacity() * std::mem::size_of::<Slot>()) as u64,
            );
            g.version_caches
                .fetch_add(new, std::sync::atomic::Ordering::Relaxed);
            g.version_caches
                .fetch_sub(old, std::sync::atomic::Ordering::Relaxed);
        }
        std::mem::replace(&mut self.slots, slots)
    }

    /// Empties the table and frees its memory.
    pub fn clear(&mut self) {
        self.set_slots(Vec::new());
        self.len = 0;
    }

    #[inline]
    fn home(&self, hash: u128) -> usize {
        // The low bits of a 128-bit xxh3 hash are uniform; the table size is a power of two.
        (hash as usize) & (self.slots.len() - 1)
    }

    /// Hints the CPU to fetch the cache line where `hash`'s probe starts.
    #[inline]
    pub fn prefetch(&self, hash: u128) {
        if self.slots.is_empty() {
            return;
        }
        let p = &self.slots[self.home(hash)] as *const Slot;
        #[cfg(target_arch = "x86_64")]
        // SAFETY: prefetching is a hint with no effect on memory; p points into `slots`.
        unsafe {
            std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }

    /// The recorded version of `hash`, if any.
    #[inline]
    pub fn get(&self, hash: u128) -> Option<VersionInfo> {
        let s = &self.slots[self.probe(hash).ok()?];
        (s.flags & VERSIONED != 0).then_some(VersionInfo {
            version: s.version,
            deleted: s.flags & DELETED != 0,
        })
    }

    /// Ok(index of `hash`'s slot), or Err(index of the empty slot where it would go; `usize::MAX`
    /// for a table with no slots).
    #[inline]
    fn probe(&self, hash: u128) -> Result<usize, usize> {
        if self.slots.is_empty() {
            return Err(usize::MAX);
        }
        let (lo, hi) = (hash as u64, (hash >> 64) as u64);
        let mask = self.slots.len() - 1;
        let mut i = self.home(hash);
        loop {
            let s = &self.slots[i];
            if s.flags == 0 {
                return Err(i);
            }
            if s.lo == lo && s.hi == hi {
                return Ok(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The slot of `hash`, inserted empty (no version, no location) if absent.
    fn slot_mut(&mut self, hash: u128) -> &mut Slot {
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        let i = match self.probe(hash) {
            Ok(i) => i,
            Err(i) => {
                self.len += 1;
                self.slots[i] = Slot {
                    lo: hash as u64,
                    hi: (hash >> 64) as u64,
                    version: 0,
                    flags: OCCUPIED,
                };
                i
            }
        };
        &mut self.slots[i]
    }

    /// Records that `hash`'s newest entry now lies at `loc` (None: the key was deleted); returns
    /// where its previous entry lay, if known: those bytes are dead now.
    pub fn relocate(&mut self, hash: u128, loc: Option<Location>) -> Option<Location> {
        let s = self.slot_mut(hash);
        let old = location_of(s.flags);
        s.flags = with_location(s.flags, loc);
        old
    }

    /// Moves `hash`'s location from segment `from` to `to` (the cleaner copied the entry);
    /// leaves it alone if the key's newest entry is known to lie elsewhere.
    pub fn moved(&mut self, hash: u128, from: u32, to: u32) {
        let Ok(i) = self.probe(hash) else { return };
        let s = &mut self.slots[i];
        if let Some(l) = location_of(s.flags).filter(|l| l.segment == from) {
            s.flags = with_location(s.flags, Some(Location { segment: to, ..l }));
        }
    }

    /// Forgets `hash`'s location if it is segment `at` (the cleaner dropped the entry there as
    /// superseded, and the segment is about to be freed: no location may point into it after).
    pub fn forget_at(&mut self, hash: u128, at: u32) {
        let Ok(i) = self.probe(hash) else { return };
        let s = &mut self.slots[i];
        if location_of(s.flags).is_some_and(|l| l.segment == at) {
            s.flags = with_location(s.flags, None);
        }
    }

    /// Records `v` for `hash` unless a newer version is recorded (equal versions: the later
    /// record wins, as in the version log). The key's location is kept.
    pub fn merge(&mut self, hash: u128, v: VersionInfo) {
        let s = self.slot_mut(hash);
        if s.flags & VERSIONED == 0 || v.version >= s.version {
            s.version = v.version;
            s.flags = (s.flags & !DELETED) | VERSIONED | if v.deleted { DELETED } else { 0 };
        }
    }

    /// Merges many records, prefetching the slot of the record `PREFETCH_AHEAD` places ahead
    /// so that the table's cache misses overlap.
    /// The table grows as keys arrive, not by `records.len()` up front: a version log holds up to
    /// several records per key, and sizing for all of them made tables several times too large
    /// (every slot of which is zeroed and faulted in).
    pub fn merge_all(&mut self, records: &[(u128, VersionInfo)]) {
        for (i, &(hash, v)) in records.iter().enumerate() {
            if let Some(&(ahead, _)) = records.get(i + PREFETCH_AHEAD) {
                self.prefetch(ahead);
            }
            self.merge(hash, v);
        }
    }

    fn grow(&mut self) {
        let new_len = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = self.set_slots(zeroed_slots(new_len));
        let mask = new_len - 1;
        for s in old.into_iter().filter(|s| s.flags != 0) {
            let mut i = (s.lo as usize) & mask;
            while self.slots[i].flags != 0 {
                i = (i + 1) & mask;
            }
            self.slots[i] = s;
        }
    }

    /// Every (hash, version) recorded, in no particular order (keys known only by location are
    /// left out).
    pub fn iter(&self) -> impl Iterator<Item = (u128, VersionInfo)> + '_ {
        self.slots
            .iter()
            .filter(|s| s.flags & VERSIONED != 0)
            .map(|s| {
                (
                    (u128::from(s.hi) << 64) | u128::from(s.lo),
                    VersionInfo {
                        version: s.version,
                        deleted: s.flags & DELETED != 0,
                    },
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        /// The table agrees with a HashMap oracle under random merges (few distinct hashes, so
        /// that updates and probe collisions are common; low bits equal to force long probes).
        #[test]
        fn matches_hashmap(ops in prop::collection::vec((0u64..300, 0u64..50, any::<bool>()), 0..3000)) {
            let mut t = VersionTable::default();
            let mut oracle: HashMap<u128, VersionInfo> = HashMap::new();
            for (k, version, deleted) in ops {
                let hash = (u128::from(k.wrapping_mul(0x9E37_79B9_7F4A_7C15)) << 64) | u128::from(k % 7);
                let v = VersionInfo { version, deleted };
                if version % 2 == 0 {
                    t.merge(hash, v);
                } else {
                    t.merge_all(&[(hash, v)]);
                }
                let e = oracle.entry(hash).or_insert(v);
                if version >= e.version {
                    *e = v;
                }
            }
            prop_assert_eq!(t.len(), oracle.len());
            for (h, v) in &oracle {
                prop_assert_eq!(t.get(*h), Some(*v));
            }
            let mut seen: Vec<(u128, VersionInfo)> = t.iter().collect();
            seen.sort_by_key(|e| e.0);
            let mut want: Vec<(u128, VersionInfo)> = oracle.into_iter().collect();
            want.sort_by_key(|e| e.0);
            prop_assert_eq!(seen, want);
            prop_assert_eq!(t.get(u128::MAX), None);
        }
    }

    #[test]
    fn locations_follow_the_newest_entry() {
        let mut t = VersionTable::default();
        let at = |segment, len| Some(Location { segment, len });
        assert_eq!(t.relocate(7, at(3, 90)), None);
        // A location alone is not a version: the key is still unknown to is_current.
        assert_eq!(t.get(7), None);
        assert_eq!(t.iter().count(), 0);
        t.merge(
            7,
            VersionInfo {
                version: 5,
                deleted: false,
            },
        );
        assert_eq!(
            t.get(7),
            Some(VersionInfo {
                version: 5,
                deleted: false
            })
        );
        assert_eq!(t.relocate(7, at(4, 100)), at(3, 90));
        t.moved(7, 3, 9); // not where the key lies: ignored
        t.moved(7, 4, 9);
        assert_eq!(t.relocate(7, None), at(9, 100));
        assert_eq!(t.relocate(7, at(1, u32::MAX)), None);
        assert_eq!(t.relocate(7, None), at(1, LEN_MAX as u32));
        assert_eq!(
            t.get(7),
            Some(VersionInfo {
                version: 5,
                deleted: false
            })
        );
        t.moved(8, 1, 2); // absent key: nothing happens
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn a_log_with_several_records_per_key_sizes_the_table_for_its_keys() {
        let mut t = VersionTable::default();
        let records: Vec<(u128, VersionInfo)> = (0..4u64)
            .flat_map(|round| {
                (0..1000u64).map(move |k| {
                    (
                        u128::from(k.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                        VersionInfo {
                            version: round,
                            deleted: false,
                        },
                    )
                })
            })
            .collect();
        t.merge_all(&records);
        assert_eq!(t.len(), 1000);
        // 1000 keys at a load factor of at most 3/4: 2048 slots, not the 8192 that 4000 records
        // would take.
        assert_eq!(t.slots.len(), 2048);
        assert!(t.iter().all(|(_, v)| v.version == 3));
    }

    #[test]
    fn empty_table_answers_none() {
        let t = VersionTable::default();
        assert_eq!(t.get(5), None);
        t.prefetch(5);
        assert_eq!(t.len(), 0);
    }
}
