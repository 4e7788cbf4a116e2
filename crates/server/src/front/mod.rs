//! The front ends: each decodes its protocol, calls the [`crate::node::Node`] and encodes the
//! answer; none keeps data of its own. RESP connections ([`resp_conn`]) and the Redis command set
//! ([`commands`]), the native binary protocol ([`native`], with its scans), and the routing port
//! ([`routing`]), which forwards each command to the key's master. They depend on the node, and on
//! the cluster roles only to ask where a key lives and to hand a replication connection to the
//! backup duty; nothing below them calls them.

pub mod analytic;
pub mod blocking;
pub mod commands;
pub mod native;
pub mod resp_conn;
pub mod routing;
pub mod scan_pool;
