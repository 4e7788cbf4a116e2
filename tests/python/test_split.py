"""Tablet splits (`ramlog cluster split`, and the coordinator's own when a tablet grows past
`--split-mib`), with writes going on.

Four servers, two backups per tablet, copies slowed so that each half's fresh copy to the backups
is still under way when its master is killed: the tablet holding slot 0 (and the empty key) splits
while RedisCluster clients and a plain client of a routing port write and read it. No
acknowledged write is lost, no request through the routing port fails, both halves serve at the
next epoch, and each can move on its own. Then the master dies before the halves' copies are
complete: the halves recover from the whole tablet's logs and the writes since the split. Real
processes on loopback; every process is stopped by its pid and every wait is bounded."""

import signal
import subprocess
import threading

from redis.crc import key_slot

from conftest import Cluster, ramlog_bin, wait_until
from test_failures import Keys, status, wait_declared_dead, wait_settled
from test_migration import cluster_writer, keys_in, move, outsider, routing_writer, tablet_at
from test_recovery_kills import index_of, preload, read_all


def split(c: Cluster, slot: str, *extra, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [ramlog_bin(), "cluster", "split", "default", slot, *extra,
         "--coordinator", c.coordinator_addr, "--timeout", str(timeout)],
        capture_output=True, text=True, timeout=timeout + 30)


def test_a_tablet_splits_under_writers_its_halves_move_apart_and_a_kill_loses_nothing(tmp_path):
    config = tmp_path / "slow-copy.toml"
    config.write_text("recovery_copy_bytes_per_sec = 65536\n")
    c = Cluster(tmp_path, servers=4, extra_args=("--config", str(config)),
                coordinator_args=["--default-replicas", "2", "--split-mib", "0"])
    stop = threading.Event()
    threads = []
    try:
        st = status(c)
        t = tablet_at(st, 0)
        at = t["first_slot"] + (t["last_slot"] - t["first_slot"] + 1) // 2
        names = keys_in(t, 1500, "s:")
        lower = [k for k in names if key_slot(k.encode()) < at]
        upper = [k for k in names if key_slot(k.encode()) >= at]
        assert len(lower) > 300 and len(upper) > 300
        special = ["", "bin\x00\xff\r\n"]
        value = lambda k: (k.encode() * 100)[:1000] or b"the empty key"  # noqa: E731
        preload(c, names + special, value)
        keys = Keys()
        for k in names + special:
            keys.acked_write(k, value(k))
        failures = []
        routing = keys_in(t, 60, "r:")
        router = c.servers[index_of(c, st, outsider(st, t))].routing

        def start(stop):
            threads = [threading.Thread(target=cluster_writer, args=(c.servers[i % 4].resp, names[i * 100:(i + 1) * 100], keys, i, stop), daemon=True)
                       for i in range(3)]
            threads.append(threading.Thread(target=routing_writer, args=(router, routing, keys, stop, failures), daemon=True))
            for th in threads:
                th.start()
            return threads

        threads = start(stop)
        assert wait_until(lambda: keys.acked > len(names) + 300, timeout=20)

        # Refused with a clear error, changing nothing: a split point outside the tablet.
        bad = split(c, "0", "--at", str(t["last_slot"] + 1))
        assert bad.returncode != 0 and "cannot split the tablet" in bad.stderr, bad.stdout + bad.stderr

        out = split(c, "0")
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"split into {t['first_slot']}-{at - 1} and {at}-{t['last_slot']}" in out.stdout, out.stdout
        st = status(c)
        lo, hi = tablet_at(st, t["first_slot"]), tablet_at(st, at)
        for half in (lo, hi):
            assert half["master"] == t["master"] and half["epoch"] == t["epoch"] + 1, half
            assert sorted(half["backups"]) == sorted(t["backups"]), (half, t)
        assert (lo["first_slot"], lo["last_slot"], hi["first_slot"], hi["last_slot"]) == (t["first_slot"], at - 1, at, t["last_slot"])
        # The copies to the backups are slowed: the upper half still reads the whole tablet's logs.
        assert hi["pending"] and hi.get("logs_from") == t["first_slot"], hi
        acked_at_split = keys.acked
        assert wait_until(lambda: keys.acked > acked_at_split + 300, timeout=20)
        # Every write reads back (the writers pause for the read).
        stop.set()
        for th in threads:
            th.join(timeout=20)
        got = read_all(c, 0, list(keys.possible))
        for k, v in got.items():
            keys.read(k, v, "after the split")
        assert not keys.violations, keys.violations[:10]
        stop = threading.Event()
        threads = start(stop)

        assert not failures, failures[:5]
        # The master dies before the halves' copies are complete: each recovers from the whole
        # tablet's logs (its slots only) and the writes since the split. (A write in flight to a
        # server whose backup dies may be answered in doubt: the checker counts it as either.)
        victim = index_of(c, st, t["master"])
        c.servers[victim].proc.send_signal(signal.SIGKILL)
        c.servers[victim].proc.wait(timeout=5)
        wait_declared_dead(c, t["master"])
        assert wait_until(lambda: all(not x["recovering"] for x in (tablet_at(status(c), t["first_slot"]), tablet_at(status(c), at))), timeout=60)
        acked_at_recovery = keys.acked
        assert wait_until(lambda: keys.acked > acked_at_recovery + 200, timeout=30)
        stop.set()
        for th in threads:
            th.join(timeout=20)
        alive = next(i for i in range(4) if i != victim)
        got = read_all(c, alive, list(keys.possible))
        for k, v in got.items():
            keys.read(k, v, "after the master died")
        assert not keys.violations, keys.violations[:10]

        # The halves are tablets of their own: the upper one moves alone.
        wait_settled(c, copies=True, timeout=120)
        st = status(c)
        hi, lo = tablet_at(st, at), tablet_at(st, t["first_slot"])
        # Three servers are left, all backing the half up: it moves to one of its backups.
        up = [x["id"] for x in st["servers"] if x["state"] == "up" and x["id"] != hi["master"]]
        to = sorted(up, key=lambda i: i == lo["master"])[0]
        out = move(c, str(at), to)
        assert out.returncode == 0 and f"moved to server {to}" in out.stdout, out.stdout + out.stderr
        st = status(c)
        assert tablet_at(st, at)["master"] == to
        after = tablet_at(st, t["first_slot"])
        assert (after["master"], after["epoch"], after["last_slot"]) == (lo["master"], lo["epoch"], at - 1), (after, lo)
        got = read_all(c, alive, list(keys.possible))
        for k, v in got.items():
            keys.read(k, v, "after the upper half moved")
        assert not keys.violations, keys.violations[:10]
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=20)
        c.stop()


