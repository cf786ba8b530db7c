"""Jobs inside a Slurm allocation: ``srun`` starts the ranks on the allocation's hosts and task slots.

Inside ``salloc`` or an ``sbatch`` script (``SLURM_JOB_ID`` set) and without ``--hostfile``, ``varuna run``
starts its P x D ranks as one job step::

    srun [VARUNA_SRUN_ARGS] --ntasks=P*D --kill-on-bad-exit=1 --mpi=none --export=ALL --unbuffered \\
        python -m varuna.launch.worker train.py ...

- Hosts and slots are the allocation's: ``SLURM_JOB_NODELIST`` and ``SLURM_TASKS_PER_NODE`` (one task
  slot per device: ``--ntasks-per-node`` = GPUs per node). A shape needing more ranks than the
  allocation has slots is refused before anything starts, and so is a ``varuna resize`` beyond it (the
  allocation is recorded in ``RUN_DIR/job.json``).
- ``--mpi=none``: the ranks meet through the run directory, not MPI (`varuna.comm.rendezvous`), so no
  PMI plugin or MPI build has to match the cluster's.
- ``--kill-on-bad-exit``: a failing rank takes the step down at once, as mpiexec does.
- ``varuna run --placement cyclic`` adds ``--distribution=cyclic``: srun deals the tasks to the step's
  nodes in turn, the planner's "cyclic" placement (the default, block, fills one node's slots first).
- A stop (Ctrl-C, SIGTERM, ``--timeout``) reaches every task through ``scancel --signal`` (`signal_step`),
  so the ranks checkpoint on SIGTERM as under mpiexec; srun itself would turn SIGTERM into SIGKILL.
- ``VARUNA_LAUNCHER=mpiexec`` keeps mpiexec inside an allocation, ``VARUNA_LAUNCHER=srun`` insists on
  srun; ``VARUNA_SRUN`` names the srun binary, ``VARUNA_SRUN_ARGS`` adds options (``--gpus-per-task=1``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from varuna._slurm import HostlistError, expand_hostlist, expand_tasks_per_node
from varuna.errors import ConfigError, LaunchError
from varuna.planner.cluster import Placement

__all__ = [
    "Allocation",
    "allocation",
    "launch_allocation",
    "check_fits",
    "srun_command",
    "find_srun",
    "recorded_allocation",
    "check_resize",
    "signal_step",
]

_LAUNCHERS = ("srun", "mpiexec")


@dataclass(frozen=True, slots=True)
class Allocation:
    """A Slurm allocation as its environment describes it: job id, hosts and task slots per host."""

    job_id: str
    hosts: tuple[str, ...]
    tasks: tuple[int, ...]
    """Task slots on each host of `hosts`, in the same order."""

    @property
    def slots(self) -> int:
        """Ranks the allocation holds: the sum of `tasks`."""
        return sum(self.tasks)

    def describe(self) -> str:
        """``Slurm job 12: 4 task slots on node1 (2), node2 (2)``."""
        where = ", ".join(f"{h} ({t})" for h, t in zip(self.hosts, self.tasks))
        return f"Slurm job {self.job_id}: {self.slots} task slots on {where}"

    def to_json(self) -> dict[str, Any]:
        """What job.json keeps, for `recorded_allocation`."""
        return {"job_id": self.job_id, "hosts": list(self.hosts), "tasks": list(self.tasks)}


def allocation(env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation this process runs in (``SLURM_JOB_ID`` set), else None."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        return None
    nodelist = (env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "").strip()
    per_node = (env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_JOB_CPUS_PER_NODE") or "").strip()
    if not nodelist or not per_node:
        raise ConfigError(
            f"SLURM_JOB_ID={job_id} is set but SLURM_JOB_NODELIST ({nodelist!r}) or SLURM_TASKS_PER_NODE "
            f"({per_node!r}) is not: run `varuna run` in the shell of salloc or an sbatch script, or unset "
            "SLURM_JOB_ID (or set VARUNA_LAUNCHER=mpiexec) to launch without Slurm"
        )
    try:
        hosts, tasks = expand_hostlist(nodelist), expand_tasks_per_node(per_node)
    except HostlistError as exc:
        raise ConfigError(f"cannot read Slurm job {job_id}'s hosts and slots: {exc}") from None
    if len(tasks) != len(hosts):
        raise ConfigError(
            f"Slurm job {job_id}: SLURM_JOB_NODELIST={nodelist!r} names {len(hosts)} hosts but "
            f"SLURM_TASKS_PER_NODE={per_node!r} gives {len(tasks)} counts; they must match"
        )
    return Allocation(job_id, tuple(hosts), tuple(tasks))


def launch_allocation(hostfile: Path | None, env: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation to launch in with srun, or None to launch with mpiexec (see the module docstring)."""
    env = os.environ if env is None else env
    choice = env.get("VARUNA_LAUNCHER", "").strip().lower()
    if choice and choice not in _LAUNCHERS:
        raise ConfigError(f"VARUNA_LAUNCHER must be 'srun' or 'mpiexec' (got {choice!r}); or unset it")
    if choice == "mpiexec":
        return None
    found = allocation(env)
    if choice == "srun":
        if found is None:
            raise ConfigError(
                "VARUNA_LAUNCHER=srun but SLURM_JOB_ID is not set: run inside `salloc` or an sbatch "
                "script, or unset VARUNA_LAUNCHER to launch with mpiexec"
            )
        if hostfile is not None:
            raise ConfigError(
                f"--hostfile {hostfile} with VARUNA_LAUNCHER=srun: srun takes the hosts from the "
                "allocation; drop --hostfile, or set VARUNA_LAUNCHER=mpiexec to use the hostfile"
            )
    return found if hostfile is None else None


