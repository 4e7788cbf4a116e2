//! The write buffer: a bounded ring of chunks that producers (callers of `append`) fill and the
//! flusher drains. Producers block when every chunk is full or in flight (back-pressure); memory
//! never grows beyond `write_buffer_bytes`.
//!
//! A chunk holds encoded entries (CRC computed by the producer, as DXRAM's message handler does)
//! plus two side tables filled while the entries are hot in the producer's cache: the batches
//! (tablet, byte range, puts or deletes) and each entry's version record (key hash, version). The
//! flusher then sorts and routes by the side tables alone and touches entry bytes only to copy
//! them.

use crate::format::{self, VersionRecord};
use crate::{Entry, Error, Result};
use parking_lot::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// A run of entries of one tablet inside a chunk, all puts or all deletes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchMeta {
    pub tablet: u64,
    pub start: usize,
    pub len: usize,
    pub rec_start: usize,
    pub rec_count: usize,
    pub deletes: bool,
}

/// One chunk of the ring.
#[derive(Default)]
pub(crate) struct Chunk {
    pub data: Vec<u8>,
    pub batches: Vec<BatchMeta>,
    pub records: Vec<VersionRecord>,
}

impl Chunk {
    /// A chunk whose memory is touched now: producers would otherwise take the page faults of
    /// the whole buffer (32 MiB by default) on its first lap, in the middle of their appends
    /// (DXRAM, too, allocates its buffers at start).
    fn with_capacity(bytes: usize) -> Chunk {
        let mut data = vec![0u8; 0];
        data.reserve_exact(bytes);
        data.resize(bytes, 0);
        data.clear();
        Chunk {
            data,
            batches: Vec::new(),
            records: Vec::new(),
        }
    }
    fn clear(&mut self) {
        self.data.clear();
        self.batches.clear();
        self.records.clear();
    }
    pub fn batch_bytes(&self, b: &BatchMeta) -> &[u8] {
        &self.data[b.start..b.start + b.len]
    }
    pub fn batch_records(&self, b: &BatchMeta) -> &[VersionRecord] {
        &self.records[b.rec_start..b.rec_start + b.rec_count]
    }
}

pub(crate) struct WriteBuffer {
    inner: Mutex<Inner>,
    /// Producers wait here for a free chunk.
    space: Condvar,
    /// The flusher waits here for work.
    work: Condvar,
    chunk_bytes: usize,
    flush_threshold: usize,
    flush_interval: Duration,
}

struct Inner {
    cur: Chunk,
    full: Vec<Chunk>,
    free: Vec<Chunk>,
    buffered: usize,
    /// Total bytes ever appended: the ticket of an append is this value after it.
    lsn: u64,
    oldest: Option<Instant>,
    force: bool,
    closed: bool,
    failed: Option<String>,
    producer_wait_ns: u64,
    /// Bytes of the chunks' side tables (batches, version records), as of the last release.
    side_bytes: usize,
}

/// What one flush took out of the buffer.
pub(crate) struct Taken {
    pub chunks: Vec<Chunk>,
    pub lsn: u64,
    /// When the oldest of the taken entries was appended (None if nothing was buffered).
    pub oldest: Option<Instant>,
    pub closed: bool,
}

impl WriteBuffer {
    pub fn new(
        total_bytes: usize,
        chunks: usize,
        flush_threshold: usize,
        flush_interval: Duration,
    ) -> Self {
        let chunk_bytes = total_bytes / chunks;
        let free = (0..chunks - 1)
            .map(|_| Chunk::with_capacity(chunk_bytes))
            .collect();
        WriteBuffer {
            inner: Mutex::new(Inner {
                cur: Chunk::with_capacity(chunk_bytes),
                full: Vec::new(),
                free,
                buffered: 0,
                lsn: 0,
                oldest: None,
                force: false,
                closed: false,
                failed: None,
                producer_wait_ns: 0,
                side_bytes: 0,
            }),
            space: Condvar::new(),
            work: Condvar::new(),
            chunk_bytes,
            flush_threshold,
            flush_interval,
        }
    }

