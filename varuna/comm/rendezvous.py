"""Rendezvous: turn a set of launched processes into one torch.distributed group.

MPI's process manager (``mpiexec``) starts the ranks and tears the job down when one dies; mpi4py is
used only here, once, to agree on the address of a ``TCPStore``. After that every tensor moves over
torch.distributed (gloo on CPU, NCCL on CUDA) and no rank sits in an MPI call, so nothing busy-polls.

    rank 0                      other ranks
    ------                      -----------
    allgather(hostname)  <--->  allgather(hostname)
    TCPStore(host, port 0)
    bcast((host, port))  ---->  TCPStore(host, port) as client
    init_process_group(store=...)  on every rank

When every rank runs on this host (the allgathered network stacks are all the same, as with no
hostfile: `varuna.comm.addresses.network_stack`), the store listens on 127.0.0.1 only and gloo
uses ``lo`` (``GLOO_SOCKET_IFNAME``): a TCPStore given host "127.0.0.1" would still listen on every
interface, so rank 0 binds the loopback socket itself and hands it over (``master_listen_fd``).
The store is unauthenticated; other hosts must not reach it when they have no business there. A
multi-host job advertises the address that routes to the other hosts, and every rank points gloo
at the interface that reaches it (`varuna.comm.addresses`: a host name resolving to 127.0.1.1, as
Debian writes it, or an inherited ``GLOO_SOCKET_IFNAME=lo`` would cut the hosts apart).

Placement contract (the engine relies on it): world rank ``r`` with pipeline depth ``P`` is
``stage = r % P`` and ``replica = r // P``, i.e. ``rank = replica * P + stage``.

Every wait of the rendezvous (the MPI barrier, reaching the store) ends after
``VARUNA_RENDEZVOUS_TIMEOUT_S`` (300 s) with a LaunchError that names what was awaited.

Under Slurm (``varuna run`` inside an allocation starts the ranks with ``srun --mpi=none`` and sets
``VARUNA_LAUNCHER=srun``) there is no MPI at all: each task knows its rank from ``SLURM_PROCID`` and the
world from ``SLURM_STEP_NUM_TASKS``; rank 0 starts the store and writes its address to
``RUN_DIR/rendezvous.json`` (tagged with ``VARUNA_JOB_ID``, so a file of an earlier launch is never
read as this one's), and the others read it there: the run directory is on the shared filesystem.

``import varuna.comm.rendezvous`` never imports mpi4py: a plain ``python train.py`` must not start MPI.
mpi4py is the optional ``varuna[mpi]`` extra, since only mpiexec's ranks meet through it; a rank that
mpiexec starts without it fails with a LaunchError that names the install (`check_mpi4py`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from varuna._files import write_json_atomic
from varuna._slurm import HostlistError, expand_hostlist
from varuna.comm.addresses import choose_gloo_interface, network_stack, outbound_ip
from varuna.errors import ConfigError, LaunchError

__all__ = [
    "host_layout",
    "LaunchEnv",
    "launch_env",
    "placement",
    "init_distributed",
    "group_timeout",
    "shutdown",
    "finalize_mpi",
    "check_mpi4py",
    "env_rank",
    "select_backend",
]

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0
"""How long a rank waits for the others to meet (``VARUNA_RENDEZVOUS_TIMEOUT_S``): generous, since
ranks on a loaded host may take long to import torch, but finite, so a rank that never comes fails
the job with a message instead of hanging it."""

# Variables that MPI process managers set in every rank they start (MPICH/hydra, Open MPI/PMIx, Intel MPI).
_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_MPI_MARKERS = (*_MPI_RANK_VARS, "PMI_SIZE", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class LaunchEnv:
    """What the varuna launcher told this process through ``VARUNA_*`` environment variables."""

    pipeline: int | None
    """Pipeline depth P (``VARUNA_PIPELINE``), or None when not set."""
    data: int | None
    """Data-parallel degree D (``VARUNA_DATA``), or None when not set."""
    run_dir: Path | None
    """The job's run directory (``VARUNA_RUN_DIR``): logs/, failures/, status/ live there."""
    launched: bool
    """True when this process runs under ``varuna.launch.worker`` (``VARUNA_LAUNCHED=1``)."""


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a positive integer (got {raw!r})") from None
    if value < 1:
        raise ConfigError(f"{name} must be a positive integer (got {value})")
    return value


