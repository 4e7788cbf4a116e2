//! Where a restore's time goes: one tablet's backup logs replayed decode-only, then replayed
//! into an engine tablet three ways: `Engine::restore` per object, the engine's bulk loader
//! after the merge (`Engine::bulk_restore`), and streamed, the engine's index doing the merge
//! (`Backup::replay_streamed` into `Engine::restore_newest`), with the CPU time of the last two.
//! `cargo run --release -p ramlog-bench --example restore_probe -- [objects] [value_bytes]`
//!
//! Environment: `PROBE_DIRECT_IO=0` reads the logs through the page cache, `PROBE_REPLAY_THREADS`
//! sets the replay's threads, `PROBE_DECODE_ONLY` times only the decode-only replay and
//! `PROBE_BULK_ONLY` skips the per-object restore.
use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).map_or(2_000_000, |s| s.parse().unwrap());
    let value_len: usize = args.get(2).map_or(100, |s| s.parse().unwrap());
    let dir = std::env::temp_dir().join(format!("restore-probe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let mut config = ramlog_backup::Config::for_memory_budget(1 << 30);
    if let Ok(v) = std::env::var("PROBE_DIRECT_IO") {
        config.direct_io = v != "0";
    }
    if let Ok(v) = std::env::var("PROBE_REPLAY_THREADS") {
        config.replay_threads = v.parse()?;
    }
    let store = ramlog_backup::Backup::open(&dir, config)?;
    let value = vec![b'v'; value_len];
    let t = Instant::now();
    let mut batch_keys: Vec<Vec<u8>> = Vec::new();
    for chunk in 0..n.div_ceil(1000) {
        batch_keys.clear();
        for i in chunk * 1000..((chunk + 1) * 1000).min(n) {
            batch_keys.push(format!("key:{i:012}").into_bytes());
        }
        for (j, k) in batch_keys.iter().enumerate() {
            store.append(
                7,
                &[ramlog_backup::Entry {
                    key: k,
                    value: Some(&value),
                    version: chunk * 1000 + j as u64 + 1,
                    expiry: 0,
                }],
            )?;
        }
    }
    store.flush()?;
    println!("load {n} objects: {:.2} s", t.elapsed().as_secs_f64());
    for round in 0..2 {
        let t = Instant::now();
        let mut count = 0u64;
        store.replay_merged(&[7], |_| count += 1)?;
        let decode = t.elapsed().as_secs_f64();
        if std::env::var("PROBE_DECODE_ONLY").is_ok() {
            println!("round {round}: replay decode-only {count} in {decode:.3} s");
            continue;
        }
        let engine = fresh_engine(n, value_len)?;
        let tablet = engine.create_tablet(0, 0, 16383)?;
        let t = Instant::now();
        if std::env::var("PROBE_BULK_ONLY").is_err() {
            store.replay_merged(&[7], |e| {
                engine
                    .restore(tablet, e.key, Some(e.value), e.version, e.expiry)
                    .unwrap();
            })?;
        }
        let restore = t.elapsed().as_secs_f64();
        drop(engine);
        let engine = fresh_engine(n, value_len)?;
        let tablet = engine.create_tablet(0, 0, 16383)?;
        let t = Instant::now();
        let c = cpu_secs();
        let mut loader = None;
        store.replay_merged_counted(&[7], |r| match r {
            ramlog_backup::Replayed::Count(expected) => {
                loader = Some(engine.bulk_restore(tablet, expected).unwrap())
            }
            ramlog_backup::Replayed::Entry(e) => loader
                .as_mut()
                .unwrap()
                .push(e.key, e.value, e.version, e.expiry)
                .unwrap(),
        })?;
        let loaded = loader.unwrap().finish()?;
        let bulk = t.elapsed().as_secs_f64();
        println!(
            "round {round}: replay + bulk restore {:.3} CPU-s",
            cpu_secs() - c
        );
        assert_eq!(loaded, count);
        assert_eq!(engine.object_count(), count);
        drop(engine);
        let engine = fresh_engine(n, value_len)?;
        let tablet = engine.create_tablet(0, 0, 16383)?;
        let t = Instant::now();
        let c = cpu_secs();
        let sink = StreamSink {
            engine: &engine,
            tablet,
        };
        let streamed = store.replay_streamed(&[7], None, &sink)?;
        let stream = t.elapsed().as_secs_f64();
        let stream_cpu = cpu_secs() - c;
        assert!(streamed.trusted && !streamed.stopped);
        assert_eq!(engine.object_count(), count);
        println!(
            "round {round}: streamed replay into the engine {stream:.3} s, {stream_cpu:.3} CPU-s ({:.2} M/s, ratio {:.2})",
            count as f64 / stream / 1e6,
            decode / stream
        );
        println!(
            "round {round}: replay decode-only {count} in {decode:.3} s ({:.2} M/s); replay + restore {:.3} s ({:.2} M/s, ratio {:.2}); replay + bulk restore {:.3} s ({:.2} M/s, ratio {:.2})",
            count as f64 / decode / 1e6,
            restore,
            count as f64 / restore / 1e6,
            decode / restore,
            bulk,
            count as f64 / bulk / 1e6,
            decode / bulk
        );
    }
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The streamed replay's taker: each batch into the engine, newest version winning.
struct StreamSink<'e> {
    engine: &'e ramlog_logmem::Engine,
    tablet: ramlog_logmem::TabletId,
}

impl ramlog_backup::ReplaySink for StreamSink<'_> {
    fn start(&self, expected: u64) {
        self.engine
            .reserve_for_restore(self.tablet, expected)
            .unwrap();
    }
    fn take(&self, batch: &[ramlog_backup::ReplayEntry<'_>]) -> bool {
        let items: Vec<ramlog_logmem::RestoreItem<'_>> = batch
            .iter()
            .map(|e| ramlog_logmem::RestoreItem {
                key: e.key,
                value: Some(e.value),
                version: e.version,
                expire_at_ms: e.expiry,
            })
            .collect();
        self.engine.restore_newest(self.tablet, &items).is_ok()
    }
}

/// CPU time of this process so far (user + system), seconds.
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// An engine with room for `n` objects of `value_len` bytes, twice over.
fn fresh_engine(n: u64, value_len: usize) -> anyhow::Result<std::sync::Arc<ramlog_logmem::Engine>> {
    Ok(ramlog_logmem::Engine::new(ramlog_logmem::EngineConfig {
        memory_bytes: (n * (value_len as u64 + 64) * 2).max(256 << 20),
        ..Default::default()
    })?)
}
