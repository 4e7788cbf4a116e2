//! A client for a whole cluster: routes each key to the master of its tablet.
//!
//! Owns: the cached cluster map (replaced only by a higher version), one pooled [`Client`] per
//! server (connected on first use to the server's native address, with the seed's password and
//! timeouts), routing by `(table, key_slot(key))`, the split of MULTI_GET by server, the
//! single-tablet check of MULTI_PUT, key listings over every master, and retries after a map
//! refresh. Hides: which server answers what.
//!
//! Retries: a request refused with `WrongServer` or `NoSuchTable` (the server applied nothing), or
//! whose connection could not even be opened (nothing was sent), or for a tablet the map shows
//! being recovered after its master failed (not sent at all), is retried after a pause (50, 100,
//! then 200 ms) and a map refresh, until it succeeds or [`ClientConfig::recovery_wait`] (10 s)
//! has passed since its first failure: a master's failure costs the caller a wait, not an
//! error. A read (GET, MULTI_GET, SCAN_KEYS) is also retried when the connection broke under
//! it; a write never is, since it may have been applied.
//!
//! A seed server that answers CLUSTER_MAP with nothing is standalone: every request then goes to
//! it unchanged.
//!
//! ```no_run
//! # async fn demo() -> Result<(), ramlog_client::Error> {
//! use ramlog_client::{ClientConfig, ClusterClient};
//! let cluster = ClusterClient::connect(ClientConfig::new("127.0.0.1:7380")).await?;
//! cluster.put(b"user:1", b"alice").await?;
//! let values = cluster.multi_get(&[b"user:1", b"user:2"]).await?;
//! assert_eq!(values.len(), 2);
//! # Ok(()) }
//! ```

use crate::{
    unexpected, Client, ClientConfig, Condition, Error, Expiry, Object, Request, Response,
};
use crate::{PutOptions, PutResult};
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use ramlog_cluster::{ClusterMap, ServerId, ServerState, TabletInfo};
use ramlog_common::{key_slot, TableId, Version};
use ramlog_proto::native::Status;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

/// Pauses before the first retries of a routed request; the last is repeated until the
/// request's [`ClientConfig::recovery_wait`] has passed.
const RETRY_BACKOFF_MS: [u64; 3] = [50, 100, 200];

/// The retries of one request: a pause before each and a deadline, `recovery_wait` after its
/// first failure.
struct Retries {
    attempt: usize,
    wait: Duration,
    deadline: Option<tokio::time::Instant>,
}

impl Retries {
    fn new(wait: Duration) -> Retries {
        Retries {
            attempt: 0,
            wait,
            deadline: None,
        }
    }

    /// Pauses before the next attempt; false when the wait is over (the last error stands).
    async fn pause(&mut self) -> bool {
        let now = tokio::time::Instant::now();
        let deadline = *self.deadline.get_or_insert(now + self.wait);
        if now >= deadline {
            return false;
        }
        let step = RETRY_BACKOFF_MS[self.attempt.min(RETRY_BACKOFF_MS.len() - 1)];
        tokio::time::sleep(Duration::from_millis(step).min(deadline - now)).await;
        self.attempt += 1;
        true
    }
}

/// The cached map: replaced only by a map with a higher version.
pub(crate) struct MapCache(RwLock<Arc<ClusterMap>>);

impl MapCache {
    pub(crate) fn new(map: ClusterMap) -> MapCache {
        MapCache(RwLock::new(Arc::new(map)))
    }

    pub(crate) fn get(&self) -> Arc<ClusterMap> {
        self.0.read().clone()
    }

    /// Keep `map` if it is newer than the cached one; true if it was kept.
    pub(crate) fn offer(&self, map: ClusterMap) -> bool {
        let mut current = self.0.write();
        if map.version > current.version {
            *current = Arc::new(map);
            true
        } else {
            false
        }
    }
}

struct Shared {
    /// The seed's configuration; per-server clients copy it with another address.
    config: ClientConfig,
    seed: Client,
    /// None when the seed is a standalone server.
    map: Option<MapCache>,
    /// Pooled clients by native address (the seed's included).
    clients: Mutex<HashMap<String, Client>>,
    /// One refresh at a time; the others wait for its map.
    refreshing: tokio::sync::Mutex<()>,
}

/// A handle to a cluster (or to a standalone server). Cheap to clone; clones share the map and the
/// connections.
#[derive(Clone)]
pub struct ClusterClient {
    shared: Arc<Shared>,
    table: TableId,
    /// Scans without a cluster snapshot read each tablet on its mirror when it has one.
    scan_mirrors: bool,
}

impl std::fmt::Debug for ClusterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterClient")
            .field("seed", &self.shared.config.addr)
            .field("table", &self.table)
            .field(
                "map_version",
                &self.shared.map.as_ref().map(|m| m.get().version),
            )
            .finish()
    }
}

impl ClusterClient {
    /// Connect to the seed server (`config.addr`, its native address) and fetch its cluster map.
    pub async fn connect(config: ClientConfig) -> Result<ClusterClient, Error> {
        let seed = Client::connect(config.clone()).await?;
        let map = fetch_map(&seed).await?.map(MapCache::new);
        let clients = HashMap::from([(config.addr.clone(), seed.clone())]);
        Ok(ClusterClient {
            scan_mirrors: false,
            shared: Arc::new(Shared {
                config,
                seed,
                map,
                clients: Mutex::new(clients),
                refreshing: tokio::sync::Mutex::new(()),
            }),
            table: 0,
        })
    }

    /// A handle on the same map and connections that addresses another table.
    pub fn with_table(&self, table: TableId) -> ClusterClient {
        ClusterClient {
            table,
            ..self.clone()
        }
    }

    /// A handle whose scans without a cluster snapshot (`scan_aggregates`, `scan_records`)
    /// read each tablet on its mirror (tables in `mirror` mode), so that the master's
    /// foreground does not share its cores with them; on its master when the tablet has no
    /// mirror or the mirror refuses (its memory still being built, or it stopped mirroring).
    /// The mirror applies every write before the master acknowledges it: a tablet read there
    /// shows every write acknowledged before the scan reached it, as on its master.
    pub fn scanning_mirrors(&self, on: bool) -> ClusterClient {
        ClusterClient {
            scan_mirrors: on,
            ..self.clone()
        }
    }

    /// The table this handle addresses.
    pub fn table(&self) -> TableId {
        self.table
    }

    /// True when the seed is a standalone server (no cluster map).
    pub fn is_standalone(&self) -> bool {
        self.shared.map.is_none()
    }

    /// The client of the seed server (the one every request uses when standalone).
    pub fn seed(&self) -> Client {
        self.shared.seed.with_table(self.table)
    }

    /// The cached map (an empty map, version 0, when standalone).
    pub fn map(&self) -> ClusterMap {
        self.shared
            .map
            .as_ref()
            .map(|m| (*m.get()).clone())
            .unwrap_or_default()
    }

    /// Ask a reachable server (the seed first, then the servers of the cached map) for its map and
    /// keep it if its version is higher than the cached one; returns the map now cached.
    pub async fn refresh_map(&self) -> Result<ClusterMap, Error> {
        self.refresh(None).await?;
        Ok(self.map())
    }

