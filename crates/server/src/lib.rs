//! ramlog-server: one server process, wired from the engine, the protocols and the network.
//!
//! Owns: configuration ([`config`]), the RESP command set with Redis 7 semantics ([`commands`]),
//! connection handling with limits ([`resp_conn`]), the keyspace of table 0 split into tablets
//! ([`keyspace`]), metrics ([`metrics`]) and the admin HTTP endpoint ([`admin`]), and the
//! `ramlog server` / `ramlog up` entry points ([`cli`]). Hides: sockets, tasks and buffers; the
//! engine is called directly from connection tasks, with no lock of the server's own.

pub mod admin;
pub mod cli;
pub mod commands;
pub mod config;
pub mod keyspace;
pub mod metrics;
pub mod native;
pub mod persistence;
pub mod resp_conn;
pub mod server;

pub use config::{PersistenceMode, ServerConfig};
pub use server::{Addresses, Server, ServerError, Shared};
