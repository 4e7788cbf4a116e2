//! Property tests: random operations against a BTreeMap oracle, with tiny segments and the cleaner
//! forced to run constantly (both a background thread and inline passes).

use proptest::prelude::*;
use ramlog_logmem::query::{KeyFilter, Query};
use ramlog_logmem::{
    Condition, Engine, EngineConfig, EngineError, PutOptions, RestoreItem, ScanMethod, Snapshot,
    SEGLET_BYTES,
};
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
enum Op {
    Put(u8, usize),
    PutIfAbsent(u8, usize),
    PutIfVersion(u8, usize, bool),
    PutIfExists(u8, usize),
    Delete(u8),
    DeleteIfVersion(u8, bool),
    Incr(u8, i64),
    MultiPut(Vec<(u8, usize)>),
    Get(u8),
    Clean,
    /// Open a snapshot (at most three stay open; the oldest is closed first).
    Snapshot,
    /// Read a key at the i-th open snapshot (modulo their number).
    GetAt(u8, usize),
    /// Scan the table at the i-th open snapshot, by log or hash index.
    ScanAt(usize, bool),
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0u8..40;
    let size = prop_oneof![0usize..40, 100usize..400, 3000usize..20_000];
    prop_oneof![
        6 => (key.clone(), size.clone()).prop_map(|(k, s)| Op::Put(k, s)),
        1 => (key.clone(), size.clone()).prop_map(|(k, s)| Op::PutIfAbsent(k, s)),
        1 => (key.clone(), size.clone(), any::<bool>()).prop_map(|(k, s, b)| Op::PutIfVersion(k, s, b)),
        1 => (key.clone(), size.clone()).prop_map(|(k, s)| Op::PutIfExists(k, s)),
        3 => key.clone().prop_map(Op::Delete),
        1 => (key.clone(), any::<bool>()).prop_map(|(k, b)| Op::DeleteIfVersion(k, b)),
        1 => (key.clone(), -5i64..5).prop_map(|(k, d)| Op::Incr(k, d)),
        1 => proptest::collection::vec((key.clone(), 0usize..200), 1..6).prop_map(Op::MultiPut),
        3 => key.clone().prop_map(Op::Get),
        1 => Just(Op::Clean),
        1 => Just(Op::Snapshot),
        2 => (key, any::<usize>()).prop_map(|(k, i)| Op::GetAt(k, i)),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(i, h)| Op::ScanAt(i, h)),
        1 => any::<usize>().prop_map(Op::Release),
    ]
}

fn key_bytes(k: u8) -> Vec<u8> {
    format!("key-{k}").into_bytes()
}

fn value_bytes(k: u8, size: usize, salt: u64) -> Vec<u8> {
    (0..size)
        .map(|i| (k as u64 + salt + i as u64 * 7) as u8)
        .collect()
}

#[derive(Clone)]
struct Model {
    value: Vec<u8>,
    version: u64,
}

fn check_all(engine: &Engine, tablet: u32, model: &BTreeMap<u8, Model>) {
    for k in 0u8..40 {
        let got = engine.get(tablet, &key_bytes(k)).unwrap();
        match (got, model.get(&k)) {
            (None, None) => {}
            (Some(o), Some(m)) => {
                assert_eq!(o.value, m.value, "value of key {k}");
                assert_eq!(o.version, m.version, "version of key {k}");
            }
            (g, m) => panic!(
                "key {k}: engine {:?} model {:?}",
                g.map(|o| o.version),
                m.map(|m| m.version)
            ),
        }
    }
    assert_eq!(engine.object_count(), model.len() as u64);
}

