//! Times the bulk restore of one tablet from keys and values already in memory (the engine's
//! share of a recovery's restore), twice in one engine so that the second fill reuses memory.
//!
//! `cargo run --release -p ramlog-logmem --example bulkprobe -- [objects] [value_bytes]`

use ramlog_logmem::{Engine, EngineConfig};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let n: u64 = args.get(1).map_or(Ok(4_000_000), |s| s.parse())?;
    let value_len: usize = args.get(2).map_or(Ok(100), |s| s.parse())?;
    let keys: Vec<Vec<u8>> = (0..n)
        .map(|i| format!("key:{i:012}").into_bytes())
        .collect();
    let value = vec![b'v'; value_len];
    let engine = Engine::new(EngineConfig {
        memory_bytes: n * (value_len as u64 + 80) * 3 + (256 << 20),
        ..Default::default()
    })?;
    for round in 0..3 {
        let tablet = engine.create_tablet(round, 0, 16383)?;
        let t = Instant::now();
        let mut loader = engine.bulk_restore(tablet, n)?;
        for (i, k) in keys.iter().enumerate() {
            loader.push(k, &value, i as u64 + 1, 0)?;
        }
        let loaded = loader.finish()?;
        let s = t.elapsed().as_secs_f64();
        println!(
            "round {round}: {loaded} objects in {s:.3} s ({:.0} ns each, {:.2} M/s)",
            s * 1e9 / n as f64,
            n as f64 / s / 1e6
        );
    }
    Ok(())
}
