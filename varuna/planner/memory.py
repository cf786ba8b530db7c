"""Memory for the planner: sizes as people write them ("16GiB") and the per-stage estimate.

`parse_memory` and `format_bytes` read and print byte counts (`varuna.planner.search` re-exports both);
`stage_memory` is the per-stage peak of the model in `varuna.planner.search`'s module docstring,
shared by the planner and the engine's pre-flight check.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from varuna.errors import PlanError
from varuna.planner.costs import SegmentCost

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_memory(text: str | int) -> int:
    """Bytes in a size like "16GiB", "80 GB", "512MiB" or a plain number of bytes.

    >>> parse_memory("16GiB")
    17179869184
    """

    if isinstance(text, int):
        value = text
    else:
        match = _MEMORY_RE.match(text)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS and unit not in ("", "k", "m", "g", "t"):
            raise PlanError(
                f"cannot read the memory size {text!r}: give a number and a unit, e.g. 16GiB, 80GB or "
                "512MiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; K, M, G, T mean KiB ... TiB)"
            )
        unit = {"": "b", "k": "kib", "m": "mib", "g": "gib", "t": "tib"}.get(unit, unit)
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise PlanError(f"the memory limit must be more than 0 bytes, got {text!r}; pass e.g. --memory 16GiB")
    return value


def format_bytes(n: float) -> str:
    """A byte count for people: "17.2 GiB", "512.0 MiB", "80 B"."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def stage_memory(
    segs: Sequence[SegmentCost],
    tied_bytes: int,
    stages: list[range],
    mbs: int,
    recompute: bool,
    inflight: list[int],
    split_backward: bool = False,
) -> list[int]:
    """Bytes per stage: weights, gradients, optimizer state and the activations the schedule holds
    at its peak (`inflight` micro-batches). A split backward (`split_backwards`, stages after the
    first) also keeps, from its input half to its weight half, the gradient at each node next to a
    weight: counted as one more micro-batch of that stage's activations (less in practice).

    The planner prices its candidates with it (`segs` from the profile) and the engine checks a
    shape against the memory it has before allocating anything (`segs` from a forward on the meta
    device, `varuna.profile.memory`)."""
    total_params = sum(s.param_bytes for s in segs)
    state_per_param = sum(s.param_bytes + s.grad_bytes + s.optimizer_bytes for s in segs) / max(
        total_params, 1
    )
    out = []
    for s, r in enumerate(stages):
        static = sum(segs[j].param_bytes + segs[j].grad_bytes + segs[j].optimizer_bytes for j in r)
        if s == len(stages) - 1 and s > 0:
            static += int(tied_bytes * state_per_param)  # the last stage's copy of the tied weights
        full = sum(segs[j].activation_memory_bytes[mbs] for j in r)
        if recompute and s < len(stages) - 1:
            held_input = segs[r[0] - 1].activation_bytes[mbs] if s > 0 else 0
            activations = inflight[s] * held_input + full
        else:
            activations = inflight[s] * full
        if split_backward and s > 0:
            activations += full
        out.append(static + activations)
    return out
