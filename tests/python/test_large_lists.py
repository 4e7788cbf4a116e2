"""The large form of lists (docs/architecture.md, "The large form"): a list past
list-max-listpack-size is a header and chunks at internal keys. Replies stay Redis's; the form
changes both ways; the chunks are deleted, carried and hidden with their key; and a long queue
survives a kill -9 on a standalone server with persistence and on a cluster."""

import random
import signal
import time
import urllib.request

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from conftest import Cluster, Server, wait_until
from test_failures import server_id_of, status, wait_declared_dead, wait_settled
from test_types import redis_peer  # noqa: F401 (a fixture)
from test_edge_keys import master_of

KEYS = ["q1", "q2", "q3"]


def element():
    # Mostly small elements, some of a few KiB: lists cross the 8 KiB limit both ways.
    n = random.choice([1, 5, 20, 100, 700, 3000])
    return f"{random.randint(0, 30)}:" + "e" * n


def random_list_command(k, k2):
    count = str(random.randint(1, 40))
    idx = lambda: str(random.randint(-60, 60))  # noqa: E731
    choices = [
        lambda: ["RPUSH", k] + [element() for _ in range(random.randint(1, 12))],
        lambda: ["LPUSH", k] + [element() for _ in range(random.randint(1, 12))],
        lambda: ["RPUSH", k] + [element() for _ in range(random.randint(1, 12))],
        lambda: ["LPUSHX", k, element()],
        lambda: ["RPUSHX", k, element()],
        lambda: ["LPOP", k],
        lambda: ["RPOP", k, count],
        lambda: ["LPOP", k, count],
        lambda: ["LLEN", k],
        lambda: ["LRANGE", k, idx(), idx()],
        lambda: ["LRANGE", k, "0", "-1"],
        lambda: ["LINDEX", k, idx()],
        lambda: ["LSET", k, idx(), element()],
        lambda: ["LREM", k, str(random.randint(-2, 2)), element()],
        lambda: ["LTRIM", k, str(random.randint(0, 3)), str(random.randint(-4, -1))],
        lambda: ["LINSERT", k, random.choice(["BEFORE", "AFTER"]), element(), element()],
        lambda: ["LPOS", k, element()] + random.choice([[], ["RANK", "-1"], ["COUNT", "0"], ["MAXLEN", "10"]]),
        lambda: ["LMOVE", k, k2, random.choice(["LEFT", "RIGHT"]), random.choice(["LEFT", "RIGHT"])],
        lambda: ["RPOPLPUSH", k, k2],
        lambda: ["RPOPLPUSH", k, k],
        lambda: ["LMPOP", "2", k, k2, random.choice(["LEFT", "RIGHT"]), "COUNT", count],
        lambda: ["TYPE", k],
        lambda: ["EXISTS", k],
    ]
    if random.random() < 0.01:
        return ["DEL", k]
    return random.choice(choices)()


def reply(client, cmd):
    try:
        return client.execute_command(*cmd)
    except redis.ResponseError as e:
        return ("error", str(e))


@pytest.mark.parametrize("seed", [3, 4])
def test_large_lists_answer_as_redis_does(server_both_ways, redis_peer, seed):  # noqa: F811
    """2 000 random list commands whose elements go up to 3 KB, so that lists cross the 8 KiB
    limit into the large form and back, sent to ramlog and to redis-server: every reply is the
    same, and so is every list at the end. Standalone, routing port and cluster ports."""
    random.seed(seed)
    ours = server_both_ways.client()
    tag = "" if isinstance(server_both_ways, Server) else "{t}"
    keys = [f"{tag}{k}" for k in KEYS]
    mismatches = []
    large_seen = 0
    for step in range(2000):
        k, k2 = random.choice(keys), random.choice(keys)
        cmd = random_list_command(k, k2)
        want = reply(redis_peer, cmd)
        got = reply(ours, cmd)
        if got != want:
            mismatches.append((step, cmd[:3], str(want)[:200], str(got)[:200]))
            if len(mismatches) >= 5:
                break
        if step % 50 == 0:
            large_seen += sum(ours.object("encoding", key) == b"quicklist" for key in keys if ours.exists(key))
    assert not mismatches, mismatches
    assert large_seen > 10, "the random lists never took the large form"
    for key in keys:
        assert ours.lrange(key, 0, -1) == redis_peer.lrange(key, 0, -1), key
        assert ours.type(key) == redis_peer.type(key), key


