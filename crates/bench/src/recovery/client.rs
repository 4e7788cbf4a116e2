//! A minimal Redis Cluster client over std sockets, for the load, the read-back and the
//! preloads: RESP2 replies parsed with bounds on what they may announce, one [`Conn`] per node
//! whose every operation times out after [`IO_TIMEOUT`], and the slot map from `CLUSTER SLOTS`
//! with node addresses by small ids ([`Nodes`]).

use anyhow::{bail, Context};
use ramlog_common::SLOT_COUNT;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Every socket operation (connect, write, read) gives up after this long.
pub(super) const IO_TIMEOUT: Duration = Duration::from_secs(1);
/// A node that failed a request is left alone by that thread for this long, and the slot map is
/// refreshed at most this often per thread.
pub(super) const RETRY_PAUSE: Duration = Duration::from_millis(10);
/// GETs pipelined per round trip by [`LoadResult::verify`](super::LoadResult::verify), SETs by
/// the Redis preload.
pub(super) const BATCH: usize = 500;
/// A node id no node has: the slot's owner is unknown.
pub(super) const NO_NODE: u16 = u16::MAX;

// ---------------------------------------------------------------------------------------------
// RESP over std sockets
// ---------------------------------------------------------------------------------------------

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

/// Bounds on what a reply may announce, so that garbage cannot make us allocate without limit.
const MAX_LINE: u64 = 64 << 10;
pub(super) const MAX_BULK: usize = 64 << 20;
const MAX_ARRAY: usize = 1 << 20;
const MAX_DEPTH: usize = 8;

pub(super) fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// One CRLF-terminated line, without the CRLF.
fn read_line<R: BufRead>(r: &mut R) -> io::Result<Vec<u8>> {
    let mut line = Vec::new();
    r.by_ref().take(MAX_LINE).read_until(b'\n', &mut line)?;
    if !line.ends_with(b"\n") {
        return Err(if (line.len() as u64) < MAX_LINE {
            io::ErrorKind::UnexpectedEof.into()
        } else {
            invalid("reply line too long")
        });
    }
    if !line.ends_with(b"\r\n") {
        return Err(invalid("reply line without CR"));
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

fn read_reply<R: BufRead>(r: &mut R, depth: usize) -> io::Result<Reply> {
    let line = read_line(r)?;
    let (&kind, rest) = line
        .split_first()
        .ok_or_else(|| invalid("empty reply line"))?;
    let text = || String::from_utf8_lossy(rest).into_owned();
    let int = || -> io::Result<i64> {
        std::str::from_utf8(rest)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| invalid(format!("bad integer {:?}", text())))
    };
    // A negative length is a null; anything above `max` is refused.
    let len = |max: usize| -> io::Result<Option<usize>> {
        let n = int()?;
        if n < 0 {
            return Ok(None);
        }
        match usize::try_from(n) {
            Ok(n) if n <= max => Ok(Some(n)),
            _ => Err(invalid(format!("reply length {n} too large"))),
        }
    };
    match kind {
        b'+' => Ok(Reply::Status(text())),
        b'-' => Ok(Reply::Error(text())),
        b':' => Ok(Reply::Int(int()?)),
        b'$' => {
            let Some(n) = len(MAX_BULK)? else {
                return Ok(Reply::Bulk(None));
            };
            let mut buf = vec![0u8; n + 2];
            r.read_exact(&mut buf)?;
            if !buf.ends_with(b"\r\n") {
                return Err(invalid("bulk string without CRLF"));
            }
            buf.truncate(n);
            Ok(Reply::Bulk(Some(buf)))
        }
        b'*' => {
            let Some(n) = len(MAX_ARRAY)? else {
                return Ok(Reply::Array(None));
            };
            if depth >= MAX_DEPTH {
                return Err(invalid("reply nested too deeply"));
            }
            let mut items = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                items.push(read_reply(r, depth + 1)?);
            }
            Ok(Reply::Array(Some(items)))
        }
        _ => Err(invalid(format!("unexpected reply type byte {kind:#04x}"))),
    }
}

