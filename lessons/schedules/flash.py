"""FlashAttention forward: tiles of keys stream through a small running state.

The loop order is FlashAttention-2's (Dao 2023, Alg. 1): the outer loop walks
query blocks of ``block_q`` rows (Br), the inner loop walks key tiles of ``block_k``
keys (Bc), and each block keeps one ``(m, l, o)`` per row. Only a
``block_q x block_k`` slice of the score matrix exists at any moment.
"""
from __future__ import annotations

import numpy as np

from lessons.core.causal_rule import DIAGONAL, SKIPPED, causal_visible, tile_kind
from lessons.core.checks import check_block_k, check_flag, check_mask, check_positive_int, check_qkv, check_scale
from lessons.core.result import output_dtype, pack_result, shape_result
from lessons.core.state import State, absorb, finalize
from lessons.core.trace import Trace, record_step

__all__ = ["flash_attention"]


def flash_attention(q, k, v, block_k=None, *, block_q=64, scale=None, causal=False, mask=None,
                    return_lse=False, return_trace=False, tile=None):
    """Exact attention computed tile by tile without the (Nq, Nk) score matrix.

    Parameters
    ----------
    q : float array, shape (Nq, d) or (d,)
    k : float array, shape (Nk, d)
    v : float array, shape (Nk, dv)
    block_k : int >= 1, default 64
        Keys per tile (Bc in the papers); any size, it need not divide Nk.
    block_q : int >= 1
        Query rows processed together (Br); the block's rows are vectorised.
    scale : float, default ``1/sqrt(d)``
    causal : bool
        Bottom-right aligned (query i sees key j iff ``j <= i + Nk - Nq``); key tiles
        wholly above the diagonal for a query block are skipped, never absorbed.
    mask : bool array broadcastable to (Nq, Nk), True = may attend, optional.
    return_lse : bool
        Also return ``lse = m + log(l)`` per row (``-inf`` for a row that sees nothing).
    return_trace : bool
        Also return a :class:`lessons.core.trace.Trace` with one step per absorbed
        (query block, key tile).
    tile : int >= 1, optional
        Alias of ``block_k`` (the name of the first notebooks and the exercises).

    Returns
    -------
    out, or a tuple ``(out[, lse][, trace])``: ``out`` has shape (Nq, dv), or (dv,)
    for a single query, in the inputs' dtype (float16 is accumulated in float32).
    Equal to :func:`lessons.attention` up to float rounding for every tile size.
    Peak extra memory is O(block_q * (block_k + dv)) floats, not O(Nq * Nk).

    A row's output never depends on a key it cannot see (masked or causal-hidden):
    NaN, inf or any value in that key's k or v leaves the row bitwise unchanged, for
    every ``tile`` and ``block_q``, even when the key shares a tile with rows that do
    see it. NaN in a key or value the row sees, or in its own query, makes that row
    (and only that row) NaN.

    Raises TypeError / ValueError naming the argument for non-float dtypes, wrong
    ranks, mismatched d or Nk, ``block_k`` (``tile``) or ``block_q`` < 1, both
    ``block_k`` and ``tile`` given with different values, or a bad mask.

    Source: Dao et al. 2022, Alg. 1; Dao 2023, Alg. 1 (loop order, one division at the end).
    """
    out_dtype = output_dtype(q, k, v)                    # before q, k, v are cast for the work
    q2, k, v, single, dtype = check_qkv(q, k, v)
    causal = check_flag(causal, "causal")
    return_lse, return_trace = check_flag(return_lse, "return_lse"), check_flag(return_trace, "return_trace")
    block_k = check_block_k(block_k, tile)
    block_q = check_positive_int(block_q, "block_q")
    nq, nk = q2.shape[0], k.shape[0]
    scale = dtype.type(check_scale(scale, q2.shape[1]))
    visible = check_mask(mask, nq, nk, single)
    trace = Trace(nq=nq, nk=nk, tile=block_k, block_q=block_q) if return_trace else None

    out = np.empty((nq, v.shape[1]), dtype=dtype)
    lse = np.empty(nq, dtype=dtype)
    for r0 in range(0, nq, block_q):                     # outer loop: query blocks (FA-2)
        r1 = min(r0 + block_q, nq)
        state = State.empty(r1 - r0, v.shape[1], dtype)
        for c0 in range(0, nk, block_k):                 # inner loop: key tiles
            c1 = min(c0 + block_k, nk)
            kind = tile_kind(r0, r1, c0, c1, nq, nk, causal)
            if kind == SKIPPED:                          # whole tile above the diagonal (and so are the rest)
                break
            s = (q2[r0:r1] @ k[c0:c1].T) * scale          # (block_q, block_k) scores, the only S we hold
            keep = None if visible is None else visible[r0:r1, c0:c1]
            if kind == DIAGONAL:
                c = causal_visible(np.arange(r0, r1), np.arange(c0, c1), nq, nk)
                keep = c if keep is None else (keep & c)
            if keep is not None:
                s = np.where(keep, s, -np.inf)
            new = absorb(state, s, v[c0:c1])
            record_step(trace, state, new, s, tile=c0 // block_k, row_start=r0, row_stop=r1,
                        key_start=c0, key_stop=c1)
            state = new
        out[r0:r1], lse[r0:r1] = finalize(state)

    out, lse = shape_result(out, lse, single, out_dtype)
    return pack_result(out, (return_lse, lse), (return_trace, trace))
