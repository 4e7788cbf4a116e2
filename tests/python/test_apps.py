"""A real application on ramlog: rq (Redis Queue), its worker process and its client, against a
standalone server and through a cluster's routing port. rq uses hashes, lists with blocking
pops (BLMOVE), sets, sorted sets (its registries), streams (its results, XADD and XREAD BLOCK),
pub/sub (worker commands) and MULTI/EXEC pipelines."""

import os
import subprocess
import sys
import time

import pytest
import redis

from conftest import Server


JOBS = '''
def add(a, b):
    return a + b

def fail():
    raise ValueError("on purpose")

def flaky(key):
    # Fails on its first two tries; rq's Retry runs it again.
    from rq import get_current_job
    if get_current_job().connection.incr(key) < 3:
        raise RuntimeError("not yet")
    return "done"
'''


@pytest.fixture(params=["standalone", "routing"])
def rq_port(request, tmp_path):
    if request.param == "standalone":
        s = Server(tmp_path)
        yield s.port
        s.stop()
    else:
        c = request.getfixturevalue("shared_cluster")
        redis.Redis(port=c.servers[0].routing).flushall()
        yield c.servers[0].routing


def test_rq_workers_run_a_thousand_jobs_with_retries_and_failures(rq_port, tmp_path):
    import rq  # installed by scripts/test; missing, the test fails
    from rq.job import Job

    (tmp_path / "rqjobs.py").write_text(JOBS)
    sys.path.insert(0, str(tmp_path))
    try:
        import rqjobs
        conn = redis.Redis(port=rq_port, socket_timeout=30)
        q = rq.Queue("default", connection=conn)
        # A worker process that blocks waiting for work (BLMOVE), started before the jobs exist.
        env = dict(os.environ, PYTHONPATH=str(tmp_path))
        # rq's SimpleWorker runs jobs in the worker process (the default forks a child per job).
        # Its log goes to a file: a pipe read only at the end would fill and stop the worker.
        log_path = tmp_path / "worker.log"
        log = open(log_path, "w")
        worker = subprocess.Popen([sys.executable, "-m", "rq.cli", "worker", "--url", f"redis://127.0.0.1:{rq_port}",
                                   "--name", "w1", "--worker-class", "rq.worker.SimpleWorker", "default"], cwd=tmp_path, env=env,
                                  stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            time.sleep(1.5)
            # 1,000 jobs: 970 that succeed, 20 that fail, 10 that fail twice and succeed on retry.
            jobs = [q.enqueue(rqjobs.add, i, 1) for i in range(970)]
            bad = [q.enqueue(rqjobs.fail) for _ in range(20)]
            retried = [q.enqueue(rqjobs.flaky, f"rq:flaky:{i}", retry=rq.Retry(max=3)) for i in range(10)]
            # The client waits on each job's result stream (XREAD BLOCK).
            for i, job in enumerate(jobs):
                result = job.latest_result(timeout=60)
                assert result is not None and result.type == result.Type.SUCCESSFUL, (i, job.get_status(), result and result.exc_string)
                assert result.return_value == i + 1
            for job in bad:
                result = job.latest_result(timeout=60)
                assert result is not None and result.type == result.Type.FAILED
                assert "on purpose" in result.exc_string
            for i, job in enumerate(retried):
                assert _wait(lambda: job.get_status(refresh=True) == "finished", 60), job.get_status()
                assert job.return_value() == "done"
                assert int(conn.get(f"rq:flaky:{i}")) == 3
            assert rq.registry.FinishedJobRegistry(queue=q).count == 980
            assert rq.registry.FailedJobRegistry(queue=q).count == 20
            assert Job.fetch(jobs[3].id, connection=conn).get_status() == "finished"
            assert [w.name for w in rq.Worker.all(connection=conn)] == ["w1"]
            # rq's worker commands go over pub/sub: shut the worker down through it.
            rq.command.send_shutdown_command(conn, "w1")
            worker.wait(timeout=30)
        finally:
            if worker.poll() is None:
                worker.kill()
            worker.wait(timeout=30)
            log.close()
        out = log_path.read_text()
        assert "Successfully completed" in out, out[-3000:]
        # Nothing the server answered made the worker fail (the failed job's own ValueError aside).
        assert "redis.exceptions" not in out and "ResponseError" not in out, out[-3000:]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("rqjobs", None)


def _wait(predicate, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


CELERY_TASKS = '''
import os
from celery import Celery

url = os.environ["RAMLOG_URL"]
app = Celery("celerytasks", broker=url, backend=url)
app.conf.update(broker_connection_retry_on_startup=True, result_expires=600,
                task_acks_late=True, worker_prefetch_multiplier=1)

@app.task
def square(x):
    return x * x

@app.task
def total(values):
    return sum(values)

@app.task(bind=True, max_retries=2, default_retry_delay=0.1)
def flaky(self, key):
    # Fails twice, then succeeds: Celery's retries go through the broker again.
    import redis
    r = redis.Redis.from_url(url)
    if r.incr(key) < 3:
        raise self.retry(exc=ValueError("not yet"))
    return "done after retries"
'''


def test_celery_runs_a_chord_with_its_redis_broker_and_backend(rq_port, tmp_path, request):
    """Celery 5 with the Redis broker (kombu: lists, BRPOP over its priority queues, sorted sets,
    MULTI, Lua) and the Redis result backend, whose chords count their parts in a Lua script
    (EVALSHA). Through the routing port, groups and retries run; a chord does not: its script
    touches six keys of six slots, which no one server holds (as on a Redis Cluster, whose
    clients Celery does not support)."""
    routing = "routing" in request.node.callspec.id
    url = f"redis://127.0.0.1:{rq_port}/0"
    (tmp_path / "celerytasks.py").write_text(CELERY_TASKS)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), RAMLOG_URL=url)
    # Its log goes to a file: a pipe read only at the end could fill and stop the worker.
    log_path = tmp_path / "celery.log"
    log = open(log_path, "w")
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "celerytasks", "worker", "--pool=solo",
                               "--loglevel=INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"],
                              cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    os.environ["RAMLOG_URL"] = url
    sys.path.insert(0, str(tmp_path))
    try:
        import celery
        import celerytasks
        parts = 20
        if routing:
            result = celery.group(celerytasks.square.s(i) for i in range(parts))()
            expected = [i * i for i in range(parts)]
        else:
            result = celery.chord(celerytasks.square.s(i) for i in range(parts))(celerytasks.total.s())
            expected = sum(i * i for i in range(parts))
        retried = celerytasks.flaky.delay("celery:flaky")
        try:
            assert result.get(timeout=60) == expected
            assert retried.get(timeout=60) == "done after retries"
        except celery.exceptions.TimeoutError:
            pytest.fail("no result in time; the worker said:\n" + log_path.read_text()[-4000:])
        assert int(redis.Redis(port=rq_port).get("celery:flaky")) == 3
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("celerytasks", None)
        if worker.poll() is None:
            worker.terminate()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(timeout=30)
        log.close()
    out = log_path.read_text()
    assert "succeeded in" in out, out[-3000:]
    assert "ResponseError" not in out, out[-3000:]


