//! Fuzzes the decoders of scan results as a client reads them from a reply: a value list
//! (`decode_values`) and a grouped result (`decode_groups`), with the bound on groups and on
//! each value's length taken from the first two bytes. Nothing may panic, a result never holds
//! more groups than the bound, and whatever decodes re-encodes to the same bytes. The first
//! eight bytes also go through `scan_position` as a resumable scan's cursor: a position it
//! accepts gives back the same cursor.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramlog_query::{
    decode_groups, decode_values, encode_groups, encode_values, is_groups, scan_cursor, scan_position,
};

fuzz_target!(|data: &[u8]| {
    if let Some(head) = data.get(..8) {
        let cursor = u64::from_le_bytes(head.try_into().expect("eight bytes"));
        if let Ok((slot, chunk)) = scan_position(cursor) {
            if cursor != 0 {
                assert_eq!(scan_cursor(slot, chunk), cursor);
            }
        }
    }
    if data.len() < 2 {
        return;
    }
    let (bounds, bytes) = data.split_at(2);
    let groups_max = bounds[0] as usize;
    let value_bytes_max = bounds[1] as usize * 4;
    if is_groups(bytes) {
        assert!(decode_values(bytes, value_bytes_max).is_err());
        if let Ok(groups) = decode_groups(bytes, groups_max, value_bytes_max) {
            assert!(groups.len() <= groups_max);
            let mut out = Vec::new();
            encode_groups(&groups, &mut out).expect("decoded groups encode");
            assert_eq!(out, bytes);
        }
    } else if let Ok(values) = decode_values(bytes, value_bytes_max) {
        let mut out = Vec::new();
        encode_values(&values, &mut out).expect("decoded values encode");
        assert_eq!(out, bytes);
    }
});
