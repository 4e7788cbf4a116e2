//! The coordinator's replicated state machine. Every change to the map is a [`Command`] in the
//! Raft log; [`ClusterState::apply`] is a pure function of the state and the command, so every
//! coordinator member that applies the same log holds the same map. Anything that is not
//! deterministic (the cluster id, the leader's view of heartbeats, the memory room the servers
//! report) is decided by the leader before it proposes, and travels in the command.
//!
//! Restore planning by memory: servers report with each heartbeat how many bytes they could
//! still take for a restore, and the live bytes of each tablet they master. The leader puts what
//! it last heard into `DeclareDead` and `Room` ([`Room`]); the state keeps the newest, and
//! `repair()` gives a recovering tablet only to a backup whose room covers it
//! ([`restore_need_bytes`]). A tablet no live backup has room for waits, with the reason in the
//! map, until a `Room` command shows room; a restore that ran out of memory anyway comes back as
//! `RestoreFailed`, and its server is passed over for the tablet until it reports more room.

use crate::map::{
    redis_node_name, ClusterMap, Migration, MigrationPhase, Refusal, ReplicationMode,
    ServerAddresses, ServerId, ServerInfo, ServerState, TableInfo, TabletInfo, DEFAULT_TABLE,
    DEFAULT_TABLE_NAME,
};
use crate::placement::place_table;
use ramlog_common::TableId;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// Longest table name.
pub const TABLE_NAME_MAX: usize = 64;
/// Most backups per tablet.
pub const REPLICAS_MAX: u32 = 7;

const MIB: u64 = 1 << 20;

/// Memory a restore of a tablet with `live_bytes` takes on its restorer: its live bytes, a tenth
/// more for the hash index and for segments the cleaner has not yet compacted while the replay
/// appends, and 1 MiB for the tablet's head segment and first index buckets.
pub fn restore_need_bytes(live_bytes: u64) -> u64 {
    live_bytes
        .saturating_add(live_bytes / 10)
        .saturating_add(MIB)
}

/// How large a recovery partition may be: a dead master's tablet above either figure is split
/// into partitions at its declaration, each restored by its own restorer and served the moment
/// it is restored. The leader puts its configured size into each [`Room`] snapshot, so that
/// every member splits alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionSize {
    pub objects: u64,
    pub bytes: u64,
}

impl Default for PartitionSize {
    /// 1 000 000 objects or 128 MiB: about 0.5 s of restore on one idle core here (the bulk
    /// restore inserts 1.5–3 M objects of 100 B per second per core). Every backup restoring
    /// partitions of a tablet reads and merges the tablet's whole logs once (its partitions share
    /// that replay), so a split over two backups costs a second read of them; it pays where the
    /// restorers have cores of their own, not where they share a machine's few (measured at
    /// 1 GiB on 2 cores, before replays were shared: 32 partitions of 335 000 recovered in
    /// 13.0 s, 16 whole tablets in 9.0 s). Clusters on many hosts set it near 250 ms of restore
    /// per core (`--recovery-partition-objects 400000`).
    fn default() -> PartitionSize {
        PartitionSize {
            objects: 1_000_000,
            bytes: 128 * MIB,
        }
    }
}

/// Partitions one tablet splits into, at most.
pub const PARTITIONS_MAX: u64 = 16;

/// How many recovery partitions a dead master's tablet of `size` over `slots` slots is split
/// into: enough that each holds at most `limit` (if its objects spread evenly over its slots),
/// no more than its slots or [`PARTITIONS_MAX`].
pub fn recovery_partitions(size: &TabletBytes, slots: u64, limit: PartitionSize) -> u64 {
    let by_objects = size.objects.div_ceil(limit.objects.max(1));
    let by_bytes = size.live_bytes.div_ceil(limit.bytes.max(1));
    by_objects
        .max(by_bytes)
        .min(PARTITIONS_MAX)
        .min(slots)
        .max(1)
}

/// The live bytes and objects of one tablet, as its master reported them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TabletBytes {
    pub table: TableId,
    pub first_slot: u16,
    pub live_bytes: u64,
    #[serde(default)]
    pub objects: u64,
    /// Reads and writes per second, over the last few heartbeats (0 when not measured).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ops_per_sec: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A snapshot of memory as the leader last heard it in heartbeats: what it plans restores by.
/// Unknown figures (a server that never reported, a tablet whose master did not) plan as if
/// memory did not matter.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Room {
    /// Bytes each server could still take for restores.
    #[serde(default)]
    pub servers: BTreeMap<ServerId, u64>,
    /// Tablets' live bytes, by (table, first slot), ascending.
    #[serde(default)]
    pub tablets: Vec<TabletBytes>,
    /// The largest recovery partition (None: tablets recover whole).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<PartitionSize>,
}

impl Room {
    pub fn server(&self, id: ServerId) -> Option<u64> {
        self.servers.get(&id).copied()
    }

    pub fn tablet(&self, table: TableId, first_slot: u16) -> Option<&TabletBytes> {
        self.tablets
            .binary_search_by_key(&(table, first_slot), |t| (t.table, t.first_slot))
            .ok()
            .map(|i| &self.tablets[i])
    }

    /// What a restore of `t` needs ([`restore_need_bytes`]), if its size is known.
    pub fn need_of(&self, t: &TabletInfo) -> Option<u64> {
        self.tablet(t.table, t.first_slot)
            .map(|b| restore_need_bytes(b.live_bytes))
    }

    /// Takes a newer snapshot: its servers replace these; its tablets replace these where both
    /// have a figure, and the figures it lacks are kept (a dead master reports nothing more).
    fn absorb(&mut self, newer: &Room) {
        self.servers = newer.servers.clone();
        self.partition = newer.partition;
        let mut tablets: BTreeMap<(TableId, u16), TabletBytes> = self
            .tablets
            .iter()
            .map(|t| ((t.table, t.first_slot), *t))
            .collect();
        for t in &newer.tablets {
            tablets.insert((t.table, t.first_slot), *t);
        }
        self.tablets = tablets.into_values().collect();
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// The first command of a new cluster: fixes its id (random, chosen by the leader) and how
    /// many servers must be up before the default table is placed.
    Init {
        cluster_id: u64,
        initial_servers: u32,
        /// The default table's replication mode (None: `sync`).
        #[serde(default)]
        default_mode: Option<ReplicationMode>,
        /// The default table's backups per tablet (None: the default for the cluster's size).
        #[serde(default)]
        default_replicas: Option<u32>,
    },
    /// A server joins: a new id, or an earlier id again (a restart) with the cluster id it was
    /// given. Either way it gets a new epoch.
    Register {
        previous: Option<PreviousIdentity>,
        addresses: ServerAddresses,
        memory_bytes: u64,
        /// The servers the proposing leader heard from well after the previous process of
        /// this id went silent: a tablet they master went on taking writes without it, so
        /// its logs of that tablet are stale.
        #[serde(default)]
        live: Vec<ServerId>,
        /// The registering process's incarnation (0: none given).
        #[serde(default)]
        incarnation: u64,
    },
    CreateTable {
        name: String,
        mode: ReplicationMode,
        /// Backups per tablet; None = the default for the cluster's size (2 with 3 servers, 3 from 4).
        replicas: Option<u32>,
        schema: Option<Vec<u8>>,
    },
    DropTable {
        name: String,
    },
    /// Changes a table's replication mode; writes after the servers see the new map keep it.
    SetTableMode {
        name: String,
        mode: ReplicationMode,
    },
    /// The leader found the server's incarnation `epoch` dead (missed heartbeats and a failed
    /// probe, or a failed probe after a peer's report). Its epoch grows (a returning process is
    /// fenced), its tablets start recovering on their first live backup, and it is replaced in
    /// the backup sets of tablets whose master lives.
    DeclareDead {
        server: ServerId,
        epoch: u64,
        reason: String,
        /// The leader's memory snapshot, the dead master's tablets included: their restorers
        /// are chosen among backups with room for them.
        #[serde(default)]
        room: Option<Room>,
    },
    /// Master `master` (at `master_epoch`) cannot reach its backup `backup`, which the leader
    /// still hears from (a partition between the two alone): `backup` leaves the backup set of
    /// every tablet that `master` serves, and is not chosen again for it while `master` serves
    /// it; `repair` puts a replacement in its place, copied as after a crash. The master's
    /// writes then wait for the other backups only. A tablet whose other backups could not
    /// restore it (none up with its logs) keeps `backup`: its writes go on waiting and fail
    /// after `replication_ack_timeout_ms`, since no acknowledgement could keep its promise.
    DropBackup {
        master: ServerId,
        master_epoch: u64,
        backup: ServerId,
        reason: String,
    },
    /// A fresh memory snapshot from the leader, proposed when a tablet waiting for room would
    /// now fit somewhere: restorers are chosen again for the tablets that wait.
    Room {
        room: Room,
    },
    /// The restorer of a recovering tablet ran out of memory restoring it (and freed what the
    /// restore held). It is passed over for this tablet until it reports clearly more room than
    /// `room_bytes`, what it has now; another backup with room restores it, or it waits.
    RestoreFailed {
        table: TableId,
        first_slot: u16,
        epoch: u64,
        server: ServerId,
        reason: String,
        #[serde(default)]
        room_bytes: Option<u64>,
    },
    /// The restorer of a recovering tablet holds it in memory: it becomes the master.
    TabletRecovered {
        table: TableId,
        first_slot: u16,
        epoch: u64,
        server: ServerId,
    },
    /// The master finished copying the tablet (at `epoch`) to `backup`.
    CopyDone {
        table: TableId,
        first_slot: u16,
        epoch: u64,
        backup: ServerId,
    },
    /// Starts moving the tablet that begins at `first_slot` to `target` (see
    /// [`crate::map::Migration`]).
    MoveTablet {
        table: TableId,
        first_slot: u16,
        target: ServerId,
    },
    /// A migration's target holds the tablet in memory (phase `Building` → `Switching`).
    MigrationReady {
        table: TableId,
        first_slot: u16,
        epoch: u64,
        server: ServerId,
    },
    /// A migration's source stopped taking requests for the tablet and every write it took is
    /// acknowledged by the target and the backups: the target becomes the master.
    MigrationSwitch {
        table: TableId,
        first_slot: u16,
        epoch: u64,
        source: ServerId,
    },
    /// Starts draining `server` (see [`crate::map::ServerInfo::draining`]).
    Drain {
        server: ServerId,
    },
    /// Starts (`true`) or ends rebalancing (see [`crate::map::ClusterMap::rebalancing`]).
    Rebalance {
        on: bool,
    },
    /// Abandons a migration (the source could not drain, or an operator asked): the source
    /// goes on serving; a target added for the move leaves the backup set.
    MigrationAbort {
        table: TableId,
        first_slot: u16,
        epoch: u64,
        reason: String,
    },
    /// Starts splitting the tablet that begins at `first_slot` at slot `at` (see
    /// [`crate::map::TabletInfo::split`]).
    SplitTablet {
        table: TableId,
        first_slot: u16,
        at: u16,
    },
    /// The master copied the split's upper slots in its memory: the tablet freezes for the
    /// split's last step.
    SplitReady {
        table: TableId,
        first_slot: u16,
        epoch: u64,
        server: ServerId,
    },
    /// The master split the tablet's memory at `at` with every write it took acknowledged: the
    /// two halves serve at the next epoch.
    SplitDone {
        table: TableId,
        first_slot: u16,
        at: u16,
        epoch: u64,
        server: ServerId,
    },
    /// The master could not split the tablet (its streams did not drain, or its memory had no
    /// room for the copy): it serves whole again.
    SplitAbort {
        table: TableId,
        first_slot: u16,
        epoch: u64,
        reason: String,
    },
    /// Starts merging the tablet that begins at `first_slot` with the next one (see
    /// [`crate::map::TabletInfo::merge`]).
    MergeTablets {
        table: TableId,
        first_slot: u16,
    },
    /// The master copied the next tablet into this one: both freeze for the last step.
    MergeReady {
        table: TableId,
        first_slot: u16,
        epoch: u64,
        server: ServerId,
    },
    /// The master joined the two tablets in memory with every write acknowledged: one tablet
    /// of both ranges serves at the next epoch.
    MergeDone {
        table: TableId,
        first_slot: u16,
        epoch: u64,
        server: ServerId,
    },
    /// The master could not merge the tablets: both serve as before.
    MergeAbort {
        table: TableId,
        first_slot: u16,
        epoch: u64,
        reason: String,
    },
}

/// What a restarted server remembers of its membership.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreviousIdentity {
    pub cluster_id: u64,
    pub server_id: ServerId,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CommandOutcome {
    Initialized,
    Registered {
        id: ServerId,
        epoch: u64,
    },
    TableCreated(TableInfo),
    TableDropped(TableId),
    TableAltered(TableInfo),
    /// A failure or recovery step was applied (or was stale and changed nothing: `applied` false).
    Noted {
        applied: bool,
    },
}

/// Why a command changed nothing. Every variant is the caller's error, stated so that a person
/// can act on it; the map is left as it was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum CommandError {
    #[error("the cluster is not initialized yet")]
    NotInitialized,
    #[error(
        "this server belongs to cluster {theirs:016x}, but this coordinator runs cluster {ours:016x}: \
         a wrong or stale coordinator address, or a data directory from another cluster"
    )]
    WrongCluster { ours: u64, theirs: u64 },
    #[error("server id {0} is not a member of this cluster")]
    UnknownServer(ServerId),
    #[error("server id {id} is in use by a live server at {address}")]
    DuplicateServer { id: ServerId, address: String },
    #[error("a table named {0:?} exists")]
    TableExists(String),
    #[error("no table named {0:?}")]
    NoSuchTable(String),
    #[error("bad table name {name:?}: {reason}")]
    BadTableName { name: String, reason: String },
    #[error("the default table cannot be dropped")]
    DefaultTable,
    #[error("{replicas} backups per tablet need at least {} live servers; {up} are up", replicas + 1)]
    NotEnoughServers { replicas: u32, up: u32 },
    #[error("replicas must be between 0 and {REPLICAS_MAX}, not {0}")]
    BadReplicas(u32),
    #[error("no server is up to place the table on")]
    NoServers,
    #[error("no tablet of table {table} starts at slot {first_slot}")]
    NoSuchTablet { table: TableId, first_slot: u16 },
    #[error("cannot move the tablet: {0}")]
    CannotMove(String),
    #[error("cannot split the tablet: {0}")]
    CannotSplit(String),
    #[error("cannot merge the tablets: {0}")]
    CannotMerge(String),
}

/// Everything the coordinator replicates.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterState {
    pub map: ClusterMap,
    pub initialized: bool,
    pub initial_servers: u32,
    #[serde(default)]
    pub default_mode: Option<ReplicationMode>,
    #[serde(default)]
    pub default_replicas: Option<u32>,
    pub next_server_id: ServerId,
    pub next_table_id: TableId,
    /// The incarnation (a random number each server process draws when it starts) that
    /// registered each server's current epoch: a `Register` retried by the same process (its
    /// first attempt's answer was lost, or the attempt was committed late) gets the same id and
    /// epoch back instead of fencing the process that sent it.
    #[serde(default)]
    pub incarnations: BTreeMap<ServerId, u64>,
    /// The newest memory snapshot a command carried (see [`Room`]); restorers are chosen by it.
    #[serde(default)]
    pub room: Option<Room>,
}

