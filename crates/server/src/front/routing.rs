//! The routing port: RESP for clients that know nothing of clusters. Any key on any server.
//!
//! Each request is routed by its keys' slots through the map this server holds:
//! - keys this server masters run here, through the same command layer as the RESP port;
//! - keys another server masters are forwarded to it over the native protocol (RESP_PASS: all the
//!   commands of one read for one server travel in one frame and run there in order);
//! - MGET, MSET, DEL, UNLINK and EXISTS over keys of several servers are split by server and their
//!   replies merged (MSET is then atomic per server, not across servers);
//! - DBSIZE, KEYS, FLUSHALL/FLUSHDB go to every server that masters slots, SCAN walks them one
//!   after the other (the cursor's low 8 bits name the server);
//! - connection commands (PING, HELLO, AUTH, CLIENT, CONFIG, INFO, ...) are answered here, and
//!   CLUSTER describes the routing port as one server holding every slot, which it is to its client;
//! - MULTI queues here; EXEC runs the queued commands through the same routing, in order, and
//!   answers their replies as one array (atomic when they all live on one server).
//!
//! Replies go back in request order. Commands for one key always reach the same server in the
//! order they were sent, so a pipeline keeps its meaning.
//!
//! When a slot's master fails, a request for it waits (at most `routing_recovery_wait_ms`) for
//! the map to name the slot's new master, then goes there, as a proxy in front of Redis Cluster
//! would: a request for a slot being recovered is held back unsent; one the master could not be
//! reached for (nothing was sent) or that its server refused (`-TRYAGAIN`, `-MOVED`, or
//! `-CLUSTERDOWN` past its lease: nothing was applied) is sent again once the map changed, or
//! after a pause that grows from 10 to 200 ms. A request that was sent and got no answer stays in
//! doubt (`-ERR ... outcome unknown`): sending it again could apply a write twice. One round
//! (one read's requests) routes by one version of the map, and a server that refuses a command
//! of a forwarded batch refuses the batch's later commands for the same slots, so that commands
//! for one key still run in the order they were sent.

use crate::cluster::membership::{ClusterView, LEASE_REFUSAL_PREFIX};
use crate::cluster::Member;
use crate::front::commands::{command_keys, execute, lookup, Session};
use crate::front::resp_conn::{request_limits, wait_input, Ending, Woke};
use crate::node::metrics::{BufferGauge, Metrics};
use crate::node::Node;
use bytes::Bytes;
use ramlog_client::{Request, Response};
use ramlog_cluster::ServerId;
use ramlog_common::key_slot;
use ramlog_proto::resp::{ReplyDecoder, ReplyEncoder, RequestDecoder};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const READ_CHUNK_BYTES: usize = 16 * 1024;

/// The pseudo-server of commands held back because their slot is being recovered: they are
/// never sent as they are, only routed again once the map names a master.
const HELD: ServerId = 0;

/// The first and the longest pause between two attempts to route again the requests whose
/// master failed, when the map has not changed meanwhile.
const RETRY_PAUSE_MIN: Duration = Duration::from_millis(10);
const RETRY_PAUSE_MAX: Duration = Duration::from_millis(200);

/// A reply being assembled.
enum Part {
    Ready(Vec<u8>),
    /// A reply of a command run here, at this range of the round's local buffer; `write`: the
    /// reply of a write, replaced by `-MISCONF` if its acknowledgement point fails.
    Local {
        range: std::ops::Range<usize>,
        write: bool,
    },
    /// The `index`-th command sent to server `peer` in this round.
    Remote {
        peer: ServerId,
        index: usize,
    },
    /// Integer replies added up (DEL, EXISTS, UNLINK, DBSIZE).
    Sum(Vec<Part>),
    /// MGET split by server: each piece's elements go to the given positions.
    Mget {
        pieces: Vec<(Part, Vec<usize>)>,
        total: usize,
    },
    /// +OK when every piece is +OK, else the first other reply (MSET, FLUSHALL).
    AllOk(Vec<Part>),
    /// Arrays concatenated (KEYS).
    Concat(Vec<Part>),
    /// One of the parts' replies that is not null, at random (RANDOMKEY: each master's random
    /// key); null when all are; the first error if any.
    AnyOf(Vec<Part>),
    /// One array of the parts' replies (EXEC).
    Array(Vec<Part>),
    /// INFO: this server's text with the keyspace line summed over every server's.
    Info {
        text: String,
        others: Vec<Part>,
    },
    /// A SCAN reply from server number `index` of `servers`: the cursor is rewritten.
    Scan {
        part: Box<Part>,
        index: u64,
        servers: u64,
    },
}

/// Commands for one server, as RESP arrays back to back in one buffer: a command forwarded as its
/// client sent it is copied once, its bytes unchanged (RESP_PASS); one the routing port made (a
/// piece of a split MGET, a SCAN with its cursor rewritten) is encoded into it.
#[derive(Default, Clone)]
struct Outgoing {
    data: Vec<u8>,
    /// Where each command ends in `data`.
    ends: Vec<usize>,
    /// Each command's slot: that of its first key (of the one being recovered, for a command
    /// held back); None for a command addressed to the server itself (DBSIZE, KEYS, SCAN, ...),
    /// which is never routed again.
    slots: Vec<Option<u16>>,
}

impl Outgoing {
    /// Adds a command: `raw`, its client's RESP array when it goes unchanged, else `args`
    /// encoded.
    fn push(&mut self, args: &[&[u8]], raw: Option<&[u8]>, slot: Option<u16>) -> usize {
        match raw {
            Some(raw) => self.data.extend_from_slice(raw),
            None => ramlog_proto::resp::encode_command(&mut self.data, args),
        }
        self.ends.push(self.data.len());
        self.slots.push(slot);
        self.ends.len() - 1
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    fn start(&self, index: usize) -> usize {
        if index == 0 {
            0
        } else {
            self.ends[index - 1]
        }
    }

    /// Command `index`'s arguments.
    fn command(&self, index: usize) -> Vec<Vec<u8>> {
        let resp = &self.data[self.start(index)..self.ends[index]];
        ramlog_proto::native::resp_pass_commands(1, resp)
            .ok()
            .and_then(|mut c| c.pop())
            .map(|args| args.into_iter().map(<[u8]>::to_vec).collect())
            .unwrap_or_default()
    }

    /// The RESP bytes of the commands from number `first` on.
    fn resp_from(&self, first: usize) -> &[u8] {
        &self.data[self.start(first)..]
    }
}

/// One read's worth of requests: the replies being assembled, the replies of commands run here,
/// the commands to forward, and the map they are routed
/// by.
struct Round {
    parts: Vec<Part>,
    local: Vec<u8>,
    outgoing: BTreeMap<ServerId, Outgoing>,
    /// The map every request of the round is routed by (loaded by the first): commands for one
    /// key all go the same way.
    view: Option<Arc<ClusterView>>,
    /// For each part that answers a client's command, that command's index in the command
    /// table, counted in the routing port's INFO commandstats once its reply is written.
    counted: Vec<Option<usize>>,
    started: Instant,
}

impl Round {
    fn new() -> Round {
        Round {
            parts: Vec::new(),
            local: Vec::new(),
            outgoing: BTreeMap::new(),
            view: None,
            counted: Vec::new(),
            started: Instant::now(),
        }
    }

    fn forward(
        &mut self,
        peer: ServerId,
        args: &[&[u8]],
        raw: Option<&[u8]>,
        slot: Option<u16>,
    ) -> Part {
        let index = self.outgoing.entry(peer).or_default().push(args, raw, slot);
        Part::Remote { peer, index }
    }

    fn view(&mut self, member: &Member) -> Arc<ClusterView> {
        self.view
            .get_or_insert_with(|| Arc::clone(&member.view()))
            .clone()
    }
}

struct Router<'a> {
    node: &'a Arc<Node>,
    session: Session,
    /// Local replies to writes, waiting for the acknowledgement point.
    local_writes: bool,
}

