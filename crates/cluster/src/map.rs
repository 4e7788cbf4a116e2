//! The cluster map: which servers exist, which tables, and which server masters and backs up each
//! tablet. The coordinator owns it; servers and clients hold copies stamped with its version, and
//! a copy with a higher version replaces a lower one.

use ramlog_common::{key_slot, TableId, SLOT_COUNT};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// A server's id in the cluster, handed out by the coordinator (1, 2, ...), never reused.
pub type ServerId = u64;

/// The table that RESP clients use (Redis's db 0).
pub const DEFAULT_TABLE: TableId = 0;
pub const DEFAULT_TABLE_NAME: &str = "default";

/// Where a server listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerAddresses {
    /// Cluster-aware RESP (answers -MOVED for keys it does not master).
    pub resp: SocketAddr,
    /// The routing port: RESP for any client and any key.
    pub routing: Option<SocketAddr>,
    /// Native protocol (clients and other servers).
    pub native: SocketAddr,
    /// Admin HTTP.
    pub admin: Option<SocketAddr>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ServerState {
    /// Registered, not serving yet.
    Joining,
    Up,
    /// Reported by a peer or missing heartbeats; not yet confirmed dead.
    Suspected,
    /// Declared dead; its epoch is fenced. A restarted process registers again.
    Dead,
}

impl ServerState {
    pub fn as_str(self) -> &'static str {
        match self {
            ServerState::Joining => "joining",
            ServerState::Up => "up",
            ServerState::Suspected => "suspected",
            ServerState::Dead => "dead",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    pub id: ServerId,
    /// Redis Cluster's 40-character node id (CLUSTER NODES, MYID).
    pub name: String,
    pub addresses: ServerAddresses,
    /// Grows with every registration of this id: a process with an older epoch is fenced.
    pub epoch: u64,
    pub state: ServerState,
    pub memory_bytes: u64,
    /// `ramlog cluster drain`: the server's tablets move to others, its backup roles are
    /// replaced, nothing new is placed on it; once it holds nothing it is removed (declared
    /// dead, so that it stops). A restart of the process under its id ends the drain.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
}

/// A table's replication mode (DESIGN.md "Replication modes").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplicationMode {
    Async,
    #[default]
    Sync,
    Durable,
    Mirror,
}

impl ReplicationMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicationMode::Async => "async",
            ReplicationMode::Sync => "sync",
            ReplicationMode::Durable => "durable",
            ReplicationMode::Mirror => "mirror",
        }
    }

    pub fn parse(s: &str) -> Option<ReplicationMode> {
        Some(match s.to_ascii_lowercase().as_str() {
            "async" => ReplicationMode::Async,
            "sync" => ReplicationMode::Sync,
            "durable" => ReplicationMode::Durable,
            "mirror" => ReplicationMode::Mirror,
            _ => return None,
        })
    }
}

impl std::fmt::Display for ReplicationMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableInfo {
    pub id: TableId,
    pub name: String,
    pub mode: ReplicationMode,
    /// Backups per tablet.
    pub replicas: u32,
    /// The table's schema in its binary form (`ramlog_query::Schema::to_bytes`), if any.
    pub schema: Option<Vec<u8>>,
    /// How many tablets the table was created with (`placement::slot_ranges` of this count
    /// gives their slot ranges). Tablets split off one of them, or restored as its recovery
    /// partitions, may merge back into it on their own; tablets of different ones never do.
    /// 0 in maps written before it was kept: such tablets merge only on request.
    #[serde(default)]
    pub tablets_at_creation: u32,
}

