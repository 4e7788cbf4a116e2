//! Raft's traffic between coordinator members, over the members' client port.
//!
//! Owns: one TCP connection per target member (opened on first use, dropped on any failure and
//! opened again on the next RPC), a deadline on every RPC, and the mapping of openraft's requests
//! and replies onto [`Request::Raft`] and [`Response::Raft`]. Hides: the JSON encoding and how
//! transport failures become openraft's `RPCError`s.

// openraft's traits return its error types, which are large; boxing them is not an option.
#![allow(clippy::result_large_err)]

use crate::TypeConfig;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use ramlog_cluster::rpc::{read_frame, write_frame, RaftRpc, Request, Response};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::Duration;
use tokio::net::TcpStream;

type NodeId = u64;

/// Deadline of an AppendEntries or Vote RPC.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(1);
/// Deadline of one InstallSnapshot chunk.
pub const SNAPSHOT_RPC_TIMEOUT: Duration = Duration::from_secs(5);

/// Makes one [`Connection`] per target member.
pub struct Network;

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Connection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Connection {
        Connection {
            target,
            address: node.addr.clone(),
            stream: None,
        }
    }
}

/// The link to one member.
pub struct Connection {
    target: NodeId,
    address: String,
    stream: Option<TcpStream>,
}

/// Why an RPC failed before the target answered.
enum Failure {
    /// Could not connect: the member is down; openraft backs off.
    Unreachable(std::io::Error),
    /// The connection broke, timed out, or the answer was malformed.
    Network(std::io::Error),
}

impl Connection {
    async fn call<Req: Serialize, Resp: DeserializeOwned>(
        &mut self,
        rpc: RaftRpc,
        request: &Req,
        timeout: Duration,
    ) -> Result<Resp, Failure> {
        let body = serde_json::to_value(request)
            .map_err(|e| Failure::Network(std::io::Error::other(e)))?;
        let request = Request::Raft { rpc, body };
        let result = tokio::time::timeout(timeout, self.exchange(&request)).await;
        let answer = match result {
            Ok(Ok(answer)) => answer,
            Ok(Err(f)) => {
                self.stream = None;
                return Err(f);
            }
            Err(_) => {
                self.stream = None;
                return Err(Failure::Network(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "member {} at {} did not answer a {rpc:?} in {timeout:?}",
                        self.target, self.address
                    ),
                )));
            }
        };
        match answer {
            Response::Raft(value) => serde_json::from_value(value).map_err(|e| {
                self.stream = None;
                Failure::Network(std::io::Error::other(format!(
                    "member {} sent a malformed {rpc:?} answer: {e}",
                    self.target
                )))
            }),
            other => {
                self.stream = None;
                Err(Failure::Network(std::io::Error::other(format!(
                    "member {} answered a {rpc:?} with {}",
                    self.target,
                    ramlog_cluster::rpc::unexpected(&other)
                ))))
            }
        }
    }

    async fn exchange(&mut self, request: &Request) -> Result<Response, Failure> {
        if self.stream.is_none() {
            let stream = TcpStream::connect(&self.address)
                .await
                .map_err(Failure::Unreachable)?;
            let _ = stream.set_nodelay(true);
            self.stream = Some(stream);
        }
        let Some(stream) = self.stream.as_mut() else {
            return Err(Failure::Network(std::io::Error::other("no connection")));
        };
        let net = |e: ramlog_cluster::rpc::RpcError| Failure::Network(std::io::Error::other(e));
        write_frame(stream, request).await.map_err(net)?;
        match read_frame::<_, Response>(stream).await.map_err(net)? {
            Some(answer) => Ok(answer),
            None => Err(Failure::Network(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the member closed the connection",
            ))),
        }
    }
}

/// Turns a transport failure or the target's error into openraft's error.
fn rpc_error<T, E: std::error::Error>(
    target: NodeId,
    result: Result<Result<T, E>, Failure>,
) -> Result<T, RPCError<NodeId, BasicNode, E>> {
    match result {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => Err(RPCError::RemoteError(RemoteError::new(target, e))),
        Err(Failure::Unreachable(e)) => Err(RPCError::Unreachable(Unreachable::new(&e))),
        Err(Failure::Network(e)) => Err(RPCError::Network(NetworkError::new(&e))),
    }
}

fn timeout_of(option: &RPCOption, cap: Duration) -> Duration {
    option.hard_ttl().min(cap).max(Duration::from_millis(50))
}

impl RaftNetwork<TypeConfig> for Connection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        let timeout = timeout_of(&option, RPC_TIMEOUT);
        let result: Result<Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>, Failure> =
            self.call(RaftRpc::AppendEntries, &rpc, timeout).await;
        rpc_error(self.target, result)
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        let timeout = timeout_of(&option, SNAPSHOT_RPC_TIMEOUT);
        let result: Result<
            Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>,
            Failure,
        > = self.call(RaftRpc::InstallSnapshot, &rpc, timeout).await;
        rpc_error(self.target, result)
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        let timeout = timeout_of(&option, RPC_TIMEOUT);
        let result: Result<Result<VoteResponse<NodeId>, RaftError<NodeId>>, Failure> =
            self.call(RaftRpc::Vote, &rpc, timeout).await;
        rpc_error(self.target, result)
    }
}
