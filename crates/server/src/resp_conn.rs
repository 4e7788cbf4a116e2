//! One RESP client connection: read, decode every complete request, execute, reply in one write.
//!
//! Each connection is its own task, so a slow or stalled client holds nothing that others need.
//! Every buffer is bounded: the read buffer by the request limits (a request that exceeds them is a
//! protocol error that closes the connection, as in Redis), the reply buffer by
//! `reply_buffer_max_bytes` and `pipeline_depth_max` (replies are written out when either is reached,
//! so a deep pipeline is served in batches and a client that does not read its replies blocks only
//! itself, until `write_timeout_secs` closes it).

use crate::commands::{execute, Session};
use crate::config::PersistenceMode;
use crate::metrics::Metrics;
use crate::server::Shared;
use ramlog_proto::resp::{ReplyEncoder, Request, RequestDecoder};
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
}

pub async fn serve_resp(mut stream: TcpStream, shared: Arc<Shared>, client_id: u64) -> Ending {
    let _ = stream.set_nodelay(true);
    let config = &shared.config;
    let mut session = Session::new(client_id, config.password.is_some());
    let decoder = RequestDecoder::new(shared.limits);
    let mut request = Request::default();
    let mut inbuf: Vec<u8> = Vec::with_capacity(READ_CHUNK_BYTES);
    let mut out: Vec<u8> = Vec::with_capacity(READ_CHUNK_BYTES);
    let idle =
        (config.idle_timeout_secs > 0).then(|| Duration::from_secs(config.idle_timeout_secs));
    let write_timeout = Duration::from_secs(config.write_timeout_secs.max(1));
    let reply_buffer_max = config.reply_buffer_max_bytes as usize;
    let depth_max = config.pipeline_depth_max;
    loop {
        if inbuf.capacity() - inbuf.len() < READ_CHUNK_BYTES / 4 {
            inbuf.reserve(READ_CHUNK_BYTES.max(inbuf.len()));
        }
        let read = match idle {
            Some(limit) => match tokio::time::timeout(limit, stream.read_buf(&mut inbuf)).await {
                Ok(r) => r,
                Err(_) => return Ending::IdleTimeout,
            },
            None => stream.read_buf(&mut inbuf).await,
        };
        match read {
            Ok(0) => return Ending::ClientClosed,
            Ok(n) => Metrics::add(&shared.metrics.bytes_in, n as u64),
            Err(_) => return Ending::IoError,
        }
        let mut pos = 0;
        let mut batch = 0;
        let mut fatal = None;
        while pos < inbuf.len() {
            match decoder.decode(&inbuf[pos..], &mut request) {
                Ok(Some(used)) => {
                    if !request.is_empty() {
                        let args = request.args(&inbuf[pos..]);
                        execute(&shared, &mut session, &args, &mut out);
                        batch += 1;
                    }
                    pos += used;
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
    }
}

/// Writes the buffered replies; in `durable` mode first waits until this connection's writes are on disk.
async fn flush(
    stream: &mut TcpStream,
    shared: &Shared,
    session: &mut Session,
    out: &mut Vec<u8>,
    write_timeout: Duration,
) -> Result<(), Ending> {
    if session.wrote {
        session.wrote = false;
        if shared.config.persistence == PersistenceMode::Durable {
            shared.wait_durable().await;
        }
    }
    if out.is_empty() {
        return Ok(());
    }
    match tokio::time::timeout(write_timeout, stream.write_all(out)).await {
        Ok(Ok(())) => {
            Metrics::add(&shared.metrics.bytes_out, out.len() as u64);
            out.clear();
            Ok(())
        }
        Ok(Err(_)) => Err(Ending::IoError),
        Err(_) => Err(Ending::WriteTimeout),
    }
}
