"""Slurm's compact notations, read without calling Slurm (pure; the launcher and the rendezvous share it).

    expand_hostlist("node[01-03,07],gpu5")   -> ["node01", "node02", "node03", "node07", "gpu5"]
    expand_tasks_per_node("2(x3),1")          -> [2, 2, 2, 1]

These are what ``scontrol show hostnames`` and ``SLURM_TASKS_PER_NODE`` say, without a process per call
(a rank reads them during its rendezvous).
"""

from __future__ import annotations

import re

__all__ = ["expand_hostlist", "expand_tasks_per_node", "HostlistError"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


class HostlistError(ValueError):
    """A hostlist or tasks-per-node string that does not parse (the caller adds where it came from)."""


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: ``a[1,2],b`` -> ``["a[1,2]", "b"]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' at {i} in {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"unbalanced '[' in {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _numbers(inside: str, whole: str) -> list[str]:
    """``01-03,7`` -> ``["01", "02", "03", "7"]`` (the width of a range's first bound is kept)."""
    out = []
    for item in inside.split(","):
        match = _RANGE.match(item.strip())
        if match is None:
            raise HostlistError(f"bad range {item!r} in {whole!r}: expected N or N-M")
        low, high = match.group(1), match.group(2)
        if high is None:
            out.append(low)
            continue
        if int(high) < int(low):
            raise HostlistError(f"range {item!r} in {whole!r} runs backwards")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def _expand_one(name: str, whole: str) -> list[str]:
    """One name with any number of bracket groups: ``r[1-2]n[1-2]`` -> r1n1, r1n2, r2n1, r2n2."""
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.find("]", open_at)
    head, rest = name[:open_at], name[close_at + 1 :]
    tails = _expand_one(rest, whole)
    return [head + n + tail for n in _numbers(name[open_at + 1 : close_at], whole) for tail in tails]


def expand_hostlist(text: str) -> list[str]:
    """Host names of a Slurm hostlist expression, in order (duplicates kept, as Slurm does)."""
    hosts = [host for part in _split_top(text.strip()) for host in _expand_one(part, text)]
    if not hosts:
        raise HostlistError(f"no host in {text!r}")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """Per-node counts of ``SLURM_TASKS_PER_NODE`` / ``SLURM_JOB_CPUS_PER_NODE``: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        match = _COUNT.match(part.strip())
        if match is None:
            raise HostlistError(f"bad count {part!r} in {text!r}: expected N or N(xK)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
