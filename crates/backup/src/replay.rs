//! Replay: rebuilds the newest version of every live key of a tablet from its secondary log, its
//! secondary-log buffer (the primary log's share, restored at open), its version log and version
//! buffer.
//!
//! Several threads read whole segments (O_DIRECT, so from the disk, not the page cache) and parse
//! them; every entry is checked against its CRC32C. The newest version of each key wins across all
//! sources — data entries, put records and delete records of the version log — which is correct
//! even when the version log lags the data after a crash (DXRAM §4.12). A key whose newest known
//! version has no intact entry is reported as lost and not returned: an older version is never
//! resurrected in its place.

use crate::engine::Shared;
use crate::format::{self, BLOCK_HEADER_BYTES, ENTRY_HEADER_BYTES};
use crate::io::{self, AlignedBuf};
use crate::tablet::{HashMapU128, Tablet};
use crate::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// One live key as replay yields it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayEntry<'a> {
    pub tablet: u64,
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub version: u64,
    pub expiry: u64,
}

/// What a replay found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReplayReport {
    /// Keys yielded (live, newest version).
    pub live_keys: u64,
    /// Keys whose newest version is a delete (not yielded).
    pub deleted_keys: u64,
    /// Older versions seen and skipped.
    pub stale_entries: u64,
    /// Entries whose checksum failed (never yielded).
    pub corrupt_entries: u64,
    /// Bytes that could not be parsed (a damaged length field ends a block).
    pub unreadable_bytes: u64,
    /// Keys whose newest known version had no intact entry (reported, not yielded).
    pub lost_keys: u64,
    /// Version-log bytes that failed their checksum: the deletes recorded there are unknown, so
    /// keys deleted in them may come back. Reported so that the caller can restore from a replica.
    pub damaged_version_bytes: u64,
    /// Highest version seen, deletes included (a restarted master continues above it).
    pub max_version: u64,
    pub bytes_read: u64,
    pub segments_read: u64,
}

impl ReplayReport {
    pub fn add(&mut self, o: &ReplayReport) {
        self.live_keys += o.live_keys;
        self.deleted_keys += o.deleted_keys;
        self.stale_entries += o.stale_entries;
        self.corrupt_entries += o.corrupt_entries;
        self.unreadable_bytes += o.unreadable_bytes;
        self.lost_keys += o.lost_keys;
        self.damaged_version_bytes += o.damaged_version_bytes;
        self.max_version = self.max_version.max(o.max_version);
        self.bytes_read += o.bytes_read;
        self.segments_read += o.segments_read;
    }

    /// True if nothing damaged was found.
    pub fn is_clean(&self) -> bool {
        self.corrupt_entries == 0 && self.unreadable_bytes == 0 && self.lost_keys == 0 && self.damaged_version_bytes == 0
    }
}

const LOC_DELETE: u64 = u64::MAX;
const LOC_KNOWN_PUT: u64 = u64::MAX - 1;
const PARTITIONS: usize = 64;

#[derive(Clone, Copy)]
struct Item {
    hash: u128,
    version: u64,
    /// source index << 32 | offset, or LOC_DELETE / LOC_KNOWN_PUT.
    loc: u64,
}

#[inline]
fn partition(hash: u128) -> usize {
    (hash >> 122) as usize & (PARTITIONS - 1)
}

struct WorkerOut {
    buffers: Vec<(usize, AlignedBuf)>,
    parts: Vec<Vec<Item>>,
    corrupt: u64,
    unreadable: u64,
    bytes: u64,
}

