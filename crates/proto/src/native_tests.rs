//! Tests of the native codec: exact bytes for one frame of each kind, round trips of every request and
//! response (property tests), and random or mutated bytes fed to the decoders (the stable twin of the fuzz
//! target in `crates/proto/fuzz`).

use super::*;
use proptest::prelude::*;

fn frame_of(request: &Request<'_>, id: u64) -> BytesMut {
    let mut out = BytesMut::new();
    request.encode(id, &mut out);
    out
}

fn decode_one(buf: &[u8]) -> Result<(FrameHeader, Request<'_>), DecodeError> {
    let h = parse_header(buf, FRAME_BYTES_HARD_MAX)
        .expect("header")
        .expect("complete header");
    assert_eq!(h.frame_bytes(), buf.len(), "exactly one frame");
    Request::decode(h.opcode, h.flags_or_status, &buf[HEADER_LEN..]).map(|r| (h, r))
}

#[test]
fn get_frame_bytes_are_as_documented() {
    let buf = frame_of(
        &Request::Get {
            table: 0,
            key: b"abc",
        },
        0x0102030405060708,
    );
    let expected: Vec<u8> = [
        &[19, 0, 0, 0][..],        // length: 12 + 7
        &[8, 7, 6, 5, 4, 3, 2, 1], // request id
        &[opcode::GET, 0, 0, 0],   // opcode, flags, reserved
        &[3, 0, 0, 0],             // key length
        b"abc",
    ]
    .concat();
    assert_eq!(&buf[..], &expected[..]);
}

#[test]
fn put_with_table_and_condition_bytes() {
    let req = Request::Put {
        table: 7,
        key: b"k",
        value: b"vv",
        condition: Condition::IfVersion(9),
        expiry: Expiry::AfterMs(1500),
        return_old: true,
    };
    let buf = frame_of(&req, 1);
    assert_eq!(buf[13], flag::TABLE | flag::RETURN_OLD);
    let body = &buf[HEADER_LEN..];
    assert_eq!(&body[..8], &7u64.to_le_bytes());
    assert_eq!(&body[8..13], &[1, 0, 0, 0, b'k']);
    assert_eq!(&body[13..19], &[2, 0, 0, 0, b'v', b'v']);
    assert_eq!(body[19], 3);
    assert_eq!(&body[20..28], &9u64.to_le_bytes());
    assert_eq!(body[28], 1);
    assert_eq!(&body[29..37], &1500u64.to_le_bytes());
    assert_eq!(body.len(), 37);
    assert_eq!(decode_one(&buf).unwrap().1, req);
}

#[test]
fn error_frame_bytes() {
    let mut out = BytesMut::new();
    encode_error(&mut out, 5, opcode::PUT, Status::ConditionFailed, 42, "no");
    let expected: Vec<u8> = [
        &[26, 0, 0, 0][..],
        &5u64.to_le_bytes(),
        &[opcode::PUT, 0x01, 0, 0],
        &42u64.to_le_bytes(),
        &[2, 0, 0, 0],
        b"no",
    ]
    .concat();
    assert_eq!(&out[..], &expected[..]);
    let h = parse_header(&out, 1 << 20).unwrap().unwrap();
    let resp = Response::decode(
        h.opcode,
        h.flags_or_status,
        out.freeze().slice(HEADER_LEN..),
    )
    .unwrap();
    assert_eq!(
        resp,
        Response::Error(ErrorReply {
            status: Status::ConditionFailed,
            detail: 42,
            message: "no".into()
        })
    );
}

