"""The storage layer under varuna.checkpoint.layout: tensors' raw bytes to files and back, checked.

torch.distributed.checkpoint (DCP) plans who writes and reads which tensor, by name (and writes
replicated copies once); a StorageWriter/StorageReader pair moves the bytes. DCP's stock pair
writes every tensor as a torch.save archive (a copy, and a zip CRC) and reads it back through
torch.load (two more copies). `Writer` here writes each tensor's bytes from its own memory, one
file per rank, computes their CRC-32 from that memory on a helper thread meanwhile (never by
reading the file back), and asks the kernel to start writing back every `WRITEBACK` bytes so
that the disk works while the rest is copied (the fsync at the end makes the file durable). The
extents (file, offset, length, CRC-32) are DCP's per-item storage data. DCP's own writer pickles
its metadata into `.metadata` and its reader unpickles it, so a forged file would run code on load:
`Writer.finish` writes `metadata.json` instead and `Reader.read_metadata` (and `read_metadata`, for
every other reader here) rebuilds DCP's Metadata from it (`varuna.checkpoint._plain`); no pickle is
written or read. A failed write (a full disk: ENOSPC) is a CheckpointError naming the file and the
fix. `Reader` reads each extent straight into its destination tensor; the coordinator
gives every extent to one of the ranks that read it to check, balancing the bytes
(`Reader.prepare_global_plan`), and DCP hands what any rank raised to every rank, which
`dcp_errors` turns back into the CheckpointError naming the file.

    extent:   __0_0.distcp  [ model.wte.weight | optim.wte.weight.exp_avg | ... ]
              offset 0 ------^ length, crc32 --^
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import os
import sys
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from varuna.checkpoint import _plain
from varuna.errors import CheckpointError

__all__ = [
    "Writer",
    "Reader",
    "Extent",
    "FORMAT",
    "checksum",
    "file_crc",
    "read_metadata",
    "verify_extents",
    "dcp_errors",
    "write_failed",
]

FORMAT = 3
"""3: metadata and extra values in JSON, no pickle (2 pickled DCP's metadata; 1 was DCP's torch.save records)."""

CHUNK = 1 << 22
WRITEBACK = 64 << 20


def checksum(data: Any, crc: int = 0) -> int:
    """CRC-32 of `data` (any buffer), continuing from `crc`; every checksum here goes through it."""
    return zlib.crc32(data, crc)


def _crc_of(data: memoryview) -> int:
    crc = 0
    for start in range(0, len(data), CHUNK):
        crc = checksum(data[start : start + CHUNK], crc)
    return crc


class _Checksums:
    """CRC-32s computed on a helper thread beside the I/O (zlib and file I/O release the GIL): a
    rank kept waiting by its disk or page faults, or one whose share of the bytes is the larger,
    gets a second core if another rank has finished. Small buffers are done in place."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="varuna-crc32")

    def __enter__(self) -> _Checksums:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def start(self, data: memoryview) -> Callable[[], int]:
        """Start the CRC-32 of `data` (which must not change until it is taken); returns its getter."""
        if len(data) < CHUNK:
            crc = _crc_of(data)
            return lambda: crc
        return self._pool.submit(_crc_of, data).result


