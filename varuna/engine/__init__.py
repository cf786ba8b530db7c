"""The engine: `Varuna` (one rank's stage and its training step), building the stage, the
runtime that executes a schedule's actions, the split backward, precision and the train state."""

from __future__ import annotations

from varuna._lazy import lazy_exports

_WHERE = {
    "EngineConfig": "config",
    "VarunaConfig": "config",
    "Varuna": "engine",
    "StageRuntime": "runtime",
    "StepTimes": "runtime",
    "LossScaler": "precision",
    "autocast_policy": "precision",
    "PRECISIONS": "precision",
    "input_grads_first": "backward",
    "WeightGrads": "backward",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
