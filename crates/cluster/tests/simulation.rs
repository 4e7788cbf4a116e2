//! A deterministic simulation of the coordinator's state machine driving a modelled cluster:
//! servers that crash, are declared dead, restart (rejoin) and crash all together; masters that
//! write and acknowledge as `sync` does; restorers that replay their own logs; masters that copy
//! tablets to pending backups. Each seed gives one schedule of events (a failing seed replays
//! exactly: `RAMLOG_SIM_SEED=N cargo test -p ramlog-cluster --test simulation`).
//!
//! What is modelled of each server: per tablet, the newest write its backup log holds and whether
//! that log is complete (it holds every write of the tablet up to it: false for a backup that was
//! sent only live writes before its copy, or that dropped its logs on rejoin), what of it is synced
//! (a crash keeps only that), and the first acknowledged write it lacks (it was down or out of the
//! backup set meanwhile); per mastered tablet, the newest write in memory (lost with the
//! process). Each seed runs `durable` (a write is acknowledged once every backup of the tablet's
//! set has synced it: nothing acknowledged may be lost, whatever crashes, power cuts included) or
//! `sync` (once every backup holds it in its write buffer, which a crash loses: nothing
//! acknowledged may be lost to one failure at a time, so a crash there waits until the cluster
//! has recovered from the last). After every step the simulation checks that:
//! - no tablet names a master among its backups, a backup twice, or a restorer outside its backups;
//! - a restore never starts from a log that is incomplete, that missed an acknowledged write, or
//!   that is older than the tablet's newest acknowledged write (no acknowledged write lost);
//! - every tablet served by a live master holds its newest acknowledged write;
//! - a server's epoch never goes back.

use ramlog_cluster::state::PreviousIdentity;
use ramlog_cluster::{
    ClusterState, Command, CommandOutcome, ServerAddresses, ServerId, ServerState,
};
use std::collections::HashMap;
use std::net::SocketAddr;

const CLUSTER: u64 = 0x5eed;

/// The schedule's only source of choices (splitmix64).
use ramlog_cluster::placement::SplitMix as Rng;

type Tablet = (ramlog_common::TableId, u16);

#[derive(Default, Clone)]
struct Log {
    newest: u64,
    /// What a crash keeps: the write buffer (`sync` acknowledges there) is synced every 100 ms.
    durable: u64,
    complete: bool,
    /// The first acknowledged write of the tablet this log lacks (0: none) because it was down,
    /// or out of the backup set, or crashed before syncing it: the log has a gap there, whatever
    /// it received later.
    missed: u64,
}

impl Log {
    fn miss(&mut self, v: u64) {
        if self.missed == 0 || v < self.missed {
            self.missed = v;
        }
    }
}

struct Server {
    id: ServerId,
    alive: bool,
    epoch: u64,
    logs: HashMap<Tablet, Log>,
    memory: HashMap<Tablet, u64>,
}

/// What the schedules exercised (so that a run that checks nothing fails).
#[derive(Default, Debug)]
struct Stats {
    acknowledged: u64,
    restores: u64,
    copies: u64,
    power_cuts: u64,
    fresh_rejoins: u64,
}

struct Sim {
    /// `sync` (acknowledged once in every backup's write buffer) or `durable` (once synced).
    sync: bool,
    stats: Stats,
    state: ClusterState,
    servers: Vec<Server>,
    acked: HashMap<Tablet, u64>,
    next_write: u64,
    step: u64,
    trace: Vec<String>,
}

fn addresses(i: usize) -> ServerAddresses {
    let a = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
    let port = 10_000 + 10 * i as u16;
    ServerAddresses {
        resp: a(port),
        routing: None,
        native: a(port + 1),
        admin: None,
    }
}

