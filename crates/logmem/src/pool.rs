//! The seglet pool: the engine's whole memory budget, cut into 64 KiB seglets.
//!
//! One anonymous mapping holds every seglet; seglet `i` lives at `base + i * SEGLET_BYTES`, so a
//! log reference is just (seglet id, offset). Pages are touched (and count towards RSS) only when a
//! seglet is first written. Segments chain their seglets through `next_seglet`, which readers may
//! follow without locks while they hold an epoch guard. Free seglets sit on a LIFO stack, so the
//! most recently freed (still resident, cache-warm) seglets are reused first.
//!
//! A reserve of seglets is kept for the cleaner: writers may not take the last `reserve` seglets,
//! so the cleaner can always find room for survivors (RAMCloud's cleaner segment pool).
//!
//! Memory held outside the log but inside the budget (the hash indexes, and what the server
//! charges from outside) is a *charge* in seglets: writers may not take the last
//! `reserve + charge` seglets either. The seglets stay mapped, and the cleaner and deletes keep
//! their own floors, so a charge larger than the budget makes writes fail, never deletes or the
//! cleaner.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

/// Size of one seglet. Offsets inside a seglet fit in 16 bits.
pub const SEGLET_BYTES: usize = 64 * 1024;
/// Marks "no seglet" in chains and owner tables.
pub const NO_SEGLET: u32 = u32::MAX;
/// Largest number of seglets a pool may have (a reference keeps 24 bits of seglet id): 1 TiB.
pub const SEGLETS_MAX: usize = 1 << 24;

/// Who is asking for a seglet: writers cannot dip into the cleaner's reserve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocClass {
    Writer,
    /// Deletes may use half of the reserve: a delete needs room for its tombstone, and it must be
    /// possible to delete when writes are already refused.
    Delete,
    Cleaner,
}

pub struct SegletPool {
    base: *mut u8,
    mapping_bytes: usize,
    seglet_count: usize,
    reserve_seglets: usize,
    /// Seglets of the budget held outside the log (see the module comment).
    charged_seglets: AtomicUsize,
    free: Mutex<Vec<u32>>,
    free_count: AtomicUsize,
    /// For every seglet, the next seglet of the same segment, or NO_SEGLET.
    next: Box<[AtomicU32]>,
    /// For every seglet, the segment slot that owns it, or NO_SEGLET while free.
    owner: Box<[AtomicU32]>,
    prefault: Arc<Prefault>,
    prefaulter: Option<std::thread::JoinHandle<()>>,
}

/// Bytes the prefaulter keeps populated beyond the highest seglet handed out so far.
const PREFAULT_AHEAD_BYTES: usize = 4 << 20;
/// Linux's MADV_POPULATE_WRITE (5.14+): fault pages in, writable, without changing their contents.
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// State shared with the prefault thread. A fresh pool hands seglets out in ascending order, so
/// the memory about to be used first is the next part of the mapping. The first touch of a page
/// costs a fault and a zeroing (2 MiB at once with huge pages, and more in a virtual machine whose
/// host backs guest memory lazily): measured at 4–8 ms, once per 2 MiB of new log. The thread
/// populates the mapping a few MiB ahead of use, off the request path, so writers never take those
/// faults. Already-touched pages are left as they are (POPULATE_WRITE does not modify contents),
/// and released seglets are reused from the free stack first.
struct Prefault {
    base: usize,
    mapping_bytes: usize,
    /// One past the highest seglet ever handed out.
    high: AtomicUsize,
    /// Bytes from the start of the mapping known to be populated.
    populated: AtomicUsize,
    stop: std::sync::atomic::AtomicBool,
}

impl Prefault {
    fn run(&self) {
        while !self.stop.load(Ordering::Acquire) {
            let target = (self.high.load(Ordering::Acquire) * SEGLET_BYTES + PREFAULT_AHEAD_BYTES)
                .min(self.mapping_bytes);
            let mut at = self.populated.load(Ordering::Relaxed);
            while at < target && !self.stop.load(Ordering::Acquire) {
                let len = (target - at).min(2 << 20);
                // SAFETY: [base+at, base+at+len) lies inside the mapping, which outlives this
                // thread (the pool joins it before unmapping); populating changes no contents.
                let r = unsafe {
                    libc::madvise(
                        (self.base + at) as *mut libc::c_void,
                        len,
                        MADV_POPULATE_WRITE,
                    )
                };
                if r != 0 {
                    // Unsupported (older kernel) or no memory right now: writers fault as usual.
                    // `populated` stays what it really is (it is reported as resident memory);
                    // waking this ended thread later does nothing.
                    return;
                }
                at += len;
                self.populated.store(at, Ordering::Relaxed);
            }
            std::thread::park_timeout(std::time::Duration::from_millis(100));
        }
    }
}

