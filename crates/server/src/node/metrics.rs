//! The server's one metrics registry: operation counts, latency histograms, connections, bytes.
//!
//! Every figure is an atomic counter bumped on the request path (relaxed ordering, no locks).
//! [`Snapshot`] reads them all once, together with the engine's statistics, and renders the same
//! figures three ways: Prometheus text (`/metrics`), JSON (`/status`) and Redis `INFO`.

use serde::Serialize;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Operation families with their own count and latency histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Op {
    Get = 0,
    Set,
    Mget,
    Mset,
    Del,
    Exists,
    Incr,
    Strlen,
    Scan,
    Expire,
    Ttl,
    /// The commands of each collection type, reads and writes.
    Hash,
    List,
    SetType,
    ZSet,
    Other,
}

impl Op {
    pub const ALL: [Op; 16] = [
        Op::Get,
        Op::Set,
        Op::Mget,
        Op::Mset,
        Op::Del,
        Op::Exists,
        Op::Incr,
        Op::Strlen,
        Op::Scan,
        Op::Expire,
        Op::Ttl,
        Op::Hash,
        Op::List,
        Op::SetType,
        Op::ZSet,
        Op::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Get => "get",
            Op::Set => "set",
            Op::Mget => "mget",
            Op::Mset => "mset",
            Op::Del => "del",
            Op::Exists => "exists",
            Op::Incr => "incr",
            Op::Strlen => "strlen",
            Op::Scan => "scan",
            Op::Expire => "expire",
            Op::Ttl => "ttl",
            Op::Hash => "hash",
            Op::List => "list",
            Op::SetType => "set_type",
            Op::ZSet => "zset",
            Op::Other => "other",
        }
    }
}

/// Upper bounds of the latency buckets in microseconds (powers of two up to about 1 s), then +Inf.
pub const LATENCY_BUCKETS_US: [u64; 21] = [
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
    262144, 524288, 1048576,
];

/// The `_bucket`, `_sum` and `_count` lines of one labelled latency histogram (seconds).
fn histogram_lines(s: &mut String, metric: &str, label: &str, value: &str, h: &HistogramSnapshot) {
    let mut cumulative = 0;
    for (i, c) in h.buckets.iter().enumerate() {
        cumulative += c;
        let le = match LATENCY_BUCKETS_US.get(i) {
            Some(us) => format!("{}", *us as f64 / 1e6),
            None => "+Inf".to_string(),
        };
        let _ = writeln!(
            s,
            "{metric}_bucket{{{label}=\"{value}\",le=\"{le}\"}} {cumulative}"
        );
    }
    let _ = writeln!(
        s,
        "{metric}_sum{{{label}=\"{value}\"}} {}",
        h.sum_ns as f64 / 1e9
    );
    let _ = writeln!(s, "{metric}_count{{{label}=\"{value}\"}} {}", h.count);
}

/// The replication part of `/metrics`: per backup stream, per mode, and the backup side.
fn replication_prometheus(s: &mut String, r: &crate::node::figures::ReplicationFigures) {
    type StreamGauge = (
        &'static str,
        &'static str,
        &'static str,
        fn(&crate::node::figures::StreamFigures) -> String,
    );
    let per_stream: [StreamGauge; 8] = [
        (
            "ramlog_replication_connected",
            "1 while the replication connection to this backup is up.",
            "gauge",
            |f| u8::from(f.connected).to_string(),
        ),
        (
            "ramlog_replication_bytes_in_flight",
            "Stream bytes not yet durable on this backup (what the master holds for it).",
            "gauge",
            |f| f.bytes_in_flight.to_string(),
        ),
        (
            "ramlog_replication_entries_in_flight",
            "Writes not yet durable on this backup.",
            "gauge",
            |f| f.entries_in_flight.to_string(),
        ),
        (
            "ramlog_replication_bytes_unbuffered",
            "Stream bytes not yet in this backup's write buffer.",
            "gauge",
            |f| f.bytes_unbuffered.to_string(),
        ),
        (
            "ramlog_replication_lag_seconds",
            "Age of the oldest write not yet durable on this backup.",
            "gauge",
            |f| (f.lag_ms as f64 / 1e3).to_string(),
        ),
        (
            "ramlog_replication_stream_bytes_total",
            "Bytes of writes streamed to this backup.",
            "counter",
            |f| f.offset.to_string(),
        ),
        (
            "ramlog_replication_entries_total",
            "Writes streamed to this backup.",
            "counter",
            |f| f.entries.to_string(),
        ),
        (
            "ramlog_replication_connects_total",
            "Replication connections made to this backup.",
            "counter",
            |f| f.connects.to_string(),
        ),
    ];
    for (name, help, kind, value) in per_stream {
        let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for f in &r.streams {
            let _ = writeln!(s, "{name}{{backup=\"{}\"}} {}", f.backup, value(f));
        }
    }
    let _ = writeln!(
        s,
        "# HELP ramlog_replication_ack_seconds Time a write's reply waited for its backups, by table mode.\n# TYPE ramlog_replication_ack_seconds histogram"
    );
    for m in &r.modes {
        histogram_lines(
            s,
            "ramlog_replication_ack_seconds",
            "mode",
            m.mode,
            &m.latency,
        );
    }
    let b = &r.backup;
    for (name, help, value) in [
        (
            "ramlog_backup_frames_total",
            "Replication frames this server took as a backup.",
            b.frames,
        ),
        (
            "ramlog_backup_units_total",
            "Write units appended to this server's backup store.",
            b.units,
        ),
        (
            "ramlog_backup_entries_total",
            "Writes appended to this server's backup store.",
            b.entries,
        ),
        (
            "ramlog_backup_bytes_total",
            "Replication frame bytes taken.",
            b.bytes,
        ),
        (
            "ramlog_backup_units_skipped_total",
            "Resent units this backup already held.",
            b.units_skipped,
        ),
        (
            "ramlog_backup_refused_fenced_total",
            "Frames refused for a stale epoch.",
            b.refused_fenced,
        ),
        (
            "ramlog_backup_refused_bad_total",
            "Frames refused as malformed or for an unknown tablet.",
            b.refused_bad,
        ),
        (
            "ramlog_backup_refused_store_total",
            "Frames refused because the backup store failed (full disk, I/O error).",
            b.refused_store,
        ),
        (
            "ramlog_backup_refused_content_total",
            "Units refused for their content; the stream went on without them (the master failed those writes).",
            b.refused_content,
        ),
        (
            "ramlog_backup_syncs_requested_total",
            "Syncs durable tables asked for.",
            b.syncs_requested,
        ),
        (
            "ramlog_backup_store_flushes_total",
            "Flush cycles of the backup store (processor, writer and finisher).",
            b.store_flushes,
        ),
        (
            "ramlog_backup_store_files_synced_total",
            "Files the backup store synced.",
            b.store_files_synced,
        ),
        (
            "ramlog_backup_store_process_ms_total",
            "Time the backup store spent building flushes (ms).",
            b.store_process_ms,
        ),
        (
            "ramlog_backup_store_write_ms_total",
            "Time the backup store spent writing flushes (ms).",
            b.store_write_ms,
        ),
        (
            "ramlog_backup_store_sync_ms_total",
            "Time the backup store spent finishing and syncing flushes (ms).",
            b.store_sync_ms,
        ),
    ] {
        let _ = writeln!(
            s,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
        );
    }
    let _ = writeln!(
        s,
        "# HELP ramlog_backup_tablets Tablets in this server's backup store.\n# TYPE ramlog_backup_tablets gauge\nramlog_backup_tablets {}",
        b.tablets
    );
}

