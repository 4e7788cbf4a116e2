"""Recovery partitions: a dead master's large tablets are split into slot ranges restored in
parallel by the backups that hold their logs, each served the moment it is restored. Real
processes on loopback; the partition size is set small (`--recovery-partition-objects`) so that
a few thousand keys split."""

import json
import random
import signal
import threading
import time

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from conftest import Cluster, wait_until
from test_failures import Keys, check_all, server_id_of, status, wait_declared_dead, wait_settled, writer

PRELOAD = 40_000


def tablets(st):
    return st["tables"][0]["tablets"]


def master_of_slot(st, slot):
    return next(t["master"] for t in tablets(st) if t["first_slot"] <= slot <= t["last_slot"])


def index_of(c: Cluster, st, server_id):
    return next(i for i in range(len(c.servers)) if server_id_of(c, st, i) == server_id)


def preload(rc: RedisCluster):
    """PRELOAD keys of 64 B values, pipelined; every tenth deleted again. Returns what each key
    must hold (None: deleted)."""
    expected = {}
    pipe = rc.pipeline(transaction=False)
    for n in range(PRELOAD):
        key = f"p:{n}"
        value = f"{n:08d}".encode() * 8
        pipe.set(key, value)
        expected[key] = value
        if len(pipe) >= 2000:
            pipe.execute()
    pipe.execute()
    for n in range(0, PRELOAD, 10):
        pipe.delete(f"p:{n}")
        expected[f"p:{n}"] = None
        if len(pipe) >= 2000:
            pipe.execute()
    pipe.execute()
    return expected


def read_back(rc: RedisCluster, expected):
    pipe = rc.pipeline(transaction=False)
    keys = list(expected)
    wrong = []
    for at in range(0, len(keys), 2000):
        chunk = keys[at:at + 2000]
        for k in chunk:
            pipe.get(k)
        for k, got in zip(chunk, pipe.execute()):
            if got != expected[k]:
                wrong.append((k, got, expected[k]))
    return wrong


def test_a_dead_masters_tablets_recover_as_partitions_over_every_backup(tmp_path):
    """4 servers, R = 2. A master of about 10 000 keys (16 tablets of about 600) dies under a
    RedisCluster load, with partitions of at most 200 objects: its tablets are split into slot
    ranges, restored by both backups of each tablet, and served. Then the master of one
    restored partition dies while its backups still wait for its copy (copies slowed to 20 kB/s by
    `recovery_copy_bytes_per_sec`): the partition recovers whole, from its backups' logs of the tablet it was split off
    and their logs of the partition since. Every preloaded key holds its value, deleted ones stay
    deleted, no acknowledged write is lost."""
    config = tmp_path / "slow-copy.toml"
    config.write_text("recovery_copy_bytes_per_sec = 20000\n")
    c = Cluster(tmp_path, servers=4, extra_args=("--config", str(config)),
                coordinator_args=["--recovery-partition-objects", "200", "--default-replicas", "2"])
    down = set()
    alive = lambda i: i not in down  # noqa: E731
    keys = Keys()
    stop = threading.Event()
    threads = []
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=5)
        started = time.time()
        expected = preload(rc)
        print(f"preload of {PRELOAD} keys: {time.time() - started:.1f} s")
        st = status(c)
        count_before = len(tablets(st))
        victim_id = master_of_slot(st, 0)
        victim = index_of(c, st, victim_id)
        victim_tablets = [t for t in tablets(st) if t["master"] == victim_id]
        threads = [threading.Thread(target=writer, args=(c, keys, alive, t, stop), daemon=True)
                   for t in range(2)]
        for t in threads:
            t.start()
        assert wait_until(lambda: keys.acked > 100, timeout=20)

        down.add(victim)
        c.servers[victim].proc.send_signal(signal.SIGKILL)
        c.servers[victim].proc.wait(timeout=5)
        wait_declared_dead(c, victim_id)
        wait_settled(c, copies=False)
        st = status(c)
        parts = [t for t in tablets(st) if t.get("logs_from") is not None]
        # Each of the dead master's tablets (about 600 keys) split into 3 or 4 partitions.
        assert len(tablets(st)) >= count_before + 2 * len(victim_tablets), len(tablets(st))
        for vt in victim_tablets:
            own = [t for t in parts if t["logs_from"] == vt["first_slot"]]
            assert len(own) >= 3, (vt, own)
            assert own[0]["first_slot"] == vt["first_slot"] and own[-1]["last_slot"] == vt["last_slot"]
            # Both backups of the tablet restored some of its partitions.
            assert {t["master"] for t in own} == set(vt["backups"]), (vt, own)
        wrong = read_back(rc, expected)
        assert not wrong, wrong[:10]

        # A restored partition whose backups still wait for its copy: its master dies.
        st = status(c)
        copying = [t for t in tablets(st) if t.get("logs_from") is not None and t["pending"]]
        assert copying, json.dumps(tablets(st))[:3000]
        part = copying[0]
        # Writes to that partition after its restore: they are in its own logs only.
        slot_keys = [f"q:{n}" for n in range(20000)
                     if part["first_slot"] <= key_slot(f"q:{n}".encode()) <= part["last_slot"]][:50]
        assert slot_keys
        for k in slot_keys:
            rc.set(k, b"after")
            expected[k] = b"after"
        second_id = part["master"]
        second = index_of(c, st, second_id)
        down.add(second)
        c.servers[second].proc.send_signal(signal.SIGKILL)
        c.servers[second].proc.wait(timeout=5)
        wait_declared_dead(c, second_id)
        wait_settled(c, copies=False, timeout=60)
        st = status(c)
        again = next(t for t in tablets(st) if t["first_slot"] == part["first_slot"])
        assert again["last_slot"] == part["last_slot"], again
        rc = RedisCluster(host="127.0.0.1", port=c.servers[next(i for i in range(4) if alive(i))].resp,
                          socket_timeout=5)
        wrong = read_back(rc, expected)
        assert not wrong, wrong[:10]
        # The writers go on until they have had writes acknowledged after both deaths too (the
        # run may be over in a few seconds).
        acked = keys.acked
        assert wait_until(lambda: keys.acked > max(200, acked + 50), timeout=30), keys.acked
        stop.set()
        for t in threads:
            t.join(timeout=30)
        check_all(c, keys, alive)
    finally:
        stop.set()
        c.stop()


