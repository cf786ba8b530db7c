"""A griffe extension for the API pages: doctest lines in a docstring's prose become code blocks.

The package's docstrings show examples as doctests (``>>> make_schedule("1f1b", 2, 4)[0]``) right in
their text. Markdown reads a ``>>>`` line as nested block quotes and ``['0F0', '0F1']`` as a link
reference (which the strict build then reports as a missing cross-reference), so each run of doctest
lines at the prose's own indentation, with its output up to the next blank line, is fenced as
``pycon``. A doctest already inside an indented code block is left as it is. mkdocs.yml loads this
file by path; it changes only what the site shows, never the package.
"""

from __future__ import annotations

from typing import Any

import griffe

__all__ = ["DoctestFences", "fence_doctests"]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def fence_doctests(text: str) -> str:
    """Wrap each prose-level run of ``>>>`` lines and their output in a ```` ```pycon ```` fence
    (tests/unit/test_docs.py shows it on examples)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    in_fence = False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        code_block = _indent(line) >= 4 and (not out or not out[-1].strip() or _indent(out[-1]) >= 4)
        if in_fence or not line.lstrip().startswith(">>>") or code_block:
            out.append(line)
            i += 1
            continue
        pad = " " * _indent(line)
        if out and out[-1].strip():
            out.append("")
        out.append(f"{pad}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{pad}```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fence the doctests of every object's docstring as it is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
