//! Tablet splits on a server: its part as the master of a tablet the map splits (the protocol is
//! [`ramlog_cluster::TabletInfo::split`]'s; docs/architecture.md "Splits").
//!
//! 1. From the map that says the tablet splits at slot `at`, this server copies the objects of
//!    the slots `at..` into a new engine tablet while it goes on serving them; the engine notes
//!    the keys written meanwhile ([`ramlog_logmem::Engine::split_prepare`]). It reports
//!    `SplitReady`.
//! 2. From the map that says the split is ready, the front ends answer its requests TRYAGAIN
//!    (the routing port holds them), as in a move's switch. This server freezes the engine
//!    tablet (every write it took is in the replication streams from then on), waits until
//!    every backup acknowledged every unit ([`super::replication::Replication::drain`]), redoes
//!    the noted writes in the copy and routes the upper slots to it
//!    ([`ramlog_logmem::Engine::split_finish`]), and reports `SplitDone`.
//! 3. The map that completes the split names both halves at the next epoch: before it is
//!    served, both engine tablets take writes again ([`before_serve`]); their copies to the
//!    backups start as after any change of epoch, and the copied objects leave the old engine
//!    tablet in the background.
//!
//! If the copy fails (no memory room), or the streams do not drain within
//! [`super::migration::DRAIN_MAX`], it reports `SplitAbort`, gives the copy up and serves the
//! tablet whole again once the map says so.
//!
//! Merges ([`ramlog_cluster::TabletInfo::merge`]) take the same steps the other way: the next
//! tablet is copied into the tablet before it while both serve (`Engine::merge_prepare`,
//! `MergeReady`); both are frozen, drained and joined (`Engine::merge_finish`, `MergeDone`); the
//! joined tablet serves at the next epoch and the next tablet's engine tablet is emptied.

use crate::cluster::migration::{report, spawn, DRAIN_MAX};
use crate::cluster::Member;
use crate::node::Node;
use ramlog_cluster::rpc::Request;
use ramlog_cluster::{ClusterMap, ServerId, TabletInfo, DEFAULT_TABLE};
use ramlog_common::TableId;
use ramlog_logmem::SplitCopy;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// A split under way here: (table, first slot, epoch) of the whole tablet.
type Key = (TableId, u16, u64);

/// The splits this server runs as master.
#[derive(Default)]
pub struct Splits {
    /// Splits whose copy was started (step 1), and those whose last step was (step 2).
    copying: parking_lot::Mutex<HashSet<Key>>,
    finishing: parking_lot::Mutex<HashSet<Key>>,
    /// Copies made, waiting for the last step (or to be given up).
    copies: parking_lot::Mutex<HashMap<Key, SplitCopy>>,
    /// Frozen for the last step, with the slot the split is at.
    frozen: parking_lot::Mutex<HashMap<Key, u16>>,
    /// Merges (keyed by the lower tablet) whose copy was started, whose last step was, whose
    /// copy is made (the upper tablet's engine id), and that are frozen (the upper tablet's
    /// first slot and engine id).
    merge_copying: parking_lot::Mutex<HashSet<Key>>,
    merge_finishing: parking_lot::Mutex<HashSet<Key>>,
    merge_copies: parking_lot::Mutex<HashMap<Key, ramlog_logmem::TabletId>>,
    merge_frozen: parking_lot::Mutex<HashMap<Key, (u16, ramlog_logmem::TabletId)>>,
}

impl Splits {
    /// Tablets splitting or merging here now (copying or frozen), for `/status`.
    pub fn count(&self) -> usize {
        self.copying.lock().len() + self.merge_copying.lock().len()
    }
}

/// True if `map` still merges the tablet `k` (the lower one) on this server.
fn merging(map: &ClusterMap, k: &Key, me: ServerId) -> bool {
    let (table, first_slot, epoch) = *k;
    map.tablet_at(table, first_slot).is_some_and(|t| {
        t.first_slot == first_slot && t.epoch == epoch && t.master == me && t.merge.is_some()
    })
}

