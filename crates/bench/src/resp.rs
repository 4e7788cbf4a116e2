//! `ramlog bench resp`: ramlog's RESP server against Redis, side by side in one run.
//!
//! Starts `redis-server` (no persistence) and `ramlog server` (persistence off) as child processes
//! on free loopback ports, then:
//! - memory: loads the same keys with 100 B values over RESP (pipelined SETs) into each and compares
//!   resident memory per key (RSS of the process after the load, divided by the keys);
//! - throughput: runs `redis-benchmark -c 50 -d 100 -r 1000000 -t set,get` at pipeline depths 1 and
//!   16 against each, alternating targets, and compares requests/s, p50 and p99.
//!
//! A second row set (`persist_`) does the same with persistence on, the configuration `ramlog up`
//! runs (ramlog `async`, Redis `appendonly yes` + `appendfsync everysec`), and adds a steady-state
//! row: memory per key after the whole key set has been overwritten twice more.
//!
//! ramlog runs with its default memory budget (`ramlog up`'s, 1 GiB), which bounds the log, the
//! index and the backup store's buffers and per-key state together.

use crate::report::{Report, Row, Target};
use anyhow::{bail, Context};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) const VALUE_BYTES: usize = 100;
pub(crate) const CLIENTS: u32 = 50;
pub(crate) const KEYSPACE: u64 = 1_000_000;

struct Sizes {
    memory_keys: u64,
    /// Budget and tablets of the small-budget rows, and their overwrite rounds.
    small_budget: (u64, u16),
    small_budget_rounds: u8,
    requests_p1: u64,
    requests_p16: u64,
    repeats: usize,
}

