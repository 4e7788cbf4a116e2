//! Small budgets and many tablets: overwrite loads must keep being accepted up to the utilisation
//! limit whatever the budget and the number of tablets (each tablet has a log, and so a head
//! segment, of its own), and every key must read back its newest value.

use ramlog_logmem::{Engine, EngineConfig, EngineError, PutOptions, TableId, TabletId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SLOTS: u32 = 16384;

fn engine(memory_bytes: u64) -> Arc<Engine> {
    Engine::new(EngineConfig {
        memory_bytes,
        // Tests share two cores with other builds: give a starved cleaner time before a write fails.
        oom_wait_ms: 10_000,
        ..Default::default()
    })
    .expect("a valid configuration")
}

/// Creates `count` tablets of `table` that split its slots evenly.
fn split_table(engine: &Engine, table: TableId, count: u32) -> Vec<TabletId> {
    (0..count)
        .map(|i| {
            let first = (i * SLOTS / count) as u16;
            let last = ((i + 1) * SLOTS / count - 1) as u16;
            engine.create_tablet(table, first, last).unwrap()
        })
        .collect()
}

/// A value that names its key and write: `seq` repeated.
fn value(seq: u64, len: usize) -> Vec<u8> {
    seq.to_le_bytes()
        .iter()
        .copied()
        .cycle()
        .take(len)
        .collect()
}

/// The keys of a load, each with its tablet, and the newest value written (the oracle).
struct Load {
    keys: Vec<(TableId, Vec<u8>, TabletId)>,
    newest: HashMap<usize, u64>,
    value_len: usize,
    seq: u64,
    failed: u64,
}

impl Load {
    fn new(value_len: usize) -> Self {
        Load {
            keys: Vec::new(),
            newest: HashMap::new(),
            value_len,
            seq: 0,
            failed: 0,
        }
    }

    fn put(&mut self, engine: &Engine, i: usize) {
        self.seq += 1;
        let (_, key, tablet) = &self.keys[i];
        match engine.put(
            *tablet,
            key,
            &value(self.seq, self.value_len),
            &PutOptions::default(),
        ) {
            Ok(_) => {
                self.newest.insert(i, self.seq);
            }
            Err(EngineError::OutOfMemory { .. }) => self.failed += 1,
            Err(e) => panic!("{e}"),
        }
    }

    /// Adds keys of `table` until the engine's utilisation reaches `target`, or its utilisation
    /// limit if that is lower.
    fn fill(&mut self, engine: &Engine, table: TableId, target: f64, deadline: Instant) {
        loop {
            for _ in 0..1000 {
                let key = format!("t{table}-key-{:010}", self.keys.len()).into_bytes();
                let tablet = engine.locate(table, &key).expect("every slot has a tablet");
                self.keys.push((table, key, tablet));
                self.put(engine, self.keys.len() - 1);
            }
            if self.failed > 0 {
                let s = engine.stats();
                panic!(
                    "{} writes failed while filling, at utilisation {:.3}, {} bytes copied by the cleaner",
                    self.failed, s.utilisation, s.cleaner_copied_bytes
                );
            }
            let s = engine.stats();
            if s.utilisation >= target.min(s.utilisation_limit) {
                return;
            }
            assert!(Instant::now() < deadline, "fill did not reach {target}");
        }
    }

    /// Overwrites uniformly chosen keys `ops` times.
    fn overwrite(&mut self, engine: &Engine, ops: u64, rng: &mut StdRng) {
        for _ in 0..ops {
            let i = rng.gen_range(0..self.keys.len());
            self.put(engine, i);
        }
    }

    fn check(&self, engine: &Engine) {
        for (i, (_, key, tablet)) in self.keys.iter().enumerate() {
            let got = engine.get(*tablet, key).unwrap().map(|o| o.value);
            let want = self.newest.get(&i).map(|&s| value(s, self.value_len));
            assert_eq!(got, want, "key {i}");
        }
    }
}

/// What the debug build's tests run: a tenth of the release build's overwrites.
fn scaled(ops: u64) -> u64 {
    if cfg!(debug_assertions) {
        ops / 10
    } else {
        ops
    }
}

/// Fills to `target` utilisation (live bytes over log capacity), overwrites, and checks that no
/// write failed, that the cleaner ran, that the utilisation held, and every key's newest value.
fn overwrite_run(engine: &Engine, load: &mut Load, table: TableId, target: f64, ops: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    load.fill(engine, table, target, deadline);
    let mut rng = StdRng::seed_from_u64(ops ^ load.keys.len() as u64);
    load.overwrite(engine, scaled(ops), &mut rng);
    let s = engine.stats();
    let target = target.min(s.utilisation_limit);
    eprintln!(
        "tablets {} budget {} MiB: {} keys, utilisation {:.3} (limit {:.3}), write cost {:.2}, head waste {} KiB, index {} KiB, used {} MiB, resident {} MiB, passes {}+{} (failed compactions {}), heads closed {}, copied {} MiB",
        s.tablets,
        s.total_bytes >> 20,
        load.keys.len(),
        s.utilisation,
        s.utilisation_limit,
        s.write_cost,
        s.head_waste_bytes >> 10,
        s.index_bytes >> 10,
        s.log_used_bytes >> 20,
        s.log_resident_bytes >> 20,
        s.compaction_passes,
        s.combined_passes,
        s.compaction_failures,
        s.heads_closed,
        s.cleaner_copied_bytes >> 20,
    );
    assert_eq!(load.failed, 0, "writes failed at {:.3}", s.utilisation);
    assert!(
        s.utilisation >= target - 0.02,
        "utilisation fell to {:.3}",
        s.utilisation
    );
    assert!(
        s.cleaner_copied_bytes > 0 && s.segments_cleaned > 0,
        "the cleaner did not run: {s:?}"
    );
    assert_eq!(
        s.log_capacity_bytes,
        s.total_bytes - s.index_bytes - s.external_bytes
    );
    assert!(s.head_waste_bytes <= s.tablets * ramlog_logmem::SEGLET_BYTES as u64 * 2);
    load.check(engine);
}

#[test]
fn overwrites_at_64_mib_with_64_tablets() {
    let e = engine(64 << 20);
    split_table(&e, 1, 64);
    overwrite_run(&e, &mut Load::new(100), 1, 0.85, 4_000_000);
}

/// 256 heads take a seglet each in 64 MiB (16 MiB, half of it unwritten on average): the limit is
/// below 85% there, and the load runs at the limit.
#[test]
fn overwrites_at_64_mib_with_256_tablets() {
    let e = engine(64 << 20);
    split_table(&e, 1, 256);
    let limit = e.stats().utilisation_limit;
    assert!((0.75..0.85).contains(&limit), "limit {limit:.3}");
    overwrite_run(&e, &mut Load::new(100), 1, 0.85, 400_000);
}

#[test]
fn overwrites_at_256_mib_with_256_tablets() {
    let e = engine(256 << 20);
    split_table(&e, 1, 256);
    overwrite_run(&e, &mut Load::new(1000), 1, 0.85, 1_500_000);
}

/// Tablets created after data exists: the first tablet's head was sized for one tablet (1/16 of
/// the budget), the 63 added later make heads a seglet or two, and the old head must close at the
/// new size rather than keep growing.
#[test]
fn overwrites_with_tablets_added_after_data_exists() {
    let deadline = Instant::now() + Duration::from_secs(120);
    let e = engine(64 << 20);
    split_table(&e, 1, 1);
    let mut load = Load::new(100);
    load.fill(&e, 1, 0.30, deadline);
    let mut rng = StdRng::seed_from_u64(7);
    load.overwrite(&e, scaled(500_000), &mut rng);
    split_table(&e, 2, 63);
    overwrite_run(&e, &mut load, 2, 0.85, 4_000_000);
    assert_eq!(e.stats().tablets, 64);
}

/// Inserts new keys of 1000 B values into `tablet` until a write fails with out-of-memory;
/// returns how many it wrote.
fn insert_until_full(engine: &Engine, tablet: TabletId, next: &mut u64) -> u64 {
    let mut written = 0;
    loop {
        let key = format!("new-{next:010}");
        *next += 1;
        match engine.put(tablet, key.as_bytes(), &[5u8; 1000], &PutOptions::default()) {
            Ok(_) => written += 1,
            Err(EngineError::OutOfMemory { .. }) => return written,
            Err(e) => panic!("{e}"),
        }
        assert!(written < 1_000_000, "no out-of-memory in a 64 MiB budget");
    }
}

/// The external charge and the hash indexes come out of the budget: writers may use only what is
/// left, writes fail earlier under a charge and are accepted again when it drops; deletes and
/// reads keep working under a charge larger than the whole budget.
#[test]
fn the_external_charge_and_the_index_shrink_what_writers_may_use() {
    let e = Engine::new(EngineConfig {
        memory_bytes: 64 << 20,
        oom_wait_ms: 10_000,
        ..Default::default()
    })
    .unwrap();
    let t = e.create_tablet(1, 0, 16383).unwrap();
    let total = e.stats().total_bytes;
    let mut next = 0;

    // A charge of half the budget: the log fills up to the other half.
    e.set_external_bytes(total / 2);
    let with_charge = insert_until_full(&e, t, &mut next);
    let s = e.stats();
    assert_eq!(s.external_bytes, total / 2);
    assert!(s.index_bytes > 0, "the index is counted");
    assert_eq!(s.log_capacity_bytes, total - s.index_bytes - total / 2);
    let seglet = ramlog_logmem::SEGLET_BYTES as u64;
    assert!(
        s.live_bytes <= s.log_capacity_bytes,
        "live {} above the log capacity {}",
        s.live_bytes,
        s.log_capacity_bytes
    );
    assert!(
        s.log_used_bytes <= s.log_capacity_bytes + seglet,
        "the log uses {} bytes of a capacity of {}",
        s.log_used_bytes,
        s.log_capacity_bytes
    );
    assert!(
        s.live_bytes >= s.log_capacity_bytes * 8 / 10,
        "writes failed at {} live bytes of a capacity of {}",
        s.live_bytes,
        s.log_capacity_bytes
    );

    // A charge above the whole budget: writes fail once the head's last seglet is full (the
    // charge applies when a seglet is taken), without waiting for the cleaner; reads and deletes
    // work.
    e.set_external_bytes(total * 2);
    let s = e.stats();
    assert_eq!(s.log_capacity_bytes, 0);
    let started = Instant::now();
    let mut accepted = 0;
    while e
        .put(t, b"one-more", &[1u8; 100], &PutOptions::default())
        .is_ok()
    {
        accepted += 1;
        assert!(
            accepted <= seglet / 100,
            "writes accepted beyond the head's last seglet"
        );
    }
    assert!(matches!(
        e.put(t, b"one-more", &[1u8; 100], &PutOptions::default()),
        Err(EngineError::OutOfMemory { .. })
    ));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the write waited for a cleaner that cannot help"
    );
    assert_eq!(
        e.get(t, b"new-0000000000").unwrap().map(|o| o.value),
        Some(vec![5u8; 1000])
    );
    for i in 0..1000u64 {
        let key = format!("new-{i:010}");
        assert!(e
            .delete(t, key.as_bytes(), ramlog_logmem::Condition::None)
            .unwrap()
            .is_some());
    }
    assert_eq!(e.get(t, b"new-0000000000").unwrap(), None);

    // The charge drops: the log grows to (nearly) the whole budget, beyond what it held before.
    e.set_external_bytes(0);
    let without_charge = insert_until_full(&e, t, &mut next);
    let s = e.stats();
    assert_eq!(s.log_capacity_bytes, total - s.index_bytes);
    assert!(
        without_charge > with_charge,
        "{without_charge} writes after the charge dropped, {with_charge} under it"
    );
    assert!(s.utilisation >= 0.85, "utilisation {:.3}", s.utilisation);
    // Every key written and not deleted reads back.
    for i in 1000..next - 1 {
        let key = format!("new-{i:010}");
        if e.get(t, key.as_bytes()).unwrap().is_none() {
            // The two writes that failed (one per fill) left no key behind.
            assert!(i == with_charge || i == next - 1, "key {i} missing");
        }
    }
}
