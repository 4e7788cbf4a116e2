"""The large form of sorted sets (docs/architecture.md, "The large form of sorted sets"): past
Redis's listpack limits a sorted set is a header, a member table and a B+-tree of score-ordered
nodes at internal keys. Replies and OBJECT ENCODING stay Redis's; ranks, counts and ranges read
one node per level; the nodes split and merge as the set grows and shrinks; and a large sorted
set survives a kill -9 on a standalone server with persistence and of its master on a cluster."""

import random
import signal

import pytest
import redis
from redis.cluster import RedisCluster

from conftest import Cluster, Server
from test_failures import server_id_of, status, wait_declared_dead, wait_settled
from test_types import redis_peer  # noqa: F401 (a fixture)
from test_edge_keys import master_of
from test_large_lists import chunks


def member():
    # Mostly short members; some past zset-max-listpack-value (64 bytes), so sets change form
    # by size as well as by count.
    if random.random() < 0.97:
        return f"m{random.randint(0, 500)}"
    return "x" * random.randint(65, 120) + str(random.randint(0, 9))


def score():
    r = random.random()
    if r < 0.6:
        return str(random.randint(-50, 50))
    if r < 0.9:
        return str(round(random.uniform(-100, 100), 3))
    return random.choice(["inf", "-inf", "0", "1e20"])


def bound():
    v = random.choice(["-inf", "+inf", str(random.randint(-60, 60)), str(random.randint(-60, 60))])
    if v not in ("-inf", "+inf") and random.random() < 0.3:
        return "(" + v
    return v


def lex():
    r = random.random()
    if r < 0.1:
        return "-"
    if r < 0.2:
        return "+"
    return random.choice("[(") + f"m{random.randint(0, 500)}"


def random_zset_command(k, k2, k3):
    pairs = lambda n: sum(([score(), member()] for _ in range(n)), [])  # noqa: E731
    limit = lambda: ["LIMIT", str(random.randint(0, 20)), str(random.randint(-1, 30))]  # noqa: E731
    rank = lambda: str(random.randint(-300, 300))  # noqa: E731
    choices = [
        lambda: ["ZADD", k] + pairs(random.randint(1, 40)),
        lambda: ["ZADD", k] + pairs(random.randint(1, 40)),
        lambda: ["ZADD", k] + random.sample([["NX"], ["XX"], ["GT"], ["LT"], ["CH"], ["XX", "CH"]], 1)[0]
        + pairs(random.randint(1, 10)),
        lambda: ["ZADD", k, "INCR", score(), member()],
        lambda: ["ZINCRBY", k, score(), member()],
        lambda: ["ZREM", k] + [member() for _ in range(random.randint(1, 20))],
        lambda: ["ZSCORE", k, member()],
        lambda: ["ZMSCORE", k] + [member() for _ in range(random.randint(1, 5))],
        lambda: ["ZCARD", k],
        lambda: ["ZRANK", k, member()],
        lambda: ["ZREVRANK", k, member()],
        lambda: ["ZRANGE", k, rank(), rank()] + random.choice([[], ["WITHSCORES"]]),
        lambda: ["ZRANGE", k, rank(), rank(), "REV", "WITHSCORES"],
        lambda: ["ZRANGE", k, bound(), bound(), "BYSCORE"] + random.choice([[], limit()]) + random.choice([[], ["WITHSCORES"]]),
        lambda: ["ZRANGE", k, bound(), bound(), "BYSCORE", "REV"] + random.choice([[], limit()]),
        lambda: ["ZRANGEBYSCORE", k, bound(), bound(), "WITHSCORES"] + random.choice([[], limit()]),
        lambda: ["ZREVRANGEBYSCORE", k, bound(), bound()] + random.choice([[], limit()]),
        lambda: ["ZCOUNT", k, bound(), bound()],
        lambda: ["ZPOPMIN", k] + random.choice([[], [str(random.randint(0, 15))]]),
        lambda: ["ZPOPMAX", k] + random.choice([[], [str(random.randint(0, 15))]]),
        lambda: ["ZREMRANGEBYRANK", k, rank(), str(random.randint(-300, 20))],
        lambda: ["ZREMRANGEBYSCORE", k, bound(), bound()],
        lambda: ["ZRANGESTORE", k3, k, bound(), bound(), "BYSCORE"],
        lambda: ["ZUNIONSTORE", k3, "2", k, k2],
        lambda: ["ZINTER", "2", k, k2, "WITHSCORES"],
        lambda: ["OBJECT", "ENCODING", k],
        lambda: ["TYPE", k],
    ]
    if random.random() < 0.003:
        return ["DEL", k]
    return random.choice(choices)()


