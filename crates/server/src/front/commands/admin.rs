//! Server and administration commands: SHUTDOWN, TIME, LASTSAVE, INFO, CONFIG, COMMAND, CLUSTER.

use super::*;

/// SHUTDOWN [NOSAVE|SAVE] [NOW] [FORCE]: stops the server as Ctrl-C does (persistence is flushed
/// either way). As in Redis, a successful SHUTDOWN closes the connection without a reply.
pub(super) fn cmd_shutdown(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    for a in &args[1..] {
        let known = ["nosave", "save", "now", "force"]
            .iter()
            .any(|o| eq_ignore_case(a, o));
        if !known {
            return ctx.enc.error(ERR_SYNTAX);
        }
    }
    // A script that runs stops at its next check, even one that has written (as Redis's
    // SHUTDOWN NOSAVE ends a busy script's server).
    ctx.node.scripts.running.stop();
    ctx.node.request_shutdown();
    ctx.session.closing = true;
}

pub(super) fn cmd_time(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    ctx.enc.array(2);
    ctx.enc.bulk(now.as_secs().to_string().as_bytes());
    ctx.enc.bulk(now.subsec_micros().to_string().as_bytes());
}

/// SAVE: every write this server has taken is made durable on its disk (the persistence log
/// fdatasync'd) before the reply, as Redis's SAVE returns once its snapshot is on disk. A
/// cluster server's writes are on its tables' backups, as each table's mode promises.
pub(super) fn cmd_save(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    if ctx.session.member().is_some() {
        return ctx.enc.error(
            "ERR SAVE is for a standalone server: a cluster server's writes are on its tables' backups as each table's mode (async, sync, durable) promises",
        );
    }
    let node = ctx.node;
    match super::off_the_runtime(|| node.save_blocking()) {
        Ok(()) => ctx.enc.ok(),
        Err(reason) => ctx.enc.error(&format!("ERR SAVE failed: {reason}")),
    }
}

pub(super) fn cmd_lastsave(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    let saved = ctx
        .node
        .last_save_secs
        .load(std::sync::atomic::Ordering::Relaxed);
    if saved > 0 {
        return ctx.enc.integer(saved as i64);
    }
    let started = std::time::SystemTime::now() - ctx.node.started.elapsed();
    let secs = started
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    ctx.enc.integer(secs as i64)
}

pub(super) fn cmd_info(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let section = args.get(1).map(|s| String::from_utf8_lossy(s).into_owned());
    let mut snapshot = ctx.node.snapshot();
    snapshot.commands = ctx
        .node
        .metrics
        .command_stats
        .read(super::stat_names().iter().copied());
    let text = snapshot.info(section.as_deref(), ctx.cluster_node());
    ctx.enc.verbatim("txt", text.as_bytes());
}

/// The parameters CONFIG GET knows, with their current values (`cluster_node`: asked on a
/// cluster server's RESP port, a Redis Cluster node).
pub(super) fn config_params(shared: &Node, cluster_node: bool) -> Vec<(&'static str, String)> {
    use crate::node::config::PersistenceMode;
    let c = &shared.config;
    vec![
        ("bind", c.bind.to_string()),
        ("port", shared.resp_port().to_string()),
        ("databases", "1".into()),
        ("maxmemory", c.memory_bytes.to_string()),
        ("maxmemory-policy", "noeviction".into()),
        ("maxclients", c.connections_max.to_string()),
        ("timeout", c.idle_timeout_secs.to_string()),
        (
            "proto-max-bulk-len",
            c.request_arg_size_max_bytes.to_string(),
        ),
        ("save", String::new()),
        (
            "appendonly",
            // A cluster server keeps no log of its own (its backups hold its writes).
            if c.persistence == PersistenceMode::Off || c.coordinator.is_some() {
                "no"
            } else {
                "yes"
            }
            .into(),
        ),
        (
            "appendfsync",
            match c.persistence {
                PersistenceMode::Off => "no",
                PersistenceMode::Async => "everysec",
                PersistenceMode::Durable => "always",
            }
            .into(),
        ),
        (
            "cluster-enabled",
            if cluster_node { "yes" } else { "no" }.into(),
        ),
        ("dir", c.data_dir.display().to_string()),
    ]
    .into_iter()
    .chain(shared.settings.all())
    .collect()
}