def launch_env() -> LaunchEnv:
    """Read ``VARUNA_PIPELINE``, ``VARUNA_DATA``, ``VARUNA_RUN_DIR`` and ``VARUNA_LAUNCHED``.

    >>> os.environ["VARUNA_PIPELINE"] = "2"
    >>> launch_env().pipeline
    2
    """
    run_dir = os.environ.get("VARUNA_RUN_DIR", "").strip()
    return LaunchEnv(
        pipeline=_env_int("VARUNA_PIPELINE"),
        data=_env_int("VARUNA_DATA"),
        run_dir=Path(run_dir) if run_dir else None,
        launched=os.environ.get("VARUNA_LAUNCHED", "") == "1",
    )


def placement(rank: int, pipeline: int) -> tuple[int, int]:
    """Return ``(stage, replica)`` of world rank ``rank`` in a pipeline of depth ``pipeline``.

    >>> [placement(r, 2) for r in range(4)]
    [(0, 0), (1, 0), (0, 1), (1, 1)]
    """
    if pipeline < 1:
        raise ConfigError(f"pipeline depth must be >= 1 (got {pipeline})")
    if rank < 0:
        raise ConfigError(f"rank must be >= 0 (got {rank})")
    return rank % pipeline, rank // pipeline


def env_rank() -> int | None:
    """This process's world rank as announced by the process manager, before any rendezvous."""
    for name in (*_MPI_RANK_VARS, "RANK", "SLURM_PROCID"):
        raw = os.environ.get(name, "").strip()
        if raw.isdigit():
            return int(raw)
    return None


def select_backend() -> str:
    """The device seam: NCCL when CUDA is available, else gloo; ``VARUNA_BACKEND`` overrides."""
    import torch

    wanted = os.environ.get("VARUNA_BACKEND", "").strip().lower()
    if wanted in ("gloo", "nccl"):
        return wanted
    if wanted:
        raise ConfigError(f"VARUNA_BACKEND must be 'gloo' or 'nccl' (got {wanted!r})")
    return "nccl" if torch.cuda.is_available() else "gloo"


def _timeout(timeout_s: float | None) -> timedelta:
    if timeout_s is None:
        raw = os.environ.get("VARUNA_TIMEOUT", "").strip()
        try:
            timeout_s = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ConfigError(f"VARUNA_TIMEOUT must be a number of seconds (got {raw!r})") from None
    if timeout_s <= 0:
        raise ConfigError(f"the distributed timeout must be > 0 seconds (got {timeout_s})")
    return timedelta(seconds=timeout_s)


_GROUP_TIMEOUT: timedelta | None = None


def group_timeout() -> timedelta:
    """The timeout `init_distributed` gave the job's process group (``VARUNA_TIMEOUT``, else 120 s).

    Pass it to ``dist.new_group``: a subgroup's own default is 30 minutes, so a rank waiting in a
    data-parallel all-reduce for a peer whose host vanished would wait that long."""
    return _GROUP_TIMEOUT or _timeout(None)


def _under_mpi() -> bool:
    if any(name in os.environ for name in _MPI_MARKERS):
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    return bool(mpi is not None and mpi.Is_initialized() and mpi.COMM_WORLD.Get_size() > 1)


def check_mpi4py() -> None:
    """A LaunchError naming the install when mpi4py, through which mpiexec's ranks meet, is missing.

    Called by the rank that needs it and by the launcher before it starts mpiexec, so the fix comes
    once, before any rank runs."""
    if sys.modules.get("mpi4py") is None and importlib.util.find_spec("mpi4py") is None:
        raise LaunchError(
            f"mpi4py is not installed in this environment ({sys.prefix}), and the ranks mpiexec starts meet "
            'through it: `pip install "varuna[mpi]"` (mpi4py and MPICH), or `pip install mpi4py` beside '
            "your cluster's MPI; torchrun and srun launches need neither"
        )


