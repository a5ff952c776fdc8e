"""Known-wrong answer to the exercise ``gqa_decode`` (mistake ``head_modulo``).

The mistake: query head h reads kv head h % num_kv_heads (heads dealt round-robin).
Everything else is the reference answer (solutions/gqa_decode.py). The grader must fail
this file and its hint must name the mistake (tests/test_grader.py checks both).
"""
EXERCISE = "gqa_decode"
MISTAKE = "head_modulo"

import numpy as np

from lessons.core.state import State, absorb, finalize   # the fold of notebook 02: yours to use here


def kv_head(h, num_heads, num_kv_heads):
    """The KV head that query head ``h`` reads (an int).

    Parameters: ``h`` int in ``[0, num_heads)``; ``num_heads``, ``num_kv_heads`` ints >= 1.

    Rule: heads are grouped consecutively, ``group = num_heads // num_kv_heads`` query
    heads per KV head, so the answer is ``h // group``. Raise ValueError if
    ``num_heads`` is not a multiple of ``num_kv_heads`` or ``h`` is out of range.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not 0 <= h < num_heads:
        raise ValueError(f"h must be in [0, {num_heads}), got {h}")
    return h % num_kv_heads


def paged_gqa_decode(q, block_table, k_cache, v_cache, seq_len, block_size):
    """Decode attention for one sequence: all query heads, a paged cache with GQA.

    Parameters
    ----------
    q : float array, shape (num_heads, d), the new token's queries
    block_table : int array, shape (num_blocks_per_seq,), page of each logical block
    k_cache : float array, shape (num_blocks, block_size, num_kv_heads, d)
    v_cache : float array, shape (num_blocks, block_size, num_kv_heads, dv)
    seq_len : int >= 1, tokens in the sequence
    block_size : int >= 1

    Returns
    -------
    out : float array, shape (num_heads, dv); head h is
        ``softmax(q[h] . k[:, kv_head(h)] / sqrt(d)) @ v[:, kv_head(h)]`` over the
        ``seq_len`` tokens.

    Rule: one pass over the logical blocks, the last one partial (read only its first
    ``seq_len - j * block_size`` slots; the rest is stale, even NaN). Each block's keys
    of a KV head serve every query head of its group. Raise ValueError if
    ``num_heads`` is not a multiple of ``num_kv_heads``.
    """
    q = np.asarray(q, dtype=np.float64)
    num_heads, d = q.shape
    num_kv_heads, dv = k_cache.shape[2], v_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    scale = 1.0 / np.sqrt(d)
    states = [State.empty(group, dv) for _ in range(num_kv_heads)]   # one state per group of heads
    for j in range(-(-seq_len // block_size)):
        n = min(block_size, seq_len - j * block_size)
        page = block_table[j]
        for g in range(num_kv_heads):
            k_blk = np.asarray(k_cache[page, :n, g], dtype=np.float64)    # loaded once for the group
            v_blk = np.asarray(v_cache[page, :n, g], dtype=np.float64)
            heads = slice(g, num_heads, num_kv_heads)                    # h % num_kv_heads == g
            states[g] = absorb(states[g], (q[heads] @ k_blk.T) * scale, v_blk)
    out = np.zeros((num_heads, dv))
    for g in range(num_kv_heads):
        out[g::num_kv_heads] = finalize(states[g])[0]
    return out
