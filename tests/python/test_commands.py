"""Every supported command against Redis 7's documented replies, through redis-py (RESP2 and RESP3)."""

import random
import socket
import subprocess
import time

import pytest
import redis
from redis.cluster import RedisCluster

from conftest import ClusterPort, RoutingPort
from test_types import redis_peer  # noqa: F401  (the redis-server fixture)


@pytest.fixture
def server(server_both_ways):
    """Each test runs against a standalone server, the routing port of a cluster and that cluster's
    cluster ports (through RedisCluster and `redis-cli -c`)."""
    return server_both_ways


CROSSSLOT = "CROSSSLOT Keys in request don't hash to the same slot"


def clustered(c):
    """A RedisCluster client, or the cluster ports it was made for."""
    return isinstance(c, RedisCluster) or getattr(c, "is_cluster", False)


def tagged(c, *names):
    """The key names; on the cluster ports with a shared {hash tag}, as Redis Cluster wants the keys
    of one multi-key command, transaction or per-node check in one slot (the routing port takes
    them as they are and splits them by server)."""
    return [f"{{t}}{n}" if clustered(c) else n for n in names]


def anywhere(r):
    """The keyword arguments RedisCluster needs for a keyless command: a node to send it to (a node,
    not RedisCluster.RANDOM, which redis-py honours only for the commands it knows as keyless)."""
    return {"target_nodes": r.get_random_node()} if clustered(r) else {}


def at(r, key):
    """Sends a per-node command (INFO, DBSIZE, FLUSHDB) to the master of `key` on the cluster ports."""
    return {"target_nodes": r.get_node_from_key(key)} if clustered(r) else {}


def everywhere(r):
    """Sends a per-node command to every master on the cluster ports (RedisCluster sums DBSIZE and
    merges KEYS)."""
    return {"target_nodes": RedisCluster.PRIMARIES} if clustered(r) else {}


def mset(r, mapping):
    """MSET; on the cluster ports split by slot (RedisCluster's mset_nonatomic), so that the keys
    spread over every server."""
    return r.mset_nonatomic(mapping) if clustered(r) else r.mset(mapping)


def scan_batches(r, **kwargs):
    """SCAN cursor after cursor until the cursor is 0 again, yielding each batch; on the cluster
    ports on each master in turn (SCAN is per node in Redis Cluster)."""
    for node in r.get_primaries() if clustered(r) else [None]:
        target = {} if node is None else {"target_nodes": node}
        cursor = 0
        rounds = 0
        while True:
            cursor, batch = r.scan(cursor=cursor, **target, **kwargs)
            if node is not None:
                cursor = cursor[node.name]
            yield batch
            rounds += 1
            if cursor == 0:
                break
            assert rounds < 10_000


def port_of(server, key):
    """The RESP port for a raw connection that sends `key`: on the cluster ports its master's."""
    return server.master_port(key) if clustered(server) else server.port


