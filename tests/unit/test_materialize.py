"""Models built on the meta device, in one process (world size 1): materialisation, the seeded
init, weights=, and the memory check before anything is allocated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import varuna
from varuna import Varuna
from varuna.data import SyntheticLM, collate
from varuna.engine.materialize import init_weights, is_meta, module_seed
from varuna.errors import CheckpointError, ConfigError, MemoryLimitError
from varuna.models import GPT, BertMLM, bert_tiny, gpt_tiny


def _meta_gpt(**kw: object) -> GPT:
    with torch.device("meta"):
        return GPT(gpt_tiny(**kw) if kw else gpt_tiny())


def _engine(model: nn.Module, **kw: object) -> Varuna:
    cfg = gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 8)
    return Varuna(
        model,
        global_batch_size=4,
        micro_batch_size=2,
        example_batch=collate([data[i] for i in range(2)]),
        **kw,
    )


def test_module_seed_depends_on_the_name_and_seed_only() -> None:
    assert module_seed(0, "blocks.3.attn") == module_seed(0, "blocks.3.attn")
    assert len({module_seed(0, "a"), module_seed(1, "a"), module_seed(0, "b")}) == 3


def test_meta_model_trains_from_the_same_weights_as_init_weights_gives_a_plain_model() -> None:
    engine = _engine(_meta_gpt())
    held = {n: p.detach().clone() for n, p in engine.named_parameters()}
    plain = init_weights(_meta_gpt(), seed=0)
    assert not is_meta(plain) and not is_meta(engine.model)
    assert held.keys() == dict(plain.named_parameters()).keys()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(held[name], p.detach(), rtol=0, atol=0, msg=name)
    assert plain.wte.weight.std().item() == pytest.approx(0.02, rel=0.2)  # the model's own _init_weights
    other = init_weights(_meta_gpt(), seed=1)
    assert not torch.equal(other.wte.weight, plain.wte.weight)


def test_a_tied_weight_stays_one_tensor_and_is_initialised_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x)).sum()

    with torch.device("meta"):
        model = Tied()
    init_weights(model, seed=3)
    assert model.head.weight is model.emb.weight and not model.emb.weight.is_meta
    with torch.device("meta"):
        again = Tied()
    again.emb.reset_parameters = lambda: None  # type: ignore[method-assign]  # only head could write it now
    with pytest.raises(
        ConfigError, match=r"1 tensors of this stage were not written by init_weights: emb.weight"
    ):
        init_weights(again, seed=3)


def test_init_callable_writes_every_module() -> None:
    seen: list[str] = []

    def init(name: str, module: nn.Module) -> None:
        seen.append(name)
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.5)

    engine = _engine(_meta_gpt(), init=init)
    assert "blocks.0.attn.qkv" in seen and "wte" in seen
    assert all(bool((p == 0.5).all()) for p in engine.parameters())


class _NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).sum()


class _Rotary(nn.Module):
    """A non-persistent buffer computed in the constructor, which its reset_parameters forgets."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2) / 4)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(x) * self.inv_freq.repeat(2)).sum()


def test_a_meta_model_whose_modules_have_no_init_is_refused_before_anything_is_allocated() -> None:
    with torch.device("meta"):
        model = _NoInit()
    with pytest.raises(
        ConfigError,
        match=r"without weights=, and 1 modules holding parameters have no init: "
        r"_NoInit \(_NoInit\)\. Give weights=PATH .* init=fn\(module_name, module\)",
    ):
        Varuna(model, global_batch_size=2, micro_batch_size=1)


def test_a_nonpersistent_buffer_nothing_recomputes_is_named() -> None:
    with torch.device("meta"):
        model = _Rotary()
    with pytest.raises(ConfigError, match=r"not written by the modules' own init: inv_freq \(2,\)"):
        Varuna(model, global_batch_size=2, micro_batch_size=1)

    def init(name: str, module: nn.Module) -> None:
        if isinstance(module, _Rotary):
            module.inv_freq.copy_(1.0 / (10000 ** (torch.arange(0, 4, 2) / 4)))
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    with torch.device("meta"):
        model = _Rotary()
    Varuna(model, global_batch_size=2, micro_batch_size=1, init=init)
    torch.testing.assert_close(model.inv_freq, torch.tensor([1.0, 0.01]))