/// True while the newest map still merges `t` at its epoch, in the step `ready` names.
fn still_merging(member: &Member, t: &TabletInfo, ready: bool) -> bool {
    let view = member.view();
    view.map.tablet_at(t.table, t.first_slot).is_some_and(|x| {
        x.first_slot == t.first_slot
            && x.epoch == t.epoch
            && x.merge == t.merge
            && x.merge_ready == ready
    })
}

fn key(t: &TabletInfo) -> Key {
    (t.table, t.first_slot, t.epoch)
}

/// True while the newest map still splits `t` at its epoch, in the step `ready` names.
fn still(member: &Member, t: &TabletInfo, ready: bool) -> bool {
    let view = member.view();
    view.map.tablet_at(t.table, t.first_slot).is_some_and(|x| {
        x.first_slot == t.first_slot
            && x.epoch == t.epoch
            && x.split == t.split
            && x.split_ready == ready
    })
}

/// True if `map` still splits the tablet `k` on this server.
fn splitting(map: &ClusterMap, k: &Key, me: ServerId) -> bool {
    let (table, first_slot, epoch) = *k;
    map.tablet_at(table, first_slot).is_some_and(|t| {
        t.first_slot == first_slot && t.epoch == epoch && t.master == me && t.split.is_some()
    })
}

/// Before a map is served (its replication routes are in place): the splits it ends, done or
/// abandoned, take writes again in both halves.
pub fn before_serve(node: &Node, member: &Member, map: &ClusterMap, me: ServerId) {
    let engine = node.engine();
    let ended: Vec<(Key, u16)> = member
        .splits
        .frozen
        .lock()
        .iter()
        .filter(|(k, _)| !splitting(map, k, me))
        .map(|(k, at)| (*k, *at))
        .collect();
    for ((table, first_slot, epoch), at) in ended {
        member
            .splits
            .frozen
            .lock()
            .remove(&(table, first_slot, epoch));
        let done = map
            .tablet_at(table, at)
            .is_some_and(|t| t.first_slot == at && t.master == me);
        for first in [first_slot, at] {
            if let Some(id) = member.created_tablet(table, first) {
                let _ = engine.set_frozen(id, false);
            }
        }
        if done {
            tracing::warn!(table, first_slot, at, "tablet split: both halves serve");
            if let Some(old) = member.created_tablet(table, first_slot) {
                let engine = engine.clone();
                spawn(
                    format!("split-clean-{table}-{first_slot}"),
                    move || match engine.split_cleanup(old) {
                        Ok(n) => tracing::info!(
                            table,
                            first_slot,
                            objects = n,
                            "split copies left the old tablet"
                        ),
                        Err(e) => {
                            tracing::error!(table, first_slot, error = %e, "cannot empty a split's copies from the old tablet")
                        }
                    },
                );
            }
        } else {
            tracing::warn!(
                table,
                first_slot,
                at,
                "tablet split ended without a split: serving it whole"
            );
        }
    }
    let merged: Vec<(Key, (u16, ramlog_logmem::TabletId))> = member
        .splits
        .merge_frozen
        .lock()
        .iter()
        .filter(|(k, _)| !merging(map, k, me))
        .map(|(k, v)| (*k, *v))
        .collect();
    for ((table, first_slot, epoch), (upper_first, upper)) in merged {
        member
            .splits
            .merge_frozen
            .lock()
            .remove(&(table, first_slot, epoch));
        let done = map.tablet_at(table, first_slot).is_some_and(|t| {
            t.first_slot == first_slot && t.master == me && t.last_slot >= upper_first
        });
        if let Some(lower) = member.created_tablet(table, first_slot) {
            let _ = engine.set_frozen(lower, false);
        }
        let _ = engine.set_frozen(upper, false);
        if done {
            member.forget_tablet(table, upper_first);
            tracing::warn!(
                table,
                first_slot,
                upper_first,
                "tablets merged: one serves both ranges"
            );
            let engine = engine.clone();
            spawn(
                format!("merge-clean-{table}-{upper_first}"),
                move || match engine.clear_tablet(upper) {
                    Ok(n) => tracing::info!(
                        table,
                        upper_first,
                        objects = n,
                        "a merged tablet's old copy emptied"
                    ),
                    Err(e) => {
                        tracing::error!(table, upper_first, error = %e, "cannot empty a merged tablet's old copy")
                    }
                },
            );
        } else if member
            .created_tablet(table, first_slot)
            .and_then(|lower| engine.tablets().into_iter().find(|t| t.id == lower))
            .is_some_and(|t| t.last_slot >= upper_first)
        {
            // Only a map that declared this server dead ends a merge after its last step (its
            // tablets are refused in every other case): it serves none of them any more.
            tracing::error!(
                table,
                first_slot,
                upper_first,
                "the map ended a merge this server had made in memory; its tablets recover elsewhere"
            );
        } else {
            tracing::warn!(
                table,
                first_slot,
                "tablet merge ended without a merge: both serve"
            );
        }
    }
    let mut copying = member.splits.copying.lock();
    let mut finishing = member.splits.finishing.lock();
    copying.retain(|k| splitting(map, k, me));
    finishing.retain(|k| splitting(map, k, me));
    member
        .splits
        .merge_copying
        .lock()
        .retain(|k| merging(map, k, me));
    member
        .splits
        .merge_finishing
        .lock()
        .retain(|k| merging(map, k, me));
}