def chunks(server: Server) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.admin_port}/metrics", timeout=10).read().decode()
    line = next(l for l in text.splitlines() if l.startswith("ramlog_large_collection_chunks "))
    return int(line.split()[1])


def test_a_list_changes_form_and_its_chunks_go_with_its_key(make_server, tmp_path):
    config = tmp_path / "sweep.toml"
    config.write_text('large_sweep_interval_ms = 200\nvalue_size_max_bytes = "64KiB"\n')
    s = make_server("--config", str(config))
    c = s.client()

    # The form follows Redis 7.2's rule: count-based limit, back at half of it.
    c.config_set("list-max-listpack-size", 4)
    c.rpush("small", 1, 2, 3, 4)
    assert c.object("encoding", "small") == b"listpack"
    c.rpush("small", 5)
    assert c.object("encoding", "small") == b"quicklist" and chunks(s) >= 1
    c.rpop("small", 3)
    assert c.object("encoding", "small") == b"listpack" and c.lrange("small", 0, -1) == [b"1", b"2"]
    assert chunks(s) == 0
    c.config_set("list-max-listpack-size", -2)

    # A queue far past the value size limit (64 KiB here): 20 000 elements of 100 B.
    model = [f"{i:06d}".encode() + b"x" * 94 for i in range(20000)]
    pipe = c.pipeline(transaction=False)
    for i in range(0, len(model), 500):
        pipe.rpush("queue", *model[i:i + 500])
    pipe.execute()
    assert c.llen("queue") == 20000 and c.object("encoding", "queue") == b"quicklist"
    assert chunks(s) >= 20000 * 100 // 2048
    for i in (0, 1, 4095, 10000, 19999, -1, -20000):
        assert c.lindex("queue", i) == model[i]
    assert c.lindex("queue", 20000) is None
    assert c.lrange("queue", 9990, 10010) == model[9990:10011]
    assert c.lrange("queue", -25, -1) == model[-25:]
    assert c.lrange("queue", 0, -1) == model
    assert c.lpop("queue", 100) == model[:100] and c.rpop("queue") == model[-1]
    model = model[100:-1]
    c.lpush("queue", b"head")
    model.insert(0, b"head")
    assert c.lpos("queue", model[5000]) == 5000
    assert c.lset("queue", 7000, b"seven") and c.lindex("queue", 7000) == b"seven"
    model[7000] = b"seven"
    assert c.lrange("queue", 0, -1) == model
    assert c.memory_usage("queue") > sum(map(len, model))
    # LTRIM cuts at both ends (whole chunks dropped, the edge chunks cut), then to one chunk.
    assert c.ltrim("queue", 123, -77) and c.lrange("queue", 0, -1) == model[123:-76]
    model = model[123:-76]
    assert c.object("encoding", "queue") == b"quicklist"
    c.rpush("capped", *model[:3000])
    for i in range(50):
        c.lpush("capped", b"new%d" % i)
        c.ltrim("capped", 0, 999)
    capped = [b"new%d" % i for i in reversed(range(50))] + model[:950]
    assert c.lrange("capped", 0, -1) == capped
    c.ltrim("capped", 10, 12)
    assert c.lrange("capped", 0, -1) == capped[10:13] and c.object("encoding", "capped") == b"listpack"
    c.delete("capped")
    # No trim leaves a chunk behind: what DEL finds is all there is.
    baseline = chunks(s)
    for a, b in ((10, 12), (0, 45), (41, 99), (3, -3), (80, 81)):
        c.rpush("t", *model[:100])
        c.ltrim("t", a, b)
        assert c.lrange("t", 0, -1) == model[:100][a:(b + 1) or None], (a, b)
        c.delete("t")
        assert chunks(s) == baseline, (a, b)

    # Only user keys are keys.
    assert c.dbsize() == 2 and sorted(c.keys()) == [b"queue", b"small"]
    assert sorted(c.scan_iter()) == [b"queue", b"small"]
    assert {c.randomkey() for _ in range(20)} <= {b"queue", b"small"}
    assert sorted(c.scan_iter(_type="list")) == [b"queue", b"small"]

    # RENAME keeps the expiry; COPY makes a second list; DEL takes the chunks along.
    c.expire("queue", 1000)
    assert c.rename("queue", "renamed")
    assert c.exists("queue") == 0 and 990 <= c.ttl("renamed") <= 1000
    # The new name's chunks are written afresh (packed full); the old name's are gone.
    before = chunks(s)
    assert c.lrange("renamed", 0, -1) == model and len(model) * 100 // 2048 <= before <= len(model) * 100 // 1500
    assert c.copy("renamed", "copied") and c.lrange("copied", 0, -1) == model
    assert chunks(s) == 2 * before
    assert c.delete("copied") == 1 and chunks(s) == before
    assert c.renamenx("renamed", "small") is False

    # Overwritten, and expired: the sweep deletes what no key names any more.
    c.set("renamed", "now a string")
    assert c.get("renamed") == b"now a string"
    assert wait_until(lambda: chunks(s) == 0, timeout=10), chunks(s)
    c.rpush("expiring", *model[:2000])
    assert chunks(s) > 0
    c.pexpire("expiring", 100)
    assert wait_until(lambda: c.exists("expiring") == 0 and chunks(s) == 0, timeout=10), chunks(s)
    # DBSIZE counts an expired key until active expiry reclaims it, as Redis's does.
    assert wait_until(lambda: c.dbsize() == 2, timeout=15), c.dbsize()

    # The internal keys' prefix is refused on every keyed command.
    for cmd in (["SET", b"\xffr\x00\x00\x01x", "v"], ["RPUSH", b"\xffr\x00", "v"], ["GET", b"\xffr\x00zz"]):
        with pytest.raises(redis.ResponseError, match="reserved"):
            c.execute_command(*cmd)
    assert c.dbsize() == 2


