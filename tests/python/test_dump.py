"""DUMP and RESTORE: keys of every type, small and large, move between redis-server and ramlog
in both directions with their values and TTLs; errors are Redis's; on a cluster, RESTORE works
through the routing port and the cluster ports (the empty key and binary keys too), and restored
keys survive a kill -9 of their master."""

import signal

import redis
from redis.cluster import RedisCluster

from conftest import Cluster, Server
from test_edge_keys import master_of
from test_failures import server_id_of, status, wait_declared_dead, wait_settled
from test_types import redis_peer  # noqa: F401 (a fixture)


def fill(c):
    c.set("s", "hello")
    c.set("n", "12345")
    c.set("neg", "-7")
    c.set("bin", bytes(range(256)) * 40)
    c.rpush("l", "a", "", 1, -2, "x" * 300)
    c.rpush("ll", *[f"e{i}" for i in range(3000)])
    c.sadd("si", 1, 2, -3, 40000, 2**40)
    c.sadd("ss", "a", "b", "")
    c.sadd("sl", *range(2000))
    c.sadd("sb", *[f"m{i}" for i in range(2000)])
    c.hset("h", mapping={"f": "v", "g": "1", "": "empty"})
    c.hset("hb", mapping={f"f{i}": f"v{i}" * (i % 5) for i in range(2000)})
    c.zadd("z", {"a": 1.5, "b": -2, "c": float("inf"), "d": 0})
    c.zadd("zb", {f"m{i}": i / 7 for i in range(600)})
    c.set("ttl", "soon", px=50_000)
    c.hset("httl", mapping={"a": "b"})
    c.pexpire("httl", 40_000)


KEYS = ["s", "n", "neg", "bin", "l", "ll", "si", "ss", "sl", "sb", "h", "hb", "z", "zb", "ttl", "httl"]


def value(c, key):
    kind = c.type(key).decode()
    read = {
        "string": lambda: c.get(key),
        "list": lambda: c.lrange(key, 0, -1),
        "set": lambda: sorted(c.smembers(key)),
        "hash": lambda: sorted(c.hgetall(key).items()),
        "zset": lambda: c.zrange(key, 0, -1, withscores=True),
        "none": lambda: None,
    }[kind]
    return kind, read()


def reply(client, *cmd):
    try:
        return client.execute_command(*cmd)
    except redis.ResponseError as e:
        return ("error", str(e))


def test_keys_move_between_redis_and_ramlog_both_ways(tmp_path, redis_peer):  # noqa: F811
    s = Server(tmp_path)
    try:
        ours = s.client()
        for c in (ours, redis_peer):
            c.flushall()
            fill(c)
        for src, dst in ((redis_peer, ours), (ours, redis_peer), (ours, ours)):
            for key in KEYS:
                payload = src.dump(key)
                assert payload, key
                ttl = max(src.pttl(key), 0)
                assert dst.restore(f"{key}:copy", ttl, payload, replace=True) == b"OK"
                assert value(dst, f"{key}:copy") == value(src, key), (key, src, dst)
                if ttl:
                    assert ttl - 5000 < dst.pttl(f"{key}:copy") <= ttl, key
                else:
                    assert dst.pttl(f"{key}:copy") == -1, key
        # Large collections restored into ramlog take the large form.
        for key, encoding in (("ll", b"quicklist"), ("sb", b"hashtable"), ("hb", b"hashtable"),
                              ("si", b"intset"), ("ss", b"listpack")):
            ours.restore(f"{key}:form", 0, redis_peer.dump(key))
            assert ours.object("encoding", f"{key}:form") == encoding, key
        # The same errors, checked as Redis checks them.
        good = redis_peer.dump("s")
        damaged = bytearray(good)
        damaged[2] ^= 0x20
        newer = good[:-10] + b"\x0c\x00" + good[-8:]
        cases = [
            ("RESTORE", "s", 0, good),
            ("RESTORE", "fresh", 0, bytes(damaged)),
            ("RESTORE", "fresh", 0, newer),
            ("RESTORE", "fresh", -1, good),
            ("RESTORE", "fresh", "x", good),
            ("RESTORE", "fresh", 0, good, "BOGUS"),
            ("RESTORE", "fresh", 0, good, "IDLETIME", -1),
            ("RESTORE", "fresh", 0, good, "FREQ", 300),
            ("RESTORE", "fresh", 0, b"\x00"),
            ("RESTORE", "past", 1, good, "ABSTTL"),
            ("EXISTS", "past"),
            ("RESTORE", "s", 1, good, "ABSTTL", "REPLACE"),
            ("EXISTS", "s"),
            ("RESTORE", "idle", 0, good, "IDLETIME", 100, "REPLACE"),
            ("GET", "idle"),
            ("DUMP", "absent"),
        ]
        for cmd in cases:
            assert reply(ours, *cmd) == reply(redis_peer, *cmd), cmd
    finally:
        s.stop()


