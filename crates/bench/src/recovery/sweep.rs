//! `RAMLOG_BENCH_RECOVERY_SWEEP=64,256,1024,2048`: the recovery measurement at several sizes of
//! the victim's data, its bare replay limit, and a plot of recovery time against size.
//!
//! Per size (MiB of values on the victim) and per value size of the cases `r4_100B` and `r4_1KiB`
//! (`sync`, 4 servers; `RAMLOG_BENCH_RECOVERY_CASES` may keep one), per repeat
//! (`RAMLOG_BENCH_RECOVERY_REPEATS`, default 1): a ramlog run ([`ramlog_failover()`]) that also
//! copies one survivor's backup store after the preload; the bare replay of that copy
//! ([`super::bare_replay`]) once the cluster is stopped; a Redis Cluster run with the same load
//! whose victim master holds the same data (the other masters none, as with ramlog). The rows of
//! a size are printed when its runs end (medians over the repeats, losses the largest).
//!
//! `restore_rate_vs_bare_replay` = (objects preloaded on the victim ÷ recovery time, i.e. the
//! cluster's restore rate) ÷ (objects/s of the bare replay on one replay thread × the cores of
//! this machine, which every process of the run shares: the most the restore could use).

use super::bare_replay::{self, BareReplay};
use super::load::LOAD_KEYS;
use super::plot::{self, Chart, Series};
use super::rows::{ms, print_ramlog_run, print_redis_run, size_name};
use super::{
    keep_logs, ramlog_failover, redis_failover, RamlogFailover, RedisFailover, RedisPreload, CASES,
    REDIS_NODE_TIMEOUT_MS,
};
use crate::report::{Report, Row, Target};
use anyhow::{bail, Context};
use std::path::{Path, PathBuf};

/// Where the plot goes unless `RAMLOG_BENCH_PLOT` says otherwise (relative to the working
/// directory: the repository's root when run from there).
const DEFAULT_PLOT: &str = "docs/benchmarks/recovery-sweep.svg";
/// Cases of the sweep (their value sizes; 4 servers, `sync`).
const SWEEP_CASES: [&str; 2] = ["r4_100B", "r4_1KiB"];
/// Largest size a sweep accepts, MiB.
const SIZE_MAX_MIB: u64 = 64 << 10;

/// The sizes of `RAMLOG_BENCH_RECOVERY_SWEEP`: MiB, comma-separated, each at least 1.
pub(super) fn parse_sizes(text: &str) -> anyhow::Result<Vec<u64>> {
    let mut sizes = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let mib: u64 = part
            .parse()
            .with_context(|| format!("RAMLOG_BENCH_RECOVERY_SWEEP: {part:?} is not MiB"))?;
        if mib == 0 || mib > SIZE_MAX_MIB {
            bail!("RAMLOG_BENCH_RECOVERY_SWEEP: {mib} MiB is not within 1..={SIZE_MAX_MIB}");
        }
        sizes.push(mib);
    }
    if sizes.is_empty() {
        bail!("RAMLOG_BENCH_RECOVERY_SWEEP names no size");
    }
    Ok(sizes)
}

/// One ramlog run of the sweep and the bare replay of its copied logs.
struct Run {
    r: RamlogFailover,
    bare: Option<BareReplay>,
}

