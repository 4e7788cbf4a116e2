//! Connection commands: PING, ECHO, SELECT, QUIT, MULTI/EXEC/DISCARD, AUTH, HELLO, CLIENT.

use super::*;
use crate::node::waiters::UnblockAs;

pub(super) fn cmd_ping(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match args.len() {
        1 => ctx.enc.simple("PONG"),
        2 => ctx.enc.bulk(args[1]),
        _ => ctx
            .enc
            .error("ERR wrong number of arguments for 'ping' command"),
    }
}

pub(super) fn cmd_echo(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    ctx.enc.bulk(args[1])
}

pub(super) fn cmd_select(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match parse_i64(args[1]) {
        None => ctx.enc.error(ERR_NOT_INTEGER),
        Some(0) => ctx.enc.ok(),
        // Redis Cluster has database 0 only.
        Some(_) if ctx.cluster_node() => ctx.enc.error("ERR SELECT is not allowed in cluster mode"),
        Some(_) => ctx.enc.error("ERR DB index is out of range"),
    }
}

pub(super) fn cmd_quit(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    ctx.session.closing = true;
    ctx.enc.ok()
}

/// MULTI: queue the following commands until EXEC. EXEC runs them back to back on this connection
/// and answers an array of their replies. Each command is atomic on its own; the batch is not
/// isolated from other connections' writes (there is no WATCH), so it is a pipeline with Redis's
/// transaction framing, which is what clients such as redis-py use for their default pipelines.
pub(super) fn cmd_multi(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    if ctx.session.multi.is_some() {
        return ctx.enc.error("ERR MULTI calls can not be nested");
    }
    ctx.session.multi = Some(Vec::new());
    ctx.session.multi_failed = false;
    ctx.enc.ok()
}

