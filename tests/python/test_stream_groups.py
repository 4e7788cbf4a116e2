"""Stream consumer groups (XGROUP, XREADGROUP, XACK, XPENDING, XCLAIM, XAUTOCLAIM, XSETID,
XINFO) on a standalone server, a cluster's routing port and the key's master's cluster port,
against redis-server in the same test."""
import socket
import threading
import time

import pytest
import redis

from conftest import Server, wait_until
from test_types import blocked_clients, blocking_target, redis_peer  # noqa: F401

S = "{q}st"
S2 = "{q}st2"

# Fields whose times differ between two servers (idle times, seen and active times).
TIMED = {b"idle", b"inactive", b"seen-time", b"active-time"}


def _zero(items, at):
    """Pending entries with the time at `at` set to 0 ([id, consumer, ms, count] or
    [id, ms, count])."""
    return [item[:at] + [0] + item[at + 1:] if isinstance(item, list) else item for item in items]


def _untimed(cmd, reply):
    """A raw reply with the times it holds left out or zeroed."""
    if not isinstance(reply, list):
        return reply
    if cmd[0] == "XPENDING" and len(cmd) > 3:
        return _zero(reply, 2)
    if cmd[0] == "XINFO":
        return [_untimed_map(x) if isinstance(x, list) else x for x in reply] \
            if cmd[1] in ("GROUPS", "CONSUMERS") else _untimed_map(reply)
    return reply


def _untimed_map(flat):
    """An XINFO map (a flat list of names and values) without times, its pending entries' times
    zeroed, its groups and consumers likewise."""
    out = []
    for k, v in zip(flat[::2], flat[1::2]):
        if k in TIMED:
            continue
        if k == b"pending" and isinstance(v, list):
            v = _zero(v, 2 if v and isinstance(v[0], list) and len(v[0]) == 4 else 1)
        elif k in (b"groups", b"consumers") and isinstance(v, list):
            v = [_untimed_map(x) if isinstance(x, list) else x for x in v]
        out += [k, v]
    return out


