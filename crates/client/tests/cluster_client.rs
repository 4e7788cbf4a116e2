//! `ClusterClient` against servers on loopback: a standalone server (every request goes to it), and
//! a cluster made of standalone servers with real engines behind a fake seed that hands out the map
//! (so where each key landed shows the routing), plus fake servers that refuse with WRONG_SERVER or
//! drop the connection (refresh and retry). The real cluster, with its coordinator, is exercised by
//! tests/python/test_cluster_client.py.

mod common;

use bytes::BytesMut;
use common::{fake_server, start_server, TestServer};
use ramlog_client::{Client, ClientConfig, ClusterClient, ClusterMap, Error, Request, Response};
use ramlog_cluster::{ServerAddresses, ServerInfo, ServerState, TabletInfo};
use ramlog_proto::native::{parse_header, ErrorReply, Status, HEADER_LEN};
use ramlog_server::front::native::NativeConfig;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

type Handler = Arc<dyn Fn(&Request<'_>) -> Option<Response> + Send + Sync>;

/// Answer each request with `handler`'s reply; None closes the connection.
async fn serve(mut stream: TcpStream, handler: Handler) {
    let mut buf = BytesMut::new();
    loop {
        match parse_header(&buf, 1 << 20).expect("valid request header") {
            Some(h) if buf.len() >= h.frame_bytes() => {
                let frame = buf.split_to(h.frame_bytes());
                let request = Request::decode(h.opcode, h.flags_or_status, &frame[HEADER_LEN..])
                    .expect("request decodes");
                let Some(reply) = handler(&request) else {
                    return;
                };
                let mut out = BytesMut::new();
                reply.encode(h.request_id, h.opcode, &mut out);
                if stream.write_all(&out).await.is_err() {
                    return;
                }
            }
            _ => match stream.read_buf(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            },
        }
    }
}

async fn scripted(handler: Handler) -> SocketAddr {
    fake_server(move |stream| serve(stream, handler.clone())).await
}

/// A seed that answers CLUSTER_MAP with `maps[min(calls, last)]` and refuses everything else.
async fn seed(maps: Vec<ClusterMap>) -> (SocketAddr, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let handler: Handler = Arc::new(move |request| {
        Some(match request {
            Request::ClusterMap => {
                let n = counter.fetch_add(1, Ordering::SeqCst).min(maps.len() - 1);
                Response::ClusterMap(maps[n].to_json().into())
            }
            _ => error(Status::WrongServer, "the seed masters nothing"),
        })
    });
    (scripted(handler).await, calls)
}

fn error(status: Status, message: &str) -> Response {
    Response::Error(ErrorReply {
        status,
        detail: 0,
        message: message.into(),
    })
}

fn server_info(id: u64, native: SocketAddr) -> ServerInfo {
    ServerInfo {
        id,
        name: format!("server-{id}"),
        addresses: ServerAddresses {
            resp: native,
            routing: None,
            native,
            admin: None,
        },
        epoch: 1,
        state: ServerState::Up,
        memory_bytes: 128 << 20,
        draining: false,
    }
}

/// Table 0 split evenly over `natives` (server ids 1, 2, ...).
fn even_map(version: u64, natives: &[SocketAddr]) -> ClusterMap {
    let n = natives.len() as u32;
    let tablets = (0..n)
        .map(|i| TabletInfo {
            table: 0,
            first_slot: (16384 * i / n) as u16,
            last_slot: (16384 * (i + 1) / n - 1) as u16,
            master: i as u64 + 1,
            mirror: None,
            backups: vec![],
            epoch: 1,
            recovering: false,
            restorer: None,
            pending: vec![],
            fresh: vec![],
            waiting: None,
            refused: vec![],
            logs_from: None,
            split: None,
            split_ready: false,
            merge: None,
            merge_ready: false,
            migration: None,
            cut_off: Vec::new(),
        })
        .collect();
    ClusterMap {
        cluster_id: 77,
        version,
        servers: natives
            .iter()
            .enumerate()
            .map(|(i, a)| server_info(i as u64 + 1, *a))
            .collect(),
        tables: vec![],
        tablets,
        rebalancing: false,
    }
}

async fn plain(server: &TestServer) -> Client {
    Client::connect(ClientConfig::new(server.addr.to_string()))
        .await
        .unwrap()
}

#[tokio::test]
async fn a_standalone_seed_serves_every_request() {
    let server = start_server(NativeConfig::default()).await;
    let cluster = ClusterClient::connect(ClientConfig::new(server.addr.to_string()))
        .await
        .unwrap();
    assert!(cluster.is_standalone());
    assert_eq!(cluster.map().version, 0);
    for i in 0..50 {
        cluster
            .put(format!("k{i}").as_bytes(), format!("v{i}").as_bytes())
            .await
            .unwrap();
    }
    let keys: Vec<Vec<u8>> = (0..60).map(|i| format!("k{i}").into_bytes()).collect();
    let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
    let got = cluster.multi_get(&refs).await.unwrap();
    for (i, object) in got.iter().enumerate() {
        match object {
            Some(o) => assert_eq!(o.value, format!("v{i}").as_bytes()),
            None => assert!(i >= 50),
        }
    }
    assert_eq!(cluster.increment(b"n", 5).await.unwrap().0, 5);
    assert!(cluster.delete(b"k0").await.unwrap().is_some());
    assert_eq!(cluster.scan_all(b"k*").await.unwrap().len(), 49);
    // The standalone server, not the client, judges a multi-put.
    cluster
        .multi_put(&[(b"{t}a", b"1"), (b"{t}b", b"2")])
        .await
        .unwrap();
    assert_eq!(
        plain(&server)
            .await
            .get(b"{t}b")
            .await
            .unwrap()
            .unwrap()
            .value,
        &b"2"[..]
    );
}

#[tokio::test]
async fn keys_land_on_the_master_the_map_names() {
    let servers = [
        start_server(NativeConfig::default()).await,
        start_server(NativeConfig::default()).await,
        start_server(NativeConfig::default()).await,
    ];
    let natives: Vec<SocketAddr> = servers.iter().map(|s| s.addr).collect();
    let map = even_map(3, &natives);
    let (seed_addr, _) = seed(vec![map.clone()]).await;
    let cluster = ClusterClient::connect(ClientConfig::new(seed_addr.to_string()))
        .await
        .unwrap();
    assert!(!cluster.is_standalone());
    assert_eq!(cluster.map(), map);

    let keys: Vec<Vec<u8>> = (0..300).map(|i| format!("key:{i}").into_bytes()).collect();
    for k in &keys {
        cluster.put(k, k).await.unwrap();
    }
    // Each key is on its master only.
    let direct = [
        plain(&servers[0]).await,
        plain(&servers[1]).await,
        plain(&servers[2]).await,
    ];
    let mut per_server = [0; 3];
    for k in &keys {
        let master = map.tablet_of(0, k).unwrap().master as usize - 1;
        per_server[master] += 1;
        for (i, client) in direct.iter().enumerate() {
            let found = client.get(k).await.unwrap();
            assert_eq!(found.is_some(), i == master, "key {k:?} on server {i}");
        }
        assert_eq!(cluster.get(k).await.unwrap().unwrap().value, k.as_slice());
    }
    assert!(per_server.iter().all(|&n| n > 50), "{per_server:?}");

    // MULTI_GET over every server, absent keys included, in order.
    let mut asked: Vec<Vec<u8>> = keys.iter().rev().cloned().collect();
    asked.insert(7, b"absent:1".to_vec());
    asked.push(b"absent:2".to_vec());
    let refs: Vec<&[u8]> = asked.iter().map(Vec::as_slice).collect();
    let got = cluster.multi_get(&refs).await.unwrap();
    assert_eq!(got.len(), refs.len());
    for (k, o) in refs.iter().zip(&got) {
        match o {
            Some(o) => assert_eq!(o.value, *k),
            None => assert!(k.starts_with(b"absent")),
        }
    }

    // The listing covers every server.
    let mut listed = cluster.scan_all(b"key:*").await.unwrap();
    listed.sort();
    let mut expected = keys.clone();
    expected.sort();
    assert_eq!(listed, expected);

    // A multi-put on one tablet is sent to its master; across tablets, nothing is sent.
    let version = cluster
        .multi_put(&[(b"{user:9}:a", b"1"), (b"{user:9}:b", b"2")])
        .await
        .unwrap();
    let master = map.tablet_of(0, b"user:9").unwrap().master as usize - 1;
    let o = direct[master].get(b"{user:9}:b").await.unwrap().unwrap();
    assert_eq!((o.value.as_ref(), o.version), (&b"2"[..], version));
    let tablet = |k: &[u8]| map.tablet_of(0, k).unwrap().first_slot;
    let a = keys[0].as_slice();
    let b = keys
        .iter()
        .map(Vec::as_slice)
        .find(|k| tablet(k) != tablet(a))
        .unwrap();
    let e = cluster
        .multi_put(&[(a, b"x"), (b, b"y")])
        .await
        .unwrap_err();
    assert!(matches!(e, Error::CrossTablet(_)), "{e}");
    assert_eq!(cluster.get(a).await.unwrap().unwrap().value, a);

    // Deletes, conditional writes, counters and expiries are routed too.
    for k in &keys[..100] {
        assert!(cluster.delete(k).await.unwrap().is_some());
    }
    assert_eq!(cluster.scan_all(b"key:*").await.unwrap().len(), 200);
    assert_eq!(cluster.increment(b"counter", 2).await.unwrap().0, 2);
    assert_eq!(cluster.increment(b"counter", 3).await.unwrap().0, 5);
    assert!(cluster
        .expire(b"counter", ramlog_client::Expiry::AfterMs(60_000))
        .await
        .unwrap()
        .is_some());
    let counter_master = map.tablet_of(0, b"counter").unwrap().master as usize - 1;
    assert!(direct[counter_master]
        .get(b"counter")
        .await
        .unwrap()
        .is_some());
}

#[tokio::test]
async fn a_refusal_refreshes_the_map_and_retries() {
    let real = start_server(NativeConfig::default()).await;
    let refusals = Arc::new(AtomicUsize::new(0));
    let counted = refusals.clone();
    let stale: Handler = Arc::new(move |_| {
        counted.fetch_add(1, Ordering::SeqCst);
        Some(error(
            Status::WrongServer,
            "not mine; refresh the cluster map",
        ))
    });
    let stale_addr = scripted(stale).await;
    // Version 1 names the refusing server; the seed's next answers name the real one.
    let (seed_addr, map_calls) =
        seed(vec![even_map(1, &[stale_addr]), even_map(2, &[real.addr])]).await;
    let cluster = ClusterClient::connect(ClientConfig::new(seed_addr.to_string()))
        .await
        .unwrap();
    assert_eq!(cluster.map().version, 1);
    // A write refused with WRONG_SERVER was not applied: it is retried on the new master.
    cluster.put(b"k", b"v").await.unwrap();
    assert_eq!(refusals.load(Ordering::SeqCst), 1);
    assert_eq!(cluster.map().version, 2);
    assert_eq!(map_calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        plain(&real).await.get(b"k").await.unwrap().unwrap().value,
        &b"v"[..]
    );
    // An older map never replaces a newer one.
    let (newer_first, _) = seed(vec![even_map(5, &[real.addr]), even_map(4, &[stale_addr])]).await;
    let other = ClusterClient::connect(ClientConfig::new(newer_first.to_string()))
        .await
        .unwrap();
    assert_eq!(other.refresh_map().await.unwrap().version, 5);
    assert_eq!(other.get(b"k").await.unwrap().unwrap().value, &b"v"[..]);
}

#[tokio::test]
async fn refusals_give_up_after_the_recovery_wait() {
    let refusals = Arc::new(AtomicUsize::new(0));
    let counted = refusals.clone();
    let stale: Handler = Arc::new(move |_| {
        counted.fetch_add(1, Ordering::SeqCst);
        Some(error(Status::WrongServer, "not mine"))
    });
    let stale_addr = scripted(stale).await;
    let (seed_addr, _) = seed(vec![even_map(1, &[stale_addr])]).await;
    let mut config = ClientConfig::new(seed_addr.to_string());
    config.recovery_wait = std::time::Duration::from_millis(400);
    let cluster = ClusterClient::connect(config).await.unwrap();
    let started = std::time::Instant::now();
    let e = cluster.put(b"k", b"v").await.unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Server {
                status: Status::WrongServer,
                ..
            }
        ),
        "{e}"
    );
    // Retried after 50, 100, 200 ms, then every 200 ms (the last pause cut at the wait's end).
    assert_eq!(refusals.load(Ordering::SeqCst), 5);
    let took = started.elapsed();
    assert!(
        took >= std::time::Duration::from_millis(400) && took < std::time::Duration::from_secs(3),
        "{took:?}"
    );
    // A key of a table the map does not have.
    let e = cluster.with_table(9).get(b"k").await.unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Server {
                status: Status::NoSuchTable,
                ..
            }
        ),
        "{e}"
    );
}

