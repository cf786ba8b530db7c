"""Network measurement for the profiler: point-to-point latency and bandwidth, and all-reduce time
against size for each data-parallel group size, along the stage layout the engine uses
(rank r is stage r % P of replica r // P, so the group of stage s is {s, s+P, s+2P, ...}).

The all-reduce curves are measured for every world size w dividing the job's (only ranks < w
active, all groups of that layout at once): a 1 x 2 job reduces alone, a 2 x 2 job's two groups
reduce together, and on a shared host the difference is real (`NetworkCost.allreduce_by_world`).

Collective: every rank of the job calls `profile_network()`; all get the same `NetworkCost`.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from varuna.comm.rendezvous import host_layout
from varuna.comm.serial import wanted as serial_links
from varuna.errors import ConfigError
from varuna.planner.costs import NetworkCost

__all__ = ["profile_network", "NETWORK_SIZES"]

NETWORK_SIZES: tuple[int, ...] = (2**12, 2**16, 2**20, 2**23, 2**25)
"""Bytes per all-reduce measured by default: from latency-bound to a 25 MB gradient bucket."""
MAX_ALLREDUCE_S = 1.0
"""An all-reduce size whose time, extrapolated from the last one measured, exceeds this many
seconds is not measured, nor any larger one (on a slow network the profile would take minutes);
the planner extrapolates the curve's last slope beyond its largest point."""
MESSAGE_BYTES = 2**16
"""Bytes of the activation whose per-message costs (`NetworkCost.message_s`) are measured."""


