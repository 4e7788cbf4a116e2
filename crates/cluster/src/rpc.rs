//! The coordinator's wire protocol and its client.
//!
//! One TCP port per coordinator member carries both what servers and tools ask ([`Request`]) and
//! Raft's traffic between members ([`Request::Raft`]). A frame is a 4-byte big-endian length and
//! that many bytes of JSON; a frame above [`FRAME_MAX_BYTES`] or one that does not decode closes
//! the connection with an error. Every request gets exactly one response, in order.
//!
//! Requests that change the map go to the Raft leader; a follower answers
//! [`Response::NotLeader`] with the leader's address when it knows it, and [`CoordinatorClient`]
//! follows it. The client tries every member it was given, within one deadline per call.

use crate::map::{ClusterMap, ReplicationMode, ServerAddresses, ServerId, TableInfo};
use crate::state::{CommandError, PreviousIdentity, TabletBytes};
use ramlog_common::TableId;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Mutex;

/// Largest frame either side accepts (a snapshot of a large map fits many times over).
pub const FRAME_MAX_BYTES: usize = 64 << 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Request {
    /// A server joins (or rejoins after a restart, with what it remembers).
    Register {
        previous: Option<PreviousIdentity>,
        addresses: ServerAddresses,
        memory_bytes: u64,
        /// A random number the server process drew when it started: a retried registration
        /// of the same process is answered with what the first one got.
        #[serde(default)]
        incarnation: u64,
    },
    /// Sent by every server every heartbeat interval; the answer carries the map when the
    /// coordinator's is newer than `map_version`.
    Heartbeat {
        id: ServerId,
        epoch: u64,
        map_version: u64,
        /// What the server could take for restores, and the size of the tablets it masters
        /// (None from servers that do not report it).
        #[serde(default)]
        memory: Option<MemoryReport>,
    },
    GetMap,
    /// A server reports a peer that does not answer as it should (a backup that leaves writes
    /// unacknowledged). The coordinator records it; the failure handling decides.
    Suspect {
        reporter: ServerId,
        suspect: ServerId,
        reason: String,
        /// The reporter knows the suspect cannot do its part (a backup that refuses what its
        /// master serves, even re-sent): the coordinator declares it dead without a probe, as a
        /// crashed server, so that it is replaced.
        #[serde(default)]
        failing: bool,
        /// The suspect is the reporter's backup and has acknowledged nothing for this long
        /// while the reporter's writes waited for it (0: not a backup, or it acknowledges). The
        /// leader cuts it off from the reporter's tablets past its `--cut-off-after-ms` if it
        /// still hears from it (`state::Command::DropBackup`).
        #[serde(default)]
        silent_ms: u64,
    },
    CreateTable {
        name: String,
        mode: ReplicationMode,
        replicas: Option<u32>,
        schema: Option<Vec<u8>>,
    },
    DropTable {
        name: String,
    },
    SetTableMode {
        name: String,
        mode: ReplicationMode,
    },
    /// The restorer of a recovering tablet holds it in memory and can master it.
    Recovered {
        server: ServerId,
        table: TableId,
        first_slot: u16,
        epoch: u64,
        /// Objects replayed and how long the replay took, for the coordinator's log.
        objects: u64,
        millis: u64,
    },
    /// The restorer of a recovering tablet ran out of memory restoring it, and freed what the
    /// restore held; `room_bytes` is the room it has now.
    RestoreFailed {
        server: ServerId,
        table: TableId,
        first_slot: u16,
        epoch: u64,
        reason: String,
        room_bytes: u64,
    },
    /// A master finished copying a tablet to a backup at `epoch`.
    CopyDone {
        server: ServerId,
        table: TableId,
        first_slot: u16,
        epoch: u64,
        backup: ServerId,
    },
    /// Moves the tablet of table `table` (by name) that holds `slot` to server `target`
    /// (`ramlog cluster move`); answered `Noted` once the migration is recorded.
    MoveTablet {
        table: String,
        slot: u16,
        target: ServerId,
    },
    /// Drains server `server` (`ramlog cluster drain`): its tablets move to the others, its
    /// backup roles are replaced, then it is removed.
    Drain {
        server: ServerId,
    },
    /// Rebalances the servers' mastered bytes (`ramlog cluster rebalance`).
    Rebalance,
    /// A migration's target holds the tablet in memory.
    MigrationReady {
        server: ServerId,
        table: TableId,
        first_slot: u16,
        epoch: u64,
    },
    /// A migration's source (`server`) stopped serving the tablet and every write it took is
    /// acknowledged by the target and the backups.
    MigrationSwitch {
        server: ServerId,
        table: TableId,
        first_slot: u16,
        epoch: u64,
    },
    /// A migration cannot go on (`server` says why).
    MigrationAbort {
        server: ServerId,
        table: TableId,
        first_slot: u16,
        epoch: u64,
        reason: String,
    },
    /// Splits the tablet of table `table` (by name) that holds `slot` at slot `at` (None: the
    /// middle of its slots) (`ramlog cluster split`); answered `Noted` once the split is recorded.
    SplitTablet {
        table: String,
        slot: u16,
        at: Option<u16>,
    },
    /// The master (`server`) copied the split's upper slots in its memory.
    SplitReady {
        server: ServerId,
        table: TableId,
        first_slot: u16,
        epoch: u64,
    },
    /// The master (`server`) split the tablet's memory at `at`, every write it took acknowledged.
    SplitDone {
        server: ServerId,
        table: TableId,
        first_slot: u16,
        at: u16,
        epoch: u64,
    },
    /// The master (`server`) could not split the tablet.
    SplitAbort {
        server: ServerId,
        table: TableId,
        first_slot: u16,
        epoch: u64,
        reason: String,
    },
    /// Merges the tablet of table `table` (by name) that holds `slot` with the next one
    /// (`ramlog cluster merge`); answered `Noted` once the merge is recorded.
    MergeTablets {
        table: String,
        slot: u16,
    },
    /// The master (`server`) copied the next tablet into the tablet at `first_slot`.
    MergeReady {
        server: ServerId,
        table: TableId,
        first_slot: u16,
        epoch: u64,
    },
    /// The master (`server`) joined the two tablets, every write they took acknowledged.
    MergeDone {
        server: ServerId,
        table: TableId,
        first_slot: u16,
        epoch: u64,
    },
    /// The master (`server`) could not merge the tablets.
    MergeAbort {
        server: ServerId,
        table: TableId,
        first_slot: u16,
        epoch: u64,
        reason: String,
    },
    /// The coordinator members, the leader, and the map.
    Status,
    /// Raft traffic between coordinator members: the body is openraft's request as JSON.
    Raft {
        rpc: RaftRpc,
        body: serde_json::Value,
    },
}

