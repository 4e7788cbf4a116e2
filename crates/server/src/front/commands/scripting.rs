//! Lua scripting (Redis's `eval.c` and `script_lua.c`): EVAL, EVALSHA, EVAL_RO, EVALSHA_RO and
//! SCRIPT LOAD|EXISTS|FLUSH|KILL|HELP, through an embedded Lua 5.1 (the version Redis embeds).
//!
//! - Each worker thread keeps one Lua state with the `redis` library (`call`, `pcall`,
//!   `error_reply`, `status_reply`, `sha1hex`, `log`, ...) and the base, table, string and math
//!   libraries (no `io`, `os` or `require`); compiled scripts are cached in it by SHA1.
//! - The script bodies live in the server (`node::scripts`): EVAL and SCRIPT LOAD add them, EVALSHA
//!   finds them, SCRIPT FLUSH forgets them (every thread's cache follows by an epoch).
//! - `redis.call` runs the command as a client's command on this connection's session, in RESP2
//!   (what a script sees in Redis by default), and converts the reply as Redis does: integers to
//!   numbers, bulk strings to strings, nulls to `false`, arrays to tables, status replies to
//!   `{ok=...}`; an error reply raises `{err=...}` (`redis.pcall` returns it).
//! - A script runs alone: every other command on this server waits for it (the gate in
//!   `super::Gate`), as in Redis. Once it has run `busy-reply-threshold` (`lua-time-limit`,
//!   5 s) other commands answer `-BUSY`, and SCRIPT KILL (which does not wait for the gate)
//!   stops it at its next check (every 10 000 Lua instructions) unless it has written:
//!   `-UNKILLABLE` then, as in Redis.
//! - In a cluster its keys must be in one slot this server masters (`-CROSSSLOT`, `-MOVED` as
//!   for any command); a key of another slot inside the script gets the command's `-MOVED`.

use super::*;
use mlua::{HookTriggers, Lua, LuaOptions, MultiValue, RegistryKey, StdLib, Table, Value, VmState};
use ramlog_proto::resp::{Reply, ReplyDecoder};
use std::cell::RefCell;

pub(super) use crate::node::scripts::sha1_hex;
use crate::node::scripts::SCRIPT_BYTES_MAX;

/// How often (in Lua instructions) a running script checks whether SCRIPT KILL asked it to stop.
const KILL_CHECK_INSTRUCTIONS: u32 = 10_000;
/// How often a long script hands its runtime worker's duties to another thread again.
const HAND_OFF_EVERY: std::time::Duration = std::time::Duration::from_millis(50);
/// How long a script runs on a runtime worker before it hands the worker's duties to another
/// thread.
const LONG_SCRIPT: std::time::Duration = std::time::Duration::from_millis(2);
/// The error a killed script ends with (Redis's words).
const KILLED: &str = "Script killed by user with SCRIPT KILL...";

/// The library every script sees, in Lua over two functions the server gives it:
/// `__ramlog_command` (set for each script run) and `__ramlog_sha1hex`.
const PRELUDE: &str = r#"
redis = {}
redis.LOG_DEBUG, redis.LOG_VERBOSE, redis.LOG_NOTICE, redis.LOG_WARNING = 0, 1, 2, 3
function redis.call(...)
  local ok, r = __ramlog_command(...)
  if not ok then error(r, 2) end
  return r
end
function redis.pcall(...)
  local ok, r = __ramlog_command(...)
  return r
end
function redis.error_reply(e)
  if type(e) ~= 'string' then error('wrong number or type of arguments', 2) end
  return {err = e}
end
function redis.status_reply(s)
  if type(s) ~= 'string' then error('wrong number or type of arguments', 2) end
  return {ok = s}
end
function redis.sha1hex(s) return __ramlog_sha1hex(s) end
function redis.log(level, ...) end
function redis.setresp(v)
  if v ~= 2 then error('ramlog scripts read replies in RESP2 only', 2) end
end
function redis.set_repl(v) end
function redis.replicate_commands() return true end
redis.REPL_NONE, redis.REPL_AOF, redis.REPL_SLAVE, redis.REPL_REPLICA, redis.REPL_ALL = 0, 1, 2, 2, 3
function __ramlog_run(f)
  local ok, r = pcall(f)
  if ok then return false, r end
  if type(r) == 'table' and type(r.err) == 'string' then return true, r.err end
  -- An error a library function (Rust) raised carries its stack traceback: Redis's do not.
  local message = string.gsub(tostring(r), '\nstack traceback:.*$', '')
  return true, 'ERR ' .. message
