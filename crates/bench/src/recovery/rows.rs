//! What the suite prints: a line per run as it ends, then the rows (medians over the repeats,
//! losses the largest) with their targets.

use super::{Case, RamlogFailover, RedisFailover, REDIS_VALUES};
use crate::report::{Report, Row, Target};
use std::time::Duration;

pub(super) fn size_name(bytes: usize) -> String {
    if bytes.is_multiple_of(1024) {
        format!("{}KiB", bytes / 1024)
    } else {
        format!("{bytes}B")
    }
}

pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The line printed when a ramlog run ends (and one on when its tablets came back).
pub(super) fn print_ramlog_run(label: &str, r: &RamlogFailover) {
    println!(
        "ramlog {label}: detection {:.0} ms, recovery {:.0} ms ({} tablets, {} restorers), \
         re-protection {:.0} ms; client failover {:.0} ms, longest gap {:.0} ms (worst tablet {:.0} ms, worst of {} partitions {:.0} ms, other slots {:.0} ms); \
         {} acked, lost {} keys / {} writes of {} keys, {} ahead; preload {} keys in {:.1} s, \
         sample {} missing + {} wrong of {}; DBSIZE {:?} of {}; {} survivors dead after; errors {:?}; {} status polls failed",
        ms(r.detection),
        ms(r.recovery),
        r.tablets,
        r.restorers,
        ms(r.reprotection),
        ms(r.failover),
        ms(r.longest_gap),
        ms(r.worst_tablet_gap),
        r.partitions,
        ms(r.worst_partition_gap),
        ms(r.others_gap),
        r.acked,
        r.lost,
        r.lost_writes,
        r.checked,
        r.ahead,
        r.preloaded,
        r.preload_time.as_secs_f64(),
        r.sample_missing,
        r.sample_wrong,
        r.sample_checked,
        r.keys_after,
        r.keys_expected,
        r.survivors_dead,
        r.errors,
        r.poll_failures
    );
    if let (Some(first), Some(last)) = (r.tablets_back.first(), r.tablets_back.last()) {
        println!(
            "ramlog {label}: the victim's tablets took writes again at {:.0} ms (first), {:.0} ms \
             (median), {:.0} ms (last) after the kill; the status showed recovery over at \
             {:.0} ms and re-protection over at {:.0} ms",
            ms(*first),
            ms(r.tablets_back[r.tablets_back.len() / 2]),
            ms(*last),
            ms(r.recovered_at),
            ms(r.protected_at)
        );
    }
}

/// The line printed when a Redis run ends.
pub(super) fn print_redis_run(label: &str, r: &RedisFailover) {
    println!(
        "{label}: failover {:.0} ms, longest gap {:.0} ms (other slots {:.0} ms); {} acked, \
         lost {} keys / {} writes of {} keys, {} ahead; errors {:?}",
        ms(r.failover),
        ms(r.longest_gap),
        ms(r.others_gap),
        r.acked,
        r.lost,
        r.lost_writes,
        r.checked,
        r.ahead,
        r.errors
    );
}