def _comm_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def _timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples = []
    for rep in range(repeats + 1):
        start = time.perf_counter()
        fn()
        sync()
        if rep:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _p2p(rank: int, device: torch.device, nbytes: int, repeats: int, peer: int = 1) -> tuple[float, float]:
    """(latency s, bandwidth B/s) between ranks 0 and `peer` by ping-pong; the same on every rank."""
    small = torch.zeros(1, device=device)
    big = torch.zeros(max(nbytes // 4, 1), device=device)
    result = torch.zeros(2, dtype=torch.float64, device=device)

    def roundtrip(out: torch.Tensor) -> None:  # rank 0 sends `out`, the peer answers one float
        if rank == 0:
            dist.send(out, peer)
            dist.recv(small, peer)
        else:
            dist.recv(out, 0)
            dist.send(small, 0)

    if rank in (0, peer):
        latency = _timed(lambda: roundtrip(small), device, 10 * repeats) / 2
        transfer = _timed(lambda: roundtrip(big), device, repeats)
        moved = transfer - 2 * latency
        result[0], result[1] = latency, big.numel() * 4 / (moved if moved > 0 else transfer)
    dist.broadcast(result, src=0)
    return float(result[0]), float(result[1])


def _busy(seconds: float, work: torch.Tensor) -> None:
    """Keep this rank's core busy for `seconds`, as a stage computing its next action does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        work @ work


def _messages(
    rank: int,
    device: torch.device,
    nbytes: int,
    repeats: int,
    transfer_s: float,
    busy_s: float = 0.005,
) -> tuple[dict[str, float], bool]:
    """What the runtime's own transfer code (`varuna.comm.p2p.P2P`) costs per message between ranks 0
    (stage 0) and 1 (stage 1) beyond `transfer_s` (`p2p_time(nbytes)` of bare tensors), and whether
    the transport reports a message's arrival before it is waited for; the same on every rank.

        SEND_F   rank 0 sends an activation of `nbytes` (header + data, posts its gradient's receive)
        RECV_F   rank 1 receives it, the header long there and rank 0 computing meanwhile
        SEND_B   rank 1 sends the gradient back
        RECV_B   rank 0 receives it, sent while it was computing
        DELAY_F  how much later than `transfer_s` an activation reaches a stage waiting for it: a
                 round trip (activation there, gradient back) with both ranks waiting, less the
                 four costs above and two transfers: each hop wakes a sleeping rank. Both
                 receives are posted before the value is sent, as in a step after the first
                 (the activation's to the receives posted early with its shape, `varuna.comm.p2p`).

    The arrival report is what the runtime's pull-ahead asks (`P2P.activation_ready`): gloo's
    receives say "not completed" until waited for, however long the message has been there.
    """
    from varuna.comm.groups import pair_link

    out = torch.zeros(6, dtype=torch.float64, device=device)
    group = dist.new_group([0, 1])  # collective: every rank of the job creates it
    p2p = pair_link(rank, device)  # collective too
    if p2p is not None:
        work = torch.randn(64, 64, device=device)
        act = torch.randn(max(nbytes // 4, 1), device=device)
        samples: list[list[float]] = [[], [], [], [], []]
        reported = 0
        # two micro-batch slots, reused as a step reuses its micro-batches: from the second round
        # on, an activation goes to the receives posted early with its shape (`varuna.comm.p2p`)
        for m in range(2 * (repeats + 1)):
            slot = m % 2
            busy = slot == 0  # even: the costs with the other rank computing; odd: a round trip
            if rank == 1:
                p2p.post_activation_header(slot)
            dist.barrier(group=group)
            if rank == 0:
                t0 = time.perf_counter()
                p2p.send_activation(slot, act)
                t1 = time.perf_counter()
                if busy:
                    _busy(2 * busy_s, work)
                t2 = time.perf_counter()
                p2p.recv_grad(slot)
                t3 = time.perf_counter()
                if m >= 2:
                    if busy:
                        samples[0].append(t1 - t0)
                        samples[3].append(t3 - t2)
                    else:
                        samples[4].append(t3 - t0)
            else:
                if busy:
                    _busy(busy_s, work)  # the header arrives meanwhile
                    reported += p2p.activation_ready(slot)
                t0 = time.perf_counter()
                value = p2p.recv_activation(slot)
                t1 = time.perf_counter()
                value.grad = torch.ones_like(value)
                t2 = time.perf_counter()
                p2p.send_grad(slot, value)
                t3 = time.perf_counter()
                if m >= 2 and busy:
                    samples[1].append(t1 - t0)
                    samples[2].append(t3 - t2)
        p2p.finish()
        p2p.close()
        if rank == 0:
            out[0], out[3], out[5] = (statistics.median(samples[i]) for i in (0, 3, 4))
        else:
            out[1], out[2], out[4] = statistics.median(samples[1]), statistics.median(samples[2]), reported
    dist.destroy_process_group(group)
    dist.all_reduce(out)
    send_f, recv_f, send_b, recv_b, reported_any, round_trip = out.tolist()
    delay = max(round_trip - (send_f + recv_f + send_b + recv_b) - 2 * transfer_s, 0.0)
    costs = {"SEND_F": send_f, "RECV_F": recv_f, "SEND_B": send_b, "RECV_B": recv_b, "DELAY_F": delay}
    return costs, reported_any > 0


def _message_cpu(
    rank: int, device: torch.device, sizes: Sequence[int], repeats: int
) -> list[tuple[int, float]]:
    """(bytes, seconds) for each of `sizes`: the CPU time one message costs ranks 0 and 1 together,
    the same on every rank.

    A round trip of the runtime's own transfer code (`varuna.comm.p2p.P2P`: an activation of that size
    to rank 1, its gradient back) runs between two pauses; each rank's process CPU time over it
    (its main thread and the transport's threads) is summed, the median over `repeats` round
    trips halved. The pause after the round trip lets the transport's threads finish their share.
    Nothing else runs then, so it is the transfer's own work; on an oversubscribed host that work
    takes core time from the computing stages (`varuna.planner.sharing`).
    """
    from varuna.comm.groups import pair_link

    out = torch.zeros(len(sizes), dtype=torch.float64, device=device)
    group = dist.new_group([0, 1])  # collective: every rank of the job creates it
    p2p = pair_link(rank, device)  # collective too
    if p2p is not None:
        for i, nbytes in enumerate(sizes):
            act = torch.randn(max(nbytes // 4, 1), device=device)
            samples = []
            for m in range(2 * (repeats + 1)):
                slot = m % 2  # two micro-batch slots, reused as a step reuses them (see _messages)
                if rank == 1:
                    p2p.post_activation_header(slot)
                dist.barrier(group=group)
                time.sleep(0.002)
                c0 = time.process_time()
                if rank == 0:
                    p2p.send_activation(slot, act)
                    p2p.recv_grad(slot)
                else:
                    value = p2p.recv_activation(slot)
                    value.grad = torch.ones_like(value)
                    p2p.send_grad(slot, value)
                time.sleep(0.003)
                if m >= 2:
                    samples.append(time.process_time() - c0)
            out[i] = statistics.median(samples) / 2
        p2p.finish()
        p2p.close()
    dist.destroy_process_group(group)
    dist.all_reduce(out)
    return [(int(b), float(t)) for b, t in zip(sizes, out.tolist())]


def _delivery(
    rank: int, world: int, device: torch.device, nbytes: int, repeats: int, transfer_s: float
) -> dict[int, dict[str, float]]:
    """n -> {"F": s, "B": s, "SEND_F": s, "SEND_B": s}: how much later than `transfer_s` an
    activation (F) or a gradient (B) sent by the runtime's own code (`varuna.comm.p2p.P2P`) reaches a
    stage waiting for it while n ranks compute (the sender, which goes on computing as a stage does
    after a send, and n - 1 others), and how long the send itself keeps the sender busy, for
    n = 1 .. world - 1; {} when ranks 0 and 1 are on different hosts.

    On a host with fewer cores than busy ranks this is the scheduler's doing, not the wire's: the
    transport's threads of the computing sender and of the receiver need a core, and the waiting
    rank needs one to wake up, so the delay can be several times the idle round trip. An
    activation's receive is posted early here, as in the runtime.
    The sender stamps the value with its clock and the receiver reads the stamp when the value is
    in, so both must share a monotonic clock: ranks on one host.
    """
    from varuna.comm.groups import pair_link

    hosts = [h for h, _ in host_layout()]
    if world < 2 or hosts[0] != hosts[1]:
        return {}
    out = torch.zeros(max(world - 1, 1), 4, dtype=torch.float64, device=device)
    p2p = pair_link(rank, device)  # collective: every rank creates its groups
    work = torch.randn(64, 64, device=device)
    stamp = torch.zeros(max(nbytes // 8, 1), dtype=torch.float64, device=device)
    m = 0  # one micro-batch slot throughout: after the first message, sent to early receives
    for n in range(1, world):
        samples: list[list[float]] = [[], [], [], []]  # delivery F, B; send F, B
        for rep in range(repeats + 1):
            if rank == 1:
                p2p.post_activation_header(m)  # type: ignore[union-attr]
            dist.barrier()
            if rank == 0:
                assert p2p is not None
                _busy(0.002, work)
                stamp[0] = t0 = time.perf_counter()
                p2p.send_activation(m, stamp)
                if rep:
                    samples[2].append(time.perf_counter() - t0)
                _busy(0.001, work)
                grad = p2p.recv_grad(m)[0]
                if rep:
                    samples[1].append(time.perf_counter() - float(grad[0]))
            elif rank == 1:
                assert p2p is not None
                value = p2p.recv_activation(m)
                if rep:
                    samples[0].append(time.perf_counter() - float(value.detach()[0]))
                _busy(0.005, work)
                value.grad = torch.zeros_like(value)
                value.grad[0] = t0 = time.perf_counter()
                p2p.send_grad(m, value)
                if rep:
                    samples[3].append(time.perf_counter() - t0)
                _busy(0.010, work)
            elif rank <= n:
                _busy(0.025, work)
        if rank == 0:
            out[n - 1, 1], out[n - 1, 2] = statistics.median(samples[1]), statistics.median(samples[2])
        elif rank == 1:
            out[n - 1, 0], out[n - 1, 3] = statistics.median(samples[0]), statistics.median(samples[3])
    if p2p is not None:
        p2p.finish()
        p2p.close()
    dist.all_reduce(out)
    return {
        n: {"F": max(f - transfer_s, 0.0), "B": max(b - transfer_s, 0.0), "SEND_F": sf, "SEND_B": sb}
        for n, (f, b, sf, sb) in enumerate(out.tolist(), start=1)
    }


def _allreduce(
    group_size: int, active: int, rank: int, sizes: Sequence[int], repeats: int, device: torch.device
) -> list[tuple[int, float]]:
    """(bytes, seconds) of all-reduces in the data-parallel groups {s, s+P, s+2P, ...}, P = active/g,
    of a job of `active` ranks (ranks >= `active` only wait).

    Every group runs at once, as the stages' gradient all-reduces do; the slowest group counts.
    Sizes stop where one would take longer than `MAX_ALLREDUCE_S`.
    """
    stride = active // group_size
    groups = [dist.new_group([s + r * stride for r in range(group_size)]) for s in range(stride)]
    mine = groups[rank % stride] if rank < active else None
    if mine is not None:
        dist.all_reduce(torch.zeros(1, device=device), group=mine)  # a new group connects lazily
    curve: list[tuple[int, float]] = []
    for nbytes in sizes:
        if curve and curve[-1][1] * nbytes / curve[-1][0] > MAX_ALLREDUCE_S:
            break  # every rank decides alike: the times are the same everywhere
        buf = torch.zeros(max(nbytes // 4, 1), device=device)
        took = torch.zeros(1, dtype=torch.float64, device=device)
        dist.barrier()
        if mine is not None:
            took[0] = _timed(functools.partial(dist.all_reduce, buf, group=mine), device, repeats)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        curve.append((int(nbytes), float(took[0])))
    for group in groups:
        dist.destroy_process_group(group)
    return curve


def profile_network(
    *,
    sizes: Sequence[int] = NETWORK_SIZES,
    group_sizes: Sequence[int] | None = None,
    p2p_bytes: int = 2**22,
    repeats: int = 3,
) -> NetworkCost:
    """Measure point-to-point and all-reduce costs; a collective call on every rank of the job.

    Latency is half a round trip of one float between ranks 0 and 1; bandwidth comes from a
    `p2p_bytes` message. For every group size g (default: each divisor of the world size >= 2) the
    all-reduce of each size in `sizes` (bytes) runs in the groups of the stage layout; with
    `group_sizes=None` also for each smaller world size w dividing the world and each g dividing w
    (`allreduce_by_world`). Every rank returns the same result. Takes a few seconds.

    The runtime's message costs (`message_s`, `delivery_s`, `message_cpu`) are measured through
    the early-receive links (`varuna.comm.p2p`, gloo's); where the engine takes the serial links
    (NCCL, `varuna.comm.serial`) they are left out (the simulator then prices bare transfers) and
    `reports_arrival` is False (the serial links run no pull-ahead).
    """
    if not dist.is_initialized():
        raise ConfigError(
            "profile_network() is collective: call it on every rank of a job, after "
            "varuna.comm.rendezvous.init_distributed() (or run under `varuna run` / `varuna profile`)"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise ConfigError(
            f"measuring the network needs >= 2 ranks, the job has {world}; use --gpus 2 or more"
        )
    wanted = (
        sorted(set(group_sizes))
        if group_sizes is not None
        else [g for g in range(2, world + 1) if world % g == 0]
    )
    bad = [g for g in wanted if g < 2 or world % g]
    if bad or not wanted:
        raise ConfigError(
            f"group_sizes {list(group_sizes or [])}: each must be >= 2 and divide the world size {world}"
        )
    device = _comm_device()
    latency, bandwidth = _p2p(rank, device, p2p_bytes, repeats)
    gpus_per_host, inter_latency, inter_bandwidth = _between_hosts(rank, device, p2p_bytes, repeats)
    duplex = _duplex(rank, device, inter_bandwidth, repeats) if gpus_per_host else {}
    transfer = latency + MESSAGE_BYTES / bandwidth
    if serial_links(device, 1, "1f1b"):  # NCCL: the engine's links are not the early ones measured here
        messages: dict[str, float] = {}
        delivery: dict[int, dict[str, float]] = {}
        message_cpu: list[tuple[int, float]] = []
        reports_arrival = False
    else:
        messages, reports_arrival = _messages(rank, device, MESSAGE_BYTES, 10 * repeats, transfer)
        delivery = _delivery(rank, world, device, MESSAGE_BYTES, 3 * repeats, transfer)
        message_cpu = _message_cpu(rank, device, (MESSAGE_BYTES, 16 * MESSAGE_BYTES), 10 * repeats)
    curves = {g: _allreduce(g, world, rank, sizes, repeats, device) for g in wanted}
    by_world = {world: dict(curves)}
    if group_sizes is None:
        for w in (w for w in range(2, world) if world % w == 0):
            by_world[w] = {
                g: _allreduce(g, w, rank, sizes, repeats, device) for g in range(2, w + 1) if w % g == 0
            }
    return NetworkCost(
        p2p_latency_s=latency,
        p2p_bandwidth_Bps=bandwidth,
        allreduce=curves,
        allreduce_by_world=by_world,
        message_s=messages,
        reports_arrival=reports_arrival,
        delivery_s=delivery,
        message_cpu=message_cpu,
        gpus_per_host=gpus_per_host,
        inter_host_latency_s=inter_latency,
        inter_host_bandwidth_Bps=inter_bandwidth,
        inter_host_duplex=duplex,
    )


def _between_hosts(rank: int, device: torch.device, nbytes: int, repeats: int) -> tuple[int, float, float]:
    """(ranks per host, latency s, bandwidth B/s) of the network between hosts, for a job whose
    ranks span several: a ping-pong between rank 0 and the first rank on another host, as the
    planner's `Cluster` prices every crossing (`varuna.planner.cluster`). (0, 0.0, 0.0) on one host;
    the same on every rank.

    Hosts must hold the same number of ranks (the planner's model of a cluster); ranks 0 and 1
    share a host for the intra-host measurements, which a launcher filling hosts in rank order
    gives."""
    hosts = [h for h, _ in host_layout()]
    if len(set(hosts)) == 1:
        return 0, 0.0, 0.0
    counts = {h: hosts.count(h) for h in hosts}
    if len(set(counts.values())) > 1:
        raise ConfigError(
            f"the profile's ranks sit unevenly on hosts ({', '.join(f'{h}: {n}' for h, n in counts.items())}); "
            "give every host of the hostfile the same number of slots, as the planner models a cluster "
            "of equal hosts"
        )
    peer = next(r for r, h in enumerate(hosts) if h != hosts[0])
    latency, bandwidth = _p2p(rank, device, nbytes, repeats, peer=peer)
    return counts[hosts[0]], latency, bandwidth


DUPLEX_SECONDS = 0.05
"""About how long one message of the duplex measurement (`_duplex`) takes alone on the link between
hosts: long enough that the link, not the latency, sets its time."""
DUPLEX_MESSAGES = 4
"""Messages each flow of the duplex measurement sends back to back, as a stage sends its micro-batches."""


def _duplex(rank: int, device: torch.device, bandwidth: float, repeats: int) -> dict[int, float]:
    """k -> how many times longer k flows between two hosts take while k other flows go the other
    way than while the link carries them alone (`NetworkCost.inter_host_duplex`), for k = 1 .. ranks
    per host; the same on every rank.

    A pipeline whose stages sit on different hosts sends activations one way and gradients the
    other, each direction on a process group of its own (`varuna.comm.p2p`), and so here: flow i
    goes from the i-th rank of the first host to the i-th rank of another, the opposite flow back,
    each a stream of `DUPLEX_MESSAGES` messages of about `DUPLEX_SECONDS` at the measured
    `bandwidth` (64 KiB to 4 MiB). On a link that queues data behind a rate limit (a shaped or busy
    Ethernet link), one direction's acknowledgements wait behind the other direction's data, so
    both slow down although each direction has its own bandwidth. The figure is the ratio of the
    mean times until every flow is done, over 2 x `repeats` rounds of each pattern."""
    hosts = [h for h, _ in host_layout()]
    a = [r for r, h in enumerate(hosts) if h == hosts[0]]
    other = next(h for h in hosts if h != hosts[0])
    b = [r for r, h in enumerate(hosts) if h == other]
    forward, backward = dist.new_group(), dist.new_group()  # collective: every rank creates both
    nbytes = int(min(max(DUPLEX_SECONDS * bandwidth, 2**16), 2**22))
    out = torch.zeros(max(nbytes // 4, 1), device=device)
    into = [torch.empty_like(out) for _ in range(2 * DUPLEX_MESSAGES)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    done = torch.zeros(1, dtype=torch.float64, device=device)

    def streams(flows: list[tuple[int, int]]) -> float:
        """Seconds from a common start until every flow (sender, receiver) has delivered its stream."""
        dist.barrier()
        start = time.perf_counter()
        works = []
        for src, dst in flows:
            group = forward if src in a else backward
            if src == rank:
                works += [dist.isend(out, dst, group=group) for _ in range(DUPLEX_MESSAGES)]
            if dst == rank:
                slots = into[:DUPLEX_MESSAGES] if src in a else into[DUPLEX_MESSAGES:]
                works += [dist.irecv(x, src, group=group) for x in slots]
        for work in works:
            if work is not None:  # None: not this rank's group (never here, every rank is in both)
                work.wait()
        sync()
        done[0] = time.perf_counter() - start
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        return float(done[0])

    factors = {}
    for k in range(1, min(len(a), len(b)) + 1):
        one_way = [(a[i], b[i]) for i in range(k)]
        both_ways = one_way + [(b[i], a[i]) for i in range(k)]
        streams(both_ways)  # warm-up: the groups' connections
        alone, beside = [], []
        for _ in range(2 * repeats):
            alone.append(streams(one_way))
            beside.append(streams(both_ways))
        factors[k] = statistics.fmean(beside) / statistics.fmean(alone)
    dist.destroy_process_group(forward)
    dist.destroy_process_group(backward)
    return factors
