//! What survives a kill -9 of the real `ramlog server` (`common/process.rs`) with writes in flight
//! over the native protocol. In `durable` persistence an OK means on disk: every acknowledged put is
//! back after the restart (same value, version at least the acknowledged one) and every
//! acknowledged delete stays deleted, unless a later write that was in flight at the kill (never
//! answered) took effect. In `async` persistence the same holds for writes acknowledged more than
//! a second before the kill (the store writes and fdatasyncs every 100 ms).

mod common;

use common::process::ServerProcess;
use ramlog_client::{Client, ClientConfig, Error};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Writer tasks; each owns its keys, so the writes to one key are issued one after another.
const TASKS: usize = 12;
const KEYS_PER_TASK: usize = 64;
/// Async persistence promises writes acknowledged this long before a crash (flush period 100 ms).
const ASYNC_MARGIN: Duration = Duration::from_secs(1);

fn key(task: usize, i: usize) -> Vec<u8> {
    format!("dur:{task}:{i}").into_bytes()
}

/// The value of a task's `seq`-th write: distinct for every write of a key, 8 to ~600 bytes.
fn value(task: usize, seq: u64) -> Vec<u8> {
    let mut v = format!("t{task}s{seq}:").into_bytes();
    let pad = (seq.wrapping_mul(2_654_435_761) % 600) as usize;
    v.extend(std::iter::repeat_n(b'a' + (seq % 26) as u8, pad));
    v
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    /// A put of `value(task, seq)`.
    Put(u64),
    Delete,
}

#[derive(Clone, Copy, Debug)]
enum Outcome {
    /// Answered OK at `at`; `version` is the put's version (for a delete, the delete's version or
    /// None when the key was absent).
    Acked { version: Option<u64>, at: Instant },
    /// Sent while the server was killed: it may or may not have taken effect.
    Unknown,
}

#[derive(Clone, Debug)]
struct Op {
    kind: Kind,
    outcome: Outcome,
}

/// What a key holds.
#[derive(Clone, Debug, PartialEq)]
enum State {
    Absent,
    Present { value: Vec<u8>, version: u64 },
}

/// A key's state as last read back from the server, and the writes issued since.
#[derive(Clone, Debug)]
struct History {
    base: State,
    ops: Vec<Op>,
}

/// One writer task's keys and the next sequence number of its values.
struct TaskState {
    task: usize,
    next_seq: u64,
    rng: u64,
    keys: Vec<History>,
}

