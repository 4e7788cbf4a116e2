//! Which tablets to move, for a drain and for rebalancing (the coordinator's leader plans with
//! these every few hundred milliseconds and proposes each move as a `MoveTablet` command).
//!
//! - **Drain.** Every tablet a draining server masters moves to a live server that is not
//!   being drained, preferring one that neither masters nor backs it up (the tablet keeps R
//!   backups throughout: a backup that became the master would leave R − 1 until it is
//!   replaced), then the one that masters the fewest bytes (counting moves already planned).
//!   Its backup roles are replaced by `ClusterState::repair`. Once it holds nothing it is
//!   removed ([`drained`]).
//! - **Rebalance.** While the live servers' mastered bytes spread more than [`TOLERANCE`]
//!   around their mean, a tablet moves from the server with the most to the one with the
//!   least: the one whose size is nearest half their gap and below the gap (every move lowers
//!   the spread's sum of squares, so the plan ends and no tablet moves back and forth).
//!
//! - **Partitions.** No tablet moves to a server its master reported it cannot reach
//!   ([`ClusterMap::is_cut_off`]): the move's copy would have to cross the partition, and the
//!   migration would only be rolled back. Rebalancing then gives to the emptiest server the
//!   giver reaches, or lets the next fullest server give.
//!
//! At most `in_flight_max` migrations run at once, and none is planned while a tablet recovers.

use crate::map::{ClusterMap, ServerId, ServerState};
use crate::state::Room;
use ramlog_common::TableId;
use std::collections::BTreeMap;

/// How far a server's mastered bytes may be from the mean, as a fraction of it.
pub const TOLERANCE: f64 = 0.10;
/// What a tablet whose size no report gave counts as.
const UNKNOWN_TABLET_BYTES: u64 = 1 << 20;

/// One planned move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    pub table: TableId,
    pub first_slot: u16,
    pub target: ServerId,
}

fn size_of(room: &Room, table: TableId, first_slot: u16) -> u64 {
    room.tablet(table, first_slot)
        .map_or(UNKNOWN_TABLET_BYTES, |b| b.live_bytes.max(1))
}

/// Servers that take tablets: up and not being drained, with the bytes each masters.
fn receivers(map: &ClusterMap, room: &Room) -> BTreeMap<ServerId, u64> {
    let mut load: BTreeMap<ServerId, u64> = map
        .servers
        .iter()
        .filter(|s| s.state == ServerState::Up && !s.draining)
        .map(|s| (s.id, 0))
        .collect();
    for t in &map.tablets {
        if let Some(l) = load.get_mut(&t.master) {
            *l += size_of(room, t.table, t.first_slot);
        }
        // A move under way counts on its target already.
        if let Some(m) = t.migration {
            if let Some(l) = load.get_mut(&m.target) {
                *l += size_of(room, t.table, t.first_slot);
            }
        }
    }
    load
}

fn in_flight(map: &ClusterMap) -> usize {
    map.tablets.iter().filter(|t| t.migration.is_some()).count()
}

/// The moves that empty the draining servers of the tablets they master.
pub fn drain_moves(map: &ClusterMap, room: &Room, in_flight_max: usize) -> Vec<Move> {
    if map.tablets.iter().any(|t| t.recovering) {
        return Vec::new();
    }
    let draining: Vec<ServerId> = map
        .servers
        .iter()
        .filter(|s| s.draining && s.state == ServerState::Up)
        .map(|s| s.id)
        .collect();
    let mut load = receivers(map, room);
    let mut budget = in_flight_max.saturating_sub(in_flight(map));
    let mut out = Vec::new();
    for t in &map.tablets {
        if budget == 0 {
            break;
        }
        if !draining.contains(&t.master) || t.migration.is_some() {
            continue;
        }
        let size = size_of(room, t.table, t.first_slot);
        let Some((&target, _)) = load
            .iter()
            .filter(|(&s, _)| s != t.master && !map.is_cut_off(t.master, s))
            .min_by_key(|(&s, &bytes)| (t.backups.contains(&s), bytes, s))
        else {
            continue;
        };
        *load.entry(target).or_default() += size;
        out.push(Move {
            table: t.table,
            first_slot: t.first_slot,
            target,
        });
        budget -= 1;
    }
    out
}