/// Gives up the copies of splits `map` no longer asks for (abandoned, or the tablet moved on).
fn give_up_copies(node: &Node, member: &Member, map: &ClusterMap, me: ServerId) {
    let gone: Vec<(Key, SplitCopy)> = member
        .splits
        .copies
        .lock()
        .iter()
        .filter(|(k, _)| !splitting(map, k, me))
        .map(|(k, c)| (*k, *c))
        .collect();
    for (k, copy) in gone {
        if member.splits.copies.lock().remove(&k).is_some() {
            node.engine().split_cancel(&copy);
            tracing::warn!(
                table = k.0,
                first_slot = k.1,
                "tablet split given up: its copy is emptied"
            );
        }
    }
    let gone: Vec<(Key, ramlog_logmem::TabletId)> = member
        .splits
        .merge_copies
        .lock()
        .iter()
        .filter(|(k, _)| !merging(map, k, me))
        .map(|(k, u)| (*k, *u))
        .collect();
    for (k, upper) in gone {
        if member.splits.merge_copies.lock().remove(&k).is_some() {
            if let Some(lower) = member.created_tablet(k.0, k.1) {
                let _ = node.engine().merge_cancel(lower, upper);
            }
            tracing::warn!(
                table = k.0,
                first_slot = k.1,
                "tablet merge given up: its copy is removed"
            );
        }
    }
}

/// After a map is served: gives up the copies of splits it ends, and starts the steps of the
/// splits it asks of this server.
pub fn apply(node: &Arc<Node>, member: &Arc<Member>, map: &ClusterMap, me: ServerId) {
    give_up_copies(node, member, map, me);
    for t in &map.tablets {
        if t.merge.is_none() || t.master != me || t.recovering {
            continue;
        }
        let Some(upper) = map.next_tablet(t).cloned() else {
            continue;
        };
        let (node, member, t) = (node.clone(), member.clone(), t.clone());
        if !t.merge_ready {
            if member.splits.merge_copying.lock().insert(key(&t)) {
                spawn(
                    format!("merge-copy-{}-{}", t.table, t.first_slot),
                    move || merge_copy(&node, &member, &t, &upper),
                );
            }
        } else if member.splits.merge_finishing.lock().insert(key(&t)) {
            spawn(format!("merge-{}-{}", t.table, t.first_slot), move || {
                merge_finish(&node, &member, &t, &upper)
            });
        }
    }
    for t in &map.tablets {
        let Some(at) = t.split else {
            continue;
        };
        if t.master != me || t.recovering {
            continue;
        }
        let (node, member, t) = (node.clone(), member.clone(), t.clone());
        if !t.split_ready {
            if member.splits.copying.lock().insert(key(&t)) {
                spawn(
                    format!("split-copy-{}-{}", t.table, t.first_slot),
                    move || copy(&node, &member, &t, at),
                );
            }
        } else if member.splits.finishing.lock().insert(key(&t)) {
            // A server that restarted between the steps has no copy: it gives the split up.
            spawn(format!("split-{}-{}", t.table, t.first_slot), move || {
                finish(&node, &member, &t, at)
            });
        }
    }
}

