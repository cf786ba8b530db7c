"""A job outlives the process that started it: its agent (varuna/elastic/agent.py) runs the launches.

The process that calls `JobController.start` is SIGKILLed mid-run, as a crashing notebook kernel would
be. The job goes on; a new `Workbench.attach` (over `JobController.attach`) resizes it to another shape
(its stop command lost on the way, as one sent before a rank's SUB socket reconnected is: the stop file
carries it), stops it and resumes it in a third, and the job finishes its steps with none lost and none
run twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from _helpers import REPO, SCRIPTS
from varuna_widgets import Workbench

from varuna.controller import JobController
from varuna.elastic import agent
from varuna.telemetry.events import read_events

pytestmark = [pytest.mark.multirank, pytest.mark.foreground]
STEPS = 100


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def console(run_dir: Path) -> str:
    path = run_dir / "logs" / "console.log"
    return path.read_text() if path.exists() else ""


def step_counts(run_dir: Path) -> Counter[int]:
    """How many times rank 0 trained each step, over every launch (from the ranks' event logs)."""
    return Counter(
        int(e["step"]) for e in read_events(run_dir) if e["type"] == "step_metrics" and e.get("rank") == 0
    )


@pytest.mark.timeout(240)
def test_the_job_outlives_its_starter_and_an_attach_steers_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    starter = textwrap.dedent(
        f"""
        import time
        from varuna.controller import JobController
        ctl = JobController.start([{str(SCRIPTS / "controller_train.py")!r}, "{STEPS}", "0.15"],
                                  pipeline=2, data=1, run_dir={str(run_dir)!r}, grace_s=5.0)
        print("started", flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", starter],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ctl = wb = None
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        status = run_dir / "status" / "rank0.json"
        assert wait_for(lambda: "step 3 " in console(run_dir), 90)
        proc.kill()  # the kernel dies; nothing of the job may go with it
        proc.wait(10)
        before = console(run_dir).count("loss")
        assert wait_for(lambda: console(run_dir).count("loss") > before + 2, 30)
        assert status.exists()

        wb = Workbench.attach(run_dir)  # a new kernel: the workbench over JobController.attach
        ctl = wb.controller
        assert ctl is not None and ctl.state == "running", ctl.console.lines
        first = ctl.job
        assert first is not None and (first.pipeline, first.data) == (2, 1)
        count = ctl.store.count
        assert wait_for(lambda: ctl.store.count > count + 2, 20), "no live events after the attach"

        # A rank's SUB socket may not have reconnected yet, and its PUB drops the command unheard:
        # drop it here for certain; the stop file the resize also writes must carry it.
        assert ctl._channel is not None
        send, dropped = ctl._channel.send, []
        ctl._channel.send = lambda cmd, **fields: (
            dropped.append(cmd) if cmd == "stop" else send(cmd, **fields)
        )
        wb.resize(1, 2)
        ctl._channel.send = send
        assert dropped == ["stop"]
        assert wait_for(lambda: ctl.job is not first and ctl.state == "running", 90), ctl.console.lines
        assert (ctl.job.pipeline, ctl.job.data) == (1, 2)
        resized_at = max(step_counts(run_dir))
        assert wait_for(lambda: max(step_counts(run_dir)) > resized_at + 1, 30)  # it trains in the new shape
        assert wb.stop(timeout=60) == "stopped"
        stopped_at = max(step_counts(run_dir))
        assert stopped_at < STEPS - 1, "the job finished before it could be stopped; give it more steps"

        wb.p_input.value, wb.d_input.value = 2, 1  # the shape typed beside the buttons
        assert wb.resume() in ("starting", "running")
        assert ctl.wait(120) == "finished", ctl.console.lines
        counts = step_counts(run_dir)
        assert sorted(counts) == list(range(STEPS)), sorted(counts)  # no step lost ...
        assert set(counts.values()) == {1}, {s: n for s, n in counts.items() if n != 1}  # ... none twice
        shapes = [(e["pipeline"], e["data"]) for e in ctl.store.events("job_start")]
        assert shapes == [(2, 1), (1, 2), (2, 1)]
        assert agent.read_state(run_dir)["state"] == "finished"
    finally:
        if proc.poll() is None:
            proc.kill()
        if ctl is not None and ctl.state not in ("stopped", "failed", "finished"):
            ctl.stop(checkpoint=False, timeout=30)
        if wb is not None:
            wb.close()


@pytest.mark.timeout(60)
def test_a_dead_agent_fails_the_job_instead_of_hanging(tmp_path: Path) -> None:
    ctl = JobController.start(
        [str(SCRIPTS / "controller_train.py"), "100000", "0.05"],
        pipeline=1,
        data=1,
        run_dir=tmp_path / "run",
        grace_s=2.0,
    )
    try:
        assert ctl.wait(40, states=("running", "failed")) == "running", ctl.console.lines
        pid = agent.read_state(ctl.run_dir)["pid"]
        os.kill(pid, signal.SIGKILL)  # the supervisor itself dies; its ranks are orphans now
        assert ctl.wait(10) == "failed"
        assert ctl.error is not None and f"pid {pid}" in ctl.error and "agent.log" in ctl.error
    finally:
        for status in (ctl.run_dir / "status").glob("*.json"):
            try:
                os.kill(int(__import__("json").loads(status.read_text())["pid"]), signal.SIGKILL)
            except (OSError, KeyError, ValueError):
                pass
        ctl.close()
