//! The master's side of replication: each tablet's writes go to the tablet's backups, in version
//! order, before their replies claim what the table's mode promises (DESIGN.md "Replication
//! modes"; frames in `ramlog_proto::repl`, docs/protocol.md "Replication").
//!
//! The engine calls [`Replication::on_writes`] (its write observer) with each atomic unit of
//! writes of a tablet, under the tablet's write lock, so units reach it in version order. The unit
//! is encoded once and appended to the **stream** of every backup of the tablet: one stream per
//! (this master, backup) pair, whatever tablets they share. A sender thread per stream carries its
//! bytes in `REPL_BATCH` frames over one native-protocol connection; a reader thread takes the
//! backup's `REPL_ACK`s (buffered, durable). The unit's end offset in each stream becomes a wait
//! in the [`Acks`] of the connection that made the write: the engine runs the write (and calls
//! the observer) synchronously on the connection's thread, and the node moves what the observer
//! left in a thread-local into the caller's `Acks` right after the call ([`collect`]); before the
//! replies go out, the node awaits [`Replication::wait`]:
//! - `async`: nothing, unless more than `replication_in_flight_bytes` of the stream are not yet
//!   durable on the backup: then the reply waits until the backup is back under the bound
//!   (back-pressure that bounds the memory a stream holds);
//! - `sync`: the backup holds the unit in its write buffer (and the same bound);
//! - `durable`: the backup has fdatasynced it; frames with such units ask the backup to sync at
//!   once, and one sync covers every unit it appended before (group commit).
//!
//! A stream keeps every byte until its backup acknowledges it durable, and resends from there
//! after a reconnection; the backup skips what it already appended. A backup that leaves a unit
//! unacknowledged longer than `backup_timeout_ms` is reported to the coordinator as suspect.
//! Waits depend only on the streams a connection used: a stopped backup delays the writes of its
//! tablets and nothing else.
//!
//! Reads: a write is visible on the master as soon as it is applied, before its backups hold it;
//! a reply showing it could then be contradicted if the master died and the write was lost with it
//! (a dirty read). So a read of a `sync`, `mirror` or `durable` tablet ([`Replication::read_barrier`])
//! makes its reply wait, as a write's would, until every unit appended so far to the tablet's
//! streams is acknowledged as the mode requires; when nothing is in flight (the common case) it
//! does not wait at all. The engine hands a write to the observer before readers can see it, so
//! a read that sees a write finds it appended. `async` reads never wait.
//!
//! **Refused units.** Admission on the master and the backup's decoder check entries with one
//! definition (`ramlog_common::limits`), so a backup refuses no unit the master admitted unless
//! something is broken (a fault, a corrupt unit; tests use a fault switch). When one is refused
//! anyway (`REPL_REFUSED`), the stream goes on and:
//! - the write whose unit it was fails: its reply becomes an error saying that a backup refused
//!   it and that its outcome is unknown (the master applied it; see below);
//! - the master re-sends the current state of the unit's keys to that backup as a new unit (the
//!   **repair**), and that stream's acknowledgements stay below the refused unit until the repair
//!   is acknowledged: no later write on the stream, and no read that may have seen the refused
//!   write, is acknowledged before every backup holds what the master shows;
//! - a repair that is refused too means the backup cannot hold what the master serves: it is
//!   reported to the coordinator as failing (every `backup_timeout_ms`), which replaces it as
//!   after a crash; meanwhile waits end at `replication_ack_timeout_ms` (below).
//!
//! Undoing the write instead would need a before-image of every write in flight on the master,
//! paid by every write, for a case that client input cannot cause.
//!
//! **Bounded waits.** No reply waits longer than `replication_ack_timeout_ms` for its backups;
//! past it, the writes (and reads) behind it fail with an error saying their outcome is unknown.
//!
//! Memory: each stream holds its unacknowledged bytes (bounded as above, plus what the writes of
//! one read batch of each connection add before they wait), and one frame buffer of up to
//! [`FRAME_UNITS_MAX`] bytes; both are reported as `replication_buffers` (with the backup side's
//! read buffers) and counted against the memory budget.

use crate::node::acks::{AckItem, Acks, RefusedWrite};
use crate::node::figures::{ModeFigures, StreamFigures};
use crate::node::metrics::Histogram;
use arc_swap::ArcSwap;
use parking_lot::{Condvar, Mutex};
use ramlog_cluster::{ClusterMap, ReplicationMode, ServerId};
use ramlog_common::TableId;
use ramlog_logmem::{LoggedWrite, TabletId, WriteObserver};
use ramlog_proto::native::{
    parse_header, ClientHello, Request, ServerHello, Status, HEADER_LEN, HELLO_FLAG_REFUSED,
    SERVER_HELLO_LEN,
};
use ramlog_proto::repl::{self, Ack, Hello, Refused, ReplEntry, UnitHead};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Unit bytes one `REPL_BATCH` frame carries at most (a larger single unit goes alone).
pub const FRAME_UNITS_MAX: usize = 1 << 20;
/// Longest time a connect or handshake with a backup may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// A frame write that makes no progress this long ends the connection (it is then re-made).
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between connection attempts to a backup that cannot be reached, doubling up to a second.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(1);
/// How often a waiting reply re-checks its stream (acks also wake it at once).
const WAIT_RECHECK: Duration = Duration::from_millis(100);
/// A copy's frames: up to this many bytes of units each.
const COPY_FRAME_BYTES: usize = 1 << 20;
/// How long a copy waits for one acknowledgement.
const COPY_ACK_TIMEOUT: Duration = Duration::from_secs(30);

/// The modes, in the order of the per-mode figures.
pub const MODES: [ReplicationMode; 3] = [
    ReplicationMode::Async,
    ReplicationMode::Sync,
    ReplicationMode::Durable,
];

fn mode_index(mode: ReplicationMode) -> u8 {
    match mode {
        ReplicationMode::Async => 0,
        // A mirror table replicates as `sync` until mirrors exist.
        ReplicationMode::Sync | ReplicationMode::Mirror => 1,
        ReplicationMode::Durable => 2,
    }
}

/// Who this master is, as its replication hellos say.
#[derive(Clone, Copy, Debug, Default)]
struct Identity {
    cluster_id: u64,
    me: ServerId,
    epoch: u64,
    map_version: u64,
}

/// Where one engine tablet's writes go.
struct Route {
    head: UnitHead,
    mode: ReplicationMode,
    streams: Vec<Arc<Stream>>,
}

thread_local! {
    /// What the writes and reads run on this thread since the node last collected them wait for
    /// (see the module comment).
    static PENDING: RefCell<Acks> = RefCell::new(Acks::default());
}

