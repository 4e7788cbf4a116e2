"""The collection types (hashes, lists, sets, sorted sets): replies compared with a real
redis-server under the same random command sequences, the types through the routing and cluster
ports, strings that begin with the typed-value tag byte, and collections through a master's kill -9."""

import random
import shutil
import socket
import subprocess
import threading
import time

import pytest
import redis
from redis.cluster import RedisCluster

from conftest import Server, free_port, ramlog_bin, wait_until

KEYS = ["h1", "h2", "l1", "l2", "s1", "s2", "z1", "z2", "str"]
WORDS = ["a", "b", "c", "d", "e", "10", "-3", "2.5", "", "x y"]

# Commands whose replies list a set's members: compared as sorted lists (Redis keeps small
# integer sets sorted and others in insertion order; ramlog keeps insertion order).
UNORDERED = {"smembers", "sinter", "sunion", "sdiff", "hkeys", "hvals", "hgetall", "sscan", "hscan"}


def word():
    return random.choice(WORDS)


def score():
    return random.choice(["1", "2", "2.5", "-1", "0", "(1", "+inf", "-inf", "3e2", "bad"])


def index():
    return str(random.randint(-5, 5))


def random_command():
    """One command of the four collection families (or a string command on any key)."""
    k = random.choice(KEYS)
    k2 = random.choice(KEYS)
    w = word
    choices = [
        lambda: ["HSET", k, w(), w()] + ([w(), w()] if random.random() < 0.5 else []),
        lambda: ["HSETNX", k, w(), w()],
        lambda: ["HGET", k, w()],
        lambda: ["HMGET", k, w(), w()],
        lambda: ["HGETALL", k],
        lambda: ["HDEL", k, w(), w()],
        lambda: ["HLEN", k],
        lambda: ["HEXISTS", k, w()],
        lambda: ["HSTRLEN", k, w()],
        lambda: ["HINCRBY", k, w(), random.choice(["1", "-2", "x", "9223372036854775807"])],
        lambda: ["HINCRBYFLOAT", k, w(), random.choice(["1.5", "-0.25", "x", "10"])],
        lambda: ["HKEYS", k],
        lambda: ["HVALS", k],
        lambda: ["LPUSH", k, w(), w()],
        lambda: ["RPUSH", k, w()],
        lambda: ["LPUSHX", k, w()],
        lambda: ["RPUSHX", k, w()],
        lambda: ["LPOP", k] + ([str(random.randint(0, 3))] if random.random() < 0.5 else []),
        lambda: ["RPOP", k] + ([str(random.randint(0, 3))] if random.random() < 0.5 else []),
        lambda: ["LLEN", k],
        lambda: ["LRANGE", k, index(), index()],
        lambda: ["LINDEX", k, index()],
        lambda: ["LSET", k, index(), w()],
        lambda: ["LREM", k, str(random.randint(-2, 2)), w()],
        lambda: ["LTRIM", k, index(), index()],
        lambda: ["LINSERT", k, random.choice(["BEFORE", "AFTER"]), w(), w()],
        lambda: ["LPOS", k, w()] + random.choice([[], ["RANK", "-1"], ["COUNT", "0"], ["RANK", "2", "COUNT", "2"], ["MAXLEN", "2"]]),
        lambda: ["LMOVE", k, k2, random.choice(["LEFT", "RIGHT"]), random.choice(["LEFT", "RIGHT"])],
        lambda: ["RPOPLPUSH", k, k2],
        lambda: ["SADD", k, w(), w()],
        lambda: ["SREM", k, w()],
        lambda: ["SMEMBERS", k],
        lambda: ["SISMEMBER", k, w()],
        lambda: ["SMISMEMBER", k, w(), w()],
        lambda: ["SCARD", k],
        lambda: ["SMOVE", k, k2, w()],
        lambda: ["SINTER", k, k2],
        lambda: ["SUNION", k, k2],
        lambda: ["SDIFF", k, k2],
        lambda: ["SINTERSTORE", random.choice(KEYS), k, k2],
        lambda: ["SUNIONSTORE", random.choice(KEYS), k, k2],
        lambda: ["SDIFFSTORE", random.choice(KEYS), k, k2],
        lambda: ["ZADD", k] + random.choice([[], ["NX"], ["XX"], ["GT"], ["LT"], ["CH"], ["XX", "CH"], ["GT", "CH"]]) + [score(), w()],
        lambda: ["ZADD", k, "INCR", score(), w()],
        lambda: ["ZINCRBY", k, score(), w()],
        lambda: ["ZSCORE", k, w()],
        lambda: ["ZMSCORE", k, w(), w()],
        lambda: ["ZCARD", k],
        lambda: ["ZCOUNT", k, score(), score()],
        lambda: ["ZLEXCOUNT", k, random.choice(["-", "[b", "(a"]), random.choice(["+", "[d", "(c"])],
        lambda: ["ZRANK", k, w()],
        lambda: ["ZREVRANK", k, w()],
        lambda: ["ZREM", k, w(), w()],
        lambda: ["ZRANGE", k, index(), index()] + random.choice([[], ["WITHSCORES"], ["REV"], ["REV", "WITHSCORES"]]),
        lambda: ["ZRANGE", k, score(), score(), "BYSCORE"] + random.choice([[], ["REV"], ["LIMIT", "1", "2"], ["WITHSCORES"]]),
        lambda: ["ZRANGE", k, random.choice(["-", "[b", "(a"]), random.choice(["+", "[d", "(c"]), "BYLEX"] + random.choice([[], ["LIMIT", "0", "1"]]),
        lambda: ["ZREVRANGE", k, index(), index()] + random.choice([[], ["WITHSCORES"]]),
        lambda: ["ZRANGEBYSCORE", k, score(), score()] + random.choice([[], ["WITHSCORES"], ["LIMIT", "0", "2"]]),
        lambda: ["ZREVRANGEBYSCORE", k, score(), score()],
        lambda: ["ZRANGEBYLEX", k, random.choice(["-", "[b"]), random.choice(["+", "(d"])],
        lambda: ["ZREVRANGEBYLEX", k, random.choice(["+", "[d"]), random.choice(["-", "(a"])],
        lambda: ["ZRANGESTORE", random.choice(KEYS), k, index(), index()],
        lambda: ["ZREMRANGEBYRANK", k, index(), index()],
        lambda: ["ZREMRANGEBYSCORE", k, score(), score()],
        lambda: ["ZREMRANGEBYLEX", k, random.choice(["-", "[b"]), random.choice(["+", "(d"])],
        lambda: ["ZPOPMIN", k] + ([str(random.randint(0, 3))] if random.random() < 0.5 else []),
        lambda: ["ZPOPMAX", k] + ([str(random.randint(0, 3))] if random.random() < 0.5 else []),
        lambda: ["TYPE", k],
        lambda: ["EXISTS", k],
        lambda: ["GET", k],
        lambda: ["SET", k, w()],
        lambda: ["APPEND", k, w()],
        lambda: ["INCR", k],
        lambda: ["STRLEN", k],
        lambda: ["GETRANGE", k, "0", "-1"],
        lambda: ["MGET", k, k2],
        lambda: ["DEL", k],
        lambda: ["EXPIRE", k, "100"],
        lambda: ["TTL", k],
        lambda: ["RENAME", k, k2],
        lambda: ["RENAMENX", k, k2],
        lambda: ["COPY", k, k2] + random.choice([[], ["REPLACE"]]),
        lambda: ["INCRBYFLOAT", k, random.choice(["1.5", "-2", "x", "1e3"])],
        lambda: ["SETRANGE", k, str(random.randint(0, 6)), w()],
        lambda: ["GETBIT", k, str(random.randint(0, 40))],
        lambda: ["SETBIT", k, str(random.randint(0, 40)), random.choice(["0", "1"])],
        lambda: ["BITCOUNT", k] + random.choice([[], ["0", "-1"], ["1", "2", "BYTE"], ["3", "17", "BIT"]]),
        lambda: ["XADD", k] + random.choice([[], ["MAXLEN", "3"], ["MAXLEN", "=", "2"], ["NOMKSTREAM"]])
        + [random.choice(["1-1", "2-*", "3", f"{random.randint(1, 9)}-{random.randint(0, 3)}", "0-0", "x"]), w(), w()],
        lambda: ["XLEN", k],
        lambda: ["XRANGE", k, random.choice(["-", "2", "(1-1"]), random.choice(["+", "5", "(9-0"])] + random.choice([[], ["COUNT", "2"]]),
        lambda: ["XREVRANGE", k, random.choice(["+", "5"]), random.choice(["-", "2"])] + random.choice([[], ["COUNT", "1"]]),
        lambda: ["XDEL", k, f"{random.randint(1, 9)}-{random.randint(0, 3)}"],
        lambda: ["XTRIM", k, random.choice(["MAXLEN", "MINID"]), str(random.randint(0, 5))],
        lambda: ["XREAD", "COUNT", "2", "STREAMS", k, random.choice(["0-0", "3-0", "$"])],
    ]
    # Collections far more often than strings, so that the types grow.
    return random.choice(choices)()


