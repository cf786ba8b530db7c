"""The cost table: what the profiler measured, and all the planner reads.

Measurement is separate from decision: `varuna profile` fills a `CostTable` and saves it as JSON in
the run directory; `varuna.planner.search` and the simulator are pure functions of it. Costs are per *segment*
(the code between two CutPoints) and per micro-batch size, so the planner can try any partition:

    segments:  [0] c0 [1] c1 [2] c2 [3]        SegmentCost j: forward/backward seconds of [j],
                                               bytes of the value it hands to cut c_j, memory

    table = CostTable.load("runs/gpt/profile.json")
    table.segments[0].forward_s[4]              # seconds for a micro-batch of 4
    table.network.allreduce_time(2**20, 4)      # 1 MiB over 4 replicas, interpolated
    table.slowdown(4)                           # compute time with 4 ranks busy on one host / alone

The JSON form (`to_json`) is a plain dict; integer keys (micro-batch sizes, group sizes) become
strings, as JSON requires, and `from_json` turns them back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from varuna._files import write_json_atomic
from varuna.cut.signature import model_signature
from varuna.errors import ConfigError
from varuna.planner._json import check_per_size, int_keys, required_field
from varuna.planner.network import NetworkCost, slowdown_of

__all__ = [
    "SegmentCost",
    "NetworkCost",
    "CostTable",
    "model_signature",
    "FORMAT_VERSION",
    "STEP_ALLREDUCE_BYTES",
]

FORMAT_VERSION = 1
STEP_ALLREDUCE_BYTES = 64
"""The engine's one small all-reduce per step (loss, gradient norm, stop and checkpoint flags)."""