#[test]
fn header_limits() {
    // Fewer than 4 bytes, or fewer than 16: incomplete.
    assert_eq!(parse_header(&[1, 0], 100), Ok(None));
    assert_eq!(parse_header(&[12, 0, 0, 0, 1], 100), Ok(None));
    // A length below the header size cannot be resynchronised.
    assert_eq!(
        parse_header(&[11, 0, 0, 0], 100),
        Err(FrameError::TooShort { frame_len: 11 })
    );
    // Oversize: reported with the request id so the server can answer it, and the bytes to skip.
    let mut buf = BytesMut::new();
    Request::Ping {
        payload: &[0u8; 100],
    }
    .encode(77, &mut buf);
    match parse_header(&buf, 64) {
        Err(FrameError::TooLarge {
            frame_bytes,
            max_bytes,
            request_id,
            opcode,
            skip_bytes,
        }) => {
            assert_eq!(
                (frame_bytes, max_bytes, request_id, opcode),
                (buf.len(), 64, 77, opcode::PING)
            );
            assert_eq!(skip_bytes, buf.len() - HEADER_LEN);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    // An absurd length is refused before anything is read or allocated.
    let absurd = [
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        opcode::GET,
        0,
        0,
        0,
    ];
    assert!(
        matches!(parse_header(&absurd, usize::MAX), Err(FrameError::TooLarge { max_bytes, .. }) if max_bytes == FRAME_BYTES_HARD_MAX)
    );
}

#[test]
fn malformed_bodies_are_typed_errors() {
    // Unknown opcode.
    let e = Request::decode(0x7E, 0, &[]).unwrap_err();
    assert_eq!(e.status, Status::UnknownOpcode);
    // Reserved opcodes and flags.
    assert_eq!(
        Request::decode(0x36, 0, &[]).unwrap_err().status,
        Status::Unsupported
    );
    assert_eq!(
        Request::decode(opcode::GET, flag::SNAPSHOT, &[0, 0, 0, 0])
            .unwrap_err()
            .status,
        Status::Unsupported
    );
    assert_eq!(
        Request::decode(opcode::GET, 0x80, &[0, 0, 0, 0])
            .unwrap_err()
            .status,
        Status::BadRequest
    );
    // A key length pointing past the end.
    assert_eq!(
        Request::decode(opcode::GET, 0, &[9, 0, 0, 0, 1])
            .unwrap_err()
            .status,
        Status::BadRequest
    );
    // Trailing bytes.
    assert_eq!(
        Request::decode(opcode::GET, 0, &[0, 0, 0, 0, 1])
            .unwrap_err()
            .status,
        Status::BadRequest
    );
    // A multi-get count far larger than the body: refused before allocating.
    let e = Request::decode(opcode::MULTI_GET, 0, &[0, 0, 1, 0]).unwrap_err();
    assert_eq!(e.status, Status::BadRequest);
    let e = Request::decode(opcode::MULTI_GET, 0, &[0xFF, 0xFF, 0xFF, 0xFF]).unwrap_err();
    assert!(e.message.contains("limit"), "{e}");
    // Bad condition kind.
    let mut body = vec![1, 0, 0, 0, b'k'];
    body.push(9);
    body.extend_from_slice(&[0; 8]);
    assert_eq!(
        Request::decode(opcode::DELETE, 0, &body)
            .unwrap_err()
            .status,
        Status::BadRequest
    );
}

#[test]
fn scan_frames_are_as_documented() {
    // SCAN_FILTERED on table 3 at snapshot 9, 100 records a page, query bytes [1, 0, 0, 0, 0].
    let buf = frame_of(
        &Request::ScanFiltered {
            table: 3,
            snapshot: 9,
            max_records: 100,
            query: &[1, 0, 0, 0, 0],
        },
        5,
    );
    assert_eq!(buf[12], opcode::SCAN_FILTERED);
    assert_eq!(buf[13], flag::TABLE);
    let expected: Vec<u8> = [
        &3u64.to_le_bytes()[..],
        &9u64.to_le_bytes(),
        &100u32.to_le_bytes(),
        &[5, 0, 0, 0, 1, 0, 0, 0, 0],
    ]
    .concat();
    assert_eq!(&buf[HEADER_LEN..], &expected[..]);
    // A page with one record, built by the direct encoder, equals Response::encode's bytes.
    let mut direct = BytesMut::new();
    let start = begin_scan_page(&mut direct, 5, opcode::SCAN_NEXT, 77, 12, 1);
    put_record(&mut direct, b"k", b"vv", 11, 0);
    finish_reply_frame(&mut direct, start);
    let page = Response::ScanPage {
        cursor: 77,
        snapshot_version: 12,
        records: vec![Record {
            key: Bytes::from_static(b"k"),
            value: Bytes::from_static(b"vv"),
            version: 11,
            expire_at_ms: 0,
        }],
    };
    let mut encoded = BytesMut::new();
    page.encode(5, opcode::SCAN_NEXT, &mut encoded);
    assert_eq!(direct, encoded);
    let body: Vec<u8> = [
        &[SCAN_REPLY_RECORDS][..],
        &77u64.to_le_bytes(),
        &12u64.to_le_bytes(),
        &1u32.to_le_bytes(),
        &[1, 0, 0, 0, b'k'],
        &11u64.to_le_bytes(),
        &0u64.to_le_bytes(),
        &[2, 0, 0, 0, b'v', b'v'],
    ]
    .concat();
    assert_eq!(&encoded[HEADER_LEN..], &body[..]);
    assert_eq!(record_wire_bytes(1, 2), body.len() - 21);
    // Aggregates only answer SCAN_FILTERED; a SCAN_NEXT reply of that kind is malformed.
    let mut agg = BytesMut::new();
    Response::ScanAggregates {
        snapshot_version: 1,
        matched: 2,
        malformed: 0,
        values: Bytes::from_static(&[0]),
    }
    .encode(1, opcode::SCAN_NEXT, &mut agg);
    let h = parse_header(&agg, FRAME_BYTES_HARD_MAX).unwrap().unwrap();
    assert!(Response::decode(h.opcode, 0, agg.freeze().slice(HEADER_LEN..)).is_err());
    // TABLE is not valid on connection-level scan operations.
    assert_eq!(
        Request::decode(opcode::SCAN_NEXT, flag::TABLE, &[0; 20])
            .unwrap_err()
            .status,
        Status::BadRequest
    );
}

#[test]
fn hellos_round_trip() {
    let c = ClientHello {
        version_max: PROTOCOL_VERSION,
        flags: 0,
    };
    let bytes = c.encode();
    assert_eq!(&bytes[..], &[b'R', b'L', b'O', b'G', 1, 0, 0, 0]);
    assert_eq!(ClientHello::decode(&bytes), Ok(c));
    let s = ServerHello {
        version: 1,
        flags: HELLO_FLAG_AUTH_REQUIRED,
        max_frame_bytes: 8 << 20,
        max_in_flight: 1024,
        key_size_max_bytes: 65536,
        value_size_max_bytes: 1 << 20,
    };
    assert_eq!(ServerHello::decode(&s.encode()), Ok(s));
    let mut bad = s.encode();
    bad[0] = b'X';
    assert!(ServerHello::decode(&bad).is_err());
    assert!(
        ClientHello::decode(b"*1\r\n$4\r\n").is_err(),
        "a RESP client is refused"
    );
}

#[test]
fn status_codes_round_trip() {
    for code in 0..=255u8 {
        assert_eq!(Status::from_u8(code).to_u8(), code);
    }
}

/// Owned request data, turned into a borrowed `Request` for encoding.
#[derive(Clone, Debug)]
struct Owned {
    kind: u8,
    table: u64,
    a: Vec<u8>,
    b: Vec<u8>,
    n: u64,
    m: u32,
    cond: Condition,
    expiry: Expiry,
    flag: bool,
    list: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Owned {
    fn request(&self) -> Request<'_> {
        let table = self.table;
        let key = &self.a[..];
        match self.kind % 23 {
            0 => Request::Ping { payload: key },
            1 => Request::Auth { password: key },
            2 => Request::Stats,
            3 => Request::Get { table, key },
            4 => Request::Put {
                table,
                key,
                value: &self.b,
                condition: self.cond,
                expiry: self.expiry,
                return_old: self.flag,
            },
            5 => Request::Delete {
                table,
                key,
                condition: self.cond,
            },
            6 => Request::Increment {
                table,
                key,
                delta: self.n as i64,
            },
            7 => Request::Expire {
                table,
                key,
                expiry: if self.expiry == Expiry::Keep {
                    Expiry::None
                } else {
                    self.expiry
                },
            },
            8 => Request::MultiGet {
                table,
                keys: self.list.iter().map(|(k, _)| &k[..]).collect(),
            },
            9 => Request::MultiPut {
                table,
                items: self.list.iter().map(|(k, v)| (&k[..], &v[..])).collect(),
            },
            10 => Request::ScanKeys {
                table,
                cursor: self.n,
                count: self.m,
                pattern: key,
            },
            11 => Request::SnapshotOpen,
            12 => Request::SnapshotRelease { snapshot: self.n },
            13 => Request::ScanFiltered {
                table,
                snapshot: self.n,
                max_records: self.m,
                query: key,
            },
            14 => Request::GetAt {
                table,
                snapshot: self.n,
                key,
            },
            15 => Request::ScanNext {
                cursor: self.n,
                max_records: self.m,
            },
            16 => Request::ScanClose { cursor: self.n },
            17 => Request::SetSchema { table, schema: key },
            18 => Request::ClusterMap,
            19 => Request::RespBatch {
                protocol: 2 + (self.n % 2) as u8,
                commands: self
                    .list
                    .iter()
                    .map(|(k, v)| vec![&k[..], &v[..]])
                    .collect(),
            },
            20 => Request::ScanTablet {
                table,
                first_slot: (self.n % 16384) as u16,
                last_slot: ((self.n % 16384) as u16 + (self.m % 8) as u16).min(16383),
                epoch: self.n,
                snapshot: if self.m % 2 == 1 { 0 } else { self.n / 3 },
                from_mirror: self.m % 2 == 1,
                only_slots: {
                    let first = (self.n % 16384) as u16;
                    let last = (first + (self.m % 8) as u16).min(16383);
                    (first + (last - first) / 2, last)
                },
                max_records: self.m,
                query: key,
            },
            21 => Request::SnapshotCut {
                table,
                at_unix_ns: self.n,
                hold_us: self.m % (SNAPSHOT_CUT_HOLD_MAX_US + 1),
            },
            _ => Request::GetSchema { table },
        }
    }
}

fn bytes_strategy() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..40)
}

