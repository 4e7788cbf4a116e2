"""Tablet migration between live servers (`ramlog cluster move`), with writes going on.

Four servers, two backups per tablet: the tablet holding slot 0 (and the empty key) moves to the
server that neither masters nor backs it up, while RedisCluster clients and a plain client of a
routing port write and read it. No acknowledged write is lost, no request through the routing
port fails, the target masters the tablet at the next epoch and the source answers MOVED. Then
the new master is killed: the tablet recovers from its backups with every write, those the
source took and those the target took. Also: a move whose target dies is abandoned and the
source goes on serving; a move whose source dies ends in a recovery. Real processes on loopback;
every process is stopped by its pid and every wait is bounded."""

import json
import os
import re
import urllib.request
import random
import signal
import subprocess
import threading
import time

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from conftest import Cluster, ramlog_bin, wait_until
from test_failures import Keys, server_id_of, status, wait_declared_dead, wait_settled
from test_recovery_kills import index_of, preload, read_all


def tablet_at(st: dict, slot: int) -> dict:
    table = next(t for t in st["tables"] if t["name"] == "default")
    return next(t for t in table["tablets"] if t["first_slot"] <= slot <= t["last_slot"])


def outsider(st: dict, t: dict) -> int:
    """A live server that neither masters nor backs up tablet `t`."""
    return next(s["id"] for s in st["servers"]
                if s["state"] == "up" and s["id"] != t["master"] and s["id"] not in t["backups"])


def keys_in(t: dict, n: int, prefix: str) -> list:
    out = []
    i = 0
    while len(out) < n:
        k = f"{prefix}{i}"
        if t["first_slot"] <= key_slot(k.encode()) <= t["last_slot"]:
            out.append(k)
        i += 1
    return out


def move(c: Cluster, slots: str, to: int, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [ramlog_bin(), "cluster", "move", "default", slots, "--to", str(to),
         "--coordinator", c.coordinator_addr, "--timeout", str(timeout)],
        capture_output=True, text=True, timeout=timeout + 30)


def cluster_writer(port: int, names: list, keys: Keys, t: int, stop: threading.Event):
    """SETs and DELs then GETs `names`, one operation at a time, through a RedisCluster client."""
    rng = random.Random(t)
    rc = RedisCluster(host="127.0.0.1", port=port, socket_timeout=5)
    seq = 0
    while not stop.is_set():
        key = rng.choice(names)
        seq += 1
        value = None if rng.random() < 0.1 else f"{t}:{seq}".encode()
        try:
            try:
                rc.delete(key) if value is None else rc.set(key, value)
            except Exception:
                keys.failed_write(key, value)
                raise
            keys.acked_write(key, value)
            keys.read(key, rc.get(key), time.time())
        except Exception as e:
            keys.errors.append((time.time(), f"{type(e).__name__}: {e}"))
            time.sleep(0.02)


def routing_writer(port: int, names: list, keys: Keys, stop: threading.Event, failures: list):
    """The same through a routing port with a plain client: no request may fail."""
    r = redis.Redis(port=port, socket_timeout=15)
    seq = 0
    while not stop.is_set():
        key = names[seq % len(names)]
        seq += 1
        value = f"r:{seq}".encode()
        try:
            r.set(key, value)
            keys.acked_write(key, value)
            keys.read(key, r.get(key), time.time())
        except Exception as e:
            keys.failed_write(key, value)
            failures.append(f"{type(e).__name__}: {e}")
            time.sleep(0.05)


