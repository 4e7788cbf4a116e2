//! `ramlog bench native`: the native protocol and the Rust client, against RESP on the same server.
//!
//! Starts one `ramlog server` (persistence off), loads the keyspace with 100-byte values over the native
//! protocol, then measures GET and PUT at pipeline depths 1 and 16 with the Rust client: 50 concurrent
//! callers multiplexed on a pool of 2 connections, on one client thread. The baselines are measured in
//! the same run: `redis-benchmark` (50 clients, same value size, key count and depth) against the same
//! server's RESP port for throughput and tail latency, and a loopback TCP round trip (the physical limit)
//! for the median latency of one caller's unpipelined GETs. No targets: the issue sets none for the
//! native path.

use crate::report::{Report, Row};
use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use ramlog_client::{Client, ClientConfig, Request, Response};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CALLERS: usize = 50;
const VALUE_BYTES: usize = 100;

struct Sizes {
    keys: u64,
    cell: Duration,
    redis_requests_p1: u64,
    redis_requests_p16: u64,
    rtt_samples: usize,
}

pub fn run(quick: bool, json: Option<&Path>) -> anyhow::Result<()> {
    let sizes = if quick {
        Sizes {
            keys: 100_000,
            cell: Duration::from_secs(2),
            redis_requests_p1: 100_000,
            redis_requests_p16: 400_000,
            rtt_samples: 5_000,
        }
    } else {
        Sizes {
            keys: 1_000_000,
            cell: Duration::from_secs(8),
            redis_requests_p1: 600_000,
            redis_requests_p16: 4_000_000,
            rtt_samples: 50_000,
        }
    };
    let mut report = Report::new("native", quick);
    let server = Server::start()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let rtt_p50_us = loopback_rtt_p50_us(sizes.rtt_samples)?;
    let (native, single_p50_us) = runtime.block_on(native_cells(&server, &sizes))?;
    report.push(Row::versus(
        "native GET one caller p50 (vs loopback RTT)",
        single_p50_us,
        "us",
        rtt_p50_us,
    ));
    let redis_benchmark = which("redis-benchmark");
    for (depth, (put, get)) in [1u32, 16].into_iter().zip(native) {
        let resp = match &redis_benchmark {
            Some(_) => Some(redis_benchmark_cells(server.resp_port, &sizes, depth)?),
            None => None,
        };
        for (op, resp_op, cell, resp_cell) in [
            ("GET", "GET", &get, resp.map(|r| r.1)),
            ("PUT", "SET", &put, resp.map(|r| r.0)),
        ] {
            let name = format!("native {op} P{depth} req/s (vs RESP {resp_op})");
            report.push(match resp_cell {
                Some(r) => Row::versus(name, cell.rps, "req/s", r.rps),
                None => Row::plain(name, cell.rps, "req/s"),
            });
            let name = format!("native {op} P{depth} p99 (vs RESP {resp_op})");
            report.push(match resp_cell {
                Some(r) => Row::versus(name, cell.p99_us, "us", r.p99_us),
                None => Row::plain(name, cell.p99_us, "us"),
            });
        }
    }
    if redis_benchmark.is_none() {
        println!("redis-benchmark not found: RESP baselines skipped");
    }
    report.finish(json)
}

#[derive(Clone, Copy, Debug)]
struct Cell {
    rps: f64,
    p99_us: f64,
}

struct Server {
    child: Child,
    resp_port: u16,
    native_port: u16,
    data_dir: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}

/// Two distinct free loopback ports: both probe sockets are held open together, so the kernel
/// cannot hand out the same port twice.
fn two_free_ports() -> anyhow::Result<(u16, u16)> {
    let a = TcpListener::bind("127.0.0.1:0")?;
    let b = TcpListener::bind("127.0.0.1:0")?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(tool))
        .find(|p| p.is_file())
}

