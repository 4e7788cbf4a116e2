//! Reading keys back through a cluster after a failover, and counting the acknowledged writes
//! that were lost ([`Verify`]).

use super::client::{
    encode, fetch_map, host_of, node_addr, Conn, Nodes, Reply, BATCH, NO_NODE, RETRY_PAUSE,
};
use anyhow::{bail, Context};
use ramlog_common::key_slot;
use std::collections::BTreeMap;
use std::io;
use std::time::{Duration, Instant};

/// How long [`LoadResult::verify`](super::LoadResult::verify) keeps trying to read every key back.
const VERIFY_DEADLINE: Duration = Duration::from_secs(60);

/// The read-back check of [`LoadResult::verify`](super::LoadResult::verify).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Verify {
    /// Keys read back.
    pub checked: u64,
    /// Keys that lost an acknowledged write: the stored sequence number is below the highest
    /// acknowledged one, or the key is absent although a write to it was acknowledged.
    pub lost: u64,
    /// Of `lost`, the keys absent.
    pub missing: u64,
    /// Acknowledged writes lost: the sum over lost keys of highest acknowledged minus stored
    /// sequence number (a key's writes are acknowledged in sequence, each before the next is sent).
    pub lost_writes: u64,
    /// Keys holding a write never acknowledged (its reply was lost): not a loss.
    pub ahead: u64,
}

/// Reads `keys` through a cluster (`seeds`: `host:port`): routes by the slot map, follows `-ASK`,
/// and reads again after a map refresh whatever failed (`-MOVED`, `-TRYAGAIN`, a connection), for
/// at most [`VERIFY_DEADLINE`]. One value per key, in order (None: absent).
pub(super) fn read_keys(
    seeds: &[String],
    keys: &[Vec<u8>],
) -> anyhow::Result<Vec<Option<Vec<u8>>>> {
    let deadline = Instant::now() + VERIFY_DEADLINE;
    let nodes = Nodes::default();
    let mut values: Vec<Option<Vec<u8>>> = vec![None; keys.len()];
    let mut pending: Vec<usize> = (0..keys.len()).collect();
    let mut last_error = String::new();
    while !pending.is_empty() {
        if Instant::now() > deadline {
            bail!(
                "{} of {} keys could not be read back within {:?} (last error: {last_error})",
                pending.len(),
                keys.len(),
                VERIFY_DEADLINE
            );
        }
        let Some(map) = fetch_map(seeds.iter().map(String::as_str), &nodes, None) else {
            last_error = "no seed answered CLUSTER SLOTS".into();
            std::thread::sleep(RETRY_PAUSE);
            continue;
        };
        let mut by_node: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
        for k in pending.drain(..) {
            by_node
                .entry(map[key_slot(&keys[k]) as usize])
                .or_default()
                .push(k);
        }
        let mut retry = Vec::new();
        for (node, ks) in by_node {
            let Some(addr) = (node != NO_NODE).then(|| nodes.name(node)).flatten() else {
                last_error = "slot not served".into();
                retry.extend(ks);
                continue;
            };
            for batch in ks.chunks(BATCH) {
                let names: Vec<&[u8]> = batch.iter().map(|&k| keys[k].as_slice()).collect();
                let replies = match get_batch(&addr, &names) {
                    Ok(r) => r,
                    Err(e) => {
                        last_error = format!("{addr}: {e}");
                        retry.extend_from_slice(batch);
                        continue;
                    }
                };
                for (&k, reply) in batch.iter().zip(replies) {
                    let reply = match reply {
                        Reply::Error(e) if e.starts_with("ASK ") => {
                            let target = e.split_whitespace().nth(2).unwrap_or("");
                            let target = match target.rsplit_once(':') {
                                Some((host, port)) => node_addr(host, port, host_of(&addr)),
                                None => target.to_string(),
                            };
                            ask_get(&target, &keys[k]).unwrap_or(Reply::Error(e))
                        }
                        r => r,
                    };
                    match reply {
                        Reply::Bulk(value) => values[k] = value,
                        other => {
                            last_error = format!("GET via {addr}: {other:?}");
                            retry.push(k);
                        }
                    }
                }
            }
        }
        pending = retry;
        if !pending.is_empty() {
            std::thread::sleep(RETRY_PAUSE);
        }
    }
    Ok(values)
}

impl Verify {
    /// Counts one key read back: `stored` against its highest acknowledged sequence number.
    pub(super) fn check(
        &mut self,
        key: &[u8],
        acked: u64,
        stored: Option<Vec<u8>>,
    ) -> anyhow::Result<()> {
        self.checked += 1;
        let Some(value) = stored else {
            if acked > 0 {
                self.lost += 1;
                self.missing += 1;
                self.lost_writes += acked;
            }
            return Ok(());
        };
        let seq: u64 = value
            .split(|&b| b == b':')
            .next()
            .and_then(|s| std::str::from_utf8(s).ok())
            .and_then(|s| s.parse().ok())
            .with_context(|| {
                format!(
                    "key {}: value {:?} does not start with a sequence number",
                    String::from_utf8_lossy(key),
                    String::from_utf8_lossy(&value[..value.len().min(40)])
                )
            })?;
        if seq < acked {
            self.lost += 1;
            self.lost_writes += acked - seq;
        } else if seq > acked {
            self.ahead += 1;
        }
        Ok(())
    }
}

/// Pipelined GETs of `keys` on `addr`, one reply each.
fn get_batch(addr: &str, keys: &[&[u8]]) -> io::Result<Vec<Reply>> {
    let mut conn = Conn::open(addr)?;
    let mut out = Vec::new();
    for key in keys {
        encode(&mut out, &[b"GET", key]);
    }
    conn.send(&out)?;
    keys.iter().map(|_| conn.recv()).collect()
}

/// `ASKING` then `GET key` on `addr`.
fn ask_get(addr: &str, key: &[u8]) -> io::Result<Reply> {
    let mut conn = Conn::open(addr)?;
    let mut out = Vec::new();
    encode(&mut out, &[b"ASKING"]);
    encode(&mut out, &[b"GET", key]);
    conn.send(&out)?;
    conn.recv()?;
    conn.recv()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_counts_losses() {
        let mut v = Verify::default();
        v.check(b"k", 5, Some(b"5:xx".to_vec())).unwrap();
        v.check(b"k", 5, Some(b"3:xx".to_vec())).unwrap();
        v.check(b"k", 5, None).unwrap();
        v.check(b"k", 0, None).unwrap();
        v.check(b"k", 5, Some(b"6:".to_vec())).unwrap();
        assert!(v.check(b"k", 5, Some(b"zz".to_vec())).is_err());
        assert_eq!(
            v,
            Verify {
                checked: 6,
                lost: 2,
                missing: 1,
                lost_writes: 7,
                ahead: 1
            }
        );
    }
}
