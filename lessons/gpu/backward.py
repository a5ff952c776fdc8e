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

The trace build's records, step by step: :func:`kernel_backward_trace` turns them into the
:class:`lessons.schedules.backward.BackwardTrace` the NumPy backward returns (so the stepper of
:mod:`lessons.views.backward` replays either), :func:`first_backward_divergence` names the first
place it parts from NumPy's, and :func:`backward_on_gpu` is notebook 04's "On the GPU" section.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from lessons.core.causal_rule import tile_kind
from lessons.core.checks import as_float_array, check_int
from lessons.gpu.launch import Runner, _check_arrays, _check_backend, _check_flash, _storage_dtype
from lessons.gpu.source import flash_attention_backward_build, flash_attention_backward_config
from lessons.gpu.source import BACKWARD_MMA_HELD, flash_attention_backward_mma_build

__all__ = ["flash_attention_backward_gpu", "GpuBackwardTrace", "PREPROCESS_ROWS", "kernel_backward_trace",
           "BackwardDivergence", "first_backward_divergence", "backward_trace_differences", "backward_on_gpu",
           "EMULATED", "backward_demo_inputs"]
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
    From the same trace build, the other two kernels: ``dq`` float32 ``(*lead, n_key_blocks, Nq, d)``,
    the dQ pass's running ``dQ_i`` (scaled, as output) of every row after each key block it absorbed,
    NaN for key blocks its query block skipped; ``D`` float32 ``(*lead, Nq)``, the preprocess
    kernel's ``rowsum(dO * O)``. (None when built by hand without them.)
    """

    key_block: int
    block_q: int
    block_k: int
    keys: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dq: np.ndarray | None = None
    D: np.ndarray | None = None

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
        ``dK_j`` and ``dV_j`` after every query block, and every row's running ``dQ_i`` after
        every key block (see :class:`GpuBackwardTrace`).
    backend : ``"cupy"`` (GPU) or ``"emulator"`` (the CPU).

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
        dq_trace = xp.full((f.batch_heads, n_kblocks, f.n_q, f.d), np.nan, dtype=np.float32)
    else:
        trace = dq_trace = xp.zeros(1, dtype=np.float32)       # unused by a build without FA_TRACE

    run.launch(build, "flash_attention_backward_preprocess", (-(-f.n_q // PREPROCESS_ROWS), f.batch_heads),
               [od, dod, delta, f.n_q])
    run.launch(build, "flash_attention_backward_dkdv", (n_kblocks, f.batch_heads),
               [qd, kd, vd, dod, lsed, delta, dk, dv, f.n_q, f.n_k, f.scale, int(f.causal),
                -1 if trace_block is None else trace_block, trace])
    run.launch(build, "flash_attention_backward_dq", (n_qblocks, f.batch_heads),
               [qd, kd, vd, dod, lsed, delta, dq, f.n_q, f.n_k, f.scale, int(f.causal), dq_trace])
    result = (run.get(dq), run.get(dk), run.get(dv))
    if tracing:
        keys = np.arange(trace_block * block_k, min((trace_block + 1) * block_k, f.n_k))
        records = run.host(trace)[..., :keys.size, :].reshape(*f.lead, n_qblocks, 2, keys.size, f.d)
        result += (GpuBackwardTrace(trace_block, block_q, block_k, keys,
                                    np.ascontiguousarray(records[..., 0, :, :]),
                                    np.ascontiguousarray(records[..., 1, :, :]),
                                    run.host(dq_trace).reshape(*f.lead, n_kblocks, f.n_q, f.d),
                                    run.host(delta).reshape(*f.lead, f.n_q)),)
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
    backend : ``"cupy"`` (a GPU of compute capability 8.0 or newer) or ``"emulator"`` (the CPU).

    Returns ``(dq, dk, dv)`` shaped and typed like ``q``, ``k``, ``v`` (accumulated in float32, rounded
    once to the storage dtype). A row with no visible key gets ``dq = 0`` and adds nothing to ``dk``,
    ``dv``; a key no row sees gets ``dk = dv = 0``.
    Raises TypeError for float32 inputs (use :func:`flash_attention_backward_gpu`) or mismatched
    dtypes, ValueError naming the argument for bad shapes, strides or a head dim other than 64 or
    128; RuntimeError with backend "cupy" and no CUDA device, or one older than compute capability 8.0.
    Source: Dao 2023 (FlashAttention-2), Alg. 2 and Sec. 3.3; PTX ISA, mma.m16n8k16.
    """
    from lessons.gpu.launch import _aligned, _check_tensor_core_dtype, _require_tensor_cores

    backend = _check_backend(backend)
    _check_tensor_core_dtype(q, bfloat16, "use flash_attention_backward_gpu for float32", "the tensor-core backward",
                             "q, k, v, o, do")
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


