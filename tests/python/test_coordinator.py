"""The coordinator as real processes: `ramlog coordinator` members, the `ramlog table` and
`ramlog cluster` tools, and the frame protocol spoken directly (4-byte big-endian length + JSON,
serde's externally tagged enums), as a server speaks it to register.

Every process is started on ports picked here and stopped by its pid at the end; every wait is
bounded.
"""

import json
import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time

import pytest

from conftest import free_port, ramlog_bin


class Coordinator:
    """A running `ramlog coordinator` member."""

    def __init__(self, member_id, port, data_dir, members=None, extra=()):
        self.id = member_id
        self.extra = list(extra)
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.data_dir = data_dir
        self.members = members
        self.proc = None
        self.start()

    def start(self):
        args = [
            ramlog_bin(), "coordinator",
            "--id", str(self.id),
            "--listen", self.address,
            "--data-dir", str(self.data_dir),
        ]
        if self.members:
            args += ["--members", self.members]
        args += self.extra
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = read_line(self.proc, timeout=15)
        if not re.fullmatch(rf"ramlog coordinator ready id={self.id} listen={self.address} pid={self.proc.pid}\n", line):
            self.kill9()
            raise RuntimeError(f"coordinator {self.id} did not start: {line!r} {self.proc.stderr.read()!r}")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill9(self):
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self):
        if self.alive():
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill9()


def read_line(proc, timeout):
    """The process's first stdout line, or '' if none comes within `timeout` seconds."""
    out = []
    t = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else ""


@pytest.fixture
def coordinators():
    started = []
    yield started
    for c in started:
        c.stop()


# --- the frame protocol ---

def exchange(address, request, timeout=5.0):
    """Sends one request frame to `address` and returns the decoded answer."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        body = json.dumps(request).encode()
        s.sendall(struct.pack(">I", len(body)) + body)
        header = recv_exact(s, 4)
        (length,) = struct.unpack(">I", header)
        return json.loads(recv_exact(s, length))


def recv_exact(s, n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def call(addresses, request, want, timeout=10.0):
    """Asks the members until one answers with `want` (following NotLeader), within `timeout`."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        for address in addresses:
            try:
                answer = exchange(address, request)
            except OSError as e:
                last = f"{address}: {e}"
                continue
            if isinstance(answer, dict) and want in answer:
                return answer[want]
            last = answer
        time.sleep(0.1)
    raise AssertionError(f"no {want} answer within {timeout}s; last: {last!r}")


def register(addresses, port=7000, previous=None):
    request = {"Register": {
        "previous": previous,
        "addresses": {
            "resp": f"127.0.0.1:{port}",
            "routing": None,
            "native": f"127.0.0.1:{port + 1}",
            "admin": None,
        },
        "memory_bytes": 1 << 30,
    }}
    return call(addresses, request, "Registered")


def get_map(addresses, timeout=10.0):
    return call(addresses, "GetMap", "Map", timeout)


def status(address):
    return exchange(address, "Status")["Status"]


def tool(*args, coordinator, timeout=30):
    return subprocess.run(
        [ramlog_bin(), *args, "--coordinator", coordinator],
        capture_output=True, text=True, timeout=timeout,
    )


def table_names(m):
    return sorted(t["name"] for t in m["tables"])


# --- tests ---

def test_one_member_keeps_the_map_across_kill_9(tmp_path, coordinators):
    c = Coordinator(1, free_port(), tmp_path / "c1")
    coordinators.append(c)
    registered = register([c.address])
    assert registered["id"] == 1 and registered["epoch"] == 1
    assert "default" in table_names(registered["map"])

    out = tool("table", "create", "t1", "--mode", "durable", "--replicas", "0", coordinator=c.address)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"created table t1 id=1 mode=durable replicas=0 tablets=16 map_version=\d+\n", out.stdout), out.stdout
    listed = tool("table", "list", coordinator=c.address)
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[0] for line in listed.stdout.splitlines()] == ["default", "t1"]
    text = tool("cluster", "status", coordinator=c.address)
    assert text.returncode == 0, text.stderr
    assert "leader *" in text.stdout and "t1 id=1 mode=durable" in text.stdout
    assert "memory_used=?" in text.stdout  # the fake server has no admin port
    js = tool("cluster", "status", "--json", coordinator=c.address)
    assert js.returncode == 0, js.stderr
    parsed = json.loads(js.stdout)
    assert parsed["leader"] == 1
    assert [t["name"] for t in parsed["tables"]] == ["default", "t1"]
    assert parsed["servers"][0]["tablets_mastered"] == 16 + 16

    before = get_map([c.address])
    c.kill9()
    c.start()
    after = get_map([c.address])
    assert after == before


