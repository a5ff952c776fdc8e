"""Paged attention (notebook 07): the key tiles come through a block table.

A serving engine stores the KV cache in fixed-size pages. Logical block ``j`` of a
sequence (tokens ``j*block_size`` to ``(j+1)*block_size - 1``) lives in physical page
``block_table[j]``. The flash loop already walks the keys a tile at a time, so let
each tile be one logical block, fetched through the table. The last block is usually
only partly filled; what lies past ``seq_len`` is whatever the page held before.

Source: Kwon et al. 2023, PagedAttention, Sec. 4.1-4.2; Dao 2023, FA-2 Alg. 1.

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("paged")``. A reference answer is in ``solutions/paged.py``.
"""
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

    What must hold: the output equals attention over the sequence's ``seq_len`` keys,
    in one pass over its pages (notebook 07, section 2), whatever the slots of the last
    page past ``seq_len`` hold (stale data, even NaN).
    """
    raise NotImplementedError
