//! Snapshots, schemas and filtered scans (`docs/protocol.md`, "Snapshots and scans").
//!
//! Snapshots and paged scans live on one server connection, so their handles ([`Snapshot`],
//! [`PagedScan`]) keep that connection and send their requests on it, whatever the pool does. If the
//! connection breaks, the server releases them and the handles answer [`Error::ConnectionLost`].
//! Dropping the last handle of a snapshot, or a paged scan not read to its end, releases it on the
//! server in the background (when dropped inside a tokio runtime); `release`/`close` do it at once and
//! report errors.
//!
//! ```no_run
//! # async fn demo(client: ramlog_client::Client) -> Result<(), ramlog_client::Error> {
//! use ramlog_client::query::{Field, FieldType, Op, Predicate, Query, Schema, Value, Aggregate};
//! let schema = Schema::new(vec![Field::new("age", FieldType::I64)]).unwrap();
//! client.set_schema(Some(&schema)).await?;
//! client.put(b"u:1", &schema.encode(&[Value::I64(41)]).unwrap()).await?;
//! let snapshot = client.snapshot_open().await?;
//! let mut query = Query::default();
//! query.predicate.clauses = vec![vec![Predicate::new(0, Op::Ge, Value::I64(18))]];
//! let adults = client.scan_records(&query, Some(&snapshot), 1000).await?;
//! query.aggregates = vec![Aggregate::Count];
//! let count = client.scan_aggregates(&query, Some(&snapshot)).await?;
//! snapshot.release().await?;
//! # Ok(()) }
//! ```

use crate::connection::Connection;
use crate::{unexpected, Client, Error, Object, Record, Request, Response};
use ramlog_common::{TableId, Version};
use ramlog_query::{decode_values, Query, Schema, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Send a release (SNAPSHOT_RELEASE or SCAN_CLOSE) without waiting, from a destructor.
fn release_in_background(conn: &Arc<Connection>, request: Request<'static>, timeout: Duration) {
    if conn.is_closed() {
        return;
    }
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        let conn = conn.clone();
        runtime.spawn(async move {
            let _ = conn.call(&request, Instant::now() + timeout).await;
        });
    }
}

/// The server-side snapshot behind every clone of a [`Snapshot`].
struct HeldSnapshot {
    conn: Arc<Connection>,
    id: u64,
    timeout: Duration,
    /// Not yet released by [`Snapshot::release`].
    open: AtomicBool,
}

impl Drop for HeldSnapshot {
    fn drop(&mut self) {
        if self.open.load(Ordering::Relaxed) {
            let request = Request::SnapshotRelease { snapshot: self.id };
            release_in_background(&self.conn, request, self.timeout);
        }
    }
}

/// A read snapshot held open by the server for this client's connection. Release it when done
/// ([`Snapshot::release`], or drop every clone); the server also releases it when the connection
/// closes, and when it passes the server's age or retained-bytes bound (then reads fail with
/// [`Error::SnapshotTooOld`]).
#[derive(Clone)]
pub struct Snapshot {
    held: Arc<HeldSnapshot>,
    conn: Arc<Connection>,
    id: u64,
    version: Version,
    timeout: Duration,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("id", &self.id)
            .field("version", &self.version)
            .finish()
    }
}

impl Snapshot {
    /// The handle of snapshot `id` that the server opened for `conn`.
    fn held_on(conn: Arc<Connection>, id: u64, version: Version, timeout: Duration) -> Snapshot {
        Snapshot {
            held: Arc::new(HeldSnapshot {
                conn: conn.clone(),
                id,
                timeout,
                open: AtomicBool::new(true),
            }),
            conn,
            id,
            version,
            timeout,
        }
    }

    /// The server's id of the snapshot (valid on its connection only).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The read version: writes up to it are visible, nothing newer.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Release the snapshot on the server (for every clone of this handle).
    pub async fn release(&self) -> Result<(), Error> {
        self.held.open.store(false, Ordering::Relaxed);
        match call_on(
            &self.conn,
            &Request::SnapshotRelease { snapshot: self.id },
            self.timeout,
        )
        .await?
        {
            Response::SnapshotReleased => Ok(()),
            other => Err(unexpected("SNAPSHOT_RELEASE", other)),
        }
    }
}

/// The tablet a SCAN_TABLET reads ([`Client::scan_tablet_raw`]): its slots and epoch as the map
/// names them, and the slots of it to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TabletScan {
    pub first_slot: u16,
    pub last_slot: u16,
    pub epoch: u64,
    /// Within `first_slot..=last_slot`.
    pub only_slots: (u16, u16),
}