/// Moves what the writes and reads this thread ran since the last call wait for into `into`
/// (the node calls it, through [`crate::cluster::Roles`], right after each data call, before any
/// `.await`: a task may move to another thread there).
pub fn collect(into: &mut Acks) {
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        if p.is_empty() {
            return;
        }
        if acks_broken() {
            p.clear();
        } else {
            into.absorb(&mut p);
        }
    });
}

/// The value of `RAMLOG_TEST_BREAK_ACKS` that breaks acknowledgements on purpose.
pub const BREAK_ACKS: &str = "replies-before-backups";

/// Test-only, never for use: with `RAMLOG_TEST_BREAK_ACKS=replies-before-backups` in its
/// environment a server replies before its backups answer, breaking every mode's promise, so that
/// the fault-injection checker can be shown to catch it (tests/python/test_chaos.py). Read once;
/// the server logs an error at start when it is set.
pub fn acks_broken() -> bool {
    static BROKEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *BROKEN.get_or_init(|| std::env::var("RAMLOG_TEST_BREAK_ACKS").is_ok_and(|v| v == BREAK_ACKS))
}

/// The bytes of one stream not yet durable on its backup, with where its units end.
#[derive(Debug)]
struct StreamState {
    /// Stream bytes from offset `base` to `end`.
    buf: Vec<u8>,
    base: u64,
    end: u64,
    /// Offset up to which the current connection has sent.
    sent: u64,
    /// Units not yet durable on the backup: (end offset, entries, when appended).
    units: VecDeque<(u64, u32, Instant)>,
    /// The current connection, to be shut down when the stream is retired.
    socket: Option<TcpStream>,
}

/// One (master, backup) replication stream; see the module comment.
#[derive(Debug)]
pub struct Stream {
    pub backup: ServerId,
    /// Random: tells the backup this stream from an earlier one to the same backup, whose offsets
    /// it may still remember.
    nonce: u64,
    /// The backup's native address (`host:port`), from the newest map.
    address: Mutex<String>,
    state: Mutex<StreamState>,
    /// Wakes the sender when bytes are appended.
    wake: Condvar,
    end: AtomicU64,
    acked_buffered: AtomicU64,
    acked_durable: AtomicU64,
    /// The end of the last unit of a `durable` table.
    durable_wanted: AtomicU64,
    /// Wakes replies waiting on this stream.
    acked: tokio::sync::Notify,
    connected: AtomicBool,
    /// No tablet uses this stream any more: its sender stops.
    retired: AtomicBool,
    last_error: Mutex<String>,
    /// When the backup's last acknowledgement came (the stream's start before the first).
    last_ack: Mutex<Instant>,
    /// When the backup was last reported suspect.
    reported: Mutex<Option<Instant>>,
    /// Units the backup refused, and the hold on acknowledgements while a repair is in flight.
    refusals: Mutex<Refusals>,
    /// Units the backup refused (counter).
    pub refused: AtomicU64,
    pub connects: AtomicU64,
    pub frames_sent: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub units_appended: AtomicU64,
    pub entries_appended: AtomicU64,
}

/// Units refused on one stream, newest last (at most [`REFUSALS_KEPT`]).
#[derive(Debug, Default)]
struct Refusals {
    list: VecDeque<Refusal>,
    /// While a repair is unacknowledged: acknowledgements count only up to `at` (where the first
    /// refused unit starts) until the backup holds everything up to `until` (the repair's end).
    hold: Option<(u64, u64)>,
    /// The backup refused a repair: it cannot hold what this master serves (reported).
    failing: Option<String>,
}

#[derive(Debug, Clone)]
struct Refusal {
    start: u64,
    end: u64,
    reason: String,
    /// The refused unit was itself a repair.
    repair: bool,
}

/// Refusals remembered per stream: far more than can be in flight at once.
const REFUSALS_KEPT: usize = 1024;

impl Stream {
    fn new(backup: ServerId, address: String) -> Stream {
        Stream {
            backup,
            nonce: stream_nonce(),
            address: Mutex::new(address),
            state: Mutex::new(StreamState {
                buf: Vec::new(),
                base: 0,
                end: 0,
                sent: 0,
                units: VecDeque::new(),
                socket: None,
            }),
            wake: Condvar::new(),
            end: AtomicU64::new(0),
            acked_buffered: AtomicU64::new(0),
            acked_durable: AtomicU64::new(0),
            durable_wanted: AtomicU64::new(0),
            acked: tokio::sync::Notify::new(),
            connected: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            last_error: Mutex::new(String::new()),
            last_ack: Mutex::new(Instant::now()),
            reported: Mutex::new(None),
            refusals: Mutex::new(Refusals::default()),
            refused: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            frames_sent: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
            units_appended: AtomicU64::new(0),
            entries_appended: AtomicU64::new(0),
        }
    }

    /// Appends one encoded unit; returns the stream offset where it ends.
    fn push(&self, unit: &[u8], entries: u32, durable: bool) -> u64 {
        let mut s = self.state.lock();
        s.buf.extend_from_slice(unit);
        s.end += unit.len() as u64;
        let end = s.end;
        s.units.push_back((end, entries, Instant::now()));
        self.end.store(end, Ordering::Release);
        if durable {
            self.durable_wanted.fetch_max(end, Ordering::AcqRel);
        }
        drop(s);
        self.units_appended.fetch_add(1, Ordering::Relaxed);
        self.entries_appended
            .fetch_add(u64::from(entries), Ordering::Relaxed);
        self.wake.notify_one();
        end
    }

    fn satisfied(&self, need: &AckItem) -> bool {
        self.acked_buffered.load(Ordering::Acquire) >= need.buffered
            && self.acked_durable.load(Ordering::Acquire) >= need.durable
    }

    /// Takes a backup's acknowledgement: frees what is durable. The caller wakes the waiting
    /// replies once for every acknowledgement it read together.
    fn on_ack(&self, ack: Ack) {
        *self.last_ack.lock() = Instant::now();
        let end = self.end.load(Ordering::Acquire);
        // An acknowledgement beyond what was sent is a broken backup: ignore that part.
        let (mut buffered, mut durable) = (ack.buffered.min(end), ack.durable.min(end));
        {
            let mut r = self.refusals.lock();
            if let Some((at, until)) = r.hold {
                // A refused repair does not release the hold: the backup lacks what this master
                // serves until the failure path replaces it (waits end at the ack timeout).
                if buffered >= until && r.failing.is_none() {
                    r.hold = None;
                } else {
                    // A repair is in flight: nothing past the refused unit counts yet.
                    buffered = buffered.min(at);
                    durable = durable.min(at);
                }
            }
        }
        self.acked_buffered.fetch_max(buffered, Ordering::AcqRel);
        if self.acked_durable.fetch_max(durable, Ordering::AcqRel) < durable {
            let mut s = self.state.lock();
            while s.units.front().is_some_and(|u| u.0 <= durable) {
                s.units.pop_front();
            }
            let free = (durable.saturating_sub(s.base) as usize).min(s.buf.len());
            // Drop freed bytes in large steps, so that the copy of what is left stays cheap.
            if free == s.buf.len() || free >= (64 << 10).max(s.buf.len() / 2) {
                s.buf.drain(..free);
                s.base += free as u64;
                if s.buf.capacity() > (4 << 20) && s.buf.len() < s.buf.capacity() / 4 {
                    let keep = s.buf.len() * 2;
                    s.buf.shrink_to(keep);
                }
            }
        }
    }