/// Replays one tablet; `f` is called once per live key.
pub fn replay_tablet(sh: &Shared, t: &Arc<Tablet>, f: &mut dyn FnMut(ReplayEntry<'_>)) -> Result<ReplayReport> {
    let _guard = t.reorg_lock.lock();
    let (segments, slb, vbuf) = {
        let st = t.state.lock();
        let segs: Vec<(usize, u64)> =
            st.segments.iter().enumerate().filter(|(_, s)| s.used > 0).map(|(i, s)| (i, s.used)).collect();
        (segs, st.slb.clone(), st.vbuf.clone())
    };
    let ver_bytes = {
        let vl = t.verlog.lock();
        let mut b = vec![0u8; vl.len as usize];
        let n = io::read_exact_at(&vl.file, &mut b, 0).map_err(|e| Error::io(&t.ver_path, e))?;
        b.truncate(n);
        b
    };
    let threads = sh.cfg.replay_threads.max(1);
    let next = AtomicUsize::new(0);
    let slb_index = segments.len();
    let mut report = ReplayReport { bytes_read: ver_bytes.len() as u64, ..Default::default() };

    // Phase 1: read and parse segments in parallel; versions are parsed on this thread meanwhile.
    let (outs, version_parts, version_damage) = std::thread::scope(|s| -> Result<(Vec<WorkerOut>, Vec<Vec<Item>>, u64)> {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let segments = &segments;
                let next = &next;
                s.spawn(move || -> Result<WorkerOut> {
                    let mut out = WorkerOut {
                        buffers: Vec::new(),
                        parts: (0..PARTITIONS).map(|_| Vec::new()).collect(),
                        corrupt: 0,
                        unreadable: 0,
                        bytes: 0,
                    };
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(seg, used)) = segments.get(k) else { break };
                        let mut buf = AlignedBuf::new(used as usize);
                        let n = io::read_exact_at(&t.file, &mut buf.full_mut()[..used as usize], seg as u64 * t.segment_bytes)
                            .map_err(|e| Error::io(&t.sec_path, e))?;
                        buf.set_len(n);
                        out.bytes += n as u64;
                        parse_region(buf.as_slice(), k, t.id, &mut out);
                        out.buffers.push((k, buf));
                    }
                    Ok(out)
                })
            })
            .collect();
        let mut vparts: Vec<Vec<Item>> = (0..PARTITIONS).map(|_| Vec::new()).collect();
        let walk = format::walk_version_log(&ver_bytes, |_, recs| {
            for r in format::version_records(recs) {
                let loc = if r.deleted { LOC_DELETE } else { LOC_KNOWN_PUT };
                vparts[partition(r.hash)].push(Item { hash: r.hash, version: r.version, loc });
            }
        });
        for r in &vbuf {
            let loc = if r.deleted { LOC_DELETE } else { LOC_KNOWN_PUT };
            vparts[partition(r.hash)].push(Item { hash: r.hash, version: r.version, loc });
        }
        let mut outs = Vec::with_capacity(threads);
        let vdamage = walk.damaged_bytes + walk.tail_bytes;
        for h in handles {
            outs.push(h.join().map_err(|_| Error::Corrupt("replay worker panicked".into()))??);
        }
        Ok((outs, vparts, vdamage))
    })?;

    // The SLB (primary-log share) is parsed here: it holds bare entries, no block headers.
    let mut slb_out = WorkerOut { buffers: Vec::new(), parts: (0..PARTITIONS).map(|_| Vec::new()).collect(), corrupt: 0, unreadable: 0, bytes: 0 };
    let stats = format::walk_entries(&slb, |off, e| {
        let h = format::key_hash(e.key);
        slb_out.parts[partition(h)].push(Item { hash: h, version: e.version, loc: ((slb_index as u64) << 32) | off as u64 });
    });
    slb_out.corrupt += stats.corrupt_entries;

    let mut sources: Vec<&[u8]> = vec![&[]; segments.len() + 1];
    for o in &outs {
        for (k, b) in &o.buffers {
            sources[*k] = b.as_slice();
        }
        report.corrupt_entries += o.corrupt;
        report.unreadable_bytes += o.unreadable;
        report.bytes_read += o.bytes;
    }
    report.corrupt_entries += slb_out.corrupt;
    report.damaged_version_bytes = version_damage;
    report.segments_read = segments.len() as u64;
    sources[slb_index] = &slb;

    // Phase 2: merge each hash partition (in parallel) into its winners.
    let next_part = AtomicUsize::new(0);
    let merged: Vec<(usize, Vec<(u64, u64)>, ReplayReport)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let outs = &outs;
                let version_parts = &version_parts;
                let slb_out = &slb_out;
                let next_part = &next_part;
                s.spawn(move || {
                    let mut done = Vec::new();
                    loop {
                        let p = next_part.fetch_add(1, Ordering::Relaxed);
                        if p >= PARTITIONS {
                            break;
                        }
                        let n: usize = outs.iter().map(|o| o.parts[p].len()).sum::<usize>() + version_parts[p].len();
                        let mut best: HashMapU128<(u64, u64)> = HashMapU128::with_capacity_and_hasher(n, Default::default());
                        let mut rep = ReplayReport::default();
                        let all = outs.iter().map(|o| &o.parts[p]).chain(std::iter::once(&slb_out.parts[p])).chain(std::iter::once(&version_parts[p]));
                        for items in all {
                            for it in items {
                                rep.max_version = rep.max_version.max(it.version);
                                match best.entry(it.hash) {
                                    std::collections::hash_map::Entry::Vacant(v) => {
                                        v.insert((it.version, it.loc));
                                    }
                                    std::collections::hash_map::Entry::Occupied(mut o) => {
                                        let (bv, bl) = *o.get();
                                        let replace = it.version > bv
                                            || (it.version == bv && (it.loc == LOC_DELETE || (bl == LOC_KNOWN_PUT && it.loc < LOC_KNOWN_PUT)));
                                        if replace {
                                            o.insert((it.version, it.loc));
                                        }
                                    }
                                }
                            }
                        }
                        let mut winners = Vec::with_capacity(best.len());
                        for (_, (v, loc)) in best {
                            match loc {
                                LOC_DELETE => rep.deleted_keys += 1,
                                LOC_KNOWN_PUT => rep.lost_keys += 1,
                                _ => winners.push((loc, v)),
                            }
                        }
                        rep.live_keys = winners.len() as u64;
                        done.push((p, winners, rep));
                    }
                    done
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("replay merge worker panicked")).collect()
    });

    // Phase 3: yield the winners.
    let data_items: u64 = outs.iter().map(|o| o.parts.iter().map(|v| v.len() as u64).sum::<u64>()).sum::<u64>()
        + slb_out.parts.iter().map(|v| v.len() as u64).sum::<u64>();
    for (_, winners, rep) in &merged {
        report.live_keys += rep.live_keys;
        report.deleted_keys += rep.deleted_keys;
        report.lost_keys += rep.lost_keys;
        report.max_version = report.max_version.max(rep.max_version);
        for &(loc, _) in winners {
            let src = sources[(loc >> 32) as usize];
            let off = (loc & 0xFFFF_FFFF) as usize;
            let e = entry_at(&src[off..]);
            f(ReplayEntry { tablet: t.id, key: e.0, value: e.1, version: e.2, expiry: e.3 });
        }
    }
    report.stale_entries = data_items.saturating_sub(report.live_keys);
    Ok(report)
}

