//! Placement of a new table's tablets: slot ranges, masters, and each tablet's ordered backups.
//!
//! - **Tablets**: [`TABLETS_PER_SERVER`] per live server, so that the tablets of a failed master
//!   spread over every survivor when they are recovered (digest 003 §5).
//! - **Masters**: contiguous blocks of tablets per server, in server order, so that CLUSTER SLOTS
//!   lists one range per server and each server masters an equal share of the slots.
//! - **Backups** (digest 000 §7.2, DXRAM's copysets; digest 003 §2.4): the servers are permuted
//!   with a PRNG seeded from the cluster id and cut into copysets of R (a remainder joins the last
//!   set). A tablet's first backup is chosen *disjunctively*: each master hands out its other
//!   servers as first backups in turn, starting over once all have had one, so that the tablets of
//!   a failed master are restored by all survivors in parallel. The remaining R − 1 backups come
//!   from the first backup's copyset (never the master), then, if that set is too small, from the
//!   servers that follow it in the permutation. The result depends only on its inputs, so every
//!   coordinator member computes the same placement.

use crate::map::{ServerId, TabletInfo};
use ramlog_common::{TableId, SLOT_COUNT};

/// Tablets per live server when a table is created.
pub const TABLETS_PER_SERVER: u32 = 16;

/// Splits the 16384 slots into `count` contiguous ranges whose sizes differ by at most one.
pub fn slot_ranges(count: u32) -> Vec<(u16, u16)> {
    let count = count.clamp(1, u32::from(SLOT_COUNT));
    let total = u32::from(SLOT_COUNT);
    (0..count)
        .map(|i| {
            let first = i * total / count;
            let last = (i + 1) * total / count - 1;
            (first as u16, last as u16)
        })
        .collect()
}

/// splitmix64: a small, well-mixed PRNG whose sequence is fixed by its seed (also the source of
/// the deterministic simulation's schedules).
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// A seeded permutation of `servers`.
pub fn permutation(servers: &[ServerId], seed: u64) -> Vec<ServerId> {
    let mut order = servers.to_vec();
    order.sort_unstable();
    let mut rng = SplitMix(seed);
    for i in (1..order.len()).rev() {
        let j = rng.below(i + 1);
        order.swap(i, j);
    }
    order
}

/// Copysets of `size` servers cut from the seeded permutation; a remainder smaller than `size`
/// joins the last set, so every server is in exactly one set.
pub fn copysets(servers: &[ServerId], size: usize, seed: u64) -> Vec<Vec<ServerId>> {
    let order = permutation(servers, seed);
    let size = size.max(1);
    let mut sets: Vec<Vec<ServerId>> = order.chunks(size).map(|c| c.to_vec()).collect();
    if sets.len() > 1 && sets.last().is_some_and(|s| s.len() < size) {
        let rest = sets.pop().unwrap_or_default();
        if let Some(last) = sets.last_mut() {
            last.extend(rest);
        }
    }
    sets
}

