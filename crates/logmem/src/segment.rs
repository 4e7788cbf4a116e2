//! Segments: the unit of appending and cleaning. A segment is a chain of up to `segment_seglets`
//! seglets holding entries back to back; its metadata (state, owner tablet, live bytes, age) lives
//! here, outside the log bytes, and is rebuilt by nobody: it is volatile like the hash index.

use crate::index::{make_loc, Loc};
use crate::pool::{AllocClass, SegletPool, NO_SEGLET, SEGLET_BYTES};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicU8, Ordering};

/// Lifecycle of a segment slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum SegmentState {
    Free = 0,
    /// Being appended to: a tablet's head, or a cleaner's survivor.
    Open = 1,
    /// Immutable and eligible for cleaning.
    Closed = 2,
    /// Claimed by a cleaner pass.
    Cleaning = 3,
    /// Cleaned; its seglets go back to the pool after an epoch grace period. Scans skip it.
    Retired = 4,
}

pub struct SegmentSlot {
    state: AtomicU8,
    pub tablet: AtomicU32,
    pub first_seglet: AtomicU32,
    pub seglet_count: AtomicU32,
    /// Bytes of entries appended; entries are parsed from 0 to here.
    pub used_bytes: AtomicU32,
    /// Bytes of entries still referenced by the hash index.
    pub live_bytes: AtomicI64,
    /// Value of the engine clock when the segment's data was first written (its age).
    pub created: AtomicU64,
    /// Bytes of superseded entries kept for snapshots (RETAINED), included in `live_bytes`.
    pub retained_bytes: AtomicI64,
    /// The largest valid-to of the RETAINED entries it received: once every open snapshot is at or
    /// above it, all of them are garbage.
    pub retained_valid_to_max: AtomicU64,
    /// Scans that still have to read this segment; the cleaner leaves pinned segments alone.
    pub pins: AtomicU32,
    /// While pinned: the largest `used_bytes` a pinning scan captured. Cleaner copies placed below
    /// it may not be swapped in (the scan reads that range and must see no state change there).
    pub pinned_upto: AtomicU32,
    /// When the expiry sweep should next walk this segment (Unix ms; `u64::MAX`: never). Writers
    /// and cleaner copies lower it to their objects' expiry times; the sweep
    /// (`cleaner::sweep_expired`) raises it after removing expired objects, to when a tenth of
    /// the expiring objects left, or the earliest of them ten seconds ago, has expired.
    pub expire_min_ms: AtomicU64,
}

impl SegmentSlot {
    fn new() -> Self {
        SegmentSlot {
            state: AtomicU8::new(SegmentState::Free as u8),
            tablet: AtomicU32::new(0),
            first_seglet: AtomicU32::new(NO_SEGLET),
            seglet_count: AtomicU32::new(0),
            used_bytes: AtomicU32::new(0),
            live_bytes: AtomicI64::new(0),
            created: AtomicU64::new(0),
            retained_bytes: AtomicI64::new(0),
            retained_valid_to_max: AtomicU64::new(0),
            pins: AtomicU32::new(0),
            pinned_upto: AtomicU32::new(0),
            expire_min_ms: AtomicU64::new(u64::MAX),
        }
    }

    pub fn state(&self) -> SegmentState {
        match self.state.load(Ordering::Acquire) {
            0 => SegmentState::Free,
            1 => SegmentState::Open,
            2 => SegmentState::Closed,
            3 => SegmentState::Cleaning,
            _ => SegmentState::Retired,
        }
    }

    pub fn set_state(&self, s: SegmentState) {
        self.state.store(s as u8, Ordering::Release);
    }

    /// Moves Closed → Cleaning; false if another cleaner got there first or the segment is not closed.
    pub fn claim(&self) -> bool {
        if self.pins.load(Ordering::Acquire) != 0 {
            return false;
        }
        self.state
            .compare_exchange(
                SegmentState::Closed as u8,
                SegmentState::Cleaning as u8,
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
    }
}

pub struct SegmentTable {
    slots: Box<[SegmentSlot]>,
    free: Mutex<Vec<u32>>,
}

impl SegmentTable {
    /// Every segment holds at least one seglet, so there are never more segments than seglets.
    pub fn new(count: usize) -> Self {
        SegmentTable {
            slots: (0..count).map(|_| SegmentSlot::new()).collect(),
            free: Mutex::new((0..count as u32).rev().collect()),
        }
    }

    pub fn get(&self, id: u32) -> &SegmentSlot {
        &self.slots[id as usize]
    }

    /// Slots in the table (free or not).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, &SegmentSlot)> {
        self.slots.iter().enumerate().map(|(i, s)| (i as u32, s))
    }

    fn take(&self) -> Option<u32> {
        self.free.lock().pop()
    }

    fn give_back(&self, id: u32) {
        self.free.lock().push(id);
    }

    /// Frees a segment's seglets and its slot. Only call once no reader can reach its bytes.
    pub fn release(&self, pool: &SegletPool, id: u32) {
        let slot = self.get(id);
        let mut seglets = Vec::with_capacity(slot.seglet_count.load(Ordering::Relaxed) as usize);
        let mut s = slot.first_seglet.load(Ordering::Acquire);
        while s != NO_SEGLET {
            seglets.push(s);
            s = pool.next_seglet(s);
        }
        debug_assert_eq!(
            seglets.len(),
            slot.seglet_count.load(Ordering::Relaxed) as usize
        );
        pool.release(&seglets);
        slot.first_seglet.store(NO_SEGLET, Ordering::Relaxed);
        slot.seglet_count.store(0, Ordering::Relaxed);
        slot.used_bytes.store(0, Ordering::Relaxed);
        slot.live_bytes.store(0, Ordering::Relaxed);
        slot.retained_bytes.store(0, Ordering::Relaxed);
        slot.retained_valid_to_max.store(0, Ordering::Relaxed);
        slot.expire_min_ms.store(u64::MAX, Ordering::Relaxed);
        debug_assert_eq!(slot.pins.load(Ordering::Relaxed), 0);
        slot.set_state(SegmentState::Free);
        self.give_back(id);
    }
}