fn error_reply(protocol: u8, message: &str) -> Vec<u8> {
    let mut out = Vec::new();
    ReplyEncoder::new(&mut out, protocol).error(message);
    out
}

impl Router<'_> {
    /// Runs a command here, as the RESP port would; its reply goes to the round's local buffer.
    fn local(&mut self, round: &mut Round, args: &[&[u8]]) -> Part {
        let start = round.local.len();
        execute(self.node, &mut self.session, args, &mut round.local);
        let write = !self.session.write_replies.is_empty();
        if write {
            self.session.write_replies.clear();
            self.local_writes = true;
        }
        Part::Local {
            range: start..round.local.len(),
            write,
        }
    }

    /// Where `args` go: here, or to server `owner`; `slot`: that of the command's first key;
    /// `raw`: the command's RESP array as its client sent it, when `args` are its arguments.
    fn send_to(
        &mut self,
        round: &mut Round,
        owner: ServerId,
        args: &[&[u8]],
        raw: Option<&[u8]>,
        slot: Option<u16>,
    ) -> Part {
        let me = self.session.member().map_or(0, |m| m.view().me);
        if owner == 0 {
            Part::Ready(error_reply(
                self.session.protocol,
                "CLUSTERDOWN Hash slot not served",
            ))
        } else if owner == me {
            self.local(round, args)
        } else {
            round.forward(owner, args, raw, slot)
        }
    }

    /// Routes one request into a reply part; `raw`: the request's RESP array as its client sent
    /// it (None for an inline command, or one the routing port made), forwarded unchanged when
    /// the request goes to one server whole.
    fn route(&mut self, round: &mut Round, args: &[&[u8]], raw: Option<&[u8]>) -> Part {
        let Some(member) = self.session.member().cloned() else {
            return self.local(round, args);
        };
        let spec = lookup(args[0]);
        let in_multi = self.session.multi.is_some();
        let Some(spec) = spec else {
            return self.local(round, args);
        };
        // Errors, authentication, transactions being queued, connection commands: here.
        if !self.session.authenticated || !crate::front::commands::arity_ok(spec.arity, args.len())
        {
            return self.local(round, args);
        }
        // A script this server runs has run long: the routing port is busy as the one server
        // its client believes it talks to would be, and answers `-BUSY` here (EXEC: the
        // transaction is discarded), except for the commands Redis serves meanwhile.
        if crate::front::commands::script_busy(self.node)
            && !crate::front::commands::allows_busy(Some(spec), args)
        {
            return self.local(round, args);
        }
        if spec.name == "exec" && in_multi && !self.session.multi_failed {
            let queued = self.session.multi.take().unwrap_or_default();
            let parts = queued
                .iter()
                .map(|cmd| {
                    let args: Vec<&[u8]> = cmd.iter().map(|a| a.as_slice()).collect();
                    self.route(round, &args, None)
                })
                .collect();
            return Part::Array(parts);
        }
        if in_multi {
            return self.local(round, args);
        }
        let view = round.view(&member);
        let servers = view.masters();
        let mut to_every_master = |router: &mut Self| -> Vec<Part> {
            servers
                .iter()
                .map(|&s| router.send_to(round, s, args, raw, None))
                .collect()
        };
        match spec.name {
            "dbsize" => return Part::Sum(to_every_master(self)),
            "keys" => return Part::Concat(to_every_master(self)),
            "randomkey" => return Part::AnyOf(to_every_master(self)),
            "flushall" | "flushdb" => return Part::AllOk(to_every_master(self)),
            // Scripts are loaded on (and flushed from) every master, so that EVALSHA finds its
            // script wherever its keys are. LOAD answers the first reply that is not +OK: the SHA1.
            "script"
                if args.len() >= 2
                    && (args[1].eq_ignore_ascii_case(b"load")
                        || args[1].eq_ignore_ascii_case(b"flush")) =>
            {
                return Part::AllOk(to_every_master(self))
            }
            // The encoding thresholds and keyspace notifications are each server's: a proxy's
            // client sets them on every master, as on the one Redis it believes it talks to.
            "config" if args.len() >= 2 && args[1].eq_ignore_ascii_case(b"set") => {
                return Part::AllOk(to_every_master(self))
            }
            "info" => {
                let section = args.get(1).map(|s| String::from_utf8_lossy(s).into_owned());
                // Its blocked clients are the routing port's own (see
                // `Metrics::routed_blocked_clients`).
                let mut snapshot = self.node.snapshot();
                snapshot.commands = self
                    .node
                    .metrics
                    .routed_command_stats
                    .read(crate::front::commands::stat_names().iter().copied());
                snapshot.blocked_clients = self
                    .node
                    .metrics
                    .routed_blocked_clients
                    .load(std::sync::atomic::Ordering::Relaxed);
                (snapshot.blocking_keys, snapshot.blocking_keys_on_nokey) =
                    self.node.routed_waiters.held_keys();
                snapshot.error_codes = self.node.metrics.routed_error_stats.read();
                snapshot.errors = snapshot.error_codes.iter().map(|(_, n)| n).sum();
                snapshot.errors_at_reset = 0;
                let text = snapshot.info(section.as_deref(), false);
                let me = view.me;
                // The keyspace and the changes since the last save are the whole cluster's,
                // as of the one Redis the client believes it talks to.
                let mut wanted: Vec<[&[u8]; 2]> = Vec::new();
                if text.contains("# Keyspace") {
                    wanted.push([b"info", b"keyspace"]);
                }
                if text.contains(CHANGES_FIELD) {
                    wanted.push([b"info", b"persistence"]);
                }
                let mut others = Vec::new();
                for &s in servers.iter().filter(|&&s| s != me) {
                    for w in &wanted {
                        others.push(self.send_to(round, s, w, None, None));
                    }
                }
                return Part::Info { text, others };
            }
            "scan" => {
                let Some(cursor) = std::str::from_utf8(args[1])
                    .ok()
                    .and_then(|c| c.parse::<u64>().ok())
                else {
                    return self.local(round, args);
                };
                let index = cursor & 0xff;
                let Some(&server) = servers.get(index as usize) else {
                    if servers.is_empty() {
                        return self.local(round, args);
                    }
                    return Part::Ready(error_reply(self.session.protocol, "ERR invalid cursor"));
                };
                let inner = (cursor >> 8).to_string();
                let mut forwarded: Vec<&[u8]> = args.to_vec();
                forwarded[1] = inner.as_bytes();
                let part = self.send_to(round, server, &forwarded, None, None);
                return Part::Scan {
                    part: Box::new(part),
                    index,
                    servers: servers.len() as u64,
                };
            }
            _ => {}
        }
        if !spec.has_keys() {
            return self.local(round, args);
        }
        let step = spec.step.max(1) as usize;
        let first_arg = spec.first_key as usize;
        // A key without its values (MSET a 1 b): the command's own check answers it.
        if spec.last_key < 0 && !(args.len() - first_arg).is_multiple_of(step) {
            return self.local(round, args);
        }
        // Each key's slot, computed once.
        let keys: Vec<(&[u8], u16)> = command_keys(spec, args).map(|k| (k, key_slot(k))).collect();
        let Some(&(_, first_slot)) = keys.first() else {
            return self.local(round, args);
        };
        // A slot whose tablet waits for memory has no server to go to: say why here.
        let waiting = keys.iter().find_map(|&(_, slot)| {
            view.waiting_reason(slot)
                .map(|why| crate::cluster::Route::waiting_error(slot, why))
        });
        if let Some(error) = waiting {
            return Part::Ready(error_reply(self.session.protocol, &error));
        }
        // A slot being recovered has no server either: the request waits for one (see the
        // module comment).
        if let Some(&(key, slot)) = keys.iter().find(|&&(_, s)| view.is_recovering(s)) {
            member.ask_for(self.node, &view, slot, key);
            return round.forward(HELD, args, raw, Some(slot));
        }
        let owner = view.owner(first_slot);
        if keys.iter().all(|&(_, slot)| view.owner(slot) == owner) {
            drop(view);
            return self.send_to(round, owner, args, raw, Some(first_slot));
        }
        // Keys on several servers: split the command by server.
        let mut by_owner: BTreeMap<ServerId, Vec<usize>> = BTreeMap::new();
        for (i, &(_, slot)) in keys.iter().enumerate() {
            by_owner
                .entry(view.owner(slot))
                .or_default()
                .push(first_arg + i * step);
        }
        drop(view);
        let split = |positions: &[usize]| {
            let mut sub: Vec<&[u8]> = vec![args[0]];
            for &p in positions {
                sub.extend_from_slice(&args[p..p + step]);
            }
            (sub, Some(key_slot(args[positions[0]])))
        };
        match spec.name {
            "mget" => {
                let pieces = by_owner
                    .iter()
                    .map(|(&owner, positions)| {
                        let (sub, slot) = split(positions);
                        let part = self.send_to(round, owner, &sub, None, slot);
                        (part, positions.iter().map(|p| p - first_arg).collect())
                    })
                    .collect();
                Part::Mget {
                    pieces,
                    total: keys.len(),
                }
            }
            "mset" => Part::AllOk(
                by_owner
                    .iter()
                    .map(|(&owner, positions)| {
                        let (sub, slot) = split(positions);
                        self.send_to(round, owner, &sub, None, slot)
                    })
                    .collect(),
            ),
            "del" | "unlink" | "exists" => Part::Sum(
                by_owner
                    .iter()
                    .map(|(&owner, positions)| {
                        let (sub, slot) = split(positions);
                        self.send_to(round, owner, &sub, None, slot)
                    })
                    .collect(),
            ),
            _ => Part::Ready(error_reply(
                self.session.protocol,
                "CROSSSLOT Keys in request don't hash to the same slot",
            )),
        }
    }
}

