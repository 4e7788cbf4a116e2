//! `ramlog bench cluster`: a 3-server ramlog cluster against a Redis Cluster of 3 masters, side by
//! side in one run on this machine.
//!
//! Starts a ramlog coordinator and 3 `ramlog server --coordinator` processes (the defaults of
//! `ramlog up`), and 3 `redis-server --cluster-enabled yes` joined with `redis-cli --cluster
//! create` (no replicas, no persistence: ramlog cluster servers keep no log of their own, their
//! backups will). Then, alternating targets, `redis-benchmark --cluster -c 50 -d 100 -r 1000000
//! -t set,get` at pipeline 1 and 16 against each cluster's first server, and plain
//! `redis-benchmark` (no `--cluster`) against ramlog's routing port of server 0. Rows: ramlog's
//! cluster port against Redis Cluster (req/s, p50, p99), and the routing port against ramlog's
//! cluster port.

use crate::report::{Report, Row, Target};
use crate::resp::{
    command, free_port, latency_rows, median_by, redis_benchmark_with, wait_for_ping, which,
    BenchResult, Peer,
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
    let (requests_p1, requests_p16, repeats) = if quick {
        (30_000, 100_000, 1)
    } else {
        (300_000, 1_000_000, 5)
    };
    let work = std::env::temp_dir().join(format!("ramlog-bench-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut report = Report::new("cluster", quick);
    let result = run_all(&work, requests_p1, requests_p16, repeats, &mut report);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    report.finish(json)
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

fn redis_cluster(work: &Path) -> anyhow::Result<Vec<Peer>> {
    let mut peers = Vec::new();
    for _ in 0..SERVERS {
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
        .args(["--cluster-replicas", "0", "--cluster-yes"])
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
    Ok(peers)
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

/// The ramlog cluster: the coordinator first, then the servers; (processes, cluster ports,
/// routing port of server 0).
fn ramlog_cluster(work: &Path) -> anyhow::Result<(Vec<Peer>, Vec<u16>, u16)> {
    let coord_port = free_port()?;
    let coord = format!("127.0.0.1:{coord_port}");
    let mut peers = vec![ramlog_process(
        &[
            "coordinator".into(),
            "--listen".into(),
            coord.clone(),
            "--members".into(),
            format!("1={coord}"),
            "--initial-servers".into(),
            SERVERS.to_string(),
            "--data-dir".into(),
            work.join("coordinator").display().to_string(),
        ],
        "coordinator",
        coord_port,
    )?];
    let mut ports = Vec::new();
    let mut routing0 = 0;
    for i in 0..SERVERS {
        let (resp, routing) = (free_port()?, free_port()?);
        if i == 0 {
            routing0 = routing;
        }
        peers.push(ramlog_process(
            &[
                "server".into(),
                "--coordinator".into(),
                coord.clone(),
                "--resp-port".into(),
                resp.to_string(),
                "--routing-port".into(),
                routing.to_string(),
                "--native-port".into(),
                free_port()?.to_string(),
                "--admin-port".into(),
                "0".into(),
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
    Ok((peers, ports, routing0))
}

fn run_all(
    work: &Path,
    requests_p1: u64,
    requests_p16: u64,
    repeats: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    let redis = redis_cluster(work)?;
    let (ramlog, ramlog_ports, routing) = ramlog_cluster(work)?;
    let cluster = ["--cluster"];
    for (pipeline, requests) in [(1u32, requests_p1), (16u32, requests_p16)] {
        // [target][op]: Redis Cluster, ramlog cluster port, ramlog routing port.
        let mut runs: [[Vec<BenchResult>; 2]; 3] = Default::default();
        for _ in 0..repeats {
            let targets: [(u16, &[&str]); 3] = [
                (redis[0].port, &cluster),
                (ramlog_ports[0], &cluster),
                (routing, &[]),
            ];
            for (t, (port, extra)) in targets.iter().enumerate() {
                let (set, get) = redis_benchmark_with(*port, requests, pipeline, extra)?;
                runs[t][0].push(set);
                runs[t][1].push(get);
            }
        }
        for (o, op) in ["set", "get"].iter().enumerate() {
            let (redis_runs, cluster_runs, routing_runs) = (&runs[0][o], &runs[1][o], &runs[2][o]);
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
                .with_target(Target::at_least(0.6)),
            );
        }
    }
    // Every key redis-benchmark wrote is on its master: DBSIZE of the servers adds up through the
    // routing port (a check that the load reached all three).
    let total = command(routing, "DBSIZE")?;
    let keys: u64 = total
        .trim_start_matches(':')
        .parse()
        .with_context(|| format!("DBSIZE through the routing port: {total}"))?;
    if keys == 0 {
        bail!("the ramlog cluster holds no keys after the benchmark");
    }
    for &port in &ramlog_ports {
        let own = command(port, "DBSIZE")?;
        if own == ":0" {
            bail!("ramlog server on port {port} received no keys");
        }
    }
    report.push(Row::plain("ramlog_keys_after", keys as f64, "keys"));
    drop(ramlog);
    drop(redis);
    Ok(())
}
