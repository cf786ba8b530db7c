"""Equal to plain training across hosts: P = 2, D = 2 `varuna run` jobs on namespace hosts.

Three placements, each one job from the first host with the launcher shim (`NetnsHosts.mpiexec_args`
through ``VARUNA_MPIEXEC_ARGS``); rank r is stage r % 2 of replica r // 2 and hydra fills a
hostfile's slots in order:

    stages-apart     h1:1 h2:1        stage 0 on h1, stage 1 on h2: activations and gradients cross hosts
    replicas-apart   h1:2 h2:2        replica 0 on h1, replica 1 on h2: the gradient all-reduce crosses
    three-hosts      h1:2 h2:1 h3:1   replica 0 on h1; replica 1's stages on h2 and h3
    one-name         h1:1 h2:1        stages apart, every host with this machine's name

For GPT and BERT under every schedule, the 5 step losses and the final parameters match
single-process training on the same global batches within 1e-5 relative, as
tests/multirank/test_transparency.py asks of one host.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from _helpers import SCRIPTS

from varuna.bench.netns import NetnsHosts

sys.path.insert(0, str(SCRIPTS))
from transparency_common import MODELS, SCHEDULES, reference  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(420)]
RTOL = 1e-5
SHAPED_MBIT = 100


@dataclass(frozen=True)
class Layout:
    slots: dict[str, int]
    """The hostfile: hydra fills the slots in order, so rank r runs on the r-th slot."""
    env: dict[str, str] = field(default_factory=dict)
    own_names: bool = True
    """False: every host has this machine's name, as two machines both called ``node`` would."""
    mpiexec_args: str = ""
    """More of mpiexec's own options, after the launcher shim's."""
    schedules: tuple[str, ...] = SCHEDULES


LAYOUTS = {
    "stages-apart": Layout({"h1": 1, "h2": 1}),
    # a GLOO_SOCKET_IFNAME=lo left in the environment (a notebook that trained alone) must not cut h1 off
    "replicas-apart": Layout({"h1": 2, "h2": 2}, {"GLOO_SOCKET_IFNAME": "lo"}),
    "three-hosts": Layout({"h1": 2, "h2": 1, "h3": 1}),
    # one name on every host: the ranks must still tell the network stacks apart (not use loopback);
    # hydra's own traffic then needs `-iface` as its host-name lookup would fail
    "one-name": Layout(
        {"h1": 1, "h2": 1},
        {"NETNS_HOSTS_SAME_NAME": "1"},
        own_names=False,
        mpiexec_args="-iface eth0",
        schedules=("varuna",),
    ),
}


@pytest.fixture(scope="module")
def runs(hosts: NetnsHosts, tmp_path_factory: pytest.TempPathFactory, varuna_popen) -> dict[str, Path]:
    """One job per placement, all started at once from h1, with h2's link shaped to a slow Ethernet
    (`SHAPED_MBIT`) while they run; each must end with exit code 0."""
    base = tmp_path_factory.mktemp("multihost")
    procs = {}
    hosts.shape("h2", SHAPED_MBIT)
    try:
        return _run_layouts(hosts, base, varuna_popen, procs)
    finally:
        hosts.shape("h2", None)


def _run_layouts(hosts: NetnsHosts, base: Path, varuna_popen, procs: dict) -> dict[str, Path]:
    for name, layout in LAYOUTS.items():
        log = open(base / f"{name}.log", "w")
        proc = varuna_popen(
            [SCRIPTS / "multihost_worker.py", base / name, ",".join(layout.schedules)],
            pipeline=2,
            data=2,
            run_dir=base / f"run-{name}",
            flags=[
                "--hostfile",
                str(hosts.hostfile(base / f"{name}.hosts", layout.slots)),
                "--timeout",
                "300",
            ],
            env={"VARUNA_MPIEXEC_ARGS": f"{hosts.mpiexec_args} {layout.mpiexec_args}", **layout.env},
            wrap=hosts.command("h1", [], own_name=layout.own_names),
            cwd=base,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        procs[name] = (proc, log)
    for name, (proc, log) in procs.items():
        try:
            code: int | str = proc.wait(timeout=360)
        except subprocess.TimeoutExpired:
            code = "timeout"
        log.close()
        assert code == 0, f"{name} job failed ({code}):\n{(base / f'{name}.log').read_text()[-6000:]}"
    return {name: base / name for name in LAYOUTS}


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    torch.set_num_threads(1)
    return {kind: reference(kind) for kind in MODELS}


def _results(folder: Path) -> list[dict]:
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(4)]


# (replica, stage) -> host: what each layout is for
WHERE = {
    "stages-apart": {(0, 0): "h1", (0, 1): "h2", (1, 0): "h1", (1, 1): "h2"},
    "replicas-apart": {(0, 0): "h1", (0, 1): "h1", (1, 0): "h2", (1, 1): "h2"},
    "three-hosts": {(0, 0): "h1", (0, 1): "h1", (1, 0): "h2", (1, 1): "h3"},
    "one-name": {(0, 0): "h1", (0, 1): "h2", (1, 0): "h1", (1, 1): "h2"},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_multihost_ranks_run_where_the_hostfile_puts_them(runs, hosts: NetnsHosts, layout: str) -> None:
    spec = LAYOUTS[layout]
    ranks = _results(runs[layout] / f"gpt-{spec.schedules[0]}")
    expected = WHERE[layout]
    assert {(r["replica"], r["stage"]): r["address"] for r in ranks} == {
        key: hosts.address(host) for key, host in expected.items()
    }
    names = {r["host"] for r in ranks}
    assert names == (set(expected.values()) if spec.own_names else {socket.gethostname()})
    # one network stack per host, and gloo on the subnet's interface everywhere (never lo)
    stacks = {r["address"]: r["stack"] for r in ranks}
    assert len(set(stacks.values())) == len(stacks) == len(spec.slots)
    assert {r["gloo_ifname"] for r in ranks} == {"eth0"}


CASES = [
    (name, kind, schedule) for name, spec in LAYOUTS.items() for kind in MODELS for schedule in spec.schedules
]


@pytest.mark.parametrize(("layout", "kind", "schedule"), CASES, ids=["-".join(c) for c in CASES])
def test_multihost_equals_plain_training(runs, references, layout: str, kind: str, schedule: str) -> None:
    ref_losses, ref_params = references[kind]
    ranks = _results(runs[layout] / f"{kind}-{schedule}")
    seen: dict[str, int] = {}
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=0)
        for name, value in r["params"].items():
            torch.testing.assert_close(
                value, ref_params[name], rtol=RTOL, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
            )
            seen[name] = seen.get(name, 0) + 1
    assert set(seen) == set(ref_params)  # every parameter is trained somewhere, on both replicas
    for r in ranks:  # the all-reduce overlapped the pipeline: every bucket started before ALLREDUCE
        assert r["buckets"] > 1 and r["started_early"] == r["buckets"], r["started_early"]
    assert min(seen.values()) >= 2
