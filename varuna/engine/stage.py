"""Building this rank's stage from the user's whole model, for `varuna.engine.engine.Varuna`.

In the order `Varuna.__init__` calls them:

    trace(model, micro)               -> Trace, …   one forward: the CutPoints, who uses what, and
                                                    every module's output shapes
    partition(model, trace, ...)      -> Partition  the stage boundaries (timed on rank 0 if balanced)
    strip(model, owned, device, ...)                other stages' parameters become meta tensors, their
                                                    modules return stand-ins
    to_device(model, device)                        what is left moves to the rank's device
    owned_parameters(model)           -> [(name, p)]
    make_groups(config, partition, stage)           the data-parallel and tied-weight groups
    broadcast_initial_values(...)                   replica 0's values, one value per tied weight
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from varuna._files import write_json_atomic
from varuna.comm.links import Link
from varuna.comm.rendezvous import group_timeout
from varuna.cut.cutpoint import CONTAINERS, CutPoint
from varuna.cut.partition import (
    Partition,
    Trace,
    balance,
    balance_ranks,
    canonical_names,
    make_partition,
    profile_segments,
    trace_model,
)
from varuna.cut.standin import SkippedForward, record_outputs
from varuna.engine.config import VarunaConfig
from varuna.engine.materialize import InitFn, check_written, initialize, nonpersistent_buffers
from varuna.schedule import schedule_spec


def trace(model: nn.Module, micro: dict[str, Any] | None) -> tuple[Trace, dict[str, dict[Any, Any]]]:
    """The model's trace on `micro`, and every module's output shapes per input signature
    (`record_outputs`) for the modules this stage will skip; None (pipeline=1 without an example
    batch) traces nothing."""
    if micro is None:
        _, aliases = canonical_names(model)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        return Trace(cut_names=[], param_segments={}, param_aliases=aliases, param_shapes=shapes), {}
    with record_outputs(model) as seen:
        traced = trace_model(model, micro)
    return traced, seen


def partition(
    model: nn.Module,
    trace: Trace,
    micro: dict[str, Any] | None,
    config: VarunaConfig,
    *,
    rank: int,
    world_size: int,
    autocast: Callable[[], AbstractContextManager[object]],
    num_stages: int | None = None,
    owners: Sequence[int] | None = None,
    timed: bool = False,
    measure: bool = True,
) -> Partition:
    """The stages `config.engine.partition` asks for: given boundaries, or balanced by measured costs;
    `num_stages`: the virtual stages (P x chunks per rank; default P), `owners` the rank of each
    (then the ranks' loads are balanced: `balance_ranks`). `timed`: measure the costs with given
    boundaries too (a schedule whose order fits them: `ScheduleSpec.timed_order`). Without `measure`
    (a model on the meta device cannot be timed) 'balanced' and 'fastest' balance parameter counts."""
    num_stages = config.engine.pipeline if num_stages is None else num_stages
    boundaries = None if isinstance(config.engine.partition, str) else list(config.engine.partition)
    costs = None
    balanced = boundaries is None and config.engine.partition in ("balanced", "fastest")
    if measure and (balanced or (timed and boundaries is not None)) and num_stages > 1:
        assert micro is not None  # pipeline > 1 always traces an example micro-batch
        costs = _segment_costs(
            model, micro, trace, config, rank=rank, world_size=world_size, autocast=autocast
        )
        if (
            balanced and owners is not None and len(owners) > config.engine.pipeline
        ):  # several chunks per rank
            boundaries = list(balance_ranks(costs, owners))
        if balanced and config.engine.partition == "fastest":
            from varuna.planner.cuts import fit_boundaries

            e = config.engine
            start = boundaries if boundaries is not None else balance(costs, num_stages)
            boundaries = list(
                fit_boundaries(
                    costs,
                    start,
                    e.schedule,
                    e.pipeline,
                    e.num_microbatches,
                    recompute=e.recompute,
                    split_backward=e.split_backward,
                )
            )
    return make_partition(
        trace,
        num_stages,
        boundaries=boundaries,
        segment_costs=costs,
        shared_weights=config.engine.shared_weights,
    )


def _segment_costs(
    model: nn.Module,
    micro: dict[str, Any],
    trace: Trace,
    config: VarunaConfig,
    *,
    rank: int,
    world_size: int,
    autocast: Callable[[], AbstractContextManager[object]],
) -> list[float]:
    """Measured on rank 0 (cached in the run directory), broadcast so every rank agrees."""
    key_src = json.dumps(
        {
            "params": sorted((n, list(s)) for n, s in trace.param_shapes.items()),
            "cuts": trace.cut_names,
            "batch": {k: list(v.shape) for k, v in micro.items() if isinstance(v, torch.Tensor)},
            "precision": config.engine.precision,
            "threads": torch.get_num_threads(),
        },
        sort_keys=True,
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache = config.run_dir / "cache" / f"segments-{key}.json" if config.run_dir is not None else None
    box: list[Any] = [None]
    if rank == 0:
        if cache is not None and cache.exists():
            box[0] = json.loads(cache.read_text())["costs"]
        else:
            box[0] = profile_segments(model, micro, repeats=config.engine.profile_repeats, autocast=autocast)
            if cache is not None:
                write_json_atomic(cache, {"costs": box[0], "key": json.loads(key_src)})
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return [float(c) for c in box[0]]


def action_costs(partition: Partition, *, whole: bool = True) -> list[tuple[float, ...]] | None:
    """Each virtual stage's (F, B, W) seconds from the profiled segment costs (forward + backward),
    split as the simulator splits them (`StageCost`), and with `whole` the whole backward's (an
    order fitted to them merges back the W's that fill nothing, `EngineConfig.fuse_weights`); None
    without a profile (given boundaries)."""
    from varuna.planner.cuts import stage_costs

    if partition.segment_costs is None:
        return None
    return [
        cost.order_costs(whole=whole) for cost in stage_costs(partition.segment_costs, partition.boundaries)
    ]


def strip(
    model: nn.Module, owned: set[str], device: torch.device, traced: dict[str, dict[Any, Any]] | None = None
) -> None:
    """Replace every parameter this stage does not hold by a meta tensor; skip modules left empty.

    A skipped module returns stand-ins on `device` with its output's shape and dtype
    (`varuna.cut.standin`), so the glue code between modules runs on every stage; `traced` holds the
    output shapes the start-up trace saw per module (see `trace`)."""
    canon, _ = canonical_names(model)
    replaced: dict[int, nn.Parameter] = {}
    kept: set[int] = set()  # the held parameters (on a model built on meta, these are meta too)
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            if canon[id(p)] in owned:
                kept.add(id(p))
                continue
            if id(p) not in replaced:
                replaced[id(p)] = nn.Parameter(
                    torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
                )
            module._parameters[pname] = replaced[id(p)]

    def visit(name: str, module: nn.Module) -> None:
        params = list(module.parameters())
        # A ModuleList is never called itself (the model loops over it): its blocks are the ones skipped.
        if (
            params
            and not any(id(p) in kept for p in params)
            and not isinstance(module, (CutPoint, *CONTAINERS))
        ):
            for sub in module.modules():
                for bname, b in list(sub._buffers.items()):
                    if b is not None:
                        sub._buffers[bname] = torch.empty_like(b, device="meta")
            seen = (traced or {}).get(name)
            module.forward = SkippedForward(module, name, device, seen)  # type: ignore[method-assign]
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}", child)

    for child_name, child in model.named_children():
        visit(child_name, child)


def to_device(model: nn.Module, device: torch.device) -> None:
    """Move the parameters and buffers this stage holds (not the meta ones) to `device`."""
    if device.type == "cpu":
        return
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if not t.is_meta:
                t.data = t.data.to(device)


def owned_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The real (not stripped) parameters, once each, under their first name."""
    out, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or p.is_meta:
            continue
        seen.add(id(p))
        out.append((name, p))
    return out


def initial_weights(
    model: nn.Module,
    fresh: dict[int, str],
    config: VarunaConfig,
    aliases: Mapping[str, Sequence[str]],
    *,
    init: InitFn | None = None,
) -> None:
    """Write this stage's starting values: from `config.checkpoint.weights` (only this stage's
    tensors are read), else, for a model built on the meta device (`fresh`: the tensors
    `materialize` made), the seeded per-module init (`varuna.engine.materialize`). A model built on
    the meta device also recomputes its non-persistent buffers, which no file holds."""
    weights = config.checkpoint.weights
    seed = config.checkpoint.init_seed
    if weights is not None:
        from varuna.checkpoint.weights import WeightsSource, load_stage, match_keys

        source = WeightsSource.open(weights)
        state = model.state_dict(keep_vars=True)
        shapes = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
        mapping = match_keys(source, shapes, aliases)
        targets: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not value.is_meta and id(value) not in seen:
                seen.add(id(value))
                targets[key] = value
        if fresh:
            unfiled_names = nonpersistent_buffers(model)
            unfiled = {id(t) for n, t in model.named_buffers() if n in unfiled_names}
            initialize(model, seed=seed, init=init, only=unfiled & set(fresh))
        with torch.no_grad():
            load_stage(source, {k: mapping[k] for k in targets}, {k: t.data for k, t in targets.items()})
        how = f"weights={weights}"
    elif fresh:
        initialize(model, seed=seed, init=init)
        how = "init=" if init is not None else "the modules' own init"
    else:
        return
    if fresh:
        check_written(model, fresh, how=how)


def make_groups(
    config: VarunaConfig, partition: Partition, stage: int, rank_of: Callable[[int], int] | None = None
) -> tuple[Any, list[tuple[Any, Any, Any]]]:
    """This stage's data-parallel group (None with D=1) and every tied group (group, pg, ranks).

    `stage` is the rank's position in its pipeline; `rank_of` maps a partition's (virtual) stage to
    that position (identity with one chunk per rank). Every rank creates every group, in the same
    order (torch.distributed requires it).
    """
    P, D = config.engine.pipeline, config.engine.data
    where = rank_of or (lambda s: s)
    dp_group = None
    if D > 1:
        for s in range(P):
            group = dist.new_group([r * P + s for r in range(D)], timeout=group_timeout())
            if s == stage:
                dp_group = group
    tied_groups: list[tuple[Any, Any, Any]] = []
    for g in partition.tied:
        positions = list(dict.fromkeys(where(s) for s in g.stages))
        ranks = [r * P + s for r in range(D) for s in positions]
        pg = dist.new_group(ranks, timeout=group_timeout()) if len(ranks) > 1 else None
        tied_groups.append((g, pg, ranks))
    return dp_group, tied_groups


def broadcast_initial_values(
    named: list[tuple[str, nn.Parameter]],
    stage: int,
    dp_group: Any,
    tied_groups: list[tuple[Any, Any, Any]],
    rank_of: Callable[[int], int] | None = None,
) -> None:
    """Replica 0's values everywhere, and one value for every copy of a tied weight."""
    params = dict(named)
    where = rank_of or (lambda s: s)
    with torch.no_grad():
        if dp_group is not None:
            for _, p in named:
                dist.broadcast(p.data, src=stage, group=dp_group)
        for g, pg, _ranks in tied_groups:
            if stage not in {where(s) for s in g.stages}:
                continue
            local = [params[n] for n in g.names if n in params]
            if pg is not None:
                dist.broadcast(local[0].data, src=where(g.stages[0]), group=pg)
            for p in local[1:]:
                p.copy_(local[0])


def pipeline_links(
    config: VarunaConfig,
    schedule: Mapping[int, Sequence[Any]],
    chunk_stages: list[int],
    rank_of: Callable[[int], int],
    *,
    rank: int,
    stage: int,
    replica: int,
    device: torch.device,
) -> tuple[list[tuple[Link | None, Link | None]], Any]:
    """This rank's (up, down) links per chunk (`chunk_links`), and the `Courier` they share where the
    links are serial (NCCL: just-in-time batches on one group per pipeline, `varuna.comm.serial`,
    planned from `schedule`), else None."""
    from varuna.comm.groups import boundary_groups
    from varuna.comm.serial import Courier, plan, replica_group, wanted

    e = config.engine
    spec = schedule_spec(e.schedule)
    n = e.pipeline * spec.chunks_per_rank
    courier, groups = None, None
    if wanted(device, spec.chunks_per_rank, e.schedule):
        group = replica_group(e.pipeline, e.data, replica, device)
        courier = Courier(group, device, plan(schedule, rank_of, stage, rank))
    else:
        groups = boundary_groups(
            e.pipeline, e.data, n, rank_of, position=stage, replica=replica, device=device
        )
    return chunk_links(chunk_stages, n, rank_of, rank, stage, device, groups, courier=courier), courier


def chunk_links(
    stages: list[int],
    num_stages: int,
    rank_of: Callable[[int], int],
    rank: int,
    position: int,
    device: torch.device,
    groups: dict[int, tuple[Any, Any]] | None = None,
    *,
    courier: Any = None,
) -> list[tuple[Link | None, Link | None]]:
    """For each virtual stage this rank holds, its (up, down) links: a `P2P` to the ranks holding the
    neighbouring stages (one per chunk, on tags and `groups` of its own: `varuna.comm.groups`), or a
    `LocalLink` where the neighbour is a chunk of this rank. With one chunk per rank: one P2P. With a
    `courier` (`varuna.comm.serial`), `SerialLink`s through it instead of P2Ps."""
    from varuna.comm.local import LocalLink
    from varuna.comm.p2p import P2P
    from varuna.comm.serial import SerialLink

    groups = groups or {}

    def make(prev: int | None, nxt: int | None, device: torch.device, stage: int, **kw: Any) -> Link:
        if courier is not None:  # `varuna.comm.serial`: every link of this rank through one courier
            return SerialLink(prev, nxt, device, courier, stage)
        return P2P(prev, nxt, device, **kw)

    def global_rank(v: int) -> int:
        return rank - position + rank_of(v)

    if len(stages) == 1:
        v = stages[0]
        p2p = make(
            global_rank(v - 1) if v > 0 else None,
            global_rank(v + 1) if v < num_stages - 1 else None,
            device,
            v,
            up=groups.get(v - 1),
            down=groups.get(v),
        )
        return [(p2p, p2p)]
    local = {v: LocalLink(v) for v in stages if v > 0 and v - 1 in stages}  # by receiving stage
    out = []
    for v in stages:
        prev = None if v == 0 or v in local else global_rank(v - 1)
        nxt = None if v == num_stages - 1 or v + 1 in local else global_rank(v + 1)
        link: Link | None = (
            make(prev, nxt, device, v, tags=(v, v + 1), up=groups.get(v - 1), down=groups.get(v))
            if prev is not None or nxt is not None
            else None
        )
        out.append((local.get(v, link), local.get(v + 1, link)))
    return out