/// Serves one routing-port connection (see the module comment).
pub async fn serve_routing(
    mut stream: TcpStream,
    node: Arc<Node>,
    cluster: Option<Arc<crate::cluster::Roles>>,
    client_id: u64,
) -> Ending {
    let _ = stream.set_nodelay(true);
    let config = &node.config;
    let mut session = Session::new(client_id, node.password_required(), cluster);
    session.addr = stream.peer_addr().ok();
    session.laddr = stream.local_addr().ok();
    session.routed = true;
    let node_ref = &node;
    let mut router = Router {
        node: &node,
        session,
        local_writes: false,
    };
    let decoder = RequestDecoder::new(request_limits(config));
    let mut request = ramlog_proto::resp::Request::default();
    let mut inbuf: Vec<u8> = Vec::with_capacity(READ_CHUNK_BYTES);
    let mut out: Vec<u8> = Vec::with_capacity(READ_CHUNK_BYTES);
    let idle =
        (config.idle_timeout_secs > 0).then(|| Duration::from_secs(config.idle_timeout_secs));
    let write_timeout = Duration::from_secs(config.write_timeout_secs.max(1));
    let depth_max = config.pipeline_depth_max;
    let mut buffers = BufferGauge::new(&node.metrics);
    loop {
        match wait_input(
            &mut stream,
            &mut inbuf,
            idle,
            &node.metrics,
            &mut router.session,
            &mut out,
        )
        .await
        {
            Ok(Woke::Input) => {}
            Ok(Woke::Delivered) => {
                if let Err(ending) = write_out(&mut stream, &mut out, write_timeout).await {
                    return ending;
                }
                continue;
            }
            Err(ending) => return ending,
        }
        buffers.update(inbuf.capacity() + out.capacity());
        let mut pos = 0;
        let mut fatal = None;
        loop {
            let mut round = Round::new();
            let mut closing = false;
            while pos < inbuf.len() && round.parts.len() < depth_max {
                match decoder.decode(&inbuf[pos..], &mut request) {
                    Ok(Some(used)) => {
                        if !request.is_empty() {
                            let args = request.args(&inbuf[pos..]);
                            if crate::front::analytic::is_analytic(args[0]) {
                                // A scan across servers runs here, after what came before it.
                                if !round.parts.is_empty() {
                                    break;
                                }
                                let (from, started) = (out.len(), Instant::now());
                                crate::front::analytic::run(
                                    node_ref,
                                    &mut router.session,
                                    &args,
                                    &mut out,
                                )
                                .await;
                                count_routed(node_ref, &args, started.elapsed(), &out[from..]);
                                pos += used;
                                continue;
                            }
                            if crate::front::blocking::is_blocking(&args)
                                && router.session.multi.is_none()
                            {
                                // A blocking command runs alone, after what came before it.
                                if !round.parts.is_empty() {
                                    break;
                                }
                                let owned: Vec<Vec<u8>> = args.iter().map(|a| a.to_vec()).collect();
                                let args: Vec<&[u8]> = owned.iter().map(|a| a.as_slice()).collect();
                                let mut ahead = Vec::new();
                                let from = out.len();
                                let done = routed_blocking(
                                    &mut router,
                                    &args,
                                    &mut out,
                                    &mut stream,
                                    &mut ahead,
                                )
                                .await;
                                // Its wait is not counted in its time, as in Redis.
                                count_routed(node_ref, &args, Duration::ZERO, &out[from..]);
                                inbuf.extend_from_slice(&ahead);
                                if let Err(ending) = done {
                                    return ending;
                                }
                                pos += used;
                                continue;
                            }
                            // WATCH, and EXEC after it: the watched keys' versions are read at
                            // their masters (the connections to them are shared, so no master
                            // keeps this client's watch), alone, after what came before.
                            // The command, looked up once for what follows.
                            let found = crate::front::commands::lookup_at(args[0]);
                            let name = found.map(|(_, s)| s.name);
                            let watching = name == Some("watch")
                                && router.session.multi.is_none()
                                && router.session.authenticated;
                            let exec_watched = name == Some("exec")
                                && router.session.multi.is_some()
                                && !router.session.watched.is_empty();
                            if watching || exec_watched {
                                if !round.parts.is_empty() {
                                    break;
                                }
                                let owned: Vec<Vec<u8>> = args.iter().map(|a| a.to_vec()).collect();
                                let args: Vec<&[u8]> = owned.iter().map(|a| a.as_slice()).collect();
                                if watching {
                                    let (from, started) = (out.len(), Instant::now());
                                    routed_watch(&mut router, &args, &mut out).await;
                                    count_routed(node_ref, &args, started.elapsed(), &out[from..]);
                                    pos += used;
                                    continue;
                                }
                                if !routed_watch_holds(&mut router, &mut out).await {
                                    pos += used;
                                    continue;
                                }
                            }
                            // A PUBLISH waits for subscribers still handling what they sent
                            // before it, after what this client sent before it.
                            let waiting = crate::front::commands::pubsub::unsettled_before(
                                node_ref,
                                &router.session,
                                &args,
                            );
                            if !waiting.is_empty() {
                                if !round.parts.is_empty() {
                                    break;
                                }
                                crate::node::pubsub::PubSub::settle(waiting).await;
                            }
                            // A change of protocol or identity applies to what follows it only:
                            // what is already routed goes out first.
                            let barrier = matches!(name, Some("hello" | "auth"));
                            if barrier && !round.outgoing.is_empty() {
                                break;
                            }
                            let raw = (!request.is_inline()).then(|| &inbuf[pos..pos + used]);
                            let part = router.route(&mut round, &args, raw);
                            round.parts.push(part);
                            round.counted.resize(round.parts.len() - 1, None);
                            round.counted.push(found.map(|(index, _)| {
                                crate::front::commands::stat_index(index, &args)
                            }));
                        }
                        pos += used;
                        if router.session.closing {
                            closing = true;
                            break;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        fatal = Some(e);
                        break;
                    }
                }
            }
            if round.parts.is_empty() {
                // An analytic command's reply may wait in `out`.
                if !out.is_empty() {
                    if let Err(ending) = write_out(&mut stream, &mut out, write_timeout).await {
                        return ending;
                    }
                }
                break;
            }
            resolve(&mut router, round, &mut out).await;
            if let Err(ending) = write_out(&mut stream, &mut out, write_timeout).await {
                return ending;
            }
            if closing {
                return Ending::Quit;
            }
            if fatal.is_some() || pos >= inbuf.len() {
                break;
            }
        }
        inbuf.drain(..pos);
        if let Some(e) = &fatal {
            Metrics::add(&node.metrics.protocol_errors, 1);
            ReplyEncoder::new(&mut out, router.session.protocol).error(&e.message());
            let _ = write_out(&mut stream, &mut out, write_timeout).await;
            return Ending::ProtocolError;
        }
    }
}

/// The versions of `keys` at their masters (None: absent), read with RAMLOG.VERSIONS.
async fn versions_at_masters(
    router: &mut Router<'_>,
    keys: &[Vec<u8>],
) -> Result<Vec<Option<u64>>, String> {
    let mut round = Round::new();
    for key in keys {
        let args: [&[u8]; 2] = [b"ramlog.versions", key];
        let part = router.route(&mut round, &args, None);
        round.parts.push(part);
    }
    let mut replies = Vec::new();
    resolve(router, round, &mut replies).await;
    let decoder = ramlog_proto::resp::ReplyDecoder::default();
    let mut at = 0;
    let mut out = Vec::with_capacity(keys.len());
    for _ in keys {
        let (reply, used) = match decoder.decode(&replies[at..]) {
            Ok(Some(r)) => r,
            _ => {
                return Err("ERR a master answered a version lookup with a malformed reply".into())
            }
        };
        at += used;
        match reply {
            ramlog_proto::resp::Reply::Array(mut v) if v.len() == 1 => match v.pop() {
                Some(ramlog_proto::resp::Reply::Integer(n)) => out.push(Some(n as u64)),
                Some(ramlog_proto::resp::Reply::Null) => out.push(None),
                other => return Err(format!("ERR unexpected version reply {other:?}")),
            },
            ramlog_proto::resp::Reply::Error(e) => return Err(e),
            other => return Err(format!("ERR unexpected version reply {other:?}")),
        }
    }
    Ok(out)
}

/// WATCH through the routing port: records each key's version at its master.
async fn routed_watch(router: &mut Router<'_>, args: &[&[u8]], out: &mut Vec<u8>) {
    let protocol = router.session.protocol;
    if !crate::front::commands::arity_ok(-2, args.len()) {
        ReplyEncoder::new(out, protocol).error("ERR wrong number of arguments for 'watch' command");
        return;
    }
    let keys: Vec<Vec<u8>> = args[1..]
        .iter()
        .filter(|k| !router.session.watched.iter().any(|(w, _)| w == *k))
        .map(|k| k.to_vec())
        .collect();
    match versions_at_masters(router, &keys).await {
        Ok(versions) => {
            router
                .session
                .watched
                .extend(keys.into_iter().zip(versions));
            ReplyEncoder::new(out, protocol).ok();
        }
        Err(e) => ReplyEncoder::new(out, protocol).error(&e),
    }
}

/// Before an EXEC through the routing port: whether every watched key still has the version
/// WATCH read (then the EXEC goes on). Otherwise the transaction is dropped and its null reply
/// (or the lookup's error) written. The watch is over either way.
async fn routed_watch_holds(router: &mut Router<'_>, out: &mut Vec<u8>) -> bool {
    let protocol = router.session.protocol;
    let watched = std::mem::take(&mut router.session.watched);
    if router.session.multi_failed {
        return true;
    }
    let keys: Vec<Vec<u8>> = watched.iter().map(|(k, _)| k.clone()).collect();
    // The lookup is not part of the transaction: it runs with the queue set aside.
    let queued = router.session.multi.take();
    match versions_at_masters(router, &keys).await {
        Ok(now) if now.iter().zip(&watched).all(|(n, (_, w))| n == w) => {
            router.session.multi = queued;
            true
        }
        Ok(_) => {
            ReplyEncoder::new(out, protocol).null_array();
            false
        }
        Err(e) => {
            ReplyEncoder::new(out, protocol).error(&e);
            false
        }
    }
}

/// A blocking command through the routing port. Tried first as any command (which waits out
/// a recovery and follows a move); if its keys, all of one slot, hold nothing, it blocks at
/// their master ([`blocked_at_master`]). A command over keys of several slots, which no one
/// master can block (BLPOP over queues of several servers, BLMOVE between them), is tried
/// again every [`crate::front::blocking::ROUTED_RETRY_INTERVAL`] while it answers the null of
/// "nothing yet", until its timeout; BLPOP, BRPOP, BZPOPMIN, BZPOPMAX, BLMPOP and BZMPOP then
/// try each key's master in turn.
async fn routed_blocking(
    router: &mut Router<'_>,
    args: &[&[u8]],
    out: &mut Vec<u8>,
    stream: &mut TcpStream,
    read_ahead: &mut Vec<u8>,
) -> Result<(), Ending> {
    use crate::front::blocking::{
        deadline_of, is_null, pause, retry_ends, Blocked, ROUTED_RETRY_INTERVAL,
    };
    let deadline = deadline_of(args);
    let before = out.len();
    // BLPOP, BRPOP, BZPOPMIN, BZPOPMAX, BLMPOP and BZMPOP over keys of several slots (as queue
    // libraries block on several queues): each try asks each key's master in turn, the keys in their order, and
    // the first key with an element answers. Each key's pop is atomic; the order among keys is
    // as of each ask, not one instant.
    let per_key = per_key_commands(args).filter(|commands| {
        let slot = |c: &Vec<&[u8]>| command_slot(c);
        commands.iter().any(|c| slot(c) != slot(&commands[0]))
    });
    // Keys of one slot block at their master; over several slots (BLMOVE between two queues
    // of different slots, which the routing port moves across servers), the command is tried
    // again here.
    let one_slot = crate::front::commands::lookup(args[0]).is_some_and(|spec| {
        let mut slots = command_keys(spec, args).map(key_slot);
        let first = slots.next();
        first.is_some() && slots.all(|s| Some(s) == first)
    });
    if one_slot {
        return blocked_at_master(router, args, deadline, out, stream, read_ahead).await;
    }
    if args[0].eq_ignore_ascii_case(b"xread") && args.contains(&&b"$"[..]) {
        // `$` must be read at each stream's master when the command arrives; give the ids.
        ReplyEncoder::new(out, router.session.protocol).error(
            "ERR XREAD BLOCK with $ over streams of several slots is not supported through the routing port: pass each stream's last id",
        );
        return Ok(());
    }
    let node = router.node.clone();
    let mut blocked = None;
    // This server's routing-port clients blocked on these keys queue in the order they blocked;
    // only the first on a key tries the master, and passes the turn when it leaves.
    // The keys it waits on: BLMOVE's and BRPOPLPUSH's destination is not one of them.
    let moves =
        args[0].eq_ignore_ascii_case(b"blmove") || args[0].eq_ignore_ascii_case(b"brpoplpush");
    let keys: Vec<Vec<u8>> = match crate::front::commands::lookup(args[0]) {
        Some(spec) => command_keys(spec, args)
            .take(if moves { 1 } else { usize::MAX })
            .map(<[u8]>::to_vec)
            .collect(),
        None => Vec::new(),
    };
    let mut queued: Option<Queued> = None;
    // Once blocked: CLIENT UNBLOCK of this routing-port client (sent to this routing port)
    // ends its wait, wherever its keys live.
    let mut unblock: Option<crate::front::blocking::ClientHandle> = None;
    let mut null_reply: Vec<u8> = Vec::new();
    loop {
        if unblocked(unblock.as_ref(), &null_reply, out) {
            return Ok(());
        }
        let turn = queued
            .as_ref()
            .is_none_or(|q| node.routed_waiters.is_first(&q.keys, &q.notify));
        if !turn {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                out.extend_from_slice(&null_reply);
                return Ok(());
            }
            let notify = queued.as_ref().map(|q| q.notify.clone());
            pause(
                deadline,
                QUEUED_RECHECK,
                notify.as_deref(),
                stream,
                read_ahead,
            )
            .await?;
            continue;
        }
        if let Some(commands) = &per_key {
            for one in commands {
                let mut round = Round::new();
                let part = router.route(&mut round, one, None);
                round.parts.push(part);
                resolve(router, round, out).await;
                if !is_null(&out[before..]) {
                    break;
                }
                out.truncate(before);
            }
        } else {
            let mut round = Round::new();
            let part = router.route(&mut round, args, None);
            round.parts.push(part);
            resolve(router, round, out).await;
        }
        if out.len() == before {
            // Every key answered null: stand for that answer if this is the last try.
            ReplyEncoder::new(out, router.session.protocol).null_array();
        }
        let ends = if blocked.is_none() {
            !is_null(&out[before..])
        } else {
            retry_ends(args, &out[before..])
        };
        if ends || deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(());
        }
        if queued.is_none() {
            null_reply = out[before..].to_vec();
            let q = Queued {
                node: &node,
                keys: keys.clone(),
                notify: Arc::new(tokio::sync::Notify::new()),
            };
            node.routed_waiters.register(&q.keys, &q.notify);
            unblock = Some(crate::front::blocking::ClientHandle::new(
                &node,
                router.session.id,
                &q.notify,
            ));
            queued = Some(q);
        }
        blocked.get_or_insert_with(|| Blocked::routed(&node, args));
        out.truncate(before);
        let notify = queued.as_ref().map(|q| q.notify.clone());
        pause(
            deadline,
            ROUTED_RETRY_INTERVAL,
            notify.as_deref(),
            stream,
            read_ahead,
        )
        .await?;
    }
}