fn condition_strategy() -> impl Strategy<Value = Condition> {
    prop_oneof![
        Just(Condition::None),
        Just(Condition::IfAbsent),
        Just(Condition::IfExists),
        any::<u64>().prop_map(Condition::IfVersion)
    ]
}

fn expiry_strategy() -> impl Strategy<Value = Expiry> {
    prop_oneof![
        Just(Expiry::None),
        Just(Expiry::Keep),
        any::<u64>().prop_map(Expiry::AfterMs),
        any::<u64>().prop_map(Expiry::AtUnixMs)
    ]
}

fn owned_strategy() -> impl Strategy<Value = Owned> {
    (
        any::<u8>(),
        prop_oneof![Just(0u64), any::<u64>()],
        bytes_strategy(),
        bytes_strategy(),
        any::<u64>(),
        any::<u32>(),
        condition_strategy(),
        expiry_strategy(),
        any::<bool>(),
        prop::collection::vec((bytes_strategy(), bytes_strategy()), 0..8),
    )
        .prop_map(
            |(kind, table, a, b, n, m, cond, expiry, flag, list)| Owned {
                kind,
                table,
                a,
                b,
                n,
                m,
                cond,
                expiry,
                flag,
                list,
            },
        )
}

fn object_strategy() -> impl Strategy<Value = Option<Object>> {
    prop::option::of((bytes_strategy(), any::<u64>(), any::<u64>())).prop_map(|o| {
        o.map(|(value, version, expire_at_ms)| Object {
            value: Bytes::from(value),
            version,
            expire_at_ms,
        })
    })
}

