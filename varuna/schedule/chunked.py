"""Schedules whose ranks hold several model chunks (virtual stages): where each chunk sits, and the
orders of `interleaved-1f1b` and `zb-v`.

With P ranks and V chunks per rank the model is cut into P*V virtual stages, numbered in the order
the data flows through them. An action names its virtual stage; a rank's list holds the actions of
all its chunks, in the order the rank runs them.

    placement "loop" (interleaved): virtual stage v on rank v % P          P=2, V=2: rank 0 holds 0, 2
    placement "v"    (zb-v):        v < P on rank v, v >= P on 2P-1-v      P=2, V=2: rank 0 holds 0, 3

In the V shape the first rank holds the first and the last chunk (embedding and head: a tied weight
stays on one rank), and the middle of the pipeline turns on the last rank without leaving it.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Literal

from varuna.errors import ScheduleError
from varuna.schedule.actions import WEIGHT_KIND, Action

__all__ = [
    "Placement",
    "rank_of",
    "stages_of",
    "interleaved_order",
    "interleaved_bubble",
    "zb_v_order",
    "zb_v_bubble",
    "checked_costs",
    "order_span",
    "fuse_weights",
]

Placement = Literal["loop", "v"]
_FUSE_BUDGET = 250_000
"""`fuse_weights` tries each W where W's x actions stay under this (P = 2, M = 8: 24 x 100)."""
_NEAR = 1.03
"""`_best_timed` fuses the orders whose span with every W is within this factor of the shortest."""
Costs = tuple[float, ...]
"""One virtual stage's seconds per micro-batch: F, the input half B of its backward, W, and
optionally the whole backward (B and W in one pass; without it, B + W: a split that costs nothing)."""


def rank_of(stage: int, num_ranks: int, chunks: int, placement: Placement = "loop") -> int:
    """The rank that holds virtual stage `stage` of `num_ranks * chunks`."""
    if not 0 <= stage < num_ranks * chunks:
        raise ScheduleError(
            f"virtual stage {stage} does not exist: {num_ranks} ranks x {chunks} chunks have stages "
            f"0..{num_ranks * chunks - 1}"
        )
    if chunks == 1:
        return stage
    if placement == "v":
        if chunks != 2:
            raise ScheduleError(f"the V placement holds 2 chunks per rank, not {chunks}")
        return stage if stage < num_ranks else 2 * num_ranks - 1 - stage
    return stage % num_ranks


def stages_of(rank: int, num_ranks: int, chunks: int, placement: Placement = "loop") -> list[int]:
    """The virtual stages rank `rank` holds, in data-flow order (its chunk 0 first)."""
    return [v for v in range(num_ranks * chunks) if rank_of(v, num_ranks, chunks, placement) == rank]