/// The suite's rows: per value size, what Redis did; per case, what ramlog did, against Redis of
/// the same value size where there is one, with the targets.
pub(super) fn push(
    report: &mut Report,
    cases: &[&Case],
    ours: &[Vec<RamlogFailover>],
    failures: &[u64],
    theirs: &[Vec<RedisFailover>],
) {
    let med = |xs: Vec<f64>| crate::util::median(&xs);
    let max = |xs: Vec<f64>| xs.into_iter().fold(0.0, f64::max);
    let redis_of = |value: usize| {
        let v = REDIS_VALUES.iter().position(|&x| x == value)?;
        let runs = &theirs[v];
        if runs.is_empty() {
            return None;
        }
        Some((
            med(runs.iter().map(|r| ms(r.failover)).collect()),
            med(runs.iter().map(|r| ms(r.longest_gap)).collect()),
            med(runs.iter().map(|r| ms(r.others_gap)).collect()),
            max(runs.iter().map(|r| r.lost_writes as f64).collect()),
        ))
    };
    for value in REDIS_VALUES {
        let Some((failover, gap, others, lost)) = redis_of(value) else {
            continue;
        };
        let p = format!("redis_{}", size_name(value));
        report.push(Row::plain(format!("{p}_failover"), failover, "ms"));
        report.push(Row::plain(format!("{p}_longest_gap"), gap, "ms"));
        report.push(Row::plain(format!("{p}_other_slots_gap"), others, "ms"));
        report.push(Row::plain(format!("{p}_lost_writes"), lost, "writes"));
    }
    let r4_recovery = cases
        .iter()
        .position(|c| c.name == "r4_100B")
        .filter(|&c| !ours[c].is_empty())
        .map(|c| med(ours[c].iter().map(|r| ms(r.recovery)).collect()));
    let r4_failover = cases
        .iter()
        .position(|c| c.name == "r4_100B")
        .filter(|&c| !ours[c].is_empty())
        .map(|c| med(ours[c].iter().map(|r| ms(r.failover)).collect()));
    for ((case, runs), failed) in cases.iter().zip(ours).zip(failures) {
        let p = case.name;
        if *failed > 0 {
            report.push(
                Row::plain(format!("{p}_failed_runs"), *failed as f64, "runs")
                    .with_target(Target::at_most(0.0)),
            );
        }
        if runs.is_empty() {
            continue;
        }
        let redis = redis_of(case.value_size);
        let detection = med(runs.iter().map(|r| ms(r.detection)).collect());
        let recovery = med(runs.iter().map(|r| ms(r.recovery)).collect());
        report.push(
            Row::plain(format!("{p}_detection"), detection, "ms")
                .with_target(Target::at_most(500.0)),
        );
        // The 3-server case is there for its recovery time against the 4-server one.
        report.push(if let (3, Some(r4)) = (case.servers, r4_recovery) {
            Row::versus(format!("{p}_recovery_vs_r4"), recovery, "ms", r4)
        } else if case.servers == 3 {
            Row::plain(format!("{p}_recovery"), recovery, "ms")
        } else {
            Row::plain(format!("{p}_recovery"), recovery, "ms").with_target(Target::at_most(2000.0))
        });
        report.push(Row::plain(
            format!("{p}_reprotection"),
            med(runs.iter().map(|r| ms(r.reprotection)).collect()),
            "ms",
        ));
        let failover = med(runs.iter().map(|r| ms(r.failover)).collect());
        let gap = med(runs.iter().map(|r| ms(r.longest_gap)).collect());
        let others = med(runs.iter().map(|r| ms(r.others_gap)).collect());
        let worst_tablet = med(runs.iter().map(|r| ms(r.worst_tablet_gap)).collect());
        if case.mode == "mirror" {
            // The mirror's promise: clients wait for detection and hardly more.
            report.push(
                Row::plain(format!("{p}_gap_after_detection"), gap - detection, "ms")
                    .with_target(Target::at_most(100.0)),
            );
            if let Some(r4) = r4_failover {
                report.push(Row::versus(
                    format!("{p}_failover_vs_backup_recovery"),
                    failover,
                    "ms",
                    r4,
                ));
            }
        }
        match redis {
            Some((r_failover, r_gap, r_others, _)) => {
                report.push(Row::versus(
                    format!("{p}_failover_vs_redis"),
                    failover,
                    "ms",
                    r_failover,
                ));
                report.push(
                    Row::versus(format!("{p}_longest_gap_vs_redis"), gap, "ms", r_gap)
                        .with_target(Target::at_most(0.5)),
                );
                report.push(Row::versus(
                    format!("{p}_worst_tablet_gap_vs_redis"),
                    worst_tablet,
                    "ms",
                    r_gap,
                ));
                report.push(Row::versus(
                    format!("{p}_other_slots_gap_vs_redis"),
                    others,
                    "ms",
                    r_others,
                ));
            }
            None => {
                report.push(Row::plain(format!("{p}_failover"), failover, "ms"));
                report.push(Row::plain(format!("{p}_longest_gap"), gap, "ms"));
                report.push(Row::plain(
                    format!("{p}_worst_tablet_gap"),
                    worst_tablet,
                    "ms",
                ));
                report.push(Row::plain(format!("{p}_other_slots_gap"), others, "ms"));
            }
        }
        report.push(
            Row::plain(
                format!("{p}_lost_writes"),
                max(runs.iter().map(|r| r.lost_writes as f64).collect()),
                "writes",
            )
            .with_target(Target::at_most(0.0)),
        );
        report.push(
            Row::plain(
                format!("{p}_preload_sample_missing"),
                max(runs
                    .iter()
                    .map(|r| (r.sample_missing + r.sample_wrong) as f64)
                    .collect()),
                "keys",
            )
            .with_target(Target::at_most(0.0)),
        );
        let during: Vec<f64> = runs.iter().filter_map(|r| r.rate_reprotection).collect();
        if !during.is_empty() {
            report.push(Row::versus(
                format!("{p}_write_rate_during_reprotection"),
                med(during),
                "acks/s",
                med(runs.iter().map(|r| r.rate_before).collect()),
            ));
        }
        report.push(
            Row::plain(
                format!("{p}_survivors_declared_dead"),
                max(runs.iter().map(|r| r.survivors_dead as f64).collect()),
                "servers",
            )
            .with_target(Target::at_most(0.0)),
        );
        let after: Vec<f64> = runs
            .iter()
            .filter_map(|r| r.keys_after.map(|k| k as f64))
            .collect();
        if !after.is_empty() {
            report.push(Row::versus(
                format!("{p}_keys_after"),
                med(after),
                "keys",
                med(runs
                    .iter()
                    .filter(|r| r.keys_after.is_some())
                    .map(|r| r.keys_expected as f64)
                    .collect()),
            ));
        }
        report.push(Row::plain(
            format!("{p}_preload_rate"),
            med(runs
                .iter()
                .map(|r| r.preloaded as f64 / r.preload_time.as_secs_f64())
                .collect()),
            "keys/s",
        ));
    }
}
