"""Known-wrong answer to the exercise ``paged`` (mistake ``last_partial_tile_dropped``).

The mistake: only seq_len // block_size blocks are read: the partial last block is lost.
Everything else is the reference answer (solutions/paged.py). The grader must fail
this file and its hint must name the mistake (tests/test_grader.py checks both).
"""
EXERCISE = "paged"
MISTAKE = "last_partial_tile_dropped"

import numpy as np


def paged_attention(q, block_table, k_cache, v_cache, seq_len, block_size):
    """One query attends to one sequence stored in a paged KV cache.

    Parameters
    ----------
    q : float array, shape (d,)
    block_table : int array, shape (num_blocks_per_seq,); ``block_table[j]`` is the page
        holding logical block j. Entries past the blocks in use may be anything (-1).
    k_cache : float array, shape (num_blocks, block_size, d)
    v_cache : float array, shape (num_blocks, block_size, dv)
    seq_len : int >= 0, tokens in the sequence
    block_size : int >= 1, token slots per page (``k_cache.shape[1]``)

    Returns
    -------
    out : float array, shape (dv,): ``softmax(q . k / sqrt(d)) @ v`` over the sequence's
        ``seq_len`` keys. ``seq_len = 0`` gives zeros.

    Rule: for ``j`` in ``range(ceil(seq_len / block_size))``: ``n = min(block_size,
    seq_len - j * block_size)`` valid tokens, keys ``k_cache[block_table[j], :n]`` (and
    the same values); fold the block into ``(m, l, o)`` with the online softmax. Read
    only those n slots: past ``seq_len`` the page holds stale data, even NaN. Do not pad
    with zeros either: a zero key still scores 0.
    """
    q = np.asarray(q, dtype=np.float64)
    scale = 1.0 / np.sqrt(q.shape[0])
    m, l, o = -np.inf, 0.0, np.zeros(v_cache.shape[2])
    num_used = seq_len // block_size                  # ceil: the last block may be partial
    for j in range(num_used):
        n = min(block_size, seq_len - j * block_size)
        page = block_table[j]
        k_blk = np.asarray(k_cache[page, :n], dtype=np.float64)   # the block-table look-up
        v_blk = np.asarray(v_cache[page, :n], dtype=np.float64)
        s = (k_blk @ q) * scale                             # (n,) scores
        m_new = max(m, float(s.max()))
        alpha = np.exp(m - m_new)
        p = np.exp(s - m_new)
        l = alpha * l + p.sum()
        o = alpha * o + p @ v_blk
        m = m_new
    return o / l if l > 0 else np.zeros_like(o)
