//! The blocking commands on a RESP connection: BLPOP, BRPOP, BLMOVE, BRPOPLPUSH, BZPOPMIN,
//! BZPOPMAX, and XREAD and XREADGROUP with BLOCK.
//!
//! Each command's handler (in `commands`) makes one try and answers a null when its keys hold
//! nothing. Outside MULTI, the connection does not send that null: it registers for its keys'
//! wakes ([`crate::node::waiters`]), waits for a write of one of them (or [`RETRY_INTERVAL`],
//! or the command's timeout), and tries again, until the handler answers something else (an
//! element, an error such as WRONGTYPE or `-MOVED` after its slot moved) or the timeout passes
//! (then the null goes out, as Redis answers a timed-out blocking command). Each try runs through
//! [`execute`] like any command, so routing checks, metrics and the replication wait of the pop's
//! write apply as usual. While blocked, the connection still reads: a client that closes ends
//! the wait, and requests it pipelined behind are served after it, in order.

use crate::front::commands::{command_keys, execute, lookup, Session};
use crate::front::resp_conn::Ending;
use crate::node::waiters::UnblockAs;
use crate::node::Node;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// How often a blocked client tries again with no wake (writes by other paths, a moved slot).
pub const RETRY_INTERVAL: Duration = Duration::from_millis(100);
/// Bytes a blocked connection reads ahead (pipelined requests behind the blocking one).
pub(crate) const READ_AHEAD_MAX: usize = 1 << 20;

/// Whether a request is one this module blocks for.
pub fn is_blocking(args: &[&[u8]]) -> bool {
    let name = args[0];
    if is_stream_read(name) {
        return xread_block(args).is_some();
    }
    [
        &b"blpop"[..],
        b"brpop",
        b"blmove",
        b"brpoplpush",
        b"bzpopmin",
        b"bzpopmax",
        b"blmpop",
        b"bzmpop",
    ]
    .iter()
    .any(|n| n.eq_ignore_ascii_case(name))
}

/// Whether a command is XREAD or XREADGROUP (whose timeout is BLOCK's milliseconds).
fn is_stream_read(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(b"xread") || name.eq_ignore_ascii_case(b"xreadgroup")
}

/// XREAD's or XREADGROUP's BLOCK milliseconds, if it has the option (before STREAMS).
fn xread_block(args: &[&[u8]]) -> Option<u64> {
    let ms = timeout_arg(args)?;
    std::str::from_utf8(ms).ok()?.parse().ok()
}

/// XREAD's `$` ids turned into each stream's last id now, so that the tries that follow wait
/// for entries added after the command arrived.
fn xread_resolved(node: &Node, session: &mut Session, args: &[&[u8]]) -> Option<Vec<Vec<u8>>> {
    if !args[0].eq_ignore_ascii_case(b"xread") {
        return None;
    }
    let (first, n) = crate::front::commands::streams::xread_streams(args).ok()?;
    let mut owned: Vec<Vec<u8>> = args.iter().map(|a| a.to_vec()).collect();
    for k in 0..n {
        if args[first + n + k] == b"$" {
            owned[first + n + k] =
                crate::front::commands::streams::last_id_text(node, session, args[first + k]);
        }
    }
    Some(owned)
}

/// The timeout argument's position.
fn timeout_at(args: &[&[u8]]) -> Option<usize> {
    let name = args[0].to_ascii_lowercase();
    let at = match name.as_slice() {
        b"xread" | b"xreadgroup" => {
            let end = args
                .iter()
                .position(|a| a.eq_ignore_ascii_case(b"streams"))
                .unwrap_or(args.len());
            args[..end]
                .iter()
                .position(|a| a.eq_ignore_ascii_case(b"block"))?
                + 1
        }
        b"blmove" => 5,
        b"brpoplpush" => 3,
        b"blmpop" | b"bzmpop" => 1,
        _ => args.len().checked_sub(1)?,
    };
    (at < args.len()).then_some(at)
}