/// `INFO replication`: Redis's fields, then one line per backup stream and per mode.
fn replication_info(s: &mut String, r: Option<&crate::node::figures::ReplicationFigures>) {
    let connected = r.map_or(0, |r| r.streams.iter().filter(|f| f.connected).count());
    let _ = write!(
        s,
        "# Replication\r\nrole:master\r\nconnected_slaves:{connected}\r\n"
    );
    if let Some(r) = r {
        for (i, f) in r.streams.iter().enumerate() {
            let _ = write!(
                s,
                "ramlog_backup{i}:id={},addr={},connected={},bytes_in_flight={},entries_in_flight={},bytes_unbuffered={},lag_ms={},offset={},acked_buffered={},acked_durable={},connects={}\r\n",
                f.backup,
                f.address,
                u8::from(f.connected),
                f.bytes_in_flight,
                f.entries_in_flight,
                f.bytes_unbuffered,
                f.lag_ms,
                f.offset,
                f.acked_buffered,
                f.acked_durable,
                f.connects
            );
        }
        for m in &r.modes {
            let _ = write!(
                s,
                "ramlog_ack_{}:acknowledged={},p50_usec_le={},p99_usec_le={}\r\n",
                m.mode,
                m.acknowledged,
                m.latency.quantile_us(0.5),
                m.latency.quantile_us(0.99)
            );
        }
        let b = &r.backup;
        let _ = write!(
            s,
            "ramlog_backup_side:tablets={},frames={},units={},entries={},units_skipped={},refused_fenced={},refused_bad={},refused_store={},refused_content={}\r\n",
            b.tablets, b.frames, b.units, b.entries, b.units_skipped, b.refused_fenced, b.refused_bad, b.refused_store, b.refused_content
        );
    }
    s.push_str("\r\n");
}

/// A fixed-bucket latency histogram updated with relaxed atomics.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    pub fn record(&self, elapsed: Duration) {
        let ns = elapsed.as_nanos().min(u64::MAX as u128) as u64;
        let us = ns / 1000;
        let index = LATENCY_BUCKETS_US
            .iter()
            .position(|&bound| us < bound)
            .unwrap_or(LATENCY_BUCKETS_US.len());
        self.buckets[index].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    pub fn read(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            buckets: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            count: self.count.load(Ordering::Relaxed),
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct HistogramSnapshot {
    /// Counts per bucket (not cumulative); the last one is +Inf.
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum_ns: u64,
}

impl HistogramSnapshot {
    /// A histogram of nothing.
    pub fn empty() -> Self {
        HistogramSnapshot {
            buckets: vec![0; LATENCY_BUCKETS_US.len() + 1],
            count: 0,
            sum_ns: 0,
        }
    }

    /// Adds another histogram's counts to this one's.
    pub fn add(&mut self, other: &HistogramSnapshot) {
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.count += other.count;
        self.sum_ns += other.sum_ns;
    }

    /// Upper bound (µs) of the bucket holding quantile `q`; an estimate good to a factor of two.
    pub fn quantile_us(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = (q * self.count as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, &c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return LATENCY_BUCKETS_US.get(i).copied().unwrap_or(u64::MAX);
            }
        }
        u64::MAX
    }
}

