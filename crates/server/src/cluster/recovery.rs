//! Failure handling on a server: the work the map asks of it after a failure.
//!
//! - **Restore** (this server is a recovering tablet's restorer): replay this server's own
//!   backup logs of the tablet (every epoch it holds, merged: the newest version of each key
//!   wins, deletes included) into a new engine tablet, move the engine clock well above every
//!   version the dead master can have handed out, and tell the coordinator, which makes this
//!   server the tablet's master. Nothing crosses the network (digest 003 §5).
//! - **Copy** (this server masters a tablet with pending backups): stream the tablet's log (its
//!   live objects in log order, at a snapshot of the tablet), at the tablet's epoch, to each
//!   pending backup over a connection of its own, paced by the clients' latency
//!   ([`crate::cluster::pacing`]), while live writes keep flowing over the regular stream; when
//!   the backup has it all on disk, tell the coordinator. Versions order the copy against the
//!   live writes.
//!
//! Each job runs on a thread of its own, once per (tablet, epoch[, backup]); a failed job is
//! logged and retried when a later map still asks for it. A restore that runs out of memory is
//! not retried on its own: it empties the tablet it was filling (the memory comes back) and
//! reports `RestoreFailed` with the room left, and the coordinator plans the tablet elsewhere
//! or lets it wait until this server has room. [`Jobs::figures`] shows where each one is
//! (`/status`, `ramlog status`).

use crate::cluster::pacing::{AckBaseline, Pacer};
use crate::cluster::Member;
use crate::node::figures::JobFigures;
use crate::node::Node;
use parking_lot::Mutex;
use ramlog_cluster::rpc::{Request, Response};
use ramlog_cluster::{ClusterMap, ServerId, TabletInfo};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The restorer moves its clock this far above the highest version it has seen from any master,
/// so that versions it gives out are above every version the dead master handed out (those
/// that reached other backups and not this one are at most a stream's worth of writes ahead).
pub const VERSION_GAP: u64 = 1 << 32;

/// The longest a restore on a server that mirrors the tablet waits for the mirror's build to
/// end (its memory then serves at once, or is restored in place if the build failed).
const MIRROR_BUILD_WAIT: Duration = Duration::from_secs(600);

/// How long a copy waits at most for the restores of its server to end before it starts.
const RESTORES_FIRST_MAX: Duration = Duration::from_secs(30);

/// Objects a restore replays between two pauses of the test knob `RAMLOG_TEST_RESTORE_PAUSE_MS`.
const RESTORE_PAUSE_EVERY_OBJECTS: u64 = 1024;

/// How long a finished job stays listed.
const KEEP_FINISHED: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Restore,
    /// To a backup, in one of its incarnations (a backup that restarted needs a new copy).
    Copy(ServerId, u64),
}

type Key = (u64, u16, u64, Kind);

/// One job's progress.
#[derive(Debug)]
struct Job {
    last_slot: u16,
    /// Its place in the order jobs were registered (the map's order): among the jobs that wait
    /// for a turn and no client asked for, the lowest goes first.
    seq: u64,
    started: Instant,
    /// False while it waits for its turn (see [`Jobs::restoring`]).
    running: AtomicBool,
    objects: AtomicU64,
    bytes: AtomicU64,
    /// A copy's current pace, bytes per second (see [`crate::cluster::pacing`]); 0 otherwise.
    rate: AtomicU64,
    /// What the job expects to handle: a restore's objects (estimated from the count its
    /// replay announces), a copy's bytes (the tablet's live bytes when it starts); 0 unknown.
    expected: AtomicU64,
    /// When a client first asked for a key of a restore that has not started: it goes first.
    demanded: Mutex<Option<Instant>>,
    done: AtomicBool,
    finished: Mutex<Option<Instant>>,
    error: Mutex<String>,
}

/// The restores and copies of one server.
#[derive(Default)]
pub struct Jobs {
    jobs: Mutex<BTreeMap<Key, Arc<Job>>>,
    /// Restores running at once: one per two cores ([`restores_at_once`]).
    restoring: Gate,
    /// Copies running at once: one (they are background work).
    copying: Gate,
    /// The pace of this server's copies (one at a time), carried from one to the next.
    pacer: Mutex<Pacer>,
    /// The writes' acknowledgement wait without a copy, which copies are held to.
    ack_baseline: Mutex<AckBaseline>,
    /// Demands for slots whose restore was not registered yet (the map that starts it was
    /// being applied): (table, slot, when), at most [`EARLY_DEMANDS_MAX`], for
    /// [`EARLY_DEMAND_KEEP`].
    early: Mutex<Vec<(u64, u16, Instant)>>,
    /// The next job's [`Job::seq`].
    next_seq: AtomicU64,
    /// Replays the recovery partitions of this server share (see [`SharedReplays`]).
    replays: SharedReplays,
}

/// Demands remembered for restores not registered yet, at most.
const EARLY_DEMANDS_MAX: usize = 1024;
/// How long such a demand is remembered.
const EARLY_DEMAND_KEEP: Duration = Duration::from_secs(10);