    /// How long the oldest unit not yet durable on the backup has waited.
    fn lag(&self) -> Duration {
        self.state
            .lock()
            .units
            .front()
            .map_or(Duration::ZERO, |u| u.2.elapsed())
    }

    /// How long the oldest unit not yet in the backup's write buffer has waited.
    /// How long the backup has acknowledged nothing while a unit waits for it (zero when none
    /// waits): a slow backup that still acknowledges something stays near zero; one that cannot
    /// be reached grows without end.
    fn silent_for(&self) -> Duration {
        self.unbuffered_age().min(self.last_ack.lock().elapsed())
    }

    fn unbuffered_age(&self) -> Duration {
        let buffered = self.acked_buffered.load(Ordering::Acquire);
        let s = self.state.lock();
        let first = s.units.partition_point(|u| u.0 <= buffered);
        s.units.get(first).map_or(Duration::ZERO, |u| u.2.elapsed())
    }

    fn figures(&self) -> StreamFigures {
        let s = self.state.lock();
        let durable = self.acked_durable.load(Ordering::Acquire);
        let buffered = self.acked_buffered.load(Ordering::Acquire);
        StreamFigures {
            backup: self.backup,
            address: self.address.lock().clone(),
            connected: self.connected.load(Ordering::Relaxed),
            bytes_in_flight: s.end - durable.min(s.end),
            entries_in_flight: s
                .units
                .iter()
                .filter(|u| u.0 > durable)
                .map(|u| u64::from(u.1))
                .sum(),
            bytes_unbuffered: s.end - buffered.min(s.end),
            lag_ms: s
                .units
                .front()
                .map_or(0, |u| u.2.elapsed().as_millis() as u64),
            offset: s.end,
            acked_buffered: buffered,
            acked_durable: durable,
            connects: self.connects.load(Ordering::Relaxed),
            frames_sent: self.frames_sent.load(Ordering::Relaxed),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            units: self.units_appended.load(Ordering::Relaxed),
            entries: self.entries_appended.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            last_error: self.last_error.lock().clone(),
        }
    }

    fn buffer_bytes(&self) -> u64 {
        self.state.lock().buf.capacity() as u64
    }

    /// Records why the connection failed; logged when the reason changes (a backup that stays
    /// unreachable is retried quietly).
    fn fail(&self, what: String) {
        let mut last = self.last_error.lock();
        if *last != what {
            tracing::warn!(backup = self.backup, error = %what, "replication connection");
            *last = what;
        }
    }
}

/// A peer to report to the coordinator, and why; `failing`: it cannot do its part, so the
/// coordinator replaces it without a probe (see `ramlog_cluster::rpc::Request::Suspect`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suspect {
    pub server: ServerId,
    pub reason: String,
    pub failing: bool,
    /// For a backup: how long it has acknowledged nothing while writes wait for it (zero for
    /// any other report).
    pub silent: Duration,
}

/// The master side of replication of one server; see the module comment.
pub struct Replication {
    identity: ArcSwap<Identity>,
    routes: ArcSwap<Vec<Option<Arc<Route>>>>,
    streams: Mutex<HashMap<ServerId, Arc<Stream>>>,
    /// The streams in use by their ids (what a connection's [`Acks`] names them by); replaced
    /// whenever the set of streams changes, read without a lock by the waits.
    by_id: ArcSwap<HashMap<u64, Arc<Stream>>>,
    in_flight_max: u64,
    backup_timeout: Duration,
    password: Option<String>,
    stopping: AtomicBool,
    latency: [Histogram; 3],
    acknowledged: [AtomicU64; 3],
    /// The longest a reply waits for its backups (`replication_ack_timeout_ms`).
    ack_timeout: Duration,
    /// Replies that waited past `ack_timeout` (their outcome is unknown to their clients).
    pub ack_timeouts: AtomicU64,
    /// Writes failed because a backup refused their unit.
    pub writes_refused_by_backup: AtomicU64,
    /// The engine the repairs read the keys' current state from (set once it exists).
    engine: std::sync::OnceLock<std::sync::Weak<ramlog_logmem::Engine>>,
}

impl Replication {
    /// A read of `tablet` just ran on this thread: its connection's replies wait until every unit
    /// appended so far to the tablet's streams is acknowledged as the tablet's mode requires
    /// (nothing in `async`, or when nothing is in flight).
    pub fn read_barrier(&self, tablet: TabletId) {
        let routes = self.routes.load();
        let Some(Some(route)) = routes.get(tablet as usize) else {
            return;
        };
        let durable = match route.mode {
            ReplicationMode::Async => return,
            ReplicationMode::Sync | ReplicationMode::Mirror => false,
            ReplicationMode::Durable => true,
        };
        let mode = mode_index(route.mode);
        for stream in &route.streams {
            let end = stream.end.load(Ordering::Acquire);
            let need_durable = if durable { end } else { 0 };
            if stream.acked_buffered.load(Ordering::Acquire) >= end
                && stream.acked_durable.load(Ordering::Acquire) >= need_durable
            {
                continue;
            }
            PENDING.with(|p| p.borrow_mut().add(stream.nonce, mode, end, need_durable));
        }
    }
}