impl TabletScan {
    /// Every slot of the tablet.
    pub fn whole(first_slot: u16, last_slot: u16, epoch: u64) -> TabletScan {
        TabletScan {
            first_slot,
            last_slot,
            epoch,
            only_slots: (first_slot, last_slot),
        }
    }
}

/// Where a SCAN_TABLET reads ([`Client::scan_tablet_raw`]).
#[derive(Clone, Copy, Debug)]
pub enum ScanAt<'a> {
    /// On the tablet's master, at a fresh snapshot.
    Master,
    /// On the tablet's master, at this part of a cluster snapshot.
    Snapshot(&'a Snapshot),
    /// On the tablet's mirror, at a fresh snapshot.
    Mirror,
}

/// The aggregates of an aggregate query, in query order, with the scan's counts.
#[derive(Clone, Debug, PartialEq)]
pub struct ScanAggregates {
    /// The aggregates' values (empty for a grouped query).
    pub values: Vec<Value>,
    /// A grouped query's groups: each group's value and its aggregates, in order of the values.
    pub groups: Option<Vec<(Value, Vec<Value>)>>,
    /// Records that matched.
    pub matched: u64,
    /// Values that are not records of the table's schema (skipped).
    pub malformed: u64,
    /// The version the scan read at.
    pub snapshot_version: Version,
}

/// What SCAN_FILTERED answered.
#[derive(Debug)]
pub enum ScanResult {
    /// A record query: the first page and, when there are more, the paged scan to continue with.
    Records {
        records: Vec<Record>,
        more: Option<PagedScan>,
        snapshot_version: Version,
    },
    /// An aggregate query.
    Aggregates(ScanAggregates),
}

/// A paged scan open on the server. Read it to the end with [`PagedScan::next_page`] (the server then
/// forgets it) or close it early with [`PagedScan::close`].
pub struct PagedScan {
    conn: Arc<Connection>,
    id: u64,
    snapshot_version: Version,
    timeout: Duration,
    done: bool,
}

impl std::fmt::Debug for PagedScan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedScan")
            .field("id", &self.id)
            .field("snapshot_version", &self.snapshot_version)
            .field("done", &self.done)
            .finish()
    }
}

impl Drop for PagedScan {
    fn drop(&mut self) {
        if !self.done {
            let request = Request::ScanClose { cursor: self.id };
            release_in_background(&self.conn, request, self.timeout);
        }
    }
}

impl PagedScan {
    /// The server's id of the scan (0 once it is complete).
    pub fn id(&self) -> u64 {
        if self.done {
            0
        } else {
            self.id
        }
    }

    pub fn snapshot_version(&self) -> Version {
        self.snapshot_version
    }

    /// Whether the last page has been read.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The next page of at most `max_records` records (the server also caps a page's bytes). A page
    /// may be empty; after the last page [`PagedScan::is_done`] is true and further calls return
    /// nothing.
    pub async fn next_page(&mut self, max_records: u32) -> Result<Vec<Record>, Error> {
        if self.done {
            return Ok(Vec::new());
        }
        let request = Request::ScanNext {
            cursor: self.id,
            max_records,
        };
        match call_on(&self.conn, &request, self.timeout).await {
            Ok(Response::ScanPage {
                cursor, records, ..
            }) => {
                self.done = cursor == 0;
                Ok(records)
            }
            Ok(other) => Err(unexpected("SCAN_NEXT", other)),
            Err(e) => {
                // The server forgets a scan that failed.
                if matches!(e, Error::SnapshotTooOld { .. } | Error::NoSuchCursor(_)) {
                    self.done = true;
                }
                Err(e)
            }
        }
    }

    /// Every remaining record.
    pub async fn collect(&mut self, page_records: u32) -> Result<Vec<Record>, Error> {
        let mut all = Vec::new();
        while !self.done {
            all.extend(self.next_page(page_records).await?);
        }
        Ok(all)
    }

    /// Close the scan before its end (nothing to do once it is complete).
    pub async fn close(mut self) -> Result<(), Error> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        match call_on(
            &self.conn,
            &Request::ScanClose { cursor: self.id },
            self.timeout,
        )
        .await?
        {
            Response::ScanClosed => Ok(()),
            other => Err(unexpected("SCAN_CLOSE", other)),
        }
    }
}

