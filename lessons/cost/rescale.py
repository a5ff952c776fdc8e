"""Lazy rescaling: how often a block of query rows must still rescale its output, counted from the scores.

In the FA-2 loop (Dao 2023, Alg. 1) every query row multiplies its running output ``o`` by
``alpha = exp(m_old - m_new)`` at every key tile. In the tensor-core rungs a warp owns 16 query rows
(a *row block*) and does that multiply for all of them at once: ``16 * d / 32`` multiplies per thread
and tile, 64 at d = 128. When no row of the block moved its running max ``m`` at a tile, ``alpha`` is
exactly 1 for all 16 rows and the multiply changes nothing, so the warp may skip it and the result
stays bitwise the same. The idea comes from FlashAttention-4's conditional rescaling, which skips the
rescale unless the max grew by more than a threshold and corrects the output at the end; threshold 0,
used here, needs no correction.

How much that saves depends on the scores: a row's max moves often in its first tiles and rarely
later. :func:`rescale_share` counts it for given ``q`` and ``k``; :func:`expected_rescale_share` and
:func:`expected_tile_share` give the same share in closed form for scores that are independent and
identically distributed (a check computed another way). Nothing here runs a kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lessons.core.causal_rule import last_visible_key
from lessons.core.checks import as_float_array, check_flag, check_int, check_scale

__all__ = ["RescaleCount", "rescale_share", "random_rescale_share", "expected_tile_share", "expected_rescale_share",
           "rescale_multiplies_per_thread"]

#: scores computed at once (rows x keys), unless one row block times one tile is more: 4 Mi float32 values are 16 MiB
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True, eq=False)
class RescaleCount:
    """Where a row block's running max moved, per (row block, key tile).

    ``moved``: bool (n_row_blocks, n_tiles), True where at least one row of the row block raised its
    running max ``m`` at that key tile, so ``alpha != 1`` for that row and the block must rescale.
    ``visited``: bool, the same shape, False for the tiles a causal row block skips entirely (its last
    row cannot see the tile's first key); all True without ``causal``. Both are read-only.
    ``block_rows``, ``block_k``: query rows per row block and keys per tile; ``n_queries``,
    ``n_keys``: Nq and Nk; ``causal``: whether the causal rule was applied.

    Row block ``b`` holds query rows ``[b * block_rows, (b + 1) * block_rows)`` (the last one may hold
    fewer), key tile ``t`` keys ``[t * block_k, (t + 1) * block_k)`` (the last one may hold fewer).
    """

    moved: np.ndarray
    visited: np.ndarray
    block_rows: int
    block_k: int
    n_queries: int
    n_keys: int
    causal: bool

    @property
    def n_row_blocks(self) -> int:
        return self.moved.shape[0]

    @property
    def n_tiles(self) -> int:
        return self.moved.shape[1]

    @property
    def rescaled(self) -> int:
        """(row block, tile) pairs that rescale: ``moved.sum()``."""
        return int(self.moved.sum())

    @property
    def skipped(self) -> int:
        """Visited (row block, tile) pairs whose rescale is skipped: visited, and no row's max moved."""
        return int((self.visited & ~self.moved).sum())

    @property
    def share(self) -> float:
        """The share of visited (row block, tile) pairs that still rescale: ``moved.sum() / visited.sum()``,
        a float in (0, 1] (every row block that sees a key rescales at its first tile)."""
        return self.rescaled / int(self.visited.sum())

    @property
    def tile_share(self) -> np.ndarray:
        """Per key tile, the share of the row blocks visiting it that rescale there: float64 (n_tiles,).

        Every tile is visited by at least one row block (the last row sees every key), so no entry
        divides by zero.
        """
        return self.moved.sum(axis=0) / self.visited.sum(axis=0)


def _check_q_k(q, k):
    q = as_float_array(q, "q", (1, 2))
    k = as_float_array(k, "k", (2,))
    q2 = q[None, :] if q.ndim == 1 else q
    if q2.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must share the head dim d: q has shape {q.shape}, k has shape {k.shape}")
    if q2.shape[1] == 0:
        raise ValueError(f"head dim d must be at least 1, got q shape {q.shape}")
    if q2.shape[0] == 0:
        raise ValueError(f"q must hold at least one query row, got shape {q.shape}")
    if k.shape[0] == 0:
        raise ValueError(f"k must hold at least one key, got shape {k.shape}")
    for name, x in (("q", q2), ("k", k)):
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        if bad:
            raise ValueError(f"{name} must be finite: it holds {bad} inf or NaN values (shape {x.shape})")
    return q2, k


def rescale_share(q, k, *, block_rows=16, block_k=64, scale=None, causal=False) -> RescaleCount:
    """Count where lazy rescaling must still rescale: per row block of ``block_rows`` query rows and per
    key tile of ``block_k`` keys, whether any row's running max moved.

    Parameters
    ----------
    q : float array (Nq, d), or (d,) for one query row; Nq >= 1
    k : float array (Nk, d), Nk >= 1. ``v`` is not needed: the max depends on the scores alone.
    block_rows : int >= 1
        Query rows that rescale together: 16 for one warp of the tensor-core rungs (a warp's
        ``mma.sync`` tiles are 16 rows high).
    block_k : int >= 1
        Keys per tile (Bc), 64 in the FA-2 rung.
    scale : float or None
        Scores are ``scale * q k^T``; None means ``1/sqrt(d)``.
    causal : bool
        Bottom-right causal rule (query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``). A row block skips
        the tiles its last row cannot see (``visited`` False there); inside a visited tile the keys a row
        cannot see do not count towards its max. A row that sees no key never moves. (A kernel whose
        thread block holds several row blocks walks the tiles of the whole block: the extra tiles hold no
        key a row block's rows can see, so there it never moves, and the kernel skips more than counted.)

    Returns
    -------
    :class:`RescaleCount` with ``moved`` and ``visited`` of shape ``(ceil(Nq / block_rows),
    ceil(Nk / block_k))``; ``.share`` is the fraction of visited pairs that rescale, ``.tile_share``
    the same per tile. The first tile a row sees always moves its max (from -inf). A max moves only
    when it strictly grows: a score equal to the running max leaves ``alpha = 1``.

    The scores are computed in float32 (float64 when q or k is float64), ``(scale * q) @ k.T``,
    a block of row blocks times a few key tiles at a time (about 4 Mi scores, 16 MiB), never the
    whole (Nq, Nk) matrix; at Nq = Nk = 8192 it takes under a second. A kernel computes its scores
    with other roundings (fp16 inputs, fused multiply-adds, log2 e folded into the scale), so where two
    scores of a row are within a rounding of each other its count can differ from this one.

    Raises
    ------
    TypeError
        ``q`` or ``k`` not a float array; ``block_rows``/``block_k`` not an int (bools refused);
        ``scale`` not a real number; ``causal`` not True or False.
    ValueError
        Wrong ranks, ``q`` and ``k`` with different d, no query row or no key, inf or NaN in ``q`` or
        ``k``, a block size below 1, a non-finite ``scale``, or scores that overflow (inf).

    Source: the rescale by ``alpha`` is Dao 2023 (FlashAttention-2), Alg. 1; skipping it unless the max
    moved follows FlashAttention-4's conditional rescaling, here with threshold 0 (exact).
    """
    q2, k = _check_q_k(q, k)
    block_rows = check_int(block_rows, "block_rows", min=1)
    block_k = check_int(block_k, "block_k", min=1)
    scale = check_scale(scale, q2.shape[1])
    causal = check_flag(causal, "causal")
    nq, nk = q2.shape[0], k.shape[0]
    dtype = np.result_type(q2.dtype, k.dtype, np.float32)
    with np.errstate(over="ignore"):                                 # overflow is refused with the scores
        qs = (q2.astype(dtype, copy=False) * dtype.type(scale)).astype(dtype, copy=False)
    kt = np.ascontiguousarray(k.astype(dtype, copy=False).T)
    n_blocks, n_tiles = -(-nq // block_rows), -(-nk // block_k)
    given = (block_rows, block_k)                   # (recorded as asked for; blocks larger than the whole
    block_rows, block_k = min(block_rows, max(nq, 1)), min(block_k, max(nk, 1))    # are one block, as big as it)

    # row chunks of whole row blocks, key chunks of whole tiles, at most _CHUNK_ELEMENTS scores each
    rows_per_chunk = block_rows * max(1, _CHUNK_ELEMENTS // (block_rows * block_k) // 8)
    rows_per_chunk = min(rows_per_chunk, n_blocks * block_rows)
    tiles_per_chunk = max(1, _CHUNK_ELEMENTS // (rows_per_chunk * block_k))
    moved = np.zeros((n_blocks, n_tiles), bool)
    for r0 in range(0, nq, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, nq)
        rows = np.arange(r0, r1)
        m = np.full(r1 - r0, -np.inf, dtype)                     # the running max of each row
        row_moved = np.zeros((r1 - r0, n_tiles), bool)
        for t0 in range(0, n_tiles, tiles_per_chunk):
            t1 = min(t0 + tiles_per_chunk, n_tiles)
            c0, c1 = t0 * block_k, min(t1 * block_k, nk)
            with np.errstate(over="ignore", invalid="ignore"):      # refused just below
                s = qs[r0:r1] @ kt[:, c0:c1]
            if not np.isfinite(s).all():
                raise ValueError(f"the scores scale * q k^T overflow {dtype.name} (inf) for rows {r0}..{r1 - 1}, "
                                 f"keys {c0}..{c1 - 1}: scale q or k down")
            if causal:
                s[np.arange(c0, c1)[None, :] > last_visible_key(rows, nq, nk)[:, None]] = -np.inf
            pad = (t1 - t0) * block_k - (c1 - c0)                # the last tile may be short
            if pad:
                s = np.concatenate([s, np.full((r1 - r0, pad), -np.inf, dtype)], axis=1)
            tile_max = s.reshape(r1 - r0, t1 - t0, block_k).max(axis=2)
            after = np.maximum.accumulate(np.concatenate([m[:, None], tile_max], axis=1), axis=1)
            row_moved[:, t0:t1] = after[:, 1:] > after[:, :-1]   # -inf -> -inf is no move
            m = after[:, -1]
        pad = -(r1 - r0) % block_rows                             # the last row block may be short
        if pad:
            row_moved = np.concatenate([row_moved, np.zeros((pad, n_tiles), bool)])
        moved[r0 // block_rows:r0 // block_rows + len(row_moved) // block_rows] = \
            row_moved.reshape(-1, block_rows, n_tiles).any(axis=1)

    if causal:
        last_row = np.minimum((np.arange(n_blocks) + 1) * block_rows, nq) - 1
        visited = np.arange(n_tiles)[None, :] * block_k <= last_visible_key(last_row, nq, nk)[:, None]
    else:
        visited = np.ones((n_blocks, n_tiles), bool)
    assert not (moved & ~visited).any(), "a row block moved its max on a tile it never visits"
    moved.setflags(write=False)
    visited.setflags(write=False)
    return RescaleCount(moved=moved, visited=visited, block_rows=given[0], block_k=given[1],
                        n_queries=nq, n_keys=nk, causal=causal)


def random_rescale_share(n, d, *, seed=0, block_rows=16, block_k=64, causal=False) -> RescaleCount:
    """:func:`rescale_share` for self-attention over ``n`` tokens with random normal ``q`` and ``k``
    (both ``(n, d)``, float32, drawn from ``numpy.random.default_rng(seed)``, q first) and the default
    scale ``1/sqrt(d)``: the case :func:`expected_rescale_share` describes. Raises TypeError /
    ValueError naming ``n``, ``d`` or ``seed`` when one is not an int (``n``, ``d`` >= 1,
    ``seed`` >= 0); the rest as :func:`rescale_share`.
    """
    n = check_int(n, "n", min=1)
    d = check_int(d, "d", min=1)
    seed = check_int(seed, "seed", min=0)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, d), dtype=np.float32)
    k = rng.standard_normal((n, d), dtype=np.float32)
    return rescale_share(q, k, block_rows=block_rows, block_k=block_k, causal=causal)


def expected_tile_share(n_k, *, block_rows=16, block_k=64) -> np.ndarray:
    """Per key tile, the chance that a row block rescales there, when every score is an independent draw
    from one continuous distribution: float64 (ceil(n_k / block_k),).

    For one row, tile j (1-based) moves the running max iff the largest of the first ``K_j`` scores lies
    in tile j: probability ``b_j / K_j`` (``b_j`` keys in tile j, ``K_j`` keys up to its end), that is
    ``1/j`` for equal tiles. For ``block_rows = R`` independent rows: ``1 - (1 - b_j / K_j) ** R``.
    Tile 1 is always 1.

    Random normal q and k come close to this but not exactly: given q, one row's scores are independent
    (so ``R = 1`` is exact on average), but rows share their keys, so the rows of a block are not quite
    independent. No causal mask. Raises TypeError / ValueError naming an argument that is not an
    int >= 1.
    """
    n_k = check_int(n_k, "n_k", min=1)
    block_rows = check_int(block_rows, "block_rows", min=1)
    block_k = check_int(block_k, "block_k", min=1)
    sizes = np.full(-(-n_k // block_k), block_k, np.float64)
    sizes[-1] = n_k - (len(sizes) - 1) * block_k
    one_row = sizes / np.cumsum(sizes)
    return 1.0 - (1.0 - one_row) ** block_rows


def expected_rescale_share(n_k, *, block_rows=16, block_k=64) -> float:
    """The share of (row block, tile) pairs that rescale, for independent identically distributed scores
    and no causal mask: the mean of :func:`expected_tile_share` over the tiles, a float in (0, 1].

    E.g. ``n_k = 8192``, 16 rows, 64-key tiles: 128 tiles, 0.32 (the first 5 tiles rescale with
    probability 0.97 or more, tile 128 with 0.12). Errors as :func:`expected_tile_share`.
    """
    return float(expected_tile_share(n_k, block_rows=block_rows, block_k=block_k).mean())


def rescale_multiplies_per_thread(head_dim, *, block_rows=16, threads=32) -> int:
    """Multiplies one thread does to rescale its share of a row block's output ``o`` at one tile:
    ``block_rows * head_dim / threads`` (64 at d = 128: a warp's 16 x 128 floats of ``o`` over its 32
    threads). Raises TypeError / ValueError naming an argument that is not an int >= 1, and ValueError
    when the output does not split evenly over the threads.
    """
    head_dim = check_int(head_dim, "head_dim", min=1)
    block_rows = check_int(block_rows, "block_rows", min=1)
    threads = check_int(threads, "threads", min=1)
    if (block_rows * head_dim) % threads:
        raise ValueError(f"block_rows * head_dim = {block_rows * head_dim} does not split evenly over "
                         f"threads = {threads}")
    return block_rows * head_dim // threads
