"""A second failure while the first is being repaired: the restorer killed halfway through its
replay, and a server killed while re-protection copies are still running. With R = 2 on 4
servers every tablet keeps a copy through both, so nothing acknowledged is lost, nothing
deleted comes back and every tablet ends up served. Real processes on loopback; each test
starts its own cluster and stops every process by its pid."""

import json
import random
import signal
import threading

from redis.cluster import RedisCluster
from redis.crc import key_slot

from conftest import Cluster, wait_until
from test_failures import (Keys, check_all, server_id_of, status, try_again, wait_declared_dead,
                           wait_settled, writer)
from test_large_master_failover import get_all
from test_mirror import server_status


def tablet_of(st: dict, key: str) -> dict:
    slot = key_slot(key.encode())
    table = next(t for t in st["tables"] if t["name"] == "default")
    return next(t for t in table["tablets"] if t["first_slot"] <= slot <= t["last_slot"])


def index_of(c: Cluster, st: dict, server_id: int) -> int:
    return next(i for i in range(len(c.servers)) if server_id_of(c, st, i) == server_id)


def preload(c: Cluster, keys: list, value, at=0):
    """SETs `keys` (pipelined, through a RedisCluster client) to `value(key)`."""
    rc = RedisCluster(host="127.0.0.1", port=c.servers[at].resp, socket_timeout=10)
    for n in range(0, len(keys), 500):
        pipe = rc.pipeline()
        for k in keys[n:n + 500]:
            pipe.set(k, value(k))
        assert all(pipe.execute())
    rc.close()


def read_all(c: Cluster, at: int, keys) -> dict:
    """key -> value read through server `at`'s cluster port, pipelined, once no key is refused
    with -TRYAGAIN (servers apply the final map within a heartbeat)."""
    rc = RedisCluster(host="127.0.0.1", port=c.servers[at].resp, socket_timeout=10)
    keys = list(keys)
    assert wait_until(lambda: not any(try_again(lambda: rc.get(k)) for k in keys[::50]), timeout=5)
    got = {}
    for n in range(0, len(keys), 500):
        batch = keys[n:n + 500]
        got.update(zip(batch, get_all(rc, batch)))
    rc.close()
    return got


def settle_and_check(c, st, keys, alive, threads, stop, dead):
    """After the last of `dead` was killed: waits for its declaration and the restores, lets the
    writers go on a while, stops them and checks every key they wrote; the servers in `dead` are
    dead, the others up, and every tablet is served by a survivor. Returns the final status."""
    for d in dead:
        wait_declared_dead(c, d)
    wait_settled(c, copies=False, timeout=60)
    acked = keys.acked
    assert wait_until(lambda: keys.acked > acked + 200, timeout=30), "the writers stalled"
    stop.set()
    for t in threads:
        t.join(timeout=30)
    check_all(c, keys, alive)
    final = status(c)
    survivors = {server_id_of(c, st, i) for i in range(len(c.servers)) if alive(i)}
    states = {s["id"]: s["state"] for s in final["servers"]}
    assert states == {**{s: "up" for s in survivors}, **{d: "dead" for d in dead}}, states
    tablets = final["tables"][0]["tablets"]
    assert all(t["master"] in survivors and not t["recovering"] for t in tablets), tablets
    return final