/// Whether CLIENT UNBLOCK ended the wait of the routing-port client (`unblock`, once it is
/// blocked): then its reply (`null_reply`, or `-UNBLOCKED`) is in `out`.
fn unblocked(
    unblock: Option<&crate::front::blocking::ClientHandle>,
    null_reply: &[u8],
    out: &mut Vec<u8>,
) -> bool {
    match unblock.and_then(|u| u.unblocked_reply(null_reply)) {
        Some(reply) => {
            out.extend_from_slice(&reply);
            true
        }
        None => false,
    }
}

/// A pop over several keys as one command per key, in the keys' order, each blocking on its
/// key alone: BLPOP, BRPOP, BZPOPMIN and BZPOPMAX (`CMD key timeout`), BLMPOP and BZMPOP
/// (`CMD timeout 1 key` and the rest of their arguments). None for other commands, or
/// arguments their own checks refuse.
fn per_key_commands<'a>(args: &[&'a [u8]]) -> Option<Vec<Vec<&'a [u8]>>> {
    let name = args[0].to_ascii_lowercase();
    match name.as_slice() {
        b"blpop" | b"brpop" | b"bzpopmin" | b"bzpopmax" if args.len() > 3 => {
            let timeout = args[args.len() - 1];
            Some(
                args[1..args.len() - 1]
                    .iter()
                    .map(|k| vec![args[0], k, timeout])
                    .collect(),
            )
        }
        b"blmpop" | b"bzmpop" if args.len() > 4 => {
            let n: usize = std::str::from_utf8(args[2]).ok()?.parse().ok()?;
            if n < 2 || args.len() < 3 + n + 1 {
                return None;
            }
            let rest = &args[3 + n..];
            Some(
                args[3..3 + n]
                    .iter()
                    .map(|k| {
                        let mut one = vec![args[0], args[1], b"1".as_slice(), k];
                        one.extend_from_slice(rest);
                        one
                    })
                    .collect(),
            )
        }
        _ => None,
    }
}

