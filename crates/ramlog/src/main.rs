//! `ramlog`: the one binary. Subcommands start processes, talk to a cluster, or run benchmarks.

use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "ramlog",
    version,
    about = "ramlog: a distributed in-memory key-value store"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a local cluster (a coordinator and 3 servers by default) and print how to connect;
    /// Ctrl-C stops it.
    Up(ramlog_server::up::UpFlags),
    /// Run one server process (RESP, native protocol, admin HTTP).
    Server(ramlog_server::cli::ServerFlags),
    /// Print a key's value (native protocol); exit 1 if absent.
    Get(ramlog_client::cli::GetArgs),
    /// Store a value, optionally conditional (--if-absent/--if-exists/--if-version) and expiring.
    Set(ramlog_client::cli::SetArgs),
    /// Delete keys; prints how many existed.
    Del(ramlog_client::cli::DelArgs),
    /// List keys matching a glob pattern, or scan records with filters, projection and aggregates.
    Scan(ramlog_client::cli::ScanArgs),
    /// Set, print or clear a table's schema (typed fields that filtered scans read).
    Schema(ramlog_client::cli::SchemaArgs),
    /// Print a server's status as JSON.
    Status(ramlog_client::cli::StatusArgs),
    /// Run one coordinator member (Raft over the cluster map) until Ctrl-C or SIGTERM.
    Coordinator(ramlog_coordinator::cli::CoordinatorArgs),
    /// Create, list or drop tables through the coordinator.
    Table(ramlog_coordinator::cli::TableArgs),
    /// Inspect the cluster through the coordinator.
    Cluster(ramlog_coordinator::cli::ClusterArgs),
    /// Read a stopped server's backup store (`ramlog backup dump --data-dir DIR`).
    Backup(ramlog_server::cluster::backup::BackupArgs),
    /// Run a benchmark suite; prints a table and optionally writes JSON.
    Bench(BenchArgs),
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Which suite to run.
    #[arg(required_unless_present = "list_suites")]
    suite: Option<Suite>,
    /// Print the names of all suites, one per line, and exit.
    #[arg(long)]
    list_suites: bool,
    /// A short run (under a minute) for CI smoke tests; targets are for the full run.
    #[arg(long)]
    quick: bool,
    /// Write the rows as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// `scan` only: scans of a cluster table (3 servers) against Redis Cluster SCAN.
    #[arg(long)]
    cluster: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum Suite {
    /// Log-structured memory engine: write cost vs utilisation, fragmentation, bytes/object, point ops.
    Engine,
    /// RESP server against redis-server with redis-benchmark: req/s, p50, p99, memory per key.
    Resp,
    /// Native protocol and Rust client against RESP (redis-benchmark) on the same server.
    Native,
    /// Backup logs (two-level logging): throughput vs raw disk, two-level on/off, reorganization, replay.
    Backup,
    /// Log-order scans against hash-index scans and gets, scan bandwidth, shared scans, writes during scans.
    Scan,
    /// A 3-server cluster against a Redis Cluster of 3 masters (redis-benchmark --cluster), and the routing port.
    Cluster,
    /// A master killed -9 under load: detection, recovery, re-protection, client gap and lost writes, against a Redis Cluster failover.
    Recovery,
    /// A tablet moved between live servers under load (`ramlog cluster move`), against `redis-cli --cluster reshard`.
    Migration,
    /// The Redis data types against Redis: redis-benchmark's hash, list, set and sorted-set tests, memory per element.
    Types,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let service = matches!(
        cli.command,
        Command::Up(_) | Command::Server(_) | Command::Coordinator(_) | Command::Bench(_)
    );
    if !service {
        // A command whose output goes to a pipe that closes (`ramlog backup dump | head`) ends
        // quietly, as other command-line tools do, instead of failing on the write.
        // SAFETY: restoring the default disposition of SIGPIPE before any thread exists.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match cli.command {
        Command::Up(flags) => ramlog_server::up::run_up(&flags),
        Command::Server(flags) => ramlog_server::cli::run_server(&flags),
        Command::Get(args) => ramlog_client::cli::get(&args),
        Command::Set(args) => ramlog_client::cli::set(&args),
        Command::Del(args) => ramlog_client::cli::del(&args),
        Command::Scan(args) => ramlog_client::cli::scan(&args),
        Command::Schema(args) => ramlog_client::cli::schema(&args),
        Command::Status(args) => ramlog_client::cli::status(&args),
        Command::Coordinator(args) => ramlog_coordinator::cli::run_coordinator(&args),
        Command::Table(args) => ramlog_coordinator::cli::run_table(&args),
        Command::Cluster(args) => ramlog_coordinator::cli::run_cluster(&args),
        Command::Backup(args) => ramlog_server::cluster::backup::run(&args),
        Command::Bench(args) => {
            let Some(suite) = args.suite else {
                for value in Suite::value_variants() {
                    if let Some(name) = value.to_possible_value() {
                        println!("{}", name.get_name());
                    }
                }
                return Ok(());
            };
            match suite {
                Suite::Engine => ramlog_bench::engine::run(args.quick, args.json.as_deref()),
                Suite::Resp => ramlog_bench::resp::run(args.quick, args.json.as_deref()),
                Suite::Native => ramlog_bench::native::run(args.quick, args.json.as_deref()),
                Suite::Backup => ramlog_bench::backup::run(args.quick, args.json.as_deref()),
                Suite::Scan if args.cluster => {
                    ramlog_bench::recovery::cluster_scan::run(args.quick, args.json.as_deref())
                }
                Suite::Scan => ramlog_bench::scan::run(args.quick, args.json.as_deref()),
                Suite::Cluster => ramlog_bench::cluster::run(args.quick, args.json.as_deref()),
                Suite::Recovery => ramlog_bench::recovery::run(args.quick, args.json.as_deref()),
                Suite::Types => ramlog_bench::types::run(args.quick, args.json.as_deref()),
                Suite::Migration => {
                    ramlog_bench::recovery::migration::run(args.quick, args.json.as_deref())
                }
            }
        }
    }
}
