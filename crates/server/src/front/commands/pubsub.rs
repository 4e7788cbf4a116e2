//! Publish/subscribe commands (Redis's `pubsub.c`): SUBSCRIBE, UNSUBSCRIBE, PSUBSCRIBE,
//! PUNSUBSCRIBE, SSUBSCRIBE, SUNSUBSCRIBE, PUBLISH, SPUBLISH, PUBSUB.
//!
//! A connection that subscribes gets a mailbox (`node::pubsub`); its connection task writes what
//! arrives there between requests (`front::resp_conn`). In a cluster, PUBLISH reaches the
//! subscribers of every server, as Redis Cluster broadcasts it: the server that takes it
//! delivers it to its own subscribers and sends it to every other server of the map, in order,
//! from one task (`Broadcast`), where it is delivered as a forwarded PUBLISH (which is not sent on
//! again). SPUBLISH stays on the channel's slot's master, as in Redis Cluster. Keyspace
//! notifications go out the same way, as RAMLOG.KEYEVENT, for the routing-port subscribers of
//! the other servers only (a routing port stands for the whole cluster; a cluster port's
//! subscribers hear their own server's keys, as a Redis Cluster node's do).

use super::*;
use crate::node::pubsub::{Broadcast, Kind, Message};

/// The header of a pub/sub reply: a push in RESP3, an array in RESP2.
pub(crate) fn push_header(out: &mut Vec<u8>, protocol: u8, len: usize) {
    out.push(if protocol == 3 { b'>' } else { b'*' });
    ramlog_proto::resp::push_decimal(out, len as i64);
    out.extend_from_slice(b"\r\n");
}

/// Encodes a delivered message as Redis sends it.
pub(crate) fn encode_message(out: &mut Vec<u8>, protocol: u8, m: &Message) {
    match m {
        Message::Channel {
            channel,
            payload,
            sharded,
        } => {
            push_header(out, protocol, 3);
            let mut enc = ReplyEncoder::new(out, protocol);
            enc.bulk(if *sharded { b"smessage" } else { b"message" });
            enc.bulk(channel);
            enc.bulk(payload);
        }
        Message::Pattern {
            pattern,
            channel,
            payload,
        } => {
            push_header(out, protocol, 4);
            let mut enc = ReplyEncoder::new(out, protocol);
            enc.bulk(b"pmessage");
            enc.bulk(pattern);
            enc.bulk(channel);
            enc.bulk(payload);
        }
    }
}

fn confirm(ctx: &mut Ctx<'_>, what: &str, name: Option<&[u8]>, count: usize) {
    let protocol = ctx.session.protocol;
    push_header(ctx.enc.buffer(), protocol, 3);
    ctx.enc.bulk(what.as_bytes());
    ctx.enc.bulk_or_null(name);
    ctx.enc.integer(count as i64);
}

fn counted(ctx: &Ctx<'_>, kind: Kind) -> usize {
    ctx.session.mailbox.as_ref().map_or(0, |m| match kind {
        Kind::Shard => m.shard_channels.len(),
        _ => m.count(),
    })
}

fn subscribe(ctx: &mut Ctx<'_>, args: &[&[u8]], kind: Kind, what: &str) {
    let node = ctx.node;
    // A routing-port client of a cluster also hears other servers' keys' events.
    let routed = ctx.session.routed && ctx.session.member().is_some();
    for name in &args[1..] {
        let mailbox = ctx
            .session
            .mailbox
            .get_or_insert_with(|| node.pubsub.mailbox(ctx.session.id, routed));
        node.pubsub.subscribe(mailbox, kind, name);
        let n = counted(ctx, kind);
        confirm(ctx, what, Some(name), n);
    }
}

