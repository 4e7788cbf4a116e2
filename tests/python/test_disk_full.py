"""Disk full: a server whose data directory cannot be written refuses every write with MISCONF,
keeps answering reads with what they returned before, reports the failure in INFO persistence and
/metrics, accepts writes again by itself once space is freed, and after a restart (SIGTERM or
kill -9) has every write it acknowledged and none it deleted.

The data directory lies on a small tmpfs, mounted here (the test runs as root, here and in CI; a
failed mount fails the test, since the scenario then did not run).

Sizes, measured with this store's defaults on a tmpfs: a fresh data directory takes 257 MiB at
start (the 256 MiB primary log is preallocated). Once about 8 MiB has been written, each of the 64
tablets' secondary logs preallocates its first 8 MiB segment (64 x 8 MiB = 512 MiB, about 770 MiB
in all). The tmpfs is 1152 MiB: the store fits at start, and the ballast file fills all but
HEADROOM of what is left, so the first segments fail to be allocated after a few MiB of writes.
Removing the ballast frees about 870 MiB, room for a second store of the full size beside the
first, which the rewrite into a fresh store may need.
"""

import os
import re
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from conftest import Server, wait_until

TMPFS_MB = 1152
HEADROOM = 24 << 20
VALUE_BYTES = 1000
# Bounds of the filling loop: the disk fills after some 10k keys (about a second).
FILL_MAX_KEYS = 100_000
FILL_MAX_SECONDS = 20
RECOVERY_SECONDS = 30
# Async persistence writes and fdatasyncs every 100 ms: before a kill -9 the test waits this long.
ASYNC_SETTLE_SECONDS = 1.5


@contextmanager
def tmpfs(path: Path, size_mb: int):
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
        capture_output=True, text=True,
    )
    if mounted.returncode != 0:
        pytest.fail(
            f"cannot mount a {size_mb} MiB tmpfs at {path} (needs root): {mounted.stderr.strip()}; "
            "the disk-full scenario did not run"
        )
    try:
        yield path
    finally:
        out = subprocess.run(["umount", str(path)], capture_output=True, text=True)
        if out.returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def value_of(key: str) -> str:
    head = f"{key}="
    return head + "v" * (VALUE_BYTES - len(head))


def is_misconf(e: Exception) -> bool:
    return isinstance(e, redis.exceptions.ResponseError) and str(e).startswith("MISCONF")


def info_persistence(server: Server) -> dict:
    """INFO persistence as raw `field:value` pairs (redis-py's parser would split the error text)."""
    text = server.cli("info", "persistence")
    fields = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and ":" in line:
            name, value = line.split(":", 1)
            fields[name] = value
    return fields


def metrics(server: Server) -> dict:
    url = f"http://127.0.0.1:{server.admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


class Model:
    """What the server may hold for each key written: a set of possible values (None = absent).

    An acknowledged write makes its result the only possibility; a refused one adds its result to
    the possibilities (a refused write was not acknowledged; it may or may not have been applied).
    """

    def __init__(self):
        self.possible: dict[str, set] = {}
        self.acked_sets = 0
        self.acked_dels = 0
        self.acked_incrs = 0
        self.refused = 0

    def current(self, key):
        return self.possible.get(key, {None})

    def apply(self, op, key, result):
        """Records `op` on `key` ("set", "del" or "incr") answered with `result` (a reply or an error)."""
        if isinstance(result, Exception):
            if not is_misconf(result):
                raise AssertionError(f"{op} {key} failed with something else than MISCONF: {result!r}")
            self.refused += 1
            before = self.current(key)
            if op == "set":
                after = {value_of(key)}
            elif op == "del":
                after = {None}
            else:
                after = {str(int(v or 0) + 1) for v in before}
            self.possible[key] = before | after
            return False
        if op == "set":
            assert result is True, (key, result)
            self.possible[key] = {value_of(key)}
            self.acked_sets += 1
        elif op == "del":
            assert result in (0, 1), (key, result)
            self.possible[key] = {None}
            self.acked_dels += 1
        else:
            self.possible[key] = {str(result)}
            self.acked_incrs += 1
        return True

    def exact(self):
        """Keys whose value is known (only acknowledged writes, or refused ones that changed nothing)."""
        return {k: next(iter(v)) for k, v in self.possible.items() if len(v) == 1}

    def check(self, c, what):
        keys = sorted(self.possible)
        wrong = []
        for i in range(0, len(keys), 500):
            chunk = keys[i:i + 500]
            for k, got in zip(chunk, c.mget(chunk)):
                if got not in self.possible[k]:
                    wrong.append(f"{k}: {got and got[:40]!r}, expected one of {[v and v[:40] for v in self.possible[k]]}")
        assert not wrong, f"{what}: {len(wrong)} of {len(keys)} keys wrong, e.g. {wrong[:5]}"
        present_min = sum(1 for v in self.possible.values() if None not in v)
        present_max = sum(1 for v in self.possible.values() if v != {None})
        assert present_min <= c.dbsize() <= present_max, (what, c.dbsize(), present_min, present_max)