def exchange(port, request, want_len):
    """Sends raw RESP on a new connection and returns the first `want_len` bytes of the replies."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        data = b""
        while len(data) < want_len:
            chunk = s.recv(4096)
            assert chunk, f"connection closed after {data!r}"
            data += chunk
    return data


def test_ping_echo(r):
    assert r.ping() is True
    assert r.echo("hello", **anywhere(r)) == "hello"


def test_get_set_basic(r):
    assert r.get("missing") is None
    assert r.set("k", "v") is True
    assert r.get("k") == "v"
    assert r.set("k", b"\x00\xff binary \r\n") is True
    assert r.strlen("k") == len(b"\x00\xff binary \r\n")


def test_set_conditions(r):
    assert r.set("k", "1", nx=True) is True
    assert r.set("k", "2", nx=True) is None
    assert r.get("k") == "1"
    assert r.set("k", "3", xx=True) is True
    assert r.set("absent", "x", xx=True) is None
    assert r.get("absent") is None
    # GET returns the old value; with NX it does not overwrite (Redis 7).
    assert r.set("k", "4", get=True) == "3"
    assert r.set("k", "5", nx=True, get=True) == "4"
    assert r.get("k") == "4"
    assert r.set("new", "n", nx=True, get=True) is None
    assert r.get("new") == "n"
    assert r.set("absent2", "x", xx=True, get=True) is None
    assert r.get("absent2") is None


def test_set_option_errors(r):
    with pytest.raises(redis.ResponseError, match="^syntax error$"):
        r.execute_command("SET", "k", "v", "NX", "XX")
    with pytest.raises(redis.ResponseError, match="^syntax error$"):
        r.execute_command("SET", "k", "v", "EX", "10", "PX", "100")
    with pytest.raises(redis.ResponseError, match="^syntax error$"):
        r.execute_command("SET", "k", "v", "KEEPTTL", "EX", "10")
    with pytest.raises(redis.ResponseError, match="^syntax error$"):
        r.execute_command("SET", "k", "v", "BOGUS")
    with pytest.raises(redis.ResponseError, match="^value is not an integer or out of range$"):
        r.execute_command("SET", "k", "v", "EX", "ten")
    with pytest.raises(redis.ResponseError, match="^invalid expire time in 'set' command$"):
        r.execute_command("SET", "k", "v", "EX", "0")
    with pytest.raises(redis.ResponseError, match="^wrong number of arguments for 'set' command$"):
        r.execute_command("SET", "k")


def test_set_expiry_options(r):
    assert r.set("ex", "v", ex=100)
    assert 99 <= r.ttl("ex") <= 100
    assert r.set("px", "v", px=100000)
    assert 99000 <= r.pttl("px") <= 100000
    at = int(time.time()) + 500
    assert r.set("exat", "v", exat=at)
    assert 498 <= r.ttl("exat") <= 500
    assert r.expiretime("exat") == at
    assert r.set("pxat", "v", pxat=at * 1000)
    assert r.pexpiretime("pxat") == at * 1000
    # KEEPTTL keeps the expiry; a plain SET clears it.
    assert r.set("ex", "v2", keepttl=True)
    assert r.ttl("ex") > 0
    assert r.set("ex", "v3")
    assert r.ttl("ex") == -1


def test_keys_expire(r):
    assert r.set("short", "v", px=100)
    assert r.get("short") == "v"
    time.sleep(0.25)
    assert r.get("short") is None
    assert r.exists("short") == 0
    assert r.ttl("short") == -2


def test_ttl_expire_persist(r):
    assert r.ttl("missing") == -2
    assert r.pttl("missing") == -2
    r.set("k", "v")
    assert r.ttl("k") == -1
    assert r.expire("k", 100) is True
    assert 99 <= r.ttl("k") <= 100
    assert r.expire("k", 200, nx=True) is False
    assert r.expire("k", 200, gt=True) is True
    assert r.expire("k", 300, lt=True) is False
    assert r.expire("k", 50, lt=True) is True
    assert 49 <= r.ttl("k") <= 50
    assert r.persist("k") is True
    assert r.persist("k") is False
    assert r.ttl("k") == -1
    assert r.expire("missing", 10) is False
    assert r.pexpire("k", 100000) is True
    assert r.expireat("k", int(time.time()) + 1000) is True
    assert r.pexpireat("k", int(time.time() * 1000) + 1000000) is True
    # An expiry in the past deletes the key.
    assert r.expire("k", -1) is True
    assert r.exists("k") == 0
    with pytest.raises(redis.ResponseError, match="^NX and XX, GT or LT options at the same time are not compatible$"):
        r.execute_command("EXPIRE", "k", "10", "NX", "XX")


def test_setnx_setex_getset_getdel_append(r):
    assert r.setnx("a", "1") is True
    assert r.setnx("a", "2") is False
    assert r.setex("b", 100, "v") is True
    assert r.ttl("b") > 0
    assert r.psetex("c", 100000, "v") is True
    with pytest.raises(redis.ResponseError, match="^invalid expire time in 'setex' command$"):
        r.setex("b", 0, "v")
    assert r.getset("a", "3") == "1"
    assert r.getdel("a") == "3"
    assert r.getdel("a") is None
    assert r.append("s", "hello") == 5
    assert r.append("s", " world") == 11
    assert r.get("s") == "hello world"


def test_mget_mset(server, r):
    a, b, c, missing = tagged(r, "a", "b", "{tag}c", "missing")
    assert r.mset({a: "1", b: "2", c: "3"}) is True
    assert r.mget(a, b, missing, c) == ["1", "2", None, "3"]
    with pytest.raises(redis.ResponseError, match="^wrong number of arguments for 'mset' command$"):
        r.execute_command("MSET", a, "1", b)
    with pytest.raises(redis.ResponseError, match="^wrong number of arguments for 'mget' command$"):
        r.execute_command("MGET", **anywhere(r))
    if clustered(server):
        assert server.cli("MSET", "a", "1", "b", "2") == CROSSSLOT
        assert server.cli("MGET", "a", "b") == CROSSSLOT


def test_del_exists(server, r):
    a, b, missing = tagged(r, "a", "b", "missing")
    r.mset({a: "1", b: "2"})
    assert r.exists(a, a, b, missing) == 3
    assert r.delete(a, b, missing) == 2
    assert r.exists(a, b) == 0
    assert r.unlink("nothing") == 0
    if clustered(server):
        assert server.cli("EXISTS", "a", "b") == CROSSSLOT
        assert server.cli("DEL", "a", "b") == CROSSSLOT


def test_incr_family(r):
    assert r.incr("n") == 1
    assert r.incrby("n", 10) == 11
    assert r.decr("n") == 10
    assert r.decrby("n", 4) == 6
    assert r.incrby("n", -10) == -4
    assert r.get("n") == "-4"
    r.set("s", "abc")
    with pytest.raises(redis.ResponseError, match="^value is not an integer or out of range$"):
        r.incr("s")
    r.set("sp", " 1")
    with pytest.raises(redis.ResponseError, match="^value is not an integer or out of range$"):
        r.incr("sp")
    with pytest.raises(redis.ResponseError, match="^value is not an integer or out of range$"):
        r.execute_command("INCRBY", "n", "1.5")
    r.set("max", str(2**63 - 1))
    with pytest.raises(redis.ResponseError, match="^increment or decrement would overflow$"):
        r.incr("max")
    r.set("min", str(-(2**63)))
    with pytest.raises(redis.ResponseError, match="^increment or decrement would overflow$"):
        r.decr("min")
    with pytest.raises(redis.ResponseError, match="^decrement would overflow$"):
        r.execute_command("DECRBY", "n", str(-(2**63)))
    # INCR keeps the key's expiry.
    r.set("e", "1", ex=100)
    r.incr("e")
    assert r.ttl("e") > 0


def test_strlen_type(r):
    r.set("k", "hello")
    assert r.strlen("k") == 5
    assert r.strlen("missing") == 0
    assert r.type("k") == "string"
    assert r.type("missing") == "none"


def test_scan_returns_every_key(r):
    keys = {f"user:{i}" for i in range(500)} | {f"other:{i}" for i in range(100)}
    mset(r, {k: "v" for k in keys})
    seen = set()
    for batch in scan_batches(r, count=37):
        seen.update(batch)
    assert seen == keys
    matched = set(r.scan_iter(match="user:1*", count=50))
    assert matched == {k for k in keys if k.startswith("user:1")}
    assert set(r.scan_iter(match="user:*", _type="STRING")) == {k for k in keys if k.startswith("user:")}
    assert list(r.scan_iter(_type="hash")) == []
    assert r.dbsize(**everywhere(r)) == 600
    assert set(r.keys("other:*", **everywhere(r))) == {k for k in keys if k.startswith("other:")}


def test_scan_guarantee_under_concurrent_writes(server):
    """Keys present for the whole iteration are returned at least once while others come and go."""
    a = server.client(decode_responses=True)
    b = server.client(decode_responses=True)
    stable = {f"stable:{i}" for i in range(2000)}
    mset(a, {k: "v" for k in stable})
    seen = set()
    i = 0
    for batch in scan_batches(a, count=50):
        seen.update(batch)
        # Churn: create and delete other keys between steps (RedisCluster splits DEL by slot).
        mset(b, {f"churn:{i}:{j}": "x" for j in range(20)})
        b.delete(*[f"churn:{i - 1}:{j}" for j in range(20)])
        i += 1
    assert stable <= seen


def test_scan_errors(r):
    with pytest.raises(redis.ResponseError, match="^invalid cursor$"):
        r.execute_command("SCAN", "abc")
    with pytest.raises(redis.ResponseError, match="^syntax error$"):
        r.execute_command("SCAN", "0", "COUNT", "0")
    with pytest.raises(redis.ResponseError, match="^value is not an integer or out of range$"):
        r.execute_command("SCAN", "0", "COUNT", "x")
    with pytest.raises(redis.ResponseError, match="^syntax error$"):
        r.execute_command("SCAN", "0", "MATCH")


def test_unknown_command_and_arity(r):
    with pytest.raises(redis.ResponseError) as e:
        r.execute_command("FOO", "a", "b", **anywhere(r))
    assert str(e.value) == "unknown command 'FOO', with args beginning with: 'a' 'b' "
    with pytest.raises(redis.ResponseError, match="^wrong number of arguments for 'get' command$"):
        r.execute_command("GET", **anywhere(r))
    # The connection goes on.
    assert r.ping() is True


def test_select_flush(r):
    assert r.select(0, **anywhere(r)) is True
    # Redis Cluster has database 0 only.
    refusal = "^SELECT is not allowed in cluster mode$" if clustered(r) else "^DB index is out of range$"
    with pytest.raises(redis.ResponseError, match=refusal):
        r.select(5, **anywhere(r))
    a, b, c = tagged(r, "a", "b", "c")
    r.mset({a: "1", b: "2"})
    assert r.flushdb(**at(r, a)) is True
    assert r.dbsize(**at(r, a)) == 0
    r.set(c, "3")
    assert r.flushall(**at(r, c)) is True
    assert r.get(c) is None


def test_hello_and_client(server):
    c = server.client(protocol=3)
    assert c.ping()
    hello = c.execute_command("HELLO", "3", **anywhere(c))
    hello = {k.decode() if isinstance(k, bytes) else k: v for k, v in hello.items()}
    assert hello["proto"] == 3
    assert hello["server"] in (b"redis", "redis")
    mode = "cluster" if clustered(server) else "standalone"
    assert hello["mode"] in (mode.encode(), mode)
    c2 = server.client(protocol=2)
    flat = c2.execute_command("HELLO", "2", **anywhere(c2))
    assert b"proto" in flat
    with pytest.raises(redis.ResponseError, match="^NOPROTO unsupported protocol version$"):
        c2.execute_command("HELLO", "4", **anywhere(c2))
    assert c2.client_setname("worker-1") is True
    assert c2.client_getname() in (b"worker-1", "worker-1")
    assert isinstance(c2.client_id(), int)
    with pytest.raises(redis.ResponseError, match="^Client names cannot contain spaces, newlines or special characters.$"):
        c2.client_setname("has space")
    with pytest.raises(redis.ResponseError, match="^unknown subcommand 'BOGUS'. Try CLIENT HELP.$"):
        c2.execute_command("CLIENT", "BOGUS", **anywhere(c2))


def test_info_config_command_cluster(server, r):
    r.set("k", "v")
    info = r.info(**at(r, "k"))
    assert info["redis_version"].startswith("7")
    assert info["db0"]["keys"] >= 1
    assert "used_memory" in info and "connected_clients" in info
    # A Redis Cluster node says so; the routing port answers as a standalone Redis.
    assert info["redis_mode"] == ("cluster" if clustered(r) else "standalone")
    assert info["cluster_enabled"] == int(clustered(r))
    assert r.info("keyspace", **at(r, "k"))["db0"]["keys"] >= 1
    assert r.config_get("save") == {"save": ""}
    assert r.config_get("appendonly") == {"appendonly": "no"}
    assert r.config_get("cluster-enabled") == {"cluster-enabled": "yes" if clustered(r) else "no"}
    assert "maxmemory" in r.config_get("max*")
    with pytest.raises(redis.ResponseError, match="^unknown subcommand 'BOGUS'. Try CONFIG HELP.$"):
        r.execute_command("CONFIG", "BOGUS", **anywhere(r))
    assert r.command_count() > 20
    info = r.execute_command("COMMAND", "INFO", "get", **anywhere(r))
    assert info
    assert r.execute_command("CLUSTER", "KEYSLOT", "foo") == 12182
    assert r.execute_command("CLUSTER", "KEYSLOT", "{user1000}.following") == r.execute_command(
        "CLUSTER", "KEYSLOT", "{user1000}.followers"
    )
    slots = r.execute_command("CLUSTER", "SLOTS")
    if clustered(r):
        # Runs of slots, [first, last, [ip, port, id], ...], that cover 0-16383 once, each with
        # its master, and every server masters some.
        runs = sorted(slots)
        assert runs[0][0] == 0 and runs[-1][1] == 16383
        assert all(a[1] + 1 == b[0] for a, b in zip(runs, runs[1:]))
        assert {run[2][1] for run in runs} == {s.resp for s in server.cluster.servers}
    else:
        assert slots[0][0] == 0 and slots[0][1] == 16383


def test_info_keyspace_counts_keys_with_expiry(r):
    # Redis 7: "db0:keys=K,expires=E,avg_ttl=T", E the keys with a time to live, T their mean
    # remaining time in milliseconds.
    # On the cluster ports INFO is per node: the keys share a node.
    plain, a, b, c = tagged(r, "plain", "a", "b", "c")
    r.set(plain, "v")
    r.set(a, "v", ex=100)
    r.set(b, "v", px=300_000)
    r.set(c, "v", ex=1000)
    db0 = r.info("keyspace", **at(r, plain))["db0"]
    assert (db0["keys"], db0["expires"]) == (4, 3)
    # (100 s + 300 s + 1000 s) / 3 = 466.7 s, less what has passed (the sum is kept in seconds).
    assert 460_000 <= db0["avg_ttl"] <= 467_000, db0
    r.persist(a)
    r.set(b, "w")  # a plain SET drops the TTL
    r.set(c, "w", keepttl=True)
    r.delete(plain)
    db0 = r.info("keyspace", **at(r, plain))["db0"]
    assert (db0["keys"], db0["expires"]) == (3, 1)
    assert 995_000 <= db0["avg_ttl"] <= 1_000_000, db0
    r.expire(a, 10)
    r.delete(c)
    db0 = r.info("keyspace", **at(r, plain))["db0"]
    assert (db0["keys"], db0["expires"]) == (2, 1)
    assert 9_000 <= db0["avg_ttl"] <= 10_000, db0
    r.flushall()
    assert "db0" not in r.info("keyspace", **at(r, plain))


def test_expired_keys_leave_dbsize_without_being_read(r):
    # Redis's active expiry removes keys nobody reads; DBSIZE and INFO follow within moments.
    # On the cluster ports DBSIZE and INFO are per node: the keys share a node.
    keys = tagged(r, *(f"t{i}" for i in range(2000)), *(f"keep{i}" for i in range(10)))
    expiring, kept = keys[:2000], keys[2000:]
    node = at(r, kept[0])
    p = r.pipeline(transaction=False)
    for k in expiring:
        p.set(k, "x" * 100, px=200)
    for k in kept:
        p.set(k, "y")
    p.execute()
    assert r.dbsize(**node) == 2010
    deadline = time.time() + 5
    while r.dbsize(**node) > 10 and time.time() < deadline:
        time.sleep(0.05)
    assert r.dbsize(**node) == 10
    db0 = r.info("keyspace", **node)["db0"]
    assert (db0["keys"], db0["expires"]) == (10, 0)
    assert r.get(kept[3]) == "y" and r.get(expiring[3]) is None


def test_pipeline_and_transactionless_batch(r):
    p = r.pipeline(transaction=False)
    for i in range(1000):
        p.set(f"p{i}", i)
    for i in range(1000):
        p.get(f"p{i}")
    out = p.execute()
    assert out[:1000] == [True] * 1000
    assert out[1000:] == [str(i) for i in range(1000)]


def test_large_value_and_limits(r):
    value = "x" * (1024 * 1024)
    assert r.set("big", value) is True
    assert r.strlen("big") == len(value)
    with pytest.raises(redis.ResponseError, match="^value too large"):
        r.set("big", value + "y")
    with pytest.raises(redis.ResponseError, match="^key too large"):
        r.set("k" * (64 * 1024 + 1), "v")
    assert r.ping() is True


def test_redis_cli(server):
    # On the cluster ports the keys share a slot and redis-cli talks to its master (`-p` again
    # overrides the first): MSET and MGET need one slot, and DBSIZE, --scan and --pipe are per node.
    k, a, b, c, x, ab = tagged(server, "k", "a", "b", "c", "x", "[ab]")
    port = port_of(server, k)

    def cli(*args, stdin=None):
        return server.cli(*args, stdin=stdin, extra=("-p", str(port)))

    assert cli("PING") == "PONG"
    assert cli("SET", k, "v") == "OK"
    assert cli("GET", k) == "v"
    assert cli("GET", "missing") == ""
    assert cli("INCR", k) == "ERR value is not an integer or out of range"
    assert cli("FOO", "a") == "ERR unknown command 'FOO', with args beginning with: 'a' "
    if clustered(server):
        assert cli("MSET", "a", "1", "b", "2") == CROSSSLOT
    assert cli("MSET", a, "1", b, "2") == "OK"
    assert cli("MGET", a, b, c) == "1\n2"
    assert cli("DBSIZE") == "3"
    assert sorted(cli("--scan").split("\n")) == [a, b, k]
    assert sorted(cli("--scan", "--pattern", ab).split("\n")) == [a, b]
    assert cli("-3", "--no-raw", "HELLO", "3").startswith('1# "server" => "redis"')
    # A batch through stdin, as redis-cli scripts do.
    assert cli(stdin=f"SET {x} 1\nINCRBY {x} 41\nGET {x}\n") == "OK\n42\n42"
    # Pipe mode with raw protocol.
    pks = tagged(server, *(f"pk{i}" for i in range(1000)))
    proto = "".join(f"*3\r\n$3\r\nSET\r\n${len(pk)}\r\n{pk}\r\n$1\r\nv\r\n" for pk in pks)
    out = cli("--pipe", stdin=proto)
    assert "errors: 0, replies: 1000" in out
    assert cli("EXISTS", pks[0], pks[999]) == "2"


def test_shutdown_command_stops_the_server(make_server):
    s = make_server()
    assert s.cli("SET", "k", "v") == "OK"
    s.cli("SHUTDOWN", "NOSAVE")
    s.proc.wait(timeout=10)
    assert s.proc.returncode == 0


def test_multi_exec_and_default_redis_py_pipeline(server, r):
    # MULTI ... EXEC: redis-py's default; RedisCluster's needs transaction=True (and one slot).
    p = r.pipeline(transaction=True)
    a, missing = tagged(r, "a", "missing")
    # MGET by name: RedisCluster's pipeline refuses its mget().
    p.set(a, "1").incr(a).get(a).execute_command("MGET", a, missing)
    # RedisCluster's transactions leave SET's +OK unparsed.
    ok = "OK" if clustered(r) else True
    assert p.execute() == [ok, 2, "2", ["2", None]]
    with pytest.raises(redis.ResponseError, match="^EXEC without MULTI$"):
        r.execute_command("EXEC", **anywhere(r))
    with pytest.raises(redis.ResponseError, match="^DISCARD without MULTI$"):
        r.execute_command("DISCARD", **anywhere(r))
    if clustered(r):
        # Redis Cluster refuses a queued command whose keys span slots, and EXEC aborts.
        want = b"+OK\r\n-" + CROSSSLOT.encode() + b"\r\n-EXECABORT Transaction discarded because of previous errors.\r\n"
        assert exchange(server.port, b"MULTI\r\nMSET a 1 b 2\r\nEXEC\r\n", len(want)) == want


def test_shutdown_inside_multi_is_refused_and_aborts_exec(server, r):
    # Redis 7's "MULTI with SHUTDOWN": the command is refused, EXEC aborts, the server lives on.
    r.delete("foo")
    s = socket.create_connection(("127.0.0.1", port_of(server, "foo")), timeout=5)
    s.sendall(b"MULTI\r\nSET foo bar\r\nSHUTDOWN\r\nEXEC\r\nGET foo\r\nPING\r\n")
    want = (
        b"+OK\r\n+QUEUED\r\n"
        b"-ERR Command not allowed inside a transaction\r\n"
        b"-EXECABORT Transaction discarded because of previous errors.\r\n"
        b"$-1\r\n+PONG\r\n"
    )
    data = b""
    while len(data) < len(want):
        chunk = s.recv(4096)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    assert data == want
    assert r.ping()


def test_multi_queueing_errors_abort_exec(server):
    s = socket.create_connection(("127.0.0.1", port_of(server, "k")), timeout=5)
    s.sendall(b"MULTI\r\nSET k v\r\nNOSUCH x\r\nGET\r\nEXEC\r\nGET k\r\nMULTI\r\nMULTI\r\nSET k w\r\nDISCARD\r\nGET k\r\n")
    want = (
        b"+OK\r\n+QUEUED\r\n"
        b"-ERR unknown command 'NOSUCH', with args beginning with: 'x' \r\n"
        b"-ERR wrong number of arguments for 'get' command\r\n"
        b"-EXECABORT Transaction discarded because of previous errors.\r\n"
        b"$-1\r\n"
        b"+OK\r\n-ERR MULTI calls can not be nested\r\n+QUEUED\r\n+OK\r\n$-1\r\n"
    )
    data = b""
    while len(data) < len(want):
        chunk = s.recv(4096)
        assert chunk
        data += chunk
    assert data == want
    s.close()


def test_getrange_getex(r):
    r.set("s", "This is a string")
    assert r.getrange("s", 0, 3) == "This"
    assert r.getrange("s", -3, -1) == "ing"
    assert r.getrange("s", 0, -1) == "This is a string"
    assert r.getrange("s", 10, 100) == "string"
    assert r.getrange("s", 5, 3) == ""
    assert r.getrange("s", -1, -5) == ""
    assert r.getrange("missing", 0, -1) == ""
    with pytest.raises(redis.ResponseError, match="^value is not an integer or out of range$"):
        r.execute_command("GETRANGE", "s", "a", "1")
    assert r.getex("s", ex=100) == "This is a string"
    assert 99 <= r.ttl("s") <= 100
    assert r.getex("s", persist=True) == "This is a string"
    assert r.ttl("s") == -1
    assert r.getex("s") == "This is a string"
    assert r.getex("missing", ex=10) is None
    with pytest.raises(redis.ResponseError, match="^syntax error$"):
        r.execute_command("GETEX", "s", "EX", "10", "PX", "10")
    with pytest.raises(redis.ResponseError, match="^invalid expire time in 'getex' command$"):
        r.execute_command("GETEX", "s", "EX", "0")


def _reply(client, cmd):
    try:
        return client.execute_command(*cmd)
    except redis.ResponseError as e:
        return ("error", str(e))


def _answers_as_redis(server, redis_peer, protocol, setup, commands, final_keys):
    """Runs `setup` then `commands` on ramlog and on redis-server with the same protocol and
    returns the differences: replies, then each of `final_keys`' type, value and TTL. Through the
    routing port and on the cluster ports the keys share a {hash tag} (one slot)."""
    tag = "{t}" if isinstance(server, RoutingPort) else ""
    ours = server.client(protocol=protocol)
    theirs = redis.Redis(port=redis_peer.connection_pool.connection_kwargs["port"], protocol=protocol,
                         socket_timeout=10)
    theirs.flushall()

    def tagged_cmd(cmd):
        names = set(final_keys) | {"missing", "missing2"}
        return [f"{tag}{a}" if a in names else a for a in cmd]

    for cmd in setup:
        assert _reply(ours, tagged_cmd(cmd)) == _reply(theirs, tagged_cmd(cmd)), cmd
    diffs = []
    for cmd in commands:
        cmd = tagged_cmd(cmd)
        want = _reply(theirs, cmd)
        if clustered(server) and "wrong number of arguments" in str(want):
            continue  # RedisCluster finds no keys in it to route by
        got = _reply(ours, cmd)
        if got != want:
            diffs.append((cmd, want, got))
    for k in final_keys:
        key = f"{tag}{k}"
        kind = theirs.type(key)
        if ours.type(key) != kind or (kind == b"string" and ours.get(key) != theirs.get(key)):
            diffs.append(("final", key, kind, theirs.get(key) if kind == b"string" else None, ours.type(key)))
        if ours.ttl(key) != theirs.ttl(key):
            diffs.append(("ttl", key, theirs.ttl(key), ours.ttl(key)))
    ours.close()
    theirs.close()
    return diffs


BIT_STRINGS = {
    "mix": b"\x00\xff\xf0",
    "ones": b"\xff\xff\xff",
    "zeros": b"\x00\x00",
    "short": b"\xf0",
    "long": b"\x0f\xaa\x55\xff\x01",
    "e": b"",
    "a": b"ohmytext",
    "b": b"mynewtext",
}
BIT_SETUP = [["SET", k, v] for k, v in BIT_STRINGS.items()] + [["RPUSH", "l", "x"]]


@pytest.mark.parametrize("protocol", [2, 3], ids=["resp2", "resp3"])
def test_lcs_answers_as_redis_does(server, redis_peer, protocol):
    """LCS plain, LEN, IDX (MINMATCHLEN, WITHMATCHLEN), empty and absent keys, a list, and option
    errors: every reply as redis-server's, RESP2 and RESP3; then random strings with IDX."""
    commands = [
        ["LCS", "a", "b"], ["LCS", "a", "b", "LEN"], ["LCS", "a", "b", "IDX"],
        ["LCS", "a", "b", "IDX", "MINMATCHLEN", "4"],
        ["LCS", "a", "b", "idx", "minmatchlen", "4", "withmatchlen"],
        ["LCS", "a", "b", "WITHMATCHLEN", "IDX"], ["LCS", "a", "b", "IDX", "MINMATCHLEN", "-3", "WITHMATCHLEN"],
        ["LCS", "b", "a", "IDX", "WITHMATCHLEN"], ["LCS", "a", "a", "IDX", "WITHMATCHLEN"],
        ["LCS", "a", "b", "MINMATCHLEN", "2"], ["LCS", "a", "b", "LEN", "MINMATCHLEN", "2", "WITHMATCHLEN"],
        ["LCS", "a", "e"], ["LCS", "e", "a", "IDX"], ["LCS", "e", "e", "LEN"],
        ["LCS", "a", "missing"], ["LCS", "missing", "a", "IDX", "WITHMATCHLEN"],
        ["LCS", "missing", "missing2"], ["LCS", "missing", "missing2", "LEN"],
        ["LCS", "missing", "missing2", "IDX"],
        ["LCS", "mix", "long", "IDX", "WITHMATCHLEN"], ["LCS", "mix", "long"],
        ["LCS", "a", "l"], ["LCS", "l", "a", "LEN"], ["LCS", "l", "missing"], ["LCS", "a", "l", "FOO"],
        ["LCS", "a", "b", "FOO"], ["LCS", "a", "b", "LEN", "IDX"], ["LCS", "a", "b", "IDX", "LEN"],
        ["LCS", "a", "b", "IDX", "MINMATCHLEN", "x"], ["LCS", "a", "b", "IDX", "MINMATCHLEN"],
        ["LCS", "a"],
    ]
    rng = random.Random(7)
    setup = list(BIT_SETUP)
    for i in range(40):
        x = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 25)))
        y = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 25)))
        setup += [["SET", f"x{i}", x], ["SET", f"y{i}", y]]
        commands.append(["LCS", f"x{i}", f"y{i}", "IDX", "WITHMATCHLEN", "MINMATCHLEN", str(i % 3)])
        commands.append(["LCS", f"x{i}", f"y{i}"])
    keys = [*BIT_STRINGS, "l"] + [f"{p}{i}" for i in range(40) for p in "xy"]
    assert _answers_as_redis(server, redis_peer, protocol, setup, commands, keys) == []


