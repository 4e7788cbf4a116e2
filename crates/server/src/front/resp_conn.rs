//! One RESP client connection: read, decode every complete request, execute, reply in one write.
//!
//! Each connection is its own task, so a slow or stalled client holds nothing that others need.
//! Every buffer is bounded: the read buffer by the request limits (a request that exceeds them is a
//! protocol error that closes the connection, as in Redis), the reply buffer by
//! `reply_buffer_max_bytes` and `pipeline_depth_max` (replies are written out when either is reached,
//! so a deep pipeline is served in batches and a client that does not read its replies blocks only
//! itself, until `write_timeout_secs` closes it).

use crate::front::commands::{continues_run, execute, execute_run, misconf, starts_run, Session};
use crate::node::metrics::{BufferGauge, Metrics};
use crate::node::{Node, NodeError};
use ramlog_proto::resp::{ReplyEncoder, Request, RequestDecoder, RequestLimits};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const READ_CHUNK_BYTES: usize = 16 * 1024;
const BUFFER_KEEP_BYTES: usize = 1 << 20;

/// Why a connection ended (for logs and tests).
#[derive(Debug, PartialEq, Eq)]
pub enum Ending {
    ClientClosed,
    Quit,
    IdleTimeout,
    WriteTimeout,
    ProtocolError,
    IoError,
    /// A subscriber let more than `node::pubsub::QUEUE_MAX_BYTES` of messages wait.
    SubscriberTooSlow,
}

