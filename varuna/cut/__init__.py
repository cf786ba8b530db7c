"""Where a model is cut into stages: CutPoint, auto_cut, the trace and the partition, and the
stand-ins a stage sees for values other stages compute."""

from __future__ import annotations

from varuna._lazy import lazy_exports

_WHERE = {
    "CutPoint": "cutpoint",
    "model_loss": "cutpoint",
    "auto_cut": "autocut",
    "find_blocks": "autocut",
    "Trace": "partition",
    "Partition": "partition",
    "TiedGroup": "partition",
    "trace_model": "partition",
    "profile_segments": "partition",
    "make_partition": "partition",
    "balance": "partition",
    "canonical_names": "partition",
    "cut_names": "partition",
    "StandIn": "standin",
    "SkippedForward": "standin",
    "record_outputs": "standin",
    "contains_stand_in": "standin",
    "origin_of": "standin",
    "model_signature": "signature",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
