"""How big things are: the score matrix textbook attention materialises, in bytes.

The whole point of FlashAttention is a number: the (Nq, Nk) score matrix ``S``
per head, which the textbook algorithm writes to memory and the tiled one never
builds. These helpers compute that number (and print it) so a notebook can show
it instead of typing it.
"""
from __future__ import annotations

import numbers

import numpy as np

__all__ = ["score_matrix_bytes", "format_bytes"]


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def _float_itemsize(dtype) -> int:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must name a float dtype such as 'float16', got {dtype!r}") from None
    if not np.issubdtype(dt, np.floating):
        raise TypeError(f"dtype must be a float dtype (float16/float32/float64), got {dt}")
    return dt.itemsize


def score_matrix_bytes(n_queries, n_keys, *, heads=1, batch=1, dtype="float16") -> int:
    """Bytes needed to hold the attention score matrix ``S = q k^T`` for every head.

    Textbook attention (Vaswani et al. 2017, Eq. 1) materialises ``S`` of shape
    ``(batch, heads, n_queries, n_keys)`` before the softmax; FlashAttention
    (Dao et al. 2022, Sec. 3.1) only ever holds one ``block_q x tile`` slice of it.

    Parameters
    ----------
    n_queries, n_keys : int >= 1
        Query rows Nq and keys Nk (for self-attention over N tokens both are N).
    heads, batch : int >= 1
        Attention heads and sequences; S has one (Nq, Nk) matrix per (batch, head).
    dtype : str or numpy dtype, a float type (default ``"float16"``, 2 bytes)

    Returns
    -------
    int, the size in bytes: ``batch * heads * n_queries * n_keys * itemsize``.
    For N = 8192, 32 heads, fp16 that is 4 GiB (4 * 2**30 bytes) for one layer.

    Raises TypeError for a non-int count (bools included) or a non-float dtype,
    ValueError for a count below 1.
    """
    nq = _check_count(n_queries, "n_queries")
    nk = _check_count(n_keys, "n_keys")
    h = _check_count(heads, "heads")
    b = _check_count(batch, "batch")
    return b * h * nq * nk * _float_itemsize(dtype)


def format_bytes(n) -> str:
    """A byte count in binary units, e.g. ``format_bytes(4 * 2**30) == '4.00 GiB'``.

    ``n`` is a non-negative int (bytes). Units are B, KiB, MiB, GiB, TiB (powers
    of 1024); values below 1024 B are printed exactly. Raises TypeError for a
    non-int and ValueError for a negative count.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"n must be an int number of bytes, got {type(n).__name__} {n!r}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if n < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "TiB":
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")
