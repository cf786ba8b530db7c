"""Cutting a model at its CutPoints into contiguous pipeline stages.

Three steps, each separate so it can be tested alone:

    trace_model(model, batch)    -> Trace       which CutPoints fire, in what order, and which
                                                 parameters each segment between them uses
    profile_segments(...)        -> [seconds]   measured forward+backward time per segment
    make_partition(trace, P,...) -> Partition   stage boundaries, parameters per stage, tied sets

With K CutPoints called in order c0 .. c(K-1) there are K+1 segments; segment j runs between
c(j-1) and c(j). A partition into P stages is P-1 increasing cut indices ("boundaries"):

    segments:   [0] c0 [1] c1 [2] c2 [3] c3 [4]
    boundaries: (1, 2)  ->  stage 0 = segments 0-1, stage 1 = segment 2, stage 2 = segments 3-4

A parameter used in segments of two stages (a tied embedding, say) is held by both and its
gradients are summed; `shared_weights` names further groups of parameters that are one weight.
"""

from __future__ import annotations

import difflib
import itertools
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from varuna.cut.cutpoint import CutPoint, handling, model_loss
from varuna.errors import ConfigError, PartitionError

__all__ = [
    "Trace",
    "Partition",
    "TiedGroup",
    "trace_model",
    "profile_segments",
    "make_partition",
    "balance",
    "balance_ranks",
]


@dataclass(kw_only=True, slots=True)
class Trace:
    """What one forward pass of the whole model did, as seen from the CutPoints."""

    cut_names: list[str]
    """Module paths of the CutPoints in the order they were called."""
    param_segments: dict[str, set[int]]
    """Canonical parameter name -> the segments whose computation used it."""
    param_aliases: dict[str, list[str]]
    """Canonical parameter name -> every name under which that Parameter object is registered."""
    param_shapes: dict[str, tuple[int, ...]]

    @property
    def num_segments(self) -> int:
        return len(self.cut_names) + 1


@dataclass(frozen=True, slots=True)
class TiedGroup:
    """Parameters that are one weight held by several stages; their gradients are summed."""

    names: tuple[str, ...]
    """Canonical names of the distinct Parameter objects in the group (one name for a reused tensor)."""
    stages: tuple[int, ...]
    """Stages holding a member, ascending."""


@dataclass(kw_only=True, slots=True)
class Partition:
    """The stages of a model: which segments and which parameters each holds."""

    num_stages: int
    boundaries: tuple[int, ...]
    """P-1 increasing cut indices; stage s ends at cut boundaries[s]."""
    num_segments: int
    stage_params: list[list[str]]
    """Canonical parameter names held by each stage."""
    tied: list[TiedGroup] = field(default_factory=list)
    segment_costs: list[float] | None = None

    def stage_segments(self, stage: int) -> range:
        """The segments stage `stage` runs."""
        first = self.boundaries[stage - 1] + 1 if stage > 0 else 0
        last = self.boundaries[stage] if stage < self.num_stages - 1 else self.num_segments - 1
        return range(first, last + 1)

    def start_cut(self, stage: int) -> int | None:
        """Index of the CutPoint whose value this stage receives (None for the first stage)."""
        return self.boundaries[stage - 1] if stage > 0 else None

    def end_cut(self, stage: int) -> int | None:
        """Index of the CutPoint whose value this stage sends on (None for the last stage)."""
        return self.boundaries[stage] if stage < self.num_stages - 1 else None

    def describe(self) -> str:
        rows = []
        for s in range(self.num_stages):
            segs = self.stage_segments(s)
            cost = ""
            if self.segment_costs is not None:
                cost = f", {sum(self.segment_costs[j] for j in segs) * 1e3:.1f} ms fwd+bwd"
            rows.append(
                f"stage {s}: segments {segs.start}-{segs.stop - 1}, {len(self.stage_params[s])} tensors{cost}"
            )
        return "\n".join(rows)


def canonical_names(model: nn.Module) -> tuple[dict[int, str], dict[str, list[str]]]:
    """id(Parameter) -> its first name, and first name -> every name it is registered under."""
    by_id: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canon = by_id.setdefault(id(p), name)
        aliases.setdefault(canon, []).append(name)
    return by_id, aliases