def recovery_jobs(admin):
    import urllib.request
    with urllib.request.urlopen(f"http://{admin}/status", timeout=5) as r:
        return json.load(r)["metrics"]["replication"]["recovery"]


def test_the_restore_a_client_waits_for_goes_first(tmp_path):
    """3 servers, R = 2, restores slowed (a 5 s pause every 1024 objects): a dead master's 16
    tablets queue on their restorers, two at a time each. Once a restorer shows three or more
    restores waiting, a plain client asks the routing port of the third server for a key of the
    last of them: that restore is marked asked for and ends while others queued before
    it still wait for their turn; progress shows in /status and in `ramlog cluster status`.
    The queue is read from the restorer itself after the kill, not guessed from the backups
    before it: the coordinator may spread a dead master's tablets over both backups."""
    # The asked-for restore waits for a free restore slot and pauses once itself: the routing
    # port's request waits up to 30 s for it instead of the default 10 s.
    config = tmp_path / "wait.toml"
    config.write_text("routing_recovery_wait_ms = 30000\n")
    c = Cluster(tmp_path, servers=3, extra_args=("--config", str(config)),
                env={"RAMLOG_TEST_RESTORE_PAUSE_MS": "5000"})
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=5)
        pipe = rc.pipeline(transaction=False)
        for n in range(60_000):
            pipe.set(f"d:{n}", b"v")
            if len(pipe) >= 2000:
                pipe.execute()
        pipe.execute()
        st = status(c)
        victim_id = master_of_slot(st, 0)
        victim = index_of(c, st, victim_id)
        assert len([t for t in tablets(st) if t["master"] == victim_id]) >= 10

        c.servers[victim].proc.send_signal(signal.SIGKILL)
        c.servers[victim].proc.wait(timeout=5)
        wait_declared_dead(c, victim_id)

        # The restorer with the longest queue, and that queue as it shows it.
        queues = {}

        def queued():
            st = status(c)
            mine = [t for t in tablets(st) if t.get("recovering") and t.get("restorer") is not None]
            if not mine:
                return False
            by = {}
            for t in mine:
                by.setdefault(t["restorer"], []).append(t)
            rid = max(by, key=lambda r: len(by[r]))
            admin = next(s for s in st["servers"] if s["id"] == rid)["addresses"]["admin"]
            jobs = [j for j in recovery_jobs(admin) if j["kind"] == "restore"]
            waiting = [j for j in jobs if j["state"] == "waiting"]
            # Three or more: the last of them is a whole turn (a 5 s pause) away from starting
            # even if the two restores running now end at once.
            if len(waiting) < 3:
                return False
            queues.update(restorer=rid, admin=admin, jobs=jobs, waiting=waiting, st=st)
            return True
        assert wait_until(queued, timeout=30, interval=0.05), status(c)
        restorer_id, admin = queues["restorer"], queues["admin"]
        last = max(queues["waiting"], key=lambda j: j["first_slot"])
        key = next(f"d:{n}" for n in range(60_000)
                   if last["first_slot"] <= key_slot(f"d:{n}".encode()) <= last["last_slot"])
        other = next(i for i in range(3)
                     if i != victim and server_id_of(c, queues["st"], i) != restorer_id)
        plain = redis.Redis(host="127.0.0.1", port=c.servers[other].routing, socket_timeout=30)
        asked_at = time.monotonic()
        got = {}
        asker = threading.Thread(target=lambda: got.setdefault("v", plain.get(key)), daemon=True)
        asker.start()
        seen_waiting = []

        def asked_and_done():
            jobs = [j for j in recovery_jobs(admin) if j["kind"] == "restore"]
            j = next((j for j in jobs if j["first_slot"] == last["first_slot"]), None)
            if j is None or j["state"] != "done":
                return False
            seen_waiting.append(sum(1 for x in jobs if x["state"] == "waiting"))
            assert j["demanded"], (round(time.monotonic() - asked_at, 2), queues["jobs"], jobs)
            return True
        assert wait_until(asked_and_done, timeout=60, interval=0.05)
        # It went ahead of restores queued before it.
        assert seen_waiting[0] >= 1, seen_waiting
        text = subprocess_status(c)
        asker.join(timeout=30)
        assert got.get("v") == b"v", got
        wait_settled(c, copies=False, timeout=90)
        # Taken while restores still waited: their progress is in the cluster's status.
        assert "RECOVERING on server" in text, text
        assert ": waiting" in text or " objects" in text, text
    finally:
        c.stop()


def subprocess_status(c: Cluster) -> str:
    from test_failures import ramlog
    return ramlog("cluster", "status", "--coordinator", c.coordinator_addr)
