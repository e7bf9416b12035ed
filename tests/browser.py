"""Real-browser test helpers: a throw-away JupyterLab (or Notebook 7) server and headless Chromium driven by
Playwright.

Use from a test module:

    from browser import browser_page, jupyter_lab  # noqa: F401  (pytest fixtures)
    from browser import open_notebook, run_all, screenshot, wait_for_output, write_notebook

or, for Jupyter Notebook 7 (the `notebook` package, built from JupyterLab's components):

    from browser import browser_page, jupyter_notebook7  # noqa: F401  (pytest fixtures)
    from browser import open_notebook7, run_all_notebook7, screenshot, wait_for_output, write_notebook

Chromium is Debian's package (`make browser` installs it); Playwright only drives it and never downloads a
browser of its own. A test that needs the browser FAILS, with a hint, when Chromium is missing: a skip
would let CI pass without having looked at the page.

Timeouts taken by these helpers are in seconds.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Optional, Union

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",  # we run as root in CI
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT = {"width": 1400, "height": 1000}
ARTIFACTS = Path(__file__).resolve().parent / ".artifacts"

# Settings written to the server's JUPYTERLAB_SETTINGS_DIR, as <plugin id> -> values.
LAB_SETTINGS = {
    # No "would you like to receive news?" toast over the notebook, no update check.
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
    # Render every cell, not only those scrolled into view, so outputs below the fold are in the DOM.
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
}

OUTPUT = ".jp-OutputArea-output"
SERVER_START_TIMEOUT = 60.0
SERVER_STOP_TIMEOUT = 10.0

# The front ends start_server() knows: app -> (the Python module run with -m, its name in messages).
APPS = {
    "lab": ("jupyterlab", "jupyter lab"),
    "notebook": ("notebook", "jupyter notebook"),
}


# --------------------------------------------------------------------------------------------- server


class JupyterServer:
    """A running Jupyter server with the JupyterLab or the Notebook 7 front end (what the `jupyter_lab`
    and `jupyter_notebook7` fixtures yield); `.app` is "lab" or "notebook"."""

    def __init__(
        self, proc: subprocess.Popen, port: int, token: str, root: Path, log_path: Path, app: str = "lab"
    ):
        self.proc = proc
        self.port = port
        self.token = token
        self.root = root
        self.log_path = log_path
        self.app = app
        self.url = f"http://127.0.0.1:{port}"
        self.started_in: Optional[float] = None  # seconds from spawn to /api/status answering

    @property
    def title(self) -> str:
        return APPS[self.app][1]

    def api(self, path: str, timeout: float = 5.0):
        """GET /api/<path> with the token; returns the decoded JSON."""
        req = urllib.request.Request(
            f"{self.url}/api/{path}", headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode())

    def notebook_url(self, name: str) -> str:
        if self.app == "notebook":
            # Notebook 7 shows one document per page and keeps no workspace to restore.
            return f"{self.url}/notebooks/{name}?token={self.token}"
        # ?reset: start from an empty workspace, not one restored from an earlier page load.
        return f"{self.url}/lab/tree/{name}?reset&token={self.token}"

    def open(self, page, name: str, timeout: float = 60.0) -> None:
        """Open notebook `name` (relative to `.root`) and wait for its cells and an idle kernel."""
        if self.app == "notebook":
            open_notebook7(page, self, name, timeout=timeout)
        else:
            open_notebook(page, self, name, timeout=timeout)

    def run_all(self, page, timeout: float = 30.0) -> None:
        """Run > Run All Cells in this server's front end."""
        if self.app == "notebook":
            run_all_notebook7(page, timeout=timeout)
        else:
            run_all(page, timeout=timeout)

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no server log: {exc})"
        return "\n".join(text.splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_lab_settings(settings_dir: Path) -> None:
    for plugin_id, values in LAB_SETTINGS.items():
        package, plugin = plugin_id.split(":")
        path = settings_dir / package / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values, indent=2))


