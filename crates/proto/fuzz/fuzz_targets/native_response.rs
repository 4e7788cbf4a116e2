//! Feeds arbitrary bytes to the native reply decoder, as a client reads them from a socket. Every decoded
//! reply must re-encode and decode to itself (checked inside `decode_response_stream`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramlog_proto::native::decode_response_stream;

fuzz_target!(|data: &[u8]| {
    decode_response_stream(data, 1 << 20);
});