// SAFETY: the mapping is plain memory shared by design; all mutation of seglet contents is
// coordinated by the log (a seglet has one writer, the owner of its segment's head) and readers only
// read bytes published through the hash index with Release/Acquire ordering.
unsafe impl Send for SegletPool {}
// SAFETY: see `Send` above; the bookkeeping fields are atomics or behind a mutex.
unsafe impl Sync for SegletPool {}

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("memory budget of {0} bytes is smaller than the minimum of 4 seglets (256 KiB)")]
    TooSmall(u64),
    #[error("memory budget of {0} bytes exceeds the maximum of 1 TiB")]
    TooLarge(u64),
    #[error("cannot map {bytes} bytes of memory: {source}")]
    Map {
        bytes: usize,
        source: std::io::Error,
    },
}

impl SegletPool {
    /// Maps `memory_bytes` (rounded down to whole seglets) and puts every seglet on the free stack.
    pub fn new(memory_bytes: u64, reserve_seglets: usize) -> Result<Self, PoolError> {
        let seglet_count = (memory_bytes / SEGLET_BYTES as u64) as usize;
        if seglet_count < 4 {
            return Err(PoolError::TooSmall(memory_bytes));
        }
        if seglet_count > SEGLETS_MAX {
            return Err(PoolError::TooLarge(memory_bytes));
        }
        let mapping_bytes = seglet_count * SEGLET_BYTES;
        // SAFETY: an anonymous private mapping with no address hint; the result is checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapping_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(PoolError::Map {
                bytes: mapping_bytes,
                source: std::io::Error::last_os_error(),
            });
        }
        // Transparent huge pages cut TLB misses on the random accesses of reads and cleaning.
        advise_huge_pages(base as *mut u8, mapping_bytes);
        // Highest ids at the bottom of the stack, so seglet 0 is handed out first.
        let free: Vec<u32> = (0..seglet_count as u32).rev().collect();
        let prefault = Arc::new(Prefault {
            base: base as usize,
            mapping_bytes,
            high: AtomicUsize::new(0),
            populated: AtomicUsize::new(0),
            stop: std::sync::atomic::AtomicBool::new(false),
        });
        let prefaulter = {
            let p = prefault.clone();
            // Without the thread, writers simply take the faults themselves.
            std::thread::Builder::new()
                .name("ramlog-prefault".into())
                .spawn(move || p.run())
                .ok()
        };
        let next = (0..seglet_count)
            .map(|_| AtomicU32::new(NO_SEGLET))
            .collect();
        let owner = (0..seglet_count)
            .map(|_| AtomicU32::new(NO_SEGLET))
            .collect();
        Ok(SegletPool {
            base: base as *mut u8,
            mapping_bytes,
            seglet_count,
            reserve_seglets: reserve_seglets.min(seglet_count / 2),
            charged_seglets: AtomicUsize::new(0),
            free: Mutex::new(free),
            free_count: AtomicUsize::new(seglet_count),
            next,
            owner,
            prefault,
            prefaulter,
        })
    }

    /// Notes that `seglet` is in use; wakes the prefaulter when use approaches what it populated.
    #[inline]
    fn note_use(&self, seglet: u32) {
        let p = &self.prefault;
        let high = seglet as usize + 1;
        if high > p.high.load(Ordering::Relaxed) {
            p.high.fetch_max(high, Ordering::AcqRel);
            if high * SEGLET_BYTES + PREFAULT_AHEAD_BYTES / 2 > p.populated.load(Ordering::Relaxed)
            {
                if let Some(t) = &self.prefaulter {
                    t.thread().unpark();
                }
            }
        }
    }

    pub fn seglet_count(&self) -> usize {
        self.seglet_count
    }

    pub fn free_count(&self) -> usize {
        self.free_count.load(Ordering::Relaxed)
    }

    pub fn reserve_seglets(&self) -> usize {
        self.reserve_seglets
    }

    /// Seglets of the budget charged to memory outside the log (may exceed the pool).
    pub fn charged_seglets(&self) -> usize {
        self.charged_seglets.load(Ordering::Relaxed)
    }

    pub fn set_charged_seglets(&self, seglets: usize) {
        self.charged_seglets.store(seglets, Ordering::Relaxed);
    }

    /// Free seglets a writer may take now (beyond the reserve and the charge).
    pub fn writer_free_count(&self) -> usize {
        self.free_count()
            .saturating_sub(self.floor(AllocClass::Writer))
    }

    /// Free seglets never handed out: their memory has not been touched yet. They sit at the
    /// bottom of the free stack (handed out in ascending order, after every released seglet).
    pub fn fresh_count(&self) -> usize {
        self.seglet_count - self.prefault.high.load(Ordering::Relaxed)
    }

    /// Bytes of the mapping that are resident: every seglet handed out so far, and what the
    /// prefaulter populated ahead of them (at most `PREFAULT_AHEAD_BYTES` more).
    pub fn resident_bytes(&self) -> usize {
        let handed_out = self.prefault.high.load(Ordering::Relaxed) * SEGLET_BYTES;
        handed_out
            .max(self.prefault.populated.load(Ordering::Relaxed))
            .min(self.mapping_bytes)
    }

    /// Takes one free seglet for `segment`, or None when none is available to this class.
    pub fn alloc(&self, class: AllocClass, segment: u32) -> Option<u32> {
        let mut free = self.free.lock();
        let floor = self.floor(class);
        if free.len() <= floor {
            return None;
        }
        let seglet = free.pop()?;
        self.free_count.store(free.len(), Ordering::Relaxed);
        drop(free);
        self.note_use(seglet);
        self.next[seglet as usize].store(NO_SEGLET, Ordering::Relaxed);
        self.owner[seglet as usize].store(segment, Ordering::Release);
        Some(seglet)
    }

    /// Takes `count` seglets at once, or none of them.
    pub fn alloc_many(
        &self,
        class: AllocClass,
        segment: u32,
        count: usize,
        out: &mut Vec<u32>,
    ) -> bool {
        let mut free = self.free.lock();
        let floor = self.floor(class);
        if free.len() < floor.saturating_add(count) {
            return false;
        }
        for _ in 0..count {
            let seglet = free.pop().expect("length checked above");
            self.next[seglet as usize].store(NO_SEGLET, Ordering::Relaxed);
            self.owner[seglet as usize].store(segment, Ordering::Release);
            out.push(seglet);
        }
        self.free_count.store(free.len(), Ordering::Relaxed);
        drop(free);
        if let Some(&top) = out.iter().max() {
            self.note_use(top);
        }
        true
    }

    fn floor(&self, class: AllocClass) -> usize {
        match class {
            AllocClass::Writer => self
                .reserve_seglets
                .saturating_add(self.charged_seglets.load(Ordering::Relaxed)),
            AllocClass::Delete => self.reserve_seglets / 2,
            AllocClass::Cleaner => 0,
        }
    }

    /// Returns seglets to the pool. The caller guarantees no reader can still reach them.
    pub fn release(&self, seglets: &[u32]) {
        for &s in seglets {
            debug_assert!((s as usize) < self.seglet_count);
            self.owner[s as usize].store(NO_SEGLET, Ordering::Relaxed);
            self.next[s as usize].store(NO_SEGLET, Ordering::Relaxed);
        }
        let mut free = self.free.lock();
        free.extend_from_slice(seglets);
        debug_assert!(free.len() <= self.seglet_count, "a seglet was freed twice");
        self.free_count.store(free.len(), Ordering::Relaxed);
    }

    pub fn next_seglet(&self, seglet: u32) -> u32 {
        self.next[seglet as usize].load(Ordering::Acquire)
    }

    pub fn set_next_seglet(&self, seglet: u32, next: u32) {
        self.next[seglet as usize].store(next, Ordering::Release);
    }

    pub fn owner(&self, seglet: u32) -> u32 {
        self.owner[seglet as usize].load(Ordering::Acquire)
    }

    /// Pointer to the first byte of a seglet.
    #[inline]
    pub fn seglet_ptr(&self, seglet: u32) -> *mut u8 {
        assert!(
            (seglet as usize) < self.seglet_count,
            "seglet {seglet} out of range"
        );
        // SAFETY: seglet < seglet_count, so the offset stays inside the mapping.
        unsafe { self.base.add(seglet as usize * SEGLET_BYTES) }
    }

    /// The bytes of a seglet from `offset` to its end.
    ///
    /// # Safety
    /// The caller must hold an epoch guard (or own the seglet) so that it is not reused meanwhile, and
    /// must only read bytes that were published before the reference that led here.
    #[inline]
    pub unsafe fn seglet_tail(&self, seglet: u32, offset: usize) -> &[u8] {
        assert!(offset <= SEGLET_BYTES);
        // SAFETY: in bounds by the assertion; liveness is the caller's obligation.
        unsafe {
            std::slice::from_raw_parts(self.seglet_ptr(seglet).add(offset), SEGLET_BYTES - offset)
        }
    }

    /// Copies `bytes` into a seglet at `offset`.
    ///
    /// # Safety
    /// The caller must own the seglet's write position: no other thread writes these bytes, and no
    /// reader has been given a reference to them yet.
    #[inline]
    pub unsafe fn write(&self, seglet: u32, offset: usize, bytes: &[u8]) {
        assert!(
            offset + bytes.len() <= SEGLET_BYTES,
            "write past seglet end"
        );
        // SAFETY: in bounds by the assertion; exclusivity is the caller's obligation.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.seglet_ptr(seglet).add(offset),
                bytes.len(),
            )
        }
    }
}

