"""GQA in a paged decode (notebook 09): query heads share KV heads.

Grouped-query attention keeps fewer KV heads than query heads: ``num_heads`` query
heads are cut into ``num_kv_heads`` groups of ``num_heads // num_kv_heads`` consecutive
heads, and every head of a group reads the same KV head. A decode kernel loads each
KV block once and uses it for the whole group: FlashAttention's recurrence,
PagedAttention's block table and GQA's sharing, in one loop.

Source: Ainslie et al. 2023, "GQA", Sec. 2.2; Kwon et al. 2023, PagedAttention,
Sec. 4.1; Dao 2023, FA-2 Alg. 1.

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("gqa_decode")``. A reference answer is in ``solutions/gqa_decode.py``.
"""
import numpy as np
from lessons.core.state import State, absorb, finalize   # the fold of notebook 02: yours to use here


def kv_head(h, num_heads, num_kv_heads):
    """The KV head that query head ``h`` reads (an int).

    Parameters: ``h`` int in ``[0, num_heads)``; ``num_heads``, ``num_kv_heads`` ints >= 1.

    The grouping is the one of notebook 09, section 2 (as in Llama 2 and vLLM). Raise
    ValueError if ``num_heads`` is not a multiple of ``num_kv_heads`` or ``h`` is out
    of range.
    """
    raise NotImplementedError


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

    What must hold: each head's output equals attention over the sequence's first
    ``seq_len`` tokens of its KV head, whatever the slots of the last page past
    ``seq_len`` hold (stale data, even NaN). Raise ValueError if ``num_heads`` is not
    a multiple of ``num_kv_heads``.
    """
    raise NotImplementedError