    /// Refresh the map; with `seen`, only if no other task replaced map version `seen` meanwhile.
    async fn refresh(&self, seen: Option<u64>) -> Result<(), Error> {
        let Some(cache) = &self.shared.map else {
            return Ok(());
        };
        let _one_at_a_time = self.shared.refreshing.lock().await;
        let current = cache.get();
        if seen.is_some_and(|seen| current.version > seen) {
            return Ok(());
        }
        let mut last_error = None;
        for addr in refresh_candidates(&self.shared.config.addr, &current) {
            let fetched = match self.client_for(&addr).await {
                Ok(client) => fetch_map(&client).await,
                Err(e) => Err(e),
            };
            match fetched {
                Ok(Some(map)) => {
                    if cache.offer(map) {
                        tracing::debug!(version = cache.get().version, from = %addr, "new cluster map");
                    }
                    return Ok(());
                }
                Ok(None) => {
                    last_error = Some(Error::Protocol(format!(
                        "{addr} answered CLUSTER_MAP with no map (a standalone server)"
                    )))
                }
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error
            .unwrap_or_else(|| Error::Protocol("no server to ask for the cluster map".into())))
    }

    /// The pooled client of the server at `addr`, connected on first use.
    async fn client_for(&self, addr: &str) -> Result<Client, Error> {
        if let Some(client) = self.shared.clients.lock().get(addr) {
            return Ok(client.clone());
        }
        let mut config = self.shared.config.clone();
        config.addr = addr.to_string();
        let client = Client::connect(config).await?;
        Ok(self
            .shared
            .clients
            .lock()
            .entry(addr.to_string())
            .or_insert(client)
            .clone())
    }

    /// Run `op` on the client of `key`'s master (after `check` passes on the map used), retrying
    /// as the module documentation says.
    async fn routed<T, C, F, Fut>(
        &self,
        key: &[u8],
        idempotent: bool,
        check: C,
        op: F,
    ) -> Result<T, Error>
    where
        C: Fn(&ClusterMap) -> Result<(), Error>,
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let Some(cache) = &self.shared.map else {
            return op(self.seed()).await;
        };
        let mut retries = self.retries();
        loop {
            let map = cache.get();
            let result = match check(&map).and_then(|()| route(&map, self.table, key)) {
                Ok((_, addr)) => match self.client_for(&addr).await {
                    Ok(client) => op(client.with_table(self.table)).await,
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            match result {
                Err(e) if retryable(&e, idempotent) => {
                    if !self.backoff_and_refresh(&mut retries, map.version).await {
                        return Err(e);
                    }
                    tracing::debug!(error = %e, attempt = retries.attempt, "retried after a map refresh");
                }
                other => return other,
            }
        }
    }

    fn retries(&self) -> Retries {
        Retries::new(self.shared.config.recovery_wait)
    }

    /// Pauses, then refreshes the map (unless another task replaced version `seen` meanwhile);
    /// false, at once, when the request's wait is over.
    async fn backoff_and_refresh(&self, retries: &mut Retries, seen: u64) -> bool {
        if !retries.pause().await {
            return false;
        }
        if let Err(e) = self.refresh(Some(seen)).await {
            tracing::debug!(error = %e, "cluster map refresh failed");
        }
        true
    }

    /// The object stored under `key` with its version, or None.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Object>, Error> {
        self.routed(key, true, no_check, |c| async move { c.get(key).await })
            .await
    }

    /// Store `value` under `key` unconditionally; returns the new version.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<Version, Error> {
        Ok(self
            .put_with(key, value, PutOptions::default())
            .await?
            .version)
    }

    /// Store with a condition, an expiry, and optionally get the replaced object back.
    pub async fn put_with(
        &self,
        key: &[u8],
        value: &[u8],
        options: PutOptions,
    ) -> Result<PutResult, Error> {
        self.routed(key, false, no_check, |c| async move {
            c.put_with(key, value, options).await
        })
        .await
    }

    /// Delete `key`; returns the delete's version if the key existed.
    pub async fn delete(&self, key: &[u8]) -> Result<Option<Version>, Error> {
        self.delete_with(key, Condition::None).await
    }

    /// Delete `key` if `condition` holds.
    pub async fn delete_with(
        &self,
        key: &[u8],
        condition: Condition,
    ) -> Result<Option<Version>, Error> {
        self.routed(key, false, no_check, |c| async move {
            c.delete_with(key, condition).await
        })
        .await
    }

    /// Add `delta` to the ASCII decimal integer under `key` (absent = 0); returns the new value and
    /// version.
    pub async fn increment(&self, key: &[u8], delta: i64) -> Result<(i64, Version), Error> {
        self.routed(key, false, no_check, |c| async move {
            c.increment(key, delta).await
        })
        .await
    }

    /// Set or clear `key`'s expiry; returns the new version if the key exists.
    pub async fn expire(&self, key: &[u8], expiry: Expiry) -> Result<Option<Version>, Error> {
        self.routed(key, false, no_check, |c| async move {
            c.expire(key, expiry).await
        })
        .await
    }