/// A server's memory as a heartbeat reports it: what the coordinator plans restores by
/// (`state::Room`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryReport {
    /// Bytes the server could still take for a restore: the live bytes its log can add before
    /// it reaches its utilisation limit, less a safety margin.
    pub room_bytes: u64,
    /// The tablets it masters (at most one entry per tablet of the map).
    #[serde(default)]
    pub tablets: Vec<TabletBytes>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RaftRpc {
    AppendEntries,
    Vote,
    InstallSnapshot,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Response {
    Registered {
        id: ServerId,
        epoch: u64,
        map: ClusterMap,
    },
    /// `map` is set when the coordinator's map is newer than the one the server named.
    /// `lease_ms`: for how long after sending this heartbeat the server may serve without
    /// another answer (shorter than the time after which the coordinator declares it dead).
    Heartbeat {
        map: Option<ClusterMap>,
        #[serde(default)]
        lease_ms: u64,
    },
    Map(ClusterMap),
    /// A report was recorded.
    Noted,
    TableCreated(TableInfo),
    TableDropped(TableId),
    TableAltered(TableInfo),
    Status(CoordinatorStatus),
    Raft(serde_json::Value),
    /// This member is not the leader; `leader` is the leader's client address if known.
    NotLeader {
        leader: Option<String>,
    },
    /// The server's epoch is older than the coordinator's: another process registered with its
    /// id since. It must stop serving.
    Fenced {
        reason: String,
    },
    /// The command was refused; nothing changed.
    Refused(CommandError),
    /// Any other failure (Raft could not commit, storage failed, a malformed request).
    Error(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordinatorStatus {
    /// The member that answered.
    pub member: u64,
    pub leader: Option<u64>,
    pub term: u64,
    pub members: Vec<MemberInfo>,
    pub map: ClusterMap,
    /// Milliseconds since each server's last heartbeat, as the answering member saw them
    /// (only the leader receives heartbeats).
    pub heartbeat_age_ms: Vec<(ServerId, u64)>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberInfo {
    pub id: u64,
    pub address: String,
    /// "leader", "follower", "candidate", "learner" or "unreachable" as the answering member knows it.
    pub role: String,
    pub last_applied: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    #[error("no coordinator reachable at {addresses}: {last}")]
    Unreachable { addresses: String, last: String },
    #[error("the coordinator refused: {0}")]
    Refused(#[from] CommandError),
    #[error("fenced by the coordinator: {0}")]
    Fenced(String),
    #[error("coordinator error: {0}")]
    Coordinator(String),
    #[error("bad frame: {0}")]
    Frame(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Writes one frame.
pub async fn write_frame<W: AsyncWriteExt + Unpin, T: Serialize>(
    w: &mut W,
    message: &T,
) -> Result<(), RpcError> {
    let body = serde_json::to_vec(message).map_err(|e| RpcError::Frame(e.to_string()))?;
    if body.len() > FRAME_MAX_BYTES {
        return Err(RpcError::Frame(format!(
            "a frame of {} bytes is above the limit of {FRAME_MAX_BYTES}",
            body.len()
        )));
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf).await?;
    w.flush().await?;
    Ok(())
}

/// Reads one frame; Ok(None) at a clean end of stream.
pub async fn read_frame<R: AsyncReadExt + Unpin, T: for<'de> Deserialize<'de>>(
    r: &mut R,
) -> Result<Option<T>, RpcError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > FRAME_MAX_BYTES {
        return Err(RpcError::Frame(format!(
            "a frame of {len} bytes is above the limit of {FRAME_MAX_BYTES}"
        )));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    decode_frame_body(&body).map(Some)
}

/// Decodes a frame's JSON body (also the fuzz target's entry point).
pub fn decode_frame_body<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, RpcError> {
    serde_json::from_slice(body).map_err(|e| RpcError::Frame(e.to_string()))
}

/// Parses a comma-separated list of coordinator addresses (`host:port,host:port`).
pub fn parse_addresses(list: &str) -> Vec<String> {
    list.split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// A client of the coordinator members. Cheap to share; calls are serialized over one cached
/// connection to the member that last answered.
pub struct CoordinatorClient {
    addresses: Vec<String>,
    timeout: Duration,
    /// Give up once as many members as there are refused a connection or knew no leader,
    /// instead of retrying until the timeout.
    single_round: bool,
    conn: Mutex<Option<(String, TcpStream)>>,
}

impl CoordinatorClient {
    /// `addresses`: every member's client address (or any subset); `timeout` bounds each call.
    pub fn new(addresses: Vec<String>, timeout: Duration) -> CoordinatorClient {
        CoordinatorClient {
            addresses,
            timeout,
            single_round: false,
            conn: Mutex::new(None),
        }
    }

    /// A client whose calls fail as soon as every member has refused a connection (no process
    /// listens on it) or answered that it knows no leader: for heartbeats, which the next tick retries anyway and whose failure
    /// must be known early.
    pub fn failing_fast(mut self) -> CoordinatorClient {
        self.single_round = true;
        self
    }

    pub fn addresses(&self) -> &[String] {
        &self.addresses
    }

    /// Sends `request` to the leader (following redirects, trying every member) and returns its
    /// answer. `Refused`, `Fenced` and `Error` answers become errors.
    pub async fn call(&self, request: &Request) -> Result<Response, RpcError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut conn = self.conn.lock().await;
        let mut next = 0usize;
        let mut hint: Option<String> = None;
        let mut last = String::from("no address given");
        let mut refused = 0usize;
        loop {
            if tokio::time::Instant::now() >= deadline || self.addresses.is_empty() {
                return Err(RpcError::Unreachable {
                    addresses: self.addresses.join(","),
                    last,
                });
            }
            if conn.is_none() {
                let address = hint
                    .take()
                    .unwrap_or_else(|| self.addresses[next % self.addresses.len()].clone());
                next += 1;
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                match tokio::time::timeout(left, TcpStream::connect(&address)).await {
                    Ok(Ok(stream)) => {
                        let _ = stream.set_nodelay(true);
                        *conn = Some((address, stream));
                    }
                    Ok(Err(e)) => {
                        last = format!("{address}: {e}");
                        if e.kind() == std::io::ErrorKind::ConnectionRefused {
                            refused += 1;
                            if self.single_round && refused >= self.addresses.len() {
                                return Err(RpcError::Unreachable {
                                    addresses: self.addresses.join(","),
                                    last,
                                });
                            }
                        }
                        if next.is_multiple_of(self.addresses.len()) {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        continue;
                    }
                    Err(_) => {
                        last = format!("{address}: connect timed out");
                        continue;
                    }
                }
            }
            let Some((address, stream)) = conn.as_mut() else {
                continue;
            };
            let address = address.clone();
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let exchange = async {
                write_frame(stream, request).await?;
                read_frame::<_, Response>(stream).await
            };
            match tokio::time::timeout(left, exchange).await {
                Ok(Ok(Some(response))) => match response {
                    Response::NotLeader { leader } => {
                        *conn = None;
                        last = format!("{address} is not the leader");
                        match leader {
                            Some(l) if l != address => hint = Some(l),
                            _ => {
                                // Knows no leader: as good as a refusal for a single round.
                                refused += 1;
                                if self.single_round && refused >= self.addresses.len() {
                                    return Err(RpcError::Unreachable {
                                        addresses: self.addresses.join(","),
                                        last,
                                    });
                                }
                                tokio::time::sleep(Duration::from_millis(50)).await
                            }
                        }
                    }
                    Response::Refused(e) => return Err(RpcError::Refused(e)),
                    Response::Fenced { reason } => return Err(RpcError::Fenced(reason)),
                    Response::Error(e) => return Err(RpcError::Coordinator(e)),
                    other => return Ok(other),
                },
                Ok(Ok(None)) => {
                    *conn = None;
                    last = format!("{address} closed the connection");
                }
                Ok(Err(e)) => {
                    *conn = None;
                    last = format!("{address}: {e}");
                }
                Err(_) => {
                    *conn = None;
                    last = format!("{address}: no answer in time");
                }
            }
        }
    }

    /// True when no coordinator member can lead now: each one either refuses connections (no
    /// process listens there) or answers that it knows no leader. False when any member cannot
    /// be reached at all (it may be on the other side of a partition) or names a leader.
    pub async fn leaderless(&self) -> bool {
        const WITHIN: Duration = Duration::from_millis(100);
        if self.addresses.is_empty() {
            return false;
        }
        for address in &self.addresses {
            let ask = async {
                let mut s = match TcpStream::connect(address).await {
                    Ok(s) => s,
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return true,
                    Err(_) => return false,
                };
                if write_frame(&mut s, &Request::Status).await.is_err() {
                    return false;
                }
                let status = match read_frame::<_, Response>(&mut s).await {
                    Ok(Some(Response::Status(status))) => status,
                    _ => return false,
                };
                let Some(leader) = status.leader else {
                    return true;
                };
                // The leader it names is gone (nothing listens there): as good as none.
                let Some(at) = status.members.iter().find(|m| m.id == leader) else {
                    return false;
                };
                matches!(
                    TcpStream::connect(&at.address).await,
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
                )
            };
            if !tokio::time::timeout(WITHIN, ask).await.unwrap_or(false) {
                return false;
            }
        }
        true
    }

    pub async fn map(&self) -> Result<ClusterMap, RpcError> {
        match self.call(&Request::GetMap).await? {
            Response::Map(map) => Ok(map),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn status(&self) -> Result<CoordinatorStatus, RpcError> {
        match self.call(&Request::Status).await? {
            Response::Status(s) => Ok(s),
            other => Err(unexpected(&other)),
        }
    }
}

/// An answer of the wrong kind for the request.
pub fn unexpected(response: &Response) -> RpcError {
    let text = format!("{response:?}");
    RpcError::Coordinator(format!(
        "unexpected answer: {}",
        text.chars().take(200).collect::<String>()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_refuse_garbage() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        write_frame(&mut a, &Request::GetMap).await.unwrap();
        let got: Request = read_frame(&mut b).await.unwrap().unwrap();
        assert!(matches!(got, Request::GetMap));
        a.write_all(&5u32.to_be_bytes()).await.unwrap();
        a.write_all(b"{bad}").await.unwrap();
        assert!(matches!(
            read_frame::<_, Request>(&mut b).await,
            Err(RpcError::Frame(_))
        ));
        a.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
        assert!(matches!(
            read_frame::<_, Request>(&mut b).await,
            Err(RpcError::Frame(_))
        ));
        drop(a);
        assert!(read_frame::<_, Request>(&mut b).await.unwrap().is_none());
    }

    #[test]
    fn messages_of_peers_without_memory_reports_still_decode() {
        let old = br#"{"Heartbeat":{"id":1,"epoch":2,"map_version":3}}"#;
        let r: Request = decode_frame_body(old).unwrap();
        assert!(
            matches!(r, Request::Heartbeat { memory: None, .. }),
            "{r:?}"
        );
        let old = br#"{"DeclareDead":{"server":1,"epoch":2,"reason":"killed"}}"#;
        let c: crate::Command = serde_json::from_slice(old).unwrap();
        assert!(
            matches!(c, crate::Command::DeclareDead { room: None, .. }),
            "{c:?}"
        );
        let old = br#"{"table":0,"first_slot":0,"last_slot":9,"master":1,"mirror":null,
            "backups":[2],"epoch":3,"recovering":true,"restorer":null}"#;
        let t: crate::TabletInfo = serde_json::from_slice(old).unwrap();
        assert!(t.waiting.is_none() && t.refused.is_empty());
        // And a report round-trips.
        let report = Request::Heartbeat {
            id: 1,
            epoch: 2,
            map_version: 3,
            memory: Some(MemoryReport {
                room_bytes: 7,
                tablets: vec![TabletBytes {
                    table: 0,
                    first_slot: 1024,
                    live_bytes: 99,
                    objects: 3,
                    ops_per_sec: 0,
                }],
            }),
        };
        let bytes = serde_json::to_vec(&report).unwrap();
        let back: Request = decode_frame_body(&bytes).unwrap();
        assert!(
            matches!(back, Request::Heartbeat { memory: Some(m), .. } if m.room_bytes == 7 && m.tablets[0].live_bytes == 99)
        );
    }

    #[tokio::test]
    async fn unreachable_members_fail_within_the_deadline() {
        let client = CoordinatorClient::new(
            vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()],
            Duration::from_millis(300),
        );
        let started = std::time::Instant::now();
        let e = client.map().await.unwrap_err();
        assert!(matches!(e, RpcError::Unreachable { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(3));
    }
}
