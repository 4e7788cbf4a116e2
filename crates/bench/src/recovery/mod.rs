//! `ramlog bench recovery`: what a client sees while a master dies, ramlog against Redis Cluster,
//! and the load generator both halves share.
//!
//! The suite, file by file (each file's own comment says more):
//! - `mod.rs`: the entry point [`run`], the cases and the order they run in;
//! - `client.rs`: a minimal Redis Cluster client over std sockets (RESP2 replies, connections
//!   that time out, the slot map from `CLUSTER SLOTS`), for everything that talks to a cluster;
//! - `load.rs`: the writers under which a master dies ([`Load`]), what they saw ([`LoadResult`]:
//!   failover time, gaps), and the end both failovers share (the slots back, the keys read back);
//! - `readback.rs`: reading keys back after a failover and counting lost writes ([`Verify`]);
//! - `redis.rs`: the Redis Cluster peer: redis-server processes, cluster creation, its preload,
//!   [`redis_failover`];
//! - `ramlog.rs`: driving a ramlog cluster: coordinator and server processes, the `ramlog` tool
//!   commands, the cluster status;
//! - `poller.rs`: the thread that polls the coordinator's status during a failover;
//! - `ramlog_failover.rs`: the victim's preload and kill, and detection, recovery and
//!   re-protection as the coordinator shows them ([`ramlog_failover()`]);
//! - `rows.rs`: what the suite prints: a line per run, then the rows with their targets;
//! - `sweep.rs`: the size sweep (`RAMLOG_BENCH_RECOVERY_SWEEP`), its rows and its plot;
//! - `bare_replay.rs`: a survivor's backup store copied after the preload and replayed
//!   decode-only, the limit a restore is compared with; `plot.rs`: the sweep's SVG chart;
//! - `process.rs`, `progress.rs`: child processes killed when dropped, waits with a limit,
//!   progress on stderr.
//!
//! [`run`] runs, per repeat and alternating, ramlog 4 servers with 100 B values, Redis with
//! 100 B, ramlog 4 servers with 1 KiB values, Redis with 1 KiB, ramlog 3 servers with 100 B (the
//! recovery time with 2 survivors instead of 3), ramlog 4 servers with 100 B in `durable` mode
//! (preloaded in `sync`) and in `mirror` mode (preloaded in `sync`, then the kill waits until
//! every mirror has built its memory; each of the victim's tablets is taken over by its mirror,
//! with a `gap_after_detection` row for the mirror's target); the rows are medians (losses: the
//! largest). A ramlog run that fails (detection, recovery or re-protection not within 120 s, a
//! read-back that fails) is counted in a `<case>_failed_runs` row and its logs are kept under
//! `$TMPDIR/ramlog-bench-recovery-<pid>-failed/`.
//!
//! Environment: `RAMLOG_BENCH_RECOVERY_MIB` (the victim's data, default 64 quick, 1024 full),
//! `RAMLOG_BENCH_RECOVERY_REPEATS` (default 1 quick, 3 full), `RAMLOG_BENCH_RECOVERY_CASES`
//! (a comma-separated subset of `r4_100B,r4_1KiB,r3_100B,r4_100B_durable,r4_100B_mirror`).
//!
//! `RAMLOG_BENCH_RECOVERY_SWEEP=64,256,1024,2048` runs the size sweep instead ([`sweep`]: the
//! cases `r4_100B` and `r4_1KiB` at each size, beside Redis Cluster at the same size, with the
//! bare replay limit), and writes a plot to `RAMLOG_BENCH_PLOT` (default
//! `docs/benchmarks/recovery-sweep.svg`).

mod bare_replay;
mod client;
pub mod cluster_scan;
mod load;
pub mod migration;
mod plot;
mod poller;
mod process;
mod progress;
mod ramlog;
mod ramlog_failover;
mod readback;
mod redis;
mod rows;
mod sweep;

pub use bare_replay::{BareReplay, StoreCopy};
pub use load::{Load, LoadResult, Window};
pub use ramlog_failover::{ramlog_failover, RamlogFailover};
pub use readback::Verify;
pub use redis::{redis_failover, redis_only, RedisFailover, RedisPreload};