def reply_of(client, cmd):
    try:
        out = client.execute_command(*cmd)
    except redis.ResponseError as e:
        return ("error", str(e))
    except ValueError as e:
        # redis-py's reply parsing failed: compare that too (both sides must fail alike).
        return ("unparsable", str(e))
    if cmd[0].lower() in UNORDERED:
        if isinstance(out, list) and len(out) == 2 and isinstance(out[1], list) and cmd[0].lower().endswith("scan"):
            return sorted(map(repr, out[1]))
        if isinstance(out, (list, set)):
            return sorted(map(repr, out))
        if isinstance(out, dict):
            return sorted(map(repr, out.items()))
    return out


@pytest.fixture
def redis_peer(tmp_path):
    if not shutil.which("redis-server"):
        pytest.fail("redis-server is not installed (scripts/test installs it)")
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=10)
    assert wait_until(lambda: _pings(client), timeout=10)
    yield client
    proc.terminate()
    proc.wait(timeout=10)


def _pings(client):
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


@pytest.mark.parametrize("protocol", [2, 3], ids=["resp2", "resp3"])
@pytest.mark.parametrize("seed", [1, 2])
def test_random_commands_answer_as_redis_does(server_both_ways, redis_peer, seed, protocol):
    """3 000 random commands of the four collection types (and string commands on the same
    keys), sent to ramlog and to redis-server: every reply is the same. Runs on a standalone
    server, through the routing port, and on the cluster ports (all keys in one slot there)."""
    random.seed(seed)
    ours = server_both_ways.client(protocol=protocol)
    redis_peer = redis.Redis(port=redis_peer.connection_pool.connection_kwargs["port"], protocol=protocol, socket_timeout=10)
    # On a cluster (either port) multi-key commands need their keys in one slot: one hash tag.
    tag = "" if isinstance(server_both_ways, Server) else "{t}"
    mismatches = []
    for step in range(3000):
        cmd = random_command()
        # Keys get the shared hash tag on the cluster ports (multi-key commands need one slot).
        cmd = [f"{tag}{a}" if a in KEYS else a for a in cmd]
        want = reply_of(redis_peer, cmd)
        got = reply_of(ours, cmd)
        if got != want:
            mismatches.append((step, cmd, want, got))
            if len(mismatches) >= 5:
                break
    assert not mismatches, mismatches
    # The final contents agree too.
    for k in KEYS:
        key = f"{tag}{k}"
        kind = redis_peer.type(key)
        assert ours.type(key) == kind, key
        if kind == b"hash":
            assert ours.hgetall(key) == redis_peer.hgetall(key)
        elif kind == b"list":
            assert ours.lrange(key, 0, -1) == redis_peer.lrange(key, 0, -1)
        elif kind == b"set":
            assert ours.smembers(key) == redis_peer.smembers(key)
        elif kind == b"zset":
            assert ours.zrange(key, 0, -1, withscores=True) == redis_peer.zrange(key, 0, -1, withscores=True)


def test_collections_survive_a_kill_9_of_a_durable_standalone_server(tmp_path):
    """Every acknowledged change of a collection is in the persistence log: after kill -9 and a
    restart the collections read back as they were, expiry included."""
    s = Server(tmp_path, ["--persistence", "durable"])
    c = s.client()
    for i in range(300):
        c.hset("h", f"f{i}", i)
        c.rpush("l", i)
        c.sadd("s", i % 50)
        c.zadd("z", {f"m{i % 40}": i})
    c.hdel("h", "f0")
    c.lpop("l")
    c.srem("s", 0)
    c.zrem("z", "m0")
    c.expire("h", 1000)
    # Pipelined pushes and pops of one list (run together as one command each run).
    p = c.pipeline(transaction=False)
    for i in range(500):
        p.lpush("pl", f"x{i}")
    for i in range(120):
        p.rpop("pl")
    replies = p.execute()
    assert replies[:500] == list(range(1, 501)) and replies[500:] == [f"x{i}".encode() for i in range(120)]
    want = (c.hgetall("h"), c.lrange("l", 0, -1), c.smembers("s"), c.zrange("z", 0, -1, withscores=True),
            c.lrange("pl", 0, -1))
    assert len(want[4]) == 380
    s.proc.kill()
    s.proc.wait()
    s2 = Server(tmp_path, ["--persistence", "durable"])
    try:
        c2 = s2.client()
        got = (c2.hgetall("h"), c2.lrange("l", 0, -1), c2.smembers("s"), c2.zrange("z", 0, -1, withscores=True),
               c2.lrange("pl", 0, -1))
        assert got == want
        assert len(want[0]) == 299 and len(want[1]) == 299 and len(want[2]) == 49 and len(want[3]) == 39
        assert 900 < c2.ttl("h") <= 1000
    finally:
        s2.stop()