def test_a_tablet_moves_under_writers_and_keeps_every_write(tmp_path):
    c = Cluster(tmp_path, servers=4, coordinator_args=["--default-replicas", "2"])
    stop = threading.Event()
    threads = []
    try:
        st = status(c)
        t = tablet_at(st, 0)
        source, target = t["master"], outsider(st, t)
        moving = keys_in(t, 3000, "m:")
        elsewhere = [f"e:{n}" for n in range(500) if not t["first_slot"] <= key_slot(f"e:{n}".encode()) <= t["last_slot"]]
        special = ["", "bin\x00\xff\r\n"]
        assert key_slot(b"") == 0
        value = lambda k: (k.encode() * 40)[:200] or b"the empty key"  # noqa: E731
        preload(c, moving + elsewhere + special, value)
        keys = Keys()
        for k in moving + elsewhere + special:
            keys.acked_write(k, value(k))
        failures = []
        routing_names = keys_in(t, 50, "r:")
        # One writer per key (what `Keys` checks): each its own share of the keys.
        threads = [threading.Thread(target=cluster_writer, args=(c.servers[i % 4].resp, moving[i * 70:(i + 1) * 70] + elsewhere[i * 20:(i + 1) * 20], keys, i, stop), daemon=True)
                   for i in range(3)]
        threads.append(threading.Thread(target=routing_writer, args=(c.servers[index_of(c, st, target)].routing, routing_names, keys, stop, failures), daemon=True))
        for th in threads:
            th.start()
        assert wait_until(lambda: keys.acked > 5000 + 300, timeout=20)

        out = move(c, "0", target)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"moved to server {target}" in out.stdout, out.stdout
        acked_at_switch = keys.acked
        assert wait_until(lambda: keys.acked > acked_at_switch + 300, timeout=20)
        stop.set()
        for th in threads:
            th.join(timeout=20)
        assert not failures, failures[:5]
        st = status(c)
        now = tablet_at(st, 0)
        assert now["master"] == target and now["epoch"] == t["epoch"] + 1, now
        assert sorted(now["backups"]) == sorted(t["backups"]), (now, t)
        assert now.get("migration") is None
        # The source answers MOVED for the tablet's keys now.
        src = redis.Redis(port=c.servers[index_of(c, st, source)].resp)
        try:
            src.get("")
            raise AssertionError("the source still serves the moved tablet")
        except redis.exceptions.MovedError as e:
            assert str(e) == f"0 127.0.0.1:{c.servers[index_of(c, st, target)].resp}", e
        got = read_all(c, 0, list(keys.possible))
        for k, v in got.items():
            keys.read(k, v, "after the move")
        assert not keys.violations, keys.violations[:10]
        assert got[""] == value("") and got["bin\x00\xff\r\n"] == value("bin\x00\xff\r\n")

        # The new master dies: its backups hold every write, before the switch and after.
        c.servers[index_of(c, st, target)].proc.send_signal(signal.SIGKILL)
        c.servers[index_of(c, st, target)].proc.wait(timeout=5)
        wait_declared_dead(c, target)
        wait_settled(c, copies=False, timeout=60)
        alive = next(i for i in range(4) if i != index_of(c, st, target))
        got = read_all(c, alive, list(keys.possible))
        for k, v in got.items():
            keys.read(k, v, "after the new master died")
        assert not keys.violations, keys.violations[:10]
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=20)
        c.stop()


