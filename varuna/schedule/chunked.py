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
]

Placement = Literal["loop", "v"]


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


def zb_v_order(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    """ZB-V ("Zero Bubble Pipeline Parallelism", Qi et al., ICLR 2024): two chunks per rank in the V
    placement, every backward split into B (input gradient) and W (weight gradients).

    Made by list scheduling with unit costs (F = B = W = 1, free communication): tick by tick, each
    rank runs the ready B of its deepest chunk first (the previous stage waits for it), else the
    ready F of its deepest chunk while it holds fewer than 2P chunk-activations (1F1B's peak on the
    first rank), else a W (nobody waits for it). The unit-cost timeline is a witness that the lists
    cannot deadlock; `validate` checks it again. Virtual stage 0's backward stays whole (nothing
    waits for its input gradient)."""
    p, m = num_ranks, num_microbatches
    return _list_schedule(p, m, cap=2 * p)[0][rank]


def zb_v_bubble(num_ranks: int, num_microbatches: int) -> float:
    """ZB-V's idle share of a step with unit costs: 1 - 6M / (the unit-cost timeline's length)."""
    span = _list_schedule(num_ranks, num_microbatches, cap=2 * num_ranks)[1]
    return 1 - 6 * num_microbatches / span


def interleaved_bubble(num_ranks: int, num_microbatches: int, chunks: int = 2) -> float:
    """(P-1)/(V*M + P-1): the fill and drain cost (P-1) chunk-steps of F+B, a V-th of 1F1B's."""
    return (num_ranks - 1) / (chunks * num_microbatches + num_ranks - 1)


@functools.lru_cache(maxsize=256)
def _list_schedule(p: int, m: int, cap: int) -> tuple[list[list[Action]], int]:
    n = 2 * p
    owner = [rank_of(v, p, 2, "v") for v in range(n)]
    mine = [sorted((v for v in range(n) if owner[v] == r), reverse=True) for r in range(p)]  # deepest first
    done_at: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> the tick it ends
    next_f, next_b = [0] * n, [0] * n
    pending_w: list[list[int]] = [[] for _ in range(n)]
    held, free_at = [0] * p, [0] * p
    out: list[list[Action]] = [[] for _ in range(p)]
    remaining = 3 * n * m

    def ended(key: tuple[str, int, int], tick: int) -> bool:
        return key in done_at and done_at[key] <= tick

    def pick(r: int, tick: int) -> Action | None:
        for v in mine[r]:  # a B: the previous stage waits for it
            b = next_b[v]
            if b < next_f[v] and ended(("F", v, b), tick) and (v == n - 1 or ended(("B", v + 1, b), tick)):
                return Action(v, "B", b)
        if held[r] < cap:  # an F
            for v in mine[r]:
                f = next_f[v]
                if f < m and (v == 0 or ended(("F", v - 1, f), tick)):
                    return Action(v, "F", f)
        for v in mine[r]:  # a W: nobody waits for it
            if pending_w[v] and ended(("B", v, pending_w[v][0]), tick):
                return Action(v, WEIGHT_KIND, pending_w[v][0])
        return None

    tick = 0
    while remaining:
        for r in range(p):
            a = None if free_at[r] > tick else pick(r, tick)
            if a is None:
                continue
            v, mb = a.stage, a.microbatch
            assert mb is not None
            cost = 2 if a.kind == "B" and v == 0 else 1  # stage 0's backward is whole: W in it
            out[r].append(a)
            done_at[(a.kind, v, mb)] = free_at[r] = tick + cost
            remaining -= cost
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
        tick += 1
        if tick > 10 * (2 * n * m + n):
            raise ScheduleError(f"zb-v: no schedule with at most {cap} activations per rank for P={p}, M={m}")
    return out, max(free_at)
