"""Flash-decoding (notebook 08): split the keys over workers, merge their states.

At decode time there is one query, so there are no query rows to hand out to the
GPU's thread blocks. Hand out the keys instead: each of ``num_splits`` workers runs
the usual recurrence over its own contiguous chunk of keys, producing a partial state
``(m, l, o)``, and a final step merges the partials. The merge is the same rescaling
the recurrence already does, applied to two states instead of a state and a tile.

Source: Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference";
Dao 2023, FA-2 Alg. 1.
"""
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

    Notebook 08, section 1, derives the merge from the absorb step.
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

    How the keys are split: with ``c = ceil(Nk / num_splits)``, worker i takes keys
    ``[i*c, min((i+1)*c, Nk))`` (trailing workers may get none: their state is empty).
    Each partial must be exactly its worker's state over its own keys, and ``out`` must
    not depend on ``num_splits`` or ``tile`` beyond rounding.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    nk, dv = k.shape[0], v.shape[1]
    scale = 1.0 / np.sqrt(q.shape[0])
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
