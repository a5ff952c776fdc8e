"""Every notebook as a learner meets it: opened in JupyterLab, Run ▸ Run All Cells, in Chromium.

Passes when every code cell ran, no cell or widget shows an error, every
figure decoded, the widgets rendered, no widget callback raised (those errors
only reach JupyterLab's log console), the kernel logged no traceback, and the
notebook as JupyterLab saves it holds no error output. A tile stepper found in
the notebook is stepped with the keyboard (first, next and last tile) and must
agree with itself: the tile readout follows the slider, a new picture is drawn
and the last tile's error is at rounding level. Screenshots of the whole
notebook and of each stepper go to artifacts/screenshots/
(:func:`jlab.run_all_and_check`).

Two notebooks get these checks elsewhere, so that no notebook runs twice in the
browser: notebook 02, with many more, in test_stepper_in_lab.py (one Run All
serves all of them), and the first notebook in test_lab_as_learner.py, in the
lab that `make lab` starts.
"""
from __future__ import annotations

import pytest

import jlab

pytestmark = pytest.mark.browser

NOTEBOOKS = [name for name in jlab.notebook_names()
             if name not in (jlab.STEPPER_NOTEBOOK, jlab.LEARNER_NOTEBOOK)]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.notebook(n)) for n in NOTEBOOKS])
def test_run_all_in_jupyterlab(lab, lab_page, name, timings):
    jlab.run_all_and_check(lab_page, lab, name, timings)
