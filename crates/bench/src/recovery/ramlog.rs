//! Driving a ramlog cluster: a coordinator and its servers as child processes of this binary,
//! the `ramlog` tool commands, and the cluster status as `ramlog cluster status --json` shows it.

use super::client::text;
use super::process::{wait_until, Proc};
use crate::resp::free_port;
use anyhow::{bail, Context};
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longest a `ramlog` tool command (`cluster status`, `table set-mode`) may take.
const TOOL_LIMIT: Duration = Duration::from_secs(20);
/// Longest a ramlog process may take to print its `ready` line.
const START_LIMIT: Duration = Duration::from_secs(30);
/// Backups per tablet of the default table.
pub(super) const REPLICAS: u32 = 2;

/// The last lines of a log file, for error messages.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

/// Starts `ramlog <args>` (stderr to `log`) and waits, at most [`START_LIMIT`], for its first
/// stdout line, which must say `ready`; the rest of its stdout is drained.
fn spawn_ramlog(args: &[String], log: &Path) -> anyhow::Result<Proc> {
    let exe = std::env::current_exe().context("locating the ramlog binary")?;
    let name = args.first().cloned().unwrap_or_default();
    let mut proc = Proc(
        Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?)
            .spawn()
            .with_context(|| format!("starting ramlog {name}"))?,
    );
    let out = proc.0.stdout.take().context("no stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(out);
        let mut line = String::new();
        let _ = reader.read_line(&mut line);
        let _ = tx.send(line);
        let _ = io::copy(&mut reader, &mut io::sink());
    });
    match rx.recv_timeout(START_LIMIT) {
        Ok(line) if line.contains("ready") => Ok(proc),
        Ok(line) => bail!("ramlog {name} did not start: {line:?} ({})", log_tail(log)),
        Err(_) => bail!(
            "ramlog {name} printed no ready line within {START_LIMIT:?} ({})",
            log_tail(log)
        ),
    }
}

/// Runs `ramlog <args>` to its end, for at most `limit`; its stdout.
pub(super) fn run_tool(args: &[&str], limit: Duration) -> anyhow::Result<String> {
    let exe = std::env::current_exe().context("locating the ramlog binary")?;
    let mut proc = Proc(
        Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running ramlog {}", args.join(" ")))?,
    );
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut text = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut text);
            }
            let _ = tx.send(String::from_utf8_lossy(&text).into_owned());
        });
        rx
    };
    let out = drain(
        proc.0
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        proc.0
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + limit;
    let stdout = out
        .recv_timeout(limit)
        .with_context(|| format!("ramlog {} took over {limit:?}", args.join(" ")))?;
    let stderr = err
        .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .unwrap_or_default();
    let status = proc.0.wait()?;
    if !status.success() {
        bail!("ramlog {}: {status}: {}", args.join(" "), stderr.trim());
    }
    Ok(stdout)
}

/// One tablet of the default table, from `ramlog cluster status --json`.
#[derive(Debug, Clone)]
pub(super) struct TabletState {
    pub(super) first_slot: u16,
    pub(super) last_slot: u16,
    pub(super) master: u64,
    pub(super) backups: Vec<u64>,
    /// A move of it to another server is under way.
    pub(super) migrating: bool,
}

/// What the suite reads from `ramlog cluster status --json`.
#[derive(Debug, Clone)]
pub(super) struct ClusterStatus {
    pub(super) map_version: u64,
    pub(super) recovering: u64,
    pub(super) pending: u64,
    /// Recovering tablets (of every table) without a restorer: none of their backups is up.
    pub(super) stuck: u64,
    /// (id, up, RESP address)
    pub(super) servers: Vec<(u64, bool, String)>,
    /// Mode of the default table.
    pub(super) mode: String,
    pub(super) tablets: Vec<TabletState>,
}