SESSION = [
    ("DEL", S, S2),
    ("XGROUP", "CREATE", S, "g", "$"),
    ("XGROUP", "CREATE", S, "g", "$", "MKSTREAM"),
    ("XGROUP", "CREATE", S, "g", "$", "MKSTREAM"),
    ("XADD", S, "1-1", "a", "1"),
    ("XADD", S, "1-2", "b", "2"),
    ("XADD", S, "2-0", "c", "3"),
    ("XADD", S, "3-0", "", "empty field"),
    ("XGROUP", "CREATE", S, "h", "0", "ENTRIESREAD", "0"),
    ("XGROUP", "CREATE", S, "bad", "0", "ENTRIESREAD", "-3"),
    ("XREADGROUP", "GROUP", "g", "alice", "COUNT", "1", "STREAMS", S, ">"),
    ("XREADGROUP", "GROUP", "g", "bob", "STREAMS", S, ">"),
    ("XREADGROUP", "GROUP", "g", "bob", "STREAMS", S, ">"),
    ("XREADGROUP", "GROUP", "g", "alice", "STREAMS", S, "0"),
    ("XREADGROUP", "GROUP", "g", "bob", "COUNT", "2", "STREAMS", S, "0"),
    ("XREADGROUP", "GROUP", "nope", "bob", "STREAMS", S, ">"),
    ("XREADGROUP", "GROUP", "g", "bob", "STREAMS", S, "$"),
    ("XREADGROUP", "GROUP", "g", "bob", "STREAMS", S),
    ("XPENDING", S, "g"),
    ("XPENDING", S, "g", "-", "+", "10"),
    ("XPENDING", S, "g", "-", "+", "10", "bob"),
    ("XPENDING", S, "g", "(1-1", "+", "10"),
    ("XPENDING", S, "g", "IDLE", "99999999", "-", "+", "10"),
    ("XPENDING", S, "nope"),
    ("XACK", S, "g", "1-1", "9-9"),
    ("XACK", S, "g", "1-1"),
    ("XACK", S, "g", "bad-id"),
    ("XCLAIM", S, "g", "carol", "0", "1-2", "JUSTID"),
    ("XCLAIM", S, "g", "carol", "0", "2-0", "RETRYCOUNT", "7"),
    ("XCLAIM", S, "g", "carol", "99999999", "3-0"),
    ("XCLAIM", S, "g", "carol", "0", "9-9", "FORCE"),
    ("XCLAIM", S, "g", "carol", "0", "1-1", "FORCE", "JUSTID", "LASTID", "5-0"),
    ("XCLAIM", S, "g", "carol", "0", "1-1", "BOGUS"),
    ("XPENDING", S, "g", "-", "+", "10"),
    ("XDEL", S, "2-0"),
    ("XAUTOCLAIM", S, "g", "dave", "0", "0", "COUNT", "1"),
    ("XAUTOCLAIM", S, "g", "dave", "0", "0"),
    ("XAUTOCLAIM", S, "g", "dave", "0", "0", "COUNT", "0"),
    ("XAUTOCLAIM", S, "g", "dave", "0", "0", "JUSTID"),
    ("XREADGROUP", "GROUP", "g", "dave", "STREAMS", S, "0"),
    ("XGROUP", "CREATECONSUMER", S, "g", "erin"),
    ("XGROUP", "CREATECONSUMER", S, "g", "erin"),
    ("XGROUP", "DELCONSUMER", S, "g", "dave"),
    ("XGROUP", "DELCONSUMER", S, "g", "nobody"),
    ("XGROUP", "SETID", S, "g", "0"),
    ("XGROUP", "SETID", S, "nope", "0"),
    ("XREADGROUP", "GROUP", "g", "erin", "NOACK", "STREAMS", S, ">"),
    ("XINFO", "GROUPS", S),
    ("XINFO", "CONSUMERS", S, "g"),
    ("XINFO", "STREAM", S),
    ("XINFO", "STREAM", S, "FULL"),
    ("XINFO", "STREAM", S, "FULL", "COUNT", "1"),
    ("XGROUP", "DESTROY", S, "h"),
    ("XGROUP", "DESTROY", S, "h"),
    ("XSETID", S, "2-5"),
    ("XSETID", S, "9-0", "ENTRIESADDED", "100", "MAXDELETEDID", "8-0"),
    ("XINFO", "STREAM", S),
    ("XSETID", S2, "1-0"),
    ("XADD", S, "MAXLEN", "=", "1", "10-0", "x", "y"),
    ("XINFO", "GROUPS", S),
    ("SET", S2, "string"),
    ("XGROUP", "CREATE", S2, "g", "$"),
    ("XREADGROUP", "GROUP", "g", "a", "STREAMS", S2, ">"),
    ("XINFO", "STREAM", S2),
    ("COPY", S, S2, "REPLACE"),
    ("XINFO", "GROUPS", S2),
    ("XGROUP", "HELP", "extra"),
    ("DEL", S, S2),
]

# Fields of XINFO STREAM whose figures describe Redis's own layout (radix tree nodes), which
# ramlog's (one value per stream) does not have.
LAYOUT = {b"radix-tree-keys", b"radix-tree-nodes"}


def _without_layout(cmd, reply):
    if cmd[:2] == ("XINFO", "STREAM") and isinstance(reply, list):
        out = []
        for k, v in zip(reply[::2], reply[1::2]):
            if k not in LAYOUT:
                out += [k, v]
        return out
    return reply


