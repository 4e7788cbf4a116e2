#!/usr/bin/env python3
"""1M keys with 100 B values and TTLs uniform in 1-60 s, loaded over RESP; then every 10 s: DBSIZE
against the keys whose TTL has not passed yet (from each batch's send time), and the server's CPU.

Usage: scripts/expiry-probe.py PORT PID   (a running ramlog or redis-server on PORT, process PID)
"""
import bisect, redis, random, time, sys
port, pid = int(sys.argv[1]), int(sys.argv[2])
r = redis.Redis(port=port)
p = r.pipeline(transaction=False)
random.seed(1)
expiry = []
batch = []
for i in range(1_000_000):
    ttl = random.randint(1000, 60000)
    p.set(f"key:{i:012}", b"v"*100, px=ttl)
    batch.append(ttl)
    if len(batch) == 10000:
        sent = time.time()
        p.execute()
        expiry.extend(sent + t / 1000 for t in batch)
        batch = []
expiry.sort()
def cpu():
    f=open(f"/proc/{pid}/stat").read().split()
    return (int(f[13])+int(f[14]))/100
t0=time.time(); c0=cpu()
rows = []
for k in range(7):
    time.sleep(10)
    c=cpu(); t=time.time()
    alive = len(expiry) - bisect.bisect_right(expiry, t)
    n = r.dbsize()
    rows.append((t - t0, n, alive, (c - c0) / (t - t0)))
    print(f"t={t-t0:5.1f}s dbsize={n:8d} unexpired={alive:8d} stale={n-alive:7d} server_cpu_share={(c-c0)/(t-t0):.3f}", flush=True)
