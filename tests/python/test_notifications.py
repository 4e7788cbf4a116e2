"""Keyspace notifications (docs/architecture.md, "Keyspace notifications"): with
notify-keyspace-events set, write commands publish Redis's events on __keyspace@0__ and
__keyevent@0__ channels to the server's own subscribers, expired keys included, and CLIENT REPLY
silences replies but not messages."""

import time

import redis

from conftest import Server, wait_until


def messages(pubsub, want, timeout=5.0):
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        m = pubsub.get_message(timeout=0.2)
        if m and m["type"] == "pmessage":
            got.append((m["channel"].decode(), m["data"].decode()))
    return got


def keyevent_subscriber(client):
    """A pub/sub connection of `client` subscribed to every key event, its subscription
    confirmed."""
    p = client.pubsub()
    p.psubscribe("__keyevent@0__:*")
    assert wait_until(lambda: p.get_message(timeout=0.2) is not None, timeout=5)
    return p


def test_write_commands_publish_redis_events(tmp_path):
    s = Server(tmp_path)
    try:
        c = s.client()
        assert c.config_get("notify-keyspace-events") == {"notify-keyspace-events": ""}
        c.set("quiet", "1")
        c.config_set("notify-keyspace-events", "KEA")
        assert c.config_get("notify-keyspace-events") == {"notify-keyspace-events": "AKE"}
        p = c.pubsub()
        p.psubscribe("__key*__:*")
        assert wait_until(lambda: p.get_message(timeout=0.2) is not None, timeout=5)
        c.set("k", "v", ex=100)
        c.rpush("l", "a", "b")
        c.lpop("l")
        c.lpop("l")  # empties the list: lpop, then del
        c.lpop("l")  # nothing popped: no event
        c.hset("h", mapping={"f": "1"})
        c.hdel("h", "missing")  # nothing removed: no event
        c.sadd("s", "m")
        c.zadd("z", {"m": 1})
        c.rename("k", "k2")
        c.delete("k2", "absent")
        events = messages(p, 24)
        keyspace = [(ch.split(":", 1)[1], ev) for ch, ev in events if ch.startswith("__keyspace@0__:")]
        assert keyspace == [
            ("k", "set"), ("k", "expire"), ("l", "rpush"), ("l", "lpop"), ("l", "lpop"), ("l", "del"),
            ("h", "hset"), ("s", "sadd"), ("z", "zadd"),
            ("k", "rename_from"), ("k2", "rename_to"), ("k2", "del"),
        ], events
        keyevent = [(ch.split(":", 1)[1], key) for ch, key in events if ch.startswith("__keyevent@0__:")]
        assert keyevent[:2] == [("set", "k"), ("expire", "k")]
        assert len(keyevent) == len(keyspace)

        # Only the classes asked for; `new` for a created key; `expired` from active expiry.
        c.config_set("notify-keyspace-events", "Elxn")
        c.set("plain", "1")
        c.lpush("list2", "x")
        c.psetex("short", 100, "1")
        got = messages(p, 5, timeout=5)
        assert ("__keyevent@0__:new", "list2") in got and ("__keyevent@0__:lpush", "list2") in got
        assert ("__keyevent@0__:new", "short") in got and ("__keyevent@0__:expired", "short") in got
        assert not any(ch.endswith(":set") for ch, _ in got)

        # CLIENT REPLY: OFF and SKIP drop replies; messages still arrive.
        raw = s.client()
        conn = raw.connection_pool.get_connection("PING")
        conn.send_command("CLIENT", "REPLY", "SKIP")
        conn.send_command("SET", "skipped", "1")
        conn.send_command("GET", "skipped")
        assert conn.read_response() == b"1"
        conn.send_command("CLIENT", "REPLY", "OFF")
        conn.send_command("SET", "off", "1")
        conn.send_command("CLIENT", "REPLY", "ON")
        assert conn.read_response() == b"OK"
        conn.send_command("GET", "off")
        assert conn.read_response() == b"1"
        with_reply = raw.execute_command("CLIENT", "REPLY", "ON")
        assert with_reply == b"OK"
    finally:
        s.stop()


def test_events_are_published_by_the_keys_master_only(shared_cluster):
    """As in Redis Cluster: each server publishes its own keys' events to its own subscribers;
    a write through RedisCluster is seen by the subscribers of the key's master only."""
    from redis.cluster import RedisCluster

    plain = [redis.Redis(port=srv.resp, socket_timeout=10) for srv in shared_cluster.servers]
    subs = []
    try:
        for c in plain:
            c.config_set("notify-keyspace-events", "KEg$")
            subs.append(keyevent_subscriber(c))
        rc = RedisCluster(host="127.0.0.1", port=shared_cluster.servers[0].resp, socket_timeout=10)
        keys = [f"notify-{i}" for i in range(12)]
        for k in keys:
            rc.set(k, "v")
            rc.delete(k)
        seen = [messages(p, 24, timeout=2) for p in subs]
        heard = sorted(key for got in seen for _, key in got)
        assert heard == sorted(keys * 2), seen
        for got in seen:
            for k in {key for _, key in got}:
                assert [ch for ch, key in got if key == k] == ["__keyevent@0__:set", "__keyevent@0__:del"]
        assert sum(1 for got in seen if got) >= 2, "the keys' masters are spread over the servers"
    finally:
        for c in plain:
            c.config_set("notify-keyspace-events", "")
        for p in subs:
            p.close()


def test_a_routing_port_subscriber_hears_every_servers_keys(shared_cluster):
    """A routing port stands for the whole cluster: its subscriber hears the events of keys on
    every server, once each and in each key's order, while a cluster port's subscriber on the
    same server still hears only that server's keys (as a Redis Cluster node's). CONFIG SET
    through the routing port sets every master."""
    from redis.cluster import RedisCluster

    srv = shared_cluster.servers[1]
    routing = redis.Redis(port=srv.routing, socket_timeout=10)
    cluster_port = redis.Redis(port=srv.resp, socket_timeout=10)
    subs = []
    try:
        routing.config_set("notify-keyspace-events", "KEg$")
        subs = [keyevent_subscriber(c) for c in (routing, cluster_port)]
        rc = RedisCluster(host="127.0.0.1", port=shared_cluster.servers[0].resp, socket_timeout=10)
        keys = [f"routed-notify-{i}" for i in range(12)]
        owners = {k: rc.get_node_from_key(k).port for k in keys}
        assert len(set(owners.values())) == 3, owners
        for k in keys:
            routing.set(k, "v")
            routing.delete(k)
        heard_routing = messages(subs[0], 24, timeout=5)
        assert sorted(key for _, key in heard_routing) == sorted(keys * 2), heard_routing
        for k in keys:
            assert [ch for ch, key in heard_routing if key == k] == \
                ["__keyevent@0__:set", "__keyevent@0__:del"], heard_routing
        mine = [k for k in keys if owners[k] == srv.resp]
        heard_here = messages(subs[1], 2 * len(mine) + 1, timeout=2)
        assert sorted(key for _, key in heard_here) == sorted(mine * 2), (mine, heard_here)
    finally:
        routing.config_set("notify-keyspace-events", "")
        for p in subs:
            p.close()