/// The slot of a command's first key.
fn command_slot(args: &[&[u8]]) -> Option<u16> {
    crate::front::commands::lookup(args[0])
        .and_then(|spec| command_keys(spec, args).next())
        .map(key_slot)
}

/// A blocking command whose keys live in one slot, through the routing port: one try as any
/// command; if that answers the null of "nothing yet", the command waits at the keys' master,
/// on a connection of its own to its RESP port ([`crate::front::blocking::block_at_master`]), as
/// a Redis Cluster client's would: among that master's blocked clients, in the order they
/// blocked, and served by the write that gives it something, at once. If the master goes (it
/// fails, the slot moves, the connection breaks) the command is routed again, with the time
/// left. XREAD's `$` is resolved by the master, when the command reaches it.
async fn blocked_at_master(
    router: &mut Router<'_>,
    args: &[&[u8]],
    deadline: Option<Instant>,
    out: &mut Vec<u8>,
    stream: &mut TcpStream,
    read_ahead: &mut Vec<u8>,
) -> Result<(), Ending> {
    use crate::front::blocking::{
        block_at_master, is_null, pause, retry_ends, with_time_left, AtMaster, ClientHandle,
        ROUTED_RETRY_INTERVAL,
    };
    let before = out.len();
    let node = router.node.clone();
    let notify = Arc::new(tokio::sync::Notify::new());
    let mut unblock: Option<ClientHandle> = None;
    let slot = command_slot(args);
    // A try here would read `$` as "after the last entry now", not when the master gets it.
    let dollar = args[0].eq_ignore_ascii_case(b"xread") && args.contains(&&b"$"[..]);
    let mut tried = false;
    let mut null_reply = Vec::new();
    ReplyEncoder::new(&mut null_reply, router.session.protocol).null_array();
    loop {
        if unblocked(unblock.as_ref(), &null_reply, out) {
            return Ok(());
        }
        if !dollar {
            let mut round = Round::new();
            let part = router.route(&mut round, args, None);
            round.parts.push(part);
            resolve(router, round, out).await;
            if out.len() == before {
                out.extend_from_slice(&null_reply);
            }
            let ends = if tried {
                retry_ends(args, &out[before..])
            } else {
                !is_null(&out[before..])
            };
            tried = true;
            if ends || deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(());
            }
            null_reply = out[before..].to_vec();
            out.truncate(before);
        }
        let unblock =
            unblock.get_or_insert_with(|| ClientHandle::new(&node, router.session.id, &notify));
        let Some(timed) = with_time_left(args, deadline) else {
            out.extend_from_slice(&null_reply);
            return Ok(());
        };
        let member = router.session.member().cloned();
        let master = match (&member, slot) {
            (Some(m), Some(slot)) => {
                let view = m.view();
                let owner = view.owner(slot);
                view.map.server(owner).map(|s| (owner, s.addresses.resp))
            }
            _ => None,
        };
        if let (Some(member), Some(slot), Some((owner, address))) = (member, slot, master) {
            let timed: Vec<&[u8]> = timed.iter().map(|a| a.as_slice()).collect();
            let still_master = move || member.view().owner(slot) == owner;
            match block_at_master(
                &node,
                address,
                router.session.protocol,
                &timed,
                unblock,
                &notify,
                still_master,
                stream,
                read_ahead,
            )
            .await?
            {
                AtMaster::Answered(reply) => {
                    out.extend_from_slice(&reply);
                    return Ok(());
                }
                AtMaster::Again => {}
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            out.extend_from_slice(&null_reply);
            return Ok(());
        }
        pause(
            deadline,
            ROUTED_RETRY_INTERVAL,
            Some(&notify),
            stream,
            read_ahead,
        )
        .await?;
    }
}

/// How often a routing-port client that waits behind others on its keys looks again whether
/// its turn came (a client ahead that leaves wakes it at once).
const QUEUED_RECHECK: Duration = Duration::from_millis(500);

/// A routing-port client's place in [`Node::routed_waiters`]: when it leaves (served, timed
/// out, closed), the next client on each of its keys gets the turn.
struct Queued<'a> {
    node: &'a Node,
    keys: Vec<Vec<u8>>,
    notify: Arc<tokio::sync::Notify>,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.node
            .routed_waiters
            .unregister_and_pass(&self.keys, &self.notify);
    }
}

