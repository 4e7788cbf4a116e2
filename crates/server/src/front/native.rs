//! The native-protocol side of a server: one task per connection that reads frames, runs them against
//! the engine and writes the replies back in batches.
//!
//! Owns the connection's life: handshake, AUTH state, limits (frame size, requests in flight, reply size),
//! idle and write timeouts, and resynchronising after an oversize frame. Every request is a call into the
//! service layer ([`Node`]): routing, auth, expiry conversion, write admission, metrics and the
//! acknowledgement wait of the durability mode live there; this module decodes requests and encodes
//! replies, mapping the node's errors to protocol status codes. The byte layout itself lives in
//! `ramlog_proto::native`.
//!
//! Model: the task reads whatever bytes arrived, answers every complete frame in them in order (engine
//! calls take microseconds, so no request waits on another connection), and writes all the replies in one
//! write. A client that stops reading only stalls its own task (and is cut after `write_timeout`).
//! Requests that may take long (filtered scans) are the exception: they run as jobs
//! on the blocking pool (see `native_scan.rs`) and their replies are written when they finish, while the
//! connection goes on answering its other requests.

use crate::node::metrics::Op;
use crate::node::{Node, NodeError};
use bytes::{Buf, BytesMut};
use ramlog_common::{glob_match, key_slot, TableId};
use ramlog_logmem::{EngineError, TabletId};
use ramlog_proto::native::{
    encode_error, opcode, parse_header, ClientHello, Condition, Expiry, FrameError, Request,
    ServerHello, Status, CLIENT_HELLO_LEN, FRAME_BYTES_HARD_MAX, HEADER_LEN,
    HELLO_FLAG_AUTH_REQUIRED, HELLO_FLAG_REFUSED, PROTOCOL_VERSION, REFUSAL_BODY_MAX_BYTES,
    SCAN_COUNT_MAX,
};
use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

#[path = "native_scan.rs"]
mod scan;
pub use scan::ScanLimits;

/// Limits and settings of native connections. `Default` gives the documented defaults.
#[derive(Clone)]
pub struct NativeConfig {
    /// Largest request frame, header included. Larger frames get FRAME_TOO_LARGE.
    pub max_frame_bytes: usize,
    /// Most requests answered per batch (pipeline depth); requests beyond it in the same batch get BUSY.
    pub max_in_flight: usize,
    /// Oversize frames up to this size are skipped and the connection goes on; larger ones close it.
    pub resync_max_bytes: usize,
    /// Largest reply (MULTI_GET, SCAN_KEYS); a larger one is replaced by FRAME_TOO_LARGE.
    pub max_reply_bytes: usize,
    /// Replies buffered before they are written out mid-batch.
    pub reply_flush_bytes: usize,
    /// Close a connection that sends nothing for this long; zero = never.
    pub idle_timeout: Duration,
    /// Close a connection whose replies cannot be written for this long (a client that stopped reading).
    pub write_timeout: Duration,
    /// Time allowed for the client hello.
    pub handshake_timeout: Duration,
    /// Announced in the server hello (the engine enforces its own limits).
    pub key_size_max_bytes: usize,
    pub value_size_max_bytes: usize,
    /// Snapshots and paged scans per connection, and the size of scan pages.
    pub scan: ScanLimits,
}

impl NativeConfig {
    /// The native protocol's settings, from the server's configuration.
    pub fn from_server(config: &crate::node::config::ServerConfig) -> NativeConfig {
        NativeConfig {
            idle_timeout: Duration::from_secs(config.idle_timeout_secs),
            write_timeout: Duration::from_secs(config.write_timeout_secs.max(1)),
            key_size_max_bytes: config.key_size_max_bytes as usize,
            value_size_max_bytes: config.value_size_max_bytes as usize,
            ..NativeConfig::default()
        }
    }
}

impl Default for NativeConfig {
    fn default() -> Self {
        NativeConfig {
            max_frame_bytes: 8 << 20,
            max_in_flight: 1024,
            resync_max_bytes: 256 << 20,
            max_reply_bytes: 64 << 20,
            reply_flush_bytes: 1 << 20,
            idle_timeout: Duration::ZERO,
            write_timeout: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(10),
            key_size_max_bytes: ramlog_common::KEY_SIZE_MAX_BYTES_DEFAULT,
            value_size_max_bytes: ramlog_common::VALUE_SIZE_MAX_BYTES_DEFAULT,
            scan: ScanLimits::default(),
        }
    }
}

impl fmt::Debug for NativeConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NativeConfig")
            .field("max_frame_bytes", &self.max_frame_bytes)
            .field("max_in_flight", &self.max_in_flight)
            .field("resync_max_bytes", &self.resync_max_bytes)
            .field("max_reply_bytes", &self.max_reply_bytes)
            .field("idle_timeout", &self.idle_timeout)
            .field("write_timeout", &self.write_timeout)
            .field("scan", &self.scan)
            .finish_non_exhaustive()
    }
}

/// Serve one native-protocol connection until the client leaves, breaks the protocol beyond repair, idles
/// out or stops reading. Never panics on client input; errors end the connection and are logged at debug.
pub async fn serve_native_connection(
    stream: TcpStream,
    node: Arc<Node>,
    cluster: Option<Arc<crate::cluster::Roles>>,
    config: Arc<NativeConfig>,
) {
    let peer = stream.peer_addr().ok();
    if let Err(e) = serve(stream, node, cluster, &config).await {
        tracing::debug!(?peer, "native connection closed: {e}");
    }
}

#[derive(Debug)]
enum Closed {
    Io(std::io::Error),
    Reason(&'static str),
}

impl fmt::Display for Closed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Closed::Io(e) => write!(f, "{e}"),
            Closed::Reason(r) => f.write_str(r),
        }
    }
}

impl From<std::io::Error> for Closed {
    fn from(e: std::io::Error) -> Self {
        Closed::Io(e)
    }
}

