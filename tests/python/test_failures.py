"""Failures: a killed master's tablets are restored by their backups and served again; nothing
acknowledged is lost, nothing deleted comes back, no read is stale; a paused master that was
replaced never answers again; the whole cluster restarts with every `durable` write. Real
processes on loopback; each test starts its own cluster and stops every process by its pid."""

import json
import random
import signal
import subprocess
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from conftest import Cluster, ramlog_bin, wait_until


def ramlog(*args, timeout=30):
    out = subprocess.run([ramlog_bin(), *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out.stdout


def status(c: Cluster) -> dict:
    return json.loads(ramlog("cluster", "status", "--json", "--coordinator", c.coordinator_addr))


def server_id_of(c: Cluster, st: dict, i: int) -> int:
    port = c.servers[i].resp
    return next(s["id"] for s in st["servers"] if int(s["addresses"]["resp"].rsplit(":", 1)[1]) == port)


def try_again(op) -> bool:
    """True if `op` was answered -TRYAGAIN (its slot's tablet is still being recovered there)."""
    try:
        op()
        return False
    except redis.exceptions.TryAgainError:
        return True


def wait_declared_dead(c: Cluster, server_id: int, timeout=10.0):
    """Until the coordinator shows server `server_id` dead."""
    assert wait_until(
        lambda: next(s for s in status(c)["servers"] if s["id"] == server_id)["state"] == "dead",
        timeout=timeout, interval=0.02), json.dumps(status(c))[:2000]


def wait_settled(c: Cluster, copies=True, timeout=30.0):
    """Until no tablet recovers (and, with `copies`, no copy is pending)."""
    def settled():
        st = status(c)
        return st["recovering_tablets"] == 0 and (not copies or st["pending_copies"] == 0)
    assert wait_until(settled, timeout=timeout, interval=0.05), json.dumps(status(c))[:3000]


def cluster_client(c: Cluster, alive) -> RedisCluster:
    i = next(i for i in range(len(c.servers)) if alive(i))
    return RedisCluster(host="127.0.0.1", port=c.servers[i].resp, socket_timeout=3,
                        socket_connect_timeout=1)


class Keys:
    """What each key may hold, for a single writer per key with sequential operations: a set of
    possible values (None = absent). An acknowledged write leaves one; an operation that failed
    adds its value to the previous ones (it may or may not have taken effect); a read must return
    one of them, and then only that one remains."""

    def __init__(self):
        self.possible = {}
        self.lock = threading.Lock()
        self.violations = []
        self.acked = 0
        self.failed = 0
        self.errors = []

    def acked_write(self, key, value):
        with self.lock:
            self.possible[key] = {value}
            self.acked += 1

    def failed_write(self, key, value):
        with self.lock:
            self.possible.setdefault(key, {None}).add(value)
            self.failed += 1

    def read(self, key, value, when):
        with self.lock:
            allowed = self.possible.get(key, {None})
            if value not in allowed:
                self.violations.append((when, key, value, sorted(map(str, allowed))))
            else:
                self.possible[key] = {value}


def writer(c: Cluster, keys: Keys, alive, t: int, stop: threading.Event):
    """Writes, deletes and reads back keys `f{t}:{n}`, one operation at a time."""
    rng = random.Random(t)
    rc = None
    seq = 0
    while not stop.is_set():
        key = f"f{t}:{rng.randrange(200)}"
        seq += 1
        try:
            if rc is None:
                rc = cluster_client(c, alive)
            if rng.random() < 0.1:
                try:
                    rc.delete(key)
                except Exception:
                    keys.failed_write(key, None)
                    raise
                keys.acked_write(key, None)
            else:
                value = f"{t}:{seq}".encode()
                try:
                    rc.set(key, value)
                except Exception:
                    keys.failed_write(key, value)
                    raise
                keys.acked_write(key, value)
            keys.read(key, rc.get(key), time.time())
        except Exception as e:
            keys.errors.append((time.time(), f"{type(e).__name__}: {e}"))
            time.sleep(0.02)
            try:
                rc = cluster_client(c, alive)
            except Exception:
                rc = None


def check_all(c: Cluster, keys: Keys, alive):
    rc = cluster_client(c, alive)
    for key in list(keys.possible):
        keys.read(key, rc.get(key), "final")
    assert not keys.violations, keys.violations[:10]


def test_masters_killed_under_load_twenty_times(tmp_path):
    """kill -9 a random server 20 times under a RedisCluster load (10 times with the default
    table `sync`, 10 times `durable`), restarting it each time: no acknowledged write lost, no
    deleted key back, no stale read."""
    c = Cluster(tmp_path, servers=3)
    down = set()
    alive = lambda i: i not in down  # noqa: E731
    keys = Keys()
    stop = threading.Event()
    threads = [threading.Thread(target=writer, args=(c, keys, alive, t, stop), daemon=True)
               for t in range(3)]
    rng = random.Random(36)
    try:
        for t in threads:
            t.start()
        assert wait_until(lambda: keys.acked > 200, timeout=20)
        declared = []
        for round_ in range(20):
            if round_ == 10:
                ramlog("table", "set-mode", "default", "durable", "--coordinator", c.coordinator_addr)
            time.sleep(rng.uniform(0.1, 0.8))
            victim = rng.randrange(3)
            before = status(c)
            victim_id = server_id_of(c, before, victim)
            down.add(victim)
            killed = time.time()
            c.servers[victim].proc.send_signal(signal.SIGKILL)
            c.servers[victim].proc.wait(timeout=5)
            wait_declared_dead(c, victim_id)
            declared.append(time.time() - killed)
            wait_settled(c, copies=False)
            c.restart_server(victim)
            down.discard(victim)
            wait_settled(c)
        acked_before = keys.acked
        assert wait_until(lambda: keys.acked > acked_before + 50, timeout=20), "the load stalled"
        stop.set()
        for t in threads:
            t.join(timeout=30)
        check_all(c, keys, alive)
        assert keys.acked > 1000, keys.acked
        # Detection within the default (400 ms of silence and a probe) plus the polling here.
        assert sorted(declared)[len(declared) // 2] < 1.0, declared
    finally:
        stop.set()
        c.stop()


def test_the_restorer_dies_during_recovery_and_the_next_backup_restores(tmp_path):
    """R = 2 over 3 servers: kill a master, then its restorer while it restores (restores are
    slowed down here by a test knob); the remaining backup restores everything."""
    c = Cluster(tmp_path, servers=3, env={"RAMLOG_TEST_RESTORE_DELAY_MS": "1500"})
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=5)
        expected = {f"r{n}": f"v{n}".encode() for n in range(3000)}
        for k, v in expected.items():
            rc.set(k, v)
        for n in range(0, 3000, 7):
            rc.delete(f"r{n}")
            expected[f"r{n}"] = None
        st = status(c)
        first = server_id_of(c, st, 0)
        c.servers[0].proc.send_signal(signal.SIGKILL)

        def restorers():
            return {t["restorer"] for t in status(c)["tables"][0]["tablets"] if t["recovering"]} - {None}

        assert wait_until(lambda: restorers(), timeout=10, interval=0.02)
        victim_id = sorted(restorers())[0]
        victim = next(i for i in range(3) if server_id_of(c, st, i) == victim_id)
        c.servers[victim].proc.send_signal(signal.SIGKILL)
        survivor = next(i for i in range(3) if i not in (0, victim))
        wait_settled(c, copies=False, timeout=30)
        st = status(c)
        survivor_id = server_id_of(c, st, survivor)
        assert all(t["master"] == survivor_id for t in st["tables"][0]["tablets"]), st
        assert {s["id"]: s["state"] for s in st["servers"]} == {
            first: "dead", victim_id: "dead", survivor_id: "up"}
        one = redis.Redis(port=c.servers[survivor].resp, socket_timeout=5)
        # The survivor serves the final map from its next heartbeat (within 100 ms).
        assert wait_until(lambda: not any(try_again(lambda: one.get(k)) for k in expected),
                          timeout=5)
        got = {k: one.get(k) for k in expected}
        assert got == expected
    finally:
        c.stop()


def test_two_servers_killed_one_after_the_other_with_two_backups(tmp_path):
    """4 servers, R = 2, under load: kill one server, wait for its tablets to be served again,
    kill another; no acknowledged write is lost."""
    c = Cluster(tmp_path, servers=4, coordinator_args=["--default-replicas", "2"])
    down = set()
    alive = lambda i: i not in down  # noqa: E731
    keys = Keys()
    stop = threading.Event()
    threads = [threading.Thread(target=writer, args=(c, keys, alive, t, stop), daemon=True)
               for t in range(3)]
    try:
        assert status(c)["tables"][0]["replicas"] == 2
        for t in threads:
            t.start()
        assert wait_until(lambda: keys.acked > 300, timeout=20)
        for victim in (1, 3):
            down.add(victim)
            c.servers[victim].proc.send_signal(signal.SIGKILL)
            time.sleep(0.6)
            wait_settled(c, copies=False)
        acked_before = keys.acked
        assert wait_until(lambda: keys.acked > acked_before + 100, timeout=20), "the load stalled"
        stop.set()
        for t in threads:
            t.join(timeout=30)
        check_all(c, keys, alive)
        # The two survivors hold everything, each tablet backed up by the other (the dead stay
        # listed: two live backups per tablet cannot be had with two servers up).
        st = status(c)
        up = {s["id"] for s in st["servers"] if s["state"] == "up"}
        assert len(up) == 2
        wait_settled(c)
        for t in status(c)["tables"][0]["tablets"]:
            assert t["master"] in up and set(t["backups"]) & up == up - {t["master"]}, t
    finally:
        stop.set()
        c.stop()


def test_a_paused_master_that_was_replaced_never_answers_again(tmp_path):
    """SIGSTOP a master until it is declared dead and its tablets are restored elsewhere, write
    new values there, then SIGCONT it: it answers no request for its old keys with data (its
    lease ran out), and stops once the coordinator fences it. Started again, it rejoins and stays."""
    c = Cluster(tmp_path, servers=3)
    paused = None
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[1].resp, socket_timeout=5)
        st = status(c)
        zombie_id = server_id_of(c, st, 0)
        own = []
        n = 0
        while len(own) < 20:
            k = f"z{n}"
            n += 1
            rc.set(k, b"old")
            node = rc.get_node_from_key(k)
            if node.port == c.servers[0].resp:
                own.append(k)
        # No client-side retries: once the zombie stops, each request fails at once instead of
        # after redis-py's backoff.
        direct = redis.Redis(port=c.servers[0].resp, socket_timeout=10, retry=Retry(NoBackoff(), 0))
        assert direct.get(own[0]) == b"old"
        paused = c.servers[0].proc
        paused.send_signal(signal.SIGSTOP)
        wait_declared_dead(c, zombie_id)
        wait_settled(c, copies=False)
        for k in own:
            rc.set(k, b"new")
        paused.send_signal(signal.SIGCONT)
        answers = []
        for k in own:
            try:
                answers.append(direct.get(k))
            except redis.exceptions.ResponseError as e:
                answers.append(str(e).split()[0])
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                answers.append("closed")
            try:
                direct.set(k, b"zombie")
                answers.append("OK")
            except redis.exceptions.ResponseError as e:
                answers.append(str(e).split()[0])
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                answers.append("closed")
        assert b"old" not in answers and "OK" not in answers, answers
        # Fenced: the old process stops on its own.
        paused.wait(timeout=10)
        paused = None
        assert all(rc.get(k) == b"new" for k in own)
        # Started again at once, it rejoins and stays: the coordinator counts the registration
        # as a heartbeat, not the old process's silence against it (it used to be declared dead
        # again within a second, and stopped).
        again = c.restart_server(0).proc
        assert wait_until(lambda: next(s for s in status(c)["servers"] if s["id"] == zombie_id)["state"] == "up",
                          timeout=10)
        time.sleep(3)
        assert again.poll() is None, (tmp_path / "server-0.log").read_text()[-2000:]
        assert next(s for s in status(c)["servers"] if s["id"] == zombie_id)["state"] == "up"
    finally:
        if paused is not None and paused.poll() is None:
            paused.send_signal(signal.SIGCONT)
        c.stop()


def test_whole_cluster_killed_and_restarted_keeps_every_durable_write(tmp_path):
    """kill -9 the coordinator and every server, start them again on their data directories:
    every write acknowledged under `durable` is back and no deleted key is."""
    c = Cluster(tmp_path, servers=3)
    try:
        ramlog("table", "set-mode", "default", "durable", "--coordinator", c.coordinator_addr)
        time.sleep(0.5)
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=5)
        expected = {}
        for n in range(2000):
            rc.set(f"w{n}", f"v{n}")
            expected[f"w{n}"] = f"v{n}".encode()
        for n in range(0, 2000, 5):
            rc.delete(f"w{n}")
            expected[f"w{n}"] = None
        for n in range(0, 2000, 9):
            rc.set(f"w{n}", f"again{n}")
            expected[f"w{n}"] = f"again{n}".encode()
        for p in [c.coordinator] + [s.proc for s in c.servers]:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=5)
        c.restart_coordinator()
        for i in range(3):
            c.restart_server(i)
        wait_settled(c, copies=False, timeout=60)
        c.wait_ok(timeout=30)
        rc = RedisCluster(host="127.0.0.1", port=c.servers[1].resp, socket_timeout=5)
        got = {k: rc.get(k) for k in expected}
        missing = [k for k in expected if got[k] != expected[k]]
        assert not missing, [(k, expected[k], got[k]) for k in missing[:10]]
    finally:
        c.stop()


