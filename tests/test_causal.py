"""The FA-2 tile schedule against a brute-force mask, and the NaN trap with its two fixes."""
import itertools
import warnings

import numpy as np
import pytest

from lessons import attention, flash_attention
from lessons.schedules.causal import (DIAGONAL, FULL, SKIPPED, causal_mask, count_tiles, masked_rows_report,
                            padded_causal_case, tile_schedule)

SIZES = [(8, 8, 2, 2), (8, 8, 3, 2), (7, 11, 2, 3), (11, 7, 3, 2), (16, 16, 4, 4), (5, 9, 5, 1),
         (9, 4, 2, 4), (1, 6, 1, 2), (6, 1, 4, 1), (13, 13, 16, 16)]


def brute_kind(mask_block):
    if not mask_block.any():
        return SKIPPED
    return FULL if mask_block.all() else DIAGONAL


def test_causal_mask_is_bottom_right_and_matches_the_reference():
    m = causal_mask(3, 5)                  # query i sees keys j <= i + 2
    np.testing.assert_array_equal(m, [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((6, 3)), rng.standard_normal((9, 3)), rng.standard_normal((9, 2))
    np.testing.assert_array_equal(attention(q, k, v, causal=True), attention(q, k, v, mask=causal_mask(6, 9)))


@pytest.mark.parametrize("nq, nk, bq, bk", SIZES)
def test_every_tile_is_classified_as_the_mask_says(nq, nk, bq, bk):
    mask = causal_mask(nq, nk)
    visits = tile_schedule(nq, nk, bq, bk)
    assert len(visits) == -(-nq // bq) * -(-nk // bk)
    covered = np.zeros((nq, nk), int)
    for t in visits:
        block = mask[t.row_start:t.row_stop, t.key_start:t.key_stop]
        assert t.kind == brute_kind(block), t
        covered[t.row_start:t.row_stop, t.key_start:t.key_stop] += 1
    np.testing.assert_array_equal(covered, 1)          # the tiles partition the score matrix
    counts = count_tiles(nq, nk, bq, bk)
    brute_skipped = sum(not mask[r:r + bq, c:c + bk].any()
                        for r, c in itertools.product(range(0, nq, bq), range(0, nk, bk)))
    assert counts.skipped == brute_skipped
    assert counts.full + counts.diagonal + counts.skipped == counts.total == len(visits)
    assert counts.visible_scores == mask.sum() <= counts.computed_scores


@pytest.mark.parametrize("nq, nk, bq, bk", SIZES)
def test_visit_order_is_the_order_flash_attention_absorbs(nq, nk, bq, bk):
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((nq, 4)), rng.standard_normal((nk, 4)), rng.standard_normal((nk, 3))
    for causal in (True, False):
        _, trace = flash_attention(q, k, v, bk, block_q=bq, causal=causal, return_trace=True)
        computed = [t for t in tile_schedule(nq, nk, bq, bk, causal) if t.computed]
        assert [(s.row_start, s.key_start, s.key_stop) for s in trace.steps] == \
               [(t.row_start, t.key_start, t.key_stop) for t in computed]
        assert [t.step for t in computed] == list(range(len(computed)))
        assert [t.order for t in tile_schedule(nq, nk, bq, bk, causal)] == list(range(len(tile_schedule(nq, nk, bq, bk))))


def test_square_closed_form():
    # N = T * B with square B x B tiles: T diagonal tiles, T(T-1)/2 skipped, T(T-1)/2 full
    for T, B in [(1, 4), (2, 3), (5, 2), (8, 16)]:
        c = count_tiles(T * B, T * B, B, B)
        assert (c.diagonal, c.skipped, c.full) == (T, T * (T - 1) // 2, T * (T - 1) // 2)
        assert c.skipped_fraction == pytest.approx((T - 1) / (2 * T))


def test_counting_a_long_sequence_never_builds_the_mask():
    """N = 32768 in 1024-key tiles: 1024 tiles to count, while the (N, N) mask alone would be 1 GiB."""
    import tracemalloc

    n = 32768
    tracemalloc.start()
    try:
        c = count_tiles(n, n, 1024, 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert c.visible_scores == n * (n + 1) // 2 and (c.diagonal, c.skipped) == (32, 32 * 31 // 2)
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    # more queries than keys: the first Nq - Nk rows see nothing; fewer: every row sees Nk - Nq more
    assert count_tiles(9, 4, 2, 2).visible_scores == 10 == causal_mask(9, 4).sum()
    assert count_tiles(4, 9, 2, 2).visible_scores == 6 + 7 + 8 + 9 == causal_mask(4, 9).sum()


def test_non_causal_computes_every_tile():
    c = count_tiles(10, 7, 3, 2, causal=False)
    assert (c.full, c.diagonal, c.skipped) == (4 * 4, 0, 0)
    assert c.computed_scores == c.visible_scores == 70


@pytest.mark.parametrize("call, exc, word", [
    (lambda: tile_schedule(0, 4, 2, 2), ValueError, "nq"),
    (lambda: tile_schedule(4, 4.0, 2, 2), TypeError, "nk"),
    (lambda: tile_schedule(4, 4, 0, 2), ValueError, "block_q"),
    (lambda: tile_schedule(4, 4, 2, -1), ValueError, "block_k"),
    (lambda: tile_schedule(4, 4, 2, 2, causal="yes"), TypeError, "causal"),
    (lambda: causal_mask(3, 0), ValueError, "nk"),
    (lambda: padded_causal_case(n=4, pad=4), ValueError, "pad"),
])
def test_bad_input_is_refused_by_name(call, exc, word):
    with pytest.raises(exc, match=word):
        call()


# --- the NaN trap ----------------------------------------------------------------------------------

def test_rows_with_no_visible_key_give_zero_and_minus_inf_lse():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((7, 4)), rng.standard_normal((4, 4)), rng.standard_normal((4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # not even a RuntimeWarning on the way
        out, lse = flash_attention(q, k, v, 2, block_q=2, causal=True, return_lse=True)
    # Nq = 7 > Nk = 4: rows 0..2 see no key (j <= i - 3)
    assert (causal_mask(7, 4).sum(axis=1) == [0, 0, 0, 1, 2, 3, 4]).all()
    np.testing.assert_array_equal(out[:3], 0.0)
    assert np.isneginf(lse[:3]).all() and np.isfinite(lse[3:]).all()
    np.testing.assert_allclose(out, attention(q, k, v, causal=True), rtol=1e-12, atol=1e-15)


def test_padded_causal_batch_through_all_four_implementations():
    q, k, v, mask = padded_causal_case(n=8, pad=3)
    report = masked_rows_report(q, k, v, 2, causal=True, mask=mask)
    vis = (mask & causal_mask(8, 8)).sum(axis=1)
    np.testing.assert_array_equal(report.visible_keys, vis)
    np.testing.assert_array_equal(vis, [0, 0, 0, 1, 2, 3, 4, 5])
    rows = list(report.rows())
    # every row's first tile (keys 0, 1) is padding: the literal port is NaN everywhere
    assert all(r["no_guard_nan"] for r in rows)
    # the guard: equal to the reference, 0 and lse = -inf where nothing is visible
    assert all(r["guarded_ok"] for r in rows)
    np.testing.assert_array_equal(report.guarded[:3], 0.0)
    assert np.isneginf(report.lse[:3]).all()
    # the finite fix: right for rows that see a key, the plain mean of V for rows that see none
    assert [r["finite_ok"] for r in rows] == [False] * 3 + [True] * 5
    np.testing.assert_allclose(report.finite[:3], np.broadcast_to(v.mean(axis=0), (3, 2)), rtol=1e-14)
    np.testing.assert_allclose(report.reference, attention(q, k, v, causal=True, mask=mask), rtol=1e-14)


def test_no_guard_is_nan_exactly_for_rows_whose_first_tile_is_fully_masked():
    q, k, v, mask = padded_causal_case(n=8, pad=1)
    for tile in (1, 2, 3):
        report = masked_rows_report(q, k, v, tile, causal=True, mask=mask)
        vis = mask & causal_mask(8, 8)
        first_tile_empty = ~vis[:, :tile].any(axis=1)
        np.testing.assert_array_equal([r["no_guard_nan"] for r in report.rows()], first_tile_empty)
        assert all(r["guarded_ok"] for r in report.rows())


def test_masked_rows_report_refuses_a_single_query():
    with pytest.raises(ValueError, match="q must be 2-D"):
        masked_rows_report(np.zeros(3), np.zeros((2, 3)), np.zeros((2, 1)), 1)


# --- the grid picture and the block stepper draw the schedule and the trace --------------------------

def test_schedule_figure_colours_follow_the_tile_states():
    from matplotlib.colors import to_rgba
    from lessons.views.flash import TILE_COLOURS
    from lessons.views.causal import schedule_figure, tile_state
    visits = tile_schedule(12, 12, 4, 4)
    for step in (0, 1, 3, 6):
        fig = schedule_figure(visits, step)
        faces = fig.axes[0].collections[0].get_facecolors()
        expected = [to_rgba(TILE_COLOURS[tile_state(t, step)]) for t in visits]
        np.testing.assert_allclose(faces, expected)
    assert [tile_state(t, 3) for t in visits] == ["done", "skipped", "skipped", "done", "current", "skipped",
                                                  "pending", "pending", "pending"]
    with pytest.raises(ValueError, match="step"):
        schedule_figure(visits, 7)


def test_block_stepper_table_is_the_trace_of_the_current_block():
    from lessons.views.causal import BlockStepper
    from lessons.views.stepper import format_value
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((12, 4)), rng.standard_normal((12, 4)), rng.standard_normal((12, 2))
    _, trace = flash_attention(q, k, v, 4, block_q=4, causal=True, return_trace=True)
    stepper = BlockStepper(trace, tile_schedule(12, 12, 4, 4))
    assert stepper.slider.max == len(trace) == 6
    stepper.slider.value = 5                               # block rows 8..11, key tile 1
    s = trace.steps[4]
    assert (s.row_start, s.key_start) == (8, 4)
    for r in range(4):
        assert f">{format_value(float(s.m[r]))}<" in stepper.table.value
        assert f">{format_value(float(s.l[r]))}<" in stepper.table.value
    assert "tiles skipped so far: <b>3</b> of 3" in stepper.readouts["skipped"].value
    assert "4 × 4" in stepper.readouts["scores_in_sram"].value
    with pytest.raises(ValueError, match="do not match"):
        BlockStepper(trace, tile_schedule(12, 12, 4, 4, causal=False))


def test_the_grid_picture_draws_the_causal_rule_only_over_a_causal_schedule():
    """A non-causal schedule drawn with the default causal=True got the red diagonal of a mask it never had;
    causal="no" was a causal picture (any truthy value was)."""
    from lessons.views.causal import BlockStepper, schedule_figure
    plain = tile_schedule(12, 12, 4, 4, causal=False)
    with pytest.raises(ValueError, match="visits were made with causal=False: pass causal=False"):
        schedule_figure(plain, 1)
    with pytest.raises(ValueError, match="visits were made with causal=True: pass causal=True"):
        schedule_figure(tile_schedule(12, 12, 4, 4), 1, causal=False)
    with pytest.raises(TypeError, match="causal must be True or False, got str 'no'"):
        schedule_figure(plain, 1, causal="no")
    assert not schedule_figure(plain, 1, causal=False).axes[0].lines          # no diagonal drawn
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((12, 4)), rng.standard_normal((12, 4)), rng.standard_normal((12, 2))
    _, trace = flash_attention(q, k, v, 4, block_q=4, return_trace=True)
    with pytest.raises(ValueError, match="visits were made with causal=False"):
        BlockStepper(trace, plain)
    assert BlockStepper(trace, plain, causal=False).slider.max == 9
    # a schedule with no diagonal or skipped tile is drawn either way: the rule hides nothing in it
    one_row = tile_schedule(1, 12, 4, 4)
    assert {t.kind for t in one_row} == {"full"}
    schedule_figure(one_row, 1), schedule_figure(one_row, 1, causal=False)


def test_block_schedule_feeds_the_stepper_a_causal_trace():
    from lessons.schedules.causal import block_schedule
    from lessons.views.stepper import TileStepper
    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((32, 4)), rng.standard_normal((32, 4)), rng.standard_normal((32, 2))
    trace = block_schedule(8)(q, k, v, 4, causal=True)
    _, expected = flash_attention(q, k, v, 4, block_q=8, causal=True, return_trace=True)
    assert [(s.row_start, s.key_start) for s in trace.steps] == [(s.row_start, s.key_start) for s in expected.steps]
    # row 13 is in block 8..15: it absorbs key tiles 0..3 (keys 0..15), tiles 4..7 are skipped
    assert list(trace.row(13).tile) == [0, 1, 2, 3]
    stepper = TileStepper(lambda kind, **kw: (q, k, v), kind="random", tile=4, row=13,
                          schedule=block_schedule(8), options={"causal": True})
    assert stepper.slider.max == 4
    with pytest.raises(ValueError, match="block_q"):
        block_schedule(0)


def test_schedule_figure_counts_from_one_and_masks_only_computed_tiles():
    from lessons.schedules.causal import causal_mask
    from lessons.views.causal import schedule_figure
    visits = tile_schedule(12, 12, 4, 4)               # computed: (0,0) (1,0) (1,1) (2,0) (2,1) (2,2)
    fig = schedule_figure(visits, 2)                   # the 2nd computed tile is query block 2, key tile 1
    assert "step 2 of 6: query block 2, key tile 1 (full" in fig.texts[0].get_text()
    fig = schedule_figure(visits, 3)
    assert "query block 2, key tile 2 (on the diagonal" in fig.texts[0].get_text()
    mask = causal_mask(12, 12)
    for step in (0, 1, 3, 6):
        fig = schedule_figure(visits, step)
        done_diagonal = [t for t in visits if t.kind == "diagonal" and t.step is not None and t.step < step]
        expected = sum(int((~mask[t.row_start:t.row_stop, t.key_start:t.key_stop]).sum()) for t in done_diagonal)
        cells = [c for c in fig.axes[0].collections[1:] if len(c.get_paths()) and c.get_alpha() == 0.35]
        assert sum(len(c.get_paths()) for c in cells) == expected
    labels = [t for t in fig.axes[0].texts if t.get_text().isdigit()]
    assert sorted(int(t.get_text()) for t in labels) == [1, 2, 3, 4, 5, 6]
    assert all(t.get_path_effects() for t in labels)
    assert all(t.get_zorder() > 3 for t in labels)     # above the staircase and the masked cells


def test_block_state_text_is_the_trace_of_the_block():
    from lessons.views.causal import block_state_text
    from lessons.views.stepper import format_value
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((12, 4)), rng.standard_normal((12, 4)), rng.standard_normal((12, 2))
    _, trace = flash_attention(q, k, v, 4, block_q=4, causal=True, return_trace=True)
    text = block_state_text(trace, 5)
    s = trace.steps[4]                                 # rows 8..11, key tile index 1 (the 2nd tile)
    lines = text.splitlines()
    assert lines[0] == "query block rows 8-11 after key tile 2 (keys 4-7)"
    assert len(lines) == 2 + 4
    for r, line in enumerate(lines[2:]):
        assert line.split() == [str(8 + r)] + [format_value(float(x[r])) for x in (s.m_before, s.m, s.alpha, s.l)]
    with pytest.raises(ValueError, match="step"):
        block_state_text(trace, 0)
    with pytest.raises(TypeError, match="trace"):
        block_state_text(trace.steps, 1)
