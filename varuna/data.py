"""Which samples a training step sees, as a pure function of (step, replica, data-parallel degree).

The global batch of step k is fixed by the step alone; the data-parallel degree D only decides how
it is split among replicas. So a job resized from D=4 to D=2 mid-training (a morph) trains on
exactly the samples the D=4 job would have, and the plain single-process reference sees them too.

    stream:  | epoch 0 (a permutation of range(N)) | epoch 1 (another permutation) | ...
    step k:  stream positions [k*B, (k+1)*B)        (may straddle two epochs)
    replica r of D:  the contiguous slice [r*B/D, (r+1)*B/D) of step k's batch

    sample_indices(step=3, replica=1, data_parallel=2, global_batch_size=8, dataset_size=100)

A map-style dataset (`len(ds)` and `ds[i]`) is read through `ReplicaLoader`, in one call per batch
where the dataset has one: `ds.__getitems__(indices)` (as torch's DataLoader asks) or, for a Hugging
Face `datasets.Dataset`, `ds[indices]`, whose columns are collated directly. `collate` stacks
equally shaped values; anything else (text, ragged lengths) needs a `collate_fn`.

An iterable dataset (a `torch.utils.data.IterableDataset`, a Hugging Face `IterableDataset`, any
iterable of samples) has no index, so it is read as ONE global stream by `StreamLoader`:

    stream:  sample 0, 1, 2, ...  the dataset's own order; every rank iterates it from the start
    step k:  stream positions [k*G, (k+1)*G)          (G = global_batch_size)
    replica r of D:  positions [k*G + r*G/D, k*G + (r+1)*G/D)

That is `sample_indices` without shuffling over an endless dataset, so a morph changes only how a
global batch is split, never which samples it holds. The position of step k is k*G, a pure function
of the step: the step a checkpoint records is the stream position, and nothing else is stored. To
resume at step k the loader calls `ds.skip(k*G)` where the dataset has it (an iterable starting at
that sample, as `datasets.IterableDataset.skip` gives), else iterates and discards k*G samples: a
resume costs reading the stream up to there, on every rank. Every rank reads all G samples of each
step and keeps its G/D. A stream that ends drops its last partial global batch. The dataset must
yield the same samples in the same order on every rank and on every pass: do not shard it by rank
yourself, and seed any shuffle it does.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import lru_cache
from typing import Any, Protocol, TypeAlias

import torch
from torch import Tensor
from torch.utils.data import Dataset

from varuna.errors import ConfigError, check_int

__all__ = [
    "sample_indices",
    "global_indices",
    "collate",
    "CollateFn",
    "MapDataset",
    "ReplicaLoader",
    "StreamLoader",
    "is_stream",
    "open_loader",
    "Loaders",
    "prefetched",
    "SyntheticLM",
    "SyntheticMLM",
]

_MASK64 = (1 << 64) - 1


def _mix(*parts: int) -> int:
    """A 63-bit seed from integers, well spread even for neighbouring inputs (splitmix64 rounds)."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (part & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h >> 1


def _generator(*parts: int) -> torch.Generator:
    """A CPU generator seeded from `parts`."""
    return torch.Generator().manual_seed(_mix(*parts))


