"""Drive a job that follows a live host set across namespace hosts; print what happened as JSON.

    python multihost_spot.py RUN_DIR HOSTFILE STEPS

Run on host h1 by tests/multihost/test_multihost_spot.py, with HOSTFILE listing h2:2 only. The job
(`JobController.start(..., watch_hosts="hostfile", settle_s=SETTLE)`, 2x1) is steered only through the
hostfile and the command line, as a person or a cloud hook would:

    coalesce   `varuna hosts add h3:1`, `add h3:2`, `add h1:1`, `remove h1` within the settle time
               -> one grow: 2x2 on h2 and h3
    notice     `varuna notice --deadline 8s --host h3` -> the ranks train on, checkpoint before the
               deadline, exit; the relaunch leaves h3 out: 2x1 on h2
    return     h3 leaves the hostfile and comes back -> grow again: 2x2
    removal    `varuna hosts remove h3` -> shrink at the end of the step: 2x1 on h2
    stop       with a checkpoint

The last line of stdout is the report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from varuna.controller import JobController
from varuna.telemetry.events import read_events

SCRIPT = str(Path(__file__).parent / "controller_train.py")
SETTLE = 3.0
EVERY = 4
"""Steps between background checkpoints (`checkpoint_every`)."""


def wait_for(predicate, timeout: float, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(every)
    return bool(predicate())


def steps_by(ctl: JobController) -> int:
    return max((m.step for m in ctl.step_metrics()), default=-1)


def varuna(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "varuna", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise RuntimeError(f"varuna {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done.stdout


class Driver:
    def __init__(self, run_dir: Path, hostfile: Path, steps: int) -> None:
        self.run_dir, self.report = run_dir, {"launches": []}
        self.ctl = JobController.start(
            [SCRIPT, str(steps), "0.2"],
            pipeline=2,
            data=1,
            run_dir=run_dir,
            hostfile=hostfile,
            grace_s=3.0,
            watch_hosts="hostfile",
            settle_s=SETTLE,
        )

    def launch(self, key: str, timeout: float = 90) -> None:
        """Wait for a launch other than the last one to train two steps; record its shape and hosts."""
        ctl = self.ctl
        before = [e["job"] for e in ctl.store.events("job_start")]
        previous = self.report["launches"][-1]["job"] if self.report["launches"] else None
        ok = wait_for(
            lambda: (
                ctl.job is not None
                and ctl.job.job_id != previous
                and ctl.state == "running"
                and self.trained(ctl.job.job_id)
            ),
            timeout,
            every=0.25,
        )
        job = ctl.job
        if not ok or job is None:
            self.fail(f"{key}: no new launch trained (state {ctl.state}, {ctl.error}, job_start {before})")
        hellos = ctl.store.events("hello", job=job.job_id)
        self.report["launches"].append(
            {
                "key": key,
                "job": job.job_id,
                "shape": [job.pipeline, job.data],
                "hosts": sorted({e["host"] for e in hellos}),
                "started": min(e["time"] for e in ctl.store.events("job_start", job=job.job_id)),
            }
        )

    def hello(self, job_id: str, rank: int = 0) -> dict:
        return next(e for e in self.ctl.store.events("hello", job=job_id) if e["rank"] == rank)

    def kill_during_write(self) -> None:
        """SIGKILL h3's ranks while a background checkpoint's data writes are held (none committed)."""
        root, hold = self.run_dir / "checkpoints", Path(os.environ["TRAIN_HOLD_WRITES"])
        latest = root / "latest"
        job = self.ctl.job
        assert job is not None
        hold.touch()
        try:

            def writing() -> list[str]:
                return [p.name for p in root.glob(".step-*.tmp") if p.is_dir()]

            # every rank waits in its write (a write already past the hold when it was set commits first)
            ranks = job.pipeline * job.data
            if not wait_for(lambda: len(list(hold.parent.glob(f"{hold.name}.*"))) == ranks, 30):
                self.fail(
                    f"kill: the {ranks} ranks were not all in a held write within 30 s (checkpoint_every={EVERY})"
                )
            before = latest.read_text().strip() if latest.exists() else None
            pids = [e["pid"] for e in self.ctl.store.events("hello", job=job.job_id) if e["host"] == "h3"]
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            self.report["kill"] = {
                "writing": writing(),
                "latest_before": before,
                "killed": len(pids),
                "job": job.job_id,
            }
        finally:
            hold.unlink()
        wait_for(lambda: self.ctl.job is None or self.ctl.job.job_id != job.job_id, 60, every=0.1)
        self.report["kill"]["latest_after"] = latest.read_text().strip() if latest.exists() else None

    def trained(self, job_id: str) -> bool:
        """Whether rank 0 of launch `job_id` has finished a step (its step_metrics in the event log)."""
        return any(
            e["type"] == "step_metrics" and e.get("job") == job_id and e["rank"] == 0
            for e in read_events(self.run_dir)
        )

    def fail(self, why: str) -> None:
        self.report["error"] = why
        self.report["agent_log"] = (self.run_dir / "logs" / "agent.log").read_text()[-3000:]
        self.finish()
        raise SystemExit(1)

    def finish(self) -> None:
        ctl = self.ctl
        notes = [e for e in read_events(self.run_dir) if e.get("rank") is None]
        self.report["morph_asked"] = [
            {k: e.get(k) for k in ("change", "gone", "added", "reason")}
            for e in notes
            if e["type"] == "morph_asked"
        ]
        self.report["job_ends"] = [
            [e.get("exit_code"), e.get("state")] for e in notes if e["type"] == "job_end"
        ]
        self.report["steps"] = [
            [e["job"], e["step"], e["loss"]]
            for e in read_events(self.run_dir)
            if e["type"] == "step_metrics" and e["rank"] == 0
        ]
        self.report["state"] = ctl.state
        if ctl.state not in ("stopped", "failed", "finished"):
            ctl.stop(checkpoint=False, timeout=20)
        ctl.close()
        print(json.dumps(self.report))

    def run(self) -> None:
        run = str(self.run_dir)
        self.launch("first")
        # coalesce: four changes well within the settle time, one grow
        t0 = time.monotonic()
        for action, host in (("add", "h3:1"), ("add", "h3:2"), ("add", "h1:1"), ("remove", "h1")):
            varuna("hosts", run, action, host)
        self.report["changes_s"] = round(time.monotonic() - t0, 2)
        self.launch("grown")
        # notice: h3 goes in 8 s; the job trains on while a step and a checkpoint (its duration
        # measured on the one asked for here) fit
        self.ctl.checkpoint(timeout=30)
        at = steps_by(self.ctl)
        deadline = time.time() + 8.0
        varuna("notice", run, "--deadline", "8s", "--host", "h3", "--reason", "spot preemption")
        noticed = self.ctl.job
        self.launch("after_notice")
        saved = [e for e in self.ctl.store.events("checkpoint_done", job=noticed.job_id) if e["rank"] == 0]
        ended = [e for e in self.ctl.store.events("job_end") if e.get("job") == noticed.job_id]
        self.report["notice"] = {
            "deadline": deadline,
            "steps_after": (saved[-1]["saved_step"] - at) if saved else None,
            "saved_at": saved[-1]["time"] if saved else None,
            "ended_at": ended[-1]["time"] if ended else None,
        }
        # h3 leaves the hostfile (the cloud took it) and comes back: a new host, grown onto
        varuna("hosts", run, "remove", "h3")
        time.sleep(1.0)
        varuna("hosts", run, "add", "h3:2")
        self.launch("returned")
        self.kill_during_write()
        self.launch("killed")
        self.report["kill"]["resumed_from"] = self.hello(self.report["launches"][-1]["job"])["resumed_from"]
        varuna("hosts", run, "remove", "h3")  # the source drops the dead host, then offers it again
        time.sleep(1.0)
        varuna("hosts", run, "add", "h3:2")
        self.launch("back")
        # an announced removal: shrink at the end of the step
        varuna("hosts", run, "remove", "h3")
        self.launch("removed")
        at = steps_by(self.ctl)
        wait_for(lambda: steps_by(self.ctl) >= at + 2, 30)
        self.report["stop"] = self.ctl.stop(checkpoint=True, timeout=30)
        self.report["listing"] = varuna("hosts", run, "list")
        self.finish()


def main() -> None:
    run_dir, hostfile, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    driver = Driver(run_dir, hostfile, steps)
    try:
        driver.run()
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - the report says what went wrong
        driver.fail(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
