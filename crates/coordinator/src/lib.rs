//! ramlog-coordinator: the coordinator process. A few members replicate the cluster's
//! [`ramlog_cluster::ClusterState`] with Raft (openraft) and answer servers and tools over the
//! protocol of [`ramlog_cluster::rpc`].
//!
//! Owns: durable Raft storage in the data directory ([`store`], over the record files of
//! [`files`]), Raft's transport between members ([`network`]), the service that answers requests
//! and proposes commands ([`service`]), and the command-line tools ([`cli`]). Hides: openraft's
//! types, the storage formats, and leader redirection on the server side.

pub mod cli;
pub mod files;
pub mod network;
pub mod service;
pub mod store;

use ramlog_cluster::{ClusterMap, Command, CommandError, CommandOutcome};
use serde::{Deserialize, Serialize};

pub use service::{Coordinator, CoordinatorConfig};

/// What applying one log entry produced: the command's outcome (None for Raft's own entries) and
/// the map after it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Applied {
    pub result: Option<Result<CommandOutcome, CommandError>>,
    pub map: ClusterMap,
}

openraft::declare_raft_types!(
    /// The coordinator's Raft types: the log carries [`Command`]s.
    pub TypeConfig:
        D = Command,
        R = Applied,
        NodeId = u64,
        Node = openraft::BasicNode,
        SnapshotData = std::io::Cursor<Vec<u8>>,
);
