//! One server process: its service layer ([`Node`]) and the listeners (RESP, native protocol,
//! admin HTTP) in front of it.
//!
//! [`Server::start`] binds every listener first (so that a port in use is reported before anything
//! runs), opens the node, then spawns one accept loop per listener on the current tokio runtime. Connections are
//! tasks of their own; the connection limit is one atomic counter shared by all listeners.
//! [`Server::shutdown`] stops accepting, ends every connection and stops the engine.

use crate::cluster::Roles;
use crate::front::native::{refuse_native_connection, serve_native_connection, NativeConfig};
use crate::front::resp_conn;
use crate::node::admin;
use crate::node::config::ServerConfig;
use crate::node::metrics::Metrics;
pub use crate::node::Addresses;
use crate::node::Node;
use ramlog_logmem::EngineError;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] crate::node::config::ConfigError),
    #[error("cannot listen on {addr} ({what}): {source}")]
    Bind {
        addr: SocketAddr,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    #[error("persistence: {0}")]
    Persistence(#[from] crate::node::persistence::PersistenceError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Join(#[from] crate::cluster::JoinError),
}

impl From<crate::node::OpenError> for ServerError {
    fn from(e: crate::node::OpenError) -> Self {
        match e {
            crate::node::OpenError::Engine(e) => ServerError::Engine(e),
            crate::node::OpenError::Persistence(e) => ServerError::Persistence(e),
            crate::node::OpenError::Io(e) => ServerError::Io(e),
        }
    }
}

/// A running server.
pub struct Server {
    node: Arc<Node>,
    shutdown: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl Server {
    /// Binds the listeners, creates the engine and table 0, and starts serving. Must run inside a
    /// multi-threaded tokio runtime.
    pub async fn start(config: ServerConfig) -> Result<Server, ServerError> {
        config.validate()?;
        let bind = |port: u16, what: &'static str| {
            let addr = SocketAddr::new(config.bind, port);
            async move {
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| ServerError::Bind { addr, what, source })
            }
        };
        let resp_listener = bind(config.resp_port, "RESP").await?;
        let native_listener = if config.native_port != 0 {
            Some(bind(config.native_port, "native protocol").await?)
        } else {
            None
        };
        let admin_listener = if config.admin_port != 0 {
            Some(bind(config.admin_port, "admin HTTP").await?)
        } else {
            None
        };
        let routing_listener = if config.routing_port != 0 && config.coordinator.is_some() {
            Some(bind(config.routing_port, "routing port").await?)
        } else {
            None
        };
        let addresses = Addresses {
            routing: routing_listener
                .as_ref()
                .map(|l| l.local_addr())
                .transpose()?,
            resp: resp_listener.local_addr()?,
            native: native_listener
                .as_ref()
                .map(|l| l.local_addr())
                .transpose()?,
            admin: admin_listener
                .as_ref()
                .map(|l| l.local_addr())
                .transpose()?,
        };

        let coordinator = config.coordinator.clone();
        if coordinator.is_some() && crate::cluster::replication::acks_broken() {
            tracing::error!(
                "RAMLOG_TEST_BREAK_ACKS={}: this server acknowledges writes before its backups hold them (a test of the fault-injection checker); never run it with data you keep",
                crate::cluster::replication::BREAK_ACKS
            );
        }
        // A cluster server streams its tablets' writes to their backups (replication is the
        // engine's write observer) and is a backup itself; the roles exist before the node.
        let roles = match &coordinator {
            Some(_) => Some(Roles::open(&config)?),
            None => None,
        };
        let observer = roles
            .as_ref()
            .map(|r| r.replication.clone() as Arc<dyn ramlog_logmem::WriteObserver>);
        let node = Node::open(config, addresses, observer).await?;
        if let Some(roles) = &roles {
            roles.attach(&node);
        }
        if let (Some(coordinator), Some(roles)) = (coordinator, &roles) {
            let native = addresses.native.ok_or(ServerError::Config(
                crate::node::config::ConfigError::Invalid {
                    field: "native_port",
                    reason: "a cluster server needs its native port (servers talk over it)".into(),
                },
            ))?;
            let member = crate::cluster::Member::join(
                &node,
                roles,
                &coordinator,
                ramlog_cluster::ServerAddresses {
                    resp: addresses.resp,
                    routing: addresses.routing,
                    native,
                    admin: addresses.admin,
                },
            )
            .await?;
            roles.set_member(member.clone());
            crate::front::commands::pubsub::start_broadcast(&node, &member);
            member.start_heartbeats(&node);
        }
        crate::front::commands::start_sweeper(&node, roles.clone());
        crate::front::commands::notify::watch_expiry(&node);
        let (shutdown, _) = watch::channel(false);
        let mut tasks = JoinSet::new();
        if let Some(listener) = routing_listener {
            tasks.spawn(accept_resp(
                listener,
                node.clone(),
                roles.clone(),
                shutdown.subscribe(),
                true,
            ));
        }
        tasks.spawn(accept_resp(
            resp_listener,
            node.clone(),
            roles.clone(),
            shutdown.subscribe(),
            false,
        ));
        if let Some(listener) = native_listener {
            let native_config = Arc::new(NativeConfig::from_server(&node.config));
            tasks.spawn(accept_native(
                listener,
                node.clone(),
                roles.clone(),
                native_config,
                shutdown.subscribe(),
            ));
        }
        if let Some(listener) = admin_listener {
            tasks.spawn(admin::serve(listener, node.clone(), shutdown.subscribe()));
        }
        tracing::info!(resp = %addresses.resp, native = ?addresses.native, admin = ?addresses.admin, "server started");
        Ok(Server {
            node,
            shutdown,
            tasks,
        })
    }

    pub fn addresses(&self) -> Addresses {
        self.node.addresses()
    }

    /// The service layer every connection of this server calls.
    pub fn node(&self) -> &Arc<Node> {
        &self.node
    }

    /// Ends when a client sent SHUTDOWN.
    pub async fn shutdown_requested(&self) {
        self.node.shutdown_requested().await
    }

    /// Stops accepting, closes every connection, and stops the engine's background threads.
    pub async fn shutdown(mut self) {
        // A script that runs stops at its next check (as SHUTDOWN stops it): otherwise its
        // connection's task never ends, and neither does the server.
        self.node.scripts.running.stop();
        let _ = self.shutdown.send(true);
        while self.tasks.join_next().await.is_some() {}
        self.node.stop().await;
        tracing::info!("server stopped");
    }
}

