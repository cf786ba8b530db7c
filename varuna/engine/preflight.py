"""The memory check before a stage is made real: a shape that cannot fit is refused, not run out of.

    estimate = rank_estimate(model, micro, trace, partition, config, schedule, ...)
    check(estimate, where="rank 3 (stage 3, replica 0)")     # MemoryLimitError, or nothing

The estimate is this rank's peak: its stages' parameters, gradients and optimizer state
(`EngineConfig.optimizer_state`), and the activations the schedule holds at its peak at this
micro-batch size, the bytes each segment saves for backward measured by one forward on the meta
device (`varuna.profile.memory`) and priced by the planner's own `stage_memory`; then what a step
needs beyond those: the largest gradient twice for a moment, and the runtime's working memory. The limit is, in
this order: `memory_limit=` (the whole process, as a cgroup counts it), on CUDA the device's free
memory, on CPU the memory cgroup's limit (v2 `memory.max`, v1 `memory.limit_in_bytes`); with none
known nothing is refused. On CPU the process's resident memory at the check (Python, torch, the
meta model) counts against the limit too, and `HEADROOM` of the estimate is kept free for what it
does not model (`required`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from varuna.cut.partition import Partition, Trace
from varuna.engine.config import VarunaConfig
from varuna.errors import MemoryLimitError
from varuna.planner.memory import format_bytes, parse_memory, stage_memory
from varuna.profile.memory import OPTIMIZER_STATE_BYTES, MetaForwardError, memory_segments
from varuna.schedule import WORK_KINDS, Action, peak_inflight, pull_ahead_room, schedule_spec

__all__ = [
    "MemoryEstimate",
    "rank_estimate",
    "memory_limit",
    "resident_bytes",
    "check",
    "required",
    "HEADROOM",
]

log = logging.getLogger("varuna.memory")
_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1
HEADROOM = 0.10
"""What the check keeps free beyond the estimate, as a share of it: the allocator's fragmentation and
autograd's temporaries, which the estimate does not model (`docs/benchmarks/memory.md` has the
estimate's error against measured peaks)."""
WORKING_BYTES = 64 * 2**20
"""What a rank's first step adds beyond its stage's tensors on CPU (`docs/benchmarks/memory.md`)."""