def test_writes_keep_the_expiry_and_collections_stay_within_the_value_limit(make_server, tmp_path):
    config = tmp_path / "small-values.toml"
    config.write_text('value_size_max_bytes = "4KiB"\n')
    s = make_server("--config", str(config))
    c = s.client()
    c.hset("h", "a", "1")
    c.expire("h", 100)
    c.hset("h", "b", "2")
    c.hincrby("h", "a", 5)
    assert 90 < c.ttl("h") <= 100
    # A hash past half the value size limit takes the large form (buckets of its own): no such
    # limit for hashes and sets; one field and value larger than an object may be are refused.
    big = {f"f{i}".encode(): bytes([65 + i]) * 1000 for i in range(20)}
    assert c.hset("bigh", mapping=big) == 20
    assert c.object("encoding", "bigh") == b"hashtable" and c.hgetall("bigh") == big
    with pytest.raises(redis.ResponseError, match="more than the value size limit"):
        c.hset("bigh", mapping={"ok": "1", "huge": b"x" * 5000})
    assert c.hgetall("bigh") == big
    with pytest.raises(redis.ResponseError, match="more than the value size limit"):
        c.hset("bigh2", mapping={f"f{i}": b"x" * 1000 for i in range(3)} | {"huge": b"x" * 5000})
    assert c.exists("bigh2") == 0
    # Three fields of 1 500 bytes whose bucket would pass 4 KiB: the table grows until each fits.
    wide = {f"w{i}".encode(): b"w" * 1500 for i in range(40)}
    for f, v in wide.items():
        c.hset("wide", f, v)
    assert c.hgetall("wide") == wide
    # A list takes the large form instead (chunks of its own) once it passes half the limit:
    # no such limit for lists.
    c.rpush("big", *[b"x" * 1000 for _ in range(2)])
    assert c.object("encoding", "big") == b"listpack"
    c.rpush("big", *[b"y" * 1500 for _ in range(3)])
    assert c.llen("big") == 5 and c.object("encoding", "big") == b"quicklist"
    assert c.lrange("big", 0, -1) == [b"x" * 1000] * 2 + [b"y" * 1500] * 3
    # Strings at the limit, with and without the tag byte in front; one byte more is refused.
    limit = 4096
    for v in (b"\xff" * limit, b"a" * limit, b"\xff\x00" + b"z" * (limit - 2)):
        assert c.set("s", v) and c.get("s") == v and c.strlen("s") == limit
        assert c.getrange("s", 0, 1) == v[:2]
    with pytest.raises(redis.ResponseError, match="value too large"):
        c.set("s", b"\xff" * (limit + 1))
    assert c.append("t", b"\xff") == 1 and c.append("t", b"\xfe") == 2 and c.get("t") == b"\xff\xfe"
    assert c.type("t") == b"string" and c.type("h") == b"hash"
    # SCAN's TYPE filter reads each key's type.
    c.sadd("set", "m")
    c.zadd("zs", {"m": 1})
    c.rpush("list", "e")
    found = {t: sorted(c.scan_iter(_type=t)) for t in ("string", "hash", "list", "set", "zset")}
    assert found == {"string": [b"s", b"t"], "hash": [b"bigh", b"h", b"wide"], "list": [b"big", b"list"], "set": [b"set"], "zset": [b"zs"]}


def test_native_clients_see_strings_and_refuse_collections(shared_cluster):
    """The native protocol reads and writes strings as RESP does (a leading 0xFF included); a
    native read of a collection is a clear error, not its bytes."""
    c = shared_cluster
    rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)

    def native(*args, value=None):
        return subprocess.run([ramlog_bin(), *args[:1], "-p", str(c.servers[1].native), *args[1:]],
                              input=value, capture_output=True, timeout=30)

    out = native("set", "native:tag", "-", value=b"\xff\x00\x01")
    assert out.returncode == 0, out.stderr
    assert rc.get("native:tag") == b"\xff\x00\x01" and rc.strlen("native:tag") == 3
    rc.set("resp:tag", b"\xffresp")
    out = native("get", "resp:tag")
    assert out.returncode == 0 and out.stdout.rstrip(b"\n") == b"\xffresp", out
    rc.hset("native:hash", "f", "v")
    out = native("get", "native:hash")
    assert out.returncode != 0 and b"holds a collection" in out.stderr, out
    assert rc.hgetall("native:hash") == {b"f": b"v"}


@pytest.fixture(params=["standalone", "routing", "cluster"])
def blocking_target(request, tmp_path):
    """A standalone server, a cluster's routing port, or the cluster port of the key's master."""
    if request.param == "standalone":
        s = Server(tmp_path)
        yield lambda: s.client(), s.port
        s.stop()
    elif request.param == "routing":
        c = request.getfixturevalue("shared_cluster")
        port = c.servers[1].routing
        redis.Redis(port=port).delete("{q}", "{q}2", "{q}z", "{q}s")
        yield lambda: redis.Redis(port=port, socket_timeout=10), port
    else:
        c = request.getfixturevalue("shared_cluster")
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
        rc.delete("{q}", "{q}2", "{q}z", "{q}s")
        port = rc.get_node_from_key("{q}").port
        yield lambda: redis.Redis(port=port, socket_timeout=10), port