/// All counters of one server process.
#[derive(Debug, Default)]
pub struct Metrics {
    ops: [AtomicU64; Op::ALL.len()],
    latency: [Histogram; Op::ALL.len()],
    pub errors: AtomicU64,
    /// Writes refused because persistence had failed (`-MISCONF`, WRITES_REFUSED), including
    /// `durable` writes whose acknowledgement was withdrawn.
    pub writes_refused: AtomicU64,
    pub connections_current: AtomicU64,
    /// Connections waiting in a blocking command (BLPOP, BZPOPMIN, XREAD BLOCK, ...).
    pub blocked_clients: AtomicU64,
    /// Of those, routing-port clients (the routing port's INFO shows these alone: a routing
    /// client that blocks on this server's keys waits on a connection of its own to this
    /// server's RESP port, which counts in `blocked_clients` too).
    pub routed_blocked_clients: AtomicU64,
    /// INFO commandstats: per command.
    pub command_stats: CommandStats,
    /// INFO errorstats: error replies by their code.
    pub error_stats: ErrorStats,
    /// The routing port's INFO errorstats (and its `total_error_replies`): its clients' error
    /// replies, counted where they arrive.
    pub routed_error_stats: ErrorStats,
    /// `errors` when CONFIG RESETSTAT last ran (INFO's `total_error_replies` counts from there;
    /// `/metrics` counts from the start).
    pub errors_at_reset: AtomicU64,
    /// The routing port's INFO commandstats: its clients' commands, counted once each where
    /// they arrive (whichever server runs them), with the time to their reply; an error reply
    /// counts as failed (a refusal is not told apart there).
    pub routed_command_stats: CommandStats,
    pub connections_total: AtomicU64,
    pub connections_rejected: AtomicU64,
    pub protocol_errors: AtomicU64,
    /// Pipelined requests run together with the one before them (`commands::execute_run`).
    pub requests_run_together: AtomicU64,
    /// Scans of a tablet this server mirrors (SCAN_TABLET from a mirror).
    pub mirror_scans: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub keyspace_hits: AtomicU64,
    pub keyspace_misses: AtomicU64,
    /// Bytes of request and reply buffers held by client connections (their capacities).
    pub connection_buffer_bytes: AtomicU64,
}

/// A connection's share of [`Metrics::connection_buffer_bytes`]: `update` moves the total by the
/// change in this connection's buffer capacity; dropping it takes the connection's share out.
pub struct BufferGauge<'a> {
    total: &'a AtomicU64,
    held: u64,
}

impl<'a> BufferGauge<'a> {
    pub fn new(metrics: &'a Metrics) -> Self {
        BufferGauge {
            total: &metrics.connection_buffer_bytes,
            held: 0,
        }
    }

    /// Records that the connection now holds `bytes` of buffers.
    #[inline]
    pub fn update(&mut self, bytes: usize) {
        let bytes = bytes as u64;
        if bytes > self.held {
            self.total.fetch_add(bytes - self.held, Ordering::Relaxed);
        } else if bytes < self.held {
            self.total.fetch_sub(self.held - bytes, Ordering::Relaxed);
        }
        self.held = bytes;
    }
}

impl Drop for BufferGauge<'_> {
    fn drop(&mut self) {
        self.total.fetch_sub(self.held, Ordering::Relaxed);
    }
}

/// What the process holds in memory, by part (bytes). `--memory` bounds the parts charged to the
/// budget (the log, the index, the backup store and connection buffers); `process` (code,
/// libraries, the runtime, measured at start) is outside it. See docs/operations.md.
#[derive(Debug, Clone, Serialize, Default)]
pub struct MemoryBreakdown {
    /// (part, bytes), in a fixed order.
    pub parts: Vec<(&'static str, u64)>,
    /// The sum of the parts: Redis's `used_memory`.
    pub accounted: u64,
    /// The budget (`--memory`).
    pub budget: u64,
    /// Of the budget, what the log may use now (the rest is charged to the index, the backup
    /// store and connection buffers).
    pub log_capacity: u64,
}

impl MemoryBreakdown {
    pub fn new(parts: Vec<(&'static str, u64)>, budget: u64, log_capacity: u64) -> Self {
        MemoryBreakdown {
            accounted: parts.iter().map(|p| p.1).sum(),
            parts,
            budget,
            log_capacity,
        }
    }
}

impl Metrics {
    /// The latency of every command this process ran, all kinds together.
    pub fn latency_all(&self) -> HistogramSnapshot {
        let mut all = HistogramSnapshot::empty();
        for h in &self.latency {
            all.add(&h.read());
        }
        all
    }

