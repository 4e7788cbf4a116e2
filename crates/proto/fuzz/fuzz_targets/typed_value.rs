//! Feeds arbitrary bytes to the decoders of typed values, as a server reads a stored value back
//! (a damaged one, or one a native client wrote with a leading 0xFF), and to the decoders of a
//! large list's chunks and chunk keys, of a large hash's or set's header and buckets, and of a
//! large sorted set's header and tree nodes. A value that decodes must re-encode to the same
//! bytes; no input may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramlog_proto::types::{
    check, chunk_key, is_large, is_raw_string, large_gen, parse_chunk_key, store_string,
    store_string_in_place, string_of, Hash, Kind, LargeList, LargeTable, LargeZSet, List,
    ListChunk, RawBucket, RawChunk, RawList, Set, Stream, ZNode, ZSet, EMBSTR_MAX_BYTES,
};

fuzz_target!(|data: &[u8]| {
    let decoded = ListChunk::decode(data);
    if let Ok(chunk) = &decoded {
        assert_eq!(
            chunk.encode(),
            data,
            "a decoded chunk re-encodes to its bytes"
        );
    }
    // The encoded form accepts exactly what the decoder does, and its pops return the elements.
    match RawChunk::decode(data) {
        Ok(mut raw) => {
            assert_eq!(raw.encode(), data, "a raw chunk re-encodes to its bytes");
            let chunk = decoded.expect("both decoders agree");
            let mut back = raw.pop_back(usize::MAX);
            back.reverse();
            assert_eq!(
                back,
                Vec::from(chunk.items),
                "the pops return every element"
            );
            assert_eq!(raw.count, 0);
        }
        Err(_) => assert!(decoded.is_err(), "both decoders agree"),
    }
    // A compact list's bytes: read as they stand exactly when the list decodes, and a push or
    // a pop on them makes what the decoded list's would.
    match RawList::decode(data) {
        Ok(raw) => {
            let list = List::decode(data).expect("both decoders agree");
            assert_eq!(raw.count, list.items.len());
            let mut want = list.clone();
            want.items.push_front(b"a".to_vec());
            want.items.push_back(b"z".to_vec());
            let once = raw.pushed(true, &[b"a".as_slice()]);
            let pushed = RawList::decode(&once).unwrap();
            assert_eq!(
                List::decode(&pushed.pushed(false, &[b"z".as_slice()])).unwrap(),
                want
            );
            let half = list.items.len() / 2 + 1;
            for left in [true, false] {
                let (popped, rest) = raw.popped(left, half);
                let mut want = list.clone();
                let want_popped = want.pop(left, half);
                assert_eq!(popped, want_popped);
                match rest {
                    Some(r) => assert_eq!(List::decode(&r).unwrap(), want),
                    None => assert!(want.items.is_empty()),
                }
            }
        }
        Err(_) => assert!(
            is_large(data) || List::decode(data).is_err(),
            "both decoders agree"
        ),
    }
    // A bucket is a compact hash or set: it decodes exactly when they do, and its entries are
    // its count.
    for kind in [Kind::Hash, Kind::Set] {
        if let Ok(bucket) = RawBucket::decode(data, kind) {
            assert_eq!(bucket.entries().count() as u64, bucket.count);
            assert_eq!(bucket.encoded_len(), bucket.encode().len());
            let compact = match kind {
                Kind::Hash => Hash::decode(data).map(|h| h.fields.len()),
                _ => Set::decode(data).map(|s| s.members.len()),
            };
            assert_eq!(
                compact,
                Ok(bucket.count as usize),
                "a bucket decodes as its compact form"
            );
        }
    }
    if let Ok(table) = LargeTable::decode(data) {
        assert_eq!(
            table.encode(),
            data,
            "a large table's header re-encodes to its bytes"
        );
        assert_eq!(large_gen(data), Some(table.gen));
        for hash in [0, 1, u64::MAX, table.gen] {
            assert!(table.bucket_of(hash) < table.buckets());
        }
    }
    if let Ok(z) = LargeZSet::decode(data) {
        assert_eq!(
            z.encode(),
            data,
            "a large sorted set's header re-encodes to its bytes"
        );
        assert_eq!(large_gen(data), Some(z.gen));
        assert!(z.root < z.next_node);
    }
    if let Ok(node) = ZNode::decode(data) {
        assert_eq!(node.encode(), data, "a tree node re-encodes to its bytes");
        assert_eq!(node.encoded_len(), data.len());
        assert!(node.first().is_some() || node.items() == 0);
    }
    if let Some((slot, key, gen, id)) = parse_chunk_key(data) {
        assert_eq!(
            chunk_key(slot, key, gen, id),
            data,
            "a chunk key re-encodes"
        );
    }
    if let Ok((kind, _)) = check(data) {
        let again = match kind {
            Kind::String => {
                // A string reads back as bytes that store again to what was read (a plain or
                // escaped string as SET stores it, a short one changed in place as APPEND does).
                let s = string_of(data).expect("a string's bytes");
                if is_raw_string(data) {
                    if s.len() <= EMBSTR_MAX_BYTES {
                        assert_eq!(store_string_in_place(s).as_ref(), data);
                    }
                } else if data.first() != Some(&0xFF) || s.first() == Some(&0xFF) {
                    assert_eq!(store_string(s).as_ref(), data);
                }
                return;
            }
            Kind::List if is_large(data) => LargeList::decode(data).map(|h| h.encode()),
            Kind::Hash | Kind::Set if is_large(data) => {
                LargeTable::decode(data).map(|h| h.encode())
            }
            Kind::ZSet if is_large(data) => LargeZSet::decode(data).map(|h| h.encode()),
            Kind::Hash => Hash::decode(data).map(|h| h.encode()),
            Kind::List => List::decode(data).map(|l| l.encode()),
            Kind::Set => Set::decode(data).map(|s| s.encode()),
            Kind::ZSet => ZSet::decode(data).map(|z| z.encode()),
            Kind::Stream => {
                let Ok(s) = Stream::decode(data) else {
                    return;
                };
                let again = s.encode();
                // A stream written before consumer groups gains their section (its counters
                // and no groups) when written again; every stream reads back as it was.
                assert!(
                    again == data || again.starts_with(data),
                    "a decoded stream re-encodes to its bytes, or to them and the groups' section"
                );
                assert_eq!(
                    Stream::decode(&again),
                    Ok(s),
                    "a re-encoded stream reads back"
                );
                return;
            }
        };
        assert_eq!(
            again.as_deref(),
            Ok(data),
            "a decoded value re-encodes to its bytes"
        );
    }
});
