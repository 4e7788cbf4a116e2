//! What a connection's replies wait for before they may claim their writes, as a value: the
//! node's data calls add to an [`Acks`] the caller owns, and [`crate::node::Node::acknowledge`]
//! waits for it. The node fills it through [`ClusterHooks`], which the replication role
//! implements and registers; a front end holds one `Acks` per connection, notes which of its
//! replies depend on which writes ([`HeldReply`]), and fails exactly those a backup refused
//! ([`refused_replies`]).
//!
//! The figures are plain: stream ids and offsets. What a stream is, how a wait is kept and what a
//! refusal means are the replication role's.

use crate::node::figures::{ClusterFigures, ReplicationFigures};
use ramlog_logmem::TabletId;
use std::future::Future;
use std::pin::Pin;
use std::time::Instant;

/// One wait on one replication stream: offsets its backup must have acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AckItem {
    /// The stream (an id the replication role gives each stream).
    pub stream: u64,
    /// Stream offset the backup must hold in its write buffer.
    pub buffered: u64,
    /// Stream offset the backup must have on disk.
    pub durable: u64,
    /// The table mode's index (for per-mode figures).
    pub mode: u8,
    /// When the first write behind this wait was applied.
    pub since: Instant,
}

/// One unit a write appended to one stream, in order (for `sync`, `durable` and `mirror`
/// tables): how a refusal of that unit finds the reply it must fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitMark {
    pub stream: u64,
    pub end: u64,
}

/// What a connection's replies wait for since they last went out; see the module comment.
#[derive(Default, Debug)]
pub struct Acks {
    items: Vec<AckItem>,
    units: Vec<UnitMark>,
    /// Grows with every wait added: a front end compares it before and after a request to know
    /// whether that request's reply must wait (a write, or a read of writes in flight).
    changes: u64,
}

impl Acks {
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Units recorded so far: a front end notes this before and after each request, and a
    /// [`RefusedWrite`] whose `unit` falls in between belongs to that request's reply.
    pub fn units_len(&self) -> usize {
        self.units.len()
    }

    /// See the field: compare before and after a request.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Adds a wait on `stream` (merged with one of the same stream and mode).
    pub fn add(&mut self, stream: u64, mode: u8, buffered: u64, durable: u64) {
        self.add_since(stream, mode, buffered, durable, Instant::now());
    }

    fn add_since(&mut self, stream: u64, mode: u8, buffered: u64, durable: u64, since: Instant) {
        self.changes += 1;
        for n in self.items.iter_mut() {
            if n.stream == stream && n.mode == mode {
                n.buffered = n.buffered.max(buffered);
                n.durable = n.durable.max(durable);
                n.since = n.since.min(since);
                return;
            }
        }
        self.items.push(AckItem {
            stream,
            buffered,
            durable,
            mode,
            since,
        });
    }

    /// Records a unit a write appended (see [`UnitMark`]).
    pub fn add_unit(&mut self, stream: u64, end: u64) {
        self.units.push(UnitMark { stream, end });
    }

    /// Moves every wait and unit of `other` into this one.
    pub fn absorb(&mut self, other: &mut Acks) {
        for n in other.items.drain(..) {
            self.add_since(n.stream, n.mode, n.buffered, n.durable, n.since);
        }
        self.units.append(&mut other.units);
        other.changes = 0;
    }

    /// Forgets every wait (a deliberately broken test server: replies go out at once).
    pub fn clear(&mut self) {
        self.items.clear();
        self.units.clear();
    }

    /// Takes the waits and the units out, leaving this empty.
    pub fn take(&mut self) -> (Vec<AckItem>, Vec<UnitMark>) {
        (
            std::mem::take(&mut self.items),
            std::mem::take(&mut self.units),
        )
    }
}

/// A unit of the connection's writes that a backup refused: the index of its mark (counted as
/// [`Acks::units_len`] counts) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefusedWrite {
    pub unit: usize,
    pub reason: String,
}

/// A reply held until the writes (or the reads) behind it are acknowledged: where it lies in its
/// connection's output, and the units its request appended (see [`Acks::units_len`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldReply {
    pub start: usize,
    pub end: usize,
    pub units_from: usize,
    pub units_to: usize,
}

/// For each held reply, in order: None if it stands, or why it must fail (a backup refused one
/// of its units).
pub fn refused_replies<'a>(
    held: &[HeldReply],
    refused: &'a [RefusedWrite],
) -> Vec<Option<&'a str>> {
    held.iter()
        .map(|h| {
            refused
                .iter()
                .find(|r| (h.units_from..h.units_to).contains(&r.unit))
                .map(|r| r.reason.as_str())
        })
        .collect()
}

/// A future the hooks return (the node awaits it on a connection's task).
pub type HookFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The memory the cluster roles hold for data, charged to the node's budget.
#[derive(Clone, Copy, Debug, Default)]
pub struct RolesMemory {
    /// Replication streams' unacknowledged bytes and frame buffers, and the backup side's read
    /// buffers.
    pub replication_buffers: u64,
    /// The backup duty's log store.
    pub backup_store: ramlog_backup::MemoryUsage,
}

/// What the node asks of a cluster server's roles, which register it once
/// ([`crate::node::Node::set_cluster_hooks`]); a standalone server has none.
pub trait ClusterHooks: Send + Sync {
    /// Moves what the writes and reads this thread just ran (through the engine, whose write
    /// observer replication is) wait for into `acks`. Called by the node right after each data
    /// call, on the same thread.
    fn collect(&self, acks: &mut Acks);

    /// A read of `tablet` ran on this thread: its reply waits until what it may have seen is
    /// replicated as the tablet's mode promises.
    fn read_barrier(&self, tablet: TabletId);

    /// Waits until every wait in `acks` is met (at most `replication_ack_timeout_ms`); empties
    /// it. Err: the promise cannot be kept (the replies must not claim the writes). Ok: the
    /// writes a backup refused, whose replies must fail; the others stand.
    fn wait<'a>(&'a self, acks: &'a mut Acks) -> HookFuture<'a, Result<Vec<RefusedWrite>, String>>;

    /// What the roles hold in memory for data.
    fn memory(&self) -> RolesMemory;

    /// The roles' figures.
    fn figures(&self) -> (ReplicationFigures, Option<ClusterFigures>);

    /// The node stops: streams end, connections close, the backup store is flushed.
    fn stop(&self) -> HookFuture<'_, ()>;
}
