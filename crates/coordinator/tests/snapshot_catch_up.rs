//! Three coordinator members in one process: a member that was down while the others took
//! snapshots and purged their logs catches up from a snapshot sent over the network.

use ramlog_cluster::rpc::{CoordinatorClient, Request, Response};
use ramlog_cluster::{ReplicationMode, ServerAddresses};
use ramlog_coordinator::{Coordinator, CoordinatorConfig};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

fn free_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

fn config(id: u64, members: &BTreeMap<u64, String>, dir: &Path) -> CoordinatorConfig {
    CoordinatorConfig {
        recovery_partition: Default::default(),
        split_bytes: 0,
        load_min_ops: 0,
        id,
        listen: members[&id].parse().unwrap(),
        members: members.clone(),
        data_dir: dir.join(format!("c{id}")),
        initial_servers: 1,
        default_mode: None,
        default_replicas: None,
        snapshot_every: 4,
        // The registered "server" is this test, not a process: it is not declared dead here.
        dead_after: std::time::Duration::from_secs(600),
        cut_off_after_ms: 1000,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_member_catches_up_from_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let members: BTreeMap<u64, String> = (1..=3).map(|i| (i, free_port().to_string())).collect();
    let mut running = BTreeMap::new();
    for id in 1..=3 {
        let c = Coordinator::start(config(id, &members, dir.path()))
            .await
            .unwrap();
        running.insert(id, c);
    }
    let addresses: Vec<String> = members.values().cloned().collect();
    let client = CoordinatorClient::new(addresses.clone(), Duration::from_secs(10));
    let server: SocketAddr = "127.0.0.1:7000".parse().unwrap();
    let register = Request::Register {
        previous: None,
        addresses: ServerAddresses {
            resp: server,
            routing: None,
            native: server,
            admin: None,
        },
        memory_bytes: 1 << 30,
        incarnation: 0,
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match client.call(&register).await {
            Ok(Response::Registered { .. }) => break,
            other => {
                assert!(Instant::now() < deadline, "cannot register: {other:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let leader = client.status().await.unwrap().leader.unwrap();
    let lagging = if leader == 3 { 2 } else { 3 };
    running.remove(&lagging).unwrap().shutdown().await;

    // Far more entries than the leader keeps behind its snapshot: the entries the lagging member
    // misses are purged, so only a snapshot can bring it up to date.
    for i in 0..40 {
        let create = Request::CreateTable {
            name: format!("t{i}"),
            mode: ReplicationMode::Async,
            replicas: Some(0),
            schema: None,
        };
        assert!(matches!(
            client.call(&create).await.unwrap(),
            Response::TableCreated(_)
        ));
    }
    let map = client.map().await.unwrap();

    let c = Coordinator::start(config(lagging, &members, dir.path()))
        .await
        .unwrap();
    let direct = CoordinatorClient::new(vec![members[&lagging].clone()], Duration::from_secs(2));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = direct.status().await.unwrap();
        if status.map == map {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "member {lagging} did not catch up: version {} of {}",
            status.map.version,
            map.version
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        dir.path()
            .join(format!("c{lagging}"))
            .join("snapshot")
            .exists(),
        "the lagging member should have installed a snapshot"
    );
    c.shutdown().await;
    for (_, c) in running {
        c.shutdown().await;
    }
}