impl Replication {
    /// Waits until every stream of `tablet` has the backup's acknowledgement of everything
    /// appended to it so far, on disk in `durable` mode (for a tablet that takes no more writes:
    /// its source before a migration's switch; for a cluster snapshot: the writes it sees). Err after `limit`, naming the backups still behind, or as soon as
    /// `keep_going` says the wait is moot.
    pub fn drain(
        &self,
        tablet: TabletId,
        limit: Duration,
        keep_going: impl Fn() -> bool,
    ) -> Result<(), String> {
        let routes = self.routes.load();
        let Some(Some(route)) = routes.get(tablet as usize) else {
            return Ok(());
        };
        // In `durable` mode a write is acknowledged once its backups have it on disk.
        let durable = route.mode == ReplicationMode::Durable;
        let wanted: Vec<(Arc<Stream>, u64)> = route
            .streams
            .iter()
            .map(|s| (s.clone(), s.end.load(Ordering::Acquire)))
            .collect();
        drop(routes);
        let deadline = Instant::now() + limit;
        loop {
            let behind: Vec<ServerId> = wanted
                .iter()
                .filter(|(s, end)| {
                    s.acked_buffered.load(Ordering::Acquire) < *end
                        || (durable && s.acked_durable.load(Ordering::Acquire) < *end)
                })
                .map(|(s, _)| s.backup)
                .collect();
            if behind.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "backups {behind:?} did not acknowledge the tablet's last writes within {} ms",
                    limit.as_millis()
                ));
            }
            if !keep_going() {
                return Err("the map no longer asks for it".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Replication {
    pub fn new(config: &crate::node::config::ServerConfig) -> Arc<Replication> {
        Arc::new(Replication {
            identity: ArcSwap::from_pointee(Identity::default()),
            routes: ArcSwap::from_pointee(Vec::new()),
            streams: Mutex::new(HashMap::new()),
            by_id: ArcSwap::from_pointee(HashMap::new()),
            in_flight_max: config.replication_in_flight_bytes.max(1 << 16),
            backup_timeout: Duration::from_millis(config.backup_timeout_ms.max(1)),
            password: config.password.clone(),
            stopping: AtomicBool::new(false),
            latency: Default::default(),
            acknowledged: Default::default(),
            ack_timeout: Duration::from_millis(config.replication_ack_timeout_ms.max(1)),
            ack_timeouts: AtomicU64::new(0),
            writes_refused_by_backup: AtomicU64::new(0),
            engine: std::sync::OnceLock::new(),
        })
    }

    /// Names the engine whose writes this replicates (repairs read the current state of refused
    /// keys from it).
    pub fn set_engine(&self, engine: &Arc<ramlog_logmem::Engine>) {
        let _ = self.engine.set(Arc::downgrade(engine));
    }

    /// Points every tablet this server masters at its backups in `map` (`tablets`: engine tablet
    /// of each (table, first slot) created here). Starts streams to new backups and retires
    /// streams no tablet uses any more. Call before the map is published to the front ends.
    pub fn apply(
        self: &Arc<Self>,
        map: &ClusterMap,
        me: ServerId,
        epoch: u64,
        tablets: &HashMap<(TableId, u16), TabletId>,
    ) {
        self.identity.store(Arc::new(Identity {
            cluster_id: map.cluster_id,
            me,
            epoch,
            map_version: map.version,
        }));
        let mut streams = self.streams.lock();
        let mut used = std::collections::HashSet::new();
        let mut routes: Vec<Option<Arc<Route>>> = Vec::new();
        for t in map.tablets.iter().filter(|t| t.master == me) {
            let Some(&engine_tablet) = tablets.get(&(t.table, t.first_slot)) else {
                continue;
            };
            let Ok(table) = u32::try_from(t.table) else {
                tracing::error!(
                    table = t.table,
                    "table id out of the replication range; not replicated"
                );
                continue;
            };
            let mode = map
                .tables
                .iter()
                .find(|x| x.id == t.table)
                .map_or(ReplicationMode::Sync, |x| x.mode);
            let mut route_streams = Vec::new();
            for &b in &t.backups {
                // A dead backup stays listed for its logs; nothing streams to it.
                let Some(server) = map
                    .server(b)
                    .filter(|s| s.state == ramlog_cluster::ServerState::Up)
                else {
                    continue;
                };
                let address = server.addresses.native.to_string();
                let stream = streams
                    .entry(b)
                    .or_insert_with(|| {
                        let s = Arc::new(Stream::new(b, address.clone()));
                        self.start_sender(s.clone());
                        s
                    })
                    .clone();
                *stream.address.lock() = address;
                used.insert(b);
                route_streams.push(stream);
            }
            let i = engine_tablet as usize;
            if routes.len() <= i {
                routes.resize(i + 1, None);
            }
            routes[i] = Some(Arc::new(Route {
                head: UnitHead {
                    table,
                    first_slot: t.first_slot,
                    last_slot: t.last_slot,
                    epoch: t.epoch,
                    count: 0,
                },
                mode,
                streams: route_streams,
            }));
        }
        // Every stream a route names is known by id before any write can add a wait on it.
        self.by_id.store(Arc::new(
            streams.values().map(|s| (s.nonce, s.clone())).collect(),
        ));
        self.routes.store(Arc::new(routes));
        streams.retain(|id, s| {
            let keep = used.contains(id);
            if !keep {
                s.retired.store(true, Ordering::Release);
                s.wake.notify_all();
                if let Some(sock) = s.state.lock().socket.take() {
                    let _ = sock.shutdown(Shutdown::Both);
                }
                s.acked.notify_waiters();
            }
            keep
        });
        self.by_id.store(Arc::new(
            streams.values().map(|s| (s.nonce, s.clone())).collect(),
        ));
    }

    /// Stops every stream (the server is stopping): waiting replies fail.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        for s in self.streams.lock().values() {
            s.retired.store(true, Ordering::Release);
            s.wake.notify_all();
            if let Some(sock) = s.state.lock().socket.take() {
                let _ = sock.shutdown(Shutdown::Both);
            }
            s.acked.notify_waiters();
        }
    }

    /// Waits until every need is met (see the module comment), at most
    /// `replication_ack_timeout_ms` after the first write behind them. An error means the
    /// promise cannot be kept (the server is stopping, or no acknowledgement came in time): the
    /// replies must not claim the writes. Ok names the units of `acks` that a backup refused:
    /// the replies of those writes must fail, the others stand.
    pub async fn wait(&self, acks: &mut Acks) -> Result<Vec<RefusedWrite>, String> {
        let (items, units) = acks.take();
        let by_id = self.by_id.load();
        let mut refused_streams: Vec<Arc<Stream>> = Vec::new();
        for need in items {
            // A stream no longer in use (its backup left every tablet's set) waits for nothing:
            // see `retired` below.
            let Some(stream) = by_id.get(&need.stream) else {
                continue;
            };
            let deadline = need.since + self.ack_timeout;
            loop {
                let notified = stream.acked.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if stream.satisfied(&need) {
                    break;
                }
                if self.stopping.load(Ordering::Acquire) {
                    return Err(
                        "the server is stopping; the write's backups did not acknowledge it".into(),
                    );
                }
                let now = Instant::now();
                if now >= deadline {
                    self.ack_timeouts.fetch_add(1, Ordering::Relaxed);
                    let error = stream.last_error.lock().clone();
                    return Err(format!(
                        "backup {} did not acknowledge within replication_ack_timeout_ms ({} ms){}; the write's outcome is unknown",
                        stream.backup,
                        self.ack_timeout.as_millis(),
                        if error.is_empty() { String::new() } else { format!(" ({error})") }
                    ));
                }
                if stream.retired.load(Ordering::Acquire) {
                    // A map took the backup out of the tablet's backup set (it was declared
                    // dead): this master still serves the tablet (a master that was itself
                    // declared dead is fenced, gets no map, and stops), the remaining backups'
                    // waits stand on their own, and the replacement receives the tablet by copy.
                    break;
                }
                let _ = tokio::time::timeout(WAIT_RECHECK.min(deadline - now), notified).await;
            }
            let mode = usize::from(need.mode).min(MODES.len() - 1);
            self.latency[mode].record(need.since.elapsed());
            self.acknowledged[mode].fetch_add(1, Ordering::Relaxed);
            if stream.refused.load(Ordering::Acquire) > 0 {
                refused_streams.push(stream.clone());
            }
        }
        let mut refused = Vec::new();
        for stream in &refused_streams {
            let r = stream.refusals.lock();
            for (i, mark) in units
                .iter()
                .enumerate()
                .filter(|(_, m)| m.stream == stream.nonce)
            {
                if let Some(x) = r.list.iter().find(|x| x.end == mark.end && !x.repair) {
                    refused.push(RefusedWrite {
                        unit: i,
                        reason: x.reason.clone(),
                    });
                }
            }
        }
        self.writes_refused_by_backup
            .fetch_add(refused.len() as u64, Ordering::Relaxed);
        Ok(refused)
    }

    /// A backup refused a unit of `stream` (see the module comment): remembers it for the
    /// replies waiting on it, and sends the repair (or, if the unit was a repair, marks the
    /// backup failing).
    fn on_refused(&self, stream: &Stream, refused: Refused) {
        let reason = format!(
            "backup {} refused the write ({:?}: {}); the master applied it, so its outcome is unknown",
            stream.backup, refused.status, refused.message
        );
        let mut r = stream.refusals.lock();
        if r.list
            .iter()
            .any(|x| x.start == refused.start && x.end == refused.end)
        {
            // Answered again after a reconnection: handled already.
            return;
        }
        let repair = r
            .hold
            .is_some_and(|(_, until)| refused.end == until && refused.start < until);
        stream.refused.fetch_add(1, Ordering::AcqRel);
        tracing::warn!(
            backup = stream.backup,
            start = refused.start,
            end = refused.end,
            status = ?refused.status,
            message = %refused.message,
            repair,
            "a backup refused a replicated unit"
        );
        if r.list.len() >= REFUSALS_KEPT {
            r.list.pop_front();
        }
        r.list.push_back(Refusal {
            start: refused.start,
            end: refused.end,
            reason: reason.clone(),
            repair,
        });
        if repair {
            r.failing = Some(format!(
                "refuses replicated writes, and a re-send of them too: {}",
                refused.message
            ));
            return;
        }
        drop(r);
        let at = refused.start;
        match self.repair_unit(stream, refused.start, refused.end) {
            Ok(Some((unit, entries))) => {
                // Acknowledgements are read on this thread only (the caller's), so none counts
                // between the push and the hold.
                let until = stream.push(&unit, entries, false);
                let mut r = stream.refusals.lock();
                r.hold = Some(match r.hold {
                    Some((a, u)) => (a.min(at), u.max(until)),
                    None => (at, until),
                });
            }
            Ok(None) => {}
            Err(e) => {
                tracing::error!(backup = stream.backup, error = %e, "cannot repair a refused unit; the backup is reported as failing");
                stream.refusals.lock().failing = Some(format!(
                    "refused a replicated unit that could not be re-sent: {e}"
                ));
            }
        }
    }

    /// The repair of the refused unit `start..end` of `stream`: one unit with the current state
    /// of each of its keys, or None when newer writes cover every key.
    fn repair_unit(
        &self,
        stream: &Stream,
        start: u64,
        end: u64,
    ) -> Result<Option<(Vec<u8>, u32)>, String> {
        let bytes = {
            let s = stream.state.lock();
            if start < s.base || end > s.end {
                return Err("the refused unit is no longer in the stream's buffer".into());
            }
            s.buf[(start - s.base) as usize..(end - s.base) as usize].to_vec()
        };
        let unit = repl::decode_units(&bytes, start, repl::Limits::for_backup(usize::MAX))
            .next()
            .ok_or("an empty unit")?
            .map_err(|e| e.decode_error().message.clone())?;
        let engine = self
            .engine
            .get()
            .and_then(|w| w.upgrade())
            .ok_or("the engine is gone")?;
        let routes = self.routes.load();
        let Some((tablet, route)) = routes.iter().enumerate().find_map(|(i, r)| {
            r.as_ref()
                .filter(|r| {
                    r.head.table == unit.head.table && r.head.first_slot == unit.head.first_slot
                })
                .map(|r| (i as TabletId, r))
        }) else {
            // This server no longer masters the tablet: its new master's state is what counts.
            return Ok(None);
        };
        // (key, value or None for a delete, version, expiry) of each key to re-send.
        type Current = (Vec<u8>, Option<Vec<u8>>, u64, u64);
        let mut current: Vec<Current> = Vec::new();
        for e in &unit.entries {
            // Under the tablet's write lock: the refusal may come back before the writer that
            // appended the unit has pointed the index at it.
            let now = engine
                .read_settled(tablet, e.key, |value, version, expiry| {
                    (value.to_vec(), version, expiry)
                })
                .map_err(|x| x.to_string())?;
            match now {
                // The refused write is the key's state: send it again.
                Some((value, version, expiry)) if version == e.version => {
                    current.push((e.key.to_vec(), Some(value), version, expiry))
                }
                // A newer write follows in the stream.
                Some(_) => {}
                // Gone (deleted, expired): absent at the refused version, so that no older value
                // of the backup's can come back.
                None => current.push((e.key.to_vec(), None, e.version, 0)),
            }
        }
        if current.is_empty() {
            return Ok(None);
        }
        let entries: Vec<ReplEntry<'_>> = current
            .iter()
            .map(|(key, value, version, expiry)| ReplEntry {
                key,
                value: value.as_deref(),
                version: *version,
                expiry: *expiry,
            })
            .collect();
        let mut out = Vec::new();
        repl::encode_unit(&mut out, &route.head, &entries);
        Ok(Some((out, entries.len() as u32)))
    }

    /// Backups that left a unit unacknowledged longer than `backup_timeout_ms`, or refused a
    /// repair (failing), and were not reported in the last timeout. Each is marked reported.
    pub fn suspects(&self) -> Vec<Suspect> {
        let mut out = Vec::new();
        for s in self.streams.lock().values() {
            let failing = s.refusals.lock().failing.clone();
            let waited = s.unbuffered_age();
            if waited < self.backup_timeout && failing.is_none() {
                continue;
            }
            let mut reported = s.reported.lock();
            if reported.is_some_and(|t| t.elapsed() < self.backup_timeout) {
                continue;
            }
            *reported = Some(Instant::now());
            if let Some(reason) = failing {
                out.push(Suspect {
                    server: s.backup,
                    reason,
                    failing: true,
                    silent: s.silent_for(),
                });
                continue;
            }
            let error = s.last_error.lock().clone();
            out.push(Suspect {
                server: s.backup,
                reason: format!(
                    "a replicated write waits {} ms for its backup's acknowledgement, none came for {} ms{}",
                    waited.as_millis(),
                    s.silent_for().as_millis(),
                    if error.is_empty() {
                        String::new()
                    } else {
                        format!(" ({error})")
                    }
                ),
                failing: false,
                silent: s.silent_for(),
            });
        }
        out
    }

    pub fn streams(&self) -> Vec<StreamFigures> {
        let mut v: Vec<StreamFigures> = self.streams.lock().values().map(|s| s.figures()).collect();
        v.sort_by_key(|f| f.backup);
        v
    }

    /// How long this server's replicated writes waited for their backups, every mode together
    /// (cumulative).
    pub fn ack_latency_all(&self) -> crate::node::metrics::HistogramSnapshot {
        let mut all = crate::node::metrics::HistogramSnapshot::empty();
        for h in &self.latency {
            all.add(&h.read());
        }
        all
    }

    pub fn modes(&self) -> Vec<ModeFigures> {
        MODES
            .iter()
            .enumerate()
            .map(|(i, m)| ModeFigures {
                mode: m.as_str(),
                acknowledged: self.acknowledged[i].load(Ordering::Relaxed),
                latency: self.latency[i].read(),
            })
            .collect()
    }

    /// Bytes the streams hold (their buffers), for the memory breakdown.
    pub fn memory_bytes(&self) -> u64 {
        self.streams
            .lock()
            .values()
            .map(|s| s.buffer_bytes() + FRAME_UNITS_MAX as u64)
            .sum()
    }

    /// The most lag of any stream (for INFO).
    pub fn max_lag(&self) -> Duration {
        self.streams
            .lock()
            .values()
            .map(|s| s.lag())
            .max()
            .unwrap_or_default()
    }

    fn start_sender(self: &Arc<Self>, stream: Arc<Stream>) {
        let me = Arc::downgrade(self);
        let name = format!("repl-to-{}", stream.backup);
        let spawned = std::thread::Builder::new()
            .name(name)
            .spawn(move || sender_loop(me, stream));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a replication sender thread");
        }
    }

    /// Copies every live object of engine tablet `tablet` to the backup at `address`, as units
    /// of `head` (the tablet at its current epoch), over a connection of its own, and returns
    /// once the backup has all of it on disk. The objects are read in bulk, in log order, at a
    /// snapshot of the tablet taken when the copy starts ([`ramlog_logmem::Engine::tablet_cursor`]):
    /// the live stream, which the backup already receives, carries every later write, and the
    /// backup keeps the newest version of each key. `pace` is told the bytes of each frame sent
    /// (and may sleep); `objects` and `bytes` count what was sent; `keep_going` is asked between
    /// frames (false: stop).
    #[allow(clippy::too_many_arguments)]
    pub fn copy_tablet(
        &self,
        engine: &ramlog_logmem::Engine,
        tablet: TabletId,
        head: UnitHead,
        address: &str,
        mut pace: impl FnMut(u64),
        objects: &AtomicU64,
        bytes: &AtomicU64,
        keep_going: impl Fn() -> bool,
    ) -> Result<u64, String> {
        /// Objects read from the engine at a time.
        const PAGE_OBJECTS: usize = 1024;
        let hello = self.hello(stream_nonce());
        let fail = |e: std::io::Error| format!("copy to {address}: {e}");
        let mut socket = connect(address, &hello, self.password.as_deref()).map_err(fail)?;
        socket
            .set_read_timeout(Some(COPY_ACK_TIMEOUT))
            .map_err(fail)?;
        let mut cursor = engine
            .tablet_cursor(tablet)
            .map_err(|e| format!("reading the tablet: {e}"))?;
        let mut acks = AckReader::default();
        let (mut offset, mut copied) = (0u64, 0u64);
        let (mut units, mut frame) = (Vec::new(), Vec::new());
        loop {
            if !keep_going() || self.stopping.load(Ordering::Acquire) {
                return Err("stopped: the map no longer asks for this copy".into());
            }
            let page = cursor
                .next_page(PAGE_OBJECTS)
                .map_err(|e| format!("reading the tablet: {e}"))?;
            if !page.is_empty() {
                let entries: Vec<ReplEntry<'_>> = page
                    .iter()
                    .map(|r| ReplEntry {
                        key: &r.key,
                        value: Some(&r.value),
                        version: r.version,
                        expiry: r.expire_at_ms,
                    })
                    .collect();
                repl::encode_unit(&mut units, &head, &entries);
                copied += entries.len() as u64;
                objects.fetch_add(entries.len() as u64, Ordering::Relaxed);
            }
            let last = cursor.is_done();
            if units.len() >= COPY_FRAME_BYTES || (last && (!units.is_empty() || offset > 0)) {
                frame.clear();
                let flags = if last { repl::FLAG_DURABLE } else { 0 };
                repl::encode_batch_frame(&mut frame, offset, flags, &units);
                socket.write_all(&frame).map_err(fail)?;
                let previous_end = offset;
                offset += units.len() as u64;
                bytes.fetch_add(units.len() as u64, Ordering::Relaxed);
                // Two frames in flight: the backup appends one while this reads and encodes the
                // next, and the copy never runs more than a frame ahead of what the backup took.
                while acks.buffered < previous_end {
                    acks.read(&mut socket).map_err(fail)?;
                }
                pace(units.len() as u64);
                units.clear();
            }
            if last {
                break;
            }
        }
        while acks.durable < offset {
            acks.read(&mut socket).map_err(fail)?;
        }
        let _ = socket.shutdown(Shutdown::Both);
        Ok(copied)
    }

    fn hello(&self, stream: u64) -> Hello {
        let id = self.identity.load();
        Hello {
            cluster_id: id.cluster_id,
            master: id.me,
            master_epoch: id.epoch,
            map_version: id.map_version,
            stream,
        }
    }
}

