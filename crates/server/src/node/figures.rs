//! What the cluster roles report for `/metrics`, `/status`, `INFO` and `ramlog status`: plain
//! figures that the roles fill in (through [`crate::node::ClusterHooks::figures`]) and the node's
//! metrics render. The node knows their shape, not the roles that make them.

use crate::node::metrics::HistogramSnapshot;
use ramlog_cluster::ServerId;
use ramlog_common::TableId;

/// Figures of one stream for `/metrics`, `INFO replication` and `ramlog status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StreamFigures {
    pub backup: ServerId,
    pub address: String,
    pub connected: bool,
    /// Bytes appended and not yet durable on the backup.
    pub bytes_in_flight: u64,
    pub entries_in_flight: u64,
    /// Bytes appended and not yet in the backup's write buffer.
    pub bytes_unbuffered: u64,
    /// Age of the oldest unit the backup has not yet made durable (0 = none).
    pub lag_ms: u64,
    pub offset: u64,
    pub acked_buffered: u64,
    pub acked_durable: u64,
    pub connects: u64,
    pub frames_sent: u64,
    pub bytes_sent: u64,
    pub units: u64,
    pub entries: u64,
    /// Units the backup refused for their content.
    pub refused: u64,
    pub last_error: String,
}

/// Per-mode acknowledgement figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModeFigures {
    pub mode: &'static str,
    pub acknowledged: u64,
    pub latency: HistogramSnapshot,
}

/// Counters of the backup side (the backup duty of a cluster server).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct BackupSideFigures {
    pub connections: u64,
    pub frames: u64,
    pub units: u64,
    pub entries: u64,
    pub bytes: u64,
    pub units_skipped: u64,
    pub refused_fenced: u64,
    pub refused_bad: u64,
    pub refused_store: u64,
    /// Units refused for their content.
    pub refused_content: u64,
    pub syncs_requested: u64,
    /// Tablets (one per table, first slot and epoch) in the backup store.
    pub tablets: u64,
    /// The store's flush cycles (each a job through its processor, writer and finisher).
    pub store_flushes: u64,
    /// Files the store synced (a round that used one syncfs counts each file).
    pub store_files_synced: u64,
    /// Time the store's processor spent building flushes, its writer writing them, and its
    /// finisher syncing them (ms).
    pub store_process_ms: u64,
    pub store_write_ms: u64,
    pub store_sync_ms: u64,
}

/// Everything replication reports, for `/metrics`, `/status`, `INFO replication` and `ramlog
/// status`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReplicationFigures {
    /// This server as a master: one entry per backup it streams to.
    pub streams: Vec<StreamFigures>,
    /// Acknowledgement latency per table mode (the time a reply waited for its backups).
    pub modes: Vec<ModeFigures>,
    /// This server as a backup.
    pub backup: BackupSideFigures,
    /// Restores and copies after failures (running, and finished in the last minute).
    pub recovery: Vec<JobFigures>,
    /// Milliseconds past its lease without an answer from the coordinator (0: the lease holds).
    pub lease_expired_ms: u64,
    /// Tablets this server mirrors (table mode `mirror`).
    pub mirrors: Vec<MirrorFigures>,
}

/// What `/status` shows of one job.
#[derive(Debug, Clone, serde::Serialize)]
pub struct JobFigures {
    /// "restore" or "copy".
    pub kind: &'static str,
    pub table: u64,
    pub first_slot: u16,
    pub last_slot: u16,
    pub epoch: u64,
    /// The backup a copy goes to.
    pub backup: Option<ServerId>,
    /// "waiting" (for a turn: restores run one per core, copies one at a time), "restoring",
    /// "copying", "done" or "failed".
    pub state: &'static str,
    pub objects: u64,
    pub bytes: u64,
    /// A copy's current pace, bytes per second: it follows the foreground's latency (see
    /// `cluster::pacing`); 0 for a restore.
    pub rate: u64,
    /// A restore's objects to go through (estimated before its replay, from the count the
    /// replay announces), a copy's bytes (the tablet's live bytes); 0 while unknown.
    pub expected: u64,
    /// A client asked for a key of it while it waited: it went first.
    pub demanded: bool,
    pub millis: u64,
    pub done: bool,
    pub error: String,
}

/// One mirrored tablet in `/status` (`metrics.replication.mirrors`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct MirrorFigures {
    pub table: TableId,
    pub first_slot: u16,
    /// "clearing", "building", "ready" or "failed: ...".
    pub state: String,
    /// Since the mirror started.
    pub millis: u64,
}

/// What a cluster server knows of the cluster's recovery from the map it serves, and the room
/// it reports for restores.
#[derive(Debug, Clone, serde::Serialize, Default)]
pub struct ClusterFigures {
    pub map_version: u64,
    /// Tablets (of the whole cluster) whose master died and that are not restored yet.
    pub tablets_recovering: u64,
    /// Of those, the ones no live backup has the memory to restore: their slots answer
    /// CLUSTERDOWN until one has.
    pub tablets_waiting_for_room: u64,
    /// The bytes this server reports it could take for a restore.
    pub restore_room_bytes: u64,
    /// Tablets this server is moving to another server (`ramlog cluster move`, drain,
    /// rebalancing), and tablets moving to it.
    pub migrations_out: u64,
    pub migrations_in: u64,
    /// Of the outgoing moves still copying: bytes copied so far, the tablets' bytes, and the
    /// copies' current pace (bytes per second; it follows the foreground's latency).
    pub migration_copied_bytes: u64,
    pub migration_copy_total_bytes: u64,
    pub migration_copy_rate: u64,
}
