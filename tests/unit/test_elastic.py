"""Pure tests of varuna/elastic.py's decisions: the hostfile's slot count and the shape of the next
launch after a morph exit (shared by `varuna run --elastic` and the workbench's controller). The
elastic runs themselves are in tests/multirank/test_morph.py."""

from __future__ import annotations

import json
from pathlib import Path

from varuna.elastic.protocol import Shape, request_resize
from varuna.elastic.supervisor import hostfile_slots, next_shape


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
