"""Measure what one attention call costs on this machine: peak memory and wall time.

Memory is measured with :mod:`tracemalloc` (NumPy reports every array buffer to
it), time with :func:`time.perf_counter` in separate runs, because tracing
every allocation slows the traced code down. ``benchmarks/memory_time.py`` uses
these helpers to compare :func:`lessons.attention` (which builds the (N, N)
score matrix) with :func:`lessons.flash_attention` (which never does).
"""
from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from dataclasses import dataclass, field

import numpy as np

from lessons.core.checks import check_positive_int
from lessons.schedules.flash import flash_attention
from lessons.core.reference import attention

__all__ = ["peak_bytes", "time_call", "CaseResult", "measure_case"]


def peak_bytes(fn, *args, **kwargs) -> int:
    """Peak memory allocated while ``fn(*args, **kwargs)`` runs, in bytes.

    Counts what was allocated during the call above what was already allocated
    when it started (so inputs made beforehand are not counted; the returned
    value's own buffers are). The result of ``fn`` is dropped. If tracemalloc is
    already tracing, it keeps tracing afterwards (its peak is reset); otherwise it
    is started and stopped here.

    Returns an int >= 0 (bytes). Raises TypeError if ``fn`` is not callable;
    whatever ``fn`` raises propagates.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    gc.collect()
    started_here = not tracemalloc.is_tracing()
    if started_here:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn(*args, **kwargs)
        return max(0, tracemalloc.get_traced_memory()[1] - before)
    finally:
        if started_here:
            tracemalloc.stop()


def time_call(fn, *args, repeats: int = 3, **kwargs) -> list[float]:
    """Wall time of ``repeats`` calls of ``fn(*args, **kwargs)``, in seconds (list of floats).

    Each call is timed alone with :func:`time.perf_counter`, after a garbage
    collection; report the minimum (least disturbed by other processes) or the
    median. Raises TypeError / ValueError for a non-callable ``fn`` or ``repeats`` < 1.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    repeats = check_positive_int(repeats, "repeats")
    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return times


@dataclass(frozen=True)
class CaseResult:
    """Cost of textbook vs flash attention for one problem size and dtype.

    Attributes
    ----------
    n, d : Nq = Nk = n queries and keys, head dim d (dv = d).
    dtype : "float64" or "float32" (any NumPy float dtype name).
    tile, block_q : flash_attention's key tile (block_k) and query block sizes.
    peak_textbook, peak_flash : int, peak bytes allocated during one call.
    times_textbook, times_flash : lists of float, seconds per call (one per repeat).
    max_abs_diff : float, max |flash - textbook| over the outputs (both should be exact).
    """

    n: int
    d: int
    dtype: str
    tile: int
    block_q: int
    peak_textbook: int
    peak_flash: int
    times_textbook: list = field(default_factory=list)
    times_flash: list = field(default_factory=list)
    max_abs_diff: float = float("nan")

    @property
    def score_bytes(self) -> int:
        """Bytes of one (N, N) score matrix in this dtype: what textbook must hold at least."""
        return self.n * self.n * np.dtype(self.dtype).itemsize

    @property
    def memory_ratio(self) -> float:
        """peak_textbook / peak_flash: how many times less memory flash needs."""
        return self.peak_textbook / self.peak_flash

    @property
    def time_textbook(self) -> float:
        """Best (minimum) textbook time, seconds."""
        return min(self.times_textbook)

    @property
    def time_flash(self) -> float:
        """Best (minimum) flash time, seconds."""
        return min(self.times_flash)

    @property
    def time_ratio(self) -> float:
        """time_flash / time_textbook from the best times: > 1 means flash is slower."""
        return self.time_flash / self.time_textbook

    @property
    def median_textbook(self) -> float:
        return statistics.median(self.times_textbook)

    @property
    def median_flash(self) -> float:
        return statistics.median(self.times_flash)


def measure_case(n: int, d: int = 64, *, dtype="float64", tile: int = 256, block_q: int = 256,
                 repeats: int = 3, seed: int = 0, on_step=None) -> CaseResult:
    """Measure peak memory and time of textbook and flash attention on Gaussian q, k, v.

    Draws ``q, k, v`` of shape (n, d) in ``dtype`` (before measuring, so the inputs
    are not counted), then

    1. runs each algorithm once under tracemalloc (:func:`peak_bytes`): this is
       also the warm-up;
    2. times ``repeats`` calls of each without tracemalloc, alternating textbook and
       flash so that both see the same background load.

    Parameters
    ----------
    n, d : ints >= 1 (Nq = Nk = n; dv = d).
    dtype : a NumPy float dtype or its name.
    tile, block_q : passed to :func:`lessons.flash_attention`.
    repeats : int >= 1, timed calls per algorithm.
    seed : int for ``numpy.random.default_rng``.
    on_step : optional callable taking one str, called after each measured call
        (1 + repeats per algorithm, so ``2 * (1 + repeats)`` times); for progress bars.

    Returns a :class:`CaseResult`. Raises TypeError / ValueError for bad sizes or a
    non-float dtype. At n = 8192 in float64 textbook holds about three (N, N)
    arrays (1.5 GiB).
    """
    n = check_positive_int(n, "n")
    d = check_positive_int(d, "d")
    tile = check_positive_int(tile, "tile")
    block_q = check_positive_int(block_q, "block_q")
    repeats = check_positive_int(repeats, "repeats")
    dt = np.dtype(dtype)
    if not np.issubdtype(dt, np.floating):
        raise TypeError(f"dtype must be a float dtype, got {dt}")
    step = on_step if on_step is not None else (lambda _label: None)

    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n, d)).astype(dt) for _ in range(3))

    def textbook():
        return attention(q, k, v)

    def flash():
        return flash_attention(q, k, v, tile, block_q=block_q)

    peak_t = peak_bytes(textbook)
    step("textbook memory")
    peak_f = peak_bytes(flash)
    step("flash memory")
    diff = float(np.abs(flash().astype(np.float64) - textbook().astype(np.float64)).max())

    times_t, times_f = [], []
    for _ in range(repeats):
        times_t += time_call(textbook, repeats=1)
        step("textbook time")
        times_f += time_call(flash, repeats=1)
        step("flash time")
    return CaseResult(n=n, d=d, dtype=dt.name, tile=tile, block_q=block_q,
                      peak_textbook=peak_t, peak_flash=peak_f,
                      times_textbook=times_t, times_flash=times_f, max_abs_diff=diff)
