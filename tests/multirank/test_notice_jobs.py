"""Preemption notices met by a real 1x2 job (`varuna.engine.notice`): a `varuna notice` a few seconds
ahead lets the job train on, then checkpoint before the deadline and exit 75, and resuming from that
checkpoint trains as if nothing happened; a deadline already too close stops at the end of the step
that saw it; a SIGTERM to one rank, with a notice window, is a notice too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import REPO, SCRIPTS

pytestmark = [pytest.mark.multirank, pytest.mark.foreground]
SCRIPT = SCRIPTS / "notice_train.py"
FOREVER = "100000"  # steps: the job ends by its notice


def records(out: Path) -> list[dict[str, Any]]:
    path = out / "losses.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(run: Path, kind: str) -> list[dict[str, Any]]:
    found = []
    for log in sorted((run / "events").glob("rank*.jsonl")):
        found += [e for e in map(json.loads, log.read_text().splitlines()) if e["type"] == kind]
    return found


def start(varuna_popen, tmp_path: Path, name: str, *args: str, env: dict[str, str] | None = None):
    """Start the notice script at 1x2 in tmp_path/<name>; return (job, run dir, out dir, log) once
    it has written OUT/ready (checkpoints measured on every rank)."""
    run, out = tmp_path / name / "run", tmp_path / name / "out"
    out.mkdir(parents=True)
    log = tmp_path / name / "console.log"
    with open(log, "w") as console:
        job = varuna_popen(
            [SCRIPT, out, *args],
            pipeline=1,
            data=2,
            run_dir=run,
            env=env,
            cwd=tmp_path,
            stdout=console,
            stderr=subprocess.STDOUT,
        )
    wait_until = time.monotonic() + 120
    while not (out / "ready").exists() and job.poll() is None and time.monotonic() < wait_until:
        time.sleep(0.05)
    assert (out / "ready").exists(), f"the job never got ready:\n{log.read_text()[-4000:]}"
    return job, run, out, log


def finish(job: subprocess.Popen, log: Path, code: int, timeout: float = 60) -> float:
    """Wait for the job; it must exit with `code`. When it ended (epoch seconds)."""
    try:
        got = job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not end within {timeout} s:\n{log.read_text()[-4000:]}")
    ended = time.time()
    assert got == code, f"exit {got}, wanted {code}:\n{log.read_text()[-4000:]}"
    return ended


def varuna_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "varuna", *map(str, args)], env=env, capture_output=True, text=True, timeout=60
    )


def stop_checkpoint(run: Path) -> tuple[int, float]:
    """The step of `latest` and when it was committed."""
    latest = run / "checkpoints" / "latest"
    return int(latest.read_text().strip().split("-")[1]), latest.stat().st_mtime


@pytest.mark.timeout(400)
def test_a_notice_is_met_and_resuming_trains_as_if_uninterrupted(
    tmp_path: Path, varuna_popen, varuna_run
) -> None:
    job, run, out, log = start(varuna_popen, tmp_path, "noticed", FOREVER)
    asked = varuna_cli("notice", run, "--deadline", "6s", "--host", "node3", "--reason", "spot reclaim")
    assert asked.returncode == 0, asked.stderr
    assert "node3 go away in 6 s" in asked.stdout
    request = json.loads(next((run / "requests").glob("stop-*.json")).read_text())
    deadline = request["deadline"]
    assert (
        request["hosts"] == ["node3"]
        and request["job"] == json.loads((run / "job.json").read_text())["job_id"]
    )
    ended = finish(job, log, 75)

    steps = records(out)
    after = [r for r in steps if r["time"] > request["time"]]
    assert len(after) > 0, "the job stopped without training on, though the deadline left time"
    stopped, committed = stop_checkpoint(run)
    assert stopped == len(steps)  # the checkpoint holds every step the script saw
    assert committed < deadline, f"checkpoint committed {committed - deadline:.2f} s after the deadline"
    assert ended < deadline, f"the job ended {ended - deadline:.2f} s after the deadline"
    (notice,) = events(run, "notice")
    assert notice["rank"] == 0 and notice["source"] == "file" and notice["hosts"] == ["node3"]
    assert notice["reason"] == "spot reclaim" and notice["deadline"] == deadline
    (decided,) = events(run, "stop_decided")
    assert decided["step"] == stopped and decided["decided_here"] and 0 < decided["seconds_left"]
    assert decided["seconds_left"] < decided["needed_s"]  # the first step after which no more fit
    exits = events(run, "exit")
    assert len(exits) == 2 and all(e["code"] == 75 and e["time"] < deadline for e in exits)
    print(
        f"stopped after step {stopped} ({len(after)} after the notice), checkpoint {deadline - committed:.2f} s "
        f"and launcher exit {deadline - ended:.2f} s before the deadline"
    )

    # resume from the notice's checkpoint for 3 steps; an uninterrupted run gives the same losses
    resumed = tmp_path / "resumed" / "out"
    resumed.mkdir(parents=True)
    latest = run / "checkpoints" / f"step-{stopped:08d}"
    varuna_run(
        [SCRIPT, resumed, str(stopped + 3), latest],
        pipeline=1,
        data=2,
        run_dir=tmp_path / "resumed" / "run",
        cwd=tmp_path,
        timeout=120,
    )
    plain = tmp_path / "plain" / "out"
    plain.mkdir(parents=True)
    varuna_run(
        [SCRIPT, plain, str(stopped + 3)],
        pipeline=1,
        data=2,
        run_dir=tmp_path / "plain" / "run",
        cwd=tmp_path,
        timeout=180,
    )
    reference = [r["loss"] for r in records(plain)]
    assert [r["loss"] for r in steps] == reference[:stopped]
    assert [r["loss"] for r in records(resumed)] == reference[stopped:]


@pytest.mark.timeout(200)
def test_a_deadline_too_close_stops_at_the_end_of_the_step_that_saw_it(tmp_path: Path, varuna_popen) -> None:
    job, run, out, log = start(varuna_popen, tmp_path, "close", FOREVER)
    asked = varuna_cli("notice", run, "--deadline", "1")
    assert asked.returncode == 0, asked.stderr
    finish(job, log, 75)
    (notice,) = events(run, "notice")
    (decided,) = events(run, "stop_decided")
    assert decided["step"] == notice["step"] + 1 and decided["decided_here"]
    stopped, _ = stop_checkpoint(run)
    assert stopped == decided["step"] == len(records(out))


@pytest.mark.timeout(200)
def test_sigterm_to_one_rank_with_a_notice_window_is_a_notice(tmp_path: Path, varuna_popen) -> None:
    job, run, out, log = start(varuna_popen, tmp_path, "sigterm", FOREVER, env={"VARUNA_NOTICE_S": "6s"})
    sent = time.time()
    os.kill(int((out / "pid-rank1").read_text()), signal.SIGTERM)  # rank 1 only: one host's ranks
    finish(job, log, 75)
    (notice,) = events(run, "notice")
    assert notice["rank"] == 1 and notice["source"] == "signal" and notice["reason"] == "SIGTERM"
    assert sent <= notice["deadline"] - 6 < sent + 1  # 6 s from when the rank handled it
    decided = {e["rank"]: e for e in events(run, "stop_decided")}
    assert decided[1]["decided_here"] and decided[1]["deadline"] == notice["deadline"]
    assert not decided[0]["decided_here"]  # rank 0 stopped on rank 1's word, through the all-reduce
    assert len([r for r in records(out) if r["time"] > sent]) > 0
    stopped, committed = stop_checkpoint(run)
    assert stopped == decided[1]["step"] == len(records(out)) and committed < notice["deadline"]