def check_fits(world: int, alloc: Allocation, *, what: str) -> None:
    """A ConfigError when `world` ranks do not fit in the allocation's task slots."""
    if world > alloc.slots:
        raise ConfigError(
            f"{what} needs {world} ranks but {alloc.describe()}; ask for more tasks (sbatch/salloc "
            f"--ntasks={world}, or --nodes with --ntasks-per-node) or choose a shape of at most "
            f"{alloc.slots} ranks"
        )


def find_srun(env: Mapping[str, str] | None = None) -> str:
    """``VARUNA_SRUN``, else ``srun`` on PATH; a LaunchError when there is none."""
    env = os.environ if env is None else env
    named = env.get("VARUNA_SRUN", "").strip()
    found = named if named and os.access(named, os.X_OK) else shutil.which(named or "srun")
    if found is None:
        raise LaunchError(
            f"no `{named or 'srun'}` found (SLURM_JOB_ID is set, so varuna launches with srun): put Slurm's "
            "srun on PATH or name it in VARUNA_SRUN, or set VARUNA_LAUNCHER=mpiexec"
        )
    return found


def _srun_args(env: Mapping[str, str]) -> list[str]:
    raw = env.get("VARUNA_SRUN_ARGS", "")
    try:
        return shlex.split(raw)
    except ValueError as exc:
        raise ConfigError(
            f"VARUNA_SRUN_ARGS is not a valid list of shell words ({exc}): {raw!r}; quote as in a shell"
        ) from None


def srun_command(
    n: int, argv: list[str], env: Mapping[str, str] | None = None, *, placement: Placement = "block"
) -> list[str]:
    """The ``srun`` command line that starts `argv` as `n` tasks of one step; the environment goes
    through srun's own (``--export=ALL``), so no value (secrets included) is on the command line.
    ``placement="cyclic"`` deals the tasks to the nodes in turn (``--distribution=cyclic``)."""
    env = os.environ if env is None else env
    flags = ["--kill-on-bad-exit=1", "--mpi=none", "--export=ALL", "--unbuffered"]
    flags += ["--distribution=cyclic"] if placement == "cyclic" else []
    return [find_srun(env), *_srun_args(env), f"--ntasks={n}", *flags, *argv]


def signal_step(run_dir: Path, job_id: str, signum: int, env: Mapping[str, str] | None = None) -> bool:
    """Send `signum` to every task of launch `job_id`'s step, on every node (``scancel --signal``);
    False when the step is not known yet (rank 0 writes it to RUN_DIR/rendezvous.json) or scancel fails.

    srun itself is no messenger for a stop: it answers SIGTERM by killing the tasks (SIGKILL) and a
    single SIGINT by printing their state, while the ranks should checkpoint on SIGTERM.
    """
    try:
        record = json.loads((Path(run_dir) / "rendezvous.json").read_text())
    except (OSError, ValueError):
        return False
    step = str(record.get("slurm_step", "")) if record.get("job_id") == job_id else ""
    scancel = shutil.which("scancel", path=(os.environ if env is None else env).get("PATH"))
    if not re.fullmatch(r"\d+(_\d+)?\.\d+", step) or scancel is None:
        return False
    try:
        done = subprocess.run(
            [scancel, f"--signal={signal.Signals(signum).name.removeprefix('SIG')}", step],
            env=None if env is None else dict(env),
            capture_output=True,
            timeout=10,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def recorded_allocation(run_dir: Path) -> Allocation | None:
    """The allocation the job in `run_dir` was launched in (from its job.json), else None."""
    try:
        record = json.loads((Path(run_dir) / "job.json").read_text()).get("slurm")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(record, dict):
        return None
    try:
        return Allocation(
            str(record["job_id"]), tuple(record["hosts"]), tuple(int(t) for t in record["tasks"])
        )
    except (KeyError, TypeError, ValueError):
        return None


def check_resize(run_dir: Path, world: int, *, what: str) -> None:
    """A ConfigError when a job launched in an allocation is asked for more ranks than it holds."""
    alloc = recorded_allocation(run_dir)
    if alloc is not None:
        check_fits(world, alloc, what=what)
