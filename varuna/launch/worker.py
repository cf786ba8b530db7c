"""The process ``mpiexec`` starts on every rank: rendezvous, tee output, run the user's script.

    python -m varuna.launch.worker train.py --lr 0.1
    python -m varuna.launch.worker -m mypackage.train --lr 0.1

What it guarantees, so that the launcher can report which rank failed and why:

- ``RUN_DIR/logs/rank{r}.log``: everything the rank printed from Python (stdout and stderr);
  the console gets the same lines prefixed ``[rank 3 s1 d1] `` (rank, stage, replica).
- ``RUN_DIR/status/rank{r}.json``: ``running`` at start, then ``done`` or ``failed``, with the
  process's host, pid, start time and boot id (`varuna.launch.pids`): a rank that stays ``running``
  after the job ended was killed, and its pid is never signalled once another process has it.
- ``RUN_DIR/failures/rank{r}.json`` when the script raised: type, message, full traceback.
- A SIGUSR1 (a morph request) before the script builds its `Varuna` is kept and honoured once the
  engine exists (`varuna.launch.signals.remember_early_stops`) instead of killing the rank.
- A failing rank leaves with ``os._exit`` without finalising MPI, which makes the process manager
  kill every other rank at once, even ranks blocked in a gloo collective. A clean rank finalises MPI
  first (a sleeping wait for the others), so it never takes the job down.
"""

from __future__ import annotations

import faulthandler
import io
import os
import re
import runpy
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

from varuna._files import write_json_atomic
from varuna.comm.rendezvous import env_rank, finalize_mpi, init_distributed, launch_env, placement, shutdown
from varuna.launch.exits import MORPH_EXIT
from varuna.launch.pids import identity
from varuna.launch.signals import STACKS_SIGNAL, remember_early_stops

__all__ = ["LineTee", "main", "run_target"]

# "\r\n" is one terminator, so a trailing "\r" waits for the next write to see whether "\n" follows.
_TERMINATOR = re.compile(r"\r\n|\n|\r(?=[^\n])")
USAGE = "usage: python -m varuna.launch.worker (script.py | -m module) [args ...]"


class LineTee(io.TextIOBase):
    """A text stream that copies whole lines to a log file and, prefixed, to a console stream.

    Text is held until ``\\n`` or ``\\r`` (so tqdm's progress bars work); the terminator is kept and
    the prefix goes at the start of every piece, so interleaved ranks never split each other's lines.

    >>> tee = LineTee(sys.stdout, None, "[rank 0] ")
    >>> _ = tee.write("a\\nb")
    [rank 0] a
    """

    def __init__(self, console: TextIO, log: TextIO | None, prefix: str, lock: threading.Lock | None = None):
        super().__init__()
        self.console = console
        self.log = log
        self.prefix = prefix
        self._pending = ""
        self._lock = lock or threading.Lock()

    def write(self, text: str) -> int:
        """Buffer ``text``; emit every complete piece (ending in ``\\n``, ``\\r`` or ``\\r\\n``)."""
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:
            data = self._pending + text
            ends = [m.end() for m in _TERMINATOR.finditer(data)]
            pieces = [data[a:b] for a, b in zip([0, *ends], ends)]
            self._pending = data[ends[-1] :] if ends else data
            if pieces:
                self._emit(pieces)
        return len(text)

    def _emit(self, pieces: list[str]) -> None:
        """Write complete pieces: prefixed to the console, as they are to the log (lock held)."""
        out = "".join(p if p == "\r" else self.prefix + p for p in pieces)
        self.console.write(out)
        self.console.flush()
        if self.log is not None:
            self.log.write("".join(pieces))
            self.log.flush()

    def flush(self) -> None:
        """Flush the underlying streams; a partial line stays buffered until its terminator."""
        with self._lock:
            self.console.flush()
            if self.log is not None:
                self.log.flush()

    def drain(self) -> None:
        """Emit a partial last line (with a newline added on the console), e.g. at exit."""
        with self._lock:
            rest, self._pending = self._pending, ""
            if rest:
                self._emit([rest if rest.endswith(("\n", "\r")) else rest + "\n"])

    def writable(self) -> bool:
        """Always: this is an output stream."""
        return True

    def isatty(self) -> bool:
        """Whether the console is a terminal (libraries like tqdm ask)."""
        return self.console.isatty()

    def fileno(self) -> int:
        """The console's file descriptor (for code that writes below Python)."""
        return self.console.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        """The console's encoding."""
        return getattr(self.console, "encoding", "utf-8")

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        """The console's error handler."""
        return getattr(self.console, "errors", None)

    @property
    def buffer(self) -> Any:
        """The console's byte buffer (bytes written there bypass the prefix and the log)."""
        return self.console.buffer  # type: ignore[attr-defined]


