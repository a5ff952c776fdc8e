"""Peak memory of textbook vs flash attention (notebook 05): quadratic vs linear.

Textbook attention builds the (N, N) score matrix, so its peak memory grows like
N**2. The tiled version holds one ``block_q x tile`` slice of it at a time plus the
(N, dv) output, so its peak grows like N. Measure both, then fit the exponent: on a
log-log plot a power law ``c * N**k`` is a straight line of slope ``k``.

NumPy reports its array allocations to :mod:`tracemalloc`, so the peak it records
during a call is the peak of NumPy memory that call needed.

Source: Dao et al. 2022, FlashAttention, Sec. 3.1 and Theorem 1 (O(N) extra memory);
Python docs, tracemalloc.

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("peak_memory")``. A reference answer is in ``solutions/peak_memory.py``.
"""
import tracemalloc
import numpy as np
from lessons import attention, flash_attention


def peak_bytes(fn, *args, **kwargs):
    """Peak memory allocated while ``fn(*args, **kwargs)`` runs, in bytes (an int).

    Measure with :mod:`tracemalloc` and count only what the call adds, at its highest:
    a call that allocates 8 MB, frees it and returns a small result has a peak of about
    8 MB, and memory allocated before the call is not counted. Leave tracemalloc as you
    found it (running or not). The value ``fn`` returns is discarded.
    """
    raise NotImplementedError


def loglog_slope(ns, values):
    """The exponent k of a power law ``values ~ c * ns**k``: the least-squares slope
    of ``log(values)`` against ``log(ns)``.

    ``ns``, ``values``: sequences of positive numbers, the same length, at least 2.
    Returns a float. (Exactly ``c * n**k`` data gives exactly ``k``.)

    Use every point, not just the first and the last.
    """
    raise NotImplementedError


def measure(sizes=(512, 2048, 8192), *, d=64, tile=64, seed=0):
    """Peak memory of :func:`lessons.attention` and :func:`lessons.flash_attention`.

    For each N in ``sizes``, random float32 ``q, k, v`` of shape (N, d) (made before
    measuring: the inputs are not counted), then :func:`peak_bytes` of
    ``attention(q, k, v)`` and of ``flash_attention(q, k, v, tile)``.

    Returns a dict::

        {"sizes": [N, ...], "textbook": [bytes, ...], "flash": [bytes, ...],
         "textbook_slope": float, "flash_slope": float}

    the slopes from :func:`loglog_slope`. Expect about 2 for the textbook (the N x N
    scores, 4 bytes each, at least) and about 1 for flash: its peak is the (N, d)
    output plus a constant working set of one ``block_q x tile`` tile, and that
    constant pulls the fitted slope a little below 1 at small N.
    (N = 8192 takes about a gigabyte and some seconds for the textbook version.)
    """
    raise NotImplementedError