async fn write_out(
    stream: &mut TcpStream,
    out: &mut Vec<u8>,
    timeout: Duration,
) -> Result<(), Ending> {
    if out.is_empty() {
        return Ok(());
    }
    match tokio::time::timeout(timeout, stream.write_all(out)).await {
        Ok(Ok(())) => {
            out.clear();
            Ok(())
        }
        Ok(Err(_)) => Err(Ending::IoError),
        Err(_) => Err(Ending::WriteTimeout),
    }
}

/// Sends every server its commands, waits for all replies (routing again those whose master
/// failed, see the module comment, and waiting for the acknowledgement point of writes run
/// here), and appends the replies in request order.
async fn resolve(router: &mut Router<'_>, mut round: Round, out: &mut Vec<u8>) {
    let protocol = router.session.protocol;
    let node = router.node;
    let mut replies: HashMap<ServerId, Vec<Reply>> = HashMap::new();
    let mut rerouted: HashMap<(ServerId, usize), Part> = HashMap::new();
    if !round.outgoing.is_empty() {
        send(router, &mut round, &mut replies).await;
        router
            .reroute(&mut round, &mut replies, &mut rerouted)
            .await;
    }
    let mut ack_error = None;
    if router.local_writes || !router.session.acks.is_empty() {
        router.local_writes = false;
        if node.acknowledgement_waits(&router.session.acks) {
            match node.acknowledge(&mut router.session.acks).await {
                Err(e) => ack_error = Some(crate::front::commands::misconf(&e.to_string())),
                // A backup refused one of this round's writes: the round's local writes are
                // not told apart here, so each reports that it is in doubt.
                Ok(refused) => {
                    ack_error = refused
                        .first()
                        .map(|r| format!("ERR {}", r.reason.replace(['\r', '\n'], " ")))
                }
            }
        }
    }
    let ctx = Assemble {
        protocol,
        local: &round.local,
        replies: &replies,
        rerouted: &rerouted,
        ack_error: ack_error.as_deref(),
    };
    let each = round.started.elapsed() / round.parts.len().max(1) as u32;
    for (i, part) in round.parts.iter().enumerate() {
        let from = out.len();
        ctx.write(part, out);
        let failed = out.get(from) == Some(&b'-');
        if failed {
            node.metrics.routed_error_stats.count(&out[from..]);
        }
        if let Some(&Some(index)) = round.counted.get(i) {
            node.metrics
                .routed_command_stats
                .ran(index, each, true, failed);
        }
    }
}

/// The INFO commandstats counter of a call with `args`, if its command is one.
fn command_index(args: &[&[u8]]) -> Option<usize> {
    crate::front::commands::lookup_at(args[0])
        .map(|(index, _)| crate::front::commands::stat_index(index, args))
}

/// Counts a routing-port client's command that took `elapsed` and answered `reply`.
fn count_routed(node: &Node, args: &[&[u8]], elapsed: Duration, reply: &[u8]) {
    let failed = reply.first() == Some(&b'-');
    if failed {
        node.metrics.routed_error_stats.count(reply);
    }
    if let Some(index) = command_index(args) {
        node.metrics
            .routed_command_stats
            .ran(index, elapsed, true, failed);
    }
}

/// Sends each server the commands of `round` it has not been sent yet, at once, and waits for
/// every answer; each command's reply (or why there is none) is appended to `replies`. The sends
/// run concurrently inside the connection's own task (no task per send: a reply wakes the task
/// that waits for it, with no hand-off).
async fn send(router: &Router<'_>, round: &mut Round, replies: &mut HashMap<ServerId, Vec<Reply>>) {
    let protocol = router.session.protocol;
    let member = router.session.member().cloned();
    let mut calls = Vec::new();
    for (&peer, commands) in &round.outgoing {
        let answered = replies.entry(peer).or_default();
        let sent = answered.len();
        if sent == commands.len() {
            continue;
        }
        if peer == HELD {
            answered.extend(commands.slots[sent..].iter().map(|slot| {
                Reply::NotSent(format!(
                    "TRYAGAIN slot {} is being recovered after its master failed; retry",
                    slot.unwrap_or_default()
                ))
            }));
            continue;
        }
        let (node, member) = (router.node, member.clone());
        calls.push(async move {
            let result = forward(node, member, peer, protocol, commands, sent).await;
            (peer, commands.len() - sent, result)
        });
    }
    for (peer, count, result) in ramlog_client::join_all(calls).await {
        let answered = replies.entry(peer).or_default();
        match result {
            Ok(r) => answered.extend(r.into_iter().map(Reply::Answer)),
            Err(Forward::NotSent(e)) => answered.extend(std::iter::repeat_n(
                Reply::NotSent(format!("TRYAGAIN routing failed: {e}")),
                count,
            )),
            Err(Forward::InDoubt(e)) => {
                answered.extend(std::iter::repeat_n(Reply::InDoubt(e), count))
            }
        }
    }
}

/// Sends `peer` the commands of `commands` from number `first` on, in one RESP_PASS.
async fn forward(
    node: &Node,
    member: Option<Arc<Member>>,
    peer: ServerId,
    protocol: u8,
    commands: &Outgoing,
    first: usize,
) -> Result<Vec<Bytes>, Forward> {
    let member = member.ok_or(Forward::NotSent("not in a cluster".into()))?;
    let addr = member
        .view()
        .map
        .server(peer)
        .map(|s| s.addresses.native)
        .ok_or_else(|| Forward::NotSent(format!("server {peer} is not in the map")))?;
    let client = match member.peers().client(node, peer, addr).await {
        Ok(client) => client,
        Err(e) => {
            member.peer_unreachable(peer, e.clone());
            return Err(Forward::NotSent(e));
        }
    };
    let count = commands.len() - first;
    let request = Request::RespPass {
        protocol,
        count: count as u32,
        resp: commands.resp_from(first),
    };
    // Once the batch was written the commands may have run on the peer: a failure leaves their
    // outcome unknown, and must not invite a retry that could apply a write twice. A connection
    // that could not be opened, or a batch too large to send, sent nothing.
    match client.request(&request).await {
        Ok(Response::RespBatch(r)) if r.len() == count => Ok(r),
        Ok(Response::RespBatch(r)) => Err(Forward::InDoubt(format!(
            "server {peer} answered {} of {count} commands",
            r.len(),
        ))),
        Ok(other) => Err(Forward::InDoubt(format!(
            "server {peer} answered {other:?}"
        ))),
        Err(e) => {
            let unsent = matches!(
                e,
                ramlog_client::Error::Connect { .. }
                    | ramlog_client::Error::Handshake { .. }
                    | ramlog_client::Error::RequestTooLarge { .. }
            );
            let e = format!("server {peer} at {addr}: {e}");
            member.peer_unreachable(peer, e.clone());
            Err(if unsent {
                Forward::NotSent(e)
            } else {
                Forward::InDoubt(e)
            })
        }
    }
}

/// Why a batch forwarded to a peer has no replies.
enum Forward {
    /// It never left this server (no connection, no address): nothing ran; retrying is safe.
    NotSent(String),
    /// It was sent: some of it may have run.
    InDoubt(String),
}

/// What became of one forwarded command.
#[derive(Clone)]
enum Reply {
    /// The server's reply.
    Answer(Bytes),
    /// It was not sent: the error to answer (a full RESP error message) unless it is routed
    /// again in time.
    NotSent(String),
    /// It was sent and no reply came: its outcome is unknown.
    InDoubt(String),
}

impl Reply {
    /// True when the command certainly was not applied and its master failed or moved: it may be
    /// routed again once the map names the new one.
    fn may_reroute(&self) -> bool {
        match self {
            Reply::NotSent(_) => true,
            Reply::Answer(b) => {
                b.starts_with(b"-TRYAGAIN ")
                    || b.starts_with(b"-MOVED ")
                    || b.get(1..)
                        .is_some_and(|e| e.starts_with(LEASE_REFUSAL_PREFIX.as_bytes()))
            }
            Reply::InDoubt(_) => false,
        }
    }
}