    /// Appends a batch for one tablet; returns the ticket (stream position after the batch).
    pub fn append(&self, tablet: u64, entries: &[Entry<'_>]) -> Result<u64> {
        let mut start = 0usize;
        let mut ticket = 0u64;
        while start < entries.len() {
            // Cut the batch into records that fit one chunk.
            let mut end = start;
            let mut body = 0usize;
            while end < entries.len() {
                let e = &entries[end];
                let len = format::entry_bytes(
                    e.key.len(),
                    e.value.map_or(0, |v| v.len()),
                    e.version,
                    e.expiry,
                );
                if body + len > self.chunk_bytes {
                    break;
                }
                body += len;
                end += 1;
            }
            debug_assert!(
                end > start,
                "entry sizes are validated against the chunk size"
            );
            ticket = self.append_record(tablet, &entries[start..end], body)?;
            start = end;
        }
        Ok(ticket)
    }

    fn append_record(&self, tablet: u64, entries: &[Entry<'_>], body: usize) -> Result<u64> {
        let need = body;
        let mut g = self.inner.lock();
        loop {
            if let Some(msg) = &g.failed {
                return Err(Error::Failed(msg.clone()));
            }
            if g.closed {
                return Err(Error::Closed);
            }
            let cap = g.cur.data.capacity();
            if cap > 0 && g.cur.data.len() + need <= cap {
                break;
            }
            if cap > 0 && !g.cur.data.is_empty() {
                let cur = std::mem::take(&mut g.cur);
                g.full.push(cur);
            }
            if let Some(chunk) = g.free.pop() {
                g.cur = chunk;
                continue;
            }
            // Every chunk is full or being flushed: wake the flusher and wait (back-pressure).
            g.force = true;
            self.work.notify_one();
            let t = Instant::now();
            self.space.wait(&mut g);
            g.producer_wait_ns += t.elapsed().as_nanos() as u64;
        }
        let cur = &mut g.cur;
        let at = cur.data.len();
        let mut open: Option<BatchMeta> = None;
        for e in entries {
            let deletes = e.value.is_none();
            if open.is_some_and(|b| b.deletes != deletes) {
                cur.batches.extend(open.take());
            }
            let start = cur.data.len();
            let meta = open.get_or_insert(BatchMeta {
                tablet,
                start,
                len: 0,
                rec_start: cur.records.len(),
                rec_count: 0,
                deletes,
            });
            match e.value {
                Some(v) => format::encode_entry(
                    &mut cur.data,
                    format::KIND_PUT,
                    e.key,
                    v,
                    e.version,
                    e.expiry,
                ),
                None => format::encode_entry(
                    &mut cur.data,
                    format::KIND_DELETE,
                    e.key,
                    &[],
                    e.version,
                    e.expiry,
                ),
            }
            meta.len += cur.data.len() - start;
            meta.rec_count += 1;
            cur.records.push(VersionRecord {
                hash: format::key_hash(e.key),
                version: e.version,
                deleted: deletes,
            });
        }
        cur.batches.extend(open);
        debug_assert_eq!(cur.data.len(), at + need);
        g.buffered += need;
        g.lsn += need as u64;
        if g.oldest.is_none() {
            g.oldest = Some(Instant::now());
        }
        if g.buffered >= self.flush_threshold {
            self.work.notify_one();
        }
        Ok(g.lsn)
    }

    /// Current stream position (ticket of everything appended so far).
    pub fn lsn(&self) -> u64 {
        self.inner.lock().lsn
    }

    /// Total time producers spent blocked on a full buffer (ns).
    pub fn producer_wait_ns(&self) -> u64 {
        self.inner.lock().producer_wait_ns
    }

    /// Asks for a flush now.
    pub fn request_flush(&self) {
        let mut g = self.inner.lock();
        g.force = true;
        self.work.notify_one();
    }

    /// Waits until a flush is due (size, age, request or close), then takes everything buffered.
    pub fn take(&self) -> Taken {
        let mut g = self.inner.lock();
        loop {
            let due_by_age = g.oldest.is_some_and(|t| t.elapsed() >= self.flush_interval);
            if g.buffered >= self.flush_threshold || g.force || due_by_age || g.closed {
                break;
            }
            let wait = match g.oldest {
                Some(t) => self.flush_interval.saturating_sub(t.elapsed()),
                None => self.flush_interval,
            };
            self.work
                .wait_for(&mut g, wait.max(Duration::from_millis(1)));
        }
        let mut chunks = std::mem::take(&mut g.full);
        if !g.cur.data.is_empty() {
            let next = g.free.pop().unwrap_or_default();
            chunks.push(std::mem::replace(&mut g.cur, next));
        }
        g.buffered = 0;
        let oldest = g.oldest.take();
        g.force = false;
        Taken {
            chunks,
            lsn: g.lsn,
            oldest,
            closed: g.closed,
        }
    }

    /// Returns drained chunks to the ring.
    pub fn release(&self, chunks: Vec<Chunk>) {
        let mut g = self.inner.lock();
        for mut c in chunks {
            c.clear();
            if g.cur.data.capacity() == 0 {
                g.cur = c;
            } else {
                g.free.push(c);
            }
        }
        g.side_bytes = side_bytes(&g);
        self.space.notify_all();
    }

    /// Frees the side tables of the empty chunks (at rest; they grow again with the entries).
    pub fn release_spare_records(&self) {
        let mut g = self.inner.lock();
        let g = &mut *g;
        for c in g.free.iter_mut().chain(std::iter::once(&mut g.cur)) {
            if c.data.is_empty() {
                c.batches = Vec::new();
                c.records = Vec::new();
            }
        }
        g.side_bytes = side_bytes(g);
    }

    /// Bytes the buffer holds: its chunks (allocated at open) and their side tables.
    pub fn held_bytes(&self, total_bytes: usize) -> u64 {
        let chunks = total_bytes / self.chunk_bytes.max(1) * self.chunk_bytes;
        (chunks + self.inner.lock().side_bytes) as u64
    }

    pub fn close(&self) {
        let mut g = self.inner.lock();
        g.closed = true;
        self.work.notify_all();
        self.space.notify_all();
    }

    pub fn fail(&self, msg: String) {
        let mut g = self.inner.lock();
        if g.failed.is_none() {
            g.failed = Some(msg);
        }
        self.space.notify_all();
    }
}

/// Bytes of the side tables of the chunks in the ring (not of those being flushed).
fn side_bytes(g: &Inner) -> usize {
    g.free
        .iter()
        .chain(&g.full)
        .chain(std::iter::once(&g.cur))
        .map(|c| {
            c.batches.capacity() * std::mem::size_of::<BatchMeta>()
                + c.records.capacity() * std::mem::size_of::<VersionRecord>()
        })
        .sum()
}
