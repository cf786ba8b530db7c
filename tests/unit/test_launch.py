"""Tests of varuna/launch.py, varuna/worker.py and varuna/cli.py that start no process: the missing
mpiexec, the line tee, the post-mortem, CLI validation, the placement of ranks on hosts. The mpiexec command lines (which ask
`mpiexec --version`) and the real 2-rank jobs are in tests/multirank/test_launch_jobs.py.
"""

from __future__ import annotations

import io
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _helpers import SCRIPTS

from varuna import cli
from varuna.controller import JobController
from varuna.elastic import agent, supervisor
from varuna.elastic.protocol import Shape
from varuna.errors import ConfigError, LaunchError
from varuna.launch import job as job_module
from varuna.launch.hostfile import filled_hosts
from varuna.launch.job import CYCLIC_HOSTFILE, Job, mpiexec_command, summarise
from varuna.launch.worker import LineTee
from varuna.planner.cluster import Placement

FAIL = str(SCRIPTS / "launch_fail.py")


# --- a missing mpiexec ----------------------------------------------------------------------------


def test_no_mpiexec_says_how_to_get_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VARUNA_MPIEXEC", raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match=r"pip install mpich.*cluster's MPI module"):
        mpiexec_command(1, ["x"], hostfile=None, env={})


def test_mpiexec_args_go_before_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARUNA_MPIEXEC_ARGS", "-launcher ssh -launcher-exec '/opt/my ssh'")
    cmd = mpiexec_command(2, ["x.py"], hostfile=None, env={})
    assert cmd[1:6] == ["-launcher", "ssh", "-launcher-exec", "/opt/my ssh", "-n"]


def test_badly_quoted_mpiexec_args_say_which_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("VARUNA_MPIEXEC_ARGS", "-launcher-exec '/opt/my ssh")
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(
        ConfigError, match=r"VARUNA_MPIEXEC_ARGS is not a valid list of shell words.*quote as in a shell"
    ):
        Job([str(script)], pipeline=1, data=1, run_dir=tmp_path / "run")


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


# --- placement: where the ranks go (--placement block|cyclic) ---------------------------------------


