//! Snapshots and log-order scans against an oracle built from the versions writes returned.

use ramlog_logmem::query::{KeyFilter, Query};
use ramlog_logmem::{
    Condition, Engine, EngineConfig, EngineError, PutOptions, ScanMethod, ScanRecord, TabletId,
};
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TABLE: u64 = 7;

/// Per key: every write as (version, value or None for a delete).
type History = HashMap<Vec<u8>, Vec<(u64, Option<Vec<u8>>)>>;
/// A scan's result: key -> (value, version).
type Seen = BTreeMap<Vec<u8>, (Vec<u8>, u64)>;

fn engine(
    memory: u64,
    segment_seglets: usize,
    tweak: impl FnOnce(&mut EngineConfig),
) -> Arc<Engine> {
    let mut config = EngineConfig {
        memory_bytes: memory,
        segment_seglets,
        oom_wait_ms: 5000,
        value_size_max_bytes: 32 << 10,
        key_size_max_bytes: 1024,
        ..EngineConfig::default()
    };
    tweak(&mut config);
    let e = Engine::new(config).unwrap();
    // Two tablets split the slot space, so whole-table scans merge tablets.
    e.create_tablet(TABLE, 0, 8191).unwrap();
    e.create_tablet(TABLE, 8192, 16383).unwrap();
    e
}

fn tablet(e: &Engine, key: &[u8]) -> TabletId {
    e.locate(TABLE, key).unwrap()
}

fn all() -> Query {
    Query::keys(KeyFilter::All)
}

fn as_map(records: Vec<ScanRecord>) -> Seen {
    as_map_of("scan", records)
}

fn as_map_of(what: &str, records: Vec<ScanRecord>) -> Seen {
    let mut m = BTreeMap::new();
    for r in records {
        let k = r.key.clone();
        let v = r.version;
        if let Some(old) = m.insert(r.key, (r.value, r.version)) {
            panic!(
                "{what}: key {:?} returned twice (versions {} and {v})",
                String::from_utf8_lossy(&k),
                old.1
            );
        }
    }
    m
}

#[test]
fn snapshot_reads_see_exactly_their_version() {
    let e = engine(64 << 20, 8, |_| {});
    let put = |k: &str, v: &str| {
        e.put(
            tablet(&e, k.as_bytes()),
            k.as_bytes(),
            v.as_bytes(),
            &PutOptions::default(),
        )
        .unwrap()
        .version
    };
    put("a", "a1");
    put("b", "b1");
    put("c", "c1");
    let s1 = e.snapshot();
    put("a", "a2");
    e.delete(tablet(&e, b"b"), b"b", Condition::None).unwrap();
    put("d", "d1");
    let s2 = e.snapshot();
    put("a", "a3");
    put("b", "b2");

    let at = |s: &ramlog_logmem::Snapshot, k: &str| {
        e.get_at(tablet(&e, k.as_bytes()), k.as_bytes(), s)
            .unwrap()
            .map(|o| String::from_utf8(o.value).unwrap())
    };
    assert_eq!(at(&s1, "a").as_deref(), Some("a1"));
    assert_eq!(at(&s1, "b").as_deref(), Some("b1"));
    assert_eq!(at(&s1, "d"), None);
    assert_eq!(at(&s2, "a").as_deref(), Some("a2"));
    assert_eq!(at(&s2, "b"), None);
    assert_eq!(at(&s2, "d").as_deref(), Some("d1"));
    assert_eq!(e.get(tablet(&e, b"a"), b"a").unwrap().unwrap().value, b"a3");

    for method in [ScanMethod::Log, ScanMethod::HashIndex] {
        let got = as_map(
            e.scan(TABLE, &s1, &all(), method, usize::MAX)
                .unwrap()
                .records,
        );
        let keys: Vec<_> = got
            .iter()
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect();
        assert_eq!(
            keys,
            vec![
                (b"a".to_vec(), b"a1".to_vec()),
                (b"b".to_vec(), b"b1".to_vec()),
                (b"c".to_vec(), b"c1".to_vec())
            ],
            "{method:?}"
        );
        let got = as_map(
            e.scan(TABLE, &s2, &all(), method, usize::MAX)
                .unwrap()
                .records,
        );
        let keys: Vec<_> = got.keys().cloned().collect();
        assert_eq!(
            keys,
            vec![b"a".to_vec(), b"c".to_vec(), b"d".to_vec()],
            "{method:?}"
        );
    }
    // One tablet at a time gives the same as the whole table.
    let mut per_tablet = Vec::new();
    for t in [0, 1] {
        per_tablet.extend(
            e.scan_tablet(t, &s2, &all(), ScanMethod::Log, usize::MAX)
                .unwrap()
                .records,
        );
    }
    let mut keys: Vec<_> = per_tablet.into_iter().map(|r| r.key).collect();
    keys.sort();
    assert_eq!(keys, vec![b"a".to_vec(), b"c".to_vec(), b"d".to_vec()]);
    // Versions kept for s1 and s2 are released with them.
    assert!(e.stats().retained_versions > 0);
    drop(s1);
    drop(s2);
    assert_eq!(e.stats().snapshots_open, 0);
}