/// The timeout argument.
fn timeout_arg<'a>(args: &[&'a [u8]]) -> Option<&'a [u8]> {
    timeout_at(args).map(|at| args[at])
}

/// `args` with the time left until `deadline` as their timeout (seconds, or XREAD's BLOCK
/// milliseconds), for a try that blocks elsewhere; unchanged without a deadline (for ever).
/// None once the deadline passed (a timeout of 0 would mean for ever).
pub fn with_time_left(args: &[&[u8]], deadline: Option<Instant>) -> Option<Vec<Vec<u8>>> {
    let mut owned: Vec<Vec<u8>> = args.iter().map(|a| a.to_vec()).collect();
    let Some(deadline) = deadline else {
        return Some(owned);
    };
    let left = deadline.checked_duration_since(Instant::now())?;
    let ms = left.as_millis() as u64;
    if ms == 0 {
        return None;
    }
    let at = timeout_at(args)?;
    owned[at] = if is_stream_read(args[0]) {
        ms.to_string().into_bytes()
    } else {
        format!("{}.{:03}", ms / 1000, ms % 1000).into_bytes()
    };
    Some(owned)
}

/// Whether a reply is the null a blocking command's try answers when its keys hold nothing.
pub fn is_null(reply: &[u8]) -> bool {
    matches!(reply, b"*-1\r\n" | b"$-1\r\n" | b"_\r\n")
}

struct Registration<'a> {
    node: &'a Node,
    keys: Vec<Vec<u8>>,
    notify: Arc<tokio::sync::Notify>,
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        self.node
            .waiters
            .unregister_and_pass(&self.keys, &self.notify);
    }
}

/// Runs a blocking command to its answer (see the module comment). Bytes the client sends
/// meanwhile are appended to `read_ahead`; a client that closes ends it with its [`Ending`].
pub async fn run(
    node: &Arc<Node>,
    session: &mut Session,
    args: &[&[u8]],
    out: &mut Vec<u8>,
    stream: &mut TcpStream,
    read_ahead: &mut Vec<u8>,
) -> Result<(), Ending> {
    let resolved = xread_resolved(node, session, args);
    let resolved_args: Vec<&[u8]>;
    let args = match &resolved {
        Some(owned) => {
            resolved_args = owned.iter().map(|a| a.as_slice()).collect();
            &resolved_args[..]
        }
        None => args,
    };
    let before = out.len();
    let held = session.write_replies.len();
    execute(node, session, args, out);
    if !is_null(&out[before..]) || session.multi.is_some() {
        return Ok(());
    }
    let deadline = deadline_of(args);
    let keys: Vec<Vec<u8>> = match lookup(args[0]) {
        Some(spec) => command_keys(spec, args).map(<[u8]>::to_vec).collect(),
        None => return Ok(()),
    };
    let registration = Registration {
        node,
        keys,
        notify: Arc::new(tokio::sync::Notify::new()),
    };
    node.waiters
        .register(&registration.keys, &registration.notify);
    if args[0].eq_ignore_ascii_case(b"xreadgroup") {
        node.waiters.mark_on_nokey(&registration.notify);
    }
    let _blocked = Blocked::new(node);
    let null_reply = out[before..].to_vec();
    let unblock = ClientHandle::new(node, session.id, &registration.notify);
    loop {
        // Nothing yet: take the null back and try again after a wake.
        out.truncate(before);
        session.write_replies.truncate(held);
        if let Some(reply) = unblock.unblocked_reply(&null_reply) {
            out.extend_from_slice(&reply);
            return Ok(());
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            // Timed out: the null answer stands.
            retry(node, session, args, out);
            return Ok(());
        }
        pause(
            deadline,
            RETRY_INTERVAL,
            Some(&registration.notify),
            stream,
            read_ahead,
        )
        .await?;
        retry(node, session, args, out);
        if retry_ends(args, &out[before..]) {
            return Ok(());
        }
    }
}

