//! Feeds arbitrary bytes to the native request decoder, as a server reads them from a socket: frame
//! after frame, skipping oversize frames the way the server resynchronises. Every decoded request must
//! re-encode to a frame that decodes to the same request (checked inside `decode_request_stream`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramlog_proto::native::decode_request_stream;

fuzz_target!(|data: &[u8]| {
    // The first byte picks a small frame limit so that the oversize path is reached often.
    let max_frame_bytes = 16 + data.first().copied().unwrap_or(0) as usize * 16;
    decode_request_stream(data, max_frame_bytes);
});
