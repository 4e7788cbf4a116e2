//! The coordinator's command-line tools: `ramlog coordinator` (run one member), `ramlog table`
//! (create, list, drop) and `ramlog cluster status`.
//!
//! Owns: the flags, their defaults and the output formats. Hides: the runtime, the client's
//! retries, and how a server's memory use is fetched from its admin HTTP port.

use crate::service::{Coordinator, CoordinatorConfig};
use anyhow::Context;
use ramlog_cluster::rpc::{
    parse_addresses, unexpected, CoordinatorClient, CoordinatorStatus, Request, Response,
};
use ramlog_cluster::{ClusterMap, ReplicationMode, ServerInfo, ServerState, TabletInfo};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long a tool keeps trying the coordinator members (a leader election takes about a second).
const TOOL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(clap::Args, Debug)]
pub struct CoordinatorArgs {
    /// This member's id (1, 2, ...).
    #[arg(long, default_value_t = 1)]
    pub id: u64,
    /// Address to listen on, for servers, tools and the other members.
    #[arg(long, default_value = "127.0.0.1:9380")]
    pub listen: SocketAddr,
    /// Every member as ID=HOST:PORT, comma-separated (default: just this one at --listen).
    #[arg(long)]
    pub members: Option<String>,
    /// Where the Raft log, vote and snapshots live (default ./ramlog-data/coordinator-ID).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Servers that must register before the default table is placed.
    #[arg(long, default_value_t = 1)]
    pub initial_servers: u32,
    /// Replication mode of the default table (the one RESP clients use) when the cluster is
    /// created: async, sync (default), durable or mirror. `ramlog table set-mode` changes it later.
    #[arg(long, value_parser = parse_mode)]
    pub default_mode: Option<ReplicationMode>,
    /// Backups per tablet of the default table when the cluster is created (default: 2 with 3
    /// servers, 3 from 4).
    #[arg(long)]
    pub default_replicas: Option<u32>,
    /// A server whose heartbeats stop for this long, and which then fails a probe, is declared
    /// dead and its tablets are recovered by their backups. Servers stop serving after 3/4 of it
    /// without an answer from the coordinator (their lease), so that a master cut off from the
    /// coordinator stops before its tablets move.
    #[arg(long, default_value_t = crate::service::DEAD_AFTER_MS)]
    pub dead_after_ms: u64,
    /// A backup that has acknowledged nothing of a master's waiting writes for this long, while
    /// this coordinator still hears from both (a partition between the two alone), is taken out
    /// of that master's tablets and replaced, so that its writes stop waiting for it (0: never).
    #[arg(long, default_value_t = crate::service::CUT_OFF_AFTER_MS)]
    pub cut_off_after_ms: u64,
    /// A dead master's tablet holding more objects than this is recovered as partitions
    /// (slot ranges), restored in parallel by its backups and each served once restored.
    #[arg(long, default_value_t = ramlog_cluster::PartitionSize::default().objects)]
    pub recovery_partition_objects: u64,
    /// The same, in MiB of live data.
    #[arg(long, default_value_t = ramlog_cluster::PartitionSize::default().bytes >> 20)]
    pub recovery_partition_mib: u64,
    /// A tablet whose master reports more live data than this (MiB) is split in two at the
    /// middle of its slots, so that it stays below the servers' `tablet_max_bytes` and its
    /// halves can move apart; 0 turns automatic splits off (`ramlog cluster split` still works).
    #[arg(long, default_value_t = crate::service::SPLIT_MIB)]
    pub split_mib: u64,
    /// Balancing by load: a server whose tablets take more than 1.5 times the servers' mean of
    /// reads and writes per second, and at least this many per second above it, has the tablet
    /// that evens the load best moved to the coolest server (one move at a time, at most one
    /// every 30 s); 0 turns it off.
    #[arg(long, default_value_t = crate::service::LOAD_MIN_OPS)]
    pub load_min_ops: u64,
}

/// Parses `1=host:port,2=host:port`.
pub fn parse_members(list: &str) -> anyhow::Result<BTreeMap<u64, String>> {
    let mut members = BTreeMap::new();
    for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (id, address) = item.split_once('=').with_context(|| {
            format!("bad member {item:?}: expected ID=HOST:PORT, for example 1=127.0.0.1:9380")
        })?;
        let id: u64 = id
            .trim()
            .parse()
            .with_context(|| format!("bad member id {id:?} in {item:?}: expected a number"))?;
        if id == 0 {
            anyhow::bail!("bad member {item:?}: member ids start at 1");
        }
        if members.insert(id, address.trim().to_string()).is_some() {
            anyhow::bail!("member id {id} is listed twice");
        }
    }
    if members.is_empty() {
        anyhow::bail!("the member list is empty");
    }
    Ok(members)
}

