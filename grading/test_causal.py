"""Grading: causal attention tile by tile, and the NaN of a fully masked tile (notebook 03)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from _support import assert_close, direct_state, no_nan, normal, qkv, seeds, tiles_of
from lessons import attention

EXERCISE = "causal"


def reference(q, k, v, mask=None):
    return attention(q, k, v, causal=True, mask=mask, return_lse=True)


@pytest.mark.hint("absorb_unguarded is the plain update, correct whenever every row has a finite score")
@given(seed=seeds, r=st.integers(1, 4), n=st.integers(1, 20), tile=st.integers(1, 7))
def test_unguarded_update_is_right_on_finite_scores(answer, seed, r, n, tile):
    s, v = normal(seed, r, n, scale=3.0), normal(seed + 1, n, 2)
    state = (np.full(r, -np.inf), np.zeros(r), np.zeros((r, 2)))
    for a, b in tiles_of(n, tile):
        state = answer.absorb_unguarded(*state, s[:, a:b], v[a:b])
    m_ref, l_ref, o_ref = direct_state(s, v)
    assert_close(state[1], l_ref, "l from absorb_unguarded")
    assert_close(state[2], o_ref, "o from absorb_unguarded")


@pytest.mark.hint("reproduce the bug: without a guard, a fully masked tile reaching an empty state "
                  "computes exp(-inf - -inf) = NaN (absorb_unguarded must not guard it)")
def test_unguarded_update_reproduces_the_nan(answer):
    m, l, o = answer.absorb_unguarded(np.array([-np.inf, -np.inf]), np.zeros(2), np.zeros((2, 3)),
                                      np.array([[-np.inf, -np.inf], [0.0, -np.inf]]), normal(0, 2, 3))
    l, o = np.asarray(l, float), np.asarray(o, float)
    assert np.isnan(l[0]) and np.isnan(o[0]).all(), (
        f"row 0 (fully masked first tile) should be NaN, got l={l[0]}, o={o[0]}")
    assert not np.isnan(l[1]) and not np.isnan(o[1]).any(), "row 1 has a visible key and must not be NaN"


@pytest.mark.hint("compare with lessons.attention(q, k, v, causal=True): query i sees key j iff j <= i + Nk - Nq")
@given(seed=seeds, n=st.integers(1, 30), tile=st.integers(1, 9), block_q=st.integers(1, 9))
def test_square_causal_matches_the_reference(answer, seed, n, tile, block_q):
    q, k, v = qkv(seed, n, n, 4, dv=3)
    out, lse = answer.causal_flash_attention(q, k, v, tile, block_q=block_q)
    out_ref, lse_ref = reference(q, k, v)
    assert_close(out, out_ref, f"out (N = {n}, tile = {tile}, block_q = {block_q})")
    assert_close(lse, lse_ref, "lse")


# Nk is a multiple of the tile in the next three checks, so that they test one thing each.

@pytest.mark.catches("top_left_causal")
@given(seed=seeds, nq=st.integers(1, 12), tiles=st.integers(1, 5), tile=st.integers(1, 6),
       block_q=st.integers(1, 8))
def test_fewer_queries_than_keys(answer, seed, nq, tiles, tile, block_q):
    nk = max(tiles * tile, nq + tile)
    nk += (-nk) % tile
    q, k, v = qkv(seed, nq, nk, 4, dv=3)       # decode-like: the queries are the last Nq positions
    out, lse = answer.causal_flash_attention(q, k, v, tile, block_q=block_q)
    out_ref, lse_ref = reference(q, k, v)
    assert_close(out, out_ref, f"out with Nq = {nq} < Nk = {nk} (bottom-right causal)")
    assert_close(lse, lse_ref, "lse")


@pytest.mark.catches("top_left_causal")
@given(seed=seeds, tiles=st.integers(1, 4), tile=st.integers(1, 4), extra=st.integers(1, 12),
       block_q=st.integers(1, 8))
def test_more_queries_than_keys(answer, seed, tiles, tile, extra, block_q):
    nk = tiles * tile
    q, k, v = qkv(seed, nk + extra, nk, 4, dv=3)      # the first `extra` rows see no key at all
    out, lse = answer.causal_flash_attention(q, k, v, tile, block_q=block_q)
    out_ref, lse_ref = reference(q, k, v)
    out = np.where(np.isnan(np.asarray(out, float)), 0.0, out)      # NaN is the subject of another check
    assert_close(out, out_ref, f"out with Nq = {nk + extra} > Nk = {nk}; rows that see no key are 0")


@pytest.mark.catches("no_guard", "top_left_causal")
@given(seed=seeds, tiles=st.integers(1, 4), tile=st.integers(1, 4), extra=st.integers(1, 12),
       block_q=st.integers(1, 8))
def test_rows_that_see_nothing_are_not_nan(answer, seed, tiles, tile, extra, block_q):
    nk = tiles * tile
    q, k, v = qkv(seed, nk + extra, nk, 4, dv=3)      # the first `extra` rows see no key at all
    out, lse = answer.causal_flash_attention(q, k, v, tile, block_q=block_q)
    no_nan(out, f"out of the {extra} rows that see no key")
    no_nan(lse, "lse")
    assert_close(np.asarray(lse, float)[:extra], np.full(extra, -np.inf), "lse of rows that see no key")


@pytest.mark.catches("no_guard")
@pytest.mark.parametrize("tile, block_q", [(4, 4), (4, 16), (3, 5), (6, 2)])
def test_fully_masked_first_tile(answer, tile, block_q):
    n = 12
    q, k, v = qkv(11, n, n, 4, dv=3)
    mask = np.ones((n, n), bool)
    mask[:, :tile] = False                 # the whole first tile is masked for every row
    out, lse = answer.causal_flash_attention(q, k, v, tile, block_q=block_q, mask=mask)
    no_nan(out, "out with a fully masked first tile")
    out_ref, lse_ref = reference(q, k, v, mask)
    assert_close(out, out_ref, "out with a fully masked first tile (rows that see nothing are 0)")
    assert_close(lse, lse_ref, "lse with a fully masked first tile")


@pytest.mark.catches("last_partial_tile_dropped")
@pytest.mark.parametrize("nq, nk, tile", [(10, 10, 4), (7, 7, 3), (9, 9, 8), (5, 5, 2)])
def test_last_partial_tile(answer, nq, nk, tile):
    q, k, v = qkv(nk * 31 + tile, nq, nk, 4, dv=3)
    out, lse = answer.causal_flash_attention(q, k, v, tile, block_q=4)
    out_ref, lse_ref = reference(q, k, v)
    assert_close(out, out_ref, f"out with Nk = {nk} not a multiple of tile = {tile}")


@pytest.mark.hint("the mask argument is combined with the causal mask: a key must pass both")
@given(seed=seeds, nq=st.integers(1, 10), nk=st.integers(1, 14), tile=st.integers(1, 6), density=st.floats(0.2, 0.9))
def test_mask_and_causal_together(answer, seed, nq, nk, tile, density):
    q, k, v = qkv(seed, nq, nk, 4, dv=3)
    mask = np.random.default_rng(seed).random((nq, nk)) < density
    out, lse = answer.causal_flash_attention(q, k, v, tile, block_q=3, mask=mask)
    out_ref, lse_ref = reference(q, k, v, mask)
    assert_close(out, out_ref, "out with causal and a mask")
    assert_close(lse, lse_ref, "lse with causal and a mask")
