"""Mirror mode: each tablet's first backup also holds the tablet in memory, applying every write
before it acknowledges it; when the master dies the mirror takes over without replaying logs.
Real processes on loopback; each test starts its own cluster and stops every process by pid."""

import json
import random
import signal
import subprocess
import threading
import time
import urllib.request

from redis.crc import key_slot

from conftest import Cluster, ramlog_bin, wait_until
from test_failures import (Keys, check_all, ramlog, server_id_of, status, wait_declared_dead,
                           wait_settled, writer)


def logs(c: Cluster, i: int) -> str:
    return (c.tmp_path / f"server-{i}.log").read_text()


def server_status(c: Cluster, i: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{c.servers[i].admin}/status", timeout=5) as r:
        return json.loads(r.read())


def mirrors_ready(c: Cluster, alive=lambda i: True) -> bool:
    """Every tablet has a mirror with the whole stream whose memory is built (its /status)."""
    st = status(c)
    table = next(t for t in st["tables"] if t["name"] == "default")
    if st["recovering_tablets"] or st["pending_copies"]:
        return False
    if any(t["mirror"] is None for t in table["tablets"]):
        return False
    ready = set()
    for i in range(len(c.servers)):
        if not alive(i) or c.servers[i].proc.poll() is not None:
            continue
        sid = server_id_of(c, st, i)
        try:
            mirrors = server_status(c, i)["metrics"]["replication"]["mirrors"]
        except (OSError, KeyError, ValueError):
            return False
        ready |= {(sid, m["first_slot"]) for m in mirrors if m["state"] == "ready"}
    return all((t["mirror"], t["first_slot"]) in ready for t in table["tablets"])


def set_mirror(c: Cluster):
    ramlog("table", "set-mode", "default", "mirror", "--coordinator", c.coordinator_addr)
    assert wait_until(lambda: mirrors_ready(c), timeout=20, interval=0.1), json.dumps(status(c))[:2000]


def test_mirrors_take_over_a_killed_master_under_load_twenty_times(tmp_path):
    """kill -9 a random server 20 times under a RedisCluster load on a mirrored table, restarting
    it each time: every tablet of the dead master is taken over by its mirror (no replay), no
    acknowledged write is lost, no deleted key comes back, no read is stale."""
    c = Cluster(tmp_path, servers=3)
    down = set()
    alive = lambda i: i not in down  # noqa: E731
    keys = Keys()
    stop = threading.Event()
    threads = [threading.Thread(target=writer, args=(c, keys, alive, t, stop), daemon=True)
               for t in range(3)]
    rng = random.Random(37)
    try:
        set_mirror(c)
        for t in threads:
            t.start()
        assert wait_until(lambda: keys.acked > 200, timeout=20)
        taken_over = 0
        for round_ in range(20):
            victim = rng.randrange(3)
            vid = server_id_of(c, status(c), victim)
            mastered = sum(1 for t in status(c)["tables"][0]["tablets"] if t["master"] == vid)
            before = sum(logs(c, i).count("mirror taking over") for i in range(3) if i != victim)
            time.sleep(rng.uniform(0.05, 0.5))
            c.servers[victim].proc.send_signal(signal.SIGKILL)
            c.servers[victim].proc.wait(timeout=5)
            down.add(victim)
            wait_declared_dead(c, vid)
            wait_settled(c, copies=False, timeout=30)
            after = sum(logs(c, i).count("mirror taking over") for i in range(3) if i != victim)
            taken_over += after - before
            assert after - before >= mastered, (round_, mastered, after - before)
            c.restart_server(victim)
            down.discard(victim)
            assert wait_until(lambda: mirrors_ready(c), timeout=60, interval=0.1), json.dumps(status(c))[:2000]
        acked = keys.acked
        assert wait_until(lambda: keys.acked > acked + 100, timeout=20)
        stop.set()
        for t in threads:
            t.join(timeout=10)
        check_all(c, keys, alive)
        assert taken_over > 0
    finally:
        stop.set()
        c.stop()


def test_readonly_connections_read_from_the_mirror(tmp_path):
    """CLUSTER SLOTS lists each mirrored range's mirror as its replica; a READONLY connection
    reads the range's keys there (every acknowledged write is in the mirror's memory), while a
    connection without READONLY is sent to the master; writes always are; RedisCluster with
    replica reads gets every value."""
    import redis
    from redis.cluster import RedisCluster
    c = Cluster(tmp_path, servers=3)
    try:
        set_mirror(c)
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=5)
        for n in range(300):
            rc.set(f"m{n}", f"v{n}")
        slots = redis.Redis(port=c.servers[0].resp).execute_command("CLUSTER", "SLOTS")
        assert slots and all(len(r) == 4 for r in slots), slots[:3]
        assert all(r[2][1] != r[3][1] for r in slots)
        by_port = {s.resp: s for s in c.servers}
        read_on_mirror = 0
        for n in range(300):
            key = f"m{n}"
            slot = rc.keyslot(key)
            r = next(r for r in slots if r[0] <= slot <= r[1])
            mirror_port = r[3][1]
            plain = redis.Redis(port=mirror_port, socket_timeout=5)
            try:
                plain.get(key)
                raise AssertionError("a connection without READONLY was served by the mirror")
            except redis.exceptions.MovedError:
                pass
            ro = redis.Redis(port=mirror_port, socket_timeout=5)
            ro.execute_command("READONLY")
            assert ro.get(key) == f"v{n}".encode()
            read_on_mirror += 1
            try:
                ro.set(key, "x")
                raise AssertionError("the mirror took a write")
            except redis.exceptions.MovedError:
                pass
            assert mirror_port in by_port
        assert read_on_mirror == 300
        # DBSIZE and SCAN count what a server masters, not what it mirrors.
        sizes = [redis.Redis(port=s.resp).dbsize() for s in c.servers]
        assert sum(sizes) == 300, sizes
        scanned = [k for s in c.servers for k in redis.Redis(port=s.resp).scan_iter(count=1000)]
        assert len(scanned) == 300 and len(set(scanned)) == 300, len(scanned)
        replica_reads = RedisCluster(host="127.0.0.1", port=c.servers[1].resp, socket_timeout=5,
                                     read_from_replicas=True)
        for n in range(300):
            rc.set(f"m{n}", f"w{n}")
            assert replica_reads.get(f"m{n}") == f"w{n}".encode()
        # FLUSHALL on one server empties what it masters (and so its mirrors' copies), not the
        # tablets it mirrors for others.
        first = c.servers[0].resp
        redis.Redis(port=first).flushall()
        for n in range(300):
            key = f"m{n}"
            slot = rc.keyslot(key)
            r = next(r for r in slots if r[0] <= slot <= r[1])
            expected = None if r[2][1] == first else f"w{n}".encode()
            assert rc.get(key) == expected, key
            if r[3][1] == first:
                ro = redis.Redis(port=first)
                ro.execute_command("READONLY")
                assert ro.get(key) == expected, key
    finally:
        c.stop()


