//! The coordinator service: one member's Raft node and its TCP port.
//!
//! Owns: the accept loop and the connections (frames answered in order; a malformed or oversized
//! frame closes its connection), the Raft node (its timing, the bootstrap of a new cluster by the
//! member with the lowest id, and the `Init` command a new leader proposes while the state is
//! uninitialized), the leader's in-memory record of server heartbeats and of the memory they
//! report (soft state: what it puts into the commands that plan restores, as a [`Room`]
//! snapshot, and what it watches to resume restores that wait for memory), and the answers to
//! every [`Request`]. Hides: openraft's errors (they become [`Response::NotLeader`] or
//! [`Response::Error`]) and how requests become commands.

use crate::network::Network;
use crate::store::{self, Machine};
use crate::TypeConfig;
use anyhow::Context;
use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, Config, Raft, RaftMetrics, ServerState, SnapshotPolicy};
use ramlog_cluster::balance;
use ramlog_cluster::rpc::{
    read_frame, write_frame, CoordinatorStatus, MemberInfo, MemoryReport, RaftRpc, Request,
    Response,
};
use ramlog_cluster::{
    ClusterMap, Command, CommandError, CommandOutcome, Room, ServerId, TabletBytes,
};
use ramlog_common::TableId;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// A heartbeat younger than this means a live process owns the server id.
pub const LIVE_HEARTBEAT: Duration = Duration::from_millis(300);

/// How much later than a restarted server's last heartbeat another server must have been heard
/// from to count as having gone on without it: more than one heartbeat interval, so that
/// servers that died together (a whole-cluster crash) never do.
const HEARD_AFTER: Duration = Duration::from_millis(150);

/// How long a proposal may wait to commit before the caller hears an error.
pub const COMMIT_TIMEOUT: Duration = Duration::from_secs(5);
/// The default of [`CoordinatorConfig::dead_after`], in milliseconds.
pub const DEAD_AFTER_MS: u64 = 400;
/// How long a probe of a silent server may take before it counts as failed.
const PROBE_TIMEOUT: Duration = Duration::from_millis(100);
/// How often the leader looks for silent servers.
const MONITOR_EVERY: Duration = Duration::from_millis(20);
/// A peer's report counts for this long.
const SUSPICION_FRESH: Duration = Duration::from_secs(2);
/// How often the leader checks whether a tablet that waits for memory would now fit.
const ROOM_CHECK_EVERY: Duration = Duration::from_millis(200);
/// How often the leader plans the moves drains and rebalancing call for.
const PLAN_EVERY: Duration = Duration::from_millis(250);
/// How long the leader leaves a tablet as it is (since it saw it at its epoch) before it merges
/// it with its neighbour by itself: a split on request, then a move of one half, is not undone
/// in between.
const MERGE_AFTER: Duration = Duration::from_secs(5);
/// Migrations a drain runs at once (rebalancing runs one).
const DRAIN_MOVES_IN_FLIGHT: usize = 2;

/// A server's latest memory report and when it arrived.
struct Report {
    at: Instant,
    memory: MemoryReport,
}

#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// This member's Raft id.
    pub id: u64,
    /// Where to listen (clients and members); port 0 picks one.
    pub listen: SocketAddr,
    /// Every member's id and address, this one included.
    pub members: BTreeMap<u64, String>,
    pub data_dir: PathBuf,
    /// Servers that must register before the default table is placed.
    pub initial_servers: u32,
    /// The default table's mode and backups per tablet, fixed when the cluster is created.
    pub default_mode: Option<ramlog_cluster::ReplicationMode>,
    pub default_replicas: Option<u32>,
    /// A snapshot is taken after this many log entries, and as many are kept behind it for
    /// followers that lag; one further behind is sent the snapshot.
    pub snapshot_every: u64,
    /// Silence after which a server that also fails a probe is declared dead.
    pub dead_after: Duration,
    /// How long a backup may acknowledge nothing of a live master's waiting writes, while the
    /// leader still hears from it, before it is cut off from that master's tablets (0: never).
    pub cut_off_after_ms: u64,
    /// The largest recovery partition: a dead master's larger tablets are split into
    /// partitions restored in parallel, each served as soon as it is restored.
    pub recovery_partition: ramlog_cluster::PartitionSize,
    /// Live bytes past which the leader splits a tablet (0: never by itself).
    pub split_bytes: u64,
    /// The floor of balancing by load (`--load-min-ops`; 0: off).
    pub load_min_ops: u64,
}

/// The default of `--cut-off-after-ms`.
pub const CUT_OFF_AFTER_MS: u64 = 1000;

/// The default of `--load-min-ops`.
pub const LOAD_MIN_OPS: u64 = 5000;
/// The least time between two moves for load: each move's effect shows in the next reports.
const LOAD_MOVE_EVERY: Duration = Duration::from_secs(30);

/// The default of `--split-mib`: half the servers' default (and largest) `tablet_max_bytes`,
/// 384 MiB, so that a growing tablet splits well before it refuses writes.
pub const SPLIT_MIB: u64 = 192;

/// The default of [`CoordinatorConfig::snapshot_every`].
pub const SNAPSHOT_EVERY: u64 = 500;

