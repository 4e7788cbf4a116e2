"""Filtered scans and aggregates of a cluster table (`ramlog scan --table T --where/--fields/--sum`
through any server's native port): each tablet's part runs on its master (SCAN_TABLET), the CLI
merges them. Three servers on loopback; the records are written through the CLI in the schema's
encoding and every query is also evaluated here, in Python, over the records written: equal for
20 random predicates. Then a tablet splits (its old engine tablet holds copies of the upper
slots until they are cleaned up): no record is counted twice. And scans started right after a
master's kill -9 (its tablets unreachable, then recovering) count every record once."""

import json
import random
import signal
import struct
import subprocess

from conftest import Cluster, ramlog_bin

CLI_TIMEOUT = 60
FIELDS = ["a", "b", "c", "d"]  # i64, i64, f64, bool
OPS = ["<", "<=", "=", "!=", ">=", ">"]


def record(a: int, b: int, c: float, d: bool) -> bytes:
    # Format version 1, offset width code 0 (no variable fields), no NULLs, then the fixed area.
    return struct.pack("<BBqqdB", 1 << 2, 0, a, b, c, 1 if d else 0)


def ramlog(*args, check=True, input=None):
    out = subprocess.run([ramlog_bin(), *args], capture_output=True, timeout=CLI_TIMEOUT, input=input)
    if check:
        assert out.returncode == 0, f"ramlog {' '.join(args)}: exit {out.returncode}: {out.stderr.decode()}"
    return out


def holds(rec: dict, field: str, op: str, const) -> bool:
    v = rec[field]
    return {"<": v < const, "<=": v <= const, "=": v == const, "!=": v != const,
            ">=": v >= const, ">": v > const}[op]


def random_cnf(rng: random.Random):
    """A CNF of 1-2 clauses of 1-2 predicates: (text for --where flags, Python test)."""
    clauses = []
    for _ in range(rng.randint(1, 2)):
        preds = []
        for _ in range(rng.randint(1, 2)):
            field = rng.choice(FIELDS)
            if field == "d":
                op, const = rng.choice(["=", "!="]), rng.choice([True, False])
            elif field == "c":
                op, const = rng.choice(OPS), round(rng.uniform(-50, 50), 1)
            else:
                op, const = rng.choice(OPS), rng.randint(-60, 60)
            preds.append((field, op, const))
        clauses.append(preds)

    def text(p):
        field, op, const = p
        if isinstance(const, bool):
            const = "true" if const else "false"
        return f"{field} {op} {const}"

    flags = []
    for clause in clauses:
        flags += ["--where", " | ".join(text(p) for p in clause)]
    return flags, lambda r: all(any(holds(r, *p) for p in clause) for clause in clauses)


def aggregates(out: str) -> dict:
    got = {}
    for line in out.splitlines():
        name, value = line.rsplit(" ", 1)
        got[name] = value
    return got