/// A counting semaphore for job threads that lets demanded jobs in first: among the jobs
/// waiting for a turn, those a client asked for go first (the earliest demand first), then the
/// others in the order they came.
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    freed: parking_lot::Condvar,
}

#[derive(Default)]
struct GateState {
    running: usize,
    waiting: Vec<Arc<Job>>,
}

impl Gate {
    fn enter(&self, limit: usize, job: &Arc<Job>) -> GateGuard<'_> {
        // The order is the jobs' registration order, not the order their threads get here
        // (a loaded machine runs freshly spawned threads in any order).
        let me = job.seq;
        let mut state = self.state.lock();
        state.waiting.push(job.clone());
        loop {
            let first = state
                .waiting
                .iter()
                .min_by_key(|j| {
                    let demanded = *j.demanded.lock();
                    (demanded.is_none(), demanded, j.seq)
                })
                .map(|j| j.seq);
            if state.running < limit.max(1) && first == Some(me) {
                state.waiting.retain(|j| j.seq != me);
                state.running += 1;
                job.running.store(true, Ordering::Release);
                return GateGuard(self);
            }
            self.freed.wait(&mut state);
        }
    }

    /// Wakes the waiters to look again at who goes first.
    fn reorder(&self) {
        let _state = self.state.lock();
        self.freed.notify_all();
    }
}

struct GateGuard<'a>(&'a Gate);

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        self.0.state.lock().running -= 1;
        self.0.freed.notify_all();
    }
}

/// Replays shared by the recovery partitions this server restores from the same logs (the
/// partitions of one dead master's tablet that the coordinator gave it). The first of them to
/// get its turn reads, checks and merges the logs once, for all of them
/// ([`ramlog_backup::GroupedReplay`]); each then takes only its own keys, in its turn (demanded
/// ones first), and is served as soon as they are in. Without this, each partition read and
/// merged the whole logs again, so splitting a tablet multiplied the restore's work.
///
/// Memory: a shared replay holds the logs it read (as a single partition's replay does while it
/// runs) until every partition it covers has taken its keys or is no longer asked of this
/// server; at most [`SHARED_REPLAYS_MAX`] are held at once (a partition that finds no room
/// replays alone, as before).
#[derive(Default)]
struct SharedReplays {
    entries: Mutex<Vec<Arc<SharedReplay>>>,
}

/// Shared replays held at once, at most.
const SHARED_REPLAYS_MAX: usize = 2;

struct SharedReplay {
    table: u64,
    /// The backup store's tablets it reads.
    ids: Vec<u64>,
    /// The partitions it covers, by group: (first slot, last slot, epoch).
    parts: Vec<(u16, u16, u64)>,
    /// None while it is read; then the replay, or why it failed.
    state: Mutex<Option<Result<Arc<ramlog_backup::GroupedReplay>, String>>>,
    ready: parking_lot::Condvar,
    /// Partitions that took their keys (or gave up on them).
    taken: Mutex<Vec<bool>>,
}

impl SharedReplay {
    fn group(&self, t: &TabletInfo) -> Option<usize> {
        self.parts
            .iter()
            .position(|&p| p == (t.first_slot, t.last_slot, t.epoch))
    }

    /// True while some partition that has not taken its keys is still asked of `me` by `map`.
    fn still_needed(&self, map: &ClusterMap, me: ServerId) -> bool {
        let taken = self.taken.lock();
        self.parts.iter().zip(taken.iter()).any(|(p, &done)| {
            !done
                && map.tablets.iter().any(|x| {
                    x.table == self.table
                        && (x.first_slot, x.last_slot, x.epoch) == *p
                        && x.recovering
                        && x.restorer == Some(me)
                })
        })
    }
}

impl SharedReplays {
    /// Drops the shared replays no partition of `map` needs any more.
    fn prune(&self, map: &ClusterMap, me: ServerId) {
        self.entries.lock().retain(|e| e.still_needed(map, me));
    }

    /// Group `g` of `entry` took its keys (or gave up): the replay goes once none is left.
    fn release(&self, entry: &Arc<SharedReplay>, g: usize) {
        let all = {
            let mut taken = entry.taken.lock();
            if let Some(t) = taken.get_mut(g) {
                *t = true;
            }
            taken.iter().all(|&t| t)
        };
        if all {
            self.entries.lock().retain(|e| !Arc::ptr_eq(e, entry));
        }
    }
}

/// What a restore replays: its own keys of a replay it shares with other partitions, or a replay
/// of its own.
enum Replay {
    Shared(Arc<SharedReplay>, usize, Arc<ramlog_backup::GroupedReplay>),
    Alone,
}

