//! `ramlog up`: a whole local cluster on this machine: coordinator members and servers, each a
//! child process of this binary with its own data directory under the data directory
//! (`coordinator-<j>/`, `server-<i>/`).
//!
//! Ports are bases: server i listens on base + i of each (a base of 0 picks free ports), and the
//! coordinator members on `coordinator_port` + j. `up` waits until every process is ready and the
//! default table is placed, prints how to connect, and stops every child on Ctrl-C or SIGTERM. A
//! child that exits on its own is reported at once and not restarted.
//!
//! `ramlog up --add N` (same data directory) adds N servers to the cluster such an `up` runs:
//! it reads the coordinator members from `<data dir>/up.json` (which `up` writes), starts the
//! servers as its own children (the next free `server-<i>/` directories and ports), asks the
//! coordinator to rebalance (the new servers take a fair share of the tablets, which move while
//! clients go on), and on Ctrl-C drains them (their tablets move back to the others) before
//! they stop.

use crate::cli::ServerFlags;
use anyhow::{bail, Context};
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Flags of `ramlog up` on top of the server flags.
#[derive(clap::Args, Debug, Clone)]
pub struct UpFlags {
    #[command(flatten)]
    pub server: ServerFlags,
    /// Servers to start.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=100))]
    pub servers: u16,
    /// Coordinator members (1, or 3 to survive the loss of one).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=5))]
    pub coordinators: u16,
    /// First coordinator member's port (member j listens on this + j - 1; 0 = free ports).
    #[arg(long, default_value_t = 9380)]
    pub coordinator_port: u16,
    /// Replication mode of the default table: async, sync (default) or durable.
    #[arg(long)]
    pub mode: Option<String>,
    /// Backups per tablet of the default table (default: 2 with 3 servers, 3 from 4).
    #[arg(long)]
    pub replicas: Option<u32>,
    /// Adds this many servers to the cluster a `ramlog up` with the same --data-dir runs: they
    /// join, take a fair share of the tablets (which move while clients go on), and are drained
    /// and stopped on Ctrl-C.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=100))]
    pub add: Option<u16>,
}

/// What `ramlog up` writes to `<data dir>/up.json` for `ramlog up --add`.
#[derive(serde::Serialize, serde::Deserialize)]
struct UpFile {
    coordinators: Vec<String>,
    servers: u16,
}

/// Default base ports of `ramlog up`: the routing port of server 0 is 6380, so that
/// `redis-cli -p 6380` works for any key as with a single server.
const ROUTING_BASE: u16 = 6380;
const RESP_BASE: u16 = 7000;
const NATIVE_BASE: u16 = 7380;
const ADMIN_BASE: u16 = 8380;

/// A port nothing listens on now (for a base of 0).
fn free_port(bind: IpAddr) -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind(SocketAddr::new(bind, 0))?;
    Ok(listener.local_addr()?.port())
}

fn port(bind: IpAddr, base: u16, i: u16) -> anyhow::Result<u16> {
    if base == 0 {
        free_port(bind)
    } else {
        base.checked_add(i)
            .with_context(|| format!("port {base} + {i} is above 65535"))
    }
}

struct Process {
    name: String,
    child: Child,
}

/// Starts a child and waits (bounded) for its `ready` line; its later output is passed through.
fn spawn(name: &str, mut command: Command, timeout: Duration) -> anyhow::Result<(Process, String)> {
    command.stdout(Stdio::piped()).stderr(Stdio::inherit());
    let mut child = command
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().context("child stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    let label = name.to_string();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        if let Some(Ok(first)) = lines.next() {
            let _ = tx.send(first);
        }
        for line in lines.map_while(Result::ok) {
            println!("[{label}] {line}");
        }
    });
    match rx.recv_timeout(timeout) {
        Ok(line) if line.contains("ready") => Ok((
            Process {
                name: name.to_string(),
                child,
            },
            line,
        )),
        other => {
            let _ = child.kill();
            let status = child.wait().ok();
            bail!(
                "{name} did not start (first line {:?}, exit {:?}); its errors are above",
                other.ok(),
                status
            )
        }
    }
}

