//! `RAMLOG.AGG` and `RAMLOG.SCAN`: filtered scans and aggregates of a table from any Redis
//! client (`docs/protocol.md`, "Scans from Redis clients"). They run on this server's own native
//! port through the Rust client, as `ramlog scan` does: against a cluster, every tablet on its
//! master, at one cluster snapshot (or each at its master's own with `NOSNAPSHOT`), merged here;
//! standalone, at one snapshot of this server.
//!
//! ```text
//! RAMLOG.AGG  TABLE [WHERE PRED]... [PREFIX P | MATCH GLOB | RANGE FROM..TO]
//!             [COUNT] [SUM F]... [MIN F]... [MAX F]... [AVG F]...
//!             [GROUPBY F [MAXGROUPS N]] [NOSNAPSHOT | MIRROR]
//! RAMLOG.SCAN TABLE [WHERE PRED]... [PREFIX P | MATCH GLOB | RANGE FROM..TO]
//!             [FIELDS F,G...] [LIMIT N] [NOSNAPSHOT | MIRROR]
//! RAMLOG.SCAN TABLE [WHERE PRED]... [...] [FIELDS F,G...] CURSOR C [COUNT N]
//! ```
//!
//! `TABLE` is a table's name or id (0 is the table Redis commands use). `PRED` is `FIELD OP
//! VALUE` with OP one of `< <= = != >= >`; predicates joined by `|` in one WHERE form a clause
//! any of which holds; every WHERE must hold. RAMLOG.AGG answers `name value` pairs (a map in
//! RESP3), or with GROUPBY one array per group: the group's value, then its `name value` pairs
//! (at most MAXGROUPS groups, 1000 unless given; more is an error); RAMLOG.SCAN answers `[matched, [[key, value], ...]]`: how many records match in all,
//! and the first LIMIT of them (1000 unless given), values shown by the table's schema as
//! `field=value ...`. With CURSOR (a cluster), RAMLOG.SCAN steps like Redis SCAN: `[next cursor,
//! [[key, value], ...]]`, about COUNT records (100 unless given) per step, cursor 0 to start and
//! at the end; the cursor is held by no server, so any client can continue it
//! (`ClusterClient::scan_step`).

use crate::front::commands::Session;
use crate::node::Node;
use ramlog_client::cli::{aggregate_name, query_of, render_record, QuerySpec};
use ramlog_client::query::{Aggregate, Query, Value};
use ramlog_client::{ClientConfig, ClusterClient, Record};
use ramlog_proto::resp::ReplyEncoder;
use std::sync::Arc;

/// What leads a RAMLOG.SCAN reply.
enum Head {
    /// The cursor of the next step (0 at the end).
    Cursor(u64),
    /// How many records match in all.
    Matched(u64),
}

/// Records per step of a RAMLOG.SCAN ... CURSOR unless COUNT says otherwise.
const STEP_DEFAULT: usize = 100;
/// Groups a RAMLOG.AGG ... GROUPBY may have unless MAXGROUPS says otherwise.
const GROUPS_DEFAULT: u32 = 1000;
/// Records a RAMLOG.SCAN answers unless LIMIT says otherwise, and at most.
const LIMIT_DEFAULT: usize = 1000;
const LIMIT_MAX: usize = 100_000;
/// Records per page read from each tablet.
const PAGE_RECORDS: u32 = 1000;

/// Whether `name` is RAMLOG.AGG or RAMLOG.SCAN.
pub fn is_analytic(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"ramlog.agg") || name.eq_ignore_ascii_case(b"ramlog.scan")
}

/// The client this server's analytic commands use: connected to its own native port.
static CLIENT: tokio::sync::OnceCell<ClusterClient> = tokio::sync::OnceCell::const_new();

async fn client(node: &Node) -> Result<ClusterClient, String> {
    CLIENT
        .get_or_try_init(|| async {
            let native = node.addresses().native.ok_or_else(|| {
                "ERR RAMLOG.SCAN and RAMLOG.AGG need the server's native port (--native-port)"
                    .to_string()
            })?;
            let port = native.port();
            let mut config = ClientConfig::new(format!("127.0.0.1:{port}"));
            config.password = node.config.password.clone().map(String::into_bytes);
            ClusterClient::connect(config)
                .await
                .map_err(|e| format!("ERR cannot reach this server's native port: {e}"))
        })
        .await
        .cloned()
}

