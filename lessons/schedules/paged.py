"""PagedAttention: the key tiles come from a paged KV cache, through a block table.

A serving engine (vLLM, SGLang, FlashInfer) does not keep a sequence's keys in one
contiguous array. It keeps a pool of fixed-size *pages* (physical blocks of
``block_size`` token slots) and, per sequence, a ``block_table`` that says which page
holds logical block 0, 1, 2, ... The flash loop already walks the keys one tile at
a time, so the tiles need not be contiguous: make each tile one logical block and
fetch it through the table. That one look-up is the whole difference.

Source: Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", Sec. 4.1-4.2 (block table, paged kernel); the fold is
Dao 2023, FA-2 Alg. 1.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from lessons.core.checks import as_float_array, check_flag, check_int, check_positive_int, check_scale
from lessons.core.result import pack_result
from lessons.core.state import State, absorb, finalize
from lessons.core.trace import TileStep, Trace, record_step

__all__ = ["paged_flash_attention", "sequence_pages", "write_paged_cache", "paged_schedule",
           "PagedStep", "PagedTrace"]


@dataclass(frozen=True)
class PagedStep(TileStep):
    """One absorbed logical block: a :class:`lessons.core.trace.TileStep` plus the physical page.

    ``tile`` is the logical block index, ``key_start``/``key_stop`` the token
    positions ``[logical * block_size, logical * block_size + n)`` in the sequence,
    and ``page`` the physical block of the cache the keys were read from.
    """

    page: int


@dataclass
class PagedTrace(Trace):
    """A :class:`lessons.core.trace.Trace` whose steps are :class:`PagedStep` records.

    ``tile`` is the ``block_size``; ``num_blocks`` the number of pages in the cache;
    ``block_table`` the table that was followed (int array, or None if not recorded).
    ``trace.row(i)`` works as for any trace; ``pages`` lists the pages read, in order.
    """

    num_blocks: int = 0
    block_table: np.ndarray = None

    @property
    def pages(self) -> list[int]:
        """Physical pages read, one per step, in the order they were absorbed."""
        return [s.page for s in self.steps]

    @property
    def logical_blocks(self) -> list[int]:
        """Logical block index of each step (0, 1, 2, ... for one sequence)."""
        return [s.tile for s in self.steps]


def _check_index_array(x, name: str, ndim: int) -> np.ndarray:
    """An integer array of the given rank (bools and floats refused)."""
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError(f"{name} must be an integer array, got {type(x).__name__}")
    arr = np.asarray(x)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        if arr.size == 0 and arr.dtype == np.float64:   # an empty list [] comes in as float64
            arr = arr.astype(np.int64)
        else:
            what = "token counts" if name.startswith("seq_len") else "page indices"
            raise TypeError(f"{name} must hold integers ({what}), got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    return arr


def sequence_pages(block_table, seq_len, block_size, num_blocks, *, name="block_table"):
    """The pages one sequence occupies: a list of ``(logical, page, n)`` triples.

    Parameters
    ----------
    block_table : int array, shape (num_blocks_per_seq,)
        Physical page of each logical block. Only the first
        ``ceil(seq_len / block_size)`` entries are used; entries after them are never
        read (they may hold padding such as -1).
    seq_len : int >= 0, tokens in the sequence.
    block_size : int >= 1, token slots per page.
    num_blocks : int >= 0, pages in the cache (valid pages are ``0 .. num_blocks-1``).
    name : str, the argument name used in error messages.

    Returns a list with one ``(logical, page, n)`` per used block, ``n`` the valid
    slots in it (``block_size`` except possibly the last). ``seq_len`` a multiple of
    ``block_size`` uses exactly ``seq_len // block_size`` pages, no extra one.

    Raises ValueError if the table is shorter than the blocks ``seq_len`` needs, a
    used entry is outside ``[0, num_blocks)``, or two used entries name the same page
    (a page holds the keys of one block of one sequence; sequences may share a page,
    one sequence's blocks may not); TypeError for a non-integer table.
    """
    table = _check_index_array(block_table, name, 1)
    seq_len = check_int(seq_len, "seq_len", min=0)
    block_size = check_positive_int(block_size, "block_size")
    num_blocks = check_int(num_blocks, "num_blocks", min=0)
    needed = -(-seq_len // block_size)
    if table.shape[0] < needed:
        raise ValueError(
            f"{name} is too short: seq_len {seq_len} with block_size {block_size} needs "
            f"{needed} blocks, {name} has {table.shape[0]} (shape {table.shape})")
    used = table[:needed]
    bad = np.flatnonzero((used < 0) | (used >= num_blocks))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name}[{i}] = {int(used[i])} points outside the cache: pages are 0 .. {num_blocks - 1} "
            f"(num_blocks = {num_blocks})")
    first = {}
    for j, page in enumerate(used.tolist()):
        if page in first:
            raise ValueError(
                f"{name} names page {page} for logical blocks {first[page]} and {j}: each block of a sequence "
                f"needs a page of its own (a page holds one block's keys)")
        first[page] = j
    return [(j, int(used[j]), min(block_size, seq_len - j * block_size)) for j in range(needed)]


def _check_caches(k_cache, v_cache, kv_axis: bool):
    """Float caches ``(num_blocks, block_size[, num_kv_heads], d)`` with matching leading axes."""
    nd = 4 if kv_axis else 3
    k_cache = as_float_array(k_cache, "k_cache", (nd,))
    v_cache = as_float_array(v_cache, "v_cache", (nd,))
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        lead = "(num_blocks, block_size, num_kv_heads)" if kv_axis else "(num_blocks, block_size)"
        raise ValueError(f"k_cache and v_cache must agree on {lead}: k_cache has shape {k_cache.shape}, "
                         f"v_cache has shape {v_cache.shape}")
    if k_cache.shape[-1] == 0:
        raise ValueError(f"head dim d must be at least 1, got k_cache shape {k_cache.shape}")
    return k_cache, v_cache


def paged_flash_attention(q, block_table, k_cache, v_cache, seq_len, block_size, *, scale=None,
                          return_lse=False, return_trace=False):
    """One query attends to one sequence stored in a paged KV cache (one head).

    The flash loop with one extra look-up: for logical block ``j`` the keys are
    ``k_cache[block_table[j], :n]``, where ``n`` is ``block_size`` except in the last,
    partly filled block. Each block is one tile absorbed into the state ``(m, l, o)``.

    Parameters
    ----------
    q : float array, shape (d,) (one decode query), or (Nq, d) for several queries
        that all see the whole sequence (no mask).
    block_table : int array, shape (num_blocks_per_seq,)
        Physical page of each logical block of the sequence. Entries past the
        ``ceil(seq_len / block_size)`` blocks in use are never read.
    k_cache : float array, shape (num_blocks, block_size, d)
    v_cache : float array, shape (num_blocks, block_size, dv)
    seq_len : int >= 0, tokens in the sequence (0 gives ``out = 0``, ``lse = -inf``).
    block_size : int >= 1, must equal ``k_cache.shape[1]``.
    scale : float, default ``1/sqrt(d)``
    return_lse : bool, also return ``lse = m + log(l)`` (a float, or (Nq,) for 2-D q).
    return_trace : bool, also return a :class:`PagedTrace` (one :class:`PagedStep`
        per logical block: logical block, physical page, scores, m, alpha, l, o).

    Returns
    -------
    out, or ``(out[, lse][, trace])``; ``out`` has shape (dv,) (or (Nq, dv)) in the inputs' dtype
    (float16 is accumulated in float32). Equal to :func:`lessons.attention` on the
    sequence's keys laid out contiguously.

    Nothing past ``seq_len`` is read: the unused slots of the last page, pages not in
    the table, and table entries past the blocks in use may hold anything (NaN, inf)
    without changing the result, bitwise. NaN in a key or value of the sequence, or
    in a query row, makes the rows that see it NaN.

    Raises TypeError for non-float q or caches, a non-integer table, a non-int
    ``seq_len``/``block_size`` or a ``return_lse``/``return_trace`` that is not True/False;
    ValueError for wrong ranks, mismatched d or cache shapes, ``block_size != k_cache.shape[1]``, a negative ``seq_len``, a table too short for
    ``seq_len``, a used entry outside ``[0, num_blocks)``, or a page used for two blocks.

    Source: Kwon et al. 2023 (PagedAttention), Sec. 4.1; Dao 2023, Alg. 1.
    """
    return_lse, return_trace = check_flag(return_lse, "return_lse"), check_flag(return_trace, "return_trace")
    q = as_float_array(q, "q", (1, 2))
    k_cache, v_cache = _check_caches(k_cache, v_cache, kv_axis=False)
    block_size = check_positive_int(block_size, "block_size")
    if k_cache.shape[1] != block_size:
        raise ValueError(f"block_size = {block_size} but k_cache has {k_cache.shape[1]} slots per page "
                         f"(shape {k_cache.shape} = (num_blocks, block_size, d))")
    if q.shape[-1] != k_cache.shape[2]:
        raise ValueError(f"q and k_cache must share the head dim d: q has shape {q.shape}, "
                         f"k_cache has shape {k_cache.shape}")
    num_blocks = k_cache.shape[0]
    pages = sequence_pages(block_table, seq_len, block_size, num_blocks)
    seq_len = int(seq_len)
    out_dtype = np.result_type(q.dtype, k_cache.dtype, v_cache.dtype)
    dtype = np.result_type(out_dtype, np.float32)
    scale = dtype.type(check_scale(scale, q.shape[-1]))
    single = q.ndim == 1
    q2 = q.astype(dtype).reshape(-1, q.shape[-1])          # (Nq, d); Nq = 1 for one decode query
    nq = q2.shape[0]
    trace = PagedTrace(nq=nq, nk=seq_len, tile=block_size, block_q=max(nq, 1), num_blocks=num_blocks,
                       block_table=np.array([p for _, p, _ in pages], dtype=np.int64)) if return_trace else None

    state = State.empty(nq, v_cache.shape[2], dtype)
    for logical, page, n in pages:                        # the loop: one logical block per tile
        k_blk = k_cache[page, :n].astype(dtype, copy=False)   # the block-table look-up: (n, d)
        v_blk = v_cache[page, :n].astype(dtype, copy=False)   # only the n valid slots are read
        s = (q2 @ k_blk.T) * scale                          # (Nq, n) scores
        new = absorb(state, s, v_blk)
        start = logical * block_size
        record_step(trace, state, new, s, PagedStep, tile=logical, row_start=0, row_stop=nq,
                    key_start=start, key_stop=start + n, page=page)
        state = new
    out, lse = finalize(state)

    out = out.astype(out_dtype, copy=False)
    if single:
        out, lse = out[0], lse[0]
    return pack_result(out, (return_lse, lse), (return_trace, trace))


def write_paged_cache(k, v, block_size, num_blocks=None, *, seed=0, fill=np.nan):
    """Store one sequence's contiguous keys and values in a shuffled pool of pages.

    What a serving engine's cache writer does for one sequence: take
    ``ceil(Nk / block_size)`` free pages from the pool (here: a random choice without
    repeats), copy block ``j`` of the keys into the page ``block_table[j]``, and leave
    every other slot as it was (here: ``fill``, NaN by default, to show it is never read).

    Parameters
    ----------
    k : float array, shape (Nk, d); v : float array, shape (Nk, dv)
    block_size : int >= 1, token slots per page.
    num_blocks : int, pages in the pool, at least the number needed (default: twice
        that number, at least 4).
    seed : int, chooses the pages (``numpy.random.default_rng(seed)``).
    fill : float, the value of every slot the sequence does not use.

    Returns ``(block_table, k_cache, v_cache)``: int64 (ceil(Nk / block_size),),
    float (num_blocks, block_size, d) and (num_blocks, block_size, dv) in the dtype of
    k and v. ``paged_flash_attention(q, *result, Nk, block_size)`` equals
    ``attention(q, k, v)``.

    Raises TypeError / ValueError naming the argument for non-float or mismatched
    k and v, ``block_size`` < 1, ``num_blocks`` too small for the sequence, a ``seed``
    that is not an int >= 0 or a ``fill`` that is not a real number.
    """
    k = as_float_array(k, "k", (2,))
    v = as_float_array(v, "v", (2,))
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same number of keys Nk: k has shape {k.shape}, v has shape {v.shape}")
    block_size = check_positive_int(block_size, "block_size")
    nk = k.shape[0]
    needed = -(-nk // block_size)
    if num_blocks is None:
        num_blocks = max(2 * needed, 4)
    num_blocks = check_int(num_blocks, "num_blocks", min=0)
    if num_blocks < needed:
        raise ValueError(f"num_blocks = {num_blocks} is too small: Nk = {nk} keys in pages of {block_size} "
                         f"need {needed} pages")
    seed = check_int(seed, "seed", min=0)
    if isinstance(fill, (bool, np.bool_)) or not isinstance(fill, numbers.Real):
        raise TypeError(f"fill must be a real number (NaN by default), got {type(fill).__name__} {fill!r}")
    rng = np.random.default_rng(seed)
    block_table = rng.choice(num_blocks, size=needed, replace=False).astype(np.int64)
    dtype = np.result_type(k.dtype, v.dtype)
    k_cache = np.full((num_blocks, block_size, k.shape[1]), fill, dtype=dtype)
    v_cache = np.full((num_blocks, block_size, v.shape[1]), fill, dtype=dtype)
    for j, page in enumerate(block_table):
        start, stop = j * block_size, min((j + 1) * block_size, nk)
        k_cache[page, :stop - start] = k[start:stop]
        v_cache[page, :stop - start] = v[start:stop]
    return block_table, k_cache, v_cache


def paged_schedule(q, k, v, block_size, *, num_blocks=None, seed=0, scale=None):
    """All query rows of ``q`` through :func:`paged_flash_attention`, as one :class:`PagedTrace`.

    The keys and values are first written into a shuffled page pool
    (:func:`write_paged_cache` with ``num_blocks`` and ``seed``); then all query rows
    run the paged loop together, one step per page. So
    ``trace.row(i)`` replays row i page by page (for a tile stepper) and
    ``trace.pages`` says which page each step read.

    Parameters: q (Nq, d), k (Nk, d), v (Nk, dv) float arrays; ``block_size`` int >= 1;
    ``num_blocks``, ``seed`` as in :func:`write_paged_cache`; ``scale`` as in
    :func:`paged_flash_attention`.

    Returns the PagedTrace (``tile = block_size``, ``block_q = Nq``) with the
    ``block_table`` used stored as ``trace.block_table``.
    Raises the errors of :func:`write_paged_cache` and :func:`paged_flash_attention`.
    """
    q = as_float_array(q, "q", (2,))
    block_table, k_cache, v_cache = write_paged_cache(k, v, block_size, num_blocks, seed=seed)
    nk = np.asarray(k).shape[0]
    _, trace = paged_flash_attention(q, block_table, k_cache, v_cache, nk, block_size, scale=scale,
                                     return_trace=True)
    return trace
