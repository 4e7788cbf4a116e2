//! Tablet migration on a server: its part as a move's target and as its source (the protocol is
//! [`ramlog_cluster::Migration`]'s; docs/architecture.md "Migration").
//!
//! - **Target.** While `Copying`, it is a pending backup like any other (the master's copy and
//!   live stream fill its logs). From `Building` on, it builds the tablet in its memory from
//!   those logs and applies live writes as they arrive, as a mirror does ([`super::mirror`]);
//!   once the memory is complete it reports `MigrationReady`. When a map makes it the master,
//!   [`take_over`] (run before that map's view serves anything) moves its clock above every
//!   version the source handed out and shows the tablet.
//! - **Source.** At `Switching` it freezes the engine tablet (every write is refused from then
//!   on, and every write taken before is in the replication streams: both happen under the
//!   tablet's write lock), waits until every backup and the target acknowledged every unit
//!   ([`super::replication::Replication::drain`]), and reports `MigrationSwitch`; the
//!   coordinator makes the target the master at the next epoch. The source's front ends answer
//!   TRYAGAIN for the tablet from the map that says `Switching` (the routing port holds such
//!   requests until the switch), so clients see a pause, not an error. If the drain does not
//!   finish within [`DRAIN_MAX`] it reports `MigrationAbort` and serves again once the map says
//!   so. After the switch it empties its copy of the tablet.

use crate::cluster::Member;
use crate::node::Node;
use ramlog_cluster::rpc::{Request, Response};
use ramlog_cluster::{ClusterMap, MigrationPhase, ServerId, TabletInfo};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The longest a source waits for its backups and the target to acknowledge the tablet's last
/// writes before it gives the move up.
pub const DRAIN_MAX: Duration = Duration::from_secs(5);
/// The longest a target waits for its memory of the tablet to be built before it gives up.
const BUILD_MAX: Duration = Duration::from_secs(600);

type Key = (u64, u16, u64);

/// What this server does for migrations now.
#[derive(Default)]
pub struct Migrations {
    /// Ready reports under way or sent, per (table, first slot, epoch).
    reporting: parking_lot::Mutex<HashSet<Key>>,
    /// Tablets this server froze as a source: (table, first slot, epoch).
    frozen: parking_lot::Mutex<HashSet<Key>>,
}

impl Migrations {
    /// Tablets frozen for a switch now, for `/status`.
    pub fn frozen_count(&self) -> usize {
        self.frozen.lock().len()
    }
}

fn key(t: &TabletInfo) -> Key {
    (t.table, t.first_slot, t.epoch)
}

/// Before a map is served: the tablets it makes this server master of that it held as a
/// migration's target. Their memory is complete (the target reported it, and the source's
/// drain made sure of every write since); the clock goes above every version the source gave
/// out, and the tablet is shown to SCAN, KEYS and DBSIZE.
pub fn take_over(node: &Node, member: &Member, map: &ClusterMap, me: ServerId) {
    let before = member.view();
    for t in map
        .tablets
        .iter()
        .filter(|t| t.master == me && !t.recovering)
    {
        let was_target = before
            .map
            .tablet_at(t.table, t.first_slot)
            .is_some_and(|old| {
                old.master != me && !old.recovering && old.first_slot == t.first_slot
            });
        if !was_target {
            continue;
        }
        let Some(mirror) = member.mirrors.get(t.table, t.first_slot) else {
            continue;
        };
        let engine = node.engine();
        let floor = member
            .backup
            .max_version_seen()
            .max(engine.clock())
            .saturating_add(crate::cluster::recovery::VERSION_GAP);
        engine.advance_clock(floor);
        node.keyspace.set_hidden(mirror.engine_tablet, false);
        member.mirrors.remove(t.table, t.first_slot);
        tracing::warn!(
            table = t.table,
            first_slot = t.first_slot,
            epoch = t.epoch,
            "tablet moved here: serving it"
        );
    }
}

/// After a map is served: the target's ready report, the source's freeze and switch report,
/// and the source's cleanup once the tablet is the target's.
pub fn apply(node: &Arc<Node>, member: &Arc<Member>, map: &ClusterMap, me: ServerId) {
    for t in &map.tablets {
        let Some(m) = t.migration else {
            continue;
        };
        if m.target == me
            && m.phase == MigrationPhase::Building
            && member.migrations.reporting.lock().insert(key(t))
        {
            let (member, t) = (member.clone(), t.clone());
            spawn(format!("move-in-{}-{}", t.table, t.first_slot), move || {
                report_ready(&member, &t)
            });
        }
        if t.master == me
            && m.phase == MigrationPhase::Switching
            && !t.recovering
            && member.migrations.frozen.lock().insert(key(t))
        {
            let (node, member, t) = (node.clone(), member.clone(), t.clone());
            spawn(
                format!("move-out-{}-{}", t.table, t.first_slot),
                move || switch(&node, &member, &t),
            );
        }
    }
    // Frozen tablets the map has moved on from: switched (empty and hide the copy here), or
    // abandoned (serve again).
    let frozen: Vec<Key> = member.migrations.frozen.lock().iter().copied().collect();
    for k in frozen {
        let (table, first_slot, epoch) = k;
        let now = map
            .tablet_at(table, first_slot)
            .filter(|t| t.first_slot == first_slot);
        let still = now.is_some_and(|t| {
            t.epoch == epoch
                && t.master == me
                && t.migration
                    .is_some_and(|m| m.phase == MigrationPhase::Switching)
        });
        if still {
            continue;
        }
        member.migrations.frozen.lock().remove(&k);
        let Some(engine_tablet) = member.created_tablet(table, first_slot) else {
            continue;
        };
        let moved = now.is_none_or(|t| t.master != me);
        let engine = node.engine().clone();
        if moved {
            node.keyspace.set_hidden(engine_tablet, true);
            spawn(format!("moved-{table}-{first_slot}"), move || {
                match engine.clear_tablet(engine_tablet) {
                    Ok(n) => {
                        tracing::info!(table, first_slot, objects = n, "moved tablet emptied here")
                    }
                    Err(e) => {
                        tracing::error!(table, first_slot, error = %e, "cannot empty a moved tablet")
                    }
                }
                let _ = engine.set_frozen(engine_tablet, false);
            });
        } else {
            let _ = engine.set_frozen(engine_tablet, false);
            tracing::warn!(table, first_slot, "tablet move abandoned: serving it again");
        }
    }
    member
        .migrations
        .reporting
        .lock()
        .retain(|&(table, first_slot, epoch)| {
            map.tablet_at(table, first_slot)
                .is_some_and(|t| t.epoch == epoch && t.migration.is_some_and(|m| m.target == me))
        });
}