use crate::report::Report;
use anyhow::{bail, Context};
use load::{LOAD_KEYS, THREADS};
use ramlog::REPLICAS;
use redis::MASTERS;
use rows::size_name;
use std::path::Path;
use std::time::Duration;

/// Either preload gives up after this long.
const PRELOAD_LIMIT: Duration = Duration::from_secs(900);
/// Redis Cluster's `cluster-node-timeout` against ramlog's default detection (its coordinator's
/// `--dead-after-ms`, 400 ms).
const REDIS_NODE_TIMEOUT_MS: u64 = 400;

/// One ramlog configuration of the suite.
struct Case {
    /// Row name prefix.
    name: &'static str,
    servers: usize,
    value_size: usize,
    mode: &'static str,
}

const CASES: [Case; 5] = [
    Case {
        name: "r4_100B",
        servers: 4,
        value_size: 100,
        mode: "sync",
    },
    Case {
        name: "r4_1KiB",
        servers: 4,
        value_size: 1024,
        mode: "sync",
    },
    Case {
        name: "r3_100B",
        servers: 3,
        value_size: 100,
        mode: "sync",
    },
    Case {
        name: "r4_100B_durable",
        servers: 4,
        value_size: 100,
        mode: "durable",
    },
    Case {
        name: "r4_100B_mirror",
        servers: 4,
        value_size: 100,
        mode: "mirror",
    },
];

/// Value sizes of the Redis runs (each beside the ramlog cases of that size).
const REDIS_VALUES: [usize; 2] = [100, 1024];

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// `ramlog bench recovery`: what a client sees when a master dies, ramlog against Redis Cluster.
///
/// Per repeat, alternating: the ramlog cases of `CASES` in order, each Redis run beside the
/// first case of its value size (see the module comment). The victim master holds 64 MiB (quick)
/// or 1 GiB (full) of values; `RAMLOG_BENCH_RECOVERY_MIB` overrides that,
/// `RAMLOG_BENCH_RECOVERY_REPEATS` the repeats (1 quick, 3 full). Redis's preload is the same
/// per master, at most `REDIS_PRELOAD_CAP_MIB` (its failover replays nothing).
/// `RAMLOG_BENCH_RECOVERY_SWEEP` runs the size sweep instead ([`sweep`]; repeats default to 1).
pub fn run(quick: bool, json: Option<&Path>) -> anyhow::Result<()> {
    redis::require_tools()?;
    if let Ok(text) = std::env::var("RAMLOG_BENCH_RECOVERY_SWEEP") {
        let sizes = sweep::parse_sizes(&text)?;
        let repeats = env_u64("RAMLOG_BENCH_RECOVERY_REPEATS").unwrap_or(1).max(1) as usize;
        let work =
            std::env::temp_dir().join(format!("ramlog-bench-recovery-{}", std::process::id()));
        std::fs::create_dir_all(&work)?;
        let mut report = Report::new("recovery", quick);
        let result = sweep::run(&work, &sizes, repeats, quick, &mut report);
        let _ = std::fs::remove_dir_all(&work);
        result?;
        return report.finish(json);
    }
    let data_mib = env_u64("RAMLOG_BENCH_RECOVERY_MIB").unwrap_or(if quick { 64 } else { 1024 });
    let repeats = env_u64("RAMLOG_BENCH_RECOVERY_REPEATS")
        .unwrap_or(if quick { 1 } else { 3 })
        .max(1) as usize;
    let memory_mib = (data_mib * 3).max(512);
    let work = std::env::temp_dir().join(format!("ramlog-bench-recovery-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut report = Report::new("recovery", quick);
    let result = run_all(&work, data_mib, memory_mib, repeats, &mut report);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    report.finish(json)
}

/// Copies the `*.log` and `*.json` files of a failed case's `dir` to a directory beside the
/// suite's work directory (which is removed at the end) and returns it.
fn keep_logs(dir: &Path, label: &str) -> std::path::PathBuf {
    let name: String = label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let kept = std::env::temp_dir()
        .join(format!(
            "ramlog-bench-recovery-{}-failed",
            std::process::id()
        ))
        .join(name);
    let _ = std::fs::create_dir_all(&kept);
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("log") | Some("json")
            ) {
                if let Some(file) = path.file_name() {
                    let _ = std::fs::copy(&path, kept.join(file));
                }
            }
        }
    }
    kept
}