impl Sim {
    fn new(servers: usize, sync: bool) -> Sim {
        let mut state = ClusterState::default();
        state
            .apply(&Command::Init {
                cluster_id: CLUSTER,
                initial_servers: servers as u32,
                default_mode: None,
                default_replicas: None,
            })
            .unwrap();
        let mut sim = Sim {
            sync,
            stats: Stats::default(),
            state,
            servers: Vec::new(),
            acked: HashMap::new(),
            next_write: 0,
            step: 0,
            trace: Vec::new(),
        };
        for i in 0..servers {
            let out = sim.state.apply(&Command::Register {
                previous: None,
                addresses: addresses(i),
                memory_bytes: 1 << 30,
                live: vec![],
                incarnation: 0,
            });
            let Ok(CommandOutcome::Registered { id, epoch }) = out else {
                panic!("{out:?}")
            };
            sim.servers.push(Server {
                id,
                alive: true,
                epoch,
                logs: HashMap::new(),
                memory: HashMap::new(),
            });
        }
        // The placement: every backup holds the (empty) tablet whole.
        for t in sim.state.map.tablets.clone() {
            let key = (t.table, t.first_slot);
            for b in &t.backups {
                sim.server_mut(*b).logs.insert(
                    key,
                    Log {
                        newest: 0,
                        durable: 0,
                        complete: true,
                        missed: 0,
                    },
                );
            }
            sim.server_mut(t.master).memory.insert(key, 0);
        }
        sim
    }

    fn server_mut(&mut self, id: ServerId) -> &mut Server {
        self.servers.iter_mut().find(|s| s.id == id).unwrap()
    }

    fn server(&self, id: ServerId) -> &Server {
        self.servers.iter().find(|s| s.id == id).unwrap()
    }

    fn up_in_map(&self, id: ServerId) -> bool {
        self.state
            .map
            .server(id)
            .is_some_and(|s| s.state == ServerState::Up)
    }

    fn note(&mut self, what: String) {
        self.trace.push(format!("{:>4} {what}", self.step));
    }

    /// A client write to a random tablet whose master is live: acknowledged if every backup of
    /// the set took it (`sync`); a backup that is down misses it (the write then waits, and the
    /// model counts it as not acknowledged).
    fn write(&mut self, rng: &mut Rng) {
        let tablets = &self.state.map.tablets;
        let t = tablets[rng.below(tablets.len())].clone();
        let key = (t.table, t.first_slot);
        if t.recovering || !self.server(t.master).alive || !self.up_in_map(t.master) {
            return;
        }
        if !self.server(t.master).memory.contains_key(&key) {
            return;
        }
        self.next_write += 1;
        let v = self.next_write;
        self.server_mut(t.master).memory.insert(key, v);
        let mut all = true;
        for b in &t.backups {
            let s = self.server_mut(*b);
            if s.alive {
                // Live writes reach pending backups too; their log stays incomplete until the copy.
                let log = s.logs.entry(key).or_default();
                log.newest = v;
                if rng.below(4) == 0 {
                    log.durable = v;
                }
            } else {
                all = false;
            }
        }
        if all && !self.sync {
            // `durable`: the reply waits until every backup has synced the write.
            for b in &t.backups {
                let log = self.server_mut(*b).logs.get_mut(&key).unwrap();
                log.durable = v;
            }
        }
        let backups = t.backups.clone();
        self.note(format!(
            "write {v} to {key:?} on {} backups {backups:?}: {}",
            t.master,
            if all { "acknowledged" } else { "waits" }
        ));
        if all {
            self.stats.acknowledged += 1;
            self.acked.insert(key, v);
            for s in &mut self.servers {
                let took = s.alive && t.backups.contains(&s.id);
                if let (false, Some(log)) = (took, s.logs.get_mut(&key)) {
                    log.miss(v);
                }
            }
        }
    }

