"""The `ramlog get/set/del/scan` verbs against a 3-server cluster: whichever server's native port the
CLI is given, its cluster map routes every key to the key's master."""

import subprocess
import threading
import time

import pytest

from conftest import free_port, ramlog_bin

STARTUP_TIMEOUT = 15.0
CLI_TIMEOUT = 30


def read_line(proc, timeout):
    """The first stdout line of `proc`, or '' if none arrives within `timeout` seconds."""
    line = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return line[0] if line else ""


class NativeCluster:
    """A coordinator and 3 servers, each a child process; every wait is bounded and every process is
    stopped by its pid in `stop()`."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.procs = []
        self.servers = []

    def start(self):
        self.coordinator_port = free_port()
        coordinator = f"127.0.0.1:{self.coordinator_port}"
        self._spawn(
            "coordinator",
            [
                "coordinator", "--id", "1", "--listen", coordinator,
                "--members", f"1={coordinator}",
                "--data-dir", str(tmp_path / "coordinator"),
                "--initial-servers", "3",
            ],
            "ramlog coordinator ready",
        )
        for i in range(3):
            ports = {name: free_port() for name in ("resp", "routing", "native")}
            self._spawn(
                f"server-{i}",
                [
                    "server", "--coordinator", coordinator,
                    "--resp-port", str(ports["resp"]),
                    "--routing-port", str(ports["routing"]),
                    "--native-port", str(ports["native"]),
                    "--admin-port", "0",
                    "--data-dir", str(tmp_path / f"server-{i}"),
                    "--memory", "256MiB",
                ],
                "ready",
            )
            self.servers.append(ports)

    def _spawn(self, name, args, ready):
        stderr = open(self.tmp_path / f"{name}.stderr", "w")
        proc = subprocess.Popen([ramlog_bin(), *args], stdout=subprocess.PIPE, stderr=stderr, text=True)
        stderr.close()
        self.procs.append((name, proc))
        line = read_line(proc, STARTUP_TIMEOUT)
        if ready not in line:
            raise RuntimeError(f"{name} did not start: {line!r}; stderr: {self.stderr(name)!r}")

    def stderr(self, name):
        try:
            return (self.tmp_path / f"{name}.stderr").read_text()[-4000:]
        except OSError:
            return ""

    def cluster_info(self, resp_port):
        try:
            out = subprocess.run(
                ["redis-cli", "-p", str(resp_port), "CLUSTER", "INFO"],
                capture_output=True, text=True, timeout=5,
            )
        except subprocess.TimeoutExpired:
            return ""
        return out.stdout

    def wait_ok(self, timeout=STARTUP_TIMEOUT):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if all("cluster_state:ok" in self.cluster_info(s["resp"]) for s in self.servers):
                return
            time.sleep(0.1)
        infos = [self.cluster_info(s["resp"]) for s in self.servers]
        logs = {name: self.stderr(name) for name, _ in self.procs}
        pytest.fail(f"the cluster is not ok after {timeout} s: {infos!r}; stderr: {logs!r}")

    def dead(self):
        return [name for name, proc in self.procs if proc.poll() is not None]

    def stop(self):
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            if proc.stdout:
                proc.stdout.close()


@pytest.fixture
def native_cluster(tmp_path):
    cluster = NativeCluster(tmp_path)
    try:
        cluster.start()
        cluster.wait_ok()
        yield cluster
        assert not cluster.dead(), f"cluster processes died during the test: {cluster.dead()}"
    finally:
        # Also the processes started before a later one failed to start.
        cluster.stop()


def ramlog(*args, port, check=True):
    out = subprocess.run(
        [ramlog_bin(), *args, "-p", str(port), "--timeout-ms", "5000"],
        capture_output=True, text=True, timeout=CLI_TIMEOUT,
    )
    if check:
        assert out.returncode == 0, f"ramlog {' '.join(args)} -p {port}: exit {out.returncode}: {out.stderr}"
    return out


def dbsize(resp_port):
    out = subprocess.run(
        ["redis-cli", "-p", str(resp_port), "DBSIZE"], capture_output=True, text=True, timeout=10
    )
    return int(out.stdout.strip())


def test_cli_verbs_route_through_any_server(native_cluster):
    natives = [s["native"] for s in native_cluster.servers]
    keys = [f"k{i}" for i in range(200)]

    # Every write goes through server 0's native port.
    for k in keys:
        out = ramlog("set", k, f"{k}-value", port=natives[0])
        assert out.stdout.startswith("OK version "), out.stdout

    # Each key was stored on its master: every server holds some, none holds them all.
    sizes = [dbsize(s["resp"]) for s in native_cluster.servers]
    assert sum(sizes) == len(keys), sizes
    assert all(0 < n < len(keys) for n in sizes), sizes

    # Reads through the other two servers.
    for port in natives[1:]:
        for k in keys:
            assert ramlog("get", k, port=port).stdout == f"{k}-value\n"
    missing = ramlog("get", "k-missing", port=natives[2], check=False)
    assert missing.returncode == 1 and "(nil)" in missing.stderr

    # The listing from any server names every key once.
    for port in natives:
        listed = ramlog("scan", "--match", "k*", port=port).stdout.split()
        assert sorted(listed) == sorted(keys), (port, len(listed))

    # Filtered scans of a cluster say so.
    filtered = ramlog("scan", "--prefix", "k1", port=natives[1], check=False)
    assert filtered.returncode != 0
    assert "filtered scans of a cluster table are not supported yet" in filtered.stderr

    # Deletes (many keys, of every server, in one call) through server 2.
    assert ramlog("del", *keys[:100], port=natives[2]).stdout == "100\n"
    for k in keys[100:]:
        assert ramlog("del", k, port=natives[1]).stdout == "1\n"
    assert ramlog("del", keys[0], port=natives[0]).stdout == "0\n"
    for port in natives:
        assert ramlog("scan", "--match", "k*", port=port).stdout == ""
    gone = ramlog("get", keys[5], port=natives[0], check=False)
    assert gone.returncode == 1
    assert [dbsize(s["resp"]) for s in native_cluster.servers] == [0, 0, 0]
