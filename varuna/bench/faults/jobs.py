"""Fault-bench cases that need real multi-rank jobs (skipped by --quick).

One 2-rank job under a `JobController` in this process serves the cases in order: the key on no
command line and in no file but controller.json, the store on loopback, forged messages to the live
controller, a SIGSTOPped rank reported silent and back, and last a SIGKILLed worker failing the job.
A second job is started by a child process that is then SIGKILLed (the job goes on), attached to, and
its agent SIGKILLed (the job fails, saying so). A few small launches cover the rendezvous timeout,
SIGUSR1 before Varuna() and a crash relaunched by max_restarts. Every process a job started is found
by its VARUNA_JOB_ID and killed in `close()`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

from varuna.bench import bench_env
from varuna.bench.faults.case import Case, Result, cli, first_line, wait_for
from varuna.launch.pids import job_processes

TRAIN = Path(__file__).resolve().parent / "train.py"


class Jobs:
    """The jobs the cases share, started on first use; `close()` ends them and all they started."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.controllers: list[Any] = []
        self.job_ids: set[str] = set()
        self.children: list[subprocess.Popen[Any]] = []
        self._shared: Any = None
        self._starter: tuple[Any, Result] | None = None

    def folder(self, name: str) -> Path:
        assert self.root is not None, "Jobs.root is set by the bench before any case runs"
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def track(self, ctl: Any) -> Any:
        self.controllers.append(ctl)
        return ctl

    def note(self, ctl: Any) -> None:
        """Remember every launch's id, for the clean-up."""
        for event in ctl.store.events("job_start"):
            self.job_ids.add(event["job"])
        if ctl.job is not None:
            self.job_ids.add(ctl.job.job_id)

    def shared(self) -> Any:
        """The 2-rank job (running), started on first use."""
        from varuna.controller import JobController

        if self._shared is None:
            run = self.folder("shared") / "run"
            argv = [str(TRAIN), "100000", "0.05", "--store-report", str(run.parent / "store.json")]
            with_env = {"OMP_NUM_THREADS": "1"}
            self._shared = self.track(
                JobController.start(argv, pipeline=2, data=1, run_dir=run, grace_s=5.0, env=with_env)
            )
            state = self._shared.wait(120, states=("running", "failed"))
            self.note(self._shared)
            if state != "running" or not wait_for(
                lambda: all(r.steps >= 2 for r in self._shared.ranks()), 60
            ):
                raise RuntimeError(f"the shared 2-rank job did not train (state {state}); see {run / 'logs'}")
        return self._shared

    def close(self) -> None:
        for ctl in self.controllers:
            try:
                self.note(ctl)
                if ctl.state not in ("stopped", "failed", "finished"):
                    ctl.stop(checkpoint=False, timeout=20)
            except Exception:  # noqa: BLE001 - clean-up goes on; the processes are killed below
                pass
            ctl.close()
        for child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait()
        for job_id in self.job_ids:
            for pid in job_processes(job_id):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


JOBS = Jobs()


# --- the shared 2-rank job ------------------------------------------------------------------------


def key_on_no_command_line(tmp: Path) -> Result:
    ctl = JOBS.shared()
    procs = job_processes(ctl.job.job_id)
    ranks = [pid for pid, argv in procs.items() if argv[1:3] == ["-m", "varuna.launch.worker"]]
    leaks = [pid for pid, argv in procs.items() if any(ctl.key in arg for arg in argv)]
    by_env = sum(ctl.key.encode() in Path(f"/proc/{pid}/environ").read_bytes() for pid in ranks)
    ok = len(ranks) == 2 and not leaks and by_env == 2
    return (
        ok,
        f"{len(procs)} processes of the job, {len(ranks)} ranks; key in {len(leaks)} command lines, in {by_env} ranks' environment",
    )


