"""The decode kernel: paged KV cache + grouped-query heads + the flash fold, in one loop.

At decode time each sequence of a batch brings one new query token with
``num_heads`` query heads. With grouped-query attention (GQA) the cache stores only
``num_kv_heads`` key/value heads, and query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``. So the loop, per sequence, is

    for each page in the sequence's block table:      # PagedAttention's indirection
        load the page's keys and values (all KV heads)
        for each KV head g:                            # GQA: one load serves the group
            scores of the group's query heads against the page
            absorb them into the group's states (m, l, o)  # the flash fold

which is most of what the decode kernels of FlashInfer and vLLM do.
MHA is ``num_kv_heads == num_heads``; MQA is ``num_kv_heads == 1``.

Source: Kwon et al. 2023 (PagedAttention), Sec. 4; Ainslie et al. 2023, "GQA",
Sec. 2 (grouping); Shazeer 2019 (MQA); Ye et al. 2025 (FlashInfer);
Dao 2023, FA-2 Alg. 1 (the fold).
"""
from __future__ import annotations

import numpy as np

from lessons.core.checks import as_float_array, check_flag, check_int, check_scale
from lessons.schedules.paged import _check_caches, _check_index_array, sequence_pages
from lessons.cost.sizes import element_size
from lessons.core.state import State, absorb, finalize

__all__ = ["paged_decode", "write_paged_batch", "kv_head_of", "kv_cache_bytes"]



