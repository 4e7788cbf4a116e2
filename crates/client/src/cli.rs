//! The command-line client verbs `ramlog get/set/del/scan/status` (feature `cli`). The binary only parses
//! flags and forwards here; each verb runs on a small current-thread runtime and prints for people and
//! scripts: values and keys raw on stdout one per line, failures on stderr with a non-zero exit.

use crate::{Client, ClientConfig, Condition, Expiry, PutOptions, NATIVE_PORT_DEFAULT};
use anyhow::{bail, Context};
use std::io::{Read, Write};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Where the server is. Flags win over the environment variables named beside them.
#[derive(clap::Args, Debug, Clone)]
pub struct ConnectArgs {
    /// Server host.
    #[arg(long, default_value = "127.0.0.1", env = "RAMLOG_HOST")]
    pub host: String,
    /// Native protocol port.
    #[arg(long, short = 'p', default_value_t = NATIVE_PORT_DEFAULT, env = "RAMLOG_NATIVE_PORT")]
    pub port: u16,
    /// Password, when the server requires one.
    #[arg(long, env = "RAMLOG_PASSWORD", hide_env_values = true)]
    pub password: Option<String>,
    /// Per-request timeout in milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub timeout_ms: u64,
    /// Table id.
    #[arg(long, default_value_t = 0)]
    pub table: u64,
}

