//! The ramlog failover: a cluster started, its victim preloaded and killed -9 under load.
//!
//! [`ramlog_failover`] does to a ramlog cluster what [`super::redis_failover`] does to Redis
//! Cluster (a coordinator and 3 or 4 servers, R = 2, the coordinator's default detection: 400 ms of
//! missed heartbeats and a failed probe): it preloads the master of slot 0 (the victim) with `data`
//! bytes of values over RESP (the other masters get none), runs the load against every server,
//! kills -9 the victim after 2 s, and polls the coordinator's status every 15 ms from another
//! thread ([`super::poller`]): **detection** is the kill until an answer shows the victim dead,
//! **recovery** from then until one shows no tablet recovering (each of the victim's tablets
//! restored by its first live backup from that backup's own logs), **re-protection** from then
//! until one shows no copy pending (the new masters copying the tablets to their backups). The load
//! runs on until 2 s after the victim's slots took a write again; then its keys and 10 000 random
//! preloaded keys are read back.

use super::bare_replay::{copy_store, StoreCopy};
use super::client::{call, encode, Conn, Reply};
use super::load::{settle_after_kill, warm_up, Load, LOAD_KEYS, THREADS};
use super::poller::Poller;
use super::process::wait_until;
use super::progress::Progress;
use super::ramlog::{save_status, RamlogCluster};
use super::readback::read_keys;
use super::PRELOAD_LIMIT;
use anyhow::{bail, Context};
use ramlog_common::{key_slot, SLOT_COUNT};
use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Every wait on a cluster (start, detection, recovery, re-protection) gives up after this.
const WAIT_LIMIT: Duration = Duration::from_secs(120);
/// Recovering tablets with no live backup for this long end a run (nothing will restore them).
const STUCK_LIMIT: Duration = Duration::from_secs(5);
/// SETs per pipelined write of the ramlog preload, such writes in flight at once per connection,
/// and connections.
const PRELOAD_BATCH: usize = 1000;
const PRELOAD_WINDOW: usize = 4;
const PRELOAD_CONNS: usize = 4;
/// Socket timeout of the ramlog preload's connection (a pipelined batch of 1000 SETs waits for
/// its backups).
const PRELOAD_IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Preloaded keys read back after a recovery.
const SAMPLE_KEYS: usize = 10_000;

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
    /// server (as [`RedisFailover::failover`](super::RedisFailover::failover)).
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
    /// The longest interval without an acknowledged write on the slots of any one tablet of
    /// the map after the run that lies in the victim's slots: the recovery partitions split off
    /// the victim's tablets at its declaration, and what remains of those tablets; and how many
    /// there were.
    pub worst_partition_gap: Duration,
    pub partitions: usize,
    /// The copy of a survivor's backup store taken after the preload, when one was asked for.
    pub store_copy: Option<StoreCopy>,
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
/// the load saw; reads back the load's keys and 10 000 preloaded ones. With `copy_store_to`,
/// the backup store of the first backup of the victim's tablet at slot 0 is copied there after
/// the preload ([`super::bare_replay`]). Every process started is stopped on return.
#[allow(clippy::too_many_arguments)]
pub fn ramlog_failover(
    work: &Path,
    label: &str,
    servers: usize,
    mode: &str,
    value_size: usize,
    data_bytes: u64,
    memory_mib: u64,
    copy_store_to: Option<&Path>,
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
    let store_copy = match copy_store_to {
        Some(to) => {
            let backup = st
                .tablets
                .iter()
                .find(|t| t.first_slot == 0)
                .and_then(|t| t.backups.first().copied())
                .context("the victim's tablet at slot 0 has no backup")?;
            let resp = st
                .servers
                .iter()
                .find(|s| s.0 == backup)
                .map(|s| s.2.clone())
                .context("the backup of slot 0 is not listed")?;
            let index = cluster
                .servers
                .iter()
                .position(|s| s.resp == resp)
                .with_context(|| format!("the backup of slot 0, {resp}, is not one of ours"))?;
            let from = work.join(format!("server-{index}")).join("backup");
            let mut copy = copy_store(&from, to, backup)?;
            // The preloaded keys whose tablet this backup holds: what its replay should yield.
            let mut held = vec![false; SLOT_COUNT as usize];
            for t in st
                .tablets
                .iter()
                .filter(|t| t.master == victim_id && t.backups.contains(&backup))
            {
                held[t.first_slot as usize..=t.last_slot as usize].fill(true);
            }
            copy.expected_objects = (0..pre.scanned)
                .filter(|i| held[key_slot(format!("p:{i}").as_bytes()) as usize])
                .count() as u64;
            eprintln!(
                "  {label}: copied the backup store of server {backup} ({:.0} MiB{})",
                copy.bytes as f64 / (1u64 << 20) as f64,
                if copy.quiet {
                    ""
                } else {
                    ", which changed during the copy"
                }
            );
            Some(copy)
        }
        None => None,
    };
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
    let load = warm_up(load, in_victim, &victim_addr)?;
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
    let after = cluster.status();
    let survivors_dead = match &after {
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
    // The victim's slots as the map divides them now (partitions included).
    let partition_ranges: Vec<(u16, u16)> = match &after {
        Ok(st) => st
            .tablets
            .iter()
            .filter(|t| in_victim(t.first_slot))
            .map(|t| (t.first_slot, t.last_slot))
            .collect(),
        Err(_) => victim_tablets.clone(),
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
        worst_partition_gap: partition_ranges
            .iter()
            .map(|&(a, b)| result.longest_gap(|s| a <= s && s <= b, from, result.stopped))
            .max()
            .unwrap_or_default(),
        partitions: partition_ranges.len(),
        store_copy,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preload_values() {
        assert_eq!(&preload_value(42, 8), b"42:vvvvv");
        assert_eq!(&preload_value(123456, 3), b"123456:");
    }
}
