"""A stage's backward in two passes: the input gradient first, the weight gradients later.

A non-first stage's backward produces two things: the gradient of its input, which the previous
stage waits for, and the gradients of its own parameters, which nobody needs before the optimizer
step. When the previous stage is idle until that input gradient arrives (the drain at the end of a
step, where each stage in turn waits for the one after it), computing the input gradient first,
sending it, and only then the weight gradients takes the weight half off the critical path.

How, without computing anything twice:

1. Walk the autograd graph from the stage's outputs. The *input path* is every node with a path
   to the stage's input. A *boundary node* is an input-path node with an edge that leaves the
   input path towards a parameter (a matmul's node, whose other edges lead to its weight).
2. Pass 1, `torch.autograd.grad(outputs, inputs, retain_graph=True)`: autograd runs only what the
   input gradient needs; a matmul's node computes its input's gradient, not its weight's. A
   pre-hook on each boundary node keeps the gradient flowing into it.
3. Pass 2 (`WeightGrads.run`): for each group of boundary nodes (nodes that reach a common
   parameter form one group), `torch.autograd.grad` from those nodes, with the kept gradients, to
   their parameters: autograd computes only the weight edges. Within a group of several nodes, a
   pre-hook replaces what flows into a node with what pass 1 kept, so no contribution is counted
   twice. The results are added into `p.grad` in place (the engine's gradient buckets are views).

The gradients are the same numbers as one `backward()` (the same kernels; a parameter used twice
in one stage may sum its two parts in another order).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightGrads", "input_grads_first"]


def _node(t: torch.Tensor) -> Node | None:
    """The node gradients of `t` flow into: its grad_fn, or for a leaf its AccumulateGrad."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    return None


def _children(node: Node) -> list[Node]:
    return [n for n, _ in node.next_functions if n is not None]


def _reachable(roots: Sequence[Node]) -> list[Node]:
    """Every node reachable from `roots`, each once (iterative: graphs can be deep)."""
    seen: set[Node] = set()
    order: list[Node] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(_children(node))
    return order


def _reaching(nodes: list[Node], targets: set[Node]) -> set[Node]:
    """The nodes of `nodes` (closed under children) with a path to one of `targets`."""
    parents: dict[Node, list[Node]] = {}
    for node in nodes:
        for child in _children(node):
            parents.setdefault(child, []).append(node)
    members = set(nodes)
    found = {t for t in targets if t in members}
    stack = list(found)
    while stack:
        for parent in parents.get(stack.pop(), []):
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


class WeightGrads:
    """The weight half of a split backward; `run()` adds each parameter's gradient into `p.grad`."""

    def __init__(
        self,
        groups: list[list[Node]],
        kept: dict[Node, tuple[Any, ...]],
        params: dict[Node, list[tuple[Node, torch.nn.Parameter]]],
    ) -> None:
        self._groups = groups
        self._kept = kept
        self._params = params  # boundary node -> [(AccumulateGrad node, parameter)] behind it

    def run(self) -> None:
        # A group of several boundary nodes shares a parameter (DeBERTa's relative embeddings feed
        # every layer): its pass runs the input-path nodes between them, which would free what a
        # later group still needs; keep the graph until the last group, then let it go.
        retain = any(len(nodes) > 1 for nodes in self._groups)
        for nodes in self._groups:
            edges: list[GradientEdge] = []
            grads: list[torch.Tensor] = []
            for node in nodes:
                for i, g in enumerate(self._kept[node]):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            targets: dict[Node, torch.nn.Parameter] = {}
            for node in nodes:
                for acc, p in self._params[node]:
                    targets[acc] = p
            if not edges or not targets:
                continue
            # Each node runs on exactly what pass 1 kept: within a group, what flows from one node
            # into another is replaced (no part counted twice), and a tensor hook of the user's on
            # a node's output, which runs before these and already shaped what pass 1 kept, does
            # not apply a second time.
            handles = [n.register_prehook(lambda _, kept=self._kept[n]: kept) for n in nodes]
            try:
                found = torch.autograd.grad(
                    edges,
                    [GradientEdge(acc, 0) for acc in targets],
                    grads,
                    retain_graph=retain,
                    allow_unused=True,
                )
            finally:
                for h in handles:
                    h.remove()
            for p, g in zip(targets.values(), found):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        self._groups, self._kept, self._params = [], {}, {}


def input_grads_first(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.nn.Parameter],
) -> tuple[list[torch.Tensor | None], WeightGrads] | None:
    """The gradients of `inputs` now (one per input, None where it got none) and the weight
    gradients of `params` to compute later with the returned `WeightGrads.run()`; call `run()`
    exactly once. None, with nothing computed, where the graph cannot be split so: an output that
    does not depend on the inputs, or a parameter reached other than through the input path (then
    call `backward()` as usual)."""
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    nodes = _reachable(roots)
    input_nodes = {n for n in map(_node, inputs) if n is not None}
    on_path = _reaching(nodes, input_nodes)
    if not roots or not all(r in on_path for r in roots):
        return None
    acc_of: dict[Node, torch.nn.Parameter] = {}
    for p in params:
        acc = _node(p) if p.requires_grad else None
        if acc is not None:
            acc_of[acc] = p
    # Boundary nodes and the parameters each reaches through edges that leave the input path.
    behind: dict[Node, list[tuple[Node, torch.nn.Parameter]]] = {}
    for node in nodes:
        if node not in on_path:
            continue
        off = [c for c in _children(node) if c not in on_path]
        if not off:
            continue
        accs = [n for n in _reachable(off) if n in acc_of]
        if accs:
            behind[node] = [(acc, acc_of[acc]) for acc in accs]
    covered = {acc for reached in behind.values() for acc, _ in reached}
    if any(n in acc_of and n not in covered for n in nodes):
        return None
    # Boundary nodes that share a parameter go together (union-find).
    parent = {n: n for n in behind}

    def find(n: Node) -> Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    owner: dict[Node, Node] = {}
    for node, reached in behind.items():
        for acc, _ in reached:
            if acc in owner:
                parent[find(node)] = find(owner[acc])
            else:
                owner[acc] = node
    groups: dict[Node, list[Node]] = {}
    for node in behind:
        groups.setdefault(find(node), []).append(node)

    kept: dict[Node, tuple[Any, ...]] = {}

    def keeper(node: Node) -> Any:
        def hook(grad_outputs: tuple[Any, ...]) -> None:
            kept[node] = grad_outputs

        return hook

    handles = [node.register_prehook(keeper(node)) for node in behind]
    try:
        valid = [(o, g) for o, g in zip(outputs, grad_outputs) if o.grad_fn is not None]
        found = torch.autograd.grad(
            [o for o, _ in valid], list(inputs), [g for _, g in valid], retain_graph=True, allow_unused=True
        )
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in behind if n not in kept]  # not run in pass 1: no gradient reached them
    for node in missing:
        del behind[node]
    live = [[n for n in group if n in kept] for group in groups.values()]
    return list(found), WeightGrads([g for g in live if g], kept, behind)
