"""Lua scripting: EVAL, EVALSHA, SCRIPT against redis-server under the same scripts; redis-py's
registered scripts on a standalone server, through the routing port and on the cluster ports;
scripts and transactions run alone (no other command between their commands)."""

import hashlib
import threading

import pytest
import redis
from redis.cluster import RedisCluster

from conftest import Server
from test_types import redis_peer  # noqa: F401  (the redis-server fixture)


def _answer(client, script, keys, args):
    try:
        return ("ok", client.eval(script, len(keys), *keys, *args))
    except redis.ResponseError as e:
        # Redis adds where the script failed (" script: <sha>, on @user_script:1."); the
        # error itself must be the same.
        return ("err", str(e).split(" script: ")[0])


SCRIPTS = [
    ("return 1", [], []),
    ("return 'text'", [], []),
    ("return {1, 2, {3, 'x'}, false, true, 3.7, nil, 'after nil'}", [], []),
    ("return nil", [], []),
    ("return false", [], []),
    ("return true", [], []),
    ("return -3.9", [], []),
    ("redis.call('set', KEYS[1], ARGV[1]); return redis.call('get', KEYS[1])", ["s"], ["v1"]),
    ("return redis.call('incr', KEYS[1])", ["s"], []),
    ("return redis.pcall('incr', KEYS[1])", ["s"], []),
    ("local r = redis.pcall('incr', KEYS[1]); return type(r) .. ':' .. tostring(r.err ~= nil)", ["s"], []),
    ("redis.call('hset', KEYS[1], 'a', '1', 'b', '2'); return redis.call('hgetall', KEYS[1])", ["h"], []),
    ("redis.call('rpush', KEYS[1], 'a', 'b', 'c'); return redis.call('lrange', KEYS[1], 0, -1)", ["l"], []),
    ("return redis.call('get', 'missing')", [], []),
    ("return tostring(redis.call('get', 'missing'))", [], []),
    ("return {err = 'MYCODE my error'}", [], []),
    ("return redis.error_reply('ERR made here')", [], []),
    ("return redis.status_reply('FINE')", [], []),
    ("return redis.call('set', KEYS[1], 'x')", ["s2"], []),
    ("return redis.sha1hex('abc')", [], []),
    ("return tonumber(ARGV[1]) + 1", [], ["41"]),
    ("return redis.call('zadd', KEYS[1], 1.5, 'a', 2, 'b')", ["z"], []),
    ("return redis.call('zrange', KEYS[1], 0, -1, 'withscores')", ["z"], []),
    ("return redis.call('type', KEYS[1])", ["z"], []),
    ("return KEYS[1] .. ':' .. ARGV[2] .. ':' .. #KEYS .. #ARGV", ["k1", "k2"], ["a", "b"]),
    ("return redis.call('exists', unpack(KEYS))", ["s", "h", "nope"], []),
    ("return redis.call()", [], []),
    ("return redis.call('nosuchcommand')", [], []),
    ("return redis.call('get', {})", [], []),
    ("local t = {} for i = 1, 100 do t[i] = i * i end return t", [], []),
    ("return string.rep('ab', 3) .. string.format('%d', 7) .. table.concat({'x', 'y'}, ',')", [], []),
    ("return math.floor(7 / 2)", [], []),
    # Celery's chord cleanup script.
    ("""local ckey = KEYS[1]
if redis.call('GET', ckey) == ARGV[1] then
    redis.call('DEL', KEYS[2])
    redis.call('SET', ckey, 'done', 'EX', tonumber(ARGV[2]))
    return 1
end
return 0""", ["ck", "l"], ["token", "60"]),
    # The bit library (LuaBitOp), on the edges of 32 bits.
    ("return {bit.tobit(0xffffffff), bit.tobit(2^32 + 5), bit.tobit(-1), bit.tobit(1.5), bit.tobit(2.5)}", [], []),
    ("return {bit.tohex(65535), bit.tohex(-1, 4), bit.tohex(255, -2), bit.tohex(1, 10)}", [], []),
    ("return {bit.band(0xff, 0x0f, 0x3), bit.bor(1, 2, 4), bit.bxor(5, 3), bit.bnot(0)}", [], []),
    ("return {bit.lshift(1, 31), bit.rshift(-1, 28), bit.arshift(-256, 4), bit.lshift(1, 33)}", [], []),
    ("return {bit.rol(0x12345678, 8), bit.ror(0x12345678, 8), bit.bswap(0x12345678)}", [], []),
    # The struct library: sizes, endianness, alignment, strings, and the errors.
    ("return struct.pack('>iH<d s c3 b', 7, 513, 1.5, 'hi', 'abcdef', -2)", [], []),
    ("return {struct.unpack('>iH<d s c3 b', struct.pack('>iH<d s c3 b', 7, 513, 1.5, 'hi', 'abcdef', -2))}", [], []),
    ("return {struct.pack('!4 b i I2 l', 1, -5, 65535, -1), struct.size('!4 b i I2 l'), struct.size('!bd')}", [], []),
    ("return {struct.unpack('<i8 I3 B h', struct.pack('<i8 I3 B h', -9, 70000, 200, -300))}", [], []),
    ("return {struct.unpack('b c0 x', struct.pack('b c0 x', 3, 'xyz'))}", [], []),
    ("return {struct.unpack('>I4', 'abcdefgh', 5)}", [], []),
    ("return struct.pack('f', 0.25)", [], []),
    ("return {struct.unpack('s', 'abc')}", [], []),
    ("return {struct.unpack('i', 'ab')}", [], []),
    ("return struct.pack('z', 1)", [], []),
    ("return struct.size('s')", [], []),
    ("return struct.pack('!3 i', 1)", [], []),
    ("return struct.pack('i33', 1)", [], []),
]


