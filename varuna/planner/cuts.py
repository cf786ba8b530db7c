"""Stage boundaries fitted to a schedule: balanced costs, then each boundary moved while the
simulated step gets shorter (`partition="fastest"`).

Balanced stages are the best cut for a schedule whose stages all wait alike, not for every
schedule. Under ZB-H1 the last stages fill their drain with weight halves (W) and the first stage's
backward has no input gradient to wait for, so the first stage may take a little more than its
share; under 1F1B the drain is a chain of whole backwards, and balance is the best. The simulator
(`varuna.planner.simulator`) times exactly the lists the engine runs, so the fitted cut is the
one it predicts fastest for this schedule, these costs and this number of micro-batches.

    fit_boundaries(costs, (8,), "zb-h1", 2, 8)     # the fitted boundaries, e.g. (9,)
"""

from __future__ import annotations

from collections.abc import Sequence

from varuna.errors import PartitionError
from varuna.planner.simulator import StageCost, simulate
from varuna.schedule import ScheduleName, schedule_spec

__all__ = ["fit_boundaries", "simulated_step", "stage_costs"]

MIN_GAIN = 1e-3
"""A move is taken only if it shortens the simulated step by this share (profile noise is larger
than the differences below it)."""


def stage_costs(segment_costs: Sequence[float], boundaries: Sequence[int]) -> list[StageCost]:
    """Each stage's cost per micro-batch when the profiled segments (each one's forward + backward
    seconds) are cut at `boundaries`: a third of it forward, the rest backward (at least 1 ns)."""
    edges = [-1, *boundaries, len(segment_costs) - 1]
    costs = [max(sum(segment_costs[a + 1 : b + 1]), 1e-9) for a, b in zip(edges, edges[1:])]
    return [StageCost(forward_s=c / 3, backward_s=2 * c / 3) for c in costs]


def simulated_step(
    segment_costs: Sequence[float],
    boundaries: Sequence[int],
    schedule: ScheduleName,
    num_ranks: int,
    num_microbatches: int,
    *,
    recompute: bool | None = None,
    split_backward: bool = True,
) -> float:
    """The simulator's step seconds of `schedule` with stages cut at `boundaries` from the profiled
    `segment_costs` (each segment's forward + backward); P x chunks-per-rank stages."""
    return simulate(
        schedule,
        num_ranks,
        num_microbatches,
        stage_costs(segment_costs, boundaries),
        recompute=recompute,
        split_backward=split_backward,
    ).step_s


def fit_boundaries(
    segment_costs: Sequence[float],
    boundaries: Sequence[int],
    schedule: ScheduleName,
    num_ranks: int,
    num_microbatches: int,
    *,
    recompute: bool | None = None,
    split_backward: bool = True,
    max_moves: int = 16,
) -> tuple[int, ...]:
    """`boundaries` (balanced, say) with single boundaries moved by one segment, the best move
    each round, while the simulated step gets shorter by at least `MIN_GAIN`; at most `max_moves`
    moves. Every stage keeps at least one segment. Deterministic: every rank that fits the same
    costs gets the same cut."""
    spec = schedule_spec(schedule)
    stages = num_ranks * spec.chunks_per_rank
    n = len(segment_costs)
    if len(boundaries) != stages - 1:
        raise PartitionError(
            f"fit_boundaries got {len(boundaries)} boundaries for {stages} stages ({schedule} at P={num_ranks}); "
            f"give {stages - 1}"
        )
    if list(boundaries) != sorted(set(boundaries)) or (
        boundaries and not 0 <= boundaries[0] <= boundaries[-1] < n - 1
    ):
        raise PartitionError(
            f"fit_boundaries: boundaries {list(boundaries)} must rise strictly within [0, {n - 2}] "
            f"({n} segments)"
        )

    def step(cut: Sequence[int]) -> float:
        return simulated_step(
            segment_costs,
            cut,
            schedule,
            num_ranks,
            num_microbatches,
            recompute=recompute,
            split_backward=split_backward,
        )

    best, best_s = tuple(boundaries), step(boundaries)
    for _ in range(max_moves):
        moves: list[tuple[float, tuple[int, ...]]] = []
        for i in range(len(best)):
            for d in (-1, 1):
                moved = list(best)
                moved[i] += d
                low = moved[i - 1] if i > 0 else -1
                high = moved[i + 1] if i + 1 < len(moved) else n - 1
                if low < moved[i] < high:
                    moves.append((step(moved), tuple(moved)))
        if not moves:
            break
        s, cut = min(moves)
        if s > best_s * (1 - MIN_GAIN):
            break
        best, best_s = cut, s
    return best
