"""A hand-off between two chunks on the same rank (the turn of zb-v's V: the last rank runs virtual
stages P-1 and P): the `P2P` interface without a transfer.

The sending chunk's value is detached and handed over as the receiving chunk's input (its floating
tensors requiring grad, as a received activation's do); the gradient of that input comes back the
same way. Nothing is copied. A receive whose value was not handed over yet is a schedule error:
one rank runs both ends in one list, so its order must put the send first (`validate` checks it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from varuna.comm.p2p import Value, flatten_value, input_grads

__all__ = ["LocalLink"]


class LocalLink:
    """Activations from one chunk to the next on this rank, gradients back."""

    def __init__(self, stage: int) -> None:
        self.stage = stage  # the receiving virtual stage
        self._activations: dict[int, Value] = {}
        self._grads: dict[int, list[torch.Tensor]] = {}
        self.idle_s = 0.0
        self.comm_s = 0.0
        self.bytes_sent = 0

    def begin_step(self, micro: Sequence[Mapping[str, Any]]) -> None:
        self._activations.clear()
        self._grads.clear()

    def send_activation(self, mb: int, value: Value, *, grad: bool = True) -> None:
        tensors, is_tuple = flatten_value(value)
        out = [t.detach().requires_grad_() if t.is_floating_point() else t.detach() for t in tensors]
        self._activations[mb] = tuple(out) if is_tuple else out[0]

    def activation_ready(self, mb: int) -> bool:
        return mb in self._activations

    def recv_activation(self, mb: int) -> Value:
        return self._take(self._activations, mb, "activation")

    def send_grad(self, mb: int, inputs: Value) -> None:
        self._grads[mb] = input_grads(inputs)

    def grad_ready(self, mb: int) -> bool:
        return mb in self._grads

    def recv_grad(self, mb: int) -> list[torch.Tensor]:
        return self._take(self._grads, mb, "gradient")

    def _take(self, box: dict[int, Any], mb: int, what: str) -> Any:
        if mb not in box:
            raise RuntimeError(
                f"virtual stage {self.stage}: micro-batch {mb}'s {what} from the chunk on this rank was not "
                "handed over yet; the schedule must run the sending action first"
            )
        return box.pop(mb)

    def shape_probe(self) -> list[int]:
        return []

    def probe_send(self, mb: int, value: Value) -> None:
        """The shape probe's hand-over (`varuna.comm.serial`): as any other."""
        self.send_activation(mb, value)

    def probe_recv(self, mb: int) -> Value:
        return self.recv_activation(mb)

    def flush(self) -> None:
        """Nothing is held back here (see `varuna.comm.serial`)."""

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass
