//! A tablet split: the upper slots and their objects go to a new tablet with their versions and
//! expiry times; the lower tablet keeps the rest; nothing is lost, nothing is in both.

use ramlog_common::key_slot;
use ramlog_logmem::query::Value;
use ramlog_logmem::{Condition, Engine, EngineConfig, EngineError, PutOptions};
use std::collections::HashMap;

fn engine(memory_bytes: u64) -> std::sync::Arc<Engine> {
    Engine::new(EngineConfig {
        memory_bytes,
        ..Default::default()
    })
    .unwrap()
}

#[test]
fn a_split_moves_the_upper_slots_objects_with_their_versions_and_nothing_else() {
    let e = engine(256 << 20);
    let t = e.create_tablet(7, 0, 16383).unwrap();
    let far = 4_000_000_000_000u64; // an expiry time far ahead (ms)
    let mut model: HashMap<Vec<u8>, (Vec<u8>, u64, u64)> = HashMap::new();
    for i in 0..20_000u32 {
        let key = format!("key:{i}").into_bytes();
        let value = vec![(i % 251) as u8; (i % 300) as usize];
        let expire_at_ms = if i % 7 == 0 { far } else { 0 };
        let opts = PutOptions {
            expire_at_ms,
            ..Default::default()
        };
        let v = e.put(t, &key, &value, &opts).unwrap().version;
        model.insert(key, (value, v, expire_at_ms));
    }
    // Overwrites and deletes leave garbage and superseded versions behind.
    for i in (0..20_000u32).step_by(5) {
        let key = format!("key:{i}").into_bytes();
        e.delete(t, &key, Condition::None).unwrap();
        model.remove(&key);
    }
    // The empty key and a binary key take part like any other.
    for key in [b"".to_vec(), vec![0u8, 255, 10, 13]] {
        let v = e
            .put(t, &key, b"edge", &PutOptions::default())
            .unwrap()
            .version;
        model.insert(key, (b"edge".to_vec(), v, 0));
    }
    let before = e.object_count();
    assert_eq!(before, model.len() as u64);

    // Unfrozen tablets, and split points outside the tablet, are refused and change nothing.
    assert!(matches!(
        e.split_tablet(t, 8192),
        Err(EngineError::Config(_))
    ));
    e.set_frozen(t, true).unwrap();
    assert!(matches!(e.split_tablet(t, 0), Err(EngineError::Config(_))));
    assert!(matches!(
        e.split_tablet(t, 16384),
        Err(EngineError::Config(_))
    ));
    let count_before_split = e.tablets().len();
    let upper = e.split_tablet(t, 8192).unwrap();
    assert_eq!(
        e.tablets().len(),
        count_before_split + 1,
        "refused splits made no tablet"
    );
    let infos = e.tablets();
    let lo = infos.iter().find(|x| x.id == t).unwrap();
    let hi = infos.iter().find(|x| x.id == upper).unwrap();
    assert_eq!((lo.first_slot, lo.last_slot), (0, 8191));
    assert_eq!((hi.first_slot, hi.last_slot, hi.table), (8192, 16383, 7));
    assert_eq!(lo.objects + hi.objects, model.len() as u64);
    assert!(lo.objects > 0 && hi.objects > 0);
    // The new tablet comes frozen: writes wait for the caller to open it.
    assert!(matches!(
        e.put(upper, b"{x}late", b"v", &PutOptions::default()),
        Err(EngineError::Frozen)
    ));

    for (key, (value, version, expire_at_ms)) in &model {
        let (mine, other) = if key_slot(key) >= 8192 {
            (upper, t)
        } else {
            (t, upper)
        };
        assert_eq!(e.locate(7, key), Some(mine), "route of {key:?}");
        let o = e
            .get(mine, key)
            .unwrap()
            .unwrap_or_else(|| panic!("{key:?} lost"));
        assert_eq!(&o.value, value);
        assert_eq!(o.version, *version, "a split keeps versions");
        assert_eq!(o.expire_at_ms, *expire_at_ms, "a split keeps expiry times");
        assert!(
            e.get(other, key).unwrap().is_none(),
            "{key:?} in both tablets"
        );
    }
    // Deleted keys stay deleted on both sides.
    for i in (0..20_000u32).step_by(5) {
        let key = format!("key:{i}").into_bytes();
        assert!(e.get(t, &key).unwrap().is_none() && e.get(upper, &key).unwrap().is_none());
    }

    // Opened, both take writes; the old tablet's memory of the moved objects is reclaimed.
    e.set_frozen(t, false).unwrap();
    e.set_frozen(upper, false).unwrap();
    let k_hi = (0..)
        .map(|i| format!("new:{i}").into_bytes())
        .find(|k| key_slot(k) >= 8192)
        .unwrap();
    e.put(upper, &k_hi, b"after", &PutOptions::default())
        .unwrap();
    assert_eq!(e.get(upper, &k_hi).unwrap().unwrap().value, b"after");
    e.clean_until_idle(100);
    let live = e.live_bytes_by_tablet();
    let moved_share =
        live[upper as usize] as f64 / (live[t as usize] + live[upper as usize]) as f64;
    assert!(
        (0.35..0.65).contains(&moved_share),
        "the upper half's bytes moved: {moved_share:.2} of the live bytes"
    );
}

