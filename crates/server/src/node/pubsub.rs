//! Publish/subscribe on this server: who subscribes to which channels and patterns, and the
//! delivery of a message to them.
//!
//! Each subscribed connection has one [`Mailbox`]: an unbounded queue its connection task drains
//! into its socket, with the bytes queued counted. A subscriber whose queue passes
//! [`QUEUE_MAX_BYTES`] (it does not read fast enough) is dropped from every channel and its
//! connection closed, as Redis closes a pub/sub client past its output buffer limit. So what this
//! module holds is bounded: per subscriber, its subscriptions and at most `QUEUE_MAX_BYTES`.
//! Delivery is at most once, as in Redis: a message reaches the subscribers present when it is
//! published, on this server (cluster servers forward PUBLISH to each other, and keyspace
//! notifications to each other's routing-port subscribers, `front::commands::pubsub`).

use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Notify};

/// The most bytes of messages a subscriber may have waiting before it is disconnected.
pub const QUEUE_MAX_BYTES: usize = 32 << 20;
/// The most bytes of PUBLISHes a cluster server holds for the other servers; past it (a peer slow
/// to answer) new ones are not sent to them (counted in `dropped`), as pub/sub is at most once.
pub const BROADCAST_MAX_BYTES: usize = 64 << 20;

/// The longest a PUBLISH waits for its subscribers to finish the requests they sent before it
/// (see [`Input`]).
pub const SETTLE_MAX: Duration = Duration::from_millis(10);
/// The most subscribers of one PUBLISH whose sockets are asked for unread requests (one
/// `ioctl` each); past it the rest are delivered to as they stand.
pub const SETTLE_CHECKS_MAX: usize = 128;

/// What a cluster server sends the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broadcast {
    /// A PUBLISH, for every subscriber of every server (as Redis Cluster broadcasts it).
    Publish,
    /// A keyspace notification of a key this server masters, for the routing-port subscribers
    /// of the other servers only (a cluster port's subscribers hear their own server's keys, as
    /// a Redis Cluster node's do; a routing port stands for the whole cluster).
    KeyEvent,
}

/// A cluster server's PUBLISHes and keyspace notifications on their way to the other servers.
pub struct BroadcastQueue {
    pub tx: mpsc::UnboundedSender<(Broadcast, Vec<u8>, Vec<u8>)>,
    /// Bytes of channel and payload queued and not sent yet.
    pub queued: Arc<AtomicUsize>,
    pub dropped: std::sync::atomic::AtomicU64,
}

impl BroadcastQueue {
    /// Queues a message for the other servers, unless [`BROADCAST_MAX_BYTES`] are waiting.
    pub fn send(&self, kind: Broadcast, channel: &[u8], payload: &[u8]) {
        let n = channel.len() + payload.len();
        if self.queued.fetch_add(n, Ordering::Relaxed) + n > BROADCAST_MAX_BYTES {
            self.queued.fetch_sub(n, Ordering::Relaxed);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if self
            .tx
            .send((kind, channel.to_vec(), payload.to_vec()))
            .is_err()
        {
            self.queued.fetch_sub(n, Ordering::Relaxed);
        }
    }
}

/// What a subscriber receives.
#[derive(Debug, Clone)]
pub enum Message {
    /// A message on a channel it subscribed to (`sharded`: SSUBSCRIBE's).
    Channel {
        channel: Arc<[u8]>,
        payload: Arc<[u8]>,
        sharded: bool,
    },
    /// A message on a channel that matches a pattern it subscribed to.
    Pattern {
        pattern: Arc<[u8]>,
        channel: Arc<[u8]>,
        payload: Arc<[u8]>,
    },
}

impl Message {
    fn bytes(&self) -> usize {
        match self {
            Message::Channel {
                channel, payload, ..
            } => channel.len() + payload.len() + 32,
            Message::Pattern {
                pattern,
                channel,
                payload,
            } => pattern.len() + channel.len() + payload.len() + 40,
        }
    }
}

/// A subscribed connection's requests as publishers see them, so that a PUBLISH is ordered
/// after the requests a subscriber sent before it, as Redis's one thread orders them: a client
/// that sends UNSUBSCRIBE and then, on another connection, PUBLISH, finds no subscriber left.
/// Each connection is a task on one of several workers, so the UNSUBSCRIBE may not have run yet
/// when the PUBLISH does. A subscriber is *unsettled* while its socket holds unread bytes
/// (`FIONREAD`) or while it handles what it read ([`Input::begin`] .. [`Input::end`]); a PUBLISH
/// waits for its unsettled subscribers ([`PubSub::settle`]), at most [`SETTLE_MAX`].
pub struct Input {
    /// The connection's socket (-1 until its task names it).
    fd: AtomicI32,
    busy: AtomicBool,
    settled: Notify,
}

impl Default for Input {
    fn default() -> Self {
        Input {
            fd: AtomicI32::new(-1),
            busy: AtomicBool::new(false),
            settled: Notify::new(),
        }
    }
}

impl Input {
    /// The connection's socket, for the unread-bytes check.
    pub fn set_fd(&self, fd: i32) {
        self.fd.store(fd, Ordering::Relaxed);
    }