def kv_head_of(num_heads: int, num_kv_heads: int) -> np.ndarray:
    """The KV head each query head reads: ``h // (num_heads // num_kv_heads)``.

    Returns an int array of shape (num_heads,). Raises TypeError for non-int input
    and ValueError if either count is < 1 or ``num_heads`` is not a multiple of
    ``num_kv_heads``. Source: Ainslie et al. 2023 (GQA), Sec. 2.
    """
    num_heads = check_int(num_heads, "num_heads", min=1)
    num_kv_heads = check_int(num_kv_heads, "num_kv_heads", min=1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}) "
                         f"so that each KV head serves the same number of query heads")
    return np.arange(num_heads) // (num_heads // num_kv_heads)


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, return_lse=False):
    """Decode attention for a batch of sequences in a paged KV cache, with GQA.

    Parameters
    ----------
    q : float array, shape (num_seqs, num_heads, d), one new token per sequence.
    k_cache : float array, shape (num_blocks, block_size, num_kv_heads, d)
    v_cache : float array, shape (num_blocks, block_size, num_kv_heads, dv)
    block_tables : int array, shape (num_seqs, max_blocks_per_seq)
        Row b lists the pages of sequence b; entries past the
        ``ceil(seq_lens[b] / block_size)`` blocks in use are padding and never read.
    seq_lens : int array, shape (num_seqs,), tokens per sequence (>= 0; lengths may
        differ within the batch; 0 gives zeros and ``lse = -inf``).
    scale : float, default ``1/sqrt(d)``
    return_lse : bool, also return ``lse`` of shape (num_seqs, num_heads).

    Returns
    -------
    out, shape (num_seqs, num_heads, dv), in the inputs' dtype (float16 accumulated
    in float32); with ``return_lse`` the tuple ``(out, lse)``. Query head h of
    sequence b equals :func:`lessons.attention` of ``q[b, h]`` over the sequence's
    keys and values of KV head ``h // (num_heads // num_kv_heads)``.

    Each page is read once per sequence and each KV head's slice of it serves all the
    query heads of its group. Nothing past ``seq_lens[b]`` is read: padding slots,
    free pages and table padding may hold anything (NaN, inf) without changing any
    output, bitwise. NaN in a sequence's keys or values makes that sequence's query
    heads of that KV head NaN, and nothing else.

    Raises TypeError for non-float q or caches, non-integer tables/lengths or a ``return_lse``
    that is not True/False;
    ValueError for wrong ranks, mismatched d, num_seqs or cache shapes, ``num_heads``
    not a multiple of ``num_kv_heads``, a negative length, a block table row too short
    for its length, a used entry outside ``[0, num_blocks)``, or a page used for two blocks
    of one sequence (sequences may share a page, as with a common prefix).

    Source: Kwon et al. 2023, Sec. 4; Ainslie et al. 2023, Sec. 2; Dao 2023, Alg. 1.
    """
    return_lse = check_flag(return_lse, "return_lse")
    q = as_float_array(q, "q", (3,))
    k_cache, v_cache = _check_caches(k_cache, v_cache, kv_axis=True)
    num_seqs, num_heads, d = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    dv = v_cache.shape[3]
    if k_cache.shape[3] != d:
        raise ValueError(f"q and k_cache must share the head dim d: q has shape {q.shape} "
                         f"(num_seqs, num_heads, d), k_cache has shape {k_cache.shape}")
    if block_size == 0:
        raise ValueError(f"block_size (k_cache.shape[1]) must be at least 1, got k_cache shape {k_cache.shape}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}, from q shape {q.shape}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}, from k_cache shape {k_cache.shape})")
    block_tables = _check_index_array(block_tables, "block_tables", 2)
    seq_lens = _check_index_array(seq_lens, "seq_lens", 1)
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(f"q, block_tables and seq_lens must agree on num_seqs: q has shape {q.shape}, "
                         f"block_tables {block_tables.shape}, seq_lens {seq_lens.shape}")
    negative = np.flatnonzero(seq_lens < 0)
    if negative.size:
        b = int(negative[0])
        raise ValueError(f"seq_lens[{b}] must be at least 0 (tokens in sequence {b}), got {int(seq_lens[b])}")
    group = num_heads // num_kv_heads                     # query heads per KV head
    out_dtype = np.result_type(q.dtype, k_cache.dtype, v_cache.dtype)
    dtype = np.result_type(out_dtype, np.float32)
    scale = dtype.type(check_scale(scale, d))
    # every sequence's pages are checked before anything is computed
    pages = [sequence_pages(block_tables[b], int(seq_lens[b]), block_size, num_blocks,
                            name=f"block_tables[{b}]") for b in range(num_seqs)]

    out = np.zeros((num_seqs, num_heads, dv), dtype)
    lse = np.full((num_seqs, num_heads), -np.inf, dtype)
    for b in range(num_seqs):
        q_groups = q[b].astype(dtype).reshape(num_kv_heads, group, d)      # heads g*group .. (g+1)*group-1
        states = [State.empty(group, dv, dtype) for _ in range(num_kv_heads)]
        for _, page, n in pages[b]:                       # one loop over this sequence's pages
            k_blk = k_cache[page, :n].astype(dtype, copy=False)   # (n, num_kv_heads, d): valid slots only
            v_blk = v_cache[page, :n].astype(dtype, copy=False)
            for g in range(num_kv_heads):                 # each KV head is loaded once for its whole group
                s = (q_groups[g] @ k_blk[:, g].T) * scale  # (group, n)
                states[g] = absorb(states[g], s, v_blk[:, g])
        for g, state in enumerate(states):
            out[b, g * group:(g + 1) * group], lse[b, g * group:(g + 1) * group] = finalize(state)

    out = out.astype(out_dtype, copy=False)
    return (out, lse) if return_lse else out


