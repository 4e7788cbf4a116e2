"""A full memory is not a failure (issue 47): a cluster whose servers are all at their memory
budget under pipelined writers answers -OOM to writes, keeps serving reads, heartbeats and
probes, declares nobody dead, and takes writes again once DEL frees room. Real processes on
loopback; the test starts its own cluster and stops every process by its pid."""

import json
import threading
import time

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from conftest import Cluster, wait_until
from test_failures import status

VALUE = b"x" * 1000
FILL_SECONDS = 60
# How long the cluster must stay up, heard from and serving reads once writes are refused: several
# lease and failure-detector periods.
FULL_SECONDS = 12


def fill(port: int, t: int, stop: threading.Event, out: dict, lock: threading.Lock):
    """Pipelines of 200 SETs of 1 KB until `stop`; counts each reply by kind and reads one key
    back after each pipeline."""
    rc = RedisCluster(host="127.0.0.1", port=port, socket_timeout=15)
    i = 0
    while not stop.is_set():
        pipe = rc.pipeline(transaction=False)
        names = [f"fill:{t}:{i + j}" for j in range(200)]
        for name in names:
            pipe.set(name, VALUE)
        i += 200
        try:
            results = pipe.execute(raise_on_error=False)
        except Exception as e:  # noqa: BLE001 - counted and reported by the test
            with lock:
                out["errors"].append(f"pipeline: {type(e).__name__}: {e}")
            time.sleep(0.1)
            continue
        with lock:
            for name, res in zip(names, results):
                if res is True:
                    out["ok"].append(name)
                elif isinstance(res, redis.ResponseError) and str(res).startswith(
                        "command not allowed when used memory"):
                    out["oom"] += 1
                    out.setdefault("first_oom", time.time())
                else:
                    out["errors"].append(f"{name}: {res!r}")
        # Reads keep working while writes are refused.
        if out["ok"]:
            key = out["ok"][len(out["ok"]) // 2]
            try:
                got = rc.get(key)
            except Exception as e:  # noqa: BLE001
                with lock:
                    out["read_errors"].append(f"{type(e).__name__}: {e}")
            else:
                with lock:
                    out["reads"] += 1
                    if got != VALUE:
                        out["read_errors"].append(f"{key}: {got!r}")


def test_a_cluster_at_its_memory_budget_refuses_writes_and_stays_up(tmp_path):
    c = Cluster(tmp_path, extra_args=["--memory", "96MiB"])
    stop = threading.Event()
    try:
        out = {"ok": [], "oom": 0, "errors": [], "reads": 0, "read_errors": []}
        lock = threading.Lock()
        threads = [threading.Thread(target=fill, args=(c.servers[t % 3].resp, t, stop, out, lock),
                                    daemon=True)
                   for t in range(3)]
        for t in threads:
            t.start()
        deadline = time.time() + FILL_SECONDS
        # Every server reaches its budget, and stays up and heard from throughout, for
        # FULL_SECONDS after writes are refused.
        while time.time() < deadline:
            first_oom = out.get("first_oom")
            if first_oom and time.time() - first_oom >= FULL_SECONDS and out["oom"] > 1000:
                break
            time.sleep(2)
            st = status(c)
            dead = [s["id"] for s in st["servers"] if s["state"] != "up"]
            assert not dead, f"declared dead at a full memory: {dead}"
            assert c.alive(), "a process died at a full memory"
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert out["oom"] > 1000, f"the budget was never reached: {out['oom']} -OOM, {len(out['ok'])} OK"
        assert out["reads"] > 10 and not out["read_errors"], out["read_errors"][:5]
        # No write got anything but OK or -OOM: no lease or coordinator error, no timeout.
        assert not out["errors"], out["errors"][:10]
        # No server was ever declared dead: every epoch is the first.
        st = status(c)
        assert all(s["state"] == "up" and s["epoch"] == 1 for s in st["servers"]), json.dumps(st["servers"])

        # Every acknowledged write reads back.
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=15)
        acked = out["ok"]
        for start in range(0, len(acked), 1000):
            chunk = acked[start:start + 1000]
            values = rc.mget_nonatomic(chunk)
            assert all(v == VALUE for v in values), [k for k, v in zip(chunk, values) if v != VALUE][:5]

        # DEL frees room: writes are taken again (the cleaner reclaims what DEL left behind).
        for start in range(0, len(acked) // 2, 1000):
            rc.delete(*acked[start:start + 1000])

        def writes_again():
            try:
                return all(rc.set(f"after:{i}", VALUE) for i in range(200))
            except redis.ResponseError:
                return False
        assert wait_until(writes_again, timeout=60, interval=0.5), "writes were not taken again after DEL"
        assert rc.get("after:199") == VALUE
        assert all(s["state"] == "up" for s in status(c)["servers"])
    finally:
        stop.set()
        c.stop()


def test_a_tablet_at_its_size_limit_refuses_growth_and_nothing_else(tmp_path):
    """A tablet holds at most `tablet_max_bytes` (by default three quarters of a backup's 512 MiB
    log of one tablet; 1 MiB here): past it, writes that would grow it get -OOM naming the limit,
    while its reads, deletes and same-size overwrites go on, other tablets take writes, and no
    backup stops. Deleting keys takes it below the limit and writes are taken again."""
    config = tmp_path / "server.toml"
    config.write_text("tablet_max_bytes = 1048576\n")
    c = Cluster(tmp_path, extra_args=["--config", str(config)])
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=15)
        # One hash tag: every key in one slot, so in one tablet.
        acked, refused = [], None
        for i in range(4000):
            try:
                rc.set(f"{{full}}:{i}", VALUE)
                acked.append(f"{{full}}:{i}")
            except redis.ResponseError as e:
                refused = str(e)
                break
            if i % 200 == 0:
                time.sleep(0.05)  # heartbeats measure the tablet while it grows
        assert refused is not None, f"{len(acked)} KB taken by a tablet limited to 1 MiB"
        assert "tablet holding this key is full" in refused and "1048576 bytes" in refused, refused
        assert 900 <= len(acked) <= 2000, len(acked)
        # Refused again (not a transient answer); the rest of the tablet serves.
        with pytest.raises(redis.ResponseError, match="is full"):
            rc.set("{full}:another", VALUE)
        assert rc.get(acked[0]) == VALUE
        assert rc.set(acked[1], VALUE) is True  # an overwrite of the same size
        # Other tablets take writes; every server is up with its first epoch.
        full_slot = key_slot(b"full")
        others = [k for k in (f"elsewhere:{i}" for i in range(500))
                  if abs(key_slot(k.encode()) - full_slot) > 1024][:50]
        for k in others:
            assert rc.set(k, VALUE) is True
        st = status(c)
        assert all(s["state"] == "up" and s["epoch"] == 1 for s in st["servers"]), st["servers"]
        # Deletes make room; once a heartbeat measures it, the tablet grows again.
        rc.delete(*acked[: len(acked) // 2])

        def takes_writes():
            try:
                return rc.set("{full}:again", VALUE) is True
            except redis.ResponseError:
                return False
        assert wait_until(takes_writes, timeout=10, interval=0.2)
        for k in acked[len(acked) // 2:]:
            assert rc.get(k) == VALUE, k
        assert c.alive()
    finally:
        c.stop()
