//! Server configuration: defaults, the TOML file, and overrides from flags and environment variables.
//!
//! Precedence, lowest to highest: built-in defaults, the TOML file (`--config FILE` or
//! `RAMLOG_CONFIG`), environment variables (`RAMLOG_*`), command-line flags. The CLI layer
//! (`ramlog server`'s command line) turns flags and environment variables into a [`ConfigOverrides`]; this module
//! knows nothing of clap. Every limit has a named field with its unit in the name.

use serde::{Deserialize, Deserializer, Serialize};
use std::net::IpAddr;
use std::path::{Path, PathBuf};

/// Errors in a configuration file or value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("invalid value for {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}

/// How writes reach disk on a single server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PersistenceMode {
    /// Memory only: nothing is written to disk, a restart starts empty.
    #[default]
    Off,
    /// Writes are acknowledged at once and flushed to disk in the background every
    /// `flush_interval_ms` (Redis's `appendfsync everysec`, at a finer grain).
    Async,
    /// A write is acknowledged only after it is on disk (fdatasync).
    Durable,
}

/// How the kernel schedules the server's threads (Linux; elsewhere the setting has no effect).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CpuScheduling {
    /// `SCHED_BATCH`: a waking server thread does not preempt the thread running on its core
    /// (often a client on the same machine); it runs when that thread's time slice ends or a core
    /// is free. Same priority, no privileges needed.
    #[default]
    Batch,
    /// The kernel's default policy (`SCHED_OTHER`).
    Normal,
}

impl std::str::FromStr for PersistenceMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "off" | "none" => Ok(PersistenceMode::Off),
            "async" | "everysec" => Ok(PersistenceMode::Async),
            "durable" | "always" => Ok(PersistenceMode::Durable),
            other => Err(format!(
                "unknown persistence mode {other:?} (use off, async or durable)"
            )),
        }
    }
}

impl std::fmt::Display for PersistenceMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PersistenceMode::Off => "off",
            PersistenceMode::Async => "async",
            PersistenceMode::Durable => "durable",
        })
    }
}

/// Tablets of table 0 in a new data directory (or with persistence off) when the configuration
/// names no count. With two workers, 64 tablets make two writers meet on one tablet's lock a
/// quarter as often as 16 did (docs/benchmarks/history/resp.md).
pub const TABLETS_DEFAULT: u16 = 64;
/// Most tablets table 0 may be split into.
pub const TABLETS_MAX: u16 = 1024;
/// The longest a routing-port request may wait for a failed master's replacement (a client
/// waits at most this plus the forward itself).
pub const ROUTING_RECOVERY_WAIT_MAX_MS: u64 = 600_000;