#[test]
fn a_split_that_runs_out_of_memory_leaves_the_tablet_whole() {
    // 32 MiB, about 20 MiB of objects: a copy of their upper half does not fit.
    let e = Engine::new(EngineConfig {
        memory_bytes: 32 << 20,
        segment_seglets: 4,
        value_size_max_bytes: 4096,
        oom_wait_ms: 200,
        ..Default::default()
    })
    .unwrap();
    let t = e.create_tablet(0, 0, 16383).unwrap();
    let value = vec![7u8; 1000];
    let mut n = 0u32;
    loop {
        let key = format!("k{n}").into_bytes();
        match e.put(t, &key, &value, &PutOptions::default()) {
            Ok(_) => n += 1,
            Err(EngineError::OutOfMemory { .. }) => break,
            Err(other) => panic!("{other}"),
        }
    }
    assert!(n > 1000);
    e.set_frozen(t, true).unwrap();
    let err = e.split_tablet(t, 8192).unwrap_err();
    assert!(matches!(err, EngineError::OutOfMemory { .. }), "{err}");
    // Every object is still in the tablet, and read through its route.
    for i in 0..n {
        let key = format!("k{i}").into_bytes();
        assert_eq!(e.locate(0, &key), Some(t));
        assert!(e.get(t, &key).unwrap().is_some(), "k{i} lost");
    }
    let info = e.tablets().into_iter().find(|x| x.id == t).unwrap();
    assert_eq!((info.last_slot, info.objects), (16383, u64::from(n)));
}

#[test]
fn writes_made_while_a_split_copies_are_redone_in_its_last_step() {
    let e = engine(256 << 20);
    let t = e.create_tablet(3, 0, 16383).unwrap();
    let put = |key: &[u8], value: &[u8]| e.put(t, key, value, &PutOptions::default()).unwrap();
    let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    for i in 0..10_000u32 {
        let key = format!("k{i}").into_bytes();
        put(&key, b"before");
        model.insert(key, b"before".to_vec());
    }
    // The copy is made while the tablet takes writes.
    let copy = e.split_prepare(t, 8192).unwrap();
    assert!(copy.objects > 0 && copy.objects < 10_000);
    for i in 0..10_000u32 {
        let key = format!("k{i}").into_bytes();
        match i % 4 {
            0 => {
                put(&key, b"after");
                model.insert(key, b"after".to_vec());
            }
            1 => {
                e.delete(t, &key, Condition::None).unwrap();
                model.remove(&key);
            }
            _ => {}
        }
    }
    for i in 0..2_000u32 {
        let key = format!("new{i}").into_bytes();
        put(&key, b"new");
        model.insert(key, b"new".to_vec());
    }
    // A second split of the same tablet is refused while this one runs.
    assert!(e.split_prepare(t, 100).is_err());
    // The last step needs the tablet frozen.
    assert!(e.split_finish(&copy, &mut |_| {}).is_err());
    e.set_frozen(t, true).unwrap();
    let mut routed = None;
    let redone = e.split_finish(&copy, &mut |id| routed = Some(id)).unwrap();
    assert_eq!(routed, Some(copy.new));
    assert!(redone > 1000, "{redone} keys redone");
    let check = |phase: &str| {
        for (key, value) in &model {
            let mine = if key_slot(key) >= 8192 { copy.new } else { t };
            assert_eq!(e.locate(3, key), Some(mine));
            let got = e.get(mine, key).unwrap();
            assert_eq!(
                got.map(|o| o.value).as_ref(),
                Some(value),
                "{phase}: {key:?}"
            );
        }
        for i in (1..10_000u32).step_by(4) {
            let key = format!("k{i}").into_bytes();
            let mine = if key_slot(&key) >= 8192 { copy.new } else { t };
            assert!(
                e.get(mine, &key).unwrap().is_none(),
                "{phase}: deleted {key:?} is back"
            );
        }
    };
    check("after the last step");
    // Until the cleanup, the old tablet's SCAN leaves the copies out.
    let mut keys = Vec::new();
    let mut cursor = 0;
    loop {
        cursor = e.scan_keys(t, cursor, 1000, &mut keys).unwrap();
        if cursor == 0 {
            break;
        }
    }
    assert!(keys.iter().all(|k| key_slot(k) < 8192));
    let removed = e.split_cleanup(t).unwrap();
    assert!(removed > 0);
    check("after the cleanup");
    let infos = e.tablets();
    let objects: u64 = infos
        .iter()
        .filter(|x| x.table == 3)
        .map(|x| x.objects)
        .sum();
    assert_eq!(objects, model.len() as u64);
}