impl CoordinatorArgs {
    pub fn config(&self) -> anyhow::Result<CoordinatorConfig> {
        let members = match &self.members {
            Some(list) => parse_members(list)?,
            None => BTreeMap::from([(self.id, self.listen.to_string())]),
        };
        Ok(CoordinatorConfig {
            id: self.id,
            listen: self.listen,
            members,
            data_dir: self
                .data_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from(format!("./ramlog-data/coordinator-{}", self.id))),
            initial_servers: self.initial_servers.max(1),
            default_mode: self.default_mode,
            default_replicas: self.default_replicas,
            snapshot_every: crate::service::SNAPSHOT_EVERY,
            dead_after: Duration::from_millis(self.dead_after_ms.max(50)),
            cut_off_after_ms: self.cut_off_after_ms,
            recovery_partition: ramlog_cluster::PartitionSize {
                objects: self.recovery_partition_objects.max(1),
                bytes: self.recovery_partition_mib.max(1) << 20,
            },
            split_bytes: self.split_mib << 20,
            load_min_ops: self.load_min_ops,
        })
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

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("ramlog-coordinator")
        .enable_all()
        .build()
        .context("starting the runtime")
}

/// `ramlog coordinator`: one member until Ctrl-C or SIGTERM.
pub fn run_coordinator(args: &CoordinatorArgs) -> anyhow::Result<()> {
    init_logging();
    let config = args.config()?;
    let id = config.id;
    runtime()?.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut interrupt =
            signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let mut terminate =
            signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let coordinator = Coordinator::start(config).await?;
        println!(
            "ramlog coordinator ready id={id} listen={} pid={}",
            coordinator.address(),
            std::process::id()
        );
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        coordinator.shutdown().await;
        Ok(())
    })
}

#[derive(clap::Args, Debug)]
pub struct CoordinatorFlag {
    /// Coordinator members to ask, comma-separated HOST:PORT.
    #[arg(
        long,
        env = "RAMLOG_COORDINATOR",
        default_value = "127.0.0.1:9380",
        global = true
    )]
    pub coordinator: String,
}

impl CoordinatorFlag {
    fn client(&self) -> CoordinatorClient {
        CoordinatorClient::new(parse_addresses(&self.coordinator), TOOL_TIMEOUT)
    }
}

#[derive(clap::Args, Debug)]
pub struct TableArgs {
    #[command(subcommand)]
    pub command: TableCommand,
    #[command(flatten)]
    pub coordinator: CoordinatorFlag,
}

#[derive(clap::Subcommand, Debug)]
pub enum TableCommand {
    /// Create a table; its tablets are placed over the live servers.
    Create {
        name: String,
        /// Replication mode: async, sync, durable or mirror.
        #[arg(long, default_value = "sync", value_parser = parse_mode)]
        mode: ReplicationMode,
        /// Backups per tablet (default: 2 with 3 servers, 3 from 4).
        #[arg(long)]
        replicas: Option<u32>,
        /// Typed fields for filtered scans: `NAME:TYPE,...` with types i32, i64, f64, bool,
        /// string, bytes.
        #[arg(long)]
        schema: Option<String>,
    },
    /// List the tables, one per line.
    List,
    /// Drop a table and its tablets.
    Drop { name: String },
    /// Change a table's replication mode (async, sync, durable or mirror); `default` is the table
    /// RESP clients use.
    SetMode {
        name: String,
        #[arg(value_parser = parse_mode)]
        mode: ReplicationMode,
    },
}

fn parse_mode(s: &str) -> Result<ReplicationMode, String> {
    ReplicationMode::parse(s).ok_or_else(|| {
        format!("unknown replication mode {s:?}: expected async, sync, durable or mirror")
    })
}

fn tool_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")
}

/// Prints a tool's error as one line on stderr and exits 1 (no backtrace, no chain: the
/// coordinator's message says it all).
fn exit_on_error(result: anyhow::Result<()>) -> anyhow::Result<()> {
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    Ok(())
}

/// `ramlog table ...`.
pub fn run_table(args: &TableArgs) -> anyhow::Result<()> {
    exit_on_error(table(args))
}

