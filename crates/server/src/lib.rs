//! ramlog-server: one server process, wired from the engine, the protocols and the network.
//!
//! Three layers, in folders; dependencies point down only:
//! - [`node`], the bottom: the service layer every front end calls (the keyspace, write admission,
//!   the acknowledgement wait of the durability mode, the clock, auth), the configuration,
//!   standalone persistence, metrics and the admin HTTP endpoint. It knows nothing of front ends
//!   or cluster roles: what it needs from the roles (acknowledgements, their memory, their
//!   figures) it asks through [`node::ClusterHooks`], which the roles register.
//! - [`front`]: the front ends, which only decode, call the node and encode: RESP connections and
//!   the command set, the native protocol (and its scans), and the routing port. They may ask the
//!   cluster roles where a key lives (membership).
//! - [`cluster`]: the roles of a cluster server: membership (joining, heartbeats, the map),
//!   replication (master side), backup duty, recovery, mirrors, and the connections to peers.
//!
//! On top, the entry points: [`server`] wires a process together, [`cli`] is `ramlog server`,
//! [`up`] is `ramlog up`. Hides: sockets, tasks and buffers; the engine is called from
//! connection tasks through the node, with no lock of the server's own.

pub mod cli;
pub mod cluster;
pub mod front;
pub mod node;
pub mod server;
pub mod up;

pub use node::config::{PersistenceMode, ServerConfig};
pub use node::{Node, NodeError};
pub use server::{Addresses, Server, ServerError};