fn response_strategy() -> impl Strategy<Value = (u8, Response)> {
    prop_oneof![
        bytes_strategy().prop_map(|p| (opcode::PING, Response::Pong(p.into()))),
        Just((opcode::AUTH, Response::AuthOk)),
        bytes_strategy().prop_map(|p| (opcode::STATS, Response::Stats(p.into()))),
        object_strategy().prop_map(|o| (opcode::GET, Response::Get(o))),
        (any::<u64>(), object_strategy())
            .prop_map(|(version, old)| (opcode::PUT, Response::Put { version, old })),
        prop::option::of(any::<u64>()).prop_map(|v| (opcode::DELETE, Response::Delete(v))),
        prop::option::of(any::<u64>()).prop_map(|v| (opcode::EXPIRE, Response::Expire(v))),
        (any::<i64>(), any::<u64>()).prop_map(|(value, version)| (
            opcode::INCREMENT,
            Response::Increment { value, version }
        )),
        prop::collection::vec(object_strategy(), 0..6)
            .prop_map(|v| (opcode::MULTI_GET, Response::MultiGet(v))),
        any::<u64>().prop_map(|version| (opcode::MULTI_PUT, Response::MultiPut { version })),
        (any::<u64>(), prop::collection::vec(bytes_strategy(), 0..6)).prop_map(|(cursor, keys)| (
            opcode::SCAN_KEYS,
            Response::ScanKeys {
                cursor,
                keys: keys.into_iter().map(Bytes::from).collect()
            }
        )),
        (any::<u64>(), any::<u64>()).prop_map(|(snapshot, version)| (
            opcode::SNAPSHOT_OPEN,
            Response::SnapshotOpen { snapshot, version }
        )),
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()).prop_map(
            |(snapshot, version, from, to)| (
                opcode::SNAPSHOT_CUT,
                Response::SnapshotCut {
                    snapshot,
                    version,
                    held_from_ns: from,
                    held_to_ns: to
                }
            )
        ),
        Just((opcode::SNAPSHOT_RELEASE, Response::SnapshotReleased)),
        Just((opcode::SCAN_CLOSE, Response::ScanClosed)),
        Just((opcode::SET_SCHEMA, Response::SchemaSet)),
        bytes_strategy().prop_map(|s| (opcode::GET_SCHEMA, Response::Schema(s.into()))),
        bytes_strategy().prop_map(|s| (opcode::CLUSTER_MAP, Response::ClusterMap(s.into()))),
        prop::collection::vec(bytes_strategy(), 0..6).prop_map(|r| (
            opcode::RESP_BATCH,
            Response::RespBatch(r.into_iter().map(Bytes::from).collect())
        )),
        object_strategy().prop_map(|o| (opcode::GET_AT, Response::GetAt(o))),
        (
            any::<bool>(),
            any::<u64>(),
            any::<u64>(),
            prop::collection::vec(
                (
                    bytes_strategy(),
                    bytes_strategy(),
                    any::<u64>(),
                    any::<u64>()
                ),
                0..6
            )
        )
            .prop_map(|(next, cursor, snapshot_version, records)| (
                if next {
                    opcode::SCAN_NEXT
                } else {
                    opcode::SCAN_FILTERED
                },
                Response::ScanPage {
                    cursor,
                    snapshot_version,
                    records: records
                        .into_iter()
                        .map(|(key, value, version, expire_at_ms)| Record {
                            key: key.into(),
                            value: value.into(),
                            version,
                            expire_at_ms
                        })
                        .collect()
                }
            )),
        (any::<u64>(), any::<u64>(), any::<u64>(), bytes_strategy()).prop_map(
            |(snapshot_version, matched, malformed, values)| (
                opcode::SCAN_FILTERED,
                Response::ScanAggregates {
                    snapshot_version,
                    matched,
                    malformed,
                    values: values.into()
                }
            )
        ),
        (1u8..=255, any::<u64>(), "[ -~]{0,30}", any::<u8>()).prop_map(
            |(status, detail, message, op)| (
                op,
                Response::Error(ErrorReply {
                    status: Status::from_u8(status),
                    detail,
                    message
                })
            )
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn request_round_trip(owned in owned_strategy(), id in any::<u64>()) {
        let request = owned.request();
        let buf = frame_of(&request, id);
        let (h, decoded) = decode_one(&buf).expect("decodes");
        prop_assert_eq!(h.request_id, id);
        prop_assert_eq!(h.opcode, request.opcode());
        prop_assert_eq!(decoded, request);
    }

    #[test]
    fn pipelined_requests_split_anywhere(owned in prop::collection::vec(owned_strategy(), 1..10), cut in any::<usize>()) {
        // Many frames back to back, delivered in two pieces: the decoder finds every frame exactly once.
        let mut stream = BytesMut::new();
        for (i, o) in owned.iter().enumerate() {
            o.request().encode(i as u64, &mut stream);
        }
        let cut = cut % (stream.len() + 1);
        let mut pending = BytesMut::from(&stream[..cut]);
        let mut rest = &stream[cut..];
        let mut seen = Vec::new();
        loop {
            match parse_header(&pending, FRAME_BYTES_HARD_MAX).expect("valid") {
                Some(h) if pending.len() >= h.frame_bytes() => {
                    let frame = pending.split_to(h.frame_bytes());
                    let req = Request::decode(h.opcode, h.flags_or_status, &frame[HEADER_LEN..]).expect("decodes");
                    prop_assert_eq!(req, owned[h.request_id as usize].request());
                    seen.push(h.request_id);
                }
                _ if !rest.is_empty() => {
                    pending.extend_from_slice(rest);
                    rest = &[];
                }
                _ => break,
            }
        }
        prop_assert_eq!(seen, (0..owned.len() as u64).collect::<Vec<_>>());
    }

    #[test]
    fn response_round_trip((op, response) in response_strategy(), id in any::<u64>()) {
        let mut out = BytesMut::new();
        response.encode(id, op, &mut out);
        let h = parse_header(&out, FRAME_BYTES_HARD_MAX).unwrap().unwrap();
        prop_assert_eq!(h.frame_bytes(), out.len());
        prop_assert_eq!(h.request_id, id);
        prop_assert_eq!(h.opcode, op);
        let decoded = Response::decode(h.opcode, h.flags_or_status, out.freeze().slice(HEADER_LEN..)).unwrap();
        prop_assert_eq!(decoded, response);
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512), max in 16usize..4096) {
        let (ok, errors) = decode_request_stream(&bytes, max);
        prop_assert!(ok + errors <= bytes.len() / HEADER_LEN + 1);
        decode_response_stream(&bytes, max);
        for op in [
            opcode::GET, opcode::PUT, opcode::MULTI_GET, opcode::MULTI_PUT, opcode::SCAN_KEYS,
            opcode::SNAPSHOT_OPEN, opcode::SNAPSHOT_RELEASE, opcode::SCAN_FILTERED, opcode::GET_AT,
            opcode::SCAN_NEXT, opcode::SCAN_CLOSE, opcode::SET_SCHEMA, opcode::GET_SCHEMA,
            opcode::CLUSTER_MAP, opcode::RESP_BATCH, opcode::RESP_PASS, opcode::SCAN_TABLET,
            opcode::SNAPSHOT_CUT,
        ] {
            let _ = Request::decode(op, bytes.first().copied().unwrap_or(0) & flag::KNOWN, &bytes);
            let _ = Response::decode(op, 0, Bytes::copy_from_slice(&bytes));
        }
    }

    #[test]
    fn mutated_frames_never_panic(owned in owned_strategy(), flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..6)) {
        // Valid frames with a few bytes changed reach deeper into the decoder than random bytes do.
        let mut buf = frame_of(&owned.request(), 3).to_vec();
        for (at, byte) in flips {
            let at = at % buf.len();
            buf[at] = byte;
        }
        decode_request_stream(&buf, 1 << 16);
    }
}