def test_blocking_pops_wait_for_a_push_and_time_out_with_nil(blocking_target):
    make, port = blocking_target
    a, b = make(), make()
    # Nothing arrives: nil after the timeout.
    t0 = time.monotonic()
    assert a.blpop(["{q}"], timeout=0.3) is None
    assert 0.25 <= time.monotonic() - t0 < 3
    # A push from another client wakes the blocked one at once.
    for pop, push, want in ((a.blpop, b.rpush, [b"{q}", b"x"]), (a.brpop, b.lpush, [b"{q}", b"x"])):
        got = []
        th = threading.Thread(target=lambda: got.append(pop(["{q}2", "{q}"], timeout=10)))
        th.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        push("{q}", "x")
        th.join(timeout=10)
        assert got and list(got[0]) == want, got
        assert time.monotonic() - t0 < 1.0
    assert b.llen("{q}") == 0
    # BLMOVE and BRPOPLPUSH, woken by a push to the source.
    got = []
    th = threading.Thread(target=lambda: got.append(a.blmove("{q}", "{q}2", 10, "RIGHT", "LEFT")))
    th.start()
    time.sleep(0.2)
    b.rpush("{q}", "m")
    th.join(timeout=10)
    assert got == [b"m"] and b.lrange("{q}2", 0, -1) == [b"m"] and b.exists("{q}") == 0
    # BZPOPMIN and BZPOPMAX, woken by ZADD.
    got = []
    th = threading.Thread(target=lambda: got.append(a.bzpopmin("{q}z", timeout=10)))
    th.start()
    time.sleep(0.2)
    b.zadd("{q}z", {"low": 1, "high": 2})
    th.join(timeout=10)
    assert got == [(b"{q}z", b"low", 1.0)], got
    assert a.bzpopmax("{q}z", timeout=1) == (b"{q}z", b"high", 2.0)
    # A key of another type answers WRONGTYPE at once; a bad timeout is an error.
    b.set("{q}s", "v")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        a.blpop(["{q}s"], timeout=5)
    with pytest.raises(redis.ResponseError, match="timeout is negative"):
        a.blpop(["{q}"], timeout=-1)
    b.delete("{q}s", "{q}2")


def test_a_blocked_client_that_leaves_takes_nothing_and_pipelined_requests_follow(blocking_target):
    make, port = blocking_target
    b = make()
    # The client closes while blocked: a later push stays in the list.
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"*3\r\n$5\r\nBLPOP\r\n$3\r\n{q}\r\n$1\r\n0\r\n")
    time.sleep(0.3)
    s.close()
    time.sleep(0.3)
    b.rpush("{q}", "kept")
    time.sleep(0.3)
    assert b.lrange("{q}", 0, -1) == [b"kept"]
    b.delete("{q}")
    # BLPOP then PING in one write: PING's reply follows the pop's, once a push came.
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"*3\r\n$5\r\nBLPOP\r\n$3\r\n{q}\r\n$1\r\n0\r\n*1\r\n$4\r\nPING\r\n")
    time.sleep(0.3)
    b.rpush("{q}", "v")
    data = b""
    want = b"*2\r\n$3\r\n{q}\r\n$1\r\nv\r\n+PONG\r\n"
    deadline = time.time() + 5
    while len(data) < len(want) and time.time() < deadline:
        data += s.recv(4096)
    s.close()
    assert data == want
    # Inside MULTI a blocking pop answers at once.
    p = b.pipeline(transaction=True)
    p.blpop(["{q}"], timeout=0)
    assert p.execute() == [None]


def test_blocked_clients_are_served_in_the_order_they_blocked(blocking_target):
    """Four clients block on one key, one after another (BLPOP, and BZPOPMIN on a sorted set);
    one write then gives three elements: the first three to block get them in that order, and
    the fourth still waits. Through the routing port too, where the key's master is another
    server and the clients queue at the routing server."""
    make, port = blocking_target
    pusher = make()
    for key, block, give in [
        ("{q}", lambda c: c.blpop(["{q}"], timeout=5), lambda: pusher.rpush("{q}", "a", "b", "c")),
        ("{q}z", lambda c: c.bzpopmin(["{q}z"], timeout=5),
         lambda: pusher.zadd("{q}z", {"a": 1, "b": 2, "c": 3})),
    ]:
        got = {}

        def run(i, c):
            got[i] = block(c)

        threads = []
        for i in range(4):
            t = threading.Thread(target=run, args=(i, make()))
            t.start()
            threads.append(t)
            # Each client is blocked before the next one blocks.
            assert wait_until(lambda: blocked_clients(pusher) >= i + 1, timeout=5)
        give()
        for t in threads[:3]:
            t.join(timeout=10)
        firsts = [got.get(i) for i in range(3)]
        assert [r[1] for r in firsts] == [b"a", b"b", b"c"], (key, firsts)
        assert 3 not in got, "the fourth client took something"
        threads[3].join(timeout=10)
        assert got.get(3) is None


def blocked_clients(c):
    return int(c.info("clients")["blocked_clients"])


def test_client_unblock_ends_a_blocked_pop_on_every_port(blocking_target):
    """CLIENT UNBLOCK, sent where the client blocked, ends its BLPOP at once: with the null of a
    timeout (no reason, or TIMEOUT) or the UNBLOCKED error; then it answers 0. Through the routing
    port too, where the key's master is another server and the client waits at the routing
    server."""
    make, port = blocking_target
    other = make()
    for how in (None, "TIMEOUT", "ERROR"):
        blocked = make()
        cid = blocked.client_id()
        got = {}

        def pop():
            try:
                got["reply"] = blocked.blpop(["{q}"], timeout=30)
            except redis.ResponseError as e:
                got["reply"] = ("error", str(e))

        t = threading.Thread(target=pop, daemon=True)
        t.start()
        assert wait_until(lambda: blocked_clients(other) >= 1, timeout=10)
        started = time.monotonic()
        assert other.execute_command("CLIENT", "UNBLOCK", cid, *([how] if how else [])) == 1
        t.join(timeout=10)
        assert time.monotonic() - started < 5, how
        want = ("error", "UNBLOCKED client unblocked via CLIENT UNBLOCK") if how == "ERROR" else None
        assert got.get("reply", "no reply") == want, (how, got)
        assert other.execute_command("CLIENT", "UNBLOCK", cid) == 0
        assert wait_until(lambda: blocked_clients(other) == 0, timeout=5)


