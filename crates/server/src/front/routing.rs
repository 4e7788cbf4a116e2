//! The routing port: RESP for clients that know nothing of clusters. Any key on any server.
//!
//! Each request is routed by its keys' slots through the map this server holds:
//! - keys this server masters run here, through the same command layer as the RESP port;
//! - keys another server masters are forwarded to it over the native protocol (RESP_BATCH: all the
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

use crate::front::commands::{command_keys, execute, lookup, Session};
use crate::front::resp_conn::{read_more, request_limits, Ending};
use crate::node::metrics::{BufferGauge, Metrics};
use crate::node::Node;
use bytes::Bytes;
use ramlog_client::{Request, Response};
use ramlog_cluster::ServerId;
use ramlog_common::key_slot;
use ramlog_proto::resp::{ReplyDecoder, ReplyEncoder, RequestDecoder};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const READ_CHUNK_BYTES: usize = 16 * 1024;

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

/// Commands for one server, their arguments copied once into one buffer.
#[derive(Default)]
struct Outgoing {
    data: Vec<u8>,
    /// Each argument's range in `data`.
    args: Vec<(usize, usize)>,
    /// Where each command's arguments end in `args`.
    ends: Vec<usize>,
}

impl Outgoing {
    fn push(&mut self, args: &[&[u8]]) -> usize {
        for a in args {
            let start = self.data.len();
            self.data.extend_from_slice(a);
            self.args.push((start, self.data.len()));
        }
        self.ends.push(self.args.len());
        self.ends.len() - 1
    }

    fn commands(&self) -> Vec<Vec<&[u8]>> {
        let mut start = 0;
        self.ends
            .iter()
            .map(|&end| {
                let command = self.args[start..end]
                    .iter()
                    .map(|&(a, b)| &self.data[a..b])
                    .collect();
                start = end;
                command
            })
            .collect()
    }
}

/// One read's worth of requests: the replies being assembled, the replies of commands run here,
/// and the commands to forward.
struct Round {
    parts: Vec<Part>,
    local: Vec<u8>,
    outgoing: BTreeMap<ServerId, Outgoing>,
}

impl Round {
    fn new() -> Round {
        Round {
            parts: Vec::new(),
            local: Vec::new(),
            outgoing: BTreeMap::new(),
        }
    }