def _server_env(base: Path) -> dict:
    """The server's (and so its kernels') environment: every per-user Jupyter/IPython dir in `base`.

    JUPYTER_DATA_DIR only replaces the *user* data dir: the venv's share/jupyter (the python3 kernelspec
    from ipykernel, the prebuilt @jupyter-widgets labextension) stays on the search path, because the
    server runs from this interpreter. JUPYTER_PATH, which would come before it, is dropped, and then
    names only this checkout's extension build, when there is one.
    """
    env = dict(os.environ)
    env.pop("JUPYTER_PATH", None)
    env.pop("JUPYTER_PREFER_ENV_PATH", None)
    dirs = {
        "JUPYTER_CONFIG_DIR": base / "config",
        "JUPYTER_DATA_DIR": base / "data",
        "JUPYTER_RUNTIME_DIR": base / "runtime",
        "JUPYTERLAB_SETTINGS_DIR": base / "lab-settings",
        "JUPYTERLAB_WORKSPACES_DIR": base / "lab-workspaces",
        "IPYTHONDIR": base / "ipython",  # no developer's IPython profile or startup files in the kernel
    }
    for name, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        env[name] = str(path)
    _write_lab_settings(dirs["JUPYTERLAB_SETTINGS_DIR"])
    if _link_this_checkouts_extension(base / "checkout"):
        env["JUPYTER_PATH"] = str(base / "checkout")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _link_this_checkouts_extension(folder: Path) -> bool:
    """Link the extension built in this checkout under `folder`, for JUPYTER_PATH, which JupyterLab
    searches first (a venv shared by several checkouts links only one of their builds); False when
    this checkout has no build."""
    built = Path(__file__).resolve().parent.parent / "notebook_accel" / "labextension"
    if not (built / "package.json").exists():
        return False
    target = folder / "labextensions" / "notebook-accel-labextension"
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        target.symlink_to(built)
    return True