/// Writers, the cleaner (forced to run constantly) and scans at snapshots run together; each
/// scan must equal the oracle's state at its snapshot: nothing missing, nothing doubled, nothing
/// stale or deleted.
#[test]
fn scans_are_snapshot_isolated_under_writers_and_cleaner() {
    let e = engine(12 << 20, 4, |c| {
        c.snapshot_max_retained_bytes = Some(64 << 20);
        c.scan_batch_wait_us = 0;
    });
    let keys: Vec<Vec<u8>> = (0..1500)
        .map(|i| format!("key:{i:05}").into_bytes())
        .collect();
    // Per key: every write as (version, value or delete).
    let history: Arc<Mutex<History>> = Default::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for w in 0..3u64 {
        let (e, keys, history, stop) = (e.clone(), keys.clone(), history.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(w);
            let mut local: Vec<(Vec<u8>, u64, Option<Vec<u8>>)> = Vec::new();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) && n < 120_000 {
                n += 1;
                let k = &keys[rng.gen_range(0..keys.len())];
                let t = tablet(&e, k);
                if rng.gen_bool(0.15) {
                    if let Some(v) = e.delete(t, k, Condition::None).unwrap() {
                        local.push((k.clone(), v, None));
                    }
                } else {
                    let len = rng.gen_range(20..400);
                    let value: Vec<u8> = format!("{w}:{n}:")
                        .into_bytes()
                        .into_iter()
                        .cycle()
                        .take(len)
                        .collect();
                    let v = e.put(t, k, &value, &PutOptions::default()).unwrap().version;
                    local.push((k.clone(), v, Some(value)));
                }
            }
            let mut h = history.lock().unwrap();
            for (k, v, val) in local {
                h.entry(k).or_default().push((v, val));
            }
        }));
    }
    {
        let (e, stop) = (e.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                e.clean_now();
            }
        }));
    }
    // Scans at snapshots, with all three readers: log scan, hash-index scan, paged cursor.
    let mut observed: Vec<(u64, &'static str, Seen)> = Vec::new();
    let started = Instant::now();
    let mut round = 0;
    while started.elapsed() < Duration::from_secs(6) {
        round += 1;
        let s = e.snapshot();
        let v = s.version();
        std::thread::sleep(Duration::from_millis(3));
        let log = e
            .scan(TABLE, &s, &all(), ScanMethod::Log, usize::MAX)
            .unwrap();
        observed.push((v, "log", as_map_of("log", log.records)));
        // A scan through a snapshot of its own, which keeps versions only until it has read them.
        let (now, at) = e
            .scan_now(TABLE, &all(), ScanMethod::Log, usize::MAX)
            .unwrap();
        observed.push((at, "scan_now", as_map_of("scan_now", now.records)));
        if round % 3 == 0 {
            let hash = e
                .scan(TABLE, &s, &all(), ScanMethod::HashIndex, usize::MAX)
                .unwrap();
            observed.push((v, "hash", as_map_of("hash", hash.records)));
        }
        if round % 3 == 1 {
            let mut cursor = e.scan_cursor(TABLE, s, &all()).unwrap();
            let mut pages = Vec::new();
            while !cursor.is_done() {
                pages.extend(cursor.next_page(97).unwrap());
                std::thread::sleep(Duration::from_micros(200));
            }
            observed.push((v, "cursor", as_map_of("cursor", pages)));
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    let stats = e.stats();
    assert!(
        stats.cleaner_copied_bytes > 0,
        "the cleaner never moved anything: {stats:?}"
    );
    let history = history.lock().unwrap();
    #[allow(clippy::type_complexity)]
    let mut sorted: HashMap<&Vec<u8>, Vec<&(u64, Option<Vec<u8>>)>> = HashMap::new();
    for (k, h) in history.iter() {
        let mut h: Vec<_> = h.iter().collect();
        h.sort_by_key(|(v, _)| *v);
        sorted.insert(k, h);
    }
    assert!(observed.len() >= 10, "only {} scans ran", observed.len());
    for (s, method, got) in &observed {
        let mut expect = BTreeMap::new();
        for (k, h) in &sorted {
            if let Some((v, Some(val))) = h.iter().rev().find(|(v, _)| v <= s) {
                expect.insert((*k).clone(), (val.clone(), *v));
            }
        }
        assert_eq!(
            got.len(),
            expect.len(),
            "{method} scan at {s}: wrong number of keys"
        );
        assert!(
            got == &expect,
            "{method} scan at {s} differs from the oracle"
        );
    }
}

#[test]
fn snapshot_too_old_by_age_and_by_retained_bytes() {
    let e = engine(64 << 20, 8, |c| {
        c.snapshot_max_age_ms = 100;
        c.snapshot_max_retained_bytes = Some(64 << 10);
    });
    let t = tablet(&e, b"x");
    e.put(t, b"x", b"1", &PutOptions::default()).unwrap();
    let s = e.snapshot();
    assert!(e.get_at(t, b"x", &s).unwrap().is_some());
    std::thread::sleep(Duration::from_millis(150));
    match e.get_at(t, b"x", &s) {
        Err(EngineError::SnapshotTooOld { reason, .. }) => {
            assert!(reason.contains("ms old"), "{reason}")
        }
        other => panic!("expected snapshot too old, got {other:?}"),
    }
    assert!(matches!(
        e.scan(TABLE, &s, &all(), ScanMethod::Log, 10),
        Err(EngineError::SnapshotTooOld { .. })
    ));

    // Retained bytes: overwriting 1000 keys of 200 B under a snapshot keeps ~210 KB > 64 KiB.
    let keys: Vec<Vec<u8>> = (0..1000).map(|i| format!("r{i}").into_bytes()).collect();
    for k in &keys {
        e.put(tablet(&e, k), k, &[1u8; 200], &PutOptions::default())
            .unwrap();
    }
    let s = e.snapshot();
    for k in &keys {
        e.put(tablet(&e, k), k, &[2u8; 200], &PutOptions::default())
            .unwrap();
    }
    match e.scan(TABLE, &s, &all(), ScanMethod::Log, usize::MAX) {
        Err(EngineError::SnapshotTooOld { reason, .. }) => {
            assert!(reason.contains("bytes of superseded versions"), "{reason}")
        }
        other => panic!(
            "expected snapshot too old, got {:?}",
            other.map(|o| o.records.len())
        ),
    }
    // A fresh snapshot works and sees the new values.
    let fresh = e.snapshot();
    let out = e
        .scan(TABLE, &fresh, &all(), ScanMethod::Log, usize::MAX)
        .unwrap();
    assert!(out
        .records
        .iter()
        .filter(|r| r.key.starts_with(b"r"))
        .all(|r| r.value == [2u8; 200]));
    assert!(e.stats().snapshots_too_old >= 2);
}

#[test]
fn memory_held_for_a_snapshot_is_reclaimed_after_release() {
    let e = engine(64 << 20, 8, |c| {
        c.snapshot_max_retained_bytes = Some(64 << 20)
    });
    let keys: Vec<Vec<u8>> = (0..20_000)
        .map(|i| format!("m{i:06}").into_bytes())
        .collect();
    for k in &keys {
        e.put(tablet(&e, k), k, &[1u8; 300], &PutOptions::default())
            .unwrap();
    }
    let live_before = e.stats().live_bytes;
    let s = e.snapshot();
    for k in &keys {
        e.put(tablet(&e, k), k, &[2u8; 300], &PutOptions::default())
            .unwrap();
    }
    let held = e.stats();
    assert!(held.retained_bytes >= live_before * 9 / 10, "{held:?}");
    assert_eq!(held.retained_versions, keys.len() as u64);
    // The snapshot still reads the old values.
    let k = &keys[123];
    assert_eq!(
        e.get_at(tablet(&e, k), k, &s).unwrap().unwrap().value,
        vec![1u8; 300]
    );
    drop(s);
    // No memory pressure here: the cleaner compacts the segments the release left sparse.
    let deadline = Instant::now() + Duration::from_secs(10);
    while e.stats().retained_bytes > held.retained_bytes / 20 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    // Segments the release left mostly garbage are compacted at once; the few retained versions
    // in segments that are still mostly live go with the next ordinary cleaning of those segments.
    let after = e.stats();
    assert!(
        after.retained_bytes <= held.retained_bytes / 20,
        "{after:?}"
    );
    assert!(
        after.retained_reclaimed_bytes >= held.retained_bytes * 19 / 20,
        "{after:?}"
    );
    assert!(
        after.retained_versions <= keys.len() as u64 / 20,
        "{after:?}"
    );
    assert!(
        after.live_bytes <= live_before + live_before / 10,
        "{after:?} vs {live_before}"
    );
    assert_eq!(
        e.get(tablet(&e, k), k).unwrap().unwrap().value,
        vec![2u8; 300]
    );
}

#[test]
fn scans_hand_sparse_segments_to_the_cleaner() {
    // More than half of memory in use (so scans report sparse segments), far from the cleaner's
    // own trigger.
    let e = engine(16 << 20, 4, |_| {});
    let keys: Vec<Vec<u8>> = (0..30_000)
        .map(|i| format!("g{i:06}").into_bytes())
        .collect();
    for k in &keys {
        e.put(tablet(&e, k), k, &[1u8; 200], &PutOptions::default())
            .unwrap();
    }
    // Overwrite two thirds: old segments become one-third live, with memory far from full.
    for k in keys.iter().filter(|k| k.last().unwrap() % 3 != 0) {
        e.put(tablet(&e, k), k, &[2u8; 200], &PutOptions::default())
            .unwrap();
    }
    let before = e.stats();
    assert_eq!(before.scan_sparse_segments, 0);
    let s = e.snapshot();
    let out = e
        .scan(TABLE, &s, &all(), ScanMethod::Log, usize::MAX)
        .unwrap();
    assert_eq!(out.records.len(), keys.len());
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(10);
    while (e.stats().segments_cleaned == before.segments_cleaned
        || e.stats().free_seglets <= before.free_seglets)
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let after = e.stats();
    assert!(after.scan_sparse_segments > 0, "{after:?}");
    assert!(
        after.segments_cleaned > before.segments_cleaned,
        "{after:?}"
    );
    assert!(after.free_seglets > before.free_seglets, "{after:?}");
    // Nothing was lost.
    for k in &keys {
        let want = if k.last().unwrap() % 3 != 0 { 2u8 } else { 1u8 };
        assert_eq!(
            e.get(tablet(&e, k), k).unwrap().unwrap().value,
            vec![want; 200]
        );
    }
}

#[test]
fn concurrent_scans_share_passes() {
    let e = engine(128 << 20, 16, |c| c.scan_batch_wait_us = 2000);
    for i in 0..20_000 {
        let k = format!("{}-{i:06}", i % 4).into_bytes();
        e.put(tablet(&e, &k), &k, &[3u8; 100], &PutOptions::default())
            .unwrap();
    }
    let before = e.stats();
    let barrier = Arc::new(std::sync::Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let (e, barrier) = (e.clone(), barrier.clone());
            std::thread::spawn(move || {
                let q = Query::keys(KeyFilter::Prefix(format!("{i}-").into_bytes()));
                let s = e.snapshot();
                barrier.wait();
                e.scan(TABLE, &s, &q, ScanMethod::Log, usize::MAX)
                    .unwrap()
                    .records
                    .len()
            })
        })
        .collect();
    let counts: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(counts, vec![5000, 5000, 5000, 5000]);
    let after = e.stats();
    let passes = after.scan_passes - before.scan_passes;
    let queries = after.scan_queries - before.scan_queries;
    assert_eq!(queries, 8, "4 scans over 2 tablets");
    assert!(
        passes < queries,
        "no pass was shared: {passes} passes for {queries} queries"
    );
}

#[test]
fn cursor_pages_resume_and_match_a_one_shot_scan() {
    let e = engine(64 << 20, 4, |_| {});
    for i in 0..5000 {
        let k = format!("p{i:05}").into_bytes();
        e.put(
            tablet(&e, &k),
            &k,
            format!("v{i}").as_bytes(),
            &PutOptions::default(),
        )
        .unwrap();
    }
    let s = e.snapshot();
    let q = Query::keys(KeyFilter::Glob(b"p*7".to_vec()));
    let one_shot = as_map(
        e.scan(TABLE, &s, &q, ScanMethod::Log, usize::MAX)
            .unwrap()
            .records,
    );
    assert_eq!(one_shot.len(), 500);
    let mut cursor = e.scan_cursor(TABLE, s, &q).unwrap();
    // Writes between pages are not seen by the cursor's snapshot.
    let mut pages = Vec::new();
    let mut n = 0;
    while !cursor.is_done() {
        let page = cursor.next_page(33).unwrap();
        assert!(page.len() <= 33);
        pages.extend(page);
        n += 1;
        let k = format!("p{:05}", n * 10 + 7).into_bytes();
        e.delete(tablet(&e, &k), &k, Condition::None).unwrap();
        let k = format!("new{n}7").into_bytes();
        e.put(tablet(&e, &k), &k, b"x", &PutOptions::default())
            .unwrap();
    }
    assert_eq!(as_map(pages), one_shot);

    // Several cursors at one snapshot (clones), and a page that ends exactly at the end.
    drop(cursor);
    let s = e.snapshot();
    let q = Query::keys(KeyFilter::Prefix(b"p0000".to_vec()));
    let mut a = e.scan_cursor(TABLE, s.clone(), &q).unwrap();
    let mut b = e.scan_cursor(TABLE, s.clone(), &q).unwrap();
    let total = e
        .scan(TABLE, &s, &q, ScanMethod::Log, usize::MAX)
        .unwrap()
        .records
        .len();
    let mut got_a = Vec::new();
    while !a.is_done() {
        got_a.extend(a.next_page(total).unwrap());
    }
    let got_b = b.next_page(usize::MAX).unwrap();
    assert_eq!(got_a.len(), total);
    assert_eq!(got_b.len(), total);
    assert!(
        b.is_done(),
        "a page that reached the end leaves nothing to fetch"
    );
    drop((a, b));
    assert_eq!(e.stats().snapshots_open, 1);
    drop(s);
    assert_eq!(e.stats().snapshots_open, 0);
}

mod queries {
    //! Filtered, projected and aggregated scans through the engine equal the same compiled query
    //! applied to the oracle's rows at the snapshot (the query module itself is checked against a
    //! separate oracle in `query_props.rs`).
    use super::*;
    use proptest::prelude::*;
    use ramlog_logmem::query::{
        Aggregate, Cnf, CompiledQuery, Field, FieldType, Op, Predicate, Schema, Value,
    };

    fn schema() -> Schema {
        Schema::new(vec![
            Field::new("a", FieldType::I64),
            Field::new("b", FieldType::I32),
            Field::new("c", FieldType::F64),
            Field::new("d", FieldType::Bool),
            Field::new("s", FieldType::String),
        ])
        .unwrap()
    }

    fn row() -> impl Strategy<Value = Vec<Value>> {
        (
            prop_oneof![Just(Value::Null), (-50i64..50).prop_map(Value::I64)],
            prop_oneof![Just(Value::Null), (-50i32..50).prop_map(Value::I32)],
            prop_oneof![Just(Value::Null), (-5.0f64..5.0).prop_map(Value::F64)],
            prop_oneof![Just(Value::Null), any::<bool>().prop_map(Value::Bool)],
            prop_oneof![Just(Value::Null), "[a-c]{0,4}".prop_map(Value::Str)],
        )
            .prop_map(|(a, b, c, d, s)| vec![a, b, c, d, s])
    }

    fn predicate() -> impl Strategy<Value = Predicate> {
        let op = prop_oneof![
            Just(Op::Lt),
            Just(Op::Le),
            Just(Op::Eq),
            Just(Op::Ne),
            Just(Op::Ge),
            Just(Op::Gt)
        ];
        prop_oneof![
            (op.clone(), -50i64..50).prop_map(|(o, v)| Predicate::new(0, o, Value::I64(v))),
            (op.clone(), -50i32..50).prop_map(|(o, v)| Predicate::new(1, o, Value::I32(v))),
            (op.clone(), -5.0f64..5.0).prop_map(|(o, v)| Predicate::new(2, o, Value::F64(v))),
            any::<bool>().prop_map(|v| Predicate::new(3, Op::Eq, Value::Bool(v))),
            "[a-c]{0,2}".prop_map(|v| Predicate::new(4, Op::Prefix, Value::Str(v))),
            (0usize..5).prop_map(|f| Predicate::new(f, Op::IsNull, Value::Null)),
        ]
    }

    fn query() -> impl Strategy<Value = Query> {
        let cnf = proptest::collection::vec(proptest::collection::vec(predicate(), 1..3), 0..3)
            .prop_map(|clauses| Cnf { clauses });
        let shape = prop_oneof![
            Just((None, vec![])),
            proptest::collection::btree_set(0usize..5, 1..4)
                .prop_map(|f| (Some(f.into_iter().collect::<Vec<_>>()), vec![])),
            Just((
                None,
                vec![
                    Aggregate::Count,
                    Aggregate::Sum(0),
                    Aggregate::Min(2),
                    Aggregate::Max(4)
                ]
            )),
            Just((None, vec![Aggregate::Count])),
        ];
        let filter = prop_oneof![
            Just(KeyFilter::All),
            Just(KeyFilter::Prefix(b"q1".to_vec())),
            Just(KeyFilter::Glob(b"q*[02468]".to_vec())),
        ];
        (filter, cnf, shape).prop_map(|(key_filter, predicate, (projection, aggregates))| Query {
            key_filter,
            predicate,
            projection,
            aggregates,
            group_by: None,
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]
        #[test]
        fn engine_scans_equal_the_query_over_the_oracle(
            rows in proptest::collection::vec(row(), 1..150),
            later in proptest::collection::vec((0usize..150, row()), 0..60),
            q in query(),
        ) {
            let e = engine(32 << 20, 4, |_| {});
            let schema = schema();
            e.set_schema(TABLE, Some(schema.clone()));
            let key = |i: usize| format!("q{i}").into_bytes();
            let mut oracle: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
            for (i, r) in rows.iter().enumerate() {
                let rec = schema.encode(r).unwrap();
                e.put(tablet(&e, &key(i)), &key(i), &rec, &PutOptions::default()).unwrap();
                oracle.insert(key(i), rec);
            }
            let snap = e.snapshot();
            // Changes after the snapshot must not show.
            for (i, r) in &later {
                let k = key(*i);
                if r[0] == Value::Null {
                    e.delete(tablet(&e, &k), &k, Condition::None).unwrap();
                } else {
                    let rec = schema.encode(r).unwrap();
                    e.put(tablet(&e, &k), &k, &rec, &PutOptions::default()).unwrap();
                }
            }
            let compiled = CompiledQuery::new(q.clone(), Some(&schema)).unwrap();
            let mut want_records = Vec::new();
            let mut agg = compiled.agg_state();
            for (k, v) in &oracle {
                if compiled.matches(k, v).unwrap() {
                    if compiled.is_aggregate() {
                        agg.update(v).unwrap();
                    } else {
                        let mut out = Vec::new();
                        compiled.project(v, &mut out).unwrap();
                        want_records.push((k.clone(), out));
                    }
                }
            }
            for method in [ScanMethod::Log, ScanMethod::HashIndex] {
                let out = e.scan(TABLE, &snap, &q, method, usize::MAX).unwrap();
                prop_assert_eq!(out.malformed, 0);
                if compiled.is_aggregate() {
                    prop_assert_eq!(out.aggregates.clone(), Some(agg.finish()), "{:?}", method);
                } else {
                    let mut got: Vec<(Vec<u8>, Vec<u8>)> =
                        out.records.into_iter().map(|r| (r.key, r.value)).collect();
                    got.sort();
                    prop_assert_eq!(&got, &want_records, "{:?}", method);
                }
            }
        }
    }
}

/// A snapshot never makes writes fail: when memory runs out, the oldest snapshot is released.
#[test]
fn snapshots_give_way_when_memory_runs_out() {
    let e = engine(16 << 20, 4, |c| {
        c.snapshot_max_retained_bytes = Some(u64::MAX);
        c.oom_wait_ms = 3000;
    });
    let keys: Vec<Vec<u8>> = (0..12_000)
        .map(|i| format!("o{i:06}").into_bytes())
        .collect();
    for k in &keys {
        e.put(tablet(&e, k), k, &[1u8; 300], &PutOptions::default())
            .unwrap();
    }
    // A snapshot before each of five overwrites of ~4 MB live data, in 16 MiB: impossible while
    // every snapshot keeps its versions.
    let mut snaps = Vec::new();
    for round in 2..7u8 {
        snaps.push(e.snapshot());
        for k in &keys {
            e.put(tablet(&e, k), k, &[round; 300], &PutOptions::default())
                .unwrap_or_else(|err| panic!("round {round}: {err}"));
        }
    }
    let s = &snaps[0];
    match e.get_at(tablet(&e, &keys[0]), &keys[0], s) {
        Err(EngineError::SnapshotTooOld { reason, .. }) => {
            assert!(reason.contains("memory is full"), "{reason}")
        }
        other => panic!("expected the snapshot to be released, got {other:?}"),
    }
    assert_eq!(
        e.get(tablet(&e, &keys[7]), &keys[7])
            .unwrap()
            .unwrap()
            .value,
        vec![6u8; 300]
    );
    // The newest snapshot survived and still reads its state.
    let last = snaps.last().unwrap();
    assert_eq!(
        e.get_at(tablet(&e, &keys[7]), &keys[7], last)
            .unwrap()
            .unwrap()
            .value,
        vec![5u8; 300]
    );
    assert!(e.stats().snapshots_too_old >= 1);
}

/// Log scans (records, a batched aggregate, a record limit) over every kind of entry the walk
/// meets: current objects, overwritten versions an open snapshot still reads, deletes, objects
/// that expired or will expire, and values long enough to cross seglets.
#[test]
fn log_scans_see_exactly_the_visible_entries_of_every_kind() {
    use ramlog_logmem::query::{Aggregate, Cnf, Field, FieldType, Op, Predicate, Schema, Value};
    let e = engine(256 << 20, 4, |c| c.cleaner_threads = 0);
    let schema = Schema::new(vec![
        Field::new("id", FieldType::I64),
        Field::new("a", FieldType::I32),
        Field::new("payload", FieldType::Bytes),
    ])
    .unwrap();
    e.set_schema(TABLE, Some(schema.clone()));
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let record = |id: i64, a: i32, len: usize| {
        let mut out = Vec::new();
        let payload: Vec<u8> = (0..len).map(|i| (i as u8) ^ (id as u8)).collect();
        schema
            .encode_into(
                &[Value::I64(id), Value::I32(a), Value::Bytes(payload)],
                &mut out,
            )
            .unwrap();
        out
    };
    // key -> (record, a) as visible at the first and at the second snapshot.
    let mut first: BTreeMap<Vec<u8>, (Vec<u8>, i32)> = BTreeMap::new();
    let far = u64::MAX / 2;
    for id in 0..4000i64 {
        let key = format!("k{id:05}").into_bytes();
        // Mostly short values; one in 16 is long enough to cross a 64 KiB seglet now and then.
        let len = if id % 16 == 0 {
            rng.gen_range(5000..30000)
        } else {
            rng.gen_range(10..200)
        };
        let a = rng.gen_range(-1000..1000);
        let value = record(id, a, len);
        let expire_at_ms = match id % 10 {
            3 => 1, // long expired: never visible
            7 => far,
            _ => 0,
        };
        let opts = PutOptions {
            expire_at_ms,
            ..Default::default()
        };
        e.put(tablet(&e, &key), &key, &value, &opts).unwrap();
        if expire_at_ms != 1 {
            first.insert(key, (value, a));
        }
    }
    let snap1 = e.snapshot();
    let mut second = first.clone();
    for id in 0..4000i64 {
        let key = format!("k{id:05}").into_bytes();
        match id % 6 {
            1 => {
                let a = rng.gen_range(-1000..1000);
                let value = record(id + 1_000_000, a, rng.gen_range(10..300));
                e.put(tablet(&e, &key), &key, &value, &PutOptions::default())
                    .unwrap();
                second.insert(key, (value, a));
            }
            4 => {
                e.delete(tablet(&e, &key), &key, Condition::None).unwrap();
                second.remove(&key);
            }
            _ => {}
        }
    }
    let snap2 = e.snapshot();
    let aggregate = Query {
        key_filter: KeyFilter::All,
        predicate: Cnf {
            clauses: vec![vec![Predicate::new(1, Op::Ge, Value::I32(0))]],
        },
        projection: None,
        aggregates: vec![Aggregate::Count, Aggregate::Sum(1)],
        group_by: None,
    };
    for (name, snap, want) in [("first", &snap1, &first), ("second", &snap2, &second)] {
        let out = e
            .scan(TABLE, snap, &all(), ScanMethod::Log, usize::MAX)
            .unwrap();
        let got = as_map_of(name, out.records);
        let expected: BTreeMap<Vec<u8>, Vec<u8>> = want
            .iter()
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect();
        let got_values: BTreeMap<Vec<u8>, Vec<u8>> =
            got.into_iter().map(|(k, (v, _))| (k, v)).collect();
        assert_eq!(got_values.len(), expected.len(), "{name}: record count");
        assert!(
            got_values == expected,
            "{name}: records differ from the oracle"
        );

        let out = e.scan(TABLE, snap, &aggregate, ScanMethod::Log, 0).unwrap();
        let selected: Vec<i64> = want
            .values()
            .map(|&(_, a)| a as i64)
            .filter(|&a| a >= 0)
            .collect();
        assert_eq!(
            out.aggregates,
            Some(vec![
                Value::I64(selected.len() as i64),
                Value::I64(selected.iter().sum()),
            ]),
            "{name}: aggregate"
        );
        assert_eq!(out.malformed, 0, "{name}: malformed");

        let limited = e.scan(TABLE, snap, &all(), ScanMethod::Log, 100).unwrap();
        assert!(limited.truncated, "{name}: a limit of 100 stops the scan");
        assert_eq!(limited.records.len(), 100, "{name}: limited records");
        for r in limited.records {
            assert_eq!(
                want.get(&r.key).map(|(v, _)| v),
                Some(&r.value),
                "{name}: limited record"
            );
        }
    }
    // The same aggregate at both snapshots, with and without key prefixes, from several threads
    // at once: passes serve the queries as a group, each with its own snapshot's visibility and
    // its own key filter.
    let expected = |want: &BTreeMap<Vec<u8>, (Vec<u8>, i32)>, prefix: &[u8]| {
        let selected: Vec<i64> = want
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, &(_, a))| a as i64)
            .filter(|&a| a >= 0)
            .collect();
        Some(vec![
            Value::I64(selected.len() as i64),
            Value::I64(selected.iter().sum()),
        ])
    };
    let before = e.stats();
    std::thread::scope(|s| {
        for k in 0..6 {
            let (e, expected) = (&e, &expected);
            let (snap, want) = if k % 2 == 0 {
                (&snap1, &first)
            } else {
                (&snap2, &second)
            };
            // Two of each: every key, keys k01…, keys k02….
            let prefix: &[u8] = [&b""[..], b"k01", b"k02"][k / 2];
            let query = Query {
                key_filter: if prefix.is_empty() {
                    KeyFilter::All
                } else {
                    KeyFilter::Prefix(prefix.to_vec())
                },
                ..aggregate.clone()
            };
            s.spawn(move || {
                let out = e.scan(TABLE, snap, &query, ScanMethod::Log, 0).unwrap();
                assert_eq!(
                    out.aggregates,
                    expected(want, prefix),
                    "concurrent aggregate {k}"
                );
            });
        }
    });
    let after = e.stats();
    assert!(
        after.scan_passes - before.scan_passes < after.scan_queries - before.scan_queries,
        "concurrent scans shared no pass"
    );
}

