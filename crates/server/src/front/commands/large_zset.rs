//! The large form of sorted sets (docs/architecture.md, "The large form of sorted sets";
//! docs/formats.md, "Large collections"). A sorted set past Redis's listpack limits
//! (`zset-max-listpack-entries`, `zset-max-listpack-value`) becomes a header at the user's key
//! ([`LargeZSet`]) and two structures at internal keys of the same tablet:
//! - a member table, the buckets of a large hash (`large_table`) whose values are the members'
//!   scores, for ZSCORE and for finding a member's place in the order;
//! - a B+-tree of nodes in Redis's order (score, then member): leaves of entries, and inner nodes
//!   whose children carry the count of entries below them and their least entry, so that a rank,
//!   a count between two bounds and the start of a range each read one node per level.
//!
//! A change (ZADD, ZINCRBY, ZREM, a pop) edits the members' buckets and the tree nodes on their
//! paths, and writes the header, those buckets and those nodes in one atomic unit conditional
//! on the header's version, under the key's read-modify-write lock: a ZADD on a set of a million
//! members writes a bucket, a leaf and one inner node per level (a few KiB), as on a set of a
//! thousand. Readers take no lock: they read the header, the nodes and the header again, and
//! start over when its version moved.

use super::large_list::{self, Change, HeaderWrite, LargeError, Place};
use super::large_table::{self, Edit};
use super::typed::Replied;
use super::*;
use ramlog_proto::types::{self, zentry_len, zset_order, LargeZSet, ZChild, ZEntry, ZNode};
use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};

/// Encoded bytes past which a node splits in two.
const NODE_BYTES: usize = 2048;
/// Entries (or children) past which a node splits in two, whatever their size.
const NODE_ITEMS: usize = 128;
/// A node under this many bytes merges with a neighbour when both fit in 3/4 of a node.
const NODE_LOW_BYTES: usize = NODE_BYTES / 4;
/// The chunk id of node 0; bucket ids start at 1, far below.
const NODE_ID_BASE: u64 = 1 << 62;

fn node_id(n: u64) -> u64 {
    NODE_ID_BASE + n
}

/// A large sorted set as read: its header and the header's version.
#[derive(Clone, Copy)]
pub(super) struct Large {
    pub header: LargeZSet,
    pub version: u64,
}

fn damaged(e: types::TypedError) -> LargeError {
    LargeError::Damaged(e.to_string())
}

/// The large sorted set at `stored` (a header read by the caller).
pub(super) fn decode(stored: &Object) -> Result<Large, LargeError> {
    Ok(Large {
        header: LargeZSet::decode(&stored.value).map_err(damaged)?,
        version: stored.version,
    })
}

/// The key's large sorted set: one index lookup, no value copied. None when it holds anything
/// else.
fn large_of(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<Option<Large>, LargeError> {
    let node = ctx.node;
    let found = node.read_with(
        node.tablet_of(key),
        key,
        &mut ctx.session.acks,
        |v, version, _| {
            (types::large_kind(v) == Some(types::Kind::ZSet))
                .then(|| LargeZSet::decode(v).map(|header| Large { header, version }))
        },
    )?;
    match found {
        Some(Some(l)) => l.map(Some).map_err(damaged),
        _ => Ok(None),
    }
}

/// Runs `op` on the key's large sorted set while it holds one, again while it changes under
/// it; None when it holds none (the caller takes the compact path). `serialize` holds the key's
/// read-modify-write lock throughout (writers). Errors are answered.
pub(super) fn on_large<R>(
    ctx: &mut Ctx<'_>,
    key: &[u8],
    serialize: bool,
    mut op: impl FnMut(&mut Ctx<'_>, Place<'_>, Large) -> Result<R, LargeError>,
) -> Result<Option<R>, Replied> {
    let node = ctx.node;
    let _serialized = serialize.then(|| node.rmw_lock(key));
    for _ in 0..64 {
        let large = match large_of(ctx, key) {
            Ok(Some(l)) => l,
            Ok(None) => return Ok(None),
            Err(LargeError::Changed) => continue,
            Err(e) => {
                large_list::reply_error(ctx, e);
                return Err(Replied);
            }
        };
        let place = Place::of(ctx, key);
        match op(ctx, place, large) {
            Ok(r) => return Ok(Some(r)),
            Err(LargeError::Changed) => continue,
            Err(e) => {
                large_list::reply_error(ctx, e);
                return Err(Replied);
            }
        }
    }
    large_list::reply_error(ctx, LargeError::Changed);
    Err(Replied)
}

/// Runs a read of a large sorted set and keeps its result only if the header did not move
/// meanwhile (else `Changed`: [`on_large`] starts over).
pub(super) fn consistent<R>(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    read: impl FnOnce(&mut Ctx<'_>, &mut Tree<'_>) -> Result<R, LargeError>,
) -> Result<R, LargeError> {
    let mut tree = Tree::of(place, &large.header);
    let r = read(ctx, &mut tree)?;
    if large_list::header_version(ctx, place)? == Some(large.version) {
        Ok(r)
    } else {
        Err(LargeError::Changed)
    }
}

/// The tree of a large sorted set as one operation sees it: the nodes it read (and changed).
pub(super) struct Tree<'k> {
    place: Place<'k>,
    gen: u64,
    header: LargeZSet,
    nodes: HashMap<u64, ZNode>,
    dirty: HashSet<u64>,
    gone: Vec<u64>,
}