    pub fn record(&self, op: Op, elapsed: Duration) {
        self.ops[op as usize].fetch_add(1, Ordering::Relaxed);
        self.latency[op as usize].record(elapsed);
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Commands the command table may hold (its index bounds [`CommandStats`]).
pub const COMMANDS_MAX: usize = 512;

/// Error replies by their code (the first word: `ERR`, `WRONGTYPE`, `NOGROUP`, ...), as INFO
/// errorstats gives them; at most [`ERROR_CODES_MAX`] codes (later new ones are not counted, as
/// Redis stops at 128).
#[derive(Debug, Default)]
pub struct ErrorStats(parking_lot::Mutex<std::collections::BTreeMap<String, u64>>);

pub const ERROR_CODES_MAX: usize = 128;

impl ErrorStats {
    /// Counts the error reply `reply` (`-CODE message\r\n`).
    pub fn count(&self, reply: &[u8]) {
        let body = reply.strip_prefix(b"-").unwrap_or(reply);
        let end = body
            .iter()
            .position(|&b| b == b' ' || b == b'\r')
            .unwrap_or(body.len());
        let code = String::from_utf8_lossy(&body[..end.min(64)]).into_owned();
        let mut map = self.0.lock();
        if let Some(n) = map.get_mut(&code) {
            *n += 1;
        } else if map.len() < ERROR_CODES_MAX {
            map.insert(code, 1);
        }
    }

    pub fn read(&self) -> Vec<(String, u64)> {
        self.0.lock().iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    pub fn reset(&self) {
        self.0.lock().clear();
    }
}

/// One command's figures, as Redis's INFO commandstats gives them.
#[derive(Debug, Default)]
pub struct CommandStat {
    /// Calls that ran (a blocking command counts once, however often it tried).
    calls: AtomicU64,
    /// Microseconds they took (a blocking command's wait not included).
    usec: AtomicU64,
    /// Calls refused before they ran: wrong arity, NOAUTH, a reserved key, `-MOVED`,
    /// `-CROSSSLOT`, `-BUSY`.
    rejected: AtomicU64,
    /// Calls that ran and answered an error.
    failed: AtomicU64,
}

/// Per command, by its index in the command table, since the start or CONFIG RESETSTAT.
#[derive(Debug)]
pub struct CommandStats(Box<[CommandStat]>);

impl Default for CommandStats {
    fn default() -> Self {
        CommandStats((0..COMMANDS_MAX).map(|_| CommandStat::default()).collect())
    }
}

/// One command's figures at a moment (only commands called since the start or the reset).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CommandCalls {
    pub name: &'static str,
    pub calls: u64,
    pub usec: u64,
    pub rejected: u64,
    pub failed: u64,
}

impl CommandStats {
    /// Command `index` ran (`counted`: false for a blocking command's tries after its first,
    /// whose time still adds) and took `elapsed`; `failed`: it answered an error.
    pub fn ran(&self, index: usize, elapsed: Duration, counted: bool, failed: bool) {
        let Some(c) = self.0.get(index) else {
            return;
        };
        if counted {
            c.calls.fetch_add(1, Ordering::Relaxed);
        }
        c.usec
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
        if failed {
            c.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Command `index` was refused before it ran.
    pub fn rejected(&self, index: usize) {
        if let Some(c) = self.0.get(index) {
            c.rejected.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// CONFIG RESETSTAT.
    pub fn reset(&self) {
        for c in self.0.iter() {
            for a in [&c.calls, &c.usec, &c.rejected, &c.failed] {
                a.store(0, Ordering::Relaxed);
            }
        }
    }

    /// The figures of the commands called, `names` giving each index's name.
    pub fn read(&self, names: impl Iterator<Item = &'static str>) -> Vec<CommandCalls> {
        names
            .zip(self.0.iter())
            .map(|(name, c)| CommandCalls {
                name,
                calls: c.calls.load(Ordering::Relaxed),
                usec: c.usec.load(Ordering::Relaxed),
                rejected: c.rejected.load(Ordering::Relaxed),
                failed: c.failed.load(Ordering::Relaxed),
            })
            .filter(|c| c.calls + c.rejected + c.failed > 0)
            .collect()
    }
}

/// Process-level figures that are not counters.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessInfo {
    pub version: &'static str,
    pub pid: u32,
    pub uptime_secs: u64,
    pub resp_port: u16,
    pub native_port: u16,
    pub admin_port: u16,
    pub connections_max: usize,
    pub rss_bytes: u64,
    pub persistence: String,
    /// `ok`, `failed` or `rewriting` (see `persistence::Health`); `ok` when persistence is off.
    pub persistence_status: &'static str,
    /// Why the store last failed; empty if it never did.
    pub persistence_error: String,
    pub persistence_failures: u64,
    pub persistence_rewrites: u64,
    /// Commands that changed data since the last SAVE (Redis's dirty counter).
    pub changes_since_save: u64,
    /// When SAVE last completed (seconds since the epoch; 0: never).
    pub last_save_secs: u64,
}

impl ProcessInfo {
    /// When the process started (seconds since the epoch).
    pub fn started_secs(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            .saturating_sub(self.uptime_secs)
    }
}

/// The engine's figures, as reported to operators.
#[derive(Debug, Clone, Serialize, Default)]
pub struct EngineFigures {
    /// Keys (what DBSIZE counts).
    pub objects: u64,
    /// Chunk objects of large collections (internal keys; not in `objects`).
    pub chunks: u64,
    /// Objects with an expiry time, and the mean time they have left in milliseconds (0 when
    /// none), as Redis's INFO keyspace `expires` and `avg_ttl`.
    pub objects_expiring: u64,
    pub objects_expiring_avg_ttl_ms: u64,
    pub memory_bytes_total: u64,
    pub memory_bytes_live: u64,
    pub memory_utilisation: f64,
    pub cleaner_bytes_copied: u64,
    pub cleaner_bytes_freed: u64,
    pub write_cost: f64,
    pub tablets: u64,
    /// Writes that waited for the cleaner to free memory, and the seconds they waited.
    pub memory_waits: u64,
    pub memory_wait_secs: f64,
    /// Bytes of the budget the log has never touched (not yet resident).
    pub memory_bytes_untouched: u64,
}

/// All figures at one moment.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    /// INFO commandstats (filled by the INFO command, which knows the command table).
    #[serde(skip)]
    pub commands: Vec<CommandCalls>,
    /// INFO errorstats, and the errors counted before the last CONFIG RESETSTAT.
    #[serde(skip)]
    pub error_codes: Vec<(String, u64)>,
    #[serde(skip)]
    pub errors_at_reset: u64,
    pub process: ProcessInfo,
    pub engine: EngineFigures,
    pub memory: MemoryBreakdown,
    pub ops: Vec<(String, u64, HistogramSnapshot)>,
    pub commands_total: u64,
    pub errors: u64,
    pub writes_refused: u64,
    pub connections_current: u64,
    pub blocked_clients: u64,
    /// Keys with blocked clients, and those with one their deletion ends (XREADGROUP).
    pub blocking_keys: u64,
    pub blocking_keys_on_nokey: u64,
    pub connections_total: u64,
    pub connections_rejected: u64,
    pub protocol_errors: u64,
    pub requests_run_together: u64,
    pub mirror_scans: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub keyspace_hits: u64,
    pub keyspace_misses: u64,
    /// Replication and backup duty (cluster servers only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replication: Option<crate::node::figures::ReplicationFigures>,
    /// Membership figures (cluster servers only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<crate::node::figures::ClusterFigures>,
}

fn cluster_prometheus(s: &mut String, c: &crate::node::figures::ClusterFigures) {
    let gauges = [
        (
            "ramlog_cluster_map_version",
            "Version of the cluster map this server serves.",
            c.map_version,
        ),
        (
            "ramlog_tablets_recovering",
            "Tablets of the cluster whose master died and that are not restored yet.",
            c.tablets_recovering,
        ),
        (
            "ramlog_tablets_waiting_for_room",
            "Recovering tablets that no live backup has the memory to restore (their slots answer CLUSTERDOWN until one has).",
            c.tablets_waiting_for_room,
        ),
        (
            "ramlog_restore_room_bytes",
            "Bytes this server reports to the coordinator that it could take for a restore.",
            c.restore_room_bytes,
        ),
        (
            "ramlog_migrations_out",
            "Tablets this server is moving to another server (move, drain, rebalancing).",
            c.migrations_out,
        ),
        (
            "ramlog_migrations_in",
            "Tablets moving to this server.",
            c.migrations_in,
        ),
        (
            "ramlog_migration_copied_bytes",
            "Bytes of the outgoing moves still copying that reached their targets' logs.",
            c.migration_copied_bytes,
        ),
        (
            "ramlog_migration_copy_total_bytes",
            "Bytes of the tablets whose outgoing moves are still copying.",
            c.migration_copy_total_bytes,
        ),
        (
            "ramlog_migration_copy_rate_bytes_per_second",
            "Current pace of the outgoing moves' copies (it follows the foreground's latency).",
            c.migration_copy_rate,
        ),
    ];
    for (name, help, value) in gauges {
        let _ = writeln!(
            s,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
        );
    }
}

impl Snapshot {
    pub fn take(
        metrics: &Metrics,
        process: ProcessInfo,
        engine: EngineFigures,
        memory: MemoryBreakdown,
    ) -> Snapshot {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let ops: Vec<_> = Op::ALL
            .iter()
            .map(|&op| {
                (
                    op.name().to_string(),
                    load(&metrics.ops[op as usize]),
                    metrics.latency[op as usize].read(),
                )
            })
            .collect();
        Snapshot {
            commands: Vec::new(),
            error_codes: metrics.error_stats.read(),
            errors_at_reset: load(&metrics.errors_at_reset),
            process,
            engine,
            memory,
            commands_total: ops.iter().map(|o| o.1).sum(),
            ops,
            errors: load(&metrics.errors),
            writes_refused: load(&metrics.writes_refused),
            connections_current: load(&metrics.connections_current),
            blocked_clients: load(&metrics.blocked_clients),
            blocking_keys: 0,
            blocking_keys_on_nokey: 0,
            connections_total: load(&metrics.connections_total),
            connections_rejected: load(&metrics.connections_rejected),
            protocol_errors: load(&metrics.protocol_errors),
            requests_run_together: load(&metrics.requests_run_together),
            mirror_scans: load(&metrics.mirror_scans),
            bytes_in: load(&metrics.bytes_in),
            bytes_out: load(&metrics.bytes_out),
            keyspace_hits: load(&metrics.keyspace_hits),
            keyspace_misses: load(&metrics.keyspace_misses),
            replication: None,
            cluster: None,
        }
    }

    /// Prometheus text exposition format (version 0.0.4).
    pub fn prometheus(&self) -> String {
        let mut s = String::with_capacity(8192);
        let mut gauge = |name: &str, help: &str, kind: &str, value: String| {
            let _ = writeln!(
                s,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        gauge(
            "ramlog_uptime_seconds",
            "Seconds since the process started.",
            "gauge",
            self.process.uptime_secs.to_string(),
        );
        gauge(
            "ramlog_persistence_failed",
            "1 while persistence has failed (or is rewriting memory into a fresh store) and writes are refused.",
            "gauge",
            u8::from(self.process.persistence_status != "ok").to_string(),
        );
        gauge(
            "ramlog_persistence_failures_total",
            "Times the backup store failed (disk full, I/O error).",
            "counter",
            self.process.persistence_failures.to_string(),
        );
        gauge(
            "ramlog_persistence_rewrites_total",
            "Rewrites of memory into a fresh store that completed and resumed writes.",
            "counter",
            self.process.persistence_rewrites.to_string(),
        );
        gauge(
            "ramlog_writes_refused_total",
            "Writes refused because persistence had failed.",
            "counter",
            self.writes_refused.to_string(),
        );
        gauge(
            "ramlog_objects",
            "Keys stored in memory (the chunks of large collections are counted apart).",
            "gauge",
            self.engine.objects.to_string(),
        );
        gauge(
            "ramlog_large_collection_chunks",
            "Chunk objects that hold the items of large collections.",
            "gauge",
            self.engine.chunks.to_string(),
        );
        gauge(
            "ramlog_objects_expiring",
            "Objects stored in memory that carry an expiry time.",
            "gauge",
            self.engine.objects_expiring.to_string(),
        );
        gauge(
            "ramlog_memory_bytes_total",
            "The engine's fixed memory budget.",
            "gauge",
            self.engine.memory_bytes_total.to_string(),
        );
        gauge(
            "ramlog_memory_bytes_live",
            "Bytes of live objects in the log.",
            "gauge",
            self.engine.memory_bytes_live.to_string(),
        );
        gauge(
            "ramlog_memory_bytes_untouched",
            "Bytes of the budget the log has never used (not yet resident).",
            "gauge",
            self.engine.memory_bytes_untouched.to_string(),
        );
        gauge(
            "ramlog_memory_utilisation",
            "Live bytes over the log's capacity (the budget less what the index, the backup store and connection buffers hold).",
            "gauge",
            format!("{}", self.engine.memory_utilisation),
        );
        gauge(
            "ramlog_process_rss_bytes",
            "Resident set size of the process.",
            "gauge",
            self.process.rss_bytes.to_string(),
        );
        gauge(
            "ramlog_memory_accounted_bytes",
            "Sum of ramlog_memory_part_bytes: what the process holds, by its own account.",
            "gauge",
            self.memory.accounted.to_string(),
        );
        gauge(
            "ramlog_memory_log_capacity_bytes",
            "Of the memory budget, what the log may use now (the rest is charged to the index, the backup store and connection buffers).",
            "gauge",
            self.memory.log_capacity.to_string(),
        );
        gauge(
            "ramlog_cleaner_bytes_copied_total",
            "Bytes the cleaner copied.",
            "counter",
            self.engine.cleaner_bytes_copied.to_string(),
        );
        gauge(
            "ramlog_cleaner_bytes_freed_total",
            "Bytes the cleaner freed.",
            "counter",
            self.engine.cleaner_bytes_freed.to_string(),
        );
        gauge(
            "ramlog_cleaner_write_cost",
            "Bytes written per byte of new data (1 = no cleaning cost).",
            "gauge",
            format!("{}", self.engine.write_cost),
        );
        gauge(
            "ramlog_memory_waits_total",
            "Times a write waited for the cleaner to free memory.",
            "counter",
            self.engine.memory_waits.to_string(),
        );
        gauge(
            "ramlog_memory_wait_seconds_total",
            "Seconds writes spent waiting for the cleaner to free memory.",
            "counter",
            format!("{}", self.engine.memory_wait_secs),
        );
        gauge(
            "ramlog_tablets",
            "Tablets held by this server.",
            "gauge",
            self.engine.tablets.to_string(),
        );
        gauge(
            "ramlog_connections",
            "Open client connections.",
            "gauge",
            self.connections_current.to_string(),
        );
        gauge(
            "ramlog_connections_total",
            "Client connections accepted.",
            "counter",
            self.connections_total.to_string(),
        );
        gauge(
            "ramlog_connections_rejected_total",
            "Connections refused at the connection limit.",
            "counter",
            self.connections_rejected.to_string(),
        );
        gauge(
            "ramlog_protocol_errors_total",
            "Connections closed for a protocol error.",
            "counter",
            self.protocol_errors.to_string(),
        );
        gauge(
            "ramlog_requests_run_together_total",
            "Pipelined pushes and pops of one list run as one command with the request before them.",
            "counter",
            self.requests_run_together.to_string(),
        );
        gauge(
            "ramlog_mirror_scans_total",
            "Scans of a tablet served on this server as its mirror (the master left alone).",
            "counter",
            self.mirror_scans.to_string(),
        );
        gauge(
            "ramlog_errors_total",
            "Commands answered with an error.",
            "counter",
            self.errors.to_string(),
        );
        gauge(
            "ramlog_net_input_bytes_total",
            "Bytes read from clients.",
            "counter",
            self.bytes_in.to_string(),
        );
        gauge(
            "ramlog_net_output_bytes_total",
            "Bytes written to clients.",
            "counter",
            self.bytes_out.to_string(),
        );
        gauge(
            "ramlog_keyspace_hits_total",
            "Reads that found their key.",
            "counter",
            self.keyspace_hits.to_string(),
        );
        gauge(
            "ramlog_keyspace_misses_total",
            "Reads that did not find their key.",
            "counter",
            self.keyspace_misses.to_string(),
        );
        let _ = writeln!(
            s,
            "# HELP ramlog_memory_part_bytes Memory the process holds, by part (they sum to ramlog_memory_accounted_bytes).\n# TYPE ramlog_memory_part_bytes gauge"
        );
        for (part, bytes) in &self.memory.parts {
            let _ = writeln!(s, "ramlog_memory_part_bytes{{part=\"{part}\"}} {bytes}");
        }
        let _ = writeln!(s, "# HELP ramlog_commands_total Commands executed, by operation.\n# TYPE ramlog_commands_total counter");
        for (name, count, _) in &self.ops {
            let _ = writeln!(s, "ramlog_commands_total{{op=\"{name}\"}} {count}");
        }
        let _ = writeln!(
            s,
            "# HELP ramlog_command_duration_seconds Command execution time on the server, by operation.\n# TYPE ramlog_command_duration_seconds histogram"
        );
        for (name, _, h) in &self.ops {
            histogram_lines(&mut s, "ramlog_command_duration_seconds", "op", name, h);
        }
        if let Some(r) = &self.replication {
            replication_prometheus(&mut s, r);
        }
        if let Some(c) = &self.cluster {
            cluster_prometheus(&mut s, c);
        }
        s
    }

    /// Redis INFO text for the given section (`None`, `default`, `all` and `everything` give all).
    /// `cluster_node`: answered on a cluster server's RESP port, which is a Redis Cluster node
    /// (`redis_mode:cluster`, `cluster_enabled:1`); a standalone server and the routing port
    /// answer as a standalone Redis.
    pub fn info(&self, section: Option<&str>, cluster_node: bool) -> String {
        let section = section.map(|s| s.to_ascii_lowercase());
        let wants = |name: &str| match section.as_deref() {
            None | Some("default") | Some("all") | Some("everything") => true,
            Some(s) => s == name,
        };
        let mut s = String::with_capacity(4096);
        if wants("server") {
            let _ = write!(
                s,
                "# Server\r\nredis_version:7.2.0\r\nramlog_version:{}\r\nredis_mode:{}\r\nos:{}\r\narch_bits:64\r\nprocess_id:{}\r\ntcp_port:{}\r\nnative_port:{}\r\nadmin_port:{}\r\nuptime_in_seconds:{}\r\nuptime_in_days:{}\r\nramlog_tablets:{}\r\n\r\n",
                self.process.version,
                if cluster_node { "cluster" } else { "standalone" },
                std::env::consts::OS,
                self.process.pid,
                self.process.resp_port,
                self.process.native_port,
                self.process.admin_port,
                self.process.uptime_secs,
                self.process.uptime_secs / 86400,
                self.engine.tablets
            );
        }
        if wants("clients") {
            let _ = write!(
                s,
                "# Clients\r\nconnected_clients:{}\r\nmaxclients:{}\r\nblocked_clients:{}\r\ntotal_blocking_keys:{}\r\ntotal_blocking_keys_on_nokey:{}\r\n\r\n",
                self.connections_current,
                self.process.connections_max,
                self.blocked_clients,
                self.blocking_keys,
                self.blocking_keys_on_nokey
            );
        }
        if wants("memory") {
            let _ = write!(
                s,
                "# Memory\r\nused_memory:{}\r\nused_memory_rss:{}\r\nmaxmemory:{}\r\nmaxmemory_policy:noeviction\r\nramlog_memory_live:{}\r\nramlog_memory_log_capacity:{}\r\nramlog_memory_utilisation:{:.6}\r\nramlog_cleaner_bytes_copied:{}\r\nramlog_cleaner_bytes_freed:{}\r\nramlog_cleaner_write_cost:{:.6}\r\n",
                self.memory.accounted,
                self.process.rss_bytes,
                self.engine.memory_bytes_total,
                self.engine.memory_bytes_live,
                self.memory.log_capacity,
                self.engine.memory_utilisation,
                self.engine.cleaner_bytes_copied,
                self.engine.cleaner_bytes_freed,
                self.engine.write_cost
            );
            for (part, bytes) in &self.memory.parts {
                let _ = write!(s, "ramlog_memory_{part}:{bytes}\r\n");
            }
            s.push_str("\r\n");
        }
        if wants("persistence") {
            let _ = write!(
                s,
                "# Persistence\r\nloading:0\r\nrdb_changes_since_last_save:{}\r\nrdb_last_save_time:{}\r\naof_last_write_status:{}\r\nramlog_persistence:{}\r\nramlog_persistence_status:{}\r\nramlog_persistence_error:{}\r\nramlog_persistence_failures:{}\r\nramlog_persistence_rewrites:{}\r\n\r\n",
                self.process.changes_since_save,
                if self.process.last_save_secs > 0 {
                    self.process.last_save_secs
                } else {
                    self.process.started_secs()
                },
                if self.process.persistence_status == "ok" { "ok" } else { "err" },
                self.process.persistence,
                self.process.persistence_status,
                self.process.persistence_error.replace(['\r', '\n'], " "),
                self.process.persistence_failures,
                self.process.persistence_rewrites,
            );
        }
        if wants("replication") {
            replication_info(&mut s, self.replication.as_ref());
        }
        if wants("stats") {
            // `migrate_cached_sockets` is always 0: MIGRATE opens a connection of its own per
            // call and closes it (Redis keeps them for 10 s).
            let _ = write!(
                s,
                "# Stats\r\ntotal_connections_received:{}\r\ntotal_commands_processed:{}\r\nrejected_connections:{}\r\ntotal_net_input_bytes:{}\r\ntotal_net_output_bytes:{}\r\nkeyspace_hits:{}\r\nkeyspace_misses:{}\r\ntotal_error_replies:{}\r\nmigrate_cached_sockets:0\r\nramlog_protocol_errors:{}\r\nramlog_requests_run_together:{}\r\n\r\n",
                self.connections_total,
                self.commands_total,
                self.connections_rejected,
                self.bytes_in,
                self.bytes_out,
                self.keyspace_hits,
                self.keyspace_misses,
                self.errors.saturating_sub(self.errors_at_reset),
                self.protocol_errors,
                self.requests_run_together
            );
        }
        if wants("commandstats") || section.as_deref() == Some("all") {
            let _ = write!(s, "# Commandstats\r\n");
            for c in &self.commands {
                let _ = write!(
                    s,
                    "cmdstat_{}:calls={},usec={},usec_per_call={:.2},rejected_calls={},failed_calls={}\r\n",
                    c.name,
                    c.calls,
                    c.usec,
                    c.usec as f64 / c.calls.max(1) as f64,
                    c.rejected,
                    c.failed
                );
            }
            s.push_str("\r\n");
        }
        if wants("errorstats") {
            let _ = write!(s, "# Errorstats\r\n");
            for (code, n) in &self.error_codes {
                let _ = write!(s, "errorstat_{code}:count={n}\r\n");
            }
            s.push_str("\r\n");
        }
        if wants("latencystats") || section.as_deref() == Some("all") {
            // Per family of commands (those of `/metrics`): calls and latency quantiles.
            let _ = write!(s, "# Latencystats\r\n");
            for (name, count, h) in &self.ops {
                if *count == 0 {
                    continue;
                }
                let _ = write!(
                    s,
                    "ramlog_latency_{name}:calls={count},usec={},p50_usec_le={},p99_usec_le={}\r\n",
                    h.sum_ns / 1000,
                    h.quantile_us(0.5),
                    h.quantile_us(0.99)
                );
            }
            s.push_str("\r\n");
        }
        if wants("cluster") {
            let _ = write!(
                s,
                "# Cluster\r\ncluster_enabled:{}\r\n\r\n",
                u8::from(cluster_node)
            );
        }
        if wants("keyspace") {
            let _ = write!(s, "# Keyspace\r\n");
            if self.engine.objects > 0 {
                let _ = write!(
                    s,
                    "db0:keys={},expires={},avg_ttl={}\r\n",
                    self.engine.objects,
                    self.engine.objects_expiring,
                    self.engine.objects_expiring_avg_ttl_ms
                );
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(metrics: &Metrics) -> Snapshot {
        let process = ProcessInfo {
            version: "0.1.0",
            pid: 1,
            uptime_secs: 5,
            resp_port: 6380,
            native_port: 7380,
            admin_port: 8380,
            connections_max: 10,
            rss_bytes: 1 << 20,
            persistence: "off".into(),
            persistence_status: "ok",
            persistence_error: String::new(),
            persistence_failures: 0,
            persistence_rewrites: 0,
            changes_since_save: 0,
            last_save_secs: 0,
        };
        let engine = EngineFigures {
            objects: 3,
            memory_bytes_total: 1 << 30,
            memory_waits: 7,
            memory_wait_secs: 0.25,
            memory_bytes_untouched: 1 << 29,
            tablets: 48,
            ..Default::default()
        };
        Snapshot::take(metrics, process, engine, MemoryBreakdown::default())
    }

    #[test]
    fn command_stats_count_each_command_of_the_table() {
        let stats = CommandStats::default();
        let names = || ["get", "set", "blpop"].into_iter();
        stats.ran(0, Duration::from_micros(5), true, false);
        stats.ran(0, Duration::from_micros(3), true, true);
        stats.rejected(0);
        // A blocking command's retry adds time, not a call; out of the table: nothing.
        stats.ran(2, Duration::from_micros(7), true, false);
        stats.ran(2, Duration::from_micros(1), false, false);
        stats.ran(COMMANDS_MAX, Duration::from_micros(1), true, false);
        let read = stats.read(names());
        let figures = |n: &str| read.iter().find(|c| c.name == n).cloned();
        let get = figures("get").unwrap();
        assert_eq!(
            (get.calls, get.usec, get.rejected, get.failed),
            (2, 8, 1, 1)
        );
        let blpop = figures("blpop").unwrap();
        assert_eq!((blpop.calls, blpop.usec), (1, 8));
        assert_eq!(figures("set"), None, "commands never called are left out");
        stats.reset();
        assert!(stats.read(names()).is_empty());
    }

    #[test]
    fn histogram_buckets_and_quantiles() {
        let h = Histogram::default();
        for _ in 0..99 {
            h.record(Duration::from_nanos(1500)); // bucket < 2 µs
        }
        h.record(Duration::from_millis(3)); // bucket < 4096 µs
        let s = h.read();
        assert_eq!(s.count, 100);
        assert_eq!(s.quantile_us(0.5), 2);
        assert_eq!(s.quantile_us(0.99), 2);
        assert_eq!(s.quantile_us(1.0), 4096);
    }

    #[test]
    fn prometheus_and_info_carry_the_same_figures() {
        let m = Metrics::default();
        m.record(Op::Get, Duration::from_micros(3));
        m.record(Op::Get, Duration::from_micros(5));
        m.record(Op::Set, Duration::from_micros(7));
        Metrics::add(&m.connections_total, 4);
        let s = snapshot(&m);
        let prom = s.prometheus();
        assert!(
            prom.contains("ramlog_commands_total{op=\"get\"} 2\n"),
            "{prom}"
        );
        assert!(prom.contains("ramlog_command_duration_seconds_count{op=\"set\"} 1\n"));
        assert!(prom.contains("ramlog_command_duration_seconds_bucket{op=\"get\",le=\"+Inf\"} 2\n"));
        assert!(prom.contains("ramlog_connections_total 4\n"));
        assert!(prom.contains("ramlog_objects 3\n"));
        assert!(prom.contains("ramlog_memory_waits_total 7\n"));
        assert!(prom.contains("ramlog_memory_wait_seconds_total 0.25\n"));
        assert!(prom.contains("ramlog_memory_bytes_untouched 536870912\n"));
        let info = s.info(None, false);
        assert!(info.contains("total_commands_processed:3\r\n"), "{info}");
        assert!(
            info.contains("redis_mode:standalone\r\n") && info.contains("cluster_enabled:0\r\n")
        );
        let node = s.info(None, true);
        assert!(
            node.contains("redis_mode:cluster\r\n")
                && node.contains("# Cluster\r\ncluster_enabled:1\r\n")
        );
        assert!(info.contains("total_connections_received:4\r\n"));
        assert!(info.contains("ramlog_latency_get:calls=2,"), "{info}");
        assert!(info.contains("db0:keys=3,"));
        assert!(info.contains("ramlog_tablets:48\r\n"));
        assert!(prom.contains("ramlog_tablets 48\n"));
        let mut s = s;
        s.cluster = Some(crate::node::figures::ClusterFigures {
            map_version: 9,
            tablets_recovering: 16,
            tablets_waiting_for_room: 5,
            restore_room_bytes: 1 << 20,
            migrations_out: 1,
            migrations_in: 2,
            migration_copied_bytes: 300,
            migration_copy_total_bytes: 1000,
            migration_copy_rate: 50,
        });
        let prom = s.prometheus();
        assert!(
            prom.contains("ramlog_tablets_waiting_for_room 5\n"),
            "{prom}"
        );
        assert!(prom.contains("ramlog_tablets_recovering 16\n"));
        assert!(prom.contains("ramlog_restore_room_bytes 1048576\n"));
        assert!(prom.contains("ramlog_migrations_out 1\n"));
        assert!(prom.contains("ramlog_migrations_in 2\n"));
        assert!(prom.contains("ramlog_migration_copied_bytes 300\n"));
        assert!(prom.contains("ramlog_migration_copy_total_bytes 1000\n"));
        assert!(prom.contains("ramlog_migration_copy_rate_bytes_per_second 50\n"));
        let only = s.info(Some("keyspace"), false);
        assert!(only.starts_with("# Keyspace") && !only.contains("# Server"));
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.contains("\"commands_total\":3"));
    }
}
