//! The roles of one cluster server together, as the rest of the process sees them: the server's
//! wiring creates them before the node (replication is the engine's write observer), registers
//! them with the node as its [`ClusterHooks`], and hands them to the front ends, which ask the
//! membership where keys live and give replication connections to the backup duty.

use crate::cluster::backup::BackupService;
use crate::cluster::membership::Member;
use crate::cluster::replication::{self, Replication};
use crate::node::acks::{Acks, ClusterHooks, HookFuture, RefusedWrite, RolesMemory};
use crate::node::figures::{ClusterFigures, ReplicationFigures};
use crate::node::Node;
use ramlog_logmem::TabletId;
use std::sync::{Arc, OnceLock, Weak};

pub struct Roles {
    pub replication: Arc<Replication>,
    pub backup: Arc<BackupService>,
    /// Set once the server joined its cluster (before it serves).
    member: OnceLock<Arc<Member>>,
    /// The node the roles serve (for the figures that read its engine).
    node: OnceLock<Weak<Node>>,
}

impl std::fmt::Debug for Roles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Roles")
            .field("member", &self.member().map(|m| m.view().me))
            .finish_non_exhaustive()
    }
}

impl Roles {
    /// Replication (not yet streaming: the map names the backups) and the backup duty's store,
    /// in `<data_dir>/backup`.
    pub fn open(config: &crate::node::config::ServerConfig) -> std::io::Result<Arc<Roles>> {
        Ok(Arc::new(Roles {
            replication: Replication::new(config),
            backup: BackupService::open(config)?,
            member: OnceLock::new(),
            node: OnceLock::new(),
        }))
    }

    /// Wires the roles to the node they serve: replication reads refused keys from its engine,
    /// and the node reaches the roles through its hooks.
    pub fn attach(self: &Arc<Self>, node: &Arc<Node>) {
        self.replication.set_engine(node.engine());
        let _ = self.node.set(Arc::downgrade(node));
        node.set_cluster_hooks(self.clone());
    }

    /// The membership, once the server joined.
    #[inline]
    pub fn member(&self) -> Option<&Arc<Member>> {
        self.member.get()
    }

    /// Records the membership once the server joined.
    pub fn set_member(&self, member: Arc<Member>) {
        let _ = self.member.set(member);
    }
}

impl ClusterHooks for Roles {
    #[inline]
    fn collect(&self, acks: &mut Acks) {
        replication::collect(acks);
    }

    #[inline]
    fn read_barrier(&self, tablet: TabletId) {
        self.replication.read_barrier(tablet);
    }

    fn wait<'a>(&'a self, acks: &'a mut Acks) -> HookFuture<'a, Result<Vec<RefusedWrite>, String>> {
        Box::pin(self.replication.wait(acks))
    }

    fn memory(&self) -> RolesMemory {
        RolesMemory {
            replication_buffers: self.replication.memory_bytes() + self.backup.buffer_bytes(),
            backup_store: self.backup.store().memory(),
        }
    }

    fn figures(&self) -> (ReplicationFigures, Option<ClusterFigures>) {
        let member = self.member();
        let replication = ReplicationFigures {
            streams: self.replication.streams(),
            modes: self.replication.modes(),
            backup: self.backup.figures(),
            recovery: member.map(|m| m.jobs.figures()).unwrap_or_default(),
            lease_expired_ms: member
                .and_then(|m| m.lease_expired())
                .map_or(0, |d| d.as_millis() as u64),
            mirrors: member.map(|m| m.mirrors.figures()).unwrap_or_default(),
        };
        let node = self.node.get().and_then(Weak::upgrade);
        let cluster = member.map(|m| {
            let view = m.view();
            let (mut out, mut into) = (0, 0);
            let (mut copied, mut total, mut rate) = (0, 0, 0);
            for t in &view.map.tablets {
                let Some(mig) = t.migration.as_ref().filter(|_| !t.recovering) else {
                    continue;
                };
                if mig.target == view.me {
                    into += 1;
                }
                if t.master != view.me {
                    continue;
                }
                out += 1;
                // The copy to the target, while the move is copying.
                if let Some(j) = replication.recovery.iter().find(|j| {
                    j.kind == "copy"
                        && !j.done
                        && j.table == t.table
                        && j.first_slot == t.first_slot
                        && j.backup == Some(mig.target)
                }) {
                    copied += j.bytes;
                    total += j.expected.max(j.bytes);
                    rate += j.rate;
                }
            }
            ClusterFigures {
                migrations_out: out,
                migrations_in: into,
                migration_copied_bytes: copied,
                migration_copy_total_bytes: total,
                migration_copy_rate: rate,
                map_version: view.map.version,
                tablets_recovering: view.map.tablets.iter().filter(|t| t.recovering).count() as u64,
                tablets_waiting_for_room: view.tablets_waiting_for_room() as u64,
                restore_room_bytes: node
                    .as_deref()
                    .map_or(0, crate::cluster::membership::restore_room_bytes),
            }
        });
        (replication, cluster)
    }

    fn stop(&self) -> HookFuture<'_, ()> {
        Box::pin(async move {
            self.replication.stop();
            self.backup.close_connections();
            let backup = self.backup.clone();
            let _ = tokio::task::spawn_blocking(move || backup.flush()).await;
        })
    }
}