/// Per-connection state that requests see.
struct Session<'a> {
    node: &'a Node,
    /// A cluster server's roles (None when standalone).
    cluster: Option<Arc<crate::cluster::Roles>>,
    config: &'a NativeConfig,
    authenticated: bool,
    /// Replies to writes in the output buffer not yet written to the socket, as (start, end,
    /// request id, opcode): in `durable` mode they go out only after [`Node::acknowledge`], and are
    /// replaced by WRITES_REFUSED errors if it fails.
    write_replies: Vec<(crate::node::HeldReply, u64, u8)>,
    /// What this connection's replies wait for (see [`Node::acknowledge`]).
    acks: crate::node::Acks,
    /// Scratch space reused across SCAN_KEYS requests.
    scan_keys: Vec<Vec<u8>>,
    /// Open snapshots and paged scans.
    scans: scan::ScanSession,
    /// Jobs created by the requests just answered, for the connection task to run.
    new_jobs: Vec<QueuedJob>,
    /// Jobs queued or running, not yet answered.
    jobs_outstanding: usize,
}

/// How long a SNAPSHOT_CUT waits for the backups of the writes its snapshot sees.
const CUT_SETTLE_MAX: Duration = Duration::from_secs(10);

/// A request's blocking work with what the metrics need.
struct QueuedJob {
    id: u64,
    op: u8,
    started: Instant,
    job: scan::Job,
}

/// What a finished job hands back: (opcode, start time, reply frame).
type JobDone = (u8, Instant, BytesMut);

/// Run a job on the scan threads (`scan_pool`: below the request path's priority); a panic
/// becomes an INTERNAL error reply.
fn spawn_job(jobs: &mut JoinSet<JobDone>, j: QueuedJob) {
    jobs.spawn(async move {
        let QueuedJob {
            id,
            op,
            started,
            job,
        } = j;
        let frame = crate::front::scan_pool::run(job).await.unwrap_or_else(|| {
            let mut out = BytesMut::new();
            encode_error(
                &mut out,
                id,
                op,
                Status::Internal,
                0,
                "the request failed inside the server",
            );
            out
        });
        (op, started, frame)
    });
}

enum Event {
    Read(std::io::Result<usize>),
    IdleTimeout,
    JobDone(Result<JobDone, tokio::task::JoinError>),
}

async fn read_some(
    stream: &mut TcpStream,
    input: &mut BytesMut,
    idle_timeout: Option<Duration>,
) -> Event {
    let read = stream.read_buf(input);
    match idle_timeout {
        None => Event::Read(read.await),
        Some(t) => match tokio::time::timeout(t, read).await {
            Ok(r) => Event::Read(r),
            Err(_) => Event::IdleTimeout,
        },
    }
}

async fn write_with_timeout(
    stream: &mut TcpStream,
    buf: &[u8],
    timeout: Duration,
) -> Result<(), Closed> {
    match tokio::time::timeout(timeout, stream.write_all(buf)).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(Closed::Reason("client did not read its replies in time")),
    }
}

/// Read the client hello; returns the version to speak (0 = none in common).
async fn read_client_hello(stream: &mut TcpStream, timeout: Duration) -> Result<u16, Closed> {
    let mut hello = [0u8; CLIENT_HELLO_LEN];
    match tokio::time::timeout(timeout, stream.read_exact(&mut hello)).await {
        Ok(r) => {
            r?;
        }
        Err(_) => return Err(Closed::Reason("no client hello in time")),
    }
    // Not a ramlog client (a Redis client on the wrong port, say): close without a word.
    let client =
        ClientHello::decode(&hello).map_err(|_| Closed::Reason("bad magic in client hello"))?;
    Ok(if client.version_max >= PROTOCOL_VERSION {
        PROTOCOL_VERSION
    } else {
        0
    })
}

fn server_hello(config: &NativeConfig, version: u16, flags: u16) -> ServerHello {
    let clamp = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    ServerHello {
        version,
        flags,
        max_frame_bytes: clamp(
            config
                .max_frame_bytes
                .clamp(HEADER_LEN + 64, FRAME_BYTES_HARD_MAX),
        ),
        max_in_flight: clamp(config.max_in_flight.max(1)),
        key_size_max_bytes: clamp(config.key_size_max_bytes),
        value_size_max_bytes: clamp(config.value_size_max_bytes),
    }
}

/// Turn a native client away with a clear error (for example when the server is at its connection
/// limit): the handshake completes with the REFUSED flag, one error frame (request id 0, status BUSY,
/// `message`) follows, and the connection is closed. Takes at most a few seconds.
pub async fn refuse_native_connection(mut stream: TcpStream, message: &str) {
    let timeout = Duration::from_secs(2);
    let Ok(version) = read_client_hello(&mut stream, timeout).await else {
        return;
    };
    let config = NativeConfig::default();
    let mut out = BytesMut::new();
    out.extend_from_slice(&server_hello(&config, version, HELLO_FLAG_REFUSED).encode());
    let mut message = message.to_string();
    while message.len() > REFUSAL_BODY_MAX_BYTES - 12 {
        message.pop();
    }
    encode_error(&mut out, 0, 0, Status::Busy, 0, &message);
    let _ = write_with_timeout(&mut stream, &out, timeout).await;
    let _ = stream.shutdown().await;
}

/// Writes the replies in `output`. When they include replies to writes and the node's durability
/// mode makes acknowledgements wait, waits first; if the wait fails, each write's reply is replaced
/// by a WRITES_REFUSED error, since its promise does not hold.
async fn send_replies(
    stream: &mut TcpStream,
    session: &mut Session<'_>,
    output: &mut BytesMut,
    timeout: Duration,
) -> Result<(), Closed> {
    if !session.write_replies.is_empty() || !session.acks.is_empty() {
        if session.node.acknowledgement_waits(&session.acks) {
            let failures: Vec<Option<String>> =
                match session.node.acknowledge(&mut session.acks).await {
                    Err(e) => {
                        vec![Some(format!("not acknowledged: {e}")); session.write_replies.len()]
                    }
                    Ok(refused) if refused.is_empty() => Vec::new(),
                    Ok(refused) => {
                        let held: Vec<_> = session.write_replies.iter().map(|w| w.0).collect();
                        crate::node::refused_replies(&held, &refused)
                            .into_iter()
                            .map(|r| r.map(str::to_string))
                            .collect()
                    }
                };
            let failed = failures.iter().filter(|f| f.is_some()).count();
            if failed > 0 {
                withdraw_write_replies(output, &session.write_replies, &failures);
                crate::node::metrics::Metrics::add(
                    &session.node.metrics.writes_refused,
                    failed as u64,
                );
            }
        }
        session.write_replies.clear();
    }
    if !output.is_empty() {
        write_with_timeout(stream, output, timeout).await?;
        output.clear();
    }
    Ok(())
}

