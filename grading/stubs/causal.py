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

    It must agree with the guarded update whenever every row has a finite score so
    far, and it must reproduce the trap of notebook 03, section 5: absorbing a fully
    masked tile into an empty state (``m = -inf``) gives NaN in ``l`` and ``o`` for
    that row.
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

    What must hold: ``out`` equals causal attention with the mask aligned bottom-right,
    as in FlashAttention-2 (notebook 03, section 2), for any ``tile`` and ``block_q``;
    a row's output never depends on a key it may not see; a row that sees no key at
    all gets ``out = 0`` and ``lse = -inf``, never NaN.
    """
    raise NotImplementedError
