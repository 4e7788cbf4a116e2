//! Bulk restore: a tablet filled from a replay of its backup logs, which yields each key once
//! with its newest version (recovery, a restart).
//!
//! The per-write path costs, per object, an epoch pin, the tablet's write lock, an index lookup
//! for the current version, and index growth that re-reads moved entries to rehash them. A
//! replay into an empty tablet needs none of that per object: the loader encodes entries into a
//! batch, and each batch takes the lock once, appends every entry, and inserts its index
//! references without a lookup (a replay yields each key once). The index is grown once, up front,
//! to the count the replay announces, while it is still empty (a split moves nothing then).
//! Into a tablet that already holds objects, the loader falls back to [`Inner::restore`]'s rules
//! per entry (the newest version wins), so it is always correct to use.
//!
//! Memory: one batch of encoded entries (at most [`BATCH_BYTES`] plus one entry).

use crate::engine::{hash_key, Inner};
use crate::entry::{encode_header, HEADER_BYTES_MAX, KIND_OBJECT};
use crate::pool::AllocClass;
use crate::segment::AppendError;
use crate::{EngineError, TabletId, Version};
use crossbeam_epoch as epoch;
use std::sync::atomic::Ordering;

/// Bytes of encoded entries a batch holds before it is appended.
pub const BATCH_BYTES: usize = 256 << 10;

/// How many entries ahead of the one it inserts a flush prefetches the index bucket of: enough
/// that the bucket arrives before its turn, few enough that it is still cached then.
const PREFETCH_AHEAD: usize = 8;

/// One entry of a batch: where its encoded bytes lie in the batch buffer, and what the index and
/// the counters need.
struct Pending {
    at: usize,
    len: usize,
    hash: u64,
    expire_at_ms: u64,
}

/// Fills one tablet from a replay; see the module comment. Call [`BulkRestore::finish`] at the
/// end (a dropped loader loses the entries of its last batch).
pub struct BulkRestore<'a> {
    engine: &'a Inner,
    tablet: TabletId,
    /// The tablet held no object when the load began: entries go in without an index lookup.
    fresh: bool,
    buf: Vec<u8>,
    pending: Vec<Pending>,
    max_version: Version,
    objects: u64,
}

impl<'a> BulkRestore<'a> {
    /// A loader for `tablet`, whose index is grown at once for `expected_objects` (an upper
    /// bound the replay announces; 0 when unknown).
    pub(crate) fn new(
        engine: &'a Inner,
        tablet: TabletId,
        expected_objects: u64,
    ) -> Result<BulkRestore<'a>, EngineError> {
        let fresh = engine.reserve_for_restore(tablet, expected_objects)?;
        Ok(BulkRestore {
            engine,
            tablet,
            fresh,
            buf: Vec::with_capacity(BATCH_BYTES + HEADER_BYTES_MAX),
            pending: Vec::new(),
            max_version: 0,
            objects: 0,
        })
    }

    /// Adds one replayed object. An object whose expiry has passed is skipped (a replay treats
    /// it as the delete it has become).
    pub fn push(
        &mut self,
        key: &[u8],
        value: &[u8],
        version: Version,
        expire_at_ms: u64,
    ) -> Result<(), EngineError> {
        self.engine.check_sizes(key, value)?;
        self.max_version = self.max_version.max(version);
        if !self.fresh {
            return self
                .engine
                .restore(self.tablet, key, Some(value), version, expire_at_ms);
        }
        if expire_at_ms != 0 && crate::engine::now_ms() >= expire_at_ms {
            return Ok(());
        }
        let mut header = [0u8; HEADER_BYTES_MAX];
        let hl = encode_header(&mut header, KIND_OBJECT, version, key, value, expire_at_ms);
        let at = self.buf.len();
        self.buf.extend_from_slice(&header[..hl]);
        self.buf.extend_from_slice(key);
        self.buf.extend_from_slice(value);
        self.pending.push(Pending {
            at,
            len: hl + key.len() + value.len(),
            hash: hash_key(key),
            expire_at_ms,
        });
        if self.buf.len() >= BATCH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    /// Appends the batch under one hold of the tablet's write lock and indexes it.
    fn flush(&mut self) -> Result<(), EngineError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let engine = self.engine;
        engine.clock.fetch_max(self.max_version, Ordering::SeqCst);
        let tablet = engine.tablet(self.tablet)?;
        let mut done = 0;
        let mut started = None;
        while done < self.pending.len() {
            let guard = epoch::pin();
            let mut head = tablet.head.lock();
            // Live bytes are added per segment, once for each run of entries in it.
            let mut run: Option<(u32, usize)> = None;
            let mut full = false;
            while done < self.pending.len() {
                if let Some(ahead) = self.pending.get(done + PREFETCH_AHEAD) {
                    tablet.index.prefetch(ahead.hash);
                }
                let p = &self.pending[done];
                let bytes = &self.buf[p.at..p.at + p.len];
                match engine.append(&mut head, self.tablet, &[bytes], p.len, AllocClass::Writer) {
                    Ok((loc, segment)) => {
                        match &mut run {
                            Some((s, n)) if *s == segment => *n += p.len,
                            _ => {
                                if let Some((s, n)) = run.take() {
                                    engine.mark_live(s, n);
                                }
                                run = Some((segment, p.len));
                            }
                        }
                        engine.note_expiry(segment, p.expire_at_ms);
                        tablet.count_expiry(p.expire_at_ms, true);
                        tablet.index.insert(p.hash, loc, |l| engine.rehash(l));
                        done += 1;
                    }
                    Err(AppendError::NoMemory) => {
                        full = true;
                        break;
                    }
                    Err(AppendError::SegmentFull) => {
                        unreachable!("append retries on a new segment")
                    }
                }
            }
            if let Some((s, n)) = run.take() {
                engine.mark_live(s, n);
            }
            drop(head);
            drop(guard);
            if full {
                engine.wait_for_memory(&mut started, AllocClass::Writer)?;
            }
        }
        let bytes: usize = self.pending.iter().map(|p| p.len).sum();
        engine.counters.new_bytes.add(bytes as i64);
        self.objects += self.pending.len() as u64;
        self.pending.clear();
        self.buf.clear();
        Ok(())
    }

    /// Appends what is left and returns how many objects the loader put in (fresh tablets; a
    /// tablet that held objects counts none).
    pub fn finish(mut self) -> Result<u64, EngineError> {
        self.flush()?;
        self.engine
            .clock
            .fetch_max(self.max_version, Ordering::SeqCst);
        Ok(self.objects)
    }
}

