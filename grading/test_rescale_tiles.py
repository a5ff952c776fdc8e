"""Grading: lazy rescaling, the key tiles where a block of query rows must rescale (notebook 06).

Expected values come from :func:`lessons.cost.rescale.rescale_share`, which counts the same moves
another way (from ``q`` and ``k``, for whole row blocks at once); the scores handed to the answer are
computed from the same ``q`` and ``k`` in float64 as it computes them, so both see the same values.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from _support import as_array, rng, seeds
from lessons.cost.rescale import rescale_share

EXERCISE = "rescale_tiles"
NEG = -np.inf


def assert_moves(actual, expected, what):
    """``actual`` is a bool array equal to ``expected``; the message names the tiles (from 1) that differ."""
    actual = as_array(actual, what)
    expected = np.asarray(expected, dtype=bool)
    assert actual.shape == expected.shape, (
        f"{what}: shape {actual.shape}, expected {expected.shape} (one entry per key tile, the last short "
        f"one included)")
    wrong = [int(t) + 1 for t in np.flatnonzero(actual != expected)]
    assert not wrong, (f"{what}: wrong at tile(s) {wrong} (counted from 1): got {actual.astype(bool).tolist()}, "
                       f"expected {expected.tolist()}")


def scores_and_expected(q, k, block_k, scale, causal=False):
    """The scores ``(q * scale) @ k.T`` (``-inf`` where the causal rule hides a key) and, from
    :func:`rescale_share` with the whole block as one row block, the tiles that rescale."""
    s = (q * scale) @ k.T
    nq, nk = s.shape
    if causal:
        s[np.arange(nk)[None, :] > np.arange(nq)[:, None] + nk - nq] = -np.inf
    count = rescale_share(q, k, block_rows=nq, block_k=block_k, scale=scale, causal=causal)
    return s, count.moved[0]


@pytest.mark.hint("return a NumPy bool array with one entry per key tile: shape (ceil(Nk / block_k),)")
def test_one_bool_per_tile(answer):
    s = rng(1).standard_normal((16, 128))
    moved = answer.rescale_tiles(s, 16)
    assert np.asarray(moved).dtype == np.bool_, f"got dtype {np.asarray(moved).dtype}, expected bool"
    assert np.asarray(moved).shape == (8,), f"128 keys in tiles of 16: 8 tiles, got shape {np.asarray(moved).shape}"


@pytest.mark.catches("one_max_per_block", "last_partial_tile_dropped")
@pytest.mark.hint("a tile is True when at least one row's running max strictly grew there "
                  "(compare with lessons.cost.rescale.rescale_share)")
@given(seed=seeds, r=st.integers(1, 20), nk=st.integers(1, 150), block_k=st.integers(1, 40), d=st.integers(1, 8))
def test_random_scores_match_rescale_share(answer, seed, r, nk, block_k, d):
    g = rng(seed)
    q, k = g.standard_normal((r, d)), g.standard_normal((nk, d))
    s, expected = scores_and_expected(q, k, block_k, 1 / np.sqrt(d))
    assert_moves(answer.rescale_tiles(s, block_k), expected,
                 f"{r} rows, {nk} keys, tiles of {block_k}")


@pytest.mark.catches("tie_counted_as_move", "one_max_per_block", "last_partial_tile_dropped")
@pytest.mark.hint("a score equal to the running max is no move; a larger one is")
@given(seed=seeds, r=st.integers(1, 16), nk=st.integers(1, 60), block_k=st.integers(1, 12))
def test_whole_number_scores_with_ties_match_rescale_share(answer, seed, r, nk, block_k):
    """q and k of small whole numbers, scale 1: whole-number scores, so many scores tie."""
    g = rng(seed)
    q, k = (g.integers(-2, 3, size=(n, 2)).astype(np.float64) for n in (r, nk))
    s, expected = scores_and_expected(q, k, block_k, 1.0)
    assert_moves(answer.rescale_tiles(s, block_k), expected,
                 f"{r} rows, {nk} keys of whole-number scores (many ties), tiles of {block_k}")


@pytest.mark.catches("nan_alpha_counted_as_move", "tie_counted_as_move", "one_max_per_block",
                     "last_partial_tile_dropped")
@pytest.mark.hint("a masked score (-inf) never moves a max; a row's first finite score does")
@given(seed=seeds, r=st.integers(1, 40), nk=st.integers(1, 40), block_k=st.integers(1, 8))
def test_causal_masked_scores_match_rescale_share(answer, seed, r, nk, block_k):
    """The bottom-right causal rule: row i sees key j iff j <= i + Nk - R; with R > Nk the first
    rows see no key at all, and many rows see nothing in the last tiles."""
    g = rng(seed)
    q, k = g.standard_normal((r, 4)), g.standard_normal((nk, 4))
    s, expected = scores_and_expected(q, k, block_k, 0.5, causal=True)
    assert_moves(answer.rescale_tiles(s, block_k), expected,
                 f"{r} rows, {nk} keys, causal, tiles of {block_k}")


@pytest.mark.catches("tie_counted_as_move")
def test_a_tie_with_the_running_max_is_no_move(answer):
    s = np.array([[3.0, 1.0, 3.0, 2.0, 1.0, 3.0]])           # tiles of 2: [3, 1], [3, 2], [1, 3]
    assert_moves(answer.rescale_tiles(s, 2), [True, False, False],
                 "one row [3, 1 | 3, 2 | 1, 3]: only tile 1 raises its max (3 again is a tie)")


# A tie counted as a move also counts -inf -> -inf as one (-inf >= -inf), so no check can fail for
# the NaN alpha alone: this one names both, and the check of ties above tells them apart. Its tiles
# are all whole (the short last tile has its own check), so no other mistake fails it.
@pytest.mark.catches("nan_alpha_counted_as_move", "tie_counted_as_move")
def test_a_row_that_has_seen_only_masked_keys_does_not_move(answer):
    s = np.array([[NEG, NEG, NEG, NEG, 5.0, 1.0],            # sees its first key in tile 3: a move
                  [4.0, 2.0, 1.0, 3.0, 0.0, 1.0],            # moves in tile 1 only
                  [NEG, NEG, NEG, NEG, NEG, NEG]])           # sees no key: never moves
    assert_moves(answer.rescale_tiles(s, 2), [True, False, True],
                 "rows [-inf, -inf | -inf, -inf | 5, 1], [4, 2 | 1, 3 | 0, 1], all -inf")
    assert_moves(answer.rescale_tiles(np.full((2, 6), NEG), 2), [False, False, False],
                 "two rows of only -inf (6 keys, tiles of 2)")


@pytest.mark.catches("one_max_per_block")
def test_a_row_growing_below_a_larger_row_still_moves(answer):
    s = np.array([[9.0, 0.0, 1.0, 0.0, 2.0, 1.0, 3.0, 0.0],   # its max, 9, is in tile 1
                  [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])  # its own max grows at every tile
    assert_moves(answer.rescale_tiles(s, 2), [True, True, True, True],
                 "row 2 grows at every tile, though row 1's 9 is larger than all of it")


@pytest.mark.catches("last_partial_tile_dropped")
def test_the_last_short_tile_counts(answer):
    s = np.array([[1.0, 0.0, 2.0, 0.0, 1.0, 0.0, 5.0]])      # tiles of 3: [1, 0, 2], [0, 1, 0], [5]
    assert_moves(answer.rescale_tiles(s, 3), [True, False, True],
                 "one row [1, 0, 2 | 0, 1, 0 | 5]: the short last tile raises the max")
    assert_moves(answer.rescale_tiles(s, 10), [True], "7 keys in tiles of 10: one short tile")