/// A blocking command's try after its first (not counted again among its calls).
fn retry(node: &Node, session: &mut Session, args: &[&[u8]], out: &mut Vec<u8>) {
    session.blocked_retry = true;
    execute(node, session, args, out);
    session.blocked_retry = false;
}

/// A blocked client's entry for CLIENT UNBLOCK, removed when its wait ends.
pub(crate) struct ClientHandle<'a> {
    node: &'a Node,
    id: u64,
    handle: Arc<crate::node::waiters::Unblock>,
}

impl<'a> ClientHandle<'a> {
    /// Client `id` blocks until `notify`, which CLIENT UNBLOCK also wakes.
    pub(crate) fn new(node: &'a Node, id: u64, notify: &Arc<tokio::sync::Notify>) -> Self {
        ClientHandle {
            node,
            id,
            handle: node.waiters.block_client(id, notify),
        }
    }

    /// How CLIENT UNBLOCK asked this client to end its wait, if it did.
    pub(crate) fn asked(&self) -> Option<UnblockAs> {
        self.handle.asked()
    }

    /// The reply that ends the wait if CLIENT UNBLOCK asked: `timed_out` (the command's reply
    /// when its timeout passes) or the UNBLOCKED error.
    pub(crate) fn unblocked_reply(&self, timed_out: &[u8]) -> Option<Vec<u8>> {
        match self.handle.asked()? {
            UnblockAs::Timeout => Some(timed_out.to_vec()),
            UnblockAs::Error => Some(UNBLOCKED.to_vec()),
        }
    }
}

const UNBLOCKED: &[u8] = b"-UNBLOCKED client unblocked via CLIENT UNBLOCK\r\n";

impl Drop for ClientHandle<'_> {
    fn drop(&mut self) {
        self.node.waiters.forget_client(self.id);
    }
}

/// Whether the reply of a blocking command's try after the first ends the wait. As Redis: a
/// source key that became another type meanwhile does not (only the first try answers
/// WRONGTYPE for it); BLMOVE's and BRPOPLPUSH's WRONGTYPE then is their destination's, which
/// Redis answers.
pub fn retry_ends(args: &[&[u8]], reply: &[u8]) -> bool {
    // XREADGROUP's group went with its key, which Redis answers at once.
    let moves = args[0].eq_ignore_ascii_case(b"blmove")
        || args[0].eq_ignore_ascii_case(b"brpoplpush")
        || args[0].eq_ignore_ascii_case(b"xreadgroup");
    !is_null(reply) && (moves || !reply.starts_with(b"-WRONGTYPE"))
}

/// Counts a connection in INFO's `blocked_clients` while it lives (and a routing-port client's
/// keys in the routing port's `total_blocking_keys`).
pub struct Blocked<'a> {
    counter: &'a std::sync::atomic::AtomicU64,
    held: Option<(&'a crate::node::waiters::KeyWaiters, Vec<Vec<u8>>, bool)>,
}

impl<'a> Blocked<'a> {
    pub fn new(node: &'a Node) -> Self {
        Self::counting(&node.metrics.blocked_clients)
    }

    /// A routing-port client blocked in `args`, counted in the routing port's INFO (not in the
    /// RESP port's).
    pub fn routed(node: &'a Node, args: &[&[u8]]) -> Self {
        let mut b = Self::counting(&node.metrics.routed_blocked_clients);
        let keys: Vec<Vec<u8>> = lookup(args[0])
            .map(|spec| command_keys(spec, args).map(<[u8]>::to_vec).collect())
            .unwrap_or_default();
        let on_nokey = args[0].eq_ignore_ascii_case(b"xreadgroup");
        node.routed_waiters.hold(&keys, on_nokey);
        b.held = Some((&node.routed_waiters, keys, on_nokey));
        b
    }

    fn counting(counter: &'a std::sync::atomic::AtomicU64) -> Self {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Blocked {
            counter,
            held: None,
        }
    }
}

