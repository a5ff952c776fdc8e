"""One step of ring attention (notebook 08): a device folds the KV block it holds.

The sequence is cut into P blocks over P devices. Device p keeps its query block and
that block's state ``(m, l, o)`` for the whole run, while the KV blocks travel around
the ring: at each of P steps every device folds the KV block it currently holds into
its state, then passes the block to its neighbour. After P steps every device has
seen every key, and ``o / l`` is exact. With a causal mask, blocks from the future are
fully masked for some devices: the fold must leave their state untouched.

Source: Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers",
Sec. 3 and Alg. 1; Dao 2023, FA-2 Alg. 1.
"""
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

    What must hold: the new state is the old one with this block's keys absorbed
    (scores scaled by ``1/sqrt(d)``), each query seeing only the keys the causal mask
    allows at their global positions. A block every key of which is in the future of a
    query leaves that query's state unchanged, never NaN.
    """
    q, k_block, v_block = (np.asarray(x, dtype=np.float64) for x in (q, k_block, v_block))
    s = (q @ k_block.T) / np.sqrt(q.shape[1])
    if causal:
        qpos = q_start + np.arange(q.shape[0])
        kpos = k_start + np.arange(k_block.shape[0])
        s = np.where(kpos[None, :] <= qpos[:, None], s, -np.inf)
    new = absorb(State(m=np.asarray(m, dtype=np.float64), l=np.asarray(l, dtype=np.float64),
                       o=np.asarray(o, dtype=np.float64)), s, v_block)    # the fold (notebook 02)
    return new.m, new.l, new.o
