"""`python -m varuna.bench faults --quick`: every in-process and CLI case of the fault bench holds.

A correctness claim, not a timing: each case provokes a fault, an attack or a bad input for real and
the bench judges what it observed. The multi-rank cases (skipped by --quick) run in the full bench;
`select` is checked here so that --quick and --only keep meaning what they say.
"""

from __future__ import annotations

import pytest
from _helpers import run_bench

from varuna.bench.faults import all_cases, select

pytestmark = pytest.mark.foreground


def test_cases_are_many_named_once_and_of_the_three_kinds() -> None:
    cases = all_cases()
    names = [c.name for c in cases]
    assert len(cases) >= 30 and len(set(names)) == len(names)
    assert {c.kind for c in cases} == {"attack", "fault", "bad input"}
    quick = select(cases, quick=True, only=None)
    assert quick and not any(c.job for c in quick) and len(quick) < len(cases)
    assert [c.name for c in select(cases, quick=False, only="enospc")] == ["ENOSPC during a checkpoint"]


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_faults_bench_quick_every_case_holds() -> None:
    report, stderr = run_bench("faults", timeout=290)
    assert report["bench"] == "faults" and report["quick"] is True
    cases = report["cases"]
    assert len(cases) >= 25 and report["total"] == len(cases)
    for case in cases:
        assert set(case) >= {"name", "kind", "expected", "observed", "ok"}
        assert case["kind"] in ("attack", "fault", "bad input") and case["observed"]
    failed = [f"{c['name']}: {c['observed']}" for c in cases if not c["ok"]]
    assert not failed, "\n".join(failed)
    assert report["passed"] == len(cases) and report["wall_s"] > 0
    assert f"{len(cases)} of {len(cases)} hold" in stderr
