"""Cluster snapshots (`docs/architecture.md`, "Cluster snapshots"): a filtered scan of a cluster
table reads every tablet at one cut across its masters. Writers increment a counter on one server
and, once it is acknowledged, write a marker on another; scans through the CLI run meanwhile,
and a master is killed -9 among them. No snapshot may show a marker without its counter, and
each sees every write acknowledged before the scan started."""

import json
import signal
import subprocess
import threading
import time

from redis.cluster import RedisCluster
from redis.crc import key_slot

from conftest import Cluster, ramlog_bin, wait_until
from test_failures import server_id_of, status, wait_declared_dead

WRITERS = 3
CLI_TIMEOUT = 90


def master_of(st, slot):
    return next(t["master"] for t in st["tables"][0]["tablets"]
                if t["first_slot"] <= slot <= t["last_slot"])


def tag_on(st, server_id, avoid=()):
    """A hash tag whose slot the server masters."""
    return next(f"t{n}" for n in range(10_000)
                if master_of(st, key_slot(f"{{t{n}}}".encode())) == server_id
                and f"t{n}" not in avoid)


def scan(port: int):
    out = subprocess.run([ramlog_bin(), "scan", "-p", str(port), "--prefix", "s:"],
                         capture_output=True, timeout=CLI_TIMEOUT)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    counters, markers = {}, {}
    for line in out.stdout.decode().splitlines():
        key, value = line.split("\t", 1)
        parts = key.split(":")
        if parts[1] == "c":
            counters[int(parts[3])] = int(value)
        else:
            markers.setdefault(int(parts[3]), set()).add(int(parts[4]))
    return counters, markers


def test_no_cluster_snapshot_shows_a_marker_without_its_counter_through_a_kill(tmp_path):
    c = Cluster(tmp_path, servers=3, coordinator_args=["--split-mib", "0"])
    stop = threading.Event()
    try:
        st = status(c)
        ids = [server_id_of(c, st, i) for i in range(3)]
        # The counters live on server 0, which is killed; the markers on server 1; the scans go
        # through server 2.
        counter_tag = tag_on(st, ids[0])
        marker_tag = tag_on(st, ids[1])
        acked_counter = [0] * WRITERS
        acked_markers = [set() for _ in range(WRITERS)]
        errors = [0] * WRITERS
        lock = threading.Lock()

        def write(w):
            rc = None
            while not stop.is_set():
                try:
                    if rc is None:
                        rc = RedisCluster(host="127.0.0.1", port=c.servers[2].resp,
                                          socket_timeout=5, socket_connect_timeout=2)
                    n = rc.incr(f"s:c:{{{counter_tag}}}:{w}")
                    with lock:
                        acked_counter[w] = max(acked_counter[w], n)
                    rc.set(f"s:m:{{{marker_tag}}}:{w}:{n}", b"1")
                    with lock:
                        acked_markers[w].add(n)
                except Exception:
                    # Refused or cut off by the kill: the write may or may not have happened,
                    # which the check allows (a counter ahead of its markers).
                    errors[w] += 1
                    rc = None
                    time.sleep(0.05)

        threads = [threading.Thread(target=write, args=(w,), daemon=True) for w in range(WRITERS)]
        for t in threads:
            t.start()
        assert wait_until(lambda: min(acked_counter) >= 50, timeout=30)

        scans = {"before": 0, "after": 0}

        def scan_and_check(phase):
            with lock:
                counter_before = list(acked_counter)
                markers_before = [set(m) for m in acked_markers]
            counters, markers = scan(c.servers[2].native)
            for w in range(WRITERS):
                seen = markers.get(w, set())
                # A consistent cut: no marker without the counter increment it followed.
                assert max(seen, default=0) <= counters.get(w, 0), (w, max(seen), counters.get(w))
                # Every write acknowledged before the scan started is in its snapshot.
                assert counters.get(w, 0) >= counter_before[w], (w, counters.get(w), counter_before[w])
                missing = markers_before[w] - seen
                assert not missing, (w, sorted(missing)[:10])
            scans[phase] += 1

        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            scan_and_check("before")
        victim = c.servers[0]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=5)
        wait_declared_dead(c, ids[0])
        # Scans while the counters' tablet is restored, and after.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            scan_and_check("after")
        with lock:
            progressed = list(acked_counter)
        assert wait_until(lambda: all(acked_counter[w] > progressed[w] for w in range(WRITERS)),
                          timeout=30), (progressed, acked_counter)
        scan_and_check("after")
        print("scans", scans, "acknowledged increments", acked_counter, "writer errors", errors)
        assert scans["before"] >= 3 and scans["after"] >= 3, scans
    finally:
        stop.set()
        c.stop()

