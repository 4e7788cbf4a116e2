"""Re-protection copies stream the tablet's log and are paced by the clients' latency.

Three servers, R = 1, copies at most 32 MiB/s. A server is killed: the survivors restore its
tablets and copy them, and the tablets it backed up, to new backups. While clients run slow
commands on the survivors (KEYS over tens of thousands of keys, several milliseconds each, among
fast PINGs, so that the command p99 is far above its usual value) the copies slow down to their
floor; once the slow commands stop they climb back to the ceiling. Then a second server is
killed: with R = 1 its tablets come back only from the copies, so every key (the empty key and a
binary one included) must read back with its value. Real processes on loopback; every process is
stopped by its pid and every wait is bounded."""

import signal
import threading
import time

import redis

from conftest import Cluster, wait_until
from test_failures import server_id_of, status, wait_declared_dead, wait_settled
from test_mirror import server_status
from test_recovery_kills import preload, read_all

CEILING = 32 << 20
FLOOR = 4 << 20  # a sixteenth of the ceiling, and at least 4 MiB/s


def copy_rates(c: Cluster, servers) -> list:
    """The pace of every copy running on `servers` now, bytes per second."""
    rates = []
    for i in servers:
        jobs = server_status(c, i)["metrics"]["replication"]["recovery"]
        rates += [j["rate"] for j in jobs if j["kind"] == "copy" and j["state"] == "copying"]
    return rates


def slow_clients(c: Cluster, servers, stop: threading.Event) -> list:
    """One client per server: KEYS over the whole keyspace (matching nothing) among PINGs."""
    def run(port):
        r = redis.Redis(port=port, socket_timeout=10)
        while not stop.is_set():
            for _ in range(10):
                r.ping()
            r.keys("no-such-key-*")
            time.sleep(0.005)
    threads = [threading.Thread(target=run, args=(c.servers[i].resp,), daemon=True) for i in servers]
    for t in threads:
        t.start()
    return threads


def test_copies_slow_down_for_slow_clients_and_carry_every_key(tmp_path):
    config = tmp_path / "copy.toml"
    config.write_text(f"recovery_copy_bytes_per_sec = {CEILING}\n")
    c = Cluster(tmp_path, servers=3, extra_args=("--config", str(config), "--memory", "1GiB"),
                coordinator_args=["--default-replicas", "1"])
    stop = threading.Event()
    threads = []
    try:
        keys = [f"k:{n}" for n in range(250_000)] + ["", "bin\x00\xff\r\n"]
        value = lambda k: (k.encode("utf-8", "surrogateescape") * 100)[:1000] or b"empty-key-value"  # noqa: E731
        preload(c, keys, value)
        st = status(c)
        victim = server_id_of(c, st, 2)
        threads = slow_clients(c, [0, 1], stop)
        c.servers[2].proc.send_signal(signal.SIGKILL)
        c.servers[2].proc.wait(timeout=5)
        wait_declared_dead(c, victim)

        # While the clients are slow, the copies halve their pace down to the floor (they start at a
        # quarter of the ceiling, twice the floor).
        seen = []

        def slowed():
            seen.extend(copy_rates(c, [0, 1]))
            return FLOOR in seen
        assert wait_until(slowed, timeout=30, interval=0.05), (sorted(set(seen)), status(c)["pending_copies"])
        assert status(c)["pending_copies"] > 0, "copies still to go once the clients are fast again"

        # Fast clients: the copies climb back to the ceiling.
        stop.set()
        for t in threads:
            t.join(timeout=20)
        fast = []

        def at_ceiling():
            fast.extend(copy_rates(c, [0, 1]))
            return CEILING in fast
        assert wait_until(at_ceiling, timeout=10, interval=0.05), sorted(set(fast))
        wait_settled(c, copies=True, timeout=120)

        # The copies alone hold server 0's tablets now for what server 2 held: kill server 0.
        st = status(c)
        second = server_id_of(c, st, 0)
        c.servers[0].proc.send_signal(signal.SIGKILL)
        c.servers[0].proc.wait(timeout=5)
        wait_declared_dead(c, second)
        wait_settled(c, copies=False, timeout=120)
        got = read_all(c, 1, keys)
        wrong = [(k, got[k]) for k in keys if got[k] != value(k)]
        assert not wrong, (len(wrong), wrong[:5])
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=20)
        c.stop()