class Raw:
    """A RESP2 client that returns replies as the server sent them (no client-side parsing):
    lists, bytes, integers, None, and ("error", message)."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.file = self.sock.makefile("rb")

    def call(self, *args):
        out = b"*%d\r\n" % len(args)
        for a in args:
            a = a.encode() if isinstance(a, str) else a
            out += b"$%d\r\n%s\r\n" % (len(a), a)
        self.sock.sendall(out)
        return self.read()

    def read(self):
        line = self.file.readline()[:-2]
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return ("error", rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.file.read(n + 2)[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise AssertionError(f"unexpected reply line {line!r}")

    def close(self):
        self.file.close()
        self.sock.close()


def _session(port):
    raw = Raw(port)
    try:
        return [_without_layout(cmd, _untimed(cmd, raw.call(*cmd))) for cmd in SESSION]
    finally:
        raw.close()


def test_consumer_groups_answer_as_redis_does(blocking_target, redis_peer):  # noqa: F811
    """A session of every consumer-group command and its errors answers as redis-server does
    (but for times and Redis's node counts), on every port."""
    _, port = blocking_target
    want = _session(redis_peer.connection_pool.connection_kwargs["port"])
    got = _session(port)
    for cmd, w, g in zip(SESSION, want, got):
        assert g == w, (cmd, g, w)


def test_a_blocked_xreadgroup_is_served_by_xadd_and_ended_by_a_destroyed_group(blocking_target):  # noqa: F811
    """XREADGROUP BLOCK with `>` waits for a new entry, which it then owns (pending); with
    another id it answers at once; when the group goes, it answers NOGROUP; without a new
    entry it answers nil at its timeout."""
    make, _ = blocking_target
    a, b = make(), make()
    b.delete(S)
    b.xgroup_create(S, "g", id="$", mkstream=True)
    got = []
    th = threading.Thread(target=lambda: got.append(
        a.xreadgroup("g", "alice", {S: ">"}, block=10000)))
    th.start()
    assert wait_until(lambda: blocked_clients(b) >= 1, timeout=10)
    t0 = time.monotonic()
    eid = b.xadd(S, {"f": "v"})
    th.join(timeout=10)
    assert time.monotonic() - t0 < 1.0
    assert got and got[0] in ([[S.encode(), [(eid, {b"f": b"v"})]]], {S.encode(): [[(eid, {b"f": b"v"})]]}), got
    assert b.xpending(S, "g")["pending"] == 1
    # Not `>`: answered at once, even with BLOCK.
    t0 = time.monotonic()
    assert a.xreadgroup("g", "alice", {S: "0"}, block=5000)[0][1] == [(eid, {b"f": b"v"})]
    assert time.monotonic() - t0 < 1.0
    # The group goes while a consumer waits: NOGROUP.
    err = []

    def blocked():
        try:
            a.xreadgroup("g", "bob", {S: ">"}, block=10000)
        except redis.ResponseError as e:
            err.append(str(e))
    th = threading.Thread(target=blocked)
    th.start()
    assert wait_until(lambda: blocked_clients(b) >= 1, timeout=10)
    b.xgroup_destroy(S, "g")
    th.join(timeout=10)
    assert err and err[0].startswith("NOGROUP No such key"), err
    # Nothing new: nil after the timeout.
    b.xgroup_create(S, "g", id="$")
    t0 = time.monotonic()
    assert not a.xreadgroup("g", "alice", {S: ">"}, block=300)
    assert 0.25 <= time.monotonic() - t0 < 3
    b.delete(S)


def test_consumer_groups_survive_a_kill_9_of_a_durable_standalone_server(tmp_path):
    """A stream's groups, consumers and pending entries are part of its value: after kill -9
    and a restart they read back as acknowledged."""
    s = Server(tmp_path, ["--persistence", "durable"])
    c = s.client()
    c.xgroup_create("s", "g", id="$", mkstream=True)
    for i in range(50):
        c.xadd("s", {"n": i})
    c.xreadgroup("g", "alice", {"s": ">"}, count=30)
    c.xreadgroup("g", "bob", {"s": ">"}, count=10)
    c.xack("s", "g", *[e[0] for e in c.xrange("s", count=5)])
    c.xgroup_create("s", "h", id="0")

    def state(cl):
        pending = [(p["message_id"], p["consumer"], p["times_delivered"])
                   for p in cl.xpending_range("s", "g", "-", "+", 100)]
        return (cl.xinfo_groups("s"), pending,
                sorted(x["name"] for x in cl.xinfo_consumers("s", "g")), cl.xlen("s"))
    want = state(c)
    s.proc.kill()
    s.proc.wait()
    s2 = Server(tmp_path, ["--persistence", "durable"])
    try:
        got = state(s2.client())
        assert got == want
        assert len(want[1]) == 35 and want[3] == 50
    finally:
        s2.stop()


def _errorstats(r):
    """CONFIG RESETSTAT, then a NOGROUP and a WRONGTYPE error: INFO errorstats' counts and
    total_error_replies."""
    r.delete(S, S2)
    r.config_resetstat()
    r.set(S2, "v")
    with pytest.raises(redis.ResponseError):
        r.xreadgroup("g", "c", {S: ">"})
    with pytest.raises(redis.ResponseError):
        r.lpush(S2, "x")
    stats = r.info("errorstats")
    total = r.info("stats")["total_error_replies"]
    r.delete(S2)
    return {k: v["count"] for k, v in stats.items()}, total


def test_errorstats_count_error_replies_by_code_as_redis_does(blocking_target, redis_peer):  # noqa: F811
    """INFO errorstats and total_error_replies, started again by CONFIG RESETSTAT, on every port
    as on redis-server."""
    make, _ = blocking_target
    want = _errorstats(redis_peer)
    assert want == ({"errorstat_NOGROUP": 1, "errorstat_WRONGTYPE": 1}, 2), want
    assert _errorstats(make()) == want


def test_randomkey_through_the_routing_port_finds_every_servers_keys(shared_cluster):
    """RANDOMKEY through a routing port picks among every master's keys (not only its own
    server's), and answers nil only when the whole cluster is empty."""
    r = redis.Redis(port=shared_cluster.servers[0].routing, socket_timeout=10)
    keys = [f"rk{i}" for i in range(12)]
    r.delete(*keys)
    for k in keys:
        r.set(k, "v")
    seen = {r.randomkey() for _ in range(300)}
    servers_with_keys = set()
    rc = redis.RedisCluster(host="127.0.0.1", port=shared_cluster.servers[0].resp, socket_timeout=10)
    for k in seen:
        servers_with_keys.add(rc.get_node_from_key(k).port)
    assert len(servers_with_keys) >= 2, (seen, servers_with_keys)
    r.delete(*keys)


def _subcommand_stats(r):
    """CONFIG RESETSTAT, then container commands: INFO commandstats' names and calls."""
    r.delete(S)
    r.config_resetstat()
    r.config_get("maxmemory")
    r.client_id()
    r.client_id()
    r.object("encoding", "nokey")
    r.xgroup_create(S, "g", id="$", mkstream=True)
    r.execute_command("XINFO", "GROUPS", S)
    r.delete(S)
    stats = r.info("commandstats")
    return {k: v["calls"] for k, v in stats.items() if "|" in k}


def test_commandstats_count_subcommands_as_redis_does(blocking_target, redis_peer):  # noqa: F811
    """INFO commandstats counts a container command's call under `command|subcommand`."""
    make, _ = blocking_target
    want = _subcommand_stats(redis_peer)
    assert want["cmdstat_client|id"] == 2 and want["cmdstat_xgroup|create"] == 1, want
    assert _subcommand_stats(make()) == want


def _stream_with_groups(r, key):
    r.delete(key)
    r.xgroup_create(key, "g", id="$", mkstream=True)
    for i in range(250):
        r.xadd(key, {"f": i} if i % 3 else {"other": i, "x": ""}, id=f"{i + 1}-{i % 5}")
    r.xreadgroup("g", "alice", {key: ">"}, count=7)
    r.xreadgroup("g", "bob", {key: ">"}, count=3)
    r.xdel(key, "5-4")
    r.xgroup_create(key, "h", id="0")
    r.xgroup_createconsumer(key, "h", "idle")


def _stream_state(r, key):
    groups = r.xinfo_groups(key)
    pending = {g["name"]: [(p["message_id"], p["consumer"], p["times_delivered"])
                           for p in r.xpending_range(key, g["name"], "-", "+", 1000)] for g in groups}
    consumers = {g["name"]: sorted(c["name"] for c in r.xinfo_consumers(key, g["name"])) for g in groups}
    info = r.xinfo_stream(key)
    return (r.xrange(key), groups, pending, consumers,
            {k: info[k] for k in ("length", "last-generated-id", "max-deleted-entry-id", "entries-added")})


def test_streams_with_groups_move_by_dump_restore_and_from_redis(blocking_target, redis_peer):  # noqa: F811
    """DUMP and RESTORE carry a stream with its groups, consumers and pending entries (RDB type
    21, Redis 7.2's); a stream DUMPed by redis-server (7.0 here: type 19) restores on every port
    to the same entries and groups."""
    make, _ = blocking_target
    r = make()
    key, copy = "{q}dump-s", "{q}dump-t"
    _stream_with_groups(r, key)
    want = _stream_state(r, key)
    payload = r.dump(key)
    assert int.from_bytes(payload[-10:-8], "little") == 11
    r.restore(copy, 0, payload, replace=True)
    assert _stream_state(r, copy) == want
    # From redis-server.
    _stream_with_groups(redis_peer, key)
    theirs = _stream_state(redis_peer, key)
    r.restore(copy, 0, redis_peer.dump(key), replace=True)
    assert _stream_state(r, copy) == theirs
    with pytest.raises(redis.ResponseError, match="BUSYKEY"):
        r.restore(copy, 0, payload)
    r.delete(key, copy)
