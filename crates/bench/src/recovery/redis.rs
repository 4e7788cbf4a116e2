//! The Redis Cluster peer: its processes, its preload and its failover.
//!
//! [`redis_failover`] runs the load ([`Load`]) against a Redis Cluster of 4 masters + 4 replicas
//! (one replica per master, no persistence, the `cluster-node-timeout` given), kills -9 the master
//! serving slot 0 and measures what the load saw ([`super::LoadResult`]). Redis replicates asynchronously, so the promoted replica may lack
//! writes its master acknowledged just before dying: the lost count is reported as measured. With
//! Redis's default `cluster-require-full-coverage yes`, every node answers `-CLUSTERDOWN` from the
//! moment the cluster marks the master failed until its replica takes over, which the other
//! slots' gap shows.

use super::client::{call, encode, fetch_map, text, Conn, Nodes, Reply, BATCH, NO_NODE};
use super::load::{settle_after_kill, warm_up, Load, THREADS};
use super::process::{wait_until, Proc};
use super::progress::Progress;
use super::PRELOAD_LIMIT;
use crate::resp::{free_port, which};
use anyhow::{bail, Context};
use ramlog_common::key_slot;
use std::collections::{BTreeMap, HashSet};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Redis Cluster shape of [`redis_failover`]: masters, each with one replica.
pub(super) const MASTERS: usize = 4;

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
    /// Keys that lost an acknowledged write ([`Verify::lost`](super::Verify::lost)).
    pub lost: u64,
    /// Acknowledged writes lost ([`Verify::lost_writes`](super::Verify::lost_writes)).
    pub lost_writes: u64,
    /// Keys read back.
    pub checked: u64,
    /// Keys holding a write whose acknowledgement the client never saw
    /// ([`Verify::ahead`](super::Verify::ahead)).
    pub ahead: u64,
    /// What the client saw fail, by kind ([`LoadResult::errors`](super::LoadResult::errors)).
    pub errors: BTreeMap<String, u64>,
}

/// One redis-server; killed -9 and reaped when dropped ([`Proc`]).
pub(super) struct RedisNode {
    port: u16,
    proc: Proc,
}