def start_slow_move(tmp_path):
    """4 servers, R = 2, copies slowed to 64 KiB/s; the tablet of slot 0 preloaded with 1.5 MB
    and moving to the outsider (still copying when this returns), writers running."""
    config = tmp_path / "slow-copy.toml"
    config.write_text("recovery_copy_bytes_per_sec = 65536\n")
    c = Cluster(tmp_path, servers=4, extra_args=("--config", str(config)),
                coordinator_args=["--default-replicas", "2"])
    st = status(c)
    t = tablet_at(st, 0)
    moving = keys_in(t, 1500, "m:")
    value = lambda k: (k.encode() * 100)[:1000]  # noqa: E731
    preload(c, moving, value)
    keys = Keys()
    for k in moving:
        keys.acked_write(k, value(k))
    stop = threading.Event()
    threads = [threading.Thread(target=cluster_writer, args=(c.servers[i % 4].resp, moving[i * 70:(i + 1) * 70], keys, i, stop), daemon=True)
               for i in range(3)]
    for th in threads:
        th.start()
    target = outsider(st, t)
    out = subprocess.run([ramlog_bin(), "cluster", "move", "default", "0", "--to", str(target), "--no-wait",
                          "--coordinator", c.coordinator_addr], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and f"moving to server {target}" in out.stdout, out.stdout + out.stderr
    assert wait_until(lambda: (tablet_at(status(c), 0).get("migration") or {}).get("phase") == "copying", timeout=10)
    return c, t, target, keys, stop, threads


def finish(c, keys, stop, threads, alive_index):
    assert wait_until(lambda: keys.acked > 2000, timeout=20)
    stop.set()
    for th in threads:
        th.join(timeout=20)
    got = read_all(c, alive_index, list(keys.possible))
    for k, v in got.items():
        keys.read(k, v, "final")
    assert not keys.violations, keys.violations[:10]


def test_a_move_whose_target_dies_is_abandoned_and_the_source_serves_on(tmp_path):
    c, t, target, keys, stop, threads = start_slow_move(tmp_path)
    try:
        st = status(c)
        c.servers[index_of(c, st, target)].proc.send_signal(signal.SIGKILL)
        c.servers[index_of(c, st, target)].proc.wait(timeout=5)
        wait_declared_dead(c, target)
        now = tablet_at(status(c), 0)
        assert now.get("migration") is None and now["master"] == t["master"], now
        assert target not in now["backups"] and now["epoch"] == t["epoch"], now
        finish(c, keys, stop, threads, index_of(c, st, t["master"]))
    finally:
        stop.set()
        c.stop()


def test_a_move_whose_source_dies_ends_in_a_recovery(tmp_path):
    c, t, target, keys, stop, threads = start_slow_move(tmp_path)
    try:
        st = status(c)
        c.servers[index_of(c, st, t["master"])].proc.send_signal(signal.SIGKILL)
        c.servers[index_of(c, st, t["master"])].proc.wait(timeout=5)
        wait_declared_dead(c, t["master"])
        wait_settled(c, copies=False, timeout=60)
        now = tablet_at(status(c), 0)
        assert now.get("migration") is None and now["master"] != t["master"], now
        assert now["epoch"] > t["epoch"]
        finish(c, keys, stop, threads, index_of(c, st, target))
    finally:
        stop.set()
        c.stop()


def test_a_drained_server_hands_everything_over_and_leaves_and_a_new_one_takes_a_share(tmp_path):
    """4 servers, R = 2, under RedisCluster writers: `ramlog cluster drain` moves every tablet
    the server masters and replaces it in every backup set, then removes it (its process stops);
    nothing acknowledged is lost. Then a fifth server joins: rebalancing gives it about a
    quarter of the tablets, and every write still reads back."""
    c = Cluster(tmp_path, servers=4, coordinator_args=["--default-replicas", "2"])
    stop = threading.Event()
    threads = []
    try:
        names = [f"d:{n}" for n in range(3000)]
        value = lambda k: (k.encode() * 20)[:100]  # noqa: E731
        preload(c, names + [""], value)
        keys = Keys()
        for k in names + [""]:
            keys.acked_write(k, value(k))
        threads = [threading.Thread(target=cluster_writer, args=(c.servers[i].resp, names[i * 300:(i + 1) * 300], keys, i, stop), daemon=True)
                   for i in range(3)]
        for th in threads:
            th.start()
        st = status(c)
        leaving = server_id_of(c, st, 3)
        out = subprocess.run([ramlog_bin(), "cluster", "drain", str(leaving), "--coordinator", c.coordinator_addr,
                              "--timeout", "120"], capture_output=True, text=True, timeout=150)
        assert out.returncode == 0 and f"server {leaving} drained and removed" in out.stdout, out.stdout + out.stderr
        st = status(c)
        assert next(s for s in st["servers"] if s["id"] == leaving)["state"] == "dead"
        for tb in st["tables"]:
            for t in tb["tablets"]:
                assert t["master"] != leaving and leaving not in t["backups"], t
        assert c.servers[3].proc.wait(timeout=10) is not None, "the drained server stopped"
        wait_settled(c, copies=True, timeout=60)

        # A new server joins and takes a share.
        c.add_server()
        joined = max(s["id"] for s in status(c)["servers"])

        def balanced():
            st = status(c)
            mastered = next(s for s in st["servers"] if s["id"] == joined)["tablets_mastered"]
            return not st["rebalancing"] and st["migrations"] == 0 and mastered > 0 and (mastered, st)
        assert wait_until(balanced, timeout=60, interval=0.2), status(c)
        st = status(c)
        counts = [s["tablets_mastered"] for s in st["servers"] if s["state"] == "up"]
        assert max(counts) - min(counts) <= max(2, sum(counts) // 10), counts
        assert wait_until(lambda: keys.acked > 3001 + 1500, timeout=30)
        stop.set()
        for th in threads:
            th.join(timeout=20)
        got = read_all(c, 0, list(keys.possible))
        for k, v in got.items():
            keys.read(k, v, "final")
        assert not keys.violations, keys.violations[:10]
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=20)
        c.stop()


def test_a_move_survives_a_backup_killed_mid_transfer(tmp_path):
    """A backup of the moving tablet dies while the target fills: the backup is replaced, the move
    completes (target master at the next epoch), and nothing acknowledged is lost."""
    c, t, target, keys, stop, threads = start_slow_move(tmp_path)
    try:
        st = status(c)
        backup = t["backups"][0]
        c.servers[index_of(c, st, backup)].proc.send_signal(signal.SIGKILL)
        c.servers[index_of(c, st, backup)].proc.wait(timeout=5)
        wait_declared_dead(c, backup)
        # The copy is slow (64 KiB/s): the move finishes within about 30 s.
        assert wait_until(lambda: tablet_at(status(c), 0)["master"] == target, timeout=90, interval=0.2), \
            tablet_at(status(c), 0)
        now = tablet_at(status(c), 0)
        assert now.get("migration") is None and now["epoch"] >= t["epoch"] + 1, now
        assert backup not in now["backups"], now
        finish(c, keys, stop, threads, index_of(c, st, target))
    finally:
        stop.set()
        c.stop()


def test_a_move_goes_on_when_the_coordinator_leader_dies(tmp_path):
    """Three coordinator members: the leader is killed while a tablet moves; a new leader takes
    the migration's next steps from the Raft log and the move completes; nothing is lost."""
    config = tmp_path / "copy.toml"
    config.write_text("recovery_copy_bytes_per_sec = 262144\n")
    c = Cluster(tmp_path, servers=4, coordinators=3, extra_args=("--config", str(config)),
                coordinator_args=["--default-replicas", "2"])
    stop = threading.Event()
    threads = []
    try:
        st = status(c)
        t = tablet_at(st, 0)
        target = outsider(st, t)
        moving = keys_in(t, 1500, "m:")
        value = lambda k: (k.encode() * 100)[:1000]  # noqa: E731
        preload(c, moving, value)
        keys = Keys()
        for k in moving:
            keys.acked_write(k, value(k))
        threads = [threading.Thread(target=cluster_writer, args=(c.servers[i].resp, moving[i * 70:(i + 1) * 70], keys, i, stop), daemon=True)
                   for i in range(3)]
        for th in threads:
            th.start()
        out = subprocess.run([ramlog_bin(), "cluster", "move", "default", "0", "--to", str(target), "--no-wait",
                              "--coordinator", c.coordinator_addr], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stdout + out.stderr
        assert (tablet_at(status(c), 0).get("migration") or {}).get("phase") == "copying"
        old = status(c)["leader"]
        c.coordinators[old - 1].send_signal(signal.SIGKILL)
        c.coordinators[old - 1].wait(timeout=5)
        assert wait_until(lambda: tablet_at(status(c), 0)["master"] == target, timeout=60, interval=0.2), \
            tablet_at(status(c), 0)
        assert tablet_at(status(c), 0).get("migration") is None
        finish(c, keys, stop, threads, index_of(c, st, target))
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=20)
        c.stop()


def test_a_move_shows_in_cluster_nodes_and_metrics_and_redis_tools_work_through_it(tmp_path):
    """While the tablet of slot 0 (6 MB) copies to its target (copies held to 512 KiB/s): the source's
    CLUSTER NODES marks its slots `[slot->-target]` on its own line and the target's marks them
    `[slot-<-source]`, as Redis shows open slots; both servers' /metrics count the move and the
    source's shows the copy's progress; `redis-cli -c` and `redis-benchmark --cluster` work
    through the move without an error. Once it is done, the marks are gone."""
    config = tmp_path / "paced.toml"
    config.write_text("recovery_copy_bytes_per_sec = 524288\n")
    c = Cluster(tmp_path, servers=4, extra_args=("--config", str(config)),
                coordinator_args=["--default-replicas", "2"])
    try:
        st = status(c)
        t = tablet_at(st, 0)
        source, target = t["master"], outsider(st, t)
        si, ti = index_of(c, st, source), index_of(c, st, target)
        moving = keys_in(t, 6000, "m:")
        preload(c, moving, lambda k: (k.encode() * 100)[:1000])
        out = subprocess.run([ramlog_bin(), "cluster", "move", "default", "0", "--to", str(target), "--no-wait",
                              "--coordinator", c.coordinator_addr], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stdout + out.stderr

        def nodes(i):
            return subprocess.run(["redis-cli", "-p", str(c.servers[i].resp), "CLUSTER", "NODES"],
                                  capture_output=True, text=True, timeout=10).stdout

        def line_of(text, i):
            return next(l for l in text.splitlines() if f":{c.servers[i].resp}@" in l)

        def metrics(i):
            with urllib.request.urlopen(f"http://127.0.0.1:{c.servers[i].admin}/metrics", timeout=10) as r:
                text = r.read().decode()
            return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(ramlog_migration\w*) (\S+)$", text, re.M)}

        seen = {}

        def marked():
            src, dst = nodes(si), nodes(ti)
            target_id = line_of(src, ti).split()[0]
            source_id = line_of(dst, si).split()[0]
            ms, mt = metrics(si), metrics(ti)
            if f"[{t['first_slot']}->-{target_id}]" in line_of(src, si) and \
                    f"[{t['last_slot']}-<-{source_id}]" in line_of(dst, ti) and \
                    ms.get("ramlog_migrations_out") == 1 and mt.get("ramlog_migrations_in") == 1 and \
                    ms.get("ramlog_migration_copy_total_bytes", 0) > 0:
                seen.update(src=src, dst=dst, ms=ms)
                return True
            return False
        assert wait_until(marked, timeout=20, interval=0.05), (nodes(si), metrics(si), metrics(ti))
        # Only a server's own line carries its open slots, as in Redis.
        assert "->-" not in line_of(seen["src"], ti) and "-<-" not in line_of(seen["dst"], si)
        assert seen["ms"]["ramlog_migration_copied_bytes"] <= seen["ms"]["ramlog_migration_copy_total_bytes"]

        # Redis's own tools through the move.
        for k in moving[:20]:
            got = subprocess.run(["redis-cli", "-c", "-p", str(c.servers[ti].resp), "SET", k, "new"],
                                 capture_output=True, text=True, timeout=10)
            assert got.stdout.strip() == "OK", got
            got = subprocess.run(["redis-cli", "-c", "-p", str(c.servers[ti].resp), "GET", k],
                                 capture_output=True, text=True, timeout=10)
            assert got.stdout.strip() == "new", got
        bench = subprocess.run(["redis-benchmark", "--cluster", "-p", str(c.servers[si].resp), "-t", "set,get",
                                "-n", "20000", "-r", "100000", "-q"], capture_output=True, text=True, timeout=120)
        assert bench.returncode == 0 and "requests per second" in bench.stdout, bench.stdout + bench.stderr
        assert "error" not in (bench.stdout + bench.stderr).lower(), bench.stdout + bench.stderr
        # All of that while the move was still under way.
        assert tablet_at(status(c), 0).get("migration") is not None, "the move ended before the tools ran"

        # It finishes; the marks and the counts are gone.
        assert wait_until(lambda: tablet_at(status(c), 0)["master"] == target
                          and tablet_at(status(c), 0).get("migration") is None, timeout=120, interval=0.2)
        assert wait_until(lambda: "->-" not in nodes(si) and "-<-" not in nodes(ti)
                          and metrics(si).get("ramlog_migrations_out") == 0, timeout=10)
        got = read_all(c, si, moving)
        assert all(got[k] == b"new" for k in moving[:20])
        assert all(got[k] == (k.encode() * 100)[:1000] for k in moving[20:])
    finally:
        c.stop()


def test_three_servers_grow_to_six_under_load_and_even_out(tmp_path):
    """3 servers (R = 2) with 60 MB of 1 KB values (`RAMLOG_TEST_GROWTH_MB` sets the size: 1024
    for the 1 GiB run docs/testing.md describes), RedisCluster writers and readers running;
    3 servers join. The cluster rebalances by itself until every server's live data is within
    10 % of the mean; no request fails (redirections are followed by the client), and every
    acknowledged write reads back."""
    mb = int(os.environ.get("RAMLOG_TEST_GROWTH_MB", "60"))
    memory = ("--memory", f"{max(256, mb)}MiB")
    c = Cluster(tmp_path, servers=3, extra_args=memory, coordinator_args=["--default-replicas", "2"])
    stop = threading.Event()
    threads = []
    try:
        names = [f"g:{n}" for n in range(mb * 1000)]
        value = lambda k: (k.encode() * 200)[:1000]  # noqa: E731
        preload(c, names, value)
        keys = Keys()
        for k in names:
            keys.acked_write(k, value(k))
        threads = [threading.Thread(target=cluster_writer, args=(c.servers[i].resp, names[i * 200:(i + 1) * 200], keys, i, stop), daemon=True)
                   for i in range(3)]
        for th in threads:
            th.start()
        assert wait_until(lambda: keys.acked > len(names) + 300, timeout=20)
        started = time.time()
        for _ in range(3):
            c.add_server(extra_args=memory)

        def live(i):
            with urllib.request.urlopen(f"http://127.0.0.1:{c.servers[i].admin}/metrics", timeout=10) as r:
                return float(re.search(r"^ramlog_memory_bytes_live (\S+)$", r.read().decode(), re.M).group(1))

        def even():
            st = status(c)
            if st["rebalancing"] or st["migrations"] or sum(1 for s in st["servers"] if s["state"] == "up") != 6:
                return False
            sizes = [live(i) for i in range(6)]
            mean = sum(sizes) / 6
            return all(abs(x - mean) <= 0.10 * mean for x in sizes) and sizes
        assert wait_until(even, timeout=180 + mb, interval=0.5), ([live(i) for i in range(6)], status(c)["rebalancing"])
        print(f"grown to six servers, even within 10 % after {time.time() - started:.1f} s: live bytes {even()}")
        acked = keys.acked
        assert wait_until(lambda: keys.acked > acked + 300, timeout=20)
        stop.set()
        for th in threads:
            th.join(timeout=20)
        assert not keys.errors, keys.errors[:5]
        got = read_all(c, 4, list(keys.possible))
        for k, v in got.items():
            keys.read(k, v, "after growing to six servers")
        assert not keys.violations, keys.violations[:10]
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=20)
        c.stop()
