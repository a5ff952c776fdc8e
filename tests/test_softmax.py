"""Safe, online and fused softmax against a plain-Python softmax and against hand counts."""
import contextlib
import math

import numpy as np
import pytest

from lessons import flash_attention
from lessons.schedules.softmax import (SOFTMAX_METHODS, fused_softmax_matmul, online_softmax, safe_softmax,
                             softmax_traffic)


def python_softmax(row):
    """An independent softmax: a Python loop with math.exp, -inf entries get 0, all -inf gives zeros."""
    finite = [x for x in row if x != -math.inf]
    if not finite:
        return [0.0] * len(row)
    mx = max(finite)
    e = [0.0 if x == -math.inf else math.exp(x - mx) for x in row]
    total = sum(e)
    return [x / total for x in e]


def rows(x):
    return np.array([python_softmax(list(r)) for r in np.atleast_2d(x)]).reshape(np.shape(x))


X2 = np.random.default_rng(3).standard_normal((4, 13)) * 3


def test_hand_computed_three_elements():
    e = math.e
    expected = [1 / (1 + e + e * e), e / (1 + e + e * e), e * e / (1 + e + e * e)]
    np.testing.assert_allclose(safe_softmax(np.array([1.0, 2.0, 3.0])), expected, rtol=1e-15)
    np.testing.assert_allclose(online_softmax(np.array([1.0, 2.0, 3.0]), 1), expected, rtol=1e-15)


@pytest.mark.parametrize("tile", [1, 2, 3, 12, 13, 14, 100])
def test_online_equals_safe_equals_python_for_every_tile(tile):
    np.testing.assert_allclose(safe_softmax(X2), rows(X2), rtol=1e-13, atol=1e-16)
    np.testing.assert_allclose(online_softmax(X2, tile), rows(X2), rtol=1e-13, atol=1e-16)
    np.testing.assert_allclose(online_softmax(X2[1], tile), rows(X2[1]), rtol=1e-13, atol=1e-16)


def test_one_dimensional_keeps_its_shape():
    assert safe_softmax(X2[0]).shape == (13,)
    assert online_softmax(X2[0], 4).shape == (13,)
    assert online_softmax(X2, 4).shape == (4, 13)


def test_all_minus_inf_row_gives_zeros_and_masked_entries_get_zero():
    x = np.array([[-np.inf] * 5, [0.0, -np.inf, 1.0, -np.inf, 2.0]])
    with np.errstate(all="raise"):          # no invalid operation may happen on the way
        for y in (safe_softmax(x), online_softmax(x, 2), online_softmax(x, 1)):
            assert not np.isnan(y).any()
            np.testing.assert_array_equal(y[0], 0.0)
            np.testing.assert_allclose(y[1], python_softmax(list(x[1])), rtol=1e-15)
            assert y[1, 1] == 0.0 and y[1, 3] == 0.0


def test_leading_masked_tiles_do_not_poison_the_row():
    # the first two tiles of size 2 hold only -inf: alpha must be 0, never exp(-inf - -inf)
    x = np.array([-np.inf, -np.inf, -np.inf, -np.inf, 0.5, 3.0])
    y, trace = online_softmax(x, 2, return_trace=True)
    np.testing.assert_allclose(y, python_softmax(list(x)), rtol=1e-15)
    assert np.isneginf(trace.m[:2, 0]).all() and (trace.l[:2, 0] == 0).all()


def test_large_scores_do_not_overflow():
    x = np.array([1000.0, 1001.0, 999.0, 1002.0])
    np.testing.assert_allclose(online_softmax(x, 1), python_softmax(list(x)), rtol=1e-14)
    np.testing.assert_allclose(safe_softmax(x), python_softmax(list(x)), rtol=1e-14)