def key_in_no_other_file(tmp: Path) -> Result:
    ctl = JOBS.shared()
    files = [p for p in ctl.run_dir.rglob("*") if p.is_file()]
    holders = [p.name for p in files if ctl.key.encode() in p.read_bytes()]
    mode = (ctl.run_dir / "controller.json").stat().st_mode & 0o777
    ok = holders == ["controller.json"] and mode == 0o600 and (ctl.run_dir / "job.json") in files
    return ok, f"{len(files)} files in the run dir; key in {holders} (mode {mode:o}); job.json has none"


def store_on_loopback(tmp: Path) -> Result:
    ctl = JOBS.shared()
    report = json.loads((ctl.run_dir.parent / "store.json").read_text())
    return report["listen"] == ["127.0.0.1"], f"TCPStore port {report['port']} listens on {report['listen']}"


def live_controller_drops_forgeries(tmp: Path) -> Result:
    import zmq

    from varuna.telemetry import events as ev

    ctl = JOBS.shared()
    key, sender = bytes.fromhex(ctl.key), ev.Sender("intruder")
    before = dict(ctl.dropped_messages())
    push: Any = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.connect(ctl.events_address)
        payload = json.dumps(sender.stamp({"type": "bench_probe", "id": [1]})).encode()
        push.send_multipart([ev.sign(key, payload), payload])  # signed, malformed
        push.send_multipart([b"0" * 64, b"y" * (ev.MAX_MESSAGE_BYTES + 1)])  # oversize
        probe = ev.encode(key, sender.stamp({"type": "bench_probe"}))
        push.send_multipart(probe)
        push.send_multipart(probe)  # its replay
        push.send_multipart(ev.encode(b"a guessed key", sender.stamp({"type": "bench_probe"})))

        def new() -> dict[str, int]:
            now = ctl.dropped_messages()
            return {k: now[k] - before.get(k, 0) for k in now if now[k] != before.get(k, 0)}

        want = {"malformed": 1, "too_big": 1, "replay": 1, "bad_signature": 1}
        wait_for(lambda: new() == want, 10)
        count = ctl.store.count
        alive = wait_for(lambda: ctl.store.count > count + 2, 20)  # the ranks' own events still arrive
    finally:
        push.close(linger=0)
    return (
        new() == want and alive,
        f"dropped {new()}; the ranks' events {'still arrive' if alive else 'STOPPED'}",
    )


def stopped_rank_is_silent(tmp: Path) -> Result:
    ctl = JOBS.shared()
    pid = {r.rank: r.pid for r in ctl.ranks()}[1]
    wait_for(lambda: ctl.liveness.actions().get(1) is not None, 10)  # its first heartbeat is in
    ctl.liveness.silent_after_s = 2.0
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            seen = wait_for(lambda: [s.rank for s in ctl.silent_ranks()] == [1], 15)
            after = time.monotonic() - t0
            silent = ctl.silent_ranks()
        finally:
            os.kill(pid, signal.SIGCONT)
        back = wait_for(lambda: ctl.silent_ranks() == [], 15)
    finally:
        ctl.liveness.silent_after_s = 10.0
    if not seen or not silent:
        return False, f"not reported silent within 15 s (silent: {silent})"
    s = silent[0]
    ok = s.host == socket.gethostname() and bool(s.last_action) and back and ctl.state == "running"
    return ok, (
        f"rank 1 silent after {after:.1f} s on {s.host}, last action {s.last_action!r}; "
        f"{'back' if back else 'NOT back'} after SIGCONT"
    )


def killed_worker_fails_the_job(tmp: Path) -> Result:
    ctl = JOBS.shared()
    pid = {r.rank: r.pid for r in ctl.ranks()}[1]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    state = ctl.wait(60)
    took = time.monotonic() - t0
    first = [(d.rank, d.how) for d in ctl.dead_ranks() if d.first]
    summary = ctl.summary()[0] if ctl.summary() else ""
    ok = state == "failed" and first == [(1, "killed")] and "rank 1" in summary
    return ok, f"{state} after {took:.1f} s; first dead {first}; {summary.strip()[:120]}"


