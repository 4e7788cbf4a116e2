"""Ordinary inputs never take a cluster down (issue 47): the empty key, binary keys, keys and
values at their limits and expiry extremes work on every cluster path, in every table mode;
a unit a backup refuses stalls nothing. Real processes on loopback; each test starts its own
cluster and stops every process by its pid."""

import json
import signal
import subprocess
import time

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from conftest import Cluster, ramlog_bin, wait_until
from test_failures import server_id_of, status, wait_declared_dead, wait_settled

KEY_MAX = 64 * 1024
VALUE_MAX = 1 << 20
FAR_FUTURE_MS = 4102444800000  # 2100-01-01


def edge_cases(mode: str):
    """(key, value, expire_at_ms or None) at and around every documented limit."""
    every_byte = bytes(range(256))
    return [
        (b"", f"{mode}: the empty key".encode(), None),
        (b"\x00", b"", None),                                   # a NUL key, an empty value
        (every_byte, every_byte * 4, None),                     # every byte value, both sides
        (b"crlf\r\n" + mode.encode(), b"\r\n$-1\r\n*", None),   # RESP-looking bytes
        (b"k" * KEY_MAX, mode.encode(), None),                  # the longest key
        (b"k" * (KEY_MAX - 1), b"", FAR_FUTURE_MS),             # one below, expiring far ahead
        (f"max-value:{mode}".encode(), bytes([7]) * VALUE_MAX, None),  # the largest value
        # The largest value that begins with the typed-value tag byte (stored escaped, 2 bytes
        # longer: docs/formats.md, "Typed values"), and the shortest.
        (f"tag-max:{mode}".encode(), b"\xff" + bytes([7]) * (VALUE_MAX - 1), None),
        (f"tag:{mode}".encode(), b"\xff", None),
        (f"expiry:{mode}".encode(), b"soon", int(time.time() * 1000) + 3_600_000),
    ]


def native_set(c: Cluster, i: int, key: bytes, value: bytes):
    out = subprocess.run(
        [ramlog_bin(), "set", "-p", str(c.servers[i].native), key.decode(), "-"],
        input=value, capture_output=True, timeout=30,
    )
    assert out.returncode == 0, (key[:40], out.stdout, out.stderr)


def native_get(c: Cluster, i: int, key: bytes) -> bytes:
    out = subprocess.run(
        [ramlog_bin(), "get", "-p", str(c.servers[i].native), key.decode()],
        capture_output=True, timeout=30,
    )
    assert out.returncode == 0, (key[:40], out.stdout, out.stderr)
    return out.stdout.rstrip(b"\n")


