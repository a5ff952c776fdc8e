"""Naive attention in CuPy and CUDA-event timing: what the GPU kernels are compared with.

Shared by the notebooks' "On the GPU" sections (:mod:`lessons.gpu.lesson`) and
``benchmarks/gpu_attention.py``. Both functions take the array module (``cupy``, or
``numpy`` for :func:`naive_attention` in tests) as their first argument, so importing
this module never imports CuPy.
"""
from __future__ import annotations

import math
import statistics

__all__ = ["naive_probabilities", "naive_attention", "median_cuda_seconds"]


def naive_probabilities(xp, q, k, causal=False):
    """The whole probability matrix ``P = softmax(scale Q K^T)`` in float32, as textbook attention builds it.

    ``q`` (heads, Nq, d), ``k`` (heads, Nk, d) arrays of module ``xp``; ``scale = 1/sqrt(d)``;
    ``causal`` bottom-right aligned (query i sees key j iff ``j <= i + Nk - Nq``). Returns
    ``(p, scale)``: ``p`` float32 of shape (heads, Nq, Nk), the matrix FlashAttention never
    stores (Vaswani et al. 2017, Eq. 1).
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = xp.matmul(q.astype(xp.float32), k.astype(xp.float32).transpose(0, 2, 1)) * scale
    if causal:
        n_q, n_k = s.shape[-2:]
        keep = xp.arange(n_k)[None, :] <= xp.arange(n_q)[:, None] + (n_k - n_q)
        s = xp.where(keep, s, -xp.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = xp.exp(s, out=s)
    p /= p.sum(axis=-1, keepdims=True)
    return p, scale


def naive_attention(xp, q, k, v, causal=False):
    """softmax(scale Q K^T) V with the whole (heads, Nq, Nk) score matrix in float32.

    ``q`` (heads, Nq, d), ``k`` (heads, Nk, d), ``v`` (heads, Nk, dv) arrays of module
    ``xp``; ``scale = 1/sqrt(d)``; ``causal`` bottom-right aligned (query i sees key j
    iff ``j <= i + Nk - Nq``). Returns (heads, Nq, dv) in q's dtype. This is the
    textbook algorithm (Vaswani et al. 2017, Eq. 1) that materialises S in HBM.
    """
    p, _ = naive_probabilities(xp, q, k, causal)
    return xp.matmul(p, v.astype(xp.float32)).astype(q.dtype)


def median_cuda_seconds(cupy, fn, warmup: int = 3, repeats: int = 20) -> float:
    """Median seconds of ``fn()`` on the current stream, timed with CUDA events.

    Runs ``fn`` ``warmup`` times untimed, then ``repeats`` times between a pair of
    events each; returns the median in seconds (float).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return statistics.median(times)
