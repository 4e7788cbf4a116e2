//! `ramlog bench scan`: log-order scans (TellStore) against the hash-index scan and one get per key,
//! and against the machine's sequential read bandwidth, measured in the same run.
//!
//! 1. Scan methods: 10M records of 100 B and 1M records of 1000 B (a schema'd table over two
//!    tablets), one aggregate query with a CNF predicate, run by the log scan, the hash-index scan
//!    and one `read_with` per key; on a clean log and on a log with 50% garbage (every record
//!    overwritten once, no snapshot open, no cleaning). All three must give the oracle's aggregates.
//! 2. Scan bandwidth: log bytes per second of the log scan against a sequential read of a buffer
//!    of the same size.
//! 3. Shared scans: four scans with different predicates run back to back, and started together
//!    from four threads (the log scan shares passes).
//! 4. Writes during a scan: one writer's put throughput with and without a thread looping scans.
//!
//! Each figure is the median of repeated runs; ratios compare figures of the same run.
//! `RAMLOG_BENCH_SCAN_SECTIONS=methods,bandwidth,shared,writes` runs a subset (all by default;
//! bandwidth and shared need the 100 B table that `methods` loads, and load it themselves if
//! `methods` is off).

use crate::report::{Report, Row, Target};
use crate::util::{median, scramble};
use anyhow::{bail, ensure, Context};
use ramlog_logmem::{Engine, EngineConfig, EngineError, PutOptions, ScanMethod, TabletId};
use ramlog_query::{
    Aggregate, Cnf, CompiledQuery, Field, FieldType, KeyFilter, Op, Predicate, Query, Schema, Value,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The one table every section scans.
const TABLE: u64 = 1;
/// Field indexes of the schema: `id i64, a i32, b f64, flag bool, payload bytes`.
const F_ID: usize = 0;
const F_A: usize = 1;
const F_B: usize = 2;
const F_FLAG: usize = 3;
/// Keys are `rec:{id:010}`.
const KEY_BYTES: usize = 14;
/// `a` is uniform in `0..A_RANGE`; `b` in `[-100, 900)`; `flag` is true for one record in four.
const A_RANGE: u64 = 1_000_000;
/// The main query: `(a < A_CUT OR flag = true) AND b >= 0.0`, aggregates Count, Sum(a), Max(b).
const A_CUT: i32 = 300_000;
/// Timed runs per figure.
const ROUNDS: usize = 3;
/// Alternating rounds of the bandwidth and shared-scan sections (a round takes 0.2–0.5 s): a scan
/// on both cores loses half its speed whenever a neighbour on this shared machine takes one of them
/// for a moment, which the one-thread read beside it does not notice, and which hits one side of a
/// shared-scan round more than the other; a median over more rounds is what the speeds usually are,
/// not what one burst made them.
const ALTERNATING_ROUNDS: usize = 9;
/// Alternating (idle, with scans) write runs: the idle rate alone moved by a fifth between full
/// runs (0.88–1.07 M puts/s), so a median of three was often one noisy window.
const WRITE_ROUNDS: usize = 5;

pub fn run(quick: bool, json: Option<&Path>) -> anyhow::Result<()> {
    let mut report = Report::new("scan", quick);
    println!(
        "machine: {} cores; full targets apply to the full run only",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    let sections = std::env::var("RAMLOG_BENCH_SCAN_SECTIONS")
        .unwrap_or_else(|_| "methods,bandwidth,shared,writes".into());
    let wants = |name: &str| sections.split(',').any(|s| s.trim() == name);
    let div: u64 = if quick { 20 } else { 1 };
    let small = Sizing {
        records: 10_000_000 / div,
        record_bytes: 100,
    };
    let large = Sizing {
        records: 1_000_000 / div,
        record_bytes: 1000,
    };
    if wants("methods") || wants("bandwidth") || wants("shared") {
        let table = Loaded::load(small, static_config(small))?;
        if wants("methods") {
            scan_methods(&mut report, &table, "clean")?;
        }
        if wants("bandwidth") {
            scan_bandwidth(&mut report, &table)?;
        }
        if wants("shared") {
            shared_scans(&mut report, &table)?;
        }
        if wants("methods") {
            let garbage = table.overwrite_all()?;
            report.push(Row::plain(
                format!("garbage_fraction_{}B", small.record_bytes),
                garbage,
                "x",
            ));
            scan_methods(&mut report, &table, "garbage50")?;
        }
    }
    if wants("methods") {
        let table = Loaded::load(large, static_config(large))?;
        scan_methods(&mut report, &table, "clean")?;
        let garbage = table.overwrite_all()?;
        report.push(Row::plain(
            format!("garbage_fraction_{}B", large.record_bytes),
            garbage,
            "x",
        ));
        scan_methods(&mut report, &table, "garbage50")?;
    }
    if wants("writes") {
        let records = if quick { 100_000 } else { 2_000_000 };
        let secs = if quick { 1.0 } else { 3.0 };
        writes_during_scan(&mut report, records, secs)?;
    }
    report.finish(json)
}

// ---------------------------------------------------------------------------------------------
// The table

#[derive(Clone, Copy, Debug)]
struct Sizing {
    records: u64,
    /// Bytes of one encoded record (the object's value).
    record_bytes: usize,
}

fn schema() -> Schema {
    Schema::new(vec![
        Field::new("id", FieldType::I64),
        Field::new("a", FieldType::I32),
        Field::new("b", FieldType::F64),
        Field::new("flag", FieldType::Bool),
        Field::new("payload", FieldType::Bytes),
    ])
    .expect("a valid schema")
}

/// The payload length that makes a record exactly `record_bytes` long.
fn payload_len_for(schema: &Schema, record_bytes: usize) -> anyhow::Result<usize> {
    let mut guess = record_bytes;
    for _ in 0..4 {
        let len = schema
            .encode(&row_values(schema_row(0, 0), vec![0; guess]))?
            .len();
        if len == record_bytes {
            return Ok(guess);
        }
        guess = (guess + record_bytes)
            .checked_sub(len)
            .context("record overhead exceeds the record size")?;
    }
    bail!("no payload length gives a record of {record_bytes} bytes")
}

/// The fields `a`, `b` and `flag` of record `id` in generation `gen` (0 = loaded, 1 = overwritten).
fn schema_row(id: u64, gen: u64) -> (i32, f64, bool) {
    let r = scramble(id ^ gen.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let a = (r % A_RANGE) as i32;
    let b = ((r >> 20) % 10_000) as f64 / 10.0 - 100.0;
    let flag = (r >> 40) & 3 == 0;
    (a, b, flag)
}

fn row_values((a, b, flag): (i32, f64, bool), payload: Vec<u8>) -> Vec<Value> {
    vec![
        Value::I64(0),
        Value::I32(a),
        Value::F64(b),
        Value::Bool(flag),
        Value::Bytes(payload),
    ]
}

/// Encodes record `id` of generation `gen` into `out`, reusing `values` (its payload stays).
fn encode_record(
    schema: &Schema,
    values: &mut [Value],
    id: u64,
    gen: u64,
    out: &mut Vec<u8>,
) -> anyhow::Result<()> {
    let (a, b, flag) = schema_row(id, gen);
    values[F_ID] = Value::I64(id as i64);
    values[F_A] = Value::I32(a);
    values[F_B] = Value::F64(b);
    values[F_FLAG] = Value::Bool(flag);
    out.clear();
    schema.encode_into(values, out)?;
    Ok(())
}

fn key_of(id: u64) -> [u8; KEY_BYTES] {
    let mut k = *b"rec:0000000000";
    let mut x = id;
    for i in (4..KEY_BYTES).rev() {
        k[i] = b'0' + (x % 10) as u8;
        x /= 10;
    }
    assert_eq!(x, 0, "id {id} has more than 10 digits");
    k
}

/// What the main query must return, computed beside the load.
#[derive(Default)]
struct Oracle {
    count: i64,
    sum_a: i64,
    max_b: Option<f64>,
}

impl Oracle {
    fn add(&mut self, (a, b, flag): (i32, f64, bool)) {
        if (a < A_CUT || flag) && b >= 0.0 {
            self.count += 1;
            self.sum_a += a as i64;
            self.max_b = Some(self.max_b.map_or(b, |m| m.max(b)));
        }
    }

    fn values(&self) -> Vec<Value> {
        if self.count == 0 {
            return vec![Value::I64(0), Value::Null, Value::Null];
        }
        vec![
            Value::I64(self.count),
            Value::I64(self.sum_a),
            Value::F64(self.max_b.unwrap_or(f64::NAN)),
        ]
    }
}

fn agg_query(clauses: Vec<Vec<Predicate>>) -> Query {
    Query {
        key_filter: KeyFilter::All,
        predicate: Cnf { clauses },
        projection: None,
        aggregates: vec![Aggregate::Count, Aggregate::Sum(F_A), Aggregate::Max(F_B)],
        group_by: None,
    }
}

/// `(a < A_CUT OR flag = true) AND b >= 0.0`.
fn main_query() -> Query {
    agg_query(vec![
        vec![
            Predicate::new(F_A, Op::Lt, Value::I32(A_CUT)),
            Predicate::new(F_FLAG, Op::Eq, Value::Bool(true)),
        ],
        vec![Predicate::new(F_B, Op::Ge, Value::F64(0.0))],
    ])
}

/// A loaded engine with the keys laid out for point gets.
struct Loaded {
    engine: Arc<Engine>,
    sizing: Sizing,
    schema: Schema,
    payload_len: usize,
    /// Keys of ids `0..records`, back to back (KEY_BYTES each).
    keys: Vec<u8>,
    /// The tablet of each key.
    tablets: Vec<TabletId>,
    /// Oracle of the main query for the current generation.
    oracle: Mutex<Oracle>,
    /// Log bytes right after the load (every entry's bytes).
    log_bytes: u64,
}

fn entry_bytes_estimate(record_bytes: usize) -> u64 {
    // Header (kind, version varint, two length varints, CRC) ~12 B, plus the key.
    (record_bytes + KEY_BYTES + 14) as u64
}

/// The engine of sections 1-3: a budget that holds two versions of every record with room to
/// spare, and no cleaner thread, so garbage stays where the overwrite leaves it (a scan hands
/// sparse segments to the cleaner, which would otherwise compact them away between runs).
fn static_config(sizing: Sizing) -> EngineConfig {
    let log_estimate = sizing.records * entry_bytes_estimate(sizing.record_bytes);
    EngineConfig {
        memory_bytes: (log_estimate as f64 * 2.6) as u64 + (256 << 20),
        cleaner_threads: 0,
        snapshot_max_age_ms: 600_000,
        ..Default::default()
    }
}

impl Loaded {
    /// A fresh engine (`config`) with the table over two tablets, loaded with generation 0.
    fn load(sizing: Sizing, config: EngineConfig) -> anyhow::Result<Loaded> {
        let n = sizing.records;
        let engine = Engine::new(config)?;
        engine.create_tablet(TABLE, 0, 8191)?;
        engine.create_tablet(TABLE, 8192, 16383)?;
        let schema = schema();
        engine.set_schema(TABLE, Some(schema.clone()));
        let payload_len = payload_len_for(&schema, sizing.record_bytes)?;
        let mut keys = Vec::with_capacity(n as usize * KEY_BYTES);
        let mut tablets = Vec::with_capacity(n as usize);
        for id in 0..n {
            let k = key_of(id);
            tablets.push(engine.locate(TABLE, &k).context("no tablet owns a key")?);
            keys.extend_from_slice(&k);
        }
        let table = Loaded {
            engine,
            sizing,
            schema,
            payload_len,
            keys,
            tablets,
            oracle: Mutex::new(Oracle::default()),
            log_bytes: 0,
        };
        let started = Instant::now();
        table.write_generation(0)?;
        let secs = started.elapsed().as_secs_f64();
        let stats = table.engine.stats();
        ensure!(
            stats.objects == n,
            "loaded {n} records, the engine holds {}",
            stats.objects
        );
        println!(
            "loaded {n} records of {} B in {secs:.1} s ({:.0} puts/s); log {:.0} MB",
            sizing.record_bytes,
            n as f64 / secs,
            stats.new_bytes as f64 / 1e6
        );
        Ok(Loaded {
            log_bytes: stats.new_bytes,
            ..table
        })
    }

    fn oracle(&self) -> MutexGuard<'_, Oracle> {
        self.oracle.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn key(&self, id: u64) -> &[u8] {
        let at = id as usize * KEY_BYTES;
        &self.keys[at..at + KEY_BYTES]
    }

    /// Writes every record (in id order) with generation `gen`, and resets the oracle to it.
    fn write_generation(&self, gen: u64) -> anyhow::Result<()> {
        let mut values = row_values((0, 0.0, false), vec![0x5A; self.payload_len]);
        let mut record = Vec::with_capacity(self.sizing.record_bytes);
        let mut oracle = Oracle::default();
        for id in 0..self.sizing.records {
            encode_record(&self.schema, &mut values, id, gen, &mut record)?;
            debug_assert_eq!(record.len(), self.sizing.record_bytes);
            self.engine.put(
                self.tablets[id as usize],
                self.key(id),
                &record,
                &PutOptions::default(),
            )?;
            oracle.add(schema_row(id, gen));
        }
        *self.oracle() = oracle;
        Ok(())
    }

    /// Overwrites every record once (no snapshot open), checks that nothing was cleaned, and
    /// returns the log's garbage fraction.
    fn overwrite_all(&self) -> anyhow::Result<f64> {
        ensure!(
            self.engine.stats().snapshots_open == 0,
            "a snapshot is open during the overwrite"
        );
        let started = Instant::now();
        self.write_generation(1)?;
        let s = self.engine.stats();
        println!(
            "overwrote {} records in {:.1} s",
            self.sizing.records,
            started.elapsed().as_secs_f64()
        );
        self.check_not_cleaned()?;
        Ok(1.0 - s.live_bytes as f64 / s.new_bytes.max(1) as f64)
    }

    /// The garbage figures mean something only if the cleaner left the log alone.
    fn check_not_cleaned(&self) -> anyhow::Result<()> {
        let s = self.engine.stats();
        ensure!(
            s.cleaner_copied_bytes == 0
                && s.cleaner_freed_bytes == 0
                && s.segments_cleaned == 0
                && s.compaction_passes + s.combined_passes == 0,
            "the cleaner ran (copied {} B, freed {} B, {} segments): the garbage figures would be wrong",
            s.cleaner_copied_bytes,
            s.cleaner_freed_bytes,
            s.segments_cleaned
        );
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Scan methods

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Method {
    Log,
    Hash,
    Get,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::Log => "log",
            Method::Hash => "hash",
            Method::Get => "get",
        }
    }
}

/// Runs the aggregate query once with `method` at `snap`; returns (seconds, aggregates).
fn run_method(
    t: &Loaded,
    snap: &ramlog_logmem::Snapshot,
    query: &Query,
    compiled: &CompiledQuery,
    method: Method,
) -> anyhow::Result<(f64, Vec<Value>)> {
    let engine = &t.engine;
    match method {
        Method::Log | Method::Hash => {
            let how = if method == Method::Log {
                ScanMethod::Log
            } else {
                ScanMethod::HashIndex
            };
            let started = Instant::now();
            let out = engine.scan(TABLE, snap, query, how, 0)?;
            let secs = started.elapsed().as_secs_f64();
            ensure!(out.malformed == 0, "{} malformed records", out.malformed);
            Ok((secs, out.aggregates.context("no aggregates")?))
        }
        Method::Get => {
            let mut agg = compiled.agg_state();
            let mut missing = 0u64;
            let mut malformed = 0u64;
            let started = Instant::now();
            for (i, key) in t.keys.chunks_exact(KEY_BYTES).enumerate() {
                let r = engine.read_with(t.tablets[i], key, |v, _, _| {
                    match compiled.matches(key, v) {
                        Ok(true) => agg.update(v).is_ok(),
                        Ok(false) => true,
                        Err(_) => false,
                    }
                })?;
                match r {
                    Some(true) => {}
                    Some(false) => malformed += 1,
                    None => missing += 1,
                }
            }
            let secs = started.elapsed().as_secs_f64();
            ensure!(
                missing == 0 && malformed == 0,
                "gets: {missing} keys missing, {malformed} malformed"
            );
            Ok((secs, agg.try_finish()?))
        }
    }
}

fn scan_methods(report: &mut Report, t: &Loaded, state: &str) -> anyhow::Result<()> {
    let size = format!("{}B", t.sizing.record_bytes);
    let n = t.sizing.records as f64;
    let query = main_query();
    let schema = t.engine.schema(TABLE).context("table has no schema")?;
    let compiled = CompiledQuery::new(query.clone(), Some(&schema))?;
    let expected = t.oracle().values();
    let methods = [Method::Log, Method::Hash, Method::Get];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); methods.len()];
    let snap = t.engine.snapshot();
    for _round in 0..ROUNDS {
        for (m, &method) in methods.iter().enumerate() {
            let (secs, aggs) = run_method(t, &snap, &query, &compiled, method)?;
            if aggs != expected {
                bail!(
                    "{size} {state}: the {} method returned {aggs:?}, the oracle {expected:?}",
                    method.name()
                );
            }
            times[m].push(secs);
        }
    }
    drop(snap);
    if state != "clean" {
        // Only now are the garbage timings known to be of a log the cleaner left alone.
        t.check_not_cleaned()?;
    }
    let rates: Vec<f64> = times.iter().map(|ts| n / median(ts)).collect();
    for (m, &method) in methods.iter().enumerate() {
        let name = format!("scan_{}_{state}_{size}", method.name());
        report.push(Row::plain(format!("{name}_time"), median(&times[m]), "s"));
        report.push(Row::plain(format!("{name}_rate"), rates[m], "rec/s"));
    }
    let target = if state == "clean" { 2.0 } else { 1.5 };
    report.push(
        Row::versus(
            format!("scan_log_vs_hash_{state}_{size}"),
            rates[0],
            "rec/s",
            rates[1],
        )
        .with_target(Target::at_least(target)),
    );
    report.push(Row::versus(
        format!("scan_log_vs_get_{state}_{size}"),
        rates[0],
        "rec/s",
        rates[2],
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. Scan bandwidth

/// Sums a buffer as u64 words, one thread: the sequential-read baseline.
fn sequential_read(buf: &[u8]) -> u64 {
    let buf = std::hint::black_box(buf);
    let mut sum = 0u64;
    for w in buf.chunks_exact(8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(w);
        sum = sum.wrapping_add(u64::from_le_bytes(word));
    }
    std::hint::black_box(sum)
}

fn scan_bandwidth(report: &mut Report, t: &Loaded) -> anyhow::Result<()> {
    let bytes = t.log_bytes;
    // Non-zero bytes, written once, so every page is really mapped (zero pages would read free).
    let buf: Vec<u8> = (0..bytes).map(|i| (i as u8) | 1).collect();
    sequential_read(&buf);
    let query = main_query();
    let count_query = Query {
        key_filter: KeyFilter::All,
        predicate: Cnf { clauses: vec![] },
        projection: None,
        aggregates: vec![Aggregate::Count],
        group_by: None,
    };
    let mut scan_secs = Vec::new();
    let mut count_secs = Vec::new();
    let mut read_secs = Vec::new();
    for _round in 0..ALTERNATING_ROUNDS {
        // The log walk alone: a count reads no field of the records.
        let snap = t.engine.snapshot();
        let started = Instant::now();
        let out = t
            .engine
            .scan(TABLE, &snap, &count_query, ScanMethod::Log, 0)?;
        count_secs.push(started.elapsed().as_secs_f64());
        ensure!(
            out.aggregates == Some(vec![Value::I64(t.sizing.records as i64)]),
            "count scan gave {:?}",
            out.aggregates
        );
        drop(snap);
        let snap = t.engine.snapshot();
        let started = Instant::now();
        let out = t.engine.scan(TABLE, &snap, &query, ScanMethod::Log, 0)?;
        scan_secs.push(started.elapsed().as_secs_f64());
        ensure!(
            out.aggregates == Some(t.oracle().values()),
            "log scan gave {:?}",
            out.aggregates
        );
        drop(snap);
        let started = Instant::now();
        sequential_read(&buf);
        read_secs.push(started.elapsed().as_secs_f64());
    }
    drop(buf);
    let scan_gbps = bytes as f64 / median(&scan_secs) / 1e9;
    let read_gbps = bytes as f64 / median(&read_secs) / 1e9;
    let count_gbps = bytes as f64 / median(&count_secs) / 1e9;
    println!(
        "scan bandwidth: log scan {scan_gbps:.2} GB/s (count only {count_gbps:.2} GB/s), sequential read {read_gbps:.2} GB/s over {:.0} MB",
        bytes as f64 / 1e6
    );
    report.push(Row::plain("scan_bandwidth_log_bytes", bytes as f64, "B"));
    report.push(Row::plain("scan_bandwidth_log_scan", scan_gbps, "GB/s"));
    report.push(Row::plain("scan_bandwidth_seq_read", read_gbps, "GB/s"));
    report.push(Row::versus(
        "scan_bandwidth_count_only_vs_seq_read",
        count_gbps,
        "GB/s",
        read_gbps,
    ));
    report.push(
        Row::versus("scan_bandwidth_vs_seq_read", scan_gbps, "GB/s", read_gbps)
            .with_target(Target::at_least(0.5)),
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 3. Shared scans

/// Four aggregate queries over different fields and constants.
fn four_queries(records: u64) -> Vec<Query> {
    vec![
        agg_query(vec![vec![Predicate::new(F_A, Op::Lt, Value::I32(250_000))]]),
        agg_query(vec![vec![Predicate::new(F_B, Op::Ge, Value::F64(500.0))]]),
        agg_query(vec![vec![
            Predicate::new(F_FLAG, Op::Eq, Value::Bool(true)),
            Predicate::new(F_ID, Op::Lt, Value::I64(records as i64 / 2)),
        ]]),
        agg_query(vec![
            vec![Predicate::new(F_A, Op::Ge, Value::I32(600_000))],
            vec![Predicate::new(F_B, Op::Lt, Value::F64(100.0))],
        ]),
    ]
}

fn shared_scans(report: &mut Report, t: &Loaded) -> anyhow::Result<()> {
    let engine = &t.engine;
    let queries = four_queries(t.sizing.records);
    let mut serial_secs = Vec::new();
    let mut concurrent_secs = Vec::new();
    let mut serial_results: Vec<Vec<Value>> = Vec::new();
    let (mut serial_passes, mut serial_queries) = (0u64, 0u64);
    let (mut conc_passes, mut conc_queries) = (0u64, 0u64);
    // CPU seconds per wall second of the whole process while the four scans run together.
    let mut conc_cores = Vec::new();
    for _round in 0..ALTERNATING_ROUNDS {
        // Back to back, each with its own snapshot.
        let before = engine.stats();
        let mut total = 0.0;
        let mut results = Vec::new();
        for q in &queries {
            let snap = engine.snapshot();
            let started = Instant::now();
            let out = engine.scan(TABLE, &snap, q, ScanMethod::Log, 0)?;
            total += started.elapsed().as_secs_f64();
            results.push(out.aggregates.context("no aggregates")?);
        }
        let after = engine.stats();
        serial_passes += after.scan_passes - before.scan_passes;
        serial_queries += after.scan_queries - before.scan_queries;
        serial_secs.push(total);
        if serial_results.is_empty() {
            serial_results = results;
        } else {
            ensure!(results == serial_results, "serial scans disagree by round");
        }

        // Together: four threads behind a barrier, wall time until all finish.
        let before = engine.stats();
        let barrier = Barrier::new(queries.len() + 1);
        let (secs, results) = std::thread::scope(|s| -> anyhow::Result<_> {
            let handles: Vec<_> = queries
                .iter()
                .map(|q| {
                    let barrier = &barrier;
                    s.spawn(move || -> anyhow::Result<Vec<Value>> {
                        let snap = engine.snapshot();
                        barrier.wait();
                        let out = engine.scan(TABLE, &snap, q, ScanMethod::Log, 0)?;
                        out.aggregates.context("no aggregates")
                    })
                })
                .collect();
            barrier.wait();
            let started = Instant::now();
            let cpu_started = crate::util::process_cpu_secs();
            let mut results = Vec::new();
            for h in handles {
                let r = h
                    .join()
                    .map_err(|_| anyhow::anyhow!("a scan thread panicked"))??;
                results.push(r);
            }
            let secs = started.elapsed().as_secs_f64();
            conc_cores.push((crate::util::process_cpu_secs() - cpu_started) / secs);
            Ok((secs, results))
        })?;
        let after = engine.stats();
        conc_passes += after.scan_passes - before.scan_passes;
        conc_queries += after.scan_queries - before.scan_queries;
        concurrent_secs.push(secs);
        ensure!(
            results == serial_results,
            "concurrent scans returned {results:?}, back to back {serial_results:?}"
        );
    }
    let rounds = ALTERNATING_ROUNDS as f64;
    report.push(Row::plain(
        "shared_scans_serial_time",
        median(&serial_secs),
        "s",
    ));
    report.push(Row::plain(
        "shared_scans_concurrent_time",
        median(&concurrent_secs),
        "s",
    ));
    report.push(
        Row::versus(
            "shared_scans_concurrent_vs_serial",
            median(&concurrent_secs),
            "s",
            median(&serial_secs),
        )
        .with_target(Target::at_most(0.5)),
    );
    report.push(Row::plain(
        "shared_scans_concurrent_cpu",
        median(&conc_cores),
        "cores",
    ));
    report.push(Row::plain(
        "shared_scans_serial_passes",
        serial_passes as f64 / rounds,
        "passes",
    ));
    report.push(Row::plain(
        "shared_scans_serial_queries",
        serial_queries as f64 / rounds,
        "queries",
    ));
    report.push(Row::plain(
        "shared_scans_concurrent_passes",
        conc_passes as f64 / rounds,
        "passes",
    ));
    report.push(Row::plain(
        "shared_scans_concurrent_queries",
        conc_queries as f64 / rounds,
        "queries",
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 4. Writes during a scan

struct WriteRun {
    puts_per_sec: f64,
    /// Puts per second of the writer thread's own CPU time.
    puts_per_cpu_sec: f64,
    /// CPU seconds per wall second of the writer thread and of the cleaner threads.
    writer_cpu_share: f64,
    cleaner_cpu_share: f64,
    scans_ok: u64,
    scans_too_old: u64,
}

/// CPU time of the calling thread, in seconds.
fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// CPU time (user + system) of this process's engine cleaner threads, in seconds, from /proc.
fn cleaner_cpu_secs() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    let mut total = 0.0;
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        // "tid (comm) state ..." : comm may hold spaces, so split after the last ')'.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if !stat[open + 1..close].starts_with("ramlog-cleaner") {
            continue;
        }
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // Fields after the comm start at the state (field 3): utime is field 14, stime 15.
        let num = |i: usize| -> f64 {
            fields
                .get(i - 3)
                .and_then(|f| f.parse().ok())
                .unwrap_or(0.0)
        };
        total += (num(14) + num(15)) / ticks;
    }
    total
}

/// One writer overwriting random keys for `secs`, with or without a thread looping log scans.
fn write_run(
    t: &Loaded,
    values: &[Vec<u8>],
    secs: f64,
    with_scan: bool,
) -> anyhow::Result<WriteRun> {
    let engine = &t.engine;
    let stop = AtomicBool::new(false);
    let scans_ok = AtomicU64::new(0);
    let scans_too_old = AtomicU64::new(0);
    let query = main_query();
    let n = t.sizing.records;
    std::thread::scope(|s| -> anyhow::Result<WriteRun> {
        let scanner = with_scan.then(|| {
            s.spawn(|| -> anyhow::Result<()> {
                while !stop.load(Ordering::Acquire) {
                    // A scan as a client runs it: at the current version, through a snapshot
                    // nobody else reads.
                    match engine.scan_now(TABLE, &query, ScanMethod::Log, 0) {
                        Ok((out, _)) => {
                            ensure!(out.malformed == 0, "scan saw malformed records");
                            scans_ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(EngineError::SnapshotTooOld { .. }) => {
                            scans_too_old.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                Ok(())
            })
        });
        let mut rng = SmallRng::seed_from_u64(0xC0FFEE ^ with_scan as u64);
        let deadline = Duration::from_secs_f64(secs);
        let started = Instant::now();
        let cpu_started = thread_cpu_secs();
        let cleaner_started = cleaner_cpu_secs();
        let mut puts = 0u64;
        let mut write = || -> anyhow::Result<()> {
            while started.elapsed() < deadline {
                for _ in 0..256 {
                    let id = rng.gen_range(0..n);
                    let v = &values[puts as usize % values.len()];
                    engine.put(t.tablets[id as usize], t.key(id), v, &PutOptions::default())?;
                    puts += 1;
                }
            }
            Ok(())
        };
        let result = write();
        let elapsed = started.elapsed().as_secs_f64();
        let cpu = thread_cpu_secs() - cpu_started;
        let cleaner_cpu = cleaner_cpu_secs() - cleaner_started;
        stop.store(true, Ordering::Release);
        if let Some(h) = scanner {
            h.join()
                .map_err(|_| anyhow::anyhow!("the scan thread panicked"))??;
        }
        result?;
        Ok(WriteRun {
            puts_per_sec: puts as f64 / elapsed,
            puts_per_cpu_sec: puts as f64 / cpu.max(1e-9),
            writer_cpu_share: cpu / elapsed,
            cleaner_cpu_share: cleaner_cpu / elapsed,
            scans_ok: scans_ok.load(Ordering::Relaxed),
            scans_too_old: scans_too_old.load(Ordering::Relaxed),
        })
    })
}

fn writes_during_scan(report: &mut Report, records: u64, secs: f64) -> anyhow::Result<()> {
    let sizing = Sizing {
        records,
        record_bytes: 100,
    };
    // The cleaner runs as in service. The budget leaves room for the overwrites of all runs,
    // and the retained-bytes bound is far above what one scan's snapshot keeps alive. The scan
    // runs on one thread, so that the writer keeps the other core (as a deployment that
    // reserves cores for writes would configure `scan_threads`).
    let memory_bytes = (records * entry_bytes_estimate(100) * 6).max(1 << 30);
    let t = Loaded::load(
        sizing,
        EngineConfig {
            memory_bytes,
            snapshot_max_retained_bytes: Some(memory_bytes / 3),
            scan_threads: 1,
            ..Default::default()
        },
    )?;
    // Fresh records: new field values, cycled through by the writer.
    let mut values_buf = row_values((0, 0.0, false), vec![0xA5; t.payload_len]);
    let values: Vec<Vec<u8>> = (0..4096u64)
        .map(|i| {
            let mut out = Vec::with_capacity(100);
            encode_record(&t.schema, &mut values_buf, i, 2 + i, &mut out).map(|_| out)
        })
        .collect::<anyhow::Result<_>>()?;
    let before = t.engine.stats();
    // Runs alternate (idle, with scans) so that slow drifts hit both alike.
    let mut idle: Vec<WriteRun> = Vec::new();
    let mut busy: Vec<WriteRun> = Vec::new();
    let mut copied = [0u64; 2];
    for _round in 0..WRITE_ROUNDS {
        for (phase, with_scan) in [false, true].into_iter().enumerate() {
            let s0 = t.engine.stats().cleaner_copied_bytes;
            let r = write_run(&t, &values, secs, with_scan)?;
            copied[phase] += t.engine.stats().cleaner_copied_bytes - s0;
            if with_scan {
                busy.push(r);
            } else {
                idle.push(r);
            }
        }
    }
    let after = t.engine.stats();
    let med = |runs: &[WriteRun], f: fn(&WriteRun) -> f64| -> f64 {
        median(&runs.iter().map(f).collect::<Vec<_>>())
    };
    let scans_ok: u64 = busy.iter().map(|r| r.scans_ok).sum();
    let scans_too_old: u64 = busy.iter().map(|r| r.scans_too_old).sum();
    let mut row = Row::versus(
        "puts_during_scan_vs_idle",
        med(&busy, |r| r.puts_per_sec),
        "ops/s",
        med(&idle, |r| r.puts_per_sec),
    )
    .with_target(Target::at_least(0.8));
    if scans_too_old > 0 || scans_ok == 0 {
        // Scans that fail (or never finish) do not count as writes during a scan.
        row.pass = Some(false);
    }
    report.push(Row::plain(
        "puts_idle",
        med(&idle, |r| r.puts_per_sec),
        "ops/s",
    ));
    report.push(row);
    // Where the difference comes from: the writer's CPU share of the 2 cores, and its puts per
    // CPU-second (the cost of a put itself).
    report.push(Row::versus(
        "puts_per_cpu_s_during_scan_vs_idle",
        med(&busy, |r| r.puts_per_cpu_sec),
        "ops/cpu-s",
        med(&idle, |r| r.puts_per_cpu_sec),
    ));
    type Share = fn(&WriteRun) -> f64;
    let shares: [(&str, Share); 2] = [
        ("writer", |r| r.writer_cpu_share),
        ("cleaner", |r| r.cleaner_cpu_share),
    ];
    for (who, share) in shares {
        for (when, runs) in [("idle", &idle), ("during_scan", &busy)] {
            report.push(Row::plain(
                format!("{who}_cpu_share_{when}"),
                med(runs, share),
                "cores",
            ));
        }
    }
    report.push(Row::plain(
        "writes_cleaner_copied_bytes_idle",
        copied[0] as f64,
        "B",
    ));
    report.push(Row::plain(
        "writes_cleaner_copied_bytes_during_scan",
        copied[1] as f64,
        "B",
    ));
    report.push(Row::plain(
        "scans_during_puts",
        scans_ok as f64 / WRITE_ROUNDS as f64,
        "scans",
    ));
    report.push(Row::plain(
        "scans_during_puts_too_old",
        scans_too_old as f64,
        "scans",
    ));
    report.push(Row::plain(
        "snapshots_too_old",
        (after.snapshots_too_old - before.snapshots_too_old) as f64,
        "snaps",
    ));
    report.push(Row::plain(
        "writes_versions_kept_in_place",
        (after.kept_in_place_versions - before.kept_in_place_versions) as f64,
        "versions",
    ));
    report.push(Row::plain(
        "writes_scan_sparse_segments",
        (after.scan_sparse_segments - before.scan_sparse_segments) as f64,
        "segs",
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_have_the_asked_size() {
        let schema = schema();
        for size in [100, 1000] {
            let p = payload_len_for(&schema, size).unwrap();
            let mut values = row_values((0, 0.0, false), vec![1; p]);
            let mut out = Vec::new();
            encode_record(&schema, &mut values, 12345, 1, &mut out).unwrap();
            assert_eq!(out.len(), size);
            let decoded = schema.decode(&out).unwrap();
            assert_eq!(decoded[F_ID], Value::I64(12345));
        }
    }

    #[test]
    fn keys_are_fixed_width_and_ordered() {
        assert_eq!(&key_of(0), b"rec:0000000000");
        assert_eq!(&key_of(9_876_543_210), b"rec:9876543210");
        assert!(key_of(99) < key_of(100));
    }

    #[test]
    fn three_methods_agree_with_the_oracle_on_clean_and_garbage_logs() {
        let sizing = Sizing {
            records: 3000,
            record_bytes: 100,
        };
        let t = Loaded::load(sizing, static_config(sizing)).unwrap();
        let query = main_query();
        let compiled = CompiledQuery::new(query.clone(), Some(&schema())).unwrap();
        for gen in 0..2 {
            if gen == 1 {
                t.overwrite_all().unwrap();
            }
            let expected = t.oracle().values();
            assert!(
                matches!(expected[0], Value::I64(c) if c > 100),
                "{expected:?}"
            );
            let snap = t.engine.snapshot();
            for m in [Method::Log, Method::Hash, Method::Get] {
                let (_, aggs) = run_method(&t, &snap, &query, &compiled, m).unwrap();
                assert_eq!(aggs, expected, "{m:?} gen {gen}");
            }
        }
        t.check_not_cleaned().unwrap();
    }
}