def test_a_tablet_that_grows_past_the_split_size_splits_by_itself(tmp_path):
    c = Cluster(tmp_path, servers=3, coordinator_args=["--split-mib", "4"])
    try:
        st = status(c)
        t = tablet_at(st, 0)
        tablets_before = sum(len(x["tablets"]) for x in st["tables"])
        names = keys_in(t, 6000, "g:")
        value = lambda k: (k.encode() * 200)[:1000]  # noqa: E731
        preload(c, names, value)
        # About 6 MB on one tablet: past 4 MiB, it splits (and its halves, under 4 MiB, stay).
        assert wait_until(lambda: tablet_at(status(c), 0)["last_slot"] < t["last_slot"], timeout=30), tablet_at(status(c), 0)
        st = status(c)
        lo = tablet_at(st, 0)
        hi = tablet_at(st, lo["last_slot"] + 1)
        assert hi["last_slot"] == t["last_slot"] and hi["master"] == t["master"], (lo, hi)
        assert sum(len(x["tablets"]) for x in st["tables"]) == tablets_before + 1
        got = read_all(c, 1, names)
        missing = [k for k in names if got.get(k) != value(k)]
        assert not missing, missing[:5]
    finally:
        c.stop()


def test_split_halves_merge_back_under_writers_and_a_kill_loses_nothing(tmp_path):
    c = Cluster(tmp_path, servers=3, coordinator_args=["--split-mib", "0"])
    stop = threading.Event()
    threads = []
    try:
        st = status(c)
        t = tablet_at(st, 0)
        names = keys_in(t, 1200, "j:")
        value = lambda k: (k.encode() * 50)[:500]  # noqa: E731
        preload(c, names, value)
        keys = Keys()
        for k in names:
            keys.acked_write(k, value(k))
        threads = [threading.Thread(target=cluster_writer, args=(c.servers[i].resp, names[i * 100:(i + 1) * 100], keys, i, stop), daemon=True)
                   for i in range(3)]
        for th in threads:
            th.start()
        out = split(c, "0")
        assert out.returncode == 0, out.stdout + out.stderr
        wait_settled(c, copies=True, timeout=60)
        at = tablet_at(status(c), t["last_slot"])["first_slot"]
        assert at > t["first_slot"]
        acked = keys.acked
        assert wait_until(lambda: keys.acked > acked + 200, timeout=20)
        out = subprocess.run([ramlog_bin(), "cluster", "merge", "default", "0", "--coordinator", c.coordinator_addr,
                              "--timeout", "60"], capture_output=True, text=True, timeout=90)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"merged into {t['first_slot']}-{t['last_slot']}" in out.stdout, out.stdout
        m = tablet_at(status(c), 0)
        assert (m["first_slot"], m["last_slot"], m["master"], m["epoch"]) == (t["first_slot"], t["last_slot"], t["master"], t["epoch"] + 2), m
        acked = keys.acked
        assert wait_until(lambda: keys.acked > acked + 200, timeout=20)
        # The joined tablet's memory holds both ranges' objects (none hidden by a map served
        # while it joined them): the preloaded keys the writers leave alone read back.
        quiet = names[300:]
        got = read_all(c, 0, quiet)
        wrong = [k for k in quiet if got.get(k) != value(k)]
        assert not wrong, wrong[:10]
        # The master dies at once, while the merged tablet's copies to the backups may still run:
        # the restore reads both halves' logs.
        victim = index_of(c, status(c), t["master"])
        c.servers[victim].proc.send_signal(signal.SIGKILL)
        c.servers[victim].proc.wait(timeout=5)
        wait_declared_dead(c, t["master"])
        assert wait_until(lambda: not tablet_at(status(c), 0)["recovering"], timeout=60)
        acked = keys.acked
        assert wait_until(lambda: keys.acked > acked + 100, timeout=30)
        stop.set()
        for th in threads:
            th.join(timeout=20)
        alive = next(i for i in range(3) if i != victim)
        got = read_all(c, alive, list(keys.possible))
        for k, v in got.items():
            keys.read(k, v, "after the merged tablet's master died")
        assert not keys.violations, keys.violations[:10]
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=20)
        c.stop()