pub fn run(quick: bool, json: Option<&Path>) -> anyhow::Result<()> {
    for tool in ["redis-server", "redis-benchmark"] {
        if which(tool).is_none() {
            bail!("{tool} not found in PATH (install the redis-server and redis-tools packages; scripts/test does)");
        }
    }
    let sizes = if quick {
        Sizes {
            memory_keys: 200_000,
            small_budget: (64 << 20, 64),
            small_budget_rounds: 1,
            requests_p1: 50_000,
            requests_p16: 200_000,
            repeats: 1,
        }
    } else {
        Sizes {
            memory_keys: 2_000_000,
            small_budget: (256 << 20, 256),
            small_budget_rounds: 3,
            requests_p1: 500_000,
            requests_p16: 2_000_000,
            // Single runs move by ±10% on a shared 2-core machine; five give a steadier median.
            repeats: 5,
        }
    };
    let work = std::env::temp_dir().join(format!("ramlog-bench-resp-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut report = Report::new("resp", quick);
    let result = run_all(&sizes, &work, &mut report);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    report.finish(json)
}

fn run_all(sizes: &Sizes, work: &Path, report: &mut Report) -> anyhow::Result<()> {
    // Memory and throughput with persistence off on both sides.
    {
        let redis = Peer::redis(work, false)?;
        let ramlog = Peer::ramlog(work, "off")?;
        memory_rows(sizes, &redis, &ramlog, "", 0.75, report)?;
        flush(redis.port)?;
        flush(ramlog.port)?;
        throughput_rows(sizes, &redis, &ramlog, "", report)?;
    }
    small_budget_rows(sizes, work, report)?;
    // Persistence on: ramlog `async` (100 ms flush) against Redis appendfsync everysec.
    {
        let ramlog = Peer::ramlog(work, "async")?;
        let redis = Peer::redis(work, true)?;
        memory_rows(sizes, &redis, &ramlog, "persist_", 0.8, report)?;
        overwrite_rows(sizes, &redis, &ramlog, "persist_", report)?;
        flush(redis.port)?;
        flush(ramlog.port)?;
        throughput_rows(sizes, &redis, &ramlog, "persist_", report)?;
    }
    Ok(())
}

/// A server under test, stopped when dropped.
pub(crate) struct Peer {
    pub(crate) name: &'static str,
    pub(crate) port: u16,
    pub(crate) child: Child,
}

impl Drop for Peer {
    fn drop(&mut self) {
        // SAFETY: kill(2) with a pid we own; a failure only means it already exited.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Peer {
    pub(crate) fn redis(work: &Path, persistence: bool) -> anyhow::Result<Peer> {
        let port = free_port()?;
        let dir = work.join(format!("redis-{port}"));
        std::fs::create_dir_all(&dir)?;
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ]);
        cmd.arg("--dir").arg(&dir);
        if persistence {
            cmd.args(["--appendonly", "yes", "--appendfsync", "everysec"]);
        } else {
            cmd.args(["--appendonly", "no"]);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server")?;
        let peer = Peer {
            name: "redis",
            port,
            child,
        };
        wait_for_ping(port)?;
        Ok(peer)
    }

    pub(crate) fn ramlog(work: &Path, persistence: &str) -> anyhow::Result<Peer> {
        Peer::ramlog_with(work, persistence, &[])
    }

    /// `ramlog server` with more flags.
    fn ramlog_with(work: &Path, persistence: &str, extra: &[&str]) -> anyhow::Result<Peer> {
        let port = free_port()?;
        let dir = work.join(format!("ramlog-{port}"));
        let exe = std::env::current_exe().context("locating the ramlog binary")?;
        let mut child = Command::new(exe)
            .args([
                "server",
                "--resp-port",
                &port.to_string(),
                "--admin-port",
                "0",
                "--native-port",
                "0",
            ])
            .args(["--persistence", persistence])
            .args(extra)
            .arg("--data-dir")
            .arg(&dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting ramlog server")?;
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            BufReader::new(out).read_line(&mut line)?;
        }
        if !line.contains("ready") {
            let _ = child.kill();
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            let _ = child.wait();
            bail!(
                "ramlog server did not start: {}",
                err.lines().next().unwrap_or("").trim()
            );
        }
        let peer = Peer {
            name: "ramlog",
            port,
            child,
        };
        wait_for_ping(port)?;
        Ok(peer)
    }

    pub(crate) fn rss_bytes(&self) -> u64 {
        let text = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .map(|kib| kib * 1024)
            .unwrap_or(0)
    }
}

pub(crate) fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|p| p.join(tool))
        .find(|p| p.is_file())
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub(crate) fn connect(port: u16) -> anyhow::Result<TcpStream> {
    let s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    Ok(s)
}

pub(crate) fn wait_for_ping(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(mut s) = connect(port) {
            let mut buf = [0u8; 7];
            if s.write_all(b"PING\r\n").is_ok()
                && s.read_exact(&mut buf).is_ok()
                && &buf == b"+PONG\r\n"
            {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("server on port {port} did not answer PING");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends one command and reads one line-sized reply.
pub(crate) fn command(port: u16, line: &str) -> anyhow::Result<String> {
    let mut s = connect(port)?;
    s.write_all(format!("{line}\r\n").as_bytes())?;
    let mut reader = BufReader::new(s);
    let mut reply = String::new();
    reader.read_line(&mut reply)?;
    Ok(reply.trim_end().to_string())
}

/// One numeric field of an INFO section.
pub(crate) fn info_field(port: u16, section: &str, field: &str) -> anyhow::Result<f64> {
    let body = info_text(port, section)?;
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("no {field} in INFO {section}"))
}

/// The text of an INFO section.
pub(crate) fn info_text(port: u16, section: &str) -> anyhow::Result<String> {
    let mut s = connect(port)?;
    s.write_all(format!("INFO {section}\r\n").as_bytes())?;
    let mut reader = BufReader::new(s);
    let mut header = String::new();
    reader.read_line(&mut header)?;
    let len: usize = header
        .trim_end()
        .strip_prefix('$')
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("INFO reply {header:?}"))?;
    let mut body = vec![0u8; len + 2];
    reader.read_exact(&mut body)?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

pub(crate) fn flush(port: u16) -> anyhow::Result<()> {
    let reply = command(port, "FLUSHALL")?;
    if reply != "+OK" {
        bail!("FLUSHALL on port {port}: {reply}");
    }
    Ok(())
}

/// Loads `keys` keys of 100 B values with pipelined SETs (1000 per round trip); `round` picks
/// the value's filler byte, so that each round overwrites with different bytes. Fails on the
/// first SET that fails.
fn load(port: u16, keys: u64, round: u8) -> anyhow::Result<()> {
    let failed = load_range(port, 0..keys, round, false)?;
    debug_assert_eq!(failed, 0);
    Ok(())
}

/// SETs keys `range` as [`load`] does; with `count_failures` a failed SET is counted and the
/// load goes on, otherwise it fails the load. Returns the failed SETs.
fn load_range(
    port: u16,
    range: std::ops::Range<u64>,
    round: u8,
    count_failures: bool,
) -> anyhow::Result<u64> {
    const BATCH: u64 = 1000;
    let mut s = connect(port)?;
    let value = vec![b'a' + round % 26; VALUE_BYTES];
    let mut out = Vec::with_capacity(64 * 1024);
    let mut reply = vec![0u8; (BATCH as usize) * 5];
    let mut failed = 0;
    let mut next = range.start;
    let mut reader = BufReader::new(s.try_clone()?);
    while next < range.end {
        out.clear();
        let n = BATCH.min(range.end - next);
        for i in next..next + n {
            let key = format!("key:{i:012}");
            out.extend_from_slice(
                format!(
                    "*3\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${}\r\n",
                    key.len(),
                    VALUE_BYTES
                )
                .as_bytes(),
            );
            out.extend_from_slice(&value);
            out.extend_from_slice(b"\r\n");
        }
        s.write_all(&out)?;
        if count_failures {
            // Replies are +OK or an error line (OOM): read them line by line.
            let mut line = String::new();
            for _ in 0..n {
                line.clear();
                reader.read_line(&mut line).context("reading SET replies")?;
                if line != "+OK\r\n" {
                    if !line.starts_with('-') {
                        bail!("unexpected reply to SET on port {port}: {line:?}");
                    }
                    failed += 1;
                }
            }
        } else {
            let want = n as usize * 5;
            reader
                .read_exact(&mut reply[..want])
                .context("reading SET replies")?;
            if reply[..want].chunks(5).any(|r| r != b"+OK\r\n") {
                bail!(
                    "a SET failed while loading port {port}: {}",
                    String::from_utf8_lossy(&reply[..want.min(200)])
                );
            }
        }
        next += n;
    }
    Ok(failed)
}

/// Memory per key after loading `memory_keys` distinct keys into each peer; `target` is the
/// bound on ramlog's RSS per key as a share of Redis's.
fn memory_rows(
    sizes: &Sizes,
    redis: &Peer,
    ramlog: &Peer,
    prefix: &str,
    target: f64,
    report: &mut Report,
) -> anyhow::Result<()> {
    let mut per_key = Vec::new();
    for peer in [redis, ramlog] {
        let before = peer.rss_bytes();
        let started = Instant::now();
        load(peer.port, sizes.memory_keys, 0)?;
        let secs = started.elapsed().as_secs_f64();
        std::thread::sleep(Duration::from_millis(200));
        let after = peer.rss_bytes();
        expect_keys(peer, sizes.memory_keys, "loading")?;
        per_key.push((
            after as f64 / sizes.memory_keys as f64,
            (after.saturating_sub(before)) as f64 / sizes.memory_keys as f64,
            sizes.memory_keys as f64 / secs,
        ));
    }
    let (redis, ramlog) = (per_key[0], per_key[1]);
    report.push(
        Row::versus(
            format!("{prefix}memory_rss_per_key"),
            ramlog.0,
            "B",
            redis.0,
        )
        .with_target(Target::at_most(target)),
    );
    report.push(Row::versus(
        format!("{prefix}memory_rss_growth_per_key"),
        ramlog.1,
        "B",
        redis.1,
    ));
    report.push(Row::versus(
        format!("{prefix}memory_load_pipelined_set"),
        ramlog.2,
        "keys/s",
        redis.2,
    ));
    Ok(())
}

/// Fails unless `peer` holds exactly `keys` keys (after `what`).
fn expect_keys(peer: &Peer, keys: u64, what: &str) -> anyhow::Result<()> {
    let dbsize = command(peer.port, "DBSIZE")?;
    if dbsize != format!(":{keys}") {
        bail!("{} holds {dbsize} keys after {what} {keys}", peer.name);
    }
    Ok(())
}

/// Steady state under overwrites: after `memory_rows` loaded the keys, overwrites every key twice
/// more (new bytes each round) in each peer, waits a second for background work (ramlog's cleaner
/// and backup reorganization, Redis's AOF rewrite) and compares RSS per key, and the overwrite
/// rate.
fn overwrite_rows(
    sizes: &Sizes,
    redis: &Peer,
    ramlog: &Peer,
    prefix: &str,
    report: &mut Report,
) -> anyhow::Result<()> {
    const ROUNDS: u8 = 2;
    let mut figures = Vec::new();
    for peer in [redis, ramlog] {
        let started = Instant::now();
        for round in 1..=ROUNDS {
            load(peer.port, sizes.memory_keys, round)?;
        }
        let secs = started.elapsed().as_secs_f64();
        std::thread::sleep(Duration::from_secs(1));
        let rss = peer.rss_bytes();
        expect_keys(peer, sizes.memory_keys, "overwriting")?;
        figures.push((
            rss as f64 / sizes.memory_keys as f64,
            (sizes.memory_keys * ROUNDS as u64) as f64 / secs,
        ));
    }
    let (redis, ramlog) = (figures[0], figures[1]);
    // No target: below its budget the log takes fresh memory while at least half of what it
    // holds is live, and recycles segments below 50% live only past that (docs/architecture.md,
    // "Recycling before fresh memory"), where Redis frees each overwritten value at once; the
    // row shows what that costs against Redis at the default budget.
    report.push(Row::versus(
        format!("{prefix}memory_rss_per_key_after_overwrites"),
        ramlog.0,
        "B",
        redis.0,
    ));
    report.push(Row::versus(
        format!("{prefix}overwrite_pipelined_set"),
        ramlog.1,
        "keys/s",
        redis.1,
    ));
    Ok(())
}

/// A small budget with many tablets, persistence on (`async`): ramlog alone, against its own
/// budget. Loads keys in steps until the log is `SMALL_BUDGET_FILL` full (live bytes over the
/// log's capacity), then overwrites all of them `small_budget_rounds` times. Reports the failed
/// writes (target 0: writes fail only above the documented utilisation limit), the utilisation
/// reached, and the peak RSS over the budget (target ≤ 1.2: the budget bounds the log, the index
/// and the backup store together).
fn small_budget_rows(sizes: &Sizes, work: &Path, report: &mut Report) -> anyhow::Result<()> {
    const SMALL_BUDGET_FILL: f64 = 0.85;
    const STEP: u64 = 50_000;
    let (budget, tablets) = sizes.small_budget;
    let config = work.join(format!("tablets-{tablets}.toml"));
    std::fs::write(&config, format!("tablets = {tablets}\n"))?;
    let budget_arg = budget.to_string();
    let peer = Peer::ramlog_with(
        work,
        "async",
        &[
            "--memory",
            &budget_arg,
            "--config",
            config.to_str().context("config path")?,
        ],
    )?;
    let mut keys = 0;
    let mut rss_peak = 0u64;
    let mut utilisation_max: f64 = 0.0;
    let mut failed = 0;
    // Steps of STEP keys, then, once the bytes per key are known, up to the fill.
    let mut step = STEP;
    loop {
        failed += load_range(peer.port, keys..keys + step, 0, true)?;
        keys += step;
        rss_peak = rss_peak.max(peer.rss_bytes());
        let u = info_field(peer.port, "memory", "ramlog_memory_utilisation")?;
        utilisation_max = utilisation_max.max(u);
        let wanted = (keys as f64 * SMALL_BUDGET_FILL / u.max(1e-6)) as u64;
        if u >= SMALL_BUDGET_FILL - 0.002 || failed > 0 || wanted <= keys {
            break;
        }
        step = (wanted - keys).min(STEP);
    }
    let started = Instant::now();
    for round in 1..=sizes.small_budget_rounds {
        let mut at = 0;
        while at < keys {
            let end = (at + STEP).min(keys);
            failed += load_range(peer.port, at..end, round, true)?;
            at = end;
            rss_peak = rss_peak.max(peer.rss_bytes());
            let u = info_field(peer.port, "memory", "ramlog_memory_utilisation")?;
            utilisation_max = utilisation_max.max(u);
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let name = format!("small_budget_{}MiB_{tablets}_tablets", budget >> 20);
    println!(
        "{name}: {keys} keys, {} overwrite rounds, {failed} failed writes, utilisation up to {utilisation_max:.3}, peak RSS {} MiB",
        sizes.small_budget_rounds,
        rss_peak >> 20
    );
    report.push(
        Row::plain(format!("{name}/failed_writes"), failed as f64, "writes")
            .with_target(Target::at_most(0.0)),
    );
    report.push(
        Row::plain(format!("{name}/utilisation_max"), utilisation_max, "frac")
            .with_target(Target::at_least(SMALL_BUDGET_FILL)),
    );
    report.push(
        Row::plain(
            format!("{name}/rss_peak_over_budget"),
            rss_peak as f64 / budget as f64,
            "x",
        )
        .with_target(Target::at_most(1.2)),
    );
    report.push(Row::plain(
        format!("{name}/overwrite_pipelined_set"),
        (keys * u64::from(sizes.small_budget_rounds)) as f64 / secs,
        "keys/s",
    ));
    Ok(())
}

#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct BenchResult {
    pub(crate) rps: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
}

/// Runs redis-benchmark once and returns the SET and GET results.
fn redis_benchmark(
    port: u16,
    requests: u64,
    pipeline: u32,
) -> anyhow::Result<(BenchResult, BenchResult)> {
    redis_benchmark_with(port, requests, pipeline, &[])
}

/// [`redis_benchmark`] with more flags (`--cluster`).
pub(crate) fn redis_benchmark_with(
    port: u16,
    requests: u64,
    pipeline: u32,
    extra: &[&str],
) -> anyhow::Result<(BenchResult, BenchResult)> {
    let out = Command::new("redis-benchmark")
        .args(extra)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args([
            "-c",
            &CLIENTS.to_string(),
            "-d",
            &VALUE_BYTES.to_string(),
            "-r",
            &KEYSPACE.to_string(),
        ])
        .args([
            "-n",
            &requests.to_string(),
            "-P",
            &pipeline.to_string(),
            "-t",
            "set,get",
            "--csv",
        ])
        .output()
        .context("running redis-benchmark")?;
    if !out.status.success() {
        bail!(
            "redis-benchmark failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    parse_csv(&text).with_context(|| format!("parsing redis-benchmark output: {text}"))
}

/// Parses `--csv` output: a header with `test,rps,...,p50_latency_ms,...,p99_latency_ms,...`, then rows.
pub(crate) fn parse_csv(text: &str) -> anyhow::Result<(BenchResult, BenchResult)> {
    // `--cluster` prints the masters it found before the CSV.
    let mut lines = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .skip_while(|l| !l.starts_with("\"test\""));
    let header: Vec<String> = lines
        .next()
        .context("empty output")?
        .split(',')
        .map(|f| f.trim_matches('"').to_string())
        .collect();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .with_context(|| format!("no column {name}"))
    };
    let (rps, p50, p99) = (col("rps")?, col("p50_latency_ms")?, col("p99_latency_ms")?);
    let mut set = None;
    let mut get = None;
    for line in lines {
        let fields: Vec<&str> = line.split(',').map(|f| f.trim_matches('"')).collect();
        let num =
            |i: usize| -> anyhow::Result<f64> { Ok(fields.get(i).context("short row")?.parse()?) };
        let result = BenchResult {
            rps: num(rps)?,
            p50_ms: num(p50)?,
            p99_ms: num(p99)?,
        };
        match fields.first().copied() {
            Some("SET") => set = Some(result),
            Some("GET") => get = Some(result),
            _ => {}
        }
    }
    Ok((set.context("no SET row")?, get.context("no GET row")?))
}

pub(crate) fn median_by(results: &[BenchResult], f: impl Fn(&BenchResult) -> f64) -> f64 {
    let values: Vec<f64> = results.iter().map(f).collect();
    crate::util::median(&values)
}

/// The rows `<name>_rps` (target ≥ 1.0×), `_p50` and `_p99` (target ≤ `p99_max`×) of `ours`
/// against `theirs`, as medians of the runs.
pub(crate) fn latency_rows(
    report: &mut Report,
    name: &str,
    ours: &[BenchResult],
    theirs: &[BenchResult],
    p99_max: f64,
) {
    report.push(
        Row::versus(
            format!("{name}_rps"),
            median_by(ours, |x| x.rps),
            "req/s",
            median_by(theirs, |x| x.rps),
        )
        .with_target(Target::at_least(1.0)),
    );
    report.push(Row::versus(
        format!("{name}_p50"),
        median_by(ours, |x| x.p50_ms),
        "ms",
        median_by(theirs, |x| x.p50_ms),
    ));
    report.push(
        Row::versus(
            format!("{name}_p99"),
            median_by(ours, |x| x.p99_ms),
            "ms",
            median_by(theirs, |x| x.p99_ms),
        )
        .with_target(Target::at_most(p99_max)),
    );
}

fn throughput_rows(
    sizes: &Sizes,
    redis: &Peer,
    ramlog: &Peer,
    prefix: &str,
    report: &mut Report,
) -> anyhow::Result<()> {
    for (pipeline, requests) in [(1u32, sizes.requests_p1), (16u32, sizes.requests_p16)] {
        // [target][op] -> runs; targets alternate so that drift in the machine hits both alike.
        let mut runs: [[Vec<BenchResult>; 2]; 2] = Default::default();
        for _ in 0..sizes.repeats {
            for (t, peer) in [redis, ramlog].iter().enumerate() {
                let (set, get) = redis_benchmark(peer.port, requests, pipeline)?;
                runs[t][0].push(set);
                runs[t][1].push(get);
            }
        }
        for (o, op) in ["set", "get"].iter().enumerate() {
            let name = format!("{prefix}{op}_p{pipeline}");
            latency_rows(report, &name, &runs[1][o], &runs[0][o], 1.0);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_redis_benchmark_csv() {
        let text = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\"SET\",\"98039.22\",\"0.300\",\"0.080\",\"0.287\",\"0.439\",\"0.567\",\"1.511\"\n\"GET\",\"99009.90\",\"0.290\",\"0.072\",\"0.279\",\"0.423\",\"0.551\",\"0.879\"\n";
        let (set, get) = parse_csv(text).unwrap();
        assert_eq!(set.rps, 98039.22);
        assert_eq!(set.p50_ms, 0.287);
        assert_eq!(get.p99_ms, 0.551);
        assert!(parse_csv("").is_err());
        assert!(parse_csv("\"test\",\"rps\"\n").is_err());
    }
}
