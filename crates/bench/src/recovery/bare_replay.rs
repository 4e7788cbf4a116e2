//! The bare replay limit of a recovery: how fast this machine decodes the logs a restore reads,
//! with nothing inserted anywhere.
//!
//! A backup drops a dead master's logs once their tablets are re-protected, so they are gone
//! when a run ends. [`copy_store`] therefore copies one survivor's backup store (the logs of its
//! share of the victim's tablets) after the preload, before the load starts and before the kill,
//! once the store has been quiet for a while; [`measure`] opens the copy, after the cluster is
//! stopped, and replays every tablet in it decode-only on one replay thread
//! (`replay_threads = 1`, reorganization off), timing only the replay. The entries differ from
//! what the restorers read only by the load's 2 s of writes before the kill (at most
//! [`super::load::LOAD_KEYS`] keys over every server).

use anyhow::{bail, Context};
use ramlog_backup::{Backup, Config};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

/// How long a store's files must stay unchanged before they are copied, and how long that may
/// take at most.
const QUIET_FOR: Duration = Duration::from_millis(500);
const QUIET_LIMIT: Duration = Duration::from_secs(60);

/// Total bytes and newest modification time of the files under `dir`.
fn fingerprint(dir: &Path) -> anyhow::Result<(u64, Option<SystemTime>)> {
    let (mut bytes, mut newest) = (0, None);
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let meta = entry.metadata()?;
        if meta.is_dir() {
            let (b, n) = fingerprint(&entry.path())?;
            bytes += b;
            newest = newest.max(n);
        } else {
            bytes += meta.len();
            newest = newest.max(meta.modified().ok());
        }
    }
    Ok((bytes, newest))
}

fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<u64> {
    std::fs::create_dir_all(to)?;
    let mut bytes = 0;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            bytes += copy_dir(&entry.path(), &target)?;
        } else {
            bytes += std::fs::copy(entry.path(), &target)
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(bytes)
}

/// A copy of a live backup store.
#[derive(Debug, Clone)]
pub struct StoreCopy {
    /// The coordinator's id of the server whose store was copied.
    pub server: u64,
    pub bytes: u64,
    /// False when the files changed while they were copied (twice): the copy is then not a
    /// snapshot of one moment, and the replay may find fewer keys than the store held.
    pub quiet: bool,
    /// Preloaded keys in the tablets whose logs the copied store holds (set by the caller):
    /// what a replay of the copy should yield.
    pub expected_objects: u64,
}

/// Copies the store in `from` to `to` once its files have not changed for [`QUIET_FOR`]; copies
/// again, once, if they changed during the copy.
pub(super) fn copy_store(from: &Path, to: &Path, server: u64) -> anyhow::Result<StoreCopy> {
    let mut quiet = false;
    let mut bytes = 0;
    for _ in 0..2 {
        let started = Instant::now();
        let mut last = fingerprint(from)?;
        let mut since = Instant::now();
        while since.elapsed() < QUIET_FOR {
            if started.elapsed() > QUIET_LIMIT {
                bail!(
                    "the backup store in {} did not stay quiet for {QUIET_FOR:?} within {QUIET_LIMIT:?}",
                    from.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
            let now = fingerprint(from)?;
            if now != last {
                last = now;
                since = Instant::now();
            }
        }
        let _ = std::fs::remove_dir_all(to);
        bytes = copy_dir(from, to)?;
        if fingerprint(from)? == last {
            quiet = true;
            break;
        }
    }
    Ok(StoreCopy {
        server,
        bytes,
        quiet,
        expected_objects: 0,
    })
}

/// What [`measure`] saw.
#[derive(Debug, Clone)]
pub struct BareReplay {
    /// Live keys yielded, and how long the replay took (wall clock; the store's opening not
    /// included) and how much CPU time this process used meanwhile.
    pub objects: u64,
    pub time: Duration,
    pub cpu: Duration,
    /// Keys the replay reported lost or entries that failed their checksum (0 for a good copy).
    pub lost: u64,
    pub corrupt: u64,
}

impl BareReplay {
    /// Objects decoded per second of wall clock, on one replay thread.
    pub fn rate(&self) -> f64 {
        self.objects as f64 / self.time.as_secs_f64().max(1e-9)
    }
}

/// Opens the store copied to `dir` (written by servers of `memory_bytes`, whose segment sizes
/// the configuration must repeat) and replays every tablet in it decode-only: the callback
/// counts the entries and sums their lengths, nothing more.
pub(super) fn measure(dir: &Path, memory_bytes: u64) -> anyhow::Result<BareReplay> {
    let config = Config {
        replay_threads: 1,
        reorg_enabled: false,
        ..Config::for_memory_budget(memory_bytes)
    };
    let store = Backup::open(dir, config)
        .with_context(|| format!("opening the copied backup store in {}", dir.display()))?;
    let (mut objects, mut bytes) = (0u64, 0u64);
    let cpu = crate::util::process_cpu_secs();
    let started = Instant::now();
    let report = store.replay_all(|e| {
        objects += 1;
        bytes += (e.key.len() + e.value.len()) as u64;
    })?;
    let time = started.elapsed();
    let cpu = Duration::from_secs_f64((crate::util::process_cpu_secs() - cpu).max(0.0));
    std::hint::black_box(bytes);
    store.close()?;
    Ok(BareReplay {
        objects,
        time,
        cpu,
        lost: report.lost_keys,
        corrupt: report.corrupt_entries,
    })
}