def _check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """`value` as an int, or ConfigError naming the setting when it is not an int >= minimum."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer (got {value!r} of type {type(value).__name__})")
    if minimum is not None:
        check_int(value, name, minimum=minimum, message=f"{name} must be >= {minimum} (got {value})")
    return value


def _check_split(global_batch_size: int, data_parallel: int) -> None:
    """Validate the batch size and the data-parallel degree, and that one divides the other."""
    _check_int("global_batch_size", global_batch_size, minimum=1)
    _check_int("data_parallel", data_parallel, minimum=1)
    if global_batch_size % data_parallel != 0:
        fits = [d for d in range(1, global_batch_size + 1) if global_batch_size % d == 0]
        raise ConfigError(
            f"global_batch_size must be divisible by data_parallel "
            f"(global_batch_size: {global_batch_size}, data_parallel: {data_parallel}); "
            f"change data_parallel to one of {fits} or global_batch_size to a multiple of {data_parallel}"
        )


@lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, dataset_size: int, shuffle: bool) -> Tensor:
    """The order of epoch `epoch`: a permutation of range(dataset_size) (cached; never handed out)."""
    if not shuffle:
        return torch.arange(dataset_size)
    return torch.randperm(dataset_size, generator=_generator(seed, epoch))


def _stream(start: int, stop: int, dataset_size: int, seed: int, shuffle: bool) -> list[int]:
    """Sample ids at stream positions [start, stop) of the endless sequence of epochs."""
    out: list[int] = []
    pos = start
    while pos < stop:
        epoch, offset = divmod(pos, dataset_size)
        take = min(stop - pos, dataset_size - offset)
        out.extend(_epoch_order(seed, epoch, dataset_size, shuffle)[offset : offset + take].tolist())
        pos += take
    return out


def sample_indices(
    step: int,
    replica: int,
    data_parallel: int,
    global_batch_size: int,
    dataset_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
) -> list[int]:
    """The dataset indices replica `replica` of `data_parallel` trains on at step `step`.

    >>> sample_indices(2, 1, 2, 4, 10, shuffle=False)    # positions 8..11, replica 1 gets 10, 11
    [0, 1]
    """
    _check_int("step", step, minimum=0)
    _check_split(global_batch_size, data_parallel)
    _check_int("dataset_size", dataset_size, minimum=1)
    _check_int("seed", seed)
    if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < data_parallel:
        raise ConfigError(
            f"replica must be in [0, data_parallel) = [0, {data_parallel}) (got {replica!r}); "
            "pass this rank's replica index, or raise data_parallel"
        )
    local = global_batch_size // data_parallel
    start = step * global_batch_size + replica * local
    return _stream(start, start + local, dataset_size, seed, bool(shuffle))


def global_indices(
    step: int, global_batch_size: int, dataset_size: int, *, seed: int = 0, shuffle: bool = True
) -> list[int]:
    """All indices of step `step`'s global batch: the concatenation over replicas, for any D."""
    return sample_indices(step, 0, 1, global_batch_size, dataset_size, seed=seed, shuffle=shuffle)


CollateFn: TypeAlias = Callable[[list[Any]], Mapping[str, Any]]
"""Turns a list of samples (as the dataset gives them) into one batch dict, like DataLoader's collate_fn."""


def _unstackable(key: str, holds: str) -> ConfigError:
    """The error for a column `collate` cannot make one tensor of."""
    return ConfigError(
        f"collate cannot stack column {key!r} into a batch: it holds {holds}; pass collate_fn=... to "
        "engine.batch / engine.batches / ReplicaLoader (e.g. a padding collator, see docs/data.md), or "
        "remove the column from the dataset"
    )


def _shapes_seen(tensors: Sequence[Tensor]) -> str:
    """The distinct shapes of `tensors`, the first few, as text."""
    shapes = list(dict.fromkeys(tuple(t.shape) for t in tensors))
    more = f" and {len(shapes) - 4} more" if len(shapes) > 4 else ""
    return ", ".join(str(s) for s in shapes[:4]) + more


def _column(key: str, values: Sequence[Any]) -> Tensor:
    """One column of a batch as a tensor with a leading batch dimension, or ConfigError naming it."""
    if all(isinstance(v, Tensor) for v in values):
        tensors = list(values)
        what = "tensors"
    else:
        kinds = list(dict.fromkeys(type(v).__name__ for v in values))
        if len(kinds) > 1:
            raise _unstackable(key, f"values of different types ({', '.join(kinds)})")
        first = values[0]
        if isinstance(first, str | bytes):
            raise _unstackable(key, f"{kinds[0]} values (e.g. {first!r:.40}), which make no tensor")
        try:
            tensors = [torch.as_tensor(v) for v in values]
        except (TypeError, ValueError, RuntimeError) as exc:
            raise _unstackable(key, f"{kinds[0]} values that make no tensor ({exc})") from exc
        what = f"{kinds[0]} values"
    if len({tuple(t.shape) for t in tensors}) > 1:
        raise _unstackable(key, f"{what} of different shapes ({_shapes_seen(tensors)})")
    return torch.stack(tensors)