/// One request on a given connection, error replies mapped to errors.
async fn call_on(
    conn: &Arc<Connection>,
    request: &Request<'_>,
    timeout: Duration,
) -> Result<Response, Error> {
    if conn.is_closed() {
        return Err(Error::ConnectionLost(
            "the connection holding this snapshot or scan was closed".into(),
        ));
    }
    match conn.call(request, Instant::now() + timeout).await? {
        Response::Error(e) => Err(e.into()),
        reply => Ok(reply),
    }
}

impl Client {
    /// Open a snapshot on one of the pool's connections.
    pub async fn snapshot_open(&self) -> Result<Snapshot, Error> {
        let conn = self.pooled_connection().await?;
        match call_on(&conn, &Request::SnapshotOpen, self.timeout).await? {
            Response::SnapshotOpen { snapshot, version } => {
                Ok(Snapshot::held_on(conn, snapshot, version, self.timeout))
            }
            other => Err(unexpected("SNAPSHOT_OPEN", other)),
        }
    }

    /// This server's part of a cluster snapshot (SNAPSHOT_CUT): at `at_unix_ns` (wall clock),
    /// the server holds its writes for `hold` and opens a snapshot on one of the pool's
    /// connections. Also returns when the server held its writes, from and to (nanoseconds
    /// since the Unix epoch). See [`crate::ClusterClient::cluster_snapshot`].
    pub async fn snapshot_cut(
        &self,
        at_unix_ns: u64,
        hold: Duration,
    ) -> Result<(Snapshot, u64, u64), Error> {
        let conn = self.pooled_connection().await?;
        let request = Request::SnapshotCut {
            table: self.table,
            at_unix_ns,
            hold_us: u32::try_from(hold.as_micros()).unwrap_or(u32::MAX),
        };
        match call_on(&conn, &request, self.timeout).await? {
            Response::SnapshotCut {
                snapshot,
                version,
                held_from_ns,
                held_to_ns,
            } => Ok((
                Snapshot::held_on(conn, snapshot, version, self.timeout),
                held_from_ns,
                held_to_ns,
            )),
            other => Err(unexpected("SNAPSHOT_CUT", other)),
        }
    }

    /// The object `key` had at the snapshot (None if absent, deleted or expired then).
    pub async fn get_at(&self, snapshot: &Snapshot, key: &[u8]) -> Result<Option<Object>, Error> {
        let request = Request::GetAt {
            table: self.table,
            snapshot: snapshot.id,
            key,
        };
        match call_on(&snapshot.conn, &request, self.timeout).await? {
            Response::GetAt(object) => Ok(object),
            other => Err(unexpected("GET_AT", other)),
        }
    }

    /// Set this handle's table's schema (None removes it). Scans read fields through it.
    pub async fn set_schema(&self, schema: Option<&Schema>) -> Result<(), Error> {
        let bytes = schema.map(Schema::to_bytes).unwrap_or_default();
        match self
            .call(&Request::SetSchema {
                table: self.table,
                schema: &bytes,
            })
            .await?
        {
            Response::SchemaSet => Ok(()),
            other => Err(unexpected("SET_SCHEMA", other)),
        }
    }

    /// This handle's table's schema, if it has one.
    pub async fn get_schema(&self) -> Result<Option<Schema>, Error> {
        match self.call(&Request::GetSchema { table: self.table }).await? {
            Response::Schema(bytes) if bytes.is_empty() => Ok(None),
            Response::Schema(bytes) => Schema::from_bytes(&bytes)
                .map(Some)
                .map_err(|e| Error::Protocol(format!("GET_SCHEMA reply: {e}"))),
            other => Err(unexpected("GET_SCHEMA", other)),
        }
    }

    /// Run a query over this handle's table: at `snapshot`, or at a fresh snapshot when None. A record
    /// query returns its first page (at most `max_records` records) and the paged scan to continue
    /// with; an aggregate query returns the aggregates.
    pub async fn scan_filtered(
        &self,
        query: &Query,
        snapshot: Option<&Snapshot>,
        max_records: u32,
    ) -> Result<ScanResult, Error> {
        let bytes = query
            .to_bytes()
            .map_err(|e| Error::InvalidQuery(e.to_string()))?;
        self.scan_filtered_raw(self.table, &bytes, snapshot, max_records)
            .await
    }

    /// [`Client::scan_filtered`] with the query already encoded (`Query::to_bytes`), for tools and
    /// tests that send any bytes.
    pub async fn scan_filtered_raw(
        &self,
        table: TableId,
        query: &[u8],
        snapshot: Option<&Snapshot>,
        max_records: u32,
    ) -> Result<ScanResult, Error> {
        let conn = match snapshot {
            Some(s) => s.conn.clone(),
            None => self.pooled_connection().await?,
        };
        let request = Request::ScanFiltered {
            table,
            snapshot: snapshot.map(|s| s.id).unwrap_or(0),
            max_records,
            query,
        };
        self.scan_reply(conn, &request, "SCAN_FILTERED").await
    }