impl ConnectArgs {
    async fn client(&self) -> anyhow::Result<Client> {
        let mut config = ClientConfig::new(format!("{}:{}", self.host, self.port));
        config.password = self
            .password
            .clone()
            .filter(|p| !p.is_empty())
            .map(String::into_bytes);
        config.request_timeout = Duration::from_millis(self.timeout_ms.max(1));
        config.connect_timeout = config.request_timeout;
        let client = Client::connect(config).await?;
        Ok(client.with_table(self.table))
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct GetArgs {
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// The key.
    pub key: String,
    /// Also print the version and expiry (unix ms, 0 = none) on a second line.
    #[arg(long)]
    pub show_version: bool,
}

#[derive(clap::Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("condition").args(["if_absent", "if_exists", "if_version"])))]
#[command(group(clap::ArgGroup::new("expiry").args(["ttl_ms", "expire_at_ms", "keep_ttl"])))]
pub struct SetArgs {
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// The key.
    pub key: String,
    /// The value; `-` reads it from standard input.
    pub value: String,
    /// Only if the key does not exist.
    #[arg(long)]
    pub if_absent: bool,
    /// Only if the key exists.
    #[arg(long)]
    pub if_exists: bool,
    /// Only if the key's current version is this one (compare-and-set).
    #[arg(long)]
    pub if_version: Option<u64>,
    /// Expire this many milliseconds from now.
    #[arg(long)]
    pub ttl_ms: Option<u64>,
    /// Expire at this unix time in milliseconds.
    #[arg(long)]
    pub expire_at_ms: Option<u64>,
    /// Keep the previous value's expiry.
    #[arg(long)]
    pub keep_ttl: bool,
}

#[derive(clap::Args, Debug, Clone)]
pub struct DelArgs {
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// Keys to delete.
    #[arg(required = true)]
    pub keys: Vec<String>,
    /// Only if the key's current version is this one (one key only).
    #[arg(long)]
    pub if_version: Option<u64>,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ScanArgs {
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// Glob pattern (`*`, `?`, `[a-z]`, `\x`); default every key.
    #[arg(long = "match", default_value = "")]
    pub pattern: String,
    /// Keys to visit per step.
    #[arg(long, default_value_t = 1000)]
    pub count: u32,
    /// Run one step from this cursor and print the next cursor first; without it, scan everything.
    #[arg(long)]
    pub cursor: Option<u64>,
}

#[derive(clap::Args, Debug, Clone)]
pub struct StatusArgs {
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// Admin HTTP port of the server (its `/status` JSON is preferred over the native STATS reply).
    #[arg(long, default_value_t = 8380, env = "RAMLOG_ADMIN_PORT")]
    pub admin_port: u16,
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")
}

fn print_line(bytes: &[u8]) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(bytes)?;
    out.write_all(b"\n")?;
    Ok(())
}

/// `ramlog get KEY`: prints the value; exits 1 with `(nil)` on stderr when the key is absent.
pub fn get(args: &GetArgs) -> anyhow::Result<()> {
    let object = runtime()?.block_on(async {
        let client = args.connect.client().await?;
        Ok::<_, anyhow::Error>(client.get(args.key.as_bytes()).await?)
    })?;
    match object {
        Some(o) => {
            print_line(&o.value)?;
            if args.show_version {
                println!("version {} expire_at_ms {}", o.version, o.expire_at_ms);
            }
            Ok(())
        }
        None => {
            eprintln!("(nil)");
            std::process::exit(1);
        }
    }
}

/// `ramlog set KEY VALUE`: prints `OK version N`.
pub fn set(args: &SetArgs) -> anyhow::Result<()> {
    let value = if args.value == "-" {
        let mut v = Vec::new();
        std::io::stdin()
            .read_to_end(&mut v)
            .context("reading the value from stdin")?;
        v
    } else {
        args.value.clone().into_bytes()
    };
    let condition = match (args.if_absent, args.if_exists, args.if_version) {
        (true, _, _) => Condition::IfAbsent,
        (_, true, _) => Condition::IfExists,
        (_, _, Some(v)) => Condition::IfVersion(v),
        _ => Condition::None,
    };
    let expiry = match (args.ttl_ms, args.expire_at_ms, args.keep_ttl) {
        (Some(ms), _, _) => Expiry::AfterMs(ms),
        (_, Some(at), _) => Expiry::AtUnixMs(at),
        (_, _, true) => Expiry::Keep,
        _ => Expiry::None,
    };
    let result = runtime()?.block_on(async {
        let client = args.connect.client().await?;
        let options = PutOptions {
            condition,
            expiry,
            return_old: false,
        };
        Ok::<_, anyhow::Error>(
            client
                .put_with(args.key.as_bytes(), &value, options)
                .await?,
        )
    })?;
    println!("OK version {}", result.version);
    Ok(())
}

/// `ramlog del KEY...`: prints how many keys existed and were deleted.
pub fn del(args: &DelArgs) -> anyhow::Result<()> {
    if args.if_version.is_some() && args.keys.len() != 1 {
        bail!("--if-version takes exactly one key");
    }
    let condition = args
        .if_version
        .map(Condition::IfVersion)
        .unwrap_or(Condition::None);
    let deleted = runtime()?.block_on(async {
        let client = args.connect.client().await?;
        let mut deleted = 0u64;
        for key in &args.keys {
            if client
                .delete_with(key.as_bytes(), condition)
                .await?
                .is_some()
            {
                deleted += 1;
            }
        }
        Ok::<_, anyhow::Error>(deleted)
    })?;
    println!("{deleted}");
    Ok(())
}

/// `ramlog scan`: prints matching keys, one per line.
pub fn scan(args: &ScanArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async {
        let client = args.connect.client().await?;
        let pattern = args.pattern.as_bytes();
        if let Some(cursor) = args.cursor {
            let (next, keys) = client.scan_keys(cursor, args.count, pattern).await?;
            println!("{next}");
            for key in keys {
                print_line(&key)?;
            }
            return Ok(());
        }
        // A full iteration may return a key twice (Redis SCAN's guarantee); print each once.
        let mut seen = std::collections::HashSet::new();
        let mut cursor = 0;
        loop {
            let (next, keys) = client.scan_keys(cursor, args.count, pattern).await?;
            for key in keys {
                if seen.insert(key.clone()) {
                    print_line(&key)?;
                }
            }
            if next == 0 {
                return Ok(());
            }
            cursor = next;
        }
    })
}

/// `ramlog status`: the server's `/status` JSON from its admin port, or the native STATS reply when the
/// admin endpoint cannot be reached.
pub fn status(args: &StatusArgs) -> anyhow::Result<()> {
    let json = runtime()?.block_on(async {
        let timeout = Duration::from_millis(args.connect.timeout_ms.max(1));
        let admin = format!("{}:{}", args.connect.host, args.admin_port);
        match tokio::time::timeout(timeout, http_get(&admin, "/status")).await {
            Ok(Ok(body)) => Ok::<_, anyhow::Error>(body),
            _ => {
                let client = args.connect.client().await?;
                Ok(client.stats().await?)
            }
        }
    })?;
    match serde_json::from_str::<serde_json::Value>(&json) {
        Ok(value) => println!("{}", serde_json::to_string_pretty(&value)?),
        Err(_) => println!("{json}"),
    }
    Ok(())
}

/// A minimal HTTP/1.0 GET: enough for the admin endpoint on this machine, no client library needed.
async fn http_get(addr: &str, path: &str) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    stream.take(16 << 20).read_to_end(&mut response).await?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("malformed HTTP response")?;
    let status_line = head.lines().next().unwrap_or("");
    if status_line.split_whitespace().nth(1) != Some("200") {
        bail!("admin endpoint answered {status_line}");
    }
    Ok(body.to_string())
}
