//! ramlog's benchmark suites, run by `ramlog bench <suite>`.
//!
//! Every suite prints a table and can write JSON in one shared format ([`report`]):
//! one row per figure, with the peer or physical limit measured in the same run
//! as its baseline, so that each figure is a ratio rather than a bare time.

pub mod backup;
pub mod cluster;
pub mod engine;
pub mod native;
pub mod recovery;
pub mod report;
pub mod resp;
pub mod scan;
pub mod types;
pub mod util;