impl TaskState {
    fn new(task: usize) -> TaskState {
        TaskState {
            task,
            next_seq: 0,
            rng: 0x9E37_79B9_7F4A_7C15 ^ (task as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03),
            keys: vec![
                History {
                    base: State::Absent,
                    ops: Vec::new(),
                };
                KEYS_PER_TASK
            ],
        }
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Writes (three puts to one delete, on random keys of this task) until `stop` is set, recording
/// every write and its answer. An error before `stop` is set fails the test: nothing else should
/// go wrong while the server runs.
async fn writer(
    client: Client,
    mut st: TaskState,
    stop: Arc<AtomicBool>,
    in_flight: Arc<AtomicUsize>,
) -> Result<TaskState, String> {
    while !stop.load(Ordering::SeqCst) {
        let r = st.next_random();
        let i = (r % KEYS_PER_TASK as u64) as usize;
        let k = key(st.task, i);
        // Counted from before the request is sent until its answer is back, so that a kill
        // can wait for a moment with writes in flight.
        in_flight.fetch_add(1, Ordering::SeqCst);
        let (kind, result) = if (r >> 32).is_multiple_of(4) {
            (Kind::Delete, client.delete(&k).await)
        } else {
            let seq = st.next_seq;
            st.next_seq += 1;
            (
                Kind::Put(seq),
                client.put(&k, &value(st.task, seq)).await.map(Some),
            )
        };
        in_flight.fetch_sub(1, Ordering::SeqCst);
        let outcome = match result {
            Ok(version) => Outcome::Acked {
                version,
                at: Instant::now(),
            },
            Err(e) if stop.load(Ordering::SeqCst) && !matches!(e, Error::WritesRefused(_)) => {
                Outcome::Unknown
            }
            Err(e) => {
                return Err(format!(
                    "{kind:?} of {} failed while the server ran: {e}",
                    String::from_utf8_lossy(&k)
                ))
            }
        };
        st.keys[i].ops.push(Op { kind, outcome });
        if matches!(outcome, Outcome::Unknown) {
            break;
        }
    }
    Ok(st)
}

/// The state `op` leaves a key of `task` in (for a put whose version is unknown, version 0).
fn state_after(task: usize, op: &Op) -> State {
    match (op.kind, op.outcome) {
        (Kind::Delete, _) => State::Absent,
        (Kind::Put(seq), Outcome::Acked { version, .. }) => State::Present {
            value: value(task, seq),
            version: version.expect("a put has a version"),
        },
        (Kind::Put(seq), Outcome::Unknown) => State::Present {
            value: value(task, seq),
            version: 0,
        },
    }
}

/// Whether `found` is a state the key may be in after the restart: the state after the last write
/// that must be on disk (`must`: index into `h.ops`, or None for `h.base`), or the state after any
/// later write (which may or may not have reached the disk).
fn allowed(task: usize, h: &History, must: Option<usize>, found: &State) -> bool {
    let must_state = match must {
        Some(i) => state_after(task, &h.ops[i]),
        None => h.base.clone(),
    };
    let must_version = match &must_state {
        State::Present { version, .. } => *version,
        State::Absent => 0,
    };
    let later = &h.ops[must.map_or(0, |i| i + 1)..];
    let matches = |expected: &State, floor: u64| match (expected, found) {
        (State::Absent, State::Absent) => true,
        (
            State::Present { value: v, version },
            State::Present {
                value: fv,
                version: fver,
            },
        ) => v == fv && *fver >= (*version).max(floor),
        _ => false,
    };
    matches(&must_state, 0)
        || later
            .iter()
            .any(|op| matches(&state_after(task, op), must_version + 1))
}

/// Reads every key back after a restart and checks it against its history; `must(history)` names
/// the last write of each key that has to be on disk. The keys' bases become what was read.
async fn check_and_rebase(
    client: &Client,
    tasks: &mut [TaskState],
    must: impl Fn(&History) -> Option<usize>,
    what: &str,
) {
    let mut wrong = Vec::new();
    let mut checked_writes = 0usize;
    for st in tasks.iter_mut() {
        for i in 0..KEYS_PER_TASK {
            let k = key(st.task, i);
            let found = match client.get(&k).await.expect("GET after the restart") {
                Some(o) => State::Present {
                    value: o.value.to_vec(),
                    version: o.version,
                },
                None => State::Absent,
            };
            let h = &st.keys[i];
            let m = must(h);
            checked_writes += m.is_some() as usize;
            if !allowed(st.task, h, m, &found) {
                let expected = match m {
                    Some(j) => format!("{:?} {:?}", h.ops[j].kind, h.ops[j].outcome),
                    None => format!("{:?}", short(&h.base)),
                };
                let later: Vec<String> = h.ops[m.map_or(0, |j| j + 1)..]
                    .iter()
                    .map(|op| format!("{:?} {:?}", op.kind, op.outcome))
                    .collect();
                wrong.push(format!(
                    "{}: found {:?}; the write that must be on disk: {expected}; later writes: {later:?}",
                    String::from_utf8_lossy(&k),
                    short(&found),
                ));
            }
            st.keys[i] = History {
                base: found,
                ops: Vec::new(),
            };
        }
    }
    assert!(
        wrong.is_empty(),
        "{what}: {} of {} keys are not as acknowledged after kill -9 and restart, e.g.:\n{}",
        wrong.len(),
        tasks.len() * KEYS_PER_TASK,
        wrong[..wrong.len().min(10)].join("\n")
    );
    assert!(
        checked_writes > 0,
        "{what}: no write was old enough to check"
    );
}

/// A state with its value cut to the part that names the write.
fn short(s: &State) -> String {
    match s {
        State::Absent => "absent".into(),
        State::Present { value, version } => {
            let v = String::from_utf8_lossy(value);
            format!("{} v{version}", v.split(':').next().unwrap_or(""))
        }
    }
}

async fn connect(server: &ServerProcess) -> Client {
    let mut config = ClientConfig::new(server.addr());
    config.connections = 4;
    config.request_timeout = Duration::from_secs(10);
    Client::connect(config).await.expect("connect")
}

/// Starts the writers, lets them write for `run`, sets their stop flag and kills the server with
/// writes in flight; returns the tasks' records and the kill time. The server is left dead.
async fn write_then_kill(
    server: &mut ServerProcess,
    tasks: Vec<TaskState>,
    run: Duration,
) -> (Vec<TaskState>, Instant) {
    write_for(server, tasks, run, true).await
}

/// Runs the writers for `run`, then stops them; with `kill`, kills the server with writes in
/// flight at that moment (it is left dead), otherwise lets every write in flight complete.
async fn write_for(
    server: &mut ServerProcess,
    tasks: Vec<TaskState>,
    run: Duration,
    kill: bool,
) -> (Vec<TaskState>, Instant) {
    let client = connect(server).await;
    let stop = Arc::new(AtomicBool::new(false));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = tasks
        .into_iter()
        .map(|st| tokio::spawn(writer(client.clone(), st, stop.clone(), in_flight.clone())))
        .collect();
    tokio::time::sleep(run).await;
    if kill {
        // The writers share group commits: at the moment one ends, all of them may be between
        // two writes, and a kill then finds none in flight. Wait (briefly) for one that is.
        let deadline = Instant::now() + Duration::from_secs(2);
        while in_flight.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            tokio::task::yield_now().await;
        }
    }
    stop.store(true, Ordering::SeqCst);
    let killed_at = Instant::now();
    if kill {
        server.kill();
    }
    let mut tasks = Vec::new();
    for h in handles {
        match h.await.expect("writer task") {
            Ok(st) => tasks.push(st),
            Err(e) => panic!("{e}"),
        }
    }
    (tasks, killed_at)
}

/// The last write of a key's history that was acknowledged (every durable acknowledgement holds).
fn last_acked(h: &History) -> Option<usize> {
    h.ops
        .iter()
        .rposition(|op| matches!(op.outcome, Outcome::Acked { .. }))
}

fn count(tasks: &[TaskState], f: impl Fn(&Op) -> bool) -> usize {
    tasks
        .iter()
        .flat_map(|st| st.keys.iter().flat_map(|h| h.ops.iter()))
        .filter(|op| f(op))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_acknowledged_writes_survive_kill_9_with_writes_in_flight() {
    let mut server = ServerProcess::start(&["--persistence", "durable"]).await;
    let mut tasks: Vec<TaskState> = (0..TASKS).map(TaskState::new).collect();
    // Three kill points; each round writes on top of what the previous ones left on disk.
    for (round, run) in [100u64, 500, 1500].into_iter().enumerate() {
        let (mut done, _) = write_then_kill(&mut server, tasks, Duration::from_millis(run)).await;
        let acked = count(&done, |op| matches!(op.outcome, Outcome::Acked { .. }));
        let in_flight = count(&done, |op| matches!(op.outcome, Outcome::Unknown));
        assert!(
            acked > 0,
            "round {round}: no write was acknowledged in {run} ms"
        );
        assert!(
            in_flight > 0,
            "round {round}: no write was in flight at the kill, so the kill point tested nothing"
        );
        server.restart().await;
        let client = connect(&server).await;
        check_and_rebase(
            &client,
            &mut done,
            last_acked,
            &format!(
                "durable, kill after {run} ms ({acked} writes acknowledged, {in_flight} in flight)"
            ),
        )
        .await;
        tasks = done;
    }
}

/// The backup store frees what grows with the keys once it is at rest (nothing appended for a
/// second): it spills every version buffer to its version log and drops the reorganizer's
/// version tables. Writes after such a rest, and the kill, must still leave every acknowledged
/// write (and no deleted key) behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_writes_survive_kill_9_after_the_store_came_to_rest() {
    let mut server = ServerProcess::start(&["--persistence", "durable"]).await;
    let tasks: Vec<TaskState> = (0..TASKS).map(TaskState::new).collect();
    let (tasks, _) = write_for(&mut server, tasks, Duration::from_millis(800), false).await;
    let rested = count(&tasks, |op| matches!(op.outcome, Outcome::Acked { .. }));
    assert!(rested > 0, "no write was acknowledged before the rest");
    // The store comes to rest a second after the last append; wait (bounded) until the memory
    // account shows that it let go of its version buffers and tables.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let metrics = admin_get(server.admin_port, "/metrics");
        let part = |name: &str| {
            metrics
                .lines()
                .find_map(|l| {
                    l.strip_prefix(&format!("ramlog_memory_part_bytes{{part=\"{name}\"}} "))
                })
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {name} part in /metrics"))
        };
        if part("backup_version_buffers") == 0 && part("backup_version_caches") == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the store did not come to rest within 15 s of the last write"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (mut done, _) = write_then_kill(&mut server, tasks, Duration::from_millis(800)).await;
    let acked = count(&done, |op| matches!(op.outcome, Outcome::Acked { .. }));
    assert!(acked > rested, "no write was acknowledged after the rest");
    server.restart().await;
    let client = connect(&server).await;
    check_and_rebase(
        &client,
        &mut done,
        last_acked,
        &format!("durable, kill after a rest ({rested} writes before it, {acked} in all)"),
    )
    .await;
}

/// GET on the server's admin port; the body.
fn admin_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("admin port");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).expect("admin reply");
    text.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_writes_acknowledged_a_second_before_kill_9_survive() {
    let mut server = ServerProcess::start(&["--persistence", "async"]).await;
    let tasks: Vec<TaskState> = (0..TASKS).map(TaskState::new).collect();
    let (mut done, killed_at) = write_then_kill(&mut server, tasks, Duration::from_secs(3)).await;
    let deadline = killed_at - ASYNC_MARGIN;
    let old_enough = count(
        &done,
        |op| matches!(op.outcome, Outcome::Acked { at, .. } if at <= deadline),
    );
    assert!(
        old_enough > 0,
        "no write was acknowledged more than {ASYNC_MARGIN:?} before the kill"
    );
    server.restart().await;
    let client = connect(&server).await;
    let last_old_enough = |h: &History| {
        h.ops
            .iter()
            .rposition(|op| matches!(op.outcome, Outcome::Acked { at, .. } if at <= deadline))
    };
    check_and_rebase(
        &client,
        &mut done,
        last_old_enough,
        &format!(
            "async ({old_enough} writes acknowledged more than {ASYNC_MARGIN:?} before the kill)"
        ),
    )
    .await;
}
