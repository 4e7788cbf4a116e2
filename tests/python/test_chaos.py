"""The fault-injection checker catches what it should: servers that acknowledge replicated
writes before their backups answer (the test-only switch `RAMLOG_TEST_BREAK_ACKS=
replies-before-backups`) fail `scripts/chaos` with violations; the same schedule without it
passes (that is `scripts/test`'s chaos run)."""

import json
import os
import subprocess
from pathlib import Path

from conftest import ramlog_bin

ROOT = Path(__file__).resolve().parents[2]


def test_servers_that_acknowledge_before_their_backups_fail_the_checker(tmp_path):
    """A master cut off from its backups and the coordinator (clients still reach it) keeps
    acknowledging writes until its lease runs out; broken servers acknowledge them although no
    backup has them, so once its tablets are restored elsewhere they are gone: the checker must
    report lost acknowledged writes or non-linearizable keys, and the runner must exit 1."""
    out = subprocess.run(
        [str(ROOT / "scripts" / "chaos"), "--seed", "7", "--runs", "1", "--modes", "sync",
         "--faults", "isolate_server,kill_server", "--run-seconds", "25", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "RAMLOG_BIN": ramlog_bin(), "RAMLOG_TEST_BREAK_ACKS": "replies-before-backups"},
    )
    summary = json.loads((tmp_path / "session-7" / "summary.json").read_text())
    run = summary["results"][0]
    assert run["operations"] > 1000 and sum(run["faults"].values()) >= 2, (run, out.stdout[-3000:])
    assert not [p for p in run["problems"] if "the run failed" in p], run["problems"]
    assert run["violations"] > 0, (run, out.stdout[-3000:])
    assert out.returncode == 1, out.stdout[-3000:]
    report = Path(run["report"]).read_text()
    assert "VIOLATION key" in report and ("missing" in report or "not linearizable" in report
                                          or "lost increments" in report), report[:3000]