impl WriteObserver for Replication {
    fn on_writes(&self, tablet: TabletId, records: &[LoggedWrite<'_>]) {
        let routes = self.routes.load();
        let Some(Some(route)) = routes.get(tablet as usize) else {
            return;
        };
        if route.streams.is_empty() {
            return;
        }
        let entries: Vec<ReplEntry<'_>> = records
            .iter()
            .map(|r| ReplEntry {
                key: r.key,
                value: r.value,
                version: r.version,
                expiry: r.expire_at_ms,
            })
            .collect();
        thread_local! {
            static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
        }
        let mode = mode_index(route.mode);
        let durable = route.mode == ReplicationMode::Durable;
        SCRATCH.with(|scratch| {
            let mut unit = scratch.borrow_mut();
            unit.clear();
            repl::encode_unit(&mut unit, &route.head, &entries);
            PENDING.with(|p| {
                let mut p = p.borrow_mut();
                for stream in &route.streams {
                    let end = stream.push(&unit, entries.len() as u32, durable);
                    let bound = end.saturating_sub(self.in_flight_max);
                    let (buffered, durable_at) = match route.mode {
                        ReplicationMode::Async => (0, bound),
                        ReplicationMode::Sync | ReplicationMode::Mirror => (end, bound),
                        ReplicationMode::Durable => (end, end),
                    };
                    p.add(stream.nonce, mode, buffered, durable_at);
                    if route.mode != ReplicationMode::Async {
                        p.add_unit(stream.nonce, end);
                    }
                }
            });
            if unit.capacity() > FRAME_UNITS_MAX {
                *unit = Vec::new();
            }
        });
    }
}

/// A number no other stream of this process uses (time, pid and a counter, mixed).
fn stream_nonce() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mixed = t ^ (u64::from(std::process::id()) << 32) ^ NEXT.fetch_add(1, Ordering::Relaxed);
    mixed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Connects to the stream's backup and sends its bytes until the stream is retired, reconnecting
/// (and resending what the backup has not made durable) after any failure.
fn sender_loop(replication: std::sync::Weak<Replication>, stream: Arc<Stream>) {
    let mut retry = RETRY_FIRST;
    let mut frame = Vec::with_capacity(FRAME_UNITS_MAX + 64);
    loop {
        if stream.retired.load(Ordering::Acquire) {
            return;
        }
        let Some(hello) = replication
            .upgrade()
            .map(|r| (r.hello(stream.nonce), r.password.clone()))
        else {
            return;
        };
        let address = stream.address.lock().clone();
        let socket = match connect(&address, &hello.0, hello.1.as_deref()) {
            Ok(s) => s,
            Err(e) => {
                stream.fail(format!("{address}: {e}"));
                std::thread::sleep(retry);
                retry = (retry * 2).min(RETRY_MAX);
                continue;
            }
        };
        let connected_at = Instant::now();
        stream.connects.fetch_add(1, Ordering::Relaxed);
        let reader = match socket.try_clone() {
            Ok(r) => r,
            Err(e) => {
                stream.fail(format!("{address}: {e}"));
                continue;
            }
        };
        {
            let mut s = stream.state.lock();
            // Resend everything the backup has not made durable: it skips what it appended.
            s.sent = stream.acked_durable.load(Ordering::Acquire).max(s.base);
            s.socket = socket.try_clone().ok();
        }
        stream.connected.store(true, Ordering::Release);
        let alive = Arc::new(AtomicBool::new(true));
        let reading = {
            let stream = stream.clone();
            let alive = alive.clone();
            let replication = replication.clone();
            std::thread::Builder::new()
                .name(format!("repl-ack-{}", stream.backup))
                .spawn(move || ack_loop(reader, &stream, &alive, &replication))
        };
        let mut socket = socket;
        let result = send_loop(&mut socket, &stream, &alive, &mut frame);
        stream.connected.store(false, Ordering::Release);
        alive.store(false, Ordering::Release);
        let _ = socket.shutdown(Shutdown::Both);
        stream.state.lock().socket = None;
        if let Ok(handle) = reading {
            let _ = handle.join();
        }
        if let Err(e) = result {
            if !stream.retired.load(Ordering::Acquire) {
                stream.fail(format!("{address}: {e}"));
                // A backup that keeps closing at once (a failed store, a fence) is retried less
                // and less often; one that served a while is retried at once.
                if connected_at.elapsed() > RETRY_MAX {
                    retry = RETRY_FIRST;
                }
                std::thread::sleep(retry);
                retry = (retry * 2).min(RETRY_MAX);
            }
        }
        if frame.capacity() > 2 * FRAME_UNITS_MAX {
            frame = Vec::with_capacity(FRAME_UNITS_MAX + 64);
        }
    }
}

/// Sends the stream's bytes in frames until the connection fails or the stream is retired.
fn send_loop(
    socket: &mut TcpStream,
    stream: &Stream,
    alive: &AtomicBool,
    frame: &mut Vec<u8>,
) -> std::io::Result<()> {
    loop {
        frame.clear();
        let (start, end) = {
            let mut s = stream.state.lock();
            while s.sent >= s.end {
                if stream.retired.load(Ordering::Acquire) {
                    return Ok(());
                }
                if !alive.load(Ordering::Acquire) {
                    return Err(std::io::Error::other("the backup closed the connection"));
                }
                stream.wake.wait_for(&mut s, Duration::from_millis(100));
            }
            // Whole units from `sent`, up to FRAME_UNITS_MAX bytes (at least one unit).
            let from = (s.sent - s.base) as usize;
            let mut to = from;
            while to < s.buf.len() {
                let Some(len) = repl::unit_len_at(&s.buf, to) else {
                    break;
                };
                if to > from && to + len - from > FRAME_UNITS_MAX {
                    break;
                }
                to += len;
            }
            let start = s.sent;
            let end = s.base + to as u64;
            let flags = if stream.durable_wanted.load(Ordering::Acquire) > start {
                repl::FLAG_DURABLE
            } else {
                0
            };
            repl::encode_batch_frame(frame, start, flags, &s.buf[from..to]);
            s.sent = end;
            (start, end)
        };
        socket.write_all(frame)?;
        stream.frames_sent.fetch_add(1, Ordering::Relaxed);
        stream.bytes_sent.fetch_add(end - start, Ordering::Relaxed);
        if !alive.load(Ordering::Acquire) {
            return Err(std::io::Error::other("the backup closed the connection"));
        }
    }
}

/// Reads the backup's acknowledgements and refusals of single units until the connection ends;
/// an error frame (fenced, a refused frame, a failed store) is logged and ends it.
fn ack_loop(
    socket: TcpStream,
    stream: &Stream,
    alive: &AtomicBool,
    replication: &std::sync::Weak<Replication>,
) {
    read_acks(socket, stream, alive, replication);
    // Replies waiting on this stream see the acknowledgements read last, and the closed connection.
    stream.acked.notify_waiters();
}

fn read_acks(
    mut socket: TcpStream,
    stream: &Stream,
    alive: &AtomicBool,
    replication: &std::sync::Weak<Replication>,
) {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        match socket.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        let mut at = 0;
        let mut acked = false;
        loop {
            let header = match parse_header(&buf[at..], 1 << 20) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(e) => {
                    stream.fail(format!("bad frame from the backup: {e}"));
                    alive.store(false, Ordering::Release);
                    let _ = socket.shutdown(Shutdown::Both);
                    return;
                }
            };
            if buf.len() - at < header.frame_bytes() {
                break;
            }
            let body = &buf[at + HEADER_LEN..at + header.frame_bytes()];
            at += header.frame_bytes();
            let status = Status::from_u8(header.flags_or_status);
            if header.opcode == repl::REPL_REFUSED {
                match Refused::decode(status, body) {
                    Ok(refused) => {
                        if let Some(r) = replication.upgrade() {
                            r.on_refused(stream, refused);
                        }
                        // Waiting replies look at the refusal when their acknowledgement comes.
                        continue;
                    }
                    Err(e) => {
                        stream.fail(format!("bad refusal: {}", e.message));
                        alive.store(false, Ordering::Release);
                        let _ = socket.shutdown(Shutdown::Both);
                        return;
                    }
                }
            }
            if header.opcode == repl::REPL_ACK && status == Status::Ok {
                match Ack::decode(body) {
                    Ok(ack) => {
                        stream.on_ack(ack);
                        acked = true;
                    }
                    Err(e) => {
                        stream.fail(format!("bad acknowledgement: {e}"));
                        alive.store(false, Ordering::Release);
                        let _ = socket.shutdown(Shutdown::Both);
                        return;
                    }
                }
            } else {
                stream.fail(format!(
                    "the backup refused the stream: {status:?}: {}",
                    error_message(body)
                ));
                alive.store(false, Ordering::Release);
                let _ = socket.shutdown(Shutdown::Both);
                stream.wake.notify_all();
                return;
            }
        }
        buf.drain(..at);
        if acked {
            stream.acked.notify_waiters();
        }
    }
    alive.store(false, Ordering::Release);
    stream.wake.notify_all();
}

