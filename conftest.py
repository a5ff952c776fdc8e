"""How the whole test run is laid out (pytest loads this file for tests/ and notebooks/ alike).

`make test` runs pytest-xdist workers with ``--dist=loadgroup`` (pyproject's addopts),
and every test gets a group here, so that work done once per module or session is
done once per run:

- nbval makes one test per notebook cell and runs them in order in one kernel, so
  every cell of a notebook carries the group ``notebook-NAME`` and all of them run in
  one worker (spread over workers, later cells fail with NameError).
- Any other test without an ``xdist_group`` mark of its own is grouped by its file,
  as ``--dist=loadfile`` would: a module's expensive fixtures (the HTML build, the
  grader runs, the emulated GPU sections) run once, not once per worker. A file may
  split itself with its own marks (the browser tests group each notebook apart, each
  worker then starting its own JupyterLab on its own port).
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


def pytest_itemcollected(item):            # as each test is collected: before xdist reads the groups
    if _is_notebook_cell(item):
        item.add_marker(pytest.mark.xdist_group(f"notebook-{Path(str(item.fspath)).name}"))
    elif item.get_closest_marker("xdist_group") is None:
        item.add_marker(pytest.mark.xdist_group(f"file-{item.nodeid.split('::')[0]}"))


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
