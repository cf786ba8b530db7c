"""Many hosts: which transfers and all-reduces cross the network between hosts, and what they cost.

The profile measures one host: its point-to-point link and all-reduces are intra-host. `Cluster`
says how many GPUs each host has and what the network between hosts does; `Links` gives the
planner every transfer time of one P x D shape on it. Ranks sit as the launcher places them:
rank = replica x P + stage, hosts filled in rank order (`gpus_per_host` ranks each).

- Point-to-point between stages s and s+1: intra-host as profiled, unless some replica has those
  two stages on different hosts; then `inter_latency_s` + bytes / `inter_bandwidth_Bps` (the
  slowest replica sets the step, so the boundary is charged as its slowest crossing). Where k
  replicas send across the boundary from one host, their transfers share that host's link: each
  keeps it busy k times as long (`p2p_busy`), so a saturated link carries all k replicas' bytes
  while one transfer on a link that is otherwise free still takes its own time. A crossing
  carries activations one way and gradients the other: with measured duplex factors
  (`Cluster.duplex`) the planner stretches its transfers by the factor for the replicas sharing it
  (at least that of fewer streams: `Cluster.duplex_factor`), as far as the opposite direction is
  busy (`Links.duplex`, `varuna.planner.search`).
- All-reduce of a group (a stage's D replicas, the tied weights' 2D ranks, the per-step one over
  everyone): within one host the profile's measurement (`NetworkCost.allreduce_time`). Across H
  hosts with at most k of its ranks on one host, a ring: 2(n-1)/n x bytes over the slowest link
  of the ring plus one latency per step of a hierarchical ring, 2(k-1) intra + 2(H-1) inter. Every
  group whose ring leaves a host shares that host's network: with g GPUs busy on a host and k of
  them in each group, g/k rings share `inter_bandwidth_Bps`, so a ring gets k/g of it (capped by
  the intra-host bandwidth). Where the profile measured its all-reduces across these hosts
  (`Cluster.measured_allreduce`), the ring model is scaled by the measured curve of the group's
  size over the ring model of the profile's group of that size: the ring's two directions busy at
  once, and whatever else it leaves out, as measured on this link.
- Shared cores (a CPU profile's `compute_slowdown`): only the replicas on one host share its cores
  (G / P of them, at most D), not all D; all D where the hosts are namespaces of one machine
  (`Cluster.shared_cores`).

The cluster comes from `varuna plan`'s flags, else from the profile's network section
(`NetworkCost.gpus_per_host`, `inter_host_latency_s`, `inter_host_bandwidth_Bps`: add them to
profile.json by hand, the profile measures one host). Defaults (`varuna plan --gpus-per-host 8` alone): 100 Gbit/s Ethernet between hosts
(12.5e9 bytes/s per host) with 20 us latency, the commodity network Varuna was built for.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from varuna.errors import PlanError, is_int
from varuna.planner.network import NetworkCost, slowdown_of

__all__ = ["Cluster", "Links", "Placement", "PLACEMENTS", "INTER_BANDWIDTH_BPS", "INTER_LATENCY_S"]

Placement = Literal["block", "cyclic"]
PLACEMENTS: tuple[Placement, ...] = ("block", "cyclic")
"""How ranks can sit on hosts (`Cluster.placement`)."""
INTER_BANDWIDTH_BPS = 12.5e9
"""Default bytes per second of one host's network (100 Gbit/s)."""
INTER_LATENCY_S = 20e-6
"""Default seconds of a minimal message between hosts."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """Hosts of `gpus_per_host` GPUs each and the network between them."""

    gpus_per_host: int
    """GPUs (ranks) per host, filled in rank order."""
    inter_bandwidth_Bps: float = INTER_BANDWIDTH_BPS
    """Bytes per second one host sends (and receives) to other hosts, shared by its GPUs."""
    inter_latency_s: float = INTER_LATENCY_S
    """Seconds of a minimal message between two hosts."""
    intra_bandwidth_Bps: float | None = None
    """Bytes per second between two GPUs of a host; None: the profile's point-to-point bandwidth."""
    intra_latency_s: float | None = None
    """Seconds of a minimal message within a host; None: the profile's point-to-point latency."""
    placement: Placement = "block"
    """How ranks sit on hosts. "block": hosts filled in rank order, `gpus_per_host` consecutive
    ranks each (what a launcher does with a hostfile of `host:slots` lines): a pipeline of P <=
    `gpus_per_host` stages stays inside a host and its replicas spread over hosts, so the stages'
    all-reduces cross the network. "cyclic": rank r on host r mod H (`varuna run --placement
    cyclic`, or a hostfile of one slot per host, dealt in turn): a replica's neighbouring stages
    sit on different hosts and, with H dividing P, each stage's replicas share a host, so
    activations cross the network and all-reduces do not. `varuna.planner.search.plan` tries both
    where the GPUs span hosts."""
    duplex: Mapping[int, float] = field(default_factory=dict)
    """k -> how many times longer k streams from one host to another take while k go the opposite
    way than alone (`NetworkCost.inter_host_duplex`, measured by the profile across hosts); {}: 1,
    each direction of a link as free as if the other were idle."""
    measured_allreduce: bool = False
    """Whether the profile's all-reduce curves were measured across these hosts, on the link this
    cluster describes (a profile across hosts of `gpus_per_host` ranks each; `from_network` sets it
    unless another bandwidth or host size is given): a cross-host all-reduce is then the ring model
    times the measured curve of its group size over the same model of the profile's group
    (`Links.allreduce`), which holds what the ring leaves out, such as both directions of the link
    busy at once."""
    shared_cores: bool = False
    """Whether the hosts share one machine's cores (namespace hosts on one machine, as the tests and
    the network bench make them): then the busy stages of every replica slow each other down (a CPU
    profile's `compute_slowdown`), as on one host, not only those of the replicas a host holds."""

    def __post_init__(self) -> None:
        if not is_int(self.gpus_per_host) or self.gpus_per_host < 1:
            raise PlanError(
                f"gpus_per_host = {self.gpus_per_host!r}: give the number of GPUs on each host, at least 1 "
                "(e.g. --gpus-per-host 8)"
            )
        if self.placement not in PLACEMENTS:
            raise PlanError(f"placement = {self.placement!r}: use one of {PLACEMENTS}")
        for name in ("inter_bandwidth_Bps", "intra_bandwidth_Bps"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise PlanError(
                    f"{name} = {value!r}: give bytes per second > 0, e.g. 12.5e9 for 100 Gbit/s "
                    "(varuna plan: --inter-host-gbit / --intra-host-gbit in Gbit/s)"
                )
        for k, factor in self.duplex.items():
            if not is_int(k) or k < 1 or not (math.isfinite(factor) and factor > 0):
                raise PlanError(
                    f"duplex[{k!r}] = {factor!r}: give streams each way >= 1 with a factor > 0 "
                    "(1: both directions as fast as one)"
                )
        for name in ("inter_latency_s", "intra_latency_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise PlanError(
                    f"{name} = {value!r}: give seconds >= 0, e.g. 2e-5 "
                    "(varuna plan: --inter-host-latency-us / --intra-host-latency-us in microseconds)"
                )

    @classmethod
    def from_network(cls, net: NetworkCost, **given: float | int | None) -> Cluster | None:
        """The cluster of a profile's network (`NetworkCost.gpus_per_host` and the inter-host
        fields), with `given` (the same names as the fields; None: not given) taking precedence;
        None when neither says how many GPUs a host has. The measured duplex factors and all-reduce
        curves describe the measured link: a given `inter_bandwidth_Bps` (another network) leaves them
        out, and another `gpus_per_host` the curves (`measured_allreduce`)."""
        gpus_per_host = given.get("gpus_per_host")
        chosen = {k: v for k, v in given.items() if v is not None and k != "gpus_per_host"}
        if gpus_per_host is None:
            gpus_per_host = net.gpus_per_host
            if not gpus_per_host:
                if chosen:
                    raise PlanError(
                        f"{', '.join(sorted(chosen))} given, but not how many GPUs a host has: pass "
                        "--gpus-per-host G (or set gpus_per_host in the profile's network section)"
                    )
                return None
        measured_link = "inter_bandwidth_Bps" not in chosen  # the duplex factors hold for it only
        if net.inter_host_bandwidth_Bps:
            chosen.setdefault("inter_bandwidth_Bps", net.inter_host_bandwidth_Bps)
        if net.inter_host_latency_s:
            chosen.setdefault("inter_latency_s", net.inter_host_latency_s)
        duplex = dict(net.inter_host_duplex) if measured_link else {}
        across = measured_link and net.gpus_per_host == gpus_per_host and profile_world(net) > gpus_per_host
        return cls(
            gpus_per_host=gpus_per_host,  # type: ignore[arg-type]
            duplex=duplex,
            measured_allreduce=across,
            **chosen,  # type: ignore[arg-type]
        )

    def duplex_factor(self, each_way: int) -> float:
        """`duplex` for `each_way` streams each way (interpolated; beyond the counts measured, the
        nearest; 1 where nothing was measured), and at least the factor measured for any fewer
        streams: k replicas sharing a crossing do not send in lockstep, so for part of a step fewer
        than k streams go each way, slowed as those fewer are (on a shaped link one stream each way
        was measured slower than two)."""
        if not self.duplex:
            return 1.0
        fewer = [f for k, f in self.duplex.items() if k < each_way]
        return max([slowdown_of(self.duplex, each_way, one=None), *fewer])

    def replicas_sharing_cores(self, pipeline: int, data: int) -> int:
        """Replicas of a P x D shape whose busy stages share cores (`Sharing.replicas`): those one
        host holds (G / P of them, at least 1, at most D), or all D with `shared_cores`."""
        return data if self.shared_cores else min(data, max(1, self.gpus_per_host // pipeline))

    def hosts(self, gpus: int) -> int:
        """Hosts that `gpus` ranks fill."""
        return -(-gpus // self.gpus_per_host)


def profile_world(net: NetworkCost) -> int:
    """The ranks of the job that measured `net` (the largest world of `allreduce_by_world`; 0 where
    it has none)."""
    return max(net.allreduce_by_world, default=0)


class Links:
    """Transfer and all-reduce seconds of one P x D shape (see the module docstring); without a
    cluster, or with every rank on one host, exactly the profile's `NetworkCost` calls."""

    def __init__(self, net: NetworkCost, cluster: Cluster | None, pipeline: int, data: int) -> None:
        self.net, self.pipeline, self.data = net, pipeline, data
        self.world = pipeline * data
        one_host = cluster is None or cluster.gpus_per_host >= self.world
        self.cluster = None if one_host else cluster
        if self.cluster is not None:
            self.intra_bw = self.cluster.intra_bandwidth_Bps or net.p2p_bandwidth_Bps
            self.intra_lat = (
                net.p2p_latency_s if self.cluster.intra_latency_s is None else self.cluster.intra_latency_s
            )

    def _host(self, rank: int) -> int:
        assert self.cluster is not None
        if self.cluster.placement == "cyclic":
            return rank % self.cluster.hosts(self.world)
        return rank // self.cluster.gpus_per_host

    def crosses(self, boundary: int, to: int | None = None) -> bool:
        """Whether some replica has pipeline positions `boundary` and `to` (default `boundary` + 1)
        on different hosts."""
        return self.sharing(boundary, to) > 0

    def p2p(self, boundary: int, nbytes: int, to: int | None = None) -> float:
        """Seconds to move `nbytes` across stage boundary `boundary`, or from position `boundary` to
        position `to` (two chunks per rank: virtual neighbours need not be neighbouring ranks)."""
        if not self.crosses(boundary, to):
            return self.net.p2p_time(nbytes)
        assert self.cluster is not None
        return self.cluster.inter_latency_s + nbytes / self.cluster.inter_bandwidth_Bps

    def p2p_busy(self, boundary: int, nbytes: int, to: int | None = None) -> float:
        """Seconds one transfer across the boundary keeps its link busy (the simulator's
        `link_busy`): `p2p`, times the replicas that share the link where it crosses hosts."""
        return self.p2p(boundary, nbytes, to) * max(1, self.sharing(boundary, to))

    def duplex(self, boundary: int) -> float:
        """How many times longer a transfer across the boundary takes while the opposite direction
        is busy too (`Cluster.duplex_factor` for the replicas sharing the crossing); 1 inside a host
        or where nothing was measured."""
        k = self.sharing(boundary)
        return self.cluster.duplex_factor(k) if k and self.cluster is not None else 1.0

    def sharing(self, boundary: int, to: int | None = None) -> int:
        """The most replicas whose transfer from position `boundary` to `to` (default `boundary` + 1)
        leaves one host for another at once (they share that host's link; 0 if none crosses, as on
        one host)."""
        if self.cluster is None:
            return 0
        p, b = self.pipeline, boundary + 1 if to is None else to
        senders: dict[int, int] = {}
        for r in range(self.data):
            src, dst = self._host(r * p + boundary), self._host(r * p + b)
            if src != dst:
                senders[src] = senders.get(src, 0) + 1
        return max(senders.values(), default=0)

    def allreduce(self, nbytes: int, ranks: list[int]) -> float:
        """Seconds of an all-reduce of `nbytes` over `ranks` (all such groups reducing at once)."""
        n = len(ranks)
        if n <= 1 or nbytes <= 0:
            return 0.0
        per_host: dict[int, int] = {}
        for r in ranks:
            h = self._host(r) if self.cluster is not None else 0
            per_host[h] = per_host.get(h, 0) + 1
        if len(per_host) == 1:  # inside one host: the profile's curves of a one-host job where it has them
            one_host = self.world if self.cluster is None else min(self.world, self.cluster.gpus_per_host)
            return self.net.allreduce_time(nbytes, n, world=one_host)
        assert self.cluster is not None
        return self._ring(nbytes, list(per_host.values()), self.world) * self._measured_over_ring(n, nbytes)

    def _ring(self, nbytes: int, per_host: list[int], world: int) -> float:
        """The ring model of an all-reduce of `nbytes` over a group with `per_host` of its ranks on
        each of its hosts (more than one), in a job of `world` ranks (module docstring)."""
        assert self.cluster is not None
        n, hosts, k = sum(per_host), len(per_host), max(per_host)
        busy = min(self.cluster.gpus_per_host, world)
        ring_bw = min(self.intra_bw, self.cluster.inter_bandwidth_Bps * k / busy)
        latency = 2 * (k - 1) * self.intra_lat + 2 * (hosts - 1) * self.cluster.inter_latency_s
        return 2.0 * (n - 1) / n * nbytes / ring_bw + latency

    def _measured_over_ring(self, n: int, nbytes: int) -> float:
        """With `Cluster.measured_allreduce`: the profile's all-reduce of `n` ranks at `nbytes`
        (`NetworkCost.allreduce`, every group of the profile's stage layout reducing at once, hosts
        filled in rank order) over the ring model of that group in that job; 1 where the profile has
        no curve of `n` ranks or its groups of `n` stay inside a host."""
        assert self.cluster is not None
        world = profile_world(self.net)
        if not self.cluster.measured_allreduce or n not in self.net.allreduce or world % n:
            return 1.0
        stride, size = world // n, self.cluster.gpus_per_host
        per_host = Counter(r * stride // size for r in range(n))  # the profile's group {0, stride, ...}
        if len(per_host) == 1:
            return 1.0
        return self.net.allreduce_time(nbytes, n) / self._ring(nbytes, list(per_host.values()), world)

    def stage_allreduce(self, stage: int, nbytes: int) -> float:
        """A stage's gradient all-reduce over its D replicas."""
        if self.cluster is None:
            return self.net.allreduce_time(nbytes, self.data, world=self.world)
        return self.allreduce(nbytes, [r * self.pipeline + stage for r in range(self.data)])

    def tied_allreduce(self, nbytes: int) -> float:
        """The tied weights' sum between the first and the last stage of every replica (2D ranks)."""
        if self.cluster is None:
            return self.net.allreduce_time(nbytes, 2 * self.data, world=self.world)
        p = self.pipeline
        return self.allreduce(nbytes, [r * p + s for r in range(self.data) for s in (0, p - 1)])

    def step_allreduce(self, nbytes: int) -> float:
        """The small per-step all-reduce over every rank."""
        if self.cluster is None:
            return self.net.allreduce_time(nbytes, self.world, world=self.world)
        return self.allreduce(nbytes, list(range(self.world)))
