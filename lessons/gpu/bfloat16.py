"""bfloat16 as raw bits, for arrays that NumPy and CuPy cannot hold as bfloat16.

bfloat16 is the top 16 bits of a float32 (8 exponent bits, 7 mantissa bits). The
kernels read and write it as ``uint16``; these two functions convert on the host,
rounding to nearest with ties to even exactly as the kernels' ``from_float`` does.
"""
from __future__ import annotations

import numpy as np

__all__ = ["to_bfloat16_bits", "from_bfloat16_bits"]


def to_bfloat16_bits(x) -> np.ndarray:
    """Round a float array to bfloat16 (nearest, ties to even) and return its bits as uint16.

    NaN becomes the quiet NaN 0x7FC0; +-inf stays +-inf; values beyond the bfloat16
    range round to +-inf. Raises TypeError for a non-float input.
    """
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        raise TypeError(f"x must be a float array, got dtype {arr.dtype}")
    u = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, 0x7FC0, rounded).astype(np.uint16)


def from_bfloat16_bits(bits) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (a uint16 array); exact. Raises TypeError otherwise."""
    arr = np.asarray(bits)
    if arr.dtype != np.uint16:
        raise TypeError(f"bits must be a uint16 array of bfloat16 bit patterns, got dtype {arr.dtype}")
    return (arr.astype(np.uint32) << 16).view(np.float32)
