"""Naive attention in CuPy, CUDA-event timing and peak device memory: what the GPU kernels are compared with.

Shared by the notebooks' "On the GPU" sections (:mod:`lessons.gpu.lesson`, :mod:`lessons.gpu.recorded`)
and the GPU benchmarks (``benchmarks/gpu_attention.py``, ``benchmarks/gpu_backward.py``). Every
function takes the array module (``cupy``, or ``numpy`` for the naive ones in tests) or ``torch``
as its first argument, so importing this module imports neither CuPy nor torch.
"""
from __future__ import annotations

import math
import statistics
from contextlib import contextmanager

from lessons.core.checks import check_flag, check_int

__all__ = ["naive_probabilities", "naive_attention", "median_cuda_seconds", "attention_flops", "naive_backward",
           "backward_flops",
           "make_peak_hook", "peak_cupy", "torch_seconds_and_peak", "sdpa_backward", "progress_steps"]


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


def attention_flops(n: int, d: int, heads: int = 1, causal: bool = False) -> float:
    """FLOPs of one attention forward: ``4 N^2 d`` per head (2 for Q K^T, 2 for P V), half when causal.
    TypeError for a non-int ``n``/``d``/``heads`` (bools included) or a non-bool ``causal``; ValueError
    below 1."""
    n, d, heads = check_int(n, "n", min=1), check_int(d, "d", min=1), check_int(heads, "heads", min=1)
    causal = check_flag(causal, "causal")
    return 4.0 * n * n * d * heads * (0.5 if causal else 1.0)


def backward_flops(n: int, d: int, heads: int, causal: bool) -> float:
    """Floating-point operations of one attention backward: 5 matmuls of 2 N^2 d each per head
    (S, dV, dP, dQ, dK; FlashAttention-2's count, Dao 2023, Sec. 4.1), halved when causal."""
    return 10.0 * n * n * d * heads * (0.5 if causal else 1.0)


def naive_backward(xp, q, k, v, do, causal=False):
    """The textbook backward in float32 with P, dP and dS materialised: (dq, dk, dv) in q's dtype.

    ``xp``: the array module (``cupy``; ``numpy`` in tests). ``q``, ``do`` (heads, Nq, d); ``k``, ``v``
    (heads, Nk, d); ``scale = 1/sqrt(d)``; causal bottom-right aligned. P, dP and dS are each
    (heads, Nq, Nk) float32 in device memory.
    Source: Dao et al. 2022, App. B.2 (the standard backward)."""
    p, scale = naive_probabilities(xp, q, k, causal)
    q32, k32, v32, do32 = (x.astype(xp.float32) for x in (q, k, v, do))
    dv = xp.matmul(p.transpose(0, 2, 1), do32)
    dp = xp.matmul(do32, v32.transpose(0, 2, 1))
    dp -= (p * dp).sum(axis=-1, keepdims=True)
    ds = xp.multiply(p, dp, out=dp)
    dq = xp.matmul(ds, k32) * scale
    dk = xp.matmul(ds.transpose(0, 2, 1), q32) * scale
    return dq.astype(q.dtype), dk.astype(q.dtype), dv.astype(q.dtype)


def make_peak_hook(cupy):
    """A CuPy memory hook that tracks the bytes held in the pool and their peak."""

    class PeakHook(cupy.cuda.MemoryHook):
        name = "PeakHook"

        def __init__(self):
            self.current = self.peak = 0

        def malloc_postprocess(self, **kwargs):      # CuPy passes device_id, size, mem_size, ...
            self.current += kwargs["mem_size"]
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, **kwargs):
            self.current -= kwargs["mem_size"]

    return PeakHook()


def peak_cupy(cupy, fn) -> int:
    """Peak bytes CuPy's pool held beyond what it held before ``fn()``."""
    hook = make_peak_hook(cupy)
    cupy.cuda.Device().synchronize()
    with hook:
        result = fn()
        cupy.cuda.Device().synchronize()
    del result
    return hook.peak


def torch_seconds_and_peak(torch, fn, warmup: int, repeats: int):
    """(median seconds of ``fn()`` over ``repeats`` runs after ``warmup``, timed with CUDA events;
    peak bytes torch allocated during one more call beyond what it held before)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return statistics.median(times), peak


def sdpa_backward(torch, q, k, v, do, causal=False):
    """A function that runs the backward of ``torch.nn.functional.scaled_dot_product_attention`` once.

    ``q``, ``k``, ``v``, ``do``: CuPy (or anything ``torch.as_tensor`` takes) of shape (heads, N, d);
    the forward runs once here, with its graph retained; each call of the result returns
    ``torch.autograd.grad(out, (q, k, v), do)`` as CUDA tensors of shape (1, heads, N, d)."""
    import torch.nn.functional as F

    tq, tk, tv = (torch.as_tensor(x, device="cuda").unsqueeze(0).requires_grad_() for x in (q, k, v))
    tdo = torch.as_tensor(do, device="cuda").unsqueeze(0)
    out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    return lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True)


@contextmanager
def progress_steps(total: int, what: str):
    """A progress bar (rich) over ``total`` runs, for the sweep scripts: yields ``step(label)``, to be called
    before each run; it counts the run before as done and shows ``label``. On leaving, every run that started
    counts as done and the bar shows ``what`` again. ``total`` an int >= 0 (TypeError/ValueError otherwise)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = check_int(total, "total", min=0)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task(what, total=total)
        started = []

        def step(label):
            if started:
                bar.advance(task)
            started.append(label)
            bar.update(task, description=label)

        try:
            yield step
        finally:
            bar.update(task, completed=len(started), description=what)
