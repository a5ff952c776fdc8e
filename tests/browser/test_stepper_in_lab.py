"""The tile stepper of notebook 02, driven with keyboard and mouse in JupyterLab.

The expected readouts are computed here, in the test process, from
``lessons.flash_attention(..., return_trace=True)`` and ``lessons.attention`` on
the data the stepper shows (read back from its controls), formatted with the
stepper's own ``format_value``. The stepper itself only displays a trace, so
these tests catch a view that shows the wrong tile, a stale value, or a tiling
that did not follow the tile-size control.

The delay from a slider move to correct readouts is measured and written to
artifacts/slider_latency.md (printed with ``-s``); it is reported, not asserted.
"""
from __future__ import annotations

import json
import math
import time

import pytest

import jlab

NOTEBOOK = jlab.STEPPER_NOTEBOOK
# One Run All (the module fixture) serves every test here (under xdist, --dist=loadfile keeps them in one worker).
pytestmark = [pytest.mark.browser, pytest.mark.notebook(NOTEBOOK)]


@pytest.fixture(scope="module")
def stepper(lab, browser, timings):
    """Notebook 02 after Run All (checked as every notebook is), and a view of its first stepper.

    Its kernel is shut down at the end of the module, whatever happened.
    """
    if NOTEBOOK is None:
        pytest.fail("notebooks/02_*.ipynb (the tile-by-tile lesson) is missing")
    context = browser.new_context(viewport=jlab.VIEWPORT)
    context.set_default_timeout(60_000)
    try:
        t0, log_mark = time.perf_counter(), lab.log_mark()
        page = context.new_page()
        jlab.open_notebook(page, lab, NOTEBOOK)
        run_s = jlab.run_all(page)
        problems = jlab.problems_after_run_all(page, NOTEBOOK)
        assert not problems, "\n---\n".join(problems)
        jlab.screenshot_notebook(page, f"{NOTEBOOK.removesuffix('.ipynb')}-run-all")
        jlab.save(page)                                 # as Run All left it, for the HTML build test
        jlab.EXECUTED[NOTEBOOK] = lab.saved_notebook(NOTEBOOK)
        cells = jlab.stepper_cells(page)
        try:                                            # widget views attach a moment after the kernel is idle
            cells.first.wait_for(state="attached", timeout=60_000)
        except Exception:
            raise AssertionError(f"{NOTEBOOK} shows no tile stepper after Run All") from None
        view = jlab.StepperView(page, cells.first, "s0", server=lab)
        view.log_mark = log_mark
        view.wait_idle()
        timings(f"{NOTEBOOK}: Run All (kernel busy to idle)", run_s)
        timings(f"{NOTEBOOK}: open + Run All + checks + screenshot", time.perf_counter() - t0)
        yield view
    finally:
        try:
            context.close()
        finally:
            lab.shutdown_kernels()


def expected(view):
    return jlab.expected_steps(**jlab.stepper_config(view))


def _check_no_errors(view):
    errors = jlab.error_outputs(view.page)
    assert not errors, "error output while stepping:\n" + "\n---\n".join(errors)
    callbacks = jlab.log_console_errors(view.page)
    assert not callbacks, "a widget callback raised:\n" + "\n---\n".join(callbacks)
    logged = view.server.log_errors(view.log_mark)
    assert not logged, "the kernel logged errors from the widget callbacks:\n" + "\n---\n".join(logged)


def test_keyboard_steps_show_the_trace_values(stepper):
    want = expected(stepper)["steps"]
    n = len(want)
    assert stepper.slider_max() == n, "the slider should have one position per tile the row absorbs"
    assert n >= 2
    stepper.handle.press("Home")
    stepper.wait_for(want[0])
    assert stepper.slider_value() == 1
    for step in range(2, n + 1):
        stepper.handle.press("ArrowRight")
        stepper.wait_for(want[step - 1])
        assert stepper.slider_value() == step
        stepper.wait_idle()
    stepper.handle.press("ArrowLeft")
    stepper.wait_for(want[n - 2])
    stepper.wait_idle()
    _check_no_errors(stepper)
    stepper.screenshot("02-stepper-keyboard")