/// Draining servers that hold nothing any more (no tablet they master, back up, restore or
/// receive): they can be removed.
pub fn drained(map: &ClusterMap) -> Vec<(ServerId, u64)> {
    map.servers
        .iter()
        .filter(|s| s.draining && s.state == ServerState::Up)
        .filter(|s| {
            !map.tablets.iter().any(|t| {
                t.master == s.id
                    || t.backups.contains(&s.id)
                    || t.restorer == Some(s.id)
                    || t.mirror == Some(s.id)
                    || t.migration.is_some_and(|m| m.target == s.id)
            })
        })
        .map(|s| (s.id, s.epoch))
        .collect()
}

/// The next moves that bring the servers' mastered bytes within [`TOLERANCE`] of their mean;
/// empty when they are (or when nothing can narrow the spread).
pub fn rebalance_moves(map: &ClusterMap, room: &Room, in_flight_max: usize) -> Vec<Move> {
    if map.tablets.iter().any(|t| t.recovering) || in_flight(map) >= in_flight_max {
        return Vec::new();
    }
    let load = receivers(map, room);
    if load.len() < 2 {
        return Vec::new();
    }
    let total: u64 = load.values().sum();
    let mean = total as f64 / load.len() as f64;
    let most = *load.values().max().expect("two or more");
    let least = *load.values().min().expect("two or more");
    let within = |b: u64| (b as f64 - mean).abs() <= mean * TOLERANCE;
    if within(most) && within(least) {
        return Vec::new();
    }
    // The fullest server gives to the emptiest. A server a master cannot reach takes none of
    // its tablets (the copy would have to cross the partition): then the emptiest server that
    // master reaches takes one, or, if none fits, the next fullest server gives.
    let mut givers: Vec<(ServerId, u64)> = load.iter().map(|(&s, &b)| (s, b)).collect();
    givers.sort_by_key(|&(s, b)| (std::cmp::Reverse(b), s));
    for (from, most) in givers {
        let Some((to, least)) = load
            .iter()
            .filter(|(&s, _)| s != from && !map.is_cut_off(from, s))
            .min_by_key(|(&s, &b)| (b, s))
            .map(|(&s, &b)| (s, b))
        else {
            continue;
        };
        if least >= most || (within(most) && within(least)) {
            continue;
        }
        // The tablet of `from` whose move evens the two best: the size nearest half their
        // gap, and smaller than the gap (so the spread's sum of squares falls with every move
        // and the plan ends, with no tablet moving back and forth).
        let gap = most - least;
        let pick = map
            .tablets
            .iter()
            .filter(|t| t.master == from && t.migration.is_none() && !t.recovering)
            .map(|t| (size_of(room, t.table, t.first_slot), t))
            .filter(|(size, _)| *size < gap)
            .min_by_key(|(size, t)| {
                (
                    (gap as i128 - 2 * *size as i128).abs(),
                    t.table,
                    t.first_slot,
                )
            });
        if let Some((_, t)) = pick {
            return vec![Move {
                table: t.table,
                first_slot: t.first_slot,
                target: to,
            }];
        }
        // Without a cut-off the fullest server decides alone, as before: a pair it cannot
        // narrow is left.
        if !map.is_cut_off(from, least_of(&load)) {
            return Vec::new();
        }
    }
    Vec::new()
}

/// The emptiest server of `load` (the lowest id on a tie).
fn least_of(load: &BTreeMap<ServerId, u64>) -> ServerId {
    load.iter()
        .min_by_key(|(&s, &b)| (b, s))
        .map_or(0, |(&s, _)| s)
}

