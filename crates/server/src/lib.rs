//! ramlog-server: one server process, wired from the engine, the protocols and the network.
//!
//! Owns: the service layer that every front end calls ([`node`]: routing, auth, the clock,
//! write admission, the acknowledgement wait of the durability mode, metrics); the front ends,
//! which only decode and encode: the RESP command set with Redis 7 semantics ([`commands`]) and
//! its connections ([`resp_conn`]), the native protocol ([`native`]); configuration
//! ([`config`]), the keyspace of table 0 split into tablets ([`keyspace`]), persistence
//! ([`persistence`]), replication to backups and the backup duty of a cluster server
//! ([`replication`], [`backup_service`]), metrics ([`metrics`]), the admin HTTP endpoint ([`admin`]), and the
//! `ramlog server` / `ramlog up` entry points ([`cli`]). Hides: sockets, tasks and buffers; the
//! engine is called from connection tasks through the node, with no lock of the server's own.

pub mod admin;
pub mod backup_service;
pub mod cli;
pub mod cluster;
pub mod commands;
pub mod config;
pub mod keyspace;
pub mod metrics;
pub mod mirror;
pub mod native;
pub mod node;
pub mod persistence;
pub mod recovery;
pub mod replication;
pub mod resp_conn;
pub mod routing;
pub mod server;
pub mod up;

pub use config::{PersistenceMode, ServerConfig};
pub use node::{Node, NodeError};
pub use server::{Addresses, Server, ServerError};
