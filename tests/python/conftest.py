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
