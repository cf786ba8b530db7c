"""Drive a controller job across namespace hosts from the first one; print what happened as JSON.

    python multihost_controller.py steer RUN_DIR HOSTFILE STEPS
        2x2 -> checkpoint -> resize 1x2 -> stop -> resume 2x1 -> finished
    python multihost_controller.py lose RUN_DIR HOSTFILE STEPS FAULT_JSON
        2x2 -> checkpoint -> FAULT (a command line, e.g. kill a host's ranks or set its link down)
        -> host_dead -> relaunch on the hosts left -> stop

Run on host h1 by tests/multihost/test_multihost_jobs.py (the controller's sockets must be on the
hosts' subnet, which the test process cannot reach); the last line of stdout is the JSON report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from varuna.controller import JobController
from varuna.telemetry.events import read_events

SCRIPT = str(Path(__file__).parent / "controller_train.py")


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(predicate())


def steps_by(ctl: JobController) -> int:
    return max((m.step for m in ctl.step_metrics()), default=-1)


def running(ctl: JobController, report: dict, key: str, timeout: float = 60) -> None:
    state = ctl.wait(timeout, states=("running", "failed", "finished", "stopped"))
    if state != "running":
        report["error"] = f"{key}: {state}: {ctl.error} {ctl.summary()} {list(ctl.console.lines)[-20:]}"
        print(json.dumps(report))
        ctl.close()
        raise SystemExit(1)
    job = ctl.job
    assert job is not None
    hellos = ctl.store.events("hello", job=job.job_id)
    report[key] = {
        "shape": [job.pipeline, job.data],
        "hosts": {e["rank"]: e["host"] for e in hellos},
        "resumed_from": sorted({str(e.get("resumed_from")) for e in hellos}),
    }


def rank0_steps(run_dir: Path) -> list[list[float]]:
    """[step, loss] of every step_metrics event of rank 0, over all launches, in log order."""
    return [
        [e["step"], e["loss"]] for e in read_events(run_dir) if e["type"] == "step_metrics" and e["rank"] == 0
    ]


def steer(ctl: JobController, report: dict, steps: int) -> None:
    running(ctl, report, "first")
    report["address"] = [ctl.events_address, ctl.commands_address]
    report["beating"] = (
        sorted(r for r, a in ctl.liveness.actions().items() if a)
        if wait_for(lambda: len([a for a in ctl.liveness.actions().values() if a]) == 4, 10)
        else sorted(ctl.liveness.actions())
    )
    wait_for(lambda: steps_by(ctl) >= 1, 30)
    done = ctl.checkpoint(timeout=30)
    report["checkpoint"] = sorted([e["rank"], e["saved_step"]] for e in done)
    first = ctl.job
    ctl.resize(pipeline=1, data=2)
    wait_for(lambda: ctl.job is not first, 60)
    running(ctl, report, "resized")
    at = steps_by(ctl)
    wait_for(lambda: steps_by(ctl) >= at + 2, 30)
    report["stop"] = ctl.stop(checkpoint=True, timeout=30)
    report["stopped_at"] = steps_by(ctl)
    ctl.resume(pipeline=2, data=1)
    report["end"] = ctl.wait(120)


def lose(ctl: JobController, report: dict, fault: list[str]) -> None:
    running(ctl, report, "first")
    wait_for(lambda: steps_by(ctl) >= 1, 30)
    done = ctl.checkpoint(timeout=30)
    report["checkpoint"] = sorted([e["rank"], e["saved_step"]] for e in done)
    first = ctl.job
    fault_at = time.time()
    subprocess.run(fault, check=True, timeout=10)
    wait_for(lambda: ctl.store.events("host_dead"), 20)
    dead = ctl.store.events("host_dead")
    report["host_dead"] = [{k: e.get(k) for k in ("host", "how", "ranks", "reason")} for e in dead]
    report["detected_s"] = round(dead[0]["time"] - fault_at, 2) if dead else None
    report["error"] = ctl.error
    wait_for(lambda: ctl.job is not first, 60)
    report["dropped"] = [
        {k: e.get(k) for k in ("lost", "slots", "pipeline", "data")}
        for e in ctl.store.events("hosts_dropped")
    ]
    running(ctl, report, "relaunched")
    report["relaunched_s"] = round(time.time() - fault_at, 2)
    at = steps_by(ctl)
    wait_for(lambda: steps_by(ctl) >= at + 2, 30)
    report["stop"] = ctl.stop(checkpoint=True, timeout=30)


def main() -> None:
    scenario, run_dir, hostfile, steps = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    report: dict = {}
    ctl = JobController.start(
        [SCRIPT, str(steps), "0.05"], pipeline=2, data=2, run_dir=run_dir, hostfile=hostfile, grace_s=3.0
    )
    try:
        if scenario == "steer":
            steer(ctl, report, steps)
        else:
            lose(ctl, report, json.loads(sys.argv[5]))
        report["shapes"] = [[e["pipeline"], e["data"]] for e in ctl.store.events("job_start")]
        report["steps"] = rank0_steps(run_dir)
        report["agent_state"] = ctl.state
    finally:
        if ctl.state not in ("stopped", "failed", "finished"):
            ctl.stop(checkpoint=False, timeout=20)
        ctl.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
