"""Measure what the planner needs: per-segment compute and memory, and the network.

    varuna profile --gpus 2 train.py --lr 3e-4      # writes RUN_DIR/profile.json (a `CostTable`)

    # or inside a job you started yourself:
    segments = profile_model(model, batch, micro_batch_sizes=(1, 2, 4))   # any process
    network = profile_network()                                           # collective, >= 2 ranks

``varuna profile`` (`varuna.profile.job`) runs the training script unchanged up to its
``Varuna(...)``, takes the model and ``example_batch`` from there and calls `run_profile` on every
rank: the network on all ranks together, the model on rank 0 alone (on a GPU host each rank has a
device of its own; on CPU the other ranks sleep in a gloo wait), and rank 0 writes the table.

Per segment (the code between two CutPoints) and micro-batch size, a profile records:

    forward_s    forward with autograd          | timestamps at each CutPoint call
    backward_s   its backward, accumulating     | and at each CutPoint's gradient hook
                 into existing gradients, as the engine's bucketed gradients do
    recompute_s  forward with autograd, right after a no_grad forward of the same micro-batch
    nograd_forward_s  that no_grad forward (a recomputing stage's first forward: no graph, nothing kept),
                 timed after an untimed one, as the first stage runs them pulled ahead, not with
                 the caches a backward left behind (docs/benchmarks/planner.md has the figures)
    update_s     once per step: zero its gradients, their norm, an AdamW step over its parameters
    activation_bytes         bytes of the value handed to the segment's CutPoint
    activation_memory_bytes  bytes saved for backward (saved-tensor hooks; parameters excluded)
    param/grad/optimizer bytes, a tied weight counted in its first segment only

and, inside a job (`run_profile`), how much slower a rank computes while n ranks compute at once
(`measure_slowdown`: on a CPU host with fewer cores than ranks, about n / cores), and on CPU the
seconds each compute action of a pipelined stage costs beyond its segments' compute where ranks
share a host's cores, fitted from a short pipeline of exactly known compute run with the real engine
(`varuna.profile.calibrate`: `CostTable.action_overhead_s`; a few seconds; 0 where every rank has a
core of its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves
from tqdm import tqdm

from varuna.cut.cutpoint import CutPoint, handling, model_loss
from varuna.cut.partition import trace_model
from varuna.engine.precision import autocast_policy
from varuna.errors import ConfigError
from varuna.planner.costs import CostTable, NetworkCost, SegmentCost, model_signature
from varuna.profile.calibrate import fit_action_overhead, shares_cores
from varuna.profile.memory import param_split, tensor_bytes
from varuna.profile.network import NETWORK_SIZES, profile_network
from varuna.profile.passes import device_of, micro_batch, micro_len, preserved
from varuna.profile.slowdown import measure_slowdown

__all__ = [
    "check_sizes",
    "profile_model",
    "profile_table",
    "profile_network",
    "run_profile",
    "measure_slowdown",
    "cached_profile",
    "model_signature",
    "NETWORK_SIZES",
]

PROFILE_FILE = "profile.json"


class _Clock:
    """A CutPoint handler: timestamps each cut in forward and its gradient's arrival in backward."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.marks: list[float] = []
        self.grad: dict[int, float] = {}
        self.bytes: list[int] = []

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def on_cut(self, cut: CutPoint, value: Any) -> Any:
        index = len(self.marks)
        self.marks.append(self.now())
        self.bytes.append(tensor_bytes(value))
        grads = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]
        if grads:
            grads[0].register_hook(lambda g, i=index: self.grad.__setitem__(i, self.now()))
        return value

    @property
    def segment(self) -> int:
        return len(self.marks)


