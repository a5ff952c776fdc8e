"""GQA in a paged decode (notebook 09): query heads share KV heads.

Grouped-query attention keeps fewer KV heads than query heads: ``num_heads`` query
heads are cut into ``num_kv_heads`` groups of ``num_heads // num_kv_heads`` consecutive
heads, and every head of a group reads the same KV head. A decode kernel loads each
KV block once and uses it for the whole group: FlashAttention's recurrence,
PagedAttention's block table and GQA's sharing, in one loop.

Source: Ainslie et al. 2023, "GQA", Sec. 2.2; Kwon et al. 2023, PagedAttention,
Sec. 4.1; Dao 2023, FA-2 Alg. 1.
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
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not 0 <= h < num_heads:
        raise ValueError(f"h must be in [0, {num_heads}), got {h}")
    return h // (num_heads // num_kv_heads)


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
            heads = slice(g * group, (g + 1) * group)                    # kv_head(h) == g for these h
            states[g] = absorb(states[g], (q[heads] @ k_blk.T) * scale, v_blk)
    return np.concatenate([finalize(st)[0] for st in states], axis=0)
