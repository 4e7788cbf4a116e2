//! Times log scans of a loaded table: a count (the walk alone) and an aggregate with a CNF
//! predicate over fixed-width fields, each as the median of several runs.
//!
//! `cargo run --release -p ramlog-logmem --example scanprobe -- [records] [scan_threads]`

use ramlog_logmem::query::{
    Aggregate, Cnf, Field, FieldType, KeyFilter, Op, Predicate, Query, Schema, Value,
};
use ramlog_logmem::{Engine, EngineConfig, PutOptions, ScanMethod};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let records: u64 = args.get(1).map_or(Ok(2_000_000), |s| s.parse())?;
    let threads: usize = args.get(2).map_or(Ok(0), |s| s.parse())?;
    let engine = Engine::new(EngineConfig {
        memory_bytes: records * 400 + (256 << 20),
        cleaner_threads: 0,
        scan_threads: threads,
        ..Default::default()
    })?;
    engine.create_tablet(1, 0, 8191)?;
    engine.create_tablet(1, 8192, 16383)?;
    let schema = Schema::new(vec![
        Field::new("id", FieldType::I64),
        Field::new("a", FieldType::I32),
        Field::new("b", FieldType::F64),
        Field::new("flag", FieldType::Bool),
        Field::new("payload", FieldType::Bytes),
    ])?;
    engine.set_schema(1, Some(schema.clone()));
    let mut record = Vec::new();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for id in 0..records {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let values = vec![
            Value::I64(id as i64),
            Value::I32((x % 1_000_000) as i32),
            Value::F64(((x >> 20) % 10_000) as f64 / 10.0 - 100.0),
            Value::Bool((x >> 40) & 3 == 0),
            Value::Bytes(vec![0x5A; 72]),
        ];
        record.clear();
        schema.encode_into(&values, &mut record)?;
        let key = format!("rec:{id:010}");
        let tablet = engine.locate(1, key.as_bytes()).expect("a tablet");
        engine.put(tablet, key.as_bytes(), &record, &PutOptions::default())?;
    }
    let bytes = engine.stats().new_bytes as f64;
    let count = Query {
        key_filter: KeyFilter::All,
        predicate: Cnf { clauses: vec![] },
        projection: None,
        aggregates: vec![Aggregate::Count],
        group_by: None,
    };
    let agg = Query {
        key_filter: KeyFilter::All,
        predicate: Cnf {
            clauses: vec![
                vec![
                    Predicate::new(1, Op::Lt, Value::I32(500_000)),
                    Predicate::new(3, Op::Eq, Value::Bool(true)),
                ],
                vec![Predicate::new(2, Op::Ge, Value::F64(0.0))],
            ],
        },
        projection: None,
        aggregates: vec![Aggregate::Count, Aggregate::Sum(1), Aggregate::Max(2)],
        group_by: None,
    };
    let only = std::env::var("SCANPROBE_ONLY").ok();
    let rounds: usize = std::env::var("SCANPROBE_ROUNDS").map_or(Ok(9), |s| s.parse())?;
    {
        // The physical limit beside the scans: one thread summing a buffer of the same size.
        let buf: Vec<u8> = (0..bytes as usize).map(|i| (i as u8) | 1).collect();
        let mut secs = Vec::new();
        for _ in 0..rounds {
            let t = Instant::now();
            let b = std::hint::black_box(&buf[..]);
            let mut sum = 0u64;
            for w in b.chunks_exact(8) {
                sum = sum.wrapping_add(u64::from_le_bytes(w.try_into().expect("8 bytes")));
            }
            std::hint::black_box(sum);
            secs.push(t.elapsed().as_secs_f64());
        }
        println!("     read: {:.2} GB/s", bytes / median(secs) / 1e9);
    }
    // `perf stat --control fifo:CTL -D -1` counts the scans only when SCANPROBE_PERF_CTL names
    // its control FIFO.
    let mut perf_ctl = match std::env::var("SCANPROBE_PERF_CTL") {
        Ok(path) => Some(std::fs::OpenOptions::new().write(true).open(path)?),
        Err(_) => None,
    };
    for (name, q) in [("count", &count), ("aggregate", &agg)] {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        if let Some(ctl) = &mut perf_ctl {
            use std::io::Write;
            ctl.write_all(b"enable\n")?;
        }
        let mut secs = Vec::new();
        let mut out = None;
        for _ in 0..rounds {
            let snap = engine.snapshot();
            let t = Instant::now();
            out = Some(engine.scan(1, &snap, q, ScanMethod::Log, 0)?.aggregates);
            secs.push(t.elapsed().as_secs_f64());
        }
        if let Some(ctl) = &mut perf_ctl {
            use std::io::Write;
            ctl.write_all(b"disable\n")?;
        }
        let fastest = secs.iter().copied().fold(f64::INFINITY, f64::min);
        let s = median(secs);
        println!(
            "{name:>9}: {:.2} GB/s, {:.1} ns/entry (fastest {:.1}) ({:?})",
            bytes / s / 1e9,
            s * 1e9 / records as f64,
            fastest * 1e9 / records as f64,
            out.flatten()
        );
    }
    if only.as_deref().is_none_or(|o| o == "shared") {
        // Four aggregates over different fields started together: they share passes.
        let four: Vec<Query> = [
            vec![vec![Predicate::new(1, Op::Lt, Value::I32(250_000))]],
            vec![vec![Predicate::new(2, Op::Ge, Value::F64(500.0))]],
            vec![vec![
                Predicate::new(3, Op::Eq, Value::Bool(true)),
                Predicate::new(0, Op::Lt, Value::I64(records as i64 / 2)),
            ]],
            vec![
                vec![Predicate::new(1, Op::Ge, Value::I32(600_000))],
                vec![Predicate::new(2, Op::Lt, Value::F64(100.0))],
            ],
        ]
        .into_iter()
        .map(|clauses| Query {
            predicate: Cnf { clauses },
            ..agg.clone()
        })
        .collect();
        let mut secs = Vec::new();
        for _ in 0..rounds {
            let barrier = std::sync::Barrier::new(four.len() + 1);
            let engine = &engine;
            let t = std::thread::scope(|s| {
                for q in &four {
                    let barrier = &barrier;
                    s.spawn(move || {
                        let snap = engine.snapshot();
                        barrier.wait();
                        engine.scan(1, &snap, q, ScanMethod::Log, 0).map(|_| ())
                    });
                }
                barrier.wait();
                Instant::now()
            });
            secs.push(t.elapsed().as_secs_f64());
        }
        let fastest = secs.iter().copied().fold(f64::INFINITY, f64::min);
        println!(
            "   shared: {:.1} ns/entry for four queries (fastest {:.1})",
            median(secs) * 1e9 / records as f64,
            fastest * 1e9 / records as f64,
        );
    }
    Ok(())
}
