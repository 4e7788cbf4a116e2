"""The large form of hashes and sets (docs/architecture.md, "The large form"): past Redis's
listpack limits a hash or set is a header and buckets at internal keys, addressed by linear
hashing. Replies and OBJECT ENCODING stay Redis's; HSCAN and SSCAN walk the buckets with a
cursor that survives splits and merges; the buckets are deleted, carried and hidden with their
key; and a large hash survives a kill -9 on a standalone server with persistence and on a
cluster."""

import random
import signal
import threading

import pytest
import redis
from redis.cluster import RedisCluster

from conftest import Cluster, Server, wait_until
from test_failures import server_id_of, status, wait_declared_dead, wait_settled
from test_types import redis_peer  # noqa: F401 (a fixture)
from test_edge_keys import master_of
from test_large_lists import chunks

# Replies whose order Redis leaves unspecified are compared sorted.
UNORDERED = {"HGETALL", "HKEYS", "HVALS", "SMEMBERS", "SINTER", "SUNION", "SDIFF"}


def value():
    # Mostly short values; some past hash-max-listpack-value (64 bytes), so hashes change form
    # by size as well as by count.
    n = random.choice([0, 1, 3, 10, 10, 30, 70, 300])
    return "v" * n


def field():
    return f"f{random.randint(0, 400)}"


def member():
    # Integers (intset) and strings (listpack), and some long members.
    r = random.random()
    if r < 0.5:
        return str(random.randint(-300, 300))
    if r < 0.95:
        return f"m{random.randint(0, 300)}"
    return "x" * random.randint(65, 200)


def random_hash_command(k, k2):
    fields = lambda n: [field() for _ in range(n)]  # noqa: E731
    pairs = lambda n: sum(([field(), value()] for _ in range(n)), [])  # noqa: E731
    choices = [
        lambda: ["HSET", k] + pairs(random.randint(1, 30)),
        lambda: ["HSET", k] + pairs(random.randint(1, 30)),
        lambda: ["HMSET", k] + pairs(random.randint(1, 5)),
        lambda: ["HSETNX", k, field(), value()],
        lambda: ["HDEL", k] + fields(random.randint(1, 25)),
        lambda: ["HGET", k, field()],
        lambda: ["HMGET", k] + fields(random.randint(1, 6)),
        lambda: ["HLEN", k],
        lambda: ["HEXISTS", k, field()],
        lambda: ["HSTRLEN", k, field()],
        lambda: ["HINCRBY", k, f"n{random.randint(0, 5)}", str(random.randint(-9, 9))],
        lambda: ["HINCRBYFLOAT", k, f"x{random.randint(0, 5)}", "1.5"],
        lambda: ["HINCRBY", k, field(), "1"],
        lambda: ["HGETALL", k],
        lambda: ["HKEYS", k],
        lambda: ["HVALS", k],
        lambda: ["OBJECT", "ENCODING", k],
        lambda: ["TYPE", k2],
        lambda: ["HGET", k2, field()],
    ]
    if random.random() < 0.005:
        return ["DEL", k]
    return random.choice(choices)()


def random_set_command(k, k2, k3):
    members = lambda n: [member() for _ in range(n)]  # noqa: E731
    choices = [
        lambda: ["SADD", k] + members(random.randint(1, 30)),
        lambda: ["SADD", k] + members(random.randint(1, 30)),
        lambda: ["SADD", k] + [str(random.randint(0, 700)) for _ in range(random.randint(1, 40))],
        lambda: ["SREM", k] + members(random.randint(1, 25)),
        lambda: ["SISMEMBER", k, member()],
        lambda: ["SMISMEMBER", k] + members(random.randint(1, 6)),
        lambda: ["SCARD", k],
        lambda: ["SMEMBERS", k],
        lambda: ["SMOVE", k, k2, member()],
        lambda: ["SINTER", k, k2],
        lambda: ["SUNION", k, k2, k3],
        lambda: ["SDIFF", k, k2],
        lambda: ["SINTERSTORE", k3, k, k2],
        lambda: ["SUNIONSTORE", k3, k, k2],
        lambda: ["SDIFFSTORE", k3, k, k2],
        lambda: ["SINTERCARD", "2", k, k2],
        lambda: ["TYPE", k],
    ]
    if random.random() < 0.005:
        return ["DEL", k]
    return random.choice(choices)()


