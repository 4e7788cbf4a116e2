//! A server's membership in a cluster: joining, heartbeats, the map it serves, and routing answers.
//!
//! With `coordinator` configured, a server registers with the coordinator (its id and epoch come
//! back, and are remembered in `<data_dir>/cluster.json` so that a restart rejoins as the same
//! id), then heartbeats every `heartbeat_interval_ms`; each heartbeat answer carries the map when
//! the coordinator's is newer. Applying a map creates, in the engine, every tablet the map makes
//! this server master of. Front ends ask [`ClusterView::route`] whether a slot is served here, and
//! get what Redis Cluster answers otherwise (`-MOVED`, `-CLUSTERDOWN`).
//!
//! Each heartbeat also reports this server's memory: the room it has for restores and the live
//! bytes of each tablet it masters ([`MemoryReport`]), by which the coordinator plans restores.
//!
//! Hides: the coordinator client, retries, the identity file, and which tablets were created.
//! Memory: one map (a few hundred bytes per tablet) and a 16384-entry owner table per version held.

use crate::node::Node;
use arc_swap::ArcSwap;
use ramlog_cluster::rpc::{CoordinatorClient, MemoryReport, Request, Response, RpcError};
use ramlog_cluster::state::PreviousIdentity;
use ramlog_cluster::{
    ClusterMap, CommandError, ServerAddresses, ServerId, ServerState, TabletBytes, DEFAULT_TABLE,
};
use ramlog_common::{key_slot, TableId, SLOT_COUNT};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// One version of the map as this server uses it.
pub struct ClusterView {
    pub map: ClusterMap,
    pub me: ServerId,
    pub epoch: u64,
    /// The master of each slot of the default table (0 = none).
    owners: Vec<ServerId>,
    /// `host:port` of each server's cluster RESP port, by position in `map.servers`.
    resp_addresses: Vec<String>,
    /// The map as JSON (the native protocol's CLUSTER_MAP reply).
    pub map_json: bytes::Bytes,
    /// Contiguous runs of slots of the default table with one master: (first, last, master).
    runs: Vec<(u16, u16, ServerId)>,
    /// The mirror of each slot's tablet of the default table (0 = none).
    mirrors: Vec<ServerId>,
    /// Servers that master slots of the default table, by id.
    masters: Vec<ServerId>,
    /// Slots of the default table whose tablet is being recovered, or switching to the target
    /// of its move (no master serves them).
    recovering: Vec<bool>,
    /// Recovering tablets of the default table that wait for memory: (first, last, why).
    waiting: Vec<(u16, u16, String)>,
    /// True if a tablet of the default table switches on this server now (a move's switch, a
    /// split's or a merge's last step), or moves to this server: its requests are held a moment on
    /// the cluster port ([`ClusterView::switching_here`], [`ClusterView::moving_here`]).
    switches_here: bool,
}

/// Where a slot of the default table is served.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    Here,
    /// Another server masters it: `host:port` of its cluster RESP port.
    Moved(String),
    /// No server masters it (the map has no tablet there yet).
    Down,
    /// Its master died and a backup is restoring it: retry shortly.
    Recovering,
    /// Its master died and no live backup has the memory to restore it: why. It waits until
    /// one has (the coordinator resumes it by itself).
    Waiting(String),
}

impl Route {
    /// The RESP error for a slot that waits for memory.
    pub fn waiting_error(slot: u16, why: &str) -> String {
        format!(
            "CLUSTERDOWN slot {slot} is unavailable: its master failed and the tablet waits for memory to be restored ({why})"
        )
    }
}

/// True while `t` switches on `me`: its master, or its move's target (which may hear that the
/// switch ended after the source has sent clients there).
fn switches_at(t: &ramlog_cluster::TabletInfo, me: ServerId) -> bool {
    !t.recovering
        && t.switching()
        && (t.master == me || t.migration.is_some_and(|m| m.target == me))
}

/// True while `t` moves to `me` (not yet mastered by it).
fn moves_to(t: &ramlog_cluster::TabletInfo, me: ServerId) -> bool {
    !t.recovering && t.master != me && t.migration.is_some_and(|m| m.target == me)
}

