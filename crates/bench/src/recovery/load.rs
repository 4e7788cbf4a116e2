//! The load both failovers run, and what it saw.
//!
//! [`Load`] is a small Redis Cluster client of its own (std sockets, one connection per node per
//! thread, one request in flight per thread). Each thread owns a disjoint set of keys,
//! `k:<thread>:<i>` (no hash tag, so they spread over the slots), and overwrites them round-robin
//! with `SET key "<seq>:<padding>"`, the sequence number growing by one per key and write. The
//! client learns the slot map with `CLUSTER SLOTS` from any seed that answers, routes by CRC16
//! slot, follows `-MOVED` (and refreshes the map) and `-ASK`. A write that fails (`-TRYAGAIN`,
//! `-CLUSTERDOWN`, any other error, a refused or reset connection, a 1 s timeout) stays pending and
//! is written again, with the same sequence number, at that key's next turn; the node that failed
//! is left alone by that thread for 10 ms and the map is refreshed (at most every 10 ms per
//! thread), so that keys on the healthy nodes keep flowing meanwhile. Nothing gives up until the
//! load is stopped, and no socket operation waits more than 1 s.
//!
//! The load records, per key, the highest sequence number acknowledged with `+OK`, and a timeline
//! of acknowledgements (time, slot, node). From these, [`LoadResult`] gives:
//! - the **failover time**: from the kill until the first write to one of the dead master's slots
//!   acknowledged by another node ([`LoadResult::first_ack`]);
//! - the **longest gap**: the longest interval in which no write to the selected slots was
//!   acknowledged ([`LoadResult::longest_gap`]), for the dead master's slots and for the others;
//! - **lost writes** ([`LoadResult::verify`]): every key read back after the load; a key whose
//!   stored sequence number is below its highest acknowledged one (or that is absent although a
//!   write to it was acknowledged) lost an acknowledged write.
//!
//! [`warm_up`] is how both failovers begin: 2 s of load that must reach the victim before it is
//! killed. [`settle_after_kill`] is how both end: the victim's slots take writes again, the load
//! runs 2 s more, and every key is read back ([`super::readback`]).

use super::client::{
    fetch_map, host_of, invalid, io_kind, node_addr, Conn, Nodes, Reply, NO_NODE, RETRY_PAUSE,
};
use super::readback::{read_keys, Verify};
use anyhow::{bail, Context};
use ramlog_common::{key_slot, SLOT_COUNT};
use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Redirections followed for one write before it counts as failed.
const MAX_REDIRECTS: usize = 5;
/// Load threads of each failover.
pub(super) const THREADS: usize = 4;
/// Keys the load writes, over all its threads (ramlog and Redis alike).
pub(super) const LOAD_KEYS: usize = 10_000;

/// One acknowledged write: when (since the load started), to which slot, by which node, and how
/// long it took from its first send (redirections included; not earlier failed attempts).
#[derive(Debug, Clone, Copy)]
struct Ack {
    at_ns: u64,
    slot: u16,
    node: u16,
    latency_us: u32,
}

/// Low bits of a packed [`Shared::last_ack`] entry: nanoseconds since the start, plus one.
const TIME_MASK: u64 = (1 << 48) - 1;

/// What the load's threads share with whoever watches them.
struct Shared {
    started: Instant,
    stop: AtomicBool,
    acked: AtomicU64,
    /// Per slot, the latest acknowledgement seen: `node << 48 | (nanoseconds since start + 1)`;
    /// 0 before the first.
    last_ack: Vec<AtomicU64>,
    nodes: Nodes,
    seeds: Vec<String>,
}

/// What one load thread hands back when stopped.
struct ThreadLog {
    /// Highest acknowledged sequence number per key (0: none).
    highest: Vec<u64>,
    acks: Vec<Ack>,
    errors: BTreeMap<String, u64>,
}

/// A running multi-threaded SET load against a Redis Cluster (or anything speaking its protocol).
/// Stopped, and its threads joined, when dropped.
pub struct Load {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<ThreadLog>>,
    keys_per_thread: usize,
}

