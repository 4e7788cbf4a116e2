//! A tablet's hash index: cache-line buckets of tagged log references that grow by linear hashing.
//!
//! Each bucket is one 64-byte cache line of eight 64-bit slots. A slot is empty (0), a reference to a
//! log entry (`VALID | HISTORIC? | tag << 40 | location`), or, in the last slot only, a link to an
//! overflow bucket (`CHAIN | overflow id`). The 21-bit tag comes from hash bits the bucket number does
//! not use, so a lookup touches about one object per probe. A key has at most one current reference;
//! HISTORIC references point at superseded versions an open snapshot may still read (MVCC), so the
//! cleaner relocates them with the same single swap as current ones.
//!
//! The table grows one bucket at a time (linear hashing): when the load passes `LOAD_MAX`, bucket
//! `split` is split into `split` and `split + 2^level * BUCKETS_INITIAL`. There is never a
//! stop-the-world rehash, and bucket arrays are never moved: the directory holds arrays of doubling
//! size. Overflow buckets come from chunked arenas, so no object ever has a heap allocation of its own.
//!
//! Concurrency: one mutator at a time (the caller holds the tablet's write lock), any number of
//! lock-free readers. A split first copies the moving references into the new bucket, then publishes
//! the new shape, then clears the old slots; a reader that misses re-checks the shape and retries, so
//! it never misses a key that was present throughout. References only move towards higher bucket
//! numbers, which gives cursor scans Redis's "every key present throughout is returned" guarantee.

use crossbeam_epoch as epoch;
use parking_lot::Mutex;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::Arc;

const SLOTS: usize = 8;
const BUCKETS_INITIAL_LOG2: u32 = 4;
const BUCKETS_INITIAL: u64 = 1 << BUCKETS_INITIAL_LOG2;
const DIR_ARRAYS: usize = 44;
/// Overflow buckets live in chunks of doubling size: chunk `k` holds `OVERFLOW_FIRST << k` buckets.
const OVERFLOW_FIRST_LOG2: u32 = 8;
const OVERFLOW_FIRST: u64 = 1 << OVERFLOW_FIRST_LOG2;
const OVERFLOW_CHUNKS: usize = 40;
/// Average references per slot above which a bucket is split.
const LOAD_MAX: f64 = 0.9;

const CHAIN: u64 = 1 << 63;
const VALID: u64 = 1 << 62;
const HISTORIC: u64 = 1 << 61;
const TAG_SHIFT: u32 = 40;
const TAG_MASK: u64 = (1 << 21) - 1;
const LOC_MASK: u64 = (1 << 40) - 1;
/// The bits of a key hash that become a reference's tag.
pub(crate) const TAG_BITS: u64 = TAG_MASK << TAG_SHIFT;
/// The lowest tag bit: `hash_key` sets it on user keys whose tag would be 0, the internal keys' tag.
pub(crate) const TAG_LOWEST: u64 = 1 << TAG_SHIFT;

/// Whether a reference (or a hash) carries the internal keys' tag, 0.
#[inline]
fn internal_ref(v: u64) -> bool {
    (v >> TAG_SHIFT) & TAG_MASK == 0
}

/// A location in the log: seglet id (24 bits) and offset inside it (16 bits).
pub type Loc = u64;

#[inline]
pub fn make_loc(seglet: u32, offset: usize) -> Loc {
    debug_assert!(offset < 1 << 16 && (seglet as u64) < 1 << 24);
    ((seglet as u64) << 16) | offset as u64
}

#[inline]
pub fn loc_seglet(loc: Loc) -> u32 {
    (loc >> 16) as u32
}

#[inline]
pub fn loc_offset(loc: Loc) -> usize {
    (loc & 0xFFFF) as usize
}

#[inline]
fn tag_of(hash: u64) -> u64 {
    (hash >> TAG_SHIFT) & TAG_MASK
}

#[inline]
fn make_ref(hash: u64, loc: Loc) -> u64 {
    VALID | (tag_of(hash) << TAG_SHIFT) | loc
}

#[repr(C, align(64))]
pub struct Bucket {
    slots: [AtomicU64; SLOTS],
}

/// Where a reference sits, so that the owner of the write lock can replace or clear it.
///
/// A SlotRef found without the lock (by `find_loc`) is only a hint: references move between slots
/// when buckets split or chains shrink, so under the lock it must pass `holds` before it is used.
#[derive(Clone, Copy)]
pub struct SlotRef(*const AtomicU64);

impl SlotRef {
    #[inline]
    fn get(&self) -> &AtomicU64 {
        // SAFETY: slot pointers point into bucket arrays (directory arrays and overflow buckets)
        // that are freed only when the index is dropped, and the index outlives every SlotRef
        // (SlotRefs live within one call on the index's owner, never stored beyond it).
        unsafe { &*self.0 }
    }
}

