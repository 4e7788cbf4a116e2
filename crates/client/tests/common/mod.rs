//! Test servers: the real native connection handler on a loopback listener with a real engine, and a
//! few scripted fake servers for behaviour a correct server never shows (silence, replies out of order).

#![allow(dead_code)]

pub mod process;

use bytes::BytesMut;
use ramlog_logmem::{Engine, EngineConfig};
use ramlog_proto::native::{
    parse_header, ClientHello, Request, Response, ServerHello, CLIENT_HELLO_LEN, HEADER_LEN,
    PROTOCOL_VERSION,
};
use ramlog_server::front::native::{serve_native_connection, NativeConfig};
use ramlog_server::{Node, ServerConfig};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub struct TestServer {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    pub node: Arc<Node>,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// A server with a real engine (128 MiB, table 0 in four tablets) and the given native limits.
pub async fn start_server(config: NativeConfig) -> TestServer {
    start_server_with(EngineConfig::default(), config).await
}

/// Like [`start_server`], with engine settings (the memory budget is always 128 MiB).
pub async fn start_server_with(engine_config: EngineConfig, config: NativeConfig) -> TestServer {
    start_server_full(engine_config, ServerConfig::default(), config).await
}

/// Like [`start_server_with`], with the service layer's settings (a password, say) from
/// `server_config`.
pub async fn start_server_full(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    config: NativeConfig,
) -> TestServer {
    let engine = Engine::new(EngineConfig {
        memory_bytes: 128 << 20,
        ..engine_config
    })
    .expect("engine");
    let node = Node::with_engine(engine.clone(), 4, server_config).expect("node");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let config = Arc::new(config);
    let node2 = node.clone();
    let accept = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(serve_native_connection(
                stream,
                node2.clone(),
                None,
                config.clone(),
            ));
        }
    });
    TestServer {
        addr,
        engine,
        node,
        accept,
    }
}

/// A raw connection that has done the handshake, for sending hand-made frames.
pub struct Raw {
    pub stream: TcpStream,
    pub hello: ServerHello,
    buf: BytesMut,
}

impl Raw {
    pub async fn connect(addr: SocketAddr) -> Raw {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(
                &ClientHello {
                    version_max: PROTOCOL_VERSION,
                    flags: 0,
                }
                .encode(),
            )
            .await
            .unwrap();
        let mut b = [0u8; ramlog_proto::native::SERVER_HELLO_LEN];
        stream.read_exact(&mut b).await.expect("server hello");
        let hello = ServerHello::decode(&b).expect("hello decodes");
        Raw {
            stream,
            hello,
            buf: BytesMut::new(),
        }
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.expect("write");
    }

    pub async fn send_request(&mut self, id: u64, request: &Request<'_>) {
        let mut out = BytesMut::new();
        request.encode(id, &mut out);
        self.send(&out).await;
    }

    /// The next reply frame: (request id, opcode, reply). None when the server closed the connection.
    pub async fn recv(&mut self) -> Option<(u64, u8, Response)> {
        loop {
            if let Some(h) = parse_header(&self.buf, usize::MAX).expect("valid reply header") {
                if self.buf.len() >= h.frame_bytes() {
                    let frame = self.buf.split_to(h.frame_bytes()).freeze();
                    let reply =
                        Response::decode(h.opcode, h.flags_or_status, frame.slice(HEADER_LEN..))
                            .expect("reply decodes");
                    return Some((h.request_id, h.opcode, reply));
                }
            }
            let n = tokio::time::timeout(
                std::time::Duration::from_secs(10),
                self.stream.read_buf(&mut self.buf),
            )
            .await
            .expect("reply within 10 s")
            .ok()?;
            if n == 0 {
                return None;
            }
        }
    }
}

/// A fake server that completes the handshake and then behaves as `script` says.
pub async fn fake_server<F, Fut>(script: F) -> SocketAddr
where
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut hello = [0u8; CLIENT_HELLO_LEN];
            if stream.read_exact(&mut hello).await.is_err() {
                continue;
            }
            let server_hello = ServerHello {
                version: PROTOCOL_VERSION,
                flags: 0,
                max_frame_bytes: 1 << 20,
                max_in_flight: 1024,
                key_size_max_bytes: 1 << 16,
                value_size_max_bytes: 1 << 20,
            };
            if stream.write_all(&server_hello.encode()).await.is_err() {
                continue;
            }
            tokio::spawn(script(stream));
        }
    });
    addr
}

/// Read request frames from `stream` until `n` arrived; returns (id, opcode, ping payload).
pub async fn read_requests(stream: &mut TcpStream, n: usize) -> Vec<(u64, u8, Vec<u8>)> {
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    while out.len() < n {
        match parse_header(&buf, 1 << 20).unwrap() {
            Some(h) if buf.len() >= h.frame_bytes() => {
                let frame = buf.split_to(h.frame_bytes());
                let payload =
                    match Request::decode(h.opcode, h.flags_or_status, &frame[HEADER_LEN..])
                        .unwrap()
                    {
                        Request::Ping { payload } => payload.to_vec(),
                        _ => Vec::new(),
                    };
                out.push((h.request_id, h.opcode, payload));
            }
            _ => {
                if stream.read_buf(&mut buf).await.unwrap() == 0 {
                    break;
                }
            }
        }
    }
    out
}