@pytest.mark.parametrize("protocol", [2, 3], ids=["resp2", "resp3"])
def test_bitop_answers_as_redis_does(server, redis_peer, protocol):
    """BITOP AND/OR/XOR/NOT over strings of different lengths and absent keys; the destination
    replaced whatever it held (a list, a key with a TTL) and deleted by an empty result; NOT with
    more than one key, an unknown operation and a list among the sources refused."""
    setup = BIT_SETUP + [["RPUSH", "dl", "x"], ["SET", "dt", "v", "EX", "1000"], ["SET", "de", "v"]]
    commands = []
    for op in ["AND", "OR", "XOR", "and", "Or"]:
        for sources in [["short", "long"], ["long", "short"], ["mix", "long", "short"], ["short", "missing"],
                        ["missing", "long"], ["a"], ["a", "b", "ones"], ["e", "short"]]:
            commands += [["BITOP", op, "dest", *sources], ["GET", "dest"]]
    for source in ["long", "ones", "zeros", "short", "a"]:
        commands += [["BITOP", "NOT", "dest", source], ["GET", "dest"]]
    commands += [
        ["BITOP", "OR", "dl", "short"], ["TYPE", "dl"], ["GET", "dl"],
        ["BITOP", "AND", "dt", "long", "mix"], ["TTL", "dt"], ["GET", "dt"],
        ["BITOP", "OR", "de", "missing", "missing2"], ["EXISTS", "de"],
        ["BITOP", "AND", "dest", "e", "e"], ["EXISTS", "dest"],
        ["BITOP", "NOT", "dest", "long"], ["BITOP", "NOT", "dest", "missing"], ["EXISTS", "dest"],
        ["BITOP", "XOR", "zeros", "zeros", "long"], ["GET", "zeros"],
        ["BITOP", "NOT", "dest", "a", "b"], ["BITOP", "not", "dest", "a", "missing"],
        ["BITOP", "FOO", "dest", "a"], ["BITOP", "AND", "dest", "a", "l"], ["BITOP", "NOT", "dest", "l"],
        ["BITOP", "FOO", "dest", "l"], ["BITOP", "AND", "dest"], ["EXISTS", "dest"],
    ]
    keys = [*BIT_STRINGS, "l", "dest", "dl", "dt", "de"]
    assert _answers_as_redis(server, redis_peer, protocol, setup, commands, keys) == []


