//! Prints what `CompiledQuery::matches` costs per record for a 3-clause CNF over 100-byte records
//! (run with `--release --nocapture` to see the figure). It checks the answers, never the time.

use ramlog_query::*;
use std::hint::black_box;
use std::time::Instant;

#[test]
fn matches_cost_per_record() {
    let schema = Schema::new(vec![
        Field::new("id", FieldType::I64),
        Field::new("age", FieldType::I32),
        Field::new("score", FieldType::F64),
        Field::new("active", FieldType::Bool),
        Field::new("name", FieldType::String),
    ])
    .unwrap();
    // 1024 records of exactly 100 bytes: 1 + 1 + 21 fixed + 1 offset + 76 bytes of name.
    let records: Vec<Vec<u8>> = (0..1024i64)
        .map(|i| {
            let prefix = if i % 3 == 0 { "user" } else { "item" };
            let name = format!("{prefix}{i:04}{}", "x".repeat(68));
            let row = vec![
                Value::I64(i),
                if i % 7 == 0 {
                    Value::Null
                } else {
                    Value::I32((i % 90) as i32)
                },
                Value::F64(i as f64 / 10.0),
                Value::Bool(i % 2 == 0),
                Value::Str(name),
            ];
            schema.encode(&row).unwrap()
        })
        .collect();
    assert!(records.iter().all(|r| r.len() == 100));

    // (age >= 18 OR active) AND score < 80.0 AND (name prefix "user" OR id = 5)
    let query = Query {
        predicate: Cnf {
            clauses: vec![
                vec![
                    Predicate::new(1, Op::Ge, Value::I32(18)),
                    Predicate::new(3, Op::Eq, Value::Bool(true)),
                ],
                vec![Predicate::new(2, Op::Lt, Value::F64(80.0))],
                vec![
                    Predicate::new(4, Op::Prefix, Value::Str("user".into())),
                    Predicate::new(0, Op::Eq, Value::I64(5)),
                ],
            ],
        },
        ..Query::default()
    };
    let compiled = CompiledQuery::new(query, Some(&schema)).unwrap();
    let expected = (0..1024i64)
        .filter(|&i| {
            let age_ok = i % 7 != 0 && i % 90 >= 18;
            (age_ok || i % 2 == 0) && (i as f64 / 10.0) < 80.0 && (i % 3 == 0 || i == 5)
        })
        .count();

    let rounds = if cfg!(debug_assertions) { 20 } else { 2000 };
    let mut hits = 0usize;
    let start = Instant::now();
    for _ in 0..rounds {
        for r in &records {
            hits += compiled.matches(black_box(b"key"), black_box(r)).unwrap() as usize;
        }
    }
    let elapsed = start.elapsed();
    assert_eq!(hits, expected * rounds);
    let evaluations = rounds * records.len();
    println!(
        "matches: 3-clause CNF over 100-byte records: {:.1} ns/record ({} evaluations, {:.1}% selected)",
        elapsed.as_nanos() as f64 / evaluations as f64,
        evaluations,
        100.0 * expected as f64 / records.len() as f64
    );

    // The same records through a projection of two fields.
    let proj = CompiledQuery::new(
        Query {
            projection: Some(vec![4, 0]),
            ..Query::default()
        },
        Some(&schema),
    )
    .unwrap();
    let mut out = Vec::with_capacity(128);
    let start = Instant::now();
    for _ in 0..rounds / 4 {
        for r in &records {
            out.clear();
            proj.project(black_box(r), &mut out).unwrap();
        }
    }
    let per = start.elapsed().as_nanos() as f64 / (rounds / 4 * records.len()) as f64;
    assert_eq!(out.len(), 1 + 1 + 8 + 1 + 76);
    println!("project: 2 of 5 fields of a 100-byte record: {per:.1} ns/record");
}