/// What the command asked for.
#[derive(Default)]
struct Request {
    aggregate: bool,
    table: String,
    prefix: Option<String>,
    pattern: String,
    range: Option<String>,
    where_: Vec<String>,
    fields: Vec<String>,
    count: bool,
    sum: Vec<String>,
    min: Vec<String>,
    max: Vec<String>,
    avg: Vec<String>,
    group_by: Option<String>,
    groups_max: u32,
    limit: usize,
    no_snapshot: bool,
    from_mirror: bool,
    cursor: Option<u64>,
    step: usize,
}

fn parse(args: &[&[u8]]) -> Result<Request, String> {
    let text = |a: &[u8]| {
        std::str::from_utf8(a)
            .map(str::to_string)
            .map_err(|_| "ERR arguments must be UTF-8 text".to_string())
    };
    let name = String::from_utf8_lossy(args[0]).to_ascii_uppercase();
    let aggregate = name == "RAMLOG.AGG";
    let Some(table) = args.get(1) else {
        return Err(format!(
            "ERR wrong number of arguments for '{}' command",
            name.to_ascii_lowercase()
        ));
    };
    let mut r = Request {
        aggregate,
        table: text(table)?,
        limit: LIMIT_DEFAULT,
        step: STEP_DEFAULT,
        groups_max: GROUPS_DEFAULT,
        ..Request::default()
    };
    let mut i = 2;
    while i < args.len() {
        let word = String::from_utf8_lossy(args[i]).to_ascii_uppercase();
        let value = |at: usize| -> Result<String, String> {
            match args.get(at + 1) {
                Some(v) => text(v),
                None => Err(format!("ERR {word} needs a value")),
            }
        };
        match word.as_str() {
            "WHERE" => r.where_.push(value(i)?),
            "PREFIX" => r.prefix = Some(value(i)?),
            "MATCH" => r.pattern = value(i)?,
            "RANGE" => r.range = Some(value(i)?),
            "FIELDS" if !aggregate => {
                r.fields = value(i)?.split(',').map(|f| f.trim().to_string()).collect()
            }
            "LIMIT" if !aggregate => {
                r.limit = value(i)?
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| (1..=LIMIT_MAX).contains(&n))
                    .ok_or_else(|| format!("ERR LIMIT must be 1..={LIMIT_MAX}"))?
            }
            "CURSOR" if !aggregate => {
                r.cursor = Some(
                    value(i)?
                        .parse::<u64>()
                        .map_err(|_| "ERR invalid cursor".to_string())?,
                )
            }
            "COUNT" if !aggregate => {
                r.step = value(i)?
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| (1..=LIMIT_MAX).contains(&n))
                    .ok_or_else(|| format!("ERR COUNT must be 1..={LIMIT_MAX}"))?
            }
            "COUNT" if aggregate => {
                r.count = true;
                i += 1;
                continue;
            }
            "SUM" if aggregate => r.sum.push(value(i)?),
            "MIN" if aggregate => r.min.push(value(i)?),
            "MAX" if aggregate => r.max.push(value(i)?),
            "AVG" if aggregate => r.avg.push(value(i)?),
            "GROUPBY" if aggregate => r.group_by = Some(value(i)?),
            "MAXGROUPS" if aggregate => {
                r.groups_max = value(i)?
                    .parse::<u32>()
                    .ok()
                    .filter(|&n| (1..=ramlog_client::query::GROUPS_MAX).contains(&n))
                    .ok_or_else(|| {
                        format!(
                            "ERR MAXGROUPS must be 1..={}",
                            ramlog_client::query::GROUPS_MAX
                        )
                    })?
            }
            "NOSNAPSHOT" => {
                r.no_snapshot = true;
                i += 1;
                continue;
            }
            "MIRROR" => {
                r.from_mirror = true;
                r.no_snapshot = true;
                i += 1;
                continue;
            }
            _ => return Err(format!("ERR syntax error near '{word}' in {name}")),
        }
        i += 2;
    }
    if aggregate
        && !r.count
        && r.sum.is_empty()
        && r.min.is_empty()
        && r.max.is_empty()
        && r.avg.is_empty()
    {
        return Err("ERR RAMLOG.AGG needs COUNT, SUM, MIN, MAX or AVG".into());
    }
    if [r.prefix.is_some(), r.range.is_some(), !r.pattern.is_empty()]
        .iter()
        .filter(|&&b| b)
        .count()
        > 1
    {
        return Err("ERR give one of PREFIX, MATCH and RANGE".into());
    }
    Ok(r)
}

