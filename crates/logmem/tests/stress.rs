//! Multi-threaded stress: writers on several tablets, lock-free readers and the background cleaner
//! all at once, checked against per-writer oracles. Values embed their key and a sequence number so
//! that readers can tell a torn or misplaced read from a stale one.

use ramlog_logmem::{Condition, Engine, EngineConfig, PutOptions, SEGLET_BYTES};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

fn value_for(key: u32, seq: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len.max(12));
    v.extend_from_slice(&key.to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    while v.len() < len {
        v.push((seq as u8).wrapping_add(v.len() as u8));
    }
    v
}

fn check_value(key: u32, v: &[u8]) -> u64 {
    assert!(v.len() >= 12, "short value for key {key}");
    assert_eq!(
        u32::from_le_bytes(v[0..4].try_into().unwrap()),
        key,
        "value of another key"
    );
    let seq = u64::from_le_bytes(v[4..12].try_into().unwrap());
    for (i, &b) in v.iter().enumerate().skip(12) {
        assert_eq!(
            b,
            (seq as u8).wrapping_add(i as u8),
            "torn value for key {key}"
        );
    }
    seq
}

#[test]
fn writers_readers_and_cleaner_agree_with_oracles() {
    stress(false);
}

/// All writers in one tablet: they share its lock and index, so a reference a writer found before
/// taking the lock is often moved meanwhile (bucket splits from the others' inserts, the cleaner's
/// swaps) and must be found again.
#[test]
fn writers_sharing_a_tablet_agree_with_oracles() {
    stress(true);
}

fn stress(one_tablet: bool) {
    let engine = Engine::new(EngineConfig {
        memory_bytes: 640 * SEGLET_BYTES as u64, // 40 MiB
        segment_seglets: 8,
        value_size_max_bytes: 8192,
        cleaner_threads: 1,
        ..Default::default()
    })
    .unwrap();
    let tablets: Vec<u32> = if one_tablet {
        vec![engine.create_tablet(0, 0, 16383).unwrap(); 4]
    } else {
        (0..4u16)
            .map(|i| engine.create_tablet(0, i * 4096, i * 4096 + 4095).unwrap())
            .collect()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    const KEYS: u32 = 3000;

    let mut writers = Vec::new();
    for (w, &tablet) in tablets.iter().enumerate() {
        let engine = engine.clone();
        writers.push(std::thread::spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(w as u64);
            let mut model: HashMap<u32, (u64, usize)> = HashMap::new();
            for seq in 1..=60_000u64 {
                let key = rng.gen_range(0..KEYS);
                let k = format!("w{w}-{key}");
                if rng.gen_bool(0.05) {
                    // An atomic multi-put of three keys (a key may repeat: the last copy wins).
                    let keys: Vec<u32> = (0..3).map(|_| rng.gen_range(0..KEYS)).collect();
                    let owned: Vec<(String, Vec<u8>)> = keys
                        .iter()
                        .map(|&key| (format!("w{w}-{key}"), value_for(key, seq, 40)))
                        .collect();
                    let items: Vec<(&[u8], &[u8])> =
                        owned.iter().map(|(k, v)| (k.as_bytes(), &v[..])).collect();
                    engine.multi_put(tablet, &items).unwrap();
                    for key in keys {
                        model.insert(key, (seq, 40));
                    }
                } else if rng.gen_bool(0.1) {
                    let existed = engine
                        .delete(tablet, k.as_bytes(), Condition::None)
                        .unwrap()
                        .is_some();
                    assert_eq!(existed, model.remove(&key).is_some());
                } else {
                    let len = if rng.gen_bool(0.9) {
                        rng.gen_range(12..300)
                    } else {
                        rng.gen_range(1000..8000)
                    };
                    if let Err(e) = engine.put(
                        tablet,
                        k.as_bytes(),
                        &value_for(key, seq, len),
                        &PutOptions::default(),
                    ) {
                        panic!("{e}: {:#?}", engine.stats());
                    }
                    model.insert(key, (seq, len));
                }
            }
            (tablet, w, model)
        }));
    }
    let mut readers = Vec::new();
    for r in 0..2 {
        let engine = engine.clone();
        let stop = stop.clone();
        let reads = reads.clone();
        let tablets = tablets.clone();
        readers.push(std::thread::spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(100 + r);
            let mut last_seen: HashMap<(usize, u32), u64> = HashMap::new();
            let mut buf = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let w = rng.gen_range(0..tablets.len());
                let key = rng.gen_range(0..KEYS);
                let k = format!("w{w}-{key}");
                if let Some(_version) = engine.get_into(tablets[w], k.as_bytes(), &mut buf).unwrap()
                {
                    let seq = check_value(key, &buf);
                    // A reader never goes back in time for one key.
                    let prev = last_seen.insert((w, key), seq).unwrap_or(0);
                    assert!(seq >= prev, "key {k} went back from {prev} to {seq}");
                }
                reads.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let models: Vec<_> = writers.into_iter().map(|h| h.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    for (tablet, w, model) in &models {
        for key in 0..KEYS {
            let k = format!("w{w}-{key}");
            let got = engine.get(*tablet, k.as_bytes()).unwrap();
            match (got, model.get(&key)) {
                (None, None) => {}
                (Some(o), Some(&(seq, len))) => {
                    assert_eq!(o.value.len(), len);
                    assert_eq!(check_value(key, &o.value), seq);
                }
                (g, m) => panic!("{k}: engine {} model {:?}", g.is_some(), m),
            }
        }
    }
    let stats = engine.stats();
    assert!(
        stats.segments_cleaned > 10,
        "cleaner did too little: {stats:?}"
    );
    assert!(reads.load(Ordering::Relaxed) > 1000);
    let expected: u64 = models.iter().map(|(_, _, m)| m.len() as u64).sum();
    assert_eq!(engine.object_count(), expected);
}
