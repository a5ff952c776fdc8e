"""Textbook attention: materialise the full score matrix S, softmax it, multiply by V.

This is the reference every other schedule is tested against. It uses O(Nq * Nk)
memory on purpose: that is the cost FlashAttention removes.
Source: Vaswani et al. 2017, Eq. 1.
"""
from __future__ import annotations

import numpy as np

from lessons.core.causal_rule import causal_visible
from lessons.core.checks import check_flag, check_mask, check_qkv, check_scale
from lessons.core.result import output_dtype, pack_result, shape_result

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

    A row's output never depends on a key it cannot see (masked or causal-hidden):
    NaN, inf or any value in that key's k or v leaves the row bitwise unchanged (its
    probability is exactly 0 and adds exactly nothing). NaN or inf in a key or value
    the row does see, or NaN in its own query, makes that row (and only that row) NaN.

    Raises TypeError / ValueError naming the argument for non-float dtypes,
    wrong ranks, mismatched d or Nk, or a mask that does not fit (Nq, Nk).
    """
    out_dtype = output_dtype(q, k, v)                    # before q, k, v are cast for the work
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
    out = np.where(seen[:, None], _p_at_v(p, v) / np.where(seen, l, 1.0)[:, None], 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
    out, lse = shape_result(out, lse, single, out_dtype)
    return pack_result(out, (return_lse, lse))


def _p_at_v(p, v):
    """``P @ V`` where a key a row gives probability 0 adds nothing to that row.

    ``0 * NaN`` is NaN, so a NaN or inf value at a key the row cannot see would leak
    into it through a plain ``p @ v``. The product runs on V with its non-finite
    entries zeroed (so a row that gives those keys p = 0 is bitwise what it would be
    with any finite value there); the non-finite entries are then added back, key by
    key, only to the rows that give their key p > 0.
    """
    finite = np.isfinite(v)
    out = p @ np.where(finite, v, 0.0)
    bad = ~finite.all(axis=1)                              # keys with a NaN/inf value
    if bad.any():
        pb = p[:, bad][:, :, None]                         # (Nq, B, 1)
        vb = np.where(finite[bad], 0.0, v[bad])[None]      # (1, B, dv): only the non-finite entries
        with np.errstate(invalid="ignore"):                # 0 * inf where p = 0: discarded
            out = out + np.where(pb > 0, pb * vb, 0.0).sum(axis=1)
    return out