def collate(samples: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
    """Stack a list of samples (dicts of equally shaped values) into a batch with a leading dimension.

    Tensors are stacked; numbers, numpy arrays and equal-length lists become tensors first
    (`torch.as_tensor`). Text, ragged lengths or mixed types in a column are a ConfigError naming
    the column: give such data a `collate_fn` (a padding collator, say).
    """
    if len(samples) == 0:
        raise ConfigError("collate needs at least one sample (got an empty list)")
    if not isinstance(samples[0], Mapping):
        raise ConfigError(
            f"a sample must be a dict of tensors, like {{'input_ids': ..., 'labels': ...}}; the dataset gave a "
            f"{type(samples[0]).__name__} (a TensorDataset gives tuples): make __getitem__ return a dict, "
            "e.g. [{'x': x, 'y': y} for x, y in TensorDataset(...)]"
        )
    keys = list(samples[0])
    for i, sample in enumerate(samples):
        if list(sample) != keys:
            raise ConfigError(
                f"every sample must have the same keys; sample 0 has {keys}, sample {i} has "
                f"{list(sample)}: make the dataset's __getitem__ return the same keys for every index"
            )
    return {key: _column(key, [s[key] for s in samples]) for key in keys}


def _collate_columns(columns: Mapping[str, Any]) -> dict[str, Tensor]:
    """`collate` of a batch given as columns (a Hugging Face batch read), without making rows."""
    if not columns:
        raise ConfigError("the dataset gave a batch with no columns; give it at least one column")
    return {key: col if isinstance(col, Tensor) else _column(key, list(col)) for key, col in columns.items()}


def _loaded_class(module: str, name: str) -> type | None:
    """`module.name` if `module` is imported already (never imports it), else None."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls if isinstance(cls, type) else None


def _is_hf(dataset: Any, name: str) -> bool:
    """Whether `dataset` is a Hugging Face `datasets.<name>`; `datasets` is never imported for it."""
    cls = _loaded_class("datasets", name)
    return cls is not None and isinstance(dataset, cls)


def _rows(columns: Mapping[str, Any], count: int) -> list[dict[str, Any]]:
    """A column batch as `count` row dicts (what a collate_fn takes)."""
    return [{key: col[i] for key, col in columns.items()} for i in range(count)]


def _read(dataset: Any, indices: list[int], collate_fn: CollateFn | None) -> dict[str, Any]:
    """The samples at `indices`, read in one call where the dataset has one, collated.

    A Hugging Face `datasets.Dataset` answers `ds[indices]` with columns, collated as they are (or
    made rows for a `collate_fn`); `ds.__getitems__(indices)` gives the rows of a dataset that
    reads batches (torch's DataLoader asks for it too); any other dataset gives one row per `ds[i]`.
    """
    if _is_hf(dataset, "Dataset"):
        columns = dataset[indices]
        if collate_fn is None:
            return _collate_columns(columns)
        return dict(collate_fn(_rows(columns, len(indices))))
    if hasattr(dataset, "__getitems__"):
        rows = list(dataset.__getitems__(indices))
        if len(rows) != len(indices):
            raise ConfigError(
                f"{type(dataset).__name__}.__getitems__ gave {len(rows)} samples for {len(indices)} indices; "
                "it must return one sample per index, in order"
            )
    else:
        rows = [dataset[i] for i in indices]
    return collate(rows) if collate_fn is None else dict(collate_fn(rows))


class MapDataset(Protocol):
    """What `ReplicaLoader` needs of a dataset: a length and samples (dicts of tensors, or what the
    loader's `collate_fn` takes); `__getitems__(indices)` as well reads a batch in one call."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def is_stream(dataset: Any) -> bool:
    """Whether `dataset` is read as a stream (`StreamLoader`) rather than by index (`ReplicaLoader`)."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset) or _is_hf(dataset, "IterableDataset"):
        return True
    if isinstance(dataset, Tensor) or (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        return False
    return hasattr(dataset, "__iter__")


def _check_map_style(dataset: Any) -> None:
    """ConfigError unless `dataset` is map-style: `len(ds)` and `ds[i]`, as a step asks for its samples."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset) or _is_hf(dataset, "IterableDataset"):
        why = (
            "an IterableDataset has no index, so a step cannot ask for its own samples; give a map-style one, "
            "or read it as a stream with StreamLoader (engine.batch and engine.batches do)"
        )
    elif isinstance(dataset, torch.Tensor):
        why = "a tensor is not a dataset of dicts; wrap it, e.g. [{'x': row} for row in tensor]"
    elif not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        why = "it needs len(ds) and ds[i]"
    else:
        return
    raise ConfigError(
        f"the dataset must be map-style, len(ds) and ds[i] giving a dict of tensors; got a "
        f"{type(dataset).__name__}: {why}"
    )


class ReplicaLoader:
    """One replica's batches of a map-style dataset, by step: `loader.batch(step)`.

        loader = ReplicaLoader(ds, global_batch_size=32, replica=1, data_parallel=4)
        batch = loader.batch(step)            # 8 samples: the second quarter of step's global batch

    Stateless: any step can be asked for in any order, which is what an exact resume needs. The
    samples are read in one call per batch where the dataset allows it (see `_read`), and made a
    batch by `collate_fn` (default `collate`), which gets the list of samples.
    """

    def __init__(
        self,
        dataset: MapDataset,
        *,
        global_batch_size: int,
        replica: int,
        data_parallel: int,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: CollateFn | None = None,
    ) -> None:
        _check_map_style(dataset)
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.replica = replica
        self.data_parallel = data_parallel
        self.seed = seed
        self.shuffle = shuffle
        self.collate_fn = collate_fn
        self.dataset_size = len(dataset)
        if self.dataset_size < 1:
            raise ConfigError("ReplicaLoader needs a non-empty dataset (len(dataset) is 0)")
        # Validate every setting now rather than at the first step.
        sample_indices(
            0, replica, data_parallel, global_batch_size, self.dataset_size, seed=seed, shuffle=shuffle
        )

    @property
    def local_batch_size(self) -> int:
        """Samples this replica gets per step: global_batch_size // data_parallel."""
        return self.global_batch_size // self.data_parallel

    def indices(self, step: int) -> list[int]:
        """The dataset indices of this replica's share of step `step`."""
        return sample_indices(
            step,
            self.replica,
            self.data_parallel,
            self.global_batch_size,
            self.dataset_size,
            seed=self.seed,
            shuffle=self.shuffle,
        )

    def batch(self, step: int) -> dict[str, Any]:
        """This replica's share of step `step`'s global batch, collated."""
        return _read(self.dataset, self.indices(step), self.collate_fn)

    def global_batch(self, step: int) -> dict[str, Any]:
        """The whole global batch of step `step` (all replicas' shares, in replica order)."""
        idx = global_indices(
            step, self.global_batch_size, self.dataset_size, seed=self.seed, shuffle=self.shuffle
        )
        return _read(self.dataset, idx, self.collate_fn)

    def _batch_or_end(self, step: int) -> dict[str, Any] | None:
        """`batch(step)`: a map-style dataset never ends (epochs follow one another)."""
        return self.batch(step)

    def __repr__(self) -> str:
        return (
            f"ReplicaLoader(replica={self.replica}/{self.data_parallel}, "
            f"global_batch_size={self.global_batch_size}, dataset_size={self.dataset_size}, "
            f"seed={self.seed}, shuffle={self.shuffle})"
        )


# ----------------------------------------------------------------------------- iterable datasets


class _Cursor:
    """An iterator over a stream that knows its position: moves forward, or restarts, as asked.

    Reading from position p when it stands at q: p > q discards p - q samples, p < q restarts the
    stream (through `dataset.skip(p)` where the dataset has it, else from sample 0 and discards p).
    """

    def __init__(self, dataset: Iterable[Any]) -> None:
        self.dataset = dataset
        self.position = 0
        """The stream position of the next sample `_it` yields."""
        self.length: int | None = None
        """How many samples the stream holds, once it has ended."""
        self._it: Iterator[Any] | None = None

    def _open(self, start: int) -> None:
        one_shot = iter(self.dataset) is self.dataset
        if one_shot and self._it is not None:
            raise ConfigError(
                f"the dataset is a one-shot iterator ({type(self.dataset).__name__}), read up to sample "
                f"{self.position}, and cannot go back to sample {start}: give an iterable that starts over "
                "on each iter() (an IterableDataset, or a class whose __iter__ makes a new generator), or "
                "ask for steps in order"
            )
        skip = getattr(self.dataset, "skip", None)
        if start > 0 and callable(skip) and not one_shot:
            source = skip(start)
            if not hasattr(source, "__iter__"):
                raise ConfigError(
                    f"{type(self.dataset).__name__}.skip({start}) gave {type(source).__name__}; the loader "
                    "uses skip(n) to resume a stream and needs it to return an iterable that starts at sample "
                    "n (as datasets.IterableDataset.skip does): return one, or rename the method"
                )
            self._it, self.position = iter(source), start
        else:
            self._it, self.position = iter(self.dataset), 0

    def read(self, start: int, count: int) -> list[Any] | None:
        """Samples [start, start + count) of the stream, or None when it ends before start + count."""
        if self.length is not None and start + count > self.length:
            return None
        if self._it is None or start < self.position:
            self._open(start)
        assert self._it is not None
        if start > self.position:
            skipped = sum(1 for _ in itertools.islice(self._it, start - self.position))
            self.position += skipped
            if self.position < start:
                self.length = self.position
                return None
        out = list(itertools.islice(self._it, count))
        self.position += len(out)
        if len(out) < count:
            self.length = self.position
            return None
        return out


class StreamLoader:
    """One replica's batches of an iterable dataset, by step: `loader.batch(step)`.

        loader = StreamLoader(stream, global_batch_size=32, replica=1, data_parallel=4)
        batch = loader.batch(step)     # stream samples [32*step + 8, 32*step + 16)

    The stream rule is in this module's docstring. Steps asked in order cost one pass over the
    stream; an earlier step restarts it, a later one skips ahead (`dataset.skip(n)` if it has one).
    """

    def __init__(
        self,
        dataset: Iterable[Any],
        *,
        global_batch_size: int,
        replica: int,
        data_parallel: int,
        collate_fn: CollateFn | None = None,
    ) -> None:
        if not hasattr(dataset, "__iter__"):
            raise ConfigError(
                f"StreamLoader reads an iterable of samples; got a {type(dataset).__name__}, which has no "
                "__iter__: give an IterableDataset or any iterable of sample dicts"
            )
        # Validate every setting now rather than at the first step.
        sample_indices(0, replica, data_parallel, global_batch_size, 1)
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.replica = replica
        self.data_parallel = data_parallel
        self.collate_fn = collate_fn
        self._cursor = _Cursor(dataset)

    @property
    def local_batch_size(self) -> int:
        """Samples this replica gets per step: global_batch_size // data_parallel."""
        return self.global_batch_size // self.data_parallel

    def positions(self, step: int) -> range:
        """The stream positions of this replica's share of step `step`."""
        _check_int("step", step, minimum=0)
        start = step * self.global_batch_size + self.replica * self.local_batch_size
        return range(start, start + self.local_batch_size)

    def _global_samples(self, step: int) -> list[Any] | None:
        _check_int("step", step, minimum=0)
        return self._cursor.read(step * self.global_batch_size, self.global_batch_size)

    def _ended(self, step: int) -> ConfigError:
        length = self._cursor.length
        G = self.global_batch_size
        return ConfigError(
            f"the stream ended after {length} samples, before step {step}'s global batch (samples "
            f"[{step * G}, {(step + 1) * G})); it holds {(length or 0) // G} full global batches of "
            f"{G} (a partial last one is dropped): train for fewer steps, or give a longer or repeating dataset"
        )

    def _batch_or_end(self, step: int) -> dict[str, Any] | None:
        samples = self._global_samples(step)
        if samples is None:
            return None
        first = self.replica * self.local_batch_size
        mine = samples[first : first + self.local_batch_size]
        return collate(mine) if self.collate_fn is None else dict(self.collate_fn(mine))

    def batch(self, step: int) -> dict[str, Any]:
        """This replica's share of step `step`'s global batch, collated."""
        out = self._batch_or_end(step)
        if out is None:
            raise self._ended(step)
        return out

    def global_batch(self, step: int) -> dict[str, Any]:
        """The whole global batch of step `step` (all replicas' shares, in replica order)."""
        samples = self._global_samples(step)
        if samples is None:
            raise self._ended(step)
        return collate(samples) if self.collate_fn is None else dict(self.collate_fn(samples))

    def __repr__(self) -> str:
        return (
            f"StreamLoader(replica={self.replica}/{self.data_parallel}, "
            f"global_batch_size={self.global_batch_size}, position={self._cursor.position})"
        )


def _check_stream_shuffle(dataset: Any, shuffle: bool | None) -> None:
    """ConfigError when a stream is asked to be shuffled: its order is its own."""
    if shuffle:
        raise ConfigError(
            f"shuffle=True needs a map-style dataset; a {type(dataset).__name__} is read as one stream in "
            "its own order: shuffle inside the dataset with a fixed seed (e.g. datasets.IterableDataset"
            ".shuffle(seed=..., buffer_size=...)) and leave shuffle unset"
        )


def open_loader(
    dataset: Any,
    *,
    global_batch_size: int,
    replica: int,
    data_parallel: int,
    seed: int = 0,
    shuffle: bool | None = None,
    collate_fn: CollateFn | None = None,
) -> ReplicaLoader | StreamLoader:
    """A `ReplicaLoader` for a map-style dataset, a `StreamLoader` for an iterable one.

    `shuffle=None` shuffles a map-style dataset and reads a stream in its own order; a stream cannot
    be shuffled here (its order is the dataset's: shuffle inside it, with a seed), and `seed` is the
    map-style shuffle's.
    """
    if is_stream(dataset):
        _check_stream_shuffle(dataset, shuffle)
        return StreamLoader(
            dataset,
            global_batch_size=global_batch_size,
            replica=replica,
            data_parallel=data_parallel,
            collate_fn=collate_fn,
        )
    return ReplicaLoader(
        dataset,
        global_batch_size=global_batch_size,
        replica=replica,
        data_parallel=data_parallel,
        seed=seed,
        shuffle=True if shuffle is None else shuffle,
        collate_fn=collate_fn,
    )


class Loaders:
    """One replica's loaders by dataset: a fresh `ReplicaLoader` per map-style call (it holds no
    state), one `StreamLoader` kept per iterable dataset, so that step k+1 continues where step k
    stopped instead of reading the stream again from its start.

        loaders = Loaders(global_batch_size=32, replica=0, data_parallel=4)
        loaders.get(stream).batch(step)
    """

    def __init__(self, *, global_batch_size: int, replica: int, data_parallel: int) -> None:
        self.global_batch_size = global_batch_size
        self.replica = replica
        self.data_parallel = data_parallel
        self._streams: dict[int, StreamLoader] = {}

    def get(
        self,
        dataset: Any,
        *,
        seed: int = 0,
        shuffle: bool | None = None,
        collate_fn: CollateFn | None = None,
    ) -> ReplicaLoader | StreamLoader:
        """The loader of `dataset`; for a stream the kept one, with this call's `collate_fn`."""
        kept = self._streams.get(id(dataset))
        if kept is not None and kept.dataset is dataset:
            _check_stream_shuffle(dataset, shuffle)
            kept.collate_fn = collate_fn  # the position belongs to the dataset, the collation to the call
            return kept
        loader = open_loader(
            dataset,
            global_batch_size=self.global_batch_size,
            replica=self.replica,
            data_parallel=self.data_parallel,
            seed=seed,
            shuffle=shuffle,
            collate_fn=collate_fn,
        )
        if isinstance(loader, StreamLoader):
            self._streams[id(dataset)] = loader
        return loader


# ------------------------------------------------------------------------------------ prefetch

_PREFETCH_THREAD = "varuna-prefetch"


def prefetched(
    loader: ReplicaLoader | StreamLoader, start: int, stop: int | None = None, *, depth: int = 1
) -> Iterator[dict[str, Any]]:
    """The batches of steps start, start + 1, ... (before `stop`, or to a stream's end), read `depth`
    steps ahead by one background thread.

        for batch in prefetched(loader, engine.step_count, steps):   # reads step k+1 while k trains
            engine.step(batch)

    The thread reads at most `depth` batches that the loop has not taken yet (0: no thread, each
    batch read when asked). An exception raised reading step k's batch is raised by the loop when it
    asks for step k's batch, after steps before k were yielded. Closing the iterator (or dropping it:
    garbage collection closes a generator) stops the thread and waits for it, so none is left. The
    loader then belongs to the thread: do not read it from elsewhere meanwhile.
    """
    _check_int("start", start, minimum=0)
    if stop is not None:
        _check_int("stop", stop, minimum=start)
    _check_int("prefetch", depth, minimum=0)
    steps: Iterable[int] = itertools.count(start) if stop is None else range(start, stop)
    if depth == 0:
        return _in_order(loader, steps)
    return _ahead(loader, steps, depth)


def _in_order(loader: ReplicaLoader | StreamLoader, steps: Iterable[int]) -> Iterator[dict[str, Any]]:
    for step in steps:
        batch = loader._batch_or_end(step)
        if batch is None:
            return
        yield batch


def _reader(
    loader: ReplicaLoader | StreamLoader,
    steps: Iterable[int],
    permits: threading.Semaphore,
    stop: threading.Event,
    out: queue.SimpleQueue[tuple[int, dict[str, Any] | None, BaseException | None]],
) -> None:
    """The prefetch thread: read each step's batch once a permit says the loop has room for it."""
    for step in steps:
        permits.acquire()
        if stop.is_set():
            return
        try:
            batch = loader._batch_or_end(step)
        except BaseException as exc:  # handed to the training thread, raised there at its step
            out.put((step, None, exc))
            return
        out.put((step, batch, None))
        if batch is None:
            return
    out.put((-1, None, None))


def _ahead(
    loader: ReplicaLoader | StreamLoader, steps: Iterable[int], depth: int
) -> Iterator[dict[str, Any]]:
    permits = threading.Semaphore(depth)
    stop = threading.Event()
    out: queue.SimpleQueue[tuple[int, dict[str, Any] | None, BaseException | None]] = queue.SimpleQueue()
    thread = threading.Thread(
        target=_reader, args=(loader, steps, permits, stop, out), name=_PREFETCH_THREAD, daemon=True
    )
    thread.start()
    try:
        while True:
            step, batch, exc = out.get()
            if exc is not None:
                exc.add_note(f"(raised reading step {step}'s batch in varuna's prefetch thread)")
                raise exc
            if batch is None:
                return
            permits.release()  # the thread may read the next batch while this one trains
            yield batch
    finally:
        stop.set()
        permits.release()  # wakes the thread if it waits for a permit; it sees `stop` and returns
        thread.join()


# ---------------------------------------------------------------------------- synthetic datasets

_CHAIN_TAG = 0xC4A1
_SAMPLE_TAG = 0x5A3B
_SUCCESSOR_PROBS = torch.tensor([0.55, 0.25, 0.12, 0.08])


def _bigram_chain(vocab_size: int, seed: int) -> list[list[int]]:
    """For each state, its 4 likely successor states, drawn once from `seed`."""
    g = _generator(seed, _CHAIN_TAG)
    return torch.randint(vocab_size, (vocab_size, len(_SUCCESSOR_PROBS)), generator=g).tolist()


def _walk(chain: list[list[int]], length: int, g: torch.Generator) -> list[int]:
    """A random walk of `length` states on `chain`, starting from a uniformly drawn state."""
    state = int(torch.randint(len(chain), (1,), generator=g))
    choices = torch.multinomial(_SUCCESSOR_PROBS, max(length - 1, 1), replacement=True, generator=g)
    out = [state]
    for c in choices.tolist()[: length - 1]:
        state = chain[state][c]
        out.append(state)
    return out


def _check_index(index: int, size: int) -> int:
    """`index` normalised to [0, size), or IndexError (so plain iteration stops)."""
    i = int(index)
    if i < 0:
        i += size
    if not 0 <= i < size:
        raise IndexError(f"index {index} out of range for a dataset of size {size}")
    return i


class SyntheticLM(Dataset[dict[str, Tensor]]):
    """Next-token samples from a fixed random sparse bigram chain: learnable in a few dozen steps.

    Each token has 4 likely successors (probabilities .55/.25/.12/.08, ~1.1 nats of entropy against
    ln(vocab_size) for a uniform guess). Sample i is a pure function of (seed, i); nothing but the
    vocab_size x 4 successor table is stored.

        ds = SyntheticLM(64, 16, 1000)
        ds[3]["input_ids"].shape   # torch.Size([16]); labels = input_ids shifted left by one
    """

    def __init__(self, vocab_size: int, seq_len: int, size: int, *, seed: int = 0) -> None:
        self.vocab_size = _check_int("vocab_size", vocab_size, minimum=2)
        self.seq_len = _check_int("seq_len", seq_len, minimum=1)
        self.size = _check_int("size", size, minimum=1)
        self.seed = seed
        self._chain = _bigram_chain(vocab_size, seed)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        i = _check_index(index, self.size)
        tokens = torch.tensor(_walk(self._chain, self.seq_len + 1, _generator(self.seed, _SAMPLE_TAG, i)))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


class SyntheticMLM(Dataset[dict[str, Tensor]]):
    """Masked-LM samples: two segments, trailing padding on some, exactly `mask_per_sample` masks each.

    Because every sample has the same number of labelled positions, the loss over a batch (the mean
    over labelled tokens) equals the mean of its equal-sized micro-batches' losses, so pipelined and
    plain training can be compared exactly. Masked positions always hold `mask_id` (no 80/10/10).

    Keys: input_ids, attention_mask (1 real, 0 pad), token_type_ids (0 first segment, 1 second,
    0 on padding), labels (the original token at masked positions, -100 elsewhere).
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        size: int,
        *,
        mask_per_sample: int = 3,
        pad_id: int = 0,
        mask_id: int = 1,
        seed: int = 0,
    ) -> None:
        self.vocab_size = _check_int("vocab_size", vocab_size, minimum=4)
        self.seq_len = _check_int("seq_len", seq_len, minimum=2)
        self.size = _check_int("size", size, minimum=1)
        self.mask_per_sample = _check_int("mask_per_sample", mask_per_sample, minimum=1)
        if mask_per_sample > seq_len:
            raise ConfigError(
                f"mask_per_sample must be <= seq_len (mask_per_sample: {mask_per_sample}, "
                f"seq_len: {seq_len}); lower mask_per_sample or raise seq_len"
            )
        for name, value in (("pad_id", pad_id), ("mask_id", mask_id)):
            if not 0 <= value < vocab_size:
                raise ConfigError(f"{name} must be in [0, vocab_size) = [0, {vocab_size}) (got {value})")
        if pad_id == mask_id:
            raise ConfigError(f"pad_id and mask_id must differ (both are {pad_id})")
        self.pad_id = pad_id
        self.mask_id = mask_id
        self.seed = seed
        # Ordinary tokens: every id except pad and mask; the chain walks over their positions.
        self._tokens = [t for t in range(vocab_size) if t not in (pad_id, mask_id)]
        self._chain = _bigram_chain(len(self._tokens), seed)
        self._min_len = max(mask_per_sample, 2, seq_len // 2)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        i = _check_index(index, self.size)
        g = _generator(self.seed, _SAMPLE_TAG, i)
        padded = bool(torch.rand((), generator=g) < 0.5) and self._min_len < self.seq_len
        length = int(torch.randint(self._min_len, self.seq_len, (), generator=g)) if padded else self.seq_len
        split = int(torch.randint(1, length, (), generator=g))
        masked = torch.randperm(length, generator=g)[: self.mask_per_sample]

        tokens = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        tokens[:length] = torch.tensor([self._tokens[s] for s in _walk(self._chain, length, g)])
        attention_mask = torch.zeros(self.seq_len, dtype=torch.long)
        attention_mask[:length] = 1
        token_type_ids = torch.zeros(self.seq_len, dtype=torch.long)
        token_type_ids[split:length] = 1
        labels = torch.full((self.seq_len,), -100, dtype=torch.long)
        labels[masked] = tokens[masked]
        input_ids = tokens.clone()
        input_ids[masked] = self.mask_id
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "token_type_ids": token_type_ids,
            "labels": labels,
        }


def slice_batch(
    batch: Mapping[str, Any], start: int, stop: int, device: torch.device | None = None
) -> dict[str, Any]:
    """Rows `start:stop` of every tensor in `batch` (other values as they are), moved to `device`."""
    return {
        k: (v[start:stop] if device is None else v[start:stop].to(device, non_blocking=True))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in batch.items()
    }


def batch_len(batch: Mapping[str, Any]) -> int:
    """The batch dimension shared by `batch`'s tensors; ConfigError if there is none or they disagree."""
    lengths = {k: v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not lengths:
        raise ConfigError("a batch must be a dict holding at least one tensor with a batch dimension")
    if len(set(lengths.values())) > 1:
        raise ConfigError(f"the batch's tensors disagree on the batch dimension: {lengths}")
    return next(iter(lengths.values()))