class _Rank:
    """This process's identity and the files it reports through."""

    def __init__(self, rank: int, pipeline: int, run_dir: Path | None):
        self.rank = rank
        self.stage, self.replica = placement(rank, pipeline)
        self.run_dir = run_dir
        # host, pid, start time and boot id: a signal goes to this rank only while all of them match
        self.identity = {"rank": rank, "stage": self.stage, "replica": self.replica, **identity()}
        self.identity["job"] = os.environ.get(
            "VARUNA_JOB_ID"
        )  # a late word of an earlier launch is told apart

    def path(self, kind: str, suffix: str) -> Path | None:
        """``RUN_DIR/kind/rank{r}{suffix}``, or None without a run directory."""
        if self.run_dir is None:
            return None
        folder = self.run_dir / kind
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"rank{self.rank}{suffix}"

    def status(self, state: str, **extra: Any) -> None:
        """Write ``status/rank{r}.json``: running, done or failed."""
        path = self.path("status", ".json")
        if path is not None:
            write_json_atomic(path, {**self.identity, "state": state, "time": time.time(), **extra})

    def failure(self, exc: BaseException, text: str) -> None:
        """Write ``failures/rank{r}.json`` for the launcher's summary."""
        path = self.path("failures", ".json")
        if path is not None:
            record = {"type": type(exc).__name__, "message": str(exc), "traceback": text, "time": time.time()}
            write_json_atomic(path, {**self.identity, **record})


def _report(me: _Rank, state: str, exc: BaseException | None = None, text: str = "", **extra: Any) -> None:
    """Write the failure record (if any) and the status; a full disk must not stop the exit path."""
    try:
        if exc is not None:
            me.failure(exc, text)
        me.status(state, **extra)
    except OSError as err:
        print(f"varuna: could not write rank {me.rank}'s {state} report: {err}", file=sys.stderr)


def _exit_code(exc: SystemExit) -> int:
    """The exit status Python would give ``exc`` (printing a string code, as Python does)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)  # what Python does with sys.exit("message")
    return 1


def _format_exception(exc: BaseException) -> str:
    """The traceback as ``python script.py`` would print it: without this module's and runpy's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if name != __file__ and "runpy" not in name:
            break
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def run_target(argv: list[str]) -> None:
    """Run ``script.py args`` or ``-m module args`` as ``python`` would run them."""
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(USAGE)
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = Path(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = str(script.resolve().parent)  # as `python script.py` puts the script's folder first
        runpy.run_path(str(script), run_name="__main__")


def _install_tee(me: _Rank, real_out: TextIO, real_err: TextIO) -> TextIO | None:
    """Point ``sys.stdout``/``sys.stderr`` at line tees into the rank's log; return the open log."""
    log_path = me.path("logs", ".log")
    log = open(log_path, "a", encoding="utf-8", errors="replace") if log_path else None  # noqa: SIM115
    prefix = f"[rank {me.rank} s{me.stage} d{me.replica}] "
    lock = threading.Lock()
    sys.stdout = LineTee(real_out, log, prefix, lock)
    sys.stderr = LineTee(real_err, log, prefix, lock)
    if log is not None:
        faulthandler.enable(file=log)  # a segfault's Python traceback lands in the rank's log
        # a job that hangs shows where: the launcher asks for every thread's stack (written even while
        # a thread blocks in C) and prints it from here
        faulthandler.register(STACKS_SIGNAL, file=log, all_threads=True)
    return log


def _finish(code: int, log: TextIO | None, real_out: TextIO, real_err: TextIO) -> None:
    """Drain the tees, restore the streams and leave without running torch/gloo teardown."""
    for tee in (sys.stdout, sys.stderr):
        if isinstance(tee, LineTee):
            tee.drain()
    sys.stdout, sys.stderr = real_out, real_err
    real_out.flush()
    real_err.flush()
    if log is not None:
        faulthandler.disable()
        log.close()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m varuna.launch.worker``; never returns."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        raise SystemExit(0 if argv else 2)
    remember_early_stops()  # a `varuna resize` during start-up waits for the engine, not kills the rank
    env = launch_env()
    pipeline = env.pipeline or 1
    real_out, real_err = sys.stdout, sys.stderr
    log: TextIO | None = None
    hint = env_rank()
    me = _Rank(hint or 0, pipeline, env.run_dir if hint is not None else None)
    if hint is not None:  # report from the start, so a failed rendezvous is logged too
        log = _install_tee(me, real_out, real_err)
        me.status("running", argv=argv)
    code = 0
    try:
        import torch

        torch.set_num_threads(int(os.environ.get("VARUNA_THREADS", "1")))
        rank, _world = init_distributed()
        if hint is None or rank != hint:
            if log is not None:
                log.close()
            me = _Rank(rank, pipeline, env.run_dir)
            log = _install_tee(me, real_out, real_err)
            me.status("running", argv=argv)
        os.environ["VARUNA_LAUNCHED"] = "1"
        run_target(argv)
    except SystemExit as exc:
        code = _exit_code(exc)
        if code and code != MORPH_EXIT:
            said = exc.code if isinstance(exc.code, str) else f"exit code {code}"
            _report(me, "failed", SystemExit(said), f"SystemExit: {said}\n", code=code)
    except BaseException as exc:  # the rank is over either way; report everything, KeyboardInterrupt too
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        text = _format_exception(exc)
        sys.stderr.write(text)
        _report(me, "failed", exc, text, code=code)
    if code and code != MORPH_EXIT:
        _finish(code, log, real_out, real_err)  # no MPI_Finalize: the process manager ends the job now
    _report(me, "morph" if code == MORPH_EXIT else "done")
    sys.stdout.flush()
    try:
        shutdown()
    except Exception as exc:  # the script's work is done; say so and still end cleanly
        print(f"varuna: destroying the process group failed: {exc!r}", file=sys.stderr)
    finalize_mpi()
    _finish(code, log, real_out, real_err)


if __name__ == "__main__":
    main()