class _SavedBytes:
    """Saved-tensor hooks adding the bytes each segment keeps for backward (each storage once)."""

    def __init__(self, clock: _Clock, param_storages: set[int], segments: int) -> None:
        self.clock = clock
        self.params = param_storages
        self.seen: set[int] = set()
        self.per_segment = [0] * segments

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            key, size = id(t), t.numel() * t.element_size()
        if key not in self.params and key not in self.seen:
            self.seen.add(key)
            self.per_segment[min(self.clock.segment, len(self.per_segment) - 1)] += size
        return t

    def hooks(self) -> AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _diffs(marks: Sequence[float]) -> list[float]:
    return [max(b - a, 0.0) for a, b in zip(marks, marks[1:])]


def check_sizes(micro_batch_sizes: Sequence[int]) -> list[int]:
    """The micro-batch sizes to profile, sorted; ConfigError unless they are distinct positive integers."""
    sizes = [int(m) for m in micro_batch_sizes]
    if not sizes or any(m < 1 for m in sizes) or len(set(sizes)) != len(sizes):
        raise ConfigError(
            f"micro_batch_sizes = {list(micro_batch_sizes)}; give distinct positive integers, e.g. 1,2,4"
        )
    return sorted(sizes)


def _profile(
    model: nn.Module,
    example_batch: Mapping[str, Any],
    *,
    micro_batch_sizes: Sequence[int] = (1, 2, 4),
    repeats: int = 3,
    precision: str = "fp32",
    optimizer_bytes_per_param: int = 8,
    progress: bool = True,
) -> tuple[list[SegmentCost], int]:
    """The segments' costs and the bytes of weights used in several segments."""
    sizes = check_sizes(micro_batch_sizes)
    if repeats < 1:
        raise ConfigError(f"repeats = {repeats}; profile at least once (repeats >= 1)")
    device = device_of(model)
    autocast = autocast_policy(precision, device.type)
    sync: Callable[[], None] = (
        (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    )
    trace = trace_model(model, micro_batch(example_batch, sizes[0], device))
    k = len(trace.cut_names)
    split, tied = param_split(model, trace.param_segments, k + 1, optimizer_bytes_per_param)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def forward(clock: _Clock, micro: dict[str, Any]) -> Any:
        with handling(clock), autocast():
            loss = model_loss(model(**micro))
        if len(clock.marks) != k:
            raise ConfigError(
                f"the model called {len(clock.marks)} CutPoints at micro-batch size "
                f"{micro_len(micro)} but {k} when traced; every CutPoint must be called once per forward"
            )
        return loss

    samples: dict[str, dict[int, list[list[float]]]] = {kind: {m: [] for m in sizes} for kind in "fbrn"}
    cut_bytes: dict[int, list[int]] = {}
    memory: dict[int, list[int]] = {}
    bar = tqdm(
        total=len(sizes) * (repeats + 1) + 1,
        desc="varuna profile",
        unit="pass",
        file=sys.stderr,
        disable=not progress,
        mininterval=0.5,
    )
    with preserved(model), bar:
        for p in model.parameters():  # the engine's backward adds into zeroed bucket views
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        for m in sizes:
            micro = micro_batch(example_batch, m, device)
            for rep in range(repeats + 1):
                clock = _Clock(sync)
                saved = _SavedBytes(clock, param_storages, k + 1)
                # Saved-tensor hooks cost time: they run in the warm-up pass only.
                with saved.hooks() if rep == 0 else contextlib.nullcontext():
                    start = clock.now()
                    loss = forward(clock, micro)
                    mid = clock.now()
                    loss.backward()
                end = clock.now()
                back = [mid]
                for i in reversed(range(k)):  # cut i's gradient arrives when segment i+1's backward ends
                    back.append(clock.grad.get(i, back[-1]))
                if rep == 0:
                    cut_bytes[m], memory[m] = [*clock.bytes, 0], saved.per_segment
                else:
                    samples["f"][m].append(_diffs([start, *clock.marks, mid]))
                    samples["b"][m].append(_diffs([*back, end])[::-1])
                    with torch.no_grad():  # what a recomputing schedule's forward runs ...
                        # ... pulled ahead on the first stage, back to back: timed after an
                        # untimed one, not with the caches a backward left behind
                        forward(_Clock(sync), micro)
                        clock = _Clock(sync)
                        start = clock.now()
                        forward(clock, micro)
                        samples["n"][m].append(_diffs([start, *clock.marks, clock.now()]))
                    clock = _Clock(sync)
                    start = clock.now()
                    loss = forward(clock, micro)  # ... and its recompute, before the backward
                    samples["r"][m].append(_diffs([start, *clock.marks, clock.now()]))
                del loss
                bar.update()
        update = _update_times(model, trace.param_segments, k + 1, repeats, sync)
        bar.update()

    def median(kind: str, j: int) -> dict[int, float]:
        return {m: statistics.median(s[j] for s in samples[kind][m]) for m in sizes}

    segments = [
        SegmentCost(
            forward_s=median("f", j),
            backward_s=median("b", j),
            recompute_s=median("r", j),
            nograd_forward_s=median("n", j),
            activation_bytes={m: cut_bytes[m][j] for m in sizes},
            activation_memory_bytes={m: memory[m][j] for m in sizes},
            param_bytes=split[0][j],
            grad_bytes=split[1][j],
            optimizer_bytes=split[2][j],
            update_s=update[j],
        )
        for j in range(k + 1)
    ]
    return segments, tied


def _update_times(
    model: nn.Module,
    segment_of: Mapping[str, set[int]],
    segments: int,
    repeats: int,
    sync: Callable[[], None],
) -> list[float]:
    """Per segment, the median seconds of what the engine does once per step for its parameters:
    zero the gradients, take their norm, and step an AdamW optimizer (values restored after)."""
    groups: list[list[nn.Parameter]] = [[] for _ in range(segments)]
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            groups[min(segment_of.get(name) or {0})].append(p)
    out = []
    for params in groups:
        if not params:
            out.append(0.0)
            continue
        saved = [p.detach().clone() for p in params]
        opt = torch.optim.AdamW(params)
        grads = [p.grad for p in params if p.grad is not None]
        times = []
        for rep in range(repeats + 1):  # the first step creates the optimizer state: untimed
            sync()
            t0 = time.perf_counter()
            torch._foreach_zero_(grads)
            torch._foreach_norm(grads)
            opt.step()
            sync()
            if rep:
                times.append(time.perf_counter() - t0)
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)
        out.append(statistics.median(times))
    return out