pub struct HashIndex {
    /// `level << 58 | moves << 40 | split`; the bucket count is `BUCKETS_INITIAL << level` plus
    /// `split`. `moves` changes whenever references move between slots, so that a reader that
    /// missed while anything moved retries.
    shape: AtomicU64,
    dir: [AtomicPtr<Bucket>; DIR_ARRAYS],
    overflow: [AtomicPtr<Bucket>; OVERFLOW_CHUNKS],
    overflow_used: AtomicU64,
    /// Overflow buckets unlinked from chains, zeroed, whose grace period has passed: reused first.
    overflow_ready: Arc<Mutex<Vec<u64>>>,
    overflow_in_use: AtomicU64,
    entries: AtomicU64,
    /// How many of `entries` are HISTORIC.
    historic: AtomicU64,
    /// How many of `entries` are current references to internal keys (tag 0).
    internal: AtomicU64,
    /// While non-zero, inserts do not split buckets (a full index walk is running, and references
    /// must not move between buckets under it); growth catches up afterwards.
    split_hold: std::sync::atomic::AtomicU32,
}

const LEVEL_SHIFT: u32 = 58;
const MOVES_SHIFT: u32 = 40;
const MOVES_MASK: u64 = (1 << 18) - 1;
const SPLIT_MASK: u64 = (1 << 40) - 1;

#[inline]
fn shape_level(shape: u64) -> u64 {
    shape >> LEVEL_SHIFT
}

#[inline]
fn shape_split(shape: u64) -> u64 {
    shape & SPLIT_MASK
}

#[inline]
fn shape_moves(shape: u64) -> u64 {
    (shape >> MOVES_SHIFT) & MOVES_MASK
}

#[inline]
fn make_shape(level: u64, moves: u64, split: u64) -> u64 {
    debug_assert!(split <= SPLIT_MASK);
    (level << LEVEL_SHIFT) | ((moves & MOVES_MASK) << MOVES_SHIFT) | split
}

// SAFETY: raw bucket pointers are owned by the index and only freed in Drop.
unsafe impl Send for HashIndex {}
// SAFETY: mutation is single-writer (the tablet lock) through atomics; readers use atomics only.
unsafe impl Sync for HashIndex {}

fn array_len(k: usize) -> usize {
    if k == 0 {
        BUCKETS_INITIAL as usize
    } else {
        (BUCKETS_INITIAL as usize) << (k - 1)
    }
}

/// Bucket arrays (directory arrays and overflow chunks) of at least this many bytes are mapped from
/// the kernel directly: their pages are zero and take memory only when first written. (An aligned
/// `alloc_zeroed` zeroes the whole array with stores, so the newest directory array, up to half of
/// the index, would be resident before linear hashing reaches it.) 64 KiB (1,024 buckets) keeps
/// the waste of a server's many small tablet indexes small too. Arrays double in size, so an index
/// has at most `DIR_ARRAYS + OVERFLOW_CHUNKS` of them.
const MAPPED_ARRAY_BYTES: usize = 64 << 10;

/// Where a bucket array's memory comes from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Backing {
    /// `alloc_zeroed`: small arrays.
    Heap,
    /// An anonymous mapping: large arrays.
    Mapped,
}

/// Number of buckets in overflow chunk `k`.
fn overflow_chunk_len(k: usize) -> usize {
    (OVERFLOW_FIRST as usize) << k
}

/// The chunk holding overflow bucket `id`, and the bucket's offset in it. Chunks `0..k` hold
/// `OVERFLOW_FIRST * (2^k - 1)` buckets together.
#[inline]
fn overflow_place(id: u64) -> (usize, usize) {
    let q = (id >> OVERFLOW_FIRST_LOG2) + 1;
    let k = (63 - q.leading_zeros()) as usize;
    let before = OVERFLOW_FIRST * ((1u64 << k) - 1);
    (k, (id - before) as usize)
}

fn backing(buckets: usize) -> Backing {
    if buckets * std::mem::size_of::<Bucket>() >= MAPPED_ARRAY_BYTES {
        Backing::Mapped
    } else {
        Backing::Heap
    }
}

fn alloc_buckets(n: usize, backing: Backing) -> *mut Bucket {
    let layout = Layout::array::<Bucket>(n).expect("bucket array layout");
    let ptr = match backing {
        Backing::Mapped => {
            // SAFETY: an anonymous private mapping with no address hint; the result is checked
            // below. Anonymous pages read as zero, and all-zero bytes are valid AtomicU64s (empty
            // slots).
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    layout.size(),
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                std::ptr::null_mut()
            } else {
                p as *mut Bucket
            }
        }
        // SAFETY: the layout is non-zero sized; all-zero bytes are valid AtomicU64s (empty slots).
        Backing::Heap => unsafe { alloc_zeroed(layout) as *mut Bucket },
    };
    if ptr.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    crate::pool::advise_huge_pages(ptr as *mut u8, layout.size());
    ptr
}

