"""How every attention function hands its answer back: the output dtype, the single-query
form, and the ``(out[, lse][, trace...])`` tuple chosen by its ``return_*`` flags.

Plumbing only: nothing here computes attention.
"""
from __future__ import annotations

import numpy as np

__all__ = ["output_dtype", "shape_result", "pack_result"]


def output_dtype(*arrays):
    """The dtype an attention function returns: NumPy's result type of its float inputs.

    Computed in float32 at least (float16 is never accumulated in float16), returned
    in this dtype. Call it on the inputs as given, before they are cast; None when one
    of them is not a float array (the input check then says what is wrong).
    """
    dtypes = [np.asarray(x).dtype for x in arrays]
    if not all(np.issubdtype(d, np.floating) for d in dtypes):
        return None
    return np.result_type(*dtypes)


def shape_result(out, lse, single: bool, out_dtype):
    """``out`` (Nq, dv) cast to ``out_dtype`` and ``lse`` (Nq,) to at least float32;
    for a single query vector (``single``) the row axis is dropped: (dv,) and a scalar."""
    out = out.astype(out_dtype, copy=False)
    lse = lse.astype(np.result_type(out_dtype, np.float32), copy=False)
    return (out[0], lse[0]) if single else (out, lse)


def pack_result(out, *extras):
    """``out`` alone, or the tuple ``(out, *wanted values)``.

    ``extras`` are ``(wanted, value)`` pairs in the documented order, e.g.
    ``pack_result(out, (return_lse, lse), (return_trace, trace))``.
    """
    wanted = tuple(value for want, value in extras if want)
    return (out, *wanted) if wanted else out