/// A tablet cursor (the bulk copy's read): exactly the tablet's objects as of its opening, newest
/// versions only, empty and binary keys included, while writers overwrite and delete; the
/// table's other tablet keeps no superseded version for it.
#[test]
fn a_tablet_cursor_reads_its_tablet_at_its_opening_and_nothing_else_keeps_versions() {
    let e = engine(64 << 20, 4, |_| {});
    let keys: Vec<Vec<u8>> = (0..4000)
        .map(|i| format!("c{i:05}").into_bytes())
        .chain([Vec::new(), vec![0u8, 255, 10, 13]])
        .collect();
    for (i, k) in keys.iter().enumerate() {
        e.put(
            tablet(&e, k),
            k,
            format!("old{i}").as_bytes(),
            &PutOptions::default(),
        )
        .unwrap();
    }
    // Overwritten and deleted before the cursor opens: only the newest state is copied.
    for k in keys.iter().step_by(3) {
        e.put(tablet(&e, k), k, b"newer", &PutOptions::default())
            .unwrap();
    }
    for k in keys.iter().skip(1).step_by(7) {
        e.delete(tablet(&e, k), k, Condition::None).unwrap();
    }
    let copied = tablet(&e, b"");
    let other = (0..2).find(|&t| t != copied).unwrap() as TabletId;
    let expected: Seen = keys
        .iter()
        .filter(|k| tablet(&e, k) == copied)
        .filter_map(|k| {
            e.get(copied, k)
                .unwrap()
                .map(|o| (k.clone(), (o.value.to_vec(), o.version)))
        })
        .collect();
    assert!(
        expected.contains_key(&Vec::new()),
        "the empty key is in the copied tablet"
    );
    let retained_before = e.stats().retained_bytes;
    let mut cursor = e.tablet_cursor(copied).unwrap();
    let mut pages = Vec::new();
    let mut n = 0;
    while !cursor.is_done() {
        pages.extend(cursor.next_page(100).unwrap());
        // Writers go on: overwrites and deletes in both tablets, new keys; none of it is seen.
        for k in keys.iter().skip(n % 50).step_by(50) {
            e.put(tablet(&e, k), k, b"after", &PutOptions::default())
                .unwrap();
        }
        let k = format!("c{:05}", n * 13 % 4000).into_bytes();
        e.delete(tablet(&e, &k), &k, Condition::None).unwrap();
        let k = format!("brand-new{n}").into_bytes();
        e.put(tablet(&e, &k), &k, b"x", &PutOptions::default())
            .unwrap();
        // The other tablet's overwrites keep nothing for this cursor.
        let retained = e.stats().retained_bytes;
        for k in keys.iter().filter(|k| tablet(&e, k) == other).take(20) {
            e.put(other, k, b"other", &PutOptions::default()).unwrap();
        }
        assert_eq!(e.stats().retained_bytes, retained, "page {n}");
        n += 1;
    }
    assert!(n > 10, "the copy took several pages: {n}");
    assert_eq!(as_map_of("tablet cursor", pages), expected);
    drop(cursor);
    assert_eq!(e.stats().retained_bytes, retained_before);
}

