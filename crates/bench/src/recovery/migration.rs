//! `ramlog bench migration`: one server's share of data moved to another while clients write,
//! ramlog (`ramlog cluster move`) against Redis Cluster (`redis-cli --cluster reshard`) in the
//! same run.
//!
//! ramlog: a coordinator and 4 servers (R = 2, `sync`, `ramlog up`'s defaults otherwise). The
//! master of slot 0 gets `RAMLOG_BENCH_MIGRATION_MIB` MiB of values spread over those of its
//! tablets that one other server (the target) does not back up; they all move to the target
//! (a server joining the cluster, as it were) while the load of [`super::Load`]
//! (4 threads, one write in flight each, over 10 000 keys of every slot) runs against every
//! server. Redis Cluster: 4 masters + 4 replicas; the master of slot 0 is preloaded with the
//! same bytes over its slots, and all its slots are resharded to the master of slot 16383 with
//! `redis-cli --cluster reshard --cluster-pipeline 1000` under the same load.
//!
//! Per run: the migration's rate (preloaded value bytes over the time from the command to its
//! end), the load's throughput and latency percentiles in the 2 s before and during the move,
//! the longest interval in which no write to the moved slots was acknowledged (the longest any
//! key was unavailable, at the load's resolution: the same figure before the move is printed
//! beside it), the failed attempts by kind, and lost writes (every load key and 10 000 preloaded
//! keys read back). The rows are medians over `RAMLOG_BENCH_MIGRATION_REPEATS` runs (losses and
//! failures: the largest).
//!
//! **Split and merge** (ramlog only: Redis Cluster's slots do not split): the same cluster and
//! load (the coordinator's own splits and merges off, `--split-mib 0`); the tablet of slot 0 holds
//! `RAMLOG_BENCH_SPLIT_MIB` MiB of values (16 quick, 128 full) and is split in two with
//! `ramlog cluster split` under the load, then, once both halves are copied to the backups, merged
//! back with `ramlog cluster merge` under the load. Rows for each step: its time (command to the
//! new tablets serving), the longest interval without an acknowledged write to its slots, the
//! load's throughput during it over before, the time until every backup holds the new tablets'
//! fresh copies (the re-protection the step costs), lost writes.

use super::client::{call, encode, fetch_map, Conn, Nodes, Reply};
use super::load::{Load, LoadResult, Window, LOAD_KEYS, THREADS};
use super::process::wait_until;
use super::progress::Progress;
use super::ramlog::{run_tool, RamlogCluster};
use super::readback::read_keys;
use super::redis::{redis_cluster, require_tools};
use crate::report::{Report, Row, Target};
use anyhow::{bail, Context};
use ramlog_common::{key_slot, SLOT_COUNT};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Servers of the ramlog cluster: with R = 2, exactly one is neither master nor backup of a
/// tablet, the target.
const SERVERS: usize = 4;
/// Preloaded keys read back after each move.
const SAMPLE_KEYS: u64 = 10_000;
/// Pipelined SETs per batch of the preload, batches in flight per connection, connections.
const PRELOAD_BATCH: usize = 1000;
const PRELOAD_WINDOW: usize = 4;
const PRELOAD_CONNS: usize = 4;
/// The load's window before the move, and how long it runs on after.
const BEFORE: Duration = Duration::from_secs(2);
const AFTER: Duration = Duration::from_secs(1);
/// Redis Cluster's node timeout here: no failover is wanted, only the reshard.
const REDIS_NODE_TIMEOUT_MS: u64 = 5000;

/// What one migration run measured.
#[derive(Debug, Clone)]
struct Run {
    /// Value bytes preloaded into what moved.
    bytes: u64,
    took: Duration,
    before: Window,
    during: Window,
    /// Longest interval without an acknowledged write to the moved slots, during the move (and
    /// 1 s after), and the same over the 2 s before it.
    gap: Duration,
    gap_before: Duration,
    /// Failed attempts by kind (redirections `moved` and `ask` included).
    errors: BTreeMap<String, u64>,
    lost_writes: u64,
    checked: u64,
    /// Preloaded keys read back with a wrong or no value.
    preload_wrong: u64,
}

