"""Known-wrong answer to the exercise ``ring_step`` (mistake ``causal_offset_ignored``).

The mistake: the causal mask compares positions inside the blocks, not global positions.
Everything else is the reference answer (solutions/ring_step.py). The grader must fail
this file and its hint must name the mistake (tests/test_grader.py checks both).
"""
EXERCISE = "ring_step"
MISTAKE = "causal_offset_ignored"

import numpy as np

from lessons.core.state import State, absorb   # the fold of notebook 02: yours to use here


def ring_step(m, l, o, q, k_block, v_block, *, q_start, k_start, causal=False):
    """Fold the KV block a device holds into its queries' state.

    Parameters
    ----------
    m, l, o : the device's state, shapes (Rq,), (Rq,), (Rq, dv) (empty: -inf, 0, 0)
    q : float array, shape (Rq, d), the device's queries, at global positions
        ``q_start .. q_start + Rq - 1``
    k_block, v_block : float arrays, shapes (T, d) and (T, dv), T >= 1: the KV block
        held now, at global key positions ``k_start .. k_start + T - 1``
    q_start, k_start : ints >= 0, global positions of the first query and first key
    causal : bool. Self-attention over one sequence: the query at global position i
        sees the key at global position j iff ``j <= i``.

    Returns
    -------
    (m, l, o) : the new state, same shapes; do not modify the inputs in place.

    Rule: scores ``q @ k_block.T / sqrt(d)``, ``-inf`` where the causal mask hides a key
    (compare global positions, not positions inside the block), then the absorb
    update. A block every key of which is in the future of a query leaves that query's
    state unchanged, never NaN.
    """
    q, k_block, v_block = (np.asarray(x, dtype=np.float64) for x in (q, k_block, v_block))
    s = (q @ k_block.T) / np.sqrt(q.shape[1])
    if causal:
        qpos = np.arange(q.shape[0])
        kpos = np.arange(k_block.shape[0])
        s = np.where(kpos[None, :] <= qpos[:, None], s, -np.inf)
    new = absorb(State(m=np.asarray(m, dtype=np.float64), l=np.asarray(l, dtype=np.float64),
                       o=np.asarray(o, dtype=np.float64)), s, v_block)    # the fold (notebook 02)
    return new.m, new.l, new.o
