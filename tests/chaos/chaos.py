#!/usr/bin/env python3
"""Fault injection with recorded histories: starts a real cluster on this machine (coordinator
members and servers, each in a network namespace of its own), drives a recorded client load
(`chaos-client run`), injects faults from a seed, heals, reads every key (`chaos-client final`)
and checks the history against the table mode's promise (`chaos-client check`).

Faults, one at a time, each followed by a wait until the cluster has healed and re-protected its
tablets (the promises are those of one failure at a time):
  kill_server, kill_coordinator   kill -9, then a restart after a while (same data directory)
  pause_server                    SIGSTOP, then SIGCONT (a slow server, not a dead one)
  partition_from_coordinators     a server cut off from every coordinator member
  partition_from_servers          a server cut off from the other servers
  isolate_server                  a server cut off from everyone but the clients
  isolate_coordinator             a coordinator member cut off from everyone
  disk_full                       a server's data directory (a tmpfs of its own) filled
  clock_jump                      a server's wall clock stepped (libfaketime; the monotonic clock,
                                  which the leases use, is left alone: a pause is its jump)
  kill_during_restore             kill -9 a master; once one of its tablets is being restored,
                                  kill -9 another server that is not the restorer; restart both
  kill_restorer                   kill -9 a server; once one of its tablets is being restored,
                                  kill -9 its restorer; restart both
  migrate                         `ramlog cluster move` of a random tablet to another server,
                                  waited for (the source freezes, drains and switches under load)
  migrate_kill                    a move started, then kill -9 of its source or its target at
                                  once (the move is abandoned or ends in a recovery); restart
  drain                           a fresh server joins on a spare host (add_server), then
                                  `ramlog cluster drain` of a server (its tablets move to the
                                  others, then it leaves and stops), then a rebalance
  split                           `ramlog cluster split` of a random tablet at the middle of its
                                  slots, waited for; or (half the time) started, then kill -9 of
                                  its master while it copies or switches (the split is abandoned
                                  and the whole tablet recovers, or its halves recover); restart.
                                  Skipped for mirrored tables (they do not split)
  merge                           a split as above (waited for), then, once both halves are
                                  copied to their backups, `ramlog cluster merge` of the halves:
                                  waited for; or (half the time) started, then kill -9 of their
                                  master while it copies or joins them; restart. Skipped for
                                  mirrored tables
The two restore faults need a restore running: restores are held back --restore-delay-ms (a test knob of
the servers) to give them one. If none is seen running after the first kill, the fault is logged
as skipped (the first kill stands) and not counted among the faults done.
A server that stops after being fenced (it learns it was replaced) is started again.

Run i of a session with seed S uses seed S+i and mode MODES[i % len(MODES)]; the report prints
the command that replays any run alone with its fault schedule."""

import argparse
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from netns import Net  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAKETIME = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
KINDS = [
    "kill_server", "kill_coordinator", "pause_server", "partition_from_coordinators",
    "partition_from_servers", "isolate_server", "isolate_coordinator", "disk_full", "clock_jump", "kill_during_restore", "kill_restorer",
    "migrate", "migrate_kill", "drain", "split", "merge",
]
# How long a fault that needs a running restore looks for one after its first kill: detection
# (400 ms of silence and a probe) and the restore itself (held back --restore-delay-ms).
RESTORE_SEEN_WITHIN_S = 4.0
MODES = ["sync", "durable", "mirror", "async"]


def log(msg):
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def schedule(seed, seconds, servers, coordinators, kinds):
    """The faults of one run, from its seed: (start offset, kind, target, duration or offset)."""
    rng = random.Random(seed)
    t = 3.0
    out = []
    while t < seconds - 5:
        kind = rng.choice(kinds)
        f = {"at": round(t, 2), "kind": kind}
        if kind in ("kill_coordinator", "isolate_coordinator"):
            f["target"] = rng.randrange(coordinators)
        else:
            f["target"] = rng.randrange(servers)
        if kind == "pause_server":
            f["seconds"] = round(rng.choice([0.1, 0.3, 1.0, 2.0]) * rng.uniform(0.8, 1.2), 2)
        elif kind == "clock_jump":
            f["offset"] = rng.choice([-3600, -600, -30, -3, 3, 30, 600, 3600])
            f["seconds"] = round(rng.uniform(1, 3), 2)
        elif kind == "disk_full":
            f["seconds"] = round(rng.uniform(4.0, 8.0), 2)
        elif kind == "kill_during_restore":
            f["pick"] = rng.randrange(1000)  # which of the servers that are not the restorer
            f["seconds"] = round(rng.uniform(0.5, 3.0), 2)
        elif kind in ("migrate", "migrate_kill"):
            f["slot"] = rng.randrange(16384)
            f["victim"] = rng.choice(["source", "target"])
            f["seconds"] = round(rng.uniform(0.5, 3.0), 2)
        elif kind in ("split", "merge"):
            f["slot"] = rng.randrange(16384)
            f["kill_after"] = rng.choice([None, round(rng.uniform(0.0, 0.5), 2)])
            f["seconds"] = round(rng.uniform(0.5, 3.0), 2)
        else:
            f["seconds"] = round(rng.uniform(0.5, 3.0), 2)
        out.append(f)
        t += f["seconds"] + rng.uniform(2, 4)
    return out


