"""`guard_chunks`: on the way to a chunk's input CutPoint, the rank's other chunk is skipped with
stand-ins, a block that holds CutPoints whole where they all come before that input."""

from __future__ import annotations

import dataclasses

import torch

from varuna.cut.cutpoint import CutPoint
from varuna.cut.standin import StandIn, record_outputs
from varuna.engine.chunks import ChunkGuard, guard_chunks
from varuna.models import GPT, gpt_tiny


def test_a_block_whose_cutpoints_all_come_before_the_start_is_skipped_whole() -> None:
    model = GPT(dataclasses.replace(gpt_tiny(), cut_inside_blocks=True))
    # CutPoints in the order the forward calls them: block k's `mid` is 2k, the cut after it 2k + 1
    order = [m for b, c in zip(model.blocks, [*model.cuts, None]) for m in (b.mid, c) if m is not None]
    cut_index = {id(c): i for i, c in enumerate(order)}
    assert all(isinstance(c, CutPoint) for c in order) and len(order) == 7
    x = torch.randn(2, gpt_tiny().seq_len, gpt_tiny().d_model)
    with record_outputs(model) as traced:  # the output shapes, as the engine's start-up trace notes them
        for block in model.blocks:
            block(x)
    start = 5  # a chunk that starts at the CutPoint after block 2
    guarded = guard_chunks(
        model, torch.device("cpu"), traced, lambda last: last is None or last < start, cut_index
    )
    assert isinstance(model.blocks[0].forward, ChunkGuard) and guarded > len(model.blocks)
    calls = {k: 0 for k in range(len(model.blocks))}
    for k, block in enumerate(model.blocks):
        block.ln_1.register_forward_pre_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
    out = [block(x) for block in model.blocks]
    assert all(isinstance(o, StandIn) and o.shape == x.shape for o in out)
    # blocks 0-2 hold CutPoints 0-4, all before the start: one stand-in call each, nothing inside run;
    # block 3 holds CutPoint 6, after it: entered, its modules skipped one by one
    assert calls == {0: 0, 1: 0, 2: 0, 3: 1}
