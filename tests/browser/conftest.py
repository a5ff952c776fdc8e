"""Fixtures for the real-browser tests: one JupyterLab server and one headless Chromium per session.

The server serves a temporary copy of ``notebooks/`` (JupyterLab autosaves
outputs into whatever it opens) with throw-away Jupyter, IPython and Matplotlib
folders, on 127.0.0.1 with a random free port and token. Every kernel a test
started is shut down after the test, pass or fail, and the server and browser
at the end of the session.

Without ``/usr/bin/chromium`` or the ``playwright`` package the tests are
skipped with the reason, unless the environment variable ``CI`` is set: then
they fail, so CI never passes by silently skipping them.
"""
from __future__ import annotations

import json
import time

import pytest

import jlab

_TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="session")
def browser_requirements():
    """Skip (or, under CI, fail) when Chromium or Playwright is missing."""
    action, reason = jlab.requirement_outcome()
    if action == "fail":
        pytest.fail(reason, pytrace=False)
    if action == "skip":
        pytest.skip(reason)


@pytest.fixture(scope="session")
def lab(browser_requirements):
    """A running :class:`jlab.LabServer`; its kernels and process end with the session."""
    t0 = time.perf_counter()
    try:
        with jlab.lab_server() as server:
            yield server
    finally:
        _TIMINGS["browser tests: server start to server stopped"] = time.perf_counter() - t0


@pytest.fixture(scope="session")
def browser(browser_requirements):
    """Headless Debian Chromium (Playwright sync API)."""
    with jlab.chromium() as b:
        yield b


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def lab_page(request, lab, browser):
    """A fresh browser page; afterwards every kernel is shut down (a failing test leaves a screenshot)."""
    context = browser.new_context(viewport=jlab.VIEWPORT)
    context.set_default_timeout(60_000)
    page = context.new_page()
    try:
        yield page
    finally:
        try:
            rep = getattr(request.node, "rep_call", None)
            if rep is not None and rep.failed:
                jlab.screenshot(page, f"FAILED-{request.node.name}".replace("/", "_"))
        except Exception:
            pass
        try:
            context.close()
        finally:
            lab.shutdown_kernels()


@pytest.fixture(scope="session")
def timings():
    """Record named durations (seconds) printed at the end of the run and written to artifacts/."""
    def record(name: str, seconds: float) -> None:
        _TIMINGS[name] = seconds
    return record


def _worker_id(config) -> str | None:
    """The pytest-xdist worker's id ('gw0', ...), or None in the controlling (or only) process."""
    return getattr(config, "workerinput", {}).get("workerid")


def pytest_sessionfinish(session):
    """Each xdist worker leaves its timings for the controller's summary."""
    worker = _worker_id(session.config)
    if worker is not None and _TIMINGS:
        jlab.ARTIFACTS.mkdir(exist_ok=True)
        (jlab.ARTIFACTS / f"browser_timings-{worker}.json").write_text(json.dumps(_TIMINGS, indent=2) + "\n")


def pytest_terminal_summary(terminalreporter):
    timings = dict(_TIMINGS)
    for path in sorted(jlab.ARTIFACTS.glob("browser_timings-gw*.json")):
        worker = path.stem.removeprefix("browser_timings-")
        timings.update({f"[{worker}] {name}": s for name, s in json.loads(path.read_text()).items()})
        path.unlink()                               # read once, into browser_timings.json
    if not timings:
        return
    lines = [f"{name:65s} {seconds:7.1f} s" for name, seconds in timings.items()]
    terminalreporter.write_sep("-", "browser timings")
    for line in lines:
        terminalreporter.write_line(line)
    jlab.ARTIFACTS.mkdir(exist_ok=True)
    (jlab.ARTIFACTS / "browser_timings.json").write_text(json.dumps(timings, indent=2) + "\n")


@pytest.fixture(autouse=True)
def _screenshot_when_failed(request):
    """A failing test that shares the stepper page leaves a screenshot of it."""
    yield
    rep = getattr(request.node, "rep_call", None)
    view = request.node.funcargs.get("stepper")
    if rep is not None and rep.failed and view is not None:
        try:
            jlab.screenshot(view.page, f"FAILED-{request.node.name}")
        except Exception:
            pass