/// Backups per tablet when a table does not say: 2 in a 3-server cluster, 3 from 4 servers.
pub fn default_replicas(up: u32) -> u32 {
    up.saturating_sub(1).min(3)
}

impl ClusterState {
    /// Applies one command; on error the state is unchanged.
    pub fn apply(&mut self, command: &Command) -> Result<CommandOutcome, CommandError> {
        if !self.initialized && !matches!(command, Command::Init { .. }) {
            return Err(CommandError::NotInitialized);
        }
        let outcome = match command {
            Command::Init {
                cluster_id,
                initial_servers,
                default_mode,
                default_replicas,
            } => {
                if self.initialized {
                    // A second Init (a new leader that had not seen the first) changes nothing.
                    return Ok(CommandOutcome::Initialized);
                }
                self.initialized = true;
                self.initial_servers = (*initial_servers).max(1);
                self.default_mode = *default_mode;
                self.default_replicas = *default_replicas;
                self.map.cluster_id = *cluster_id;
                self.next_server_id = 1;
                self.next_table_id = 1;
                CommandOutcome::Initialized
            }
            Command::Register {
                previous,
                addresses,
                memory_bytes,
                live,
                incarnation,
            } => self.register(
                previous.as_ref(),
                *addresses,
                *memory_bytes,
                live,
                *incarnation,
            )?,
            Command::CreateTable {
                name,
                mode,
                replicas,
                schema,
            } => {
                check_table_name(name)?;
                if self.map.table_by_name(name).is_some() || name == DEFAULT_TABLE_NAME {
                    return Err(CommandError::TableExists(name.clone()));
                }
                let id = self.next_table_id;
                let table = self.place(id, name, *mode, *replicas, schema.clone())?;
                self.next_table_id += 1;
                self.repair();
                CommandOutcome::TableCreated(table)
            }
            Command::DropTable { name } => {
                let Some(table) = self.map.table_by_name(name) else {
                    return Err(CommandError::NoSuchTable(name.clone()));
                };
                let id = table.id;
                if id == DEFAULT_TABLE {
                    return Err(CommandError::DefaultTable);
                }
                self.map.tables.retain(|t| t.id != id);
                self.map.tablets.retain(|t| t.table != id);
                CommandOutcome::TableDropped(id)
            }
            Command::SetTableMode { name, mode } => {
                let Some(table) = self.map.tables.iter_mut().find(|t| t.name == *name) else {
                    return Err(CommandError::NoSuchTable(name.clone()));
                };
                table.mode = *mode;
                let table = table.clone();
                // Mirrors come and go with the mode.
                self.repair();
                CommandOutcome::TableAltered(table)
            }
            Command::DeclareDead {
                server,
                epoch,
                room,
                ..
            } => {
                let current = self.map.server(*server).map(|s| (s.epoch, s.state));
                match current {
                    Some((e, state)) if e == *epoch && state != ServerState::Dead => {
                        self.declare_dead(*server);
                        match room {
                            Some(room) => {
                                self.absorb_room(room);
                                self.split_for_recovery(*server);
                            }
                            // A leader that reports no memory: restores are planned as if
                            // memory did not matter (and tablets recover whole).
                            None => self.room = None,
                        }
                        self.repair();
                    }
                    // An older incarnation, or one declared already: nothing changes.
                    _ => return Ok(CommandOutcome::Noted { applied: false }),
                }
                CommandOutcome::Noted { applied: true }
            }
            Command::Room { room } => {
                self.absorb_room(room);
                self.repair();
                CommandOutcome::Noted { applied: true }
            }
            Command::DropBackup {
                master,
                master_epoch,
                backup,
                ..
            } => {
                if self.drop_backup(*master, *master_epoch, *backup) == 0 {
                    return Ok(CommandOutcome::Noted { applied: false });
                }
                self.repair();
                CommandOutcome::Noted { applied: true }
            }
            Command::RestoreFailed {
                table,
                first_slot,
                epoch,
                server,
                room_bytes,
                ..
            } => {
                let Some(t) = self.map.tablet_mut(*table, *first_slot) else {
                    return Ok(CommandOutcome::Noted { applied: false });
                };
                if !t.recovering || t.epoch != *epoch || t.restorer != Some(*server) {
                    return Ok(CommandOutcome::Noted { applied: false });
                }
                t.restorer = None;
                t.refused.retain(|r| r.server != *server);
                t.refused.push(Refusal {
                    server: *server,
                    room_bytes: room_bytes.unwrap_or(0),
                });
                if let Some(bytes) = room_bytes {
                    self.room
                        .get_or_insert_with(Room::default)
                        .servers
                        .insert(*server, *bytes);
                }
                self.repair();
                CommandOutcome::Noted { applied: true }
            }
            Command::TabletRecovered {
                table,
                first_slot,
                epoch,
                server,
            } => {
                let up: Vec<ServerId> = self.map.up_servers().map(|s| s.id).collect();
                let Some(t) = self.map.tablet_mut(*table, *first_slot) else {
                    return Ok(CommandOutcome::Noted { applied: false });
                };
                if !up.contains(server)
                    || !t.recovering
                    || t.epoch != *epoch
                    || t.restorer != Some(*server)
                {
                    return Ok(CommandOutcome::Noted { applied: false });
                }
                let promoted_mirror = t.mirror == Some(*server);
                t.master = *server;
                t.recovering = false;
                t.restorer = None;
                t.waiting = None;
                t.refused.clear();
                t.backups.retain(|b| b != server);
                // Every remaining live backup receives the new master's copy at this epoch;
                // until then it restores from its older logs and what it received since.
                t.pending = t
                    .backups
                    .iter()
                    .copied()
                    .filter(|b| up.contains(b))
                    .collect();
                t.fresh.retain(|b| b != server);
                // The tablet's memory is taken on its new master now; until a fresh snapshot
                // says how much room is left there, the snapshot held counts it as gone.
                if let Some(room) = &mut self.room {
                    let t = self.map.tablet_at(*table, *first_slot);
                    let need = t.and_then(|t| room.need_of(t));
                    if let (Some(need), Some(left), false) =
                        (need, room.servers.get_mut(server), promoted_mirror)
                    {
                        *left = left.saturating_sub(need);
                    }
                    room.tablets
                        .retain(|b| (b.table, b.first_slot) != (*table, *first_slot));
                }
                self.repair();
                CommandOutcome::Noted { applied: true }
            }
            Command::CopyDone {
                table,
                first_slot,
                epoch,
                backup,
            } => {
                let Some(t) = self.map.tablet_mut(*table, *first_slot) else {
                    return Ok(CommandOutcome::Noted { applied: false });
                };
                if t.epoch != *epoch || t.recovering || !t.pending.contains(backup) {
                    return Ok(CommandOutcome::Noted { applied: false });
                }
                t.pending.retain(|b| b != backup);
                t.fresh.retain(|b| b != backup);
                self.repair();
                CommandOutcome::Noted { applied: true }
            }
            Command::MoveTablet {
                table,
                first_slot,
                target,
            } => {
                self.move_tablet(*table, *first_slot, *target)?;
                self.repair();
                CommandOutcome::Noted { applied: true }
            }
            Command::MigrationReady {
                table,
                first_slot,
                epoch,
                server,
            } => {
                let Some(t) = self.map.tablet_mut(*table, *first_slot) else {
                    return Ok(CommandOutcome::Noted { applied: false });
                };
                match &mut t.migration {
                    Some(m)
                        if t.epoch == *epoch
                            && m.target == *server
                            && m.phase == MigrationPhase::Building =>
                    {
                        m.phase = MigrationPhase::Switching;
                    }
                    _ => return Ok(CommandOutcome::Noted { applied: false }),
                }
                CommandOutcome::Noted { applied: true }
            }
            Command::MigrationSwitch {
                table,
                first_slot,
                epoch,
                source,
            } => {
                let up: Vec<ServerId> = self.map.up_servers().map(|s| s.id).collect();
                let Some(t) = self.map.tablet_mut(*table, *first_slot) else {
                    return Ok(CommandOutcome::Noted { applied: false });
                };
                let Some(m) = t.migration.filter(|m| {
                    t.epoch == *epoch
                        && t.master == *source
                        && !t.recovering
                        && m.phase == MigrationPhase::Switching
                        && up.contains(&m.target)
                }) else {
                    return Ok(CommandOutcome::Noted { applied: false });
                };
                // The target masters the tablet at the next epoch: the source's stream, at the
                // old one, is refused by every backup from now on. Re-replication is deferred
                // to after the switch, with lineage: each backup keeps its logs of the older
                // epochs (they hold everything up to the switch) while it waits for the new
                // master's copy, as after a recovery (`pending`), and drops them once it has it.
                t.master = m.target;
                t.epoch += 1;
                t.backups.retain(|&b| b != m.target);
                t.fresh.retain(|&b| b != m.target);
                t.pending = t
                    .backups
                    .iter()
                    .copied()
                    .filter(|&b| up.contains(&b))
                    .collect();
                if t.mirror == Some(m.target) {
                    t.mirror = None;
                }
                t.migration = None;
                self.repair();
                CommandOutcome::Noted { applied: true }
            }
            Command::Drain { server } => {
                let Some(s) = self.map.server(*server) else {
                    return Err(CommandError::UnknownServer(*server));
                };
                if s.state != ServerState::Up {
                    return Err(CommandError::CannotMove(format!(
                        "server {server} is not up"
                    )));
                }
                let left = self
                    .map
                    .up_servers()
                    .filter(|s| s.id != *server && !s.draining)
                    .count() as u32;
                if let Some(t) = self.map.tables.iter().find(|t| t.replicas + 1 > left) {
                    return Err(CommandError::NotEnoughServers {
                        replicas: t.replicas,
                        up: left,
                    });
                }
                if let Some(s) = self.map.servers.iter_mut().find(|s| s.id == *server) {
                    s.draining = true;
                }
                self.repair();
                CommandOutcome::Noted { applied: true }
            }
            Command::Rebalance { on } => {
                let changed = self.map.rebalancing != *on;
                self.map.rebalancing = *on;
                if !changed {
                    return Ok(CommandOutcome::Noted { applied: false });
                }
                CommandOutcome::Noted { applied: true }
            }
            Command::MigrationAbort {
                table,
                first_slot,
                epoch,
                ..
            } => {
                let Some(t) = self.map.tablet_mut(*table, *first_slot) else {
                    return Ok(CommandOutcome::Noted { applied: false });
                };
                if t.epoch != *epoch || t.migration.is_none() {
                    return Ok(CommandOutcome::Noted { applied: false });
                }
                abandon_migration(t);
                self.repair();
                CommandOutcome::Noted { applied: true }
            }
            Command::SplitTablet {
                table,
                first_slot,
                at,
            } => {
                self.split_tablet(*table, *first_slot, *at)?;
                CommandOutcome::Noted { applied: true }
            }
            Command::SplitReady {
                table,
                first_slot,
                epoch,
                server,
            } => {
                let Some(t) = self.map.tablet_mut(*table, *first_slot) else {
                    return Ok(CommandOutcome::Noted { applied: false });
                };
                if t.first_slot != *first_slot
                    || t.epoch != *epoch
                    || t.master != *server
                    || t.split.is_none()
                    || t.split_ready
                {
                    return Ok(CommandOutcome::Noted { applied: false });
                }
                t.split_ready = true;
                CommandOutcome::Noted { applied: true }
            }
            Command::SplitDone {
                table,
                first_slot,
                at,
                epoch,
                server,
            } => {
                if !self.split_done(*table, *first_slot, *at, *epoch, *server) {
                    return Ok(CommandOutcome::Noted { applied: false });
                }
                self.repair();
                CommandOutcome::Noted { applied: true }
            }
            Command::MergeTablets { table, first_slot } => {
                self.merge_tablets(*table, *first_slot)?;
                CommandOutcome::Noted { applied: true }
            }
            Command::MergeReady {
                table,
                first_slot,
                epoch,
                server,
            } => {
                let Some((i, upper_epoch)) = self.merging(*table, *first_slot, *epoch, *server)
                else {
                    return Ok(CommandOutcome::Noted { applied: false });
                };
                if self.map.tablets[i].merge_ready || self.map.tablets[i + 1].epoch != upper_epoch {
                    return Ok(CommandOutcome::Noted { applied: false });
                }
                self.map.tablets[i].merge_ready = true;
                self.map.tablets[i + 1].merge_ready = true;
                CommandOutcome::Noted { applied: true }
            }
            Command::MergeDone {
                table,
                first_slot,
                epoch,
                server,
            } => {
                let up: Vec<ServerId> = self.map.up_servers().map(|s| s.id).collect();
                let Some((i, upper_epoch)) = self.merging(*table, *first_slot, *epoch, *server)
                else {
                    return Ok(CommandOutcome::Noted { applied: false });
                };
                let upper = self.map.tablets[i + 1].clone();
                if !self.map.tablets[i].merge_ready || upper.epoch != upper_epoch {
                    return Ok(CommandOutcome::Noted { applied: false });
                }
                self.map.tablets.remove(i + 1);
                let t = &mut self.map.tablets[i];
                t.merge = None;
                t.merge_ready = false;
                t.last_slot = upper.last_slot;
                t.epoch = t.epoch.max(upper.epoch) + 1;
                t.pending = t
                    .backups
                    .iter()
                    .copied()
                    .filter(|b| up.contains(b))
                    .collect();
                t.logs_from = Some(upper.first_slot);
                self.repair();
                CommandOutcome::Noted { applied: true }
            }
            Command::MergeAbort {
                table,
                first_slot,
                epoch,
                ..
            } => {
                let Some(i) = self.map.tablets.iter().position(|t| {
                    t.table == *table && t.first_slot == *first_slot && t.epoch == *epoch
                }) else {
                    return Ok(CommandOutcome::Noted { applied: false });
                };
                if self.map.tablets[i].merge.is_none() {
                    return Ok(CommandOutcome::Noted { applied: false });
                }
                self.map.tablets[i].merge = None;
                self.map.tablets[i].merge_ready = false;
                if let Some(n) = self.map.tablets.get_mut(i + 1) {
                    if n.table == *table {
                        n.merge_ready = false;
                    }
                }
                CommandOutcome::Noted { applied: true }
            }
            Command::SplitAbort {
                table,
                first_slot,
                epoch,
                ..
            } => {
                let Some(t) = self.map.tablet_mut(*table, *first_slot) else {
                    return Ok(CommandOutcome::Noted { applied: false });
                };
                if t.first_slot != *first_slot || t.epoch != *epoch || t.split.is_none() {
                    return Ok(CommandOutcome::Noted { applied: false });
                }
                t.split = None;
                t.split_ready = false;
                CommandOutcome::Noted { applied: true }
            }
        };
        self.map.version += 1;
        Ok(outcome)
    }

    /// The id and epoch that this incarnation registered already, if the server is still up
    /// under them (a retried `Register`).
    pub fn registered_incarnation(
        &self,
        previous: Option<&PreviousIdentity>,
        incarnation: u64,
    ) -> Option<(ServerId, u64)> {
        if incarnation == 0 {
            return None;
        }
        let (&id, _) = self.incarnations.iter().find(|(_, &i)| i == incarnation)?;
        if previous.is_some_and(|p| p.server_id != id || p.cluster_id != self.map.cluster_id) {
            return None;
        }
        let server = self.map.server(id)?;
        (server.state == ServerState::Up).then_some((id, server.epoch))
    }