#[tokio::test]
async fn a_broken_connection_retries_reads_but_not_writes() {
    let requests = Arc::new(AtomicUsize::new(0));
    let counted = requests.clone();
    // Reads every request, answers none: the connection closes under it.
    let dropping: Handler = Arc::new(move |_| {
        counted.fetch_add(1, Ordering::SeqCst);
        None
    });
    let dropping_addr = scripted(dropping).await;
    let (seed_addr, _) = seed(vec![even_map(1, &[dropping_addr])]).await;
    let mut config = ClientConfig::new(seed_addr.to_string());
    config.recovery_wait = std::time::Duration::from_millis(400);
    let cluster = ClusterClient::connect(config).await.unwrap();
    let e = cluster.put(b"k", b"v").await.unwrap_err();
    assert!(matches!(e, Error::ConnectionLost(_)), "{e}");
    assert_eq!(
        requests.load(Ordering::SeqCst),
        1,
        "a write that may have been applied is not sent again"
    );
    let e = cluster.get(b"k").await.unwrap_err();
    assert!(matches!(e, Error::ConnectionLost(_)), "{e}");
    assert!(requests.load(Ordering::SeqCst) > 4);
}

/// The map a seed hands out `elapsed` after it started: the master is dead (its address refuses
/// connections) for 0.4 s, then its tablets are being recovered until 1.5 s, then the real server
/// masters them.
fn map_during_a_recovery(
    elapsed: std::time::Duration,
    dead: SocketAddr,
    real: SocketAddr,
) -> ClusterMap {
    if elapsed < std::time::Duration::from_millis(400) {
        return even_map(1, &[dead]);
    }
    let mut map = even_map(2, &[dead, real]);
    map.servers[0].state = ServerState::Dead;
    for t in &mut map.tablets {
        if elapsed < std::time::Duration::from_millis(1500) {
            t.master = 1;
            t.recovering = true;
            t.restorer = Some(2);
        } else {
            t.master = 2;
        }
    }
    if elapsed >= std::time::Duration::from_millis(1500) {
        map.version = 3;
    }
    map
}

