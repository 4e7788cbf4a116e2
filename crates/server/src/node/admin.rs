//! Admin HTTP: `GET /metrics` (Prometheus text), `GET /status` (JSON), `GET /` (a short index).
//!
//! A deliberately small HTTP/1.1 responder: it reads one request head (at most 8 KiB, within 5 s),
//! answers it and closes the connection. Operators and Prometheus need nothing more, and it keeps
//! a web framework out of the server.

use crate::node::Node;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

const HEAD_MAX_BYTES: usize = 8 * 1024;
const CONNECTIONS_MAX: usize = 64;

pub async fn serve(listener: TcpListener, node: Arc<Node>, mut shutdown: watch::Receiver<bool>) {
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => break,
        };
        while connections.try_join_next().is_some() {}
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        if connections.len() >= CONNECTIONS_MAX {
            continue; // dropped: the admin port is not for load
        }
        let node = node.clone();
        connections.spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(5), handle(stream, &node)).await;
        });
    }
    connections.shutdown().await;
}

async fn handle(mut stream: TcpStream, node: &Node) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&chunk[..n]);
        if head.len() > HEAD_MAX_BYTES {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                "text/plain",
                "request head too large\n",
            )
            .await;
        }
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    if method != "GET" && method != "HEAD" {
        return respond(
            &mut stream,
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n",
        )
        .await;
    }
    match path {
        "/metrics" => {
            let body = node.snapshot().prometheus();
            respond(&mut stream, "200 OK", "text/plain; version=0.0.4", &body).await
        }
        "/status" => {
            let snapshot = node.snapshot();
            let body = serde_json::json!({
                "status": "ok",
                "role": "server",
                "node_id": node.node_id(),
                "config": {
                    "bind": node.config.bind.to_string(),
                    "memory_bytes": node.config.memory_bytes,
                    "persistence": node.config.persistence.to_string(),
                    "connections_max": node.config.connections_max,
                },
                "metrics": snapshot,
            });
            respond(
                &mut stream,
                "200 OK",
                "application/json",
                &format!("{body:#}\n"),
            )
            .await
        }
        "/" => {
            let body = "ramlog server\n/metrics  Prometheus metrics\n/status   JSON status\n";
            respond(&mut stream, "200 OK", "text/plain", body).await
        }
        _ => respond(&mut stream, "404 Not Found", "text/plain", "not found\n").await,
    }
}

async fn respond(
    stream: &mut TcpStream,
    status: &str,
    content_type: &str,
    body: &str,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}