/// Appends one command in RESP to `out`.
pub(super) fn encode(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

/// A TCP connection to `addr` (`host:port`) without Nagle's delay, whose connect, reads and
/// writes each time out after [`IO_TIMEOUT`].
pub(super) fn connect(addr: &str) -> io::Result<TcpStream> {
    let sock = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no address for {addr}")))?;
    let s = TcpStream::connect_timeout(&sock, IO_TIMEOUT)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(s)
}

/// A connection to one node; every operation times out after [`IO_TIMEOUT`].
pub(super) struct Conn {
    pub(super) reader: BufReader<TcpStream>,
}

impl Conn {
    pub(super) fn open(addr: &str) -> io::Result<Conn> {
        Ok(Conn {
            reader: BufReader::with_capacity(64 << 10, connect(addr)?),
        })
    }

    pub(super) fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.reader.get_mut().write_all(bytes)
    }

    pub(super) fn recv(&mut self) -> io::Result<Reply> {
        read_reply(&mut self.reader, 0)
    }

    pub(super) fn call(&mut self, args: &[&[u8]]) -> io::Result<Reply> {
        let mut out = Vec::new();
        encode(&mut out, args);
        self.send(&out)?;
        self.recv()
    }
}

/// One command on a fresh connection to `addr`.
pub(super) fn call(addr: &str, args: &[&str]) -> anyhow::Result<Reply> {
    let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
    Conn::open(addr)
        .with_context(|| format!("connecting to {addr}"))?
        .call(&args)
        .with_context(|| format!("calling {addr}"))
}

/// The text of an INFO section, or of CLUSTER INFO (`args`).
pub(super) fn text(addr: &str, args: &[&str]) -> anyhow::Result<String> {
    match call(addr, args)? {
        Reply::Bulk(Some(body)) => Ok(String::from_utf8_lossy(&body).into_owned()),
        other => bail!("{args:?} on {addr}: {other:?}"),
    }
}

/// The error class of an I/O failure, as counted in
/// [`LoadResult::errors`](super::LoadResult::errors).
pub(super) fn io_kind(e: &io::Error) -> &'static str {
    use io::ErrorKind::*;
    match e.kind() {
        ConnectionRefused => "refused",
        ConnectionReset | ConnectionAborted | BrokenPipe => "reset",
        UnexpectedEof => "closed",
        TimedOut | WouldBlock => "timeout",
        InvalidData => "protocol",
        _ => "io",
    }
}

// ---------------------------------------------------------------------------------------------
// Nodes and the slot map
// ---------------------------------------------------------------------------------------------

/// Node addresses (`host:port`) by small ids, shared by the load's threads.
#[derive(Default)]
pub(super) struct Nodes(Mutex<Vec<String>>);