impl<'k> Tree<'k> {
    fn of(place: Place<'k>, header: &LargeZSet) -> Tree<'k> {
        Tree {
            place,
            gen: header.gen,
            header: *header,
            nodes: HashMap::new(),
            dirty: HashSet::new(),
            gone: Vec::new(),
        }
    }

    pub fn len(&self) -> u64 {
        self.header.len()
    }

    /// Node `n`, read from the store the first time.
    fn node(&mut self, ctx: &mut Ctx<'_>, n: u64) -> Result<&mut ZNode, LargeError> {
        if !self.nodes.contains_key(&n) {
            let node =
                large_list::read_decoded(ctx, self.place, self.gen, node_id(n), ZNode::decode)?;
            self.nodes.insert(n, node);
        }
        Ok(self.nodes.get_mut(&n).expect("read above"))
    }

    /// Node `n`, to be written.
    fn node_mut(&mut self, ctx: &mut Ctx<'_>, n: u64) -> Result<&mut ZNode, LargeError> {
        self.dirty.insert(n);
        self.node(ctx, n)
    }

    fn add(&mut self, node: ZNode) -> u64 {
        let n = self.header.next_node;
        self.header.next_node += 1;
        self.nodes.insert(n, node);
        self.dirty.insert(n);
        n
    }

    fn drop_node(&mut self, n: u64) {
        self.nodes.remove(&n);
        self.dirty.remove(&n);
        self.gone.push(node_id(n));
    }

    /// The path from the root to the leaf where `key` is or would be: each inner node with the
    /// index of the child taken, then the leaf with 0.
    fn path_to(
        &mut self,
        ctx: &mut Ctx<'_>,
        key: &ZEntry,
    ) -> Result<Vec<(u64, usize)>, LargeError> {
        let mut path = Vec::with_capacity(self.header.height as usize + 1);
        let mut n = self.header.root;
        for _ in 0..self.header.height {
            let ZNode::Inner(children) = self.node(ctx, n)? else {
                return Err(shape(n));
            };
            if children.is_empty() {
                return Err(shape(n));
            }
            let i = children
                .partition_point(|c| zset_order(&c.first, key) != Ordering::Greater)
                .saturating_sub(1);
            let child = children[i].node;
            path.push((n, i));
            n = child;
        }
        path.push((n, 0));
        Ok(path)
    }

    /// Adds `entry` (its member must not be in the tree).
    pub fn insert(&mut self, ctx: &mut Ctx<'_>, entry: ZEntry) -> Result<(), LargeError> {
        let path = self.path_to(ctx, &entry)?;
        let leaf = path.last().expect("a path ends at a leaf").0;
        let ZNode::Leaf(entries) = self.node_mut(ctx, leaf)? else {
            return Err(shape(leaf));
        };
        match entries.binary_search_by(|e| zset_order(e, &entry)) {
            Ok(_) => return Err(LargeError::Damaged("an entry is twice in the order".into())),
            Err(at) => entries.insert(at, entry),
        }
        self.settle(ctx, &path)
    }

    /// Removes `entry` (the table says it is there).
    pub fn remove(&mut self, ctx: &mut Ctx<'_>, entry: &ZEntry) -> Result<(), LargeError> {
        let path = self.path_to(ctx, entry)?;
        let leaf = path.last().expect("a path ends at a leaf").0;
        let ZNode::Leaf(entries) = self.node_mut(ctx, leaf)? else {
            return Err(shape(leaf));
        };
        match entries.binary_search_by(|e| zset_order(e, entry)) {
            Ok(at) => {
                entries.remove(at);
            }
            Err(_) => {
                return Err(LargeError::Damaged(
                    "a member of the table is missing from the order".into(),
                ))
            }
        }
        self.settle(ctx, &path)
    }

    /// After a change of the leaf at the end of `path`: splits what grew past a node, drops
    /// what is empty, merges what shrank with a neighbour, and brings each parent's count and
    /// least entry of its child up to date, from the leaf up to the root.
    fn settle(&mut self, ctx: &mut Ctx<'_>, path: &[(u64, usize)]) -> Result<(), LargeError> {
        let (mut n, _) = *path.last().expect("a path ends at a leaf");
        for level in (0..path.len() - 1).rev() {
            let (parent, i) = path[level];
            let split = self.split_if_full(n);
            let node = self.nodes.get(&n).expect("on the path");
            let (count, first, bytes) = (node.count(), node.first().cloned(), node.encoded_len());
            let ZNode::Inner(children) = self.node_mut(ctx, parent)? else {
                return Err(shape(parent));
            };
            match first {
                None => {
                    children.remove(i);
                    self.drop_node(n);
                }
                Some(first) => {
                    children[i].count = count;
                    children[i].first = first;
                    if let Some(child) = split {
                        children.insert(i + 1, child);
                    } else if bytes < NODE_LOW_BYTES {
                        self.merge_near(ctx, parent, i)?;
                    }
                }
            }
            n = parent;
        }
        // The root: a new one above it when it split, one level less when it has one child.
        if let Some(child) = self.split_if_full(n) {
            let root = self.nodes.get(&n).expect("the root");
            let left = ZChild {
                node: n,
                count: root.count(),
                first: root.first().cloned().expect("a split node is not empty"),
            };
            let up = self.add(ZNode::Inner(vec![left, child]));
            self.header.root = up;
            self.header.height += 1;
        }
        loop {
            let root = self.header.root;
            match self.nodes.get(&root) {
                Some(ZNode::Inner(children)) if children.len() == 1 => {
                    let only = children[0].node;
                    self.drop_node(root);
                    self.header.root = only;
                    self.header.height -= 1;
                }
                _ => break,
            }
        }
        Ok(())
    }

    /// Splits node `n` in two when it is past a node's size: the upper half goes to a new node,
    /// returned as its parent's entry for it.
    fn split_if_full(&mut self, n: u64) -> Option<ZChild> {
        let node = self.nodes.get_mut(&n)?;
        let (items, bytes) = (node.items(), node.encoded_len());
        if items < 2 || (bytes <= NODE_BYTES && items <= NODE_ITEMS) {
            return None;
        }
        let upper = match node {
            ZNode::Leaf(entries) => {
                let at = half(entries.iter().map(zentry_len));
                ZNode::Leaf(entries.split_off(at))
            }
            ZNode::Inner(children) => {
                let at = half(children.iter().map(|c| zentry_len(&c.first) + 12));
                ZNode::Inner(children.split_off(at))
            }
        };
        let (count, first) = (upper.count(), upper.first().cloned()?);
        let node = self.add(upper);
        Some(ZChild { node, count, first })
    }

    /// Merges child `i` of `parent` with its right neighbour (or its left one when it is the
    /// last) if both fit in 3/4 of a node.
    fn merge_near(&mut self, ctx: &mut Ctx<'_>, parent: u64, i: usize) -> Result<(), LargeError> {
        let ZNode::Inner(children) = self.node(ctx, parent)? else {
            return Err(shape(parent));
        };
        if children.len() < 2 {
            return Ok(());
        }
        let (l, r) = if i + 1 < children.len() {
            (i, i + 1)
        } else {
            (i - 1, i)
        };
        let (left, right) = (children[l].node, children[r].node);
        let lb = self.node(ctx, left)?.encoded_len();
        let rb = self.node(ctx, right)?.encoded_len();
        let items = self.nodes[&left].items() + self.nodes[&right].items();
        if lb + rb > NODE_BYTES * 3 / 4 || items > NODE_ITEMS * 3 / 4 {
            return Ok(());
        }
        let moved = self.nodes.remove(&right).expect("read above");
        match (self.node_mut(ctx, left)?, moved) {
            (ZNode::Leaf(a), ZNode::Leaf(b)) => a.extend(b),
            (ZNode::Inner(a), ZNode::Inner(b)) => a.extend(b),
            _ => return Err(shape(left)),
        }
        self.drop_node(right);
        let ZNode::Inner(children) = self.node_mut(ctx, parent)? else {
            return Err(shape(parent));
        };
        let gone = children.remove(r);
        children[l].count += gone.count;
        Ok(())
    }

    /// How many entries `before` holds for: `before` is true for a prefix of the order (the
    /// entries below a bound).
    pub fn count_before(
        &mut self,
        ctx: &mut Ctx<'_>,
        before: impl Fn(&ZEntry) -> bool,
    ) -> Result<u64, LargeError> {
        let mut n = self.header.root;
        let mut acc = 0u64;
        for _ in 0..self.header.height {
            let ZNode::Inner(children) = self.node(ctx, n)? else {
                return Err(shape(n));
            };
            let i = children.partition_point(|c| before(&c.first));
            if i == 0 {
                return Ok(acc);
            }
            acc += children[..i - 1].iter().map(|c| c.count).sum::<u64>();
            n = children[i - 1].node;
        }
        let ZNode::Leaf(entries) = self.node(ctx, n)? else {
            return Err(shape(n));
        };
        Ok(acc + entries.partition_point(|e| before(e)) as u64)
    }

    /// Visits the entries from rank `start` on (towards lower ranks when `rev`), while `visit`
    /// answers true.
    pub fn walk(
        &mut self,
        ctx: &mut Ctx<'_>,
        start: u64,
        rev: bool,
        mut visit: impl FnMut(&ZEntry) -> bool,
    ) -> Result<(), LargeError> {
        if start >= self.len() {
            return Ok(());
        }
        // Down to the leaf of rank `start`, keeping the path.
        let mut stack: Vec<(u64, usize)> = Vec::new();
        let mut n = self.header.root;
        let mut r = start;
        for _ in 0..self.header.height {
            let ZNode::Inner(children) = self.node(ctx, n)? else {
                return Err(shape(n));
            };
            let mut at = None;
            for (i, c) in children.iter().enumerate() {
                if r < c.count {
                    at = Some(i);
                    break;
                }
                r -= c.count;
            }
            let Some(i) = at else {
                return Err(counts(n));
            };
            stack.push((n, i));
            n = children[i].node;
        }
        let mut pos = r as usize;
        loop {
            let ZNode::Leaf(entries) = self.node(ctx, n)? else {
                return Err(shape(n));
            };
            if pos >= entries.len() {
                return Err(counts(n));
            }
            let entries = entries.clone();
            if rev {
                for e in entries[..=pos].iter().rev() {
                    if !visit(e) {
                        return Ok(());
                    }
                }
            } else {
                for e in &entries[pos..] {
                    if !visit(e) {
                        return Ok(());
                    }
                }
            }
            // The next leaf: up to the first inner node with a child further on, then down
            // its nearest edge.
            loop {
                let Some((p, i)) = stack.pop() else {
                    return Ok(());
                };
                let ZNode::Inner(children) = self.node(ctx, p)? else {
                    return Err(shape(p));
                };
                let next = if rev {
                    i.checked_sub(1)
                } else {
                    (i + 1 < children.len()).then_some(i + 1)
                };
                if let Some(j) = next {
                    stack.push((p, j));
                    n = children[j].node;
                    break;
                }
            }
            while stack.len() < self.header.height as usize {
                let ZNode::Inner(children) = self.node(ctx, n)? else {
                    return Err(shape(n));
                };
                if children.is_empty() {
                    return Err(shape(n));
                }
                let j = if rev { children.len() - 1 } else { 0 };
                stack.push((n, j));
                n = children[j].node;
            }
            let ZNode::Leaf(entries) = self.node(ctx, n)? else {
                return Err(shape(n));
            };
            if entries.is_empty() {
                return Err(shape(n));
            }
            pos = if rev { entries.len() - 1 } else { 0 };
        }
    }

    /// Entries of ranks `from..=to` (clamped), in order (reversed when `rev`: ranks counted
    /// from the highest).
    pub fn ranks(
        &mut self,
        ctx: &mut Ctx<'_>,
        from: u64,
        to: u64,
        rev: bool,
    ) -> Result<Vec<ZEntry>, LargeError> {
        let len = self.len();
        if from > to || from >= len {
            return Ok(Vec::new());
        }
        let to = to.min(len - 1);
        let want = (to - from + 1) as usize;
        let start = if rev { len - 1 - from } else { from };
        let mut out = Vec::with_capacity(want.min(1 << 16));
        self.walk(ctx, start, rev, |e| {
            out.push(e.clone());
            out.len() < want
        })?;
        Ok(out)
    }

    /// The ids of every node (what a delete of the whole set deletes), read from the inner
    /// nodes.
    fn node_ids(&mut self, ctx: &mut Ctx<'_>) -> Result<Vec<u64>, LargeError> {
        let mut ids = Vec::new();
        let mut level = vec![self.header.root];
        for _ in 0..self.header.height {
            let mut next = Vec::new();
            for n in &level {
                let ZNode::Inner(children) = self.node(ctx, *n)? else {
                    return Err(shape(*n));
                };
                next.extend(children.iter().map(|c| c.node));
            }
            ids.extend(level.iter().map(|n| node_id(*n)));
            level = next;
        }
        ids.extend(level.iter().map(|n| node_id(*n)));
        Ok(ids)
    }
}

fn shape(n: u64) -> LargeError {
    LargeError::Damaged(format!("node {n} is not where the tree's height puts it"))
}

fn counts(n: u64) -> LargeError {
    LargeError::Damaged(format!(
        "node {n} holds fewer entries than its parent counts"
    ))
}

/// Where to split items of these sizes in two halves of about equal bytes (both non-empty).
fn half(sizes: impl Iterator<Item = usize> + Clone) -> usize {
    let total: usize = sizes.clone().sum();
    let items = sizes.clone().count();
    let mut acc = 0;
    for (i, s) in sizes.enumerate() {
        if acc + s > total / 2 && i > 0 {
            return i.min(items - 1);
        }
        acc += s;
    }
    items / 2
}

fn score_bytes(s: f64) -> Vec<u8> {
    s.to_le_bytes().to_vec()
}

fn score_of(v: &[u8]) -> Result<f64, LargeError> {
    let raw: [u8; 8] = v
        .try_into()
        .map_err(|_| LargeError::Damaged(format!("a score of {} bytes", v.len())))?;
    Ok(f64::from_le_bytes(raw))
}

/// The scores of `members` (None for those absent).
pub(super) fn scores(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    members: &[&[u8]],
) -> Result<Vec<Option<f64>>, LargeError> {
    consistent(ctx, place, large, |ctx, _| {
        large_table::get_in(ctx, place, &large.header.table, members)?
            .into_iter()
            .map(|v| v.as_deref().map(score_of).transpose())
            .collect()
    })
}

/// The member's rank (from the lowest) and score; None if absent.
pub(super) fn rank(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    member: &[u8],
) -> Result<Option<(u64, f64)>, LargeError> {
    consistent(ctx, place, large, |ctx, tree| {
        let found = large_table::get_in(ctx, place, &large.header.table, &[member])?;
        let Some(score) = found[0].as_deref().map(score_of).transpose()? else {
            return Ok(None);
        };
        let key = (score, member.to_vec());
        let r = tree.count_before(ctx, |e| zset_order(e, &key) == Ordering::Less)?;
        Ok(Some((r, score)))
    })
}

/// Runs a read of the tree (ranks, counts, walks) consistently.
pub(super) fn read<R>(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    read: impl FnOnce(&mut Ctx<'_>, &mut Tree<'_>) -> Result<R, LargeError>,
) -> Result<R, LargeError> {
    consistent(ctx, place, large, read)
}

/// Every entry in order.
pub(super) fn entries(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
) -> Result<Vec<ZEntry>, LargeError> {
    consistent(ctx, place, large, |ctx, tree| {
        let len = tree.len();
        let mut out = Vec::with_capacity(len.min(1 << 22) as usize);
        tree.walk(ctx, 0, false, |e| {
            out.push(e.clone());
            true
        })?;
        if out.len() as u64 != len {
            return Err(LargeError::Damaged(format!(
                "the header counts {len} members, the order holds {}",
                out.len()
            )));
        }
        Ok(out)
    })
}

/// ZSCAN: members and scores from the member table's scan position `cursor`.
pub(super) fn scan(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    cursor: u64,
    count: usize,
) -> Result<(u64, Vec<ZEntry>), LargeError> {
    consistent(ctx, place, large, |ctx, _| {
        let (next, found) = large_table::scan_in(ctx, place, &large.header.table, cursor, count)?;
        let entries = found
            .into_iter()
            .map(|(m, v)| Ok((score_of(&v)?, m)))
            .collect::<Result<Vec<_>, LargeError>>()?;
        Ok((next, entries))
    })
}

/// ZRANDMEMBER: `count` random entries (see `large_table::random`).
pub(super) fn random(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    count: i64,
) -> Result<Vec<ZEntry>, LargeError> {
    consistent(ctx, place, large, |ctx, _| {
        large_table::random_in(ctx, place, &large.header.table, count)?
            .into_iter()
            .map(|(m, v)| Ok((score_of(&v)?, m)))
            .collect()
    })
}

/// The most bytes a member of a large sorted set may take: a quarter of what one object may
/// hold (a node holds at least two entries, and an inner node the least entry of each child).
pub(super) fn member_limit(ctx: &Ctx<'_>) -> usize {
    (ctx.node.config.value_size_max_bytes / 4) as usize
}

fn member_too_large(ctx: &Ctx<'_>, len: usize) -> String {
    member_too_large_text(len, member_limit(ctx))
}

/// Changes members' scores: `edit(i, current)` for each of `members` in turn says what becomes
/// of it (None: nothing; Some(Some(score)): that score; Some(None): removed), or answers an
/// error and nothing is written. Writes the header, the members' buckets and the tree's changed
/// nodes in one unit conditional on the header's version; a set left empty is deleted whole.
/// Returns the new length.
pub(super) fn change(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
    members: &[&[u8]],
    mut edit: impl FnMut(usize, Option<f64>) -> Result<Option<Option<f64>>, String>,
) -> Result<Result<u64, String>, LargeError> {
    let limit = member_limit(ctx);
    let mut moves: Vec<(usize, Option<f64>, Option<f64>)> = Vec::new();
    let mut bad = None;
    let staged = large_table::stage(ctx, place, large.header.table, members, |i, current| {
        let current = match current.map(score_of).transpose() {
            Ok(c) => c,
            Err(_) => {
                bad = Some(i);
                return Err("ERR the stored value of this key is damaged: a score".into());
            }
        };
        match edit(i, current)? {
            None => Ok(Edit::Keep),
            Some(Some(score)) => {
                if members[i].len() > limit {
                    return Err(member_too_large_text(members[i].len(), limit));
                }
                moves.push((i, current, Some(score)));
                Ok(Edit::Set(score_bytes(score)))
            }
            Some(None) => {
                if current.is_some() {
                    moves.push((i, current, None));
                }
                Ok(Edit::Remove)
            }
        }
    })?;
    let staged = match staged {
        Ok(s) => s,
        Err(message) if bad.is_some() => return Err(LargeError::Damaged(message)),
        Err(message) => return Ok(Err(message)),
    };
    if !staged.changed {
        return Ok(Ok(staged.t.len));
    }
    let mut tree = Tree::of(place, &large.header);
    if staged.t.len == 0 {
        let mut deletes: Vec<u64> = large_table::bucket_ids(&large.header.table).collect();
        deletes.extend(tree.node_ids(ctx)?);
        let mut change = Change {
            header: HeaderWrite::Delete,
            expire: None,
            condition: Condition::IfVersion(large.version),
            gen: large.header.gen,
            puts: Vec::new(),
            deletes,
        };
        large_list::delete_in_units(ctx, place, &mut change)?;
        return Ok(Ok(0));
    }
    for (i, old, new) in moves {
        let member = members[i];
        if let Some(s) = old {
            tree.remove(ctx, &(s, member.to_vec()))?;
        }
        if let Some(s) = new {
            tree.insert(ctx, (s, member.to_vec()))?;
        }
    }
    let mut header = tree.header;
    header.table = staged.t;
    let mut puts = staged.puts;
    let mut dirty: Vec<u64> = tree.dirty.iter().copied().collect();
    dirty.sort_unstable();
    for n in dirty {
        puts.push((node_id(n), tree.nodes[&n].encode()));
    }
    let mut deletes = staged.gone;
    deletes.extend(tree.gone);
    let change = Change {
        header: HeaderWrite::Small(header.encode()),
        expire: None,
        condition: Condition::IfVersion(large.version),
        gen: header.gen,
        puts,
        deletes,
    };
    large_list::commit(ctx, place, &change)?;
    Ok(Ok(header.len()))
}

fn member_too_large_text(len: usize, limit: usize) -> String {
    format!(
        "ERR a sorted-set member of {len} bytes is more than a large sorted set takes ({limit} bytes, a quarter of the value size limit); nothing was changed"
    )
}

/// Whether a sorted set of these entries belongs in the large form on this server: Redis's
/// limits for its listpack encoding (`zset-max-listpack-entries` and `-value`), and never past
/// half the value limit.
pub(super) fn wants_large(ctx: &Ctx<'_>, entries: &[ZEntry]) -> bool {
    let settings = &ctx.node.settings;
    let max_entries = settings.value("zset-max-listpack-entries").max(0) as usize;
    let max_value = settings.value("zset-max-listpack-value").max(0) as usize;
    if entries.len() > max_entries {
        return true;
    }
    let mut size = 0usize;
    for e in entries {
        if e.1.len() > max_value {
            return true;
        }
        size += zentry_len(e);
    }
    size as u64 > ctx.node.config.value_size_max_bytes / 2
}

/// The nodes of a new tree over `entries` (in order), numbered from 0: leaves filled to 3/4 of
/// a node, then inner levels up to one root. Returns (root, height, next node, nodes).
fn build_tree(entries: &[ZEntry]) -> (u64, u32, u64, Vec<(u64, ZNode)>) {
    let fill_bytes = NODE_BYTES * 3 / 4;
    let fill_items = NODE_ITEMS * 3 / 4;
    let mut out: Vec<(u64, ZNode)> = Vec::new();
    let mut next = 0u64;
    let mut level: Vec<ZChild> = Vec::new();
    let mut leaf: Vec<ZEntry> = Vec::new();
    let mut bytes = 0;
    let mut flush_leaf =
        |leaf: &mut Vec<ZEntry>, out: &mut Vec<(u64, ZNode)>, level: &mut Vec<ZChild>| {
            let node = ZNode::Leaf(std::mem::take(leaf));
            level.push(ZChild {
                node: next,
                count: node.count(),
                first: node.first().cloned().expect("not empty"),
            });
            out.push((next, node));
            next += 1;
        };
    for e in entries {
        if !leaf.is_empty() && (bytes + zentry_len(e) > fill_bytes || leaf.len() >= fill_items) {
            flush_leaf(&mut leaf, &mut out, &mut level);
            bytes = 0;
        }
        bytes += zentry_len(e);
        leaf.push(e.clone());
    }
    if !leaf.is_empty() || level.is_empty() {
        flush_leaf(&mut leaf, &mut out, &mut level);
    }
    let mut next = out.len() as u64;
    let mut height = 0u32;
    while level.len() > 1 {
        let mut up: Vec<ZChild> = Vec::new();
        let mut group: Vec<ZChild> = Vec::new();
        let mut bytes = 0;
        let mut flush =
            |group: &mut Vec<ZChild>, out: &mut Vec<(u64, ZNode)>, up: &mut Vec<ZChild>| {
                let node = ZNode::Inner(std::mem::take(group));
                up.push(ZChild {
                    node: next,
                    count: node.count(),
                    first: node.first().cloned().expect("not empty"),
                });
                out.push((next, node));
                next += 1;
            };
        for c in level {
            let size = zentry_len(&c.first) + 12;
            if !group.is_empty() && (bytes + size > fill_bytes || group.len() >= fill_items) {
                flush(&mut group, &mut out, &mut up);
                bytes = 0;
            }
            bytes += size;
            group.push(c);
        }
        if !group.is_empty() {
            flush(&mut group, &mut out, &mut up);
        }
        level = up;
        height += 1;
    }
    let root = level[0].node;
    (root, height, next, out)
}

/// Writes `entries` (distinct members, in order) at the key as a large sorted set under a new
/// generation, replacing what the key holds at `condition` (`old`: a large sorted set there,
/// whose chunks are deleted after). A set larger than one unit is written as chunks first and
/// switched to by a last unit with the header.
pub(super) fn write(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    entries: &[ZEntry],
    condition: Condition,
    expire: Option<u64>,
    old: Option<Large>,
) -> Result<(), LargeError> {
    let limit = member_limit(ctx);
    if let Some(e) = entries.iter().find(|e| e.1.len() > limit) {
        return Err(LargeError::Refused(member_too_large(ctx, e.1.len())));
    }
    let old = match old {
        Some(l) => {
            let mut ids: Vec<u64> = large_table::bucket_ids(&l.header.table).collect();
            ids.extend(Tree::of(place, &l.header).node_ids(ctx)?);
            Some((l.header.gen, ids))
        }
        None => None,
    };
    let gen = large_list::random_gen();
    let scores: Vec<Vec<u8>> = entries.iter().map(|e| score_bytes(e.0)).collect();
    let members: Vec<(&[u8], &[u8])> = entries
        .iter()
        .zip(&scores)
        .map(|(e, s)| (e.1.as_slice(), s.as_slice()))
        .collect();
    let (table, mut puts) = large_table::build(ctx, types::Kind::Hash, gen, &members)?;
    let (root, height, next_node, nodes) = build_tree(entries);
    puts.extend(
        nodes
            .into_iter()
            .map(|(n, node)| (node_id(n), node.encode())),
    );
    let header = LargeZSet {
        gen,
        table,
        root,
        height,
        next_node,
    };
    large_table::commit_built(
        ctx,
        place,
        header.encode(),
        gen,
        puts,
        condition,
        expire,
        old,
    )
}

/// Deletes a large sorted set: its header (if still at its version), buckets and nodes.
pub(super) fn delete(ctx: &mut Ctx<'_>, place: Place<'_>, large: Large) -> Result<(), LargeError> {
    let mut deletes: Vec<u64> = large_table::bucket_ids(&large.header.table).collect();
    deletes.extend(Tree::of(place, &large.header).node_ids(ctx)?);
    let mut change = Change {
        header: HeaderWrite::Delete,
        expire: None,
        condition: Condition::IfVersion(large.version),
        gen: large.header.gen,
        puts: Vec::new(),
        deletes,
    };
    large_list::delete_in_units(ctx, place, &mut change)
}

/// The bytes a large sorted set's buckets and nodes take in the log.
pub(super) fn memory_usage(
    ctx: &mut Ctx<'_>,
    place: Place<'_>,
    large: Large,
) -> Result<u64, LargeError> {
    consistent(ctx, place, large, |ctx, tree| {
        let mut ids: Vec<u64> = large_table::bucket_ids(&large.header.table).collect();
        ids.extend(tree.node_ids(ctx)?);
        large_list::chunks_in_log(ctx, place, large.header.gen, ids)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(n: usize) -> Vec<ZEntry> {
        (0..n)
            .map(|i| ((i / 3) as f64, format!("member:{i:08}").into_bytes()))
            .collect()
    }

    #[test]
    fn a_built_tree_counts_every_entry_and_keeps_the_order() {
        for n in [1, 2, 50, 51, 2_000, 100_000] {
            let e = entries(n);
            let (root, height, next, nodes) = build_tree(&e);
            assert_eq!(next as usize, nodes.len());
            let by: HashMap<u64, ZNode> = nodes.into_iter().collect();
            assert_eq!(by[&root].count(), n as u64);
            // Walk the leaves left to right.
            let mut level = vec![root];
            for _ in 0..height {
                level = level
                    .iter()
                    .flat_map(|x| match &by[x] {
                        ZNode::Inner(c) => c.iter().map(|c| c.node).collect::<Vec<_>>(),
                        ZNode::Leaf(_) => panic!("a leaf above the leaves"),
                    })
                    .collect();
            }
            let flat: Vec<ZEntry> = level
                .iter()
                .flat_map(|x| match &by[x] {
                    ZNode::Leaf(l) => l.clone(),
                    ZNode::Inner(_) => panic!("an inner node at the leaves"),
                })
                .collect();
            assert_eq!(flat, e);
            for node in by.values() {
                assert!(node.encoded_len() <= NODE_BYTES);
                assert_eq!(ZNode::decode(&node.encode()).as_ref(), Ok(node));
            }
        }
    }

    #[test]
    fn half_splits_into_two_non_empty_parts() {
        assert_eq!(half([10, 10].into_iter()), 1);
        assert_eq!(half([1000, 1, 1].into_iter()), 1);
        assert_eq!(half([1, 1, 1000].into_iter()), 2);
        let at = half([5; 100].into_iter());
        assert!((49..=51).contains(&at));
    }
}
