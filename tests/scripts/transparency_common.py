"""What the transparency tests train, shared by the worker jobs and the single-process reference."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from varuna.data import SyntheticLM, SyntheticMLM, collate, global_indices
from varuna.models import GPT, BertMLM, bert_tiny, gpt_tiny

STEPS = 5
BUCKET_MB = 0.02  # about 20 KB: a tiny model's stage still has several gradient buckets
GLOBAL_BATCH = 16
MICRO_BATCH = 2
SCHEDULES = ("gpipe", "1f1b", "eager-1f1b", "varuna", "zb-h1")
MODELS = ("gpt", "bert")
# world size -> (P, D, partition); 3x1 uses an explicit uneven split of the 4 segments.
CONFIGS: dict[int, list[tuple[int, int, Any]]] = {
    1: [(1, 1, "balanced")],
    2: [(2, 1, "balanced"), (1, 2, "balanced")],
    3: [(3, 1, [0, 1])],
    4: [(2, 2, "balanced"), (4, 1, "balanced")],
}


# zb-h1 and zb-v merge the weight halves that fill nothing back into their backward, on the profiled
# costs (`fuse_weights`); "<schedule>:every-w" runs them with every W split, as the paper has them.
EVERY_W = ":every-w"
# world size -> (P, D, model, schedule) run beside CONFIGS' (one chunk per rank, balanced)
EXTRA: dict[int, list[tuple[int, int, str, str]]] = {
    2: [(2, 1, kind, "zb-h1" + EVERY_W) for kind in MODELS],
    4: [(2, 2, "gpt", "zb-h1" + EVERY_W)],
}


def engine_options(schedule: str) -> dict[str, Any]:
    """Varuna keywords of a schedule name as these tests write it (see EVERY_W)."""
    name, _, variant = schedule.partition(":")
    return {"schedule": name} | ({"fuse_weights": False} if variant == EVERY_W[1:] else {})


# Schedules with two chunks per rank (P x 2 virtual stages): world size -> (P, D, partition, models).
# 4x1 needs 8 segments (a CutPoint inside every GPT block; an 8-layer BERT); the uneven splits: 4
# virtual stages of 1, 1, 3 and 3 segments, and zb-v on 3 ranks (interleaved-1f1b needs M % P == 0).
CHUNKED = ("interleaved-1f1b", "zb-v")
CHUNK_CONFIGS: dict[int, list[tuple[int, int, Any, tuple[str, ...], tuple[str, ...]]]] = {
    1: [(1, 1, "balanced", ("gpt",), CHUNKED)],
    2: [
        (2, 1, "balanced", MODELS, CHUNKED + ("zb-v" + EVERY_W,)),
        (2, 1, [0, 1, 4], ("gpt-midcut",), CHUNKED),
    ],
    3: [(3, 1, [0, 2, 3, 4, 6], ("gpt-midcut",), ("zb-v",))],
    4: [(2, 2, "balanced", MODELS, CHUNKED), (4, 1, "balanced", ("gpt-midcut", "bert8"), CHUNKED)],
}


def build(kind: str) -> nn.Module:
    torch.manual_seed(1234)
    if kind == "gpt-untied":  # the tied model's values plus a separate (random) head
        tied = build("gpt")
        untied = GPT(dataclasses.replace(gpt_tiny(), tie_embeddings=False))
        missing, unexpected = untied.load_state_dict(tied.state_dict(), strict=False)
        assert missing == ["lm_head.weight"] and not unexpected
        return untied
    if kind == "gpt-midcut":  # the same GPT (same parameters) with a CutPoint inside every block too
        return GPT(dataclasses.replace(gpt_tiny(), cut_inside_blocks=True))
    if kind == "bert8":  # 8 segments: enough for two chunks on each of 4 ranks
        return BertMLM(dataclasses.replace(bert_tiny(), n_layer=8))
    return GPT(gpt_tiny()) if kind == "gpt" else BertMLM(bert_tiny())


def dataset(kind: str) -> Any:
    if kind.startswith("gpt"):
        cfg = gpt_tiny()
        return SyntheticLM(cfg.vocab_size, cfg.seq_len, 256, seed=7)
    bcfg = bert_tiny()
    return SyntheticMLM(bcfg.vocab_size, bcfg.seq_len, 256, seed=7)


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def varlen(batch: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """Step k's batch cut to a sequence length that changes from step to step."""
    length = 6 + 2 * step
    return {k: v[:, :length] for k, v in batch.items()}


CLIP = 0.05


def reference(
    kind: str, transform: Any = None, clip: float | None = None, steps: int = STEPS
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process training on the same global batches."""
    model = build(kind)
    data = dataset(kind)
    opt = optimizer(model.parameters())
    losses = []
    for k in range(steps):
        batch = collate([data[i] for i in global_indices(k, GLOBAL_BATCH, len(data))])
        if transform is not None:
            batch = transform(batch, k)
        loss = model(**batch)
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float, name: str) -> None:
    """Equal within `rel` relative to the tensor's scale: |a - b| <= rel * (|b| + max|b|) elementwise.

    Elementwise relative error alone is meaningless for entries that pass through zero.
    """
    torch.testing.assert_close(
        actual,
        expected,
        rtol=rel,
        atol=rel * float(expected.abs().max()),
        msg=lambda m, name=name: f"{name}: {m}",
    )
