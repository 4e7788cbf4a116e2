//! `ramlog bench cluster`: 3-server ramlog clusters against Redis Clusters of the same shape, side
//! by side in one run on this machine. All load is `redis-benchmark --cluster -c 50 -d 100 -r
//! 1000000 -t set,get` at pipeline 1 and 16 against each cluster's first server, targets
//! alternating, medians of the repeats.
//!
//! 1. **Without replication**: ramlog with no backups (`--default-replicas 0`) against 3 Redis
//!    masters with no replicas and no persistence; and plain `redis-benchmark` (no `--cluster`)
//!    against ramlog's routing port of server 0 against its cluster port.
//! 2. **Replication** (`ramlog up`'s defaults: 2 backups per tablet): ramlog in each mode
//!    (`async`, `sync`, `durable`, `mirror`, switched with `ramlog table set-mode`) against a Redis Cluster
//!    of 3 masters + 3 replicas (asynchronous replication, the closest Redis offers); ramlog
//!    `durable` against the same Redis Cluster with `appendonly yes, appendfsync always`; and the
//!    cost of R = 0, 1, 2 backups in each mode (SET, req/s against R = 0).
//! 3. **Backup RAM per replicated key**, at rest after the load: what the backup stores of the
//!    R = 2 cluster hold for keys (version buffers, caches, notes, tablet metadata), divided by the
//!    keys they back up; the fixed buffers are reported beside it.

use crate::report::{Report, Row, Target};
use crate::resp::{
    command, free_port, info_text, latency_rows, median_by, redis_benchmark_with, wait_for_ping,
    which, BenchResult, Peer,
};
use anyhow::{bail, Context};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SERVERS: usize = 3;