def test_restore_on_the_routing_and_cluster_ports_survives_a_kill(tmp_path):
    """Payloads from one port restore through the other (the empty key, a binary key, a large
    hash and a large list among them); then the master of the large hash is killed -9 and every
    restored key reads back after the recovery."""
    c = Cluster(tmp_path)
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
        routing = redis.Redis(port=c.servers[1].routing, socket_timeout=10)
        rc.set(b"", b"the empty key")
        rc.set(b"\x00\xff\r\n", bytes(range(256)))
        routing.hset(b"{big}hash", mapping={f"f{i}": f"v{i}" for i in range(5000)})
        routing.rpush(b"{big}list", *[f"item{i}" for i in range(5000)])
        routing.zadd(b"z", {f"m{i}": i for i in range(100)})
        keys = [b"", b"\x00\xff\r\n", b"{big}hash", b"{big}list", b"z"]
        want = {}
        for i, key in enumerate(keys):
            src, dst = (rc, routing) if i % 2 == 0 else (routing, rc)
            payload = src.dump(key)
            assert dst.restore(key + b":r", 0, payload) == b"OK", key
            try:
                dst.restore(key + b":r", 0, payload)
                raise AssertionError("RESTORE over an existing key without REPLACE succeeded")
            except redis.ResponseError as e:
                assert "Target key name already exists" in str(e), e
            want[key + b":r"] = value(src, key)
            assert value(dst, key + b":r") == want[key + b":r"], key
        assert rc.object("encoding", b"{big}hash:r") == b"hashtable"
        st = status(c)
        victim = master_of(c, st, b"{big}hash:r")
        victim_id = server_id_of(c, st, victim)
        c.servers[victim].proc.send_signal(signal.SIGKILL)
        c.servers[victim].proc.wait(timeout=10)
        wait_declared_dead(c, victim_id)
        wait_settled(c, copies=False, timeout=60)
        alive = [i for i in range(len(c.servers)) if i != victim]
        rc = RedisCluster(host="127.0.0.1", port=c.servers[alive[0]].resp, socket_timeout=10)
        routing = redis.Redis(port=c.servers[alive[1]].routing, socket_timeout=10)
        for key, expected in want.items():
            assert value(rc, key) == expected, key
            assert value(routing, key) == expected, key
    finally:
        c.stop()


def test_migrate_moves_keys_between_redis_and_ramlog_both_ways(tmp_path, redis_peer):  # noqa: F811
    """MIGRATE from ramlog to redis-server (one key, KEYS with every type, COPY, REPLACE, AUTH,
    a TTL, +NOKEY, the target's BUSYKEY), and redis-server's own MIGRATE into ramlog: the values
    and TTLs arrive, and the source keeps a key only with COPY or when the target refused it.
    Then from a cluster, through the routing port, of a key another server masters."""
    s = Server(tmp_path / "standalone")
    try:
        ours = s.client()
        fill(ours)
        want = {k: value(ours, k) for k in KEYS}
        target = redis_peer.connection_pool.connection_kwargs["port"]
        # One key; then the rest with KEYS, copies first.
        assert ours.execute_command("MIGRATE", "127.0.0.1", target, "s", 0, 5000) == b"OK"
        assert ours.exists("s") == 0
        rest = [k for k in KEYS if k != "s"]
        assert ours.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "COPY",
                                    "KEYS", *rest) == b"OK"
        assert ours.exists(*rest) == len(rest)
        for k in KEYS:
            assert value(redis_peer, k) == want[k], k
        assert 45_000 < redis_peer.pttl("ttl") <= 50_000
        # The target holds them now: BUSYKEY, unless REPLACE.
        err = reply(ours, "MIGRATE", "127.0.0.1", target, "n", 0, 5000)
        assert err[0] == "error" and "Target instance replied with error: BUSYKEY" in err[1]
        assert ours.exists("n") == 1
        ours.set("n", "changed")
        assert ours.execute_command("MIGRATE", "127.0.0.1", target, "n", 0, 5000, "REPLACE") == b"OK"
        assert redis_peer.get("n") == b"changed" and ours.exists("n") == 0
        assert ours.execute_command("MIGRATE", "127.0.0.1", target, "absent", 0, 5000) == b"NOKEY"
        # A closed port: IOERR, and the key stays.
        err = reply(ours, "MIGRATE", "127.0.0.1", 1, "neg", 0, 500)
        assert err[0] == "error" and err[1].startswith("IOERR")
        assert ours.exists("neg") == 1
        # AUTH: a target that asks for a password.
        redis_peer.config_set("requirepass", "pw")
        try:
            err = reply(ours, "MIGRATE", "127.0.0.1", target, "neg", 0, 5000, "REPLACE")
            assert err[0] == "error" and "NOAUTH" in err[1]
            assert ours.execute_command("MIGRATE", "127.0.0.1", target, "neg", 0, 5000, "REPLACE",
                                        "AUTH", "pw") == b"OK"
        finally:
            redis_peer.execute_command("AUTH", "pw")
            redis_peer.config_set("requirepass", "")
        # Redis's own MIGRATE into ramlog.
        ours.flushall()
        assert redis_peer.execute_command("MIGRATE", "127.0.0.1", s.port, "", 0, 5000, "KEYS",
                                          *[k for k in KEYS if k != "neg"]) == b"OK"
        for k in KEYS:
            if k not in ("neg",):
                assert value(ours, k) == (want[k] if k != "n" else ("string", b"changed")), k
        assert 40_000 < ours.pttl("ttl") <= 50_000
    finally:
        s.stop()
    c = Cluster(tmp_path / "cluster")
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
        redis_peer.flushall()
        keys = [f"{{m}}k{i}" for i in range(50)]
        for k in keys:
            rc.set(k, k)
        rc.rpush("{m}list", *range(3000))
        st = status(c)
        master = master_of(c, st, b"{m}")
        routing = redis.Redis(port=c.servers[(master + 1) % len(c.servers)].routing, socket_timeout=10)
        assert routing.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS",
                                       *keys, "{m}list") == b"OK"
        assert routing.exists(*keys, "{m}list") == 0
        assert [redis_peer.get(k) for k in keys] == [k.encode() for k in keys]
        assert redis_peer.lrange("{m}list", 0, -1) == [str(i).encode() for i in range(3000)]
        err = reply(routing, "MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", "{m}a", "{n}b")
        assert err[0] == "error" and "same slot" in err[1]
    finally:
        c.stop()
