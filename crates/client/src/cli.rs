//! The command-line client verbs `ramlog get/set/del/scan/schema/status` (feature `cli`). The binary only
//! parses flags and forwards here; each verb runs on a small current-thread runtime and prints for people
//! and scripts: values and keys raw on stdout one per line, failures on stderr with a non-zero exit.

use crate::query::{
    Aggregate, Cnf, Field, FieldType, KeyFilter, Op, Predicate, Query, Schema, Value,
};
use crate::{
    Client, ClientConfig, ClusterClient, Condition, Expiry, PutOptions, ScanResult,
    NATIVE_PORT_DEFAULT,
};
use anyhow::{anyhow, bail, Context};
use std::io::{Read, Write};
use std::ops::Bound;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Where the server is (for `get`, `set`, `del` and `scan`: any server of a cluster, whose map routes
/// each key to its master). Flags win over the environment variables named beside them.
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
    fn config(&self) -> ClientConfig {
        let mut config = ClientConfig::new(format!("{}:{}", self.host, self.port));
        config.password = self
            .password
            .clone()
            .filter(|p| !p.is_empty())
            .map(String::into_bytes);
        config.request_timeout = Duration::from_millis(self.timeout_ms.max(1));
        config.connect_timeout = config.request_timeout;
        config
    }

    /// A client of this one server.
    async fn client(&self) -> anyhow::Result<Client> {
        let client = Client::connect(self.config()).await?;
        Ok(client.with_table(self.table))
    }

    /// A client of the cluster this server belongs to (or of the server alone when standalone).
    async fn cluster_client(&self) -> anyhow::Result<ClusterClient> {
        let client = ClusterClient::connect(self.config()).await?;
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
#[command(group(clap::ArgGroup::new("key_filter").args(["prefix", "range"])))]
pub struct ScanArgs {
    #[command(flatten)]
    pub connect: ConnectArgs,
    /// Glob pattern (`*`, `?`, `[a-z]`, `\x`); default every key.
    #[arg(long = "match", default_value = "")]
    pub pattern: String,
    /// Keys to visit per step (key listing), or records per page (filtered scan).
    #[arg(long, default_value_t = 1000)]
    pub count: u32,
    /// Run one step from this cursor and print the next cursor first; without it, scan everything
    /// (key listing only).
    #[arg(long)]
    pub cursor: Option<u64>,
    /// Only keys starting with this prefix.
    #[arg(long, conflicts_with = "pattern")]
    pub prefix: Option<String>,
    /// Only keys in `START..END` (START included, END excluded, byte order; either may be empty).
    #[arg(long, conflicts_with = "pattern")]
    pub range: Option<String>,
    /// A predicate `FIELD OP VALUE` over the table's schema (OP: < <= = != >= > prefix, or
    /// `FIELD is null`); `|` joins alternatives (OR) inside one flag; repeated flags are ANDed.
    #[arg(long = "where", value_name = "PREDICATE")]
    pub where_: Vec<String>,
    /// Print only these fields of each record (comma-separated names).
    #[arg(long, value_delimiter = ',')]
    pub fields: Vec<String>,
    /// Print the number of matching records instead of the records.
    #[arg(long = "count-records", alias = "count-only")]
    pub count_records: bool,
    /// Print the sum of this field over the matching records.
    #[arg(long)]
    pub sum: Vec<String>,
    /// Print the smallest value of this field.
    #[arg(long)]
    pub min: Vec<String>,
    /// Print the largest value of this field.
    #[arg(long)]
    pub max: Vec<String>,
    /// Stop after this many records.
    #[arg(long)]
    pub limit: Option<u64>,
    /// Print keys only (filtered scans print `key<TAB>value` by default).
    #[arg(long)]
    pub keys_only: bool,
    /// Print the mean of this numeric field's non-NULL values (repeatable).
    #[arg(long)]
    pub avg: Vec<String>,
    /// With aggregates: one line of them per value of this field.
    #[arg(long)]
    pub group_by: Option<String>,
    /// With --group-by: the most groups; more fail the scan.
    #[arg(long, default_value_t = 1000)]
    pub groups_max: u32,
    /// Against a cluster: read each tablet at a snapshot of its own master, not at one
    /// cluster snapshot (which holds every master's writes for a few milliseconds to cut).
    #[arg(long)]
    pub no_snapshot: bool,
    /// Against a cluster: read each tablet of a `mirror` table on its mirror, so that its
    /// master's foreground is left alone (each at a snapshot of its own, as --no-snapshot).
    #[arg(long)]
    pub from_mirror: bool,
}

impl ScanArgs {
    /// Whether any flag asks for a filtered scan (SCAN_FILTERED) rather than a key listing.
    fn filtered(&self) -> bool {
        self.prefix.is_some()
            || self.range.is_some()
            || !self.where_.is_empty()
            || !self.fields.is_empty()
            || self.count_records
            || !self.sum.is_empty()
            || !self.min.is_empty()
            || !self.max.is_empty()
            || !self.avg.is_empty()
            || self.group_by.is_some()
            || self.limit.is_some()
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct SchemaArgs {
    #[command(subcommand)]
    pub action: SchemaAction,
}

#[derive(clap::Subcommand, Debug, Clone)]
pub enum SchemaAction {
    /// Set a table's schema: `NAME:TYPE,...` with types i32, i64, f64, bool, string, bytes.
    Set {
        #[command(flatten)]
        connect: ConnectArgs,
        /// The table id (overrides --table).
        #[arg(value_name = "TABLE")]
        table_id: u64,
        /// The fields, e.g. `age:i64,name:string,active:bool`.
        spec: String,
    },
    /// Print a table's schema as `NAME:TYPE,...` (empty line when it has none).
    Get {
        #[command(flatten)]
        connect: ConnectArgs,
        /// The table id (overrides --table).
        #[arg(value_name = "TABLE")]
        table_id: u64,
    },
    /// Remove a table's schema.
    Clear {
        #[command(flatten)]
        connect: ConnectArgs,
        /// The table id (overrides --table).
        #[arg(value_name = "TABLE")]
        table_id: u64,
    },
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
        let client = args.connect.cluster_client().await?;
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
        let client = args.connect.cluster_client().await?;
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
        let client = args.connect.cluster_client().await?;
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

/// `ramlog scan`: prints matching keys, one per line; with filter, projection or aggregate flags, runs a
/// filtered scan at one snapshot and prints `key<TAB>value` lines (values decoded by the table's
/// schema when it has one) or one `aggregate value` line per aggregate. Against a cluster, the key
/// listing covers every server, and a filtered scan every tablet (on its master, merged here) at
/// one cluster snapshot (each tablet at its own master's snapshot with `--no-snapshot`);
/// `--cursor` needs a standalone server.
pub fn scan(args: &ScanArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async {
        let cluster = args.connect.cluster_client().await?;
        let pattern = args.pattern.as_bytes();
        if !cluster.is_standalone() {
            if args.filtered() {
                return filtered_scan(args, cluster.seed(), Some(&cluster)).await;
            }
            if args.cursor.is_some() {
                bail!(
                    "--cursor steps through one server's keys; against a cluster, scan without \
                     --cursor (every server is listed)"
                );
            }
            // A key may come back twice if the key set changes meanwhile; print each once.
            let mut seen = std::collections::HashSet::new();
            for key in cluster.scan_all(pattern).await? {
                if seen.insert(key.clone()) {
                    print_line(&key)?;
                }
            }
            return Ok(());
        }
        let client = cluster.seed();
        if args.filtered() {
            return filtered_scan(args, client, None).await;
        }
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

/// A filtered scan of one server's table, or (`cluster` given) of every tablet of a cluster
/// table, each on its master, merged here.
async fn filtered_scan(
    args: &ScanArgs,
    client: Client,
    cluster: Option<&crate::ClusterClient>,
) -> anyhow::Result<()> {
    if args.cursor.is_some() {
        bail!("--cursor is for key listings; a filtered scan pages by itself");
    }
    let schema = match cluster {
        Some(cluster) => cluster.schema()?,
        None => client.get_schema().await?,
    };
    let query = build_query(args, schema.as_ref())?;
    let mut printed = 0u64;
    let limit = args.limit.unwrap_or(u64::MAX);
    let page = args
        .count
        .clamp(1, ramlog_proto::native::SCAN_PAGE_RECORDS_MAX);
    // The schema of the values printed: the projection's, or the table's.
    let out_schema = match (&schema, &query.projection) {
        (Some(s), Some(fields)) => Some(s.project(fields)?),
        (Some(s), None) => Some(s.clone()),
        (None, _) => None,
    };
    let print = |r: &crate::Record| -> anyhow::Result<()> {
        let mut out = std::io::stdout().lock();
        out.write_all(&r.key)?;
        if !args.keys_only {
            out.write_all(b"\t")?;
            match out_schema
                .as_ref()
                .map(|s| s.decode(&r.value).map(|v| (s, v)))
            {
                Some(Ok((s, values))) => out.write_all(render_record(s, &values).as_bytes())?,
                _ => out.write_all(&r.value)?,
            }
        }
        out.write_all(b"\n")?;
        Ok(())
    };
    let offloaded;
    let cluster = match cluster {
        Some(c) if args.from_mirror => {
            offloaded = c.scanning_mirrors(true);
            Some(&offloaded)
        }
        other => other,
    };
    let per_tablet = args.no_snapshot || args.from_mirror;
    let result = match cluster {
        Some(cluster) if query.aggregates.is_empty() => ScanResult::Records {
            records: if per_tablet {
                cluster.scan_records(&query, page).await?
            } else {
                cluster.scan_records_consistent(&query, page).await?.0
            },
            more: None,
            snapshot_version: 0,
        },
        Some(cluster) if per_tablet => {
            ScanResult::Aggregates(cluster.scan_aggregates(&query).await?)
        }
        Some(cluster) => {
            ScanResult::Aggregates(cluster.scan_aggregates_consistent(&query).await?.0)
        }
        None => client.scan_filtered(&query, None, page).await?,
    };
    match result {
        ScanResult::Aggregates(a) if a.groups.is_some() => {
            let field = query
                .group_by
                .map(|g| field_name(schema.as_ref(), g.field))
                .unwrap_or_default();
            for (group, values) in a.groups.iter().flatten() {
                let mut line = format!("{field}={}", render_value(group));
                for (agg, value) in query.aggregates.iter().zip(values) {
                    line.push_str(&format!(
                        "\t{} {}",
                        aggregate_name(agg, schema.as_ref()),
                        render_value(value)
                    ));
                }
                println!("{line}");
            }
        }
        ScanResult::Aggregates(a) => {
            for (agg, value) in query.aggregates.iter().zip(&a.values) {
                println!(
                    "{} {}",
                    aggregate_name(agg, schema.as_ref()),
                    render_value(value)
                );
            }
            if a.malformed > 0 {
                eprintln!(
                    "{} values are not records of the table's schema (skipped)",
                    a.malformed
                );
            }
        }
        ScanResult::Records { records, more, .. } => {
            for r in &records {
                if printed >= limit {
                    break;
                }
                print(r)?;
                printed += 1;
            }
            if let Some(mut more) = more {
                while printed < limit && !more.is_done() {
                    for r in more.next_page(page).await? {
                        if printed >= limit {
                            break;
                        }
                        print(&r)?;
                        printed += 1;
                    }
                }
                more.close().await?;
            }
        }
    }
    Ok(())
}

/// A field's name in the schema (its index without one).
pub fn field_name(schema: Option<&Schema>, i: usize) -> String {
    schema
        .and_then(|s| s.fields().get(i))
        .map(|f| f.name.clone())
        .unwrap_or_else(|| i.to_string())
}

/// How `ramlog scan` names an aggregate: `count`, `sum(FIELD)`, ...
pub fn aggregate_name(agg: &Aggregate, schema: Option<&Schema>) -> String {
    let name = |i: usize| field_name(schema, i);
    match *agg {
        Aggregate::Count => "count".into(),
        Aggregate::Sum(i) => format!("sum({})", name(i)),
        Aggregate::Min(i) => format!("min({})", name(i)),
        Aggregate::Max(i) => format!("max({})", name(i)),
        Aggregate::CountOf(i) => format!("count({})", name(i)),
        Aggregate::Avg(i) => format!("avg({})", name(i)),
    }
}

/// A value for people: numbers and booleans as text, strings quoted, bytes in hex, `null`.
pub fn render_value(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::I32(x) => x.to_string(),
        Value::I64(x) => x.to_string(),
        Value::F64(x) => x.to_string(),
        Value::Bool(x) => x.to_string(),
        Value::Str(s) => format!("{s:?}"),
        Value::Bytes(b) => {
            let mut out = String::from("0x");
            for byte in b {
                out.push_str(&format!("{byte:02x}"));
            }
            out
        }
    }
}

/// A record as `name=value name=value ...`.
pub fn render_record(schema: &Schema, values: &[Value]) -> String {
    schema
        .fields()
        .iter()
        .zip(values)
        .map(|(f, v)| format!("{}={}", f.name, render_value(v)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Parse `NAME:TYPE,...`.
pub fn parse_schema(spec: &str) -> anyhow::Result<Schema> {
    let mut fields = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, ty) = part
            .split_once(':')
            .ok_or_else(|| anyhow!("field {part:?} is not NAME:TYPE"))?;
        let ty = match ty.trim().to_ascii_lowercase().as_str() {
            "i32" => FieldType::I32,
            "i64" | "int" => FieldType::I64,
            "f64" | "float" => FieldType::F64,
            "bool" => FieldType::Bool,
            "string" | "str" => FieldType::String,
            "bytes" => FieldType::Bytes,
            other => bail!("unknown type {other:?} (use i32, i64, f64, bool, string or bytes)"),
        };
        fields.push(Field::new(name.trim(), ty));
    }
    Ok(Schema::new(fields)?)
}

/// A schema as `NAME:TYPE,...`.
pub fn format_schema(schema: &Schema) -> String {
    schema
        .fields()
        .iter()
        .map(|f| {
            let ty = match f.ty {
                FieldType::I32 => "i32",
                FieldType::I64 => "i64",
                FieldType::F64 => "f64",
                FieldType::Bool => "bool",
                FieldType::String => "string",
                FieldType::Bytes => "bytes",
            };
            format!("{}:{ty}", f.name)
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn field_index(schema: Option<&Schema>, name: &str) -> anyhow::Result<usize> {
    let schema = schema
        .ok_or_else(|| anyhow!("field {name:?}: the table has no schema (ramlog schema set)"))?;
    schema.index_of(name).ok_or_else(|| {
        anyhow!(
            "no field {name:?} in the table's schema ({})",
            format_schema(schema)
        )
    })
}

/// Parse a constant for a field of type `ty`: numbers, `true`/`false`, strings (optionally quoted),
/// bytes (quoted text or `0x` hex), `null`.
fn parse_constant(ty: FieldType, text: &str) -> anyhow::Result<Value> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("null") {
        return Ok(Value::Null);
    }
    let unquoted = |t: &str| -> String {
        let b = t.as_bytes();
        if b.len() >= 2 && (b[0] == b'"' || b[0] == b'\'') && b[b.len() - 1] == b[0] {
            t[1..t.len() - 1].to_string()
        } else {
            t.to_string()
        }
    };
    Ok(match ty {
        FieldType::I32 => Value::I32(t.parse().with_context(|| format!("{t:?} is not an i32"))?),
        FieldType::I64 => Value::I64(t.parse().with_context(|| format!("{t:?} is not an i64"))?),
        FieldType::F64 => Value::F64(
            t.parse()
                .with_context(|| format!("{t:?} is not a number"))?,
        ),
        FieldType::Bool => match t.to_ascii_lowercase().as_str() {
            "true" | "1" => Value::Bool(true),
            "false" | "0" => Value::Bool(false),
            _ => bail!("{t:?} is not a bool (true or false)"),
        },
        FieldType::String => Value::Str(unquoted(t)),
        FieldType::Bytes => match t.strip_prefix("0x") {
            Some(hex) if hex.len() % 2 == 0 && hex.bytes().all(|c| c.is_ascii_hexdigit()) => {
                Value::Bytes(
                    (0..hex.len())
                        .step_by(2)
                        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex digits"))
                        .collect(),
                )
            }
            _ => Value::Bytes(unquoted(t).into_bytes()),
        },
    })
}

/// Parse one predicate `FIELD OP VALUE` or `FIELD is null`.
pub fn parse_predicate(text: &str, schema: Option<&Schema>) -> anyhow::Result<Predicate> {
    let t = text.trim();
    let name_end = t
        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.' || c == '-'))
        .unwrap_or(t.len());
    let (name, rest) = t.split_at(name_end);
    if name.is_empty() {
        bail!("predicate {text:?} does not start with a field name");
    }
    let field = field_index(schema, name)?;
    let ty = schema.expect("field_index checked").fields()[field].ty;
    let rest = rest.trim_start();
    let lower = rest.to_ascii_lowercase();
    if lower == "is null" {
        return Ok(Predicate::new(field, Op::IsNull, Value::Null));
    }
    const OPS: [(&str, Op); 9] = [
        ("<=", Op::Le),
        (">=", Op::Ge),
        ("!=", Op::Ne),
        ("==", Op::Eq),
        ("<", Op::Lt),
        (">", Op::Gt),
        ("=", Op::Eq),
        ("prefix ", Op::Prefix),
        ("^=", Op::Prefix),
    ];
    let Some((op_text, op)) = OPS.iter().find(|(o, _)| lower.starts_with(o)) else {
        bail!("predicate {text:?}: expected an operator (< <= = != >= > prefix) or `is null` after {name:?}");
    };
    let value = parse_constant(ty, &rest[op_text.len()..])?;
    Ok(Predicate::new(field, *op, value))
}

/// Parse `START..END` (either side may be empty).
pub fn parse_range(text: &str) -> anyhow::Result<KeyFilter> {
    let (start, end) = text
        .split_once("..")
        .ok_or_else(|| anyhow!("range {text:?} is not START..END"))?;
    let bound = |s: &str, included: bool| {
        if s.is_empty() {
            Bound::Unbounded
        } else if included {
            Bound::Included(s.as_bytes().to_vec())
        } else {
            Bound::Excluded(s.as_bytes().to_vec())
        }
    };
    Ok(KeyFilter::Range {
        start: bound(start, true),
        end: bound(end, false),
    })
}

/// The query the scan flags describe, with field names resolved through `schema`.
pub fn build_query(args: &ScanArgs, schema: Option<&Schema>) -> anyhow::Result<Query> {
    query_of(
        &QuerySpec {
            prefix: args.prefix.as_deref(),
            range: args.range.as_deref(),
            pattern: &args.pattern,
            where_: &args.where_,
            fields: &args.fields,
            count_records: args.count_records,
            sum: &args.sum,
            min: &args.min,
            max: &args.max,
            avg: &args.avg,
            group_by: args.group_by.as_deref(),
            groups_max: args.groups_max,
        },
        schema,
    )
}

/// What a filtered scan asks for, as `ramlog scan`'s flags (and `RAMLOG.SCAN`/`RAMLOG.AGG`'s
/// arguments) give it.
#[derive(Default)]
pub struct QuerySpec<'a> {
    /// Keys starting with this.
    pub prefix: Option<&'a str>,
    /// Keys in `FROM..TO`.
    pub range: Option<&'a str>,
    /// Keys matching this glob (empty: every key).
    pub pattern: &'a str,
    /// Clauses, all of which must hold; each is predicates joined by `|`, one of which must.
    pub where_: &'a [String],
    pub fields: &'a [String],
    pub count_records: bool,
    pub sum: &'a [String],
    pub min: &'a [String],
    pub max: &'a [String],
    pub avg: &'a [String],
    /// One set of aggregates per value of this field.
    pub group_by: Option<&'a str>,
    /// The most groups.
    pub groups_max: u32,
}

/// The query of `args`, with field names resolved through `schema`.
pub fn query_of(args: &QuerySpec<'_>, schema: Option<&Schema>) -> anyhow::Result<Query> {
    let key_filter = if let Some(p) = args.prefix {
        KeyFilter::Prefix(p.as_bytes().to_vec())
    } else if let Some(r) = args.range {
        parse_range(r)?
    } else if !args.pattern.is_empty() {
        KeyFilter::Glob(args.pattern.as_bytes().to_vec())
    } else {
        KeyFilter::All
    };
    let mut clauses = Vec::new();
    for w in args.where_ {
        let clause = w
            .split('|')
            .map(|p| parse_predicate(p, schema))
            .collect::<anyhow::Result<Vec<_>>>()?;
        clauses.push(clause);
    }
    let projection = if args.fields.is_empty() {
        None
    } else {
        Some(
            args.fields
                .iter()
                .map(|f| field_index(schema, f.trim()))
                .collect::<anyhow::Result<Vec<_>>>()?,
        )
    };
    let mut aggregates = Vec::new();
    if args.count_records {
        aggregates.push(Aggregate::Count);
    }
    for f in args.sum {
        aggregates.push(Aggregate::Sum(field_index(schema, f)?));
    }
    for f in args.min {
        aggregates.push(Aggregate::Min(field_index(schema, f)?));
    }
    for f in args.max {
        aggregates.push(Aggregate::Max(field_index(schema, f)?));
    }
    for f in args.avg {
        aggregates.push(Aggregate::Avg(field_index(schema, f)?));
    }
    let group_by = match args.group_by {
        None => None,
        Some(_) if aggregates.is_empty() => {
            bail!("a group-by needs aggregates (--count-records, --sum, --min, --max, --avg)")
        }
        Some(f) => Some(ramlog_query::GroupBy {
            field: field_index(schema, f.trim())?,
            groups_max: args.groups_max,
        }),
    };
    if projection.is_some() && !aggregates.is_empty() {
        bail!(
            "--fields prints records; it cannot be combined with --count-records/--sum/--min/--max"
        );
    }
    Ok(Query {
        key_filter,
        predicate: Cnf { clauses },
        projection,
        aggregates,
        group_by,
    })
}

/// `ramlog schema set|get|clear TABLE`.
pub fn schema(args: &SchemaArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async {
        match &args.action {
            SchemaAction::Set {
                connect,
                table_id: table,
                spec,
            } => {
                let schema = parse_schema(spec)?;
                let client = connect.client().await?.with_table(*table);
                client.set_schema(Some(&schema)).await?;
                println!("OK {}", format_schema(&schema));
            }
            SchemaAction::Get {
                connect,
                table_id: table,
            } => {
                let client = connect.client().await?.with_table(*table);
                match client.get_schema().await? {
                    Some(s) => println!("{}", format_schema(&s)),
                    None => println!(),
                }
            }
            SchemaAction::Clear {
                connect,
                table_id: table,
            } => {
                let client = connect.client().await?.with_table(*table);
                client.set_schema(None).await?;
                println!("OK");
            }
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Wrap {
        #[command(flatten)]
        scan: ScanArgs,
    }

    fn scan_args(args: &[&str]) -> ScanArgs {
        Wrap::try_parse_from(std::iter::once("scan").chain(args.iter().copied()))
            .expect("flags parse")
            .scan
    }

    fn schema() -> Schema {
        parse_schema("a:i64, b:string,flag:bool,x:f64,raw:bytes,n:i32").unwrap()
    }

    #[test]
    fn schema_specs_round_trip() {
        let s = schema();
        assert_eq!(
            format_schema(&s),
            "a:i64,b:string,flag:bool,x:f64,raw:bytes,n:i32"
        );
        assert_eq!(parse_schema(&format_schema(&s)).unwrap(), s);
        assert!(parse_schema("a:int128").is_err());
        assert!(parse_schema("a").is_err());
        assert!(parse_schema("a:i64,a:i32").is_err(), "duplicate names");
    }

    #[test]
    fn where_flags_make_a_cnf() {
        let s = schema();
        let args = scan_args(&[
            "--where",
            "a < 5 | flag = true",
            "--where",
            "b prefix \"ab c\"",
            "--where",
            "x is null|raw = 0x00ff|n >= -3",
            "--prefix",
            "user:",
        ]);
        let q = build_query(&args, Some(&s)).unwrap();
        assert_eq!(q.key_filter, KeyFilter::Prefix(b"user:".to_vec()));
        assert_eq!(
            q.predicate.clauses,
            vec![
                vec![
                    Predicate::new(0, Op::Lt, Value::I64(5)),
                    Predicate::new(2, Op::Eq, Value::Bool(true)),
                ],
                vec![Predicate::new(1, Op::Prefix, Value::Str("ab c".into()))],
                vec![
                    Predicate::new(3, Op::IsNull, Value::Null),
                    Predicate::new(4, Op::Eq, Value::Bytes(vec![0, 255])),
                    Predicate::new(5, Op::Ge, Value::I32(-3)),
                ],
            ]
        );
        assert!(q.projection.is_none() && q.aggregates.is_empty());
        // Each operator.
        for (text, op) in [
            ("a<=1", Op::Le),
            ("a >= 1", Op::Ge),
            ("a != 1", Op::Ne),
            ("a == 1", Op::Eq),
            ("a > 1", Op::Gt),
            ("a = 1", Op::Eq),
        ] {
            assert_eq!(parse_predicate(text, Some(&s)).unwrap().op, op, "{text}");
        }
        // Errors name the problem.
        let e = parse_predicate("nope < 1", Some(&s))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope"), "{e}");
        assert!(parse_predicate("a < x", Some(&s)).is_err());
        assert!(parse_predicate("a ~ 1", Some(&s)).is_err());
        assert!(parse_predicate("a < 1", None)
            .unwrap_err()
            .to_string()
            .contains("no schema"));
    }

    #[test]
    fn projection_aggregates_and_ranges() {
        let s = schema();
        let q = build_query(
            &scan_args(&["--fields", "b,a", "--range", "a..m"]),
            Some(&s),
        )
        .unwrap();
        assert_eq!(q.projection, Some(vec![1, 0]));
        assert_eq!(
            q.key_filter,
            KeyFilter::Range {
                start: Bound::Included(b"a".to_vec()),
                end: Bound::Excluded(b"m".to_vec())
            }
        );
        let q = build_query(
            &scan_args(&["--count-records", "--sum", "a", "--min", "x", "--max", "b"]),
            Some(&s),
        )
        .unwrap();
        assert_eq!(
            q.aggregates,
            vec![
                Aggregate::Count,
                Aggregate::Sum(0),
                Aggregate::Min(3),
                Aggregate::Max(1)
            ]
        );
        assert_eq!(
            parse_range("..z").unwrap(),
            KeyFilter::Range {
                start: Bound::Unbounded,
                end: Bound::Excluded(b"z".to_vec())
            }
        );
        assert!(parse_range("az").is_err());
        assert!(build_query(&scan_args(&["--fields", "a", "--sum", "a"]), Some(&s)).is_err());
        // A glob alone stays a key listing; any filter flag makes a filtered scan.
        assert!(!scan_args(&["--match", "a*"]).filtered());
        assert!(scan_args(&["--match", "a*", "--limit", "3"]).filtered());
        assert!(Wrap::try_parse_from(["scan", "--prefix", "a", "--range", "a..b"]).is_err());
    }

    #[test]
    fn records_render_for_people() {
        let s = schema();
        let values = vec![
            Value::I64(-4),
            Value::Str("hi \"x\"".into()),
            Value::Bool(true),
            Value::Null,
            Value::Bytes(vec![1, 171]),
            Value::I32(7),
        ];
        assert_eq!(
            render_record(&s, &values),
            "a=-4 b=\"hi \\\"x\\\"\" flag=true x=null raw=0x01ab n=7"
        );
    }
}