class Proc:
    """One ramlog process; `start()` waits (bounded) for its `ready` line."""

    def __init__(self, name, args, logfile, prefix=(), env=None):
        self.name, self.args, self.logfile, self.prefix, self.env = name, args, logfile, prefix, env
        self.p = None
        self.stopped = False

    def start(self, binary, timeout=20.0):
        logf = open(self.logfile, "a")
        self.p = subprocess.Popen([*self.prefix, binary, *self.args], stdout=subprocess.PIPE, stderr=logf,
                                  env=None if self.env is None else {**os.environ, **self.env})
        logf.close()
        self.stopped = False
        deadline = time.time() + timeout
        line = b""
        while time.time() < deadline and self.p.poll() is None:
            r, _, _ = select.select([self.p.stdout], [], [], 0.2)
            if r:
                line = self.p.stdout.readline()
                break
        if b"ready" not in line:
            self.kill()
            self.stopped = True
            raise RuntimeError(f"{self.name} did not start: {line!r}; see {self.logfile}")

    def alive(self):
        return self.p is not None and self.p.poll() is None

    def signal(self, sig):
        if self.alive():
            os.kill(self.p.pid, sig)

    def kill(self):
        if self.p is None:
            return
        if self.alive():
            os.kill(self.p.pid, signal.SIGCONT)
            self.p.kill()
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class Run:
    def __init__(self, args, index, mode, seed, out):
        self.args, self.index, self.mode, self.seed, self.out = args, index, mode, seed, out
        self.binary = args.bin
        self.net = None
        self.coords, self.servers, self.mounts = [], [], []
        self.load = None
        self.events = []  # what was done, when
        self.disk_errors = 0  # out-of-space errors the servers logged while a disk was full
        self.problems = []  # crashes and heal failures: violations besides the checker's
        self.t0 = time.time()

    # ---- cluster ---------------------------------------------------------------------------

    def up(self):
        a = self.args
        # One host more than servers: the spare, where `drain` starts the server that joins.
        self.net = Net(a.servers + 1, coordinators=a.coordinators)
        self.spare = self.net.servers[a.servers]
        cports = [free_port() for _ in range(a.coordinators)]
        self.coord_addrs = [f"{h.ip}:{p}" for h, p in zip(self.net.coordinators, cports)]
        members = ",".join(f"{m + 1}={addr}" for m, addr in enumerate(self.coord_addrs))
        for m, host in enumerate(self.net.coordinators):
            args = ["coordinator", "--id", str(m + 1), "--listen", self.coord_addrs[m], "--members", members,
                    "--data-dir", str(self.out / f"coordinator-{m + 1}"), "--initial-servers", str(a.servers),
                    "--default-mode", self.mode]
            self.coords.append(Proc(f"coordinator {m + 1}", args, self.out / f"coordinator-{m + 1}.log",
                                    prefix=host.exec))
        for c in self.coords:
            c.start(self.binary)
        for i, host in enumerate(self.net.servers[:a.servers]):
            data = self.out / f"server-{i}"
            data.mkdir()
            self._mount(data)
            clock = self.out / f"clock-{i}"
            clock.write_text("+0\n")
            env = {"LD_PRELOAD": FAKETIME, "FAKETIME_TIMESTAMP_FILE": str(clock), "FAKETIME_CACHE_DURATION": "1",
                   "DONT_FAKE_MONOTONIC": "1", "RAMLOG_TEST_RESTORE_DELAY_MS": str(a.restore_delay_ms)}
            s = Proc(f"server {i}", ["server", "--coordinator", ",".join(self.coord_addrs), "--bind", host.ip,
                                     "--resp-port", str(free_port()), "--routing-port", str(free_port()),
                                     "--native-port", str(free_port()), "--admin-port", str(free_port()),
                                     "--data-dir", str(data), "--memory", a.memory],
                     self.out / f"server-{i}.log", prefix=host.exec, env=env)
            s.host, s.data, s.clock = host, data, clock
            s.resp = int(s.args[s.args.index("--resp-port") + 1])
            self.servers.append(s)
            s.start(self.binary)
        if not self.wait_settled(60):
            raise RuntimeError("the cluster did not come up: " + json.dumps(self.status())[:2000])

    def _mount(self, path):
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.args.disk_mb}m", "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"cannot mount a tmpfs at {path} (needs root): {r.stderr.strip()}")
        self.mounts.append(path)

    def down(self):
        if self.load is not None and self.load.poll() is None:
            self.load.kill()
        for p in self.servers + self.coords:
            p.kill()
        for m in self.mounts:
            if subprocess.run(["umount", str(m)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(m)], capture_output=True)
        self.mounts = []
        if self.net is not None:
            self.net.close()
            self.net = None

    def status(self):
        try:
            r = subprocess.run([self.binary, "cluster", "status", "--json", "--coordinator", ",".join(self.coord_addrs)],
                               capture_output=True, text=True, timeout=10)
            return json.loads(r.stdout) if r.returncode == 0 else None
        except (subprocess.TimeoutExpired, json.JSONDecodeError):
            return None

    def wait_settled(self, timeout):
        """Until every server is up, no tablet recovers and no copy is pending."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.restart_exited()
            st = self.status()
            if st and st.get("recovering_tablets") == 0 and st.get("pending_copies") == 0 and \
                    sum(1 for s in st["servers"] if s["state"] == "up") == len(self.servers) and \
                    all(s.alive() for s in self.servers):
                return True
            time.sleep(0.2)
        return False

    def restart_exited(self):
        for s in self.servers + self.coords:
            if s.p is not None and not s.alive() and not s.stopped:
                code = s.p.returncode
                self.note(f"{s.name} exited with {code}; starting it again")
                if code not in (0, -signal.SIGKILL):
                    self.problems.append(f"{s.name} exited with status {code} (see {s.logfile})")
                try:
                    s.start(self.binary)
                except RuntimeError as e:
                    self.note(str(e))

    @staticmethod
    def tail(p):
        lines = Path(p.logfile).read_text(errors="replace").strip().splitlines()
        return lines[-1][-300:] if lines else ""

    def note(self, what):
        self.events.append((round(time.time() - self.t0, 2), what))
        log(f"run {self.index}: {what}")

    # ---- faults ----------------------------------------------------------------------------

    def server_index(self, st, server_id):
        """The index in `self.servers` of the server with id `server_id` in status `st`, or None."""
        s = next((s for s in st["servers"] if s["id"] == server_id), None)
        if s is None:
            return None
        resp = s["addresses"]["resp"]
        return next((j for j, p in enumerate(self.servers) if f"{p.host.ip}:{p.resp}" == resp), None)

    def restore_running(self, dead):
        """(tablet's first slot, restorer's index) of a tablet whose master is server `dead` and
        that a live server restores, or None."""
        st = self.status()
        for table in (st or {}).get("tables", []):
            for t in table["tablets"]:
                if t["recovering"] and t["restorer"] is not None:
                    master, restorer = self.server_index(st, t["master"]), self.server_index(st, t["restorer"])
                    if master == dead and restorer is not None and restorer != dead:
                        return t["first_slot"], restorer
        return None

    def kill_during_restore(self, f):
        """kill -9 server `target`, then, once one of its tablets is being restored, the restorer
        (`kill_restorer`) or another server (`kill_during_restore`); both start again after
        `seconds`. Returns False (skipped) when no restore was seen running."""
        kind, secs = f["kind"], f["seconds"]
        # A server that masters no tablet (one started again after an earlier fault masters none
        # until tablets are moved to it) has nothing to restore: the first from `target` on that does.
        st = self.status() or {}
        mastering = {self.server_index(st, t["master"]) for table in st.get("tables", [])
                     for t in table["tablets"] if not t["recovering"]}
        n = len(self.servers)
        i = next((j % n for j in range(f["target"], f["target"] + n) if j % n in mastering), f["target"])
        first = self.servers[i]
        first.stopped = True
        first.kill()
        self.note(f"{kind}: kill -9 server {i}")
        deadline = time.time() + RESTORE_SEEN_WITHIN_S
        running = None
        while running is None and time.time() < deadline:
            running = self.restore_running(i)
            if running is None:
                time.sleep(0.02)
        killed = [first]
        if running is None:
            self.note(f"{kind} skipped: no restore of server {i}'s tablets seen running within "
                      f"{RESTORE_SEEN_WITHIN_S} s (the kill of server {i} stands)")
        else:
            first_slot, restorer = running
            if kind == "kill_restorer":
                j = restorer
            else:
                others = [j for j in range(len(self.servers)) if j not in (i, restorer)]
                j = others[f["pick"] % len(others)]
            second = self.servers[j]
            second.stopped = True
            second.kill()
            killed.append(second)
            what = "the restorer" if j == restorer else f"not the restorer (server {restorer})"
            self.note(f"{kind}: kill -9 server {j}, {what}, while the tablet at slot {first_slot} is restored")
        time.sleep(secs)
        for p in killed:
            p.start(self.binary)
            self.note(f"{p.name} restarted")
        return running is not None

    def migrate(self, f):
        """Moves the tablet holding `slot` to server `target` (the next one if that masters it)
        and waits for it; `migrate_kill` starts the move and kill -9s its source or its target
        at once, restarting it after `seconds`. False (skipped) when the tablet cannot move now."""
        st = self.status()
        if not st:
            return False
        table = next(t for t in st["tables"] if t["name"] == "default")
        t = next(t for t in table["tablets"] if t["first_slot"] <= f["slot"] <= t["last_slot"])
        source = self.server_index(st, t["master"])
        ids = {self.server_index(st, s["id"]): s["id"] for s in st["servers"] if s["state"] == "up"}
        to = next((j for j in ((f["target"] + k) % len(self.servers) for k in range(len(self.servers)))
                   if j in ids and j != source), None)
        if t["recovering"] or t.get("migration") or source is None or to is None:
            return False
        cmd = [self.binary, "cluster", "move", "default", str(f["slot"]), "--to", str(ids[to]),
               "--coordinator", ",".join(self.coord_addrs)]
        if f["kind"] == "migrate":
            r = subprocess.run(cmd + ["--timeout", "30"], capture_output=True, text=True, timeout=60)
            self.note(f"migrate slots {t['first_slot']}-{t['last_slot']} from server {source} to server {to}: "
                      + (r.stdout.strip() or r.stderr.strip())[-300:])
            return True
        r = subprocess.run(cmd + ["--no-wait"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            self.note(f"migrate_kill: the move was refused: {r.stderr.strip()[-300:]}")
            return False
        victim = self.servers[source if f["victim"] == "source" else to]
        victim.stopped = True
        victim.kill()
        self.note(f"migrate_kill: slots {t['first_slot']}-{t['last_slot']} moving from server {source} to "
                  f"server {to}; kill -9 the {f['victim']} ({victim.name})")
        time.sleep(f["seconds"])
        victim.start(self.binary)
        self.note(f"{victim.name} restarted")
        return True

    def split(self, f):
        """Splits the tablet holding `slot` at the middle of its slots and waits for it; with
        `kill_after` set, starts the split and kill -9s the tablet's master that many seconds
        later, restarting it after `seconds`. False (skipped) when the tablet cannot split now
        (one slot, recovering, moving, still copying to a backup, or a mirrored table)."""
        st = self.status()
        if not st:
            return False
        table = next(t for t in st["tables"] if t["name"] == "default")
        t = next(t for t in table["tablets"] if t["first_slot"] <= f["slot"] <= t["last_slot"])
        master = self.server_index(st, t["master"])
        if master is None:
            return False
        cmd = [self.binary, "cluster", "split", "default", str(f["slot"]), "--coordinator", ",".join(self.coord_addrs)]
        if f["kill_after"] is None:
            r = subprocess.run(cmd + ["--timeout", "30"], capture_output=True, text=True, timeout=60)
            self.note(f"split slots {t['first_slot']}-{t['last_slot']} on server {master}: "
                      + (r.stdout.strip() or r.stderr.strip())[-300:])
            return r.returncode == 0
        r = subprocess.run(cmd + ["--no-wait"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            self.note(f"split: refused: {r.stderr.strip()[-300:]}")
            return False
        time.sleep(f["kill_after"])
        victim = self.servers[master]
        victim.stopped = True
        victim.kill()
        self.note(f"split: slots {t['first_slot']}-{t['last_slot']} splitting on server {master}; "
                  f"kill -9 it {f['kill_after']} s later")
        time.sleep(f["seconds"])
        victim.start(self.binary)
        self.note(f"{victim.name} restarted")
        return True

    def merge(self, f):
        """Splits the tablet holding `slot` at the middle of its slots (waited for), then merges
        the halves back: the coordinator's leader merges small halves by itself once both are
        copied to their backups, else `ramlog cluster merge` asks for it once they are. Waited
        for (at most 30 s each); or, with `kill_after` set, their master is killed -9 that many
        seconds after the merge is seen started (restarted after `seconds`). False (skipped) when
        the split or the merge was refused or the halves did not settle."""
        st = self.status()
        if not st:
            return False
        table = next(t for t in st["tables"] if t["name"] == "default")
        t = next(t for t in table["tablets"] if t["first_slot"] <= f["slot"] <= t["last_slot"])
        first, last = t["first_slot"], t["last_slot"]
        coordinator = ",".join(self.coord_addrs)
        r = subprocess.run([self.binary, "cluster", "split", "default", str(f["slot"]), "--timeout", "30",
                            "--coordinator", coordinator], capture_output=True, text=True, timeout=60)
        self.note(f"merge: split slots {first}-{last} first: " + (r.stdout.strip() or r.stderr.strip())[-300:])
        if r.returncode != 0:
            return False

        def halves():
            st = self.status()
            if not st:
                return st, None
            table = next(t for t in st["tables"] if t["name"] == "default")
            return st, [x for x in table["tablets"] if first <= x["first_slot"] <= last]

        deadline = time.time() + 30
        asked = False
        while time.time() < deadline:
            st, hs = halves()
            if hs is None:
                time.sleep(0.2)
                continue
            if len(hs) == 1 and hs[0]["last_slot"] == last:
                self.note(f"merge: slots {first}-{last} merged by the coordinator's leader")
                return True
            if len(hs) == 2 and hs[0]["merge"]:
                break
            idle = len(hs) == 2 and hs[0]["master"] == hs[1]["master"] and all(
                not x["pending"] and x["logs_from"] is None and not x["recovering"]
                and x["migration"] is None for x in hs)
            if idle and not asked:
                asked = True
                r = subprocess.run([self.binary, "cluster", "merge", "default", str(first), "--no-wait",
                                    "--coordinator", coordinator], capture_output=True, text=True, timeout=30)
                self.note(f"merge slots {first}-{last}: " + (r.stdout.strip() or r.stderr.strip())[-300:])
                continue
            time.sleep(0.05)
        else:
            self.note(f"merge: the halves of slots {first}-{last} did not merge within 30 s: {hs}")
            return False
        master = self.server_index(st, hs[0]["master"])
        if master is None:
            return False
        if f["kill_after"] is None:
            deadline = time.time() + 30
            while time.time() < deadline:
                st, hs = halves()
                if hs and len(hs) == 1 and hs[0]["last_slot"] == last:
                    self.note(f"merge: slots {first}-{last} merged on server {master}")
                    return True
                if hs and len(hs) == 2 and not hs[0]["merge"]:
                    break
                time.sleep(0.1)
            self.note(f"merge: slots {first}-{last} did not merge: {hs}")
            return False
        time.sleep(f["kill_after"])
        victim = self.servers[master]
        victim.stopped = True
        victim.kill()
        self.note(f"merge: slots {first}-{last} merging on server {master}; kill -9 it {f['kill_after']} s later")
        time.sleep(f["seconds"])
        victim.start(self.binary)
        self.note(f"{victim.name} restarted")
        return True

    def drain(self, f):
        """A server joins (add_server): a fresh one on the spare host, with an empty data
        directory; then server `target` is drained (its tablets move to the others, the new one
        first; waited for) and stops, and the new one takes its place in `self.servers` (its host
        becomes the spare). A rebalance is asked for at the end (not waited for: the next fault
        waits until the cluster settles). False (skipped) when the server is not up or the drain
        was refused."""
        i = f["target"]
        old = self.servers[i]
        st = self.status()
        sid = next((x["id"] for x in (st or {}).get("servers", [])
                    if x["state"] == "up" and x["addresses"]["resp"] == f"{old.host.ip}:{old.resp}"), None)
        if sid is None:
            return False
        coordinator = ",".join(self.coord_addrs)
        gen = getattr(old, "generation", 0) + 1
        data = self.out / f"server-{i}-{gen}"
        data.mkdir()
        self._mount(data)
        host = self.spare
        args = list(old.args)
        for flag in ("--resp-port", "--routing-port", "--native-port", "--admin-port"):
            args[args.index(flag) + 1] = str(free_port())
        args[args.index("--bind") + 1] = host.ip
        args[args.index("--data-dir") + 1] = str(data)
        fresh = Proc(f"server {i}", args, self.out / f"server-{i}-{gen}.log", prefix=host.exec, env=old.env)
        fresh.host, fresh.data, fresh.clock, fresh.generation = host, data, old.clock, gen
        fresh.resp = int(args[args.index("--resp-port") + 1])
        fresh.start(self.binary)
        self.note(f"add_server: a fresh server joined on {host.ip}:{fresh.resp} to take server {i}'s place")
        old.stopped = True
        r = subprocess.run([self.binary, "cluster", "drain", str(sid), "--timeout", "60", "--coordinator", coordinator],
                           capture_output=True, text=True, timeout=90)
        self.note(f"drain server {i} (id {sid}): " + (r.stdout.strip() or r.stderr.strip())[-300:])
        if r.returncode != 0:
            # Refused or not finished: the old server stays, the new one too (as an extra).
            old.stopped = False
            self.servers.append(fresh)
            return False
        deadline = time.time() + 15
        while old.alive() and time.time() < deadline:
            time.sleep(0.05)
        if old.alive():
            self.problems.append(f"server {i} was drained but did not stop within 15 s")
        old.kill()
        self.servers[i] = fresh
        self.spare = old.host
        r = subprocess.run([self.binary, "cluster", "rebalance", "--no-wait", "--coordinator", coordinator],
                           capture_output=True, text=True, timeout=30)
        self.note("rebalance: " + (r.stdout.strip() or r.stderr.strip())[-200:])
        return True

    def inject(self, f):
        """Carries out fault `f`; False if it was skipped (its conditions did not arise)."""
        kind, i, secs = f["kind"], f["target"], f.get("seconds", 0)
        net = self.net
        if kind in ("kill_during_restore", "kill_restorer"):
            return self.kill_during_restore(f)
        if kind in ("migrate", "migrate_kill"):
            return self.migrate(f)
        if kind == "drain":
            return self.drain(f)
        if kind == "split":
            return self.split(f)
        if kind == "merge":
            return self.merge(f)
        if kind in ("kill_server", "kill_coordinator"):
            p = self.servers[i] if kind == "kill_server" else self.coords[i]
            p.stopped = True
            p.kill()
            self.note(f"kill -9 {p.name}")
            time.sleep(secs)
            p.start(self.binary)
            self.note(f"{p.name} restarted")
        elif kind == "pause_server":
            s = self.servers[i]
            s.signal(signal.SIGSTOP)
            self.note(f"SIGSTOP server {i} for {secs} s")
            time.sleep(secs)
            s.signal(signal.SIGCONT)
            self.note(f"SIGCONT server {i}")
        elif kind in ("partition_from_coordinators", "partition_from_servers", "isolate_server"):
            host = net.servers[i]
            others = {
                "partition_from_coordinators": net.coordinators,
                "partition_from_servers": [h for h in net.servers if h is not host],
                "isolate_server": net.coordinators + [h for h in net.servers if h is not host],
            }[kind]
            net.cut(host, others)
            self.note(f"{kind} server {i} for {secs} s")
            time.sleep(secs)
            net.heal()
            self.note("healed")
        elif kind == "isolate_coordinator":
            host = net.coordinators[i]
            net.cut(host, [h for h in net.coordinators if h is not host] + net.servers)
            self.note(f"isolate coordinator {i + 1} for {secs} s")
            time.sleep(secs)
            net.heal()
            self.note("healed")
        elif kind == "disk_full":
            # The stores preallocate their logs, so a disk that fills under a running server
            # changes nothing until a store needs new space: when a backup takes new tablets.
            # The server is therefore restarted while its disk is full (it rejoins as a fresh
            # backup and is sent copies), then the disk is freed.
            s = self.servers[i]
            ballast = s.data / "ballast"
            st = os.statvfs(s.data)
            free = st.f_bavail * st.f_frsize
            with open(ballast, "wb") as fh:
                try:
                    os.posix_fallocate(fh.fileno(), 0, max(free - 4096, 4096))
                except OSError:
                    pass
            logged = Path(s.logfile).stat().st_size
            self.note(f"disk of server {i} full ({free >> 20} MiB filled) for {secs} s")
            time.sleep(secs / 3)
            s.stopped = True
            s.kill()
            try:
                s.start(self.binary)
                self.note(f"server {i} restarted with its disk full")
            except RuntimeError:
                self.note(f"server {i} refused to start with its disk full: {self.tail(s)}")
            time.sleep(secs * 2 / 3)
            ballast.unlink()
            with open(s.logfile, "rb") as fh:
                fh.seek(logged)
                errors = sum(1 for line in fh if b"disk full" in line or b"No space left" in line)
            self.disk_errors += errors
            self.note(f"disk of server {i} freed; it logged {errors} out-of-space errors meanwhile")
            if not s.alive():
                s.start(self.binary)
                self.note(f"server {i} started")
        elif kind == "clock_jump":
            s = self.servers[i]
            s.clock.write_text(f"{f['offset']:+d}\n")
            self.note(f"wall clock of server {i} stepped {f['offset']:+d} s for {secs} s")
            time.sleep(secs)
            s.clock.write_text("+0\n")
            self.note(f"wall clock of server {i} back")
        return True

    # ---- one run ---------------------------------------------------------------------------

    def go(self):
        a = self.args
        faults = schedule(self.seed, a.run_seconds, a.servers, a.coordinators, a.faults)
        (self.out / "faults.json").write_text(json.dumps(faults, indent=1))
        self.up()
        nodes = ",".join(f"{s.host.ip}:{s.resp}" for s in self.servers)
        client = ROOT / "target" / "chaos-client"
        history = self.out / "history.jsonl"
        self.load = load = subprocess.Popen([str(client), "run", "--nodes", nodes, "--seed", str(self.seed),
                                 "--duration", f"{a.run_seconds}s", "--out", str(history)],
                                stdout=open(self.out / "client.log", "w"), stderr=subprocess.STDOUT)
        self.t0 = time.time()
        injected, skipped = [], []
        unsettled = 0
        try:
            for f in faults:
                while time.time() - self.t0 < f["at"]:
                    time.sleep(0.05)
                if time.time() - self.t0 + f.get("seconds", 0) > a.run_seconds - 2:
                    break
                (injected if self.inject(f) else skipped).append(f)
                if not self.wait_settled(60):
                    unsettled += 1
                    self.problems.append(f"not healed within 60 s after {f}: " + json.dumps(self.status())[:1500])
        finally:
            self.net.heal()
            for s in self.servers:
                s.signal(signal.SIGCONT)
                s.clock.write_text("+0\n")
                (s.data / "ballast").unlink(missing_ok=True)
        try:
            load.wait(timeout=a.run_seconds + 60)
        except subprocess.TimeoutExpired:
            load.kill()
            self.problems.append("the client load did not end")
        if not self.wait_settled(60):
            self.problems.append("the cluster did not heal after the run: " + json.dumps(self.status())[:1500])
        # The servers now (a drain replaces one with a server on other addresses).
        nodes = ",".join(f"{s.host.ip}:{s.resp}" for s in self.servers)
        final = subprocess.run([str(client), "final", "--nodes", nodes, "--history", str(history), "--limit", "60s"],
                               capture_output=True, text=True, timeout=300)
        if final.returncode != 0:
            self.problems.append("keys unreadable after healing: " + final.stdout[-2000:] + final.stderr[-2000:])
        self.down()
        for p in self.servers + self.coords:
            text = Path(p.logfile).read_text(errors="replace")
            if "panicked" in text:
                self.problems.append(f"{p.name} panicked (see {p.logfile})")
        check = subprocess.run([str(client), "check", "--mode", self.mode, "--history", str(history),
                                "--report", str(self.out)], capture_output=True, text=True, timeout=1800)
        (self.out / "report.txt").write_text(check.stdout + check.stderr)
        if check.returncode not in (0, 1):
            self.problems.append(f"the checker failed: {check.stderr[-2000:]}")
        report = json.loads((self.out / "report.json").read_text()) if (self.out / "report.json").exists() else {}
        counts, skips = {}, {}
        for f in injected:
            counts[f["kind"]] = counts.get(f["kind"], 0) + 1
        for f in skipped:
            skips[f["kind"]] = skips.get(f["kind"], 0) + 1
        return {
            "run": self.index, "mode": self.mode, "seed": self.seed, "faults": counts, "injected": injected,
            "skipped": skips,
            "operations": sum(report.get("operations", {}).values()), "keys": report.get("keys", 0),
            "keys_linearizable": report.get("keys_linearizable", 0),
            "keys_undecided": len(report.get("keys_undecided") or []),
            "violations": len(report.get("violations") or []), "problems": self.problems,
            "disk_errors_logged": self.disk_errors,
            "async_losses": report.get("async_losses") or {}, "events": self.events,
            "report": str(self.out / "report.txt"), "checker_head": check.stdout[:3000],
        }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=None, help="session seed (default: random, printed)")
    ap.add_argument("--minutes", type=float, default=3.0, help="runs start while this much time is left")
    ap.add_argument("--runs", type=int, default=0, help="stop after this many runs (0: as many as fit)")
    ap.add_argument("--run-seconds", type=int, default=40, help="load and faults per run")
    ap.add_argument("--modes", default=",".join(MODES), help="table modes, one per run in turn")
    ap.add_argument("--faults", default=",".join(KINDS), help="fault kinds to draw from")
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--coordinators", type=int, default=3)
    ap.add_argument("--memory", default="256MiB", help="each server's --memory")
    ap.add_argument("--disk-mb", type=int, default=2048, help="size of each server's tmpfs data directory")
    ap.add_argument("--restore-delay-ms", type=int, default=300,
                    help="restores wait this long before they replay (RAMLOG_TEST_RESTORE_DELAY_MS), so that "
                         "kill_during_restore and kill_restorer find one running")
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "ramlog"))
    ap.add_argument("--out", default=str(ROOT / "target" / "chaos"))
    args = ap.parse_args()
    args.faults = [k for k in args.faults.split(",") if k]
    bad = [k for k in args.faults if k not in KINDS]
    modes = [m for m in args.modes.split(",") if m]
    if bad or not args.faults or not modes or any(m not in MODES for m in modes):
        ap.error(f"faults from {KINDS}, modes from {MODES}")
    if os.geteuid() != 0:
        sys.exit("chaos: needs root (network namespaces, tmpfs mounts)")
    for need in (args.bin, FAKETIME, ROOT / "target" / "chaos-client"):
        if not Path(need).exists():
            sys.exit(f"chaos: {need} is missing (scripts/chaos builds the client; apt-get install faketime)")
    # A stop (SIGTERM, Ctrl-C) unwinds: each run's `finally` stops its processes, unmounts its
    # disks and deletes its namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    out = Path(args.out) / f"session-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    log(f"session seed {seed}; reports in {out}")
    results = []
    started = time.time()
    i = 0
    while True:
        if args.runs and i >= args.runs:
            break
        if not args.runs and i > 0 and time.time() - started + args.run_seconds + 30 > args.minutes * 60:
            break
        mode = modes[i % len(modes)]
        run_dir = out / f"run-{i}-{mode}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir()
        run = Run(args, i, mode, seed + i, run_dir)
        try:
            r = run.go()
        except Exception as e:  # a run that could not be carried out is a failure, not a pass
            r = {"run": i, "mode": mode, "seed": seed + i, "faults": {}, "operations": 0, "violations": 0,
                 "problems": [f"the run failed: {type(e).__name__}: {e}"], "events": run.events}
        finally:
            run.down()
        r["replay"] = (f"scripts/chaos --seed {seed + i} --runs 1 --modes {mode} --run-seconds {args.run_seconds} "
                       f"--faults {','.join(args.faults)}")
        results.append(r)
        log(f"run {i} ({mode}, seed {seed + i}): {r['operations']} operations, faults {r['faults']}, "
            f"skipped {r.get('skipped', {})}, "
            f"{r['violations']} violations, {len(r['problems'])} problems")
        if r["violations"] or r["problems"]:
            log(r.get("checker_head", "")[:3000])
            for p in r["problems"]:
                log("PROBLEM " + p[:2000])
            log("replay: " + r["replay"])
        i += 1
    summary = {
        "seed": seed, "runs": len(results),
        "operations": sum(r["operations"] for r in results),
        "faults": sum(sum(r["faults"].values()) for r in results),
        "skipped": sum(sum(r.get("skipped", {}).values()) for r in results),
        "violations": sum(r["violations"] for r in results),
        "problems": sum(len(r["problems"]) for r in results),
        "results": results,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"session {seed}: {summary['runs']} runs, {summary['faults']} faults ({summary['skipped']} skipped), "
        f"{summary['operations']} operations "
        f"checked, {summary['violations']} violations, {summary['problems']} problems; {out / 'summary.json'}")
    sys.exit(1 if summary["violations"] or summary["problems"] or not results else 0)


if __name__ == "__main__":
    main()
