"""A job that follows its hosts as spot machines come and go (issue #38): the controller and agent on
h1, ranks on h2 and h3, every change made the way a person or a cloud hook would make it (`varuna hosts`,
`varuna notice`); one run of tests/scripts/multihost_spot.py, whose docstring has the story.

Checked: four host changes within the settle time make one grow (onto both hosts), a notice with a
deadline is met (training goes on after it, the checkpoint is committed and the launch has exited
before the deadline, the relaunch leaves the host out), a host that comes back is grown onto again, an
announced removal shrinks; every step trained exactly once, to plain training's losses.
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

pytestmark = [pytest.mark.multihost]
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
        "removed": ([2, 1], ["h2"]),
    }
    # the changes took under the settle time, and made one morph each time
    assert report["changes_s"] < 3.0
    asked = [(m["change"], m["gone"], m["added"]) for m in report["morph_asked"]]
    assert asked == [("grow", [], ["h3"]), ("grow", [], ["h3"]), ("shrink", ["h3"], [])]
    # the notice: training went on after it, then checkpoint and exit before the deadline
    assert notice["steps_after"] is not None and notice["steps_after"] >= 3, notice
    assert notice["saved_at"] < notice["deadline"] and notice["ended_at"] < notice["deadline"], notice
    assert [code for code, _ in report["job_ends"]] == [75, 75, 75, 75, 75]
    assert report["stop"] == "stopped" and report["state"] == "stopped"
    assert "offered: h2:2" in report["listing"]
    # every step exactly once, as plain training
    steps = [s for s, _ in report["steps"]]
    assert steps == list(range(len(steps))) and len(steps) > 10
    torch.set_num_threads(1)
    plain = reference("gpt", steps=len(steps))[0]
    torch.testing.assert_close(
        torch.tensor([loss for _, loss in report["steps"]]), torch.tensor(plain), rtol=1e-5, atol=0
    )