    /// The connection is about to read requests and handle them.
    pub fn begin(&self) {
        self.busy.store(true, Ordering::SeqCst);
    }

    /// It handled everything it read and waits for more.
    pub fn end(&self) {
        if self.busy.swap(false, Ordering::SeqCst) {
            self.settled.notify_waiters();
        }
    }

    /// True while requests it was sent are unread or being handled.
    fn unsettled(&self) -> bool {
        if self.busy.load(Ordering::SeqCst) {
            return true;
        }
        let fd = self.fd.load(Ordering::Relaxed);
        if fd < 0 {
            return false;
        }
        let mut unread: libc::c_int = 0;
        // SAFETY: FIONREAD writes one c_int through the pointer, which points at `unread`. The
        // descriptor may have been closed meanwhile (the connection ended): the call then fails
        // or reports another socket's bytes, and the wait is bounded either way.
        let r = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut unread as *mut libc::c_int) };
        r == 0 && unread > 0
    }
}

/// The sending half a subscription is registered with.
#[derive(Clone)]
struct Sender {
    id: u64,
    input: Arc<Input>,
    /// A routing-port client's: it also hears the other servers' keyspace notifications.
    routed: bool,
    tx: mpsc::UnboundedSender<Message>,
    queued: Arc<AtomicUsize>,
    overflowed: Arc<AtomicBool>,
}

impl Sender {
    fn send(&self, m: Message) -> bool {
        if self.overflowed.load(Ordering::Relaxed) {
            return false;
        }
        let n = m.bytes();
        if self.queued.fetch_add(n, Ordering::Relaxed) + n > QUEUE_MAX_BYTES {
            self.overflowed.store(true, Ordering::Relaxed);
            return false;
        }
        self.tx.send(m).is_ok()
    }
}

/// One connection's subscriptions and its queue of messages.
pub struct Mailbox {
    registry: Arc<Mutex<Registry>>,
    sender: Sender,
    rx: mpsc::UnboundedReceiver<Message>,
    pub channels: HashSet<Vec<u8>>,
    pub patterns: HashSet<Vec<u8>>,
    pub shard_channels: HashSet<Vec<u8>>,
}

impl std::fmt::Debug for Mailbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mailbox")
            .field("channels", &self.channels.len())
            .field("patterns", &self.patterns.len())
            .field("shard_channels", &self.shard_channels.len())
            .finish()
    }
}

impl Mailbox {
    /// Subscriptions of every kind (what the subscribe replies count).
    pub fn count(&self) -> usize {
        self.channels.len() + self.patterns.len()
    }

    /// The next message, once one is queued.
    pub async fn next(&mut self) -> Option<Message> {
        let m = self.rx.recv().await?;
        self.sender.queued.fetch_sub(m.bytes(), Ordering::Relaxed);
        Some(m)
    }

    /// A message already queued, if any.
    pub fn try_next(&mut self) -> Option<Message> {
        let m = self.rx.try_recv().ok()?;
        self.sender.queued.fetch_sub(m.bytes(), Ordering::Relaxed);
        Some(m)
    }

