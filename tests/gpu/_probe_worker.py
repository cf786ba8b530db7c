"""GPU check, 2 ranks: which point-to-point patterns the job's transport completes, one per job.

    varuna run --pipeline 2 tests/gpu/_probe_worker.py OUT CASE

The pipeline's messages rest on a few patterns; each case isolates one, so a run that hangs says
which (run_gpu_checks.py launches one job per case, each with a short timeout, and a hung case
costs only that). Every case moves known values and checks them exactly; each rank writes
OUT/probe-rank{r}.json. The cases, from the simplest:

- one-group:  rank 0 sends to rank 1 and back, on one new group (one communicator);
- two-groups: one group per direction, warmed in one order (`varuna.comm.groups.warm`), used one
              after the other (each operation finished on the device before the next is posted);
- batched:    one group, each round's send and receive posted together (`batch_isend_irecv`, as
              torch.distributed.pipelining does) and finished before the next round;
- recv-barrier: rank 1 posts its receive, then joins a barrier (the default group) that rank 0
              passes before it sends, as the p2p check's worker does at each step's start;
- early-recv: rank 0 posts its receive on the second group before its send on the first and
              waits for both: two communicators of one process in flight at once, as a stage
              with an early gradient receive has;
- both-early: rank 1 also posts its next receive on the first group before it sends on the
              second (what the runtime does every micro-batch);
- link:       `varuna.comm.groups.pair_link`'s P2P, 2 steps x 3 micro-batches, every header
              receive posted at the start of a step (as the runtime does);
- serial:     `varuna.comm.serial`'s links (the engine's on NCCL): one group, each new batch
              shape probed first, sends batched with the next receive, the same 2 steps x 3
              micro-batches.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from varuna.comm.groups import pair_link, warm
from varuna.comm.serial import Courier, SerialLink, replica_group

CASES = ("one-group", "two-groups", "batched", "recv-barrier", "early-recv", "both-early", "link", "serial")


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _groups(n: int, device: torch.device) -> list[object]:
    made = [dist.new_group([0, 1]) for _ in range(n)]
    warm([(g, 0, 1) for g in made], dist.get_rank(), device)
    return made


def _full(v: float, device: torch.device) -> torch.Tensor:
    return torch.full((1024,), v, device=device)


def _got(t: torch.Tensor) -> float:
    return float(t[0].item()) if bool((t == t[0]).all()) else float("nan")


def _done(work: Any, device: torch.device) -> None:
    """Wait for `work` and, on a GPU, until the device has finished it too."""
    work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batched(rank: int, device: torch.device) -> list[float]:
    """Rounds of [send activation k, receive gradient k - 1] against [receive activation k, send
    gradient k - 1], each round one batch."""
    (g,) = _groups(1, device)
    seen: list[float] = []
    act, grad = torch.zeros(1024, device=device), torch.zeros(1024, device=device)
    for k in range(4):
        ops = []
        if rank == 0:
            if k < 3:
                ops.append(dist.P2POp(dist.isend, _full(k + 1.0, device), 1, g))
            if k > 0:
                ops.append(dist.P2POp(dist.irecv, grad, 1, g))
        else:
            if k < 3:
                ops.append(dist.P2POp(dist.irecv, act, 0, g))
            if k > 0:
                ops.append(dist.P2POp(dist.isend, 2 * got, 0, g))  # noqa: F821 - the previous round's
        for work in dist.batch_isend_irecv(ops):
            _done(work, device)
        if rank == 0 and k > 0:
            seen.append(_got(grad))
        if rank == 1 and k < 3:
            got = act.clone()
            seen.append(_got(got))
    return seen


def _steps(link: Any, rank: int, device: torch.device, *, headers_first: bool) -> list[float]:
    """2 steps x 3 micro-batches through `link`: rank 0 sends each activation and receives its
    gradient, rank 1 the other way round (with `headers_first`, every header receive posted at the
    start of a step, as the runtime does with `P2P`). The values this rank received."""
    seen: list[float] = []
    for step in range(2):
        if not headers_first:
            link.begin_step([{}] * 3)
            for mb in link.shape_probe():  # serial links: each new batch shape sent once first
                if rank == 0:
                    link.probe_send(mb, _full(-1.0, device))
                else:
                    link.probe_recv(mb)
        for mb in range(3):
            if rank == 0:
                link.send_activation(mb, _full(10.0 * step + mb, device))
                seen.append(_got(link.recv_grad(mb)[0]))
                continue
            if mb == 0 and headers_first:
                for m in range(3):
                    link.post_activation_header(m)
            x = link.recv_activation(mb)
            assert isinstance(x, torch.Tensor)
            seen.append(_got(x))
            x.grad = 2 * x.detach()
            link.send_grad(mb, x)
        link.flush()
        link.finish()
    return seen


def case(name: str, rank: int, device: torch.device) -> list[float]:
    """Run one case; the values this rank received, in order."""
    seen: list[float] = []
    buf = torch.zeros(1024, device=device)
    if name == "one-group":
        (g,) = _groups(1, device)
        if rank == 0:
            dist.isend(_full(1.0, device), 1, group=g).wait()
            dist.irecv(buf, 1, group=g).wait()
        else:
            dist.irecv(buf, 0, group=g).wait()
            dist.isend(buf * 2, 0, group=g).wait()
        seen.append(_got(buf))
    elif name == "recv-barrier":
        (g,) = _groups(1, device)
        for k in range(3):
            if rank == 1:
                work = dist.irecv(buf, 0, group=g)
                dist.barrier()
                _done(work, device)
                seen.append(_got(buf))
                _done(dist.isend(buf * 2, 0, group=g), device)
            else:
                dist.barrier()
                _done(dist.isend(_full(k + 1.0, device), 1, group=g), device)
                _done(dist.irecv(buf, 1, group=g), device)
                seen.append(_got(buf))
    elif name == "batched":
        seen = _batched(rank, device)
    elif name in ("two-groups", "early-recv", "both-early"):
        act, grad = _groups(2, device)
        nbuf, nxt = torch.zeros(1024, device=device), None
        for k in range(3):
            if rank == 0:
                if name == "two-groups":
                    _done(dist.isend(_full(k + 1.0, device), 1, group=act), device)
                    _done(dist.irecv(buf, 1, group=grad), device)
                else:
                    back = dist.irecv(buf, 1, group=grad)  # posted before the send on the other group
                    sent = dist.isend(_full(k + 1.0, device), 1, group=act)
                    sent.wait()
                    back.wait()
                seen.append(_got(buf))
            else:
                if nxt is None:
                    _done(dist.irecv(buf, 0, group=act), device)
                else:
                    nxt.wait()  # posted in the previous round
                    buf.copy_(nbuf)
                got = buf.clone()
                nxt = None
                if name == "both-early" and k < 2:
                    nxt = dist.irecv(nbuf, 0, group=act)  # the next activation's, before the send
                if name == "two-groups":
                    _done(dist.isend(got * 2, 0, group=grad), device)
                else:
                    dist.isend(got * 2, 0, group=grad).wait()
                seen.append(_got(got))
    elif name == "link":
        p2p = pair_link(rank, device)
        assert p2p is not None
        seen = _steps(p2p, rank, device, headers_first=True)
        p2p.close()
    elif name == "serial":
        courier = Courier(replica_group(2, 1, 0, device), device)
        link = SerialLink(None, 1, device, courier) if rank == 0 else SerialLink(0, None, device, courier)
        seen = _steps(link, rank, device, headers_first=False)
    else:
        raise SystemExit(f"unknown case {name!r}; expected one of {CASES}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    return seen


def main() -> None:
    out, name = Path(sys.argv[1]), sys.argv[2]
    rank, device = dist.get_rank(), _device()
    t0 = time.perf_counter()
    seen = case(name, rank, device)
    result = {"case": name, "rank": rank, "seen": seen, "seconds": round(time.perf_counter() - t0, 3)}
    (out / f"probe-rank{rank}.json").write_text(json.dumps(result))
    print(f"probe {name}: rank {rank} saw {seen}", flush=True)


if __name__ == "__main__":
    main()
