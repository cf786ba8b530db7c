"""The controller and its agent across hosts: ranks on h2 and h3, the controller (and the agent,
and mpiexec) on h1, the run directory on the shared file system. Each test is one run of
tests/scripts/multihost_controller.py on h1, which reports what happened as JSON:

    steer         h2:1 h3:1   2x2 -> checkpoint -> resize 1x2 -> stop -> resume 2x1 -> finished
    ranks killed  h2:2 h3:2   2x2 -> checkpoint -> SIGKILL h3's ranks -> host_dead h3 -> 2x1 on h2
    link down     h2:2 h3:2   2x2 -> checkpoint -> h3's link down     -> host_dead h3 -> 2x1 on h2

Losses are those of plain training on the same global batches (every step exactly once in the
steer run; after a host loss the steps since the checkpoint are trained again, to the same losses).

One more test launches `varuna run` itself on h1 (no controller): the same hostfile h2:2 h3:2 puts
ranks 0-3 on h2 h2 h3 h3 by default and on h2 h3 h2 h3 with `--placement cyclic`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _helpers import REPO, SCRIPTS

from varuna.bench.netns import NetnsHosts
from varuna.telemetry.events import read_events

sys.path.insert(0, str(SCRIPTS))
from transparency_common import reference  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.foreground]
DRIVER = SCRIPTS / "multihost_controller.py"
STEER_STEPS = 24


def drive(
    hosts: NetnsHosts, folder: Path, scenario: str, slots: dict[str, int], steps: int, *fault: str, **env: str
) -> dict:
    """Run the driver on h1 and return its report; the test fails with its output if it fails."""
    folder.mkdir(parents=True, exist_ok=True)
    hostfile = hosts.hostfile(folder / "hosts", slots)
    argv = [sys.executable, str(DRIVER), scenario, str(folder / "run"), str(hostfile), str(steps)]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "VARUNA_MPIEXEC_ARGS": hosts.mpiexec_args,
        **env,
    }
    done = subprocess.run(
        hosts.command("h1", argv + ([json.dumps(list(fault))] if fault else [])),
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        stdin=subprocess.DEVNULL,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        agent_log = folder / "run" / "logs" / "agent.log"
        log = agent_log.read_text()[-3000:] if agent_log.exists() else ""
        pytest.fail(f"driver exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{log}")
    return json.loads(lines[-1])


def workers_on(hosts: NetnsHosts, host: str) -> list[int]:
    """The varuna ranks still running on `host`."""
    pids = subprocess.run(["ip", "netns", "pids", hosts.netns(host)], capture_output=True, text=True).stdout
    found = []
    for pid in pids.split():
        try:
            if b"varuna.launch.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


@functools.cache
def plain_losses() -> list[float]:
    """Plain training's losses for the first STEER_STEPS steps (computed once for the module)."""
    torch.set_num_threads(1)
    return reference("gpt", steps=STEER_STEPS)[0]


def assert_plain_losses(steps: list[list[float]], count: int) -> None:
    ref = plain_losses()
    assert count <= len(ref), f"{count} steps trained; plain_losses() has {len(ref)}"
    for step, loss in steps:
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(ref[step]), rtol=1e-5, atol=0)


@pytest.mark.timeout(180)
def test_multihost_controller_steers_ranks_on_other_hosts(hosts: NetnsHosts, tmp_path: Path) -> None:
    # 24 steps: the resized job must still be running when the driver, two steps after the resize,
    # asks it to stop (on a loaded machine 16 steps were sometimes all done by then)
    report = drive(hosts, tmp_path, "steer", {"h2": 1, "h3": 1}, STEER_STEPS)
    h1 = hosts.address("h1")
    assert report["address"] == [a for a in report["address"] if a.startswith(f"tcp://{h1}:")]  # not loopback
    # events from every rank on both hosts (hello, heartbeats), commands to every rank (checkpoint)
    assert report["first"]["hosts"] == {"0": "h2", "1": "h3", "2": "h2", "3": "h3"}
    assert report["beating"] == [0, 1, 2, 3]
    assert [r for r, _ in report["checkpoint"]] == [0, 1, 2, 3]
    assert len({s for _, s in report["checkpoint"]}) == 1  # all on the same step
    # resize, stop and resume across hosts, from checkpoints on the shared file system
    assert report["resized"]["shape"] == [1, 2] and report["resized"]["hosts"] == {"0": "h2", "1": "h3"}
    assert report["resized"]["resumed_from"] != ["None"]
    assert report["stop"] == "stopped" and report["end"] == "finished"
    assert report["shapes"] == [[2, 2], [1, 2], [2, 1]]
    assert [s for s, _ in report["steps"]] == list(range(STEER_STEPS))  # every step exactly once
    assert_plain_losses(report["steps"], STEER_STEPS)


