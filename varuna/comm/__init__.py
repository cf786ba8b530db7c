"""Communication: the rendezvous (MPI ranks to a torch.distributed group), point-to-point
activations and gradients, and the gradient buckets of the data-parallel all-reduce."""

from __future__ import annotations

from varuna._lazy import lazy_exports

_WHERE = {
    "init_distributed": "rendezvous",
    "launch_env": "rendezvous",
    "placement": "rendezvous",
    "host_layout": "rendezvous",
    "shutdown": "rendezvous",
    "finalize_mpi": "rendezvous",
    "env_rank": "rendezvous",
    "P2P": "p2p",
    "GradBuckets": "buckets",
    "flatten_value": "p2p",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