impl ClusterView {
    pub fn new(map: ClusterMap, me: ServerId, epoch: u64) -> ClusterView {
        // A recovering tablet is listed under its restorer (where clients should go next); one
        // that waits for memory under its first live backup (which says why, and restores it
        // once it has room); else under its dead master. Its slots answer TRYAGAIN everywhere
        // meanwhile, CLUSTERDOWN while it waits for memory.
        let mut owners = vec![0; SLOT_COUNT as usize];
        let mut recovering = vec![false; SLOT_COUNT as usize];
        let mut mirrors = vec![0; SLOT_COUNT as usize];
        let mut waiting = Vec::new();
        let mut switches_here = false;
        let is_up = |id: &ServerId| map.server(*id).is_some_and(|s| s.state == ServerState::Up);
        for t in map.tablets_of(DEFAULT_TABLE) {
            if let Some(m) = t.mirror.filter(|_| !t.recovering) {
                for slot in t.slots() {
                    mirrors[slot as usize] = m;
                }
            }
            if let Some(why) = t.waiting.as_ref().filter(|_| t.recovering) {
                waiting.push((t.first_slot, t.last_slot, why.clone()));
            }
            let owner = if t.recovering {
                t.restorer
                    .or_else(|| {
                        t.waiting
                            .as_ref()
                            .and(t.backups.iter().copied().find(is_up))
                    })
                    .unwrap_or(t.master)
            } else {
                t.master
            };
            // A tablet switching to its migration's target is served nowhere for that moment.
            let unavailable = t.recovering || t.switching();
            switches_here |= switches_at(t, me) || moves_to(t, me);
            for slot in t.slots() {
                owners[slot as usize] = owner;
                recovering[slot as usize] = unavailable;
            }
        }
        let resp_addresses = map
            .servers
            .iter()
            .map(|s| s.addresses.resp.to_string())
            .collect();
        let map_json = map.to_json().into();
        let mut runs: Vec<(u16, u16, ServerId)> = Vec::new();
        for slot in 0..SLOT_COUNT {
            let owner = owners[slot as usize];
            if owner == 0 {
                continue;
            }
            match runs.last_mut() {
                Some(run) if run.2 == owner && run.1 + 1 == slot => run.1 = slot,
                _ => runs.push((slot, slot, owner)),
            }
        }
        let mut masters: Vec<ServerId> = runs.iter().map(|r| r.2).collect();
        masters.sort_unstable();
        masters.dedup();
        ClusterView {
            map,
            me,
            epoch,
            owners,
            resp_addresses,
            map_json,
            runs,
            mirrors,
            masters,
            recovering,
            waiting,
            switches_here,
        }
    }

    /// True if some tablet of the default table switches on this server now, or moves to it.
    #[inline]
    pub fn switches_here(&self) -> bool {
        self.switches_here
    }

    /// True while `slot`'s tablet of the default table switches on this server, its master or
    /// its move's target (a move's switch, a split's or a merge's last step: tens of
    /// milliseconds, at most the drain's bound). Cheap when nothing switches here.
    #[inline]
    pub fn switching_here(&self, slot: u16) -> bool {
        self.switches_here
            && self
                .map
                .tablet_at(DEFAULT_TABLE, slot)
                .is_some_and(|t| switches_at(t, self.me))
    }

    /// True while `slot`'s tablet of the default table moves to this server and the source
    /// still masters it in this server's map: a request for it here was most likely sent by the
    /// source, whose map already names this server (maps reach servers a heartbeat apart).
    #[inline]
    pub fn moving_here(&self, slot: u16) -> bool {
        self.switches_here
            && self
                .map
                .tablet_at(DEFAULT_TABLE, slot)
                .is_some_and(|t| moves_to(t, self.me))
    }

    /// The mirror of `slot`'s tablet of the default table (0 = none).
    #[inline]
    pub fn mirror_of(&self, slot: u16) -> ServerId {
        self.mirrors[slot as usize]
    }

    /// `host:port` of server `id`'s cluster RESP port.
    pub fn resp_address(&self, id: ServerId) -> Option<&str> {
        self.map
            .servers
            .binary_search_by_key(&id, |s| s.id)
            .ok()
            .map(|i| self.resp_addresses[i].as_str())
    }

    /// The master of `slot` of the default table (0 = none).
    #[inline]
    pub fn owner(&self, slot: u16) -> ServerId {
        self.owners[slot as usize]
    }

    pub fn route(&self, slot: u16) -> Route {
        if self.recovering[slot as usize] {
            return match self.waiting_reason(slot) {
                Some(why) => Route::Waiting(why.to_string()),
                None => Route::Recovering,
            };
        }
        match self.owner(slot) {
            0 => Route::Down,
            id if id == self.me => Route::Here,
            id => match self.map.servers.binary_search_by_key(&id, |s| s.id) {
                Ok(i) => Route::Moved(self.resp_addresses[i].clone()),
                Err(_) => Route::Down,
            },
        }
    }

    /// Where `key` of `table` is served (any table; the default table's fast path is [`Self::route`]).
    pub fn route_key(&self, table: TableId, key: &[u8]) -> Route {
        if table == DEFAULT_TABLE {
            return self.route(key_slot(key));
        }
        match self.map.tablet_of(table, key) {
            None => Route::Down,
            Some(t) if t.recovering || t.switching() => match &t.waiting {
                Some(why) => Route::Waiting(why.clone()),
                None => Route::Recovering,
            },
            Some(t) if t.master == self.me => Route::Here,
            Some(t) => match self.map.server(t.master) {
                Some(s) => Route::Moved(s.addresses.resp.to_string()),
                None => Route::Down,
            },
        }
    }

    /// Slots of the default table with a master.
    pub fn slots_assigned(&self) -> usize {
        self.owners.iter().filter(|&&o| o != 0).count()
    }

    /// Contiguous runs of slots of the default table with the same master: (first, last, master).
    pub fn slot_runs(&self) -> &[(u16, u16, ServerId)] {
        &self.runs
    }

    /// Servers that master slots of the default table, by id.
    pub fn masters(&self) -> &[ServerId] {
        &self.masters
    }

    /// True while `slot`'s tablet of the default table is being recovered (waiting for memory
    /// or not): no server serves it.
    #[inline]
    pub fn is_recovering(&self, slot: u16) -> bool {
        self.recovering[slot as usize]
    }