def reply(client, cmd):
    try:
        out = client.execute_command(*cmd)
    except redis.ResponseError as e:
        return ("error", str(e))
    if cmd[0] in UNORDERED and isinstance(out, (list, set, dict)):
        if isinstance(out, dict):
            return sorted(out.items())
        return sorted(out)
    if cmd[0] == "HGETALL" and isinstance(out, dict):
        return sorted(out.items())
    return out


@pytest.mark.parametrize("seed", [5])
def test_large_hashes_and_sets_answer_as_redis_does(server_both_ways, redis_peer, seed):  # noqa: F811
    """1 500 random hash commands and 1 500 random set commands, sent to ramlog and to
    redis-server: hashes and sets cross Redis's listpack and intset limits into the large form,
    and every reply is the same, hashes' OBJECT ENCODING included. (Sets' encodings follow Redis
    7.2, which added listpack sets; Debian's redis-server is 7.0, so the Redis 7.2 suite's set
    unit checks them instead.) Standalone, routing port and cluster ports."""
    random.seed(seed)
    ours = server_both_ways.client()
    tag = "" if isinstance(server_both_ways, Server) else "{t}"
    hashes = [f"{tag}h1", f"{tag}h2"]
    sets = [f"{tag}s1", f"{tag}s2", f"{tag}s3"]
    mismatches = []
    large_seen = set()
    for step in range(3000):
        if step % 2 == 0:
            cmd = random_hash_command(random.choice(hashes), random.choice(sets))
        else:
            cmd = random_set_command(*random.sample(sets, 3))
        want = reply(redis_peer, cmd)
        got = reply(ours, cmd)
        if got != want:
            mismatches.append((step, cmd[:4], str(want)[:200], str(got)[:200]))
            if len(mismatches) >= 5:
                break
        if step % 50 == 0:
            for key in hashes + sets:
                if ours.object("encoding", key) == b"hashtable":
                    large_seen.add(key)
    assert not mismatches, mismatches
    assert len(large_seen) >= 3, f"too few collections took the large form: {large_seen}"
    for key in hashes:
        assert ours.hgetall(key) == redis_peer.hgetall(key), key
    for key in sets:
        assert ours.smembers(key) == redis_peer.smembers(key), key


def scan_all(c, key, kind, count=20):
    cursor, out = 0, []
    calls = 0
    while True:
        if kind == "hash":
            cursor, part = c.hscan(key, cursor, count=count)
            out.extend(part.keys())
        else:
            cursor, part = c.sscan(key, cursor, count=count)
            out.extend(part)
        calls += 1
        if cursor == 0:
            return out, calls


