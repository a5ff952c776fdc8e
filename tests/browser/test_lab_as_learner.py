"""The lab a learner starts: `make lab` in a git clone, a notebook run and saved, then `make test`'s check.

One JupyterLab started by ``make lab`` (:class:`jlab.MakeLabServer`) in a fresh
clone of the course. The first notebook is opened from the learner's copies,
run with Run All and checked as every notebook is (:func:`jlab.run_all_and_check`,
so test_notebooks_in_lab.py leaves it out), then saved with its outputs. After
that: the learner's copy holds the outputs, the committed notebook is
byte-for-byte unchanged, ``git status`` is clean and the clean-notebook test
passes in the clone. JupyterLab's news pop-up does not appear, because `make lab`
turned it off.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

import jlab

pytestmark = [pytest.mark.browser, pytest.mark.notebook(jlab.LEARNER_NOTEBOOK)]

NOTIFICATION_PLUGIN = "@jupyterlab/apputils-extension:notification"


@pytest.fixture
def learner_lab(browser_requirements):
    with jlab.lab_server(kind=jlab.MakeLabServer) as server:
        try:
            yield server
        finally:
            server.shutdown_kernels()


def test_a_learner_runs_a_notebook_in_make_lab_and_make_test_stays_clean(learner_lab, browser, timings):
    name = jlab.LEARNER_NOTEBOOK
    repo = learner_lab.repo
    committed = (repo / "notebooks" / name).read_bytes()
    context = browser.new_context(viewport=jlab.VIEWPORT)
    context.set_default_timeout(60_000)
    try:
        page = context.new_page()
        try:
            jlab.run_all_and_check(page, learner_lab, name, timings)
        except BaseException:
            jlab.screenshot(page, "FAILED-make-lab-learner")
            raise
        # The setting `make lab` wrote is the one the lab runs with, and no news toast shows.
        settings = learner_lab.api("GET", f"/lab/api/settings/{NOTIFICATION_PLUGIN}")
        defaults = {k: v.get("default") for k, v in settings["schema"]["properties"].items()}
        effective = {**defaults, **(settings.get("settings") or {})}     # overrides.json sets the defaults
        assert effective["fetchNews"] == "false", effective
        assert effective["checkForUpdates"] is False, effective
        toasts = page.locator(".Toastify__toast").all_text_contents()
        assert not any("news" in t.lower() for t in toasts), f"a news pop-up is showing: {toasts}"
    finally:
        context.close()

    saved = learner_lab.saved_notebook(name)          # read again if a save was still rewriting it
    outputs = sum(len(c.get("outputs", [])) for c in saved["cells"] if c["cell_type"] == "code")
    assert outputs > 0, "the learner's copy should keep the outputs JupyterLab saved"
    assert (repo / "notebooks" / name).read_bytes() == committed, "the committed notebook was modified"
    assert jlab.git(repo, "status", "--porcelain", "--untracked-files=all") == ""
    clean = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                            "tests/test_notebooks_clean.py"], cwd=repo, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stdout[-3000:]
