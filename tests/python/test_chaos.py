"""The fault-injection checker catches what it should: a deliberately broken build, which
acknowledges replicated writes before their backups answer (`--features
broken-ack-before-backups`), fails `scripts/chaos` with violations; the same schedule on the real
build passes (that is `scripts/test`'s chaos run). `scripts/test` builds the broken binary as
target/ramlog-broken (RAMLOG_BROKEN_BIN overrides it)."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def broken_bin():
    b = os.environ.get("RAMLOG_BROKEN_BIN", str(ROOT / "target" / "ramlog-broken"))
    assert Path(b).exists(), (
        f"{b} is missing: build it with `cargo build --release -p ramlog --features "
        "broken-ack-before-backups` and copy target/release/ramlog there (scripts/test does)")
    return b


def test_a_build_that_acknowledges_before_its_backups_fails_the_checker(tmp_path):
    """A master cut off from its backups and the coordinator (clients still reach it) keeps
    acknowledging writes until its lease runs out; the broken build acknowledges them although no
    backup has them, so once its tablets are restored elsewhere they are gone: the checker must
    report lost acknowledged writes or non-linearizable keys, and the runner must exit 1."""
    out = subprocess.run(
        [str(ROOT / "scripts" / "chaos"), "--seed", "7", "--runs", "1", "--modes", "sync",
         "--faults", "isolate_server,kill_server", "--run-seconds", "25", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "RAMLOG_BIN": broken_bin()},
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