    /// A cluster scan's part on one tablet (SCAN_TABLET): the query (`Query::to_bytes`) over
    /// the objects of the tablet of `table` covering `first_slot..=last_slot` at `epoch`, on its
    /// master at a fresh snapshot or at `snapshot` (a part of a cluster snapshot), or with
    /// `from_mirror` on its mirror at a fresh snapshot. Refused (`Status::WrongServer`) unless
    /// this server masters (mirrors, with its memory complete) exactly that tablet now.
    pub async fn scan_tablet_raw(
        &self,
        table: TableId,
        tablet: TabletScan,
        at: ScanAt<'_>,
        query: &[u8],
        max_records: u32,
    ) -> Result<ScanResult, Error> {
        let conn = match at {
            ScanAt::Snapshot(s) => s.conn.clone(),
            ScanAt::Master | ScanAt::Mirror => self.pooled_connection().await?,
        };
        let request = Request::ScanTablet {
            table,
            first_slot: tablet.first_slot,
            last_slot: tablet.last_slot,
            epoch: tablet.epoch,
            only_slots: tablet.only_slots,
            snapshot: match at {
                ScanAt::Snapshot(s) => s.id,
                ScanAt::Master | ScanAt::Mirror => 0,
            },
            from_mirror: matches!(at, ScanAt::Mirror),
            max_records,
            query,
        };
        self.scan_reply(conn, &request, "SCAN_TABLET").await
    }

    /// Sends a scan request on `conn` and reads its first reply.
    async fn scan_reply(
        &self,
        conn: Arc<Connection>,
        request: &Request<'_>,
        what: &str,
    ) -> Result<ScanResult, Error> {
        match call_on(&conn, request, self.timeout).await? {
            Response::ScanPage {
                cursor,
                snapshot_version,
                records,
            } => Ok(ScanResult::Records {
                records,
                more: (cursor != 0).then(|| PagedScan {
                    conn,
                    id: cursor,
                    snapshot_version,
                    timeout: self.timeout,
                    done: false,
                }),
                snapshot_version,
            }),
            Response::ScanAggregates {
                snapshot_version,
                matched,
                malformed,
                values,
            } => {
                let (values, groups) = if ramlog_query::is_groups(&values) {
                    let groups = ramlog_query::decode_groups(
                        &values,
                        ramlog_query::GROUPS_MAX as usize,
                        usize::MAX,
                    )
                    .map_err(|e| Error::Protocol(format!("aggregate groups: {e}")))?;
                    (Vec::new(), Some(groups))
                } else {
                    let values = decode_values(&values, usize::MAX)
                        .map_err(|e| Error::Protocol(format!("aggregate values: {e}")))?;
                    (values, None)
                };
                Ok(ScanResult::Aggregates(ScanAggregates {
                    values,
                    groups,
                    matched,
                    malformed,
                    snapshot_version,
                }))
            }
            other => Err(unexpected(what, other)),
        }
    }

    /// Every record a record query matches, read page by page (`page_records` per page).
    pub async fn scan_records(
        &self,
        query: &Query,
        snapshot: Option<&Snapshot>,
        page_records: u32,
    ) -> Result<Vec<Record>, Error> {
        match self.scan_filtered(query, snapshot, page_records).await? {
            ScanResult::Records {
                mut records, more, ..
            } => {
                if let Some(mut more) = more {
                    records.extend(more.collect(page_records).await?);
                }
                Ok(records)
            }
            ScanResult::Aggregates(_) => Err(Error::InvalidQuery(
                "scan_records needs a query without aggregates".into(),
            )),
        }
    }

    /// The aggregates of an aggregate query.
    pub async fn scan_aggregates(
        &self,
        query: &Query,
        snapshot: Option<&Snapshot>,
    ) -> Result<ScanAggregates, Error> {
        if query.aggregates.is_empty() {
            return Err(Error::InvalidQuery(
                "scan_aggregates needs a query with aggregates".into(),
            ));
        }
        match self.scan_filtered(query, snapshot, 1).await? {
            ScanResult::Aggregates(a) => Ok(a),
            ScanResult::Records { .. } => Err(Error::Protocol(
                "SCAN_FILTERED answered records to an aggregate query".into(),
            )),
        }
    }
}