/// Rebuilds `output` with each held write reply whose failure is given (in order, not
/// overlapping) replaced by an error frame for the same request.
fn withdraw_write_replies(
    output: &mut BytesMut,
    replies: &[(crate::node::HeldReply, u64, u8)],
    failures: &[Option<String>],
) {
    let mut rebuilt = BytesMut::with_capacity(output.len());
    let mut at = 0;
    for (&(held, id, op), failure) in replies.iter().zip(failures) {
        let Some(message) = failure else { continue };
        let (start, end) = (held.start, held.end);
        debug_assert!(at <= start && start <= end && end <= output.len());
        rebuilt.extend_from_slice(&output[at..start]);
        encode_error(&mut rebuilt, id, op, Status::WritesRefused, 0, message);
        at = end;
    }
    rebuilt.extend_from_slice(&output[at..]);
    *output = rebuilt;
}

/// Turns a native connection into a replication stream from a master (see
/// [`crate::cluster::backup`]) once its `REPL_HELLO` is accepted; answers an error and closes
/// otherwise.
/// A connection's `REPL_HELLO` request, with whether the connection authenticated.
struct ReplicationHello<'a> {
    authenticated: bool,
    request_id: u64,
    body: &'a [u8],
}

async fn serve_replication(
    mut stream: TcpStream,
    node: Arc<Node>,
    cluster: Option<Arc<crate::cluster::Roles>>,
    ReplicationHello {
        authenticated,
        request_id,
        body,
    }: ReplicationHello<'_>,
    leftover: Vec<u8>,
    config: &NativeConfig,
) -> Result<(), Closed> {
    let checked = (|| {
        if !authenticated {
            return Err((Status::NoAuth, "AUTH first".to_string()));
        }
        let hello = ramlog_proto::repl::Hello::decode(body).map_err(|e| (e.status, e.message))?;
        let Some((roles, member)) = cluster
            .as_ref()
            .and_then(|c| c.member().map(|m| (c, m.clone())))
        else {
            return Err((
                Status::Unsupported,
                "this server is not in a cluster; it takes no replication".to_string(),
            ));
        };
        roles.backup.check_hello(Some(&member), &hello)?;
        Ok((hello, roles.backup.clone(), member))
    })();
    let mut out = BytesMut::new();
    let (hello, backup, member) = match checked {
        Ok(v) => v,
        Err((status, message)) => {
            encode_error(
                &mut out,
                request_id,
                opcode::REPL_HELLO,
                status,
                0,
                &message,
            );
            let _ = write_with_timeout(&mut stream, &out, config.write_timeout).await;
            return Err(Closed::Reason("replication hello refused"));
        }
    };
    let mut ok = Vec::new();
    ramlog_proto::repl::encode_frame(
        &mut ok,
        request_id,
        opcode::REPL_HELLO,
        Status::Ok.to_u8(),
        &[],
    );
    write_with_timeout(&mut stream, &ok, config.write_timeout).await?;
    let socket = stream.into_std()?;
    socket.set_nonblocking(false)?;
    tracing::info!(
        master = hello.master,
        epoch = hello.master_epoch,
        "replication stream opened"
    );
    let _ =
        tokio::task::spawn_blocking(move || backup.serve(node, member, socket, leftover, hello))
            .await;
    Ok(())
}

/// Whether a request of this opcode changes data (and so waits for the acknowledgement point).
fn is_write(op: u8) -> bool {
    matches!(
        op,
        opcode::PUT
            | opcode::DELETE
            | opcode::INCREMENT
            | opcode::EXPIRE
            | opcode::MULTI_PUT
            | opcode::RESP_BATCH
            | opcode::RESP_PASS
    )
}