    /// The subscriber fell too far behind: the connection must close.
    pub fn overflowed(&self) -> bool {
        self.sender.overflowed.load(Ordering::Relaxed)
    }

    /// The connection's requests as publishers see them.
    pub fn input(&self) -> &Arc<Input> {
        &self.sender.input
    }
}

#[derive(Default)]
struct Registry {
    channels: HashMap<Vec<u8>, Vec<Sender>>,
    patterns: HashMap<Vec<u8>, Vec<Sender>>,
    shard_channels: HashMap<Vec<u8>, Vec<Sender>>,
}

#[derive(Default)]
pub struct PubSub {
    registry: Arc<Mutex<Registry>>,
    /// On a cluster server: what goes to the other servers (set once it joined).
    pub broadcast: std::sync::OnceLock<BroadcastQueue>,
}

impl Drop for Mailbox {
    /// A connection that ends leaves every channel.
    fn drop(&mut self) {
        self.sender.input.end();
        let mut r = self.registry.lock();
        let id = self.sender.id;
        for (kind, names) in [
            (Kind::Channel, &self.channels),
            (Kind::Pattern, &self.patterns),
            (Kind::Shard, &self.shard_channels),
        ] {
            let table = PubSub::table(&mut r, kind);
            for name in names {
                if let Some(list) = table.get_mut(name) {
                    list.retain(|s| s.id != id);
                    if list.is_empty() {
                        table.remove(name);
                    }
                }
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Channel,
    Pattern,
    Shard,
}

impl PubSub {
    /// A connection's mailbox (`routed`: a routing-port client's, see [`Broadcast::KeyEvent`]).
    pub fn mailbox(&self, id: u64, routed: bool) -> Mailbox {
        let (tx, rx) = mpsc::unbounded_channel();
        Mailbox {
            registry: self.registry.clone(),
            sender: Sender {
                id,
                // Made by a SUBSCRIBE the connection is handling: busy until it waits for more.
                input: Arc::new(Input {
                    busy: AtomicBool::new(true),
                    ..Input::default()
                }),
                routed,
                tx,
                queued: Arc::default(),
                overflowed: Arc::default(),
            },
            rx,
            channels: HashSet::new(),
            patterns: HashSet::new(),
            shard_channels: HashSet::new(),
        }
    }

    fn table(r: &mut Registry, kind: Kind) -> &mut HashMap<Vec<u8>, Vec<Sender>> {
        match kind {
            Kind::Channel => &mut r.channels,
            Kind::Pattern => &mut r.patterns,
            Kind::Shard => &mut r.shard_channels,
        }
    }

    /// Subscribes `mailbox` to `name`; false if it already was.
    pub fn subscribe(&self, mailbox: &mut Mailbox, kind: Kind, name: &[u8]) -> bool {
        let set = match kind {
            Kind::Channel => &mut mailbox.channels,
            Kind::Pattern => &mut mailbox.patterns,
            Kind::Shard => &mut mailbox.shard_channels,
        };
        if !set.insert(name.to_vec()) {
            return false;
        }
        let mut r = self.registry.lock();
        Self::table(&mut r, kind)
            .entry(name.to_vec())
            .or_default()
            .push(mailbox.sender.clone());
        true
    }

    /// Unsubscribes `mailbox` from `name`; false if it was not subscribed.
    pub fn unsubscribe(&self, mailbox: &mut Mailbox, kind: Kind, name: &[u8]) -> bool {
        let set = match kind {
            Kind::Channel => &mut mailbox.channels,
            Kind::Pattern => &mut mailbox.patterns,
            Kind::Shard => &mut mailbox.shard_channels,
        };
        if !set.remove(name) {
            return false;
        }
        let id = mailbox.sender.id;
        let mut r = self.registry.lock();
        let table = Self::table(&mut r, kind);
        if let Some(list) = table.get_mut(name) {
            list.retain(|s| s.id != id);
            if list.is_empty() {
                table.remove(name);
            }
        }
        true
    }

    /// Delivers a message to this server's subscribers of `channel` (and of patterns that
    /// match it; `sharded`: to SSUBSCRIBE's subscribers only); how many received it.
    pub fn publish(&self, channel: &[u8], payload: &[u8], sharded: bool) -> usize {
        self.deliver(channel, payload, sharded, false)
    }

    /// The subscribers a PUBLISH on `channel` would reach that have requests unread or in hand
    /// (the first [`SETTLE_CHECKS_MAX`] looked at). Empty almost always; the caller then need
    /// not wait.
    pub fn unsettled(&self, channel: &[u8], sharded: bool) -> Vec<Arc<Input>> {
        let r = self.registry.lock();
        let mut found = Vec::new();
        let mut checked = 0;
        let mut look = |list: &Vec<Sender>| {
            for s in list {
                if checked >= SETTLE_CHECKS_MAX {
                    return;
                }
                checked += 1;
                if s.input.unsettled() {
                    found.push(s.input.clone());
                }
            }
        };
        let table = if sharded {
            &r.shard_channels
        } else {
            &r.channels
        };
        if let Some(list) = table.get(channel) {
            look(list);
        }
        if !sharded {
            for (pattern, list) in &r.patterns {
                if ramlog_common::glob_match(pattern, channel) {
                    look(list);
                }
            }
        }
        found
    }

    /// Waits until each of `inputs` has handled what it was sent, at most [`SETTLE_MAX`] in all.
    pub async fn settle(inputs: Vec<Arc<Input>>) {
        let deadline = tokio::time::Instant::now() + SETTLE_MAX;
        for input in inputs {
            loop {
                let settled = input.settled.notified();
                tokio::pin!(settled);
                settled.as_mut().enable();
                if !input.unsettled() {
                    break;
                }
                if tokio::time::timeout_at(deadline, settled).await.is_err() {
                    return;
                }
            }
        }
    }

    /// A keyspace notification of a key this server masters: delivered here, and sent to the
    /// other servers' routing-port subscribers.
    pub fn publish_key_event(&self, channel: &[u8], payload: &[u8]) {
        self.deliver(channel, payload, false, false);
        if let Some(q) = self.broadcast.get() {
            q.send(Broadcast::KeyEvent, channel, payload);
        }
    }

    /// Another server's keyspace notification: delivered to this server's routing-port
    /// subscribers; how many received it.
    pub fn deliver_key_event(&self, channel: &[u8], payload: &[u8]) -> usize {
        self.deliver(channel, payload, false, true)
    }

    fn deliver(&self, channel: &[u8], payload: &[u8], sharded: bool, routed_only: bool) -> usize {
        let r = self.registry.lock();
        let channel_arc: Arc<[u8]> = Arc::from(channel);
        let payload_arc: Arc<[u8]> = Arc::from(payload);
        let mut n = 0;
        let table = if sharded {
            &r.shard_channels
        } else {
            &r.channels
        };
        if let Some(list) = table.get(channel) {
            for s in list.iter().filter(|s| s.routed || !routed_only) {
                let m = Message::Channel {
                    channel: channel_arc.clone(),
                    payload: payload_arc.clone(),
                    sharded,
                };
                n += usize::from(s.send(m));
            }
        }
        if !sharded {
            for (pattern, list) in &r.patterns {
                if !ramlog_common::glob_match(pattern, channel) {
                    continue;
                }
                let pattern: Arc<[u8]> = Arc::from(pattern.as_slice());
                for s in list.iter().filter(|s| s.routed || !routed_only) {
                    let m = Message::Pattern {
                        pattern: pattern.clone(),
                        channel: channel_arc.clone(),
                        payload: payload_arc.clone(),
                    };
                    n += usize::from(s.send(m));
                }
            }
        }
        n
    }

    /// Channels (of `kind`, matching `pattern`) with subscribers here.
    pub fn channels(&self, kind: Kind, pattern: Option<&[u8]>) -> Vec<Vec<u8>> {
        let mut r = self.registry.lock();
        Self::table(&mut r, kind)
            .keys()
            .filter(|c| pattern.is_none_or(|p| ramlog_common::glob_match(p, c)))
            .cloned()
            .collect()
    }

    /// Subscribers of a channel here.
    pub fn subscribers(&self, kind: Kind, channel: &[u8]) -> usize {
        let mut r = self.registry.lock();
        Self::table(&mut r, kind).get(channel).map_or(0, Vec::len)
    }

    /// Patterns subscribed to here (each counted once).
    pub fn patterns(&self) -> usize {
        self.registry.lock().patterns.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn messages_reach_channel_and_pattern_subscribers_once_each() {
        let ps = PubSub::default();
        let mut a = ps.mailbox(1, false);
        let mut b = ps.mailbox(2, false);
        assert!(ps.subscribe(&mut a, Kind::Channel, b"news"));
        assert!(!ps.subscribe(&mut a, Kind::Channel, b"news"));
        assert!(ps.subscribe(&mut b, Kind::Pattern, b"n*"));
        assert_eq!(ps.publish(b"news", b"hi", false), 2);
        assert_eq!(ps.publish(b"other", b"x", false), 0);
        assert!(matches!(a.next().await, Some(Message::Channel { .. })));
        assert!(matches!(b.next().await, Some(Message::Pattern { .. })));
        assert!(a.try_next().is_none());
        drop(a);
        assert_eq!(ps.publish(b"news", b"again", false), 1);
        assert_eq!(ps.channels(Kind::Channel, None).len(), 0);
    }

    #[tokio::test]
    async fn other_servers_key_events_reach_routing_port_subscribers_only() {
        let ps = PubSub::default();
        let mut cluster_port = ps.mailbox(1, false);
        let mut routing_port = ps.mailbox(2, true);
        for m in [&mut cluster_port, &mut routing_port] {
            ps.subscribe(m, Kind::Pattern, b"__keyspace@0__:*");
        }
        // This server's own key: both hear it (no broadcast queue outside a cluster).
        ps.publish_key_event(b"__keyspace@0__:mine", b"set");
        // Another server's: the routing port's subscriber alone.
        assert_eq!(ps.deliver_key_event(b"__keyspace@0__:theirs", b"del"), 1);
        let channel = |m: Option<Message>| match m {
            Some(Message::Pattern { channel, .. }) => channel.to_vec(),
            other => panic!("{other:?}"),
        };
        assert_eq!(channel(cluster_port.next().await), b"__keyspace@0__:mine");
        assert!(cluster_port.try_next().is_none());
        assert_eq!(channel(routing_port.next().await), b"__keyspace@0__:mine");
        assert_eq!(channel(routing_port.next().await), b"__keyspace@0__:theirs");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_publish_waits_for_a_subscriber_that_handles_requests_and_no_longer() {
        let ps = Arc::new(PubSub::default());
        let mut a = ps.mailbox(1, false);
        ps.subscribe(&mut a, Kind::Channel, b"c");
        // Made while handling a SUBSCRIBE: busy until its connection waits again.
        let waiting = ps.unsettled(b"c", false);
        assert_eq!(waiting.len(), 1);
        assert!(ps.unsettled(b"other", false).is_empty());
        let input = a.input().clone();
        let ended = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(3)).await;
            input.end();
            std::time::Instant::now()
        });
        PubSub::settle(waiting).await;
        let settled = std::time::Instant::now();
        assert!(settled >= ended.await.unwrap());
        assert!(ps.unsettled(b"c", false).is_empty());
        // One that never ends: the wait is bounded.
        a.input().begin();
        let started = std::time::Instant::now();
        PubSub::settle(ps.unsettled(b"c", false)).await;
        let waited = started.elapsed();
        assert!(
            waited >= SETTLE_MAX && waited < SETTLE_MAX * 20,
            "{waited:?}"
        );
        // A connection that ends settles.
        drop(a);
        assert!(ps.unsettled(b"c", false).is_empty());
    }

    #[test]
    fn a_subscriber_that_falls_behind_is_cut_off() {
        let ps = PubSub::default();
        let mut a = ps.mailbox(1, false);
        ps.subscribe(&mut a, Kind::Channel, b"c");
        let big = vec![0u8; 1 << 20];
        let mut delivered = 0;
        for _ in 0..40 {
            delivered += ps.publish(b"c", &big, false);
        }
        assert!(delivered < 40 && a.overflowed());
    }
}