/// A server is hot when its tablets take more than this many times the servers' mean of reads
/// and writes per second.
pub const LOAD_HOT: f64 = 1.5;

/// The move that spreads load (reads and writes per second of each tablet, by (table, first
/// slot), as masters report them) when one server is hot: more than [`LOAD_HOT`] times the
/// mean and at least `min_ops` per second above it. The tablet of the hottest server whose move
/// narrows the gap to the coolest server the most without reversing it (its rate at most half
/// the gap) goes to the coolest. None when no server is hot, anything moves or recovers, or no
/// single tablet can narrow the gap (one tablet carries the heat).
pub fn load_move(
    map: &ClusterMap,
    rates: &BTreeMap<(TableId, u16), u64>,
    min_ops: u64,
) -> Option<Move> {
    if min_ops == 0 || in_flight(map) > 0 || map.tablets.iter().any(|t| t.recovering) {
        return None;
    }
    let mut load: BTreeMap<ServerId, u64> = map
        .servers
        .iter()
        .filter(|s| s.state == ServerState::Up && !s.draining)
        .map(|s| (s.id, 0))
        .collect();
    if load.len() < 2 {
        return None;
    }
    let rate =
        |t: &crate::map::TabletInfo| rates.get(&(t.table, t.first_slot)).copied().unwrap_or(0);
    for t in &map.tablets {
        if let Some(l) = load.get_mut(&t.master) {
            *l += rate(t);
        }
    }
    let mean = load.values().sum::<u64>() as f64 / load.len() as f64;
    let (&hot, &most) = load
        .iter()
        .max_by_key(|(&s, &r)| (r, std::cmp::Reverse(s)))?;
    // The coolest server the hot one can reach (see `rebalance_moves`).
    let (&cool, &least) = load
        .iter()
        .filter(|(&s, _)| s != hot && !map.is_cut_off(hot, s))
        .min_by_key(|(&s, &r)| (r, s))?;
    if (most as f64) < mean * LOAD_HOT || (most as f64) < mean + min_ops as f64 {
        return None;
    }
    let gap = most - least;
    map.tablets
        .iter()
        .filter(|t| {
            t.master == hot
                && t.migration.is_none()
                && t.split.is_none()
                && !t.recovering
                && t.pending.is_empty()
                && rate(t) > 0
                && rate(t) <= gap / 2
        })
        .max_by_key(|t| (rate(t), std::cmp::Reverse((t.table, t.first_slot))))
        .map(|t| Move {
            table: t.table,
            first_slot: t.first_slot,
            target: cool,
        })
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_hot_server_moves_the_tablet_that_evens_the_load_best_to_the_coolest() {
        let (map, _) = cluster(3, 3);
        let hot = map.tablets[0].master;
        let mine: Vec<_> = map.tablets.iter().filter(|t| t.master == hot).collect();
        assert!(mine.len() >= 3, "{} tablets", mine.len());
        let mut rates = BTreeMap::new();
        for t in &map.tablets {
            rates.insert((t.table, t.first_slot), 100);
        }
        // Even: nothing moves.
        assert_eq!(super::load_move(&map, &rates, 1000), None);
        // One server's three tablets take 30 000, 20 000 and 9 000 ops/s more.
        for (t, r) in mine.iter().zip([30_000, 20_000, 9_000]) {
            rates.insert((t.table, t.first_slot), r);
        }
        let m = super::load_move(&map, &rates, 1000).expect("a move");
        assert_ne!(m.target, hot);
        // Load of the hot server ~59 000 + the rest, the coolest ~ a few hundred: half the gap is
        // about 29 600, so the 20 000 tablet (the largest at most half the gap) moves.
        assert_eq!(rates[&(m.table, m.first_slot)], 20_000);
        // Below the floor, or off: nothing moves.
        assert_eq!(super::load_move(&map, &rates, 1_000_000), None);
        assert_eq!(super::load_move(&map, &rates, 0), None);
        // One tablet carries all the heat: no move narrows the gap.
        let mut one = BTreeMap::new();
        one.insert((mine[0].table, mine[0].first_slot), 50_000);
        assert_eq!(super::load_move(&map, &one, 1000), None);
    }

    use super::*;
    use crate::map::{Migration, MigrationPhase, ServerAddresses, ServerInfo};
    use crate::placement::place_table;
    use crate::state::TabletBytes;
    use std::net::SocketAddr;

    fn server(id: ServerId) -> ServerInfo {
        let a = SocketAddr::from(([127, 0, 0, 1], 1000 + id as u16));
        ServerInfo {
            id,
            name: format!("{id:040}"),
            addresses: ServerAddresses {
                resp: a,
                routing: None,
                native: a,
                admin: None,
            },
            epoch: 1,
            state: ServerState::Up,
            memory_bytes: 1 << 30,
            draining: false,
        }
    }

    /// `servers` servers, a table placed on the first `placed` of them, every tablet 10 MiB.
    fn cluster(servers: u64, placed: u64) -> (ClusterMap, Room) {
        let ids: Vec<ServerId> = (1..=placed).collect();
        let map = ClusterMap {
            cluster_id: 7,
            version: 1,
            servers: (1..=servers).map(server).collect(),
            tables: vec![],
            tablets: place_table(0, &ids, 1, 7),
            rebalancing: false,
        };
        let room = Room {
            tablets: map
                .tablets
                .iter()
                .map(|t| TabletBytes {
                    table: t.table,
                    first_slot: t.first_slot,
                    live_bytes: 10 << 20,
                    objects: 1000,
                    ops_per_sec: 0,
                })
                .collect(),
            ..Room::default()
        };
        (map, room)
    }

    fn apply(map: &mut ClusterMap, moves: &[Move]) {
        for m in moves {
            let t = map
                .tablets
                .iter_mut()
                .find(|t| (t.table, t.first_slot) == (m.table, m.first_slot))
                .unwrap();
            t.master = m.target;
            t.backups.retain(|&b| b != m.target);
        }
    }

    fn mastered(map: &ClusterMap, id: ServerId) -> usize {
        map.tablets.iter().filter(|t| t.master == id).count()
    }

    #[test]
    fn servers_that_join_take_a_fair_share_one_move_at_a_time() {
        let (mut map, room) = cluster(6, 3);
        let mut rounds = 0;
        loop {
            let moves = rebalance_moves(&map, &room, 1);
            assert!(moves.len() <= 1);
            if moves.is_empty() {
                break;
            }
            apply(&mut map, &moves);
            rounds += 1;
            assert!(rounds < 1000, "the plan ends");
        }
        let counts: Vec<usize> = (1..=6).map(|id| mastered(&map, id)).collect();
        let mean = map.tablets.len() as f64 / 6.0;
        for c in &counts {
            assert!(
                (*c as f64 - mean).abs() <= mean * TOLERANCE + 1.0,
                "{counts:?} around {mean}"
            );
        }
        // Nothing moves while a tablet recovers, or while as many moves run as allowed.
        let (mut map, room) = cluster(4, 3);
        map.tablets[0].recovering = true;
        assert!(rebalance_moves(&map, &room, 1).is_empty());
        map.tablets[0].recovering = false;
        map.tablets[0].migration = Some(Migration {
            target: 4,
            phase: MigrationPhase::Copying,
            added: true,
        });
        assert!(rebalance_moves(&map, &room, 1).is_empty());
        assert_eq!(rebalance_moves(&map, &room, 2).len(), 1);
    }

    #[test]
    fn a_drain_moves_every_tablet_to_servers_that_do_not_back_it_up() {
        let (mut map, room) = cluster(4, 4);
        map.servers[1].draining = true;
        let mut planned = 0;
        loop {
            let moves = drain_moves(&map, &room, 3);
            assert!(moves.len() <= 3);
            if moves.is_empty() {
                break;
            }
            for m in &moves {
                let t = map
                    .tablets
                    .iter()
                    .find(|t| (t.table, t.first_slot) == (m.table, m.first_slot))
                    .unwrap();
                assert_eq!(t.master, 2);
                assert_ne!(m.target, 2);
                assert!(!t.backups.contains(&m.target), "{t:?} to {}", m.target);
            }
            planned += moves.len();
            apply(&mut map, &moves);
        }
        assert_eq!(mastered(&map, 2), 0);
        assert!(planned > 0);
        // The others share what it had.
        let counts: Vec<usize> = [1, 3, 4].iter().map(|&id| mastered(&map, id)).collect();
        assert!(
            counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 2,
            "{counts:?}"
        );
        // Still a backup: not drained yet; no role left: drained.
        assert!(map.tablets.iter().any(|t| t.backups.contains(&2)));
        assert!(drained(&map).is_empty());
        for t in &mut map.tablets {
            t.backups.retain(|&b| b != 2);
        }
        assert_eq!(drained(&map), vec![(2, 1)]);
    }

    #[test]
    fn no_tablet_moves_to_a_server_its_master_cannot_reach() {
        // Three servers hold the table, a fourth joins empty; server 1 reported it cannot
        // reach server 4 (one of its tablets lists the cut-off).
        let (mut map, room) = cluster(4, 3);
        let t1 = map.tablets.iter().position(|t| t.master == 1).unwrap();
        map.tablets[t1].cut_off.push(crate::map::CutOff {
            master: 1,
            backup: 4,
        });
        assert!(map.is_cut_off(1, 4) && !map.is_cut_off(4, 1) && !map.is_cut_off(2, 4));
        // Rebalancing: server 4 takes tablets, never one of server 1's, and the plan ends.
        for _ in 0..100 {
            let moves = rebalance_moves(&map, &room, 1);
            if moves.is_empty() {
                break;
            }
            for m in &moves {
                let t = map.tablet_at(m.table, m.first_slot).unwrap();
                assert!(!(t.master == 1 && m.target == 4), "{m:?}");
            }
            apply(&mut map, &moves);
        }
        assert!(rebalance_moves(&map, &room, 1).is_empty());
        assert!(mastered(&map, 4) > 0);
        // Load: server 1 is hot and server 4 the coolest; the move goes elsewhere.
        let (mut map, _) = cluster(4, 3);
        map.tablets[t1].cut_off.push(crate::map::CutOff {
            master: 1,
            backup: 4,
        });
        let mut rates = BTreeMap::new();
        for (n, t) in map.tablets.iter().filter(|t| t.master == 1).enumerate() {
            rates.insert((t.table, t.first_slot), [30_000, 20_000, 9_000][n % 3]);
        }
        let m = load_move(&map, &rates, 1000).expect("a move");
        assert!(m.target != 4 && m.target != 1, "{m:?}");
        // A drain of server 1: none of its tablets goes to server 4.
        map.servers[0].draining = true;
        let moves = drain_moves(&map, &room, 100);
        assert!(!moves.is_empty());
        assert!(moves.iter().all(|m| m.target != 4), "{moves:?}");
    }

    /// Equal empty tablets that cannot be spread evenly (47 over 3 servers): no move, rather
    /// than one tablet going back and forth.
    #[test]
    fn an_uneven_count_of_equal_tablets_is_left_alone() {
        let (mut map, mut room) = cluster(3, 3);
        map.tablets.pop();
        for t in &mut room.tablets {
            t.live_bytes = 0;
        }
        let counts: Vec<usize> = (1..=3).map(|id| mastered(&map, id)).collect();
        assert_ne!(counts.iter().min(), counts.iter().max(), "{counts:?}");
        assert!(rebalance_moves(&map, &room, 1).is_empty(), "{counts:?}");
    }
}
