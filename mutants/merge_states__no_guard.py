"""Known-wrong answer to the exercise ``merge_states`` (mistake ``no_guard``).

The mistake: the textbook formula with no guard: two empty parts compute exp(-inf -
-inf) = NaN.
Everything else is the reference answer (solutions/merge_states.py). The grader must fail
this file and its hint must name the mistake (tests/test_grader.py checks both).
"""
EXERCISE = "merge_states"
MISTAKE = "no_guard"

import numpy as np


def merge_states(o_a, lse_a, o_b, lse_b):
    """Merge two normalised partial states over disjoint key sets.

    Parameters
    ----------
    o_a, o_b : float arrays, shape (R, dv), normalised outputs of the two parts
    lse_a, lse_b : float arrays, shape (R,), log-sum-exp of the scores of each part;
        ``-inf`` for an empty part (whose ``o`` is 0)

    Returns
    -------
    (o, lse) : shapes (R, dv) and (R,), the state over both key sets.

    Rule::

        lse = log(exp(lse_a) + exp(lse_b))      computed stably: subtract max(lse_a, lse_b)
        o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

    ``lse`` can be large (hundreds): never exponentiate it unshifted. Two empty parts
    give ``o = 0, lse = -inf``: no NaN (``exp(-inf - -inf)``), and never ``lse = +inf``.
    """
    o_a, lse_a, o_b, lse_b = (np.asarray(x, dtype=np.float64) for x in (o_a, lse_a, o_b, lse_b))
    m = np.maximum(lse_a, lse_b)
    lse = m + np.log(np.exp(lse_a - m) + np.exp(lse_b - m))
    o = np.exp(lse_a - lse)[:, None] * o_a + np.exp(lse_b - lse)[:, None] * o_b
    return o, lse
