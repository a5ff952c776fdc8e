"""Online softmax (notebook 01): one pass for the max and the sum of a row.

A safe softmax needs the row max ``m`` (so that ``exp`` cannot overflow) and the
sum ``l = sum(exp(x - m))``. Both look as if they need every score first. They do
not: keep a running max and a running sum, and each time the max moves, rescale the
sum by the correction factor ``alpha = exp(m_old - m_new)``.

Source: Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", Alg. 3.
"""
import numpy as np


def online_max_sum(tiles):
    """Running max and sum of one row of scores that arrives a tile at a time.

    Parameters
    ----------
    tiles : iterable of 1-D float arrays
        The row's scores in order, one tile per item; tiles may have different
        lengths (the last one is often shorter), and some may be empty. The iterable
        can be read only once (it may be a generator): one pass.

    Returns
    -------
    (m, l) : two floats
        ``m = max(x)`` over all scores and ``l = sum(exp(x - m))``.

    Keep only ``m`` and ``l`` between tiles (notebook 01, section 3, derives the update).
    Scores may be ``-inf`` (masked). If every score is ``-inf``, or there are no
    scores, return ``m = -inf, l = 0.0``, never NaN.
    """
    m, l = -np.inf, 0.0
    for x in tiles:
        x = np.asarray(x, dtype=np.float64)
        if x.size == 0:
            continue
        m_new = max(m, float(x.max()))
        if m_new == -np.inf:                   # nothing visible yet: the state stays empty
            continue
        alpha = np.exp(m - m_new)              # 0 when m was -inf, 1 when the max did not move
        l = alpha * l + float(np.exp(x - m_new).sum())
        m = m_new
    return float(m), float(l)


def online_max_sum_rows(tiles):
    """Row-wise :func:`online_max_sum`: R rows at once, each with its own max and sum.

    Parameters
    ----------
    tiles : iterable of 2-D float arrays, shape (R, T_i)
        Column tiles of an (R, N) score matrix, in order; read once. ``T_i`` may differ.

    Returns
    -------
    (m, l) : float arrays of shape (R,)
        Per row, ``m = max`` and ``l = sum(exp(x - m))``; a row of only ``-inf`` gives
        ``m = -inf, l = 0``, never NaN. There is always at least one tile.

    The same one pass as :func:`online_max_sum`, for every row at once.
    """
    m = l = None
    for x in tiles:
        x = np.asarray(x, dtype=np.float64)
        if m is None:
            m, l = np.full(x.shape[0], -np.inf), np.zeros(x.shape[0])
        if x.shape[1] == 0:
            continue
        m_new = np.maximum(m, x.max(axis=1))
        shift = np.where(np.isneginf(m_new), 0.0, m_new)      # the guard, per row
        alpha = np.exp(m - shift)
        l = alpha * l + np.exp(x - shift[:, None]).sum(axis=1)
        m = m_new
    return m, l


def online_softmax(x, tile):
    """Softmax along the last axis in two passes: the online max/sum, then one normalise.

    Parameters
    ----------
    x : float array, shape (N,) or (R, N); ``-inf`` entries are masked.
    tile : int >= 1, columns per tile for the first pass (need not divide N).

    Returns
    -------
    float array of the shape of ``x``: ``exp(x - m) / l`` per row. A row of only
    ``-inf`` gives zeros, never NaN.

    Pass 1 reads ``x`` once, a tile at a time, with the functions above; pass 2
    normalises. Raise ValueError if ``tile < 1``.
    """
    if tile < 1:
        raise ValueError(f"tile must be at least 1, got {tile}")
    x = np.asarray(x, dtype=np.float64)
    single = x.ndim == 1
    x2 = x[None, :] if single else x
    n = x2.shape[1]
    m, l = online_max_sum_rows(x2[:, a:a + tile] for a in range(0, max(n, 1), tile))
    seen = l > 0
    shift = np.where(seen, m, 0.0)
    p = np.where(seen[:, None], np.exp(x2 - shift[:, None]) / np.where(seen, l, 1.0)[:, None], 0.0)
    return p[0] if single else p