@pytest.mark.parametrize("protocol", [2, 3], ids=["resp2", "resp3"])
def test_bitpos_answers_as_redis_does(server, redis_peer, protocol):
    """BITPOS for bit 0 and 1 over strings of ones, zeros and both, empty and absent keys, with
    start and end (negative, past the end, reversed) in BYTE and BIT units, and its errors."""
    ranges = [[], ["0"], ["1"], ["-1"], ["2"], ["5"], ["-100"], ["0", "-1"], ["1", "1"], ["-2", "-1"],
              ["2", "1"], ["0", "-100"], ["-100", "100"], ["5", "10"], ["0", "0", "BYTE"], ["1", "-1", "byte"],
              ["0", "-1", "BIT"], ["3", "5", "BIT"], ["9", "22", "bit"], ["-5", "-1", "BIT"], ["7", "7", "BIT"],
              ["0", "100", "BIT"], ["12", "3", "BIT"], ["-100", "-20", "BIT"], ["8", "15", "BIT"],
              ["16", "-1", "BIT"], ["1", "0", "BIT"], ["17", "19", "BIT"]]
    commands = [["BITPOS", key, bit, *r] for key in [*BIT_STRINGS, "missing"] for bit in "01" for r in ranges]
    commands += [
        ["BITPOS", "mix", "2"], ["BITPOS", "mix", "x"], ["BITPOS", "l", "1"], ["BITPOS", "l", "2"],
        ["BITPOS", "l", "0", "x"], ["BITPOS", "missing", "2"], ["BITPOS", "missing", "0", "a", "b", "c", "d"],
        ["BITPOS", "mix", "1", "x"], ["BITPOS", "mix", "1", "0", "x"], ["BITPOS", "mix", "1", "x", "1", "FOO"],
        ["BITPOS", "mix", "1", "0", "x", "FOO"], ["BITPOS", "mix", "1", "0", "1", "FOO"],
        ["BITPOS", "mix", "1", "0", "1", "BIT", "x"], ["BITPOS", "mix"],
    ]
    keys = [*BIT_STRINGS, "l"]
    assert _answers_as_redis(server, redis_peer, protocol, BIT_SETUP, commands, keys) == []