impl Nodes {
    pub(super) fn list(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The id of `addr`, given one if new ([`NO_NODE`] once ids run out).
    pub(super) fn id(&self, addr: &str) -> u16 {
        let mut list = self.list();
        if let Some(i) = list.iter().position(|a| a == addr) {
            return i as u16;
        }
        if list.len() >= NO_NODE as usize {
            return NO_NODE;
        }
        list.push(addr.to_string());
        (list.len() - 1) as u16
    }

    pub(super) fn find(&self, addr: &str) -> Option<u16> {
        self.list().iter().position(|a| a == addr).map(|i| i as u16)
    }

    pub(super) fn name(&self, id: u16) -> Option<String> {
        self.list().get(id as usize).cloned()
    }
}

/// `host:port`, with `host` taken from `fallback` when the node left it empty (Redis does when it
/// does not know its own address), and bracketed when it is IPv6.
pub(super) fn node_addr(host: &str, port: &str, fallback: &str) -> String {
    let host = if host.is_empty() || host == "?" {
        fallback
    } else {
        host
    };
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The host part of `host:port`.
pub(super) fn host_of(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}

/// The owner of every slot from a `CLUSTER SLOTS` reply, [`NO_NODE`] for uncovered slots.
fn parse_slots(reply: &Reply, fallback_host: &str, nodes: &Nodes) -> Result<Vec<u16>, String> {
    let Reply::Array(Some(ranges)) = reply else {
        return Err(format!("CLUSTER SLOTS replied {reply:?}"));
    };
    let mut owner = vec![NO_NODE; SLOT_COUNT as usize];
    for range in ranges {
        let Reply::Array(Some(items)) = range else {
            return Err(format!("CLUSTER SLOTS range {range:?}"));
        };
        let (Some(Reply::Int(start)), Some(Reply::Int(end)), Some(Reply::Array(Some(master)))) =
            (items.first(), items.get(1), items.get(2))
        else {
            return Err(format!("CLUSTER SLOTS range {range:?}"));
        };
        let (Some(Reply::Bulk(Some(host))), Some(Reply::Int(port))) =
            (master.first(), master.get(1))
        else {
            return Err(format!("CLUSTER SLOTS node {master:?}"));
        };
        if !(0 <= *start && start <= end && *end < i64::from(SLOT_COUNT)) {
            return Err(format!("CLUSTER SLOTS range {start}-{end}"));
        }
        let addr = node_addr(
            &String::from_utf8_lossy(host),
            &port.to_string(),
            fallback_host,
        );
        owner[*start as usize..=*end as usize].fill(nodes.id(&addr));
    }
    Ok(owner)
}

/// The slot map from the first of `addrs` that answers `CLUSTER SLOTS` with at least one covered
/// slot; None if none does. Checks `stop` between nodes.
pub(super) fn fetch_map<'a>(
    addrs: impl IntoIterator<Item = &'a str>,
    nodes: &Nodes,
    stop: Option<&AtomicBool>,
) -> Option<Vec<u16>> {
    for addr in addrs {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            return None;
        }
        let Ok(mut conn) = Conn::open(addr) else {
            continue;
        };
        let Ok(reply) = conn.call(&[b"CLUSTER", b"SLOTS"]) else {
            continue;
        };
        if let Ok(map) = parse_slots(&reply, host_of(addr), nodes) {
            if map.iter().any(|&n| n != NO_NODE) {
                return Some(map);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> io::Result<Reply> {
        read_reply(&mut io::Cursor::new(bytes), 0)
    }

    #[test]
    fn parses_replies_and_refuses_garbage() {
        assert_eq!(parse(b"+OK\r\n").unwrap(), Reply::Status("OK".into()));
        assert_eq!(
            parse(b"-MOVED 3999 127.0.0.1:6381\r\n").unwrap(),
            Reply::Error("MOVED 3999 127.0.0.1:6381".into())
        );
        assert_eq!(parse(b"$-1\r\n").unwrap(), Reply::Bulk(None));
        assert_eq!(
            parse(b"*2\r\n$3\r\nabc\r\n:7\r\n").unwrap(),
            Reply::Array(Some(vec![
                Reply::Bulk(Some(b"abc".to_vec())),
                Reply::Int(7)
            ]))
        );
        assert!(parse(b"").is_err());
        assert!(parse(b"$5\r\nab").is_err());
        assert!(parse(b"$99999999999\r\n").is_err());
        assert!(parse(b"?what\r\n").is_err());
        assert!(parse(b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n").is_err());
    }

    #[test]
    fn parses_cluster_slots() {
        let node = |host: &str, port| {
            Reply::Array(Some(vec![
                Reply::Bulk(Some(host.as_bytes().to_vec())),
                Reply::Int(port),
                Reply::Bulk(Some(b"id".to_vec())),
                Reply::Array(Some(vec![])),
            ]))
        };
        let reply = Reply::Array(Some(vec![
            Reply::Array(Some(vec![
                Reply::Int(0),
                Reply::Int(99),
                node("127.0.0.1", 7000),
                node("127.0.0.1", 7001),
            ])),
            Reply::Array(Some(vec![
                Reply::Int(100),
                Reply::Int(16383),
                node("", 7002),
            ])),
        ]));
        let nodes = Nodes::default();
        let map = parse_slots(&reply, "10.0.0.1", &nodes).unwrap();
        assert_eq!(nodes.name(map[0]).unwrap(), "127.0.0.1:7000");
        assert_eq!(map[99], map[0]);
        assert_eq!(nodes.name(map[100]).unwrap(), "10.0.0.1:7002");
        assert!(parse_slots(&Reply::Int(1), "h", &nodes).is_err());
    }
}