fn table(args: &TableArgs) -> anyhow::Result<()> {
    let client = args.coordinator.client();
    tool_runtime()?.block_on(async {
        match &args.command {
            TableCommand::Create {
                name,
                mode,
                replicas,
                schema,
            } => {
                let schema = schema
                    .as_deref()
                    .map(ramlog_client::cli::parse_schema)
                    .transpose()?
                    .map(|s| s.to_bytes());
                let request = Request::CreateTable {
                    name: name.clone(),
                    mode: *mode,
                    replicas: *replicas,
                    schema,
                };
                let info = match client.call(&request).await? {
                    Response::TableCreated(info) => info,
                    other => return Err(unexpected(&other).into()),
                };
                let map = client.map().await?;
                println!(
                    "created table {} id={} mode={} replicas={} tablets={} map_version={}",
                    info.name,
                    info.id,
                    info.mode,
                    info.replicas,
                    map.tablets_of(info.id).count(),
                    map.version
                );
            }
            TableCommand::List => {
                let map = client.map().await?;
                for t in &map.tables {
                    println!(
                        "{} id={} mode={} replicas={} tablets={}",
                        t.name,
                        t.id,
                        t.mode,
                        t.replicas,
                        map.tablets_of(t.id).count()
                    );
                }
            }
            TableCommand::Drop { name } => {
                let request = Request::DropTable { name: name.clone() };
                match client.call(&request).await? {
                    Response::TableDropped(id) => println!("dropped table {name} id={id}"),
                    other => return Err(unexpected(&other).into()),
                }
            }
            TableCommand::SetMode { name, mode } => {
                let request = Request::SetTableMode {
                    name: name.clone(),
                    mode: *mode,
                };
                match client.call(&request).await? {
                    Response::TableAltered(t) => {
                        println!("table {} id={} mode={}", t.name, t.id, t.mode)
                    }
                    other => return Err(unexpected(&other).into()),
                }
            }
        }
        Ok(())
    })
}

#[derive(clap::Args, Debug)]
pub struct ClusterArgs {
    #[command(subcommand)]
    pub command: ClusterCommand,
    #[command(flatten)]
    pub coordinator: CoordinatorFlag,
}

