"""Textbook attention: materialise the full score matrix S, softmax it, multiply by V.

This is the reference every other schedule is tested against. It uses O(Nq * Nk)
memory on purpose: that is the cost FlashAttention removes.
Source: Vaswani et al. 2017, Eq. 1.
"""
from __future__ import annotations

import numpy as np

from lessons.core.checks import causal_visible, check_flag, check_mask, check_qkv, check_scale

__all__ = ["attention"]


def attention(q, k, v, *, scale=None, causal=False, mask=None, return_lse=False):
    """Exact softmax attention ``softmax(scale * q k^T) v`` with S materialised.

    Parameters
    ----------
    q : float array, shape (Nq, d) or (d,)
    k : float array, shape (Nk, d)
    v : float array, shape (Nk, dv)
    scale : float, default ``1/sqrt(d)``
    causal : bool
        Bottom-right aligned: query i sees key j iff ``j <= i + Nk - Nq``
        (as FlashAttention-2 does).
    mask : bool array broadcastable to (Nq, Nk), True = may attend, optional.
    return_lse : bool
        Also return ``lse = log(sum_j exp(s_j))`` per query row.

    Returns
    -------
    out : shape (Nq, dv) (or (dv,) for a single query); dtype of the inputs
        (float16 inputs are computed in float32 and returned as float16).
    lse : shape (Nq,) (or scalar), only if ``return_lse``. A row with nothing to
        attend to gives ``out = 0`` and ``lse = -inf``, never NaN.

    Raises TypeError / ValueError naming the argument for non-float dtypes,
    wrong ranks, mismatched d or Nk, or a mask that does not fit (Nq, Nk).
    """
    out_dtype = np.result_type(*(np.asarray(x).dtype for x in (q, k, v))) if _all_float(q, k, v) else None
    q2, k, v, single, dtype = check_qkv(q, k, v)
    causal, return_lse = check_flag(causal, "causal"), check_flag(return_lse, "return_lse")
    nq, nk = q2.shape[0], k.shape[0]
    scale = check_scale(scale, q2.shape[1])
    visible = check_mask(mask, nq, nk, single)
    if causal:
        c = causal_visible(np.arange(nq), np.arange(nk), nq, nk)
        visible = c if visible is None else (visible & c)

    s = (q2 @ k.T) * dtype.type(scale)                     # (Nq, Nk): the matrix FlashAttention never builds
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=1) if nk else np.full(nq, -np.inf, dtype=dtype)
    seen = ~np.isneginf(m)                                 # -inf: nothing visible; NaN/+inf propagate
    p = np.exp(s - np.where(seen, m, 0.0)[:, None])       # safe softmax: subtract the row max
    l = p.sum(axis=1)
    out = np.where(seen[:, None], (p @ v) / np.where(seen, l, 1.0)[:, None], 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
    return _shape_result(out, lse, single, out_dtype, return_lse)


def _all_float(*xs) -> bool:
    return all(np.issubdtype(np.asarray(x).dtype, np.floating) for x in xs)


def _shape_result(out, lse, single, out_dtype, return_lse):
    """Cast back to the input dtype and drop the row axis for a single query."""
    out = out.astype(out_dtype, copy=False)
    lse = lse.astype(np.result_type(out_dtype, np.float32), copy=False)
    if single:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