#[tokio::test]
async fn a_request_waits_out_its_masters_recovery() {
    let real = start_server(NativeConfig::default()).await;
    // An address nobody listens on: the dead master.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let started = std::time::Instant::now();
    let real_addr = real.addr;
    let handler: Handler = Arc::new(move |request| {
        Some(match request {
            Request::ClusterMap => Response::ClusterMap(
                map_during_a_recovery(started.elapsed(), dead, real_addr)
                    .to_json()
                    .into(),
            ),
            _ => error(Status::WrongServer, "the seed masters nothing"),
        })
    });
    let seed_addr = scripted(handler).await;
    let cluster = ClusterClient::connect(ClientConfig::new(seed_addr.to_string()))
        .await
        .unwrap();
    assert_eq!(cluster.map().version, 1);
    // A write to the dead master is not sent (its connection is refused), then waits while its
    // tablet is recovered, then goes to the new master: one wait, no error.
    cluster.put(b"k", b"v").await.unwrap();
    let took = started.elapsed();
    assert!(
        took >= std::time::Duration::from_millis(1500) && took < std::time::Duration::from_secs(5),
        "{took:?}"
    );
    assert_eq!(cluster.map().version, 3);
    assert_eq!(
        plain(&real).await.get(b"k").await.unwrap().unwrap().value,
        &b"v"[..]
    );
    // With no wait, a tablet being recovered answers at once, sending nothing.
    let mut config = ClientConfig::new(seed_addr.to_string());
    config.recovery_wait = std::time::Duration::ZERO;
    let recovering = map_during_a_recovery(std::time::Duration::from_secs(1), dead, real_addr);
    let (recovering_seed, _) = seed(vec![recovering]).await;
    config.addr = recovering_seed.to_string();
    let impatient = ClusterClient::connect(config).await.unwrap();
    let e = impatient.put(b"k", b"w").await.unwrap_err();
    assert!(
        matches!(&e, Error::Server { status: Status::WrongServer, message } if message.contains("being recovered")),
        "{e}"
    );
    assert_eq!(
        plain(&real).await.get(b"k").await.unwrap().unwrap().value,
        &b"v"[..]
    );
}
