"""Balancing by load: a server whose tablets take far more reads and writes than the others has
one of them moved to the coolest server by the coordinator's leader, with clients going on.

Three servers; clients hammer three tablets of one server through RedisCluster pipelines (the
others stay idle). Within the bound, the leader moves one of the hot tablets (the one that evens
the load best) to another server; every write reads back. Real processes on loopback; every wait
is bounded."""

import re
import threading
import time

from redis.cluster import RedisCluster

from conftest import Cluster, wait_until
from test_failures import status
from test_migration import keys_in


def test_a_hot_server_has_a_hot_tablet_moved_to_the_coolest(tmp_path):
    c = Cluster(tmp_path, servers=3, coordinator_args=["--load-min-ops", "1000", "--split-mib", "0"])
    stop = threading.Event()
    threads = []
    errors = []
    try:
        st = status(c)
        tablets = next(t for t in st["tables"] if t["name"] == "default")["tablets"]
        hot = tablets[0]["master"]
        mine = [t for t in tablets if t["master"] == hot][:3]
        assert len(mine) == 3, mine
        names = [keys_in(t, 200, f"h{i}:") for i, t in enumerate(mine)]
        written = {}

        def hammer(n):
            rc = RedisCluster(host="127.0.0.1", port=c.servers[n].resp, socket_timeout=10)
            seq = 0
            while not stop.is_set():
                seq += 1
                try:
                    p = rc.pipeline()
                    for k in names[n]:
                        p.set(k, f"{n}:{seq}")
                    for k in names[n]:
                        p.get(k)
                    out = p.execute()
                    for k in names[n]:
                        written[k] = f"{n}:{seq}".encode()
                    assert all(v == f"{n}:{seq}".encode() for v in out[len(names[n]):]), out[-3:]
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    time.sleep(0.05)

        threads = [threading.Thread(target=hammer, args=(n,), daemon=True) for n in range(3)]
        for th in threads:
            th.start()

        def moved():
            now = {t["first_slot"]: t["master"] for t in next(x for x in status(c)["tables"] if x["name"] == "default")["tablets"]}
            return [t["first_slot"] for t in mine if now.get(t["first_slot"]) != hot]

        assert wait_until(lambda: moved(), timeout=60), "no hot tablet moved"
        gone = moved()
        assert len(gone) == 1, f"one move at a time: {gone}"
        time.sleep(1)
        stop.set()
        for th in threads:
            th.join(timeout=20)
        # A move pauses its tablet for a moment: RedisCluster follows MOVED and retries TRYAGAIN.
        assert not errors, errors[:5]
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
        for k, v in written.items():
            assert rc.get(k) == v, k
        log = re.sub(r"\x1b\[[0-9;]*m", "", (tmp_path / "coordinator-1.log").read_text())
        assert "tablet migration started: its server is hot" in log and 'reason="load"' in log, log[-2000:]
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=20)
        c.stop()