/// A running coordinator member.
pub struct Coordinator {
    address: SocketAddr,
    raft: Raft<TypeConfig>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

struct Shared {
    id: u64,
    raft: Raft<TypeConfig>,
    machine: Arc<RwLock<Machine>>,
    heartbeats: Mutex<HashMap<ServerId, Instant>>,
    /// The last suspicion reported against each server: (reporter, reason, when).
    suspicions: Mutex<HashMap<ServerId, (ServerId, String, Instant)>>,
    /// Each server's latest memory report (heartbeats).
    reports: Mutex<HashMap<ServerId, Report>>,
    /// When each server last became the master of a tablet it restored: a report sent before
    /// may not count all the memory the tablet takes.
    recovered_at: Mutex<HashMap<ServerId, Instant>>,
    /// The tablets whose wait for memory was logged, with the epoch they wait at.
    logged_waiting: Mutex<HashMap<(TableId, u16), u64>>,
    initial_servers: u32,
    default_mode: Option<ramlog_cluster::ReplicationMode>,
    default_replicas: Option<u32>,
    dead_after: Duration,
    cut_off_after_ms: u64,
    recovery_partition: ramlog_cluster::PartitionSize,
    split_bytes: u64,
    load_min_ops: u64,
    /// When the leader last moved a tablet for load.
    load_moved_at: Mutex<Option<Instant>>,
    /// When the leader first saw each tablet at its epoch: (table, first slot, epoch).
    tablets_seen: Mutex<HashMap<(TableId, u16, u64), Instant>>,
    /// When this member last became leader (None while it is not): heartbeats it did not see
    /// count from then, so a new leader never declares a server dead on its predecessor's watch.
    leader_since: Mutex<Option<Instant>>,
}

impl Coordinator {
    /// Opens the storage, starts Raft and listens; bootstraps a new cluster when this is the
    /// member with the lowest id and its storage is empty.
    pub async fn start(config: CoordinatorConfig) -> anyhow::Result<Coordinator> {
        if !config.members.contains_key(&config.id) {
            anyhow::bail!(
                "member id {} is not in the member list ({})",
                config.id,
                config
                    .members
                    .keys()
                    .map(|k| k.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            );
        }
        let (log, sm) = store::open(&config.data_dir)?;
        let machine = sm.shared();
        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let address = listener.local_addr()?;
        let raft_config = Config {
            cluster_name: "ramlog-coordinator".into(),
            heartbeat_interval: 50,
            election_timeout_min: 150,
            election_timeout_max: 300,
            install_snapshot_timeout: 5000,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(config.snapshot_every.max(1)),
            max_in_snapshot_log_to_keep: config.snapshot_every,
            purge_batch_size: config.snapshot_every.clamp(1, 64),
            ..Config::default()
        }
        .validate()
        .context("the Raft configuration is invalid")?;
        let raft = Raft::new(config.id, Arc::new(raft_config), Network, log, sm)
            .await
            .context("cannot start Raft")?;
        let shared = Arc::new(Shared {
            id: config.id,
            raft: raft.clone(),
            machine,
            heartbeats: Mutex::new(HashMap::new()),
            suspicions: Mutex::new(HashMap::new()),
            reports: Mutex::new(HashMap::new()),
            recovered_at: Mutex::new(HashMap::new()),
            logged_waiting: Mutex::new(HashMap::new()),
            initial_servers: config.initial_servers,
            default_mode: config.default_mode,
            default_replicas: config.default_replicas,
            dead_after: config.dead_after,
            cut_off_after_ms: config.cut_off_after_ms,
            recovery_partition: config.recovery_partition,
            split_bytes: config.split_bytes,
            load_min_ops: config.load_min_ops,
            load_moved_at: Mutex::new(None),
            tablets_seen: Mutex::new(HashMap::new()),
            leader_since: Mutex::new(None),
        });
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = vec![tokio::spawn(accept_loop(
            shared.clone(),
            listener,
            stop_rx.clone(),
        ))];
        tasks.push(tokio::spawn(init_when_leader(
            shared.clone(),
            stop_rx.clone(),
        )));
        tasks.push(tokio::spawn(monitor(shared.clone(), stop_rx)));

        let lowest = config.members.keys().next().copied();
        if lowest == Some(config.id) && !raft.is_initialized().await? {
            let nodes: BTreeMap<u64, BasicNode> = config
                .members
                .iter()
                .map(|(id, addr)| (*id, BasicNode::new(addr)))
                .collect();
            match raft.initialize(nodes).await {
                Ok(()) => tracing::info!("initialized a new coordinator group"),
                Err(e) => {
                    tracing::info!(error = %e, "the coordinator group is initialized already")
                }
            }
        }
        Ok(Coordinator {
            address,
            raft,
            stop,
            tasks,
        })
    }

    /// Where this member listens.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Stops accepting, closes the connections and stops Raft.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
        if let Err(e) = self.raft.shutdown().await {
            tracing::warn!(error = %e, "Raft did not stop cleanly");
        }
    }
}

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    connections.spawn(serve(shared.clone(), stream, peer));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    connections.shutdown().await;
}

async fn serve(shared: Arc<Shared>, mut stream: TcpStream, peer: SocketAddr) {
    loop {
        let request = match read_frame::<_, Request>(&mut stream).await {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "closing a coordinator connection");
                return;
            }
        };
        let response = answer(&shared, request).await;
        if let Err(e) = write_frame(&mut stream, &response).await {
            tracing::warn!(%peer, error = %e, "cannot answer; closing the connection");
            return;
        }
    }
}

/// Proposes `Init` whenever this member leads a group whose state is not initialized.
async fn init_when_leader(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut metrics = shared.raft.metrics();
    loop {
        let leading = metrics.borrow().state == ServerState::Leader;
        let initialized = shared.machine_read(|m| m.state.initialized);
        if leading && !initialized {
            let command = Command::Init {
                cluster_id: rand::random::<u64>(),
                initial_servers: shared.initial_servers,
                default_mode: shared.default_mode,
                default_replicas: shared.default_replicas,
            };
            match shared.propose(command).await {
                Ok(_) => tracing::info!("initialized the cluster state"),
                Err(e) => {
                    tracing::warn!(answer = ?e, "proposing Init failed; retrying");
                    tokio::select! {
                        _ = stop.changed() => return,
                        _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    }
                }
            }
            continue;
        }
        tokio::select! {
            _ = stop.changed() => return,
            changed = metrics.changed() => if changed.is_err() { return },
        }
    }
}

/// On the leader: declares dead every server that has been silent for `dead_after` (or that a
/// peer reported, once its lease has run out) and fails a probe; resumes restores that wait for
/// memory once the servers' reports show room for them.
async fn monitor(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut ticker = tokio::time::interval(MONITOR_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut room_checked = Instant::now();
    let mut planned = Instant::now();
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = ticker.tick() => {}
        }
        if shared.not_leader().is_some() {
            *shared
                .leader_since
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = None;
            continue;
        }
        let since = *shared
            .leader_since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(Instant::now);
        if room_checked.elapsed() >= ROOM_CHECK_EVERY {
            room_checked = Instant::now();
            shared.resume_waiting().await;
        }
        if planned.elapsed() >= PLAN_EVERY {
            planned = Instant::now();
            shared.plan_moves().await;
            shared.plan_splits().await;
            shared.plan_load().await;
        }
        let candidates = shared.silent_servers(since);
        if candidates.is_empty() {
            continue;
        }
        let mut probes = JoinSet::new();
        for (id, epoch, address, reason) in candidates {
            probes.spawn(async move { (id, epoch, reason, probe(address).await) });
        }
        while let Some(Ok((id, epoch, reason, answered))) = probes.join_next().await {
            if let Err(e) = answered {
                // Still silent after the probe?
                if !shared.silent_servers(since).iter().any(|c| c.0 == id) {
                    continue;
                }
                let reason = format!("{reason}; probe: {e}");
                tracing::warn!(server = id, epoch, %reason, "declaring a server dead");
                match shared
                    .propose(Command::DeclareDead {
                        server: id,
                        epoch,
                        reason,
                        room: Some(shared.room_snapshot(Some(id))),
                    })
                    .await
                {
                    Ok(_) => shared.log_recovery_plan(id),
                    Err(e) => tracing::warn!(server = id, answer = ?e, "declaring failed"),
                }
            } else {
                tracing::warn!(
                    server = id,
                    %reason,
                    "a silent server answers its probe: not declared dead (it stops serving when its lease runs out)"
                );
            }
        }
    }
}

