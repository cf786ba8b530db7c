"""The network model of a cost table: measured point-to-point and all-reduce times, interpolated
over message sizes and group sizes (`NetworkCost`), and the per-message CPU work that the
simulator charges on an oversubscribed host."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from varuna.errors import ConfigError
from varuna.planner._json import int_keys, required_field

__all__ = ["NetworkCost", "MESSAGE_KINDS", "slowdown_of"]

MESSAGE_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "DELAY_F", "DELAY_B")


def slowdown_of(table: Mapping[int, float], busy: int, one: float | None = 1.0) -> float:
    """`CostTable.slowdown` for any table of measured values per busy count; `one` is the value at one
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
    oversubscribed host the woken receiver and the transport threads take the sender's core, so a
    send there can cost many times what `message_s` says); missing: `message_s`."""
    message_cpu: list[tuple[int, float]] = field(default_factory=list)
    """(bytes, seconds) points: CPU time one point-to-point message of that size costs the two ranks
    together (encoding, the transport's threads on both sides, decoding), measured as process CPU
    time over round trips of the runtime's own transfer code. On a host with fewer cores than busy
    ranks this work takes core time from the stages computing there (`varuna.planner.sharing`).
    [] means unmeasured: 0."""
    reports_arrival: bool = True
    """Whether a posted receive says "completed" once its message is there, before it is waited
    for. The runtime's pull-ahead (Varuna's schedule) asks exactly that; gloo's receives say
    "not completed" until waited for, so there stage 0 always pulls the next forward ahead and the
    other stages never do (measured by the profile)."""
    gpus_per_host: int = 0
    """GPUs per host of the cluster the job runs on; with it `varuna plan` spreads the GPUs over
    hosts (`varuna.planner.cluster`) unless --gpus-per-host says otherwise. 0: not given."""
    inter_host_latency_s: float = 0.0
    """Seconds of a minimal message between hosts; 0: not given (`cluster.INTER_LATENCY_S`)."""
    inter_host_bandwidth_Bps: float = 0.0
    """Bytes per second of one host's network to the others; 0: not given (`cluster.INTER_BANDWIDTH_BPS`)."""
    inter_host_duplex: dict[int, float] = field(default_factory=dict)
    """k -> how many times longer k streams of messages from one host to another take while k
    others go the opposite way than alone (measured by the profile across hosts; {}: not measured,
    1). On a link that queues data behind a rate limit, one direction's acknowledgements wait
    behind the other direction's data; the planner stretches a pipeline's crossings by it as far as
    the opposite direction is busy (`varuna.planner.search`)."""

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
        for name in ("gpus_per_host", "inter_host_latency_s", "inter_host_bandwidth_Bps"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"NetworkCost.{name} = {value!r}; give a number >= 0 (0: not given)")
        for k, factor in self.inter_host_duplex.items():
            if not isinstance(k, int) or k < 1 or not math.isfinite(factor) or factor <= 0:
                raise ConfigError(
                    f"NetworkCost.inter_host_duplex[{k!r}] = {factor!r}; give streams each way >= 1 "
                    "with a factor > 0 (1: both ways at once cost nothing extra)"
                )
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
        return slowdown_of({n: d[kind] for n, d in self.delivery_s.items()}, busy, one=None)

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
            "gpus_per_host": self.gpus_per_host,
            "inter_host_latency_s": self.inter_host_latency_s,
            "inter_host_bandwidth_Bps": self.inter_host_bandwidth_Bps,
            "inter_host_duplex": {str(k): f for k, f in sorted(self.inter_host_duplex.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NetworkCost:
        """Inverse of `to_json`."""
        what = "the profile's network section"
        allreduce = int_keys(data.get("allreduce", {}), "allreduce")
        by_world = int_keys(data.get("allreduce_by_world", {}), "allreduce_by_world")
        return cls(
            p2p_latency_s=float(required_field(data, "p2p_latency_s", what)),
            p2p_bandwidth_Bps=float(required_field(data, "p2p_bandwidth_Bps", what)),
            allreduce={g: [(int(b), float(t)) for b, t in pts] for g, pts in allreduce.items()},
            allreduce_by_world={
                w: {g: [(int(b), float(t)) for b, t in pts] for g, pts in int_keys(curves, "groups").items()}
                for w, curves in by_world.items()
            },
            message_s={str(k): float(v) for k, v in data.get("message_s", {}).items()},
            reports_arrival=bool(data.get("reports_arrival", True)),
            delivery_s={
                n: {str(k): float(v) for k, v in d.items()}
                for n, d in int_keys(data.get("delivery_s", {}), "delivery_s").items()
            },
            message_cpu=[(int(b), float(t)) for b, t in data.get("message_cpu", [])],
            gpus_per_host=int(data.get("gpus_per_host", 0)),
            inter_host_latency_s=float(data.get("inter_host_latency_s", 0.0)),
            inter_host_bandwidth_Bps=float(data.get("inter_host_bandwidth_Bps", 0.0)),
            inter_host_duplex={
                k: float(f)
                for k, f in int_keys(data.get("inter_host_duplex", {}), "inter_host_duplex").items()
            },
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