fn stop_all(processes: &mut [Process]) {
    for p in processes.iter() {
        // SAFETY: kill(2) with a pid this process spawned and has not reaped yet.
        unsafe {
            libc::kill(p.child.id() as libc::pid_t, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    for p in processes.iter_mut() {
        loop {
            match p.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    eprintln!("{} did not stop in time; killing it", p.name);
                    let _ = p.child.kill();
                    let _ = p.child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

fn data_dir_of(flags: &ServerFlags) -> PathBuf {
    flags
        .data_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("./ramlog-data"))
}

/// The command that starts server `i` of a local cluster.
fn server_command(
    exe: &Path,
    s: &ServerFlags,
    bind: IpAddr,
    coordinator: &str,
    a: &Addresses,
    data_dir: &Path,
    i: u16,
) -> Command {
    let mut c = Command::new(exe);
    c.arg("server")
        .args(["--coordinator", coordinator])
        .args(["--bind", &bind.to_string()])
        .args(["--resp-port", &a.resp.to_string()])
        .args(["--routing-port", &a.routing.to_string()])
        .args(["--native-port", &a.native.to_string()])
        .args(["--admin-port", &a.admin.unwrap_or(0).to_string()])
        .arg("--data-dir")
        .arg(data_dir.join(format!("server-{i}")));
    if let Some(config) = &s.config {
        c.arg("--config").arg(config);
    }
    if let Some(m) = s.memory {
        c.args(["--memory", &m.to_string()]);
    }
    if let Some(w) = s.workers {
        c.args(["--workers", &w.to_string()]);
    }
    if let Some(n) = s.max_connections {
        c.args(["--max-connections", &n.to_string()]);
    }
    if let Some(t) = s.idle_timeout {
        c.args(["--idle-timeout", &t.to_string()]);
    }
    if let Some(p) = &s.password {
        c.env("RAMLOG_PASSWORD", p);
    }
    c
}

/// The addresses of server `i` from the bases of the flags.
fn addresses(s: &ServerFlags, bind: IpAddr, i: u16) -> anyhow::Result<Addresses> {
    Ok(Addresses {
        routing: port(bind, s.routing_port.unwrap_or(ROUTING_BASE), i)?,
        resp: port(bind, s.resp_port.unwrap_or(RESP_BASE), i)?,
        native: port(bind, s.native_port.unwrap_or(NATIVE_BASE), i)?,
        admin: match s.admin_port.unwrap_or(ADMIN_BASE) {
            0 if s.admin_port == Some(0) => None,
            base => Some(port(bind, base, i)?),
        },
    })
}

/// `ramlog up`: see the module comment.
pub fn run_up(flags: &UpFlags) -> anyhow::Result<()> {
    if let Some(n) = flags.add {
        return run_add(flags, n);
    }
    let s = &flags.server;
    // The flags are checked once, as a server would, before anything starts.
    let config = s.load()?;
    let bind = config.bind;
    let data_dir = data_dir_of(s);
    std::fs::create_dir_all(&data_dir)
        .with_context(|| format!("creating data directory {}", data_dir.display()))?;
    let exe = std::env::current_exe().context("locating the ramlog binary")?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook_consts::SIGINT, signal_hook_consts::SIGTERM] {
        register_stop(signal, &stop)?;
    }
    let mut processes: Vec<Process> = Vec::new();
    let started = (|| -> anyhow::Result<(Vec<String>, Vec<Addresses>)> {
        let mut members = Vec::new();
        for j in 1..=flags.coordinators {
            members.push((
                j,
                SocketAddr::new(bind, port(bind, flags.coordinator_port, j - 1)?),
            ));
        }
        let member_list = members
            .iter()
            .map(|(j, a)| format!("{j}={a}"))
            .collect::<Vec<_>>()
            .join(",");
        for (j, addr) in &members {
            let mut c = Command::new(&exe);
            c.arg("coordinator")
                .args(["--id", &j.to_string()])
                .args(["--listen", &addr.to_string()])
                .args(["--members", &member_list])
                .args(["--initial-servers", &flags.servers.to_string()])
                .args(
                    flags
                        .mode
                        .iter()
                        .flat_map(|m| ["--default-mode", m.as_str()]),
                )
                .args(
                    flags
                        .replicas
                        .iter()
                        .flat_map(|r| ["--default-replicas".to_string(), r.to_string()]),
                )
                .arg("--data-dir")
                .arg(data_dir.join(format!("coordinator-{j}")));
            let (p, _) = spawn(&format!("coordinator {j}"), c, Duration::from_secs(30))?;
            processes.push(p);
        }
        let coordinator = members
            .iter()
            .map(|(_, a)| a.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let mut servers = Vec::new();
        for i in 0..flags.servers {
            let a = addresses(s, bind, i)?;
            let c = server_command(&exe, s, bind, &coordinator, &a, &data_dir, i);
            let (p, _) = spawn(&format!("server {i}"), c, Duration::from_secs(60))?;
            processes.push(p);
            servers.push(a);
        }
        Ok((
            members.iter().map(|(_, a)| a.to_string()).collect(),
            servers,
        ))
    })();
    let (members, servers) = match started {
        Ok(x) => x,
        Err(e) => {
            stop_all(&mut processes);
            return Err(e);
        }
    };
    let cluster_ports: Vec<u16> = servers.iter().map(|a| a.resp).collect();
    if let Err(e) = wait_for_placement(&members, flags.servers as usize, &stop)
        .and_then(|()| wait_for_servers(bind, &cluster_ports, &stop))
    {
        stop_all(&mut processes);
        return Err(e);
    }
    let up_file = UpFile {
        coordinators: members.clone(),
        servers: flags.servers,
    };
    if let Err(e) = std::fs::write(
        data_dir.join("up.json"),
        serde_json::to_vec_pretty(&up_file).unwrap_or_default(),
    ) {
        eprintln!(
            "ramlog up: cannot write up.json (ramlog up --add will not find this cluster): {e}"
        );
    }
    print_banner(flags, &config, &data_dir, &members, &servers);
    // Until Ctrl-C: report any child that exits on its own (it is not restarted).
    let mut reported = vec![false; processes.len()];
    while !stop.load(Ordering::Acquire) {
        for (k, p) in processes.iter_mut().enumerate() {
            if reported[k] {
                continue;
            }
            if let Ok(Some(status)) = p.child.try_wait() {
                eprintln!(
                    "ramlog up: {} (pid {}) exited with {status}; it is not restarted",
                    p.name,
                    p.child.id()
                );
                reported[k] = true;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("stopping...");
    stop_all(&mut processes);
    println!("stopped");
    Ok(())
}

#[derive(Clone, Copy)]
struct Addresses {
    routing: u16,
    resp: u16,
    native: u16,
    admin: Option<u16>,
}

/// Waits until the coordinator placed the default table on all servers (bounded).
fn wait_for_placement(members: &[String], servers: usize, stop: &AtomicBool) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client =
        ramlog_cluster::rpc::CoordinatorClient::new(members.to_vec(), Duration::from_secs(2));
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while Instant::now() < deadline && !stop.load(Ordering::Acquire) {
        match rt.block_on(client.map()) {
            Ok(map)
                if map.table(ramlog_cluster::DEFAULT_TABLE).is_some()
                    && map.up_servers().count() >= servers =>
            {
                return Ok(())
            }
            Ok(map) => last = format!("{} of {servers} servers up", map.up_servers().count()),
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("the cluster did not come up: {last}")
}

/// Waits until every server serves a map in which all slots have a master (bounded).
fn wait_for_servers(bind: IpAddr, ports: &[u16], stop: &AtomicBool) -> anyhow::Result<()> {
    use std::io::{Read, Write};
    let deadline = Instant::now() + Duration::from_secs(30);
    for &port in ports {
        loop {
            let ok = (|| -> std::io::Result<bool> {
                let mut s = std::net::TcpStream::connect(SocketAddr::new(bind, port))?;
                s.set_read_timeout(Some(Duration::from_secs(2)))?;
                s.write_all(b"CLUSTER INFO\r\n")?;
                let mut buf = [0u8; 2048];
                let n = s.read(&mut buf)?;
                Ok(String::from_utf8_lossy(&buf[..n]).contains("cluster_state:ok"))
            })()
            .unwrap_or(false);
            if ok {
                break;
            }
            if Instant::now() >= deadline || stop.load(Ordering::Acquire) {
                bail!("the server on port {port} does not serve the whole map yet");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

fn print_banner(
    flags: &UpFlags,
    config: &crate::ServerConfig,
    data_dir: &Path,
    members: &[String],
    servers: &[Addresses],
) {
    let host = config.bind;
    let loopback = host.is_loopback();
    let h = |port: u16| {
        if loopback {
            format!("-p {port}")
        } else {
            format!("-h {host} -p {port}")
        }
    };
    let auth = if config.password.is_some() {
        " -a <password>"
    } else {
        ""
    };
    println!(
        "ramlog is up: {} servers and {} coordinator{} on this machine",
        flags.servers,
        flags.coordinators,
        if flags.coordinators == 1 { "" } else { "s" }
    );
    let first = servers[0];
    println!(
        "  connect:  redis-cli {}{auth}      (routing port: any client, any key)",
        h(first.routing)
    );
    println!(
        "  cluster:  redis-cli -c {}{auth}   (cluster-aware clients: redis-cli -c, RedisCluster)",
        h(first.resp)
    );
    for (i, a) in servers.iter().enumerate() {
        let admin = a
            .admin
            .map(|p| format!("  admin http://{host}:{p}/status"))
            .unwrap_or_default();
        println!(
            "  server {i}: routing {}  cluster {}  native {}{admin}",
            a.routing, a.resp, a.native
        );
    }
    if let Some(admin) = first.admin {
        println!(
            "  admin:    http://{host}:{admin}/status   (metrics: http://{host}:{admin}/metrics)"
        );
    }
    println!("  coordinator: {}", members.join(","));
    println!(
        "  status:   ramlog cluster status --coordinator {}",
        members.join(",")
    );
    println!("  data:     {}", data_dir.display());
    println!("Press Ctrl-C to stop.");
}

/// Signal numbers (libc's), named for the handler below.
mod signal_hook_consts {
    pub const SIGINT: i32 = libc::SIGINT;
    pub const SIGTERM: i32 = libc::SIGTERM;
}

static STOP_FLAG: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();

extern "C" fn on_stop_signal(_: libc::c_int) {
    if let Some(flag) = STOP_FLAG.get() {
        flag.store(true, Ordering::Release);
    }
}

/// Sets `stop` when `signal` arrives (an async-signal-safe store, nothing else).
fn register_stop(signal: i32, stop: &Arc<AtomicBool>) -> anyhow::Result<()> {
    let _ = STOP_FLAG.set(stop.clone());
    let handler = on_stop_signal as extern "C" fn(libc::c_int);
    // SAFETY: installs a handler that only performs an atomic store, which is async-signal-safe.
    let previous = unsafe { libc::signal(signal, handler as libc::sighandler_t) };
    if previous == libc::SIG_ERR {
        bail!("cannot install the handler for signal {signal}");
    }
    Ok(())
}

/// Runs `ramlog <args>` (this binary) to its end; its stdout, or its error output as the error.
fn run_tool(exe: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running ramlog {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "ramlog {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ramlog up --add n`: see the module comment.
fn run_add(flags: &UpFlags, n: u16) -> anyhow::Result<()> {
    let s = &flags.server;
    let config = s.load()?;
    let bind = config.bind;
    let data_dir = data_dir_of(s);
    let up_path = data_dir.join("up.json");
    let up: UpFile = serde_json::from_slice(&std::fs::read(&up_path).with_context(|| {
        format!(
            "reading {} (is a `ramlog up` with --data-dir {} running?)",
            up_path.display(),
            data_dir.display()
        )
    })?)
    .with_context(|| format!("parsing {}", up_path.display()))?;
    let coordinator = up.coordinators.join(",");
    let exe = std::env::current_exe().context("locating the ramlog binary")?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook_consts::SIGINT, signal_hook_consts::SIGTERM] {
        register_stop(signal, &stop)?;
    }
    let mut processes: Vec<Process> = Vec::new();
    let mut added: Vec<(u16, Addresses)> = Vec::new();
    let started = (|| -> anyhow::Result<()> {
        let mut i = up.servers;
        while added.len() < n as usize {
            if !data_dir.join(format!("server-{i}")).exists() {
                let a = addresses(s, bind, i)?;
                let c = server_command(&exe, s, bind, &coordinator, &a, &data_dir, i);
                let (p, _) = spawn(&format!("server {i}"), c, Duration::from_secs(60))?;
                processes.push(p);
                added.push((i, a));
            }
            i = i.checked_add(1).context("no server index left")?;
        }
        let ports: Vec<u16> = added.iter().map(|(_, a)| a.resp).collect();
        wait_for_servers(bind, &ports, &stop)?;
        run_tool(
            &exe,
            &[
                "cluster",
                "rebalance",
                "--no-wait",
                "--coordinator",
                &coordinator,
            ],
        )?;
        Ok(())
    })();
    if let Err(e) = started {
        stop_all(&mut processes);
        return Err(e);
    }
    println!(
        "ramlog up: {n} server{} added; tablets move to {} while clients go on (ramlog cluster status --coordinator {coordinator})",
        if n == 1 { "" } else { "s" },
        if n == 1 { "it" } else { "them" }
    );
    for (i, a) in &added {
        let admin = a
            .admin
            .map(|p| format!("  admin http://{bind}:{p}/status"))
            .unwrap_or_default();
        println!(
            "  server {i}: routing {}  cluster {}  native {}{admin}",
            a.routing, a.resp, a.native
        );
    }
    println!(
        "Press Ctrl-C to drain {} and stop.",
        if n == 1 { "it" } else { "them" }
    );
    let mut reported = vec![false; processes.len()];
    while !stop.load(Ordering::Acquire) {
        for (k, p) in processes.iter_mut().enumerate() {
            if !reported[k] {
                if let Ok(Some(status)) = p.child.try_wait() {
                    eprintln!(
                        "ramlog up: {} exited with {status}; it is not restarted",
                        p.name
                    );
                    reported[k] = true;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Drain the added servers (their tablets move to the others), then stop them.
    println!("draining...");
    let drained = (|| -> anyhow::Result<()> {
        let status: serde_json::Value = serde_json::from_str(&run_tool(
            &exe,
            &["cluster", "status", "--json", "--coordinator", &coordinator],
        )?)?;
        for (i, a) in &added {
            let resp = SocketAddr::new(bind, a.resp).to_string();
            let id = status["servers"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|s| s["addresses"]["resp"].as_str() == Some(resp.as_str()))
                .and_then(|s| s["id"].as_u64());
            let Some(id) = id else {
                eprintln!("ramlog up: server {i} ({resp}) is not in the cluster map; not drained");
                continue;
            };
            print!(
                "{}",
                run_tool(
                    &exe,
                    &[
                        "cluster",
                        "drain",
                        &id.to_string(),
                        "--coordinator",
                        &coordinator
                    ],
                )?
            );
        }
        Ok(())
    })();
    if let Err(e) = &drained {
        eprintln!("ramlog up: the drain did not finish ({e:#}); stopping the added servers anyway (their tablets recover from their backups)");
    }
    stop_all(&mut processes);
    println!("stopped");
    Ok(())
}