impl Server {
    fn start() -> anyhow::Result<Server> {
        let exe = std::env::current_exe().context("finding the ramlog binary")?;
        let (resp_port, native_port) = two_free_ports()?;
        let data_dir =
            std::env::temp_dir().join(format!("ramlog-bench-native-{}", std::process::id()));
        std::fs::create_dir_all(&data_dir)?;
        let child = Command::new(exe)
            .arg("server")
            .args(["--resp-port", &resp_port.to_string()])
            .args(["--native-port", &native_port.to_string()])
            .args([
                "--admin-port",
                "0",
                "--memory",
                "2GiB",
                "--persistence",
                "off",
            ])
            .args(["--data-dir", data_dir.to_str().context("temp dir path")?])
            .env_remove("RAMLOG_PASSWORD")
            .env_remove("RAMLOG_CONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting ramlog server")?;
        let server = Server {
            child,
            resp_port,
            native_port,
            data_dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", native_port)).is_err() {
            if Instant::now() > deadline {
                bail!("ramlog server did not open its native port");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(server)
    }
}

fn key(i: u64) -> String {
    // redis-benchmark's `-r` key format, so both clients address the same keyspace.
    format!("key:{i:012}")
}

async fn native_cells(server: &Server, sizes: &Sizes) -> anyhow::Result<(Vec<(Cell, Cell)>, f64)> {
    let mut config = ClientConfig::new(format!("127.0.0.1:{}", server.native_port));
    config.connections = 2;
    config.request_timeout = Duration::from_secs(30);
    let client = Client::connect(config).await?;
    // Load the keyspace in pipelined batches.
    let value = vec![b'x'; VALUE_BYTES];
    let mut next = 0u64;
    while next < sizes.keys {
        let keys: Vec<String> = (next..(next + 1000).min(sizes.keys)).map(key).collect();
        let puts: Vec<Request> = keys
            .iter()
            .map(|k| Request::Put {
                table: 0,
                key: k.as_bytes(),
                value: &value,
                condition: Default::default(),
                expiry: Default::default(),
                return_old: false,
            })
            .collect();
        for reply in client.pipeline(&puts).await? {
            reply?;
        }
        next += 1000;
    }
    let single_p50_us = single_caller_get_p50_us(&client, sizes).await?;
    let mut cells = Vec::new();
    for depth in [1usize, 16] {
        let put = measure(&client, sizes, depth, true).await?;
        let get = measure(&client, sizes, depth, false).await?;
        cells.push((put, get));
    }
    Ok((cells, single_p50_us))
}

/// Runs CALLERS concurrent loops for `sizes.cell`; each sends `depth` requests at a time.
async fn measure(
    client: &Client,
    sizes: &Sizes,
    depth: usize,
    write: bool,
) -> anyhow::Result<Cell> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for caller in 0..CALLERS {
        let client = client.clone();
        let keys = sizes.keys;
        let cell = sizes.cell;
        tasks.push(tokio::spawn(async move {
            let mut rng = SmallRng::seed_from_u64(caller as u64);
            let mut histogram = latency_histogram();
            let value = vec![b'v'; VALUE_BYTES];
            let mut done = 0u64;
            while started.elapsed() < cell {
                let batch: Vec<String> = (0..depth).map(|_| key(rng.gen_range(0..keys))).collect();
                let requests: Vec<Request> = batch
                    .iter()
                    .map(|k| {
                        if write {
                            Request::Put {
                                table: 0,
                                key: k.as_bytes(),
                                value: &value,
                                condition: Default::default(),
                                expiry: Default::default(),
                                return_old: false,
                            }
                        } else {
                            Request::Get {
                                table: 0,
                                key: k.as_bytes(),
                            }
                        }
                    })
                    .collect();
                let t0 = Instant::now();
                let replies = if depth == 1 {
                    vec![client.request(&requests[0]).await]
                } else {
                    client.pipeline(&requests).await?
                };
                // With pipelining every request of a batch waits for the batch, as in redis-benchmark.
                let elapsed_us = t0.elapsed().as_micros() as u64;
                for reply in replies {
                    match reply? {
                        Response::Error(e) => anyhow::bail!("server error: {}", e.message),
                        Response::Get(None) => anyhow::bail!("a loaded key is missing"),
                        _ => {}
                    }
                    histogram.saturating_record(elapsed_us);
                    done += 1;
                }
            }
            Ok::<_, anyhow::Error>((done, histogram))
        }));
    }
    let mut total = 0;
    let mut histogram = latency_histogram();
    for task in tasks {
        let (done, h) = task.await??;
        total += done;
        histogram.add(h)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    Ok(Cell {
        rps: total as f64 / seconds,
        p99_us: histogram.value_at_quantile(0.99) as f64,
    })
}

/// A histogram of values from 1 to an hour in microseconds (or ~3.6 s in nanoseconds), 3 digits.
fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

/// Median latency of GETs sent one at a time by a single caller: the protocol's own cost over loopback.
async fn single_caller_get_p50_us(client: &Client, sizes: &Sizes) -> anyhow::Result<f64> {
    let mut rng = SmallRng::seed_from_u64(99);
    let mut histogram = latency_histogram();
    for _ in 0..sizes.rtt_samples {
        let k = key(rng.gen_range(0..sizes.keys));
        let t0 = Instant::now();
        if client.get(k.as_bytes()).await?.is_none() {
            bail!("a loaded key is missing");
        }
        histogram.saturating_record(t0.elapsed().as_nanos() as u64);
    }
    Ok(histogram.value_at_quantile(0.5) as f64 / 1000.0)
}

/// SET and GET results of one redis-benchmark run against the server's RESP port.
fn redis_benchmark_cells(port: u16, sizes: &Sizes, depth: u32) -> anyhow::Result<(Cell, Cell)> {
    let requests = if depth == 1 {
        sizes.redis_requests_p1
    } else {
        sizes.redis_requests_p16
    };
    let out = Command::new("redis-benchmark")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-c",
            &CALLERS.to_string(),
        ])
        .args([
            "-d",
            &VALUE_BYTES.to_string(),
            "-r",
            &sizes.keys.to_string(),
        ])
        .args([
            "-n",
            &requests.to_string(),
            "-P",
            &depth.to_string(),
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
    parse_csv(&String::from_utf8_lossy(&out.stdout))
}

/// `--csv` output: a header naming `rps` and `p99_latency_ms` (among others), then one row per test.
fn parse_csv(text: &str) -> anyhow::Result<(Cell, Cell)> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines
        .next()
        .context("empty redis-benchmark output")?
        .split(',')
        .map(|f| f.trim_matches('"'))
        .collect();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .with_context(|| format!("no column {name}"))
    };
    let (rps, p99) = (col("rps")?, col("p99_latency_ms")?);
    let (mut set, mut get) = (None, None);
    for line in lines {
        let fields: Vec<&str> = line.split(',').map(|f| f.trim_matches('"')).collect();
        let num =
            |i: usize| -> anyhow::Result<f64> { Ok(fields.get(i).context("short row")?.parse()?) };
        let cell = Cell {
            rps: num(rps)?,
            p99_us: num(p99)? * 1000.0,
        };
        match fields.first().copied() {
            Some("SET") => set = Some(cell),
            Some("GET") => get = Some(cell),
            _ => {}
        }
    }
    Ok((set.context("no SET row")?, get.context("no GET row")?))
}