def test_filtered_scans_and_aggregates_of_a_cluster_table_equal_python(tmp_path):
    c = Cluster(tmp_path, servers=3, coordinator_args=["--split-mib", "0"])
    try:
        created = ramlog("table", "create", "points", "--schema", "a:i64,b:i64,c:f64,d:bool",
                         "--coordinator", c.coordinator_addr).stdout.decode()
        table = created.split(" id=")[1].split()[0]
        rng = random.Random(51)
        records = {}
        for i in range(400):
            key = f"p{i}"
            r = {"a": rng.randint(-100, 100), "b": rng.randint(-100, 100),
                 "c": round(rng.uniform(-100, 100), 3), "d": rng.random() < 0.5}
            records[key] = r
            port = c.servers[i % 3].native
            ramlog("set", "-p", str(port), "--table", table, key, "-",
                   input=record(r["a"], r["b"], r["c"], r["d"]))
        status = json.loads(ramlog("cluster", "status", "--json", "--coordinator", c.coordinator_addr).stdout)
        tablets = next(t for t in status["tables"] if t["name"] == "points")["tablets"]
        assert len({t["master"] for t in tablets}) == 3, tablets

        def check(rounds, seed):
            qrng = random.Random(seed)
            for n in range(rounds):
                flags, test = random_cnf(qrng)
                port = str(c.servers[n % 3].native)
                chosen = {k: r for k, r in records.items() if test(r)}
                out = ramlog("scan", "-p", port, "--table", table, *flags, "--count-records",
                             "--sum", "a", "--min", "b", "--max", "c").stdout.decode()
                got = aggregates(out)
                want = {
                    "count": str(len(chosen)),
                    "sum(a)": str(sum(r["a"] for r in chosen.values())) if chosen else "null",
                    "min(b)": str(min(r["b"] for r in chosen.values())) if chosen else "null",
                }
                assert {k: got.get(k) for k in want} == want, (flags, out)
                if chosen:
                    assert float(got["max(c)"]) == max(r["c"] for r in chosen.values()), (flags, out)
                else:
                    assert got["max(c)"] == "null", (flags, out)
                rows = ramlog("scan", "-p", port, "--table", table, *flags, "--fields", "a,d",
                              "--count", "7").stdout.decode().splitlines()
                want_rows = sorted(f"{k}\ta={r['a']} d={'true' if r['d'] else 'false'}" for k, r in chosen.items())
                assert sorted(rows) == want_rows, (flags, len(rows), len(want_rows))

        check(20, 1)
        # A key filter and a limit go to every tablet too.
        out = ramlog("scan", "-p", str(c.servers[0].native), "--table", table, "--prefix", "p1",
                     "--count-records").stdout.decode()
        assert out.strip() == f"count {sum(1 for k in records if k.startswith('p1'))}", out

        # A tablet splits: its old engine tablet keeps the upper slots' copies a moment; a scan
        # counts each record once.
        t = tablets[0]
        ramlog("cluster", "split", "points", str(t["first_slot"]), "--coordinator", c.coordinator_addr)
        check(5, 2)
        out = ramlog("scan", "-p", str(c.servers[1].native), "--table", table, "--count-records").stdout.decode()
        assert out.strip() == f"count {len(records)}", out
    finally:
        c.stop()


def test_a_cluster_scan_started_while_a_master_is_recovering_counts_every_record_once(tmp_path):
    # A master is killed -9 just before the scans: its tablets are recovering when they start,
    # their masters refuse (or the map shows them recovering), and each scan starts again from a
    # newer map until every tablet is served: the count is exact, nothing twice or missed.
    c = Cluster(tmp_path, servers=3, coordinator_args=["--split-mib", "0"])
    try:
        created = ramlog("table", "create", "points", "--schema", "a:i64,b:i64,c:f64,d:bool",
                         "--coordinator", c.coordinator_addr).stdout.decode()
        table = created.split(" id=")[1].split()[0]
        total = 0
        for i in range(300):
            ramlog("set", "-p", str(c.servers[i % 3].native), "--table", table, f"q{i}", "-",
                   input=record(i, -i, i / 2, i % 2 == 0))
            total += i
        status = json.loads(ramlog("cluster", "status", "--json", "--coordinator", c.coordinator_addr).stdout)
        tablets = next(t for t in status["tables"] if t["name"] == "points")["tablets"]
        victim_id = tablets[0]["master"]
        victim = next(i for i, s in enumerate(c.servers)
                      if any(x["id"] == victim_id and x["addresses"]["native"].endswith(f":{s.native}")
                             for x in status["servers"]))
        c.servers[victim].proc.send_signal(signal.SIGKILL)
        c.servers[victim].proc.wait(timeout=5)
        survivor = next(i for i in range(3) if i != victim)
        out = ramlog("scan", "-p", str(c.servers[survivor].native), "--table", table,
                     "--count-records", "--sum", "a").stdout.decode()
        assert aggregates(out) == {"count": "300", "sum(a)": str(total)}, out
        rows = ramlog("scan", "-p", str(c.servers[survivor].native), "--table", table,
                      "--fields", "a", "--keys-only").stdout.decode().split()
        assert sorted(rows) == sorted(f"q{i}" for i in range(300)), len(rows)
    finally:
        c.stop()