#[derive(clap::Subcommand, Debug)]
pub enum ClusterCommand {
    /// The cluster at a glance: coordinator members, servers, tables and tablets.
    Status {
        /// Print the structured form as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Moves the tablets of TABLE that hold SLOTS (a slot, or FIRST-LAST) to server ID, one
    /// after another, with writes going on: the target fills from the master's copy and live
    /// stream, then a short switch makes it the master (clients see a pause, then MOVED).
    Move {
        /// The table ("default" is the one RESP clients use).
        table: String,
        /// A slot or a range FIRST-LAST: every tablet holding one of them moves whole.
        slots: String,
        /// The server to move them to.
        #[arg(long)]
        to: u64,
        /// Return once each move is recorded, without waiting for it to finish.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for each tablet's move, in seconds.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
    /// Splits the tablet of TABLE that holds SLOT in two, at slot --at or in the middle of its
    /// slots: its requests wait while its master splits its memory, then both halves serve
    /// (each can move on its own) and are copied afresh to the tablet's backups.
    Split {
        /// The table ("default" is the one RESP clients use).
        table: String,
        /// A slot of the tablet to split.
        slot: String,
        /// The first slot of the upper half (default: the middle of the tablet's slots).
        #[arg(long)]
        at: Option<String>,
        /// Return once the split is recorded, without waiting for it to finish.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for the split, in seconds.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
    },
    /// Merges the tablet of TABLE that holds SLOT with the next one (same master and backups):
    /// the master copies the next tablet into it while both serve, then both pause for a moment
    /// and one tablet of both ranges serves, copied afresh to the backups.
    Merge {
        /// The table ("default" is the one RESP clients use).
        table: String,
        /// A slot of the first of the two tablets.
        slot: String,
        /// Return once the merge is recorded, without waiting for it to finish.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for the merge, in seconds.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
    },
    /// Moves every tablet server ID masters to the others and replaces it in every backup set,
    /// then removes it from the cluster (its process stops).
    Drain {
        /// The server to drain.
        id: u64,
        /// Return once the drain is recorded.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for the drain, in seconds.
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
    },
    /// Moves tablets until every server masters about as many bytes (within 10 % of the mean);
    /// a server that joins starts this by itself.
    Rebalance {
        /// Return once rebalancing is recorded.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for the servers to be balanced, in seconds.
        #[arg(long, default_value_t = 3600)]
        timeout: u64,
    },
}

/// Sends `request` and expects `Noted`.
async fn noted(client: &CoordinatorClient, request: &Request) -> anyhow::Result<()> {
    match client.call(request).await? {
        Response::Noted => Ok(()),
        Response::Error(e) => anyhow::bail!("{e}"),
        other => Err(unexpected(&other).into()),
    }
}

/// Polls the map every 200 ms until `done` says so (Some(line) to print) or `timeout` passes.
async fn wait_for(
    client: &CoordinatorClient,
    timeout: Duration,
    what: &str,
    mut done: impl FnMut(&ramlog_cluster::ClusterMap) -> Option<String>,
) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    loop {
        let map = client.status().await?.map;
        if let Some(line) = done(&map) {
            println!("{line} in {} ms", started.elapsed().as_millis());
            return Ok(());
        }
        anyhow::ensure!(
            started.elapsed() < timeout,
            "{what}: not done after {} s",
            timeout.as_secs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn drain(
    client: &CoordinatorClient,
    id: u64,
    wait: bool,
    timeout: Duration,
) -> anyhow::Result<()> {
    noted(client, &Request::Drain { server: id }).await?;
    if !wait {
        println!("draining server {id}");
        return Ok(());
    }
    wait_for(client, timeout, "the drain", |map| {
        let s = map.server(id)?;
        (s.state == ServerState::Dead).then(|| format!("server {id} drained and removed"))
    })
    .await
}

async fn rebalance(
    client: &CoordinatorClient,
    wait: bool,
    timeout: Duration,
) -> anyhow::Result<()> {
    noted(client, &Request::Rebalance).await?;
    if !wait {
        println!("rebalancing");
        return Ok(());
    }
    wait_for(client, timeout, "rebalancing", |map| {
        let moving = map.tablets.iter().any(|t| t.migration.is_some());
        (!map.rebalancing && !moving).then(|| "servers balanced".to_string())
    })
    .await
}

/// "N" or "A-B" as an inclusive slot range.
fn parse_slots(s: &str) -> anyhow::Result<(u16, u16)> {
    let slot = |x: &str| -> anyhow::Result<u16> {
        let n: u16 = x
            .trim()
            .parse()
            .map_err(|_| anyhow::anyhow!("bad slot {x:?}: slots are 0 to 16383"))?;
        anyhow::ensure!(
            n < ramlog_common::SLOT_COUNT,
            "slot {n} is out of range (0 to 16383)"
        );
        Ok(n)
    };
    let (a, b) = match s.split_once('-') {
        Some((a, b)) => (slot(a)?, slot(b)?),
        None => (slot(s)?, slot(s)?),
    };
    anyhow::ensure!(a <= b, "the range {s} is empty");
    Ok((a, b))
}

/// The cluster map and the id of the table named `table`.
async fn table_map(
    client: &CoordinatorClient,
    table: &str,
) -> anyhow::Result<(ClusterMap, ramlog_common::TableId)> {
    let map = client.status().await?.map;
    let id = map
        .tables
        .iter()
        .find(|t| t.name == table)
        .map(|t| t.id)
        .ok_or_else(|| anyhow::anyhow!("no table named {table:?}"))?;
    Ok((map, id))
}

/// `ramlog cluster move`: one tablet after another.
async fn move_tablets(
    client: &CoordinatorClient,
    table: &str,
    slots: &str,
    to: u64,
    wait: bool,
    timeout: Duration,
) -> anyhow::Result<()> {
    let (first, last) = parse_slots(slots)?;
    let (map, id) = table_map(client, table).await?;
    let tablets: Vec<(u16, u16)> = map
        .tablets_of(id)
        .filter(|t| t.first_slot <= last && t.last_slot >= first)
        .map(|t| (t.first_slot, t.last_slot))
        .collect();
    anyhow::ensure!(
        !tablets.is_empty(),
        "no tablet of {table} holds slots {slots}"
    );
    for (first_slot, last_slot) in tablets {
        let request = Request::MoveTablet {
            table: table.to_string(),
            slot: first_slot,
            target: to,
        };
        match client.call(&request).await? {
            Response::Noted => {}
            Response::Error(e) => anyhow::bail!("slots {first_slot}-{last_slot}: {e}"),
            other => return Err(unexpected(&other).into()),
        }
        if !wait {
            println!("slots {first_slot}-{last_slot}: moving to server {to}");
            continue;
        }
        let started = std::time::Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let map = client.status().await?.map;
            let Some(t) = map.tablet_at(id, first_slot) else {
                anyhow::bail!("slots {first_slot}-{last_slot}: the tablet is gone");
            };
            if t.master == to && t.migration.is_none() {
                println!(
                    "slots {first_slot}-{last_slot}: moved to server {to} in {} ms",
                    started.elapsed().as_millis()
                );
                break;
            }
            if t.migration.is_none() {
                anyhow::bail!(
                    "slots {first_slot}-{last_slot}: the move was abandoned (see the coordinator's log); server {} masters them",
                    t.master
                );
            }
            anyhow::ensure!(
                started.elapsed() < timeout,
                "slots {first_slot}-{last_slot}: still moving after {} s",
                timeout.as_secs()
            );
        }
    }
    Ok(())
}

/// `ramlog cluster merge`.
async fn merge_tablets(
    client: &CoordinatorClient,
    table: &str,
    slot: &str,
    wait: bool,
    timeout: Duration,
) -> anyhow::Result<()> {
    let (slot, _) = parse_slots(slot)?;
    let (map, id) = table_map(client, table).await?;
    let t = map
        .tablet_at(id, slot)
        .ok_or_else(|| anyhow::anyhow!("no tablet of {table} holds slot {slot}"))?;
    let next = map.next_tablet(t).ok_or_else(|| {
        anyhow::anyhow!(
            "no tablet of {table} follows slots {}-{}",
            t.first_slot,
            t.last_slot
        )
    })?;
    let (first, mid, last) = (t.first_slot, next.first_slot, next.last_slot);
    let request = Request::MergeTablets {
        table: table.to_string(),
        slot,
    };
    noted(client, &request)
        .await
        .map_err(|e| anyhow::anyhow!("slots {first}-{last}: {e}"))?;
    if !wait {
        println!("slots {first}-{} and {mid}-{last}: merging", mid - 1);
        return Ok(());
    }
    let mut abandoned = false;
    wait_for(client, timeout, "the merge", |map| {
        let t = map.tablet_at(id, first)?;
        if t.first_slot == first && t.last_slot == last {
            return Some(format!(
                "slots {first}-{} and {mid}-{last}: merged into {first}-{last} (epoch {})",
                mid - 1,
                t.epoch
            ));
        }
        abandoned = t.merge.is_none();
        abandoned.then(|| format!("slots {first}-{last}: the merge was abandoned"))
    })
    .await?;
    anyhow::ensure!(
        !abandoned,
        "the merge was abandoned (see the coordinator's and the master's logs)"
    );
    Ok(())
}

/// `ramlog cluster split`.
async fn split_tablet(
    client: &CoordinatorClient,
    table: &str,
    slot: &str,
    at: Option<&str>,
    wait: bool,
    timeout: Duration,
) -> anyhow::Result<()> {
    let (slot, _) = parse_slots(slot)?;
    let at = at.map(|a| parse_slots(a).map(|(a, _)| a)).transpose()?;
    let (map, id) = table_map(client, table).await?;
    let t = map
        .tablet_at(id, slot)
        .ok_or_else(|| anyhow::anyhow!("no tablet of {table} holds slot {slot}"))?;
    let (first, last) = (t.first_slot, t.last_slot);
    let (start_epoch, master) = (t.epoch, t.master);
    let at = at.unwrap_or_else(|| t.middle_slot());
    let request = Request::SplitTablet {
        table: table.to_string(),
        slot,
        at: Some(at),
    };
    noted(client, &request)
        .await
        .map_err(|e| anyhow::anyhow!("slots {first}-{last}: {e}"))?;
    if !wait {
        println!("slots {first}-{last}: splitting at slot {at}");
        return Ok(());
    }
    let mut abandoned = false;
    wait_for(client, timeout, "the split", |map| {
        if let Some(upper) = map.tablet_at(id, at).filter(|t| t.first_slot == at) {
            return Some(format!(
                "slots {first}-{last}: split into {first}-{} and {at}-{} (epoch {})",
                at - 1,
                upper.last_slot,
                upper.epoch
            ));
        }
        let whole = map.tablet_at(id, first)?;
        if whole.split.is_some() {
            return None;
        }
        // Whole again, on the same master, two epochs on (the split's and a merge's): the split
        // was done and the leader merged its small halves back before this poll saw them.
        if whole.epoch >= start_epoch + 2 && whole.master == master && whole.last_slot == last {
            return Some(format!(
                "slots {first}-{last}: split at slot {at}; the halves have merged back since (epoch {}): \
                 together they hold less than a quarter of the coordinator's --split-mib",
                whole.epoch
            ));
        }
        abandoned = true;
        Some(format!("slots {first}-{last}: the split was abandoned"))
    })
    .await?;
    anyhow::ensure!(
        !abandoned,
        "the split was abandoned (see the coordinator's and the master's logs)"
    );
    Ok(())
}

/// `ramlog cluster ...`.
pub fn run_cluster(args: &ClusterArgs) -> anyhow::Result<()> {
    exit_on_error(cluster(args))
}

fn cluster(args: &ClusterArgs) -> anyhow::Result<()> {
    let client = args.coordinator.client();
    let json = match &args.command {
        ClusterCommand::Status { json } => *json,
        ClusterCommand::Drain {
            id,
            no_wait,
            timeout,
        } => {
            return tool_runtime()?.block_on(drain(
                &client,
                *id,
                !no_wait,
                Duration::from_secs(*timeout),
            ))
        }
        ClusterCommand::Rebalance { no_wait, timeout } => {
            return tool_runtime()?.block_on(rebalance(
                &client,
                !no_wait,
                Duration::from_secs(*timeout),
            ))
        }
        ClusterCommand::Merge {
            table,
            slot,
            no_wait,
            timeout,
        } => {
            return tool_runtime()?.block_on(merge_tablets(
                &client,
                table,
                slot,
                !no_wait,
                Duration::from_secs(*timeout),
            ))
        }
        ClusterCommand::Split {
            table,
            slot,
            at,
            no_wait,
            timeout,
        } => {
            return tool_runtime()?.block_on(split_tablet(
                &client,
                table,
                slot,
                at.as_deref(),
                !no_wait,
                Duration::from_secs(*timeout),
            ))
        }
        ClusterCommand::Move {
            table,
            slots,
            to,
            no_wait,
            timeout,
        } => {
            return tool_runtime()?.block_on(move_tablets(
                &client,
                table,
                slots,
                *to,
                !no_wait,
                Duration::from_secs(*timeout),
            ))
        }
    };
    tool_runtime()?.block_on(async {
        let mut status = client.status().await?;
        // Ask the leader, which knows its followers' progress and the servers' heartbeats.
        if let Some(leader) = status.leader.filter(|l| *l != status.member) {
            if let Some(address) = status.members.iter().find(|m| m.id == leader) {
                let direct =
                    CoordinatorClient::new(vec![address.address.clone()], Duration::from_secs(2));
                if let Ok(s) = direct.status().await {
                    status = s;
                }
            }
        }
        let mut servers = BTreeMap::new();
        for server in status
            .map
            .servers
            .iter()
            .filter(|s| s.state == ServerState::Up)
        {
            if let Some(body) = server_status(server).await {
                servers.insert(server.id, body);
            }
        }
        let seen = Seen::new(&servers);
        if json {
            println!("{:#}", status_json(&status, &seen));
        } else {
            print!("{}", status_text(&status, &seen));
        }
        Ok(())
    })
}

/// A server's admin `/status`, or None when unreachable.
async fn server_status(server: &ServerInfo) -> Option<serde_json::Value> {
    let admin = server.addresses.admin?;
    let fetch = async {
        let mut stream = tokio::net::TcpStream::connect(admin).await.ok()?;
        stream
            .write_all(b"GET /status HTTP/1.0\r\nHost: ramlog\r\n\r\n")
            .await
            .ok()?;
        let mut reply = Vec::new();
        stream.take(16 << 20).read_to_end(&mut reply).await.ok()?;
        let at = reply.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
        serde_json::from_slice(&reply[at..]).ok()
    };
    tokio::time::timeout(Duration::from_secs(2), fetch)
        .await
        .ok()
        .flatten()
}

/// What the servers' `/status` say: memory in use, and the restores and copies they run.
struct Seen<'a> {
    servers: &'a BTreeMap<u64, serde_json::Value>,
}

impl<'a> Seen<'a> {
    fn new(servers: &'a BTreeMap<u64, serde_json::Value>) -> Seen<'a> {
        Seen { servers }
    }

    fn memory_used(&self, server: u64) -> Option<u64> {
        let body = self.servers.get(&server)?;
        body.pointer("/metrics/memory/accounted")
            .or_else(|| body.pointer("/metrics/engine/memory_bytes_live"))
            .and_then(|v| v.as_u64())
    }

    /// The job `server` runs for tablet `t` at its epoch: its restore (`backup` None) or its
    /// copy to `backup`.
    fn job(&self, server: u64, t: &TabletInfo, backup: Option<u64>) -> Option<&serde_json::Value> {
        let jobs = self
            .servers
            .get(&server)?
            .pointer("/metrics/replication/recovery")?
            .as_array()?;
        jobs.iter().find(|j| {
            let n = |k: &str| j.get(k).and_then(|v| v.as_u64());
            n("table") == Some(t.table)
                && n("first_slot") == Some(u64::from(t.first_slot))
                && n("epoch") == Some(t.epoch)
                && n("backup") == backup
                && j.get("kind").and_then(|v| v.as_str())
                    == Some(if backup.is_some() { "copy" } else { "restore" })
        })
    }

    /// One line of a job's progress: "restoring 120000/335000 objects", "copying 12/67 MiB at
    /// 32 MiB/s" (the pace the foreground's latency allows).
    fn progress(&self, server: u64, t: &TabletInfo, backup: Option<u64>) -> Option<String> {
        let j = self.job(server, t, backup)?;
        let n = |k: &str| j.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
        let state = j.get("state").and_then(|v| v.as_str()).unwrap_or("?");
        let expected = |done: u64, total: u64, unit: &str, scale: u64| {
            if total > 0 {
                format!("{}/{} {unit}", done / scale, total / scale)
            } else {
                format!("{} {unit}", done / scale)
            }
        };
        Some(match (state, backup) {
            ("restoring", _) => format!(
                "restoring {}",
                expected(n("objects"), n("expected"), "objects", 1)
            ),
            ("copying", _) if n("rate") > 0 => format!(
                "copying {} at {} MiB/s",
                expected(n("bytes"), n("expected"), "MiB", 1 << 20),
                n("rate") >> 20
            ),
            ("copying", _) => format!(
                "copying {}",
                expected(n("bytes"), n("expected"), "MiB", 1 << 20)
            ),
            ("waiting", _) if j.get("demanded").and_then(|v| v.as_bool()) == Some(true) => {
                "waiting for a turn (asked for: next)".into()
            }
            ("failed", _) => format!(
                "failed: {}",
                j.get("error").and_then(|v| v.as_str()).unwrap_or("")
            ),
            (state, _) => state.to_string(),
        })
    }
}

fn tablet_counts(map: &ClusterMap, server: u64) -> (usize, usize) {
    let mastered = map.tablets.iter().filter(|t| t.master == server).count();
    let backed = map
        .tablets
        .iter()
        .filter(|t| t.backups.contains(&server) || t.mirror == Some(server))
        .count();
    (mastered, backed)
}

fn status_json(status: &CoordinatorStatus, seen: &Seen<'_>) -> serde_json::Value {
    let map = &status.map;
    let servers: Vec<serde_json::Value> = map
        .servers
        .iter()
        .map(|s| {
            let (mastered, backed) = tablet_counts(map, s.id);
            serde_json::json!({
                "id": s.id,
                "state": s.state.as_str(),
                "draining": s.draining,
                "epoch": s.epoch,
                "addresses": s.addresses,
                "tablets_mastered": mastered,
                "tablets_backed_up": backed,
                "memory_used": seen.memory_used(s.id),
            })
        })
        .collect();
    let tables: Vec<serde_json::Value> = map
        .tables
        .iter()
        .map(|t| {
            let tablets: Vec<serde_json::Value> = map
                .tablets_of(t.id)
                .map(|tb| {
                    serde_json::json!({
                        "first_slot": tb.first_slot,
                        "last_slot": tb.last_slot,
                        "master": tb.master,
                        "mirror": tb.mirror,
                        "backups": tb.backups,
                        "epoch": tb.epoch,
                        "recovering": tb.recovering,
                        "restorer": tb.restorer,
                        "pending": tb.pending,
                        "fresh": tb.fresh,
                        "waiting": tb.waiting,
                        "refused": tb.refused,
                        "logs_from": tb.logs_from,
                        "cut_off": tb.cut_off.iter().map(|c| serde_json::json!({
                            "master": c.master,
                            "backup": c.backup,
                        })).collect::<Vec<_>>(),
                        "split": tb.split,
                        "merge": tb.merge.is_some(),
                        "migration": tb.migration.map(|m| serde_json::json!({
                            "target": m.target,
                            "phase": m.phase.as_str(),
                        })),
                        "restore": tb.restorer.filter(|_| tb.recovering).and_then(|r| seen.job(r, tb, None)),
                        "copies": tb.pending.iter().filter_map(|&b| seen.job(tb.master, tb, Some(b))).collect::<Vec<_>>(),
                    })
                })
                .collect();
            serde_json::json!({
                "name": t.name,
                "id": t.id,
                "mode": t.mode.as_str(),
                "replicas": t.replicas,
                "tablet_count": tablets.len(),
                "tablets": tablets,
            })
        })
        .collect();
    serde_json::json!({
        "cluster_id": format!("{:016x}", map.cluster_id),
        "answered_by": status.member,
        "leader": status.leader,
        "term": status.term,
        "members": status.members,
        "map_version": map.version,
        "recovering_tablets": map.tablets.iter().filter(|t| t.recovering).count(),
        "tablets_waiting_for_room": map.tablets.iter().filter(|t| t.waiting.is_some()).count(),
        "pending_copies": map.tablets.iter().map(|t| t.pending.len()).sum::<usize>(),
        "migrations": map.tablets.iter().filter(|t| t.migration.is_some()).count(),
        "rebalancing": map.rebalancing,
        "servers": servers,
        "tables": tables,
    })
}

fn status_text(status: &CoordinatorStatus, seen: &Seen<'_>) -> String {
    use std::fmt::Write;
    let map = &status.map;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "cluster {:016x}  map version {}  term {}",
        map.cluster_id, map.version, status.term
    );
    let _ = writeln!(s, "coordinator members:");
    for m in &status.members {
        let mark = if Some(m.id) == status.leader {
            " *"
        } else {
            ""
        };
        let applied = m
            .last_applied
            .map(|a| a.to_string())
            .unwrap_or_else(|| "?".into());
        let _ = writeln!(
            s,
            "  {} {} {}{} applied={}",
            m.id, m.address, m.role, mark, applied
        );
    }
    let _ = writeln!(s, "servers:");
    if map.servers.is_empty() {
        let _ = writeln!(s, "  (none)");
    }
    for server in &map.servers {
        let (mastered, backed) = tablet_counts(map, server.id);
        let a = &server.addresses;
        let opt = |x: Option<SocketAddr>| x.map(|x| x.to_string()).unwrap_or_else(|| "-".into());
        let mem = seen
            .memory_used(server.id)
            .map(|m| m.to_string())
            .unwrap_or_else(|| "?".into());
        let state = match (server.draining, server.state) {
            (true, ServerState::Dead) => "drained",
            (true, _) => "draining",
            (false, st) => st.as_str(),
        };
        let _ = writeln!(
            s,
            "  {} {} epoch={} resp={} routing={} native={} admin={} masters={} backups={} memory_used={}",
            server.id,
            state,
            server.epoch,
            a.resp,
            opt(a.routing),
            a.native,
            opt(a.admin),
            mastered,
            backed,
            mem
        );
    }
    let recovering = map.tablets.iter().filter(|t| t.recovering).count();
    let copies: usize = map.tablets.iter().map(|t| t.pending.len()).sum();
    if recovering > 0 || copies > 0 {
        let _ = writeln!(
            s,
            "failures: {recovering} tablets recovering, {copies} copies to backups pending (server progress: ramlog status --admin HOST:PORT)"
        );
    }
    let waiting = map.tablets.iter().filter(|t| t.waiting.is_some()).count();
    if waiting > 0 {
        let _ = writeln!(
            s,
            "memory: {waiting} tablets wait for a backup with room to restore them; their slots answer CLUSTERDOWN (free memory: delete keys, or add a server)"
        );
    }
    let _ = writeln!(s, "tables:");
    for t in &map.tables {
        let count = map.tablets_of(t.id).count();
        let _ = writeln!(
            s,
            "  {} id={} mode={} replicas={} tablets={}",
            t.name, t.id, t.mode, t.replicas, count
        );
        for tb in map.tablets_of(t.id) {
            let backups: Vec<String> = tb.backups.iter().map(|b| b.to_string()).collect();
            let mirror = tb
                .mirror
                .map(|m| format!(" mirror={m}"))
                .unwrap_or_default();
            let state = if tb.recovering {
                match (tb.restorer, &tb.waiting) {
                    (Some(r), _) => match seen.progress(r, tb, None) {
                        Some(p) => format!(" RECOVERING on server {r}: {p}"),
                        None => format!(" RECOVERING on server {r}"),
                    },
                    (None, Some(why)) => format!(" RECOVERING: WAITING FOR MEMORY: {why}"),
                    (None, None) => " RECOVERING: waiting for a live backup".to_string(),
                }
            } else if tb.pending.is_empty() {
                String::new()
            } else {
                let p: Vec<String> = tb
                    .pending
                    .iter()
                    .map(|&b| match seen.progress(tb.master, tb, Some(b)) {
                        Some(p) => format!("{b}: {p}"),
                        None => b.to_string(),
                    })
                    .collect();
                format!(" copying to [{}]", p.join(", "))
            };
            let mut split = tb
                .logs_from
                .map(|f| format!(" logs-of={f}"))
                .unwrap_or_default();
            if let Some(at) = tb.split {
                split.push_str(&format!(" SPLITTING at slot {at}"));
            }
            if tb.merge.is_some() {
                split.push_str(" MERGING with the next tablet");
            }
            if !tb.cut_off.is_empty() {
                let c: Vec<String> = tb.cut_off.iter().map(|c| c.backup.to_string()).collect();
                split.push_str(&format!(" cut-off=[{}]", c.join(", ")));
            }
            if let Some(m) = tb.migration {
                split.push_str(&format!(
                    " MOVING to server {} ({})",
                    m.target,
                    m.phase.as_str()
                ));
            }
            let _ = writeln!(
                s,
                "    {}-{} master={}{} backups=[{}] epoch={}{split}{}",
                tb.first_slot,
                tb.last_slot,
                tb.master,
                mirror,
                backups.join(","),
                tb.epoch,
                state
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_lists_parse_and_refuse_mistakes() {
        let m = parse_members("1=127.0.0.1:1, 2=127.0.0.1:2").unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[&2], "127.0.0.1:2");
        for bad in ["", "1", "x=a:1", "0=a:1", "1=a:1,1=b:2"] {
            assert!(parse_members(bad).is_err(), "{bad}");
        }
    }
}
