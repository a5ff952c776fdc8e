"""How big things are: the score matrix textbook attention materialises, in bytes.

The whole point of FlashAttention is a number: the (Nq, Nk) score matrix ``S``
per head, which the textbook algorithm writes to memory and the tiled one never
builds. These helpers compute that number (and print it) so a notebook can show
it instead of typing it.
"""
from __future__ import annotations

import numbers

import numpy as np
from lessons.core.checks import check_int

__all__ = ["score_matrix_bytes", "format_bytes", "element_size", "EXTRA_ITEMSIZE"]


def _check_count(value, name: str) -> int:
    return check_int(value, name, min=1)


#: Bytes per element of float formats NumPy itself does not have (names are lower-case).
EXTRA_ITEMSIZE = {"bfloat16": 2, "bf16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1}


def element_size(dtype, *, name: str = "dtype", integers: bool = False) -> int:
    """Bytes per element of a float ``dtype`` (or, with ``integers=True``, an int dtype).

    ``dtype`` is a NumPy dtype, scalar type or name (``np.float16``, ``"float32"``), or
    one of :data:`EXTRA_ITEMSIZE` (``"bfloat16"``/``"bf16"`` 2 bytes, ``"fp8"``,
    ``"float8_e4m3fn"``, ``"float8_e5m2"`` 1 byte), case-insensitive. Returns an int >= 1.

    Raises TypeError naming ``name`` for None (NumPy would read it as float64), object,
    string, void, bool or complex dtypes, ints unless ``integers``, and unknown names.
    """
    choices = f"a float dtype such as 'float16' or one of {sorted(EXTRA_ITEMSIZE)}"
    if isinstance(dtype, str) and dtype.lower() in EXTRA_ITEMSIZE:
        return EXTRA_ITEMSIZE[dtype.lower()]
    if dtype is None:
        raise TypeError(f"{name} must be {choices}, got None")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be {choices}, got {dtype!r}") from None
    if dt.name in EXTRA_ITEMSIZE:                    # e.g. ml_dtypes.bfloat16, a NumPy extension type
        return dt.itemsize
    ok = np.issubdtype(dt, np.floating) or (integers and np.issubdtype(dt, np.integer))
    if not ok:
        also = " or an int dtype" if integers else ""
        raise TypeError(f"{name} must be {choices}{also}, got dtype {dt} ({dtype!r})")
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
    dtype : str or numpy dtype, a float type (default ``"float16"``, 2 bytes);
        also ``"bfloat16"``/``"bf16"`` (2 bytes) and the fp8 names (1 byte), see
        :func:`element_size`. ``None`` is refused (NumPy would read it as float64).

    Returns
    -------
    int, the size in bytes: ``batch * heads * n_queries * n_keys * itemsize``.
    For N = 8192, 32 heads, fp16 that is 4 GiB (4 * 2**30 bytes) for one layer.

    Raises TypeError for a non-int count (bools included) or a dtype that is not a
    float type (None, object, str, void, int, ...), ValueError for a count below 1.
    """
    nq = _check_count(n_queries, "n_queries")
    nk = _check_count(n_keys, "n_keys")
    h = _check_count(heads, "heads")
    b = _check_count(batch, "batch")
    return b * h * nq * nk * element_size(dtype)


def format_bytes(n) -> str:
    """A byte count in binary units, e.g. ``format_bytes(4 * 2**30) == '4.00 GiB'``.

    ``n`` is a non-negative int (bytes). Units are B, KiB, MiB, GiB, TiB (powers
    of 1024); values below 1024 B are printed exactly. The unit is chosen after
    rounding to 2 decimals, so ``2**20 - 1`` prints as ``'1.00 MiB'``, never
    ``'1024.00 KiB'``. Raises TypeError for a non-int and ValueError for a
    negative count.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"n must be an int number of bytes, got {type(n).__name__} {n!r}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if n < 1024:
        return f"{int(n)} B"
    units = ("KiB", "MiB", "GiB", "TiB")
    for power, unit in enumerate(units, start=1):
        text = f"{int(n) / 1024.0 ** power:.2f}"
        if float(text) < 1024.0 or unit == units[-1]:
            return f"{text} {unit}"
    raise AssertionError("unreachable")