@dataclass(slots=True)
class MemoryEstimate:
    """This rank's expected peak, its parts, and the limit it is checked against."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    """The largest gradient this stage computes: autograd makes it whole before adding it into the
    stage's gradient buffer, so for a moment it exists twice (an embedding's or an LM head's)."""
    working: int
    """The runtime's own working memory on the first step (kernels, autograd, the allocator's
    caches): `WORKING_BYTES`."""
    total: int
    """params + grads + optimizer + activations + transient + working: what the stage adds."""
    baseline: int
    """The process's resident bytes at the check (CPU; 0 on CUDA, where the device is counted)."""
    limit: int | None
    limit_source: str
    stage_bytes: list[int]
    """Per virtual stage this rank holds (one entry unless the schedule gives it several chunks)."""
    note: str | None = None
    """Why a part is missing from the estimate (the activations of a forward the meta device cannot
    run), or None."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def resident_bytes() -> int:
    """The process's resident memory (VmRSS), 0 where /proc is not there."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cgroup_limit() -> tuple[int | None, str]:
    """The memory cgroup's limit of this process (v2 or v1; the smallest on the way up to the
    hierarchy's root, since a parent's limit binds its children) and the file it came from."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, ""
    v2_root = Path("/sys/fs/cgroup")
    if not (v2_root / "cgroup.controllers").exists():
        v2_root = Path("/sys/fs/cgroup/unified")  # a hybrid layout mounts v2 beside v1
    found: list[tuple[int, str]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, name = v2_root, "memory.max"
        elif "memory" in controllers.split(","):
            root, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        group = root / path.lstrip("/")
        while True:
            try:
                text = (group / name).read_text().strip()
            except OSError:
                text = ""
            if text.isdigit() and int(text) < _UNLIMITED:
                found.append((int(text), str(group / name)))
            if group == root or root not in group.parents:
                break
            group = group.parent
    if not found:
        return None, ""
    return min(found)


def memory_limit(config: VarunaConfig, device: torch.device) -> tuple[int | None, str]:
    """The bytes this rank may use, and where that figure comes from; (None, "") when unknown."""
    if config.planner.memory_limit is not None:
        return parse_memory(config.planner.memory_limit), f"memory_limit={config.planner.memory_limit!r}"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    limit, file = _cgroup_limit()
    return (limit, f"the memory cgroup's limit ({file})") if limit is not None else (None, "")


def _inflight(
    schedule: Mapping[int, Sequence[Action]], stages: int, config: VarunaConfig, rank_of: Callable[[int], int]
) -> list[int]:
    """Per virtual stage, the most micro-batches whose activations it holds at once."""
    e = config.engine
    spec = schedule_spec(e.schedule)
    out = []
    for v in range(stages):
        mine = [a for a in schedule[rank_of(v)] if a.stage == v and a.kind in WORK_KINDS]
        held = peak_inflight(mine)  # type: ignore[arg-type]  # an Action has a Span's kind, stage, micro-batch
        if spec.pull_ahead and not e.uses_recompute:
            held = max(held, min(pull_ahead_room(rank_of(v), e.pipeline), e.num_microbatches))
        out.append(held)
    return out


def rank_estimate(
    model: nn.Module,
    micro: Mapping[str, Any] | None,
    trace: Trace,
    partition: Partition,
    config: VarunaConfig,
    schedule: Mapping[int, Sequence[Action]],
    *,
    chunk_stages: Sequence[int],
    rank_of: Callable[[int], int],
    device: torch.device,
    autocast: Any = None,
    where: str = "this rank",
) -> MemoryEstimate:
    """This rank's expected peak (`MemoryEstimate`) for the partition and schedule chosen."""
    e = config.engine
    per_param = OPTIMIZER_STATE_BYTES[e.optimizer_state]
    sizes = {p.element_size() for p in model.parameters()} or {4}
    opt_bytes = per_param * max(sizes)  # the optimizer's state is in the parameters' dtype
    note = None
    try:
        segs, tied = memory_segments(
            model, micro, trace, optimizer_bytes_per_param=opt_bytes, autocast=autocast
        )
    except MetaForwardError as exc:
        # the state is still known; the activations are not: checked without them, and said so
        segs, tied = memory_segments(model, None, trace, optimizer_bytes_per_param=opt_bytes)
        note = f"activations not counted: the forward does not run on the meta device ({exc})"
        log.warning("varuna: memory check of %s: %s", where, note)
    ranges = [partition.stage_segments(v) for v in range(partition.num_stages)]
    inflight = _inflight(schedule, partition.num_stages, config, rank_of)
    mbs = next(iter(segs[0].activation_memory_bytes))
    per_stage = stage_memory(segs, tied, ranges, mbs, e.uses_recompute, inflight, e.split_backward)
    mine = [per_stage[v] for v in chunk_stages]
    params = grads = optimizer = 0
    for v in chunk_stages:
        for j in ranges[v]:
            params, grads, optimizer = (
                params + segs[j].param_bytes,
                grads + segs[j].grad_bytes,
                optimizer + segs[j].optimizer_bytes,
            )
    held = {n for v in chunk_stages for n in partition.stage_params[v]}
    transient = max(
        (p.numel() * p.element_size() for n, p in model.named_parameters() if n in held and p.requires_grad),
        default=0,
    )
    state = sum(mine)
    limit, source = memory_limit(config, device)
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=max(state - params - grads - optimizer, 0),
        transient=transient,
        working=WORKING_BYTES,
        total=state + transient + WORKING_BYTES,
        baseline=resident_bytes() if device.type == "cpu" else 0,
        limit=limit,
        limit_source=source,
        stage_bytes=mine,
        note=note,
    )


def required(total: int, baseline: int) -> int:
    """The bytes a rank needs for a stage whose estimate is `total`: the baseline, the estimate, and
    `HEADROOM` of the estimate."""
    return baseline + math.ceil(total * (1 + HEADROOM))


def check(estimate: MemoryEstimate, *, where: str, config: VarunaConfig) -> None:
    """MemoryLimitError when the estimate, with the process's baseline and `HEADROOM`, is over the limit."""
    need = required(estimate.total, estimate.baseline)
    if estimate.limit is None or need <= estimate.limit:
        return
    e = config.engine
    hints = [f"more pipeline stages (pipeline={e.pipeline} now; each stage holds fewer layers)"]
    if not e.uses_recompute:
        hints.append("recompute=True (a stage keeps only its input per micro-batch in flight)")
    if e.micro_batch_size > 1:
        hints.append(f"a smaller micro_batch_size ({e.micro_batch_size} now)")
    if e.optimizer_state != "none":
        hints.append(f"an optimizer with less state (optimizer_state={e.optimizer_state!r} counted)")
    raise MemoryLimitError(
        f"{where} would need about {format_bytes(need)} but has {format_bytes(estimate.limit)} "
        f"({estimate.limit_source}): its stage holds {format_bytes(estimate.params)} of parameters, "
        f"{format_bytes(estimate.grads)} of gradients, {format_bytes(estimate.optimizer)} of optimizer state "
        f"and {format_bytes(estimate.activations)} of activations at its peak (and "
        f"{format_bytes(estimate.transient + estimate.working)} of working memory; {HEADROOM:.0%} more kept "
        f"free), on top of {format_bytes(estimate.baseline)} the process holds already. Nothing was "
        "allocated; try "
        + ", or ".join(hints)
        + (
            f". Stages of this rank: {[format_bytes(b) for b in estimate.stage_bytes]}"
            if len(estimate.stage_bytes) > 1
            else ""
        )
        + (f" ({estimate.note})" if estimate.note else "")
    )