impl Load {
    /// Starts `threads` threads, each writing its own `keys_per_thread` keys with values of
    /// `value_size` bytes (at least `"<seq>:"`), routed with the slot map learnt from `seeds`
    /// (`host:port`). Fails if no seed answers `CLUSTER SLOTS` within 10 s.
    pub fn start(
        seeds: &[String],
        threads: usize,
        keys_per_thread: usize,
        value_size: usize,
    ) -> anyhow::Result<Load> {
        if seeds.is_empty() || threads == 0 || keys_per_thread == 0 {
            bail!("a load needs seeds, threads and keys");
        }
        let shared = Arc::new(Shared {
            started: Instant::now(),
            stop: AtomicBool::new(false),
            acked: AtomicU64::new(0),
            last_ack: (0..SLOT_COUNT).map(|_| AtomicU64::new(0)).collect(),
            nodes: Nodes::default(),
            seeds: seeds.to_vec(),
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        let map = loop {
            if let Some(map) = fetch_map(seeds.iter().map(String::as_str), &shared.nodes, None) {
                break map;
            }
            if Instant::now() > deadline {
                bail!("no seed of {seeds:?} answered CLUSTER SLOTS");
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let padding = vec![b'x'; value_size];
        let mut handles = Vec::with_capacity(threads);
        for t in 0..threads {
            let keys: Vec<Vec<u8>> = (0..keys_per_thread).map(|i| key_name(t, i)).collect();
            let worker = Worker {
                index: t,
                shared: shared.clone(),
                map: map.clone(),
                conns: Vec::new(),
                retry_at: Vec::new(),
                refresh_due: false,
                last_refresh: Instant::now(),
                slots: keys.iter().map(|k| key_slot(k)).collect(),
                next_seq: vec![1; keys_per_thread],
                keys,
                padding: padding.clone(),
                buf: Vec::with_capacity(value_size + 64),
                acks: Vec::new(),
                errors: BTreeMap::new(),
            };
            let spawned = std::thread::Builder::new()
                .name(format!("load-{t}"))
                .spawn(move || worker.run());
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    // Dropping the load stops and joins the threads started so far.
                    drop(Load {
                        shared,
                        threads: handles,
                        keys_per_thread,
                    });
                    return Err(e).context("starting a load thread");
                }
            }
        }
        Ok(Load {
            shared,
            threads: handles,
            keys_per_thread,
        })
    }

    /// When the load started.
    pub fn started(&self) -> Instant {
        self.shared.started
    }

    /// Writes acknowledged so far.
    pub fn acked(&self) -> u64 {
        self.shared.acked.load(Ordering::Relaxed)
    }

    /// The latest acknowledgement so far of a write to one of the selected slots by a node other
    /// than `excluding` (`host:port` as the cluster names it); None if there was none.
    pub fn last_ack(
        &self,
        slots: impl Fn(u16) -> bool,
        excluding: Option<&str>,
    ) -> Option<Instant> {
        let excluded = excluding.and_then(|a| self.shared.nodes.find(a));
        let mut latest = None;
        for slot in (0..SLOT_COUNT).filter(|&s| slots(s)) {
            let packed = self.shared.last_ack[slot as usize].load(Ordering::Relaxed);
            if packed == 0 || Some((packed >> 48) as u16) == excluded {
                continue;
            }
            let ns = (packed & TIME_MASK) - 1;
            latest = latest.max(Some(ns));
        }
        latest.map(|ns| self.shared.started + Duration::from_nanos(ns))
    }

    /// Stops the threads (each ends within its current request, at most a few socket timeouts)
    /// and gathers what they recorded.
    pub fn stop(mut self) -> LoadResult {
        self.shared.stop.store(true, Ordering::Relaxed);
        let mut result = LoadResult {
            started: self.shared.started,
            stopped: Instant::now(),
            acked: 0,
            errors: BTreeMap::new(),
            keys_per_thread: self.keys_per_thread,
            highest: Vec::new(),
            acks: Vec::new(),
            nodes: Vec::new(),
        };
        for handle in self.threads.drain(..) {
            match handle.join() {
                Ok(log) => {
                    for (kind, n) in log.errors {
                        *result.errors.entry(kind).or_default() += n;
                    }
                    result.acks.extend(log.acks);
                    result.highest.push(log.highest);
                }
                Err(_) => {
                    // Its keys are not verified; the count says so.
                    *result.errors.entry("thread_panicked".into()).or_default() += 1;
                    result.highest.push(Vec::new());
                }
            }
        }
        result.stopped = Instant::now();
        result.acks.sort_unstable_by_key(|a| a.at_ns);
        result.acked = result.acks.len() as u64;
        result.nodes = self.shared.nodes.list().clone();
        result
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
    }
}

/// The name of key `i` of thread `t`.
fn key_name(t: usize, i: usize) -> Vec<u8> {
    format!("k:{t}:{i}").into_bytes()
}

/// One load thread.
struct Worker {
    index: usize,
    shared: Arc<Shared>,
    /// Owner of every slot ([`NO_NODE`]: unknown).
    map: Vec<u16>,
    /// By node id.
    conns: Vec<Option<Conn>>,
    /// By node id: not before this instant after a failure.
    retry_at: Vec<Option<Instant>>,
    refresh_due: bool,
    last_refresh: Instant,
    keys: Vec<Vec<u8>>,
    slots: Vec<u16>,
    /// The sequence number each key's next (or pending) write carries.
    next_seq: Vec<u64>,
    padding: Vec<u8>,
    buf: Vec<u8>,
    acks: Vec<Ack>,
    errors: BTreeMap<String, u64>,
}

/// How one attempt at a write ended.
enum Outcome {
    Acked,
    /// Left pending; the node is left alone for a while.
    Failed,
}

impl Worker {
    fn run(mut self) -> ThreadLog {
        let n = self.keys.len();
        let mut key = 0;
        // Keys passed over in a row because their node is resting or unknown.
        let mut skipped = 0;
        while !self.shared.stop.load(Ordering::Relaxed) {
            if self.refresh_due && self.last_refresh.elapsed() >= RETRY_PAUSE {
                self.refresh();
            }
            let k = key;
            key = (key + 1) % n;
            let node = self.map[self.slots[k] as usize];
            let now = Instant::now();
            let rest = if node == NO_NODE {
                self.refresh_due = true;
                Some(RETRY_PAUSE)
            } else {
                self.retry_at
                    .get(node as usize)
                    .copied()
                    .flatten()
                    .filter(|&t| t > now)
                    .map(|t| t - now)
            };
            if let Some(rest) = rest {
                skipped += 1;
                if skipped >= n {
                    // Every key's node is resting: wait for the first to be tried again.
                    std::thread::sleep(rest.min(RETRY_PAUSE));
                    skipped = 0;
                }
                continue;
            }
            skipped = 0;
            if let Outcome::Failed = self.write(k, node) {
                self.refresh_due = true;
            }
        }
        ThreadLog {
            highest: self.next_seq.iter().map(|s| s - 1).collect(),
            acks: self.acks,
            errors: self.errors,
        }
    }

    fn count(&mut self, kind: &str) {
        *self.errors.entry(kind.to_string()).or_default() += 1;
    }

    /// Re-reads the slot map, seeds first (starting at a different one per thread), then the
    /// nodes known; keeps the old map if nobody answers.
    fn refresh(&mut self) {
        self.last_refresh = Instant::now();
        let seeds = &self.shared.seeds;
        let known: Vec<String> = self.shared.nodes.list().clone();
        let start = self.index % seeds.len();
        let order = seeds[start..]
            .iter()
            .chain(&seeds[..start])
            .chain(known.iter())
            .map(String::as_str);
        if let Some(map) = fetch_map(order, &self.shared.nodes, Some(&self.shared.stop)) {
            self.map = map;
            self.refresh_due = false;
        } else {
            self.count("no_map");
        }
    }

    /// Makes the per-node vectors long enough for `node`.
    fn ensure(&mut self, node: u16) {
        let want = node as usize + 1;
        if self.conns.len() < want {
            self.conns.resize_with(want, || None);
            self.retry_at.resize(want, None);
        }
    }

    /// Sends the command in `buf` to `node` (after `ASKING` if `asking`) and reads its reply.
    /// Drops the connection on any I/O failure.
    fn request(&mut self, node: u16, asking: bool) -> io::Result<Reply> {
        self.ensure(node);
        let slot = &mut self.conns[node as usize];
        let result = (|| {
            if slot.is_none() {
                let addr = self
                    .shared
                    .nodes
                    .name(node)
                    .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "unknown node"))?;
                *slot = Some(Conn::open(&addr)?);
            }
            let conn = slot.as_mut().ok_or_else(|| invalid("no connection"))?;
            if asking {
                conn.send(b"*1\r\n$6\r\nASKING\r\n")?;
            }
            conn.send(&self.buf)?;
            if asking {
                let reply = conn.recv()?;
                if reply != Reply::Status("OK".into()) {
                    // Read the SET's reply too, so that the connection stays in step.
                    conn.recv()?;
                    return Ok(reply);
                }
            }
            conn.recv()
        })();
        if result.is_err() {
            *slot = None;
        }
        result
    }

