"""Measurement: the model profile, the network profile, the slowdown of ranks sharing a host,
the runtime's calibration, and the profile job (`varuna profile`)."""

from __future__ import annotations

from varuna._lazy import lazy_exports

_WHERE = {
    "run_profile": "measure",
    "PROFILE_FILE": "measure",
    "profile_network": "network",
    "measure_slowdown": "slowdown",
    "fit_action_overhead": "calibrate",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