#[test]
fn a_cancelled_split_leaves_the_tablet_as_it_was() {
    let e = engine(64 << 20);
    let t = e.create_tablet(0, 0, 16383).unwrap();
    for i in 0..1000u32 {
        e.put(t, format!("k{i}").as_bytes(), b"v", &PutOptions::default())
            .unwrap();
    }
    let copy = e.split_prepare(t, 5000).unwrap();
    e.split_cancel(&copy);
    assert_eq!(e.locate(0, b"k1"), Some(t));
    let info = e.tablets().into_iter().find(|x| x.id == t).unwrap();
    assert_eq!((info.last_slot, info.objects), (16383, 1000));
    let new = e.tablets().into_iter().find(|x| x.id == copy.new).unwrap();
    assert_eq!(new.objects, 0, "the copy is emptied");
    // Writes after the cancel are not noted, and another split may start.
    e.put(t, b"later", b"v", &PutOptions::default()).unwrap();
    let again = e.split_prepare(t, 5000).unwrap();
    e.split_cancel(&again);
}

#[test]
fn a_restored_tablet_splits_whole() {
    let e = engine(256 << 20);
    let t = e.create_tablet(0, 0, 16383).unwrap();
    let mut load = e.bulk_restore(t, 20_000).unwrap();
    for i in 0..20_000u64 {
        load.push(format!("r{i}").as_bytes(), b"restored", 1_000 + i, 0)
            .unwrap();
    }
    load.finish().unwrap();
    e.advance_clock(1 << 32);
    let copy = e.split_prepare(t, 12288).unwrap();
    let expect = (0..20_000u64)
        .filter(|i| key_slot(format!("r{i}").as_bytes()) >= 12288)
        .count() as u64;
    assert_eq!(
        copy.objects, expect,
        "the split copies every object of a restored tablet"
    );
    e.set_frozen(t, true).unwrap();
    e.split_finish(&copy, &mut |_| {}).unwrap();
    for i in 0..20_000u64 {
        let key = format!("r{i}").into_bytes();
        let mine = if key_slot(&key) >= 12288 { copy.new } else { t };
        let o = e
            .get(mine, &key)
            .unwrap()
            .expect("every restored object stays");
        assert_eq!(o.version, 1_000 + i);
    }
}

#[test]
fn a_split_whose_noted_keys_overflow_compares_both_tablets_whole() {
    let e = engine(1 << 30);
    let t = e.create_tablet(0, 0, 16383).unwrap();
    for i in 0..5_000u32 {
        e.put(
            t,
            format!("old{i}").as_bytes(),
            b"v",
            &PutOptions::default(),
        )
        .unwrap();
    }
    let copy = e.split_prepare(t, 8192).unwrap();
    // More keys written during the copy than the 16 MiB of notes hold (about 34 B each).
    let mut upper_new = 0u64;
    for i in 0..1_300_000u32 {
        let key = format!("n{i}").into_bytes();
        e.put(t, &key, b"w", &PutOptions::default()).unwrap();
        upper_new += u64::from(key_slot(&key) >= 8192);
    }
    for i in 0..5_000u32 {
        if i % 2 == 0 {
            e.delete(t, format!("old{i}").as_bytes(), Condition::None)
                .unwrap();
        }
    }
    e.set_frozen(t, true).unwrap();
    e.split_finish(&copy, &mut |_| {}).unwrap();
    e.split_cleanup(t).unwrap();
    let upper_old = (0..5_000u32)
        .filter(|i| i % 2 == 1 && key_slot(format!("old{i}").as_bytes()) >= 8192)
        .count() as u64;
    let hi = e.tablets().into_iter().find(|x| x.id == copy.new).unwrap();
    assert_eq!(hi.objects, upper_new + upper_old);
    for i in 0..5_000u32 {
        let key = format!("old{i}").into_bytes();
        let mine = if key_slot(&key) >= 8192 { copy.new } else { t };
        assert_eq!(e.get(mine, &key).unwrap().is_some(), i % 2 == 1, "old{i}");
    }
}