    /// The TRYAGAIN answer for a slot of the default table that no server serves for now
    /// ([`Route::Recovering`]): its tablet is recovering, switching to its move's target,
    /// splitting or merging.
    pub fn unavailable_error(&self, slot: u16) -> String {
        let t = self.map.tablet_at(DEFAULT_TABLE, slot);
        if t.is_some_and(|t| t.split.is_some()) {
            format!("TRYAGAIN slot {slot} is in a tablet that splits; retry")
        } else if t.is_some_and(|t| t.merge_ready) {
            format!("TRYAGAIN slot {slot} is in a tablet that merges; retry")
        } else if t.is_some_and(|t| t.switching()) {
            format!("TRYAGAIN slot {slot} is switching to the server it moves to; retry")
        } else {
            format!("TRYAGAIN slot {slot} is being recovered after its master failed; retry")
        }
    }

    /// Why `slot` of the default table has no server, if its tablet waits for memory.
    #[inline]
    pub fn waiting_reason(&self, slot: u16) -> Option<&str> {
        if !self.recovering[slot as usize] {
            return None;
        }
        self.waiting
            .iter()
            .find(|w| (w.0..=w.1).contains(&slot))
            .map(|w| w.2.as_str())
    }

    /// Tablets of any table that wait for memory to be restored.
    pub fn tablets_waiting_for_room(&self) -> usize {
        self.map
            .tablets
            .iter()
            .filter(|t| t.recovering && t.waiting.is_some())
            .count()
    }
}

/// What a server keeps back from the room it reports for restores: 1/32 of its budget, at
/// least 2 MiB. The engine's figures move with every write between two heartbeats, and the
/// backup store's memory (charged to the same budget) grows with the tablets it backs up.
fn room_margin_bytes(budget_bytes: u64) -> u64 {
    (budget_bytes / 32).max(2 << 20)
}

/// The bytes this server could take for a restore now: the live bytes its log can add before
/// it reaches its utilisation limit (the budget less the index, buffers and backup store
/// charged to it, the cleaner's reserve, the heads' unwritten tails and the garbage the cleaner
/// needs), less [`room_margin_bytes`].
pub fn restore_room_bytes(node: &Node) -> u64 {
    let engine = node.engine();
    engine
        .room_bytes()
        .saturating_sub(room_margin_bytes(engine.config().memory_bytes))
}

/// What a server remembers of its membership across restarts.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Identity {
    cluster_id: u64,
    server_id: ServerId,
}

fn identity_path(data_dir: &Path) -> PathBuf {
    data_dir.join("cluster.json")
}

fn load_identity(data_dir: &Path) -> Result<Option<Identity>, String> {
    let path = identity_path(data_dir);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            format!(
                "{} is corrupt ({e}); remove it to join as a new server",
                path.display()
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

fn save_identity(data_dir: &Path, identity: Identity) -> Result<(), String> {
    std::fs::create_dir_all(data_dir)
        .map_err(|e| format!("cannot create {}: {e}", data_dir.display()))?;
    let path = identity_path(data_dir);
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec(&identity).map_err(|e| e.to_string())?;
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        if let Ok(dir) = std::fs::File::open(data_dir) {
            let _ = dir.sync_all();
        }
        Ok(())
    };
    write().map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// This server's membership (see the module comment).
pub struct Member {
    view: ArcSwap<ClusterView>,
    /// Recovering tablets (first slots) whose restorer this server told, at the map version
    /// given, that a client waits for them (at most one message per tablet and map).
    asked: parking_lot::Mutex<(u64, std::collections::HashSet<u16>)>,
    client: CoordinatorClient,
    /// The replication role: each map points the tablets this server masters at their backups.
    pub replication: Arc<crate::cluster::replication::Replication>,
    /// The backup duty: each map sets the epochs it fences and the logs it keeps.
    pub backup: Arc<crate::cluster::backup::BackupService>,
    /// Tablets created in the engine: (table, first slot) to the engine's tablet.
    created: parking_lot::Mutex<HashMap<(TableId, u16), ramlog_logmem::TabletId>>,
    /// Connections to the other servers (the routing port forwards over them).
    peers: crate::cluster::peers::Peers,
    /// Heartbeats go over their own client, with a deadline shorter than the lease.
    heartbeat_client: CoordinatorClient,
    /// Until when this server may serve (nanoseconds after `clock_base`): renewed by each
    /// answered heartbeat, from the moment it was sent.
    lease_until: std::sync::atomic::AtomicU64,
    clock_base: std::time::Instant,
    /// Restores and copies this server runs for the cluster.
    pub jobs: Arc<crate::cluster::recovery::Jobs>,
    /// Tablets this server mirrors (table mode `mirror`, and tablets moving here).
    pub mirrors: crate::cluster::mirror::Mirrors,
    /// This server's part in tablet migrations.
    pub migrations: crate::cluster::migration::Migrations,
    pub splits: crate::cluster::split::Splits,
    /// Wakes the heartbeat loop for a heartbeat now (a migration step expects a new map).
    refresh: tokio::sync::Notify,
    /// Peers this server failed to reach on a client's behalf (the routing port forwarding to
    /// them), with what went wrong; reported to the coordinator with the next heartbeat.
    unreachable_peers: parking_lot::Mutex<HashMap<ServerId, String>>,
    /// When each peer was last reported, so that one is reported at most every
    /// [`SUSPECT_REPORT_EVERY`].
    reported_peers: parking_lot::Mutex<HashMap<ServerId, std::time::Instant>>,
    /// The tablets of the last memory report: sent again while a map is being applied (the
    /// heartbeat never waits for that).
    last_tablets: parking_lot::Mutex<Vec<TabletBytes>>,
    /// Per engine tablet: when its operation count was last read, that count, and its rate of
    /// operations per second averaged over about a second (for the leader's balancing by load).
    ops_seen: parking_lot::Mutex<HashMap<ramlog_logmem::TabletId, (std::time::Instant, u64, f64)>>,
    /// The version of the map served, published after each map is applied: what waits for the
    /// map to change (the routing port, for a slot whose master failed) wakes on it.
    map_version: tokio::sync::watch::Sender<u64>,
}

/// The heartbeat interval while a migration this server takes part in builds or switches.
const FAST_HEARTBEAT: Duration = Duration::from_millis(10);

/// How often one peer is reported suspect at most (the coordinator holds a report for 2 s).
const SUSPECT_REPORT_EVERY: Duration = Duration::from_secs(1);

/// How a refusal for an expired lease begins: the request was not applied.
pub const LEASE_REFUSAL_PREFIX: &str =
    "CLUSTERDOWN this server has had no answer from the coordinator";

/// The lease a server assumes until the coordinator's first answer names one.
const LEASE_DEFAULT: Duration = Duration::from_millis(300);

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("cannot join the cluster: {0}")]
    Refused(String),
    #[error("cannot reach the coordinator at {addresses} within {secs} s: {last}")]
    Unreachable {
        addresses: String,
        secs: f64,
        last: String,
    },
    #[error("{0}")]
    Identity(String),
}