/// Fields of an entry already verified in phase 1.
#[inline]
fn entry_at(b: &[u8]) -> (&[u8], &[u8], u64, u64) {
    let kl = u32::from_le_bytes([b[5], b[6], b[7], b[8]]) as usize;
    let vl = u32::from_le_bytes([b[9], b[10], b[11], b[12]]) as usize;
    let version = u64::from_le_bytes(b[13..21].try_into().expect("8 bytes"));
    let expiry = u64::from_le_bytes(b[21..29].try_into().expect("8 bytes"));
    (&b[ENTRY_HEADER_BYTES..ENTRY_HEADER_BYTES + kl], &b[ENTRY_HEADER_BYTES + kl..ENTRY_HEADER_BYTES + kl + vl], version, expiry)
}

fn parse_region(region: &[u8], source: usize, tablet: u64, out: &mut WorkerOut) {
    let src = (source as u64) << 32;
    format::walk_blocks(region, |boff, h, body| {
        if h.tablet != tablet {
            return;
        }
        let body_at = boff + BLOCK_HEADER_BYTES;
        let stats = format::walk_entries(body, |off, e| {
            if e.is_delete() {
                return;
            }
            let hash = format::key_hash(e.key);
            out.parts[partition(hash)].push(Item { hash, version: e.version, loc: src | (body_at + off) as u64 });
        });
        out.corrupt += stats.corrupt_entries;
        out.unreadable += stats.unreadable_bytes;
    });
}