impl TableInfo {
    /// The slots of the tablet the table was created with that holds `slot`, if known.
    pub fn creation_range(&self, slot: u16) -> Option<(u16, u16)> {
        (self.tablets_at_creation > 0)
            .then(|| crate::placement::slot_ranges(self.tablets_at_creation))
            .and_then(|r| r.into_iter().find(|&(a, b)| a <= slot && slot <= b))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TabletInfo {
    pub table: TableId,
    pub first_slot: u16,
    pub last_slot: u16,
    pub master: ServerId,
    pub mirror: Option<ServerId>,
    /// Ordered backups: the first is the tablet's designated restorer.
    pub backups: Vec<ServerId>,
    /// Grows whenever the tablet's master changes; replication frames carry it.
    pub epoch: u64,
    /// True from the declaration of the master's death until a backup has restored the tablet
    /// and become its master; `master` keeps naming the dead master meanwhile.
    #[serde(default)]
    pub recovering: bool,
    /// While recovering: the backup that replays its own logs of the tablet and then becomes
    /// its master; None while no live backup that holds the tablet is up.
    #[serde(default)]
    pub restorer: Option<ServerId>,
    /// Backups that have not received the master's full copy of the tablet at this epoch (after
    /// a recovery or a replacement); the master copies to them in the background.
    #[serde(default)]
    pub pending: Vec<ServerId>,
    /// The subset of `pending` whose logs of the tablet do not count: replacements (they held
    /// nothing of it) and restarted backups that a live master went on without (their logs
    /// miss writes and deletes; they drop them). They cannot restore it until their copy is
    /// complete.
    #[serde(default)]
    pub fresh: Vec<ServerId>,
    /// While recovering with no restorer although live backups hold it: why none restores it
    /// (none has the memory room for it, see `state::restore_need_bytes`). Clients of its slots
    /// get `-CLUSTERDOWN` with this text; the restore starts by itself once a backup has room.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<String>,
    /// While recovering: backups whose restore of it ran out of memory, with the room each
    /// reported then. `repair()` passes each over until it reports clearly more room.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<Refusal>,
    /// A recovery partition: the tablet was split off the tablet that started at this slot when
    /// its master died (a will, see `state::recovery_partitions`). Its backups hold its objects
    /// in their logs of that tablet (slots outside this tablet's range included: a restore takes
    /// only its own), until each has this tablet's own copy; cleared once every backup has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logs_from: Option<u16>,
    /// The tablet is moving to another server (`ramlog cluster move`, a drain): see
    /// [`Migration`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<Migration>,
    /// The tablet splits in two at this slot (`ramlog cluster split`, or the coordinator's
    /// leader once the tablet grew past its split size):
    /// 1. its master copies the upper slots' objects in its memory into a new tablet while it
    ///    goes on serving, noting the keys written meanwhile, and reports `SplitReady`;
    /// 2. then (`split_ready`) it freezes the tablet (requests wait, as in a move's switch),
    ///    drains its streams, redoes the noted writes in the copy and reports `SplitDone`;
    /// 3. both halves serve at the next epoch, each copied afresh to every backup, which keeps
    ///    the logs of the whole tablet until it has both copies (`logs_from` on the upper half).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<u16>,
    /// The split's copy is made: the tablet is frozen for its last step.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub split_ready: bool,
    /// The tablet absorbs the next tablet of its table (same master and backups), whose epoch
    /// was this when the merge began (`ramlog cluster merge`, or the leader for two small halves
    /// of one former tablet): its master copies the next tablet into this one's memory while
    /// both serve, noting the keys written meanwhile, and reports `MergeReady`; then both are
    /// frozen (`merge_ready`), drained and joined, and it reports `MergeDone`: one tablet of both
    /// ranges serves at the next epoch, copied afresh to every backup, restored from both
    /// tablets' logs until then (`logs_from` names the next tablet's first slot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merge: Option<u64>,
    /// On both tablets of a merge whose copy is made: frozen for its last step.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub merge_ready: bool,
    /// Backups this tablet's master reported it cannot reach while the coordinator still heard
    /// from them (a partition between the two alone): each was taken out of the backup set
    /// (`state::Command::DropBackup`) and is not chosen again while that master serves it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cut_off: Vec<CutOff>,
}

/// A backup that a tablet's master could not reach (see [`TabletInfo::cut_off`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CutOff {
    pub master: ServerId,
    pub backup: ServerId,
}

/// A tablet's move from its master to `target`, with writes going on. The source serves the
/// tablet until a short final switch (the design choice of docs/architecture.md "Migration"):
///
/// 1. `Copying`: the target is a backup of the tablet (added as a pending one if it was not) and
///    receives the master's copy and its live stream, as any new backup does;
/// 2. `Building`: the target holds the whole stream in its logs and builds the tablet in its
///    memory from them, applying live writes as they come (as a mirror does), then reports ready;
/// 3. `Switching`: the source stops taking requests for the tablet, waits until every backup and
///    the target acknowledged every write it took, and reports; the coordinator then makes the
///    target the master at the next epoch (the source is fenced by it) and ends the migration.
///
/// The tablet's backups keep their logs throughout: an acknowledged write is on the table's R
/// backups before, during and after the move (the target is an extra one while it fills). After
/// the switch each backup waits for the new master's copy (`pending`) and keeps its logs of the
/// older epochs until it has it: re-replication is deferred to after the move, with lineage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Migration {
    pub target: ServerId,
    pub phase: MigrationPhase,
    /// The target was not a backup of the tablet: it was added for the move, and goes from
    /// the backup set again if the move is abandoned.
    pub added: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigrationPhase {
    Copying,
    Building,
    Switching,
}

impl MigrationPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            MigrationPhase::Copying => "copying",
            MigrationPhase::Building => "building",
            MigrationPhase::Switching => "switching",
        }
    }
}

