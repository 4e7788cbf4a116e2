//! The status poller: the coordinator's answers about the victim, every 15 ms, from another
//! thread, from which the failover reads detection, recovery and re-protection.

use super::client::{connect, MAX_BULK};
use super::ramlog::cluster_status;
use anyhow::{bail, Context};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the status poller asks the coordinator.
const POLL_EVERY: Duration = Duration::from_millis(15);

/// A connection to the coordinator speaking its own protocol (crates/cluster/src/rpc.rs: a
/// 4-byte big-endian length and that much JSON each way; the request `"Status"`, the answer
/// `{"Status": {.., "map": ClusterMap}}`). `ramlog cluster status` sends the same request but
/// costs a process (about 4 ms of CPU); polled every 15 ms on a 2-core machine that would take a
/// fifth of a core from the servers under test. The poller falls back to the command when this
/// does not parse.
struct StatusConn(TcpStream);

impl StatusConn {
    fn open(addr: &str) -> anyhow::Result<StatusConn> {
        Ok(StatusConn(connect(addr)?))
    }

    /// (victim dead, tablets recovering, copies pending, recovering tablets without a restorer),
    /// counted as `ramlog cluster status --json` counts them.
    fn poll(&mut self, victim: u64) -> anyhow::Result<(bool, u64, u64, u64)> {
        let body = b"\"Status\"";
        let mut frame = (body.len() as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(body);
        self.0.write_all(&frame)?;
        let mut len = [0u8; 4];
        self.0.read_exact(&mut len)?;
        let len = u32::from_be_bytes(len) as usize;
        if len > MAX_BULK {
            bail!("a status frame of {len} bytes");
        }
        let mut buf = vec![0u8; len];
        self.0.read_exact(&mut buf)?;
        let v: serde_json::Value = serde_json::from_slice(&buf)?;
        let map = &v["Status"]["map"];
        let servers = map["servers"].as_array().context("no map.servers")?;
        let tablets = map["tablets"].as_array().context("no map.tablets")?;
        let victim = servers
            .iter()
            .find(|s| s["id"].as_u64() == Some(victim))
            .context("the victim is not in the map")?;
        let state = victim["state"].as_str().context("no server state")?;
        let mut recovering = 0;
        let mut pending = 0;
        let mut stuck = 0;
        for t in tablets {
            if t["recovering"].as_bool().context("no tablet recovering")? {
                recovering += 1;
                if t["restorer"].is_null() {
                    stuck += 1;
                }
            }
            pending += t["pending"].as_array().context("no tablet pending")?.len() as u64;
        }
        Ok((state == "dead", recovering, pending, stuck))
    }
}

/// One answer of the coordinator, as the poller saw it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sample {
    /// When the status command was started, and when its answer was in.
    pub(super) asked: Instant,
    pub(super) answered: Instant,
    pub(super) victim_dead: bool,
    pub(super) recovering: u64,
    pub(super) pending: u64,
    /// Recovering tablets that no live backup can restore.
    pub(super) stuck: u64,
}

/// A thread that asks the coordinator for its status every [`POLL_EVERY`] and keeps every
/// answer; stopped when dropped.
pub(super) struct Poller {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    pub(super) failures: Arc<AtomicU64>,
    /// Whether it polls over the coordinator's protocol (else through the CLI).
    pub(super) direct: bool,
    handle: Option<JoinHandle<()>>,
}

impl Poller {
    /// Polls `coordinator` about `victim`: over the coordinator's own protocol
    /// ([`StatusConn`]) if it answers that way now, else with `ramlog cluster status --json`.
    pub(super) fn start(coordinator: String, victim: u64) -> Poller {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let failures = Arc::new(AtomicU64::new(0));
        let (s, v, f) = (stop.clone(), samples.clone(), failures.clone());
        let mut direct = StatusConn::open(&coordinator).ok();
        if let Some(d) = direct.as_mut() {
            if d.poll(victim).is_err() {
                direct = None;
            }
        }
        let direct_ok = direct.is_some();
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let asked = Instant::now();
                let answer = match direct.as_mut() {
                    Some(d) => d.poll(victim).or_else(|_| {
                        // One reconnection per failure; the next poll tries again.
                        *d = StatusConn::open(&coordinator)?;
                        d.poll(victim)
                    }),
                    None => cluster_status(&coordinator).map(|st| {
                        (
                            st.servers.iter().any(|x| x.0 == victim && !x.1),
                            st.recovering,
                            st.pending,
                            st.stuck,
                        )
                    }),
                };
                match answer {
                    Ok((victim_dead, recovering, pending, stuck)) => {
                        let sample = Sample {
                            asked,
                            answered: Instant::now(),
                            victim_dead,
                            recovering,
                            pending,
                            stuck,
                        };
                        v.lock().unwrap_or_else(|e| e.into_inner()).push(sample);
                    }
                    Err(_) => {
                        f.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let next = asked + POLL_EVERY;
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                }
            }
        });
        Poller {
            stop,
            samples,
            failures,
            direct: direct_ok,
            handle: Some(handle),
        }
    }

    /// The first sample that satisfies `pred`.
    pub(super) fn first(&self, pred: impl Fn(&Sample) -> bool) -> Option<Sample> {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples.iter().find(|s| pred(s)).copied()
    }

    /// When the current run of samples showing stuck tablets began (None if the last shows
    /// none).
    pub(super) fn stuck_since(&self) -> Option<Instant> {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let run = samples.iter().rev().take_while(|s| s.stuck > 0).last()?;
        Some(run.answered)
    }

    pub(super) fn last(&self) -> Option<Sample> {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples.last().copied()
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
