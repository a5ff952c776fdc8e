"""The backward pass: the textbook gradients against finite differences, the flash backward
(recomputing P from the row log-sum-exp) against the textbook one, its trace and its cost."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lessons import attention, attention_backward, causal_mask, flash_attention, flash_attention_backward, \
    safe_softmax
from lessons.schedules.backward import recomputed_probabilities
from lessons.schedules.causal import count_tiles


def qkv(nq, nk, d, dv=None, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    return (rng.standard_normal((nq, d)) * scale, rng.standard_normal((nk, d)) * scale,
            rng.standard_normal((nk, dv)), rng.standard_normal((nq, dv)))


def forward(q, k, v, **kw):
    """O and lse from the textbook forward (not the flash one: the backward must not need it)."""
    return attention(q, k, v, return_lse=True, **kw)


def flash_bwd(q, k, v, do, block_q, block_k, **kw):
    o, lse = forward(q, k, v, **kw)
    return flash_attention_backward(q, k, v, o, lse, do, block_q=block_q, block_k=block_k, **kw)


def max_err(a, b):
    return max(float(np.max(np.abs(x - y))) if x.size else 0.0 for x, y in zip(a, b))


# --- the oracle against central finite differences of lessons.attention ------------------

def finite_differences(q, k, v, do, eps=1e-6, **kw):
    """dL/dx for L = sum(attention(q, k, v) * do), by central differences, one entry at a time."""
    def loss(q_, k_, v_):
        return float(np.sum(attention(q_, k_, v_, **kw) * do))
    grads = []
    for which in range(3):
        args = [q, k, v]
        g = np.zeros_like(args[which])
        for idx in np.ndindex(g.shape):
            plus = [a.copy() for a in args]; minus = [a.copy() for a in args]
            plus[which][idx] += eps; minus[which][idx] -= eps
            g[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        grads.append(g)
    return grads


@pytest.mark.parametrize("nq,nk,causal,use_mask", [(1, 3, False, False), (4, 4, False, False), (3, 6, True, False),
                                                   (6, 3, True, False), (5, 7, False, True), (5, 5, True, True)])
def test_textbook_backward_matches_finite_differences(nq, nk, causal, use_mask):
    q, k, v, do = qkv(nq, nk, 3, dv=2, seed=nq * 10 + nk)
    mask = None
    if use_mask:
        mask = np.random.default_rng(nq).random((nq, nk)) < 0.6
        mask[0] = False                               # one row sees nothing: its gradient is 0
    exact = attention_backward(q, k, v, do, causal=causal, mask=mask)
    fd = finite_differences(q, k, v, do, causal=causal, mask=mask)
    for g, f in zip(exact, fd):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, f, atol=1e-8, rtol=0)
    if use_mask:
        assert np.all(exact[0][0] == 0.0)


def test_textbook_backward_hand_computed_two_keys():
    # scale 1, q = (1, 0), k = I: s = (1, 0), p = (e, 1)/(e + 1); v = (2, 4), do = 1.
    # o = 2 p0 + 4 p1; dv = p; dp = v; dS = p * (v - o); dq = dS_0 k_0 + dS_1 k_1 = dS.
    q = np.array([[1.0, 0.0]]); k = np.eye(2); v = np.array([[2.0], [4.0]]); do = np.array([[1.0]])
    e = math.e
    p = np.array([e, 1.0]) / (e + 1)
    o = 2 * p[0] + 4 * p[1]
    ds = p * (np.array([2.0, 4.0]) - o)
    dq, dk, dv = attention_backward(q, k, v, do, scale=1.0)
    np.testing.assert_allclose(dv[:, 0], p, atol=1e-15)
    np.testing.assert_allclose(dq[0], ds, atol=1e-15)
    np.testing.assert_allclose(dk, np.outer(ds, q[0]), atol=1e-15)
    assert ds.sum() == pytest.approx(0.0, abs=1e-15)     # softmax's Jacobian kills a constant shift


# --- flash == textbook over the forward's sweep ------------------------------------------

SWEEP_N = [1, 63, 64, 65, 129, 1000]


@pytest.mark.parametrize("n", SWEEP_N)
@pytest.mark.parametrize("block_k", [1, 3, 64, 2000])
def test_flash_backward_matches_textbook_over_n_and_block_k(n, block_k):
    if block_k < 64 and n == 1000:
        n = 300
    nq = min(n, 130)
    q, k, v, do = qkv(nq, n, 16, seed=n + block_k)
    got = flash_bwd(q, k, v, do, 32, block_k)
    want = attention_backward(q, k, v, do)
    assert [g.shape for g in got] == [q.shape, k.shape, v.shape]
    assert all(g.dtype == np.float64 for g in got)
    assert max_err(got, want) <= 1e-12


@pytest.mark.parametrize("nq,nk", [(1, 100), (37, 100), (100, 37), (129, 300)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_q", [1, 16, 64, 500])
def test_flash_backward_nq_ne_nk_and_causal(nq, nk, causal, block_q):
    q, k, v, do = qkv(nq, nk, 8, dv=5, seed=nq + nk + block_q)
    got = flash_bwd(q, k, v, do, block_q, 16, causal=causal)
    assert max_err(got, attention_backward(q, k, v, do, causal=causal)) <= 1e-12


def test_causal_rows_and_keys_nobody_sees_get_zero_gradients():
    # Nq > Nk, bottom-right: the first Nq - Nk rows see no key at all.
    q, k, v, do = qkv(9, 4, 3, seed=3)
    o, lse = flash_attention(q, k, v, 2, block_q=3, causal=True, return_lse=True)
    assert np.isneginf(lse[:5]).all()
    dq, dk, dv = flash_attention_backward(q, k, v, o, lse, do, block_q=2, block_k=3, causal=True)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert np.all(dq[:5] == 0.0)
    assert max_err((dq, dk, dv), attention_backward(q, k, v, do, causal=True)) <= 1e-12


def test_mask_blanking_whole_tiles_rows_and_keys():
    q, k, v, do = qkv(12, 20, 4, seed=4)
    mask = np.ones((12, 20), bool)
    mask[:, :8] = False          # the first two key tiles of 4: blank for every row
    mask[5] = False              # a row that sees nothing
    mask[:, 17] = False          # a key nobody sees
    mask[8:, 8:12] = False       # a whole (query block, key tile) tile
    want = attention_backward(q, k, v, do, mask=mask)
    assert np.all(want[0][5] == 0.0)
    assert np.all(want[1][:8] == 0.0) and np.all(want[2][:8] == 0.0)
    assert np.all(want[1][17] == 0.0) and np.all(want[2][17] == 0.0)
    for bq, bk in [(4, 4), (3, 5), (12, 1)]:
        got = flash_bwd(q, k, v, do, bq, bk, mask=mask)
        assert all(np.isfinite(g).all() for g in got)
        assert max_err(got, want) <= 1e-12
        assert np.all(got[0][5] == 0.0) and np.all(got[1][:8] == 0.0) and np.all(got[2][17] == 0.0)


def test_very_large_scores():
    q, k, v, do = qkv(16, 200, 8, seed=8)
    q *= 3000.0                                   # |s| ~ 1e4
    assert np.abs(q @ k.T / np.sqrt(8)).max() > 5e3
    want = attention_backward(q, k, v, do)
    assert all(np.isfinite(g).all() for g in want)
    # A score of size |s| carries a rounding of |s| * eps (~3e-12 here), and P = exp(S - L) inherits it
    # as a relative error: float64 cannot promise 1e-12 absolute on dK, whose entries reach 150 (|q| ~ 3e3).
    # So the bound is relative, a few |s|max * eps of each gradient's size.
    smax = np.abs(q @ k.T / np.sqrt(8)).max()
    for bk in (1, 7, 64):
        got = flash_bwd(q, k, v, do, 5, bk)
        for g, w in zip(got, want):
            assert np.abs(g - w).max() <= 4 * smax * np.finfo(float).eps * max(1.0, np.abs(w).max())
        assert np.abs(got[0] - want[0]).max() <= 1e-12            # dQ is O(0.1): absolute 1e-12 holds
    # rows whose top score leads by > 50 have a one-hot softmax: dV is their dO routed to the argmax key,
    # and dQ is 0 (moving q does not change which key wins)
    s = q @ k.T / np.sqrt(8)
    gap = np.sort(s, axis=1)[:, -1] - np.sort(s, axis=1)[:, -2]
    sharp = gap > 50
    assert 5 <= sharp.sum() < len(sharp)
    dq, _, dv = attention_backward(q[sharp], k, v, do[sharp])
    routed = np.zeros_like(v)
    np.add.at(routed, np.argmax(s[sharp], axis=1), do[sharp])
    np.testing.assert_allclose(dv, routed, atol=1e-12, rtol=0)
    np.testing.assert_allclose(dq, 0.0, atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-5), (np.float16, 2e-2)])
def test_low_precision_dtypes(dtype, tol):
    q, k, v, do = qkv(20, 33, 8, seed=5)
    want = attention_backward(q, k, v, do)
    args = [x.astype(dtype) for x in (q, k, v, do)]
    o, lse = flash_attention(*args[:3], 8, block_q=8, return_lse=True)
    got = flash_attention_backward(*args[:3], o, lse, args[3], block_q=8, block_k=8)
    text = attention_backward(*args)
    for g, t, w in zip(got, text, want):
        assert g.dtype == dtype and t.dtype == dtype
        np.testing.assert_allclose(g.astype(float), w, atol=tol * max(1.0, np.abs(w).max()), rtol=0)
        np.testing.assert_allclose(t.astype(float), w, atol=tol * max(1.0, np.abs(w).max()), rtol=0)


def test_single_query_vector():
    q, k, v, do = qkv(1, 9, 4, dv=3, seed=6)
    o, lse = attention(q[0], k, v, return_lse=True)
    dq, dk, dv = flash_attention_backward(q[0], k, v, o, lse, do[0], block_k=4)
    assert dq.shape == (4,) and dk.shape == (9, 4) and dv.shape == (9, 3)
    full = attention_backward(q, k, v, do)
    assert max_err((dq[None], dk, dv), full) <= 1e-12
    dq1 = attention_backward(q[0], k, v, do[0])[0]
    assert dq1.shape == (4,) and np.max(np.abs(dq1 - full[0][0])) <= 1e-15


@settings(max_examples=40, deadline=None)
@given(nq=st.integers(1, 20), nk=st.integers(1, 20), bq1=st.integers(1, 25), bk1=st.integers(1, 25),
       bq2=st.integers(1, 25), bk2=st.integers(1, 25), causal=st.booleans(), seed=st.integers(0, 10_000))
def test_block_sizes_never_change_the_result(nq, nk, bq1, bk1, bq2, bk2, causal, seed):
    q, k, v, do = qkv(nq, nk, 3, dv=2, seed=seed)
    a = flash_bwd(q, k, v, do, bq1, bk1, causal=causal)
    b = flash_bwd(q, k, v, do, bq2, bk2, causal=causal)
    assert max_err(a, b) <= 1e-12
    assert all(np.isfinite(g).all() for g in a)


# --- what the backward keeps from the forward --------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_p_recomputed_from_lse_equals_the_stored_p(causal):
    q, k, v, _ = qkv(10, 14, 4, seed=7)
    s = q @ k.T / 2.0
    if causal:
        s = np.where(causal_mask(10, 14), s, -np.inf)
    stored = safe_softmax(s)                               # three passes: max, sum, divide
    _, lse = flash_attention(q, k, v, 3, block_q=4, causal=causal, return_lse=True)
    one_pass = recomputed_probabilities(q, k, lse, causal=causal)
    assert np.max(np.abs(one_pass - stored)) <= 1e-15
    np.testing.assert_allclose(one_pass.sum(axis=1), 1.0, atol=1e-14)


def test_d_is_rowsum_do_times_o_equals_rowsum_p_times_dp():
    q, k, v, do = qkv(6, 9, 4, seed=9)
    o, lse = forward(q, k, v)
    *_, trace = flash_attention_backward(q, k, v, o, lse, do, block_q=2, block_k=4, return_trace=True)
    p = safe_softmax(q @ k.T / 2.0)
    dp = do @ v.T
    np.testing.assert_allclose(trace.D, (p * dp).sum(axis=1), atol=1e-14, rtol=0)


# --- the trace ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_trace_one_step_per_computed_tile_key_blocks_outer(causal):
    nq, nk, bq, bk = 11, 13, 3, 4
    q, k, v, do = qkv(nq, nk, 4, seed=10)
    o, lse = forward(q, k, v, causal=causal)
    dq, dk, dv, trace = flash_attention_backward(q, k, v, o, lse, do, block_q=bq, block_k=bk, causal=causal,
                                                 return_trace=True)
    assert len(trace) == count_tiles(nq, nk, bq, bk, causal=causal).computed
    order = [(s.key_block, s.query_block) for s in trace.steps]
    assert order == sorted(order)                          # outer loop: key blocks; inner: query blocks
    for s in trace.steps:
        assert (s.row_start, s.key_start) == (s.query_block * bq, s.key_block * bk)
        assert s.p.shape == (s.row_stop - s.row_start, s.key_stop - s.key_start)
    # the last step of each key block holds the final dK_j, dV_j
    for j in range(-(-nk // bk)):
        last = [s for s in trace.steps if s.key_block == j][-1]
        np.testing.assert_array_equal(last.dk, dk[last.key_start:last.key_stop])
        np.testing.assert_array_equal(last.dv, dv[last.key_start:last.key_stop])
    # the running dK_j after each step is the sum of the tiles seen so far, computed from the textbook dS
    p = safe_softmax(np.where(causal_mask(nq, nk), q @ k.T / 2.0, -np.inf) if causal else q @ k.T / 2.0)
    ds = p * (do @ v.T - (do * o).sum(axis=1, keepdims=True))
    for s in trace.steps:
        r1, c0, c1 = s.row_stop, s.key_start, s.key_stop
        np.testing.assert_allclose(s.dk, 0.5 * ds[:r1, c0:c1].T @ q[:r1], atol=1e-13)
        np.testing.assert_allclose(s.dv, p[:r1, c0:c1].T @ do[:r1], atol=1e-13)
        np.testing.assert_allclose(s.dq, 0.5 * ds[s.row_start:r1, :c1] @ k[:c1], atol=1e-13)


def test_trace_running_errors_reach_zero_only_at_the_end():
    q, k, v, do = qkv(8, 12, 4, seed=11)
    o, lse = forward(q, k, v)
    *got, trace = flash_attention_backward(q, k, v, o, lse, do, block_q=4, block_k=4, return_trace=True)
    exact = attention_backward(q, k, v, do)
    err = trace.errors(exact)
    assert err.shape == (len(trace), 3)
    assert err[-1].max() <= 1e-12
    assert err[:-1, 0].min() > 1e-3                        # dQ rows are partial until the last key block
    assert err[:-1, 1].max() > 1e-3                        # later dK_j blocks are still 0 early on
    before = trace.gradients_after(-1)
    assert all(np.all(g == 0) for g in before)
    np.testing.assert_array_equal(trace.gradients_after(len(trace) - 1)[0], got[0])
    with pytest.raises(IndexError, match="step t"):
        trace.gradients_after(len(trace))
    with pytest.raises(ValueError, match="exact must be"):
        trace.errors(exact[:2])


# --- bad input ---------------------------------------------------------------------------

def good():
    q, k, v, do = qkv(4, 5, 3, dv=2)
    o, lse = forward(q, k, v)
    return dict(q=q, k=k, v=v, o=o, lse=lse, do=do)


@pytest.mark.parametrize("change,exc,match", [
    (dict(do=np.zeros((4, 3))), ValueError, r"do must have shape \(4, 2\)"),
    (dict(do=np.zeros(2)), ValueError, "do must be 2-D"),
    (dict(o=np.zeros((5, 2))), ValueError, r"o must have shape \(4, 2\)"),
    (dict(lse=np.zeros(3)), ValueError, r"lse must have shape \(4,\)"),
    (dict(lse=np.zeros(4, int)), TypeError, "lse must be a float array"),
    (dict(do=np.zeros((4, 2), int)), TypeError, "do must have a float dtype"),
    (dict(k=np.zeros((5, 4))), ValueError, "head dim d"),
])
def test_bad_shapes_and_dtypes(change, exc, match):
    args = {**good(), **change}
    with pytest.raises(exc, match=match):
        flash_attention_backward(args["q"], args["k"], args["v"], args["o"], args["lse"], args["do"])
    if "o" not in change and "lse" not in change:
        with pytest.raises(exc, match=match):
            attention_backward(args["q"], args["k"], args["v"], args["do"])


@pytest.mark.parametrize("kw,exc,match", [(dict(block_q=0), ValueError, "block_q must be at least 1"),
                                          (dict(block_k=2.0), TypeError, "block_k must be an int"),
                                          (dict(causal="yes"), TypeError, "causal must be True or False"),
                                          (dict(mask=np.ones((3, 5), bool)), ValueError, "not broadcastable"),
                                          (dict(scale=np.inf), ValueError, "scale must be finite")])
def test_bad_options(kw, exc, match):
    a = good()
    with pytest.raises(exc, match=match):
        flash_attention_backward(a["q"], a["k"], a["v"], a["o"], a["lse"], a["do"], **kw)


# --- cost: traffic and FLOPs from the schedule, measured peak memory -----------------------

from lessons.cost.backward import flash_backward_io, measure_backward_peak_memory, textbook_backward_io  # noqa: E402
from lessons.cost.traffic import flash_io, textbook_io  # noqa: E402


@pytest.mark.parametrize("n,d", [(1, 1), (100, 16), (1024, 64)])
def test_textbook_backward_io_closed_form(n, d):
    t = textbook_backward_io(n, d, element_size=4)
    assert t.read_elements == 5 * n * n + 5 * n * d      # P twice, dP, dS twice; dO twice, V, K, Q
    assert t.write_elements == 2 * n * n + 3 * n * d
    assert t.hbm_bytes == 4 * (7 * n * n + 8 * n * d)
    assert t.flops == 4 * 2 * n * n * d == 2 * textbook_io(n, d).flops


@pytest.mark.parametrize("n,d,bq,bk", [(1, 1, 1, 1), (100, 16, 7, 30), (1024, 64, 64, 128), (1000, 64, 1000, 1)])
def test_flash_backward_io_closed_form(n, d, bq, bk):
    f = flash_backward_io(n, d, block_q=bq, block_k=bk)
    tc = -(-n // bk)
    assert f.read_elements == 2 * n * d + 2 * n * d + tc * (3 * n * d + 2 * n)
    assert f.write_elements == n + 2 * n * d + tc * n * d
    assert (f.block_q, f.block_k) == (bq, bk)
    # recomputing S: five N x N x d matmuls, 2.5x the forward's two
    assert f.flops == 5 * 2 * n * n * d
    assert f.flops == 2.5 * flash_io(n, d, m_bytes=1, block_q=bq, block_k=bk, order="fa2").flops


def test_flash_backward_moves_fewer_bytes_than_textbook():
    for n in (1024, 8192, 32768):
        f = flash_backward_io(n, 64, m_bytes=227 * 1024)     # Hopper's shared memory, FA-1 block sizes
        t = textbook_backward_io(n, 64)
        assert f.flops == 1.25 * t.flops                     # one more matmul than the textbook backward
        assert f.hbm_bytes < t.hbm_bytes / 5
    assert flash_backward_io(8192, 64, m_bytes=227 * 1024).block_k == -(-227 * 512 // 256)


def test_flash_backward_io_needs_m_or_both_blocks():
    with pytest.raises(ValueError, match="m_bytes is needed"):
        flash_backward_io(64, 8, block_q=8)
    with pytest.raises(ValueError, match="block_k must be at least 1"):
        flash_backward_io(64, 8, block_q=8, block_k=0)


def test_measured_backward_peak_memory_quadratic_vs_linear():
    ns, d = (256, 512, 1024), 16
    r = measure_backward_peak_memory(ns, d, block_q=32, block_k=32)
    assert r.ns == list(ns) and r.score_bytes == [n * n * 4 for n in ns]
    # textbook holds P, dP and dS: at least two full (N, N) matrices at its peak, at most a handful
    for t, s in zip(r.textbook_bytes, r.score_bytes):
        assert 2 * s <= t <= 8 * s
    assert 1.9 < r.textbook_slope < 2.1
    # flash grows by one row each of dq, dk, dv and one D, L per token
    a, b = r.flash_linear_fit
    assert b == pytest.approx((3 * d + 2) * 4, rel=0.1)
    assert 0 < a < 32 * 32 * 4 * 16
    assert r.flash_slope < 1.05
    assert r.flash_bytes[-1] < r.score_bytes[-1] / 4


# --- the view draws what the trace recorded ------------------------------------------------

def _small_trace(causal=True):
    q, k, v, do = qkv(12, 12, 4, seed=12)
    o, lse = forward(q, k, v, causal=causal)
    *_, trace = flash_attention_backward(q, k, v, o, lse, do, block_q=4, block_k=4, causal=causal, return_trace=True)
    return trace, attention_backward(q, k, v, do, causal=causal)


def test_backward_figure_plots_the_trace_errors():
    from lessons.views.backward import backward_figure
    trace, exact = _small_trace()
    fig = backward_figure(trace, 3, exact, causal=True)
    grid, curves = fig.axes
    err = trace.errors(exact)
    for line, col in zip(curves.lines[:3], range(3)):
        np.testing.assert_array_equal(line.get_ydata(), np.maximum(err[:, col], 1e-17))
    assert len(trace) == 6                                  # 3 x 3 blocks, 3 above the diagonal skipped
    with pytest.raises(ValueError, match="step must be an int in 1..6"):
        backward_figure(trace, 0, exact)
    with pytest.raises(TypeError, match="causal"):
        backward_figure(trace, 3, exact, causal="no")


def test_backward_stepper_readouts_follow_the_slider():
    from lessons.views.backward import BackwardStepper, backward_step_text
    trace, exact = _small_trace()
    st = BackwardStepper(trace, exact, causal=True)
    assert st.slider.max == len(trace)
    st.slider.value = len(trace)
    last = trace.steps[-1]
    assert f"key block <b>{last.key_block + 1}</b>" in st.readouts["key_block"].value
    err = trace.errors(exact)[-1]
    assert f"<b>{float(err[1]):.6g}</b>" in st.readouts["dk_error"].value
    text = backward_step_text(trace, 1, exact)
    first = trace.block_errors(0, exact)
    assert f"{float(first['dk'][0]):.6g}" in text.splitlines()[2]


def test_backward_cost_figure_draws_the_counts():
    from lessons.cost.traffic import PeakMemory
    from lessons.views.backward import backward_cost_figure
    peak = PeakMemory(ns=[512, 1024], d=8, dtype="float32", tile=8, block_q=8, textbook_bytes=[10 ** 6, 4 * 10 ** 6],
                      flash_bytes=[10 ** 4, 2 * 10 ** 4], score_bytes=[512 ** 2 * 4, 1024 ** 2 * 4])
    t, f = textbook_backward_io(1024, 64), flash_backward_io(1024, 64, block_q=64, block_k=128)
    mem, bars = backward_cost_figure(peak, t, f).axes
    np.testing.assert_allclose(mem.lines[0].get_ydata(), np.array(peak.textbook_bytes) / 2 ** 20)
    heights = [p.get_height() for p in bars.patches]
    np.testing.assert_allclose(heights, [t.hbm_bytes / 2 ** 30, t.flops / 1e9, f.hbm_bytes / 2 ** 30, f.flops / 1e9])


# --- a gradient never depends on what its row (or key) cannot see --------------------------

@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                            "ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf, 1e30])
@pytest.mark.parametrize("fn", ["textbook", "flash"])
def test_unseen_keys_and_rows_change_nothing(poison, fn):
    """Key 6 is seen by no row, row 2 sees no key: poisoning their inputs leaves every gradient bitwise equal."""
    q, k, v, do = qkv(5, 8, 4, dv=3, seed=21)
    mask = np.ones((5, 8), bool)
    mask[:, 6] = False
    mask[2] = False
    mask[0, :3] = False                                   # and row 0 does not see keys 0..2

    def grads(q, k, v, do):
        if fn == "textbook":
            return attention_backward(q, k, v, do, mask=mask)
        o, lse = forward(q, k, v, mask=mask)
        return flash_attention_backward(q, k, v, o, lse, do, block_q=2, block_k=3, mask=mask)

    clean = grads(q, k, v, do)
    pq, pk, pv, pdo = q.copy(), k.copy(), v.copy(), do.copy()
    pk[6], pv[6], pq[2], pdo[2] = poison, poison, poison, poison
    dirty = grads(pq, pk, pv, pdo)
    for c, d in zip(clean, dirty):
        assert np.array_equal(c, d), f"max change {np.nanmax(np.abs(c - d))}"
    assert np.all(dirty[0][2] == 0) and np.all(dirty[1][6] == 0) and np.all(dirty[2][6] == 0)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("fn", ["textbook", "flash"])
def test_a_nan_key_reaches_only_the_rows_that_see_it(fn):
    q, k, v, do = qkv(6, 6, 4, seed=22)
    k[5] = np.nan                                          # causal: only the last row sees key 5

    def grads(k):
        if fn == "textbook":
            return attention_backward(q, k, v, do, causal=True)
        o, lse = forward(q, k, v, causal=True)
        return flash_attention_backward(q, k, v, o, lse, do, block_q=2, block_k=2, causal=True)

    clean = grads(np.where(np.isnan(k), 0.0, k))
    dq = grads(k)[0]
    assert np.isnan(dq[5]).all()
    assert np.array_equal(dq[:5], clean[0][:5])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                            "ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["q", "k", "v", "do"])
@pytest.mark.parametrize("fn", ["textbook", "flash"])
def test_bad_data_a_row_sees_stays_with_the_keys_it_sees(fn, where, poison):
    """Row 0 sees only keys 0, 1 and rows 1..3 only keys 2..5: the two groups share no (row, key) pair,
    so NaN or inf in row 0's q or dO, or in key 0's k or v, leaves dq of rows 1..3 and dk, dv of keys 2..5
    bitwise as they are without it (a hidden pair's P and dS are 0, never 0 * NaN)."""
    q, k, v, do = qkv(4, 6, 4, dv=3, seed=23)
    mask = np.zeros((4, 6), bool)
    mask[0, :2] = True
    mask[1:, 2:] = True

    def grads(q, k, v, do):
        if fn == "textbook":
            return attention_backward(q, k, v, do, mask=mask)
        o, lse = forward(q, k, v, mask=mask)
        return flash_attention_backward(q, k, v, o, lse, do, block_q=2, block_k=3, mask=mask)

    clean = grads(q, k, v, do)
    args = dict(q=q.copy(), k=k.copy(), v=v.copy(), do=do.copy())
    args[where][0, 0] = poison
    dq, dk, dv = grads(**args)
    assert np.array_equal(dq[1:], clean[0][1:])
    assert np.array_equal(dk[2:], clean[1][2:]) and np.array_equal(dv[2:], clean[2][2:])
    if np.isnan(poison):                                  # while a NaN row 0 sees makes its dq NaN
        assert np.isnan(dq[0]).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_recomputed_p_is_zero_where_masked_even_in_a_nan_row():
    q, k, _, _ = qkv(3, 5, 4, seed=24)
    mask = np.ones((3, 5), bool)
    mask[0, 3:] = False
    lse = np.array([np.nan, 1.0, 2.0])                     # row 0 saw bad data in the forward
    p = recomputed_probabilities(q, k, lse, mask=mask)
    assert np.isnan(p[0, :3]).all() and np.all(p[0, 3:] == 0)