def test_trace_matches_prefix_max_and_prefix_sum():
    x = X2
    _, t = online_softmax(x, 3, return_trace=True)
    assert list(t.key_start) == [0, 3, 6, 9, 12] and list(t.key_stop) == [3, 6, 9, 12, 13]
    for i, c1 in enumerate(t.key_stop):
        m = x[:, :c1].max(axis=1)                              # the max of everything seen so far
        np.testing.assert_array_equal(t.m[i], m)
        np.testing.assert_allclose(t.l[i], np.exp(x[:, :c1] - m[:, None]).sum(axis=1), rtol=1e-13)
        np.testing.assert_allclose(t.alpha[i], np.exp(t.m_before[i] - t.m[i]) if i else 0.0, rtol=1e-15)
    assert len(t) == 5


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_low_precision_keeps_the_dtype(dtype):
    x = X2.astype(dtype)
    for y in (safe_softmax(x), online_softmax(x, 4)):
        assert y.dtype == dtype
        np.testing.assert_allclose(y.astype(float), rows(x.astype(float)), rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("tile", [1, 4, 13, 50])
def test_fused_form_is_softmax_then_matmul(tile):
    v = np.random.default_rng(4).standard_normal((13, 3))
    np.testing.assert_allclose(fused_softmax_matmul(X2, v, tile), rows(X2) @ v, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(fused_softmax_matmul(X2[2], v, tile), rows(X2[2]) @ v, rtol=1e-12, atol=1e-14)


def test_fused_form_on_scores_is_flash_attention():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((6, 8)), rng.standard_normal((20, 8)), rng.standard_normal((20, 4))
    scores = (q @ k.T) / np.sqrt(8)
    np.testing.assert_allclose(fused_softmax_matmul(scores, v, 7), flash_attention(q, k, v, 7),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fused_low_precision_keeps_the_dtype(dtype):
    x = X2.astype(dtype)
    v = np.random.default_rng(6).standard_normal((13, 3)).astype(dtype)
    out = fused_softmax_matmul(x, v, 4)
    assert out.dtype == dtype
    np.testing.assert_allclose(out.astype(float), rows(x.astype(float)) @ v.astype(float), rtol=5e-3, atol=5e-3)
    assert fused_softmax_matmul(np.zeros(2, np.float16), np.eye(2, dtype=np.float16), 1).dtype == np.float16


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_plus_inf_propagates_instead_of_zeros(bad):
    x = np.array([[1.0, bad, 2.0], [-np.inf, -np.inf, -np.inf], [0.0, 1.0, -np.inf]])
    # +inf - inf is NaN, and NumPy says so with a RuntimeWarning: expected, and kept visible
    expect = pytest.warns(RuntimeWarning, match="invalid value") if np.isinf(bad) else contextlib.nullcontext()
    with expect:
        ys = (safe_softmax(x), online_softmax(x, 1), online_softmax(x, 2), online_softmax(x, 3))
    for y in ys:
        assert np.isnan(y[0]).all()                      # not silently [0, 0, 0]
        np.testing.assert_array_equal(y[1], 0.0)         # only the all -inf row is empty
        np.testing.assert_allclose(y[2], [1 / (1 + math.e), math.e / (1 + math.e), 0.0], rtol=1e-15)
    with expect:
        assert np.isnan(safe_softmax(np.array([1.0, bad, 2.0]))).all()


def test_fused_all_masked_row_gives_zeros():
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, 1.0, -np.inf]])
    v = np.array([[1.0], [2.0], [3.0]])
    out = fused_softmax_matmul(x, v, 1)
    assert out[0, 0] == 0.0
    assert out[1, 0] == pytest.approx((1 + 2 * math.e) / (1 + math.e), rel=1e-15)


@pytest.mark.parametrize("n, tile, rows_", [(10, None, 1), (10, 3, 2), (7, 1, 3), (16, 16, 1), (5, 100, 4)])
def test_traffic_against_hand_count(n, tile, rows_):
    # Milakov & Gimelshein: safe softmax 3 loads + 1 store per element, online 2 + 1, fused 1 + 0.
    expected = {"safe": (3, 3, 1), "online": (2, 2, 1), "fused": (1, 1, 0)}
    for method in SOFTMAX_METHODS:
        t = softmax_traffic(method, n, tile=tile, rows=rows_)
        passes, reads_per, writes_per = expected[method]
        assert (t.passes, t.reads, t.writes) == (passes, reads_per * n * rows_, writes_per * n * rows_)
        assert t.tile == (n if tile is None else tile)


