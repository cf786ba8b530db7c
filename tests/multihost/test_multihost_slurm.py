"""`varuna run` inside a real Slurm allocation (Debian's slurm-wlm: munged, slurmctld and slurmd started
here, as root, for this module; `slurm_cluster.SlurmCluster`).

- An sbatch job of 2 tasks runs `varuna run --elastic -p 2`: srun starts the ranks, which meet through
  the run directory; `varuna resize --gpus 4` (and `-p 2 -d 2`) beyond the 2 slots are refused with a
  typed error, `--gpus 1` morphs the job to 1x1 inside the allocation; every loss equals plain training.
- A shape beyond the allocation is refused before anything starts.
- A rank that fails takes the step down (srun --kill-on-bad-exit) and is named first; a SIGTERM to
  `varuna run` reaches the ranks (scancel), which checkpoint before they stop.
- Two nodes: a Slurm of three namespace hosts (`varuna.bench.netns`, a slurmd in each): a 2-node allocation runs
  one stage per node, its ranks meet over the hosts' subnet, and the losses equal plain training; the
  elastic agent's Slurm host source (`varuna.elastic.hostset.SlurmSource`) reads a live allocation's nodes
  and tasks per node as `scontrol` gives them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from _helpers import REPO, SCRIPTS
from slurm_cluster import SlurmCluster, slurm_unavailable

from varuna.bench.netns import NetnsHosts

sys.path.insert(0, str(SCRIPTS))
from transparency_common import reference  # noqa: E402

from varuna._slurm import expand_hostlist  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.foreground, pytest.mark.timeout(150)]


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """A one-node Slurm (this machine, 2 CPUs) for the module; every process of it ended afterwards."""
    reason = slurm_unavailable()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster(cpus=2).up()
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(scope="module")
def slurm_hosts(hosts: NetnsHosts) -> Iterator[SlurmCluster]:
    """A Slurm whose nodes are the namespace hosts h1, h2, h3 (slurmctld on h1), for the module."""
    reason = slurm_unavailable()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster(cpus=2, nodes={h: hosts.address(h) for h in hosts.names}, on_host=hosts.command)
    cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()


def _env(slurm: SlurmCluster) -> dict[str, str]:
    return slurm.env({**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


def _varuna(
    slurm: SlurmCluster, *args: str, cwd: Path, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "varuna", *args],
        env=_env(slurm),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _records(out: Path) -> list[dict]:
    path = out / "losses.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_multihost_slurm_sbatch_job_trains_and_resizes_inside_its_allocation(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # 100 steps (~0.04 s each at 2x1): `varuna resize` (a fresh interpreter) lands well before the end
    run, out, steps = tmp_path / "run", tmp_path / "out", 100
    out.mkdir()
    script, log, status = tmp_path / "job.sbatch", tmp_path / "slurm.out", tmp_path / "status"
    script.write_text(  # the exit status in a file: `sbatch --wait` polls Slurm and returns ~25 s late
        "#!/bin/bash\n#SBATCH --ntasks=2\n"
        f"{sys.executable} -m varuna run --elastic --pipeline 2 --run-dir {run} "
        f"{SCRIPTS / 'morph_train.py'} {out} {steps} fp32\n"
        f"echo $? > {status}.tmp && mv {status}.tmp {status}\n"
    )
    submitted = subprocess.run(
        slurm.client(["sbatch", "--parsable", f"--output={log}", str(script)]),
        env=_env(slurm),
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert submitted.returncode == 0, submitted.stderr
    slurm_job = submitted.stdout.strip().split(";")[0]

    def wait_for(ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert time.monotonic() < deadline, f"{what}:\n{log.read_text()[-4000:] if log.exists() else ''}"
            time.sleep(0.1)

    wait_for(lambda: len(_records(out)) >= 2, 90, "no training steps")
    asked = _varuna(slurm, "resize", str(run), "--gpus", "1", cwd=tmp_path)
    assert asked.returncode == 0, asked.stderr
    wait_for(status.exists, 120, "the job did not end")
    text = log.read_text()
    assert status.read_text().strip() == "0", text[-4000:]
    for args in (["--gpus", "4"], ["-p", "2", "-d", "2"]):  # job.json keeps the allocation: 2 slots
        refused = _varuna(slurm, "resize", str(run), *args, "--no-signal", cwd=tmp_path)
        assert refused.returncode == 2, refused.stderr
        assert f"needs 4 ranks but Slurm job {slurm_job}: 2 task slots on {slurm.node} (2)" in refused.stderr
    meta = json.loads((run / "job.json").read_text())
    assert meta["launcher"] == "srun" and Path(meta["command"][0]).name == "srun"
    assert meta["slurm"]["hosts"] == [slurm.node] and meta["slurm"]["tasks"] == [2]
    met = json.loads((run / "rendezvous.json").read_text())  # the ranks met through the run dir
    assert met["job_id"] == meta["job_id"]
    assert "srun in Slurm job" in text and "morphing 2x1 -> 1x1" in text
    records = _records(out)
    assert [r["step"] for r in records] == list(range(steps))
    morph_at = next(i for i, r in enumerate(records) if r["shape"] == "1x1")
    assert 2 <= morph_at < steps and {r["shape"] for r in records[:morph_at]} == {"2x1"}
    ref_losses, _ = reference("gpt", steps=steps)
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in records]), torch.tensor(ref_losses), rtol=1e-5, atol=0
    )


def test_multihost_slurm_shape_beyond_the_allocation_is_refused(slurm: SlurmCluster, tmp_path: Path) -> None:
    done = subprocess.run(
        slurm.client(
            [
                "salloc",
                "--ntasks=2",
                "--",
                sys.executable,
                "-m",
                "varuna",
                "run",
                "-p",
                "2",
                "-d",
                "2",
                "--run-dir",
                str(tmp_path / "run"),
                "-m",
                "varuna.demo",
            ]
        ),
        env=_env(slurm),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2, done.stderr
    assert "varuna: error: pipeline 2 x data 2 needs 4 ranks but Slurm job" in done.stderr
    assert f"2 task slots on {slurm.node} (2); ask for more tasks" in done.stderr
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_multihost_slurm_failing_rank_ends_the_step_and_is_named(slurm: SlurmCluster, tmp_path: Path) -> None:
    started = time.monotonic()
    done = subprocess.run(
        slurm.client(
            [
                "salloc",
                "--ntasks=2",
                "--",
                sys.executable,
                "-m",
                "varuna",
                "run",
                "-p",
                "2",
                "--run-dir",
                str(tmp_path / "run"),
                str(SCRIPTS / "launch_fail.py"),
                "raise",
            ]
        ),
        env=_env(slurm),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("varuna: rank")]
    assert said[0].startswith("varuna: rank 1 (stage 1, replica 0) failed: ValueError: boom"), said
    assert time.monotonic() - started < 60  # rank 0 sat in a barrier for 120 s: srun ended it


def _launcher_pid(run: Path) -> int | None:
    """The `python -m varuna run ... --run-dir RUN` process (not salloc, which names it too)."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if argv[:4] == [sys.executable, "-m", "varuna", "run"] and str(run) in argv:
            return int(entry.name)
    return None


