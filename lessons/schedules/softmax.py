"""Softmax in three passes, in two, and in one: the road to FlashAttention.

* :func:`safe_softmax` - the textbook-stable form. Pass 1 finds the row maximum,
  pass 2 sums ``exp(x - max)``, pass 3 normalises and writes the result.
* :func:`online_softmax` - Milakov & Gimelshein 2018 (Alg. 3). Pass 1 keeps a
  running maximum ``m`` and a running sum ``l`` and corrects ``l`` by
  ``alpha = exp(m_old - m_new)`` whenever the maximum moves, so max and sum come
  out of a single sweep; pass 2 normalises.
* :func:`fused_softmax_matmul` - the form attention uses: the probabilities are
  never written at all. What leaves the sweep is ``softmax(x) @ v``, accumulated
  by the very same fold as attention (:func:`lessons.core.state.absorb`).

:func:`softmax_traffic` runs each algorithm on a counting memory and reports how
many times it swept over ``x`` and how many elements it read and wrote.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lessons.core.checks import as_float_array, check_flag, check_positive_int
from lessons.core.state import State, absorb, correction_factor, finalize, safe_max

__all__ = ["safe_softmax", "online_softmax", "fused_softmax_matmul", "OnlineSoftmaxTrace",
           "SoftmaxTraffic", "softmax_traffic", "SOFTMAX_METHODS"]

SOFTMAX_METHODS = ("safe", "online", "fused")


class _Memory:
    """The input ``x`` and output ``y`` of a softmax, with every element access counted.

    ``loads`` and ``stores`` have the shape of ``x`` (rows, n) and count how often
    each element was read from ``x`` or written to ``y``.
    """

    def __init__(self, x: np.ndarray, counting: bool):
        self.x = x
        self.y = np.empty_like(x)
        self.loads = np.zeros(x.shape, dtype=np.int64) if counting else None
        self.stores = np.zeros(x.shape, dtype=np.int64) if counting else None

    def load(self, c0: int, c1: int) -> np.ndarray:
        if self.loads is not None:
            self.loads[:, c0:c1] += 1
        return self.x[:, c0:c1]

    def store(self, c0: int, c1: int, value: np.ndarray) -> None:
        if self.stores is not None:
            self.stores[:, c0:c1] += 1
        self.y[:, c0:c1] = value


def _tiles(n: int, tile: int):
    return [(c0, min(c0 + tile, n)) for c0 in range(0, n, tile)]


def _row_max(block: np.ndarray, rows: int) -> np.ndarray:
    return block.max(axis=1) if block.shape[1] else np.full(rows, -np.inf, dtype=block.dtype)


def _normalise(p: np.ndarray, l: np.ndarray) -> np.ndarray:
    """``p / l`` row-wise; a row with ``l == 0`` exactly (all ``-inf``) becomes 0, never NaN.

    Only the empty row is special: a NaN ``l`` (from a NaN or ``+inf`` input)
    stays NaN, so bad input is never silently turned into zeros.
    """
    empty = l == 0
    return np.where(empty[:, None], 0.0, p / np.where(empty, 1.0, l)[:, None])


def _safe_passes(mem: _Memory, tile: int) -> None:
    rows, n = mem.x.shape
    m = np.full(rows, -np.inf, dtype=mem.x.dtype)
    for c0, c1 in _tiles(n, tile):                       # pass 1: the maximum
        m = np.maximum(m, _row_max(mem.load(c0, c1), rows))
    l = np.zeros(rows, dtype=mem.x.dtype)
    for c0, c1 in _tiles(n, tile):                       # pass 2: the sum, against that maximum
        l += np.exp(mem.load(c0, c1) - safe_max(m)[:, None]).sum(axis=1)
    for c0, c1 in _tiles(n, tile):                       # pass 3: normalise and write
        mem.store(c0, c1, _normalise(np.exp(mem.load(c0, c1) - safe_max(m)[:, None]), l))


def _online_passes(mem: _Memory, tile: int, record: list | None) -> None:
    rows, n = mem.x.shape
    m = np.full(rows, -np.inf, dtype=mem.x.dtype)
    l = np.zeros(rows, dtype=mem.x.dtype)
    for c0, c1 in _tiles(n, tile):                       # pass 1: running max and sum together
        x = mem.load(c0, c1)
        m_new = np.maximum(m, _row_max(x, rows))
        alpha = correction_factor(m, m_new)              # rescale what was summed against the old max
        l = alpha * l + np.exp(x - safe_max(m_new)[:, None]).sum(axis=1)
        if record is not None:
            record.append((c0, c1, m.copy(), m_new.copy(), alpha, l.copy()))
        m = m_new
    for c0, c1 in _tiles(n, tile):                       # pass 2: normalise and write
        mem.store(c0, c1, _normalise(np.exp(mem.load(c0, c1) - safe_max(m)[:, None]), l))


def _check_x(x) -> tuple[np.ndarray, bool, np.dtype]:
    arr = as_float_array(x, "x", (1, 2))
    one = arr.ndim == 1
    x2 = arr[None, :] if one else arr
    work = np.result_type(arr.dtype, np.float32)         # float16 is computed in float32
    return x2.astype(work, copy=False), one, arr.dtype


def safe_softmax(x):
    """Numerically safe softmax in three passes over ``x`` (max, sum, normalise).

    Parameters
    ----------
    x : float array, shape (n,) or (rows, n); the softmax is taken along the last
        axis (row-wise). ``-inf`` entries are masked scores and get probability 0.

    Returns
    -------
    ndarray of the shape and dtype of ``x`` (float16 is computed in float32),
    each row summing to 1. A row that is entirely ``-inf`` gives zeros, never NaN;
    a row holding a NaN or a ``+inf`` gives NaN (it is not silently zeroed).

    Raises TypeError for a non-float ``x``, ValueError for 0-D or 3-D input.

    Source: Milakov & Gimelshein 2018, Alg. 2 ("safe softmax": 3 loads and 1
    store per element).
    """
    x2, one, dtype = _check_x(x)
    mem = _Memory(x2, counting=False)
    _safe_passes(mem, max(x2.shape[1], 1))
    y = mem.y.astype(dtype, copy=False)
    return y[0] if one else y


@dataclass(frozen=True)
class OnlineSoftmaxTrace:
    """The running state of pass 1 of :func:`online_softmax`, one entry per tile.

    ``key_start``, ``key_stop`` : int arrays (n_tiles,), the elements of each tile.
    ``m_before``, ``m``, ``alpha``, ``l`` : float arrays (n_tiles, rows): the
    running max before and after the tile, the correction ``exp(m_before - m)``
    applied to ``l``, and the running sum after the tile.
    """

    key_start: np.ndarray
    key_stop: np.ndarray
    m_before: np.ndarray
    m: np.ndarray
    alpha: np.ndarray
    l: np.ndarray

    def __len__(self) -> int:
        return len(self.key_start)


def online_softmax(x, tile, *, return_trace=False):
    """Softmax in two passes: one sweep keeps a running max and sum, one normalises.

    Parameters
    ----------
    x : float array, shape (n,) or (rows, n); softmax along the last axis.
    tile : int >= 1
        Elements read per step of pass 1 (any size; it need not divide n).
    return_trace : bool
        Also return an :class:`OnlineSoftmaxTrace` of pass 1.

    Returns
    -------
    ndarray of the shape and dtype of ``x`` (or ``(y, trace)``), equal to
    :func:`safe_softmax` up to float rounding. An all ``-inf`` row gives zeros;
    a row holding a NaN or a ``+inf`` gives NaN.

    Raises TypeError for a non-float ``x``, a non-int ``tile`` or a ``return_trace``
    that is not True/False; ValueError for 0-D or 3-D input or ``tile < 1``.

    Source: Milakov & Gimelshein 2018, Alg. 3 (online normaliser calculation):
    ``m_j = max(m_{j-1}, x_j)``, ``d_j = d_{j-1} * exp(m_{j-1} - m_j) + exp(x_j - m_j)``.
    """
    x2, one, dtype = _check_x(x)
    tile = check_positive_int(tile, "tile")
    record = [] if check_flag(return_trace, "return_trace") else None
    mem = _Memory(x2, counting=False)
    _online_passes(mem, tile, record)
    y = mem.y.astype(dtype, copy=False)
    y = y[0] if one else y
    if not return_trace:
        return y
    rows = x2.shape[0]
    stack = (lambda i: np.array([r[i] for r in record]).reshape(len(record), rows))
    trace = OnlineSoftmaxTrace(
        key_start=np.array([r[0] for r in record], dtype=int),
        key_stop=np.array([r[1] for r in record], dtype=int),
        m_before=stack(2), m=stack(3), alpha=stack(4), l=stack(5))
    return y, trace


def fused_softmax_matmul(x, v, tile):
    """``softmax(x) @ v`` in a single pass: the probabilities are never written.

    This is the fused form of the online softmax that attention uses: each tile
    of ``x`` is folded into the running state ``(m, l, o)`` with
    :func:`lessons.core.state.absorb` and divided once at the end
    (:func:`lessons.core.state.finalize`). With ``x = scale * q k^T`` it *is*
    :func:`lessons.flash_attention`.

    Parameters
    ----------
    x : float array, shape (n,) or (rows, n) - the scores.
    v : float array, shape (n, dv) - one value row per score.
    tile : int >= 1, elements folded per step.

    Returns
    -------
    ndarray (dv,) for 1-D ``x`` or (rows, dv), in the result dtype of ``x`` and
    ``v`` (float16 computed in float32). A row of all ``-inf`` gives zeros. A value
    whose score is ``-inf`` in a row adds exactly nothing to that row, even NaN or inf.

    Raises TypeError for non-float input or a non-int tile, ValueError for a bad
    rank, ``tile < 1``, or ``v`` whose length differs from ``x``'s.

    Source: Milakov & Gimelshein 2018, Sec. 4 (softmax fused with the following
    operation); Dao et al. 2022, Alg. 1; Dao 2023, Alg. 1.
    """
    x2, one, dtype = _check_x(x)
    v = as_float_array(v, "v", (2,))
    out_dtype = np.result_type(dtype, v.dtype)           # before v is upcast for the work
    tile = check_positive_int(tile, "tile")
    if v.shape[0] != x2.shape[1]:
        raise ValueError(f"v must have one row per element of x: x has shape {np.shape(x)}, v has shape {v.shape}")
    work = np.result_type(x2.dtype, v.dtype)
    x2, v = x2.astype(work, copy=False), v.astype(work, copy=False)
    state = State.empty(x2.shape[0], v.shape[1], work)
    for c0, c1 in _tiles(x2.shape[1], tile):
        state = absorb(state, x2[:, c0:c1], v[c0:c1])
    out, _ = finalize(state)
    out = out.astype(out_dtype, copy=False)
    return out[0] if one else out


@dataclass(frozen=True)
class SoftmaxTraffic:
    """Memory traffic of one softmax algorithm over ``rows`` rows of length ``n``.

    ``passes``: sweeps over ``x`` (every element was read this many times);
    ``reads``: elements of ``x`` read; ``writes``: probabilities written (elements).
    The fused form writes no probabilities: only the ``dv`` numbers of
    ``softmax(x) @ v`` per row leave it (not counted here).
    """

    method: str
    n: int
    rows: int
    tile: int
    passes: int
    reads: int
    writes: int


def softmax_traffic(method, n, *, tile=None, rows=1):
    """Count, by running the algorithm on a counting memory, its passes, reads and writes.

    Parameters
    ----------
    method : ``"safe"`` (3 passes), ``"online"`` (2 passes) or ``"fused"`` (1 pass).
    n : int >= 1, row length.
    tile : int >= 1, elements per step; default ``n`` (one step per pass).
    rows : int >= 1.

    Returns a :class:`SoftmaxTraffic`. Reads and writes are in elements; multiply
    by the element size for bytes. Hand count per row: safe 3n reads and n
    writes, online 2n and n, fused n and 0 (Milakov & Gimelshein 2018, Secs. 2-3:
    4 memory accesses per element for safe softmax, 3 for online softmax; Sec. 4
    fuses the softmax with the operation that consumes it).

    Raises ValueError for an unknown method or a count < 1, TypeError for non-ints.
    """
    if not isinstance(method, str) or method not in SOFTMAX_METHODS:
        raise ValueError(f"method must be one of {SOFTMAX_METHODS}, got {method!r}")
    n = check_positive_int(n, "n")
    rows = check_positive_int(rows, "rows")
    tile = n if tile is None else check_positive_int(tile, "tile")
    mem = _Memory(np.zeros((rows, n)), counting=True)
    if method == "safe":
        _safe_passes(mem, tile)
    elif method == "online":
        _online_passes(mem, tile, None)
    else:                                                # fused: one sweep straight into (m, l, o)
        state = State.empty(rows, 1)
        ones = np.ones((n, 1))
        for c0, c1 in _tiles(n, tile):
            state = absorb(state, mem.load(c0, c1), ones[c0:c1])
    passes = int(mem.loads.max())
    if not np.all(mem.loads == passes):
        raise AssertionError("some elements were read more often than others")   # a counting bug, not input
    return SoftmaxTraffic(method=method, n=n, rows=rows, tile=tile, passes=passes,
                          reads=int(mem.loads.sum()), writes=int(mem.stores.sum()))
