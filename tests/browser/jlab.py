"""Drive the notebooks the way a learner does: JupyterLab in headless Chromium.

Used by the browser tests (``tests/browser``) and by
``scripts/measure_slider_latency.py``. Everything runs on a throw-away copy of
``notebooks/`` with throw-away Jupyter/IPython/Matplotlib folders, so the real
notebooks and the user's settings are never touched.

Requirements: Debian's ``chromium`` at :data:`CHROMIUM` and the Python package
``playwright`` (its own browser download is never used).
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
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
ARTIFACTS = ROOT / "artifacts"
SCREENSHOTS = ARTIFACTS / "screenshots"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
VIEWPORT = {"width": 1280, "height": 1000}

#: {notebook name: the notebook as JupyterLab saved it after a Run All that passed every check}, filled
#: in this process by :func:`run_all_and_check` and the stepper tests: the HTML build test converts
#: these instead of running them a second time (conftest.py keeps both in one worker)
EXECUTED: dict[str, dict] = {}


def notebook_names() -> list[str]:
    """The series' notebooks (file names), in order."""
    return sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


#: The notebook whose tile stepper test_stepper_in_lab.py drives in depth.
STEPPER_NOTEBOOK = next((n for n in notebook_names() if n.startswith("02_")), None)
#: The notebook test_lab_as_learner.py runs in the lab `make lab` starts (the first one).
LEARNER_NOTEBOOK = next(iter(notebook_names()), None)

# Folders copied next to notebooks/ so relative paths in the lessons keep working.
_COPIED = ("notebooks", "exercises", "solutions")

# JupyterLab user settings for the throw-away server: no news/update pop-ups
# covering the notebook (the machine may be offline).
_LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
}


def missing_requirements() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if not CHROMIUM.exists():
        return (f"{CHROMIUM} not found; install it with "
                "`apt-get install -y --no-install-recommends chromium fonts-dejavu-core`")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package `playwright` is not installed (`pip install -e '.[test]'`)"
    return None