/// Connects to a server's RESP port and expects an answer to PING within [`PROBE_TIMEOUT`].
async fn probe(address: SocketAddr) -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut s = TcpStream::connect(address).await?;
        s.write_all(b"PING\r\n").await?;
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::Error::other("closed without an answer"));
        }
        Ok(())
    };
    match tokio::time::timeout(PROBE_TIMEOUT, exchange).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("{address}: {e}")),
        Err(_) => Err(format!(
            "{address}: no answer within {} ms",
            PROBE_TIMEOUT.as_millis()
        )),
    }
}

async fn answer(shared: &Shared, request: Request) -> Response {
    match request {
        Request::Raft { rpc, body } => shared.raft_rpc(rpc, body).await,
        Request::Status => Response::Status(shared.status()),
        other => {
            if let Some(not_leader) = shared.not_leader() {
                return not_leader;
            }
            shared.leader_request(other).await
        }
    }
}

impl Shared {
    fn machine_read<T>(&self, f: impl FnOnce(&Machine) -> T) -> T {
        f(&self.machine.read().unwrap_or_else(|p| p.into_inner()))
    }

    fn map(&self) -> ClusterMap {
        self.machine_read(|m| m.state.map.clone())
    }

    fn metrics(&self) -> RaftMetrics<u64, BasicNode> {
        self.raft.metrics().borrow().clone()
    }

    fn address_of(metrics: &RaftMetrics<u64, BasicNode>, id: u64) -> Option<String> {
        metrics
            .membership_config
            .membership()
            .get_node(&id)
            .map(|n| n.addr.clone())
    }

    /// The servers heard from within the detection time and well after `server` was last heard
    /// from (more than [`HEARD_AFTER`] later): they kept going without it. None if `server`
    /// was never heard from by this leader (it may have restarted since).
    fn heard_after(&self, server: ServerId) -> Vec<ServerId> {
        let heartbeats = self.heartbeats.lock().unwrap_or_else(|p| p.into_inner());
        let Some(&silent_since) = heartbeats.get(&server) else {
            return Vec::new();
        };
        heartbeats
            .iter()
            .filter(|(&id, &t)| {
                id != server && t.elapsed() < self.dead_after && t > silent_since + HEARD_AFTER
            })
            .map(|(&id, _)| id)
            .collect()
    }

    /// Up servers silent for `dead_after` (counted from `since` at the earliest), or reported by a
    /// peer and silent for longer than their lease: (id, epoch, resp address, why).
    fn silent_servers(&self, since: Instant) -> Vec<(ServerId, u64, SocketAddr, String)> {
        let map = self.map();
        let heartbeats = self.heartbeats.lock().unwrap_or_else(|p| p.into_inner());
        let suspicions = self.suspicions.lock().unwrap_or_else(|p| p.into_inner());
        let lease = self.lease();
        map.servers
            .iter()
            .filter(|s| s.state == ramlog_cluster::ServerState::Up)
            .filter_map(|s| {
                let last = heartbeats.get(&s.id).map_or(since, |t| (*t).max(since));
                let silent = last.elapsed();
                let reason = if silent >= self.dead_after {
                    format!("no heartbeat for {} ms", silent.as_millis())
                } else {
                    let (reporter, why, when) = suspicions.get(&s.id)?;
                    if when.elapsed() > SUSPICION_FRESH || silent < lease + MONITOR_EVERY * 2 {
                        return None;
                    }
                    format!(
                        "server {reporter} reports: {why}; no heartbeat for {} ms",
                        silent.as_millis()
                    )
                };
                Some((s.id, s.epoch, s.addresses.resp, reason))
            })
            .collect()
    }

