"""Every notebook as a learner meets it: opened in JupyterLab, Run ▸ Run All Cells, in Chromium.

Passes when every code cell ran, no cell or widget shows an error, every
figure decoded, the widgets rendered, no widget callback raised (those errors
only reach JupyterLab's log console), the kernel logged no traceback, and the
notebook as JupyterLab saves it holds no error output. A tile stepper found in
the notebook is stepped with the keyboard (first, next and last tile) and must
agree with itself: the tile readout follows the slider, a new picture is drawn
and the last tile's error is at rounding level. Screenshots of the whole
notebook and of each stepper go to artifacts/screenshots/.

Notebook 02 gets the same checks, and many more, in test_stepper_in_lab.py
(one Run All serves all of them).
"""
from __future__ import annotations

import time

import pytest

import jlab

pytestmark = pytest.mark.browser

NOTEBOOKS = sorted(p.name for p in jlab.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb") if not p.name.startswith("02_"))


def _shown_float(text: str) -> float:
    """The number a readout ends with ('max |o/l − exact| = 2.77556e-16' -> 2.77556e-16)."""
    return float(text.rsplit("=", 1)[1].strip().replace(",", ""))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_run_all_in_jupyterlab(lab, lab_page, name, timings):
    page, stem = lab_page, name.removesuffix(".ipynb")
    t0, log_mark = time.perf_counter(), lab.log_mark()
    jlab.open_notebook(page, lab, name)
    run_s = jlab.run_all(page)
    problems = jlab.problems_after_run_all(page, name)
    assert not problems, "\n---\n".join(problems)
    jlab.screenshot_notebook(page, f"{stem}-run-all")

    for i in range(jlab.stepper_cells(page).count()):
        view = jlab.StepperView(page, jlab.stepper_cells(page).nth(i), f"s{i}", server=lab)
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
        last_error = _shown_float(view.readout_texts()["max_error"])
        assert last_error < 1e-6, f"{name}: stepper {i} ends with max error {last_error}, not rounding level"
        view.screenshot(f"{stem}-stepper{i}-last-tile")

    problems = jlab.problems_at_the_end(page, lab, name, log_mark)
    assert not problems, "\n---\n".join(problems)
    timings(f"{name}: Run All (kernel busy to idle)", run_s)
    timings(f"{name}: open + Run All + checks + stepping + screenshots", time.perf_counter() - t0)
