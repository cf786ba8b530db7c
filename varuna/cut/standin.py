"""Stand-ins: what a stage sees where the user's forward uses a value another stage computes.

A stage runs the user's whole `forward` (that is how a model runs unchanged), but the modules
other stages hold are skipped. Glue code between modules still runs on every stage, and the glue
of real models reads what it is given: GPT-2 builds `output_shape` from the embedding's size,
BERT casts its mask `.to(dtype=embedding_output.dtype)`, Llama takes
`torch.arange(..., device=inputs_embeds.device)`. So a skipped module returns a `StandIn`: a
tensor with the shape, dtype and device of the value it stands for and no data.

    skipped module ──> StandIn(shape, dtype, device, origin="transformer.h.3")
       glue: x.shape, x.size(-1), x.to(dev, dtype), x + y, x.view(...)  ──> more StandIns, on meta
       the stage's own input CutPoint  ──> the activation received from the previous stage (real)

How:
- A skipped module's output shape is what the engine's start-up trace of the whole model saw for
  the same input signature (`record_outputs`), or else is inferred by running the module's own
  forward on the meta device (its parameters and buffers are meta already, see
  `varuna.engine.stage.strip`); either is cached per input signature (shapes, dtypes, plain values), and
  later calls rebuild stand-ins from it.
- Every torch operation touching a stand-in runs on meta (`__torch_dispatch__`); its result is a
  stand-in on the same device. Results are cached per operation and input signature, so a step's
  glue costs a dictionary lookup per operation after the first micro-batch.

A stand-in must never be trained on. These raise `PartitionError`, naming the module the value
came from and the CutPoint through which it would have to cross:
- an operation that combines a stand-in with a parameter this stage trains (the value reached one
  of the stage's own modules other than through its input CutPoint);
- an operation that reads a stand-in's values (``.item()``, ``bool()``, ``nonzero``), or writes
  a stand-in into a real tensor in place;
- (checked by the runtime) a loss, or the value a stage sends on, that is a stand-in.
Reading a stand-in's shape, dtype or device is what it is for, and is never an error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from varuna.cut.cutpoint import CONTAINERS
from varuna.errors import PartitionError

__all__ = ["StandIn", "SkippedForward", "stand_in_context", "contains_stand_in", "origin_of", "timer"]

_META = torch.device("meta")
_OP_CACHE_LIMIT = 8192


class _Context(threading.local):
    """What an error needs to say on this thread: the stage, its input CutPoint, parameter names."""

    def __init__(self) -> None:
        self.stage: int | None = None
        self.start_cut: str | None = None
        self.param_names: dict[int, str] = {}


_context = _Context()


class timer:
    """Seconds spent in stand-in work on this process (skipped modules and glue on stand-ins),
    accumulated only while `timer.enabled` is set (the stand-in bench turns it on). Nested work
    (an operation inside another) counts once.

        with timer():
            ...            # adds the elapsed time to timer.seconds, unless already inside one
    """

    enabled = False
    seconds = 0.0
    _depth = 0

    def __enter__(self) -> None:
        type(self)._depth += 1
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        cls = type(self)
        cls._depth -= 1
        if cls._depth == 0:
            cls.seconds += time.perf_counter() - self.t0


class stand_in_context:
    """Names the stage for errors raised while its forward runs (the runtime enters it)."""

    def __init__(self, stage: int, start_cut: str | None, param_names: dict[int, str]) -> None:
        self.values = (stage, start_cut, param_names)

    def __enter__(self) -> None:
        self.previous = (_context.stage, _context.start_cut, _context.param_names)
        _context.stage, _context.start_cut, _context.param_names = self.values

    def __exit__(self, *exc: object) -> None:
        _context.stage, _context.start_cut, _context.param_names = self.previous


def _stage() -> str:
    return "this stage" if _context.stage is None else f"stage {_context.stage}"


def _crossing_hint(origin: str) -> str:
    stage = _stage()
    if _context.start_cut is None:
        return (
            f"only the value given to a stage's input CutPoint crosses to {stage}; pass the value through "
            f"that CutPoint too (x = cut((x, value))) or stop using it (e.g. output_hidden_states=False)"
        )
    return (
        f"only the value given to CutPoint {_context.start_cut!r} (where {stage} starts) crosses to it; "
        f"pass the value through that CutPoint too (x = cut((x, value))), move the boundary so that "
        f"{origin!r} runs on {stage}, or stop using the value (e.g. output_hidden_states=False)"
    )


def cross_stage_error(what: str, origin: str) -> PartitionError:
    """The error for a stand-in (a value computed by module `origin` on another stage) used by `what`."""
    return PartitionError(
        f"on {_stage()}, {what} uses the output of module {origin!r}, which another stage computes; "
        f"{_crossing_hint(origin)}"
    )


class StandIn(torch.Tensor):
    """A value another stage computes: its shape, dtype and device, and no data."""

    _meta: torch.Tensor
    origin: str
    """The module whose output this stands for (or derives from)."""

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: torch.device, origin: str) -> StandIn:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=device,
            requires_grad=False,
        )
        out._meta = meta
        out.origin = origin
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"StandIn(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, of {self.origin!r})"

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if not timer.enabled:
            return _function(func, args, kwargs or {})
        with timer():
            return _function(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub omits `func`
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return _dispatch(func, args, kwargs or {})


_PLAIN = (torch.Tensor, bool, int, float, str, type(None), torch.dtype, torch.device, torch.memory_format)


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The leaves `tree_flatten((args, kwargs))` gives, without its cost where the arguments are
    plain tuples, lists and dicts of tensors and numbers (every stand-in operation goes through
    here); any other container (a namedtuple, a registered ModelOutput) is flattened by pytree."""
    out: list[Any] = []
    stack: list[Any] = [kwargs, args]
    while stack:
        value = stack.pop()
        kind = type(value)
        if kind is tuple or kind is list:
            stack.extend(reversed(value))
        elif kind is dict:
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, _PLAIN):
            out.append(value)
        else:
            out.extend(tree_flatten(value)[0])
    return out


