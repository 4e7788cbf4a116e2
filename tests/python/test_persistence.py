"""Single-server persistence: a restart (clean or kill -9) replays the data directory."""

import time

import pytest
import redis

from conftest import Server


def fill(c, n):
    p = c.pipeline(transaction=False)
    for i in range(n):
        p.set(f"k{i}", f"v{i}")
    p.execute()


@pytest.mark.parametrize("mode", ["async", "durable"])
def test_clean_restart_replays(tmp_path, mode):
    s = Server(tmp_path, ["--persistence", mode])
    c = s.client(decode_responses=True)
    fill(c, 2000)
    c.delete("k1", "k2")
    c.set("k3", "changed")
    c.incrby("counter", 41)
    c.incr("counter")
    c.set("ttl", "v", ex=1000)
    c.mset({"m1": "a", "m2": "b"})
    s.stop()
    assert s.proc.returncode == 0
    s2 = Server(tmp_path, ["--persistence", mode])
    try:
        c2 = s2.client(decode_responses=True)
        assert c2.dbsize() == 2000 - 2 + 4
        assert c2.get("k0") == "v0" and c2.get("k1999") == "v1999"
        assert c2.get("k1") is None and c2.get("k2") is None
        assert c2.get("k3") == "changed"
        assert c2.get("counter") == "42"
        assert 900 < c2.ttl("ttl") <= 1000
        assert c2.mget("m1", "m2") == ["a", "b"]
        # Versions keep growing after the restart: new writes win over replayed ones next time.
        c2.set("k0", "after")
    finally:
        s2.stop()
    s3 = Server(tmp_path, ["--persistence", mode])
    try:
        assert s3.client(decode_responses=True).get("k0") == "after"
    finally:
        s3.stop()


def test_keys_that_expired_while_stopped_do_not_come_back(tmp_path):
    s = Server(tmp_path, ["--persistence", "durable"])
    c = s.client(decode_responses=True)
    fill(c, 100)
    # Long enough to outlive 50 durable writes (one fdatasync each) on a loaded machine.
    for i in range(50):
        c.set(f"short{i}", "v", px=3000)
    c.set("long", "v", ex=1000)
    assert c.dbsize() == 151
    s.stop()
    time.sleep(3.2)
    s2 = Server(tmp_path, ["--persistence", "durable"])
    try:
        c2 = s2.client(decode_responses=True)
        assert c2.dbsize() == 101
        assert c2.info("keyspace")["db0"]["expires"] == 1
        assert c2.get("short0") is None and c2.get("long") == "v"
    finally:
        s2.stop()


def test_durable_survives_kill_9_right_after_the_reply(tmp_path):
    s = Server(tmp_path, ["--persistence", "durable"])
    c = s.client(decode_responses=True)
    for i in range(200):
        assert c.set(f"d{i}", str(i))
    s.proc.kill()
    s.proc.wait()
    s2 = Server(tmp_path, ["--persistence", "durable"])
    try:
        c2 = s2.client(decode_responses=True)
        assert [c2.get(f"d{i}") for i in range(200)] == [str(i) for i in range(200)]
    finally:
        s2.stop()


def test_async_is_on_disk_within_the_flush_interval(tmp_path):
    s = Server(tmp_path, ["--persistence", "async"])
    c = s.client(decode_responses=True)
    fill(c, 1000)
    time.sleep(0.6)  # several 100 ms flush periods
    s.proc.kill()
    s.proc.wait()
    s2 = Server(tmp_path, ["--persistence", "async"])
    try:
        assert s2.client().dbsize() == 1000
    finally:
        s2.stop()


def test_off_starts_empty(tmp_path):
    s = Server(tmp_path)
    s.client().set("k", "v")
    s.stop()
    s2 = Server(tmp_path)
    try:
        assert s2.client().dbsize() == 0
    finally:
        s2.stop()


def tablets_of(server):
    return int(server.client().info("server")["ramlog_tablets"])


def test_tablet_count_is_recorded_adopted_and_enforced(tmp_path):
    """A data directory keeps the tablet count it was written with: a server whose configuration
    names none adopts it, and one that names another refuses to start with a clear error."""
    sixteen = tmp_path / "sixteen.toml"
    sixteen.write_text("tablets = 16\n")
    other = tmp_path / "other.toml"
    other.write_text("tablets = 32\n")

    s = Server(tmp_path, ["--persistence", "async", "--config", str(sixteen)])
    assert tablets_of(s) == 16
    fill(s.client(), 500)
    s.stop()

    s2 = Server(tmp_path, ["--persistence", "async"])
    try:
        assert tablets_of(s2) == 16, "the recorded count wins over the default"
        c2 = s2.client(decode_responses=True)
        assert c2.dbsize() == 500
        assert c2.get("k499") == "v499"
    finally:
        s2.stop()

    with pytest.raises(RuntimeError) as refused:
        Server(tmp_path, ["--persistence", "async", "--config", str(other)])
    assert "written with 16 tablets" in str(refused.value)
    assert "tablets = 32" in str(refused.value) or "asks for 32" in str(refused.value)

    s3 = Server(tmp_path, ["--persistence", "async"])
    try:
        assert s3.client().dbsize() == 500, "the refused start changed nothing"
    finally:
        s3.stop()

    fresh = Server(tmp_path / "fresh", ["--persistence", "off"])
    try:
        assert tablets_of(fresh) == 64, "the default for a new deployment"
    finally:
        fresh.stop()


def test_save_makes_every_write_durable_before_it_answers(tmp_path):
    """SAVE under `async` persistence: its OK means every write before it is on disk, so a
    kill -9 right after it loses none (without SAVE, `async` may lose the last 100 ms). LASTSAVE
    gives its time; inside MULTI it is refused and EXEC aborts; without persistence it is an
    error that says why."""
    s = Server(tmp_path, ["--persistence", "async"])
    c = s.client(decode_responses=True)
    before = c.lastsave()
    fill(c, 3000)
    assert c.save() is True
    assert c.lastsave() >= before
    p = c.pipeline(transaction=True)
    p.set("in-multi", "1")
    p.execute_command("SAVE")
    with pytest.raises(redis.ResponseError, match="not allowed inside a transaction"):
        p.execute()
    assert c.get("in-multi") is None
    s.proc.kill()
    s.proc.wait()
    s2 = Server(tmp_path, ["--persistence", "async"])
    try:
        c2 = s2.client(decode_responses=True)
        assert c2.dbsize() == 3000
        assert c2.get("k2999") == "v2999"
    finally:
        s2.stop()
    off = Server(tmp_path / "off")
    try:
        with pytest.raises(redis.ResponseError, match="persistence off"):
            off.client().save()
    finally:
        off.stop()