def in_ci() -> bool:
    """True when the environment variable CI is set to anything but an explicit no."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def requirement_outcome() -> tuple[str, str]:
    """("run", "") when the browser tests can run; else ("skip", why), or ("fail", why) under CI."""
    reason = missing_requirements()
    if reason is None:
        return "run", ""
    if in_ci():
        return "fail", f"browser tests cannot run under CI: {reason}"
    return "skip", reason


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    """A JupyterLab server on 127.0.0.1 with a random port and token, over a temporary tree.

    ``root`` is the temporary folder served (holding a copy of ``notebooks/``);
    ``url`` and ``token`` address it. Use :func:`lab_server` to get one that is
    always shut down.
    """

    def __init__(self, workdir: Path, source: Path = ROOT):
        self.workdir = Path(workdir)
        self.source = Path(source)
        self.root = self.workdir / "tree"
        self.token = secrets.token_hex(24)
        self.port = None
        self.proc = None
        self.log_path = self.workdir / "jupyterlab.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict:
        """Environment with every Jupyter/IPython/Matplotlib folder moved into the work dir."""
        env = dict(os.environ)
        for var, sub in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                         ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython"),
                         ("MPLCONFIGDIR", "mpl"), ("JUPYTERLAB_SETTINGS_DIR", "lab-settings"),
                         ("JUPYTERLAB_WORKSPACES_DIR", "lab-workspaces")]:
            path = self.workdir / sub
            path.mkdir(parents=True, exist_ok=True)
            env[var] = str(path)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.pop("JUPYTER_TOKEN", None)
        return env

    #: Where the notebooks sit under the served root (URLs and the contents API).
    nb_prefix = "notebooks/"

    def prepare(self, env: dict) -> None:
        """Fill the served tree: a copy of notebooks/ (and what they read), throw-away lab settings."""
        for name in _COPIED:
            if (self.source / name).is_dir():
                shutil.copytree(self.source / name, self.root / name,
                                ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        for rel, values in _LAB_SETTINGS.items():
            path = Path(env["JUPYTERLAB_SETTINGS_DIR"]) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))

    def command(self) -> list[str]:
        """The command line that starts the server on ``self.port``."""
        return [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
                f"--port={self.port}", "--ServerApp.port_retries=0",
                f"--ServerApp.token={self.token}", f"--ServerApp.root_dir={self.root}",
                "--allow-root"]

    def start(self, timeout: float = 60.0) -> "LabServer":
        env = self.env()
        self.prepare(env)
        last_error = None
        for _ in range(3):                      # a port taken between probe and bind: try another
            self.port = _free_port()
            log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(self.command(), cwd=self.workdir, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    self.api("GET", "/api/status")
                    return self
                except (urllib.error.URLError, ConnectionError, OSError) as exc:
                    last_error = exc
                    time.sleep(0.2)
            self._stop_process()
        raise RuntimeError(f"JupyterLab did not start ({last_error}); log:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def log_mark(self) -> int:
        """Current length of the server log (kernels write their stderr there too)."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_errors(self, since: int = 0) -> list[str]:
        """Tracebacks written to the server log after byte offset SINCE.

        The log holds the server's own errors and the kernels' stderr, e.g. an
        exception in a comm handler that ipywidgets did not catch ("Exception in
        comm_msg ..."). Exceptions in widget callbacks go to the log console
        instead (:func:`log_console_errors`).
        """
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            return []
        found = [m.group(0) for m in re.finditer(r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*.*", text)]
        found = [t for t in found if not _lost_port_race(t)]
        found += [line for line in text.splitlines() if "Exception in comm" in line]
        return found

    def api(self, method: str, path: str, body=None, timeout: float = 10.0):
        """Call the server's REST API with the token; returns the decoded JSON (or None)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def notebook_url(self, name: str) -> str:
        """Open notebooks/NAME with a fresh workspace (no restored tabs)."""
        return f"{self.url}/lab/tree/{self.nb_prefix}{name}?reset&token={self.token}"

    def saved_notebook(self, name: str, tries: int = 20) -> dict:
        """The notebook as JupyterLab last saved it (an nbformat node), read from disk, not through the
        contents API. The server saves a notebook in place (a copy aside, then the file rewritten), and
        a GET that meets a half-written file makes the server "restore" it: it renames the file to
        NAME.invalid, then moves the copy back, which the save may already have deleted; the
        notebook is then gone (404) until the next save. Reading the file ourselves never starts
        that; a half-written file does not parse and is read again, up to TRIES times 0.5 s apart."""
        path = self.root / self.nb_prefix / name
        last_error: Exception | None = None
        for _ in range(tries):
            try:
                return nbformat.reads(path.read_text(encoding="utf-8"), as_version=4)
            except (OSError, ValueError) as err:      # gone for a moment, or caught mid-write
                last_error = err
                time.sleep(0.5)
        raise AssertionError(f"{name} could not be read as saved from {path}: {last_error!r}")

    def shutdown_kernels(self) -> None:
        """DELETE every session, then every kernel left without one."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for session in self.api("GET", "/api/sessions"):
            try:
                self.api("DELETE", f"/api/sessions/{session['id']}", timeout=30)
            except urllib.error.HTTPError:
                pass
        for kernel in self.api("GET", "/api/kernels"):
            try:
                self.api("DELETE", f"/api/kernels/{kernel['id']}", timeout=30)
            except urllib.error.HTTPError:
                pass

    def stop(self) -> None:
        """Shut down every kernel and the server; safe to call twice."""
        if self.proc is None:
            return
        try:
            self.shutdown_kernels()
            if self.proc.poll() is None:
                self.api("POST", "/api/shutdown", timeout=10)
        except Exception:                       # the server may already be gone
            pass
        self._stop_process()

    def _stop_process(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:                                    # anything left in the group this server led
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def make_course_clone(dest: Path, source: Path = ROOT) -> Path:
    """A git repository at DEST holding what `make lab` and the clean-notebook test need, all committed.

    A file of ``notebooks/`` or ``exercises/`` that the source repository has committed is taken as committed
    (``git show HEAD:...``), not as it is in the working tree: a learner who ran and saved a notebook in the
    source checkout must not make the clone start dirty. Files git does not know yet are copied as they are."""
    dest = Path(dest)
    for name in ("notebooks", "exercises"):
        shutil.copytree(source / name, dest / name, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
        try:
            committed = git(source, "ls-files", "--", name).split()
        except (OSError, subprocess.CalledProcessError):
            committed = []                       # (not a git checkout: the working tree is all there is)
        for rel in committed:
            blob = subprocess.run(["git", "-C", str(source), "show", f"HEAD:{rel}"], capture_output=True)
            if blob.returncode == 0:             # (added but not yet committed: as it is)
                (dest / rel).write_bytes(blob.stdout)
    for rel in ("scripts/lab.py", "tests/test_notebooks_clean.py", ".gitignore", "Makefile", "pyproject.toml"):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / rel, dest / rel)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "-c", "user.name=learner", "-c", "user.email=learner@example.org", "commit", "-q", "-m", "course")
    return dest


def git(repo: Path, *args: str) -> str:
    """Run git in REPO; returns its stdout (raises CalledProcessError on failure)."""
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


class MakeLabServer(LabServer):
    """JupyterLab started the way a learner starts it: ``make lab`` in a git clone of the course.

    ``self.repo`` is the clone (under the work dir); the lab serves its
    ``my_notebooks/``, which ``make lab`` creates. The only things added to the
    learner's command are ``LAB_ARGS`` (address, port, token, no browser) and
    ``PY`` (this interpreter, instead of the clone's ``.venv``, whose install
    step ``-o`` skips). No lab settings are written here: any setting the lab
    shows (the news pop-up off) comes from ``make lab`` itself.
    """

    nb_prefix = ""

    def __init__(self, workdir: Path, source: Path = ROOT):
        super().__init__(workdir, source)
        self.repo = self.workdir / "course"
        self.root = self.repo / "my_notebooks"

    def prepare(self, env: dict) -> None:
        make_course_clone(self.repo, self.source)

    def command(self) -> list[str]:
        lab_args = (f"--no-browser --ip=127.0.0.1 --port={self.port} --ServerApp.port_retries=0 "
                    f"--ServerApp.token={self.token}")
        return ["make", "--no-print-directory", "-C", str(self.repo), "lab", "-o", ".venv/.installed-lab",
                f"PY={sys.executable}", f"LAB_ARGS={lab_args}"]


@contextmanager
def lab_server(source: Path = ROOT, kind: type = LabServer):
    """Yield a started KIND (:class:`LabServer`) over a temporary copy of SOURCE's notebooks/; always stopped."""
    with tempfile.TemporaryDirectory(prefix="flash-tiles-lab-") as tmp:
        server = kind(Path(tmp), source)
        try:
            yield server.start()
        finally:
            server.stop()


@contextmanager
def chromium():
    """Yield a headless Debian Chromium driven by Playwright (sync API)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


# --------------------------------------------------------------------------- page helpers

STATUS_IDLE = "Python 3 (ipykernel) | Idle"


def notebook_panel(page):
    """The visible notebook tab."""
    return page.locator(".jp-NotebookPanel:visible")


def open_notebook(page, server: LabServer, name: str, timeout_ms: float = 60_000):
    """Open notebooks/NAME and wait until its kernel has started and is idle."""
    from playwright.sync_api import expect

    page.goto(server.notebook_url(name))
    expect(notebook_panel(page)).to_have_count(1, timeout=timeout_ms)
    expect(page.locator("#jp-main-statusbar")).to_contain_text(STATUS_IDLE, timeout=timeout_ms)
    left_tab = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
    if left_tab.count():                        # fold the file browser away: room for the lesson
        left_tab.first.click()
        expect(left_tab).to_have_count(0)
    return notebook_panel(page)


def click_menu(page, menu: str, item: str) -> None:
    """Click main menu MENU then its entry ITEM (exact labels)."""
    page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text=re.compile(rf"^{re.escape(menu)}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(rf"^{re.escape(item)}$")).click()


_RUN_DONE_JS = """
([statusIdle]) => {
  const panel = [...document.querySelectorAll('.jp-NotebookPanel')].find(p => p.offsetParent !== null);
  if (!panel) return false;
  const prompts = [...panel.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim());
  const status = document.querySelector('#jp-main-statusbar');
  return prompts.some(t => /\\[\\d+\\]/.test(t)) && !prompts.some(t => t.includes('*'))
         && !!status && status.textContent.includes(statusIdle);
}
"""


def run_all(page, timeout_ms: float = 300_000) -> float:
    """Run ▸ Run All Cells, wait until every cell ran and the kernel is idle; returns seconds."""
    t0 = time.perf_counter()
    click_menu(page, "Run", "Run All Cells")
    page.wait_for_function(_RUN_DONE_JS, arg=[STATUS_IDLE], timeout=timeout_ms, polling=100)
    page.wait_for_timeout(300)                  # let the last widget views attach
    page.wait_for_function(_RUN_DONE_JS, arg=[STATUS_IDLE], timeout=timeout_ms, polling=100)
    return time.perf_counter() - t0


def cell_prompts(page) -> list[tuple[str, str]]:
    """(prompt text, source text) of every code cell of the visible notebook."""
    return notebook_panel(page).evaluate("""panel =>
        [...panel.querySelectorAll('.jp-CodeCell')].map(c => [
            (c.querySelector('.jp-InputPrompt') || {textContent: ''}).textContent.trim(),
            (c.querySelector('.cm-content') || {textContent: ''}).textContent.trim()])""")


def _lost_port_race(traceback: str) -> bool:
    """A kernel that died at launch because another process took one of the ports it had been given between the
    server's choice and its bind (``ZMQError: Address already in use`` in ``_bind_socket``): jupyter_client's
    restarter starts it again on fresh ports before anything runs in it, so this is no error of the notebook. Seen
    when other kernels start at the same moment (parallel test workers)."""
    return "_bind_socket" in traceback and "ZMQError: Address already in use" in traceback.rstrip().splitlines()[-1]


_ERROR_TEXT = re.compile(r"Traceback \(most recent call last\)|^\s*\w*(Error|Exception)\b.*$", re.M)


def error_outputs(page) -> list[str]:
    """Texts of the error outputs shown in the visible notebook (cells and Output widgets).

    An output counts as an error when JupyterLab renders it with the error/stderr
    MIME type and its text holds a traceback or an ``...Error:`` line (plain
    warnings on stderr do not count).
    """
    texts = notebook_panel(page).evaluate("""panel =>
        [...panel.querySelectorAll('.jp-OutputArea-output')]
          .filter(o => ['application/vnd.jupyter.stderr', 'application/vnd.jupyter.error']
                         .includes(o.getAttribute('data-mime-type')))
          .map(o => o.textContent)""")
    return [t for t in texts if _ERROR_TEXT.search(t)]


def widget_problems(page, timeout_ms: float = 20_000) -> list[str]:
    """Widget outputs that failed to render ('Error displaying widget'), after loading settles."""
    panel = notebook_panel(page)
    try:
        page.wait_for_function("""() => ![...document.querySelectorAll('.jp-NotebookPanel .jp-OutputArea-output')]
                                   .some(o => o.textContent.includes('Loading widget...'))""", timeout=timeout_ms)
    except Exception:
        pass
    texts = panel.locator(".jp-OutputArea-output").evaluate_all("els => els.map(e => e.textContent)")
    return [t[:200] for t in texts if "Error displaying widget" in t or "Loading widget..." in t]


_IMAGES_SETTLED_JS = """() => {
  const panel = [...document.querySelectorAll('.jp-NotebookPanel')].find(p => p.offsetParent !== null);
  return !!panel && [...panel.querySelectorAll('.jp-RenderedImage img')].every(i => i.complete);
}"""


def broken_images(page, timeout_ms: float = 30_000) -> list[str]:
    """Output images (figures) that did not decode: their alt text or src prefix.

    An image still loading is waited for (up to TIMEOUT_MS) before it is judged: the last figure of a
    Run All arrives just before the kernel goes idle, and on a busy machine the browser may not have
    decoded it yet. An image that failed to decode counts as complete, with no width."""
    try:
        page.wait_for_function(_IMAGES_SETTLED_JS, timeout=timeout_ms, polling=100)
    except Exception:
        pass                                     # what is still loading then is reported below
    return notebook_panel(page).evaluate("""panel =>
        [...panel.querySelectorAll('.jp-RenderedImage img')]
          .filter(i => !(i.complete && i.naturalWidth > 0))
          .map(i => i.alt || i.src.slice(0, 40))""")


def log_console_errors(page) -> list[str]:
    """Errors raised in widget callbacks of the visible notebook.

    They never reach a cell: ipywidgets sends them to JupyterLab's log console,
    whose status-bar item shows a count. When the count is not zero the log
    console is opened and its error entries are returned.
    """
    item = page.locator(".jp-LogConsoleStatusItem")
    if not item.count() or not item.first.is_visible() or not (item.first.text_content() or "").strip():
        return []
    if not page.locator(".jp-LogConsolePanel").count():
        click_menu(page, "View", "Show Log Console")
    panel = page.locator(".jp-LogConsolePanel")
    panel.first.wait_for(state="visible", timeout=10_000)
    page.wait_for_timeout(500)
    texts = panel.first.locator(".jp-OutputArea-output").evaluate_all("els => els.map(e => e.textContent)")
    return [t.strip()[-3000:] for t in texts if _ERROR_TEXT.search(t)]


def saved_errors(nb: dict) -> list[str]:
    """'ename: evalue' of every error output stored in a saved notebook."""
    return [f"{o.get('ename')}: {o.get('evalue')}" for c in nb["cells"] if c["cell_type"] == "code"
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


def _is_save(request) -> bool:
    """True for the contents API's PUT, with which JupyterLab writes a file."""
    return request.method == "PUT" and "/api/contents/" in request.url


def save(page, timeout_ms: float = 60_000) -> None:
    """File ▸ Save Notebook (Ctrl+S); returns once the server has written the file, and the tab shows no
    unsaved changes.

    The tab's dirty mark alone does not say the save is done: a notebook with no unsaved changes (an
    autosave came after the last output) shows none before Ctrl+S, yet Ctrl+S still saves it, rewriting
    the file in place. So this waits for the server's answer to the first PUT sent after the key press;
    the server answers once the whole file is written."""
    notebook_panel(page).locator(".jp-Notebook").click(position={"x": 5, "y": 5})
    with page.expect_request(_is_save, timeout=timeout_ms) as put:
        page.keyboard.press("Control+s")
    response = put.value.response()
    if response is None or not response.ok:
        status = "no answer" if response is None else f"{response.status} {response.status_text}"
        raise AssertionError(f"saving the notebook failed: {status} for PUT {put.value.url.split('?')[0]}")
    page.wait_for_function("""() => !document.querySelector('.jp-mod-current.jp-mod-dirty')""",
                           timeout=timeout_ms)


def screenshot_notebook(page, name: str, max_height: int = 16_000) -> Path:
    """Save the whole visible notebook, top to bottom, as one PNG (up to MAX_HEIGHT px).

    The window is grown to the notebook's height; cells off screen are only laid
    out once visible, so the height is measured again until it settles.
    """
    panel = notebook_panel(page)
    inner = panel.locator(".jp-WindowedPanel-inner").first
    outer = panel.locator(".jp-WindowedPanel-outer").first
    old = page.viewport_size
    try:
        height = 0
        for _ in range(6):
            new = int(min(max_height, inner.evaluate("e => e.offsetHeight") + 200))
            if new == height:
                break
            height = new
            page.set_viewport_size({"width": old["width"], "height": height})
            outer.evaluate("e => { e.scrollTop = 0; }")
            page.wait_for_timeout(500)          # off-screen cells paint once they are in view
        return screenshot(panel, name)
    finally:
        page.set_viewport_size(old)


def screenshot(page_or_locator, name: str) -> Path:
    """Save a PNG under artifacts/screenshots/NAME.png and return its path."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page_or_locator.screenshot(path=str(path))
    return path


# --------------------------------------------------------------------------- the tile stepper

#: Label of the stepper's step slider, and of its tile-size slider (lessons.views.stepper.TileStepper).
STEP_LABEL = "tiles absorbed"
TILE_SIZE_LABEL = "keys per tile"
#: How each readout of the stepper starts (its text) -> the readout's name in TileStepper.readouts.
READOUT_PATTERNS = {
    "tile": r"^tile \S+ of \S+$",
    "m": r"^m \(running max\) = ",
    "alpha": r"^α = ",
    "l": r"^l \(running sum\) = ",
    "max_error": r"^max \|o/l − exact\| = ",
}


def stepper_cells(page):
    """Code cells of the visible notebook whose output holds a tile stepper."""
    return notebook_panel(page).locator(".jp-CodeCell").filter(
        has=page.locator(".widget-slider", has_text=STEP_LABEL))


class StepperView:
    """One TileStepper as the browser shows it; readouts are tagged ``data-readout="ID:name"``."""

    def __init__(self, page, cell, ident: str = "s0", server: LabServer | None = None):
        self.page, self.cell, self.id, self.server = page, cell, ident, server
        self.step_slider = self.slider(STEP_LABEL)
        self.handle = self.step_slider.locator(".noUi-handle")
        self.image = cell.locator(".widget-image").first
        texts = cell.locator(".widget-html").evaluate_all("els => els.map(e => e.textContent.trim())")
        found = {}
        for name, pattern in READOUT_PATTERNS.items():
            hits = [i for i, t in enumerate(texts) if re.search(pattern, t)]
            if len(hits) != 1:
                raise AssertionError(f"readout {name!r} ({pattern}) found {len(hits)} times among {texts}")
            found[name] = hits[0]
        for name, i in found.items():
            cell.locator(".widget-html").nth(i).evaluate("(e, a) => e.setAttribute('data-readout', a)",
                                                        f"{ident}:{name}")

    def slider(self, label: str):
        return self.cell.locator(".widget-slider").filter(
            has=self.page.locator(".widget-label", has_text=re.compile(rf"^{re.escape(label)}$")))

    def slider_value(self, label: str = STEP_LABEL) -> int:
        return int(float(self.slider(label).locator(".noUi-handle").get_attribute("aria-valuenow")))

    def slider_max(self, label: str = STEP_LABEL) -> int:
        return int(float(self.slider(label).locator(".noUi-handle").get_attribute("aria-valuemax")))

    def wait_idle(self, timeout_ms: float = 60_000) -> None:
        """Wait until the kernel finished every callback the page has seen start."""
        wait_kernel_idle(self.page, self.server, timeout_ms)

    def wait_new_picture(self, old_src: str, timeout_ms: float = 30_000) -> None:
        """Wait until the step picture's src differs from OLD_SRC (the kernel sent a new PNG)."""
        try:
            self.image.wait_for(state="attached", timeout=timeout_ms)
            self.page.wait_for_function("([img, old]) => img.src && img.src !== old",
                                        arg=[self.image.element_handle(), old_src], timeout=timeout_ms)
        except Exception as exc:
            raise AssertionError("the step picture was not redrawn") from exc

    def readout(self, name: str):
        return self.cell.locator(f'[data-readout="{self.id}:{name}"]')

    def readout_texts(self) -> dict:
        return {name: self.readout(name).text_content().strip() for name in READOUT_PATTERNS}

    def data_kind_label(self) -> str:
        return self.cell.locator(".widget-toggle-buttons .mod-active").text_content().strip()

    def image_src(self) -> str:
        return self.image.get_attribute("src") if self.image.count() else ""

    def wait_for(self, expected: dict, timeout_ms: float = 30_000) -> None:
        """Wait until every readout NAME ends with expected[NAME]; raise with what was shown."""
        try:
            self.page.wait_for_function(_READOUTS_MATCH_JS, arg=[self.id, expected], timeout=timeout_ms,
                                        polling="raf")
        except Exception as exc:
            raise AssertionError(f"readouts never showed {expected}; they show {self.readout_texts()}") from exc

    def timed_press(self, key: str, expected: dict, timeout_ms: float = 30_000) -> dict:
        """Press KEY on the step handle; milliseconds from the keydown to readouts == EXPECTED and to a new image.

        Timestamps are taken inside the page (performance.now()): the key event, the
        first DOM mutation after which every readout matches, and the first change of
        the step picture's ``src``. Returns {"readouts_ms", "image_ms"}.
        """
        self.cell.evaluate(_LATENCY_PROBE_JS, [self.id, expected])
        self.handle.press(key)
        try:
            self.page.wait_for_function("() => window.__stepProbe.readouts !== null && "
                                        "(window.__stepProbe.image !== null || !window.__stepProbe.hasImage)",
                                        timeout=timeout_ms, polling=50)
        except Exception as exc:
            raise AssertionError(f"after {key}: readouts never showed {expected}; "
                                 f"they show {self.readout_texts()}") from exc
        probe = self.page.evaluate("() => window.__stepProbe")
        return {"readouts_ms": probe["readouts"] - probe["key"],
                "image_ms": (probe["image"] - probe["key"]) if probe["image"] is not None else None}

    def drag_to(self, value: int, label: str = STEP_LABEL) -> None:
        """Drag the handle of slider LABEL with the mouse to where VALUE sits on its track."""
        slider = self.slider(label)
        handle = slider.locator(".noUi-handle")
        handle.scroll_into_view_if_needed()
        lo = float(handle.get_attribute("aria-valuemin"))
        hi = float(handle.get_attribute("aria-valuemax"))
        track = slider.locator(".noUi-base").bounding_box()
        box = handle.bounding_box()
        x0, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        x1 = track["x"] + track["width"] * ((value - lo) / (hi - lo) if hi > lo else 0.0)
        self.page.mouse.move(x0, y)
        self.page.mouse.down()
        self.page.mouse.move((x0 + x1) / 2, y, steps=5)
        self.page.mouse.move(x1, y, steps=5)
        self.page.mouse.up()

    def type_value(self, label: str, value: int) -> None:
        """Type VALUE into the number box of slider LABEL and press Enter (as a learner does)."""
        box = self.slider(label).locator(".widget-readout")
        box.click()
        self.page.keyboard.press("Control+a")
        self.page.keyboard.type(str(value))
        self.page.keyboard.press("Enter")

    def screenshot(self, name: str) -> Path:
        """The stepper's cell, whole (the viewport grows to fit it for the picture)."""
        return screenshot_tall(self.page, self.cell, name)


_READOUTS_MATCH_JS = """
([id, expected]) => Object.entries(expected).every(([name, text]) => {
  const el = document.querySelector(`[data-readout="${id}:${name}"]`);
  return !!el && el.textContent.trim().endsWith(text);
})
"""

_LATENCY_PROBE_JS = """
(cell, [id, expected]) => {
  const img = cell.querySelector('img.widget-image');
  const probe = {key: null, readouts: null, image: null, hasImage: !!img, src: img ? img.src : null};
  window.__stepProbe = probe;
  const matches = () => Object.entries(expected).every(([name, text]) => {
    const el = cell.querySelector(`[data-readout="${id}:${name}"]`);
    return !!el && el.textContent.trim().endsWith(text);
  });
  document.addEventListener('keydown', () => { if (probe.key === null) probe.key = performance.now(); },
                            {capture: true, once: true});
  const obs = new MutationObserver(() => {
    if (probe.key === null) return;
    const now = performance.now();
    if (probe.readouts === null && matches()) probe.readouts = now;
    const cur = cell.querySelector('img.widget-image');
    if (probe.image === null && cur && cur.src !== probe.src) probe.image = now;
    if (probe.readouts !== null && (probe.image !== null || !probe.hasImage)) obs.disconnect();
  });
  obs.observe(cell, {subtree: true, childList: true, characterData: true, attributes: true,
                     attributeFilter: ['src']});
}
"""


def screenshot_tall(page, locator, name: str, margin: int = 120) -> Path:
    """Screenshot LOCATOR whole: grow the viewport to its height first (JupyterLab clips at the window)."""
    old = page.viewport_size
    height = locator.evaluate("e => e.getBoundingClientRect().height")
    page.set_viewport_size({"width": old["width"], "height": int(max(old["height"], height + 2 * margin + 200))})
    try:
        locator.scroll_into_view_if_needed()
        page.wait_for_timeout(300)
        return screenshot(locator, name)
    finally:
        page.set_viewport_size(old)


def latency_summary(samples_ms) -> dict:
    """n, median, worst (ms) of a list of delays."""
    xs = sorted(samples_ms)
    n = len(xs)
    median = (xs[(n - 1) // 2] + xs[n // 2]) / 2 if n else float("nan")
    return {"n": n, "median_ms": median, "worst_ms": xs[-1] if n else float("nan")}


def stepper_config(view: StepperView) -> dict:
    """What the stepper on the page is showing: data kind, layer, head, query row, keys per tile."""
    from lessons.views.stepper import DATA_CHOICES

    kinds = dict(DATA_CHOICES)
    label = view.data_kind_label()
    if label not in kinds:
        raise AssertionError(f"unknown data choice {label!r}; expected one of {list(kinds)}")
    return {"kind": kinds[label], "layer": view.slider_value("layer"), "head": view.slider_value("head"),
            "row": view.slider_value("query row"), "tile": view.slider_value(TILE_SIZE_LABEL)}


def expected_steps(kind: str, layer: int, head: int, row: int, tile: int, seed: int = 0) -> dict:
    """The readouts TileStepper should show after each step, computed here from the trace.

    Runs :func:`lessons.flash_attention` (``return_trace=True``) and the textbook
    :func:`lessons.attention` on the same data the stepper loads
    (:func:`lessons.course.data.make_case`), and formats every value with the stepper's
    :func:`lessons.views.stepper.format_value`. Returns {"steps": [ {readout: text the
    readout ends with} per step ], "errors": max |o/l - exact| per step (floats),
    "rounding": the error bound that counts as float rounding for this data}.
    """
    import numpy as np

    from lessons import attention, flash_attention
    from lessons.course import data
    from lessons.views.stepper import format_value as fv

    q, k, v = data.make_case(kind, layer=layer, head=head, tile=tile, seed=seed)
    _, trace = flash_attention(q, k, v, min(tile, k.shape[0]), return_trace=True)
    rt = trace.row(row)
    exact = np.asarray(attention(q, k, v))[row]
    n = len(rt)
    errors = [float(np.max(np.abs(rt.o[i] / rt.l[i] - exact))) for i in range(n)]
    steps = [{"tile": f"{fv(i + 1)} of {fv(n)}", "m": f"= {fv(rt.m[i])}", "alpha": f"= {fv(rt.alpha[i])}",
              "l": f"= {fv(rt.l[i])}", "max_error": f"= {fv(errors[i])}"} for i in range(n)]
    eps = float(np.finfo(np.result_type(rt.o.dtype, exact.dtype)).eps)
    return {"steps": steps, "errors": errors, "rounding": 64 * eps * max(1.0, float(np.abs(exact).max()))}


def wait_kernel_idle(page, server: LabServer | None = None, timeout_ms: float = 60_000) -> None:
    """Wait until the kernel is idle.

    The status bar lags the kernel by a render or two, so with SERVER the
    server's own record (``execution_state`` of every kernel, updated from the
    kernel's status messages in order with its outputs) is polled as well: once
    the page has shown an output of a callback, this returns only after that
    callback finished.
    """
    from playwright.sync_api import expect

    deadline = time.monotonic() + timeout_ms / 1000
    if server is not None:
        while True:
            states = [k.get("execution_state") for k in server.api("GET", "/api/kernels")]
            if all(state == "idle" for state in states):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"kernels still busy after {timeout_ms / 1000:.0f} s: {states}")
            time.sleep(0.05)
    expect(page.locator("#jp-main-statusbar")).to_contain_text(
        STATUS_IDLE, timeout=max(1_000, (deadline - time.monotonic()) * 1000))


def measure_moves(view: StepperView, moves: int = 20) -> list[dict]:
    """Move the step slider MOVES times with the keyboard (bouncing between the ends).

    Before each move the kernel is idle; each move waits until the readouts show
    the trace's values for the new step (checked, not just changed). Returns one
    dict per move: step, key, readouts_ms, image_ms.
    """
    cfg = stepper_config(view)
    steps = expected_steps(**cfg)["steps"]
    n = len(steps)
    if n < 2:
        raise AssertionError(f"the stepper shows {n} tile(s); cannot move between tiles")
    view.handle.press("Home")
    view.wait_for(steps[0])
    view.wait_idle()
    step, direction, out = 1, +1, []
    for _ in range(moves):
        if not 1 <= step + direction <= n:
            direction = -direction
        step += direction
        key = "ArrowRight" if direction > 0 else "ArrowLeft"
        timing = view.timed_press(key, steps[step - 1])
        out.append({"step": step, "key": key, **timing})
        view.wait_idle()
    return out


def latency_report(samples: list[dict], title: str, context: str = "") -> str:
    """A Markdown table (median and worst) of measure_moves' samples."""
    rd = latency_summary([s["readouts_ms"] for s in samples])
    im = latency_summary([s["image_ms"] for s in samples if s["image_ms"] is not None])
    lines = [f"# {title}", ""] + ([context, ""] if context else []) + [
             "| what | moves | median (ms) | worst (ms) |", "| --- | ---: | ---: | ---: |",
             f"| key press -> readouts show the new tile's trace values | {rd['n']} | {rd['median_ms']:.0f} | {rd['worst_ms']:.0f} |"]
    if im["n"]:
        lines.append(f"| key press -> step picture replaced | {im['n']} | {im['median_ms']:.0f} | {im['worst_ms']:.0f} |")
    lines += ["", "Per move (ms): " + ", ".join(f"{s['readouts_ms']:.0f}" for s in samples), ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- checks shared by the tests

def problems_after_run_all(page, name: str) -> list[str]:
    """What is wrong with the visible notebook after Run All (empty when nothing is)."""
    problems = [f"{name}: error output after Run All:\n{e}" for e in error_outputs(page)]
    not_run = [src[:80] for prompt, src in cell_prompts(page) if src and not re.fullmatch(r"\[\d+\]:", prompt)]
    if not_run:
        problems.append(f"{name}: cells that did not run: {not_run}")
    problems += [f"{name}: widget did not render: {w}" for w in widget_problems(page)]
    problems += [f"{name}: figure did not decode: {i}" for i in broken_images(page)]
    return problems


def problems_at_the_end(page, server: LabServer, name: str, log_mark: int = 0) -> list[str]:
    """Errors that only show outside the cells: widget callbacks (log console), the kernel's
    stderr (server log since LOG_MARK), and error outputs in the notebook as JupyterLab saves it."""
    problems = [f"{name}: a widget callback raised:\n{e}" for e in log_console_errors(page)]
    problems += [f"{name}: the kernel logged:\n{e}" for e in server.log_errors(log_mark)]
    problems += [f"{name}: error outputs in other cells: {e}" for e in error_outputs(page)]
    save(page)
    problems += [f"{name}: the saved notebook holds an error: {e}" for e in saved_errors(server.saved_notebook(name))]
    return problems


def shown_float(text: str) -> float:
    """The number a readout ends with ('max |o/l − exact| = 2.77556e-16' -> 2.77556e-16)."""
    return float(text.rsplit("=", 1)[1].strip().replace(",", ""))


def run_all_and_check(page, server: LabServer, name: str, timings=None) -> None:
    """Open NAME, Run All, check it as a learner would meet it; raise AssertionError naming every problem.

    Every code cell ran, no cell or widget shows an error, every figure decoded,
    the widgets rendered; each tile stepper is stepped with the keyboard (first,
    next, last tile): the readout follows the slider, a new picture is drawn, the
    last tile's error is at rounding level; then no widget callback raised, the
    kernel logged no traceback and the notebook as saved holds no error output.
    Screenshots go to artifacts/screenshots/. TIMINGS(name, seconds) records durations.
    """
    stem = name.removesuffix(".ipynb")
    t0, log_mark = time.perf_counter(), server.log_mark()
    open_notebook(page, server, name)
    run_s = run_all(page)
    problems = problems_after_run_all(page, name)
    assert not problems, "\n---\n".join(problems)
    screenshot_notebook(page, f"{stem}-run-all")

    for i in range(stepper_cells(page).count()):
        view = StepperView(page, stepper_cells(page).nth(i), f"s{i}", server=server)
        n = view.slider_max()
        view.handle.press("Home")
        view.wait_for({"tile": f"1 of {n}"})
        view.wait_idle()
        picture = view.image_src()
        if n > 1:
            view.handle.press("ArrowRight")
            view.wait_for({"tile": f"2 of {n}"})
            assert view.slider_value() == 2
            view.wait_new_picture(picture)
        view.handle.press("End")
        view.wait_for({"tile": f"{n} of {n}"})
        view.wait_idle()
        last_error = shown_float(view.readout_texts()["max_error"])
        assert last_error < 1e-6, f"{name}: stepper {i} ends with max error {last_error}, not rounding level"
        view.screenshot(f"{stem}-stepper{i}-last-tile")

    problems = problems_at_the_end(page, server, name, log_mark)
    assert not problems, "\n---\n".join(problems)
    EXECUTED[name] = server.saved_notebook(name)
    if timings is not None:
        timings(f"{name}: Run All (kernel busy to idle)", run_s)
        timings(f"{name}: open + Run All + checks + stepping + screenshots", time.perf_counter() - t0)