    fn crash(&mut self, i: usize) {
        if !self.servers[i].alive {
            return;
        }
        let s = &mut self.servers[i];
        s.alive = false;
        s.memory.clear();
        // What was only in the write buffer is gone (under `durable` never an acknowledged
        // write; under `sync` the log then has a gap from the first acknowledged write lost).
        for (key, log) in s.logs.iter_mut() {
            if log.newest > log.durable && self.acked.get(key).is_some_and(|&a| a > log.durable) {
                log.miss(log.durable + 1);
            }
            log.newest = log.durable;
        }
        let id = s.id;
        self.note(format!("crash server {id}"));
    }

    fn declare(&mut self, i: usize) {
        let (id, alive, epoch) = (
            self.servers[i].id,
            self.servers[i].alive,
            self.servers[i].epoch,
        );
        if alive || !self.up_in_map(id) {
            return;
        }
        let out = self.state.apply(&Command::DeclareDead {
            server: id,
            epoch,
            reason: "simulated".into(),
            room: None,
        });
        self.note(format!("declare {id} dead: {out:?}"));
    }

    fn restart(&mut self, i: usize) {
        if self.servers[i].alive {
            return;
        }
        let id = self.servers[i].id;
        // Servers the coordinator heard from after this one went silent: those running now.
        let live: Vec<ServerId> = self
            .servers
            .iter()
            .filter(|s| s.id != id && s.alive)
            .map(|s| s.id)
            .collect();
        let out = self
            .state
            .apply(&Command::Register {
                previous: Some(PreviousIdentity {
                    cluster_id: CLUSTER,
                    server_id: id,
                }),
                addresses: addresses(i),
                memory_bytes: 1 << 30,
                live: live.clone(),
                incarnation: 0,
            })
            .unwrap();
        let CommandOutcome::Registered { epoch, .. } = out else {
            panic!("{out:?}")
        };
        assert!(
            epoch > self.servers[i].epoch || epoch == self.server(id).epoch,
            "epoch went back"
        );
        let fresh: Vec<Tablet> = self
            .state
            .map
            .tablets
            .iter()
            .filter(|t| t.fresh.contains(&id))
            .map(|t| (t.table, t.first_slot))
            .collect();
        let listed: Vec<Tablet> = self
            .state
            .map
            .tablets
            .iter()
            .filter(|t| t.backups.contains(&id))
            .map(|t| (t.table, t.first_slot))
            .collect();
        if !fresh.is_empty() {
            self.stats.fresh_rejoins += 1;
        }
        let s = &mut self.servers[i];
        s.alive = true;
        s.epoch = epoch;
        // As the server does: logs of tablets it is fresh for are dropped, logs of tablets that no
        // longer list it are dropped; the others stay (they count where it is not fresh).
        s.logs
            .retain(|k, _| listed.contains(k) && !fresh.contains(k));
        self.note(format!(
            "restart server {id} (epoch {epoch}, live {live:?}, fresh for {})",
            fresh.len()
        ));
    }

    /// Every process dies at once (run under `durable` only).
    fn power_cut(&mut self) {
        for i in 0..self.servers.len() {
            self.crash(i);
        }
    }

    /// Every server runs and is up, no tablet recovers and no copy is pending.
    fn settled(&self) -> bool {
        self.servers.iter().all(|s| s.alive && self.up_in_map(s.id))
            && self
                .state
                .map
                .tablets
                .iter()
                .all(|t| !t.recovering && t.pending.is_empty())
    }

    /// The newest acknowledged write of the tablet (none may be lost).
    fn required(&self, key: Tablet) -> u64 {
        self.acked.get(&key).copied().unwrap_or(0)
    }

