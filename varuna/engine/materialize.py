"""A model built on the meta device becomes real one stage at a time: no rank holds the whole model.

    with torch.device("meta"):
        model = GPT(cfg)                                  # shapes only: no memory
    engine = Varuna(model, ..., weights="gpt/")          # this rank's stage, read from safetensors
    engine = Varuna(model, ...)                          # or initialised, the same at every P x D

The engine traces and partitions the meta model (shapes are all a trace needs), strips what other
stages hold (`varuna.engine.stage.strip`), and then `materialize` gives every tensor still on meta
in this stage a real, empty tensor on the rank's device. A tied weight stays one tensor (every
module slot that shared the meta parameter gets the same real one). Floating-point tensors start as
NaN and integer ones at their type's minimum, so that a tensor nothing wrote is found
(`check_written`) instead of training on `torch.empty`'s garbage.

What writes them, in this order:

    1. init, of every module (with `weights=`: only of the modules holding a non-persistent
       buffer, which no file holds): `init(name, module)` if given, else the model's own
       `_init_weights(module)` where the module belongs to a model that has one (transformers
       models, `varuna.models`), else the module's `reset_parameters()`. Each module is initialised
       under a seed derived from the base seed and the module's qualified name (`module_seed`), so
       its values do not depend on which stage holds it: a pipelined run at any P x D starts from
       the same weights as a plain model given `init_weights(model, seed)`. A tied weight is
       initialised by the module of its first name only. transformers recomputes rotary `inv_freq`
       and position-id buffers in `_init_weights`; a module of your own with a non-persistent
       buffer recomputes it in its `reset_parameters()` (or in your `init`).
    2. the weights file (`varuna.checkpoint.weights`) or the checkpoint (`resume=`), which overwrite
       what they hold.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from varuna.cut.partition import canonical_names
from varuna.cut.standin import SkippedForward
from varuna.errors import ConfigError

__all__ = [
    "InitFn",
    "init_weights",
    "is_meta",
    "materialize",
    "module_seed",
    "initialize",
    "check_written",
    "nonpersistent_buffers",
]

InitFn = Callable[[str, nn.Module], None]
"""`init(module_name, module)`: writes the module's own parameters and buffers (not its children's)."""


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on the meta device."""
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def module_seed(seed: int, name: str) -> int:
    """The seed a module is initialised under: from the base seed and its qualified name only.

    >>> module_seed(0, "h.0.attn") == module_seed(0, "h.0.attn") != module_seed(0, "h.1.attn")
    True
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63 - 1)


def _unset(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor shaped as `like` holding the 'never written' mark (NaN, or the integer minimum)."""
    out = torch.empty(like.shape, dtype=like.dtype, device=device)
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    elif out.dtype != torch.bool:
        out.fill_(torch.iinfo(out.dtype).min)
    return out