def test_routing_port_clients_block_at_the_keys_master(shared_cluster):
    """Through the routing port, a blocking command over keys of one slot waits at their master:
    that server's INFO counts it, the routing port's INFO counts it as its own, and the push
    that gives it something serves it there. Two chained BLMOVEs (Redis 7.2's "Linked LMOVEs")
    both move the pushed element; XREAD BLOCK with `$` waits for entries added after it reached
    the master. INFO's changes since the last save, through the routing port, are those of
    every server."""
    c = shared_cluster
    rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
    rc.delete("{lm}1", "{lm}2", "{lm}3", "{lm}s")
    master_port = rc.get_node_from_key("{lm}1").port
    routing_port = next(s.routing for s in c.servers if s.resp != master_port)
    r = redis.Redis(port=routing_port, socket_timeout=10)
    master = redis.Redis(port=master_port, socket_timeout=10)
    base_master, base_routing = blocked_clients(master), blocked_clients(r)
    got = {}

    def blmove(name, src, dst, wherefrom, whereto):
        client = redis.Redis(port=routing_port, socket_timeout=30)
        got[name] = client.blmove(src, dst, 0, wherefrom, whereto)

    def blocked(n):
        return blocked_clients(master) == base_master + n and blocked_clients(r) == base_routing + n

    t1 = threading.Thread(target=blmove, args=("rd1", "{lm}1", "{lm}2", "RIGHT", "LEFT"), daemon=True)
    t1.start()
    assert wait_until(lambda: blocked(1), timeout=10), (blocked_clients(master), blocked_clients(r))
    t2 = threading.Thread(target=blmove, args=("rd2", "{lm}2", "{lm}3", "LEFT", "RIGHT"), daemon=True)
    t2.start()
    assert wait_until(lambda: blocked(2), timeout=10), (blocked_clients(master), blocked_clients(r))
    assert r.rpush("{lm}1", "foo") == 1
    t1.join(timeout=10)
    t2.join(timeout=10)
    assert got == {"rd1": b"foo", "rd2": b"foo"}, got
    assert [r.lrange(k, 0, -1) for k in ("{lm}1", "{lm}2", "{lm}3")] == [[], [], [b"foo"]]
    assert wait_until(lambda: blocked(0), timeout=10)

    # XREAD BLOCK with `$`: only what is added after it blocked.
    r.xadd("{lm}s", {"old": "1"})
    entries = {}

    def xread():
        client = redis.Redis(port=routing_port, socket_timeout=30)
        entries["got"] = client.xread({"{lm}s": "$"}, block=20_000)

    t = threading.Thread(target=xread, daemon=True)
    t.start()
    assert wait_until(lambda: blocked(1), timeout=10)
    new_id = r.xadd("{lm}s", {"new": "2"})
    t.join(timeout=10)
    assert entries.get("got") == [[b"{lm}s", [(new_id, {b"new": b"2"})]]], entries

    # BZMPOP over keys of two slots, which no one master can block: each key's master is asked
    # in turn, and the key that gets an element answers.
    r.delete("zq:a", "zq:b")
    popped = {}

    def bzmpop():
        client = redis.Redis(port=routing_port, socket_timeout=30)
        popped["got"] = client.bzmpop(20, 2, ["zq:a", "zq:b"], max=True, count=10)

    t = threading.Thread(target=bzmpop, daemon=True)
    t.start()
    assert wait_until(lambda: blocked_clients(r) == base_routing + 1, timeout=10)
    r.zadd("zq:b", {"m1": 1, "m2": 2})
    t.join(timeout=10)
    got = popped.get("got")
    assert got is not None and got[0] == b"zq:b", popped
    assert [m for m, _ in got[1]] == [b"m2", b"m1"], popped
    assert r.exists("zq:b") == 0

    # Changes since the last save: 30 keys over every server, all counted.
    before = r.info("persistence")["rdb_changes_since_last_save"]
    for n in range(30):
        r.set(f"changes:{n}", "v")
    assert len({rc.get_node_from_key(f"changes:{n}").port for n in range(30)}) == 3
    assert r.info("persistence")["rdb_changes_since_last_save"] - before == 30


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_watch_aborts_exec_when_a_watched_key_changed(where, tmp_path, request):
    if where == "standalone":
        s = Server(tmp_path)
        make = s.client
        routing = None
    else:
        c = request.getfixturevalue("shared_cluster")
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
        port = rc.get_node_from_key("{w}").port
        make = lambda **kw: redis.Redis(port=port, socket_timeout=10, **kw)  # noqa: E731
        routing = redis.Redis(port=c.servers[0].routing, socket_timeout=10)
    a, b = make(), make()
    a.delete("{w}k", "{w}h", "{w}n")
    a.set("{w}k", "1")
    # Nothing changed: EXEC runs.
    p = a.pipeline(transaction=True)
    p.watch("{w}k", "{w}n")
    assert p.get("{w}k") == b"1"
    p.multi()
    p.set("{w}k", "2")
    assert p.execute() == [True]
    # Another client changes a watched key (a string, a hash field, an absent key created):
    # EXEC answers nil and runs nothing.
    for change in (lambda: b.set("{w}k", "x"), lambda: b.hset("{w}h", "f", "v"), lambda: b.set("{w}n", "new")):
        p = a.pipeline(transaction=True)
        p.watch("{w}k", "{w}h", "{w}n")
        change()
        p.multi()
        p.set("{w}k", "mine")
        with pytest.raises(redis.WatchError):
            p.execute()
        assert a.get("{w}k") != b"mine"
        b.delete("{w}n")
    # UNWATCH forgets; WATCH inside MULTI is refused and the transaction goes on, as in Redis
    # (one connection throughout).
    a = make(single_connection_client=True)
    assert a.execute_command("WATCH", "{w}k")
    b.set("{w}k", "y")
    assert a.execute_command("UNWATCH")
    assert a.execute_command("MULTI")
    a.execute_command("SET", "{w}k", "z")  # +QUEUED (redis-py's SET callback reads it as False)
    assert a.execute_command("EXEC") == [b"OK"] and a.get("{w}k") == b"z"
    a.execute_command("MULTI")
    with pytest.raises(redis.ResponseError, match="WATCH inside MULTI is not allowed"):
        a.execute_command("WATCH", "{w}k")
    a.execute_command("SET", "{w}k", "after")
    assert a.execute_command("EXEC") == [b"OK"] and a.get("{w}k") == b"after"
    if routing is not None:
        # Through the routing port: the versions are read at the keys' masters.
        for changed in (False, True):
            p = routing.pipeline(transaction=True)
            p.watch("{w}k", "other-slot-key")
            if changed:
                b.set("{w}k", "by-b")
            p.multi()
            p.set("{w}k", "routed")
            p.set("other-slot-key", "routed")
            if changed:
                with pytest.raises(redis.WatchError):
                    p.execute()
                assert routing.get("{w}k") == b"by-b"
            else:
                assert p.execute() == [True, True]
                assert routing.get("{w}k") == b"routed"
    if where == "standalone":
        s.stop()


def _messages(p, want, timeout=10):
    got = []
    deadline = time.time() + timeout
    while len(got) < want and time.time() < deadline:
        m = p.get_message(timeout=0.2)
        if m and m["type"] in ("message", "pmessage", "smessage"):
            got.append(m)
    return got