def interleaved_order(rank: int, num_ranks: int, num_microbatches: int, chunks: int = 2) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al., SC'21, as in Megatron-LM): micro-batches go through a
    rank's chunks in rounds of P; the warm-up runs 2(P-1-r) + (V-1)P forwards, then one forward
    and one backward alternate, backwards visiting the chunks in reverse. The bubble shrinks by V:
    (P-1)/(V*M + P-1). M must be a multiple of P (the rounds)."""
    p, m, v = num_ranks, num_microbatches, chunks
    if m % p:
        raise ScheduleError(
            f"interleaved-1f1b runs micro-batches in rounds of P={p}: the number of micro-batches must be a "
            f"multiple of {p} (given {m}); choose global_batch_size / (data x micro_batch_size) divisible by {p}"
        )
    total = m * v

    def forward(k: int) -> Action:
        chunk = (k // p) % v
        return Action(chunk * p + rank, "F", (k // (p * v)) * p + k % p)

    def backward(k: int) -> Action:
        chunk = v - 1 - (k // p) % v
        return Action(chunk * p + rank, "B", (k // (p * v)) * p + k % p)

    warmup = total if m == p else min(2 * (p - 1 - rank) + (v - 1) * p, total)
    actions = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [forward(warmup + k), backward(k)]
    actions += [backward(k) for k in range(total - warmup, total)]
    return actions


def zb_v_order(
    rank: int, num_ranks: int, num_microbatches: int, costs: Sequence[Costs] | None = None
) -> list[Action]:
    """ZB-V ("Zero Bubble Pipeline Parallelism", Qi et al., ICLR 2024): two chunks per rank in the V
    placement, every backward split into B (input gradient) and W (weight gradients); with `costs`
    that give a whole backward, the W's whose deferral shortens nothing run inside their B again
    (`fuse_weights`).

    Made by list scheduling: each time a rank is free, it runs the ready B of its deepest chunk first
    (the previous stage waits for it), else the ready F of its deepest chunk while it holds fewer
    than 2P chunk-activations (1F1B's peak on the first rank), else a W (nobody waits for it); or,
    the second priority, a ready W before that F (a W right after its B, as in ZB-V's steady state:
    the W's do not pile up at the end). The shorter timeline of the two wins (with `costs`, of each
    activation reserve too, and of the paper's fixed order timed on them, `_paper_order`): neither
    rule is shortest everywhere (at P = 4, M = 8 on unit costs the W-first order idles less), and on
    a real model's chunk costs the paper's order can beat both. Without `costs` every action costs
    one tick and communication is free; the timeline is a witness that the lists cannot deadlock,
    and `validate` checks them again. With `costs` (per
    virtual stage: the seconds of F, of the input half B and of W) the same rules run on those times:
    where the chunks differ (a light embedding chunk beside the head's, both on rank 0) the
    unit-cost order leaves the first rank waiting, 16% of a P=2, M=8 step with chunks of 0.6, 1, 1
    and 1.4, and the timed one about 1% (`tests/unit/test_zb_v_costs.py`). If the timed rules find
    no order within 2P activations, the unit-cost one is used. Virtual stage 0's backward stays
    whole (nothing waits for its input gradient)."""
    p, m = num_ranks, num_microbatches
    if costs is not None:
        timed = _best_timed(p, m, checked_costs(costs, 2 * p))
        if timed is not None:
            return timed[rank]
    return _list_schedule(p, m, cap=2 * p)[0][rank]


def zb_v_bubble(num_ranks: int, num_microbatches: int) -> float:
    """ZB-V's idle share of a step with unit costs: 1 - 6M / (the unit-cost timeline's length)."""
    span = _list_schedule(num_ranks, num_microbatches, cap=2 * num_ranks)[1]
    return 1 - 6 * num_microbatches / span


def interleaved_bubble(num_ranks: int, num_microbatches: int, chunks: int = 2) -> float:
    """(P-1)/(V*M + P-1): the fill and drain cost (P-1) chunk-steps of F+B, a V-th of 1F1B's."""
    return (num_ranks - 1) / (chunks * num_microbatches + num_ranks - 1)


@functools.lru_cache(maxsize=256)
def _list_schedule(p: int, m: int, cap: int) -> tuple[list[list[Action]], float]:
    """The unit-cost order (F = B = W = 1: stage 0's whole backward 2) and its length: the shorter
    of the two priorities (a ready W before or after the next F)."""
    unit = ((1.0, 1.0, 1.0, 2.0),) * (2 * p)
    done = [f for f in (_timed_list_schedule(p, m, cap, unit, 0, w) for w in (False, True)) if f is not None]
    found = min(done, key=lambda f: f[1]) if done else None
    if found is None:
        raise ScheduleError(f"zb-v: no schedule with at most {cap} activations per rank for P={p}, M={m}")
    return found


def checked_costs(costs: Sequence[Costs], n: int) -> tuple[Costs, ...]:
    """(F, B, W, whole backward) per virtual stage, the whole B + W where not given."""
    if len(costs) != n or any(len(c) not in (3, 4) for c in costs) or any(x <= 0 for c in costs for x in c):
        raise ScheduleError(
            f"schedule costs need {n} (F, B, W) or (F, B, W, whole backward) tuples of positive seconds (one per "
            f"virtual stage), got {list(costs)}"
        )
    return tuple(
        (float(c[0]), float(c[1]), float(c[2]), float(c[3] if len(c) == 4 else c[1] + c[2])) for c in costs
    )


@functools.lru_cache(maxsize=64)
def _best_timed(p: int, m: int, costs: tuple[Costs, ...]) -> list[list[Action]] | None:
    """The shortest of the timed orders that keep `reserve` = 0..P of a rank's 2P activation slots
    for its deeper chunk (a first chunk filling them all can starve the deep one: no order), with a
    ready W after or before the next F, and of the paper's fixed order timed on the same costs;
    each with its W's fused where they fill nothing (`fuse_weights`) before they are compared, since
    two orders equally long with every W can differ once fused. Only orders within `_NEAR` of the
    shortest unfused one are fused (fusing takes a few percent off an order, so one further behind
    stays behind), and only the shortest where fusing them all would time more than `_FUSE_BUDGET`
    actions (the planner at scale)."""
    found = [
        _timed_list_schedule(p, m, 2 * p, costs, reserve, w_first)
        for w_first in (False, True)
        for reserve in range(p + 1)
    ]
    if m >= 2 * p - 1:
        fixed = [_paper_order(r, p, m) for r in range(p)]
        span = _span(fixed, costs)
        found.append(None if span is None else (fixed, span))
    done = sorted((f for f in found if f is not None), key=lambda f: f[1])
    if not done:
        return None
    near = [lists for lists, span in done if span <= done[0][1] * _NEAR]
    if _fuse_work(near[0]) * len(near) > _FUSE_BUDGET:
        near = near[:1]  # as many orders as `fuse_weights` would try for one
    timed = [(lists, _span(lists, costs)) for lists in (fuse_weights(x, costs) for x in near)]
    return min(timed, key=lambda f: math.inf if f[1] is None else f[1])[0]


def _fuse_work(lists: list[list[Action]]) -> int:
    """W's x actions: how many actions `fuse_weights` times for `lists` at most."""
    return sum(a.kind == WEIGHT_KIND for actions in lists for a in actions) * sum(map(len, lists))


def fuse_weights(lists: list[list[Action]], costs: tuple[Costs, ...]) -> list[list[Action]]:
    """`lists` (one per rank; `costs` from `checked_costs`) with each W whose deferral shortens nothing merged back into its B: that backward
    then runs whole, one pass, where the split's two cost more (a split backward walks part of the
    graph twice, so B + W exceeds the whole backward). Greedy, rank by rank in list order: a W goes
    where the lists without it take no longer on `costs`; nothing goes where a split costs nothing, nor where
    the lists are so long that trying each W would take seconds (W's x actions > `_FUSE_BUDGET`:
    the planner prices such shapes with every W split)."""
    out = [list(x) for x in lists]
    span = _span(out, costs)
    if span is None or all(whole >= b + w for _, b, w, whole in costs) or _fuse_work(out) > _FUSE_BUDGET:
        return out
    for r, actions in enumerate(out):
        i = 0
        while i < len(actions):
            a = actions[i]
            f, b, w, whole = costs[a.stage]
            if a.kind == WEIGHT_KIND and whole < b + w:
                trial = actions[:i] + actions[i + 1 :]
                took = _span([*out[:r], trial, *out[r + 1 :]], costs, limit=span)
                if took is not None and took <= span:
                    out[r] = actions = trial
                    span = took
                    continue
            i += 1
    return out


def _paper_order(r: int, p: int, m: int) -> list[Action]:
    """ZB-V's fixed order for rank r as the paper draws it (M >= 2P - 1), with the rank's shallow
    chunk a = r and deep chunk d = 2P - 1 - r: warm-up 2(P - r) - 1 forwards of a, then r pairs
    F d, F a, then P - r rounds F d, B d, W d; the steady state repeats F a (while any is left),
    B a, W a, F d, B d, W d; the cool-down r pairs B a, B d, then P - r pairs B a, W a, then the
    W's left, d's first. W's of virtual stage 0 stay in its B."""
    a, d = r, 2 * p - 1 - r
    out: list[Action] = []
    count = {("F", a): 0, ("F", d): 0, ("B", a): 0, ("B", d): 0, ("W", a): 0, ("W", d): 0}

    def add(*steps: tuple[str, int]) -> None:
        for kind, v in steps:
            out.append(Action(v, kind, count[(kind, v)]))
            count[(kind, v)] += 1

    for _ in range(2 * (p - r) - 1):
        add(("F", a))
    for _ in range(r):
        add(("F", d), ("F", a))
    for _ in range(p - r):
        add(("F", d), ("B", d), ("W", d))
    while count[("F", a)] < m or count[("F", d)] < count[("F", a)]:
        if count[("F", a)] < m:
            add(("F", a))
        add(("B", a), ("W", a), ("F", d), ("B", d), ("W", d))
    for _ in range(r):
        add(("B", a), ("B", d))
    for _ in range(p - r):
        add(("B", a), ("W", a))
    for v in (d, a):
        while count[("W", v)] < count[("B", v)]:
            add(("W", v))
    return [x for x in out if not (x.kind == WEIGHT_KIND and x.stage == 0)]


def _seconds(costs: tuple[Costs, ...], a: Action, split: bool) -> float:
    """An action's seconds on `costs`: a B is its input half where `split` (its W runs later), else
    the whole backward (virtual stage 0's always)."""
    f, b, w, whole = costs[a.stage]
    if a.kind == "F":
        return f
    if a.kind == "B":
        return b if split else whole
    return w


def order_span(schedule: Mapping[int, Sequence[Action]], costs: Sequence[Costs]) -> float | None:
    """How long `schedule` (each rank's actions, by rank; messages and all-reduces are free) takes
    on `costs` (per virtual stage: F, split B, W and the whole backward, as `checked_costs` takes
    them); None where it deadlocks or recomputes (R)."""
    lists = [[a for a in schedule[r] if a.kind in ("F", "B", "R", WEIGHT_KIND)] for r in sorted(schedule)]
    if any(a.kind == "R" for actions in lists for a in actions):
        return None
    return _span(lists, checked_costs(costs, len(costs)))


def _span(lists: list[list[Action]], costs: tuple[Costs, ...], limit: float | None = None) -> float | None:
    """How long the ranks take to run the given lists in order on `costs` (free messages, as
    `_timed_list_schedule` times them); None if they deadlock, or once an action ends after `limit`."""
    n = len(costs)
    split = {(a.stage, a.microbatch) for actions in lists for a in actions if a.kind == WEIGHT_KIND}
    done_at: dict[tuple[str, int, int], float] = {}
    heads, free_at = [0] * len(lists), [0.0] * len(lists)
    moved = True
    while moved:
        moved = False
        for r, actions in enumerate(lists):
            while heads[r] < len(actions):
                a = actions[heads[r]]
                v, mb = a.stage, a.microbatch
                assert mb is not None
                if a.kind == "F":
                    needs = [("F", v - 1, mb)] if v > 0 else []
                elif a.kind == "B":
                    needs = [("F", v, mb)] + ([("B", v + 1, mb)] if v < n - 1 else [])
                else:
                    needs = [("B", v, mb)]
                if any(k not in done_at for k in needs):
                    break
                start = max([free_at[r], *(done_at[k] for k in needs)])
                done_at[(a.kind, v, mb)] = free_at[r] = end = start + _seconds(costs, a, (v, mb) in split)
                if limit is not None and end > limit:
                    return None
                heads[r] += 1
                moved = True
    return max(free_at) if all(h == len(x) for h, x in zip(heads, lists)) else None


def _timed_list_schedule(
    p: int, m: int, cap: int, costs: tuple[Costs, ...], reserve: int, w_first: bool = False
) -> tuple[list[list[Action]], float] | None:
    """`_list_schedule`'s rules on the given times, a shallow chunk's F only while the rank holds
    fewer than `cap - reserve` activations; (lists, step length), or None if they get stuck."""
    n = 2 * p
    owner = [rank_of(v, p, 2, "v") for v in range(n)]
    mine = [sorted((v for v in range(n) if owner[v] == r), reverse=True) for r in range(p)]
    done_at: dict[tuple[str, int, int], float] = {}
    next_f, next_b = [0] * n, [0] * n
    pending_w: list[list[int]] = [[] for _ in range(n)]
    held, free_at = [0] * p, [0.0] * p
    out: list[list[Action]] = [[] for _ in range(p)]
    left = 3 * n * m - m  # stage 0's backward is one action

    def ended(key: tuple[str, int, int], t: float) -> bool:
        return key in done_at and done_at[key] <= t

    def pick(r: int, t: float) -> Action | None:
        for v in mine[r]:
            b = next_b[v]
            if b < next_f[v] and ended(("F", v, b), t) and (v == n - 1 or ended(("B", v + 1, b), t)):
                return Action(v, "B", b)
        weights = [
            Action(v, WEIGHT_KIND, pending_w[v][0])
            for v in mine[r]
            if pending_w[v] and ended(("B", v, pending_w[v][0]), t)
        ]
        if w_first and weights:
            return weights[0]
        for v in mine[r]:
            f = next_f[v]
            if held[r] < cap - (reserve if v < p else 0) and f < m and (v == 0 or ended(("F", v - 1, f), t)):
                return Action(v, "F", f)
        return weights[0] if weights else None

    events, now = [0.0], 0.0  # start times never go back: nothing new is ready before the last one
    while left:
        started = None
        while events and started is None:
            t = events[0]
            if t >= now:
                for r in range(p):
                    if free_at[r] <= t and (a := pick(r, t)) is not None:
                        started = (r, t, a)
                        break
            if started is None:
                heapq.heappop(events)
        if started is None:
            return None
        r, t, a = started
        v, mb = a.stage, a.microbatch
        assert mb is not None
        out[r].append(a)
        cost = _seconds(costs, a, v > 0)
        done_at[(a.kind, v, mb)] = free_at[r] = t + cost
        heapq.heappush(events, t + cost)
        now = t
        left -= 1
        if a.kind == "F":
            next_f[v] += 1
            held[r] += 1
        elif a.kind == "B":
            next_b[v] += 1
            if v == 0:
                held[r] -= 1
            else:
                pending_w[v].append(mb)
        else:
            pending_w[v].pop(0)
            held[r] -= 1
    return out, max(free_at)