/// The shared replay `t` (a recovery partition) takes its keys from, reading it first if no other
/// partition did; [`Replay::Alone`] if `t` shares its logs with no other partition this server
/// restores, or no room is left for another shared replay, or its group was taken before (a
/// restore that failed and starts again).
fn shared_replay(member: &Member, t: &TabletInfo) -> Result<Replay, String> {
    let Some(from) = t.logs_from else {
        return Ok(Replay::Alone);
    };
    let view = member.view();
    let me = view.me;
    let ids = member.backup.log_ids(t, 0..t.epoch);
    let (entry, builder) = {
        let mut entries = member.jobs.replays.entries.lock();
        let found = entries.iter().find(|e| {
            e.table == t.table && e.ids == ids && e.group(t).is_some_and(|g| !e.taken.lock()[g])
        });
        match found {
            Some(e) => (e.clone(), false),
            None => {
                // Every partition of the same logs this server restores at this epoch.
                let parts: Vec<(u16, u16, u64)> = view
                    .map
                    .tablets
                    .iter()
                    .filter(|x| {
                        x.table == t.table
                            && x.logs_from == Some(from)
                            && x.epoch == t.epoch
                            && x.recovering
                            && x.restorer == Some(me)
                            && member.backup.log_ids(x, 0..x.epoch) == ids
                    })
                    .map(|x| (x.first_slot, x.last_slot, x.epoch))
                    .collect();
                if parts.len() < 2 || entries.len() >= SHARED_REPLAYS_MAX {
                    return Ok(Replay::Alone);
                }
                let e = Arc::new(SharedReplay {
                    table: t.table,
                    ids,
                    taken: Mutex::new(vec![false; parts.len()]),
                    parts,
                    state: Mutex::new(None),
                    ready: parking_lot::Condvar::new(),
                });
                entries.push(e.clone());
                (e, true)
            }
        }
    };
    drop(view);
    let Some(g) = entry.group(t) else {
        return Ok(Replay::Alone);
    };
    if builder {
        let slots: Vec<(u16, u16)> = entry.parts.iter().map(|p| (p.0, p.1)).collect();
        tracing::info!(
            table = t.table,
            logs_of = from,
            partitions = slots.len(),
            "replaying the logs once for every partition of them this server restores"
        );
        let result = member
            .backup
            .replay_partitions(&entry.ids, &slots)
            .map(Arc::new)
            .map_err(|e| format!("replaying the backup logs: {e}"));
        if result.is_err() {
            // The next turn of each partition reads them again.
            member
                .jobs
                .replays
                .entries
                .lock()
                .retain(|e| !Arc::ptr_eq(e, &entry));
        }
        *entry.state.lock() = Some(result);
        entry.ready.notify_all();
    }
    let mut state = entry.state.lock();
    loop {
        match &*state {
            Some(Ok(replay)) => return Ok(Replay::Shared(entry.clone(), g, replay.clone())),
            Some(Err(e)) => return Err(e.clone()),
            None => {
                if entry
                    .ready
                    .wait_for(&mut state, Duration::from_millis(200))
                    .timed_out()
                    && !still_restoring(member, t)
                {
                    return Err("the map no longer asks for this restore".into());
                }
            }
        }
    }
}

/// Cores of this machine.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Restores a server runs at once: one per two cores, and at least one. A restore's merge of
/// the logs runs on several threads (`replay_threads`) and its load into memory on one, so one
/// restore keeps about two cores busy; more at once only share the cores, and every tablet
/// among them comes back later. One after another, demanded ones first, the first tablet is
/// served as soon as its own work is done and the last no later than before: on 2 cores with
/// 1 GiB on the dead master (16 tablets over 3 restorers), the first tablet took writes again
/// 0.92 s after the kill against 1.28 s with one restore per core, and the last at the same
/// time (benchmarks.md, recovery run 12). Fewer at once also leave the server's own threads
/// (heartbeats, probes, clients) their share, so that it is not taken for dead while it
/// restores.
fn restores_at_once() -> usize {
    (cores() / 2).max(1)
}

/// A failed job starts again this long after it failed (not at once: a peer that refuses
/// connections would make it fail in a loop).
const RETRY_AFTER: Duration = Duration::from_secs(1);

impl Jobs {
    /// True while a job failed and may be started again (see [`start_jobs`]).
    pub fn any_failed(&self) -> bool {
        self.jobs
            .lock()
            .values()
            .any(|j| j.finished.lock().is_some() && !j.done.load(Ordering::Acquire))
    }

    /// Registers a job unless it runs or finished; None if it should not start.
    fn begin(&self, key: Key, last_slot: u16) -> Option<Arc<Job>> {
        let mut jobs = self.jobs.lock();
        jobs.retain(|_, j| {
            j.finished
                .lock()
                .is_none_or(|t| t.elapsed() < KEEP_FINISHED)
        });
        if let Some(j) = jobs.get(&key) {
            // Running, or done: nothing to do. Failed: start again, once it failed
            // `RETRY_AFTER` ago (the heartbeat loop asks again while any job is failed).
            match *j.finished.lock() {
                None => return None,
                Some(_) if j.done.load(Ordering::Acquire) => return None,
                Some(at) if at.elapsed() < RETRY_AFTER => return None,
                Some(_) => {}
            }
        }
        let demanded = match key.3 {
            Kind::Restore => {
                let mut early = self.early.lock();
                early.retain(|e| e.2.elapsed() < EARLY_DEMAND_KEEP);
                early
                    .iter()
                    .filter(|e| e.0 == key.0 && (key.1..=last_slot).contains(&e.1))
                    .map(|e| e.2)
                    .min()
            }
            Kind::Copy(..) => None,
        };
        let job = Arc::new(Job {
            last_slot,
            seq: self.next_seq.fetch_add(1, Ordering::Relaxed),
            started: Instant::now(),
            running: AtomicBool::new(false),
            objects: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            rate: AtomicU64::new(0),
            expected: AtomicU64::new(0),
            demanded: Mutex::new(demanded),
            done: AtomicBool::new(false),
            finished: Mutex::new(None),
            error: Mutex::new(String::new()),
        });
        jobs.insert(key, job.clone());
        Some(job)
    }

