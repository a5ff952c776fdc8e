"""Known-wrong answer to the exercise ``absorb`` (mistake ``alpha_missing_on_l``).

The mistake: the running sum l is not rescaled when the max moves (l = l + sum(p)).
Everything else is the reference answer (solutions/absorb.py). The grader must fail
this file and its hint must name the mistake (tests/test_grader.py checks both).
"""
EXERCISE = "absorb"
MISTAKE = "alpha_missing_on_l"

import numpy as np


def absorb(m, l, o, s, v):
    """Fold one tile of scores into the state ``(m, l, o)`` of R query rows.

    Parameters
    ----------
    m : float array, shape (R,)       running max (``-inf`` for a row that saw nothing)
    l : float array, shape (R,)       running sum of ``exp(s - m)``
    o : float array, shape (R, dv)    running sum of ``exp(s - m) * v``, unnormalised
    s : float array, shape (R, T)     this tile's scaled scores, ``-inf`` where masked
    v : float array, shape (T, dv)    this tile's values

    Returns
    -------
    (m, l, o) : new arrays of the same shapes. Do not modify the inputs in place.

    Rule::

        m_new = max(m, max of s over the tile)     per row
        alpha = exp(m - m_new)                      the correction factor
        p     = exp(s - m_new)
        l     = alpha * l + sum(p)
        o     = alpha * o + p @ v

    A row whose ``m_new`` is still ``-inf`` (a fully masked tile reaching an empty
    state) must stay empty, ``(-inf, 0, 0)``, never NaN: ``exp(-inf - -inf)`` is NaN,
    so subtract 0 instead of ``m_new`` for such rows.
    """
    m_new = np.maximum(m, s.max(axis=1))
    shift = np.where(np.isneginf(m_new), 0.0, m_new)     # the guard: never -inf - -inf
    alpha = np.exp(m - shift)
    p = np.exp(s - shift[:, None])
    l_new = l + p.sum(axis=1)
    o_new = alpha[:, None] * o + p @ v
    return m_new, l_new, o_new
