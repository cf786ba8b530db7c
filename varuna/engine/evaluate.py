"""Evaluation through the pipeline: forwards only, over the same stages, data-parallel.

    result = engine.evaluate(val_set)                        # every rank: the same Evaluation
    result.loss, result.samples                              # mean loss, weighted by sample count
    result = engine.evaluate(val_set, metrics=accuracy)      # accuracy(outputs, batch) -> {"correct": n}

Which samples go where (the rule a plain evaluation reproduces exactly, `split`):

    dataset of N samples, global batch G, D replicas, micro-batch size m
    batch k            samples k*G ... min(N, (k+1)*G) - 1, in order (the last batch may be partial)
    replica r          the r-th of D contiguous, near-equal parts of it (the first parts one larger)
    micro-batches      that part in runs of m samples (the last may be shorter)

Every sample is evaluated exactly once. An iterable of batch dicts is read the same way, each dict
one global batch (every rank iterates it the same way). The loss is the mean of the model's loss
per micro-batch weighted by the micro-batch's sample count; `metrics(outputs, batch)` runs on the
last stage for every micro-batch with what the model returned (e.g. a transformers output with
`.logits`) and that micro-batch, and returns numbers to add up (counts and sums: `{"correct": 7.0,
"tokens": 96.0}`), summed over micro-batches, batches and replicas. The model is in eval mode
(dropout off) during evaluation and back in its modes after; nothing is kept for a backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from varuna.data import batch_len, collate, slice_batch
from varuna.errors import ConfigError

__all__ = ["Evaluation", "MetricsFn", "split", "evaluate"]

MetricsFn = Callable[[Any, Mapping[str, Any]], Mapping[str, float | torch.Tensor]]
"""`metrics(outputs, micro_batch) -> {name: number}`: additive quantities of one micro-batch."""


@dataclass(slots=True)
class Evaluation:
    """What `Varuna.evaluate` returns on every rank."""

    loss: float
    """The model's loss, averaged over micro-batches weighted by their sample counts."""
    samples: int
    """How many samples were evaluated (each once, over all replicas)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Each name `metrics` returned, summed over every micro-batch of every replica."""


def split(n: int, data: int, replica: int, micro_batch_size: int) -> list[range]:
    """The micro-batches (as row ranges of a global batch of `n` samples) of `replica` of `data`.

    >>> split(10, 2, 1, 2)        # replica 1 takes rows 5..9
    [range(5, 7), range(7, 9), range(9, 10)]
    >>> split(3, 4, 3, 2)         # a short last batch: replica 3 gets nothing
    []
    """
    base, extra = divmod(n, data)
    start = replica * base + min(replica, extra)
    stop = start + base + (1 if replica < extra else 0)
    return [range(i, min(i + micro_batch_size, stop)) for i in range(start, stop, micro_batch_size)]


def _replica_batches(
    data: Any, global_batch_size: int, replicas: int, replica: int, micro_batch_size: int
) -> Iterator[tuple[list[int], dict[str, Any] | None]]:
    """Per global batch: this replica's micro-batch sizes and its rows as one batch (None: no rows)."""
    if isinstance(data, Mapping):
        raise ConfigError(
            "evaluate() takes a map-style dataset (len() and [i]) or an iterable of batch dicts, not one "
            "batch dict; wrap it in a list: engine.evaluate([batch])"
        )
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        n = len(data)
        for start in range(0, n, global_batch_size):
            parts = split(min(n - start, global_batch_size), replicas, replica, micro_batch_size)
            if not parts:
                yield [], None
                continue
            rows = [start + i for i in range(parts[0].start, parts[-1].stop)]
            getitems = getattr(data, "__getitems__", None)
            samples = getitems(rows) if callable(getitems) else [data[i] for i in rows]
            yield [len(r) for r in parts], collate(samples)
    elif isinstance(data, Iterable):
        for i, batch in enumerate(data):
            if not isinstance(batch, Mapping):
                raise ConfigError(
                    f"evaluate() iterates batch dicts (one global batch each); item {i} is a {type(batch).__name__}"
                )
            parts = split(batch_len(batch), replicas, replica, micro_batch_size)
            if not parts:
                yield [], None
                continue
            yield [len(r) for r in parts], slice_batch(batch, parts[0].start, parts[-1].stop)
    else:
        raise ConfigError(
            f"evaluate() takes a map-style dataset or an iterable of batch dicts, got a {type(data).__name__}"
        )


def evaluate(engine: Any, data: Any, metrics: MetricsFn | None = None) -> Evaluation:
    """Collective: `Varuna.evaluate`'s work (see the module docstring)."""
    cfg = engine.config.engine
    runtime = engine._runtime
    last = engine.partition.num_stages - 1 in engine.chunk_stages
    sums: dict[str, float] = {}
    loss_sum, samples = 0.0, 0
    model: nn.Module = engine.model
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        batches = _replica_batches(
            data, cfg.global_batch_size, cfg.data, engine.replica, cfg.micro_batch_size
        )
        for sizes, batch in batches:
            if batch is None:
                continue
            bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            micro = [slice_batch(batch, a, b, engine.device) for a, b in zip(bounds, bounds[1:])]
            results: dict[int, tuple[torch.Tensor, Any]] = {}

            def keep(m: int, loss: torch.Tensor, result: Any, results: dict = results) -> None:
                results[m] = (loss, result)

            with torch.no_grad():
                runtime.evaluate(engine._eval_actions(len(micro)), micro, keep)
            if last:
                for m, (loss, result) in sorted(results.items()):
                    loss_sum += float(loss) * sizes[m]
                    samples += sizes[m]
                    if metrics is not None:
                        with torch.no_grad():
                            for name, value in metrics(result, micro[m]).items():
                                sums[name] = sums.get(name, 0.0) + float(value)
    finally:
        for module, training in modes:
            module.training = training
        engine._eval_done()
    names: list[str] = sorted(sums)
    if engine.world_size > 1:
        gathered: list[Any] = [None] * engine.world_size
        dist.all_gather_object(gathered, names)
        names = sorted({name for part in gathered for name in part})
        totals = torch.tensor(
            [loss_sum, float(samples), *(sums.get(k, 0.0) for k in names)],
            dtype=torch.float64,
            device=engine.device,
        )
        dist.all_reduce(totals)
        loss_sum, total, values = float(totals[0]), int(totals[1]), [float(v) for v in totals[2:]]
    else:
        total, values = samples, [sums[k] for k in names]
    if total == 0:
        raise ConfigError("evaluate() saw no samples: the dataset or iterable was empty")
    return Evaluation(loss=loss_sum / total, samples=total, metrics=dict(zip(names, values)))