def file_crc(path: Path) -> int:
    """CRC-32 of a whole file."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = checksum(chunk, crc)
    return crc


def _libc_sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing these dirty pages now (Linux; elsewhere a no-op), so the disk
    works while the next tensors are copied instead of all at once in the final fsync. Only a
    hint: the fsync at the end is what makes the file durable."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE: start, don't wait


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable buffer over its memory (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


@dataclass(frozen=True)
class Extent:
    """Where one stored tensor's raw bytes lie (DCP's per-item storage data), and their CRC-32."""

    relative_path: str
    offset: int
    length: int
    crc32: int


class Writer(dcp.FileSystemWriter):
    """One file per rank, each tensor's bytes written from its memory, checksummed on the way."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path), single_file_per_rank=True, sync_files=True, thread_count=1)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0.distcp"
        try:
            results = self._write(Path(self.path) / name, name, plan, planner)
        except OSError as exc:
            raise write_failed(Path(self.path) / name, exc) from None
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write(self, path: Path, name: str, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        written: list[tuple[Any, int, int, Callable[[], int]]] = []
        with open(path, "wb", buffering=0) as f, _Checksums() as crcs:
            offset = flushed = 0
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise CheckpointError(
                        f"checkpoint entry {item.index.fqn!r} is not a tensor; only tensors go through DCP "
                        "here (every other value belongs in extra.json)"
                    )
                tensor = planner.resolve_data(item)
                assert isinstance(tensor, torch.Tensor)
                tensor = tensor.detach().to("cpu").contiguous()
                data = byte_view(tensor)
                written.append((item.index, offset, len(data), crcs.start(data)))
                for start in range(0, len(data), CHUNK):
                    chunk = data[start : start + CHUNK]
                    while chunk:
                        chunk = chunk[f.write(chunk) :]
                offset += len(data)
                if offset - flushed >= WRITEBACK:
                    start_writeback(f.fileno(), flushed, offset - flushed)
                    flushed = offset
            os.fsync(f.fileno())
            return [
                WriteResult(index=index, size_in_bytes=n, storage_data=Extent(name, at, n, crc()))
                for index, at, n, crc in written
            ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: `metadata.json` (never DCP's pickled `.metadata`), fsynced."""
        extents = {wr.index: wr.storage_data for ranks in results for wr in ranks}
        path = Path(self.path) / _plain.METADATA
        try:
            with open(path, "wb") as f:
                f.write(_plain.metadata_json(metadata, extents, FORMAT))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise write_failed(path, exc) from None


def write_failed(path: Path, exc: OSError) -> CheckpointError:
    """The CheckpointError of a checkpoint file that could not be written, saying what to do."""
    what = errno.errorcode.get(exc.errno or 0, "error")
    fix = (
        "the disk is full: free space there or lower checkpoint_keep"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT)
        else "check the run directory's file system"
    )
    return CheckpointError(
        f"checkpoint file {path} could not be written: {exc.strerror or exc} ({what}); {fix}. The checkpoint "
        "was not committed: checkpoints/latest still names the previous one"
    )


def read_exactly(f: Any, offset: int, out: memoryview, path: Path, key: str, crc: int | None) -> int | None:
    """Fill `out` from `offset` of the open file; returns the CRC-32 of the bytes if `crc` is not None."""
    f.seek(offset)
    for start in range(0, len(out), CHUNK):
        chunk = out[start : start + CHUNK]
        got = 0
        while got < len(chunk):
            n = f.readinto(chunk[got:])
            if not n:
                raise CheckpointError(
                    f"checkpoint file {path} is truncated or damaged: it ends inside {key!r} "
                    f"(at byte {offset + start + got}, the entry ends at {offset + len(out)})"
                )
            got += n
        if crc is not None:
            crc = checksum(chunk, crc)
    return crc


class Reader(dcp.FileSystemReader):
    """Reads each extent straight into its destination tensor and checks the extents it is given."""

    def __init__(self, path: Path, metadata: Metadata | None = None) -> None:
        super().__init__(str(path))
        self._chunks: dict[MetadataIndex, tuple[torch.Size, torch.dtype]] = {}
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's Metadata rebuilt from `metadata.json` (or the one given, read so already);
        `.metadata` (a pickle) is never opened. Rank-local metadata (DCP's fallback) does not exist here."""
        if kwargs.get("rank") is not None:
            raise CheckpointError(
                f"checkpoint {self.path} has no rank-local metadata; it has {_plain.METADATA}"
            )
        return self._metadata if self._metadata is not None else read_metadata(Path(self.path))

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[MetadataIndex(fqn, chunk.offsets)] = (chunk.sizes, md.properties.dtype)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Give each extent to be checked to one of the ranks that read it, balancing the bytes."""
        readers: dict[MetadataIndex, list[int]] = {}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                readers.setdefault(item.storage_index, []).append(rank)
        load = [0] * len(plans)
        checks: list[set[MetadataIndex]] = [set() for _ in plans]
        for key in sorted(readers, key=lambda k: -self._extent(k).length):
            rank = min(readers[key], key=lambda r: load[r])
            load[rank] += self._extent(key).length
            checks[rank].add(key)
        return [dataclasses.replace(p, storage_data=c) for p, c in zip(plans, checks)]

    def _extent(self, key: MetadataIndex) -> Extent:
        extent = self.storage_data[key]
        if not isinstance(extent, Extent):
            raise CheckpointError(
                f"checkpoint {self.path} was not written by this Varuna's checkpoint writer (entry "
                f"{key.fqn!r} has no extent); resave it, or load it with torch.distributed.checkpoint directly"
            )
        return extent

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        check = plan.storage_data  # the extents this rank checks; None: every one it reads
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            by_file.setdefault(self._extent(item.storage_index).relative_path, []).append(item)
        checked: list[tuple[Path, str, Extent, Callable[[], int]]] = []
        with _Checksums() as crcs:
            for relative, items in by_file.items():
                path = Path(self.path) / relative
                with open(path, "rb", buffering=0) as f:
                    for item in sorted(items, key=lambda i: self._extent(i.storage_index).offset):
                        out = self._read_item(f, path, item, planner)
                        if check is None or item.storage_index in check:
                            extent = self._extent(item.storage_index)
                            checked.append((path, item.storage_index.fqn, extent, crcs.start(out)))
            for path, key, extent, crc in checked:
                if crc() != extent.crc32:
                    raise CheckpointError(
                        f"checkpoint file {path} is corrupted: the bytes of {key!r} (offset {extent.offset}, "
                        f"{extent.length} bytes) do not match their CRC-32"
                    )
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_item(self, f: Any, path: Path, item: Any, planner: LoadPlanner) -> memoryview:
        """Read one extent into its destination; returns the bytes read (to be checked)."""
        key, extent = item.storage_index.fqn, self._extent(item.storage_index)
        if item.type == LoadItemType.BYTE_IO:
            raise CheckpointError(
                f"checkpoint entry {key!r} in {path} is not a tensor; this Varuna reads tensors only"
            )
        sizes, dtype = self._chunks[item.storage_index]
        target = planner.resolve_tensor(item).detach()
        whole = (
            target.is_cpu
            and target.is_contiguous()
            and target.dtype == dtype
            and tuple(target.shape) == tuple(sizes)
            and not any(item.storage_offsets)
        )
        dest = target if whole else torch.empty(sizes, dtype=dtype)
        out = byte_view(dest)
        if len(out) != extent.length:
            raise CheckpointError(
                f"checkpoint file {path} is damaged: {key!r} ({tuple(sizes)}, {dtype}) needs {len(out)} bytes, "
                f"its extent holds {extent.length}"
            )
        read_exactly(f, extent.offset, out, path, key, None)
        if not whole:
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                dest = dest.narrow(dim, start, length)
            target.copy_(dest)
        planner.commit_tensor(item, target)
        return out


def read_metadata(path: Path) -> Metadata:
    """The checkpoint's DCP Metadata, from its `metadata.json` (checked; never a pickle)."""
    return _plain.metadata_from_json(path / _plain.METADATA, FORMAT, Extent)


def verify_extents(path: Path, manifest: dict[str, Any]) -> None:
    """Every data file is exactly its extents, one after the other, each matching its CRC-32."""
    metadata = read_metadata(path)
    by_file: dict[str, list[tuple[str, Extent]]] = {}
    for index, extent in metadata.storage_data.items():
        if not isinstance(extent, Extent):
            raise CheckpointError(
                f"checkpoint {path}: entry {index.fqn!r} has no extent (not written by Varuna)"
            )
        by_file.setdefault(extent.relative_path, []).append((index.fqn, extent))
    for fname, info in manifest["files"].items():
        if fname.endswith(".distcp") and fname not in by_file and info["bytes"]:
            raise CheckpointError(f"checkpoint file {path / fname} holds no tensor the metadata knows of")
    for fname, extents in by_file.items():
        f, end = path / fname, 0
        with open(f, "rb", buffering=0) as fh:
            for key, extent in sorted(extents, key=lambda e: e[1].offset):
                if extent.offset != end:
                    raise CheckpointError(
                        f"checkpoint file {f} is damaged: {key!r} starts at {extent.offset}, not {end}"
                    )
                out = memoryview(bytearray(extent.length))
                if read_exactly(fh, extent.offset, out, f, key, 0) != extent.crc32:
                    raise CheckpointError(
                        f"checkpoint file {f} is corrupted: the bytes of {key!r} do not match their CRC-32"
                    )
                end += extent.length
        if f.stat().st_size != end:
            raise CheckpointError(
                f"checkpoint file {f} is damaged: {f.stat().st_size} bytes, its extents end at {end}"
            )


@contextlib.contextmanager
def dcp_errors(what: str) -> Iterator[None]:
    """DCP gathers what any rank raised in a collective step and raises it on every rank, wrapped in
    a CheckpointException (a BaseException); unwrap ours, so every rank raises the same message."""
    try:
        yield
    except dcp.CheckpointException as exc:
        raised = [exc.failures[r][0] for r in sorted(exc.failures)]  # the lowest rank's first
        ours = [e for e in raised if isinstance(e, CheckpointError)]
        if ours:
            raise CheckpointError(str(ours[0])) from None
        raise CheckpointError(f"{what}: {exc}") from None
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{what}: {type(exc).__name__}: {exc}") from exc