impl Drop for Blocked<'_> {
    fn drop(&mut self) {
        self.counter
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        if let Some((waiters, keys, on_nokey)) = &self.held {
            waiters.release(keys, *on_nokey);
        }
    }
}

/// When a blocking command (`args`) times out; None for ever (timeout 0, or one its handler
/// refuses, which then answers the error itself).
pub fn deadline_of(args: &[&[u8]]) -> Option<Instant> {
    if is_stream_read(args[0]) {
        return xread_block(args)
            .filter(|&ms| ms > 0)
            .map(|ms| Instant::now() + Duration::from_millis(ms));
    }
    let timeout = timeout_arg(args)
        .and_then(|t| crate::front::commands::parse_timeout(t).ok())
        .unwrap_or(0.0);
    (timeout > 0.0).then(|| Instant::now() + Duration::from_secs_f64(timeout))
}

/// How often the routing port tries a blocking command again at the key's master (no wake
/// reaches it from another server).
pub const ROUTED_RETRY_INTERVAL: Duration = Duration::from_millis(20);

/// Waits for a wake (if `notify`), `interval` or the deadline, whichever comes first,
/// reading what the client sends meanwhile into `read_ahead`; the client closing ends it.
pub async fn pause(
    deadline: Option<Instant>,
    interval: Duration,
    notify: Option<&tokio::sync::Notify>,
    stream: &mut TcpStream,
    read_ahead: &mut Vec<u8>,
) -> Result<(), Ending> {
    let wait = match deadline {
        Some(d) => d.saturating_duration_since(Instant::now()).min(interval),
        None => interval,
    };
    let woken = async {
        match notify {
            Some(n) => n.notified().await,
            None => std::future::pending().await,
        }
    };
    if read_ahead.len() >= READ_AHEAD_MAX {
        tokio::select! {
            _ = woken => {}
            _ = tokio::time::sleep(wait) => {}
        }
        return Ok(());
    }
    tokio::select! {
        _ = woken => Ok(()),
        _ = tokio::time::sleep(wait) => Ok(()),
        read = stream.read_buf(read_ahead) => match read {
            Ok(0) | Err(_) => Err(Ending::ClientClosed),
            Ok(_) => Ok(()),
        },
    }
}

/// How a try at the keys' master ended when the routing port blocked a client there.
pub enum AtMaster {
    /// The master's answer: an element, an error, or the null of a timeout. It goes to the
    /// client as it is.
    Answered(Vec<u8>),
    /// Nothing was popped there: the master could not be reached, closed, refused the keys
    /// (`-MOVED`, `-ASK`, `-TRYAGAIN`, `-CLUSTERDOWN`, ...), or is no longer their master. The
    /// routing port routes the command again.
    Again,
}

/// How long the routing port waits to connect to a master's RESP port.
const MASTER_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How often a routing-port client blocked at a master checks that the map still names it
/// master of the keys (one declared dead is fenced, and cannot pop anything any more).
const MASTER_RECHECK: Duration = Duration::from_millis(250);