    /// Writes key `k`'s pending sequence number through `node`, following redirections.
    fn write(&mut self, k: usize, mut node: u16) -> Outcome {
        let seq = self.next_seq[k];
        let head = format!("{seq}:");
        let pad = self.padding.len().saturating_sub(head.len());
        self.buf.clear();
        let key = &self.keys[k];
        self.buf
            .extend_from_slice(format!("*3\r\n$3\r\nSET\r\n${}\r\n", key.len()).as_bytes());
        self.buf.extend_from_slice(key);
        self.buf
            .extend_from_slice(format!("\r\n${}\r\n{head}", head.len() + pad).as_bytes());
        self.buf.extend_from_slice(&self.padding[..pad]);
        self.buf.extend_from_slice(b"\r\n");

        let mut asking = false;
        let began = Instant::now();
        for _ in 0..=MAX_REDIRECTS {
            match self.request(node, asking) {
                Ok(Reply::Status(s)) if s == "OK" => {
                    self.acked(k, node, began);
                    return Outcome::Acked;
                }
                Ok(Reply::Error(e)) => {
                    let mut words = e.split_whitespace();
                    let kind = words.next().unwrap_or("").to_ascii_lowercase();
                    self.count(&kind);
                    if kind != "moved" && kind != "ask" {
                        return self.failed(node);
                    }
                    let slot = words.next().and_then(|s| s.parse::<u16>().ok());
                    let target = words.next().and_then(|a| a.rsplit_once(':'));
                    let (Some(slot), Some((host, port))) = (slot, target) else {
                        return self.failed(node);
                    };
                    let from = self.shared.nodes.name(node).unwrap_or_default();
                    let target = self.shared.nodes.id(&node_addr(host, port, host_of(&from)));
                    if target == NO_NODE || slot >= SLOT_COUNT {
                        return self.failed(node);
                    }
                    asking = kind == "ask";
                    if !asking {
                        self.map[slot as usize] = target;
                        self.refresh_due = true;
                    }
                    node = target;
                }
                Ok(_) => {
                    self.count("unexpected_reply");
                    return self.failed(node);
                }
                Err(e) => {
                    self.count(io_kind(&e));
                    return self.failed(node);
                }
            }
        }
        self.count("redirect_loop");
        Outcome::Failed
    }

