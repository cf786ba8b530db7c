"""Real-browser test harness: JupyterLab in headless Debian Chromium, driven by Playwright.

Why it exists: nbclient proves a notebook *executes*; only a browser proves the widgets *render* and the
buttons drive the kernel. This module starts a private `jupyter lab` on a temp copy of a notebook folder,
opens the notebook in Chromium and offers a few helpers that speak the workbench's DOM contract. It is a
helper module (no `test_` prefix); tests import it as `import browser` (pytest puts `tests/` on sys.path).

What it isolates: a free port on 127.0.0.1, a random token, temp JUPYTER_CONFIG/DATA/RUNTIME dirs, temp
JupyterLab settings and workspaces (so no old tabs reopen and no user setting leaks in), a temp IPYTHONDIR,
news and update checks off, a fresh Chromium profile. Everything it starts is stopped on exit, also on
failure or a pytest-timeout: the server gets SIGTERM then SIGKILL, and every descendant it had (kernels,
and whatever the kernels launched, e.g. mpiexec and workers) is swept after it.

Screenshots, the browser console and the server log go to `test-artifacts/browser/<name>/` (gitignored),
always: one per `shot(...)`, plus `99-final.png` or `99-failed.png` when the session ends.

Writing the quickstart test (the workbench's DOM contract)::

    import browser

    NOTEBOOKS = browser.REPO / "notebooks"

    @pytest.mark.timeout(600)
    def test_quickstart_in_browser(request):
        with browser.lab_session(NOTEBOOKS, "quickstart.ipynb", request.node.name) as lab:
            lab.run_all_cells(timeout_s=300)
            lab.shot("ran")
            # Buttons are labelled exactly "Start", "Checkpoint", "Resize", "Resume", "Stop"; IntTexts
            # have descriptions "P", "D", "GPUs"; the job state is an HTML widget with class
            # `varuna-state` reading "state: ..."; the timeline PlotView has class `varuna-timeline`
            # and y tick labels "stage S · replica R"; the memory figure has class `varuna-memory`.
            lab.wait_for_class_text("varuna-state", re.compile(r"^state: running"), timeout_s=120)
            rows = lab.wait_for_plotly_texts(
                "varuna-timeline", lambda t: {r.split(" · ")[0] for r in t} == {"stage 0", "stage 1"}
            )
            assert lab.trace_count("varuna-timeline") > 0      # spans drawn
            assert lab.trace_count("varuna-memory") > 0
            lab.click_button("Checkpoint")
            lab.wait_for_class_text("varuna-state", "state: running", timeout_s=120)
            lab.wait_for_file("runs/quickstart-*/checkpoints/step-*", timeout_s=120)  # under lab.root
            lab.set_int_text("P", 4)
            lab.set_int_text("D", 1)
            lab.click_button("Resize")
            lab.wait_for_plotly_texts("varuna-timeline", lambda t: len(t) == 4, timeout_s=180)
            lab.click_button("Stop")
            lab.wait_for_class_text("varuna-state", "state: stopped", timeout_s=120)

`lab.root` is the temp copy the server serves (the kernel's working directory is the notebook's folder
inside it). The quickstart must keep its job small enough to run in a few minutes on 2 CPU cores, and
should write its run directory under the notebook's folder so `wait_for_file` finds it. Run one test:
`OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/browser/test_browser.py -x -q`; set VARUNA_CHROMIUM to use
another Chromium binary.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "browser"
# A folder (relative to the repository) for the docs' pictures of the workbench; unset: none are saved.
SCREENSHOTS_ENV = "VARUNA_SCREENSHOTS"
TEST_NOTEBOOKS = Path(__file__).resolve().parent / "notebooks"

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # Docker's default /dev/shm is 64 MB, too small for Chromium's shared memory: use /tmp instead.
    "--disable-dev-shm-usage",
]

# JupyterLab user settings for the session: no news prompt, no update check, every cell in the DOM
# (the default "contentVisibility"/"full" windowing leaves off-screen cells unrendered or detached).
LAB_SETTINGS: dict[str, dict[str, Any]] = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/extensionmanager-extension/plugin": {"enabled": False},
}
SERVER_CONFIG = {
    # news_url None disables the announcements feed in the page config; the frontend then never asks.
    "LabApp": {
        "news_url": None,
        "check_for_updates_class": "jupyterlab.NeverCheckForUpdate",
        "extension_manager": "readonly",
        # window.jupyterapp lets the harness read cell outputs from the notebook model (errors).
        "expose_app_in_browser": True,
    },
}

_PROMPTS_JS = """panel => {
    const cells = [...panel.querySelectorAll('.jp-Notebook .jp-CodeCell')];
    const prompt = c => (c.querySelector('.jp-InputPrompt')?.textContent || '').trim();
    const ind = panel.querySelector('.jp-Notebook-ExecutionIndicator');
    return {prompts: cells.map(prompt), kernel: ind ? ind.dataset.status : null};
}"""
# Select the first cell containing a marker and run the ones above it; returns how many are code cells.
_RUN_ABOVE_JS = """([path, marker]) => {
    const app = window.jupyterapp;
    if (!app) return null;
    const panel = [...app.shell.widgets('main')].find(w => w.context && w.context.path === path);
    if (!panel || !panel.content.model) return null;
    const cells = panel.content.model.cells;
    let index = -1, code = 0;
    for (let i = 0; i < cells.length; i++) {
        if (cells.get(i).sharedModel.getSource().includes(marker)) { index = i; break; }
        if (cells.get(i).type === 'code') code += 1;
    }
    if (index < 0) return null;
    app.shell.activateById(panel.id);
    panel.content.activeCellIndex = index;
    app.commands.execute('notebook:run-all-above');
    return code;
}"""
# Error outputs look like stderr in the DOM; the notebook model tells them apart (output_type "error").
_ERRORS_JS = """path => {
    const app = window.jupyterapp;
    if (!app) return null;
    const panel = [...app.shell.widgets('main')].find(w => w.context && w.context.path === path);
    if (!panel || !panel.content.model) return null;
    const cells = panel.content.model.cells, errors = [];
    let code = 0;
    for (let i = 0; i < cells.length; i++) {
        const cell = cells.get(i);
        if (cell.type !== 'code') continue;
        code += 1;
        for (let j = 0; j < cell.outputs.length; j++) {
            const o = cell.outputs.get(j).toJSON();
            if (o.output_type === 'error') errors.push({cell: code, ename: o.ename, evalue: o.evalue,
                traceback: (o.traceback || []).join('\\n'), source: cell.sharedModel.getSource().split('\\n')[0]});
        }
    }
    return errors;
}"""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class BrowserHarnessError(RuntimeError):
    """The browser, the server or the page did not do what the test waited for; the message says what was seen."""


def _exact(text: str) -> re.Pattern[str]:
    return re.compile(rf"^\s*{re.escape(text)}\s*$")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80] or "session"


# --------------------------------------------------------------------------------------------- server


@dataclass
class LabServer:
    """A running `jupyter lab`: where it listens, its token, the folder it serves and its log."""

    base_url: str
    token: str
    root: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base_url}/{path.lstrip('/')}{sep}token={self.token}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


try:  # resolved here, not in the forked child, where loading a library is not safe
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent() -> None:
    # If pytest itself is SIGKILLed, the server still gets SIGTERM (and stops its kernels).
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop_tree(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the server, SIGKILL it after `grace_s`, then kill any descendant still alive."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    _, alive = psutil.wait_procs(family, timeout=3)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def _isolated_env(home: Path, extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "JPY_"))}
    env.pop("IPYTHONDIR", None)
    dirs = {
        "JUPYTER_CONFIG_DIR": home / "config",
        "JUPYTER_DATA_DIR": home / "data",
        "JUPYTER_RUNTIME_DIR": home / "runtime",
        "JUPYTERLAB_SETTINGS_DIR": home / "lab-settings",
        "JUPYTERLAB_WORKSPACES_DIR": home / "lab-workspaces",
        "IPYTHONDIR": home / "ipython",
    }
    for name, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        env[name] = str(path)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@contextlib.contextmanager
def jupyter_lab(
    notebook_dir: Path,
    *,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    settings: dict[str, dict[str, Any]] | None = None,
    extra_args: list[str] | None = None,
    startup_timeout_s: float = 90.0,
) -> Iterator[LabServer]:
    """Serve a temp copy of `notebook_dir` with a private, headless `jupyter lab`; stop it on exit.

    `settings` adds JupyterLab user settings ({"@jupyterlab/PKG/PLUGIN": {...}}) over LAB_SETTINGS;
    `extra_args` go last on the command line (e.g. "--ServerApp.log_level=DEBUG")."""
    home = Path(tempfile.mkdtemp(prefix="varuna-browser-"))
    root = home / "root"
    shutil.copytree(notebook_dir, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "runs"))
    run_env = _isolated_env(home, env)
    (home / "config" / "jupyter_server_config.json").write_text(json.dumps(SERVER_CONFIG))
    for plugin, values in {**LAB_SETTINGS, **(settings or {})}.items():
        path = home / "lab-settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    log_path = log_path or home / "jupyter.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(24)
    proc: subprocess.Popen[bytes] | None = None
    try:
        for _attempt in range(3):  # a port picked free can be taken before the server binds it
            port = _free_port()
            cmd = [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={root}",
            ]
            if os.geteuid() == 0:  # CI containers run as root; the server refuses without the flag
                cmd.append("--allow-root")
            cmd += extra_args or []
            with open(log_path, "wb") as log:
                # Popen runs the server's own Python: the PID we keep is the server's, not a shell's.
                proc = subprocess.Popen(
                    cmd,
                    cwd=root,
                    env=run_env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_die_with_parent,
                    start_new_session=True,  # a Ctrl-C in the terminal is pytest's to handle, not the server's
                )
            server = LabServer(f"http://127.0.0.1:{port}", token, root, proc, log_path)
            if _wait_until_up(server, startup_timeout_s):
                break
            tail = server.log_tail()
            if "already in use" not in tail:
                hint = (
                    " (install the notebook extra: pip install -e '.[notebook]')"
                    if "No module" in tail
                    else ""
                )
                raise BrowserHarnessError(
                    f"jupyter lab exited with code {proc.returncode} before answering /api/status{hint}.\n"
                    f"command: {' '.join(cmd).replace(token, '<token>')}\nlog {log_path}:\n{tail}"
                )
        else:
            raise BrowserHarnessError(
                f"no free port for jupyter lab after 3 tries; log:\n{server.log_tail()}"
            )
        yield server
    finally:
        if proc is not None:
            _stop_tree(proc)
        shutil.rmtree(home, ignore_errors=True)


def _wait_until_up(server: LabServer, timeout_s: float) -> bool:
    """True when /api/status answers; False if the process died; raises after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(server.url("api/status"), timeout=2) as reply:
                if reply.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise BrowserHarnessError(
        f"jupyter lab did not answer {server.base_url}/api/status within {timeout_s:.0f} s.\n"
        f"log {server.log_path}:\n{server.log_tail()}"
    )