/// A frozen tablet (moving to another server) refuses every write and serves reads; the table's
/// other tablet is not affected; thawed, it takes writes again.
#[test]
fn a_frozen_tablet_refuses_writes_until_thawed() {
    let e = engine(16 << 20, 4, |_| {});
    let t = tablet(&e, b"");
    e.put(t, b"", b"before", &PutOptions::default()).unwrap();
    e.set_frozen(t, true).unwrap();
    assert_eq!(
        e.put(t, b"", b"during", &PutOptions::default()),
        Err(EngineError::Frozen)
    );
    assert_eq!(e.delete(t, b"", Condition::None), Err(EngineError::Frozen));
    let items: Vec<(&[u8], &[u8])> = vec![(b"", b"x")];
    assert!(matches!(e.multi_put(t, &items), Err(EngineError::Frozen)));
    assert_eq!(&e.get(t, b"").unwrap().unwrap().value[..], b"before");
    let other = (0..2).find(|&x| x != t).unwrap() as TabletId;
    let k = (0..)
        .map(|n| format!("o{n}").into_bytes())
        .find(|k| tablet(&e, k) == other)
        .unwrap();
    e.put(other, &k, b"v", &PutOptions::default()).unwrap();
    e.set_frozen(t, false).unwrap();
    e.put(t, b"", b"after", &PutOptions::default()).unwrap();
    assert_eq!(&e.get(t, b"").unwrap().unwrap().value[..], b"after");
}