/// Everything one server process needs to start.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address every listener binds to. Loopback unless configured otherwise.
    pub bind: IpAddr,
    /// RESP (Redis protocol) port.
    pub resp_port: u16,
    /// Native binary protocol port; 0 turns the listener off.
    pub native_port: u16,
    /// Admin HTTP port (`/metrics`, `/status`); 0 turns it off.
    pub admin_port: u16,
    /// Where persistent data lives.
    pub data_dir: PathBuf,
    /// The engine's fixed memory budget (`1GiB`, `512MiB`, or a number of bytes).
    #[serde(
        alias = "memory",
        deserialize_with = "de_size",
        serialize_with = "ser_size"
    )]
    pub memory_bytes: u64,
    /// Optional password; when set, clients must AUTH (or HELLO ... AUTH) first.
    pub password: Option<String>,
    /// Simultaneous client connections (RESP and native together); more are refused with an error.
    pub connections_max: usize,
    /// Largest single argument (bulk string) in a request.
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub request_arg_size_max_bytes: u64,
    /// Largest whole request.
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub request_size_max_bytes: u64,
    /// Most arguments in one request.
    pub request_args_max: usize,
    /// Largest key.
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub key_size_max_bytes: u64,
    /// Largest value.
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub value_size_max_bytes: u64,
    /// Most pipelined commands answered in one batch; the rest wait (backpressure, no error).
    pub pipeline_depth_max: usize,
    /// Replies buffered for one connection before they are written out.
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub reply_buffer_max_bytes: u64,
    /// Close connections idle for this long; 0 = never.
    pub idle_timeout_secs: u64,
    /// Close a connection whose replies cannot be written for this long (a client that stopped reading).
    pub write_timeout_secs: u64,
    /// Tokio worker threads serving connections.
    pub worker_threads: usize,
    /// Tablets of the single-server table 0 (the 16384 slots split evenly), so writers spread.
    /// Unset = the count recorded in the data directory, or [`TABLETS_DEFAULT`] for a new one.
    pub tablets: Option<u16>,
    /// Persistence mode for a single server.
    pub persistence: PersistenceMode,
    /// Background flush period in `async` persistence.
    pub flush_interval_ms: u64,
    /// A snapshot (native SNAPSHOT_OPEN, or the one a scan takes) older than this is released and
    /// answers "snapshot too old".
    pub snapshot_max_age_ms: u64,
    /// A snapshot is released ("snapshot too old") once more than this many bytes of superseded
    /// versions were kept since it opened; unset = an eighth of `memory`.
    #[serde(
        default,
        deserialize_with = "de_opt_size",
        serialize_with = "ser_opt_size"
    )]
    pub snapshot_max_retained_bytes: Option<u64>,
    /// Threads one scan pass over a tablet may use (0 = one per core). Fewer leave cores to
    /// point requests while analytic scans run.
    pub scan_threads: usize,
    /// Scheduling policy of every server thread (workers, cleaner, persistence, scans).
    pub cpu_scheduling: CpuScheduling,
    /// Microseconds a worker that ran out of work keeps its core before it sleeps (0 = sleep at
    /// once). A request that arrives meanwhile is picked up when the spin ends, without a wake-up
    /// for the client's send to pay for; each such idle moment costs up to this much CPU.
    pub worker_idle_spin_us: u64,
    /// Coordinator members' addresses (`host:port,host:port`): set, the server joins that cluster
    /// and serves the tablets its map gives it; unset, it is a standalone server.
    pub coordinator: Option<String>,
    /// The routing port: RESP for clients that know nothing of clusters, any key on any server
    /// (cluster mode only); 0 turns it off.
    pub routing_port: u16,
    /// The routing port: how long a request waits for the map to name a new master of its slot
    /// when the old one failed (the tablet is being recovered, or could not be reached before
    /// the request was sent), before it is answered `-TRYAGAIN`. 0 answers at once.
    pub routing_recovery_wait_ms: u64,
    /// How often a cluster server heartbeats the coordinator.
    pub heartbeat_interval_ms: u64,
    /// How long a starting cluster server keeps trying to register with the coordinator (while
    /// it is unreachable, or the previous process of this id still heartbeats) before it gives
    /// up with an error.
    pub join_timeout_ms: u64,
    /// Replication: bytes of a backup's stream that may be not yet durable on it before the
    /// replies to further writes to it wait (in every mode); bounds what each stream holds.
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub replication_in_flight_bytes: u64,
    /// Replication: a backup that leaves a write unacknowledged this long is reported to the
    /// coordinator as suspect.
    pub backup_timeout_ms: u64,
    /// Replication: the longest a reply waits for its backups' acknowledgement. Past it the
    /// write (or a read that waited on writes in flight) fails with an error saying its outcome
    /// is unknown, as for any write in doubt.
    pub replication_ack_timeout_ms: u64,
    /// How often the chunks of large collections that no key names any more (the collection
    /// was overwritten or expired, or a rewrite stopped half way) are looked for and deleted.
    pub large_sweep_interval_ms: u64,
    /// Re-protection: the most bytes per second the copy of one tablet to one backup may send
    /// (after a recovery or a backup's replacement). Below it the copy is paced by the clients'
    /// latency: it halves its rate after every 100 ms in which this server's command p99 was
    /// above twice its usual p99 (at least 2 ms), and grows again when it is not
    /// (`cluster::pacing`). 0: no ceiling and no pacing.
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub recovery_copy_bytes_per_sec: u64,
    /// The most live bytes one tablet may hold on its master; past it, writes that would grow
    /// the tablet are refused with -OOM naming the limit (deletes, and overwrites no larger than
    /// what they replace, go on) until keys are deleted or the tablet's slots move. A backup
    /// keeps one log per tablet of at most 512 MiB (`ramlog_backup::Config`'s
    /// `tablet_log_capacity_bytes`); the default, three quarters of it, leaves its
    /// reorganization room for superseded versions. Larger values are lowered to that default.
    #[serde(deserialize_with = "de_size", serialize_with = "ser_size")]
    pub tablet_max_bytes: u64,
}

