"""Blocks compiled with `torch.compile` (`block.compile()` before `Varuna(...)`) train equal to the
same blocks uncompiled; the start-up trace and the memory check run them eagerly (inductor has no
meta kernels). In one process: compiling takes seconds, so this sits with the slow tier."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from varuna import Varuna
from varuna.data import SyntheticLM, collate
from varuna.models import GPT, gpt_tiny

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]


def _train(compiled: bool) -> tuple[list[float], Varuna]:
    torch.manual_seed(0)
    cfg = dataclasses.replace(gpt_tiny(), n_layer=2)  # two blocks of one class: one compile
    model = GPT(cfg)
    if compiled:
        for block in model.blocks:
            block.compile()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
    engine = Varuna(model, global_batch_size=8, micro_batch_size=4, example_batch=collate([data[0], data[1]]))
    engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    return [engine.step(engine.batch(data, k)) for k in range(3)], engine


def test_compiled_blocks_train_equal_to_eager_ones() -> None:
    torch.set_num_threads(1)
    eager, _ = _train(False)
    compiled, engine = _train(True)
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert engine.memory_estimate.note is None and engine.memory_estimate.activations > 0