/// A conditional multi-put writes all of its items, or none when any condition fails; an expired
/// object counts as absent.
#[test]
fn a_conditional_multi_put_is_all_or_nothing() {
    let e = engine(16 << 20, 4, |_| {});
    let t = tablet(&e, b"");
    let v1 = e
        .put(t, b"a", b"1", &PutOptions::default())
        .unwrap()
        .version;
    let items: Vec<(&[u8], &[u8])> = vec![(b"a", b"2"), (b"b", b"2")];
    let refused = e.multi_put_if(t, &items, &[Condition::IfAbsent, Condition::IfAbsent]);
    assert!(matches!(refused, Err(EngineError::ConditionFailed { .. })));
    assert_eq!(e.get(t, b"a").unwrap().unwrap().value, b"1");
    assert!(e.get(t, b"b").unwrap().is_none());
    e.multi_put_if(t, &items, &[Condition::IfVersion(v1), Condition::IfAbsent])
        .unwrap();
    assert_eq!(e.get(t, b"a").unwrap().unwrap().value, b"2");
    assert_eq!(e.get(t, b"b").unwrap().unwrap().value, b"2");
    let gone = PutOptions {
        expire_at_ms: 1,
        ..PutOptions::default()
    };
    e.put(t, b"c", b"old", &gone).unwrap();
    let items: Vec<(&[u8], &[u8])> = vec![(b"c", b"new")];
    e.multi_put_if(t, &items, &[Condition::IfAbsent]).unwrap();
    assert_eq!(e.get(t, b"c").unwrap().unwrap().value, b"new");
}

