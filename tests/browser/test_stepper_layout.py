"""The steppers at 1400 x 900, as a learner sees them in JupyterLab (headless Chromium).

A small notebook written into the server's throw-away folder holds three steppers:
notebook 02's with the kernel's trace beside NumPy's, the plain one, and notebook
05's paged one. Checked: the picture and the table stand side by side (no wrap),
changing the query row, head or layer keeps the tile slider where it was (clamped),
and the paged stepper shows the block table and the current step's physical page
beside the state. The expected page is computed here from the schedule itself.
"""
from __future__ import annotations

import nbformat
import pytest

import jlab

pytestmark = pytest.mark.browser

VIEWPORT = {"width": 1400, "height": 900}
NAME = "zz_stepper_layout.ipynb"
CELLS = [
    "from lessons.views.stepper import TileStepper\n"
    "from lessons.schedules.paged import paged_schedule\n"
    "from lessons.gpu import kernel_row_trace",
    'TileStepper(kind="real", row=93, tile=16, kernel=kernel_row_trace)',
    'TileStepper(kind="real", row=93, tile=16)',
    'TileStepper(kind="real", row=93, tile=16, schedule=paged_schedule)',
]


@pytest.fixture(scope="module")
def steppers(lab, browser):
    from playwright.sync_api import expect

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, lab.root / "notebooks" / NAME)
    context = browser.new_context(viewport=VIEWPORT)
    context.set_default_timeout(120_000)
    try:
        page = context.new_page()
        jlab.open_notebook(page, lab, NAME)
        jlab.run_all(page, timeout_ms=600_000)
        assert not jlab.error_outputs(page), jlab.error_outputs(page)
        cells = jlab.stepper_cells(page)
        try:                                         # widget views attach a moment after the kernel is idle
            expect(cells).to_have_count(3, timeout=60_000)
        except AssertionError:
            raise AssertionError(f"expected 3 steppers, found {cells.count()}") from None
        yield page, [jlab.StepperView(page, cells.nth(i), f"l{i}", server=lab) for i in range(3)]
    finally:
        try:
            context.close()
        finally:
            lab.shutdown_kernels()


def _boxes(view):
    image = view.cell.locator(".widget-image").first
    table = view.cell.locator(".widget-html", has_text="α in bold orange").first   # the per-tile table
    image.scroll_into_view_if_needed()
    img, tab = image.bounding_box(), table.bounding_box()
    if img is None or tab is None:
        jlab.screenshot(view.cell, "stepper-layout-missing-box")
        raise AssertionError(f"picture {img} or table {tab} is not on the page")
    return img, tab


@pytest.mark.parametrize("which", [0, 1, 2], ids=["with kernel trace", "plain", "paged"])
def test_picture_and_table_side_by_side_at_1400_by_900(steppers, which):
    page, views = steppers
    view = views[which]
    view.handle.press("End")
    view.wait_idle()
    img, table = _boxes(view)
    assert table["x"] >= img["x"] + img["width"] - 2, f"the table wrapped below the picture: {img}, {table}"
    assert table["y"] < img["y"] + img["height"], f"the table starts below the picture: {img}, {table}"
    assert table["x"] + table["width"] <= VIEWPORT["width"], f"the table runs off the window: {table}"
    assert img["width"] >= 450, f"the picture shrank to {img['width']} px"
    jlab.screenshot(view.cell, f"stepper-1400x900-{which}")


@pytest.mark.parametrize("label, value", [("query row", 10), ("head", 3), ("layer", 2)])
def test_changing_row_head_or_layer_keeps_the_tile(steppers, label, value):
    from playwright.sync_api import expect

    page, views = steppers
    view = views[1]
    view.handle.press("Home")
    expect(view.handle).to_have_attribute("aria-valuetext", "1")
    for _ in range(4):
        view.handle.press("ArrowRight")
    expect(view.handle).to_have_attribute("aria-valuetext", "5")
    view.wait_idle()
    view.type_value(label, value)
    expect(view.slider(label).locator(".noUi-handle")).to_have_attribute("aria-valuetext", str(value))
    expect(view.readout("tile")).to_contain_text("tile 5 of", timeout=30_000)
    view.wait_idle()
    page.wait_for_timeout(500)                       # a late reset from the kernel would land by now
    assert view.slider_value() == 5, f"changing {label} moved the tile slider to {view.slider_value()}"


def test_paged_stepper_shows_the_block_table_and_the_page(steppers):
    from lessons.course.data import make_case
    from lessons.schedules.paged import paged_schedule

    page, views = steppers
    view = views[2]
    view.handle.press("Home")
    view.wait_idle()
    view.handle.press("ArrowRight")
    view.handle.press("ArrowRight")
    view.wait_idle()
    q, k, v = make_case("real", layer=0, head=0)
    table = paged_schedule(q, k, v, 16).block_table                # the same shuffled pool (seed 0)
    from playwright.sync_api import expect

    readout = view.cell.locator(".widget-html", has_text="physical page").first
    expect(readout).to_contain_text(f"logical block 2 → physical page {int(table[2])}", timeout=30_000)
    assert view.slider_value() == 3
    shown = view.cell.locator(".widget-html", has_text="block_table").first
    assert shown.is_visible()
    pages = shown.locator("[data-page]")
    assert [c.text_content().strip() for c in pages.all()] == [str(int(p)) for p in table]
    boxes = [c.bounding_box() for c in pages.all()]
    assert all(a["x"] < b["x"] for a, b in zip(boxes, boxes[1:])), "the pages are not in one row"
