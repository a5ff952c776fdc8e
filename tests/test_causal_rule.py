"""The one causal rule against a brute-force look at the mask, and every user of it agreeing."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lessons import attention, flash_attention, ring_attention, tile_schedule
from lessons.core.causal_rule import DIAGONAL, FULL, SKIPPED, causal_visible, last_visible_key, tile_kind


def brute_mask(nq, nk):
    return np.array([[j <= i + nk - nq for j in range(nk)] for i in range(nq)])


@settings(max_examples=80, deadline=None)
@given(nq=st.integers(1, 12), nk=st.integers(1, 12), block_q=st.integers(1, 6), block_k=st.integers(1, 6))
def test_tile_kind_is_what_the_mask_says(nq, nk, block_q, block_k):
    mask = brute_mask(nq, nk)
    assert np.array_equal(causal_visible(np.arange(nq), np.arange(nk), nq, nk), mask)
    assert [last_visible_key(i, nq, nk) for i in range(nq)] == [i + nk - nq for i in range(nq)]
    for r0 in range(0, nq, block_q):
        for c0 in range(0, nk, block_k):
            r1, c1 = min(r0 + block_q, nq), min(c0 + block_k, nk)
            tile = mask[r0:r1, c0:c1]
            want = SKIPPED if not tile.any() else FULL if tile.all() else DIAGONAL
            assert tile_kind(r0, r1, c0, c1, nq, nk) == want
            assert tile_kind(r0, r1, c0, c1, nq, nk, causal=False) == FULL


@settings(max_examples=40, deadline=None)
@given(nq=st.integers(1, 12), nk=st.integers(1, 12), block_q=st.integers(1, 6), block_k=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_flash_absorbs_exactly_the_computed_tiles_of_the_schedule(nq, nk, block_q, block_k, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((nq, 3)), rng.standard_normal((nk, 3)), rng.standard_normal((nk, 2))
    out, trace = flash_attention(q, k, v, block_k, block_q=block_q, causal=True, return_trace=True)
    computed = [(t.row_start, t.row_stop, t.key_start, t.key_stop)
                for t in tile_schedule(nq, nk, block_q, block_k) if t.computed]
    assert [(s.row_start, s.row_stop, s.key_start, s.key_stop) for s in trace.steps] == computed
    np.testing.assert_allclose(out, attention(q, k, v, causal=True), rtol=0, atol=1e-12)
    ring, ring_trace = ring_attention(q, k, v, 3, causal=True, return_trace=True)
    for s in ring_trace.steps:                          # a ring device folds only blocks the rule computes
        assert tile_kind(s.row_start, s.row_stop, s.key_start, s.key_stop, nq, nk) != SKIPPED
    np.testing.assert_allclose(ring, attention(q, k, v, causal=True), rtol=0, atol=1e-12)