/// A multi-write puts, deletes and checks in one unit: one version for all, expiries as asked (or
/// kept), deletes of absent keys write nothing, and a failed check writes nothing at all.
#[test]
fn a_multi_write_puts_deletes_and_checks_in_one_unit() {
    use ramlog_logmem::{MultiOp, MultiWrite};
    let e = engine(16 << 20, 4, |_| {});
    let t = tablet(&e, b"");
    let far = 4_000_000_000_000u64;
    let with_ttl = PutOptions {
        expire_at_ms: far,
        ..PutOptions::default()
    };
    let vh = e.put(t, b"head", b"h1", &with_ttl).unwrap().version;
    e.put(t, b"old", b"x", &PutOptions::default()).unwrap();
    let put = |key: &'static [u8], value: &'static [u8], expire: Option<u64>| MultiWrite {
        key,
        op: MultiOp::Put {
            value,
            expire_at_ms: expire,
        },
        condition: Condition::None,
    };
    let del = |key: &'static [u8]| MultiWrite {
        key,
        op: MultiOp::Delete,
        condition: Condition::None,
    };
    // A stale check refuses the whole unit.
    let mut stale = put(b"head", b"h2", None);
    stale.condition = Condition::IfVersion(vh + 100);
    let refused = e.multi_write_if(t, &[stale, put(b"c1", b"one", Some(0)), del(b"old")]);
    assert!(matches!(refused, Err(EngineError::ConditionFailed { .. })));
    assert!(e.get(t, b"c1").unwrap().is_none());
    assert!(e.get(t, b"old").unwrap().is_some());
    // The current version: everything lands with one version.
    let mut head = put(b"head", b"h2", None);
    head.condition = Condition::IfVersion(vh);
    let v = e
        .multi_write_if(
            t,
            &[
                head,
                put(b"c1", b"one", Some(0)),
                del(b"old"),
                del(b"never"),
            ],
        )
        .unwrap()
        .expect("it wrote");
    let h = e.get(t, b"head").unwrap().unwrap();
    assert_eq!(
        (&h.value[..], h.version, h.expire_at_ms),
        (&b"h2"[..], v, far)
    );
    let c1 = e.get(t, b"c1").unwrap().unwrap();
    assert_eq!((c1.version, c1.expire_at_ms), (v, 0));
    assert!(e.get(t, b"old").unwrap().is_none());
    // Checks alone, and deletes of absent keys, write nothing.
    let check = MultiWrite {
        key: b"head",
        op: MultiOp::Check,
        condition: Condition::IfVersion(v),
    };
    assert_eq!(e.multi_write_if(t, &[check, del(b"old")]).unwrap(), None);
    assert_eq!(e.get(t, b"head").unwrap().unwrap().version, v);
    // A check that fails stops a delete.
    let check = MultiWrite {
        key: b"head",
        op: MultiOp::Check,
        condition: Condition::IfAbsent,
    };
    assert!(e.multi_write_if(t, &[check, del(b"c1")]).is_err());
    assert!(e.get(t, b"c1").unwrap().is_some());
    // The deleted key's tombstone survives cleaning: it stays deleted.
    e.clean_until_idle(4);
    assert!(e.get(t, b"old").unwrap().is_none());
    assert_eq!(e.object_count(), 2);
}