def leader_of(c: Cluster) -> int:
    return status(c)["leader"]


def plain_load(c: Cluster, keys: Keys, stop: threading.Event):
    """SET and GET through a routing port with a client that never retries: any refusal (such as
    `-CLUSTERDOWN` from a server whose lease ran out) is an error here."""
    r = redis.Redis(host="127.0.0.1", port=c.servers[0].routing, socket_timeout=3)
    n = 0
    while not stop.is_set():
        n += 1
        key = f"plain{n % 500}"
        try:
            r.set(key, str(n))
            if r.get(key) != str(n).encode():
                keys.errors.append((time.time(), f"plain: {key} lost {n}"))
        except Exception as e:
            keys.errors.append((time.time(), f"plain {type(e).__name__}: {e}"))
            time.sleep(0.01)


def start_writers(c: Cluster, keys: Keys, stop: threading.Event, n=3):
    threads = [threading.Thread(target=writer, args=(c, keys, lambda i: True, t, stop), daemon=True)
               for t in range(n)]
    threads.append(threading.Thread(target=plain_load, args=(c, keys, stop), daemon=True))
    for t in threads:
        t.start()
    assert wait_until(lambda: keys.acked > 200, timeout=20)
    return threads


def test_the_coordinator_leaders_loss_is_invisible_to_clients(tmp_path):
    """Three coordinator members; kill -9 the leader under a RedisCluster load: no request fails,
    no server is declared dead, a new leader takes map changes, the old member rejoins."""
    c = Cluster(tmp_path, servers=3, coordinators=3)
    keys = Keys()
    stop = threading.Event()
    threads = []
    try:
        threads = start_writers(c, keys, stop)
        old = leader_of(c)
        c.coordinators[old - 1].send_signal(signal.SIGKILL)
        c.coordinators[old - 1].wait(timeout=5)
        killed = time.time()
        assert wait_until(lambda: leader_of(c) not in (None, old), timeout=15, interval=0.1)
        elected = time.time() - killed
        # Well past dead-after (400 ms) several times over, under load.
        acked = keys.acked
        time.sleep(3)
        assert keys.acked > acked + 100
        assert not keys.errors, (elected, keys.errors[:5])
        st = status(c)
        assert [s["state"] for s in st["servers"]] == ["up"] * 3, st["servers"]
        # The new leader takes map changes; the killed member comes back as a follower.
        ramlog("table", "set-mode", "default", "durable", "--coordinator", c.coordinator_addr)
        c.restart_coordinator(old - 1)
        time.sleep(1)
        assert not keys.errors, keys.errors[:5]
        stop.set()
        for t in threads:
            t.join(timeout=10)
        check_all(c, keys, lambda i: True)
    finally:
        stop.set()
        c.stop()


