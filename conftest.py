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
- The files that take longest run first (:data:`LONG_FIRST`): with two workers a long file
  started last would run alone while the other worker waits at the end.
- The browser tests and tests/test_html.py form one unit (:data:`NOTEBOOK_RUNS`), run by one worker
  in that order, so that the HTML build converts the notebooks JupyterLab just ran instead of
  running each notebook a second time.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest


#: test files in order of their share of a run (worker seconds on 2 cores), scheduled in this order
#: (pyproject's addopts keep it: ``--no-loadscope-reorder``) so that no long file starts last
LONG_FIRST = (
    "tests/browser/test_notebooks_in_lab.py", "tests/browser/test_lab_as_learner.py",
    "tests/browser/test_stepper_in_lab.py", "tests/browser/test_stepper_layout.py", "tests/test_html.py",
    "tests/test_gpu_compile.py", "tests/test_distributed.py", "tests/test_gpu_check_script.py",
    "tests/test_gpu_backward.py", "tests/test_grader.py", "tests/test_gpu_fa2.py", "tests/test_gpu_ladder.py",
    "tests/test_gpu_kernels.py", "tests/test_stepper.py", "tests/test_gpu_decode.py", "tests/test_gpu_backward_mma.py",
)
#: one unit of work for one worker: the browser tests and the HTML build, which converts the notebooks
#: the browser tests ran (tests/test_html.py) instead of running them again
NOTEBOOK_RUNS = "tests/browser/ and tests/test_html.py"


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


def pytest_collection_modifyitems(items):
    """Put the files of :data:`LONG_FIRST` first, in that order (a stable sort: a file's tests keep theirs)."""
    rank = {path: i for i, path in enumerate(LONG_FIRST)}
    root = Path(__file__).resolve().parent

    def key(item):
        try:
            path = Path(str(item.fspath)).resolve().relative_to(root).as_posix()
        except ValueError:
            return len(LONG_FIRST)
        return rank.get(path, len(LONG_FIRST))
    items.sort(key=key)


def pytest_xdist_make_scheduler(config, log):
    """``--dist=loadfile`` with the files of :data:`NOTEBOOK_RUNS` as one unit."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduler(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return NOTEBOOK_RUNS if scope.startswith("tests/browser/") or scope == "tests/test_html.py" else scope

    return Scheduler(config, log)