pub(super) fn cmd_config(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1];
    if eq_ignore_case(sub, "get") {
        if args.len() < 3 {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'config|get' command");
        }
        let params = config_params(ctx.node, ctx.cluster_node());
        let matched: Vec<&(&str, String)> = params
            .iter()
            .filter(|(name, _)| {
                args[2..]
                    .iter()
                    .any(|p| glob_match_nocase(p, name.as_bytes()))
            })
            .collect();
        ctx.enc.map(matched.len());
        for (name, value) in matched {
            ctx.enc.bulk(name.as_bytes());
            ctx.enc.bulk(value.as_bytes());
        }
    } else if eq_ignore_case(sub, "set") {
        if args.len() < 4 || !args.len().is_multiple_of(2) {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'config|set' command");
        }
        let pairs: Vec<(String, String)> = args[2..]
            .chunks(2)
            .map(|p| {
                (
                    String::from_utf8_lossy(p[0]).into_owned(),
                    String::from_utf8_lossy(p[1]).into_owned(),
                )
            })
            .collect();
        let fixed = config_params(ctx.node, ctx.cluster_node());
        for (name, value) in &pairs {
            if crate::node::settings::RuntimeSettings::is_settable(name) {
                continue;
            }
            // `save ""`: ramlog takes no snapshots on a schedule, so there is none to turn off.
            if name.eq_ignore_ascii_case("save") && value.is_empty() {
                continue;
            }
            return ctx.enc.error(&if fixed.iter().any(|(n, _)| n.eq_ignore_ascii_case(name)) {
                format!(
                    "ERR CONFIG SET failed (possibly related to argument '{name}') - ramlog sets '{name}' at start (file, flags, environment), not at run time"
                )
            } else {
                format!("ERR Unknown option or number of arguments for CONFIG SET - '{name}'")
            });
        }
        let pairs: Vec<(String, String)> = pairs
            .into_iter()
            .filter(|(n, _)| !n.eq_ignore_ascii_case("save"))
            .collect();
        let pairs: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        match ctx.node.settings.set_all(&pairs) {
            Ok(()) => ctx.enc.ok(),
            Err(e) => ctx.enc.error(&format!(
                "ERR CONFIG SET failed (possibly related to argument '{}') - {e}",
                pairs[0].0
            )),
        }
    } else if eq_ignore_case(sub, "resetstat") {
        // INFO commandstats, errorstats and total_error_replies start again, the RESP port's
        // and the routing port's (the other counters run on, for `/metrics`).
        let m = &ctx.node.metrics;
        m.command_stats.reset();
        m.routed_command_stats.reset();
        m.error_stats.reset();
        m.routed_error_stats.reset();
        m.errors_at_reset.store(
            m.errors.load(std::sync::atomic::Ordering::Relaxed),
            std::sync::atomic::Ordering::Relaxed,
        );
        ctx.enc.ok();
    } else if eq_ignore_case(sub, "help") {
        let lines = [
            "CONFIG <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "GET <pattern>",
            "    Return parameters matching the glob-like <pattern> and their values.",
        ];
        ctx.enc.array(lines.len());
        for l in lines {
            ctx.enc.simple(l);
        }
    } else {
        unknown_subcommand(ctx, "config", sub);
    }
}