    fn failed(&mut self, node: u16) -> Outcome {
        self.ensure(node);
        self.retry_at[node as usize] = Some(Instant::now() + RETRY_PAUSE);
        Outcome::Failed
    }

    fn acked(&mut self, k: usize, node: u16, began: Instant) {
        let at_ns = self.shared.started.elapsed().as_nanos() as u64;
        let slot = self.slots[k];
        let latency_us = began.elapsed().as_micros().min(u32::MAX as u128) as u32;
        self.acks.push(Ack {
            at_ns,
            slot,
            node,
            latency_us,
        });
        self.shared.last_ack[slot as usize].store(
            u64::from(node) << 48 | ((at_ns + 1) & TIME_MASK),
            Ordering::Relaxed,
        );
        self.shared.acked.fetch_add(1, Ordering::Relaxed);
        self.next_seq[k] += 1;
    }
}

// ---------------------------------------------------------------------------------------------
// Results
// ---------------------------------------------------------------------------------------------

/// What a stopped [`Load`] recorded.
pub struct LoadResult {
    pub started: Instant,
    pub stopped: Instant,
    /// Writes acknowledged with `+OK`.
    pub acked: u64,
    /// Failed attempts (and redirections: `moved`, `ask`) by kind: the error reply's first word
    /// lowercased (`clusterdown`, `tryagain`, ...), or `refused`, `reset`, `closed`, `timeout`,
    /// `protocol`, `io` for connections, `no_map` for refreshes nobody answered.
    pub errors: BTreeMap<String, u64>,
    keys_per_thread: usize,
    /// Highest acknowledged sequence number by thread, then key (0: none; empty: the thread
    /// panicked).
    highest: Vec<Vec<u64>>,
    /// Every acknowledgement, in time order.
    acks: Vec<Ack>,
    /// Node addresses by id.
    nodes: Vec<String>,
}

