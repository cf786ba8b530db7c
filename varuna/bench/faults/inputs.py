"""Fault-bench cases on bad input: each must be a typed varuna error saying what was expected, what was
given and what to change; on the command line one line and exit status 2. The engine is real (world
size 1, this process); the CLI runs as `python -m varuna`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from varuna.bench.faults.case import Case, Result, cli_user_error, env_set, raises
from varuna.errors import ConfigError


def varuna_with(**kw: Any) -> Callable[[Path], Result]:
    """`Varuna(model, ..., **kw)` must refuse `kw`."""
    pattern = {
        "checkpoint_kep": r"unknown option 'checkpoint_kep'; did you mean 'checkpoint_keep'",
        "checkpoint_keep": r"checkpoint_keep must be a positive integer, got '2'",
        "profile_repeats": r"profile_repeats must be a positive integer, got 0",
        "bucket_mb": r"bucket_mb must be a number > 0, got 0",
    }[next(iter(kw))]

    def case(tmp: Path) -> Result:
        from varuna import Varuna
        from varuna.models import GPT, gpt_tiny

        model = GPT(gpt_tiny())
        return raises(
            lambda: Varuna(model, global_batch_size=4, micro_batch_size=2, **kw), ConfigError, pattern
        )

    return case


def engine_call(call: Callable[[Any, Any], Any], pattern: str) -> Callable[[Path], Result]:
    """`call(engine, dataset)` on a real one-process engine must raise ConfigError matching `pattern`."""

    def case(tmp: Path) -> Result:
        from varuna.bench.faults.checkpoints import engine

        eng, data = engine(tmp / "run")
        try:
            return raises(lambda: call(eng, data), ConfigError, pattern)
        finally:
            eng.close()

    return case


def _tensor_dataset(eng: Any, data: Any) -> Any:
    import torch
    from torch.utils.data import TensorDataset

    return eng.batch(TensorDataset(torch.zeros(8, 2)), 0)


def _tensor(eng: Any, data: Any) -> Any:
    import torch

    return eng.batch(torch.zeros(8, 2), 0)


def _iterable(eng: Any, data: Any) -> Any:
    import torch
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            yield {"x": torch.zeros(1)}

    return eng.batch(Stream(), 0)


def finished_run(tmp: Path) -> Path:
    """A run directory whose job finished (job.json only), as `resume` finds it."""
    run = tmp / "run"
    run.mkdir()
    job = {"argv": ["train.py"], "pipeline": 2, "data": 1, "start": 0.0, "end": 1.0, "exit_code": 0}
    (run / "job.json").write_text(json.dumps(job))
    return run


def controller_call(call: Callable[[Any], Any], pattern: str) -> Callable[[Path], Result]:
    """`call(controller)` on a controller attached to a finished run must refuse, launching nothing."""

    def case(tmp: Path) -> Result:
        from varuna.controller import JobController

        ctl = JobController.attach(finished_run(tmp), reconnect=False)
        try:
            ok, seen = raises(lambda: call(ctl), ConfigError, pattern)
            return ok and ctl.job is None and ctl.state == "finished", f"{seen}; state {ctl.state}"
        finally:
            ctl.close()

    return case


def heartbeat_env(tmp: Path) -> Result:
    from varuna.telemetry.heartbeat import heartbeat_interval

    with env_set(VARUNA_HEARTBEAT_S="abc"):
        return raises(heartbeat_interval, ConfigError, r"VARUNA_HEARTBEAT_S must be a number of seconds >= 0")


def silent_after(tmp: Path) -> Result:
    from varuna.controller import JobController

    return raises(
        lambda: JobController(tmp, silent_after_s=-1),
        ConfigError,
        r"silent_after_s must be a number of seconds > 0",
    )


def max_restarts(tmp: Path) -> Result:
    from varuna.bench.faults.jobs import TRAIN
    from varuna.controller import JobController

    def start() -> Any:
        return JobController.start(
            [str(TRAIN), "1", "0"], pipeline=1, data=1, run_dir=tmp / "run", max_restarts=-1
        )

    ok, seen = raises(start, ConfigError, r"max_restarts must be an integer >= 0, got -1")
    return ok and not (tmp / "run" / "agent").exists(), seen


def cli_case(build: Callable[[Path], list[str]], says: str) -> Callable[[Path], Result]:
    return lambda tmp: cli_user_error(build(tmp), says)


def _missing_hostfile(tmp: Path) -> list[str]:
    (tmp / "t.py").write_text("")
    return ["run", "--elastic", "--hostfile", str(tmp / "missing"), "-p", "1", str(tmp / "t.py")]


def _bad_slots(tmp: Path) -> list[str]:
    (tmp / "t.py").write_text("")
    (tmp / "hosts").write_text("node1 slots=abc\n")
    return ["run", "--elastic", "--hostfile", str(tmp / "hosts"), "-p", "1", str(tmp / "t.py")]


def _corrupt_engine_json(tmp: Path) -> list[str]:
    run = tmp / "run"
    (run / "status").mkdir(parents=True)
    (run / "job.json").write_text("{}")
    (run / "engine.json").write_text('{"pipeline": 2, "data"')  # torn, as by a full disk
    return ["resize", "--gpus", "2", str(run)]


def cases() -> list[Case]:
    return [
        Case(
            "checkpoint_kep=2",
            "bad input",
            "ConfigError: did you mean 'checkpoint_keep'? lists options",
            varuna_with(checkpoint_kep=2),
        ),
        Case(
            'checkpoint_keep="2"',
            "bad input",
            "ConfigError: a positive integer, got '2'",
            varuna_with(checkpoint_keep="2"),
        ),
        Case(
            "profile_repeats=0",
            "bad input",
            "ConfigError: a positive integer, got 0",
            varuna_with(profile_repeats=0),
        ),
        Case("bucket_mb=0", "bad input", "ConfigError: a number > 0, got 0", varuna_with(bucket_mb=0)),
        Case(
            "engine.step([batch])",
            "bad input",
            "ConfigError: step() takes one batch dict (got a list)",
            engine_call(
                lambda e, d: e.step([e.batch(d, 0)]), r"step\(\) takes one batch dict, .*\(got a list\)"
            ),
        ),
        Case(
            "engine.batch(TensorDataset)",
            "bad input",
            "ConfigError: a sample must be a dict of tensors",
            engine_call(_tensor_dataset, r"a sample must be a dict of tensors.*TensorDataset"),
        ),
        Case(
            "a tensor as dataset",
            "bad input",
            "ConfigError: a tensor is not a dataset of dicts; wrap it",
            engine_call(_tensor, r"a tensor is not a dataset of dicts; wrap it"),
        ),
        Case(
            "an IterableDataset shorter than a global batch",
            "bad input",
            "ConfigError: the stream ends before step 0's global batch",
            engine_call(_iterable, r"the stream ended after 1 samples, before step 0's global batch"),
        ),
        Case(
            "varuna run --elastic --hostfile missing",
            "bad input",
            "exit 2, one line: hostfile not found",
            cli_case(_missing_hostfile, "hostfile not found"),
        ),
        Case(
            "hostfile slots=abc",
            "bad input",
            "exit 2, one line naming line 1",
            cli_case(_bad_slots, "line 1: expected `host`"),
        ),
        Case(
            "varuna resize --gpus 2, corrupt engine.json",
            "bad input",
            "exit 2, one line: not readable JSON",
            cli_case(_corrupt_engine_json, "engine.json is not readable JSON"),
        ),
        Case(
            'ctl.set(spans_every="x")',
            "bad input",
            "ConfigError before sending; nothing launched",
            controller_call(
                lambda c: c.set(spans_every="x"), r"set\(spans_every=...\) takes an integer >= 1"
            ),
        ),
        Case(
            "ctl.set(span_every=2) (misspelt)",
            "bad input",
            "ConfigError listing the valid options",
            controller_call(lambda c: c.set(span_every=2), r"no option 'span_every'; valid: paused"),
        ),
        Case(
            'ctl.resume(pipeline="2")',
            "bad input",
            "ConfigError at once; no launch, no hang",
            controller_call(
                lambda c: c.resume(pipeline="2"), r"resume\(pipeline=...\) takes a positive integer"
            ),
        ),
        Case(
            "ctl.resume(pipeline=0)",
            "bad input",
            "ConfigError (not silently the last shape)",
            controller_call(lambda c: c.resume(pipeline=0), r"resume\(pipeline=...\).*got 0"),
        ),
        Case("VARUNA_HEARTBEAT_S=abc", "bad input", "ConfigError: seconds >= 0, got 'abc'", heartbeat_env),
        Case("silent_after_s=-1", "bad input", "ConfigError: seconds > 0", silent_after),
        Case(
            "JobController.start(max_restarts=-1)",
            "bad input",
            "ConfigError in the caller; no agent",
            max_restarts,
        ),
    ]
