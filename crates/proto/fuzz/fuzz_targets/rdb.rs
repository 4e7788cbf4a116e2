//! Feeds arbitrary bytes to the `RESTORE` payload decoder: no input may panic or allocate past
//! the limits, and whatever decodes dumps to a payload that decodes to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramlog_proto::rdb::{dump, restore, Limits};

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        string_bytes: 1 << 20,
        elements: 1 << 16,
    };
    // Most inputs fail the checksum; also decode the body as if it had a valid footer.
    let mut sealed = data.to_vec();
    sealed.extend_from_slice(&9u16.to_le_bytes());
    let crc = ramlog_proto::rdb::crc64(0, &sealed);
    sealed.extend_from_slice(&crc.to_le_bytes());
    for payload in [data, &sealed[..]] {
        if let Ok(value) = restore(payload, limits) {
            assert_eq!(restore(&dump(&value), limits), Ok(value), "a dump restores to its value");
        }
    }
});
