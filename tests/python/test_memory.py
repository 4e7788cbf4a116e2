"""The memory breakdown in /metrics and INFO memory against the process's real RSS.

The server reports what it holds by part (the log, the index, each part of the backup store,
connection buffers, and the process itself as it was before the engine and the store existed).
Their sum must match the resident set size the kernel reports within 10%, with persistence on
and off, after loading data and while it is being overwritten.
"""

import re
import urllib.request

import pytest

KEYS = 300_000
VALUE = 100


def metrics(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.admin_port}/metrics", timeout=10) as r:
        return r.read().decode()


def parts(text: str) -> dict:
    found = {}
    for m in re.finditer(r'^ramlog_memory_part_bytes\{part="([a-z_]+)"\} (\d+)$', text, re.M):
        found[m.group(1)] = int(m.group(2))
    return found


def gauge(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def proc_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def load(client, keys: int, fill: bytes):
    pipe = client.pipeline(transaction=False)
    value = fill * VALUE
    for i in range(keys):
        pipe.set(f"key:{i:012d}", value)
        if i % 2000 == 1999:
            assert all(pipe.execute())
    assert all(pipe.execute())


def check_breakdown(server):
    text = metrics(server)
    p = parts(text)
    for part in ["log", "index", "connections", "process"]:
        assert part in p, f"part {part} missing: {sorted(p)}"
    accounted = gauge(text, "ramlog_memory_accounted_bytes")
    assert accounted == sum(p.values())
    reported_rss = gauge(text, "ramlog_process_rss_bytes")
    rss = proc_rss(server.proc.pid)
    # The server's own RSS figure and the kernel's agree (same moment, give or take a page run).
    assert abs(reported_rss - rss) <= 0.05 * rss, (reported_rss, rss)
    assert abs(accounted - rss) <= 0.10 * rss, f"parts sum to {accounted} against RSS {rss}: {p}"
    return p, rss


@pytest.mark.parametrize("persistence", ["off", "async"])
def test_the_memory_breakdown_sums_to_the_rss(make_server, persistence):
    s = make_server("--persistence", persistence)  # the fixture runs with --memory 256MiB
    c = s.client()
    load(c, KEYS, b"a")
    p, rss = check_breakdown(s)
    # The data is where the breakdown says it is: the log holds at least the live bytes.
    live = gauge(metrics(s), "ramlog_memory_bytes_live")
    assert p["log"] >= live
    assert p["index"] > 0
    if persistence == "async":
        backup = {k: v for k, v in p.items() if k.startswith("backup_")}
        assert backup, f"no backup parts reported: {sorted(p)}"
        assert sum(backup.values()) > 0
    # Overwrites: the cleaner and the backup store's reorganization run, and the account holds.
    load(c, KEYS, b"b")
    check_breakdown(s)
    info = c.info("memory")
    info_parts = {k: v for k, v in info.items() if k.startswith("ramlog_memory_") and k[len("ramlog_memory_"):] in p}
    for part in ["log", "index", "process"]:
        assert f"ramlog_memory_{part}" in info_parts
    assert info["used_memory"] == sum(info_parts.values())
    assert abs(info["used_memory"] - info["used_memory_rss"]) <= 0.10 * info["used_memory_rss"]
    # The log may use the budget less what the other parts charged to it hold.
    capacity = gauge(metrics(s), "ramlog_memory_log_capacity_bytes")
    assert 0 < capacity < 256 * 1024 * 1024
    c.close()