fn abort(member: &Member, t: &TabletInfo, reason: String) -> Request {
    tracing::error!(table = t.table, first_slot = t.first_slot, %reason, "giving the split up");
    Request::SplitAbort {
        server: member.view().me,
        table: t.table,
        first_slot: t.first_slot,
        epoch: t.epoch,
        reason,
    }
}

/// Step 1: copies the upper slots while the tablet serves, then reports.
fn copy(node: &Arc<Node>, member: &Arc<Member>, t: &TabletInfo, at: u16) {
    let Some(engine_tablet) = member.created_tablet(t.table, t.first_slot) else {
        return;
    };
    let started = Instant::now();
    let made = if t.table == DEFAULT_TABLE {
        node.keyspace.split_prepare(engine_tablet, at)
    } else {
        node.engine().split_prepare(engine_tablet, at)
    };
    let request = match made {
        Ok(copy) => {
            tracing::warn!(
                table = t.table,
                first_slot = t.first_slot,
                at,
                objects = copy.objects,
                millis = started.elapsed().as_millis() as u64,
                "split: upper slots copied while serving; reporting"
            );
            member.splits.copies.lock().insert(key(t), copy);
            // A map that ended the split while the copy was made found no copy to give up.
            let view = member.view();
            give_up_copies(node, member, &view.map, view.me);
            Request::SplitReady {
                server: member.view().me,
                table: t.table,
                first_slot: t.first_slot,
                epoch: t.epoch,
            }
        }
        Err(e) => abort(member, t, format!("cannot copy the upper slots: {e}")),
    };
    if let Err(e) = report(member, &request, || still(member, t, false)) {
        tracing::warn!(table = t.table, first_slot = t.first_slot, error = %e, "the split report did not reach the coordinator");
    }
    member.refresh_map_soon();
}

/// Step 2: freezes the tablet, drains its streams, ends the split in memory, reports.
fn finish(node: &Arc<Node>, member: &Arc<Member>, t: &TabletInfo, at: u16) {
    let Some(engine_tablet) = member.created_tablet(t.table, t.first_slot) else {
        return;
    };
    let engine = node.engine();
    let started = Instant::now();
    let result = (|| -> Result<(SplitCopy, u64, u128), String> {
        let copy = member
            .splits
            .copies
            .lock()
            .remove(&key(t))
            .ok_or("this server holds no copy of the upper slots (it restarted)")?;
        member.splits.frozen.lock().insert(key(t), at);
        let finished = engine
            .set_frozen(engine_tablet, true)
            .map_err(|e| format!("cannot freeze the tablet: {e}"))
            .and_then(|()| {
                member
                    .replication
                    .drain(engine_tablet, DRAIN_MAX, || still(member, t, true))
            })
            .and_then(|()| {
                let drained = started.elapsed().as_millis();
                let redone = if t.table == DEFAULT_TABLE {
                    node.keyspace.split_finish(&copy)
                } else {
                    engine.split_finish(&copy, &mut |_| {})
                };
                redone
                    .map(|n| (n, drained))
                    .map_err(|e| format!("cannot end the split in memory: {e}"))
            });
        match finished {
            Ok((redone, drained)) => Ok((copy, redone, drained)),
            Err(e) => {
                engine.split_cancel(&copy);
                Err(e)
            }
        }
    })();
    let request = match result {
        Ok((copy, redone, drained)) => {
            member.adopt_tablet(t.table, at, copy.new);
            tracing::warn!(
                table = t.table,
                first_slot = t.first_slot,
                at,
                redone,
                drain_ms = drained as u64,
                millis = started.elapsed().as_millis() as u64,
                "split: tablet frozen, drained and split here; reporting"
            );
            Request::SplitDone {
                server: member.view().me,
                table: t.table,
                first_slot: t.first_slot,
                at,
                epoch: t.epoch,
            }
        }
        Err(reason) => abort(member, t, reason),
    };
    if let Err(e) = report(member, &request, || still(member, t, true)) {
        tracing::warn!(table = t.table, first_slot = t.first_slot, error = %e, "the split report did not reach the coordinator");
    }
    member.refresh_map_soon();
}