/// Asks for transparent huge pages on the 2 MiB-aligned interior of a range (a hint; ignored where
/// THP is disabled).
pub(crate) fn advise_huge_pages(ptr: *mut u8, len: usize) {
    const HUGE: usize = 2 << 20;
    let start = (ptr as usize).div_ceil(HUGE) * HUGE;
    let end = (ptr as usize + len) / HUGE * HUGE;
    if end > start {
        // SAFETY: the range lies inside a mapping owned by the caller; madvise only changes paging.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

impl Drop for SegletPool {
    fn drop(&mut self) {
        self.prefault.stop.store(true, Ordering::Release);
        if let Some(t) = self.prefaulter.take() {
            t.thread().unpark();
            let _ = t.join();
        }
        // SAFETY: the mapping was created in `new` with this length and is not used after drop.
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.mapping_bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefaulter_stays_ahead_of_use_and_stops_with_the_pool() {
        let pool = SegletPool::new(512 * SEGLET_BYTES as u64, 0).unwrap();
        let mut got = Vec::new();
        assert!(pool.alloc_many(AllocClass::Writer, 0, 100, &mut got));
        let want = (100 * SEGLET_BYTES + PREFAULT_AHEAD_BYTES).min(pool.mapping_bytes);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while pool.prefault.populated.load(Ordering::Relaxed) < want {
            assert!(
                std::time::Instant::now() < deadline,
                "prefaulter made no progress"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Using more moves the populated prefix along (here to the end of the mapping).
        assert!(pool.alloc_many(AllocClass::Writer, 0, 400, &mut got));
        while pool.prefault.populated.load(Ordering::Relaxed) < pool.mapping_bytes {
            assert!(
                std::time::Instant::now() < deadline,
                "prefaulter stopped following use"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let thread = pool.prefaulter.as_ref().map(|t| t.thread().id());
        assert!(thread.is_some(), "the prefault thread did not start");
        drop(pool); // stops and joins the thread; a hang here fails the test run
    }

    #[test]
    fn alloc_respects_reserve() {
        let pool = SegletPool::new(16 * SEGLET_BYTES as u64, 4).unwrap();
        let mut got = Vec::new();
        while let Some(s) = pool.alloc(AllocClass::Writer, 0) {
            got.push(s);
        }
        assert_eq!(got.len(), 12, "writers stop at the reserve");
        assert!(
            pool.alloc(AllocClass::Cleaner, 1).is_some(),
            "the cleaner may use the reserve"
        );
        pool.release(&got);
        assert_eq!(pool.free_count(), 15);
    }

    #[test]
    fn a_charge_keeps_writers_out_but_not_deletes_or_the_cleaner() {
        let pool = SegletPool::new(16 * SEGLET_BYTES as u64, 4).unwrap();
        pool.set_charged_seglets(6);
        assert_eq!(pool.writer_free_count(), 6);
        let mut got = Vec::new();
        while let Some(s) = pool.alloc(AllocClass::Writer, 0) {
            got.push(s);
        }
        assert_eq!(got.len(), 6, "writers stop at reserve + charge");
        assert!(!pool.alloc_many(AllocClass::Writer, 0, 1, &mut got));
        // A charge beyond the whole pool: writers get nothing, deletes still get their half of
        // the reserve, the cleaner everything.
        pool.set_charged_seglets(usize::MAX);
        assert_eq!(pool.writer_free_count(), 0);
        assert!(pool.alloc(AllocClass::Writer, 0).is_none());
        assert!(!pool.alloc_many(AllocClass::Writer, 0, 1, &mut got));
        let delete = pool
            .alloc(AllocClass::Delete, 0)
            .expect("deletes ignore the charge");
        assert!(pool.alloc(AllocClass::Cleaner, 0).is_some());
        // The charge drops: writers may take seglets again.
        pool.set_charged_seglets(0);
        pool.release(&[delete]);
        assert!(pool.alloc(AllocClass::Writer, 0).is_some());
    }

    #[test]
    fn write_and_read_back() {
        let pool = SegletPool::new(8 * SEGLET_BYTES as u64, 0).unwrap();
        let s = pool.alloc(AllocClass::Writer, 3).unwrap();
        assert_eq!(pool.owner(s), 3);
        // SAFETY: we own the freshly allocated seglet.
        unsafe {
            pool.write(s, 100, b"hello");
            assert_eq!(&pool.seglet_tail(s, 100)[..5], b"hello");
        }
    }

    #[test]
    fn rejects_tiny_budget() {
        assert!(matches!(
            SegletPool::new(1000, 0),
            Err(PoolError::TooSmall(_))
        ));
    }
}
