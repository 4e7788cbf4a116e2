//! Feeds arbitrary bytes to the coordinator's frame body decoder, as both a coordinator (requests)
//! and a client (responses) read them: decoding must fail cleanly or succeed, never panic, and a
//! decoded message must encode again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramlog_cluster::rpc::{decode_frame_body, Request, Response};

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = decode_frame_body::<Request>(data) {
        let again = serde_json::to_vec(&request).expect("a decoded request encodes");
        decode_frame_body::<Request>(&again).expect("an encoded request decodes");
    }
    if let Ok(response) = decode_frame_body::<Response>(data) {
        let again = serde_json::to_vec(&response).expect("a decoded response encodes");
        decode_frame_body::<Response>(&again).expect("an encoded response decodes");
    }
});