impl LoadResult {
    fn at(&self, ack: &Ack) -> Instant {
        self.started + Duration::from_nanos(ack.at_ns)
    }

    fn node_id(&self, addr: Option<&str>) -> Option<u16> {
        addr.and_then(|a| self.nodes.iter().position(|n| n == a))
            .map(|i| i as u16)
    }

    /// The acknowledgements from `from` on, in time order.
    fn acks_from(&self, from: Instant) -> &[Ack] {
        let from_ns = from.saturating_duration_since(self.started).as_nanos() as u64;
        let first = self.acks.partition_point(|a| a.at_ns < from_ns);
        &self.acks[first..]
    }

    /// The longest interval within [`from`, `to`] in which no write to a selected slot was
    /// acknowledged (the whole interval if none was).
    pub fn longest_gap(&self, slots: impl Fn(u16) -> bool, from: Instant, to: Instant) -> Duration {
        let mut last = from;
        let mut longest = Duration::ZERO;
        for ack in self.acks_from(from) {
            let at = self.at(ack);
            if at > to {
                break;
            }
            if slots(ack.slot) {
                longest = longest.max(at.saturating_duration_since(last));
                last = at;
            }
        }
        longest.max(to.saturating_duration_since(last))
    }

    /// The first acknowledgement after `after` of a write to a selected slot by a node other
    /// than `excluding` (`host:port` as the cluster names it).
    pub fn first_ack(
        &self,
        slots: impl Fn(u16) -> bool,
        after: Instant,
        excluding: Option<&str>,
    ) -> Option<Instant> {
        let excluded = self.node_id(excluding);
        self.acks_from(after)
            .iter()
            .find(|a| slots(a.slot) && Some(a.node) != excluded && self.at(a) > after)
            .map(|a| self.at(a))
    }

    /// Acknowledged writes to the selected slots within [`from`, `to`].
    pub fn acks_between(&self, slots: impl Fn(u16) -> bool, from: Instant, to: Instant) -> u64 {
        self.acks_from(from)
            .iter()
            .take_while(|a| self.at(a) <= to)
            .filter(|a| slots(a.slot))
            .count() as u64
    }

    /// The acknowledged writes within [`from`, `to`]: how many, per second, and their latency
    /// percentiles.
    pub fn window(&self, from: Instant, to: Instant) -> Window {
        let mut latencies: Vec<u32> = self
            .acks_from(from)
            .iter()
            .take_while(|a| self.at(a) <= to)
            .map(|a| a.latency_us)
            .collect();
        latencies.sort_unstable();
        let pick = |q: f64| {
            if latencies.is_empty() {
                return Duration::ZERO;
            }
            let i = ((latencies.len() as f64 * q).ceil() as usize).clamp(1, latencies.len()) - 1;
            Duration::from_micros(u64::from(latencies[i]))
        };
        let secs = to.saturating_duration_since(from).as_secs_f64();
        Window {
            acked: latencies.len() as u64,
            per_second: if secs > 0.0 {
                latencies.len() as f64 / secs
            } else {
                0.0
            },
            p50: pick(0.50),
            p99: pick(0.99),
            p999: pick(0.999),
        }
    }

    /// Keys of the load with at least one acknowledged write.
    pub fn keys_written(&self) -> u64 {
        self.highest
            .iter()
            .flatten()
            .filter(|&&seq| seq > 0)
            .count() as u64
    }

    /// Reads every key of the load back through the cluster (`seeds`: `host:port`), following
    /// redirections and retrying failures after a map refresh, for at most 60 s; compares each
    /// stored sequence number (the integer before `:`) with the highest acknowledged one.
    pub fn verify(&self, seeds: &[String]) -> anyhow::Result<Verify> {
        // (key, highest acknowledged seq)
        let keys: Vec<(Vec<u8>, u64)> = self
            .highest
            .iter()
            .enumerate()
            .flat_map(|(t, seqs)| {
                seqs.iter()
                    .enumerate()
                    .map(move |(i, &seq)| (key_name(t, i), seq))
            })
            .collect();
        debug_assert!(self
            .highest
            .iter()
            .all(|h| h.is_empty() || h.len() == self.keys_per_thread));
        let names: Vec<Vec<u8>> = keys.iter().map(|(k, _)| k.clone()).collect();
        let values = read_keys(seeds, &names)?;
        let mut out = Verify::default();
        for ((key, acked), value) in keys.iter().zip(values) {
            out.check(key, *acked, value)?;
        }
        Ok(out)
    }
}