impl Member {
    /// Registers with the coordinator (retrying for up to `join_timeout_ms` while it is unreachable
    /// or the previous process with this id still heartbeats), applies the map it returns, and
    /// starts the heartbeat task.
    pub async fn join(
        node: &Arc<Node>,
        roles: &crate::cluster::Roles,
        coordinator: &str,
        addresses: ServerAddresses,
    ) -> Result<Arc<Member>, JoinError> {
        let config = &node.config;
        let client = CoordinatorClient::new(
            ramlog_cluster::rpc::parse_addresses(coordinator),
            Duration::from_secs(3),
        );
        let previous = load_identity(&config.data_dir)
            .map_err(JoinError::Identity)?
            .map(|i| PreviousIdentity {
                cluster_id: i.cluster_id,
                server_id: i.server_id,
            });
        let request = Request::Register {
            previous,
            addresses,
            memory_bytes: config.memory_bytes,
            // Retries below resend this: the coordinator answers a repeat of a registration it
            // committed with the same id and epoch.
            incarnation: incarnation(),
        };
        let join_timeout = Duration::from_millis(config.join_timeout_ms.max(1));
        let deadline = tokio::time::Instant::now() + join_timeout;
        let (id, epoch, map) = loop {
            match client.call(&request).await {
                Ok(Response::Registered { id, epoch, map }) => break (id, epoch, map),
                Ok(other) => {
                    return Err(JoinError::Refused(
                        ramlog_cluster::rpc::unexpected(&other).to_string(),
                    ))
                }
                Err(e) => {
                    let retry = matches!(
                        e,
                        RpcError::Unreachable { .. }
                            | RpcError::Refused(CommandError::DuplicateServer { .. })
                            | RpcError::Refused(CommandError::NotInitialized)
                    );
                    if !retry {
                        return Err(JoinError::Refused(e.to_string()));
                    }
                    if tokio::time::Instant::now() >= deadline {
                        return Err(JoinError::Unreachable {
                            addresses: coordinator.to_string(),
                            secs: join_timeout.as_secs_f64(),
                            last: e.to_string(),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        save_identity(
            &config.data_dir,
            Identity {
                cluster_id: map.cluster_id,
                server_id: id,
            },
        )
        .map_err(JoinError::Identity)?;
        tracing::info!(
            server = id,
            epoch,
            map_version = map.version,
            "joined the cluster"
        );
        let heartbeat_every = Duration::from_millis(config.heartbeat_interval_ms.max(10));
        let member = Arc::new(Member {
            view: ArcSwap::from_pointee(ClusterView::new(ClusterMap::default(), id, epoch)),
            replication: roles.replication.clone(),
            backup: roles.backup.clone(),
            heartbeat_client: CoordinatorClient::new(
                client.addresses().to_vec(),
                (heartbeat_every * 2).min(LEASE_DEFAULT),
            )
            .failing_fast(),
            client,
            created: parking_lot::Mutex::new(HashMap::new()),
            peers: crate::cluster::peers::Peers::default(),
            lease_until: std::sync::atomic::AtomicU64::new(0),
            clock_base: std::time::Instant::now(),
            jobs: Arc::new(crate::cluster::recovery::Jobs::default()),
            asked: parking_lot::Mutex::new((0, std::collections::HashSet::new())),
            mirrors: crate::cluster::mirror::Mirrors::default(),
            migrations: Default::default(),
            splits: Default::default(),
            refresh: tokio::sync::Notify::new(),
            unreachable_peers: parking_lot::Mutex::new(HashMap::new()),
            reported_peers: parking_lot::Mutex::new(HashMap::new()),
            last_tablets: parking_lot::Mutex::new(Vec::new()),
            ops_seen: parking_lot::Mutex::new(HashMap::new()),
            map_version: tokio::sync::watch::Sender::new(0),
        });
        member.renew_lease(member.clock_base, LEASE_DEFAULT);
        member.apply(node, map);
        Ok(member)
    }

    pub fn view(&self) -> arc_swap::Guard<Arc<ClusterView>> {
        self.view.load()
    }

    /// Waits until this server serves a map newer than version `seen`, or `timeout` passes;
    /// true if it does. Any number of tasks may wait at once, on any runtime.
    pub async fn map_newer_than(&self, seen: u64, timeout: Duration) -> bool {
        let mut versions = self.map_version.subscribe();
        let newer = tokio::time::timeout(timeout, versions.wait_for(|&v| v > seen)).await;
        matches!(newer, Ok(Ok(_)))
    }

    /// Extends the lease to `lease` after `sent` (never shortens it).
    fn renew_lease(&self, sent: std::time::Instant, lease: Duration) {
        let until = (sent.saturating_duration_since(self.clock_base) + lease).as_nanos() as u64;
        self.lease_until
            .fetch_max(until, std::sync::atomic::Ordering::AcqRel);
    }

    /// Notes that `peer` could not be reached for a client's request; the next heartbeat
    /// reports it to the coordinator (which probes it and declares it dead if it is).
    pub fn peer_unreachable(&self, peer: ServerId, reason: String) {
        if peer == self.view().me {
            return;
        }
        self.unreachable_peers.lock().entry(peer).or_insert(reason);
    }

    fn take_unreachable_peers(&self) -> Vec<crate::cluster::replication::Suspect> {
        let now = std::time::Instant::now();
        let mut reported = self.reported_peers.lock();
        self.unreachable_peers
            .lock()
            .drain()
            .filter(|(peer, _)| {
                let fresh = reported
                    .get(peer)
                    .is_none_or(|at| now.duration_since(*at) >= SUSPECT_REPORT_EVERY);
                if fresh {
                    reported.insert(*peer, now);
                }
                fresh
            })
            .map(|(peer, reason)| crate::cluster::replication::Suspect {
                server: peer,
                reason: format!("a client's request could not reach it: {reason}"),
                failing: false,
                silent: std::time::Duration::ZERO,
            })
            .collect()
    }

    /// No coordinator member can declare anything while none runs or none leads (a new leader
    /// waits a full detection time, longer than a lease, before it declares): found so, the
    /// lease is extended from when the check began. A coordinator that is merely unreachable
    /// (a partition) extends nothing.
    async fn extend_lease_if_leaderless(&self) {
        let checked = std::time::Instant::now();
        if self.heartbeat_client.leaderless().await {
            self.renew_lease(checked, LEASE_DEFAULT);
        }
    }

    /// None while the lease holds; else how long ago it ran out. A server whose lease ran out
    /// serves nothing (the coordinator may have declared it dead and moved its tablets).
    #[inline]
    pub fn lease_expired(&self) -> Option<Duration> {
        let now = self.clock_base.elapsed().as_nanos() as u64;
        let until = self.lease_until.load(std::sync::atomic::Ordering::Acquire);
        (now >= until).then(|| Duration::from_nanos(now - until))
    }

    /// The error a front end answers while the lease has run out (it starts with
    /// [`LEASE_REFUSAL_PREFIX`]).
    pub fn lease_refusal(&self) -> Option<String> {
        self.lease_expired().map(|late| {
            format!(
                "{LEASE_REFUSAL_PREFIX} for {} ms past its lease; it serves again once it has",
                late.as_millis()
            )
        })
    }

    /// The engine tablet of (table, first slot) of `t`, created now if it is not yet.
    pub fn engine_tablet(
        &self,
        node: &Node,
        t: &ramlog_cluster::TabletInfo,
    ) -> Result<ramlog_logmem::TabletId, String> {
        let mut created = self.created.lock();
        if let Some(&id) = created.get(&(t.table, t.first_slot)) {
            return Ok(id);
        }
        let made = if t.table == DEFAULT_TABLE {
            node.keyspace.add_tablet(t.first_slot, t.last_slot)
        } else {
            node.engine()
                .create_tablet(t.table, t.first_slot, t.last_slot)
        };
        let id = made.map_err(|e| e.to_string())?;
        created.insert((t.table, t.first_slot), id);
        Ok(id)
    }

    /// Records `id` as the engine tablet of (table, first slot): the upper half of a split,
    /// made by splitting the engine tablet of the whole.
    pub fn adopt_tablet(&self, table: TableId, first_slot: u16, id: ramlog_logmem::TabletId) {
        self.created.lock().insert((table, first_slot), id);
    }

    /// Forgets the engine tablet of (table, first slot): a merge joined it into the tablet
    /// before it.
    pub fn forget_tablet(&self, table: TableId, first_slot: u16) {
        self.created.lock().remove(&(table, first_slot));
    }

    /// The engine tablet of (table, first slot), if created here.
    pub fn created_tablet(
        &self,
        table: TableId,
        first_slot: u16,
    ) -> Option<ramlog_logmem::TabletId> {
        self.created.lock().get(&(table, first_slot)).copied()
    }

    /// A client asked for a key of `slot` (default table), which is recovering: if this server
    /// restores it, that restore goes first ([`crate::cluster::recovery::Jobs::demand`]).
    pub fn demand(&self, view: &ClusterView, slot: u16) {
        if view.owner(slot) == view.me {
            self.jobs.demand(DEFAULT_TABLE, slot);
        }
    }

    /// A request for `key`, in recovering `slot`, waits here (the routing port holds it): its
    /// restorer is told, so that the restore of that slot goes first there. The restorer hears
    /// it as a read of `key` forwarded to it, which it answers TRYAGAIN and counts as a demand;
    /// one per tablet and map version, sent in the background.
    pub fn ask_for(self: &Arc<Self>, node: &Arc<Node>, view: &ClusterView, slot: u16, key: &[u8]) {
        let restorer = view.owner(slot);
        if restorer == view.me {
            self.jobs.demand(DEFAULT_TABLE, slot);
            return;
        }
        let Some(t) = view
            .map
            .tablet_at(DEFAULT_TABLE, slot)
            .filter(|t| t.recovering)
        else {
            return;
        };
        {
            let mut asked = self.asked.lock();
            if asked.0 != view.map.version {
                *asked = (view.map.version, std::collections::HashSet::new());
            }
            if !asked.1.insert(t.first_slot) {
                return;
            }
        }
        let Some(addr) = view.map.server(restorer).map(|s| s.addresses.native) else {
            return;
        };
        tracing::info!(
            slot,
            restorer,
            "a client waits for a recovering slot: telling its restorer"
        );
        let (node, member, key) = (node.clone(), self.clone(), key.to_vec());
        let (version, first_slot) = (view.map.version, t.first_slot);
        tokio::spawn(async move {
            if !member.tell_restorer(&node, restorer, addr, &key).await {
                // Not told (unreachable, or it did not serve the map naming it in time): the
                // next request held for the tablet asks again.
                let mut asked = member.asked.lock();
                if asked.0 == version {
                    asked.1.remove(&first_slot);
                }
            }
        });
    }

    /// Tells `restorer` that a client waits for `key`'s recovering slot (an EXISTS it answers as
    /// recovering, which raises that restore's priority); false if it could not be told.
    async fn tell_restorer(
        &self,
        node: &Arc<Node>,
        restorer: ServerId,
        addr: std::net::SocketAddr,
        key: &[u8],
    ) -> bool {
        let Ok(client) = self.peers().client(node, restorer, addr).await else {
            return false;
        };
        let request = ramlog_proto::native::Request::RespBatch {
            protocol: 2,
            commands: vec![vec![b"EXISTS".as_slice(), &key]],
        };
        // The restorer may not serve this map yet (it answers that the slot is not its
        // own): asked again, a few times, until it answers that the slot is recovering.
        for _ in 0..20 {
            match client.request(&request).await {
                Ok(ramlog_proto::native::Response::RespBatch(r))
                    if r.first().is_some_and(|a| {
                        !a.starts_with(b"-TRYAGAIN") || a.windows(9).any(|w| w == b"recovered")
                    }) =>
                {
                    return true
                }
                Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(_) => return false,
            }
        }
        false
    }

    pub fn peers(&self) -> &crate::cluster::peers::Peers {
        &self.peers
    }

    pub fn coordinator(&self) -> &CoordinatorClient {
        &self.client
    }

    /// Serves `map` if it is newer than the one held: creates the tablets it makes this server
    /// master of and sets table schemas, then publishes the view.
    pub fn apply(self: &Arc<Self>, node: &Arc<Node>, map: ClusterMap) {
        let current = self.view.load();
        if map.version <= current.map.version && current.map.version != 0 {
            return;
        }
        let me = current.me;
        let epoch = map.server(me).map_or(current.epoch, |s| s.epoch);
        {
            let mut created = self.created.lock();
            // A recovering tablet is created by its restore, on the restorer.
            for t in map
                .tablets
                .iter()
                .filter(|t| t.master == me && !t.recovering)
            {
                if created.contains_key(&(t.table, t.first_slot)) {
                    continue;
                }
                let made = if t.table == DEFAULT_TABLE {
                    node.keyspace.add_tablet(t.first_slot, t.last_slot)
                } else {
                    node.engine()
                        .create_tablet(t.table, t.first_slot, t.last_slot)
                };
                match made {
                    Ok(tablet) => {
                        created.insert((t.table, t.first_slot), tablet);
                    }
                    Err(e) => tracing::error!(
                        table = t.table,
                        first = t.first_slot,
                        last = t.last_slot,
                        error = %e,
                        "cannot create a tablet the map gives this server"
                    ),
                }
            }
        }
        for table in &map.tables {
            let schema = table.schema.as_deref().and_then(|bytes| {
                ramlog_logmem::query::Schema::from_bytes(bytes)
                    .map_err(
                        |e| tracing::error!(table = table.id, error = %e, "bad schema in the map"),
                    )
                    .ok()
            });
            if schema.is_some() {
                node.engine().set_schema(table.id, schema);
            }
        }
        // A tablet moved here is served from this map on: its clock goes up first.
        crate::cluster::migration::take_over(node, self, &map, me);
        // Writes to a tablet go to its backups from before the front ends route to it.
        self.replication
            .apply(&map, me, epoch, &self.created.lock());
        // Both halves of a split this map completes take writes again (requests reach them
        // once the view below is served).
        crate::cluster::split::before_serve(node, self, &map, me);
        tracing::info!(version = map.version, "serving map");
        let view = Arc::new(ClusterView::new(map, me, epoch));
        self.view.store(view.clone());
        self.map_version.send_replace(view.map.version);
        // Backups fence old epochs and let go of logs the map no longer needs; restores and
        // copies this map asks of this server start.
        self.backup.apply_map(&view.map, me);
        crate::cluster::mirror::apply(node, self, &view.map, me);
        crate::cluster::migration::apply(node, self, &view.map, me);
        crate::cluster::split::apply(node, self, &view.map, me);
        crate::cluster::recovery::start_jobs(node, self, &view.map);
    }

    /// Asks the heartbeat loop for a heartbeat now (and so for the newest map).
    pub fn refresh_map_soon(&self) {
        self.refresh.notify_one();
    }

    /// True while a migration this server takes part in is building or switching, or a tablet
    /// it masters splits: heartbeats
    /// then go every [`FAST_HEARTBEAT`], so that each step's map arrives without waiting for
    /// the regular interval (the switch's pause is a few of them).
    fn migrating(&self) -> bool {
        let view = self.view.load();
        let me = view.me;
        view.map.tablets.iter().any(|t| {
            t.migration.is_some_and(|m| {
                m.phase >= ramlog_cluster::MigrationPhase::Building
                    && (m.target == me || t.master == me)
            }) || (t.split.is_some() && t.master == me)
        })
    }

    /// This server's memory for the coordinator: its room for restores and the live bytes and
    /// objects of each tablet it masters (one walk over the engine's segments). Never blocks:
    /// while a map is being applied, the tablets of the last report go again.
    pub fn memory_report(&self, node: &Node) -> MemoryReport {
        let room_bytes = restore_room_bytes(node);
        let engine = node.engine();
        let live = engine.live_bytes_by_tablet();
        let infos = engine.tablets();
        let objects: HashMap<ramlog_logmem::TabletId, u64> =
            infos.iter().map(|t| (t.id, t.objects)).collect();
        let rates: HashMap<ramlog_logmem::TabletId, u64> = {
            let now = std::time::Instant::now();
            let mut seen = self.ops_seen.lock();
            infos
                .iter()
                .map(|t| {
                    let e = seen.entry(t.id).or_insert((now, t.ops, 0.0));
                    let dt = now.duration_since(e.0).as_secs_f64();
                    if dt > 0.0 {
                        let rate = t.ops.saturating_sub(e.1) as f64 / dt;
                        let weight = dt.min(1.0);
                        e.2 = e.2 * (1.0 - weight) + rate * weight;
                        *e = (now, t.ops, e.2);
                    }
                    (t.id, e.2 as u64)
                })
                .collect()
        };
        // Test knob: tablets reported this many times smaller than they are, so that a test
        // can make the coordinator plan restores that run out of memory.
        static UNDERSTATE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let understate = *UNDERSTATE.get_or_init(|| {
            std::env::var("RAMLOG_TEST_UNDERSTATE_TABLETS")
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(1)
                .max(1)
        });
        let view = self.view();
        let Some(created) = self.created.try_lock() else {
            return MemoryReport {
                room_bytes,
                tablets: self.last_tablets.lock().clone(),
            };
        };
        let tablets: Vec<TabletBytes> = view
            .map
            .tablets
            .iter()
            .filter(|t| t.master == view.me && !t.recovering)
            .filter_map(|t| {
                let id = *created.get(&(t.table, t.first_slot))?;
                Some(TabletBytes {
                    table: t.table,
                    first_slot: t.first_slot,
                    live_bytes: live.get(id as usize).copied().unwrap_or(0) / understate,
                    objects: objects.get(&id).copied().unwrap_or(0),
                    ops_per_sec: rates.get(&id).copied().unwrap_or(0),
                })
            })
            .collect();
        // A tablet at its size limit refuses writes that would grow it (a backup's log of one
        // tablet would otherwise fill up and stop that backup), and takes them again below it.
        let limit = node
            .config
            .tablet_max_bytes
            .min(crate::node::config::tablet_max_bytes_limit());
        for t in view.map.tablets.iter().filter(|t| t.master == view.me) {
            if let Some(&id) = created.get(&(t.table, t.first_slot)) {
                let size = live.get(id as usize).copied().unwrap_or(0);
                let _ = engine.set_tablet_full(id, if size >= limit { limit } else { 0 });
            }
        }
        drop(created);
        self.last_tablets.lock().clone_from(&tablets);
        MemoryReport {
            room_bytes,
            tablets,
        }
    }

    /// Heartbeats until the node stops. A newer map in an answer is applied; a fenced answer
    /// (another process registered with this id) stops the server.
    ///
    /// The heartbeats, the lease they renew and the suspect reports run on a thread of their
    /// own with a runtime of its own (`keepalive`), never on the runtime that serves clients:
    /// a server whose workers are all busy (writes at a full memory waiting for the cleaner, a
    /// long pipeline) still heartbeats on time and is not taken for dead.
    pub fn start_heartbeats(self: &Arc<Self>, node: &Arc<Node>) {
        let member = self.clone();
        let node_weak = Arc::downgrade(node);
        let spawned = std::thread::Builder::new()
            .name("keepalive".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot start the heartbeat runtime");
                        if let Some(node) = node_weak.upgrade() {
                            node.fail_stop(format!("cannot start the heartbeat runtime: {e}"));
                        }
                        return;
                    }
                };
                runtime.block_on(member.heartbeat_loop(node_weak));
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the heartbeat thread");
            node.fail_stop(format!("cannot start the heartbeat thread: {e}"));
        }
    }

    /// The body of the `keepalive` thread (see [`Member::start_heartbeats`]).
    async fn heartbeat_loop(self: Arc<Self>, node: std::sync::Weak<Node>) {
        let member = self;
        let interval = Duration::from_millis(
            node.upgrade()
                .map_or(100, |n| n.config.heartbeat_interval_ms.max(10)),
        );
        // Suspect reports go over a client of this thread's own (a connection belongs to the
        // runtime that opened it).
        let reporter = Arc::new(CoordinatorClient::new(
            member.client.addresses().to_vec(),
            Duration::from_secs(3),
        ));
        {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failing_since: Option<std::time::Instant> = None;
            loop {
                let fast = member.migrating();
                tokio::select! {
                    _ = ticker.tick() => {}
                    _ = member.refresh.notified() => {}
                    _ = tokio::time::sleep(FAST_HEARTBEAT), if fast => {}
                }
                let Some(node) = node.upgrade() else { return };
                if node.stopping() {
                    return;
                }
                // A backup store that failed (full disk, I/O error) refuses every append, so
                // the masters it backs up could acknowledge no write: the server stops, and the
                // cluster replaces it as after a crash (fail-stop).
                if let Some(reason) = member.backup.store().failure() {
                    tracing::error!(%reason, "the backup store failed: stopping so that the cluster replaces this server; free space (or fix the disk) and start it again");
                    node.fail_stop(format!("the backup store failed: {reason}"));
                    return;
                }
                member
                    .jobs
                    .sample_ack_wait(member.replication.ack_latency_all());
                let memory = member.memory_report(&node);
                // A restore or copy that failed (a peer cut off, a connection that timed out)
                // starts again with the map it serves: no new map may come to start it.
                if member.jobs.any_failed() {
                    let view = member.view();
                    crate::cluster::recovery::start_jobs(&node, &member, &view.map);
                }
                let view = member.view();
                let request = Request::Heartbeat {
                    id: view.me,
                    epoch: view.epoch,
                    map_version: view.map.version,
                    memory: Some(memory),
                };
                drop(view);
                // While the coordinator does not answer, the lease is extended ahead of the call
                // (which takes up to its timeout to fail), so that it does not run out between
                // two failed heartbeats.
                if failing_since.is_some() {
                    member.extend_lease_if_leaderless().await;
                }
                let sent = std::time::Instant::now();
                match member.heartbeat_client.call(&request).await {
                    Ok(Response::Heartbeat { map, lease_ms }) => {
                        let lease = if lease_ms == 0 {
                            LEASE_DEFAULT
                        } else {
                            Duration::from_millis(lease_ms)
                        };
                        member.renew_lease(sent, lease);
                        if let Some(since) = failing_since.take() {
                            tracing::warn!(
                                after_ms = since.elapsed().as_millis() as u64,
                                "the coordinator answers heartbeats again"
                            );
                        }
                        if let Some(map) = map {
                            member.apply(&node, map);
                        }
                    }
                    Ok(other) => tracing::warn!(answer = ?other, "unexpected heartbeat answer"),
                    Err(RpcError::Fenced(reason)) => {
                        tracing::error!(%reason, "fenced by the coordinator: stopping");
                        node.request_shutdown();
                        return;
                    }
                    Err(e) => {
                        member.extend_lease_if_leaderless().await;
                        if failing_since.is_none() {
                            tracing::warn!(error = %e, "heartbeat failed; serving the map held while the lease lasts");
                            failing_since = Some(std::time::Instant::now());
                        }
                    }
                }
                // Backups that do not acknowledge, and peers a client's request could not reach:
                // the coordinator decides what to do. Reported off this loop, whose pace keeps
                // the lease.
                let mut suspects = member.replication.suspects();
                suspects.extend(member.take_unreachable_peers());
                if !suspects.is_empty() {
                    let me = member.view().me;
                    let reporter = reporter.clone();
                    tokio::spawn(async move { report_suspects(&reporter, me, suspects).await });
                }
            }
        }
    }
}

async fn report_suspects(
    client: &CoordinatorClient,
    me: ServerId,
    suspects: Vec<crate::cluster::replication::Suspect>,
) {
    for s in suspects {
        tracing::warn!(peer = s.server, reason = %s.reason, failing = s.failing, "reporting a suspect peer to the coordinator");
        let report = Request::Suspect {
            reporter: me,
            suspect: s.server,
            reason: s.reason,
            failing: s.failing,
            silent_ms: u64::try_from(s.silent.as_millis()).unwrap_or(u64::MAX),
        };
        if let Err(e) = client.call(&report).await {
            tracing::warn!(error = %e, "could not report a suspect peer");
        }
    }
}

/// A random number for this process's registrations (time, pid and the address of a local,
/// mixed); never 0.
fn incarnation() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let local = 0u8;
    let mixed = t ^ (u64::from(std::process::id()) << 40) ^ (std::ptr::addr_of!(local) as u64);
    mixed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}
