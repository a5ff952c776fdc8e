"""A row's output never depends on what it cannot see.

A key a row cannot see (masked, above the causal diagonal, past ``seq_len``, on a page
the sequence does not use) gets probability exactly 0 and must add exactly nothing:
NaN, inf or 1e30 written there leaves the row bitwise as it was (``0 * NaN`` must
never reach it). NaN in a key or value the row does see, or in its own query, makes
that row, and only that row, NaN. Every schedule is checked the same way: run it on
clean inputs, poison every slot a row cannot see, run it again, compare exactly.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lessons import (State, absorb, attention, flash_attention, flash_decoding, merge_states,
                     paged_decode, paged_flash_attention, ring_attention)
from lessons.schedules.paged import write_paged_cache
from lessons.schedules.gqa_decode import write_paged_batch
from lessons.schedules.softmax import fused_softmax_matmul

nan, inf = np.nan, np.inf
POISON = [nan, inf, -inf, 1e30]

# poisoned inputs make NumPy warn about the NaN it computes in the rows that see them
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


def same(a, b):
    """Exactly equal, NaN where NaN (the test of 'bitwise unchanged')."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


def causal_visible(nq, nk):
    """Bottom-right aligned, written out here: query i sees key j iff j <= i + nk - nq."""
    return np.array([[j <= i + nk - nq for j in range(nk)] for i in range(nq)], dtype=bool)


def softmax_by_hand(scores, values):
    """One row of attention with math.exp over the keys it sees: the issue's numbers."""
    m = max(scores)
    w = [math.exp(s - m) for s in scores]
    total = sum(w)
    out = [sum(wi * v[c] for wi, v in zip(w, values)) / total for c in range(len(values[0]))]
    return out, m + math.log(total)


# --- the values of the report, each a test -------------------------------------------------

Q = np.array([[1.0, 0.0], [0.0, 1.0]])
K = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
V_NAN = np.array([[1.0, 2.0], [3.0, 4.0], [nan, nan]])
MASK = np.array([[True, True, False], [True, True, False]])
OUT = np.array([[1.660477, 2.660477], [2.339523, 3.339523]])
LSE = np.array([1.107940, 1.107940])


def test_the_reported_numbers_by_hand():
    s = 1 / math.sqrt(2)
    row0, lse0 = softmax_by_hand([s, 0.0], [[1, 2], [3, 4]])
    row1, lse1 = softmax_by_hand([0.0, s], [[1, 2], [3, 4]])
    np.testing.assert_allclose([row0, row1], OUT, rtol=0, atol=5e-7)
    np.testing.assert_allclose([lse0, lse1], LSE, rtol=0, atol=5e-7)


def test_masked_nan_value_reference():
    out, lse = attention(Q, K, V_NAN, mask=MASK, return_lse=True)
    np.testing.assert_allclose(out, OUT, rtol=0, atol=5e-7)
    np.testing.assert_allclose(lse, LSE, rtol=0, atol=5e-7)
    clean = V_NAN.copy()
    clean[2] = [5.0, 6.0]
    assert same(out, attention(Q, K, clean, mask=MASK))


@pytest.mark.parametrize("block_k", [1, 2, 3, 64])
@pytest.mark.parametrize("block_q", [1, 2, 64])
def test_masked_nan_value_flash_every_tiling(block_k, block_q):
    out, lse = flash_attention(Q, K, V_NAN, block_k, block_q=block_q, mask=MASK, return_lse=True)
    np.testing.assert_allclose(out, OUT, rtol=0, atol=5e-7)
    np.testing.assert_allclose(lse, LSE, rtol=0, atol=5e-7)


CAUSAL_Q = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
CAUSAL_V = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])


def causal_case():
    k, v = CAUSAL_Q.copy(), CAUSAL_V.copy()
    k[2] = v[2] = nan                                   # the slot not yet written
    return CAUSAL_Q, k, v


def check_causal_case(out):
    np.testing.assert_allclose(out[0], [1.0, 2.0], rtol=0, atol=1e-15)
    np.testing.assert_allclose(out[1], [2.339523, 3.339523], rtol=0, atol=5e-7)
    assert np.isnan(out[2]).all()


def test_causal_unwritten_slot_reference():
    check_causal_case(attention(*causal_case(), causal=True))