class FollowMeta(TorchFunctionMode):
    """Runs a forward whose parameters are on the meta device on real inputs: an op that mixes meta
    and real tensors runs on meta (shapes only), and a real value moved to the meta device (a
    padding mask moved to the model's device) stays real, so code that reads its values still runs."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args and not args[0].is_meta and _to_meta(args[1:], kwargs):
            dtype = next(
                (a.dtype for a in (*args[1:], kwargs.get("other")) if isinstance(a, torch.Tensor)), None
            )
            dtype = dtype or next((a for a in args[1:] if isinstance(a, torch.dtype)), kwargs.get("dtype"))
            return args[0] if dtype is None else args[0].to(dtype)
        leaves = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(a.is_meta for a in leaves) and not all(a.is_meta for a in leaves):
            args, kwargs = tree_map(
                lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a, (args, kwargs)
            )
        return func(*args, **kwargs)


class _Recorder(FollowMeta):
    """Notes which parameters every torch call touches, and in which segment it happens (a model
    built on the meta device is followed on shapes: `FollowMeta`)."""

    def __init__(self, param_ids: Mapping[int, str]) -> None:
        super().__init__()
        self.param_ids = param_ids
        self.segment = 0
        self.used: dict[str, set[int]] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        for a in tree_leaves((args, kwargs or {})):
            name = self.param_ids.get(id(a)) if isinstance(a, torch.Tensor) else None
            if name is not None:
                self.used.setdefault(name, set()).add(self.segment)
        return super().__torch_function__(func, types, args, kwargs)


def _to_meta(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether `Tensor.to(*args, **kwargs)` moves to the meta device."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_meta:
            return True
        if (isinstance(a, torch.device) and a.type == "meta") or (isinstance(a, str) and a == "meta"):
            return True
    return False


class _TraceCuts:
    def __init__(self, names: Mapping[int, str], recorder: _Recorder) -> None:
        self.names = names
        self.recorder = recorder
        self.order: list[str] = []

    def on_cut(self, cut: CutPoint, value: Any) -> Any:
        name = self.names.get(id(cut), "<a CutPoint not registered in the model>")
        if name in self.order:
            block = cut.block
            if block is not None:
                raise PartitionError(
                    f"block {block!r} ran twice in one forward pass (its CutPoint {name!r} was called twice): "
                    "the model reuses one block's weights for several layers (as ALBERT shares its layer "
                    "groups), so auto_cut cannot put a stage boundary after it. Put varuna.CutPoint() calls "
                    "in the loop that runs the layers instead, one instance per call."
                )
            raise PartitionError(
                f"CutPoint {name!r} was called twice in one forward pass (calls so far: {self.order + [name]}); "
                "each candidate boundary needs its own CutPoint instance, called exactly once — "
                "create one CutPoint per boundary, e.g. nn.ModuleList(CutPoint() for _ in range(n))."
            )
        self.order.append(name)
        self.recorder.segment += 1
        return value


def cut_names(model: nn.Module) -> dict[int, str]:
    """id(CutPoint module) -> its path in the model."""
    return {id(m): name for name, m in model.named_modules() if isinstance(m, CutPoint)}


def trace_model(model: nn.Module, batch: Mapping[str, Any]) -> Trace:
    """Run one forward pass under no_grad and record the CutPoint order and parameter use."""
    param_ids, aliases = canonical_names(model)
    names = cut_names(model)
    recorder = _Recorder(param_ids)
    cuts = _TraceCuts(names, recorder)
    with torch.no_grad(), handling(cuts), recorder, torch.compiler.set_stance("force_eager"):
        model(**batch)  # compiled blocks run as written: the trace follows every call
    never = [n for n in names.values() if n not in cuts.order]
    if never:
        raise PartitionError(
            f"CutPoint(s) {never} are registered in the model but were never called in forward "
            f"(called: {cuts.order}); call every CutPoint once per forward, or remove the unused ones."
        )
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return Trace(
        cut_names=cuts.order, param_segments=recorder.used, param_aliases=aliases, param_shapes=shapes
    )


class _TimeCuts:
    """Timestamps each CutPoint in forward and the arrival of its gradient in backward."""

    def __init__(self, names: Mapping[int, str]) -> None:
        self.names = names
        self.forward: list[float] = []
        self.grad: dict[int, float] = {}

    def on_cut(self, cut: CutPoint, value: Any) -> Any:
        index = len(self.forward)
        self.forward.append(time.perf_counter())
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            tensors[0].register_hook(lambda g, i=index: self.grad.__setitem__(i, time.perf_counter()))
        return value


def profile_segments(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    repeats: int = 3,
    autocast: Any = None,
) -> list[float]:
    """Measured forward+backward seconds of each segment (median over `repeats` after one warm-up).

    `autocast` is a zero-argument callable returning a context manager (the precision policy).
    Gradients the profile computes are discarded.
    """
    names = cut_names(model)
    samples: list[list[float]] = []
    for rep in range(repeats + 1):
        timer = _TimeCuts(names)
        start = time.perf_counter()
        with handling(timer):
            if autocast is not None:
                with autocast():
                    loss = model_loss(model(**batch))
            else:
                loss = model_loss(model(**batch))
        fwd_end = time.perf_counter()
        loss.backward()
        bwd_end = time.perf_counter()
        k = len(timer.forward)
        marks_f = [start, *timer.forward, fwd_end]
        fwd = [marks_f[j + 1] - marks_f[j] for j in range(k + 1)]
        # Backward runs last segment first: grad of cut k-1 arrives after segment k's backward.
        marks_b = [fwd_end] + [timer.grad.get(i, fwd_end) for i in reversed(range(k))] + [bwd_end]
        bwd_rev = [max(marks_b[j + 1] - marks_b[j], 0.0) for j in range(k + 1)]
        bwd = list(reversed(bwd_rev))
        if rep > 0:
            samples.append([f + b for f, b in zip(fwd, bwd)])
    model.zero_grad(set_to_none=True)
    return [statistics.median(col) for col in zip(*samples)]


def balance(costs: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Boundaries splitting `costs` into `num_stages` contiguous parts minimising the largest part.

    >>> balance([1, 1, 1, 3], 2)
    (2,)
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise PartitionError(f"cannot split {n} segments into {num_stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = (float("inf"), float("inf"))
    # best[p][i]: (largest stage cost, sum of squared stage costs) splitting the first i segments
    # into p stages; the second term breaks ties towards evenly loaded remaining stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for p in range(1, num_stages + 1):
        for i in range(p, n - (num_stages - p) + 1):
            for j in range(p - 1, i):
                part = prefix[i] - prefix[j]
                prev = best[p - 1][j]
                value = (max(prev[0], part), prev[1] + part * part)
                if value[0] < best[p][i][0] - 1e-12 or (
                    abs(value[0] - best[p][i][0]) <= 1e-12 and value[1] < best[p][i][1] - 1e-12
                ):
                    best[p][i] = value
                    choice[p][i] = j
    cuts = []
    i = n
    for p in range(num_stages, 1, -1):
        i = choice[p][i]
        cuts.append(i - 1)  # stage p-1 starts at segment i, so it receives cut i-1
    return tuple(reversed(cuts))


def balance_ranks(
    costs: Sequence[float], owners: Sequence[int], *, slack: float = 1.05, limit: int = 300_000
) -> tuple[int, ...]:
    """Boundaries for `len(owners)` contiguous stages where stage v runs on rank `owners[v]` (several
    chunks per rank): among the splits whose largest stage is within `slack` of the smallest
    possible (`balance`'s), the one whose busiest rank has the least load, then the evenest.

    Balancing the stages alone can leave a rank with two large chunks against one with two small
    ones (zb-v puts the first and the last chunk together); balancing only the ranks can make one
    chunk tiny and its neighbour huge, which stalls the pipeline. Exhaustive over the boundary
    choices when they number at most `limit`, else `balance`'s.

    >>> balance_ranks([1, 3, 1, 1, 1, 1], [0, 1, 1, 0], slack=1.5)  # balance(): rank loads 3 and 5
    (0, 1, 2)
    """
    n, k = len(costs), len(owners)
    plain = balance(costs, k)
    if math.comb(n - 1, k - 1) > limit:
        return plain
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def parts(bounds: Sequence[int]) -> list[float]:
        edges = (0, *(b + 1 for b in bounds), n)
        return [prefix[edges[v + 1]] - prefix[edges[v]] for v in range(k)]

    cap = max(parts(plain)) * slack + 1e-12
    ranks = max(owners) + 1
    best: tuple[float, float, float] | None = None
    chosen = plain
    for starts in itertools.combinations(range(1, n), k - 1):
        sizes = parts([b - 1 for b in starts])
        if max(sizes) > cap:
            continue
        load = [0.0] * ranks
        for v, size in enumerate(sizes):
            load[owners[v]] += size
        value = (max(load), max(sizes), sum(x * x for x in sizes))
        if best is None or value < best:
            best, chosen = value, tuple(b - 1 for b in starts)
    return chosen


def _check_boundaries(boundaries: Sequence[int], num_stages: int, num_cuts: int) -> tuple[int, ...]:
    bounds = tuple(int(b) for b in boundaries)
    if len(bounds) != num_stages - 1:
        raise PartitionError(
            f"partition={list(bounds)} has {len(bounds)} boundaries but pipeline={num_stages} needs "
            f"{num_stages - 1} (one CutPoint index, 0..{num_cuts - 1}, per stage boundary)"
        )
    if any(b < 0 or b >= num_cuts for b in bounds) or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise PartitionError(
            f"partition={list(bounds)} must be strictly increasing CutPoint indices in 0..{num_cuts - 1}"
        )
    return bounds


def _resolve_shared(shared_weights: Sequence[Sequence[str]], trace: Trace) -> list[tuple[str, ...]]:
    canon_of = {alias: canon for canon, names in trace.param_aliases.items() for alias in names}
    groups = []
    for group in shared_weights:
        if isinstance(group, str) or len(group) < 2:
            raise ConfigError(
                f"shared_weights entries are tuples of two or more parameter names, got {group!r}; "
                "e.g. shared_weights=[('wte.weight', 'lm_head.weight')]"
            )
        canon = []
        for name in group:
            if name not in canon_of:
                close = difflib.get_close_matches(name, list(canon_of), n=3)
                hint = f" Did you mean {close}?" if close else ""
                raise ConfigError(
                    f"shared_weights names {name!r}, which is not a parameter of the model.{hint} "
                    "Use names from model.named_parameters()."
                )
            if canon_of[name] not in canon:
                canon.append(canon_of[name])
        groups.append(tuple(canon))
    return groups


def make_partition(
    trace: Trace,
    num_stages: int,
    *,
    boundaries: Sequence[int] | None = None,
    segment_costs: Sequence[float] | None = None,
    shared_weights: Sequence[Sequence[str]] = (),
) -> Partition:
    """Choose stage boundaries (given, or balanced over `segment_costs`) and place the parameters."""
    num_cuts = len(trace.cut_names)
    if num_stages > 1 and num_cuts == 0:
        raise PartitionError(
            f"pipeline={num_stages} needs CutPoints to cut the model at, but forward called none; "
            "add varuna.CutPoint() modules and call them in forward where a stage may end "
            "(e.g. after each transformer block), or use pipeline=1."
        )
    if num_stages > trace.num_segments:
        raise PartitionError(
            f"pipeline={num_stages} is more stages than the model has segments: {num_cuts} CutPoints give "
            f"{trace.num_segments} segments; use pipeline <= {trace.num_segments} or add CutPoints."
        )
    if boundaries is not None:
        bounds = _check_boundaries(boundaries, num_stages, num_cuts)
    elif num_stages == 1:
        bounds = ()
    else:
        costs = list(segment_costs) if segment_costs is not None else _param_costs(trace)
        bounds = balance(costs, num_stages)
    stage_of_segment = [0] * trace.num_segments
    for s, b in enumerate(bounds):
        for j in range(b + 1, trace.num_segments):
            stage_of_segment[j] = s + 1
    stages_of: dict[str, set[int]] = {}
    for name in trace.param_aliases:
        segs = trace.param_segments.get(name)
        stages_of[name] = {stage_of_segment[j] for j in segs} if segs else {0}

    tied_groups: list[tuple[str, ...]] = [(name,) for name, st in stages_of.items() if len(st) > 1]
    for group in _resolve_shared(shared_weights, trace):
        tied_groups = [g for g in tied_groups if not set(g) & set(group)] + [group]
    tied = [
        TiedGroup(names=g, stages=tuple(sorted(set().union(*(stages_of[n] for n in g))))) for g in tied_groups
    ]
    stage_params: list[list[str]] = [[] for _ in range(num_stages)]
    for name, st in stages_of.items():
        for s in sorted(st):
            stage_params[s].append(name)
    partition = Partition(
        num_stages=num_stages,
        boundaries=bounds,
        num_segments=trace.num_segments,
        stage_params=stage_params,
        tied=tied,
        segment_costs=list(segment_costs) if segment_costs is not None else None,
    )
    for s, params in enumerate(stage_params):
        if not params:
            span = partition.stage_segments(s)
            raise PartitionError(
                f"stage {s} (segments {span.start}-{span.stop - 1}, between CutPoints "
                f"{trace.cut_names[span.start - 1] if span.start else 'start'} and "
                f"{trace.cut_names[span.stop - 1] if span.stop - 1 < num_cuts else 'end'}) holds no parameters; "
                "choose other boundaries with partition=[...], fewer stages, or remove CutPoints around "
                "parameter-free code."
            )
    return partition


def _param_costs(trace: Trace) -> list[float]:
    """Segment cost by parameter count, the fallback when nothing was measured (meta models)."""
    costs = [0.0] * trace.num_segments
    for name, segs in trace.param_segments.items():
        numel = 1
        for d in trace.param_shapes.get(name, ()):
            numel *= d
        for j in segs:
            costs[j] += numel / len(segs)
    return [c + 1.0 for c in costs]