pub fn run(quick: bool, json: Option<&Path>) -> anyhow::Result<()> {
    for tool in ["redis-server", "redis-benchmark", "redis-cli"] {
        if which(tool).is_none() {
            bail!("{tool} not found in PATH (install the redis-server and redis-tools packages; scripts/test does)");
        }
    }
    // `redis-benchmark --cluster` runs a thread per node and notices the end of a run only at its
    // 250 ms throughput tick, so a run's time is rounded up to the next tick: the full run's
    // counts keep every run past 5 s (the rounding under 5 %, the same for both sides); the
    // quick run's rates are a smoke test, rounded to 0.25 s of 0.5-1.5 s.
    let (requests_p1, requests_p16, repeats) = if quick {
        (30_000, 100_000, 1)
    } else {
        (300_000, 3_000_000, 3)
    };
    let work = std::env::temp_dir().join(format!("ramlog-bench-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut report = Report::new("cluster", quick);
    let result = run_all(&work, requests_p1, requests_p16, repeats, &mut report);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    report.finish(json)
}

/// Issue 52's targets for the replicated rows (R = 2 against Redis Cluster with replicas).
fn replicated_target(mode: &str, op: &str, pipeline: u32) -> Option<f64> {
    match (mode, op, pipeline) {
        ("sync", "set", _) => Some(1.3),
        ("async", "set", _) => Some(1.5),
        ("sync" | "durable", "get", 16) => Some(1.3),
        ("mirror", "set", _) => Some(1.0),
        ("durable", "set", _) => None,
        _ => Some(1.0),
    }
}

/// Runs `write(commit bytes) + fdatasync` for 2 s in a file under `work`; returns syncs/s.
fn bare_sync_loop(work: &Path, commit: usize) -> anyhow::Result<f64> {
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    let path = work.join("bare-sync");
    let mut file = std::fs::File::create(&path)?;
    let block = vec![0x5au8; commit];
    // Written once first, so that the loop overwrites allocated blocks as a log's steady state
    // appends into preallocated segments.
    file.write_all(&block)?;
    file.sync_all()?;
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < Duration::from_secs(2) {
        file.write_all_at(&block, 0)?;
        file.sync_data()?;
        n += 1;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    drop(file);
    let _ = std::fs::remove_file(&path);
    Ok(rate)
}

/// The sum over `ports` of the named counters of each server's `/metrics`.
fn metrics_sum(ports: &[u16], names: &[&str]) -> anyhow::Result<Vec<f64>> {
    use std::io::{Read, Write};
    let mut sums = vec![0.0; names.len()];
    for &port in ports {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        for line in text.lines() {
            let mut parts = line.split_whitespace();
            let (Some(name), Some(value)) = (parts.next(), parts.next()) else {
                continue;
            };
            if let Some(i) = names.iter().position(|n| *n == name) {
                sums[i] += value.parse::<f64>().unwrap_or(0.0);
            }
        }
    }
    Ok(sums)
}

/// Waits until `CLUSTER INFO` on `port` says the cluster is ok.
fn wait_cluster_ok(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        use std::io::{Read, Write};
        s.write_all(b"CLUSTER INFO\r\n")?;
        let mut buf = vec![0u8; 4096];
        let n = s.read(&mut buf).unwrap_or(0);
        if String::from_utf8_lossy(&buf[..n]).contains("cluster_state:ok") {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the cluster on port {port} did not reach cluster_state:ok");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A Redis Cluster of 3 masters, each with `replicas` replicas.
fn redis_cluster(work: &Path, replicas: usize) -> anyhow::Result<Vec<Peer>> {
    let mut peers = Vec::new();
    for _ in 0..SERVERS * (1 + replicas) {
        let port = free_port()?;
        let dir = work.join(format!("redis-{port}"));
        std::fs::create_dir_all(&dir)?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--cluster-enabled",
                "yes",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--cluster-config-file")
            .arg(dir.join("nodes.conf"))
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server")?;
        peers.push(Peer {
            name: "redis",
            port,
            child,
        });
        wait_for_ping(port)?;
    }
    let out = Command::new("redis-cli")
        .arg("--cluster")
        .arg("create")
        .args(peers.iter().map(|p| format!("127.0.0.1:{}", p.port)))
        .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
        .output()
        .context("running redis-cli --cluster create")?;
    if !out.status.success() {
        bail!(
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    for p in &peers {
        wait_cluster_ok(p.port)?;
    }
    if replicas > 0 {
        // Every replica has finished its first sync before any load.
        let deadline = Instant::now() + Duration::from_secs(60);
        for p in &peers {
            loop {
                let info = info_text(p.port, "replication")?;
                let synced = info.contains("role:master")
                    || info.contains("master_link_status:up")
                        && info.contains("master_sync_in_progress:0");
                if synced {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("Redis replica on port {} did not sync", p.port);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    Ok(peers)
}

/// Turns every Redis node's AOF on with `appendfsync always` (or back off), waiting for the
/// initial rewrite to end.
fn redis_fsync_always(peers: &[Peer], on: bool) -> anyhow::Result<()> {
    for p in peers {
        let fsync = command(
            p.port,
            if on {
                "CONFIG SET appendfsync always"
            } else {
                "CONFIG SET appendfsync everysec"
            },
        )?;
        let aof = command(
            p.port,
            if on {
                "CONFIG SET appendonly yes"
            } else {
                "CONFIG SET appendonly no"
            },
        )?;
        if fsync != "+OK" || aof != "+OK" {
            bail!("CONFIG SET on Redis port {}: {fsync} {aof}", p.port);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    for p in peers {
        while info_text(p.port, "persistence")?.contains("aof_rewrite_in_progress:1") {
            if Instant::now() > deadline {
                bail!("the AOF rewrite on Redis port {} did not end", p.port);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(())
}

/// Starts a child and waits for its `ready` line.
fn ramlog_process(args: &[String], name: &'static str, port: u16) -> anyhow::Result<Peer> {
    let exe = std::env::current_exe().context("locating the ramlog binary")?;
    let mut child = Command::new(exe)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting ramlog {name}"))?;
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        BufReader::new(out).read_line(&mut line)?;
    }
    let peer = Peer { name, port, child };
    if !line.contains("ready") {
        bail!("ramlog {name} did not start: {line:?}");
    }
    Ok(peer)
}

/// A running ramlog cluster.
struct Ramlog {
    /// The coordinator first, then the servers; held so that dropping the cluster stops them.
    _processes: Vec<Peer>,
    coordinator: String,
    /// Cluster RESP ports of the servers.
    ports: Vec<u16>,
    /// Routing port of server 0.
    routing: u16,
    /// Admin (HTTP) ports of the servers.
    admin: Vec<u16>,
}

impl Ramlog {
    /// The coordinator first, then the servers; `replicas` backups per tablet of the default
    /// table (None: `ramlog up`'s default, 2 with 3 servers).
    fn start(work: &Path, name: &str, replicas: Option<u32>) -> anyhow::Result<Ramlog> {
        let work = work.join(name);
        let coord_port = free_port()?;
        let coordinator = format!("127.0.0.1:{coord_port}");
        let mut args: Vec<String> = vec![
            "coordinator".into(),
            "--listen".into(),
            coordinator.clone(),
            "--members".into(),
            format!("1={coordinator}"),
            "--initial-servers".into(),
            SERVERS.to_string(),
            "--data-dir".into(),
            work.join("coordinator").display().to_string(),
        ];
        if let Some(r) = replicas {
            args.extend(["--default-replicas".into(), r.to_string()]);
        }
        let mut peers = vec![ramlog_process(&args, "coordinator", coord_port)?];
        let mut ports = Vec::new();
        let mut admin = Vec::new();
        let mut routing0 = 0;
        for i in 0..SERVERS {
            let (resp, routing, admin_port) = (free_port()?, free_port()?, free_port()?);
            admin.push(admin_port);
            if i == 0 {
                routing0 = routing;
            }
            peers.push(ramlog_process(
                &[
                    "server".into(),
                    "--coordinator".into(),
                    coordinator.clone(),
                    "--resp-port".into(),
                    resp.to_string(),
                    "--routing-port".into(),
                    routing.to_string(),
                    "--native-port".into(),
                    free_port()?.to_string(),
                    "--admin-port".into(),
                    admin_port.to_string(),
                    "--data-dir".into(),
                    work.join(format!("server-{i}")).display().to_string(),
                ],
                "server",
                resp,
            )?);
            ports.push(resp);
        }
        for &p in &ports {
            wait_cluster_ok(p)?;
        }
        Ok(Ramlog {
            _processes: peers,
            coordinator,
            ports,
            routing: routing0,
            admin,
        })
    }

    /// Switches the default table to `mode` and waits until every server applied the new map.
    fn set_mode(&self, mode: &str) -> anyhow::Result<()> {
        let before = self.map_epochs()?;
        let exe = std::env::current_exe().context("locating the ramlog binary")?;
        let out = Command::new(exe)
            .args([
                "table",
                "set-mode",
                "default",
                mode,
                "--coordinator",
                &self.coordinator,
            ])
            .output()
            .context("running ramlog table set-mode")?;
        if !out.status.success() {
            bail!(
                "ramlog table set-mode: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let target = before.iter().copied().max().unwrap_or(0) + 1;
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.map_epochs()?.iter().any(|&e| e < target) {
            if Instant::now() > deadline {
                bail!("the servers did not apply the map that sets mode {mode}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The map version each server serves (CLUSTER INFO's `cluster_current_epoch`).
    fn map_epochs(&self) -> anyhow::Result<Vec<u64>> {
        self.ports
            .iter()
            .map(|&p| {
                let mut s = std::net::TcpStream::connect(("127.0.0.1", p))?;
                s.set_read_timeout(Some(Duration::from_secs(5)))?;
                use std::io::{Read, Write};
                s.write_all(b"CLUSTER INFO\r\n")?;
                let mut buf = vec![0u8; 4096];
                let n = s.read(&mut buf)?;
                String::from_utf8_lossy(&buf[..n])
                    .lines()
                    .find_map(|l| l.strip_prefix("cluster_current_epoch:"))
                    .and_then(|v| v.trim().parse().ok())
                    .context("no cluster_current_epoch in CLUSTER INFO")
            })
            .collect()
    }
}

fn run_all(
    work: &Path,
    requests_p1: u64,
    requests_p16: u64,
    repeats: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    let cluster = ["--cluster"];
    // 1. Without replication, each side.
    {
        let redis = redis_cluster(work, 0)?;
        let ramlog = Ramlog::start(work, "r0-plain", Some(0))?;
        for (pipeline, requests) in [(1u32, requests_p1), (16u32, requests_p16)] {
            // [target][op]: Redis Cluster, ramlog cluster port, ramlog routing port.
            let mut runs: [[Vec<BenchResult>; 2]; 3] = Default::default();
            for _ in 0..repeats {
                let targets: [(u16, &[&str]); 3] = [
                    (redis[0].port, &cluster),
                    (ramlog.ports[0], &cluster),
                    (ramlog.routing, &[]),
                ];
                for (t, (port, extra)) in targets.iter().enumerate() {
                    let (set, get) = redis_benchmark_with(*port, requests, pipeline, extra)?;
                    runs[t][0].push(set);
                    runs[t][1].push(get);
                }
            }
            for (o, op) in ["set", "get"].iter().enumerate() {
                let (redis_runs, cluster_runs, routing_runs) =
                    (&runs[0][o], &runs[1][o], &runs[2][o]);
                latency_rows(
                    report,
                    &format!("{op}_p{pipeline}"),
                    cluster_runs,
                    redis_runs,
                    1.2,
                );
                report.push(
                    Row::versus(
                        format!("routing_{op}_p{pipeline}_rps"),
                        median_by(routing_runs, |x| x.rps),
                        "req/s",
                        median_by(cluster_runs, |x| x.rps),
                    )
                    .with_target(Target::at_least(if pipeline == 16 {
                        0.8
                    } else {
                        0.6
                    })),
                );
            }
        }
        check_keys(&ramlog)?;
    }

    // 2. Replication: R = 2 (the default) in each mode against Redis Cluster with replicas, and
    // the cost of R = 0, 1, 2.
    let redis = redis_cluster(work, 1)?;
    let r2 = Ramlog::start(work, "r2", None)?;
    let r1 = Ramlog::start(work, "r1", Some(1))?;
    let r0 = Ramlog::start(work, "r0", Some(0))?;
    const MODES: [&str; 4] = ["async", "sync", "durable", "mirror"];
    for (pipeline, requests) in [(1u32, requests_p1), (16u32, requests_p16)] {
        let mut redis_runs: [Vec<BenchResult>; 2] = Default::default();
        // [R][mode][op]
        let mut ours: [[[Vec<BenchResult>; 2]; 4]; 3] = Default::default();
        for _ in 0..repeats {
            let (set, get) = redis_benchmark_with(redis[0].port, requests, pipeline, &cluster)?;
            redis_runs[0].push(set);
            redis_runs[1].push(get);
            for (m, mode) in MODES.iter().enumerate() {
                for (r, c) in [&r0, &r1, &r2].iter().enumerate() {
                    c.set_mode(mode)?;
                    let (set, get) =
                        redis_benchmark_with(c.ports[0], requests, pipeline, &cluster)?;
                    ours[r][m][0].push(set);
                    ours[r][m][1].push(get);
                }
            }
        }
        for (m, mode) in MODES.iter().enumerate() {
            for (o, op) in ["set", "get"].iter().enumerate() {
                let row = Row::versus(
                    format!("repl_{mode}_{op}_p{pipeline}_rps"),
                    median_by(&ours[2][m][o], |x| x.rps),
                    "req/s",
                    median_by(&redis_runs[o], |x| x.rps),
                );
                report.push(match replicated_target(mode, op, pipeline) {
                    Some(t) => row.with_target(Target::at_least(t)),
                    None => row,
                });
                report.push(Row::versus(
                    format!("repl_{mode}_{op}_p{pipeline}_p99"),
                    median_by(&ours[2][m][o], |x| x.p99_ms),
                    "ms",
                    median_by(&redis_runs[o], |x| x.p99_ms),
                ));
            }
            if *mode == "mirror" {
                // What the mirror's in-memory apply costs over `sync` (same R = 2).
                report.push(Row::versus(
                    format!("repl_mirror_set_vs_sync_p{pipeline}_rps"),
                    median_by(&ours[2][m][0], |x| x.rps),
                    "req/s",
                    median_by(&ours[2][1][0], |x| x.rps),
                ));
            }
            // The cost of backups: SET at R = 1 and 2 against R = 0, in this mode.
            let r0_set = median_by(&ours[0][m][0], |x| x.rps);
            report.push(Row::plain(
                format!("r0_{mode}_set_p{pipeline}_rps"),
                r0_set,
                "req/s",
            ));
            for (r, runs) in ours.iter().enumerate().skip(1) {
                report.push(Row::versus(
                    format!("r{r}_{mode}_set_p{pipeline}_rps"),
                    median_by(&runs[m][0], |x| x.rps),
                    "req/s",
                    r0_set,
                ));
            }
        }
    }
    drop(r0);
    drop(r1);

    // durable against Redis Cluster (with replicas) with appendfsync always.
    redis_fsync_always(&redis, true)?;
    r2.set_mode("durable")?;
    let counters = [
        "ramlog_backup_bytes_total",
        "ramlog_backup_syncs_requested_total",
    ];
    let before = metrics_sum(&r2.admin, &counters)?;
    for (pipeline, requests) in [(1u32, requests_p1), (16u32, requests_p16)] {
        let (mut theirs, mut mine) = (Vec::new(), Vec::new());
        for _ in 0..repeats {
            theirs.push(redis_benchmark_with(redis[0].port, requests, pipeline, &cluster)?.0);
            mine.push(redis_benchmark_with(r2.ports[0], requests, pipeline, &cluster)?.0);
        }
        let row = Row::versus(
            format!("durable_vs_fsync_always_set_p{pipeline}_rps"),
            median_by(&mine, |x| x.rps),
            "req/s",
            median_by(&theirs, |x| x.rps),
        );
        report.push(if pipeline == 16 {
            row.with_target(Target::at_least(2.0))
        } else {
            row
        });
        report.push(Row::versus(
            format!("durable_vs_fsync_always_set_p{pipeline}_p99"),
            median_by(&mine, |x| x.p99_ms),
            "ms",
            median_by(&theirs, |x| x.p99_ms),
        ));
    }
    drop(redis);
    // The disk's own bound on `durable`: a bare loop of one write and one fdatasync, on the same
    // file system, with the bytes of an average group commit of the runs above (their frame
    // bytes ÷ the syncs they asked for, over every backup): what a backup would pay per commit
    // with no store around it.
    let after = metrics_sum(&r2.admin, &counters)?;
    let (bytes, syncs) = (after[0] - before[0], after[1] - before[1]);
    let commit_bytes = if syncs > 0.0 {
        ((bytes / syncs) as usize).clamp(512, 16 << 20)
    } else {
        4096
    };
    let syncs_per_s = bare_sync_loop(work, commit_bytes)?;
    report.push(Row::plain("durable_group_commits", syncs, "syncs"));
    report.push(Row::plain(
        "bare_write_fdatasync_per_s",
        syncs_per_s,
        "syncs/s",
    ));
    report.push(Row::plain(
        "bare_write_fdatasync_bytes",
        commit_bytes as f64,
        "bytes",
    ));

    // 3. Backup RAM per replicated key, at rest (the stores come to rest 1 s after the last
    // append; wait for it).
    let keys = check_keys(&r2)?;
    std::thread::sleep(Duration::from_secs(3));
    let (mut per_key_parts, mut fixed_parts) = (0.0, 0.0);
    for &port in &r2.ports {
        let info = info_text(port, "memory")?;
        for line in info.lines() {
            let Some((name, value)) = line.trim().split_once(':') else {
                continue;
            };
            let Some(part) = name.strip_prefix("ramlog_memory_backup_") else {
                continue;
            };
            let bytes: f64 = value.trim().parse().unwrap_or(0.0);
            match part {
                "write_buffer" | "flush_arenas" | "reorg_buffers" | "secondary_buffers" => {
                    fixed_parts += bytes
                }
                _ => per_key_parts += bytes,
            }
        }
    }
    let replicated = (keys * 2) as f64;
    report.push(
        Row::plain(
            "backup_ram_per_replicated_key",
            per_key_parts / replicated,
            "B/key",
        )
        .with_target(Target::at_most(16.0)),
    );
    report.push(Row::plain(
        "backup_fixed_buffers_per_server",
        fixed_parts / SERVERS as f64,
        "bytes",
    ));
    report.push(Row::plain("replicated_keys", replicated, "keys"));
    drop(r2);
    Ok(())
}

/// Checks that the load reached every server of `c` and returns its keys (DBSIZE summed through
/// the routing port).
fn check_keys(c: &Ramlog) -> anyhow::Result<u64> {
    let total = command(c.routing, "DBSIZE")?;
    let keys: u64 = total
        .trim_start_matches(':')
        .parse()
        .with_context(|| format!("DBSIZE through the routing port: {total}"))?;
    if keys == 0 {
        bail!("the ramlog cluster holds no keys after the benchmark");
    }
    for &port in &c.ports {
        if command(port, "DBSIZE")? == ":0" {
            bail!("ramlog server on port {port} received no keys");
        }
    }
    Ok(keys)
}