def _function(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A torch function called with a stand-in among its arguments (before dispatch)."""
    leaves = _leaves(args, kwargs)
    origin = next((a.origin for a in leaves if isinstance(a, StandIn)), None)
    if origin is not None:
        for a in leaves:
            if isinstance(a, nn.Parameter) and a.requires_grad and not a.is_meta:
                name = _context.param_names.get(id(a), f"a parameter of shape {tuple(a.shape)}")
                raise cross_stage_error(f"{getattr(func, '__name__', func)} with parameter {name!r}", origin)
    # No autograd: a stand-in has no gradient to carry, and recording would save stand-ins for a
    # backward that never reaches them.
    with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
        return func(*args, **kwargs)


_op_cache: dict[Any, Any] = {}


def _signature(value: Any) -> Any:
    """A hashable description of what an operation's output shape can depend on; None if unknown."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.stride(), isinstance(value, StandIn))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout)):
        return value
    if isinstance(value, torch.memory_format):
        return str(value)
    if isinstance(value, (tuple, list)):
        parts = tuple(_signature(v) for v in value)
        return (
            None if any(p is None and v is not None for p, v in zip(parts, value)) else (type(value), parts)
        )
    return None


def _to_meta(value: Any) -> Any:
    if isinstance(value, StandIn):
        return value._meta
    if isinstance(value, torch.Tensor):
        return (
            value
            if value.is_meta
            else torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=_META)
        )
    if isinstance(value, torch.device):
        return _META
    return value