@pytest.mark.parametrize("block_k", [1, 2, 3, 64])
@pytest.mark.parametrize("block_q", [1, 2, 3, 64])
def test_causal_unwritten_slot_flash_every_tiling(block_k, block_q):
    out = flash_attention(*causal_case(), block_k, block_q=block_q, causal=True)
    check_causal_case(out)
    assert same(out, flash_attention(*causal_case(), 1, block_q=1, causal=True))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_causal_unwritten_slot_ring_every_world_size(world_size):
    check_causal_case(ring_attention(*causal_case(), world_size, causal=True))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("tile", [1, 2, 64])
def test_flash_decoding_nan_query_row_stays_in_its_row(num_splits, tile):
    rng = np.random.default_rng(3)
    k, v = rng.standard_normal((5, 2)), rng.standard_normal((5, 3))
    q = np.array([[1.0, 0.0], [nan, 0.0]])
    out, lse = flash_decoding(q, k, v, num_splits, tile=tile, return_lse=True)
    ref, ref_lse = attention(q[:1], k, v, return_lse=True)
    np.testing.assert_allclose(out[0], ref[0], rtol=0, atol=1e-14)
    assert lse[0] == pytest.approx(ref_lse[0], abs=1e-14)
    assert np.isnan(out[1]).all() and np.isnan(lse[1])
    # and row 0 is exactly what it is with a finite query beside it
    clean, clean_lse = flash_decoding(np.array([[1.0, 0.0], [0.5, 0.0]]), k, v, num_splits, tile=tile,
                                      return_lse=True)
    assert same(out[0], clean[0]) and same(lse[0], clean_lse[0])


def test_merge_states_keeps_nan_in_its_row():
    o_a, lse_a = np.array([[1.0, 2.0], [nan, nan], [5.0, 6.0]]), np.array([0.0, nan, -inf])
    o_b, lse_b = np.array([[3.0, 4.0], [1.0, 1.0], [nan, 0.0]]), np.array([np.log(3.0), 0.0, 1.0])
    o, lse = merge_states(o_a, lse_a, o_b, lse_b)
    # row 0 by hand: weights 1/4 and 3/4, lse = log(1 + 3)
    np.testing.assert_allclose(o[0], [0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 4], rtol=0, atol=1e-15)
    assert lse[0] == pytest.approx(np.log(4.0), abs=1e-15)
    assert np.isnan(o[1]).all() and np.isnan(lse[1])
    # row 2: the empty state is the identity, so b's row comes through, NaN entry and all
    assert np.isnan(o[2, 0]) and o[2, 1] == 0.0 and lse[2] == 1.0
    # +inf lse is no state at all: that row is NaN, the others are untouched
    o, lse = merge_states(np.zeros((2, 1)), np.array([inf, 0.0]), np.ones((2, 1)), np.array([0.0, 0.0]))
    assert np.isnan(o[0]).all() and np.isnan(lse[0])
    assert o[1, 0] == 0.5 and lse[1] == pytest.approx(np.log(2.0), abs=1e-15)


# --- the fold itself -------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), keys=st.integers(1, 6), dv=st.integers(1, 3), seed=st.integers(0, 2**16),
       poison=st.sampled_from(POISON))
def test_absorb_a_key_with_score_minus_inf_adds_exactly_nothing(rows, keys, dv, seed, poison):
    rng = np.random.default_rng(seed)
    state = absorb(State.empty(rows, dv), rng.standard_normal((rows, 3)), rng.standard_normal((3, dv)))
    s = rng.standard_normal((rows, keys))
    hidden_key = rng.integers(keys)
    hidden_rows = rng.random(rows) < 0.6
    s[hidden_rows, hidden_key] = -inf                   # masked for these rows
    v = rng.standard_normal((keys, dv))
    clean = absorb(state, s, v)
    v[hidden_key] = poison
    dirty = absorb(state, s, v)
    for x, y in zip((clean.m, clean.l, clean.o), (dirty.m, dirty.l, dirty.o)):
        assert same(x[hidden_rows], y[hidden_rows])
    if poison != 1e30 and (~hidden_rows).any():         # the rows that see it are not finite
        assert not np.isfinite(dirty.o[~hidden_rows]).any()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 12), tile=st.integers(1, 13), seed=st.integers(0, 2**16),
       poison=st.sampled_from(POISON))
def test_fused_softmax_matmul_ignores_values_of_minus_inf_scores(rows, n, tile, seed, poison):
    rng = np.random.default_rng(seed)
    x, v = rng.standard_normal((rows, n)), rng.standard_normal((n, 2))
    hidden = rng.random(n) < 0.4
    x[:, hidden] = -inf
    clean = fused_softmax_matmul(x, v, tile)
    v[hidden] = poison
    assert same(clean, fused_softmax_matmul(x, v, tile))