/// Frees an array `alloc_buckets(n, backing)` returned.
///
/// # Safety
/// `ptr` came from `alloc_buckets(n, backing)` with the same `n` and `backing`, and nothing refers
/// to the array any more.
unsafe fn free_buckets(ptr: *mut Bucket, n: usize, backing: Backing) {
    let layout = Layout::array::<Bucket>(n).expect("bucket array layout");
    match backing {
        // SAFETY: the caller's contract: a mapping of exactly this length made by alloc_buckets.
        Backing::Mapped => unsafe {
            libc::munmap(ptr as *mut libc::c_void, layout.size());
        },
        // SAFETY: the caller's contract: allocated by alloc_zeroed with this layout.
        Backing::Heap => unsafe { dealloc(ptr as *mut u8, layout) },
    }
}

impl Default for HashIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl HashIndex {
    pub fn new() -> Self {
        let dir: [AtomicPtr<Bucket>; DIR_ARRAYS] =
            std::array::from_fn(|_| AtomicPtr::new(std::ptr::null_mut()));
        dir[0].store(
            alloc_buckets(array_len(0), backing(array_len(0))),
            Ordering::Release,
        );
        let overflow: [AtomicPtr<Bucket>; OVERFLOW_CHUNKS] =
            std::array::from_fn(|_| AtomicPtr::new(std::ptr::null_mut()));
        HashIndex {
            shape: AtomicU64::new(0),
            dir,
            overflow,
            overflow_used: AtomicU64::new(0),
            overflow_ready: Arc::new(Mutex::new(Vec::new())),
            overflow_in_use: AtomicU64::new(0),
            entries: AtomicU64::new(0),
            historic: AtomicU64::new(0),
            internal: AtomicU64::new(0),
            split_hold: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// Number of keys (current references).
    pub fn len(&self) -> u64 {
        self.entries
            .load(Ordering::Relaxed)
            .saturating_sub(self.historic.load(Ordering::Relaxed))
    }

    /// Number of current references to internal keys (counted in [`HashIndex::len`]).
    pub fn internal_len(&self) -> u64 {
        self.internal.load(Ordering::Relaxed)
    }

    /// Number of HISTORIC references (versions kept for snapshots).
    pub fn historic_len(&self) -> u64 {
        self.historic.load(Ordering::Relaxed)
    }

    /// Number of main buckets (not counting overflow buckets).
    pub fn bucket_count(&self) -> u64 {
        let shape = self.shape.load(Ordering::Acquire);
        (BUCKETS_INITIAL << shape_level(shape)) + shape_split(shape)
    }

    /// Bytes of buckets in use (main and overflow). Bucket arrays are allocated zeroed and grow by
    /// doubling, so the untouched tail of the newest array costs address space, not memory.
    pub fn memory_bytes(&self) -> u64 {
        (self.bucket_count() + self.overflow_in_use.load(Ordering::Relaxed)) * 64
    }

    /// Number of overflow buckets in use.
    #[cfg(test)]
    pub fn overflow_buckets(&self) -> u64 {
        self.overflow_in_use.load(Ordering::Relaxed)
    }

    #[inline]
    fn bucket_of(shape: u64, hash: u64) -> u64 {
        let level = shape_level(shape);
        let split = shape_split(shape);
        let m = BUCKETS_INITIAL << level;
        let b = hash & (m - 1);
        if b < split {
            hash & (2 * m - 1)
        } else {
            b
        }
    }

    #[inline]
    fn bucket(&self, b: u64) -> &Bucket {
        let (k, off) = if b < BUCKETS_INITIAL {
            (0usize, b as usize)
        } else {
            let q = b >> BUCKETS_INITIAL_LOG2;
            let k = (63 - q.leading_zeros()) as usize + 1;
            (k, (b - (BUCKETS_INITIAL << (k - 1))) as usize)
        };
        let arr = self.dir[k].load(Ordering::Acquire);
        assert!(
            !arr.is_null(),
            "bucket {b} addressed before its array exists"
        );
        // SAFETY: off < array_len(k) by construction, and arrays live until Drop.
        unsafe { &*arr.add(off) }
    }

    #[inline]
    fn overflow_bucket(&self, id: u64) -> &Bucket {
        let (k, offset) = overflow_place(id);
        let chunk = self.overflow[k].load(Ordering::Acquire);
        assert!(!chunk.is_null(), "overflow bucket {id} has no chunk");
        // SAFETY: `overflow_place` returns an offset below the chunk's length; chunks live until
        // Drop.
        unsafe { &*chunk.add(offset) }
    }

    /// Visits every reference of the chain starting at bucket `b`; stops when `f` returns true.
    #[inline]
    fn walk_chain<'a>(
        &'a self,
        mut bucket: &'a Bucket,
        mut f: impl FnMut(&'a AtomicU64, u64) -> bool,
    ) -> bool {
        loop {
            for i in 0..SLOTS - 1 {
                let v = bucket.slots[i].load(Ordering::Acquire);
                if v != 0 && f(&bucket.slots[i], v) {
                    return true;
                }
            }
            let last = &bucket.slots[SLOTS - 1];
            let v = last.load(Ordering::Acquire);
            if v & CHAIN != 0 {
                bucket = self.overflow_bucket(v & !CHAIN);
                continue;
            }
            return v != 0 && f(last, v);
        }
    }

    /// Finds the reference whose tag matches `hash` and for which `is_key(loc)` is true.
    /// Lock-free; safe to call concurrently with the single mutator.
    #[inline]
    pub fn lookup(&self, hash: u64, mut is_key: impl FnMut(Loc) -> bool) -> Option<(SlotRef, Loc)> {
        let tag = tag_of(hash);
        loop {
            let shape = self.shape.load(Ordering::Acquire);
            let bucket = self.bucket(Self::bucket_of(shape, hash));
            let mut found = None;
            self.walk_chain(bucket, |slot, v| {
                if (v >> TAG_SHIFT) & TAG_MASK == tag && v & (VALID | HISTORIC) == VALID {
                    let loc = v & LOC_MASK;
                    if is_key(loc) {
                        found = Some((SlotRef(slot as *const _), loc));
                        return true;
                    }
                }
                false
            });
            if found.is_some() || self.shape.load(Ordering::Acquire) == shape {
                return found;
            }
        }
    }

    /// Calls `f(loc, historic)` for every reference (current and HISTORIC) whose tag matches `hash`,
    /// as one consistent view: a walk that overlapped a move is repeated. `f` may see a location
    /// twice (a reference being moved by a split); callers deduplicate by location.
    pub fn lookup_versions(&self, hash: u64, out: &mut Vec<(Loc, bool)>) {
        let tag = tag_of(hash);
        loop {
            out.clear();
            let shape = self.shape.load(Ordering::Acquire);
            let bucket = self.bucket(Self::bucket_of(shape, hash));
            self.walk_chain(bucket, |_, v| {
                if (v >> TAG_SHIFT) & TAG_MASK == tag && v & VALID != 0 {
                    out.push((v & LOC_MASK, v & HISTORIC != 0));
                }
                false
            });
            if self.shape.load(Ordering::Acquire) == shape {
                return;
            }
        }
    }

    /// Starts loading the bucket `hash` maps to, so that a later lookup finds it in cache.
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        let shape = self.shape.load(Ordering::Acquire);
        let bucket = self.bucket(Self::bucket_of(shape, hash));
        #[cfg(target_arch = "x86_64")]
        // SAFETY: prefetching is a hint; the address is a valid bucket.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                bucket as *const Bucket as *const i8,
            );
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = bucket;
    }