end
"#;

struct Vm {
    lua: Lua,
    compiled: HashMap<String, RegistryKey>,
    epoch: u64,
}

impl Vm {
    fn new() -> mlua::Result<Vm> {
        let lua = Lua::new_with(
            StdLib::TABLE | StdLib::STRING | StdLib::MATH,
            LuaOptions::default(),
        )?;
        // No loading of code from files (the base library's loadfile/dofile).
        let globals = lua.globals();
        for name in ["loadfile", "dofile"] {
            globals.set(name, Value::Nil)?;
        }
        globals.set(
            "__ramlog_sha1hex",
            lua.create_function(|lua, s: mlua::String| lua.create_string(sha1_hex(&s.as_bytes())))?,
        )?;
        super::lua_libs::install(&lua)?;
        lua.load(PRELUDE).set_name("=ramlog").exec()?;
        lua.set_memory_limit(LUA_MEMORY_MAX)?;
        Ok(Vm {
            lua,
            compiled: HashMap::new(),
            epoch: 0,
        })
    }
}

thread_local! {
    static VM: RefCell<Option<Vm>> = const { RefCell::new(None) };
}

/// Most memory one worker thread's Lua state may take (its compiled scripts and a running
/// script's data); past it the script fails with Lua's "not enough memory".
const LUA_MEMORY_MAX: usize = 64 << 20;

/// EVAL script numkeys [key ...] [arg ...]
pub(super) fn cmd_eval(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    match ctx.node.scripts.add(args[1]) {
        Ok(sha) => run(ctx, args, &sha, args[1].into()),
        Err(e) => ctx.enc.error(&e),
    }
}

/// EVALSHA sha1 numkeys [key ...] [arg ...]
pub(super) fn cmd_evalsha(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sha = String::from_utf8_lossy(args[1]).to_ascii_lowercase();
    match ctx.node.scripts.get(&sha) {
        Some(body) => run(ctx, args, &sha, body),
        None => ctx
            .enc
            .error("NOSCRIPT No matching script. Please use EVAL."),
    }
}

fn run(ctx: &mut Ctx<'_>, args: &[&[u8]], sha: &str, body: std::sync::Arc<[u8]>) {
    let numkeys = match parse_i64(args[2]) {
        Some(n) if n < 0 => return ctx.enc.error("ERR Number of keys can't be negative"),
        Some(n) if n as u64 > (args.len() - 3) as u64 => {
            return ctx
                .enc
                .error("ERR Number of keys can't be greater than number of args")
        }
        Some(n) => n as usize,
        None => return ctx.enc.error(ERR_NOT_INTEGER),
    };
    let read_only = args[0].len() > 4 && args[0][args[0].len() - 3..].eq_ignore_ascii_case(b"_ro");
    let keys = &args[3..3 + numkeys];
    let argv = &args[3 + numkeys..];
    let outcome = VM.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(Vm::new()?);
        }
        let vm = slot.as_mut().expect("created above");
        let epoch = ctx.node.scripts.epoch();
        if vm.epoch != epoch {
            vm.compiled.clear();
            vm.epoch = epoch;
            vm.lua.expire_registry_values();
        }
        if !vm.compiled.contains_key(sha) {
            let f = match vm
                .lua
                .load(&body[..])
                .set_name("@user_script")
                .into_function()
            {
                Ok(f) => f,
                Err(e) => {
                    return Ok(Err(format!(
                        "ERR Error compiling script (new function): {}",
                        compile_message(&e)
                    )))
                }
            };
            let key = vm.lua.create_registry_value(f)?;
            vm.compiled.insert(sha.to_string(), key);
        }
        let f: mlua::Function = vm.lua.registry_value(&vm.compiled[sha])?;
        let running = ctx.node.scripts.running.clone();
        running.start(now_ms());
        let stop = running.clone();
        let started = Instant::now();
        let moved: std::cell::Cell<Option<Instant>> = std::cell::Cell::new(None);
        vm.lua.set_hook(
            HookTriggers::new().every_nth_instruction(KILL_CHECK_INSTRUCTIONS),
            move |_, _| {
                if stop.kill_requested() {
                    return Err(mlua::Error::RuntimeError(KILLED.into()));
                }
                // A script that runs long would stall the runtime worker it runs on, and with
                // it the polling of every connection (so nobody could even be told -BUSY): it
                // hands the worker's duties to another thread. The pause lets that thread take
                // them before this one goes on without them; on a loaded machine it may not
                // have, and this thread takes them back, so the hand-off is made again every
                // HAND_OFF_EVERY (a thread that holds no worker's duties just pauses).
                if started.elapsed() >= LONG_SCRIPT
                    && moved.get().is_none_or(|at| at.elapsed() >= HAND_OFF_EVERY)
                {
                    moved.set(Some(Instant::now()));
                    off_the_runtime(|| std::thread::sleep(std::time::Duration::from_millis(1)));
                }
                Ok(VmState::Continue)
            },
        );
        let outcome = run_in(&vm.lua, ctx, f, keys, argv, read_only).map(Ok);
        vm.lua.remove_hook();
        running.end();
        outcome
    });
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(message)) => ctx.enc.error(&message),
        Err(e) => ctx
            .enc
            .error(&format!("ERR Error running script: {}", first_line(&e))),
    }
}

