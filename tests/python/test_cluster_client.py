"""The `ramlog get/set/del/scan` verbs against a 3-server cluster: whichever server's native port the
CLI is given, its cluster map routes every key to the key's master."""

import subprocess
import pytest

from conftest import Cluster, ramlog_bin

CLI_TIMEOUT = 30


@pytest.fixture
def native_cluster(tmp_path):
    cluster = Cluster(tmp_path)
    yield cluster
    alive = cluster.alive()
    cluster.stop()
    assert alive, "a cluster process died during the test"


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
    natives = [s.native for s in native_cluster.servers]
    keys = [f"k{i}" for i in range(200)]

    # Every write goes through server 0's native port.
    for k in keys:
        out = ramlog("set", k, f"{k}-value", port=natives[0])
        assert out.stdout.startswith("OK version "), out.stdout

    # Each key was stored on its master: every server holds some, none holds them all.
    sizes = [dbsize(s.resp) for s in native_cluster.servers]
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

    # A filtered scan covers every tablet, each on its master (tests/python/test_cluster_scan.py
    # checks predicates and aggregates).
    filtered = ramlog("scan", "--prefix", "k1", "--keys-only", port=natives[1]).stdout.split()
    assert sorted(filtered) == sorted(k for k in keys if k.startswith("k1")), filtered

    # Deletes (many keys, of every server, in one call) through server 2.
    assert ramlog("del", *keys[:100], port=natives[2]).stdout == "100\n"
    for k in keys[100:]:
        assert ramlog("del", k, port=natives[1]).stdout == "1\n"
    assert ramlog("del", keys[0], port=natives[0]).stdout == "0\n"
    for port in natives:
        assert ramlog("scan", "--match", "k*", port=port).stdout == ""
    gone = ramlog("get", keys[5], port=natives[0], check=False)
    assert gone.returncode == 1
    assert [dbsize(s.resp) for s in native_cluster.servers] == [0, 0, 0]


def test_table_created_with_a_schema_reaches_every_server(native_cluster):
    c = native_cluster
    out = subprocess.run(
        [ramlog_bin(), "table", "create", "people", "--mode", "durable", "--schema", "age:i64,name:string",
         "--coordinator", c.coordinator_addr],
        capture_output=True, text=True, timeout=CLI_TIMEOUT,
    )
    assert out.returncode == 0, out.stderr
    table_id = int(out.stdout.split("id=")[1].split()[0])
    # Each server applies the map (with the schema) within a heartbeat or two.
    from conftest import wait_until

    def schema_everywhere():
        for s in c.servers:
            got = subprocess.run(
                [ramlog_bin(), "schema", "get", str(table_id), "-p", str(s.native)],
                capture_output=True, text=True, timeout=CLI_TIMEOUT,
            )
            if got.stdout.strip() != "age:i64,name:string":
                return False
        return True

    assert wait_until(schema_everywhere, timeout=10), "the schema did not reach every server"
    bad = subprocess.run(
        [ramlog_bin(), "table", "create", "broken", "--schema", "age:decimal", "--coordinator", c.coordinator_addr],
        capture_output=True, text=True, timeout=CLI_TIMEOUT,
    )
    assert bad.returncode != 0 and "unknown type" in bad.stderr, bad.stderr
