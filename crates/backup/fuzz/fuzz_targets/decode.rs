//! Fuzzes every on-disk decoder of the backup logs: entries, blocks, primary-log runs, version-log
//! blocks (with resynchronisation), the manifest and write-buffer batch headers.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = ramlog_backup::format::decode_everything(data);
});