/// FUNCTION: ramlog runs no server-side functions, so there is never a library to list or flush;
/// FLUSH and LIST answer as Redis does for an empty library set, LOAD and the rest are refused.
pub(super) fn cmd_function(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1];
    if eq_ignore_case(sub, "flush") {
        if args.len() > 3
            || (args.len() == 3
                && !eq_ignore_case(args[2], "async")
                && !eq_ignore_case(args[2], "sync"))
        {
            return ctx.enc.error(ERR_SYNTAX);
        }
        ctx.enc.ok();
    } else if eq_ignore_case(sub, "list") {
        ctx.enc.array(0);
    } else if eq_ignore_case(sub, "help") {
        let lines = [
            "FUNCTION <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "LIST",
            "    Return the function libraries (ramlog runs none).",
            "FLUSH [ASYNC|SYNC]",
            "    Delete all function libraries (there are none).",
        ];
        ctx.enc.array(lines.len());
        for l in lines {
            ctx.enc.simple(l);
        }
    } else if ["load", "delete", "restore", "dump", "stats", "kill"]
        .iter()
        .any(|s| eq_ignore_case(sub, s))
    {
        let sub = String::from_utf8_lossy(sub).to_ascii_uppercase();
        ctx.enc.error(&format!(
            "ERR FUNCTION {sub} is not supported: ramlog runs no server-side functions"
        ));
    } else {
        unknown_subcommand(ctx, "function", sub);
    }
}

pub(super) fn command_info(enc: &mut ReplyEncoder<'_>, spec: &Spec) {
    enc.array(10);
    enc.bulk(spec.name.as_bytes());
    enc.integer(i64::from(spec.arity));
    enc.set(spec.flags.len());
    for f in spec.flags {
        enc.simple(f);
    }
    enc.integer(i64::from(spec.first_key));
    enc.integer(i64::from(spec.last_key));
    enc.integer(i64::from(spec.step));
    enc.set(spec.categories.len());
    for c in spec.categories {
        enc.simple(c);
    }
    enc.set(0); // tips
    enc.array(0); // key specs
    enc.array(0); // subcommands
}

pub(super) fn cmd_command(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let specs = specs();
    if args.len() == 1 {
        ctx.enc.array(specs.len());
        for spec in specs {
            command_info(&mut ctx.enc, spec);
        }
        return;
    }
    let sub = args[1];
    if eq_ignore_case(sub, "count") {
        ctx.enc.integer(specs.len() as i64);
    } else if eq_ignore_case(sub, "info") {
        let names: Vec<&[u8]> = if args.len() == 2 {
            specs.iter().map(|s| s.name.as_bytes()).collect()
        } else {
            args[2..].to_vec()
        };
        ctx.enc.array(names.len());
        for name in names {
            match lookup(name) {
                Some(spec) => command_info(&mut ctx.enc, spec),
                None => ctx.enc.null_array(),
            }
        }
    } else if eq_ignore_case(sub, "docs") {
        // No documentation is served; clients treat an empty map as "no hints".
        ctx.enc.map(0);
    } else if eq_ignore_case(sub, "list") {
        ctx.enc.array(specs.len());
        for spec in specs {
            ctx.enc.bulk(spec.name.as_bytes());
        }
    } else if eq_ignore_case(sub, "getkeys") {
        if args.len() < 3 {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'command|getkeys' command");
        }
        let Some(spec) = lookup(args[2]) else {
            return ctx.enc.error("ERR Invalid command specified");
        };
        let cmd = &args[2..];
        if !spec.has_keys() || !arity_ok(spec.arity, cmd.len()) {
            return ctx.enc.error("ERR The command has no key arguments");
        }
        let keys: Vec<&[u8]> = command_keys(spec, cmd).collect();
        ctx.enc.array(keys.len());
        for k in keys {
            ctx.enc.bulk(k);
        }
    } else {
        unknown_subcommand(ctx, "command", sub);
    }
}

/// A range's replica (its mirror): host, port, node id.
type Replica = (String, u16, String);

/// One server as CLUSTER SLOTS/SHARDS/NODES describe it.
struct NodeDesc {
    id: String,
    host: String,
    port: u16,
    /// Slot ranges of the default table it masters, each with its mirror's (host, port, id)
    /// if the range has one.
    ranges: Vec<(u16, u16)>,
    replicas: Vec<Option<Replica>>,
    myself: bool,
    epoch: u64,
    failed: bool,
    /// On the line of the server answering only, as Redis shows its open slots: slot ranges it
    /// moves to another server (`[slot->-id]`) and ranges it takes from another (`[slot-<-id]`).
    migrating: Vec<(u16, u16, String)>,
    importing: Vec<(u16, u16, String)>,
}