# --- every schedule: poison what a row cannot see ------------------------------------------

def poisoned(k, v, hidden_keys, poison, where):
    """Copies of k and v with the given keys overwritten in k, v or both."""
    k, v = k.copy(), v.copy()
    if where in ("k", "both"):
        k[hidden_keys] = poison
    if where in ("v", "both"):
        v[hidden_keys] = poison
    return k, v


problems = dict(
    nq=st.integers(1, 8), nk=st.integers(1, 10), d=st.integers(1, 4), dv=st.integers(1, 3),
    seed=st.integers(0, 2**16), poison=st.sampled_from(POISON), where=st.sampled_from(["k", "v", "both"]))


def random_problem(nq, nk, d, dv, seed):
    rng = np.random.default_rng(seed)
    return rng, rng.standard_normal((nq, d)), rng.standard_normal((nk, d)), rng.standard_normal((nk, dv))


@settings(max_examples=80, deadline=None)
@given(causal=st.booleans(), block_k=st.integers(1, 11), block_q=st.integers(1, 9), **problems)
def test_masked_and_causal_hidden_keys_change_nothing(nq, nk, d, dv, seed, poison, where, causal,
                                                      block_k, block_q):
    rng, q, k, v = random_problem(nq, nk, d, dv, seed)
    mask = rng.random((nq, nk)) < 0.7
    visible = mask & causal_visible(nq, nk) if causal else mask
    hidden = ~visible.any(axis=0)                       # keys no row may see
    k2, v2 = poisoned(k, v, hidden, poison, where)
    runs = [
        lambda k, v: attention(q, k, v, mask=mask, causal=causal, return_lse=True),
        lambda k, v: flash_attention(q, k, v, block_k, block_q=block_q, mask=mask, causal=causal,
                                     return_lse=True),
    ]
    for run in runs:
        (out, lse), (out2, lse2) = run(k, v), run(k2, v2)
        assert same(out, out2) and same(lse, lse2)
        assert np.isfinite(out2).all()


@settings(max_examples=80, deadline=None)
@given(causal=st.booleans(), block_k=st.integers(1, 11), block_q=st.integers(1, 9), **problems)
def test_a_key_hidden_from_some_rows_reaches_only_the_rows_that_see_it(nq, nk, d, dv, seed, poison, where,
                                                                       causal, block_k, block_q):
    """One key poisoned: rows that cannot see it are unchanged; with NaN, rows that see it are NaN."""
    rng, q, k, v = random_problem(nq, nk, d, dv, seed)
    mask = rng.random((nq, nk)) < 0.7
    visible = mask & causal_visible(nq, nk) if causal else mask
    j = int(rng.integers(nk))
    k2, v2 = poisoned(k, v, [j], poison, where)
    blind, sees = ~visible[:, j], visible[:, j]
    runs = [
        lambda k, v: attention(q, k, v, mask=mask, causal=causal, return_lse=True),
        lambda k, v: flash_attention(q, k, v, block_k, block_q=block_q, mask=mask, causal=causal,
                                     return_lse=True),
    ]
    for run in runs:
        (out, lse), (out2, lse2) = run(k, v), run(k2, v2)
        assert same(out[blind], out2[blind]) and same(lse[blind], lse2[blind])
        if poison is nan:
            assert np.isnan(out2[sees]).all()


@settings(max_examples=80, deadline=None)
@given(world_size=st.integers(1, 9), **problems)
def test_ring_causal_hidden_keys_change_nothing(nq, nk, d, dv, seed, poison, where, world_size):
    _, q, k, v = random_problem(nq, nk, d, dv, seed)
    visible = causal_visible(nq, nk)
    j = int(np.random.default_rng(seed + 1).integers(nk))
    k2, v2 = poisoned(k, v, [j], poison, where)
    blind, sees = ~visible[:, j], visible[:, j]
    out, lse = ring_attention(q, k, v, world_size, causal=True, return_lse=True)
    out2, lse2 = ring_attention(q, k2, v2, world_size, causal=True, return_lse=True)
    assert same(out[blind], out2[blind]) and same(lse[blind], lse2[blind])
    if poison is nan:
        assert np.isnan(out2[sees]).all()


@settings(max_examples=60, deadline=None)
@given(nq=st.integers(1, 6), nk=st.integers(0, 10), num_splits=st.integers(1, 12), tile=st.integers(1, 6),
       order=st.sampled_from(["left", "tree"]), seed=st.integers(0, 2**16), poison=st.sampled_from([nan, inf]))