@pytest.mark.parametrize("protocol", [2, 3], ids=["resp2", "resp3"])
def test_publish_reaches_channel_and_pattern_subscribers_on_a_standalone_server(tmp_path, protocol):
    s = Server(tmp_path)
    try:
        sub = s.client(protocol=protocol).pubsub()
        sub.subscribe("news")
        sub.psubscribe("n*")
        c = s.client()
        assert wait_until(lambda: c.pubsub_numsub("news") == [(b"news", 1)])
        assert c.pubsub_numpat() == 1 and c.pubsub_channels() == [b"news"]
        assert c.publish("news", "hello") == 2
        assert c.publish("other", "x") == 0
        got = _messages(sub, 2)
        assert sorted((m["type"], m["channel"], m["data"]) for m in got) == [
            ("message", b"news", b"hello"), ("pmessage", b"news", b"hello")]
        sub.unsubscribe("news")
        sub.punsubscribe("n*")
        assert wait_until(lambda: c.pubsub_numsub("news") == [(b"news", 0)])
        assert c.publish("news", "gone") == 0
        sub.close()
        # A subscribed RESP2 connection refuses other commands, as Redis does.
        raw = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        raw.sendall(b"SUBSCRIBE a\r\nGET k\r\nPING\r\n")
        want = b"*3\r\n$9\r\nsubscribe\r\n$1\r\na\r\n:1\r\n"
        data = b""
        deadline = time.time() + 5
        while data.count(b"\r\n") < 9 and time.time() < deadline:
            data += raw.recv(4096)
        raw.close()
        assert data.startswith(want), data
        assert b"-ERR Can't execute 'get'" in data and data.endswith(b"*2\r\n$4\r\npong\r\n$0\r\n\r\n"), data
    finally:
        s.stop()


def test_publish_reaches_subscribers_on_every_server_of_a_cluster_in_order(shared_cluster):
    """Subscribers on two servers' cluster ports and on a routing port receive what is published
    on any server (cluster port or routing port), each publisher's messages in order."""
    c = shared_cluster
    subs = [redis.Redis(port=c.servers[0].resp).pubsub(), redis.Redis(port=c.servers[2].resp).pubsub(),
            redis.Redis(port=c.servers[1].routing).pubsub()]
    for p in subs:
        p.subscribe("events")
    time.sleep(0.3)
    pub_a = redis.Redis(port=c.servers[1].resp)
    pub_b = redis.Redis(port=c.servers[2].routing)
    for i in range(50):
        pub_a.publish("events", f"a{i}")
        pub_b.publish("events", f"b{i}")
    for p in subs:
        got = [m["data"].decode() for m in _messages(p, 100)]
        assert len(got) == 100, got
        assert [x for x in got if x[0] == "a"] == [f"a{i}" for i in range(50)]
        assert [x for x in got if x[0] == "b"] == [f"b{i}" for i in range(50)]
        p.close()
    # Sharded pub/sub stays at the channel's slot's master.
    rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
    master = redis.Redis(port=rc.get_node_from_key("shard-ch").port)
    sp = master.pubsub()
    sp.ssubscribe("shard-ch")
    time.sleep(0.2)
    assert master.execute_command("SPUBLISH", "shard-ch", "s1") == 1
    got = _messages(sp, 1)
    assert [(m["type"], m["data"]) for m in got] == [("smessage", b"s1")]
    sp.close()
    with pytest.raises(redis.ResponseError, match="not supported through the routing port"):
        redis.Redis(port=c.servers[0].routing).execute_command("SSUBSCRIBE", "shard-ch")


def _read_replies(sock, n, timeout=5):
    """Reads until `n` RESP2 subscribe confirmations (arrays of 3) arrived."""
    data = b""
    deadline = time.time() + timeout
    while data.count(b"*3\r\n") < n and time.time() < deadline:
        data += sock.recv(65536)
    assert data.count(b"*3\r\n") >= n, data
    return data


def test_publish_after_an_unsubscribe_sent_before_it_finds_no_subscriber(tmp_path):
    """A client that sends UNSUBSCRIBE (or PUNSUBSCRIBE) without arguments and, without reading its
    reply, PUBLISHes on another connection reaches no subscriber, as with Redis's one thread (the
    two connections may run on different workers here). On a standalone server: on a cluster
    server about one PUBLISH in a thousand still overtakes the UNSUBSCRIBE (docs/testing.md)."""
    s = Server(tmp_path)
    try:
        _unsubscribe_then_publish(s.port, s.client())
    finally:
        s.stop()


def _unsubscribe_then_publish(port, publisher):
    for kind, unsub, names in (("SUBSCRIBE", "UNSUBSCRIBE", [b"{q}c1", b"{q}c2", b"{q}c3"]),
                               ("PSUBSCRIBE", "PUNSUBSCRIBE", [b"{q}p1*", b"{q}p2*"])):
        sub = socket.create_connection(("127.0.0.1", port), timeout=5)
        try:
            for i in range(500):
                sub.sendall(kind.encode() + b" " + b" ".join(names) + b"\r\n")
                _read_replies(sub, len(names))
                sub.sendall(unsub.encode() + b"\r\n")
                for n in names:
                    channel = n if kind == "SUBSCRIBE" else n.rstrip(b"*") + b"x"
                    assert publisher.publish(channel, b"hello") == 0, (kind, i, channel)
                _read_replies(sub, len(names))
        finally:
            sub.close()


def _resp(*args):
    out = b"*%d\r\n" % len(args)
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out += b"$%d\r\n%s\r\n" % (len(a), a)
    return out