async fn serve(
    mut stream: TcpStream,
    node_arc: Arc<Node>,
    cluster: Option<Arc<crate::cluster::Roles>>,
    config: &NativeConfig,
) -> Result<(), Closed> {
    let node: &Node = &node_arc;
    let _ = stream.set_nodelay(true);
    let version = read_client_hello(&mut stream, config.handshake_timeout).await?;
    let flags = if node.password_required() {
        HELLO_FLAG_AUTH_REQUIRED
    } else {
        0
    };
    let server_hello = server_hello(config, version, flags);
    let max_frame_bytes = server_hello.max_frame_bytes as usize;
    write_with_timeout(&mut stream, &server_hello.encode(), config.write_timeout).await?;
    if version == 0 {
        return Err(Closed::Reason("no protocol version in common"));
    }

    let mut session = Session {
        node,
        cluster,
        config,
        authenticated: !node.password_required(),
        write_replies: Vec::new(),
        acks: Default::default(),
        scan_keys: Vec::new(),
        scans: scan::ScanSession::new(node.engine().clone(), config.scan),
        new_jobs: Vec::new(),
        jobs_outstanding: 0,
    };
    let mut input = BytesMut::with_capacity(16 * 1024);
    let mut output = BytesMut::with_capacity(16 * 1024);
    // Bytes of an oversize frame still to be discarded.
    let mut skip_bytes = 0usize;
    // Blocking jobs running, and those waiting for a turn.
    let mut jobs: JoinSet<JobDone> = JoinSet::new();
    let mut waiting: VecDeque<QueuedJob> = VecDeque::new();
    let mut buffers = crate::node::metrics::BufferGauge::new(&node.metrics);
    loop {
        buffers.update(input.capacity() + output.capacity());
        waiting.extend(session.new_jobs.drain(..));
        while jobs.len() < config.scan.jobs_running_max.max(1) {
            let Some(job) = waiting.pop_front() else {
                break;
            };
            spawn_job(&mut jobs, job);
        }
        if input.capacity() - input.len() < 4096 {
            input.reserve(16 * 1024);
        }
        // A client waiting for a long scan is not idle.
        let idle_timeout =
            (!config.idle_timeout.is_zero() && jobs.is_empty()).then_some(config.idle_timeout);
        let event = tokio::select! {
            event = read_some(&mut stream, &mut input, idle_timeout) => event,
            Some(done) = jobs.join_next(), if !jobs.is_empty() => Event::JobDone(done),
        };
        let n = match event {
            Event::Read(r) => r?,
            Event::IdleTimeout => {
                encode_error(
                    &mut output,
                    0,
                    0,
                    Status::BadRequest,
                    0,
                    "idle timeout: closing the connection",
                );
                let _ = write_with_timeout(&mut stream, &output, config.write_timeout).await;
                return Err(Closed::Reason("idle timeout"));
            }
            Event::JobDone(done) => {
                session.jobs_outstanding = session.jobs_outstanding.saturating_sub(1);
                let (op, started, frame) =
                    done.map_err(|_| Closed::Reason("a scan job was lost"))?;
                node.record(
                    native_op(op),
                    started.elapsed(),
                    frame.get(13) == Some(&Status::Ok.to_u8()),
                );
                write_with_timeout(&mut stream, &frame, config.write_timeout).await?;
                continue;
            }
        };
        if n == 0 {
            return Ok(());
        }
        if skip_bytes > 0 {
            let discard = skip_bytes.min(input.len());
            input.advance(discard);
            skip_bytes -= discard;
        }
        let mut answered = 0usize;
        while skip_bytes == 0 {
            match parse_header(&input, max_frame_bytes) {
                Ok(None) => break,
                Ok(Some(header)) => {
                    let frame_bytes = header.frame_bytes();
                    if input.len() < frame_bytes {
                        input.reserve(frame_bytes - input.len());
                        break;
                    }
                    if header.opcode == opcode::REPL_HELLO {
                        // A master opening a replication stream: the connection becomes one.
                        let body = input[HEADER_LEN..frame_bytes].to_vec();
                        input.advance(frame_bytes);
                        send_replies(&mut stream, &mut session, &mut output, config.write_timeout)
                            .await?;
                        let authenticated = session.authenticated;
                        let cluster = session.cluster.take();
                        drop(session);
                        return serve_replication(
                            stream,
                            node_arc.clone(),
                            cluster,
                            ReplicationHello {
                                authenticated,
                                request_id: header.request_id,
                                body: &body,
                            },
                            input.to_vec(),
                            config,
                        )
                        .await;
                    }
                    answered += 1;
                    if answered > config.max_in_flight.max(1) {
                        let message = format!(
                            "more than {} requests in flight on this connection; wait for replies",
                            config.max_in_flight
                        );
                        encode_error(
                            &mut output,
                            header.request_id,
                            header.opcode,
                            Status::Busy,
                            config.max_in_flight as u64,
                            &message,
                        );
                    } else {
                        let body = &input[HEADER_LEN..frame_bytes];
                        let reply_at = output.len();
                        let jobs_before = session.new_jobs.len();
                        let started = Instant::now();
                        let (changes_before, units_from) =
                            (session.acks.changes(), session.acks.units_len());
                        session.answer(
                            header.request_id,
                            header.opcode,
                            header.flags_or_status,
                            header.reserved,
                            body,
                            &mut output,
                        );
                        let units_to = session.acks.units_len();
                        let read_waits = session.acks.changes() != changes_before;
                        // A request that became a job is reported when the job is done.
                        let queued = session.new_jobs.len() > jobs_before;
                        if !queued {
                            let ok = output.get(reply_at + 13) == Some(&Status::Ok.to_u8());
                            node.record(native_op(header.opcode), started.elapsed(), ok);
                            if ok && (is_write(header.opcode) || read_waits) {
                                session.write_replies.push((
                                    crate::node::HeldReply {
                                        start: reply_at,
                                        end: output.len(),
                                        units_from,
                                        units_to,
                                    },
                                    header.request_id,
                                    header.opcode,
                                ));
                            }
                        }
                    }
                    input.advance(frame_bytes);
                    if output.len() >= config.reply_flush_bytes {
                        send_replies(&mut stream, &mut session, &mut output, config.write_timeout)
                            .await?;
                        answered = 0;
                    }
                }
                Err(FrameError::TooShort { .. }) => {
                    encode_error(
                        &mut output,
                        0,
                        0,
                        Status::BadRequest,
                        0,
                        "frame length shorter than the header; closing",
                    );
                    send_replies(&mut stream, &mut session, &mut output, config.write_timeout)
                        .await?;
                    return Err(Closed::Reason("frame shorter than its header"));
                }
                Err(FrameError::TooLarge {
                    frame_bytes,
                    max_bytes,
                    request_id,
                    opcode,
                    skip_bytes: body_len,
                }) => {
                    let resync = frame_bytes <= config.resync_max_bytes;
                    let message = format!(
                        "frame of {frame_bytes} bytes exceeds the limit of {max_bytes} bytes{}",
                        if resync { "" } else { "; closing" }
                    );
                    encode_error(
                        &mut output,
                        request_id,
                        opcode,
                        Status::FrameTooLarge,
                        max_bytes as u64,
                        &message,
                    );
                    if !resync {
                        send_replies(&mut stream, &mut session, &mut output, config.write_timeout)
                            .await?;
                        return Err(Closed::Reason("absurd frame length"));
                    }
                    input.advance(HEADER_LEN);
                    let discard = body_len.min(input.len());
                    input.advance(discard);
                    skip_bytes = body_len - discard;
                }
            }
        }
        send_replies(&mut stream, &mut session, &mut output, config.write_timeout).await?;
        // Give back memory a large frame or reply left behind.
        if input.is_empty() && input.capacity() > 1 << 20 {
            input = BytesMut::with_capacity(16 * 1024);
        }
        if output.capacity() > config.reply_flush_bytes.max(1 << 20) * 2 {
            output = BytesMut::with_capacity(16 * 1024);
        }
    }
}

fn engine_condition(condition: Condition) -> ramlog_logmem::Condition {
    match condition {
        Condition::None => ramlog_logmem::Condition::None,
        Condition::IfAbsent => ramlog_logmem::Condition::IfAbsent,
        Condition::IfExists => ramlog_logmem::Condition::IfExists,
        Condition::IfVersion(v) => ramlog_logmem::Condition::IfVersion(v),
    }
}

/// An error reply: status, detail number, message.
pub(crate) struct Failure(Status, u64, String);

impl From<NodeError> for Failure {
    fn from(e: NodeError) -> Self {
        match e {
            NodeError::Engine(e) => e.into(),
            NodeError::WritesRefused { .. } => Failure(Status::WritesRefused, 0, e.to_string()),
        }
    }
}