fn unsubscribe(ctx: &mut Ctx<'_>, args: &[&[u8]], kind: Kind, what: &str) {
    let node = ctx.node;
    let names: Vec<Vec<u8>> = if args.len() > 1 {
        args[1..].iter().map(|a| a.to_vec()).collect()
    } else {
        ctx.session.mailbox.as_ref().map_or(Vec::new(), |m| {
            let set = match kind {
                Kind::Channel => &m.channels,
                Kind::Pattern => &m.patterns,
                Kind::Shard => &m.shard_channels,
            };
            set.iter().cloned().collect()
        })
    };
    if names.is_empty() {
        let n = counted(ctx, kind);
        return confirm(ctx, what, None, n);
    }
    for name in names {
        if let Some(m) = ctx.session.mailbox.as_mut() {
            node.pubsub.unsubscribe(m, kind, &name);
        }
        let n = counted(ctx, kind);
        confirm(ctx, what, Some(&name), n);
    }
}

pub(super) fn cmd_subscribe(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    subscribe(ctx, args, Kind::Channel, "subscribe")
}
pub(super) fn cmd_unsubscribe(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    unsubscribe(ctx, args, Kind::Channel, "unsubscribe")
}
pub(super) fn cmd_psubscribe(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    subscribe(ctx, args, Kind::Pattern, "psubscribe")
}
pub(super) fn cmd_punsubscribe(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    unsubscribe(ctx, args, Kind::Pattern, "punsubscribe")
}
pub(super) fn cmd_ssubscribe(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    if ctx.session.forwarded || (ctx.session.routed && ctx.session.member().is_some()) {
        return ctx.enc.error(
            "ERR SSUBSCRIBE is not supported through the routing port: subscribe at the channel's master (its cluster port)",
        );
    }
    subscribe(ctx, args, Kind::Shard, "ssubscribe")
}
pub(super) fn cmd_sunsubscribe(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    unsubscribe(ctx, args, Kind::Shard, "sunsubscribe")
}

/// PUBLISH channel message: this server's subscribers that received it. On a cluster server
/// (not a forwarded PUBLISH) it is also sent to every other server.
pub(super) fn cmd_publish(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let n = ctx.node.pubsub.publish(args[1], args[2], false);
    if !ctx.session.forwarded {
        if let Some(q) = ctx.node.pubsub.broadcast.get() {
            q.send(Broadcast::Publish, args[1], args[2]);
        }
    }
    ctx.enc.integer(n as i64)
}

/// The subscribers a PUBLISH or SPUBLISH request (outside MULTI) must wait for before it runs:
/// those still handling requests they sent before it ([`crate::node::pubsub::Input`]).
pub fn unsettled_before(
    node: &Node,
    session: &Session,
    args: &[&[u8]],
) -> Vec<std::sync::Arc<crate::node::pubsub::Input>> {
    if args.len() != 3 || session.multi.is_some() {
        return Vec::new();
    }
    let sharded = if args[0].eq_ignore_ascii_case(b"publish") {
        false
    } else if args[0].eq_ignore_ascii_case(b"spublish") {
        true
    } else {
        return Vec::new();
    };
    node.pubsub.unsettled(args[1], sharded)
}

/// RAMLOG.KEYEVENT channel message: another server's keyspace notification, for this server's
/// routing-port subscribers (sent by [`broadcaster`]); how many received it.
pub(super) fn cmd_ramlog_keyevent(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let n = ctx.node.pubsub.deliver_key_event(args[1], args[2]);
    ctx.enc.integer(n as i64)
}

/// SPUBLISH shardchannel message: the subscribers of the channel's slot's master.
pub(super) fn cmd_spublish(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let n = ctx.node.pubsub.publish(args[1], args[2], true);
    ctx.enc.integer(n as i64)
}