def random_lex_command(k):
    """Lex ranges are defined only over members of one score (Redis answers something else, by
    its skiplist's levels, otherwise): this key's members all score 0."""
    limit = lambda: ["LIMIT", str(random.randint(0, 20)), str(random.randint(-1, 30))]  # noqa: E731
    choices = [
        lambda: ["ZADD", k] + sum((["0", member()] for _ in range(random.randint(1, 40))), []),
        lambda: ["ZREM", k] + [member() for _ in range(random.randint(1, 10))],
        lambda: ["ZRANGE", k, lex(), lex(), "BYLEX"] + random.choice([[], limit()]),
        lambda: ["ZRANGE", k, lex(), lex(), "BYLEX", "REV"] + random.choice([[], limit()]),
        lambda: ["ZRANGEBYLEX", k, lex(), lex()] + random.choice([[], limit()]),
        lambda: ["ZREVRANGEBYLEX", k, lex(), lex()] + random.choice([[], limit()]),
        lambda: ["ZLEXCOUNT", k, lex(), lex()],
        lambda: ["ZREMRANGEBYLEX", k, lex(), lex()],
        lambda: ["ZRANK", k, member()],
        lambda: ["ZPOPMAX", k, str(random.randint(0, 5))],
        lambda: ["OBJECT", "ENCODING", k],
    ]
    return random.choice(choices)()


def reply(client, cmd):
    try:
        return client.execute_command(*cmd)
    except redis.ResponseError as e:
        return ("error", str(e))


def zscan_all(c, key, count=20):
    cursor, out, calls = 0, {}, 0
    while True:
        cursor, part = c.zscan(key, cursor, count=count)
        for m, s in part:
            assert m not in out, f"ZSCAN returned {m!r} twice"
            out[m] = s
        calls += 1
        if cursor == 0:
            return out, calls


@pytest.mark.parametrize("seed", [7])
def test_large_sorted_sets_answer_as_redis_does(server_both_ways, redis_peer, seed):  # noqa: F811
    """3 000 random sorted-set commands sent to ramlog and to redis-server: sets cross Redis's
    listpack limits into the large form and shrink again, and every reply is the same, OBJECT
    ENCODING included. Standalone, routing port and cluster ports."""
    random.seed(seed)
    ours = server_both_ways.client()
    tag = "" if isinstance(server_both_ways, Server) else "{t}"
    keys = [f"{tag}z1", f"{tag}z2", f"{tag}z3"]
    lexed = f"{tag}lex"
    mismatches = []
    large_seen = set()
    for step in range(3000):
        if step % 4 == 3:
            cmd = random_lex_command(lexed)
        else:
            cmd = random_zset_command(*random.sample(keys, 3))
        want = reply(redis_peer, cmd)
        got = reply(ours, cmd)
        if got != want:
            mismatches.append((step, cmd[:6], str(want)[:200], str(got)[:200]))
            if len(mismatches) >= 5:
                break
        if step % 50 == 0:
            for key in keys + [lexed]:
                if ours.object("encoding", key) == b"skiplist":
                    large_seen.add(key)
    assert not mismatches, mismatches
    assert len(large_seen) >= 2, f"too few sorted sets took the large form: {large_seen}"
    for key in keys + [lexed]:
        assert ours.zrange(key, 0, -1, withscores=True) == redis_peer.zrange(key, 0, -1, withscores=True), key
        if ours.exists(key):
            members, _ = zscan_all(ours, key)
            assert members == dict(redis_peer.zrange(key, 0, -1, withscores=True)) or \
                {m: float(s) for m, s in members.items()} == dict(redis_peer.zrange(key, 0, -1, withscores=True))