#[test]
fn a_merge_joins_the_next_tablet_with_the_writes_made_while_it_copies() {
    let e = engine(256 << 20);
    let lower = e.create_tablet(5, 0, 8191).unwrap();
    let upper = e.create_tablet(5, 8192, 16383).unwrap();
    let put = |key: &[u8], value: &[u8]| {
        let t = e.locate(5, key).unwrap();
        e.put(t, key, value, &PutOptions::default()).unwrap();
    };
    let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    for i in 0..10_000u32 {
        let key = format!("k{i}").into_bytes();
        put(&key, b"before");
        model.insert(key, b"before".to_vec());
    }
    // Not adjacent (reversed), or another table: refused.
    assert!(e.merge_prepare(upper, lower).is_err());
    let other = e.create_tablet(6, 0, 16383).unwrap();
    assert!(e.merge_prepare(other, upper).is_err());
    let copied = e.merge_prepare(lower, upper).unwrap();
    assert!(copied > 1000);
    // Both take writes while the copy waits for its last step.
    for i in 0..10_000u32 {
        let key = format!("k{i}").into_bytes();
        match i % 4 {
            0 => {
                put(&key, b"after");
                model.insert(key, b"after".to_vec());
            }
            1 => {
                let t = e.locate(5, &key).unwrap();
                e.delete(t, &key, Condition::None).unwrap();
                model.remove(&key);
            }
            _ => {}
        }
    }
    assert!(
        e.merge_finish(lower, upper, &mut || {}).is_err(),
        "needs both frozen"
    );
    e.set_frozen(lower, true).unwrap();
    e.set_frozen(upper, true).unwrap();
    let mut routed = false;
    let redone = e.merge_finish(lower, upper, &mut || routed = true).unwrap();
    assert!(routed && redone > 0);
    let info = e.tablets().into_iter().find(|x| x.id == lower).unwrap();
    assert_eq!((info.first_slot, info.last_slot), (0, 16383));
    for (key, value) in &model {
        assert_eq!(e.locate(5, key), Some(lower));
        assert_eq!(
            e.get(lower, key).unwrap().map(|o| o.value).as_ref(),
            Some(value),
            "{key:?}"
        );
    }
    for i in (1..10_000u32).step_by(4) {
        let key = format!("k{i}").into_bytes();
        assert!(
            e.get(lower, &key).unwrap().is_none(),
            "deleted {key:?} is back"
        );
    }
    e.clear_tablet(upper).unwrap();
    assert_eq!(
        e.tablets()
            .into_iter()
            .find(|x| x.id == lower)
            .unwrap()
            .objects,
        model.len() as u64
    );
}

#[test]
fn a_cancelled_merge_removes_its_copies() {
    let e = engine(64 << 20);
    let lower = e.create_tablet(0, 0, 99).unwrap();
    let upper = e.create_tablet(0, 100, 16383).unwrap();
    let mut n = [0u64; 2];
    for i in 0..2000u32 {
        let key = format!("k{i}").into_bytes();
        let t = e.locate(0, &key).unwrap();
        e.put(t, &key, b"v", &PutOptions::default()).unwrap();
        n[usize::from(t == upper)] += 1;
    }
    e.merge_prepare(lower, upper).unwrap();
    e.merge_cancel(lower, upper).unwrap();
    let count = |id| {
        e.tablets()
            .into_iter()
            .find(|x| x.id == id)
            .unwrap()
            .objects
    };
    assert_eq!((count(lower), count(upper)), (n[0], n[1]));
    assert_eq!(
        e.tablets()
            .into_iter()
            .find(|x| x.id == lower)
            .unwrap()
            .last_slot,
        99
    );
}