def write_batch(c, model: Model, batch: int, counters: int = 8):
    """One pipeline: 200 SETs of new keys, DELs of two keys of an earlier batch, INCRs of counters.
    Returns how many of its writes were refused."""
    ops = [("set", f"b{batch}:{i}") for i in range(200)]
    if batch >= 2:
        ops += [("del", f"b{batch - 2}:{i}") for i in (batch % 200, (batch * 7 + 3) % 200)]
    ops += [("incr", f"ctr:{(batch + j) % counters}") for j in range(4)]
    p = c.pipeline(transaction=False)
    for op, key in ops:
        if op == "set":
            p.set(key, value_of(key))
        elif op == "del":
            p.delete(key)
        else:
            p.incr(key)
    results = p.execute(raise_on_error=False)
    return sum(0 if model.apply(op, key, r) else 1 for (op, key), r in zip(ops, results))


@pytest.mark.parametrize("stop", ["sigterm", "kill9"])
@pytest.mark.parametrize("mode", ["durable", "async"])
def test_disk_full_refuses_writes_keeps_reads_and_recovers(tmp_path, mode, stop):
    mnt = tmp_path / "mnt"
    args = ["--persistence", mode]
    servers = []
    with tmpfs(mnt, TMPFS_MB):
        try:
            s = Server(mnt, args)
            servers.append(s)
            c = s.client(decode_responses=True)
            healthy = info_persistence(s)
            assert healthy.get("aof_last_write_status") == "ok", healthy
            assert healthy.get("ramlog_persistence_status") == "ok", healthy
            assert metrics(s).get("ramlog_persistence_failed") == 0

            ballast = mnt / "ballast"
            size = free_bytes(mnt) - HEADROOM
            assert size > 0, f"the store took the whole {TMPFS_MB} MiB tmpfs at start"
            with open(ballast, "wb") as f:
                chunk = b"\0" * (1 << 20)
                for _ in range(size >> 20):
                    f.write(chunk)

            # Fill the disk: pipelines until a write is refused with MISCONF.
            model = Model()
            started = time.time()
            batch = 0
            refused = 0
            while (not refused and batch * 200 < FILL_MAX_KEYS
                   and time.time() - started < FILL_MAX_SECONDS):
                refused = write_batch(c, model, batch)
                batch += 1
            assert refused, (
                f"{mode}: no write was refused with MISCONF after {batch * 200} SETs of {VALUE_BYTES} B "
                f"in {time.time() - started:.1f} s with {free_bytes(mnt) >> 20} MiB free on the data "
                f"directory's file system; INFO persistence: {info_persistence(s)}"
            )
            assert model.acked_sets > 0, "the disk filled before any write was acknowledged"

            # Every write is refused now; reads go on and return what they returned before.
            failed = info_persistence(s)
            assert failed.get("aof_last_write_status") == "err", failed
            assert failed.get("ramlog_persistence_status") == "failed", failed
            assert failed.get("ramlog_persistence_error"), failed
            m = metrics(s)
            assert m.get("ramlog_persistence_failed") == 1, m
            assert m.get("ramlog_persistence_failures_total", 0) >= 1, m
            assert m.get("ramlog_writes_refused_total", 0) >= 1, m

            model.check(c, "reads while writes are refused")
            exact = model.exact()
            a_key = next(k for k, v in exact.items() if v is not None and k.startswith("b"))
            a_counter = next(k for k, v in exact.items() if v is not None and k.startswith("ctr:"))
            dbsize = c.dbsize()
            for name, call in [
                ("DEL", lambda: c.delete(a_key)),
                ("INCR", lambda: c.incr(a_counter)),
                ("SET", lambda: c.set("after-failure", "x")),
            ]:
                with pytest.raises(redis.exceptions.ResponseError) as refusal:
                    call()
                assert is_misconf(refusal.value), f"{name}: {refusal.value!r}"
            assert c.get(a_key) == exact[a_key], "a refused DEL changed the key"
            assert c.get(a_counter) == exact[a_counter], "a refused INCR changed the counter"
            assert c.exists(a_key) == 1 and c.get("after-failure") is None
            assert c.dbsize() == dbsize
            assert c.mget(a_key, a_counter) == [exact[a_key], exact[a_counter]]
            scanned = set(c.scan_iter(count=1000))
            assert len(scanned) == dbsize and a_key in scanned
            refused_total = metrics(s)["ramlog_writes_refused_total"]
            assert refused_total >= 4, refused_total

            # Free the space: writes resume by themselves within RECOVERY_SECONDS.
            ballast.unlink()
            probe = {"n": 0}

            def writes_accepted():
                probe["n"] += 1
                try:
                    return c.set("probe", str(probe["n"]))
                except redis.exceptions.ResponseError as e:
                    assert is_misconf(e), repr(e)
                    return False

            assert wait_until(writes_accepted, timeout=RECOVERY_SECONDS, interval=0.2), (
                f"writes still refused {RECOVERY_SECONDS} s after the space was freed "
                f"({free_bytes(mnt) >> 20} MiB free); INFO persistence: {info_persistence(s)}"
            )
            model.possible["probe"] = {str(probe["n"])}
            recovered = info_persistence(s)
            assert recovered.get("aof_last_write_status") == "ok", recovered
            assert recovered.get("ramlog_persistence_status") == "ok", recovered
            m = metrics(s)
            assert m.get("ramlog_persistence_failed") == 0, m
            assert m.get("ramlog_persistence_failures_total", 0) >= 1, m
            model.check(c, "reads after writes resumed")

            # A few more writes after the recovery, all acknowledged.
            for extra in range(batch, batch + 5):
                assert write_batch(c, model, extra) == 0, "a write was refused after the recovery"
            assert model.apply("del", a_key, c.delete(a_key))
            assert model.apply("incr", a_counter, c.incr(a_counter))
            model.check(c, "reads after more writes")

            if stop == "sigterm":
                s.stop()
                assert s.proc.returncode == 0, s.proc.stderr.read()
            else:
                if mode == "async":
                    time.sleep(ASYNC_SETTLE_SECONDS)
                s.proc.kill()
                s.proc.wait()

            s2 = Server(mnt, args)
            servers.append(s2)
            c2 = s2.client(decode_responses=True)
            model.check(c2, f"after a restart ({stop})")
            assert c2.get(a_key) is None, "a deleted key came back"
            assert c2.get("after-failure") is None, "a refused SET came back"
            for key, v in model.exact().items():
                assert c2.get(key) == v, key
            assert model.acked_dels > 0 and model.acked_incrs > 0
            status = info_persistence(s2)
            assert status.get("ramlog_persistence_status") == "ok", status
        finally:
            for srv in servers:
                srv.stop()