def _pipeline_replies(port, payload, protocol):
    """Sends `payload` (RESP requests) in one write, then PING, and returns the raw replies
    before the PING's."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        if protocol == 3:
            sock.sendall(_resp("HELLO", 3))
            data = b""
            while b"proto" not in data or not data.endswith(b"\r\n"):
                data += sock.recv(65536)
            time.sleep(0.05)
            sock.setblocking(False)
            try:
                sock.recv(65536)
            except BlockingIOError:
                pass
            sock.setblocking(True)
        marker = _resp("PING", "end-of-pipeline-marker")
        sock.sendall(payload + marker)
        want_end = b"$22\r\nend-of-pipeline-marker\r\n"
        data = b""
        deadline = time.time() + 20
        while not data.endswith(want_end) and time.time() < deadline:
            data += sock.recv(1 << 20)
        assert data.endswith(want_end), data[-200:]
        return data[: -len(want_end)]
    finally:
        sock.close()


def _commandstats(client):
    stats = client.info("commandstats")
    return {k: v["calls"] for k, v in stats.items() if k in ("cmdstat_lpush", "cmdstat_rpush", "cmdstat_lpop", "cmdstat_rpop")}


@pytest.mark.parametrize("protocol", [2, 3], ids=["resp2", "resp3"])
def test_pipelined_pushes_and_pops_of_one_list_answer_as_redis_does(blocking_target, redis_peer, protocol, request):
    """Runs of pipelined LPUSH/RPUSH (of one and of several elements) and LPOP/RPOP of one list,
    which a server runs as one command each (`commands::execute_run`), interleaved with other
    keys, pops past the list's end, wrong types and a missing key: the raw replies are Redis's,
    byte for byte, and so are the list, INFO commandstats' calls and (single-element runs) the
    changes since the last save."""
    make, port = blocking_target
    ours = make()
    peer_port = redis_peer.connection_pool.connection_kwargs["port"]
    rnd = random.Random(protocol)
    payload = b""
    for round_ in range(30):
        for _ in range(rnd.randint(1, 70)):
            payload += _resp(rnd.choice(["LPUSH", "RPUSH"]), "{q}", f"v{round_}-{rnd.randint(0, 999)}")
        for _ in range(rnd.randint(1, 20)):
            payload += _resp("RPUSH", "{q}", "a", "b", f"c{round_}")
        payload += _resp("SET", "{q}s", "str")
        for _ in range(3):
            payload += _resp("LPUSH", "{q}s", "x")
        for _ in range(3):
            payload += _resp("RPOP", "{q}s")
        for _ in range(rnd.randint(1, 4)):
            payload += _resp("LPOP", "{q}2")
        pops = rnd.randint(1, 120)
        for _ in range(pops):
            payload += _resp(rnd.choice(["LPOP", "RPOP"]), "{q}")
        payload += _resp("LLEN", "{q}")
    for c in (ours, redis_peer):
        c.delete("{q}", "{q}2", "{q}s")
    before = {"ours": _commandstats(ours), "redis": _commandstats(redis_peer)}
    got = _pipeline_replies(port, payload, protocol)
    want = _pipeline_replies(peer_port, payload, protocol)
    assert got == want
    assert ours.lrange("{q}", 0, -1) == redis_peer.lrange("{q}", 0, -1)
    after = {"ours": _commandstats(ours), "redis": _commandstats(redis_peer)}
    for name in after["redis"]:
        assert (after["ours"].get(name, 0) - before["ours"].get(name, 0)
                == after["redis"][name] - before["redis"].get(name, 0)), name
    # Single-element pushes and pops: the changes since the last save agree.
    def changes(c):
        return c.info("persistence")["rdb_changes_since_last_save"]
    payload = b"".join(_resp("RPUSH", "{q}", i) for i in range(50)) + b"".join(
        _resp("LPOP", "{q}") for _ in range(60))
    for c in (ours, redis_peer):
        c.delete("{q}")
    base = (changes(ours), changes(redis_peer))
    assert _pipeline_replies(port, payload, protocol) == _pipeline_replies(peer_port, payload, protocol)
    assert changes(ours) - base[0] == changes(redis_peer) - base[1] == 100
    if request.node.callspec.params["blocking_target"] != "routing":
        # They ran together (the routing port's requests run at their masters).
        assert int(ours.info("stats").get("ramlog_requests_run_together", 0)) > 1000


def test_client_unblock_ends_a_blocked_pop_as_redis_does(server, redis_peer):
    """CLIENT UNBLOCK id [TIMEOUT|ERROR] ends a blocked BLPOP/BLMOVE with the null of a timeout
    or the UNBLOCKED error, answers 0 for a client that is not blocked, and refuses a bad id or
    reason; the same replies from ramlog and from redis-server."""

    def run(port):
        seen = []
        for how, cmd in ((None, ["BLPOP", "ub", "0"]), ("ERROR", ["BLPOP", "ub", "0"]),
                         ("TIMEOUT", ["BLMOVE", "ub", "ub2", "LEFT", "RIGHT", "0"])):
            blocked = redis.Redis(port=port, socket_timeout=10)
            other = redis.Redis(port=port, socket_timeout=10)
            cid = blocked.client_id()
            got = {}

            def pop():
                try:
                    got["reply"] = blocked.execute_command(*cmd)
                except redis.ResponseError as e:
                    got["reply"] = ("error", str(e))

            t = threading.Thread(target=pop, daemon=True)
            t.start()
            assert wait_until(lambda: other.info("clients")["blocked_clients"] >= 1, timeout=10)
            args = ["CLIENT", "UNBLOCK", cid] + ([how] if how else [])
            seen.append(other.execute_command(*args))
            t.join(timeout=10)
            seen.append(got.get("reply", "no reply"))
            seen.append(other.execute_command("CLIENT", "UNBLOCK", cid))
        probe = redis.Redis(port=port, socket_timeout=10)
        for bad in (["CLIENT", "UNBLOCK", "asd"], ["CLIENT", "UNBLOCK", "1", "LATER"]):
            try:
                seen.append(probe.execute_command(*bad))
            except redis.ResponseError as e:
                seen.append(("error", str(e)))
        return seen

    ours = run(server.port)
    theirs = run(redis_peer.connection_pool.connection_kwargs["port"])
    assert ours == theirs, (ours, theirs)
    assert ours[1] is None and ours[4][0] == "error" and ours[7] is None, ours


def test_changes_since_last_save_count_as_redis_does(server, redis_peer, tmp_path):
    """INFO's rdb_changes_since_last_save (Redis's dirty counter) grows by one for each command
    that changed data and not for one that changed nothing, as redis-server's does: a new key, a
    SETBIT or BITFIELD SET of the bit already there, a DEL of no key, a push and the blocked pop it
    serves, BLMOVE, a transaction of two writes; and SAVE takes it back to 0 (on a server with
    persistence)."""
    steps = [
        ["SET", "d:a", "1"],
        ["SET", "d:a", "2"],
        ["SETBIT", "d:b", "0", "0"],
        ["SETBIT", "d:b", "0", "0"],
        ["SETBIT", "d:b", "0", "1"],
        ["BITFIELD", "d:c", "SET", "i5", "0", "0"],
        ["BITFIELD", "d:c", "SET", "i5", "0", "0"],
        ["DEL", "d:none"],
        ["DEL", "d:a"],
        ["GET", "d:b"],
        ["RPUSH", "d:l", "x"],
        ["LPOP", "d:none"],
        ["INCR", "d:n"],
        ["EXPIRE", "d:none", "100"],
        ["EXPIRE", "d:n", "100"],
    ]

    def deltas(client):
        def dirty():
            return int(client.info("persistence")["rdb_changes_since_last_save"])
        out = []
        for step in steps:
            before = dirty()
            client.execute_command(*step)
            out.append((" ".join(step), dirty() - before))
        # A push served to a blocked pop, then a blocked move: 2 each (the push and the pop), as
        # Redis 7.2's list unit asserts ("BLPOP/BLMOVE should increase dirty"; the redis-server
        # 7.0 of Debian counts 1).
        if client is redis_peer:
            return out
        for block in (["BLPOP", "d:q", "0"], ["BLMOVE", "d:q", "d:q2", "LEFT", "LEFT", "0"]):
            before = dirty()
            got = {}
            blocked = redis.Redis(port=client.connection_pool.connection_kwargs["port"], socket_timeout=10)
            t = threading.Thread(target=lambda: got.update(r=blocked.execute_command(*block)), daemon=True)
            t.start()
            assert wait_until(lambda: client.info("clients")["blocked_clients"] >= 1, timeout=10)
            client.lpush("d:q", "a")
            t.join(timeout=10)
            assert got.get("r"), got
            out.append((block[0], dirty() - before))
        return out

    def transaction(client):
        before = int(client.info("persistence")["rdb_changes_since_last_save"])
        pipe = client.pipeline(transaction=True)
        pipe.set("d:t1", "1")
        pipe.set("d:t2", "1")
        pipe.execute()
        return int(client.info("persistence")["rdb_changes_since_last_save"]) - before

    ours = deltas(server.client())
    theirs = deltas(redis_peer)
    assert ours[:len(theirs)] == theirs, [(a, b) for a, b in zip(ours, theirs) if a != b]
    assert ours[len(theirs):] == [("BLPOP", 2), ("BLMOVE", 2)], ours
    assert transaction(server.client()) == transaction(redis_peer)
    # SAVE makes every change durable: the count starts again from 0.
    saving = Server(tmp_path / "saving", extra_args=("--persistence", "async"))
    try:
        c = saving.client()
        c.set("k", "v")
        assert int(c.info("persistence")["rdb_changes_since_last_save"]) == 1
        assert c.save()
        assert int(c.info("persistence")["rdb_changes_since_last_save"]) == 0
        assert int(c.info("persistence")["rdb_last_save_time"]) == c.lastsave().timestamp()
    finally:
        saving.stop()


def _commandstats_session(make):
    """CONFIG RESETSTAT, then: calls that run, one refused for its arity, one that fails with
    WRONGTYPE, a BLPOP that blocks and is served, one that times out. Returns INFO commandstats'
    calls, rejected and failed calls of the commands used."""
    r = make()
    s, lst, q = "{q}cs:s", "{q}cs:l", "{q}cs:q"
    r.delete(s, lst, q)
    r.config_resetstat()
    r.set(s, "v")
    assert r.get(s) == b"v"
    r.rpush(lst, "a", "b")
    with pytest.raises(redis.ResponseError):
        r.execute_command("GET")
    with pytest.raises(redis.ResponseError):
        r.lpush(s, "x")
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("v", make().blpop([q], timeout=10)),
                         daemon=True)
    t.start()
    assert wait_until(lambda: blocked_clients(r) == 1, timeout=10)
    r.lpush(q, "e")
    t.join(timeout=10)
    assert got.get("v") == (q.encode(), b"e")
    assert make().blpop([q], timeout=0.2) is None
    stats = r.info("commandstats")
    return {name: {k: stats[f"cmdstat_{name}"][k] for k in ("calls", "rejected_calls", "failed_calls")}
            for name in ("set", "get", "rpush", "lpush", "blpop")}


def test_commandstats_count_calls_refusals_and_failures_as_redis_does(blocking_target, redis_peer,
                                                                      request):
    """INFO commandstats per command, on every port, against redis-server: a call that runs
    counts once (a blocked BLPOP too, served or timed out, however often it tried), a call
    refused for its arity counts as rejected (through the routing port, which counts its
    clients' commands where they arrive and does not tell a refusal apart, as failed), a
    WRONGTYPE as failed; CONFIG RESETSTAT starts them again."""
    make, _ = blocking_target
    peer_port = redis_peer.connection_pool.connection_kwargs["port"]
    want = _commandstats_session(lambda: redis.Redis(port=peer_port, socket_timeout=10))
    assert want["blpop"] == {"calls": 2, "rejected_calls": 0, "failed_calls": 0}, want
    assert want["get"] == {"calls": 1, "rejected_calls": 1, "failed_calls": 0}, want
    got = _commandstats_session(make)
    if request.node.callspec.params["blocking_target"] == "routing":
        want["get"] = {"calls": 2, "rejected_calls": 0, "failed_calls": 1}
    assert got == want


def test_string_encodings_follow_changes_in_place_as_redis_does(server_both_ways, redis_peer):
    """OBJECT ENCODING of strings as redis-server answers it: `int` and `embstr` for values set
    whole, `raw` after APPEND, SETRANGE, SETBIT and BITFIELD change a short one in place (until a
    SET or an INCR sets it whole again), unchanged by a SETRANGE that writes nothing, `int` for
    an APPEND that creates its key; GET,
    STRLEN, GETRANGE and DUMP/RESTORE see only the client's bytes. Standalone, through the routing
    port and on the cluster ports."""
    ours = server_both_ways.client()
    theirs = redis.Redis(port=redis_peer.connection_pool.connection_kwargs["port"], socket_timeout=10)
    steps = [
        ["SET", "e", "1"], ["APPEND", "e", "2"], ["INCR", "e"], ["DECRBY", "e", "3"],
        ["SET", "e", "1234"], ["SETRANGE", "e", "0", ""], ["SETRANGE", "e", "1", "3"],
        ["SET", "e", "foo"], ["APPEND", "e", "bar"], ["SET", "e", "foobar"],
        ["SET", "e", "7"], ["SETBIT", "e", "4", "1"], ["SET", "e", "7"],
        ["BITFIELD", "e", "SET", "u8", "0", "65"], ["INCRBYFLOAT", "e", "1.5"],
        ["DEL", "e"], ["APPEND", "e", "5"], ["SETRANGE", "n", "2", "x"],
        ["SET", "e", "x" * 44], ["APPEND", "e", "y"], ["SET", "e", "\xff"], ["APPEND", "e", "\xff"],
    ]
    seen_ours, seen_theirs = [], []
    for cmd in steps:
        for client, seen in ((ours, seen_ours), (theirs, seen_theirs)):
            seen.append(reply_of(client, cmd))
            key = cmd[1]
            seen.append(client.execute_command("OBJECT", "ENCODING", key))
            seen.append(client.get(key))
            seen.append(client.strlen(key))
            seen.append(client.getrange(key, 0, 1))
    assert seen_ours == seen_theirs, [(i // 5, steps[i // 5], a, b)
                                      for i, (a, b) in enumerate(zip(seen_ours, seen_theirs)) if a != b][:5]
    assert b"raw" in seen_ours and b"int" in seen_ours and b"embstr" in seen_ours
    # A string changed in place moves with DUMP and RESTORE as its bytes.
    ours.set("d", "1")
    ours.append("d", "2")
    payload = ours.dump("d")
    ours.restore("d2", 0, payload)
    assert ours.get("d2") == b"12" and theirs.restore("d2", 0, payload) and theirs.get("d2") == b"12"