/// The table's id: a number, or the name of a table in the cluster map.
fn table_id(client: &ClusterClient, table: &str) -> Result<u64, String> {
    if let Ok(id) = table.parse::<u64>() {
        return Ok(id);
    }
    if client.is_standalone() {
        return Err(format!(
            "ERR a standalone server knows tables by id only; '{table}' is not a number"
        ));
    }
    client
        .map()
        .tables
        .iter()
        .find(|t| t.name == table)
        .map(|t| t.id)
        .ok_or_else(|| format!("ERR no table named '{table}' in the cluster"))
}

/// Runs RAMLOG.AGG or RAMLOG.SCAN and appends its reply.
pub async fn run(node: &Arc<Node>, session: &mut Session, args: &[&[u8]], out: &mut Vec<u8>) {
    let mut enc = ReplyEncoder::new(out, session.protocol);
    if !session.authenticated {
        enc.error("NOAUTH Authentication required.");
        return;
    }
    if session.multi.is_some() {
        // Not queued: a transaction runs on one server, a scan on all of them.
        session.multi_failed = true;
        enc.error("ERR RAMLOG.SCAN and RAMLOG.AGG cannot run inside MULTI");
        return;
    }
    if let Err(e) = answer(node, args, &mut enc).await {
        enc.error(&e);
    }
}

async fn answer(
    node: &Arc<Node>,
    args: &[&[u8]],
    enc: &mut ReplyEncoder<'_>,
) -> Result<(), String> {
    let r = parse(args)?;
    let base = client(node).await?;
    let id = table_id(&base, &r.table)?;
    let client = base.with_table(id).scanning_mirrors(r.from_mirror);
    let schema = if client.is_standalone() {
        client.seed().get_schema().await.map_err(reply_error)?
    } else {
        client.schema().map_err(reply_error)?
    };
    let spec = QuerySpec {
        prefix: r.prefix.as_deref(),
        range: r.range.as_deref(),
        pattern: &r.pattern,
        where_: &r.where_,
        fields: &r.fields,
        count_records: r.count,
        sum: &r.sum,
        min: &r.min,
        max: &r.max,
        avg: &r.avg,
        group_by: r.group_by.as_deref(),
        groups_max: r.groups_max,
    };
    let query = query_of(&spec, schema.as_ref()).map_err(|e| format!("ERR {e:#}"))?;
    if r.aggregate {
        let result = aggregates(&client, &query, r.no_snapshot).await?;
        let names: Vec<String> = query
            .aggregates
            .iter()
            .map(|a| aggregate_name(a, schema.as_ref()))
            .collect();
        match result.groups {
            Some(groups) => {
                enc.array(groups.len());
                for (group, values) in &groups {
                    enc.array(1 + 2 * values.len());
                    value_reply(enc, group);
                    for (name, value) in names.iter().zip(values) {
                        enc.bulk(name.as_bytes());
                        value_reply(enc, value);
                    }
                }
            }
            None => {
                enc.map(result.values.len());
                for (name, value) in names.iter().zip(&result.values) {
                    enc.bulk(name.as_bytes());
                    value_reply(enc, value);
                }
            }
        }
        return Ok(());
    }
    let shown = match (&schema, &query.projection) {
        (Some(s), Some(fields)) => Some(s.project(fields).map_err(|e| format!("ERR {e}"))?),
        (Some(s), None) => Some(s.clone()),
        (None, _) => None,
    };
    let (head, records) = match r.cursor {
        Some(cursor) => {
            if client.is_standalone() {
                return Err(
                    "ERR CURSOR steps through a cluster's slots; on a standalone server use LIMIT"
                        .into(),
                );
            }
            let (next, records) = client
                .scan_step(&query, cursor, r.step)
                .await
                .map_err(reply_error)?;
            (Head::Cursor(next), records)
        }
        None => {
            let (matched, records) = records(&client, &query, r.limit, r.no_snapshot).await?;
            (Head::Matched(matched), records)
        }
    };
    enc.array(2);
    match head {
        Head::Cursor(next) => enc.bulk(next.to_string().as_bytes()),
        Head::Matched(matched) => enc.integer(matched as i64),
    }
    enc.array(records.len());
    for record in &records {
        enc.array(2);
        enc.bulk(&record.key);
        match shown
            .as_ref()
            .map(|s| s.decode(&record.value).map(|v| (s, v)))
        {
            Some(Ok((s, values))) => enc.bulk(render_record(s, &values).as_bytes()),
            _ => enc.bulk(&record.value),
        }
    }
    Ok(())
}

