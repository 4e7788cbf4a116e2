//! `ramlog bench scan --cluster`: filtered scans and aggregates over a cluster table, against the
//! way a Redis Cluster user answers the same question today.
//!
//! Three ramlog servers (R = 2, `sync`) hold a table of `RAMLOG_BENCH_SCAN_RECORDS` records (default
//! 200 000 quick, 10 000 000 full) of about 100 B with a schema (`id i64, score i64, price f64,
//! flag bool, name string`), written through the Rust `ClusterClient` in MULTI_PUT batches of one
//! slot. A Redis Cluster of three masters (one replica each) holds the same records as hashes.
//! Rows (medians of `RAMLOG_BENCH_SCAN_REPEATS`, default 1 quick, 3 full):
//! - the full scan (an aggregate that reads every record: count and sum of `score`) of the whole
//!   cluster, against the sum of each server's rate when it alone scans its tablets (all of them at
//!   once, nothing else running). Three servers share this machine's two cores in the cluster scan,
//!   so the bound of the ratio here is about 2/3 of what a server alone reaches with both cores;
//! - a selective aggregate (`score < 1000`: 1 % of the records; count and sum of `price`) through
//!   `ClusterClient::scan_aggregates`, against Redis Cluster `SCAN` + `HGETALL` of every key on
//!   every master (in parallel, pipelined) with the filter and the sum in the client. Both
//!   answers must be equal;
//! - the RESP foreground (SETs of [`THREADS`] writers over the cluster ports) during full scans
//!   run back to back, against the 2 s before;
//! - keys repeated or missed by a record scan of the whole table (projection of `id`).

use super::client::{encode, fetch_map, Conn, Nodes, Reply};
use super::load::{Load, LOAD_KEYS, THREADS};
use super::migration::slot_tags;
use super::ramlog::{run_tool, RamlogCluster};
use super::redis::{redis_cluster_of, require_tools};
use crate::report::{Report, Row, Target};
use anyhow::{bail, Context};
use ramlog_client::{ClientConfig, ClusterClient};
use ramlog_common::SLOT_COUNT;
use ramlog_query::{Aggregate, Cnf, Field, FieldType, Op, Predicate, Query, Schema, Value};
use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

const SERVERS: usize = 3;
const TABLE: &str = "scanbench";
const SCHEMA: &str = "id:i64,score:i64,price:f64,flag:bool,name:string";
/// Records per MULTI_PUT (all of one slot) and batches in flight.
const BATCH: u64 = 100;
const IN_FLIGHT: usize = 32;
/// Scores are uniform in 0..SCORE_RANGE; the selective query keeps score < SELECTIVE_BELOW (1 %).
const SCORE_RANGE: i64 = 100_000;
const SELECTIVE_BELOW: i64 = 1_000;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn score_of(i: u64) -> i64 {
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) as i64 % SCORE_RANGE
}

fn price_of(i: u64) -> f64 {
    (i % 1000) as f64 * 0.5
}

fn name_of(i: u64) -> String {
    let mut s = format!("record-{i}-");
    s.extend(std::iter::repeat_n('n', 72usize.saturating_sub(s.len())));
    s
}

/// The slot of batch `b` (consecutive batches spread over every slot: 10 007 is odd, so this
/// walks all 16 384 slots before it repeats).
fn batch_slot(b: u64) -> u16 {
    (b.wrapping_mul(10_007) % u64::from(SLOT_COUNT)) as u16
}

/// Record `i`'s key: batch `i / BATCH` lies in one slot.
fn key_of(tags: &[String], i: u64) -> String {
    format!("r{{{}}}:{i}", tags[batch_slot(i / BATCH) as usize])
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs.get(xs.len() / 2).copied().unwrap_or(0.0)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")
}

