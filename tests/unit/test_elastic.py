"""Pure tests of varuna/elastic.py's decisions: the hostfile's slot count and the shape of the next
launch after a morph exit (shared by `varuna run --elastic` and the workbench's controller), and the
typed errors of bad hostfiles and run directories. The elastic runs themselves are in
tests/multirank/test_morph.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import REPO

from varuna.elastic.protocol import Shape, request_resize
from varuna.elastic.reshape import shape_for_gpus
from varuna.elastic.supervisor import hostfile_slots, next_shape
from varuna.errors import ConfigError


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    info = {"pipeline": 2, "data": 2, "global_batch_size": 16, "micro_batch_size": 2, "num_segments": 4}
    (run / "engine.json").write_text(json.dumps(info))
    return run


def test_hostfile_slots_reads_every_mpi_form(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a\nb:2\nc slots=3  # a comment\n\n# only a comment\n")
    assert hostfile_slots(hostfile) == 6


def test_next_shape_keeps_the_shape_when_nothing_changed(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a:4\n")
    assert next_shape(run, Shape(2, 2), hostfile, 4) == Shape(2, 2)
    assert next_shape(run, Shape(2, 2), None, None) == Shape(2, 2)


def test_next_shape_follows_an_edited_hostfile(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a:2\n")  # was 4 slots when the job started
    new = next_shape(run, Shape(2, 2), hostfile, 4)
    assert new.pipeline * new.data == 2 and 16 % (new.data * 2) == 0


def test_a_resize_request_wins_and_is_taken_once(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a:2\n")
    request_resize(run, pipeline=4, data=1, notify=False)
    assert next_shape(run, Shape(2, 2), hostfile, 4) == Shape(4, 1)  # the request, not the hostfile
    assert next_shape(run, Shape(4, 1), None, None) == Shape(4, 1)  # consumed


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("a\nb slots=abc\n", r"hosts line 2: expected `host`, `host:N` or `host slots=N`.*got 'b slots=abc'"),
        ("a:0\n", r"hosts line 1: .*got 'a:0'"),
        ("b slots=\n", r"hosts line 1: .*got 'b slots='"),
        ("# nobody\n", r"hosts names no host"),
    ],
)
def test_a_bad_hostfile_names_the_line(tmp_path: Path, text: str, says: str) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(text)
    with pytest.raises(ConfigError, match=says):
        hostfile_slots(hostfile)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "varuna", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_cli_bad_inputs_of_elastic_runs_and_resizes_are_one_line_exit_2(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    (run / "job.json").write_text("{}")
    (run / "engine.json").write_text('{"pipeline": 2, "data"')  # torn, e.g. by a full disk
    script = tmp_path / "t.py"
    script.write_text("")
    bad = tmp_path / "bad-hosts"
    bad.write_text("node1 slots=abc\n")
    cases = [
        (
            ["run", "--elastic", "--hostfile", str(tmp_path / "missing"), "-p", "1", str(script)],
            "hostfile not found",
        ),
        (["run", "--elastic", "--hostfile", str(bad), "-p", "1", str(script)], "line 1: expected `host`"),
        (["resize", "--gpus", "2", str(run)], "engine.json is not readable JSON"),
    ]
    for argv, says in cases:
        done = _cli(*argv)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("varuna: error: "), done.stderr
        assert says in done.stderr, done.stderr


def test_an_engine_json_without_the_shape_is_a_config_error(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    (run / "engine.json").write_text('{"pipeline": 2}')
    with pytest.raises(
        ConfigError, match=r"lacks integer data, global_batch_size.*or give --pipeline and --data"
    ):
        shape_for_gpus(run, 2)