impl Run {
    fn mb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e6 / self.took.as_secs_f64().max(1e-9)
    }

    /// Failed attempts: every error but a redirection (`moved`, `ask`) or `tryagain` (which
    /// Redis Cluster clients retry by themselves: redis-py, Jedis, go-redis, Lettuce).
    fn failed(&self) -> u64 {
        self.errors
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "moved" | "ask" | "tryagain"))
            .map(|(_, n)| n)
            .sum()
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// A hash tag per slot: `tags[s]` is a string whose slot, as `{tag}`, is `s`.
pub(super) fn slot_tags() -> Vec<String> {
    let mut tags = vec![String::new(); SLOT_COUNT as usize];
    let mut left = SLOT_COUNT as usize;
    let mut n = 0u64;
    while left > 0 {
        let tag = n.to_string();
        let slot = key_slot(format!("{{{tag}}}").as_bytes()) as usize;
        if tags[slot].is_empty() {
            tags[slot] = tag;
            left -= 1;
        }
        n += 1;
    }
    tags
}

/// Preloaded key `i` of the slots `slots` (key `i` is in `slots[i % len]`).
fn preload_key(tags: &[String], slots: &[u16], i: u64) -> Vec<u8> {
    let slot = slots[(i % slots.len() as u64) as usize];
    format!("m{{{}}}:{i}", tags[slot as usize]).into_bytes()
}

fn preload_value(i: u64, value_size: usize) -> Vec<u8> {
    let mut v = format!("{i}:").into_bytes();
    if v.len() < value_size {
        v.resize(value_size, b'v');
    }
    v
}