/// Median round trip of one byte over loopback TCP between two threads: the floor of any request.
fn loopback_rtt_p50_us(samples: usize) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut b = [0u8; 1];
        while s.read(&mut b)? == 1 {
            s.write_all(&b)?;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let mut histogram = latency_histogram();
    let mut b = [7u8; 1];
    for _ in 0..samples {
        let t0 = Instant::now();
        s.write_all(&b)?;
        s.read_exact(&mut b)?;
        histogram.saturating_record(t0.elapsed().as_nanos() as u64);
    }
    drop(s);
    let _ = echo.join();
    Ok(histogram.value_at_quantile(0.5) as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_redis_benchmark_csv() {
        let text = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\"SET\",\"100000.00\",\"0.3\",\"0.1\",\"0.250\",\"0.5\",\"0.900\",\"2.0\"\n\"GET\",\"120000.00\",\"0.2\",\"0.1\",\"0.200\",\"0.4\",\"0.700\",\"1.0\"\n";
        let (set, get) = parse_csv(text).unwrap();
        assert_eq!((set.rps, set.p99_us), (100000.0, 900.0));
        assert_eq!((get.rps, get.p99_us), (120000.0, 700.0));
    }

    #[test]
    fn keys_match_redis_benchmark() {
        assert_eq!(key(42), "key:000000000042");
    }
}
