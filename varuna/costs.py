"""The cost table: what the profiler measured, and all the planner reads.

Measurement is separate from decision: `varuna profile` fills a `CostTable` and saves it as JSON in
the run directory; `varuna.plan` and the simulator are pure functions of it. Costs are per *segment*
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

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from varuna._files import write_json_atomic
from varuna.errors import ConfigError

__all__ = ["SegmentCost", "NetworkCost", "CostTable", "model_signature", "FORMAT_VERSION"]

FORMAT_VERSION = 1
MESSAGE_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "DELAY_F", "DELAY_B")


def _int_keys(data: Mapping[Any, Any], what: str) -> dict[int, Any]:
    try:
        return {int(k): v for k, v in data.items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: keys must be micro-batch sizes (integers), got {list(data)}") from exc


def _check_per_size(table: Mapping[int, float], what: str) -> None:
    for size, value in table.items():
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"{what}: micro-batch size {size!r} must be a positive integer")
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{what}[{size}] = {value!r}; it must be a finite number >= 0")


def _field(data: Mapping[str, Any], name: str, what: str) -> Any:
    if name not in data:
        raise ConfigError(f"{what} is missing the field {name!r}; re-run `varuna profile` to write a new one")
    return data[name]


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
    update_s: float = 0.0
    """Seconds of the once-per-step parameter update of this segment's parameters: the gradient
    norm and an AdamW step (the profile assumes Adam, as `optimizer_bytes` does); 0 if unmeasured."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.update_s) or self.update_s < 0:
            raise ConfigError(f"SegmentCost.update_s = {self.update_s!r}; it must be a finite number >= 0")
        sizes = set(self.forward_s)
        for name in ("forward_s", "backward_s", "activation_bytes", "activation_memory_bytes", "recompute_s"):
            table = getattr(self, name)
            if table is None:
                continue
            _check_per_size(table, f"SegmentCost.{name}")
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

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (integer keys as strings)."""

        def keyed(table: Mapping[int, float] | None) -> dict[str, float] | None:
            return None if table is None else {str(k): v for k, v in sorted(table.items())}

        return {
            "forward_s": keyed(self.forward_s),
            "backward_s": keyed(self.backward_s),
            "recompute_s": keyed(self.recompute_s),
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
        recompute = data.get("recompute_s")
        return cls(
            forward_s={
                k: float(v) for k, v in _int_keys(_field(data, "forward_s", what), "forward_s").items()
            },
            backward_s={
                k: float(v) for k, v in _int_keys(_field(data, "backward_s", what), "backward_s").items()
            },
            recompute_s=None
            if recompute is None
            else {k: float(v) for k, v in _int_keys(recompute, "recompute_s").items()},
            activation_bytes={
                k: int(v)
                for k, v in _int_keys(_field(data, "activation_bytes", what), "activation_bytes").items()
            },
            activation_memory_bytes={
                k: int(v)
                for k, v in _int_keys(
                    _field(data, "activation_memory_bytes", what), "activation_memory_bytes"
                ).items()
            },
            param_bytes=int(_field(data, "param_bytes", what)),
            grad_bytes=int(_field(data, "grad_bytes", what)),
            optimizer_bytes=int(_field(data, "optimizer_bytes", what)),
            update_s=float(data.get("update_s", 0.0)),
        )


def _check_points(points: list[tuple[int, float]], what: str) -> list[tuple[int, float]]:
    if not points:
        raise ConfigError(f"{what} has no measured points")
    sizes = [b for b, _ in points]
    if len(set(sizes)) != len(sizes) or any(b < 0 for b in sizes) or any(t < 0 for _, t in points):
        raise ConfigError(f"{what} = {points}: give distinct byte sizes >= 0 with seconds >= 0")
    return sorted((int(b), float(t)) for b, t in points)


@dataclass(kw_only=True, slots=True)
class NetworkCost:
    """Measured communication costs between devices."""

    p2p_latency_s: float
    """Seconds of a minimal point-to-point message between neighbouring stages."""
    p2p_bandwidth_Bps: float
    """Point-to-point bandwidth, bytes per second."""
    allreduce: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    """Group size -> measured (bytes, seconds) points of an all-reduce over that many ranks."""
    allreduce_by_world: dict[int, dict[int, list[tuple[int, float]]]] = field(default_factory=dict)
    """World size w -> group size g -> (bytes, seconds) points, measured with only w ranks active,
    all w/g groups of the stage layout reducing at once (how a P x D = w job reduces). On a shared
    host the ranks compete for cores, so a 1 x 2 job reduces faster than two groups of a 2 x 2 one."""
    message_s: dict[str, float] = field(default_factory=dict)
    """Per message, what the runtime's transfer code adds to `p2p_time`: SEND_F / SEND_B -> seconds
    a send keeps the sending stage busy (encoding, posting), RECV_F / RECV_B -> seconds a receive
    keeps the receiving stage busy once the message is there (an activation's data is fetched
    only after its header is read), DELAY_F / DELAY_B -> seconds later than `p2p_time` a value
    reaches a stage that waits for it. {} (or a missing kind) means unmeasured: 0."""
    delivery_s: dict[int, dict[str, float]] = field(default_factory=dict)
    """n busy ranks -> {"F": s, "B": s}: how much later than `p2p_time` an activation (F) or a
    gradient (B) reaches a stage waiting for it while n ranks of the host compute, the sender
    among them (measured with the runtime's own transfer code on one host; {} when unmeasured,
    e.g. ranks 0 and 1 on different hosts: then DELAY_F / DELAY_B of `message_s` apply). On a
    host with fewer cores than busy ranks the scheduler, not the wire, sets it. Optional "SEND_F" /
    "SEND_B": seconds a send keeps the sending stage busy while n - 1 other ranks compute (on an
    oversubscribed host the woken receiver and the transport threads take the sender's core; 4
    ranks on 2 cores: ~1 ms per send where `message_s` says 0.1); missing: `message_s`."""
    message_cpu: list[tuple[int, float]] = field(default_factory=list)
    """(bytes, seconds) points: CPU time one point-to-point message of that size costs the two ranks
    together (encoding, the transport's threads on both sides, decoding), measured as process CPU
    time over round trips of the runtime's own transfer code. On a host with fewer cores than busy
    ranks this work takes core time from the stages computing there (`varuna.sharing`); ~0.3 ms
    for 64 KiB and ~0.5 ms for 256 KiB with gloo on CPU. [] means unmeasured: 0."""
    reports_arrival: bool = True
    """Whether a posted receive says "completed" once its message is there, before it is waited
    for. The runtime's pull-ahead (Varuna's schedule) asks exactly that; gloo's receives say
    "not completed" until waited for, so there stage 0 always pulls the next forward ahead and the
    other stages never do (measured by the profile)."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.p2p_latency_s) or self.p2p_latency_s < 0:
            raise ConfigError(f"NetworkCost.p2p_latency_s = {self.p2p_latency_s!r}; it must be >= 0 seconds")
        if not math.isfinite(self.p2p_bandwidth_Bps) or self.p2p_bandwidth_Bps <= 0:
            raise ConfigError(
                f"NetworkCost.p2p_bandwidth_Bps = {self.p2p_bandwidth_Bps!r}; it must be > 0 bytes/s"
            )
        for group, points in self.allreduce.items():
            if not isinstance(group, int) or group < 2:
                raise ConfigError(f"NetworkCost.allreduce: group size {group!r} must be an integer >= 2")
            self.allreduce[group] = _check_points(points, f"NetworkCost.allreduce[{group}]")
        for world, curves in self.allreduce_by_world.items():
            for group, points in curves.items():
                if not isinstance(group, int) or group < 2 or world % group:
                    raise ConfigError(
                        f"NetworkCost.allreduce_by_world[{world}]: group size {group!r} must be an "
                        f"integer >= 2 dividing the world size {world}"
                    )
                curves[group] = _check_points(points, f"NetworkCost.allreduce_by_world[{world}][{group}]")
        for n, delays in self.delivery_s.items():
            if (
                not isinstance(n, int)
                or n < 1
                or not {"F", "B"} <= set(delays) <= {"F", "B", "SEND_F", "SEND_B"}
                or not all(math.isfinite(v) and v >= 0 for v in delays.values())
            ):
                raise ConfigError(
                    f"NetworkCost.delivery_s[{n!r}] = {delays!r}; give busy-rank counts >= 1 with "
                    '{"F": seconds >= 0, "B": seconds >= 0} and optionally "SEND_F" and "SEND_B"'
                )
        if self.message_cpu:
            self.message_cpu = _check_points(self.message_cpu, "NetworkCost.message_cpu")
        for kind, seconds in self.message_s.items():
            if kind not in MESSAGE_KINDS or not math.isfinite(seconds) or seconds < 0:
                raise ConfigError(
                    f"NetworkCost.message_s[{kind!r}] = {seconds!r}; give seconds >= 0 for the kinds "
                    f"{', '.join(MESSAGE_KINDS)}"
                )

    def delivery_delay(self, kind: str, busy: int) -> float:
        """Seconds an activation (`kind` "F") or gradient ("B") arrives later than `p2p_time`
        while `busy` ranks compute: `delivery_s` interpolated in the busy count (the largest
        measured count beyond it), else DELAY_F / DELAY_B of `message_s`, else 0."""
        if not self.delivery_s:
            return self.message_s.get("DELAY_" + kind, 0.0)
        return CostTable.slowdown_of({n: d[kind] for n, d in self.delivery_s.items()}, busy, one=None)

    def message_cpu_time(self, nbytes: int) -> float:
        """CPU seconds one message of `nbytes` costs both ranks together (`message_cpu`
        interpolated in bytes, the last slope beyond the largest); 0 when unmeasured."""
        return _interpolate(self.message_cpu, nbytes) if self.message_cpu and nbytes > 0 else 0.0

    def p2p_time(self, nbytes: int) -> float:
        """Seconds to move `nbytes` between neighbouring stages: latency + bytes / bandwidth."""
        return self.p2p_latency_s + nbytes / self.p2p_bandwidth_Bps

    def allreduce_time(self, nbytes: int, group: int, *, world: int | None = None) -> float:
        """Seconds of an all-reduce of `nbytes` over `group` ranks (0 for a group of one).

        With `world` (the job's P x D) and a curve measured at that world size
        (`allreduce_by_world`), that curve is used. Otherwise it interpolates the measured points
        of that group size linearly in bytes; below the smallest
        measurement it returns that measurement (latency bound), above the largest it extrapolates
        with the last slope. An unmeasured group size scales the nearest measured one by the ring
        all-reduce's traffic factor 2(g-1)/g; with no measurement at all it uses that ring model
        over the point-to-point latency and bandwidth.
        """
        if group <= 1 or nbytes <= 0:
            return 0.0
        if world is not None and group in self.allreduce_by_world.get(world, {}):
            return _interpolate(self.allreduce_by_world[world][group], nbytes)
        ring = 2.0 * (group - 1) / group
        if not self.allreduce:
            return 2 * (group - 1) * self.p2p_latency_s + ring * nbytes / self.p2p_bandwidth_Bps
        if group in self.allreduce:
            return _interpolate(self.allreduce[group], nbytes)
        near = min(self.allreduce, key=lambda g: (abs(g - group), -g))
        return _interpolate(self.allreduce[near], nbytes) * ring / (2.0 * (near - 1) / near)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (group sizes as strings)."""
        return {
            "p2p_latency_s": self.p2p_latency_s,
            "p2p_bandwidth_Bps": self.p2p_bandwidth_Bps,
            "allreduce": {str(g): [[b, t] for b, t in pts] for g, pts in sorted(self.allreduce.items())},
            "allreduce_by_world": {
                str(w): {str(g): [[b, t] for b, t in pts] for g, pts in sorted(curves.items())}
                for w, curves in sorted(self.allreduce_by_world.items())
            },
            "message_s": dict(self.message_s),
            "reports_arrival": self.reports_arrival,
            "delivery_s": {str(n): dict(d) for n, d in sorted(self.delivery_s.items())},
            "message_cpu": [[b, t] for b, t in self.message_cpu],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NetworkCost:
        """Inverse of `to_json`."""
        what = "the profile's network section"
        allreduce = _int_keys(data.get("allreduce", {}), "allreduce")
        by_world = _int_keys(data.get("allreduce_by_world", {}), "allreduce_by_world")
        return cls(
            p2p_latency_s=float(_field(data, "p2p_latency_s", what)),
            p2p_bandwidth_Bps=float(_field(data, "p2p_bandwidth_Bps", what)),
            allreduce={g: [(int(b), float(t)) for b, t in pts] for g, pts in allreduce.items()},
            allreduce_by_world={
                w: {g: [(int(b), float(t)) for b, t in pts] for g, pts in _int_keys(curves, "groups").items()}
                for w, curves in by_world.items()
            },
            message_s={str(k): float(v) for k, v in data.get("message_s", {}).items()},
            reports_arrival=bool(data.get("reports_arrival", True)),
            delivery_s={
                n: {str(k): float(v) for k, v in d.items()}
                for n, d in _int_keys(data.get("delivery_s", {}), "delivery_s").items()
            },
            message_cpu=[(int(b), float(t)) for b, t in data.get("message_cpu", [])],
        )


def _interpolate(points: Sequence[tuple[int, float]], nbytes: int) -> float:
    b_first, t_first = points[0]
    if nbytes <= b_first:
        return t_first
    if len(points) == 1:
        return t_first * nbytes / b_first if b_first > 0 else t_first
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = points[-2], points[-1]
    return max(t1 + (t1 - t0) * (nbytes - b1) / (b1 - b0), t1)


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
    the busy stages (`varuna.simulate.Sharing`)."""
    action_overhead_s: float = 0.0
    """Seconds each compute action (F, B, R) of a pipelined stage (P > 1) takes beyond its segments'
    profiled compute: what the runtime does per action, per message and per step that the other
    terms miss (entering the model once per stage, the transport's threads under load, the step's
    bookkeeping), fitted by the profile from a short pipeline of exactly known compute run with
    the real runtime (`varuna._calibrate`). 0 when unmeasured."""

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
        return CostTable.slowdown_of(table, busy)

    @staticmethod
    def slowdown_of(table: Mapping[int, float], busy: int, one: float | None = 1.0) -> float:
        """`slowdown` for any table of measured values per busy count; `one` is the value at one
        busy rank and below when the table lacks it (None: the smallest measured count's)."""
        if not table:
            return 1.0 if one is None else one
        if one is not None and busy <= 1:
            return one
        if busy in table:
            return table[busy]
        below = [n for n in table if n < busy]
        above = [n for n in table if n > busy]
        if not above:
            return table[max(table)]
        if not below and one is None:
            return table[min(above)]
        lo, hi = (max(below), min(above)) if below else (1, min(above))
        f_lo = table.get(lo, 1.0 if one is None else one)
        return f_lo + (table[hi] - f_lo) * (busy - lo) / (hi - lo)

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
            model_signature=str(_field(data, "model_signature", what)),
            segments=[SegmentCost.from_json(s) for s in _field(data, "segments", what)],
            network=NetworkCost.from_json(_field(data, "network", what)),
            micro_batch_sizes=[int(m) for m in _field(data, "micro_batch_sizes", what)],
            device=str(data.get("device", "cpu")),
            precision=str(data.get("precision", "fp32")),
            created=float(data.get("created", 0.0)),
            tied_bytes=int(data.get("tied_bytes", 0)),
            compute_slowdown={
                n: float(f)
                for n, f in _int_keys(data.get("compute_slowdown", {}), "compute_slowdown").items()
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


def model_signature(model: Any) -> str:
    """A short hash of a model's parameter names and shapes, in registration order.

    `model` is an `nn.Module` (anything with `named_parameters()`) or an iterable of
    `(name, shape)` pairs; two models with the same architecture give the same signature.
    """
    if hasattr(model, "named_parameters"):
        pairs: Iterable[tuple[str, Sequence[int]]] = ((n, p.shape) for n, p in model.named_parameters())
    else:
        pairs = model
    text = json.dumps([[str(n), [int(d) for d in shape]] for n, shape in pairs])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
