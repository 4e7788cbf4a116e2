//! The Rust client against a real server: the native connection handler of `ramlog-server` on a loopback
//! listener, with a real engine. Also raw-socket abuse of the server (oversize and malformed frames,
//! pipelines beyond the in-flight limit) and fake servers for client-side behaviour (timeouts, replies
//! out of order, reconnection).

mod common;

use bytes::BytesMut;
use common::*;
use ramlog_client::{
    Client, ClientConfig, Condition, Error, Expiry, PutOptions, Request, Response,
};
use ramlog_proto::native::{opcode, ErrorReply, Status, HEADER_LEN};
use ramlog_server::front::native::NativeConfig;
use std::collections::BTreeSet;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

async fn client_for(server: &TestServer) -> Client {
    Client::connect(ClientConfig::new(server.addr.to_string()))
        .await
        .expect("connect")
}

#[tokio::test]
async fn put_get_delete_with_versions() {
    let server = start_server(NativeConfig::default()).await;
    let c = client_for(&server).await;
    assert_eq!(c.get(b"missing").await.unwrap(), None);
    let v1 = c.put(b"k", b"one").await.unwrap();
    let o = c.get(b"k").await.unwrap().expect("present");
    assert_eq!(
        (&o.value[..], o.version, o.expire_at_ms),
        (&b"one"[..], v1, 0)
    );
    let v2 = c.put(b"k", b"two").await.unwrap();
    assert!(v2 > v1, "versions grow per key");
    let deleted = c.delete(b"k").await.unwrap().expect("existed");
    assert!(deleted > v2);
    assert_eq!(c.get(b"k").await.unwrap(), None);
    assert_eq!(
        c.delete(b"k").await.unwrap(),
        None,
        "second delete finds nothing"
    );
    let v3 = c.put(b"k", b"three").await.unwrap();
    assert!(v3 > deleted, "versions grow across delete and re-create");
    assert_eq!(&c.ping(b"hi").await.unwrap()[..], b"hi");
}