    /// Read many keys: one MULTI_GET per server holding some of them, sent at once; one entry per
    /// key, in the order of `keys`.
    pub async fn multi_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Object>>, Error> {
        let Some(cache) = &self.shared.map else {
            return self.seed().multi_get(keys).await;
        };
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut results: Vec<Option<Option<Object>>> = vec![None; keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        let mut retries = self.retries();
        loop {
            let map = cache.get();
            let mut failed = Vec::new();
            let mut last_error = None;
            match split_by_server(&map, self.table, keys, &pending) {
                Ok(groups) => {
                    let calls = groups.into_iter().map(|(_, addr, indices)| async move {
                        let reply = async {
                            let client = self.client_for(&addr).await?;
                            let group: Vec<&[u8]> = indices.iter().map(|&i| keys[i]).collect();
                            client.with_table(self.table).multi_get(&group).await
                        }
                        .await;
                        (indices, reply)
                    });
                    for (indices, reply) in join_all(calls.collect()).await {
                        match reply {
                            Ok(objects) => place(&mut results, &indices, objects)?,
                            Err(e) if retryable(&e, true) => {
                                failed.extend(indices);
                                last_error = Some(e);
                            }
                            Err(e) => return Err(e),
                        }
                    }
                }
                Err(e) if retryable(&e, true) => {
                    failed = pending.clone();
                    last_error = Some(e);
                }
                Err(e) => return Err(e),
            }
            match last_error {
                None => {
                    return Ok(results
                        .into_iter()
                        .map(|r| r.expect("every key was answered"))
                        .collect())
                }
                Some(e) => {
                    if !self.backoff_and_refresh(&mut retries, map.version).await {
                        return Err(e);
                    }
                    tracing::debug!(error = %e, attempt = retries.attempt, "retried part of a MULTI_GET");
                    failed.sort_unstable();
                    pending = failed;
                }
            }
        }
    }

    /// Write many keys atomically under one version. All keys must live on one tablet (use a
    /// `{hash tag}`); otherwise nothing is sent and the answer is [`Error::CrossTablet`], as the
    /// server would answer.
    pub async fn multi_put(&self, items: &[(&[u8], &[u8])]) -> Result<Version, Error> {
        let Some((first_key, _)) = items.first() else {
            // The server answers an empty MULTI_PUT with its error.
            return self.seed().multi_put(items).await;
        };
        let table = self.table;
        let check = |map: &ClusterMap| single_tablet(map, table, items.iter().map(|(k, _)| *k));
        self.routed(first_key, false, check, |c| async move {
            c.multi_put(items).await
        })
        .await
    }

    /// Every key of the table matching `pattern` (a Redis-style glob; empty matches every key):
    /// the key listings of every server that masters tablets of the table, concatenated in server
    /// order. A key may repeat if the key set changes meanwhile.
    pub async fn scan_all(&self, pattern: &[u8]) -> Result<Vec<Bytes>, Error> {
        let Some(cache) = &self.shared.map else {
            return self.seed().scan_all(pattern).await;
        };
        let mut retries = self.retries();
        loop {
            let map = cache.get();
            let result = self.scan_all_once(&map, pattern).await;
            match result {
                Err(e) if retryable(&e, true) => {
                    if !self.backoff_and_refresh(&mut retries, map.version).await {
                        return Err(e);
                    }
                    tracing::debug!(error = %e, attempt = retries.attempt, "retried a key listing");
                }
                other => return other,
            }
        }
    }

    /// The schema of this handle's table, from the cluster map (None without one).
    pub fn schema(&self) -> Result<Option<ramlog_query::Schema>, Error> {
        let map = self.map();
        let Some(bytes) = map
            .tables
            .iter()
            .find(|t| t.id == self.table)
            .and_then(|t| t.schema.clone())
        else {
            return Ok(None);
        };
        ramlog_query::Schema::from_bytes(&bytes)
            .map(Some)
            .map_err(|e| Error::Protocol(format!("the map's schema of table {}: {e}", self.table)))
    }

    /// The aggregates of `query` over the whole table: each tablet's part on its master, all in
    /// parallel (SCAN_TABLET), merged here (counts and sums add, min and max take the extreme;
    /// `matched` and `malformed` add; `snapshot_version` is the highest tablet's). Each tablet is
    /// read at a snapshot of its own master: the result is not one cut across servers. A
    /// tablet that is recovering, or that moved, split or merged under the scan, makes the scan
    /// start again from a newer map (until the recovery wait runs out): no tablet is counted
    /// twice or left out.
    pub async fn scan_aggregates(
        &self,
        query: &ramlog_query::Query,
    ) -> Result<crate::ScanAggregates, Error> {
        if self.shared.map.is_none() {
            return self.seed().scan_aggregates(query, None).await;
        }
        if query.aggregates.is_empty() {
            return Err(Error::InvalidQuery(
                "scan_aggregates needs a query with aggregates".into(),
            ));
        }
        let partial = Partial::of(query)?;
        self.each_tablet(|map| self.aggregates_once(map, None, &partial))
            .await
    }

    /// Every record `query` (no aggregates) selects in the whole table: each tablet's part on
    /// its master, in parallel (SCAN_TABLET, then pages of `page_records`), in slot order of the
    /// tablets. Restarted as [`ClusterClient::scan_aggregates`] is.
    pub async fn scan_records(
        &self,
        query: &ramlog_query::Query,
        page_records: u32,
    ) -> Result<Vec<crate::Record>, Error> {
        if self.shared.map.is_none() {
            return self.seed().scan_records(query, None, page_records).await;
        }
        if !query.aggregates.is_empty() {
            return Err(Error::InvalidQuery(
                "scan_records needs a query without aggregates".into(),
            ));
        }
        let bytes = query
            .to_bytes()
            .map_err(|e| Error::InvalidQuery(e.to_string()))?;
        let page = page_records.max(1);
        self.each_tablet(|map| self.records_once(map, None, &bytes, page, None))
            .await
    }

    /// One step of a resumable scan of the records `query` selects (no aggregates), Redis
    /// SCAN-style: `cursor` 0 starts; the answer is the cursor to continue with (0 at the end)
    /// and at least `count` records unless the end came first. The cursor names a hash slot
    /// and a number of slots per step, nothing held by a server: any process can continue it,
    /// through fail-overs and moves. Each step reads whole slots, each group of slots at one
    /// snapshot of its tablet's master, so a key that exists for the whole scan is returned
    /// exactly once; a key written or deleted meanwhile may or may not be.
    pub async fn scan_step(
        &self,
        query: &ramlog_query::Query,
        cursor: u64,
        count: usize,
    ) -> Result<(u64, Vec<crate::Record>), Error> {
        if !query.aggregates.is_empty() {
            return Err(Error::InvalidQuery(
                "a resumable scan returns records; aggregates come whole (scan_aggregates)".into(),
            ));
        }
        let (mut slot, mut chunk) =
            ramlog_query::scan_position(cursor).map_err(|e| Error::InvalidQuery(e.to_string()))?;
        if self.shared.map.is_none() {
            return Err(Error::InvalidQuery(
                "a resumable scan steps through a cluster's slots; this server is standalone"
                    .into(),
            ));
        }
        let bytes = query
            .to_bytes()
            .map_err(|e| Error::InvalidQuery(e.to_string()))?;
        let count = count.max(1);
        let mut out = Vec::new();
        loop {
            let (last, records) = self
                .each_tablet(|map| self.step_once(map, slot, chunk, &bytes))
                .await?;
            // Steps of about `count` records: fewer slots where they are dense.
            if records.len() > count.saturating_mul(2) {
                chunk = (chunk / 2).max(1);
            } else if records.len() < count / 2 {
                chunk = chunk.saturating_mul(2).min(ramlog_query::SCAN_CHUNK_MAX);
            }
            out.extend(records);
            if last + 1 >= ramlog_common::slot::SLOT_COUNT {
                return Ok((0, out));
            }
            slot = last + 1;
            if out.len() >= count {
                return Ok((ramlog_query::scan_cursor(slot, chunk), out));
            }
        }
    }

    /// Reads slots `slot..` (at most `chunk`, within one tablet) on the tablet's master: the
    /// last slot read and the records.
    async fn step_once(
        &self,
        map: Arc<ClusterMap>,
        slot: u16,
        chunk: u16,
        query: &[u8],
    ) -> Result<(u16, Vec<crate::Record>), Error> {
        let t = map
            .tablet_at(self.table, slot)
            .ok_or_else(|| no_tablet_of(self.table, &map))?;
        if t.recovering {
            return Err(Error::Server {
                status: Status::WrongServer,
                message: format!(
                    "slots {}-{} of table {} are being recovered (map version {})",
                    t.first_slot, t.last_slot, self.table, map.version
                ),
            });
        }
        let addr = map
            .server(t.master)
            .map(|s| s.addresses.native.to_string())
            .ok_or_else(|| Error::Server {
                status: Status::WrongServer,
                message: format!(
                    "the cluster map (version {}) names server {} as a master but does not list it",
                    map.version, t.master
                ),
            })?;
        let last = slot.saturating_add(chunk - 1).min(t.last_slot);
        let tablet = crate::TabletScan {
            first_slot: t.first_slot,
            last_slot: t.last_slot,
            epoch: t.epoch,
            only_slots: (slot, last),
        };
        let client = self.client_for(&addr).await?;
        match client
            .scan_tablet_raw(self.table, tablet, crate::ScanAt::Master, query, 1000)
            .await?
        {
            crate::ScanResult::Records {
                mut records, more, ..
            } => {
                if let Some(mut more) = more {
                    records.extend(more.collect(1000).await?);
                }
                Ok((last, records))
            }
            crate::ScanResult::Aggregates(_) => Err(Error::Protocol(
                "SCAN_TABLET answered aggregates to a record query".into(),
            )),
        }
    }

    /// A cluster snapshot of this handle's table: a snapshot on every master of the table, all
    /// cut while every one of them held its writes at once (SNAPSHOT_CUT at one wall-clock
    /// instant; the holds are checked to overlap, and the cut taken again, with a longer lead
    /// and hold, when they do not). See `docs/architecture.md`, "Cluster snapshots", for what
    /// it sees. A tablet that is recovering makes it wait for a newer map (until the recovery
    /// wait runs out).
    pub async fn cluster_snapshot(&self) -> Result<ClusterSnapshot, Error> {
        let Some(cache) = &self.shared.map else {
            return Err(Error::Protocol(
                "a cluster snapshot needs a cluster (this server is standalone)".into(),
            ));
        };
        let mut retries = self.retries();
        let mut lead = CUT_LEAD_FIRST;
        let mut hold = CUT_HOLD_FIRST;
        loop {
            let map = cache.get();
            match self.cut_once(map.clone(), lead, hold).await {
                Ok(Some(snapshot)) => return Ok(snapshot),
                Ok(None) => {
                    // The holds did not overlap (a server got the request late, or its cut
                    // thread woke late): again, with more room.
                    if lead >= CUT_LEAD_MAX && hold >= CUT_HOLD_MAX {
                        return Err(Error::Protocol(format!(
                            "the masters' holds did not overlap even with a lead of {} ms and a hold of {} ms",
                            lead.as_millis(),
                            hold.as_millis()
                        )));
                    }
                    lead = (lead * 2).min(CUT_LEAD_MAX);
                    hold = (hold * 2).min(CUT_HOLD_MAX);
                }
                Err(e) if retryable(&e, true) => {
                    if !self.backoff_and_refresh(&mut retries, map.version).await {
                        return Err(e);
                    }
                    tracing::debug!(error = %e, attempt = retries.attempt, "took a cluster snapshot again");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One try of [`ClusterClient::cluster_snapshot`]: None when the holds did not overlap.
    async fn cut_once(
        &self,
        map: Arc<ClusterMap>,
        lead: Duration,
        hold: Duration,
    ) -> Result<Option<ClusterSnapshot>, Error> {
        let mut addrs: Vec<String> = Self::tablet_masters(&map, self.table)?
            .into_iter()
            .map(|(_, addr)| addr)
            .collect();
        addrs.sort();
        addrs.dedup();
        // Connected first, so that the lead is not spent connecting.
        let mut clients = Vec::new();
        for addr in &addrs {
            clients.push(self.client_for(addr).await?.with_table(self.table));
        }
        let at = ramlog_common::unix_ns() + lead.as_nanos() as u64;
        let cuts = clients.iter().map(|c| c.snapshot_cut(at, hold));
        let mut parts = HashMap::new();
        let (mut from, mut to) = (0u64, u64::MAX);
        let mut first_error = None;
        for (addr, cut) in addrs.into_iter().zip(join_all(cuts.collect()).await) {
            match cut {
                Ok((snapshot, f, t)) => {
                    from = from.max(f);
                    to = to.min(t);
                    parts.insert(addr, snapshot);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        // Snapshots of a failed try are released as they drop.
        if let Some(e) = first_error {
            return Err(e);
        }
        if from >= to {
            return Ok(None);
        }
        Ok(Some(ClusterSnapshot {
            map,
            parts,
            held_from_ns: from,
            held_to_ns: to,
        }))
    }

    /// [`ClusterClient::scan_aggregates`] at a cluster snapshot: every tablet on the master the
    /// snapshot was cut on, at its part of the snapshot. Fails (`Error::SnapshotTooOld`, or the
    /// error of a master that is gone) when a tablet changed master, split or merged since:
    /// the snapshot's versions are not on its new master. Use
    /// [`ClusterClient::scan_aggregates_consistent`] to take a new snapshot then.
    pub async fn scan_aggregates_at(
        &self,
        snapshot: &ClusterSnapshot,
        query: &ramlog_query::Query,
    ) -> Result<crate::ScanAggregates, Error> {
        if query.aggregates.is_empty() {
            return Err(Error::InvalidQuery(
                "scan_aggregates needs a query with aggregates".into(),
            ));
        }
        let partial = Partial::of(query)?;
        self.aggregates_once(snapshot.map.clone(), Some(snapshot), &partial)
            .await
    }

    /// [`ClusterClient::scan_records`] at a cluster snapshot (see
    /// [`ClusterClient::scan_aggregates_at`]); with `limit`, at most that many records from
    /// each tablet (so the first `limit` records in tablet order are exact).
    pub async fn scan_records_at(
        &self,
        snapshot: &ClusterSnapshot,
        query: &ramlog_query::Query,
        page_records: u32,
        limit: Option<usize>,
    ) -> Result<Vec<crate::Record>, Error> {
        if !query.aggregates.is_empty() {
            return Err(Error::InvalidQuery(
                "scan_records needs a query without aggregates".into(),
            ));
        }
        let bytes = query
            .to_bytes()
            .map_err(|e| Error::InvalidQuery(e.to_string()))?;
        self.records_once(
            snapshot.map.clone(),
            Some(snapshot),
            &bytes,
            page_records.max(1),
            limit,
        )
        .await
    }

    /// The aggregates of `query` at a new cluster snapshot, taken again (and the scan run
    /// again) when a fail-over, move, split or merge comes between the snapshot and a tablet's
    /// scan, until the recovery wait runs out. Returns the snapshot it read at too.
    pub async fn scan_aggregates_consistent(
        &self,
        query: &ramlog_query::Query,
    ) -> Result<(crate::ScanAggregates, ClusterSnapshot), Error> {
        match self.at_new_snapshot(Wanted::Aggregates(query)).await? {
            (Scanned::Aggregates(a), snapshot) => Ok((a, snapshot)),
            _ => unreachable!("an aggregate scan answers aggregates"),
        }
    }

    /// The records `query` selects at a new cluster snapshot (see
    /// [`ClusterClient::scan_aggregates_consistent`]).
    pub async fn scan_records_consistent(
        &self,
        query: &ramlog_query::Query,
        page_records: u32,
    ) -> Result<(Vec<crate::Record>, ClusterSnapshot), Error> {
        match self
            .at_new_snapshot(Wanted::Records(query, page_records))
            .await?
        {
            (Scanned::Records(r), snapshot) => Ok((r, snapshot)),
            _ => unreachable!("a record scan answers records"),
        }
    }

    /// How many records `query` selects, and the first `limit` of them in tablet order, at a
    /// new cluster snapshot (see [`ClusterClient::scan_aggregates_consistent`]).
    pub async fn scan_page_consistent(
        &self,
        query: &ramlog_query::Query,
        page_records: u32,
        limit: usize,
    ) -> Result<(u64, Vec<crate::Record>, ClusterSnapshot), Error> {
        match self
            .at_new_snapshot(Wanted::Page(query, page_records, limit))
            .await?
        {
            (Scanned::Page(matched, r), snapshot) => Ok((matched, r, snapshot)),
            _ => unreachable!("a page scan answers a page"),
        }
    }

    /// The first `limit` records `query` selects in tablet order, each tablet at its master's
    /// own snapshot (as [`ClusterClient::scan_records`]).
    pub async fn scan_records_limited(
        &self,
        query: &ramlog_query::Query,
        page_records: u32,
        limit: usize,
    ) -> Result<Vec<crate::Record>, Error> {
        let bytes = query
            .to_bytes()
            .map_err(|e| Error::InvalidQuery(e.to_string()))?;
        let page = page_records.max(1);
        let mut records = self
            .each_tablet(|map| self.records_once(map, None, &bytes, page, Some(limit)))
            .await?;
        records.truncate(limit);
        Ok(records)
    }

    async fn at_new_snapshot(
        &self,
        wanted: Wanted<'_>,
    ) -> Result<(Scanned, ClusterSnapshot), Error> {
        let mut retries = self.retries();
        loop {
            let snapshot = self.cluster_snapshot().await?;
            let result = match wanted {
                Wanted::Aggregates(q) => self
                    .scan_aggregates_at(&snapshot, q)
                    .await
                    .map(Scanned::Aggregates),
                Wanted::Records(q, page) => self
                    .scan_records_at(&snapshot, q, page, None)
                    .await
                    .map(Scanned::Records),
                Wanted::Page(q, page, limit) => {
                    let mut count = q.clone();
                    count.projection = None;
                    count.aggregates = vec![ramlog_query::Aggregate::Count];
                    match self.scan_aggregates_at(&snapshot, &count).await {
                        Ok(a) => self
                            .scan_records_at(&snapshot, q, page, Some(limit))
                            .await
                            .map(|mut r| {
                                r.truncate(limit);
                                Scanned::Page(a.matched, r)
                            }),
                        Err(e) => Err(e),
                    }
                }
            };
            match result {
                Ok(scanned) => return Ok((scanned, snapshot)),
                Err(e) if retryable(&e, true) || snapshot_lost(&e) => {
                    let seen = snapshot.map.version;
                    drop(snapshot);
                    if !self.backoff_and_refresh(&mut retries, seen).await {
                        return Err(e);
                    }
                    tracing::debug!(error = %e, attempt = retries.attempt, "scanned again at a new cluster snapshot");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Runs `once` over the cached map, again from a refreshed map after a retryable failure.
    async fn each_tablet<'a, T, F, Fut>(&'a self, once: F) -> Result<T, Error>
    where
        F: Fn(Arc<ClusterMap>) -> Fut,
        Fut: Future<Output = Result<T, Error>> + 'a,
    {
        let cache = self.shared.map.as_ref().expect("a cluster handle");
        let mut retries = self.retries();
        loop {
            let map = cache.get();
            let version = map.version;
            match once(map).await {
                Err(e) if retryable(&e, true) => {
                    if !self.backoff_and_refresh(&mut retries, version).await {
                        return Err(e);
                    }
                    tracing::debug!(error = %e, attempt = retries.attempt, "restarted a cluster scan");
                }
                other => return other,
            }
        }
    }

    /// Each tablet of the table with its master's native address; WRONG_SERVER (retried after a
    /// map refresh) for a tablet that is recovering.
    fn tablet_masters(
        map: &ClusterMap,
        table: TableId,
    ) -> Result<Vec<(TabletInfo, String)>, Error> {
        let mut out = Vec::new();
        for t in map.tablets_of(table) {
            if t.recovering {
                return Err(Error::Server {
                    status: Status::WrongServer,
                    message: format!(
                        "slots {}-{} of table {table} are being recovered (map version {})",
                        t.first_slot, t.last_slot, map.version
                    ),
                });
            }
            let server = map.server(t.master).ok_or_else(|| Error::Server {
                status: Status::WrongServer,
                message: format!(
                    "the cluster map (version {}) names server {} as a master but does not list it",
                    map.version, t.master
                ),
            })?;
            out.push((t.clone(), server.addresses.native.to_string()));
        }
        if out.is_empty() {
            return Err(no_tablet_of(table, map));
        }
        Ok(out)
    }

    /// SCAN_TABLET of tablet `t`: on its master `addr` (at its part of `snapshot` if given), or,
    /// for a handle [`ClusterClient::scanning_mirrors`] without a snapshot, on its mirror first.
    async fn scan_part(
        &self,
        map: &ClusterMap,
        t: &TabletInfo,
        addr: &str,
        snapshot: Option<&ClusterSnapshot>,
        query: &[u8],
        page: u32,
    ) -> Result<crate::ScanResult, Error> {
        let slots = crate::TabletScan::whole(t.first_slot, t.last_slot, t.epoch);
        let mirror = t
            .mirror
            .filter(|_| self.scan_mirrors && snapshot.is_none())
            .and_then(|m| map.server(m))
            .filter(|s| s.state == ServerState::Up)
            .map(|s| s.addresses.native.to_string());
        if let Some(mirror) = mirror {
            let client = self.client_for(&mirror).await?;
            match client
                .scan_tablet_raw(self.table, slots, crate::ScanAt::Mirror, query, page)
                .await
            {
                Err(e) if retryable(&e, true) => {
                    tracing::debug!(error = %e, "the mirror refused a scan; reading the master");
                }
                other => return other,
            }
        }
        let client = self.client_for(addr).await?;
        let at = match snapshot {
            Some(s) => crate::ScanAt::Snapshot(s.part(addr)?),
            None => crate::ScanAt::Master,
        };
        client
            .scan_tablet_raw(self.table, slots, at, query, page)
            .await
    }

    async fn aggregates_once(
        &self,
        map: Arc<ClusterMap>,
        snapshot: Option<&ClusterSnapshot>,
        partial: &Partial,
    ) -> Result<crate::ScanAggregates, Error> {
        let table = self.table;
        let query = &partial.bytes[..];
        let map_ref = &*map;
        let parts = Self::tablet_masters(&map, table)?
            .into_iter()
            .map(|(t, addr)| async move {
                match self
                    .scan_part(map_ref, &t, &addr, snapshot, query, 1)
                    .await?
                {
                    crate::ScanResult::Aggregates(a) => Ok(a),
                    crate::ScanResult::Records { .. } => Err(Error::Protocol(
                        "SCAN_TABLET answered records to an aggregate query".into(),
                    )),
                }
            });
        let aggregates = &partial.query.aggregates;
        let merge_values = |acc: &mut Vec<ramlog_query::Value>,
                            part: Vec<ramlog_query::Value>|
         -> Result<(), Error> {
            if acc.len() != part.len() || part.len() != aggregates.len() {
                return Err(Error::Protocol(format!(
                    "SCAN_TABLET answered {} aggregate values for {} aggregates",
                    part.len(),
                    aggregates.len()
                )));
            }
            for ((a, v), agg) in acc.iter_mut().zip(part).zip(aggregates) {
                *a = merge_aggregate(agg, std::mem::replace(a, ramlog_query::Value::Null), v)?;
            }
            Ok(())
        };
        let mut total: Option<crate::ScanAggregates> = None;
        // A grouped query's groups, by their value's encoding.
        let mut groups: BTreeMap<Vec<u8>, (ramlog_query::Value, Vec<ramlog_query::Value>)> =
            BTreeMap::new();
        for part in join_all(parts.collect()).await {
            let mut part = part?;
            for (value, values) in part.groups.take().unwrap_or_default() {
                let mut key = Vec::new();
                ramlog_query::encode_values(std::slice::from_ref(&value), &mut key)
                    .map_err(|e| Error::Protocol(format!("a group value: {e}")))?;
                match groups.get_mut(&key) {
                    Some((_, acc)) => merge_values(acc, values)?,
                    None => {
                        if values.len() != aggregates.len() {
                            return Err(Error::Protocol(format!(
                                "SCAN_TABLET answered {} aggregate values for {} aggregates",
                                values.len(),
                                aggregates.len()
                            )));
                        }
                        groups.insert(key, (value, values));
                    }
                }
            }
            total = Some(match total {
                None => part,
                Some(mut t) => {
                    if partial.query.group_by.is_none() {
                        merge_values(&mut t.values, part.values)?;
                    }
                    t.matched += part.matched;
                    t.malformed += part.malformed;
                    t.snapshot_version = t.snapshot_version.max(part.snapshot_version);
                    t
                }
            });
        }
        let mut total =
            total.ok_or_else(|| Error::Protocol("a cluster scan read no tablet".into()))?;
        if let Some(g) = partial.query.group_by {
            if groups.len() > g.groups_max as usize {
                return Err(Error::Server {
                    status: Status::BadRequest,
                    message: format!(
                        "bad query: more than {} groups over the tablets (raise the query's bound on groups, or filter more)",
                        g.groups_max
                    ),
                });
            }
            let mut finished = groups
                .into_values()
                .map(|(value, values)| (value, partial.finish(values)))
                .collect::<Vec<_>>();
            finished.sort_by(|a, b| ramlog_query::compare_values(&a.0, &b.0));
            total.values = Vec::new();
            total.groups = Some(finished);
        } else {
            total.values = partial.finish(std::mem::take(&mut total.values));
        }
        Ok(total)
    }

    async fn records_once(
        &self,
        map: Arc<ClusterMap>,
        snapshot: Option<&ClusterSnapshot>,
        query: &[u8],
        page: u32,
        limit: Option<usize>,
    ) -> Result<Vec<crate::Record>, Error> {
        let limit = limit.unwrap_or(usize::MAX);
        let page = page.min(u32::try_from(limit).unwrap_or(u32::MAX)).max(1);
        let table = self.table;
        let map_ref = &*map;
        let parts = Self::tablet_masters(&map, table)?
            .into_iter()
            .map(|(t, addr)| async move {
                match self
                    .scan_part(map_ref, &t, &addr, snapshot, query, page)
                    .await?
                {
                    crate::ScanResult::Records {
                        mut records, more, ..
                    } => {
                        if let Some(mut more) = more {
                            if limit == usize::MAX {
                                records.extend(more.collect(page).await?);
                            } else {
                                // At most `limit` from each tablet: the first `limit` of all
                                // are among them.
                                while records.len() < limit && !more.is_done() {
                                    records.extend(more.next_page(page).await?);
                                }
                                more.close().await?;
                            }
                        }
                        records.truncate(limit);
                        Ok(records)
                    }
                    crate::ScanResult::Aggregates(_) => Err(Error::Protocol(
                        "SCAN_TABLET answered aggregates to a record query".into(),
                    )),
                }
            });
        let mut all = Vec::new();
        for part in join_all(parts.collect()).await {
            all.extend(part?);
        }
        Ok(all)
    }

    async fn scan_all_once(&self, map: &ClusterMap, pattern: &[u8]) -> Result<Vec<Bytes>, Error> {
        let masters = masters_of(map, self.table)?;
        let table = self.table;
        let listings = masters.into_iter().map(|(id, addr)| async move {
            let client = self.client_for(&addr).await?.with_table(table);
            let mut keys = Vec::new();
            let mut cursor = 0;
            loop {
                let (next, batch) = client.scan_keys(cursor, 1000, pattern).await?;
                // A server keeps the tablets it no longer masters: list only what it masters.
                keys.extend(
                    batch
                        .into_iter()
                        .filter(|k| map.tablet_of(table, k).map(|t| t.master) == Some(id)),
                );
                if next == 0 {
                    return Ok::<_, Error>(keys);
                }
                cursor = next;
            }
        });
        let mut all = Vec::new();
        for listing in join_all(listings.collect()).await {
            all.extend(listing?);
        }
        Ok(all)
    }

    /// Send a request to the master of `key` (routed and retried like a write: only when refused)
    /// and return the raw reply.
    pub async fn request_for_key(
        &self,
        key: &[u8],
        request: &Request<'_>,
    ) -> Result<Response, Error> {
        self.routed(key, false, no_check, |c| async move {
            match c.request(request).await? {
                Response::Error(e) => Err(e.into()),
                reply => Ok(reply),
            }
        })
        .await
    }
}

/// Two tablets' values of one aggregate as one: NULL (no value seen) yields to the other;
/// counts and integer sums add (an overflow of i64 is an error, as on one server), float sums
/// add; min and max keep the extreme.
fn merge_aggregate(
    agg: &ramlog_query::Aggregate,
    a: ramlog_query::Value,
    b: ramlog_query::Value,
) -> Result<ramlog_query::Value, Error> {
    use ramlog_query::{Aggregate, Value};
    use std::cmp::Ordering;
    let (a, b) = match (a, b) {
        (Value::Null, v) | (v, Value::Null) => return Ok(v),
        pair => pair,
    };
    let mismatch = |a: &Value, b: &Value| {
        Error::Protocol(format!(
            "tablets answered {agg:?} values of different types: {a:?} and {b:?}"
        ))
    };
    match agg {
        Aggregate::Avg(_) => Err(Error::Protocol(
            "an average is merged from its sum and count, not from tablets' averages".into(),
        )),
        Aggregate::Count | Aggregate::CountOf(_) | Aggregate::Sum(_) => match (&a, &b) {
            (Value::I64(x), Value::I64(y)) => {
                x.checked_add(*y)
                    .map(Value::I64)
                    .ok_or_else(|| Error::Server {
                        status: Status::BadRequest,
                        message: format!("{agg:?} overflows a 64-bit integer over the tablets"),
                    })
            }
            (Value::F64(x), Value::F64(y)) => Ok(Value::F64(x + y)),
            _ => Err(mismatch(&a, &b)),
        },
        Aggregate::Min(_) | Aggregate::Max(_) => {
            let order = match (&a, &b) {
                (Value::I32(x), Value::I32(y)) => x.cmp(y),
                (Value::I64(x), Value::I64(y)) => x.cmp(y),
                (Value::F64(x), Value::F64(y)) => x.partial_cmp(y).unwrap_or(Ordering::Equal),
                (Value::Bool(x), Value::Bool(y)) => x.cmp(y),
                (Value::Str(x), Value::Str(y)) => x.cmp(y),
                (Value::Bytes(x), Value::Bytes(y)) => x.cmp(y),
                _ => return Err(mismatch(&a, &b)),
            };
            let keep_a = match agg {
                Aggregate::Min(_) => order != Ordering::Greater,
                _ => order != Ordering::Less,
            };
            Ok(if keep_a { a } else { b })
        }
    }
}

fn no_check(_: &ClusterMap) -> Result<(), Error> {
    Ok(())
}

/// The map the server holds, or None from a standalone server.
async fn fetch_map(client: &Client) -> Result<Option<ClusterMap>, Error> {
    match client.call(&Request::ClusterMap).await? {
        Response::ClusterMap(json) if json.is_empty() => Ok(None),
        Response::ClusterMap(json) => ClusterMap::from_json(&json)
            .map(Some)
            .map_err(|e| Error::Protocol(format!("CLUSTER_MAP reply is not a cluster map: {e}"))),
        other => Err(unexpected("CLUSTER_MAP", other)),
    }
}

/// Where to ask for a map: the seed, then the servers of `map` that are up, then the others.
fn refresh_candidates(seed: &str, map: &ClusterMap) -> Vec<String> {
    let mut out = vec![seed.to_string()];
    let up = map.servers.iter().filter(|s| s.state == ServerState::Up);
    let others = map.servers.iter().filter(|s| s.state != ServerState::Up);
    for server in up.chain(others) {
        let addr = server.addresses.native.to_string();
        if !out.contains(&addr) {
            out.push(addr);
        }
    }
    out
}

/// Whether a failed request may be sent again after a map refresh: always when the server refused
/// it or it was never sent; when the connection broke under it, only if it is idempotent.
/// An aggregate query as each tablet computes it ([`ramlog_query::Query::partial`]: averages
/// as sums and counts), and how to finish the merged values.
struct Partial {
    query: ramlog_query::Query,
    bytes: Vec<u8>,
    /// For each aggregate asked for: its partial value's index, and for an average its count's.
    at: Vec<(usize, Option<usize>)>,
}

impl Partial {
    fn of(query: &ramlog_query::Query) -> Result<Partial, Error> {
        let (partial, at) = query.partial();
        let bytes = partial
            .to_bytes()
            .map_err(|e| Error::InvalidQuery(e.to_string()))?;
        Ok(Partial {
            query: partial,
            bytes,
            at,
        })
    }

    /// The values asked for, from the merged partial values.
    fn finish(&self, values: Vec<ramlog_query::Value>) -> Vec<ramlog_query::Value> {
        use ramlog_query::Value;
        self.at
            .iter()
            .map(|&(i, n)| {
                let v = values.get(i).cloned().unwrap_or(Value::Null);
                match n {
                    None => v,
                    Some(n) => match (v, values.get(n)) {
                        (_, Some(Value::I64(0))) | (Value::Null, _) => Value::Null,
                        (Value::I64(s), Some(Value::I64(n))) => Value::F64(s as f64 / *n as f64),
                        (Value::F64(s), Some(Value::I64(n))) => Value::F64(s / *n as f64),
                        _ => Value::Null,
                    },
                }
            })
            .collect()
    }
}

/// What [`ClusterClient::at_new_snapshot`] scans for.
#[derive(Clone, Copy)]
enum Wanted<'q> {
    Aggregates(&'q ramlog_query::Query),
    Records(&'q ramlog_query::Query, u32),
    Page(&'q ramlog_query::Query, u32, usize),
}

enum Scanned {
    Aggregates(crate::ScanAggregates),
    Records(Vec<crate::Record>),
    Page(u64, Vec<crate::Record>),
}

/// Where a cluster snapshot is cut: this far ahead of the request, first (every master must
/// have the request before the instant), and at most.
const CUT_LEAD_FIRST: Duration = Duration::from_millis(5);
const CUT_LEAD_MAX: Duration = Duration::from_millis(200);
/// How long each master holds its writes for a cluster snapshot, first and at most.
const CUT_HOLD_FIRST: Duration = Duration::from_millis(2);
const CUT_HOLD_MAX: Duration = Duration::from_millis(50);

/// A consistent cut of a table across its masters ([`ClusterClient::cluster_snapshot`]): one
/// snapshot per master, held by this client's connection to it, each the master's state at one
/// common instant (between `held_from_ns` and `held_to_ns`, wall clock). Dropping it releases
/// every part; a master also releases its part when the connection closes, and when it passes
/// the server's age or retained-bytes bound (then scans at it fail with `SnapshotTooOld`).
pub struct ClusterSnapshot {
    /// The map the snapshot was cut with: scans at it read the tablets it names.
    map: Arc<ClusterMap>,
    /// Each master's part, by native address.
    parts: HashMap<String, crate::Snapshot>,
    /// When every master held its writes: the latest start of a hold.
    pub held_from_ns: u64,
    /// The earliest end of a hold.
    pub held_to_ns: u64,
}

impl std::fmt::Debug for ClusterSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSnapshot")
            .field("map_version", &self.map.version)
            .field("parts", &self.versions())
            .field("held_from_ns", &self.held_from_ns)
            .field("held_to_ns", &self.held_to_ns)
            .finish()
    }
}

impl ClusterSnapshot {
    /// Each master's read version, by native address.
    pub fn versions(&self) -> BTreeMap<String, Version> {
        self.parts
            .iter()
            .map(|(a, s)| (a.clone(), s.version()))
            .collect()
    }

    /// The version of the cluster map the snapshot was cut with.
    pub fn map_version(&self) -> u64 {
        self.map.version
    }

    fn part(&self, addr: &str) -> Result<&crate::Snapshot, Error> {
        self.parts.get(addr).ok_or_else(|| {
            Error::Protocol(format!(
                "the cluster snapshot has no part on {addr}, which its map names as a master"
            ))
        })
    }

    /// Releases every part now.
    pub async fn release(self) -> Result<(), Error> {
        for part in self.parts.values() {
            part.release().await?;
        }
        Ok(())
    }
}

/// A scan at a cluster snapshot cannot go on: the snapshot lacks a tablet's writes where the
/// tablet is now (a fail-over, move, split or merge), or its part was released.
fn snapshot_lost(e: &Error) -> bool {
    matches!(
        e,
        Error::SnapshotTooOld { .. } | Error::NoSuchSnapshot(_) | Error::ConnectionLost(_)
    )
}

fn retryable(e: &Error, idempotent: bool) -> bool {
    match e {
        Error::Server { status, .. } => {
            matches!(status, Status::WrongServer | Status::NoSuchTable)
        }
        Error::Connect { .. } | Error::Handshake { .. } => true,
        Error::ConnectionLost(_) => idempotent,
        _ => false,
    }
}

fn no_such_table(table: TableId, key: &[u8], map: &ClusterMap) -> Error {
    Error::Server {
        status: Status::NoSuchTable,
        message: format!(
            "no tablet of table {table} holds slot {} in the cluster map (version {})",
            key_slot(key),
            map.version
        ),
    }
}

/// The tablet of `key`, the server to ask for it (its master) and that server's native address.
fn tablet_and_master<'m>(
    map: &'m ClusterMap,
    table: TableId,
    key: &[u8],
) -> Result<(&'m TabletInfo, ServerId, String), Error> {
    let tablet = map
        .tablet_of(table, key)
        .ok_or_else(|| no_such_table(table, key, map))?;
    // A tablet being restored has no server to ask until the map names its new master (its
    // dead master would not answer): nothing is sent, and the request is retried.
    if tablet.recovering && tablet.waiting.is_none() {
        return Err(Error::Server {
            status: Status::WrongServer,
            message: format!(
                "slot {} of table {table} is being recovered after its master failed (map version {}); retry",
                key_slot(key),
                map.version
            ),
        });
    }
    // A tablet that waits for memory to be restored goes to its first live backup, which
    // answers why (CLUSTER_DOWN) from its own map, or WRONG_SERVER once that map moved on; its
    // dead master would not answer at all.
    let is_up = |id: &ServerId| map.server(*id).is_some_and(|s| s.state == ServerState::Up);
    let target = match &tablet.waiting {
        Some(_) if tablet.recovering => tablet.backups.iter().copied().find(is_up),
        _ => None,
    }
    .unwrap_or(tablet.master);
    let server = map.server(target).ok_or_else(|| Error::Server {
        status: Status::WrongServer,
        message: format!(
            "the cluster map (version {}) names server {} as the master of slot {} of table {table} but does not list it",
            map.version,
            target,
            key_slot(key)
        ),
    })?;
    Ok((tablet, target, server.addresses.native.to_string()))
}

/// The master of `(table, key_slot(key))` and its native address.
pub(crate) fn route(
    map: &ClusterMap,
    table: TableId,
    key: &[u8],
) -> Result<(ServerId, String), Error> {
    tablet_and_master(map, table, key).map(|(_, server, addr)| (server, addr))
}

/// `indices` of `keys` grouped by master: (server, its native address, indices in the order given),
/// servers ascending.
pub(crate) fn split_by_server(
    map: &ClusterMap,
    table: TableId,
    keys: &[&[u8]],
    indices: &[usize],
) -> Result<Vec<(ServerId, String, Vec<usize>)>, Error> {
    let mut groups: BTreeMap<ServerId, (String, Vec<usize>)> = BTreeMap::new();
    for &i in indices {
        let (server, addr) = route(map, table, keys[i])?;
        groups
            .entry(server)
            .or_insert_with(|| (addr, Vec::new()))
            .1
            .push(i);
    }
    Ok(groups
        .into_iter()
        .map(|(server, (addr, indices))| (server, addr, indices))
        .collect())
}

/// Put the replies of one group at their keys' positions.
pub(crate) fn place(
    results: &mut [Option<Option<Object>>],
    indices: &[usize],
    objects: Vec<Option<Object>>,
) -> Result<(), Error> {
    if objects.len() != indices.len() {
        return Err(Error::Protocol(format!(
            "MULTI_GET of {} keys answered {} objects",
            indices.len(),
            objects.len()
        )));
    }
    for (&i, object) in indices.iter().zip(objects) {
        results[i] = Some(object);
    }
    Ok(())
}

/// Ok if every key lives on one tablet of `table` in `map`; the server's CROSS_TABLET refusal
/// otherwise.
pub(crate) fn single_tablet<'k>(
    map: &ClusterMap,
    table: TableId,
    mut keys: impl Iterator<Item = &'k [u8]>,
) -> Result<(), Error> {
    let Some(first) = keys.next() else {
        return Ok(());
    };
    let (tablet, _, _) = tablet_and_master(map, table, first)?;
    for key in keys {
        let (other, _, _) = tablet_and_master(map, table, key)?;
        if (other.table, other.first_slot) != (tablet.table, tablet.first_slot) {
            return Err(Error::CrossTablet(
                "MULTI_PUT keys live on more than one tablet; give them a common {hash tag}".into(),
            ));
        }
    }
    Ok(())
}

/// The masters of `table`'s tablets, by server id, with their native addresses.
pub(crate) fn masters_of(
    map: &ClusterMap,
    table: TableId,
) -> Result<Vec<(ServerId, String)>, Error> {
    let mut masters = BTreeMap::new();
    for tablet in map.tablets_of(table) {
        let server = map.server(tablet.master).ok_or_else(|| Error::Server {
            status: Status::WrongServer,
            message: format!(
                "the cluster map (version {}) names server {} as a master but does not list it",
                map.version, tablet.master
            ),
        })?;
        let addr = server.addresses.native.to_string();
        masters.insert(tablet.master, addr);
    }
    if masters.is_empty() {
        return Err(no_tablet_of(table, map));
    }
    Ok(masters.into_iter().collect())
}

/// The error for a table the map has no tablet of.
fn no_tablet_of(table: TableId, map: &ClusterMap) -> Error {
    Error::Server {
        status: Status::NoSuchTable,
        message: format!(
            "no tablet of table {table} in the cluster map (version {})",
            map.version
        ),
    }
}

/// Run futures concurrently on the current task; their outputs in the order given.
pub async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(value) => *output = Some(value),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outputs
        .into_iter()
        .map(|o| o.expect("every future finished"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ramlog_cluster::{ServerAddresses, ServerInfo};

    fn server(id: ServerId) -> ServerInfo {
        let addr = |port: u16| format!("127.0.0.1:{port}").parse().unwrap();
        ServerInfo {
            id,
            name: format!("s{id}"),
            addresses: ServerAddresses {
                resp: addr(6000 + id as u16),
                routing: None,
                native: addr(7000 + id as u16),
                admin: None,
            },
            epoch: 1,
            state: ServerState::Up,
            memory_bytes: 1 << 30,
            draining: false,
        }
    }

    fn tablet(table: TableId, first: u16, last: u16, master: ServerId) -> TabletInfo {
        TabletInfo {
            table,
            first_slot: first,
            last_slot: last,
            master,
            mirror: None,
            backups: vec![],
            epoch: 1,
            recovering: false,
            restorer: None,
            pending: vec![],
            fresh: vec![],
            waiting: None,
            refused: vec![],
            logs_from: None,
            split: None,
            split_ready: false,
            merge: None,
            merge_ready: false,
            migration: None,
            cut_off: Vec::new(),
        }
    }

    /// Table 0 in three tablets on servers 1, 2, 3; table 5 in one tablet on server 2.
    fn map(version: u64) -> ClusterMap {
        ClusterMap {
            cluster_id: 9,
            version,
            servers: vec![server(1), server(2), server(3)],
            tables: vec![],
            tablets: vec![
                tablet(0, 0, 5460, 1),
                tablet(0, 5461, 10922, 2),
                tablet(0, 10923, 16383, 3),
                tablet(5, 0, 16383, 2),
            ],
            rebalancing: false,
        }
    }

    /// A key whose slot is in `first..=last`.
    fn key_in(first: u16, last: u16, n: usize) -> Vec<u8> {
        (0..)
            .map(|i| format!("k{n}:{i}").into_bytes())
            .find(|k| (first..=last).contains(&key_slot(k)))
            .unwrap()
    }

    fn status_of(e: &Error) -> Option<Status> {
        match e {
            Error::Server { status, .. } => Some(*status),
            _ => None,
        }
    }

    #[test]
    fn keys_route_to_the_master_of_their_slot() {
        let m = map(3);
        // "foo" is slot 12182 and "bar" slot 5061 in Redis Cluster.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(route(&m, 0, b"foo").unwrap(), (3, "127.0.0.1:7003".into()));
        assert_eq!(route(&m, 0, b"bar").unwrap(), (1, "127.0.0.1:7001".into()));
        // Hash tags route by the tag.
        assert_eq!(route(&m, 0, b"{foo}:x").unwrap().0, 3);
        // Tablet edges.
        for (first, last, master) in [(0, 5460, 1), (5461, 10922, 2), (10923, 16383, 3)] {
            for k in [key_in(first, first + 20, 0), key_in(last - 20, last, 1)] {
                assert_eq!(route(&m, 0, &k).unwrap().0, master);
            }
        }
        // Another table's own tablets.
        assert_eq!(route(&m, 5, b"bar").unwrap(), (2, "127.0.0.1:7002".into()));
        // A table the map does not have.
        let e = route(&m, 6, b"bar").unwrap_err();
        assert_eq!(status_of(&e), Some(Status::NoSuchTable), "{e}");
        assert!(retryable(&e, false));
        // A master the map does not list: stale, retry after a refresh.
        let mut broken = map(4);
        broken.servers.retain(|s| s.id != 3);
        let e = route(&broken, 0, b"foo").unwrap_err();
        assert_eq!(status_of(&e), Some(Status::WrongServer), "{e}");
    }

    #[test]
    fn a_tablet_being_recovered_routes_nowhere_until_it_has_a_master() {
        let mut m = map(7);
        m.tablets[2].recovering = true;
        m.tablets[2].restorer = Some(1);
        let e = route(&m, 0, b"foo").unwrap_err();
        assert_eq!(status_of(&e), Some(Status::WrongServer), "{e}");
        assert!(e.to_string().contains("being recovered"), "{e}");
        assert!(
            retryable(&e, false),
            "nothing was sent: a write retries too"
        );
        // Other tablets route as before; one that waits for memory goes to a live backup.
        assert_eq!(route(&m, 0, b"bar").unwrap().0, 1);
        m.tablets[2].waiting = Some("no room".into());
        m.tablets[2].backups = vec![2];
        assert_eq!(route(&m, 0, b"foo").unwrap().0, 2);
    }

    #[test]
    fn multi_get_splits_by_server_and_reassembles_in_order() {
        let m = map(1);
        let keys: Vec<Vec<u8>> = (0..30)
            .map(|n| match n % 3 {
                0 => key_in(10923, 16383, n),
                1 => key_in(0, 5460, n),
                _ => key_in(5461, 10922, n),
            })
            .collect();
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let all: Vec<usize> = (0..refs.len()).collect();
        let groups = split_by_server(&m, 0, &refs, &all).unwrap();
        let servers: Vec<ServerId> = groups.iter().map(|g| g.0).collect();
        assert_eq!(servers, vec![1, 2, 3]);
        assert_eq!(groups[0].1, "127.0.0.1:7001");
        assert_eq!(
            groups[0].2,
            (0..30).filter(|i| i % 3 == 1).collect::<Vec<_>>()
        );
        assert_eq!(
            groups[1].2,
            (0..30).filter(|i| i % 3 == 2).collect::<Vec<_>>()
        );
        assert_eq!(
            groups[2].2,
            (0..30).filter(|i| i % 3 == 0).collect::<Vec<_>>()
        );
        // Each group's reply (the value is the key itself) lands at its keys' positions, whatever
        // order the groups finish in.
        let mut results: Vec<Option<Option<Object>>> = vec![None; refs.len()];
        for (_, _, indices) in groups.iter().rev() {
            let objects = indices
                .iter()
                .map(|&i| {
                    (i != 4).then(|| Object {
                        value: Bytes::copy_from_slice(refs[i]),
                        version: i as u64 + 1,
                        expire_at_ms: 0,
                    })
                })
                .collect();
            place(&mut results, indices, objects).unwrap();
        }
        for (i, r) in results.iter().enumerate() {
            let r = r.as_ref().expect("answered");
            if i == 4 {
                assert!(r.is_none());
            } else {
                let o = r.as_ref().unwrap();
                assert_eq!((&o.value[..], o.version), (refs[i], i as u64 + 1));
            }
        }
        // A short reply is a protocol error, not a misplaced value.
        assert!(matches!(
            place(&mut results, &[0, 1], vec![None]),
            Err(Error::Protocol(_))
        ));
        // A retry splits only the keys still pending.
        let groups = split_by_server(&m, 0, &refs, &[3, 5, 6]).unwrap();
        assert_eq!(
            groups
                .iter()
                .map(|g| (g.0, g.2.clone()))
                .collect::<Vec<_>>(),
            vec![(2, vec![5]), (3, vec![3, 6])]
        );
        // One key of an unknown table fails the split.
        assert!(split_by_server(&m, 7, &refs, &all).is_err());
    }

    #[test]
    fn multi_put_must_stay_on_one_tablet() {
        let m = map(1);
        let tagged: Vec<&[u8]> = vec![b"{user:1}:name", b"{user:1}:age", b"{user:1}"];
        single_tablet(&m, 0, tagged.iter().copied()).unwrap();
        // Different slots of one tablet are fine.
        let a = key_in(0, 100, 0);
        let b = key_in(5000, 5460, 1);
        single_tablet(&m, 0, [a.as_slice(), b.as_slice()].into_iter()).unwrap();
        // Two tablets (here also two servers) are refused before sending.
        let c = key_in(5461, 6000, 2);
        let e = single_tablet(&m, 0, [a.as_slice(), c.as_slice()].into_iter()).unwrap_err();
        assert!(matches!(e, Error::CrossTablet(_)), "{e}");
        assert!(!retryable(&e, false));
        // Two tablets on the same server are refused too.
        let mut same_server = map(2);
        same_server.tablets[1].master = 1;
        let e =
            single_tablet(&same_server, 0, [a.as_slice(), c.as_slice()].into_iter()).unwrap_err();
        assert!(matches!(e, Error::CrossTablet(_)), "{e}");
        // One table's single tablet holds every key.
        single_tablet(&m, 5, [a.as_slice(), c.as_slice()].into_iter()).unwrap();
    }

    #[test]
    fn refresh_keeps_the_higher_version() {
        let cache = MapCache::new(map(5));
        assert!(!cache.offer(map(4)), "an older map is ignored");
        assert!(!cache.offer(map(5)), "the same version is ignored");
        assert_eq!(cache.get().version, 5);
        let mut newer = map(6);
        newer.tablets[0].master = 2;
        assert!(cache.offer(newer));
        assert_eq!(cache.get().version, 6);
        assert_eq!(route(&cache.get(), 0, b"bar").unwrap().0, 2);
        assert!(!cache.offer(map(3)));
        assert_eq!(route(&cache.get(), 0, b"bar").unwrap().0, 2);
    }

    #[test]
    fn listings_walk_every_master_once() {
        let m = map(1);
        let masters = masters_of(&m, 0).unwrap();
        assert_eq!(
            masters,
            vec![
                (1, "127.0.0.1:7001".to_string()),
                (2, "127.0.0.1:7002".to_string()),
                (3, "127.0.0.1:7003".to_string()),
            ]
        );
        assert_eq!(
            masters_of(&m, 5).unwrap(),
            vec![(2, "127.0.0.1:7002".into())]
        );
        let e = masters_of(&m, 8).unwrap_err();
        assert_eq!(status_of(&e), Some(Status::NoSuchTable));
        // Candidates for a refresh: the seed first, then every server once.
        let mut m = map(1);
        m.servers[0].state = ServerState::Dead;
        assert_eq!(
            refresh_candidates("127.0.0.1:7002", &m),
            vec!["127.0.0.1:7002", "127.0.0.1:7003", "127.0.0.1:7001"]
        );
    }

    #[test]
    fn only_refusals_and_unsent_requests_retry_writes() {
        let refused = |status| Error::Server {
            status,
            message: String::new(),
        };
        assert!(retryable(&refused(Status::WrongServer), false));
        assert!(retryable(&refused(Status::NoSuchTable), false));
        assert!(!retryable(&refused(Status::Internal), true));
        let not_sent = Error::Connect {
            addr: "x".into(),
            source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        };
        assert!(retryable(&not_sent, false));
        let lost = Error::ConnectionLost("reset".into());
        assert!(retryable(&lost, true));
        assert!(!retryable(&lost, false), "a write may have been applied");
        assert!(!retryable(&Error::Timeout(Duration::from_secs(1)), true));
        assert!(!retryable(
            &Error::ConditionFailed {
                current_version: None
            },
            false
        ));
    }

    #[tokio::test]
    async fn join_all_keeps_the_order_given() {
        let futures = (0..5u64)
            .map(|i| async move {
                tokio::time::sleep(Duration::from_millis(50 - i * 10)).await;
                i
            })
            .collect();
        assert_eq!(join_all(futures).await, vec![0, 1, 2, 3, 4]);
    }
}