    pub fn figures(&self) -> Vec<JobFigures> {
        self.jobs
            .lock()
            .iter()
            .map(|(&(table, first_slot, epoch, kind), j)| JobFigures {
                kind: match kind {
                    Kind::Restore => "restore",
                    Kind::Copy(..) => "copy",
                },
                table,
                first_slot,
                last_slot: j.last_slot,
                epoch,
                backup: match kind {
                    Kind::Copy(b, _) => Some(b),
                    Kind::Restore => None,
                },
                state: if j.done.load(Ordering::Acquire) {
                    "done"
                } else if j.finished.lock().is_some() {
                    "failed"
                } else if j.running.load(Ordering::Acquire) {
                    match kind {
                        Kind::Restore => "restoring",
                        Kind::Copy(..) => "copying",
                    }
                } else {
                    "waiting"
                },
                objects: j.objects.load(Ordering::Relaxed),
                bytes: j.bytes.load(Ordering::Relaxed),
                rate: j.rate.load(Ordering::Relaxed),
                expected: j.expected.load(Ordering::Relaxed),
                demanded: j.demanded.lock().is_some(),
                millis: j
                    .finished
                    .lock()
                    .map_or(j.started.elapsed(), |t| t.duration_since(j.started))
                    .as_millis() as u64,
                done: j.done.load(Ordering::Acquire),
                error: j.error.lock().clone(),
            })
            .collect()
    }

    /// A client asked for a key in `slot` of `table`, which this server is restoring: the
    /// restore of that slot goes before the others that wait for a turn.
    pub fn demand(&self, table: u64, slot: u16) {
        let mut hurried = false;
        let mut found = false;
        for (&(t, first_slot, _, kind), job) in self.jobs.lock().iter() {
            if t != table || kind != Kind::Restore || !(first_slot..=job.last_slot).contains(&slot)
            {
                continue;
            }
            found = true;
            if job.running.load(Ordering::Acquire) || job.finished.lock().is_some() {
                continue;
            }
            let mut demanded = job.demanded.lock();
            if demanded.is_none() {
                *demanded = Some(Instant::now());
                hurried = true;
                tracing::info!(
                    table,
                    first_slot,
                    slot,
                    "a client waits for this tablet: its restore goes first"
                );
            }
        }
        if hurried {
            self.restoring.reorder();
        }
        if !found {
            // The map that starts this restore is being applied: kept for its registration.
            let mut early = self.early.lock();
            early.retain(|e| e.2.elapsed() < EARLY_DEMAND_KEEP);
            if early.len() < EARLY_DEMANDS_MAX {
                early.push((table, slot, Instant::now()));
            }
        }
    }

    /// A new reading of the writes' cumulative acknowledgement wait (every heartbeat): see
    /// [`AckBaseline`].
    pub fn sample_ack_wait(&self, reading: crate::node::metrics::HistogramSnapshot) {
        let copying = self.copying.state.lock().running > 0;
        self.ack_baseline
            .lock()
            .sample(Instant::now(), reading, copying);
    }

    /// True while a restore of this server runs or waits for its turn.
    fn restores_pending(&self) -> bool {
        self.jobs
            .lock()
            .iter()
            .any(|(&(.., kind), j)| kind == Kind::Restore && j.finished.lock().is_none())
    }

    /// Jobs not finished yet.
    pub fn running(&self) -> usize {
        self.jobs
            .lock()
            .values()
            .filter(|j| j.finished.lock().is_none())
            .count()
    }
}

impl Job {
    fn finish(&self, result: &Result<(), String>) {
        match result {
            Ok(()) => self.done.store(true, Ordering::Release),
            Err(e) => *self.error.lock() = e.clone(),
        }
        *self.finished.lock() = Some(Instant::now());
    }
}

