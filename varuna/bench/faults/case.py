"""What a fault-bench case is, and the small observers the case modules share.

A case provokes one real fault, attack or bad input and reports what it `observed` (the error type and
the first line of its message, an exit code, a drop counter, a state); `ok` is computed from that
observation, never written down in advance.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from varuna.bench import bench_env

Kind = Literal["attack", "fault", "bad input"]
Result = tuple[bool, str]
"""(ok, observed)"""


@dataclass(frozen=True, slots=True)
class Case:
    """One row of the bench: `run(tmp)` provokes it in the folder `tmp` and returns (ok, observed)."""

    name: str
    kind: Kind
    expected: str
    run: Callable[[Path], Result]
    job: bool = False
    """True when the case needs a multi-rank job (skipped by --quick)."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def raises(call: Callable[[], Any], exc_type: type[BaseException], pattern: str) -> Result:
    """Run `call`; ok when it raised `exc_type` with a message matching `pattern`."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - whatever it raised is the observation
        return isinstance(exc, exc_type) and re.search(pattern, str(exc)) is not None, first_line(exc)
    return False, "returned without an error"


def warned(call: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Run `call`, returning its value and the first lines of the warnings it issued."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        value = call()
    return value, [str(w.message).splitlines()[0] for w in seen]


def cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`python -m varuna ARGV` in the bench's environment."""
    return subprocess.run(
        [sys.executable, "-m", "varuna", *argv],
        env=bench_env(60),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_user_error(argv: list[str], says: str) -> Result:
    """A CLI user error: exit 2 and one line `varuna: error: ...` containing `says`."""
    done = cli(*argv)
    lines = done.stderr.splitlines()
    line = lines[0] if lines else ""
    ok = done.returncode == 2 and len(lines) == 1 and line.startswith("varuna: error: ") and says in line
    return ok, f"exit {done.returncode}, {len(lines)} line(s): {line}"


def wait_for(predicate: Callable[[], Any], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(predicate())


@contextmanager
def env_set(**values: str) -> Iterator[None]:
    """Set environment variables for the block, then put back what was there."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
