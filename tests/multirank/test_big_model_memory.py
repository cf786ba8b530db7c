"""A model larger than one rank's memory trains when no rank holds it whole; a shape that cannot
fit is refused by the engine's memory check, not by the OOM killer.

A Llama-style model of ~0.5B parameters (1.9 GiB of fp32 weights; tests/scripts/big_llama_worker.py)
is built on the meta device, its weights written beforehand as sharded safetensors (shard by shard:
this process never holds the model either). Every rank runs in a memory cgroup of its own limited
to LIMIT, less than the model's weights:

- at P = 4 it trains two SGD steps from the shards, and each rank's peak resident memory grows from
  its baseline (measured before the model is built) by at most its stage's parameters and gradients,
  its largest gradient once more, and SLACK: never by anything near the whole model;
- at P = 1 the engine refuses it before allocating (MemoryLimitError naming the stage, the estimate,
  the cgroup's limit and what to change), reading the limit from the cgroup.

Needs root and a writable memory cgroup (v1 `memory.limit_in_bytes` or v2 `memory.max`); skipped
with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from _helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from big_llama_worker import config  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(400)]
LIMIT = int(1.8 * 2**30) // 4096 * 4096  # a cgroup keeps whole pages
SLACK = 320 * 2**20
"""Beyond the stage's parameters, gradients and largest gradient (made whole by autograd before it
is added into the gradient buffer): activations of one micro-batch of 16 tokens, the runtime's
working memory, the allocator's slack."""
SHARD = 256 * 2**20


def _cgroup_root() -> tuple[Path, str, dict[str, str]] | str:
    """Where memory cgroups are made, the limit file's name and extra settings; or why not."""
    if os.geteuid() != 0:
        return "memory cgroups need root"
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.controllers").read_text():
        return v2, "memory.max", {"memory.swap.max": "0"}
    v1 = Path("/sys/fs/cgroup/memory")
    if (v1 / "memory.limit_in_bytes").exists():
        return v1, "memory.limit_in_bytes", {}
    return "no memory cgroup hierarchy (v1 or v2) is mounted here"


@pytest.fixture(scope="module")
def cgroups() -> Iterator[Path]:
    """Memory cgroups <prefix>-rank0 ... -rank3, each limited to LIMIT; removed after the module.
    The prefix is returned: a rank moves itself into <prefix>-rank<r>."""
    found = _cgroup_root()
    if isinstance(found, str):
        pytest.skip(found)
    root, limit_file, extra = found
    prefix = root / f"varuna-test{os.getpid()}"
    made: list[Path] = []
    try:
        for r in range(4):
            group = Path(f"{prefix}-rank{r}")
            group.mkdir()
            made.append(group)
            (group / limit_file).write_text(str(LIMIT))
            for file, value in extra.items():
                if (group / file).exists():
                    (group / file).write_text(value)
            if (group / "memory.memsw.limit_in_bytes").exists():  # v1 with swap accounting
                (group / "memory.memsw.limit_in_bytes").write_text(str(LIMIT))
    except OSError as exc:
        for group in made:
            group.rmdir()
        pytest.skip(f"a memory cgroup with a limit cannot be made here ({exc})")
    try:
        yield prefix
    finally:
        for group in made:
            try:
                group.rmdir()
            except OSError:  # a rank still exiting: its cgroup goes with the next boot
                pass


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model's weights as save_pretrained's sharded layout, written one shard at a time."""
    import transformers
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config())
    folder = tmp_path_factory.mktemp("big-llama")
    g = torch.Generator().manual_seed(0)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    shards: list[list[str]] = [[]]
    size = 0
    for key, shape in shapes.items():
        nbytes = shape.numel() * 4
        if shards[-1] and size + nbytes > SHARD:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {
            k: torch.ones(shapes[k])
            if k.endswith("norm.weight")
            else torch.randn(shapes[k], generator=g) * 0.02
            for k in keys
        }
        save_file(tensors, str(folder / name))
        weight_map |= dict.fromkeys(keys, name)
        del tensors
    total = sum(s.numel() * 4 for s in shapes.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    assert total > LIMIT, "the test needs a model larger than one rank's limit"
    return folder


def _run(
    varuna_run, pipeline: int, base: Path, weights: Path, cgroups: Path
) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = base / f"out{pipeline}"
    done = varuna_run(
        [SCRIPTS / "big_llama_worker.py", out, weights, cgroups],
        pipeline=pipeline,
        run_dir=base / f"run{pipeline}",
        cwd=base,
        env={"TRANSFORMERS_VERBOSITY": "error"},
        timeout=360,
        check=False,
    )
    return done, out


def test_a_model_larger_than_a_rank_trains_at_p4_and_no_rank_holds_it(
    cgroups: Path, weights: Path, tmp_path: Path, varuna_run
) -> None:
    done, out = _run(varuna_run, 4, tmp_path, weights, cgroups)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    whole = sum(json.loads((weights / "model.safetensors.index.json").read_text())["metadata"].values())
    print()
    for r in ranks:
        grown = r["peak"] - r["baseline"]
        bound = 2 * r["stage_param_bytes"] + r["estimate"]["transient"] + SLACK
        est = r["estimate"]
        print(
            f"rank {r['rank']}: stage {r['stage_param_bytes'] / 2**20:.0f} MiB of parameters, grew "
            f"{grown / 2**20:.0f} MiB (bound {bound / 2**20:.0f}; whole model {whole / 2**20:.0f} MiB), "
            f"peak {r['peak'] / 2**20:.0f} MiB; estimate {est['total'] / 2**20:.0f} MiB + baseline "
            f"{est['baseline'] / 2**20:.0f}, limit {est['limit']}"
        )
        assert grown <= bound, r
        assert r["stage_param_bytes"] < whole / 2
        assert est["limit"] == LIMIT and str(cgroups) in est["limit_source"]
        assert est["params"] == r["stage_param_bytes"] and est["optimizer"] == 0
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert sorted(r["stage"] for r in ranks) == [0, 1, 2, 3]
    assert len({tuple(r["losses"]) for r in ranks}) == 1


def test_at_p1_the_memory_check_refuses_it_before_the_oom_killer(
    cgroups: Path, weights: Path, tmp_path: Path, varuna_run
) -> None:
    done, out = _run(varuna_run, 1, tmp_path, weights, cgroups)
    text = done.stdout + done.stderr
    assert done.returncode == 1, text[-4000:]  # a Python exception, not a kill (137) by the OOM killer
    assert "MemoryLimitError: rank 0 (stage 0, replica 0) would need about" in text, text[-4000:]
    assert f"but has 1.8 GiB (the memory cgroup's limit ({cgroups}-rank0/" in text
    assert "Nothing was allocated; try more pipeline stages (pipeline=1 now" in text
    assert not out.exists()