fn reply_error(e: ramlog_client::Error) -> String {
    format!("ERR {e}")
}

async fn aggregates(
    client: &ClusterClient,
    query: &Query,
    no_snapshot: bool,
) -> Result<ramlog_client::ScanAggregates, String> {
    let result = if client.is_standalone() {
        client.seed().scan_aggregates(query, None).await
    } else if no_snapshot {
        client.scan_aggregates(query).await
    } else {
        client
            .scan_aggregates_consistent(query)
            .await
            .map(|(a, _)| a)
    };
    result.map_err(reply_error)
}

/// How many records match, and the first `limit` of them, at one snapshot.
async fn records(
    client: &ClusterClient,
    query: &Query,
    limit: usize,
    no_snapshot: bool,
) -> Result<(u64, Vec<Record>), String> {
    let mut count = query.clone();
    count.projection = None;
    count.aggregates = vec![Aggregate::Count];
    if client.is_standalone() {
        let seed = client.seed();
        let snapshot = seed.snapshot_open().await.map_err(reply_error)?;
        let matched = seed
            .scan_aggregates(&count, Some(&snapshot))
            .await
            .map_err(reply_error)?
            .matched;
        let records = match seed
            .scan_filtered(query, Some(&snapshot), PAGE_RECORDS.min(limit as u32))
            .await
            .map_err(reply_error)?
        {
            ramlog_client::ScanResult::Records {
                mut records, more, ..
            } => {
                if let Some(mut more) = more {
                    while records.len() < limit && !more.is_done() {
                        records.extend(more.next_page(PAGE_RECORDS).await.map_err(reply_error)?);
                    }
                    more.close().await.map_err(reply_error)?;
                }
                records.truncate(limit);
                records
            }
            ramlog_client::ScanResult::Aggregates(_) => {
                return Err("ERR the scan answered aggregates to a record query".into())
            }
        };
        let _ = snapshot.release().await;
        return Ok((matched, records));
    }
    if no_snapshot {
        let matched = client
            .scan_aggregates(&count)
            .await
            .map_err(reply_error)?
            .matched;
        let records = client
            .scan_records_limited(query, PAGE_RECORDS, limit)
            .await
            .map_err(reply_error)?;
        return Ok((matched, records));
    }
    client
        .scan_page_consistent(query, PAGE_RECORDS, limit)
        .await
        .map(|(matched, records, _)| (matched, records))
        .map_err(reply_error)
}

fn value_reply(enc: &mut ReplyEncoder<'_>, value: &Value) {
    match value {
        Value::Null => enc.null(),
        Value::I32(x) => enc.integer(i64::from(*x)),
        Value::I64(x) => enc.integer(*x),
        Value::F64(x) => enc.double(*x),
        Value::Bool(x) => enc.boolean(*x),
        Value::Str(s) => enc.bulk(s.as_bytes()),
        Value::Bytes(b) => enc.bulk(b),
    }
}
