"""Every notebook as a learner meets it: opened in JupyterLab, Run ▸ Run All Cells, in Chromium.

Passes when every code cell ran, no cell or widget shows an error, every
figure decoded, the widgets rendered, and the notebook JupyterLab saved holds
no error output, and the kernel logged no traceback (an exception in a widget
callback only shows up there). A stepper found in the notebook is stepped with the keyboard
(first tile, next tile, last tile) and must agree with itself: the tile
readout follows the slider and the last tile's error is at rounding level.
Screenshots go to artifacts/screenshots/.
"""
from __future__ import annotations

import re
import time

import pytest

import jlab

pytestmark = pytest.mark.browser

NOTEBOOKS = sorted(p.name for p in jlab.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _shown_float(text: str) -> float:
    """The number a readout ends with ('max |o/l − exact| = 2.77556e-16' -> 2.77556e-16)."""
    return float(text.rsplit("=", 1)[1].strip().replace(",", ""))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_run_all_in_jupyterlab(lab, lab_page, name, timings):
    page, stem = lab_page, name.removesuffix(".ipynb")
    t0, log_mark = time.perf_counter(), lab.log_mark()
    jlab.open_notebook(page, lab, name)
    run_s = jlab.run_all(page)

    errors = jlab.error_outputs(page)
    assert not errors, f"{name}: error output after Run All:\n" + "\n---\n".join(errors)
    not_run = [src[:80] for prompt, src in jlab.cell_prompts(page)
               if src and not re.fullmatch(r"\[\d+\]:", prompt)]
    assert not not_run, f"{name}: cells that did not run: {not_run}"
    assert not jlab.widget_problems(page), f"{name}: widgets did not render: {jlab.widget_problems(page)}"
    assert not jlab.broken_images(page), f"{name}: figures that did not decode: {jlab.broken_images(page)}"
    jlab.screenshot_notebook(page, f"{stem}-run-all")

    for i in range(jlab.stepper_cells(page).count()):
        view = jlab.StepperView(page, jlab.stepper_cells(page).nth(i), f"s{i}", server=lab)
        n = view.slider_max()
        view.handle.press("Home")
        view.wait_for({"tile": f"1 of {n}"})
        if n > 1:
            view.handle.press("ArrowRight")
            view.wait_for({"tile": f"2 of {n}"})
            assert view.slider_value() == 2
        view.handle.press("End")
        view.wait_for({"tile": f"{n} of {n}"})
        view.wait_idle()
        last_error = _shown_float(view.readout_texts()["max_error"])
        assert last_error < 1e-6, f"{name}: stepper {i} ends with max error {last_error}, not rounding level"
        assert not jlab.error_outputs(page), f"{name}: error after stepping: {jlab.error_outputs(page)}"
        assert view.image_src(), f"{name}: stepper {i} shows no step picture"
        view.screenshot(f"{stem}-stepper{i}-last-tile")

    callbacks = jlab.log_console_errors(page)
    assert not callbacks, f"{name}: a widget callback raised:\n" + "\n---\n".join(callbacks)
    kernel_errors = lab.log_errors(log_mark)
    assert not kernel_errors, f"{name}: the kernel logged errors (widget callbacks?):\n" + "\n---\n".join(kernel_errors)
    jlab.save(page)
    saved = jlab.saved_errors(lab.saved_notebook(name))
    assert not saved, f"{name}: the saved notebook holds errors: {saved}"
    timings(f"{name}: Run All (kernel busy to idle)", run_s)
    timings(f"{name}: open + Run All + checks + screenshots", time.perf_counter() - t0)
