"""Grading: merge_states in the normalised (o, lse) form, empty states included (notebook 08)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from _support import assert_close, no_nan, qkv, seeds
from lessons import attention

EXERCISE = "merge_states"


def part(q, k, v, a, b):
    """(o, lse) of attention over keys [a, b) by the textbook reference; empty: (0, -inf)."""
    return attention(q, k[a:b], v[a:b], return_lse=True)


def empty(r, dv):
    return np.zeros((r, dv)), np.full(r, -np.inf)


@pytest.mark.hint("o = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b, lse = log(exp(lse_a) + exp(lse_b))")
@given(seed=seeds, r=st.integers(1, 4), nk=st.integers(2, 30), data=st.data())
def test_merge_matches_attention(answer, seed, r, nk, data):
    cut = data.draw(st.integers(1, nk - 1))
    q, k, v = qkv(seed, r, nk, 4, dv=3)
    o, lse = answer.merge_states(*part(q, k, v, 0, cut), *part(q, k, v, cut, nk))
    out_ref, lse_ref = attention(q, k, v, return_lse=True)
    assert_close(o, out_ref, f"o of keys [0, {cut}) merged with [{cut}, {nk})")
    assert_close(lse, lse_ref, "lse")


@pytest.mark.hint("an empty part (o = 0, lse = -inf) is the identity: merging it changes nothing")
@given(seed=seeds, r=st.integers(1, 4), nk=st.integers(1, 20))
def test_empty_part_is_the_identity(answer, seed, r, nk):
    q, k, v = qkv(seed, r, nk, 4, dv=3)
    full = attention(q, k, v, return_lse=True)
    for o, lse in (answer.merge_states(*full, *empty(r, 3)), answer.merge_states(*empty(r, 3), *full)):
        assert_close(o, full[0], "o merged with an empty part")
        assert_close(lse, full[1], "lse merged with an empty part")


@pytest.mark.catches("no_guard")
def test_two_empty_parts_give_no_nan(answer):
    o, lse = answer.merge_states(*empty(2, 3), *empty(2, 3))
    no_nan(o, "o of two empty parts")
    no_nan(lse, "lse of two empty parts")


@pytest.mark.catches("lse_inf_for_empty")
def test_two_empty_parts_give_an_empty_part(answer):
    o, lse = answer.merge_states(*empty(2, 3), *empty(2, 3))
    lse, o = np.asarray(lse, dtype=np.float64), np.asarray(o, dtype=np.float64)
    # NaN here is the other mistake (no guard), which test_two_empty_parts_give_no_nan names;
    # this check names only what a NaN-free answer can get wrong: lse = +inf, or o not 0
    assert not np.isposinf(lse).any(), f"lse of two empty parts is {lse}; the empty state has lse = -inf"
    seen = ~np.isnan(lse)
    assert_close(lse[seen], np.full(int(seen.sum()), -np.inf), "lse of two empty parts (the empty state has lse = -inf)")
    rows = ~np.isnan(o).any(axis=-1) if o.ndim == 2 else np.ones(0, bool)
    assert_close(o[rows], np.zeros((int(rows.sum()), 3)), "o of two empty parts")


@pytest.mark.catches("lse_inf_for_empty", "no_guard")
@given(seed=seeds, nk=st.integers(1, 12), splits=st.integers(2, 7))
def test_reduce_with_empty_splits(answer, seed, nk, splits):
    """Split the keys over `splits` workers (trailing ones may be empty), merge left to right."""
    q, k, v = qkv(seed, 2, nk, 4, dv=3)
    c = -(-nk // splits)
    acc = empty(2, 3)
    for i in range(splits):
        acc = answer.merge_states(*acc, *part(q, k, v, min(i * c, nk), min((i + 1) * c, nk)))
    acc = answer.merge_states(*empty(2, 3), *acc)
    out_ref, lse_ref = attention(q, k, v, return_lse=True)
    assert_close(acc[0], out_ref, f"o after merging {splits} partials of {nk} keys (some empty)")
    assert_close(acc[1], lse_ref, "lse after merging")


@pytest.mark.catches("lse_inf_for_empty", "no_guard")
def test_empty_rows_next_to_full_rows(answer):
    """Row 0 has keys in part a only, row 1 in neither, row 2 in both."""
    o_a, lse_a = np.array([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]]), np.array([0.5, -np.inf, 1.0])
    o_b, lse_b = np.array([[0.0, 0.0], [0.0, 0.0], [5.0, 6.0]]), np.array([-np.inf, -np.inf, 1.0])
    o, lse = answer.merge_states(o_a, lse_a, o_b, lse_b)
    assert_close(lse, [0.5, -np.inf, 1.0 + np.log(2.0)], "lse per row")
    assert_close(o, [[1.0, 2.0], [0.0, 0.0], [4.0, 5.0]], "o per row")


@pytest.mark.hint("shift by max(lse_a, lse_b) before exp: lse can be in the hundreds and exp(lse) overflows")
def test_large_lse_does_not_overflow(answer):
    q, k, v = qkv(3, 2, 8, 4, dv=3)
    q = q * 400.0                                    # scores, and so lse, in the hundreds
    with np.errstate(over="ignore", invalid="ignore"):
        o, lse = answer.merge_states(*part(q, k, v, 0, 3), *part(q, k, v, 3, 8))
    out_ref, lse_ref = attention(q, k, v, return_lse=True)
    assert np.abs(lse_ref).max() > 750, "the case should have |lse| > 750"
    assert_close(o, out_ref, "o with lse in the hundreds")
    assert_close(lse, lse_ref, "lse in the hundreds")


@pytest.mark.hint("merging is order-free: swapping the parts or regrouping three parts gives the same state")
@given(seed=seeds, sizes=st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 5)))
def test_merge_order_does_not_matter(answer, seed, sizes):
    q, k, v = qkv(seed, 2, max(sum(sizes), 1), 4, dv=3)
    cuts = np.cumsum((0,) + sizes)
    a, b, c = (part(q, k, v, x, y) for x, y in zip(cuts, cuts[1:]))
    ab, ba = answer.merge_states(*a, *b), answer.merge_states(*b, *a)
    assert_close(ab[0], ba[0], "o of merge(a, b) vs merge(b, a)")
    assert_close(ab[1], ba[1], "lse of merge(a, b) vs merge(b, a)")
    left = answer.merge_states(*ab, *c)
    right = answer.merge_states(*a, *answer.merge_states(*b, *c))
    assert_close(left[0], right[0], "o of (a + b) + c vs a + (b + c)")
    assert_close(left[1], right[1], "lse of (a + b) + c vs a + (b + c)")