pub async fn serve_resp(
    mut stream: TcpStream,
    shared: Arc<Node>,
    cluster: Option<Arc<crate::cluster::Roles>>,
    client_id: u64,
) -> Ending {
    let _ = stream.set_nodelay(true);
    let config = &shared.config;
    let mut session = Session::new(client_id, shared.password_required(), cluster);
    session.addr = stream.peer_addr().ok();
    session.laddr = stream.local_addr().ok();
    let decoder = RequestDecoder::new(request_limits(config));
    let mut request = Request::default();
    let mut run_pool: Vec<(Request, usize)> = Vec::new();
    let mut inbuf: Vec<u8> = Vec::with_capacity(READ_CHUNK_BYTES);
    let mut out: Vec<u8> = Vec::with_capacity(READ_CHUNK_BYTES);
    let idle =
        (config.idle_timeout_secs > 0).then(|| Duration::from_secs(config.idle_timeout_secs));
    let write_timeout = Duration::from_secs(config.write_timeout_secs.max(1));
    let reply_buffer_max = config.reply_buffer_max_bytes as usize;
    let depth_max = config.pipeline_depth_max;
    let mut buffers = BufferGauge::new(&shared.metrics);
    loop {
        match wait_input(
            &mut stream,
            &mut inbuf,
            idle,
            &shared.metrics,
            &mut session,
            &mut out,
        )
        .await
        {
            Ok(Woke::Input) => {}
            Ok(Woke::Delivered) => {
                if let Err(ending) =
                    flush(&mut stream, &shared, &mut session, &mut out, write_timeout).await
                {
                    return ending;
                }
                continue;
            }
            Err(ending) => return ending,
        }
        buffers.update(inbuf.capacity() + out.capacity());
        let mut pos = 0;
        let mut batch = 0;
        let mut fatal = None;
        while pos < inbuf.len() {
            match decoder.decode(&inbuf[pos..], &mut request) {
                Ok(Some(used)) => {
                    let mut consumed = used;
                    if !request.is_empty() {
                        let args = request.args(&inbuf[pos..]);
                        if crate::front::analytic::is_analytic(args[0]) {
                            // A scan across servers: what came before it goes out first.
                            if let Err(ending) =
                                flush(&mut stream, &shared, &mut session, &mut out, write_timeout)
                                    .await
                            {
                                return ending;
                            }
                            crate::front::analytic::run(&shared, &mut session, &args, &mut out)
                                .await;
                        } else if crate::front::blocking::is_blocking(&args)
                            && session.multi.is_none()
                        {
                            // A blocking command: what came before it goes out first.
                            let owned: Vec<Vec<u8>> = args.iter().map(|a| a.to_vec()).collect();
                            if let Err(ending) =
                                flush(&mut stream, &shared, &mut session, &mut out, write_timeout)
                                    .await
                            {
                                return ending;
                            }
                            let args: Vec<&[u8]> = owned.iter().map(|a| a.as_slice()).collect();
                            hold_through_switch(&session, &args).await;
                            let mut ahead = Vec::new();
                            let done = crate::front::blocking::run(
                                &shared,
                                &mut session,
                                &args,
                                &mut out,
                                &mut stream,
                                &mut ahead,
                            )
                            .await;
                            // Requests read while blocked are served next, in order.
                            inbuf.extend_from_slice(&ahead);
                            if let Err(ending) = done {
                                return ending;
                            }
                        } else {
                            hold_through_switch(&session, &args).await;
                            let waiting = crate::front::commands::pubsub::unsettled_before(
                                &shared, &session, &args,
                            );
                            if !waiting.is_empty() {
                                crate::node::pubsub::PubSub::settle(waiting).await;
                            }
                            let before = out.len();
                            // Pipelined pushes or pops of one key run as one command
                            // (`commands::execute_run`).
                            let (more, run_end) = if starts_run(&args) && batch + 1 < depth_max {
                                run_after(
                                    &decoder,
                                    &inbuf,
                                    pos + used,
                                    &args,
                                    &mut run_pool,
                                    depth_max - batch - 1,
                                )
                            } else {
                                (0, 0)
                            };
                            let run: Vec<Vec<&[u8]>> = if more > 0 {
                                std::iter::once(args.clone())
                                    .chain(
                                        run_pool[..more]
                                            .iter()
                                            .map(|(r, at)| r.args(&inbuf[*at..])),
                                    )
                                    .collect()
                            } else {
                                Vec::new()
                            };
                            let mut ran_run =
                                more > 0 && execute_run(&shared, &mut session, &run, &mut out);
                            if !ran_run {
                                execute(&shared, &mut session, &args, &mut out);
                            }
                            // A switch that began between the hold's look at the map and the
                            // command's route: its TRYAGAIN applied nothing, so the request
                            // waits the switch out and runs again (redis-cli -c prints a
                            // TRYAGAIN rather than retry it).
                            for _ in 0..3 {
                                if !out[before..].starts_with(b"-TRYAGAIN")
                                    || !switching_now(&session, &args)
                                {
                                    break;
                                }
                                out.truncate(before);
                                hold_through_switch(&session, &args).await;
                                ran_run =
                                    ran_run && execute_run(&shared, &mut session, &run, &mut out);
                                if !ran_run {
                                    execute(&shared, &mut session, &args, &mut out);
                                }
                            }
                            if ran_run {
                                batch += more;
                                consumed = run_end - pos;
                            }
                        }
                        batch += 1;
                    }
                    pos += consumed;
                    if session.closing {
                        break;
                    }
                    if batch >= depth_max || out.len() >= reply_buffer_max {
                        if let Err(ending) =
                            flush(&mut stream, &shared, &mut session, &mut out, write_timeout).await
                        {
                            return ending;
                        }
                        batch = 0;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    fatal = Some(e);
                    break;
                }
            }
        }
        inbuf.drain(..pos);
        if let Some(e) = &fatal {
            Metrics::add(&shared.metrics.protocol_errors, 1);
            ReplyEncoder::new(&mut out, session.protocol).error(&e.message());
        }
        if let Err(ending) =
            flush(&mut stream, &shared, &mut session, &mut out, write_timeout).await
        {
            return ending;
        }
        if fatal.is_some() {
            return Ending::ProtocolError;
        }
        if session.closing {
            return Ending::Quit;
        }
        if inbuf.is_empty() && inbuf.capacity() > BUFFER_KEEP_BYTES {
            inbuf = Vec::with_capacity(READ_CHUNK_BYTES);
        }
        if out.capacity() > BUFFER_KEEP_BYTES {
            out = Vec::with_capacity(READ_CHUNK_BYTES);
        }
        buffers.update(inbuf.capacity() + out.capacity());
    }
}

/// The longest a cluster-port request waits for a switch of its tablet on this server (it is
/// answered as the map then stands: served, `-MOVED` to a move's target, or `-TRYAGAIN` if the
/// switch still runs). A switch takes tens of milliseconds; its drain gives up after 5 s.
const SWITCH_HOLD_MAX: Duration = Duration::from_secs(2);
/// The longest a cluster-port request for a tablet that moves here waits for this server's map
/// to name it the master (the source, a heartbeat ahead, sent the client here), before it is
/// answered as the map then stands (`-MOVED` back to the source). Without it, the two servers
/// redirect the client to each other until their maps agree.
const MOVE_HOLD_MAX: Duration = Duration::from_millis(100);
const SWITCH_HOLD_POLL: Duration = Duration::from_millis(2);

/// The requests from `at` on that continue the run `first` begins (at most `max`, and
/// [`RUN_MAX`](crate::front::commands::RUN_MAX) in all), decoded into `pool` with where each
/// starts; how many, and where the last ends.
fn run_after(
    decoder: &RequestDecoder,
    inbuf: &[u8],
    mut at: usize,
    first: &[&[u8]],
    pool: &mut Vec<(Request, usize)>,
    max: usize,
) -> (usize, usize) {
    let max = max.min(crate::front::commands::RUN_MAX - 1);
    let mut n = 0;
    while n < max && at < inbuf.len() {
        if pool.len() <= n {
            pool.push((Request::default(), 0));
        }
        let (request, start) = &mut pool[n];
        // A pooled request may hold the progress of an incomplete one at another place.
        request.clear();
        match decoder.decode(&inbuf[at..], request) {
            Ok(Some(used))
                if !request.is_empty() && continues_run(first, &request.args(&inbuf[at..])) =>
            {
                *start = at;
                at += used;
                n += 1;
            }
            _ => break,
        }
    }
    (n, at)
}

/// True if the slot of the request's first key switches on this server now.
fn switching_now(session: &Session, args: &[&[u8]]) -> bool {
    let Some(member) = session.member() else {
        return false;
    };
    let view = member.view();
    view.switches_here()
        && crate::front::commands::lookup(args[0])
            .and_then(|spec| crate::front::commands::command_keys(spec, args).next())
            .is_some_and(|key| view.switching_here(ramlog_common::key_slot(key)))
}

/// On a cluster server: holds a command whose first key's slot is in a tablet that switches here
/// now (a move's switch, a split's or a merge's last step) until the switch ends, at most
/// [`SWITCH_HOLD_MAX`], so that clients see the tablet served (or `-MOVED`) rather than
/// `-TRYAGAIN` (which `redis-cli -c` prints rather than retries); and one for a tablet that moves
/// here until this server's map names it master, at most [`MOVE_HOLD_MAX`]. Only this connection
/// waits.
async fn hold_through_switch(session: &Session, args: &[&[u8]]) {
    let Some(member) = session.member() else {
        return;
    };
    let slot = {
        let view = member.view();
        if !view.switches_here() {
            return;
        }
        let Some(slot) = crate::front::commands::lookup(args[0])
            .and_then(|spec| crate::front::commands::command_keys(spec, args).next())
            .map(ramlog_common::key_slot)
        else {
            return;
        };
        slot
    };
    let started = std::time::Instant::now();
    let mut asked = false;
    loop {
        let view = member.view();
        let limit = if view.switching_here(slot) {
            SWITCH_HOLD_MAX
        } else if view.moving_here(slot) {
            if !asked {
                asked = true;
                member.refresh_map_soon();
            }
            MOVE_HOLD_MAX
        } else {
            return;
        };
        if started.elapsed() >= limit {
            return;
        }
        drop(view);
        tokio::time::sleep(SWITCH_HOLD_POLL).await;
    }
}

/// What ended a wait for input.
pub(crate) enum Woke {
    /// Request bytes arrived.
    Input,
    /// Messages for a subscribed connection were encoded into `out`.
    Delivered,
}

/// Waits for request bytes (within the idle timeout, which a subscribed connection does not
/// have, as in Redis) or, once the connection subscribed, for messages, which it encodes into
/// `out`.
pub(crate) async fn wait_input(
    stream: &mut TcpStream,
    inbuf: &mut Vec<u8>,
    idle: Option<Duration>,
    metrics: &Metrics,
    session: &mut Session,
    out: &mut Vec<u8>,
) -> Result<Woke, Ending> {
    let protocol = session.protocol;
    let Some(mailbox) = session.mailbox.as_mut() else {
        read_more(stream, inbuf, idle, metrics).await?;
        return Ok(Woke::Input);
    };
    // Publishers wait for what this subscriber sent before them (`node::pubsub::Input`): it
    // handled all it read, and it is busy again from the moment it reads more.
    let input = mailbox.input().clone();
    input.set_fd(std::os::fd::AsRawFd::as_raw_fd(&*stream));
    input.end();
    tokio::select! {
        read = read_subscribed(stream, inbuf, metrics, &input) => read.map(|()| Woke::Input),
        message = mailbox.next() => {
            let Some(m) = message else {
                return Err(Ending::IoError);
            };
            crate::front::commands::pubsub::encode_message(out, protocol, &m);
            while out.len() < READ_CHUNK_BYTES * 16 {
                match mailbox.try_next() {
                    Some(m) => crate::front::commands::pubsub::encode_message(out, protocol, &m),
                    None => break,
                }
            }
            if mailbox.overflowed() {
                return Err(Ending::SubscriberTooSlow);
            }
            Ok(Woke::Delivered)
        }
    }
}

/// A subscribed connection's read: once the socket is readable the connection is busy
/// ([`Input::begin`](crate::node::pubsub::Input::begin)) before a byte leaves the socket, so a
/// publisher never finds it neither holding unread bytes nor busy while it has requests in hand.
async fn read_subscribed(
    stream: &TcpStream,
    inbuf: &mut Vec<u8>,
    metrics: &Metrics,
    input: &crate::node::pubsub::Input,
) -> Result<(), Ending> {
    loop {
        if stream.readable().await.is_err() {
            return Err(Ending::IoError);
        }
        input.begin();
        if inbuf.capacity() - inbuf.len() < READ_CHUNK_BYTES / 4 {
            inbuf.reserve(READ_CHUNK_BYTES.max(inbuf.len()));
        }
        match stream.try_read_buf(inbuf) {
            Ok(0) => return Err(Ending::ClientClosed),
            Ok(n) => {
                Metrics::add(&metrics.bytes_in, n as u64);
                return Ok(());
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => input.end(),
            Err(_) => return Err(Ending::IoError),
        }
    }
}

/// Reads more request bytes into `inbuf` (growing it when nearly full) within the idle timeout;
/// the end of the connection, an idle timeout or an error is the `Ending`.
pub(crate) async fn read_more(
    stream: &mut TcpStream,
    inbuf: &mut Vec<u8>,
    idle: Option<Duration>,
    metrics: &Metrics,
) -> Result<(), Ending> {
    if inbuf.capacity() - inbuf.len() < READ_CHUNK_BYTES / 4 {
        inbuf.reserve(READ_CHUNK_BYTES.max(inbuf.len()));
    }
    let read = match idle {
        Some(limit) => match tokio::time::timeout(limit, stream.read_buf(inbuf)).await {
            Ok(r) => r,
            Err(_) => return Err(Ending::IdleTimeout),
        },
        None => stream.read_buf(inbuf).await,
    };
    match read {
        Ok(0) => Err(Ending::ClientClosed),
        Ok(n) => {
            Metrics::add(&metrics.bytes_in, n as u64);
            Ok(())
        }
        Err(_) => Err(Ending::IoError),
    }
}

/// The RESP request limits of this server's configuration.
pub fn request_limits(config: &crate::node::config::ServerConfig) -> RequestLimits {
    RequestLimits {
        bulk_len_max: config.request_arg_size_max_bytes as usize,
        array_len_max: config.request_args_max,
        inline_len_max: 64 * 1024,
        request_len_max: config.request_size_max_bytes as usize,
    }
}

/// Writes the buffered replies. When they include replies to writes and the node's durability
/// mode makes acknowledgements wait (`durable`), waits first; if that fails, each write's reply is
/// replaced by a `-MISCONF` error, since what it would have claimed does not hold.
async fn flush(
    stream: &mut TcpStream,
    node: &Node,
    session: &mut Session,
    out: &mut Vec<u8>,
    write_timeout: Duration,
) -> Result<(), Ending> {
    if !session.write_replies.is_empty() || !session.acks.is_empty() {
        if node.acknowledgement_waits(&session.acks) {
            let failures: Vec<Option<String>> = match node.acknowledge(&mut session.acks).await {
                Err(e) => {
                    let reason = match &e {
                        NodeError::WritesRefused { reason } => reason.clone(),
                        other => other.to_string(),
                    };
                    let error = misconf(&reason);
                    vec![Some(error); session.write_replies.len()]
                }
                Ok(refused) if refused.is_empty() => Vec::new(),
                Ok(refused) => crate::node::refused_replies(&session.write_replies, &refused)
                    .into_iter()
                    .map(|r| r.map(|reason| format!("ERR {}", one_line(reason))))
                    .collect(),
            };
            let failed = failures.iter().filter(|f| f.is_some()).count();
            if failed > 0 {
                withdraw_write_replies(out, &session.write_replies, &failures, session.protocol);
                Metrics::add(&node.metrics.writes_refused, failed as u64);
            }
        }
        session.write_replies.clear();
    }
    if out.is_empty() {
        return Ok(());
    }
    match tokio::time::timeout(write_timeout, stream.write_all(out)).await {
        Ok(Ok(())) => {
            Metrics::add(&node.metrics.bytes_out, out.len() as u64);
            out.clear();
            Ok(())
        }
        Ok(Err(_)) => Err(Ending::IoError),
        Err(_) => Err(Ending::WriteTimeout),
    }
}

/// Rebuilds `out` with each held reply whose failure is given (in order, not overlapping)
/// replaced by that error.
fn withdraw_write_replies(
    out: &mut Vec<u8>,
    replies: &[crate::node::HeldReply],
    failures: &[Option<String>],
    protocol: u8,
) {
    let mut rebuilt = Vec::with_capacity(out.len());
    let mut at = 0;
    for (held, failure) in replies.iter().zip(failures) {
        let Some(failure) = failure else { continue };
        debug_assert!(at <= held.start && held.start <= held.end && held.end <= out.len());
        rebuilt.extend_from_slice(&out[at..held.start]);
        ReplyEncoder::new(&mut rebuilt, protocol).error(failure);
        at = held.end;
    }
    rebuilt.extend_from_slice(&out[at..]);
    *out = rebuilt;
}

/// A message on one line (an error reply cannot hold a line break).
fn one_line(s: &str) -> String {
    s.replace(['\r', '\n'], " ")
}