/// The largest `tablet_max_bytes`: three quarters of a backup's log of one tablet.
pub fn tablet_max_bytes_limit() -> u64 {
    ramlog_backup::Config::default().tablet_log_capacity_bytes / 4 * 3
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            bind: IpAddr::from([127, 0, 0, 1]),
            resp_port: 6380,
            native_port: 7380,
            admin_port: 8380,
            data_dir: PathBuf::from("./ramlog-data"),
            memory_bytes: 1 << 30,
            password: None,
            connections_max: 10_000,
            request_arg_size_max_bytes: 16 << 20,
            request_size_max_bytes: 64 << 20,
            request_args_max: 1024 * 1024,
            key_size_max_bytes: ramlog_common::KEY_SIZE_MAX_BYTES_DEFAULT as u64,
            value_size_max_bytes: ramlog_common::VALUE_SIZE_MAX_BYTES_DEFAULT as u64,
            pipeline_depth_max: 1024,
            reply_buffer_max_bytes: 1 << 20,
            idle_timeout_secs: 0,
            write_timeout_secs: 30,
            worker_threads: 2,
            tablets: None,
            persistence: PersistenceMode::Async,
            flush_interval_ms: 100,
            snapshot_max_age_ms: 60_000,
            snapshot_max_retained_bytes: None,
            scan_threads: 0,
            cpu_scheduling: CpuScheduling::Batch,
            worker_idle_spin_us: 20,
            coordinator: None,
            routing_port: 0,
            routing_recovery_wait_ms: 10_000,
            heartbeat_interval_ms: 100,
            join_timeout_ms: 30_000,
            replication_in_flight_bytes: 16 << 20,
            backup_timeout_ms: 200,
            replication_ack_timeout_ms: 5000,
            large_sweep_interval_ms: 30_000,
            recovery_copy_bytes_per_sec: 128 << 20,
            tablet_max_bytes: tablet_max_bytes_limit(),
        }
    }
}

/// Values given on the command line or in the environment; `None` keeps the file's or default value.
#[derive(Debug, Clone, Default)]
pub struct ConfigOverrides {
    pub bind: Option<IpAddr>,
    pub resp_port: Option<u16>,
    pub native_port: Option<u16>,
    pub admin_port: Option<u16>,
    pub data_dir: Option<PathBuf>,
    pub memory_bytes: Option<u64>,
    pub password: Option<String>,
    pub connections_max: Option<usize>,
    pub idle_timeout_secs: Option<u64>,
    pub worker_threads: Option<usize>,
    pub persistence: Option<PersistenceMode>,
    pub coordinator: Option<String>,
    pub routing_port: Option<u16>,
}

impl ServerConfig {
    /// The largest value the engine, the backups and the persistence log hold: the largest value
    /// a client may write, plus what the typed-value encoding puts in front of a string that
    /// begins with its tag byte (docs/formats.md, "Typed values").
    pub fn stored_value_max_bytes(&self) -> u64 {
        self.value_size_max_bytes + ramlog_proto::types::TAG_BYTES as u64
    }

    /// Defaults, then the file (if any), then the overrides; checked before it is returned.
    pub fn load(
        file: Option<&Path>,
        overrides: &ConfigOverrides,
    ) -> Result<ServerConfig, ConfigError> {
        let mut config = match file {
            Some(path) => Self::from_file(path)?,
            None => ServerConfig::default(),
        };
        config.apply(overrides);
        config.validate()?;
        Ok(config)
    }

    pub fn from_file(path: &Path) -> Result<ServerConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml(&text).map_err(|source| ConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }

    pub fn from_toml(text: &str) -> Result<ServerConfig, toml::de::Error> {
        toml::from_str(text)
    }

