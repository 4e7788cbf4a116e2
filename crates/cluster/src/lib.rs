//! ramlog-cluster: what the coordinator, the servers and the clients agree on.
//!
//! Owns: the cluster map ([`map`]: servers, tables, tablets, the map version), the deterministic
//! state machine the coordinator replicates with Raft ([`state`]: every change to the map is a
//! [`state::Command`] applied in log order, so every coordinator member computes the same map),
//! placement ([`placement`]: tablets, masters, copysets and disjunctive first backups), restore
//! planning by the memory room servers report ([`state::Room`]), and the coordinator's wire
//! protocol with an async client ([`rpc`]). Hides: how placement chooses, the framing of
//! coordinator messages, leader redirection and retries.

pub mod balance;
pub mod map;
pub mod placement;
pub mod rpc;
pub mod state;

pub use map::{
    ClusterMap, CutOff, Migration, MigrationPhase, Refusal, ReplicationMode, ServerAddresses,
    ServerId, ServerInfo, ServerState, TableInfo, TabletInfo, DEFAULT_TABLE, DEFAULT_TABLE_NAME,
};
pub use state::{
    ClusterState, Command, CommandError, CommandOutcome, PartitionSize, Room, TabletBytes,
};