/// The servers a CLUSTER command describes: the map's servers on a cluster server's own RESP
/// port; one server holding every slot on a standalone server and on the routing port.
fn cluster_nodes(ctx: &Ctx<'_>) -> (Vec<NodeDesc>, u64) {
    let node = ctx.node;
    if let (Some(member), false) = (ctx.session.member(), ctx.session.routed) {
        let view = member.view();
        // Runs of one master split where the mirror changes.
        let mut runs: Vec<(u16, u16, ramlog_cluster::ServerId, ramlog_cluster::ServerId)> =
            Vec::new();
        for &(first, last, owner) in view.slot_runs() {
            for slot in first..=last {
                let mirror = view.mirror_of(slot);
                match runs.last_mut() {
                    Some(r) if r.2 == owner && r.3 == mirror && r.1 + 1 == slot => r.1 = slot,
                    _ => runs.push((slot, slot, owner, mirror)),
                }
            }
        }
        let replica = |id: ramlog_cluster::ServerId| {
            view.map
                .server(id)
                .filter(|s| s.state == ramlog_cluster::ServerState::Up)
                .map(|s| {
                    (
                        s.addresses.resp.ip().to_string(),
                        s.addresses.resp.port(),
                        s.name.clone(),
                    )
                })
        };
        let name = |id: ramlog_cluster::ServerId| {
            view.map
                .server(id)
                .map_or_else(|| id.to_string(), |s| s.name.clone())
        };
        let (mut migrating, mut importing) = (Vec::new(), Vec::new());
        for t in view.map.tablets_of(ramlog_cluster::DEFAULT_TABLE) {
            let Some(m) = t.migration.as_ref().filter(|_| !t.recovering) else {
                continue;
            };
            if t.master == view.me {
                migrating.push((t.first_slot, t.last_slot, name(m.target)));
            } else if m.target == view.me {
                importing.push((t.first_slot, t.last_slot, name(t.master)));
            }
        }
        let nodes = view
            .map
            .servers
            .iter()
            .map(|s| {
                let myself = s.id == view.me;
                let mine: Vec<_> = runs.iter().filter(|r| r.2 == s.id).collect();
                NodeDesc {
                    id: s.name.clone(),
                    host: s.addresses.resp.ip().to_string(),
                    port: s.addresses.resp.port(),
                    ranges: mine.iter().map(|r| (r.0, r.1)).collect(),
                    replicas: mine.iter().map(|r| replica(r.3)).collect(),
                    myself,
                    epoch: s.epoch,
                    failed: s.state == ramlog_cluster::ServerState::Dead,
                    migrating: if myself {
                        migrating.clone()
                    } else {
                        Vec::new()
                    },
                    importing: if myself {
                        importing.clone()
                    } else {
                        Vec::new()
                    },
                }
            })
            .collect();
        return (nodes, view.map.version);
    }
    let (id, port) = match (ctx.session.member(), node.addresses().routing) {
        (Some(member), Some(routing)) => (
            member
                .view()
                .map
                .server(member.view().me)
                .map_or_else(|| node.node_id().to_string(), |s| s.name.clone()),
            routing.port(),
        ),
        _ => (node.node_id().to_string(), node.resp_port()),
    };
    let nodes = vec![NodeDesc {
        id,
        host: node.config.bind.to_string(),
        port,
        ranges: vec![(0, SLOT_COUNT - 1)],
        replicas: vec![None],
        myself: true,
        epoch: 1,
        failed: false,
        migrating: Vec::new(),
        importing: Vec::new(),
    }];
    (nodes, 1)
}

/// The keys of `slot` held here (at most `limit`).
fn keys_in_slot(ctx: &mut Ctx<'_>, slot: u16, limit: usize) -> Result<Vec<Vec<u8>>, NodeError> {
    let node = ctx.node;
    let mut found = Vec::new();
    let Some(tablet) = node.engine().tablets().into_iter().find(|t| {
        t.table == crate::node::keyspace::RESP_TABLE
            && t.first_slot <= slot
            && slot <= t.last_slot
            && !node.keyspace.is_hidden(t.id)
    }) else {
        return Ok(found);
    };
    let mut cursor = 0;
    let mut batch = Vec::new();
    loop {
        batch.clear();
        cursor = node
            .engine()
            .scan_keys(tablet.id, cursor, 1024, &mut batch)?;
        for key in batch.drain(..) {
            if found.len() < limit && key_slot(&key) == slot {
                found.push(key);
            }
        }
        if cursor == 0 || found.len() >= limit {
            return Ok(found);
        }
    }
}

