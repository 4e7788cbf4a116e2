//! ramlog-proto: the wire formats, and nothing else.
//!
//! Owns: the RESP codec ([`resp`]: request decoder with limits, RESP2/RESP3 reply encoder, a reply
//! decoder for tests and tools). Hides: framing details and every bound check on untrusted lengths.
//! Knows nothing of storage or sockets: functions take byte buffers and return values or errors,
//! so each format can be fuzzed alone (see `fuzz/`).

pub mod msgpack;
pub mod native;
pub mod rdb;
pub mod repl;
pub mod resp;
pub mod types;