/// Redis's preload per master is at most this (MiB of values).
const REDIS_PRELOAD_CAP_MIB: u64 = 64;

fn run_all(
    work: &Path,
    data_mib: u64,
    memory_mib: u64,
    repeats: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    let data_bytes = data_mib << 20;
    println!(
        "victim master holds {data_mib} MiB of values; servers --memory {memory_mib}MiB; R = {REPLICAS}; \
         load: {THREADS} threads over {LOAD_KEYS} keys; {repeats} repeat(s)"
    );
    // RAMLOG_BENCH_RECOVERY_CASES=r4_100B,r3_100B: only these ramlog cases (and the Redis runs of
    // their value sizes).
    let only: Option<Vec<String>> = std::env::var("RAMLOG_BENCH_RECOVERY_CASES")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let cases: Vec<&Case> = CASES
        .iter()
        .filter(|c| only.as_ref().is_none_or(|o| o.iter().any(|n| n == c.name)))
        .collect();
    if cases.is_empty() {
        bail!(
            "RAMLOG_BENCH_RECOVERY_CASES names no case of {:?}",
            CASES.iter().map(|c| c.name).collect::<Vec<_>>()
        );
    }
    let mut ours: Vec<Vec<RamlogFailover>> = cases.iter().map(|_| Vec::new()).collect();
    let mut failures: Vec<u64> = cases.iter().map(|_| 0).collect();
    let mut theirs: Vec<Vec<RedisFailover>> = REDIS_VALUES.iter().map(|_| Vec::new()).collect();
    for repeat in 0..repeats {
        for (c, case) in cases.iter().enumerate() {
            let label = format!("{} #{}", case.name, repeat + 1);
            eprintln!(
                "ramlog {label}: {} servers, {} B values, {}",
                case.servers, case.value_size, case.mode
            );
            let dir = work.join(format!("{}-{}", case.name, repeat + 1));
            let r = ramlog_failover(
                &dir,
                &label,
                case.servers,
                case.mode,
                case.value_size,
                data_bytes,
                memory_mib,
                None,
            );
            match r {
                Ok(r) => {
                    if r.anomalous {
                        let kept = keep_logs(&dir, &label);
                        println!(
                            "ramlog {label}: something is off (below); logs in {}",
                            kept.display()
                        );
                    }
                    let _ = std::fs::remove_dir_all(&dir);
                    rows::print_ramlog_run(&label, &r);
                    ours[c].push(r);
                }
                Err(e) => {
                    // Recorded as a failed run; the logs are kept for whoever reads the report.
                    let kept = keep_logs(&dir, &label);
                    let _ = std::fs::remove_dir_all(&dir);
                    println!("ramlog {label} FAILED: {e:#} (logs in {})", kept.display());
                    failures[c] += 1;
                }
            }
            // Redis beside the ramlog case that first uses its value size.
            if let Some(v) = REDIS_VALUES.iter().position(|&v| {
                v == case.value_size && cases.iter().position(|k| k.value_size == v) == Some(c)
            }) {
                let value = REDIS_VALUES[v];
                let label = format!("redis_{} #{}", size_name(value), repeat + 1);
                let per_master = data_bytes.min(REDIS_PRELOAD_CAP_MIB << 20);
                let preload = (per_master / value as u64) as usize * MASTERS;
                eprintln!(
                    "{label}: 4 masters + 4 replicas, {value} B values, {preload} keys preloaded"
                );
                let dir = work.join(format!("redis-{}-{}", value, repeat + 1));
                std::fs::create_dir_all(&dir)?;
                let r = redis_failover(
                    &dir,
                    REDIS_NODE_TIMEOUT_MS,
                    value,
                    LOAD_KEYS,
                    RedisPreload::Spread(preload),
                );
                let _ = std::fs::remove_dir_all(&dir);
                let r = r.with_context(|| label.clone())?;
                rows::print_redis_run(&label, &r);
                theirs[v].push(r);
            }
        }
    }

    rows::push(report, &cases, &ours, &failures, &theirs);
    Ok(())
}
