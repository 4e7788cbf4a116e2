//! One multiplexed native-protocol connection.
//!
//! Callers encode their frames into a shared output buffer and wait on a oneshot keyed by request id. A
//! writer task sends whatever accumulated in one write (so concurrent callers pipeline for free), and a
//! reader task matches replies to waiters by request id, in whatever order they arrive. A semaphore caps
//! requests in flight at the server's advertised limit. When either task sees the stream fail, every
//! waiter gets `ConnectionLost` and the connection is marked closed; the pool then opens a new one.

use crate::{ClientConfig, Error};
use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use ramlog_proto::native::{
    parse_header, ClientHello, ErrorReply, Request, Response, ServerHello, HEADER_LEN,
    HELLO_FLAG_REFUSED, PROTOCOL_VERSION, REFUSAL_BODY_MAX_BYTES, SERVER_HELLO_LEN,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Notify, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;

type Waiter = oneshot::Sender<Result<Response, Error>>;

struct Pending {
    opcode: u8,
    waiter: Waiter,
}

struct Shared {
    /// Frames encoded by callers, not yet handed to the socket.
    out: Mutex<BytesMut>,
    out_ready: Notify,
    pending: Mutex<HashMap<u64, Pending>>,
    closed: AtomicBool,
    close_reason: Mutex<String>,
    next_request_id: AtomicU64,
    in_flight: Semaphore,
    permits_total: usize,
    hello: ServerHello,
    reply_frame_max_bytes: usize,
}

impl Shared {
    /// Mark the connection dead and fail every waiter.
    fn fail(&self, reason: String) {
        {
            let mut r = self.close_reason.lock();
            if r.is_empty() {
                *r = reason;
            }
        }
        self.closed.store(true, Ordering::SeqCst);
        let drained: Vec<Pending> = self.pending.lock().drain().map(|(_, p)| p).collect();
        let reason = self.close_reason.lock().clone();
        for p in drained {
            let _ = p.waiter.send(Err(Error::ConnectionLost(reason.clone())));
        }
        self.in_flight.close();
        self.out_ready.notify_one();
    }
}

/// A live connection. Dropping the last handle stops its tasks.
pub(crate) struct Connection {
    shared: Arc<Shared>,
    tasks: [JoinHandle<()>; 2],
}

impl Drop for Connection {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Connection {
    /// Connect, exchange hellos and, if configured, authenticate.
    pub(crate) async fn open(config: &ClientConfig) -> Result<Arc<Connection>, Error> {
        let addr = config.addr.clone();
        let connect = TcpStream::connect(&addr);
        let mut stream = match tokio::time::timeout(config.connect_timeout, connect).await {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => return Err(Error::Connect { addr, source }),
            Err(_) => {
                return Err(Error::Connect {
                    addr,
                    source: std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"),
                })
            }
        };
        let _ = stream.set_nodelay(true);
        let handshake_error = |reason: String| Error::Handshake {
            addr: config.addr.clone(),
            reason,
        };
        let hello = async {
            let client_hello = ClientHello {
                version_max: PROTOCOL_VERSION,
                flags: 0,
            };
            stream.write_all(&client_hello.encode()).await?;
            let mut buf = [0u8; SERVER_HELLO_LEN];
            stream.read_exact(&mut buf).await?;
            Ok::<_, std::io::Error>(buf)
        };
        let buf = match tokio::time::timeout(config.connect_timeout, hello).await {
            Ok(Ok(buf)) => buf,
            Ok(Err(e)) => return Err(handshake_error(e.to_string())),
            Err(_) => return Err(handshake_error("no server hello in time".into())),
        };
        let hello = ServerHello::decode(&buf).map_err(|e| handshake_error(e.message))?;
        if hello.flags & HELLO_FLAG_REFUSED != 0 {
            let refusal =
                tokio::time::timeout(config.connect_timeout, read_refusal(&mut stream)).await;
            return Err(match refusal {
                Ok(Some(e)) => e.into(),
                _ => handshake_error("the server refused the connection".into()),
            });
        }
        if hello.version != PROTOCOL_VERSION {
            return Err(handshake_error(format!(
                "server offers protocol version {}, this client speaks {PROTOCOL_VERSION}",
                hello.version
            )));
        }
        let permits = (hello.max_in_flight as usize).clamp(1, config.max_in_flight.max(1));
        let shared = Arc::new(Shared {
            out: Mutex::new(BytesMut::with_capacity(64 * 1024)),
            out_ready: Notify::new(),
            pending: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            close_reason: Mutex::new(String::new()),
            next_request_id: AtomicU64::new(1),
            in_flight: Semaphore::new(permits),
            permits_total: permits,
            hello,
            reply_frame_max_bytes: config.reply_frame_max_bytes,
        });
        let (read_half, write_half) = stream.into_split();
        let reader = tokio::spawn(read_loop(shared.clone(), read_half));
        let writer = tokio::spawn(write_loop(shared.clone(), write_half));
        let conn = Arc::new(Connection {
            shared,
            tasks: [reader, writer],
        });
        if let Some(password) = &config.password {
            let deadline = Instant::now() + config.connect_timeout.max(config.request_timeout);
            let reply = conn.call(&Request::Auth { password }, deadline).await?;
            match reply {
                Response::AuthOk => {}
                Response::Error(e) => return Err(e.into()),
                other => {
                    return Err(Error::Protocol(format!(
                        "unexpected reply to AUTH: {other:?}"
                    )))
                }
            }
        }
        Ok(conn)
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::SeqCst)
    }

    pub(crate) fn server_hello(&self) -> ServerHello {
        self.shared.hello
    }

    /// Send one request and wait for its reply until `deadline`. Error replies come back as
    /// `Ok(Response::Error)`; the caller maps them.
    pub(crate) async fn call(
        &self,
        request: &Request<'_>,
        deadline: Instant,
    ) -> Result<Response, Error> {
        let mut replies = self
            .call_many(std::slice::from_ref(request), deadline)
            .await?;
        replies
            .pop()
            .unwrap_or_else(|| Err(Error::Protocol("no reply".into())))
    }

    /// Send several requests in one write and wait for all replies (a pipeline). Each reply is returned in
    /// request order, whatever order the server answered in.
    pub(crate) async fn call_many(
        &self,
        requests: &[Request<'_>],
        deadline: Instant,
    ) -> Result<Vec<Result<Response, Error>>, Error> {
        let shared = &self.shared;
        let timeout = deadline.saturating_duration_since(Instant::now());
        // A pipeline larger than the in-flight limit goes in chunks.
        if requests.len() > shared.permits_total {
            let mut all = Vec::with_capacity(requests.len());
            for part in requests.chunks(shared.permits_total) {
                all.extend(Box::pin(self.call_many(part, deadline)).await?);
            }
            return Ok(all);
        }
        let permit_count = requests.len() as u32;
        let permits =
            match tokio::time::timeout_at(deadline, shared.in_flight.acquire_many(permit_count))
                .await
            {
                Ok(Ok(p)) => p,
                Ok(Err(_)) => {
                    return Err(Error::ConnectionLost(shared.close_reason.lock().clone()))
                }
                Err(_) => return Err(Error::Timeout(timeout)),
            };
        let max_bytes = shared.hello.max_frame_bytes as usize;
        let mut frames = BytesMut::new();
        let mut receivers = Vec::with_capacity(requests.len());
        let mut ids = Vec::with_capacity(requests.len());
        for request in requests {
            let id = shared.next_request_id.fetch_add(1, Ordering::Relaxed);
            let before = frames.len();
            request.encode(id, &mut frames);
            let bytes = frames.len() - before;
            if bytes > max_bytes {
                return Err(Error::RequestTooLarge { bytes, max_bytes });
            }
            let (tx, rx) = oneshot::channel();
            ids.push((id, request.opcode(), tx));
            receivers.push((id, rx));
        }
        {
            let mut pending = shared.pending.lock();
            for (id, opcode, waiter) in ids {
                pending.insert(id, Pending { opcode, waiter });
            }
        }
        if shared.closed.load(Ordering::SeqCst) {
            let mut pending = shared.pending.lock();
            for (id, _) in &receivers {
                pending.remove(id);
            }
            return Err(Error::ConnectionLost(shared.close_reason.lock().clone()));
        }
        shared.out.lock().extend_from_slice(&frames);
        shared.out_ready.notify_one();
        let mut replies = Vec::with_capacity(receivers.len());
        for (id, rx) in receivers {
            let reply = match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(reply)) => reply,
                Ok(Err(_)) => Err(Error::ConnectionLost(shared.close_reason.lock().clone())),
                Err(_) => {
                    shared.pending.lock().remove(&id);
                    Err(Error::Timeout(timeout))
                }
            };
            replies.push(reply);
        }
        drop(permits);
        Ok(replies)
    }
}

