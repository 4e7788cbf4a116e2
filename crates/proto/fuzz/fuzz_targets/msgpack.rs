//! Feeds arbitrary bytes to the MessagePack decoder behind Lua's `cmsgpack.unpack`: no input may
//! panic, and what decodes re-encodes to bytes that decode to the same values.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramlog_proto::msgpack::{decode_all, encode};

fuzz_target!(|data: &[u8]| {
    if let Ok(values) = decode_all(data) {
        let mut out = Vec::new();
        for v in &values {
            encode(v, &mut out);
        }
        let again = decode_all(&out).expect("an encoding decodes");
        // NaN floats compare unequal to themselves; compare their encodings instead.
        let mut twice = Vec::new();
        for v in &again {
            encode(v, &mut twice);
        }
        assert_eq!(out, twice, "values re-encode to the same bytes");
    }
});
