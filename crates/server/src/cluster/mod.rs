//! The roles a cluster server plays, above the node and beside the front ends:
//! - [`membership`]: joining, heartbeats and the lease, the map this server serves, routing
//!   answers (which server masters a key);
//! - [`replication`]: the master side, each tablet's writes streamed to its backups;
//! - [`backup`]: the backup duty, masters' streams into this server's backup log store;
//! - [`recovery`]: restores and re-protection copies after failures;
//! - [`mirror`]: tablets this server keeps in memory for their masters (table mode `mirror`);
//! - [`migration`] and [`split`]: tablets moving between servers, and tablets splitting in two;
//! - [`peers`]: connections to the other servers (the routing port forwards over them).
//!
//! The roles call the node; the node reaches them only through [`crate::node::ClusterHooks`],
//! which [`Roles`] implements and the server registers.

pub mod backup;
pub mod bulk_sink;
pub mod membership;
pub mod migration;
pub mod mirror;
pub mod pacing;
pub mod peers;
pub mod recovery;
pub mod replication;
mod roles;
pub mod split;

pub use membership::{restore_room_bytes, JoinError, Member, Route};
pub use roles::Roles;
