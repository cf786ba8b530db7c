"""Elasticity: the morph protocol (torch-free), choosing a new shape, and the supervisor that
relaunches a job after a morph or a failure."""

from __future__ import annotations

from varuna._lazy import lazy_exports

_WHERE = {
    "ElasticConfig": "config",
    "MORPH_EXIT": "protocol",
    "StopRequest": "protocol",
    "Shape": "protocol",
    "ShapeChoice": "reshape",
    "request_resize": "protocol",
    "take_resize": "protocol",
    "live_workers": "protocol",
    "choose_shape": "reshape",
    "shape_for_gpus": "reshape",
    "run_elastic": "supervisor",
    "hostfile_slots": "supervisor",
    "next_shape": "supervisor",
    "USER_STOP": "supervisor",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
