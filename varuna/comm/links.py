"""The link contract: what a pipeline chunk's runtime asks of the connection to its neighbours.

A chunk receives activations from the stage before it and sends gradients back on its `up` link,
sends activations to the stage after it and receives their gradients on its `down` link
(`varuna.engine.runtime.Chunk`). Three classes implement the contract:

- `varuna.comm.p2p.P2P`: non-blocking sends and receives between two ranks, shapes carried in
  headers (gloo, and NCCL where a pair of ranks has its own communicator);
- `varuna.comm.serial.SerialLink`: every message of a rank at its tick of one exchange table, so
  that NCCL's in-order communicators never wait on each other; it needs each activation's shapes
  before the step, so it lists micro-batches to probe;
- `varuna.comm.local.LocalLink`: a hand-off between two chunks on the same rank (the turn of
  zb-v's V), nothing copied.

A step on a link runs `begin_step`, the probe (`shape_probe`, then `probe_send` / `probe_recv`
for each micro-batch it listed, stage after stage), the schedule's sends and receives in its
order, `flush` before the step's collectives and `finish` after them; `close` once after the last
step. To add a link, implement `Link` and give it to the chunks where `varuna.engine.stage.chunk_links`
builds them; mypy checks each implementation against this protocol (the assignments at the end
of this module).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from varuna.comm.p2p import Value

__all__ = ["Link"]


class Link(Protocol):
    """One chunk's connection to a neighbouring stage, in both directions.

    Micro-batches are named by their index `mb` within the step. Receives return what the
    neighbour sent: an activation (a tensor or a tuple of tensors, its floating tensors requiring
    grad so that a backward reaches the sender's gradients) or the list of gradients of the
    floating tensors this side sent.
    """

    idle_s: float
    """Seconds spent waiting for a message the neighbour had not sent yet (a bubble)."""
    comm_s: float
    """Seconds spent moving data once it was on its way."""
    bytes_sent: int
    """Bytes of tensors sent, over the link's life."""

    def begin_step(self, micro: Sequence[Mapping[str, Any]]) -> None:
        """Start a step of `len(micro)` micro-batches (the batches themselves, for their shapes)."""
        ...

    def shape_probe(self) -> list[int]:
        """The micro-batches whose activations must go through the pipeline once, without
        gradients, before the step's actions (empty where shapes travel with the messages)."""
        ...

    def probe_send(self, mb: int, value: Value) -> None:
        """Send micro-batch `mb`'s probe activation (only for micro-batches `shape_probe` listed)."""
        ...

    def probe_recv(self, mb: int) -> Value:
        """Receive micro-batch `mb`'s probe activation (only for micro-batches `shape_probe` listed)."""
        ...

    def activation_ready(self, mb: int) -> bool:
        """Whether micro-batch `mb`'s activation has arrived (a receive would not wait)."""
        ...

    def recv_activation(self, mb: int) -> Value:
        """Micro-batch `mb`'s activation from the stage before, waiting for it if needed."""
        ...

    def send_activation(self, mb: int, value: Value, *, grad: bool = True) -> None:
        """Send micro-batch `mb`'s activation to the stage after; `grad=False`: no gradient will
        come back for it (evaluation), so nothing is posted for one."""
        ...

    def grad_ready(self, mb: int) -> bool:
        """Whether the gradient of micro-batch `mb`'s activation has arrived."""
        ...

    def recv_grad(self, mb: int) -> list[torch.Tensor]:
        """The gradients of micro-batch `mb`'s activation from the stage after, one per floating
        tensor sent, waiting for them if needed."""
        ...

    def send_grad(self, mb: int, inputs: Value) -> None:
        """Send the gradients that the backward left on micro-batch `mb`'s received `inputs` to
        the stage before."""
        ...

    def flush(self) -> None:
        """Send whatever the link holds back, before the step's collectives."""
        ...

    def finish(self) -> None:
        """Wait for every send of the step (their buffers stay alive until then)."""
        ...

    def close(self) -> None:
        """Release what the link runs in the background; after the last step."""
        ...


if TYPE_CHECKING:  # mypy checks each implementation against the contract here
    from varuna.comm.local import LocalLink
    from varuna.comm.p2p import P2P
    from varuna.comm.serial import SerialLink

    def _implementations(p2p: P2P, serial: SerialLink, local: LocalLink) -> list[Link]:
        return [p2p, serial, local]