/// What a [`Load`] saw within a time window ([`LoadResult::window`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Window {
    pub acked: u64,
    pub per_second: f64,
    pub p50: Duration,
    pub p99: Duration,
    pub p999: Duration,
}

/// Before a kill: lets the load run 2 s, and fails (stopping it) if no write to the victim's slots
/// (`in_victim`) was acknowledged meanwhile, since a kill would then show nothing.
pub(super) fn warm_up(
    load: Load,
    in_victim: impl Fn(u16) -> bool,
    victim_addr: &str,
) -> anyhow::Result<Load> {
    std::thread::sleep(Duration::from_secs(2));
    if load.last_ack(in_victim, None).is_none() {
        let result = load.stop();
        bail!(
            "no write to the slots of {victim_addr} was acknowledged before the kill ({} acked, errors {:?})",
            result.acked,
            result.errors
        );
    }
    Ok(load)
}

/// After a kill: waits (until `deadline`) for the victim's slots to take a write acknowledged
/// by another server, lets the load run 2 s more, stops it, and reads every key back through the
/// survivors. Returns the load's result, the first write back, where the gap windows start (1 s
/// before the kill) and the verification.
pub(super) fn settle_after_kill(
    load: Load,
    in_victim: impl Fn(u16) -> bool + Copy,
    victim_addr: &str,
    killed_at: Instant,
    deadline: Instant,
    seeds: &[String],
) -> anyhow::Result<(LoadResult, Instant, Instant, Verify)> {
    while load
        .last_ack(in_victim, Some(victim_addr))
        .is_none_or(|t| t <= killed_at)
    {
        if Instant::now() > deadline {
            let result = load.stop();
            bail!(
                "the slots of {victim_addr} took no write within {:?} of its kill (errors {:?})",
                deadline - killed_at,
                result.errors
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_secs(2));
    let result = load.stop();
    let back = result
        .first_ack(in_victim, killed_at, Some(victim_addr))
        .context("no acknowledged write to the victim's slots after the kill")?;
    let from = killed_at
        .checked_sub(Duration::from_secs(1))
        .unwrap_or(result.started)
        .max(result.started);
    let survivors: Vec<String> = seeds
        .iter()
        .filter(|s| **s != victim_addr)
        .cloned()
        .collect();
    let verify = result.verify(&survivors)?;
    Ok((result, back, from, verify))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_and_first_acks() {
        let started = Instant::now();
        let ms = |n: u64| started + Duration::from_millis(n);
        let ack = |at: u64, slot, node| Ack {
            at_ns: at * 1_000_000,
            slot,
            node,
            latency_us: at as u32,
        };
        let result = LoadResult {
            started,
            stopped: ms(100),
            acked: 4,
            errors: BTreeMap::new(),
            keys_per_thread: 1,
            highest: vec![vec![3]],
            acks: vec![ack(10, 1, 0), ack(20, 2, 0), ack(60, 1, 1), ack(70, 2, 1)],
            nodes: vec!["a:1".into(), "b:2".into()],
        };
        let one = |s: u16| s == 1;
        assert_eq!(
            result.longest_gap(one, ms(0), ms(100)),
            Duration::from_millis(50)
        );
        assert_eq!(
            result.longest_gap(one, ms(15), ms(65)),
            Duration::from_millis(45)
        );
        assert_eq!(
            result.longest_gap(|_| true, ms(0), ms(100)),
            Duration::from_millis(40)
        );
        assert_eq!(
            result.longest_gap(|_| false, ms(0), ms(100)),
            Duration::from_millis(100)
        );
        assert_eq!(result.first_ack(one, ms(10), Some("a:1")), Some(ms(60)));
        assert_eq!(
            result.first_ack(|s| s == 2, ms(0), Some("b:2")),
            Some(ms(20))
        );
        assert_eq!(result.acks_between(|_| true, ms(10), ms(60)), 3);
        // Latencies of the acks at 20, 60 and 70 ms (each test ack took its time in µs).
        let w = result.window(ms(15), ms(75));
        assert_eq!(w.acked, 3);
        assert!((w.per_second - 50.0).abs() < 1e-9, "{}", w.per_second);
        assert_eq!(w.p50, Duration::from_micros(60));
        assert_eq!(w.p99, Duration::from_micros(70));
    }
}
