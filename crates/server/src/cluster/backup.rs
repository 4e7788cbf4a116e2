//! The backup's side of replication: masters' streams land in this server's backup log store
//! (`ramlog-backup`, in `<data_dir>/backup`), and the backup acknowledges each frame by stage.
//!
//! A native connection whose first request is `REPL_HELLO` is handed here
//! ([`BackupService::serve`]); two threads then own it. The reader decodes each `REPL_BATCH`
//! (checksum, every length and limit), checks each unit, appends it whole with one
//! [`Backup::append`] and, after the frame, acknowledges what is now in the write buffer. The
//! syncer acknowledges what is on disk: a frame flagged durable makes it wait for the store's
//! fdatasync at once (one sync for everything appended before it: group commit); otherwise it
//! reports what the store's own periodic sync (every `flush_interval`) made durable.
//!
//! A unit refused for its **content** (an entry over the limits that `ramlog_common::limits`
//! defines for every layer, a malformed entry inside a well-framed unit) is refused alone: the
//! backup answers `REPL_REFUSED` with the unit's stream range before any acknowledgement that
//! covers it, skips it, and takes the rest of the stream (the master fails that write and
//! re-sends the key's current state; see [`crate::cluster::replication`]). A refused unit that is resent
//! after a reconnection is refused again from memory. Refusals are counted (`refused_content`)
//! and logged once per master and reason.
//!
//! Checks, each refusing the frame before anything of it is appended, with an error reply and the
//! connection closed (the master reconnects and resends; nothing acknowledged is touched):
//! - the cluster id of the hello must be this server's;
//! - **fencing**: a unit's tablet epoch must not be older than the newest this backup has seen
//!   for that tablet (`Fenced`), so a master that was replaced cannot write into the logs the new
//!   owner's recovery will read. The newest epochs are what the store's tablet ids record, so
//!   they survive a restart;
//! - the unit's tablet must be one of the map's (an unknown one is `NoSuchTable`, after a wait of
//!   at most [`MAP_WAIT`] for a newer map: a master that split a tablet serves the map with its
//!   halves before its backups do);
//! - a batch whose checksum or unit bounds are broken (it cannot be tied to one unit), and a
//!   store that works: a full disk refuses with `WritesRefused`.
//!
//! A unit's tablet in the store is `(table, first slot, epoch)` packed in the store's u64 tablet
//! id ([`store_tablet`]); replay groups by it. Resent units (after a reconnection) that this
//! process already appended are skipped by their stream offset.

use crate::cluster::membership::Member;
use crate::node::Node;
use parking_lot::{Condvar, Mutex};
use ramlog_backup::{Backup, Entry, Stage, Ticket};
use ramlog_proto::native::{parse_header, FrameError, Status, HEADER_LEN};
use ramlog_proto::repl::{self, Ack, Hello, Limits, Refused, UnitError};
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The longest a backup waits for a newer map that names the tablet of a unit it does not know
/// (its master serves that map already), before it refuses the unit.
const MAP_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Bits of the store's tablet id: table (24) | first slot (16) | epoch (24).
const EPOCH_BITS: u32 = 24;
const SLOT_BITS: u32 = 16;
const TABLE_BITS: u32 = 24;

/// The store's tablet id of (table, first slot, epoch), or None if a part is out of range.
pub fn store_tablet(table: u32, first_slot: u16, epoch: u64) -> Option<u64> {
    if u64::from(table) >= 1 << TABLE_BITS || epoch >= 1 << EPOCH_BITS {
        return None;
    }
    Some(
        (u64::from(table) << (SLOT_BITS + EPOCH_BITS))
            | (u64::from(first_slot) << EPOCH_BITS)
            | epoch,
    )
}

/// (table, first slot, epoch) of a store tablet id.
pub fn split_store_tablet(id: u64) -> (u32, u16, u64) {
    (
        (id >> (SLOT_BITS + EPOCH_BITS)) as u32,
        (id >> EPOCH_BITS) as u16,
        id & ((1 << EPOCH_BITS) - 1),
    )
}

/// Counters of the backup side.
#[derive(Debug, Default)]
pub struct BackupCounters {
    pub connections: AtomicU64,
    pub frames: AtomicU64,
    pub units: AtomicU64,
    pub entries: AtomicU64,
    pub bytes: AtomicU64,
    pub units_skipped: AtomicU64,
    pub refused_fenced: AtomicU64,
    pub refused_bad: AtomicU64,
    pub refused_store: AtomicU64,
    /// Units refused for their content (the stream went on without them).
    pub refused_content: AtomicU64,
    pub syncs_requested: AtomicU64,
}

/// What a backup remembers of one master's stream (master, its epoch, stream nonce) in this
/// process.
#[derive(Clone, Copy, Default)]
struct StreamMark {
    /// Stream offset up to which units are appended.
    appended: u64,
    /// The store ticket of the last of them.
    ticket: u64,
}

pub struct BackupService {
    store: Backup,
    dir: PathBuf,
    limits: Limits,
    /// Newest epoch seen per (table, first slot).
    epochs: Mutex<HashMap<(u32, u16), u64>>,
    marks: Mutex<HashMap<(u64, u64, u64), StreamMark>>,
    /// Units refused for their content, per stream (the newest [`REFUSALS_KEPT`]), so that a
    /// resent one is refused again without being decoded.
    refusals: Mutex<HashMap<(u64, u64, u64), VecDeque<Refused>>>,
    /// (master, reason) pairs already logged.
    refusals_logged: Mutex<std::collections::HashSet<(u64, String)>>,
    /// Test-only fault switch (`RAMLOG_TEST_REFUSE_VALUE`): a unit with an entry whose value is
    /// exactly these bytes is refused for its content, as if the decoder disagreed with the
    /// master about it: once per key (a transient fault, which the master's re-send of the key
    /// gets past), or every time with the prefix `always:` (a backup that cannot hold it).
    refuse_value: Option<(Vec<u8>, bool)>,
    /// Keys the fault switch refused once already.
    refused_once: Mutex<std::collections::HashSet<Vec<u8>>>,
    /// The open replication connections, to be closed at shutdown.
    sockets: Mutex<Vec<(u64, TcpStream)>>,
    /// Bytes the connections' read buffers hold (counted against the memory budget).
    buffer_bytes: AtomicU64,
    next_socket: AtomicU64,
    /// The highest version of any entry any master sent here (a restorer's clock goes above it).
    max_version: AtomicU64,
    /// Store tablets being dropped (by the map's garbage collection), so that a drop is not
    /// started twice.
    dropping: Mutex<std::collections::HashSet<u64>>,
    /// Set once the first map of this process was applied (see [`BackupService::apply_map`]).
    first_map: AtomicBool,
    pub counters: BackupCounters,
}

