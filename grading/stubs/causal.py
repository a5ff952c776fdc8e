"""Causal attention, tile by tile (notebook 03), and the NaN of a fully masked tile.

With a causal mask most key tiles are partly or wholly hidden from a block of
queries. Tiles wholly above the diagonal are skipped; the others are masked with
``-inf`` inside the tile. A row whose first tile is entirely masked has ``m = -inf``
after it, and the literal update then computes ``exp(-inf - -inf) = NaN``, which
spreads to everything after it. Real kernels guard it; so will you.

Alignment is bottom-right, as in FlashAttention-2: with Nq queries and Nk keys,
query i sees key j iff ``j <= i + Nk - Nq`` (the last query sees every key).

Source: Dao 2023, FlashAttention-2, Sec. 3.1.1 (causal masking, skipped blocks)
and Alg. 1.

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("causal")``. A reference answer is in ``solutions/causal.py``.
"""
import numpy as np


def absorb_unguarded(m, l, o, s, v):
    """The update written literally, with no special case for ``-inf``.

    Same arguments and result as the absorb step: ``m (R,)``, ``l (R,)``,
    ``o (R, dv)``, ``s (R, T)`` scaled scores (``-inf`` = masked), ``v (T, dv)``;
    returns the new ``(m, l, o)``.

    Rule: exactly ``m_new = max(m, rowmax(s)); alpha = exp(m - m_new);
    p = exp(s - m_new); l = alpha*l + sum(p); o = alpha*o + p @ v`` with no guard.
    It must agree with the guarded update whenever every row has a finite score so
    far, and it must reproduce the NaN: absorbing a fully masked tile into an empty
    state (``m = -inf``) gives NaN in ``l`` and ``o`` for that row.
    """
    raise NotImplementedError


def causal_flash_attention(q, k, v, tile, *, block_q=16, mask=None):
    """Causal attention computed tile by tile, never NaN.

    Parameters
    ----------
    q : float array, shape (Nq, d)
    k : float array, shape (Nk, d)
    v : float array, shape (Nk, dv)
    tile : int >= 1, keys per tile; need not divide Nk (the last tile is partial).
    block_q : int >= 1, query rows per block; need not divide Nq.
    mask : optional bool array, shape (Nq, Nk), True = may attend. It is combined with
        the causal mask (a key must pass both).

    Returns
    -------
    (out, lse) : ``out`` shape (Nq, dv), ``lse`` shape (Nq,) with ``lse = m + log(l)``.
    Scale the scores by ``1/sqrt(d)``.

    Rule: for each block of ``block_q`` query rows, walk the key tiles in order and
    fold each into the rows' ``(m, l, o)``; mask with ``-inf`` every key j that query i
    may not see: ``j > i + Nk - Nq`` (bottom-right causal) or ``mask[i, j]`` False. Tiles
    wholly above the diagonal for the whole block may be skipped. A fully masked tile
    must leave a row's state unchanged (guard ``exp(-inf - -inf)``); a row that sees no
    key at all gets ``out = 0`` and ``lse = -inf``, never NaN.
    """
    raise NotImplementedError