/// Acknowledgements read from a copy's connection.
#[derive(Default)]
struct AckReader {
    buf: Vec<u8>,
    buffered: u64,
    durable: u64,
}

impl AckReader {
    /// Reads at least one frame; an error frame from the backup becomes an error.
    fn read(&mut self, socket: &mut TcpStream) -> std::io::Result<()> {
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(header) = parse_header(&self.buf, 1 << 20)
                .map_err(|e| std::io::Error::other(e.to_string()))?
            {
                if self.buf.len() >= header.frame_bytes() {
                    let body = self.buf[HEADER_LEN..header.frame_bytes()].to_vec();
                    self.buf.drain(..header.frame_bytes());
                    let status = Status::from_u8(header.flags_or_status);
                    if header.opcode != repl::REPL_ACK || status != Status::Ok {
                        return Err(std::io::Error::other(format!(
                            "the backup refused the copy: {status:?}: {}",
                            error_message(&body)
                        )));
                    }
                    let ack = Ack::decode(&body).map_err(|e| std::io::Error::other(e.message))?;
                    self.buffered = self.buffered.max(ack.buffered);
                    self.durable = self.durable.max(ack.durable);
                    return Ok(());
                }
            }
            let n = socket.read(&mut chunk)?;
            if n == 0 {
                return Err(std::io::Error::other("the backup closed the connection"));
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// The message of a native error reply body (detail u64, then a length-prefixed string).
pub fn error_message(body: &[u8]) -> String {
    body.get(12..)
        .map(|m| String::from_utf8_lossy(m).into_owned())
        .unwrap_or_default()
}

/// Opens a replication connection: native hello, AUTH when a password is set, REPL_HELLO.
fn connect(address: &str, hello: &Hello, password: Option<&str>) -> std::io::Result<TcpStream> {
    use std::net::ToSocketAddrs;
    let addr = address
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other("no address"))?;
    let mut socket = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
    socket.set_nodelay(true)?;
    socket.set_read_timeout(Some(CONNECT_TIMEOUT))?;
    socket.set_write_timeout(Some(WRITE_TIMEOUT))?;
    socket.write_all(
        &ClientHello {
            version_max: ramlog_proto::native::PROTOCOL_VERSION,
            flags: 0,
        }
        .encode(),
    )?;
    let mut sh = [0u8; SERVER_HELLO_LEN];
    socket.read_exact(&mut sh)?;
    let server_hello = ServerHello::decode(&sh).map_err(|e| std::io::Error::other(e.message))?;
    if server_hello.flags & HELLO_FLAG_REFUSED != 0 || server_hello.version == 0 {
        return Err(std::io::Error::other("the backup refused the connection"));
    }
    let mut out = bytes::BytesMut::new();
    if let Some(password) = password {
        Request::Auth {
            password: password.as_bytes(),
        }
        .encode(1, &mut out);
        socket.write_all(&out)?;
        read_reply(&mut socket, "AUTH")?;
    }
    let mut frame = Vec::new();
    repl::encode_frame(&mut frame, 2, repl::REPL_HELLO, 0, &hello.encode());
    socket.write_all(&frame)?;
    read_reply(&mut socket, "REPL_HELLO")?;
    socket.set_read_timeout(None)?;
    Ok(socket)
}

/// Reads one reply frame; an error status becomes an error with its message.
fn read_reply(socket: &mut TcpStream, what: &str) -> std::io::Result<()> {
    let mut head = [0u8; HEADER_LEN];
    socket.read_exact(&mut head)?;
    let header = parse_header(&head, 1 << 20)
        .map_err(|e| std::io::Error::other(e.to_string()))?
        .ok_or_else(|| std::io::Error::other("short reply"))?;
    let mut body = vec![0u8; header.body_len];
    socket.read_exact(&mut body)?;
    let status = Status::from_u8(header.flags_or_status);
    if status != Status::Ok {
        return Err(std::io::Error::other(format!(
            "{what} refused: {status:?}: {}",
            error_message(&body)
        )));
    }
    Ok(())
}