    /// Calls `f` with the location of every current reference in the first bucket of `hash`'s
    /// chain whose tag matches it, with no key comparison: for prefetching the entries a later
    /// [`HashIndex::lookup`] compares keys with. A hint; a concurrent move may hide one.
    #[inline]
    pub fn tag_matches(&self, hash: u64, mut f: impl FnMut(Loc)) {
        let tag = tag_of(hash);
        let bucket = self.bucket(Self::bucket_of(self.shape.load(Ordering::Acquire), hash));
        for slot in &bucket.slots[..SLOTS - 1] {
            let v = slot.load(Ordering::Relaxed);
            if (v >> TAG_SHIFT) & TAG_MASK == tag && v & (VALID | HISTORIC) == VALID {
                f(v & LOC_MASK);
            }
        }
    }

    /// Finds the slot that holds exactly `loc` (the cleaner's liveness test: no key comparison).
    pub fn find_loc(&self, hash: u64, loc: Loc) -> Option<SlotRef> {
        let want = make_ref(hash, loc);
        loop {
            let shape = self.shape.load(Ordering::Acquire);
            let bucket = self.bucket(Self::bucket_of(shape, hash));
            let mut found = None;
            self.walk_chain(bucket, |slot, v| {
                if v & !HISTORIC == want {
                    found = Some(SlotRef(slot as *const _));
                    return true;
                }
                false
            });
            if found.is_some() || self.shape.load(Ordering::Acquire) == shape {
                return found;
            }
        }
    }

    /// Whether `slot` holds the reference to `loc` of a key with this hash (current or HISTORIC).
    /// Under the write lock a slot that holds it is that reference's only place: a hint found
    /// without the lock that passes this check can be used as if found under it.
    #[inline]
    pub fn holds(&self, slot: SlotRef, hash: u64, loc: Loc) -> bool {
        slot.get().load(Ordering::Acquire) & !HISTORIC == make_ref(hash, loc)
    }