def test_last_tile_shows_rounding_level_error(stepper):
    exp = expected(stepper)
    n = len(exp["steps"])
    stepper.handle.press("End")
    stepper.wait_for(exp["steps"][-1])
    shown = float(stepper.readout_texts()["max_error"].rsplit("=", 1)[1])
    assert shown <= exp["rounding"], f"last tile shows max error {shown}, above rounding ({exp['rounding']:.3g})"
    # ...and it is the *last* tile that gets there: the first one is far from exact on this data.
    assert exp["errors"][0] > 1e6 * exp["rounding"], "the sample should start far from the exact output"
    assert stepper.slider_value() == n
    stepper.wait_idle()
    stepper.screenshot("02-stepper-last-tile")


def test_dragging_the_slider_shows_that_tile(stepper):
    want = expected(stepper)["steps"]
    n = len(want)
    stepper.handle.press("Home")
    stepper.wait_for(want[0])
    stepper.wait_idle()
    for target in sorted({(n + 1) // 2, n}):
        stepper.drag_to(target)
        assert stepper.slider_value() == target, f"dragged to {target}, the slider says {stepper.slider_value()}"
        stepper.wait_for(want[target - 1])
        stepper.wait_idle()
    stepper.drag_to((n + 1) // 2)
    stepper.wait_for(want[(n + 1) // 2 - 1])
    stepper.wait_idle()
    _check_no_errors(stepper)
    stepper.screenshot("02-stepper-after-drag")


def test_slider_latency_is_reported(stepper):
    samples = jlab.measure_moves(stepper, moves=20)
    cfg = jlab.stepper_config(stepper)
    report = jlab.latency_report(
        samples, "Slider move to updated readouts (notebook 02, JupyterLab in headless Chromium)",
        f"Data: {cfg}. Each move is one ArrowRight/ArrowLeft on the step slider's handle with the kernel "
        "idle before it; the time runs from the keydown event to the DOM mutation after which every "
        "readout (tile, m, alpha, l, max error) shows the trace's value for the new tile.")
    summary = jlab.latency_summary([s["readouts_ms"] for s in samples])
    jlab.ARTIFACTS.mkdir(exist_ok=True)
    (jlab.ARTIFACTS / "slider_latency.md").write_text(report)
    (jlab.ARTIFACTS / "slider_latency.json").write_text(json.dumps({"summary": summary, "moves": samples},
                                                                  indent=2) + "\n")
    print("\n" + report)
    assert summary["n"] == 20 and all(math.isfinite(s["readouts_ms"]) and s["readouts_ms"] >= 0 for s in samples)
    _check_no_errors(stepper)


def test_tile_size_control_reslices_the_tiles(stepper):
    cfg = jlab.stepper_config(stepper)
    nk = stepper.slider_max(jlab.TILE_SIZE_LABEL)         # the control runs from 1 to the number of keys
    t = cfg["tile"]
    new_tile = next(c for c in (2 * t, t // 2, t + 1, t - 1)
                    if 1 <= c <= nk and math.ceil(nk / c) != math.ceil(nk / t))
    after = jlab.expected_steps(**{**cfg, "tile": new_tile})["steps"]
    assert len(after) == math.ceil(nk / new_tile)
    picture = stepper.image_src()
    stepper.type_value(jlab.TILE_SIZE_LABEL, new_tile)
    stepper.page.wait_for_function(
        "([h, n]) => h.getAttribute('aria-valuemax') === String(n.toFixed(1))",
        arg=[stepper.handle.element_handle(), len(after)], timeout=60_000)
    stepper.wait_idle()                                  # the new tiling is drawn to the end
    assert stepper.slider_value(jlab.TILE_SIZE_LABEL) == new_tile
    assert stepper.slider_max() == len(after)
    step = stepper.slider_value()
    stepper.wait_for(after[step - 1])
    stepper.wait_new_picture(picture)
    _check_no_errors(stepper)
    stepper.handle.press("End")
    stepper.wait_for(after[-1])
    stepper.wait_idle()
    _check_no_errors(stepper)
    stepper.screenshot("02-stepper-retiled")


def test_notebook_02_ends_without_errors(stepper):
    """After all that stepping: no callback error, nothing in the kernel log, a clean saved notebook."""
    problems = jlab.problems_at_the_end(stepper.page, stepper.server, NOTEBOOK, stepper.log_mark)
    assert not problems, "\n---\n".join(problems)
