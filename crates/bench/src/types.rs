//! `ramlog bench types`: the Redis data types against Redis, side by side in one run.
//!
//! Starts `redis-server` (`appendonly yes`, `appendfsync everysec`) and `ramlog server` with
//! persistence `async`, the configuration `ramlog up` runs, then:
//! - throughput: redis-benchmark's own tests `-t hset,lpush,lpop,rpush,rpop,sadd,spop,zadd,
//!   zpopmin,lrange_100` (`-c 50`, its default keys) at pipeline depths 1 and 16 against each,
//!   alternating targets, medians of the runs; a row per test and depth, ratio ramlog ÷ Redis;
//! - memory per element: small collections (keys of 10 elements) and large ones (keys of 10,000
//!   elements) of each type, loaded with the same many-element commands into each server; the
//!   memory the load added (Redis's `used_memory`; ramlog's live log bytes and index), divided
//!   by the elements;
//! - HSET of existing fields on a large hash ÷ the same on a 10-field hash, time per op (one
//!   client, pipelined 16 deep); and ZADD of existing members with new scores on a large sorted
//!   set ÷ the same on a 10-member one.
//!
//! With its default keys, redis-benchmark sets one field of one hash and adds one member to one
//! set; its list tests push to and pop from one list (`mylist`), which grows to the run's
//! request count.

use crate::report::{Report, Row, Target};
use crate::resp::{connect, flush, info_field, which, Peer};
use anyhow::{bail, Context};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

const TESTS: &str = "hset,lpush,lpop,rpush,rpop,sadd,spop,zadd,zpopmin,lrange_100";

struct Sizes {
    requests: u64,
    repeats: usize,
    small_keys: u64,
    large_keys: u64,
    hset_ops: u64,
    /// Fields of the large hash HSET is timed on.
    hset_fields: u64,
}