def start_load(c, keys, alive, n=3):
    stop = threading.Event()
    threads = [threading.Thread(target=writer, args=(c, keys, alive, t, stop), daemon=True)
               for t in range(n)]
    for t in threads:
        t.start()
    assert wait_until(lambda: keys.acked > 200, timeout=20)
    return stop, threads


def test_the_mirror_dies_and_the_master_goes_on_with_a_new_one(tmp_path):
    """kill -9 a server under load: the tablets it mirrored get their other live backup as
    mirror, which builds its memory; nothing acknowledged is lost; restarted, it mirrors again
    once copied."""
    c = Cluster(tmp_path, servers=3)
    down = set()
    alive = lambda i: i not in down  # noqa: E731
    keys = Keys()
    stop, threads = None, []
    try:
        set_mirror(c)
        stop, threads = start_load(c, keys, alive)
        st = status(c)
        victim = server_id_of(c, st, 2)
        mirrored = [t["first_slot"] for t in st["tables"][0]["tablets"] if t["mirror"] == victim]
        assert mirrored
        c.servers[2].proc.send_signal(signal.SIGKILL)
        c.servers[2].proc.wait(timeout=5)
        down.add(2)
        wait_declared_dead(c, victim)
        wait_settled(c, copies=False, timeout=30)
        assert wait_until(lambda: all(
            t["mirror"] not in (None, victim) for t in status(c)["tables"][0]["tablets"]), timeout=10)
        ready = lambda: all(  # noqa: E731
            (t["mirror"], t["first_slot"]) in {
                (server_id_of(c, status(c), i), m["first_slot"])
                for i in (0, 1)
                for m in server_status(c, i)["metrics"]["replication"]["mirrors"] if m["state"] == "ready"}
            for t in status(c)["tables"][0]["tablets"] if not t["pending"])
        assert wait_until(ready, timeout=30, interval=0.2)
        acked = keys.acked
        assert wait_until(lambda: keys.acked > acked + 100, timeout=20)
        c.restart_server(2)
        down.discard(2)
        assert wait_until(lambda: mirrors_ready(c), timeout=60, interval=0.2)
        stop.set()
        for t in threads:
            t.join(timeout=10)
        check_all(c, keys, alive)
    finally:
        if stop:
            stop.set()
        c.stop()


