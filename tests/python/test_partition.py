"""Partitions: a master cut off from the coordinator and its backups (but not from its clients)
stops acknowledging once its lease runs out, before the coordinator declares it dead; every
write it acknowledged is on the new owner; once healed it is fenced and stops.

Each process runs on a host of its own: a network namespace joined to the others by a veth pair
on a bridge (in a namespace of its own too). The test itself reaches every host from a veth in
its own namespace, like a client on the same network. A partition is a blackhole route on both
sides, so the master's packets to the coordinator and its backups go nowhere (the connection
errors are not `refused`: to the master the coordinator is unreachable, not gone)."""

import threading
import time

import pytest
import redis
from redis.cluster import RedisCluster

from conftest import Cluster
from netns import Net
from test_failures import Keys, ramlog, server_id_of, status, wait_declared_dead, wait_settled
from conftest import wait_until


@pytest.fixture
def net():
    n = Net(3)
    yield n
    n.close()


def direct_load(client, keys, model, log, stop):
    """Writes then reads each key on the partitioned master, one request at a time; `log` gets
    (started, finished, what, reply) for every request."""
    seq = 0
    while not stop.is_set():
        for k in keys:
            if stop.is_set():
                break
            seq += 1
            value = f"p{seq}".encode()
            started = time.time()
            try:
                client.set(k, value)
                model.acked_write(k, value)
                log.append((started, time.time(), "set", "OK"))
            except redis.exceptions.RedisError as e:
                model.failed_write(k, value)
                log.append((started, time.time(), "set", f"{type(e).__name__}: {e}"))
                time.sleep(0.005)
            started = time.time()
            try:
                log.append((started, time.time(), "get", ("data", client.get(k))))
            except redis.exceptions.RedisError as e:
                log.append((started, time.time(), "get", f"{type(e).__name__}: {e}"))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_partitioned_master_acknowledges_nothing_after_its_lease(tmp_path, net, mode):
    """Cut a master off from the coordinator and its backups while a client keeps writing and
    reading its keys directly. Once its lease (3/4 of dead-after) has run out, no request gets
    `OK` or data; it is declared dead and its tablets restored elsewhere. With `sync`, every write
    it acknowledged is on the new owner. Writes on the new owner are never read back old from
    the cut-off master. Healed, the old master learns it was replaced and stops."""
    dead_after = 0.4
    lease = 0.75 * dead_after
    c = Cluster(tmp_path, servers=3, net=net)
    stop = threading.Event()
    loader = None
    try:
        if mode != "sync":
            ramlog("table", "set-mode", "default", mode, "--coordinator", c.coordinator_addr)
            time.sleep(0.5)
        rc = RedisCluster(host=c.servers[1].ip, port=c.servers[1].resp, socket_timeout=5)
        victim = server_id_of(c, status(c), 0)
        model = Keys()
        own, n = [], 0
        while len(own) < 30:
            k = f"k{n}"
            n += 1
            if rc.get_node_from_key(k).port == c.servers[0].resp:
                rc.set(k, b"before")
                model.acked_write(k, b"before")
                own.append(k)
        direct = redis.Redis(host=c.servers[0].ip, port=c.servers[0].resp, socket_timeout=2)
        log = []
        loader = threading.Thread(target=direct_load, args=(direct, own, model, log, stop), daemon=True)
        loader.start()
        assert wait_until(lambda: sum(1 for e in log if e[3] == "OK") >= 50, timeout=10)

        net.cut(net.server(0), [net.coordinator] + net.servers[1:])
        cut_done = time.time()
        wait_declared_dead(c, victim)
        declared_seen = time.time()
        wait_settled(c, copies=False, timeout=30)
        time.sleep(0.5)
        stop.set()
        loader.join(timeout=10)
        assert not loader.is_alive()

        after_lease = [e for e in log if e[0] > cut_done + lease]
        assert after_lease, "no request reached the cut-off master after its lease"
        assert not [e for e in after_lease if not isinstance(e[3], str) or e[3] == "OK"], after_lease[:10]
        assert all(e[3] != "OK" for e in log if e[0] > declared_seen)
        acked_cut = [e for e in log if cut_done < e[0] and e[3] == "OK"]

        if mode == "sync":
            # Every write the old master acknowledged is on the new owner.
            for k in own:
                model.read(k, rc.get(k), "after recovery")
            assert not model.violations, (model.violations[:10], acked_cut[:5])

        # New values on the new owner; the cut-off master never serves the old ones.
        for k in own:
            rc.set(k, b"new")
        answers = []
        for k in own:
            for op in (lambda: ("data", direct.get(k)), lambda: ("set", direct.set(k, b"zombie"))):
                try:
                    answers.append(op())
                except redis.exceptions.RedisError as e:
                    answers.append(f"{type(e).__name__}: {e}")
        assert not [a for a in answers if not isinstance(a, str)], answers[:10]

        # Healed, it learns it was declared dead and stops (its epoch is fenced).
        net.heal()
        c.servers[0].proc.wait(timeout=15)
        assert all(rc.get(k) == b"new" for k in own)
    finally:
        stop.set()
        if loader is not None:
            loader.join(timeout=10)
        c.stop()