/// Blocks a routing-port client's command at its keys' master, as a Redis Cluster client
/// would: on a connection of its own to the master's RESP port, where it waits among that
/// server's own blocked clients, in the order they blocked, and is served by the write that
/// gives it something (the push's own server, not a poll). `args` carry the time left to the
/// client's deadline. CLIENT UNBLOCK of the client (through `unblock`, whose notifier is
/// `notify`) is passed on to the master, and the master's answer still taken: an element popped
/// meanwhile is never dropped. The client closing ends the wait (the master sees the
/// connection close). `still_master`: whether the map still names the master.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn block_at_master(
    node: &Node,
    master: std::net::SocketAddr,
    protocol: u8,
    args: &[&[u8]],
    unblock: &ClientHandle<'_>,
    notify: &tokio::sync::Notify,
    still_master: impl Fn() -> bool,
    stream: &mut TcpStream,
    read_ahead: &mut Vec<u8>,
) -> Result<AtMaster, Ending> {
    use ramlog_proto::resp::{encode_command, Reply, ReplyDecoder};
    use tokio::io::AsyncWriteExt;
    let mut request = Vec::new();
    if protocol == 3 {
        encode_command(&mut request, &[b"HELLO", b"3"]);
    }
    // Its id there, for CLIENT UNBLOCK; its reply also says the master reached the command.
    encode_command(&mut request, &[b"CLIENT", b"ID"]);
    encode_command(&mut request, args);
    let mut conn =
        match tokio::time::timeout(MASTER_CONNECT_TIMEOUT, TcpStream::connect(master)).await {
            Ok(Ok(c)) => c,
            _ => return Ok(AtMaster::Again),
        };
    let _ = conn.set_nodelay(true);
    if conn.write_all(&request).await.is_err() {
        return Ok(AtMaster::Again);
    }
    let decoder = ReplyDecoder::default();
    let mut buf = Vec::with_capacity(1024);
    let mut hello = protocol == 3;
    let mut id: Option<i64> = None;
    let mut _blocked = None;
    let mut unblock_sent = false;
    let mut recheck = tokio::time::interval(MASTER_RECHECK);
    recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        while let Some((reply, used)) = match decoder.decode(&buf) {
            Ok(r) => r,
            Err(_) => return Ok(AtMaster::Again),
        } {
            if std::mem::take(&mut hello) {
                buf.drain(..used);
                continue;
            }
            if id.is_none() {
                let Reply::Integer(n) = reply else {
                    return Ok(AtMaster::Again);
                };
                id = Some(n);
                // The master runs the command next: the client counts as blocked.
                _blocked = Some(Blocked::routed(node, args));
                buf.drain(..used);
                continue;
            }
            let answer = &buf[..used];
            let refused = [
                &b"-MOVED "[..],
                b"-ASK ",
                b"-TRYAGAIN",
                b"-CLUSTERDOWN",
                b"-LOADING",
                b"-MASTERDOWN",
            ]
            .iter()
            .any(|p| answer.starts_with(p));
            return Ok(if refused {
                AtMaster::Again
            } else {
                AtMaster::Answered(answer.to_vec())
            });
        }
        if let (false, Some(how), Some(id)) = (unblock_sent, unblock.asked(), id) {
            unblock_sent = true;
            unblock_at(master, id, how).await;
        }
        let read_client = read_ahead.len() < READ_AHEAD_MAX;
        tokio::select! {
            read = conn.read_buf(&mut buf) => match read {
                Ok(0) | Err(_) => return Ok(AtMaster::Again),
                Ok(_) => {}
            },
            _ = notify.notified() => {}
            _ = recheck.tick() => {
                if !still_master() {
                    return Ok(AtMaster::Again);
                }
            }
            read = stream.read_buf(read_ahead), if read_client => match read {
                Ok(0) | Err(_) => return Err(Ending::ClientClosed),
                Ok(_) => {}
            },
        }
    }
}

/// Sends `CLIENT UNBLOCK id [ERROR]` to `master`'s RESP port (bounded: a master that does not
/// answer within a second is not waited for; its client's wait then ends at its timeout).
async fn unblock_at(master: std::net::SocketAddr, id: i64, how: UnblockAs) {
    use tokio::io::AsyncWriteExt;
    let id = id.to_string();
    let mut args: Vec<&[u8]> = vec![b"CLIENT", b"UNBLOCK", id.as_bytes()];
    if how == UnblockAs::Error {
        args.push(b"ERROR");
    }
    let mut request = Vec::new();
    ramlog_proto::resp::encode_command(&mut request, &args);
    let send = async {
        let mut conn = TcpStream::connect(master).await?;
        conn.write_all(&request).await?;
        let mut reply = [0u8; 64];
        conn.read(&mut reply).await
    };
    if let Err(e) = tokio::time::timeout(MASTER_CONNECT_TIMEOUT, send)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
    {
        tracing::warn!(%master, error = %e, "CLIENT UNBLOCK could not reach the keys' master");
    }
}
