"""The launcher with real processes: the mpiexec command lines (which ask `mpiexec --version`), then
four real 2-rank jobs under the mpich wheel's mpiexec: success, a raising rank, a SIGKILLed rank, a
timeout (which shows each rank's stack). Every job must end promptly and leave no process behind.
"""

from __future__ import annotations

import io
import json
import os
import re
import time
import uuid
from pathlib import Path

import pytest
from _helpers import REPO, SCRIPTS

from varuna.launch import job as launch
from varuna.launch.job import Job, mpiexec_command

pytestmark = [pytest.mark.multirank, pytest.mark.foreground]
FAIL = str(SCRIPTS / "launch_fail.py")


def _processes_with(marker: str) -> list[str]:
    """Command lines of live processes whose argv mentions ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state != "Z":
            found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_two_rank_run_through_the_cli(tmp_path: Path, varuna_run) -> None:
    script = SCRIPTS / "launch_allreduce.py"
    # the script's own arguments pass through untouched
    done = varuna_run(
        [script, "--pipeline", "7", "x"], pipeline=2, run_dir="run", cwd=tmp_path, timeout=100, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        prefix = f"[rank {rank} s{rank} d0] "
        assert f"{prefix}allreduce sum=3 world=2 args=['--pipeline', '7', 'x']\n" in done.stdout
        assert f"{prefix}partial line\n" in done.stdout
        assert f"{prefix}to stderr\n" in done.stderr
        log = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
        assert log.splitlines() == [
            "allreduce sum=3 world=2 args=['--pipeline', '7', 'x']",
            "partial line",
            "to stderr",
        ]
        status = json.loads((tmp_path / "run" / "status" / f"rank{rank}.json").read_text())
        assert status["state"] == "done" and (status["stage"], status["replica"]) == (rank, 0)
    job = json.loads((tmp_path / "run" / "job.json").read_text())
    assert job["exit_code"] == 0 and job["pipeline"] == 2 and job["data"] == 1
    assert not list((tmp_path / "run" / "failures").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def _run_job(tmp_path: Path, mode: str, **kw: float) -> tuple[Job, int, float, str, str]:
    marker = f"varuna-test-{uuid.uuid4().hex}"
    out, err = io.StringIO(), io.StringIO()
    job = Job(
        [FAIL, mode, marker], pipeline=2, data=1, run_dir=tmp_path / "run", stdout=out, stderr=err, **kw
    )
    start = time.monotonic()
    job.start()
    try:
        code = job.wait()
    finally:
        if job.state == "running":
            job.stop()
            job.stop()
            job.wait()
    ended = time.time()
    elapsed = time.monotonic() - start
    assert _processes_with(marker) == []
    if mode != "hang":  # timed from rank 1's failure, not from the launch: start-up under load is not timed
        log = (tmp_path / "run" / "logs" / "rank1.log").read_text()
        failed = re.search(r"rank 1 about to \w+ at ([0-9.]+)", log)
        assert failed, log
        elapsed = ended - float(failed[1])
    return job, code, elapsed, out.getvalue(), err.getvalue()


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_a_raising_rank_ends_the_job_and_is_named(tmp_path: Path) -> None:
    job, code, elapsed, out, err = _run_job(tmp_path, "raise")
    assert code == 1
    assert elapsed < 10, f"the job took {elapsed:.1f} s to end after rank 1 raised"
    assert "[rank 1 s1 d0] ValueError: boom\n" in err
    assert "[rank 1 s1 d0] note: raised on purpose by launch_fail.py\n" in err
    log = tmp_path / "run" / "logs" / "rank1.log"
    assert f"varuna: rank 1 (stage 1, replica 0) failed: ValueError: boom — log: {log}" in err
    assert job.summary[0].startswith("varuna: rank 1 (stage 1, replica 0) failed: ValueError: boom")
    failure = json.loads((tmp_path / "run" / "failures" / "rank1.json").read_text())
    assert (failure["rank"], failure["stage"], failure["replica"]) == (1, 1, 0)
    assert (failure["type"], failure["message"]) == ("ValueError", "boom")
    assert 'launch_fail.py", line' in failure["traceback"] and "varuna/worker.py" not in failure["traceback"]
    assert "ValueError: boom" in log.read_text()
    assert json.loads((tmp_path / "run" / "status" / "rank1.json").read_text())["state"] == "failed"


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_a_sigkilled_rank_ends_the_job_and_is_named(tmp_path: Path) -> None:
    job, code, elapsed, out, err = _run_job(tmp_path, "kill")
    assert code != 0
    assert elapsed < 10, f"the job took {elapsed:.1f} s to end after rank 1 was killed"
    first = job.summary[0]
    assert first.startswith("varuna: rank 1 (stage 1, replica 0) "), job.summary
    assert "killed" in first and first in err
    assert "rank 1 about to kill at " in (tmp_path / "run" / "logs" / "rank1.log").read_text()
    assert not (tmp_path / "run" / "failures" / "rank1.json").exists()


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_a_job_past_its_timeout_is_stopped(tmp_path: Path) -> None:
    # --timeout counts from the launch, start-up included: 10 s leaves two ranks on a loaded 2-core
    # machine the time to import torch and reach the script's sleep, whose stacks the test reads
    job, code, elapsed, out, err = _run_job(tmp_path, "hang", timeout_s=10.0, grace_s=3.0)
    assert code == 124
    assert elapsed < 10.0 + 3.0 + 6.0
    assert "varuna: job ran past --timeout 10 s; stopping it" in err
    # before stopping them the launcher has each rank print where it waits (every thread's stack)
    assert "varuna: the Python stacks of ranks [0, 1] at the timeout:" in err
    for rank in (0, 1):  # each rank's, from its log, where it waits (the script's sleep)
        assert re.search(rf'\[rank {rank}\]\s+File ".*launch_fail\.py", line \d+ in main', err), err[-3000:]
        assert "most recent call first" in (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
    assert "varuna: job stopped by SIGTERM" in err
    assert json.loads((tmp_path / "run" / "job.json").read_text())["exit_code"] == 124


def test_mpiexec_command_mpich(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    env = {"A": "1", "VARUNA_EVENTS_KEY": "s3cret"}
    cmd = mpiexec_command(4, ["python", "-m", "varuna.launch.worker", "t.py"], hostfile=hosts, env=env)
    assert Path(cmd[0]).name == "mpiexec"
    assert cmd[1:] == [
        "-n",
        "4",
        "-f",
        str(hosts),
        "-genv",
        "A",
        "1",
        "-genvlist",
        "VARUNA_EVENTS_KEY",  # by name: the value stays in mpiexec's environment
        "python",
        "-m",
        "varuna.launch.worker",
        "t.py",
    ]


def test_mpiexec_command_open_mpi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec (Open MPI) 5.0.5'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("VARUNA_MPIEXEC", str(fake))
    launch.mpi_flavor.cache_clear()
    try:
        env = {"A": "1", "VARUNA_EVENTS_KEY": "s3cret", "TOKEN": "t0k"}
        cmd = mpiexec_command(2, ["python", "x.py"], hostfile=Path("h"), env=env, secret=frozenset({"TOKEN"}))
        default = mpiexec_command(1, ["x.py"], hostfile=None, env=env)
    finally:
        launch.mpi_flavor.cache_clear()
    assert cmd == [
        str(fake),
        "-n",
        "2",
        "--oversubscribe",
        "--hostfile",
        "h",
        "-x",
        "A=1",
        "-x",
        "VARUNA_EVENTS_KEY=s3cret",
        "-x",
        "TOKEN",
        "python",
        "x.py",
    ]
    assert default[-7:] == ["-x", "A=1", "-x", "VARUNA_EVENTS_KEY", "-x", "TOKEN=t0k", "x.py"]


@pytest.mark.timeout(90)
def test_a_rank_that_never_reaches_the_rendezvous_fails_the_job_after_the_timeout(tmp_path: Path) -> None:
    """Rank 1 starts MPI and then hangs before the rendezvous (as a rank stuck in an import would):
    rank 0 gives up after VARUNA_RENDEZVOUS_TIMEOUT_S with a LaunchError, and mpiexec ends rank 1."""
    import subprocess
    import sys

    marker = f"stuck-{uuid.uuid4().hex[:8]}"
    stuck = f"import mpi4py; mpi4py.rc.threads = False; from mpi4py import MPI; import time; time.sleep(60)  # {marker}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env |= {"VARUNA_RUN_DIR": str(tmp_path), "VARUNA_PIPELINE": "2", "VARUNA_RENDEZVOUS_TIMEOUT_S": "2"}
    env["MPIR_CVAR_NOLOCAL"] = "1"  # as the worker sets it: MPICH's ranks must agree on it
    mpiexec = str(launch.find_mpiexec())
    cmd = [mpiexec, "-n", "1", sys.executable, "-m", "varuna.launch.worker", FAIL]
    cmd += [":", "-n", "1", sys.executable, "-c", stuck]  # MPMD: rank 1 is the stuck one
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and time.monotonic() - start < 40
    failure = json.loads((tmp_path / "failures" / "rank0.json").read_text())
    assert failure["type"] == "LaunchError"
    assert failure["message"].startswith("rank 0 waited 2 s for all 2 ranks to reach the rendezvous")
    assert not _processes_with(marker)
