"""The planner: cost tables, the network model, memory, the simulator that times a schedule's
actions, core sharing, the search over P x D, micro-batch size and schedule, hosts and the network
between them (`Cluster`), and what limits a plan (`explain`)."""

from __future__ import annotations

from varuna._lazy import lazy_exports

_WHERE = {
    "PlannerConfig": "config",
    "CostTable": "costs",
    "SegmentCost": "costs",
    "NetworkCost": "network",
    "Cluster": "cluster",
    "explain": "limits",
    "model_signature": "costs",
    "simulate": "simulator",
    "StageCost": "simulator",
    "Timeline": "simulator",
    "Sharing": "simulator",
    "plan": "search",
    "predict": "search",
    "PlanResult": "search",
    "PlanError": "search",
    "parse_memory": "memory",
    "format_bytes": "memory",
    "plan_for_hosts": "hosts",
    "host_speeds": "hosts",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
