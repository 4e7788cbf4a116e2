//! Mirrors (table mode `mirror`, Mojim's in-memory mirror): besides logging a tablet's stream
//! like any backup, the tablet's mirror applies every write to a copy of the tablet in its own
//! memory before it acknowledges the write. When the master dies, the mirror is the tablet's
//! restorer (it is its first backup with the whole stream), and its restore is instant: the
//! tablet is already in memory, so it only moves its clock and asks to become the master.
//!
//! A mirror starts when the map names this server the mirror of a tablet whose copy it holds
//! (it is not pending): it creates the engine tablet and builds it from its own backup logs
//! with the bulk restore a recovery uses (the same merged replay; each key once, no index lookup
//! per object). Units that arrive while it builds are queued, not applied (the bulk restore
//! installs without looking a key up, so nothing else may install into the tablet meanwhile);
//! once the logs are in, the queue is applied with `Engine::restore_batch`'s rule (the newer
//! version of a key wins, a delete included), under the phase lock, and from then on every unit
//! is applied as it arrives. The queue holds at most [`QUEUE_MAX_BYTES`] of entries: a unit that
//! would pass it waits (its backup connection with it) until the build ends.
//!
//! A unit the backup is taking when the mirror starts (or ends its clearing) may have found no
//! mirror to apply to and not be logged yet, so neither path would install it. The backup holds
//! the mirrors' unit gate shared from a unit's apply to its append, and the build takes it alone
//! once, after it starts applying live and before it reads the logs: every unit that was not
//! applied live is in the logs by then.
//!
//! The mirror's tablet counts against `--memory` like any tablet. The master waits for the
//! mirror's acknowledgement as `sync` waits for every backup's, so a mirrored table keeps
//! `sync`'s promise and gains a fail-over without replay.