    fn register(
        &mut self,
        previous: Option<&PreviousIdentity>,
        addresses: ServerAddresses,
        memory_bytes: u64,
        live: &[ServerId],
        incarnation: u64,
    ) -> Result<CommandOutcome, CommandError> {
        let cluster_id = self.map.cluster_id;
        if let Some((id, epoch)) = self.registered_incarnation(previous, incarnation) {
            return Ok(CommandOutcome::Registered { id, epoch });
        }
        let (id, epoch) = match previous {
            Some(p) if p.cluster_id != cluster_id => {
                return Err(CommandError::WrongCluster {
                    ours: cluster_id,
                    theirs: p.cluster_id,
                })
            }
            Some(p) => {
                let Some(state) = self.map.server(p.server_id).map(|s| s.state) else {
                    return Err(CommandError::UnknownServer(p.server_id));
                };
                // The earlier process is gone (this one replaces it): what it mastered is
                // recovered by its backups, it leaves the backup sets of live tablets, and its
                // epoch is fenced. A declaration already did all that; the new process takes the
                // epoch the declaration fenced the old one with.
                if state != ServerState::Dead {
                    self.declare_dead(p.server_id);
                }
                let Some(server) = self.map.servers.iter_mut().find(|s| s.id == p.server_id) else {
                    return Err(CommandError::UnknownServer(p.server_id));
                };
                let id = server.id;
                // Tablets with a master that is up and still list it get their copy again.
                // Where the master was heard from after this server went silent, it went on
                // without it: its logs miss writes and deletes, so it drops them and cannot
                // restore the tablet until its copy is complete (fresh). Otherwise (the master
                // may have died with it, as in a whole-cluster restart) its logs stay and count.
                let up: Vec<ServerId> = self.map.up_servers().map(|s| s.id).collect();
                for t in &mut self.map.tablets {
                    if t.recovering || !up.contains(&t.master) || !t.backups.contains(&id) {
                        continue;
                    }
                    if !t.pending.contains(&id) {
                        t.pending.push(id);
                    }
                    if live.contains(&t.master) && !t.fresh.contains(&id) {
                        t.fresh.push(id);
                    }
                }
                let Some(server) = self.map.servers.iter_mut().find(|s| s.id == p.server_id) else {
                    return Err(CommandError::UnknownServer(p.server_id));
                };
                server.addresses = addresses;
                server.state = ServerState::Up;
                server.memory_bytes = memory_bytes;
                server.draining = false;
                (server.id, server.epoch)
            }
            None => {
                let id = self.next_server_id;
                self.next_server_id += 1;
                self.map.servers.push(ServerInfo {
                    id,
                    name: redis_node_name(cluster_id, id),
                    addresses,
                    epoch: 1,
                    state: ServerState::Up,
                    memory_bytes,
                    draining: false,
                });
                // A server that joins a formed cluster takes a fair share of the tablets.
                if self.map.table(DEFAULT_TABLE).is_some() {
                    self.map.rebalancing = true;
                }
                (id, 1)
            }
        };
        if incarnation != 0 {
            self.incarnations.insert(id, incarnation);
        } else {
            self.incarnations.remove(&id);
        }
        self.repair();
        let up = self.map.up_servers().count() as u32;
        if self.map.table(DEFAULT_TABLE).is_none() && up >= self.initial_servers {
            // More replicas than the live servers allow are cut to what they allow.
            let replicas = self.default_replicas.map(|r| r.min(up.saturating_sub(1)));
            self.place(
                DEFAULT_TABLE,
                DEFAULT_TABLE_NAME,
                self.default_mode.unwrap_or_default(),
                replicas,
                None,
            )?;
            self.repair();
        }
        Ok(CommandOutcome::Registered { id, epoch })
    }

    /// Marks `server` dead and fences its incarnation; its tablets start recovering.
    fn declare_dead(&mut self, server: ServerId) {
        if let Some(s) = self.map.servers.iter_mut().find(|s| s.id == server) {
            s.state = ServerState::Dead;
            s.epoch += 1;
        }
        for t in &mut self.map.tablets {
            if t.master == server && !t.recovering {
                t.recovering = true;
                t.restorer = None;
                t.waiting = None;
                t.refused.clear();
                // Backups refuse the dead master's epoch from the moment they see this map.
                t.epoch += 1;
            }
        }
    }

    /// Splits each tablet of the dead `server` that is too large to restore at once into
    /// recovery partitions (RAMCloud's wills, [`recovery_partitions`]): tablets of equal slot
    /// ranges, each recovering on its own (`repair()` spreads their restorers over the backups
    /// that hold the logs), each served the moment it is restored. Every partition keeps the
    /// whole tablet's backups, epoch and copy state, and names the tablet whose logs hold its
    /// objects (`logs_from`). Not split: tablets whose size was not reported, tablets of a
    /// `mirror` table (the mirror holds the whole tablet in memory: it takes over at once), and
    /// partitions whose backups do not all hold their own copy yet (their objects are in two
    /// tablets' logs already).
    fn split_for_recovery(&mut self, server: ServerId) {
        let Some(room) = self.room.as_mut() else {
            return;
        };
        let Some(limit) = room.partition else {
            return;
        };
        let mirrored: Vec<TableId> = self
            .map
            .tables
            .iter()
            .filter(|t| t.mode == ReplicationMode::Mirror)
            .map(|t| t.id)
            .collect();
        let mut tablets = Vec::with_capacity(self.map.tablets.len());
        let mut split: Vec<(u16, TableId)> = Vec::new();
        let mut sizes: Vec<TabletBytes> = Vec::new();
        for t in std::mem::take(&mut self.map.tablets) {
            let size = room.tablet(t.table, t.first_slot).copied();
            let splittable = t.master == server
                && t.recovering
                && t.mirror.is_none()
                && t.logs_from.is_none()
                && !mirrored.contains(&t.table);
            let slots = u64::from(t.last_slot - t.first_slot) + 1;
            let parts = match size.filter(|_| splittable) {
                Some(size) => recovery_partitions(&size, slots, limit),
                None => 1,
            };
            if parts < 2 {
                tablets.push(t);
                continue;
            }
            let size = size.unwrap_or(TabletBytes {
                table: t.table,
                first_slot: t.first_slot,
                live_bytes: 0,
                objects: 0,
                ops_per_sec: 0,
            });
            split.push((t.first_slot, t.table));
            for i in 0..parts {
                let first = u64::from(t.first_slot) + slots * i / parts;
                let last = u64::from(t.first_slot) + slots * (i + 1) / parts - 1;
                let mut p = t.clone();
                p.first_slot = first as u16;
                p.last_slot = last as u16;
                p.logs_from = Some(t.first_slot);
                sizes.push(TabletBytes {
                    table: t.table,
                    first_slot: p.first_slot,
                    live_bytes: size.live_bytes / parts,
                    objects: size.objects / parts,
                    ops_per_sec: 0,
                });
                tablets.push(p);
            }
        }
        tablets.sort_by_key(|t| (t.table, t.first_slot));
        room.tablets
            .retain(|b| !split.contains(&(b.first_slot, b.table)));
        room.tablets.extend(sizes);
        room.tablets.sort_by_key(|b| (b.table, b.first_slot));
        self.map.tablets = tablets;
    }

    /// Keeps `room` as the newest snapshot, with only the tablet figures that restores need
    /// (those of recovering tablets).
    fn absorb_room(&mut self, room: &Room) {
        let held = self.room.get_or_insert_with(Room::default);
        held.absorb(room);
        let tablets = &self.map;
        held.tablets.retain(|b| {
            tablets
                .tablet_at(b.table, b.first_slot)
                .is_some_and(|t| t.recovering && t.first_slot == b.first_slot)
        });
    }

    /// Starts a migration of the tablet at (`table`, `first_slot`) to `target`.
    fn move_tablet(
        &mut self,
        table: TableId,
        first_slot: u16,
        target: ServerId,
    ) -> Result<(), CommandError> {
        let target_up = self
            .map
            .server(target)
            .is_some_and(|s| s.state == ServerState::Up);
        let master = self.map.tablet_at(table, first_slot).map(|t| t.master);
        let cut_off = master.is_some_and(|m| self.map.is_cut_off(m, target));
        let Some(t) = self.map.tablet_mut(table, first_slot) else {
            return Err(CommandError::NoSuchTablet { table, first_slot });
        };
        let refuse = |why: String| Err(CommandError::CannotMove(why));
        if !target_up {
            return refuse(format!("server {target} is not up"));
        }
        if cut_off {
            return refuse(format!(
                "its master, server {}, reported it cannot reach server {target}",
                t.master
            ));
        }
        if t.master == target {
            return refuse(format!("server {target} masters it already"));
        }
        if t.recovering {
            return refuse("it is being recovered".into());
        }
        if let Some(m) = &t.migration {
            return refuse(format!("it is moving to server {} already", m.target));
        }
        if let Some(at) = t.split {
            return refuse(format!("it is splitting at slot {at}"));
        }
        if t.merge.is_some() || t.merge_ready {
            return refuse("it is merging".into());
        }
        let added = !t.backups.contains(&target);
        if added {
            // A backup while it fills: copied like any new backup, then an extra one.
            t.backups.push(target);
            t.pending.push(target);
            t.fresh.push(target);
        }
        let phase = if t.pending.contains(&target) {
            MigrationPhase::Copying
        } else {
            MigrationPhase::Building
        };
        t.migration = Some(Migration {
            target,
            phase,
            added,
        });
        Ok(())
    }

    /// Starts splitting the tablet at (`table`, `first_slot`) at slot `at`.
    fn split_tablet(
        &mut self,
        table: TableId,
        first_slot: u16,
        at: u16,
    ) -> Result<(), CommandError> {
        let mirrored = self
            .map
            .tables
            .iter()
            .any(|x| x.id == table && x.mode == ReplicationMode::Mirror);
        let master_up = |m: ServerId, map: &ClusterMap| {
            map.server(m).is_some_and(|s| s.state == ServerState::Up)
        };
        let Some(t) = self
            .map
            .tablet_at(table, first_slot)
            .filter(|t| t.first_slot == first_slot)
        else {
            return Err(CommandError::NoSuchTablet { table, first_slot });
        };
        let refuse = |why: String| Err(CommandError::CannotSplit(why));
        if at <= t.first_slot || at > t.last_slot {
            return refuse(format!(
                "slot {at} is not inside it past its first slot (it holds {}-{})",
                t.first_slot, t.last_slot
            ));
        }
        if mirrored {
            return refuse(
                "its table is mirrored (a mirror holds the whole tablet in memory; move the \
                 table to another mode to split it)"
                    .into(),
            );
        }
        if t.recovering {
            return refuse("it is being recovered".into());
        }
        if !master_up(t.master, &self.map) {
            return refuse(format!("its master, server {}, is not up", t.master));
        }
        if let Some(m) = &t.migration {
            return refuse(format!("it is moving to server {}", m.target));
        }
        if let Some(s) = t.split {
            return refuse(format!("it is splitting at slot {s} already"));
        }
        if t.merge.is_some() || t.merge_ready {
            return refuse("it is merging".into());
        }
        if !t.pending.is_empty() || t.logs_from.is_some() {
            return refuse(format!(
                "its backups {:?} do not all hold its copy yet (retry once they do)",
                t.pending
            ));
        }
        if let Some(t) = self.map.tablet_mut(table, first_slot) {
            t.split = Some(at);
        }
        Ok(())
    }

    /// Starts merging the tablet at (`table`, `first_slot`) with the next one.
    fn merge_tablets(&mut self, table: TableId, first_slot: u16) -> Result<(), CommandError> {
        let refuse = |why: String| Err(CommandError::CannotMerge(why));
        let Some(t) = self
            .map
            .tablet_at(table, first_slot)
            .filter(|t| t.first_slot == first_slot)
        else {
            return Err(CommandError::NoSuchTablet { table, first_slot });
        };
        let Some(n) = self.map.next_tablet(t) else {
            return refuse(format!(
                "no tablet follows slots {}-{}",
                t.first_slot, t.last_slot
            ));
        };
        if self
            .map
            .tables
            .iter()
            .any(|x| x.id == table && x.mode == ReplicationMode::Mirror)
        {
            return refuse("their table is mirrored".into());
        }
        if n.master != t.master {
            return refuse(format!(
                "slots {}-{} are mastered by server {}, slots {}-{} by server {} (move one first)",
                t.first_slot, t.last_slot, t.master, n.first_slot, n.last_slot, n.master
            ));
        }
        let mut a = t.backups.clone();
        let mut b = n.backups.clone();
        a.sort_unstable();
        b.sort_unstable();
        if a != b {
            return refuse(format!("their backups differ ({a:?} and {b:?})"));
        }
        if !self
            .map
            .server(t.master)
            .is_some_and(|s| s.state == ServerState::Up)
        {
            return refuse(format!("their master, server {}, is not up", t.master));
        }
        for x in [t, n] {
            let busy = x.recovering
                || x.migration.is_some()
                || x.split.is_some()
                || x.merge.is_some()
                || x.merge_ready
                || !x.pending.is_empty()
                || x.logs_from.is_some();
            if busy {
                return refuse(format!(
                    "slots {}-{} are recovering, moving, splitting, merging or still copying to a backup",
                    x.first_slot, x.last_slot
                ));
            }
        }
        let upper_epoch = n.epoch;
        if let Some(t) = self.map.tablet_mut(table, first_slot) {
            t.merge = Some(upper_epoch);
        }
        Ok(())
    }

    /// The position of the tablet at (`table`, `first_slot`) if it merges at `epoch` on
    /// `server` with the next tablet, still adjacent and on that server, and the next tablet's
    /// epoch when the merge began.
    fn merging(
        &self,
        table: TableId,
        first_slot: u16,
        epoch: u64,
        server: ServerId,
    ) -> Option<(usize, u64)> {
        let i = self
            .map
            .tablets
            .iter()
            .position(|t| t.table == table && t.first_slot == first_slot)?;
        let t = &self.map.tablets[i];
        let n = self.map.tablets.get(i + 1)?;
        let up = self
            .map
            .server(server)
            .is_some_and(|s| s.state == ServerState::Up);
        (t.epoch == epoch
            && t.master == server
            && up
            && !t.recovering
            && n.table == table
            && n.first_slot == t.last_slot + 1
            && n.master == server
            && !n.recovering
            && n.migration.is_none())
        .then_some((i, t.merge?))
    }

    /// The master of (`table`, `first_slot`) split it at `at` at `epoch`: two tablets at the
    /// next epoch, both copied afresh to every live backup, the upper one restored from the
    /// whole tablet's logs until then (`logs_from`). False if the map moved on.
    fn split_done(
        &mut self,
        table: TableId,
        first_slot: u16,
        at: u16,
        epoch: u64,
        server: ServerId,
    ) -> bool {
        let up: Vec<ServerId> = self.map.up_servers().map(|s| s.id).collect();
        let Some(i) = self
            .map
            .tablets
            .iter()
            .position(|t| t.table == table && t.first_slot == first_slot)
        else {
            return false;
        };
        let t = &mut self.map.tablets[i];
        if t.epoch != epoch
            || t.master != server
            || t.recovering
            || t.split != Some(at)
            || !t.split_ready
            || !up.contains(&server)
        {
            return false;
        }
        let mut upper = t.clone();
        t.split = None;
        t.split_ready = false;
        t.last_slot = at - 1;
        t.epoch += 1;
        t.pending = t
            .backups
            .iter()
            .copied()
            .filter(|b| up.contains(b))
            .collect();
        upper.split = None;
        upper.split_ready = false;
        upper.first_slot = at;
        upper.epoch = t.epoch;
        upper.pending = t.pending.clone();
        upper.logs_from = Some(first_slot);
        self.map.tablets.insert(i + 1, upper);
        true
    }