def test_the_restorer_killed_halfway_through_its_replay_and_the_other_backup_restores(tmp_path):
    """4 servers, R = 2; 48 000 keys on one master, a third of them then overwritten and a
    seventh deleted; restores pause 250 ms after every 1024 objects replayed (a test knob).
    Under RedisCluster writers the master is killed -9; once one of its restorers' `/status`
    shows a restore with more than 0 and fewer than all of its tablet's objects replayed, that
    restorer is killed -9 as well. The tablet's other backup restores it and masters it at a
    newer epoch; every tablet ends up mastered by one of the two survivors; every preloaded key holds its newest
    value, no deleted key is back; the writers' history holds."""
    c = Cluster(tmp_path, servers=4, coordinator_args=["--default-replicas", "2"],
                env={"RAMLOG_TEST_RESTORE_PAUSE_MS": "250"})
    down = set()
    alive = lambda i: i not in down  # noqa: E731
    keys = Keys()
    stop = threading.Event()
    threads = [threading.Thread(target=writer, args=(c, keys, alive, t, stop), daemon=True)
               for t in range(2)]
    try:
        st = status(c)
        assert st["tables"][0]["replicas"] == 2
        first_id = server_id_of(c, st, 0)
        owned = [k for k in (f"h{n}" for n in range(200_000)) if tablet_of(st, k)["master"] == first_id][:48_000]
        assert len(owned) == 48_000
        preload(c, owned, lambda k: f"first:{k}")
        expected = {k: f"first:{k}".encode() for k in owned}
        rng = random.Random(5)
        overwritten = rng.sample(owned, len(owned) // 3)
        preload(c, overwritten, lambda k: f"second:{k}")
        expected.update({k: f"second:{k}".encode() for k in overwritten})
        deleted = rng.sample(owned, len(owned) // 7)
        rc = RedisCluster(host="127.0.0.1", port=c.servers[1].resp, socket_timeout=10)
        for n in range(0, len(deleted), 500):
            pipe = rc.pipeline()
            for k in deleted[n:n + 500]:
                pipe.delete(k)
            pipe.execute()
        expected.update({k: None for k in deleted})
        live_per_tablet = {}
        for k, v in expected.items():
            if v is not None:
                first_slot = tablet_of(st, k)["first_slot"]
                live_per_tablet[first_slot] = live_per_tablet.get(first_slot, 0) + 1

        for t in threads:
            t.start()
        assert wait_until(lambda: keys.acked > 200, timeout=20)
        down.add(0)
        c.servers[0].proc.send_signal(signal.SIGKILL)
        c.servers[0].proc.wait(timeout=5)

        def halfway():
            """(server index, first slot, objects) of a restore that has replayed part of its
            tablet, or None."""
            for t in status(c)["tables"][0]["tablets"]:
                if not (t["recovering"] and t["restorer"] is not None):
                    continue
                i = index_of(c, st, t["restorer"])
                try:
                    jobs = server_status(c, i)["metrics"]["replication"]["recovery"]
                except OSError:
                    continue
                for j in jobs:
                    total = live_per_tablet.get(j["first_slot"], 0)
                    if j["kind"] == "restore" and not j["done"] and 0 < j["objects"] < total:
                        return i, j["first_slot"], j["objects"], total
            return None

        found = []
        assert wait_until(lambda: found.append(halfway()) or found[-1], timeout=15, interval=0.02), \
            json.dumps(status(c))[:2000]
        restorer, first_slot, objects, total = found[-1]
        restorer_id = server_id_of(c, st, restorer)
        down.add(restorer)
        c.servers[restorer].proc.send_signal(signal.SIGKILL)
        c.servers[restorer].proc.wait(timeout=5)
        before = next(t for t in st["tables"][0]["tablets"] if t["first_slot"] == first_slot)

        final = settle_and_check(c, st, keys, alive, threads, stop, dead={first_id, restorer_id})
        tablets = final["tables"][0]["tablets"]
        half = next(t for t in tablets if t["first_slot"] == first_slot)
        assert half["epoch"] > before["epoch"] and half["master"] in set(before["backups"]) - {restorer_id}, \
            (half, before)

        got = read_all(c, next(iter(i for i in range(4) if alive(i))), expected)
        wrong = [(k, expected[k], got[k]) for k in expected if got[k] != expected[k]]
        assert not wrong, (len(wrong), wrong[:10], (restorer, first_slot, objects, total))
        print(f"restorer {restorer} killed at {objects} of {total} objects of the tablet at slot {first_slot}; "
              f"{keys.acked} writes acknowledged")
    finally:
        stop.set()
        c.stop()


def test_a_second_server_killed_during_re_protection(tmp_path):
    """4 servers, R = 2, copies slowed to 256 KiB/s; 12 MiB preloaded; under RedisCluster
    writers a master is killed -9 and, once none of its tablets is recovering while copies are
    still pending, the server that masters the most tablets with pending copies (restored ones
    among them) is killed -9 too. Every tablet still had a copy on a live server that is not
    a fresh replacement (the promise of R = 2 when the second failure follows a completed
    restore), so: every tablet ends up mastered by one of the two survivors, no acknowledged
    write is lost, no deleted key comes back, every preloaded key holds its value."""
    config = tmp_path / "slow-copy.toml"
    config.write_text("recovery_copy_bytes_per_sec = 262144\n")
    c = Cluster(tmp_path, servers=4, coordinator_args=["--default-replicas", "2"],
                extra_args=("--config", str(config)))
    down = set()
    alive = lambda i: i not in down  # noqa: E731
    keys = Keys()
    stop = threading.Event()
    threads = [threading.Thread(target=writer, args=(c, keys, alive, t, stop), daemon=True)
               for t in range(2)]
    try:
        st = status(c)
        assert st["tables"][0]["replicas"] == 2
        first_id = server_id_of(c, st, 0)
        filler = [f"fill{n}" for n in range(6000)]
        preload(c, filler, lambda k: f"{k}:".encode() * (2048 // len(k)))
        expected = {k: f"{k}:".encode() * (2048 // len(k)) for k in filler}
        for t in threads:
            t.start()
        assert wait_until(lambda: keys.acked > 200, timeout=20)
        down.add(0)
        c.servers[0].proc.send_signal(signal.SIGKILL)
        c.servers[0].proc.wait(timeout=5)
        wait_declared_dead(c, first_id)
        wait_settled(c, copies=False, timeout=30)

        st = status(c)
        tablets = st["tables"][0]["tablets"]
        assert not any(t["recovering"] for t in tablets)
        pending = [t for t in tablets if t["pending"]]
        assert pending, "no copy pending right after the restore: slow the copies more"
        by_master = {}
        for t in pending:
            by_master[t["master"]] = by_master.get(t["master"], 0) + 1
        second_id = max(by_master, key=lambda m: (by_master[m], m))
        second = index_of(c, st, second_id)
        restored_there = [t for t in pending if t["master"] == second_id and t["epoch"] > 1]
        down.add(second)
        c.servers[second].proc.send_signal(signal.SIGKILL)
        c.servers[second].proc.wait(timeout=5)
        # What the second victim masters must have a live, non-fresh backup to restore from.
        for t in tablets:
            if t["master"] == second_id:
                holders = set(t["backups"]) - set(t["fresh"]) - {first_id, second_id}
                assert holders, t
        settle_and_check(c, st, keys, alive, threads, stop, dead={first_id, second_id})
        got = read_all(c, next(i for i in range(4) if alive(i)), expected)
        wrong = [(k, got[k][:30] if got[k] else None) for k in expected if got[k] != expected[k]]
        assert not wrong, (len(wrong), wrong[:10], len(restored_there))
        print(f"server {second} killed with {by_master[second_id]} tablets pending ({len(restored_there)} restored "
              f"there); {keys.acked} writes acknowledged")
    finally:
        stop.set()
        c.stop()
