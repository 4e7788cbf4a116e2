//! The `ramlog server` subcommand: flags and environment variables, the runtime, and Ctrl-C
//! handling (`ramlog up`, which starts a cluster of such processes, is [`crate::up`]). The binary
//! only forwards to [`run_server`] and [`crate::up::run_up`].

use crate::node::config::{ConfigOverrides, CpuScheduling, PersistenceMode, ServerConfig};
use crate::server::Server;
use anyhow::Context;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Flags shared by `ramlog server` and `ramlog up`. Each may also come from the environment
/// variable named beside it; flags win over the environment, which wins over the config file.
#[derive(clap::Args, Debug, Clone)]
pub struct ServerFlags {
    /// TOML configuration file (see docs/operations.md).
    #[arg(long, env = "RAMLOG_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on (default 127.0.0.1).
    #[arg(long, env = "RAMLOG_BIND")]
    pub bind: Option<IpAddr>,
    /// RESP (Redis protocol) port (default 6380).
    #[arg(long, env = "RAMLOG_RESP_PORT")]
    pub resp_port: Option<u16>,
    /// Native protocol port (default 7380; 0 = off).
    #[arg(long, env = "RAMLOG_NATIVE_PORT")]
    pub native_port: Option<u16>,
    /// Admin HTTP port (default 8380; 0 = off).
    #[arg(long, env = "RAMLOG_ADMIN_PORT")]
    pub admin_port: Option<u16>,
    /// Data directory (default ./ramlog-data).
    #[arg(long, env = "RAMLOG_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Memory budget, e.g. 2GiB (default 1GiB).
    #[arg(long, env = "RAMLOG_MEMORY", value_parser = parse_size)]
    pub memory: Option<u64>,
    /// Require this password (AUTH); empty = no password.
    #[arg(long, env = "RAMLOG_PASSWORD", hide_env_values = true)]
    pub password: Option<String>,
    /// Most simultaneous client connections (default 10000).
    #[arg(long, env = "RAMLOG_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Close connections idle this many seconds (default 0 = never).
    #[arg(long, env = "RAMLOG_IDLE_TIMEOUT")]
    pub idle_timeout: Option<u64>,
    /// Worker threads (default 2).
    #[arg(long, env = "RAMLOG_WORKERS")]
    pub workers: Option<usize>,
    /// Persistence: off, async (flushed every 100 ms) or durable (fdatasync before the reply).
    #[arg(long, env = "RAMLOG_PERSISTENCE")]
    pub persistence: Option<PersistenceMode>,
    /// Join the cluster of these coordinator members (`host:port,...`); unset = standalone.
    #[arg(long, env = "RAMLOG_COORDINATOR")]
    pub coordinator: Option<String>,
    /// Routing port (cluster mode): RESP for any client and any key (default 0 = off).
    #[arg(long, env = "RAMLOG_ROUTING_PORT")]
    pub routing_port: Option<u16>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    ramlog_common::parse_size_bytes(s).map_err(|e| e.to_string())
}

impl ServerFlags {
    pub fn load(&self) -> anyhow::Result<ServerConfig> {
        let overrides = ConfigOverrides {
            bind: self.bind,
            resp_port: self.resp_port,
            native_port: self.native_port,
            admin_port: self.admin_port,
            data_dir: self.data_dir.clone(),
            memory_bytes: self.memory,
            password: self.password.clone(),
            connections_max: self.max_connections,
            idle_timeout_secs: self.idle_timeout,
            worker_threads: self.workers,
            persistence: self.persistence,
            coordinator: self.coordinator.clone(),
            routing_port: self.routing_port,
        };
        Ok(ServerConfig::load(self.config.as_deref(), &overrides)?)
    }
}

/// Listening beyond loopback without a password lets anyone on the network read and write.
fn warn_if_exposed(config: &ServerConfig) {
    if !config.bind.is_loopback() && config.password.is_none() {
        eprintln!(
            "warning: listening on {} without a password: anyone who can reach this address can read and \
             write every key (set `password`, --password or RAMLOG_PASSWORD)",
            config.bind
        );
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("RAMLOG_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Applies `cpu_scheduling` to the calling thread before any other thread exists: threads inherit
/// their creator's policy, so the runtime's workers and the engine's and persistence's background
/// threads all get it.
fn apply_cpu_scheduling(policy: CpuScheduling) {
    #[cfg(target_os = "linux")]
    {
        let which = match policy {
            CpuScheduling::Batch => libc::SCHED_BATCH,
            CpuScheduling::Normal => libc::SCHED_OTHER,
        };
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param for both policies.
        if unsafe { libc::sched_setscheduler(0, which, &param) } != 0 {
            tracing::warn!(
                ?policy,
                error = %std::io::Error::last_os_error(),
                "cannot set the CPU scheduling policy; keeping the default"
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = policy;
}

fn runtime(config: &ServerConfig) -> anyhow::Result<tokio::runtime::Runtime> {
    apply_cpu_scheduling(config.cpu_scheduling);
    crate::node::tune_allocator();
    let spin = Duration::from_micros(config.worker_idle_spin_us);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.worker_threads)
        .thread_name("ramlog-worker")
        // A worker about to sleep first stays runnable for `spin`. A request arriving meanwhile
        // is not seen until the spin ends (the runtime polls no sockets in this hook), but its
        // poll then returns at once: no wake-up, which the client's send would pay for. The
        // spin yields rather than busy-waits, so a client or the other worker that shares the
        // core runs instead whenever it has work (docs/operations.md, "Idle spin").
        .on_thread_park(move || {
            if !spin.is_zero() {
                let started = Instant::now();
                while started.elapsed() < spin {
                    std::thread::yield_now();
                }
            }
        })
        .enable_all()
        .build()
        .context("starting the runtime")
}

/// Registers for Ctrl-C (SIGINT) and SIGTERM at once, and returns a future that ends on either.
/// Registering before the server reports ready means a signal sent right after "ready" is not lost.
#[cfg(unix)]
fn stop_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut terminate =
        signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    })
}

#[cfg(not(unix))]
fn stop_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}

/// `ramlog server`: one server process until Ctrl-C or SIGTERM.
pub fn run_server(flags: &ServerFlags) -> anyhow::Result<()> {
    init_logging();
    let config = flags.load()?;
    warn_if_exposed(&config);
    let rt = runtime(&config)?;
    rt.block_on(async {
        let stop = stop_signal()?;
        let server = Server::start(config).await?;
        let a = server.addresses();
        // One line that scripts and tests can wait for.
        println!(
            "ramlog server ready resp={} native={} admin={} pid={}",
            a.resp,
            a.native
                .map(|x| x.to_string())
                .unwrap_or_else(|| "off".into()),
            a.admin
                .map(|x| x.to_string())
                .unwrap_or_else(|| "off".into()),
            std::process::id()
        );
        tokio::select! {
            _ = stop => {}
            _ = server.shutdown_requested() => {}
        }
        let failure = server.node().failure();
        server.shutdown().await;
        match failure {
            Some(reason) => Err(anyhow::anyhow!("the server stopped: {reason}")),
            None => anyhow::Ok(()),
        }
    })
}