def test_with_its_only_coordinator_down_the_cluster_keeps_serving(tmp_path):
    """One coordinator member, kill -9 under load: the servers keep serving every request; a map
    change fails with a clear error until the coordinator is back; then it works, and nobody was
    declared dead for the coordinator's absence."""
    c = Cluster(tmp_path, servers=3)
    keys = Keys()
    stop = threading.Event()
    threads = []
    try:
        threads = start_writers(c, keys, stop)
        c.coordinator.send_signal(signal.SIGKILL)
        c.coordinator.wait(timeout=5)
        acked = keys.acked
        time.sleep(3)
        assert keys.acked > acked + 100
        assert not keys.errors, keys.errors[:5]
        out = subprocess.run(
            [ramlog_bin(), "table", "set-mode", "default", "durable", "--coordinator", c.coordinator_addr],
            capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "coordinator" in out.stderr, (out.stdout, out.stderr)
        assert not keys.errors, keys.errors[:5]
        c.restart_coordinator()
        ramlog("table", "set-mode", "default", "durable", "--coordinator", c.coordinator_addr)
        time.sleep(1.5)
        st = status(c)
        assert [s["state"] for s in st["servers"]] == ["up"] * 3, st["servers"]
        assert not keys.errors, keys.errors[:5]
        stop.set()
        for t in threads:
            t.join(timeout=10)
        check_all(c, keys, lambda i: True)
    finally:
        stop.set()
        c.stop()


def test_a_peer_that_fails_a_clients_request_is_reported_and_declared_sooner(tmp_path):
    """With a long dead-after (6 s, lease 4.5 s), a killed server whose keys a client asks for
    through another server's routing port is reported by that server; the coordinator probes it
    once its lease has run out and declares it well before the silence alone would."""
    c = Cluster(tmp_path, servers=3, coordinator_args=("--dead-after-ms", "6000"))
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[1].resp, socket_timeout=5)
        victim = server_id_of(c, status(c), 0)
        own = [k for k in (f"s{n}" for n in range(200)) if rc.get_node_from_key(k).port == c.servers[0].resp]
        assert own
        c.servers[0].proc.send_signal(signal.SIGKILL)
        c.servers[0].proc.wait(timeout=5)
        killed = time.time()
        r = redis.Redis(host="127.0.0.1", port=c.servers[1].routing, socket_timeout=5)

        def declared():
            try:
                r.get(own[0])
            except redis.exceptions.RedisError:
                pass
            return next(s for s in status(c)["servers"] if s["id"] == victim)["state"] == "dead"

        assert wait_until(declared, timeout=10, interval=0.1)
        took = time.time() - killed
        log = (tmp_path / "coordinator-1.log").read_text()
        assert "a client's request could not reach it" in log, log[-2000:]
        assert took < 5.7, took
    finally:
        c.stop()


