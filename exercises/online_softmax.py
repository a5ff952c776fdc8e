"""Online softmax (notebook 01): one pass for the max and the sum of a row.

A safe softmax needs the row max ``m`` (so that ``exp`` cannot overflow) and the
sum ``l = sum(exp(x - m))``. Both look as if they need every score first. They do
not: keep a running max and a running sum, and each time the max moves, rescale the
sum by the correction factor ``alpha = exp(m_old - m_new)``.

Source: Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", Alg. 3.

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("online_softmax")``. A reference answer is in ``solutions/online_softmax.py``.
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
    raise NotImplementedError


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
    raise NotImplementedError


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
    raise NotImplementedError