/// Internal keys (the chunks of large collections) are objects like any other but are counted
/// apart: `key_count` leaves them out through puts, overwrites, deletes and cleaning.
#[test]
fn internal_keys_are_counted_apart() {
    use ramlog_common::INTERNAL_PREFIX;
    let e = engine(16 << 20, 4, |_| {});
    let t = tablet(&e, b"");
    let slot = ramlog_common::key_slot(b"");
    let internal = |n: u32| {
        let mut k = INTERNAL_PREFIX.to_vec();
        k.extend_from_slice(&slot.to_be_bytes());
        k.extend_from_slice(&n.to_be_bytes());
        k
    };
    let keys: Vec<Vec<u8>> = (0..50).map(internal).collect();
    for k in &keys {
        assert_eq!(
            tablet(&e, k),
            t,
            "an internal key lives in its named slot's tablet"
        );
        e.put(t, k, b"chunk", &PutOptions::default()).unwrap();
    }
    e.put(t, b"", b"user", &PutOptions::default()).unwrap();
    assert_eq!((e.object_count(), e.key_count()), (51, 1));
    assert_eq!(e.internal_count(t).unwrap(), 50);
    // Scans return records, and chunks are none, by either method.
    for method in [ScanMethod::Log, ScanMethod::HashIndex] {
        let out = e
            .scan(TABLE, &e.snapshot(), &all(), method, usize::MAX)
            .unwrap();
        let keys: Vec<Vec<u8>> = out.records.into_iter().map(|r| r.key).collect();
        assert_eq!(keys, vec![b"".to_vec()], "{method:?}");
    }
    for k in &keys[..10] {
        e.put(t, k, b"again", &PutOptions::default()).unwrap();
    }
    for k in &keys[10..30] {
        e.delete(t, k, Condition::None).unwrap();
    }
    e.clean_until_idle(4);
    assert_eq!((e.object_count(), e.key_count()), (31, 1));
    assert_eq!(e.internal_count(t).unwrap(), 30);
}

