//! `ramlog schema` and `ramlog scan` with filters, projection and aggregates against the real
//! `ramlog server` process (`common/process.rs`).

mod common;

use common::process::ServerProcess;
use ramlog_client::query::{Schema, Value};
use ramlog_client::{Client, ClientConfig};
use std::process::Output;

fn ok_stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}: {}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn sorted_lines(s: &str) -> Vec<String> {
    let mut v: Vec<String> = s.lines().map(String::from).collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_and_filtered_scan_verbs() {
    let server = ServerProcess::start(&["--persistence", "off"]).await;
    // Schema verbs.
    assert_eq!(ok_stdout(&server.cli(&["schema", "get", "0"])).trim(), "");
    let set = server.cli(&["schema", "set", "0", "age:i64,name:string,active:bool"]);
    assert_eq!(ok_stdout(&set).trim(), "OK age:i64,name:string,active:bool");
    assert_eq!(
        ok_stdout(&server.cli(&["schema", "get", "0"])).trim(),
        "age:i64,name:string,active:bool"
    );
    let bad = server.cli(&["schema", "set", "0", "age:int128"]);
    assert!(!bad.status.success());

    // Records written with the client in the schema's encoding.
    let client = Client::connect(ClientConfig::new(server.addr()))
        .await
        .unwrap();
    let schema: Schema = client.get_schema().await.unwrap().expect("schema set");
    let people = [
        ("user:1", 15, "ann", true),
        ("user:2", 42, "bob", false),
        ("user:3", 67, "cy", true),
        ("user:4", 30, "dee", false),
        ("team:1", 99, "ops", true),
    ];
    for (key, age, name, active) in people {
        let value = schema
            .encode(&[
                Value::I64(age),
                Value::Str(name.into()),
                Value::Bool(active),
            ])
            .unwrap();
        client.put(key.as_bytes(), &value).await.unwrap();
    }

    // Prefix + OR inside one --where + AND across flags + projection.
    let out = ok_stdout(&server.cli(&[
        "scan",
        "--prefix",
        "user:",
        "--where",
        "age < 20 | active = false",
        "--where",
        "name != \"dee\"",
        "--fields",
        "name,age",
    ]));
    assert_eq!(
        sorted_lines(&out),
        vec![
            "user:1\tname=\"ann\" age=15".to_string(),
            "user:2\tname=\"bob\" age=42".to_string()
        ]
    );
    // Whole records, decoded by the schema; glob key filter; keys only.
    let out = ok_stdout(&server.cli(&["scan", "--match", "team:*", "--where", "active = true"]));
    assert_eq!(out.trim(), "team:1\tage=99 name=\"ops\" active=true");
    let out = ok_stdout(&server.cli(&[
        "scan",
        "--range",
        "user:2..user:4",
        "--keys-only",
        "--limit",
        "10",
    ]));
    assert_eq!(sorted_lines(&out), vec!["user:2", "user:3"]);
    // --limit stops early.
    let out =
        ok_stdout(&server.cli(&["scan", "--prefix", "user:", "--limit", "2", "--count", "1"]));
    assert_eq!(out.lines().count(), 2);
    // Aggregates.
    let out = ok_stdout(&server.cli(&[
        "scan",
        "--prefix",
        "user:",
        "--count-records",
        "--sum",
        "age",
        "--min",
        "name",
        "--max",
        "age",
    ]));
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        vec![
            "count 4",
            "sum(age) 154",
            "min(name) \"ann\"",
            "max(age) 67"
        ]
    );
    // An unknown field is an error that names it.
    let bad = server.cli(&["scan", "--where", "height > 3"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("height"));
    // The plain key listing still works.
    let out = ok_stdout(&server.cli(&["scan", "--match", "user:*"]));
    assert_eq!(sorted_lines(&out).len(), 4);
    // Clearing the schema.
    assert_eq!(
        ok_stdout(&server.cli(&["schema", "clear", "0"])).trim(),
        "OK"
    );
    assert_eq!(client.get_schema().await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_survive_kill_9_and_a_corrupt_one_is_refused() {
    let mut server = ServerProcess::start(&["--persistence", "async"]).await;
    let set = server.cli(&["schema", "set", "0", "age:i64,name:string"]);
    assert_eq!(ok_stdout(&set).trim(), "OK age:i64,name:string");
    let client = Client::connect(ClientConfig::new(server.addr()))
        .await
        .unwrap();
    let schema: Schema = client.get_schema().await.unwrap().expect("schema set");
    for (key, age, name) in [("p:1", 15, "ann"), ("p:2", 42, "bob"), ("p:3", 67, "cy")] {
        let value = schema
            .encode(&[Value::I64(age), Value::Str(name.into())])
            .unwrap();
        client.put(key.as_bytes(), &value).await.unwrap();
    }
    // Written within the flush interval; wait past it before the kill.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    drop(client);

    // The schema was recorded before SET_SCHEMA answered: a kill -9 right after keeps it, and
    // filtered scans decode the replayed records with it.
    server.kill_and_restart().await;
    assert_eq!(
        ok_stdout(&server.cli(&["schema", "get", "0"])).trim(),
        "age:i64,name:string"
    );
    let out = ok_stdout(&server.cli(&["scan", "--where", "age > 20", "--fields", "name"]));
    assert_eq!(
        sorted_lines(&out),
        vec![
            "p:2\tname=\"bob\"".to_string(),
            "p:3\tname=\"cy\"".to_string()
        ]
    );

    // A cleared schema stays cleared.
    ok_stdout(&server.cli(&["schema", "clear", "0"]));
    server.kill_and_restart().await;
    assert_eq!(ok_stdout(&server.cli(&["schema", "get", "0"])).trim(), "");

    // A corrupt schema file: the server refuses to start and names the file; nothing is lost
    // once it is removed.
    let file = server.data_dir.join("schemas").join("0.schema");
    std::fs::write(&file, b"\xff\xfenot a schema").unwrap();
    let refused = server.kill_and_start_expecting_failure();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("0.schema") && stderr.contains("set the schema again"),
        "{stderr}"
    );
    std::fs::remove_file(&file).unwrap();
    server.kill_and_restart().await;
    let out = ok_stdout(&server.cli(&["scan", "--keys-only"]));
    assert_eq!(sorted_lines(&out), vec!["p:1", "p:2", "p:3"]);
}