    /// See [`Command::DropBackup`]; the number of tablets `backup` left.
    fn drop_backup(&mut self, master: ServerId, master_epoch: u64, backup: ServerId) -> usize {
        let up = |id: ServerId, epoch: Option<u64>| {
            self.map
                .server(id)
                .is_some_and(|s| s.state == ServerState::Up && epoch.is_none_or(|e| e == s.epoch))
        };
        if master == backup || !up(master, Some(master_epoch)) || !up(backup, None) {
            return 0;
        }
        let is_up: Vec<ServerId> = self.map.up_servers().map(|s| s.id).collect();
        let mut dropped = 0;
        for t in &mut self.map.tablets {
            if t.master != master || t.recovering || !t.backups.contains(&backup) {
                continue;
            }
            let others = t
                .backups
                .iter()
                .filter(|&&b| b != backup && is_up.contains(&b) && !t.fresh.contains(&b))
                .count();
            if others == 0 {
                continue;
            }
            t.backups.retain(|&b| b != backup);
            t.pending.retain(|&b| b != backup);
            t.fresh.retain(|&b| b != backup);
            if t.mirror == Some(backup) {
                t.mirror = None;
            }
            if !t.cut_off.iter().any(|c| c.backup == backup) {
                t.cut_off.push(crate::map::CutOff { master, backup });
            }
            dropped += 1;
        }
        dropped
    }

    /// Brings every tablet to the shape the live servers allow, after any change of membership:
    /// - a recovering tablet's restorer is its first backup that is up, can restore it and has
    ///   room for it (none while no such backup is up: the tablet waits, keeping its backup
    ///   set, whose logs a restarted server brings back; `waiting` says why when live backups
    ///   lack the room);
    /// - a tablet with a live master drops its dead backups and gets replacements (fresh and
    ///   pending: the master copies the tablet to them) up to the table's replicas, taken from
    ///   the seeded server permutation after the server they replace (the copyset order).
    fn repair(&mut self) {
        let up: Vec<ServerId> = self.map.up_servers().map(|s| s.id).collect();
        let all: Vec<ServerId> = self.map.servers.iter().map(|s| s.id).collect();
        let order = crate::placement::permutation(&all, self.map.cluster_id);
        let is_up = |id: ServerId| up.contains(&id);
        let draining: Vec<ServerId> = self
            .map
            .servers
            .iter()
            .filter(|s| s.draining)
            .map(|s| s.id)
            .collect();
        // A backup that counts towards the table's replicas: up and not being drained.
        let good = |id: ServerId| is_up(id) && !draining.contains(&id);
        let replicas: HashMap<TableId, u32> =
            self.map.tables.iter().map(|t| (t.id, t.replicas)).collect();
        let mirrored: Vec<TableId> = self
            .map
            .tables
            .iter()
            .filter(|t| t.mode == ReplicationMode::Mirror)
            .map(|t| t.id)
            .collect();
        // Backup roles per server, to spread replacements.
        let mut load: HashMap<ServerId, usize> = HashMap::new();
        for t in &self.map.tablets {
            for b in &t.backups {
                *load.entry(*b).or_default() += 1;
            }
        }
        // Memory already promised to restores under way (their restorer stays); a mirror's
        // promotion needs none: it holds the tablet in memory already.
        let room = self.room.clone().unwrap_or_default();
        let mut promised: HashMap<ServerId, u64> = HashMap::new();
        for t in &self.map.tablets {
            let Some(r) = t.restorer.filter(|&r| t.recovering && is_up(r)) else {
                continue;
            };
            if t.mirror != Some(r) {
                *promised.entry(r).or_default() += room.need_of(t).unwrap_or(0);
            }
        }
        // The partitions of one tablet take turns among the backups that hold its logs.
        let mut turn: HashMap<(TableId, u16), usize> = HashMap::new();
        for t in &mut self.map.tablets {
            settle_migration(t, &is_up);
            // A split ends with its master: the tablet recovers whole.
            if t.recovering || !is_up(t.master) {
                t.split = None;
                t.split_ready = false;
                t.merge = None;
                t.merge_ready = false;
            }
            if t.recovering {
                let nth = match t.logs_from {
                    Some(from) => {
                        let n = turn.entry((t.table, from)).or_default();
                        *n += 1;
                        *n - 1
                    }
                    None => 0,
                };
                if t.restorer.is_none_or(|r| !is_up(r)) {
                    pick_restorer(t, nth, &is_up, &room, &mut promised);
                }
                continue;
            }
            t.waiting = None;
            t.refused.clear();
            // A cut-off holds while the master that reported it serves the tablet.
            let master = t.master;
            t.cut_off.retain(|c| c.master == master);
            if !is_up(t.master) {
                continue;
            }
            // A dead backup stays listed (its logs on disk may be all that is left if the
            // master turns out to be dead too, as in a whole-cluster restart) until the tablet
            // is fully protected again (see `CopyDone`); one that never held the tablet goes.
            let dead: Vec<ServerId> = t.backups.iter().copied().filter(|&b| !is_up(b)).collect();
            let want = replicas.get(&t.table).copied().unwrap_or(0) as usize;
            let mut after = dead.first().copied().unwrap_or(t.master);
            let gone: Vec<ServerId> = dead
                .iter()
                .copied()
                .filter(|b| t.fresh.contains(b))
                .collect();
            t.backups.retain(|b| !gone.contains(b));
            t.pending.retain(|b| is_up(*b));
            t.fresh.retain(|b| is_up(*b));
            for d in &gone {
                if let Some(n) = load.get_mut(d) {
                    *n = n.saturating_sub(1);
                }
            }
            while t.backups.iter().filter(|&&b| good(b)).count() < want {
                let at = order.iter().position(|&s| s == after).unwrap_or(0);
                let n = order.len();
                let candidates: Vec<ServerId> = (1..=n)
                    .map(|k| order[(at + k) % n])
                    .filter(|&s| {
                        good(s)
                            && s != t.master
                            && !t.backups.contains(&s)
                            && !t.cut_off.iter().any(|c| c.backup == s)
                    })
                    .collect();
                // The least loaded of the candidates, the earliest in the order on a tie.
                let Some(&pick) = candidates
                    .iter()
                    .min_by_key(|s| load.get(s).copied().unwrap_or(0))
                else {
                    break;
                };
                t.backups.push(pick);
                t.pending.push(pick);
                t.fresh.push(pick);
                *load.entry(pick).or_default() += 1;
                after = pick;
            }
            // Fully protected again (every live backup copied, as many as the table wants):
            // the dead ones' logs are no longer needed.
            // A draining backup leaves once its replacement holds the whole copy; a migration's
            // target stays (it is an extra backup until its switch).
            if t.pending.is_empty() && t.backups.iter().filter(|&&b| good(b)).count() >= want {
                let target = t.migration.map(|m| m.target);
                t.backups.retain(|&b| good(b) || Some(b) == target);
                // Every backup holds the partition's own copy: the logs it was split off
                // are no longer needed for it.
                t.logs_from = None;
            }
        }
        // A merge ends when its next tablet is no longer one it can absorb (moved, moving,
        // splitting, recovering, or a new epoch).
        for i in 0..self.map.tablets.len() {
            let Some(upper_epoch) = self.map.tablets[i].merge else {
                continue;
            };
            let t = &self.map.tablets[i];
            let ok = self.map.tablets.get(i + 1).is_some_and(|n| {
                n.table == t.table
                    && n.first_slot == t.last_slot + 1
                    && n.master == t.master
                    && n.epoch == upper_epoch
                    && !n.recovering
                    && n.migration.is_none()
                    && n.split.is_none()
            });
            if !ok {
                let table = t.table;
                self.map.tablets[i].merge = None;
                self.map.tablets[i].merge_ready = false;
                if let Some(n) = self.map.tablets.get_mut(i + 1).filter(|n| n.table == table) {
                    n.merge_ready = false;
                }
            }
        }
        // A mirrored tablet's mirror is one of its live backups: the one it had while that one
        // stays (a mirror's memory takes a while to build), else the first with the whole
        // stream, else the first (it builds once its copy is complete). A recovering tablet
        // keeps the mirror it had until its restorer takes over.
        for t in &mut self.map.tablets {
            if !mirrored.contains(&t.table) {
                t.mirror = None;
                continue;
            }
            if t.recovering {
                continue;
            }
            let complete = |b: ServerId| good(b) && !t.pending.contains(&b);
            if t.mirror
                .is_some_and(|m| t.backups.contains(&m) && complete(m))
            {
                continue;
            }
            t.mirror = t
                .backups
                .iter()
                .copied()
                .find(|&b| complete(b))
                .or_else(|| t.backups.iter().copied().find(|&b| is_up(b)));
        }
    }

    /// Adds the table and its tablets over the live servers.
    fn place(
        &mut self,
        id: TableId,
        name: &str,
        mode: ReplicationMode,
        replicas: Option<u32>,
        schema: Option<Vec<u8>>,
    ) -> Result<TableInfo, CommandError> {
        let up: Vec<ServerId> = self
            .map
            .up_servers()
            .filter(|s| !s.draining)
            .map(|s| s.id)
            .collect();
        if up.is_empty() {
            return Err(CommandError::NoServers);
        }
        let n = up.len() as u32;
        let replicas = match replicas {
            Some(r) if r > REPLICAS_MAX => return Err(CommandError::BadReplicas(r)),
            Some(r) if r + 1 > n => {
                return Err(CommandError::NotEnoughServers { replicas: r, up: n })
            }
            Some(r) => r,
            None => default_replicas(n),
        };
        let tablets = place_table(id, &up, replicas as usize, self.map.cluster_id);
        let table = TableInfo {
            id,
            name: name.to_string(),
            mode,
            replicas,
            schema,
            tablets_at_creation: tablets.len() as u32,
        };
        self.map.tables.push(table.clone());
        self.map.tables.sort_by_key(|t| t.id);
        self.map.tablets.extend(tablets);
        self.map.tablets.sort_by_key(|t| (t.table, t.first_slot));
        Ok(table)
    }
}

/// Moves `t`'s migration on or ends it, as the map stands: a target that holds the whole
/// stream now builds the tablet in memory; a move whose target is gone, or whose source died
/// (the tablet recovers instead), is abandoned. A target with the whole stream stays a backup
/// then: its logs are as good as any backup's.
fn settle_migration(t: &mut TabletInfo, is_up: &impl Fn(ServerId) -> bool) {
    let Some(m) = &mut t.migration else {
        return;
    };
    if t.recovering || !is_up(t.master) {
        if m.phase >= MigrationPhase::Building {
            m.added = false;
        }
        abandon_migration(t);
        return;
    }
    // A target that is gone, or that restarted (its logs count for nothing again: pending)
    // after it started building, holds nothing to switch to.
    let restarted = m.phase >= MigrationPhase::Building && t.pending.contains(&m.target);
    if !is_up(m.target) || !t.backups.contains(&m.target) || restarted {
        abandon_migration(t);
        return;
    }
    if m.phase == MigrationPhase::Copying && !t.pending.contains(&m.target) {
        m.phase = MigrationPhase::Building;
    }
}

/// Ends `t`'s migration without a switch: a target added for it leaves the backup set (its
/// logs are no backup the table asked for).
fn abandon_migration(t: &mut TabletInfo) {
    if let Some(m) = t.migration.take() {
        if m.added {
            t.backups.retain(|&b| b != m.target);
            t.pending.retain(|&b| b != m.target);
            t.fresh.retain(|&b| b != m.target);
            if t.mirror == Some(m.target) {
                t.mirror = None;
            }
        }
    }
}

/// Chooses the restorer of recovering tablet `t` (see [`ClusterState::repair`]), or records why
/// none can restore it. Candidates, in order: the mirror with the whole stream (it holds the
/// tablet in memory: no room needed), the live backups with the whole stream, then those still
/// waiting for their copy (their logs may lack what their memory held when they restarted);
/// never a fresh one. The first whose room, less what is `promised` to other restores, covers
/// the tablet's need restores it. Unknown figures count as room, except on a backup whose
/// restore of this tablet ran out of memory: that one needs a report of room both above the
/// need and a quarter of the need (and 1 MiB) above what it had after the failure.
fn pick_restorer(
    t: &mut TabletInfo,
    nth: usize,
    is_up: &impl Fn(ServerId) -> bool,
    room: &Room,
    promised: &mut HashMap<ServerId, u64>,
) {
    let eligible = |b: ServerId| is_up(b) && !t.fresh.contains(&b);
    let mirror = t
        .mirror
        .filter(|&m| t.backups.contains(&m) && eligible(m) && !t.pending.contains(&m));
    let mut candidates: Vec<ServerId> = mirror.into_iter().collect();
    let mut streamed: Vec<ServerId> = t
        .backups
        .iter()
        .copied()
        .filter(|&b| eligible(b) && !t.pending.contains(&b))
        .collect();
    // The `nth` partition of a split tablet starts with the `nth` such backup, so that the
    // partitions spread over every backup that holds their logs.
    if !streamed.is_empty() {
        let n = nth % streamed.len();
        streamed.rotate_left(n);
    }
    let copying = t.backups.iter().copied().filter(|&b| eligible(b));
    for b in streamed.into_iter().chain(copying) {
        if !candidates.contains(&b) {
            candidates.push(b);
        }
    }
    let need = room.need_of(t);
    let refusal = |b: ServerId| t.refused.iter().find(|r| r.server == b).copied();
    let required = |b: ServerId| -> Option<u64> {
        match refusal(b) {
            Some(r) => {
                let need = need.unwrap_or(0);
                Some(need.max(r.room_bytes.saturating_add(need / 4).saturating_add(MIB)))
            }
            None => need,
        }
    };
    let left = |b: ServerId, promised: &HashMap<ServerId, u64>| {
        room.server(b)
            .map(|r| r.saturating_sub(promised.get(&b).copied().unwrap_or(0)))
    };
    let fits = |b: ServerId, promised: &HashMap<ServerId, u64>| {
        if Some(b) == mirror {
            return true;
        }
        match (required(b), left(b, promised)) {
            (None, _) => true,
            (Some(required), Some(left)) => left >= required,
            (Some(_), None) => refusal(b).is_none(),
        }
    };
    let pick = candidates.iter().copied().find(|&b| fits(b, promised));
    t.restorer = pick;
    t.waiting = None;
    if let Some(b) = pick {
        if Some(b) != mirror {
            *promised.entry(b).or_default() += need.unwrap_or(0);
        }
        return;
    }
    if candidates.is_empty() {
        // No live backup holds it: it waits for one to come back (not for memory).
        return;
    }
    let mut reason = match need {
        Some(need) => format!("no live backup has room: needs {} MiB", need.div_ceil(MIB)),
        None => "no live backup has room".to_string(),
    };
    let most = candidates
        .iter()
        .filter(|&&b| refusal(b).is_none())
        .filter_map(|&b| left(b, promised).map(|l| (l, b)))
        .max_by_key(|&(l, b)| (l, std::cmp::Reverse(b)));
    if let Some((l, b)) = most {
        reason.push_str(&format!("; most room is {} MiB on server {b}", l / MIB));
    }
    for r in candidates.iter().filter_map(|&b| refusal(b)) {
        reason.push_str(&format!(
            "; the restore on server {} ran out of memory ({} MiB room after it)",
            r.server,
            r.room_bytes / MIB
        ));
    }
    t.waiting = Some(reason);
}