impl Router<'_> {
    /// Routes again, by the newest map, the keyed commands whose master failed or moved before
    /// they were applied, and sends them, until none is left or `routing_recovery_wait_ms` has
    /// passed; between attempts, waits for a newer map (at most a pause that grows from
    /// [`RETRY_PAUSE_MIN`] to [`RETRY_PAUSE_MAX`]). Each command routed again gets its part in
    /// `rerouted`, in place of its first one; those still waiting at the end keep their error.
    async fn reroute(
        &mut self,
        round: &mut Round,
        replies: &mut HashMap<ServerId, Vec<Reply>>,
        rerouted: &mut HashMap<(ServerId, usize), Part>,
    ) {
        let Some(member) = self.session.member().cloned() else {
            return;
        };
        let wait = Duration::from_millis(self.node.config.routing_recovery_wait_ms);
        let mut deadline = None;
        let mut pause = RETRY_PAUSE_MIN;
        // Commands routed again run as if no transaction were open (a MULTI left open by this
        // round queues only what follows it).
        let multi = self.session.multi.take();
        loop {
            let mut waiting: Vec<(ServerId, usize)> = replies
                .iter()
                .flat_map(|(&peer, r)| {
                    let slots = &round.outgoing[&peer].slots;
                    r.iter()
                        .enumerate()
                        .filter(move |(i, reply)| slots[*i].is_some() && reply.may_reroute())
                        .map(move |(i, _)| (peer, i))
                })
                .filter(|key| !rerouted.contains_key(key))
                .collect();
            if waiting.is_empty() {
                break;
            }
            let now = Instant::now();
            let deadline = *deadline.get_or_insert(now + wait);
            if now >= deadline {
                break;
            }
            let seen = round.view.as_ref().map_or(0, |v| v.map.version);
            if !member.map_newer_than(seen, pause.min(deadline - now)).await {
                pause = (pause * 2).min(RETRY_PAUSE_MAX);
            }
            // In request order per server: commands for one key came from one server.
            waiting.sort_unstable();
            round.view = None;
            let view = round.view(&member);
            for (peer, index) in waiting {
                // A copy: the round's commands grow while this one is routed.
                let owned = round.outgoing[&peer].command(index);
                let args: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
                if peer == HELD {
                    if let Some((key, slot)) = still_held(&view, &args) {
                        // Its restorer is told again if the last telling did not reach it (at
                        // most once per map version while one is under way).
                        member.ask_for(self.node, &view, slot, key);
                        continue;
                    }
                }
                let part = self.route(round, &args, None);
                rerouted.insert((peer, index), part);
            }
            send(self, round, replies).await;
        }
        self.session.multi = multi;
    }
}

/// A key of `args` in a slot being recovered (and not waiting for memory, which routing answers
/// at once), with its slot, while there is one.
fn still_held<'a>(view: &ClusterView, args: &[&'a [u8]]) -> Option<(&'a [u8], u16)> {
    let spec = lookup(args[0])?;
    command_keys(spec, args).find_map(|k| {
        let slot = key_slot(k);
        (view.is_recovering(slot) && view.waiting_reason(slot).is_none()).then_some((k, slot))
    })
}

struct Assemble<'a> {
    protocol: u8,
    local: &'a [u8],
    replies: &'a HashMap<ServerId, Vec<Reply>>,
    /// Commands routed again after their master failed: their new parts.
    rerouted: &'a HashMap<(ServerId, usize), Part>,
    ack_error: Option<&'a str>,
}

impl Assemble<'_> {
    fn bytes(&self, part: &Part) -> Vec<u8> {
        let mut out = Vec::new();
        self.write(part, &mut out);
        out
    }

    fn write(&self, part: &Part, out: &mut Vec<u8>) {
        match part {
            Part::Ready(bytes) => out.extend_from_slice(bytes),
            Part::Local { range, write } => match (self.ack_error, write) {
                (Some(e), true) => ReplyEncoder::new(out, self.protocol).error(e),
                _ => out.extend_from_slice(&self.local[range.clone()]),
            },
            Part::Remote { peer, index } => {
                if let Some(part) = self.rerouted.get(&(*peer, *index)) {
                    return self.write(part, out);
                }
                match self.replies.get(peer).and_then(|r| r.get(*index)) {
                    Some(Reply::Answer(r)) => out.extend_from_slice(r),
                    Some(Reply::NotSent(e)) => {
                        ReplyEncoder::new(out, self.protocol).error(&e.replace(['\r', '\n'], " "))
                    }
                    Some(Reply::InDoubt(e)) => {
                        ReplyEncoder::new(out, self.protocol).error(&format!(
                    "ERR routing failed after the command was sent ({}); its outcome is unknown",
                    e.replace(['\r', '\n'], " ")
                ))
                    }
                    None => ReplyEncoder::new(out, self.protocol)
                        .error("TRYAGAIN routing failed: no answer"),
                }
            }
            Part::Sum(parts) => {
                let mut total: i64 = 0;
                for p in parts {
                    let b = self.bytes(p);
                    match parse_integer(&b) {
                        Some(n) => total += n,
                        None => return out.extend_from_slice(&b),
                    }
                }
                ReplyEncoder::new(out, self.protocol).integer(total);
            }
            Part::AnyOf(parts) => {
                let mut found = Vec::new();
                let mut null = None;
                for p in parts {
                    let b = self.bytes(p);
                    if b.first() == Some(&b'-') {
                        return out.extend_from_slice(&b);
                    }
                    if crate::front::blocking::is_null(&b) {
                        null = Some(b);
                    } else {
                        found.push(b);
                    }
                }
                if found.is_empty() {
                    match null {
                        Some(b) => out.extend_from_slice(&b),
                        None => ReplyEncoder::new(out, self.protocol).null(),
                    }
                } else {
                    let pick = crate::front::commands::typed::random_u64() as usize % found.len();
                    out.extend_from_slice(&found[pick]);
                }
            }
            Part::AllOk(parts) => {
                for p in parts {
                    let b = self.bytes(p);
                    if b != b"+OK\r\n" {
                        return out.extend_from_slice(&b);
                    }
                }
                out.extend_from_slice(b"+OK\r\n");
            }
            Part::Mget { pieces, total } => {
                let mut slots: Vec<Option<Vec<u8>>> = vec![None; *total];
                for (p, positions) in pieces {
                    let b = self.bytes(p);
                    let Some(elements) = split_array(&b) else {
                        return out.extend_from_slice(&b);
                    };
                    if elements.len() != positions.len() {
                        return ReplyEncoder::new(out, self.protocol)
                            .error("ERR routing: a server answered MGET with the wrong count");
                    }
                    for (e, &at) in elements.into_iter().zip(positions) {
                        slots[at] = Some(e.to_vec());
                    }
                }
                ReplyEncoder::new(out, self.protocol).array(*total);
                for s in slots {
                    match s {
                        Some(e) => out.extend_from_slice(&e),
                        None => ReplyEncoder::new(out, self.protocol).null(),
                    }
                }
            }
            Part::Concat(parts) => {
                let mut all = Vec::new();
                let mut count = 0;
                for p in parts {
                    let b = self.bytes(p);
                    let Some(elements) = split_array(&b) else {
                        return out.extend_from_slice(&b);
                    };
                    count += elements.len();
                    for e in elements {
                        all.extend_from_slice(e);
                    }
                }
                ReplyEncoder::new(out, self.protocol).array(count);
                out.extend_from_slice(&all);
            }
            Part::Array(parts) => {
                ReplyEncoder::new(out, self.protocol).array(parts.len());
                for p in parts {
                    self.write(p, out);
                }
            }
            Part::Info { text, others } => {
                let mut total = keyspace_of(text.as_bytes());
                let mut changes = changes_of(text.as_bytes());
                for p in others {
                    let b = self.bytes(p);
                    let (k, e, ttl_sum) = keyspace_of(&b);
                    total = (total.0 + k, total.1 + e, total.2 + ttl_sum);
                    changes = match (changes, changes_of(&b)) {
                        (Some(a), Some(b)) => Some(a + b),
                        (a, b) => a.or(b),
                    };
                }
                let text = &match (changes, text.find(CHANGES_FIELD)) {
                    (Some(n), Some(at)) => {
                        let value = at + CHANGES_FIELD.len();
                        let end = text[value..].find("\r\n").map_or(text.len(), |e| value + e);
                        format!("{}{n}{}", &text[..value], &text[end..])
                    }
                    _ => text.clone(),
                };
                let (keys, expires, ttl_sum) = total;
                let line = if keys > 0 {
                    format!(
                        "db0:keys={keys},expires={expires},avg_ttl={}\r\n",
                        ttl_sum.checked_div(expires).unwrap_or(0)
                    )
                } else {
                    String::new()
                };
                let mut merged = String::with_capacity(text.len() + line.len());
                match text.find("# Keyspace\r\n") {
                    Some(at) => {
                        let head = at + "# Keyspace\r\n".len();
                        merged.push_str(&text[..head]);
                        merged.push_str(&line);
                        let rest = &text[head..];
                        let skip = if rest.starts_with("db0:") {
                            rest.find("\r\n").map_or(rest.len(), |e| e + 2)
                        } else {
                            0
                        };
                        merged.push_str(&rest[skip..]);
                    }
                    None => merged.push_str(text),
                }
                ReplyEncoder::new(out, self.protocol).verbatim("txt", merged.as_bytes());
            }
            Part::Scan {
                part,
                index,
                servers,
            } => {
                let b = self.bytes(part);
                let Some(elements) = split_array(&b) else {
                    return out.extend_from_slice(&b);
                };
                let inner = elements
                    .first()
                    .and_then(|c| parse_bulk(c))
                    .and_then(|c| std::str::from_utf8(c).ok()?.parse::<u64>().ok());
                let (Some(inner), Some(keys), 2) = (inner, elements.get(1), elements.len()) else {
                    return out.extend_from_slice(&b);
                };
                let next = if inner != 0 {
                    (inner << 8) | index
                } else if index + 1 < *servers {
                    index + 1
                } else {
                    0
                };
                let mut enc = ReplyEncoder::new(out, self.protocol);
                enc.array(2);
                enc.bulk(next.to_string().as_bytes());
                out.extend_from_slice(keys);
            }
        }
    }
}