def write_paged_batch(keys, values, block_size, num_blocks=None, *, seed=0, fill=np.nan):
    """Store a batch of sequences in one shuffled page pool, as :func:`paged_decode` reads it.

    Parameters
    ----------
    keys : list of float arrays, sequence b of shape (seq_len_b, num_kv_heads, d)
    values : list of float arrays, sequence b of shape (seq_len_b, num_kv_heads, dv)
    block_size : int >= 1, token slots per page.
    num_blocks : int, pages in the pool, at least the total needed (default: the total
        plus a quarter, at least one spare page).
    seed : int, chooses which free page each block gets (``numpy.random.default_rng``).
    fill : float, the value of every slot no sequence uses (NaN by default).

    Returns ``(k_cache, v_cache, block_tables, seq_lens)``: float arrays
    (num_blocks, block_size, num_kv_heads, d) and (..., dv), int64
    (num_seqs, max_blocks_per_seq) with unused entries set to -1, and int64 (num_seqs,).

    Raises TypeError / ValueError naming the argument for an empty batch, non-float or
    mismatched arrays, or ``num_blocks`` too small.
    """
    if not isinstance(keys, (list, tuple)) or not isinstance(values, (list, tuple)):
        raise TypeError(f"keys and values must be lists of arrays, got {type(keys).__name__} and "
                        f"{type(values).__name__}")
    if len(keys) != len(values) or not keys:
        raise ValueError(f"keys and values must list the same number (>= 1) of sequences, got {len(keys)} "
                         f"and {len(values)}")
    keys = [as_float_array(k, f"keys[{b}]", (3,)) for b, k in enumerate(keys)]
    values = [as_float_array(v, f"values[{b}]", (3,)) for b, v in enumerate(values)]
    for b, (k, v) in enumerate(zip(keys, values)):
        if k.shape[1:] != keys[0].shape[1:] or v.shape[1:] != values[0].shape[1:] or k.shape[:2] != v.shape[:2]:
            raise ValueError(f"sequence {b}: keys {k.shape} / values {v.shape} do not match (seq_len, "
                             f"num_kv_heads, d) = (*, {keys[0].shape[1]}, {keys[0].shape[2]}) and "
                             f"(seq_len, num_kv_heads, dv) = (*, {values[0].shape[1]}, {values[0].shape[2]})")
    block_size = check_int(block_size, "block_size", min=1)
    seq_lens = np.array([k.shape[0] for k in keys], dtype=np.int64)
    needed = [-(-int(n) // block_size) for n in seq_lens]
    total = sum(needed)
    if num_blocks is None:
        num_blocks = total + max(1, total // 4)
    num_blocks = check_int(num_blocks, "num_blocks", min=0)
    if num_blocks < total:
        raise ValueError(f"num_blocks = {num_blocks} is too small: the batch needs {total} pages of {block_size}")
    _, h, d = keys[0].shape
    dv = values[0].shape[2]
    dtype = np.result_type(*(k.dtype for k in keys), *(v.dtype for v in values))
    k_cache = np.full((num_blocks, block_size, h, d), fill, dtype=dtype)
    v_cache = np.full((num_blocks, block_size, h, dv), fill, dtype=dtype)
    free = list(np.random.default_rng(seed).permutation(num_blocks))
    block_tables = np.full((len(keys), max(max(needed), 1)), -1, dtype=np.int64)
    for b, (k, v) in enumerate(zip(keys, values)):
        for j in range(needed[b]):
            page = int(free.pop())
            block_tables[b, j] = page
            start, stop = j * block_size, min((j + 1) * block_size, k.shape[0])
            k_cache[page, :stop - start] = k[start:stop]
            v_cache[page, :stop - start] = v[start:stop]
    return k_cache, v_cache, block_tables, seq_lens


def kv_cache_bytes(seq_len, num_layers, num_kv_heads, head_dim, dtype, *, batch_size=1) -> int:
    """Bytes of KV cache: ``2 * batch_size * seq_len * num_layers * num_kv_heads * head_dim * itemsize``.

    The 2 counts keys and values. MHA has ``num_kv_heads = num_heads``, GQA fewer,
    MQA one. Example: Llama-2-7B (32 layers, 32 KV heads, head_dim 128, float16)
    stores 524,288 bytes = 0.5 MiB per token, so 4096 tokens take 2 GiB; with 8 KV
    heads (GQA, as in Llama-3-8B) the same cache is 4x smaller.

    Parameters
    ----------
    seq_len, num_layers, num_kv_heads, head_dim, batch_size : ints (seq_len >= 0, the
        others >= 1).
    dtype : a float or int NumPy dtype or its name (``np.float16``, ``"float32"``,
        ``np.int8`` for a quantised cache), or one of ``"bfloat16"``/``"bf16"``
        (2 bytes), ``"fp8"``/``"float8_e4m3fn"``/``"float8_e5m2"`` (1 byte)
        (:func:`lessons.cost.sizes.element_size`).

    Returns an int, in bytes. Raises TypeError for non-int counts or a dtype that
    is unknown or not a number type (None, object, str, void, bool, complex),
    ValueError for counts out of range.

    Source: Ainslie et al. 2023 (GQA), Sec. 1-2; Kwon et al. 2023, Sec. 3 (KV cache size).
    """
    counts = dict(seq_len=seq_len, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  batch_size=batch_size)
    for name, value in counts.items():
        check_int(value, name, min=0 if name == "seq_len" else 1)
    itemsize = element_size(dtype, integers=True)
    return 2 * int(batch_size) * int(seq_len) * int(num_layers) * int(num_kv_heads) * int(head_dim) * itemsize