def check_relaunch(report: dict, how: str) -> None:
    print(
        f"host h3 {how}: reported after {report['detected_s']} s, training again after {report['relaunched_s']} s"
    )
    (dead,) = report["host_dead"]
    assert (dead["host"], dead["how"], dead["ranks"]) == ("h3", how, [2, 3])
    assert report["detected_s"] < 10, report["detected_s"]
    assert "h3" in report["error"]
    assert report["dropped"] == [{"lost": ["h3"], "slots": 2, "pipeline": 2, "data": 1}]  # same global batch
    assert report["relaunched"]["shape"] == [2, 1]
    assert report["relaunched"]["hosts"] == {"0": "h2", "1": "h2"}
    saved = report["checkpoint"][0][1]
    assert report["relaunched"]["resumed_from"][0].endswith(f"step-{saved:08d}")
    assert report["stop"] == "stopped" and report["shapes"] == [[2, 2], [2, 1]]
    steps = sorted({s for s, _ in report["steps"]})
    assert steps == list(range(len(steps))) and len(steps) > saved + 2
    assert_plain_losses(report["steps"], len(steps))


@pytest.mark.timeout(180)
def test_multihost_a_host_whose_ranks_are_killed_is_named_and_left_out(
    hosts: NetnsHosts, tmp_path: Path
) -> None:
    kill = f"for p in $(ip netns pids {hosts.netns('h3')}); do grep -q varuna.launch.worker /proc/$p/cmdline && kill -9 $p; done; true"
    report = drive(hosts, tmp_path, "lose", {"h2": 2, "h3": 2}, 100000, "sh", "-c", kill)
    check_relaunch(report, "killed")
    assert workers_on(hosts, "h2") == [] and workers_on(hosts, "h3") == []  # mpiexec's teardown ended them


@pytest.mark.timeout(180)
def test_multihost_a_host_whose_link_goes_down_is_named_and_left_out(
    hosts: NetnsHosts, tmp_path: Path
) -> None:
    port = ["ip", "-n", f"{hosts.prefix}-sw", "link", "set", f"{hosts.prefix}p3"]
    try:
        # a distributed timeout of 20 s: the ranks cut off on h3 give up waiting for their peers by then
        report = drive(
            hosts, tmp_path, "lose", {"h2": 2, "h3": 2}, 100000, *port, "down", VARUNA_TIMEOUT="20"
        )
        check_relaunch(report, "silent")
        assert workers_on(hosts, "h2") == []  # the survivors went with mpiexec's teardown
        deadline = time.monotonic() + 30  # nothing can reach h3: its ranks end by their own timeout
        while workers_on(hosts, "h3") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert workers_on(hosts, "h3") == []
        failures = [json.loads(p.read_text()) for p in (tmp_path / "run" / "failures").glob("rank*.json")]
        assert all(f["host"] == "h3" and "Timed out" in f["message"] for f in failures)  # late, ignored
    finally:
        subprocess.run([*port, "up"], check=False)
        for pid in workers_on(hosts, "h3"):
            os.kill(pid, 9)


@pytest.mark.timeout(300)
def test_multihost_placement_cyclic_deals_ranks_to_the_hosts_in_turn(
    hosts: NetnsHosts, tmp_path: Path, varuna_run
) -> None:
    hostfile = hosts.hostfile(tmp_path / "hosts", {"h2": 2, "h3": 2})
    placed = {}
    for placement, flag in (("block", []), ("cyclic", ["--placement", "cyclic"])):  # block: the default
        run_dir = tmp_path / placement
        varuna_run(
            [SCRIPTS / "controller_train.py", "2", "0"],  # 2 steps, no pause
            pipeline=2,
            data=2,
            run_dir=run_dir,
            flags=["--hostfile", str(hostfile), *flag, "--timeout", "100"],
            env={"VARUNA_MPIEXEC_ARGS": hosts.mpiexec_args},
            wrap=hosts.command("h1", []),
            cwd=tmp_path,
            timeout=110,
        )
        hello = [e for e in read_events(run_dir) if e["type"] == "hello"]
        placed[placement] = [h["host"] for h in sorted(hello, key=lambda e: e["rank"])]
        assert json.loads((run_dir / "job.json").read_text())["placement"] == placement
    assert placed == {"block": ["h2", "h2", "h3", "h3"], "cyclic": ["h2", "h3", "h2", "h3"]}
