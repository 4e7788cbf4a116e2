//! Connections from this server to the other servers of its cluster: one pooled, multiplexed
//! native client per peer, opened by whichever caller needs it first (the routing port forwards
//! clients' commands over them).

use crate::node::Node;
use ramlog_client::{Client, ClientConfig};
use ramlog_cluster::ServerId;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// A peer's client, connected once by whichever routing connection needs it first.
type PeerCell = Arc<tokio::sync::OnceCell<Client>>;

/// Connections from this server to the others, for forwarding. One pooled, multiplexed client
/// per server, shared by every routing connection.
#[derive(Default)]
pub struct Peers {
    clients: parking_lot::Mutex<HashMap<(ServerId, std::net::SocketAddr), PeerCell>>,
}

impl Peers {
    /// The pooled client of server `id` at `addr`, connected on first use.
    pub async fn client(
        &self,
        node: &Node,
        id: ServerId,
        addr: std::net::SocketAddr,
    ) -> Result<Client, String> {
        let cell = self.clients.lock().entry((id, addr)).or_default().clone();
        cell.get_or_try_init(|| async {
            let mut config = ClientConfig::new(addr.to_string());
            config.password = node.config.password.clone().map(String::into_bytes);
            config.connections = node.config.worker_threads.clamp(1, 4);
            config.request_timeout = Duration::from_secs(10);
            config.retry_idempotent = false;
            Client::connect(config).await.map_err(|e| e.to_string())
        })
        .await
        .cloned()
        .map_err(|e| format!("server {id} at {addr}: {e}"))
    }
}