pub fn run(quick: bool, json: Option<&Path>) -> anyhow::Result<()> {
    for tool in ["redis-server", "redis-benchmark"] {
        if which(tool).is_none() {
            bail!("{tool} not found in PATH (install the redis-server and redis-tools packages; scripts/test does)");
        }
    }
    let sizes = if quick {
        Sizes {
            requests: 2_000,
            repeats: 1,
            small_keys: 20_000,
            large_keys: 10,
            hset_ops: 5_000,
            hset_fields: 100_000,
        }
    } else {
        Sizes {
            requests: 20_000,
            repeats: 3,
            small_keys: 200_000,
            large_keys: 100,
            hset_ops: 10_000,
            hset_fields: 1_000_000,
        }
    };
    let work = std::env::temp_dir().join(format!("ramlog-bench-types-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut report = Report::new("types", quick);
    let result = run_all(&sizes, &work, &mut report);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    report.finish(json)
}

fn run_all(sizes: &Sizes, work: &Path, report: &mut Report) -> anyhow::Result<()> {
    let redis = Peer::redis(work, true)?;
    let ramlog = Peer::ramlog(work, "async")?;
    throughput_rows(sizes, &redis, &ramlog, report)?;
    for peer in [&redis, &ramlog] {
        flush(peer.port)?;
    }
    memory_rows(sizes, work, &redis, report)?;
    for peer in [&redis, &ramlog] {
        flush(peer.port)?;
    }
    hset_scaling_rows(sizes, &redis, &ramlog, report)?;
    Ok(())
}

/// One redis-benchmark run: (test name, requests/s) for every test in its CSV.
fn benchmark(port: u16, requests: u64, pipeline: u32) -> anyhow::Result<Vec<(String, f64)>> {
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-c", "50", "-n", &requests.to_string()])
        .args(["-P", &pipeline.to_string(), "-t", TESTS, "--csv"])
        .output()
        .context("running redis-benchmark")?;
    if !out.status.success() {
        bail!(
            "redis-benchmark failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse_rates(&String::from_utf8_lossy(&out.stdout))
}

/// The `test` and `rps` columns of redis-benchmark's `--csv` output. The test names are
/// shortened to their first word (`LRANGE_100 (first 100 elements)` → `lrange_100`); the LPUSH
/// that only fills the list for LRANGE is left out.
fn parse_rates(text: &str) -> anyhow::Result<Vec<(String, f64)>> {
    let mut lines = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .skip_while(|l| !l.starts_with("\"test\""));
    let header: Vec<&str> = lines
        .next()
        .context("no CSV header")?
        .split(',')
        .map(|f| f.trim_matches('"'))
        .collect();
    let rps = header
        .iter()
        .position(|h| *h == "rps")
        .context("no rps column")?;
    let mut out = Vec::new();
    for line in lines {
        let fields: Vec<&str> = line.split("\",\"").map(|f| f.trim_matches('"')).collect();
        let name = fields.first().copied().unwrap_or_default();
        if name.contains("needed to benchmark") {
            continue;
        }
        let short = name
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase();
        let rate: f64 = fields
            .get(rps)
            .context("short CSV row")?
            .parse()
            .with_context(|| format!("rps of {line}"))?;
        out.push((short, rate));
    }
    if out.is_empty() {
        bail!("no rows in redis-benchmark output: {text}");
    }
    Ok(out)
}

fn throughput_rows(
    sizes: &Sizes,
    redis: &Peer,
    ramlog: &Peer,
    report: &mut Report,
) -> anyhow::Result<()> {
    for (pipeline, target) in [(1u32, 1.0), (16u32, 1.3)] {
        // runs[peer] = every run's (test, rps); peers alternate so that drift hits both alike.
        let mut runs: [Vec<Vec<(String, f64)>>; 2] = Default::default();
        for _ in 0..sizes.repeats {
            for (i, peer) in [redis, ramlog].iter().enumerate() {
                flush(peer.port)?;
                runs[i].push(benchmark(peer.port, sizes.requests, pipeline)?);
            }
        }
        let median_of = |runs: &[Vec<(String, f64)>], test: &str| {
            let v: Vec<f64> = runs
                .iter()
                .filter_map(|r| r.iter().find(|(t, _)| t == test).map(|x| x.1))
                .collect();
            crate::util::median(&v)
        };
        for (test, _) in &runs[1][0] {
            report.push(
                Row::versus(
                    format!("{test}_p{pipeline}_rps"),
                    median_of(&runs[1], test),
                    "req/s",
                    median_of(&runs[0], test),
                )
                .with_target(Target::at_least(target)),
            );
        }
    }
    Ok(())
}

/// Sends `commands` pipelined (in batches) and reads every reply, failing on an error reply.
fn pipeline(port: u16, commands: &[Vec<Vec<u8>>]) -> anyhow::Result<()> {
    pipeline_deep(port, commands, 256)
}

/// [`pipeline`] with `depth` commands in flight at a time.
fn pipeline_deep(port: u16, commands: &[Vec<Vec<u8>>], depth: usize) -> anyhow::Result<()> {
    let mut s = connect(port)?;
    let mut reader = BufReader::new(s.try_clone()?);
    for batch in commands.chunks(depth) {
        let mut out = Vec::new();
        for args in batch {
            out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
            for a in args {
                out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
                out.extend_from_slice(a);
                out.extend_from_slice(b"\r\n");
            }
        }
        s.write_all(&out)?;
        for _ in batch {
            read_reply(&mut reader)?;
        }
    }
    Ok(())
}

/// Reads one RESP reply (integers, simple strings, bulk strings and arrays of them).
fn read_reply(r: &mut impl BufRead) -> anyhow::Result<()> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let line = line.trim_end();
    match line.as_bytes().first() {
        Some(b'-') => bail!("error reply: {line}"),
        Some(b'$') => {
            let n: i64 = line[1..].parse()?;
            if n >= 0 {
                let mut body = vec![0u8; n as usize + 2];
                r.read_exact(&mut body)?;
            }
        }
        Some(b'*') => {
            let n: i64 = line[1..].parse()?;
            for _ in 0..n.max(0) {
                read_reply(r)?;
            }
        }
        Some(_) => {}
        None => bail!("connection closed"),
    }
    Ok(())
}

/// The commands that build `keys` collections of `kind` with `elements` each, many elements a
/// command. Fields, members and values are short strings, as a session store's or a queue's.
fn build_commands(kind: &str, keys: u64, elements: u64) -> Vec<Vec<Vec<u8>>> {
    let per_command = 100;
    let mut out = Vec::new();
    for k in 0..keys {
        let key = format!("{kind}:{k}").into_bytes();
        let mut e = 0;
        while e < elements {
            let end = (e + per_command).min(elements);
            let mut args: Vec<Vec<u8>> = vec![
                match kind {
                    "hash" => b"HSET".to_vec(),
                    "list" => b"RPUSH".to_vec(),
                    "set" => b"SADD".to_vec(),
                    _ => b"ZADD".to_vec(),
                },
                key.clone(),
            ];
            for i in e..end {
                match kind {
                    "hash" => {
                        args.push(format!("field:{i}").into_bytes());
                        args.push(format!("value:{i}").into_bytes());
                    }
                    "zset" => {
                        args.push(i.to_string().into_bytes());
                        args.push(format!("member:{i}").into_bytes());
                    }
                    _ => args.push(format!("member:{i}").into_bytes()),
                }
            }
            out.push(args);
            e = end;
        }
    }
    out
}

/// Bytes a server holds for its data: Redis's `used_memory`; for ramlog, the live bytes of its
/// log (objects as stored, with their entry headers) and its index. ramlog's `used_memory`
/// counts the log in whole segments, too coarse for the smaller loads here.
fn data_bytes(peer: &Peer) -> anyhow::Result<f64> {
    if peer.name == "redis" {
        return info_field(peer.port, "memory", "used_memory");
    }
    Ok(info_field(peer.port, "memory", "ramlog_memory_live")?
        + info_field(peer.port, "memory", "ramlog_memory_index")?)
}

fn memory_rows(
    sizes: &Sizes,
    work: &Path,
    redis: &Peer,
    report: &mut Report,
) -> anyhow::Result<()> {
    for (size, keys, elements, target) in [
        ("small", sizes.small_keys, 10u64, 1.0),
        ("large", sizes.large_keys, 10_000u64, 0.8),
    ] {
        for kind in ["hash", "list", "set", "zset"] {
            let commands = build_commands(kind, keys, elements);
            let mut per_element = [0.0f64; 2];
            // A fresh ramlog for each row: nothing of the previous row is left to reclaim.
            let ramlog = Peer::ramlog(work, "async")?;
            for (i, peer) in [redis, &ramlog].iter().enumerate() {
                flush(peer.port)?;
                let before = data_bytes(peer)?;
                pipeline(peer.port, &commands)?;
                let after = data_bytes(peer)?;
                per_element[i] = (after - before).max(0.0) / (keys * elements) as f64;
            }
            let row = Row::versus(
                format!("{kind}_{size}_bytes_per_element"),
                per_element[1],
                "B",
                per_element[0],
            );
            // Sets and lists are held to the hash and sorted-set targets too.
            report.push(row.with_target(Target::at_most(target)));
        }
    }
    Ok(())
}

/// Microseconds per update of an existing element (HSET of a field with a new value; ZADD of a
/// member with a new score, which moves it in the order), one client pipelining 16 at a time,
/// on a collection of `kind` ("hash" or "zset") of `elements` elements.
fn update_us(port: u16, kind: &str, key: &str, elements: u64, ops: u64) -> anyhow::Result<f64> {
    let fill = build_commands(kind, 1, elements)
        .into_iter()
        .map(|mut c| {
            c[1] = key.as_bytes().to_vec();
            c
        })
        .collect::<Vec<_>>();
    pipeline(port, &fill)?;
    let commands: Vec<Vec<Vec<u8>>> = (0..ops)
        .map(|i| {
            let at = (i * 7919) % elements;
            match kind {
                "hash" => vec![
                    b"HSET".to_vec(),
                    key.as_bytes().to_vec(),
                    format!("field:{at}").into_bytes(),
                    format!("value:{i}").into_bytes(),
                ],
                _ => vec![
                    b"ZADD".to_vec(),
                    key.as_bytes().to_vec(),
                    ((i * 104_729) % elements).to_string().into_bytes(),
                    format!("member:{at}").into_bytes(),
                ],
            }
        })
        .collect();
    let started = Instant::now();
    pipeline_deep(port, &commands, 16)?;
    Ok(started.elapsed().as_secs_f64() * 1e6 / ops as f64)
}

/// HSET on a large hash ÷ HSET on a 10-field hash, per op: a hash of 1 M fields (100,000 in a
/// quick run); the same for ZADD on a sorted set of as many members (no target in the issue;
/// reported beside it).
fn hset_scaling_rows(
    sizes: &Sizes,
    redis: &Peer,
    ramlog: &Peer,
    report: &mut Report,
) -> anyhow::Result<()> {
    let large = sizes.hset_fields;
    for (kind, command) in [("hash", "hset"), ("zset", "zadd")] {
        for peer in [redis, ramlog] {
            let small = update_us(
                peer.port,
                kind,
                &format!("{command}:small"),
                10,
                sizes.hset_ops,
            )?;
            let big = update_us(
                peer.port,
                kind,
                &format!("{command}:large"),
                large,
                sizes.hset_ops,
            )?;
            let row = Row::versus(
                format!(
                    "{}_{command}_{}k_{}_vs_10_us_per_op",
                    peer.name,
                    large / 1000,
                    if kind == "hash" { "fields" } else { "members" }
                ),
                big,
                "us",
                small,
            );
            report.push(if peer.name == "ramlog" && kind == "hash" {
                row.with_target(Target::at_most(2.0))
            } else {
                row
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_rates_of_every_test() {
        let text = "\"test\",\"rps\",\"avg_latency_ms\"\n\"HSET\",\"98039.22\",\"0.300\"\n\"LPUSH (needed to benchmark LRANGE)\",\"5.0\",\"0.1\"\n\"LRANGE_100 (first 100 elements)\",\"1234.50\",\"0.2\"\n";
        let rates = parse_rates(text).unwrap();
        assert_eq!(
            rates,
            vec![
                ("hset".to_string(), 98039.22),
                ("lrange_100".to_string(), 1234.5)
            ]
        );
        assert!(parse_rates("").is_err());
    }

    #[test]
    fn builds_collections_many_elements_a_command() {
        let c = build_commands("zset", 2, 150);
        assert_eq!(c.len(), 4);
        assert_eq!(c[0][0], b"ZADD");
        assert_eq!(c[0].len(), 2 + 2 * 100);
        assert_eq!(c[1].len(), 2 + 2 * 50);
        assert_eq!(c[2][1], b"zset:1");
    }
}
