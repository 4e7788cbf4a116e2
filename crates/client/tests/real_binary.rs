//! The client and the command-line verbs against the real `ramlog server` process
//! (`common/process.rs`).

mod common;

use common::process::ServerProcess;
use ramlog_client::{Client, ClientConfig, Condition, Error, PutOptions};
use std::process::Output;

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_against_the_real_server() {
    let server = ServerProcess::start(&[]).await;
    let mut config = ClientConfig::new(server.addr());
    config.connections = 2;
    let c = Client::connect(config).await.unwrap();
    let v = c.put(b"real:1", b"hello").await.unwrap();
    let o = c.get(b"real:1").await.unwrap().unwrap();
    assert_eq!((&o.value[..], o.version), (&b"hello"[..], v));
    assert!(matches!(
        c.put_with(b"real:1", b"x", PutOptions { condition: Condition::IfAbsent, ..Default::default() }).await,
        Err(Error::ConditionFailed { current_version: Some(cv) }) if cv == v
    ));
    c.put(b"real:n", b"abc").await.unwrap();
    assert!(matches!(
        c.increment(b"real:n", 1).await,
        Err(Error::NotAnInteger)
    ));
    assert!(matches!(
        c.put(b"real:big", &vec![0u8; (1 << 20) + 1]).await,
        Err(Error::ValueTooLarge(_))
    ));
    // Many tasks in flight on two connections.
    let mut tasks = Vec::new();
    for t in 0..32 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..50 {
                let k = format!("real:{t}:{i}");
                c.put(k.as_bytes(), k.as_bytes()).await.unwrap();
                assert_eq!(
                    &c.get(k.as_bytes()).await.unwrap().unwrap().value[..],
                    k.as_bytes()
                );
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let keys = c.scan_all(b"real:*:*").await.unwrap();
    let unique: std::collections::BTreeSet<_> = keys.iter().collect();
    assert_eq!(unique.len(), 32 * 50);
    assert!(c.stats().await.unwrap().starts_with('{'));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_line_verbs() {
    let server = ServerProcess::start(&[]).await;
    let set = server.cli(&["set", "cli:a", "alpha"]);
    assert!(set.status.success(), "{set:?}");
    assert!(stdout(&set).starts_with("OK version "), "{}", stdout(&set));
    let version: u64 = stdout(&set)
        .trim()
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();

    let get = server.cli(&["get", "cli:a", "--show-version"]);
    assert!(get.status.success());
    assert_eq!(
        stdout(&get),
        format!("alpha\nversion {version} expire_at_ms 0\n")
    );

    // Conditions: if-absent fails on an existing key (non-zero exit, message on stderr).
    let again = server.cli(&["set", "cli:a", "beta", "--if-absent"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("condition failed"));
    let cas = server.cli(&[
        "set",
        "cli:a",
        "gamma",
        "--if-version",
        &version.to_string(),
    ]);
    assert!(cas.status.success(), "{cas:?}");

    assert!(server.cli(&["set", "cli:b", "2"]).status.success());
    assert!(server.cli(&["set", "other", "3"]).status.success());
    let scan = server.cli(&["scan", "--match", "cli:*"]);
    assert!(scan.status.success());
    let mut keys: Vec<String> = stdout(&scan).lines().map(String::from).collect();
    keys.sort();
    assert_eq!(keys, vec!["cli:a", "cli:b"]);

    let del = server.cli(&["del", "cli:a", "cli:b", "cli:none"]);
    assert_eq!(stdout(&del), "2\n");
    let missing = server.cli(&["get", "cli:a"]);
    assert_eq!(missing.status.code(), Some(1));
    assert_eq!(String::from_utf8_lossy(&missing.stderr).trim(), "(nil)");

    let status = server.cli(&["status"]);
    assert!(status.status.success(), "{status:?}");
    assert!(
        stdout(&status).trim_start().starts_with('{'),
        "{}",
        stdout(&status)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persistent_server_opens_every_tablet_log_at_start() {
    let server = ServerProcess::start(&["--persistence", "async"]).await;
    // Before any write: a secondary log and a version log per tablet of table 0 (a new data
    // directory gets 64 tablets).
    let count = |suffix: &str| {
        std::fs::read_dir(server.data_dir.join("backup"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(suffix)
            })
            .count()
    };
    assert_eq!(count(".sec"), 64);
    assert_eq!(count(".ver"), 64);
}