use crate::node::figures::MirrorFigures;
use crate::node::Node;
use parking_lot::{Condvar, Mutex, RwLock, RwLockReadGuard};
use ramlog_cluster::{ClusterMap, MigrationPhase, ReplicationMode, ServerId};
use ramlog_common::TableId;
use ramlog_logmem::{Engine, RestoreItem, TabletId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Where a mirror's memory stands.
enum Phase {
    /// Emptying the engine tablet of what an earlier role of this process left in it; units
    /// that arrive meanwhile are only logged (the build replays them).
    Clearing,
    /// Replaying the logs into the tablet; units that arrive meanwhile wait in `queue`.
    Building {
        queue: Queue,
    },
    Ready,
    Failed(String),
}

/// Bytes of queued entries a building mirror holds at most (see the module comment).
pub const QUEUE_MAX_BYTES: usize = 32 << 20;

/// A replicated entry kept until the build ends.
struct Queued {
    key: Vec<u8>,
    value: Option<Vec<u8>>,
    version: u64,
    expiry: u64,
}

/// The units that arrived while a mirror builds, in arrival (version) order.
#[derive(Default)]
struct Queue {
    entries: Vec<Queued>,
    bytes: usize,
}

/// One tablet this server mirrors.
pub struct MirrorTablet {
    pub engine_tablet: TabletId,
    phase: Mutex<Phase>,
    /// The newest version applied to the tablet (from the logs while building, then from the
    /// stream, which comes in version order).
    applied: AtomicU64,
    settled: Condvar,
    started: Instant,
}

impl MirrorTablet {
    /// Waits until the build ends (at most `limit`): Ok once the memory holds the whole tablet.
    pub fn wait_ready(&self, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        let mut phase = self.phase.lock();
        loop {
            match &*phase {
                Phase::Ready => return Ok(()),
                Phase::Failed(e) => return Err(e.clone()),
                Phase::Clearing | Phase::Building { .. } => {
                    if self.settled.wait_until(&mut phase, deadline).timed_out() {
                        return Err("the mirror's memory is still being built".into());
                    }
                }
            }
        }
    }

    pub fn is_ready(&self) -> bool {
        matches!(*self.phase.lock(), Phase::Ready)
    }

    /// A snapshot for one scan of the mirrored tablet, once its memory is complete: at the
    /// newest version applied, taken while no unit is being applied (units apply under the
    /// phase lock), so the scan sees every write applied before and none after.
    pub fn scan_snapshot(&self, engine: &Engine) -> Result<ramlog_logmem::Snapshot, String> {
        let phase = self.phase.lock();
        if !matches!(*phase, Phase::Ready) {
            return Err("the mirror's memory is not complete yet".into());
        }
        engine
            .scan_snapshot_of_tablet_at(self.engine_tablet, self.applied.load(Ordering::Acquire))
            .map_err(|e| e.to_string())
    }
}

/// The tablets this server mirrors, by (table, first slot).
#[derive(Default)]
pub struct Mirrors {
    tablets: Mutex<HashMap<(TableId, u16), Arc<MirrorTablet>>>,
    /// How many: a backup that mirrors nothing skips the lookup per replicated unit.
    count: std::sync::atomic::AtomicUsize,
    /// Held shared by the backup from a unit's apply to its append, alone by a build before it
    /// reads the logs (see the module comment).
    units: Arc<RwLock<()>>,
}

impl Mirrors {
    /// Held while the backup applies units and appends them to its logs.
    pub fn unit_gate(&self) -> RwLockReadGuard<'_, ()> {
        self.units.read()
    }

    pub fn get(&self, table: TableId, first_slot: u16) -> Option<Arc<MirrorTablet>> {
        self.tablets.lock().get(&(table, first_slot)).cloned()
    }

    /// Stops mirroring (table, first slot): its restore took the tablet over, or the map moved
    /// the mirror elsewhere.
    pub fn remove(&self, table: TableId, first_slot: u16) -> Option<Arc<MirrorTablet>> {
        let mut tablets = self.tablets.lock();
        let removed = tablets.remove(&(table, first_slot));
        self.count.store(tablets.len(), Ordering::Release);
        removed
    }

    fn insert(&self, table: TableId, first_slot: u16, mirror: Arc<MirrorTablet>) {
        let mut tablets = self.tablets.lock();
        tablets.insert((table, first_slot), mirror);
        self.count.store(tablets.len(), Ordering::Release);
    }

    /// Where each mirrored tablet stands, for `/status`.
    pub fn figures(&self) -> Vec<MirrorFigures> {
        let mut v: Vec<MirrorFigures> = self
            .tablets
            .lock()
            .iter()
            .map(|(&(table, first_slot), m)| MirrorFigures {
                table,
                first_slot,
                state: match &*m.phase.lock() {
                    Phase::Clearing => "clearing".into(),
                    Phase::Building { .. } => "building".into(),
                    Phase::Ready => "ready".into(),
                    Phase::Failed(e) => format!("failed: {e}"),
                },
                millis: m.started.elapsed().as_millis() as u64,
            })
            .collect();
        v.sort_by_key(|f| (f.table, f.first_slot));
        v
    }

    /// (table, first slot, ready) of every mirrored tablet.
    pub fn list(&self) -> Vec<(TableId, u16, bool)> {
        let mut v: Vec<_> = self
            .tablets
            .lock()
            .iter()
            .map(|(k, m)| (k.0, k.1, m.is_ready()))
            .collect();
        v.sort();
        v
    }

    /// Applies one replicated unit to the mirrored tablet, if (table, first slot) is mirrored
    /// here; an error refuses the unit (before it is logged, so that a resend applies it).
    pub fn apply_unit(
        &self,
        node: &Node,
        table: TableId,
        first_slot: u16,
        entries: &[ramlog_proto::repl::ReplEntry<'_>],
    ) -> Result<(), String> {
        if self.count.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        let Some(mirror) = self.get(table, first_slot) else {
            return Ok(());
        };
        let engine = node.engine();
        let mut phase = mirror.phase.lock();
        let unit_bytes: usize = entries
            .iter()
            .map(|e| e.key.len() + e.value.map_or(0, <[u8]>::len) + 48)
            .sum();
        // A full queue: wait for the build to end (it applies the queue, then the live units).
        while let Phase::Building { queue } = &*phase {
            if queue.bytes == 0 || queue.bytes + unit_bytes <= QUEUE_MAX_BYTES {
                break;
            }
            mirror
                .settled
                .wait_for(&mut phase, Duration::from_millis(100));
        }
        match &mut *phase {
            Phase::Clearing => return Ok(()),
            Phase::Building { queue } => {
                queue.bytes += unit_bytes;
                queue.entries.extend(entries.iter().map(|e| Queued {
                    key: e.key.to_vec(),
                    value: e.value.map(<[u8]>::to_vec),
                    version: e.version,
                    expiry: e.expiry,
                }));
                return Ok(());
            }
            Phase::Ready | Phase::Failed(_) => {}
        }
        // The unit goes in as one batch (one lock hold per group of entries, their index
        // buckets prefetched ahead).
        let items: Vec<RestoreItem<'_>> = entries
            .iter()
            .map(|e| RestoreItem {
                key: e.key,
                value: e.value,
                version: e.version,
                expire_at_ms: e.expiry,
            })
            .collect();
        engine
            .restore_batch(mirror.engine_tablet, &items)
            .map_err(|err| format!("the mirror cannot apply the write: {err}"))?;
        if let Some(newest) = entries.iter().map(|e| e.version).max() {
            mirror.applied.fetch_max(newest, Ordering::AcqRel);
        }
        Ok(())
    }
}

/// Whether the map makes `me` the mirror of `t` with the whole stream in its logs: the mirror
/// of a `mirror` table, or the target of the tablet's migration once its copy is complete (it
/// builds the tablet in memory the same way before it takes it over).
fn mirrors_here(map: &ClusterMap, t: &ramlog_cluster::TabletInfo, me: ServerId) -> bool {
    let mirrored = map
        .table(t.table)
        .is_some_and(|table| table.mode == ReplicationMode::Mirror);
    let moving_here = t
        .migration
        .is_some_and(|m| m.target == me && m.phase >= MigrationPhase::Building);
    ((mirrored && t.mirror == Some(me)) || moving_here)
        && !t.recovering
        && t.master != me
        && !t.pending.contains(&me)
}

/// Starts the mirrors `map` asks of this server and stops those it no longer does.
pub fn apply(
    node: &Arc<Node>,
    member: &Arc<crate::cluster::Member>,
    map: &ClusterMap,
    me: ServerId,
) {
    let mirrors = &member.mirrors;
    // Stopped: a mirror promoted to master keeps its tablet (the restore took it over); one
    // the map moved elsewhere keeps its memory until the server restarts (the engine cannot
    // drop a tablet), and is no longer written to.
    let wanted: Vec<(TableId, u16)> = map
        .tablets
        .iter()
        .filter(|t| mirrors_here(map, t, me) || (t.recovering && t.restorer == Some(me)))
        .map(|t| (t.table, t.first_slot))
        .collect();
    for (table, first_slot, _) in mirrors.list() {
        if !wanted.contains(&(table, first_slot)) {
            mirrors.remove(table, first_slot);
            tracing::info!(table, first_slot, "no longer the mirror of this tablet");
        }
    }
    for t in map.tablets.iter().filter(|t| mirrors_here(map, t, me)) {
        if mirrors.get(t.table, t.first_slot).is_some() {
            continue;
        }
        // Memory of this tablet from an earlier role may hold what was deleted since: emptied
        // first.
        let held_before = member.created_tablet(t.table, t.first_slot).is_some();
        let engine_tablet = match member.engine_tablet(node, t) {
            Ok(id) => id,
            Err(e) => {
                tracing::error!(table = t.table, first_slot = t.first_slot, error = %e, "cannot create the mirror's tablet");
                continue;
            }
        };
        node.keyspace.set_hidden(engine_tablet, true);
        let mirror = Arc::new(MirrorTablet {
            engine_tablet,
            applied: AtomicU64::new(0),
            phase: Mutex::new(if held_before {
                Phase::Clearing
            } else {
                Phase::Building {
                    queue: Queue::default(),
                }
            }),
            settled: Condvar::new(),
            started: Instant::now(),
        });
        mirrors.insert(t.table, t.first_slot, mirror.clone());
        let node = node.clone();
        let backup = member.backup.clone();
        let gate = mirrors.units.clone();
        let t = t.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("mirror-{}-{}", t.table, t.first_slot))
            .spawn(move || build(&node, &backup, &gate, &mirror, &t));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a mirror build");
        }
    }
}