impl BackupService {
    /// Opens (or creates) the store in `<data_dir>/backup`.
    pub fn open(config: &crate::node::config::ServerConfig) -> std::io::Result<Arc<BackupService>> {
        let dir = config.data_dir.join("backup");
        let store_config = ramlog_backup::Config {
            flush_interval: Duration::from_millis(config.flush_interval_ms),
            value_max_bytes: config.stored_value_max_bytes() as usize,
            sync_hold_file: std::env::var_os("RAMLOG_TEST_HOLD_SYNC").map(PathBuf::from),
            ..ramlog_backup::Config::for_memory_budget(config.memory_bytes)
        };
        let open = || -> Result<Backup, String> {
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            Backup::open(&dir, store_config.clone()).map_err(|e| e.to_string())
        };
        let store = open().map_err(|e| {
            std::io::Error::other(format!("backup store in {}: {e}", dir.display()))
        })?;
        let mut epochs = HashMap::new();
        for id in store.tablets() {
            let (table, first, epoch) = split_store_tablet(id);
            let e = epochs.entry((table, first)).or_insert(0);
            *e = (*e).max(epoch);
        }
        Ok(Arc::new(BackupService {
            limits: Limits::for_backup(store.config().value_max_bytes),
            store,
            dir,
            epochs: Mutex::new(epochs),
            marks: Mutex::new(HashMap::new()),
            refusals: Mutex::new(HashMap::new()),
            refusals_logged: Mutex::new(std::collections::HashSet::new()),
            refuse_value: std::env::var_os("RAMLOG_TEST_REFUSE_VALUE").map(|v| {
                let v = v.into_encoded_bytes();
                match v.strip_prefix(b"always:") {
                    Some(rest) => (rest.to_vec(), true),
                    None => (v, false),
                }
            }),
            refused_once: Mutex::new(std::collections::HashSet::new()),
            sockets: Mutex::new(Vec::new()),
            buffer_bytes: AtomicU64::new(0),
            next_socket: AtomicU64::new(0),
            max_version: AtomicU64::new(0),
            dropping: Mutex::new(std::collections::HashSet::new()),
            first_map: AtomicBool::new(false),
            counters: BackupCounters::default(),
        }))
    }

    pub fn store(&self) -> &Backup {
        &self.store
    }

    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// The highest version any master sent here since this process started.
    pub fn max_version_seen(&self) -> u64 {
        self.max_version.load(Ordering::Acquire)
    }