fn run(ops: Vec<Op>, background_cleaner: bool) {
    let writes = ops
        .iter()
        .filter(|o| {
            matches!(
                o,
                Op::Put(..)
                    | Op::PutIfAbsent(..)
                    | Op::PutIfVersion(..)
                    | Op::PutIfExists(..)
                    | Op::Delete(_)
                    | Op::DeleteIfVersion(..)
                    | Op::Incr(..)
                    | Op::MultiPut(_)
            )
        })
        .count();
    let engine = Engine::new(EngineConfig {
        memory_bytes: 96 * SEGLET_BYTES as u64,
        segment_seglets: 2,
        value_size_max_bytes: 30_000,
        key_size_max_bytes: 1024,
        cleaner_threads: usize::from(background_cleaner),
        cleaner_reserve_seglets: Some(8),
        ..Default::default()
    })
    .unwrap();
    let tablet = engine.create_tablet(0, 0, 16383).unwrap();
    let mut model: BTreeMap<u8, Model> = BTreeMap::new();
    // Highest version ever given to each key, to check versions grow across delete and re-create.
    let mut last_version: BTreeMap<u8, u64> = BTreeMap::new();
    let mut salt = 0u64;
    // Open snapshots with the model's state when each was taken.
    let mut snapshots: Vec<(Snapshot, BTreeMap<u8, Model>)> = Vec::new();
    let bump = |k: u8, v: u64, last: &mut BTreeMap<u8, u64>| {
        let prev = last.insert(k, v).unwrap_or(0);
        assert!(v > prev, "version of key {k} went from {prev} to {v}");
    };
    for op in ops {
        salt += 1;
        match op {
            Op::Put(k, s) => {
                let v = value_bytes(k, s, salt);
                let out = engine
                    .put(tablet, &key_bytes(k), &v, &PutOptions::default())
                    .unwrap();
                bump(k, out.version, &mut last_version);
                model.insert(
                    k,
                    Model {
                        value: v,
                        version: out.version,
                    },
                );
            }
            Op::PutIfAbsent(k, s) => {
                let v = value_bytes(k, s, salt);
                let r = engine.put(
                    tablet,
                    &key_bytes(k),
                    &v,
                    &PutOptions {
                        condition: Condition::IfAbsent,
                        ..Default::default()
                    },
                );
                match (r, model.contains_key(&k)) {
                    (Ok(out), false) => {
                        bump(k, out.version, &mut last_version);
                        model.insert(
                            k,
                            Model {
                                value: v,
                                version: out.version,
                            },
                        );
                    }
                    (Err(EngineError::ConditionFailed { .. }), true) => {}
                    (r, present) => panic!("put-if-absent {k}: {r:?}, present {present}"),
                }
            }
            Op::PutIfExists(k, s) => {
                let v = value_bytes(k, s, salt);
                let opts = PutOptions {
                    condition: Condition::IfExists,
                    return_old: true,
                    ..Default::default()
                };
                match (
                    engine.put(tablet, &key_bytes(k), &v, &opts),
                    model.get(&k).cloned(),
                ) {
                    (Ok(out), Some(m)) => {
                        assert_eq!(
                            out.old.as_ref().map(|o| &o.value),
                            Some(&m.value),
                            "SET XX GET old value"
                        );
                        bump(k, out.version, &mut last_version);
                        model.insert(
                            k,
                            Model {
                                value: v,
                                version: out.version,
                            },
                        );
                    }
                    (Err(EngineError::ConditionFailed { current: None }), None) => {}
                    (r, m) => panic!("put-if-exists {k}: {r:?}, model {}", m.is_some()),
                }
            }
            Op::PutIfVersion(k, s, right) => {
                let v = value_bytes(k, s, salt);
                let current = model.get(&k).map(|m| m.version);
                let want = if right {
                    current.unwrap_or(12345)
                } else {
                    current.unwrap_or(0) + 1_000_000
                };
                let r = engine.put(
                    tablet,
                    &key_bytes(k),
                    &v,
                    &PutOptions {
                        condition: Condition::IfVersion(want),
                        ..Default::default()
                    },
                );
                match r {
                    Ok(out) => {
                        assert_eq!(current, Some(want));
                        bump(k, out.version, &mut last_version);
                        model.insert(
                            k,
                            Model {
                                value: v,
                                version: out.version,
                            },
                        );
                    }
                    Err(EngineError::ConditionFailed { .. }) => assert_ne!(current, Some(want)),
                    Err(e) => panic!("{e}"),
                }
            }
            Op::Delete(k) => {
                let r = engine
                    .delete(tablet, &key_bytes(k), Condition::None)
                    .unwrap();
                match (r, model.remove(&k)) {
                    (Some(v), Some(_)) => bump(k, v, &mut last_version),
                    (None, None) => {}
                    (r, m) => panic!("delete {k}: {r:?} vs model {}", m.is_some()),
                }
            }
            Op::DeleteIfVersion(k, right) => {
                let current = model.get(&k).map(|m| m.version);
                let want = if right {
                    current.unwrap_or(1)
                } else {
                    current.unwrap_or(0) + 7
                };
                match engine.delete(tablet, &key_bytes(k), Condition::IfVersion(want)) {
                    Ok(Some(v)) => {
                        assert_eq!(current, Some(want));
                        bump(k, v, &mut last_version);
                        model.remove(&k);
                    }
                    Err(EngineError::ConditionFailed { .. }) => assert_ne!(current, Some(want)),
                    r => panic!("delete-if-version {k}: {r:?}"),
                }
            }
            Op::Incr(k, d) => {
                let current = model.get(&k).map(|m| m.value.clone());
                let parsed = match &current {
                    None => Some(0i64),
                    Some(v) => ramlog_common::parse_redis_i64(v),
                };
                match (engine.increment(tablet, &key_bytes(k), d), parsed) {
                    (Ok((n, version)), Some(old)) => {
                        assert_eq!(n, old + d);
                        bump(k, version, &mut last_version);
                        model.insert(
                            k,
                            Model {
                                value: n.to_string().into_bytes(),
                                version,
                            },
                        );
                    }
                    (Err(EngineError::NotAnInteger), None) => {}
                    (r, p) => panic!("incr {k}: {r:?} vs {p:?}"),
                }
            }
            Op::MultiPut(items) => {
                let owned: Vec<(Vec<u8>, Vec<u8>)> = items
                    .iter()
                    .map(|&(k, s)| (key_bytes(k), value_bytes(k, s, salt)))
                    .collect();
                let refs: Vec<(&[u8], &[u8])> =
                    owned.iter().map(|(k, v)| (&k[..], &v[..])).collect();
                let version = engine.multi_put(tablet, &refs).unwrap();
                for (&(k, _), (_, v)) in items.iter().zip(&owned) {
                    if last_version.get(&k) != Some(&version) {
                        bump(k, version, &mut last_version);
                    }
                    model.insert(
                        k,
                        Model {
                            value: v.clone(),
                            version,
                        },
                    );
                }
            }
            Op::Get(k) => {
                let got = engine.get(tablet, &key_bytes(k)).unwrap();
                assert_eq!(
                    got.map(|o| (o.value, o.version)),
                    model.get(&k).map(|m| (m.value.clone(), m.version)),
                    "get {k}"
                );
            }
            Op::Clean => {
                engine.clean_until_idle(50);
                check_all(&engine, tablet, &model);
            }
            Op::Snapshot => {
                if snapshots.len() == 3 {
                    snapshots.remove(0);
                }
                snapshots.push((engine.snapshot(), model.clone()));
            }
            Op::GetAt(k, i) => {
                if !snapshots.is_empty() {
                    let (snap, then) = &snapshots[i % snapshots.len()];
                    match engine.get_at(tablet, &key_bytes(k), snap) {
                        Ok(got) => assert_eq!(
                            got.map(|o| (o.value, o.version)),
                            then.get(&k).map(|m| (m.value.clone(), m.version)),
                            "get {k} at snapshot {}",
                            snap.version()
                        ),
                        // Snapshots are released when memory runs short or they keep too much.
                        Err(EngineError::SnapshotTooOld { .. }) => {}
                        Err(e) => panic!("get_at: {e}"),
                    }
                }
            }
            Op::ScanAt(i, hash) => {
                if !snapshots.is_empty() {
                    let (snap, then) = &snapshots[i % snapshots.len()];
                    let method = if hash {
                        ScanMethod::HashIndex
                    } else {
                        ScanMethod::Log
                    };
                    match engine.scan(0, snap, &Query::keys(KeyFilter::All), method, usize::MAX) {
                        Ok(out) => {
                            let mut got: Vec<(Vec<u8>, Vec<u8>, u64)> = out
                                .records
                                .into_iter()
                                .map(|r| (r.key, r.value, r.version))
                                .collect();
                            got.sort();
                            let mut want: Vec<(Vec<u8>, Vec<u8>, u64)> = then
                                .iter()
                                .map(|(k, m)| (key_bytes(*k), m.value.clone(), m.version))
                                .collect();
                            want.sort();
                            assert!(
                                got == want,
                                "{method:?} scan at snapshot {}",
                                snap.version()
                            );
                        }
                        Err(EngineError::SnapshotTooOld { .. }) => {}
                        Err(e) => panic!("scan: {e}"),
                    }
                }
            }
            Op::Release(i) => {
                if !snapshots.is_empty() {
                    let n = snapshots.len();
                    snapshots.remove(i % n);
                }
            }
        }
        if salt.is_multiple_of(16) {
            engine.clean_now();
        }
    }
    check_all(&engine, tablet, &model);
    drop(snapshots);
    engine.clean_until_idle(1000);
    check_all(&engine, tablet, &model);
    let stats = engine.stats();
    // Enough writes to fill several segments (2 seglets each) must have made the cleaner work.
    if writes > 150 && stats.new_bytes > 8 * 2 * SEGLET_BYTES as u64 {
        assert!(
            stats.segments_cleaned > 0,
            "the cleaner never ran: {stats:?}"
        );
    }
    let model_bytes: usize = model.values().map(|m| m.value.len()).sum();
    assert!(
        stats.live_bytes as usize >= model_bytes,
        "live {} < model {}",
        stats.live_bytes,
        model_bytes
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn matches_oracle_with_inline_cleaning(ops in proptest::collection::vec(op(), 1..600)) {
        run(ops, false);
    }

    #[test]
    fn matches_oracle_with_background_cleaner(ops in proptest::collection::vec(op(), 1..600)) {
        run(ops, true);
    }
}

#[test]
fn refuses_oversized_keys_and_values() {
    let engine = Engine::new(EngineConfig {
        memory_bytes: 64 << 20,
        ..Default::default()
    })
    .unwrap();
    let t = engine.create_tablet(0, 0, 16383).unwrap();
    let big_key = vec![b'k'; 64 * 1024 + 1];
    assert!(matches!(
        engine.put(t, &big_key, b"v", &PutOptions::default()),
        Err(EngineError::KeyTooLarge {
            len: 65537,
            max: 65536
        })
    ));
    let big_value = vec![0u8; (1 << 20) + 1];
    let err = engine
        .put(t, b"k", &big_value, &PutOptions::default())
        .unwrap_err();
    assert!(matches!(
        err,
        EngineError::ValueTooLarge {
            len: 1048577,
            max: 1048576
        }
    ));
    assert!(err.to_string().contains("exceeds the limit"), "{err}");
    // The largest allowed sizes work, and nothing was stored by the refused writes.
    let max_key = vec![b'k'; 64 * 1024];
    let max_value = vec![7u8; 1 << 20];
    engine
        .put(t, &max_key, &max_value, &PutOptions::default())
        .unwrap();
    assert_eq!(engine.get(t, &max_key).unwrap().unwrap().value, max_value);
    assert_eq!(engine.object_count(), 1);
}

#[test]
fn expiry_hides_and_reclaims() {
    let engine = Engine::new(EngineConfig {
        memory_bytes: 8 << 20,
        segment_seglets: 4,
        cleaner_threads: 0,
        value_size_max_bytes: 4096,
        ..Default::default()
    })
    .unwrap();
    let t = engine.create_tablet(0, 0, 16383).unwrap();
    let past = 1; // 1 ms after the epoch: long expired
    engine
        .put(
            t,
            b"gone",
            b"x",
            &PutOptions {
                expire_at_ms: past,
                ..Default::default()
            },
        )
        .unwrap();
    let future = u64::MAX / 2;
    engine
        .put(
            t,
            b"kept",
            b"y",
            &PutOptions {
                expire_at_ms: future,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(engine.get(t, b"gone").unwrap(), None);
    assert_eq!(
        engine.get(t, b"kept").unwrap().unwrap().expire_at_ms,
        future
    );
    // SET NX succeeds over an expired key; KEEPTTL keeps the old expiry.
    engine
        .put(
            t,
            b"gone",
            b"z",
            &PutOptions {
                condition: Condition::IfAbsent,
                ..Default::default()
            },
        )
        .unwrap();
    engine
        .put(
            t,
            b"kept",
            b"w",
            &PutOptions {
                keep_ttl: true,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(
        engine.get(t, b"kept").unwrap().unwrap().expire_at_ms,
        future
    );
    assert_eq!(engine.set_expiry(t, b"missing", 5).unwrap(), None);
    engine.set_expiry(t, b"kept", past).unwrap().unwrap();
    assert_eq!(engine.get(t, b"kept").unwrap(), None);
}

#[test]
fn scan_keys_returns_every_key_once_per_pass() {
    let engine = Engine::new(EngineConfig {
        memory_bytes: 32 << 20,
        ..Default::default()
    })
    .unwrap();
    let t = engine.create_tablet(0, 0, 16383).unwrap();
    for i in 0..10_000 {
        engine
            .put(t, format!("k{i}").as_bytes(), b"v", &PutOptions::default())
            .unwrap();
    }
    let mut seen = std::collections::HashSet::new();
    let mut cursor = 0;
    let mut calls = 0;
    loop {
        let mut keys = Vec::new();
        cursor = engine.scan_keys(t, cursor, 100, &mut keys).unwrap();
        // Keys present throughout are returned; while iterating, keep writing new ones.
        engine
            .put(
                t,
                format!("new{calls}").as_bytes(),
                b"v",
                &PutOptions::default(),
            )
            .unwrap();
        calls += 1;
        seen.extend(keys);
        if cursor == 0 {
            break;
        }
    }
    for i in 0..10_000 {
        assert!(seen.contains(format!("k{i}").as_bytes()), "k{i} missing");
    }
    assert!(calls > 50);
}

#[test]
fn restore_keeps_newest_and_moves_the_clock() {
    let engine = Engine::new(EngineConfig {
        memory_bytes: 8 << 20,
        segment_seglets: 4,
        value_size_max_bytes: 4096,
        ..Default::default()
    })
    .unwrap();
    let t = engine.create_tablet(0, 0, 16383).unwrap();
    engine.restore(t, b"a", Some(b"v10"), 10, 0).unwrap();
    engine.restore(t, b"a", Some(b"v5"), 5, 0).unwrap();
    assert_eq!(engine.get(t, b"a").unwrap().unwrap().value, b"v10");
    engine.restore(t, b"a", None, 11, 0).unwrap();
    assert_eq!(engine.get(t, b"a").unwrap(), None);
    let v = engine
        .put(t, b"a", b"new", &PutOptions::default())
        .unwrap()
        .version;
    assert!(v > 11, "version {v} must follow restored versions");
}

/// A batch restore (one lock per group of records, lookups prefetched ahead) leaves each key as
/// restoring its records one by one does: the newest version wins, whatever the order within
/// and across batches; replayed deletes and records that expired while away remove the key;
/// a key repeated within one batch keeps its newest record; a record over the size limits fails
/// the batch before anything of it is installed.
#[test]
fn a_batch_restore_equals_restoring_one_by_one() {
    use rand::{Rng, SeedableRng};
    let config = || EngineConfig {
        memory_bytes: 16 << 20,
        segment_seglets: 4,
        value_size_max_bytes: 4096,
        ..Default::default()
    };
    let (one, batched) = (
        Engine::new(config()).unwrap(),
        Engine::new(config()).unwrap(),
    );
    let (t1, t2) = (
        one.create_tablet(0, 0, 16383).unwrap(),
        batched.create_tablet(0, 0, 16383).unwrap(),
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let values: Vec<Vec<u8>> = (0..16).map(|i| vec![b'a' + i as u8; 1 + 40 * i]).collect();
    for _ in 0..200 {
        let len = rng.gen_range(1..200);
        let records: Vec<(Vec<u8>, Option<usize>, u64, u64)> = (0..len)
            .map(|_| {
                let key = format!("k{}", rng.gen_range(0..500)).into_bytes();
                let value = rng.gen_bool(0.85).then(|| rng.gen_range(0..values.len()));
                let expiry = if rng.gen_bool(0.05) { 1 } else { 0 };
                (key, value, rng.gen_range(1..10_000), expiry)
            })
            .collect();
        for (k, v, version, expiry) in &records {
            one.restore(t1, k, v.map(|i| &values[i][..]), *version, *expiry)
                .unwrap();
        }
        let items: Vec<RestoreItem<'_>> = records
            .iter()
            .map(|(k, v, version, expiry)| RestoreItem {
                key: k,
                value: v.map(|i| &values[i][..]),
                version: *version,
                expire_at_ms: *expiry,
            })
            .collect();
        batched.restore_batch(t2, &items).unwrap();
    }
    for k in 0..500 {
        let key = format!("k{k}").into_bytes();
        let (a, b) = (one.get(t1, &key).unwrap(), batched.get(t2, &key).unwrap());
        assert_eq!(
            a.as_ref().map(|o| (&o.value, o.version)),
            b.as_ref().map(|o| (&o.value, o.version)),
            "key k{k}"
        );
    }
    assert_eq!(one.stats().objects, batched.stats().objects);
    let huge = vec![0u8; 8192];
    let before = batched.stats().objects;
    let err = batched.restore_batch(
        t2,
        &[
            RestoreItem {
                key: b"new-key",
                value: Some(b"v"),
                version: 20_000,
                expire_at_ms: 0,
            },
            RestoreItem {
                key: b"too-large",
                value: Some(&huge),
                version: 20_001,
                expire_at_ms: 0,
            },
        ],
    );
    assert!(err.is_err());
    assert_eq!(batched.get(t2, b"new-key").unwrap(), None);
    assert_eq!(batched.stats().objects, before);
}

/// The engine's count of objects with an expiry time (Redis's `expires`) and their mean expiry
/// follow every way a key's current object changes: puts with and without expiry, KEEPTTL,
/// set_expiry, deletes, multi-puts, restores, an expired object replaced or reclaimed by the
/// cleaner, and cleaner moves (which must change nothing).
#[test]
fn expiring_object_count_follows_every_write() {
    use rand::{Rng, SeedableRng};
    let engine = Engine::new(EngineConfig {
        memory_bytes: 16 << 20,
        segment_seglets: 2,
        cleaner_threads: 1,
        key_size_max_bytes: 64,
        value_size_max_bytes: 4096,
        ..Default::default()
    })
    .unwrap();
    let t = engine.create_tablet(0, 0, 16383).unwrap();
    let base_ms = 4_000_000_000_000u64; // year 2096: never expires during the test
                                        // key -> expiry of its current object (0: none); absent keys are not in the map.
    let mut model: BTreeMap<u8, u64> = BTreeMap::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut next_version = 1u64 << 40;
    for round in 0..20_000u32 {
        let k = rng.gen_range(0u8..60);
        let key = key_bytes(k);
        let expiry = if rng.gen_bool(0.5) {
            base_ms + rng.gen_range(0..1_000_000_000)
        } else {
            0
        };
        let value = value_bytes(k, rng.gen_range(0..300), round as u64);
        match rng.gen_range(0..7) {
            0 | 1 => {
                let opts = PutOptions {
                    expire_at_ms: expiry,
                    ..Default::default()
                };
                engine.put(t, &key, &value, &opts).unwrap();
                model.insert(k, expiry);
            }
            2 => {
                let opts = PutOptions {
                    keep_ttl: true,
                    ..Default::default()
                };
                engine.put(t, &key, &value, &opts).unwrap();
                let kept = model.get(&k).copied().unwrap_or(0);
                model.insert(k, kept);
            }
            3 => {
                if engine.set_expiry(t, &key, expiry).unwrap().is_some() {
                    model.insert(k, expiry);
                } else {
                    assert!(!model.contains_key(&k));
                }
            }
            4 => {
                engine.delete(t, &key, Condition::None).unwrap();
                model.remove(&k);
            }
            5 => {
                let k2 = rng.gen_range(0u8..60);
                let key2 = key_bytes(k2);
                engine
                    .multi_put(t, &[(&key[..], &value[..]), (&key2[..], &value[..])])
                    .unwrap();
                model.insert(k, 0);
                model.insert(k2, 0);
            }
            _ => {
                // A replayed record newer than anything written so far replaces the key.
                next_version += 1 << 20;
                let value = rng.gen_bool(0.8).then_some(&value[..]);
                engine
                    .restore(t, &key, value, next_version, expiry)
                    .unwrap();
                match value {
                    Some(_) => model.insert(k, expiry),
                    None => model.remove(&k),
                };
            }
        }
        if round % 1000 == 0 {
            engine.clean_until_idle(50);
        }
        if round % 97 == 0 {
            let stats = engine.stats();
            let expiring: Vec<u64> = model.values().copied().filter(|&e| e != 0).collect();
            assert_eq!(
                stats.expiring_objects,
                expiring.len() as u64,
                "round {round}"
            );
            let mean_ms = if expiring.is_empty() {
                0
            } else {
                expiring.iter().map(|e| e / 1000).sum::<u64>() * 1000 / expiring.len() as u64
            };
            assert_eq!(stats.expiring_mean_expire_at_ms, mean_ms, "round {round}");
        }
    }
    // Expired objects stay counted until they go, as Redis counts its expires; replacing one
    // or letting the cleaner reclaim it takes it out.
    let before = engine.stats().expiring_objects;
    for (i, k) in [200u8, 201, 202].iter().enumerate() {
        let opts = PutOptions {
            expire_at_ms: 1 + i as u64,
            ..Default::default()
        };
        engine.put(t, &key_bytes(*k), b"old", &opts).unwrap();
    }
    assert_eq!(engine.stats().expiring_objects, before + 3);
    engine
        .put(t, &key_bytes(200), b"new", &PutOptions::default())
        .unwrap();
    assert_eq!(engine.stats().expiring_objects, before + 2);
    // Overwrite everything else so that the expired objects' segments are worth cleaning.
    for round in 0..20u64 {
        for (&k, &expire_at_ms) in &model {
            let opts = PutOptions {
                expire_at_ms,
                ..Default::default()
            };
            engine
                .put(t, &key_bytes(k), &value_bytes(k, 200, round), &opts)
                .unwrap();
        }
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while engine.stats().expiring_objects != before && std::time::Instant::now() < deadline {
        engine.clean_until_idle(50);
    }
    assert_eq!(engine.stats().expiring_objects, before);
    assert!(engine.stats().expired_reclaimed >= 2);
}

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Active expiry: expired objects nobody reads leave the index and the live bytes within a few
/// sweep intervals of the background cleaner, in open head segments and in closed ones alike;
/// objects without expiry, with a later expiry, or made persistent stay.
#[test]
fn expired_objects_leave_without_being_read() {
    let engine = Engine::new(EngineConfig {
        memory_bytes: 64 << 20,
        segment_seglets: 4,
        cleaner_threads: 1,
        key_size_max_bytes: 64,
        value_size_max_bytes: 4096,
        ..Default::default()
    })
    .unwrap();
    let tablets: Vec<_> = (0..4u16)
        .map(|i| engine.create_tablet(0, i * 4096, i * 4096 + 4095).unwrap())
        .collect();
    let soon = wall_ms() + 300;
    let value = vec![7u8; 200];
    for i in 0..20_000u32 {
        let t = tablets[i as usize % tablets.len()];
        let key = format!("k{i}");
        let expire_at_ms = match i % 4 {
            0 => 0,
            1 => soon + 3_600_000,
            _ => soon,
        };
        let opts = PutOptions {
            expire_at_ms,
            ..Default::default()
        };
        engine.put(t, key.as_bytes(), &value, &opts).unwrap();
    }
    // Half of the ones about to expire are made persistent again (PERSIST writes a new entry).
    for i in (2..20_000u32).step_by(8) {
        let t = tablets[i as usize % tablets.len()];
        engine.set_expiry(t, format!("k{i}").as_bytes(), 0).unwrap();
    }
    let stats = engine.stats();
    assert_eq!(stats.objects, 20_000);
    assert_eq!(stats.expiring_objects, 5_000 + 7_500);
    let live_before = stats.live_bytes;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while engine.object_count() > 12_500 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let stats = engine.stats();
    assert_eq!(stats.objects, 12_500, "expired objects left the index");
    assert_eq!(stats.expiring_objects, 5_000);
    assert!(stats.expired_reclaimed >= 7_500);
    assert!(
        stats.live_bytes < live_before * 13 / 20,
        "their bytes are no longer live: {} of {live_before}",
        stats.live_bytes
    );
    for i in 0..20_000u32 {
        let t = tablets[i as usize % tablets.len()];
        let got = engine.get(t, format!("k{i}").as_bytes()).unwrap();
        let expected = i % 4 < 2 || i % 8 == 2;
        assert_eq!(got.is_some(), expected, "k{i}");
    }
}

/// `expire_now` removes exactly the expired objects, never one a snapshot may still read, and
/// agrees with an oracle under random writes, deletes, expiry changes and cleaning.
#[test]
fn expiry_sweep_agrees_with_an_oracle() {
    use rand::{Rng, SeedableRng};
    let engine = Engine::new(EngineConfig {
        memory_bytes: 16 << 20,
        segment_seglets: 2,
        cleaner_threads: 0,
        key_size_max_bytes: 64,
        value_size_max_bytes: 4096,
        ..Default::default()
    })
    .unwrap();
    let t = engine.create_tablet(0, 0, 16383).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    // key -> (value, expiry)
    let mut model: BTreeMap<u16, (Vec<u8>, u64)> = BTreeMap::new();
    let past = 1_000u64;
    let future = wall_ms() + 3_600_000;
    for round in 0..30_000u32 {
        let k = rng.gen_range(0u16..500);
        let key = format!("key-{k}").into_bytes();
        match rng.gen_range(0..10) {
            0..=5 => {
                let expire_at_ms = [0, past, future][rng.gen_range(0..3)];
                let value = value_bytes(k as u8, rng.gen_range(0..200), round as u64);
                let opts = PutOptions {
                    expire_at_ms,
                    ..Default::default()
                };
                engine.put(t, &key, &value, &opts).unwrap();
                model.insert(k, (value, expire_at_ms));
            }
            6 => {
                engine.delete(t, &key, Condition::None).unwrap();
                model.remove(&k);
            }
            7 => {
                let expire_at_ms = [0, past, future][rng.gen_range(0..3)];
                let live = model.get(&k).is_some_and(|(_, e)| *e != past);
                let set = engine.set_expiry(t, &key, expire_at_ms).unwrap().is_some();
                assert_eq!(set, live, "set_expiry {k}");
                if live {
                    model.get_mut(&k).unwrap().1 = expire_at_ms;
                }
            }
            8 => {
                engine.clean_until_idle(5);
            }
            _ => {
                // A snapshot keeps what it can read; the sweep leaves those alone.
                let snap = engine.snapshot();
                let swept = engine.expire_now();
                let _ = swept;
                for (k, (value, expire_at_ms)) in model.iter().take(50) {
                    let got = engine
                        .get_at(t, format!("key-{k}").as_bytes(), &snap)
                        .unwrap();
                    let visible = *expire_at_ms != past;
                    assert_eq!(got.map(|o| o.value), visible.then(|| value.clone()), "{k}");
                }
                drop(snap);
                engine.expire_now();
                model.retain(|_, (_, e)| *e != past);
                assert_eq!(engine.object_count(), model.len() as u64, "round {round}");
                assert_eq!(
                    engine.stats().expiring_objects,
                    model.values().filter(|(_, e)| *e != 0).count() as u64
                );
            }
        }
    }
    engine.expire_now();
    model.retain(|_, (_, e)| *e != past);
    assert_eq!(engine.object_count(), model.len() as u64);
    for (k, (value, _)) in &model {
        let got = engine.get(t, format!("key-{k}").as_bytes()).unwrap();
        assert_eq!(got.map(|o| o.value).as_ref(), Some(value), "{k}");
    }
}
