"""A 3-server cluster with its coordinator, through real Redis clients: RedisCluster, redis-cli -c,
MOVED and CROSSSLOT, CLUSTER SLOTS/SHARDS/NODES/INFO, and the routing port for plain clients."""

import subprocess

import pytest
import redis
from redis.cluster import RedisCluster

from conftest import wait_until


def cluster_client(cluster, **kwargs):
    return RedisCluster(host="127.0.0.1", port=cluster.servers[0].resp, socket_timeout=10, **kwargs)


def nodes_by_slot(cluster):
    """slot -> port of its master, from CLUSTER NODES of the first server."""
    text = redis.Redis(port=cluster.servers[0].resp, decode_responses=True).execute_command("CLUSTER", "NODES")
    if isinstance(text, dict):  # redis-py may parse it
        raise AssertionError("expected the raw CLUSTER NODES text")
    owner = {}
    for line in text.strip().splitlines():
        fields = line.split()
        port = int(fields[1].split("@")[0].split(":")[1])
        for r in fields[8:]:
            a, _, b = r.partition("-")
            for slot in range(int(a), int(b or a) + 1):
                owner[slot] = port
    return owner


def test_redis_cluster_client_writes_and_reads_10000_keys(shared_cluster):
    c = shared_cluster
    redis.Redis(port=c.servers[0].routing).flushall()
    rc = cluster_client(c, decode_responses=True)
    keys = [f"key:{i}" for i in range(10000)]
    for k in keys:
        assert rc.set(k, k + "-v")
    for k in keys:
        assert rc.get(k) == k + "-v"
    # Each key lives on the master the map names, and only there.
    owner = nodes_by_slot(c)
    assert len(owner) == 16384 and len(set(owner.values())) == 3
    plain = {s.resp: redis.Redis(port=s.resp, decode_responses=True) for s in c.servers}
    for k in keys[::97]:
        slot = plain[c.servers[0].resp].execute_command("CLUSTER", "KEYSLOT", k)
        master = owner[slot]
        assert plain[master].get(k) == k + "-v"
        for port, client in plain.items():
            if port != master:
                with pytest.raises(redis.exceptions.MovedError, match=f"^{slot} 127.0.0.1:{master}$"):
                    client.get(k)
    # Every server holds about a third of the keys.
    sizes = [client.dbsize() for client in plain.values()]
    assert sum(sizes) == len(keys)
    assert all(s > len(keys) // 5 for s in sizes), sizes
    rc.close()


def test_cluster_commands_describe_the_map(shared_cluster):
    c = shared_cluster
    r = redis.Redis(port=c.servers[1].resp)
    slots = r.execute_command("CLUSTER", "SLOTS")
    covered = sorted((int(a), int(b)) for a, b, *_ in slots)
    assert covered[0][0] == 0 and covered[-1][1] == 16383
    for (a1, b1), (a2, b2) in zip(covered, covered[1:]):
        assert b1 + 1 == a2
    ports = {int(entry[2][1]) for entry in slots}
    assert ports == {s.resp for s in c.servers}
    shards = r.execute_command("CLUSTER", "SHARDS")
    assert len(shards) == 3
    info = r.execute_command("CLUSTER", "INFO")
    info = info.decode() if isinstance(info, bytes) else info
    assert "cluster_enabled:1" in info and "cluster_state:ok" in info
    assert "cluster_known_nodes:3" in info and "cluster_slots_assigned:16384" in info
    myid = r.execute_command("CLUSTER", "MYID")
    nodes = r.execute_command("CLUSTER", "NODES")
    nodes = nodes.decode() if isinstance(nodes, bytes) else nodes
    mine = [l for l in nodes.splitlines() if "myself" in l]
    assert len(mine) == 1 and mine[0].split()[0] == (myid.decode() if isinstance(myid, bytes) else myid)
    # COUNTKEYSINSLOT / GETKEYSINSLOT on the slot's master.
    rc = cluster_client(c)
    rc.set("{slotted}a", "1")
    rc.set("{slotted}b", "2")
    slot = r.execute_command("CLUSTER", "KEYSLOT", "{slotted}")
    master = nodes_by_slot(c)[slot]
    m = redis.Redis(port=master)
    assert m.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 2
    assert sorted(m.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10)) == [b"{slotted}a", b"{slotted}b"]
    with pytest.raises(redis.ResponseError, match="Invalid slot"):
        m.execute_command("CLUSTER", "COUNTKEYSINSLOT", 16384)
    rc.close()


def test_crossslot_and_readonly(shared_cluster):
    c = shared_cluster
    owner = nodes_by_slot(c)
    r = redis.Redis(port=c.servers[0].resp)
    with pytest.raises(redis.exceptions.ClusterCrossSlotError, match="^Keys in request don't hash to the same slot$"):
        r.execute_command("MSET", "a", "1", "b", "2")
    with pytest.raises(redis.exceptions.ClusterCrossSlotError):
        r.execute_command("MGET", "a", "b")
    out = subprocess.run(["redis-cli", "-p", str(c.servers[0].resp), "DEL", "a", "b"], capture_output=True, text=True, timeout=10)
    assert out.stdout.strip() == "CROSSSLOT Keys in request don't hash to the same slot", out
    # Keys with one hash tag are one slot: allowed on that slot's master.
    slot = r.execute_command("CLUSTER", "KEYSLOT", "{t}")
    m = redis.Redis(port=owner[slot], decode_responses=True)
    assert m.mset({"{t}1": "x", "{t}2": "y"}) is True
    assert m.mget("{t}1", "{t}2") == ["x", "y"]
    assert m.execute_command("READONLY") is True
    assert m.execute_command("READWRITE") is True