fn parse_status(v: &serde_json::Value) -> anyhow::Result<ClusterStatus> {
    let u = |v: &serde_json::Value, what: &str| v.as_u64().with_context(|| format!("no {what}"));
    let servers = v["servers"]
        .as_array()
        .context("no servers")?
        .iter()
        .map(|s| {
            Ok((
                u(&s["id"], "server id")?,
                s["state"].as_str() == Some("up"),
                s["addresses"]["resp"].as_str().unwrap_or("").to_string(),
            ))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let table = v["tables"]
        .as_array()
        .context("no tables")?
        .iter()
        .find(|t| t["name"].as_str() == Some("default"));
    let (mode, tablets) = match table {
        Some(t) => (
            t["mode"].as_str().unwrap_or("").to_string(),
            t["tablets"]
                .as_array()
                .context("no tablets")?
                .iter()
                .map(|tb| {
                    Ok(TabletState {
                        first_slot: u(&tb["first_slot"], "first_slot")? as u16,
                        last_slot: u(&tb["last_slot"], "last_slot")? as u16,
                        master: u(&tb["master"], "master")?,
                        backups: tb["backups"]
                            .as_array()
                            .map(|b| b.iter().filter_map(|x| x.as_u64()).collect())
                            .unwrap_or_default(),
                        migrating: !tb["migration"].is_null(),
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?,
        ),
        None => (String::new(), Vec::new()),
    };
    let mut stuck = 0;
    for t in v["tables"].as_array().into_iter().flatten() {
        for tb in t["tablets"].as_array().into_iter().flatten() {
            if tb["recovering"].as_bool() == Some(true) && tb["restorer"].is_null() {
                stuck += 1;
            }
        }
    }
    Ok(ClusterStatus {
        stuck,
        map_version: u(&v["map_version"], "map_version")?,
        recovering: u(&v["recovering_tablets"], "recovering_tablets")?,
        pending: u(&v["pending_copies"], "pending_copies")?,
        servers,
        mode,
        tablets,
    })
}

/// `ramlog cluster status --json` through `coordinator`.
pub(super) fn cluster_status(coordinator: &str) -> anyhow::Result<ClusterStatus> {
    let out = run_tool(
        &["cluster", "status", "--json", "--coordinator", coordinator],
        TOOL_LIMIT,
    )?;
    let value: serde_json::Value =
        serde_json::from_str(&out).context("parsing ramlog cluster status --json")?;
    parse_status(&value)
}

/// `cluster_current_epoch` (the map version a server serves) from CLUSTER INFO on `addr`.
fn map_epoch(addr: &str) -> anyhow::Result<u64> {
    text(addr, &["CLUSTER", "INFO"])?
        .lines()
        .find_map(|l| l.strip_prefix("cluster_current_epoch:"))
        .and_then(|v| v.trim().parse().ok())
        .context("no cluster_current_epoch in CLUSTER INFO")
}

/// One server of a [`RamlogCluster`].
pub(super) struct RamlogServer {
    pub(super) proc: Proc,
    pub(super) resp: String,
    pub(super) routing: String,
    pub(super) native: String,
}

/// A coordinator and its servers, each a child process; all killed -9 when dropped (the servers
/// first: fields drop in order).
pub(super) struct RamlogCluster {
    pub(super) servers: Vec<RamlogServer>,
    _coordinator: Proc,
    pub(super) coordinator: String,
}

impl RamlogCluster {
    /// Starts a coordinator (`--initial-servers servers --default-replicas 2 --load-min-ops 0
    /// --split-mib 0`, default detection)
    /// and `servers` servers of `memory_mib` MiB each under `dir` (the default table `sync`).
    /// Returns once every server serves the whole map and no tablet recovers or waits for a copy.
    pub(super) fn start(
        dir: &Path,
        servers: usize,
        memory_mib: u64,
    ) -> anyhow::Result<RamlogCluster> {
        std::fs::create_dir_all(dir)?;
        let coord_port = free_port()?;
        let coordinator = format!("127.0.0.1:{coord_port}");
        let args: Vec<String> = [
            "coordinator",
            "--id",
            "1",
            "--listen",
            &coordinator,
            "--members",
            &format!("1={coordinator}"),
            "--data-dir",
            &dir.join("coordinator").display().to_string(),
            "--initial-servers",
            &servers.to_string(),
            "--default-replicas",
            &REPLICAS.to_string(),
            // Balancing by load is off: a preload makes one server hot on purpose, and a run
            // measures the recovery or the move it starts, not moves the leader would add.
            "--load-min-ops",
            "0",
            // Nor does the leader split or merge tablets by itself: the split runs measure the
            // split and the merge they ask for.
            "--split-mib",
            "0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut args = args;
        // The recovery partition's size in objects, where a run sets it (the default otherwise).
        if let Ok(objects) = std::env::var("RAMLOG_BENCH_RECOVERY_PARTITION_OBJECTS") {
            args.extend(["--recovery-partition-objects".to_string(), objects]);
        }
        let coordinator_proc = spawn_ramlog(&args, &dir.join("coordinator.log"))?;
        let mut list = Vec::new();
        for i in 0..servers {
            let (resp, routing, native) = (free_port()?, free_port()?, free_port()?);
            let args: Vec<String> = [
                "server",
                "--coordinator",
                &coordinator,
                "--resp-port",
                &resp.to_string(),
                "--routing-port",
                &routing.to_string(),
                "--native-port",
                &native.to_string(),
                "--admin-port",
                "0",
                "--data-dir",
                &dir.join(format!("server-{i}")).display().to_string(),
                "--memory",
                &format!("{memory_mib}MiB"),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let proc = spawn_ramlog(&args, &dir.join(format!("server-{i}.log")))?;
            list.push(RamlogServer {
                proc,
                resp: format!("127.0.0.1:{resp}"),
                routing: format!("127.0.0.1:{routing}"),
                native: format!("127.0.0.1:{native}"),
            });
        }
        let cluster = RamlogCluster {
            servers: list,
            _coordinator: coordinator_proc,
            coordinator,
        };
        for s in &cluster.servers {
            wait_until(
                &format!("ramlog server {} did not say cluster_state:ok", s.resp),
                Duration::from_secs(30),
                || Ok(text(&s.resp, &["CLUSTER", "INFO"])?.contains("cluster_state:ok")),
            )?;
        }
        cluster.wait_settled(servers)?;
        Ok(cluster)
    }

    /// Switches the default table to `mode` (if it is not in it already) and waits until every
    /// server serves the map that says so.
    pub(super) fn set_mode(&self, mode: &str) -> anyhow::Result<()> {
        if self.status()?.mode == mode {
            return Ok(());
        }
        run_tool(
            &[
                "table",
                "set-mode",
                "default",
                mode,
                "--coordinator",
                &self.coordinator,
            ],
            TOOL_LIMIT,
        )?;
        wait_until(
            &format!("the servers did not apply the map that sets mode {mode}"),
            Duration::from_secs(30),
            || {
                let st = self.status()?;
                if st.mode != mode {
                    return Ok(false);
                }
                for s in &self.servers {
                    if map_epoch(&s.resp)? < st.map_version {
                        return Ok(false);
                    }
                }
                Ok(true)
            },
        )
    }

    pub(super) fn status(&self) -> anyhow::Result<ClusterStatus> {
        cluster_status(&self.coordinator)
    }

    /// Until `servers` servers are up, the default table is placed, and no tablet recovers or
    /// waits for a copy.
    fn wait_settled(&self, servers: usize) -> anyhow::Result<()> {
        wait_until(
            "the ramlog cluster did not settle",
            Duration::from_secs(30),
            || {
                let st = self.status()?;
                Ok(st.servers.iter().filter(|s| s.1).count() == servers
                    && !st.tablets.is_empty()
                    && st.recovering == 0
                    && st.pending == 0)
            },
        )
    }
}

/// Writes `ramlog cluster status --json` to `path`, for a failed run's logs (best effort).
pub(super) fn save_status(coordinator: &str, path: &Path) {
    if let Ok(text) = run_tool(
        &["cluster", "status", "--json", "--coordinator", coordinator],
        TOOL_LIMIT,
    ) {
        let _ = std::fs::write(path, text);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cluster_status() {
        let json = serde_json::json!({
            "map_version": 9,
            "recovering_tablets": 1,
            "pending_copies": 2,
            "servers": [
                {"id": 1, "state": "dead", "epoch": 2,
                 "addresses": {"resp": "127.0.0.1:7001", "routing": null, "native": null, "admin": null}},
                {"id": 2, "state": "up", "epoch": 1,
                 "addresses": {"resp": "127.0.0.1:7002", "routing": null, "native": null, "admin": null}}
            ],
            "tables": [{"name": "default", "mode": "sync", "tablets": [
                {"first_slot": 0, "last_slot": 8191, "master": 1, "backups": [2], "epoch": 2,
                 "recovering": true, "restorer": null, "pending": [], "fresh": []},
                {"first_slot": 8192, "last_slot": 16383, "master": 2, "backups": [3, 4], "epoch": 1,
                 "recovering": false, "restorer": null, "pending": [3, 4], "fresh": []}
            ]}]
        });
        let st = parse_status(&json).unwrap();
        assert_eq!(
            (st.map_version, st.recovering, st.pending, st.stuck),
            (9, 1, 2, 1)
        );
        assert_eq!(st.servers[0], (1, false, "127.0.0.1:7001".to_string()));
        assert!(st.servers[1].1);
        assert_eq!(st.mode, "sync");
        assert_eq!(st.tablets[1].first_slot, 8192);
        assert_eq!(st.tablets[1].backups, vec![3, 4]);
        assert!(parse_status(&serde_json::json!({"servers": []})).is_err());
    }
}