/// The error frame that follows a refusing server hello.
async fn read_refusal(stream: &mut TcpStream) -> Option<ErrorReply> {
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header).await.ok()?;
    let h = parse_header(&header, HEADER_LEN + REFUSAL_BODY_MAX_BYTES).ok()??;
    let mut body = vec![0u8; h.body_len];
    stream.read_exact(&mut body).await.ok()?;
    match Response::decode(h.opcode, h.flags_or_status, Bytes::from(body)) {
        Ok(Response::Error(e)) => Some(e),
        _ => None,
    }
}

async fn write_loop(shared: Arc<Shared>, mut socket: OwnedWriteHalf) {
    let mut batch = BytesMut::with_capacity(64 * 1024);
    loop {
        if shared.closed.load(Ordering::SeqCst) {
            return;
        }
        {
            let mut out = shared.out.lock();
            std::mem::swap(&mut *out, &mut batch);
        }
        if batch.is_empty() {
            shared.out_ready.notified().await;
            continue;
        }
        if let Err(e) = socket.write_all(&batch).await {
            shared.fail(format!("write failed: {e}"));
            return;
        }
        batch.clear();
    }
}

async fn read_loop(shared: Arc<Shared>, mut socket: OwnedReadHalf) {
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let reason = loop {
        match socket.read_buf(&mut buf).await {
            Ok(0) => break "server closed the connection".to_string(),
            Ok(_) => {}
            Err(e) => break format!("read failed: {e}"),
        }
        if let Err(reason) = dispatch_frames(&shared, &mut buf) {
            break reason;
        }
    };
    shared.fail(reason);
}

