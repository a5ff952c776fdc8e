"""The fold and the tiled schedule against the textbook reference (materialised S)."""

import numpy as np
import pytest

from lessons import State, absorb, attention, finalize, flash_attention, merge

TILE = 64


def qkv(nq, nk, d, dv=None, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    return (rng.standard_normal((nq, d)) * scale, rng.standard_normal((nk, d)) * scale,
            rng.standard_normal((nk, dv)))


def naive_loop_attention(q, k, v, scale, visible):
    """A third, independent computation: a Python loop over rows with math.exp."""
    import math
    out = np.zeros((q.shape[0], v.shape[1]))
    for i in range(q.shape[0]):
        s = [float(q[i] @ k[j]) * scale for j in range(k.shape[0]) if visible[i, j]]
        js = [j for j in range(k.shape[0]) if visible[i, j]]
        if not s:
            continue
        mx = max(s)
        w = [math.exp(x - mx) for x in s]
        out[i] = sum(wi * v[j] for wi, j in zip(w, js)) / sum(w)
    return out


# --- the textbook reference itself, against a hand-written loop -------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_plain_python_loop(causal):
    q, k, v = qkv(7, 11, 5, dv=3, seed=1)
    vis = np.ones((7, 11), bool)
    if causal:
        vis = np.arange(11)[None, :] <= np.arange(7)[:, None] + 11 - 7
    np.testing.assert_allclose(attention(q, k, v, causal=causal), naive_loop_attention(q, k, v, 1 / np.sqrt(5), vis),
                               rtol=0, atol=1e-13)


def test_reference_hand_computed_two_keys():
    # q.k = (1, 0) with scale 1: weights e/(e+1), 1/(e+1)
    q = np.array([1.0, 0.0]); k = np.array([[1.0, 0.0], [0.0, 1.0]]); v = np.array([[2.0], [4.0]])
    e = np.e
    out, lse = attention(q, k, v, scale=1.0, return_lse=True)
    assert out.shape == (1,)
    assert out[0] == pytest.approx((2 * e + 4) / (e + 1), abs=1e-15)
    assert lse == pytest.approx(np.log(e + 1), abs=1e-15)


# --- flash == textbook over the sweep ----------------------------------------------------

SWEEP_N = [1, TILE - 1, TILE, TILE + 1, 2 * TILE + 1, 1000]


@pytest.mark.parametrize("n", SWEEP_N)
@pytest.mark.parametrize("tile", [1, 3, 64, 2000])
def test_flash_matches_textbook_over_n_and_tile(n, tile):
    if tile == 1 and n == 1000:
        n = 300  # keep tile=1 fast; 300 keys is still many tiles
    q, k, v = qkv(min(n, 130), n, 16, seed=n + tile)
    out, lse = attention(q, k, v, return_lse=True)
    fo, flse = flash_attention(q, k, v, tile, return_lse=True)
    assert fo.shape == out.shape and fo.dtype == np.float64
    assert np.max(np.abs(fo - out)) <= 1e-12
    assert np.max(np.abs(flse - lse)) <= 1e-12


@pytest.mark.parametrize("d", [1, 3, 64, 129])
@pytest.mark.parametrize("tile", [1, 3, 64])
def test_flash_matches_textbook_over_d(d, tile):
    q, k, v = qkv(40, 150, d, dv=7, seed=d)
    assert np.max(np.abs(flash_attention(q, k, v, tile) - attention(q, k, v))) <= 1e-12


@pytest.mark.parametrize("nq,nk", [(1, 100), (37, 100), (100, 37), (129, 300)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_q", [1, 16, 64, 500])
def test_flash_nq_ne_nk_and_causal(nq, nk, causal, block_q):
    q, k, v = qkv(nq, nk, 8, seed=nq * nk)
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    fo, flse = flash_attention(q, k, v, 16, block_q=block_q, causal=causal, return_lse=True)
    assert not np.isnan(fo).any() and not np.isnan(flse).any()
    assert np.max(np.abs(fo - out)) <= 1e-12
    np.testing.assert_array_equal(np.isneginf(flse), np.isneginf(lse))
    fin = np.isfinite(lse)
    assert np.max(np.abs(flse[fin] - lse[fin]), initial=0) <= 1e-12


def test_causal_is_bottom_right_aligned():
    # Nq=2, Nk=4: row 0 sees keys 0..2, row 1 sees keys 0..3 (FA-2 convention)
    q, k, v = qkv(2, 4, 3, seed=3)
    vis = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
    expect = naive_loop_attention(q, k, v, 1 / np.sqrt(3), vis)
    np.testing.assert_allclose(attention(q, k, v, causal=True), expect, atol=1e-14, rtol=0)
    np.testing.assert_allclose(flash_attention(q, k, v, 1, causal=True), expect, atol=1e-14, rtol=0)


def test_causal_rows_with_nothing_visible_are_zero_with_lse_minus_inf():
    q, k, v = qkv(10, 4, 3, seed=4)  # Nq > Nk: the first 6 rows see no key
    for f in (attention, lambda *a, **kw: flash_attention(*a, tile=2, **kw)):
        out, lse = f(q, k, v, causal=True, return_lse=True)
        assert np.all(out[:6] == 0) and np.all(np.isneginf(lse[:6]))
        assert np.all(np.isfinite(lse[6:]))


def test_mask_blanking_whole_first_tile():
    q, k, v = qkv(20, 50, 4, seed=5)
    mask = np.ones((20, 50), bool)
    mask[:, :16] = False  # the whole first tile (tile=16) is masked for every row
    out = attention(q, k, v, mask=mask)
    fo, tr = flash_attention(q, k, v, 16, mask=mask, return_trace=True)
    assert not np.isnan(fo).any()
    assert np.max(np.abs(fo - out)) <= 1e-12
    np.testing.assert_allclose(out, attention(q, k[16:], v[16:]), atol=1e-13, rtol=0)
    first = tr.row(0)
    assert np.isneginf(first.m[0]) and first.l[0] == 0 and first.alpha[0] == 0


def test_mask_blanking_a_whole_row_gives_zero_and_minus_inf():
    q, k, v = qkv(5, 30, 4, seed=6)
    mask = np.ones((5, 30), bool)
    mask[2] = False
    for f in (attention, lambda *a, **kw: flash_attention(*a, tile=7, **kw)):
        out, lse = f(q, k, v, mask=mask, return_lse=True)
        assert np.all(out[2] == 0) and np.isneginf(lse[2])
        assert not np.isnan(out).any()


@pytest.mark.parametrize("shape", [(30,), (1, 30), (5, 1)])
def test_broadcastable_masks(shape):
    q, k, v = qkv(5, 30, 4, seed=7)
    rng = np.random.default_rng(0)
    m = rng.random(shape) > 0.3
    full = np.broadcast_to(m, (5, 30))
    np.testing.assert_allclose(flash_attention(q, k, v, 8, mask=m), attention(q, k, v, mask=full), atol=1e-12, rtol=0)


def test_very_large_scores():
    q, k, v = qkv(16, 200, 8, seed=8, scale=1.0)
    q *= 3000.0  # |s| ~ 1e4
    s = q @ k.T / np.sqrt(8)
    assert np.abs(s).max() > 5e3
    out = attention(q, k, v)
    assert np.isfinite(out).all()
    for tile in (1, 7, 64):
        assert np.max(np.abs(flash_attention(q, k, v, tile) - out)) <= 1e-12
    # |s|~1e4 softmax is almost one-hot: check against the argmax row of v
    top = np.argmax(s, axis=1)
    gap = np.sort(s, axis=1)[:, -1] - np.sort(s, axis=1)[:, -2]
    sharp = gap > 50
    np.testing.assert_allclose(out[sharp], v[top[sharp]], atol=1e-12)


def test_default_scale_is_inverse_sqrt_d():
    q, k, v = qkv(9, 20, 16, seed=9)
    np.testing.assert_allclose(flash_attention(q, k, v, 4), flash_attention(q, k, v, 4, scale=0.25), atol=0, rtol=0)
    np.testing.assert_allclose(attention(q, k, v), attention(q, k, v, scale=0.25), atol=0, rtol=0)
    assert np.max(np.abs(flash_attention(q, k, v, 4, scale=1.3) - attention(q, k, v, scale=1.3))) <= 1e-12
    assert np.max(np.abs(attention(q, k, v, scale=1.3) - attention(q, k, v))) > 1e-3


def test_single_query_vector_shapes():
    q, k, v = qkv(1, 10, 4, dv=6, seed=10)
    out, lse = flash_attention(q[0], k, v, 3, return_lse=True)
    assert out.shape == (6,) and np.ndim(lse) == 0
    np.testing.assert_allclose(out, attention(q, k, v)[0], atol=1e-14, rtol=0)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-6), (np.float16, 2e-3)])