/// A syntax error as Lua gives it (`user_script:1: unexpected symbol near ...`).
fn compile_message(e: &mlua::Error) -> String {
    match e {
        mlua::Error::SyntaxError { message, .. } => message.clone(),
        other => first_line(other),
    }
}

fn first_line(e: &mlua::Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// Runs `f` with KEYS and ARGV set and `redis.call` bound to this connection; writes its reply.
fn run_in(
    lua: &Lua,
    ctx: &mut Ctx<'_>,
    f: mlua::Function,
    keys: &[&[u8]],
    argv: &[&[u8]],
    read_only: bool,
) -> mlua::Result<()> {
    let globals = lua.globals();
    let list = |items: &[&[u8]]| -> mlua::Result<Table> {
        let t = lua.create_table_with_capacity(items.len(), 0)?;
        for (i, a) in items.iter().enumerate() {
            t.raw_set(i + 1, lua.create_string(a)?)?;
        }
        Ok(t)
    };
    globals.set("KEYS", list(keys)?)?;
    globals.set("ARGV", list(argv)?)?;
    let run: mlua::Function = globals.get("__ramlog_run")?;
    let node = ctx.node;
    let protocol = ctx.session.protocol;
    ctx.session.protocol = 2;
    ctx.session.scripting = true;
    let session = RefCell::new(&mut *ctx.session);
    let result = lua.scope(|scope| {
        let command = scope.create_function(|lua, params: MultiValue| {
            let mut session = session.borrow_mut();
            script_command(lua, node, &mut session, params, read_only)
        })?;
        globals.set("__ramlog_command", command)?;
        let out = run.call::<(bool, Value)>(f);
        globals.set("__ramlog_command", Value::Nil)?;
        out
    });
    ctx.session.protocol = protocol;
    ctx.session.scripting = false;
    let (failed, value) = result?;
    if failed {
        let message = match value {
            // Stopped by SCRIPT KILL or SHUTDOWN: Redis's words, without Lua's traceback.
            _ if ctx.node.scripts.running.kill_requested() => format!("ERR {KILLED}"),
            Value::String(s) => s.to_string_lossy(),
            _ => "ERR script failed".to_string(),
        };
        ctx.enc.error(&message);
        return Ok(());
    }
    reply_from_lua(&mut ctx.enc, &value, 0);
    Ok(())
}

/// `redis.call`'s body: (true, reply) or (false, {err = message}).
fn script_command(
    lua: &Lua,
    node: &Node,
    session: &mut Session,
    params: MultiValue,
    read_only: bool,
) -> mlua::Result<(bool, Value)> {
    let error = |lua: &Lua, message: &str| -> mlua::Result<(bool, Value)> {
        let t = lua.create_table()?;
        t.set("err", message)?;
        Ok((false, Value::Table(t)))
    };
    if params.is_empty() {
        return error(
            lua,
            "ERR Please specify at least one argument for this redis lib call",
        );
    }
    let mut owned: Vec<Vec<u8>> = Vec::with_capacity(params.len());
    for p in params.iter() {
        match p {
            Value::String(s) => owned.push(s.as_bytes().to_vec()),
            Value::Integer(i) => owned.push(i.to_string().into_bytes()),
            Value::Number(n) => owned.push(lua_number_text(*n).into_bytes()),
            _ => {
                return error(
                    lua,
                    "ERR Lua redis lib command arguments must be strings or integers",
                )
            }
        }
    }
    let args: Vec<&[u8]> = owned.iter().map(|a| a.as_slice()).collect();
    match lookup(args[0]) {
        None => return error(lua, "ERR Unknown Redis command called from script"),
        Some(spec) if spec.flags.contains(&"noscript") => {
            return error(lua, "ERR This Redis command is not allowed from script")
        }
        Some(spec) if read_only && spec.is_write() => {
            return error(
                lua,
                "ERR Write commands are not allowed from read-only scripts.",
            )
        }
        // From its first write on, SCRIPT KILL cannot stop the script.
        Some(spec) if spec.is_write() => node.scripts.running.note_write(),
        Some(_) => {}
    }
    let mut out = Vec::new();
    execute(node, session, &args, &mut out);
    let decoded = ReplyDecoder::default().decode(&out);
    let reply = match decoded {
        Ok(Some((reply, _))) => reply,
        _ => return error(lua, "ERR the command's reply could not be read"),
    };
    if let Reply::Error(message) = &reply {
        return error(lua, message);
    }
    Ok((true, reply_to_lua(lua, &reply)?))
}

/// A Lua number as an argument: integral values without a fraction (Lua's own `%.14g`).
fn lua_number_text(n: f64) -> String {
    if n.fract() == 0.0 && n.abs() < 1e15 {
        format!("{}", n as i64)
    } else {
        let s = format!("{n:.14e}");
        // Shortest form that reads back the same, as `%.14g` prints.
        format!("{}", s.parse::<f64>().unwrap_or(n))
    }
}

/// Redis's conversion of a (RESP2) reply to Lua.
fn reply_to_lua(lua: &Lua, reply: &Reply) -> mlua::Result<Value> {
    Ok(match reply {
        Reply::Simple(s) => {
            let t = lua.create_table()?;
            t.set("ok", s.as_str())?;
            Value::Table(t)
        }
        Reply::Error(e) => {
            let t = lua.create_table()?;
            t.set("err", e.as_str())?;
            Value::Table(t)
        }
        Reply::Integer(i) => Value::Integer(*i),
        Reply::Bulk(b) => Value::String(lua.create_string(b)?),
        Reply::Null => Value::Boolean(false),
        Reply::Boolean(b) => Value::Boolean(*b),
        Reply::Double(d) | Reply::BigNumber(d) => Value::String(lua.create_string(d)?),
        Reply::Verbatim(_, b) => Value::String(lua.create_string(b)?),
        Reply::Array(items) | Reply::Set(items) | Reply::Push(items) => {
            let t = lua.create_table_with_capacity(items.len(), 0)?;
            for (i, item) in items.iter().enumerate() {
                t.raw_set(i + 1, reply_to_lua(lua, item)?)?;
            }
            Value::Table(t)
        }
        Reply::Map(pairs) => {
            let t = lua.create_table_with_capacity(pairs.len() * 2, 0)?;
            for (i, (k, v)) in pairs.iter().enumerate() {
                t.raw_set(2 * i + 1, reply_to_lua(lua, k)?)?;
                t.raw_set(2 * i + 2, reply_to_lua(lua, v)?)?;
            }
            Value::Table(t)
        }
    })
}

/// Redis's conversion of a script's result to a reply: numbers to integers (truncated), strings
/// to bulk strings, `true` to 1, `false` and nil to null, `{ok=...}` to a status, `{err=...}` to
/// an error, other tables to arrays (up to the first nil).
fn reply_from_lua(enc: &mut ReplyEncoder<'_>, value: &Value, depth: usize) {
    match value {
        Value::Nil | Value::Boolean(false) => enc.null(),
        Value::Boolean(true) => enc.integer(1),
        Value::Integer(i) => enc.integer(*i),
        Value::Number(n) => enc.integer(*n as i64),
        Value::String(s) => enc.bulk(&s.as_bytes()),
        Value::Table(t) if depth < 64 => {
            if let Ok(Value::String(e)) = t.raw_get::<Value>("err") {
                return enc.error(&e.to_string_lossy());
            }
            if let Ok(Value::String(s)) = t.raw_get::<Value>("ok") {
                return enc.simple(&s.to_string_lossy());
            }
            let mut items = Vec::new();
            for i in 1.. {
                match t.raw_get::<Value>(i) {
                    Ok(Value::Nil) | Err(_) => break,
                    Ok(v) => items.push(v),
                }
            }
            enc.array(items.len());
            for v in &items {
                reply_from_lua(enc, v, depth + 1);
            }
        }
        Value::Table(_) => enc.error("ERR reached lua stack limit"),
        _ => enc.null(),
    }
}

/// SCRIPT LOAD|EXISTS|FLUSH|KILL|HELP
pub(super) fn cmd_script(ctx: &mut Ctx<'_>, args: &[&[u8]]) {
    let sub = args[1];
    if eq_ignore_case(sub, "load") && args.len() == 3 {
        if args[2].len() > SCRIPT_BYTES_MAX {
            return ctx.enc.error(&format!(
                "ERR script of {} bytes is over the limit of {SCRIPT_BYTES_MAX}",
                args[2].len()
            ));
        }
        // Compiled here first, so that a script with a syntax error is refused at once.
        let compiled = VM.with(|cell| -> Result<(), String> {
            let mut slot = cell.borrow_mut();
            if slot.is_none() {
                *slot = Some(Vm::new().map_err(|e| first_line(&e))?);
            }
            let vm = slot.as_ref().expect("created above");
            vm.lua
                .load(args[2])
                .set_name("@user_script")
                .into_function()
                .map(|_| ())
                .map_err(|e| compile_message(&e))
        });
        if let Err(e) = compiled {
            return ctx
                .enc
                .error(&format!("ERR Error compiling script (new function): {e}"));
        }
        match ctx.node.scripts.add(args[2]) {
            Ok(sha) => ctx.enc.bulk(sha.as_bytes()),
            Err(e) => ctx.enc.error(&e),
        }
    } else if eq_ignore_case(sub, "exists") && args.len() >= 3 {
        ctx.enc.array(args.len() - 2);
        for sha in &args[2..] {
            let sha = String::from_utf8_lossy(sha).to_ascii_lowercase();
            ctx.enc
                .integer(i64::from(ctx.node.scripts.get(&sha).is_some()));
        }
    } else if eq_ignore_case(sub, "flush") && args.len() <= 3 {
        if args.len() == 3 && !eq_ignore_case(args[2], "async") && !eq_ignore_case(args[2], "sync")
        {
            return ctx.enc.error(ERR_SYNTAX);
        }
        ctx.node.scripts.flush();
        ctx.enc.ok()
    } else if eq_ignore_case(sub, "kill") && args.len() == 2 {
        use crate::node::scripts::Kill;
        match ctx.node.scripts.running.kill() {
            Kill::NotBusy => ctx.enc.error("NOTBUSY No scripts in execution right now."),
            Kill::Unkillable => ctx.enc.error("UNKILLABLE Sorry the script already executed write commands against the dataset. You can either wait the script termination or kill the server in a hard way using the SHUTDOWN NOSAVE command."),
            Kill::Killed => ctx.enc.ok(),
        }
    } else if eq_ignore_case(sub, "help") {
        let lines = [
            "SCRIPT <subcommand> [<arg> [value] [opt] ...]. Subcommands are:",
            "EXISTS <sha1> [<sha1> ...]",
            "FLUSH [ASYNC|SYNC]",
            "KILL",
            "LOAD <script>",
        ];
        ctx.enc.array(lines.len());
        for l in lines {
            ctx.enc.simple(l);
        }
    } else {
        unknown_subcommand(ctx, "script", sub)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_as_arguments_read_as_lua_prints_them() {
        assert_eq!(lua_number_text(3.0), "3");
        assert_eq!(lua_number_text(-7.0), "-7");
        assert_eq!(lua_number_text(0.5), "0.5");
    }
}