def test_a_restarted_backup_is_not_the_restorer_before_its_copy(tmp_path):
    """A backup is killed and declared dead; keys are deleted and rewritten meanwhile; it
    restarts and, while its copies are still running (slowed), the master of tablets it is the
    first backup of is killed: the other backup restores them, so nothing deleted comes back and
    nothing written while the first was away is lost."""
    config = tmp_path / "slow-copy.toml"
    config.write_text("recovery_copy_bytes_per_sec = 65536\n")
    c = Cluster(tmp_path, servers=3, extra_args=("--config", str(config)))
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=5)
        st = status(c)
        a_id = server_id_of(c, st, 2)
        m_id = server_id_of(c, st, 0)
        # Keys mastered by server 0 in tablets whose first backup is server 2.
        table = next(t for t in st["tables"] if t["name"] == "default")
        def watched(k):
            t = next(t for t in table["tablets"] if t["first_slot"] <= key_slot(k.encode()) <= t["last_slot"])
            return t["master"] == m_id and t["backups"][0] == a_id
        keys = [k for k in (f"b{n}" for n in range(20000)) if watched(k)][:400]
        assert len(keys) >= 100, len(keys)
        filler = b"x" * 2000
        for k in keys:
            rc.set(k, b"first")
        for n in range(2000):  # enough that copying at 64 KiB/s takes a while
            rc.set(f"fill{n}", filler)
        c.servers[2].proc.send_signal(signal.SIGKILL)
        c.servers[2].proc.wait(timeout=5)
        wait_declared_dead(c, a_id)
        expected = {}
        for n, k in enumerate(keys):
            if n % 2:
                rc.delete(k)
                expected[k] = None
            else:
                rc.set(k, b"while-away")
                expected[k] = b"while-away"
        c.restart_server(2)

        def copying():
            st = status(c)
            back = next(s for s in st["servers"] if s["id"] == a_id)["state"] == "up"
            return back and any(a_id in t.get("pending", []) for tb in st["tables"] for t in tb["tablets"])
        assert wait_until(copying, timeout=20, interval=0.05), json.dumps(status(c))[:2000]
        c.servers[0].proc.send_signal(signal.SIGKILL)
        c.servers[0].proc.wait(timeout=5)
        wait_declared_dead(c, m_id)
        wait_settled(c, copies=False, timeout=30)
        restorers = {t["master"] for tb in status(c)["tables"] for t in tb["tablets"]}
        assert m_id not in restorers
        rc = RedisCluster(host="127.0.0.1", port=c.servers[1].resp, socket_timeout=5)
        got = {k: rc.get(k) for k in keys}
        wrong = [(k, expected[k], got[k]) for k in keys if got[k] != expected[k]]
        assert not wrong, (len(wrong), wrong[:10])
    finally:
        c.stop()
