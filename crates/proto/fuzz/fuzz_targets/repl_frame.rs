//! Feeds arbitrary bytes to the replication decoders, as a backup reads a REPL_BATCH body and a
//! master reads a REPL_ACK. Every batch that decodes must re-encode to the same bytes
//! (checked inside `check_batch_roundtrip`); no input may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramlog_proto::repl::{check_batch_roundtrip, encode_batch_body, Ack, Hello, Limits};

const LIMITS: Limits = Limits {
    key_max_bytes: 64 * 1024,
    value_max_bytes: 1 << 20,
};

fuzz_target!(|data: &[u8]| {
    let _ = check_batch_roundtrip(data, LIMITS);
    // The checksum stops almost every random body at the door: also wrap the bytes in a valid
    // head so that the unit decoder sees them.
    let mut body = Vec::new();
    encode_batch_body(&mut body, 0, 0, data);
    let _ = check_batch_roundtrip(&body, LIMITS);
    let _ = Ack::decode(data);
    let _ = Hello::decode(data);
});
