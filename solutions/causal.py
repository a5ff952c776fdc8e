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
    with np.errstate(invalid="ignore"):
        m_new = np.maximum(m, s.max(axis=1))
        alpha = np.exp(m - m_new)
        p = np.exp(s - m_new[:, None])
        return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * o + p @ v


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
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    nq, nk, dv = q.shape[0], k.shape[0], v.shape[1]
    scale = 1.0 / np.sqrt(q.shape[1])
    out = np.zeros((nq, dv))
    lse = np.full(nq, -np.inf)
    for r0 in range(0, nq, block_q):
        rows = np.arange(r0, min(r0 + block_q, nq))
        m, l, o = np.full(rows.size, -np.inf), np.zeros(rows.size), np.zeros((rows.size, dv))
        for c0 in range(0, nk, tile):                       # ceil(Nk / tile) tiles, the last partial
            cols = np.arange(c0, min(c0 + tile, nk))
            if c0 > rows[-1] + nk - nq:                      # above the diagonal for every row: skip
                break
            visible = cols[None, :] <= rows[:, None] + (nk - nq)
            if mask is not None:
                visible = visible & mask[rows[:, None], cols[None, :]]
            s = np.where(visible, (q[rows] @ k[cols].T) * scale, -np.inf)
            m_new = np.maximum(m, s.max(axis=1))
            shift = np.where(np.isneginf(m_new), 0.0, m_new)    # the fix: never -inf - -inf
            alpha = np.exp(m - shift)
            p = np.exp(s - shift[:, None])
            l = alpha * l + p.sum(axis=1)
            o = alpha[:, None] * o + p @ v[cols]
            m = m_new
        seen = l > 0
        out[rows] = np.where(seen[:, None], o / np.where(seen, l, 1.0)[:, None], 0.0)
        lse[rows] = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
    return out, lse
