"""The routing port while a master fails: a plain (cluster-unaware) redis-py client writing
through a surviving server's routing port during a kill -9 of a master gets no -TRYAGAIN and
no -CLUSTERDOWN. Its requests for the dead master's slots wait for the map to name the new
master (at most `routing_recovery_wait_ms`) and then go there; only a request in flight at the
kill may end in doubt (`-ERR ... outcome unknown`), and its key then holds the old value or the
new one. Every acknowledged write is read back. With `routing_recovery_wait_ms = 0` the same
client gets -TRYAGAIN, as before the wait existed. Real processes on loopback; every wait is
bounded."""

import signal
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from conftest import Cluster
from test_failures import server_id_of, status, wait_declared_dead, wait_settled

WRITERS = 2
KEYS_PER_WRITER = 400


class Load:
    """Writers that set `w{t}:{n % KEYS_PER_WRITER}` to `n` for n = 0, 1, 2, ... one request at a
    time, each on its own plain connection to one routing port, recording what each got."""

    def __init__(self, port):
        self.port = port
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acked = {}  # key -> the value its last acknowledged write set
        self.in_doubt = []  # (started, ended, key, old value, new value)
        self.refused = []  # (started, error) for -TRYAGAIN / -CLUSTERDOWN
        self.other = []  # (started, error)
        self.writes = 0
        self.longest = 0.0
        self.threads = [threading.Thread(target=self.write, args=(t,), daemon=True)
                        for t in range(WRITERS)]

    def write(self, t):
        r = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=30,
                        retry=Retry(NoBackoff(), 0))
        n = 0
        while not self.stop.is_set():
            key = f"w{t}:{n % KEYS_PER_WRITER}"
            value = str(n)
            with self.lock:
                old = self.acked.get(key)
            started = time.time()
            try:
                r.set(key, value)
                ended = time.time()
                with self.lock:
                    self.acked[key] = value
                    self.writes += 1
                    self.longest = max(self.longest, ended - started)
            except redis.exceptions.ResponseError as e:
                ended = time.time()
                text = str(e)
                with self.lock:
                    self.longest = max(self.longest, ended - started)
                    if "outcome is unknown" in text:
                        self.in_doubt.append((started, ended, key, old, value))
                        # Either value may be there now: the key is checked on its own below.
                        self.acked.pop(key, None)
                    elif isinstance(e, (redis.exceptions.TryAgainError,
                                        redis.exceptions.ClusterDownError)) \
                            or text.startswith(("TRYAGAIN", "CLUSTERDOWN")):
                        self.refused.append((started, f"{type(e).__name__}: {text}"))
                    else:
                        self.other.append((started, text))
            except redis.exceptions.RedisError as e:
                with self.lock:
                    self.other.append((started, f"{type(e).__name__}: {e}"))
                time.sleep(0.05)
            n += 1
        r.close()

    def start(self):
        for t in self.threads:
            t.start()

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=40)
        assert not any(t.is_alive() for t in self.threads), "a writer is stuck"


def write_through_a_kill(c: Cluster, load: Load):
    """Starts `load`, kills server 0 (a master), waits until its tablets are served again and
    the load went on past that; returns the time of the kill."""
    victim = server_id_of(c, status(c), 0)
    load.start()
    deadline = time.time() + 10
    while load.writes < 300 and time.time() < deadline:
        time.sleep(0.02)
    assert load.writes >= 300, "the load did not start"
    c.servers[0].proc.send_signal(signal.SIGKILL)
    killed = time.time()
    c.servers[0].proc.wait(timeout=5)
    wait_declared_dead(c, victim)
    wait_settled(c, copies=False, timeout=20)
    settled = load.writes
    deadline = time.time() + 10
    while load.writes < settled + 300 and time.time() < deadline:
        time.sleep(0.02)
    load.finish()
    return killed


def test_a_plain_client_on_the_routing_port_waits_out_a_killed_master(tmp_path):
    c = Cluster(tmp_path, servers=4)
    load = Load(c.servers[1].routing)
    try:
        killed = write_through_a_kill(c, load)
        print(f"writes {load.writes}, refused {len(load.refused)}, in doubt {len(load.in_doubt)}, "
              f"longest wait {load.longest:.3f} s")
        assert not load.refused, load.refused[:5]
        assert not load.other, load.other[:5]
        # Only requests in flight at the kill may end in doubt: one per writer at most (and one
        # more if it raced the peer connection's close).
        assert len(load.in_doubt) <= 2 * WRITERS, load.in_doubt
        for started, _, _, _, _ in load.in_doubt:
            assert killed - 1.0 <= started <= killed + 0.5, (killed, load.in_doubt)
        # The longest request waited for detection and restore, far less than the bound.
        assert load.longest < 8.0, load.longest
        r = redis.Redis(host="127.0.0.1", port=c.servers[2].routing, socket_timeout=10)
        keys = sorted(load.acked)
        for i in range(0, len(keys), 100):
            chunk = keys[i:i + 100]
            got = r.mget(chunk)
            wrong = [(k, v, load.acked[k]) for k, v in zip(chunk, got)
                     if v is None or v.decode() != load.acked[k]]
            assert not wrong, wrong[:5]
        for _, _, key, old, new in load.in_doubt:
            v = r.get(key)
            assert (v.decode() if v is not None else None) in (old, new), (key, v, old, new)
    finally:
        load.stop.set()
        c.stop()


def test_with_no_wait_the_routing_port_answers_tryagain_at_once(tmp_path):
    config = tmp_path / "server.toml"
    config.write_text("routing_recovery_wait_ms = 0\n")
    c = Cluster(tmp_path, servers=4, extra_args=("--config", str(config)))
    load = Load(c.servers[1].routing)
    try:
        write_through_a_kill(c, load)
        print(f"writes {load.writes}, refused {len(load.refused)}, in doubt {len(load.in_doubt)}, "
              f"longest wait {load.longest:.3f} s")
        assert load.refused, "no request was refused while the master was down"
        assert all("TryAgain" in e or "TRYAGAIN" in e for _, e in load.refused), load.refused[:5]
        assert load.longest < 2.0, load.longest
    finally:
        load.stop.set()
        c.stop()