def test_three_members_survive_the_leaders_kill_9(tmp_path, coordinators):
    ports = [free_port() for _ in range(3)]
    members = ",".join(f"{i + 1}=127.0.0.1:{p}" for i, p in enumerate(ports))
    for i, p in enumerate(ports):
        # The registered "server" is this test speaking the protocol: not declared dead here.
        coordinators.append(Coordinator(i + 1, p, tmp_path / f"c{i + 1}", members,
                                         extra=["--dead-after-ms", "60000"]))
    addresses = [c.address for c in coordinators]
    everyone = ",".join(addresses)

    register(addresses)
    out = tool("table", "create", "t1", "--replicas", "0", coordinator=everyone)
    assert out.returncode == 0, out.stderr
    first = get_map(addresses)

    leader_id = status(addresses[0])["leader"]
    leader = coordinators[leader_id - 1]
    assert status(leader.address)["leader"] == leader_id
    leader.kill9()

    started = time.time()
    out = tool("table", "create", "t2", "--replicas", "0", coordinator=everyone, timeout=15)
    assert out.returncode == 0, out.stderr
    assert time.time() - started < 10
    survivors = [c.address for c in coordinators if c is not leader]
    second = get_map(survivors)
    assert second["version"] > first["version"]
    assert table_names(second) == ["default", "t1", "t2"]
    new_leader = status(survivors[0])["leader"]
    assert new_leader is not None and new_leader != leader_id

    leader.start()
    deadline = time.time() + 10
    caught_up = None
    while time.time() < deadline:
        try:
            caught_up = status(leader.address)
        except OSError:
            caught_up = None
        if caught_up and caught_up["map"] == second:
            break
        time.sleep(0.1)
    assert caught_up and caught_up["map"]["version"] == second["version"], caught_up


def test_bad_input_is_refused_and_changes_nothing(tmp_path, coordinators):
    c = Coordinator(1, free_port(), tmp_path / "c1")
    coordinators.append(c)
    register([c.address])
    out = tool("table", "create", "t1", coordinator=c.address)
    assert out.returncode == 0, out.stderr
    before = get_map([c.address])

    for garbage in [struct.pack(">I", 5) + b"{bad}", struct.pack(">I", 0xFFFFFFFF) + b"x" * 64]:
        with socket.create_connection(("127.0.0.1", c.port), timeout=5) as s:
            s.sendall(garbage)
            try:
                closed = s.recv(16) == b""
            except ConnectionResetError:  # closed with unread bytes pending
                closed = True
            assert closed, "the coordinator should close a connection that sends a bad frame"
    assert c.alive()

    for args, message in [
        (("table", "drop", "default"), "the default table cannot be dropped"),
        (("table", "create", "t1"), 'a table named "t1" exists'),
        (("table", "drop", "nope"), 'no table named "nope"'),
        (("table", "create", "bad name"), "bad table name"),
        (("table", "create", "t9", "--replicas", "3"), "need at least 4 live servers"),
    ]:
        out = tool(*args, coordinator=c.address)
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert message in out.stderr, (args, out.stderr)
        assert out.stderr.count("\n") == 1, out.stderr

    assert get_map([c.address]) == before
    assert c.alive()


def test_heartbeats_carry_newer_maps_and_guard_server_ids(tmp_path, coordinators):
    # The registered "servers" here are this test speaking the protocol, not processes: they are
    # not declared dead while the test looks at ids and epochs.
    c = Coordinator(1, free_port(), tmp_path / "c1", extra=["--dead-after-ms", "60000"])
    coordinators.append(c)
    first = register([c.address])
    sid, version, cluster_id = first["id"], first["map"]["version"], first["map"]["cluster_id"]

    def heartbeat(server, epoch, map_version):
        return exchange(c.address, {"Heartbeat": {"id": server, "epoch": epoch, "map_version": map_version}})

    assert heartbeat(sid, 1, version) == {"Heartbeat": {"map": None, "lease_ms": 45000}}
    newer = heartbeat(sid, 1, version - 1)["Heartbeat"]["map"]
    assert newer["version"] == version
    assert heartbeat(99, 1, 0) == {"Refused": {"UnknownServer": 99}}

    # A live process (heartbeat within 300 ms) owns its id: a second one may not take it over.
    previous = {"cluster_id": cluster_id, "server_id": sid}
    heartbeat(sid, 1, version)
    refused = exchange(c.address, {"Register": {
        "previous": previous,
        "addresses": {"resp": "127.0.0.1:7100", "routing": None, "native": "127.0.0.1:7101", "admin": None},
        "memory_bytes": 1,
    }})
    assert refused == {"Refused": {"DuplicateServer": {"id": sid, "address": "127.0.0.1:7000"}}}
    # Once its heartbeats stop, a restarted process takes the id with a new epoch, fencing the old.
    time.sleep(0.5)
    again = register([c.address], port=7100, previous=previous)
    assert (again["id"], again["epoch"]) == (sid, 2)
    fenced = heartbeat(sid, 1, 0)
    assert "Fenced" in fenced and "another process" in fenced["Fenced"]["reason"]
    assert heartbeat(sid, 2, again["map"]["version"]) == {"Heartbeat": {"map": None, "lease_ms": 45000}}