def test_scripts_answer_as_redis_does(tmp_path, redis_peer):  # noqa: F811
    s = Server(tmp_path)
    try:
        ours = redis.Redis(port=s.port, socket_timeout=10)
        for client in (ours, redis_peer):
            client.flushall()
            client.set("ck", "token")
        for script, keys, args in SCRIPTS:
            assert _answer(ours, script, keys, args) == _answer(redis_peer, script, keys, args), script
        # The same data results on both.
        for key in ["s", "s2", "h", "l", "z", "ck"]:
            assert ours.type(key) == redis_peer.type(key), key
        assert ours.get("ck") == redis_peer.get("ck") == b"done"
        assert ours.ttl("ck") > 0
        # Errors in the script itself.
        with pytest.raises(redis.ResponseError, match="Error compiling script"):
            ours.eval("return 'a' ..", 0)
        with pytest.raises(redis.ResponseError, match="user_script:1:"):
            ours.eval("return nosuch()", 0)
        with pytest.raises(redis.ResponseError, match="Number of keys can't be greater"):
            ours.eval("return 1", 3, "a")
        with pytest.raises(redis.ResponseError, match="negative"):
            ours.eval("return 1", -1)
        with pytest.raises(redis.ResponseError, match="not allowed from script"):
            ours.eval("return redis.call('watch', 'x')", 0)
        with pytest.raises(redis.ResponseError, match="not allowed from read-only"):
            ours.eval_ro("return redis.call('set', KEYS[1], 'x')", 1, "ro")
        assert ours.eval_ro("return redis.call('get', KEYS[1])", 1, "s2") == b"x"
        # No file or process access from a script.
        assert ours.eval("return type(io) .. type(os) .. type(loadfile) .. type(require)", 0) == b"nilnilnilnil"
    finally:
        s.stop()


def test_evalsha_and_the_script_cache(tmp_path):
    s = Server(tmp_path)
    try:
        r = redis.Redis(port=s.port, socket_timeout=10)
        sha = r.script_load("return ARGV[1]")
        assert sha == hashlib.sha1(b"return ARGV[1]").hexdigest()
        assert r.evalsha(sha, 0, "hello") == b"hello"
        assert r.script_exists(sha, "0" * 40) == [True, False]
        # EVAL adds its script too.
        r.eval("return 2", 0)
        assert r.script_exists(hashlib.sha1(b"return 2").hexdigest()) == [True]
        assert r.script_flush() is True
        with pytest.raises(redis.exceptions.NoScriptError):
            r.evalsha(sha, 0, "x")
        # redis-py's registered scripts load themselves again after NOSCRIPT.
        script = r.register_script("return redis.call('incrby', KEYS[1], ARGV[1])")
        assert script(keys=["n"], args=[5]) == 5
        r.script_flush()
        assert script(keys=["n"], args=[2]) == 7
        with pytest.raises(redis.ResponseError, match="NOTBUSY"):
            r.script_kill()
        with pytest.raises(redis.ResponseError, match="Error compiling"):
            r.script_load("return (")
    finally:
        s.stop()