    /// Whether `slot` holds the current (not HISTORIC) reference to `loc` of a key with this hash.
    #[inline]
    pub fn holds_current(&self, slot: SlotRef, hash: u64, loc: Loc) -> bool {
        slot.get().load(Ordering::Acquire) == make_ref(hash, loc)
    }

    /// Points an existing slot at a new location, keeping it current or HISTORIC. Caller holds the
    /// write lock.
    #[inline]
    pub fn replace(&self, slot: SlotRef, hash: u64, loc: Loc) {
        let old = slot.get().load(Ordering::Relaxed);
        debug_assert!(old & VALID != 0);
        slot.get()
            .store(make_ref(hash, loc) | (old & HISTORIC), Ordering::Release);
    }

    /// Whether a slot holds a HISTORIC reference.
    #[inline]
    pub fn is_historic(&self, slot: SlotRef) -> bool {
        slot.get().load(Ordering::Relaxed) & HISTORIC != 0
    }

    /// Turns a key's current reference into a HISTORIC one (its object was superseded but a snapshot
    /// may still read it). Caller holds the write lock.
    #[inline]
    pub fn make_historic(&self, slot: SlotRef) {
        let old = slot.get().load(Ordering::Relaxed);
        debug_assert!(old & VALID != 0 && old & HISTORIC == 0);
        slot.get().store(old | HISTORIC, Ordering::Release);
        self.historic.fetch_add(1, Ordering::Relaxed);
        if internal_ref(old) {
            self.internal.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Clears an existing slot. Caller holds the write lock.
    #[inline]
    pub fn remove(&self, slot: SlotRef) {
        let old = slot.get().load(Ordering::Relaxed);
        debug_assert!(old & VALID != 0);
        slot.get().store(0, Ordering::Release);
        self.entries.fetch_sub(1, Ordering::Relaxed);
        if old & HISTORIC != 0 {
            self.historic.fetch_sub(1, Ordering::Relaxed);
        } else if internal_ref(old) {
            self.internal.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Clears a slot and shortens its chain when the holes allow. `hash` is the removed key's hash.
    /// Caller holds the write lock.
    pub fn remove_and_compact(&self, slot: SlotRef, hash: u64) {
        self.remove(slot);
        let shape = self.shape.load(Ordering::Relaxed);
        self.compact_chain(self.bucket(Self::bucket_of(shape, hash)));
    }

    /// Adds a reference for a key known to be absent, then grows the table if it is too full.
    /// `rehash(loc)` must return the hash of the key stored at `loc` (used when splitting).
    /// Caller holds the write lock.
    pub fn insert(&self, hash: u64, loc: Loc, rehash: impl FnMut(Loc) -> u64) {
        let shape = self.shape.load(Ordering::Relaxed);
        let bucket = self.bucket(Self::bucket_of(shape, hash));
        self.place(bucket, make_ref(hash, loc));
        if internal_ref(hash) {
            self.internal.fetch_add(1, Ordering::Relaxed);
        }
        let n = self.entries.fetch_add(1, Ordering::Relaxed) + 1;
        if n as f64 > self.bucket_count() as f64 * SLOTS as f64 * LOAD_MAX
            && self.split_hold.load(Ordering::Acquire) == 0
        {
            self.split_one(rehash);
        }
    }

    /// Grows the table until `keys` references fit under the load limit. Cheap while the table
    /// is empty (a split moves nothing); a bulk load calls it first, so that the splits do not
    /// re-read every moved entry to rehash it. `rehash` as for [`HashIndex::insert`]. Caller
    /// holds the write lock.
    pub fn reserve(&self, keys: u64, mut rehash: impl FnMut(Loc) -> u64) {
        while (self.bucket_count() as f64 * SLOTS as f64 * LOAD_MAX) < keys as f64
            && self.split_hold.load(Ordering::Acquire) == 0
        {
            self.split_one(&mut rehash);
        }
    }

    /// Puts a reference into the first empty slot of a chain, extending the chain if needed.
    fn place(&self, head: &Bucket, value: u64) -> SlotRef {
        let mut bucket = head;
        loop {
            for i in 0..SLOTS - 1 {
                if bucket.slots[i].load(Ordering::Relaxed) == 0 {
                    bucket.slots[i].store(value, Ordering::Release);
                    return SlotRef(&bucket.slots[i] as *const _);
                }
            }
            let last = &bucket.slots[SLOTS - 1];
            let v = last.load(Ordering::Relaxed);
            if v & CHAIN != 0 {
                bucket = self.overflow_bucket(v & !CHAIN);
                continue;
            }
            if v == 0 {
                last.store(value, Ordering::Release);
                return SlotRef(last as *const _);
            }
            // Full chain: move the last reference into a new overflow bucket, then link it.
            let id = self.new_overflow_bucket();
            let next = self.overflow_bucket(id);
            next.slots[0].store(v, Ordering::Release);
            next.slots[1].store(value, Ordering::Release);
            last.store(CHAIN | id, Ordering::Release);
            return SlotRef(&next.slots[1] as *const _);
        }
    }

    fn new_overflow_bucket(&self) -> u64 {
        self.overflow_in_use.fetch_add(1, Ordering::Relaxed);
        if let Some(id) = self.overflow_ready.lock().pop() {
            return id;
        }
        let id = self.overflow_used.fetch_add(1, Ordering::Relaxed);
        let (k, _) = overflow_place(id);
        assert!(k < OVERFLOW_CHUNKS, "hash index overflow arena exhausted");
        if self.overflow[k].load(Ordering::Relaxed).is_null() {
            let len = overflow_chunk_len(k);
            self.overflow[k].store(alloc_buckets(len, backing(len)), Ordering::Release);
        }
        id
    }

    /// Splits bucket `split` into itself and its buddy one doubling above.
    fn split_one(&self, mut rehash: impl FnMut(Loc) -> u64) {
        let shape = self.shape.load(Ordering::Relaxed);
        let level = shape_level(shape);
        let split = shape_split(shape);
        let m = BUCKETS_INITIAL << level;
        let new_b = split + m;
        // Make sure the array holding the new bucket exists.
        let q = new_b >> BUCKETS_INITIAL_LOG2;
        let k = (63 - q.leading_zeros()) as usize + 1;
        assert!(k < DIR_ARRAYS, "hash index directory exhausted");
        if self.dir[k].load(Ordering::Relaxed).is_null() {
            self.dir[k].store(
                alloc_buckets(array_len(k), backing(array_len(k))),
                Ordering::Release,
            );
        }
        // 1. Copy the references that move into the new bucket.
        let mut moved: Vec<(SlotRef, u64)> = Vec::new();
        let old = self.bucket(split);
        let new = self.bucket(new_b);
        let mut movers: Vec<(SlotRef, u64)> = Vec::new();
        self.walk_chain(old, |slot, v| {
            let hash = rehash(v & LOC_MASK);
            if hash & (2 * m - 1) == new_b {
                movers.push((SlotRef(slot as *const _), v));
            }
            false
        });
        for (slot, v) in movers {
            self.place(new, v);
            moved.push((slot, v));
        }
        // 2. Publish the new shape: lookups of moved keys now go to the new bucket.
        let moves = shape_moves(shape) + 1;
        let next_shape = if split + 1 == m {
            make_shape(level + 1, moves, 0)
        } else {
            make_shape(level, moves, split + 1)
        };
        self.shape.store(next_shape, Ordering::Release);
        // 3. Clear the old copies, then give back the overflow buckets the old chain no longer needs.
        for (slot, v) in moved {
            debug_assert_eq!(slot.get().load(Ordering::Relaxed), v);
            slot.get().store(0, Ordering::Release);
        }
        self.compact_chain(old);
    }

    /// Shortens a chain: while the last overflow bucket's references fit in the holes of the buckets
    /// before it, copies them there, bumps `moves`, clears the originals and unlinks the bucket. The
    /// bucket is reused only after an epoch grace period, so a reader still inside it sees empty
    /// slots, misses, notices the bumped shape and retries. Caller holds the write lock.
    fn compact_chain(&self, head: &Bucket) {
        loop {
            if head.slots[SLOTS - 1].load(Ordering::Relaxed) & CHAIN == 0 {
                // No overflow bucket (most chains): nothing to shorten, nothing to allocate.
                return;
            }
            let mut chain: Vec<&Bucket> = vec![head];
            let mut ids: Vec<u64> = Vec::new();
            loop {
                let v = chain.last().expect("non-empty").slots[SLOTS - 1].load(Ordering::Relaxed);
                if v & CHAIN == 0 {
                    break;
                }
                ids.push(v & !CHAIN);
                chain.push(self.overflow_bucket(v & !CHAIN));
            }
            if chain.len() < 2 {
                return;
            }
            let last = chain[chain.len() - 1];
            let entries: Vec<usize> = (0..SLOTS)
                .filter(|&i| last.slots[i].load(Ordering::Relaxed) != 0)
                .collect();
            let mut holes: Vec<&AtomicU64> = Vec::new();
            for b in &chain[..chain.len() - 1] {
                for i in 0..SLOTS - 1 {
                    if b.slots[i].load(Ordering::Relaxed) == 0 {
                        holes.push(&b.slots[i]);
                    }
                }
            }
            if entries.len() > holes.len() {
                return;
            }
            for (&i, hole) in entries.iter().zip(&holes) {
                hole.store(last.slots[i].load(Ordering::Relaxed), Ordering::Release);
            }
            let shape = self.shape.load(Ordering::Relaxed);
            let bumped = make_shape(
                shape_level(shape),
                shape_moves(shape) + 1,
                shape_split(shape),
            );
            self.shape.store(bumped, Ordering::Release);
            for &i in &entries {
                last.slots[i].store(0, Ordering::Release);
            }
            chain[chain.len() - 2].slots[SLOTS - 1].store(0, Ordering::Release);
            let id = *ids.last().expect("chain has an overflow bucket");
            self.overflow_in_use.fetch_sub(1, Ordering::Relaxed);
            let ready = self.overflow_ready.clone();
            epoch::pin().defer(move || ready.lock().push(id));
        }
    }

    /// Collects the references of main buckets `from..` (and their chains) until at least `count`
    /// references were seen; returns the next bucket to visit, or 0 when the table is exhausted.
    pub fn scan(&self, from: u64, count: usize, mut f: impl FnMut(Loc)) -> u64 {
        self.scan_refs(from, count, |loc, historic| {
            if !historic {
                f(loc)
            }
        })
    }

    /// Stops bucket splits until [`HashIndex::release_splits`]. Call it under the write lock, so
    /// that no split is under way when it returns.
    pub fn hold_splits(&self) {
        self.split_hold.fetch_add(1, Ordering::AcqRel);
    }

    pub fn release_splits(&self) {
        self.split_hold.fetch_sub(1, Ordering::AcqRel);
    }

    /// Like [`HashIndex::scan`], but visits HISTORIC references too: `f(loc, historic)`. Each
    /// bucket's chain is read as one consistent view (re-read if references moved meanwhile).
    /// With splits held, every reference present throughout is visited exactly once.
    pub fn scan_refs(&self, from: u64, count: usize, mut f: impl FnMut(Loc, bool)) -> u64 {
        let mut b = from;
        let mut seen = 0usize;
        let mut chain: Vec<u64> = Vec::with_capacity(16);
        loop {
            let buckets = self.bucket_count();
            if b >= buckets {
                return 0;
            }
            loop {
                let shape = self.shape.load(Ordering::Acquire);
                chain.clear();
                self.walk_chain(self.bucket(b), |_, v| {
                    if v & VALID != 0 {
                        chain.push(v);
                    }
                    false
                });
                if shape_moves(self.shape.load(Ordering::Acquire)) == shape_moves(shape) {
                    break;
                }
            }
            for &v in &chain {
                f(v & LOC_MASK, v & HISTORIC != 0);
                seen += 1;
            }
            b += 1;
            if seen >= count {
                return if b >= self.bucket_count() { 0 } else { b };
            }
        }
    }
}

impl Drop for HashIndex {
    fn drop(&mut self) {
        for (k, slot) in self.dir.iter().enumerate() {
            let p = slot.load(Ordering::Relaxed);
            if !p.is_null() {
                // SAFETY: allocated by alloc_buckets with this length and backing; the index is
                // dropped.
                unsafe { free_buckets(p, array_len(k), backing(array_len(k))) };
            }
        }
        for (k, slot) in self.overflow.iter().enumerate() {
            let p = slot.load(Ordering::Relaxed);
            if !p.is_null() {
                let len = overflow_chunk_len(k);
                // SAFETY: allocated by alloc_buckets with this length and backing; the index is
                // dropped.
                unsafe { free_buckets(p, len, backing(len)) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn h(i: u64) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes())
    }

    /// A slot found without the lock stops passing `holds` once its reference moves (splits) or
    /// changes, and then `find_loc` finds the reference's new place.
    #[test]
    fn slot_hints_are_checked_by_holds() {
        let idx = HashIndex::new();
        let n = 1_000u64;
        for i in 0..n {
            idx.insert(h(i), i, h);
        }
        let hints: Vec<SlotRef> = (0..n)
            .map(|i| idx.find_loc(h(i), i).expect("present"))
            .collect();
        for (i, hint) in hints.iter().enumerate() {
            assert!(idx.holds(*hint, h(i as u64), i as u64));
            assert!(!idx.holds(*hint, h(i as u64), i as u64 + 1));
        }
        // Growth splits buckets and moves references between slots.
        for i in n..50_000 {
            idx.insert(h(i), i, h);
        }
        let mut moved = 0;
        for (i, hint) in hints.iter().enumerate() {
            let (hash, loc) = (h(i as u64), i as u64);
            let slot = if idx.holds(*hint, hash, loc) {
                *hint
            } else {
                moved += 1;
                idx.find_loc(hash, loc).expect("still present")
            };
            assert!(idx.holds(slot, hash, loc));
            // A replaced reference no longer passes with its old location.
            idx.replace(slot, hash, loc + 1_000_000);
            assert!(!idx.holds(slot, hash, loc));
            assert!(idx.holds(slot, hash, loc + 1_000_000));
        }
        assert!(moved > 0, "growth by 50x moved no reference");
    }

    /// Overflow ids fill chunk after chunk of doubling size, every id at its own in-bounds place.
    #[test]
    fn overflow_ids_map_onto_doubling_chunks() {
        let mut expected = (0usize, 0usize);
        for id in 0..OVERFLOW_FIRST * 15 {
            assert_eq!(overflow_place(id), expected, "id {id}");
            expected.1 += 1;
            if expected.1 == overflow_chunk_len(expected.0) {
                expected = (expected.0 + 1, 0);
            }
        }
        assert_eq!(
            expected,
            (4, 0),
            "ids 0..15*first fill chunks 0..=3 exactly"
        );
        let last = OVERFLOW_FIRST * ((1u64 << OVERFLOW_CHUNKS) - 1) - 1;
        assert_eq!(
            overflow_place(last),
            (
                OVERFLOW_CHUNKS - 1,
                overflow_chunk_len(OVERFLOW_CHUNKS - 1) - 1
            )
        );
    }

    /// The newest directory array takes memory only as linear hashing reaches its buckets: just
    /// after the index grows into an 8 MiB array, most of that array's pages are not resident.
    #[test]
    fn new_directory_array_is_resident_only_where_used() {
        let idx = HashIndex::new();
        // dir[14] holds buckets 131072..262144 (8 MiB); at about 7.2 references per bucket it is
        // first split into at about 944k entries.
        let k = 14;
        let first = BUCKETS_INITIAL << (k - 1);
        let mut i = 0u64;
        while idx.bucket_count() < first + 4096 {
            idx.insert(h(i), i, h);
            i += 1;
        }
        let used_bytes = (idx.bucket_count() - first) as usize * 64;
        let array = idx.dir[k].load(Ordering::Acquire) as usize;
        let len = array_len(k) * 64;
        let page = 4096usize;
        let start = array.div_ceil(page) * page;
        let pages = (array + len - start) / page;
        let mut resident = vec![0u8; pages];
        // SAFETY: [start, start + pages * page) lies inside the array's mapping; mincore only reads
        // the page table.
        let rc = unsafe {
            libc::mincore(
                start as *mut libc::c_void,
                pages * page,
                resident.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        let resident_bytes = resident.iter().filter(|&&r| r & 1 == 1).count() * page;
        // Touched pages, plus at most one transparent huge page of 2 MiB around the split point.
        assert!(
            resident_bytes <= used_bytes + (2 << 20) + page,
            "{resident_bytes} of {len} bytes resident with {used_bytes} in use"
        );
        assert!(
            resident_bytes >= used_bytes / 2,
            "{resident_bytes} resident, {used_bytes} used"
        );
    }

    /// Uses loc = key id, so rehash(loc) = h(loc).
    #[test]
    fn grows_and_finds_everything() {
        let idx = HashIndex::new();
        for i in 0..200_000u64 {
            idx.insert(h(i), i, h);
        }
        assert_eq!(idx.len(), 200_000);
        assert!(idx.bucket_count() > 200_000 / 8);
        for i in 0..200_000u64 {
            let (_, loc) = idx
                .lookup(h(i), |loc| loc == i)
                .unwrap_or_else(|| panic!("lost {i}"));
            assert_eq!(loc, i);
        }
        assert!(idx
            .lookup(h(999_999_999), |loc| loc == 999_999_999)
            .is_none());
        // Load stays near the target: memory per entry is bounded.
        let per_entry = idx.memory_bytes() as f64 / idx.len() as f64;
        assert!(
            per_entry < 16.0,
            "{per_entry} bytes per entry, {} overflow buckets",
            idx.overflow_buckets()
        );
    }

    #[test]
    fn replace_remove_and_scan() {
        let idx = HashIndex::new();
        let mut model = HashMap::new();
        for i in 0..5_000u64 {
            idx.insert(h(i), i, h);
            model.insert(i, i);
        }
        for i in (0..5_000u64).step_by(3) {
            let (slot, _) = idx.lookup(h(i), |loc| loc == i).unwrap();
            idx.remove(slot);
            model.remove(&i);
        }
        let mut seen = std::collections::HashSet::new();
        let mut cursor = 0;
        loop {
            cursor = idx.scan(cursor, 100, |loc| {
                seen.insert(loc);
            });
            if cursor == 0 {
                break;
            }
        }
        assert_eq!(seen.len(), model.len());
        for k in model.keys() {
            assert!(seen.contains(k));
        }
    }

    #[test]
    fn concurrent_readers_never_miss_during_growth() {
        use std::sync::Arc;
        let idx = Arc::new(HashIndex::new());
        for i in 0..1000u64 {
            idx.insert(h(i), i, h);
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let idx = idx.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut rounds = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let _guard = epoch::pin();
                    for i in 0..1000u64 {
                        assert!(
                            idx.lookup(h(i), |loc| loc == i).is_some(),
                            "reader missed {i}"
                        );
                    }
                    rounds += 1;
                }
                rounds
            })
        };
        for i in 1000..300_000u64 {
            idx.insert(h(i), i, h);
        }
        stop.store(true, Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
    }
}