def test_ramlog_scan_and_agg_from_redis_clients_equal_python(tmp_path):
    # RAMLOG.AGG and RAMLOG.SCAN through the routing port (plain redis-py, RESP2 and RESP3), the
    # cluster port (redis-cli) and over the table Redis commands use (the empty key included).
    import redis
    c = Cluster(tmp_path, servers=3, coordinator_args=["--split-mib", "0"])
    try:
        created = ramlog("table", "create", "points", "--schema", "a:i64,b:i64,c:f64,d:bool",
                         "--coordinator", c.coordinator_addr).stdout.decode()
        table_id = created.split(" id=")[1].split()[0]
        # By name through Redis clients, by id through the CLI.
        table = "points"
        rng = random.Random(7)
        records = {}
        for i in range(120):
            r = {"a": rng.randint(-50, 50), "b": rng.randint(-50, 50),
                 "c": round(rng.uniform(-50, 50), 2), "d": rng.random() < 0.5}
            records[f"r{i}"] = r
            ramlog("set", "-p", str(c.servers[i % 3].native), "--table", table_id, f"r{i}", "-",
                   input=record(r["a"], r["b"], r["c"], r["d"]))
        chosen = {k: r for k, r in records.items() if r["a"] >= 0 and (r["d"] or r["b"] < 10)}
        r2 = redis.Redis(host="127.0.0.1", port=c.servers[1].routing, socket_timeout=30, protocol=2)
        r3 = redis.Redis(host="127.0.0.1", port=c.servers[2].routing, socket_timeout=30, protocol=3)
        where = ["WHERE", "a >= 0", "WHERE", "d = true | b < 10"]
        flat = r2.execute_command("RAMLOG.AGG", table, *where, "COUNT", "SUM", "a", "MIN", "b", "MAX", "c")
        got = dict(zip(flat[0::2], flat[1::2]))
        assert got[b"count"] == len(chosen), got
        assert got[b"sum(a)"] == sum(r["a"] for r in chosen.values()), got
        assert got[b"min(b)"] == min(r["b"] for r in chosen.values()), got
        assert float(got[b"max(c)"]) == max(r["c"] for r in chosen.values()), got
        as_map = r3.execute_command("RAMLOG.AGG", table, *where, "COUNT", "NOSNAPSHOT")
        assert as_map == {b"count": len(chosen)} or as_map == {"count": len(chosen)}, as_map

        matched, rows = r2.execute_command("RAMLOG.SCAN", table, *where, "FIELDS", "a,d", "LIMIT", "7")
        assert matched == len(chosen), matched
        assert len(rows) == 7, rows
        want = {k: f"a={r['a']} d={'true' if r['d'] else 'false'}" for k, r in chosen.items()}
        for key, value in rows:
            assert want[key.decode()] == value.decode(), (key, value)
        matched, rows = r2.execute_command("RAMLOG.SCAN", table, *where, "LIMIT", "1000")
        assert sorted(k.decode() for k, _ in rows) == sorted(chosen), len(rows)

        # Averages and groups: each tablet sends sums and counts, merged here and on the server.
        def mean(xs):
            return sum(xs) / len(xs) if xs else None
        groups = r2.execute_command("RAMLOG.AGG", table, *where, "GROUPBY", "d", "COUNT", "AVG", "a", "AVG", "c")
        want_groups = []
        for d in (False, True):
            rows_d = [r for r in chosen.values() if r["d"] == d]
            if rows_d:
                want_groups.append((d, len(rows_d), mean([r["a"] for r in rows_d]), mean([r["c"] for r in rows_d])))
        assert len(groups) == len(want_groups), groups
        for got_g, (d, n, avg_a, avg_c) in zip(groups, want_groups):
            assert got_g[0] == (1 if d else 0), got_g
            assert got_g[1:3] == [b"count", n], got_g
            assert got_g[3] == b"avg(a)" and abs(float(got_g[4]) - avg_a) < 1e-9, (got_g, avg_a)
            assert got_g[5] == b"avg(c)" and abs(float(got_g[6]) - avg_c) < 1e-9, (got_g, avg_c)
        lines = ramlog("scan", "-p", str(c.servers[2].native), "--table", table_id, "--group-by", "b",
                       "--count-records", "--avg", "c", "--groups-max", "200").stdout.decode().splitlines()
        by_b = {}
        for r in records.values():
            by_b.setdefault(r["b"], []).append(r["c"])
        assert len(lines) == len(by_b), (len(lines), len(by_b))
        for line, b in zip(lines, sorted(by_b)):
            name, count, avg = line.split("\t")
            assert name == f"b={b}" and count == f"count {len(by_b[b])}", line
            assert abs(float(avg.split()[1]) - mean(by_b[b])) < 1e-9, (line, mean(by_b[b]))
        # More groups than the bound: a clear error, not a cut-off answer.
        too_many = ramlog("scan", "-p", str(c.servers[2].native), "--table", table_id, "--group-by", "b",
                          "--count-records", "--groups-max", "5", check=False)
        assert too_many.returncode != 0 and b"groups" in too_many.stderr, too_many
        try:
            r2.execute_command("RAMLOG.AGG", table, "GROUPBY", "a", "MAXGROUPS", "3", "COUNT")
            raise AssertionError("more groups than MAXGROUPS answered no error")
        except redis.exceptions.ResponseError as e:
            assert "groups" in str(e), e

        out = subprocess.run(["redis-cli", "-p", str(c.servers[0].resp), "RAMLOG.AGG", table, "COUNT"],
                             capture_output=True, timeout=30).stdout.decode()
        assert out.split() == ["count", str(len(records))], out

        # The table Redis commands use, the empty key among its keys.
        plain = redis.Redis(host="127.0.0.1", port=c.servers[0].routing, socket_timeout=30, protocol=2)
        for n in range(50):
            plain.set(f"k:{n}", f"v{n}")
        plain.set("", "empty")
        matched, rows = plain.execute_command("RAMLOG.SCAN", "0", "LIMIT", "100")
        assert matched == 51, matched
        assert dict((k, v) for k, v in rows) == {**{f"k:{n}".encode(): f"v{n}".encode() for n in range(50)},
                                                 b"": b"empty"}
        assert plain.execute_command("RAMLOG.AGG", "0", "PREFIX", "k:", "COUNT") == [b"count", 50]

        # Bad input: a clear error, and the connection goes on.
        for bad in (["RAMLOG.AGG", table], ["RAMLOG.AGG", "nosuch", "COUNT"],
                    ["RAMLOG.SCAN", table, "WHERE", "zz > 1"], ["RAMLOG.SCAN", table, "LIMIT", "0"],
                    ["RAMLOG.SCAN", table, "BOGUS", "1"], ["RAMLOG.SCAN"]):
            try:
                r2.execute_command(*bad)
                raise AssertionError(f"{bad} answered no error")
            except redis.exceptions.ResponseError as e:
                assert str(e), bad
        assert r2.ping()
    finally:
        c.stop()


