"""Hosts on one machine: each a network namespace with a veth pair on a bridge (itself in a
namespace of its own), 10.231.N.0/24. The namespace that creates them reaches every host through a
veth of its own (10.231.N.1), like a client on the same network. A partition is a blackhole route
on both sides, so packets go nowhere (to the cut-off side a peer is unreachable, not gone).

Used by the partition tests and by the fault-injection runner (`scripts/chaos`); needs root."""

import os
import random
import subprocess


def ip(*args):
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


class Host:
    def __init__(self, ns, address):
        self.ns = ns
        self.ip = address
        self.exec = ("ip", "netns", "exec", ns)


class Net:
    """`coordinators` coordinator hosts (.2, .3, ...) and `servers` server hosts (.10, .11, ...)."""

    def __init__(self, servers, coordinators=1):
        tag = f"{os.getpid() % 100000}{random.randrange(100)}"
        # A subnet no other Net of this machine uses (test files and the chaos runner may run side
        # by side).
        used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=10).stdout
        free = [n for n in range(256) if f"10.231.{n}." not in used]
        self.subnet = f"10.231.{random.choice(free or [random.randrange(256)])}"
        self.hub = f"rl{tag}h"
        self.namespaces = []
        self.root_link = f"rl{tag}r"
        self.routes = []
        try:
            self._add_ns(self.hub)
            ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            ip("-n", self.hub, "link", "set", "br0", "up")
            ip("link", "add", self.root_link, "type", "veth", "peer", "name", "p0", "netns", self.hub)
            ip("-n", self.hub, "link", "set", "p0", "master", "br0", "up")
            ip("addr", "add", f"{self.subnet}.1/24", "dev", self.root_link)
            ip("link", "set", self.root_link, "up")
            self.coordinators = [self._host(f"rl{tag}c{m}", 2 + m, 1 + m) for m in range(coordinators)]
            self.coordinator = self.coordinators[0]
            self.servers = [
                self._host(f"rl{tag}s{i}", 10 + i, 1 + coordinators + i) for i in range(servers)
            ]
        except Exception:
            self.close()
            raise

    def _add_ns(self, ns):
        ip("netns", "add", ns)
        self.namespaces.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")

    def _host(self, ns, last, port):
        self._add_ns(ns)
        ip("-n", self.hub, "link", "add", f"p{port}", "type", "veth", "peer", "name", "e0", "netns", ns)
        ip("-n", self.hub, "link", "set", f"p{port}", "master", "br0", "up")
        ip("-n", ns, "addr", "add", f"{self.subnet}.{last}/24", "dev", "e0")
        ip("-n", ns, "link", "set", "e0", "up")
        return Host(ns, f"{self.subnet}.{last}")

    def server(self, i):
        return self.servers[i]

    def cut(self, host, others):
        """Drops every packet between `host` and each of `others`, both ways."""
        for other in others:
            for a, b in ((host, other), (other, host)):
                ip("-n", a.ns, "route", "add", "blackhole", f"{b.ip}/32")
                self.routes.append((a, b))

    def heal(self):
        for a, b in self.routes:
            ip("-n", a.ns, "route", "del", "blackhole", f"{b.ip}/32")
        self.routes = []

    def close(self):
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", self.root_link], capture_output=True, timeout=10)