def test_weights_file_loads_the_stage_and_names_what_does_not_fit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = GPT(gpt_tiny())
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    save_file(state, str(tmp_path / "gpt.safetensors"))
    engine = _engine(_meta_gpt(), weights=tmp_path / "gpt.safetensors")
    for name, p in engine.named_parameters():
        torch.testing.assert_close(p.detach(), state[name], rtol=0, atol=0)

    missing = {k: v for k, v in state.items() if k != "ln_f.bias"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing from the weights \(1\).*ln_f\.bias"):
        _engine(_meta_gpt(), weights=tmp_path / "missing.safetensors")

    wrong = dict(state, **{"ln_f.bias": torch.zeros(3)})
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(CheckpointError, match=r"shape differs \(1\).*ln_f\.bias"):
        _engine(_meta_gpt(), weights=tmp_path / "wrong.safetensors")

    with pytest.raises(CheckpointError, match=r"does not exist"):
        _engine(_meta_gpt(), weights=tmp_path / "nowhere")


def test_a_missing_shard_is_named_before_training(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=8)
    folder = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50, (2, 8))
    with pytest.raises(CheckpointError, match=rf"{shards[-1].name}"):
        Varuna(
            model,
            global_batch_size=2,
            micro_batch_size=2,
            example_batch={"input_ids": ids, "labels": ids},
            weights=folder,
        )


def test_the_memory_check_refuses_a_stage_over_the_limit_before_allocating() -> None:
    engine = _engine(_meta_gpt(), optimizer_state="adam")
    est = engine.memory_estimate
    real = sum(p.numel() * p.element_size() for p in engine.parameters())
    assert est.params == real and est.grads == real and est.optimizer == 2 * real
    assert est.activations > 0 and est.transient == max(p.numel() * 4 for p in engine.parameters())
    assert est.total == est.params + est.grads + est.optimizer + est.activations + est.transient + est.working
    sgd = _engine(_meta_gpt(), optimizer_state="none").memory_estimate
    assert sgd.optimizer == 0 and sgd.total == est.total - est.optimizer
    model = _meta_gpt()
    with pytest.raises(
        MemoryLimitError,
        match=r"rank 0 \(stage 0, replica 0\) would need about .* but has 1\.0 MiB \(memory_limit='1MiB'\): its "
        r"stage holds .* of parameters, .* Nothing was allocated; try more pipeline stages \(pipeline=1 now",
    ):
        _engine(model, memory_limit="1MiB")
    assert is_meta(model)  # refused before any of it became real


def test_our_own_models_build_on_meta_and_match_their_plain_init() -> None:
    with torch.device("meta"):
        model = BertMLM(bert_tiny())
    varuna.init_weights(model, seed=5)
    assert torch.equal(model.decoder_bias, torch.zeros_like(model.decoder_bias))
    with torch.device("meta"):
        again = BertMLM(bert_tiny())
    varuna.init_weights(again, seed=5)
    for (name, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name


def test_a_meta_model_resumes_from_a_checkpoint(tmp_path: Path) -> None:
    engine = _engine(_meta_gpt(), run_dir=tmp_path / "run")
    engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
    cfg = gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 8)
    engine.step(engine.batch(data, 0))
    engine.checkpoint()
    trained = {n: p.detach().clone() for n, p in engine.named_parameters()}
    engine.close()
    again = _engine(_meta_gpt(), run_dir=tmp_path / "run", resume="latest")
    assert again.step_count == 1
    for name, p in again.named_parameters():
        torch.testing.assert_close(p.detach(), trained[name], rtol=0, atol=0, msg=name)


class _Routed(nn.Module):
    """A forward whose shapes depend on values (as a mixture of experts' routing): no meta kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.cut = varuna.CutPoint()
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.cut(self.a(x))
        return self.b(h[h.sum(-1) > 0]).sum()


def test_a_forward_the_meta_device_cannot_run_is_checked_without_its_activations(caplog) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    engine = Varuna(_Routed(), global_batch_size=4, micro_batch_size=2, example_batch={"x": x})
    est = engine.memory_estimate
    assert est.activations == 0 and est.params == sum(p.numel() * 4 for p in engine.parameters())
    assert est.note is not None and est.note.startswith(
        "activations not counted: the forward does not run on the meta"
    )
    assert "memory check of rank 0 (stage 0, replica 0): activations not counted" in caplog.text
    with pytest.raises(
        MemoryLimitError, match=r"\(activations not counted: the forward does not run on the meta"
    ):
        Varuna(
            _Routed(), global_batch_size=4, micro_batch_size=2, example_batch={"x": x}, memory_limit="1KiB"
        )