def test_low_precision_dtypes(dtype, tol):
    q, k, v = qkv(30, 90, 16, seed=11)
    exact = attention(q, k, v)
    fo = flash_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), 16)
    assert fo.dtype == dtype
    assert np.max(np.abs(fo.astype(np.float64) - exact)) <= tol


# --- trace invariants -------------------------------------------------------------------

@pytest.mark.parametrize("tile", [1, 5, 16, 100])
def test_trace_invariants(tile):
    q, k, v = qkv(12, 77, 8, seed=12)
    exact = attention(q, k, v)
    out, tr = flash_attention(q, k, v, tile, block_q=5, return_trace=True)
    n_tiles = -(-77 // tile)
    assert len(tr) == n_tiles * 3  # 3 query blocks of <= 5 rows
    for i in range(12):
        r = tr.row(i)
        assert len(r) == n_tiles
        assert np.all(r.alpha <= 1) and np.all(r.alpha >= 0)
        assert np.all(np.diff(r.m) >= 0)
        np.testing.assert_array_equal(r.m_before[1:], r.m[:-1])
        assert np.isneginf(r.m_before[0])
        np.testing.assert_array_equal(r.key_start, np.arange(n_tiles) * tile)
        np.testing.assert_array_equal(r.key_stop, np.minimum(np.arange(1, n_tiles + 1) * tile, 77))
        assert np.max(np.abs(r.output[-1] - exact[i])) <= 1e-12
        # the running max is the max of all scores seen so far
        s_all = q[i] @ k.T / np.sqrt(8)
        np.testing.assert_allclose(r.m, [s_all[:stop].max() for stop in r.key_stop], atol=1e-14, rtol=0)
        # l is the softmax denominator over the keys seen so far, at the current max
        np.testing.assert_allclose(r.l, [np.exp(s_all[:stop] - mm).sum() for stop, mm in zip(r.key_stop, r.m)],
                                   rtol=1e-13)
        # the running output is the exact attention over the keys seen so far
        for t, stop in enumerate(r.key_stop):
            np.testing.assert_allclose(r.output[t], attention(q[i], k[:stop], v[:stop]), atol=1e-13, rtol=0)


def test_trace_records_one_per_tile_and_row():
    q, k, v = qkv(7, 20, 4, seed=13)
    _, tr = flash_attention(q, k, v, 6, block_q=3, return_trace=True)
    recs = list(tr.records())
    assert len(recs) == 7 * 4
    assert {(r["row"], r["tile"]) for r in recs} == {(i, t) for i in range(7) for t in range(4)}
    rec = next(r for r in recs if r["row"] == 4 and r["tile"] == 2)
    np.testing.assert_allclose(rec["scores"], q[4] @ k[12:18].T / 2.0, atol=1e-14, rtol=0)


def test_trace_skips_tiles_above_the_diagonal():
    q, k, v = qkv(32, 32, 4, seed=14)
    _, tr = flash_attention(q, k, v, 8, block_q=8, causal=True, return_trace=True)
    # 4x4 tiles, lower triangle incl. diagonal = 10 absorbed
    assert len(tr) == 10
    assert len(tr.row(0)) == 1 and len(tr.row(31)) == 4


def test_running_error_positive_before_last_tile_on_real_like_data():
    q, k, v = qkv(1, 64, 8, seed=15)
    exact = attention(q, k, v)[0]
    _, tr = flash_attention(q, k, v, 8, return_trace=True)
    err = tr.row(0).errors(exact)
    assert np.all(err[:-1] > 1e-6) and err[-1] <= 1e-14


# --- the state algebra ------------------------------------------------------------------

def test_merge_equals_absorbing_both_in_either_order():
    q, k, v = qkv(4, 30, 5, seed=16)
    s = q @ k.T
    a = absorb(State.empty(4, 5), s[:, :12], v[:12])
    b = absorb(State.empty(4, 5), s[:, 12:], v[12:])
    whole = absorb(State.empty(4, 5), s, v)
    for mm in (merge(a, b), merge(b, a)):
        np.testing.assert_allclose(finalize(mm)[0], finalize(whole)[0], atol=1e-14, rtol=0)
        np.testing.assert_allclose(finalize(mm)[1], finalize(whole)[1], atol=1e-14, rtol=0)


def test_empty_states_never_make_nan():
    e = State.empty(3, 2)
    for st in (merge(e, e), absorb(e, np.full((3, 4), -np.inf), np.ones((4, 2)))):
        assert np.all(np.isneginf(st.m)) and np.all(st.l == 0) and np.all(st.o == 0)
        out, lse = finalize(st)
        assert np.all(out == 0) and np.all(np.isneginf(lse))
    full = absorb(e, np.zeros((3, 4)), np.ones((4, 2)))
    for st in (merge(e, full), merge(full, e)):
        np.testing.assert_array_equal(finalize(st)[0], np.ones((3, 2)))


def test_merge_shape_mismatch():
    with pytest.raises(ValueError, match="shapes"):
        merge(State.empty(3, 2), State.empty(3, 4))


# --- bad input ----------------------------------------------------------------------------

GOOD = qkv(4, 6, 3, seed=17)


@pytest.mark.parametrize("fn", [attention, flash_attention])
@pytest.mark.parametrize("args,exc,match", [
    ((GOOD[0][:, :2], GOOD[1], GOOD[2]), ValueError, "head dim d"),
    ((GOOD[0], GOOD[1][:5], GOOD[2]), ValueError, "number of keys Nk"),
    ((GOOD[0][None], GOOD[1], GOOD[2]), ValueError, "q must be"),
    ((GOOD[0], GOOD[1][0], GOOD[2]), ValueError, "k must be 2-D"),
    ((GOOD[0], GOOD[1], GOOD[2][..., None]), ValueError, "v must be 2-D"),
    ((GOOD[0].astype(int), GOOD[1], GOOD[2]), TypeError, "q must have a float dtype"),
    ((GOOD[0], GOOD[1], GOOD[2].astype(np.complex128)), TypeError, "v must have a float dtype"),
    (("abc", GOOD[1], GOOD[2]), TypeError, "q must be a float array"),
])
def test_bad_shapes_and_dtypes(fn, args, exc, match):
    with pytest.raises(exc, match=match):
        fn(*args)


@pytest.mark.parametrize("fn", [attention, flash_attention])
def test_bad_masks(fn):
    q, k, v = GOOD
    with pytest.raises(TypeError, match="mask must be a boolean"):
        fn(q, k, v, mask=np.ones((4, 6)))
    with pytest.raises(ValueError, match=r"mask of shape \(5, 6\) is not broadcastable"):
        fn(q, k, v, mask=np.ones((5, 6), bool))
    with pytest.raises(ValueError, match="mask must be broadcastable"):
        fn(q, k, v, mask=np.ones((1, 4, 6), bool))


@pytest.mark.parametrize("tile,exc,match", [(0, ValueError, "must be at least 1"),
                                            (-3, ValueError, "must be at least 1"),
                                            (2.5, TypeError, "must be an int"),
                                            (True, TypeError, "must be an int")])
def test_bad_tile(tile, exc, match):
    with pytest.raises(exc, match="block_k " + match):
        flash_attention(*GOOD, tile)
    with pytest.raises(exc, match="block_k " + match):
        flash_attention(*GOOD, block_k=tile)
    with pytest.raises(exc, match="tile " + match):
        flash_attention(*GOOD, tile=tile)


def test_tile_is_an_alias_of_block_k():
    q, k, v = qkv(9, 13, 4, seed=4)
    by_position, trace = flash_attention(q, k, v, 5, block_q=4, return_trace=True)
    assert trace.tile == trace.block_k == trace.row(0).block_k == 5 and trace.block_q == 4
    assert [s.key_start for s in trace.steps[:3]] == [0, 5, 10]
    for kwargs in (dict(block_k=5), dict(tile=5), dict(block_k=5, tile=5)):
        assert np.array_equal(flash_attention(q, k, v, block_q=4, **kwargs), by_position)
    assert flash_attention(q, k, v, return_trace=True)[1].tile == 64          # the default
    with pytest.raises(ValueError, match="block_k or its alias tile, not both"):
        flash_attention(q, k, v, 4, tile=5)


def test_bad_block_q_and_scale():
    with pytest.raises(ValueError, match="block_q must be at least 1"):
        flash_attention(*GOOD, 2, block_q=0)
    with pytest.raises(TypeError, match="scale must be a real number"):
        attention(*GOOD, scale="0.5")
    with pytest.raises(ValueError, match="scale must be finite"):
        flash_attention(*GOOD, scale=float("nan"))
    with pytest.raises(ValueError, match="scale must be finite, got a number too large for a float: 1000"):
        attention(*GOOD, scale=10**400)


def test_a_scale_of_any_real_kind_is_one_float():
    from fractions import Fraction
    np.testing.assert_array_equal(attention(*GOOD, scale=Fraction(1, 8)), attention(*GOOD, scale=0.125))
    np.testing.assert_array_equal(attention(*GOOD, scale=np.float32(0.125)), attention(*GOOD, scale=0.125))


# --- bad data is never reported as an empty row ---------------------------------------------

@pytest.mark.parametrize("fn", [attention, lambda *a, **kw: flash_attention(*a, tile=1, **kw)])
def test_nan_and_overflow_propagate_instead_of_looking_empty(fn):
    with np.errstate(invalid="ignore", over="ignore"):
        out, lse = fn(np.array([[np.nan, 0.0]]), np.eye(2), np.eye(2), return_lse=True)
        assert np.isnan(out).all() and np.isnan(lse).all()
        out = fn(np.array([[1e200, 0.0]]), np.array([[1e200, 0.0], [0.0, 0.0]]), np.eye(2))
        assert np.isnan(out).all()


@pytest.mark.parametrize("fn", [attention, flash_attention])
@pytest.mark.parametrize("name,value", [("causal", "no"), ("causal", np.array([True, False])),
                                        ("return_lse", "yes"), ("causal", 1)])
def test_flags_must_be_bools(fn, name, value):
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        fn(*GOOD, **{name: value})


def test_absorb_refuses_shapes_that_do_not_fit():
    st = State.empty(2, 3)
    with pytest.raises(ValueError, match=r"s must have shape \(R, T\) with R = 2"):
        absorb(st, np.zeros((1, 4)), np.ones((4, 3)))
    with pytest.raises(ValueError, match=r"v must have shape \(T, dv\) = \(4, 3\)"):
        absorb(st, np.zeros((2, 4)), np.ones((4, 1)))
    with pytest.raises(TypeError, match="s must have a float dtype"):
        absorb(st, np.zeros((2, 4), int), np.ones((4, 3)))
    with pytest.raises(TypeError, match="state must be a lessons.State"):
        absorb((0, 0, 0), np.zeros((2, 4)), np.ones((4, 3)))
    same = absorb(st, np.zeros((2, 0)), np.zeros((0, 3)))   # an empty tile changes nothing
    assert np.isneginf(same.m).all() and (same.l == 0).all()
    bad = State(m=np.zeros(3), l=np.zeros(2), o=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="a must hold m"):
        merge(bad, st)


@pytest.mark.parametrize("field, value", [("m", [-np.inf, -np.inf]), ("l", np.zeros(2, int)), ("o", np.ones((2, 3), int)),
                                          ("o", None)])
def test_a_state_built_by_hand_must_hold_float_arrays(field, value):
    """Lists were an AttributeError in absorb; int arrays an error naming m_old, or an output
    finalize truncated to ints."""
    parts = dict(m=np.full(2, -np.inf), l=np.zeros(2), o=np.zeros((2, 3)))
    parts[field] = value
    st = State(**parts)
    for call in (lambda: absorb(st, np.zeros((2, 4)), np.ones((4, 3))), lambda: finalize(st),
                 lambda: merge(State.empty(2, 3), st)):
        with pytest.raises(TypeError, match=rf"\.{field} must be a float NumPy array"):
            call()


def test_correction_factor_takes_plain_floats():
    from lessons import correction_factor
    assert correction_factor(-np.inf, -np.inf) == 0.0
    assert correction_factor(1.0, 3.0) == pytest.approx(np.exp(-2.0))


def test_trace_row_index_must_be_int():
    _, tr = flash_attention(*GOOD, 2, return_trace=True)
    with pytest.raises(TypeError, match="row index i must be an int"):
        tr.row(True)
    with pytest.raises(TypeError, match="row index i must be an int"):
        tr.row(2.0)
    assert tr.row(np.int64(1)).row == 1


def test_a_rank_error_for_any_rank_reads_at_least_n_d():
    import lessons
    with pytest.raises(ValueError, match=r"o_a must be at least 1-D, got shape \(\)$"):
        lessons.merge_states(np.float64(1.0), np.float64(0.0), np.float64(1.0), np.float64(0.0))
    with pytest.raises(ValueError, match=r"o must be at least 2-D, got shape \(2,\)$"):
        lessons.reduce_states(np.array([1.0, 2.0]), np.array([0.0, 0.0]))