def test_scans_through_a_tablet_move_count_every_key_once(tmp_path):
    # 4 servers, R = 2, copies slowed to 256 KiB/s: the tablet of slot 0 (1.5 MB) moves to a
    # server that neither masters nor backs it up while scans at cluster snapshots (and, every
    # other one, at each master's own snapshot) run back to back through the copy, the switch
    # and after. Each counts every key exactly once and lists each key once.
    from test_failures import status
    from test_migration import keys_in, outsider, tablet_at
    from test_recovery_kills import preload
    config = tmp_path / "slow-copy.toml"
    config.write_text("recovery_copy_bytes_per_sec = 262144\n")
    c = Cluster(tmp_path, servers=4, extra_args=("--config", str(config)),
                coordinator_args=["--default-replicas", "2", "--split-mib", "0"])
    try:
        st = status(c)
        t = tablet_at(st, 0)
        moving = keys_in(t, 1500, "m:")
        others = [f"m:o{i}" for i in range(1500)]
        value = lambda k: (k.encode() * 100)[:1000]  # noqa: E731
        preload(c, moving + others, value)
        everything = sorted(moving + others)
        target = outsider(st, t)
        out = subprocess.run([ramlog_bin(), "cluster", "move", "default", "0", "--to", str(target), "--no-wait",
                              "--coordinator", c.coordinator_addr], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stdout + out.stderr
        phases = {}
        n = 0
        while True:
            phase = (tablet_at(status(c), 0).get("migration") or {}).get("phase", "done")
            flags = ["--no-snapshot"] if n % 2 else []
            port = str(c.servers[n % 4].native)
            count = ramlog("scan", "-p", port, "--prefix", "m:", "--count-records", *flags).stdout.decode()
            assert count.strip() == f"count {len(everything)}", (phase, flags, count)
            keys = ramlog("scan", "-p", port, "--prefix", "m:", "--keys-only", *flags).stdout.decode().split()
            assert sorted(keys) == everything, (phase, flags, len(keys), len(set(keys)))
            phases[phase] = phases.get(phase, 0) + 1
            n += 1
            if phase == "done" and phases["done"] >= 3:
                break
            assert n < 500, phases
        print("scans per phase of the move", phases)
        assert tablet_at(status(c), 0)["master"] == target
        assert phases.get("copying", 0) >= 3, phases
    finally:
        c.stop()


def test_scans_of_a_mirrored_table_read_the_mirrors_and_equal_python(tmp_path):
    # A table in `mirror` mode: `--from-mirror` (and RAMLOG.AGG ... MIRROR) read every tablet on
    # its mirror. The answers equal Python's over the records written (also after more writes),
    # and the mirrors served every tablet's part (their `ramlog_mirror_scans_total`).
    import urllib.request
    import redis
    from test_failures import status
    from test_mirror import server_status
    from conftest import wait_until
    c = Cluster(tmp_path, servers=3, coordinator_args=["--split-mib", "0"])
    try:
        created = ramlog("table", "create", "points", "--mode", "mirror", "--schema", "a:i64,b:i64,c:f64,d:bool",
                         "--coordinator", c.coordinator_addr).stdout.decode()
        table_id = created.split(" id=")[1].split()[0]

        def table_of(st):
            return next(t for t in st["tables"] if t["name"] == "points")

        def mirrors_ready():
            st = status(c)
            tablets = table_of(st)["tablets"]
            if any(t["mirror"] is None for t in tablets):
                return False
            ready = set()
            for i in range(3):
                for m in server_status(c, i)["metrics"]["replication"]["mirrors"]:
                    if m["state"] == "ready":
                        ready.add(m["first_slot"])
            return all(t["first_slot"] in ready for t in tablets)
        assert wait_until(mirrors_ready, timeout=30, interval=0.1)
        records = {}
        rng = random.Random(9)

        def write(n0, n1):
            for i in range(n0, n1):
                r = {"a": rng.randint(-50, 50), "b": rng.randint(-50, 50),
                     "c": round(rng.uniform(-50, 50), 2), "d": rng.random() < 0.5}
                records[f"m{i}"] = r
                ramlog("set", "-p", str(c.servers[i % 3].native), "--table", table_id, f"m{i}", "-",
                       input=record(r["a"], r["b"], r["c"], r["d"]))
        write(0, 90)
        st = status(c)
        tablets = len(table_of(st)["tablets"])
        ports = [int(s["addresses"]["admin"].rsplit(":", 1)[1]) for s in st["servers"]]

        def mirror_scans():
            total = 0
            for port in ports:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    for line in r.read().decode().splitlines():
                        if line.startswith("ramlog_mirror_scans_total "):
                            total += int(line.split()[-1])
            return total

        def check():
            before = mirror_scans()
            chosen = [r for r in records.values() if r["a"] >= 0]
            out = ramlog("scan", "-p", str(c.servers[0].native), "--table", table_id, "--where", "a >= 0",
                         "--count-records", "--sum", "b", "--from-mirror").stdout.decode()
            assert aggregates(out) == {"count": str(len(chosen)), "sum(b)": str(sum(r["b"] for r in chosen))}, out
            keys = ramlog("scan", "-p", str(c.servers[1].native), "--table", table_id, "--keys-only",
                          "--fields", "a", "--from-mirror").stdout.decode().split()
            assert sorted(keys) == sorted(records), len(keys)
            r2 = redis.Redis(host="127.0.0.1", port=c.servers[2].routing, socket_timeout=30, protocol=2)
            got = r2.execute_command("RAMLOG.AGG", "points", "COUNT", "MIRROR")
            assert got == [b"count", len(records)], got
            # Every tablet of the three scans was read on its mirror (every mirror was ready).
            assert mirror_scans() - before == 3 * tablets, (before, mirror_scans(), tablets)
        check()
        write(90, 150)
        check()
    finally:
        c.stop()


def test_a_resumable_scan_continues_through_other_servers_and_a_kill(tmp_path):
    # RAMLOG.SCAN ... CURSOR steps through the table like Redis SCAN. Each step goes to another
    # server's port (routing ports and a cluster port: other processes continue the cursor,
    # which no server holds), and a master is killed -9 after a third of the steps: every key
    # comes back exactly once.
    import redis
    from redis.cluster import RedisCluster
    from test_failures import server_id_of, status, wait_declared_dead
    c = Cluster(tmp_path, servers=3, coordinator_args=["--split-mib", "0"])
    try:
        rc = RedisCluster(host="127.0.0.1", port=c.servers[0].resp, socket_timeout=10)
        pipe = rc.pipeline(transaction=False)
        expected = [f"c:{n}" for n in range(3000)]
        for k in expected:
            pipe.set(k, k)
        pipe.execute()
        rc.set("other", "x")
        st = status(c)
        victim = 0
        victim_id = server_id_of(c, st, victim)
        ports = [("routing", 1), ("resp", 2), ("routing", 2), ("routing", 0)]
        got = []
        cursor = b"0"
        steps = 0
        killed = False
        while True:
            kind, i = ports[steps % len(ports)]
            if killed and i == victim:
                kind, i = "routing", 1
            r = redis.Redis(host="127.0.0.1", port=getattr(c.servers[i], kind), socket_timeout=60, protocol=2)
            cursor, rows = r.execute_command("RAMLOG.SCAN", "0", "PREFIX", "c:", "CURSOR", cursor, "COUNT", "100")
            r.close()
            got.extend(k.decode() for k, v in rows)
            assert all(k == v for k, v in rows)
            steps += 1
            if cursor == b"0":
                break
            if steps == 6 and not killed:
                c.servers[victim].proc.send_signal(signal.SIGKILL)
                c.servers[victim].proc.wait(timeout=5)
                wait_declared_dead(c, victim_id)
                killed = True
            assert steps < 2000
        assert killed
        assert len(got) == len(set(got)), len(got) - len(set(got))
        assert sorted(got) == sorted(expected), (len(got), len(expected))
        print("steps", steps)
        # A cursor no scan gave out is an error, not a scan from somewhere.
        r = redis.Redis(host="127.0.0.1", port=c.servers[1].routing, socket_timeout=30, protocol=2)
        try:
            r.execute_command("RAMLOG.SCAN", "0", "CURSOR", str(1 << 40))
            raise AssertionError("a bad cursor answered no error")
        except redis.exceptions.ResponseError as e:
            assert "cursor" in str(e), e
    finally:
        c.stop()