def test_a_long_queue_survives_a_kill_9_with_persistence(tmp_path):
    """A standalone server with persistence (durable): a 6 MB queue pushed, popped from and
    pushed to again is whole after kill -9 and a restart."""
    s = Server(tmp_path, extra_args=("--persistence", "durable"))
    try:
        c = s.client()
        items = [f"job-{i}".encode() + b"p" * 200 for i in range(30000)]
        pipe = c.pipeline(transaction=False)
        for i in range(0, len(items), 1000):
            pipe.rpush("jobs", *items[i:i + 1000])
        pipe.execute()
        assert c.lpop("jobs", 2500) == items[:2500]
        c.lpush("jobs", b"urgent")
        want = [b"urgent"] + items[2500:]
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(timeout=10)
    finally:
        s.stop()
    again = Server(tmp_path, extra_args=("--persistence", "durable"))
    try:
        c = again.client()
        assert c.llen("jobs") == len(want)
        assert c.lrange("jobs", 0, -1) == want
        assert c.dbsize() == 1
    finally:
        again.stop()


def test_a_long_queue_survives_a_master_kill_on_a_cluster(tmp_path):
    """A 6 MB queue (30 000 jobs) on a cluster with `ramlog up`'s defaults, pushed and popped
    through the cluster and routing ports, with a TTL; kill -9 its master: after the restore
    every job is there in order, the TTL too, and the queue goes on (BLPOP, RPUSH)."""
    c = Cluster(tmp_path)
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
        routing = redis.Redis(port=c.servers[1].routing, socket_timeout=10)
        key = b"{jobs}queue"
        items = [f"job-{i}".encode() + b"q" * 200 for i in range(30000)]
        for i in range(0, len(items), 1000):
            client = rc if (i // 1000) % 2 == 0 else routing
            client.rpush(key, *items[i:i + 1000])
        assert routing.lpop(key, 1000) == items[:1000]
        assert rc.rpop(key) == items[-1]
        want = items[1000:-1]
        rc.expire(key, 3600)
        assert rc.llen(key) == len(want) and rc.object("encoding", key) == b"quicklist"
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
        assert rc.llen(key) == len(want)
        assert rc.lrange(key, 0, -1) == want
        assert routing.lrange(key, -10, -1) == want[-10:]
        assert 3500 <= rc.ttl(key) <= 3600
        assert routing.blpop([key], timeout=5) == (key, want[0])
        assert rc.rpush(key, b"after") == len(want)
        assert routing.lindex(key, -1) == b"after"
        assert key_slot(key) == key_slot(b"{jobs}")
    finally:
        c.stop()
