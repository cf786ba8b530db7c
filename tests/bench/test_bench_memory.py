"""`python -m varuna.bench memory`: the weights folder it writes, its settings, and a real `--quick --json` run.

Benchmarks never gate: the run's checks are invariants that hold whatever the host's speed or load
(a peak is at least its baseline, the estimate prices the parameters the stage really holds, a
rank at P = 4 grows by less than the whole model's parameter bytes while its stage is made and
loaded and by at least that much less than the one rank at P = 1 over the steps, more stages hold
less and fit more layers, the verified size is not refused and trains), never a timing or an error
bound. "A rank at P = 4 grows by less than half the model's parameter bytes" does not hold and is
not checked: the rank holds its quarter of the parameters, a gradient buffer as large (made with
the stage), and a step's working memory, which on the quick model is as large as its stage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _helpers import run_bench

from varuna.bench.memory import MemoryBench, quick
from varuna.errors import ConfigError


def _tiny_llama() -> object:
    from varuna.bench.memory import meta_llama

    small = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "num_hidden_layers": 3,
    }
    return meta_llama(quick().config | small)


def test_weights_folder_is_sharded_with_an_index_and_read_by_the_engine(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import torch
    from safetensors import safe_open

    from varuna.bench.memory import write_weights
    from varuna.checkpoint.weights import WeightsSource

    model = _tiny_llama()
    shapes = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    written = write_weights(model, tmp_path, shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert written["shards"] == len(files) > 1
    assert set(index["weight_map"]) == set(shapes)
    assert (
        index["metadata"]["total_size"]
        == written["bytes"]
        == 4 * sum(torch.Size(s).numel() for s in shapes.values())
    )
    for file in files:
        with safe_open(str(tmp_path / file), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                assert tuple(t.shape) == shapes[key] and t.dtype == torch.float32
                if key.endswith("norm.weight"):
                    assert torch.equal(t, torch.ones_like(t))
                else:
                    assert 0.01 < float(t.std()) < 0.03
        assert (tmp_path / file).stat().st_size <= 64 * 1024 + 4096  # the limit plus a header
    source = WeightsSource.open(tmp_path)
    assert all(source.shape(k) == s for k, s in shapes.items())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"pipelines": (1, 2), "torch_pipelines": (4,)},
            r"torch_pipelines \[4\] holds \[4\], not among pipelines",
        ),
        ({"verify_pipelines": (3,)}, r"verify_pipelines \[3\] holds \[3\], not among pipelines \[1, 2, 4\]"),
        ({"pipelines": (1, 8)}, r"pipelines must be integers in \[1, num_hidden_layers=4\] \(got 8\)"),
        ({"global_batch_size": 3, "micro_batch_size": 2}, r"global_batch_size \(3\) must be a multiple"),
        ({"limit": "lots"}, r"cannot read the memory size 'lots'"),
        ({"baseline_margin": 1.5}, r"baseline_margin must be in \[0, 1\) \(got 1.5\)"),
    ],
)
def test_bad_memory_bench_settings_name_the_fix(change: dict, message: str) -> None:
    from varuna.errors import PlanError

    with pytest.raises((ConfigError, PlanError), match=message):
        MemoryBench(**({"config": quick().config, "torch_pipelines": (2,)} | change))


@pytest.mark.multirank
def test_memory_bench_quick_reports_every_rank_and_a_verified_largest_model() -> None:
    pytest.importorskip("transformers")
    report, stderr = run_bench("memory", timeout=300)
    config = report["config"]
    whole = report["model"]["param_bytes"]
    assert whole == 4 * report["model"]["params"]
    assert [r["pipeline"] for r in report["varuna"]] == list(config["pipelines"]) == [1, 2, 4]
    for run in report["varuna"]:
        P, ranks = run["pipeline"], run["ranks"]
        assert [r["rank"] for r in ranks] == list(range(P)) and [r["stage"] for r in ranks] == list(range(P))
        assert sum(r["stage_param_bytes"] for r in ranks) == whole  # untied: each tensor on one stage
        layers = [i for r in ranks for i in r["layers"]]
        assert layers == list(range(report["model"]["config"]["num_hidden_layers"]))
        for r in ranks:
            assert r["peak_bytes"] >= r["baseline_bytes"] > 0
            assert r["growth_bytes"] == r["peak_bytes"] - r["baseline_bytes"]
            assert r["estimate"]["params"] == r["stage_param_bytes"]
            assert r["estimate"]["total"] >= r["estimate"]["params"] + r["estimate"]["grads"]
            assert isinstance(r["estimate_error_pct"], float)
            if P == 4:  # no rank held the whole model's parameters while its stage was made and loaded
                assert r["built_growth_bytes"] < whole
        losses = {tuple(r["losses"]) for r in ranks}
        assert len(losses) == 1 and len(next(iter(losses))) == config["steps"]
    growth = {run["pipeline"]: max(r["growth_bytes"] for r in run["ranks"]) for run in report["varuna"]}
    assert growth[4] < growth[2] < growth[1]
    assert growth[1] - growth[4] > whole  # P = 1 holds every parameter and its gradient
    first_loss = report["varuna"][0]["ranks"][0]["losses"][0]
    for run in report["torch_pipelining"]:
        assert "not_measured" not in run, run.get("not_measured")
        P, ranks = run["pipeline"], run["ranks"]
        varuna = next(v for v in report["varuna"] if v["pipeline"] == P)["ranks"]
        assert [r["layers"] for r in ranks] == [r["layers"] for r in varuna]
        assert [r["stage_param_bytes"] for r in ranks] == [r["stage_param_bytes"] for r in varuna]
        assert all(r["peak_bytes"] >= r["baseline_bytes"] > 0 for r in ranks)
        assert ranks[-1]["losses"][0] == pytest.approx(first_loss, rel=1e-4)  # the same model and batch

    largest = report["largest_model"]
    rows = largest["per_pipeline"]
    assert [r["pipeline"] for r in rows] == [1, 2, 4]
    layers = [r["layers"] for r in rows]
    assert 0 < layers[0] < layers[1] < layers[2], layers
    for r in rows:
        assert r["baseline_bytes"] + r["margin_bytes"] + max(r["rank_bytes"]) <= largest["limit_bytes"]
        assert r["next_layer_needs_bytes"] > largest["limit_bytes"]
    verified = {r["pipeline"]: r["verified"] for r in rows if r["verified"] is not None}
    assert set(verified) == set(config["verify_pipelines"]) == {2}
    for P, v in verified.items():
        assert v["finished"], v.get("refused") or v.get("log_tail")
        assert v["refused"] is None and len(v["ranks"]) == P
        assert v["engine_matches_search"]
        assert v["check_within_limit"]
    assert "largest model under 1GiB per rank" in stderr