def test_a_leaderboard_of_200_000_members_ranks_counts_and_pops_as_a_model(make_server):
    """200 000 members (far past what one object may hold): ZRANK, ZREVRANGE, ZCOUNT, ZSCORE and
    ZRANGEBYSCORE answer as a Python model; ZINCRBY moves members; ZPOPMIN and ZREMRANGEBYRANK
    shrink it, the tree's nodes merging; DEL leaves no internal key behind."""
    s = make_server()
    c = s.client()
    random.seed(11)
    n = 200_000
    model = {f"player:{i}": float(random.randint(0, 1_000_000)) for i in range(n)}
    items = list(model.items())
    pipe = c.pipeline(transaction=False)
    for i in range(0, n, 2000):
        pipe.zadd("board", dict(items[i:i + 2000]))
    pipe.execute()
    assert c.zcard("board") == n
    assert c.object("encoding", "board") == b"skiplist"

    def ordered():
        return sorted(model.items(), key=lambda kv: (kv[1], kv[0].encode()))

    order = ordered()
    for _ in range(50):
        m = random.choice(items)[0]
        rank = order.index((m, model[m]))
        assert c.zrank("board", m) == rank
        assert c.zrevrank("board", m) == n - 1 - rank
        assert c.zscore("board", m) == model[m]
    top = c.zrevrange("board", 0, 9, withscores=True)
    assert [(m.decode(), s) for m, s in top] == [(m, s) for m, s in reversed(order[-10:])]
    lo, hi = 250_000, 260_000
    want = [(m, s) for m, s in order if lo <= s <= hi]
    assert c.zcount("board", lo, hi) == len(want)
    got = c.zrangebyscore("board", lo, hi, withscores=True)
    assert [(m.decode(), s) for m, s in got] == want
    page = c.zrangebyscore("board", lo, hi, start=100, num=50)
    assert [m.decode() for m in page] == [m for m, _ in want[100:150]]
    # Moves: each increment takes a member to another leaf.
    for _ in range(2000):
        m = random.choice(items)[0]
        d = random.randint(-5000, 5000)
        model[m] += d
        assert c.zincrby("board", d, m) == model[m]
    order = ordered()
    assert [(m.decode(), s) for m, s in c.zrange("board", 5000, 5100, withscores=True)] == order[5000:5101]
    # Shrink: pops from both ends and a rank range in the middle.
    popped = c.zpopmin("board", 3000)
    assert [(m.decode(), s) for m, s in popped] == order[:3000]
    order = order[3000:]
    assert c.zremrangebyrank("board", 1000, 150_999) == 150_000
    order = order[:1000] + order[151_000:]
    assert c.zcard("board") == len(order)
    assert [(m.decode(), s) for m, s in c.zrange("board", 0, -1, withscores=True)] == order
    members, calls = zscan_all(c, "board", count=500)
    assert set(m.decode() for m in members) == {m for m, _ in order}
    assert calls > 10
    assert chunks(s) > 0
    c.delete("board")
    assert c.dbsize() == 0
    assert chunks(s) == 0


def test_a_large_sorted_set_survives_a_kill_9_with_persistence(tmp_path):
    """A standalone server with persistence (durable): a sorted set of 50 000 members, written,
    incremented and partly removed, is whole after kill -9 and a restart."""
    s = Server(tmp_path, extra_args=("--persistence", "durable"))
    try:
        c = s.client()
        model = {f"job:{i}": float(i % 977) for i in range(50000)}
        items = list(model.items())
        pipe = c.pipeline(transaction=False)
        for i in range(0, len(items), 1000):
            pipe.zadd("queue", dict(items[i:i + 1000]))
        pipe.execute()
        for i in range(0, 50000, 7):
            c.zincrby("queue", 0.5, f"job:{i}")
            model[f"job:{i}"] += 0.5
        gone = [f"job:{i}" for i in range(0, 50000, 3)]
        c.zrem("queue", *gone)
        for m in gone:
            del model[m]
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(timeout=10)
    finally:
        s.stop()
    again = Server(tmp_path, extra_args=("--persistence", "durable"))
    try:
        c = again.client()
        assert c.zcard("queue") == len(model)
        want = sorted(model.items(), key=lambda kv: (kv[1], kv[0].encode()))
        assert [(m.decode(), s) for m, s in c.zrange("queue", 0, -1, withscores=True)] == want
        assert c.object("encoding", "queue") == b"skiplist"
        assert c.zadd("queue", {"after": 1.0}) == 1
    finally:
        again.stop()


def test_a_large_sorted_set_survives_a_master_kill_on_a_cluster(tmp_path):
    """A sorted set of 30 000 members on a cluster with `ramlog up`'s defaults, written through
    the cluster and routing ports; kill -9 its master: after the restore every member is there
    with its score and the key its TTL, and ZADD, ZRANK and ZSCAN go on."""
    c = Cluster(tmp_path)
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
        routing = redis.Redis(port=c.servers[1].routing, socket_timeout=10)
        key = b"{scores}board"
        model = {f"u{i}".encode(): float(i * 7 % 10007) for i in range(30000)}
        items = list(model.items())
        for i in range(0, len(items), 1000):
            client = rc if (i // 1000) % 2 == 0 else routing
            client.zadd(key, dict(items[i:i + 1000]))
        routing.zrem(key, *[f"u{i}" for i in range(0, 30000, 10)])
        for i in range(0, 30000, 10):
            del model[f"u{i}".encode()]
        rc.expire(key, 3600)
        assert rc.zcard(key) == len(model) and rc.object("encoding", key) == b"skiplist"
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
        want = sorted(model.items(), key=lambda kv: (kv[1], kv[0]))
        assert rc.zrange(key, 0, -1, withscores=True) == want
        assert 3500 <= rc.ttl(key) <= 3600
        assert routing.zadd(key, {"after": -1.0}) == 1
        assert routing.zrank(key, "after") == 0
        members, _ = zscan_all(routing, key, count=500)
        assert len(members) == len(model) + 1
    finally:
        c.stop()