BULLMQ = os.path.join(os.path.dirname(__file__), "..", "node", "bullmq")


def test_bullmq_runs_a_thousand_jobs_with_retries_and_failures(rq_port):
    """BullMQ (Node), unmodified: its Lua scripts (EVALSHA with cmsgpack and cjson), streams of
    events, sorted sets and hashes. 1 000 jobs on 8 concurrent workers: every 10th fails once
    and succeeds on its retry, every 100th fails for good. The queue's keys share the hash tag
    `{bull}`, as BullMQ asks of a cluster."""
    if not os.path.isdir(os.path.join(BULLMQ, "node_modules", "bullmq")):
        pytest.fail("BullMQ is not installed (scripts/test runs npm ci in tests/node/bullmq)")
    out = subprocess.run(["node", "run.js", str(rq_port), "1000", "{bull}"], cwd=BULLMQ,
                         capture_output=True, text=True, timeout=180)
    import json
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, (result, out.stderr[-2000:])
    assert result["completed"] == 990 and result["failed"] == 10, result
    assert result["counts"]["completed"] == 990 and result["counts"]["failed"] == 10, result
    assert result["counts"]["waiting"] == 0 and result["counts"]["active"] == 0, result
    assert result["retried"] == 100, result
    assert result["sample"] == {"returnvalue": {"sum": 11}, "attemptsMade": 2}, result