    /// A live restorer of a recovering tablet replays its logs and reports.
    fn recover(&mut self, rng: &mut Rng) -> Result<(), String> {
        let candidates: Vec<_> = self
            .state
            .map
            .tablets
            .iter()
            .filter(|t| t.recovering && t.restorer.is_some_and(|r| self.server(r).alive))
            .cloned()
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        let t = &candidates[rng.below(candidates.len())];
        let key = (t.table, t.first_slot);
        let r = t.restorer.unwrap();
        let log = self.server(r).logs.get(&key).cloned().unwrap_or_default();
        let acked = self.required(key);
        if log.missed != 0 && log.missed <= acked {
            return Err(format!(
                "tablet {key:?} restored by server {r} from a log that lacks acknowledged write {} (acknowledged {acked})",
                log.missed
            ));
        }
        if !log.complete && acked > 0 {
            return Err(format!(
                "tablet {key:?} restored by server {r} from an incomplete log (newest {}, acknowledged {acked})",
                log.newest
            ));
        }
        if log.newest < acked {
            return Err(format!(
                "tablet {key:?} restored by server {r} loses acknowledged writes: its log ends at {}, {acked} was acknowledged",
                log.newest
            ));
        }
        let out = self.state.apply(&Command::TabletRecovered {
            table: t.table,
            first_slot: t.first_slot,
            epoch: t.epoch,
            server: r,
        });
        if out == Ok(CommandOutcome::Noted { applied: true }) {
            self.stats.restores += 1;
            self.server_mut(r).memory.insert(key, log.newest);
        }
        self.note(format!(
            "server {r} restores {key:?} from log {} (acked {acked}): {out:?}",
            log.newest
        ));
        Ok(())
    }

    /// A live master finishes copying a tablet to one of its pending backups.
    fn copy(&mut self, rng: &mut Rng) {
        let candidates: Vec<_> = self
            .state
            .map
            .tablets
            .iter()
            .filter(|t| {
                !t.recovering
                    && self.server(t.master).alive
                    && t.pending.iter().any(|b| self.server(*b).alive)
            })
            .cloned()
            .collect();
        if candidates.is_empty() {
            return;
        }
        let t = &candidates[rng.below(candidates.len())];
        let key = (t.table, t.first_slot);
        let live: Vec<ServerId> = t
            .pending
            .iter()
            .copied()
            .filter(|b| self.server(*b).alive)
            .collect();
        let b = live[rng.below(live.len())];
        let Some(&v) = self.server(t.master).memory.get(&key) else {
            return;
        };
        let out = self.state.apply(&Command::CopyDone {
            table: t.table,
            first_slot: t.first_slot,
            epoch: t.epoch,
            backup: b,
        });
        if out == Ok(CommandOutcome::Noted { applied: true }) {
            self.stats.copies += 1;
            self.server_mut(b).logs.insert(
                key,
                Log {
                    newest: v,
                    durable: v,
                    complete: true,
                    missed: 0,
                },
            );
        }
        self.note(format!("copy {key:?} to {b} at {v}: {out:?}"));
    }

    fn check(&self) -> Result<(), String> {
        for t in &self.state.map.tablets {
            let key = (t.table, t.first_slot);
            if t.backups.contains(&t.master) {
                return Err(format!(
                    "tablet {key:?}: master {} among its backups {:?}",
                    t.master, t.backups
                ));
            }
            let mut b = t.backups.clone();
            b.sort_unstable();
            b.dedup();
            if b.len() != t.backups.len() {
                return Err(format!("tablet {key:?}: a backup twice: {:?}", t.backups));
            }
            if let Some(r) = t.restorer {
                if !t.backups.contains(&r) {
                    return Err(format!(
                        "tablet {key:?}: restorer {r} outside its backups {:?}",
                        t.backups
                    ));
                }
            }
            let acked = self.required(key);
            let m = self.server(t.master);
            if !t.recovering && m.alive && self.up_in_map(t.master) {
                let held = m.memory.get(&key).copied().unwrap_or(0);
                if held < acked {
                    return Err(format!(
                        "tablet {key:?}: master {} serves write {held}, {acked} was acknowledged",
                        t.master
                    ));
                }
            }
        }
        for s in &self.servers {
            let e = self.state.map.server(s.id).map_or(0, |x| x.epoch);
            if e < s.epoch {
                return Err(format!(
                    "server {}: epoch went back from {} to {e}",
                    s.id, s.epoch
                ));
            }
        }
        Ok(())
    }
}