pub(super) fn cmd_exec(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    let Some(queue) = ctx.session.multi.take() else {
        return ctx.enc.error("ERR EXEC without MULTI");
    };
    let watched = std::mem::take(&mut ctx.session.watched);
    if std::mem::take(&mut ctx.session.multi_failed) {
        return ctx
            .enc
            .error("EXECABORT Transaction discarded because of previous errors.");
    }
    // WATCH: a watched key that changed since aborts the transaction (a null reply). The check
    // and the queued commands are not one atomic step: a write that lands between them is not
    // seen (docs/protocol.md, MULTI/EXEC).
    for (key, version) in &watched {
        match watched_version(ctx, key) {
            Ok(now) if now == *version => {}
            Ok(_) => return ctx.enc.null_array(),
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc.array(queue.len());
    let out = ctx.enc.buffer();
    for command in &queue {
        let args: Vec<&[u8]> = command.iter().map(|a| a.as_slice()).collect();
        execute(ctx.node, ctx.session, &args, out);
    }
}

/// The version of a key as WATCH records it (None: absent).
fn watched_version(ctx: &mut Ctx<'_>, key: &[u8]) -> Result<Option<u64>, NodeError> {
    let node = ctx.node;
    node.read_with(
        node.tablet_of(key),
        key,
        &mut ctx.session.acks,
        |_, version, _| version,
    )
}

/// RAMLOG.VERSIONS key [key ...]: each key's version (nil when absent). The routing port's
/// WATCH reads the versions of keys at their masters with it.
pub(super) fn cmd_ramlog_versions(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let mut versions = Vec::with_capacity(args.len() - 1);
    for key in &args[1..] {
        match watched_version(ctx, key) {
            Ok(v) => versions.push(v),
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc.array(versions.len());
    for v in versions {
        match v {
            Some(v) => ctx.enc.integer(v as i64),
            None => ctx.enc.null(),
        }
    }
}

/// WATCH key [key ...]
pub(super) fn cmd_watch(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    for key in &args[1..] {
        if ctx.session.watched.iter().any(|(k, _)| k == key) {
            continue;
        }
        match watched_version(ctx, key) {
            Ok(v) => ctx.session.watched.push((key.to_vec(), v)),
            Err(e) => return engine_error(ctx, &e),
        }
    }
    ctx.enc.ok()
}

pub(super) fn cmd_unwatch(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    ctx.session.watched.clear();
    ctx.enc.ok()
}

pub(super) fn cmd_discard(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    ctx.session.watched.clear();
    if ctx.session.multi.take().is_none() {
        return ctx.enc.error("ERR DISCARD without MULTI");
    }
    ctx.session.multi_failed = false;
    ctx.enc.ok()
}

/// Checks a username/password pair against the configured password (user `default` only).
pub(super) fn credentials_ok(node: &Node, user: &[u8], pass: &[u8]) -> bool {
    user == b"default" && node.password_ok(pass)
}

pub(super) fn cmd_auth(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let (user, pass) = match args.len() {
        2 => (&b"default"[..], args[1]),
        3 => (args[1], args[2]),
        _ => return ctx.enc.error(ERR_SYNTAX),
    };
    if args.len() == 2 && ctx.node.config.password.is_none() {
        return ctx.enc.error("ERR AUTH <password> called without any password configured for the default user. Are you sure your configuration is correct?");
    }
    if credentials_ok(ctx.node, user, pass) {
        ctx.session.authenticated = true;
        ctx.enc.ok()
    } else {
        ctx.enc.error(ERR_WRONGPASS)
    }
}

/// HELLO [protover [AUTH username password] [SETNAME clientname]]
pub(super) fn cmd_hello(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let mut protocol = ctx.session.protocol;
    let mut i = 1;
    if args.len() >= 2 {
        match parse_i64(args[1]) {
            None => {
                return ctx
                    .enc
                    .error("ERR Protocol version is not an integer or out of range")
            }
            Some(v) if !(2..=3).contains(&v) => {
                return ctx.enc.error("NOPROTO unsupported protocol version")
            }
            Some(v) => protocol = v as u8,
        }
        i = 2;
    }
    let mut auth: Option<(&[u8], &[u8])> = None;
    let mut name: Option<&[u8]> = None;
    while i < args.len() {
        let more = args.len() - i - 1;
        if eq_ignore_case(args[i], "auth") && more >= 2 {
            auth = Some((args[i + 1], args[i + 2]));
            i += 3;
        } else if eq_ignore_case(args[i], "setname") && more >= 1 {
            name = Some(args[i + 1]);
            i += 2;
        } else {
            let o = String::from_utf8_lossy(args[i]);
            return ctx
                .enc
                .error(&format!("ERR Syntax error in HELLO option '{o}'"));
        }
    }
    if let Some((user, pass)) = auth {
        if !credentials_ok(ctx.node, user, pass) {
            return ctx.enc.error(ERR_WRONGPASS);
        }
        ctx.session.authenticated = true;
    }
    if !ctx.session.authenticated {
        return ctx.enc.error("NOAUTH HELLO must be called with the client already authenticated, otherwise the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and select the RESP protocol version at the same time");
    }
    if let Some(n) = name {
        if !valid_client_name(n) {
            return ctx
                .enc
                .error("ERR Client names cannot contain spaces, newlines or special characters.");
        }
        ctx.session.name = if n.is_empty() { None } else { Some(n.to_vec()) };
    }
    ctx.session.protocol = protocol;
    ctx.enc.set_protocol(protocol);
    let mode: &[u8] = if ctx.cluster_node() {
        b"cluster"
    } else {
        b"standalone"
    };
    let enc = &mut ctx.enc;
    enc.map(7);
    enc.bulk(b"server");
    enc.bulk(b"redis");
    enc.bulk(b"version");
    enc.bulk(b"7.2.0");
    enc.bulk(b"proto");
    enc.integer(i64::from(protocol));
    enc.bulk(b"id");
    enc.integer(ctx.session.id as i64);
    enc.bulk(b"mode");
    enc.bulk(mode);
    enc.bulk(b"role");
    enc.bulk(b"master");
    enc.bulk(b"modules");
    enc.array(0);
}

pub(super) fn valid_client_name(name: &[u8]) -> bool {
    name.iter().all(|&c| (b'!'..=b'~').contains(&c))
}

pub(super) fn client_info_line(session: &Session) -> String {
    let name = session
        .name
        .as_deref()
        .map(String::from_utf8_lossy)
        .unwrap_or_default();
    let lib_name = session
        .lib_name
        .as_deref()
        .map(String::from_utf8_lossy)
        .unwrap_or_default();
    let lib_ver = session
        .lib_ver
        .as_deref()
        .map(String::from_utf8_lossy)
        .unwrap_or_default();
    let addr = |a: Option<std::net::SocketAddr>| a.map(|a| a.to_string()).unwrap_or_default();
    let (sub, psub, ssub) = session.mailbox.as_ref().map_or((0, 0, 0), |m| {
        (m.channels.len(), m.patterns.len(), m.shard_channels.len())
    });
    let multi = session.multi.as_ref().map_or(-1, |q| q.len() as i64);
    format!(
        "id={} addr={} laddr={} name={} age={} idle=0 flags={} db=0 sub={sub} psub={psub} ssub={ssub} multi={multi} resp={} lib-name={} lib-ver={}\n",
        session.id,
        addr(session.addr),
        addr(session.laddr),
        name,
        session.connected.elapsed().as_secs(),
        if sub + psub + ssub > 0 { "P" } else { "N" },
        session.protocol,
        lib_name,
        lib_ver
    )
}

pub(super) fn cmd_client(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1];
    if eq_ignore_case(sub, "setname") {
        if args.len() != 3 {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'client|setname' command");
        }
        if !valid_client_name(args[2]) {
            return ctx
                .enc
                .error("ERR Client names cannot contain spaces, newlines or special characters.");
        }
        ctx.session.name = if args[2].is_empty() {
            None
        } else {
            Some(args[2].to_vec())
        };
        ctx.enc.ok();
    } else if eq_ignore_case(sub, "reply") {
        // CLIENT REPLY ON|OFF|SKIP: OFF and SKIP are not answered (the reply is dropped after
        // the command runs), ON answers OK.
        match args.get(2) {
            Some(mode) if args.len() == 3 && eq_ignore_case(mode, "on") => {
                ctx.session.replies_off = false;
                ctx.enc.ok();
            }
            Some(mode) if args.len() == 3 && eq_ignore_case(mode, "off") => {
                ctx.session.replies_off = true;
                ctx.enc.ok();
            }
            Some(mode) if args.len() == 3 && eq_ignore_case(mode, "skip") => {
                ctx.session.skip_next_reply = true;
                ctx.enc.ok();
            }
            _ => ctx.enc.error(ERR_SYNTAX),
        }
    } else if eq_ignore_case(sub, "getname") {
        let name = ctx.session.name.clone();
        ctx.enc.bulk_or_null(name.as_deref());
    } else if eq_ignore_case(sub, "id") {
        ctx.enc.integer(ctx.session.id as i64);
    } else if eq_ignore_case(sub, "setinfo") {
        if args.len() != 4 {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'client|setinfo' command");
        }
        let attr = args[2];
        let is_name = eq_ignore_case(attr, "lib-name");
        if !is_name && !eq_ignore_case(attr, "lib-ver") {
            let a = String::from_utf8_lossy(attr);
            return ctx.enc.error(&format!("ERR Unrecognized option '{a}'"));
        }
        if !valid_client_name(args[3]) {
            let a = String::from_utf8_lossy(attr).to_ascii_lowercase();
            return ctx.enc.error(&format!(
                "ERR {a} cannot contain spaces, newlines or special characters."
            ));
        }
        let value = Some(args[3].to_vec());
        if is_name {
            ctx.session.lib_name = value;
        } else {
            ctx.session.lib_ver = value;
        }
        ctx.enc.ok();
    } else if eq_ignore_case(sub, "info") {
        let line = client_info_line(ctx.session);
        ctx.enc.verbatim("txt", line.as_bytes());
    } else if eq_ignore_case(sub, "unblock") {
        // CLIENT UNBLOCK client-id [TIMEOUT|ERROR]
        if args.len() != 3 && args.len() != 4 {
            return ctx
                .enc
                .error("ERR wrong number of arguments for 'client|unblock' command");
        }
        let Some(id) = parse_i64(args[2]) else {
            return ctx.enc.error(ERR_NOT_INTEGER);
        };
        let how = match args.get(3) {
            None => UnblockAs::Timeout,
            Some(a) if eq_ignore_case(a, "timeout") => UnblockAs::Timeout,
            Some(a) if eq_ignore_case(a, "error") => UnblockAs::Error,
            Some(_) => {
                return ctx
                    .enc
                    .error("ERR CLIENT UNBLOCK reason should be TIMEOUT or ERROR")
            }
        };
        let done = u64::try_from(id).is_ok_and(|id| ctx.node.waiters.unblock(id, how));
        ctx.enc.integer(i64::from(done));
    } else if eq_ignore_case(sub, "no-evict") || eq_ignore_case(sub, "no-touch") {
        ctx.enc.ok();
    } else if eq_ignore_case(sub, "help") {
        let lines = [
            "CLIENT <subcommand> [<arg> ...]. Subcommands are:",
            "ID",
            "GETNAME",
            "SETNAME <name>",
            "SETINFO <LIB-NAME|LIB-VER> <value>",
            "INFO",
            "UNBLOCK <clientid> [TIMEOUT|ERROR]",
        ];
        ctx.enc.array(lines.len());
        for l in lines {
            ctx.enc.simple(l);
        }
    } else {
        unknown_subcommand(ctx, "client", sub);
    }
}

/// READONLY: this connection may read from replicas (a mirror serves them; a master answers as
/// before).
pub(super) fn cmd_readonly(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    ctx.session.readonly = true;
    ctx.enc.ok();
}

pub(super) fn cmd_readwrite(ctx: &mut Ctx<'_>, _args: &[&[u8]]) {
    ctx.session.readonly = false;
    ctx.enc.ok();
}