    fn forward(&mut self, peer: ServerId, args: &[&[u8]]) -> Part {
        let index = self.outgoing.entry(peer).or_default().push(args);
        Part::Remote { peer, index }
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

    /// Where `args` go: here, or to the server that masters `slot`.
    fn send_to(&mut self, round: &mut Round, owner: ServerId, args: &[&[u8]]) -> Part {
        let me = self.session.member().map_or(0, |m| m.view().me);
        if owner == 0 {
            Part::Ready(error_reply(
                self.session.protocol,
                "CLUSTERDOWN Hash slot not served",
            ))
        } else if owner == me {
            self.local(round, args)
        } else {
            round.forward(owner, args)
        }
    }

    /// Routes one request into a reply part.
    fn route(&mut self, round: &mut Round, args: &[&[u8]]) -> Part {
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
        if spec.name == "exec" && in_multi && !self.session.multi_failed {
            let queued = self.session.multi.take().unwrap_or_default();
            let parts = queued
                .iter()
                .map(|cmd| {
                    let args: Vec<&[u8]> = cmd.iter().map(|a| a.as_slice()).collect();
                    self.route(round, &args)
                })
                .collect();
            return Part::Array(parts);
        }
        if in_multi {
            return self.local(round, args);
        }
        let view = member.view();
        let servers = view.masters();
        let mut to_every_master = |router: &mut Self| -> Vec<Part> {
            servers
                .iter()
                .map(|&s| router.send_to(round, s, args))
                .collect()
        };
        match spec.name {
            "dbsize" => return Part::Sum(to_every_master(self)),
            "keys" => return Part::Concat(to_every_master(self)),
            "flushall" | "flushdb" => return Part::AllOk(to_every_master(self)),
            "info" => {
                let section = args.get(1).map(|s| String::from_utf8_lossy(s).into_owned());
                let text = self.node.snapshot().info(section.as_deref(), false);
                let me = view.me;
                let others = if text.contains("# Keyspace") {
                    let info_keyspace: [&[u8]; 2] = [b"info", b"keyspace"];
                    servers
                        .iter()
                        .filter(|&&s| s != me)
                        .map(|&s| self.send_to(round, s, &info_keyspace))
                        .collect()
                } else {
                    Vec::new()
                };
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
                let part = self.send_to(round, server, &forwarded);
                return Part::Scan {
                    part: Box::new(part),
                    index,
                    servers: servers.len() as u64,
                };
            }
            _ => {}
        }
        if spec.first_key <= 0 {
            return self.local(round, args);
        }
        let step = spec.step.max(1) as usize;
        let first_arg = spec.first_key as usize;
        // A key without its values (MSET a 1 b): the command's own check answers it.
        if spec.last_key < 0 && !(args.len() - first_arg).is_multiple_of(step) {
            return self.local(round, args);
        }
        let keys: Vec<&[u8]> = command_keys(spec, args).collect();
        let Some(first) = keys.first() else {
            return self.local(round, args);
        };
        // A slot whose tablet waits for memory has no server to go to: say why here.
        let waiting = keys.iter().map(|k| key_slot(k)).find_map(|slot| {
            view.waiting_reason(slot)
                .map(|why| crate::cluster::Route::waiting_error(slot, why))
        });
        if let Some(error) = waiting {
            return Part::Ready(error_reply(self.session.protocol, &error));
        }
        let owner = view.owner(key_slot(first));
        if keys.iter().all(|k| view.owner(key_slot(k)) == owner) {
            drop(view);
            return self.send_to(round, owner, args);
        }
        // Keys on several servers: split the command by server.
        let mut by_owner: BTreeMap<ServerId, Vec<usize>> = BTreeMap::new();
        for (i, k) in keys.iter().enumerate() {
            by_owner
                .entry(view.owner(key_slot(k)))
                .or_default()
                .push(first_arg + i * step);
        }
        drop(view);
        let split = |positions: &[usize]| {
            let mut sub: Vec<&[u8]> = vec![args[0]];
            for &p in positions {
                sub.extend_from_slice(&args[p..p + step]);
            }
            sub
        };
        match spec.name {
            "mget" => {
                let pieces = by_owner
                    .iter()
                    .map(|(&owner, positions)| {
                        let sub = split(positions);
                        let part = self.send_to(round, owner, &sub);
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
                        let sub = split(positions);
                        self.send_to(round, owner, &sub)
                    })
                    .collect(),
            ),
            "del" | "unlink" | "exists" => Part::Sum(
                by_owner
                    .iter()
                    .map(|(&owner, positions)| {
                        let sub = split(positions);
                        self.send_to(round, owner, &sub)
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
    session.routed = true;
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
        if let Err(ending) = read_more(&mut stream, &mut inbuf, idle, &node.metrics).await {
            return ending;
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
                            // A change of protocol or identity applies to what follows it only:
                            // what is already routed goes out first.
                            let barrier =
                                lookup(args[0]).is_some_and(|s| matches!(s.name, "hello" | "auth"));
                            if barrier && !round.outgoing.is_empty() {
                                break;
                            }
                            let part = router.route(&mut round, &args);
                            round.parts.push(part);
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

/// Sends every server its commands, waits for all replies (and for the acknowledgement point of
/// writes run here), and appends the replies in request order.
async fn resolve(router: &mut Router<'_>, round: Round, out: &mut Vec<u8>) {
    let protocol = router.session.protocol;
    let node = router.node;
    let Round {
        parts,
        local,
        outgoing,
    } = round;
    let mut replies: HashMap<ServerId, Result<Vec<Bytes>, Forward>> = HashMap::new();
    if !outgoing.is_empty() {
        let member = router.session.member().cloned();
        let mut calls = tokio::task::JoinSet::new();
        for (peer, commands) in outgoing {
            let node = node.clone();
            let member = member.clone();
            calls.spawn(async move {
                let result = async {
                    let member = member.ok_or(Forward::NotSent("not in a cluster".into()))?;
                    let addr = member
                        .view()
                        .map
                        .server(peer)
                        .map(|s| s.addresses.native)
                        .ok_or_else(|| {
                            Forward::NotSent(format!("server {peer} is not in the map"))
                        })?;
                    let client = match member.peers().client(&node, peer, addr).await {
                        Ok(client) => client,
                        Err(e) => {
                            member.peer_unreachable(peer, e.clone());
                            return Err(Forward::NotSent(e));
                        }
                    };
                    let borrowed = commands.commands();
                    let count = borrowed.len();
                    let request = Request::RespBatch {
                        protocol,
                        commands: borrowed,
                    };
                    // From here the commands may have run on the peer: a failure leaves their
                    // outcome unknown, and must not invite a retry (TRYAGAIN) that could apply
                    // a write twice.
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
                            let e = format!("server {peer} at {addr}: {e}");
                            member.peer_unreachable(peer, e.clone());
                            Err(Forward::InDoubt(e))
                        }
                    }
                }
                .await;
                (peer, result)
            });
        }
        while let Some(done) = calls.join_next().await {
            if let Ok((peer, result)) = done {
                replies.insert(peer, result);
            }
        }
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
        local: &local,
        replies: &replies,
        ack_error: ack_error.as_deref(),
    };
    for part in &parts {
        ctx.write(part, out);
    }
}

/// Why a batch forwarded to a peer has no replies.
enum Forward {
    /// It never left this server (no connection, no address): nothing ran; retrying is safe.
    NotSent(String),
    /// It was sent: some of it may have run.
    InDoubt(String),
}

struct Assemble<'a> {
    protocol: u8,
    local: &'a [u8],
    replies: &'a HashMap<ServerId, Result<Vec<Bytes>, Forward>>,
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
            Part::Remote { peer, index } => match self.replies.get(peer) {
                Some(Ok(r)) => out.extend_from_slice(&r[*index]),
                Some(Err(Forward::NotSent(e))) => ReplyEncoder::new(out, self.protocol)
                    .error(&format!("TRYAGAIN routing failed: {e}")),
                Some(Err(Forward::InDoubt(e))) => {
                    ReplyEncoder::new(out, self.protocol).error(&format!(
                    "ERR routing failed after the command was sent ({}); its outcome is unknown",
                    e.replace(['\r', '\n'], " ")
                ))
                }
                None => ReplyEncoder::new(out, self.protocol)
                    .error("TRYAGAIN routing failed: no answer"),
            },
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
                for p in others {
                    let (k, e, ttl_sum) = keyspace_of(&self.bytes(p));
                    total = (total.0 + k, total.1 + e, total.2 + ttl_sum);
                }
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
}
