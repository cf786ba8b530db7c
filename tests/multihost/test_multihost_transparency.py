"""Equal to plain training across hosts: P = 2, D = 2 `varuna run` jobs on namespace hosts.

Three placements, each one job from the first host with the launcher shim (`NetnsHosts.mpiexec_args`
through ``VARUNA_MPIEXEC_ARGS``); rank r is stage r % 2 of replica r // 2 and hydra fills a
hostfile's slots in order:

    stages-apart     h1:1 h2:1        stage 0 on h1, stage 1 on h2: activations and gradients cross hosts
    replicas-apart   h1:2 h2:2        replica 0 on h1, replica 1 on h2: the gradient all-reduce crosses
    three-hosts      h1:2 h2:1 h3:1   replica 0 on h1; replica 1's stages on h2 and h3

For GPT and BERT under every schedule, the 5 step losses and the final parameters match
single-process training on the same global batches within 1e-5 relative, as
tests/multirank/test_transparency.py asks of one host.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import SCRIPTS
from netns_hosts import NetnsHosts

sys.path.insert(0, str(SCRIPTS))
from transparency_common import MODELS, SCHEDULES, reference  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(420)]
RTOL = 1e-5
LAYOUTS: dict[str, tuple[dict[str, int], dict[str, str]]] = {
    "stages-apart": ({"h1": 1, "h2": 1}, {}),
    # a GLOO_SOCKET_IFNAME=lo left in the environment (a notebook that trained alone) must not cut h1 off
    "replicas-apart": ({"h1": 2, "h2": 2}, {"GLOO_SOCKET_IFNAME": "lo"}),
    "three-hosts": ({"h1": 2, "h2": 1, "h3": 1}, {}),
}


@pytest.fixture(scope="module")
def runs(hosts: NetnsHosts, tmp_path_factory: pytest.TempPathFactory, varuna_popen) -> dict[str, Path]:
    """One job per placement, all started at once from h1; each must end with exit code 0."""
    base = tmp_path_factory.mktemp("multihost")
    procs = {}
    for name, (slots, env) in LAYOUTS.items():
        log = open(base / f"{name}.log", "w")
        proc = varuna_popen(
            [SCRIPTS / "multihost_worker.py", base / name, ",".join(SCHEDULES)],
            pipeline=2, data=2, run_dir=base / f"run-{name}",
            flags=["--hostfile", str(hosts.hostfile(base / f"{name}.hosts", slots)), "--timeout", "300"],
            env={"VARUNA_MPIEXEC_ARGS": hosts.mpiexec_args, **env},
            wrap=hosts.command("h1", []), cwd=base, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_multihost_ranks_run_where_the_hostfile_puts_them(runs, hosts: NetnsHosts, layout: str) -> None:
    ranks = _results(runs[layout] / f"gpt-{SCHEDULES[0]}")
    where = {(r["replica"], r["stage"]): r["host"] for r in ranks}
    expected = {
        "stages-apart": {(0, 0): "h1", (0, 1): "h2", (1, 0): "h1", (1, 1): "h2"},
        "replicas-apart": {(0, 0): "h1", (0, 1): "h1", (1, 0): "h2", (1, 1): "h2"},
        "three-hosts": {(0, 0): "h1", (0, 1): "h1", (1, 0): "h2", (1, 1): "h3"},
    }[layout]
    assert where == expected
    # one network stack per host, and gloo on the subnet's interface everywhere (never lo)
    stacks = {r["host"]: r["stack"] for r in ranks}
    assert len(set(stacks.values())) == len(stacks) == len(LAYOUTS[layout][0])
    assert {r["gloo_ifname"] for r in ranks} == {"eth0"}


CASES = [(layout, kind, schedule) for layout in LAYOUTS for kind in MODELS for schedule in SCHEDULES]


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
    assert min(seen.values()) >= 2