/// Counts a connection for as long as it lives.
struct ConnectionGuard(Arc<Node>);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0
            .metrics
            .connections_current
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// Takes a connection slot, or refuses the connection with Redis's error when all are taken.
fn admit(shared: &Arc<Node>) -> Option<ConnectionGuard> {
    let current = shared
        .metrics
        .connections_current
        .fetch_add(1, Ordering::Relaxed);
    if current >= shared.config.connections_max as u64 {
        shared
            .metrics
            .connections_current
            .fetch_sub(1, Ordering::Relaxed);
        Metrics::add(&shared.metrics.connections_rejected, 1);
        return None;
    }
    Metrics::add(&shared.metrics.connections_total, 1);
    Some(ConnectionGuard(shared.clone()))
}

async fn refuse(mut stream: TcpStream, message: &'static [u8]) {
    let _ =
        tokio::time::timeout(std::time::Duration::from_secs(1), stream.write_all(message)).await;
}

/// Accepts RESP connections: the RESP port's, or the routing port's (`routing`).
async fn accept_resp(
    listener: TcpListener,
    shared: Arc<Node>,
    cluster: Option<Arc<Roles>>,
    mut shutdown: watch::Receiver<bool>,
    routing: bool,
) {
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => break,
        };
        while connections.try_join_next().is_some() {}
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors and the like: back off briefly instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(guard) = admit(&shared) else {
            tokio::spawn(refuse(stream, b"-ERR max number of clients reached\r\n"));
            continue;
        };
        let id = shared.next_client_id();
        let conn_shared = shared.clone();
        let cluster = cluster.clone();
        connections.spawn(async move {
            let _guard = guard;
            let ending = if routing {
                crate::front::routing::serve_routing(stream, conn_shared, cluster, id).await
            } else {
                resp_conn::serve_resp(stream, conn_shared, cluster, id).await
            };
            tracing::debug!(client = id, routing, ?ending, "connection closed");
        });
    }
    connections.shutdown().await;
}

async fn accept_native(
    listener: TcpListener,
    shared: Arc<Node>,
    cluster: Option<Arc<Roles>>,
    native_config: Arc<NativeConfig>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => break,
        };
        while connections.try_join_next().is_some() {}
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(guard) = admit(&shared) else {
            tokio::spawn(refuse_native_connection(
                stream,
                "max number of clients reached",
            ));
            continue;
        };
        let node = shared.clone();
        let cluster = cluster.clone();
        let native_config = native_config.clone();
        connections.spawn(async move {
            let _guard = guard;
            serve_native_connection(stream, node, cluster, native_config).await;
        });
    }
    connections.shutdown().await;
}