/// Writes `keys` keys spread over `slots` to `addr` (their owner): [`PRELOAD_CONNS`] connections,
/// batches of [`PRELOAD_BATCH`] pipelined SETs, [`PRELOAD_WINDOW`] in flight per connection.
fn preload(
    addr: &str,
    tags: &[String],
    slots: &[u16],
    keys: u64,
    value_size: usize,
    label: &str,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let acked = AtomicU64::new(0);
    let mut progress = Progress::new(&format!("{label} preload"));
    let results: Vec<anyhow::Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..PRELOAD_CONNS as u64)
            .map(|part| {
                let acked = &acked;
                scope.spawn(move || -> anyhow::Result<()> {
                    let mut conn =
                        Conn::open(addr).with_context(|| format!("connecting to {addr}"))?;
                    let stream = conn.reader.get_ref();
                    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
                    stream.set_write_timeout(Some(Duration::from_secs(30)))?;
                    let mut in_flight = std::collections::VecDeque::new();
                    let mut out = Vec::new();
                    let mut i = part;
                    let receive = |conn: &mut Conn, n: usize| -> anyhow::Result<()> {
                        for _ in 0..n {
                            match conn.recv().with_context(|| format!("preloading {addr}"))? {
                                Reply::Status(s) if s == "OK" => {
                                    acked.fetch_add(1, Ordering::Relaxed);
                                }
                                other => bail!("SET while preloading {addr}: {other:?}"),
                            }
                        }
                        Ok(())
                    };
                    while i < keys {
                        out.clear();
                        let mut batch = 0;
                        while batch < PRELOAD_BATCH && i < keys {
                            let key = preload_key(tags, slots, i);
                            encode(&mut out, &[b"SET", &key, &preload_value(i, value_size)]);
                            batch += 1;
                            i += PRELOAD_CONNS as u64;
                        }
                        conn.send(&out)
                            .with_context(|| format!("preloading {addr}"))?;
                        in_flight.push_back(batch);
                        while in_flight.len() >= PRELOAD_WINDOW {
                            let n = in_flight.pop_front().unwrap_or(0);
                            receive(&mut conn, n)?;
                        }
                    }
                    while let Some(n) = in_flight.pop_front() {
                        receive(&mut conn, n)?;
                    }
                    Ok(())
                })
            })
            .collect();
        while !handles.iter().all(|h| h.is_finished()) {
            progress.show(|| {
                let done = acked.load(Ordering::Relaxed);
                format!(
                    "{:.0}% ({done} of {keys} keys, {:.0} keys/s)",
                    done as f64 * 100.0 / keys.max(1) as f64,
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
    for r in results {
        r?;
    }
    progress.done(&format!(
        "{keys} keys of {value_size} B in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// Reads back up to [`SAMPLE_KEYS`] preloaded keys through `seeds`; how many are wrong or gone.
fn check_preload(
    seeds: &[String],
    tags: &[String],
    slots: &[u16],
    keys: u64,
    value_size: usize,
) -> anyhow::Result<u64> {
    let step = (keys / SAMPLE_KEYS).max(1);
    let ids: Vec<u64> = (0..keys).step_by(step as usize).collect();
    let names: Vec<Vec<u8>> = ids.iter().map(|&i| preload_key(tags, slots, i)).collect();
    let values = read_keys(seeds, &names)?;
    Ok(ids
        .iter()
        .zip(values)
        .filter(|(&i, v)| v.as_deref() != Some(&preload_value(i, value_size)[..]))
        .count() as u64)
}

/// Runs the load before, during and after `migrate` (which moves the slots `moved`); the run's
/// figures except the preload check.
fn under_load(
    seeds: &[String],
    value_size: usize,
    moved: &[bool],
    bytes: u64,
    migrate: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<(Run, LoadResult)> {
    let load = Load::start(seeds, THREADS, LOAD_KEYS.div_ceil(THREADS), value_size)?;
    // The first second warms connections and maps up; the next two are the baseline.
    std::thread::sleep(Duration::from_secs(1) + BEFORE);
    let began = Instant::now();
    let outcome = migrate();
    let ended = Instant::now();
    std::thread::sleep(AFTER);
    let result = load.stop();
    outcome?;
    let in_moved = |s: u16| moved[s as usize];
    let verify = result.verify(seeds)?;
    let run = Run {
        bytes,
        took: ended - began,
        before: result.window(began - BEFORE, began),
        during: result.window(began, ended),
        gap: result.longest_gap(in_moved, began, ended + AFTER),
        gap_before: result.longest_gap(in_moved, began - BEFORE, began),
        errors: result.errors.clone(),
        lost_writes: verify.lost_writes,
        checked: verify.checked,
        preload_wrong: 0,
    };
    Ok((run, result))
}

/// The tablet that holds slot 0, and its master's RESP address.
fn slot0_tablet(
    st: &super::ramlog::ClusterStatus,
) -> anyhow::Result<(super::ramlog::TabletState, String)> {
    let first = st
        .tablets
        .iter()
        .find(|t| t.first_slot == 0)
        .context("no tablet holds slot 0")?
        .clone();
    let addr = st
        .servers
        .iter()
        .find(|s| s.0 == first.master)
        .map(|s| s.2.clone())
        .context("the master of slot 0 is not listed")?;
    Ok((first, addr))
}

/// One ramlog run: start; preload the tablets the master of slot 0 masters that the server
/// outside the backup set of slot 0's tablet could take (it backs none of them up); move them
/// all to that server under load; check.
fn ramlog_run(
    work: &Path,
    label: &str,
    tags: &[String],
    data_bytes: u64,
    value_size: usize,
) -> anyhow::Result<Run> {
    let memory_mib = ((data_bytes >> 20) * 3).max(512);
    let cluster = RamlogCluster::start(work, SERVERS, memory_mib)?;
    let st = cluster.status()?;
    let (first, source_addr) = slot0_tablet(&st)?;
    let source = first.master;
    let target = st
        .servers
        .iter()
        .map(|s| s.0)
        .find(|id| *id != source && !first.backups.contains(id))
        .context("every server masters or backs up the tablet of slot 0")?;
    // A tablet's log on a backup holds at most 512 MiB (the backup store's
    // `tablet_log_capacity_bytes`): the data is spread over several tablets, as a server's data is.
    let tablets: Vec<(u16, u16)> = st
        .tablets
        .iter()
        .filter(|t| t.master == source && !t.backups.contains(&target))
        .map(|t| (t.first_slot, t.last_slot))
        .collect();
    let slots: Vec<u16> = tablets.iter().flat_map(|&(a, b)| a..=b).collect();
    let mut moved = vec![false; SLOT_COUNT as usize];
    for &s in &slots {
        moved[s as usize] = true;
    }
    let keys = (data_bytes / value_size as u64).max(1);
    preload(&source_addr, tags, &slots, keys, value_size, label)?;
    eprintln!(
        "  {label}: {} tablets of server {source} ({} slots) move to server {target}",
        tablets.len(),
        slots.len()
    );
    let seeds: Vec<String> = cluster.servers.iter().map(|s| s.resp.clone()).collect();
    let coordinator = cluster.coordinator.clone();
    let (mut run, _) = under_load(&seeds, value_size, &moved, keys * value_size as u64, || {
        // Every move is recorded at once; the coordinator runs them side by side.
        for &(a, b) in &tablets {
            run_tool(
                &[
                    "cluster",
                    "move",
                    "default",
                    &format!("{a}-{b}"),
                    "--to",
                    &target.to_string(),
                    "--no-wait",
                    "--coordinator",
                    &coordinator,
                ],
                Duration::from_secs(60),
            )?;
        }
        wait_until(
            "the tablets did not all move",
            Duration::from_secs(3600),
            || {
                let st = super::ramlog::cluster_status(&coordinator)?;
                Ok(tablets.iter().all(|&(a, _)| {
                    st.tablets
                        .iter()
                        .any(|t| t.first_slot == a && t.master == target && !t.migrating)
                }))
            },
        )
    })?;
    run.preload_wrong = check_preload(&seeds, tags, &slots, keys, value_size)?;
    Ok(run)
}

/// What one split run measured: the split, then the merge of its halves.
struct SplitRun {
    run: Run,
    /// From the split's end until no copy to a backup is pending.
    recopy: Duration,
    merge: Run,
    /// From the merge's end until no copy to a backup is pending.
    merge_recopy: Duration,
}

/// One split run: start; preload the tablet of slot 0; split it under load; wait for its
/// halves' copies; check.
fn split_run(
    work: &Path,
    label: &str,
    tags: &[String],
    data_bytes: u64,
    value_size: usize,
) -> anyhow::Result<SplitRun> {
    let memory_mib = ((data_bytes >> 20) * 4).max(512);
    let cluster = RamlogCluster::start(work, SERVERS, memory_mib)?;
    let st = cluster.status()?;
    let (first, master_addr) = slot0_tablet(&st)?;
    let slots: Vec<u16> = (first.first_slot..=first.last_slot).collect();
    let mut split_slots = vec![false; SLOT_COUNT as usize];
    for &s in &slots {
        split_slots[s as usize] = true;
    }
    let keys = (data_bytes / value_size as u64).max(1);
    preload(&master_addr, tags, &slots, keys, value_size, label)?;
    eprintln!(
        "  {label}: the tablet of slots {}-{} ({} MiB) splits",
        first.first_slot,
        first.last_slot,
        data_bytes >> 20
    );
    let seeds: Vec<String> = cluster.servers.iter().map(|s| s.resp.clone()).collect();
    let coordinator = cluster.coordinator.clone();
    // `ramlog cluster split|merge default 0` under the load.
    let step = |verb: &str| {
        under_load(
            &seeds,
            value_size,
            &split_slots,
            keys * value_size as u64,
            || {
                run_tool(
                    &[
                        "cluster",
                        verb,
                        "default",
                        "0",
                        "--timeout",
                        "600",
                        "--coordinator",
                        &coordinator,
                    ],
                    Duration::from_secs(660),
                )
                .map(|_| ())
            },
        )
        .map(|(run, _)| run)
    };
    let mut run = step("split")?;
    let recopied = |what: &str| -> anyhow::Result<Duration> {
        let started = Instant::now();
        wait_until(what, Duration::from_secs(3600), || {
            Ok(super::ramlog::cluster_status(&coordinator)?.pending == 0)
        })?;
        Ok(started.elapsed() + AFTER)
    };
    let recopy = recopied("the split halves' copies did not complete")?;
    run.preload_wrong = check_preload(&seeds, tags, &slots, keys, value_size)?;
    eprintln!("  {label}: the halves merge back");
    let mut merge = step("merge")?;
    let merge_recopy = recopied("the merged tablet's copies did not complete")?;
    merge.preload_wrong = check_preload(&seeds, tags, &slots, keys, value_size)?;
    Ok(SplitRun {
        run,
        recopy,
        merge,
        merge_recopy,
    })
}

fn push_split_rows(report: &mut Report, value_size: usize, runs: &[SplitRun]) {
    let splits: Vec<(&Run, Duration)> = runs.iter().map(|r| (&r.run, r.recopy)).collect();
    push_reshape_rows(report, "split", value_size, &splits);
    let merges: Vec<(&Run, Duration)> = runs.iter().map(|r| (&r.merge, r.merge_recopy)).collect();
    push_reshape_rows(report, "merge", value_size, &merges);
}

/// The rows of one step (`split` or `merge`) over the runs: each run with the time its copies
/// to the backups took after it.
fn push_reshape_rows(
    report: &mut Report,
    step: &str,
    value_size: usize,
    runs: &[(&Run, Duration)],
) {
    let v = size_name(value_size);
    let med = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(|(r, _)| f(r)).collect());
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    report.push(Row::plain(
        format!("{step}_{v}_took"),
        med(&|r| ms(r.took)),
        "ms",
    ));
    report.push(Row::plain(
        format!("{step}_{v}_longest_key_unavailable"),
        med(&|r| ms(r.gap)),
        "ms",
    ));
    report.push(Row::plain(
        format!("{step}_{v}_longest_key_unavailable_before_{step}"),
        med(&|r| ms(r.gap_before)),
        "ms",
    ));
    report.push(Row::plain(
        format!("{step}_{v}_throughput_during_over_before"),
        med(&|r| r.during.per_second / r.before.per_second.max(1e-9)),
        "ratio",
    ));
    report.push(Row::plain(
        format!("{step}_{v}_recopy"),
        median(runs.iter().map(|(_, d)| d.as_secs_f64()).collect()),
        "s",
    ));
    let worst = |f: &dyn Fn(&Run) -> u64| runs.iter().map(|(r, _)| f(r)).max().unwrap_or(0) as f64;
    report.push(
        Row::plain(
            format!("{step}_{v}_lost_writes"),
            worst(&|r| r.lost_writes + r.preload_wrong),
            "writes",
        )
        .with_target(Target::at_most(0.0)),
    );
    report.push(
        Row::plain(
            format!("{step}_{v}_failed_attempts"),
            worst(&|r| r.failed()),
            "attempts",
        )
        .with_target(Target::at_most(0.0)),
    );
}

fn print_split(label: &str, s: &SplitRun) {
    print_reshape(label, "split", "both halves", &s.run, s.recopy);
    print_reshape(
        label,
        "merge",
        "the joined tablet",
        &s.merge,
        s.merge_recopy,
    );
}

fn print_reshape(label: &str, step: &str, copied: &str, r: &Run, recopy: Duration) {
    println!(
        "{label}: {step} {:.0} MB in {:.0} ms; load {:.0}/s before, {:.0}/s during; longest gap of \
         the tablet's slots {:.0} ms (before: {:.0} ms); {copied} copied to every backup {:.1} s \
         later; errors {:?}; lost writes {} of {} keys, preloaded keys wrong {}",
        r.bytes as f64 / 1e6,
        r.took.as_secs_f64() * 1e3,
        r.before.per_second,
        r.during.per_second,
        r.gap.as_secs_f64() * 1e3,
        r.gap_before.as_secs_f64() * 1e3,
        recopy.as_secs_f64(),
        r.errors,
        r.lost_writes,
        r.checked,
        r.preload_wrong,
    );
}

/// `CLUSTER MYID` of a Redis node.
fn redis_id(addr: &str) -> anyhow::Result<String> {
    match call(addr, &["CLUSTER", "MYID"])? {
        Reply::Bulk(Some(id)) => Ok(String::from_utf8_lossy(&id).into_owned()),
        other => bail!("CLUSTER MYID on {addr}: {other:?}"),
    }
}

/// One Redis Cluster run: preload the master of slot 0, reshard all its slots to the master of
/// slot 16383 under load, check.
fn redis_run(
    work: &Path,
    label: &str,
    tags: &[String],
    data_bytes: u64,
    value_size: usize,
) -> anyhow::Result<Run> {
    std::fs::create_dir_all(work)?;
    let nodes = redis_cluster(work, REDIS_NODE_TIMEOUT_MS)?;
    let seeds: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let names = Nodes::default();
    let map = fetch_map(seeds.iter().map(String::as_str), &names, None)
        .context("no Redis node answered CLUSTER SLOTS")?;
    let (from, to) = (map[0], map[SLOT_COUNT as usize - 1]);
    if from == to {
        bail!("one Redis master serves both slot 0 and slot 16383");
    }
    let from_addr = names.name(from).context("unknown Redis node")?;
    let to_addr = names.name(to).context("unknown Redis node")?;
    let slots: Vec<u16> = (0..SLOT_COUNT)
        .filter(|&s| map[s as usize] == from)
        .collect();
    let mut moved = vec![false; SLOT_COUNT as usize];
    for &s in &slots {
        moved[s as usize] = true;
    }
    let keys = (data_bytes / value_size as u64).max(1);
    preload(&from_addr, tags, &slots, keys, value_size, label)?;
    wait_until(
        "the Redis replica did not acknowledge the preload",
        Duration::from_secs(120),
        || Ok(matches!(call(&from_addr, &["WAIT", "1", "500"])?, Reply::Int(n) if n >= 1)),
    )?;
    let (from_id, to_id) = (redis_id(&from_addr)?, redis_id(&to_addr)?);
    let log = work.join("reshard.txt");
    let (mut run, _) = under_load(&seeds, value_size, &moved, keys * value_size as u64, || {
        let mut child = Command::new("redis-cli")
            .args(["--cluster", "reshard", &from_addr])
            .args(["--cluster-from", &from_id, "--cluster-to", &to_id])
            .args(["--cluster-slots", &slots.len().to_string()])
            .args(["--cluster-yes", "--cluster-pipeline", "1000"])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log)?)
            .stderr(Stdio::null())
            .spawn()
            .context("running redis-cli --cluster reshard")?;
        let deadline = Instant::now() + Duration::from_secs(3600);
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("redis-cli --cluster reshard did not finish within an hour");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let out = std::fs::read_to_string(&log).unwrap_or_default();
        if !status.success() || out.contains("[ERR]") {
            bail!(
                "redis-cli --cluster reshard failed: {}",
                out.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
            );
        }
        Ok(())
    })?;
    run.preload_wrong = check_preload(&seeds, tags, &slots, keys, value_size)?;
    drop(nodes);
    Ok(run)
}

/// Copies the `*.log` files of `dir` to `to`.
fn keep_logs(dir: &Path, to: &Path) {
    let _ = std::fs::create_dir_all(to);
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) == Some("log") {
            if let Some(name) = path.file_name() {
                let _ = std::fs::copy(&path, to.join(name));
            }
        }
    }
}

fn print_run(label: &str, r: &Run) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{label}: moved {:.0} MB in {:.2} s ({:.1} MB/s); load {:.0}/s before, {:.0}/s during; \
         p50/p99/p99.9 {:.2}/{:.2}/{:.2} ms before, {:.2}/{:.2}/{:.2} ms during; longest gap of \
         the moved slots {:.0} ms (before: {:.0} ms); errors {:?}; lost writes {} of {} keys, \
         preloaded keys wrong {}",
        r.bytes as f64 / 1e6,
        r.took.as_secs_f64(),
        r.mb_per_s(),
        r.before.per_second,
        r.during.per_second,
        ms(r.before.p50),
        ms(r.before.p99),
        ms(r.before.p999),
        ms(r.during.p50),
        ms(r.during.p99),
        ms(r.during.p999),
        ms(r.gap),
        ms(r.gap_before),
        r.errors,
        r.lost_writes,
        r.checked,
        r.preload_wrong,
    );
}

fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[xs.len() / 2]
}

fn size_name(value_size: usize) -> String {
    if value_size >= 1024 && value_size.is_multiple_of(1024) {
        format!("{}KiB", value_size / 1024)
    } else {
        format!("{value_size}B")
    }
}

fn push_rows(report: &mut Report, value_size: usize, ours: &[Run], theirs: &[Run]) {
    let v = size_name(value_size);
    let med = |runs: &[Run], f: &dyn Fn(&Run) -> f64| median(runs.iter().map(f).collect());
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let rate = med(ours, &|r| r.mb_per_s());
    let redis_rate = med(theirs, &|r| r.mb_per_s());
    let mut row = Row::versus(
        format!("migration_{v}_mb_per_s_vs_redis_reshard"),
        rate,
        "MB/s",
        redis_rate,
    );
    if value_size == 100 {
        row = row.with_target(Target::at_least(10.0));
    }
    report.push(row);
    let mut row = Row::plain(format!("migration_{v}_mb_per_s"), rate, "MB/s");
    if value_size == 100 {
        row = row.with_target(Target::at_least(300.0));
    }
    report.push(row);
    for (name, runs) in [("ramlog", ours), ("redis", theirs)] {
        let during = med(runs, &|r| {
            r.during.per_second / r.before.per_second.max(1e-9)
        });
        let mut row = Row::plain(
            format!("{name}_{v}_throughput_during_over_before"),
            during,
            "ratio",
        );
        let mut p99 = Row::plain(
            format!("{name}_{v}_p99_during_over_before"),
            med(runs, &|r| ms(r.during.p99) / ms(r.before.p99).max(1e-9)),
            "ratio",
        );
        let mut gap = Row::plain(
            format!("{name}_{v}_longest_key_unavailable"),
            med(runs, &|r| ms(r.gap)),
            "ms",
        );
        if name == "ramlog" {
            row = row.with_target(Target::at_least(0.7));
            p99 = p99.with_target(Target::at_most(3.0));
            gap = gap.with_target(Target::at_most(100.0));
        }
        report.push(row);
        for (q, f) in [
            ("p50", &(|w: &Window| ms(w.p50)) as &dyn Fn(&Window) -> f64),
            ("p99", &|w: &Window| ms(w.p99)),
            ("p999", &|w: &Window| ms(w.p999)),
        ] {
            report.push(Row::plain(
                format!("{name}_{v}_{q}_before"),
                med(runs, &|r| f(&r.before)),
                "ms",
            ));
            report.push(Row::plain(
                format!("{name}_{v}_{q}_during"),
                med(runs, &|r| f(&r.during)),
                "ms",
            ));
        }
        report.push(p99);
        report.push(gap);
        report.push(Row::plain(
            format!("{name}_{v}_longest_key_unavailable_before_move"),
            med(runs, &|r| ms(r.gap_before)),
            "ms",
        ));
        let worst = |f: &dyn Fn(&Run) -> u64| runs.iter().map(f).max().unwrap_or(0) as f64;
        let mut lost = Row::plain(
            format!("{name}_{v}_lost_writes"),
            worst(&|r| r.lost_writes + r.preload_wrong),
            "writes",
        );
        let mut failed = Row::plain(
            format!("{name}_{v}_failed_attempts"),
            worst(&|r| r.failed()),
            "attempts",
        );
        if name == "ramlog" {
            lost = lost.with_target(Target::at_most(0.0));
            failed = failed.with_target(Target::at_most(0.0));
        }
        report.push(lost);
        report.push(failed);
        report.push(Row::plain(
            format!("{name}_{v}_tryagain_replies"),
            worst(&|r| r.errors.get("tryagain").copied().unwrap_or(0)),
            "replies",
        ));
    }
}

