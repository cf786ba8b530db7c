"""Pretrained weights per stage from safetensors: headers only at open, the whole model checked once, and
each stage's tensors read from the shards that hold them.

A small module with a tied head, BatchNorm buffers and a non-persistent buffer covers the rules on single
files; a tiny GPT-2 saved by transformers' `save_pretrained` in several shards (when transformers is
installed) covers the real folder layout, its index and its tied `lm_head.weight`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from varuna.checkpoint import weights
from varuna.checkpoint.weights import WeightsSource, load_stage, match_keys
from varuna.errors import CheckpointError


class Tiny(nn.Module):
    """An embedding tied to the head, a linear layer, BatchNorm buffers and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


class Wrapper(nn.Module):
    """A model that wraps another one as `model`, as a loss wrapper does: its keys are `model.<key>`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def shapes_of(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def aliases_of(module: nn.Module) -> dict[str, list[str]]:
    """Canonical name -> every name of each parameter registered under several names."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {group[0]: group for group in names.values() if len(group) > 1}


def file_state(module: nn.Module, drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The state dict as save_pretrained writes it: tied tensors once, each a tensor of its own."""
    seen: set[int] = set()
    state: dict[str, torch.Tensor] = {}
    for key, value in module.state_dict().items():
        if value.data_ptr() in seen or key in drop:
            continue
        seen.add(value.data_ptr())
        state[key] = value.detach().clone()
    return state


def empty_like_state(
    module: nn.Module, keys: list[str], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    state = module.state_dict()
    return {k: torch.full_like(state[k], 7, dtype=dtype or state[k].dtype) for k in keys}


@pytest.fixture()
def tiny() -> Tiny:
    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        model.norm.running_mean.normal_()
        model.norm.num_batches_tracked.fill_(5)
    return model


@pytest.fixture()
def tiny_file(tmp_path: Path, tiny: Tiny) -> Path:
    path = tmp_path / "tiny.safetensors"
    save_file(file_state(tiny), str(path))
    return path


# -- single files -------------------------------------------------------------------------------------


def test_open_reads_keys_shapes_and_dtypes_from_the_header(tiny_file: Path) -> None:
    source = WeightsSource.open(tiny_file)
    assert source.keys == (
        "body.bias",
        "body.weight",
        "emb.weight",
        "norm.bias",
        "norm.num_batches_tracked",
        "norm.running_mean",
        "norm.running_var",
        "norm.weight",
    )
    assert source.shape("emb.weight") == (10, 4) and source.dtype("emb.weight") == torch.float32
    assert (
        source.shape("norm.num_batches_tracked") == ()
        and source.dtype("norm.num_batches_tracked") == torch.int64
    )
    assert source.files == (tiny_file,) and source.file("body.bias") == tiny_file
    assert "body.bias" in source and len(source) == 8
    assert repr(source).endswith("8 tensors in 1 files)")


def test_a_key_the_source_lacks_is_named(tiny_file: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"hold no tensor 'nope' \(8 tensors, e\.g\. body\.bias.*source\.keys"
    ):
        WeightsSource.open(tiny_file).shape("nope")


def test_match_keys_maps_every_key_and_a_tied_name_to_the_one_stored(tiny_file: Path, tiny: Tiny) -> None:
    mapping = match_keys(WeightsSource.open(tiny_file), shapes_of(tiny), aliases_of(tiny))
    assert set(mapping) == set(tiny.state_dict())
    assert "scratch" not in mapping  # non-persistent: not in the state dict, never missing
    assert mapping["head.weight"] == "emb.weight" and mapping["emb.weight"] == "emb.weight"
    assert mapping["norm.running_mean"] == "norm.running_mean"


def test_a_tied_group_is_satisfied_by_any_of_its_names(tmp_path: Path, tiny: Tiny) -> None:
    path = tmp_path / "head.safetensors"
    save_file(file_state(tiny, drop=("emb.weight",)), str(path))  # the head's name only
    mapping = match_keys(WeightsSource.open(path), shapes_of(tiny), aliases_of(tiny))
    assert mapping["emb.weight"] == "head.weight" and mapping["head.weight"] == "head.weight"


def test_both_tied_names_in_the_file_read_the_canonical_one(tmp_path: Path, tiny: Tiny) -> None:
    state = file_state(tiny)
    state["head.weight"] = state["emb.weight"].clone()
    path = tmp_path / "both.safetensors"
    save_file(state, str(path))
    mapping = match_keys(WeightsSource.open(path), shapes_of(tiny), aliases_of(tiny))
    assert mapping["emb.weight"] == "emb.weight" and mapping["head.weight"] == "emb.weight"


def test_load_stage_fills_the_stage_tensors_only(tiny_file: Path, tiny: Tiny) -> None:
    source = WeightsSource.open(tiny_file)
    mapping = match_keys(source, shapes_of(tiny), aliases_of(tiny))
    stage = empty_like_state(tiny, ["body.weight", "head.weight", "norm.num_batches_tracked"])
    load_stage(source, mapping, stage)
    for key, value in stage.items():
        torch.testing.assert_close(value, tiny.state_dict()[key], rtol=0, atol=0)


def test_load_stage_copies_into_parameters_that_require_grad(tiny_file: Path, tiny: Tiny) -> None:
    source = WeightsSource.open(tiny_file)
    mapping = match_keys(source, shapes_of(tiny), aliases_of(tiny))
    fresh = Tiny()
    load_stage(source, mapping, dict(fresh.state_dict(keep_vars=True)))
    assert fresh.body.weight.requires_grad
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, tiny.state_dict()[key], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("stored", "loaded"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
)
def test_dtypes_are_cast_to_the_destination(
    tmp_path: Path, tiny: Tiny, stored: torch.dtype, loaded: torch.dtype
) -> None:
    state = {k: v.to(stored) if v.is_floating_point() else v for k, v in file_state(tiny).items()}
    path = tmp_path / "cast.safetensors"
    save_file(state, str(path))
    source = WeightsSource.open(path)
    assert source.dtype("body.weight") == stored
    stage = empty_like_state(tiny, ["body.weight", "norm.num_batches_tracked"], dtype=None)
    stage["body.weight"] = stage["body.weight"].to(loaded)
    load_stage(source, match_keys(source, shapes_of(tiny), aliases_of(tiny)), stage)
    assert stage["body.weight"].dtype == loaded
    torch.testing.assert_close(stage["body.weight"], state["body.weight"].to(loaded), rtol=0, atol=0)


def test_a_folder_with_one_model_safetensors(tmp_path: Path, tiny: Tiny) -> None:
    save_file(file_state(tiny), str(tmp_path / "model.safetensors"))
    source = WeightsSource.open(tmp_path)
    assert source.files == (tmp_path / "model.safetensors",)
    assert set(match_keys(source, shapes_of(tiny), aliases_of(tiny))) == set(tiny.state_dict())


def test_a_folder_with_both_reads_model_safetensors_as_transformers_does(tmp_path: Path, tiny: Tiny) -> None:
    save_file(file_state(tiny), str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "gone.safetensors"}})
    )
    assert WeightsSource.open(tmp_path).files == (tmp_path / "model.safetensors",)


# -- prefixes -------------------------------------------------------------------------------------------


def test_a_wrapper_model_loads_its_inner_models_file(tiny_file: Path, tiny: Tiny) -> None:
    wrapped = Wrapper(tiny)
    source = WeightsSource.open(tiny_file)
    mapping = match_keys(source, shapes_of(wrapped), aliases_of(wrapped))
    assert mapping["model.body.weight"] == "body.weight" and mapping["model.head.weight"] == "emb.weight"
    stage = empty_like_state(wrapped, ["model.head.weight"])
    load_stage(source, mapping, stage)
    torch.testing.assert_close(stage["model.head.weight"], tiny.emb.weight, rtol=0, atol=0)


def test_a_wrapper_models_file_loads_into_the_inner_model(tmp_path: Path, tiny: Tiny) -> None:
    path = tmp_path / "wrapped.safetensors"
    save_file(file_state(Wrapper(tiny)), str(path))
    source = WeightsSource.open(path)
    mapping = match_keys(source, shapes_of(tiny), aliases_of(tiny))
    assert mapping["body.weight"] == "model.body.weight" and mapping["head.weight"] == "model.emb.weight"


def test_several_fitting_prefixes_are_an_error_not_a_guess(tmp_path: Path) -> None:
    path = tmp_path / "layer.safetensors"
    save_file({"a.weight": torch.ones(2), "b.weight": torch.ones(3)}, str(path))
    model = {"enc.a.weight": (2,), "enc.b.weight": (3,), "dec.a.weight": (2,), "dec.b.weight": (3,)}
    with pytest.raises(
        CheckpointError,
        match=r"cannot tell which prefix .*: 2 do \(prefix 'enc\.' added to the file's keys; prefix 'dec\.' "
        r"added.*file keys \(2\): a\.weight, b\.weight; model keys \(4\).*load the weights into the submodule",
    ):
        match_keys(WeightsSource.open(path), model)


def test_no_fitting_prefix_shows_both_key_sets_and_how_far_each_candidate_got(tmp_path: Path) -> None:
    path = tmp_path / "other.safetensors"
    save_file({"a.weight": torch.ones(2), "zz.weight": torch.ones(3)}, str(path))
    model = {"model.a.weight": (2,), "model.b.weight": (3,)}
    with pytest.raises(
        CheckpointError,
        match=r"not the model's under any one prefix.*with prefix 'model\.' added to the file's keys, 1 match "
        r"\(not: zz\.weight\).*file keys \(2\): a\.weight, zz\.weight; model keys \(2\): model\.a\.weight",
    ):
        match_keys(WeightsSource.open(path), model)


def test_no_candidate_at_all_says_so(tmp_path: Path) -> None:
    path = tmp_path / "other.safetensors"
    save_file({"q.weight": torch.ones(2)}, str(path))
    with pytest.raises(CheckpointError, match=r"no prefix makes the first file key 'q\.weight' a model key"):
        match_keys(WeightsSource.open(path), {"p.weight": (2,)})


# -- mismatches ---------------------------------------------------------------------------------------


def test_a_missing_key_is_reported_with_its_shape(tmp_path: Path, tiny: Tiny) -> None:
    path = tmp_path / "short.safetensors"
    save_file(file_state(tiny, drop=("body.bias",)), str(path))
    with pytest.raises(
        CheckpointError,
        match=r"do not match the model \(no prefix.*\n  missing from the weights \(1\): body\.bias \(4,\)\n",
    ):
        match_keys(WeightsSource.open(path), shapes_of(tiny), aliases_of(tiny))


def test_a_tied_group_absent_from_the_file_is_one_missing_entry(tmp_path: Path, tiny: Tiny) -> None:
    path = tmp_path / "headless.safetensors"
    save_file(file_state(tiny, drop=("emb.weight", "head.weight")), str(path))
    with pytest.raises(
        CheckpointError,
        match=r"missing from the weights \(1\): emb\.weight \(10, 4\) \(tied: head\.weight\)\n",
    ):
        match_keys(WeightsSource.open(path), shapes_of(tiny), aliases_of(tiny))


def test_unexpected_and_misshaped_keys_are_reported_together(tmp_path: Path, tiny: Tiny) -> None:
    state = file_state(tiny, drop=("body.bias",))
    state["extra.weight"] = torch.ones(2, 2)
    state["norm.weight"] = torch.ones(5)
    path = tmp_path / "off.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError) as caught:
        match_keys(WeightsSource.open(path), shapes_of(tiny), aliases_of(tiny))
    lines = str(caught.value).splitlines()
    assert lines[1:4] == [
        "  missing from the weights (1): body.bias (4,)",
        "  not in the model (1): extra.weight (2, 2)",
        "  shape differs (1): norm.weight model (4,) vs file (5,)",
    ]
    assert lines[4].startswith("fix: give weights saved from this model's architecture and config")
    assert lines[4].endswith("rename the file's keys to the model's state_dict keys")


def test_an_unexpected_key_alone(tmp_path: Path, tiny: Tiny) -> None:
    state = file_state(tiny)
    state["extra.weight"] = torch.ones(2, 2)
    path = tmp_path / "extra.safetensors"
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=r"\n  not in the model \(1\): extra\.weight \(2, 2\)\nfix: "):
        match_keys(WeightsSource.open(path), shapes_of(tiny), aliases_of(tiny))


def test_a_shape_mismatch_alone(tmp_path: Path, tiny: Tiny) -> None:
    path = tmp_path / "tiny.safetensors"
    save_file(file_state(tiny), str(path))
    model = shapes_of(tiny) | {"emb.weight": (12, 4), "head.weight": (12, 4)}
    with pytest.raises(
        CheckpointError,
        match=r"\n  shape differs \(1\): emb\.weight model \(12, 4\) vs file \(10, 4\)\nfix: .*vocabulary",
    ):
        match_keys(WeightsSource.open(path), model, aliases_of(tiny))


def test_long_lists_are_cut_with_a_count(tmp_path: Path) -> None:
    path = tmp_path / "one.safetensors"
    save_file({"k0": torch.ones(1)}, str(path))
    model = {f"k{i}": (1,) for i in range(8)}
    with pytest.raises(
        CheckpointError, match=r"missing from the weights \(7\): k1 \(1,\), .*k5 \(1,\) \(and 2 more\)"
    ):
        match_keys(WeightsSource.open(path), model)


def test_aliases_must_name_model_keys_of_one_shape(tiny_file: Path, tiny: Tiny) -> None:
    source = WeightsSource.open(tiny_file)
    with pytest.raises(
        CheckpointError, match=r"aliases of emb\.weight name lm_head\.weight, which model_shapes lacks"
    ):
        match_keys(source, shapes_of(tiny), {"emb.weight": ["emb.weight", "lm_head.weight"]})
    with pytest.raises(
        CheckpointError, match=r"name one tensor but model_shapes gives them shapes \(4,\), \(10, 4\)"
    ):
        match_keys(source, shapes_of(tiny), {"emb.weight": ["body.bias"]})
    with pytest.raises(CheckpointError, match=r"aliases put head\.weight in two groups"):
        match_keys(source, shapes_of(tiny), {"emb.weight": ["head.weight"], "head.weight": ["head.weight"]})


# -- load_stage's own checks ------------------------------------------------------------------------


def test_load_stage_refuses_keys_outside_the_mapping_wrong_shapes_and_meta(
    tiny_file: Path, tiny: Tiny
) -> None:
    source = WeightsSource.open(tiny_file)
    mapping = match_keys(source, shapes_of(tiny), aliases_of(tiny))
    with pytest.raises(
        CheckpointError, match=r"other\.weight has no entry in the mapping \(9 keys.*build it with match_keys"
    ):
        load_stage(source, mapping, {"other.weight": torch.empty(2)})
    with pytest.raises(
        CheckpointError,
        match=r"body\.weight: destination shape \(4, 5\) vs file body\.weight \(4, 4\); allocate",
    ):
        load_stage(source, mapping, {"body.weight": torch.empty(4, 5)})
    with pytest.raises(CheckpointError, match=r"body\.weight is on the meta device.*to_empty"):
        load_stage(source, mapping, {"body.weight": torch.empty(4, 4, device="meta")})


def test_a_file_damaged_after_open_is_named(tmp_path: Path, tiny: Tiny) -> None:
    path = tmp_path / "tiny.safetensors"
    save_file(file_state(tiny), str(path))
    source = WeightsSource.open(path)
    mapping = match_keys(source, shapes_of(tiny), aliases_of(tiny))
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(
        CheckpointError, match=r"cannot read .*tiny\.safetensors: .*copy or download it again"
    ):
        load_stage(source, mapping, empty_like_state(tiny, ["body.weight"]))


# -- paths that are not weights -----------------------------------------------------------------------


def test_a_missing_path(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"nowhere does not exist; give a \.safetensors file, a folder with"
    ):
        WeightsSource.open(tmp_path / "nowhere")


def test_a_folder_with_neither_says_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        CheckpointError,
        match=r"holds neither model\.safetensors\.index\.json nor model\.safetensors \(it holds config\.json\)",
    ):
        WeightsSource.open(tmp_path)


def test_a_folder_with_other_safetensors_names_one(tmp_path: Path) -> None:
    save_file({"x": torch.ones(1)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"to read one file, give its path, e\.g\. .*adapter_model\.safetensors"
    ):
        WeightsSource.open(tmp_path)


def test_pickled_weights_are_refused_with_how_to_convert(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(
        CheckpointError, match=r"its weights are torch pickles, convert it once: save_pretrained"
    ):
        WeightsSource.open(tmp_path)
    with pytest.raises(
        CheckpointError, match=r"pytorch_model\.bin is a torch pickle \(\.bin\), which is not read here"
    ):
        WeightsSource.open(tmp_path / "pytorch_model.bin")


def test_an_empty_folder_and_another_file(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"\(it is empty\)"):
        WeightsSource.open(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match=r"notes\.txt is not a \.safetensors file; give"):
        WeightsSource.open(tmp_path / "notes.txt")


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x01\x00", r"its header length field \(1\) does not fit its 2 bytes"),
        ((1 << 40).to_bytes(8, "little") + b"{}", r"its header length field \(1099511627776\) does not fit"),
        ((4).to_bytes(8, "little") + b"\xff\xfe{}", r"its header is not JSON"),
        ((2).to_bytes(8, "little") + b"[]", r"its header is not a JSON object"),
        (
            (14).to_bytes(8, "little") + b'{"x": {"a":1}}',
            r"its entry 'x' lacks a dtype, shape or data_offsets",
        ),
    ],
)
def test_a_damaged_header_is_not_a_safetensors_file(tmp_path: Path, data: bytes, why: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    with pytest.raises(
        CheckpointError, match=rf"bad\.safetensors is not a safetensors file: {why}.*written by safetensors"
    ):
        WeightsSource.open(path)


def test_a_dtype_torch_cannot_hold_is_named(tmp_path: Path) -> None:
    header = json.dumps({"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    path = tmp_path / "fp4.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\x00")
    with pytest.raises(
        CheckpointError, match=r"tensor x is stored as F4, which is not read here \(expected one of BOOL"
    ):
        WeightsSource.open(path)


# -- a sharded folder ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[nn.Module, Path]]:
    """A tiny GPT-2 with tied embeddings, saved by save_pretrained in several shards with an index."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder, max_shard_size="20KB")
    yield model, folder


@pytest.fixture()
def gpt2_copy(gpt2: tuple[nn.Module, Path], tmp_path: Path) -> Path:
    """A copy of the saved folder, for the tests that damage it."""
    return Path(shutil.copytree(gpt2[1], tmp_path / "gpt2"))


def index_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def test_a_sharded_folder_maps_every_key_and_the_tied_head(gpt2: tuple[nn.Module, Path]) -> None:
    model, folder = gpt2
    source = WeightsSource.open(folder)
    index = index_of(folder)
    assert len(source.files) == len(set(index["weight_map"].values())) > 1
    assert set(source.keys) == set(index["weight_map"]) and "lm_head.weight" not in source
    mapping = match_keys(source, shapes_of(model), aliases_of(model))
    assert set(mapping) == set(model.state_dict())
    assert mapping["lm_head.weight"] == "transformer.wte.weight"
    assert all(source.file(mapping[k]).name == index["weight_map"][mapping[k]] for k in mapping)


def test_load_stage_fills_a_stage_from_shards_equal_to_the_model(gpt2: tuple[nn.Module, Path]) -> None:
    model, folder = gpt2
    source = WeightsSource.open(folder)
    mapping = match_keys(source, shapes_of(model), aliases_of(model))
    keys = [k for k in model.state_dict() if k.startswith(("transformer.h.1.", "transformer.ln_f."))]
    stage = {k: torch.empty(source.shape(mapping[k])) for k in [*keys, "lm_head.weight"]}
    load_stage(source, mapping, stage)
    for key, value in stage.items():
        torch.testing.assert_close(value, model.state_dict()[key], rtol=0, atol=0)


def test_a_wrapper_of_the_hf_model_loads_its_folder(gpt2: tuple[nn.Module, Path]) -> None:
    model, folder = gpt2
    wrapped = Wrapper(model)
    source = WeightsSource.open(folder)
    mapping = match_keys(source, shapes_of(wrapped), aliases_of(wrapped))
    assert set(mapping) == set(wrapped.state_dict())
    assert mapping["model.lm_head.weight"] == "transformer.wte.weight"
    stage = {"model.lm_head.weight": torch.empty(50, 16, dtype=torch.bfloat16)}
    load_stage(source, mapping, stage)
    torch.testing.assert_close(stage["model.lm_head.weight"], model.lm_head.weight.detach().bfloat16())


def test_a_wrappers_file_loads_into_the_hf_model(gpt2: tuple[nn.Module, Path], tmp_path: Path) -> None:
    model, _ = gpt2
    path = tmp_path / "wrapped.safetensors"
    save_file(file_state(Wrapper(model)), str(path))
    source = WeightsSource.open(path)
    mapping = match_keys(source, shapes_of(model), aliases_of(model))
    assert mapping["transformer.h.0.attn.c_attn.weight"] == "model.transformer.h.0.attn.c_attn.weight"
    assert mapping["lm_head.weight"] == "model.transformer.wte.weight"


class SpyOpen:
    """Records each file safe_open opens, and opens it."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.opened: list[str] = []

    def __call__(self, file: str, **kw: Any) -> Any:
        self.opened.append(Path(file).name)
        return self.real(file, **kw)


@pytest.fixture()
def spy(monkeypatch: pytest.MonkeyPatch) -> SpyOpen:
    spy = SpyOpen(weights.safe_open)
    monkeypatch.setattr(weights, "safe_open", spy)
    return spy


def test_load_stage_opens_only_the_shards_holding_wanted_keys_once(
    gpt2: tuple[nn.Module, Path], spy: SpyOpen
) -> None:
    model, folder = gpt2
    source = WeightsSource.open(folder)
    mapping = match_keys(source, shapes_of(model), aliases_of(model))
    assert spy.opened == []  # open and match_keys read headers only
    weight_map = index_of(folder)["weight_map"]
    shards = sorted(set(weight_map.values()))
    last = [k for k, shard in weight_map.items() if shard == shards[-1]]
    load_stage(source, mapping, {k: torch.empty(source.shape(k)) for k in last})
    assert spy.opened == [shards[-1]]
    spy.opened.clear()
    wanted = [*last, "transformer.wte.weight", "lm_head.weight"]
    load_stage(source, mapping, {k: torch.empty(source.shape(mapping[k])) for k in wanted})
    assert sorted(spy.opened) == sorted({weight_map["transformer.wte.weight"], shards[-1]})


def test_a_missing_shard_is_named_before_anything_is_read(gpt2_copy: Path) -> None:
    shards = sorted(set(index_of(gpt2_copy)["weight_map"].values()))
    (gpt2_copy / shards[0]).unlink()
    (gpt2_copy / shards[1]).write_bytes(b"damaged")  # never read: the missing shard is reported first
    with pytest.raises(
        CheckpointError,
        match=rf"index .*model\.safetensors\.index\.json names 1 shard file\(s\) that do not exist in .*: "
        rf"{shards[0]} \(of {len(shards)} shards\); copy or download the missing shards",
    ):
        WeightsSource.open(gpt2_copy)


def test_an_index_that_disagrees_with_its_shards(gpt2_copy: Path) -> None:
    index = index_of(gpt2_copy)
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["transformer.wte.weight"] = shards[-1]
    (gpt2_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError,
        match=rf"does not match its shards \(.*{shards[0]} holds 1 keys the index does not place there: "
        rf"transformer\.wte\.weight; the index places 1 keys in {shards[-1]}, which lacks them.*different saves",
    ):
        WeightsSource.open(gpt2_copy)


def test_an_index_without_a_weight_map(gpt2_copy: Path) -> None:
    (gpt2_copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match=r"has no weight_map of tensor key -> shard file name"):
        WeightsSource.open(gpt2_copy)
    (gpt2_copy / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"cannot read index .*save the checkpoint again"):
        WeightsSource.open(gpt2_copy)


def test_the_index_file_itself_is_a_source(gpt2: tuple[nn.Module, Path]) -> None:
    _, folder = gpt2
    assert WeightsSource.open(folder / "model.safetensors.index.json").keys == WeightsSource.open(folder).keys