impl RedisNode {
    pub(super) fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

/// Fails unless redis-server and redis-cli are in PATH.
pub(super) fn require_tools() -> anyhow::Result<()> {
    for tool in ["redis-server", "redis-cli"] {
        if which(tool).is_none() {
            bail!("{tool} not found in PATH (install the redis-server and redis-tools packages; scripts/test does)");
        }
    }
    Ok(())
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
pub(super) fn redis_cluster(work: &Path, node_timeout_ms: u64) -> anyhow::Result<Vec<RedisNode>> {
    redis_cluster_of(work, node_timeout_ms, MASTERS)
}

/// [`redis_cluster`] with `masters` masters (each with one replica).
pub(super) fn redis_cluster_of(
    work: &Path,
    node_timeout_ms: u64,
    masters: usize,
) -> anyhow::Result<Vec<RedisNode>> {
    let mut taken = HashSet::new();
    let mut nodes = Vec::new();
    for _ in 0..masters * 2 {
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
        nodes.push(RedisNode {
            port,
            proc: Proc(child),
        });
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

/// Which keys a Redis preload writes.
#[derive(Debug, Clone, Copy)]
pub enum RedisPreload {
    /// `p:<i>` for every `i` below the count, on whichever master serves its slot.
    Spread(usize),
    /// The first that many `p:<i>` whose slot the master of slot 0 (the victim) serves; the
    /// other masters get none, as ramlog's victim is preloaded.
    Victim(usize),
}

/// Writes the keys `p:<i>` that `what` selects, with `value_size` bytes each, pipelined per
/// master (batches of [`BATCH`], keys generated as they are sent), and waits until each
/// master's replica has acknowledged them (`WAIT`), for at most [`PRELOAD_LIMIT`] in all; shows
/// its progress on stderr.
fn preload(
    map: &[u16],
    nodes: &Nodes,
    what: RedisPreload,
    value_size: usize,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let deadline = started + PRELOAD_LIMIT;
    let value = vec![b'p'; value_size];
    // (master, keys it gets): with `Spread`, `p:<i>` for i < n whose slot it serves; with
    // `Victim`, the first n such keys of the master of slot 0.
    let mut masters: Vec<u16> = map.iter().copied().filter(|&n| n != NO_NODE).collect();
    masters.sort_unstable();
    masters.dedup();
    let keys = match what {
        RedisPreload::Spread(n) => n,
        RedisPreload::Victim(n) => {
            masters = vec![map[0]];
            n
        }
    };
    // Whether a master's scan of `i` goes on, after `sent` of its keys.
    let more = |i: u64, sent: usize| match what {
        RedisPreload::Spread(n) => i < n as u64,
        RedisPreload::Victim(n) => sent < n,
    };
    let mut progress = Progress::new("Redis preload");
    let mut done = 0usize;
    for node in masters {
        let addr = nodes
            .name(node)
            .filter(|_| node != NO_NODE)
            .context("a slot has no master")?;
        let mut conn = Conn::open(&addr).with_context(|| format!("connecting to {addr}"))?;
        let mut out = Vec::new();
        let (mut i, mut sent) = (0u64, 0usize);
        loop {
            out.clear();
            let mut batch = 0;
            while batch < BATCH && more(i, sent) {
                let key = format!("p:{i}").into_bytes();
                i += 1;
                if map[key_slot(&key) as usize] == node {
                    encode(&mut out, &[b"SET", &key, &value]);
                    batch += 1;
                    sent += 1;
                }
            }
            if batch == 0 {
                break;
            }
            conn.send(&out)
                .with_context(|| format!("preloading {addr}"))?;
            for _ in 0..batch {
                match conn.recv().with_context(|| format!("preloading {addr}"))? {
                    Reply::Status(s) if s == "OK" => {}
                    other => bail!("SET while preloading {addr}: {other:?}"),
                }
            }
            done += batch;
            progress.show(|| {
                format!(
                    "{:.0}% ({done} of {keys} keys, {:.0} keys/s)",
                    done as f64 * 100.0 / keys.max(1) as f64,
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
        "{done} keys in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// Starts a Redis Cluster of 4 masters + 4 replicas in `work` (`cluster-node-timeout` =
/// `node_timeout_ms`, no persistence), preloads the keys `preload` selects with `value_size`
/// bytes each, runs
/// a [`Load`] of 4 threads over `keys` keys with `value_size`-byte values, kills -9 the master
/// serving slot 0 after 2 s, keeps the load on until that master's slots have taken writes again
/// for 2 s, then reads every key back. Every process started is stopped on return.
pub fn redis_failover(
    work: &Path,
    node_timeout_ms: u64,
    value_size: usize,
    keys: usize,
    preload_keys: RedisPreload,
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
    if !matches!(
        preload_keys,
        RedisPreload::Spread(0) | RedisPreload::Victim(0)
    ) {
        preload(&map, &names, preload_keys, value_size)?;
    }

    let load = Load::start(&seeds, THREADS, keys.div_ceil(THREADS).max(1), value_size)?;
    let load = warm_up(load, in_victim, &victim_addr)?;
    let killed_at = Instant::now();
    nodes[victim]
        .proc
        .0
        .kill()
        .context("killing the Redis master")?;
    nodes[victim]
        .proc
        .0
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

/// Runs [`redis_failover`] once (node timeout 500 ms, 100 B values, 10 000 keys under load;
/// 100 000 keys preloaded with `quick`, 1 000 000 without) and prints what it measured.
pub fn redis_only(quick: bool) -> anyhow::Result<()> {
    require_tools()?;
    const NODE_TIMEOUT_MS: u64 = 500;
    const VALUE: usize = 100;
    const KEYS: usize = 10_000;
    let preload = if quick { 100_000 } else { 1_000_000 };
    let work = std::env::temp_dir().join(format!("ramlog-bench-recovery-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = redis_failover(
        &work,
        NODE_TIMEOUT_MS,
        VALUE,
        KEYS,
        RedisPreload::Spread(preload),
    );
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `cargo test --release -p ramlog-bench recovery -- --ignored --nocapture`
    #[test]
    #[ignore = "starts a Redis Cluster; needs redis-server and redis-cli"]
    fn redis_failover_runs() {
        redis_only(true).unwrap();
    }
}