/// (keys, expires, avg_ttl × expires) of the `db0:` line in an INFO reply; zeros without one.
/// INFO's count of changes since the last save (Redis's dirty counter).
const CHANGES_FIELD: &str = "rdb_changes_since_last_save:";

/// The changes since the last save an INFO reply shows, if it shows them.
fn changes_of(b: &[u8]) -> Option<u64> {
    let text = String::from_utf8_lossy(b);
    let at = text.find(CHANGES_FIELD)? + CHANGES_FIELD.len();
    text[at..].lines().next()?.trim().parse().ok()
}

fn keyspace_of(b: &[u8]) -> (u64, u64, u64) {
    let text = String::from_utf8_lossy(b);
    let Some(at) = text.find("db0:") else {
        return (0, 0, 0);
    };
    let line = text[at + 4..].lines().next().unwrap_or("");
    let field = |name: &str| -> u64 {
        line.split(',')
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let expires = field("expires");
    (
        field("keys"),
        expires,
        field("avg_ttl").saturating_mul(expires),
    )
}

fn parse_integer(b: &[u8]) -> Option<i64> {
    let body = b.strip_prefix(b":")?.strip_suffix(b"\r\n")?;
    std::str::from_utf8(body).ok()?.parse().ok()
}

fn parse_bulk(b: &[u8]) -> Option<&[u8]> {
    let rest = b.strip_prefix(b"$")?;
    let nl = rest.iter().position(|&c| c == b'\r')?;
    let len: usize = std::str::from_utf8(&rest[..nl]).ok()?.parse().ok()?;
    rest.get(nl + 2..nl + 2 + len)
}

/// The elements of an array reply, as byte slices of `b`; None if `b` is not an array.
fn split_array(b: &[u8]) -> Option<Vec<&[u8]>> {
    let rest = b.strip_prefix(b"*")?;
    let nl = rest.iter().position(|&c| c == b'\r')?;
    let count: usize = std::str::from_utf8(&rest[..nl]).ok()?.parse().ok()?;
    let mut pos = 1 + nl + 2;
    let decoder = ReplyDecoder::default();
    let mut elements = Vec::with_capacity(count);
    for _ in 0..count {
        let (_, used) = decoder.decode(&b[pos..]).ok()??;
        elements.push(&b[pos..pos + used]);
        pos += used;
    }
    Some(elements)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_split_into_elements() {
        let b = b"*3\r\n$1\r\na\r\n$-1\r\n:5\r\n";
        let e = split_array(b).unwrap();
        assert_eq!(e, vec![&b"$1\r\na\r\n"[..], b"$-1\r\n", b":5\r\n"]);
        assert!(split_array(b"+OK\r\n").is_none());
        assert!(split_array(b"*2\r\n:1\r\n").is_none());
        assert_eq!(parse_integer(b":-12\r\n"), Some(-12));
        assert_eq!(parse_bulk(b"$2\r\n17\r\n"), Some(&b"17"[..]));
    }

    #[test]
    fn only_commands_certainly_not_applied_are_routed_again() {
        let answer = |b: &[u8]| Reply::Answer(Bytes::copy_from_slice(b));
        assert!(Reply::NotSent("TRYAGAIN routing failed: refused".into()).may_reroute());
        assert!(answer(b"-TRYAGAIN slot 3 is not served by this server\r\n").may_reroute());
        assert!(answer(b"-MOVED 3 127.0.0.1:7000\r\n").may_reroute());
        let lease = format!("-{LEASE_REFUSAL_PREFIX} for 5 ms past its lease\r\n");
        assert!(answer(lease.as_bytes()).may_reroute());
        // Waiting for memory is the answer itself; anything else ran.
        assert!(!answer(b"-CLUSTERDOWN slot 3 is unavailable: waits for memory\r\n").may_reroute());
        assert!(!answer(b"+OK\r\n").may_reroute());
        assert!(!answer(b"-ERR value is not an integer\r\n").may_reroute());
        assert!(!Reply::InDoubt("connection lost".into()).may_reroute());
    }

    #[test]
    fn outgoing_commands_come_back_whole() {
        let mut o = Outgoing::default();
        assert_eq!(o.push(&[b"set", b"a", b"1"], None, Some(15495)), 0);
        assert_eq!(o.push(&[b"dbsize"], None, None), 1);
        // Passed through as the client sent it (an empty key, a binary value).
        let raw = b"*3\r\n$3\r\nSET\r\n$0\r\n\r\n$2\r\n\x00\r\r\n";
        assert_eq!(o.push(&[b"SET", b"", b"\x00\r"], Some(raw), Some(0)), 2);
        assert_eq!(o.push(&[b"get", b"a"], None, Some(15495)), 3);
        assert_eq!(o.len(), 4);
        assert_eq!(
            o.command(0),
            vec![b"set".to_vec(), b"a".to_vec(), b"1".to_vec()]
        );
        assert_eq!(o.command(1), vec![b"dbsize".to_vec()]);
        assert_eq!(
            o.command(2),
            vec![b"SET".to_vec(), Vec::new(), b"\x00\r".to_vec()]
        );
        let rest = o.resp_from(1);
        let commands = ramlog_proto::native::resp_pass_commands(3, rest).unwrap();
        assert_eq!(
            commands,
            vec![
                vec![&b"dbsize"[..]],
                vec![&b"SET"[..], b"", b"\x00\r"],
                vec![&b"get"[..], b"a"]
            ]
        );
        assert!(o.resp_from(4).is_empty());
        assert_eq!(o.slots, vec![Some(15495), None, Some(0), Some(15495)]);
    }
}
