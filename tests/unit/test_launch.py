"""Tests of varuna/launch.py, varuna/worker.py and varuna/cli.py.

Pure tests first (command lines, the line tee, CLI validation), then four real 2-rank jobs under
the mpich wheel's mpiexec: success, a raising rank, a SIGKILLed rank, a timeout. Every job must end
promptly and leave no process behind.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from varuna import cli
from varuna.errors import ConfigError, LaunchError
from varuna.launch import job as launch
from varuna.launch.job import Job, mpiexec_command, summarise
from varuna.launch.worker import LineTee

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
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


# --- mpiexec command lines -------------------------------------------------------------------------


def test_mpiexec_command_mpich(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    cmd = mpiexec_command(4, ["python", "-m", "varuna.launch.worker", "t.py"], hostfile=hosts, env={"A": "1"})
    assert Path(cmd[0]).name == "mpiexec"
    assert cmd[1:] == [
        "-n",
        "4",
        "-f",
        str(hosts),
        "-genv",
        "A",
        "1",
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
        cmd = mpiexec_command(2, ["python", "x.py"], hostfile=Path("h"), env={"A": "1"})
    finally:
        launch.mpi_flavor.cache_clear()
    assert cmd == [str(fake), "-n", "2", "--oversubscribe", "--hostfile", "h", "-x", "A=1", "python", "x.py"]


def test_no_mpiexec_says_how_to_get_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VARUNA_MPIEXEC", raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match=r"pip install mpich.*cluster's MPI module"):
        mpiexec_command(1, ["x"], hostfile=None, env={})


# --- the worker's line tee -------------------------------------------------------------------------


def test_line_tee_prefixes_whole_lines_and_keeps_terminators() -> None:
    console, log = io.StringIO(), io.StringIO()
    tee = LineTee(console, log, "[r1] ")
    tee.write("par")
    tee.write("tial\nnext")
    assert console.getvalue() == "[r1] partial\n"
    tee.write(" line\n\n")
    tee.write("\r 10%\r 20%\r")  # a progress bar: "\r" ends a piece, the prefix follows it
    tee.write("\n")  # completes " 20%\r" as one "\r\n" terminator
    tee.write("dos\r")
    tee.write("\nend")
    tee.drain()
    assert console.getvalue() == (
        "[r1] partial\n[r1] next line\n[r1] \n\r[r1]  10%\r[r1]  20%\r\n[r1] dos\r\n[r1] end\n"
    )
    assert log.getvalue() == "partial\nnext line\n\n\r 10%\r 20%\r\ndos\r\nend\n"


# --- the post-mortem ---------------------------------------------------------------------------


def _reports(run_dir: Path, states: dict[int, str], failures: dict[int, tuple[str, str, float]]) -> None:
    for sub in ("status", "failures", "logs"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    for rank, state in states.items():
        status = {"rank": rank, "state": state, "pid": 1000 + rank, "host": "h1", "time": 0.0}
        (run_dir / "status" / f"rank{rank}.json").write_text(json.dumps(status))
    for rank, (kind, message, at) in failures.items():
        record = {"rank": rank, "type": kind, "message": message, "traceback": "", "time": at}
        (run_dir / "failures" / f"rank{rank}.json").write_text(json.dumps(record))


GLOO_LOST = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:4711. This is typically caused by a remote worker crashing. Check the logs of the remote worker."
)


def test_summary_blames_the_first_death_not_the_ranks_it_took_down(tmp_path: Path) -> None:
    # rank 1 was SIGKILLed; rank 3's gloo error beat the launcher's clock; mpiexec killed 0 and 2
    _reports(
        tmp_path,
        {0: "running", 1: "running", 2: "running", 3: "failed"},
        {3: ("RuntimeError", GLOO_LOST, 9.9)},
    )
    banner = "=   PID 1000 RUNNING AT h1\n=   EXIT CODE: 9\n... Killed (signal 9)"  # hydra names a victim
    lines = summarise(tmp_path, 2, 4, deaths=[(10.0, [1]), (10.1, [0, 2])], console=banner, mpiexec_code=9)
    log = tmp_path / "logs"
    assert lines == [
        f"varuna: rank 1 (stage 1, replica 0) died without a Python exception (killed, e.g. SIGKILL, or os._exit) — log: {log}/rank1.log",
        f"varuna: rank 3 (stage 1, replica 1) also failed (after rank 1): RuntimeError: {GLOO_LOST[:120]}... — log: {log}/rank3.log",
        "varuna: ranks 0, 2 stopped by mpiexec after rank 1",
    ]
    lines = summarise(tmp_path, 2, 4, deaths=[(10.0, [0]), (10.1, [1, 2])], console=banner, mpiexec_code=9)
    assert (
        lines[0]
        == f"varuna: rank 0 (stage 0, replica 0) was killed by signal 9 (SIGKILL) — log: {log}/rank0.log"
    )


def test_summary_puts_an_exception_before_the_deaths_it_caused(tmp_path: Path) -> None:
    _reports(tmp_path, {0: "running", 1: "failed"}, {1: ("ValueError", "boom", 5.0)})
    (tmp_path / "logs" / "rank0.log").write_text("Fatal Python error: Segmentation fault\n")
    lines = summarise(tmp_path, 1, 2, deaths=[(5.2, [1]), (5.3, [0])], console="", mpiexec_code=1)
    assert lines == [
        f"varuna: rank 1 (stage 0, replica 1) failed: ValueError: boom — log: {tmp_path}/logs/rank1.log",
        "varuna: rank 0 stopped by mpiexec after rank 1",
    ]
    # seen from afar (no deaths observed, survivors lost a peer): the dead rank is named, with what its log says
    _reports(tmp_path, {0: "running", 1: "failed"}, {1: ("RuntimeError", GLOO_LOST, 5.0)})
    lines = summarise(tmp_path, 1, 3, deaths=[], console="", mpiexec_code=1)
    assert lines == [
        f"varuna: rank 0 (stage 0, replica 0) crashed: Fatal Python error: Segmentation fault — log: {tmp_path}/logs/rank0.log",
        f"varuna: rank 1 (stage 0, replica 1) also failed (after rank 0): RuntimeError: {GLOO_LOST[:120]}... — log: {tmp_path}/logs/rank1.log",
    ]


# --- CLI validation (in process: no jobs start) ----------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--pipeline", "0", FAIL], r"--pipeline must be an integer >= 1 \(got 0\)"),
        (["run", "--pipeline", "1", "--data", "-2", FAIL], r"--data must be an integer >= 1 \(got -2\)"),
        (["run", "--pipeline", "2", "no_such_script.py"], r"script not found: no_such_script.py"),
        (["run", "--pipeline", "2", "-m", "no_such_module_xyz"], r"module 'no_such_module_xyz' not found"),
        (["run", "--pipeline", "2", "--hostfile", "nope.txt", FAIL], r"hostfile not found: nope.txt"),
        (["run", "--pipeline", "2"], r"nothing to run"),
        (["run", "--pipeline", "2", "--timeout", "0", FAIL], r"--timeout must be > 0 seconds"),
    ],
)
def test_cli_errors_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("varuna: error: ")
    assert "Traceback" not in err
    assert re.search(message, err), err


@pytest.mark.parametrize(
    ("argv", "head", "target"),
    [
        (
            ["run", "-p", "2", "-m", "pkg.train", "--data", "8"],
            ["run", "-p", "2", "-m", "pkg.train"],
            ["--data", "8"],
        ),
        (
            ["run", "--pipeline=2", "-d", "2", "t.py", "-p", "7"],
            ["run", "--pipeline=2", "-d", "2"],
            ["t.py", "-p", "7"],
        ),
        (["run", "-p", "2", "--", "t.py", "-h"], ["run", "-p", "2"], ["t.py", "-h"]),
        (["run", "-p", "2"], ["run", "-p", "2"], []),
    ],
)
def test_cli_passes_everything_after_the_target_through(
    argv: list[str], head: list[str], target: list[str]
) -> None:
    assert cli._split_target(argv, cli._parsers()[1]) == (head, target)


def test_job_validates_before_starting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--pipeline must be an integer >= 1 \(got 0\)"):
        Job([FAIL], pipeline=0, data=1, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


# --- real jobs -------------------------------------------------------------------------------------


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_two_rank_run_through_the_cli(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    script = str(SCRIPTS / "launch_allreduce.py")
    argv = [sys.executable, "-m", "varuna", "run", "--pipeline", "2", "--run-dir", "run", script]
    argv += ["--pipeline", "7", "x"]  # the script's own arguments pass through untouched
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
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
    elapsed = time.monotonic() - start
    assert _processes_with(marker) == []
    return job, code, elapsed, out.getvalue(), err.getvalue()


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_a_raising_rank_ends_the_job_and_is_named(tmp_path: Path) -> None:
    job, code, elapsed, out, err = _run_job(tmp_path, "raise")
    assert code == 1
    assert elapsed < 20, f"the job took {elapsed:.1f} s to end after rank 1 raised"
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
    assert elapsed < 20, f"the job took {elapsed:.1f} s to end after rank 1 was killed"
    first = job.summary[0]
    assert first.startswith("varuna: rank 1 (stage 1, replica 0) "), job.summary
    assert "killed" in first and first in err
    assert "rank 1 about to kill" in (tmp_path / "run" / "logs" / "rank1.log").read_text()
    assert not (tmp_path / "run" / "failures" / "rank1.json").exists()


@pytest.mark.multirank
@pytest.mark.timeout(90)
def test_a_job_past_its_timeout_is_stopped(tmp_path: Path) -> None:
    job, code, elapsed, out, err = _run_job(tmp_path, "hang", timeout_s=4.0, grace_s=3.0)
    assert code == 124
    assert elapsed < 4.0 + 3.0 + 6.0
    assert "varuna: job ran past --timeout 4 s; stopping it" in err
    assert "varuna: job stopped by SIGTERM" in err
    assert json.loads((tmp_path / "run" / "job.json").read_text())["exit_code"] == 124
