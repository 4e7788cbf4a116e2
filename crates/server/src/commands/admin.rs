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

pub(super) fn cmd_lastsave(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    let started = std::time::SystemTime::now() - ctx.node.started.elapsed();
    let secs = started
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    ctx.enc.integer(secs as i64)
}

pub(super) fn cmd_info(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let section = args.get(1).map(|s| String::from_utf8_lossy(s).into_owned());
    let text = ctx.node.snapshot().info(section.as_deref());
    ctx.enc.verbatim("txt", text.as_bytes());
}

/// The parameters CONFIG GET knows, with their current values.
pub(super) fn config_params(shared: &Node) -> Vec<(&'static str, String)> {
    use crate::config::PersistenceMode;
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
            if c.persistence == PersistenceMode::Off {
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
        ("cluster-enabled", "no".into()),
        ("dir", c.data_dir.display().to_string()),
    ]
}

pub(super) fn cmd_config(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1];
    if eq_ignore_case(sub, "get") {
        if args.len() < 3 {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'config|get' command");
        }
        let params = config_params(ctx.node);
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
        let name = String::from_utf8_lossy(args[2]);
        ctx.enc.error(&format!(
            "ERR Unknown option or number of arguments for CONFIG SET - '{name}' (ramlog is configured by file, flags and environment at start)"
        ));
    } else if eq_ignore_case(sub, "resetstat") {
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
        if spec.first_key <= 0 || !arity_ok(spec.arity, cmd.len()) {
            return ctx.enc.error("ERR The command has no key arguments");
        }
        let last = if spec.last_key < 0 {
            cmd.len() as i32 + spec.last_key
        } else {
            spec.last_key
        };
        let keys: Vec<&[u8]> = (spec.first_key..=last)
            .step_by(spec.step.max(1) as usize)
            .filter_map(|i| cmd.get(i as usize).copied())
            .collect();
        ctx.enc.array(keys.len());
        for k in keys {
            ctx.enc.bulk(k);
        }
    } else {
        unknown_subcommand(ctx, "command", sub);
    }
}

pub(super) fn cmd_cluster(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1];
    if eq_ignore_case(sub, "keyslot") {
        if args.len() != 3 {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'cluster|keyslot' command");
        }
        return ctx.enc.integer(i64::from(key_slot(args[2])));
    }
    let id = ctx.node.node_id();
    let host = ctx.node.config.bind.to_string();
    let port = ctx.node.resp_port();
    if eq_ignore_case(sub, "myid") {
        ctx.enc.bulk(id.as_bytes());
    } else if eq_ignore_case(sub, "slots") {
        // One node owns every slot.
        ctx.enc.array(1);
        ctx.enc.array(3);
        ctx.enc.integer(0);
        ctx.enc.integer(i64::from(SLOT_COUNT - 1));
        ctx.enc.array(3);
        ctx.enc.bulk(host.as_bytes());
        ctx.enc.integer(i64::from(port));
        ctx.enc.bulk(id.as_bytes());
    } else if eq_ignore_case(sub, "shards") {
        ctx.enc.array(1);
        ctx.enc.map(2);
        ctx.enc.bulk(b"slots");
        ctx.enc.array(2);
        ctx.enc.integer(0);
        ctx.enc.integer(i64::from(SLOT_COUNT - 1));
        ctx.enc.bulk(b"nodes");
        ctx.enc.array(1);
        ctx.enc.map(7);
        ctx.enc.bulk(b"id");
        ctx.enc.bulk(id.as_bytes());
        ctx.enc.bulk(b"port");
        ctx.enc.integer(i64::from(port));
        ctx.enc.bulk(b"ip");
        ctx.enc.bulk(host.as_bytes());
        ctx.enc.bulk(b"endpoint");
        ctx.enc.bulk(host.as_bytes());
        ctx.enc.bulk(b"role");
        ctx.enc.bulk(b"master");
        ctx.enc.bulk(b"replication-offset");
        ctx.enc.integer(0);
        ctx.enc.bulk(b"health");
        ctx.enc.bulk(b"online");
    } else if eq_ignore_case(sub, "nodes") {
        let line = format!(
            "{id} {host}:{port}@0 myself,master - 0 0 1 connected 0-{}\n",
            SLOT_COUNT - 1
        );
        ctx.enc.verbatim("txt", line.as_bytes());
    } else if eq_ignore_case(sub, "info") {
        let text = "cluster_enabled:0\r\ncluster_state:ok\r\ncluster_slots_assigned:16384\r\ncluster_slots_ok:16384\r\ncluster_slots_pfail:0\r\ncluster_slots_fail:0\r\ncluster_known_nodes:1\r\ncluster_size:1\r\ncluster_current_epoch:1\r\ncluster_my_epoch:1\r\n";
        ctx.enc.verbatim("txt", text.as_bytes());
    } else {
        unknown_subcommand(ctx, "cluster", sub);
    }
}
