"""BITFIELD and BITFIELD_RO against redis-server: 1 000 random commands of GET, SET and INCRBY
on signed and unsigned fields of 1 to 64 bits at bit and #-scaled offsets, with WRAP, SAT and
FAIL overflow; every reply and the strings are the same. Through a cluster port too."""

import random

import redis
from redis.cluster import RedisCluster

from conftest import Server
from test_types import redis_peer  # noqa: F401 (a fixture)


def random_type():
    if random.random() < 0.5:
        return f"i{random.randint(1, 64)}"
    return f"u{random.randint(1, 63)}"


def random_command(key):
    cmd = ["BITFIELD", key]
    for _ in range(random.randint(1, 4)):
        r = random.random()
        t = random_type()
        off = f"#{random.randint(0, 20)}" if random.random() < 0.3 else str(random.randint(0, 300))
        if r < 0.2:
            cmd += ["OVERFLOW", random.choice(["WRAP", "SAT", "FAIL"])]
        if r < 0.4:
            cmd += ["GET", t, off]
        elif r < 0.7:
            cmd += ["SET", t, off, str(random.randint(-2**63, 2**63 - 1) if random.random() < 0.3 else random.randint(-300, 300))]
        else:
            cmd += ["INCRBY", t, off, str(random.randint(-1000, 1000))]
    if random.random() < 0.05:
        cmd = ["BITFIELD", key, "GET", random.choice(["u64", "i0", "x8"]), "0"]
    if random.random() < 0.05:
        cmd = ["BITFIELD_RO", key, "GET", random_type(), str(random.randint(0, 300))]
    return cmd


def reply(client, cmd):
    try:
        return client.execute_command(*cmd)
    except redis.ResponseError as e:
        return ("error", str(e))


def test_bitfield_answers_as_redis_does(tmp_path, redis_peer):  # noqa: F811
    s = Server(tmp_path)
    try:
        ours = s.client()
        random.seed(21)
        for step in range(1000):
            key = random.choice(["b1", "b2"])
            cmd = random_command(key)
            assert reply(ours, cmd) == reply(redis_peer, cmd), (step, cmd)
        for key in ("b1", "b2"):
            assert ours.get(key) == redis_peer.get(key)
        ours.rpush("list", "x")
        assert "WRONGTYPE" in str(reply(ours, ["BITFIELD", "list", "GET", "u8", "0"]))
        assert "only supports the GET" in str(reply(ours, ["BITFIELD_RO", "b1", "SET", "u8", "0", "1"]))
    finally:
        s.stop()


def test_bitfield_on_a_cluster_port(shared_cluster):
    rc = RedisCluster(host="127.0.0.1", port=shared_cluster.servers[0].resp, socket_timeout=10)
    rc.delete("bf")
    assert rc.execute_command("BITFIELD", "bf", "SET", "u8", "#1", "200", "INCRBY", "u8", "#1", "100") == [0, 44]
    assert rc.execute_command("BITFIELD", "bf", "OVERFLOW", "SAT", "INCRBY", "u8", "#1", "300") == [255]
    assert rc.execute_command("BITFIELD_RO", "bf", "GET", "u8", "8") == [255]
    assert rc.get("bf") == b"\x00\xff"
