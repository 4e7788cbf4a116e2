//! The write buffer: a bounded ring of chunks that producers (callers of `append`) fill and the
//! flusher drains. Producers block when every chunk is full or in flight (back-pressure); memory
//! never grows beyond `write_buffer_bytes`.
//!
//! Each append becomes one or more batch records: `tablet u64 | body_len u32 | count u32` followed
//! by encoded entries (CRC computed by the producer, as DXRAM's message handler does).

use crate::format::{self, BATCH_HEADER_BYTES};
use crate::{Entry, Error, Result};
use parking_lot::{Condvar, Mutex};
use std::time::{Duration, Instant};

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
    cur: Vec<u8>,
    full: Vec<Vec<u8>>,
    free: Vec<Vec<u8>>,
    buffered: usize,
    /// Total bytes ever appended: the ticket of an append is this value after it.
    lsn: u64,
    oldest: Option<Instant>,
    force: bool,
    closed: bool,
    failed: Option<String>,
}

/// What one flush took out of the buffer.
pub(crate) struct Taken {
    pub chunks: Vec<Vec<u8>>,
    pub lsn: u64,
    pub force: bool,
    pub closed: bool,
}

impl WriteBuffer {
    pub fn new(total_bytes: usize, chunks: usize, flush_threshold: usize, flush_interval: Duration) -> Self {
        let chunk_bytes = total_bytes / chunks;
        let free = (0..chunks - 1).map(|_| Vec::with_capacity(chunk_bytes)).collect();
        WriteBuffer {
            inner: Mutex::new(Inner {
                cur: Vec::with_capacity(chunk_bytes),
                full: Vec::new(),
                free,
                buffered: 0,
                lsn: 0,
                oldest: None,
                force: false,
                closed: false,
                failed: None,
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
                let len = format::entry_bytes(e.key.len(), e.value.map_or(0, |v| v.len()));
                if BATCH_HEADER_BYTES + body + len > self.chunk_bytes {
                    break;
                }
                body += len;
                end += 1;
            }
            debug_assert!(end > start, "entry sizes are validated against the chunk size");
            ticket = self.append_record(tablet, &entries[start..end], body)?;
            start = end;
        }
        Ok(ticket)
    }

    fn append_record(&self, tablet: u64, entries: &[Entry<'_>], body: usize) -> Result<u64> {
        let need = BATCH_HEADER_BYTES + body;
        let mut g = self.inner.lock();
        loop {
            if let Some(msg) = &g.failed {
                return Err(Error::Failed(msg.clone()));
            }
            if g.closed {
                return Err(Error::Closed);
            }
            if g.cur.capacity() > 0 && g.cur.len() + need <= g.cur.capacity() {
                break;
            }
            if g.cur.capacity() > 0 && !g.cur.is_empty() {
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
            self.space.wait(&mut g);
        }
        let cur = &mut g.cur;
        let at = cur.len();
        cur.resize(at + BATCH_HEADER_BYTES, 0);
        for e in entries {
            match e.value {
                Some(v) => format::encode_entry(cur, format::KIND_PUT, e.key, v, e.version, e.expiry),
                None => format::encode_entry(cur, format::KIND_DELETE, e.key, &[], e.version, e.expiry),
            }
        }
        debug_assert_eq!(cur.len(), at + need);
        format::encode_batch_header(&mut cur[at..], tablet, body as u32, entries.len() as u32);
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
            self.work.wait_for(&mut g, wait.max(Duration::from_millis(1)));
        }
        let mut chunks = std::mem::take(&mut g.full);
        if !g.cur.is_empty() {
            let next = g.free.pop().unwrap_or_default();
            chunks.push(std::mem::replace(&mut g.cur, next));
        }
        g.buffered = 0;
        g.oldest = None;
        let force = std::mem::take(&mut g.force);
        Taken { chunks, lsn: g.lsn, force, closed: g.closed }
    }

    /// Returns drained chunks to the ring.
    pub fn release(&self, chunks: Vec<Vec<u8>>) {
        let mut g = self.inner.lock();
        for mut c in chunks {
            c.clear();
            if g.cur.capacity() == 0 {
                g.cur = c;
            } else {
                g.free.push(c);
            }
        }
        self.space.notify_all();
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