impl From<EngineError> for Failure {
    fn from(e: EngineError) -> Self {
        let message = e.to_string();
        match e {
            EngineError::ConditionFailed { current } => Failure(
                Status::ConditionFailed,
                current.map(|o| o.version).unwrap_or(0),
                message,
            ),
            EngineError::NotAnInteger => Failure(Status::NotAnInteger, 0, message),
            EngineError::IncrementOverflow => Failure(Status::IncrementOverflow, 0, message),
            EngineError::KeyTooLarge { max, .. } => {
                Failure(Status::KeyTooLarge, max as u64, message)
            }
            EngineError::ValueTooLarge { max, .. } => {
                Failure(Status::ValueTooLarge, max as u64, message)
            }
            EngineError::BatchTooLarge { max, .. } => {
                Failure(Status::ValueTooLarge, max as u64, message)
            }
            EngineError::OutOfMemory { .. } | EngineError::TabletFull { .. } => {
                Failure(Status::OutOfMemory, 0, message)
            }
            EngineError::NoSuchTablet(_) | EngineError::Frozen => {
                Failure(Status::WrongServer, 0, message)
            }
            EngineError::SnapshotTooOld { version, .. } => {
                Failure(Status::SnapshotTooOld, version, message)
            }
            EngineError::Query(m) => Failure(Status::BadRequest, 0, format!("bad query: {m}")),
            _ => Failure(Status::Internal, 0, message),
        }
    }
}

