//! Starts a real server in process on an ephemeral port and talks RESP to it over TCP.

use ramlog_proto::resp::{encode_command, Reply, ReplyDecoder};
use ramlog_server::{PersistenceMode, Server, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn start() -> Server {
    let config = ServerConfig {
        resp_port: 0,
        native_port: 0,
        admin_port: 0,
        memory_bytes: 64 << 20,
        persistence: PersistenceMode::Off,
        ..ServerConfig::default()
    };
    Server::start(config).await.expect("server starts")
}

struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(server: &Server) -> Conn {
        Conn {
            stream: TcpStream::connect(server.addresses().resp).await.unwrap(),
            buf: Vec::new(),
        }
    }

    async fn send(&mut self, commands: &[&[&str]]) {
        let mut out = Vec::new();
        for c in commands {
            let args: Vec<&[u8]> = c.iter().map(|a| a.as_bytes()).collect();
            encode_command(&mut out, &args);
        }
        self.stream.write_all(&out).await.unwrap();
    }

    async fn reply(&mut self) -> Reply {
        loop {
            if let Some((reply, used)) = ReplyDecoder::default().decode(&self.buf).unwrap() {
                self.buf.drain(..used);
                return reply;
            }
            let mut chunk = [0u8; 4096];
            let n = self.stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "server closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    async fn call(&mut self, command: &[&str]) -> Reply {
        self.send(&[command]).await;
        self.reply().await
    }
}

fn bulk(s: &str) -> Reply {
    Reply::Bulk(s.as_bytes().to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_over_resp2_and_resp3() {
    let server = start().await;
    let mut c = Conn::open(&server).await;
    assert_eq!(c.call(&["PING"]).await, Reply::Simple("PONG".into()));
    assert_eq!(c.call(&["SET", "k", "v"]).await, Reply::Simple("OK".into()));
    assert_eq!(c.call(&["GET", "k"]).await, bulk("v"));
    assert_eq!(c.call(&["GET", "nope"]).await, Reply::Null);
    assert_eq!(c.call(&["SET", "k", "w", "NX"]).await, Reply::Null);
    assert_eq!(c.call(&["SET", "k", "w", "XX", "GET"]).await, bulk("v"));
    assert_eq!(
        c.call(&["INCR", "k"]).await,
        Reply::Error("ERR value is not an integer or out of range".into())
    );
    assert_eq!(c.call(&["INCRBY", "n", "41"]).await, Reply::Integer(41));
    assert_eq!(c.call(&["INCR", "n"]).await, Reply::Integer(42));
    assert_eq!(
        c.call(&["MSET", "a", "1", "b", "2"]).await,
        Reply::Simple("OK".into())
    );
    assert_eq!(
        c.call(&["MGET", "a", "x", "b"]).await,
        Reply::Array(vec![bulk("1"), Reply::Null, bulk("2")])
    );
    assert_eq!(c.call(&["DEL", "a", "b", "x"]).await, Reply::Integer(2));
    assert_eq!(c.call(&["DBSIZE"]).await, Reply::Integer(2));
    assert_eq!(
        c.call(&["nosuch", "x"]).await,
        Reply::Error("ERR unknown command 'nosuch', with args beginning with: 'x' ".into())
    );
    // RESP3 after HELLO 3: maps and the `_` null.
    let hello = c.call(&["HELLO", "3"]).await;
    let Reply::Map(pairs) = hello else {
        panic!("HELLO 3 answers a map: {hello:?}")
    };
    assert!(pairs.contains(&(bulk("proto"), Reply::Integer(3))));
    assert_eq!(c.call(&["GET", "nope"]).await, Reply::Null);
    let config = c.call(&["CONFIG", "GET", "appendonly"]).await;
    assert_eq!(config, Reply::Map(vec![(bulk("appendonly"), bulk("no"))]));
    assert!(
        matches!(c.call(&["INFO", "keyspace"]).await, Reply::Verbatim(f, t) if f == "txt" && t.starts_with(b"# Keyspace"))
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_pipeline_is_answered_in_order() {
    let server = start().await;
    let mut c = Conn::open(&server).await;
    let keys: Vec<String> = (0..5000).map(|i| format!("key:{i}")).collect();
    let mut commands: Vec<Vec<&str>> = keys
        .iter()
        .map(|k| vec!["SET", k.as_str(), k.as_str()])
        .collect();
    commands.extend(keys.iter().map(|k| vec!["GET", k.as_str()]));
    let refs: Vec<&[&str]> = commands.iter().map(|c| c.as_slice()).collect();
    c.send(&refs).await;
    for _ in &keys {
        assert_eq!(c.reply().await, Reply::Simple("OK".into()));
    }
    for k in &keys {
        assert_eq!(c.reply().await, bulk(k));
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_error_closes_only_that_connection() {
    let server = start().await;
    let mut bad = TcpStream::connect(server.addresses().resp).await.unwrap();
    bad.write_all(b"*1\r\n$999999999999\r\n").await.unwrap();
    let mut reply = Vec::new();
    bad.read_to_end(&mut reply).await.unwrap();
    assert_eq!(reply, b"-ERR Protocol error: invalid bulk length\r\n");
    let mut good = Conn::open(&server).await;
    assert_eq!(good.call(&["PING"]).await, Reply::Simple("PONG".into()));
    server.shutdown().await;
}