@dataclass(kw_only=True, slots=True)
class SegmentCost:
    """Measured costs of one segment, per micro-batch size."""

    forward_s: dict[int, float]
    """Micro-batch size -> seconds of the forward pass."""
    backward_s: dict[int, float]
    """Micro-batch size -> seconds of the backward pass."""
    activation_bytes: dict[int, int]
    """Micro-batch size -> bytes of the value leaving this segment at its cut (0 for the last segment)."""
    activation_memory_bytes: dict[int, int]
    """Micro-batch size -> bytes of activations the segment holds for its backward, per micro-batch."""
    param_bytes: int
    """Bytes of the parameters this segment uses (a tied weight counted once, in its first segment)."""
    grad_bytes: int
    """Bytes of their gradients (also what the data-parallel all-reduce moves)."""
    optimizer_bytes: int
    """Bytes of optimizer state for them (e.g. 2 x param_bytes for Adam in fp32)."""
    recompute_s: dict[int, float] | None = None
    """Micro-batch size -> seconds of a recomputed forward; None means the same as `forward_s`."""
    nograd_forward_s: dict[int, float] | None = None
    """Micro-batch size -> seconds of a forward under `torch.no_grad()` (a recomputing stage's first
    forward: it builds no graph and keeps nothing); None means the same as `forward_s`."""
    update_s: float = 0.0
    """Seconds of the once-per-step parameter update of this segment's parameters: the gradient
    norm and an AdamW step (the profile assumes Adam, as `optimizer_bytes` does); 0 if unmeasured."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.update_s) or self.update_s < 0:
            raise ConfigError(f"SegmentCost.update_s = {self.update_s!r}; it must be a finite number >= 0")
        sizes = set(self.forward_s)
        for name in (
            "forward_s",
            "backward_s",
            "activation_bytes",
            "activation_memory_bytes",
            "recompute_s",
            "nograd_forward_s",
        ):
            table = getattr(self, name)
            if table is None:
                continue
            check_per_size(table, f"SegmentCost.{name}")
            if set(table) != sizes:
                raise ConfigError(
                    f"SegmentCost.{name} has micro-batch sizes {sorted(table)} but forward_s has "
                    f"{sorted(sizes)}; every per-size table must cover the same sizes"
                )
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"SegmentCost.{name} = {getattr(self, name)}; bytes cannot be negative")

    def recompute_at(self, mbs: int) -> float:
        """Seconds to recompute the forward of one micro-batch of size `mbs`."""
        return (self.recompute_s or self.forward_s)[mbs]

    def nograd_forward_at(self, mbs: int) -> float:
        """Seconds of a forward of one micro-batch of size `mbs` that keeps nothing for a backward."""
        return (self.nograd_forward_s or self.forward_s)[mbs]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (integer keys as strings)."""

        def keyed(table: Mapping[int, float] | None) -> dict[str, float] | None:
            return None if table is None else {str(k): v for k, v in sorted(table.items())}

        return {
            "forward_s": keyed(self.forward_s),
            "backward_s": keyed(self.backward_s),
            "recompute_s": keyed(self.recompute_s),
            "nograd_forward_s": keyed(self.nograd_forward_s),
            "activation_bytes": keyed(self.activation_bytes),
            "activation_memory_bytes": keyed(self.activation_memory_bytes),
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "update_s": self.update_s,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SegmentCost:
        """Inverse of `to_json`."""
        what = "a segment of the profile"
        recompute, nograd = data.get("recompute_s"), data.get("nograd_forward_s")
        return cls(
            forward_s={
                k: float(v) for k, v in int_keys(required_field(data, "forward_s", what), "forward_s").items()
            },
            backward_s={
                k: float(v)
                for k, v in int_keys(required_field(data, "backward_s", what), "backward_s").items()
            },
            recompute_s=None
            if recompute is None
            else {k: float(v) for k, v in int_keys(recompute, "recompute_s").items()},
            nograd_forward_s=None
            if nograd is None
            else {k: float(v) for k, v in int_keys(nograd, "nograd_forward_s").items()},
            activation_bytes={
                k: int(v)
                for k, v in int_keys(
                    required_field(data, "activation_bytes", what), "activation_bytes"
                ).items()
            },
            activation_memory_bytes={
                k: int(v)
                for k, v in int_keys(
                    required_field(data, "activation_memory_bytes", what), "activation_memory_bytes"
                ).items()
            },
            param_bytes=int(required_field(data, "param_bytes", what)),
            grad_bytes=int(required_field(data, "grad_bytes", what)),
            optimizer_bytes=int(required_field(data, "optimizer_bytes", what)),
            update_s=float(data.get("update_s", 0.0)),
        )


@dataclass(kw_only=True, slots=True)
class CostTable:
    """Everything the planner needs about one model on one kind of device."""

    model_signature: str
    """`model_signature(model)` of the profiled model; the planner refuses a table of another model."""
    segments: list[SegmentCost]
    """One entry per segment, in order (K CutPoints give K+1 segments)."""
    network: NetworkCost
    """Point-to-point and all-reduce costs."""
    micro_batch_sizes: list[int]
    """The micro-batch sizes profiled; every segment has costs for each."""
    device: str = "cpu"
    """Where it was measured, e.g. "cpu" or "cuda:NVIDIA H100"."""
    precision: str = "fp32"
    """The engine precision profiled: "fp32", "bf16" or "fp16"."""
    created: float = 0.0
    """Unix time of the measurement."""
    tied_bytes: int = 0
    """Bytes of weights tied across the first and last stage, summed between them every step."""
    compute_slowdown: dict[int, float] = field(default_factory=dict)
    """n -> a rank's compute time while n ranks of the job compute at once, over its time alone
    (measured by the profile on its host; {} means each rank has a device of its own). On a CPU
    host with fewer cores than ranks this is about n / cores: the planner shares the cores among
    the busy stages (`varuna.planner.simulator.Sharing`)."""
    action_overhead_s: float = 0.0
    """Seconds each compute action (F, B, R) of a pipelined stage (P > 1) takes beyond its segments'
    profiled compute: what the runtime does per action, per message and per step that the other
    terms miss (entering the model once per stage, the transport's threads under load, the step's
    bookkeeping), fitted by the profile from a short pipeline of exactly known compute run with
    the real runtime (`varuna.profile.calibrate`). 0 when unmeasured."""

    def __post_init__(self) -> None:
        if not self.segments:
            raise ConfigError("CostTable.segments is empty; a profile needs at least one segment")
        if not self.micro_batch_sizes or any(m < 1 for m in self.micro_batch_sizes):
            raise ConfigError(
                f"CostTable.micro_batch_sizes = {self.micro_batch_sizes}; give one or more sizes >= 1"
            )
        if len(set(self.micro_batch_sizes)) != len(self.micro_batch_sizes):
            raise ConfigError(f"CostTable.micro_batch_sizes = {self.micro_batch_sizes} repeats a size")
        self.micro_batch_sizes = sorted(self.micro_batch_sizes)
        for j, seg in enumerate(self.segments):
            missing = sorted(set(self.micro_batch_sizes) - set(seg.forward_s))
            if missing:
                raise ConfigError(
                    f"segment {j} has no costs for micro-batch sizes {missing} (it has "
                    f"{sorted(seg.forward_s)}); re-profile, or drop them from micro_batch_sizes"
                )
        if self.tied_bytes < 0:
            raise ConfigError(f"CostTable.tied_bytes = {self.tied_bytes}; bytes cannot be negative")
        if not math.isfinite(self.action_overhead_s) or self.action_overhead_s < 0:
            raise ConfigError(
                f"CostTable.action_overhead_s = {self.action_overhead_s!r}; give seconds >= 0 (0: unmeasured)"
            )
        for n, factor in self.compute_slowdown.items():
            if not isinstance(n, int) or n < 1 or not math.isfinite(factor) or factor <= 0:
                raise ConfigError(
                    f"CostTable.compute_slowdown[{n!r}] = {factor!r}; give rank counts >= 1 with "
                    "factors > 0 (1.0: no slowdown)"
                )

    def slowdown(self, busy: int) -> float:
        """Compute-time factor while `busy` ranks compute at once (1.0 when unmeasured).

        Between measured counts it interpolates linearly. Beyond the largest, a host already
        oversubscribed there (factor > 1) shares its cores fairly: factor x busy / largest; one
        that was not (a core or device per rank) keeps that factor.
        """
        return self.compute_factor_of(self.compute_slowdown, busy)

    @staticmethod
    def compute_factor_of(table: Mapping[int, float], busy: int) -> float:
        """`slowdown` for any table of compute-time factors per busy count."""
        top = max(table, default=1)
        if table and busy > top and table[top] > 1.0:
            return table[top] * busy / top
        return slowdown_of(table, busy)

    @property
    def num_segments(self) -> int:
        """How many segments the model has (at most this many pipeline stages)."""
        return len(self.segments)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict with a format version."""
        return {
            "version": FORMAT_VERSION,
            "model_signature": self.model_signature,
            "device": self.device,
            "precision": self.precision,
            "created": self.created,
            "micro_batch_sizes": list(self.micro_batch_sizes),
            "tied_bytes": self.tied_bytes,
            "compute_slowdown": {str(n): f for n, f in sorted(self.compute_slowdown.items())},
            "action_overhead_s": self.action_overhead_s,
            "network": self.network.to_json(),
            "segments": [s.to_json() for s in self.segments],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CostTable:
        """Inverse of `to_json`; raises ConfigError naming what is missing or of another version."""
        what = "the profile"
        if not isinstance(data, Mapping):
            raise ConfigError(f"a profile is a JSON object, got {type(data).__name__}")
        version = data.get("version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ConfigError(
                f"the profile has format version {version}, this varuna reads {FORMAT_VERSION}; "
                "re-run `varuna profile`"
            )
        return cls(
            model_signature=str(required_field(data, "model_signature", what)),
            segments=[SegmentCost.from_json(s) for s in required_field(data, "segments", what)],
            network=NetworkCost.from_json(required_field(data, "network", what)),
            micro_batch_sizes=[int(m) for m in required_field(data, "micro_batch_sizes", what)],
            device=str(data.get("device", "cpu")),
            precision=str(data.get("precision", "fp32")),
            created=float(data.get("created", 0.0)),
            tied_bytes=int(data.get("tied_bytes", 0)),
            compute_slowdown={
                n: float(f) for n, f in int_keys(data.get("compute_slowdown", {}), "compute_slowdown").items()
            },
            action_overhead_s=float(data.get("action_overhead_s", 0.0)),
        )

    def save(self, path: str | Path) -> Path:
        """Write the table as JSON (via a temporary file, so a reader never sees half of it)."""
        return write_json_atomic(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        """Read a table written by `save`; ConfigError if it is missing or unreadable."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"no profile at {path}; run `varuna profile` first, or pass the right --profile"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON ({exc}); re-run `varuna profile`") from exc
        return cls.from_json(data)