pub(crate) fn spawn(name: String, f: impl FnOnce() + Send + 'static) {
    if let Err(e) = std::thread::Builder::new().name(name).spawn(f) {
        tracing::error!(error = %e, "cannot start a migration thread");
    }
}

/// True while the newest map still has `t`'s migration to this server in `phase` at its epoch.
fn still(member: &Member, t: &TabletInfo, phase: MigrationPhase) -> bool {
    let view = member.view();
    view.map.tablet_at(t.table, t.first_slot).is_some_and(|x| {
        x.first_slot == t.first_slot
            && x.epoch == t.epoch
            && x.migration.is_some_and(|m| m.phase == phase)
    })
}

/// The target: once its memory of the tablet is complete, says so.
fn report_ready(member: &Arc<Member>, t: &TabletInfo) {
    let me = member.view().me;
    let started = Instant::now();
    let built = loop {
        if !still(member, t, MigrationPhase::Building) {
            return;
        }
        match member.mirrors.get(t.table, t.first_slot) {
            Some(mirror) => match mirror.wait_ready(Duration::from_millis(200)) {
                Ok(()) => break Ok(()),
                Err(e) if e.contains("still being built") && started.elapsed() < BUILD_MAX => {}
                Err(e) => break Err(e),
            },
            None if started.elapsed() < BUILD_MAX => std::thread::sleep(Duration::from_millis(20)),
            None => break Err("the tablet's memory was never started here".into()),
        }
    };
    let request = match built {
        Ok(()) => {
            tracing::warn!(
                table = t.table,
                first_slot = t.first_slot,
                millis = started.elapsed().as_millis() as u64,
                "moving tablet in memory here; telling the coordinator"
            );
            Request::MigrationReady {
                server: me,
                table: t.table,
                first_slot: t.first_slot,
                epoch: t.epoch,
            }
        }
        Err(reason) => {
            tracing::error!(table = t.table, first_slot = t.first_slot, %reason, "cannot take the moving tablet");
            Request::MigrationAbort {
                server: me,
                table: t.table,
                first_slot: t.first_slot,
                epoch: t.epoch,
                reason: format!("the target could not build the tablet: {reason}"),
            }
        }
    };
    let _ = report(member, &request, || {
        still(member, t, MigrationPhase::Building)
    });
}

/// The source: freezes the tablet, drains its streams, reports the switch (or gives up).
fn switch(node: &Arc<Node>, member: &Arc<Member>, t: &TabletInfo) {
    let me = member.view().me;
    let Some(engine_tablet) = member.created_tablet(t.table, t.first_slot) else {
        return;
    };
    let started = Instant::now();
    let frozen = node.engine().set_frozen(engine_tablet, true);
    let drained = frozen
        .map_err(|e| format!("cannot freeze the tablet: {e}"))
        .and_then(|()| {
            member.replication.drain(engine_tablet, DRAIN_MAX, || {
                still(member, t, MigrationPhase::Switching)
            })
        });
    let request = match drained {
        Ok(()) => {
            tracing::warn!(
                table = t.table,
                first_slot = t.first_slot,
                millis = started.elapsed().as_millis() as u64,
                "moving tablet frozen and drained here; the target takes it"
            );
            Request::MigrationSwitch {
                server: me,
                table: t.table,
                first_slot: t.first_slot,
                epoch: t.epoch,
            }
        }
        Err(reason) => {
            tracing::error!(table = t.table, first_slot = t.first_slot, %reason, "giving the move up");
            Request::MigrationAbort {
                server: me,
                table: t.table,
                first_slot: t.first_slot,
                epoch: t.epoch,
                reason,
            }
        }
    };
    if let Err(e) = report(member, &request, || {
        still(member, t, MigrationPhase::Switching)
    }) {
        tracing::warn!(table = t.table, first_slot = t.first_slot, error = %e, "the switch report did not reach the coordinator");
    }
    // A map soon says how it ended; this server asks for it at once rather than at its next
    // heartbeat, so the pause clients see is short.
    member.refresh_map_soon();
}

/// Sends `request` until the coordinator takes it, while `still` says the map still has the
/// step it reports under way.
pub(crate) fn report(
    member: &Arc<Member>,
    request: &Request,
    still: impl Fn() -> bool,
) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime to report: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if !still() {
            return Err("the map moved on".into());
        }
        let client = ramlog_cluster::rpc::CoordinatorClient::new(
            member.coordinator().addresses().to_vec(),
            Duration::from_secs(3),
        );
        match runtime.block_on(async { client.call(request).await }) {
            Ok(Response::Noted) => return Ok(()),
            Ok(other) => return Err(format!("unexpected answer {other:?}")),
            Err(e) if Instant::now() > deadline => return Err(e.to_string()),
            Err(e) => {
                tracing::warn!(error = %e, "reporting a migration step failed; retrying");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}
