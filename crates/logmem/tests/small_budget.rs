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
    seq.to_le_bytes().iter().copied().cycle().take(len).collect()
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

    /// Adds keys of `table` until the engine's utilisation reaches `target`.
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
            if engine.stats().utilisation >= target {
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

#[test]
fn overwrites_at_64_mib_with_64_tablets() {
    let deadline = Instant::now() + Duration::from_secs(120);
    let e = engine(64 << 20);
    split_table(&e, 1, 64);
    let mut load = Load::new(100);
    load.fill(&e, 1, 0.85, deadline);
    let mut rng = StdRng::seed_from_u64(64);
    load.overwrite(&e, scaled(4_000_000), &mut rng);
    let s = e.stats();
    assert_eq!(load.failed, 0, "writes failed at {:.3}", s.utilisation);
    load.check(&e);
}