pub fn run(quick: bool, json: Option<&Path>) -> anyhow::Result<()> {
    require_tools()?;
    let records =
        env_u64("RAMLOG_BENCH_SCAN_RECORDS").unwrap_or(if quick { 200_000 } else { 10_000_000 });
    let repeats = env_u64("RAMLOG_BENCH_SCAN_REPEATS")
        .unwrap_or(if quick { 1 } else { 3 })
        .max(1) as usize;
    println!(
        "{records} records of about 100 B; ramlog {SERVERS} servers (R = 2, sync) against Redis Cluster \
         3 masters + 3 replicas (hashes); {repeats} repeat(s)"
    );
    let work =
        std::env::temp_dir().join(format!("ramlog-bench-cluster-scan-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut report = Report::new("scan-cluster", quick);
    let result = measure(&work, records, repeats, &mut report);
    let _ = std::fs::remove_dir_all(&work);
    result?;
    report.finish(json)
}

fn measure(work: &Path, records: u64, repeats: usize, report: &mut Report) -> anyhow::Result<()> {
    let tags = slot_tags();
    // About 150 B per record in memory on its master; room for the load and the cleaner.
    let memory_mib = ((records * 150 / SERVERS as u64) >> 20) * 2 + 512;
    let cluster = RamlogCluster::start(&work.join("ramlog"), SERVERS, memory_mib)?;
    let created = run_tool(
        &[
            "table",
            "create",
            TABLE,
            "--schema",
            SCHEMA,
            "--coordinator",
            &cluster.coordinator,
        ],
        Duration::from_secs(30),
    )?;
    let table: u64 = created
        .split(" id=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no table id in {created:?}"))?;
    let rt = runtime()?;
    let seed = cluster.servers[0].native.clone();
    let client = rt.block_on(async {
        let mut config = ClientConfig::new(seed.clone());
        config.connections = 4;
        ClusterClient::connect(config).await
    })?;
    let client = client.with_table(table);
    // The table's tablets are in the client's map once the servers serve it.
    rt.block_on(client.refresh_map())?;
    let schema = Schema::new(vec![
        Field::new("id", FieldType::I64),
        Field::new("score", FieldType::I64),
        Field::new("price", FieldType::F64),
        Field::new("flag", FieldType::Bool),
        Field::new("name", FieldType::String),
    ])?;
    let started = Instant::now();
    rt.block_on(preload_ramlog(&client, &schema, &tags, records))?;
    println!(
        "  ramlog preload: {records} records in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // Keys repeated or missed by a record scan of the whole table.
    let ids = Query {
        projection: Some(vec![0]),
        ..Default::default()
    };
    let rows = rt.block_on(client.scan_records(&ids, 10_000))?;
    let unique: HashSet<&[u8]> = rows.iter().map(|r| &r.key[..]).collect();
    let repeated = rows.len() as u64 - unique.len() as u64;
    let missed = records.saturating_sub(unique.len() as u64);
    println!(
        "  record scan: {} records, {repeated} repeated, {missed} missed",
        rows.len()
    );
    drop(rows);

    // Full scans: the whole cluster, then each server alone on its tablets.
    let full = Query {
        aggregates: vec![Aggregate::Count, Aggregate::Sum(1)],
        ..Default::default()
    };
    let map = client.map();
    let mut cluster_rates = Vec::new();
    let mut single_sums = Vec::new();
    for repeat in 1..=repeats {
        let t = Instant::now();
        let a = rt.block_on(client.scan_aggregates(&full))?;
        let took = t.elapsed();
        if a.values.first() != Some(&Value::I64(records as i64)) {
            bail!(
                "the full scan counted {:?} records, not {records}",
                a.values.first()
            );
        }
        let rate = records as f64 / took.as_secs_f64();
        let mut sum = 0.0;
        let mut per_server = Vec::new();
        for s in &map.servers {
            let tablets: Vec<(u16, u16, u64)> = map
                .tablets_of(table)
                .filter(|t| t.master == s.id)
                .map(|t| (t.first_slot, t.last_slot, t.epoch))
                .collect();
            if tablets.is_empty() {
                continue;
            }
            let (n, took) = rt.block_on(scan_server_alone(
                &s.addresses.native.to_string(),
                table,
                &tablets,
                &full,
            ))?;
            sum += n as f64 / took.as_secs_f64();
            per_server.push(format!(
                "server {}: {n} in {:.0} ms",
                s.id,
                took.as_secs_f64() * 1e3
            ));
        }
        println!(
            "  full scan #{repeat}: cluster {:.0} ms ({:.2} M records/s); alone: {} (sum {:.2} M records/s)",
            took.as_secs_f64() * 1e3,
            rate / 1e6,
            per_server.join(", "),
            sum / 1e6
        );
        cluster_rates.push(rate);
        single_sums.push(sum);
    }

    // The selective aggregate, ramlog.
    let selective = Query {
        predicate: Cnf {
            clauses: vec![vec![Predicate {
                field: 1,
                op: Op::Lt,
                constant: Value::I64(SELECTIVE_BELOW),
            }]],
        },
        aggregates: vec![Aggregate::Count, Aggregate::Sum(2)],
        ..Default::default()
    };
    let mut ours = Vec::new();
    let mut answer = (0i64, 0.0f64);
    for _ in 0..repeats {
        let t = Instant::now();
        let a = rt.block_on(client.scan_aggregates(&selective))?;
        ours.push(t.elapsed().as_secs_f64());
        answer = match (&a.values[0], &a.values[1]) {
            (Value::I64(n), Value::F64(p)) => (*n, *p),
            (Value::I64(n), Value::Null) => (*n, 0.0),
            other => bail!("unexpected aggregate values {other:?}"),
        };
    }
    println!(
        "  selective aggregate (score < {SELECTIVE_BELOW}): {} records, sum of price {:.1}; {:.1} ms",
        answer.0,
        answer.1,
        median(ours.clone()) * 1e3
    );
    // The same at one cluster snapshot: the cut, then the scans at it.
    let mut cuts = Vec::new();
    let mut consistent = Vec::new();
    for _ in 0..repeats {
        let t = Instant::now();
        let snapshot = rt.block_on(client.cluster_snapshot())?;
        cuts.push(t.elapsed().as_secs_f64());
        let a = rt.block_on(client.scan_aggregates_at(&snapshot, &selective))?;
        consistent.push(t.elapsed().as_secs_f64());
        if a.values[0] != Value::I64(answer.0) {
            bail!(
                "at a cluster snapshot the selective aggregate counted {:?}, not {}",
                a.values[0],
                answer.0
            );
        }
        rt.block_on(snapshot.release())?;
    }
    println!(
        "  at a cluster snapshot: cut {:.1} ms, cut and selective aggregate {:.1} ms",
        median(cuts.clone()) * 1e3,
        median(consistent.clone()) * 1e3
    );

    // The foreground during full scans.
    let seeds: Vec<String> = cluster.servers.iter().map(|s| s.resp.clone()).collect();
    let load = Load::start(&seeds, THREADS, LOAD_KEYS / THREADS, 100)?;
    std::thread::sleep(Duration::from_secs(3));
    let before_from = Instant::now() - Duration::from_secs(2);
    let before_to = Instant::now();
    let scans_from = Instant::now();
    let mut scans = 0;
    while scans_from.elapsed() < Duration::from_secs(3) || scans == 0 {
        rt.block_on(client.scan_aggregates(&full))?;
        scans += 1;
    }
    let scans_to = Instant::now();
    let result = load.stop();
    let before = result.window(before_from, before_to);
    let during = result.window(scans_from, scans_to);
    println!(
        "  foreground: {:.0}/s before, {:.0}/s during {scans} full scans",
        before.per_second, during.per_second
    );
    // And while cluster snapshots are cut back to back (each holds every master's writes for
    // its hold), each read by a selective aggregate.
    let load = Load::start(&seeds, THREADS, LOAD_KEYS / THREADS, 100)?;
    std::thread::sleep(Duration::from_secs(3));
    let cut_before_from = Instant::now() - Duration::from_secs(2);
    let cut_before_to = Instant::now();
    let cuts_from = Instant::now();
    let mut snapshots = 0;
    while cuts_from.elapsed() < Duration::from_secs(3) || snapshots == 0 {
        rt.block_on(client.scan_aggregates_consistent(&selective))?;
        snapshots += 1;
    }
    let cuts_to = Instant::now();
    let cut_result = load.stop();
    let cut_before = cut_result.window(cut_before_from, cut_before_to);
    let cut_during = cut_result.window(cuts_from, cuts_to);
    println!(
        "  foreground: {:.0}/s before, {:.0}/s during {snapshots} snapshot scans ({:.1} per second)",
        cut_before.per_second,
        cut_during.per_second,
        snapshots as f64 / (cuts_to - cuts_from).as_secs_f64()
    );
    drop(cluster);

    // Redis Cluster: the same records as hashes, the same question by SCAN + HGETALL.
    let nodes = redis_cluster_of(&work.join("redis"), 5000, SERVERS)?;
    let addrs: Vec<String> = nodes.iter().map(|n| n.addr()).collect();
    let started = Instant::now();
    let masters = preload_redis(&addrs, &tags, records)?;
    println!(
        "  Redis preload: {records} hashes in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let mut theirs = Vec::new();
    for _ in 0..repeats {
        let t = Instant::now();
        let got = redis_selective(&masters)?;
        theirs.push(t.elapsed().as_secs_f64());
        if got.0 != answer.0 || (got.1 - answer.1).abs() > 1e-6 * answer.1.abs().max(1.0) {
            bail!("Redis Cluster answered {got:?}, ramlog {answer:?}");
        }
    }
    println!(
        "  Redis SCAN + HGETALL + client filter: {:.1} ms (same answer)",
        median(theirs.clone()) * 1e3
    );
    drop(nodes);

    let cluster_rate = median(cluster_rates);
    let single_sum = median(single_sums);
    report.push(Row::plain(
        "cluster_full_scan_records_per_s",
        cluster_rate,
        "records/s",
    ));
    report.push(
        Row::versus(
            "cluster_full_scan_over_sum_of_single_servers",
            cluster_rate,
            "records/s",
            single_sum,
        )
        .with_target(Target::at_least(0.8)),
    );
    let (ours, theirs) = (median(ours), median(theirs));
    report.push(Row::plain("selective_aggregate_ms", ours * 1e3, "ms"));
    report.push(Row::plain(
        "redis_scan_hgetall_filter_ms",
        theirs * 1e3,
        "ms",
    ));
    report.push(
        Row::plain(
            "selective_aggregate_speedup_vs_redis_scan",
            theirs / ours.max(1e-9),
            "x",
        )
        .with_target(Target::at_least(20.0)),
    );
    report.push(
        Row::versus(
            "foreground_during_full_scan_over_before",
            during.per_second,
            "ops/s",
            before.per_second,
        )
        .with_target(Target::at_least(0.8)),
    );
    report.push(Row::plain(
        "cluster_snapshot_cut_ms",
        median(cuts) * 1e3,
        "ms",
    ));
    report.push(Row::versus(
        "selective_aggregate_at_cluster_snapshot_ms",
        median(consistent) * 1e3,
        "ms",
        ours * 1e3,
    ));
    report.push(Row::versus(
        "foreground_during_snapshot_scans_over_before",
        cut_during.per_second,
        "ops/s",
        cut_before.per_second,
    ));
    report.push(
        Row::plain(
            "scan_keys_repeated_or_missed",
            (repeated + missed) as f64,
            "keys",
        )
        .with_target(Target::at_most(0.0)),
    );
    Ok(())
}

async fn preload_ramlog(
    client: &ClusterClient,
    schema: &Schema,
    tags: &[String],
    records: u64,
) -> anyhow::Result<()> {
    let batches = records.div_ceil(BATCH);
    let mut tasks = Vec::new();
    for part in 0..IN_FLIGHT as u64 {
        let client = client.clone();
        let schema = schema.clone();
        let tags = tags.to_vec();
        tasks.push(tokio::spawn(async move {
            let mut b = part;
            while b < batches {
                let items: Vec<(Vec<u8>, Vec<u8>)> = (b * BATCH..((b + 1) * BATCH).min(records))
                    .map(|i| {
                        let value = schema.encode(&[
                            Value::I64(i as i64),
                            Value::I64(score_of(i)),
                            Value::F64(price_of(i)),
                            Value::Bool(i % 2 == 0),
                            Value::Str(name_of(i)),
                        ]);
                        (
                            key_of(&tags, i).into_bytes(),
                            value.expect("a record of the schema"),
                        )
                    })
                    .collect();
                let refs: Vec<(&[u8], &[u8])> =
                    items.iter().map(|(k, v)| (&k[..], &v[..])).collect();
                client.multi_put(&refs).await?;
                b += IN_FLIGHT as u64;
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// One server alone scanning its `tablets` (all at once): records counted and the time.
async fn scan_server_alone(
    addr: &str,
    table: u64,
    tablets: &[(u16, u16, u64)],
    query: &Query,
) -> anyhow::Result<(u64, Duration)> {
    let mut config = ClientConfig::new(addr.to_string());
    config.connections = 4;
    let client = ramlog_client::Client::connect(config).await?;
    let bytes = query.to_bytes()?;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for &(first, last, epoch) in tablets {
        let client = client.clone();
        let bytes = bytes.clone();
        tasks.push(tokio::spawn(async move {
            client
                .scan_tablet_raw(
                    table,
                    ramlog_client::TabletScan::whole(first, last, epoch),
                    ramlog_client::ScanAt::Master,
                    &bytes,
                    1,
                )
                .await
        }));
    }
    let mut n = 0u64;
    for t in tasks {
        match t.await?? {
            ramlog_client::ScanResult::Aggregates(a) => match a.values.first() {
                Some(Value::I64(c)) => n += *c as u64,
                other => bail!("a tablet's count is {other:?}"),
            },
            ramlog_client::ScanResult::Records { .. } => bail!("records for an aggregate query"),
        }
    }
    Ok((n, started.elapsed()))
}

/// Writes the records as hashes to the masters serving their slots; returns the masters.
fn preload_redis(addrs: &[String], tags: &[String], records: u64) -> anyhow::Result<Vec<String>> {
    let nodes = Nodes::default();
    let map = fetch_map(addrs.iter().map(String::as_str), &nodes, None)
        .context("no Redis node answered CLUSTER SLOTS")?;
    let master_of = |slot: u16| {
        nodes
            .name(map[slot as usize])
            .context("a slot without a master")
    };
    let mut masters: Vec<String> = Vec::new();
    for slot in 0..SLOT_COUNT {
        let m = master_of(slot)?;
        if !masters.contains(&m) {
            masters.push(m);
        }
    }
    let batches = records.div_ceil(BATCH);
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let handles: Vec<_> = masters
            .iter()
            .map(|master| {
                let master = master.clone();
                let master_of = &master_of;
                scope.spawn(move || -> anyhow::Result<()> {
                    let mut conn = Conn::open(&master)?;
                    let mut out = Vec::new();
                    let mut pending = 0;
                    for b in 0..batches {
                        if master_of(batch_slot(b))? != master {
                            continue;
                        }
                        for i in b * BATCH..((b + 1) * BATCH).min(records) {
                            let (id, score, price) = (
                                i.to_string(),
                                score_of(i).to_string(),
                                price_of(i).to_string(),
                            );
                            let flag = if i % 2 == 0 { "1" } else { "0" };
                            let key = key_of(tags, i);
                            let name = name_of(i);
                            encode(
                                &mut out,
                                &[
                                    b"HSET",
                                    key.as_bytes(),
                                    b"id",
                                    id.as_bytes(),
                                    b"score",
                                    score.as_bytes(),
                                    b"price",
                                    price.as_bytes(),
                                    b"flag",
                                    flag.as_bytes(),
                                    b"name",
                                    name.as_bytes(),
                                ],
                            );
                            pending += 1;
                        }
                        if pending >= 1000 {
                            conn.send(&out)?;
                            out.clear();
                            for _ in 0..pending {
                                if let Reply::Error(e) = conn.recv()? {
                                    bail!("HSET on {master}: {e}");
                                }
                            }
                            pending = 0;
                        }
                    }
                    conn.send(&out)?;
                    for _ in 0..pending {
                        if let Reply::Error(e) = conn.recv()? {
                            bail!("HSET on {master}: {e}");
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("a preload thread panicked"))??;
        }
        Ok(())
    })?;
    Ok(masters)
}

/// What a Redis Cluster user does for the selective aggregate: on every master at once, SCAN its
/// keys and HGETALL each (pipelined per SCAN page), keep score < SELECTIVE_BELOW, count and sum
/// the price.
fn redis_selective(masters: &[String]) -> anyhow::Result<(i64, f64)> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = masters
            .iter()
            .map(|master| {
                scope.spawn(move || -> anyhow::Result<(i64, f64)> {
                    let mut conn = Conn::open(master)?;
                    let (mut n, mut sum) = (0i64, 0.0f64);
                    let mut cursor = b"0".to_vec();
                    loop {
                        let Reply::Array(Some(parts)) =
                            conn.call(&[b"SCAN", &cursor, b"COUNT", b"1000"])?
                        else {
                            bail!("SCAN on {master}: not an array");
                        };
                        let (Some(Reply::Bulk(Some(next))), Some(Reply::Array(Some(keys)))) =
                            (parts.first(), parts.get(1))
                        else {
                            bail!("SCAN on {master}: malformed reply");
                        };
                        let mut out = Vec::new();
                        for k in keys {
                            if let Reply::Bulk(Some(k)) = k {
                                encode(&mut out, &[b"HGETALL", k]);
                            }
                        }
                        conn.send(&out)?;
                        for _ in 0..keys.len() {
                            let Reply::Array(Some(fields)) = conn.recv()? else {
                                bail!("HGETALL on {master}: not an array");
                            };
                            let field = |name: &[u8]| {
                                fields.chunks(2).find_map(|p| match p {
                                    [Reply::Bulk(Some(f)), Reply::Bulk(Some(v))] if f == name => {
                                        std::str::from_utf8(v).ok().map(str::to_string)
                                    }
                                    _ => None,
                                })
                            };
                            let score: i64 = field(b"score")
                                .and_then(|s| s.parse().ok())
                                .unwrap_or(i64::MAX);
                            if score < SELECTIVE_BELOW {
                                n += 1;
                                sum += field(b"price").and_then(|s| s.parse().ok()).unwrap_or(0.0);
                            }
                        }
                        cursor = next.to_vec();
                        if cursor == b"0" {
                            return Ok((n, sum));
                        }
                    }
                })
            })
            .collect();
        let mut total = (0i64, 0.0f64);
        for h in handles {
            let (n, s) = h
                .join()
                .map_err(|_| anyhow::anyhow!("a scan thread panicked"))??;
            total.0 += n;
            total.1 += s;
        }
        Ok(total)
    })
}
