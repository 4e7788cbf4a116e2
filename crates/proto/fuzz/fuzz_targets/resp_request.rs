//! Feeds arbitrary bytes to the RESP request decoder, as a server reads them from a socket:
//! decode requests one after another until the buffer runs out or an error stops the connection.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramlog_proto::resp::{Request, RequestDecoder, RequestLimits};

fuzz_target!(|data: &[u8]| {
    let limits = RequestLimits { bulk_len_max: 4096, array_len_max: 256, inline_len_max: 1024, request_len_max: 16384 };
    let decoder = RequestDecoder::new(limits);
    let mut request = Request::default();
    let mut pos = 0;
    while pos < data.len() {
        match decoder.decode(&data[pos..], &mut request) {
            Ok(Some(consumed)) => {
                assert!(consumed > 0 && pos + consumed <= data.len());
                let args = request.args(&data[pos..]);
                assert!(args.len() <= limits.array_len_max);
                for arg in args {
                    assert!(arg.len() <= limits.bulk_len_max.max(limits.inline_len_max));
                }
                pos += consumed;
            }
            Ok(None) | Err(_) => break,
        }
    }
});