    /// Records that server `id` was heard from now (a heartbeat or a registration).
    fn note_heard(&self, id: ServerId) {
        self.heartbeats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Instant::now());
    }

    /// How long a server may serve after sending a heartbeat that was answered.
    fn lease(&self) -> Duration {
        self.dead_after * 3 / 4
    }

    /// A live server reports a live peer that cannot do its part (a backup that refuses what its
    /// master serves, even re-sent): the peer is declared dead at its current epoch, without a
    /// probe (it would answer one), and replaced as after a crash. A report from a server that is
    /// not up, or about a server that is not up, changes nothing.
    async fn declare_failing(
        &self,
        reporter: ServerId,
        suspect: ServerId,
        reason: String,
    ) -> Response {
        let map = self.map();
        let up = |id: ServerId| {
            map.server(id)
                .filter(|s| s.state == ramlog_cluster::ServerState::Up)
                .map(|s| s.epoch)
        };
        let (Some(_), Some(epoch)) = (up(reporter), up(suspect)) else {
            tracing::warn!(reporter, suspect, %reason, "a failing report about or from a server that is not up; ignored");
            return Response::Noted;
        };
        if reporter == suspect {
            return Response::Noted;
        }
        let reason = format!("server {reporter} reports that it fails: {reason}");
        tracing::warn!(server = suspect, epoch, %reason, "declaring a server dead");
        match self
            .propose(Command::DeclareDead {
                server: suspect,
                epoch,
                reason,
                room: Some(self.room_snapshot(Some(suspect))),
            })
            .await
        {
            Ok(_) => {
                self.log_recovery_plan(suspect);
                Response::Noted
            }
            Err(answer) => answer,
        }
    }

    /// A live master reports that its backup `suspect` has acknowledged nothing for
    /// `cut_off_after_ms` while its writes waited. If this leader still
    /// hears from the backup (a partition between the two alone; a silent one is the failure
    /// detector's), the backup leaves the backup sets of the master's tablets and is replaced
    /// (`Command::DropBackup`), so that the master's writes stop waiting for it.
    async fn cut_off(&self, reporter: ServerId, suspect: ServerId, reason: String) -> Response {
        let heard = self
            .heartbeats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&suspect)
            .is_some_and(|t| t.elapsed() < LIVE_HEARTBEAT);
        let master_epoch = self
            .map()
            .server(reporter)
            .filter(|s| s.state == ramlog_cluster::ServerState::Up)
            .map(|s| s.epoch);
        let Some(master_epoch) = master_epoch.filter(|_| heard && reporter != suspect) else {
            self.suspicions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(suspect, (reporter, reason, Instant::now()));
            return Response::Noted;
        };
        let reason = format!("server {reporter} cannot reach its backup {suspect}: {reason}");
        match self
            .propose(Command::DropBackup {
                master: reporter,
                master_epoch,
                backup: suspect,
                reason: reason.clone(),
            })
            .await
        {
            Ok((CommandOutcome::Noted { applied: true }, _)) => {
                tracing::warn!(master = reporter, backup = suspect, %reason, "backup cut off from its master's tablets; replaced");
                Response::Noted
            }
            Ok(_) => Response::Noted,
            Err(answer) => answer,
        }
    }

    /// Logs, after a declaration, which tablets recover where.
    fn log_recovery_plan(&self, dead: ServerId) {
        let map = self.map();
        let mut by_restorer: BTreeMap<Option<ServerId>, usize> = BTreeMap::new();
        for t in map
            .tablets
            .iter()
            .filter(|t| t.recovering && t.master == dead)
        {
            *by_restorer.entry(t.restorer).or_default() += 1;
        }
        let waiting = map
            .tablets
            .iter()
            .filter(|t| t.recovering && t.master == dead && t.waiting.is_some())
            .count();
        for (restorer, tablets) in by_restorer {
            match restorer {
                Some(r) => tracing::warn!(dead, restorer = r, tablets, "tablets recovering"),
                None if tablets > waiting => tracing::error!(
                    dead,
                    tablets = tablets - waiting,
                    "tablets wait for a backup: none of their backups is up"
                ),
                None => {}
            }
        }
        if waiting > 0 {
            tracing::error!(
                dead,
                tablets = waiting,
                "tablets wait for memory: no live backup has room to restore them (each is logged)"
            );
        }
        let replaced = map.tablets.iter().filter(|t| !t.fresh.is_empty()).count();
        if replaced > 0 {
            tracing::warn!(tablets = replaced, "tablets copy to replacement backups");
        }
    }

    /// The memory snapshot to plan restores by: every live server's latest reported room, and
    /// the live bytes of each recovering tablet (as the state kept them from the master's death,
    /// else as its master last reported) and of every tablet of `dead` (about to be declared).
    /// A server's report sent before it last took over a restored tablet may not count that
    /// tablet's memory: it counts as no more than what the state kept for it.
    fn room_snapshot(&self, dead: Option<ServerId>) -> Room {
        let (held, up, recovering) = self.machine_read(|m| {
            let map = &m.state.map;
            let up: Vec<ServerId> = map.up_servers().map(|s| s.id).collect();
            let recovering: Vec<(TableId, u16, ServerId)> = map
                .tablets
                .iter()
                .filter(|t| t.recovering)
                .map(|t| (t.table, t.first_slot, t.master))
                .collect();
            (m.state.room.clone().unwrap_or_default(), up, recovering)
        });
        let reports = self.reports.lock().unwrap_or_else(|p| p.into_inner());
        let recovered_at = self.recovered_at.lock().unwrap_or_else(|p| p.into_inner());
        let mut room = Room::default();
        for id in up {
            let Some(report) = reports.get(&id) else {
                continue;
            };
            let mut bytes = report.memory.room_bytes;
            if recovered_at.get(&id).is_some_and(|at| report.at <= *at) {
                bytes = bytes.min(held.server(id).unwrap_or(bytes));
            }
            room.servers.insert(id, bytes);
        }
        let reported = |master: ServerId, table: TableId, first_slot: u16| {
            reports.get(&master).and_then(|r| {
                r.memory
                    .tablets
                    .iter()
                    .find(|b| (b.table, b.first_slot) == (table, first_slot))
                    .copied()
            })
        };
        let mut tablets: BTreeMap<(TableId, u16), TabletBytes> = BTreeMap::new();
        if let Some(report) = dead.and_then(|d| reports.get(&d)) {
            for b in &report.memory.tablets {
                tablets.insert((b.table, b.first_slot), *b);
            }
        }
        for (table, first_slot, master) in recovering {
            let known = held
                .tablet(table, first_slot)
                .copied()
                .or_else(|| reported(master, table, first_slot));
            if let Some(b) = known {
                tablets.insert((table, first_slot), b);
            }
        }
        room.tablets = tablets.into_values().collect();
        room.partition = Some(self.recovery_partition);
        room
    }

    /// On the leader: proposes the moves that drains and rebalancing call for
    /// ([`ramlog_cluster::balance`]), ends rebalancing once the servers are balanced, and
    /// removes drained servers (declared dead: they are fenced and stop).
    async fn plan_moves(&self) {
        let map = self.machine_read(|m| m.state.map.clone());
        let draining = map
            .servers
            .iter()
            .any(|s| s.draining && s.state == ramlog_cluster::ServerState::Up);
        if !draining && !map.rebalancing {
            return;
        }
        let room = self.room_snapshot(None);
        let mut moves = balance::drain_moves(&map, &room, DRAIN_MOVES_IN_FLIGHT);
        if !draining && map.rebalancing {
            moves = balance::rebalance_moves(&map, &room, 1);
            let busy = map
                .tablets
                .iter()
                .any(|t| t.migration.is_some() || t.recovering);
            if moves.is_empty() && !busy {
                match self.propose(Command::Rebalance { on: false }).await {
                    Ok(_) => tracing::warn!("servers balanced: rebalancing ends"),
                    Err(e) => tracing::warn!(answer = ?e, "ending rebalancing failed"),
                }
                return;
            }
        }
        for m in moves {
            let command = Command::MoveTablet {
                table: m.table,
                first_slot: m.first_slot,
                target: m.target,
            };
            match self.propose(command).await {
                Ok(_) => tracing::warn!(
                    table = m.table,
                    first_slot = m.first_slot,
                    target = m.target,
                    reason = if draining { "drain" } else { "rebalance" },
                    "tablet migration started"
                ),
                Err(e) => tracing::warn!(answer = ?e, "a planned move was refused"),
            }
        }
        for (server, epoch) in balance::drained(&map) {
            let command = Command::DeclareDead {
                server,
                epoch,
                reason: "drained: it holds no tablet any more".into(),
                room: Some(self.room_snapshot(Some(server))),
            };
            match self.propose(command).await {
                Ok(_) => tracing::warn!(server, "server drained: removed from the cluster"),
                Err(e) => tracing::warn!(server, answer = ?e, "removing a drained server failed"),
            }
        }
    }

    /// On the leader: splits the tablets whose masters report more live bytes than
    /// `split_bytes` (see `--split-mib`), at the middle of their slots, one per master at a time,
    /// and merges adjacent small ones back.
    /// Tablets that cannot split now (moving, recovering, still copying to a backup, of a
    /// mirrored table, one slot) wait for a later round or stay whole.
    async fn plan_splits(&self) {
        if self.split_bytes == 0 {
            return;
        }
        let map = self.machine_read(|m| m.state.map.clone());
        let mirrored: Vec<TableId> = map
            .tables
            .iter()
            .filter(|t| t.mode == ramlog_cluster::ReplicationMode::Mirror)
            .map(|t| t.id)
            .collect();
        let mut splits = Vec::new();
        {
            let reports = self.reports.lock().unwrap_or_else(|p| p.into_inner());
            for s in map.up_servers() {
                if map
                    .tablets
                    .iter()
                    .any(|t| t.master == s.id && t.split.is_some())
                {
                    continue;
                }
                let Some(report) = reports.get(&s.id) else {
                    continue;
                };
                let largest = report
                    .memory
                    .tablets
                    .iter()
                    .filter(|b| b.live_bytes > self.split_bytes)
                    .filter_map(|b| {
                        let t = map
                            .tablet_at(b.table, b.first_slot)
                            .filter(|t| t.first_slot == b.first_slot && t.master == s.id)?;
                        let splittable = t.last_slot > t.first_slot
                            && !t.recovering
                            && t.migration.is_none()
                            && t.pending.is_empty()
                            && t.logs_from.is_none()
                            && !mirrored.contains(&t.table);
                        splittable.then_some((b.live_bytes, t.table, t.first_slot, t.middle_slot()))
                    })
                    .max();
                splits.extend(largest);
            }
        }
        // Two adjacent tablets of one master and backup set merge back when both together hold
        // less than a quarter of the split size and lie in one of the tablets the table was
        // created with (split halves, recovery partitions); those never merge with each other.
        let mut merges = Vec::new();
        let settled: Vec<(TableId, u16)> = {
            let mut seen = self.tablets_seen.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            seen.retain(|k, _| {
                map.tablets
                    .iter()
                    .any(|t| (t.table, t.first_slot, t.epoch) == *k)
            });
            map.tablets
                .iter()
                .filter(|t| {
                    let since = *seen.entry((t.table, t.first_slot, t.epoch)).or_insert(now);
                    now.duration_since(since) >= MERGE_AFTER
                })
                .map(|t| (t.table, t.first_slot))
                .collect()
        };
        {
            let reports = self.reports.lock().unwrap_or_else(|p| p.into_inner());
            let bytes_of = |t: &ramlog_cluster::TabletInfo| {
                reports.get(&t.master).and_then(|r| {
                    r.memory
                        .tablets
                        .iter()
                        .find(|b| (b.table, b.first_slot) == (t.table, t.first_slot))
                        .map(|b| b.live_bytes)
                })
            };
            let mut busy: Vec<ServerId> = map
                .tablets
                .iter()
                .filter(|t| t.split.is_some() || t.merge.is_some())
                .map(|t| t.master)
                .collect();
            for t in &map.tablets {
                let Some(n) = map.next_tablet(t) else {
                    continue;
                };
                let one_origin = map
                    .tables
                    .iter()
                    .find(|x| x.id == t.table)
                    .and_then(|x| x.creation_range(t.first_slot))
                    .is_some_and(|(_, last)| n.last_slot <= last);
                let mut a = t.backups.clone();
                let mut b = n.backups.clone();
                a.sort_unstable();
                b.sort_unstable();
                let idle = |x: &ramlog_cluster::TabletInfo| {
                    !x.recovering
                        && x.migration.is_none()
                        && x.split.is_none()
                        && x.merge.is_none()
                        && !x.merge_ready
                        && x.pending.is_empty()
                        && x.logs_from.is_none()
                };
                let small = match (bytes_of(t), bytes_of(n)) {
                    (Some(x), Some(y)) => x + y < self.split_bytes / 4,
                    _ => false,
                };
                if n.master == t.master
                    && a == b
                    && settled.contains(&(t.table, t.first_slot))
                    && settled.contains(&(n.table, n.first_slot))
                    && !mirrored.contains(&t.table)
                    && idle(t)
                    && idle(n)
                    && small
                    && one_origin
                    && !busy.contains(&t.master)
                    && !splits.iter().any(|s| (s.1, s.2) == (t.table, t.first_slot))
                {
                    busy.push(t.master);
                    merges.push((t.table, t.first_slot));
                }
            }
        }
        for (table, first_slot) in merges {
            match self
                .propose(Command::MergeTablets { table, first_slot })
                .await
            {
                Ok(_) => tracing::warn!(
                    table,
                    first_slot,
                    "tablet merge started: two adjacent small tablets"
                ),
                Err(e) => tracing::warn!(answer = ?e, "a planned merge was refused"),
            }
        }
        for (bytes, table, first_slot, at) in splits {
            let command = Command::SplitTablet {
                table,
                first_slot,
                at,
            };
            match self.propose(command).await {
                Ok(_) => tracing::warn!(
                    table,
                    first_slot,
                    at,
                    live_bytes = bytes,
                    limit = self.split_bytes,
                    "tablet split started: it grew past the split size"
                ),
                Err(e) => tracing::warn!(answer = ?e, "a planned split was refused"),
            }
        }
    }

    /// On the leader: moves a tablet off a server that is hot by load ([`balance::load_move`]),
    /// at most one move every [`LOAD_MOVE_EVERY`], never while rebalancing by memory or
    /// draining.
    async fn plan_load(&self) {
        if self.load_min_ops == 0 {
            return;
        }
        if self
            .load_moved_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|at| at.elapsed() < LOAD_MOVE_EVERY)
        {
            return;
        }
        let map = self.machine_read(|m| m.state.map.clone());
        if map.rebalancing || map.servers.iter().any(|s| s.draining) {
            return;
        }
        let rates: BTreeMap<(TableId, u16), u64> = {
            let reports = self.reports.lock().unwrap_or_else(|p| p.into_inner());
            map.tablets
                .iter()
                .filter_map(|t| {
                    let r = reports.get(&t.master)?;
                    let b = r
                        .memory
                        .tablets
                        .iter()
                        .find(|b| (b.table, b.first_slot) == (t.table, t.first_slot))?;
                    Some(((t.table, t.first_slot), b.ops_per_sec))
                })
                .collect()
        };
        let Some(m) = balance::load_move(&map, &rates, self.load_min_ops) else {
            return;
        };
        let rate = rates.get(&(m.table, m.first_slot)).copied().unwrap_or(0);
        let command = Command::MoveTablet {
            table: m.table,
            first_slot: m.first_slot,
            target: m.target,
        };
        match self.propose(command).await {
            Ok(_) => {
                *self.load_moved_at.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(Instant::now());
                tracing::warn!(
                    table = m.table,
                    first_slot = m.first_slot,
                    target = m.target,
                    ops_per_sec = rate,
                    reason = "load",
                    "tablet migration started: its server is hot"
                );
            }
            Err(e) => tracing::warn!(answer = ?e, "a planned move for load was refused"),
        }
    }

    /// Proposes a fresh [`Room`] snapshot when it would give a restorer to a tablet that waits
    /// for memory (the servers' reports show room: keys were deleted, a server joined).
    async fn resume_waiting(&self) {
        if !self.machine_read(|m| m.state.map.tablets.iter().any(|t| t.waiting.is_some())) {
            return;
        }
        let command = Command::Room {
            room: self.room_snapshot(None),
        };
        let resumed = self.machine_read(|m| {
            let mut trial = m.state.clone();
            if trial.apply(&command).is_err() {
                return 0;
            }
            m.state
                .map
                .tablets
                .iter()
                .zip(&trial.map.tablets)
                .filter(|(before, after)| before.waiting.is_some() && after.restorer.is_some())
                .count()
        });
        if resumed == 0 {
            return;
        }
        match self.propose(command).await {
            Ok((_, map)) => {
                let still = map.tablets.iter().filter(|t| t.waiting.is_some()).count();
                tracing::warn!(
                    tablets = resumed,
                    still_waiting = still,
                    "servers report room: restores that waited for memory start"
                );
            }
            Err(e) => tracing::warn!(answer = ?e, "proposing a room snapshot failed"),
        }
    }

    /// Logs one line for each tablet that starts waiting for memory, with what it misses.
    fn log_waiting(&self, map: &ClusterMap) {
        let mut logged = self
            .logged_waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        logged.retain(|&(table, first_slot), epoch| {
            map.tablet_at(table, first_slot)
                .is_some_and(|t| t.waiting.is_some() && t.epoch == *epoch)
        });
        for t in map.tablets.iter().filter(|t| t.recovering) {
            let Some(reason) = &t.waiting else {
                continue;
            };
            if logged.insert((t.table, t.first_slot), t.epoch).is_none() {
                tracing::error!(
                    table = t.table,
                    first_slot = t.first_slot,
                    last_slot = t.last_slot,
                    dead_master = t.master,
                    %reason,
                    "tablet waits for memory: clients get CLUSTERDOWN until a backup has room (delete keys, or add a server)"
                );
            }
        }
    }

    /// None when this member leads; else the NotLeader answer.
    fn not_leader(&self) -> Option<Response> {
        let m = self.metrics();
        if m.state == ServerState::Leader && m.current_leader == Some(self.id) {
            return None;
        }
        let leader = m
            .current_leader
            .filter(|l| *l != self.id)
            .and_then(|l| Self::address_of(&m, l));
        Some(Response::NotLeader { leader })
    }

    async fn raft_rpc(&self, rpc: RaftRpc, body: serde_json::Value) -> Response {
        fn bad(rpc: RaftRpc, e: serde_json::Error) -> Response {
            Response::Error(format!("a malformed {rpc:?} request: {e}"))
        }
        let value = match rpc {
            RaftRpc::AppendEntries => match serde_json::from_value(body) {
                Ok(req) => serde_json::to_value(self.raft.append_entries(req).await),
                Err(e) => return bad(rpc, e),
            },
            RaftRpc::Vote => match serde_json::from_value(body) {
                Ok(req) => serde_json::to_value(self.raft.vote(req).await),
                Err(e) => return bad(rpc, e),
            },
            RaftRpc::InstallSnapshot => match serde_json::from_value(body) {
                Ok(req) => serde_json::to_value(self.raft.install_snapshot(req).await),
                Err(e) => return bad(rpc, e),
            },
        };
        match value {
            Ok(v) => Response::Raft(v),
            Err(e) => Response::Error(format!("cannot encode the {rpc:?} answer: {e}")),
        }
    }

    /// The table named `table` and its tablet that holds `slot`, or the error text to answer.
    fn named_tablet(
        &self,
        table: &str,
        slot: u16,
    ) -> Result<(TableId, ramlog_cluster::TabletInfo), String> {
        let map = self.map();
        let Some(info) = map.tables.iter().find(|t| t.name == table) else {
            return Err(CommandError::NoSuchTable(table.to_string()).to_string());
        };
        match map.tablet_at(info.id, slot) {
            Some(t) => Ok((info.id, t.clone())),
            None => Err(format!("no tablet of {table} holds slot {slot}")),
        }
    }

    /// Proposes `command` and waits until it is applied; errors are the answer to send.
    /// Proposes a migration step a server reported; logs `what` when it applied.
    async fn note_migration(&self, command: Command, what: &str) -> Response {
        let (table, first_slot) = match &command {
            Command::MigrationReady {
                table, first_slot, ..
            }
            | Command::MigrationSwitch {
                table, first_slot, ..
            }
            | Command::MigrationAbort {
                table, first_slot, ..
            }
            | Command::SplitReady {
                table, first_slot, ..
            }
            | Command::MergeReady {
                table, first_slot, ..
            }
            | Command::MergeDone {
                table, first_slot, ..
            }
            | Command::MergeAbort {
                table, first_slot, ..
            }
            | Command::SplitDone {
                table, first_slot, ..
            }
            | Command::SplitAbort {
                table, first_slot, ..
            } => (*table, *first_slot),
            _ => (0, 0),
        };
        match self.propose(command).await {
            Ok((CommandOutcome::Noted { applied }, map)) => {
                let t = map.tablet_at(table, first_slot);
                tracing::info!(
                    table,
                    first_slot,
                    applied,
                    master = ?t.map(|t| t.master),
                    epoch = ?t.map(|t| t.epoch),
                    "{what}"
                );
                Response::Noted
            }
            Ok((other, _)) => unexpected_outcome(&other),
            Err(answer) => answer,
        }
    }

    async fn propose(&self, command: Command) -> Result<(CommandOutcome, ClusterMap), Response> {
        let written = tokio::time::timeout(COMMIT_TIMEOUT, self.raft.client_write(command)).await;
        let response = match written {
            Err(_) => {
                return Err(Response::Error(format!(
                    "the change did not commit within {} s: a majority of coordinator members \
                     may be unreachable",
                    COMMIT_TIMEOUT.as_secs()
                )))
            }
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => {
                return Err(Response::NotLeader {
                    leader: f.leader_node.map(|n| n.addr),
                })
            }
            Ok(Err(e)) => return Err(Response::Error(format!("Raft failed: {e}"))),
            Ok(Ok(r)) => r,
        };
        self.log_waiting(&response.data.map);
        match response.data.result {
            Some(Ok(outcome)) => Ok((outcome, response.data.map)),
            Some(Err(e)) => Err(Response::Refused(e)),
            None => Err(Response::Error(
                "the proposal was applied as a Raft entry, not a command".into(),
            )),
        }
    }

    async fn leader_request(&self, request: Request) -> Response {
        match request {
            Request::Suspect {
                reporter,
                suspect,
                reason,
                failing,
                silent_ms,
            } => {
                if failing {
                    return self.declare_failing(reporter, suspect, reason).await;
                }
                if self.cut_off_after_ms > 0 && silent_ms >= self.cut_off_after_ms {
                    return self.cut_off(reporter, suspect, reason).await;
                }
                // Recorded and logged; declaring a server dead is the failure handling's.
                tracing::warn!(reporter, suspect, %reason, "a server reports a suspect peer");
                self.suspicions
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(suspect, (reporter, reason, Instant::now()));
                Response::Noted
            }
            Request::GetMap => match self.raft.ensure_linearizable().await {
                Ok(_) => Response::Map(self.map()),
                Err(RaftError::APIError(e)) => match e {
                    openraft::error::CheckIsLeaderError::ForwardToLeader(f) => {
                        Response::NotLeader {
                            leader: f.leader_node.map(|n| n.addr),
                        }
                    }
                    other => Response::Error(format!("cannot confirm leadership: {other}")),
                },
                Err(e) => Response::Error(format!("Raft failed: {e}")),
            },
            Request::Heartbeat {
                id,
                epoch,
                map_version,
                memory,
            } => self.heartbeat(id, epoch, map_version, memory),
            Request::Register {
                previous,
                addresses,
                memory_bytes,
                incarnation,
            } => {
                let retried = self.machine_read(|m| {
                    m.state
                        .registered_incarnation(previous.as_ref(), incarnation)
                        .is_some()
                });
                if let (Some(p), false) = (&previous, retried) {
                    // Only a server of this cluster can be a duplicate; another cluster's id is
                    // refused by the state machine with WrongCluster.
                    let live = self.machine_read(|m| {
                        m.state
                            .map
                            .server(p.server_id)
                            .filter(|_| m.state.map.cluster_id == p.cluster_id)
                            .filter(|s| s.state == ramlog_cluster::ServerState::Up)
                            .map(|s| s.addresses.resp.to_string())
                    });
                    let recent = self
                        .heartbeats
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get(&p.server_id)
                        .is_some_and(|t| t.elapsed() < LIVE_HEARTBEAT);
                    if let (Some(address), true) = (live, recent) {
                        return Response::Refused(CommandError::DuplicateServer {
                            id: p.server_id,
                            address,
                        });
                    }
                }
                let live = previous
                    .as_ref()
                    .map(|p| self.heard_after(p.server_id))
                    .unwrap_or_default();
                // The registering process counts as heard from now: the detector must not take the
                // silence of the process it replaces (or of a new id) for its own.
                if let Some(p) = &previous {
                    self.note_heard(p.server_id);
                }
                let command = Command::Register {
                    previous,
                    addresses,
                    memory_bytes,
                    live,
                    incarnation,
                };
                match self.propose(command).await {
                    Ok((CommandOutcome::Registered { id, epoch }, map)) => {
                        self.note_heard(id);
                        Response::Registered { id, epoch, map }
                    }
                    Ok((other, _)) => unexpected_outcome(&other),
                    Err(answer) => answer,
                }
            }
            Request::CreateTable {
                name,
                mode,
                replicas,
                schema,
            } => match self
                .propose(Command::CreateTable {
                    name,
                    mode,
                    replicas,
                    schema,
                })
                .await
            {
                Ok((CommandOutcome::TableCreated(info), _)) => Response::TableCreated(info),
                Ok((other, _)) => unexpected_outcome(&other),
                Err(answer) => answer,
            },
            Request::DropTable { name } => match self.propose(Command::DropTable { name }).await {
                Ok((CommandOutcome::TableDropped(id), _)) => Response::TableDropped(id),
                Ok((other, _)) => unexpected_outcome(&other),
                Err(answer) => answer,
            },
            Request::SetTableMode { name, mode } => {
                match self.propose(Command::SetTableMode { name, mode }).await {
                    Ok((CommandOutcome::TableAltered(info), _)) => Response::TableAltered(info),
                    Ok((other, _)) => unexpected_outcome(&other),
                    Err(answer) => answer,
                }
            }
            Request::Recovered {
                server,
                table,
                first_slot,
                epoch,
                objects,
                millis,
            } => {
                let command = Command::TabletRecovered {
                    table,
                    first_slot,
                    epoch,
                    server,
                };
                match self.propose(command).await {
                    Ok((CommandOutcome::Noted { applied }, map)) => {
                        if applied {
                            self.recovered_at
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .insert(server, Instant::now());
                        }
                        let left = map.tablets.iter().filter(|t| t.recovering).count();
                        tracing::info!(
                            server,
                            table,
                            first_slot,
                            epoch,
                            objects,
                            millis,
                            applied,
                            recovering_left = left,
                            "tablet recovered"
                        );
                        if applied {
                            Response::Noted
                        } else {
                            Response::Error(format!(
                                "tablet {table}:{first_slot} at epoch {epoch} is not being restored by server {server}"
                            ))
                        }
                    }
                    Ok((other, _)) => unexpected_outcome(&other),
                    Err(answer) => answer,
                }
            }
            Request::RestoreFailed {
                server,
                table,
                first_slot,
                epoch,
                reason,
                room_bytes,
            } => {
                tracing::warn!(
                    server,
                    table,
                    first_slot,
                    epoch,
                    room_mib = room_bytes >> 20,
                    %reason,
                    "a restore ran out of memory; the server is passed over for the tablet until it reports more room"
                );
                // The room it reports now is its newest figure.
                if let Some(report) = self
                    .reports
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_mut(&server)
                {
                    report.memory.room_bytes = room_bytes;
                    report.at = Instant::now();
                }
                let command = Command::RestoreFailed {
                    table,
                    first_slot,
                    epoch,
                    server,
                    reason,
                    room_bytes: Some(room_bytes),
                };
                match self.propose(command).await {
                    Ok((CommandOutcome::Noted { applied }, map)) => {
                        let now = map.tablet_at(table, first_slot);
                        tracing::info!(
                            table,
                            first_slot,
                            applied,
                            restorer = ?now.and_then(|t| t.restorer),
                            "restore planned again"
                        );
                        Response::Noted
                    }
                    Ok((other, _)) => unexpected_outcome(&other),
                    Err(answer) => answer,
                }
            }
            Request::CopyDone {
                server,
                table,
                first_slot,
                epoch,
                backup,
            } => {
                let command = Command::CopyDone {
                    table,
                    first_slot,
                    epoch,
                    backup,
                };
                match self.propose(command).await {
                    Ok((CommandOutcome::Noted { applied }, map)) => {
                        let left: usize = map.tablets.iter().map(|t| t.pending.len()).sum();
                        tracing::info!(
                            master = server,
                            table,
                            first_slot,
                            backup,
                            applied,
                            copies_left = left,
                            "tablet copied to a backup"
                        );
                        Response::Noted
                    }
                    Ok((other, _)) => unexpected_outcome(&other),
                    Err(answer) => answer,
                }
            }
            Request::MoveTablet {
                table,
                slot,
                target,
            } => {
                let (id, t) = match self.named_tablet(&table, slot) {
                    Ok(found) => found,
                    Err(e) => return Response::Error(e),
                };
                let command = Command::MoveTablet {
                    table: id,
                    first_slot: t.first_slot,
                    target,
                };
                match self.propose(command).await {
                    Ok((CommandOutcome::Noted { .. }, map)) => {
                        let t = map.tablet_at(id, slot);
                        tracing::warn!(
                            table = id,
                            first_slot = ?t.map(|t| t.first_slot),
                            target,
                            phase = ?t.and_then(|t| t.migration).map(|m| m.phase),
                            "tablet migration started"
                        );
                        Response::Noted
                    }
                    Ok((other, _)) => unexpected_outcome(&other),
                    Err(answer) => answer,
                }
            }
            Request::Drain { server } => match self.propose(Command::Drain { server }).await {
                Ok((CommandOutcome::Noted { .. }, _)) => {
                    tracing::warn!(server, "draining a server");
                    Response::Noted
                }
                Ok((other, _)) => unexpected_outcome(&other),
                Err(answer) => answer,
            },
            Request::Rebalance => match self.propose(Command::Rebalance { on: true }).await {
                Ok((CommandOutcome::Noted { .. }, _)) => Response::Noted,
                Ok((other, _)) => unexpected_outcome(&other),
                Err(answer) => answer,
            },
            Request::MigrationReady {
                server,
                table,
                first_slot,
                epoch,
            } => {
                let command = Command::MigrationReady {
                    table,
                    first_slot,
                    epoch,
                    server,
                };
                self.note_migration(command, "migration target ready; the source switches")
                    .await
            }
            Request::MigrationSwitch {
                server,
                table,
                first_slot,
                epoch,
            } => {
                let command = Command::MigrationSwitch {
                    table,
                    first_slot,
                    epoch,
                    source: server,
                };
                self.note_migration(command, "tablet migrated: the target masters it")
                    .await
            }
            Request::MigrationAbort {
                server,
                table,
                first_slot,
                epoch,
                reason,
            } => {
                tracing::warn!(server, table, first_slot, %reason, "migration abandoned");
                let command = Command::MigrationAbort {
                    table,
                    first_slot,
                    epoch,
                    reason,
                };
                self.note_migration(command, "migration abandoned").await
            }
            Request::SplitTablet { table, slot, at } => {
                let (id, t) = match self.named_tablet(&table, slot) {
                    Ok(found) => found,
                    Err(e) => return Response::Error(e),
                };
                let at = at.unwrap_or_else(|| t.middle_slot());
                let command = Command::SplitTablet {
                    table: id,
                    first_slot: t.first_slot,
                    at,
                };
                match self.propose(command).await {
                    Ok((CommandOutcome::Noted { .. }, _)) => {
                        tracing::warn!(
                            table = id,
                            first_slot = t.first_slot,
                            at,
                            "tablet split started"
                        );
                        Response::Noted
                    }
                    Ok((other, _)) => unexpected_outcome(&other),
                    Err(answer) => answer,
                }
            }
            Request::MergeTablets { table, slot } => {
                let (id, t) = match self.named_tablet(&table, slot) {
                    Ok(found) => found,
                    Err(e) => return Response::Error(e),
                };
                let command = Command::MergeTablets {
                    table: id,
                    first_slot: t.first_slot,
                };
                match self.propose(command).await {
                    Ok((CommandOutcome::Noted { .. }, _)) => {
                        tracing::warn!(
                            table = id,
                            first_slot = t.first_slot,
                            "tablet merge started"
                        );
                        Response::Noted
                    }
                    Ok((other, _)) => unexpected_outcome(&other),
                    Err(answer) => answer,
                }
            }
            Request::MergeReady {
                server,
                table,
                first_slot,
                epoch,
            } => {
                let command = Command::MergeReady {
                    table,
                    first_slot,
                    epoch,
                    server,
                };
                self.note_migration(command, "tablet merge copied: its last step begins")
                    .await
            }
            Request::MergeDone {
                server,
                table,
                first_slot,
                epoch,
            } => {
                let command = Command::MergeDone {
                    table,
                    first_slot,
                    epoch,
                    server,
                };
                self.note_migration(command, "tablets merged: one serves both ranges")
                    .await
            }
            Request::MergeAbort {
                server,
                table,
                first_slot,
                epoch,
                reason,
            } => {
                tracing::warn!(server, table, first_slot, %reason, "tablet merge abandoned");
                let command = Command::MergeAbort {
                    table,
                    first_slot,
                    epoch,
                    reason,
                };
                self.note_migration(command, "tablet merge abandoned").await
            }
            Request::SplitReady {
                server,
                table,
                first_slot,
                epoch,
            } => {
                let command = Command::SplitReady {
                    table,
                    first_slot,
                    epoch,
                    server,
                };
                self.note_migration(command, "tablet split copied: its last step begins")
                    .await
            }
            Request::SplitDone {
                server,
                table,
                first_slot,
                at,
                epoch,
            } => {
                let command = Command::SplitDone {
                    table,
                    first_slot,
                    at,
                    epoch,
                    server,
                };
                self.note_migration(command, "tablet split: both halves serve")
                    .await
            }
            Request::SplitAbort {
                server,
                table,
                first_slot,
                epoch,
                reason,
            } => {
                tracing::warn!(server, table, first_slot, %reason, "tablet split abandoned");
                let command = Command::SplitAbort {
                    table,
                    first_slot,
                    epoch,
                    reason,
                };
                self.note_migration(command, "tablet split abandoned").await
            }
            Request::Status | Request::Raft { .. } => {
                Response::Error("internal: this request is not a leader request".into())
            }
        }
    }

    fn heartbeat(
        &self,
        id: ServerId,
        epoch: u64,
        map_version: u64,
        memory: Option<MemoryReport>,
    ) -> Response {
        let (known, map) = self.machine_read(|m| {
            let known = m.state.map.server(id).map(|s| s.epoch);
            let newer = (m.state.map.version > map_version).then(|| m.state.map.clone());
            (known, newer)
        });
        let Some(current) = known else {
            return Response::Refused(CommandError::UnknownServer(id));
        };
        if epoch < current {
            return Response::Fenced {
                reason: format!(
                    "server {id} has epoch {epoch}, but epoch {current} registered since: \
                     another process took over this id"
                ),
            };
        }
        self.note_heard(id);
        if let Some(memory) = memory {
            self.reports
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(
                    id,
                    Report {
                        at: Instant::now(),
                        memory,
                    },
                );
        }
        Response::Heartbeat {
            map,
            lease_ms: self.lease().as_millis() as u64,
        }
    }

    fn status(&self) -> CoordinatorStatus {
        let m = self.metrics();
        let leading = m.state == ServerState::Leader;
        let members = m
            .membership_config
            .membership()
            .nodes()
            .map(|(id, node)| {
                let role = if m.current_leader == Some(*id) {
                    "leader".to_string()
                } else if *id == self.id {
                    role_name(m.state).to_string()
                } else {
                    "follower".to_string()
                };
                let last_applied = if *id == self.id {
                    m.last_applied.map(|l| l.index)
                } else if leading {
                    m.replication
                        .as_ref()
                        .and_then(|r| r.get(id).cloned().flatten())
                        .map(|l| l.index)
                } else {
                    None
                };
                MemberInfo {
                    id: *id,
                    address: node.addr.clone(),
                    role,
                    last_applied,
                }
            })
            .collect();
        let mut heartbeat_age_ms: Vec<(ServerId, u64)> = self
            .heartbeats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(id, t)| (*id, t.elapsed().as_millis() as u64))
            .collect();
        heartbeat_age_ms.sort_unstable();
        CoordinatorStatus {
            member: self.id,
            leader: m.current_leader,
            term: m.current_term,
            members,
            map: self.map(),
            heartbeat_age_ms,
        }
    }
}

fn role_name(state: ServerState) -> &'static str {
    match state {
        ServerState::Leader => "leader",
        ServerState::Follower => "follower",
        ServerState::Candidate => "candidate",
        ServerState::Learner => "learner",
        ServerState::Shutdown => "shutdown",
    }
}

fn unexpected_outcome(outcome: &CommandOutcome) -> Response {
    Response::Error(format!(
        "internal: the command had an unexpected outcome {outcome:?}"
    ))
}