@pytest.mark.parametrize("call, exc, word", [
    (lambda: safe_softmax(np.arange(4)), TypeError, "x"),
    (lambda: online_softmax(np.arange(4), 2), TypeError, "x"),
    (lambda: safe_softmax("abc"), TypeError, "x"),
    (lambda: safe_softmax(np.float64(1.0)), ValueError, "x"),
    (lambda: safe_softmax(np.zeros((2, 2, 2))), ValueError, r"shape \(2, 2, 2\)"),
    (lambda: online_softmax(np.zeros(4), 0), ValueError, "tile"),
    (lambda: online_softmax(np.zeros(4), 1.5), TypeError, "tile"),
    (lambda: online_softmax(np.zeros((1, 1, 4)), 2), ValueError, "x"),
    (lambda: fused_softmax_matmul(np.zeros(4), np.zeros((3, 2)), 2), ValueError, "v"),
    (lambda: fused_softmax_matmul(np.zeros(4), np.zeros(4), 2), ValueError, "v"),
    (lambda: fused_softmax_matmul(np.zeros(4), np.zeros((4, 2)), 0), ValueError, "tile"),
    (lambda: softmax_traffic("naive", 4), ValueError, "method"),
    (lambda: softmax_traffic("safe", 0), ValueError, "n"),
    (lambda: softmax_traffic("safe", 4, tile=0), ValueError, "tile"),
])
def test_bad_input_is_refused_by_name(call, exc, word):
    with pytest.raises(exc, match=word):
        call()


# --- the pictures draw what was counted and traced ---------------------------------------------------

def test_traffic_figure_bars_are_the_counted_accesses():
    from lessons.views.softmax import traffic_figure
    traffics = [softmax_traffic(m, 40, tile=7, rows=2) for m in SOFTMAX_METHODS]
    ax = traffic_figure(traffics).axes[0]
    widths = [p.get_width() for p in ax.patches]
    # first the read bars (3, 2, 1 per element), then the write bars (1, 1, 0)
    assert widths == [3.0, 2.0, 1.0, 1.0, 1.0, 0.0]
    with pytest.raises(TypeError, match="SoftmaxTraffic"):
        traffic_figure([1, 2])


def test_online_softmax_figure_draws_the_running_max_and_sum():
    from lessons.views.softmax import online_softmax_figure
    _, t = online_softmax(X2, 4, return_trace=True)
    fig = online_softmax_figure(X2, t, row=2)
    ax, axl = fig.axes
    stair = ax.lines[0].get_ydata()
    np.testing.assert_array_equal(stair, np.repeat(t.m[:, 2], 2))
    np.testing.assert_array_equal(axl.lines[0].get_ydata(), t.l[:, 2])
    with pytest.raises(ValueError, match="does not fit"):
        online_softmax_figure(X2[:, :5], t)
    with pytest.raises(TypeError, match="OnlineSoftmaxTrace"):
        online_softmax_figure(X2, None)


@pytest.mark.parametrize("row, exc, match", [
    (X2.shape[0], ValueError, rf"row must be in -{X2.shape[0]}..{X2.shape[0] - 1}"),
    (1.0, TypeError, "row must be an int, got float 1.0"),
    (True, TypeError, "row must be an int, got bool True"),
])
def test_online_softmax_figure_names_a_row_it_cannot_draw(row, exc, match):
    from lessons.views.softmax import online_softmax_figure
    _, t = online_softmax(X2, 4, return_trace=True)
    with pytest.raises(exc, match=match):
        online_softmax_figure(X2, t, row=row)
    assert online_softmax_figure(X2, t, row=-1).axes[1].lines[0].get_ydata().tolist() == t.l[:, -1].tolist()


def test_online_softmax_figure_refuses_the_trace_of_other_values():
    """A trace of x drawn over 2 x (same shape): the staircase would not be the max of the bars."""
    from lessons.views.softmax import online_softmax_figure
    _, t = online_softmax(X2, 4, return_trace=True)
    with pytest.raises(ValueError, match="running max ends at"):
        online_softmax_figure(2 * X2, t)