fn slot_arg(ctx: &mut Ctx<'_>, arg: &[u8]) -> Option<u16> {
    match parse_i64(arg) {
        Some(n) if (0..i64::from(SLOT_COUNT)).contains(&n) => Some(n as u16),
        _ => {
            ctx.enc.error("ERR Invalid slot");
            None
        }
    }
}

pub(super) fn cmd_cluster(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1];
    let arity = |ctx: &mut Ctx<'_>, n: usize, name: &str| {
        if args.len() != n {
            ctx.enc.error(&format!(
                "ERR wrong number of arguments for 'cluster|{name}' command"
            ));
            return false;
        }
        true
    };
    if eq_ignore_case(sub, "keyslot") {
        if arity(ctx, 3, "keyslot") {
            ctx.enc.integer(i64::from(key_slot(args[2])));
        }
        return;
    }
    if eq_ignore_case(sub, "countkeysinslot") {
        if !arity(ctx, 3, "countkeysinslot") {
            return;
        }
        let Some(slot) = slot_arg(ctx, args[2]) else {
            return;
        };
        match keys_in_slot(ctx, slot, usize::MAX) {
            Ok(keys) => ctx.enc.integer(keys.len() as i64),
            Err(e) => engine_error(ctx, &e),
        }
        return;
    }
    if eq_ignore_case(sub, "getkeysinslot") {
        if !arity(ctx, 4, "getkeysinslot") {
            return;
        }
        let Some(slot) = slot_arg(ctx, args[2]) else {
            return;
        };
        let count = match parse_i64(args[3]) {
            Some(n) if n >= 0 => n as usize,
            _ => return ctx.enc.error("ERR Invalid number of keys"),
        };
        match keys_in_slot(ctx, slot, count) {
            Ok(keys) => {
                ctx.enc.array(keys.len());
                for k in keys {
                    ctx.enc.bulk(&k);
                }
            }
            Err(e) => engine_error(ctx, &e),
        }
        return;
    }
    let (nodes, version) = cluster_nodes(ctx);
    let me = nodes.iter().find(|n| n.myself);
    if eq_ignore_case(sub, "myid") {
        let id = me.map_or_else(|| ctx.node.node_id().to_string(), |n| n.id.clone());
        ctx.enc.bulk(id.as_bytes());
    } else if eq_ignore_case(sub, "slots") {
        let mut ranges: Vec<(u16, u16, &NodeDesc, &Option<Replica>)> = nodes
            .iter()
            .flat_map(|n| {
                n.ranges
                    .iter()
                    .zip(&n.replicas)
                    .map(move |(r, m)| (r.0, r.1, n, m))
            })
            .collect();
        ranges.sort_by_key(|r| r.0);
        ctx.enc.array(ranges.len());
        for (first, last, n, mirror) in ranges {
            // A mirrored range lists its mirror as the replica (READONLY reads go there).
            ctx.enc.array(3 + usize::from(mirror.is_some()));
            ctx.enc.integer(i64::from(first));
            ctx.enc.integer(i64::from(last));
            ctx.enc.array(3);
            ctx.enc.bulk(n.host.as_bytes());
            ctx.enc.integer(i64::from(n.port));
            ctx.enc.bulk(n.id.as_bytes());
            if let Some((host, port, id)) = mirror {
                ctx.enc.array(3);
                ctx.enc.bulk(host.as_bytes());
                ctx.enc.integer(i64::from(*port));
                ctx.enc.bulk(id.as_bytes());
            }
        }
    } else if eq_ignore_case(sub, "shards") {
        let shards: Vec<&NodeDesc> = nodes.iter().filter(|n| !n.ranges.is_empty()).collect();
        ctx.enc.array(shards.len());
        for n in shards {
            ctx.enc.map(2);
            ctx.enc.bulk(b"slots");
            ctx.enc.array(n.ranges.len() * 2);
            for &(first, last) in &n.ranges {
                ctx.enc.integer(i64::from(first));
                ctx.enc.integer(i64::from(last));
            }
            ctx.enc.bulk(b"nodes");
            ctx.enc.array(1);
            ctx.enc.map(7);
            ctx.enc.bulk(b"id");
            ctx.enc.bulk(n.id.as_bytes());
            ctx.enc.bulk(b"port");
            ctx.enc.integer(i64::from(n.port));
            ctx.enc.bulk(b"ip");
            ctx.enc.bulk(n.host.as_bytes());
            ctx.enc.bulk(b"endpoint");
            ctx.enc.bulk(n.host.as_bytes());
            ctx.enc.bulk(b"role");
            ctx.enc.bulk(b"master");
            ctx.enc.bulk(b"replication-offset");
            ctx.enc.integer(0);
            ctx.enc.bulk(b"health");
            ctx.enc
                .bulk(if n.failed { &b"fail"[..] } else { b"online" });
        }
    } else if eq_ignore_case(sub, "nodes") {
        let now = now_ms();
        let mut text = String::new();
        for n in &nodes {
            let flags = match (n.myself, n.failed) {
                (true, _) => "myself,master",
                (false, true) => "master,fail",
                (false, false) => "master",
            };
            let link = if n.failed {
                "disconnected"
            } else {
                "connected"
            };
            text.push_str(&format!(
                "{} {}:{}@{} {flags} - 0 {now} {} {link}",
                n.id,
                n.host,
                n.port,
                u32::from(n.port) + 10000,
                n.epoch
            ));
            for &(first, last) in &n.ranges {
                if first == last {
                    text.push_str(&format!(" {first}"));
                } else {
                    text.push_str(&format!(" {first}-{last}"));
                }
            }
            // Redis lists each open slot on its own.
            for (first, last, to) in &n.migrating {
                for slot in *first..=*last {
                    text.push_str(&format!(" [{slot}->-{to}]"));
                }
            }
            for (first, last, from) in &n.importing {
                for slot in *first..=*last {
                    text.push_str(&format!(" [{slot}-<-{from}]"));
                }
            }
            text.push('\n');
        }
        ctx.enc.verbatim("txt", text.as_bytes());
    } else if eq_ignore_case(sub, "info") {
        let assigned: usize = nodes
            .iter()
            .flat_map(|n| n.ranges.iter())
            .map(|&(a, b)| usize::from(b - a) + 1)
            .sum();
        let failed: usize = nodes
            .iter()
            .filter(|n| n.failed)
            .flat_map(|n| n.ranges.iter())
            .map(|&(a, b)| usize::from(b - a) + 1)
            .sum();
        let enabled = u8::from(ctx.session.member().is_some() && !ctx.session.routed);
        // Tablets that wait for memory are listed under a live backup, but nobody serves them.
        let waiting = ctx
            .session
            .member()
            .filter(|_| !ctx.session.routed)
            .is_some_and(|m| m.view().tablets_waiting_for_room() > 0);
        let ok = assigned == usize::from(SLOT_COUNT) && failed == 0 && !waiting;
        let my_epoch = me.map_or(1, |n| n.epoch);
        let text = format!(
            "cluster_enabled:{enabled}\r\ncluster_state:{}\r\ncluster_slots_assigned:{assigned}\r\ncluster_slots_ok:{}\r\ncluster_slots_pfail:0\r\ncluster_slots_fail:{failed}\r\ncluster_known_nodes:{}\r\ncluster_size:{}\r\ncluster_current_epoch:{version}\r\ncluster_my_epoch:{my_epoch}\r\n",
            if ok { "ok" } else { "fail" },
            assigned - failed,
            nodes.len(),
            nodes.iter().filter(|n| !n.ranges.is_empty()).count(),
        );
        ctx.enc.verbatim("txt", text.as_bytes());
    } else {
        unknown_subcommand(ctx, "cluster", sub);
    }
}
