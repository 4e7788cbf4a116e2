//! Snapshots, schemas and filtered scans over the native protocol: the Rust client against the real
//! native connection handler of `ramlog-server` with a real engine (and, for the configuration knobs,
//! against a whole in-process server). Results are checked against oracles kept by the tests.

mod common;

use common::Raw;
use ramlog_client::query::{
    Aggregate, Cnf, Field, FieldType, KeyFilter, Op, Predicate, Query, Schema, Value,
};
use ramlog_client::{Client, ClientConfig, Error, Record, Request, Response, ScanResult};
use ramlog_logmem::EngineConfig;
use ramlog_proto::native::{opcode, Status};
use ramlog_server::front::native::{NativeConfig, ScanLimits};
use std::collections::BTreeMap;
use std::ops::Bound;
use std::time::Duration;

type Server = common::TestServer;

/// The native handler on a loopback port with a real engine (table 0 in four tablets).
async fn start(engine_config: EngineConfig, native: NativeConfig) -> Server {
    common::start_server_with(engine_config, native).await
}

/// A server with default engine settings and these scan limits.
async fn start_with_scan_limits(scan: ScanLimits) -> Server {
    start(
        EngineConfig::default(),
        NativeConfig {
            scan,
            ..NativeConfig::default()
        },
    )
    .await
}

async fn start_default() -> Server {
    start(EngineConfig::default(), NativeConfig::default()).await
}

async fn client(server: &Server) -> Client {
    Client::connect(ClientConfig::new(server.addr.to_string()))
        .await
        .expect("connect")
}

type State = BTreeMap<Vec<u8>, (Vec<u8>, u64)>;

fn as_state(records: &[Record]) -> State {
    let mut state = State::new();
    for r in records {
        let old = state.insert(r.key.to_vec(), (r.value.to_vec(), r.version));
        assert!(old.is_none(), "key {:?} returned twice", r.key);
    }
    state
}

async fn records(
    c: &Client,
    q: &Query,
    snap: Option<&ramlog_client::Snapshot>,
    page: u32,
) -> State {
    as_state(&c.scan_records(q, snap, page).await.expect("scan"))
}

