"""Input checks shared by every attention function: clear errors, no silent broadcasting."""
from __future__ import annotations

import math
import numbers

import numpy as np

from lessons.core.causal_rule import causal_visible  # re-exported: the rule lives in causal_rule

__all__ = ["as_float_array", "check_qkv", "check_scale", "check_int", "check_int_sequence", "check_positive_int",
           "check_positive_real", "check_block_k", "check_flag", "check_mask", "causal_visible"]


def as_float_array(x, name: str, ndims: tuple[int, ...] | None = None) -> np.ndarray:
    """Return ``x`` as a float ndarray with one of the allowed ranks (``ndims``; None: any), or raise.

    Raises TypeError for non-array-like or non-float input (for uint16, the bfloat16 bits the GPU
    launchers take, the message names :func:`lessons.gpu.from_bfloat16_bits`), ValueError for a wrong rank.
    """
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError(f"{name} must be a float array, got {type(x).__name__}")
    arr = np.asarray(x)
    if not np.issubdtype(arr.dtype, np.floating):
        bits = (f" (bfloat16 bits, as the GPU launchers take them? lessons.gpu.from_bfloat16_bits({name}) "
                f"gives float32)") if arr.dtype == np.uint16 else ""
        raise TypeError(
            f"{name} must have a float dtype (float16/32/64), got dtype {arr.dtype}; "
            f"convert with {name}.astype(np.float64){bits}"
        )
    if ndims is not None and arr.ndim not in ndims:
        if len(ndims) > 3 and tuple(ndims) == tuple(range(min(ndims), max(ndims) + 1)):
            want = f"at least {min(ndims)}-D"       # "1-D or 2-D or ... or 32-D" says nothing more
        else:
            want = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(f"{name} must be {want}, got shape {arr.shape}")
    return arr


def check_qkv(q, k, v):
    """Validate ``q (Nq, d) or (d,)``, ``k (Nk, d)``, ``v (Nk, dv)``.

    Returns ``(q2, k, v, single, dtype)``: q as 2-D, whether q was one vector, and
    the compute dtype (float32 for float16 inputs: accumulation is never fp16).
    """
    q = as_float_array(q, "q", (1, 2))
    k = as_float_array(k, "k", (2,))
    v = as_float_array(v, "v", (2,))
    single = q.ndim == 1
    q2 = q[None, :] if single else q
    if q2.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must share the head dim d: q has shape {q.shape}, k has shape {k.shape}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same number of keys Nk: k has shape {k.shape}, v has shape {v.shape}")
    if q2.shape[1] == 0:
        raise ValueError(f"head dim d must be at least 1, got q shape {q.shape}")
    dtype = np.result_type(q.dtype, k.dtype, v.dtype, np.float32)
    return q2.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False), single, dtype


def check_scale(scale, d: int) -> float:
    """``scale`` or the default ``1/sqrt(d)``; must be a finite real number."""
    if scale is None:
        return 1.0 / np.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    try:
        value = float(scale)                        # (a Fraction, a Decimal, a NumPy scalar: one float)
    except OverflowError:
        raise ValueError(f"scale must be finite, got a number too large for a float: {scale!r:.40}") from None
    if not np.isfinite(value):
        raise ValueError(f"scale must be finite, got {scale}")
    return value


def check_int(value, name: str, *, min: int | None = None, max: int | None = None) -> int:
    """``value`` as a Python int, or a TypeError / ValueError that names ``name``.

    Python and NumPy integers pass; bools, floats (even ``2.0``) and everything else
    are a TypeError. ``min`` / ``max`` (inclusive, optional) bound the value.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if min is not None and value < min:
        raise ValueError(f"{name} must be at least {min}, got {value}")
    if max is not None and value > max:
        raise ValueError(f"{name} must be at most {max}, got {value}")
    return int(value)


def check_int_sequence(values, name: str, *, min: int | None = None, count: int | None = None) -> tuple:
    """A non-empty sequence of ints (``count`` of them when given), each checked by :func:`check_int`
    with ``min``; returned as a tuple. A str, bytes, a dict or set (no order), a bare number, an array
    that is not 1-D or anything not iterable is a TypeError, no value or the wrong number of them a
    ValueError, both naming ``name``."""
    if (isinstance(values, (str, bytes, bytearray, dict, set, frozenset)) or not hasattr(values, "__iter__")
            or (isinstance(values, np.ndarray) and values.ndim != 1)):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__} {values!r}")
    values = tuple(values)
    if not values or (count is not None and len(values) != count):
        wanted = f"{count} int{'s' * (count != 1)}" if count is not None else "at least one int"
        raise ValueError(f"{name} must hold {wanted}, got {values!r}")
    return tuple(check_int(x, name, min=min) for x in values)


def check_positive_int(value, name: str) -> int:
    """An int >= 1 (bools refused): ``check_int(value, name, min=1)``."""
    return check_int(value, name, min=1)


def check_positive_real(value, name: str, what: str = "number") -> float:
    """``value`` as a float when it is a real number above 0 and finite (NumPy numbers too); ValueError
    ``"{name} must be a positive finite {what}, got ..."`` otherwise, bools, NaN and inf included."""
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real)
            or not (math.isfinite(value) and value > 0)):
        raise ValueError(f"{name} must be a positive finite {what}, got {value!r}")
    return float(value)


def check_block_k(block_k, tile, default: int = 64) -> int:
    """The keys per tile (block_k, Bc in the papers) from ``block_k`` or its alias ``tile``.

    ``tile`` is the name the first notebooks and the exercises use. Give one of them
    (or neither, for ``default``); both with different values is a ValueError.
    Returns an int >= 1; TypeError / ValueError naming the argument otherwise.
    """
    if tile is not None:
        tile = check_int(tile, "tile", min=1)
        if block_k is not None and check_int(block_k, "block_k", min=1) != tile:
            raise ValueError(f"give block_k or its alias tile, not both: block_k = {block_k}, tile = {tile}")
        return tile
    return check_int(default if block_k is None else block_k, "block_k", min=1)


def check_flag(value, name: str, *, none: bool = False) -> bool | None:
    """A real bool (Python or NumPy), or None where ``none`` allows it ("decide for me"); anything else
    (``0``, ``"no"``) is a TypeError naming the argument."""
    if none and value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        allowed = "None, True or False" if none else "True or False"
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")
    return bool(value)


def check_mask(mask, nq: int, nk: int, single: bool):
    """A boolean mask broadcastable to (Nq, Nk) (True = may attend), or None.

    For one query vector q (d,), a mask of shape (Nk,) is also accepted.
    Returns a read-only broadcast view of shape (Nq, Nk).
    """
    if mask is None:
        return None
    arr = np.asarray(mask)
    if arr.dtype != np.bool_:
        raise TypeError(f"mask must be a boolean array (True = may attend), got dtype {arr.dtype}")
    if arr.ndim > 2:
        raise ValueError(f"mask must be broadcastable to (Nq, Nk) = ({nq}, {nk}), got shape {arr.shape}")
    try:
        return np.broadcast_to(arr, (nq, nk))
    except ValueError:
        raise ValueError(
            f"mask of shape {arr.shape} is not broadcastable to (Nq, Nk) = ({nq}, {nk})"
        ) from None