def _kept_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module this stage runs: not skipped (`SkippedForward`), nor inside a skipped one."""
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        name, module = stack.pop()
        if isinstance(module.__dict__.get("forward"), SkippedForward):
            continue
        yield name, module
        children = list(module.named_children())
        for child_name, child in reversed(children):
            stack.append((f"{name}.{child_name}" if name else child_name, child))


def materialize(model: nn.Module, device: torch.device, *, params: set[str] | None = None) -> dict[int, str]:
    """Give every meta parameter named in `params` (canonical names; None: all) and every meta buffer
    of a module this stage runs a real, unwritten tensor on `device`; returns id(tensor) -> name of
    the tensors made (their state_dict key; a tied weight under its first name)."""
    canon, _ = canonical_names(model)
    made: dict[int, nn.Parameter] = {}
    fresh: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            name = canon.get(id(p), f"{module_name}.{pname}" if module_name else pname)
            if params is not None and name not in params:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(_unset(p, device), requires_grad=p.requires_grad)
                fresh[id(made[id(p)])] = name
            module._parameters[pname] = made[id(p)]
    for module_name, module in _kept_modules(model):
        for bname, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                real = _unset(b, device)
                module._buffers[bname] = real
                fresh[id(real)] = f"{module_name}.{bname}" if module_name else bname
    return fresh


def nonpersistent_buffers(model: nn.Module) -> set[str]:
    """Qualified names of the buffers `state_dict()` leaves out (no weights file holds them)."""
    out = set()
    for module_name, module in model.named_modules():
        for bname in module._non_persistent_buffers_set:
            if module._buffers.get(bname) is not None:
                out.add(f"{module_name}.{bname}" if module_name else bname)
    return out


def _init_roots(model: nn.Module) -> dict[int, Any]:
    """id(module) -> the outermost model it belongs to that initialises its modules one by one with
    `_init_weights(module)` and has a `config` (transformers models; `varuna.models`' too)."""
    owner: dict[int, Any] = {}
    for _, module in model.named_modules():
        if id(module) in owner:
            continue
        if callable(getattr(module, "_init_weights", None)) and hasattr(module, "config"):
            for sub in module.modules():
                owner.setdefault(id(sub), module)
    return owner


def _default_init(roots: dict[int, Any]) -> InitFn:
    def init(name: str, module: nn.Module) -> None:
        root = roots.get(id(module))
        if root is not None:
            root._init_weights(module)
        else:
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()

    return init


def initialize(
    model: nn.Module,
    *,
    seed: int = 0,
    init: InitFn | None = None,
    only: set[int] | None = None,
) -> None:
    """Initialise the modules this stage runs, each under `module_seed(seed, name)`; with `only` (ids
    of tensors), just the modules that directly hold one of them. A parameter registered under a
    second name (a tied weight) is left to the module of its first name."""
    canon, _ = canonical_names(model)
    call = init if init is not None else _default_init(_init_roots(model))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for name, module in _kept_modules(model):
            own = [*module._parameters.values(), *module._buffers.values()]
            if only is not None and not any(t is not None and id(t) in only for t in own):
                continue
            hidden = {
                pname: p
                for pname, p in module._parameters.items()
                if p is not None and canon.get(id(p)) != (f"{name}.{pname}" if name else pname)
            }
            for pname, p in hidden.items():  # another module's tied weight: not written from here
                module._parameters[pname] = nn.Parameter(
                    torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
                )
            torch.manual_seed(module_seed(seed, name))
            try:
                call(name, module)
            finally:
                for pname, p in hidden.items():
                    module._parameters[pname] = p


def check_written(model: nn.Module, fresh: dict[int, str], *, how: str) -> None:
    """ConfigError naming the tensors of `fresh` that still hold the unwritten mark after `how`."""
    left = []
    for t in [*model.parameters(), *model.buffers()]:
        name = fresh.get(id(t))
        if name is None or t.dtype == torch.bool:
            continue
        with torch.no_grad():
            if t.is_floating_point() or t.is_complex():
                unset = bool(torch.isnan(t).any())
            else:
                unset = bool((t == torch.iinfo(t.dtype).min).all()) and t.numel() > 0
        if unset:
            left.append(f"{name} {tuple(t.shape)}")
    if left:
        more = f" (and {len(left) - 8} more)" if len(left) > 8 else ""
        raise ConfigError(
            f"the model was built on the meta device and {len(left)} tensors of this stage were not "
            f"written by {how}: {', '.join(left[:8])}{more}. Give weights=PATH (a safetensors file or "
            "folder), an init=fn(module_name, module) that writes them, or give those modules a "
            "reset_parameters() that does (a non-persistent buffer such as a rotary inv_freq must be "
            "recomputed there: no weights file holds it)"
        )


def init_weights(
    model: nn.Module,
    seed: int = 0,
    *,
    init: InitFn | None = None,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Initialise a plain (not pipelined) model exactly as `Varuna` initialises its stages; returns it.

    Meta tensors become real on `device` first. Every module is initialised under
    `module_seed(seed, name)` by `init`, the transformers model's `_init_weights` or the module's
    `reset_parameters()`, so a plain run and a pipelined run of the same model at any P x D start
    from the same weights:

        with torch.device("meta"):
            plain = GPT(cfg)
        varuna.init_weights(plain, seed=0)         # == what Varuna(GPT-on-meta, ...) holds per stage
    """
    fresh = materialize(model, torch.device(device))
    initialize(model, seed=seed, init=init)
    check_written(model, fresh, how="init_weights")
    return model


def require_init(model: nn.Module, init: InitFn | None) -> None:
    """ConfigError when a meta model has no way to be initialised: neither `init` nor, for some
    module holding parameters, `reset_parameters` or a transformers `_init_weights`."""
    if init is not None:
        return
    roots = _init_roots(model)
    bare = [
        f"{name or type(model).__name__} ({type(module).__name__})"
        for name, module in model.named_modules()
        if any(p is not None for p in module._parameters.values())
        and id(module) not in roots
        and not callable(getattr(module, "reset_parameters", None))
    ]
    if bare:
        raise ConfigError(
            f"the model was built on the meta device without weights=, and {len(bare)} modules holding "
            f"parameters have no init: {', '.join(bare[:6])}{' ...' if len(bare) > 6 else ''}. Give "
            "weights=PATH (a safetensors file or folder), init=fn(module_name, module), or a "
            "reset_parameters() method on those modules"
        )