    /// Replays, as one, every log this store holds of tablet `t` from epochs before `epoch`
    /// (the restore of a tablet whose master died at `epoch - 1` or earlier): its own logs and,
    /// for a recovery partition, those of the tablet it was split off (`TabletInfo::logs_from`).
    /// Only entries of the tablet's slots are passed on.
    pub fn replay_for_restore(
        &self,
        t: &ramlog_cluster::TabletInfo,
        epoch: u64,
        mut f: impl FnMut(ramlog_backup::ReplayEntry<'_>),
    ) -> Result<ramlog_backup::ReplayReport, ramlog_backup::Error> {
        self.replay_for_restore_counted(t, epoch, |r| {
            if let ramlog_backup::Replayed::Entry(e) = r {
                f(e)
            }
        })
    }

    /// [`BackupService::replay_for_restore`], told first how many keys the logs hold at most
    /// (`Replayed::Count`, keys of other slots included), so that a restore can size the
    /// tablet's index before it fills it.
    pub fn replay_for_restore_counted(
        &self,
        t: &ramlog_cluster::TabletInfo,
        epoch: u64,
        f: impl FnMut(ramlog_backup::Replayed<'_>),
    ) -> Result<ramlog_backup::ReplayReport, ramlog_backup::Error> {
        self.replay_epochs(t, 0..epoch, f)
    }

    /// The merged replay of `t`'s logs of the epochs in `epochs`.
    pub fn replay_epochs(
        &self,
        t: &ramlog_cluster::TabletInfo,
        epochs: std::ops::Range<u64>,
        f: impl FnMut(ramlog_backup::Replayed<'_>),
    ) -> Result<ramlog_backup::ReplayReport, ramlog_backup::Error> {
        let ids = self.log_ids(t, epochs);
        // A tablet's own logs hold only its slots unless it was split off a larger one since
        // they were written (a partition, or the tablet a partition was split off).
        let slots = t.slots();
        let keep = |key: &[u8]| slots.contains(&ramlog_common::key_slot(key));
        self.store.replay_merged_filtered(&ids, Some(&keep), f)
    }

    /// A restore's replay of `t`'s logs of the epochs before `epoch` that leaves the merge to
    /// `sink` ([`ramlog_backup::Backup::replay_streamed`]; damaged logs are not trusted).
    pub fn replay_streamed_for_restore(
        &self,
        t: &ramlog_cluster::TabletInfo,
        epoch: u64,
        sink: &dyn ramlog_backup::ReplaySink,
    ) -> Result<ramlog_backup::Streamed, ramlog_backup::Error> {
        let ids = self.log_ids(t, 0..epoch);
        let slots = t.slots();
        let keep = |key: &[u8]| slots.contains(&ramlog_common::key_slot(key));
        self.store.replay_streamed(&ids, Some(&keep), sink)
    }

    /// The store's tablets that hold `t`'s logs of the epochs in `epochs`, ascending.
    pub fn log_ids(
        &self,
        t: &ramlog_cluster::TabletInfo,
        epochs: std::ops::Range<u64>,
    ) -> Vec<u64> {
        let sources: Vec<u16> = t.log_sources().collect();
        let mut ids: Vec<u64> = self
            .store
            .tablets()
            .into_iter()
            .filter(|&id| {
                let (table, s, e) = split_store_tablet(id);
                u64::from(table) == t.table && sources.contains(&s) && epochs.contains(&e)
            })
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The merged replay of the logs `ids` (see [`BackupService::log_ids`]) for several
    /// partitions at once (slot ranges, inclusive): read and merged once, each partition's keys
    /// then taken on their own ([`ramlog_backup::GroupedReplay::take`]), group `i` being
    /// `parts[i]`.
    pub fn replay_partitions(
        &self,
        ids: &[u64],
        parts: &[(u16, u16)],
    ) -> Result<ramlog_backup::GroupedReplay, ramlog_backup::Error> {
        let group_of = |key: &[u8]| {
            let slot = ramlog_common::key_slot(key);
            parts
                .iter()
                .position(|&(first, last)| (first..=last).contains(&slot))
        };
        self.store.replay_grouped(ids, &group_of, parts.len())
    }

    /// Takes a new map: raises the fence of every tablet to its epoch in the map (a master of
    /// an older epoch is refused from now on, before the tablet's restorer reads its logs), and
    /// drops, in the background, the logs the map no longer needs:
    /// - of tablets this server is no longer a backup of (a restarted server's stale logs, a
    ///   tablet it now masters, a dropped table), unless the tablet is recovering and lists it;
    /// - older epochs of tablets whose copy at the current epoch this server holds completely.
    pub fn apply_map(self: &Arc<Self>, map: &ramlog_cluster::ClusterMap, me: u64) {
        {
            let mut epochs = self.epochs.lock();
            for t in &map.tablets {
                let Ok(table) = u32::try_from(t.table) else {
                    continue;
                };
                let e = epochs.entry((table, t.first_slot)).or_insert(0);
                *e = (*e).max(t.epoch);
            }
        }
        // Only a map whose servers include this one says anything about its logs.
        if map.server(me).is_none() {
            return;
        }
        if !self.first_map.swap(true, Ordering::AcqRel) {
            // This process joined as a replacement (fresh) backup of these tablets: whatever an
            // earlier process left of them is stale (it was replaced while it was gone). They go
            // now, before any master can reach this server (it takes replication only once its
            // first map is applied), so that the copy starts from nothing.
            for id in self.store.tablets() {
                let (table, first_slot, epoch) = split_store_tablet(id);
                let fresh = map.tablets.iter().any(|t| {
                    t.table == u64::from(table)
                        && t.first_slot == first_slot
                        && t.fresh.contains(&me)
                });
                if fresh {
                    match self.store.drop_tablet(id) {
                        Ok(()) => tracing::info!(
                            table,
                            first_slot,
                            epoch,
                            "dropped stale backup logs of a tablet this server now backs up afresh"
                        ),
                        Err(e) => {
                            tracing::error!(table, first_slot, epoch, error = %e, "cannot drop stale backup logs")
                        }
                    }
                }
            }
        }
        let mut drop = Vec::new();
        for id in self.store.tablets() {
            let (table, first_slot, epoch) = split_store_tablet(id);
            // The tablet starting at this slot, and the recovery partitions split off it
            // whose backups do not all hold their own copy yet, read these logs.
            let needed = map
                .tablets
                .iter()
                .filter(|t| {
                    t.table == u64::from(table)
                        && (t.first_slot == first_slot || t.logs_from == Some(first_slot))
                })
                .any(|t| {
                    if t.recovering {
                        t.backups.contains(&me)
                    } else {
                        let own = t.first_slot == first_slot && epoch >= t.epoch;
                        t.backups.contains(&me) && (own || t.pending.contains(&me))
                    }
                });
            if !needed {
                drop.push(id);
            }
        }
        drop.retain(|id| self.dropping.lock().insert(*id));
        if drop.is_empty() {
            return;
        }
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("backup-gc".into())
            .spawn(move || {
                for id in drop {
                    let (table, first_slot, epoch) = split_store_tablet(id);
                    match me.store.drop_tablet(id) {
                        Ok(()) => tracing::info!(
                            table,
                            first_slot,
                            epoch,
                            "dropped backup logs the map no longer needs"
                        ),
                        Err(e) => tracing::warn!(table, first_slot, epoch, error = %e, "cannot drop backup logs"),
                    }
                    me.dropping.lock().remove(&id);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the backup log collector");
        }
    }

    /// The newest epoch seen for each tablet (table, first slot).
    pub fn epochs(&self) -> Vec<((u32, u16), u64)> {
        let mut v: Vec<_> = self.epochs.lock().iter().map(|(k, v)| (*k, *v)).collect();
        v.sort();
        v
    }

    pub fn figures(&self) -> crate::node::figures::BackupSideFigures {
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let store = self.store.stats();
        crate::node::figures::BackupSideFigures {
            connections: load(&c.connections),
            frames: load(&c.frames),
            units: load(&c.units),
            entries: load(&c.entries),
            bytes: load(&c.bytes),
            units_skipped: load(&c.units_skipped),
            refused_fenced: load(&c.refused_fenced),
            refused_bad: load(&c.refused_bad),
            refused_store: load(&c.refused_store),
            refused_content: load(&c.refused_content),
            syncs_requested: load(&c.syncs_requested),
            tablets: self.store.tablets().len() as u64,
            store_flushes: store.flushes,
            store_files_synced: store.syncs,
            store_process_ms: store.process_ms,
            store_write_ms: store.write_ms,
            store_sync_ms: store.sync_ms,
        }
    }

    /// Bytes the replication connections' read buffers hold now.
    pub fn buffer_bytes(&self) -> u64 {
        self.buffer_bytes.load(Ordering::Relaxed)
    }

    /// Closes every replication connection (at shutdown): masters reconnect to whoever serves.
    pub fn close_connections(&self) {
        for (_, s) in self.sockets.lock().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Writes out and syncs what the store holds (at shutdown).
    pub fn flush(&self) {
        if let Err(e) = self.store.flush() {
            tracing::error!(error = %e, "the backup store could not be flushed at shutdown");
        }
    }

    /// Checks a replication hello against this server; an error is the refusal to send.
    pub fn check_hello(
        &self,
        member: Option<&Member>,
        hello: &Hello,
    ) -> Result<(), (Status, String)> {
        let Some(member) = member else {
            return Err((
                Status::Unsupported,
                "this server is not in a cluster; it takes no replication".into(),
            ));
        };
        let view = member.view();
        if view.map.cluster_id != 0 && hello.cluster_id != view.map.cluster_id {
            return Err((
                Status::Fenced,
                format!(
                    "the master is in cluster {:016x}, this backup in {:016x}",
                    hello.cluster_id, view.map.cluster_id
                ),
            ));
        }
        if hello.master == view.me {
            return Err((Status::BadRequest, "a server cannot back up itself".into()));
        }
        if let Some(reason) = self.store.failure() {
            self.counters.refused_store.fetch_add(1, Ordering::Relaxed);
            return Err((
                Status::WritesRefused,
                format!("the backup store cannot take writes: {reason}"),
            ));
        }
        Ok(())
    }

    /// Serves one replication connection on this thread and one more (see the module comment),
    /// until the master leaves or a frame is refused. `input` holds bytes already read after the
    /// hello.
    pub fn serve(
        self: &Arc<Self>,
        node: Arc<Node>,
        member: Arc<Member>,
        socket: TcpStream,
        input: Vec<u8>,
        hello: Hello,
    ) {
        self.counters.connections.fetch_add(1, Ordering::Relaxed);
        let writer = match socket.try_clone() {
            Ok(w) => Arc::new(Mutex::new(w)),
            Err(e) => {
                tracing::warn!(error = %e, "replication connection");
                return;
            }
        };
        let mark = self
            .marks
            .lock()
            .get(&(hello.master, hello.master_epoch, hello.stream))
            .copied()
            .unwrap_or_default();
        let acks = Arc::new(Acks {
            pending: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            buffered: AtomicU64::new(mark.appended),
            durable: AtomicU64::new(0),
            done: AtomicBool::new(false),
        });
        if mark.ticket > 0 {
            // Units a previous connection of this stream appended: their durability is reported
            // on this one.
            acks.pending
                .lock()
                .push_back((Ticket(mark.ticket), mark.appended, true));
        }
        let syncer = {
            let me = self.clone();
            let acks = acks.clone();
            let writer = writer.clone();
            std::thread::Builder::new()
                .name("repl-sync".into())
                .spawn(move || me.sync_loop(&acks, &writer))
        };
        let token = self.next_socket.fetch_add(1, Ordering::Relaxed);
        if let Ok(s) = socket.try_clone() {
            self.sockets.lock().push((token, s));
        }
        let result = self.read_loop((&node, &member), socket, input, &hello, &acks, &writer);
        self.sockets.lock().retain(|(t, _)| *t != token);
        if let Err((status, message)) = result {
            tracing::warn!(master = hello.master, ?status, %message, "replication frame refused; closing");
            let mut out = bytes::BytesMut::new();
            ramlog_proto::native::encode_error(&mut out, 0, repl::REPL_BATCH, status, 0, &message);
            let mut w = writer.lock();
            let _ = w.write_all(&out);
            let _ = w.shutdown(Shutdown::Both);
        }
        acks.done.store(true, Ordering::Release);
        acks.wake.notify_all();
        if let Ok(h) = syncer {
            let _ = h.join();
        }
    }

    fn read_loop(
        &self,
        (node, member): (&Node, &Member),
        mut socket: TcpStream,
        mut input: Vec<u8>,
        hello: &Hello,
        acks: &Acks,
        writer: &Mutex<TcpStream>,
    ) -> Result<(), (Status, String)> {
        let mut chunk = vec![0u8; 256 * 1024];
        let max_frame = node.config.request_size_max_bytes as usize + (1 << 20);
        // What the buffers hold is counted while the connection lives (see `buffer_bytes`).
        let mut held = Held {
            counter: &self.buffer_bytes,
            bytes: 0,
        };
        let mut taken = false;
        loop {
            held.set((chunk.len() + input.capacity()) as u64);
            let mut at = 0;
            loop {
                let header = match parse_header(&input[at..], max_frame) {
                    Ok(Some(h)) => h,
                    Ok(None) => break,
                    Err(FrameError::TooShort { .. }) => {
                        self.counters.refused_bad.fetch_add(1, Ordering::Relaxed);
                        return Err((Status::BadRequest, "frame shorter than its header".into()));
                    }
                    Err(e @ FrameError::TooLarge { .. }) => {
                        self.counters.refused_bad.fetch_add(1, Ordering::Relaxed);
                        return Err((Status::FrameTooLarge, e.to_string()));
                    }
                };
                if input.len() - at < header.frame_bytes() {
                    break;
                }
                if header.opcode != repl::REPL_BATCH {
                    self.counters.refused_bad.fetch_add(1, Ordering::Relaxed);
                    return Err((
                        Status::BadRequest,
                        format!(
                            "a replication connection carries REPL_BATCH frames only, not opcode {:#04x}",
                            header.opcode
                        ),
                    ));
                }
                let body = &input[at + HEADER_LEN..at + header.frame_bytes()];
                at += header.frame_bytes();
                self.take_batch(node, Some(member), body, hello, acks, &mut |frames| {
                    writer.lock().write_all(frames)
                })?;
                taken = true;
            }
            // One acknowledgement for every frame this read brought.
            if std::mem::take(&mut taken) {
                let ack = Ack {
                    buffered: acks.buffered.load(Ordering::Acquire),
                    durable: acks.durable.load(Ordering::Acquire),
                };
                send_ack(writer, ack).map_err(|e| (Status::Internal, e.to_string()))?;
            }
            input.drain(..at);
            if input.capacity() > 4 * chunk.len() && input.len() < chunk.len() {
                input.shrink_to(chunk.len());
            }
            match socket.read(&mut chunk) {
                Ok(0) => return Ok(()),
                Ok(n) => input.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Ok(()),
            }
        }
    }

    /// Checks and appends one batch; see the module comment.
    fn take_batch(
        &self,
        node: &Node,
        member: Option<&Member>,
        body: &[u8],
        hello: &Hello,
        acks: &Acks,
        send: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<(), (Status, String)> {
        let refuse_bad = |e: ramlog_proto::native::DecodeError| {
            self.counters.refused_bad.fetch_add(1, Ordering::Relaxed);
            (e.status, e.message)
        };
        let batch = repl::decode_batch(body).map_err(refuse_bad)?;
        let key = (hello.master, hello.master_epoch, hello.stream);
        let mut mark = self.marks.lock().get(&key).copied().unwrap_or_default();
        if batch.start > mark.appended && mark.appended != 0 {
            self.counters.refused_bad.fetch_add(1, Ordering::Relaxed);
            return Err((
                Status::BadRequest,
                format!(
                    "the batch starts at stream offset {} but this backup holds the stream only up to {}",
                    batch.start, mark.appended
                ),
            ));
        }
        // Decode and check every unit before appending any. A unit refused for its content is
        // set aside (answered below); one whose bounds are broken refuses the whole frame.
        let mut units = Vec::new();
        let mut refused: Vec<Refused> = Vec::new();
        for unit in batch.units(self.limits) {
            match unit {
                Ok(u) if self.test_refuses(&u) => refused.push(Refused {
                    start: u.start,
                    end: u.end,
                    status: Status::BadRequest,
                    message: "refused by the test fault switch RAMLOG_TEST_REFUSE_VALUE".into(),
                }),
                Ok(u) => units.push(u),
                Err(UnitError::Refused { start, end, error }) => refused.push(Refused {
                    start,
                    end,
                    status: error.status,
                    message: error.message,
                }),
                Err(UnitError::Frame(e)) => return Err(refuse_bad(e)),
            }
        }
        let known = |map: &ramlog_cluster::ClusterMap, h: &repl::UnitHead| {
            map.tablets.iter().any(|t| {
                t.table == u64::from(h.table)
                    && t.first_slot == h.first_slot
                    && t.last_slot == h.last_slot
            })
        };
        let mut view = member.map(|m| Arc::clone(&m.view()));
        // A master that serves a newer map than this backup (one that split a tablet) sends
        // units of tablets this map does not have yet: the newer map is asked for and awaited,
        // for at most `MAP_WAIT`, before such a unit is refused.
        if let (Some(m), Some(v)) = (member, &view) {
            if units.iter().any(|u| !known(&v.map, &u.head)) {
                m.refresh_map_soon();
                let deadline = std::time::Instant::now() + MAP_WAIT;
                loop {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    let now = Arc::clone(&m.view());
                    let all_known = units.iter().all(|u| known(&now.map, &u.head));
                    view = Some(now);
                    if all_known || std::time::Instant::now() >= deadline {
                        break;
                    }
                }
            }
        }
        {
            let mut epochs = self.epochs.lock();
            for u in &units {
                let h = &u.head;
                if let Some(view) = &view {
                    if !known(&view.map, h) {
                        self.counters.refused_bad.fetch_add(1, Ordering::Relaxed);
                        return Err((
                            Status::NoSuchTable,
                            format!(
                                "unknown tablet: table {} slots {}..={} is not in this backup's map (version {}; the master's is {})",
                                h.table, h.first_slot, h.last_slot, view.map.version, hello.map_version
                            ),
                        ));
                    }
                }
                let newest = epochs.get(&(h.table, h.first_slot)).copied().unwrap_or(0);
                if h.epoch < newest {
                    self.counters.refused_fenced.fetch_add(1, Ordering::Relaxed);
                    return Err((
                        Status::Fenced,
                        format!(
                            "stale epoch: table {} slot {} is at epoch {newest} here; the frame carries epoch {}",
                            h.table, h.first_slot, h.epoch
                        ),
                    ));
                }
                if store_tablet(h.table, h.first_slot, h.epoch).is_none() {
                    self.counters.refused_bad.fetch_add(1, Ordering::Relaxed);
                    return Err((
                        Status::BadRequest,
                        format!("table {} or epoch {} out of range", h.table, h.epoch),
                    ));
                }
            }
            for u in &units {
                let e = epochs.entry((u.head.table, u.head.first_slot)).or_insert(0);
                *e = (*e).max(u.head.epoch);
            }
        }
        // Refusals go out before any acknowledgement that covers them (this thread sends the
        // frame's acknowledgement after this returns; the syncer only acknowledges what the
        // pending list below names).
        if !refused.is_empty() {
            self.refuse_units(key, hello.master, &refused, mark.appended, send)?;
        }
        let mut entries: Vec<Entry<'_>> = Vec::new();
        let mut last_ticket = None;
        // A mirror that starts meanwhile reads the logs only after these units are in them.
        let _mirror_gate = member.map(|m| m.mirrors.unit_gate());
        for u in &units {
            if u.end <= mark.appended {
                self.counters.units_skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let id =
                store_tablet(u.head.table, u.head.first_slot, u.head.epoch).expect("checked above");
            // A mirror applies the unit to its memory before logging it (a refusal is resent
            // whole, and applying twice keeps the same version).
            if let Some(member) = member {
                if let Err(e) = member.mirrors.apply_unit(
                    node,
                    u64::from(u.head.table),
                    u.head.first_slot,
                    &u.entries,
                ) {
                    self.counters.refused_store.fetch_add(1, Ordering::Relaxed);
                    self.remember(key, mark);
                    return Err((Status::WritesRefused, e));
                }
            }
            if let Some(v) = u.entries.iter().map(|e| e.version).max() {
                self.max_version.fetch_max(v, Ordering::AcqRel);
            }
            entries.clear();
            entries.extend(u.entries.iter().map(|e| Entry {
                key: e.key,
                value: e.value,
                version: e.version,
                expiry: e.expiry,
            }));
            match self.store.append(id, &entries) {
                Ok(t) => last_ticket = Some(t),
                Err(e) => {
                    self.counters.refused_store.fetch_add(1, Ordering::Relaxed);
                    self.remember(key, mark);
                    return Err((
                        Status::WritesRefused,
                        format!("the backup store cannot take the write: {e}"),
                    ));
                }
            }
            mark.appended = u.end;
            self.counters.units.fetch_add(1, Ordering::Relaxed);
            self.counters
                .entries
                .fetch_add(u.entries.len() as u64, Ordering::Relaxed);
        }
        mark.appended = mark.appended.max(batch.end());
        if let Some(t) = last_ticket {
            mark.ticket = t.0;
        }
        self.remember(key, mark);
        self.counters.frames.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes
            .fetch_add(body.len() as u64, Ordering::Relaxed);
        acks.buffered.fetch_max(mark.appended, Ordering::AcqRel);
        let durable = batch.flags & repl::FLAG_DURABLE != 0;
        {
            let mut p = acks.pending.lock();
            match last_ticket {
                Some(t) => p.push_back((t, mark.appended, durable)),
                // Nothing new appended (all resent): durable as far as the store is.
                None if mark.ticket > 0 => {
                    p.push_back((Ticket(mark.ticket), mark.appended, durable))
                }
                None => {
                    acks.durable.fetch_max(mark.appended, Ordering::AcqRel);
                }
            }
        }
        acks.wake.notify_one();
        Ok(())
    }

    fn remember(&self, key: (u64, u64, u64), mark: StreamMark) {
        self.marks.lock().insert(key, mark);
    }

    /// Whether the test fault switch refuses this unit.
    fn test_refuses(&self, unit: &repl::Unit<'_>) -> bool {
        let Some((marker, always)) = &self.refuse_value else {
            return false;
        };
        unit.entries.iter().any(|e| {
            e.value.is_some_and(|v| v == marker.as_slice())
                && (*always || self.refused_once.lock().insert(e.key.to_vec()))
        })
    }

    /// Answers `REPL_REFUSED` for each unit refused for its content (see the module comment):
    /// new ones are counted, remembered and logged once per master and reason; resent ones
    /// (ending at or before `appended`) are answered again only if this process refused them.
    fn refuse_units(
        &self,
        stream: (u64, u64, u64),
        master: u64,
        refused: &[Refused],
        appended: u64,
        send: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<(), (Status, String)> {
        let mut out = Vec::new();
        {
            let mut all = self.refusals.lock();
            let kept = all.entry(stream).or_default();
            for r in refused {
                if r.end <= appended {
                    if kept.iter().any(|k| k.start == r.start && k.end == r.end) {
                        r.encode_frame(&mut out);
                    }
                    continue;
                }
                self.counters
                    .refused_content
                    .fetch_add(1, Ordering::Relaxed);
                if self
                    .refusals_logged
                    .lock()
                    .insert((master, r.message.clone()))
                {
                    tracing::warn!(
                        master,
                        status = ?r.status,
                        message = %r.message,
                        start = r.start,
                        end = r.end,
                        "refused a replicated unit for its content; the stream goes on without it (logged once per master and reason)"
                    );
                }
                if kept.len() >= REFUSALS_KEPT {
                    kept.pop_front();
                }
                kept.push_back(r.clone());
                r.encode_frame(&mut out);
            }
        }
        if !out.is_empty() {
            send(&out).map_err(|e| (Status::Internal, e.to_string()))?;
        }
        Ok(())
    }

    /// Acknowledges durability (see the module comment) until the connection ends.
    fn sync_loop(&self, acks: &Acks, writer: &Mutex<TcpStream>) {
        loop {
            let (target, want) = {
                let mut p = acks.pending.lock();
                while p.is_empty() && !acks.done.load(Ordering::Acquire) {
                    acks.wake.wait_for(&mut p, Duration::from_millis(50));
                }
                if acks.done.load(Ordering::Acquire) {
                    return;
                }
                let want = p.iter().any(|e| e.2);
                (*p.back().expect("not empty"), want)
            };
            let durable_to = if want {
                self.counters
                    .syncs_requested
                    .fetch_add(1, Ordering::Relaxed);
                match self.store.wait(target.0, Stage::Durable) {
                    Ok(()) => Some(target.1),
                    Err(e) => {
                        // Nothing more becomes durable here: say why and close; the master keeps
                        // every byte not acknowledged durable.
                        tracing::error!(error = %e, "the backup store cannot sync");
                        self.counters.refused_store.fetch_add(1, Ordering::Relaxed);
                        let mut out = bytes::BytesMut::new();
                        ramlog_proto::native::encode_error(
                            &mut out,
                            0,
                            repl::REPL_BATCH,
                            Status::WritesRefused,
                            0,
                            &format!("the backup store cannot sync: {e}"),
                        );
                        let mut w = writer.lock();
                        let _ = w.write_all(&out);
                        let _ = w.shutdown(Shutdown::Both);
                        return;
                    }
                }
            } else {
                // The store syncs by itself within its flush interval: report how far it got.
                let mut reached = None;
                let p = acks.pending.lock();
                for e in p.iter() {
                    match self.store.poll(e.0) {
                        Ok(Stage::Durable) => reached = Some(e.1),
                        _ => break,
                    }
                }
                drop(p);
                if reached.is_none() {
                    std::thread::sleep(Duration::from_millis(10));
                }
                reached
            };
            if let Some(end) = durable_to {
                let mut p = acks.pending.lock();
                while p.front().is_some_and(|e| e.1 <= end) {
                    p.pop_front();
                }
                drop(p);
                if acks.durable.fetch_max(end, Ordering::AcqRel) < end {
                    let ack = Ack {
                        buffered: acks.buffered.load(Ordering::Acquire).max(end),
                        durable: end,
                    };
                    if send_ack(writer, ack).is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// Refused units remembered per stream.
const REFUSALS_KEPT: usize = 256;

/// Bytes one connection's buffers hold, kept in a shared counter and taken out of it on drop.
struct Held<'a> {
    counter: &'a AtomicU64,
    bytes: u64,
}

impl Held<'_> {
    fn set(&mut self, bytes: u64) {
        if bytes > self.bytes {
            self.counter
                .fetch_add(bytes - self.bytes, Ordering::Relaxed);
        } else {
            self.counter
                .fetch_sub(self.bytes - bytes, Ordering::Relaxed);
        }
        self.bytes = bytes;
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// What one replication connection has appended and still has to report durable.
struct Acks {
    /// (store ticket, stream offset it ends, a durable table asked for a sync).
    pending: Mutex<VecDeque<(Ticket, u64, bool)>>,
    wake: Condvar,
    buffered: AtomicU64,
    durable: AtomicU64,
    done: AtomicBool,
}

fn send_ack(writer: &Mutex<TcpStream>, ack: Ack) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(HEADER_LEN + repl::ACK_LEN);
    repl::encode_frame(
        &mut frame,
        0,
        repl::REPL_ACK,
        Status::Ok.to_u8(),
        &ack.encode(),
    );
    writer.lock().write_all(&frame)
}

/// `ramlog backup`: reads a stopped server's backup store.
#[derive(clap::Args, Debug)]
pub struct BackupArgs {
    #[command(subcommand)]
    pub command: BackupCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum BackupCommand {
    /// Replay the backup store of a stopped server's data directory and print every live key,
    /// one JSON object per line: table, first_slot, epoch, key and value (hex), version,
    /// expiry. A summary goes to stderr. Exits 1 if the store reports damage.
    Dump {
        /// The server's data directory (the store is its `backup` directory).
        #[arg(long)]
        data_dir: PathBuf,
        /// Also print the live keys of each tablet to stderr.
        #[arg(long)]
        tablets: bool,
    },
}

/// Runs `ramlog backup ...`.
pub fn run(args: &BackupArgs) -> anyhow::Result<()> {
    match &args.command {
        BackupCommand::Dump { data_dir, tablets } => dump(data_dir, *tablets),
    }
}

fn dump(data_dir: &std::path::Path, tablets: bool) -> anyhow::Result<()> {
    use std::fmt::Write as _;
    let dir = data_dir.join("backup");
    if !dir.is_dir() {
        anyhow::bail!(
            "{} has no backup store ({} is missing)",
            data_dir.display(),
            dir.display()
        );
    }
    let store = Backup::open(&dir, ramlog_backup::Config::default())
        .map_err(|e| anyhow::anyhow!("backup store in {}: {e}", dir.display()))?;
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut line = String::new();
    let mut per_tablet: std::collections::BTreeMap<u64, u64> = Default::default();
    let mut failed = None;
    let report = store
        .replay_all(|e| {
            let (table, first_slot, epoch) = split_store_tablet(e.tablet);
            line.clear();
            let _ = write!(
                line,
                "{{\"table\":{table},\"first_slot\":{first_slot},\"epoch\":{epoch},\"key\":\"{}\",\"value\":\"{}\",\"version\":{},\"expiry\":{}}}",
                hex(e.key),
                hex(e.value),
                e.version,
                e.expiry
            );
            line.push('\n');
            if let Err(err) = out.write_all(line.as_bytes()) {
                failed.get_or_insert(err);
            }
            *per_tablet.entry(e.tablet).or_default() += 1;
        })
        .map_err(|e| anyhow::anyhow!("replaying {}: {e}", dir.display()))?;
    out.flush()?;
    if let Some(e) = failed {
        return Err(e.into());
    }
    for (id, keys) in per_tablet.iter().filter(|_| tablets) {
        let (table, first_slot, epoch) = split_store_tablet(*id);
        eprintln!("table {table} slot {first_slot} epoch {epoch}: {keys} live keys");
    }
    eprintln!(
        "{} live keys, {} deleted, {} stale entries skipped, {} corrupt entries, {} lost keys",
        report.live_keys,
        report.deleted_keys,
        report.stale_entries,
        report.corrupt_entries,
        report.lost_keys
    );
    let _ = store.close();
    if !report.is_clean() {
        anyhow::bail!("the backup store reports damage: {report:?}");
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    use ramlog_proto::repl::{encode_batch_body, encode_unit, ReplEntry, UnitHead};

    fn service(dir: &std::path::Path) -> (Arc<BackupService>, Arc<Node>) {
        let config = crate::node::config::ServerConfig {
            data_dir: dir.to_path_buf(),
            memory_bytes: 64 << 20,
            ..crate::node::config::ServerConfig::default()
        };
        let backup = BackupService::open(&config).unwrap();
        let engine = ramlog_logmem::Engine::new(ramlog_logmem::EngineConfig {
            memory_bytes: 64 << 20,
            ..Default::default()
        })
        .unwrap();
        let node = Node::with_engine(engine, 1, config).unwrap();
        (backup, node)
    }

    fn acks() -> Acks {
        Acks {
            pending: Mutex::new(VecDeque::new()),
            wake: Condvar::new(),
            buffered: AtomicU64::new(0),
            durable: AtomicU64::new(0),
            done: AtomicBool::new(false),
        }
    }

    /// A batch of one unit of `key = value` at `version` for tablet (0, 0..=99) at `epoch`,
    /// starting at stream offset `start`; returns the body and its end offset.
    fn batch(start: u64, epoch: u64, key: &[u8], value: &[u8], version: u64) -> (Vec<u8>, u64) {
        let mut units = Vec::new();
        let head = UnitHead {
            table: 0,
            first_slot: 0,
            last_slot: 99,
            epoch,
            count: 0,
        };
        let n = encode_unit(
            &mut units,
            &head,
            &[ReplEntry {
                key,
                value: Some(value),
                version,
                expiry: 0,
            }],
        );
        let mut body = Vec::new();
        encode_batch_body(&mut body, start, 0, &units);
        (body, start + n as u64)
    }

    fn hello(epoch: u64) -> Hello {
        Hello {
            cluster_id: 1,
            master: 7,
            master_epoch: epoch,
            map_version: 1,
            stream: 1,
        }
    }

    /// The master's side of the agreement test below: an engine whose writes are encoded as
    /// replication units by the same code a master runs.
    struct Capture {
        head: UnitHead,
        units: Mutex<Vec<(Vec<u8>, usize)>>,
    }

    impl ramlog_logmem::WriteObserver for Capture {
        fn on_writes(
            &self,
            _: ramlog_logmem::TabletId,
            records: &[ramlog_logmem::LoggedWrite<'_>],
        ) {
            let entries: Vec<ReplEntry<'_>> = records
                .iter()
                .map(|r| ReplEntry {
                    key: r.key,
                    value: r.value,
                    version: r.version,
                    expiry: r.expire_at_ms,
                })
                .collect();
            let mut unit = Vec::new();
            encode_unit(&mut unit, &self.head, &entries);
            self.units.lock().push((unit, records.len()));
        }
    }

    /// One write of the agreement test: a put (with an expiry), a delete, or a multi-put.
    #[derive(Debug, Clone)]
    enum Write {
        Put(Vec<u8>, Vec<u8>, u64),
        Delete(Vec<u8>),
        Multi(Vec<(Vec<u8>, Vec<u8>)>),
    }

    fn length_near(limit: usize) -> impl proptest::strategy::Strategy<Value = usize> + Clone {
        use proptest::prelude::*;
        prop_oneof![
            Just(0usize),
            Just(1usize),
            Just(limit - 1),
            Just(limit),
            Just(limit + 1),
            0usize..512,
        ]
    }

    fn bytes_of(len: usize, seed: u8) -> Vec<u8> {
        // Every byte value appears once a key or value is 256 bytes or longer.
        (0..len).map(|i| (i as u8).wrapping_add(seed)).collect()
    }

    fn write_strategy() -> impl proptest::strategy::Strategy<Value = Write> {
        use proptest::prelude::*;
        let key = || {
            (
                length_near(ramlog_common::KEY_SIZE_FORMAT_MAX_BYTES),
                any::<u8>(),
            )
                .prop_map(|(n, s)| bytes_of(n, s))
        };
        let value = (
            length_near(ramlog_common::VALUE_SIZE_MAX_BYTES_DEFAULT),
            any::<u8>(),
        )
            .prop_map(|(n, s)| bytes_of(n, s));
        let expiry = prop_oneof![
            Just(0u64),
            Just(1u64),
            Just(u64::MAX),
            Just(i64::MAX as u64),
            any::<u64>()
        ];
        prop_oneof![
            (key(), value, expiry).prop_map(|(k, v, e)| Write::Put(k, v, e)),
            key().prop_map(Write::Delete),
            // Multi-puts up to and past what one unit may carry (the engine's segment).
            (
                1usize..10,
                any::<u8>(),
                length_near(ramlog_common::VALUE_SIZE_MAX_BYTES_DEFAULT)
            )
                .prop_map(|(n, s, len)| Write::Multi(
                    (0..n)
                        .map(|i| (bytes_of(i + 1, s), bytes_of(len, s.wrapping_add(i as u8))))
                        .collect()
                )),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// Master and backup agree on what a valid entry is, at and around every limit: every
        /// write the engine takes becomes units that the backup's decoder and store take whole
        /// (none refused), and every write the engine refuses produces no unit at all.
        #[test]
        fn master_and_backup_agree_on_every_write_at_the_limits(writes in proptest::collection::vec(write_strategy(), 1..6)) {
            let dir = tempfile::tempdir().unwrap();
            let (backup, node) = service(dir.path());
            let head = UnitHead { table: 0, first_slot: 0, last_slot: 99, epoch: 1, count: 0 };
            let capture = Arc::new(Capture { head, units: Mutex::new(Vec::new()) });
            let engine = ramlog_logmem::Engine::new(ramlog_logmem::EngineConfig {
                memory_bytes: 256 << 20,
                write_observer: Some(capture.clone()),
                ..Default::default()
            })
            .unwrap();
            let tablet = engine.create_tablet(0, 0, 99).unwrap();
            let a = acks();
            let mut offset = 0u64;
            for w in &writes {
                let before = capture.units.lock().len();
                let taken = match w {
                    Write::Put(k, v, e) => engine
                        .put(tablet, k, v, &ramlog_logmem::PutOptions { expire_at_ms: *e, ..Default::default() })
                        .is_ok(),
                    Write::Delete(k) => engine.delete(tablet, k, ramlog_logmem::Condition::None).is_ok(),
                    Write::Multi(items) => {
                        let items: Vec<(&[u8], &[u8])> =
                            items.iter().map(|(k, v)| (k.as_slice(), v.as_slice())).collect();
                        engine.multi_put(tablet, &items).is_ok()
                    }
                };
                let units: Vec<(Vec<u8>, usize)> = capture.units.lock().drain(before..).collect();
                if !taken {
                    proptest::prop_assert!(units.is_empty(), "a refused write produced a unit: {:?}", w);
                    continue;
                }
                for (unit, entries) in units {
                    let mut body = Vec::new();
                    encode_batch_body(&mut body, offset, 0, &unit);
                    // The frame fits what the backup reads.
                    proptest::prop_assert!(
                        body.len() + HEADER_LEN <= node.config.request_size_max_bytes as usize + (1 << 20)
                    );
                    let mut refusals = Vec::new();
                    let units_before = backup.counters.units.load(Ordering::Relaxed);
                    backup
                        .take_batch(&node, None, &body, &hello(1), &a, &mut |f| {
                            refusals.extend_from_slice(f);
                            Ok(())
                        })
                        .map_err(|e| proptest::test_runner::TestCaseError::fail(format!("{e:?}")))?;
                    proptest::prop_assert!(refusals.is_empty(), "the backup refused a unit the master took");
                    proptest::prop_assert_eq!(backup.counters.units.load(Ordering::Relaxed), units_before + 1);
                    proptest::prop_assert!(entries >= 1);
                    offset += unit.len() as u64;
                }
            }
            proptest::prop_assert_eq!(backup.counters.refused_content.load(Ordering::Relaxed), 0);
        }
    }

    #[test]
    fn a_unit_refused_for_its_content_is_refused_alone_and_again_when_resent() {
        let dir = tempfile::tempdir().unwrap();
        let (backup, node) = service(dir.path());
        let a = acks();
        let head = UnitHead {
            table: 0,
            first_slot: 0,
            last_slot: 99,
            epoch: 1,
            count: 0,
        };
        let too_large = vec![7u8; backup.limits.value_max_bytes + 1];
        let mut units = Vec::new();
        let mut ends = Vec::new();
        for (i, (key, value)) in [
            (&b""[..], &b"empty key"[..]),
            (b"big", &too_large),
            (b"k3", b"v3"),
        ]
        .into_iter()
        .enumerate()
        {
            encode_unit(
                &mut units,
                &head,
                &[ReplEntry {
                    key,
                    value: Some(value),
                    version: 10 + i as u64,
                    expiry: 0,
                }],
            );
            ends.push(units.len() as u64);
        }
        let mut body = Vec::new();
        encode_batch_body(&mut body, 0, 0, &units);
        let mut sent = Vec::new();
        backup
            .take_batch(&node, None, &body, &hello(1), &a, &mut |f| {
                sent.extend_from_slice(f);
                Ok(())
            })
            .unwrap();
        // The frame is taken whole but for the refused unit, which is answered alone.
        assert_eq!(a.buffered.load(Ordering::Relaxed), ends[2]);
        assert_eq!(backup.counters.units.load(Ordering::Relaxed), 2);
        assert_eq!(backup.counters.refused_content.load(Ordering::Relaxed), 1);
        let header = ramlog_proto::native::parse_header(&sent, 1 << 20)
            .unwrap()
            .unwrap();
        assert_eq!(header.opcode, repl::REPL_REFUSED);
        assert_eq!(header.frame_bytes(), sent.len());
        let refused =
            Refused::decode(Status::from_u8(header.flags_or_status), &sent[HEADER_LEN..]).unwrap();
        assert_eq!((refused.start, refused.end), (ends[0], ends[1]));
        assert_eq!(refused.status, Status::ValueTooLarge);
        // Resent after a reconnection: nothing appended again, the refusal answered again.
        let mut again = Vec::new();
        backup
            .take_batch(&node, None, &body, &hello(1), &a, &mut |f| {
                again.extend_from_slice(f);
                Ok(())
            })
            .unwrap();
        assert_eq!(again, sent);
        assert_eq!(backup.counters.units.load(Ordering::Relaxed), 2);
        assert_eq!(backup.counters.refused_content.load(Ordering::Relaxed), 1);
        // The empty key and k3 are in the store; the refused value is not.
        let mut seen = Vec::new();
        backup
            .store()
            .replay_all(|e| seen.push(e.key.to_vec()))
            .unwrap();
        seen.sort();
        assert_eq!(seen, vec![b"".to_vec(), b"k3".to_vec()]);
    }

    #[test]
    fn older_epochs_are_fenced_and_resent_units_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let (backup, node) = service(dir.path());
        let a = acks();
        let (b1, end1) = batch(0, 3, b"k", b"epoch3", 10);
        backup
            .take_batch(&node, None, &b1, &hello(1), &a, &mut |_| Ok(()))
            .unwrap();
        assert_eq!(a.buffered.load(Ordering::Relaxed), end1);
        // The same units again (a reconnection resends from the last durable offset): skipped.
        backup
            .take_batch(&node, None, &b1, &hello(1), &a, &mut |_| Ok(()))
            .unwrap();
        assert_eq!(backup.counters.units_skipped.load(Ordering::Relaxed), 1);
        // A frame from an older epoch of the tablet is refused, and nothing of it is appended.
        let (b2, _) = batch(end1, 2, b"k", b"zombie", 11);
        let (status, message) = backup
            .take_batch(&node, None, &b2, &hello(1), &a, &mut |_| Ok(()))
            .unwrap_err();
        assert_eq!(status, Status::Fenced, "{message}");
        assert!(message.contains("stale epoch"), "{message}");
        // Another master process (a new master epoch) with the same old tablet epoch: fenced too.
        let (b3, _) = batch(0, 2, b"k", b"zombie", 12);
        assert_eq!(
            backup
                .take_batch(&node, None, &b3, &hello(2), &a, &mut |_| Ok(()))
                .unwrap_err()
                .0,
            Status::Fenced
        );
        // A newer epoch is taken, and raises the fence.
        let (b4, _) = batch(0, 4, b"k", b"epoch4", 13);
        backup
            .take_batch(&node, None, &b4, &hello(3), &a, &mut |_| Ok(()))
            .unwrap();
        let (b5, _) = batch(end1, 3, b"j", b"late", 14);
        assert_eq!(
            backup
                .take_batch(&node, None, &b5, &hello(1), &a, &mut |_| Ok(()))
                .unwrap_err()
                .0,
            Status::Fenced
        );
        // A corrupt frame and a gap in the stream are refused.
        let mut bad = b4.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert_eq!(
            backup
                .take_batch(&node, None, &bad, &hello(3), &a, &mut |_| Ok(()))
                .unwrap_err()
                .0,
            Status::BadRequest
        );
        let (gap, _) = batch(end1 * 10, 4, b"g", b"gap", 15);
        assert_eq!(
            backup
                .take_batch(&node, None, &gap, &hello(3), &a, &mut |_| Ok(()))
                .unwrap_err()
                .0,
            Status::BadRequest
        );
        assert_eq!(backup.epochs(), vec![((0, 0), 4)]);
        // What replays: each epoch's log, nothing refused.
        let mut seen = Vec::new();
        backup
            .store()
            .replay_all(|e| seen.push((split_store_tablet(e.tablet).2, e.value.to_vec())))
            .unwrap();
        seen.sort();
        assert_eq!(seen, vec![(3, b"epoch3".to_vec()), (4, b"epoch4".to_vec())]);
        drop(backup);
        // The fence survives a restart: the newest epoch is what the store's tablets record.
        let (again, node) = service(dir.path());
        assert_eq!(again.epochs(), vec![((0, 0), 4)]);
        let (b6, _) = batch(0, 3, b"k", b"after-restart", 20);
        assert_eq!(
            again
                .take_batch(&node, None, &b6, &hello(9), &acks(), &mut |_| Ok(()))
                .unwrap_err()
                .0,
            Status::Fenced
        );
    }

    #[test]
    fn store_tablet_ids_pack_and_unpack() {
        let id = store_tablet(7, 16383, 5).unwrap();
        assert_eq!(split_store_tablet(id), (7, 16383, 5));
        assert_eq!(
            split_store_tablet(store_tablet(0, 0, 1).unwrap()),
            (0, 0, 1)
        );
        assert!(store_tablet(1 << 24, 0, 1).is_none());
        assert!(store_tablet(0, 0, 1 << 24).is_none());
    }
}
