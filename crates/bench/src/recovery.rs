//! `ramlog bench recovery`: what a client sees while a master dies, ramlog against Redis Cluster,
//! and the load generator both halves share.
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
//! [`redis_failover`] runs the load against a Redis Cluster of 4 masters + 4 replicas (one replica
//! per master, no persistence, the `cluster-node-timeout` given), kills -9 the master serving slot
//! 0 and measures the above. Redis replicates asynchronously, so the promoted replica may lack
//! writes its master acknowledged just before dying: the lost count is reported as measured. With
//! Redis's default `cluster-require-full-coverage yes`, every node answers `-CLUSTERDOWN` from the
//! moment the cluster marks the master failed until its replica takes over, which the other
//! slots' gap shows.
//!
//! [`ramlog_failover`] does the same to a ramlog cluster (a coordinator and 3 or 4 servers, R = 2,
//! the coordinator's default detection: 400 ms of missed heartbeats and a failed probe): it
//! preloads the master of slot 0 (the victim) with `data` bytes of values over RESP (the other
//! masters get none), runs the load against every server, kills -9 the victim after 2 s, and polls
//! the coordinator's status every 15 ms from another thread: **detection** is the kill until an
//! answer shows the victim dead, **recovery** from then until one shows no tablet recovering
//! (each of the victim's tablets restored by its first live backup from that backup's own logs),
//! **re-protection** from then until one shows no copy pending (the new masters copying the
//! tablets to their backups). The load runs on until 2 s after the victim's slots took a write
//! again; then its keys and 10 000 random preloaded keys are read back.
//!
//! [`run`] runs, per repeat and alternating, ramlog 4 servers with 100 B values, Redis with
//! 100 B, ramlog 4 servers with 1 KiB values, Redis with 1 KiB, ramlog 3 servers with 100 B (the
//! recovery time with 2 survivors instead of 3), ramlog 4 servers with 100 B in `durable` mode
//! (preloaded in `sync`) and in `mirror` mode (preloaded in `sync`, then the kill waits until
//! every mirror has built its memory; each of the victim's tablets is taken over by its mirror,
//! with a `gap_after_detection` row for the mirror's target); the rows are medians (losses: the largest). A ramlog run that fails
//! (detection, recovery or re-protection not within 120 s, a read-back that fails) is counted in
//! a `<case>_failed_runs` row and its logs are kept under
//! `$TMPDIR/ramlog-bench-recovery-<pid>-failed/`.
//!
//! Environment: `RAMLOG_BENCH_RECOVERY_MIB` (the victim's data, default 64 quick, 1024 full),
//! `RAMLOG_BENCH_RECOVERY_REPEATS` (default 1 quick, 3 full), `RAMLOG_BENCH_RECOVERY_CASES`
//! (a comma-separated subset of `r4_100B,r4_1KiB,r3_100B,r4_100B_durable,r4_100B_mirror`).

use crate::report::{Report, Row, Target};
use crate::resp::{free_port, which};
use anyhow::{bail, Context};
use ramlog_common::{key_slot, SLOT_COUNT};
use std::collections::{BTreeMap, HashSet};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Every socket operation (connect, write, read) gives up after this long.
const IO_TIMEOUT: Duration = Duration::from_secs(1);
/// A node that failed a request is left alone by that thread for this long, and the slot map is
/// refreshed at most this often per thread.
const RETRY_PAUSE: Duration = Duration::from_millis(10);
/// Redirections followed for one write before it counts as failed.
const MAX_REDIRECTS: usize = 5;
/// How long [`LoadResult::verify`] keeps trying to read every key back.
const VERIFY_DEADLINE: Duration = Duration::from_secs(60);
/// GETs pipelined per round trip by [`LoadResult::verify`], SETs by the preload.
const BATCH: usize = 500;
/// A node id no node has: the slot's owner is unknown.
const NO_NODE: u16 = u16::MAX;
/// Load threads of [`redis_failover`].
const THREADS: usize = 4;
/// Redis Cluster shape of [`redis_failover`]: masters, each with one replica.
const MASTERS: usize = 4;

// ---------------------------------------------------------------------------------------------
// RESP over std sockets
// ---------------------------------------------------------------------------------------------

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq)]
enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

/// Bounds on what a reply may announce, so that garbage cannot make us allocate without limit.
const MAX_LINE: u64 = 64 << 10;
const MAX_BULK: usize = 64 << 20;
const MAX_ARRAY: usize = 1 << 20;
const MAX_DEPTH: usize = 8;

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// One CRLF-terminated line, without the CRLF.
fn read_line<R: BufRead>(r: &mut R) -> io::Result<Vec<u8>> {
    let mut line = Vec::new();
    r.by_ref().take(MAX_LINE).read_until(b'\n', &mut line)?;
    if !line.ends_with(b"\n") {
        return Err(if (line.len() as u64) < MAX_LINE {
            io::ErrorKind::UnexpectedEof.into()
        } else {
            invalid("reply line too long")
        });
    }
    if !line.ends_with(b"\r\n") {
        return Err(invalid("reply line without CR"));
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

fn read_reply<R: BufRead>(r: &mut R, depth: usize) -> io::Result<Reply> {
    let line = read_line(r)?;
    let (&kind, rest) = line
        .split_first()
        .ok_or_else(|| invalid("empty reply line"))?;
    let text = || String::from_utf8_lossy(rest).into_owned();
    let int = || -> io::Result<i64> {
        std::str::from_utf8(rest)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| invalid(format!("bad integer {:?}", text())))
    };
    // A negative length is a null; anything above `max` is refused.
    let len = |max: usize| -> io::Result<Option<usize>> {
        let n = int()?;
        if n < 0 {
            return Ok(None);
        }
        match usize::try_from(n) {
            Ok(n) if n <= max => Ok(Some(n)),
            _ => Err(invalid(format!("reply length {n} too large"))),
        }
    };
    match kind {
        b'+' => Ok(Reply::Status(text())),
        b'-' => Ok(Reply::Error(text())),
        b':' => Ok(Reply::Int(int()?)),
        b'$' => {
            let Some(n) = len(MAX_BULK)? else {
                return Ok(Reply::Bulk(None));
            };
            let mut buf = vec![0u8; n + 2];
            r.read_exact(&mut buf)?;
            if !buf.ends_with(b"\r\n") {
                return Err(invalid("bulk string without CRLF"));
            }
            buf.truncate(n);
            Ok(Reply::Bulk(Some(buf)))
        }
        b'*' => {
            let Some(n) = len(MAX_ARRAY)? else {
                return Ok(Reply::Array(None));
            };
            if depth >= MAX_DEPTH {
                return Err(invalid("reply nested too deeply"));
            }
            let mut items = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                items.push(read_reply(r, depth + 1)?);
            }
            Ok(Reply::Array(Some(items)))
        }
        _ => Err(invalid(format!("unexpected reply type byte {kind:#04x}"))),
    }
}

/// Appends one command in RESP to `out`.
fn encode(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

/// A connection to one node; every operation times out after [`IO_TIMEOUT`].
struct Conn {
    reader: BufReader<TcpStream>,
}

impl Conn {
    fn open(addr: &str) -> io::Result<Conn> {
        let sock = addr.to_socket_addrs()?.next().ok_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, format!("no address for {addr}"))
        })?;
        let s = TcpStream::connect_timeout(&sock, IO_TIMEOUT)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(IO_TIMEOUT))?;
        s.set_write_timeout(Some(IO_TIMEOUT))?;
        Ok(Conn {
            reader: BufReader::with_capacity(64 << 10, s),
        })
    }

    fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.reader.get_mut().write_all(bytes)
    }

    fn recv(&mut self) -> io::Result<Reply> {
        read_reply(&mut self.reader, 0)
    }

    fn call(&mut self, args: &[&[u8]]) -> io::Result<Reply> {
        let mut out = Vec::new();
        encode(&mut out, args);
        self.send(&out)?;
        self.recv()
    }
}

/// One command on a fresh connection to `addr`.
fn call(addr: &str, args: &[&str]) -> anyhow::Result<Reply> {
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    Conn::open(addr)
        .with_context(|| format!("connecting to {addr}"))?
        .call(&args)
        .with_context(|| format!("calling {addr}"))
}

/// The text of an INFO section, or of CLUSTER INFO (`args`).
fn text(addr: &str, args: &[&str]) -> anyhow::Result<String> {
    match call(addr, args)? {
        Reply::Bulk(Some(body)) => Ok(String::from_utf8_lossy(&body).into_owned()),
        other => bail!("{args:?} on {addr}: {other:?}"),
    }
}

/// The error class of an I/O failure, as counted in [`LoadResult::errors`].
fn io_kind(e: &io::Error) -> &'static str {
    use io::ErrorKind::*;
    match e.kind() {
        ConnectionRefused => "refused",
        ConnectionReset | ConnectionAborted | BrokenPipe => "reset",
        UnexpectedEof => "closed",
        TimedOut | WouldBlock => "timeout",
        InvalidData => "protocol",
        _ => "io",
    }
}

// ---------------------------------------------------------------------------------------------
// Nodes and the slot map
// ---------------------------------------------------------------------------------------------

/// Node addresses (`host:port`) by small ids, shared by the load's threads.
#[derive(Default)]
struct Nodes(Mutex<Vec<String>>);

impl Nodes {
    fn list(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The id of `addr`, given one if new ([`NO_NODE`] once ids run out).
    fn id(&self, addr: &str) -> u16 {
        let mut list = self.list();
        if let Some(i) = list.iter().position(|a| a == addr) {
            return i as u16;
        }
        if list.len() >= NO_NODE as usize {
            return NO_NODE;
        }
        list.push(addr.to_string());
        (list.len() - 1) as u16
    }

    fn find(&self, addr: &str) -> Option<u16> {
        self.list().iter().position(|a| a == addr).map(|i| i as u16)
    }

    fn name(&self, id: u16) -> Option<String> {
        self.list().get(id as usize).cloned()
    }
}

/// `host:port`, with `host` taken from `fallback` when the node left it empty (Redis does when it
/// does not know its own address), and bracketed when it is IPv6.
fn node_addr(host: &str, port: &str, fallback: &str) -> String {
    let host = if host.is_empty() || host == "?" {
        fallback
    } else {
        host
    };
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The host part of `host:port`.
fn host_of(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}

/// The owner of every slot from a `CLUSTER SLOTS` reply, [`NO_NODE`] for uncovered slots.
fn parse_slots(reply: &Reply, fallback_host: &str, nodes: &Nodes) -> Result<Vec<u16>, String> {
    let Reply::Array(Some(ranges)) = reply else {
        return Err(format!("CLUSTER SLOTS replied {reply:?}"));
    };
    let mut owner = vec![NO_NODE; SLOT_COUNT as usize];
    for range in ranges {
        let Reply::Array(Some(items)) = range else {
            return Err(format!("CLUSTER SLOTS range {range:?}"));
        };
        let (Some(Reply::Int(start)), Some(Reply::Int(end)), Some(Reply::Array(Some(master)))) =
            (items.first(), items.get(1), items.get(2))
        else {
            return Err(format!("CLUSTER SLOTS range {range:?}"));
        };
        let (Some(Reply::Bulk(Some(host))), Some(Reply::Int(port))) =
            (master.first(), master.get(1))
        else {
            return Err(format!("CLUSTER SLOTS node {master:?}"));
        };
        if !(0 <= *start && start <= end && *end < i64::from(SLOT_COUNT)) {
            return Err(format!("CLUSTER SLOTS range {start}-{end}"));
        }
        let addr = node_addr(
            &String::from_utf8_lossy(host),
            &port.to_string(),
            fallback_host,
        );
        owner[*start as usize..=*end as usize].fill(nodes.id(&addr));
    }
    Ok(owner)
}

/// The slot map from the first of `addrs` that answers `CLUSTER SLOTS` with at least one covered
/// slot; None if none does. Checks `stop` between nodes.
fn fetch_map<'a>(
    addrs: impl IntoIterator<Item = &'a str>,
    nodes: &Nodes,
    stop: Option<&AtomicBool>,
) -> Option<Vec<u16>> {
    for addr in addrs {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return None;
        }
        let Ok(mut conn) = Conn::open(addr) else {
            continue;
        };
        let Ok(reply) = conn.call(&[b"CLUSTER", b"SLOTS"]) else {
            continue;
        };
        if let Ok(map) = parse_slots(&reply, host_of(addr), nodes) {
            if map.iter().any(|&n| n != NO_NODE) {
                return Some(map);
            }
        }
    }
    None
}