def test_multihost_slurm_sigterm_reaches_the_ranks_which_checkpoint(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    job = subprocess.Popen(
        slurm.client(
            [
                "salloc",
                "--ntasks=2",
                "--",
                sys.executable,
                "-m",
                "varuna",
                "run",
                "-p",
                "2",
                "--run-dir",
                str(run),
                str(SCRIPTS / "morph_train.py"),
                str(out),
                "100000",
                "fp32",
            ]
        ),
        env=_env(slurm),
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while len(_records(out)) < 2 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        launcher = _launcher_pid(run)
        assert launcher is not None and len(_records(out)) >= 2, job.poll()
        os.kill(launcher, signal.SIGTERM)
        text, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 128 + signal.SIGTERM, text[-4000:]
    assert "varuna: job stopped by SIGTERM" in text and "stop requested (SIGTERM); checkpointed step" in text
    statuses = [json.loads((run / "status" / f"rank{r}.json").read_text())["state"] for r in (0, 1)]
    assert statuses == ["morph", "morph"]  # both checkpointed and left cleanly, none killed
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{len(_records(out)):08d}"


def test_multihost_slurm_two_node_allocation_runs_a_stage_per_node(
    slurm_hosts: SlurmCluster, hosts: NetnsHosts, tmp_path: Path
) -> None:
    run, out, steps = tmp_path / "run", tmp_path / "out", 8
    out.mkdir()
    done = subprocess.run(
        slurm_hosts.client(
            [
                "salloc",
                "--nodes=2",
                "--ntasks-per-node=1",
                "--",
                sys.executable,
                "-m",
                "varuna",
                "run",
                "-p",
                "2",
                "--run-dir",
                str(run),
                str(SCRIPTS / "morph_train.py"),
                str(out),
                str(steps),
                "fp32",
            ]
        ),
        env=_env(slurm_hosts),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    allocated = json.loads((run / "job.json").read_text())["slurm"]["hosts"]
    assert len(allocated) == 2 and set(allocated) <= set(hosts.names)
    ran_on = [json.loads((run / "status" / f"rank{r}.json").read_text())["host"] for r in (0, 1)]
    assert ran_on == allocated  # stage 0 on the first node, stage 1 on the second
    assert json.loads((run / "rendezvous.json").read_text())["host"] == hosts.address(allocated[0])
    records = _records(out)
    assert [r["step"] for r in records] == list(range(steps))
    ref_losses, _ = reference("gpt", steps=steps)
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in records]), torch.tensor(ref_losses), rtol=1e-5, atol=0
    )


def test_multihost_slurm_host_source_reads_the_allocation_it_runs_in(
    slurm_hosts: SlurmCluster, hosts: NetnsHosts
) -> None:
    """`watch_hosts="slurm"`'s source inside a real 2-node allocation of 2 tasks per node: each node
    once, with its task slots; outside an allocation a typed error says what it needs."""
    read = "import json; from varuna.elastic.hostset import SlurmSource as S; print(json.dumps(S().read()))"
    done = subprocess.run(
        slurm_hosts.client(["salloc", "--nodes=2", "--ntasks-per-node=2", "--", sys.executable, "-c", read]),
        env=_env(slurm_hosts),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    offered = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"the allocation as its host source reads it: {offered}")
    assert len(offered) == 2 and set(offered) <= set(hosts.names) and set(offered.values()) == {2}, offered
    env = {k: v for k, v in _env(slurm_hosts).items() if k != "SLURM_JOB_ID"}
    outside = subprocess.run(
        [sys.executable, "-c", read],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert outside.returncode != 0 and "host source 'slurm' needs a Slurm allocation" in outside.stderr


def test_multihost_slurm_hostlists_read_as_scontrol_reads_them(slurm: SlurmCluster) -> None:
    for text in ("vm", "node[01-03,07],gpu5", "r[1-2]n[1-2],a,b[09-11]", "n[8-10]"):
        said = subprocess.run(
            slurm.client(["scontrol", "show", "hostnames", text]),
            env=_env(slurm),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert said.returncode == 0, said.stderr
        assert expand_hostlist(text) == said.stdout.split(), text
