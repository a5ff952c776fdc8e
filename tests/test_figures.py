"""The step pictures show what the trace recorded: tile colours, o / l, errors, running max."""
import io

import numpy as np
import PIL.Image
import pytest
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from lessons import attention, flash_attention
from lessons.course.data import make_case
from lessons.views.flash import (TILE_COLOURS, StepFigure, final_step_figure, key_row_figure, step_figure,
                             tile_spans, tile_states)

ROW = 93


@pytest.fixture(scope="module")
def real():
    q, k, v = make_case("real")
    _, trace = flash_attention(q, k, v, 16, return_trace=True)
    return q, k, v, trace, attention(q, k, v)


def expected_state(t, step):
    """Hand rule for a schedule that absorbs tiles 0, 1, 2, ... in order."""
    return "done" if t < step - 1 else ("current" if t == step - 1 else "pending")


def prefix_output(q_row, k, v, stop):
    """What o / l must be after the keys [0, stop): textbook attention over that prefix."""
    return attention(q_row, k[:stop], v[:stop])


@pytest.mark.parametrize("tile, n_tiles, last", [(16, 8, (112, 128)), (5, 26, (125, 128)),
                                                 (1, 128, (127, 128)), (128, 1, (0, 128))])
def test_tile_spans_cover_every_key_once(real, tile, n_tiles, last):
    q, k, v, _, _ = real
    _, trace = flash_attention(q, k, v, tile, return_trace=True)
    spans = tile_spans(trace.row(0))
    assert len(spans) == n_tiles == -(-128 // tile)
    assert spans[-1][1:] == last
    assert [t for t, _, _ in spans] == list(range(n_tiles))
    assert all(spans[i][2] == spans[i + 1][1] for i in range(n_tiles - 1)) and spans[0][1] == 0


def test_tile_states_follow_the_step(real):
    *_, trace, _ = real
    rt = trace.row(ROW)
    for step in range(len(rt) + 1):
        assert tile_states(rt, step) == [expected_state(t, step) for t in range(8)]


def test_key_row_colours_match_the_state_at_every_step(real):
    *_, trace, exact = real
    rt = trace.row(ROW)
    fig = StepFigure(rt, exact[ROW], 0)
    for step in range(len(rt) + 1):
        fig.show(step)
        colours = fig.tiles.get_facecolors()
        assert colours.shape == (8, 4)
        for t in range(8):
            assert np.allclose(colours[t], to_rgba(TILE_COLOURS[expected_state(t, step)])), (step, t)
        # exactly one tile in SRAM after the first absorb, none before
        in_sram = [np.allclose(c, to_rgba(TILE_COLOURS["current"])) for c in colours]
        assert sum(in_sram) == (1 if step else 0)


def test_the_three_colours_are_distinct():
    rgba = {to_rgba(TILE_COLOURS[s]) for s in ("pending", "current", "done")}
    assert len(rgba) == 3


def test_output_markers_are_the_prefix_softmax_and_end_on_the_exact_answer(real):
    q, k, v, trace, exact = real
    rt = trace.row(ROW)
    fig = StepFigure(rt, exact[ROW], 1)
    for step in range(1, len(rt) + 1):
        fig.show(step)
        y = np.asarray(fig.out_dots.get_ydata())
        stop = int(rt.key_stop[step - 1])
        np.testing.assert_allclose(y, prefix_output(q[ROW], k, v, stop), rtol=0, atol=1e-12)
        if step < len(rt):
            assert np.abs(y - exact[ROW]).max() > 1e-6       # wrong before the last tile
    np.testing.assert_allclose(fig.out_dots.get_ydata(), exact[ROW], rtol=0, atol=1e-12)


def test_error_curve_and_running_max_are_the_prefix_values(real):
    q, k, v, trace, exact = real
    rt = trace.row(ROW)
    scores = (q[ROW] @ k.T) / np.sqrt(q.shape[1])            # one row of S, computed directly
    fig = StepFigure(rt, exact[ROW], 0)
    for step in range(1, len(rt) + 1):
        fig.show(step)
        x, err = fig.err_line.get_data()
        assert list(x) == list(range(1, step + 1))
        want = [np.abs(prefix_output(q[ROW], k, v, int(rt.key_stop[i])) - exact[ROW]).max() for i in range(step)]
        np.testing.assert_allclose(err[:-1], want[:-1], rtol=1e-9)
        assert err[-1] <= max(want[-1], 1e-18) * 1.01 + 1e-15
        xs, ms = fig.max_line.get_data()
        assert xs[-1] == rt.key_stop[step - 1]
        stops = [int(s) for s in rt.key_stop[:step]]
        assert np.allclose(ms[1::2], [scores[:s].max() for s in stops], rtol=0, atol=1e-12)


def test_bars_show_only_scores_already_computed(real):
    *_, trace, exact = real
    rt = trace.row(ROW)
    fig = StepFigure(rt, exact[ROW], 3)
    alpha = fig.bars.get_facecolors()[:, 3]
    assert (alpha[:48] > 0).all() and (alpha[48:] == 0).all()
    assert np.allclose(fig.bars.get_facecolors()[32:48], to_rgba(TILE_COLOURS["current"]))


def test_final_step_figure_is_the_last_step(real):
    *_, trace, exact = real
    fig = final_step_figure(trace.row(ROW), exact[ROW])
    assert isinstance(fig, Figure)
    assert "tile 8 of 8" in fig.texts[0].get_text()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue().startswith(b"\x89PNG")


def test_png_blitting_gives_the_same_pixels_as_a_fresh_figure(real):
    *_, trace, exact = real
    rt = trace.row(ROW)
    moving = StepFigure(rt, exact[ROW], 1, titles=False)
    for step in (1, 5):
        moving.show(step)
        moving.png()
    for step in (8, 3):                    # after moving forward, then back
        moving.show(step)
        got = np.asarray(PIL.Image.open(io.BytesIO(moving.png())))
        fresh = np.asarray(PIL.Image.open(io.BytesIO(StepFigure(rt, exact[ROW], step, titles=False).png())))
        assert got.shape == fresh.shape == (int(5.7 * 80), 800, 3)
        assert np.array_equal(got, fresh), step


def test_skipped_tiles_of_a_causal_schedule_are_marked(real):
    q, k, v, _, _ = real
    _, trace = flash_attention(q, k, v, 16, block_q=16, causal=True, return_trace=True)
    rt = trace.row(40)                      # sees keys 0..40: tiles 0, 1, 2; tiles 3..7 never loaded
    assert list(rt.tile) == [0, 1, 2]
    assert tile_states(rt, 2) == ["done", "current", "pending"] + ["skipped"] * 5
    fig = StepFigure(rt, attention(q, k, v, causal=True)[40], 2)
    colours = fig.tiles.get_facecolors()
    assert np.allclose(colours[3:], to_rgba(TILE_COLOURS["skipped"]))
    assert any(c.get_hatch() == "////" for c in fig.ax_keys.collections)


def test_key_row_figure_colours(real):
    *_, trace, _ = real
    rt = trace.row(ROW)
    fig = key_row_figure(rt, 3)
    colours = fig.axes[0].collections[0].get_facecolors()
    assert [tuple(c) for c in colours] == [to_rgba(TILE_COLOURS[expected_state(t, 3)]) for t in range(8)]
    assert isinstance(step_figure(rt, np.zeros(32), 0), Figure)


def test_bad_input_is_refused(real):
    *_, trace, exact = real
    rt = trace.row(ROW)
    with pytest.raises(ValueError, match="step must be in 0..8"):
        tile_states(rt, 9)
    with pytest.raises(ValueError, match="step"):
        StepFigure(rt, exact[ROW], -1)
    with pytest.raises(TypeError, match="step must be an int"):
        tile_states(rt, 1.5)
    with pytest.raises(ValueError, match=r"exact must have shape \(32,\)"):
        StepFigure(rt, exact)
    with pytest.raises(TypeError, match="row_trace must be"):
        final_step_figure(trace, exact[ROW])


def test_score_lanes_follow_the_mma_c_layout_by_hand():
    from lessons.views.gpu import mma_fragment_figure, score_lanes

    lanes = score_lanes(16)
    # PTX ISA: lane 4g + t holds C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1] of each 16x8 result
    assert lanes[0, 0] == lanes[0, 1] == lanes[8, 0] == lanes[8, 1] == 0
    assert lanes[1, 2] == lanes[1, 3] == lanes[9, 2] == lanes[9, 3] == lanes[1, 10] == 5
    assert lanes[15, 15] == 31 and lanes[7, 6] == 31
    # every lane holds 4 scores of each 16x8 tile; a row is held by the 4 lanes of one quad
    assert np.all(np.bincount(lanes[:, :8].ravel(), minlength=32) == 4)
    assert all(set(lanes[r]) == set(range(4 * (r % 8), 4 * (r % 8) + 4)) for r in range(16))
    with pytest.raises(ValueError, match="keys must be a positive multiple of 8"):
        score_lanes(12)
    fig = mma_fragment_figure(highlight_lane=5)
    assert "Lane 5 (outlined) holds rows 1 and 9" in fig.axes[0].get_title()
    with pytest.raises(ValueError, match="highlight_lane"):
        mma_fragment_figure(highlight_lane=32)