fn check_table_name(name: &str) -> Result<(), CommandError> {
    let bad = |reason: &str| {
        Err(CommandError::BadTableName {
            name: name.chars().take(80).collect(),
            reason: reason.to_string(),
        })
    };
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > TABLE_NAME_MAX {
        return bad("longer than 64 bytes");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
    {
        return bad("only letters, digits, '_', '-' and '.' are allowed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    fn addrs(port: u16) -> ServerAddresses {
        let a = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        ServerAddresses {
            resp: a(port),
            routing: Some(a(port + 1)),
            native: a(port + 2),
            admin: None,
        }
    }

    fn register(s: &mut ClusterState, port: u16) -> (ServerId, u64) {
        match s
            .apply(&Command::Register {
                previous: None,
                addresses: addrs(port),
                memory_bytes: 1 << 30,
                live: vec![],
                incarnation: 0,
            })
            .unwrap()
        {
            CommandOutcome::Registered { id, epoch } => (id, epoch),
            other => panic!("{other:?}"),
        }
    }

    fn init(initial: u32) -> ClusterState {
        let mut s = ClusterState::default();
        assert_eq!(
            s.apply(&Command::Register {
                previous: None,
                addresses: addrs(1),
                memory_bytes: 0,
                live: vec![],
                incarnation: 0,
            }),
            Err(CommandError::NotInitialized)
        );
        s.apply(&Command::Init {
            cluster_id: 0xabc,
            initial_servers: initial,
            default_mode: None,
            default_replicas: None,
        })
        .unwrap();
        s
    }

    #[test]
    fn default_table_waits_for_the_initial_servers() {
        let mut s = init(3);
        register(&mut s, 100);
        register(&mut s, 200);
        assert!(s.map.table(DEFAULT_TABLE).is_none());
        let v = s.map.version;
        register(&mut s, 300);
        assert!(s.map.version > v);
        let table = s.map.table(DEFAULT_TABLE).unwrap();
        assert_eq!(table.replicas, 2);
        assert_eq!(s.map.tablets_of(DEFAULT_TABLE).count(), 48);
        // A fourth server gets no tablets of the default table, but of a new one.
        let (four, _) = register(&mut s, 400);
        assert!(s.map.tablets.iter().all(|t| t.master != four));
        s.apply(&Command::CreateTable {
            name: "users".into(),
            mode: ReplicationMode::Durable,
            replicas: None,
            schema: None,
        })
        .unwrap();
        let users = s.map.table_by_name("users").unwrap().clone();
        assert_eq!((users.id, users.replicas), (1, 3));
        assert_eq!(
            s.map
                .tablets_of(users.id)
                .filter(|t| t.master == four)
                .count(),
            16
        );
    }

    #[test]
    fn restart_keeps_the_id_and_bumps_the_epoch() {
        let mut s = init(1);
        let (id, epoch) = register(&mut s, 100);
        let again = s
            .apply(&Command::Register {
                previous: Some(PreviousIdentity {
                    cluster_id: 0xabc,
                    server_id: id,
                }),
                addresses: addrs(500),
                memory_bytes: 1,
                live: vec![],
                incarnation: 0,
            })
            .unwrap();
        assert_eq!(
            again,
            CommandOutcome::Registered {
                id,
                epoch: epoch + 1
            }
        );
        assert_eq!(s.map.server(id).unwrap().addresses.resp.port(), 500);
    }

    #[test]
    fn a_retried_registration_gets_the_same_id_and_epoch() {
        let mut s = init(1);
        let reg = |s: &mut ClusterState, previous: Option<ServerId>, incarnation| {
            s.apply(&Command::Register {
                previous: previous.map(|server_id| PreviousIdentity {
                    cluster_id: 0xabc,
                    server_id,
                }),
                addresses: addrs(100),
                memory_bytes: 1,
                live: vec![],
                incarnation,
            })
            .unwrap()
        };
        // A new server's registration, repeated: one id.
        let first = reg(&mut s, None, 7);
        assert_eq!(reg(&mut s, None, 7), first);
        assert_eq!(s.map.servers.len(), 1);
        let CommandOutcome::Registered { id, epoch } = first else {
            panic!("{first:?}")
        };
        // A restart (a new incarnation) bumps the epoch; its repeat does not.
        let restarted = reg(&mut s, Some(id), 8);
        assert_eq!(
            restarted,
            CommandOutcome::Registered {
                id,
                epoch: epoch + 1
            }
        );
        assert_eq!(reg(&mut s, Some(id), 8), restarted);
        // Once declared dead, the same incarnation registers anew (a new epoch).
        s.apply(&Command::DeclareDead {
            server: id,
            epoch: epoch + 1,
            reason: "test".into(),
            room: None,
        })
        .unwrap();
        let CommandOutcome::Registered { epoch: after, .. } = reg(&mut s, Some(id), 8) else {
            panic!()
        };
        assert!(after > epoch + 1);
        // Without an incarnation every registration is a new one.
        let a = reg(&mut s, Some(id), 0);
        assert_ne!(reg(&mut s, Some(id), 0), a);
    }

    #[test]
    fn bad_commands_change_nothing() {
        let mut s = init(1);
        register(&mut s, 100);
        let before = s.clone();
        let wrong = s.apply(&Command::Register {
            previous: Some(PreviousIdentity {
                cluster_id: 0xdef,
                server_id: 1,
            }),
            addresses: addrs(1),
            memory_bytes: 0,
            live: vec![],
            incarnation: 0,
        });
        assert!(matches!(wrong, Err(CommandError::WrongCluster { .. })));
        let unknown = s.apply(&Command::Register {
            previous: Some(PreviousIdentity {
                cluster_id: 0xabc,
                server_id: 9,
            }),
            addresses: addrs(1),
            memory_bytes: 0,
            live: vec![],
            incarnation: 0,
        });
        assert_eq!(unknown, Err(CommandError::UnknownServer(9)));
        for (name, replicas) in [("", None), ("a b", None), ("default", None), ("t", Some(1))] {
            assert!(s
                .apply(&Command::CreateTable {
                    name: name.into(),
                    mode: ReplicationMode::Sync,
                    replicas,
                    schema: None,
                })
                .is_err());
        }
        assert_eq!(
            s.apply(&Command::DropTable {
                name: "default".into()
            }),
            Err(CommandError::DefaultTable)
        );
        assert_eq!(
            s.apply(&Command::DropTable { name: "x".into() }),
            Err(CommandError::NoSuchTable("x".into()))
        );
        assert_eq!(s, before);
    }

    #[test]
    fn table_modes_change_and_the_default_table_takes_the_configured_ones() {
        let mut s = init(3);
        for port in 1..=3 {
            register(&mut s, port);
        }
        assert_eq!(
            s.map.table(DEFAULT_TABLE).unwrap().mode,
            ReplicationMode::Sync
        );
        let version = s.map.version;
        let out = s
            .apply(&Command::SetTableMode {
                name: "default".into(),
                mode: ReplicationMode::Durable,
            })
            .unwrap();
        assert!(
            matches!(out, CommandOutcome::TableAltered(t) if t.mode == ReplicationMode::Durable)
        );
        assert_eq!(s.map.version, version + 1);
        assert!(s
            .apply(&Command::SetTableMode {
                name: "nope".into(),
                mode: ReplicationMode::Async,
            })
            .is_err());

        let mut s = ClusterState::default();
        s.apply(&Command::Init {
            cluster_id: 1,
            initial_servers: 3,
            default_mode: Some(ReplicationMode::Async),
            default_replicas: Some(5),
        })
        .unwrap();
        for port in 1..=3 {
            register(&mut s, port);
        }
        let table = s.map.table(DEFAULT_TABLE).unwrap();
        assert_eq!(table.mode, ReplicationMode::Async);
        // More replicas than the servers allow are cut to what they allow.
        assert_eq!(table.replicas, 2);
    }

    #[test]
    fn drop_removes_the_tablets() {
        let mut s = init(1);
        register(&mut s, 100);
        s.apply(&Command::CreateTable {
            name: "t".into(),
            mode: ReplicationMode::Async,
            replicas: Some(0),
            schema: None,
        })
        .unwrap();
        assert_eq!(s.map.tablets_of(1).count(), 16);
        s.apply(&Command::DropTable { name: "t".into() }).unwrap();
        assert_eq!(s.map.tablets_of(1).count(), 0);
        assert!(s.map.table_by_name("t").is_none());
    }

    #[test]
    fn a_dead_master_is_restored_by_its_first_live_backup_and_replaced_backups_are_copied() {
        let mut s = init(4);
        for port in [100, 200, 300, 400, 500] {
            register(&mut s, port);
        }
        let before = s.map.tablets.clone();
        let dead = 1;
        let epoch = s.map.server(dead).unwrap().epoch;
        let out = s
            .apply(&Command::DeclareDead {
                server: dead,
                epoch,
                reason: "test".into(),
                room: None,
            })
            .unwrap();
        assert_eq!(out, CommandOutcome::Noted { applied: true });
        assert_eq!(s.map.server(dead).unwrap().state, ServerState::Dead);
        assert_eq!(s.map.server(dead).unwrap().epoch, epoch + 1);
        // Declaring the same incarnation again changes nothing.
        let again = s.apply(&Command::DeclareDead {
            server: dead,
            epoch,
            reason: "again".into(),
            room: None,
        });
        assert_eq!(again, Ok(CommandOutcome::Noted { applied: false }));
        for (t, old) in s.map.tablets.iter().zip(&before) {
            if old.master == dead {
                assert!(t.recovering && t.epoch == old.epoch + 1, "{t:?}");
                assert_eq!(t.restorer, old.backups.iter().copied().find(|&b| b != dead));
            } else {
                assert!(!t.recovering && t.epoch == old.epoch);
                // The dead backup gets a fresh replacement that the master copies to; it stays
                // listed until the copy is done.
                let live = t.backups.iter().filter(|&&b| b != dead).count();
                assert_eq!(live, old.backups.len());
                if old.backups.contains(&dead) {
                    assert!(t.backups.contains(&dead));
                    assert_eq!(t.fresh.len(), 1);
                    assert_eq!(t.pending, t.fresh);
                }
            }
        }
        // The restorer reports; a stale report (wrong epoch or server) changes nothing.
        let t = s.map.tablets.iter().find(|t| t.recovering).unwrap().clone();
        let restorer = t.restorer.unwrap();
        let stale = s.apply(&Command::TabletRecovered {
            table: t.table,
            first_slot: t.first_slot,
            epoch: t.epoch - 1,
            server: restorer,
        });
        assert_eq!(stale, Ok(CommandOutcome::Noted { applied: false }));
        s.apply(&Command::TabletRecovered {
            table: t.table,
            first_slot: t.first_slot,
            epoch: t.epoch,
            server: restorer,
        })
        .unwrap();
        let now = s.map.tablet_at(t.table, t.first_slot).unwrap().clone();
        assert_eq!(
            (now.master, now.recovering, now.restorer),
            (restorer, false, None)
        );
        assert!(!now.backups.contains(&restorer) && !now.backups.contains(&dead));
        assert_eq!(now.backups.len(), 3);
        assert_eq!(
            now.pending.len(),
            3,
            "every live backup gets the new master's copy"
        );
        for b in now.pending.clone() {
            s.apply(&Command::CopyDone {
                table: t.table,
                first_slot: t.first_slot,
                epoch: now.epoch,
                backup: b,
            })
            .unwrap();
        }
        let done = s.map.tablet_at(t.table, t.first_slot).unwrap();
        assert!(done.pending.is_empty() && done.fresh.is_empty());
        assert_eq!(done.backups.len(), 3);
    }

    #[test]
    fn tablets_without_a_live_backup_wait_and_a_restarted_backup_restores_them() {
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        for id in [1, 2, 3] {
            let epoch = s.map.server(id).unwrap().epoch;
            s.apply(&Command::DeclareDead {
                server: id,
                epoch,
                reason: "all down".into(),
                room: None,
            })
            .unwrap();
        }
        assert!(s
            .map
            .tablets
            .iter()
            .all(|t| t.recovering && t.restorer.is_none()));
        // Backup sets are kept while nobody can restore: their logs come back with the servers.
        assert!(s.map.tablets.iter().all(|t| t.backups.len() == 2));
        let again = s
            .apply(&Command::Register {
                previous: Some(PreviousIdentity {
                    cluster_id: 0xabc,
                    server_id: 2,
                }),
                addresses: addrs(200),
                memory_bytes: 1,
                live: vec![],
                incarnation: 0,
            })
            .unwrap();
        assert!(matches!(again, CommandOutcome::Registered { id: 2, .. }));
        for t in &s.map.tablets {
            if t.master == 2 {
                assert_eq!(t.restorer, None, "nobody else is up");
            } else {
                let first_up = t.backups.iter().copied().find(|&b| b == 2);
                assert_eq!(t.restorer, first_up);
            }
        }
    }

    fn rejoin(s: &mut ClusterState, id: ServerId, live: Vec<ServerId>) {
        let port = s.map.server(id).unwrap().addresses.resp.port();
        let again = s
            .apply(&Command::Register {
                previous: Some(PreviousIdentity {
                    cluster_id: 0xabc,
                    server_id: id,
                }),
                addresses: addrs(port),
                memory_bytes: 1,
                live,
                incarnation: 0,
            })
            .unwrap();
        assert!(matches!(again, CommandOutcome::Registered { id: i, .. } if i == id));
    }

    #[test]
    fn a_restarted_backup_that_a_live_master_went_on_without_cannot_restore_until_copied() {
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        // Server 3 restarts while 1 and 2 were heard from: their tablets that list it went on
        // without it, so its logs do not count.
        rejoin(&mut s, 3, vec![1, 2]);
        let listing: Vec<crate::TabletInfo> = s
            .map
            .tablets
            .iter()
            .filter(|t| t.backups.contains(&3))
            .cloned()
            .collect();
        assert!(!listing.is_empty());
        for t in &listing {
            assert!(t.pending.contains(&3) && t.fresh.contains(&3), "{t:?}");
        }
        // Its master dies before the copy: the other backup restores, never server 3.
        let victim = listing[0].master;
        let epoch = s.map.server(victim).unwrap().epoch;
        s.apply(&Command::DeclareDead {
            server: victim,
            epoch,
            reason: "killed".into(),
            room: None,
        })
        .unwrap();
        for t in s.map.tablets.iter().filter(|t| t.recovering) {
            assert!(t.restorer.is_some() && t.restorer != Some(3), "{t:?}");
        }

        // Restarted while nobody was heard from after it (all died together): its logs count,
        // but one that streamed all along is preferred.
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        rejoin(&mut s, 3, vec![]);
        for t in s.map.tablets.iter().filter(|t| t.backups.contains(&3)) {
            assert!(t.pending.contains(&3) && !t.fresh.contains(&3), "{t:?}");
        }
        let t = s
            .map
            .tablets
            .iter()
            .find(|t| t.backups.first() == Some(&3))
            .cloned()
            .expect("a tablet whose first backup is server 3");
        let epoch = s.map.server(t.master).unwrap().epoch;
        s.apply(&Command::DeclareDead {
            server: t.master,
            epoch,
            reason: "killed".into(),
            room: None,
        })
        .unwrap();
        let now = s.map.tablet_mut(t.table, t.first_slot).unwrap().clone();
        assert_eq!(now.restorer, Some(t.backups[1]), "{now:?}");
        // With the other backup dead too, the restarted one is all that is left.
        let other = t.backups[1];
        let epoch = s.map.server(other).unwrap().epoch;
        s.apply(&Command::DeclareDead {
            server: other,
            epoch,
            reason: "killed".into(),
            room: None,
        })
        .unwrap();
        let now = s.map.tablet_mut(t.table, t.first_slot).unwrap().clone();
        assert_eq!(now.restorer, Some(3), "{now:?}");
    }

    /// Partitions of at most 400 000 objects or 64 MiB.
    const SMALL_PARTITIONS: PartitionSize = PartitionSize {
        objects: 400_000,
        bytes: 64 * MIB,
    };

    /// A snapshot in which every tablet of `master` holds `live` bytes and the servers have the
    /// room given (in MiB).
    fn room_for(
        s: &ClusterState,
        master: ServerId,
        live: u64,
        servers: &[(ServerId, u64)],
    ) -> Room {
        Room {
            partition: Some(SMALL_PARTITIONS),
            servers: servers.iter().map(|&(id, mib)| (id, mib * MIB)).collect(),
            tablets: s
                .map
                .tablets
                .iter()
                .filter(|t| t.master == master)
                .map(|t| TabletBytes {
                    table: t.table,
                    first_slot: t.first_slot,
                    live_bytes: live,
                    objects: live / 100,
                    ops_per_sec: 0,
                })
                .collect(),
        }
    }

    /// Applies the report of recovering tablet `t`'s restorer; returns the restorer.
    fn restored_by_its_restorer(s: &mut ClusterState, t: &TabletInfo) -> ServerId {
        let server = t.restorer.expect("a restorer");
        s.apply(&Command::TabletRecovered {
            table: t.table,
            first_slot: t.first_slot,
            epoch: t.epoch,
            server,
        })
        .unwrap();
        server
    }

    fn declare_dead_with(s: &mut ClusterState, dead: ServerId, room: Room) {
        let epoch = s.map.server(dead).unwrap().epoch;
        let out = s
            .apply(&Command::DeclareDead {
                server: dead,
                epoch,
                reason: "killed".into(),
                room: Some(room),
            })
            .unwrap();
        assert_eq!(out, CommandOutcome::Noted { applied: true });
    }

    fn recovering(s: &ClusterState) -> Vec<TabletInfo> {
        s.map
            .tablets
            .iter()
            .filter(|t| t.recovering)
            .cloned()
            .collect()
    }

    #[test]
    fn large_tablets_recover_as_partitions_spread_over_their_backups() {
        let mut s = init(4);
        for port in [100, 200, 300, 400] {
            register(&mut s, port);
        }
        // A fifth server joins after the table is placed: the replacement backups.
        register(&mut s, 500);
        let before: Vec<TabletInfo> = s
            .map
            .tablets
            .iter()
            .filter(|t| t.master == 1)
            .cloned()
            .collect();
        let slots_before: usize = s.map.tablets.iter().map(|t| t.slots().count()).sum();
        // 100 MiB and 1 M objects per tablet: 3 partitions by objects, 2 by bytes.
        let mut room = room_for(
            &s,
            1,
            100 * MIB,
            &[(2, 10_000), (3, 10_000), (4, 10_000), (5, 10_000)],
        );
        for b in &mut room.tablets {
            b.objects = 1_000_000;
        }
        declare_dead_with(&mut s, 1, room);
        assert_eq!(
            recovery_partitions(
                &TabletBytes {
                    table: 0,
                    first_slot: 0,
                    live_bytes: 100 * MIB,
                    objects: 1_000_000,
                    ops_per_sec: 0,
                },
                1000,
                SMALL_PARTITIONS
            ),
            3
        );
        // The slots stay covered once each, in order.
        let slots_after: usize = s.map.tablets.iter().map(|t| t.slots().count()).sum();
        assert_eq!(slots_before, slots_after);
        for w in s.map.tablets.windows(2) {
            if w[0].table == w[1].table {
                assert_eq!(w[0].last_slot + 1, w[1].first_slot, "{:?} {:?}", w[0], w[1]);
            }
        }
        for t in &before {
            let parts: Vec<&TabletInfo> = s
                .map
                .tablets
                .iter()
                .filter(|p| p.table == t.table && p.logs_from == Some(t.first_slot))
                .collect();
            assert_eq!(parts.len(), 3, "{t:?}");
            assert_eq!(parts[0].first_slot, t.first_slot);
            assert_eq!(parts[2].last_slot, t.last_slot);
            let restorers: std::collections::BTreeSet<ServerId> = parts
                .iter()
                .map(|p| {
                    assert!(p.recovering && p.epoch == t.epoch + 1 && p.backups == t.backups);
                    assert!(p.log_sources().eq([p.first_slot, t.first_slot]
                        .into_iter()
                        .take(if p.first_slot == t.first_slot { 1 } else { 2 })));
                    p.restorer.expect("a restorer")
                })
                .collect();
            // Spread over every backup holding the logs.
            assert_eq!(restorers.len(), t.backups.len().min(3), "{parts:?}");
        }
        // A partition restored: it is served on its own, and once every backup holds its copy
        // the logs it was split off are no longer named.
        let p = s
            .map
            .tablets
            .iter()
            .find(|t| t.logs_from.is_some() && t.first_slot != t.logs_from.unwrap())
            .unwrap()
            .clone();
        let r = restored_by_its_restorer(&mut s, &p);
        let now = s.map.tablet_mut(p.table, p.first_slot).unwrap().clone();
        assert!(!now.recovering && now.master == r && now.logs_from.is_some());
        assert!(s
            .map
            .tablets
            .iter()
            .any(|t| t.recovering && t.logs_from == p.logs_from));
        for b in now.pending.clone() {
            s.apply(&Command::CopyDone {
                table: p.table,
                first_slot: p.first_slot,
                epoch: p.epoch,
                backup: b,
            })
            .unwrap();
        }
        let now = s.map.tablet_mut(p.table, p.first_slot).unwrap().clone();
        let want = s.map.table(p.table).unwrap().replicas as usize;
        assert!(
            now.pending.is_empty() && now.backups.len() >= want,
            "{now:?}"
        );
        assert_eq!(now.logs_from, None, "{now:?}");
        // Another partition, restored on another server, whose backups still wait for its
        // copy: when that server dies, it recovers whole (its objects are in two tablets' logs).
        let q = s
            .map
            .tablets
            .iter()
            .find(|t| t.recovering && t.logs_from.is_some() && t.restorer != Some(r))
            .unwrap()
            .clone();
        let r2 = restored_by_its_restorer(&mut s, &q);
        let die = |s: &mut ClusterState, server: ServerId| {
            let mut room = room_for(
                s,
                server,
                100 * MIB,
                &[(2, 10_000), (3, 10_000), (4, 10_000), (5, 10_000)],
            );
            room.servers.remove(&server);
            for b in &mut room.tablets {
                b.objects = 1_000_000;
            }
            declare_dead_with(s, server, room);
        };
        die(&mut s, r2);
        let again = s.map.tablet_mut(q.table, q.first_slot).unwrap().clone();
        assert!(again.recovering, "{again:?}");
        assert_eq!(
            (again.last_slot, again.logs_from),
            (q.last_slot, q.logs_from),
            "{again:?}"
        );
        // The fully protected partition is an ordinary tablet again: its master's death
        // splits it like any other.
        die(&mut s, r);
        let parts: Vec<&TabletInfo> = s
            .map
            .tablets
            .iter()
            .filter(|t| t.logs_from == Some(p.first_slot))
            .collect();
        assert_eq!(parts.len(), 3, "{parts:?}");
        assert_eq!(parts[2].last_slot, p.last_slot);
        assert!(parts.iter().all(|t| t.recovering));
    }

    #[test]
    fn small_tablets_and_mirrored_ones_recover_whole() {
        for (mode, live) in [
            (ReplicationMode::Sync, 10 * MIB),
            (ReplicationMode::Mirror, 500 * MIB),
        ] {
            let mut s = init(3);
            for port in [100, 200, 300] {
                register(&mut s, port);
            }
            s.apply(&Command::SetTableMode {
                name: DEFAULT_TABLE_NAME.into(),
                mode,
            })
            .unwrap();
            let count = s.map.tablets.len();
            let room = room_for(&s, 1, live, &[(2, 10_000), (3, 10_000)]);
            declare_dead_with(&mut s, 1, room);
            assert_eq!(s.map.tablets.len(), count, "{mode:?}");
            assert!(s.map.tablets.iter().all(|t| t.logs_from.is_none()));
        }
    }

    #[test]
    fn restorers_are_backups_with_room_for_the_tablet() {
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        // Tablets of 10 MiB need 12 MiB each: server 2 has room for two, server 3 for all.
        let room = room_for(&s, 1, 10 * MIB, &[(2, 30), (3, 1000)]);
        assert_eq!(restore_need_bytes(10 * MIB), 12 * MIB);
        let before = s.map.tablets.clone();
        declare_dead_with(&mut s, 1, room);
        let tablets = recovering(&s);
        assert_eq!(tablets.len(), 16);
        let on_2: Vec<&TabletInfo> = tablets.iter().filter(|t| t.restorer == Some(2)).collect();
        assert_eq!(on_2.len(), 2, "{tablets:?}");
        for t in &tablets {
            assert!(t.restorer.is_some() && t.waiting.is_none(), "{t:?}");
            let old = before
                .iter()
                .find(|o| o.first_slot == t.first_slot)
                .unwrap();
            // The first backup in order that has room: the first two that list server 2 first
            // go there, the rest to their other backup.
            if t.restorer == Some(3) && old.backups[0] == 2 {
                assert!(on_2.iter().all(|o| o.first_slot < t.first_slot), "{t:?}");
            }
        }
        // The snapshot kept has the dead master's tablet figures (they are all restoring).
        let held = s.room.clone().unwrap();
        assert_eq!(held.tablets.len(), 16);
        assert_eq!(held.server(2), Some(30 * MIB));
        // Once one restore is done, its memory counts as taken on its restorer.
        let t = on_2[0];
        s.apply(&Command::TabletRecovered {
            table: t.table,
            first_slot: t.first_slot,
            epoch: t.epoch,
            server: 2,
        })
        .unwrap();
        let held = s.room.clone().unwrap();
        assert_eq!(held.server(2), Some(18 * MIB));
        assert_eq!(
            held.tablets.len(),
            15,
            "only recovering tablets' figures are kept"
        );
    }

    #[test]
    fn tablets_no_backup_has_room_for_wait_with_the_reason_and_resume_after_a_room_command() {
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        let room = room_for(&s, 1, 10 * MIB, &[(2, 5), (3, 3)]);
        declare_dead_with(&mut s, 1, room);
        let tablets = recovering(&s);
        assert_eq!(tablets.len(), 16);
        for t in &tablets {
            assert_eq!(t.restorer, None, "{t:?}");
            assert_eq!(
                t.waiting.as_deref(),
                Some("no live backup has room: needs 12 MiB; most room is 5 MiB on server 2"),
            );
        }
        // A Room command that changes nothing keeps them waiting.
        let version = s.map.version;
        s.apply(&Command::Room {
            room: Room {
                servers: [(2, 6 * MIB), (3, 3 * MIB)].into(),
                tablets: vec![],
                partition: None,
            },
        })
        .unwrap();
        assert_eq!(s.map.version, version + 1);
        assert!(recovering(&s).iter().all(|t| t.restorer.is_none()));
        assert!(recovering(&s)[0]
            .waiting
            .as_deref()
            .unwrap()
            .contains("6 MiB on server 2"));
        // Server 3 freed 100 MiB: eight tablets fit there (96 MiB); the rest wait.
        s.apply(&Command::Room {
            room: Room {
                servers: [(2, 6 * MIB), (3, 100 * MIB)].into(),
                tablets: vec![],
                partition: None,
            },
        })
        .unwrap();
        let tablets = recovering(&s);
        let on_3 = tablets.iter().filter(|t| t.restorer == Some(3)).count();
        assert_eq!(on_3, 8, "{tablets:?}");
        for t in tablets.iter().filter(|t| t.restorer.is_none()) {
            // What is promised to the eight restores under way is not room any more.
            assert_eq!(
                t.waiting.as_deref(),
                Some("no live backup has room: needs 12 MiB; most room is 6 MiB on server 2"),
            );
        }
        // Server 2 freed memory too: everything restores.
        s.apply(&Command::Room {
            room: Room {
                servers: [(2, 200 * MIB), (3, 100 * MIB)].into(),
                tablets: vec![],
                partition: None,
            },
        })
        .unwrap();
        let tablets = recovering(&s);
        assert!(tablets
            .iter()
            .all(|t| t.restorer.is_some() && t.waiting.is_none()));
        assert_eq!(tablets.iter().filter(|t| t.restorer == Some(3)).count(), 8);
    }

    #[test]
    fn unknown_sizes_and_unknown_room_plan_as_before() {
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        // Server 3 never reported; the tablets' sizes are known.
        let before = s.map.tablets.clone();
        let room = room_for(&s, 1, 10 * MIB, &[(2, 0)]);
        declare_dead_with(&mut s, 1, room);
        for t in recovering(&s) {
            assert_eq!(t.restorer, Some(3), "{t:?}");
        }
        // Sizes unknown: the first live backup, as without any snapshot.
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        declare_dead_with(
            &mut s,
            1,
            Room {
                servers: [(2, 0), (3, 0)].into(),
                tablets: vec![],
                partition: None,
            },
        );
        for t in recovering(&s) {
            let old = before
                .iter()
                .find(|o| o.first_slot == t.first_slot)
                .unwrap();
            assert_eq!(t.restorer, Some(old.backups[0]), "{t:?}");
        }
    }

    #[test]
    fn a_restore_that_ran_out_of_memory_goes_to_another_backup_or_waits_for_more_room() {
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        let room = room_for(&s, 1, 10 * MIB, &[(2, 1000), (3, 1000)]);
        declare_dead_with(&mut s, 1, room);
        let t = recovering(&s)[0].clone();
        let first = t.restorer.unwrap();
        let other = if first == 2 { 3 } else { 2 };
        let failed = |s: &mut ClusterState, server: ServerId, epoch: u64| {
            s.apply(&Command::RestoreFailed {
                table: t.table,
                first_slot: t.first_slot,
                epoch,
                server,
                reason: "restoring into memory: out of memory".into(),
                room_bytes: Some(5 * MIB),
            })
            .unwrap()
        };
        // Stale reports change nothing: an older epoch, or a server that is not the restorer.
        assert_eq!(
            failed(&mut s, first, t.epoch - 1),
            CommandOutcome::Noted { applied: false }
        );
        assert_eq!(
            failed(&mut s, other, t.epoch),
            CommandOutcome::Noted { applied: false }
        );
        assert_eq!(
            failed(&mut s, first, t.epoch),
            CommandOutcome::Noted { applied: true }
        );
        let now = s.map.tablet_at(t.table, t.first_slot).unwrap().clone();
        assert_eq!(now.restorer, Some(other), "{now:?}");
        assert_eq!(
            now.refused,
            vec![Refusal {
                server: first,
                room_bytes: 5 * MIB
            }]
        );
        // The other runs out too: the tablet waits, saying so.
        failed(&mut s, other, t.epoch);
        let now = s.map.tablet_at(t.table, t.first_slot).unwrap().clone();
        assert_eq!(now.restorer, None);
        let reason = now.waiting.clone().unwrap();
        assert!(
            reason.contains(&format!(
                "the restore on server {first} ran out of memory (5 MiB room after it)"
            )),
            "{reason}"
        );
        // A little more room than after the failure is not enough: the need (12 MiB) is.
        let room = |s: &mut ClusterState, first_mib: u64| {
            s.apply(&Command::Room {
                room: Room {
                    servers: [(first, first_mib * MIB), (other, 0)].into(),
                    tablets: vec![],
                    partition: None,
                },
            })
            .unwrap();
            s.map.tablet_at(t.table, t.first_slot).unwrap().clone()
        };
        // Server `first` has the other restores promised to it: give it room beyond them.
        let promised: u64 = recovering(&s)
            .iter()
            .filter(|x| x.restorer == Some(first))
            .count() as u64
            * 12;
        assert_eq!(room(&mut s, promised + 7).restorer, None);
        assert_eq!(room(&mut s, promised + 12).restorer, Some(first));
        // Recovered: the refusals go with the recovery state.
        s.apply(&Command::TabletRecovered {
            table: t.table,
            first_slot: t.first_slot,
            epoch: t.epoch,
            server: first,
        })
        .unwrap();
        let now = s.map.tablet_at(t.table, t.first_slot).unwrap().clone();
        assert!(now.refused.is_empty() && now.waiting.is_none() && !now.recovering);
    }

    #[test]
    fn a_mirror_takes_over_without_room() {
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        s.apply(&Command::SetTableMode {
            name: DEFAULT_TABLE_NAME.into(),
            mode: ReplicationMode::Mirror,
        })
        .unwrap();
        let room = room_for(&s, 1, 10 * MIB, &[(2, 0), (3, 0)]);
        declare_dead_with(&mut s, 1, room);
        for t in recovering(&s) {
            assert_eq!(t.restorer, t.mirror, "{t:?}");
            assert!(t.restorer.is_some() && t.waiting.is_none());
        }
    }

    #[test]
    fn a_mirrored_tablets_mirror_is_its_first_live_backup_and_takes_over() {
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        assert!(s.map.tablets.iter().all(|t| t.mirror.is_none()));
        s.apply(&Command::SetTableMode {
            name: DEFAULT_TABLE_NAME.into(),
            mode: ReplicationMode::Mirror,
        })
        .unwrap();
        for t in &s.map.tablets {
            assert_eq!(t.mirror, t.backups.first().copied(), "{t:?}");
            assert_ne!(t.mirror, Some(t.master));
        }
        let t = s.map.tablets[0].clone();
        let mirror = t.mirror.unwrap();
        let epoch = s.map.server(t.master).unwrap().epoch;
        s.apply(&Command::DeclareDead {
            server: t.master,
            epoch,
            reason: "killed".into(),
            room: None,
        })
        .unwrap();
        let now = s.map.tablet_mut(t.table, t.first_slot).unwrap().clone();
        assert!(now.recovering);
        assert_eq!((now.restorer, now.mirror), (Some(mirror), Some(mirror)));
        s.apply(&Command::TabletRecovered {
            table: t.table,
            first_slot: t.first_slot,
            epoch: now.epoch,
            server: mirror,
        })
        .unwrap();
        let now = s.map.tablet_mut(t.table, t.first_slot).unwrap().clone();
        assert_eq!(now.master, mirror);
        // The next live backup mirrors now (it builds once its copy is complete).
        let next = now.mirror.expect("a new mirror");
        assert!(next != mirror && now.pending.contains(&next), "{now:?}");
        // Back to sync: no mirrors.
        s.apply(&Command::SetTableMode {
            name: DEFAULT_TABLE_NAME.into(),
            mode: ReplicationMode::Sync,
        })
        .unwrap();
        assert!(s.map.tablets.iter().all(|t| t.mirror.is_none()));
    }

    #[test]
    fn a_split_freezes_then_serves_two_halves_at_the_next_epoch_copied_afresh() {
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        let t = s.map.tablets_of(DEFAULT_TABLE).next().unwrap().clone();
        let (fs, ls) = (t.first_slot, t.last_slot);
        let at = fs + (ls - fs) / 2 + 1;
        let split = |s: &mut ClusterState, first_slot, at| {
            s.apply(&Command::SplitTablet {
                table: DEFAULT_TABLE,
                first_slot,
                at,
            })
        };
        // Refused, changing nothing: a slot no tablet starts at, split points outside it.
        let before = s.clone();
        assert!(matches!(
            split(&mut s, fs + 1, at),
            Err(CommandError::NoSuchTablet { .. })
        ));
        for bad in [fs, ls + 1] {
            assert!(matches!(
                split(&mut s, fs, bad),
                Err(CommandError::CannotSplit(_))
            ));
        }
        assert_eq!(s, before);
        split(&mut s, fs, at).unwrap();
        let now = s.map.tablet_at(DEFAULT_TABLE, fs).unwrap().clone();
        assert_eq!(now.split, Some(at));
        assert!(
            !now.switching(),
            "the tablet serves while its master copies the upper slots"
        );
        let ready = |epoch, server| Command::SplitReady {
            table: DEFAULT_TABLE,
            first_slot: fs,
            epoch,
            server,
        };
        // Done before ready: stale.
        let early = s
            .apply(&Command::SplitDone {
                table: DEFAULT_TABLE,
                first_slot: fs,
                at,
                epoch: t.epoch,
                server: t.master,
            })
            .unwrap();
        assert_eq!(early, CommandOutcome::Noted { applied: false });
        let outsider0 = s
            .map
            .up_servers()
            .map(|x| x.id)
            .find(|&id| id != t.master)
            .unwrap();
        let stale = s.apply(&ready(t.epoch, outsider0)).unwrap();
        assert_eq!(stale, CommandOutcome::Noted { applied: false });
        s.apply(&ready(t.epoch, t.master)).unwrap();
        let now = s.map.tablet_at(DEFAULT_TABLE, fs).unwrap().clone();
        assert!(
            now.split_ready && now.switching(),
            "requests wait for the last step"
        );
        // A second split, and a move, are refused meanwhile.
        assert!(matches!(
            split(&mut s, fs, at),
            Err(CommandError::CannotSplit(_))
        ));
        let outsider = s
            .map
            .up_servers()
            .map(|x| x.id)
            .find(|&id| id != t.master)
            .unwrap();
        assert!(s
            .apply(&Command::MoveTablet {
                table: DEFAULT_TABLE,
                first_slot: fs,
                target: outsider,
            })
            .is_err());
        // A stale report (another epoch, another server) changes nothing.
        let done = |epoch, server| Command::SplitDone {
            table: DEFAULT_TABLE,
            first_slot: fs,
            at,
            epoch,
            server,
        };
        let stale = s.apply(&done(t.epoch + 1, t.master)).unwrap();
        assert_eq!(stale, CommandOutcome::Noted { applied: false });
        let stale = s.apply(&done(t.epoch, outsider)).unwrap();
        assert_eq!(stale, CommandOutcome::Noted { applied: false });
        s.apply(&done(t.epoch, t.master)).unwrap();
        let lo = s.map.tablet_at(DEFAULT_TABLE, fs).unwrap().clone();
        let hi = s.map.tablet_at(DEFAULT_TABLE, at).unwrap().clone();
        assert_eq!((lo.first_slot, lo.last_slot), (fs, at - 1));
        assert_eq!((hi.first_slot, hi.last_slot), (at, ls));
        for half in [&lo, &hi] {
            assert_eq!(half.master, t.master);
            assert_eq!(half.epoch, t.epoch + 1, "the old epoch's stream is fenced");
            assert_eq!(half.backups, t.backups);
            assert_eq!(
                half.pending, t.backups,
                "every backup gets each half's copy"
            );
            assert!(
                half.fresh.is_empty(),
                "their logs of the whole tablet still count"
            );
            assert!(half.split.is_none() && !half.split_ready && !half.switching());
        }
        assert_eq!((lo.logs_from, hi.logs_from), (None, Some(fs)));
        assert_eq!(hi.log_sources().collect::<Vec<_>>(), vec![at, fs]);
        // Once each backup holds both copies, the whole tablet's logs are no longer needed.
        for half in [&lo, &hi] {
            for &b in &t.backups {
                s.apply(&Command::CopyDone {
                    table: DEFAULT_TABLE,
                    first_slot: half.first_slot,
                    epoch: half.epoch,
                    backup: b,
                })
                .unwrap();
            }
        }
        let hi = s.map.tablet_at(DEFAULT_TABLE, at).unwrap().clone();
        assert!(hi.pending.is_empty() && hi.logs_from.is_none(), "{hi:?}");

        // A split whose master dies ends: the tablet recovers whole.
        split(&mut s, at, at + 1).unwrap();
        let epoch = s.map.server(t.master).unwrap().epoch;
        s.apply(&Command::DeclareDead {
            server: t.master,
            epoch,
            reason: "killed".into(),
            room: None,
        })
        .unwrap();
        let hi = s.map.tablet_at(DEFAULT_TABLE, at).unwrap().clone();
        assert!(
            hi.recovering && hi.split.is_none() && !hi.split_ready,
            "{hi:?}"
        );
        // An abort of a split no longer under way changes nothing.
        let abort = s
            .apply(&Command::SplitAbort {
                table: DEFAULT_TABLE,
                first_slot: at,
                epoch: hi.epoch,
                reason: "test".into(),
            })
            .unwrap();
        assert_eq!(abort, CommandOutcome::Noted { applied: false });
    }

    #[test]
    fn a_split_is_refused_for_mirrored_tables_and_tablets_still_copying_and_can_be_aborted() {
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        let t = s.map.tablets_of(DEFAULT_TABLE).next().unwrap().clone();
        let split = |s: &mut ClusterState| {
            s.apply(&Command::SplitTablet {
                table: DEFAULT_TABLE,
                first_slot: t.first_slot,
                at: t.first_slot + 1,
            })
        };
        s.map
            .tablet_mut(DEFAULT_TABLE, t.first_slot)
            .unwrap()
            .pending = vec![t.backups[0]];
        assert!(matches!(split(&mut s), Err(CommandError::CannotSplit(_))));
        s.map
            .tablet_mut(DEFAULT_TABLE, t.first_slot)
            .unwrap()
            .pending
            .clear();
        s.apply(&Command::SetTableMode {
            name: DEFAULT_TABLE_NAME.into(),
            mode: ReplicationMode::Mirror,
        })
        .unwrap();
        assert!(matches!(split(&mut s), Err(CommandError::CannotSplit(_))));
        s.apply(&Command::SetTableMode {
            name: DEFAULT_TABLE_NAME.into(),
            mode: ReplicationMode::Sync,
        })
        .unwrap();
        split(&mut s).unwrap();
        s.apply(&Command::SplitAbort {
            table: DEFAULT_TABLE,
            first_slot: t.first_slot,
            epoch: t.epoch,
            reason: "no room".into(),
        })
        .unwrap();
        let now = s
            .map
            .tablet_at(DEFAULT_TABLE, t.first_slot)
            .unwrap()
            .clone();
        assert_eq!(
            (now.split, now.epoch, now.last_slot),
            (None, t.epoch, t.last_slot)
        );
    }

    #[test]
    fn the_halves_of_a_split_merge_back_at_the_next_epoch_restored_from_both_logs() {
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        let t = s.map.tablets_of(DEFAULT_TABLE).next().unwrap().clone();
        let n = s.map.next_tablet(&t).unwrap().clone();
        // The tablets a table starts with have other masters (or are refused for it).
        if n.master != t.master {
            assert!(matches!(
                s.apply(&Command::MergeTablets {
                    table: DEFAULT_TABLE,
                    first_slot: t.first_slot
                }),
                Err(CommandError::CannotMerge(_))
            ));
        }
        let at = t.middle_slot();
        let step = |s: &mut ClusterState, c: Command| s.apply(&c).unwrap();
        step(
            &mut s,
            Command::SplitTablet {
                table: DEFAULT_TABLE,
                first_slot: t.first_slot,
                at,
            },
        );
        step(
            &mut s,
            Command::SplitReady {
                table: DEFAULT_TABLE,
                first_slot: t.first_slot,
                epoch: t.epoch,
                server: t.master,
            },
        );
        step(
            &mut s,
            Command::SplitDone {
                table: DEFAULT_TABLE,
                first_slot: t.first_slot,
                at,
                epoch: t.epoch,
                server: t.master,
            },
        );
        let merge = Command::MergeTablets {
            table: DEFAULT_TABLE,
            first_slot: t.first_slot,
        };
        // Still copying the halves to the backups: refused.
        assert!(matches!(s.apply(&merge), Err(CommandError::CannotMerge(_))));
        for first_slot in [t.first_slot, at] {
            for &b in &t.backups {
                step(
                    &mut s,
                    Command::CopyDone {
                        table: DEFAULT_TABLE,
                        first_slot,
                        epoch: t.epoch + 1,
                        backup: b,
                    },
                );
            }
        }
        step(&mut s, merge.clone());
        let lo = s
            .map
            .tablet_at(DEFAULT_TABLE, t.first_slot)
            .unwrap()
            .clone();
        assert_eq!(lo.merge, Some(t.epoch + 1));
        assert!(!lo.switching(), "both serve while the master copies");
        let ready = Command::MergeReady {
            table: DEFAULT_TABLE,
            first_slot: t.first_slot,
            epoch: t.epoch + 1,
            server: t.master,
        };
        let done = Command::MergeDone {
            table: DEFAULT_TABLE,
            first_slot: t.first_slot,
            epoch: t.epoch + 1,
            server: t.master,
        };
        assert_eq!(
            s.apply(&done).unwrap(),
            CommandOutcome::Noted { applied: false },
            "done before ready"
        );
        step(&mut s, ready);
        for slot in [t.first_slot, at] {
            assert!(
                s.map.tablet_at(DEFAULT_TABLE, slot).unwrap().switching(),
                "slot {slot} waits"
            );
        }
        // A move of either is refused meanwhile.
        let other = s
            .map
            .up_servers()
            .map(|x| x.id)
            .find(|&id| id != t.master)
            .unwrap();
        assert!(s
            .apply(&Command::MoveTablet {
                table: DEFAULT_TABLE,
                first_slot: at,
                target: other
            })
            .is_err());
        step(&mut s, done);
        let m = s
            .map
            .tablet_at(DEFAULT_TABLE, t.first_slot)
            .unwrap()
            .clone();
        assert_eq!(
            (m.first_slot, m.last_slot, m.epoch),
            (t.first_slot, t.last_slot, t.epoch + 2)
        );
        assert_eq!(
            s.map.tablet_at(DEFAULT_TABLE, at).unwrap().first_slot,
            t.first_slot
        );
        assert_eq!(
            m.logs_from,
            Some(at),
            "restored from both tablets' logs until copied"
        );
        assert_eq!(m.pending, t.backups);
        assert!(m.merge.is_none() && !m.merge_ready && !m.switching());
        assert_eq!(s.map.tablets_of(DEFAULT_TABLE).count(), covered_tablets(&s));
    }

    fn covered_tablets(s: &ClusterState) -> usize {
        // Every slot belongs to exactly one tablet.
        let mut covered = 0usize;
        for x in s.map.tablets_of(DEFAULT_TABLE) {
            covered += usize::from(x.last_slot - x.first_slot) + 1;
        }
        assert_eq!(covered, usize::from(ramlog_common::SLOT_COUNT));
        s.map.tablets_of(DEFAULT_TABLE).count()
    }

    #[test]
    fn a_merge_ends_when_its_next_tablet_moves_or_its_master_dies() {
        let mut s = init(3);
        for port in [100, 200, 300] {
            register(&mut s, port);
        }
        let t = s.map.tablets_of(DEFAULT_TABLE).next().unwrap().clone();
        let at = t.middle_slot();
        let step = |s: &mut ClusterState, c: Command| s.apply(&c).unwrap();
        step(
            &mut s,
            Command::SplitTablet {
                table: DEFAULT_TABLE,
                first_slot: t.first_slot,
                at,
            },
        );
        step(
            &mut s,
            Command::SplitReady {
                table: DEFAULT_TABLE,
                first_slot: t.first_slot,
                epoch: t.epoch,
                server: t.master,
            },
        );
        step(
            &mut s,
            Command::SplitDone {
                table: DEFAULT_TABLE,
                first_slot: t.first_slot,
                at,
                epoch: t.epoch,
                server: t.master,
            },
        );
        for first_slot in [t.first_slot, at] {
            for &b in &t.backups {
                step(
                    &mut s,
                    Command::CopyDone {
                        table: DEFAULT_TABLE,
                        first_slot,
                        epoch: t.epoch + 1,
                        backup: b,
                    },
                );
            }
        }
        step(
            &mut s,
            Command::MergeTablets {
                table: DEFAULT_TABLE,
                first_slot: t.first_slot,
            },
        );
        // The next tablet moves away while the master copies: the merge ends.
        let other = s
            .map
            .up_servers()
            .map(|x| x.id)
            .find(|&id| id != t.master)
            .unwrap();
        step(
            &mut s,
            Command::MoveTablet {
                table: DEFAULT_TABLE,
                first_slot: at,
                target: other,
            },
        );
        assert!(s
            .map
            .tablet_at(DEFAULT_TABLE, t.first_slot)
            .unwrap()
            .merge
            .is_none());
        let abort = Command::MigrationAbort {
            table: DEFAULT_TABLE,
            first_slot: at,
            epoch: t.epoch + 1,
            reason: "test".into(),
        };
        step(&mut s, abort);
        // Merging again, then the master dies: the merge ends, both recover.
        step(
            &mut s,
            Command::MergeTablets {
                table: DEFAULT_TABLE,
                first_slot: t.first_slot,
            },
        );
        let epoch = s.map.server(t.master).unwrap().epoch;
        step(
            &mut s,
            Command::DeclareDead {
                server: t.master,
                epoch,
                reason: "killed".into(),
                room: None,
            },
        );
        for slot in [t.first_slot, at] {
            let x = s.map.tablet_at(DEFAULT_TABLE, slot).unwrap();
            assert!(x.recovering && x.merge.is_none() && !x.merge_ready, "{x:?}");
        }
    }

    fn migration_of(s: &ClusterState, first_slot: u16) -> Option<Migration> {
        s.map
            .tablet_at(DEFAULT_TABLE, first_slot)
            .unwrap()
            .migration
    }

    /// A tablet and a server that neither masters nor backs it up, which its master reaches.
    fn movable(s: &ClusterState) -> (TabletInfo, ServerId) {
        s.map
            .tablets_of(DEFAULT_TABLE)
            .find_map(|t| {
                s.map
                    .up_servers()
                    .map(|x| x.id)
                    .find(|id| {
                        *id != t.master
                            && !t.backups.contains(id)
                            && !s.map.is_cut_off(t.master, *id)
                    })
                    .map(|id| (t.clone(), id))
            })
            .unwrap()
    }

    #[test]
    fn a_backup_its_master_cannot_reach_is_cut_off_and_replaced() {
        let mut s = init(5);
        for port in [100, 200, 300, 400, 500] {
            register(&mut s, port);
        }
        let t = s.map.tablets_of(DEFAULT_TABLE).next().unwrap().clone();
        let (m, b) = (t.master, t.backups[0]);
        let epoch_of = |s: &ClusterState, id| s.map.server(id).unwrap().epoch;
        let drop = |s: &mut ClusterState, master, master_epoch, backup| {
            s.apply(&Command::DropBackup {
                master,
                master_epoch,
                backup,
                reason: "test".into(),
            })
            .unwrap()
        };
        let before = s.map.clone();
        // An older incarnation of the master, or a report about itself: nothing changes.
        let stale = epoch_of(&s, m) + 1;
        assert_eq!(
            drop(&mut s, m, stale, b),
            CommandOutcome::Noted { applied: false }
        );
        let e = epoch_of(&s, m);
        assert_eq!(
            drop(&mut s, m, e, m),
            CommandOutcome::Noted { applied: false }
        );
        assert_eq!(s.map.tablets, before.tablets);
        assert_eq!(
            drop(&mut s, m, e, b),
            CommandOutcome::Noted { applied: true }
        );
        for (old, new) in before.tablets.iter().zip(&s.map.tablets) {
            if old.master != m || !old.backups.contains(&b) {
                assert_eq!(old, new, "tablets of other masters keep their backups");
                continue;
            }
            assert!(!new.backups.contains(&b), "{new:?}");
            assert_eq!(
                new.cut_off,
                vec![crate::map::CutOff {
                    master: m,
                    backup: b
                }]
            );
            assert_eq!(
                new.backups.len(),
                old.backups.len(),
                "a replacement took its place"
            );
            let added: Vec<ServerId> = new
                .backups
                .iter()
                .copied()
                .filter(|x| !old.backups.contains(x))
                .collect();
            assert_eq!(added.len(), 1);
            assert!(new.pending.contains(&added[0]) && new.fresh.contains(&added[0]));
            assert!(added[0] != m && added[0] != b);
        }
        // A move of any tablet of that master to the cut-off server is refused, with why.
        let other = s
            .map
            .tablets
            .iter()
            .find(|x| x.master == m && !x.backups.contains(&b))
            .unwrap()
            .first_slot;
        let refused = s
            .apply(&Command::MoveTablet {
                table: DEFAULT_TABLE,
                first_slot: other,
                target: b,
            })
            .unwrap_err();
        assert!(refused.to_string().contains("cannot reach"), "{refused}");
        // Cut off from a second backup: the last one that holds the tablet's logs stays (the
        // replacement's copy is not done), whatever else is reported.
        let now = s
            .map
            .tablet_at(DEFAULT_TABLE, t.first_slot)
            .unwrap()
            .clone();
        let holders: Vec<ServerId> = now
            .backups
            .iter()
            .copied()
            .filter(|x| !now.fresh.contains(x))
            .collect();
        assert_eq!(holders.len(), 2);
        drop(&mut s, m, e, holders[0]);
        drop(&mut s, m, e, holders[1]);
        let now = s
            .map
            .tablet_at(DEFAULT_TABLE, t.first_slot)
            .unwrap()
            .clone();
        assert_eq!(
            now.backups
                .iter()
                .filter(|x| !now.fresh.contains(x))
                .count(),
            1,
            "{now:?}"
        );
        assert!(now.can_restore(holders[1]));
        assert!(
            !now.backups.contains(&b),
            "a cut-off backup is not chosen again"
        );
        // A move whose target its source cannot reach is abandoned.
        let (u, target) = movable(&s);
        s.apply(&Command::MoveTablet {
            table: DEFAULT_TABLE,
            first_slot: u.first_slot,
            target,
        })
        .unwrap();
        assert!(migration_of(&s, u.first_slot).is_some());
        let ue = epoch_of(&s, u.master);
        drop(&mut s, u.master, ue, target);
        assert!(migration_of(&s, u.first_slot).is_none());
        let after = s.map.tablet_at(DEFAULT_TABLE, u.first_slot).unwrap();
        assert!(!after.backups.contains(&target));
        // The cut-off ends with the master that reported it: a restorer takes over.
        s.apply(&Command::DeclareDead {
            server: m,
            epoch: e,
            reason: "test".into(),
            room: None,
        })
        .unwrap();
        let r = s
            .map
            .tablet_at(DEFAULT_TABLE, t.first_slot)
            .unwrap()
            .clone();
        s.apply(&Command::TabletRecovered {
            table: DEFAULT_TABLE,
            first_slot: r.first_slot,
            epoch: r.epoch,
            server: r.restorer.unwrap(),
        })
        .unwrap();
        let r = s.map.tablet_at(DEFAULT_TABLE, t.first_slot).unwrap();
        assert!(r.cut_off.is_empty(), "{r:?}");
    }

    #[test]
    fn a_move_copies_builds_switches_and_fences_the_source_by_epoch() {
        let mut s = init(5);
        for port in [100, 200, 300, 400, 500] {
            register(&mut s, port);
        }
        let (t, target) = movable(&s);
        let fs = t.first_slot;
        // Refusals: the master itself, a server that does not exist, a slot no tablet starts at.
        let refused = |s: &mut ClusterState, first_slot, target| {
            s.apply(&Command::MoveTablet {
                table: DEFAULT_TABLE,
                first_slot,
                target,
            })
        };
        assert!(matches!(
            refused(&mut s, fs, t.master),
            Err(CommandError::CannotMove(_))
        ));
        assert!(matches!(
            refused(&mut s, fs, 99),
            Err(CommandError::CannotMove(_))
        ));
        assert!(matches!(
            refused(&mut s, t.last_slot, target),
            Err(CommandError::NoSuchTablet { .. })
        ));
        s.apply(&Command::MoveTablet {
            table: DEFAULT_TABLE,
            first_slot: fs,
            target,
        })
        .unwrap();
        let m = migration_of(&s, fs).unwrap();
        assert_eq!(
            (m.target, m.phase, m.added),
            (target, MigrationPhase::Copying, true)
        );
        let now = s.map.tablet_at(DEFAULT_TABLE, fs).unwrap().clone();
        assert_eq!(
            now.backups.len(),
            t.backups.len() + 1,
            "the target is an extra backup while it fills"
        );
        assert!(now.pending.contains(&target) && now.fresh.contains(&target));
        assert!(matches!(
            refused(&mut s, fs, target),
            Err(CommandError::CannotMove(_))
        ));
        // Ready before the copy is done, or from another server: nothing.
        let ready = |s: &mut ClusterState, server| {
            s.apply(&Command::MigrationReady {
                table: DEFAULT_TABLE,
                first_slot: fs,
                epoch: t.epoch,
                server,
            })
            .unwrap()
        };
        assert_eq!(
            ready(&mut s, target),
            CommandOutcome::Noted { applied: false }
        );
        s.apply(&Command::CopyDone {
            table: DEFAULT_TABLE,
            first_slot: fs,
            epoch: t.epoch,
            backup: target,
        })
        .unwrap();
        assert_eq!(
            migration_of(&s, fs).unwrap().phase,
            MigrationPhase::Building
        );
        assert_eq!(
            ready(&mut s, t.master),
            CommandOutcome::Noted { applied: false }
        );
        assert_eq!(
            ready(&mut s, target),
            CommandOutcome::Noted { applied: true }
        );
        assert_eq!(
            migration_of(&s, fs).unwrap().phase,
            MigrationPhase::Switching
        );
        // Only the source, at the tablet's epoch, switches it.
        let switch = |s: &mut ClusterState, source, epoch| {
            s.apply(&Command::MigrationSwitch {
                table: DEFAULT_TABLE,
                first_slot: fs,
                epoch,
                source,
            })
            .unwrap()
        };
        assert_eq!(
            switch(&mut s, target, t.epoch),
            CommandOutcome::Noted { applied: false }
        );
        assert_eq!(
            switch(&mut s, t.master, t.epoch + 1),
            CommandOutcome::Noted { applied: false }
        );
        assert_eq!(
            switch(&mut s, t.master, t.epoch),
            CommandOutcome::Noted { applied: true }
        );
        let after = s.map.tablet_at(DEFAULT_TABLE, fs).unwrap();
        assert_eq!(after.master, target);
        assert_eq!(after.epoch, t.epoch + 1);
        assert_eq!(
            after.backups, t.backups,
            "the backups keep the tablet, the target leaves them"
        );
        assert_eq!(
            after.pending, t.backups,
            "each backup keeps its logs until the new master's copy"
        );
        assert!(after.fresh.is_empty() && after.migration.is_none());
        assert_eq!(
            switch(&mut s, t.master, t.epoch),
            CommandOutcome::Noted { applied: false }
        );
    }

    #[test]
    fn a_move_is_abandoned_when_its_target_dies_asked_or_its_source_dies() {
        let mut s = init(5);
        for port in [100, 200, 300, 400, 500] {
            register(&mut s, port);
        }
        let (t, target) = movable(&s);
        let fs = t.first_slot;
        let start = |s: &mut ClusterState| {
            s.apply(&Command::MoveTablet {
                table: DEFAULT_TABLE,
                first_slot: fs,
                target,
            })
            .unwrap()
        };
        // Asked to stop: the added target leaves the backups.
        start(&mut s);
        s.apply(&Command::MigrationAbort {
            table: DEFAULT_TABLE,
            first_slot: fs,
            epoch: t.epoch,
            reason: "test".into(),
        })
        .unwrap();
        let now = s.map.tablet_at(DEFAULT_TABLE, fs).unwrap();
        assert!(now.migration.is_none());
        assert_eq!((&now.backups, &now.pending), (&t.backups, &t.pending));
        // The target dies: abandoned, the table's backups as before.
        start(&mut s);
        let epoch = s.map.server(target).unwrap().epoch;
        s.apply(&Command::DeclareDead {
            server: target,
            epoch,
            reason: "test".into(),
            room: None,
        })
        .unwrap();
        let now = s.map.tablet_at(DEFAULT_TABLE, fs).unwrap();
        assert!(now.migration.is_none());
        assert!(!now.backups.contains(&target), "{now:?}");
        // Back again; the source dies once the target holds the whole stream: the tablet
        // recovers, and the target stays one of its backups.
        register(&mut s, 600);
        let (t, target) = movable(&s);
        let fs = t.first_slot;
        s.apply(&Command::MoveTablet {
            table: DEFAULT_TABLE,
            first_slot: fs,
            target,
        })
        .unwrap();
        s.apply(&Command::CopyDone {
            table: DEFAULT_TABLE,
            first_slot: fs,
            epoch: t.epoch,
            backup: target,
        })
        .unwrap();
        let epoch = s.map.server(t.master).unwrap().epoch;
        s.apply(&Command::DeclareDead {
            server: t.master,
            epoch,
            reason: "test".into(),
            room: None,
        })
        .unwrap();
        let now = s.map.tablet_at(DEFAULT_TABLE, fs).unwrap();
        assert!(now.recovering && now.migration.is_none());
        assert!(now.backups.contains(&target), "{now:?}");
    }
}