def test_lcs_bitop_bitpos_over_keys_of_several_slots(shared_cluster):
    """Keys of several slots: the routing port serves LCS and BITOP when one server masters all
    their slots (as a standalone Redis would) and answers -CROSSSLOT when they are on several
    servers; a cluster port answers -CROSSSLOT even for slots it masters all of (as Redis
    Cluster), and serves keys with one {hash tag}."""
    routing = RoutingPort(shared_cluster).client()
    routing.flushall()
    finder = ClusterPort(shared_cluster).client()
    masters = {}
    for n in range(200):
        masters.setdefault(finder.get_node_from_key(f"k{n}").port, []).append(f"k{n}")
    finder.close()
    assert len(masters) == 3
    (port, here), elsewhere = next(iter(masters.items())), list(masters.values())[1]
    a, b, dest = here[:3]
    far = elsewhere[0]
    routing.set(a, "ohmytext")
    routing.set(b, "mynewtext")
    routing.set(far, "text")
    assert routing.execute_command("LCS", a, b) == b"mytext"
    assert routing.execute_command("LCS", a, b, "LEN") == 6
    assert routing.execute_command("BITOP", "OR", dest, a, b) == 9
    assert routing.get(dest) == bytes(x | y for x, y in zip(b"ohmytext\0", b"mynewtext"))
    assert routing.execute_command("BITPOS", a, 1, 2, -1) == 17
    for cmd in [["LCS", a, far], ["BITOP", "AND", dest, a, far], ["BITOP", "AND", far, a, b]]:
        with pytest.raises(redis.exceptions.ClusterCrossSlotError, match="^Keys in request don't hash to the same slot$"):
            routing.execute_command(*cmd)

    def direct(*args):
        out = subprocess.run(["redis-cli", "-p", str(port), *map(str, args)], capture_output=True, text=True,
                             timeout=30)
        return out.stdout.rstrip("\n")

    for cmd in [["LCS", a, b], ["BITOP", "XOR", dest, a, b], ["BITOP", "NOT", dest, b]]:
        assert direct(*cmd) == CROSSSLOT
    assert direct("LCS", far, far).startswith("MOVED ")
    assert direct("LCS", a, a) == "ohmytext"
    assert direct("BITPOS", a, 0) == "0"
    cluster = ClusterPort(shared_cluster).client()
    cluster.set("{t}a", "ohmytext")
    cluster.set("{t}b", "mynewtext")
    assert cluster.execute_command("LCS", "{t}a", "{t}b", "IDX", "MINMATCHLEN", "4") == \
        [b"matches", [[[4, 7], [5, 8]]], b"len", 6]
    assert cluster.execute_command("BITOP", "AND", "{t}d", "{t}a", "{t}b") == 9
    assert cluster.get("{t}d") == bytes(x & y for x, y in zip(b"ohmytext\0", b"mynewtext"))
    cluster.close()
    routing.close()