def test_a_bad_query_row_stays_in_its_row_every_path(nq, nk, num_splits, tile, order, seed, poison):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((nq, 3)), rng.standard_normal((nk, 3)), rng.standard_normal((nk, 2))
    i = int(rng.integers(nq))
    q2 = q.copy()
    q2[i, 0] = poison
    others = np.arange(nq) != i
    runs = [
        lambda q: attention(q, k, v, return_lse=True),
        lambda q: flash_attention(q, k, v, tile, block_q=2, return_lse=True),
        lambda q: ring_attention(q, k, v, num_splits, return_lse=True),
        lambda q: flash_decoding(q, k, v, num_splits, tile=tile, order=order, return_lse=True),
    ]
    for run in runs:
        (out, lse), (out2, lse2) = run(q), run(q2)
        assert same(out[others], out2[others]) and same(lse[others], lse2[others])
        if nk and poison is nan:
            assert np.isnan(out2[i]).all() and np.isnan(lse2[i])


@settings(max_examples=60, deadline=None)
@given(nq=st.integers(1, 3), nk=st.integers(0, 12), d=st.integers(1, 3), block_size=st.integers(1, 5),
       seed=st.integers(0, 2**16), poison=st.sampled_from(POISON), table_pad=st.integers(0, 3))
def test_paged_slots_past_seq_len_and_unused_pages_change_nothing(nq, nk, d, block_size, seed, poison,
                                                                  table_pad):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((nq, d)), rng.standard_normal((nk, d)), rng.standard_normal((nk, 2))
    table, k_clean, v_clean = write_paged_cache(k, v, block_size, seed=seed, fill=0.5)
    _, k_dirty, v_dirty = write_paged_cache(k, v, block_size, seed=seed, fill=poison)
    pad_clean = np.concatenate([table, np.zeros(table_pad, np.int64)])          # a valid page, never read
    pad_dirty = np.concatenate([table, np.full(table_pad, -1, np.int64)])       # not a page at all
    out, lse = paged_flash_attention(q, pad_clean, k_clean, v_clean, nk, block_size, return_lse=True)
    out2, lse2 = paged_flash_attention(q, pad_dirty, k_dirty, v_dirty, nk, block_size, return_lse=True)
    assert same(out, out2) and same(lse, lse2)
    assert np.isfinite(out2).all()


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(0, 9), min_size=1, max_size=3), num_kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2]), block_size=st.integers(1, 4), seed=st.integers(0, 2**16),
       poison=st.sampled_from(POISON))
def test_gqa_decode_padding_and_free_pages_change_nothing(lens, num_kv_heads, group, block_size, seed, poison):
    rng = np.random.default_rng(seed)
    d, dv = 3, 2
    keys = [rng.standard_normal((n, num_kv_heads, d)) for n in lens]
    values = [rng.standard_normal((n, num_kv_heads, dv)) for n in lens]
    q = rng.standard_normal((len(lens), num_kv_heads * group, d))
    k_c, v_c, tables, seq_lens = write_paged_batch(keys, values, block_size, seed=seed, fill=0.5)
    k_d, v_d, tables_d, _ = write_paged_batch(keys, values, block_size, seed=seed, fill=poison)
    clean_tables = np.where(tables < 0, 0, tables)      # padding pointing at a real page, never read
    out, lse = paged_decode(q, k_c, v_c, clean_tables, seq_lens, return_lse=True)
    out2, lse2 = paged_decode(q, k_d, v_d, tables_d, seq_lens, return_lse=True)
    assert same(out, out2) and same(lse, lse2)
    assert np.isfinite(out2).all()


def test_gqa_decode_nan_key_reaches_only_its_sequence_and_kv_head():
    rng = np.random.default_rng(5)
    keys = [rng.standard_normal((n, 2, 3)) for n in (4, 6)]
    values = [rng.standard_normal((n, 2, 2)) for n in (4, 6)]
    q = rng.standard_normal((2, 4, 3))                  # 4 query heads, 2 KV heads: groups {0, 1} and {2, 3}
    clean = paged_decode(q, *write_paged_batch(keys, values, 3, seed=1))
    keys[1][2, 1] = nan                                 # sequence 1, KV head 1, token 2
    dirty = paged_decode(q, *write_paged_batch(keys, values, 3, seed=1))
    assert np.isnan(dirty[1, 2:]).all()
    assert same(dirty[0], clean[0]) and same(dirty[1, :2], clean[1, :2])