def profile_model(
    model: nn.Module,
    example_batch: Mapping[str, Any],
    *,
    micro_batch_sizes: Sequence[int] = (1, 2, 4),
    repeats: int = 3,
    precision: str = "fp32",
    optimizer_bytes_per_param: int = 8,
    progress: bool = True,
) -> list[SegmentCost]:
    """Costs of every segment of `model`, one `SegmentCost` per segment (K CutPoints: K+1).

    Each micro-batch size gets a warm-up pass (which also counts bytes) and `repeats` timed passes;
    times are medians. Micro-batches are the first rows of `example_batch`, repeated cyclically when
    it has fewer rows. The model's gradients and the RNG state are left as they were.
    `optimizer_bytes_per_param` is 8 for Adam with fp32 state (two moments).

    >>> segs = profile_model(GPT(gpt_tiny()), batch, micro_batch_sizes=(1, 2))   # doctest: +SKIP
    >>> len(segs), segs[0].forward_s[2] > 0                                      # doctest: +SKIP
    (4, True)
    """
    segments, _ = _profile(
        model,
        example_batch,
        micro_batch_sizes=micro_batch_sizes,
        repeats=repeats,
        precision=precision,
        optimizer_bytes_per_param=optimizer_bytes_per_param,
        progress=progress,
    )
    return segments


