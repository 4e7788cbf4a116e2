"""Admin HTTP, INFO, and the `ramlog up` / `ramlog server` command lines (config file, env, flags)."""

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from conftest import free_port, ramlog_bin, wait_until


def http_get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        return resp.status, resp.headers.get("Content-Type"), resp.read().decode()


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def test_metrics_status_and_info_agree(server):
    c = server.client()
    for i in range(100):
        c.set(f"k{i}", "v")
    for i in range(50):
        c.get(f"k{i}")
    c.get("missing")
    status, ctype, text = http_get(server.admin_port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    assert metric(text, 'ramlog_commands_total{op="set"}') == 100
    assert metric(text, 'ramlog_commands_total{op="get"}') == 51
    assert metric(text, 'ramlog_command_duration_seconds_count{op="set"}') == 100
    assert metric(text, 'ramlog_command_duration_seconds_bucket{op="get",le="+Inf"}') == 51
    assert metric(text, "ramlog_objects") == 100
    assert metric(text, "ramlog_keyspace_hits_total") == 50
    assert metric(text, "ramlog_keyspace_misses_total") == 1
    assert metric(text, "ramlog_connections") >= 1
    assert metric(text, "ramlog_memory_bytes_total") == 256 * 1024 * 1024
    for name in ["ramlog_memory_utilisation", "ramlog_cleaner_bytes_copied_total", "ramlog_cleaner_bytes_freed_total"]:
        metric(text, name)
    info = c.info("all")
    assert info["db0"]["keys"] == 100
    assert info["keyspace_hits"] == 50 and info["keyspace_misses"] == 1
    assert info["cmdstat_set"]["calls"] == 100
    assert info["maxmemory"] == 256 * 1024 * 1024
    status, ctype, body = http_get(server.admin_port, "/status")
    assert ctype == "application/json"
    doc = json.loads(body)
    assert doc["status"] == "ok"
    assert doc["metrics"]["engine"]["objects"] == 100
    assert doc["metrics"]["keyspace_hits"] == 50
    with pytest.raises(urllib.error.HTTPError) as e:
        http_get(server.admin_port, "/nope")
    assert e.value.code == 404


def start(args, env=None, cwd=None):
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.Popen(
        [ramlog_bin(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=cwd
    )


def test_up_starts_a_cluster_prints_how_to_connect_and_stops_on_ctrl_c(tmp_path):
    # Free ports for everything (bases of 0), three servers and one coordinator.
    proc = start(
        ["up", "--routing-port", "0", "--resp-port", "0", "--native-port", "0", "--admin-port", "0",
         "--coordinator-port", "0", "--memory", "64MiB"],
        cwd=tmp_path,
    )
    lines = []
    try:
        while len(lines) < 30:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C" in line:
                break
        text = "".join(lines)
        assert "3 servers and 1 coordinator" in text, text
        routing = int(re.search(r"connect:\s+redis-cli -p (\d+)", text).group(1))
        cluster = int(re.search(r"cluster:\s+redis-cli -c -p (\d+)", text).group(1))
        for d in ["coordinator-1", "server-0", "server-1", "server-2"]:
            assert (tmp_path / "ramlog-data" / d).is_dir(), d
        # Any key through the routing port, and through the cluster port with -c.
        for i in range(30):
            out = subprocess.run(["redis-cli", "-p", str(routing), "SET", f"k{i}", str(i)], capture_output=True, text=True)
            assert out.stdout.strip() == "OK", out
            out = subprocess.run(["redis-cli", "-c", "-p", str(cluster), "GET", f"k{i}"], capture_output=True, text=True)
            assert out.stdout.strip() == str(i), out
        info = subprocess.run(["redis-cli", "-p", str(cluster), "CLUSTER", "INFO"], capture_output=True, text=True)
        assert "cluster_state:ok" in info.stdout and "cluster_known_nodes:3" in info.stdout
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "stopped" in rest
        # Every child is gone: nothing listens on the ports any more.
        out = subprocess.run(["redis-cli", "-p", str(routing), "PING"], capture_output=True, text=True)
        assert "PONG" not in out.stdout
    finally:
        if proc.poll() is None:
            proc.kill()


def read_until(proc, marker: str, limit=40) -> str:
    lines = []
    while len(lines) < limit:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            break
    return "".join(lines)


def test_up_add_joins_a_server_that_takes_tablets_and_is_drained_on_ctrl_c(tmp_path):
    free = ["--routing-port", "0", "--resp-port", "0", "--native-port", "0", "--admin-port", "0",
            "--memory", "64MiB"]
    up = start(["up", "--coordinator-port", "0", *free], cwd=tmp_path)
    add = None
    try:
        text = read_until(up, "Ctrl-C")
        routing = int(re.search(r"connect:\s+redis-cli -p (\d+)", text).group(1))
        coordinator = re.search(r"coordinator: (\S+)", text).group(1)
        for i in range(200):
            out = subprocess.run(["redis-cli", "-p", str(routing), "SET", f"k{i}", str(i)], capture_output=True, text=True)
            assert out.stdout.strip() == "OK", out

        def status():
            out = subprocess.run([ramlog_bin(), "cluster", "status", "--json", "--coordinator", coordinator],
                                 capture_output=True, text=True, timeout=20)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        def masters_of(st, port):
            sid = next(s["id"] for s in st["servers"] if s["addresses"]["resp"].endswith(f":{port}"))
            table = next(t for t in st["tables"] if t["name"] == "default")
            return sid, [t for t in table["tablets"] if t["master"] == sid and t.get("migration") is None]

        add = start(["up", "--add", "1", *free], cwd=tmp_path)
        text = read_until(add, "Ctrl-C")
        assert "1 server added" in text, text
        assert (tmp_path / "ramlog-data" / "server-3").is_dir()
        cluster = int(re.search(r"server 3: routing \d+  cluster (\d+)", text).group(1))
        # It takes a fair share: a quarter of the 48 tablets, within the rebalancer's tolerance.
        # Once the rebalance is over, every read is answered by the new owners.
        assert wait_until(lambda: len(masters_of(status(), cluster)[1]) >= 8 and not status()["rebalancing"]
                          and status()["migrations"] == 0, timeout=90, interval=0.5), \
            json.dumps(status())[:3000]
        info = subprocess.run(["redis-cli", "-p", str(cluster), "CLUSTER", "INFO"], capture_output=True, text=True)
        assert "cluster_known_nodes:4" in info.stdout, info.stdout
        for i in range(200):
            out = subprocess.run(["redis-cli", "-c", "-p", str(cluster), "GET", f"k{i}"], capture_output=True, text=True)
            assert out.stdout.strip() == str(i), out
        # Ctrl-C drains it: its tablets move back, then it stops; nothing is lost.
        sid, _ = masters_of(status(), cluster)
        add.send_signal(signal.SIGINT)
        rest, err = add.communicate(timeout=120)
        assert add.returncode == 0, err
        assert "stopped" in rest, rest
        st = status()
        table = next(t for t in st["tables"] if t["name"] == "default")
        assert not [t for t in table["tablets"] if t["master"] == sid or sid in t["backups"]], table
        for i in range(200):
            out = subprocess.run(["redis-cli", "-p", str(routing), "GET", f"k{i}"], capture_output=True, text=True)
            assert out.stdout.strip() == str(i), out
        up.send_signal(signal.SIGINT)
        up.communicate(timeout=30)
        assert up.returncode == 0
    finally:
        for p in (add, up):
            if p is not None and p.poll() is None:
                p.kill()


def wait_ready(proc):
    line = proc.stdout.readline()
    assert "ready" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return line


def test_config_precedence_file_env_flag(tmp_path):
    file_port, env_port, flag_port = free_port(), free_port(), free_port()
    config = tmp_path / "ramlog.toml"
    config.write_text(
        f'resp_port = {file_port}\nadmin_port = 0\nnative_port = 0\nmemory = "64MiB"\npassword = "frompass"\n'
        f'persistence = "off"\ndata_dir = "{tmp_path / "data"}"\n'
    )
    for extra_env, extra_args, expected in [
        ({}, [], file_port),
        ({"RAMLOG_RESP_PORT": str(env_port)}, [], env_port),
        ({"RAMLOG_RESP_PORT": str(env_port)}, ["--resp-port", str(flag_port)], flag_port),
    ]:
        proc = start(["server", "--config", str(config), *extra_args], env=extra_env)
        try:
            line = wait_ready(proc)
            assert f"resp=127.0.0.1:{expected}" in line
            out = subprocess.run(
                ["redis-cli", "-p", str(expected), "-a", "frompass", "--no-auth-warning", "PING"],
                capture_output=True, text=True,
            )
            assert out.stdout.strip() == "PONG"
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        assert proc.returncode == 0


def test_bad_config_is_a_clear_error(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("resp_prot = 1\n")
    out = subprocess.run([ramlog_bin(), "server", "--config", str(config)], capture_output=True, text=True, timeout=10)
    assert out.returncode != 0
    assert "resp_prot" in out.stderr
    out = subprocess.run([ramlog_bin(), "server", "--memory", "lots"], capture_output=True, text=True, timeout=10)
    assert out.returncode != 0
    assert "lots" in out.stderr


def test_port_in_use_is_reported(server):
    out = subprocess.run(
        [ramlog_bin(), "server", "--resp-port", str(server.port), "--admin-port", "0", "--native-port", "0",
         "--persistence", "off"],
        capture_output=True, text=True, timeout=10,
    )
    assert out.returncode != 0
    assert f"cannot listen on 127.0.0.1:{server.port}" in out.stderr


def test_native_port_listens_beside_resp(tmp_path):
    resp, native = free_port(), free_port()
    proc = start(
        ["server", "--resp-port", str(resp), "--native-port", str(native), "--admin-port", "0", "--memory", "64MiB"],
        cwd=tmp_path,
    )
    try:
        line = wait_ready(proc)
        assert f"native=127.0.0.1:{native}" in line
        import socket

        with socket.create_connection(("127.0.0.1", native), timeout=5):
            pass
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0


def thread_policies(pid):
    """Scheduling policy of each thread (field 41 of /proc/<pid>/task/<tid>/stat: 0 normal, 3 batch)."""
    policies = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            name = f.read().strip()
        # The command name may hold spaces: fields are counted after its closing parenthesis.
        fields = stat[stat.rindex(")") + 2:].split()
        policies[f"{name}/{tid}"] = int(fields[41 - 3])
    return policies


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_cpu_scheduling_applies_to_every_thread(tmp_path):
    for setting, expected in [(None, 3), ("normal", 0), ("batch", 3)]:
        config = tmp_path / f"sched-{setting}.toml"
        config.write_text(
            f'resp_port = {free_port()}\nadmin_port = 0\nnative_port = 0\nmemory = "64MiB"\n'
            f'persistence = "async"\ndata_dir = "{tmp_path / ("data-" + str(setting))}"\n'
            + (f'cpu_scheduling = "{setting}"\n' if setting else "")
        )
        proc = start(["server", "--config", str(config)])
        try:
            wait_ready(proc)
            policies = thread_policies(proc.pid)
            # Workers, the engine's cleaner and prefaulter, and the persistence threads.
            assert len(policies) >= 4, policies
            assert set(policies.values()) == {expected}, (setting, policies)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        assert proc.returncode == 0