def _import_mpi() -> Any:
    check_mpi4py()
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        # MPI_Init rather than MPI_Init_thread(MULTIPLE): only the main thread talks MPI, and only
        # during rendezvous; nothing is left to progress in the background.
        mpi4py.rc.threads = False
        # MPICH's shared-memory setup spins a core in MPI_Init until the slowest rank arrives (seconds
        # while ranks import torch on a small machine); our few bytes of MPI traffic don't need it.
        os.environ.setdefault("MPIR_CVAR_NOLOCAL", "1")
    from mpi4py import MPI

    return MPI


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; all of the machine's off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def host_layout() -> list[tuple[str, int]]:
    """Collective (torch.distributed): every rank's (host name, cores this process may run on),
    in rank order; the profile reads it to tell ranks sharing a host's cores apart from others."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (socket.gethostname(), usable_cores()))
    return [(str(h), int(c)) for h, c in every]


def _rendezvous_timeout_s() -> float:
    """``VARUNA_RENDEZVOUS_TIMEOUT_S``, else 300 s: how long a rank waits for the others to meet."""
    raw = os.environ.get("VARUNA_RENDEZVOUS_TIMEOUT_S", "").strip()
    try:
        value = float(raw) if raw else DEFAULT_RENDEZVOUS_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"VARUNA_RENDEZVOUS_TIMEOUT_S must be a number of seconds > 0 (got {raw!r})")
    return value


def _sleepy_barrier(comm: Any, timeout_s: float) -> None:
    """Wait for every rank without spinning (blocking MPI collectives busy-poll a core meanwhile);
    a LaunchError after `timeout_s`, since a rank that never arrives would otherwise hang the job."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout_s
    while not request.Test():
        if time.monotonic() > deadline:
            raise LaunchError(
                f"rank {comm.Get_rank()} waited {timeout_s:g} s for all {comm.Get_size()} ranks to reach the "
                "rendezvous (an MPI barrier) and some never did: a rank is stuck or died before it (see its log); "
                "raise VARUNA_RENDEZVOUS_TIMEOUT_S if the ranks only start slowly"
            )
        time.sleep(0.005)