#[test]
fn resp_pass_carries_commands_byte_for_byte() {
    use crate::native::resp_pass_commands;
    let commands: Vec<Vec<&[u8]>> = vec![
        vec![b"SET", b"", b"empty key"],
        vec![b"set", b"\x00\r\n*1\r\n", b""],
        vec![b"GET", &[0xff; 300]],
    ];
    let mut resp = Vec::new();
    for c in &commands {
        crate::resp::encode_command(&mut resp, c);
    }
    let request = Request::RespPass {
        protocol: 3,
        count: 3,
        resp: &resp,
    };
    let mut frame = BytesMut::new();
    request.encode(9, &mut frame);
    let h = parse_header(&frame, FRAME_BYTES_HARD_MAX).unwrap().unwrap();
    assert_eq!(h.opcode, opcode::RESP_PASS);
    let decoded = Request::decode(h.opcode, h.flags_or_status, &frame[HEADER_LEN..]).unwrap();
    assert_eq!(decoded, request);
    let Request::RespPass {
        count, resp: got, ..
    } = decoded
    else {
        unreachable!()
    };
    assert_eq!(got, &resp[..], "the bytes pass through unchanged");
    assert_eq!(resp_pass_commands(count, got).unwrap(), commands);
    // The reply is RESP_BATCH's.
    let reply = Response::RespBatch(vec![Bytes::from_static(b"+OK\r\n")]);
    let mut out = BytesMut::new();
    reply.encode(9, opcode::RESP_PASS, &mut out);
    let h = parse_header(&out, FRAME_BYTES_HARD_MAX).unwrap().unwrap();
    assert_eq!(
        Response::decode(opcode::RESP_PASS, 0, out.freeze().slice(HEADER_LEN..)).unwrap(),
        reply
    );
    assert_eq!(h.opcode, opcode::RESP_PASS);

    // Malformed bodies: a clear error each, never a panic.
    let bad = |count: u32, resp: &[u8]| resp_pass_commands(count, resp).unwrap_err().message;
    assert!(
        bad(4, &resp).contains("command 3"),
        "fewer commands than counted"
    );
    assert!(
        bad(2, &resp).contains("bytes after"),
        "more commands than counted"
    );
    assert!(bad(1, b"GET a\r\n").contains("not a RESP array"), "inline");
    assert!(bad(1, b"*0\r\n").contains("without a name"));
    assert!(
        bad(1, b"*2\r\n$3\r\nGET\r\n$5\r\nab").contains("command 0"),
        "truncated"
    );
    assert!(bad(1, b"*2\r\n$3\r\nGET\r\n").contains("truncated"));
    assert!(bad(1, b"*1\r\n:3\r\n").contains("command 0"));
    assert_eq!(
        Request::decode(opcode::RESP_PASS, 0, &[4, 1, 0, 0, 0])
            .unwrap_err()
            .status,
        Status::BadRequest,
        "RESP protocol 4"
    );
    assert!(
        Request::decode(opcode::RESP_PASS, 0, &[2, 0xff, 0xff, 0, 0, b'*']).is_err(),
        "a count the body cannot hold"
    );
}