/// Starts the restores and copies `map` asks of this server that are not running.
pub fn start_jobs(node: &Arc<Node>, member: &Arc<Member>, map: &ClusterMap) {
    let me = member.view().me;
    member.jobs.replays.prune(map, me);
    for t in &map.tablets {
        if t.recovering && t.restorer == Some(me) {
            let key = (t.table, t.first_slot, t.epoch, Kind::Restore);
            if let Some(job) = member.jobs.begin(key, t.last_slot) {
                spawn(format!("restore-{}-{}", t.table, t.first_slot), {
                    let (node, member, t) = (node.clone(), member.clone(), t.clone());
                    move || {
                        let result = restore(&node, &member, &t, &job);
                        job.finish(&result);
                    }
                });
            }
        }
        if !t.recovering && t.master == me {
            for &backup in &t.pending {
                let Some(server) = map.server(backup) else {
                    continue;
                };
                let address = server.addresses.native.to_string();
                let key = (
                    t.table,
                    t.first_slot,
                    t.epoch,
                    Kind::Copy(backup, server.epoch),
                );
                if let Some(job) = member.jobs.begin(key, t.last_slot) {
                    spawn(format!("copy-{}-{}-to-{backup}", t.table, t.first_slot), {
                        let (node, member, t) = (node.clone(), member.clone(), t.clone());
                        move || {
                            let result = copy(&node, &member, &t, backup, &address, &job);
                            job.finish(&result);
                        }
                    });
                }
            }
        }
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) {
    if let Err(e) = std::thread::Builder::new().name(name).spawn(f) {
        tracing::error!(error = %e, "cannot start a recovery thread");
    }
}

/// The share of the keys in `t`'s logs that are its own: 1 for a whole tablet; for a recovery
/// partition, its slots over those of every partition split off the same tablet (keys spread
/// evenly over slots, unless hash tags gather them).
fn slot_share(member: &Member, t: &TabletInfo) -> f64 {
    let Some(from) = t.logs_from else {
        return 1.0;
    };
    let view = member.view();
    let last = view
        .map
        .tablets
        .iter()
        .filter(|x| x.table == t.table && x.logs_from == Some(from))
        .map(|x| x.last_slot)
        .max()
        .unwrap_or(t.last_slot);
    let all = f64::from(last.saturating_sub(from)) + 1.0;
    let mine = f64::from(t.last_slot - t.first_slot) + 1.0;
    (mine / all).min(1.0)
}

/// True while the newest map still asks this server to restore `t` at its epoch.
fn still_restoring(member: &Member, t: &TabletInfo) -> bool {
    let view = member.view();
    view.map.tablets.iter().any(|x| {
        x.table == t.table
            && x.first_slot == t.first_slot
            && x.epoch == t.epoch
            && x.recovering
            && x.restorer == Some(view.me)
    })
}

fn restore(
    node: &Arc<Node>,
    member: &Arc<Member>,
    t: &TabletInfo,
    job: &Arc<Job>,
) -> Result<(), String> {
    let started = Instant::now();
    let duty = &**member;
    tracing::warn!(
        table = t.table,
        first_slot = t.first_slot,
        last_slot = t.last_slot,
        epoch = t.epoch,
        dead_master = t.master,
        "restoring a tablet from this server's backup logs"
    );
    if let Some(mirror) = member.mirrors.get(t.table, t.first_slot) {
        // This server mirrors the tablet: its memory holds it already, or will once its build
        // ends. The restore in place below may only start after that: the build loads the
        // tablet in bulk, without index lookups, and nothing else may install into it meanwhile.
        let waited = Instant::now();
        let ready = loop {
            match mirror.wait_ready(Duration::from_secs(10)) {
                Err(e) if e.contains("still being built") => {
                    if waited.elapsed() >= MIRROR_BUILD_WAIT {
                        return Err(format!(
                            "the mirror's memory is still being built after {} s",
                            MIRROR_BUILD_WAIT.as_secs()
                        ));
                    }
                    if !still_restoring(member, t) {
                        return Err("the map no longer asks for this restore".into());
                    }
                }
                other => break other,
            }
        };
        match ready {
            Ok(()) => return promote_mirror(node, member, t, &mirror, started),
            Err(e) => tracing::error!(
                table = t.table,
                first_slot = t.first_slot,
                error = %e,
                "the mirror's memory is not usable; restoring from the logs instead"
            ),
        }
    }
    if let Some(ms) = std::env::var("RAMLOG_TEST_RESTORE_DELAY_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        // Test knob: a slow restore, so that a test can kill the restorer during it.
        std::thread::sleep(Duration::from_millis(ms));
    }
    // Test knob: a pause after every `RESTORE_PAUSE_EVERY_OBJECTS` objects replayed, so that a
    // test can kill the restorer while it replays.
    let pause = std::env::var("RAMLOG_TEST_RESTORE_PAUSE_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis);
    let waiting_since = Instant::now();
    let _turn = member.jobs.restoring.enter(restores_at_once(), job);
    if !still_restoring(member, t) {
        return Err("the map no longer asks for this restore".into());
    }
    let replay = shared_replay(member, t)?;
    // A shared replay counts each partition's own keys; a replay of its own counts every key of
    // the logs, of which the partition's slots hold their share.
    let share = match replay {
        Replay::Shared(..) => 1.0,
        Replay::Alone => slot_share(member, t),
    };
    let tablet = member.engine_tablet(node, t)?;
    // A mirror's tablet whose memory could not be used is restored in place; it is this
    // server's own from now on.
    node.keyspace.set_hidden(tablet, false);
    let engine = node.engine();
    // The logs hold every acknowledged write, deletes included, and the restore leaves exactly
    // what they hold. Whatever the engine tablet held before goes first: the memory of a move
    // this server was the target of and that was rolled back, a mirror's memory that could not
    // be used, a restore here that stopped half-way. A key deleted since that memory was written
    // would otherwise come back, as the replay only adds keys.
    let stale = engine
        .clear_tablet(tablet)
        .map_err(|e| format!("emptying the tablet before the restore: {e}"))?;
    if stale > 0 {
        tracing::warn!(
            table = t.table,
            first_slot = t.first_slot,
            objects = stale,
            "the tablet held objects from before the restore; they were dropped"
        );
    }
    let announce = |count: u64| -> u64 {
        // The logs of a tablet this one was split off hold other slots' keys too.
        let expected = (count as f64 * share).ceil() as u64;
        job.expected.store(expected, Ordering::Relaxed);
        tracing::info!(
            table = t.table,
            first_slot = t.first_slot,
            last_slot = t.last_slot,
            expected,
            waited_ms = waiting_since.elapsed().as_millis() as u64,
            "restoring"
        );
        expected
    };
    // The test knob's pause, once per `RESTORE_PAUSE_EVERY_OBJECTS` objects replayed.
    let paced = |before: u64, after: u64| {
        if let Some(p) = pause {
            if after / RESTORE_PAUSE_EVERY_OBJECTS > before / RESTORE_PAUSE_EVERY_OBJECTS {
                std::thread::sleep(p);
            }
        }
    };
    // A replay of its own streams into the engine tablet: the replay's threads hand their
    // checked entries to the engine as they read them, and its index keeps the newest version
    // of each key, so there is no merge map to fill, sort and read back before the load. Damaged
    // logs are replayed again through the merge (below), which never restores a key at an older
    // version in place of a newer one it lost.
    let mut streamed_report = None;
    if matches!(replay, Replay::Alone) {
        let sink = super::bulk_sink::NewestSink::new(
            engine,
            tablet,
            &job.objects,
            &job.bytes,
            |count| {
                announce(count);
            },
            |after, taken| paced(after - taken, after),
        );
        let result = duty.backup.replay_streamed_for_restore(t, t.epoch, &sink);
        if let Some(e) = sink.error() {
            let reason = format!("restoring into memory: {e}");
            if matches!(e, ramlog_logmem::EngineError::OutOfMemory { .. }) {
                return out_of_memory(node, member, t, tablet, job, reason);
            }
            return Err(reason);
        }
        let streamed = result.map_err(|e| format!("replaying the backup logs: {e}"))?;
        if streamed.trusted {
            streamed_report = Some(streamed.report);
        } else {
            tracing::warn!(
                table = t.table,
                first_slot = t.first_slot,
                report = ?streamed.report,
                "the backup logs of the tablet are damaged; replaying them through the merge"
            );
            engine
                .clear_tablet(tablet)
                .map_err(|e| format!("emptying the tablet for a merged replay: {e}"))?;
            job.objects.store(0, Ordering::Relaxed);
            job.bytes.store(0, Ordering::Relaxed);
        }
    }
    let report = match streamed_report {
        Some(report) => report,
        None => match merged_restore(duty, t, &replay, (engine, tablet), job, &announce, &paced) {
            Ok(report) => report,
            Err(MergedFailure::Memory(reason)) => {
                return out_of_memory(node, member, t, tablet, job, reason)
            }
            Err(MergedFailure::Other(reason)) => return Err(reason),
        },
    };
    drop(replay);
    if !report.is_clean() {
        tracing::error!(
            table = t.table,
            first_slot = t.first_slot,
            ?report,
            "the backup logs of the tablet are damaged: some keys may be missing or older"
        );
    }
    let floor = report
        .max_version
        .max(duty.backup.max_version_seen())
        .saturating_add(VERSION_GAP);
    engine.advance_clock(floor);
    // A streamed replay counted every candidate it took, older versions included; the tablet
    // holds the newest of each key.
    let objects = engine
        .tablets()
        .iter()
        .find(|i| i.id == tablet)
        .map_or_else(|| job.objects.load(Ordering::Relaxed), |i| i.objects);
    job.objects.store(objects, Ordering::Relaxed);
    let millis = started.elapsed().as_millis() as u64;
    tracing::warn!(
        table = t.table,
        first_slot = t.first_slot,
        objects,
        millis,
        "tablet restored; asking the coordinator to make this server its master"
    );
    report_recovered(member, t, objects, millis)
}

/// Why a merged restore failed: memory ran out, or anything else.
enum MergedFailure {
    Memory(String),
    Other(String),
}

/// The restore of a merged replay (a share of a replay read for several partitions, or damaged
/// logs): the replay yields each key once with its newest version, and the engine's bulk loader
/// appends them in batches and grows the index once, for the count the replay announces.
/// `announce` hears that count (and gives the partition's share of it); `paced` the objects
/// replayed before and after each one.
fn merged_restore(
    duty: &Member,
    t: &TabletInfo,
    replay: &Replay,
    (engine, tablet): (&ramlog_logmem::Engine, ramlog_logmem::TabletId),
    job: &Job,
    announce: &dyn Fn(u64) -> u64,
    paced: &dyn Fn(u64, u64),
) -> Result<ramlog_backup::ReplayReport, MergedFailure> {
    let mut sink = super::bulk_sink::BulkSink::new(engine, tablet);
    let mut on_replayed = |r: ramlog_backup::Replayed<'_>| match r {
        ramlog_backup::Replayed::Count(count) => sink.start(announce(count)),
        ramlog_backup::Replayed::Entry(e) => {
            // After a failure the rest of the replay only reads: the restore has failed.
            if !sink.push(&e) {
                return;
            }
            let objects = job.objects.fetch_add(1, Ordering::Relaxed) + 1;
            paced(objects - 1, objects);
            job.bytes
                .fetch_add((e.key.len() + e.value.len()) as u64, Ordering::Relaxed);
        }
    };
    let report = match replay {
        Replay::Shared(entry, g, shared) => {
            on_replayed(ramlog_backup::Replayed::Count(shared.len(*g)));
            let taken = shared.take(*g, &mut |e| on_replayed(ramlog_backup::Replayed::Entry(e)));
            duty.jobs.replays.release(entry, *g);
            if taken.is_none() {
                return Err(MergedFailure::Other(
                    "the partition's keys were taken by another restore".into(),
                ));
            }
            shared.report()
        }
        Replay::Alone => duty
            .backup
            .replay_for_restore_counted(t, t.epoch, on_replayed)
            .map_err(|e| MergedFailure::Other(format!("replaying the backup logs: {e}")))?,
    };
    sink.finish().map_err(|e| {
        let reason = format!("restoring into memory: {e}");
        if matches!(e, ramlog_logmem::EngineError::OutOfMemory { .. }) {
            MergedFailure::Memory(reason)
        } else {
            MergedFailure::Other(reason)
        }
    })?;
    Ok(report)
}

/// A restore that ran out of memory: empties the engine tablet it filled (its memory comes
/// back as the cleaner runs; the tablet itself stays, for a later restore), then tells the
/// coordinator, with the room this server has after that, so that it plans the tablet on a
/// backup with room or lets it wait. Returns the failure.
fn out_of_memory(
    node: &Arc<Node>,
    member: &Arc<Member>,
    t: &TabletInfo,
    tablet: ramlog_logmem::TabletId,
    job: &Arc<Job>,
    reason: String,
) -> Result<(), String> {
    let removed = node
        .engine()
        .clear_tablet(tablet)
        .map_err(|e| format!("{reason}; emptying the tablet failed: {e}"))?;
    let room_bytes = crate::cluster::restore_room_bytes(node);
    tracing::error!(
        table = t.table,
        first_slot = t.first_slot,
        epoch = t.epoch,
        restored = job.objects.load(Ordering::Relaxed),
        removed,
        room_mib = room_bytes >> 20,
        %reason,
        "the restore ran out of memory: emptied what it restored; telling the coordinator"
    );
    let me = member.view().me;
    report_until_done(member, || {
        still_restoring(member, t).then(|| Request::RestoreFailed {
            server: me,
            table: t.table,
            first_slot: t.first_slot,
            epoch: t.epoch,
            reason: reason.clone(),
            room_bytes,
        })
    })?;
    Err(reason)
}

/// The restore of a tablet this server mirrors: no replay, only the clock moved above every
/// version the dead master can have handed out, and the report.
fn promote_mirror(
    node: &Arc<Node>,
    member: &Arc<Member>,
    t: &TabletInfo,
    mirror: &crate::cluster::mirror::MirrorTablet,
    started: Instant,
) -> Result<(), String> {
    let duty = &**member;
    if !still_restoring(member, t) {
        return Err("the map no longer asks for this restore".into());
    }
    let engine = node.engine();
    let floor = duty
        .backup
        .max_version_seen()
        .max(engine.clock())
        .saturating_add(VERSION_GAP);
    engine.advance_clock(floor);
    node.keyspace.set_hidden(mirror.engine_tablet, false);
    let objects = engine
        .tablets()
        .iter()
        .find(|i| i.id == mirror.engine_tablet)
        .map_or(0, |i| i.objects);
    let millis = started.elapsed().as_millis() as u64;
    tracing::warn!(
        table = t.table,
        first_slot = t.first_slot,
        objects,
        millis,
        "mirror taking over the tablet; asking the coordinator to make this server its master"
    );
    report_recovered(member, t, objects, millis)
}

/// Tells the coordinator that this server holds the recovering tablet `t` now (until it takes
/// the report or the map no longer asks for this restore).
fn report_recovered(
    member: &Arc<Member>,
    t: &TabletInfo,
    objects: u64,
    millis: u64,
) -> Result<(), String> {
    let me = member.view().me;
    let reported = report_until_done(member, || {
        if !still_restoring(member, t) {
            return None;
        }
        Some(Request::Recovered {
            server: me,
            table: t.table,
            first_slot: t.first_slot,
            epoch: t.epoch,
            objects,
            millis,
        })
    });
    // The coordinator answers once the change is committed: the map that makes this server the
    // tablet's master is there to fetch now. Without asking, it came with the next regular
    // heartbeat, up to `heartbeat_interval_ms` later, while clients got `-TRYAGAIN` for a
    // tablet that was ready.
    if reported.is_ok() {
        member.refresh_map_soon();
    }
    reported
}

/// Sends the request `make` builds until the coordinator takes it or `make` says it is moot.
/// Job threads are not the runtime's: each attempt runs on a small runtime of its own with a
/// connection of its own (a connection belongs to the runtime that opened it).
fn report_until_done(
    member: &Arc<Member>,
    make: impl Fn() -> Option<Request>,
) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime to report: {e}"))?;
    loop {
        let Some(request) = make() else {
            return Err("the map no longer asks for it".into());
        };
        let client = ramlog_cluster::rpc::CoordinatorClient::new(
            member.coordinator().addresses().to_vec(),
            Duration::from_secs(3),
        );
        let answer = runtime.block_on(async { client.call(&request).await });
        match answer {
            Ok(Response::Noted) => return Ok(()),
            Ok(other) => return Err(format!("unexpected answer {other:?}")),
            Err(e) if Instant::now() > deadline => {
                return Err(format!("the coordinator did not take the report: {e}"))
            }
            Err(e) => {
                tracing::warn!(error = %e, "reporting to the coordinator failed; retrying");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn copy(
    node: &Arc<Node>,
    member: &Arc<Member>,
    t: &TabletInfo,
    backup: ServerId,
    address: &str,
    job: &Arc<Job>,
) -> Result<(), String> {
    let duty = &**member;
    let tablet = member
        .created_tablet(t.table, t.first_slot)
        .ok_or("the tablet is not in memory here")?;
    let table = u32::try_from(t.table).map_err(|_| "table id out of range".to_string())?;
    let head = ramlog_proto::repl::UnitHead {
        table,
        first_slot: t.first_slot,
        last_slot: t.last_slot,
        epoch: t.epoch,
        count: 0,
    };
    let rate = node.config.recovery_copy_bytes_per_sec;
    // Restores first: a copy waits while this server restores (or has restores waiting for a
    // turn) and while any tablet of the cluster is recovering, so that re-protection does not
    // slow down the tablets clients are waiting for (the restorers read their logs, and their
    // backups take copies; on one machine they share its cores too); the copy's tablet is
    // served meanwhile and its live writes reach every backup.
    let deadline = Instant::now() + RESTORES_FIRST_MAX;
    let recovering = || member.view().map.tablets.iter().any(|t| t.recovering);
    while (member.jobs.restores_pending() || recovering()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _turn = member.jobs.copying.enter(1, job);
    if let Some(&live) = node.engine().live_bytes_by_tablet().get(tablet as usize) {
        job.expected.store(live, Ordering::Relaxed);
    }
    let started = Instant::now();
    let mut pacer = member.jobs.pacer.lock();
    let readings = || {
        (
            node.metrics.latency_all(),
            duty.replication.ack_latency_all(),
        )
    };
    let baseline = member.jobs.ack_baseline.lock().baseline_ns();
    pacer.begin(readings(), baseline, rate);
    job.rate.store(pacer.rate(), Ordering::Relaxed);
    let copied = duty.replication.copy_tablet(
        node.engine(),
        tablet,
        head,
        address,
        |sent| {
            pacer.sent(sent, readings);
            job.rate.store(pacer.rate(), Ordering::Relaxed);
        },
        &job.objects,
        &job.bytes,
        || still_master(member, t, backup),
    )?;
    tracing::info!(
        table = t.table,
        first_slot = t.first_slot,
        backup,
        objects = copied,
        millis = started.elapsed().as_millis() as u64,
        slowed_windows = pacer.slowed(),
        foreground_p99_target_us = pacer.target_us(),
        ack_wait_target_us = pacer.ack_target_us(),
        "tablet copied to a backup"
    );
    drop(pacer);
    let me = member.view().me;
    report_until_done(member, || {
        still_master(member, t, backup).then_some(Request::CopyDone {
            server: me,
            table: t.table,
            first_slot: t.first_slot,
            epoch: t.epoch,
            backup,
        })
    })
}

/// True while the newest map has this server master `t` at its epoch with `backup` pending.
fn still_master(member: &Member, t: &TabletInfo, backup: ServerId) -> bool {
    let view = member.view();
    view.map.tablets.iter().any(|x| {
        x.table == t.table
            && x.first_slot == t.first_slot
            && x.epoch == t.epoch
            && !x.recovering
            && x.master == view.me
            && x.pending.contains(&backup)
    })
}