/// `ramlog bench migration`: see the module comment. `RAMLOG_BENCH_MIGRATION_MIB` (default 16
/// quick, 1024 full), `RAMLOG_BENCH_MIGRATION_REPEATS` (default 1 quick, 3 full),
/// `RAMLOG_BENCH_MIGRATION_VALUES` (comma-separated value sizes; default 100 quick, 100,1024 full;
/// the split runs with the first), `RAMLOG_BENCH_SPLIT_MIB` (default 16 quick, 128 full).
pub fn run(quick: bool, json: Option<&Path>) -> anyhow::Result<()> {
    require_tools()?;
    let data_mib = env_u64("RAMLOG_BENCH_MIGRATION_MIB").unwrap_or(if quick { 16 } else { 1024 });
    let split_mib = env_u64("RAMLOG_BENCH_SPLIT_MIB").unwrap_or(if quick { 16 } else { 128 });
    let repeats = env_u64("RAMLOG_BENCH_MIGRATION_REPEATS")
        .unwrap_or(if quick { 1 } else { 3 })
        .max(1) as usize;
    let values: Vec<usize> = match std::env::var("RAMLOG_BENCH_MIGRATION_VALUES") {
        Ok(v) => v
            .split(',')
            .map(|s| {
                s.trim()
                    .parse::<usize>()
                    .context("RAMLOG_BENCH_MIGRATION_VALUES")
            })
            .collect::<anyhow::Result<_>>()?,
        Err(_) if quick => vec![100],
        Err(_) => vec![100, 1024],
    };
    println!(
        "{data_mib} MiB of values moved per run; ramlog {SERVERS} servers (R = 2, sync) moving the \
         tablets of one server that another does not back up, Redis Cluster 4 masters + 4 replicas \
         resharding one master's slots; load: {THREADS} threads over {LOAD_KEYS} keys; {repeats} \
         repeat(s)"
    );
    // RAMLOG_BENCH_MIGRATION_KEEP_LOGS=1: the servers' and the coordinator's logs of each ramlog
    // run stay in the work directory (printed at the end).
    let keep = std::env::var_os("RAMLOG_BENCH_MIGRATION_KEEP_LOGS").is_some();
    let tags = slot_tags();
    let work = std::env::temp_dir().join(format!("ramlog-bench-migration-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut report = Report::new("migration", quick);
    let result = (|| -> anyhow::Result<()> {
        for &value_size in &values {
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for repeat in 1..=repeats {
                let v = size_name(value_size);
                let label = format!("ramlog_{v} #{repeat}");
                let dir = work.join(format!("ramlog-{value_size}-{repeat}"));
                let r = ramlog_run(&dir, &label, &tags, data_mib << 20, value_size)
                    .with_context(|| format!("{label} (logs in {})", dir.display()))?;
                if keep {
                    keep_logs(
                        &dir,
                        &work.join(format!("logs-ramlog-{value_size}-{repeat}")),
                    );
                }
                let _ = std::fs::remove_dir_all(&dir);
                print_run(&label, &r);
                ours.push(r);
                let label = format!("redis_{v} #{repeat}");
                let dir = work.join(format!("redis-{value_size}-{repeat}"));
                let r = redis_run(&dir, &label, &tags, data_mib << 20, value_size)
                    .with_context(|| label.clone())?;
                let _ = std::fs::remove_dir_all(&dir);
                print_run(&label, &r);
                theirs.push(r);
            }
            push_rows(&mut report, value_size, &ours, &theirs);
        }
        let value_size = values[0];
        let mut splits = Vec::new();
        for repeat in 1..=repeats {
            let label = format!("split_{} #{repeat}", size_name(value_size));
            let dir = work.join(format!("split-{value_size}-{repeat}"));
            let r = split_run(&dir, &label, &tags, split_mib << 20, value_size)
                .with_context(|| format!("{label} (logs in {})", dir.display()))?;
            if keep {
                keep_logs(
                    &dir,
                    &work.join(format!("logs-split-{value_size}-{repeat}")),
                );
            }
            let _ = std::fs::remove_dir_all(&dir);
            print_split(&label, &r);
            splits.push(r);
        }
        push_split_rows(&mut report, value_size, &splits);
        Ok(())
    })();
    if result.is_ok() && !keep {
        let _ = std::fs::remove_dir_all(&work);
    } else if keep {
        println!("logs kept in {}", work.display());
    }
    result?;
    report.finish(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slot_has_a_tag_and_preload_keys_land_in_their_slots() {
        let tags = slot_tags();
        assert!(tags.iter().all(|t| !t.is_empty()));
        let slots = [5u16, 700, 16383];
        for i in 0..30 {
            let key = preload_key(&tags, &slots, i);
            assert_eq!(key_slot(&key), slots[(i % 3) as usize]);
        }
    }
}