#[tokio::test]
async fn conditions() {
    let server = start_server(NativeConfig::default()).await;
    let c = client_for(&server).await;
    let opts = |condition| PutOptions {
        condition,
        ..Default::default()
    };
    // if-exists on an absent key fails and reports no current version.
    match c.put_with(b"c", b"x", opts(Condition::IfExists)).await {
        Err(Error::ConditionFailed {
            current_version: None,
        }) => {}
        other => panic!("expected ConditionFailed, got {other:?}"),
    }
    let v1 = c
        .put_with(b"c", b"a", opts(Condition::IfAbsent))
        .await
        .unwrap()
        .version;
    // if-absent on a present key fails and reports the current version.
    match c.put_with(b"c", b"b", opts(Condition::IfAbsent)).await {
        Err(Error::ConditionFailed {
            current_version: Some(v),
        }) => assert_eq!(v, v1),
        other => panic!("expected ConditionFailed, got {other:?}"),
    }
    // Compare-and-set on the version.
    let v2 = c
        .put_with(b"c", b"b", opts(Condition::IfVersion(v1)))
        .await
        .unwrap()
        .version;
    assert!(matches!(
        c.put_with(b"c", b"stale", opts(Condition::IfVersion(v1))).await,
        Err(Error::ConditionFailed { current_version: Some(v) }) if v == v2
    ));
    assert_eq!(&c.get(b"c").await.unwrap().unwrap().value[..], b"b");
    // return_old gives the replaced object.
    let r = c
        .put_with(
            b"c",
            b"new",
            PutOptions {
                return_old: true,
                condition: Condition::IfExists,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let old = r.old.expect("old object");
    assert_eq!((&old.value[..], old.version), (&b"b"[..], v2));
    // Conditional delete.
    assert!(matches!(
        c.delete_with(b"c", Condition::IfVersion(v2)).await,
        Err(Error::ConditionFailed { .. })
    ));
    assert!(c
        .delete_with(b"c", Condition::IfVersion(r.version))
        .await
        .unwrap()
        .is_some());
    assert_eq!(c.get(b"c").await.unwrap(), None);
}

#[tokio::test]
async fn increment_and_its_errors() {
    let server = start_server(NativeConfig::default()).await;
    let c = client_for(&server).await;
    assert_eq!(c.increment(b"n", 1).await.unwrap().0, 1);
    assert_eq!(c.increment(b"n", 41).await.unwrap().0, 42);
    assert_eq!(c.increment(b"n", -50).await.unwrap().0, -8);
    assert_eq!(&c.get(b"n").await.unwrap().unwrap().value[..], b"-8");
    c.put(b"s", b"not a number").await.unwrap();
    assert!(matches!(
        c.increment(b"s", 1).await,
        Err(Error::NotAnInteger)
    ));
    c.put(b"max", i64::MAX.to_string().as_bytes())
        .await
        .unwrap();
    assert!(matches!(
        c.increment(b"max", 1).await,
        Err(Error::IncrementOverflow)
    ));
    assert_eq!(
        &c.get(b"max").await.unwrap().unwrap().value[..],
        i64::MAX.to_string().as_bytes()
    );
}

#[tokio::test]
async fn expiry() {
    let server = start_server(NativeConfig::default()).await;
    let c = client_for(&server).await;
    let opts = PutOptions {
        expiry: Expiry::AfterMs(150),
        ..Default::default()
    };
    c.put_with(b"short", b"v", opts).await.unwrap();
    let o = c.get(b"short").await.unwrap().expect("not yet expired");
    assert!(o.expire_at_ms > 0);
    // Keep the expiry across an overwrite.
    c.put_with(
        b"short",
        b"w",
        PutOptions {
            expiry: Expiry::Keep,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        c.get(b"short").await.unwrap().unwrap().expire_at_ms,
        o.expire_at_ms
    );
    c.put(b"long", b"v").await.unwrap();
    assert!(c
        .expire(b"long", Expiry::AfterMs(100))
        .await
        .unwrap()
        .is_some());
    c.put(b"kept", b"v").await.unwrap();
    c.expire(b"kept", Expiry::AfterMs(100)).await.unwrap();
    c.expire(b"kept", Expiry::None).await.unwrap();
    assert_eq!(
        c.expire(b"absent", Expiry::AfterMs(100)).await.unwrap(),
        None
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(c.get(b"short").await.unwrap(), None);
    assert_eq!(c.get(b"long").await.unwrap(), None);
    assert_eq!(c.get(b"kept").await.unwrap().unwrap().expire_at_ms, 0);
    // An absolute time in the past: gone at once.
    c.put_with(
        b"past",
        b"v",
        PutOptions {
            expiry: Expiry::AtUnixMs(1),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(c.get(b"past").await.unwrap(), None);
}

#[tokio::test]
async fn multi_get_and_atomic_multi_put() {
    let server = start_server(NativeConfig::default()).await;
    let c = client_for(&server).await;
    let items: Vec<(Vec<u8>, Vec<u8>)> = (0..20)
        .map(|i| {
            (
                format!("{{user7}}:f{i}").into_bytes(),
                format!("v{i}").into_bytes(),
            )
        })
        .collect();
    let refs: Vec<(&[u8], &[u8])> = items.iter().map(|(k, v)| (&k[..], &v[..])).collect();
    let version = c.multi_put(&refs).await.unwrap();
    let mut keys: Vec<&[u8]> = items.iter().map(|(k, _)| &k[..]).collect();
    keys.push(b"absent");
    let got = c.multi_get(&keys).await.unwrap();
    assert_eq!(got.len(), 21);
    for (i, o) in got[..20].iter().enumerate() {
        let o = o.as_ref().expect("present");
        assert_eq!(&o.value[..], format!("v{i}").as_bytes());
        assert_eq!(o.version, version, "one version for the whole multi-put");
    }
    assert_eq!(got[20], None);
    // Keys on different tablets: refused, nothing written. "foo" and "bar" are in different quarters.
    assert_ne!(
        ramlog_common::key_slot(b"foo") / 4096,
        ramlog_common::key_slot(b"bar") / 4096
    );
    match c.multi_put(&[(b"foo", b"1"), (b"bar", b"2")]).await {
        Err(Error::CrossTablet(_)) => {}
        other => panic!("expected CrossTablet, got {other:?}"),
    }
    assert_eq!(
        c.multi_get(&[b"foo", b"bar"]).await.unwrap(),
        vec![None, None]
    );
}

#[tokio::test]
async fn scan_keys_with_pattern_and_cursor() {
    let server = start_server(NativeConfig::default()).await;
    let c = client_for(&server).await;
    let mut expected = BTreeSet::new();
    let mut requests = Vec::new();
    let keys: Vec<Vec<u8>> = (0..600)
        .map(|i| {
            if i % 3 == 0 {
                format!("other:{i}")
            } else {
                format!("scan:{i}")
            }
            .into_bytes()
        })
        .collect();
    for k in &keys {
        if k.starts_with(b"scan:") {
            expected.insert(k.clone());
        }
        requests.push(Request::Put {
            table: 0,
            key: k,
            value: b"v",
            condition: Condition::None,
            expiry: Expiry::None,
            return_old: false,
        });
    }
    for r in c.pipeline(&requests).await.unwrap() {
        assert!(matches!(r.unwrap(), Response::Put { .. }));
    }
    let all: BTreeSet<Vec<u8>> = c
        .scan_all(b"scan:*")
        .await
        .unwrap()
        .into_iter()
        .map(|k| k.to_vec())
        .collect();
    assert_eq!(all, expected);
    // Step by step with a small count: several steps, the same keys.
    let (mut cursor, mut steps, mut seen) = (0u64, 0, BTreeSet::new());
    loop {
        let (next, batch) = c.scan_keys(cursor, 50, b"").await.unwrap();
        steps += 1;
        seen.extend(batch.into_iter().map(|k| k.to_vec()));
        if next == 0 {
            break;
        }
        cursor = next;
        assert!(steps < 1000, "scan terminates");
    }
    assert!(steps > 4, "count bounds each step ({steps} steps)");
    assert_eq!(seen.len(), 600);
    assert!(matches!(
        c.scan_keys(u64::MAX, 10, b"").await,
        Err(Error::Server {
            status: Status::BadRequest,
            ..
        })
    ));
}

#[tokio::test]
async fn many_concurrent_requests_on_one_connection() {
    let server = start_server(NativeConfig::default()).await;
    let c = client_for(&server).await;
    let mut tasks = Vec::new();
    for t in 0..64 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..100 {
                let key = format!("t{t}:{i}");
                let v = c.put(key.as_bytes(), key.as_bytes()).await.unwrap();
                let o = c.get(key.as_bytes()).await.unwrap().unwrap();
                assert_eq!((&o.value[..], o.version), (key.as_bytes(), v));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(server.engine.object_count(), 6400);
    // A pipeline much deeper than the server's in-flight limit: sent in chunks, answered in order.
    let keys: Vec<String> = (0..5000)
        .map(|i| format!("t{}:{}", i % 64, i % 100))
        .collect();
    let gets: Vec<Request> = keys
        .iter()
        .map(|k| Request::Get {
            table: 0,
            key: k.as_bytes(),
        })
        .collect();
    let replies = c.pipeline(&gets).await.unwrap();
    assert_eq!(replies.len(), 5000);
    for (k, r) in keys.iter().zip(replies) {
        match r.unwrap() {
            Response::Get(Some(o)) => assert_eq!(&o.value[..], k.as_bytes()),
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test]
async fn oversize_values_and_frames() {
    let server = start_server(NativeConfig {
        max_frame_bytes: 4 << 20,
        ..Default::default()
    })
    .await;
    let c = client_for(&server).await;
    // Over the engine's value limit but inside a frame: the engine's typed error.
    let big = vec![b'x'; (1 << 20) + 1];
    assert!(matches!(
        c.put(b"big", &big).await,
        Err(Error::ValueTooLarge(_))
    ));
    let long_key = vec![b'k'; (64 << 10) + 1];
    assert!(matches!(
        c.put(&long_key, b"v").await,
        Err(Error::KeyTooLarge(_))
    ));
    // Over the frame limit: refused by the client before sending.
    let huge = vec![b'x'; 5 << 20];
    assert!(matches!(
        c.put(b"huge", &huge).await,
        Err(Error::RequestTooLarge { .. })
    ));
    // The connection is fine afterwards.
    c.put(b"small", b"ok").await.unwrap();

    // A raw client sends the oversize frame anyway: an error frame, then the stream is resynchronised.
    let mut raw = Raw::connect(server.addr).await;
    assert_eq!(raw.hello.max_frame_bytes, 4 << 20);
    let mut frame = BytesMut::new();
    Request::Put {
        table: 0,
        key: b"huge",
        value: &huge,
        condition: Condition::None,
        expiry: Expiry::None,
        return_old: false,
    }
    .encode(7, &mut frame);
    raw.send(&frame).await;
    raw.send_request(8, &Request::Ping { payload: b"after" })
        .await;
    let (id, op, reply) = raw.recv().await.unwrap();
    assert_eq!((id, op), (7, opcode::PUT));
    assert!(
        matches!(reply, Response::Error(ErrorReply { status: Status::FrameTooLarge, detail, .. }) if detail == 4 << 20)
    );
    let (id, _, reply) = raw.recv().await.unwrap();
    assert_eq!(
        (id, reply),
        (8, Response::Pong(bytes::Bytes::from_static(b"after")))
    );
    assert_eq!(c.get(b"huge").await.unwrap(), None);

    // An absurd length (beyond what the server will skip): an error frame, then a clean close.
    let mut raw = Raw::connect(server.addr).await;
    let mut absurd = vec![0xF0, 0xFF, 0xFF, 0xFF];
    absurd.extend_from_slice(&9u64.to_le_bytes());
    absurd.extend_from_slice(&[opcode::GET, 0, 0, 0]);
    raw.send(&absurd).await;
    let (id, _, reply) = raw.recv().await.unwrap();
    assert_eq!(id, 9);
    assert!(matches!(
        reply,
        Response::Error(ErrorReply {
            status: Status::FrameTooLarge,
            ..
        })
    ));
    assert!(raw.recv().await.is_none(), "closed after an absurd length");
    // Other clients were never affected.
    assert_eq!(&c.get(b"small").await.unwrap().unwrap().value[..], b"ok");
}

#[tokio::test]
async fn malformed_frames_get_typed_errors_and_the_connection_lives() {
    let server = start_server(NativeConfig::default()).await;
    let mut raw = Raw::connect(server.addr).await;
    let frame = |id: u64, op: u8, flags: u8, body: &[u8]| {
        let mut f = Vec::new();
        f.extend_from_slice(&(12 + body.len() as u32).to_le_bytes());
        f.extend_from_slice(&id.to_le_bytes());
        f.extend_from_slice(&[op, flags, 0, 0]);
        f.extend_from_slice(body);
        f
    };
    let cases: Vec<(Vec<u8>, Status)> = vec![
        (
            frame(1, opcode::GET, 0, &[200, 0, 0, 0, b'x']),
            Status::BadRequest,
        ), // key length past the end
        (frame(2, 0x7E, 0, &[]), Status::UnknownOpcode),
        (frame(3, 0x36, 0, &[]), Status::Unsupported), // reserved (0x30 is RESP_BATCH, 0x31..=0x34 replication, 0x35 RESP_PASS)
        (frame(4, opcode::SCAN_KEYS, 0x08, &[]), Status::Unsupported), // FILTER flag is reserved
        (
            frame(5, opcode::MULTI_GET, 0, &[0xFF, 0xFF, 0xFF, 0x7F]),
            Status::BadRequest,
        ), // absurd count
        (frame(6, opcode::PUT, 0x40, &[]), Status::BadRequest), // unknown flag
        (
            frame(7, opcode::MULTI_PUT, 0, &[0, 0, 0, 0]),
            Status::BadRequest,
        ), // empty multi-put
    ];
    for (bytes, _) in &cases {
        raw.send(bytes).await;
    }
    let mut reserved = frame(8, opcode::PING, 0, &[0, 0, 0, 0]);
    reserved[14] = 1;
    raw.send(&reserved).await;
    for (i, (_, status)) in cases.iter().enumerate() {
        let (id, _, reply) = raw.recv().await.unwrap();
        assert_eq!(id, i as u64 + 1);
        match reply {
            Response::Error(e) => assert_eq!(e.status, *status, "case {id}: {}", e.message),
            other => panic!("case {id}: {other:?}"),
        }
    }
    let (id, _, reply) = raw.recv().await.unwrap();
    assert!(
        id == 8
            && matches!(
                reply,
                Response::Error(ErrorReply {
                    status: Status::BadRequest,
                    ..
                })
            )
    );
    raw.send_request(9, &Request::Ping { payload: b"" }).await;
    assert_eq!(
        raw.recv().await.unwrap().0,
        9,
        "still serving after malformed frames"
    );
    // A length shorter than the header cannot be resynchronised: error frame (id 0), then close.
    raw.send(&[3, 0, 0, 0]).await;
    let (id, _, reply) = raw.recv().await.unwrap();
    assert!(
        id == 0
            && matches!(
                reply,
                Response::Error(ErrorReply {
                    status: Status::BadRequest,
                    ..
                })
            )
    );
    assert!(raw.recv().await.is_none());
    // Not a ramlog client at all: closed without a hello.
    let mut s = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    s.write_all(b"*1\r\n$4\r\nPING\r\n").await.unwrap();
    let mut buf = Vec::new();
    let n = tokio::io::AsyncReadExt::read_to_end(&mut s, &mut buf)
        .await
        .unwrap_or(0);
    assert_eq!(n, 0);
}

#[tokio::test]
async fn pipeline_beyond_the_in_flight_limit_gets_busy() {
    let server = start_server(NativeConfig {
        max_in_flight: 100,
        ..Default::default()
    })
    .await;
    let mut raw = Raw::connect(server.addr).await;
    assert_eq!(raw.hello.max_in_flight, 100);
    let mut frames = BytesMut::new();
    for id in 0..1000u64 {
        Request::Ping { payload: b"p" }.encode(id, &mut frames);
    }
    raw.send(&frames).await;
    let (mut ok, mut busy) = (0, 0);
    for expected in 0..1000u64 {
        let (id, _, reply) = raw.recv().await.unwrap();
        assert_eq!(id, expected);
        match reply {
            Response::Pong(_) => ok += 1,
            Response::Error(ErrorReply {
                status: Status::Busy,
                detail: 100,
                ..
            }) => busy += 1,
            other => panic!("{other:?}"),
        }
    }
    assert!(ok >= 100 && busy > 0, "ok {ok}, busy {busy}");
    // The well-behaved client respects the announced limit and never sees BUSY.
    let c = client_for(&server).await;
    let pings: Vec<Request> = (0..1000).map(|_| Request::Ping { payload: b"p" }).collect();
    for r in c.pipeline(&pings).await.unwrap() {
        assert!(matches!(r.unwrap(), Response::Pong(_)));
    }
}

#[tokio::test]
async fn password_protects_data_operations() {
    let server = common::start_server_full(
        ramlog_logmem::EngineConfig::default(),
        ramlog_server::ServerConfig {
            password: Some("s3cret".into()),
            ..Default::default()
        },
        NativeConfig::default(),
    )
    .await;
    let anonymous = client_for(&server).await;
    assert_eq!(
        &anonymous.ping(b"x").await.unwrap()[..],
        b"x",
        "PING needs no password"
    );
    assert!(matches!(anonymous.get(b"k").await, Err(Error::NoAuth(_))));
    let mut wrong = ClientConfig::new(server.addr.to_string());
    wrong.password = Some(b"nope".to_vec());
    assert!(matches!(
        Client::connect(wrong).await,
        Err(Error::AuthFailed(_))
    ));
    let mut right = ClientConfig::new(server.addr.to_string());
    right.password = Some(b"s3cret".to_vec());
    let c = Client::connect(right).await.unwrap();
    c.put(b"k", b"v").await.unwrap();
    assert_eq!(&c.get(b"k").await.unwrap().unwrap().value[..], b"v");
}

#[tokio::test]
async fn stats_are_json() {
    let server = start_server(NativeConfig::default()).await;
    let c = client_for(&server).await;
    c.put(b"a", b"1").await.unwrap();
    let stats = c.stats().await.unwrap();
    assert!(
        stats.starts_with('{')
            && stats.contains("\"engine\":{")
            && stats.contains("\"objects\":1,"),
        "{stats}"
    );
}

#[tokio::test]
async fn per_request_timeout() {
    // A server that reads requests and never answers.
    let addr = fake_server(|mut s| async move {
        let _ = read_requests(&mut s, usize::MAX).await;
    })
    .await;
    let c = Client::connect(ClientConfig::new(addr.to_string()))
        .await
        .unwrap();
    let quick = c.with_timeout(Duration::from_millis(100));
    let started = std::time::Instant::now();
    assert!(matches!(quick.get(b"k").await, Err(Error::Timeout(_))));
    assert!(started.elapsed() < Duration::from_secs(3));
    // A listener that never completes the handshake: connect fails with a handshake error.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = ClientConfig::new(silent.local_addr().unwrap().to_string());
    config.connect_timeout = Duration::from_millis(200);
    assert!(matches!(
        Client::connect(config).await,
        Err(Error::Handshake { .. })
    ));
    // Nobody listening: a connect error.
    let port = silent.local_addr().unwrap().port();
    drop(silent);
    assert!(matches!(
        Client::connect(ClientConfig::new(format!("127.0.0.1:{port}"))).await,
        Err(Error::Connect { .. })
    ));
}

#[tokio::test]
async fn replies_out_of_order_reach_their_callers() {
    // A server that collects 50 pings and answers them in reverse order.
    let addr = fake_server(|mut s| async move {
        let requests = read_requests(&mut s, 50).await;
        let mut out = BytesMut::new();
        for (id, op, payload) in requests.into_iter().rev() {
            Response::Pong(payload.into()).encode(id, op, &mut out);
        }
        s.write_all(&out).await.unwrap();
        let _ = read_requests(&mut s, usize::MAX).await;
    })
    .await;
    let c = Client::connect(ClientConfig::new(addr.to_string()))
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..50 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let payload = format!("ping {i}");
            assert_eq!(
                &c.ping(payload.as_bytes()).await.unwrap()[..],
                payload.as_bytes()
            );
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn reconnects_after_the_server_drops_the_connection() {
    let server = start_server(NativeConfig {
        idle_timeout: Duration::from_millis(200),
        ..Default::default()
    })
    .await;
    let c = client_for(&server).await;
    c.put(b"k", b"v1").await.unwrap();
    // The server closes the idle connection; the next calls open a new one transparently.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(&c.get(b"k").await.unwrap().unwrap().value[..], b"v1");
    tokio::time::sleep(Duration::from_millis(500)).await;
    c.put(b"k", b"v2").await.unwrap();
    assert_eq!(&c.get(b"k").await.unwrap().unwrap().value[..], b"v2");
    // A pool of several connections spreads requests and each reconnects on its own.
    let mut config = ClientConfig::new(server.addr.to_string());
    config.connections = 3;
    let pooled = Client::connect(config).await.unwrap();
    for i in 0..30 {
        pooled.put(format!("p{i}").as_bytes(), b"x").await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in 0..30 {
        assert!(pooled
            .get(format!("p{i}").as_bytes())
            .await
            .unwrap()
            .is_some());
    }
}

#[tokio::test]
async fn decoded_reply_layout_matches_raw_bytes() {
    // GET replies are encoded by the server's zero-copy path; check its bytes against the documented layout.
    let server = start_server(NativeConfig::default()).await;
    let c = client_for(&server).await;
    let version = c.put(b"layout", b"abc").await.unwrap();
    let mut raw = Raw::connect(server.addr).await;
    raw.send_request(
        42,
        &Request::Get {
            table: 0,
            key: b"layout",
        },
    )
    .await;
    let mut buf = vec![0u8; HEADER_LEN + 1 + 8 + 8 + 4 + 3];
    tokio::io::AsyncReadExt::read_exact(&mut raw.stream, &mut buf)
        .await
        .unwrap();
    let expected: Vec<u8> = [
        &((buf.len() - 4) as u32).to_le_bytes()[..],
        &42u64.to_le_bytes(),
        &[opcode::GET, 0, 0, 0],
        &[1],
        &version.to_le_bytes(),
        &0u64.to_le_bytes(),
        &3u32.to_le_bytes(),
        b"abc",
    ]
    .concat();
    assert_eq!(buf, expected);
}

#[tokio::test]
async fn random_operations_match_a_model() {
    // A seeded random mix of operations on a few keys, checked against a BTreeMap of (value, version).
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    use std::collections::BTreeMap;
    let server = start_server(NativeConfig::default()).await;
    let c = client_for(&server).await;
    let mut rng = SmallRng::seed_from_u64(0x5eed);
    let mut model: BTreeMap<Vec<u8>, (Vec<u8>, u64)> = BTreeMap::new();
    let mut last_version = 0u64;
    for step in 0..3000 {
        let key = format!("{{m}}k{}", rng.gen_range(0..12)).into_bytes();
        let current = model.get(&key).cloned();
        match rng.gen_range(0..7) {
            0 | 1 => {
                let value = format!("v{step}").into_bytes();
                let condition = match rng.gen_range(0..4) {
                    0 => Condition::None,
                    1 => Condition::IfAbsent,
                    2 => Condition::IfExists,
                    _ => Condition::IfVersion(match &current {
                        Some((_, v)) if rng.gen_bool(0.7) => *v,
                        _ => rng.gen_range(1..=last_version.max(1)),
                    }),
                };
                let holds = match condition {
                    Condition::None => true,
                    Condition::IfAbsent => current.is_none(),
                    Condition::IfExists => current.is_some(),
                    Condition::IfVersion(v) => current.as_ref().map(|c| c.1) == Some(v),
                };
                let options = PutOptions {
                    condition,
                    return_old: rng.gen_bool(0.5),
                    ..Default::default()
                };
                match c.put_with(&key, &value, options).await {
                    Ok(r) => {
                        assert!(holds, "step {step}: {condition:?} applied on {current:?}");
                        assert!(r.version > last_version, "versions only grow");
                        if options.return_old {
                            assert_eq!(r.old.map(|o| (o.value.to_vec(), o.version)), current);
                        }
                        last_version = r.version;
                        model.insert(key, (value, r.version));
                    }
                    Err(Error::ConditionFailed { current_version }) => {
                        assert!(!holds, "step {step}: {condition:?} refused on {current:?}");
                        assert_eq!(current_version, current.map(|c| c.1));
                    }
                    Err(e) => panic!("step {step}: {e}"),
                }
            }
            2 => {
                let condition = if rng.gen_bool(0.5) {
                    Condition::None
                } else {
                    Condition::IfVersion(current.as_ref().map_or(1, |c| c.1))
                };
                let holds = match condition {
                    Condition::IfVersion(v) => current.as_ref().map(|c| c.1) == Some(v),
                    _ => true,
                };
                match c.delete_with(&key, condition).await {
                    Ok(deleted) => {
                        assert!(holds);
                        assert_eq!(deleted.is_some(), current.is_some(), "step {step}");
                        if let Some(v) = deleted {
                            assert!(v > last_version);
                            last_version = v;
                        }
                        model.remove(&key);
                    }
                    Err(Error::ConditionFailed { .. }) => assert!(!holds, "step {step}"),
                    Err(e) => panic!("step {step}: {e}"),
                }
            }
            3 => {
                let delta = rng.gen_range(-5..=5);
                let as_int = current.as_ref().map(|c| {
                    std::str::from_utf8(&c.0)
                        .ok()
                        .and_then(|s| s.parse::<i64>().ok())
                });
                match c.increment(&key, delta).await {
                    Ok((value, version)) => {
                        let before = match as_int {
                            None => 0,
                            Some(Some(n)) => n,
                            Some(None) => {
                                panic!("step {step}: increment of a non-integer succeeded")
                            }
                        };
                        assert_eq!(value, before + delta);
                        assert!(version > last_version);
                        last_version = version;
                        model.insert(key, (value.to_string().into_bytes(), version));
                    }
                    Err(Error::NotAnInteger) => assert_eq!(as_int, Some(None), "step {step}"),
                    Err(e) => panic!("step {step}: {e}"),
                }
            }
            4 => {
                let keys: Vec<Vec<u8>> =
                    (0..4).map(|i| format!("{{m}}k{i}").into_bytes()).collect();
                let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
                let got = c.multi_get(&refs).await.unwrap();
                for (k, o) in keys.iter().zip(got) {
                    assert_eq!(
                        o.map(|o| (o.value.to_vec(), o.version)),
                        model.get(k).cloned(),
                        "step {step}"
                    );
                }
            }
            5 => {
                let items: Vec<(Vec<u8>, Vec<u8>)> = (0..rng.gen_range(1..4))
                    .map(|_| {
                        (
                            format!("{{m}}k{}", rng.gen_range(0..12)).into_bytes(),
                            format!("mp{step}").into_bytes(),
                        )
                    })
                    .collect();
                let refs: Vec<(&[u8], &[u8])> =
                    items.iter().map(|(k, v)| (&k[..], &v[..])).collect();
                let version = c.multi_put(&refs).await.unwrap();
                assert!(version > last_version);
                last_version = version;
                for (k, v) in items {
                    model.insert(k, (v, version));
                }
            }
            _ => {
                let got = c.get(&key).await.unwrap();
                assert_eq!(
                    got.map(|o| (o.value.to_vec(), o.version)),
                    current,
                    "step {step}"
                );
            }
        }
    }
}

#[tokio::test]
async fn a_slow_client_does_not_stall_others() {
    let server = start_server(NativeConfig::default()).await;
    let c = client_for(&server).await;
    c.put(b"k", b"v").await.unwrap();
    // A client that sends its 21-byte frame one byte every 30 ms.
    let mut slow = Raw::connect(server.addr).await;
    let mut frame = BytesMut::new();
    Request::Get {
        table: 0,
        key: b"k",
    }
    .encode(1, &mut frame);
    let dribble = tokio::spawn(async move {
        for b in frame.iter() {
            slow.stream.write_all(&[*b]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        slow.recv().await
    });
    // Meanwhile others are served: all these replies arrive before the slow frame is even complete.
    for _ in 0..50 {
        assert!(c.get(b"k").await.unwrap().is_some());
    }
    assert!(
        !dribble.is_finished(),
        "others were served while the slow client was still sending"
    );
    let (id, _, reply) = dribble
        .await
        .unwrap()
        .expect("the slow client gets its answer");
    assert_eq!(id, 1);
    assert!(matches!(reply, Response::Get(Some(_))));
}

#[tokio::test]
async fn hundreds_of_simultaneous_connections() {
    let server = start_server(NativeConfig::default()).await;
    let mut clients = Vec::new();
    for _ in 0..300 {
        clients.push(client_for(&server).await);
    }
    let mut tasks = Vec::new();
    for (i, c) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let key = format!("conn{i}");
            let v = c.put(key.as_bytes(), b"x").await.unwrap();
            assert_eq!(c.get(key.as_bytes()).await.unwrap().unwrap().version, v);
            c
        }));
    }
    let mut alive = Vec::new();
    for t in tasks {
        alive.push(t.await.unwrap());
    }
    assert_eq!(server.engine.object_count(), 300);
}

#[tokio::test]
async fn a_refused_connection_gets_a_clear_error() {
    // What a server at its connection limit does with one more native client.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(ramlog_server::front::native::refuse_native_connection(
                stream,
                "max number of clients reached",
            ));
        }
    });
    match Client::connect(ClientConfig::new(addr.to_string())).await {
        Err(Error::Busy(message)) => assert_eq!(message, "max number of clients reached"),
        Err(e) => panic!("expected Busy, got {e}"),
        Ok(_) => panic!("expected Busy, got a connection"),
    }
}

#[tokio::test]
async fn the_service_layer_counts_every_answered_request() {
    let server = start_server(NativeConfig::default()).await;
    let c = client_for(&server).await;
    c.put(b"k", b"v").await.unwrap();
    c.get(b"k").await.unwrap();
    c.get(b"absent").await.unwrap();
    assert!(c.increment(b"k", 1).await.is_err());
    let snapshot = server.node.snapshot();
    let count = |op: &str| {
        snapshot
            .ops
            .iter()
            .find(|o| o.0 == op)
            .map(|o| o.1)
            .unwrap_or_else(|| panic!("no op {op}"))
    };
    assert_eq!(count("set"), 1);
    assert_eq!(count("get"), 2);
    assert_eq!(count("incr"), 1);
    assert_eq!(snapshot.errors, 1, "the failed INCREMENT");
}

#[tokio::test]
async fn random_garbage_never_takes_the_server_down() {
    // Seeded: valid frames with random bytes changed, and pure noise, on many connections; each
    // connection sends its bytes, half-closes, and reads until the server closes. Then a normal client
    // must still be served.
    use rand::{rngs::SmallRng, Rng, SeedableRng};
    let server = start_server(NativeConfig {
        max_frame_bytes: 64 << 10,
        ..Default::default()
    })
    .await;
    let mut rng = SmallRng::seed_from_u64(7);
    for round in 0..150 {
        let mut raw = Raw::connect(server.addr).await;
        let mut bytes = BytesMut::new();
        for id in 0..rng.gen_range(1..20u64) {
            let key = format!("g{}", rng.gen_range(0..50));
            match rng.gen_range(0..4) {
                0 => Request::Get {
                    table: 0,
                    key: key.as_bytes(),
                }
                .encode(id, &mut bytes),
                1 => Request::Put {
                    table: rng.gen_range(0..2),
                    key: key.as_bytes(),
                    value: b"value",
                    condition: Condition::IfVersion(rng.gen()),
                    expiry: Expiry::AfterMs(rng.gen_range(0..1000)),
                    return_old: rng.gen(),
                }
                .encode(id, &mut bytes),
                2 => Request::MultiGet {
                    table: 0,
                    keys: vec![key.as_bytes(); 3],
                }
                .encode(id, &mut bytes),
                _ => Request::ScanKeys {
                    table: 0,
                    cursor: rng.gen(),
                    count: rng.gen(),
                    pattern: b"g*",
                }
                .encode(id, &mut bytes),
            }
        }
        if round % 5 == 0 {
            bytes.extend((0..rng.gen_range(0..200)).map(|_| rng.gen::<u8>()));
        }
        for _ in 0..rng.gen_range(0..6) {
            let at = rng.gen_range(0..bytes.len());
            bytes[at] = rng.gen();
        }
        raw.send(&bytes).await;
        raw.stream.shutdown().await.unwrap();
        let mut sink = Vec::new();
        let read = tokio::io::AsyncReadExt::read_to_end(&mut raw.stream, &mut sink);
        tokio::time::timeout(Duration::from_secs(5), read)
            .await
            .expect("the server closes a half-closed connection")
            .ok();
    }
    let c = client_for(&server).await;
    c.put(b"after", b"garbage").await.unwrap();
    assert_eq!(
        &c.get(b"after").await.unwrap().unwrap().value[..],
        b"garbage"
    );
}