/// Why an append could not be placed.
#[derive(Debug, PartialEq, Eq)]
pub enum AppendError {
    /// The entry does not fit in what is left of this segment: open a new one.
    SegmentFull,
    /// No free seglet is available to this allocation class.
    NoMemory,
}

/// The append cursor of one open segment (a tablet head or a cleaner survivor).
pub struct SegmentWriter {
    pub segment: u32,
    seglets: Vec<u32>,
    used: usize,
    capacity: usize,
}

impl SegmentWriter {
    /// Opens a new segment for `tablet` that may grow to `segment_seglets` seglets, with one
    /// seglet, or fails for lack of memory.
    pub fn open(
        table: &SegmentTable,
        pool: &SegletPool,
        class: AllocClass,
        tablet: u32,
        created: u64,
        segment_seglets: usize,
    ) -> Result<Self, AppendError> {
        let segment = table.take().ok_or(AppendError::NoMemory)?;
        let Some(first) = pool.alloc(class, segment) else {
            table.give_back(segment);
            return Err(AppendError::NoMemory);
        };
        let slot = table.get(segment);
        slot.tablet.store(tablet, Ordering::Relaxed);
        slot.first_seglet.store(first, Ordering::Release);
        slot.seglet_count.store(1, Ordering::Relaxed);
        slot.used_bytes.store(0, Ordering::Relaxed);
        slot.live_bytes.store(0, Ordering::Relaxed);
        slot.retained_bytes.store(0, Ordering::Relaxed);
        slot.retained_valid_to_max.store(0, Ordering::Relaxed);
        slot.expire_min_ms.store(u64::MAX, Ordering::Relaxed);
        slot.created.store(created, Ordering::Relaxed);
        slot.set_state(SegmentState::Open);
        let mut seglets = Vec::with_capacity(segment_seglets);
        seglets.push(first);
        Ok(SegmentWriter {
            segment,
            seglets,
            used: 0,
            capacity: segment_seglets * SEGLET_BYTES,
        })
    }

    pub fn used(&self) -> usize {
        self.used
    }

    /// Seglets allocated so far.
    pub fn seglet_count(&self) -> usize {
        self.seglets.len()
    }

    /// Whether appending `len` more bytes needs another seglet.
    pub fn needs_seglet(&self, len: usize) -> bool {
        self.used + len > self.seglets.len() * SEGLET_BYTES
    }

    /// Lowers the segment's capacity to `seglets` seglets, or to the seglets it already holds if
    /// that is more: appends that would need a seglet beyond it find the segment full.
    pub fn limit_capacity(&mut self, seglets: usize) {
        let bytes = seglets.max(self.seglets.len()) * SEGLET_BYTES;
        self.capacity = self.capacity.min(bytes);
    }

    /// Makes room for `len` more bytes, allocating seglets as needed (all or nothing).
    pub fn reserve(
        &mut self,
        table: &SegmentTable,
        pool: &SegletPool,
        len: usize,
        class: AllocClass,
    ) -> Result<(), AppendError> {
        let end = self.used + len;
        if end > self.capacity {
            return Err(AppendError::SegmentFull);
        }
        let needed = end.div_ceil(SEGLET_BYTES).max(1);
        if needed > self.seglets.len() {
            let mut fresh = Vec::with_capacity(needed - self.seglets.len());
            if !pool.alloc_many(class, self.segment, needed - self.seglets.len(), &mut fresh) {
                return Err(AppendError::NoMemory);
            }
            for s in fresh {
                let last = *self
                    .seglets
                    .last()
                    .expect("a segment has at least one seglet");
                pool.set_next_seglet(last, s);
                self.seglets.push(s);
            }
            table
                .get(self.segment)
                .seglet_count
                .store(self.seglets.len() as u32, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Where the next byte goes.
    pub fn position(&self) -> Loc {
        let k = self.used / SEGLET_BYTES;
        make_loc(self.seglets[k], self.used % SEGLET_BYTES)
    }

    /// Appends bytes at the cursor; `reserve` must have made room.
    pub fn write(&mut self, pool: &SegletPool, mut bytes: &[u8]) {
        assert!(
            self.used + bytes.len() <= self.seglets.len() * SEGLET_BYTES,
            "write beyond reserved seglets"
        );
        while !bytes.is_empty() {
            let k = self.used / SEGLET_BYTES;
            let off = self.used % SEGLET_BYTES;
            let n = bytes.len().min(SEGLET_BYTES - off);
            // SAFETY: this writer owns the segment's append position; the range was reserved and
            // nothing references it yet (references are published after the write).
            unsafe { pool.write(self.seglets[k], off, &bytes[..n]) };
            self.used += n;
            bytes = &bytes[n..];
        }
    }

    /// Publishes the appended length so cleaners and scans may parse up to it.
    pub fn publish(&self, table: &SegmentTable) {
        table
            .get(self.segment)
            .used_bytes
            .store(self.used as u32, Ordering::Release);
    }

    /// Closes the segment. Seglets are allocated on demand, so at most the last one is partly empty.
    pub fn close(self, table: &SegmentTable) -> u32 {
        self.publish(table);
        table.get(self.segment).set_state(SegmentState::Closed);
        self.segment
    }

    /// Gives back a segment that received no entries.
    pub fn abandon(self, table: &SegmentTable, pool: &SegletPool) {
        debug_assert_eq!(self.used, 0);
        table.release(pool, self.segment);
    }
}