def test_small_split_halves_merge_back_by_themselves_and_the_first_tablets_never_do(tmp_path):
    # Halves under a quarter of --split-mib (2 MiB here) merge back; the tablets the table was
    # created with are as small, and stay.
    c = Cluster(tmp_path, servers=3, coordinator_args=["--split-mib", "8"])
    try:
        st = status(c)
        t = tablet_at(st, 0)
        tablets_before = sum(len(x["tablets"]) for x in st["tables"])
        names = keys_in(t, 1000, "a:")
        value = lambda k: (k.encode() * 40)[:400]  # noqa: E731
        preload(c, names, value)
        out = split(c, "0")
        assert out.returncode == 0, out.stdout + out.stderr
        # The leader may merge the halves back before this status is read: then the epoch shows
        # both steps (split, merge) instead of the lower half.
        seen = tablet_at(status(c), 0)
        assert seen["last_slot"] < t["last_slot"] or seen["epoch"] >= t["epoch"] + 2, (seen, t)
        assert wait_until(lambda: tablet_at(status(c), 0)["last_slot"] == t["last_slot"], timeout=60), tablet_at(status(c), 0)
        st = status(c)
        m = tablet_at(st, 0)
        assert (m["first_slot"], m["master"]) == (t["first_slot"], t["master"]) and m["epoch"] >= t["epoch"] + 2, m
        # Two more planning rounds: nothing else merges.
        wait_settled(c, copies=True, timeout=60)
        assert not wait_until(lambda: sum(len(x["tablets"]) for x in status(c)["tables"]) != tablets_before, timeout=6)
        got = read_all(c, 1, names)
        missing = [k for k in names if got.get(k) != value(k)]
        assert not missing, missing[:5]
    finally:
        c.stop()


def test_redis_cli_c_sees_no_error_through_a_split_a_merge_and_a_move(tmp_path):
    # The switches of a split, a merge and a move hold the cluster port's requests for their
    # slots a moment instead of answering -TRYAGAIN, which redis-cli -c prints rather than retries.
    c = Cluster(tmp_path, servers=3, coordinator_args=["--split-mib", "0"])
    try:
        st = status(c)
        t = tablet_at(st, 0)
        names = keys_in(t, 3000, "c:")
        preload(c, names, lambda k: (k.encode() * 30)[:300])
        server = index_of(c, st, t["master"])
        cli = subprocess.Popen(["redis-cli", "-c", "-p", str(c.servers[server].resp)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        stop = threading.Event()
        sent = [0]

        def feed():
            i = 0
            while not stop.is_set():
                k = names[i % len(names)]
                cli.stdin.write(f"SET {k} v{i}\nGET {k}\n".encode())
                sent[0] += 2
                i += 1
                if i % 200 == 0:
                    cli.stdin.flush()
            cli.stdin.close()

        out = []
        reader = threading.Thread(target=lambda: out.append(cli.stdout.read()), daemon=True)
        writer = threading.Thread(target=feed, daemon=True)
        reader.start()
        writer.start()
        try:
            r = split(c, "0")
            assert r.returncode == 0, r.stdout + r.stderr
            wait_settled(c, copies=True, timeout=60)
            r = subprocess.run([ramlog_bin(), "cluster", "merge", "default", "0", "--coordinator", c.coordinator_addr,
                                "--timeout", "60"], capture_output=True, text=True, timeout=90)
            assert r.returncode == 0, r.stdout + r.stderr
            wait_settled(c, copies=True, timeout=60)
            st = status(c)
            to = next(x["id"] for x in st["servers"] if x["state"] == "up" and x["id"] != tablet_at(st, 0)["master"])
            r = move(c, "0", to)
            assert r.returncode == 0, r.stdout + r.stderr
        finally:
            stop.set()
            writer.join(timeout=30)
            reader.join(timeout=60)
            cli.wait(timeout=30)
        lines = out[0].decode(errors="replace").splitlines()
        errors = [x for x in lines if x.startswith("(error)") or "TRYAGAIN" in x or "ERR" in x]
        assert sent[0] > 2000 and len(lines) >= sent[0], (sent[0], len(lines))
        assert not errors, errors[:5]
    finally:
        c.stop()
