"""`JobController`: start, watch and steer a job from a Python process that is never an MPI rank.

    ctl = JobController.start(["train.py"], pipeline=2, data=2)     # launches via varuna.launch.job.Job
    ctl.state                       # starting, running, checkpointing, morphing, stopped, failed, finished
    ctl.timeline(); ctl.step_metrics(); ctl.memory(); ctl.ranks()    # plain data for the widgets
    ctl.checkpoint()                # every rank checkpoints at the end of the same step
    ctl.resize(pipeline=4, data=1)  # stop with a checkpoint, relaunch in the new shape from it
    ctl.stop(); ctl.resume()        # ... and later relaunch from checkpoints/latest
    JobController.attach("runs/x")  # after a kernel restart: replay the log, reconnect if it runs
    ctl.silent_ranks()              # ranks not heard from for silent_after_s (default 10 s): host, last action

Workers PUSH signed events to this process's PULL socket and SUBscribe to its PUB socket for
commands (both bound to loopback unless `interface=` says otherwise; see varuna.telemetry.events). A
supervisor thread runs `Job.start()`/`Job.wait()` and, after a morph exit (75) that it did not
ask for as a stop, relaunches in the queued shape, as `varuna run --elastic` does. No Jupyter here.
The key reaches the workers by name in mpiexec's environment, kept for `attach` in controller.json (0600)
only. A thread notes `rank_silent`/`rank_back` as ranks' heartbeats stop and resume (varuna.telemetry.heartbeat).
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import zmq

from varuna.elastic.protocol import (
    MORPH_EXIT,
    Shape,
    live_workers,
    request_resize,
)
from varuna.elastic.reshape import ShapeChoice, shape_for_gpus
from varuna.elastic.supervisor import USER_STOP, hostfile_slots, next_shape
from varuna.errors import ConfigError, LaunchError
from varuna.launch.job import Job
from varuna.launch.launches import ConsoleTail, DeadRank, Launch, post_mortem
from varuna.telemetry import events as _events
from varuna.telemetry.channel import Channel
from varuna.telemetry.heartbeat import DEFAULT_SILENT_AFTER_S, Liveness, SilentRank
from varuna.telemetry.store import EventStore, RankRow, StageMemory, StepMetrics, Timeline

__all__ = ["JobController", "JobState", "DeadRank", "SilentRank"]

JobState = Literal["starting", "running", "checkpointing", "morphing", "stopped", "failed", "finished"]


class JobController:
    """One job's controller; make it with `start` or `attach`."""

    def __init__(
        self, run_dir: Path, *, interface: str = "127.0.0.1", key: str | None = None,
        silent_after_s: float = DEFAULT_SILENT_AFTER_S,
    ) -> None:  # fmt: skip
        self.liveness = Liveness(silent_after_s)  # validates silent_after_s first
        self.run_dir = Path(run_dir).absolute()
        self.interface = interface
        self.key = key or _events.new_key()
        self.store = EventStore()
        self.console = ConsoleTail()
        self._state: JobState = "starting"
        self._intent: str | None = None
        self._launches: list[Launch] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._channel: Channel | None = None
        self._threads: list[threading.Thread] = []
        self._argv: list[str] = []
        self._job_options: dict[str, Any] = {}
        self._attached_pids: list[int] = []
        self._morph_from: Launch | None = None
        self.elastic = True
        """Relaunch after a morph exit (a resize, a stop-for-morph); False: a morph exit ends the job."""
        self._slots: int | None = None
        self._attached_job: str | None = None

    # sockets -----------------------------------------------------------------------------------
    def _bind(self, events: str | None = None, commands: str | None = None) -> None:
        self._channel = Channel(
            self.run_dir, self.key, self._on_event, interface=self.interface, events=events, commands=commands
        )
        self.events_address = self._channel.events_address
        self.commands_address = self._channel.commands_address
        self._spawn(self._watch_silence)

    def _on_event(self, event: dict[str, Any]) -> None:
        self.liveness.see(event)
        if event["type"] != "heartbeat":  # a beat a second per rank: counted as life, not stored
            self.store.add(event)

    def _watch_silence(self) -> None:
        """Note `rank_silent` when a rank goes quiet, `rank_back` when it speaks again."""
        quiet: dict[int, SilentRank] = {}
        while not self._closing.wait(0.25):
            now = {s.rank: s for s in self.silent_ranks()}
            for rank in now.keys() - quiet.keys():
                s = now[rank]
                self._note("rank_silent", silent_rank=rank, host=s.host, last_action=s.last_action,
                           silent_s=round(s.silent_s, 1))  # fmt: skip
            for rank in quiet.keys() - now.keys():
                self._note("rank_back", silent_rank=rank, host=quiet[rank].host)
            quiet = now

    def _spawn(self, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, daemon=True, name="varuna-controller")
        self._threads.append(thread)
        thread.start()

    def _send(self, cmd: str, **fields: Any) -> None:
        if self._channel is None:
            raise LaunchError("this controller has no command socket (the job is not running under it)")
        self._channel.send(cmd, **fields)

    def _note(self, kind: str, **fields: Any) -> None:
        """An event of the controller's own, stored and logged to events/controller.jsonl."""
        job = self._launches[-1].job.job_id if self._launches else None
        event = {
            "type": kind,
            "rank": None,
            "time": time.time(),
            "job": job,
            "id": uuid.uuid4().hex,
            **fields,
        }
        self.store.add(event)
        log = _events.EventLog(self.run_dir / "events" / "controller.jsonl")
        log.write(event)
        log.close()

    # starting ----------------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        script_argv: list[str],
        *,
        pipeline: int,
        data: int,
        run_dir: str | Path | None = None,
        hostfile: str | Path | None = None,
        elastic: bool = True,
        interface: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        grace_s: float = 10.0,
        resume: str | None = None,
        silent_after_s: float = DEFAULT_SILENT_AFTER_S,
    ) -> JobController:
        """Launch `script_argv` at `pipeline` x `data` through `varuna.launch.job.Job`; return at once.

        A rank not heard from for `silent_after_s` seconds is reported (`silent_ranks()`)."""
        run_dir = (
            Path(run_dir) if run_dir is not None else Path.cwd() / "runs" / time.strftime("%Y%m%d-%H%M%S")
        )
        self = cls(run_dir, interface=interface, silent_after_s=silent_after_s)
        self.elastic = elastic
        self._argv = list(script_argv)
        self._job_options = {
            "hostfile": Path(hostfile) if hostfile else None,
            "timeout_s": timeout_s,
            "grace_s": grace_s,
            "env": dict(env or {}),
        }
        self._slots = hostfile_slots(Path(hostfile)) if hostfile else None  # an edited hostfile resizes
        self._bind()
        try:
            job = self._make_job(pipeline, data, resume)  # validates the arguments here, in the caller
        except BaseException:
            self.close()
            raise
        self._spawn(lambda: self._supervise(job))
        return self

    def _make_job(self, pipeline: int, data: int, resume: str | None) -> Job:
        opts = self._job_options
        env = {**opts["env"], "VARUNA_EVENTS": self.events_address, "VARUNA_EVENTS_KEY": self.key}
        env["VARUNA_COMMANDS"] = self.commands_address
        env["VARUNA_LAUNCH"] = str(len(self._launches) + 1)
        if resume is not None:
            env["VARUNA_RESUME"] = resume
        job = Job(
            self._argv, pipeline=pipeline, data=data, run_dir=self.run_dir, hostfile=opts["hostfile"],
            extra_env=env, timeout_s=opts["timeout_s"], grace_s=opts["grace_s"], stdout=self.console, stderr=self.console,
        )  # fmt: skip
        return job

    def _supervise(self, job: Job) -> None:
        while True:
            launch = Launch(job, job.world)
            with self._lock:
                self._launches.append(launch)
                self._state = (
                    "morphing" if len(self._launches) > 1 and self._state == "morphing" else "starting"
                )
            try:
                job.start()
                self._note("job_start", pipeline=job.pipeline, data=job.data, world=job.world)
                code = job.wait()
            except Exception as exc:  # noqa: BLE001 - the controller must say why, not die silently
                self.console.write(f"varuna: launch failed: {exc!r}\n")
                code = -1
            launch.code = code
            self._after(launch)
            with self._lock:
                intent = self._intent
                if code == MORPH_EXIT and intent != "stop" and self.elastic:
                    self._state, self._intent = "morphing", None
                else:
                    self._state = (
                        "finished" if code == 0
                        else "stopped" if code == MORPH_EXIT or (intent == "stop" and code in USER_STOP)
                        else "failed"
                    )  # fmt: skip
            self._note("job_end", exit_code=code, state=self._state, summary=job.summary)
            if self._state != "morphing":
                return
            hostfile = self._job_options["hostfile"]
            shape = next_shape(self.run_dir, Shape(job.pipeline, job.data), hostfile, self._slots)
            if hostfile is not None:
                self._slots = hostfile_slots(hostfile)
            job = self._make_job(shape.pipeline, shape.data, "latest")

    def _after(self, launch: Launch) -> None:
        """Reconcile the logs (messages lost at exit), then note each rank's `exit` and the dead ranks."""
        for event in _events.read_events(self.run_dir):
            if event.get("job") == launch.job.job_id:
                self.store.add(event)
        for record in post_mortem(self.run_dir, launch):
            self._note("exit", **record)

    # attaching ---------------------------------------------------------------------------------
    @classmethod
    def attach(
        cls, run_dir: str | Path, *, reconnect: bool = True, silent_after_s: float = DEFAULT_SILENT_AFTER_S
    ) -> JobController:
        """Reattach to the job of `run_dir`: replay its events; reconnect (key from controller.json) when it runs."""
        run_dir = Path(run_dir).absolute()
        if not (run_dir / "job.json").exists():
            raise ConfigError(f"{run_dir} is not a varuna run directory (it has no job.json)")
        info = _events.read_controller_info(run_dir) or {}
        self = cls(run_dir, key=info.get("key"), silent_after_s=silent_after_s)
        self.elastic = False
        for event in _events.read_events(run_dir):
            self.store.add(event)
        job = json.loads((run_dir / "job.json").read_text())
        self._attached_job = job.get("job_id")
        self._attached_pids = live_workers(run_dir)
        if "end" not in job and self._attached_pids:
            self._state = "running"
            if reconnect and info.get("events"):
                try:
                    self._bind(info["events"], info.get("commands"))
                except zmq.ZMQError as exc:
                    raise LaunchError(
                        f"cannot listen on {info['events']} again ({exc}): is the job's first controller still "
                        "open? close() it, or attach with reconnect=False to replay only"
                    ) from exc
                self._spawn(self._watch)
        else:
            code = job.get("exit_code")
            self._state = (
                "finished" if code == 0 else "stopped" if code in (MORPH_EXIT, *USER_STOP) else "failed"
            )
        return self

    def _watch(self) -> None:
        """An attached job has no Job object: watch its workers, then read its end from job.json."""
        while not self._closing.is_set() and live_workers(self.run_dir):
            time.sleep(0.2)
        deadline = time.monotonic() + 30.0  # the launcher writes the end after its clean-up
        while (
            "end" not in (job := json.loads((self.run_dir / "job.json").read_text()))
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        code = job.get("exit_code")
        self._state = "finished" if code == 0 else "stopped" if code in (MORPH_EXIT, *USER_STOP) else "failed"

    # state and health --------------------------------------------------------------------------
    @property
    def state(self) -> JobState:
        """starting, running, checkpointing, morphing, stopped, failed or finished."""
        with self._lock:
            state = self._state
            launch = self._launches[-1] if self._launches else None
        if (
            state in ("starting", "morphing")
            and launch is not None
            and launch.code is None
            and launch is not self._morph_from
        ):
            ready = {e["rank"] for e in self.store.events("ready", job=launch.job.job_id)}
            if len(ready) == launch.world:
                with self._lock:
                    if self._state == state:
                        self._state = state = "running"
        return state

    @property
    def job(self) -> Job | None:
        """The current (or last) launch's `Job`."""
        return self._launches[-1].job if self._launches else None

    @property
    def exit_code(self) -> int | None:
        """The last launch's exit code, None while it runs."""
        return self._launches[-1].code if self._launches else None

    def dead_ranks(self) -> list[DeadRank]:
        """The ranks of the last launch that died (the first to die marked `first`)."""
        return list(self._launches[-1].dead) if self._launches else []

    def summary(self) -> list[str]:
        """The launcher's summary of the last launch (which rank failed first, and why)."""
        return list(self._launches[-1].job.summary) if self._launches else []

    def hellos(self) -> set[int]:
        """Ranks of the current launch that said hello."""
        job = self.job.job_id if self.job else None
        return {e["rank"] for e in self.store.events("hello", job=job)}

    def silent_ranks(self) -> list[SilentRank]:
        """Ranks of the running launch not heard from (heartbeat or any event) for `silent_after_s`
        seconds, with their host and last action; empty when no launch runs."""
        with self._lock:
            launch = self._launches[-1] if self._launches else None
            state = self._state
        if launch is not None:
            return self.liveness.silent(launch.job.job_id) if launch.code is None else []
        return self.liveness.silent(self._attached_job) if state == "running" else []

    def dropped_messages(self) -> dict[str, int]:
        """Messages the controller refused, by reason (too_big, bad_signature, malformed, replay, stale)."""
        return self._channel.drops if self._channel is not None else {}

    def log_tail(self, rank: int, lines: int = 40) -> str:
        """The last `lines` lines of RUN_DIR/logs/rank{rank}.log."""
        path = self.run_dir / "logs" / f"rank{rank}.log"
        try:
            text = path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait(
        self, timeout: float | None = None, *, states: tuple[str, ...] = ("stopped", "failed", "finished")
    ) -> JobState:
        """Block until the job reaches one of `states` (or `timeout` passes); the state."""
        return self._wait_until(lambda: self.state in states, timeout)

    def _wait_until(self, done: Callable[[], bool], timeout: float | None) -> JobState:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)
        return self.state

    # commands ----------------------------------------------------------------------------------
    def checkpoint(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Ask for a checkpoint at the end of the current step; the `checkpoint_done` events of all ranks.

        Raises TimeoutError when not every rank reported within `timeout` seconds.
        """
        launch = self._running_launch("checkpoint")
        before = len(self.store.events("checkpoint_done", job=launch.job.job_id))
        with self._lock:
            self._state = "checkpointing"
        self._send("checkpoint")

        def done() -> bool:
            return (
                len(self.store.events("checkpoint_done", job=launch.job.job_id)) >= before + launch.world
                or launch.code is not None
            )

        self._wait_until(done, timeout)
        with self._lock:
            if self._state == "checkpointing":
                self._state = "running"
        events = self.store.events("checkpoint_done", job=launch.job.job_id)[before:]
        if len(events) < launch.world:
            raise TimeoutError(
                f"{len(events)} of {launch.world} ranks reported checkpoint_done within {timeout:g} s"
            )
        return events

    def stop(self, checkpoint: bool = True, timeout: float = 60.0) -> JobState:
        """Stop the job: with `checkpoint`, every rank checkpoints at the end of the step and exits
        (the morph path); without, at once (SIGKILL). Falls back to SIGTERM after `timeout` s."""
        launch = self._running_launch("stop")
        with self._lock:
            self._intent = "stop"
            self._state = "checkpointing" if checkpoint else self._state
        if not checkpoint:
            launch.job.stop(signal.SIGKILL)
            return self.wait(timeout)
        self._send("stop", checkpoint=True)
        if self.wait(timeout) not in ("stopped", "failed", "finished"):
            launch.job.stop(signal.SIGTERM)
        return self.wait(timeout)

    def resize(
        self, pipeline: int | None = None, data: int | None = None, *, gpus: int | None = None
    ) -> JobState:
        """Morph to `pipeline` x `data`, or to `shape_for(gpus)` (noted as a "resize_plan" event)."""
        if gpus is not None:
            choice = self.shape_for(gpus)
            pipeline, data = choice.shape.pipeline, choice.shape.data
            self._note("resize_plan", gpus=gpus, pipeline=pipeline, data=data, chosen_by=choice.chosen_by,
                       reason=choice.reason)  # fmt: skip
        if pipeline is None or data is None:
            raise ConfigError("resize needs pipeline= and data=, or gpus=")
        self._morph_from = self._running_launch("resize")
        request_resize(self.run_dir, pipeline=pipeline, data=data, notify=False)
        with self._lock:
            self._intent, self._state = "resize", "morphing"
        self._send("stop", checkpoint=True, reason="resize")
        return self.state

    def shape_for(self, gpus: int) -> ShapeChoice:
        """The P x D `resize(gpus=N)` would ask for, and how it was chosen: the planner when the run
        directory has a profile, else the keep-the-depth rule (`varuna.elastic.reshape.shape_for_gpus`)."""
        return shape_for_gpus(self.run_dir, gpus)

    def resume(
        self, checkpoint: str | Path = "latest", *, pipeline: int | None = None, data: int | None = None
    ) -> JobState:
        """Relaunch a stopped or failed job from `checkpoint` ("latest" or a checkpoint directory)."""
        if self.state not in ("stopped", "failed", "finished"):
            raise LaunchError(f"resume() needs a stopped or failed job; this one is {self.state}")
        last = self.job
        if last is None:
            job = json.loads((self.run_dir / "job.json").read_text())
            self._argv, self._job_options = (
                list(job["argv"]),
                {"hostfile": None, "timeout_s": None, "grace_s": 10.0, "env": {}},
            )
            pipeline, data = pipeline or job["pipeline"], data or job["data"]
        else:
            pipeline, data = pipeline or last.pipeline, data or last.data
        if self._channel is None:
            self._bind()
        with self._lock:
            self._state, self._intent = "starting", None
        self._spawn(lambda: self._supervise(self._make_job(pipeline, data, str(checkpoint))))
        self._wait_until(lambda: self.exit_code is None and self.job is not last, 10.0)
        return self.state

    def set(self, **options: Any) -> None:
        """Change telemetry settings on every rank, e.g. `set(spans_every=10)`."""
        self._send("set", **options)

    def _running_launch(self, what: str) -> Launch:
        if (
            not self._launches
            or self._launches[-1].code is not None
            or self.state in ("stopped", "failed", "finished")
        ):
            raise LaunchError(f"{what}() needs a running job; this one is {self.state}")
        return self._launches[-1]

    # views -------------------------------------------------------------------------------------
    def timeline(self, last_steps: int = 3) -> Timeline:
        """Spans of the last steps, one row per stage and replica."""
        return self.store.timeline(last_steps)

    def step_metrics(self) -> list[StepMetrics]:
        """Loss, samples/s and bubble fraction per step."""
        return self.store.step_metrics()

    def memory(self) -> list[StageMemory]:
        """The latest memory figures per stage."""
        return self.store.memory()

    def ranks(self) -> list[RankRow]:
        """Rank, stage, replica, state, last heartbeat, host, pid."""
        return self.store.ranks()

    def export_chrome_trace(self, path: str | Path, last_steps: int | None = None) -> Path:
        """Write a Chrome/Perfetto trace JSON of the recorded spans (with send -> recv arrows)."""
        from varuna._files import write_json_atomic

        path = Path(path)
        write_json_atomic(path, self.store.chrome_trace(last_steps))  # a reader never sees half a trace
        return path

    def close(self) -> None:
        """Stop receiving and close the sockets (a running job keeps running)."""
        self._closing.set()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