@pytest.fixture
def flavor(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Pretend the mpiexec found is MPICH's hydra or Open MPI's (no `mpiexec --version` is run)."""
    monkeypatch.setattr(job_module, "find_mpiexec", lambda: Path("/opt/mpi/bin/mpiexec"))
    monkeypatch.delenv("VARUNA_MPIEXEC_ARGS", raising=False)

    def use(name: str) -> None:
        monkeypatch.setattr(job_module, "mpi_flavor", lambda exe: name)

    return use


@pytest.mark.parametrize(
    ("mpi", "placement", "flags"),
    [
        ("mpich", "block", ["-f", "hosts"]),
        ("mpich", "cyclic", ["-f", "hosts", "-ppn", "1"]),  # every host one slot: dealt in turn, wrapping
        ("openmpi", "block", ["--oversubscribe", "--hostfile", "hosts"]),
        ("openmpi", "cyclic", ["--oversubscribe", "--map-by", "node", "--hostfile", "hosts"]),
    ],
)
def test_mpiexec_command_places_ranks_as_asked(
    flavor: Callable[[str], None], mpi: str, placement: Placement, flags: list[str]
) -> None:
    flavor(mpi)
    cmd = mpiexec_command(4, ["w.py"], hostfile=Path("hosts"), env={}, placement=placement)
    assert cmd == ["/opt/mpi/bin/mpiexec", "-n", "4", *flags, "w.py"]


@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_cyclic_without_a_hostfile_is_one_host_and_changes_nothing(
    flavor: Callable[[str], None], mpi: str
) -> None:
    flavor(mpi)
    block = mpiexec_command(4, ["w.py"], hostfile=None, env={"A": "1"})
    assert mpiexec_command(4, ["w.py"], hostfile=None, env={"A": "1"}, placement="cyclic") == block


def test_a_placement_that_is_neither_block_nor_cyclic_is_refused(
    flavor: Callable[[str], None], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flavor("mpich")
    message = r"--placement 'round-robin' is not one of 'block', 'cyclic': 'block' fills the hosts"
    with pytest.raises(ConfigError, match=message):
        mpiexec_command(4, ["w.py"], hostfile=None, env={}, placement="round-robin")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        Job([FAIL], pipeline=2, data=2, run_dir=tmp_path / "r", placement="round-robin")  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match="2"):
        cli.main(["run", "-p", "2", "--placement", "round-robin", FAIL])
    assert (
        "--placement: invalid choice: 'round-robin' (choose from 'block', 'cyclic')"
        in capsys.readouterr().err
    )


def test_cyclic_deals_only_to_the_hosts_the_ranks_fill(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("h1:2\nh2 slots=2\nh3:2\n")
    assert filled_hosts(hosts, 4) == {"h1": 2, "h2": 2}
    assert filled_hosts(hosts, 5) == filled_hosts(hosts, 9) == {"h1": 2, "h2": 2, "h3": 2}
    cyclic = Job([FAIL], pipeline=2, data=2, run_dir=tmp_path / "r", hostfile=hosts, placement="cyclic")
    cyclic.run_dir.mkdir()
    used = cyclic._launch_hostfile()  # h3 is spare: -ppn 1 would put rank 2 there, not on h1
    assert used == cyclic.run_dir / CYCLIC_HOSTFILE and used.read_text() == "h1\nh2\n"
    assert Job([FAIL], pipeline=3, data=2, hostfile=hosts, placement="cyclic")._launch_hostfile() == hosts
    assert Job([FAIL], pipeline=2, data=2, hostfile=hosts)._launch_hostfile() == hosts  # block: as given


def _capture(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> dict[str, Any]:
    """Replace `module.name` by a function that records its keyword arguments and returns 0."""
    seen: dict[str, Any] = {}

    def fake(*args: object, **kwargs: object) -> int:
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(module, name, fake)
    return seen


@pytest.mark.parametrize(
    ("flags", "module", "name"),
    [
        ([], job_module, "run_job"),
        (["--elastic"], supervisor, "run_elastic"),
        (["--elastic", "--watch-hosts", "--hostfile", "hosts"], agent, "run_foreground"),
    ],
)
def test_cli_passes_the_placement_to_every_launcher(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], module: object, name: str
) -> None:
    seen = _capture(monkeypatch, module, name)
    argv = ["run", "-p", "2", "-d", "2", *flags, "--placement", "cyclic", FAIL, "--placement", "x"]
    assert cli.main(argv) == 0
    assert seen["placement"] == "cyclic"  # the script's own --placement x stays the script's
    assert cli.main(["run", "-p", "2", "-d", "2", *flags, FAIL]) == 0
    assert seen["placement"] == "block"


def test_every_launch_of_a_job_keeps_its_placement(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # varuna run -> Job; varuna run --elastic -> each run_job
    made: list[Job] = []

    class Started(Job):
        def start(self) -> None:
            made.append(self)
            self.state = "after"

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(job_module, "Job", Started)
    code = job_module.run_job([FAIL], pipeline=2, data=2, run_dir=None, hostfile=None, placement="cyclic")
    assert code == 0 and made[-1].placement == "cyclic"
    relaunch = _capture(monkeypatch, supervisor, "run_job")
    assert supervisor.run_elastic([FAIL], pipeline=2, data=2, run_dir=tmp_path / "b", placement="cyclic") == 0
    assert relaunch["placement"] == "cyclic"
    # the agent (varuna run --elastic --watch-hosts, JobController) builds every launch from its spec
    spec = {"argv": [FAIL], "pipeline": 2, "data": 2, "hostfile": None, "placement": "cyclic"}
    assert agent.Agent(tmp_path / "c", spec).make_job(Shape(2, 1), None).placement == "cyclic"
    del spec["placement"]  # a spec written before --placement existed
    assert agent.Agent(tmp_path / "d", spec).make_job(Shape(2, 2), None).placement == "block"
    # a resume of a run that `varuna run` started reads the placement from its job.json
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "job.json").write_text(
        json.dumps({"argv": [FAIL], "pipeline": 2, "data": 2, "placement": "cyclic"})
    )
    assert agent.relaunch_spec(tmp_path / "e")["placement"] == "cyclic"


def test_controller_start_puts_the_placement_in_the_agents_spec(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    specs: list[dict[str, Any]] = []
    monkeypatch.setattr(JobController, "_launch_agent", lambda self, spec, *_: specs.append(spec))
    JobController.start([FAIL], pipeline=2, data=2, run_dir=tmp_path / "run", placement="cyclic").close()
    assert specs[0]["placement"] == "cyclic"
    with pytest.raises(ConfigError, match=r"--placement 'ring' is not one of"):
        JobController.start([FAIL], pipeline=2, data=2, run_dir=tmp_path / "run", placement="ring")  # type: ignore[arg-type]