# --- a job whose starter dies, then its agent -----------------------------------------------------

STARTER = """
import sys, time
from varuna.controller import JobController
JobController.start([sys.argv[1], "100000", "0.1"], pipeline=1, data=1, run_dir=sys.argv[2], grace_s=2.0)
print("started", flush=True)
time.sleep(600)
"""


def _console(run: Path) -> str:
    path = run / "logs" / "console.log"
    return path.read_text(errors="replace") if path.exists() else ""


def starter_dies(tmp: Path) -> Result:
    from varuna.controller import JobController

    if JOBS._starter is not None:
        return JOBS._starter[1]
    run = JOBS.folder("starter") / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(STARTER), str(TRAIN), str(run)],
        env=bench_env(60),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    JOBS.children.append(proc)
    if not wait_for(lambda: "step 3 " in _console(run), 120):
        proc.kill()
        result: Result = (False, f"the job never reached step 3; see {run / 'logs'}")
        JOBS._starter = (None, result)
        return result
    proc.kill()  # as a crashing notebook kernel
    proc.wait(10)
    before = _console(run).count("loss")
    goes_on = wait_for(lambda: _console(run).count("loss") >= before + 3, 30)
    ctl = JOBS.track(JobController.attach(run))
    JOBS.note(ctl)
    ok = goes_on and ctl.state == "running"
    after = _console(run).count("loss")
    result = ok, f"starter SIGKILLed at {before} steps; {after} steps now; attach sees {ctl.state}"
    JOBS._starter = (ctl, result)
    return result


def agent_dies(tmp: Path) -> Result:
    from varuna.elastic import agent

    starter_dies(tmp)
    assert JOBS._starter is not None
    ctl = JOBS._starter[0]
    if ctl is None or ctl.state != "running":
        return False, "no running job to test (the starter case failed)"
    pid = (agent.read_state(ctl.run_dir) or {}).get("pid")
    if not isinstance(pid, int):
        return False, "the agent wrote no pid in its state"
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    state = ctl.wait(15)
    took = time.monotonic() - t0
    error = ctl.error or ""
    ok = state == "failed" and f"pid {pid}" in error and "agent.log" in error
    return ok, f"{state} after {took:.1f} s: {error[:110]}"


# --- small launches -------------------------------------------------------------------------------


def rendezvous_timeout(tmp: Path) -> Result:
    from varuna.launch.job import find_mpiexec

    marker = f"varuna-bench-stuck-{os.getpid()}"
    stuck = f"import mpi4py; mpi4py.rc.threads = False; from mpi4py import MPI; import time; time.sleep(60)  # {marker}"
    env = bench_env(60) | {
        "VARUNA_RUN_DIR": str(tmp),
        "VARUNA_PIPELINE": "2",
        "VARUNA_RENDEZVOUS_TIMEOUT_S": "2",
        "MPIR_CVAR_NOLOCAL": "1",
    }
    cmd = [str(find_mpiexec()), "-n", "1", sys.executable, "-m", "varuna.launch.worker", str(TRAIN), "1", "0"]
    cmd += [":", "-n", "1", sys.executable, "-c", stuck]  # MPMD: rank 1 hangs before the rendezvous
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=90
        )
        code: int | str = done.returncode
    except subprocess.TimeoutExpired:
        code = "TIMEOUT (hung)"
    took = time.monotonic() - t0
    path = tmp / "failures" / "rank0.json"
    failure = json.loads(path.read_text()) if path.exists() else {}
    message = str(failure.get("message", "")).splitlines()[0] if failure else "no failure record"
    ok = (
        code not in (0, "TIMEOUT (hung)") and failure.get("type") == "LaunchError" and "rendezvous" in message
    )
    return ok, f"exit {code} after {took:.0f} s; rank 0: {failure.get('type')}: {message[:110]}"