fn merge_abort(member: &Member, t: &TabletInfo, reason: String) -> Request {
    tracing::error!(table = t.table, first_slot = t.first_slot, %reason, "giving the merge up");
    Request::MergeAbort {
        server: member.view().me,
        table: t.table,
        first_slot: t.first_slot,
        epoch: t.epoch,
        reason,
    }
}

/// A merge's step 1: copies the next tablet into `t` while both serve, then reports.
fn merge_copy(node: &Arc<Node>, member: &Arc<Member>, t: &TabletInfo, upper: &TabletInfo) {
    let (Some(lower_id), Some(upper_id)) = (
        member.created_tablet(t.table, t.first_slot),
        member.created_tablet(upper.table, upper.first_slot),
    ) else {
        return;
    };
    let started = Instant::now();
    let request = match node.engine().merge_prepare(lower_id, upper_id) {
        Ok(objects) => {
            tracing::warn!(
                table = t.table,
                first_slot = t.first_slot,
                objects,
                millis = started.elapsed().as_millis() as u64,
                "merge: next tablet copied while serving; reporting"
            );
            member.splits.merge_copies.lock().insert(key(t), upper_id);
            let view = member.view();
            give_up_copies(node, member, &view.map, view.me);
            Request::MergeReady {
                server: member.view().me,
                table: t.table,
                first_slot: t.first_slot,
                epoch: t.epoch,
            }
        }
        Err(e) => merge_abort(member, t, format!("cannot copy the next tablet: {e}")),
    };
    if let Err(e) = report(member, &request, || still_merging(member, t, false)) {
        tracing::warn!(table = t.table, first_slot = t.first_slot, error = %e, "the merge report did not reach the coordinator");
    }
    member.refresh_map_soon();
}

/// A merge's step 2: freezes both tablets, drains their streams, joins them, reports.
fn merge_finish(node: &Arc<Node>, member: &Arc<Member>, t: &TabletInfo, upper: &TabletInfo) {
    let Some(lower_id) = member.created_tablet(t.table, t.first_slot) else {
        return;
    };
    let engine = node.engine();
    let started = Instant::now();
    let result = (|| -> Result<u64, String> {
        let upper_id = member
            .splits
            .merge_copies
            .lock()
            .remove(&key(t))
            .ok_or("this server holds no copy of the next tablet (it restarted)")?;
        member
            .splits
            .merge_frozen
            .lock()
            .insert(key(t), (upper.first_slot, upper_id));
        let finished = (|| -> Result<u64, String> {
            for id in [lower_id, upper_id] {
                engine
                    .set_frozen(id, true)
                    .map_err(|e| format!("cannot freeze the tablets: {e}"))?;
            }
            for id in [lower_id, upper_id] {
                member
                    .replication
                    .drain(id, DRAIN_MAX, || still_merging(member, t, true))?;
            }
            let redone = if t.table == DEFAULT_TABLE {
                node.keyspace.merge_finish(lower_id, upper_id)
            } else {
                engine.merge_finish(lower_id, upper_id, &mut || {})
            };
            redone.map_err(|e| format!("cannot join the tablets in memory: {e}"))
        })();
        if finished.is_err() {
            let _ = engine.merge_cancel(lower_id, upper_id);
        }
        finished
    })();
    let request = match result {
        Ok(redone) => {
            // The upper tablet's engine tablet stays recorded until the map that joins the two
            // is served ([`before_serve`]): a map served before it still names the upper
            // tablet, and a tablet of a map with no engine tablet here is created afresh
            // (empty, its slots routed to it).
            tracing::warn!(
                table = t.table,
                first_slot = t.first_slot,
                redone,
                millis = started.elapsed().as_millis() as u64,
                "merge: tablets frozen, drained and joined here; reporting"
            );
            Request::MergeDone {
                server: member.view().me,
                table: t.table,
                first_slot: t.first_slot,
                epoch: t.epoch,
            }
        }
        Err(reason) => merge_abort(member, t, reason),
    };
    if let Err(e) = report(member, &request, || still_merging(member, t, true)) {
        tracing::warn!(table = t.table, first_slot = t.first_slot, error = %e, "the merge report did not reach the coordinator");
    }
    member.refresh_map_soon();
}
