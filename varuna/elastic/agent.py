"""A job's own supervisor process: the job outlives the notebook that started it.

A notebook kernel can crash or be restarted at any time. So `JobController.start` does not run
``mpiexec`` itself: it starts this agent (``python -m varuna.elastic.agent RUN_DIR``) in a session of
its own, with its output in ``RUN_DIR/logs/agent.log``, and the agent runs the launches, in the spirit
of TorchElastic's agent::

    controller (kernel)                     agent (own session)                       mpiexec + ranks
    start():  agent/spec.json, key in env -> Job.start() -----------------------------> ranks
    resize(): resize request, stop command ----------------------------(ZMQ)---------> exit 75
                                            75, no stop intent: next shape, relaunch -> ranks
    stop():   agent/intent.json "stop"      75 with a stop intent: stopped, exit
    kill():   agent/intent.json "kill"      Job.stop(SIGKILL)
    state:    reads agent/state.json   <--  written on every change (atomic)
              tails events/agent.jsonl <--  job_start, exit, job_end notes

Nothing travels through the kernel's process: mpiexec writes to ``logs/console.log``, the ranks' events
go to whichever controller listens on the addresses in ``controller.json`` (and to their own logs), and
the agent's state and notes are files. `JobController.attach` reads them back and has full control.

The agent relaunches after a morph exit (75) that was not asked for as a stop, and after a failure up
to ``max_restarts`` times, from ``checkpoints/latest``. Any error of its own becomes a ``failed`` state
carrying the error, so nobody waits on a supervisor that died; a controller that finds the agent's
process gone (pid and start time) while the state says otherwise reports ``failed`` too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from varuna._files import write_json_atomic
from varuna.elastic.hosts import hostfile_without, lost_in_console
from varuna.elastic.hostset import (
    DEFAULT_SETTLE_S,
    HostfileSource,
    HostSet,
    HostSource,
    SlurmSource,
    check_settle,
    write_hostfile,
)
from varuna.elastic.protocol import MORPH_EXIT, Shape, live_workers, take_resize
from varuna.elastic.reshape import choose_shape, read_engine_info, shape_for_gpus
from varuna.elastic.supervisor import USER_STOP, hostfile_slots, next_shape
from varuna.errors import ConfigError, LaunchError
from varuna.launch.exclude import hostfile_for
from varuna.launch.hostfile import hostfile_hosts
from varuna.launch.job import Job
from varuna.launch.launches import Launch, post_mortem
from varuna.launch.notices import post_stop, stop_requests
from varuna.launch.pids import identity
from varuna.launch.postmortem import read_reports
from varuna.planner.cluster import Placement

__all__ = ["AGENT_DIR", "SPEC", "STATE", "INTENT", "NOTES", "read_state", "write_intent", "spawn", "main"]

AGENT_DIR = "agent"
SPEC = "spec.json"
STATE = "state.json"
INTENT = "intent.json"
NOTES = "events/agent.jsonl"
TERMINAL = ("stopped", "failed", "finished")
INTENTS = ("stop", "resize", "kill", "terminate", "host_lost", "exclude")
"""stop: a morph exit ends the job; resize: it relaunches; kill / terminate: SIGKILL / SIGTERM now;
host_lost: the hosts named (``hosts``) of launch ``job`` stopped answering: end it now, relaunch
without them; exclude: relaunch without the hosts named after the (checkpointed) morph exit."""


_DISCARD = open(os.devnull, "w")  # noqa: SIM115 - ranks' stdout is in logs/console.log; stderr, with the launcher's lines, also in agent.log


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """``RUN_DIR/agent/state.json``, or None when no agent ever ran there (or it is unreadable)."""
    try:
        state = json.loads((Path(run_dir) / AGENT_DIR / STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def write_intent(run_dir: Path, what: str, *, after: int = 0, **fields: Any) -> None:
    """The controller's side of ``agent/intent.json``: the next sequence number (above `after`, the
    last the agent consumed) and what the next exit means, or a signal to send now (with `fields`,
    e.g. the ``hosts`` of a host_lost)."""
    path = Path(run_dir) / AGENT_DIR / INTENT
    try:
        seq = max(int(json.loads(path.read_text())["seq"]), after)
    except (OSError, ValueError, KeyError, TypeError):
        seq = after
    write_json_atomic(path, {**fields, "seq": seq + 1, "intent": what, "time": time.time()})


def launch_record(launch: Launch) -> dict[str, Any]:
    job = launch.job
    return {
        "job_id": job.job_id,
        "pipeline": job.pipeline,
        "data": job.data,
        "world": launch.world,
        "code": launch.code,
        "summary": list(job.summary),
        "dead": [asdict(d) for d in launch.dead],
    }


class FirstStep:
    """When rank 0 of a launch finished its first step: its ``step_metrics`` event appended to
    ``events/rank0.jsonl`` since the launch began (read from where the file ended then)."""

    def __init__(self, run_dir: Path, job_id: str) -> None:
        self.path = run_dir / "events" / "rank0.jsonl"
        self.job_id = job_id
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.at: float | None = None

    def poll(self) -> float | None:
        if self.at is not None:
            return self.at
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return None
        lines = chunk.split(b"\n")
        self.offset += len(chunk) - len(lines[-1])  # a half-written last line is read again
        if any(b'"step_metrics"' in line and self.job_id.encode() in line for line in lines[:-1]):
            self.at = time.time()
        return self.at


class Agent:
    """The launch loop of one job; its state goes to ``agent/state.json`` on every change."""

    def __init__(self, run_dir: Path, spec: dict[str, Any], *, stdout: TextIO = _DISCARD) -> None:
        self.run_dir = run_dir
        self.spec = spec
        self.stdout = stdout
        """Where the ranks' output goes besides logs/console.log (nowhere, unless run in a terminal)."""
        previous = read_state(run_dir) or {}
        self.launches: list[dict[str, Any]] = list(previous.get("launches") or [])  # a resume continues them
        self.state = "starting"
        self.error: str | None = None
        self._intent_seq = int(previous.get("intent_seq") or 0)
        self.intent: str | None = None
        self.lost: set[str] = set()
        """Hosts this agent's launches lost; a resume (a fresh agent) tries the whole hostfile again."""
        self.current: str | None = None
        """The job id of the launch that runs now."""
        self._notes = run_dir / NOTES
        self.lost_now: set[str] = set()
        """Hosts the controller reported dead during the current launch (a host_lost intent)."""
        self.base_hostfile = Path(spec["hostfile"]) if spec.get("hostfile") else None
        self.hostfile = self.base_hostfile
        self._notes.parent.mkdir(parents=True, exist_ok=True)
        source = host_source(spec)
        self.hostset = (
            HostSet(source, settle_s=float(spec.get("settle_s", DEFAULT_SETTLE_S)))
            if source is not None
            else None
        )
        """The live host set, when the spec asks to watch one (``watch_hosts``); None: the hostfile as given."""
        self.offered: dict[str, int] = {}
        """The hosts (and slots) the running launch was given, when watching hosts."""
        self.considered: dict[str, int] | None = None
        """A larger host set already weighed for this launch that would not change its shape."""
        self.asked: str | None = None
        """Why this agent asked the running launch to morph (one morph in flight at a time)."""
        self.morphs = {"grow": 0, "shrink": 0}
        self._last_poll = 0.0
        self.first_step: FirstStep | None = None
        """When the running launch trained its first step (watching hosts only)."""
        self.stopped_at: float | None = None
        """When the previous launch was asked to morph or was found ended: the start of a morph."""
        self.morph_s: list[float] = []
        """Seconds from each morph's start to the relaunch's first step: a grow waits that long."""
        self.policy = str(spec.get("policy") or "elastic")
        """"elastic" (follow the host set), or a baseline the spot bench compares with: "restart_only"
        (after a failure relaunch on the hosts there, never grow: TorchElastic's way) or "static" (run
        only on every host it started with, wait for all of them after a failure)."""
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        self.first_hosts = dict(self.hostset.available()) if self.hostset is not None else {}

    # files -------------------------------------------------------------------------------------
    def write(self) -> None:
        write_json_atomic(
            self.run_dir / AGENT_DIR / STATE,
            {
                **identity(),
                "state": self.state,
                "error": self.error,
                "launches": self.launches,
                "intent_seq": self._intent_seq,
                "lost_hosts": sorted(self.lost),
                "hostfile": str(self.hostfile) if self.hostfile else None,
                "hosts": self.hosts_state(),
                "updated": time.time(),
            },
        )

    def hosts_state(self) -> dict[str, Any] | None:
        """The live host set as `varuna hosts RUN_DIR list` shows it (None when not watching hosts)."""
        if self.hostset is None:
            return None
        return {
            "source": self.hostset.source.describe(),
            "settle_s": self.hostset.settle_s,
            "listed": self.hostset.listed,
            "available": self.hostset.available(),
            "dead": sorted(self.hostset.dead),
            "offered": self.offered,
            "morph_asked": self.asked,
            "morphs": self.morphs,
            "morph_s": [round(t, 2) for t in self.morph_s],
        }

    def note(self, kind: str, job: str | None, **fields: Any) -> None:
        """A lifecycle event of the agent's own (job_start, exit, job_end, restart), logged for the
        controller to tail and for a later attach to replay."""
        event = {"type": kind, "rank": None, "time": time.time(), "job": job, "id": uuid.uuid4().hex}
        with open(self._notes, "a", encoding="utf-8") as log:  # the format of varuna.telemetry.events logs
            log.write(json.dumps({**event, **fields}, separators=(",", ":"), default=str) + "\n")

    def read_intent(self) -> str | None:
        """The newest intent the controller wrote that this agent has not consumed yet."""
        try:
            intent = json.loads((self.run_dir / AGENT_DIR / INTENT).read_text())
            seq, what = int(intent["seq"]), intent["intent"]
        except (OSError, ValueError, KeyError, TypeError):
            return self.intent
        if seq > self._intent_seq and what in INTENTS:
            if what in ("host_lost", "exclude") and intent.get("job") != self.current:
                self._intent_seq = seq  # about a launch that is over already: nothing to do
                return self.intent
            self._intent_seq, self.intent = seq, what
            if what in ("host_lost", "exclude"):
                self.lost_now.update(str(h) for h in intent.get("hosts") or [])
        return self.intent

    # the loop ----------------------------------------------------------------------------------
    def make_job(self, shape: Shape, resume: str | None) -> Job:
        env = {**self.spec.get("env", {}), "VARUNA_LAUNCH": str(len(self.launches) + 1)}
        if resume is not None:
            env["VARUNA_RESUME"] = resume
        key = os.environ.get("VARUNA_EVENTS_KEY")
        if key:
            env["VARUNA_EVENTS_KEY"] = key
        own = hostfile_for(self.run_dir, None)  # RUN_DIR/agent/hostfile once a host was excluded
        if self.hostset is None and own is not None and own != self.base_hostfile:
            self.base_hostfile = own
            self.hostfile = hostfile_without(own, self.lost, self.run_dir / AGENT_DIR) if self.lost else own
        return Job(
            self.spec["argv"],
            pipeline=shape.pipeline,
            data=shape.data,
            run_dir=self.run_dir,
            hostfile=self.hostfile,
            extra_env=env,
            timeout_s=self.spec.get("timeout_s"),
            grace_s=float(self.spec.get("grace_s", 10.0)),
            placement=self.spec.get("placement", "block"),
            stdout=self.stdout,
            stderr=sys.stderr,
        )

    def run_one(self, job: Job) -> int:
        launch = Launch(job, job.world)
        self.current = job.job_id
        self.launches.append(launch_record(launch))
        self.write()
        if self.hostset is not None:
            self.first_step = FirstStep(self.run_dir, job.job_id)
            if self.stopped_at is None:
                self.stopped_at = time.time()  # the first launch: its start-up is what a morph costs
        job.start()
        self.note("job_start", job.job_id, pipeline=job.pipeline, data=job.data, world=job.world)
        signalled: str | None = None
        while (code := job.poll()) is None:
            intent = self.read_intent()
            if intent in ("kill", "terminate", "host_lost") and signalled != intent:
                # host_lost: the survivors wait on a dead peer, nothing to save; SIGKILLed, mpiexec's
                # proxies end the ranks on the hosts that still answer (no signal crosses hosts)
                signalled = intent
                job.stop(signal.SIGTERM if intent == "terminate" else signal.SIGKILL)
            if self.hostset is not None and time.monotonic() - self._last_poll >= 0.5:
                self._last_poll = time.monotonic()
                self.watch(job)
            time.sleep(0.1)
        launch.code = code
        if self.hostset is not None and self.asked is None:
            self.stopped_at = time.time()  # ended by itself (a failure, a notice): the morph starts now
        for record in post_mortem(self.run_dir, launch):
            self.note("exit", job.job_id, **record)
        self.launches[-1] = launch_record(launch)
        return code

    def run(self) -> None:
        spec = self.spec
        shape, resume = Shape(int(spec["pipeline"]), int(spec["data"])), spec.get("resume")
        watching = self.hostset is not None
        slots = hostfile_slots(self.hostfile) if self.hostfile is not None and not watching else None
        restarts, max_restarts = 0, int(spec.get("max_restarts", 0))
        elastic = spec.get("elastic", True)
        replan = False
        while True:
            if watching:
                placed = self.place(shape, replan=replan)
                if placed is None:  # stopped while no host was there
                    self.state = "stopped"
                    self.note("job_end", None, exit_code=None, state=self.state, summary=[])
                    self.write()
                    return
                shape = placed
            job = self.make_job(shape, resume)
            self.lost_now = set()
            code = self.run_one(job)
            intent = self.read_intent()
            lost = self.hosts_lost(job, code, intent)
            gone: set[str] = set()
            if watching:
                lost |= self.noticed(job)
                gone = self.gone_hosts()
            if (lost or gone) and elastic and code != 0 and not (intent == "stop" and code == MORPH_EXIT):
                shape = self.drop_hosts(lost, job, shape)
                if not watching:
                    slots = hostfile_slots(self.hostfile) if self.hostfile is not None else None
                self.state, self.intent = "morphing" if code == MORPH_EXIT else "restarting", None
            elif code == MORPH_EXIT and intent != "stop" and elastic:
                self.state, self.intent = "morphing", None
            elif code not in (0, MORPH_EXIT, 124, *USER_STOP) and intent is None and restarts < max_restarts:
                restarts += 1
                self.state = "restarting"
                self.note("restart", job.job_id, restart=restarts, of=max_restarts, exit_code=code)
            else:
                self.state = (
                    "finished"
                    if code == 0
                    else "stopped"
                    if code == MORPH_EXIT or (intent in ("stop", "kill", "terminate") and code in USER_STOP)
                    else "failed"
                )
                if lost:
                    self.error = f"lost host {', '.join(sorted(lost))} (not elastic: no relaunch)"
            self.note("job_end", job.job_id, exit_code=code, state=self.state, summary=job.summary)
            self.write()
            if self.state in TERMINAL:
                return
            replan = watching and (bool(lost or gone) or self.asked is not None)
            if self.state == "morphing":
                if not watching:
                    shape = next_shape(self.run_dir, shape, self.hostfile, slots)
                    if self.hostfile is not None:
                        slots = hostfile_slots(self.hostfile)
                elif (requested := take_resize(self.run_dir)) is not None:
                    shape, replan = requested, False
            resume = "latest"

    # a live host set (spec "watch_hosts") --------------------------------------------------------
    def place(self, shape: Shape, *, replan: bool) -> Shape | None:
        """Before a launch: wait until a host is available (None when asked to stop meanwhile), choose
        the shape for the available slots (`replan`, or when `shape` no longer fits), and write the
        launch's hostfile, ``agent/hosts-<launch>``, of the hosts it is offered."""
        hostset = self.hostset
        assert hostset is not None
        waiting = False
        while not (available := self._poll_hosts()) or not self.may_launch(available):
            if self.read_intent() in ("stop", "kill", "terminate"):
                return None
            if not waiting:
                waiting, self.state = True, "waiting"
                self.note("waiting_for_hosts", None, source=hostset.source.describe())
                self.write()
            time.sleep(0.5)
        total = sum(available.values())
        if (replan and self.policy != "static") or shape.pipeline * shape.data > total:
            shape = self.shape_for(total, shape)
        need, offered = shape.pipeline * shape.data, {}
        for host, n in available.items():  # the order the source lists them in
            if need <= 0:
                break
            offered[host] = min(n, need)
            need -= offered[host]
        self.offered, self.considered, self.asked = offered, None, None
        self.hostfile = write_hostfile(self.run_dir / AGENT_DIR / f"hosts-{len(self.launches) + 1}", offered)
        return shape

    def may_launch(self, available: dict[str, int]) -> bool:
        """Whether the policy launches on `available`: "static" only on every host it started with."""
        return self.policy != "static" or all(available.get(h, 0) >= n for h, n in self.first_hosts.items())

    def _poll_hosts(self) -> dict[str, int]:
        assert self.hostset is not None
        if self.hostset.poll():
            self.write()
        return self.hostset.available()

    def shape_for(self, slots: int, current: Shape, *, note: bool = True) -> Shape:
        """The shape for `slots` devices that keeps the global batch: the planner's (or the rule's,
        `shape_for_gpus`) for the most devices up to `slots` that have one; `current` when the job
        has not trained yet (no engine.json to plan from) and fits."""
        if not (self.run_dir / "engine.json").exists():
            if current.pipeline * current.data <= slots:
                return current
            raise ConfigError(
                f"{slots} slots are available but the job needs {current.pipeline} x {current.data} and has "
                "not started training (no engine.json) to choose another shape from; add hosts or relaunch "
                "with a smaller --pipeline/--data"
            )
        errors = []
        for n in range(slots, 0, -1):
            try:
                choice = shape_for_gpus(self.run_dir, n, depth=int(self.spec["pipeline"]))
            except ConfigError as exc:
                errors.append(f"{n}: {exc}")
                continue
            if note and choice.shape != current:
                self.note(
                    "shape_chosen",
                    None,
                    slots=slots,
                    pipeline=choice.shape.pipeline,
                    data=choice.shape.data,
                    chosen_by=choice.chosen_by,
                    reason=choice.reason,
                )
            return choice.shape
        raise ConfigError(f"no shape fits any of 1..{slots} devices: {'; '.join(errors[:3])}")

    def watch(self, job: Job) -> None:
        """While a launch runs: read the host set and, when it calls for a morph (`HostSet.change`: a
        host gone at once, more hosts once settled) and none is in flight, ask the ranks to checkpoint
        and exit (a stop request, `varuna.launch.notices`). Changes that come while a morph is in flight
        are taken by the relaunch, which reads the host set again: coalesced into one morph."""
        hostset = self.hostset
        assert hostset is not None
        self._poll_hosts()
        trained = self.first_step.poll() if self.first_step is not None else None
        if trained is not None and self.stopped_at is not None:
            self.morph_s.append(trained - self.stopped_at)
            self.stopped_at = None
        if self.asked is not None or self.policy != "elastic":
            return  # restart_only and static never morph: a lost host fails the launch
        change = hostset.change(self.offered)
        if change is None:
            return
        if change.kind == "grow":
            # no morph storm: a launch trains at least as long as the last morph took before it
            # grows (a host that comes while it starts waits for it: coalesced with what follows)
            if trained is None or time.time() - trained < (self.morph_s[-1] if self.morph_s else 0.0):
                return
            if change.available == self.considered:
                return
            self.considered = dict(change.available)
            current = Shape(job.pipeline, job.data)
            try:
                new = self.shape_for(sum(change.available.values()), current, note=False)
            except ConfigError as exc:
                self.note("hosts_changed", job.job_id, change=change.describe(), action=f"none: {exc}")
                return
            if new == current:
                self.note("hosts_changed", job.job_id, change=change.describe(), action="none: same shape")
                return
        self.asked = change.describe()
        self.stopped_at = time.time()
        self.morphs[change.kind] += 1
        post_stop(self.run_dir, job=job.job_id, reason=self.asked)
        self.note(
            "morph_asked",
            job.job_id,
            change=change.kind,
            gone=list(change.gone),
            added=list(change.added),
            available=change.available,
            reason=self.asked,
        )
        self.write()

    def noticed(self, job: Job) -> set[str]:
        """The hosts that this launch's preemption notices named (they are being taken); the notices
        are moved to ``requests/applied`` so that no later launch reads them again."""
        hosts: set[str] = set()
        for request in stop_requests(self.run_dir, job.job_id):
            hosts.update(str(h) for h in request.get("hosts") or [])
            path = Path(request["path"])
            try:
                (path.parent / "applied").mkdir(exist_ok=True)
                path.replace(path.parent / "applied" / path.name)
            except OSError:
                pass
        return hosts

    def gone_hosts(self) -> set[str]:
        """The hosts of the last launch that the host set no longer has (taken, with or without notice)."""
        assert self.hostset is not None
        self._poll_hosts()
        return set(self.hostset.gone(self.offered))

    def hosts_lost(self, job: Job, code: int, intent: str | None) -> set[str]:
        """The hosts this launch lost: those the controller named (a host_lost or exclude intent), and
        after a failure nobody asked for, the host mpiexec's output names as lost (`lost_in_console`)
        when the job spans several."""
        if self.hostfile is None or code == 0:
            return set()
        if intent in ("host_lost", "exclude"):
            return set(self.lost_now)
        if intent is not None or code == MORPH_EXIT:
            return set()
        names = hostfile_hosts(self.hostfile)
        found = lost_in_console(job._tail.decode("utf-8", "replace"), names) if len(names) > 1 else None
        if found is None:
            return set()
        host, how = found
        statuses = read_reports(self.run_dir, job.job_id)[0]
        ranks = sorted(
            r for r, st in statuses.items() if str(st.get("host", "")).split(".")[0] == host.split(".")[0]
        )
        said = "its ranks killed (SIGKILL)" if how == "killed" else "its launcher cannot reach mpiexec"
        self.note("host_dead", job.job_id, host=host, how=how, ranks=ranks, reason=f"mpiexec reports {said}")
        return {host}

    def drop_hosts(self, lost: set[str], job: Job, shape: Shape) -> Shape:
        """Leave the `lost` hosts out of the hostfile from now on; the shape for the slots left (the
        same if it still fits, else one that keeps the global batch: `choose_shape`)."""
        if self.hostset is not None:  # the next launch's shape comes from `place`
            self.hostset.mark_dead(lost)
            available = self.hostset.available()
            self.morphs["shrink"] += self.asked is None
            self.note(
                "hosts_dropped",
                job.job_id,
                lost=sorted(lost),
                gone=sorted(self.hostset.gone(self.offered)),
                available=available,
                slots=sum(available.values()),
            )
            return shape
        assert self.base_hostfile is not None
        self.lost |= lost
        self.hostfile = hostfile_without(self.base_hostfile, self.lost, self.run_dir / AGENT_DIR)
        left = hostfile_slots(self.hostfile)
        new = shape
        if shape.pipeline * shape.data > left:
            new = choose_shape(left, read_engine_info(self.run_dir / "engine.json"))
        self.note(
            "hosts_dropped",
            job.job_id,
            lost=sorted(lost),
            hostfile=str(self.hostfile),
            slots=left,
            pipeline=new.pipeline,
            data=new.data,
        )
        return new


