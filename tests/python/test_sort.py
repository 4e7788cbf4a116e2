"""SORT and SORT_RO against redis-server: lists, sets and sorted sets, numeric and ALPHA, BY
weights and hash fields, GET, LIMIT, DESC and STORE; every reply the same. On a cluster port,
patterns must carry the key's hash tag, as in Redis Cluster."""

import random

import pytest
import redis
from redis.cluster import RedisCluster

from conftest import Server
from test_types import redis_peer  # noqa: F401 (a fixture)


def reply(client, cmd):
    try:
        return client.execute_command(*cmd)
    except redis.ResponseError as e:
        return ("error", str(e).split(" when ")[0])


def test_sort_answers_as_redis_does(tmp_path, redis_peer):  # noqa: F811
    s = Server(tmp_path)
    try:
        ours = s.client()
        random.seed(11)
        nums = [random.randint(-50, 50) for _ in range(40)] + ["3.5", "-0.25"]
        words = [random.choice(["pear", "apple", "fig", "kiwi", "date", "Zed"]) for _ in range(30)]
        scores = {f"m{i}": random.randint(0, 9) for i in range(25)}
        weights = {i: random.randint(0, 1000) for i in range(-50, 61)}
        ranks = {i: random.randint(0, 99) for i in range(-50, 61)}
        for c in (ours, redis_peer):
            c.flushall()
            c.rpush("nums", *nums)
            c.rpush("words", *words)
            c.sadd("set", *range(0, 60, 3))
            c.zadd("z", scores)
            for i in range(-50, 61):
                c.set(f"w_{i}", weights[i])
                c.hset(f"h_{i}", mapping={"name": f"n{i}", "rank": ranks[i]})
            c.set("text", "abc")
        cmds = [
            ["SORT", "nums"], ["SORT", "nums", "DESC"], ["SORT", "nums", "LIMIT", "5", "10"],
            ["SORT", "nums", "LIMIT", "-3", "4"], ["SORT", "nums", "LIMIT", "100", "4"],
            ["SORT", "words"], ["SORT", "words", "ALPHA"], ["SORT", "words", "ALPHA", "DESC", "LIMIT", "0", "7"],
            ["SORT", "set"], ["SORT", "set", "BY", "w_*"], ["SORT", "set", "BY", "w_*", "DESC", "GET", "#", "GET", "w_*"],
            ["SORT", "set", "BY", "h_*->rank", "GET", "h_*->name"], ["SORT", "set", "BY", "nosort", "STORE", "stored"],
            ["LRANGE", "stored", "0", "-1"], ["SORT", "z", "BY", "nosort"], ["SORT", "z", "BY", "nosort", "DESC"],
            ["SORT", "z", "ALPHA", "STORE", "zs"], ["LRANGE", "zs", "0", "-1"], ["SORT", "z"],
            ["SORT", "nums", "GET", "missing_*"], ["SORT", "text"], ["SORT", "absent"],
            ["SORT", "absent", "STORE", "stored"], ["EXISTS", "stored"], ["SORT", "nums", "LIMIT", "1"],
            ["SORT", "nums", "STORE"], ["SORT_RO", "words", "ALPHA", "LIMIT", "2", "3"],
            ["SORT_RO", "words", "ALPHA", "STORE", "x"], ["SORT", "set", "BY", "w_*", "ALPHA", "GET", "w_*"],
        ]
        for cmd in cmds:
            assert reply(ours, cmd) == reply(redis_peer, cmd), cmd
    finally:
        s.stop()


def test_sort_on_a_cluster_port_needs_patterns_in_the_keys_slot(shared_cluster):
    rc = RedisCluster(host="127.0.0.1", port=shared_cluster.servers[0].resp, socket_timeout=10)
    rc.delete("{u}ids", "{u}out")
    rc.rpush("{u}ids", 3, 1, 2)
    for i in (1, 2, 3):
        rc.set(f"{{u}}w_{i}", 10 - i)
    assert rc.sort("{u}ids") == [b"1", b"2", b"3"]
    assert rc.sort("{u}ids", by="{u}w_*") == [b"3", b"2", b"1"]
    assert rc.sort("{u}ids", by="{u}w_*", get=["#", "{u}w_*"]) == [b"3", b"7", b"2", b"8", b"1", b"9"]
    assert rc.sort("{u}ids", desc=True, store="{u}out") == 3
    assert rc.lrange("{u}out", 0, -1) == [b"3", b"2", b"1"]
    with pytest.raises(redis.ResponseError, match="BY option of SORT denied in Cluster mode"):
        rc.sort("{u}ids", by="w_*")
    with pytest.raises(redis.ResponseError, match="same slot"):
        rc.execute_command("SORT", "{u}ids", "STORE", "elsewhere")
