"""A NaN or Inf is never trained on silently (`varuna.engine.nonfinite`), in one process: the error
names the step and the module where it first appeared, forward or backward; "skip" skips the update
and counts it. Also: an LR scheduler that takes a metric gets the step's loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from varuna import Varuna
from varuna.data import SyntheticLM, collate
from varuna.engine.nonfinite import NonFiniteError
from varuna.models import GPT, gpt_tiny


class Poison(nn.Module):
    """Wraps a block; while `on`, its output is inf."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block, self.on = block, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out * float("inf") if self.on else out


class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        return g * float("nan")


class NanBackward(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(_NanGrad.apply(x))


def _setup(model: nn.Module, **kw: object) -> tuple[Varuna, SyntheticLM]:
    cfg = gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
    engine = Varuna(
        model, global_batch_size=4, micro_batch_size=2, example_batch=collate([data[0], data[1]]), **kw
    )
    engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    return engine, data


def test_a_nan_in_the_forward_names_its_step_and_module_and_nothing_is_updated() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    model.blocks[1] = Poison(model.blocks[1])
    engine, data = _setup(model)
    for k in range(2):
        engine.step(engine.batch(data, k))
    model.blocks[1].on = True
    before = {n: p.detach().clone() for n, p in engine.named_parameters()}
    with pytest.raises(
        NonFiniteError,
        match=r"^step 2: the loss is nan and the gradients hold NaN or Inf; it first appears in the forward of "
        r"stage 0 \(rank 0\), micro-batch 0, at module 'blocks\.1', whose inputs were finite\. Nothing was "
        r"updated\. Lower the learning rate, clip gradients",
    ):
        engine.step(engine.batch(data, 2))
    for n, p in engine.named_parameters():
        assert torch.equal(p, before[n]), n
    assert engine.step_count == 2 and model.training


def test_a_nan_only_in_the_backward_names_the_parameters() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    model.blocks[2] = NanBackward(model.blocks[2])
    engine, data = _setup(model)
    with pytest.raises(
        NonFiniteError,
        match=r"^step 0: the gradients hold NaN or Inf; the forward is finite, and the backward first gives "
        r"non-finite gradients on stage 0 \(rank 0\): wte\.weight, wpe\.weight, blocks\.0\.",
    ):
        engine.step(engine.batch(data, 0))


def test_skip_skips_the_update_counts_it_and_training_goes_on() -> None:
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    model.blocks[1] = Poison(model.blocks[1])
    engine, data = _setup(model, on_nonfinite="skip")
    engine.step(engine.batch(data, 0))
    before = {n: p.detach().clone() for n, p in engine.named_parameters()}
    model.blocks[1].on = True  # step 1 only
    loss = engine.step(engine.batch(data, 1))
    assert loss != loss and engine.last_step_skipped and engine.nonfinite_steps == 1
    for n, p in engine.named_parameters():
        assert torch.equal(p, before[n]), n
    model.blocks[1].on = False
    loss = engine.step(engine.batch(data, 2))
    assert loss == loss and not engine.last_step_skipped and engine.step_count == 3
    assert any(not torch.equal(p, before[n]) for n, p in engine.named_parameters())


def test_on_nonfinite_is_checked() -> None:
    from varuna.engine.config import VarunaConfig
    from varuna.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"on_nonfinite='ignore': use 'raise' \(stop with an error\) or 'skip'"
    ):
        VarunaConfig(pipeline=1, data=1, global_batch_size=4, micro_batch_size=2, on_nonfinite="ignore")


def test_reduce_lr_on_plateau_gets_the_loss() -> None:
    torch.manual_seed(0)
    engine, data = _setup(GPT(gpt_tiny()))
    opt = engine.optimizer
    assert opt is not None
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10.0)
    engine.set_optimizer(opt, plateau)
    for k in range(3):
        engine.step(engine.batch(data, k))
    assert plateau.last_epoch == 3  # stepped once per step, with a metric (it raises without one)
    assert opt.param_groups[0]["lr"] < 0.1  # no step improved by the huge threshold: the LR was cut