#[test]
fn a_split_cleanup_that_runs_while_the_halves_merge_back_leaves_the_merged_objects() {
    let e = engine(256 << 20);
    let t = e.create_tablet(0, 0, 16383).unwrap();
    let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    for i in 0..8_000u32 {
        let key = format!("c{i}").into_bytes();
        let value = format!("v{i}").into_bytes();
        e.put(t, &key, &value, &PutOptions::default()).unwrap();
        model.insert(key, value);
    }
    // Split, with the old tablet still holding the copies of its former upper slots.
    e.set_frozen(t, true).unwrap();
    let upper = e.split_tablet(t, 8192).unwrap();
    e.set_frozen(t, false).unwrap();
    e.set_frozen(upper, false).unwrap();
    // The halves merge back before the split's cleanup ran; the cleanup then runs while the
    // copy waits for its last step, and again after it.
    e.merge_prepare(t, upper).unwrap();
    e.split_cleanup(t).unwrap();
    e.set_frozen(t, true).unwrap();
    e.set_frozen(upper, true).unwrap();
    e.merge_finish(t, upper, &mut || {}).unwrap();
    e.set_frozen(t, false).unwrap();
    assert_eq!(
        e.split_cleanup(t).unwrap(),
        0,
        "nothing lies outside the joined range"
    );
    e.clear_tablet(upper).unwrap();
    for (key, value) in &model {
        assert_eq!(e.locate(0, key), Some(t));
        assert_eq!(
            e.get(t, key).unwrap().map(|o| o.value).as_ref(),
            Some(value),
            "{key:?}"
        );
    }
    // A second merge into a tablet that is merged into already is refused.
    let a = e.create_tablet(1, 0, 99).unwrap();
    let b = e.create_tablet(1, 100, 199).unwrap();
    e.merge_prepare(a, b).unwrap();
    assert!(e.merge_prepare(a, b).is_err());
    e.merge_cancel(a, b).unwrap();
}

#[test]
fn a_scan_of_a_tablets_slots_leaves_out_the_copies_of_a_split_and_a_merge() {
    use ramlog_logmem::query::{Aggregate, Query};
    use ramlog_logmem::ScanMethod;
    let e = engine(256 << 20);
    let t = e.create_tablet(0, 0, 16383).unwrap();
    let keys: Vec<Vec<u8>> = (0..6_000u32)
        .map(|i| format!("s{i}").into_bytes())
        .collect();
    for k in &keys {
        e.put(t, k, b"v", &PutOptions::default()).unwrap();
    }
    let lower = keys.iter().filter(|k| key_slot(k) < 8192).count() as i64;
    let upper = keys.len() as i64 - lower;
    let count = Query {
        aggregates: vec![Aggregate::Count],
        ..Default::default()
    };
    let counted = |tablet, slots| {
        let snap = e.scan_snapshot(0);
        e.scan_tablet_slots(tablet, &snap, &count, slots, 0)
            .unwrap()
            .aggregates
            .unwrap()
    };
    let listed = |tablet, slots| {
        let mut cursor = e
            .scan_cursor_slots(tablet, e.scan_snapshot(0), &Query::default(), slots)
            .unwrap();
        let mut n = 0;
        while !cursor.is_done() {
            n += cursor.next_page(500).unwrap().len() as i64;
        }
        n
    };
    // Split, the copies of the upper slots still in the old tablet (no cleanup yet).
    let copy = e.split_prepare(t, 8192).unwrap();
    e.set_frozen(t, true).unwrap();
    e.split_finish(&copy, &mut |_| {}).unwrap();
    let hi = copy.new;
    e.set_frozen(t, false).unwrap();
    e.set_frozen(hi, false).unwrap();
    let whole = e.scan_snapshot(0);
    assert!(
        e.scan_tablet(t, &whole, &count, ScanMethod::Log, 0)
            .unwrap()
            .aggregates
            .unwrap()[0]
            == Value::I64(keys.len() as i64),
        "the old engine tablet still holds the copies"
    );
    assert_eq!(counted(t, (0, 8191)), vec![Value::I64(lower)]);
    assert_eq!(counted(hi, (8192, 16383)), vec![Value::I64(upper)]);
    assert_eq!(listed(t, (0, 8191)), lower);
    assert_eq!(listed(hi, (8192, 16383)), upper);
    // A merge back, while it copies: the lower tablet holds the upper's copies above its range.
    e.split_cleanup(t).unwrap();
    e.merge_prepare(t, hi).unwrap();
    assert_eq!(counted(t, (0, 8191)), vec![Value::I64(lower)]);
    assert_eq!(listed(t, (0, 8191)), lower);
    e.merge_cancel(t, hi).unwrap();
}
