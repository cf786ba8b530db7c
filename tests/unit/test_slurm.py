"""Slurm without a cluster: its notations, the allocation read from the environment, the launcher's
choice, the refusals, and the rank side of the run-directory rendezvous. The real cluster is
tests/multihost/test_multihost_slurm.py."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from varuna._env import patched_environ
from varuna._slurm import HostlistError, expand_hostlist, expand_tasks_per_node
from varuna.comm import rendezvous
from varuna.errors import ConfigError, LaunchError
from varuna.launch.slurm import (
    Allocation,
    allocation,
    check_fits,
    check_resize,
    launch_allocation,
    recorded_allocation,
    signal_step,
    srun_command,
)

ALLOC = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_TASKS_PER_NODE": "4(x2)"}


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("vm", ["vm"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        (
            "r[1-2]n[1-2],a,b[09-11]",
            ["r1n1", "r1n2", "r2n1", "r2n2", "a", "b09", "b10", "b11"],
        ),  # as scontrol
        ("n[8-10]", ["n8", "n9", "n10"]),
    ],
)
def test_hostlists_expand_as_scontrol_show_hostnames(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-", "n1]", "n[a]", "n[3-1]", ""])
def test_bad_hostlists_are_refused(text: str) -> None:
    with pytest.raises(HostlistError):
        expand_hostlist(text)


def test_tasks_per_node_expand() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("8") == [8]
    with pytest.raises(HostlistError, match="expected N or N\\(xK\\)"):
        expand_tasks_per_node("2(3)")


def test_allocation_from_the_environment() -> None:
    alloc = allocation(ALLOC)
    assert alloc == Allocation("42", ("gpu01", "gpu02"), (4, 4))
    assert alloc.slots == 8
    assert alloc.describe() == "Slurm job 42: 8 task slots on gpu01 (4), gpu02 (4)"
    assert allocation({}) is None
    with pytest.raises(ConfigError, match="names 2 hosts but SLURM_TASKS_PER_NODE='4' gives 1 counts"):
        allocation({**ALLOC, "SLURM_TASKS_PER_NODE": "4"})
    with pytest.raises(ConfigError, match="SLURM_JOB_ID=42 is set but SLURM_JOB_NODELIST"):
        allocation({"SLURM_JOB_ID": "42"})


def test_the_launcher_follows_the_allocation_unless_told(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    assert launch_allocation(None, ALLOC) == allocation(ALLOC)
    assert launch_allocation(hostfile, ALLOC) is None  # a hostfile is the user's choice: mpiexec
    assert launch_allocation(None, {**ALLOC, "VARUNA_LAUNCHER": "mpiexec"}) is None
    assert launch_allocation(None, {}) is None
    with pytest.raises(ConfigError, match="VARUNA_LAUNCHER=srun but SLURM_JOB_ID is not set"):
        launch_allocation(None, {"VARUNA_LAUNCHER": "srun"})
    with pytest.raises(ConfigError, match="srun takes the hosts from the allocation; drop --hostfile"):
        launch_allocation(hostfile, {**ALLOC, "VARUNA_LAUNCHER": "srun"})
    with pytest.raises(ConfigError, match="must be 'srun' or 'mpiexec' \\(got 'pbs'\\)"):
        launch_allocation(None, {"VARUNA_LAUNCHER": "pbs"})


def test_a_shape_beyond_the_allocation_is_refused_with_the_numbers() -> None:
    alloc = allocation(ALLOC)
    assert alloc is not None
    check_fits(8, alloc, what="pipeline 4 x data 2")
    with pytest.raises(ConfigError, match="pipeline 3 x data 3 needs 9 ranks but Slurm job 42: 8 task slots"):
        check_fits(9, alloc, what="pipeline 3 x data 3")


def test_srun_command_keeps_values_off_the_command_line(tmp_path: Path) -> None:
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {"VARUNA_SRUN": str(fake), "VARUNA_SRUN_ARGS": "--gpus-per-task=1 --partition 'big one'"}
    cmd = srun_command(4, ["python", "-m", "varuna.launch.worker", "t.py"], env)
    assert cmd == [
        str(fake),
        "--gpus-per-task=1",
        "--partition",
        "big one",
        "--ntasks=4",
        "--kill-on-bad-exit=1",
        "--mpi=none",
        "--export=ALL",
        "--unbuffered",
        "python",
        "-m",
        "varuna.launch.worker",
        "t.py",
    ]
    cyclic = srun_command(4, ["python", "-m", "varuna.launch.worker", "t.py"], env, placement="cyclic")
    assert cyclic == [*cmd[:9], "--distribution=cyclic", *cmd[9:]]  # tasks dealt to the nodes in turn
    with pytest.raises(ConfigError, match="VARUNA_SRUN_ARGS is not a valid list of shell words"):
        srun_command(1, ["x"], {**env, "VARUNA_SRUN_ARGS": "'open"})
    with pytest.raises(LaunchError, match="no `/nowhere/srun` found"):
        srun_command(1, ["x"], {"VARUNA_SRUN": "/nowhere/srun"})


def test_resize_stays_inside_the_recorded_allocation(tmp_path: Path) -> None:
    check_resize(tmp_path, 64, what="--gpus 64")  # no job.json: not a Slurm job, nothing to check
    (tmp_path / "job.json").write_text(json.dumps({"slurm": allocation(ALLOC).to_json()}))  # type: ignore[union-attr]
    assert recorded_allocation(tmp_path) == allocation(ALLOC)
    check_resize(tmp_path, 8, what="--gpus 8")
    with pytest.raises(ConfigError, match="--gpus 9 needs 9 ranks but Slurm job 42: 8 task slots on gpu01"):
        check_resize(tmp_path, 9, what="--gpus 9")


def test_rendezvous_waits_for_this_launchs_address_only(tmp_path: Path) -> None:
    path = tmp_path / "rendezvous.json"
    path.write_text(json.dumps({"job_id": "earlier", "host": "127.0.0.1", "port": 1}))
    with pytest.raises(LaunchError, match="rank 3 waited 0.3 s for rank 0 to write the rendezvous address"):
        rendezvous._await_address(path, "now", 3, 0.3)
    path.write_text(json.dumps({"job_id": "now", "host": "10.0.0.1", "port": 2345}))
    assert rendezvous._await_address(path, "now", 3, 0.3) == ("10.0.0.1", 2345)


def test_srun_tasks_need_the_run_dir_and_job_id() -> None:
    env = {"VARUNA_LAUNCHER": "srun", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}
    with patched_environ({**env, "VARUNA_RUN_DIR": None, "VARUNA_JOB_ID": None}):
        assert rendezvous._under_srun()
        with pytest.raises(ConfigError, match="needs VARUNA_RUN_DIR"):
            rendezvous._srun_store(rendezvous._timeout(5.0))
    with patched_environ({"VARUNA_LAUNCHER": None, "SLURM_PROCID": "0"}):  # an sbatch script's own shell
        assert not rendezvous._under_srun()


def test_a_stop_goes_to_the_step_only_once_rank_0_named_it(tmp_path: Path) -> None:
    fake = tmp_path / "scancel"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "said"}\n')
    fake.chmod(0o755)
    env = {"PATH": str(tmp_path)}
    assert not signal_step(tmp_path, "now", 15, env)  # no rendezvous.json yet: the caller signals srun
    (tmp_path / "rendezvous.json").write_text(json.dumps({"job_id": "earlier", "slurm_step": "7.0"}))
    assert not signal_step(tmp_path, "now", 15, env)  # another launch's step
    (tmp_path / "rendezvous.json").write_text(json.dumps({"job_id": "now", "slurm_step": "7.1"}))
    assert signal_step(tmp_path, "now", 15, env)
    assert (tmp_path / "said").read_text().split() == ["--signal=TERM", "7.1"]