POLICIES = ("elastic", "restart_only", "static")
HOST_SOURCES = ("hostfile", "slurm")
"""What ``watch_hosts`` may name: the job's hostfile, watched for edits, or the Slurm allocation."""


def host_source(spec: dict[str, Any]) -> HostSource | None:
    """The live host source an agent spec asks for (``watch_hosts``), or None for a fixed hostfile."""
    what = spec.get("watch_hosts")
    if not what:
        return None
    if what == "hostfile":
        if not spec.get("hostfile"):
            raise ConfigError("watch_hosts='hostfile' needs a hostfile: give hostfile= (the file to watch)")
        return HostfileSource(Path(spec["hostfile"]))
    if what == "slurm":
        return SlurmSource()
    raise ConfigError(f"watch_hosts must be one of {', '.join(HOST_SOURCES)} (or None), got {what!r}")


def relaunch_spec(run_dir: Path) -> dict[str, Any]:
    """What a resume relaunches: the agent's spec, or (a run started by `varuna run`) its job.json's
    script and shape; without the previous controller's addresses."""
    path = Path(run_dir) / AGENT_DIR / SPEC
    if path.exists():
        spec = json.loads(path.read_text())
    else:
        job = json.loads((Path(run_dir) / "job.json").read_text())
        spec = {"argv": list(job["argv"]), "pipeline": job["pipeline"], "data": job["data"], "env": {}}
        spec["placement"] = job.get("placement", "block")
    drop = ("VARUNA_EVENTS", "VARUNA_COMMANDS")
    spec["env"] = {k: v for k, v in spec.get("env", {}).items() if k not in drop}
    return dict(spec)