/// The tablets of a new table over `servers` (the live ones), each with `replicas` ordered backups.
/// `replicas` must be below the number of servers (a backup is never the tablet's master).
pub fn place_table(
    table: TableId,
    servers: &[ServerId],
    replicas: usize,
    seed: u64,
) -> Vec<TabletInfo> {
    let mut servers = servers.to_vec();
    servers.sort_unstable();
    servers.dedup();
    let n = servers.len();
    if n == 0 {
        return Vec::new();
    }
    let replicas = replicas.min(n - 1);
    let count = (n as u32 * TABLETS_PER_SERVER).min(u32::from(SLOT_COUNT));
    let ranges = slot_ranges(count);
    let order = permutation(&servers, seed);
    let sets = copysets(&servers, replicas.max(1), seed);
    // Per master: the servers it has not yet used as a first backup in the current round.
    let mut first_rounds: Vec<Vec<ServerId>> = vec![Vec::new(); n];
    ranges
        .iter()
        .enumerate()
        .map(|(i, &(first_slot, last_slot))| {
            let master_index = i * n / ranges.len();
            let master = servers[master_index];
            let mut backups = Vec::with_capacity(replicas);
            if replicas > 0 {
                let round = &mut first_rounds[master_index];
                if round.is_empty() {
                    // This master's turn order starts after it in the permutation, so that
                    // different masters do not all pick the same server first.
                    let at = order.iter().position(|&s| s == master).unwrap_or(0);
                    round.extend(
                        (1..n)
                            .map(|k| order[(at + k) % n])
                            .filter(|&s| s != master)
                            .rev(),
                    );
                }
                let first = round.pop().expect("a round holds every other server");
                backups.push(first);
                let set = sets
                    .iter()
                    .find(|s| s.contains(&first))
                    .expect("every server is in a copyset");
                let at = order.iter().position(|&s| s == first).unwrap_or(0);
                let candidates = set
                    .iter()
                    .copied()
                    .chain((1..n).map(|k| order[(at + k) % n]));
                for s in candidates {
                    if backups.len() == replicas {
                        break;
                    }
                    if s != master && !backups.contains(&s) {
                        backups.push(s);
                    }
                }
            }
            TabletInfo {
                table,
                first_slot,
                last_slot,
                master,
                mirror: None,
                backups,
                epoch: 1,
                recovering: false,
                restorer: None,
                pending: vec![],
                fresh: vec![],
                waiting: None,
                refused: vec![],
                logs_from: None,
                split: None,
                split_ready: false,
                merge: None,
                merge_ready: false,
                migration: None,
                cut_off: Vec::new(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    #[test]
    fn ranges_cover_every_slot_once() {
        for count in [1, 3, 16, 48, 1000, 16384, 20000] {
            let r = slot_ranges(count);
            assert_eq!(r[0].0, 0);
            assert_eq!(r.last().unwrap().1, SLOT_COUNT - 1);
            for w in r.windows(2) {
                assert_eq!(w[0].1 + 1, w[1].0);
            }
            let sizes: BTreeSet<u16> = r.iter().map(|(a, b)| b - a + 1).collect();
            assert!(sizes.len() <= 2, "{count}: {sizes:?}");
        }
    }

    #[test]
    fn copysets_partition_the_servers() {
        let servers: Vec<u64> = (1..=10).collect();
        let sets = copysets(&servers, 3, 42);
        assert_eq!(sets.len(), 3);
        let mut all: Vec<u64> = sets.concat();
        all.sort();
        assert_eq!(all, servers);
        assert_eq!(copysets(&servers, 3, 42), sets, "deterministic");
    }

    #[test]
    fn three_servers_two_replicas() {
        let tablets = place_table(0, &[1, 2, 3], 2, 7);
        assert_eq!(tablets.len(), 48);
        let mut per_master: BTreeMap<u64, usize> = BTreeMap::new();
        for t in &tablets {
            *per_master.entry(t.master).or_default() += 1;
            assert_eq!(t.backups.len(), 2);
            assert!(!t.backups.contains(&t.master));
            assert_ne!(t.backups[0], t.backups[1]);
        }
        assert_eq!(
            per_master.values().copied().collect::<Vec<_>>(),
            [16, 16, 16]
        );
        // Masters hold contiguous blocks: three runs.
        let runs = tablets
            .windows(2)
            .filter(|w| w[0].master != w[1].master)
            .count();
        assert_eq!(runs, 2);
    }

    #[test]
    fn first_backups_are_disjunctive_per_master() {
        let servers: Vec<u64> = (1..=8).collect();
        let tablets = place_table(3, &servers, 3, 99);
        for m in &servers {
            let firsts: Vec<u64> = tablets
                .iter()
                .filter(|t| t.master == *m)
                .map(|t| t.backups[0])
                .collect();
            assert_eq!(firsts.len(), 16);
            // The first 7 tablets of each master use 7 different first backups.
            let distinct: BTreeSet<u64> = firsts[..7].iter().copied().collect();
            assert_eq!(distinct.len(), 7, "master {m}: {firsts:?}");
        }
    }

    #[test]
    fn backups_come_from_copysets() {
        let servers: Vec<u64> = (1..=9).collect();
        let sets = copysets(&servers, 3, 5);
        let tablets = place_table(1, &servers, 3, 5);
        // Distinct backup sets stay few: far below the C(8,3) = 56 a random choice could reach
        // per master.
        let distinct: BTreeSet<Vec<u64>> = tablets
            .iter()
            .map(|t| {
                let mut b = t.backups.clone();
                b.sort();
                b
            })
            .collect();
        for t in &tablets {
            let set = sets.iter().find(|s| s.contains(&t.backups[0])).unwrap();
            let from_set = t.backups.iter().filter(|b| set.contains(b)).count();
            let room = set.iter().filter(|&&s| s != t.master).count();
            assert_eq!(from_set, room.min(3), "{t:?} {set:?}");
        }
        assert!(distinct.len() <= 30, "{}", distinct.len());
    }

    #[test]
    fn one_server_has_no_backups() {
        let tablets = place_table(0, &[4], 2, 1);
        assert_eq!(tablets.len(), 16);
        assert!(tablets
            .iter()
            .all(|t| t.master == 4 && t.backups.is_empty()));
    }
}