/// Hand every complete frame in `buf` to its waiter.
fn dispatch_frames(shared: &Shared, buf: &mut BytesMut) -> Result<(), String> {
    loop {
        let header = match parse_header(buf, shared.reply_frame_max_bytes) {
            Ok(Some(h)) => h,
            Ok(None) => return Ok(()),
            Err(e) => return Err(format!("bad reply frame: {e}")),
        };
        if buf.len() < header.frame_bytes() {
            buf.reserve(header.frame_bytes() - buf.len());
            return Ok(());
        }
        let frame: Bytes = buf.split_to(header.frame_bytes()).freeze();
        let pending = shared.pending.lock().remove(&header.request_id);
        let Some(pending) = pending else {
            // A reply to a request that timed out, or a connection-level error from the server.
            if header.request_id == 0 && header.flags_or_status != 0 {
                let message = Response::decode(
                    header.opcode,
                    header.flags_or_status,
                    frame.slice(HEADER_LEN..),
                )
                .map(|r| format!("{r:?}"))
                .unwrap_or_default();
                return Err(format!("server reported a connection error: {message}"));
            }
            continue;
        };
        let reply = Response::decode(
            pending.opcode,
            header.flags_or_status,
            frame.slice(HEADER_LEN..),
        )
        .map_err(|e| Error::Protocol(e.to_string()));
        let protocol_error = reply.as_ref().err().map(|e| e.to_string());
        let _ = pending.waiter.send(reply);
        if let Some(reason) = protocol_error {
            return Err(reason);
        }
    }
}

/// The default per-request timeout.
pub const REQUEST_TIMEOUT_DEFAULT: Duration = Duration::from_secs(5);
