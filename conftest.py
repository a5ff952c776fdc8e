"""How the whole test run is laid out (pytest loads this file for tests/ and notebooks/ alike).

`make test` runs pytest-xdist workers with ``--dist=loadgroup`` (pyproject's addopts):

- nbval makes one test per notebook cell and runs them in order in one kernel, so
  every cell of a notebook carries the group ``notebook-NAME`` and all of them run in
  one worker (spread over workers, later cells fail with NameError).
- A notebook that the browser tests run in JupyterLab (tests marked
  ``notebook(NAME)``: Run All, then every cell ran, no error output, no error saved)
  is not executed a second time by nbval in the same run: its nbval cells are
  skipped, naming the browser test that runs it. The browser check is a superset of
  nbval's here: the committed notebooks hold no outputs, so nbval only executes them.
  When the browser tests are deselected (``-m "not browser"``), not collected, or
  cannot run (no Chromium or Playwright), nbval executes every notebook as before.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest


def _is_notebook_cell(item) -> bool:
    return type(item).__name__ == "IPyNbCell" and str(item.fspath).endswith(".ipynb")


@pytest.hookimpl(tryfirst=True, specname="pytest_collection_modifyitems")   # before xdist reads the groups
def pytest_collection_modifyitems_groups(items):
    for item in items:
        if _is_notebook_cell(item):
            item.add_marker(pytest.mark.xdist_group(f"notebook-{Path(str(item.fspath)).name}"))


@pytest.hookimpl(hookwrapper=True, specname="pytest_collection_modifyitems")  # after -m/-k deselection
def pytest_collection_modifyitems_browser_runs(items):
    yield
    jlab = sys.modules.get("jlab")           # imported by the browser tests when they are collected
    if jlab is None or jlab.missing_requirements() is not None:
        return
    in_browser = {}
    for item in items:
        for mark in item.iter_markers("notebook"):
            in_browser.setdefault(mark.args[0], item.nodeid)
    for item in items:
        name = Path(str(item.fspath)).name
        if _is_notebook_cell(item) and name in in_browser:
            item.add_marker(pytest.mark.skip(reason=f"runs in JupyterLab in this session: {in_browser[name]}"))
