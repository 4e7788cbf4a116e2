//! Feeds arbitrary bytes to the RESP2/RESP3 reply decoder used by tools and tests.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramlog_proto::resp::ReplyDecoder;

fuzz_target!(|data: &[u8]| {
    let decoder = ReplyDecoder { bulk_len_max: 4096, aggregate_len_max: 1024, depth_max: 16 };
    let mut pos = 0;
    while pos < data.len() {
        match decoder.decode(&data[pos..]) {
            Ok(Some((_, used))) => {
                assert!(used > 0 && pos + used <= data.len());
                pos += used;
            }
            Ok(None) | Err(_) => break,
        }
    }
});
