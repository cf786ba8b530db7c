"""`varuna run --elastic --watch-hosts` on this host: the job follows the hostfile it watches. It starts
on `localhost:1`; `varuna hosts RUN_DIR add localhost:2` gives it a second slot, and once that has
settled the job grows to 1x2 through the morph protocol and finishes there, every step trained once,
to plain training's losses. (Across hosts: tests/multihost/test_multihost_spot.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _helpers import REPO, SCRIPTS

from varuna.telemetry.events import read_events

sys.path.insert(0, str(SCRIPTS))
from transparency_common import reference  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.foreground]
STEPS = 80


def _rank0_steps(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["type"] == "step_metrics" and e.get("rank") == 0]


@pytest.mark.timeout(150)
def test_a_watched_hostfile_given_a_slot_grows_the_job(tmp_path: Path, varuna_popen) -> None:
    hostfile, run_dir, log = tmp_path / "hosts", tmp_path / "run", tmp_path / "out.log"
    hostfile.write_text("localhost:1\n")
    with open(log, "w") as out:
        job = varuna_popen(
            [SCRIPTS / "controller_train.py", str(STEPS), "0.1"],
            pipeline=1,
            run_dir=run_dir,
            flags=["--elastic", "--watch-hosts", "--hostfile", str(hostfile), "--settle", "1"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while len(_rank0_steps(run_dir)) < 3 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_rank0_steps(run_dir)) >= 3, log.read_text()[-3000:]
        added = subprocess.run(
            [sys.executable, "-m", "varuna", "hosts", str(run_dir), "add", "localhost:2"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=REPO,
        )
        assert added.returncode == 0, added.stderr
        assert job.wait(timeout=120) == 0, log.read_text()[-3000:]
    notes = [e for e in read_events(run_dir) if e.get("rank") is None]
    assert [e["world"] for e in notes if e["type"] == "job_start"] == [1, 2]
    (asked,) = [e for e in notes if e["type"] == "morph_asked"]
    assert asked["change"] == "grow" and asked["available"] == {"localhost": 2}
    steps = _rank0_steps(run_dir)
    assert [e["step"] for e in steps] == list(range(STEPS))  # every step once, across the morph
    assert len({e["job"] for e in steps}) == 2
    torch.set_num_threads(1)
    plain = reference("gpt", steps=STEPS)[0]
    torch.testing.assert_close(
        torch.tensor([e["loss"] for e in steps]), torch.tensor(plain), rtol=1e-5, atol=0
    )
