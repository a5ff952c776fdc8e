"""The tile stepper, driven headlessly: every readout against values computed another way.

Two independent sources: the trace of ``lessons.flash_attention(..., return_trace=True)``
(the text must be exactly its values through ``format_value``), and a from-scratch
computation over the key prefix (one row of S, its max, its exp-sum, and textbook
attention over the keys absorbed so far).
"""
import math
import re

import numpy as np
import pytest

from lessons import attention, flash_attention
from lessons.course.data import make_case
from lessons.gpu import emulator_available
from lessons.views.stepper import DEFAULT_ROWS, TileStepper, format_value

NAMES = ["tile", "keys", "m", "alpha", "l", "max_error", "scores_in_memory", "naive_scores", "rescales"]


def text(widget):
    """The readout as plain text (tags removed)."""
    return re.sub(r"<[^>]+>", "", widget.value)


def number_after_equals(widget):
    return float(text(widget).rsplit("=", 1)[1].strip().split()[0].replace(",", ""))


def prefix_values(q_row, k, v, stops):
    """m, l, alpha, o/l and the rescale count after each prefix of keys, without any tiling code."""
    s = (q_row @ k.T) / math.sqrt(q_row.shape[0])
    exact = attention(q_row, k, v)
    out, m_prev, rescales = [], None, 0
    for stop in stops:
        m = s[:stop].max()
        alpha = 0.0 if m_prev is None else math.exp(m_prev - m)
        rescales += m_prev is not None and m > m_prev
        o_over_l = attention(q_row, k[:stop], v[:stop])
        out.append(dict(m=m, l=np.exp(s[:stop] - m).sum(), alpha=alpha, rescales=rescales,
                        error=np.abs(o_over_l - exact).max()))
        m_prev = m
    return out


