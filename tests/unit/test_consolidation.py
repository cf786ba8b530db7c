"""`varuna.consolidate` in one process: the errors of bad paths and sizes, and Hugging Face's sharded
layout written from a real one-rank checkpoint (a tiny GPT, and a tiny transformers GPT-2 with tied
embeddings); the 2x2 checkpoints and the peak memory are in tests/multirank/test_consolidation_jobs.py.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from _helpers import SCRIPTS, make_gpt_engine
from safetensors import safe_open
from safetensors.torch import load_file

import varuna
from varuna import cli
from varuna.checkpoint import consolidation
from varuna.checkpoint import layout as ckpt
from varuna.errors import CheckpointError, ConfigError

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A one-rank checkpoint of a tiny GPT after one step, and the plain model's state dict."""
    engine, data = make_gpt_engine(tmp_path_factory.mktemp("gpt"))
    engine.step(engine.batch(data, 0))
    path = engine.checkpoint()
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    engine.close()
    return path, state


def _shards(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {f.name: load_file(f) for f in sorted(folder.glob("*.safetensors"))}


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


def test_a_missing_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"checkpoint .*nowhere does not exist; give a step directory"):
        varuna.consolidate(tmp_path / "nowhere", tmp_path / "x.safetensors")


def test_a_directory_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(
        CheckpointError, match=r"holds no checkpoint \(no manifest.json, latest or checkpoints/latest\)"
    ):
        varuna.consolidate(tmp_path, tmp_path / "x.safetensors")


def test_out_must_be_a_file_name_or_a_folder(tmp_path: Path) -> None:
    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / "manifest.json").write_text("{}")
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(
        CheckpointError,
        match=r"dir.safetensors is a directory, and a name ending in .safetensors is the one file",
    ):
        varuna.consolidate(step, tmp_path / "dir.safetensors")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(
        CheckpointError, match=r"notes.txt is a file; give a folder for Hugging Face's sharded"
    ):
        varuna.consolidate(step, tmp_path / "notes.txt")


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("5XB", r"must be a positive number of bytes or a size, e\.g\. 5GB.*; got '5XB'"),
        (0, r"must be a positive number of bytes or a size, .*; got 0"),
        ("-1GB", r"must be a positive number of bytes or a size, .*; got '-1GB'"),
        (1.5e9, r"takes a number of bytes or a size, e\.g\. 5GB, 200MB or 10MiB .*; got a float"),
    ],
)
def test_a_bad_max_shard_size_says_what_to_give(tmp_path: Path, size: object, message: str) -> None:
    with pytest.raises(ConfigError, match=r"max_shard_size \(--max-shard-size\) " + message):
        varuna.consolidate(tmp_path / "nowhere", tmp_path / "out", max_shard_size=size)  # type: ignore[arg-type]


def test_sizes_read_as_hugging_face_writes_them() -> None:
    assert consolidation.shard_limit("5GB") == 5 * 10**9
    assert consolidation.shard_limit("200MB") == 200 * 10**6
    assert consolidation.shard_limit("10MiB") == 10 * 2**20
    assert consolidation.shard_limit(12345) == 12345


def test_shards_keep_tied_names_together_and_give_a_large_tensor_its_own() -> None:
    f32 = torch.float32
    stored = {
        "model.a": ((10,), f32),
        "model.big": ((100,), f32),
        "model.b": ((10,), f32),
        "model.c": ((5,), f32),
    }
    sources = {"a": "model.a", "big": "model.big", "b": "model.b", "tied": "model.b", "c": "model.c"}
    assert consolidation.plan_shards(sources, stored, 100) == [["big"], ["a"], ["b", "tied", "c"]]
    assert consolidation.plan_shards(sources, stored, 10**6) == [["a", "big", "b", "tied", "c"]]
    assert consolidation.plan_shards({}, stored, 100) == [[]]