def test_master_and_mirror_both_die_and_the_backups_restore(tmp_path):
    """4 servers, R = 2: kill -9 a tablet's master and its mirror together under load; the
    remaining backup restores the tablet from its logs (the failure path), with every
    acknowledged write."""
    c = Cluster(tmp_path, servers=4)
    down = set()
    alive = lambda i: i not in down  # noqa: E731
    keys = Keys()
    stop, threads = None, []
    try:
        set_mirror(c)
        stop, threads = start_load(c, keys, alive)
        st = status(c)
        t = st["tables"][0]["tablets"][0]
        idx = {server_id_of(c, st, i): i for i in range(4)}
        pair = [idx[t["master"]], idx[t["mirror"]]]
        replayed_before = sum(logs(c, i).count("restoring a tablet from this server's backup logs")
                              for i in range(4) if i not in pair)
        for i in pair:
            c.servers[i].proc.send_signal(signal.SIGKILL)
        for i in pair:
            c.servers[i].proc.wait(timeout=5)
            down.add(i)
        dead = {s for s in idx if idx[s] in pair}
        assert wait_until(
            lambda: all(s["state"] == "dead" for s in status(c)["servers"] if s["id"] in dead),
            timeout=10, interval=0.02)
        wait_settled(c, copies=False, timeout=30)
        replayed = sum(logs(c, i).count("restoring a tablet from this server's backup logs")
                       for i in range(4) if i not in pair) - replayed_before
        assert replayed >= 1
        acked = keys.acked
        assert wait_until(lambda: keys.acked > acked + 100, timeout=20)
        stop.set()
        for th in threads:
            th.join(timeout=10)
        check_all(c, keys, alive)
    finally:
        if stop:
            stop.set()
        c.stop()


def native_master(c: Cluster, st: dict, table_id: int, key: str) -> int:
    table = next(t for t in st["tables"] if t["id"] == table_id)
    slot = key_slot(key.encode())
    t = next(t for t in table["tablets"] if t["first_slot"] <= slot <= t["last_slot"])
    server = next(s for s in st["servers"] if s["id"] == t["master"])
    return int(server["addresses"]["native"].rsplit(":", 1)[1])


def native(*args):
    out = subprocess.run([ramlog_bin(), *args], capture_output=True, text=True, timeout=30)
    return out.returncode, out.stdout.strip(), out.stderr.strip()


def test_a_mirrored_and_a_durable_table_keep_their_own_promises(tmp_path):
    """The default table mirrored, table `ledger` durable, on the same servers: a killed master's
    mirrored tablets are taken over by their mirrors and its durable ones restored from logs,
    with everything in both; then the whole cluster is killed and restarted and every durable
    write is back."""
    from redis.cluster import RedisCluster
    c = Cluster(tmp_path, servers=3)
    try:
        set_mirror(c)
        ramlog("table", "create", "ledger", "--mode", "durable", "--coordinator", c.coordinator_addr)
        st = status(c)
        ledger = next(t["id"] for t in st["tables"] if t["name"] == "ledger")
        time.sleep(0.5)
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=5)
        for n in range(300):
            rc.set(f"mir{n}", f"m{n}")
        for n in range(60):
            key = f"led{n}"
            rc_, out, err = native("set", "-p", str(native_master(c, st, ledger, key)),
                                   "--table", str(ledger), key, f"l{n}")
            assert rc_ == 0, err

        def check_ledger(st):
            for n in range(60):
                key = f"led{n}"
                rc_, out, err = native("get", "-p", str(native_master(c, st, ledger, key)),
                                       "--table", str(ledger), key)
                assert rc_ == 0 and out == f"l{n}", (key, out, err)

        victim = server_id_of(c, st, 0)
        c.servers[0].proc.send_signal(signal.SIGKILL)
        c.servers[0].proc.wait(timeout=5)
        wait_declared_dead(c, victim)
        wait_settled(c, copies=False, timeout=30)
        took_over = sum(logs(c, i).count("mirror taking over") for i in (1, 2))
        replayed = sum(logs(c, i).count("restoring a tablet from this server's backup logs") for i in (1, 2))
        assert took_over >= 1 and replayed >= 1, (took_over, replayed)
        rc = RedisCluster(host="127.0.0.1", port=c.servers[1].resp, socket_timeout=5)
        assert all(rc.get(f"mir{n}") == f"m{n}".encode() for n in range(300))
        check_ledger(status(c))

        c.restart_server(0)
        assert wait_until(lambda: mirrors_ready(c), timeout=60, interval=0.2)
        for p in [c.coordinator] + [s.proc for s in c.servers]:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=5)
        c.restart_coordinator()
        for i in range(3):
            c.restart_server(i)
        wait_settled(c, copies=False, timeout=60)
        c.wait_ok(timeout=30)
        check_ledger(status(c))
    finally:
        c.stop()