def _store_client(host: str, port: int, rank: int, timeout_s: float, source: str) -> Any:
    """Connect to the rendezvous TCPStore, retrying for `timeout_s`; a LaunchError naming it if not."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise LaunchError(
            f"rank {rank} could not reach the rendezvous store at {host}:{port} ({source}) within "
            f"{timeout_s:g} s: {first}; is rank 0 running and reachable from this host? "
            "(VARUNA_RENDEZVOUS_TIMEOUT_S sets the wait)"
        ) from None


def _set_device(backend: str, local_rank: int) -> None:
    """With NCCL, give each rank on a host its own GPU (round-robin when ranks outnumber GPUs)."""
    if backend == "nccl":
        import torch

        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def _server_store(host: str, timeout: timedelta) -> Any:
    """The TCPStore server on a free port, listening on `host` alone when it is the loopback address."""
    import torch.distributed as dist

    if host != "127.0.0.1":
        return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns the listening socket from here on
    finally:
        sock.close()
    try:
        return dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=fd
        )
    except BaseException:
        try:
            os.close(fd)
        except OSError:  # the store closed it already
            pass
        raise


def _mpi_store(timeout: timedelta) -> tuple[Any, int, int, int]:
    """Rendezvous over MPI; return (store, rank, world size, local rank)."""

    comm = _import_mpi().COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    wait_s = _rendezvous_timeout_s()
    _sleepy_barrier(comm, wait_s)
    every: list[tuple[str, str]] = comm.allgather((socket.gethostname(), network_stack()))
    hosts = [host for host, _ in every]
    local_rank = hosts[:rank].count(hosts[rank])
    one_host = len({stack for _, stack in every}) == 1
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = None
    address: tuple[str, int] | str
    if rank == 0:
        try:
            host = "127.0.0.1" if one_host else outbound_ip(hosts)
            store = _server_store(host, timeout)
            address = (host, int(store.port))
        except Exception as exc:  # every rank must leave bcast, or the others would spin in MPI
            address = f"{type(exc).__name__}: {exc}"
    else:
        address = ""
    address = comm.bcast(address, root=0)
    if isinstance(address, str):
        raise LaunchError(f"rank 0 could not start the rendezvous store: {address}")
    if not one_host:
        choose_gloo_interface(address[0])
    if store is None:
        store = _store_client(address[0], address[1], rank, wait_s, "sent by rank 0")
        store.set_timeout(timeout)
    return store, rank, size, local_rank


def _under_srun() -> bool:
    """Started by `varuna run` through ``srun`` as one task of a Slurm job step."""
    return os.environ.get("VARUNA_LAUNCHER") == "srun" and "SLURM_PROCID" in os.environ


def _slurm_int(*names: str) -> int:
    for name in names:
        raw = os.environ.get(name, "").strip()
        if raw.isdigit():
            return int(raw)
    raise LaunchError(
        f"srun gave this task no {' or '.join(names)} (got {[os.environ.get(n) for n in names]}); "
        "start it with `varuna run` inside a Slurm allocation, or set VARUNA_LAUNCHER=mpiexec to use mpiexec"
    )


def _await_address(path: Path, job_id: str, rank: int, timeout_s: float) -> tuple[str, int]:
    """Wait until rank 0 of launch `job_id` has written its store's address to `path`."""
    deadline, pause = time.monotonic() + timeout_s, 0.02
    while True:
        try:
            record = json.loads(path.read_text())
            if record.get("job_id") == job_id:
                return str(record["host"]), int(record["port"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not there yet, or an earlier launch's
        if time.monotonic() > deadline:
            raise LaunchError(
                f"rank {rank} waited {timeout_s:g} s for rank 0 to write the rendezvous address of launch "
                f"{job_id} to {path} and it never did: is rank 0 running (see its log), and is the run "
                "directory on a filesystem every node shares? (VARUNA_RENDEZVOUS_TIMEOUT_S sets the wait)"
            )
        time.sleep(pause)
        pause = min(pause * 1.5, 0.25)


def _srun_store(timeout: timedelta) -> tuple[Any, int, int, int]:
    """Rendezvous of a Slurm job step through the run directory; return (store, rank, size, local rank)."""
    rank, size = _slurm_int("SLURM_PROCID"), _slurm_int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    local_rank = _slurm_int("SLURM_LOCALID") if "SLURM_LOCALID" in os.environ else 0
    run_dir, job_id = os.environ.get("VARUNA_RUN_DIR", ""), os.environ.get("VARUNA_JOB_ID", "")
    if not run_dir or not job_id:
        raise ConfigError(
            "a task started by srun with VARUNA_LAUNCHER=srun needs VARUNA_RUN_DIR (a directory every node "
            f"shares) and VARUNA_JOB_ID (got {run_dir!r}, {job_id!r}); start the job with `varuna run`"
        )
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
    try:
        nodes = expand_hostlist(nodelist)
    except HostlistError as exc:
        raise LaunchError(f"cannot read the step's SLURM_STEP_NODELIST {nodelist!r}: {exc}") from None
    one_host = len(set(nodes)) == 1
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    path, wait_s = Path(run_dir) / "rendezvous.json", _rendezvous_timeout_s()
    if rank == 0:
        host = "127.0.0.1" if one_host else outbound_ip(nodes)
        store = _server_store(host, timeout)
        step = f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}"
        record = {"job_id": job_id, "host": host, "port": int(store.port), "world": size, "slurm_step": step}
        write_json_atomic(path, record)  # the step lets the launcher signal every task (scancel)
    else:
        host, port = _await_address(path, job_id, rank, wait_s)
        store = _store_client(host, port, rank, wait_s, f"read from {path}")
        store.set_timeout(timeout)
    if not one_host:
        choose_gloo_interface(host)
    return store, rank, size, local_rank


def init_distributed(*, timeout_s: float | None = None) -> tuple[int, int]:
    """Initialise torch.distributed for this process and return ``(rank, world_size)``.

    Under an MPI launch the ranks meet through mpi4py, under ``srun`` through the run directory (see
    the module docstring); otherwise this is a one-process group on loopback, so single-process code
    paths use the same collectives. A
    torchrun-style environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) is
    honoured too. Idempotent. ``timeout_s`` defaults to ``VARUNA_TIMEOUT`` or 120 s.

    >>> rank, world = init_distributed()   # doctest: +SKIP
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    global _GROUP_TIMEOUT
    timeout = _GROUP_TIMEOUT = _timeout(timeout_s)
    backend = select_backend()
    if _under_srun() or _under_mpi():
        store, rank, size, local_rank = _srun_store(timeout) if _under_srun() else _mpi_store(timeout)
        _set_device(backend, local_rank)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    elif all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        _set_device(backend, int(os.environ.get("LOCAL_RANK", "0")))
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # torchrun hosts it
            store = dist.TCPStore(host, port, size, is_master=True, wait_for_workers=False, timeout=timeout)
        else:
            store = _store_client(host, port, rank, _rendezvous_timeout_s(), "MASTER_ADDR:MASTER_PORT")
            store.set_timeout(timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = _server_store("127.0.0.1", timeout)
        _set_device(backend, 0)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    from varuna.comm import nccl_rules

    if backend == "gloo" and nccl_rules.wanted():  # point-to-point under NCCL's rules
        nccl_rules.install(timeout.total_seconds(), strict=nccl_rules.strict_wanted())
    return dist.get_rank(), dist.get_world_size()


def shutdown() -> None:
    """Destroy the default process group if one is initialised (safe to call twice)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def finalize_mpi() -> None:
    """Finalise MPI if this process initialised it; call it last, on a clean exit.

    ``MPI_Finalize`` waits (sleeping, not spinning) until every rank reaches it. It matters: the
    process manager treats a rank that exits *without* finalising as failed and kills the job, which
    is exactly what a failing rank wants (``os._exit(1)``) and what a finished one must avoid.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