impl Session<'_> {
    /// This cluster server's membership (None when standalone).
    fn member(&self) -> Option<&Arc<crate::cluster::Member>> {
        self.cluster.as_ref().and_then(|c| c.member())
    }

    /// Runs RESP commands a routing port forwarded here, in order, as one RESP connection would
    /// (the batch's own MULTI state included), and returns each reply.
    fn resp_batch(&mut self, protocol: u8, commands: &[Vec<&[u8]>]) -> Vec<bytes::Bytes> {
        let mut session = crate::front::commands::Session::new(0, false, self.cluster.clone());
        session.protocol = protocol;
        session.routed = true;
        session.forwarded = true;
        // Every reply into one buffer, handed out as slices of it: one allocation per batch.
        let mut out = Vec::new();
        let ends: Vec<usize> = commands
            .iter()
            .map(|args| {
                crate::front::commands::execute(self.node, &mut session, args, &mut out);
                out.len()
            })
            .collect();
        self.acks.absorb(&mut session.acks);
        let all = bytes::Bytes::from(out);
        let mut start = 0;
        ends.into_iter()
            .map(|end| {
                let reply = all.slice(start..end);
                start = end;
                reply
            })
            .collect()
    }

    /// The engine tablet of a SCAN_TABLET: the tablet of `table` that covers exactly
    /// `first..=last` at `epoch` and that this server masters now (not recovering, not
    /// switching); WRONG_SERVER otherwise, so that the client refreshes its map and scans the
    /// tablets it then names.
    fn scanned_tablet(
        &self,
        table: TableId,
        first: u16,
        last: u16,
        epoch: u64,
    ) -> Result<TabletId, Failure> {
        let Some(member) = self.member() else {
            return Err(Failure(
                Status::BadRequest,
                0,
                "SCAN_TABLET is for cluster servers; a standalone server answers SCAN_FILTERED"
                    .into(),
            ));
        };
        if let Some(refusal) = member.lease_refusal() {
            return Err(Failure(Status::WrongServer, 0, refusal));
        }
        let view = member.view();
        let refuse = |why: String| {
            Err(Failure(
                Status::WrongServer,
                0,
                format!(
                    "slots {first}-{last} of table {table} at epoch {epoch}: {why} (map version {}); refresh the cluster map",
                    view.map.version
                ),
            ))
        };
        let Some(t) = view
            .map
            .tablet_at(table, first)
            .filter(|t| t.first_slot == first && t.last_slot == last && t.epoch == epoch)
        else {
            return refuse("no such tablet in this server's map".into());
        };
        if t.master != view.me || t.recovering || t.switching() {
            return refuse(format!(
                "this server does not serve it now (master {}{}{})",
                t.master,
                if t.recovering { ", recovering" } else { "" },
                if t.switching() { ", switching" } else { "" }
            ));
        }
        match member.created_tablet(table, first) {
            Some(id) => Ok(id),
            None => refuse("its tablet is not in this server's memory".into()),
        }
    }

    /// SNAPSHOT_CUT (see [`scan::ScanSession::snapshot_cut`]): on a cluster server, the cut
    /// covers the tablets of `table` it masters and serves, and waits for their backups.
    fn snapshot_cut(
        &self,
        id: u64,
        table: TableId,
        at_unix_ns: u64,
        hold_us: u32,
    ) -> Result<scan::Job, Failure> {
        let hold = Duration::from_micros(u64::from(hold_us));
        let Some(member) = self.member().cloned() else {
            return self
                .scans
                .snapshot_cut(id, at_unix_ns, hold, Vec::new, |_| Ok(()));
        };
        if let Some(refusal) = member.lease_refusal() {
            return Err(Failure(Status::WrongServer, 0, refusal));
        }
        let served = {
            let member = member.clone();
            move || {
                let view = member.view();
                if member.lease_refusal().is_some() {
                    return Vec::new();
                }
                view.map
                    .tablets_of(table)
                    .filter(|t| t.master == view.me && !t.recovering && !t.switching())
                    .map(|t| (t.table, t.first_slot, t.last_slot, t.epoch))
                    .collect()
            }
        };
        let settle = move |tablets: &[scan::CutTablet]| {
            for &(table, first, _, _) in tablets {
                if let Some(engine_tablet) = member.created_tablet(table, first) {
                    member
                        .replication
                        .drain(engine_tablet, CUT_SETTLE_MAX, || true)?;
                }
            }
            Ok(())
        };
        self.scans
            .snapshot_cut(id, at_unix_ns, hold, served, settle)
    }

    /// SCAN_TABLET on a mirror: the engine tablet holding the mirrored tablet of `table` at
    /// exactly `first..=last` and `epoch`, with a snapshot for the scan; WRONG_SERVER unless
    /// this server mirrors it now with its memory complete.
    fn mirrored_tablet(
        &self,
        table: TableId,
        first: u16,
        last: u16,
        epoch: u64,
    ) -> Result<(TabletId, ramlog_logmem::Snapshot), Failure> {
        let refuse = |why: String| {
            Failure(
                Status::WrongServer,
                0,
                format!("slots {first}-{last} of table {table} at epoch {epoch}: {why}; read its master"),
            )
        };
        let member = self.member().ok_or_else(|| {
            Failure(
                Status::BadRequest,
                0,
                "SCAN_TABLET is for cluster servers; a standalone server answers SCAN_FILTERED"
                    .into(),
            )
        })?;
        if let Some(refusal) = member.lease_refusal() {
            return Err(Failure(Status::WrongServer, 0, refusal));
        }
        let view = member.view();
        let mirrored = view.map.tablet_at(table, first).is_some_and(|t| {
            t.first_slot == first
                && t.last_slot == last
                && t.epoch == epoch
                && t.mirror == Some(view.me)
                && !t.recovering
        });
        if !mirrored {
            return Err(refuse(format!(
                "this server does not mirror it (map version {})",
                view.map.version
            )));
        }
        let mirror = member
            .mirrors
            .get(table, first)
            .ok_or_else(|| refuse("its mirror is not set up here yet".into()))?;
        let snapshot = mirror.scan_snapshot(self.node.engine()).map_err(refuse)?;
        crate::node::metrics::Metrics::add(&self.node.metrics.mirror_scans, 1);
        Ok((mirror.engine_tablet, snapshot))
    }

    fn tablet(&self, table: TableId, key: &[u8]) -> Result<TabletId, Failure> {
        if let Some(member) = self.member() {
            if let Some(refusal) = member.lease_refusal() {
                return Err(Failure(Status::WrongServer, 0, refusal));
            }
            match member.view().route_key(table, key) {
                crate::cluster::Route::Here => {}
                crate::cluster::Route::Recovering => {
                    return Err(Failure(
                        Status::WrongServer,
                        0,
                        format!(
                            "slot {} of table {table} is being recovered after its master failed, or switching to the server it moves to; retry",
                            key_slot(key)
                        ),
                    ))
                }
                crate::cluster::Route::Waiting(why) => {
                    return Err(Failure(
                        Status::ClusterDown,
                        0,
                        format!(
                            "slot {} of table {table} is unavailable: its master failed and the tablet waits for memory to be restored ({why})",
                            key_slot(key)
                        ),
                    ))
                }
                crate::cluster::Route::Moved(addr) => {
                    return Err(Failure(
                        Status::WrongServer,
                        0,
                        format!(
                            "slot {} of table {table} is served by {addr}; refresh the cluster map",
                            key_slot(key)
                        ),
                    ))
                }
                crate::cluster::Route::Down => {
                    return Err(Failure(
                        Status::NoSuchTable,
                        0,
                        format!(
                            "no server serves slot {} of table {table} (no such table in the cluster map)",
                            key_slot(key)
                        ),
                    ))
                }
            }
        }
        self.node.locate(table, key).ok_or_else(|| {
            Failure(
                Status::WrongServer,
                0,
                format!(
                    "this server owns no tablet of table {table} for slot {}",
                    key_slot(key)
                ),
            )
        })
    }

    /// The reply for an engine error on `key`. A failed condition reports the key's current version (read
    /// right after the failure when the engine did not return it; 0 = absent).
    fn failure(&self, tablet: TabletId, key: &[u8], e: NodeError) -> Failure {
        match e {
            NodeError::Engine(EngineError::ConditionFailed { current: None }) => {
                let version = self
                    .node
                    // The reply is an error, which waits for nothing.
                    .read_with(
                        tablet,
                        key,
                        &mut crate::node::Acks::default(),
                        |_, version, _| version,
                    )
                    .ok()
                    .flatten();
                Failure(
                    Status::ConditionFailed,
                    version.unwrap_or(0),
                    "condition failed".into(),
                )
            }
            e => e.into(),
        }
    }

    /// Queue a request's blocking work; its reply is written when it is done.
    fn queue_job(&mut self, id: u64, op: u8, job: scan::Job) -> Result<(), Failure> {
        self.new_jobs.push(QueuedJob {
            id,
            op,
            started: Instant::now(),
            job,
        });
        self.jobs_outstanding += 1;
        Ok(())
    }

    /// Refuse new scan work when as many requests as the in-flight limit wait for jobs.
    fn check_job_room(&self) -> Result<(), Failure> {
        let max = self.config.max_in_flight.max(1);
        if self.jobs_outstanding >= max {
            return Err(Failure(
                Status::Busy,
                max as u64,
                format!("{max} scans are unanswered on this connection; wait for replies"),
            ));
        }
        Ok(())
    }

    /// Decode and run one request, appending one reply frame to `out` (or queueing a job that
    /// produces it later).
    fn answer(
        &mut self,
        request_id: u64,
        op: u8,
        flags: u8,
        reserved: u16,
        body: &[u8],
        out: &mut BytesMut,
    ) {
        let start = out.len();
        let result = if reserved != 0 {
            Err(Failure(
                Status::BadRequest,
                0,
                "header bytes 14..16 must be zero".into(),
            ))
        } else {
            match Request::decode(op, flags, body) {
                Ok(request) => self.run(request_id, &request, out),
                Err(e) => Err(Failure(e.status, 0, e.message)),
            }
        };
        if let Err(Failure(status, detail, message)) = result {
            out.truncate(start);
            encode_error(out, request_id, op, status, detail, &message);
        }
    }

    fn run(&mut self, id: u64, request: &Request<'_>, out: &mut BytesMut) -> Result<(), Failure> {
        use ramlog_proto::native::{Object, Response};
        let op = request.opcode();
        if !self.authenticated && !matches!(request, Request::Ping { .. } | Request::Auth { .. }) {
            return Err(Failure(
                Status::NoAuth,
                0,
                "authentication required: send AUTH first".into(),
            ));
        }
        // The old value a PUT returns, if it was a string (a collection is absent to it).
        let string_object = |o: ramlog_logmem::Object| {
            ramlog_proto::types::string_of(&o.value).map(|s| Object {
                value: bytes::Bytes::copy_from_slice(s),
                version: o.version,
                expire_at_ms: o.expire_at_ms,
            })
        };
        let reply = match request {
            Request::Ping { payload } => Response::Pong(bytes::Bytes::copy_from_slice(payload)),
            Request::Auth { password } => {
                if self.node.password_ok(password) {
                    self.authenticated = true;
                    Response::AuthOk
                } else {
                    self.authenticated = false;
                    return Err(Failure(Status::AuthFailed, 0, "wrong password".into()));
                }
            }
            Request::Stats => Response::Stats(self.node.status_json().into()),
            Request::Get { table, key } => {
                let tablet = self.tablet(*table, key)?;
                // Encode straight from the engine's memory: no copy of the value besides the one into `out`.
                let found = self.node.read_with(
                    tablet,
                    key,
                    &mut self.acks,
                    |value, version, expire_at_ms| match ramlog_proto::types::string_of(value) {
                        Some(s) => {
                            get_reply(out, id, s, version, expire_at_ms);
                            true
                        }
                        None => false,
                    },
                )?;
                match found {
                    None => Response::Get(None).encode(id, op, out),
                    Some(false) => return Err(wrong_type()),
                    Some(true) => {}
                }
                return Ok(());
            }
            Request::Put {
                table,
                key,
                value,
                condition,
                expiry,
                return_old,
            } => {
                let tablet = self.tablet(*table, key)?;
                let stored = self
                    .node
                    .stored_string(value)
                    .map_err(|e| self.failure(tablet, key, e))?;
                let options = ramlog_logmem::PutOptions {
                    condition: engine_condition(*condition),
                    expire_at_ms: self.node.expire_at_ms(*expiry),
                    keep_ttl: *expiry == Expiry::Keep,
                    return_old: *return_old,
                };
                let outcome = self
                    .node
                    .put(tablet, key, &stored, &options, &mut self.acks)
                    .map_err(|e| self.failure(tablet, key, e))?;
                Response::Put {
                    version: outcome.version,
                    old: outcome.old.and_then(string_object),
                }
            }
            Request::Delete {
                table,
                key,
                condition,
            } => {
                let tablet = self.tablet(*table, key)?;
                let deleted = self
                    .node
                    .delete(tablet, key, engine_condition(*condition), &mut self.acks)
                    .map_err(|e| self.failure(tablet, key, e))?;
                Response::Delete(deleted)
            }
            Request::Increment { table, key, delta } => {
                let tablet = self.tablet(*table, key)?;
                let (value, version) = self.node.increment(tablet, key, *delta, &mut self.acks)?;
                Response::Increment { value, version }
            }
            Request::Expire { table, key, expiry } => {
                let tablet = self.tablet(*table, key)?;
                let at = self.node.expire_at_ms(*expiry);
                Response::Expire(self.node.set_expiry(tablet, key, at, &mut self.acks)?)
            }
            Request::MultiGet { table, keys } => {
                let start = out.len();
                let frame = begin_multi_get(out, id, keys.len());
                for key in keys {
                    let tablet = self.tablet(*table, key)?;
                    let found = self.node.read_with(
                        tablet,
                        key,
                        &mut self.acks,
                        |value, version, expire_at_ms| match ramlog_proto::types::string_of(value) {
                            Some(s) => put_present_object(out, s, version, expire_at_ms),
                            // A collection is absent to a string read.
                            None => out.extend_from_slice(&[0]),
                        },
                    )?;
                    if found.is_none() {
                        out.extend_from_slice(&[0]);
                    }
                    if out.len() - start > self.config.max_reply_bytes {
                        return Err(reply_too_large(self.config.max_reply_bytes));
                    }
                }
                finish_frame(out, frame);
                return Ok(());
            }
            Request::MultiPut { table, items } => {
                let Some((first_key, _)) = items.first() else {
                    return Err(Failure(
                        Status::BadRequest,
                        0,
                        "MULTI_PUT needs at least one item".into(),
                    ));
                };
                let tablet = self.tablet(*table, first_key)?;
                for (key, _) in items.iter().skip(1) {
                    if self.tablet(*table, key)? != tablet {
                        return Err(Failure(
                            Status::CrossTablet,
                            0,
                            "MULTI_PUT keys live on more than one tablet; give them a common {hash tag}".into(),
                        ));
                    }
                }
                let stored: Vec<std::borrow::Cow<'_, [u8]>> = items
                    .iter()
                    .map(|(_, v)| self.node.stored_string(v))
                    .collect::<Result<_, _>>()?;
                let items: Vec<(&[u8], &[u8])> = items
                    .iter()
                    .zip(&stored)
                    .map(|((k, _), v)| (*k, v.as_ref()))
                    .collect();
                Response::MultiPut {
                    version: self.node.multi_put(tablet, &items, &mut self.acks)?,
                }
            }
            Request::ScanKeys {
                table,
                cursor,
                count,
                pattern,
            } => {
                let (next, keys) = self.scan(*table, *cursor, *count, pattern)?;
                let reply_bytes: usize = keys.iter().map(|k| k.len() + 4).sum();
                if reply_bytes > self.config.max_reply_bytes {
                    return Err(reply_too_large(self.config.max_reply_bytes));
                }
                Response::ScanKeys {
                    cursor: next,
                    keys: keys.into_iter().map(bytes::Bytes::from).collect(),
                }
            }
            Request::SnapshotOpen => self.scans.snapshot_open()?,
            Request::SnapshotRelease { snapshot } => self.scans.snapshot_release(*snapshot)?,
            Request::ScanClose { cursor } => self.scans.scan_close(*cursor)?,
            Request::SetSchema { table, schema } => {
                let schema = scan::decode_schema(schema)?;
                self.node.set_schema(*table, schema)?;
                Response::SchemaSet
            }
            Request::GetSchema { table } => self.scans.get_schema(*table),
            Request::ClusterMap => Response::ClusterMap(
                self.member()
                    .map(|m| m.view().map_json.clone())
                    .unwrap_or_default(),
            ),
            Request::RespBatch { protocol, commands } => {
                Response::RespBatch(self.resp_batch(*protocol, commands))
            }
            Request::RespPass {
                protocol,
                count,
                resp,
            } => {
                let commands = ramlog_proto::native::resp_pass_commands(*count, resp)
                    .map_err(|e| Failure(Status::BadRequest, 0, e.message))?;
                Response::RespBatch(self.resp_batch(*protocol, &commands))
            }
            Request::GetAt {
                table,
                snapshot,
                key,
            } => {
                let tablet = self.tablet(*table, key)?;
                self.scans.get_at(*snapshot, tablet, key)?
            }
            Request::ScanFiltered {
                table,
                snapshot,
                max_records,
                query,
            } => {
                self.check_job_room()?;
                let job = self.scans.scan_filtered(
                    id,
                    *table,
                    *snapshot,
                    None,
                    *max_records,
                    query,
                    None,
                )?;
                return self.queue_job(id, op, job);
            }
            Request::ScanTablet {
                table,
                first_slot,
                last_slot,
                epoch,
                snapshot,
                from_mirror,
                only_slots,
                max_records,
                query,
            } => {
                self.check_job_room()?;
                let (tablet, fresh) = if *from_mirror {
                    let (tablet, snap) =
                        self.mirrored_tablet(*table, *first_slot, *last_slot, *epoch)?;
                    (tablet, Some(snap))
                } else {
                    let tablet = self.scanned_tablet(*table, *first_slot, *last_slot, *epoch)?;
                    (tablet, None)
                };
                if *snapshot != 0 {
                    self.scans
                        .check_cut_covers(*snapshot, (*table, *first_slot, *last_slot, *epoch))?;
                }
                let job = self.scans.scan_filtered(
                    id,
                    *table,
                    *snapshot,
                    fresh,
                    *max_records,
                    query,
                    Some((tablet, only_slots.0, only_slots.1)),
                )?;
                return self.queue_job(id, op, job);
            }
            Request::SnapshotCut {
                table,
                at_unix_ns,
                hold_us,
            } => {
                self.check_job_room()?;
                let job = self.snapshot_cut(id, *table, *at_unix_ns, *hold_us)?;
                return self.queue_job(id, op, job);
            }
            Request::ScanNext {
                cursor,
                max_records,
            } => {
                self.check_job_room()?;
                let job = self.scans.scan_next(id, *cursor, *max_records)?;
                return self.queue_job(id, op, job);
            }
        };
        reply.encode(id, op, out);
        Ok(())
    }

    /// One step over every tablet of `table` in slot order. The cursor packs the tablet's position in its
    /// low 16 bits and the engine's cursor inside that tablet above them.
    fn scan(
        &mut self,
        table: TableId,
        cursor: u64,
        count: u32,
        pattern: &[u8],
    ) -> Result<(u64, Vec<Vec<u8>>), Failure> {
        const TABLET_BITS: u32 = 16;
        let mut tablets: Vec<_> = self
            .node
            .engine()
            .tablets()
            .into_iter()
            .filter(|t| t.table == table)
            .collect();
        if tablets.is_empty() {
            return Err(Failure(
                Status::NoSuchTable,
                0,
                format!("no tablet of table {table} on this server"),
            ));
        }
        tablets.sort_by_key(|t| t.first_slot);
        let mut position = (cursor & ((1 << TABLET_BITS) - 1)) as usize;
        let mut inner = cursor >> TABLET_BITS;
        if position >= tablets.len() {
            return Err(Failure(
                Status::BadRequest,
                0,
                format!("invalid cursor {cursor}"),
            ));
        }
        let count = count.clamp(1, SCAN_COUNT_MAX) as usize;
        let mut matched = Vec::new();
        let mut visited = 0;
        let batch = &mut self.scan_keys;
        loop {
            batch.clear();
            let next = self.node.engine().scan_keys(
                tablets[position].id,
                inner,
                count - visited.min(count - 1),
                batch,
            )?;
            visited += batch.len().max(1);
            matched.extend(batch.drain(..).filter(|k| {
                // The chunks of large collections are not keys of their own.
                !ramlog_common::is_internal(k) && (pattern.is_empty() || glob_match(pattern, k))
            }));
            if next == 0 {
                position += 1;
                inner = 0;
                if position == tablets.len() {
                    return Ok((0, matched));
                }
            } else {
                inner = next;
            }
            if visited >= count {
                break;
            }
        }
        if inner.leading_zeros() < TABLET_BITS {
            return Err(Failure(
                Status::Internal,
                0,
                "engine cursor too large to pack".into(),
            ));
        }
        Ok(((inner << TABLET_BITS) | position as u64, matched))
    }
}