/// The runs of one (value size, victim size).
#[derive(Default)]
struct Point {
    ours: Vec<Run>,
    theirs: Vec<RedisFailover>,
    failed: u64,
    redis_failed: u64,
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs the sweep over `sizes` (MiB), `repeats` times each, and writes the plot.
pub(super) fn run(
    work: &Path,
    sizes: &[u64],
    repeats: usize,
    quick: bool,
    report: &mut Report,
) -> anyhow::Result<()> {
    let only: Option<Vec<String>> = std::env::var("RAMLOG_BENCH_RECOVERY_CASES")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let values: Vec<usize> = CASES
        .iter()
        .filter(|c| SWEEP_CASES.contains(&c.name))
        .filter(|c| only.as_ref().is_none_or(|o| o.iter().any(|n| n == c.name)))
        .map(|c| c.value_size)
        .collect();
    if values.is_empty() {
        bail!("RAMLOG_BENCH_RECOVERY_CASES keeps none of the sweep's cases {SWEEP_CASES:?}");
    }
    println!(
        "sweep: victim sizes {sizes:?} MiB; values {:?}; 4 servers, sync, R = 2; load: {LOAD_KEYS} keys; \
         {repeats} repeat(s); {} cores",
        values.iter().map(|&v| size_name(v)).collect::<Vec<_>>(),
        cores()
    );
    let mut points: Vec<(usize, u64, Point)> = Vec::new();
    for &mib in sizes {
        let memory_mib = (mib * 3).max(512);
        for &value in &values {
            let mut point = Point::default();
            for repeat in 0..repeats {
                run_once(work, value, mib, memory_mib, repeat, &mut point)?;
            }
            push_point(report, value, mib, &point);
            points.push((value, mib, point));
        }
    }
    for &value in &values {
        let recovery = |size: u64| {
            points
                .iter()
                .find(|(v, m, p)| *v == value && *m == size && !p.ours.is_empty())
                .map(|(_, _, p)| median(p.ours.iter().map(|r| ms(r.r.recovery))))
        };
        if let (Some(big), Some(small)) = (recovery(2048), recovery(1024)) {
            report.push(
                Row::versus(
                    format!("sweep_{}_recovery_2048_vs_1024", size_name(value)),
                    big,
                    "ms",
                    small,
                )
                .with_target(Target::at_most(2.2)),
            );
        }
    }
    write_plot(&points, sizes, &values, repeats, quick)
}

fn median(xs: impl Iterator<Item = f64>) -> f64 {
    crate::util::median(&xs.collect::<Vec<_>>())
}

/// One repeat at one point: ramlog (with the copy of a backup store and its bare replay), then
/// Redis Cluster. A failed run is counted and its logs kept; the sweep goes on.
fn run_once(
    work: &Path,
    value: usize,
    mib: u64,
    memory_mib: u64,
    repeat: usize,
    point: &mut Point,
) -> anyhow::Result<()> {
    let data_bytes = mib << 20;
    let name = format!("sweep_{}_{mib}MiB", size_name(value));
    let label = format!("{name} #{}", repeat + 1);
    eprintln!("ramlog {label}: 4 servers, {value} B values, {mib} MiB on the victim, sync");
    let dir = work.join(format!("{name}-{}", repeat + 1));
    let copy = work.join(format!("{name}-{}-backup-copy", repeat + 1));
    let r = ramlog_failover(
        &dir,
        &label,
        4,
        "sync",
        value,
        data_bytes,
        memory_mib,
        Some(&copy),
    );
    match r {
        Ok(r) => {
            if r.anomalous {
                let kept = keep_logs(&dir, &label);
                println!(
                    "ramlog {label}: something is off (below); logs in {}",
                    kept.display()
                );
            } else if std::env::var_os("RAMLOG_BENCH_RECOVERY_KEEP_LOGS").is_some() {
                // The servers' and the coordinator's logs of every run, for a look at its timeline.
                let kept = keep_logs(&dir, &label);
                println!("ramlog {label}: logs in {}", kept.display());
            }
            let _ = std::fs::remove_dir_all(&dir);
            print_ramlog_run(&label, &r);
            let bare = match bare_replay::measure(&copy, memory_mib << 20) {
                Ok(b) => {
                    print_bare(&label, &r, &b);
                    Some(b)
                }
                Err(e) => {
                    println!("ramlog {label}: bare replay of the copied store FAILED: {e:#}");
                    None
                }
            };
            point.ours.push(Run { r, bare });
        }
        Err(e) => {
            let kept = keep_logs(&dir, &label);
            let _ = std::fs::remove_dir_all(&dir);
            println!("ramlog {label} FAILED: {e:#} (logs in {})", kept.display());
            point.failed += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&copy);

    let label = format!("sweep_redis_{}_{mib}MiB #{}", size_name(value), repeat + 1);
    let keys = (data_bytes / value as u64).max(1) as usize;
    eprintln!(
        "{label}: 4 masters + 4 replicas, {value} B values, {keys} keys preloaded on the victim"
    );
    let dir = work.join(format!("redis-{name}-{}", repeat + 1));
    std::fs::create_dir_all(&dir)?;
    let r = redis_failover(
        &dir,
        REDIS_NODE_TIMEOUT_MS,
        value,
        LOAD_KEYS,
        RedisPreload::Victim(keys),
    );
    let _ = std::fs::remove_dir_all(&dir);
    match r {
        Ok(r) => {
            print_redis_run(&label, &r);
            point.theirs.push(r);
        }
        Err(e) => {
            println!("{label} FAILED: {e:#}");
            point.redis_failed += 1;
        }
    }
    Ok(())
}

/// The cluster's restore rate: objects preloaded on the victim per second of recovery.
fn restore_rate(r: &RamlogFailover) -> f64 {
    r.preloaded as f64 / r.recovery.as_secs_f64().max(1e-9)
}

fn print_bare(label: &str, r: &RamlogFailover, b: &BareReplay) {
    let copy = r.store_copy.as_ref();
    println!(
        "ramlog {label}: bare replay of server {}'s copied store ({:.0} MiB{}): {} objects ({} \
         preloaded in its tablets) in {:.2} s on one replay thread ({:.2} M/s; {:.2} CPU-s), {} \
         lost, {} corrupt; the cluster restored {:.2} M/s ({} objects in {:.0} ms, {} \
         partitions); {} cores",
        copy.map_or(0, |c| c.server),
        copy.map_or(0.0, |c| c.bytes as f64 / (1u64 << 20) as f64),
        if copy.is_some_and(|c| !c.quiet) {
            ", changed while copied"
        } else {
            ""
        },
        b.objects,
        copy.map_or(0, |c| c.expected_objects),
        b.time.as_secs_f64(),
        b.rate() / 1e6,
        b.cpu.as_secs_f64(),
        b.lost,
        b.corrupt,
        restore_rate(r) / 1e6,
        r.preloaded,
        ms(r.recovery),
        r.partitions,
        cores()
    );
}

/// The rows of one (value size, victim size).
fn push_point(report: &mut Report, value: usize, mib: u64, p: &Point) {
    let name = format!("sweep_{}_{mib}MiB", size_name(value));
    let max = |xs: &mut dyn Iterator<Item = f64>| xs.fold(0.0, f64::max);
    if p.failed > 0 {
        report.push(
            Row::plain(format!("{name}_failed_runs"), p.failed as f64, "runs")
                .with_target(Target::at_most(0.0)),
        );
    }
    let redis = format!("sweep_redis_{}_{mib}MiB", size_name(value));
    if p.redis_failed > 0 {
        report.push(Row::plain(
            format!("{redis}_failed_runs"),
            p.redis_failed as f64,
            "runs",
        ));
    }
    let redis_gap = (!p.theirs.is_empty()).then(|| {
        let failover = median(p.theirs.iter().map(|r| ms(r.failover)));
        let gap = median(p.theirs.iter().map(|r| ms(r.longest_gap)));
        report.push(Row::plain(format!("{redis}_failover"), failover, "ms"));
        report.push(Row::plain(format!("{redis}_longest_gap"), gap, "ms"));
        report.push(Row::plain(
            format!("{redis}_lost_writes"),
            max(&mut p.theirs.iter().map(|r| r.lost_writes as f64)),
            "writes",
        ));
        gap
    });
    if p.ours.is_empty() {
        return;
    }
    let runs = || p.ours.iter().map(|x| &x.r);
    report.push(Row::plain(
        format!("{name}_recovery"),
        median(runs().map(|r| ms(r.recovery))),
        "ms",
    ));
    report.push(Row::plain(
        format!("{name}_objects_per_s"),
        median(runs().map(restore_rate)),
        "objects/s",
    ));
    let gap = median(runs().map(|r| ms(r.longest_gap)));
    report.push(match redis_gap {
        Some(theirs) => Row::versus(format!("{name}_longest_gap_vs_redis"), gap, "ms", theirs)
            .with_target(Target::at_most(0.5)),
        None => Row::plain(format!("{name}_longest_gap"), gap, "ms"),
    });
    report.push(Row::plain(
        format!("{name}_worst_partition_gap"),
        median(runs().map(|r| ms(r.worst_partition_gap))),
        "ms",
    ));
    let during: Vec<f64> = runs().filter_map(|r| r.rate_reprotection).collect();
    if !during.is_empty() {
        report.push(Row::versus(
            format!("{name}_write_rate_during_reprotection"),
            crate::util::median(&during),
            "acks/s",
            median(runs().map(|r| r.rate_before)),
        ));
    }
    report.push(
        Row::plain(
            format!("{name}_lost_writes"),
            max(&mut runs().map(|r| r.lost_writes as f64)),
            "writes",
        )
        .with_target(Target::at_most(0.0)),
    );
    report.push(
        Row::plain(
            format!("{name}_preload_sample_missing"),
            max(&mut runs().map(|r| (r.sample_missing + r.sample_wrong) as f64)),
            "keys",
        )
        .with_target(Target::at_most(0.0)),
    );
    // Restore rate ÷ (bare replay rate on one thread × cores), over the runs whose copy replayed.
    let with_bare: Vec<(&RamlogFailover, &BareReplay)> = p
        .ours
        .iter()
        .filter_map(|x| x.bare.as_ref().map(|b| (&x.r, b)))
        .collect();
    if !with_bare.is_empty() {
        let limit = median(with_bare.iter().map(|(_, b)| b.rate())) * cores() as f64;
        report.push(
            Row::versus(
                format!("{name}_restore_rate_vs_bare_replay"),
                median(with_bare.iter().map(|(r, _)| restore_rate(r))),
                "objects/s",
                limit,
            )
            .with_target(Target::at_least(0.7)),
        );
    }
}

/// Recovery time against size, ramlog and Redis Cluster, to `RAMLOG_BENCH_PLOT` or
/// [`DEFAULT_PLOT`]: for ramlog from the kill until the status showed no tablet recovering
/// (detection + recovery), for Redis until the first write acknowledged by the promoted replica.
fn write_plot(
    points: &[(usize, u64, Point)],
    sizes: &[u64],
    values: &[usize],
    repeats: usize,
    quick: bool,
) -> anyhow::Result<()> {
    const COLORS: [(&str, &str); 2] = [("#1f77b4", "#d62728"), ("#2ca02c", "#ff7f0e")];
    let mut series = Vec::new();
    for (n, &value) in values.iter().enumerate() {
        let (ours, theirs) = COLORS[n % COLORS.len()];
        let mine = points
            .iter()
            .filter(|(v, _, p)| *v == value && !p.ours.is_empty())
            .map(|(_, mib, p)| {
                (
                    *mib as f64,
                    median(
                        p.ours
                            .iter()
                            .map(|x| (x.r.detection + x.r.recovery).as_secs_f64()),
                    ),
                )
            })
            .collect();
        let redis = points
            .iter()
            .filter(|(v, _, p)| *v == value && !p.theirs.is_empty())
            .map(|(_, mib, p)| {
                (
                    *mib as f64,
                    median(p.theirs.iter().map(|r| r.failover.as_secs_f64())),
                )
            })
            .collect();
        series.push(Series {
            label: format!("ramlog, {} values", size_name(value)),
            color: ours,
            dashed: false,
            points: mine,
        });
        series.push(Series {
            label: format!("Redis Cluster, {} values", size_name(value)),
            color: theirs,
            dashed: true,
            points: redis,
        });
    }
    let ticks: Vec<f64> = sizes.iter().map(|&s| s as f64).collect();
    let subtitle = format!(
        "killed -9 under load; ramlog 4 servers, R = 2; Redis 4 masters + 4 replicas; {}, \
         median of {repeats}; {} cores",
        if quick { "quick run" } else { "full run" },
        cores()
    );
    let text = plot::svg(&Chart {
        title: "Recovery time against the dead master's data",
        subtitle: &subtitle,
        x_label: "MiB of values on the killed master",
        y_label: "s from the kill until its slots are all served",
        x_ticks: &ticks,
        series: &series,
    });
    let path = std::env::var_os("RAMLOG_BENCH_PLOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PLOT));
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    println!("plot: {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(
            parse_sizes("64, 256,1024,2048").unwrap(),
            vec![64, 256, 1024, 2048]
        );
        assert!(parse_sizes("").is_err());
        assert!(parse_sizes("0").is_err());
        assert!(parse_sizes("64,x").is_err());
    }
}