// ---------------------------------------------------------------------------------------------
// The load
// ---------------------------------------------------------------------------------------------

/// One acknowledged write: when (since the load started), to which slot, by which node.
#[derive(Debug, Clone, Copy)]
struct Ack {
    at_ns: u64,
    slot: u16,
    node: u16,
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
        for _ in 0..=MAX_REDIRECTS {
            match self.request(node, asking) {
                Ok(Reply::Status(s)) if s == "OK" => {
                    self.acked(k, node);
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

    fn acked(&mut self, k: usize, node: u16) {
        let at_ns = self.shared.started.elapsed().as_nanos() as u64;
        let slot = self.slots[k];
        self.acks.push(Ack { at_ns, slot, node });
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

/// The read-back check of [`LoadResult::verify`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Verify {
    /// Keys read back.
    pub checked: u64,
    /// Keys that lost an acknowledged write: the stored sequence number is below the highest
    /// acknowledged one, or the key is absent although a write to it was acknowledged.
    pub lost: u64,
    /// Of `lost`, the keys absent.
    pub missing: u64,
    /// Acknowledged writes lost: the sum over lost keys of highest acknowledged minus stored
    /// sequence number (a key's writes are acknowledged in sequence, each before the next is sent).
    pub lost_writes: u64,
    /// Keys holding a write never acknowledged (its reply was lost): not a loss.
    pub ahead: u64,
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

/// Reads `keys` through a cluster (`seeds`: `host:port`): routes by the slot map, follows `-ASK`,
/// and reads again after a map refresh whatever failed (`-MOVED`, `-TRYAGAIN`, a connection), for
/// at most [`VERIFY_DEADLINE`]. One value per key, in order (None: absent).
fn read_keys(seeds: &[String], keys: &[Vec<u8>]) -> anyhow::Result<Vec<Option<Vec<u8>>>> {
    let deadline = Instant::now() + VERIFY_DEADLINE;
    let nodes = Nodes::default();
    let mut values: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
    let mut pending: Vec<usize> = (0..keys.len()).collect();
    let mut last_error = String::new();
    while !pending.is_empty() {
        if Instant::now() > deadline {
            bail!(
                "{} of {} keys could not be read back within {:?} (last error: {last_error})",
                pending.len(),
                keys.len(),
                VERIFY_DEADLINE
            );
        }
        let Some(map) = fetch_map(seeds.iter().map(String::as_str), &nodes, None) else {
            last_error = "no seed answered CLUSTER SLOTS".into();
            std::thread::sleep(RETRY_PAUSE);
            continue;
        };
        let mut by_node: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
        for k in pending.drain(..) {
            by_node
                .entry(map[key_slot(&keys[k]) as usize])
                .or_default()
                .push(k);
        }
        let mut retry = Vec::new();
        for (node, ks) in by_node {
            let Some(addr) = (node != NO_NODE).then(|| nodes.name(node)).flatten() else {
                last_error = "slot not served".into();
                retry.extend(ks);
                continue;
            };
            for batch in ks.chunks(BATCH) {
                let names: Vec<&[u8]> = batch.iter().map(|&k| keys[k].as_slice()).collect();
                let replies = match get_batch(&addr, &names) {
                    Ok(r) => r,
                    Err(e) => {
                        last_error = format!("{addr}: {e}");
                        retry.extend_from_slice(batch);
                        continue;
                    }
                };
                for (&k, reply) in batch.iter().zip(replies) {
                    let reply = match reply {
                        Reply::Error(e) if e.starts_with("ASK ") => {
                            let target = e.split_whitespace().nth(2).unwrap_or("");
                            let target = match target.rsplit_once(':') {
                                Some((host, port)) => node_addr(host, port, host_of(&addr)),
                                None => target.to_string(),
                            };
                            ask_get(&target, &keys[k]).unwrap_or(Reply::Error(e))
                        }
                        r => r,
                    };
                    match reply {
                        Reply::Bulk(value) => values[k] = value,
                        other => {
                            last_error = format!("GET via {addr}: {other:?}");
                            retry.push(k);
                        }
                    }
                }
            }
        }
        pending = retry;
        if !pending.is_empty() {
            std::thread::sleep(RETRY_PAUSE);
        }
    }
    Ok(values)
}

impl Verify {
    /// Counts one key read back: `stored` against its highest acknowledged sequence number.
    fn check(&mut self, key: &[u8], acked: u64, stored: Option<Vec<u8>>) -> anyhow::Result<()> {
        self.checked += 1;
        let Some(value) = stored else {
            if acked > 0 {
                self.lost += 1;
                self.missing += 1;
                self.lost_writes += acked;
            }
            return Ok(());
        };
        let seq: u64 = value
            .split(|&b| b == b':')
            .next()
            .and_then(|s| std::str::from_utf8(s).ok())
            .and_then(|s| s.parse().ok())
            .with_context(|| {
                format!(
                    "key {}: value {:?} does not start with a sequence number",
                    String::from_utf8_lossy(key),
                    String::from_utf8_lossy(&value[..value.len().min(40)])
                )
            })?;
        if seq < acked {
            self.lost += 1;
            self.lost_writes += acked - seq;
        } else if seq > acked {
            self.ahead += 1;
        }
        Ok(())
    }
}

/// Pipelined GETs of `keys` on `addr`, one reply each.
fn get_batch(addr: &str, keys: &[&[u8]]) -> io::Result<Vec<Reply>> {
    let mut conn = Conn::open(addr)?;
    let mut out = Vec::new();
    for key in keys {
        encode(&mut out, &[b"GET", key]);
    }
    conn.send(&out)?;
    keys.iter().map(|_| conn.recv()).collect()
}

/// `ASKING` then `GET key` on `addr`.
fn ask_get(addr: &str, key: &[u8]) -> io::Result<Reply> {
    let mut conn = Conn::open(addr)?;
    let mut out = Vec::new();
    encode(&mut out, &[b"ASKING"]);
    encode(&mut out, &[b"GET", key]);
    conn.send(&out)?;
    conn.recv()?;
    conn.recv()
}

// ---------------------------------------------------------------------------------------------
// Redis Cluster failover
// ---------------------------------------------------------------------------------------------

/// What [`redis_failover`] measured.
#[derive(Debug, Clone)]
pub struct RedisFailover {
    /// From the kill -9 of the master until the first write to one of its slots acknowledged by
    /// another node (its promoted replica).
    pub failover: Duration,
    /// The longest interval without an acknowledged write to the dead master's slots, from 1 s
    /// before the kill until the load stopped.
    pub longest_gap: Duration,
    /// The same for the other masters' slots (Redis stops them too while the cluster is down).
    pub others_gap: Duration,
    /// Writes acknowledged over the whole load.
    pub acked: u64,
    /// Keys that lost an acknowledged write ([`Verify::lost`]).
    pub lost: u64,
    /// Acknowledged writes lost ([`Verify::lost_writes`]).
    pub lost_writes: u64,
    /// Keys read back.
    pub checked: u64,
    /// Keys holding a write whose acknowledgement the client never saw ([`Verify::ahead`]).
    pub ahead: u64,
    /// What the client saw fail, by kind ([`LoadResult::errors`]).
    pub errors: BTreeMap<String, u64>,
}

/// One redis-server; killed (SIGKILL, through its child handle) and reaped when dropped.
struct RedisNode {
    port: u16,
    child: Child,
}

impl RedisNode {
    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for RedisNode {
    fn drop(&mut self) {
        // std does not signal a child it has already reaped.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `ready` every 50 ms until it says yes, for at most `limit`; an error from `ready` counts
/// as "not yet" and is reported if time runs out.
fn wait_until(
    what: &str,
    limit: Duration,
    mut ready: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let last = match ready() {
            Ok(true) => return Ok(()),
            Ok(false) => String::new(),
            Err(e) => format!(" ({e:#})"),
        };
        if Instant::now() > deadline {
            bail!("{what} within {limit:?}{last}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A free port whose cluster bus port (+10000) is free too, distinct from `taken`.
fn cluster_port(taken: &mut HashSet<u16>) -> anyhow::Result<u16> {
    for _ in 0..1000 {
        let port = free_port()?;
        if port > u16::MAX - 10_000 || taken.contains(&port) || taken.contains(&(port + 10_000)) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_err() {
            continue;
        }
        taken.insert(port);
        taken.insert(port + 10_000);
        return Ok(port);
    }
    bail!("no free port pair for a Redis Cluster node")
}

/// A Redis Cluster of [`MASTERS`] masters, each with one replica (another process), no
/// persistence, `cluster-node-timeout` = `node_timeout_ms`; returns once every node says
/// `cluster_state:ok`, knows every other and every replica has synced.
fn redis_cluster(work: &Path, node_timeout_ms: u64) -> anyhow::Result<Vec<RedisNode>> {
    let mut taken = HashSet::new();
    let mut nodes = Vec::new();
    for _ in 0..MASTERS * 2 {
        let port = cluster_port(&mut taken)?;
        let dir = work.join(format!("redis-{port}"));
        std::fs::create_dir_all(&dir)?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--cluster-enabled", "yes"])
            .args(["--cluster-node-timeout", &node_timeout_ms.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--cluster-config-file")
            .arg(dir.join("nodes.conf"))
            .arg("--dir")
            .arg(&dir)
            .arg("--logfile")
            .arg(dir.join("redis.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server")?;
        nodes.push(RedisNode { port, child });
    }
    for node in &nodes {
        let addr = node.addr();
        wait_until(
            &format!("redis-server on {addr} did not answer PING"),
            Duration::from_secs(20),
            || Ok(call(&addr, &["PING"])? == Reply::Status("PONG".into())),
        )?;
    }

    // redis-cli makes the first MASTERS nodes masters and gives each one of the others.
    let out_path = work.join("cluster-create.txt");
    let mut create = Command::new("redis-cli")
        .arg("--cluster")
        .arg("create")
        .args(nodes.iter().map(RedisNode::addr))
        .args(["--cluster-replicas", "1", "--cluster-yes"])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(Stdio::null())
        .spawn()
        .context("running redis-cli --cluster create")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = create.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = create.kill();
            let _ = create.wait();
            bail!("redis-cli --cluster create did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if !status.success() {
        bail!(
            "redis-cli --cluster create failed: {}",
            std::fs::read_to_string(&out_path).unwrap_or_default()
        );
    }

    let total = nodes.len();
    for node in &nodes {
        let addr = node.addr();
        wait_until(
            &format!("Redis node {addr} did not see a whole cluster"),
            Duration::from_secs(30),
            || {
                let info = text(&addr, &["CLUSTER", "INFO"])?;
                Ok(info.contains("cluster_state:ok")
                    && info.contains(&format!("cluster_known_nodes:{total}")))
            },
        )?;
    }
    for node in &nodes {
        let addr = node.addr();
        wait_until(
            &format!("Redis replica {addr} did not sync"),
            Duration::from_secs(60),
            || {
                let info = text(&addr, &["INFO", "replication"])?;
                Ok(info.contains("role:master")
                    || info.contains("master_link_status:up")
                        && info.contains("master_sync_in_progress:0"))
            },
        )?;
    }
    Ok(nodes)
}

/// Writes `keys` keys `p:<i>` of `value_size` bytes, pipelined per master, and waits until each
/// master's replica has acknowledged them (`WAIT`), for at most [`PRELOAD_LIMIT`] in all; shows
/// its progress on stderr.
fn preload(map: &[u16], nodes: &Nodes, keys: usize, value_size: usize) -> anyhow::Result<()> {
    let started = Instant::now();
    let deadline = started + PRELOAD_LIMIT;
    let value = vec![b'p'; value_size];
    let mut by_node: BTreeMap<u16, Vec<Vec<u8>>> = BTreeMap::new();
    for i in 0..keys {
        let key = format!("p:{i}").into_bytes();
        by_node
            .entry(map[key_slot(&key) as usize])
            .or_default()
            .push(key);
    }
    let mut progress = Progress::new("Redis preload");
    let mut done = 0usize;
    for (node, node_keys) in by_node {
        let addr = nodes
            .name(node)
            .filter(|_| node != NO_NODE)
            .context("a slot has no master")?;
        let mut conn = Conn::open(&addr).with_context(|| format!("connecting to {addr}"))?;
        let mut out = Vec::new();
        for batch in node_keys.chunks(BATCH) {
            out.clear();
            for key in batch {
                encode(&mut out, &[b"SET", key, &value]);
            }
            conn.send(&out)
                .with_context(|| format!("preloading {addr}"))?;
            for _ in batch {
                match conn.recv().with_context(|| format!("preloading {addr}"))? {
                    Reply::Status(s) if s == "OK" => {}
                    other => bail!("SET while preloading {addr}: {other:?}"),
                }
            }
            done += batch.len();
            progress.show(|| {
                format!(
                    "{:.0}% ({done} of {keys} keys, {:.0} keys/s)",
                    done as f64 * 100.0 / keys as f64,
                    done as f64 / started.elapsed().as_secs_f64()
                )
            });
            if Instant::now() > deadline {
                bail!("preloading {keys} keys took over {PRELOAD_LIMIT:?}");
            }
        }
        // WAIT blocks at most 500 ms, below the socket timeout.
        loop {
            match conn.call(&[b"WAIT", b"1", b"500"])? {
                Reply::Int(n) if n >= 1 => break,
                Reply::Int(_) => {}
                other => bail!("WAIT on {addr}: {other:?}"),
            }
            if Instant::now() > deadline {
                bail!("the replica of {addr} did not acknowledge the preload");
            }
        }
    }
    progress.done(&format!(
        "{keys} keys in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// Starts a Redis Cluster of 4 masters + 4 replicas in `work` (`cluster-node-timeout` =
/// `node_timeout_ms`, no persistence), preloads `preload_keys` keys of `value_size` bytes, runs
/// a [`Load`] of 4 threads over `keys` keys with `value_size`-byte values, kills -9 the master
/// serving slot 0 after 2 s, keeps the load on until that master's slots have taken writes again
/// for 2 s, then reads every key back. Every process started is stopped on return.
pub fn redis_failover(
    work: &Path,
    node_timeout_ms: u64,
    value_size: usize,
    keys: usize,
    preload_keys: usize,
) -> anyhow::Result<RedisFailover> {
    let mut nodes = redis_cluster(work, node_timeout_ms)?;
    let seeds: Vec<String> = nodes.iter().map(RedisNode::addr).collect();
    let names = Nodes::default();
    let map = fetch_map(seeds.iter().map(String::as_str), &names, None)
        .context("no Redis node answered CLUSTER SLOTS")?;
    let victim_id = map[0];
    let victim_addr = names.name(victim_id).context("slot 0 has no master")?;
    let victim = nodes
        .iter()
        .position(|n| n.addr() == victim_addr)
        .with_context(|| format!("slot 0 is served by {victim_addr}, not one of ours"))?;
    // The slots the victim serves, fixed now: after the failover they belong to its replica.
    let victim_slots: Vec<bool> = map.iter().map(|&n| n == victim_id).collect();
    let in_victim = |s: u16| victim_slots[s as usize];
    if preload_keys > 0 {
        preload(&map, &names, preload_keys, value_size)?;
    }

    let load = Load::start(&seeds, THREADS, keys.div_ceil(THREADS).max(1), value_size)?;
    std::thread::sleep(Duration::from_secs(2));
    if load.last_ack(in_victim, None).is_none() {
        let result = load.stop();
        bail!(
            "no write to the slots of {victim_addr} was acknowledged before the kill ({} acked, errors {:?})",
            result.acked,
            result.errors
        );
    }
    let killed_at = Instant::now();
    nodes[victim]
        .child
        .kill()
        .context("killing the Redis master")?;
    nodes[victim]
        .child
        .wait()
        .context("reaping the Redis master")?;

    // Until the victim's slots take writes from another node, then 2 s more.
    let limit =
        Duration::from_secs(30).max(Duration::from_millis(node_timeout_ms.saturating_mul(20)));
    let deadline = killed_at + limit;
    let (result, back, from, verify) =
        settle_after_kill(load, in_victim, &victim_addr, killed_at, deadline, &seeds)?;
    Ok(RedisFailover {
        failover: back - killed_at,
        longest_gap: result.longest_gap(in_victim, from, result.stopped),
        others_gap: result.longest_gap(|s| !in_victim(s), from, result.stopped),
        acked: result.acked,
        lost: verify.lost,
        lost_writes: verify.lost_writes,
        checked: verify.checked,
        ahead: verify.ahead,
        errors: result.errors,
    })
}

/// After a kill: waits (until `deadline`) for the victim's slots to take a write acknowledged
/// by another server, lets the load run 2 s more, stops it, and reads every key back through the
/// survivors. Returns the load's result, the first write back, where the gap windows start (1 s
/// before the kill) and the verification.
fn settle_after_kill(
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

/// Runs [`redis_failover`] once (node timeout 500 ms, 100 B values, 10 000 keys under load;
/// 100 000 keys preloaded with `quick`, 1 000 000 without) and prints what it measured.
pub fn redis_only(quick: bool) -> anyhow::Result<()> {
    for tool in ["redis-server", "redis-cli"] {
        if which(tool).is_none() {
            bail!("{tool} not found in PATH (install the redis-server and redis-tools packages; scripts/test does)");
        }
    }
    const NODE_TIMEOUT_MS: u64 = 500;
    const VALUE: usize = 100;
    const KEYS: usize = 10_000;
    let preload = if quick { 100_000 } else { 1_000_000 };
    let work = std::env::temp_dir().join(format!("ramlog-bench-recovery-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = redis_failover(&work, NODE_TIMEOUT_MS, VALUE, KEYS, preload);
    let _ = std::fs::remove_dir_all(&work);
    let r = result?;
    println!(
        "Redis Cluster 4+4, cluster-node-timeout {NODE_TIMEOUT_MS} ms, {VALUE} B values, \
         {KEYS} keys under load, {preload} preloaded; master of slot 0 killed -9:"
    );
    println!(
        "  failover {:.0} ms; longest gap on its slots {:.0} ms, on the other slots {:.0} ms",
        r.failover.as_secs_f64() * 1e3,
        r.longest_gap.as_secs_f64() * 1e3,
        r.others_gap.as_secs_f64() * 1e3
    );
    println!(
        "  {} writes acknowledged; {} of {} keys lost an acknowledged write ({} writes); \
         {} keys hold a write never acknowledged",
        r.acked, r.lost, r.checked, r.lost_writes, r.ahead
    );
    println!("  client errors: {:?}", r.errors);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Progress on stderr
// ---------------------------------------------------------------------------------------------

/// A one-line progress display on stderr: redrawn in place at most every 250 ms on a terminal,
/// one line every 5 s otherwise.
struct Progress {
    label: String,
    last: Option<Instant>,
    terminal: bool,
}

impl Progress {
    fn new(label: &str) -> Progress {
        use std::io::IsTerminal;
        Progress {
            label: label.to_string(),
            last: None,
            terminal: io::stderr().is_terminal(),
        }
    }

    fn show(&mut self, text: impl FnOnce() -> String) {
        let every = if self.terminal {
            Duration::from_millis(250)
        } else {
            Duration::from_secs(5)
        };
        if self.last.is_some_and(|t| t.elapsed() < every) {
            return;
        }
        self.last = Some(Instant::now());
        if self.terminal {
            eprint!("\r  {}: {:<76}", self.label, text());
        } else {
            eprintln!("  {}: {}", self.label, text());
        }
        let _ = io::stderr().flush();
    }

    fn done(&mut self, text: &str) {
        if self.terminal {
            eprintln!("\r  {}: {:<76}", self.label, text);
        } else {
            eprintln!("  {}: {}", self.label, text);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// ramlog processes and the cluster status
// ---------------------------------------------------------------------------------------------

/// Keys the load writes, over all its threads (ramlog and Redis alike).
const LOAD_KEYS: usize = 10_000;
/// Every wait on a cluster (start, detection, recovery, re-protection) gives up after this.
const WAIT_LIMIT: Duration = Duration::from_secs(120);
/// Recovering tablets with no live backup for this long end a run (nothing will restore them).
const STUCK_LIMIT: Duration = Duration::from_secs(5);
/// How often the status poller asks the coordinator.
const POLL_EVERY: Duration = Duration::from_millis(15);
/// SETs per pipelined write of the ramlog preload, such writes in flight at once per connection,
/// and connections.
const PRELOAD_BATCH: usize = 1000;
const PRELOAD_WINDOW: usize = 4;
const PRELOAD_CONNS: usize = 4;
/// Either preload gives up after this long.
const PRELOAD_LIMIT: Duration = Duration::from_secs(900);
/// Socket timeout of the ramlog preload's connection (a pipelined batch of 1000 SETs waits for
/// its backups).
const PRELOAD_IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Preloaded keys read back after a recovery.
const SAMPLE_KEYS: usize = 10_000;
/// Longest a `ramlog` tool command (`cluster status`, `table set-mode`) may take.
const TOOL_LIMIT: Duration = Duration::from_secs(20);
/// Longest a ramlog process may take to print its `ready` line.
const START_LIMIT: Duration = Duration::from_secs(30);
/// Backups per tablet of the default table.
const REPLICAS: u32 = 2;
/// Redis Cluster's `cluster-node-timeout` against ramlog's default detection (its coordinator's
/// `--dead-after-ms`, 400 ms).
const REDIS_NODE_TIMEOUT_MS: u64 = 400;

/// A child process, killed -9 and reaped when dropped (std signals nothing once it is reaped).
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The last lines of a log file, for error messages.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

/// Starts `ramlog <args>` (stderr to `log`) and waits, at most [`START_LIMIT`], for its first
/// stdout line, which must say `ready`; the rest of its stdout is drained.
fn spawn_ramlog(args: &[String], log: &Path) -> anyhow::Result<Proc> {
    let exe = std::env::current_exe().context("locating the ramlog binary")?;
    let name = args.first().cloned().unwrap_or_default();
    let mut proc = Proc(
        Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?)
            .spawn()
            .with_context(|| format!("starting ramlog {name}"))?,
    );
    let out = proc.0.stdout.take().context("no stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(out);
        let mut line = String::new();
        let _ = reader.read_line(&mut line);
        let _ = tx.send(line);
        let _ = io::copy(&mut reader, &mut io::sink());
    });
    match rx.recv_timeout(START_LIMIT) {
        Ok(line) if line.contains("ready") => Ok(proc),
        Ok(line) => bail!("ramlog {name} did not start: {line:?} ({})", log_tail(log)),
        Err(_) => bail!(
            "ramlog {name} printed no ready line within {START_LIMIT:?} ({})",
            log_tail(log)
        ),
    }
}

/// Runs `ramlog <args>` to its end, for at most `limit`; its stdout.
fn run_tool(args: &[&str], limit: Duration) -> anyhow::Result<String> {
    let exe = std::env::current_exe().context("locating the ramlog binary")?;
    let mut proc = Proc(
        Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running ramlog {}", args.join(" ")))?,
    );
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut text = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut text);
            }
            let _ = tx.send(String::from_utf8_lossy(&text).into_owned());
        });
        rx
    };
    let out = drain(
        proc.0
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        proc.0
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + limit;
    let stdout = out
        .recv_timeout(limit)
        .with_context(|| format!("ramlog {} took over {limit:?}", args.join(" ")))?;
    let stderr = err
        .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .unwrap_or_default();
    let status = proc.0.wait()?;
    if !status.success() {
        bail!("ramlog {}: {status}: {}", args.join(" "), stderr.trim());
    }
    Ok(stdout)
}

/// One tablet of the default table, from `ramlog cluster status --json`.
#[derive(Debug, Clone)]
struct TabletState {
    first_slot: u16,
    last_slot: u16,
    master: u64,
    backups: Vec<u64>,
}

/// What the suite reads from `ramlog cluster status --json`.
#[derive(Debug, Clone)]
struct ClusterStatus {
    map_version: u64,
    recovering: u64,
    pending: u64,
    /// Recovering tablets (of every table) without a restorer: none of their backups is up.
    stuck: u64,
    /// (id, up, RESP address)
    servers: Vec<(u64, bool, String)>,
    /// Mode of the default table.
    mode: String,
    tablets: Vec<TabletState>,
}

fn parse_status(v: &serde_json::Value) -> anyhow::Result<ClusterStatus> {
    let u = |v: &serde_json::Value, what: &str| v.as_u64().with_context(|| format!("no {what}"));
    let servers = v["servers"]
        .as_array()
        .context("no servers")?
        .iter()
        .map(|s| {
            Ok((
                u(&s["id"], "server id")?,
                s["state"].as_str() == Some("up"),
                s["addresses"]["resp"].as_str().unwrap_or("").to_string(),
            ))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let table = v["tables"]
        .as_array()
        .context("no tables")?
        .iter()
        .find(|t| t["name"].as_str() == Some("default"));
    let (mode, tablets) = match table {
        Some(t) => (
            t["mode"].as_str().unwrap_or("").to_string(),
            t["tablets"]
                .as_array()
                .context("no tablets")?
                .iter()
                .map(|tb| {
                    Ok(TabletState {
                        first_slot: u(&tb["first_slot"], "first_slot")? as u16,
                        last_slot: u(&tb["last_slot"], "last_slot")? as u16,
                        master: u(&tb["master"], "master")?,
                        backups: tb["backups"]
                            .as_array()
                            .map(|b| b.iter().filter_map(|x| x.as_u64()).collect())
                            .unwrap_or_default(),
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?,
        ),
        None => (String::new(), Vec::new()),
    };
    let mut stuck = 0;
    for t in v["tables"].as_array().into_iter().flatten() {
        for tb in t["tablets"].as_array().into_iter().flatten() {
            if tb["recovering"].as_bool() == Some(true) && tb["restorer"].is_null() {
                stuck += 1;
            }
        }
    }
    Ok(ClusterStatus {
        stuck,
        map_version: u(&v["map_version"], "map_version")?,
        recovering: u(&v["recovering_tablets"], "recovering_tablets")?,
        pending: u(&v["pending_copies"], "pending_copies")?,
        servers,
        mode,
        tablets,
    })
}

/// `ramlog cluster status --json` through `coordinator`.
fn cluster_status(coordinator: &str) -> anyhow::Result<ClusterStatus> {
    let out = run_tool(
        &["cluster", "status", "--json", "--coordinator", coordinator],
        TOOL_LIMIT,
    )?;
    let value: serde_json::Value =
        serde_json::from_str(&out).context("parsing ramlog cluster status --json")?;
    parse_status(&value)
}

/// `cluster_current_epoch` (the map version a server serves) from CLUSTER INFO on `addr`.
fn map_epoch(addr: &str) -> anyhow::Result<u64> {
    text(addr, &["CLUSTER", "INFO"])?
        .lines()
        .find_map(|l| l.strip_prefix("cluster_current_epoch:"))
        .and_then(|v| v.trim().parse().ok())
        .context("no cluster_current_epoch in CLUSTER INFO")
}

/// One server of a [`RamlogCluster`].
struct RamlogServer {
    proc: Proc,
    resp: String,
    routing: String,
}

/// A coordinator and its servers, each a child process; all killed -9 when dropped (the servers
/// first: fields drop in order).
struct RamlogCluster {
    servers: Vec<RamlogServer>,
    _coordinator: Proc,
    coordinator: String,
}

impl RamlogCluster {
    /// Starts a coordinator (`--initial-servers servers --default-replicas 2`, default detection)
    /// and `servers` servers of `memory_mib` MiB each under `dir` (the default table `sync`).
    /// Returns once every server serves the whole map and no tablet recovers or waits for a copy.
    fn start(dir: &Path, servers: usize, memory_mib: u64) -> anyhow::Result<RamlogCluster> {
        std::fs::create_dir_all(dir)?;
        let coord_port = free_port()?;
        let coordinator = format!("127.0.0.1:{coord_port}");
        let args: Vec<String> = [
            "coordinator",
            "--id",
            "1",
            "--listen",
            &coordinator,
            "--members",
            &format!("1={coordinator}"),
            "--data-dir",
            &dir.join("coordinator").display().to_string(),
            "--initial-servers",
            &servers.to_string(),
            "--default-replicas",
            &REPLICAS.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let coordinator_proc = spawn_ramlog(&args, &dir.join("coordinator.log"))?;
        let mut list = Vec::new();
        for i in 0..servers {
            let (resp, routing, native) = (free_port()?, free_port()?, free_port()?);
            let args: Vec<String> = [
                "server",
                "--coordinator",
                &coordinator,
                "--resp-port",
                &resp.to_string(),
                "--routing-port",
                &routing.to_string(),
                "--native-port",
                &native.to_string(),
                "--admin-port",
                "0",
                "--data-dir",
                &dir.join(format!("server-{i}")).display().to_string(),
                "--memory",
                &format!("{memory_mib}MiB"),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let proc = spawn_ramlog(&args, &dir.join(format!("server-{i}.log")))?;
            list.push(RamlogServer {
                proc,
                resp: format!("127.0.0.1:{resp}"),
                routing: format!("127.0.0.1:{routing}"),
            });
        }
        let cluster = RamlogCluster {
            servers: list,
            _coordinator: coordinator_proc,
            coordinator,
        };
        for s in &cluster.servers {
            wait_until(
                &format!("ramlog server {} did not say cluster_state:ok", s.resp),
                Duration::from_secs(30),
                || Ok(text(&s.resp, &["CLUSTER", "INFO"])?.contains("cluster_state:ok")),
            )?;
        }
        cluster.wait_settled(servers)?;
        Ok(cluster)
    }

    /// Switches the default table to `mode` (if it is not in it already) and waits until every
    /// server serves the map that says so.
    fn set_mode(&self, mode: &str) -> anyhow::Result<()> {
        if self.status()?.mode == mode {
            return Ok(());
        }
        run_tool(
            &[
                "table",
                "set-mode",
                "default",
                mode,
                "--coordinator",
                &self.coordinator,
            ],
            TOOL_LIMIT,
        )?;
        wait_until(
            &format!("the servers did not apply the map that sets mode {mode}"),
            Duration::from_secs(30),
            || {
                let st = self.status()?;
                if st.mode != mode {
                    return Ok(false);
                }
                for s in &self.servers {
                    if map_epoch(&s.resp)? < st.map_version {
                        return Ok(false);
                    }
                }
                Ok(true)
            },
        )
    }

    fn status(&self) -> anyhow::Result<ClusterStatus> {
        cluster_status(&self.coordinator)
    }

    /// Until `servers` servers are up, the default table is placed, and no tablet recovers or
    /// waits for a copy.
    fn wait_settled(&self, servers: usize) -> anyhow::Result<()> {
        wait_until(
            "the ramlog cluster did not settle",
            Duration::from_secs(30),
            || {
                let st = self.status()?;
                Ok(st.servers.iter().filter(|s| s.1).count() == servers
                    && !st.tablets.is_empty()
                    && st.recovering == 0
                    && st.pending == 0)
            },
        )
    }
}

// ---------------------------------------------------------------------------------------------
// The status poller
// ---------------------------------------------------------------------------------------------

/// A connection to the coordinator speaking its own protocol (crates/cluster/src/rpc.rs: a
/// 4-byte big-endian length and that much JSON each way; the request `"Status"`, the answer
/// `{"Status": {.., "map": ClusterMap}}`). `ramlog cluster status` sends the same request but
/// costs a process (about 4 ms of CPU); polled every 15 ms on a 2-core machine that would take a
/// fifth of a core from the servers under test. The poller falls back to the command when this
/// does not parse.
struct StatusConn(TcpStream);

impl StatusConn {
    fn open(addr: &str) -> anyhow::Result<StatusConn> {
        let sock = addr
            .to_socket_addrs()?
            .next()
            .with_context(|| format!("no address for {addr}"))?;
        let s = TcpStream::connect_timeout(&sock, IO_TIMEOUT)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(IO_TIMEOUT))?;
        s.set_write_timeout(Some(IO_TIMEOUT))?;
        Ok(StatusConn(s))
    }

    /// (victim dead, tablets recovering, copies pending, recovering tablets without a restorer),
    /// counted as `ramlog cluster status --json` counts them.
    fn poll(&mut self, victim: u64) -> anyhow::Result<(bool, u64, u64, u64)> {
        let body = b"\"Status\"";
        let mut frame = (body.len() as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(body);
        self.0.write_all(&frame)?;
        let mut len = [0u8; 4];
        self.0.read_exact(&mut len)?;
        let len = u32::from_be_bytes(len) as usize;
        if len > MAX_BULK {
            bail!("a status frame of {len} bytes");
        }
        let mut buf = vec![0u8; len];
        self.0.read_exact(&mut buf)?;
        let v: serde_json::Value = serde_json::from_slice(&buf)?;
        let map = &v["Status"]["map"];
        let servers = map["servers"].as_array().context("no map.servers")?;
        let tablets = map["tablets"].as_array().context("no map.tablets")?;
        let victim = servers
            .iter()
            .find(|s| s["id"].as_u64() == Some(victim))
            .context("the victim is not in the map")?;
        let state = victim["state"].as_str().context("no server state")?;
        let mut recovering = 0;
        let mut pending = 0;
        let mut stuck = 0;
        for t in tablets {
            if t["recovering"].as_bool().context("no tablet recovering")? {
                recovering += 1;
                if t["restorer"].is_null() {
                    stuck += 1;
                }
            }
            pending += t["pending"].as_array().context("no tablet pending")?.len() as u64;
        }
        Ok((state == "dead", recovering, pending, stuck))
    }
}

/// One answer of the coordinator, as the poller saw it.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// When the status command was started, and when its answer was in.
    asked: Instant,
    answered: Instant,
    victim_dead: bool,
    recovering: u64,
    pending: u64,
    /// Recovering tablets that no live backup can restore.
    stuck: u64,
}

/// A thread that asks the coordinator for its status every [`POLL_EVERY`] and keeps every
/// answer; stopped when dropped.
struct Poller {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    failures: Arc<AtomicU64>,
    /// Whether it polls over the coordinator's protocol (else through the CLI).
    direct: bool,
    handle: Option<JoinHandle<()>>,
}

impl Poller {
    /// Polls `coordinator` about `victim`: over the coordinator's own protocol
    /// ([`StatusConn`]) if it answers that way now, else with `ramlog cluster status --json`.
    fn start(coordinator: String, victim: u64) -> Poller {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let failures = Arc::new(AtomicU64::new(0));
        let (s, v, f) = (stop.clone(), samples.clone(), failures.clone());
        let mut direct = StatusConn::open(&coordinator).ok();
        if let Some(d) = direct.as_mut() {
            if d.poll(victim).is_err() {
                direct = None;
            }
        }
        let direct_ok = direct.is_some();
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let asked = Instant::now();
                let answer = match direct.as_mut() {
                    Some(d) => d.poll(victim).or_else(|_| {
                        // One reconnection per failure; the next poll tries again.
                        *d = StatusConn::open(&coordinator)?;
                        d.poll(victim)
                    }),
                    None => cluster_status(&coordinator).map(|st| {
                        (
                            st.servers.iter().any(|x| x.0 == victim && !x.1),
                            st.recovering,
                            st.pending,
                            st.stuck,
                        )
                    }),
                };
                match answer {
                    Ok((victim_dead, recovering, pending, stuck)) => {
                        let sample = Sample {
                            asked,
                            answered: Instant::now(),
                            victim_dead,
                            recovering,
                            pending,
                            stuck,
                        };
                        v.lock().unwrap_or_else(|e| e.into_inner()).push(sample);
                    }
                    Err(_) => {
                        f.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let next = asked + POLL_EVERY;
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                }
            }
        });
        Poller {
            stop,
            samples,
            failures,
            direct: direct_ok,
            handle: Some(handle),
        }
    }

    /// The first sample that satisfies `pred`.
    fn first(&self, pred: impl Fn(&Sample) -> bool) -> Option<Sample> {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples.iter().find(|s| pred(s)).copied()
    }

    /// When the current run of samples showing stuck tablets began (None if the last shows
    /// none).
    fn stuck_since(&self) -> Option<Instant> {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let run = samples.iter().rev().take_while(|s| s.stuck > 0).last()?;
        Some(run.answered)
    }

    fn last(&self) -> Option<Sample> {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples.last().copied()
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The ramlog failover
// ---------------------------------------------------------------------------------------------

/// The value of preloaded key `p:<i>`: `"<i>:"` padded with `v` to `value_size` bytes.
fn preload_value(i: u64, value_size: usize) -> Vec<u8> {
    let mut v = format!("{i}:").into_bytes();
    if v.len() < value_size {
        v.resize(value_size, b'v');
    }
    v
}

/// What [`preload_victim`] wrote.
struct Preloaded {
    /// Keys written: the first `keys` of the `p:<i>` whose slot is selected, `i < scanned`.
    keys: u64,
    scanned: u64,
    time: Duration,
}

/// Writes `keys` keys `p:<i>` of `value_size` bytes, the first `keys` values of `i` whose slot is
/// selected, to `addr` over [`PRELOAD_CONNS`] connections (the `k`-th such key goes to connection
/// `k % PRELOAD_CONNS`): batches of [`PRELOAD_BATCH`] pipelined SETs, up to [`PRELOAD_WINDOW`]
/// batches in flight per connection. Every reply must be `+OK`. Shows its progress on stderr.
fn preload_victim(
    addr: &str,
    slots: &[bool],
    keys: u64,
    value_size: usize,
    label: &str,
) -> anyhow::Result<Preloaded> {
    let started = Instant::now();
    let acked = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let mut progress = Progress::new(&format!("{label} preload"));
    let results: Vec<anyhow::Result<u64>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..PRELOAD_CONNS)
            .map(|part| {
                let (acked, failed) = (&acked, &failed);
                scope.spawn(move || {
                    let r = preload_part(addr, slots, keys, value_size, part, acked, failed);
                    if r.is_err() {
                        failed.store(true, Ordering::Relaxed);
                    }
                    r
                })
            })
            .collect();
        while !handles.iter().all(|h| h.is_finished()) {
            progress.show(|| {
                let done = acked.load(Ordering::Relaxed);
                format!(
                    "{:.0}% ({done} of {keys} keys, {:.0} keys/s)",
                    done as f64 * 100.0 / keys as f64,
                    done as f64 / started.elapsed().as_secs_f64()
                )
            });
            std::thread::sleep(Duration::from_millis(20));
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a preload thread panicked")))
            })
            .collect()
    });
    let mut scanned = 0;
    for r in results {
        scanned = scanned.max(r?);
    }
    let time = started.elapsed();
    let done = acked.load(Ordering::Relaxed);
    progress.done(&format!(
        "{done} keys of {value_size} B in {:.1} s ({:.0} keys/s)",
        time.as_secs_f64(),
        done as f64 / time.as_secs_f64()
    ));
    Ok(Preloaded {
        keys: done,
        scanned,
        time,
    })
}

/// One connection's share of [`preload_victim`]; returns how far it scanned `i`.
fn preload_part(
    addr: &str,
    slots: &[bool],
    keys: u64,
    value_size: usize,
    part: usize,
    acked: &AtomicU64,
    failed: &AtomicBool,
) -> anyhow::Result<u64> {
    let deadline = Instant::now() + PRELOAD_LIMIT;
    let mut conn = Conn::open(addr).with_context(|| format!("connecting to {addr}"))?;
    conn.reader
        .get_ref()
        .set_read_timeout(Some(PRELOAD_IO_TIMEOUT))?;
    conn.reader
        .get_ref()
        .set_write_timeout(Some(PRELOAD_IO_TIMEOUT))?;
    let mut out = Vec::with_capacity(PRELOAD_BATCH * (value_size + 48));
    let mut in_flight = std::collections::VecDeque::new();
    // `i` scans the key names, `k` counts the selected ones.
    let (mut i, mut k) = (0u64, 0u64);
    let receive = |conn: &mut Conn, n: usize| -> anyhow::Result<()> {
        for _ in 0..n {
            match conn.recv().with_context(|| format!("preloading {addr}"))? {
                Reply::Status(s) if s == "OK" => {
                    acked.fetch_add(1, Ordering::Relaxed);
                }
                other => bail!(
                    "SET while preloading {addr} (after {} keys): {other:?}",
                    acked.load(Ordering::Relaxed)
                ),
            }
        }
        Ok(())
    };
    while k < keys {
        if failed.load(Ordering::Relaxed) {
            bail!("another preload connection failed");
        }
        out.clear();
        let mut batch = 0;
        while batch < PRELOAD_BATCH && k < keys {
            let key = format!("p:{i}").into_bytes();
            if slots[key_slot(&key) as usize] {
                if k % PRELOAD_CONNS as u64 == part as u64 {
                    encode(&mut out, &[b"SET", &key, &preload_value(i, value_size)]);
                    batch += 1;
                }
                k += 1;
            }
            i += 1;
        }
        if batch == 0 {
            break;
        }
        conn.send(&out)
            .with_context(|| format!("preloading {addr}"))?;
        in_flight.push_back(batch);
        while in_flight.len() >= PRELOAD_WINDOW {
            let n = in_flight.pop_front().unwrap_or(0);
            receive(&mut conn, n)?;
        }
        if Instant::now() > deadline {
            bail!("preloading {keys} keys took over {PRELOAD_LIMIT:?}");
        }
    }
    while let Some(n) = in_flight.pop_front() {
        receive(&mut conn, n)?;
    }
    Ok(i)
}

/// What [`ramlog_failover`] measured.
#[derive(Debug, Clone)]
pub struct RamlogFailover {
    /// From the kill -9 until the coordinator's status shows the victim dead (the answer's
    /// arrival: an upper bound, the status is polled every 15 ms and takes a few ms).
    pub detection: Duration,
    /// From that answer until one that shows no tablet recovering.
    pub recovery: Duration,
    /// From that answer until one that shows no copy pending.
    pub reprotection: Duration,
    /// From the kill until the first write to one of the victim's slots acknowledged by another
    /// server (as [`RedisFailover::failover`]).
    pub failover: Duration,
    /// The longest interval without an acknowledged write to the victim's slots, from 1 s before
    /// the kill until the load stopped (2 s after re-protection ended).
    pub longest_gap: Duration,
    /// The longest such interval on the slots of any one of the victim's tablets: tablets come
    /// back one by one, so this is how long the last one was out, where `longest_gap` ends with
    /// the first.
    pub worst_tablet_gap: Duration,
    /// Per tablet of the victim, from the kill until the first write to it acknowledged by its
    /// new master (sorted); and from the kill until the status showed recovery, then
    /// re-protection, over.
    pub tablets_back: Vec<Duration>,
    pub recovered_at: Duration,
    /// Writes acknowledged per second over every slot in the 1.5 s before the kill, and during
    /// re-protection (None when it took under 100 ms).
    pub rate_before: f64,
    pub rate_reprotection: Option<f64>,
    pub protected_at: Duration,
    /// The same for the other servers' slots.
    pub others_gap: Duration,
    pub acked: u64,
    pub lost: u64,
    pub lost_writes: u64,
    pub checked: u64,
    pub ahead: u64,
    pub errors: BTreeMap<String, u64>,
    /// Keys preloaded on the victim, and how long that took.
    pub preloaded: u64,
    pub preload_time: Duration,
    /// Preloaded keys read back after the recovery, absent, and present with another value.
    pub sample_checked: u64,
    pub sample_missing: u64,
    pub sample_wrong: u64,
    /// DBSIZE through a survivor's routing port after the load, and what it should be
    /// (preloaded keys + the load's keys with an acknowledged write; keys whose only write was
    /// never acknowledged, counted in `ahead`, may add to it).
    pub keys_after: Option<u64>,
    pub keys_expected: u64,
    /// The victim's tablets, and the servers that restore them.
    pub tablets: usize,
    pub restorers: usize,
    /// Status polls that failed.
    pub poll_failures: u64,
    /// Servers other than the victim that the coordinator shows dead after the run.
    pub survivors_dead: u64,
    /// Something is off (a survivor dead, a loss, a preloaded key missing, a DBSIZE that is not
    /// what it should be): the run's logs are worth keeping.
    pub anomalous: bool,
}

/// Starts a ramlog cluster of `servers` servers (R = 2, `memory_mib` MiB each) in `work`,
/// preloads `data_bytes` of `value_size`-byte values on the master of slot 0 (the victim; the
/// other masters get none) with the default table `sync`, switches it to `mode`, runs a [`Load`]
/// of 4 threads over
/// 10 000 keys of `value_size` bytes against every server, kills -9 the victim after 2 s and
/// measures detection, recovery and re-protection through the coordinator's status, then what
/// the load saw; reads back the load's keys and 10 000 preloaded ones. Every process started is
/// stopped on return.
pub fn ramlog_failover(
    work: &Path,
    label: &str,
    servers: usize,
    mode: &str,
    value_size: usize,
    data_bytes: u64,
    memory_mib: u64,
) -> anyhow::Result<RamlogFailover> {
    let mut cluster = RamlogCluster::start(work, servers, memory_mib)?;
    let st = cluster.status()?;
    let victim_id = st
        .tablets
        .iter()
        .find(|t| t.first_slot == 0)
        .context("no tablet holds slot 0")?
        .master;
    let victim_addr = st
        .servers
        .iter()
        .find(|s| s.0 == victim_id)
        .map(|s| s.2.clone())
        .context("the master of slot 0 is not listed")?;
    let victim = cluster
        .servers
        .iter()
        .position(|s| s.resp == victim_addr)
        .with_context(|| format!("slot 0 is served by {victim_addr}, not one of ours"))?;
    let mut victim_slots = vec![false; SLOT_COUNT as usize];
    let victim_tablets: Vec<(u16, u16)> = st
        .tablets
        .iter()
        .filter(|t| t.master == victim_id)
        .map(|t| (t.first_slot, t.last_slot))
        .collect();
    let mut restorers = HashSet::new();
    let mut tablets = 0;
    for t in st.tablets.iter().filter(|t| t.master == victim_id) {
        victim_slots[t.first_slot as usize..=t.last_slot as usize].fill(true);
        tablets += 1;
        if let Some(&b) = t.backups.first() {
            restorers.insert(b);
        }
    }
    let in_victim = |s: u16| victim_slots[s as usize];

    let preload_keys = (data_bytes / value_size as u64).max(1);
    let pre = preload_victim(&victim_addr, &victim_slots, preload_keys, value_size, label)?;
    // The preload is written in `sync` (`durable` fsyncs every batch on the backups: minutes for
    // a GiB); the mode under test holds from the load on.
    cluster.set_mode(mode)?;
    if mode == "mirror" {
        // Each tablet's mirror builds its memory from its logs (the preload) before the kill.
        let mirrored = st.tablets.len();
        let built = std::time::Instant::now();
        wait_until(
            "the mirrors did not build their memory",
            Duration::from_secs(600),
            || {
                let mut n = 0;
                for i in 0..servers {
                    let log = std::fs::read_to_string(work.join(format!("server-{i}.log")))
                        .unwrap_or_default();
                    n += log.matches("mirror in memory").count();
                }
                Ok(n >= mirrored)
            },
        )?;
        eprintln!(
            "  {label}: {mirrored} mirrors in memory {:.1} s after the mode change",
            built.elapsed().as_secs_f64()
        );
    }

    let seeds: Vec<String> = cluster.servers.iter().map(|s| s.resp.clone()).collect();
    let load = Load::start(&seeds, THREADS, LOAD_KEYS.div_ceil(THREADS), value_size)?;
    let poller = Poller::start(cluster.coordinator.clone(), victim_id);
    std::thread::sleep(Duration::from_secs(2));
    if load.last_ack(in_victim, None).is_none() {
        let result = load.stop();
        bail!(
            "no write to the slots of {victim_addr} was acknowledged before the kill ({} acked, errors {:?})",
            result.acked,
            result.errors
        );
    }
    let killed_at = Instant::now();
    cluster.servers[victim]
        .proc
        .0
        .kill()
        .context("killing the victim")?;
    cluster.servers[victim]
        .proc
        .0
        .wait()
        .context("reaping the victim")?;

    // Detection, recovery, re-protection, as the coordinator's answers show them.
    let deadline = killed_at + WAIT_LIMIT;
    let mut progress = Progress::new(&format!("{label} failover"));
    let (detected, recovered, protected) = loop {
        let detected = poller.first(|s| s.asked >= killed_at && s.victim_dead);
        let recovered = detected.and_then(|d| {
            poller.first(|s| s.asked >= d.asked && s.victim_dead && s.recovering == 0)
        });
        let protected = recovered.and_then(|r| {
            poller.first(|s| s.asked >= r.asked && s.recovering == 0 && s.pending == 0)
        });
        if let (Some(d), Some(r), Some(p)) = (detected, recovered, protected) {
            break (d, r, p);
        }
        let last = poller.last();
        let describe = || {
            match last {
            Some(s) => format!(
                "{:.1} s after the kill: victim {}, {} tablets recovering, {} copies pending, {} acked",
                killed_at.elapsed().as_secs_f64(),
                if s.victim_dead { "dead" } else { "up" },
                s.recovering,
                s.pending,
                load.acked()
            ),
            None => "no status yet".to_string(),
        }
        };
        // Tablets that no live backup can restore stay so until a server comes back, which
        // nothing here does: 5 s of that ends the wait.
        let stuck_for = poller
            .stuck_since()
            .map(|t| t.elapsed())
            .unwrap_or_default();
        if Instant::now() > deadline || stuck_for > STUCK_LIMIT {
            let mut text = describe();
            if stuck_for > STUCK_LIMIT {
                text = format!(
                    "{text}; {} recovering tablets have had no live backup for {:.1} s",
                    poller.last().map_or(0, |s| s.stuck),
                    stuck_for.as_secs_f64()
                );
            }
            progress.done(&text);
            save_status(&cluster.coordinator, &work.join("status-at-failure.json"));
            let states = match cluster.status() {
                Ok(st) => {
                    let dead: Vec<String> = st
                        .servers
                        .iter()
                        .filter(|s| !s.1)
                        .map(|s| {
                            if s.0 == victim_id {
                                format!("{} (the victim)", s.0)
                            } else {
                                s.0.to_string()
                            }
                        })
                        .collect();
                    format!("servers dead: {} of {}", dead.join(", "), st.servers.len())
                }
                Err(e) => format!("no status: {e:#}"),
            };
            bail!(
                "{label}: {} not reached within {:.0} s of the kill ({text}; {states}; {} status polls failed)",
                if detected.is_none() {
                    "detection"
                } else if recovered.is_none() {
                    "the end of recovery"
                } else {
                    "the end of re-protection"
                },
                killed_at.elapsed().as_secs_f64(),
                poller.failures.load(Ordering::Relaxed)
            );
        }
        progress.show(describe);
        std::thread::sleep(Duration::from_millis(10));
    };
    progress.done(&format!(
        "detected {:.0} ms after the kill, recovered {:.0} ms later, re-protected {:.0} ms later",
        (detected.answered - killed_at).as_secs_f64() * 1e3,
        (recovered.answered - detected.answered).as_secs_f64() * 1e3,
        (protected.answered - recovered.answered).as_secs_f64() * 1e3
    ));
    let poll_failures = poller.failures.load(Ordering::Relaxed);
    if !poller.direct {
        eprintln!("  {label}: the status was polled through `ramlog cluster status` (the coordinator's frames did not parse)");
    }
    drop(poller);

    // The victim's slots take writes from another server, then 2 s more of load.
    let (result, back, from, verify) =
        settle_after_kill(load, in_victim, &victim_addr, killed_at, deadline, &seeds)?;

    // A sample of the preloaded keys, read back with their values.
    let mut rng_state = 0x9E37_79B9_7F4A_7C15u64 ^ pre.scanned;
    let mut picked = HashSet::new();
    let want = (SAMPLE_KEYS as u64).min(pre.keys);
    let mut tries = 0u64;
    while (picked.len() as u64) < want && tries < want * 1000 {
        tries += 1;
        rng_state = crate::util::scramble(rng_state);
        let i = rng_state % pre.scanned.max(1);
        if in_victim(key_slot(format!("p:{i}").as_bytes())) {
            picked.insert(i);
        }
    }
    let picked: Vec<u64> = picked.into_iter().collect();
    let names: Vec<Vec<u8>> = picked
        .iter()
        .map(|i| format!("p:{i}").into_bytes())
        .collect();
    let survivors: Vec<String> = seeds
        .iter()
        .filter(|s| **s != victim_addr)
        .cloned()
        .collect();
    let values = read_keys(&survivors, &names)?;
    let (mut sample_missing, mut sample_wrong) = (0, 0);
    for (i, value) in picked.iter().zip(&values) {
        match value {
            None => sample_missing += 1,
            Some(v) if *v != preload_value(*i, value_size) => sample_wrong += 1,
            Some(_) => {}
        }
    }

    // Every key, counted through the routing port of a survivor the coordinator shows up.
    let up: Vec<String> = cluster
        .status()
        .map(|st| {
            st.servers
                .iter()
                .filter(|s| s.1)
                .map(|s| s.2.clone())
                .collect()
        })
        .unwrap_or_default();
    let routing = cluster
        .servers
        .iter()
        .enumerate()
        .find(|(n, s)| *n != victim && up.contains(&s.resp))
        .map(|(_, s)| s.routing.clone());
    let keys_after = routing.and_then(|r| match call(&r, &["DBSIZE"]) {
        Ok(Reply::Int(n)) => Some(n as u64),
        Ok(other) => {
            eprintln!("  {label}: DBSIZE through the routing port {r}: {other:?}");
            None
        }
        Err(e) => {
            eprintln!("  {label}: DBSIZE through the routing port {r}: {e:#}");
            None
        }
    });
    // Every survivor should still be up: a busy survivor declared dead is a false positive.
    let survivors_dead = match cluster.status() {
        Ok(st) => st
            .servers
            .iter()
            .filter(|s| s.0 != victim_id && !s.1)
            .count() as u64,
        Err(e) => {
            eprintln!("  {label}: the status after the run: {e:#}");
            cluster.servers.len() as u64
        }
    };
    let keys_expected = pre.keys + result.keys_written();
    let anomalous = survivors_dead > 0
        || verify.lost > 0
        || sample_missing + sample_wrong > 0
        // Keys whose only write was never acknowledged ("ahead") may be there or not.
        || keys_after.is_none_or(|k| k < keys_expected || k > keys_expected + verify.ahead);
    if anomalous {
        save_status(&cluster.coordinator, &work.join("status-at-end.json"));
    }
    drop(cluster);

    Ok(RamlogFailover {
        detection: detected.answered - killed_at,
        recovery: recovered.answered - detected.answered,
        reprotection: protected.answered - recovered.answered,
        failover: back - killed_at,
        longest_gap: result.longest_gap(in_victim, from, result.stopped),
        tablets_back: {
            let mut back: Vec<Duration> = victim_tablets
                .iter()
                .map(|&(a, b)| {
                    result
                        .first_ack(|s| a <= s && s <= b, killed_at, Some(&victim_addr))
                        .map_or(result.stopped - killed_at, |t| t - killed_at)
                })
                .collect();
            back.sort();
            back
        },
        recovered_at: recovered.answered - killed_at,
        rate_before: {
            let from = killed_at
                .checked_sub(Duration::from_millis(1500))
                .unwrap_or(result.started)
                .max(result.started);
            result.acks_between(|_| true, from, killed_at) as f64
                / (killed_at - from).as_secs_f64().max(1e-3)
        },
        rate_reprotection: {
            let span = protected.answered - recovered.answered;
            (span >= Duration::from_millis(100)).then(|| {
                result.acks_between(|_| true, recovered.answered, protected.answered) as f64
                    / span.as_secs_f64()
            })
        },
        protected_at: protected.answered - killed_at,
        worst_tablet_gap: victim_tablets
            .iter()
            .map(|&(a, b)| result.longest_gap(|s| a <= s && s <= b, from, result.stopped))
            .max()
            .unwrap_or_default(),
        others_gap: result.longest_gap(|s| !in_victim(s), from, result.stopped),
        acked: result.acked,
        lost: verify.lost,
        lost_writes: verify.lost_writes,
        checked: verify.checked,
        ahead: verify.ahead,
        errors: result.errors.clone(),
        preloaded: pre.keys,
        preload_time: pre.time,
        sample_checked: picked.len() as u64,
        sample_missing,
        sample_wrong,
        keys_after,
        keys_expected,
        survivors_dead,
        anomalous,
        tablets,
        restorers: restorers.len(),
        poll_failures,
    })
}

// ---------------------------------------------------------------------------------------------
// The suite
// ---------------------------------------------------------------------------------------------

/// One ramlog configuration of the suite.
struct Case {
    /// Row name prefix.
    name: &'static str,
    servers: usize,
    value_size: usize,
    mode: &'static str,
}

const CASES: [Case; 5] = [
    Case {
        name: "r4_100B",
        servers: 4,
        value_size: 100,
        mode: "sync",
    },
    Case {
        name: "r4_1KiB",
        servers: 4,
        value_size: 1024,
        mode: "sync",
    },
    Case {
        name: "r3_100B",
        servers: 3,
        value_size: 100,
        mode: "sync",
    },
    Case {
        name: "r4_100B_durable",
        servers: 4,
        value_size: 100,
        mode: "durable",
    },
    Case {
        name: "r4_100B_mirror",
        servers: 4,
        value_size: 100,
        mode: "mirror",
    },
];

/// Value sizes of the Redis runs (each beside the ramlog cases of that size).
const REDIS_VALUES: [usize; 2] = [100, 1024];

fn size_name(bytes: usize) -> String {
    if bytes.is_multiple_of(1024) {
        format!("{}KiB", bytes / 1024)
    } else {
        format!("{bytes}B")
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `ramlog bench recovery`: what a client sees when a master dies, ramlog against Redis Cluster.
///
/// Per repeat, alternating: ramlog 4 servers 100 B values, Redis 100 B, ramlog 4 servers 1 KiB,
/// Redis 1 KiB, ramlog 3 servers 100 B, ramlog 4 servers 100 B `durable`. The victim master holds
/// 64 MiB (quick) or 1 GiB (full) of values; `RAMLOG_BENCH_RECOVERY_MIB` overrides that,
/// `RAMLOG_BENCH_RECOVERY_REPEATS` the repeats (1 quick, 3 full). Redis's preload is the same
/// per master, at most [`REDIS_PRELOAD_CAP_MIB`] (its failover replays nothing).
pub fn run(quick: bool, json: Option<&Path>) -> anyhow::Result<()> {
    for tool in ["redis-server", "redis-cli"] {
        if which(tool).is_none() {
            bail!("{tool} not found in PATH (install the redis-server and redis-tools packages; scripts/test does)");
        }
    }
    let data_mib = env_u64("RAMLOG_BENCH_RECOVERY_MIB").unwrap_or(if quick { 64 } else { 1024 });
    let repeats = env_u64("RAMLOG_BENCH_RECOVERY_REPEATS")
        .unwrap_or(if quick { 1 } else { 3 })
        .max(1) as usize;
    let memory_mib = (data_mib * 3).max(512);
    let work = std::env::temp_dir().join(format!("ramlog-bench-recovery-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut report = Report::new("recovery", quick);
    let result = run_all(&work, data_mib, memory_mib, repeats, &mut report);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    report.finish(json)
}

/// Copies the `*.log` and `*.json` files of a failed case's `dir` to a directory beside the
/// suite's work directory (which is removed at the end) and returns it.
fn keep_logs(dir: &Path, label: &str) -> std::path::PathBuf {
    let name: String = label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let kept = std::env::temp_dir()
        .join(format!(
            "ramlog-bench-recovery-{}-failed",
            std::process::id()
        ))
        .join(name);
    let _ = std::fs::create_dir_all(&kept);
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("log") | Some("json")
            ) {
                if let Some(file) = path.file_name() {
                    let _ = std::fs::copy(&path, kept.join(file));
                }
            }
        }
    }
    kept
}

/// Writes `ramlog cluster status --json` to `path`, for a failed run's logs (best effort).
fn save_status(coordinator: &str, path: &Path) {
    if let Ok(text) = run_tool(
        &["cluster", "status", "--json", "--coordinator", coordinator],
        TOOL_LIMIT,
    ) {
        let _ = std::fs::write(path, text);
    }
}

/// Redis's preload per master is at most this (MiB of values).
const REDIS_PRELOAD_CAP_MIB: u64 = 64;

fn run_all(
    work: &Path,
    data_mib: u64,
    memory_mib: u64,
    repeats: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    let data_bytes = data_mib << 20;
    println!(
        "victim master holds {data_mib} MiB of values; servers --memory {memory_mib}MiB; R = {REPLICAS}; \
         load: {THREADS} threads over {LOAD_KEYS} keys; {repeats} repeat(s)"
    );
    // RAMLOG_BENCH_RECOVERY_CASES=r4_100B,r3_100B: only these ramlog cases (and the Redis runs of
    // their value sizes).
    let only: Option<Vec<String>> = std::env::var("RAMLOG_BENCH_RECOVERY_CASES")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let cases: Vec<&Case> = CASES
        .iter()
        .filter(|c| only.as_ref().is_none_or(|o| o.iter().any(|n| n == c.name)))
        .collect();
    if cases.is_empty() {
        bail!(
            "RAMLOG_BENCH_RECOVERY_CASES names no case of {:?}",
            CASES.iter().map(|c| c.name).collect::<Vec<_>>()
        );
    }
    let mut ours: Vec<Vec<RamlogFailover>> = cases.iter().map(|_| Vec::new()).collect();
    let mut failures: Vec<u64> = cases.iter().map(|_| 0).collect();
    let mut theirs: Vec<Vec<RedisFailover>> = REDIS_VALUES.iter().map(|_| Vec::new()).collect();
    for repeat in 0..repeats {
        for (c, case) in cases.iter().enumerate() {
            let label = format!("{} #{}", case.name, repeat + 1);
            eprintln!(
                "ramlog {label}: {} servers, {} B values, {}",
                case.servers, case.value_size, case.mode
            );
            let dir = work.join(format!("{}-{}", case.name, repeat + 1));
            let r = ramlog_failover(
                &dir,
                &label,
                case.servers,
                case.mode,
                case.value_size,
                data_bytes,
                memory_mib,
            );
            match r {
                Ok(r) => {
                    if r.anomalous {
                        let kept = keep_logs(&dir, &label);
                        println!(
                            "ramlog {label}: something is off (below); logs in {}",
                            kept.display()
                        );
                    }
                    let _ = std::fs::remove_dir_all(&dir);
                    println!(
                        "ramlog {label}: detection {:.0} ms, recovery {:.0} ms ({} tablets, {} restorers), \
                         re-protection {:.0} ms; client failover {:.0} ms, longest gap {:.0} ms (worst tablet {:.0} ms, other slots {:.0} ms); \
                         {} acked, lost {} keys / {} writes of {} keys, {} ahead; preload {} keys in {:.1} s, \
                         sample {} missing + {} wrong of {}; DBSIZE {:?} of {}; {} survivors dead after; errors {:?}; {} status polls failed",
                        ms(r.detection),
                        ms(r.recovery),
                        r.tablets,
                        r.restorers,
                        ms(r.reprotection),
                        ms(r.failover),
                        ms(r.longest_gap),
                        ms(r.worst_tablet_gap),
                        ms(r.others_gap),
                        r.acked,
                        r.lost,
                        r.lost_writes,
                        r.checked,
                        r.ahead,
                        r.preloaded,
                        r.preload_time.as_secs_f64(),
                        r.sample_missing,
                        r.sample_wrong,
                        r.sample_checked,
                        r.keys_after,
                        r.keys_expected,
                        r.survivors_dead,
                        r.errors,
                        r.poll_failures
                    );
                    if let (Some(first), Some(last)) =
                        (r.tablets_back.first(), r.tablets_back.last())
                    {
                        println!(
                            "ramlog {label}: the victim's tablets took writes again at {:.0} ms (first), {:.0} ms \
                             (median), {:.0} ms (last) after the kill; the status showed recovery over at \
                             {:.0} ms and re-protection over at {:.0} ms",
                            ms(*first),
                            ms(r.tablets_back[r.tablets_back.len() / 2]),
                            ms(*last),
                            ms(r.recovered_at),
                            ms(r.protected_at)
                        );
                    }
                    ours[c].push(r);
                }
                Err(e) => {
                    // Recorded as a failed run; the logs are kept for whoever reads the report.
                    let kept = keep_logs(&dir, &label);
                    let _ = std::fs::remove_dir_all(&dir);
                    println!("ramlog {label} FAILED: {e:#} (logs in {})", kept.display());
                    failures[c] += 1;
                }
            }
            // Redis beside the ramlog case that first uses its value size.
            if let Some(v) = REDIS_VALUES.iter().position(|&v| {
                v == case.value_size && cases.iter().position(|k| k.value_size == v) == Some(c)
            }) {
                let value = REDIS_VALUES[v];
                let label = format!("redis_{} #{}", size_name(value), repeat + 1);
                let per_master = data_bytes.min(REDIS_PRELOAD_CAP_MIB << 20);
                let preload = (per_master / value as u64) as usize * MASTERS;
                eprintln!(
                    "{label}: 4 masters + 4 replicas, {value} B values, {preload} keys preloaded"
                );
                let dir = work.join(format!("redis-{}-{}", value, repeat + 1));
                std::fs::create_dir_all(&dir)?;
                let r = redis_failover(&dir, REDIS_NODE_TIMEOUT_MS, value, LOAD_KEYS, preload);
                let _ = std::fs::remove_dir_all(&dir);
                let r = r.with_context(|| label.clone())?;
                println!(
                    "{label}: failover {:.0} ms, longest gap {:.0} ms (other slots {:.0} ms); {} acked, \
                     lost {} keys / {} writes of {} keys, {} ahead; errors {:?}",
                    ms(r.failover),
                    ms(r.longest_gap),
                    ms(r.others_gap),
                    r.acked,
                    r.lost,
                    r.lost_writes,
                    r.checked,
                    r.ahead,
                    r.errors
                );
                theirs[v].push(r);
            }
        }
    }

    let med = |xs: Vec<f64>| crate::util::median(&xs);
    let max = |xs: Vec<f64>| xs.into_iter().fold(0.0, f64::max);
    let redis_of = |value: usize| {
        let v = REDIS_VALUES.iter().position(|&x| x == value)?;
        let runs = &theirs[v];
        if runs.is_empty() {
            return None;
        }
        Some((
            med(runs.iter().map(|r| ms(r.failover)).collect()),
            med(runs.iter().map(|r| ms(r.longest_gap)).collect()),
            med(runs.iter().map(|r| ms(r.others_gap)).collect()),
            max(runs.iter().map(|r| r.lost_writes as f64).collect()),
        ))
    };
    for value in REDIS_VALUES {
        let Some((failover, gap, others, lost)) = redis_of(value) else {
            continue;
        };
        let p = format!("redis_{}", size_name(value));
        report.push(Row::plain(format!("{p}_failover"), failover, "ms"));
        report.push(Row::plain(format!("{p}_longest_gap"), gap, "ms"));
        report.push(Row::plain(format!("{p}_other_slots_gap"), others, "ms"));
        report.push(Row::plain(format!("{p}_lost_writes"), lost, "writes"));
    }
    let r4_recovery = cases
        .iter()
        .position(|c| c.name == "r4_100B")
        .filter(|&c| !ours[c].is_empty())
        .map(|c| med(ours[c].iter().map(|r| ms(r.recovery)).collect()));
    let r4_failover = cases
        .iter()
        .position(|c| c.name == "r4_100B")
        .filter(|&c| !ours[c].is_empty())
        .map(|c| med(ours[c].iter().map(|r| ms(r.failover)).collect()));
    for ((case, runs), failed) in cases.iter().zip(&ours).zip(&failures) {
        let p = case.name;
        if *failed > 0 {
            report.push(
                Row::plain(format!("{p}_failed_runs"), *failed as f64, "runs")
                    .with_target(Target::at_most(0.0)),
            );
        }
        if runs.is_empty() {
            continue;
        }
        let redis = redis_of(case.value_size);
        let detection = med(runs.iter().map(|r| ms(r.detection)).collect());
        let recovery = med(runs.iter().map(|r| ms(r.recovery)).collect());
        report.push(
            Row::plain(format!("{p}_detection"), detection, "ms")
                .with_target(Target::at_most(500.0)),
        );
        // The 3-server case is there for its recovery time against the 4-server one.
        report.push(if let (3, Some(r4)) = (case.servers, r4_recovery) {
            Row::versus(format!("{p}_recovery_vs_r4"), recovery, "ms", r4)
        } else if case.servers == 3 {
            Row::plain(format!("{p}_recovery"), recovery, "ms")
        } else {
            Row::plain(format!("{p}_recovery"), recovery, "ms").with_target(Target::at_most(2000.0))
        });
        report.push(Row::plain(
            format!("{p}_reprotection"),
            med(runs.iter().map(|r| ms(r.reprotection)).collect()),
            "ms",
        ));
        let failover = med(runs.iter().map(|r| ms(r.failover)).collect());
        let gap = med(runs.iter().map(|r| ms(r.longest_gap)).collect());
        let others = med(runs.iter().map(|r| ms(r.others_gap)).collect());
        let worst_tablet = med(runs.iter().map(|r| ms(r.worst_tablet_gap)).collect());
        if case.mode == "mirror" {
            // The mirror's promise: clients wait for detection and hardly more.
            report.push(
                Row::plain(format!("{p}_gap_after_detection"), gap - detection, "ms")
                    .with_target(Target::at_most(100.0)),
            );
            if let Some(r4) = r4_failover {
                report.push(Row::versus(
                    format!("{p}_failover_vs_backup_recovery"),
                    failover,
                    "ms",
                    r4,
                ));
            }
        }
        match redis {
            Some((r_failover, r_gap, r_others, _)) => {
                report.push(Row::versus(
                    format!("{p}_failover_vs_redis"),
                    failover,
                    "ms",
                    r_failover,
                ));
                report.push(
                    Row::versus(format!("{p}_longest_gap_vs_redis"), gap, "ms", r_gap)
                        .with_target(Target::at_most(0.5)),
                );
                report.push(Row::versus(
                    format!("{p}_worst_tablet_gap_vs_redis"),
                    worst_tablet,
                    "ms",
                    r_gap,
                ));
                report.push(Row::versus(
                    format!("{p}_other_slots_gap_vs_redis"),
                    others,
                    "ms",
                    r_others,
                ));
            }
            None => {
                report.push(Row::plain(format!("{p}_failover"), failover, "ms"));
                report.push(Row::plain(format!("{p}_longest_gap"), gap, "ms"));
                report.push(Row::plain(
                    format!("{p}_worst_tablet_gap"),
                    worst_tablet,
                    "ms",
                ));
                report.push(Row::plain(format!("{p}_other_slots_gap"), others, "ms"));
            }
        }
        report.push(
            Row::plain(
                format!("{p}_lost_writes"),
                max(runs.iter().map(|r| r.lost_writes as f64).collect()),
                "writes",
            )
            .with_target(Target::at_most(0.0)),
        );
        report.push(
            Row::plain(
                format!("{p}_preload_sample_missing"),
                max(runs
                    .iter()
                    .map(|r| (r.sample_missing + r.sample_wrong) as f64)
                    .collect()),
                "keys",
            )
            .with_target(Target::at_most(0.0)),
        );
        let during: Vec<f64> = runs.iter().filter_map(|r| r.rate_reprotection).collect();
        if !during.is_empty() {
            report.push(Row::versus(
                format!("{p}_write_rate_during_reprotection"),
                med(during),
                "acks/s",
                med(runs.iter().map(|r| r.rate_before).collect()),
            ));
        }
        report.push(
            Row::plain(
                format!("{p}_survivors_declared_dead"),
                max(runs.iter().map(|r| r.survivors_dead as f64).collect()),
                "servers",
            )
            .with_target(Target::at_most(0.0)),
        );
        let after: Vec<f64> = runs
            .iter()
            .filter_map(|r| r.keys_after.map(|k| k as f64))
            .collect();
        if !after.is_empty() {
            report.push(Row::versus(
                format!("{p}_keys_after"),
                med(after),
                "keys",
                med(runs
                    .iter()
                    .filter(|r| r.keys_after.is_some())
                    .map(|r| r.keys_expected as f64)
                    .collect()),
            ));
        }
        report.push(Row::plain(
            format!("{p}_preload_rate"),
            med(runs
                .iter()
                .map(|r| r.preloaded as f64 / r.preload_time.as_secs_f64())
                .collect()),
            "keys/s",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> io::Result<Reply> {
        read_reply(&mut io::Cursor::new(bytes), 0)
    }

    #[test]
    fn parses_replies_and_refuses_garbage() {
        assert_eq!(parse(b"+OK\r\n").unwrap(), Reply::Status("OK".into()));
        assert_eq!(
            parse(b"-MOVED 3999 127.0.0.1:6381\r\n").unwrap(),
            Reply::Error("MOVED 3999 127.0.0.1:6381".into())
        );
        assert_eq!(parse(b"$-1\r\n").unwrap(), Reply::Bulk(None));
        assert_eq!(
            parse(b"*2\r\n$3\r\nabc\r\n:7\r\n").unwrap(),
            Reply::Array(Some(vec![
                Reply::Bulk(Some(b"abc".to_vec())),
                Reply::Int(7)
            ]))
        );
        assert!(parse(b"").is_err());
        assert!(parse(b"$5\r\nab").is_err());
        assert!(parse(b"$99999999999\r\n").is_err());
        assert!(parse(b"?what\r\n").is_err());
        assert!(parse(b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n").is_err());
    }

    #[test]
    fn parses_cluster_slots() {
        let node = |host: &str, port| {
            Reply::Array(Some(vec![
                Reply::Bulk(Some(host.as_bytes().to_vec())),
                Reply::Int(port),
                Reply::Bulk(Some(b"id".to_vec())),
                Reply::Array(Some(vec![])),
            ]))
        };
        let reply = Reply::Array(Some(vec![
            Reply::Array(Some(vec![
                Reply::Int(0),
                Reply::Int(99),
                node("127.0.0.1", 7000),
                node("127.0.0.1", 7001),
            ])),
            Reply::Array(Some(vec![
                Reply::Int(100),
                Reply::Int(16383),
                node("", 7002),
            ])),
        ]));
        let nodes = Nodes::default();
        let map = parse_slots(&reply, "10.0.0.1", &nodes).unwrap();
        assert_eq!(nodes.name(map[0]).unwrap(), "127.0.0.1:7000");
        assert_eq!(map[99], map[0]);
        assert_eq!(nodes.name(map[100]).unwrap(), "10.0.0.1:7002");
        assert!(parse_slots(&Reply::Int(1), "h", &nodes).is_err());
    }

    #[test]
    fn gaps_and_first_acks() {
        let started = Instant::now();
        let ms = |n: u64| started + Duration::from_millis(n);
        let ack = |at: u64, slot, node| Ack {
            at_ns: at * 1_000_000,
            slot,
            node,
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
    }

    #[test]
    fn verify_counts_losses() {
        let mut v = Verify::default();
        v.check(b"k", 5, Some(b"5:xx".to_vec())).unwrap();
        v.check(b"k", 5, Some(b"3:xx".to_vec())).unwrap();
        v.check(b"k", 5, None).unwrap();
        v.check(b"k", 0, None).unwrap();
        v.check(b"k", 5, Some(b"6:".to_vec())).unwrap();
        assert!(v.check(b"k", 5, Some(b"zz".to_vec())).is_err());
        assert_eq!(
            v,
            Verify {
                checked: 6,
                lost: 2,
                missing: 1,
                lost_writes: 7,
                ahead: 1
            }
        );
    }

    #[test]
    fn parses_cluster_status() {
        let json = serde_json::json!({
            "map_version": 9,
            "recovering_tablets": 1,
            "pending_copies": 2,
            "servers": [
                {"id": 1, "state": "dead", "epoch": 2,
                 "addresses": {"resp": "127.0.0.1:7001", "routing": null, "native": null, "admin": null}},
                {"id": 2, "state": "up", "epoch": 1,
                 "addresses": {"resp": "127.0.0.1:7002", "routing": null, "native": null, "admin": null}}
            ],
            "tables": [{"name": "default", "mode": "sync", "tablets": [
                {"first_slot": 0, "last_slot": 8191, "master": 1, "backups": [2], "epoch": 2,
                 "recovering": true, "restorer": null, "pending": [], "fresh": []},
                {"first_slot": 8192, "last_slot": 16383, "master": 2, "backups": [3, 4], "epoch": 1,
                 "recovering": false, "restorer": null, "pending": [3, 4], "fresh": []}
            ]}]
        });
        let st = parse_status(&json).unwrap();
        assert_eq!(
            (st.map_version, st.recovering, st.pending, st.stuck),
            (9, 1, 2, 1)
        );
        assert_eq!(st.servers[0], (1, false, "127.0.0.1:7001".to_string()));
        assert!(st.servers[1].1);
        assert_eq!(st.mode, "sync");
        assert_eq!(st.tablets[1].first_slot, 8192);
        assert_eq!(st.tablets[1].backups, vec![3, 4]);
        assert!(parse_status(&serde_json::json!({"servers": []})).is_err());
        assert_eq!(&preload_value(42, 8), b"42:vvvvv");
        assert_eq!(&preload_value(123456, 3), b"123456:");
    }

    /// `cargo test --release -p ramlog-bench recovery -- --ignored --nocapture`
    #[test]
    #[ignore = "starts a Redis Cluster; needs redis-server and redis-cli"]
    fn redis_failover_runs() {
        redis_only(true).unwrap();
    }
}