/// One unit of thousands of puts and deletes: the index grows and shrinks under it (bucket
/// splits, shorter chains), and every key ends where the unit put it, counted once.
#[test]
fn a_large_multi_write_leaves_every_key_findable() {
    use ramlog_logmem::{MultiOp, MultiWrite};
    let e = engine(64 << 20, 32, |_| {});
    let t = tablet(&e, b"");
    let keys: Vec<Vec<u8>> = (0..6000)
        .map(|i| format!("k{i}").into_bytes())
        .filter(|k| tablet(&e, k) == t)
        .collect();
    let puts: Vec<MultiWrite<'_>> = keys
        .iter()
        .map(|k| MultiWrite {
            key: k,
            op: MultiOp::Put {
                value: b"first",
                expire_at_ms: Some(0),
            },
            condition: Condition::IfAbsent,
        })
        .collect();
    e.multi_write_if(t, &puts).unwrap();
    assert_eq!(e.key_count(), keys.len() as u64);
    let more: Vec<Vec<u8>> = (0..keys.len())
        .map(|i| format!("m{i}").into_bytes())
        .collect();
    let more: Vec<&Vec<u8>> = more.iter().filter(|k| tablet(&e, k) == t).collect();
    let mut mixed: Vec<MultiWrite<'_>> = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        mixed.push(MultiWrite {
            key: k,
            op: if i % 2 == 0 {
                MultiOp::Delete
            } else {
                MultiOp::Put {
                    value: b"second",
                    expire_at_ms: None,
                }
            },
            condition: Condition::None,
        });
    }
    for k in &more {
        mixed.push(MultiWrite {
            key: k,
            op: MultiOp::Put {
                value: b"new",
                expire_at_ms: Some(0),
            },
            condition: Condition::None,
        });
    }
    e.multi_write_if(t, &mixed).unwrap();
    for (i, k) in keys.iter().enumerate() {
        let got = e.get(t, k).unwrap().map(|o| o.value);
        if i % 2 == 0 {
            assert_eq!(got, None, "{i}");
        } else {
            assert_eq!(got.as_deref(), Some(&b"second"[..]), "{i}");
        }
    }
    for k in &more {
        assert_eq!(e.get(t, k).unwrap().unwrap().value, b"new");
    }
    assert_eq!(e.key_count(), (keys.len() / 2 + more.len()) as u64);
}