/// A backup whose restore of a tablet ran out of memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    pub server: ServerId,
    /// The room the server reported once it had freed what the failed restore held.
    pub room_bytes: u64,
}

impl TabletInfo {
    pub fn slots(&self) -> std::ops::RangeInclusive<u16> {
        self.first_slot..=self.last_slot
    }

    /// True while the tablet's move switches to its target, or while its split or merge takes
    /// its last step: its master takes no requests for it (they are answered TRYAGAIN, or held by the
    /// routing port) until the target masters it, or both halves serve.
    pub fn switching(&self) -> bool {
        self.migration
            .is_some_and(|m| m.phase == MigrationPhase::Switching)
            || (self.split.is_some() && self.split_ready)
            || self.merge_ready
    }

    /// Where a split cuts the tablet when none is named: the middle of its slots (keys spread
    /// evenly over slots unless hash tags gather them). Its first slot for a one-slot tablet,
    /// which cannot split.
    pub fn middle_slot(&self) -> u16 {
        self.first_slot + (self.last_slot - self.first_slot).div_ceil(2)
    }

    /// Backups that can restore the tablet: every backup but the fresh ones.
    pub fn can_restore(&self, server: ServerId) -> bool {
        self.backups.contains(&server) && !self.fresh.contains(&server)
    }

    /// The first slots of the tablets whose backup logs hold this tablet's objects: its own,
    /// and the one it was split off at a recovery while its backups lack its own copy.
    pub fn log_sources(&self) -> impl Iterator<Item = u16> + '_ {
        std::iter::once(self.first_slot).chain(self.logs_from.filter(|&s| s != self.first_slot))
    }
}

/// The whole map at one version.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterMap {
    /// Random at the cluster's creation: a server or client that names another cluster's id is
    /// pointed at the wrong coordinator.
    pub cluster_id: u64,
    /// Grows with every change.
    pub version: u64,
    /// By id, ascending.
    pub servers: Vec<ServerInfo>,
    /// By id, ascending.
    pub tables: Vec<TableInfo>,
    /// By (table, first slot).
    pub tablets: Vec<TabletInfo>,
    /// The coordinator's leader moves tablets until the servers' mastered bytes are balanced
    /// (a server joined, or `ramlog cluster rebalance`); cleared once they are
    /// (`balance::rebalance_moves`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rebalancing: bool,
}

impl ClusterMap {
    pub fn server(&self, id: ServerId) -> Option<&ServerInfo> {
        self.servers
            .binary_search_by_key(&id, |s| s.id)
            .ok()
            .map(|i| &self.servers[i])
    }

    pub fn table(&self, id: TableId) -> Option<&TableInfo> {
        self.tables.iter().find(|t| t.id == id)
    }

    pub fn table_by_name(&self, name: &str) -> Option<&TableInfo> {
        self.tables.iter().find(|t| t.name == name)
    }

    /// The tablets of `table`, in slot order.
    pub fn tablets_of(&self, table: TableId) -> impl Iterator<Item = &TabletInfo> {
        self.tablets.iter().filter(move |t| t.table == table)
    }

    /// The tablet of `table` holding `slot`.
    /// Whether `master` reported, for any tablet it serves, that it cannot reach `server`
    /// ([`TabletInfo::cut_off`]): a partition between the two, so no tablet of `master`'s is
    /// moved to `server` while it lasts (the move's copy would have to cross it).
    pub fn is_cut_off(&self, master: ServerId, server: ServerId) -> bool {
        self.tablets.iter().any(|t| {
            t.cut_off
                .iter()
                .any(|c| c.master == master && c.backup == server)
        })
    }

