"""Grading: online softmax (notebook 01), 1-D and row-wise."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from _support import assert_close, no_nan, normal, seeds, softmax_reference

EXERCISE = "online_softmax"


class ReadOnce:
    """An iterable of tiles that fails loudly if it is read a second time."""

    def __init__(self, tiles):
        self.tiles, self.used = list(tiles), False

    def __iter__(self):
        assert not self.used, "the tiles were read twice: online_max_sum must make one pass"
        self.used = True
        return iter(self.tiles)


def tiles_1d(x, tile):
    return ReadOnce(x[a:a + tile] for a in range(0, len(x), tile))


def tiles_2d(x, tile):
    return ReadOnce(x[:, a:a + tile] for a in range(0, x.shape[1], tile))


def expected(x):
    """(m, l) through the textbook reference: m = max, l = exp(lse - m)."""
    x2 = np.atleast_2d(x)
    _, lse = softmax_reference(x2)
    m = x2.max(axis=1)
    l = np.where(np.isfinite(m), np.exp(lse - np.where(np.isfinite(m), m, 0.0)), 0.0)
    return m, l


@pytest.mark.catches("alpha_missing_on_l")
@given(seed=seeds, n=st.integers(1, 40), tile=st.integers(1, 12))
def test_max_and_sum_match_the_reference(answer, seed, n, tile):
    x = normal(seed, n, scale=3.0)
    m, l = answer.online_max_sum(tiles_1d(x, tile))
    m_ref, l_ref = expected(x)
    assert_close(m, m_ref[0], "m (the max)")
    assert_close(l, l_ref[0], "l (the sum of exp(x - m))")


@pytest.mark.catches("alpha_missing_on_l")
def test_rising_scores(answer):
    """Every tile raises the max, so every tile needs the correction alpha."""
    x = np.arange(12, dtype=np.float64)          # 0, 1, ..., 11: the max moves at every tile
    m, l = answer.online_max_sum(tiles_1d(x, 3))
    assert_close(m, 11.0, "m")
    assert_close(l, np.exp(x - 11.0).sum(), "l for scores 0..11 in tiles of 3")


@pytest.mark.hint("read the tiles once (they may come from a generator) and keep only m and l between them")
def test_one_pass_over_a_generator(answer):
    x = np.sort(normal(3, 17))[::-1].copy()           # the max comes first: only the one pass is tested
    m, l = answer.online_max_sum(x[a:a + 4] for a in range(0, 17, 4))
    m_ref, l_ref = expected(x)
    assert_close(l, l_ref[0], "l from a generator of tiles")


@pytest.mark.catches("no_guard")
def test_masked_scores_and_fully_masked_tiles(answer):
    x = np.array([-np.inf, -np.inf, 2.0, -np.inf, 0.5, -np.inf, -np.inf])
    m, l = answer.online_max_sum(tiles_1d(x, 2))          # first tile fully masked
    m_ref, l_ref = expected(x)
    assert_close(m, m_ref[0], "m with masked scores")
    assert_close(l, l_ref[0], "l with a fully masked first tile")


@pytest.mark.catches("no_guard")
def test_all_masked_gives_empty_state(answer):
    m, l = answer.online_max_sum(tiles_1d(np.full(5, -np.inf), 2))
    no_nan([m, l], "(m, l) of an all -inf row")
    assert m == -np.inf and l == 0.0, f"an all -inf row should give m = -inf, l = 0, got m = {m}, l = {l}"
    m, l = answer.online_max_sum(iter([]))
    assert m == -np.inf and l == 0.0, f"no tiles at all should give m = -inf, l = 0, got m = {m}, l = {l}"


@pytest.mark.hint("the tile size must not change the answer: every tile, including a short last one, is absorbed")
@given(seed=seeds, n=st.integers(1, 30), t1=st.integers(1, 10), t2=st.integers(1, 10))
def test_tile_size_does_not_matter(answer, seed, n, t1, t2):
    x = normal(seed, n, scale=3.0)
    a = answer.online_max_sum(tiles_1d(x, t1))
    b = answer.online_max_sum(tiles_1d(x, t2))
    assert_close(a[1], b[1], f"l with tile {t1} vs tile {t2}")


@pytest.mark.catches("alpha_missing_on_l")
@given(seed=seeds, r=st.integers(1, 5), n=st.integers(1, 30), tile=st.integers(1, 9))
def test_rows_match_the_reference(answer, seed, r, n, tile):
    x = normal(seed, r, n, scale=3.0)
    m, l = answer.online_max_sum_rows(tiles_2d(x, tile))
    m_ref, l_ref = expected(x)
    assert_close(m, m_ref, "m per row")
    assert_close(l, l_ref, "l per row")


@pytest.mark.catches("no_guard")
def test_rows_all_masked(answer):
    x = np.full((3, 7), -np.inf)
    x[1, 5] = 1.0
    m, l = answer.online_max_sum_rows(tiles_2d(x, 2))
    assert_close(m, [-np.inf, 1.0, -np.inf], "m per row (rows 0 and 2 fully masked)")
    assert_close(l, [0.0, 1.0, 0.0], "l per row (rows 0 and 2 fully masked)")


@pytest.mark.hint("tiles may have different widths, even 0 columns; fold each as it comes")
def test_rows_ragged_tiles(answer):
    x = normal(5, 3, 11, scale=2.0)
    cuts = [0, 1, 1, 5, 6, 11]                           # widths 1, 0, 4, 1, 5
    m, l = answer.online_max_sum_rows(ReadOnce(x[:, a:b] for a, b in zip(cuts, cuts[1:])))
    m_ref, l_ref = expected(x)
    assert_close(l, l_ref, "l per row with ragged tiles")


@pytest.mark.catches("alpha_missing_on_l", "no_guard")
@given(seed=seeds, r=st.integers(1, 4), n=st.integers(1, 25), tile=st.integers(1, 30))
def test_softmax_matches_the_reference(answer, seed, r, n, tile):
    x = normal(seed, r, n, scale=3.0)
    x[0, 0] = -np.inf
    p_ref, _ = softmax_reference(x)
    assert_close(answer.online_softmax(x, tile), p_ref, f"softmax of an ({r}, {n}) array, tile {tile}")
    assert_close(answer.online_softmax(x[-1], tile), p_ref[-1], f"softmax of a ({n},) vector, tile {tile}")


@pytest.mark.catches("no_guard")
def test_softmax_of_a_masked_row_is_zero(answer):
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, 1.0, -np.inf]])
    p_ref, _ = softmax_reference(x)
    assert_close(answer.online_softmax(x, 2), p_ref, "softmax with a fully masked row")


@pytest.mark.hint("online_softmax must raise ValueError for tile < 1")
def test_softmax_rejects_bad_tile(answer):
    with pytest.raises(ValueError):
        answer.online_softmax(np.zeros(4), 0)
