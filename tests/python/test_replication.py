"""Replication: every acknowledged write is on the backups the map names, at the point its table's
mode promises; multi-puts are atomic; stale epochs are fenced. Real processes on loopback; each
test starts its own cluster and stops every process by its pid."""

import json
import os
import signal
import socket
import struct
import subprocess
import threading
import time
import urllib.request

import pytest
import redis
from redis.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from conftest import Cluster, ramlog_bin, wait_until


# ---- helpers ---------------------------------------------------------------------------------

def ramlog(*args, timeout=30):
    out = subprocess.run([ramlog_bin(), *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out.stdout


def status(c: Cluster) -> dict:
    return json.loads(ramlog("cluster", "status", "--json", "--coordinator", c.coordinator_addr))


def set_mode(c: Cluster, mode: str, table="default"):
    ramlog("table", "set-mode", table, mode, "--coordinator", c.coordinator_addr)
    version = status(c)["map_version"]

    def applied():
        for s in c.servers:
            if s.proc.poll() is not None:
                continue
            info = c.cluster_info(s.resp)
            line = [l for l in info.splitlines() if l.startswith("cluster_current_epoch:")]
            if not line or int(line[0].split(":")[1]) < version:
                return False
        return True

    assert wait_until(applied, timeout=10), f"servers did not apply map {version}"


def tablet_of(st: dict, table_id: int, slot: int) -> dict:
    table = next(t for t in st["tables"] if t["id"] == table_id)
    return next(t for t in table["tablets"] if t["first_slot"] <= slot <= t["last_slot"])


def server_index(c: Cluster, st: dict, server_id: int) -> int:
    port = int(next(s for s in st["servers"] if s["id"] == server_id)["addresses"]["resp"].rsplit(":", 1)[1])
    return next(i for i, s in enumerate(c.servers) if s.resp == port)


def dump(data_dir) -> dict:
    """key -> (value, version, table, first_slot, epoch) of a stopped server's backup store."""
    out = subprocess.run(
        [ramlog_bin(), "backup", "dump", "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    keys = {}
    for line in out.stdout.splitlines():
        e = json.loads(line)
        key = bytes.fromhex(e["key"]).decode()
        prev = keys.get(key)
        if prev is None or e["version"] > prev[1]:
            keys[key] = (bytes.fromhex(e["value"]).decode(), e["version"], e["table"], e["first_slot"], e["epoch"])
    return keys


def timed_get(port, key, timeout=30.0):
    """Runs GET in a thread; returns (thread, result dict with 'value' or 'error')."""
    result = {}

    def run():
        try:
            result["value"] = redis.Redis(port=port, socket_timeout=timeout).get(key)
        except Exception as e:  # noqa: BLE001 - reported by the test
            result["error"] = repr(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def timed_set(port, key, value, timeout=30.0):
    """Runs SET in a thread; returns (thread, result dict with 'done' time or 'error')."""
    result = {}

    def run():
        try:
            r = redis.Redis(port=port, socket_timeout=timeout)
            t0 = time.monotonic()
            assert r.set(key, value)
            result["done"] = time.monotonic() - t0
        except Exception as e:  # noqa: BLE001 - reported by the test
            result["error"] = repr(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


# ---- tests -----------------------------------------------------------------------------------

def test_acknowledged_writes_are_on_the_backups_the_map_names(tmp_path):
    c = Cluster(tmp_path)
    expected = {}
    deleted = set()
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
        for i in range(3000):
            assert rc.set(f"key:{i}", f"v{i}")
            expected[f"key:{i}"] = f"v{i}"
        for i in range(0, 3000, 7):
            assert rc.delete(f"key:{i}") == 1
            expected.pop(f"key:{i}")
            deleted.add(f"key:{i}")
        for i in range(0, 3000, 5):
            if f"key:{i}" in deleted:
                continue
            assert rc.set(f"key:{i}", f"w{i}")
            expected[f"key:{i}"] = f"w{i}"
        # A deleted key written again is live.
        assert rc.set("key:7", "back")
        expected["key:7"] = "back"
        deleted.discard("key:7")
        st = status(c)
        table = next(t for t in st["tables"] if t["id"] == 0)
        assert table["mode"] == "sync" and table["replicas"] == 2

        # Observability while running: every server streams to two backups.
        for s in c.servers:
            info = redis.Redis(port=s.resp, socket_timeout=10).info("replication")
            assert info["role"] == "master" and info["connected_slaves"] == 2, info
            assert info["ramlog_ack_sync"]["acknowledged"] > 0, info
            metrics = subprocess.run(
                ["curl", "-s", f"http://127.0.0.1:{s.admin}/metrics"], capture_output=True, text=True, timeout=10
            ).stdout
            assert 'ramlog_replication_bytes_in_flight{backup="' in metrics
            assert 'ramlog_replication_ack_seconds_count{mode="sync"}' in metrics
            assert "ramlog_memory_part_bytes{part=\"replication_buffers\"}" in metrics
        status_json = json.loads(ramlog("status", "--admin-port", str(c.servers[0].admin)))
        streams = status_json["metrics"]["replication"]["streams"]
        assert len(streams) == 2 and all(s["connected"] for s in streams), streams
    finally:
        c.stop()

    ids = [s["id"] for s in st["servers"]]
    dumps = {sid: dump(c.servers[server_index(c, st, sid)].data_dir) for sid in ids}
    for key, value in expected.items():
        t = tablet_of(st, 0, key_slot(key.encode()))
        assert len(t["backups"]) == 2
        for b in t["backups"]:
            got = dumps[b].get(key)
            assert got is not None, f"{key} missing on backup {b}"
            assert got[0] == value, (key, got, value)
            assert (got[2], got[3]) == (0, t["first_slot"])
        # No double logging: the master keeps no log of its own tablets.
        assert key not in dumps[t["master"]], f"{key} logged on its master {t['master']}"
    for key in deleted:
        for sid in ids:
            assert key not in dumps[sid], f"deleted {key} came back on {sid}"
    # Nothing else: each backup holds exactly the live keys of the tablets it backs up.
    for sid in ids:
        mine = {k for k in expected if sid in tablet_of(st, 0, key_slot(k.encode()))["backups"]}
        assert set(dumps[sid]) == mine, (sid, len(dumps[sid]), len(mine))


def test_acknowledgement_points_by_mode(tmp_path):
    hold = lambda i: {"RAMLOG_TEST_HOLD_SYNC": str(tmp_path / f"hold-sync-{i}")}
    # A backup is stopped here for seconds: not long enough to be declared dead.
    c = Cluster(tmp_path, env=hold, coordinator_args=["--dead-after-ms", "8000"])
    try:
        st = status(c)
        # A backup B, and a key whose tablet B backs up (mastered elsewhere).
        b_id = st["servers"][-1]["id"]
        b = c.servers[server_index(c, st, b_id)]
        key = next(
            f"ack:{i}" for i in range(10_000)
            if b_id in tablet_of(st, 0, key_slot(f"ack:{i}".encode()))["backups"]
        )
        master = c.servers[server_index(c, st, tablet_of(st, 0, key_slot(key.encode()))["master"])]
        # A table with one backup per tablet, for a tablet that B neither masters nor backs up.
        ramlog("table", "create", "iso", "--replicas", "1", "--coordinator", c.coordinator_addr)
        c.wait_ok()
        st = status(c)
        iso = next(t for t in st["tables"] if t["name"] == "iso")
        other_key = next(
            f"other:{i}" for i in range(10_000)
            if tablet_of(st, iso["id"], key_slot(f"other:{i}".encode()))["backups"] != [b_id]
            and tablet_of(st, iso["id"], key_slot(f"other:{i}".encode()))["master"] != b_id
        )
        other_master = c.servers[server_index(c, st, tablet_of(st, iso["id"], key_slot(other_key.encode()))["master"])]

        # sync: a stopped backup holds the reply back until it runs again.
        os.kill(b.proc.pid, signal.SIGSTOP)
        try:
            t, res = timed_set(master.resp, key, "sync-1")
            t.join(1.5)
            assert t.is_alive() and not res, f"a sync write was answered while its backup was stopped: {res}"
            # A tablet the stopped server does not back up is not delayed, nor are reads.
            t0 = time.monotonic()
            out = subprocess.run(
                [ramlog_bin(), "set", "-p", str(other_master.native), "--table", str(iso["id"]), other_key, "free"],
                capture_output=True, text=True, timeout=20,
            )
            assert out.returncode == 0, out.stderr
            assert time.monotonic() - t0 < 1.5, "a write to a tablet the stopped server does not back up waited"
            t0 = time.monotonic()
            out = subprocess.run(
                [ramlog_bin(), "get", "-p", str(other_master.native), "--table", str(iso["id"]), other_key],
                capture_output=True, text=True, timeout=20,
            )
            assert out.returncode == 0 and "free" in out.stdout, (out.stdout, out.stderr)
            assert time.monotonic() - t0 < 1.5, "a read of a tablet the stopped server does not back up waited"
            # A read of the key waits too: its answer must not show a write that the stopped
            # backup does not hold (the master could die with it: a dirty read).
            reader = redis.Redis(port=master.resp, socket_timeout=1, retry=Retry(NoBackoff(), 0))
            with pytest.raises(redis.exceptions.TimeoutError):
                reader.get(key)
            t2, got = timed_get(master.resp, key)
            t2.join(1.0)
            assert t2.is_alive() and not got, f"a read showed a write its backup does not hold: {got}"
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        t.join(10)
        assert "done" in res, res
        t2.join(10)
        assert got.get("value") == b"sync-1", got
        # The master reported the backup that kept it waiting past backup_timeout_ms (1 s).
        assert wait_until(
            lambda: "a server reports a suspect peer" in (tmp_path / "coordinator-1.log").read_text(),
            timeout=10,
        ), (tmp_path / "coordinator-1.log").read_text()[-2000:]

        # async: answered at once even with the backup stopped.
        set_mode(c, "async")
        os.kill(b.proc.pid, signal.SIGSTOP)
        try:
            t, res = timed_set(master.resp, key, "async-1")
            t.join(5)
            assert "done" in res and res["done"] < 1.0, res
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)

        # durable: a backup whose disk sync is held back delays the reply; sync is not delayed.
        hold_file = tmp_path / f"hold-sync-{c.servers.index(b)}"
        hold_file.touch()
        try:
            set_mode(c, "sync")
            t, res = timed_set(master.resp, key, "sync-2")
            t.join(5)
            assert "done" in res and res["done"] < 1.0, f"sync waited for a held-back disk sync: {res}"
            set_mode(c, "durable")
            t, res = timed_set(master.resp, key, "durable-1")
            t.join(1.5)
            assert t.is_alive() and not res, f"a durable write was answered before its backup synced: {res}"
        finally:
            hold_file.unlink()
        t.join(10)
        assert "done" in res, res
        info = redis.Redis(port=master.resp, socket_timeout=10).info("replication")
        assert info["ramlog_ack_durable"]["acknowledged"] >= 1, info
        assert c.alive()
    finally:
        c.stop()


def test_durable_writes_survive_kill_9_of_every_server(tmp_path):
    c = Cluster(tmp_path)
    try:
        set_mode(c, "durable")
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
        expected = {}
        for i in range(600):
            assert rc.set(f"d:{i}", f"v{i}")
            expected[f"d:{i}"] = f"v{i}"
        for i in range(0, 600, 3):
            assert rc.delete(f"d:{i}") == 1
            expected.pop(f"d:{i}")
        # Many clients' writes at once: they share the backups' syncs.
        pipe = rc.pipeline()
        for i in range(600, 1600):
            pipe.set(f"d:{i}", f"p{i}")
            expected[f"d:{i}"] = f"p{i}"
        assert all(pipe.execute())
        st = status(c)
        syncs = sum(
            redis.Redis(port=s.resp).info("replication")["ramlog_backup_side"]["frames"] for s in c.servers
        )
        assert syncs > 0
        # /metrics breaks the backup stores' work down: durable writes made them flush and sync.
        store = {}
        for s in c.servers:
            with urllib.request.urlopen(f"http://127.0.0.1:{s.admin}/metrics", timeout=5) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("ramlog_backup_store_") or line.startswith("ramlog_backup_syncs_requested"):
                        name, value = line.split()
                        store[name] = store.get(name, 0) + float(value)
        assert store["ramlog_backup_syncs_requested_total"] > 0, store
        assert store["ramlog_backup_store_flushes_total"] > 0, store
        assert store["ramlog_backup_store_files_synced_total"] > 0, store
        for part in ("process", "write", "sync"):
            assert f"ramlog_backup_store_{part}_ms_total" in store, store
        for s in c.servers:
            s.proc.kill()  # kill -9: nothing flushed at exit
        for s in c.servers:
            s.proc.wait(timeout=10)
    finally:
        c.stop()
    dumps = {s["id"]: dump(c.servers[server_index(c, st, s["id"])].data_dir) for s in st["servers"]}
    for key, value in expected.items():
        t = tablet_of(st, 0, key_slot(key.encode()))
        for b in t["backups"]:
            assert dumps[b].get(key, (None,))[0] == value, (key, b, dumps[b].get(key))
    for i in range(0, 600, 3):
        for d in dumps.values():
            assert f"d:{i}" not in d


def test_multi_put_is_replicated_whole_through_a_master_crash(tmp_path):
    c = Cluster(tmp_path)
    try:
        st = status(c)
        victim_id = st["servers"][0]["id"]
        victim = c.servers[server_index(c, st, victim_id)]
        tags = [
            t for t in (f"t{i}" for i in range(10_000))
            if tablet_of(st, 0, key_slot(t.encode()))["master"] == victim_id
        ][:3]
        acked = {tag: 0 for tag in tags}
        stop = threading.Event()

        def writer(tag):
            r = redis.Redis(port=victim.resp, socket_timeout=5)
            i = 0
            while not stop.is_set():
                i += 1
                mapping = {f"{{{tag}}}f{j}": f"{i}" for j in range(10)}
                try:
                    r.mset(mapping)
                except Exception:  # noqa: BLE001 - the master was killed
                    return
                acked[tag] = i

        threads = [threading.Thread(target=writer, args=(tag,), daemon=True) for tag in tags]
        for t in threads:
            t.start()
        assert wait_until(lambda: all(v > 200 for v in acked.values()), timeout=30), acked
        victim.proc.kill()  # kill -9 in the middle of the stream
        victim.proc.wait(timeout=10)
        stop.set()
        for t in threads:
            t.join(10)
        # The backups restore the tablets (one of them becomes the master): each multi-put is
        # there whole, at least up to the last one acknowledged.
        assert wait_until(lambda: status(c)["recovering_tablets"] == 0, timeout=30)
        other = next(s for s in c.servers if s is not victim)
        rc = RedisCluster(host="127.0.0.1", port=other.resp, socket_timeout=10)
        for tag in tags:
            values = set(rc.mget([f"{{{tag}}}f{j}" for j in range(10)]))
            assert len(values) == 1, f"a multi-put was split: {values}"
            (value,) = values
            assert value is not None and int(value) >= acked[tag], (tag, value, acked[tag])
    finally:
        c.stop()


# ---- fencing and bad frames, spoken to a backup directly ---------------------------------------

def _crc32c_table():
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def frame(opcode, body, request_id=0, flags=0):
    return struct.pack("<IQBBH", 12 + len(body), request_id, opcode, flags, 0) + body


def unit(table, first, last, epoch, key: bytes, value: bytes, version):
    entry = struct.pack("<BIIQQ", 0, len(key), len(value), version, 0) + key + value
    body = struct.pack("<IHHQI", table, first, last, epoch, 1) + entry
    return struct.pack("<I", len(body)) + body


def batch(start, units: bytes, corrupt=False):
    rest = struct.pack("<QB", start, 0) + units
    crc = crc32c(rest) ^ (1 if corrupt else 0)
    return frame(0x32, struct.pack("<I", crc) + rest)


def read_frame(sock):
    head = b""
    while len(head) < 16:
        chunk = sock.recv(16 - len(head))
        if not chunk:
            return None
        head += chunk
    length, _rid, opcode, status_byte, _ = struct.unpack("<IQBBH", head)
    body = b""
    while len(body) < length - 12:
        chunk = sock.recv(length - 12 - len(body))
        if not chunk:
            break
        body += chunk
    return opcode, status_byte, body


def open_stream(port, cluster_id, master, epoch, map_version):
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"RLOG" + struct.pack("<HH", 1, 0))
    hello = b""
    while len(hello) < 24:
        hello += s.recv(24 - len(hello))
    s.sendall(frame(0x31, struct.pack("<QQQQQ", cluster_id, master, epoch, map_version, 7), request_id=1))
    reply = read_frame(s)
    assert reply is not None and reply[1] == 0, reply
    return s


def test_backups_fence_stale_epochs_and_refuse_bad_frames(tmp_path):
    # A backup that fences the master's stream acknowledges nothing of it: the coordinator, whose
    # map still names that master, would cut the backup off from its tablets after a second
    # (docs/operations.md) and its logs of them with it; this test keeps them to read them.
    c = Cluster(tmp_path, coordinator_args=["--cut-off-after-ms", "0"])
    try:
        st = status(c)
        cluster_id = int(st["cluster_id"], 16)
        key = "fenced-key"
        t = tablet_of(st, 0, key_slot(key.encode()))
        master_id, backup_id = t["master"], t["backups"][0]
        backup = c.servers[server_index(c, st, backup_id)]
        master = c.servers[server_index(c, st, master_id)]
        assert redis.Redis(port=master.resp, socket_timeout=5).set(key, "before")
        new = t["epoch"] + 1

        # A newer owner (epoch + 1) writes to the tablet's log on the backup: accepted.
        s = open_stream(backup.native, cluster_id, master_id, 1000, st["map_version"])
        u1 = unit(0, t["first_slot"], t["last_slot"], new, key.encode(), b"new-owner", 1 << 40)
        s.sendall(batch(0, u1))
        op, status_byte, body = read_frame(s)
        assert (op, status_byte) == (0x33, 0), (op, status_byte, body)
        buffered, _durable = struct.unpack("<QQ", body)
        assert buffered == len(u1)
        # The old epoch is refused from now on, with Fenced, and the connection closed.
        u2 = unit(0, t["first_slot"], t["last_slot"], t["epoch"], key.encode(), b"zombie", (1 << 40) + 1)
        s.sendall(batch(len(u1), u2))
        op, status_byte, body = read_frame(s)
        assert status_byte == 0x18, (op, status_byte, body)
        assert b"stale epoch" in body
        assert read_frame(s) is None
        s.close()

        # The real master, still at the old epoch, is fenced too: its write to that tablet is
        # never acknowledged.
        z = socket.create_connection(("127.0.0.1", master.resp), timeout=2)
        z.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$12\r\nzombie-write\r\n" % (len(key), key.encode()))
        with pytest.raises(socket.timeout):
            z.recv(100)
        z.close()
        assert wait_until(
            lambda: redis.Redis(port=backup.resp).info("replication")["ramlog_backup_side"]["refused_fenced"] >= 2,
            timeout=10,
        )

        # A corrupt frame and an unknown tablet are refused with their own errors.
        s = open_stream(backup.native, cluster_id, master_id, 1001, st["map_version"])
        s.sendall(batch(0, unit(0, t["first_slot"], t["last_slot"], new, b"x", b"y", 5), corrupt=True))
        op, status_byte, body = read_frame(s)
        assert status_byte == 0x10 and b"checksum" in body, (status_byte, body)
        s.close()
        s = open_stream(backup.native, cluster_id, master_id, 1002, st["map_version"])
        s.sendall(batch(0, unit(0, t["first_slot"], t["first_slot"], new, b"x", b"y", 5)))
        op, status_byte, body = read_frame(s)
        if t["first_slot"] == t["last_slot"]:
            pytest.fail("test needs a tablet of more than one slot")
        assert status_byte == 0x09 and b"unknown tablet" in body, (status_byte, body)
        s.close()
        # A truncated frame followed by a close leaves everything acknowledged intact.
        s = open_stream(backup.native, cluster_id, master_id, 1003, st["map_version"])
        whole = batch(0, unit(0, t["first_slot"], t["last_slot"], new, b"torn", b"half", 6))
        s.sendall(whole[: len(whole) // 2])
        s.close()
        # Another cluster's master is refused at the hello.
        s = socket.create_connection(("127.0.0.1", backup.native), timeout=10)
        s.sendall(b"RLOG" + struct.pack("<HH", 1, 0))
        s.recv(24)
        s.sendall(frame(0x31, struct.pack("<QQQQQ", cluster_id ^ 1, master_id, 1, 1, 7), request_id=1))
        reply = read_frame(s)
        assert reply is not None and reply[1] == 0x18, reply
        s.close()
        assert c.alive()
    finally:
        c.stop()
    d = dump(backup.data_dir)
    assert d[key][0] == "new-owner", d.get(key)
    assert "torn" not in d and "x" not in d


def test_a_backup_whose_disk_fills_refuses_and_keeps_what_it_acknowledged(tmp_path):
    """One server's data directory lies on a small tmpfs (mounted here, as root; a failed mount
    fails the test). Its backup store fits at start (the 256 MiB primary log is preallocated);
    a ballast file then leaves little room, and the 8 MiB secondary-log segments of the tablets
    it backs up cannot be allocated: the store fails. The table is `durable`, so every reply
    claims a synced copy on every backup: writes to those tablets are then not acknowledged. The
    server whose store failed stops with an error naming the failure (fail-stop), is declared dead
    and replaced: writes to those tablets are acknowledged again. Every write acknowledged before
    replays intact from the failed store (and every acknowledged write from the other backup).
    (Under `sync` a backup's buffered copy can be lost with its store; the master keeps those
    bytes until the backup says they are durable.)"""
    from test_disk_full import free_bytes, tmpfs

    full_dir = tmp_path / "server-2"
    with tmpfs(full_dir, 640):
        c = Cluster(tmp_path)
        acked = {}
        try:
            set_mode(c, "durable")
            st = status(c)
            full = c.servers[2]
            assert full.data_dir == full_dir
            full_id = next(s["id"] for s in st["servers"] if int(s["addresses"]["resp"].rsplit(":", 1)[1]) == full.resp)
            ballast = full_dir / "ballast"
            with open(ballast, "wb") as f:
                f.write(b"\0" * max(0, free_bytes(full_dir) - (20 << 20)))
            keys = [
                f"df:{i}" for i in range(200_000)
                if full_id in tablet_of(st, 0, key_slot(f"df:{i}".encode()))["backups"]
            ]
            clients = {}
            failed_key = None
            deadline = time.monotonic() + 60
            value = "x" * 1000
            # Writes until one is not acknowledged or the full server stops (whichever shows first).
            for key in keys:
                if full.proc.poll() is not None:
                    break
                master = c.servers[server_index(c, st, tablet_of(st, 0, key_slot(key.encode()))["master"])]
                r = clients.setdefault(master.resp, redis.Redis(port=master.resp, socket_timeout=3, retry=Retry(NoBackoff(), 0)))
                try:
                    assert r.set(key, f"{key}={value}")
                except redis.exceptions.RedisError:
                    failed_key = key
                    break
                acked[key] = f"{key}={value}"
                assert time.monotonic() < deadline, "the backup's disk never filled"
            assert full.proc.wait(timeout=10) != 0, "the server whose store failed did not stop with an error"
            failed_key = failed_key or next(k for k in keys if k not in acked)
            log = (tmp_path / "server-2.log").read_text()
            assert "disk full while writing" in log and "the backup store failed: stopping" in log, log[-3000:]
            acked_before = dict(acked)

            def write_again():
                try:
                    return clients_for(failed_key).set(failed_key, f"{failed_key}={value}")
                except redis.exceptions.RedisError:
                    return False

            def clients_for(key):
                m = c.servers[server_index(c, status(c), tablet_of(status(c), 0, key_slot(key.encode()))["master"])]
                return redis.Redis(port=m.resp, socket_timeout=3, retry=Retry(NoBackoff(), 0))

            assert wait_until(write_again, timeout=30), "writes were not acknowledged again after the server stopped"
            acked[failed_key] = f"{failed_key}={value}"
            assert all(p.poll() is None for s in c.servers if s is not full for p in [s.proc])
        finally:
            c.stop()
        ballast.unlink()
        d = dump(full_dir)
        assert failed_key not in d or d[failed_key][0] == f"{failed_key}={value}"
        # Writes acknowledged after the full server left the backup set (it was declared dead
        # while it stopped) are not on it; every earlier one is: the failed store kept what it
        # took, so what it lacks is a tail of the writes, in the order they were acknowledged.
        present = [d.get(k, (None,))[0] == v for k, v in acked_before.items()]
        last = max((i for i, p in enumerate(present) if p), default=-1)
        missing = [k for (k, _), p in list(zip(acked_before.items(), present))[:last + 1] if not p]
        assert last >= 0 and not missing, f"{len(missing)} acknowledged writes missing on the full backup: {missing[:5]}"
    others = {}
    for k, v in acked.items():
        other = next(b for b in tablet_of(st, 0, key_slot(k.encode()))["backups"] if b != full_id)
        if other not in others:
            others[other] = dump(c.servers[server_index(c, st, other)].data_dir)
        assert others[other].get(k, (None,))[0] == v, (k, other)


def test_a_stopped_backup_bounds_what_async_writes_hold_in_flight(tmp_path):
    """Back-pressure: with `replication_in_flight_bytes = 1MiB`, async writes to the tablets of a
    stopped backup are answered at once until about 1 MiB is in flight to it, then wait; once the
    backup runs again they are answered, and the in-flight bytes drain."""
    config = tmp_path / "server.toml"
    config.write_text('replication_in_flight_bytes = "1MiB"\n')
    # The backup is stopped for seconds: not long enough to be declared dead.
    c = Cluster(tmp_path, extra_args=("--config", str(config)), coordinator_args=["--dead-after-ms", "8000"])
    try:
        set_mode(c, "async")
        st = status(c)
        b_id = st["servers"][-1]["id"]
        b = c.servers[server_index(c, st, b_id)]
        master_id = next(s["id"] for s in st["servers"] if s["id"] != b_id)
        master = c.servers[server_index(c, st, master_id)]
        keys = [
            f"bp:{i}" for i in range(100_000)
            if (lambda t: t["master"] == master_id and b_id in t["backups"])(tablet_of(st, 0, key_slot(f"bp:{i}".encode())))
        ][:400]
        value = "v" * 10_000
        os.kill(b.proc.pid, signal.SIGSTOP)
        try:
            r = redis.Redis(port=master.resp, socket_timeout=2, retry=Retry(NoBackoff(), 0))
            answered = 0
            blocked = None
            for key in keys:
                try:
                    r.set(key, value)
                    answered += 1
                except redis.exceptions.TimeoutError:
                    blocked = key
                    break
            assert blocked is not None, "async writes never waited for a stopped backup"
            # About 1 MiB of 10 KB values went out before the bound held them (socket buffers
            # take some of it off the stream's books first).
            assert 50 <= answered <= 300, answered
            info = redis.Redis(port=master.resp, socket_timeout=5).info("replication")
            line = next(v for k, v in info.items() if k.startswith("ramlog_backup") and v.get("id") == b_id)
            assert line["bytes_in_flight"] <= 4 << 20, line
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        r = redis.Redis(port=master.resp, socket_timeout=10)
        assert r.set("bp:after", "x")
        assert wait_until(
            lambda: next(
                v for k, v in redis.Redis(port=master.resp).info("replication").items()
                if k.startswith("ramlog_backup") and v.get("id") == b_id
            )["bytes_in_flight"] == 0,
            timeout=15,
        )
        assert c.alive()
    finally:
        c.stop()