    pub fn tablet_at(&self, table: TableId, slot: u16) -> Option<&TabletInfo> {
        let start = self.tablets.partition_point(|t| t.table < table);
        let rest = &self.tablets[start..];
        let end = rest.partition_point(|t| t.table == table);
        let within = &rest[..end];
        let i = within.partition_point(|t| t.last_slot < slot);
        within.get(i).filter(|t| t.first_slot <= slot)
    }

    /// The tablet of `table` after `t` (the one whose slots follow its own), if any.
    pub fn next_tablet(&self, t: &TabletInfo) -> Option<&TabletInfo> {
        (t.last_slot + 1 < SLOT_COUNT)
            .then(|| self.tablet_at(t.table, t.last_slot + 1))
            .flatten()
            .filter(|n| n.first_slot == t.last_slot + 1)
    }

    /// The tablet of `table` that starts at `first_slot`, to change it.
    pub fn tablet_mut(&mut self, table: TableId, first_slot: u16) -> Option<&mut TabletInfo> {
        self.tablets
            .iter_mut()
            .find(|t| t.table == table && t.first_slot == first_slot)
    }

    /// The tablet of `table` holding `key`.
    pub fn tablet_of(&self, table: TableId, key: &[u8]) -> Option<&TabletInfo> {
        self.tablet_at(table, key_slot(key))
    }

    /// Owner of every slot of `table` (0 where no tablet covers it), for O(1) routing.
    pub fn slot_owners(&self, table: TableId) -> Vec<ServerId> {
        let mut owners = vec![0; SLOT_COUNT as usize];
        for t in self.tablets_of(table) {
            for slot in t.slots() {
                owners[slot as usize] = t.master;
            }
        }
        owners
    }

    /// Servers in state `Up`.
    pub fn up_servers(&self) -> impl Iterator<Item = &ServerInfo> {
        self.servers.iter().filter(|s| s.state == ServerState::Up)
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a map always serializes")
    }

    pub fn from_json(bytes: &[u8]) -> Result<ClusterMap, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// Redis Cluster's node id for a server: 40 lowercase hex characters, derived from the cluster
/// and the server id so that it is the same on every server and client that holds the map.
pub fn redis_node_name(cluster_id: u64, server: ServerId) -> String {
    let mut x = cluster_id ^ server.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut out = String::with_capacity(40);
    while out.len() < 40 {
        // splitmix64
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        out.push_str(&format!("{z:016x}"));
    }
    out.truncate(40);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tablet(table: TableId, first: u16, last: u16, master: ServerId) -> TabletInfo {
        TabletInfo {
            table,
            first_slot: first,
            last_slot: last,
            master,
            mirror: None,
            backups: vec![],
            epoch: 1,
            recovering: false,
            restorer: None,
            pending: vec![],
            fresh: vec![],
            waiting: None,
            refused: vec![],
            logs_from: None,
            split: None,
            split_ready: false,
            merge: None,
            merge_ready: false,
            migration: None,
            cut_off: Vec::new(),
        }
    }

    #[test]
    fn tablet_lookup_by_slot() {
        let map = ClusterMap {
            tablets: vec![
                tablet(0, 0, 99, 1),
                tablet(0, 100, 16383, 2),
                tablet(5, 0, 16383, 3),
            ],
            ..ClusterMap::default()
        };
        assert_eq!(map.tablet_at(0, 0).unwrap().master, 1);
        assert_eq!(map.tablet_at(0, 99).unwrap().master, 1);
        assert_eq!(map.tablet_at(0, 100).unwrap().master, 2);
        assert_eq!(map.tablet_at(5, 7).unwrap().master, 3);
        assert!(map.tablet_at(4, 7).is_none());
        let owners = map.slot_owners(0);
        assert_eq!((owners[99], owners[100]), (1, 2));
    }

    #[test]
    fn node_names_are_40_hex_and_distinct() {
        let a = redis_node_name(7, 1);
        let b = redis_node_name(7, 2);
        assert_eq!(a.len(), 40);
        assert!(a
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
        assert_ne!(a, b);
        assert_eq!(a, redis_node_name(7, 1));
    }
}