fn reply_too_large(max: usize) -> Failure {
    Failure(
        Status::FrameTooLarge,
        max as u64,
        format!("reply would exceed {max} bytes; ask for fewer keys"),
    )
}

// Direct encoders for the two replies that carry values, so that values go from the engine's memory into
// the output buffer in one copy. They produce the same bytes as `Response::encode`.

fn begin_frame(out: &mut BytesMut, id: u64, op: u8) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&[op, Status::Ok.to_u8(), 0, 0]);
    start
}

fn finish_frame(out: &mut BytesMut, start: usize) {
    let len = u32::try_from(out.len() - start - 4).unwrap_or(u32::MAX);
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

/// A native read of a key that holds a collection.
fn wrong_type() -> Failure {
    Failure(
        Status::WrongType,
        0,
        "the key holds a collection (hash, list, set or sorted set); read it with the RESP commands".into(),
    )
}

fn put_present_object(out: &mut BytesMut, value: &[u8], version: u64, expire_at_ms: u64) {
    out.reserve(21 + value.len());
    out.extend_from_slice(&[1]);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&expire_at_ms.to_le_bytes());
    out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    out.extend_from_slice(value);
}

fn get_reply(out: &mut BytesMut, id: u64, value: &[u8], version: u64, expire_at_ms: u64) {
    let start = begin_frame(out, id, opcode::GET);
    put_present_object(out, value, version, expire_at_ms);
    finish_frame(out, start);
}

fn begin_multi_get(out: &mut BytesMut, id: u64, count: usize) -> usize {
    let start = begin_frame(out, id, opcode::MULTI_GET);
    out.extend_from_slice(&(count as u32).to_le_bytes());
    start
}

/// The metrics family of a native request.
fn native_op(opcode_byte: u8) -> Op {
    match opcode_byte {
        opcode::GET | opcode::GET_AT => Op::Get,
        opcode::PUT => Op::Set,
        opcode::DELETE => Op::Del,
        opcode::INCREMENT => Op::Incr,
        opcode::MULTI_GET => Op::Mget,
        opcode::MULTI_PUT => Op::Mset,
        opcode::SCAN_KEYS | opcode::SCAN_FILTERED | opcode::SCAN_TABLET | opcode::SCAN_NEXT => {
            Op::Scan
        }
        opcode::EXPIRE => Op::Expire,
        _ => Op::Other,
    }
}
