"""Shared helpers of the grading tests: random cases and the values to compare against.

Every expected value here is computed another way than the answers compute it: the
textbook reference :func:`lessons.attention` (the full score matrix, softmaxed at once)
or the closed form of the state over all keys seen so far.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from lessons import attention

RTOL, ATOL = 1e-6, 1e-9

seeds = st.integers(0, 2**32 - 1)


def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


def normal(seed, *shape, scale=1.0) -> np.ndarray:
    """Standard normal float64 array of ``shape`` (times ``scale``)."""
    return rng(seed).standard_normal(shape) * scale


def qkv(seed, nq, nk, d, dv=None, *, spread=2.0):
    """Random float64 ``q (nq, d)``, ``k (nk, d)``, ``v (nk, dv)``; ``spread`` widens the scores
    so that the running max really moves from tile to tile."""
    g = rng(seed)
    dv = d if dv is None else dv
    return (g.standard_normal((nq, d)) * spread, g.standard_normal((nk, d)) * spread,
            g.standard_normal((nk, dv)))


def as_array(x, what) -> np.ndarray:
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise AssertionError(f"{what}: expected a float array, got {type(x).__name__} ({exc})") from None


def assert_close(actual, expected, what, *, rtol=RTOL, atol=ATOL):
    """``actual`` equals ``expected`` (same shape, no NaN, -inf where expected is -inf)."""
    actual = as_array(actual, what)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    assert not np.isnan(actual).any(), f"{what} holds NaN where {np.array2string(expected, precision=4)} was expected"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


def direct_state(s, v):
    """The state ``(m, l, o)`` over all keys at once: ``m = max s``, ``l = sum exp(s - m)``,
    ``o = exp(s - m) @ v``; a row of only ``-inf`` gives ``(-inf, 0, 0)``.
    ``s`` (R, N) scaled scores, ``v`` (N, dv)."""
    s = np.asarray(s, dtype=np.float64)
    m = s.max(axis=1) if s.shape[1] else np.full(s.shape[0], -np.inf)
    shift = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - shift[:, None])
    return m, p.sum(axis=1), p @ v


def softmax_reference(x):
    """Softmax along the last axis and its log-sum-exp, through the textbook reference.

    ``x`` (R, N) scores, ``-inf`` = masked. Computed as ``attention(I_R, x.T, I_N, scale=1)``
    with a mask for the ``-inf`` entries, so ``s = x`` and ``out = softmax(x)``.
    Returns ``(p (R, N), lse (R,))``; a row of only ``-inf`` gives zeros and ``-inf``.
    """
    x = np.asarray(x, dtype=np.float64)
    r, n = x.shape
    finite = np.isfinite(x)
    p, lse = attention(np.eye(r), np.where(finite, x, 0.0).T, np.eye(n), scale=1.0, mask=finite,
                       return_lse=True)
    return p, lse


def tiles_of(n, tile):
    """``[(start, stop), ...]`` covering ``range(n)`` in steps of ``tile``, last one partial."""
    return [(a, min(a + tile, n)) for a in range(0, n, tile)]


def no_nan(x, what):
    x = as_array(x, what)
    assert not np.isnan(x).any(), f"{what} holds NaN: {x}"