/// Puts `{prefix}:{i}` = `v0-{i}` for i in 0..n; the state with the versions the puts returned.
async fn load(c: &Client, prefix: &str, n: u32) -> State {
    let mut state = State::new();
    for i in 0..n {
        let key = format!("{prefix}:{i}").into_bytes();
        let value = format!("v0-{i}").into_bytes();
        let version = c.put(&key, &value).await.unwrap();
        state.insert(key, (value, version));
    }
    state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_isolation_over_the_network() {
    let server = start_default().await;
    let c = client(&server).await;
    let old = load(&c, "k", 400).await;
    let snap = c.snapshot_open().await.unwrap();
    assert!(snap.version() >= old.values().map(|v| v.1).max().unwrap());
    // Overwrite every even key, delete every third, add new keys.
    let mut new = old.clone();
    for i in 0..400u32 {
        let key = format!("k:{i}").into_bytes();
        if i % 3 == 0 {
            c.delete(&key).await.unwrap();
            new.remove(&key);
        } else if i % 2 == 0 {
            let value = format!("v1-{i}").into_bytes();
            let version = c.put(&key, &value).await.unwrap();
            new.insert(key, (value, version));
        }
    }
    for i in 0..50u32 {
        let key = format!("n:{i}").into_bytes();
        let version = c.put(&key, b"new").await.unwrap();
        new.insert(key, (b"new".to_vec(), version));
    }
    // GET_AT returns the old state of every key, including deleted and not-yet-created ones.
    for (key, (value, version)) in &old {
        let o = c
            .get_at(&snap, key)
            .await
            .unwrap()
            .expect("present at the snapshot");
        assert_eq!((&o.value[..], o.version), (&value[..], *version));
    }
    assert_eq!(c.get_at(&snap, b"n:1").await.unwrap(), None);
    assert_eq!(c.get(b"k:0").await.unwrap(), None, "deleted now");
    // A paged scan at the snapshot (7 records a page) returns exactly the old state.
    let all = Query::default();
    assert_eq!(records(&c, &all, Some(&snap), 7).await, old);
    // Without a snapshot: the new state.
    assert_eq!(records(&c, &all, None, 50).await, new);
    // GET_AT still works while the snapshot backs a finished paged scan, and after more writes.
    c.put(b"k:1", b"later").await.unwrap();
    let o = c.get_at(&snap, b"k:1").await.unwrap().unwrap();
    assert_eq!(&o.value[..], b"v0-1");
    // Aggregates at the snapshot count the old state.
    let count = Query {
        aggregates: vec![Aggregate::Count],
        ..Query::default()
    };
    let agg = c.scan_aggregates(&count, Some(&snap)).await.unwrap();
    assert_eq!(agg.values, vec![Value::I64(old.len() as i64)]);
    assert_eq!(agg.snapshot_version, snap.version());
    snap.release().await.unwrap();
    assert!(matches!(
        c.get_at(&snap, b"k:1").await,
        Err(Error::NoSuchSnapshot(id)) if id == snap.id()
    ));
    assert!(matches!(
        snap.release().await,
        Err(Error::NoSuchSnapshot(_))
    ));
}

fn test_schema() -> Schema {
    Schema::new(vec![
        Field::new("a", FieldType::I64),
        Field::new("b", FieldType::String),
        Field::new("flag", FieldType::Bool),
        Field::new("x", FieldType::F64),
    ])
    .unwrap()
}

/// Row i of the test table: a = i % 100 - 20, b = "x{i%7}..." or "y..", flag = i % 5 == 0,
/// x = NULL for every 4th row.
fn row(i: i64) -> Vec<Value> {
    let b = if i % 3 == 0 {
        format!("y{}", i % 7)
    } else {
        format!("x{}", i % 7)
    };
    let x = if i % 4 == 0 {
        Value::Null
    } else {
        Value::F64(i as f64 / 8.0)
    };
    vec![
        Value::I64(i % 100 - 20),
        Value::Str(b),
        Value::Bool(i % 5 == 0),
        x,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_predicates_projection_and_aggregates() {
    let server = start_default().await;
    let c = client(&server).await;
    assert_eq!(c.get_schema().await.unwrap(), None);
    let schema = test_schema();
    c.set_schema(Some(&schema)).await.unwrap();
    assert_eq!(c.get_schema().await.unwrap(), Some(schema.clone()));
    let n = 600i64;
    let mut rows = BTreeMap::new();
    for i in 0..n {
        let key = format!("r:{i:04}").into_bytes();
        let values = row(i);
        c.put(&key, &schema.encode(&values).unwrap()).await.unwrap();
        rows.insert(key, values);
    }
    // One value that is not a record of the schema.
    c.put(b"r:bad", b"\xff\xff").await.unwrap();

    // (a < 10 OR flag = true) AND b starts with "x", projected to (b, a).
    let query = Query {
        key_filter: KeyFilter::Prefix(b"r:".to_vec()),
        predicate: Cnf {
            clauses: vec![
                vec![
                    Predicate::new(0, Op::Lt, Value::I64(10)),
                    Predicate::new(2, Op::Eq, Value::Bool(true)),
                ],
                vec![Predicate::new(1, Op::Prefix, Value::Str("x".into()))],
            ],
        },
        projection: Some(vec![1, 0]),
        aggregates: vec![],
        group_by: None,
    };
    let expected: BTreeMap<Vec<u8>, Vec<Value>> = rows
        .iter()
        .filter(|(_, v)| {
            let a = matches!(v[0], Value::I64(a) if a < 10);
            let flag = v[2] == Value::Bool(true);
            let b = matches!(&v[1], Value::Str(s) if s.starts_with('x'));
            (a || flag) && b
        })
        .map(|(k, v)| (k.clone(), vec![v[1].clone(), v[0].clone()]))
        .collect();
    assert!(
        expected.len() > 50 && expected.len() < 500,
        "a selective query"
    );
    let projected = schema.project(&[1, 0]).unwrap();
    let got = c.scan_records(&query, None, 64).await.unwrap();
    let got: BTreeMap<Vec<u8>, Vec<Value>> = got
        .iter()
        .map(|r| (r.key.to_vec(), projected.decode(&r.value).unwrap()))
        .collect();
    assert_eq!(got, expected);

    // Aggregates over a range of keys: count, sum(a), min(x), max(b); x NULLs are ignored.
    let range = KeyFilter::Range {
        start: Bound::Included(b"r:0100".to_vec()),
        end: Bound::Excluded(b"r:0300".to_vec()),
    };
    let agg_query = Query {
        key_filter: range.clone(),
        predicate: Cnf::default(),
        projection: None,
        aggregates: vec![
            Aggregate::Count,
            Aggregate::Sum(0),
            Aggregate::Min(3),
            Aggregate::Max(1),
        ],
        group_by: None,
    };
    let in_range: Vec<&Vec<Value>> = rows
        .iter()
        .filter(|(k, _)| range.matches(k))
        .map(|(_, v)| v)
        .collect();
    let sum: i64 = in_range
        .iter()
        .map(|v| match v[0] {
            Value::I64(a) => a,
            _ => 0,
        })
        .sum();
    let min_x = in_range
        .iter()
        .filter_map(|v| match v[3] {
            Value::F64(x) => Some(x),
            _ => None,
        })
        .fold(f64::INFINITY, f64::min);
    let max_b = in_range
        .iter()
        .filter_map(|v| match &v[1] {
            Value::Str(s) => Some(s.clone()),
            _ => None,
        })
        .max()
        .unwrap();
    let agg = c.scan_aggregates(&agg_query, None).await.unwrap();
    assert_eq!(
        agg.values,
        vec![
            Value::I64(in_range.len() as i64),
            Value::I64(sum),
            Value::F64(min_x),
            Value::Str(max_b)
        ]
    );
    assert_eq!(agg.matched, in_range.len() as u64);

    // A count without predicates counts every value; with a predicate on a field, the value that is
    // not a record is counted as malformed and skipped.
    let mut count_all = Query {
        aggregates: vec![Aggregate::Count],
        ..Query::default()
    };
    let agg = c.scan_aggregates(&count_all, None).await.unwrap();
    assert_eq!(agg.values, vec![Value::I64(n + 1)]);
    count_all.predicate.clauses = vec![vec![Predicate::new(0, Op::Ge, Value::I64(-1000))]];
    let agg = c.scan_aggregates(&count_all, None).await.unwrap();
    assert_eq!(agg.values, vec![Value::I64(n)]);
    assert_eq!((agg.matched, agg.malformed), (n as u64, 1));

    // Glob key filter (Redis MATCH semantics), no schema fields needed.
    let glob = Query::keys(KeyFilter::Glob(b"r:00[0-4]?".to_vec()));
    let got = records(&c, &glob, None, 1000).await;
    assert_eq!(got.len(), 50);
    assert!(got.keys().all(|k| k.starts_with(b"r:00")));

    // Removing the schema makes field predicates invalid.
    c.set_schema(None).await.unwrap();
    assert_eq!(c.get_schema().await.unwrap(), None);
    match c.scan_filtered(&query, None, 10).await {
        Err(Error::Server {
            status: Status::BadRequest,
            message,
        }) => assert!(message.contains("schema"), "{message}"),
        other => panic!("expected BAD_REQUEST, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paging_equals_one_shot_and_respects_the_byte_cap() {
    // Pages of at most ~2 KiB: with 300-byte values that is a handful of records a page.
    let server = start_with_scan_limits(ScanLimits {
        page_bytes_max: 2048,
        ..ScanLimits::default()
    })
    .await;
    let c = client(&server).await;
    let mut expected = State::new();
    for i in 0..500u32 {
        let key = format!("p:{i}").into_bytes();
        let value = vec![b'a' + (i % 26) as u8; 300];
        let version = c.put(&key, &value).await.unwrap();
        expected.insert(key, (value, version));
    }
    let all = Query::default();
    // One page of up to 10,000 records is still cut by the byte cap.
    match c.scan_filtered(&all, None, 10_000).await.unwrap() {
        ScanResult::Records { records, more, .. } => {
            let bytes: usize = records
                .iter()
                .map(|r| r.key.len() + r.value.len() + 24)
                .sum();
            assert!(
                !records.is_empty() && bytes <= 2048,
                "{} records, {bytes} bytes",
                records.len()
            );
            let mut more = more.expect("more pages");
            let mut all_records = records;
            let mut pages = 1;
            while !more.is_done() {
                let page = more.next_page(10_000).await.unwrap();
                let bytes: usize = page.iter().map(|r| r.key.len() + r.value.len() + 24).sum();
                assert!(bytes <= 2048);
                all_records.extend(page);
                pages += 1;
            }
            assert!(pages >= 500 / 7, "{pages} pages");
            assert_eq!(as_state(&all_records), expected);
        }
        other => panic!("expected records, got {other:?}"),
    }
    // Other page sizes give the same records.
    for page in [1u32, 3, 13] {
        assert_eq!(records(&c, &all, None, page).await, expected, "page {page}");
    }
    // A small result fits in the first reply: no paged scan is left open.
    let few = Query::keys(KeyFilter::Glob(b"p:4[0-2]".to_vec()));
    match c.scan_filtered(&few, None, 100).await.unwrap() {
        ScanResult::Records { records, more, .. } => {
            assert_eq!(records.len(), 3);
            assert!(more.is_none());
        }
        other => panic!("expected records, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_and_errors() {
    let server = start_with_scan_limits(ScanLimits {
        snapshots_max: 2,
        cursors_max: 2,
        ..ScanLimits::default()
    })
    .await;
    let c = client(&server).await;
    for i in 0..100u32 {
        c.put(format!("l:{i}").as_bytes(), b"v").await.unwrap();
    }
    let all = Query::default();
    // Two paged scans may stay open; the third is refused with the limit, and closing one makes room.
    let mut open = Vec::new();
    for _ in 0..2 {
        match c.scan_filtered(&all, None, 5).await.unwrap() {
            ScanResult::Records { more: Some(m), .. } => open.push(m),
            other => panic!("expected a paged scan, got {other:?}"),
        }
    }
    match c.scan_filtered(&all, None, 5).await {
        Err(Error::TooManyOpen { limit: 2, .. }) => {}
        other => panic!("expected TOO_MANY_OPEN, got {other:?}"),
    }
    let closed = open.pop().unwrap();
    let closed_id = closed.id();
    closed.close().await.unwrap();
    // The closed scan is gone.
    let reply = c
        .request(&Request::ScanNext {
            cursor: closed_id,
            max_records: 5,
        })
        .await
        .unwrap();
    match reply {
        Response::Error(e) => assert_eq!((e.status, e.detail), (Status::NoSuchCursor, closed_id)),
        other => panic!("expected NO_SUCH_CURSOR, got {other:?}"),
    }
    let mut again = match c.scan_filtered(&all, None, 5).await.unwrap() {
        ScanResult::Records { more: Some(m), .. } => m,
        other => panic!("expected a paged scan, got {other:?}"),
    };
    assert_eq!(again.collect(7).await.unwrap().len(), 95);

    for m in open {
        m.close().await.unwrap();
    }
    // Snapshots: two per connection.
    let s1 = c.snapshot_open().await.unwrap();
    let s2 = c.snapshot_open().await.unwrap();
    assert!(matches!(
        c.snapshot_open().await,
        Err(Error::TooManyOpen { limit: 2, .. })
    ));
    // Paged scans at a client snapshot count against the same limit of paged scans: two at s1 are
    // fine, a third (at s2) is refused; GET_AT and aggregates at s1 still work meanwhile.
    let mut at_s1 = Vec::new();
    for _ in 0..2 {
        match c.scan_filtered(&all, Some(&s1), 5).await.unwrap() {
            ScanResult::Records { more: Some(m), .. } => at_s1.push(m),
            other => panic!("expected a paged scan, got {other:?}"),
        }
    }
    match c.scan_filtered(&all, Some(&s2), 5).await {
        Err(Error::TooManyOpen { limit: 2, .. }) => {}
        other => panic!("expected TOO_MANY_OPEN, got {other:?}"),
    }
    assert!(c.get_at(&s1, b"l:3").await.unwrap().is_some());
    let count = Query {
        aggregates: vec![Aggregate::Count],
        ..Query::default()
    };
    assert_eq!(
        c.scan_aggregates(&count, Some(&s1)).await.unwrap().values,
        vec![Value::I64(100)]
    );
    for m in at_s1 {
        m.close().await.unwrap();
    }
    s1.release().await.unwrap();
    s2.release().await.unwrap();

    // Malformed query bytes, bad schema bytes, unknown ids, unknown table.
    let bad_query = |bytes: &'static [u8]| Request::ScanFiltered {
        table: 0,
        snapshot: 0,
        max_records: 10,
        query: bytes,
    };
    for bytes in [&b""[..], &[9, 0, 0, 0, 0], &[1, 7], &[1, 0, 0, 0, 0, 0xAA]] {
        match c.request(&bad_query(bytes)).await.unwrap() {
            Response::Error(e) => assert_eq!(e.status, Status::BadRequest, "{bytes:?}: {e:?}"),
            other => panic!("expected BAD_REQUEST, got {other:?}"),
        }
    }
    match c
        .request(&Request::SetSchema {
            table: 0,
            schema: &[1, 1, 99, 1, b'a'],
        })
        .await
        .unwrap()
    {
        Response::Error(e) => assert_eq!(e.status, Status::BadRequest),
        other => panic!("expected BAD_REQUEST, got {other:?}"),
    }
    for (request, status, detail) in [
        (
            Request::GetAt {
                table: 0,
                snapshot: 424242,
                key: b"k",
            },
            Status::NoSuchSnapshot,
            424242,
        ),
        (
            Request::ScanFiltered {
                table: 0,
                snapshot: 424242,
                max_records: 1,
                query: &[1, 0, 0, 0, 0],
            },
            Status::NoSuchSnapshot,
            424242,
        ),
        (
            Request::SnapshotRelease { snapshot: 424242 },
            Status::NoSuchSnapshot,
            424242,
        ),
        (Request::ScanClose { cursor: 77 }, Status::NoSuchCursor, 77),
        (
            Request::ScanFiltered {
                table: 9,
                snapshot: 0,
                max_records: 1,
                query: &[1, 0, 0, 0, 0],
            },
            Status::NoSuchTable,
            0,
        ),
    ] {
        match c.request(&request).await.unwrap() {
            Response::Error(e) => assert_eq!((e.status, e.detail), (status, detail), "{e:?}"),
            other => panic!("expected {status:?}, got {other:?}"),
        }
    }
    // The connection is still fine.
    assert_eq!(&c.ping(b"ok").await.unwrap()[..], b"ok");
}

/// Reads every remaining page of `scan`, `page` records at a time, into `into`.
async fn drain(scan: &mut ramlog_client::PagedScan, page: u32, into: &mut Vec<Record>) {
    while !scan.is_done() {
        into.extend(scan.next_page(page).await.expect("page"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paged_scans_share_a_client_snapshot() {
    let server = start_default().await;
    let c = client(&server).await;
    let old = load(&c, "s", 300).await;
    let snap = c.snapshot_open().await.unwrap();
    let all = Query::default();
    let paged = |r: ScanResult| match r {
        ScanResult::Records {
            records,
            more: Some(m),
            snapshot_version,
        } => (records, m, snapshot_version),
        other => panic!("expected a paged scan, got {other:?}"),
    };
    // Two paged scans at the one snapshot, read in turns with writes in between: both return exactly
    // the snapshot's state.
    let (mut got_a, mut a, version_a) = paged(c.scan_filtered(&all, Some(&snap), 7).await.unwrap());
    let (mut got_b, mut b, version_b) =
        paged(c.scan_filtered(&all, Some(&snap), 11).await.unwrap());
    assert_eq!((version_a, version_b), (snap.version(), snap.version()));
    assert_ne!(a.id(), b.id());
    let mut round = 0u32;
    while !a.is_done() || !b.is_done() {
        for j in 0..5u32 {
            let key = format!("s:{}", (round * 5 + j) % 300);
            if j % 2 == 0 {
                c.delete(key.as_bytes()).await.unwrap();
            } else {
                c.put(key.as_bytes(), b"newer").await.unwrap();
            }
        }
        c.put(format!("new:{round}").as_bytes(), b"n")
            .await
            .unwrap();
        if !a.is_done() {
            got_a.extend(a.next_page(7).await.unwrap());
        }
        if !b.is_done() {
            got_b.extend(b.next_page(11).await.unwrap());
        }
        // GET_AT at the snapshot is answered while the scans are open.
        let o = c
            .get_at(&snap, b"s:1")
            .await
            .unwrap()
            .expect("at the snapshot");
        assert_eq!(&o.value[..], b"v0-1");
        round += 1;
    }
    assert_eq!(as_state(&got_a), old, "first scan");
    assert_eq!(as_state(&got_b), old, "second scan");
    assert_eq!(server.engine.stats().snapshots_open, 1);

    // Releasing the snapshot while a paged scan runs at it: the id is gone for new requests, the scan
    // reads on to its end at the snapshot, and the snapshot is released when the scan is done.
    let (mut got_c, mut scan_c, _) = paged(c.scan_filtered(&all, Some(&snap), 5).await.unwrap());
    got_c.extend(scan_c.next_page(5).await.unwrap());
    snap.release().await.unwrap();
    assert!(matches!(
        c.get_at(&snap, b"s:1").await,
        Err(Error::NoSuchSnapshot(id)) if id == snap.id()
    ));
    assert!(matches!(
        c.scan_filtered(&all, Some(&snap), 5).await,
        Err(Error::NoSuchSnapshot(_))
    ));
    assert_eq!(
        server.engine.stats().snapshots_open,
        1,
        "the running scan keeps the snapshot open"
    );
    for i in 0..300u32 {
        c.put(format!("s:{i}").as_bytes(), b"after-release")
            .await
            .unwrap();
    }
    drain(&mut scan_c, 9, &mut got_c).await;
    assert_eq!(as_state(&got_c), old, "the scan after the release");
    assert_eq!(server.engine.stats().snapshots_open, 0);

    // A paged scan closed early releases what it holds at once (here the last hold on its snapshot).
    let s2 = c.snapshot_open().await.unwrap();
    let (_, d, _) = paged(c.scan_filtered(&all, Some(&s2), 5).await.unwrap());
    let (_, e, _) = paged(c.scan_filtered(&all, Some(&s2), 5).await.unwrap());
    s2.release().await.unwrap();
    assert_eq!(server.engine.stats().snapshots_open, 1);
    d.close().await.unwrap();
    assert_eq!(
        server.engine.stats().snapshots_open,
        1,
        "the other scan still holds it"
    );
    e.close().await.unwrap();
    assert_eq!(server.engine.stats().snapshots_open, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_too_old_is_reported() {
    let engine_config = EngineConfig {
        snapshot_max_age_ms: 300,
        ..EngineConfig::default()
    };
    let server = start(engine_config, NativeConfig::default()).await;
    let c = client(&server).await;
    for i in 0..50u32 {
        c.put(format!("t:{i}").as_bytes(), b"v").await.unwrap();
    }
    let snap = c.snapshot_open().await.unwrap();
    let paged = match c.scan_filtered(&Query::default(), None, 5).await.unwrap() {
        ScanResult::Records { more: Some(m), .. } => m,
        other => panic!("expected a paged scan, got {other:?}"),
    };
    assert!(c.get_at(&snap, b"t:1").await.unwrap().is_some());
    tokio::time::sleep(Duration::from_millis(700)).await;
    match c.get_at(&snap, b"t:1").await {
        Err(Error::SnapshotTooOld { version, message }) => {
            assert_eq!(version, snap.version());
            assert!(message.contains("too old"), "{message}");
        }
        other => panic!("expected SNAPSHOT_TOO_OLD, got {other:?}"),
    }
    let count = Query {
        aggregates: vec![Aggregate::Count],
        ..Query::default()
    };
    assert!(matches!(
        c.scan_aggregates(&count, Some(&snap)).await,
        Err(Error::SnapshotTooOld { .. })
    ));
    // The paged scan's own snapshot is too old as well; the server then forgets the scan.
    let id = paged.id();
    let mut paged = paged;
    assert!(matches!(
        paged.next_page(5).await,
        Err(Error::SnapshotTooOld { .. })
    ));
    match c
        .request(&Request::ScanNext {
            cursor: id,
            max_records: 5,
        })
        .await
        .unwrap()
    {
        Response::Error(e) => assert_eq!(e.status, Status::NoSuchCursor),
        other => panic!("expected NO_SUCH_CURSOR, got {other:?}"),
    }
    // A fresh scan works.
    assert_eq!(
        c.scan_aggregates(&count, None).await.unwrap().values,
        vec![Value::I64(50)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scans_do_not_hold_up_other_requests_and_close_with_the_connection() {
    // Each shared scan pass waits 400 ms for other scans to join, so a scan takes at least that long.
    let engine_config = EngineConfig {
        scan_batch_wait_us: 400_000,
        ..EngineConfig::default()
    };
    let server = start(engine_config, NativeConfig::default()).await;
    let mut raw = Raw::connect(server.addr).await;
    let put = |key: &'static [u8], value: &'static [u8]| Request::Put {
        table: 0,
        key,
        value,
        condition: Default::default(),
        expiry: Default::default(),
        return_old: false,
    };
    raw.send_request(100, &put(b"old", b"v0")).await;
    assert!(matches!(
        raw.recv().await,
        Some((100, _, Response::Put { .. }))
    ));
    raw.send_request(1, &Request::SnapshotOpen).await;
    let Some((1, _, Response::SnapshotOpen { snapshot, .. })) = raw.recv().await else {
        panic!("snapshot open");
    };
    let count = Query {
        aggregates: vec![Aggregate::Count],
        ..Query::default()
    }
    .to_bytes()
    .unwrap();
    // A slow aggregate scan, then a PUT and a PING pipelined behind it.
    let mut frames = bytes::BytesMut::new();
    Request::ScanFiltered {
        table: 0,
        snapshot,
        max_records: 1,
        query: &count,
    }
    .encode(2, &mut frames);
    Request::Put {
        table: 0,
        key: b"later",
        value: b"v",
        condition: Default::default(),
        expiry: Default::default(),
        return_old: false,
    }
    .encode(3, &mut frames);
    Request::Ping { payload: b"p" }.encode(4, &mut frames);
    raw.send(&frames).await;
    let mut order = Vec::new();
    let mut scan_reply = None;
    for _ in 0..3 {
        let (id, op, reply) = raw.recv().await.expect("reply");
        order.push(id);
        if id == 2 {
            assert_eq!(op, opcode::SCAN_FILTERED);
            scan_reply = Some(reply);
        }
    }
    assert_eq!(order, vec![3, 4, 2], "the scan is answered last");
    // The scan ran at the snapshot: the PUT answered before it is not counted.
    match scan_reply.unwrap() {
        Response::ScanAggregates { values, .. } => {
            let v = ramlog_client::query::decode_values(&values, 1 << 20).unwrap();
            assert_eq!(v, vec![Value::I64(1)]);
        }
        other => panic!("expected aggregates, got {other:?}"),
    }
    // Another slow scan at the snapshot, and GET_ATs at it sent while the scan runs: they do not wait
    // for the scan (it reads through its own handle on the snapshot), so their replies come first.
    raw.send_request(8, &put(b"old", b"v1")).await;
    assert!(matches!(
        raw.recv().await,
        Some((8, _, Response::Put { .. }))
    ));
    let mut frames = bytes::BytesMut::new();
    Request::ScanFiltered {
        table: 0,
        snapshot,
        max_records: 1,
        query: &count,
    }
    .encode(5, &mut frames);
    raw.send(&frames).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut frames = bytes::BytesMut::new();
    for (id, key) in [(6, &b"later"[..]), (7, b"old")] {
        Request::GetAt {
            table: 0,
            snapshot,
            key,
        }
        .encode(id, &mut frames);
    }
    raw.send(&frames).await;
    let mut got = BTreeMap::new();
    let mut order = Vec::new();
    for _ in 0..3 {
        let (id, _, reply) = raw.recv().await.expect("reply");
        order.push(id);
        got.insert(id, reply);
    }
    assert_eq!(order, vec![6, 7, 5], "GET_AT answered before the scan");
    match &got[&5] {
        Response::ScanAggregates { values, .. } => assert_eq!(
            ramlog_client::query::decode_values(values, 1 << 20).unwrap(),
            vec![Value::I64(1)]
        ),
        other => panic!("expected aggregates, got {other:?}"),
    }
    assert_eq!(got[&6], Response::GetAt(None), "written after the snapshot");
    match &got[&7] {
        Response::GetAt(Some(o)) => assert_eq!(&o.value[..], b"v0", "the value at the snapshot"),
        other => panic!("expected the old object, got {other:?}"),
    }
    assert_eq!(server.engine.stats().snapshots_open, 1);
    // Closing the connection releases its snapshot.
    drop(raw);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while server.engine.stats().snapshots_open != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "snapshot not released"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_config_bounds_snapshot_age() {
    use ramlog_server::{PersistenceMode, Server as FullServer, ServerConfig};
    let native_port = common::process::free_port();
    let config = ServerConfig {
        resp_port: 0,
        native_port,
        admin_port: 0,
        memory_bytes: 64 << 20,
        persistence: PersistenceMode::Off,
        snapshot_max_age_ms: 200,
        ..ServerConfig::default()
    };
    let server = FullServer::start(config).await.expect("server starts");
    let addr = server.addresses().native.expect("native listener");
    let c = Client::connect(ClientConfig::new(addr.to_string()))
        .await
        .unwrap();
    c.put(b"a", b"1").await.unwrap();
    let snap = c.snapshot_open().await.unwrap();
    assert_eq!(
        &c.get_at(&snap, b"a").await.unwrap().unwrap().value[..],
        b"1"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(matches!(
        c.get_at(&snap, b"a").await,
        Err(Error::SnapshotTooOld { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_handles_release_their_server_state() {
    let server = start_with_scan_limits(ScanLimits {
        cursors_max: 1,
        ..ScanLimits::default()
    })
    .await;
    let c = client(&server).await;
    for i in 0..40u32 {
        c.put(format!("d:{i}").as_bytes(), b"v").await.unwrap();
    }
    let snap = c.snapshot_open().await.unwrap();
    let clone = snap.clone();
    drop(snap);
    // A clone keeps it open.
    assert!(c.get_at(&clone, b"d:1").await.unwrap().is_some());
    assert_eq!(server.engine.stats().snapshots_open, 1);
    drop(clone);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while server.engine.stats().snapshots_open != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "snapshot not released"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A paged scan dropped before its end is closed, which makes room for the next one.
    for round in 0..3 {
        let paged = loop {
            match c.scan_filtered(&Query::default(), None, 3).await {
                Ok(ScanResult::Records { more: Some(m), .. }) => break m,
                Err(Error::TooManyOpen { .. }) => {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "round {round}: scan not closed"
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                other => panic!("expected a paged scan, got {other:?}"),
            }
        };
        drop(paged);
    }
}