#[cfg(test)]
mod tests {
    use crate::{Engine, EngineConfig, EngineError, PutOptions};

    fn engine(memory_bytes: u64) -> std::sync::Arc<Engine> {
        Engine::new(EngineConfig {
            memory_bytes,
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn a_fresh_tablet_is_filled_in_batches_and_reads_back() {
        let e = engine(256 << 20);
        let t = e.create_tablet(0, 0, 16383).unwrap();
        let n = 50_000u64;
        let far = crate::engine::now_ms() + 3_600_000;
        let mut l = e.bulk_restore(t, n + 10).unwrap();
        for i in 0..n {
            let key = format!("k{i}");
            let expiry = if i % 7 == 0 { far } else { 0 };
            l.push(key.as_bytes(), &i.to_le_bytes(), 1000 + i, expiry)
                .unwrap();
        }
        // An object whose expiry has passed is the delete it has become.
        l.push(b"gone", b"x", 5, 1).unwrap();
        assert_eq!(l.finish().unwrap(), n);
        assert_eq!(e.object_count(), n);
        for i in (0..n).step_by(97) {
            let o = e.get(t, format!("k{i}").as_bytes()).unwrap().unwrap();
            assert_eq!(o.value, i.to_le_bytes());
            assert_eq!(o.version, 1000 + i);
            assert_eq!(o.expire_at_ms, if i % 7 == 0 { far } else { 0 });
        }
        assert!(e.get(t, b"gone").unwrap().is_none());
        // The clock is above every restored version; later writes go above it.
        assert!(e.clock() >= 1000 + n - 1);
        let v = e
            .put(t, b"k1", b"new", &PutOptions::default())
            .unwrap()
            .version;
        assert!(v > 1000 + n - 1);
        assert_eq!(e.get(t, b"k1").unwrap().unwrap().value, b"new");
        // The index was grown once, up front: every key is found, and none twice.
        let mut keys = Vec::new();
        let mut cursor = 0;
        loop {
            cursor = e.scan_keys(t, cursor, 4096, &mut keys).unwrap();
            if cursor == 0 {
                break;
            }
        }
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len() as u64, n);
    }

    #[test]
    fn into_a_tablet_that_holds_objects_the_newest_version_wins() {
        let e = engine(64 << 20);
        let t = e.create_tablet(0, 0, 16383).unwrap();
        e.restore(t, b"a", Some(b"newer"), 50, 0).unwrap();
        e.restore(t, b"b", Some(b"older"), 5, 0).unwrap();
        let mut l = e.bulk_restore(t, 3).unwrap();
        l.push(b"a", b"stale", 10, 0).unwrap();
        l.push(b"b", b"fresher", 20, 0).unwrap();
        l.push(b"c", b"new key", 30, 0).unwrap();
        l.finish().unwrap();
        assert_eq!(e.get(t, b"a").unwrap().unwrap().value, b"newer");
        assert_eq!(e.get(t, b"b").unwrap().unwrap().value, b"fresher");
        assert_eq!(e.get(t, b"c").unwrap().unwrap().value, b"new key");
        assert_eq!(e.object_count(), 3);
    }

    /// Versions handed over in no order, from several threads at once (a streamed replay): the
    /// newest of each key wins, and a version whose expiry has passed still hides older ones
    /// that come after it.
    #[test]
    fn restore_newest_keeps_the_newest_version_whatever_the_order() {
        use crate::RestoreItem;
        let e = engine(256 << 20);
        let t = e.create_tablet(0, 0, 16383).unwrap();
        let keys = 20_000u64;
        assert!(e.reserve_for_restore(t, keys).unwrap());
        // Version v of key i: value "i:v". The newest is 3, which for every 5th key has an
        // expiry long gone.
        let item = |i: u64, v: u64| {
            let expired = v == 3 && i.is_multiple_of(5);
            (
                format!("k{i}").into_bytes(),
                format!("{i}:{v}").into_bytes(),
                v,
                if expired { 1 } else { 0 },
            )
        };
        // Version v of every key, 256 at a time.
        let send = |v: u64| {
            let owned: Vec<_> = (0..keys).map(|i| item(i, v)).collect();
            for chunk in owned.chunks(256) {
                let items: Vec<RestoreItem<'_>> = chunk
                    .iter()
                    .map(|(k, val, ver, exp)| RestoreItem {
                        key: k,
                        value: Some(val),
                        version: *ver,
                        expire_at_ms: *exp,
                    })
                    .collect();
                e.restore_newest(t, &items).unwrap();
            }
        };
        let orders: [[u64; 3]; 4] = [[1, 2, 3], [3, 2, 1], [2, 3, 1], [3, 1, 2]];
        std::thread::scope(|s| {
            let send = &send;
            for order in &orders {
                // Each thread sends every version of every key, in its own order.
                s.spawn(move || order.iter().for_each(|&v| send(v)));
            }
        });
        // Older versions that come last change nothing.
        send(2);
        send(1);
        for i in 0..keys {
            let got = e.get(t, format!("k{i}").as_bytes()).unwrap();
            if i.is_multiple_of(5) {
                assert!(
                    got.is_none(),
                    "k{i}: an expired newest version hides older ones"
                );
            } else {
                let o = got.unwrap();
                assert_eq!((o.value, o.version), (format!("{i}:3").into_bytes(), 3));
            }
        }
        // Into a tablet that holds objects, the index is not grown again.
        assert!(!e.reserve_for_restore(t, 10).unwrap());
    }

    #[test]
    fn a_full_memory_is_an_error_not_a_hang() {
        let e = Engine::new(EngineConfig {
            memory_bytes: 16 << 20,
            oom_wait_ms: 200,
            ..Default::default()
        })
        .unwrap();
        let t = e.create_tablet(0, 0, 16383).unwrap();
        let mut l = e.bulk_restore(t, 0).unwrap();
        let value = vec![7u8; 1000];
        let mut failed = None;
        for i in 0..100_000u64 {
            if let Err(err) = l.push(format!("k{i}").as_bytes(), &value, i + 1, 0) {
                failed = Some((i, err));
                break;
            }
        }
        let (i, err) = failed.expect("16 MiB cannot hold 100 MB");
        assert!(matches!(err, EngineError::OutOfMemory { .. }), "{err:?}");
        assert!(i > 1000, "it filled memory first ({i} objects)");
        // What went in before the failure reads back.
        assert_eq!(e.get(t, b"k0").unwrap().unwrap().value, value);
    }

    #[test]
    fn limits_are_the_engines() {
        let e = engine(64 << 20);
        let t = e.create_tablet(0, 0, 16383).unwrap();
        let mut l = e.bulk_restore(t, 1).unwrap();
        assert!(matches!(
            l.push(&vec![1u8; 64 * 1024 + 1], b"v", 1, 0),
            Err(EngineError::KeyTooLarge { .. })
        ));
        l.push(b"", b"", 2, 0).unwrap();
        l.finish().unwrap();
        assert_eq!(e.get(t, b"").unwrap().unwrap().version, 2);
    }
}