    pub fn apply(&mut self, o: &ConfigOverrides) {
        macro_rules! set {
            ($field:ident) => {
                if let Some(v) = &o.$field {
                    self.$field = v.clone();
                }
            };
        }
        set!(bind);
        set!(resp_port);
        set!(native_port);
        set!(admin_port);
        set!(data_dir);
        set!(memory_bytes);
        set!(connections_max);
        set!(idle_timeout_secs);
        set!(worker_threads);
        set!(persistence);
        set!(routing_port);
        if let Some(c) = &o.coordinator {
            self.coordinator = if c.is_empty() { None } else { Some(c.clone()) };
        }
        if let Some(p) = &o.password {
            self.password = if p.is_empty() { None } else { Some(p.clone()) };
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |field, reason: &str| {
            Err(ConfigError::Invalid {
                field,
                reason: reason.to_string(),
            })
        };
        if self.memory_bytes < 16 << 20 {
            return invalid("memory", "must be at least 16MiB");
        }
        if self.connections_max == 0 {
            return invalid("connections_max", "must be at least 1");
        }
        if self.worker_threads == 0 || self.worker_threads > 256 {
            return invalid("worker_threads", "must be 1..=256");
        }
        if self
            .tablets
            .is_some_and(|t| !(1..=TABLETS_MAX).contains(&t))
        {
            return invalid("tablets", &format!("must be 1..={TABLETS_MAX}"));
        }
        if self.pipeline_depth_max == 0 {
            return invalid("pipeline_depth_max", "must be at least 1");
        }
        if self.key_size_max_bytes == 0 || self.value_size_max_bytes == 0 {
            return invalid(
                "key_size_max_bytes",
                "key and value limits must be positive",
            );
        }
        if self.request_arg_size_max_bytes < self.value_size_max_bytes.max(self.key_size_max_bytes)
        {
            return invalid(
                "request_arg_size_max_bytes",
                "must be at least the key and value limits",
            );
        }
        if self.request_size_max_bytes < self.request_arg_size_max_bytes {
            return invalid(
                "request_size_max_bytes",
                "must be at least request_arg_size_max_bytes",
            );
        }
        if self.routing_recovery_wait_ms > ROUTING_RECOVERY_WAIT_MAX_MS {
            return invalid(
                "routing_recovery_wait_ms",
                &format!("must be 0..={ROUTING_RECOVERY_WAIT_MAX_MS}"),
            );
        }
        if self.large_sweep_interval_ms == 0 {
            return invalid("large_sweep_interval_ms", "must be at least 1");
        }
        if self.replication_ack_timeout_ms == 0 {
            return invalid("replication_ack_timeout_ms", "must be at least 1");
        }
        if self.replication_in_flight_bytes < 1 << 20 {
            return invalid("replication_in_flight_bytes", "must be at least 1MiB");
        }
        if self.request_args_max < 3 {
            return invalid("request_args_max", "must be at least 3");
        }
        if self.resp_port != 0
            && (self.resp_port == self.native_port || self.resp_port == self.admin_port)
        {
            return invalid("resp_port", "ports must differ");
        }
        if self.native_port != 0 && self.native_port == self.admin_port {
            return invalid("native_port", "ports must differ");
        }
        if self.persistence != PersistenceMode::Off && self.flush_interval_ms == 0 {
            return invalid("flush_interval_ms", "must be positive");
        }
        if self.worker_idle_spin_us > 1000 {
            return invalid("worker_idle_spin_us", "must be 0..=1000");
        }
        if self.scan_threads > 256 {
            return invalid("scan_threads", "must be 0..=256");
        }
        if self.snapshot_max_age_ms == 0 {
            return invalid("snapshot_max_age_ms", "must be positive");
        }
        Ok(())
    }
}

fn de_size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Number(u64),
        Text(String),
    }
    match Size::deserialize(d)? {
        Size::Number(n) => Ok(n),
        Size::Text(s) => ramlog_common::parse_size_bytes(&s).map_err(serde::de::Error::custom),
    }
}

fn ser_size<S: serde::Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(*v)
}

fn de_opt_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_size(d).map(Some)
}

