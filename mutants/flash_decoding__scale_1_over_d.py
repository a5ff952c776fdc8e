"""Known-wrong answer to the exercise ``flash_decoding`` (mistake ``scale_1_over_d``).

The mistake: the scores are scaled by 1/d instead of 1/sqrt(d).
Everything else is the reference answer (solutions/flash_decoding.py). The grader must fail
this file and its hint must name the mistake (tests/test_grader.py checks both).
"""
EXERCISE = "flash_decoding"
MISTAKE = "scale_1_over_d"

import numpy as np


def merge(a, b):
    """Merge two partial states over disjoint sets of keys.

    Parameters
    ----------
    a, b : tuples ``(m, l, o)`` with ``m`` a float (max score), ``l`` a float (sum of
        ``exp(s - m)``), ``o`` a float array (dv,) (sum of ``exp(s - m) * v``).
        The empty state (a worker with no keys) is ``(-inf, 0.0, zeros(dv))``.

    Returns
    -------
    ``(m, l, o)`` for the union of the two key sets, as if one worker had folded
    them all. ``merge(a, b) == merge(b, a)``, merging with an empty state changes
    nothing, and two empty states merge to an empty state, never NaN.

    Rule: ``m = max(m_a, m_b)``, ``l = exp(m_a - m) * l_a + exp(m_b - m) * l_b``, and
    the same factors on ``o``; guard ``m = -inf`` (both empty).
    """
    (m_a, l_a, o_a), (m_b, l_b, o_b) = a, b
    m = max(m_a, m_b)
    if m == -np.inf:                                      # both empty: nothing to rescale
        return -np.inf, 0.0, np.zeros_like(np.asarray(o_a, dtype=np.float64))
    alpha_a, alpha_b = np.exp(m_a - m), np.exp(m_b - m)
    return m, alpha_a * l_a + alpha_b * l_b, alpha_a * np.asarray(o_a) + alpha_b * np.asarray(o_b)


def flash_decoding(q, k, v, num_splits=4, tile=16):
    """Attention for one query with the keys split over ``num_splits`` workers.

    Parameters
    ----------
    q : float array, shape (d,)
    k : float array, shape (Nk, d)
    v : float array, shape (Nk, dv)
    num_splits : int >= 1, workers
    tile : int >= 1, keys per tile inside a worker

    Returns
    -------
    (out, partials) : ``out`` shape (dv,), equal to ``softmax(q . k / sqrt(d)) @ v``;
    ``partials`` a list of ``num_splits`` states ``(m, l, o)`` as in :func:`merge`, one
    per worker, in worker order.

    Rule: with ``c = ceil(Nk / num_splits)``, worker i takes keys ``[i*c, min((i+1)*c, Nk))``
    (trailing workers may get none: their state is empty). Each worker folds its keys
    tile by tile into its own ``(m, l, o)``, starting empty, with scores scaled by
    ``1/sqrt(d)``. Then merge the partials left to right and return ``o / l``
    (zeros if ``l == 0``).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    nk, dv = k.shape[0], v.shape[1]
    scale = 1.0 / q.shape[0]
    c = max(1, -(-nk // num_splits))
    partials = []
    for i in range(num_splits):                           # each worker, independently
        start, stop = min(i * c, nk), min((i + 1) * c, nk)
        m, l, o = -np.inf, 0.0, np.zeros(dv)               # this worker's state, empty
        for a in range(start, stop, tile):                  # the recurrence over its tiles
            b = min(a + tile, stop)
            s = (k[a:b] @ q) * scale
            m_new = max(m, float(s.max()))
            alpha = np.exp(m - m_new)
            p = np.exp(s - m_new)
            l, o, m = alpha * l + float(p.sum()), alpha * o + p @ v[a:b], m_new
        partials.append((m, l, o))
    m, l, o = -np.inf, 0.0, np.zeros(dv)
    for part in partials:                                 # the reduction
        m, l, o = merge((m, l, o), part)
    return (o / l if l > 0 else np.zeros(dv)), partials
