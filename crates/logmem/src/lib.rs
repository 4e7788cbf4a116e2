//! Log-structured memory: the master's object store (see crates/logmem/README in lib docs).
