//! Snapshots, schemas and filtered scans over the native protocol (`docs/protocol.md`, "Snapshots and
//! scans"): the state one connection holds (open snapshots, paged scans) and the blocking work those
//! requests do.
//!
//! A scan can take seconds, so SCAN_FILTERED and SCAN_NEXT run as jobs on tokio's blocking pool (a few
//! at a time per connection); the connection task keeps answering the other requests meanwhile and
//! writes each job's reply frame when it is done. Everything a request needs from the wire is checked
//! before its job is queued (query bytes, ids, limits), so a job only meets engine errors. GET_AT is a
//! point read (microseconds) and is answered on the connection task.
//!
//! A snapshot the client opened (SNAPSHOT_OPEN) is a [`Snapshot`] handle held by the session; every
//! scan at it works on a clone (clones share one engine registration), so any number of paged scans
//! may read at one snapshot (within the per-connection limit of paged scans), and nothing that uses a
//! snapshot waits for a scan at it. SNAPSHOT_RELEASE drops the session's handle; paged scans at that
//! snapshot keep their clone until they finish or are closed. Closing a paged scan drops its
//! [`ScanCursor`] (and with it the segments it pinned). Scans with snapshot id 0 open their own snapshot.

use super::Failure;
use bytes::BytesMut;
use parking_lot::Mutex;
use ramlog_common::TableId;
use ramlog_logmem::query::{encode_values, CompiledQuery, Query};
use ramlog_logmem::{Engine, EngineError, ScanCursor, ScanMethod, ScanRecord, Snapshot, TabletId};
use ramlog_proto::native::{
    begin_scan_page, finish_reply_frame, opcode, put_record, record_wire_bytes, Object, Response,
    Status,
};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Ids of snapshots and paged scans: process-wide, so an id is never reused (not even by another
/// connection after a reconnect).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Limits of snapshots and scans per connection.
#[derive(Clone, Copy, Debug)]
pub struct ScanLimits {
    /// Snapshots one connection may hold open.
    pub snapshots_max: usize,
    /// Paged scans one connection may hold open.
    pub cursors_max: usize,
    /// Records per page (a request's `max_records` is clamped to 1..=this).
    pub page_records_max: u32,
    /// Bytes of records per page; a page holds at least one record.
    pub page_bytes_max: usize,
    /// Scan jobs of one connection running at once; more wait in the connection's queue.
    pub jobs_running_max: usize,
}

impl Default for ScanLimits {
    fn default() -> Self {
        ScanLimits {
            snapshots_max: 64,
            cursors_max: 64,
            page_records_max: ramlog_proto::native::SCAN_PAGE_RECORDS_MAX,
            page_bytes_max: 4 << 20,
            jobs_running_max: 4,
        }
    }
}

struct CursorState {
    cursor: ScanCursor,
    /// Records read from the engine that did not fit in the last page.
    pending: VecDeque<ScanRecord>,
}

type CursorRef = Arc<Mutex<CursorState>>;
type CursorMap = Arc<Mutex<HashMap<u64, CursorRef>>>;

/// A request's work on the blocking pool; returns the reply frame.
pub(super) type Job = Box<dyn FnOnce() -> BytesMut + Send + 'static>;

/// A tablet as a cut names it: table, first slot, last slot, epoch.
pub(super) type CutTablet = (TableId, u16, u16, u64);

/// A client's snapshot on this connection.
#[derive(Clone)]
pub(super) struct HeldSnapshot {
    pub snapshot: Snapshot,
    /// For a SNAPSHOT_CUT's: the tablets (table, first slot, last slot, epoch) this server
    /// mastered and served at that epoch during the whole hold. A scan of a tablet at it
    /// (SCAN_TABLET) must be of one of these: only their writes are all in the snapshot.
    pub tablets: Option<Arc<Vec<CutTablet>>>,
}

/// The snapshots and paged scans of one connection. Dropped with the connection, which releases them.
pub(super) struct ScanSession {
    engine: Arc<Engine>,
    limits: ScanLimits,
    /// The client's snapshots; scans at one work on clones of its handle. Shared with the jobs
    /// of SNAPSHOT_CUT, which add theirs when their cut is done.
    snapshots: Arc<Mutex<HashMap<u64, HeldSnapshot>>>,
    cursors: CursorMap,
}

fn too_old(version: u64, reason: impl Into<String>) -> Failure {
    Failure(
        Status::SnapshotTooOld,
        version,
        format!(
            "snapshot too old: snapshot {version} was released because {}",
            reason.into()
        ),
    )
}

fn error_frame(id: u64, op: u8, f: Failure) -> BytesMut {
    let mut out = BytesMut::new();
    ramlog_proto::native::encode_error(&mut out, id, op, f.0, f.1, &f.2);
    out
}

fn reply_frame(id: u64, op: u8, result: Result<Response, Failure>) -> BytesMut {
    match result {
        Ok(reply) => {
            let mut out = BytesMut::new();
            reply.encode(id, op, &mut out);
            out
        }
        Err(f) => error_frame(id, op, f),
    }
}

impl ScanSession {
    pub(super) fn new(engine: Arc<Engine>, limits: ScanLimits) -> ScanSession {
        ScanSession {
            engine,
            limits,
            snapshots: Arc::new(Mutex::new(HashMap::new())),
            cursors: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    fn check_snapshot_room(&self) -> Result<(), Failure> {
        if self.snapshots.lock().len() >= self.limits.snapshots_max {
            return Err(Failure(
                Status::TooManyOpen,
                self.limits.snapshots_max as u64,
                format!(
                    "this connection holds {} snapshots, the limit; release one first",
                    self.limits.snapshots_max
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn snapshot_open(&mut self) -> Result<Response, Failure> {
        self.check_snapshot_room()?;
        let snapshot = self.engine.snapshot();
        let version = snapshot.version();
        let id = next_id();
        self.snapshots.lock().insert(
            id,
            HeldSnapshot {
                snapshot,
                tablets: None,
            },
        );
        Ok(Response::SnapshotOpen {
            snapshot: id,
            version,
        })
    }

    pub(super) fn snapshot_release(&mut self, id: u64) -> Result<Response, Failure> {
        // Scans at the snapshot (paged ones included) hold clones, which keep it open until they
        // finish or are closed.
        match self.snapshots.lock().remove(&id) {
            Some(_) => Ok(Response::SnapshotReleased),
            None => Err(no_such_snapshot(id)),
        }
    }

    /// Refuses a SCAN_TABLET at a SNAPSHOT_CUT's snapshot of a tablet the cut did not hold
    /// on this server at `epoch` (a snapshot SNAPSHOT_OPEN took covers this server's tablets).
    pub(super) fn check_cut_covers(
        &self,
        snapshot: u64,
        (table, first, last, epoch): CutTablet,
    ) -> Result<(), Failure> {
        let held = self.client_snapshot(snapshot)?;
        match &held.tablets {
            Some(cut) if !cut.contains(&(table, first, last, epoch)) => Err(Failure(
                Status::SnapshotTooOld,
                held.snapshot.version(),
                format!(
                    "snapshot {snapshot} was cut while this server did not master slots \
                     {first}-{last} of table {table} at epoch {epoch} (a fail-over, move, split \
                     or merge came between): it lacks their writes; take a new cluster snapshot"
                ),
            )),
            _ => Ok(()),
        }
    }

    pub(super) fn client_snapshot(&self, id: u64) -> Result<HeldSnapshot, Failure> {
        self.snapshots
            .lock()
            .get(&id)
            .cloned()
            .ok_or_else(|| no_such_snapshot(id))
    }

    /// SNAPSHOT_CUT: at `at_unix_ns`, holds this server's writes for `hold` and opens a
    /// snapshot (on a thread of normal priority: the scan pool's may start late, and would hold
    /// the writers' locks at idle priority); then `settle` waits for the backups of what it
    /// saw. `tablets` is asked before and after the hold, and keeps what it named both times.
    pub(super) fn snapshot_cut(
        &self,
        id: u64,
        at_unix_ns: u64,
        hold: std::time::Duration,
        tablets: impl Fn() -> Vec<CutTablet> + Send + 'static,
        settle: impl FnOnce(&[CutTablet]) -> Result<(), String> + Send + 'static,
    ) -> Result<Job, Failure> {
        self.check_snapshot_room()?;
        let engine = self.engine.clone();
        let snapshots = self.snapshots.clone();
        Ok(Box::new(move || {
            let cut = std::thread::Builder::new()
                .name("snapshot-cut".into())
                .spawn(move || {
                    let wait = at_unix_ns.saturating_sub(ramlog_logmem::unix_ns());
                    // Not asked for a time far ahead: at most a second.
                    std::thread::sleep(std::time::Duration::from_nanos(wait.min(1_000_000_000)));
                    let before = tablets();
                    let (snapshot, from, to) = engine.cut_snapshot(hold);
                    let after = tablets();
                    let kept: Vec<_> = before.into_iter().filter(|t| after.contains(t)).collect();
                    (snapshot, from, to, kept)
                });
            let result = match cut.map(|h| h.join()) {
                Ok(Ok(cut)) => Ok(cut),
                Ok(Err(_)) => Err("the cut's thread failed".to_string()),
                Err(e) => Err(format!("cannot start the cut's thread: {e}")),
            };
            let result = result.and_then(|(snapshot, from, to, kept)| {
                settle(&kept)?;
                let version = snapshot.version();
                let snapshot_id = next_id();
                snapshots.lock().insert(
                    snapshot_id,
                    HeldSnapshot {
                        snapshot,
                        tablets: Some(Arc::new(kept)),
                    },
                );
                Ok(Response::SnapshotCut {
                    snapshot: snapshot_id,
                    version,
                    held_from_ns: from,
                    held_to_ns: to,
                })
            });
            reply_frame(
                id,
                opcode::SNAPSHOT_CUT,
                result.map_err(|e| Failure(Status::Internal, 0, format!("snapshot cut: {e}"))),
            )
        }))
    }

    pub(super) fn get_schema(&self, table: TableId) -> Response {
        Response::Schema(
            self.engine
                .schema(table)
                .map(|s| s.to_bytes())
                .unwrap_or_default()
                .into(),
        )
    }

    /// GET_AT: a point read at a client snapshot, answered at once (no scan at the snapshot holds
    /// it up: scans read through their own clones).
    pub(super) fn get_at(
        &self,
        snapshot: u64,
        tablet: TabletId,
        key: &[u8],
    ) -> Result<Response, Failure> {
        let snap = self.client_snapshot(snapshot)?.snapshot;
        let found = self
            .engine
            .get_at(tablet, key, &snap)
            .map_err(engine_failure)?;
        Ok(Response::GetAt(found.map(|o| Object {
            value: o.value.into(),
            version: o.version,
            expire_at_ms: o.expire_at_ms,
        })))
    }

    /// SCAN_FILTERED: decodes and checks the query now, scans on the blocking pool. With
    /// `tablet` (SCAN_TABLET: engine tablet, first and last slot), only that tablet's objects of
    /// those slots, at a fresh snapshot.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn scan_filtered(
        &self,
        id: u64,
        table: TableId,
        snapshot: u64,
        fresh: Option<Snapshot>,
        max_records: u32,
        query: &[u8],
        tablet: Option<(TabletId, u16, u16)>,
    ) -> Result<Job, Failure> {
        let query = Query::from_bytes(query)
            .map_err(|e| Failure(Status::BadRequest, 0, format!("bad query: {e}")))?;
        if !self.engine.tablets().iter().any(|t| t.table == table) {
            return Err(Failure(
                Status::NoSuchTable,
                0,
                format!("no tablet of table {table} on this server"),
            ));
        }
        let schema = self.engine.schema(table);
        let compiled = CompiledQuery::new(query.clone(), schema.as_deref())
            .map_err(|e| Failure(Status::BadRequest, 0, format!("bad query: {e}")))?;
        let aggregate = compiled.is_aggregate();
        if !aggregate && self.cursors.lock().len() >= self.limits.cursors_max {
            return Err(too_many_cursors(self.limits.cursors_max));
        }
        // A fresh snapshot is taken now, so that the scan sees exactly the requests before it.
        // A client snapshot is cloned: the scan keeps it open for as long as it runs, even if the
        // client releases its handle meanwhile.
        let snap = if snapshot != 0 {
            self.client_snapshot(snapshot)?.snapshot
        } else if let Some(fresh) = fresh {
            // Opened by the caller (a mirror's, at the version its tablet reached).
            fresh
        } else {
            // A snapshot for this one scan: versions stay only while the scan may read them.
            self.engine.scan_snapshot(table)
        };
        let engine = self.engine.clone();
        let limits = self.limits;
        let max_records = max_records.clamp(1, limits.page_records_max.max(1)) as usize;
        let cursors = self.cursors.clone();
        Ok(Box::new(move || {
            let op = if tablet.is_some() {
                opcode::SCAN_TABLET
            } else {
                opcode::SCAN_FILTERED
            };
            if aggregate {
                let result = aggregate_scan(&engine, table, tablet, &snap, &query);
                return reply_frame(id, op, result);
            }
            match record_scan(
                &engine,
                table,
                tablet,
                snap,
                &query,
                max_records,
                limits,
                &cursors,
            ) {
                Ok(frame) => frame(id),
                Err(f) => error_frame(id, op, f),
            }
        }))
    }

    /// SCAN_NEXT: checks the cursor id now, reads the page on the blocking pool.
    pub(super) fn scan_next(&self, id: u64, cursor: u64, max_records: u32) -> Result<Job, Failure> {
        let state = self
            .cursors
            .lock()
            .get(&cursor)
            .cloned()
            .ok_or_else(|| no_such_cursor(cursor))?;
        let limits = self.limits;
        let max_records = max_records.clamp(1, limits.page_records_max.max(1)) as usize;
        let cursors = self.cursors.clone();
        Ok(Box::new(move || {
            // Closed while this request waited for its turn: read nothing.
            if !cursors.lock().contains_key(&cursor) {
                return error_frame(id, opcode::SCAN_NEXT, no_such_cursor(cursor));
            }
            let mut guard = state.lock();
            let version = guard.cursor.snapshot().version();
            match fill_page(&mut guard, max_records, limits.page_bytes_max) {
                Ok((page, done)) => {
                    if done {
                        cursors.lock().remove(&cursor);
                    }
                    page_frame(
                        id,
                        opcode::SCAN_NEXT,
                        if done { 0 } else { cursor },
                        version,
                        &page,
                    )
                }
                Err(e) => {
                    // The scan cannot go on (snapshot too old, ...): forget it.
                    cursors.lock().remove(&cursor);
                    error_frame(id, opcode::SCAN_NEXT, engine_failure(e))
                }
            }
        }))
    }

    /// SCAN_CLOSE: forgets the paged scan. Its cursor (with its segment pins and its clone of the
    /// snapshot) is dropped here, or when a SCAN_NEXT still reading a page of it finishes.
    pub(super) fn scan_close(&self, cursor: u64) -> Result<Response, Failure> {
        let state = self.cursors.lock().remove(&cursor);
        match state {
            Some(state) => {
                drop(state);
                Ok(Response::ScanClosed)
            }
            None => Err(no_such_cursor(cursor)),
        }
    }
}

fn no_such_snapshot(id: u64) -> Failure {
    Failure(
        Status::NoSuchSnapshot,
        id,
        format!("no snapshot {id} is open on this connection"),
    )
}

fn no_such_cursor(id: u64) -> Failure {
    Failure(
        Status::NoSuchCursor,
        id,
        format!("no paged scan {id} is open on this connection (finished, closed or never opened)"),
    )
}

fn too_many_cursors(max: usize) -> Failure {
    Failure(
        Status::TooManyOpen,
        max as u64,
        format!(
            "this connection holds {max} paged scans, the limit; close one or read it to the end"
        ),
    )
}

/// The engine error of a scan or read at a snapshot, as a reply.
fn engine_failure(e: EngineError) -> Failure {
    match e {
        EngineError::SnapshotTooOld { version, reason } => too_old(version, reason),
        e => e.into(),
    }
}

fn aggregate_scan(
    engine: &Engine,
    table: TableId,
    tablet: Option<(TabletId, u16, u16)>,
    snap: &Snapshot,
    query: &Query,
) -> Result<Response, Failure> {
    let version = snap.version();
    let out = match tablet {
        None => engine.scan(table, snap, query, ScanMethod::Log, 0),
        Some((tablet, first, last)) => {
            engine.scan_tablet_slots(tablet, snap, query, (first, last), 0)
        }
    }
    .map_err(engine_failure)?;
    let mut encoded = Vec::new();
    match &out.groups {
        Some(groups) => ramlog_logmem::query::encode_groups(groups, &mut encoded),
        None => encode_values(&out.aggregates.unwrap_or_default(), &mut encoded),
    }
    .map_err(|e| Failure(Status::Internal, 0, format!("encoding aggregates: {e}")))?;
    Ok(Response::ScanAggregates {
        snapshot_version: version,
        matched: out.matched,
        malformed: out.malformed,
        values: encoded.into(),
    })
}

/// Opens a paged scan and produces its first page; registers the scan when it has more pages.
/// Returns a function that encodes the reply frame for a request id.
#[allow(clippy::too_many_arguments)]
fn record_scan(
    engine: &Engine,
    table: TableId,
    tablet: Option<(TabletId, u16, u16)>,
    snap: Snapshot,
    query: &Query,
    max_records: usize,
    limits: ScanLimits,
    cursors: &CursorMap,
) -> Result<impl FnOnce(u64) -> BytesMut, Failure> {
    let cursor = match tablet {
        None => engine.scan_cursor(table, snap, query),
        Some((tablet, first, last)) => engine.scan_cursor_slots(tablet, snap, query, (first, last)),
    }
    .map_err(engine_failure)?;
    let mut state = CursorState {
        cursor,
        pending: VecDeque::new(),
    };
    let version = state.cursor.snapshot().version();
    let (page, done) =
        fill_page(&mut state, max_records, limits.page_bytes_max).map_err(engine_failure)?;
    let reply_cursor = if done {
        0
    } else {
        let mut map = cursors.lock();
        if map.len() >= limits.cursors_max {
            return Err(too_many_cursors(limits.cursors_max));
        }
        let cursor_id = next_id();
        map.insert(cursor_id, Arc::new(Mutex::new(state)));
        cursor_id
    };
    let op = if tablet.is_some() {
        opcode::SCAN_TABLET
    } else {
        opcode::SCAN_FILTERED
    };
    Ok(move |id: u64| page_frame(id, op, reply_cursor, version, &page))
}

/// Records for one page: at most `max` records and (beyond the first) `bytes_max` bytes; records
/// read from the engine beyond that wait in `pending` for the next page. Returns the page and
/// whether the scan is complete.
fn fill_page(
    state: &mut CursorState,
    max: usize,
    bytes_max: usize,
) -> Result<(Vec<ScanRecord>, bool), EngineError> {
    let mut page = Vec::new();
    let mut bytes = 0usize;
    // Largest record seen, to size the next read from the engine.
    let mut largest = 0usize;
    loop {
        while let Some(r) = state.pending.front() {
            let b = record_wire_bytes(r.key.len(), r.value.len());
            if page.len() >= max || (!page.is_empty() && bytes + b > bytes_max) {
                return Ok((page, false));
            }
            bytes += b;
            largest = largest.max(b);
            page.extend(state.pending.pop_front());
        }
        if page.len() >= max || state.cursor.is_done() {
            break;
        }
        let room = max - page.len();
        // Before any record is seen, a small read; then as many records of the largest size seen as
        // the page still has room for.
        let want = match bytes_max.saturating_sub(bytes).checked_div(largest) {
            None => room.min(32),
            Some(fit) => room.min(fit.max(1)),
        };
        let got = state.cursor.next_page(want)?;
        if got.is_empty() {
            break;
        }
        state.pending.extend(got);
    }
    let done = state.pending.is_empty() && state.cursor.is_done();
    Ok((page, done))
}

fn page_frame(id: u64, op: u8, cursor: u64, version: u64, page: &[ScanRecord]) -> BytesMut {
    let bytes: usize = page
        .iter()
        .map(|r| record_wire_bytes(r.key.len(), r.value.len()))
        .sum();
    let mut out = BytesMut::with_capacity(64 + bytes);
    let start = begin_scan_page(&mut out, id, op, cursor, version, page.len() as u32);
    for r in page {
        put_record(&mut out, &r.key, &r.value, r.version, r.expire_at_ms);
    }
    finish_reply_frame(&mut out, start);
    out
}

/// SET_SCHEMA's body as a schema: empty removes the table's schema.
pub(super) fn decode_schema(bytes: &[u8]) -> Result<Option<ramlog_logmem::query::Schema>, Failure> {
    if bytes.is_empty() {
        return Ok(None);
    }
    ramlog_logmem::query::Schema::from_bytes(bytes)
        .map(Some)
        .map_err(|e| Failure(Status::BadRequest, 0, format!("bad schema: {e}")))
}
