"""The backward pass on the GPU: three CuPy RawKernels (``kernels/flash_attention_backward.cu``).

:func:`flash_attention_backward_gpu` takes what the forward kept, the output ``o`` and the
row log-sum-exp ``lse`` (from :func:`lessons.gpu.flash_attention_gpu` or any forward), and the
upstream gradient ``do``, and returns ``(dq, dk, dv)`` without ever holding the N x N matrix:

1. ``flash_attention_backward_preprocess``: ``D = rowsum(dO * O)``, one float32 per query row;
2. ``flash_attention_backward_dkdv``: one thread block per key block, ``dK_j``, ``dV_j`` in
   registers while the query blocks stream past, ``P = exp(S - L)`` recomputed from ``lse``;
3. ``flash_attention_backward_dq``: one thread block per query block, the key blocks streaming
   past, ``S`` and ``dP`` recomputed once more.

dQ by a separate pass, not by float32 ``atomicAdd`` from the dK/dV kernel (FlashAttention-2's
choice): the separate pass recomputes ``S`` and ``dP`` (7 matmuls per pair of tiles instead of
5, 1.4x the FLOPs) but sums every ``dQ_i`` in one fixed order, so the gradients are bitwise the
same on every run, with no float32 dQ buffer and no atomics.

Runs on ``backend="cupy"`` (a CUDA device) or ``backend="emulator"`` (the same CUDA C on CPU
threads, :mod:`lessons.gpu.emulator`), like the forward launchers in :mod:`lessons.gpu.launch`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lessons.core.checks import check_int
from lessons.gpu.launch import Runner, _check_arrays, _check_backend, _check_flash, _storage_dtype
from lessons.gpu.source import flash_attention_backward_build, flash_attention_backward_config
from lessons.gpu.source import BACKWARD_MMA_HELD, flash_attention_backward_mma_build

__all__ = ["flash_attention_backward_gpu", "GpuBackwardTrace", "PREPROCESS_ROWS"]
__all__ += ["flash_attention_backward_mma_gpu"]

#: query rows per block of the preprocess kernel (one warp each)
PREPROCESS_ROWS = 4


@dataclass(frozen=True)
class GpuBackwardTrace:
    """What the trace build of the dK/dV kernel recorded for one key block.

    ``key_block``: the traced block j; ``block_q``, ``block_k``: the tile sizes (Br, Bc);
    ``keys``: (n,) int, the block's key indices (n <= block_k: the last block may be short);
    ``dk``, ``dv``: float32 ``(*lead, n_query_blocks, n, d)``, the running ``dK_j`` (scaled, as
    output) and ``dV_j`` after each query block i was absorbed, NaN for query blocks the kernel
    skipped (causal: the block lies above the diagonal for all their rows);
    ``visited``: (n_query_blocks,) bool, which query blocks were absorbed.
    After the last visited step ``dk``/``dv`` equal the kernel's output rows ``keys``.
    """

    key_block: int
    block_q: int
    block_k: int
    keys: np.ndarray
    dk: np.ndarray
    dv: np.ndarray

    @property
    def visited(self) -> np.ndarray:
        flat = self.dk.reshape(-1, *self.dk.shape[-3:])
        return ~np.isnan(flat[0]).all(axis=(-2, -1)) if self.keys.size else np.zeros(flat.shape[1], bool)

    def query_rows(self, step: int, n_q: int) -> range:
        """The query rows of query block ``step`` (``n_q`` rows in all)."""
        return range(step * self.block_q, min((step + 1) * self.block_q, n_q))

    def errors(self, numpy_trace, head: tuple = ()) -> np.ndarray:
        """Step by step against NumPy: max |running dK_j - NumPy's| and the same for dV_j.

        ``numpy_trace``: a :class:`lessons.schedules.backward.BackwardTrace` of
        :func:`lessons.flash_attention_backward` on the same head's inputs with the same
        ``block_q``, ``block_k`` and options; ``head``: the leading index of that head ((): none).
        Returns float64 (steps, 3): query block, dK error, dV error, one row per query block both
        absorbed, in order. Raises ValueError when the block sizes differ or the two did not visit
        the same query blocks of this key block (a causal skip that went wrong).
        """
        if (numpy_trace.block_q, numpy_trace.block_k) != (self.block_q, self.block_k):
            raise ValueError(f"numpy_trace has block_q, block_k = {numpy_trace.block_q}, {numpy_trace.block_k}; "
                             f"this trace {self.block_q}, {self.block_k}")
        head = tuple(head)
        dk, dv = self.dk[head], self.dv[head]
        if dk.ndim != 3:
            raise ValueError(f"head must index all {self.dk.ndim - 3} leading dims, got {head}")
        steps = {s.query_block: s for s in numpy_trace.steps if s.key_block == self.key_block}
        visited = np.flatnonzero(~np.isnan(dk).all(axis=(1, 2))) if self.keys.size else np.array([], int)
        if sorted(steps) != visited.tolist():
            raise ValueError(f"key block {self.key_block}: the kernel absorbed query blocks {visited.tolist()}, "
                             f"NumPy {sorted(steps)}")
        return np.array([[i, np.abs(dk[i] - steps[i].dk).max(initial=0.0), np.abs(dv[i] - steps[i].dv).max(initial=0.0)]
                         for i in visited], dtype=np.float64).reshape(-1, 3)


def _check_trace_block(trace_block, n_blocks: int) -> int:
    trace_block = check_int(trace_block, "trace_block")
    if not 0 <= trace_block < n_blocks:
        raise ValueError(f"trace_block must be in [0, {n_blocks}) (ceil(Nk / block_k) key blocks), got {trace_block}")
    return trace_block


def flash_attention_backward_gpu(q, k, v, o, lse, do, *, scale=None, causal: bool = False,
                                 block_q: int | None = None, block_k: int | None = None, bfloat16: bool = False,
                                 trace_block=None, backend: str = "cupy"):
    """FlashAttention-2 backward on the GPU (or its CPU emulation): ``(dq, dk, dv)`` from ``(o, lse, do)``.

    Parameters
    ----------
    q : (Nq, d), (heads, Nq, d) or (batch, heads, Nq, d); float32 or float16 (or bfloat16 bits as
        uint16 with ``bfloat16=True``), C-contiguous, NumPy or CuPy; 1 <= d <= 128.
    k, v : (..., Nk, d), same leading dims and dtype as q (the kernels need ``dv == d``).
    o : the forward's output, shape and dtype of q.
    lse : float32 (..., Nq), the forward's row log-sum-exp (``-inf`` for a row with no visible key).
    do : dL/dO, shape and dtype of q.
    scale : float, default ``1/sqrt(d)``; must be the forward's.
    causal : bool, bottom-right aligned as the forward: query i sees key j iff ``j <= i + Nk - Nq``.
    block_q, block_k : tile sizes Br, Bc shared by both passes (default per d:
        :func:`lessons.gpu.source.flash_attention_backward_config`).
    trace_block : optional key block index j; the trace build then records the running
        ``dK_j`` and ``dV_j`` after every query block (see :class:`GpuBackwardTrace`).
    backend : ``"cupy"`` (GPU) or ``"emulator"`` (CPU threads).

    Returns ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v`` (accumulated in float32,
    rounded once to the storage dtype), plus a :class:`GpuBackwardTrace` when ``trace_block`` is given.
    A row with no visible key gets ``dq = 0`` and adds nothing to ``dk``, ``dv``; a key no row sees
    gets ``dk = dv = 0``. dQ is computed by its own pass (no atomics): the result is bitwise
    repeatable.
    Raises TypeError/ValueError naming the argument for wrong dtypes, shapes, strides, tile sizes,
    ``d > 128`` or a bad ``trace_block``; RuntimeError with backend "cupy" and no CUDA device.
    Source: Dao 2023 (FlashAttention-2), Alg. 2; Dao et al. 2022 (FlashAttention), App. B.2.
    """
    backend = _check_backend(backend)
    f = _check_flash(q, k, v, scale, causal, bfloat16)
    arrays = {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do}
    _check_arrays(arrays)
    _storage_dtype({"q": q, "o": o, "do": do}, bfloat16)
    for name, x in (("o", o), ("do", do)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(x.shape)}")
        if np.dtype(x.dtype) != np.dtype(q.dtype):
            raise TypeError(f"{name} must have q's dtype {np.dtype(q.dtype)}, got {np.dtype(x.dtype)}")
    if np.dtype(lse.dtype) != np.float32:
        raise TypeError(f"lse must be float32 (as the forward kernels return it), got {np.dtype(lse.dtype)}")
    if tuple(lse.shape) != tuple(q.shape[:-1]):
        raise ValueError(f"lse must have shape q.shape[:-1] = {tuple(q.shape[:-1])}, got {tuple(lse.shape)}")
    block_q, block_k = flash_attention_backward_config(f.d, block_q, block_k)
    n_kblocks = -(-f.n_k // block_k)
    n_qblocks = -(-f.n_q // block_q)
    tracing = trace_block is not None
    if tracing:
        trace_block = _check_trace_block(trace_block, n_kblocks)
    build = flash_attention_backward_build(f.d, f.dtype, tracing, block_q, block_k)

    run = Runner(backend, f.kind)
    qd, kd, vd, od, lsed, dod = (run.put(x) for x in (q, k, v, o, lse, do))
    xp = run.xp
    delta = xp.empty((f.batch_heads, f.n_q), dtype=np.float32)
    dq = xp.empty(q.shape, dtype=q.dtype)
    dk = xp.empty(k.shape, dtype=k.dtype)
    dv = xp.empty(v.shape, dtype=v.dtype)
    if tracing:
        trace = xp.full((f.batch_heads, n_qblocks, 2, block_k, f.d), np.nan, dtype=np.float32)
    else:
        trace = xp.zeros(1, dtype=np.float32)       # unused by a build without FA_TRACE

    run.launch(build, "flash_attention_backward_preprocess", (-(-f.n_q // PREPROCESS_ROWS), f.batch_heads),
               [od, dod, delta, f.n_q])
    run.launch(build, "flash_attention_backward_dkdv", (n_kblocks, f.batch_heads),
               [qd, kd, vd, dod, lsed, delta, dk, dv, f.n_q, f.n_k, f.scale, int(f.causal),
                -1 if trace_block is None else trace_block, trace])
    run.launch(build, "flash_attention_backward_dq", (n_qblocks, f.batch_heads),
               [qd, kd, vd, dod, lsed, delta, dq, f.n_q, f.n_k, f.scale, int(f.causal)])
    result = (run.get(dq), run.get(dk), run.get(dv))
    if tracing:
        keys = np.arange(trace_block * block_k, min((trace_block + 1) * block_k, f.n_k))
        records = run.host(trace)[..., :keys.size, :].reshape(*f.lead, n_qblocks, 2, keys.size, f.d)
        result += (GpuBackwardTrace(trace_block, block_q, block_k, keys,
                                 np.ascontiguousarray(records[..., 0, :, :]),
                                 np.ascontiguousarray(records[..., 1, :, :])),)
    return result


def _check_backward_inputs(q, k, v, o, lse, do, scale, causal, bfloat16):
    """The checks of both backward launchers (metadata only, no device needed)."""
    f = _check_flash(q, k, v, scale, causal, bfloat16)
    _check_arrays({"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do})
    _storage_dtype({"q": q, "o": o, "do": do}, bfloat16)
    for name, x in (("o", o), ("do", do)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(x.shape)}")
        if np.dtype(x.dtype) != np.dtype(q.dtype):
            raise TypeError(f"{name} must have q's dtype {np.dtype(q.dtype)}, got {np.dtype(x.dtype)}")
    if np.dtype(lse.dtype) != np.float32:
        raise TypeError(f"lse must be float32 (as the forward kernels return it), got {np.dtype(lse.dtype)}")
    if tuple(lse.shape) != tuple(q.shape[:-1]):
        raise ValueError(f"lse must have shape q.shape[:-1] = {tuple(q.shape[:-1])}, got {tuple(lse.shape)}")
    return f


def flash_attention_backward_mma_gpu(q, k, v, o, lse, do, *, scale=None, causal: bool = False,
                                     bfloat16: bool = False, backend: str = "cupy"):
    """FlashAttention-2 backward on tensor cores (``mma.sync.m16n8k16``): ``(dq, dk, dv)``.

    The algorithm, arguments and results of :func:`flash_attention_backward_gpu`, with every
    matrix product (``S``, ``dP``, ``dV_j += P^T dO_i``, ``dK_j += dS^T Q_i``, ``dQ_i += dS K_j``)
    on tensor cores, ``kernels/flash_attention_backward_mma.cu``: ``D = rowsum(dO * O)`` by the
    CUDA-core preprocess kernel, then a dK/dV kernel (one block per 64 keys) and a dQ kernel
    (one block per 64 query rows, no atomics: bitwise repeatable). P and dS are rounded to the
    16-bit storage dtype before their products, as in FlashAttention-2; every sum is float32.

    Parameters
    ----------
    q : (Nq, d), (heads, Nq, d) or (batch, heads, Nq, d); float16 (or bfloat16 bits as uint16 with
        ``bfloat16=True``), C-contiguous, NumPy or CuPy; d = 64 or 128.
    k, v : (..., Nk, d), same leading dims and dtype as q.
    o : the forward's output, shape and dtype of q.
    lse : float32 (..., Nq), the forward's row log-sum-exp (``-inf`` for a row with no visible key).
    do : dL/dO, shape and dtype of q.
    scale : float, default ``1/sqrt(d)``; must be the forward's.
    causal : bool, bottom-right aligned: query i sees key j iff ``j <= i + Nk - Nq``.
    backend : ``"cupy"`` (a GPU of compute capability 8.0 or newer) or ``"emulator"`` (CPU threads).

    Returns ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v`` (accumulated in float32, rounded
    once to the storage dtype). A row with no visible key gets ``dq = 0`` and adds nothing to ``dk``,
    ``dv``; a key no row sees gets ``dk = dv = 0``.
    Raises TypeError for float32 inputs (use :func:`flash_attention_backward_gpu`) or mismatched
    dtypes, ValueError naming the argument for bad shapes, strides or a head dim other than 64 or
    128; RuntimeError with backend "cupy" and no CUDA device, or one older than compute capability 8.0.
    Source: Dao 2023 (FlashAttention-2), Alg. 2 and Sec. 3.3; PTX ISA, mma.m16n8k16.
    """
    from lessons.gpu.launch import _aligned, _require_tensor_cores

    backend = _check_backend(backend)
    dtype = getattr(q, "dtype", None)
    if dtype is not None and not bfloat16 and np.dtype(dtype) != np.float16:
        raise TypeError(f"the tensor-core backward takes float16 q, k, v, o, do (or bfloat16 bits with "
                        f"bfloat16=True), got {np.dtype(dtype)}; use flash_attention_backward_gpu for float32")
    f = _check_backward_inputs(q, k, v, o, lse, do, scale, causal, bfloat16)
    build = flash_attention_backward_mma_build(f.d, f.dtype)        # ValueError for d not 64 or 128
    preprocess = flash_attention_backward_build(f.d, f.dtype)        # D = rowsum(dO * O), reused

    run = Runner(backend, f.kind)
    _require_tensor_cores(run)
    qd, kd, vd, od, dod = (_aligned(run, run.put(x)) for x in (q, k, v, o, do))
    lsed = run.put(lse)
    xp = run.xp
    delta = xp.empty((f.batch_heads, f.n_q), dtype=np.float32)
    dq = xp.empty(q.shape, dtype=q.dtype)
    dk = xp.empty(k.shape, dtype=k.dtype)
    dv = xp.empty(v.shape, dtype=v.dtype)

    run.launch(preprocess, "flash_attention_backward_preprocess", (-(-f.n_q // PREPROCESS_ROWS), f.batch_heads),
               [od, dod, delta, f.n_q])
    run.launch(build, "flash_attention_backward_mma_dkdv", (-(-f.n_k // BACKWARD_MMA_HELD), f.batch_heads),
               [qd, kd, vd, dod, lsed, delta, dk, dv, f.n_q, f.n_k, f.scale, int(f.causal)])
    run.launch(build, "flash_attention_backward_mma_dq", (-(-f.n_q // BACKWARD_MMA_HELD), f.batch_heads),
               [qd, kd, vd, dod, lsed, delta, dq, f.n_q, f.n_k, f.scale, int(f.causal)])
    return run.get(dq), run.get(dk), run.get(dv)