/// PUBSUB CHANNELS [pattern] | NUMSUB [channel ...] | NUMPAT | SHARDCHANNELS [pattern] |
/// SHARDNUMSUB [channel ...] (this server's subscribers, as in Redis Cluster)
pub(super) fn cmd_pubsub(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1].to_ascii_lowercase();
    let ps = &ctx.node.pubsub;
    match sub.as_slice() {
        b"channels" | b"shardchannels" if args.len() <= 3 => {
            let kind = if sub == b"channels" {
                Kind::Channel
            } else {
                Kind::Shard
            };
            let list = ps.channels(kind, args.get(2).copied());
            ctx.enc.array(list.len());
            for c in &list {
                ctx.enc.bulk(c);
            }
        }
        b"numsub" | b"shardnumsub" => {
            let kind = if sub == b"numsub" {
                Kind::Channel
            } else {
                Kind::Shard
            };
            let counts: Vec<usize> = args[2..].iter().map(|c| ps.subscribers(kind, c)).collect();
            // A flat array in both protocols, as Redis answers.
            ctx.enc.array(counts.len() * 2);
            for (c, n) in args[2..].iter().zip(counts) {
                ctx.enc.bulk(c);
                ctx.enc.integer(n as i64);
            }
        }
        b"numpat" if args.len() == 2 => {
            let n = ps.patterns();
            ctx.enc.integer(n as i64)
        }
        _ => unknown_subcommand(ctx, "pubsub", args[1]),
    }
}

/// Starts sending this cluster server's PUBLISHes and keyspace notifications to every other
/// server of the map, in the order this server took them, from one task.
pub fn start_broadcast(node: &Node, member: &std::sync::Arc<crate::cluster::Member>) {
    node.pubsub.broadcast.get_or_init(|| {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let queued = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let member = member.clone();
        let password = node.config.password.clone();
        tokio::spawn(broadcaster(rx, queued.clone(), member, password));
        crate::node::pubsub::BroadcastQueue {
            tx,
            queued,
            dropped: Default::default(),
        }
    });
}

/// Messages a broadcast batch carries at most.
const BROADCAST_BATCH: usize = 1024;

async fn broadcaster(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<(Broadcast, Vec<u8>, Vec<u8>)>,
    queued: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    member: std::sync::Arc<crate::cluster::Member>,
    password: Option<String>,
) {
    use ramlog_client::{Client, ClientConfig};
    use ramlog_proto::native::{Request, Response};
    let mut clients: HashMap<(ramlog_cluster::ServerId, std::net::SocketAddr), Client> =
        HashMap::new();
    let mut batch = Vec::new();
    while let Some(first) = rx.recv().await {
        batch.clear();
        batch.push(first);
        while batch.len() < BROADCAST_BATCH {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        let taken: usize = batch.iter().map(|(_, c, p)| c.len() + p.len()).sum();
        queued.fetch_sub(taken, std::sync::atomic::Ordering::Relaxed);
        let commands: Vec<Vec<&[u8]>> = batch
            .iter()
            .map(|(kind, c, p)| {
                let name: &[u8] = match kind {
                    Broadcast::Publish => b"PUBLISH",
                    Broadcast::KeyEvent => b"RAMLOG.KEYEVENT",
                };
                vec![name, c.as_slice(), p.as_slice()]
            })
            .collect();
        let peers: Vec<(ramlog_cluster::ServerId, std::net::SocketAddr)> = {
            let view = member.view();
            view.map
                .servers
                .iter()
                .filter(|s| s.id != view.me && s.state == ramlog_cluster::ServerState::Up)
                .map(|s| (s.id, s.addresses.native))
                .collect()
        };
        for peer in peers {
            if let std::collections::hash_map::Entry::Vacant(slot) = clients.entry(peer) {
                let mut config = ClientConfig::new(peer.1.to_string());
                config.password = password.clone().map(String::into_bytes);
                config.connections = 1;
                config.request_timeout = std::time::Duration::from_secs(5);
                config.retry_idempotent = false;
                match Client::connect(config).await {
                    Ok(c) => {
                        slot.insert(c);
                    }
                    Err(e) => {
                        tracing::debug!("PUBLISH to server {} not sent: {e}", peer.0);
                        continue;
                    }
                }
            }
            let request = Request::RespBatch {
                protocol: 2,
                commands: commands.clone(),
            };
            match clients[&peer].request(&request).await {
                Ok(Response::RespBatch(_)) => {}
                other => {
                    tracing::debug!("PUBLISH to server {} failed: {other:?}", peer.0);
                    clients.remove(&peer);
                }
            }
        }
    }
}