def test_scripts_and_transactions_run_alone(tmp_path):
    """A script that reads a counter and writes it back one more loses nothing to plain INCRs,
    transactions and other scripts running at the same time (nothing runs between its two
    commands), and neither does a WATCH/MULTI/EXEC read-modify-write."""
    s = Server(tmp_path, extra_args=("--workers", "2"))
    try:
        bump = "local v = tonumber(redis.call('get', KEYS[1]) or '0'); redis.call('set', KEYS[1], v + 1); return v + 1"
        rounds, threads = 400, 3
        errors = []

        def by_script():
            try:
                c = redis.Redis(port=s.port, socket_timeout=30)
                f = c.register_script(bump)
                for _ in range(rounds):
                    f(keys=["counter"])
            except Exception as e:  # noqa: BLE001  (reported below)
                errors.append(e)

        def by_incr():
            try:
                c = redis.Redis(port=s.port, socket_timeout=30)
                for _ in range(rounds):
                    c.incr("counter")
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        def by_transaction():
            try:
                c = redis.Redis(port=s.port, socket_timeout=30)
                for _ in range(rounds):
                    p = c.pipeline(transaction=True)
                    p.incr("counter")
                    p.incr("counter")
                    p.execute()
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        def by_watch():
            # WATCH, read, then MULTI/SET/EXEC, again on a WatchError: EXEC's check of the
            # watched key and its SET run together, so no INCR falls between them.
            try:
                c = redis.Redis(port=s.port, socket_timeout=30)

                def bump_watched(p):
                    v = int(p.get("counter") or 0)
                    p.multi()
                    p.set("counter", v + 1)

                for _ in range(rounds):
                    c.transaction(bump_watched, "counter")
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        workers = [threading.Thread(target=by_script) for _ in range(threads)]
        workers += [threading.Thread(target=by_incr), threading.Thread(target=by_transaction),
                    threading.Thread(target=by_watch)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
        assert not errors, errors[:3]
        assert int(redis.Redis(port=s.port).get("counter")) == rounds * (threads + 1 + 2 + 1)
    finally:
        s.stop()


def test_scripts_on_the_cluster_ports_and_the_routing_port(shared_cluster):
    c = shared_cluster
    rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
    script = rc.register_script("redis.call('set', KEYS[1], ARGV[1]); return redis.call('get', KEYS[1])")
    for i in range(20):
        assert script(keys=[f"script:{i}"], args=[f"v{i}"]) == f"v{i}".encode()
    rc.set("{tag}a", "1")
    rc.set("{tag}b", "2")
    assert rc.eval("return redis.call('get', KEYS[1]) .. redis.call('get', KEYS[2])", 2, "{tag}a", "{tag}b") == b"12"
    # Keys of two slots: refused as Redis Cluster refuses them.
    node = redis.Redis(port=c.servers[0].resp, socket_timeout=10)
    with pytest.raises(redis.ResponseError, match="hash to the same slot"):
        node.eval("return 1", 2, "a", "b")
    # The routing port: scripts are loaded on every master, so EVALSHA finds them wherever the key is.
    routed = redis.Redis(port=c.servers[0].routing, socket_timeout=10)
    f = routed.register_script("return redis.call('incrby', KEYS[1], ARGV[1])")
    for i in range(20):
        assert f(keys=[f"routed:{i}"], args=[i]) == i
    for i in range(20):
        assert rc.get(f"routed:{i}") == str(i).encode()
    assert routed.eval("return ARGV[1]", 0, "keyless") == b"keyless"


def _until_busy(client, timeout=10.0):
    """Until a command answers -BUSY (a script has run past busy-reply-threshold)."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.ping()
        except redis.exceptions.BusyLoadingError:
            raise
        except redis.ResponseError as e:
            if str(e).startswith("BUSY") or "busy running a script" in str(e):
                return str(e)
            raise
        time.sleep(0.02)
    raise AssertionError("no command answered BUSY")


def test_a_long_script_makes_others_busy_until_script_kill(tmp_path, redis_peer):  # noqa: F811
    """Past busy-reply-threshold (lua-time-limit) a running script makes other clients'
    commands answer -BUSY; SCRIPT KILL stops a script that has not written (its caller gets the
    kill's error) and refuses one that has (-UNKILLABLE); SHUTDOWN NOSAVE ends that server.
    Each step is checked against redis-server as well."""
    s = Server(tmp_path)
    try:
        for client in (s.client(), redis_peer):
            port = client.connection_pool.connection_kwargs["port"]
            other = redis.Redis(port=port, socket_timeout=20)
            assert other.config_set("lua-time-limit", 200)
            assert other.config_get("busy-reply-threshold") == {"busy-reply-threshold": "200"}
            other.set("before", "1")
            result = {}

            def spin():
                try:
                    result["reply"] = redis.Redis(port=port, socket_timeout=30).eval(
                        "local i = 0 while true do i = i + 1 end", 0)
                except redis.ResponseError as e:
                    result["error"] = str(e)

            t = threading.Thread(target=spin)
            t.start()
            busy = _until_busy(other)
            assert "SCRIPT KILL" in busy, busy
            assert other.script_kill() is True
            t.join(timeout=10)
            assert not t.is_alive()
            assert "killed by user" in result.get("error", ""), result
            assert other.get("before") == b"1"
            try:
                other.script_kill()
                raise AssertionError("SCRIPT KILL with no script running succeeded")
            except redis.ResponseError as e:
                assert "No scripts in execution" in str(e)
        ours = s.client()
        wrote = {}

        def write_then_spin():
            try:
                redis.Redis(port=s.port, socket_timeout=30).eval(
                    "redis.call('set', 'written', 'yes') while true do end", 0)
            except (redis.ResponseError, redis.ConnectionError) as e:
                wrote["error"] = str(e)

        t = threading.Thread(target=write_then_spin)
        t.start()
        _until_busy(ours)
        try:
            ours.script_kill()
            raise AssertionError("SCRIPT KILL stopped a script that had written")
        except redis.ResponseError as e:
            assert "UNKILLABLE" in str(e) or "already executed write commands" in str(e), e
        try:
            ours.shutdown(nosave=True)
        except redis.ConnectionError:
            pass
        s.proc.wait(timeout=15)
        t.join(timeout=10)
        assert not t.is_alive()
    finally:
        s.stop()