def _mutated(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments `func` writes to (in-place and out= operations)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(args[i] if i < len(args) else kwargs.get(arg.name))
    return out


def _op_name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", None)
    return str(getattr(packet, "__name__", None) or getattr(func, "__name__", func))


def _dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    leaves = _leaves(args, kwargs)
    standins = [a for a in leaves if isinstance(a, StandIn)]
    first = standins[0]
    if func._schema.is_mutable:
        for target in _mutated(func, args, kwargs):
            if isinstance(target, torch.Tensor) and not isinstance(target, StandIn):
                raise cross_stage_error(
                    f"an in-place {_op_name(func)} into a tensor of this stage", first.origin
                )
    key = (func, _signature(args), _signature(tuple(sorted(kwargs.items()))))
    cacheable = None not in key[1:]
    meta_out = _op_cache.get(key) if cacheable else None
    if meta_out is None:
        margs, mkwargs = tree_map(_to_meta, (args, kwargs))
        try:
            meta_out = func(*margs, **mkwargs)
        except Exception as exc:
            raise cross_stage_error(
                f"{_op_name(func)}, which needs the values and not only the shape ({type(exc).__name__}: {exc}),",
                first.origin,
            ) from exc
        if cacheable and not func._schema.is_mutable:
            if len(_op_cache) >= _OP_CACHE_LIMIT:
                _op_cache.clear()
            _op_cache[key] = meta_out
    returns = func._schema.returns
    if (
        func._schema.is_mutable
        and isinstance(args[0], StandIn)
        and returns
        and returns[0].alias_info is not None
    ):
        if tuple(meta_out.shape) != tuple(args[0].shape):
            raise cross_stage_error(
                f"{_op_name(func)}, which changes a stand-in's shape in place,", first.origin
            )
        return args[0]
    return _stand_ins(meta_out, first.device, first.origin)


def _stand_ins(meta_out: Any, device: torch.device, origin: str) -> Any:
    """`meta_out` (any nesting) with each meta tensor as a fresh stand-in on `device`."""
    if isinstance(meta_out, torch.Tensor):
        return StandIn(meta_out, device, origin)
    return tree_map(lambda t: StandIn(t, device, origin) if isinstance(t, torch.Tensor) else t, meta_out)


def contains_stand_in(value: Any) -> bool:
    """Whether `value` is, or holds (tuples, lists, dicts, ModelOutputs), a stand-in."""
    return origin_of(value) is not None


def origin_of(value: Any) -> str | None:
    """The module name of the first stand-in in `value`, or None."""
    if isinstance(value, StandIn):
        return value.origin
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for v in value:
            found = origin_of(v)
            if found is not None:
                return found
    return None


def input_key(value: Any) -> Any:
    """What a module's output shape may depend on in its inputs: tensor shapes, dtypes and
    strides, plain values; other objects by their type (a block's output shape does not depend
    on, say, the contents of a key/value cache)."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.stride())
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(input_key(v) for v in value))
    if isinstance(value, dict):
        return (type(value), tuple((k, input_key(v)) for k, v in value.items()))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    return type(value).__qualname__


def _as_meta(value: Any) -> Any:
    return tree_map(lambda t: _to_meta(t) if isinstance(t, torch.Tensor) else t, value)


class record_outputs:
    """While a model runs for real (the engine's start-up trace), note every module's output, as
    meta tensors, per input signature: the ground truth a `SkippedForward` prefers to inferring.

        with record_outputs(model) as seen:
            model(**batch)
        seen["transformer.h.3"]       # {input_key((args, kwargs)): meta output}
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.seen: dict[str, dict[Any, Any]] = {}

    def __enter__(self) -> dict[str, dict[Any, Any]]:
        self.handles = [
            module.register_forward_hook(self._hook(name), with_kwargs=True)
            for name, module in self.model.named_modules()
            if name and not isinstance(module, CONTAINERS) and next(module.parameters(), None) is not None
        ]
        return self.seen

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            self.seen.setdefault(name, {})[input_key((tuple(args), dict(kwargs)))] = _as_meta(output)

        return hook

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()


class SkippedForward:
    """The forward of a module another stage holds: stand-ins with its output's shape and dtype.

    The output's shape comes from the engine's start-up trace (`record_outputs`) where it saw the
    same input signature, else from running the module's own forward on meta (its parameters and
    buffers are meta on this stage); either is cached per input signature (`input_key`). A module
    that neither can describe (routing on data, device-specific kernels) is a `PartitionError`.
    """

    def __init__(
        self, module: nn.Module, name: str, device: torch.device, traced: dict[Any, Any] | None = None
    ) -> None:
        self.forward: Callable[..., Any] = type(module).forward.__get__(module)
        self.name = name
        self.device = device
        self.cache: dict[Any, Any] = dict(traced or {})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not timer.enabled:
            return self._call(args, kwargs)
        with timer():
            return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = input_key((args, kwargs))
        meta_out = self.cache.get(key)
        if meta_out is None:
            margs, mkwargs = tree_map(_to_meta, (args, kwargs))
            try:
                with torch.no_grad():
                    meta_out = self.forward(*margs, **mkwargs)
            except Exception as exc:
                raise PartitionError(
                    f"{_stage()} skips module {self.name!r} (another stage holds it) but needs the shape of its "
                    f"output: the start-up trace saw no call with these input shapes, and running it on the "
                    f"meta device failed ({type(exc).__name__}: {exc}). Give example_batch= a batch shaped "
                    "like the training batches, or choose boundaries (partition=[...]) that keep this "
                    "module's callers on the stage that holds it"
                ) from exc
            self.cache[key] = meta_out
        return _stand_ins(meta_out, self.device, self.name)
