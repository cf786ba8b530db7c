"""Only the job's own workers are signalled: a status file's pid must still be the process it names
(varuna/launch/pids.py), and `varuna resize` signals nothing else (varuna/elastic/protocol.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import REPO

from varuna.elastic.protocol import live_workers
from varuna.launch.pids import check_status, identity, start_ticks

ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
# a process that writes its own status, as a rank does, then waits to be signalled
RANK = (
    "import sys, time; from varuna._files import write_json_atomic; from varuna.launch.pids import identity; "
    "write_json_atomic(sys.argv[1], {'rank': 0, 'state': 'running', **identity()}); time.sleep(30)"
)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    """A live process that has nothing to do with any job."""
    proc = subprocess.Popen(["sleep", "30"])
    yield proc
    proc.kill()
    proc.wait()


def _run_dir(tmp_path: Path, **status: object) -> Path:
    run = tmp_path / "run"
    (run / "status").mkdir(parents=True)
    (run / "job.json").write_text("{}")
    (run / "status" / "rank0.json").write_text(json.dumps({"rank": 0, "state": "running", **status}))
    return run


def _resize(run: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "varuna", "resize", str(run), "-p", "1", "-d", "1"]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=60)


def test_this_process_matches_its_own_identity() -> None:
    me = identity()
    assert me["pid"] == os.getpid() and isinstance(me["start_ticks"], int) and me["boot_id"]
    assert check_status({**me, "rank": 3}).live


def test_resize_never_signals_a_live_unrelated_process_with_a_stale_status(
    tmp_path: Path, sleeper: subprocess.Popen
) -> None:
    # the rank that wrote this status died; its pid now belongs to `sleep` (a different start time)
    other_start = start_ticks(os.getpid())
    run = _run_dir(tmp_path, **{**identity(), "pid": sleeper.pid, "start_ticks": other_start})
    done = _resize(run)
    assert done.returncode == 0, done.stderr
    time.sleep(0.2)
    assert sleeper.poll() is None, "the unrelated process was signalled"
    assert f"pid {sleeper.pid} is another process now" in done.stderr and "stale status" in done.stderr
    assert "no running rank" in done.stderr and "requested 1x1" in done.stdout
    assert live_workers(run) == []  # an attaching controller sees no live job either


@pytest.mark.parametrize(
    ("status", "says"),
    [
        ({"start_ticks": None}, "cannot be matched to its start time"),  # written before start times
        ({"host": "elsewhere.example"}, "runs on elsewhere.example, not on this host"),
    ],
)
def test_unverifiable_and_remote_statuses_are_skipped_with_a_reason(
    tmp_path: Path, sleeper: subprocess.Popen, status: dict, says: str
) -> None:
    run = _run_dir(
        tmp_path, **{**identity(), "pid": sleeper.pid, "start_ticks": start_ticks(sleeper.pid), **status}
    )
    done = _resize(run)
    time.sleep(0.2)
    assert sleeper.poll() is None and says in done.stderr


def test_a_dead_rank_is_recognised_as_dead(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    verdict = check_status({"rank": 1, "state": "running", **identity(), "pid": gone.pid})
    assert verdict.kind == "dead" and f"pid {gone.pid} is gone" in verdict.reason


def test_resize_signals_the_rank_that_wrote_its_own_status(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(run / "status" / "rank0.json")], env=ENV)
    try:
        deadline = time.monotonic() + 30
        while "pid" not in (run / "status" / "rank0.json").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live_workers(run) == [rank.pid]
        assert _resize(run).returncode == 0
        assert rank.wait(timeout=10) == -signal.SIGUSR1  # SIGUSR1's default: the request arrived
    finally:
        rank.kill()
        rank.wait()