def test_redis_cli_c_follows_moved(shared_cluster):
    c = shared_cluster
    for i in range(20):
        key = f"cli:{i}"
        out = subprocess.run(
            ["redis-cli", "-c", "-p", str(c.servers[i % 3].resp), "SET", key, f"v{i}"],
            capture_output=True, text=True, timeout=10,
        )
        assert out.stdout.strip() == "OK", out
        out = subprocess.run(
            ["redis-cli", "-c", "-p", str(c.servers[(i + 1) % 3].resp), "GET", key],
            capture_output=True, text=True, timeout=10,
        )
        assert out.stdout.strip() == f"v{i}", out


def test_routing_port_serves_plain_clients_across_servers(shared_cluster):
    c = shared_cluster
    owner = nodes_by_slot(c)
    for s in c.servers:
        r = redis.Redis(port=s.routing, decode_responses=True)
        keys = [f"route:{s.routing}:{i}" for i in range(300)]
        assert len({owner[r.execute_command("CLUSTER", "KEYSLOT", k)] for k in keys}) == 3
        # One pipelined MSET and MGET across all servers, plus per-key commands, in order.
        pairs = {k: f"v{i}" for i, k in enumerate(keys)}
        p = r.pipeline(transaction=False)
        p.mset(pairs)
        p.mget(keys)
        for k in keys[:50]:
            p.incr(k + ":n")
            p.get(k + ":n")
        p.delete(*keys[:10])
        p.exists(*keys)
        out = p.execute()
        assert out[0] is True
        assert out[1] == [pairs[k] for k in keys]
        for i in range(50):
            assert out[2 + 2 * i] == 1 and out[3 + 2 * i] == "1"
        assert out[-2] == 10
        assert out[-1] == len(keys) - 10
        # The writes landed on their masters.
        for k in keys[10:40]:
            slot = r.execute_command("CLUSTER", "KEYSLOT", k)
            assert redis.Redis(port=owner[slot], decode_responses=True).get(k) == pairs[k]


def test_routing_port_with_redis_benchmark(shared_cluster):
    c = shared_cluster
    out = subprocess.run(
        ["redis-benchmark", "-p", str(c.servers[1].routing), "-t", "set,get", "-n", "20000", "-P", "8", "-q",
         "-r", "100000"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "SET:" in out.stdout and "GET:" in out.stdout, out.stdout
    # redis-benchmark --cluster against the cluster ports.
    out = subprocess.run(
        ["redis-benchmark", "--cluster", "-p", str(c.servers[0].resp), "-t", "set,get", "-n", "20000", "-q",
         "-r", "100000"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SET:" in out.stdout and "GET:" in out.stdout, out.stdout


def test_server_with_a_wrong_coordinator_address_fails_clearly(tmp_path):
    from conftest import free_port, ramlog_bin

    dead = free_port()
    # It gives up after join_timeout_ms (30 s by default; 2 s here).
    config = tmp_path / "join.toml"
    config.write_text("join_timeout_ms = 2000\n")
    proc = subprocess.run(
        [ramlog_bin(), "server", "--coordinator", f"127.0.0.1:{dead}", "--resp-port", str(free_port()),
         "--native-port", str(free_port()), "--admin-port", "0", "--data-dir", str(tmp_path / "d"),
         "--memory", "64MiB", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert f"cannot reach the coordinator at 127.0.0.1:{dead} within 2 s" in proc.stderr, proc.stderr


def test_server_of_another_cluster_is_refused(tmp_path):
    from conftest import Cluster

    a = Cluster(tmp_path / "a", servers=1)
    b = Cluster(tmp_path / "b", servers=1)
    try:
        # Server 0 of cluster a restarts pointed at cluster b's coordinator.
        s = a.servers[0]
        s.proc.terminate()
        s.proc.wait(timeout=10)
        from conftest import free_port, ramlog_bin

        proc = subprocess.run(
            [ramlog_bin(), "server", "--coordinator", b.coordinator_addr, "--resp-port", str(free_port()),
             "--native-port", str(free_port()), "--admin-port", "0", "--data-dir", str(tmp_path / "a" / "server-0"),
             "--memory", "64MiB"],
            capture_output=True, text=True, timeout=60,
        )
        assert proc.returncode != 0
        assert "belongs to cluster" in proc.stderr, proc.stderr
        # Cluster b's map is untouched: one server.
        assert "cluster_known_nodes:1" in b.cluster_info(b.servers[0].resp)
    finally:
        a.stop()
        b.stop()