def dump_entries(data_dir) -> dict:
    """key -> (value, version, expiry) of the newest entry of each key in a stopped server's store."""
    out = subprocess.run(
        [ramlog_bin(), "backup", "dump", "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[:3000]
    keys = {}
    for line in out.stdout.splitlines():
        e = json.loads(line)
        key = bytes.fromhex(e["key"])
        if key not in keys or e["version"] > keys[key][1]:
            keys[key] = (bytes.fromhex(e["value"]), e["version"], e.get("expiry", 0))
    return keys


def backups_of(c: Cluster, st: dict, key: bytes) -> list:
    """Indexes of the servers that back up `key`'s tablet in the map `st`."""
    slot = key_slot(key)
    table = next(t for t in st["tables"] if t["name"] == "default")
    tablet = next(t for t in table["tablets"] if t["first_slot"] <= slot <= t["last_slot"])
    return [i for i in range(len(c.servers)) if server_id_of(c, st, i) in tablet["backups"]]


def master_of(c: Cluster, st: dict, key: bytes) -> int:
    slot = key_slot(key)
    table = next(t for t in st["tables"] if t["name"] == "default")
    tablet = next(t for t in table["tablets"] if t["first_slot"] <= slot <= t["last_slot"])
    return next(i for i in range(len(c.servers)) if server_id_of(c, st, i) == tablet["master"])


@pytest.mark.parametrize("mode", ["async", "sync", "durable", "mirror"])
def test_edge_keys_and_values_on_every_cluster_path_and_through_a_master_crash(tmp_path, mode):
    c = Cluster(tmp_path, coordinator_args=["--default-mode", mode])
    try:
        if mode == "mirror":
            from test_mirror import mirrors_ready
            assert wait_until(lambda: mirrors_ready(c), timeout=30, interval=0.1)
        cases = edge_cases(mode)
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
        routing = redis.Redis(port=c.servers[1].routing, socket_timeout=10)
        expected = {}
        # Through the cluster port (redis-py follows -MOVED), then overwritten through the routing
        # port, each read back both ways.
        for key, value, at in cases:
            assert rc.set(key, value, pxat=at) is True, key[:40]
            assert rc.get(key) == value, key[:40]
            v2 = value + b"/routed" if len(value) < VALUE_MAX else value[:-1] + b"!"
            assert routing.set(key, v2, pxat=at) is True, key[:40]
            assert routing.get(key) == v2
            assert rc.get(key) == v2
            expected[key] = (v2, at)
        assert rc.ttl(b"") == -1
        assert 3500 <= rc.ttl(f"expiry:{mode}".encode()) <= 3600
        # redis-cli on the cluster port with -c, the empty key and a binary one.
        out = subprocess.run(["redis-cli", "-c", "-p", str(c.servers[2].resp), "SET", "", "from redis-cli"],
                             capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "OK", out
        expected[b""] = (b"from redis-cli", None)
        # The native protocol (ramlog's map-routed client): the empty key and the longest key.
        native_set(c, 0, b"", b"native \x00 empty")
        assert native_get(c, 1, b"") == b"native \x00 empty"
        expected[b""] = (b"native \x00 empty", None)
        native_set(c, 2, b"n" * KEY_MAX, b"")
        assert native_get(c, 0, b"n" * KEY_MAX) == b""
        expected[b"n" * KEY_MAX] = (b"", None)
        # Deletes of edge keys replicate too.
        assert rc.delete(b"\x00") == 1
        expected[b"\x00"] = (None, None)

        # Collections with edge fields, members and elements, in the empty key's slot (so on the
        # tablet killed below), written through the cluster port and read back through both.
        tag = next(f"{{c{i}}}" for i in range(10**6) if key_slot(f"c{i}".encode()) == key_slot(b""))
        hkey, lkey, skey, zkey = (f"{tag}{t}:{mode}".encode() for t in ("hash", "list", "set", "zset"))
        fields = {b"": b"\xff", b"\x00": b"", b"\xff\x00": bytes(range(256)), b"k" * 1000: b"v"}
        assert rc.hset(hkey, mapping=fields) == 4
        assert rc.rpush(lkey, b"", b"\xff", b"\r\n", bytes(range(256))) == 4
        assert rc.sadd(skey, b"", b"\xff", b"m") == 3
        assert rc.zadd(zkey, {b"": 0, b"\xff": float("inf"), b"neg": float("-inf"), b"half": 0.5}) == 4
        assert routing.hdel(hkey, b"k" * 1000) == 1
        del fields[b"k" * 1000]
        assert routing.lpop(lkey) == b""
        assert routing.type(hkey) == b"hash" and routing.get(f"tag:{mode}".encode()) == b"\xff/routed"

        def collections_read_back(client):
            assert client.hgetall(hkey) == fields, mode
            assert client.lrange(lkey, 0, -1) == [b"\xff", b"\r\n", bytes(range(256))], mode
            assert client.smembers(skey) == {b"", b"\xff", b"m"}, mode
            assert client.zrange(zkey, 0, -1, withscores=True) == [
                (b"neg", float("-inf")), (b"", 0.0), (b"half", 0.5), (b"\xff", float("inf"))], mode
            assert [client.type(k) for k in (hkey, lkey, skey, zkey)] == [b"hash", b"list", b"set", b"zset"]
        collections_read_back(rc)
        collections_read_back(routing)

        # kill -9 the master of the empty key's tablet; its backups restore it.
        st = status(c)
        victim = master_of(c, st, b"")
        victim_id = server_id_of(c, st, victim)
        if mode == "async":
            # async acknowledges before the backups hold a write: let the streams drain first.
            time.sleep(1.0)
        c.servers[victim].proc.send_signal(signal.SIGKILL)
        c.servers[victim].proc.wait(timeout=10)
        wait_declared_dead(c, victim_id)
        wait_settled(c, copies=False, timeout=60)
        alive = [i for i in range(len(c.servers)) if i != victim]
        rc = RedisCluster(host="127.0.0.1", port=c.servers[alive[0]].resp, socket_timeout=10)
        routing = redis.Redis(port=c.servers[alive[1]].routing, socket_timeout=10)
        for key, (value, at) in expected.items():
            assert rc.get(key) == value, (mode, key[:40])
            assert routing.get(key) == value, (mode, key[:40])
        collections_read_back(rc)
        collections_read_back(routing)
        assert rc.pttl(f"expiry:{mode}".encode()) > 3_000_000
        assert rc.pttl(b"k" * (KEY_MAX - 1)) > 10**12 // 2

        # Re-protected, then every process stopped: each live key is in the stores of its
        # tablet's backups, with its value and expiry.
        wait_settled(c, copies=True, timeout=120)
        st = status(c)
        c.stop()
        stores = {i: dump_entries(c.servers[i].data_dir) for i in alive}
        for key, (value, at) in expected.items():
            for b in backups_of(c, st, key):
                if b not in stores:
                    continue
                entry = stores[b].get(key)
                if value is None:
                    assert entry is None, (mode, b, key[:40])
                    continue
                assert entry is not None, (mode, b, key[:40])
                # A string that begins with the tag byte is stored escaped.
                stored = b"\xff\x00" + value if value[:1] == b"\xff" else value
                assert entry[0] == stored, (mode, b, key[:40])
                if at is not None:
                    assert entry[2] == at, (mode, b, key[:40], entry[2], at)
    finally:
        c.stop()


def _info_replication(port) -> dict:
    out = subprocess.run(["redis-cli", "-p", str(port), "INFO", "replication"],
                         capture_output=True, text=True, timeout=10).stdout
    streams = {}
    for line in out.splitlines():
        if line.startswith("ramlog_backup") and "id=" in line:
            fields = dict(f.split("=", 1) for f in line.split(":", 1)[1].split(","))
            streams[int(fields["id"])] = fields
    return streams


def test_a_unit_a_backup_refuses_fails_that_write_alone_and_the_stream_goes_on(tmp_path):
    """The backups' test fault switch refuses, once per key, a unit holding the value `poison`:
    exactly that write fails; the writes before and after it on the same stream succeed; the
    stream does not reconnect; the master re-sends the key, so every backup ends up with what
    the master serves."""
    c = Cluster(tmp_path, env={"RAMLOG_TEST_REFUSE_VALUE": "poison"})
    try:
        st = status(c)
        key = b"{refused}k"
        m = master_of(c, st, key)
        before_streams = _info_replication(c.servers[m].resp)
        r = redis.Redis(port=c.servers[m].resp, socket_timeout=10)
        pipe = r.pipeline(transaction=False)
        pipe.set(b"{refused}before", b"1")
        pipe.set(key, b"poison")
        pipe.set(b"{refused}after", b"2")
        pipe.get(key)
        results = pipe.execute(raise_on_error=False)
        assert results[0] is True and results[2] is True, results
        assert isinstance(results[1], redis.ResponseError), results
        assert "refused the write" in str(results[1]) and "outcome is unknown" in str(results[1]), results
        # The read that followed it waited for the re-send: what it shows is on every backup.
        assert results[3] == b"poison", results
        # More writes on the same stream go through at once.
        t0 = time.monotonic()
        for i in range(100):
            assert r.set(f"{{refused}}n{i}".encode(), b"x") is True
        assert time.monotonic() - t0 < 5
        after_streams = _info_replication(c.servers[m].resp)
        for backup, fields in after_streams.items():
            assert fields["connects"] == before_streams[backup]["connects"] == "1", (before_streams, after_streams)
        metrics = "".join(
            subprocess.run(["curl", "-s", f"http://127.0.0.1:{s.admin}/metrics"], capture_output=True,
                           text=True, timeout=10).stdout for s in c.servers)
        refused = sum(int(l.split()[1]) for l in metrics.splitlines()
                      if l.startswith("ramlog_backup_refused_content_total "))
        assert refused == 2, refused  # once on each of the tablet's two backups
        st = status(c)
        backups = backups_of(c, st, key)
        c.stop()
        for b in backups:
            entries = dump_entries(c.servers[b].data_dir)
            assert entries[key][0] == b"poison", b
            assert entries[b"{refused}before"][0] == b"1" and entries[b"{refused}after"][0] == b"2"
    finally:
        c.stop()


def test_a_backup_that_keeps_refusing_is_declared_dead_and_the_stream_goes_on(tmp_path):
    """One server's fault switch refuses, every time, a unit holding `poison` (re-sends too): it
    cannot hold what its masters serve. The write fails; the master reports the backup as failing;
    the coordinator declares it dead at once (no probe: it would answer one) and the cluster goes
    on without it; nothing waits for ever."""
    bad = 2
    c = Cluster(tmp_path, env=lambda i: {"RAMLOG_TEST_REFUSE_VALUE": "always:poison"} if i == bad else None)
    try:
        st = status(c)
        bad_id = server_id_of(c, st, bad)
        key = next(k for k in (f"{{p{n}}}k".encode() for n in range(10_000))
                   if bad in backups_of(c, st, k) and master_of(c, st, k) != bad)
        m = master_of(c, st, key)
        r = redis.Redis(port=c.servers[m].resp, socket_timeout=15)
        assert r.set(key + b"-before", b"1") is True
        t0 = time.monotonic()
        with pytest.raises(redis.ResponseError, match="refused the write"):
            r.set(key, b"poison")
        assert time.monotonic() - t0 < 5, "the refused write waited for the acknowledgement timeout"
        wait_declared_dead(c, bad_id, timeout=10)
        log = (tmp_path / "coordinator-1.log").read_text()
        assert "reports that it fails" in log and "refuses replicated writes" in log, log[-3000:]
        # Fenced, the bad server stops by itself.
        c.servers[bad].proc.wait(timeout=15)
        # The stream goes on: writes on the same master are acknowledged at once, and what the
        # master applied stays readable (the write was in doubt; it took effect).
        t0 = time.monotonic()
        for i in range(50):
            assert r.set(key + f"-after{i}".encode(), b"x") is True
        assert time.monotonic() - t0 < 5
        assert r.get(key) == b"poison"
        assert r.get(key + b"-before") == b"1"
    finally:
        c.stop()