def test_a_large_hash_grows_shrinks_and_goes_with_its_key(make_server, tmp_path):
    config = tmp_path / "sweep.toml"
    config.write_text("large_sweep_interval_ms = 200\n")
    s = make_server("--config", str(config))
    c = s.client()

    # 20 000 fields: one HSET each, as a session store writes them.
    model = {f"field:{i}".encode(): f"value-{i}".encode() * 2 for i in range(20000)}
    pipe = c.pipeline(transaction=False)
    for f, v in model.items():
        pipe.hset("big", f, v)
    pipe.execute()
    assert c.hlen("big") == 20000 and c.object("encoding", "big") == b"hashtable"
    grown = chunks(s)
    assert grown >= 20000 * 20 // 2048, grown
    assert c.hgetall("big") == model
    assert c.hmget("big", "field:0", "nope", "field:19999") == [model[b"field:0"], None, model[b"field:19999"]]
    assert c.hstrlen("big", "field:7") == len(model[b"field:7"]) and c.hexists("big", "field:7")
    assert c.hincrby("big", "counter", 41) == 41 and c.hincrby("big", "counter", 1) == 42
    model[b"counter"] = b"42"
    assert c.memory_usage("big") > sum(len(f) + len(v) for f, v in model.items())

    # HSCAN returns every field present throughout exactly once, while writers split and merge
    # buckets under it (fields are added and removed that the scan may or may not see).
    stop = threading.Event()

    def churn():
        w = s.client()
        i = 0
        while not stop.is_set():
            w.hset("big", f"extra:{i}", "x" * 30)
            if i >= 50:
                w.hdel("big", f"extra:{i - 50}")
            i += 1

    t = threading.Thread(target=churn)
    t.start()
    try:
        fields, calls = scan_all(c, "big", "hash")
    finally:
        stop.set()
        t.join(timeout=30)
    assert calls > 20
    steady = [f for f in fields if not f.startswith(b"extra:")]
    assert sorted(steady) == sorted(model), "HSCAN missed or repeated a field present throughout"
    extras = [f for f in c.hkeys("big") if f.startswith(b"extra:")]
    if extras:
        c.hdel("big", *extras)

    # Deleting most fields merges buckets back; what is left reads the same.
    doomed = [f for f in model if f != b"counter"][:19900]
    for i in range(0, len(doomed), 500):
        c.hdel("big", *doomed[i:i + 500])
    for f in doomed:
        del model[f]
    assert c.hgetall("big") == model and c.hlen("big") == len(model)
    assert chunks(s) < grown // 20, (chunks(s), grown)
    assert c.object("encoding", "big") == b"hashtable", "a hashtable stays one, as in Redis"

    # RENAME keeps the TTL; COPY doubles the buckets; DEL takes them along.
    c.expire("big", 1000)
    assert c.rename("big", "renamed") and c.exists("big") == 0 and 990 <= c.ttl("renamed") <= 1000
    before = chunks(s)
    assert c.copy("renamed", "copied") and c.hgetall("copied") == model
    assert chunks(s) == 2 * before
    assert c.delete("copied") == 1 and chunks(s) == before
    assert c.dbsize() == 1 and c.keys() == [b"renamed"] and list(c.scan_iter()) == [b"renamed"]

    # Overwritten by SET: the sweep deletes buckets that no key names any more.
    c.set("renamed", "a string now")
    assert wait_until(lambda: chunks(s) == 0, timeout=10), chunks(s)

    # A large set: SPOP, SRANDMEMBER and SSCAN over buckets.
    members = {f"member-{i}".encode() for i in range(5000)}
    for part in range(0, 5000, 1000):
        c.sadd("set", *sorted(members)[part:part + 1000])
    assert c.object("encoding", "set") == b"hashtable" and c.scard("set") == 5000
    scanned, _ = scan_all(c, "set", "set", count=100)
    assert sorted(scanned) == sorted(members)
    popped = c.spop("set", 300)
    assert len(set(popped)) == 300 and set(popped) <= members
    members -= set(popped)
    assert c.smembers("set") == members
    assert set(c.srandmember("set", 50)) <= members and len(set(c.srandmember("set", 50))) == 50
    # Each member is as likely as any other: 40 000 draws over 4 700 members.
    draws = {}
    for _ in range(20):
        for m in c.srandmember("set", -2000):
            draws[m] = draws.get(m, 0) + 1
    assert set(draws) <= members and len(draws) > 0.95 * len(members)
    assert max(draws.values()) < 40, max(draws.values())
    assert c.sinterstore("both", "set", "set") == len(members)
    assert c.smove("set", "other", sorted(members)[0]) and c.sismember("other", sorted(members)[0])
    c.delete("set", "both", "other")
    assert chunks(s) == 0 and c.dbsize() == 1


def test_a_large_hash_survives_a_kill_9_with_persistence(tmp_path):
    """A standalone server with persistence (durable): a hash of 30 000 fields and a set of
    10 000 members, written and partly deleted, are whole after kill -9 and a restart."""
    s = Server(tmp_path, extra_args=("--persistence", "durable"))
    try:
        c = s.client()
        model = {f"user:{i}".encode(): f"session-{i}".encode() * 3 for i in range(30000)}
        pipe = c.pipeline(transaction=False)
        for i, (f, v) in enumerate(model.items()):
            pipe.hset("sessions", f, v)
            if i % 1000 == 999:
                pipe.execute()
        pipe.execute()
        gone = [f"user:{i}" for i in range(0, 30000, 3)]
        c.hdel("sessions", *gone)
        for f in gone:
            del model[f.encode()]
        c.sadd("flags", *range(10000))
        c.srem("flags", *range(0, 10000, 2))
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(timeout=10)
    finally:
        s.stop()
    again = Server(tmp_path, extra_args=("--persistence", "durable"))
    try:
        c = again.client()
        assert c.hlen("sessions") == len(model)
        assert c.hgetall("sessions") == model
        assert c.smembers("flags") == {str(i).encode() for i in range(1, 10000, 2)}
        assert c.object("encoding", "flags") == b"hashtable"
        assert c.dbsize() == 2
        assert c.hset("sessions", "after", "restart") == 1
    finally:
        again.stop()