# ---------------------------------------------------------------------------
# the kernel's trace as a step-by-step BackwardTrace, and its comparison with NumPy's
# ---------------------------------------------------------------------------

#: the label of a trace the CPU emulator computed (never called a GPU's)
EMULATED = "emulated on the CPU"


def _one_head(q, k, v, o, lse, do):
    """One head's float arrays as float32: TypeError for a non-float one, ValueError for a wrong rank."""
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        if np.ndim(x) != 2:
            raise ValueError(f"{name} must be 2-D (N, d): one head, as the stepper holds it; got shape {np.shape(x)}")
    if np.ndim(lse) != 1:
        raise ValueError(f"lse must be 1-D (Nq,): one head; got shape {np.shape(lse)}")
    named = zip((q, k, v, o, lse, do), ("q", "k", "v", "o", "lse", "do"))
    return tuple(np.ascontiguousarray(as_float_array(x, name), dtype=np.float32) for x, name in named)


def _traced_run(runner, q, k, v, o, lse, do, *, scale, causal, block_q, block_k):
    """The trace build once per key block on ``runner``: ((dq, dk, dv) of the last launch, BackwardTrace)."""
    from lessons.schedules.backward import BackwardStep, BackwardTrace
    n_q, n_k, d = q.shape[0], k.shape[0], q.shape[1]
    block_q, block_k = flash_attention_backward_config(d, block_q, block_k)
    launch = runner.kernel(flash_attention_backward_gpu)
    dev = [runner.put(x) for x in (q, k, v, o, lse, do)]
    n_kblocks = -(-n_k // block_k)
    records, outputs = [], None
    for j in range(n_kblocks):                      # the dK/dV trace holds one key block per launch
        *outputs, t = launch(*dev, scale=scale, causal=causal, block_q=block_q, block_k=block_k, trace_block=j)
        records.append(t)
    outputs = tuple(runner.host(x) for x in outputs) if outputs else tuple(
        np.zeros(x.shape, np.float32) for x in (q, k, v))
    first = records[0] if records else None
    D = first.D.astype(np.float64) if first is not None else np.zeros(n_q)
    trace = BackwardTrace(nq=n_q, nk=n_k, d=d, dv=v.shape[1], block_q=block_q, block_k=block_k, D=D)
    for j, t in enumerate(records):
        c0, c1 = j * block_k, min((j + 1) * block_k, n_k)
        for i, r0 in enumerate(range(0, n_q, block_q)):
            r1 = min(r0 + block_q, n_q)
            dk, dv = t.dk[i].astype(np.float64), t.dv[i].astype(np.float64)
            dq = first.dq[j, r0:r1].astype(np.float64)
            if np.isnan(dk).all() and np.isnan(dq).all():
                continue                             # neither pass absorbed this tile: skipped
            trace.steps.append(BackwardStep(key_block=j, query_block=i, row_start=r0, row_stop=r1, key_start=c0,
                                            key_stop=c1, kind=tile_kind(r0, r1, c0, c1, n_q, n_k, causal),
                                            p=None, ds=None, dk=dk, dv=dv, dq=dq))
    return outputs, trace


def kernel_backward_trace(q, k, v, o, lse, do, *, scale=None, causal: bool = False, block_q: int | None = None,
                          block_k: int | None = None, use_device=None):
    """The backward kernels' own trace, step by step, as a :class:`lessons.schedules.backward.BackwardTrace`.

    Parameters
    ----------
    q (Nq, d), k (Nk, d), v (Nk, d), o (Nq, d), do (Nq, d), lse (Nq,) : one head; cast to float32
        (what the kernels compute in); ``o`` and ``lse`` are the forward's.
    scale, causal, block_q, block_k : as :func:`flash_attention_backward_gpu` (block sizes: powers of
        two with ``128 <= block_q * block_k <= 2048``, default per d).
    use_device : None = a CUDA device when there is one, else the CPU emulator; False = always the emulator.

    Runs the trace build (``-DFA_TRACE``) once per key block j: the dK/dV kernel records its running
    ``dK_j``, ``dV_j`` after each query block, the dQ kernel every row's running ``dQ_i`` after each key
    block, the preprocess kernel ``D``. Returns ``(where, trace)``: ``where`` is ``"GPU (<name>)"`` or
    :data:`EMULATED` (``"emulated on the CPU"``); ``trace`` has one step per (key block, query block)
    that either pass absorbed, in NumPy's order (key blocks outside), holding the kernel's float32 values
    as float64: the same object :func:`lessons.flash_attention_backward` returns, so the same views
    replay it. The dQ pass runs its own loop (query blocks outside), but ``dQ_i`` after key block j is
    the same partial sum in either order. ``p`` and ``ds`` of each step are None: the kernels keep them in
    shared memory only. A tile only one pass absorbed has NaN for the other pass's values.
    Raises TypeError for non-float inputs; ValueError for inputs that are not one head or tile sizes the
    kernels cannot take; RuntimeError when neither a CUDA device nor a C++ compiler for the emulator is there.
    Source: Dao 2023 (FlashAttention-2), Alg. 2.
    """
    from lessons.gpu.emulator import emulator_available
    from lessons.gpu.launch import Runner, open_device
    q, k, v, o, lse, do = _one_head(q, k, v, o, lse, do)
    device, _ = open_device(use_device)
    if device is None and not emulator_available():
        raise RuntimeError("no CUDA device and no C++ compiler (g++) for the emulator")
    runner = device or Runner("emulator")
    _, trace = _traced_run(runner, q, k, v, o, lse, do, scale=scale, causal=causal, block_q=block_q,
                           block_k=block_k)
    return (f"GPU ({device.name})" if device is not None else EMULATED), trace


@dataclass(frozen=True)
class BackwardDivergence:
    """Where a kernel's backward trace first parts from NumPy's.

    ``step``: index into the NumPy trace's steps (0 = first; None for ``D``, checked before the loop);
    ``key_block``, ``query_block``: that step's blocks (None when one trace has ended, or for ``D``);
    ``quantity``: ``"D"``, ``"tile"`` (the two visited different tiles), ``"dk"``, ``"dv"``, ``"dq"`` or
    ``"length"``; ``row``, ``col``: the element (a query row for dq and D, a key for dk and dv; a column),
    global 0-based indices, None where there is none; ``gpu``, ``numpy``: the two values;
    ``message``: one sentence, counting steps and blocks from 1 as the steppers do.
    """

    step: int | None
    key_block: int | None
    query_block: int | None
    quantity: str
    row: int | None
    col: int | None
    gpu: float
    numpy: float
    message: str

    def __str__(self) -> str:
        return self.message


_NAMES = {"dq": "dQ", "dk": "dK", "dv": "dV", "D": "D"}


def _check_traces(gpu_trace, numpy_trace):
    from lessons.schedules.backward import BackwardTrace
    for name, t in (("gpu_trace", gpu_trace), ("numpy_trace", numpy_trace)):
        if not isinstance(t, BackwardTrace):
            raise TypeError(f"{name} must be a lessons.schedules.backward.BackwardTrace, got {type(t).__name__}")
    sizes = ("nq", "nk", "d", "dv", "block_q", "block_k")
    g, n = (tuple(getattr(t, f) for f in sizes) for t in (gpu_trace, numpy_trace))
    if g != n:
        raise ValueError(f"the traces describe different problems: (nq, nk, d, dv, block_q, block_k) = {g} "
                         f"(gpu_trace) and {n} (numpy_trace)")


def _first_far(a, b, rtol, atol):
    """Index of the first element where ``|a - b| > atol + rtol |b|`` (NaN never matches; -inf only -inf), or None."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    with np.errstate(invalid="ignore"):
        ok = np.where(np.isinf(a) | np.isinf(b), a == b, np.abs(a - b) <= atol + rtol * np.abs(b))
    bad = np.argwhere(~ok)
    return tuple(int(x) for x in bad[0]) if len(bad) else None


def first_backward_divergence(gpu_trace, numpy_trace, *, rtol: float = 1e-4, atol: float = 1e-5):
    """The first place a kernel's backward trace differs from NumPy's beyond tolerance.

    Parameters
    ----------
    gpu_trace : :class:`lessons.schedules.backward.BackwardTrace` from :func:`kernel_backward_trace`.
    numpy_trace : the trace of :func:`lessons.flash_attention_backward` (``return_trace=True``) on the same
        inputs, options and block sizes (float64 on the kernel's float32 inputs is the natural choice).
    rtol, atol : non-negative; an element matches when ``|gpu - numpy| <= atol + rtol * |numpy|``
        (NaN never matches, -inf only -inf). The default atol suits gradients of order 1 in float32.

    Checked in order: ``D`` row by row; then step by step the tile (key block, query block), the running
    ``dK_j``, ``dV_j`` and ``dQ_i`` element by element; then the number of steps. Returns None when all
    agree, else a :class:`BackwardDivergence`. Raises TypeError for traces that are not BackwardTraces,
    ValueError for a negative tolerance or traces of different sizes or block sizes.
    Source: the forward's :func:`lessons.gpu.trace_compare.first_divergence`, for Dao 2023, Alg. 2.
    """
    for name, tol in (("rtol", rtol), ("atol", atol)):
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not tol >= 0:
            raise ValueError(f"{name} must be a non-negative number, got {tol!r}")
    _check_traces(gpu_trace, numpy_trace)
    bad = _first_far(gpu_trace.D, numpy_trace.D, rtol, atol)
    if bad is not None:
        a, b = float(gpu_trace.D[bad]), float(numpy_trace.D[bad])
        return BackwardDivergence(None, None, None, "D", bad[0], None, a, b,
                                  f"before the loop: D of row {bad[0]} differs: GPU {a:.9g} vs NumPy {b:.9g}")
    n_steps = min(len(gpu_trace), len(numpy_trace))
    for n in range(n_steps):
        g, s = gpu_trace.steps[n], numpy_trace.steps[n]
        where = f"step {n + 1} (key block {s.key_block + 1}, query block {s.query_block + 1})"
        if (g.key_block, g.query_block) != (s.key_block, s.query_block):
            return BackwardDivergence(n, s.key_block, s.query_block, "tile", None, None, float(g.query_block),
                                      float(s.query_block),
                                      f"step {n + 1}: the GPU absorbed key block {g.key_block + 1} x query block "
                                      f"{g.query_block + 1}, NumPy key block {s.key_block + 1} x query block "
                                      f"{s.query_block + 1}")
        for f, start in (("dk", s.key_start), ("dv", s.key_start), ("dq", s.row_start)):
            a, b = getattr(g, f), getattr(s, f)
            bad = _first_far(a, b, rtol, atol)
            if bad is not None:
                x, y = float(a[bad]), float(b[bad])
                what = "row" if f == "dq" else "key"
                return BackwardDivergence(
                    n, s.key_block, s.query_block, f, start + bad[0], bad[1], x, y,
                    f"{where}: {_NAMES[f]} differs at {what} {start + bad[0]}, column {bad[1]}: GPU {x:.9g} vs "
                    f"NumPy {y:.9g} (|diff| {abs(x - y):.3g} > atol {atol:g} + rtol {rtol:g} * |NumPy|)")
    if len(gpu_trace) != len(numpy_trace):
        longer = gpu_trace if len(gpu_trace) > n_steps else numpy_trace
        s = longer.steps[n_steps]
        return BackwardDivergence(n_steps, s.key_block, s.query_block, "length", None, None, float(len(gpu_trace)),
                                  float(len(numpy_trace)),
                                  f"the GPU took {len(gpu_trace)} steps, NumPy {len(numpy_trace)}: they part at step "
                                  f"{n_steps + 1} (key block {s.key_block + 1}, query block {s.query_block + 1})")
    return None


def backward_trace_differences(gpu_trace, numpy_trace) -> np.ndarray:
    """Max |kernel - NumPy| of the running dQ_i, dK_j, dV_j at every step: float64 (steps, 3).

    Columns dq, dk, dv (the blocks the step updated), inf where the kernel's value is NaN or inf and
    NumPy's is not. Both traces as for :func:`first_backward_divergence`; they must have visited the
    same tiles in the same order, else ValueError (which names the first tile where they part).
    Raises TypeError for traces that are not BackwardTraces.
    """
    _check_traces(gpu_trace, numpy_trace)
    tiles = [[(s.key_block + 1, s.query_block + 1) for s in t.steps] for t in (gpu_trace, numpy_trace)]
    if tiles[0] != tiles[1]:
        n = next((n for n, (a, b) in enumerate(zip(*tiles)) if a != b), min(map(len, tiles)))
        raise ValueError(f"the traces visited different tiles: from step {n + 1} the GPU's (key block, query "
                         f"block) are {tiles[0][n:n + 3]}, NumPy's {tiles[1][n:n + 3]}")
    out = np.zeros((len(numpy_trace), 3))
    for n, (g, s) in enumerate(zip(gpu_trace.steps, numpy_trace.steps)):
        for c, f in enumerate(("dq", "dk", "dv")):
            a, b = np.asarray(getattr(g, f), np.float64), np.asarray(getattr(s, f), np.float64)
            with np.errstate(invalid="ignore"):
                diff = np.abs(a - b)
            diff = np.where(np.isnan(b) & np.isnan(a), 0.0, np.where(np.isfinite(diff), diff, np.inf))
            out[n, c] = diff.max(initial=0.0)
    return out


# ---------------------------------------------------------------------------
# notebook 04's "On the GPU" section
# ---------------------------------------------------------------------------

def backward_demo_inputs(n_q: int = 64, n_k: int = 64, d: int = 16, *, causal: bool = True, seed: int = 0):
    """One head's backward inputs as a forward kernel hands them over: ``(q, k, v, o, lse, do)`` float32.

    q, do (n_q, d), k, v (n_k, d): standard normal from ``numpy.random.default_rng(seed)``, stored in float32;
    ``o`` and ``lse``: :func:`lessons.attention` in float64 on those stored values (``causal`` as given),
    then stored in float32. Raises ValueError for sizes below 1 (``n_q``, ``n_k``, ``d``) or a negative
    ``seed``, TypeError for a non-int size or seed (bools included).
    """
    from lessons.core.checks import check_int, check_positive_int
    from lessons.core.reference import attention
    n_q, n_k, d = (check_positive_int(x, name) for x, name in ((n_q, "n_q"), (n_k, "n_k"), (d, "d")))
    rng = np.random.default_rng(check_int(seed, "seed", min=0))
    q, k, v, do = (rng.standard_normal((n, d)).astype(np.float32) for n in (n_q, n_k, n_k, n_q))
    o, lse = attention(*(x.astype(np.float64) for x in (q, k, v)), causal=causal, return_lse=True)
    return q, k, v, o.astype(np.float32), lse.astype(np.float32), do


def _difference_table(differences, numpy_trace, where) -> str:
    head = ["step", "key block", "query block", f"dQ_i {where} - NumPy", f"dK_j {where} - NumPy",
            f"dV_j {where} - NumPy"]
    body = [[str(n + 1), str(s.key_block + 1), str(s.query_block + 1), *(f"{x:.1e}" for x in differences[n])]
            for n, s in enumerate(numpy_trace.steps)]
    widths = [max(len(r[j]) for r in [head, *body]) for j in range(len(head))]
    return "\n".join("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *body])


def backward_on_gpu(*, n_q: int = 64, n_k: int = 64, d: int = 16, block_q: int = 16, block_k: int = 16,
                    causal: bool = True, seed: int = 0, use_device=None, emulate=None):
    """Notebook 04: the backward kernels on one head, checked against NumPy, and their trace.

    Parameters
    ----------
    n_q, n_k, d : the head's sizes (default 64 queries, 64 keys, d = 16: with blocks of 16, 4 x 4 tiles,
        10 of them computed under the causal mask, as the notebook's NumPy stepper).
    block_q, block_k : the kernels' tile sizes (:func:`lessons.gpu.source.flash_attention_backward_config`).
    causal : bool, bottom-right aligned.
    seed : the inputs' seed (:func:`backward_demo_inputs`).
    use_device, emulate : as :func:`lessons.gpu.lesson.online_softmax_on_gpu` (None: a GPU when there is
        one, else the CPU emulator, labelled as such).

    At each place that runs (a GPU, or the emulator: the same CUDA C on the CPU), the trace build runs
    once per key block (:func:`kernel_backward_trace`); its ``dq``, ``dk``, ``dv`` are checked against
    :func:`lessons.attention_backward` in float64 on the same float32 inputs (tolerance
    :data:`lessons.gpu.harness.TOLERANCE`); on a GPU the plain build is checked and timed as well. Returns
    a :class:`lessons.gpu.harness.GpuLesson` whose ``details`` hold ``inputs`` (q, k, v, o, lse, do),
    ``exact`` (the textbook gradients), ``numpy_trace`` (:func:`lessons.flash_attention_backward` in float64
    on the inputs), ``baseline`` (the same in float32), and from the first place that ran ``where``
    (``"GPU (<name>)"`` or ``"emulated on the CPU"``), ``trace`` (the kernels' BackwardTrace), ``kernel``
    (the pair ``(where, trace)``, what :class:`lessons.views.backward.BackwardStepper` takes as ``kernel``),
    ``differences`` ((steps, 3) max |kernel - NumPy|) and ``divergence`` (None when every step agrees);
    on a GPU also ``seconds``, the median time of one backward (all three kernels, CUDA events).
    NVRTC's report (registers, shared memory, spills) is of the plain build, the one a training step runs.
    Raises ValueError for bad sizes or tiles the kernels cannot take.
    Source: Dao 2023 (FlashAttention-2), Alg. 2.
    """
    from lessons.gpu.harness import TOLERANCE, Section, Table, format_seconds, run_section
    from lessons.schedules.backward import attention_backward, flash_attention_backward

    inputs = backward_demo_inputs(n_q, n_k, d, causal=causal, seed=seed)
    block_q, block_k = flash_attention_backward_config(d, block_q, block_k)
    as64 = [x.astype(np.float64) for x in inputs]
    exact = attention_backward(as64[0], as64[1], as64[2], as64[5], causal=causal)
    *_, numpy_trace = flash_attention_backward(*as64, block_q=block_q, block_k=block_k, causal=causal,
                                               return_trace=True)
    *_, baseline = flash_attention_backward(*inputs, block_q=block_q, block_k=block_k, causal=causal,
                                            return_trace=True)
    build = flash_attention_backward_build(d, "float32", False, block_q, block_k)
    trace_build = flash_attention_backward_build(d, "float32", True, block_q, block_k)
    case = f"{n_q} x {n_k}, d = {d}{', causal' if causal else ''}"
    options = dict(causal=causal, block_q=block_q, block_k=block_k)

    def run(place):
        checks, timed = [], {}
        if place.timed:
            launch = place.kernel(flash_attention_backward_gpu)
            dev = [place.put(x) for x in inputs]
            timed["seconds"] = place.seconds(lambda: launch(*dev, **options))     # all three kernels
            checks += [place.check(f"{case}: {name}", (g,), (r,), **TOLERANCE)
                       for name, g, r in zip(("dq", "dk", "dv"), launch(*dev, **options), exact)]
        outputs, trace = _traced_run(place.runner, *inputs, scale=None, **options)
        checks += [place.check(f"{case}, trace build: {name}", (g,), (r,), **TOLERANCE)
                   for name, g, r in zip(("dq", "dk", "dv"), outputs, exact)]
        where = f"GPU ({place.runner.name})" if place.timed else EMULATED
        return checks, {**timed, "where": where, "trace": trace, "kernel": (where, trace),
                        "divergence": first_backward_divergence(trace, numpy_trace),
                        "differences": backward_trace_differences(trace, numpy_trace)}

    def report(r):
        if "trace" not in r.details:
            return []
        where, found = r.details["where"], r.details["divergence"]
        lines = [Table(_difference_table(r.details["differences"], numpy_trace, "kernel"),
                       f"Step by step, the kernels' trace ({where}; trace build, -DFA_TRACE) beside NumPy's "
                       f"(lessons.flash_attention_backward, float64, block_q={block_q}, block_k={block_k}): "
                       f"max |kernel - NumPy| of the running blocks each step updated:")]
        if r.details.get("seconds") is not None:
            lines.append(f"  One backward (the three kernels, plain build) on the GPU: median "
                         f"{format_seconds(r.details['seconds'])} (CUDA events).")
        lines.append("  first_backward_divergence: " + (
            "none - D and every step's running dK_j, dV_j, dQ_i agree within rounding (rtol 1e-4, atol 1e-5)."
            if found is None else str(found)))
        return lines

    details = dict(inputs=inputs, exact=exact, numpy_trace=numpy_trace, baseline=baseline, block_q=block_q,
                   block_k=block_k, causal=causal)
    return run_section(Section("04_backward_pass", f"FlashAttention-2 backward kernels "
                               f"(lessons/gpu/kernels/flash_attention_backward.cu), block_q={block_q}, "
                               f"block_k={block_k}, d={d}", [build], run, report,
                               emulator_builds=[trace_build], details=details), use_device, emulate)
