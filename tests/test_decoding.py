"""Flash-decoding and the merge of partial states, against the textbook reference."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lessons import attention, flash_decoding, merge_states, reduce_states
from lessons.schedules.split_kv import split_ranges

ATOL = 1e-12


def qkv(nq, nk, d=6, dv=4, seed=0, spread=1.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(d) if nq is None else rng.standard_normal((nq, d))
    return q * spread, rng.standard_normal((nk, d)) * spread, rng.standard_normal((nk, dv))


def empty_state(shape, dv):
    return np.zeros((*shape, dv)), np.full(shape, -np.inf)


# --- merge_states ------------------------------------------------------------------------

def test_merge_hand_computed():
    # state a: one key, score 0 (sum exp = 1), value 1; state b: sum exp = 3, output 5.
    o, lse = merge_states(np.array([1.0]), np.array(0.0), np.array([5.0]), np.array(np.log(3.0)))
    assert lse == pytest.approx(np.log(4.0), abs=1e-15)
    assert o[0] == pytest.approx((1 * 1 + 3 * 5) / 4, abs=1e-15)


@pytest.mark.parametrize("nk", [1, 2, 9, 33])
def test_merging_the_two_halves_of_the_keys_gives_attention_over_all(nk):
    q, k, v = qkv(5, nk, seed=nk, spread=2.0)
    ref, ref_lse = attention(q, k, v, return_lse=True)
    for cut in range(nk + 1):                              # cut 0 and nk: one side is empty
        o_a, lse_a = attention(q, k[:cut], v[:cut], return_lse=True)
        o_b, lse_b = attention(q, k[cut:], v[cut:], return_lse=True)
        o, lse = merge_states(o_a, lse_a, o_b, lse_b)
        np.testing.assert_allclose(o, ref, rtol=0, atol=ATOL)
        np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=ATOL)


def test_merge_of_two_empties_stays_empty_without_nan():
    with np.errstate(all="raise"):                          # not even an invalid-operation warning
        o, lse = merge_states(*empty_state((3,), 4), *empty_state((3,), 4))
    np.testing.assert_array_equal(o, np.zeros((3, 4)))
    np.testing.assert_array_equal(lse, np.full(3, -np.inf))


def test_empty_is_the_identity_and_merge_is_commutative_and_associative():
    rng = np.random.default_rng(1)
    states = [(rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 3)) * 10) for _ in range(3)]
    a, b, c = states
    e = empty_state((2, 3), 5)
    for left, right in [(a, e), (e, a)]:
        o, lse = merge_states(*left, *right)
        np.testing.assert_array_equal(o, a[0])
        np.testing.assert_array_equal(lse, a[1])
    ab, ba = merge_states(*a, *b), merge_states(*b, *a)
    np.testing.assert_allclose(ab[0], ba[0], rtol=0, atol=1e-15)
    np.testing.assert_allclose(ab[1], ba[1], rtol=0, atol=1e-15)
    ab_c = merge_states(*ab, *c)
    a_bc = merge_states(*a, *merge_states(*b, *c))
    np.testing.assert_allclose(ab_c[0], a_bc[0], rtol=0, atol=ATOL)
    np.testing.assert_allclose(ab_c[1], a_bc[1], rtol=0, atol=ATOL)


def test_mixed_rows_some_empty_some_not():
    o_a = np.array([[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]])
    lse_a = np.array([0.5, -np.inf, -np.inf])
    o_b = np.array([[0.0, 0.0], [0.0, 0.0], [7.0, 8.0]])
    lse_b = np.array([-np.inf, -np.inf, 2.0])
    o, lse = merge_states(o_a, lse_a, o_b, lse_b)
    np.testing.assert_array_equal(o, [[1.0, 2.0], [0.0, 0.0], [7.0, 8.0]])
    np.testing.assert_array_equal(lse, [0.5, -np.inf, 2.0])


def test_an_empty_state_is_empty_whatever_its_o_holds():
    o, lse = merge_states(np.array([np.nan, np.inf]), np.array(-np.inf), np.array([1.0, 2.0]), np.array(0.25))
    np.testing.assert_array_equal(o, [1.0, 2.0])
    assert lse == 0.25


def test_merge_with_dv_zero_still_merges_lse():
    # no value columns: o stays empty, lse is still log(e^a + e^b) (hand: log(1 + e) for 0 and 1)
    o, lse = merge_states(np.zeros((3, 0)), np.array([0.0, 1.0, -np.inf]),
                          np.zeros((3, 0)), np.array([1.0, -np.inf, -np.inf]))
    assert o.shape == (3, 0)
    np.testing.assert_allclose(lse, [np.log1p(np.e), 1.0, -np.inf], rtol=1e-15)
    o, lse = reduce_states(np.zeros((4, 2, 0)), np.zeros((4, 2)), order="tree")
    assert o.shape == (2, 0)
    np.testing.assert_allclose(lse, [np.log(4.0)] * 2, rtol=1e-15)


def test_merge_does_not_overflow_with_huge_lse():
    o, lse = merge_states(np.array([1.0]), np.array(1000.0), np.array([3.0]), np.array(1000.0))
    assert lse == pytest.approx(1000.0 + np.log(2.0), abs=1e-12)
    assert o[0] == pytest.approx(2.0, abs=1e-15)


@pytest.mark.parametrize("args, exc, words", [
    ((np.zeros((2, 3)), np.zeros(2), np.zeros((2, 4)), np.zeros(2)), ValueError, ["o_a and o_b", "(2, 3)", "(2, 4)"]),
    ((np.zeros((2, 3)), np.zeros(3), np.zeros((2, 3)), np.zeros(2)), ValueError, ["lse_a", "(2,)", "(3,)"]),
    ((np.zeros((2, 3)), np.zeros(2), np.zeros((2, 3)), np.zeros((2, 1))), ValueError, ["lse_b"]),
    ((np.zeros(3, dtype=int), np.array(0.0), np.zeros(3), np.array(0.0)), TypeError, ["o_a", "float"]),
    ((np.array(1.0), np.array(0.0), np.array(1.0), np.array(0.0)), ValueError, ["o_a"]),
])
def test_merge_bad_input(args, exc, words):
    with pytest.raises(exc) as err:
        merge_states(*args)
    for w in words:
        assert w in str(err.value)


# --- reduce_states: left fold and tree give the same answer --------------------------------

@pytest.mark.parametrize("num_states", [1, 2, 3, 5, 8, 13])
def test_left_fold_and_tree_agree_with_attention(num_states):
    q, k, v = qkv(3, 4 * num_states + 1, seed=num_states, spread=1.5)
    parts = [attention(q, k[a:b], v[a:b], return_lse=True) for a, b in split_ranges(k.shape[0], num_states)]
    o = np.stack([p[0] for p in parts]); lse = np.stack([p[1] for p in parts])
    ref, ref_lse = attention(q, k, v, return_lse=True)
    left = reduce_states(o, lse, order="left")
    tree = reduce_states(o, lse, order="tree")
    for got in (left, tree):
        np.testing.assert_allclose(got[0], ref, rtol=0, atol=ATOL)
        np.testing.assert_allclose(got[1], ref_lse, rtol=0, atol=ATOL)
    np.testing.assert_allclose(left[0], tree[0], rtol=0, atol=ATOL)


def test_tree_merges_neighbours_in_rounds():
    # Five states: the tree computes ((s0+s1)+(s2+s3))+s4, written out by hand here.
    rng = np.random.default_rng(4)
    o = rng.standard_normal((5, 2, 3)); lse = rng.standard_normal((5, 2))
    s = [(o[i], lse[i]) for i in range(5)]
    by_hand = merge_states(*merge_states(*merge_states(*s[0], *s[1]), *merge_states(*s[2], *s[3])), *s[4])
    tree = reduce_states(o, lse, order="tree")
    np.testing.assert_array_equal(tree[0], by_hand[0])
    np.testing.assert_array_equal(tree[1], by_hand[1])


def test_reduce_of_nothing_is_empty():
    o, lse = reduce_states(np.zeros((0, 2, 3)), np.zeros((0, 2)), order="tree")
    np.testing.assert_array_equal(o, np.zeros((2, 3)))
    np.testing.assert_array_equal(lse, np.full(2, -np.inf))


def test_reduce_bad_input():
    with pytest.raises(ValueError, match="order"):
        reduce_states(np.zeros((2, 3)), np.zeros(2), order="right")
    with pytest.raises(ValueError, match="lse must have shape"):
        reduce_states(np.zeros((2, 3)), np.zeros(3))


# --- split_ranges ----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 7, 64, 65])
def test_split_ranges_are_contiguous_and_cover_everything(n):
    for num_splits in range(1, n + 4):
        ranges = split_ranges(n, num_splits)
        assert len(ranges) == num_splits
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        chunk = max(1, -(-n // num_splits))
        assert all(stop - start <= chunk for start, stop in ranges)
        assert sum(stop - start for start, stop in ranges) == n


def test_split_ranges_by_hand():
    assert split_ranges(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert split_ranges(3, 5) == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]


# --- flash_decoding ----------------------------------------------------------------------------

@pytest.mark.parametrize("nk", [1, 7, 16, 17, 40])
@pytest.mark.parametrize("order", ["left", "tree"])
def test_every_num_splits_gives_the_textbook_answer(nk, order):
    q, k, v = qkv(None, nk, seed=nk, spread=2.0)            # one decode query
    ref, ref_lse = attention(q, k, v, return_lse=True)
    for num_splits in range(1, nk + 3):                    # up to two empty workers past Nk
        out, lse = flash_decoding(q, k, v, num_splits, tile=4, order=order, return_lse=True)
        assert out.shape == ref.shape
        np.testing.assert_allclose(out, ref, rtol=0, atol=ATOL)
        assert lse == pytest.approx(ref_lse, abs=ATOL)


@pytest.mark.parametrize("tile", [1, 3, 64])
def test_several_query_rows_and_tiles(tile):
    q, k, v = qkv(5, 50, dv=3, seed=tile)
    ref = attention(q, k, v, scale=0.7)
    for num_splits in (1, 4, 7, 50, 51):
        np.testing.assert_allclose(flash_decoding(q, k, v, num_splits, tile=tile, scale=0.7), ref,
                                   rtol=0, atol=ATOL)


def test_partials_are_attention_over_each_chunk_and_empty_workers_are_empty():
    q, k, v = qkv(None, 10, seed=9)
    out, (o_parts, lse_parts) = flash_decoding(q, k, v, 6, return_partials=True)
    assert o_parts.shape == (6, 4) and lse_parts.shape == (6,)
    for i, (a, b) in enumerate(split_ranges(10, 6)):       # chunks 2,2,2,2,2,0
        o_ref, lse_ref = attention(q, k[a:b], v[a:b], return_lse=True)
        np.testing.assert_allclose(o_parts[i], o_ref, rtol=0, atol=ATOL)
        assert lse_parts[i] == pytest.approx(lse_ref, abs=ATOL) if b > a else lse_parts[i] == -np.inf
    np.testing.assert_array_equal(o_parts[5], 0.0)
    # the final answer is the weighted average of the partials, weights exp(lse_i - lse)
    w = np.exp(lse_parts - np.logaddexp.reduce(lse_parts))
    np.testing.assert_allclose(out, w @ o_parts, rtol=0, atol=ATOL)


def test_float32_partials_stay_float32_and_output_keeps_dtype():
    q, k, v = qkv(None, 30, seed=2)
    out, lse, (o_parts, _) = flash_decoding(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), 4,
                                            return_lse=True, return_partials=True)
    assert out.dtype == np.float16 and o_parts.dtype == np.float32
    np.testing.assert_allclose(out.astype(float), attention(q, k, v), rtol=0, atol=1e-2)


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(num_splits=0), ValueError, "num_splits"),
    (dict(num_splits=2.0), TypeError, "num_splits"),
    (dict(num_splits=True), TypeError, "num_splits"),
    (dict(num_splits=2, tile=0), ValueError, "tile"),
    (dict(num_splits=2, order="random"), ValueError, "order"),
    (dict(num_splits=2, k=np.zeros((5, 7))), ValueError, "head dim"),
    (dict(num_splits=2, v=np.zeros((4, 4))), ValueError, "Nk"),
])
def test_flash_decoding_bad_input(kwargs, exc, word):
    q, k, v = qkv(None, 5)
    args = dict(q=q, k=k, v=v)
    args.update(kwargs)
    with pytest.raises(exc, match=word):
        flash_decoding(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@settings(max_examples=60, deadline=None)
@given(nk=st.integers(0, 60), num_splits=st.integers(1, 70), tile=st.integers(1, 20),
       order=st.sampled_from(["left", "tree"]), spread=st.sampled_from([0.1, 1.0, 8.0]), seed=st.integers(0, 2**16))
def test_property_flash_decoding_equals_textbook(nk, num_splits, tile, order, spread, seed):
    q, k, v = qkv(2, nk, d=3, dv=2, seed=seed, spread=spread)
    out, lse = flash_decoding(q, k, v, num_splits, tile=tile, order=order, return_lse=True)
    ref, ref_lse = attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-11)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-11)


# --- merge weights and the picture ------------------------------------------------------------

def test_merge_weights_by_hand_and_as_the_merge_uses_them():
    from lessons.schedules.split_kv import merge_weights
    np.testing.assert_allclose(merge_weights(np.array([0.0, np.log(3.0), -np.inf])), [0.25, 0.75, 0.0],
                               rtol=0, atol=1e-15)
    np.testing.assert_array_equal(merge_weights(np.full((3, 2), -np.inf)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="NaN"):
        merge_weights(np.array([0.0, np.nan]))
    np.testing.assert_allclose(merge_weights(np.log([[1.0, 3.0], [1.0, 1.0]]), axis=-1), [[0.25, 0.75], [0.5, 0.5]],
                               rtol=0, atol=1e-15)
    for axis, error in ((0.5, TypeError), (2, ValueError), (-3, ValueError), (True, TypeError)):
        with pytest.raises(error, match="axis"):
            merge_weights(np.zeros((2, 2)), axis=axis)


def test_flash_decoding_figure_draws_the_weights_of_the_partials():
    from lessons.schedules.split_kv import merge_weights
    from lessons.views.split_kv import flash_decoding_figure, split_strip_figure
    q, k, v = qkv(None, 20, seed=21)
    out, (o_parts, lse_parts) = flash_decoding(q, k, v, 5, return_partials=True)
    fig = flash_decoding_figure(o_parts, lse_parts, out, attention(q, k, v))
    heights = [p.get_height() for p in fig.axes[0].patches]
    np.testing.assert_allclose(heights, merge_weights(lse_parts), rtol=0, atol=1e-15)
    assert sum(heights) == pytest.approx(1.0, abs=1e-12)
    strip = split_strip_figure(20, 5)
    assert [(p.get_x(), p.get_width()) for p in strip.axes[0].patches] == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4)]
    assert "(contiguous chunks of 4)" in strip.axes[0].get_title(loc="left")
    # 128 keys over 6 workers: ceil(128 / 6) = 22 keys each, the last gets 128 - 5 * 22 = 18
    strip = split_strip_figure(128, 6)
    assert "(contiguous chunks of 22 (last: 18))" in strip.axes[0].get_title(loc="left")
    assert v.shape[1] <= 8 and "dims)" not in fig.axes[2].get_title()     # every dim drawn: no note
    wide = flash_decoding_figure(np.zeros((2, 32)), np.zeros(2), np.zeros(32), dims=8)
    assert wide.axes[2].get_title().endswith("(first 8 of 32 dims)")
    with pytest.raises(ValueError, match="o_parts"):
        flash_decoding_figure(o_parts, lse_parts[:2], out)


@pytest.mark.parametrize("change, exc, match", [
    (dict(exact=np.zeros(5)), ValueError, r"exact must have the shape of out \(3,\) \(dv,\), got \(5,\)"),
    (dict(exact=np.zeros(2)), ValueError, r"exact must have the shape of out \(3,\) \(dv,\), got \(2,\)"),
    (dict(dims=0), ValueError, "dims must be at least 1, got 0"),
    (dict(dims=-1), ValueError, "dims must be at least 1, got -1"),
    (dict(dims=2.5), TypeError, "dims must be an int, got float 2.5"),
    (dict(dims="a"), TypeError, "dims must be an int, got str 'a'"),
    (dict(o_parts=np.zeros((4, 3), complex)), TypeError, "o_parts must have a float dtype"),
])
def test_flash_decoding_figure_refuses_what_does_not_fit_by_name(change, exc, match):
    """An exact output of another problem is not drawn beside this one's, even when it is longer."""
    from lessons.views.split_kv import flash_decoding_figure
    q, k, v = qkv(None, 20, dv=3, seed=22)
    out, (o_parts, lse_parts) = flash_decoding(q, k, v, 4, return_partials=True)
    args = {**dict(o_parts=o_parts, lse_parts=lse_parts, out=out, exact=attention(q, k, v), dims=8), **change}
    with pytest.raises(exc, match=match):
        flash_decoding_figure(args.pop("o_parts"), args.pop("lse_parts"), args.pop("out"), **args)