fn ser_opt_size<S: serde::Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.serialize_u64(*v),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_safe_and_valid() {
        let c = ServerConfig::default();
        assert!(c.bind.is_loopback());
        assert_eq!(c.password, None);
        c.validate().unwrap();
    }

    #[test]
    fn file_then_overrides() {
        let c = ServerConfig::from_toml(
            "resp_port = 7000\nmemory = \"2GiB\"\npassword = \"pw\"\npersistence = \"durable\"\n",
        )
        .unwrap();
        assert_eq!(c.resp_port, 7000);
        assert_eq!(c.memory_bytes, 2 << 30);
        assert_eq!(c.persistence, PersistenceMode::Durable);
        assert_eq!(c.admin_port, 8380, "unset keys keep defaults");
        let mut c2 = c.clone();
        c2.apply(&ConfigOverrides {
            resp_port: Some(7001),
            password: Some(String::new()),
            ..Default::default()
        });
        assert_eq!(c2.resp_port, 7001);
        assert_eq!(
            c2.password, None,
            "an empty password override turns AUTH off"
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_errors() {
        assert!(ServerConfig::from_toml("resp_prot = 1\n").is_err());
        assert!(ServerConfig::from_toml("memory_bytes = \"lots\"\n").is_err());
        let mut c = ServerConfig {
            memory_bytes: 1024,
            ..Default::default()
        };
        assert!(c.validate().is_err());
        c.memory_bytes = 1 << 30;
        c.admin_port = c.resp_port;
        assert!(c.validate().is_err());
    }

    #[test]
    fn snapshot_bounds() {
        let c = ServerConfig::from_toml(
            "snapshot_max_age_ms = 250\nsnapshot_max_retained_bytes = \"8MiB\"\n",
        )
        .unwrap();
        assert_eq!(c.snapshot_max_age_ms, 250);
        assert_eq!(c.snapshot_max_retained_bytes, Some(8 << 20));
        assert_eq!(ServerConfig::default().snapshot_max_retained_bytes, None);
        let c = ServerConfig {
            snapshot_max_age_ms: 0,
            ..Default::default()
        };
        assert!(c.validate().is_err());
    }

    #[test]
    fn scan_threads_setting() {
        assert_eq!(ServerConfig::default().scan_threads, 0);
        let c = ServerConfig::from_toml("scan_threads = 1\n").unwrap();
        assert_eq!(c.scan_threads, 1);
        let c = ServerConfig {
            scan_threads: 100_000,
            ..Default::default()
        };
        assert!(c.validate().is_err());
    }

    #[test]
    fn tablets_setting() {
        assert_eq!(ServerConfig::default().tablets, None);
        let c = ServerConfig::from_toml("tablets = 16\n").unwrap();
        assert_eq!(c.tablets, Some(16));
        for bad in [0, TABLETS_MAX + 1] {
            let c = ServerConfig {
                tablets: Some(bad),
                ..Default::default()
            };
            assert!(c.validate().is_err(), "{bad} tablets");
        }
    }

    #[test]
    fn routing_recovery_wait_setting() {
        assert_eq!(ServerConfig::default().routing_recovery_wait_ms, 10_000);
        let c = ServerConfig::from_toml("routing_recovery_wait_ms = 0\n").unwrap();
        assert_eq!(c.routing_recovery_wait_ms, 0);
        c.validate().unwrap();
        let c = ServerConfig {
            routing_recovery_wait_ms: ROUTING_RECOVERY_WAIT_MAX_MS + 1,
            ..Default::default()
        };
        assert!(c.validate().is_err());
    }

    #[test]
    fn cpu_scheduling_setting() {
        assert_eq!(ServerConfig::default().cpu_scheduling, CpuScheduling::Batch);
        let c = ServerConfig::from_toml("cpu_scheduling = \"normal\"\n").unwrap();
        assert_eq!(c.cpu_scheduling, CpuScheduling::Normal);
        assert!(ServerConfig::from_toml("cpu_scheduling = \"realtime\"\n").is_err());
    }

    #[test]
    fn worker_idle_spin_setting() {
        assert_eq!(ServerConfig::default().worker_idle_spin_us, 20);
        let c = ServerConfig::from_toml("worker_idle_spin_us = 0\n").unwrap();
        assert_eq!(c.worker_idle_spin_us, 0);
        let c = ServerConfig {
            worker_idle_spin_us: 5000,
            ..Default::default()
        };
        assert!(c.validate().is_err());
    }

    #[test]
    fn persistence_mode_names() {
        assert_eq!(
            "everysec".parse::<PersistenceMode>(),
            Ok(PersistenceMode::Async)
        );
        assert_eq!(
            "DURABLE".parse::<PersistenceMode>(),
            Ok(PersistenceMode::Durable)
        );
        assert!("sometimes".parse::<PersistenceMode>().is_err());
    }
}