/// Applies the entries queued while the mirror was built (the newer version of each key wins).
fn apply_queued(engine: &Engine, mirror: &MirrorTablet, queued: &[Queued]) -> Result<(), String> {
    for part in queued.chunks(1024) {
        let items: Vec<RestoreItem<'_>> = part
            .iter()
            .map(|e| RestoreItem {
                key: &e.key,
                value: e.value.as_deref(),
                version: e.version,
                expire_at_ms: e.expiry,
            })
            .collect();
        engine
            .restore_batch(mirror.engine_tablet, &items)
            .map_err(|err| {
                format!("the mirror cannot apply the writes queued while it was built: {err}")
            })?;
        if let Some(newest) = part.iter().map(|e| e.version).max() {
            mirror.applied.fetch_max(newest, Ordering::AcqRel);
        }
    }
    Ok(())
}

/// Deletes every object of `tablet` (a delete leaves no entry in the index, so the versions the
/// build installs afterwards are taken whatever they are).
fn clear(engine: &ramlog_logmem::Engine, tablet: TabletId) -> Result<(), String> {
    let mut cursor = 0u64;
    let mut keys = Vec::new();
    loop {
        keys.clear();
        cursor = engine
            .scan_keys(tablet, cursor, 512, &mut keys)
            .map_err(|e| format!("reading the tablet to empty it: {e}"))?;
        for key in &keys {
            engine
                .delete(tablet, key, ramlog_logmem::Condition::None)
                .map_err(|e| format!("emptying the tablet: {e}"))?;
        }
        if cursor == 0 {
            return Ok(());
        }
    }
}