def test_a_large_hash_survives_a_master_kill_on_a_cluster(tmp_path):
    """A hash of 20 000 fields on a cluster with `ramlog up`'s defaults, written through the
    cluster and routing ports; kill -9 its master: after the restore every field is there with
    its TTL, and HSET and HSCAN go on."""
    c = Cluster(tmp_path)
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
        routing = redis.Redis(port=c.servers[1].routing, socket_timeout=10)
        key = b"{users}profile"
        model = {f"u{i}".encode(): f"name-{i}".encode() for i in range(20000)}
        items = list(model.items())
        for i in range(0, len(items), 1000):
            client = rc if (i // 1000) % 2 == 0 else routing
            client.hset(key, mapping=dict(items[i:i + 1000]))
        routing.hdel(key, *[f"u{i}" for i in range(0, 20000, 10)])
        for i in range(0, 20000, 10):
            del model[f"u{i}".encode()]
        rc.expire(key, 3600)
        assert rc.hlen(key) == len(model) and rc.object("encoding", key) == b"hashtable"
        st = status(c)
        victim = master_of(c, st, key)
        victim_id = server_id_of(c, st, victim)
        c.servers[victim].proc.send_signal(signal.SIGKILL)
        c.servers[victim].proc.wait(timeout=10)
        wait_declared_dead(c, victim_id)
        wait_settled(c, copies=False, timeout=60)
        alive = [i for i in range(len(c.servers)) if i != victim]
        rc = RedisCluster(host="127.0.0.1", port=c.servers[alive[0]].resp, socket_timeout=10)
        routing = redis.Redis(port=c.servers[alive[1]].routing, socket_timeout=10)
        assert rc.hlen(key) == len(model)
        assert rc.hgetall(key) == model
        assert 3500 <= rc.ttl(key) <= 3600
        assert routing.hset(key, "after", "failover") == 1
        fields, _ = scan_all(routing, key, "hash", count=500)
        assert sorted(fields) == sorted(list(model) + [b"after"])
    finally:
        c.stop()


def test_buckets_split_and_merge_under_a_small_value_limit(make_server, tmp_path):
    """Values of up to 1 500 bytes under a 4 KiB value limit: buckets split past their average
    size, split further when large values share one, and merge as fields go, often in one
    change. Every field stays readable: HGETALL always equals the model."""
    config = tmp_path / "small.toml"
    config.write_text('value_size_max_bytes = "4KiB"\n')
    s = make_server("--config", str(config))
    c = s.client()
    random.seed(7)
    model = {}
    for step in range(1500):
        f = f"f{random.randint(0, 60)}".encode()
        if random.random() < 0.15 and model:
            gone = random.sample(sorted(model), min(len(model), random.randint(1, 5)))
            assert c.hdel("h", *gone) == len(gone)
            for g in gone:
                del model[g]
        else:
            v = bytes([97 + step % 26]) * random.choice([10, 700, 1500, 1500, 1500])
            c.hset("h", f, v)
            model[f] = v
        if step % 20 == 0:
            assert c.hgetall("h") == model, step
    assert c.hgetall("h") == model
    assert c.hlen("h") == len(model)


def test_config_set_through_the_routing_port_reaches_every_master(shared_cluster):
    """A proxy's client sets an encoding threshold once: it applies at every key's master."""
    routing = redis.Redis(port=shared_cluster.servers[0].routing, socket_timeout=10)
    try:
        assert routing.config_set("hash-max-listpack-entries", 4)
        for srv in shared_cluster.servers:
            direct = redis.Redis(port=srv.resp, socket_timeout=10)
            assert direct.config_get("hash-max-listpack-entries") == {"hash-max-listpack-entries": "4"}
        keys = [f"cfg-{i}" for i in range(12)]
        for k in keys:
            routing.delete(k)
            routing.hset(k, mapping={f"f{j}": "v" for j in range(5)})
            assert routing.object("encoding", k) == b"hashtable", k
        with pytest.raises(redis.ResponseError):
            routing.config_set("no-such-setting", 1)
    finally:
        routing.config_set("hash-max-listpack-entries", 128)
        for k in [f"cfg-{i}" for i in range(12)]:
            routing.delete(k)
