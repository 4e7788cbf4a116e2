//! Tablet splits on a server: its part as the master of a tablet the map splits (the protocol is
//! [`ramlog_cluster::TabletInfo::split`]'s; docs/architecture.md "Splits").
//!
//! From the map that says the tablet splits at slot `at`, the front ends answer its requests
//! TRYAGAIN (the routing port holds them), as in a move's switch. This server then freezes the
//! engine tablet (every write it took is in the replication streams from then on), waits until
//! every backup acknowledged every unit ([`super::replication::Replication::drain`]), splits
//! the engine tablet (the upper slots' objects go to a new tablet, with their versions), and
//! reports `SplitDone`. The map that completes the split names both halves at the next epoch:
//! before it is served, both engine tablets take writes again ([`before_serve`]), and their
//! copies to the backups start as after any change of epoch. If the streams do not drain within
//! [`super::migration::DRAIN_MAX`], or the memory has no room for the copy, it reports
//! `SplitAbort` and serves the tablet whole again once the map says so.

use crate::cluster::migration::{report, spawn, DRAIN_MAX};
use crate::cluster::Member;
use crate::node::Node;
use ramlog_cluster::rpc::Request;
use ramlog_cluster::{ClusterMap, ServerId, TabletInfo};
use ramlog_common::TableId;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// A split under way here: (table, first slot, epoch) of the whole tablet.
type Key = (TableId, u16, u64);

/// The splits this server runs as master.
#[derive(Default)]
pub struct Splits {
    /// Frozen for a split, with the slot it splits at.
    frozen: parking_lot::Mutex<HashMap<Key, u16>>,
}

impl Splits {
    /// Tablets frozen for a split now, for `/status`.
    pub fn frozen_count(&self) -> usize {
        self.frozen.lock().len()
    }
}

/// True while the newest map still splits `t` at its epoch.
fn still(member: &Member, t: &TabletInfo) -> bool {
    let view = member.view();
    view.map
        .tablet_at(t.table, t.first_slot)
        .is_some_and(|x| x.first_slot == t.first_slot && x.epoch == t.epoch && x.split == t.split)
}

/// Before a map is served (its replication routes are in place): the splits it ends, done or
/// abandoned, take writes again in both halves.
pub fn before_serve(node: &Node, member: &Member, map: &ClusterMap, me: ServerId) {
    let ended: Vec<(Key, u16)> = member
        .splits
        .frozen
        .lock()
        .iter()
        .filter(|((table, first_slot, epoch), _)| {
            !map.tablet_at(*table, *first_slot).is_some_and(|t| {
                t.first_slot == *first_slot
                    && t.epoch == *epoch
                    && t.master == me
                    && t.split.is_some()
            })
        })
        .map(|(k, at)| (*k, *at))
        .collect();
    for ((table, first_slot, epoch), at) in ended {
        member
            .splits
            .frozen
            .lock()
            .remove(&(table, first_slot, epoch));
        let halves = [first_slot, at];
        let done = map
            .tablet_at(table, at)
            .is_some_and(|t| t.first_slot == at && t.master == me);
        for first in halves {
            if let Some(id) = member.created_tablet(table, first) {
                let _ = node.engine().set_frozen(id, false);
            }
        }
        if done {
            tracing::warn!(table, first_slot, at, "tablet split: both halves serve");
        } else {
            tracing::warn!(
                table,
                first_slot,
                at,
                "tablet split ended without a split: serving it whole"
            );
        }
    }
}

/// After a map is served: starts the splits it asks of this server.
pub fn apply(node: &Arc<Node>, member: &Arc<Member>, map: &ClusterMap, me: ServerId) {
    for t in &map.tablets {
        let Some(at) = t.split else {
            continue;
        };
        if t.master != me || t.recovering {
            continue;
        }
        if member
            .splits
            .frozen
            .lock()
            .insert((t.table, t.first_slot, t.epoch), at)
            .is_some()
        {
            continue;
        }
        let (node, member, t) = (node.clone(), member.clone(), t.clone());
        spawn(format!("split-{}-{}", t.table, t.first_slot), move || {
            split(&node, &member, &t, at)
        });
    }
}

/// Freezes the tablet, drains its streams, splits its memory, reports (or gives up).
fn split(node: &Arc<Node>, member: &Arc<Member>, t: &TabletInfo, at: u16) {
    let me = member.view().me;
    let Some(engine_tablet) = member.created_tablet(t.table, t.first_slot) else {
        return;
    };
    let started = Instant::now();
    let engine = node.engine();
    let result = engine
        .set_frozen(engine_tablet, true)
        .map_err(|e| format!("cannot freeze the tablet: {e}"))
        .and_then(|()| {
            member
                .replication
                .drain(engine_tablet, DRAIN_MAX, || still(member, t))
        })
        .and_then(|()| {
            let drained = started.elapsed();
            let made = if t.table == ramlog_cluster::DEFAULT_TABLE {
                node.keyspace.split_tablet(engine_tablet, at)
            } else {
                engine.split_tablet(engine_tablet, at)
            };
            made.map(|id| (id, drained))
                .map_err(|e| format!("cannot split the tablet's memory: {e}"))
        });
    let request = match result {
        Ok((upper, drained)) => {
            member.adopt_tablet(t.table, at, upper);
            tracing::warn!(
                table = t.table,
                first_slot = t.first_slot,
                at,
                drain_ms = drained.as_millis() as u64,
                split_ms = (started.elapsed() - drained).as_millis() as u64,
                "tablet frozen, drained and split here; reporting"
            );
            Request::SplitDone {
                server: me,
                table: t.table,
                first_slot: t.first_slot,
                at,
                epoch: t.epoch,
            }
        }
        Err(reason) => {
            tracing::error!(table = t.table, first_slot = t.first_slot, at, %reason, "giving the split up");
            Request::SplitAbort {
                server: me,
                table: t.table,
                first_slot: t.first_slot,
                epoch: t.epoch,
                reason,
            }
        }
    };
    if let Err(e) = report(member, &request, || still(member, t)) {
        tracing::warn!(table = t.table, first_slot = t.first_slot, error = %e, "the split report did not reach the coordinator");
    }
    member.refresh_map_soon();
}
