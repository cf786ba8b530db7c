"""A job that follows its hosts as spot machines come and go (issue #38): the controller and agent on
h1, ranks on h2 and h3, every change made the way a person or a cloud hook would make it (`varuna hosts`,
`varuna notice`); one run of tests/scripts/multihost_spot.py, whose docstring has the story.

Checked: four host changes within the settle time make one grow (onto both hosts), a notice with a
deadline is met (training goes on after it, the checkpoint is committed and the launch has exited
before the deadline, the relaunch leaves the host out), a host that comes back is grown onto again, a
host killed without warning while a background checkpoint is being written leaves the checkpoint before
it `latest` (the relaunch resumes from that one, without the host), an announced removal shrinks;
every step exactly once in the final trajectory (the steps after the last commit are trained again by
the relaunch), to plain training's losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import REPO, SCRIPTS

from varuna.bench.netns import NetnsHosts

sys.path.insert(0, str(SCRIPTS))
from transparency_common import reference  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.foreground]
STEPS = 400


@pytest.mark.timeout(300)
def test_multihost_job_grows_shrinks_and_meets_a_notice_as_hosts_come_and_go(
    hosts: NetnsHosts, tmp_path: Path
) -> None:
    hostfile = hosts.hostfile(tmp_path / "hosts", {"h2": 2})
    argv = [
        sys.executable,
        str(SCRIPTS / "multihost_spot.py"),
        str(tmp_path / "run"),
        str(hostfile),
        str(STEPS),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "VARUNA_MPIEXEC_ARGS": hosts.mpiexec_args,
        "TRAIN_CHECKPOINT_EVERY": "4",
        "TRAIN_HOLD_WRITES": str(tmp_path / "hold-writes"),
    }
    done = subprocess.run(
        hosts.command("h1", argv),
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        stdin=subprocess.DEVNULL,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, f"driver exited {done.returncode} without a report:\n{done.stderr[-3000:]}"
    report = json.loads(lines[-1])
    assert done.returncode == 0 and "error" not in report, json.dumps(report, indent=1)[-6000:]

    notice = report["notice"]
    print(
        f"notice: {notice['steps_after']} steps after it, checkpoint {notice['deadline'] - notice['saved_at']:.1f} s "
        f"and exit {notice['deadline'] - notice['ended_at']:.1f} s before the deadline; {len(report['steps'])} steps"
    )
    shapes = {launch["key"]: (launch["shape"], launch["hosts"]) for launch in report["launches"]}
    assert shapes == {
        "first": ([2, 1], ["h2"]),
        "grown": ([2, 2], ["h2", "h3"]),
        "after_notice": ([2, 1], ["h2"]),
        "returned": ([2, 2], ["h2", "h3"]),
        "killed": ([2, 1], ["h2"]),
        "back": ([2, 2], ["h2", "h3"]),
        "removed": ([2, 1], ["h2"]),
    }
    # the changes took under the settle time, and made one morph each time
    assert report["changes_s"] < 3.0
    asked = [(m["change"], m["gone"], m["added"]) for m in report["morph_asked"]]
    assert asked == [("grow", [], ["h3"])] * 3 + [("shrink", ["h3"], [])]
    # the notice: training went on after it, then checkpoint and exit before the deadline
    assert notice["steps_after"] is not None and notice["steps_after"] >= 3, notice
    assert notice["saved_at"] < notice["deadline"] and notice["ended_at"] < notice["deadline"], notice
    codes = [code for code, _ in report["job_ends"]]
    assert codes[:3] == [75, 75, 75] and codes[3] not in (0, 75) and codes[4:] == [75, 75, 75], codes
    # the kill: a background write was in flight (held), never committed; the relaunch resumed from the
    # checkpoint before it, which was still `latest`
    kill = report["kill"]
    print(f"kill: {kill}")
    assert kill["killed"] == 2 and len(kill["writing"]) == 1, kill
    (writing,) = kill["writing"]
    assert kill["latest_before"] is not None and kill["latest_after"] == kill["latest_before"], kill
    assert int(writing.split("-")[1].split(".")[0]) > int(kill["latest_before"].split("-")[1]), kill
    assert kill["resumed_from"] is not None and kill["resumed_from"].endswith(kill["latest_before"]), kill
    assert report["stop"] == "stopped" and report["state"] == "stopped"
    assert "offered: h2:2" in report["listing"]
    # the final trajectory: each launch's steps replace what an earlier launch trained from the step it
    # resumed at (only the killed launch's steps after its last commit are trained again)
    final: list[tuple[int, float]] = []
    for job in dict.fromkeys(j for j, _, _ in report["steps"]):
        mine = [(s, loss) for j, s, loss in report["steps"] if j == job]
        final = [p for p in final if p[0] < mine[0][0]] + mine
    steps = [s for s, _ in final]
    assert steps == list(range(len(steps))) and len(steps) > 10
    redone = len(report["steps"]) - len(final)
    assert 0 < redone <= 2 * 4, redone  # trained since the last commit (every 4 steps), and no more
    torch.set_num_threads(1)
    plain = reference("gpt", steps=len(steps))[0]
    torch.testing.assert_close(
        torch.tensor([loss for _, loss in final]), torch.tensor(plain), rtol=1e-5, atol=0
    )
    # the steps trained again reached the same losses the first time
    by_step = dict(final)
    for _, s, loss in report["steps"]:
        assert loss == pytest.approx(by_step[s], rel=1e-5)
