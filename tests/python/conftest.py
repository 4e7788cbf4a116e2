"""Fixtures that start the real `ramlog server` binary on free loopback ports.

RAMLOG_BIN names the binary (scripts/test sets it to target/release/ramlog).
"""

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

REPO = Path(__file__).resolve().parents[2]


def ramlog_bin() -> str:
    path = os.environ.get("RAMLOG_BIN") or str(REPO / "target" / "release" / "ramlog")
    if not Path(path).exists():
        pytest.fail(f"ramlog binary not found at {path}; build it or set RAMLOG_BIN")
    return path


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, never one this test run handed out before.

    The kernel may give back a port it just gave (the probe socket is closed at once), so two calls
    in a row could name the same port; remembering the ports handed out rules that out.
    """
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


class Server:
    """A running `ramlog server` child process."""

    def __init__(self, tmp_path: Path, extra_args=(), env=None):
        self.port = free_port()
        self.admin_port = free_port()
        self.data_dir = tmp_path / "data"
        args = [
            ramlog_bin(), "server",
            "--resp-port", str(self.port),
            "--admin-port", str(self.admin_port),
            "--native-port", "0",
            "--data-dir", str(self.data_dir),
            "--memory", "256MiB",
            *(() if "--persistence" in extra_args else ("--persistence", "off")),
            *extra_args,
        ]
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env)
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.proc.kill()
            out, err = self.proc.communicate(timeout=5)
            raise RuntimeError(f"server did not start: {line!r} {out!r} {err!r}")

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10, **kwargs)

    def cli(self, *args, stdin=None, extra=()):
        """Runs redis-cli against this server and returns its stdout (stripped of one trailing newline)."""
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), *extra, *args],
            input=stdin, capture_output=True, text=True, timeout=30,
        )
        return out.stdout.rstrip("\n")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path)
    yield s
    assert s.alive(), "the server died during the test"
    s.stop()


@pytest.fixture(params=["standalone", "routing"])
def server_both_ways(request, tmp_path):
    """A standalone server, then the routing port of a 3-server cluster (RESP tests run both ways)."""
    if request.param == "standalone":
        s = Server(tmp_path)
        yield s
        assert s.alive(), "the server died during the test"
        s.stop()
    else:
        cluster = request.getfixturevalue("shared_cluster")
        port = RoutingPort(cluster)
        port.client().flushall()
        yield port
        assert port.alive(), "a cluster process died during the test"


@pytest.fixture
def make_server(tmp_path):
    started = []

    def make(*extra_args, env=None):
        s = Server(tmp_path / f"s{len(started)}", extra_args, env)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture(params=[2, 3], ids=["resp2", "resp3"])
def r(server, request):
    client = server.client(protocol=request.param, decode_responses=True)
    yield client
    client.close()


def wait_until(predicate, timeout=10.0, interval=0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


class Cluster:
    """A coordinator and `servers` ramlog servers, each a child process on ports picked here.

    Every process is stopped by its pid in `stop()`; every wait is bounded.
    """

    def __init__(self, tmp_path: Path, servers=3, extra_args=(), initial_servers=None, env=None,
                 coordinator_args=(), net=None, coordinators=1):
        """`net`, when given, places each process on a host of its own (see `test_partition.py`):
        `net.coordinator` and `net.server(i)` are hosts with an `ip` and an `exec` prefix.
        `coordinators` members form the coordinator group (on loopback)."""
        self.tmp_path = tmp_path
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.net = net
        assert net is None or coordinators == 1
        self.coordinator_host = net.coordinator if net else None
        host = net.coordinator.ip if net else "127.0.0.1"
        self.coord_ports = [free_port() for _ in range(coordinators)]
        self.coord_port = self.coord_ports[0]
        self.coordinator_addrs = [f"{host}:{p}" for p in self.coord_ports]
        self.coordinator_addr = ",".join(self.coordinator_addrs)
        members = ",".join(f"{m + 1}={a}" for m, a in enumerate(self.coordinator_addrs))
        self.procs = []
        self.coordinator_cmds = [
            [
                "coordinator", "--id", str(m + 1), "--listen", self.coordinator_addrs[m],
                "--members", members,
                "--data-dir", str(tmp_path / f"coordinator-{m + 1}"),
                "--initial-servers", str(initial_servers or servers),
                *coordinator_args,
            ]
            for m in range(coordinators)
        ]
        self.coordinator_cmd = self.coordinator_cmds[0]
        self.coordinators = [
            self._spawn(cmd, f"coordinator {m + 1}", host=self.coordinator_host)
            for m, cmd in enumerate(self.coordinator_cmds)
        ]
        self.coordinator = self.coordinators[0]
        self.servers = []
        for i in range(servers):
            self.add_server(extra_args, env=env)
        self.wait_ok()

    def restart_coordinator(self, m=0):
        """Starts coordinator member `m` again on its port and data directory (after it was killed)."""
        self.coordinators[m] = self._spawn(self.coordinator_cmds[m], f"coordinator {m + 1}",
                                           host=self.coordinator_host)
        if m == 0:
            self.coordinator = self.coordinators[0]

    def restart_server(self, i, env=None):
        """Starts server `i` again with its data directory (it rejoins under its id), on its ports."""
        s = self.servers[i]
        s.proc = self._spawn(s.cmd, f"server {i}", env=env(i) if callable(env) else env, host=s.host)
        return s

    def _spawn(self, args, name, env=None, host=None):
        # Logs go to a file: a pipe nobody reads would stop a process that logs enough.
        log = open(self.tmp_path / f"{name.replace(' ', '-')}.log", "a")
        proc = subprocess.Popen(
            [*(host.exec if host else ()), ramlog_bin(), *args], stdout=subprocess.PIPE, stderr=log, text=True,
            env=None if env is None else {**os.environ, **env},
        )
        log.close()
        line = proc.stdout.readline()
        if "ready" not in line:
            proc.kill()
            out, _ = proc.communicate(timeout=5)
            err = (self.tmp_path / f"{name.replace(' ', '-')}.log").read_text()[-4000:]
            raise RuntimeError(f"{name} did not start: {line!r} {out!r} {err!r}")
        self.procs.append(proc)
        return proc

    def add_server(self, extra_args=(), env=None):
        i = len(self.servers)
        s = type("ClusterServer", (), {})()
        s.resp, s.routing, s.native, s.admin = free_port(), free_port(), free_port(), free_port()
        s.host = self.net.server(i) if self.net else None
        s.ip = s.host.ip if s.host else "127.0.0.1"
        s.data_dir = self.tmp_path / f"server-{i}"
        s.cmd = [
            "server", "--coordinator", self.coordinator_addr,
            "--resp-port", str(s.resp), "--routing-port", str(s.routing),
            "--native-port", str(s.native), "--admin-port", str(s.admin),
            "--data-dir", str(self.tmp_path / f"server-{i}"),
            *(() if "--memory" in extra_args else ("--memory", "256MiB")),
            *(("--bind", s.ip) if s.host else ()),
            *extra_args,
        ]
        s.proc = self._spawn(s.cmd, f"server {i}", env=env(i) if callable(env) else env, host=s.host)
        self.servers.append(s)
        return s

    def cluster_info(self, port):
        ip = next((s.ip for s in self.servers if s.resp == port), "127.0.0.1")
        out = subprocess.run(["redis-cli", "-h", ip, "-p", str(port), "CLUSTER", "INFO"], capture_output=True, text=True, timeout=10)
        return out.stdout

    def wait_ok(self, timeout=20.0):
        ok = wait_until(
            lambda: all("cluster_state:ok" in self.cluster_info(s.resp) for s in self.servers),
            timeout=timeout,
        )
        assert ok, [self.cluster_info(s.resp) for s in self.servers]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class RoutingPort:
    """The routing port of a cluster's first server, with the interface of `Server` above, so that
    the RESP tests run unchanged against a cluster."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.port = cluster.servers[0].routing
        self.admin_port = cluster.servers[0].admin

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10, **kwargs)

    def cli(self, *args, stdin=None, extra=()):
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), *extra, *args],
            input=stdin, capture_output=True, text=True, timeout=30,
        )
        return out.stdout.rstrip("\n")

    def alive(self) -> bool:
        return self.cluster.alive()

    def stop(self):
        pass


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    alive = c.alive()
    c.stop()
    assert alive, "a cluster process died during the tests"
