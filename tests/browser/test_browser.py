"""Real-browser tests: JupyterLab in headless Chromium renders the widgets and the buttons reach the kernel.

The harness lives in `tests/browser/browser.py` (how to write the quickstart test is in its docstring). The smoke
test uses `tests/browser/notebooks/browser_smoke.ipynb`, which follows the workbench's DOM contract without a job.
"""

from __future__ import annotations

import json
import re

import browser
import pytest

pytestmark = pytest.mark.foreground

ROWS = ["stage 0 · replica 0", "stage 1 · replica 0"]


@pytest.fixture
def smoke_lab(request: pytest.FixtureRequest):
    failed = browser.test_failed(request)
    with browser.lab_session(
        browser.TEST_NOTEBOOKS, "browser_smoke.ipynb", request.node.name, failed=failed
    ) as lab:
        yield lab


@pytest.mark.timeout(420)  # two Chromium starts of up to 120 s each, then the lab
def test_browser_harness_smoke(smoke_lab: browser.LabPage) -> None:
    lab = smoke_lab
    lab.run_all_cells(timeout_s=90)
    lab.wait_for_output("smoke notebook ready")
    assert lab.wait_for_class_text("varuna-state", re.compile(r"^state: ")) == "state: idle"
    assert lab.wait_for_plotly_texts("varuna-timeline", lambda t: t == ROWS) == ROWS
    assert lab.trace_count("varuna-timeline") == 1
    lab.shot("rendered", show="varuna-timeline")

    lab.set_int_text("P", 3)
    lab.click_button("Checkpoint")
    written = lab.wait_for_file("smoke-checkpoint.json")
    assert json.loads(written.read_text()) == {"P": 3}
    lab.wait_for_class_text("varuna-state", "state: checkpointed")
    rows = lab.wait_for_plotly_texts("varuna-timeline", lambda t: len(t) == 3)
    assert rows == [*ROWS, "stage 2 · replica 0"]
    assert lab.trace_count("varuna-timeline") == 1
    lab.shot("checkpointed", show="varuna-timeline")

    # An element that never appears fails within its timeout, saying what was visible and where the
    # screenshot is, instead of hanging until pytest-timeout.
    with pytest.raises(
        browser.BrowserHarnessError,
        match=r"(?s)exactly one button labelled 'Resize'.*visible:.*output: state: checkpointed.*screenshot: .*\.png",
    ):
        lab.click_button("Resize", timeout_s=1)


@pytest.mark.timeout(60)
def test_missing_chromium_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VARUNA_CHROMIUM", "/nonexistent/chromium")
    with pytest.raises(browser.BrowserHarnessError, match=r"apt-get install -y chromium"):
        with browser.chromium():
            pass


@pytest.mark.timeout(60)
def test_a_chromium_start_that_times_out_is_tried_again_then_reported() -> None:
    with pytest.raises(browser.BrowserHarnessError, match=r"did not start in 2 attempt\(s\) of 0 s.*Timeout"):
        with browser.chromium(timeout_s=0.001, attempts=2):
            pass


@pytest.mark.timeout(60)
def test_lab_start_failure_shows_log_tail() -> None:
    missing_cert = ["--ServerApp.certfile=/nonexistent/varuna-cert.pem"]
    with pytest.raises(
        browser.BrowserHarnessError,
        match=r"(?s)jupyter lab exited with code 1.*log .*varuna-cert.pem\" does not exist",
    ):
        with browser.jupyter_lab(browser.TEST_NOTEBOOKS, extra_args=missing_cert):
            pass


# --- the quickstart notebook, for real -------------------------------------------------------------

QUICKSTART_ENV = {
    "VARUNA_NOTEBOOK_SMALL": "1",
    "VARUNA_QUICKSTART_STEPS": "100000",  # keeps running until the test stops it
    "OMP_NUM_THREADS": "1",
}


def _rows(n_stages: int, n_replicas: int) -> set[str]:
    return {f"stage {s} · replica {r}" for s in range(n_stages) for r in range(n_replicas)}


@pytest.mark.timeout(900)
def test_quickstart_in_the_browser(request: pytest.FixtureRequest) -> None:
    """Open the quickstart, run its first part (start + display), then drive the job with the buttons:
    spans for every stage, Checkpoint lands on disk, Resize changes the rows, a SIGKILLed worker shows
    as dead while the kernel lives on, Resume relaunches from the checkpoint, Stop stops."""
    import os
    import signal

    from varuna.elastic.protocol import live_workers

    failed = browser.test_failed(request)
    with browser.lab_session(
        browser.REPO / "notebooks",
        "quickstart.ipynb",
        request.node.name,
        env=QUICKSTART_ENV,
        failed=failed,
    ) as lab:
        lab.run_cells_above("## Steer it from code", timeout_s=120)
        lab.wait_for_class_text("varuna-state", re.compile(r"^state: running"), timeout_s=120)
        rows = lab.wait_for_plotly_texts("varuna-timeline", lambda t: set(t) == _rows(2, 2), timeout_s=150)
        assert len(rows) == 4
        assert lab.trace_count("varuna-timeline") >= 7  # a bar trace per span kind
        assert lab.trace_count("varuna-memory") >= 4
        lab.shot("running 2x2", show="varuna-timeline")
        # The docs' picture of the workbench, when VARUNA_SCREENSHOTS is set (`make docs-screenshots`).
        lab.docs_shot("workbench", ["varuna-state", "varuna-timeline", "varuna-bubbles", "varuna-memory"])

        lab.click_button("Checkpoint")
        ckpt = lab.wait_for_file("runs/quickstart-*/checkpoints/step-*/manifest.json", timeout_s=120)
        run_dir = ckpt.parents[2]
        lab.wait_for_output(re.compile(r"checkpoint of step \d+ written"), timeout_s=60)

        lab.set_int_text("P", 4)
        lab.set_int_text("D", 1)
        lab.click_button("Resize")
        lab.wait_for_plotly_texts("varuna-timeline", lambda t: set(t) == _rows(4, 1), timeout_s=240)
        lab.wait_for_class_text("varuna-state", re.compile(r"^state: running"), timeout_s=120)
        lab.shot("running 4x1", show="varuna-timeline")

        pids = live_workers(run_dir)
        assert len(pids) == 4
        os.kill(pids[-1], signal.SIGKILL)
        lab.wait_for_class_text("varuna-state", re.compile(r"^state: failed"), timeout_s=60)
        lab.wait_for_output(re.compile(r"rank \d \(stage \d, replica 0\) killed"), timeout_s=30)
        lab.shot("a worker killed")
        lab.wait_kernel_idle(timeout_s=10)  # the kernel survived

        lab.click_button("Resume")
        lab.wait_for_class_text("varuna-state", re.compile(r"^state: running"), timeout_s=180)
        lab.wait_for_plotly_texts("varuna-timeline", lambda t: set(t) == _rows(4, 1), timeout_s=120)
        lab.click_button("Stop")
        lab.wait_for_class_text("varuna-state", re.compile(r"^state: stopped"), timeout_s=180)
        lab.shot("stopped")
