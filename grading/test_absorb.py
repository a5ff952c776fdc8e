"""Grading: the absorb step (notebook 02), driven tile by tile by the grader."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from _support import assert_close, direct_state, no_nan, normal, qkv, seeds, tiles_of
from lessons import attention

EXERCISE = "absorb"


def empty(r, dv):
    return np.full(r, -np.inf), np.zeros(r), np.zeros((r, dv))


def fold(answer, s, v, tile):
    """Absorb the tiles of s (R, N) in order; return the states after each tile."""
    state, states = empty(s.shape[0], v.shape[1]), []
    for a, b in tiles_of(s.shape[1], tile):
        state = answer.absorb(*state, s[:, a:b].copy(), v[a:b].copy())
        states.append((a, b, state))
    return states


def scores(seed, r, n, spread=3.0):
    return normal(seed, r, n, scale=spread)


@pytest.mark.hint("m_new = max(m, max of s over the tile), per row")
@given(seed=seeds, r=st.integers(1, 4), n=st.integers(1, 24), tile=st.integers(1, 8))
def test_m_is_the_running_max(answer, seed, r, n, tile):
    s, v = scores(seed, r, n), normal(seed + 1, n, 3)
    for a, b, (m, l, o) in fold(answer, s, v, tile):
        assert_close(m, direct_state(s[:, :b], v[:b])[0], f"m after keys [0, {b})")


@pytest.mark.catches("alpha_missing_on_l")
@given(seed=seeds, r=st.integers(1, 4), n=st.integers(2, 24), tile=st.integers(1, 8))
def test_l_after_every_tile(answer, seed, r, n, tile):
    s, v = scores(seed, r, n), normal(seed + 1, n, 3)
    for a, b, (m, l, o) in fold(answer, s, v, tile):
        assert_close(l, direct_state(s[:, :b], v[:b])[1], f"l after keys [0, {b}) (tile {tile})")


@pytest.mark.catches("alpha_missing_on_o")
@given(seed=seeds, r=st.integers(1, 4), n=st.integers(2, 24), tile=st.integers(1, 8))
def test_o_after_every_tile(answer, seed, r, n, tile):
    s, v = scores(seed, r, n), normal(seed + 1, n, 3)
    for a, b, (m, l, o) in fold(answer, s, v, tile):
        assert_close(o, direct_state(s[:, :b], v[:b])[2], f"o after keys [0, {b}) (tile {tile})")


@pytest.mark.catches("alpha_missing_on_o", "alpha_missing_on_l")
@given(seed=seeds, nq=st.integers(1, 6), nk=st.integers(1, 30), d=st.integers(1, 8), tile=st.integers(1, 9))
def test_o_over_l_is_attention(answer, seed, nq, nk, d, tile):
    q, k, v = qkv(seed, nq, nk, d, dv=3)
    s = (q @ k.T) / np.sqrt(d)
    m, l, o = fold(answer, s, v, tile)[-1][2]
    assert_close(np.asarray(o) / np.asarray(l)[:, None], attention(q, k, v),
                 f"o / l after all tiles vs lessons.attention (Nk = {nk}, tile = {tile})")


@pytest.mark.hint("the tile size must not change the result: it only decides how many keys are in SRAM at once")
@given(seed=seeds, nk=st.integers(1, 30), t1=st.integers(1, 10), t2=st.integers(1, 10))
def test_tile_size_does_not_matter(answer, seed, nk, t1, t2):
    s, v = scores(seed, 3, nk), normal(seed + 1, nk, 2)
    a = fold(answer, s, v, t1)[-1][2]
    b = fold(answer, s, v, t2)[-1][2]
    assert_close(np.asarray(a[2]) / np.asarray(a[1])[:, None], np.asarray(b[2]) / np.asarray(b[1])[:, None],
                 f"o / l with tile {t1} vs tile {t2}")


@pytest.mark.catches("no_guard")
def test_fully_masked_tile_into_an_empty_state(answer):
    m, l, o = answer.absorb(*empty(2, 3), np.full((2, 4), -np.inf), normal(0, 4, 3))
    no_nan(l, "l after a fully masked first tile")
    no_nan(o, "o after a fully masked first tile")
    assert_close(m, [-np.inf, -np.inf], "m after a fully masked first tile")
    assert_close(l, [0.0, 0.0], "l after a fully masked first tile")
    assert_close(o, np.zeros((2, 3)), "o after a fully masked first tile")


@pytest.mark.catches("no_guard")
def test_fully_masked_first_tile_then_visible_keys(answer):
    q, k, v = qkv(7, 3, 10, 4)
    mask = np.ones((3, 10), bool)
    mask[:, :4] = False                      # the first tile of 4 keys is hidden from every row
    mask[2, :] = False                       # row 2 sees nothing at all
    s = np.where(mask, (q @ k.T) / 2.0, -np.inf)
    state = answer.absorb(*empty(3, 4), s[:, :4], v[:4])        # the fully masked tile
    m, l, o = answer.absorb(*state, s[:, 4:], v[4:])             # then all visible keys in one tile
    no_nan(o, "o")
    out = np.where(np.asarray(l)[:, None] > 0, np.asarray(o) / np.where(np.asarray(l) > 0, l, 1.0)[:, None], 0.0)
    assert_close(out, attention(q, k, v, mask=mask), "o / l with a fully masked first tile")
    assert_close(l[2], 0.0, "l of a row that sees no key")


@pytest.mark.hint("a fully masked tile must leave a non-empty state exactly as it was")
def test_fully_masked_tile_changes_nothing(answer):
    s, v = scores(3, 2, 5), normal(4, 5, 3)
    m0, l0, o0 = fold(answer, s, v, 5)[-1][2]
    m1, l1, o1 = answer.absorb(m0, l0, o0, np.full((2, 3), -np.inf), normal(5, 3, 3))
    assert_close(m1, m0, "m after a fully masked tile")
    assert_close(l1, l0, "l after a fully masked tile")
    assert_close(o1, o0, "o after a fully masked tile")


@pytest.mark.hint("return new arrays: updating m, l or o in place (o *= alpha) changes the caller's arrays")
def test_inputs_are_not_modified(answer):
    s, v = scores(8, 3, 4), normal(9, 4, 2)
    m, l, o = np.array([0.5, -1.0, -np.inf]), np.array([2.0, 1.0, 0.0]), normal(10, 3, 2)
    o[2] = 0.0
    before = [x.copy() for x in (m, l, o, s, v)]
    answer.absorb(m, l, o, s, v)
    for name, x, x0 in zip("mlosv", (m, l, o, s, v), before):
        np.testing.assert_array_equal(x, x0, err_msg=f"absorb changed its argument {name}")