def check_every_step(st, q, k, v, row, tile, steps=None):
    """Move the slider through ``steps`` and compare every readout with both sources."""
    _, trace = flash_attention(q, k, v, tile, return_trace=True)
    rt = trace.row(row)
    exact = attention(q, k, v)[row]
    errors = rt.errors(exact)
    n = len(rt)
    nk = k.shape[0]
    assert n == -(-nk // tile)
    assert (st.slider.min, st.slider.max) == (1, n) and st.play.max == n
    stops = [min(tile * t, nk) for t in range(1, n + 1)]
    scratch = prefix_values(q[row], k, v, stops)
    for t in (range(1, n + 1) if steps is None else steps):
        st.slider.value = t
        i = t - 1
        r = st.readouts
        a, b = tile * i, stops[i]
        assert sorted(r) == sorted(NAMES)
        # exactly the trace's numbers, formatted by the one function
        assert f"{format_value(t)} of {format_value(n)}" in text(r["tile"])
        assert f"{format_value(a)}–{format_value(b - 1)}" in text(r["keys"])
        assert format_value(rt.m[i]) in text(r["m"])
        assert format_value(rt.alpha[i]) in text(r["alpha"])
        assert format_value(rt.l[i]) in text(r["l"])
        assert format_value(errors[i]) in text(r["max_error"])
        assert format_value(b - a) in text(r["scores_in_memory"])
        assert format_value(q.shape[0] * nk) in text(r["naive_scores"])
        assert format_value(int(rt.rescaled[:t].sum())) in text(r["rescales"])
        # and the same numbers from scratch (6 significant digits are shown)
        want = scratch[i]
        assert number_after_equals(r["m"]) == pytest.approx(want["m"], rel=1e-5, abs=1e-12)
        assert number_after_equals(r["l"]) == pytest.approx(want["l"], rel=1e-5)
        assert number_after_equals(r["alpha"]) == pytest.approx(want["alpha"], rel=1e-5, abs=1e-12)
        assert int(text(r["rescales"]).rsplit(":", 1)[1]) == want["rescales"]
        assert int(text(r["scores_in_memory"]).rsplit(":", 1)[1]) == b - a
        err = number_after_equals(r["max_error"])
        if t < n:
            assert err == pytest.approx(want["error"], rel=1e-5)
        else:
            assert err <= 1e-12 and want["error"] <= 1e-12
        # the table lists the tiles so far (at most 12), the current one last
        assert st.table.value.count("<tr") == 1 + min(t, 12) + (t > 12)
        assert bytes(st.image.value).startswith(b"\x89PNG")
    return rt, errors


@pytest.fixture(scope="module")
def real_qkv():
    return make_case("real")


def test_format_value():
    assert format_value(16384) == "16,384"
    assert format_value(np.int64(7)) == "7"
    assert format_value(0.0312456789) == "0.0312457"
    assert format_value(np.float64(1.1102230246251565e-16)) == "1.11022e-16"
    assert format_value(-np.inf) == "-inf"
    for bad in (True, "1", None, np.array([1.0])):
        with pytest.raises(TypeError, match="real number"):
            format_value(bad)


def test_real_sample_every_step_and_error_only_vanishes_at_the_last_tile(real_qkv):
    st = TileStepper()
    assert (st.data.value, st.tile_size.value, st.row.value) == ("real", 16, DEFAULT_ROWS["real"])
    assert (st.layer.value, st.head.value) == (0, 0) and not st.layer.disabled
    assert (st.row.max, st.tile_size.max, st.layer.max, st.head.max) == (127, 128, 5, 11)
    assert "application/vnd.jupyter.widget-view+json" in st._repr_mimebundle_()
    q, k, v = real_qkv
    rt, errors = check_every_step(st, q, k, v, DEFAULT_ROWS["real"], 16)
    assert errors[-1] <= 1e-12 and (errors[:-1] > 1e-6).all()
    assert "last tile" in st.caption.value
    pictures = set()                           # every step draws a different picture
    for t in range(1, st.slider.max + 1):
        st.slider.value = t
        pictures.add(bytes(st.image.value))
    assert len(pictures) == st.slider.max


@pytest.mark.parametrize("tile", [5, 128, 1])
def test_changing_the_tile_size_reslices(real_qkv, tile):
    st = TileStepper()
    st.slider.value = 4                                  # 64 keys absorbed with tiles of 16
    st.tile_size.value = tile
    n = -(-128 // tile)
    assert st.slider.max == st.play.max == n == len(st.row_trace)
    # the place is kept: the first step that has seen the same 64 keys
    assert st.slider.value == min(n, -(-64 // tile))
    q, k, v = real_qkv
    steps = sorted({1, 2, n - 1, n} - {0}) if n > 2 else None
    check_every_step(st, q, k, v, DEFAULT_ROWS["real"], tile, steps)


def test_other_rows_layers_and_heads(real_qkv):
    st = TileStepper(tile=32)
    q, k, v = real_qkv
    for row in (0, 127):
        st.row.value = row
        check_every_step(st, q, k, v, row, 32, steps=[1, 4])
    st.layer.value, st.head.value = 2, 3
    q2, k2, v2 = make_case("real", layer=2, head=3)
    rt, errors = check_every_step(st, q2, k2, v2, 127, 32, steps=[1, 3, 4])
    assert errors[-1] <= 1e-12 and (errors[:-1] > 1e-6).all()


@pytest.mark.parametrize("kind, tile, steps", [("random", 16, None), ("late-max", 16, None),
                                               ("late-max", 8, [1, 7, 8])])
def test_synthetic_data_choices(kind, tile, steps):
    st = TileStepper(tile=tile)
    st.data.value = kind
    assert st.row.value == DEFAULT_ROWS[kind] and st.slider.value == 1
    assert st.layer.disabled and st.head.disabled
    q, k, v = make_case(kind, tile=tile)
    rt, errors = check_every_step(st, q, k, v, DEFAULT_ROWS[kind], tile, steps)
    if kind == "late-max":
        # the case's point: the max moves only in the last tile, by alpha = exp(1 - 4)
        assert list(rt.rescaled) == [False] * (len(rt) - 1) + [True]
        assert format_value(math.exp(1.0 - 4.0)) in text(st.readouts["alpha"])
        assert "new max" in st.caption.value
    st.data.value = "real"
    assert not st.layer.disabled and st.row.value == DEFAULT_ROWS["real"]


@pytest.mark.parametrize("tile", [64, 70])
def test_late_max_works_at_a_large_tile(tile):
    # make_case builds max(64, 2 * tile) keys for it: two tiles, the max moves in the second.
    st = TileStepper(tile=tile)
    st.data.value = "late-max"
    assert st.data.value == "late-max" and st.tile_size.value == tile
    q, k, v = make_case("late-max", tile=tile)
    assert q.shape[0] == 2 * tile
    rt, _ = check_every_step(st, q, k, v, 0, tile)
    assert list(rt.rescaled) == [False, True]
    assert format_value(math.exp(1.0 - 4.0)) in text(st.readouts["alpha"])
    st = TileStepper(kind="late-max", tile=8)
    st.tile_size.value = 64                              # also when the tile grows on late-max data
    assert st.tile_size.value == 64 and st.slider.max == 2 and "Kept" not in st.caption.value


def test_a_tile_size_the_data_cannot_use_is_refused_and_kept():
    def make(kind, *, tile, **kw):
        if tile > 10:
            raise ValueError(f"tile must be at most 10 for this data, got {tile}")
        return tuple(np.random.default_rng(1).standard_normal((40, 4)) for _ in range(3))
    st = TileStepper(make, kind="toy", choices=[("toy", "toy")], tile=8)
    st.tile_size.value = 20
    assert st.tile_size.value == 8 and st.slider.max == 5
    assert "Kept keys per tile = 8" in text(st.caption) and "at most 10" in st.caption.value


def test_fully_masked_row_captions_describe_the_empty_state(real_qkv):
    q, k, v = real_qkv
    mask = np.ones((128, 128), dtype=bool)
    mask[3] = False                                      # row 3 sees nothing
    mask[5, :40] = False                                 # row 5 sees keys 40.. only: tiles 1, 2 are empty
    st = TileStepper(options={"mask": mask}, row=3)
    _, trace = flash_attention(q, k, v, 16, mask=mask, return_trace=True)
    rt = trace.row(3)
    assert st.slider.max == len(rt) == 8 and (rt.l == 0).all() and np.isneginf(rt.m).all()
    for t in range(1, 9):
        st.slider.value = t
        cap = text(st.caption)
        assert "nothing visible yet" in cap and "m = -inf, l = 0" in cap
        assert "start from it" not in cap and "α = 1" not in cap
        assert number_after_equals(st.readouts["alpha"]) == rt.alpha[t - 1] == 0.0
    assert "no visible key, so its output is 0" in cap and "exact output" not in cap
    st.row.value = 5
    rt = trace.row(5)
    st.slider.value = 1
    assert "nothing visible yet" in text(st.caption)
    st.slider.value = 3                                  # keys 32-47: 40.. are the first visible ones
    cap = text(st.caption)
    assert rt.l[1] == 0 < rt.l[2] and "first visible keys" in cap and "nothing visible" not in cap
    st.slider.value = 8
    assert "exact output" in text(st.caption)


def test_module_docstring_example_runs():
    import doctest

    import lessons.views.stepper as module
    finder = doctest.DocTestFinder(recurse=False)
    (test,) = finder.find(module, "lessons.views.stepper", globs=dict(vars(module)))
    assert len(test.examples) == 4                       # two imports and the two steppers
    result = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS).run(test)
    assert result.failed == 0 and result.attempted == 4


def test_reusable_with_another_data_source_and_options():
    rng = np.random.default_rng(5)
    qkv = tuple(rng.standard_normal((40, 6)) for _ in range(3))
    st = TileStepper(lambda kind, **kw: qkv, kind="toy", choices=[("toy", "toy")], tile=8, row=3,
                     options={"causal": True})
    q, k, v = qkv
    _, trace = flash_attention(q, k, v, 8, causal=True, return_trace=True)
    rt = trace.row(3)
    assert st.slider.max == len(rt) and st.layer.disabled
    st.slider.value = len(rt)
    exact = attention(q, k, v, causal=True)[3]
    assert format_value(rt.errors(exact)[-1]) in text(st.readouts["max_error"])
    assert number_after_equals(st.readouts["max_error"]) <= 1e-12


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(kind="nope"), ValueError, "kind"),
    (dict(tile=0), ValueError, "tile"),
    (dict(tile=2.5), TypeError, "tile"),
    (dict(row=128), ValueError, "row"),
    (dict(layer=6), ValueError, "layer"),
])
def test_bad_arguments(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        TileStepper(**kwargs)


# ---------------------------------------------------------------------------
# the kernel's own trace, replayed beside NumPy's
# ---------------------------------------------------------------------------

def _perturbed_kernel(step, factor):
    """A stand-in kernel: NumPy's own trace of the row, with l scaled at one step."""
    from lessons.gpu import GpuRowTrace

    def kernel(q, k, v, tile, row, **options):
        rt = flash_attention(q, k, v, tile, return_trace=True, **options)[1].row(row)
        l = np.array(rt.l, dtype=np.float64)
        l[step] *= factor
        return "stand-in", GpuRowTrace((row,), np.asarray(rt.tile), np.asarray(rt.m), np.asarray(rt.alpha), l)
    return kernel


def test_the_kernel_trace_is_shown_beside_numpy_and_the_first_divergence_named():
    stepper = TileStepper(kind="real", row=93, tile=16, kernel=_perturbed_kernel(2, 1.01))
    assert stepper.divergence.step == 2 and stepper.divergence.quantity == "l"
    assert "stand-in trace" in stepper.readouts["kernel"].value
    assert "tile 3 (step 3): l differs" in stepper.readouts["kernel"].value
    stepper.slider.value = 4
    html = stepper.table.value
    assert "l kernel" in html and html.count("color:#b00;font-weight:bold;") == 1      # l of tile 3, only
    assert format_value(float(stepper.kernel_row.l[2])) in html
    # agreeing within rounding: no divergence, nothing marked
    stepper = TileStepper(kind="real", row=93, tile=16, kernel=_perturbed_kernel(2, 1 + 1e-7))
    assert stepper.divergence is None and "first divergence: none" in stepper.readouts["kernel"].value
    assert stepper.kernel_where == "stand-in"


def test_a_kernel_that_cannot_run_is_reported_and_the_stepper_still_works():
    def broken(*args, **kwargs):
        raise ValueError("block_k must be a multiple of 2")

    stepper = TileStepper(kind="real", row=93, tile=16, kernel=broken)
    assert "not run (ValueError: block_k must be a multiple of 2)" in stepper.readouts["kernel"].value
    assert stepper.kernel_row is None and stepper.kernel_where is None and "m kernel" not in stepper.table.value
    stepper.slider.value = 3
    assert stepper.readouts["tile"].value.endswith("3 of 8")
    with pytest.raises(TypeError, match="kernel must be a callable"):
        TileStepper(kind="real", kernel=3)


@pytest.mark.skipif(not emulator_available(), reason="no C++ compiler (g++) for the CPU emulation")
def test_the_forward_kernels_trace_agrees_with_numpy_tile_by_tile():
    from lessons.gpu import kernel_row_trace

    stepper = TileStepper(kind="real", row=93, tile=16, kernel=kernel_row_trace)
    assert stepper.divergence is None, stepper.divergence
    assert stepper.kernel_where == "emulator"
    rt, kr = stepper.row_trace, stepper.kernel_row
    assert len(kr) == len(rt) == 8
    np.testing.assert_allclose(kr.l, rt.l, rtol=1e-5)
    stepper.tile_size.value = 7                     # odd tiles: the kernel takes them with block_q = 128
    assert stepper.divergence is None and len(stepper.kernel_row) == len(stepper.row_trace) == 19


def test_causal_stepper_legend_stays_inside_the_figure():
    """With "skipped" tiles the legend has five entries; none may run off the picture."""
    from lessons.schedules.causal import block_schedule
    from lessons.views.stepper import TileStepper

    s = TileStepper(kind="real", row=93, tile=16, schedule=block_schedule(16), options={"causal": True})
    fig = s._figure.figure
    fig.canvas.draw()
    legend = s._figure.ax_scores.get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert "skipped (fully masked)" in labels and "running max m" in labels
    box, page = legend.get_window_extent(), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1, (box, page)


def test_paged_stepper_shows_the_block_table_and_the_page_of_the_step():
    from lessons.course.data import make_case
    from lessons.schedules.paged import paged_schedule
    from lessons.views.stepper import TileStepper

    s = TileStepper(kind="real", row=93, tile=16, schedule=paged_schedule)
    q, k, v = make_case("real", layer=0, head=0)
    table = paged_schedule(q, k, v, 16).block_table                   # the same shuffled pool (seed 0)
    assert s.paged and len(table) == 8
    for step in (1, 3, 8):
        s.slider.value = step
        text = re.sub(r"<[^>]+>", "", s.readouts["page"].value)
        assert text == f"logical block {step - 1} → physical page {int(table[step - 1])}"
        cells = re.findall(r"<td style='padding:0 5px;text-align:center;([^']*)'><div[^>]*>(\d+)</div>"
                           r"<div data-page='(\d+)'>", s.readouts["block_table"].value)
        assert [int(i) for _, i, _ in cells] == list(range(len(table)))
        cells = [(style, page) for style, _, page in cells]
        assert [int(c) for _, c in cells] == [int(p) for p in table]
        assert [i for i, (style, _) in enumerate(cells) if "background" in style] == [step - 1]
    state = s.widget.children[2]                                       # the state row holds the page
    assert s.readouts["page"] in state.children
    plain = TileStepper(kind="random", row=0, tile=32)
    assert not plain.paged and "page" not in plain.readouts and "block_table" not in plain.readouts


def test_changing_row_head_or_layer_keeps_the_tile_clamped():
    from lessons.views.stepper import TileStepper

    s = TileStepper(kind="real", row=93, tile=16)
    s.slider.value = 5
    s.row.value = 10
    assert s.slider.value == 5 and s.play.value == 5
    s.head.value = 3
    assert s.slider.value == 5
    s.layer.value = 2
    assert s.slider.value == 5
    s.tile_size.value = 64                                             # 2 tiles now: clamped to what exists
    assert s.slider.max == 2 and s.slider.value == 2


def test_the_stepper_shell_links_play_to_the_slider_and_renders_each_step():
    from lessons.views.causal import BlockStepper
    from lessons.views.stepper import READOUT_CARD, StepperShell, step_controls

    slider, play = step_controls(5, 9, label="steps", interval=300)
    assert (slider.value, slider.min, slider.max, play.value, play.max, play.interval) == (5, 1, 5, 5, 5, 300)
    assert step_controls(5, -2, label="steps")[0].value == 1

    class Counting(StepperShell):
        def __init__(self):
            self.seen = []
            self._build_shell(4, step=2, label="steps", readouts=("a", "b"), table_width="100px", interval=500)

        def _render(self):
            self.seen.append(self.slider.value)
            self.readouts["a"].value = f"step {self.slider.value}"

    s = Counting()
    s.slider.value = 4
    assert s.seen == [2, 4] and s.readouts["a"].value == "step 4"
    assert s.readouts["b"].layout.border == READOUT_CARD["border"]
    controls, cards, body = s.widget.children
    assert list(controls.children) == [s.play, s.slider] and list(body.children) == [s.image, s.table]
    assert list(cards.children) == list(s.readouts.values())
    assert "application/vnd.jupyter.widget-view+json" in s._repr_mimebundle_()
    assert issubclass(BlockStepper, StepperShell)