def legacy_state(run_dir: Path) -> str:
    """The state of a run without an agent (`varuna run`), from its job.json and live workers."""
    job = json.loads((Path(run_dir) / "job.json").read_text())
    code = job.get("exit_code")
    if "end" not in job and live_workers(run_dir):
        return "running"
    return "finished" if code == 0 else "stopped" if code in (MORPH_EXIT, *USER_STOP) else "failed"


def spawn(run_dir: Path, spec: dict[str, Any], key: str) -> subprocess.Popen[bytes]:
    """Start the agent of the job `spec` describes, in a session of its own, with its output in
    ``logs/agent.log``. The key goes in its environment, never on a command line or in a file."""
    folder = run_dir / AGENT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    write_json_atomic(folder / SPEC, spec)
    here = str(Path(__file__).resolve().parents[2])  # the folder holding this varuna
    path = os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        "VARUNA_EVENTS_KEY": key,
        "PYTHONPATH": f"{here}{os.pathsep}{path}" if path else here,
    }
    with open(run_dir / "logs" / "agent.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "varuna.elastic.agent", str(run_dir)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(run_dir),
        )


def run_foreground(
    script_argv: list[str],
    *,
    pipeline: int,
    data: int,
    run_dir: Path | None,
    hostfile: Path,
    max_restarts: int = 3,
    timeout_s: float | None = None,
    settle_s: float = DEFAULT_SETTLE_S,
    placement: Placement = "block",
) -> int:
    """`varuna run --elastic --watch-hosts`: the agent in this process, the ranks' output on this
    terminal, following the hostfile as it changes; the last launch's exit code (0 when it finished).
    SIGINT or SIGTERM stops the job (the ranks checkpoint when they can)."""
    check_settle(settle_s)
    run_dir = Path(run_dir or Path.cwd() / "runs" / time.strftime("%Y%m%d-%H%M%S")).absolute()
    hostfile = Path(hostfile).absolute()
    spec = {
        "argv": list(script_argv),
        "pipeline": pipeline,
        "data": data,
        "hostfile": str(hostfile),
        "watch_hosts": "hostfile",
        "settle_s": settle_s,
        "timeout_s": timeout_s,
        "max_restarts": max_restarts,
        "elastic": True,
        "env": {},
        "placement": placement,
    }
    Job(
        list(script_argv),
        pipeline=pipeline,
        data=data,
        run_dir=run_dir,
        hostfile=None,
        timeout_s=timeout_s,
        placement=placement,
    )
    hostfile_hosts(hostfile)  # a ConfigError naming the bad line, before anything starts
    write_json_atomic(run_dir / AGENT_DIR / SPEC, spec)
    agent = Agent(run_dir, spec, stdout=sys.stdout)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda *_: setattr(agent, "intent", "terminate"))
    try:
        agent.write()
        agent.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [launch.get("code") for launch in agent.launches]
    if agent.state == "finished":
        return 0
    last = codes[-1] if codes else None
    return int(last) if isinstance(last, int) and last != 0 else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m varuna.elastic.agent RUN_DIR``: run the job that ``RUN_DIR/agent/spec.json`` describes."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m varuna.elastic.agent RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0]).absolute()
    try:
        spec = json.loads((run_dir / AGENT_DIR / SPEC).read_text())
    except (OSError, ValueError) as exc:
        print(f"varuna agent: cannot read {run_dir / AGENT_DIR / SPEC}: {exc}", file=sys.stderr)
        return 2
    agent = Agent(run_dir, spec)
    signal.signal(signal.SIGTERM, lambda *_: setattr(agent, "intent", "terminate"))  # never orphan the ranks
    agent.write()
    try:
        agent.run()
    except BaseException as exc:  # noqa: BLE001 - the state must say why the supervisor ended
        agent.state, agent.error = "failed", f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, LaunchError):
            traceback.print_exc()
        agent.note("job_end", None, exit_code=None, state="failed", error=agent.error)
        agent.write()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
