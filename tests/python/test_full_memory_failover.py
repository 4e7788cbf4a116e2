"""A full memory is not a failure: a master dies while every server's memory is full.

Three servers of 64 MiB each are filled until they answer -OOM; then one is killed. Its tablets'
backups have no room to restore them, so they wait (the coordinator says why, clients of their
slots get -CLUSTERDOWN naming the memory) instead of failing restore after restore; nothing else
suffers (no survivor is declared dead, other slots serve). Once keys are deleted on the survivors,
the restores start by themselves and every acknowledged write of the dead server is back. Real
processes on loopback; every wait is bounded and every process is stopped by its pid.
"""

import json
import re
import signal
import subprocess
import threading
import time
import urllib.request

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from conftest import Cluster, ramlog_bin, wait_until

VALUE_BYTES = 1000
WRITERS = 3
BATCH = 500


def value_of(key: str) -> bytes:
    return ((key + "|") * (VALUE_BYTES // len(key) + 1)).encode()[:VALUE_BYTES]


def ramlog(*args, timeout=30):
    out = subprocess.run([ramlog_bin(), *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out.stdout


def status(c: Cluster) -> dict:
    return json.loads(ramlog("cluster", "status", "--json", "--coordinator", c.coordinator_addr))


def server_id_of(c: Cluster, st: dict, i: int) -> int:
    port = c.servers[i].resp
    return next(s["id"] for s in st["servers"] if int(s["addresses"]["resp"].rsplit(":", 1)[1]) == port)


def tablets(st: dict) -> list:
    return next(t for t in st["tables"] if t["name"] == "default")["tablets"]


def tablet_of(st: dict, slot: int) -> dict:
    return next(t for t in tablets(st) if t["first_slot"] <= slot <= t["last_slot"])


def metric(admin_port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def fill(c: Cluster, t: int, acked: list, errors: list, deadline: float):
    """Pipelined SETs of `w{t}:{n}` until a whole batch is refused (every server is full)."""
    rc = RedisCluster(host="127.0.0.1", port=c.servers[t % len(c.servers)].resp, socket_timeout=20)
    n = 0
    try:
        while time.time() < deadline:
            keys = [f"w{t}:{n + i}" for i in range(BATCH)]
            n += BATCH
            pipe = rc.pipeline()
            for k in keys:
                pipe.set(k, value_of(k))
            replies = pipe.execute(raise_on_error=False)
            ok = [k for k, r in zip(keys, replies) if r is True]
            acked.extend(ok)
            refused = [r for r in replies if r is not True]
            if refused and not all("maxmemory" in str(r) or "OOM" in str(r) for r in refused):
                errors.append(str(refused[0]))
            if not ok:
                return
        errors.append(f"writer {t} did not fill the memory in time")
    finally:
        rc.close()


def fill_all(c: Cluster) -> list:
    """Fills every server until it answers -OOM; returns the keys acknowledged OK."""
    acked = [[] for _ in range(WRITERS)]
    errors = []
    deadline = time.time() + 180
    threads = [threading.Thread(target=fill, args=(c, t, acked[t], errors, deadline), daemon=True)
               for t in range(WRITERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=200)
    assert not errors, errors[:5]
    keys = [k for part in acked for k in part]
    assert len(keys) > 100_000, len(keys)
    return keys


def delete(rc: RedisCluster, keys: list):
    for start in range(0, len(keys), 2000):
        pipe = rc.pipeline()
        for k in keys[start:start + 2000]:
            pipe.delete(k)
        assert all(r == 1 for r in pipe.execute())


def check_values(c: Cluster, port: int, keys: list):
    """Every key in `keys` reads back with its value."""
    rc = RedisCluster(host="127.0.0.1", port=port, socket_timeout=20)
    try:
        for start in range(0, len(keys), 2000):
            part = keys[start:start + 2000]
            pipe = rc.pipeline()
            for k in part:
                pipe.get(k)
            got = pipe.execute()
            wrong = [k for k, v in zip(part, got) if v != value_of(k)]
            assert not wrong, (len(wrong), wrong[:5])
    finally:
        rc.close()


def state_of(st: dict, server_id: int) -> str:
    return next(s for s in st["servers"] if s["id"] == server_id)["state"]


def test_tablets_wait_for_room_then_restore_by_themselves(tmp_path):
    c = Cluster(tmp_path, servers=3, extra_args=("--memory", "64MiB"))
    try:
        keys = fill_all(c)

        before = status(c)
        victim = 2
        victim_id = server_id_of(c, before, victim)
        survivors = [i for i in range(3) if i != victim]
        survivor_ids = [server_id_of(c, before, i) for i in survivors]
        master_of = {k: tablet_of(before, key_slot(k.encode()))["master"] for k in keys}
        dead_keys = [k for k in keys if master_of[k] == victim_id]
        live_keys = [k for k in keys if master_of[k] != victim_id]
        assert dead_keys and live_keys

        c.servers[victim].proc.send_signal(signal.SIGKILL)
        c.servers[victim].proc.wait(timeout=10)

        # Declared dead; its tablets wait for memory, each saying what it misses.
        def waiting_reported():
            st = status(c)
            dead = next(s for s in st["servers"] if s["id"] == victim_id)["state"] == "dead"
            return dead and st["tablets_waiting_for_room"] > 0
        assert wait_until(waiting_reported, timeout=15, interval=0.1), json.dumps(status(c))[:3000]
        st = status(c)
        recovering = [t for t in tablets(st) if t["recovering"]]
        waiting = [t for t in recovering if t["waiting"]]
        assert len(recovering) == 16, recovering
        assert len(waiting) >= 8, recovering
        assert st["tablets_waiting_for_room"] == len(waiting)
        for t in waiting:
            assert t["restorer"] is None, t
            assert re.search(r"no live backup has room: needs \d+ MiB", t["waiting"]), t
        text = ramlog("cluster", "status", "--coordinator", c.coordinator_addr)
        assert "WAITING FOR MEMORY" in text and "tablets wait for a backup with room" in text, text
        # The servers count them once they serve the map that says so (a heartbeat later).
        for i in survivors:
            assert wait_until(
                lambda: metric(c.servers[i].admin, "ramlog_tablets_waiting_for_room") == len(waiting),
                timeout=5), metric(c.servers[i].admin, "ramlog_tablets_waiting_for_room")

        # Clients of a waiting slot get -CLUSTERDOWN naming the memory, on the cluster port and
        # the routing port alike; the answer stays the same (no restore failing over and over).
        waiting_slots = [(t["first_slot"], t["last_slot"]) for t in waiting]
        stuck = next(k for k in dead_keys
                     if any(a <= key_slot(k.encode()) <= b for a, b in waiting_slots))
        for port in [c.servers[survivors[0]].resp, c.servers[survivors[1]].routing]:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
            try:
                client.get(stuck)
                raise AssertionError(f"a read of {stuck} in a waiting slot was answered")
            except redis.exceptions.ResponseError as e:
                message, kind = str(e), type(e)
            finally:
                client.close()
            # redis-py takes the error code off the message and names the exception after it.
            assert kind is redis.exceptions.ClusterDownError, (kind, message)
            assert "memory" in message and "no live backup has room" in message, message

        # No survivor is taken for dead; the slots they master serve reads.
        time.sleep(1.0)
        st = status(c)
        for sid in survivor_ids:
            assert next(s for s in st["servers"] if s["id"] == sid)["state"] == "up", st["servers"]
        assert st["tablets_waiting_for_room"] == len(waiting), "the waiting tablets changed by themselves"
        rc = RedisCluster(host="127.0.0.1", port=c.servers[survivors[0]].resp, socket_timeout=20)
        try:
            sample = live_keys[::50]
            pipe = rc.pipeline()
            for k in sample:
                pipe.get(k)
            assert pipe.execute() == [value_of(k) for k in sample]

            # Free memory on the survivors: delete all but a sample of their keys.
            kept = set(live_keys[::40])
            delete(rc, [k for k in live_keys if k not in kept])
        finally:
            rc.close()

        # The restores start by themselves and finish.
        def restored():
            st = status(c)
            return st["recovering_tablets"] == 0 and st["tablets_waiting_for_room"] == 0
        assert wait_until(restored, timeout=90, interval=0.2), json.dumps(status(c))[:4000]
        st = status(c)
        for sid in survivor_ids:
            assert next(s for s in st["servers"] if s["id"] == sid)["state"] == "up", st["servers"]

        # Every acknowledged write of the dead server is back, and what was kept elsewhere.
        check_values(c, c.servers[survivors[0]].resp, dead_keys + sorted(kept))
    finally:
        c.stop()


def test_a_restore_that_runs_out_of_memory_is_emptied_reported_and_planned_again(tmp_path):
    """The servers report their tablets 64 times smaller than they are (a test knob), so the
    coordinator plans restores onto survivors that cannot hold them: those run out of memory,
    empty what they restored, report it, and the tablet goes elsewhere or waits, saying so; none
    is retried on the same server until it reports clearly more room. Once keys are deleted,
    everything restores."""
    c = Cluster(tmp_path, servers=3, extra_args=("--memory", "64MiB"),
                env={"RAMLOG_TEST_UNDERSTATE_TABLETS": "64"})
    try:
        keys = fill_all(c)
        before = status(c)
        victim = 2
        victim_id = server_id_of(c, before, victim)
        survivors = [i for i in range(3) if i != victim]
        survivor_ids = [server_id_of(c, before, i) for i in survivors]
        master_of = {k: tablet_of(before, key_slot(k.encode()))["master"] for k in keys}
        dead_keys = [k for k in keys if master_of[k] == victim_id]
        live_keys = [k for k in keys if master_of[k] != victim_id]
        rc = RedisCluster(host="127.0.0.1", port=c.servers[survivors[0]].resp, socket_timeout=20)
        try:
            # Room for about a third of the dead server's data, which looks like all of it (16
            # tablets of about 1.05 MiB by the estimate, 3.5 MiB in truth): the survivors report
            # it before the kill, so restores are planned all at once, and some run out. Keys
            # are deleted a fortieth at a time until each survivor reports 10 MiB of room.
            rooms = lambda: [metric(c.servers[i].admin, "ramlog_restore_room_bytes") for i in survivors]  # noqa: E731
            # The room rises as the cleaner reclaims what a step deleted, later on a loaded
            # machine: each step waits until it stops rising, so that the deletes do not
            # overshoot into room for the whole dead server (then no restore runs out).
            def settled_rooms():
                last = rooms()
                for _ in range(20):
                    time.sleep(0.25)
                    now = rooms()
                    if all(abs(a - b) < (1 << 20) for a, b in zip(now, last)):
                        return now
                    last = now
                return last
            step = len(live_keys) // 40
            deleted = 0
            while min(settled_rooms()) < 10 << 20:
                assert deleted < len(live_keys) * 0.6, rooms()
                delete(rc, live_keys[deleted:deleted + step])
                deleted += step
            remaining = live_keys[deleted:]
            time.sleep(0.3)  # a heartbeat carries it to the coordinator

            c.servers[victim].proc.send_signal(signal.SIGKILL)
            c.servers[victim].proc.wait(timeout=10)

            def some_refused():
                st = status(c)
                return state_of(st, victim_id) == "dead" and any(t.get("refused") for t in tablets(st))
            assert wait_until(some_refused, timeout=30, interval=0.1), json.dumps(status(c))[:4000]
            server_logs = "".join((tmp_path / f"server-{i}.log").read_text() for i in survivors)
            assert "the restore ran out of memory: emptied what it restored" in server_logs
            # A tablet that nobody can take says so.
            def settled():
                st = status(c)
                return all(t["restorer"] is not None or t["waiting"] for t in tablets(st) if t["recovering"])
            assert wait_until(settled, timeout=30, interval=0.2), json.dumps(status(c))[:4000]
            st = status(c)
            for t in tablets(st):
                for r in t.get("refused") or []:
                    # Not planned again on a server whose restore ran out, at the same room.
                    if t["recovering"] and t["restorer"] == r["server"]:
                        assert False, t
            for sid in survivor_ids:
                assert state_of(st, sid) == "up", st["servers"]

            # Free the rest: everything restores, retried where it ran out before.
            kept = set(remaining[::40])
            delete(rc, [k for k in remaining if k not in kept])
        finally:
            rc.close()

        def restored():
            st = status(c)
            return st["recovering_tablets"] == 0 and st["tablets_waiting_for_room"] == 0
        assert wait_until(restored, timeout=120, interval=0.2), json.dumps(status(c))[:4000]
        st = status(c)
        for sid in survivor_ids:
            assert state_of(st, sid) == "up", st["servers"]
        check_values(c, c.servers[survivors[0]].resp, dead_keys + sorted(kept))
    finally:
        c.stop()