/// Builds the mirror's memory from this server's backup logs of the tablet's current epoch with
/// the bulk restore, then applies the units queued meanwhile. `gate` is the mirrors' unit gate:
/// taken alone once the phase queues units, so that every unit taken before is in the logs the
/// replay reads.
fn build(
    node: &Node,
    backup: &crate::cluster::backup::BackupService,
    gate: &RwLock<()>,
    mirror: &MirrorTablet,
    t: &ramlog_cluster::TabletInfo,
) {
    let (table, first_slot) = (t.table, t.first_slot);
    let engine = node.engine();
    let result = (|| -> Result<u64, String> {
        if matches!(*mirror.phase.lock(), Phase::Clearing) {
            clear(engine, mirror.engine_tablet)?;
            *mirror.phase.lock() = Phase::Building {
                queue: Queue::default(),
            };
        }
        drop(gate.write());
        let mut sink = super::bulk_sink::BulkSink::new(engine, mirror.engine_tablet);
        let (mut objects, mut newest) = (0u64, 0u64);
        // The map names a mirror, or lets a migration's target build, only once it is not a
        // pending backup: it holds the tablet's whole copy at the current epoch, since every
        // epoch change (a recovery, a switch, a split, a merge) makes every backup take the
        // new master's copy at the new epoch. Older epochs' logs, which the collector drops once
        // that copy is complete, may hold keys deleted before it (a copy carries no deletes),
        // and are not read: a build just before the drop brought such keys back.
        let epochs = t.epoch..t.epoch + 1;
        let report = backup
            .replay_epochs(t, epochs, |r| match r {
                ramlog_backup::Replayed::Count(n) => sink.start(n),
                ramlog_backup::Replayed::Entry(e) => {
                    if sink.push(&e) {
                        objects += 1;
                        newest = newest.max(e.version);
                    }
                }
            })
            .map_err(|e| format!("replaying the backup logs: {e}"))?;
        sink.finish()
            .map_err(|e| format!("building the mirror in memory: {e}"))?;
        mirror.applied.fetch_max(newest, Ordering::AcqRel);
        // A copy built from damaged logs may lack keys or hold older values: it is not taken
        // (a move is given up and its source keeps serving; a mirror is not offered).
        if !report.is_clean() {
            return Err(format!(
                "the backup logs of the tablet are damaged: {} corrupt entries, {} unreadable bytes, {} lost keys, {} damaged version-log bytes",
                report.corrupt_entries,
                report.unreadable_bytes,
                report.lost_keys,
                report.damaged_version_bytes
            ));
        }
        Ok(objects)
    })();
    let mut phase = mirror.phase.lock();
    // The units queued meanwhile go in now, under the phase lock: the next unit is applied
    // live, after them.
    let result = result.and_then(|objects| {
        if let Phase::Building { queue } = &mut *phase {
            let queued = std::mem::take(queue);
            apply_queued(engine, mirror, &queued.entries)?;
        }
        Ok(objects)
    });
    match result {
        Ok(objects) => {
            tracing::warn!(
                table,
                first_slot,
                objects,
                millis = mirror.started.elapsed().as_millis() as u64,
                "mirror in memory"
            );
            *phase = Phase::Ready;
        }
        Err(e) => {
            tracing::error!(table, first_slot, error = %e, "the mirror could not be built");
            *phase = Phase::Failed(e);
        }
    }
    mirror.settled.notify_all();
}