def stop_before_varuna(tmp: Path) -> Result:
    run = tmp / "run"
    try:
        done = cli("run", "-p", "1", "--run-dir", str(run), str(TRAIN), "3", "0", "--stop-first", timeout=180)
    except subprocess.TimeoutExpired as exc:
        return False, first_line(exc)
    text = done.stdout + done.stderr
    said = next((ln for ln in text.splitlines() if "before Varuna() existed" in ln), "")
    latest = run / "checkpoints" / "latest"
    saved = latest.read_text().strip() if latest.exists() else None
    ok = done.returncode == 75 and bool(said) and saved == "step-00000001"
    return ok, f"exit {done.returncode}; checkpoint {saved}; {said.strip()[:100] or 'no word of the request'}"


def crash_is_relaunched(tmp: Path) -> Result:
    from varuna.controller import JobController
    from varuna.telemetry.events import read_events

    ctl = JOBS.track(
        JobController.start(
            [str(TRAIN), "6", "0", "--crash-at", "3"],
            pipeline=1,
            data=1,
            run_dir=tmp / "run",
            grace_s=2.0,
            max_restarts=1,
        )
    )
    state = ctl.wait(240)
    JOBS.note(ctl)
    starts = len(ctl.store.events("job_start"))
    resumed = [e.get("resumed_from") for e in ctl.store.events("hello")]
    trained = Counter(
        int(e["step"]) for e in read_events(ctl.run_dir) if e["type"] == "step_metrics" and e.get("rank") == 0
    )
    steps = sorted(trained)
    once = set(trained.values()) == {1}
    ok = state == "finished" and starts == 2 and steps == list(range(6)) and once and bool(resumed[-1])
    where = Path(str(resumed[-1])).name if resumed and resumed[-1] else None
    return (
        ok,
        f"{state} after {starts} launches; relaunch resumed from {where}; steps {steps}, {'each once' if once else dict(trained)}",
    )


def cases() -> list[Case]:
    return [
        Case(
            "key on no command line (live job)",
            "attack",
            "absent from /proc/*/cmdline; in the ranks' env",
            key_on_no_command_line,
            job=True,
        ),
        Case(
            "key in no other file (live job)",
            "attack",
            "only controller.json (600); not job.json",
            key_in_no_other_file,
            job=True,
        ),
        Case(
            "TCPStore of a one-host job", "attack", "listens on 127.0.0.1 only", store_on_loopback, job=True
        ),
        Case(
            "forgeries to a live controller",
            "attack",
            "malformed, too_big, replay, bad_signature dropped; ranks still heard",
            live_controller_drops_forgeries,
            job=True,
        ),
        Case(
            "SIGSTOP a rank",
            "fault",
            "reported silent with host and last action; back after SIGCONT",
            stopped_rank_is_silent,
            job=True,
        ),
        Case(
            "SIGKILL a worker",
            "fault",
            "failed; first dead rank named (rank 1, killed)",
            killed_worker_fails_the_job,
            job=True,
        ),
        Case(
            "SIGKILL the starter of a job",
            "fault",
            "the job goes on; attach sees running",
            starter_dies,
            job=True,
        ),
        Case(
            "SIGKILL the agent",
            "fault",
            "failed within seconds, naming the agent's pid and log",
            agent_dies,
            job=True,
        ),
        Case(
            "a rank never reaches the rendezvous",
            "fault",
            "LaunchError after VARUNA_RENDEZVOUS_TIMEOUT_S=2",
            rendezvous_timeout,
            job=True,
        ),
        Case(
            "SIGUSR1 before Varuna()",
            "fault",
            "rank survives; checkpoint after step 1; exit 75",
            stop_before_varuna,
            job=True,
        ),
        Case(
            "crash with max_restarts=1",
            "fault",
            "relaunched from latest; finishes all 6 steps once",
            crash_is_relaunched,
            job=True,
        ),
    ]