def test_a_folder_gets_hugging_faces_sharded_layout(
    gpt: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, state = gpt
    limit = 20_000
    with caplog.at_level(logging.INFO, logger="varuna.consolidate"):
        out = varuna.consolidate(path, tmp_path / "hf", max_shard_size=limit)
    shards = _shards(out)
    count = len(shards)
    assert count >= 3
    assert sorted(p.name for p in out.iterdir()) == sorted([*shards, INDEX])
    assert list(shards) == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    for name, tensors in shards.items():
        assert _nbytes(tensors) <= limit or len(tensors) == 1, name
        with safe_open(str(out / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt", "varuna_step": "1"}
    index = json.loads((out / INDEX).read_text())
    assert index["metadata"] == {"total_size": sum(_nbytes(t) for t in shards.values()), "varuna_step": "1"}
    assert index["weight_map"] == {k: name for name, tensors in shards.items() for k in tensors}
    assert sorted(index["weight_map"]) == sorted(state)
    merged = {k: v for tensors in shards.values() for k, v in tensors.items()}
    assert all(torch.equal(merged[k], state[k]) for k in state)
    assert f"model-00001-of-{count:05d}.safetensors (" in caplog.text


def test_a_tensor_larger_than_the_limit_gets_a_shard_of_its_own(
    gpt: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, state = gpt
    limit = 10_000  # below the attention and MLP weights, above every bias and norm
    large = {k for k, v in state.items() if v.nbytes > limit}
    assert large
    shards = _shards(varuna.consolidate(path, tmp_path / "hf", max_shard_size=limit))
    for tensors in shards.values():
        assert len(tensors) == 1 or (not set(tensors) & large and _nbytes(tensors) <= limit)
    assert sum(len(t) for t in shards.values()) == len(state)


def test_everything_in_one_shard_is_model_safetensors_without_an_index(
    gpt: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, state = gpt
    out = varuna.consolidate(path, tmp_path / "hf")
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    got = load_file(out / "model.safetensors")
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


def test_a_folder_is_rewritten_and_leftover_shards_removed(
    gpt: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, _ = gpt
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / ".model-00002-of-00009.safetensors.999.tmp").write_bytes(b"half")  # of a killed run
    varuna.consolidate(path, out, max_shard_size=10_000)
    many = len(_shards(out))
    varuna.consolidate(path, out, max_shard_size=40_000)
    few = _shards(out)
    assert 1 < len(few) < many
    assert sorted(p.name for p in out.iterdir()) == sorted([*few, INDEX, "tokenizer.json"])
    varuna.consolidate(path, out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "tokenizer.json"]
    varuna.consolidate(path, out, max_shard_size=40_000)
    assert sorted(p.name for p in out.iterdir()) == sorted([*few, INDEX, "tokenizer.json"])


def test_a_failure_leaves_no_index_and_no_half_written_file(
    gpt: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = gpt
    out = varuna.consolidate(path, tmp_path / "hf", max_shard_size=20_000)
    count = len(_shards(out))
    read = consolidation._read
    calls: list[int] = []

    def fail_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise CheckpointError("checkpoint file __0_0.distcp is corrupted")
        return read(*args, **kwargs)

    monkeypatch.setattr(consolidation, "_read", fail_third)
    with pytest.raises(CheckpointError, match="is corrupted"):
        varuna.consolidate(path, out, max_shard_size=20_000)
    names = sorted(p.name for p in out.iterdir())
    assert INDEX not in names and not [n for n in names if n.startswith(".")]
    assert len(names) == count and all(load_file(out / n) for n in names)  # each whole, old or new


def test_one_file_holds_every_tensor(gpt: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    path, state = gpt
    out = varuna.consolidate(path, tmp_path / "gpt.safetensors", max_shard_size=10_000)  # read in parts
    got = load_file(out)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    assert [p.name for p in tmp_path.iterdir()] == ["gpt.safetensors"]


def test_cli_writes_a_folder_and_says_what(
    gpt: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, state = gpt
    out = tmp_path / "hf"
    assert cli.main(["consolidate", str(path), str(out), "--max-shard-size", "50KB"]) == 0
    shards = _shards(out)
    nbytes = sum((out / name).stat().st_size for name in shards)
    line = f"varuna: wrote {out} ({len(shards)} safetensors files, {len(state)} tensors, {nbytes} bytes) from {path}\n"
    assert len(shards) > 1 and capsys.readouterr().out == line


def test_cli_prints_one_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["consolidate", str(tmp_path / "nowhere"), str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("varuna: error: checkpoint ") and "does not exist" in err and err.count("\n") == 1
    assert (
        cli.main(["consolidate", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "5 parsecs"]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("varuna: error: max_shard_size (--max-shard-size) must be a positive number")
    assert "got '5 parsecs'" in err and err.count("\n") == 1


def test_config_needs_a_folder_and_a_config(
    gpt: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, _ = gpt
    with pytest.raises(ConfigError, match=r"config= takes a transformers PretrainedConfig .*got a dict"):
        varuna.consolidate(path, tmp_path / "hf", config={"n_layer": 4})
    with pytest.raises(
        ConfigError, match=r"config= writes config.json beside the weights; give a folder as out"
    ):
        varuna.consolidate(path, tmp_path / "x.safetensors", config=_Config())
    assert not list(tmp_path.iterdir())


class _Config:
    def to_json_file(self, path: Path) -> None:
        Path(path).write_text('{"model_type": "gpt2"}')


def test_a_transformers_model_loads_with_from_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(SCRIPTS))
    from hf_common import MICRO_BATCH, Data, build, optimizer

    from varuna import Varuna, auto_cut
    from varuna.data import collate

    model = build("gpt2")
    auto_cut(model)
    data = Data("gpt2")
    engine = Varuna(
        model,
        global_batch_size=4,
        micro_batch_size=MICRO_BATCH,
        run_dir=tmp_path / "run",
        example_batch=collate([data[i] for i in range(MICRO_BATCH)]),
    )
    engine.set_optimizer(optimizer(engine.parameters()))
    engine.step(engine.batch(data, 0))
    path = engine.checkpoint()
    trained = {n: p.detach().clone() for n, p in engine.named_parameters()}
    engine.close()
    out = varuna.consolidate(path, tmp_path / "gpt2", model=build("gpt2"), max_shard_size=30_000)
    index = json.loads((out / INDEX).read_text())
    assert (out / "config.json").exists() and len(set(index["weight_map"].values())) >= 3
    assert index["weight_map"]["lm_head.weight"] == index["weight_map"]["transformer.wte.weight"]
    again = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(again) is type(model)
    for name, p in again.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name
    assert again.lm_head.weight is again.transformer.wte.weight  # tied again
    assert ckpt.read_extra(path)["step"] == 1