# -------------------------------------------------------------------------------------------- browser


def chromium_path() -> str:
    """The Chromium binary: $VARUNA_CHROMIUM or Debian's /usr/bin/chromium, with the fix when missing."""
    path = os.environ.get("VARUNA_CHROMIUM") or shutil.which("chromium") or CHROMIUM
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise BrowserHarnessError(
            f"Chromium not found at {path}. Install Debian's chromium: apt-get install -y chromium "
            "(or set VARUNA_CHROMIUM=/path/to/chromium). Do not run `playwright install`."
        )
    return path


@contextlib.contextmanager
def chromium(
    *, viewport: tuple[int, int] = (1400, 1300), timeout_s: float = 120.0, attempts: int = 2
) -> Iterator[Any]:
    """A Playwright BrowserContext on Debian's Chromium with a fresh profile; closed on exit.

    CI's first start, right after `apt-get install chromium` on a loaded 2-core host, once took over
    30 s while the later ones started in seconds: each start gets `timeout_s`, and a start that times
    out is tried again with a new profile, `attempts` times in all."""
    executable = chromium_path()
    try:
        from playwright.sync_api import TimeoutError as StartTimeout
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        raise BrowserHarnessError(
            "the Python package `playwright` is missing: pip install playwright (only the package; "
            "never `playwright install`, the browser is Debian's chromium)"
        ) from exc
    profiles: list[str] = []
    try:
        with sync_playwright() as pw:
            for attempt in range(1, attempts + 1):
                profiles.append(tempfile.mkdtemp(prefix="varuna-chromium-"))
                try:
                    context = pw.chromium.launch_persistent_context(
                        profiles[-1],
                        executable_path=executable,
                        headless=True,
                        args=CHROMIUM_ARGS,
                        viewport={"width": viewport[0], "height": viewport[1]},
                        timeout=timeout_s * 1000,
                    )
                    break
                except Exception as exc:
                    if attempt < attempts and isinstance(exc, StartTimeout):
                        continue
                    raise BrowserHarnessError(
                        f"Chromium at {executable} did not start in {attempt} attempt(s) of {timeout_s:.0f} s "
                        f"({type(exc).__name__}: {exc}). Check that `{executable} --headless --no-sandbox "
                        "--disable-gpu --dump-dom about:blank` works; reinstall with apt-get install -y chromium."
                    ) from exc
            try:
                yield context
            finally:
                context.close()
    finally:
        for profile in profiles:
            shutil.rmtree(profile, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- page


class LabPage:
    """One JupyterLab tab showing one notebook, with helpers that wait, look only at the visible notebook
    panel (JupyterLab keeps hidden tabs in the DOM) and fail with what was visible and a screenshot."""

    def __init__(self, page: Any, server: LabServer, artifacts: Path, *, timeout_s: float = 30.0) -> None:
        self.page = page
        self.server = server
        self.artifacts = artifacts
        self.timeout_s = timeout_s
        self.console: list[str] = []
        self._shots = 0
        self.notebook_path = ""
        page.set_default_timeout(timeout_s * 1000)
        page.on("console", lambda m: self.console.append(f"[{m.type}] {m.text}"))
        page.on("pageerror", lambda e: self.console.append(f"[pageerror] {e}"))
        self.notebook = page.locator(".jp-NotebookPanel").filter(visible=True)

    @property
    def root(self) -> Path:
        """The folder the server serves (a temp copy of the notebook folder)."""
        return self.server.root

    # -- artifacts and failures

    def shot(self, step: str, *, show: str | None = None) -> Path:
        """Save a screenshot `NN-step.png` into this session's artifact folder and return its path;
        `show` (a CSS class, e.g. "varuna-timeline") scrolls that element into view first."""
        if show:
            with contextlib.suppress(Exception):
                self.notebook.locator(f".{show}").filter(visible=True).first.scroll_into_view_if_needed(
                    timeout=2000
                )
        self._shots += 1
        path = self.artifacts / f"{self._shots:02d}-{_slug(step)}.png"
        self.page.screenshot(path=str(path))
        return path

    def docs_shot(self, name: str, classes: list[str], *, settle_s: float = 60.0) -> Path | None:
        """When $VARUNA_SCREENSHOTS names a folder, save `NAME.png` there: the part of the visible
        notebook from the first element of `classes` to the last, once every figure among them has
        traces (waited for up to `settle_s`, never failing: this is a picture, not a check). It is how
        `make docs-screenshots` renews docs/img/; without the variable it does nothing."""
        folder = os.environ.get(SCREENSHOTS_ENV)
        if not folder:
            return None
        elements = [self.notebook.locator(f".{c}").filter(visible=True).first for c in classes]
        deadline = time.monotonic() + settle_s
        plots = [c for c in classes if self.plot(c).count()]
        while time.monotonic() < deadline and not all(self.trace_count(c) for c in plots):
            self.page.wait_for_timeout(500)
        self.page.wait_for_timeout(1500)  # the throttled redraw after the last update
        elements[0].evaluate("e => e.scrollIntoView({block: 'start'})")
        boxes = [box for box in (e.bounding_box() for e in elements) if box]
        viewport = self.page.viewport_size or {"width": 1400, "height": 1300}
        pad = 8
        left = max(0.0, min(b["x"] for b in boxes) - pad)
        top = max(0.0, min(b["y"] for b in boxes) - pad)
        right = min(float(viewport["width"]), max(b["x"] + b["width"] for b in boxes) + pad)
        bottom = min(float(viewport["height"]), max(b["y"] + b["height"] for b in boxes) + pad)
        path = Path(folder) if Path(folder).is_absolute() else REPO / folder
        path.mkdir(parents=True, exist_ok=True)
        path = path / f"{_slug(name)}.png"
        clip = {"x": left, "y": top, "width": right - left, "height": bottom - top}
        self.page.screenshot(path=str(path), clip=clip, animations="disabled")
        return path

    def visible_summary(self, limit: int = 1500) -> str:
        """What a person would see: open dialogs, toasts and the visible notebook's outputs, as text."""
        parts = []
        for what, sel in (
            ("dialog", ".jp-Dialog"),
            ("toast", ".Toastify__toast"),
            ("output", ".jp-OutputArea-output"),
        ):
            with contextlib.suppress(Exception):
                scope = self.page if what != "output" else self.notebook
                for text in scope.locator(sel).filter(visible=True).all_text_contents():
                    parts.append(f"{what}: {' '.join(text.split())[:300]}")
        text = "\n  ".join(parts) or "(no notebook, dialog or output visible)"
        return text[:limit]

    def fail(self, message: str, *, step: str = "error") -> BrowserHarnessError:
        """An error carrying `message`, what was visible, a fresh screenshot and the log locations."""
        try:
            shot = str(self.shot(step))
        except Exception as exc:  # the page may be gone; the message still matters more
            shot = f"(screenshot failed: {exc})"
        console = "\n    ".join(self.console[-8:]) or "(empty)"
        return BrowserHarnessError(
            f"{message}\n  visible:\n  {self.visible_summary()}\n  screenshot: {shot}\n"
            f"  browser console (last lines):\n    {console}\n  jupyter log: {self.server.log_path}"
        )

    def wait_until(
        self, check: Callable[[], tuple[bool, Any]], what: str, timeout_s: float | None = None
    ) -> Any:
        """Poll `check() -> (done, observed)` until done; fail after the timeout showing the last observed."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        observed: Any = None
        while True:
            try:
                done, observed = check()
            except BrowserHarnessError:
                raise
            except Exception as exc:  # e.g. element detached while the widget re-renders
                done, observed = False, f"{type(exc).__name__}: {exc}"
            if done:
                return observed
            if time.monotonic() > deadline:
                raise self.fail(
                    f"timed out after {timeout_s or self.timeout_s:.0f} s waiting for {what}; last seen: {observed!r}",
                    step=f"timeout {what}",
                )
            self.page.wait_for_timeout(200)

    # -- notebook

    def open_notebook(self, path: str, *, timeout_s: float = 60.0) -> None:
        """Open `path` (relative to the served folder) in a reset workspace and wait for an idle kernel."""
        self.notebook_path = path
        self.page.goto(self.server.url(f"lab/tree/{quote(path)}?reset"), wait_until="domcontentloaded")
        self.wait_until(
            lambda: (self.notebook.locator(".jp-Cell").count() > 0, self.page.title()),
            f"notebook {path} to show its cells",
            timeout_s,
        )
        self.dismiss_news()
        self.wait_kernel_idle(timeout_s=timeout_s)

    def dismiss_news(self) -> None:
        """Answer the "Jupyter news" toast with "No" if it shows (settings normally prevent it)."""
        no = self.page.locator(".Toastify__toast button").filter(visible=True).filter(has_text=_exact("No"))
        if no.count():
            no.first.click()

    def kernel_status(self) -> str:
        """The kernel status ("idle", "busy", ...; "no kernel" before one is attached). The toolbar indicator
        alone reads "idle" while the name still says "No Kernel", so the name and the server must agree."""
        name = self.notebook.locator(".jp-KernelName").first
        label = " ".join((name.text_content(timeout=2000) or "").split()) if name.count() else ""
        if not label or label == "No Kernel":
            return "no kernel"
        indicator = self.notebook.locator(".jp-Notebook-ExecutionIndicator").first
        status = indicator.get_attribute("data-status", timeout=2000) if indicator.count() else None
        return status or "unknown"

    def server_kernel_state(self) -> str | None:
        """The server's view of the notebook's kernel (`/api/sessions`), None when it has no session."""
        with urllib.request.urlopen(self.server.url("api/sessions"), timeout=5) as reply:
            sessions = json.load(reply)
        for session in sessions:
            if session.get("path") == self.notebook_path and session.get("kernel"):
                return session["kernel"].get("execution_state")
        return None

    def wait_kernel_idle(self, *, timeout_s: float | None = None) -> None:
        def check() -> tuple[bool, Any]:
            status, server = self.kernel_status(), self.server_kernel_state()
            if "dead" in (status, server):
                raise self.fail(f"the kernel died; server log tail:\n{self.server.log_tail(20)}")
            return status == server == "idle", {"page": status, "server": server}

        self.wait_until(check, "the kernel to be idle", timeout_s)

    def cell_errors(self) -> list[dict[str, Any]]:
        """Error outputs in the notebook: [{cell (1-based among code cells), ename, evalue, traceback, source}]."""
        return self.page.evaluate(_ERRORS_JS, self.notebook_path) or []

    def raise_cell_error(self, prefix: str = "") -> None:
        """Fail with the first error output's cell and traceback, if the notebook has one."""
        errors = self.cell_errors()
        if errors:
            e = errors[0]
            raise self.fail(
                f"{prefix}code cell {e['cell']} ({e['source']!r}) raised {e['ename']}: {e['evalue']}\n"
                f"{_ANSI.sub('', e['traceback'])[-3000:]}",
                step="cell error",
            )

    def run_all_cells(self, *, timeout_s: float = 120.0) -> None:
        """Menu Run > Run All Cells, then wait until every code cell has an execution count.

        Fails as soon as a cell has an error output (JupyterLab then skips the rest), with its traceback."""
        self.wait_kernel_idle()
        self.page.locator("#jp-MainMenu .lm-MenuBar-item").filter(has_text=_exact("Run")).click()
        # Match the label, not data-command: the Run menu routes it through "runmenu:run-all".
        label = self.page.locator(".lm-Menu-itemLabel").filter(has_text=_exact("Run All Cells"))
        self.page.locator(".lm-Menu li.lm-Menu-item:not(.lm-mod-disabled)").filter(has=label).click()
        panel = self.notebook.element_handle()
        idle_since: list[float] = []

        def check() -> tuple[bool, Any]:
            self.raise_cell_error("Run All: ")
            state = panel.evaluate(_PROMPTS_JS)
            prompts, kernel = state["prompts"], state["kernel"]
            numbered = [bool(re.fullmatch(r"\[\d+\]:", p)) for p in prompts]
            if all(numbered) and kernel == "idle":
                return True, state
            # Stopped without an error output (interrupted, kernel restarted): idle, nothing queued.
            if any(numbered) and kernel == "idle" and not any(p.startswith("[*]") for p in prompts):
                idle_since.append(time.monotonic())
                if idle_since[-1] - idle_since[0] > 3.0:
                    raise self.fail(
                        f"Run All stopped before the end; prompts {prompts}", step="run all stopped"
                    )
            else:
                idle_since.clear()
            return False, state

        self.wait_until(check, "Run All Cells to finish", timeout_s)

    def run_cells_above(self, marker: str, *, timeout_s: float = 120.0) -> int:
        """Run every cell above the first cell whose source contains `marker` (JupyterLab's "Run All
        Above Selected Cell"), wait until they ran; the number of code cells run. A notebook can so
        hold a part for the buttons and a part that does the same from code."""
        self.wait_kernel_idle()
        count = self.page.evaluate(_RUN_ABOVE_JS, [self.notebook_path, marker])
        if count is None:
            raise self.fail(f"no cell contains {marker!r} (or the notebook model is not reachable)")
        panel = self.notebook.element_handle()

        def check() -> tuple[bool, Any]:
            self.raise_cell_error()
            state = panel.evaluate(_PROMPTS_JS)
            done = all(re.fullmatch(r"\[\d+\]:", p) for p in state["prompts"][:count])
            return done and state["kernel"] == "idle", state

        self.wait_until(check, f"the {count} code cells above {marker!r} to run", timeout_s)
        return int(count)

    def wait_for_output(
        self,
        text: str | re.Pattern[str] | None = None,
        *,
        selector: str | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """Wait for a visible cell output containing `text` and/or matching `selector`; return its locator."""
        found = self.notebook.locator(".jp-OutputArea-output")
        if selector:
            found = found.locator(selector)
        found = found.filter(visible=True)
        if text is not None:
            found = found.filter(has_text=text)
        self.wait_until(
            lambda: (found.count() > 0, found.count()), f"an output with {text or selector!r}", timeout_s
        )
        return found.first

    # -- widgets

    def _one(self, locator: Any, what: str, timeout_s: float | None) -> Any:
        self.wait_until(
            lambda: (locator.count() == 1, f"{locator.count()} match(es)"), f"exactly one {what}", timeout_s
        )
        return locator

    def button(self, label: str, *, timeout_s: float | None = None) -> Any:
        """The visible ipywidgets Button whose label is exactly `label`."""
        found = (
            self.notebook.locator("button.jupyter-button, button.widget-button")
            .filter(visible=True)
            .filter(has_text=_exact(label))
        )
        return self._one(found, f"button labelled {label!r}", timeout_s)

    def click_button(self, label: str, *, timeout_s: float | None = None) -> None:
        button = self.button(label, timeout_s=timeout_s)
        self.wait_until(
            lambda: (button.is_enabled(), "disabled"), f"button {label!r} to be enabled", timeout_s
        )
        button.click()

    def int_text(self, description: str, *, timeout_s: float | None = None) -> Any:
        """The <input> of the visible IntText/FloatText/Text whose description label is exactly `description`."""
        label = self.page.locator("label.widget-label").filter(has_text=_exact(description))
        found = (
            self.notebook.locator(".widget-inline-hbox")
            .filter(has=label)
            .filter(visible=True)
            .locator("input")
        )
        return self._one(found, f"text input described {description!r}", timeout_s)

    def set_int_text(self, description: str, value: int, *, timeout_s: float | None = None) -> None:
        """Type `value` into the IntText and commit it (IntText syncs on change, i.e. Enter or blur)."""
        box = self.int_text(description, timeout_s=timeout_s)
        box.fill(str(value))
        box.press("Enter")
        box.evaluate("e => e.blur()")
        self.wait_until(
            lambda: (box.input_value() == str(value), box.input_value()),
            f"{description} = {value}",
            timeout_s,
        )

    def class_text(self, css_class: str) -> str:
        """Text of the visible element carrying `css_class` (e.g. the `varuna-state` HTML widget)."""
        found = self.notebook.locator(f".{css_class}").filter(visible=True)
        return " ".join((found.first.text_content(timeout=2000) or "").split()) if found.count() else ""

    def wait_for_class_text(
        self, css_class: str, expected: str | re.Pattern[str], *, timeout_s: float | None = None
    ) -> str:
        """Wait until `class_text(css_class)` equals `expected` (a string) or matches it (a regex)."""

        def check() -> tuple[bool, str]:
            text = self.class_text(css_class)
            ok = expected.search(text) is not None if isinstance(expected, re.Pattern) else text == expected
            return ok, text

        return self.wait_until(check, f".{css_class} text {expected!r}", timeout_s)

    # -- plotly

    def plot(self, css_class: str) -> Any:
        """The Plotly graph div of the visible PlotView carrying `css_class`."""
        return (
            self.notebook.locator(f".{css_class}.js-plotly-plot, .{css_class} .js-plotly-plot")
            .filter(visible=True)
            .first
        )

    def plotly_texts(self, css_class: str, selector: str = "g.ytick text") -> list[str]:
        """SVG texts of the figure in screen order: y tick labels (the default; `g.y2tick text` for y2) top
        to bottom, anything else left to right. Plotly's DOM order is tick-value order, which a reversed
        axis turns upside down. Read with textContent: SVG <text> has no layout text for inner_text."""
        plot = self.plot(css_class)
        if not plot.count():
            return []
        key = "top" if re.search(r"\by\d*tick\b", selector) else "left"
        boxes = plot.locator(selector).evaluate_all(
            "(els, key) => els.map(e => [e.getBoundingClientRect()[key], e.textContent.trim()])", key
        )
        return [text for _, text in sorted(boxes, key=lambda b: b[0])]

    def wait_for_plotly_texts(
        self,
        css_class: str,
        predicate: Callable[[list[str]], bool],
        *,
        selector: str = "g.ytick text",
        timeout_s: float | None = None,
    ) -> list[str]:
        """Wait until `predicate(plotly_texts(...))` holds and return the texts."""

        def check() -> tuple[bool, list[str]]:
            texts = self.plotly_texts(css_class, selector)
            return bool(texts) and predicate(texts), texts

        return self.wait_until(check, f"{selector} of .{css_class} to satisfy the check", timeout_s)

    def trace_count(self, css_class: str) -> int:
        """Number of traces in the figure's data (from the graph div, as Plotly.js holds them)."""
        plot = self.plot(css_class)
        return int(plot.evaluate("gd => (gd.data || []).length")) if plot.count() else 0

    # -- files

    def wait_for_file(self, pattern: str, *, timeout_s: float | None = None) -> Path:
        """Wait for a file matching the glob `pattern` (relative to the served folder); return the first."""

        def check() -> tuple[bool, Any]:
            hits = sorted(self.root.glob(pattern))
            return bool(hits), hits[0] if hits else sorted(p.name for p in self.root.iterdir())

        return self.wait_until(check, f"a file {pattern!r} under {self.root}", timeout_s)


def test_failed(request: Any) -> Callable[[], bool]:
    """For a fixture's teardown: has the test (of this `request`) failed? pytest counts the call phase's
    failure in `session.testsfailed` before it tears fixtures down."""
    before = request.session.testsfailed
    return lambda: request.session.testsfailed > before


test_failed.__test__ = False  # type: ignore[attr-defined]  # not a test, despite the name


@contextlib.contextmanager
def lab_session(
    notebook_dir: Path,
    notebook: str,
    name: str,
    *,
    timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
    settings: dict[str, dict[str, Any]] | None = None,
    failed: Callable[[], bool] | None = None,
) -> Iterator[LabPage]:
    """Server + browser + the notebook opened with an idle kernel; artifacts in test-artifacts/browser/<name>/.

    On exit saves `99-final.png` (or `99-failed.png` when the block raised or `failed()` says so), the
    browser console and the server log, then stops the browser and the server. In a pytest fixture the
    test's exception never reaches the `with`: pass `failed=browser.test_failed(request)`."""
    artifacts = ARTIFACTS / _slug(name)
    shutil.rmtree(artifacts, ignore_errors=True)
    artifacts.mkdir(parents=True)
    with (
        jupyter_lab(notebook_dir, log_path=artifacts / "jupyter.log", env=env, settings=settings) as server,
        chromium() as context,
    ):
        lab = LabPage(
            context.pages[0] if context.pages else context.new_page(), server, artifacts, timeout_s=timeout_s
        )
        outcome = "failed"
        try:
            lab.open_notebook(notebook)
            yield lab
            outcome = "final"
        finally:
            if failed is not None and failed():
                outcome = "failed"
            with contextlib.suppress(Exception):
                lab.page.screenshot(path=str(artifacts / f"99-{outcome}.png"))
            (artifacts / "console.log").write_text("\n".join(lab.console) + "\n")