def _wait_for_status(lab: JupyterServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if lab.proc.poll() is not None:
            raise RuntimeError(
                f"{lab.title} exited with code {lab.proc.returncode} before answering; "
                f"log {lab.log_path}:\n{lab.log_tail()}"
            )
        try:
            lab.api("status", timeout=2.0)
            return
        except (urllib.error.URLError, ConnectionError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{lab.title} did not answer /api/status within {timeout:.0f}s; log {lab.log_path}:\n{lab.log_tail()}"
            )
        time.sleep(0.2)


def _require_app(app: str) -> None:
    """Fail (never skip) when the front end's package is missing or, for "notebook", older than 7."""
    if app not in APPS:
        raise ValueError(f"app must be one of {sorted(APPS)}, not {app!r}")
    module = APPS[app][0]
    try:
        mod = __import__(module)
    except ImportError:
        pytest.fail(
            f"{module} is not installed in this interpreter: run `make test` (it installs the dev set)",
            pytrace=False,
        )
    if app == "notebook":
        major = str(getattr(mod, "__version__", "0")).split(".")[0]
        if not (major.isdigit() and int(major) >= 7):
            pytest.fail(
                f"notebook {getattr(mod, '__version__', '?')} is installed; these tests need Notebook 7 "
                "(run `make test`, it installs the dev set)",
                pytrace=False,
            )


def start_server(base: Path, app: str = "lab") -> JupyterServer:
    """Start a Jupyter server whose state and notebooks live under `base`; returns once it answers.

    `app` picks the front end: "lab" (JupyterLab, pages under /lab) or "notebook" (Notebook 7, pages
    under /tree and /notebooks). Both run on 127.0.0.1 with a random token and open no browser.
    """
    _require_app(app)
    base.mkdir(parents=True, exist_ok=True)
    root = base / "notebooks"
    root.mkdir(exist_ok=True)
    env = _server_env(base)
    port = _free_port()
    token = secrets.token_hex(16)
    log_path = base / f"jupyter-{app}.log"
    cmd = [
        sys.executable, "-m", APPS[app][0],
        "--no-browser", "--allow-root",
        "--ip", "127.0.0.1", "--port", str(port), "--ServerApp.port_retries=0",
        f"--ServerApp.token={token}",
        f"--ServerApp.root_dir={root}",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl+C in the terminal reaches pytest, which then stops us in order
        )  # fmt: skip
    lab = JupyterServer(proc, port, token, root, log_path, app=app)
    t0 = time.monotonic()
    try:
        _wait_for_status(lab, SERVER_START_TIMEOUT)
    except BaseException:
        stop_server(lab)
        raise
    lab.started_in = time.monotonic() - t0
    return lab


def start_jupyter_lab(base: Path) -> JupyterServer:
    """Start a JupyterLab server whose state and notebooks live under `base`; returns once it answers."""
    return start_server(base, app="lab")


def stop_server(lab: JupyterServer) -> None:
    """SIGTERM the server (it shuts its kernels down), then SIGKILL whatever of it and its kernels is left.

    Kernels run in sessions of their own, so they are found as the server's descendants before it stops.
    """
    import psutil  # a dependency of ipykernel, so present wherever the kernel is

    try:
        server = psutil.Process(lab.proc.pid)
        family = [server, *server.children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    if lab.proc.poll() is None:
        lab.proc.send_signal(signal.SIGTERM)
        try:
            lab.proc.wait(timeout=SERVER_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            lab.proc.kill()
            lab.proc.wait(timeout=SERVER_STOP_TIMEOUT)
    # The server waits for its kernels on a clean stop; anything still alive here is a leftover.
    _, alive = psutil.wait_procs(family, timeout=2.0)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5.0)


# The names these had when JupyterLab was the only front end.
JupyterLab = JupyterServer
stop_jupyter_lab = stop_server


def _failures(request) -> int:
    return request.session.testsfailed


def _report(request, text: str) -> None:
    """Write straight to the terminal: output captured in a fixture's teardown would not be shown."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("")
        for line in text.splitlines():
            reporter.write_line(line)
    else:
        sys.stderr.write(text + "\n")


def _server_fixture(request, tmp_path_factory, app: str) -> Iterator[JupyterServer]:
    require_chromium()  # a server with no browser to look at it is of no use: fail before starting it
    lab = start_server(tmp_path_factory.mktemp(f"jupyter-{app}"), app=app)
    failed_before = _failures(request)
    try:
        yield lab
    finally:
        stop_server(lab)
        if _failures(request) > failed_before:
            _report(
                request, f"---- {lab.title} server log ({lab.log_path}), last lines ----\n{lab.log_tail()}"
            )


@pytest.fixture(scope="module")
def jupyter_lab(request, tmp_path_factory) -> Iterator[JupyterServer]:
    """A JupyterLab server for this module: yields a `JupyterLab` (`.url`, `.token`, `.root`, `.open`)."""
    yield from _server_fixture(request, tmp_path_factory, "lab")


@pytest.fixture(scope="module")
def jupyter_notebook7(request, tmp_path_factory) -> Iterator[JupyterServer]:
    """A Jupyter Notebook 7 server for this module: yields a `JupyterServer` with `.app == "notebook"`
    (`.url`, `.token`, `.root`, `.open`, `.run_all`)."""
    yield from _server_fixture(request, tmp_path_factory, "notebook")


# -------------------------------------------------------------------------------------------- browser


def require_chromium() -> None:
    """Fail (never skip) when the browser or its driver is missing, saying what to run."""
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(
            f"{CHROMIUM} is missing: run `make browser` (installs Debian's chromium; needs root)",
            pytrace=False,
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.fail(
            "the playwright package is missing: run `make test` (it installs the dev set)", pytrace=False
        )


def _test_dir_name(nodeid: str) -> str:
    name = nodeid.split("::", 1)[-1] if "::" in nodeid else nodeid
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name.replace("::", ".")).strip("_") or "test"


def _current_test() -> Optional[str]:
    current = os.environ.get("PYTEST_CURRENT_TEST")  # "path::name (call)"
    return _test_dir_name(current.rsplit(" ", 1)[0]) if current else None


@pytest.fixture
def browser_page(request) -> Iterator:
    """A Playwright `Page` in a fresh headless Chromium (viewport 1400x1000); the browser is closed after.

    `page.console_errors` collects the page's console errors and uncaught exceptions; `page.started_in`
    is how many seconds the browser took to start. On a failing test
    a `failure.png` screenshot is saved with the test's artifacts and the errors are printed.
    """
    require_chromium()
    from playwright.sync_api import sync_playwright

    artifacts = ARTIFACTS / _test_dir_name(request.node.nodeid)
    shutil.rmtree(artifacts, ignore_errors=True)  # only this run's pictures are left to look at
    failed_before = _failures(request)

    t0 = time.monotonic()
    pw = sync_playwright().start()
    try:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport=VIEWPORT)
            page = context.new_page()
            page.started_in = time.monotonic() - t0  # seconds to a blank page, driver start included
            page.console_errors = []
            page.on(
                "console", lambda m: m.type == "error" and page.console_errors.append(f"console: {m.text}")
            )
            page.on("pageerror", lambda e: page.console_errors.append(f"pageerror: {e}"))
            yield page
            if _failures(request) > failed_before:
                lines = [f"---- browser at failure: {page.url}"]
                try:
                    shot = artifacts / "failure.png"
                    shot.parent.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(shot))
                    lines.append(f"screenshot: {shot}")
                except Exception as exc:  # the page may be gone; the report is still useful
                    lines.append(f"(no screenshot: {exc})")
                lines += page.console_errors[-30:]
                _report(request, "\n".join(lines))
        finally:
            browser.close()
    finally:
        pw.stop()


# -------------------------------------------------------------------------------------------- helpers


def write_notebook(root: Union[str, Path], name: str, cells: list[str]) -> Path:
    """Write an nbformat v4 notebook of code cells, with the python3 kernelspec, to `root / name`."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    path = Path(root) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


# The shown notebook has its cells, a kernel (its toolbar names one) and that kernel is idle. The
# execution indicator alone is not enough: it reads "idle" while the toolbar still says "No Kernel",
# and a Run All then opens the "Select Kernel" dialog instead of running.
_NOTEBOOK_READY = """() => {
  const panel = Array.from(document.querySelectorAll('.jp-NotebookPanel'))
    .find(p => !p.classList.contains('lm-mod-hidden') && p.querySelector('.jp-Cell'));
  if (!panel) return false;
  const name = panel.querySelector('.jp-Toolbar-kernelName');
  const status = panel.querySelector('.jp-Notebook-ExecutionIndicator');
  const kernel = name ? name.textContent.trim() : '';
  return kernel !== '' && kernel !== 'No Kernel' && !!status && status.getAttribute('data-status') === 'idle';
}"""


def open_notebook(page, lab: JupyterServer, name: str, timeout: float = 60.0) -> None:
    """Load `name` in JupyterLab and wait until its cells are shown and its kernel is started and idle."""
    ms = timeout * 1000
    page.goto(lab.notebook_url(name), wait_until="domcontentloaded", timeout=ms)
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(state="visible", timeout=ms)
    try:
        page.wait_for_function(_NOTEBOOK_READY, timeout=ms, polling=100)
    except Exception as exc:
        toolbar = page.locator(".jp-NotebookPanel-toolbar .jp-Toolbar-kernelName").all_inner_texts()
        raise AssertionError(
            f"{name}: no idle kernel within {timeout:.0f}s (toolbar kernel: {toolbar}); "
            f"server log: {lab.log_path}"
        ) from exc


def run_all(page, timeout: float = 30.0) -> None:
    """Run > Run All Cells, through the menu bar as a person would."""
    ms = timeout * 1000
    page.locator("li.lm-MenuBar-item", has_text=re.compile(r"^Run$")).click(timeout=ms)
    page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click(timeout=ms)


# Notebook 7 (measured with notebook 7.6 on JupyterLab 4.6 components): one document per page, whose
# <body> has data-notebook="notebooks"; the top bar (#top-panel: logo, #jp-title) and the menu bar
# (#menu-panel: #jp-MainMenu, then the kernel status text and the "Not Trusted" button) sit above
# #main-panel, which holds the .jp-NotebookPanel. Its toolbar names the kernel like Lab's does
# (.jp-Toolbar-kernelName, "No Kernel" until a session exists) and has the same execution indicator
# (.jp-Notebook-ExecutionIndicator[data-status]), plus Notebook 7's .jp-NotebookKernelLogo. The menu
# bar's .jp-NotebookKernelStatus reads "Kernel Initializing" / "Kernel Connecting" (class
# jp-NotebookKernelStatus-info), "Kernel Unknown" (-warn) or "Kernel Dead" (-error) and turns empty
# (only -fade) once the kernel is idle or busy.
NB7_PAGE = 'body[data-notebook="notebooks"]'
NB7_MENU_BAR = "#menu-panel #jp-MainMenu"
NB7_PANEL = "#main-panel .jp-NotebookPanel"
NB7_KERNEL_STATUS = "#menu-panel .jp-NotebookKernelStatus"

_NOTEBOOK7_READY = """() => {
  if (document.body.dataset.notebook !== 'notebooks') return false;
  const panel = document.querySelector('#main-panel .jp-NotebookPanel');
  if (!panel || !panel.querySelector('.jp-Cell')) return false;
  const name = panel.querySelector('.jp-NotebookPanel-toolbar .jp-Toolbar-kernelName');
  const kernel = name ? name.textContent.trim() : '';
  const indicator = panel.querySelector('.jp-Notebook-ExecutionIndicator');
  const status = document.querySelector('#menu-panel .jp-NotebookKernelStatus');
  const starting = !status || ['info', 'warn', 'error'].some(
    k => status.classList.contains('jp-NotebookKernelStatus-' + k)) || status.textContent.trim() !== '';
  return kernel !== '' && kernel !== 'No Kernel' && !starting
    && !!indicator && indicator.getAttribute('data-status') === 'idle';
}"""


def open_notebook7(page, server: JupyterServer, name: str, timeout: float = 60.0) -> None:
    """Load `name` in Notebook 7 (/notebooks/<name>) and wait until its cells are shown and its kernel
    is started and idle."""
    if server.app != "notebook":
        raise ValueError(f"open_notebook7 needs a Notebook 7 server (jupyter_notebook7), not {server.app!r}")
    ms = timeout * 1000
    page.goto(server.notebook_url(name), wait_until="domcontentloaded", timeout=ms)
    page.locator(NB7_PAGE).wait_for(state="attached", timeout=ms)
    page.locator(f"{NB7_PANEL} .jp-Cell").first.wait_for(state="visible", timeout=ms)
    try:
        page.wait_for_function(_NOTEBOOK7_READY, timeout=ms, polling=100)
    except Exception as exc:
        toolbar = page.locator(f"{NB7_PANEL} .jp-Toolbar-kernelName").all_inner_texts()
        status = page.locator(NB7_KERNEL_STATUS).all_inner_texts()
        raise AssertionError(
            f"{name}: no idle kernel within {timeout:.0f}s in Notebook 7 (toolbar kernel: {toolbar}, "
            f"kernel status: {status}); server log: {server.log_path}"
        ) from exc


def run_all_notebook7(page, timeout: float = 30.0) -> None:
    """Notebook 7's Run > Run All Cells, through its menu bar as a person would."""
    ms = timeout * 1000
    page.locator(f"{NB7_MENU_BAR} li.lm-MenuBar-item", has_text=re.compile(r"^Run$")).click(timeout=ms)
    page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click(timeout=ms)


def wait_for_output(page, selector_or_text: Union[str, "re.Pattern[str]"], timeout: float = 60.0):
    """Wait for something to show in a cell's output area; returns its Locator (the first match).

    A string starting with ".", "#" or "[" is a CSS selector, searched inside the output areas; any
    other string (or a compiled regex) is text the output areas must show. Text is never matched in a
    cell's source, which would make the wait succeed before the cell ran.
    """
    if isinstance(selector_or_text, str) and selector_or_text[:1] in (".", "#", "["):
        target = page.locator(f"{OUTPUT} {selector_or_text}")
    else:
        target = page.locator(OUTPUT).filter(has_text=selector_or_text)
    try:
        target.first.wait_for(state="visible", timeout=timeout * 1000)
    except Exception as exc:
        shown = page.locator(OUTPUT).all_inner_texts()
        raise AssertionError(
            f"no output matching {selector_or_text!r} within {timeout:.0f}s; the output areas show:\n"
            + "\n---\n".join(shown or ["(none)"])
        ) from exc
    return target.first


def screenshot(page, path: Union[str, Path]) -> Path:
    """Save a screenshot to `path` (e.g. under `tmp_path`) and a copy to tests/.artifacts/<test>/.

    Returns the copy a person can look at after the run (or `path` itself outside a test).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))
    test = _current_test()
    if test is None:
        return path
    copy = ARTIFACTS / test / path.name
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, copy)
    return copy
