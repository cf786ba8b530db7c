"""`auto_cut(model)`: put CutPoints between the repeated blocks of a model that has none.

GPT-2, BERT and most transformer models run their blocks from one ``nn.ModuleList`` (or
``nn.Sequential``): ``model.transformer.h`` in the transformers library's GPT-2,
``model.bert.encoder.layer`` in its BERT, ``model.blocks`` in `varuna.models`. `auto_cut` finds the
largest such list of same-class blocks and routes the output of every block but the last through a
new `CutPoint`, without touching the model's code or its parameter names:

    model = GPT2LMHeadModel(config)            # no CutPoints
    names = varuna.auto_cut(model)             # ['transformer.varuna_cuts.0', ..., '...10']
    engine = varuna.Varuna(model, ...)         # the engine sees n_layer - 1 candidate boundaries

How: each block gets a forward hook that passes its output through its CutPoint. The CutPoints
live in a ``varuna_cuts`` ModuleList on the nearest ancestor of the block list that is not itself a
container (so no ``nn.Sequential`` calls them by accident); they hold no parameters or buffers, so
``state_dict()`` keys are unchanged and pretrained weights load as before.

Blocks returning tuples (the transformers library's blocks return ``(hidden_states, present, ...)``):
only the first element, the hidden states, crosses the cut. The other elements (key/value caches,
attention maps) stay on the stage that computed them; on later stages they are stand-ins (shape,
dtype and device, no data), and a loss or a module that uses one raises `PartitionError`. Train
without ``output_attentions``/``output_hidden_states``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from varuna.cut.cutpoint import CONTAINERS, CutPoint
from varuna.errors import PartitionError

__all__ = ["auto_cut", "find_blocks"]

_ATTRIBUTE = "varuna_cuts"


class _CutHook:
    """A forward hook routing a block's output (or its first element) through `cut`.

    A callable object rather than a closure, so that ``copy.deepcopy(model)`` gives the copy's
    hooks the copy's CutPoints.
    """

    def __init__(self, cut: CutPoint, block_name: str) -> None:
        self.cut = cut
        self.block_name = block_name

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, (tuple, list)):
            if not output:
                raise PartitionError(
                    f"auto_cut: block {self.block_name!r} returned an empty {type(output).__name__}; "
                    "a block must return its hidden states (a tensor, or a tuple whose first element is one)"
                )
            return type(output)((self.cut(output[0]), *output[1:]))
        if not hasattr(output, "shape"):
            raise PartitionError(
                f"auto_cut: block {self.block_name!r} returned a {type(output).__name__}; auto_cut handles "
                "blocks returning a tensor or a tuple/list whose first element is the hidden states. "
                "Put varuna.CutPoint() calls in the model's forward by hand instead."
            )
        return self.cut(output)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _candidates(model: nn.Module) -> list[tuple[int, str, list[tuple[str, nn.Module]]]]:
    """(parameter count, container name, [(block name, block)]) for every repeated-block group."""
    found = []
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[tuple[str, nn.Module]]] = {}
        for child_name, child in container.named_children():
            if not isinstance(child, CutPoint):
                by_class.setdefault(type(child), []).append((child_name, child))
        for blocks in by_class.values():
            distinct = {id(b) for _, b in blocks}
            size = sum(_numel(b) for _, b in blocks)
            # One module listed twice runs twice per forward: a hook on it cannot tell the calls apart.
            if len(blocks) >= 2 and len(distinct) == len(blocks) and size > 0:
                prefix = f"{name}." if name else ""
                found.append((size, name, [(prefix + n, b) for n, b in blocks]))
    return found


def find_blocks(model: nn.Module) -> tuple[str, list[str]]:
    """The container `auto_cut` would cut and the names of its blocks, in order.

    The chosen container is the ``nn.ModuleList``/``nn.Sequential`` whose two or more children of one
    class hold the most parameters (ties go to the one met first in ``model.named_modules()``).

    >>> find_blocks(GPT2LMHeadModel(config))     # doctest: +SKIP
    ('transformer.h', ['transformer.h.0', ..., 'transformer.h.11'])
    """
    found = _candidates(model)
    if not found:
        seen = "; ".join(
            f"{n or '<model>'} ({type(m).__name__} of {', '.join(sorted({type(c).__name__ for c in m.children()}))})"
            for n, m in model.named_modules()
            if isinstance(m, (nn.ModuleList, nn.Sequential))
        )
        raise PartitionError(
            f"auto_cut found no repeated blocks in {type(model).__name__}: it looks for an nn.ModuleList or "
            "nn.Sequential holding two or more distinct modules of the same class with parameters (like "
            "GPT-2's transformer.h or BERT's encoder.layer); containers seen: "
            f"{seen or 'none'}. Put varuna.CutPoint() calls in the model's forward by hand instead."
        )
    best = max(found, key=lambda c: c[0])  # max() keeps the first of equals
    return best[1], [n for n, _ in best[2]]


def _holder(model: nn.Module, container: str) -> tuple[nn.Module, str]:
    """The nearest ancestor of `container` that is not itself a container, and its path."""
    parts = container.split(".") if container else []
    while parts:
        parts.pop()
        path = ".".join(parts)
        module = model.get_submodule(path)
        if not isinstance(module, CONTAINERS):
            return module, path
    raise PartitionError(
        f"auto_cut cannot place CutPoints in {type(model).__name__}: the model is itself an "
        f"{type(model).__name__}, which would call any module added to it. Wrap it in a module "
        "whose forward calls it (class Net(nn.Module): forward(self, x): return self.body(x))."
    )


def auto_cut(model: nn.Module, *, blocks: Sequence[str] | None = None) -> list[str]:
    """Insert a CutPoint after every repeated block but the last; return the CutPoints' names.

    `blocks` names the container to cut (e.g. ``"transformer.h"``) when the largest one is not the
    right choice; by default `find_blocks` picks it. The model is changed in place and its
    ``state_dict()`` keys stay the same. Calling it on a model that already has CutPoints is an
    error: the two sets would both fire.

    >>> names = auto_cut(model)                  # doctest: +SKIP
    >>> len(names) == model.config.n_layer - 1   # doctest: +SKIP
    True
    """
    existing = [n for n, m in model.named_modules() if isinstance(m, CutPoint)]
    if existing:
        raise PartitionError(
            f"auto_cut: the model already has CutPoints ({existing[:4]}{' ...' if len(existing) > 4 else ''}); "
            "use it as it is, or build it without CutPoints before calling auto_cut"
        )
    coupled = next(
        (
            m
            for m in model.modules()
            if getattr(getattr(m, "config", None), "is_encoder_decoder", False) is True
        ),
        None,
    )
    if coupled is not None:
        raise PartitionError(
            f"auto_cut cannot cut the encoder-decoder {type(coupled).__name__}: every decoder block also reads "
            "the encoder's output (cross-attention), and only a block's hidden states cross an auto_cut "
            "boundary. Put varuna.CutPoint() calls in the model by hand, passing (hidden_states, "
            "encoder_hidden_states) through each, or pipeline a decoder-only or encoder-only model."
        )
    if blocks is None:
        container, names = find_blocks(model)
    else:
        container = str(blocks)
        try:
            target = model.get_submodule(container)
        except AttributeError as exc:
            raise PartitionError(f"auto_cut(blocks={container!r}): no such submodule ({exc})") from None
        if not isinstance(target, (nn.ModuleList, nn.Sequential)) or len(target) < 2:
            raise PartitionError(
                f"auto_cut(blocks={container!r}) names a {type(target).__name__}; it must be an "
                "nn.ModuleList or nn.Sequential of two or more blocks"
            )
        names = [f"{container}.{n}" for n, _ in target.named_children()]
    holder, path = _holder(model, container)
    attribute = _ATTRIBUTE
    while hasattr(holder, attribute):
        attribute = f"_{attribute}"
    cuts = nn.ModuleList(CutPoint() for _ in names[:-1])
    holder.add_module(attribute, cuts)
    prefix = f"{path}.{attribute}" if path else attribute
    for block_name, cut in zip(names, cuts):
        assert isinstance(cut, CutPoint)
        cut.block = block_name
        model.get_submodule(block_name).register_forward_hook(_CutHook(cut, block_name))
    return [f"{prefix}.{i}" for i in range(len(cuts))]