/// One schedule: returns the trace and the first violation, if any.
fn run(seed: u64, steps: u64) -> Result<Stats, (String, Vec<String>)> {
    let mut rng = Rng(seed);
    let n = 3 + rng.below(3);
    let sync = rng.below(2) == 0;
    let mut sim = Sim::new(n, sync);
    for step in 1..=steps {
        sim.step = step;
        let roll = rng.below(1000);
        let i = rng.below(n);
        let result = match roll {
            0..=599 => {
                sim.write(&mut rng);
                Ok(())
            }
            600..=619 => {
                // `sync` promises to survive one failure at a time: a crash waits until the
                // cluster has recovered and re-protected everything from the last one.
                if !sim.sync || sim.settled() {
                    sim.crash(i);
                }
                Ok(())
            }
            620..=623 => {
                // Every process at once (a power cut): only `durable` promises to survive it.
                if !sim.sync {
                    sim.stats.power_cuts += 1;
                    sim.power_cut();
                }
                Ok(())
            }
            624..=723 => {
                sim.declare(i);
                Ok(())
            }
            724..=823 => {
                sim.restart(i);
                Ok(())
            }
            824..=903 => sim.recover(&mut rng),
            904..=963 => {
                sim.copy(&mut rng);
                Ok(())
            }
            _ => {
                // The periodic sync of every running server's write buffer.
                for s in sim.servers.iter_mut().filter(|s| s.alive) {
                    for log in s.logs.values_mut() {
                        log.durable = log.newest;
                    }
                }
                Ok(())
            }
        };
        if let Err(e) = result.and_then(|_| sim.check()) {
            // The events of the tablet named, and every membership event.
            let tablet = e.split(')').next().unwrap_or("").to_string() + ")";
            let trace = sim
                .trace
                .into_iter()
                .filter(|l| {
                    !l.contains("write ") && !l.contains("restores") && !l.contains("copy ")
                        || l.contains(tablet.trim_start_matches(|c: char| c != '('))
                })
                .collect();
            return Err((e, trace));
        }
    }
    Ok(sim.stats)
}

#[test]
fn thousands_of_seeded_schedules_keep_every_acknowledged_write() {
    let (first, count) = match std::env::var("RAMLOG_SIM_SEED") {
        Ok(s) => (s.parse::<u64>().expect("RAMLOG_SIM_SEED is a number"), 1),
        Err(_) => (1, 3000),
    };
    let steps = 400;
    let mut total = Stats::default();
    for seed in first..first + count {
        match run(seed, steps) {
            Ok(s) => {
                total.acknowledged += s.acknowledged;
                total.restores += s.restores;
                total.copies += s.copies;
                total.power_cuts += s.power_cuts;
                total.fresh_rejoins += s.fresh_rejoins;
            }
            Err((violation, trace)) => {
                let tail = trace[trace.len().saturating_sub(80)..].join("\n");
                panic!("seed {seed}: {violation}\nreplay: RAMLOG_SIM_SEED={seed} cargo test -p ramlog-cluster --test simulation\nevents of that tablet and of membership:\n{tail}");
            }
        }
    }
    println!("{count} schedules of {steps} steps: {total:?}");
    if count > 1 {
        // Every kind of event happened many times.
        assert!(
            total.acknowledged > 50 * count && total.restores > 5 * count,
            "{total:?}"
        );
        assert!(
            total.copies > 2 * count && total.power_cuts > count / 2 && total.fresh_rejoins > count,
            "{total:?}"
        );
    }
}

#[test]
fn the_same_seed_gives_the_same_schedule() {
    let trace = |seed| {
        let mut rng = Rng(seed);
        (0..100).map(|_| rng.next_u64()).collect::<Vec<_>>()
    };
    assert_eq!(trace(42), trace(42));
    assert_ne!(trace(42), trace(43));
}