def profile_table(
    model: nn.Module,
    example_batch: Mapping[str, Any],
    *,
    network: NetworkCost,
    compute_slowdown: Mapping[int, float] | None = None,
    **options: Any,
) -> CostTable:
    """`profile_model(model, example_batch, **options)` with `network`, the model's signature, its
    tied bytes and `compute_slowdown` (from `measure_slowdown`), as the `CostTable` the planner reads."""
    segments, tied = _profile(model, example_batch, **options)
    device = device_of(model)
    return CostTable(
        model_signature=model_signature(model),
        segments=segments,
        network=network,
        micro_batch_sizes=check_sizes(options.get("micro_batch_sizes", (1, 2, 4))),
        device=f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type,
        precision=str(options.get("precision", "fp32")),
        created=time.time(),
        tied_bytes=tied,
        compute_slowdown=dict(compute_slowdown or {}),
    )


def run_profile(
    model: nn.Module,
    example_batch: Mapping[str, Any],
    *,
    micro_batch_sizes: Sequence[int] = (1, 2, 4),
    precision: str = "fp32",
    repeats: int = 3,
    run_dir: str | Path | None = None,
    progress: bool = True,
    engine: Callable[..., Any] | None = None,
) -> CostTable:
    """Profile inside a job (every rank calls it): the network and the compute slowdown with
    1..world ranks busy on all ranks, then the model on rank 0, then (on CPU, where ranks share a
    host's cores) the runtime's own cost per action on all ranks
    (`varuna.profile.calibrate.fit_action_overhead`), measured with
    `engine` (the `varuna.Varuna` class, handed in so that measurement does not import the engine
    that imports it; None: no calibration, the cost per action stays 0).

    Every rank returns the same table; rank 0 writes it to ``RUN_DIR/profile.json`` (`run_dir`
    defaults to the launcher's ``VARUNA_RUN_DIR``). The other ranks wait in a broadcast while
    rank 0 profiles, which must end within the distributed timeout (``VARUNA_TIMEOUT``, 120 s).
    """
    from varuna.comm.rendezvous import host_layout, init_distributed, launch_env

    rank, world = init_distributed()
    network = profile_network()
    slowdown = measure_slowdown(model, example_batch, micro_batch_size=min(check_sizes(micro_batch_sizes)))
    box: list[Any] = [None]
    if rank == 0:
        table = profile_table(
            model,
            example_batch,
            network=network,
            compute_slowdown=slowdown,
            micro_batch_sizes=micro_batch_sizes,
            repeats=repeats,
            precision=precision,
            progress=progress,
        )
        box[0] = table.to_json()
    dist.broadcast_object_list(box, src=0)
    table = CostTable.from_json(box[0])
    where = Path(run_dir) if run_dir is not None else launch_env().run_dir
    if table.device == "cpu" and engine is not None:
        if rank == 0 and where is not None:  # the minutes of measurement above survive a failure below
            table.save(where / PROFILE_FILE)
        layout = host_layout()  # collective: gathered once, for the message and the fit
        shared = shares_cores(layout)
        if progress and rank == 0:
            what = (
                f"the runtime's own cost per action ({world}-stage pipeline of known compute)"
                if shared
                else "every rank has a core of its own: no runtime cost per action beyond the profiled compute"
            )
            print(f"varuna profile: {what}", file=sys.stderr, flush=True)
        if shared:
            table = dataclasses.replace(
                table, action_overhead_s=fit_action_overhead(table, engine, layout=layout)
            )
    if rank == 0 and where is not None:
        path = table.save(where / PROFILE_FILE)
        print(f"varuna: profile of {table.num_segments} segments written to {path}", file=sys.stderr)
    return table


def cached_profile(run_dir: str | Path, model: nn.Module) -> CostTable | None:
    """``RUN_DIR/profile.json`` if it exists and was measured on this model's architecture."""
    path = Path(run_dir) / PROFILE_FILE
    if not path.is_file():
        return None
    table = CostTable.load(path)
    return table if table.model_signature == model_signature(model) else None
