"""How the whole test run is laid out (pytest loads this file for tests/ and notebooks/ alike).

`make test` runs pytest-xdist workers with ``--dist=loadfile`` (pyproject's addopts):
every test of a file runs in one worker, so nbval's cells of one notebook run in
order in one kernel (spread over workers, later cells would fail with NameError),
and a module's expensive fixtures (the HTML build, the grader runs, the emulated
GPU sections, the browser tests' JupyterLab) run once, not once per worker.
(``loadgroup`` cannot be used here: pytest 9.2 ignores the node-id suffix through
which pytest-xdist 3.8 marks groups.)

- A notebook that another selected test executes top to bottom, failing on any
  error (tests marked ``notebook(NAME, ...)``: the HTML build in tests/test_html.py,
  the browser tests' Run All in JupyterLab), is not executed once more by nbval in
  the same run: its nbval cells are skipped, naming the test that executes it. That
  is nbval's whole check here: the committed notebooks hold no outputs, so nbval
  (``--nbval-lax``) only executes them and fails on an error. When those tests are
  deselected or not collected (``pytest notebooks/``), or for the browser tests
  when they cannot run (no Chromium or Playwright), nbval executes the notebook.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest


def _is_notebook_cell(item) -> bool:
    return type(item).__name__ == "IPyNbCell" and str(item.fspath).endswith(".ipynb")


def _will_run_notebooks(item) -> bool:
    """True unless ITEM is a browser test that will skip (no Chromium or Playwright here)."""
    if item.get_closest_marker("browser") is None:
        return True
    jlab = sys.modules.get("jlab")           # imported by the browser tests when they are collected
    return jlab is not None and jlab.missing_requirements() is None


@pytest.hookimpl(hookwrapper=True, specname="pytest_collection_modifyitems")  # after -m/-k deselection
def pytest_collection_modifyitems_executed_elsewhere(items):
    yield
    runs = {}
    for item in items:
        marks = list(item.iter_markers("notebook"))
        if marks and _will_run_notebooks(item):
            for mark in marks:
                for name in mark.args:
                    runs.setdefault(name, item.nodeid)
    for item in items:
        name = Path(str(item.fspath)).name
        if _is_notebook_cell(item) and name in runs:
            item.add_marker(pytest.mark.skip(reason=f"executed top to bottom in this run by {runs[name]}"))
