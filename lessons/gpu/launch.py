"""Launchers: check the inputs in Python, pick the compiled variant, run the kernel.

Each launcher validates shapes, dtypes and contiguity *before* touching a device, so
bad input gets a clear TypeError/ValueError on any machine. Then it runs on one of
two backends:

* ``backend="cupy"`` (default): the kernel is compiled by CuPy's ``RawModule`` (NVRTC)
  for the GPU at hand and launched there. CuPy inputs give CuPy outputs; NumPy inputs
  are copied to the device and the results copied back. Without a CUDA device this
  raises RuntimeError saying so.
* ``backend="emulator"``: the same CUDA C runs on the CPU
  (:mod:`lessons.gpu.emulator`), slowly, with NumPy in and out: for tests and for
  stepping through the kernel on a laptop.

Storage dtypes: float32 or float16 arrays; bfloat16 as uint16 bit patterns with
``bfloat16=True`` (see :mod:`lessons.gpu.bfloat16`). Arithmetic is float32 throughout;
``lse`` is always float32.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from lessons.core.checks import as_float_array, check_flag, check_int, check_positive_int, check_scale
from lessons.gpu.compile import device_available, device_module, device_name
from lessons.gpu.emulator import emulator_available
from lessons.gpu.source import (MAX_HEAD_DIM, MMA_BLOCK_Q, MMA_DTYPES, flash_attention_build, flash_attention_config,
                     flash_attention_mma_build, flash_attention_mma_config, kernel_signature,
                     online_softmax_build, paged_decode_build)
from lessons.gpu.source import flash_attention_regtile_build, flash_attention_regtile_config
from lessons.gpu.source import flash_attention_regtile_wide_build, flash_attention_regtile_wide_config
from lessons.gpu.source import flash_attention_mma_async_build, flash_attention_mma_async_config
from lessons.gpu.source import flash_attention_mma_fa2_build, flash_attention_mma_fa2_config
from lessons.gpu.source import (flash_attention_mma_fa2_lazy_build, flash_attention_mma_fa2_lazy_config,
                                flash_attention_mma_fa2_wide_build, flash_attention_mma_fa2_wide_config)
from lessons.gpu.source import (FA2_LEAN_V_FLAGS, flash_attention_mma_fa2_lean_build,
                                flash_attention_mma_fa2_lean_config)
from lessons.gpu.source import (flash_attention_wgmma_build, flash_attention_wgmma_config,
                                flash_attention_wgmma_overlap_build)
from lessons.gpu.trace_compare import GpuTrace

__all__ = ["flash_attention_gpu", "flash_attention_mma_gpu", "mma_probe_gpu", "online_softmax_gpu", "paged_decode_gpu",
           "flash_decoding_gpu",
           "SplitTraces", "BACKENDS", "MAX_TRACE_ROWS", "Runner"]
__all__ += ["flash_attention_regtile_gpu", "flash_attention_regtile_wide_gpu", "flash_attention_mma_async_gpu", "paged_decode_split_gpu"]
__all__ += ["flash_attention_mma_fa2_gpu", "flash_attention_mma_fa2_lazy_gpu", "flash_attention_mma_fa2_wide_gpu", "flash_attention_mma_fa2_lean_gpu", "open_device", "kernel_row_trace", "flash_attention_wgmma_gpu",
            "flash_attention_wgmma_overlap_gpu", "flash_attention_wgmma_pingpong_gpu", "wgmma_probe_gpu"]

BACKENDS = ("cupy", "emulator")
#: most rows one launch may trace (each traced row is looked up by every thread)
MAX_TRACE_ROWS = 64
_GRID_YZ_LIMIT = 65535


# ---------------------------------------------------------------------------
# input checks (metadata only: no device needed)
# ---------------------------------------------------------------------------

def _array_kind(x, name: str) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    if type(x).__module__.split(".")[0] == "cupy" and hasattr(x, "shape") and hasattr(x, "dtype"):
        return "cupy"
    raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(x).__name__}")


def _check_arrays(arrays: dict) -> str:
    """All arrays NumPy or all CuPy, each C-contiguous; returns 'numpy' or 'cupy'."""
    kinds = {name: _array_kind(x, name) for name, x in arrays.items()}
    if len(set(kinds.values())) > 1:
        raise TypeError(f"inputs must be all NumPy or all CuPy arrays, got {kinds}")
    for name, x in arrays.items():
        if not x.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (got strides {x.strides} for shape {x.shape}); "
                             f"pass {name}.copy() or xp.ascontiguousarray({name})")
    return next(iter(kinds.values()))


def _storage_dtype(arrays: dict, bfloat16: bool) -> str:
    """'float32', 'float16' or 'bfloat16' for float arrays that share one dtype."""
    check_flag(bfloat16, "bfloat16")
    dtypes = {name: np.dtype(x.dtype) for name, x in arrays.items()}
    if bfloat16:
        bad = {n: str(d) for n, d in dtypes.items() if d != np.uint16}
        if bad:
            raise TypeError(f"with bfloat16=True, {', '.join(arrays)} must hold bfloat16 bits as uint16 "
                            f"(lessons.gpu.to_bfloat16_bits), got {bad}")
        return "bfloat16"
    kinds = set(dtypes.values())
    unsupported = {n: str(d) for n, d in dtypes.items() if d not in (np.float32, np.float16)}
    if unsupported:                       # (before a mismatch: an int beside floats is what is wrong)
        got = next(iter(kinds)) if len(kinds) == 1 else unsupported
        hint = " (for bfloat16 bits pass bfloat16=True)" if np.dtype(np.uint16) in kinds else ""
        raise TypeError(f"{', '.join(arrays)} must be float32 or float16, got {got}{hint}")
    if len(kinds) > 1:
        raise TypeError(f"{', '.join(arrays)} must share one dtype, got "
                        f"{ {n: str(d) for n, d in dtypes.items()} }")
    return str(kinds.pop())                                  # "float32" or "float16"


def _check_index_array(x, name: str, ndim: int) -> None:
    _array_kind(x, name)
    if np.dtype(x.dtype) != np.int32:
        raise TypeError(f"{name} must be an int32 array, got dtype {x.dtype}; use {name}.astype(np.int32)")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {x.shape}")


#: the largest |scale| a kernel takes: the base-2 kernels multiply it by log2(e) in float32, which must stay finite
_MAX_KERNEL_SCALE = float(np.finfo(np.float32).max) / 1.4426950408889634


def _kernel_scale(scale, d: int) -> float:
    """``scale`` (default ``1/sqrt(d)``) as the kernels receive it: a float32 that stays finite when the
    base-2 kernels fold log2(e) into it (|scale| <= 2.359e38)."""
    scale = check_scale(scale, d)
    if abs(scale) > _MAX_KERNEL_SCALE:
        raise ValueError(f"scale must fit in float32 times log2(e), which the kernels fold into it "
                         f"(|scale| <= {_MAX_KERNEL_SCALE:.4g}), got {scale}")
    return scale


def _check_backend(backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def _check_rows(rows, name: str, limit: int) -> list:
    """trace_rows: a sequence of distinct ints in [0, limit)."""
    arr = np.asarray(rows)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise TypeError(f"{name} must be a 1-D sequence of ints, got {rows!r}")
    out = [int(r) for r in arr]
    if not 1 <= len(out) <= MAX_TRACE_ROWS:
        raise ValueError(f"{name} must name 1..{MAX_TRACE_ROWS} rows, got {len(out)}")
    bad = [r for r in out if not 0 <= r < limit]
    if bad:
        raise ValueError(f"{name} must be in [0, {limit}), got {bad}")
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must not repeat a row, got {out}")
    return out


def _check_pairs(pairs, num_seqs: int, num_heads: int) -> list:
    """trace_rows of the decode kernels: (seq, head) pairs -> flat rows seq * num_heads + head."""
    arr = np.asarray(pairs)
    if arr.size == 0:
        raise ValueError(f"trace_rows must name 1..{MAX_TRACE_ROWS} (seq, head) pairs, got none")
    if arr.ndim != 2 or arr.shape[1] != 2 or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"trace_rows must be a sequence of (seq, head) int pairs, got {pairs!r}")
    for s, h in arr:
        if not (0 <= s < num_seqs and 0 <= h < num_heads):
            raise ValueError(f"trace_rows entry ({s}, {h}) is outside num_seqs={num_seqs}, num_heads={num_heads}")
    if len({(int(s), int(h)) for s, h in arr}) != len(arr):
        raise ValueError(f"trace_rows must not repeat a (seq, head) pair, got {arr.tolist()}")
    return _check_rows(arr[:, 0] * num_heads + arr[:, 1], "trace_rows", num_seqs * num_heads)


# ---------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------

class Runner:
    """Where a kernel runs: moves arrays there, launches, and (on a device) times.

    ``backend``: ``"cupy"`` (the current CUDA device; RuntimeError saying why when there is
    none) or ``"emulator"`` (the CPU). ``kind``: ``"numpy"`` or ``"cupy"``, the kind of
    the caller's arrays: results come back as NumPy for NumPy inputs or the emulator.
    ``name`` says where in words (e.g. ``'NVIDIA H200 (sm_90)'``). Used by every launcher
    and by the notebooks' "On the GPU" sections (:mod:`lessons.gpu.harness`).
    """

    def __init__(self, backend: str = "cupy", kind: str = "numpy"):
        self.backend = _check_backend(backend)
        if kind not in ("numpy", "cupy"):
            raise ValueError(f"kind must be 'numpy' or 'cupy' (the caller's arrays), got {kind!r}")
        self.return_numpy = backend == "emulator" or kind == "numpy"
        if backend == "cupy":
            try:
                import cupy
            except ImportError:
                cupy = None
            if cupy is None or not device_available():
                why = "no CUDA device" if cupy else "CuPy is not installed (pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12)"
                raise RuntimeError(f"cannot run the CUDA kernel: {why}. To run the same kernel on the "
                                   f"CPU, pass backend='emulator'.")
            self.xp = cupy
        else:
            self.xp = np

    _name = None

    @property
    def name(self) -> str:
        """Where the kernel runs, in words (asked only when shown, never on a launch's path)."""
        if self._name is None:
            self._name = (device_name() or "a CUDA device") if self.backend == "cupy" else "the CPU emulator"
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        self._name = value

    def put(self, x):
        """``x`` where the kernel reads it: a CuPy array on a device, a NumPy array on the emulator."""
        if self.backend == "cupy":
            return self.xp.asarray(x)
        return x if isinstance(x, np.ndarray) else x.get()

    def get(self, x):
        """A result, as the caller gets it (NumPy for NumPy inputs or the emulator)."""
        if self.return_numpy and not isinstance(x, np.ndarray):
            return x.get()
        return x

    @staticmethod
    def host(x) -> np.ndarray:
        """Always a NumPy array (traces and comparisons are NumPy)."""
        return x if isinstance(x, np.ndarray) else (x.get() if hasattr(x, "get") else np.asarray(x))

    def kernel(self, launcher):
        """``launcher`` (e.g. :func:`flash_attention_gpu`) bound to this backend."""
        return functools.partial(launcher, backend=self.backend)

    def median_seconds(self, fn, *, warmup: int = 3, repeats: int = 20) -> float:
        """Median seconds of ``fn()`` on the device's stream (CUDA events). RuntimeError on the emulator."""
        if self.backend != "cupy":
            raise RuntimeError("the emulator is not timed: its seconds say nothing about a GPU")
        from lessons.gpu.measure import median_cuda_seconds

        return median_cuda_seconds(self.xp, fn, warmup, repeats)

    def launch(self, build, entry: str, grid, args) -> None:
        """Run ``entry<<<grid, build.threads_per_block>>>(*args)``; an empty grid does nothing."""
        params = kernel_signature(build.kernel, entry)
        grid = tuple(int(g) for g in grid)
        if min(grid) <= 0:
            return                                   # nothing to do (CUDA refuses empty grids)
        if self.backend == "emulator":
            from lessons.gpu.emulator import EmulatedModule

            EmulatedModule(build).launch(entry, grid, (build.threads_per_block,), args)
            return
        typed = []
        for (kind, _), value in zip(params, args):
            if kind == "tensormap":
                value = value.arg                    # (a DeviceTensorMap: its bytes, passed by value)
            typed.append(value if kind in ("pointer", "tensormap")
                         else (np.int32(value) if kind == "int" else np.float32(value)))
        fn = device_module(build).get_function(entry)
        dynamic = build.entry_dynamic_smem_bytes(entry)
        if dynamic:
            fn.max_dynamic_shared_size_bytes = dynamic
        fn(grid, (build.threads_per_block,), tuple(typed), shared_mem=dynamic)


def _trace_buffer(runner, shape, tracing: bool):
    if tracing:
        return runner.xp.full(shape, np.nan, dtype=np.float32)
    return runner.xp.zeros(1, dtype=np.float32)      # unused by a build without FA_TRACE


def _rows_buffer(runner, rows):
    return runner.xp.asarray(np.asarray(rows if rows else [0], dtype=np.int32))


# ---------------------------------------------------------------------------
# online softmax
# ---------------------------------------------------------------------------

def online_softmax_gpu(x, *, tile: int = 256, bfloat16: bool = False, trace_rows=None, backend: str = "cupy"):
    """Softmax of each row of ``x`` by the online-softmax kernel (one block per row).

    Parameters
    ----------
    x : float32/float16 array (n_cols,) or (n_rows, n_cols), C-contiguous (NumPy or CuPy);
        uint16 bfloat16 bits with ``bfloat16=True``. ``-inf`` entries are masked columns.
    tile : columns per tile = threads per block, a multiple of 32 up to 1024.
    trace_rows : optional sequence of row indices; the trace build then records
        ``(m, alpha, l)`` after each tile for those rows.
    backend : ``"cupy"`` (GPU) or ``"emulator"`` (the CPU).

    Returns ``(y, lse)`` or ``(y, lse, trace)``: ``y`` like ``x``; ``lse`` float32 of shape
    ``x.shape[:-1]`` (-inf for a row with nothing visible, whose y is 0); ``trace`` a
    :class:`GpuTrace` labelled ``(row,)``.
    Raises TypeError/ValueError for bad input, RuntimeError with backend "cupy" and no device.
    Source: Milakov & Gimelshein 2018, Alg. 3.
    """
    backend = _check_backend(backend)
    kind = _check_arrays({"x": x})
    dtype = _storage_dtype({"x": x}, bfloat16)
    if x.ndim not in (1, 2):
        raise ValueError(f"x must be 1-D (n_cols,) or 2-D (n_rows, n_cols), got shape {x.shape}")
    n_rows, n_cols = (1, x.shape[0]) if x.ndim == 1 else x.shape
    tracing = trace_rows is not None
    rows = _check_rows(trace_rows, "trace_rows", n_rows) if tracing else []
    build = online_softmax_build(tile, dtype, tracing)
    if n_rows > 2**31 - 1 or n_cols > 2**31 - 1:
        raise ValueError(f"x of shape {x.shape} is too large for int32 indexing")

    run = Runner(backend, kind)
    xd = run.put(x)
    y = run.xp.empty(x.shape, dtype=x.dtype)
    lse = run.xp.empty(x.shape[:-1], dtype=np.float32)
    n_tiles = -(-n_cols // tile)
    trace = _trace_buffer(run, (len(rows), n_tiles, 3), tracing)
    run.launch(build, "online_softmax", (n_rows,),
               [xd, y, lse, n_rows, n_cols, _rows_buffer(run, rows), len(rows), trace])
    result = (run.get(y), run.get(lse))
    if tracing:
        result += (GpuTrace(tuple((r,) for r in rows), run.host(trace)),)
    return result


# ---------------------------------------------------------------------------
# flash attention forward
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _FlashInputs:
    kind: str            # 'numpy' or 'cupy'
    dtype: str           # storage dtype name
    lead: tuple          # leading (batch, heads) dims
    n_q: int
    n_k: int
    d: int
    batch_heads: int
    scale: float
    causal: bool


def _check_flash(q, k, v, scale, causal, bfloat16) -> _FlashInputs:
    """The checks both forward launchers share (metadata only, no device needed)."""
    arrays = {"q": q, "k": k, "v": v}
    kind = _check_arrays(arrays)
    dtype = _storage_dtype(arrays, bfloat16)
    if q.ndim not in (2, 3, 4):
        raise ValueError(f"q must be (Nq, d), (heads, Nq, d) or (batch, heads, Nq, d), got shape {q.shape}")
    if k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"q, k, v must have the same rank, got shapes {q.shape}, {k.shape}, {v.shape}")
    lead = tuple(q.shape[:-2])
    if tuple(k.shape[:-2]) != lead or tuple(v.shape[:-2]) != lead:
        raise ValueError(f"q, k, v must share the leading (batch, heads) dims, got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    n_q, d = q.shape[-2:]
    n_k = k.shape[-2]
    if k.shape[-1] != d:
        raise ValueError(f"q and k must share the head dim d: q has shape {q.shape}, k has shape {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k (this kernel needs dv == d): k {k.shape}, v {v.shape}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim d must be in 1..{MAX_HEAD_DIM}, got q shape {q.shape}")
    scale = _kernel_scale(scale, d)
    causal = check_flag(causal, "causal")
    batch_heads = math.prod(lead)
    if batch_heads > _GRID_YZ_LIMIT:
        raise ValueError(f"batch * heads must be at most {_GRID_YZ_LIMIT}, got {batch_heads}")
    if max(n_q, n_k) > 2**31 - 1:
        raise ValueError(f"Nq and Nk must fit in int32, got Nq={n_q}, Nk={n_k}")
    return _FlashInputs(kind, dtype, lead, int(n_q), int(n_k), int(d), batch_heads, scale, causal)


def flash_attention_gpu(q, k, v, *, scale=None, causal: bool = False, block_q: int | None = None,
                        block_k: int | None = None, bfloat16: bool = False, trace_rows=None,
                        backend: str = "cupy"):
    """FlashAttention-2 forward on the GPU (or its CPU emulation).

    Parameters
    ----------
    q : (Nq, d), (heads, Nq, d) or (batch, heads, Nq, d); float32/float16, C-contiguous.
    k, v : (Nk, d) / (heads, Nk, d) / (batch, heads, Nk, d) with the same leading dims and
        dtype as q; the kernel needs ``dv == d``; any Nq, Nk >= 0 and 1 <= d <= 256.
    scale : float, default ``1/sqrt(d)``.
    causal : bool, bottom-right aligned: query i sees key j iff ``j <= i + Nk - Nq``; rows
        that see no key give out 0 and lse -inf.
    block_q, block_k : tile sizes Br, Bc (default per d: :func:`lessons.gpu.flash_attention_config`).
    bfloat16 : inputs are uint16 bfloat16 bits (output too).
    trace_rows : optional query row indices to trace (every batch and head).
    backend : ``"cupy"`` or ``"emulator"``.

    Returns ``(out, lse)`` or ``(out, lse, trace)``: ``out`` shaped and typed like ``q``;
    ``lse`` float32 of shape ``q.shape[:-1]``; ``trace`` a :class:`GpuTrace` labelled
    ``(*leading_index, row)``, one record per key tile of ``block_k`` keys, comparable with
    ``lessons.flash_attention(q, k, v, tile=block_k, block_q=block_q, return_trace=True).row(i)``.
    Raises TypeError/ValueError naming the argument for wrong dtypes, shapes, strides or
    sizes; RuntimeError with backend "cupy" and no CUDA device.
    Source: Dao 2023 (FlashAttention-2), Alg. 1.
    """
    backend = _check_backend(backend)
    f = _check_flash(q, k, v, scale, causal, bfloat16)
    block_q, block_k = flash_attention_config(f.d, block_q, block_k)
    tracing = trace_rows is not None
    rows = _check_rows(trace_rows, "trace_rows", f.n_q) if tracing else []
    build = flash_attention_build(f.d, f.dtype, tracing, block_q, block_k)
    run = Runner(backend, f.kind)
    return _launch_forward(run, build, "flash_attention_forward", f, [run.put(x) for x in (q, k, v)],
                           block_q, block_k, rows)


def _launch_forward(run, build, entry: str, f: _FlashInputs, qkv, block_q: int, block_k: int, rows, extra=()):
    """Launch one of the forward kernels (they share one signature; ``extra`` arguments follow the trace) over
    ``qkv`` already on ``run``'s device; returns ``(out, lse)`` or, for a trace build, ``(out, lse, GpuTrace)``."""
    q = qkv[0]
    out = run.xp.empty(q.shape, dtype=q.dtype)
    lse = run.xp.empty(q.shape[:-1], dtype=np.float32)
    n_tiles = -(-f.n_k // block_k)
    trace = _trace_buffer(run, (f.batch_heads, len(rows), n_tiles, 3), build.trace)
    run.launch(build, entry, (-(-f.n_q // block_q), f.batch_heads),
               [*qkv, out, lse, f.n_q, f.n_k, f.scale, int(f.causal), _rows_buffer(run, rows), len(rows),
                n_tiles, trace, *extra])
    result = (run.get(out), run.get(lse))
    if build.trace:
        labels = tuple((*idx, r) for idx in np.ndindex(*f.lead) for r in rows)
        records = run.host(trace).reshape(f.batch_heads * len(rows), n_tiles, 3)
        result += (GpuTrace(labels, records),)
    return result


def flash_attention_mma_gpu(q, k, v, *, scale=None, causal: bool = False, block_k: int | None = None,
                            bfloat16: bool = False, trace_rows=None, backend: str = "cupy"):
    """FlashAttention-2 forward on tensor cores (``mma.sync.m16n8k16``), or its CPU emulation.

    The advanced kernel of the series: the fold of :func:`flash_attention_gpu` with both
    products, ``S = Q K^T`` and ``o += P V``, on tensor cores; P is rounded to q's 16-bit
    dtype before the second product, as in FlashAttention-2. Needs a GPU of compute
    capability 8.0 or newer (A100, H100, H200).

    Parameters
    ----------
    q, k, v : as :func:`flash_attention_gpu`, but float16 (or bfloat16 bits with
        ``bfloat16=True``) only, and the head dim d a multiple of 16 in 16..256.
    scale, causal, bfloat16, trace_rows, backend : as :func:`flash_attention_gpu`.
    block_k : keys per tile (Bc), a multiple of 16; default 64 for d <= 128, else 32
        (:func:`lessons.gpu.source.flash_attention_mma_config`). Query blocks are 64 rows.

    Returns ``(out, lse)`` or ``(out, lse, trace)`` as :func:`flash_attention_gpu`; the trace
    compares with ``lessons.flash_attention(q, k, v, tile=block_k, block_q=64, return_trace=True)``.
    Raises TypeError for float32 input (use :func:`flash_attention_gpu`), ValueError naming
    the argument for bad shapes, a head dim that is not a multiple of 16, or a bad block_k;
    RuntimeError with backend "cupy" and no CUDA device, or a GPU older than compute capability 8.0.
    Source: Dao 2023 (FlashAttention-2), Alg. 1 and Sec. 3.3; PTX ISA, mma.m16n8k16.
    """
    backend = _check_backend(backend)
    _check_tensor_core_dtype(q, bfloat16, "convert with q.astype(np.float16) or use flash_attention_gpu")
    if len(getattr(q, "shape", ())) >= 2:
        flash_attention_mma_config(int(q.shape[-1]), block_k)      # the head dim and block_k it can take
    f = _check_flash(q, k, v, scale, causal, bfloat16)
    block_k = flash_attention_mma_config(f.d, block_k)
    tracing = trace_rows is not None
    rows = _check_rows(trace_rows, "trace_rows", f.n_q) if tracing else []
    build = flash_attention_mma_build(f.d, f.dtype, tracing, block_k)
    run = Runner(backend, f.kind)
    _require_tensor_cores(run)
    return _launch_forward(run, build, "flash_attention_mma", f, [_aligned(run, run.put(x)) for x in (q, k, v)],
                           MMA_BLOCK_Q, block_k, rows)


def flash_attention_regtile_gpu(q, k, v, *, scale=None, causal: bool = False, block_q: int | None = None,
                                block_k: int | None = None, trace_rows=None, backend: str = "cupy"):
    """FlashAttention-2 forward on CUDA cores, register-tiled (float32), or its CPU emulation.

    The fold of :func:`flash_attention_gpu`, but each thread owns a small block of S (up to
    4 rows x 8 keys) and of O (up to 4 rows x 4*ceil(d/32) columns), and reads shared memory
    16 bytes at a time, so one shared-memory load feeds several FMAs instead of one.

    Parameters
    ----------
    q, k, v : as :func:`flash_attention_gpu`, but float32 only and the head dim d a multiple
        of 4 in 4..256 (rows are read as 16-byte vectors).
    scale, causal, trace_rows, backend : as :func:`flash_attention_gpu`.
    block_q, block_k : tile sizes Br (16, 32, 64, 128) and Bc (8, 16, 32, 64); default per d from
        :func:`lessons.gpu.source.flash_attention_regtile_config`.

    Returns ``(out, lse)`` or ``(out, lse, trace)`` as :func:`flash_attention_gpu`; the trace
    compares with ``lessons.flash_attention(q, k, v, tile=block_k, block_q=block_q, return_trace=True)``.
    Raises TypeError for input that is not float32 (16-bit, float64, integers, mixed) or a tile that is not
    an int, ValueError naming the argument for bad shapes, a head dim that is not a multiple of 4, or bad
    tiles; RuntimeError with backend "cupy" and no CUDA device.
    Source: Dao 2023 (FlashAttention-2), Alg. 1; register tiling as in Volkov & Demmel 2008.
    """
    return _launch_regtile(q, k, v, scale, causal, block_q, block_k, trace_rows, backend,
                           flash_attention_regtile_config, flash_attention_regtile_build)


def _launch_regtile(q, k, v, scale, causal, block_q, block_k, trace_rows, backend, config, make_build):
    """The checks and launch shared by the register-tiled builds: ``config`` resolves the tiles (it raises for bad
    ones, before the inputs' other checks when the head dim is readable), ``make_build`` makes the build."""
    backend = _check_backend(backend)
    dtype = getattr(q, "dtype", None)
    if dtype is not None and np.dtype(dtype) != np.float32:
        given = np.dtype(dtype)
        hint = ("use flash_attention_gpu or flash_attention_mma_gpu for 16-bit inputs" if given.itemsize == 2
                else "convert with q.astype(np.float32) (native byte order)")
        raise TypeError(f"the register-tiled kernel takes float32 q, k, v, got {given}; {hint}")
    if len(getattr(q, "shape", ())) >= 2:
        config(int(q.shape[-1]), block_q, block_k)
    f = _check_flash(q, k, v, scale, causal, False)
    block_q, block_k = config(f.d, block_q, block_k)
    tracing = trace_rows is not None
    rows = _check_rows(trace_rows, "trace_rows", f.n_q) if tracing else []
    build = make_build(f.d, f.dtype, tracing, block_q, block_k)
    run = Runner(backend, f.kind)
    return _launch_forward(run, build, build.kernel, f, [_aligned(run, run.put(x)) for x in (q, k, v)],
                           block_q, block_k, rows)


def flash_attention_regtile_wide_gpu(q, k, v, *, scale=None, causal: bool = False, block_q: int | None = None,
                                     block_k: int | None = None, trace_rows=None, backend: str = "cupy"):
    """:func:`flash_attention_regtile_gpu` with wider rows: 16 lanes per row group, P read 4 keys at a time.

    The same kernel file built with ``REGTILE_WIDE=1`` (entry point ``flash_attention_regtile_wide``): 8 row
    groups of 16 lanes instead of 16 of 8, so a thread holds half as many columns of each output row and can
    own 8 rows x 4 keys of S at d = 64 and 128 (the plain build at d = 128: 2 x 4), its 8 rows interleaved so
    that the two row groups of a warp read rows in different banks; and one 16-byte load of P gives 4 keys of
    P V. In S = Q K^T, per 4 columns of the head dim, 12 shared loads feed 128 FMAs (plain, d = 128: 6 feed 32).

    Parameters
    ----------
    q, k, v : as :func:`flash_attention_regtile_gpu`: float32, head dim d a multiple of 4 in 4..256.
    scale, causal, trace_rows, backend : as :func:`flash_attention_gpu`.
    block_q, block_k : tile sizes Br (8, 16, 32, 64) and Bc (16, 32, 64, 128); default per d from
        :func:`lessons.gpu.source.flash_attention_regtile_wide_config` ((64, 64) at d = 64 and 128).

    Returns ``(out, lse)`` or ``(out, lse, trace)`` as :func:`flash_attention_gpu`; the trace compares with
    ``lessons.flash_attention(q, k, v, tile=block_k, block_q=block_q, return_trace=True)``.
    Raises TypeError for input that is not float32 (16-bit, float64, integers, mixed) or a tile that is not an
    int, ValueError naming the argument for bad shapes, a head dim that is not a multiple of 4, or bad tiles;
    RuntimeError with backend "cupy" and no CUDA device.
    Source: Dao 2023 (FlashAttention-2), Alg. 1; register tiling as in Volkov & Demmel 2008 (a thread's
    block of the product grows until its loads are a small share of its instructions).
    """
    return _launch_regtile(q, k, v, scale, causal, block_q, block_k, trace_rows, backend,
                           flash_attention_regtile_wide_config, flash_attention_regtile_wide_build)


def flash_attention_mma_async_gpu(q, k, v, *, scale=None, causal: bool = False, block_k: int | None = None,
                                  bfloat16: bool = False, trace_rows=None, backend: str = "cupy"):
    """:func:`flash_attention_mma_gpu` with K/V tiles copied by ``cp.async`` into two shared-memory
    stages (tile j + 1 in flight while tile j is multiplied) and fragments loaded by ``ldmatrix``.

    Same arguments, returns and errors as :func:`flash_attention_mma_gpu`, except ``block_k``:
    16, 32 or 64, default from :func:`lessons.gpu.source.flash_attention_mma_async_config`
    (two stages must fit 48 KiB). The trace compares with
    ``lessons.flash_attention(q, k, v, tile=block_k, block_q=64, return_trace=True)``.
    Source: Dao 2023 (FlashAttention-2), Alg. 1 and Sec. 3.3; PTX ISA, cp.async and ldmatrix.
    """
    backend = _check_backend(backend)
    _check_tensor_core_dtype(q, bfloat16, "use flash_attention_gpu or flash_attention_regtile_gpu for float32")
    if len(getattr(q, "shape", ())) >= 2:
        flash_attention_mma_async_config(int(q.shape[-1]), block_k)
    f = _check_flash(q, k, v, scale, causal, bfloat16)
    block_k = flash_attention_mma_async_config(f.d, block_k)
    tracing = trace_rows is not None
    rows = _check_rows(trace_rows, "trace_rows", f.n_q) if tracing else []
    build = flash_attention_mma_async_build(f.d, f.dtype, tracing, block_k)
    run = Runner(backend, f.kind)
    _require_tensor_cores(run)
    return _launch_forward(run, build, "flash_attention_mma_async", f,
                           [_aligned(run, run.put(x)) for x in (q, k, v)], MMA_BLOCK_Q, block_k, rows)


def _check_tensor_core_dtype(q, bfloat16, fp32_hint: str, what: str = "the tensor-core kernel",
                             names: str = "q, k, v") -> None:
    """TypeError unless ``q`` (``names`` in the message) holds float16, or bfloat16 bits with ``bfloat16=True``:
    uint16 without the flag is asked whether it holds bfloat16 bits (then pass ``bfloat16=True``), any other dtype
    gets ``fp32_hint``. An array without a dtype passes, for :func:`_check_flash` to refuse."""
    dtype = getattr(q, "dtype", None)
    if dtype is None or bfloat16 or np.dtype(dtype) == np.float16:
        return
    if np.dtype(dtype) == np.uint16:
        raise TypeError(f"{what} got uint16 {names}: pass bfloat16=True if they hold bfloat16 bits (float16 "
                        f"{names} need no flag)")
    raise TypeError(f"{what} takes float16 {names} (or bfloat16 bits with bfloat16=True), got {np.dtype(dtype)}; "
                    f"{fp32_hint}")


def _check_fixed_tile_forward(q, k, v, scale, causal, bfloat16, config) -> _FlashInputs:
    """The checks of the tensor-core forwards whose tiles are fixed per head dim (the FA-2 recipe, the
    Hopper rung): float16 q, k, v (or bfloat16 bits), a head dim ``config`` takes (it raises), then
    :func:`_check_flash`."""
    _check_tensor_core_dtype(q, bfloat16, "use flash_attention_gpu or flash_attention_regtile_gpu for float32")
    if len(getattr(q, "shape", ())) >= 2:
        config(int(q.shape[-1]))                                   # the head dims it takes
    return _check_flash(q, k, v, scale, causal, bfloat16)


def flash_attention_mma_fa2_gpu(q, k, v, *, scale=None, causal: bool = False, bfloat16: bool = False,
                                trace_rows=None, backend: str = "cupy"):
    """The tensor-core forward further along FlashAttention-2's recipe, or its CPU emulation.

    :func:`flash_attention_mma_async_gpu` plus: 128-row query blocks over 8 warps at d = 64
    (64 rows over 4 warps at d = 128) with registers capped so 2 blocks share an SM; Q loaded
    once into registers by ``ldmatrix.x4``; K and V fragments by ``ldmatrix.x4`` (``.trans``
    for V) out of XOR-swizzled, unpadded shared memory; ``exp2`` with ``log2(e)`` folded into
    the scale; P kept in registers as the A operand of ``P V``.

    Parameters
    ----------
    q, k, v : float16 (or bfloat16 bits with ``bfloat16=True``), shaped as for
        :func:`flash_attention_gpu`; head dim d = 64 or 128; any Nq, Nk >= 0.
    scale, causal, bfloat16, trace_rows, backend : as :func:`flash_attention_gpu`.

    Returns ``(out, lse)`` or ``(out, lse, trace)`` as :func:`flash_attention_gpu`. Tiles are
    fixed per d (:func:`lessons.gpu.source.flash_attention_mma_fa2_config`); the trace compares
    with ``lessons.flash_attention(q, k, v, tile=block_k, block_q=block_q, return_trace=True)``.
    Raises TypeError for float32 input, ValueError naming the argument for bad shapes or a
    head dim other than 64 and 128; RuntimeError with backend "cupy" and no CUDA device, or a
    GPU older than compute capability 8.0.
    Source: Dao 2023 (FlashAttention-2), Alg. 1, Sec. 3.1 and 3.3; PTX ISA, mma.m16n8k16, ldmatrix, cp.async, ex2.
    """
    backend = _check_backend(backend)
    f = _check_fixed_tile_forward(q, k, v, scale, causal, bfloat16, flash_attention_mma_fa2_config)
    block_q, block_k, _ = flash_attention_mma_fa2_config(f.d)
    tracing = trace_rows is not None
    rows = _check_rows(trace_rows, "trace_rows", f.n_q) if tracing else []
    build = flash_attention_mma_fa2_build(f.d, f.dtype, tracing)
    run = Runner(backend, f.kind)
    _require_tensor_cores(run)
    return _launch_forward(run, build, "flash_attention_mma_fa2", f,
                           [_aligned(run, run.put(x)) for x in (q, k, v)], block_q, block_k, rows)


def flash_attention_mma_fa2_lazy_gpu(q, k, v, *, scale=None, causal: bool = False, bfloat16: bool = False,
                                     trace_rows=None, backend: str = "cupy", block_q: int | None = None,
                                     block_k: int | None = None, min_blocks: int | None = None):
    """:func:`flash_attention_mma_fa2_gpu` with lazy rescaling and dynamic shared memory, or its CPU emulation.

    The same kernel file built with ``LAZY_RESCALE`` and ``FA2_DYNAMIC_SMEM`` (entry point
    ``flash_attention_mma_fa2_lazy``): each warp skips ``o *= alpha`` on a tile where the running max of
    none of its 16 rows moved (alpha is then exactly 1; a row whose max did not move gets ``1.f``, not
    ``ex2(0)``), so the output is bitwise the FA-2 rung's with the same tiles; and the two K/V stages
    live in dynamic shared memory, so d = 128 can take 64-key tiles (64 KiB) and 128-row blocks.

    Parameters
    ----------
    q, k, v : float16 (or bfloat16 bits with ``bfloat16=True``), shaped as for
        :func:`flash_attention_gpu`; head dim d = 64 or 128; any Nq, Nk >= 0.
    scale, causal, bfloat16, trace_rows, backend : as :func:`flash_attention_gpu`.
    block_q, block_k : query rows per block (64 or 128, 16 per warp) and keys per tile (32 or 64); None:
        the default per d, (128, 64) at d = 64 and (64, 64) at d = 128; otherwise a pair of
        :func:`lessons.gpu.source.flash_attention_mma_fa2_lazy_configs` (the Q tile must fit in one
        K/V stage: ``block_q <= 2 * block_k``).
    min_blocks : blocks per SM promised to the compiler (it caps the registers per thread); None: 2
        where that spills nothing, else 1; otherwise one that
        :func:`lessons.gpu.source.flash_attention_mma_fa2_lazy_configs` lists with the tiles.

    Returns ``(out, lse)`` or ``(out, lse, trace)`` as :func:`flash_attention_gpu`; the trace records m,
    alpha and l per tile as the FA-2 rung's does (alpha 1 where the max did not move) and compares with
    ``lessons.flash_attention(q, k, v, tile=block_k, block_q=block_q, return_trace=True)``.
    Raises TypeError for float32 input or a non-integer (bools included) ``block_q``, ``block_k``,
    ``min_blocks``; ValueError naming the argument for bad shapes, a head dim other than 64 and 128, or
    tiles that are not a legal pair (the message lists the legal ones); RuntimeError with backend "cupy"
    and no CUDA device, or a GPU older than compute capability 8.0.
    Source: Dao 2023 (FlashAttention-2), Alg. 1, Sec. 3.1 and 3.3; lazy rescaling after FlashAttention-4
    (the Blackwell forward of the flash-attention repository, 2025), which keeps a stale max until the
    new one is larger by more than a threshold; here the threshold is 0, so no bit changes.
    """
    return _launch_tiled_fa2(q, k, v, scale, causal, bfloat16, trace_rows, backend, block_q, block_k, min_blocks,
                             flash_attention_mma_fa2_lazy_config, flash_attention_mma_fa2_lazy_build)


def flash_attention_mma_fa2_wide_gpu(q, k, v, *, scale=None, causal: bool = False, bfloat16: bool = False,
                                     trace_rows=None, backend: str = "cupy", block_q: int | None = None,
                                     block_k: int | None = None, min_blocks: int | None = None):
    """:func:`flash_attention_mma_fa2_lazy_gpu` with FlashAttention-2's warp shape: 32 query rows per warp.

    The same kernel file built with ``WARP_ROWS=32`` as well (entry point ``flash_attention_mma_fa2_wide``):
    each warp owns two 16-row m-tiles, so every K and V fragment it loads from shared memory (``ldmatrix``)
    feeds two ``mma`` instructions instead of one, and a block of 128 rows is 4 warps, not 8. Its o and s
    take twice the registers, so Q's fragments are read from shared memory (Q keeps its own region there)
    at each tile instead of staying in registers, as in FlashAttention-2.

    Parameters
    ----------
    q, k, v : float16 (or bfloat16 bits with ``bfloat16=True``), shaped as for
        :func:`flash_attention_gpu`; head dim d = 64 or 128; any Nq, Nk >= 0.
    scale, causal, bfloat16, trace_rows, backend : as :func:`flash_attention_gpu`.
    block_q, block_k, min_blocks : query rows per block (64 or 128, 32 per warp), keys per tile (32 or 64)
        and blocks per SM promised to the compiler; None: (128, 64, 2) at d = 64, (128, 32, 2) at d = 128; otherwise a
        configuration of :func:`lessons.gpu.source.flash_attention_mma_fa2_wide_configs`, with the rules of
        :func:`lessons.gpu.source.flash_attention_mma_fa2_wide_config` for one left None.

    Returns ``(out, lse)`` or ``(out, lse, trace)`` as :func:`flash_attention_gpu`; with the same tiles the
    output is bitwise the lazy rung's (the same products in the same order, only shared by two m-tiles), and
    the trace compares with ``lessons.flash_attention(q, k, v, tile=block_k, block_q=block_q, return_trace=True)``.
    Raises TypeError for float32 input or a non-integer (bools included) ``block_q``, ``block_k``,
    ``min_blocks``; ValueError naming the argument for bad shapes, a head dim other than 64 and 128, or
    tiles that are not legal (the message lists the legal ones); RuntimeError with backend "cupy" and no
    CUDA device, or a GPU older than compute capability 8.0.
    Source: Dao 2023 (FlashAttention-2), Sec. 3.3 (work partitioning between warps); its forward kernel's
    tiles (4 warps, 128 query rows) for sm_90.
    """
    return _launch_tiled_fa2(q, k, v, scale, causal, bfloat16, trace_rows, backend, block_q, block_k, min_blocks,
                             flash_attention_mma_fa2_wide_config, flash_attention_mma_fa2_wide_build)


def flash_attention_mma_fa2_lean_gpu(q, k, v, *, scale=None, causal: bool = False, bfloat16: bool = False,
                                     trace_rows=None, backend: str = "cupy", block_q: int | None = None,
                                     block_k: int | None = None, min_blocks: int | None = None):
    """:func:`flash_attention_mma_fa2_wide_gpu` whose interior key tiles issue only what they need.

    The same kernel file built with ``FA2_LEAN=1`` as well (entry point ``flash_attention_mma_fa2_lean``), in
    two launches:

    1. the pre-pass ``flash_attention_mma_fa2_lean_v_flags`` reads V once and writes one int32 flag per
       (batch * heads, key tile of ``block_k`` keys): 1 where that tile of V holds an inf or NaN;
    2. the main kernel runs the key tiles that need no mask for any row of its query block (inside Nk and,
       causal, wholly at or below the block's first row's diagonal) in a loop compiled without mask code,
       then the rest with the wide rung's masked step; it copies a tile that lies inside Nk with no bounds
       test per chunk, and only a tile whose flag is set rewrites V's inf/NaN and adds their terms back (the
       wide rung tests every chunk of every tile).

    The arithmetic is the wide rung's, so with the same tiles the output (and trace) is bitwise the wide
    rung's. The pre-pass is part of the rung's time.

    Parameters
    ----------
    q, k, v : float16 (or bfloat16 bits with ``bfloat16=True``), shaped as for
        :func:`flash_attention_gpu`; head dim d = 64 or 128; any Nq, Nk >= 0.
    scale, causal, bfloat16, trace_rows, backend : as :func:`flash_attention_gpu`.
    block_q, block_k, min_blocks : as :func:`flash_attention_mma_fa2_wide_gpu` (the same legal configurations,
        :func:`lessons.gpu.source.flash_attention_mma_fa2_lean_configs`); None: (128, 64, 2) at d = 64,
        (128, 32, 2) at d = 128.

    Returns ``(out, lse)`` or ``(out, lse, trace)`` as :func:`flash_attention_gpu`: out like q, lse float32
    (natural log); the trace compares with
    ``lessons.flash_attention(q, k, v, tile=block_k, block_q=block_q, return_trace=True)``.
    Raises TypeError for float32 input or a non-integer (bools included) ``block_q``, ``block_k``,
    ``min_blocks``; ValueError naming the argument for bad shapes, a head dim other than 64 and 128, or
    tiles that are not legal (the message lists the legal ones); RuntimeError with backend "cupy" and no
    CUDA device, or a GPU older than compute capability 8.0.
    Source: Dao 2023 (FlashAttention-2), Sec. 3.1; its forward kernel's main loop, split into the few
    masking steps (``n_masking_steps``) and the rest, with bounds-free copies of even tiles (``Is_even_MN``)
    (flash-attention repository, ``flash_fwd_kernel.h``).
    """
    return _launch_tiled_fa2(q, k, v, scale, causal, bfloat16, trace_rows, backend, block_q, block_k, min_blocks,
                             flash_attention_mma_fa2_lean_config, flash_attention_mma_fa2_lean_build)


def _launch_tiled_fa2(q, k, v, scale, causal, bfloat16, trace_rows, backend, block_q, block_k, min_blocks,
                      config, make_build):
    """The checks and launch shared by the FA-2 builds whose tiles a caller may choose (the lazy and the
    wide-warp rung): ``config`` resolves the tiles (it raises for bad ones), ``make_build`` makes the build."""
    backend = _check_backend(backend)
    f = _check_fixed_tile_forward(q, k, v, scale, causal, bfloat16, config)
    block_q, block_k, min_blocks = config(f.d, block_q, block_k, min_blocks)
    tracing = trace_rows is not None
    rows = _check_rows(trace_rows, "trace_rows", f.n_q) if tracing else []
    build = make_build(f.d, f.dtype, tracing, block_q, block_k, min_blocks)
    run = Runner(backend, f.kind)
    _require_tensor_cores(run)
    qkv = [_aligned(run, run.put(x)) for x in (q, k, v)]
    extra = ()
    if build.kernel == "flash_attention_mma_fa2_lean":
        # the pre-pass: one int32 flag per (batch * heads, key tile), 1 where V's tile holds an inf or NaN
        n_tiles = -(-f.n_k // block_k)
        v_flags = run.xp.zeros(max(1, f.batch_heads * n_tiles), dtype=np.int32)
        run.launch(build, FA2_LEAN_V_FLAGS, (n_tiles, f.batch_heads), [qkv[2], f.n_k, v_flags])
        extra = (v_flags,)
    return _launch_forward(run, build, build.kernel, f, qkv, block_q, block_k, rows, extra)


def flash_attention_wgmma_gpu(q, k, v, *, scale=None, causal: bool = False, bfloat16: bool = False,
                              trace_rows=None, backend: str = "cupy"):
    """The Hopper rung (``kernels/flash_attention_wgmma.cu``), or its CPU emulation.

    One producer warpgroup copies Q once and each K and V tile by TMA (``cp.async.bulk.tensor``,
    a tensor map per input, :mod:`lessons.gpu.hopper`) into a 2-stage pipeline handed over by
    mbarriers; two consumer warpgroups of 64 query rows each compute ``S = Q K^T`` and
    ``O += P V`` with ``wgmma`` (operands read from 128-byte swizzled shared memory, P from
    registers), and fold each tile as :func:`flash_attention_mma_fa2_gpu` does.

    Parameters
    ----------
    q, k, v : float16 (or bfloat16 bits with ``bfloat16=True``), shaped as for
        :func:`flash_attention_gpu`; head dim d = 64 or 128; any Nq, Nk >= 0.
    scale, causal, bfloat16, trace_rows, backend : as :func:`flash_attention_gpu`.

    Returns ``(out, lse)`` or ``(out, lse, trace)`` as :func:`flash_attention_gpu`: out like q,
    lse float32 (natural log). Tiles are fixed per d
    (:func:`lessons.gpu.source.flash_attention_wgmma_config`: 128 query rows, 128-key tiles at
    d = 64, 64-key tiles at d = 128); the trace compares with
    ``lessons.flash_attention(q, k, v, tile=block_k, block_q=128, return_trace=True)``.
    Raises TypeError for float32 input, ValueError naming the argument for bad shapes or a head
    dim other than 64 and 128; RuntimeError with backend "cupy" and no CUDA device, or a GPU
    that is not compute capability 9.0 (the kernel is compiled for sm_90a).
    Source: Shah et al. 2024 (FlashAttention-3), Sec. 3.1; Dao 2023 (FlashAttention-2), Alg. 1;
    PTX ISA 8.x, wgmma.mma_async, cp.async.bulk.tensor, mbarrier.
    """
    return _wgmma_forward(flash_attention_wgmma_build, "flash_attention_wgmma", q, k, v, scale, causal, bfloat16,
                          trace_rows, backend)


def flash_attention_wgmma_overlap_gpu(q, k, v, *, scale=None, causal: bool = False, bfloat16: bool = False,
                                      trace_rows=None, backend: str = "cupy"):
    """The Hopper rung with softmax overlapped with the products
    (``kernels/flash_attention_wgmma_overlap.cu``), or its CPU emulation.

    :func:`flash_attention_wgmma_gpu`'s kernel with each consumer's steps reordered as in
    FlashAttention-3's Algorithm 2: the consumer issues ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}``
    together, waits only for the first, and computes tile j's softmax while the tensor cores do the
    second; 3 K/V stages instead of 2. The arithmetic and its order are the plain rung's, so the
    output is bitwise the same. Arguments, returns, errors and trace as
    :func:`flash_attention_wgmma_gpu`.
    Source: Shah et al. 2024 (FlashAttention-3), Sec. 3.2 and Alg. 2; Dao 2023 (FlashAttention-2), Alg. 1.
    """
    return _wgmma_forward(flash_attention_wgmma_overlap_build, "flash_attention_wgmma_overlap", q, k, v, scale, causal,
                          bfloat16, trace_rows, backend)


def flash_attention_wgmma_pingpong_gpu(q, k, v, *, scale=None, causal: bool = False, bfloat16: bool = False,
                                       trace_rows=None, backend: str = "cupy"):
    """The overlapped Hopper rung with the two consumer warpgroups taking turns on the tensor cores
    (``flash_attention_wgmma_pingpong`` in ``kernels/flash_attention_wgmma_overlap.cu``), or its CPU
    emulation.

    :func:`flash_attention_wgmma_overlap_gpu`'s kernel, where each consumer warpgroup waits for its turn
    (a named barrier, ``bar.sync``) before it issues its products and hands the turn to the other
    (``bar.arrive``) after: one warpgroup's softmax runs while the other's products do. The turns change
    no arithmetic, so the output is bitwise the overlapped rung's. Arguments, returns, errors and trace
    as :func:`flash_attention_wgmma_gpu`.
    Source: Shah et al. 2024 (FlashAttention-3), Sec. 3.1 (pingpong scheduling) and Alg. 2.
    """
    return _wgmma_forward(flash_attention_wgmma_overlap_build, "flash_attention_wgmma_pingpong", q, k, v, scale, causal,
                          bfloat16, trace_rows, backend)


def _wgmma_forward(make_build, entry, q, k, v, scale, causal, bfloat16, trace_rows, backend):
    """The launch the Hopper forwards share: ``make_build(d, dtype, trace)`` picks the kernel file,
    ``entry`` its forward entry point."""
    backend = _check_backend(backend)
    f = _check_fixed_tile_forward(q, k, v, scale, causal, bfloat16, flash_attention_wgmma_config)
    block_q, block_k = flash_attention_wgmma_config(f.d)
    tracing = trace_rows is not None
    rows = _check_rows(trace_rows, "trace_rows", f.n_q) if tracing else []
    build = make_build(f.d, f.dtype, tracing)
    run = Runner(backend, f.kind)
    _require_hopper(run)
    (q3, k3, v3), maps = _tma_operands(run, f.dtype, [(q, f.batch_heads, f.n_q, block_q),
                                                       (k, f.batch_heads, f.n_k, block_k),
                                                       (v, f.batch_heads, f.n_k, block_k)])
    out = run.xp.empty(q3.shape, dtype=q3.dtype)
    lse = run.xp.empty(q3.shape[:-1], dtype=np.float32)
    n_tiles = -(-f.n_k // block_k)
    trace = _trace_buffer(run, (f.batch_heads, len(rows), n_tiles, 3), build.trace)
    run.launch(build, entry, (-(-f.n_q // block_q), f.batch_heads),
               [*maps, v3, out, lse, f.n_q, f.n_k, f.scale, int(f.causal), _rows_buffer(run, rows), len(rows),
                n_tiles, trace])
    shape = (*f.lead, f.n_q, f.d)
    result = (run.get(out.reshape(shape)), run.get(lse.reshape(shape[:-1])))
    if build.trace:
        labels = tuple((*idx, r) for idx in np.ndindex(*f.lead) for r in rows)
        records = run.host(trace).reshape(f.batch_heads * len(rows), n_tiles, 3)
        result += (GpuTrace(labels, records),)
    return result


def wgmma_probe_gpu(a, b, v, *, bfloat16: bool = False, backend: str = "cupy"):
    """The Hopper rung's two products on their own: ``s = a @ b.T`` by ``wgmma`` with both operands
    read from shared memory (as S = Q K^T), then ``o = round16(s) @ v`` with the left operand in
    registers and ``v`` read as an MN-major operand (as O += P V). Every input arrives by TMA with
    the 128-byte swizzle, through the kernel's own descriptors: a check of those layouts on a GPU
    (s right and o wrong points at the MN-major descriptor; s wrong at TMA or the K-major one).

    a : (64, d) float16 (or bfloat16 bits with ``bfloat16=True``); b, v : (block_k, d), the same
    dtype, where d is 64 or 128 and block_k the rung's key tile for that d
    (:func:`lessons.gpu.source.flash_attention_wgmma_config`: 128 at d = 64, 64 at d = 128).
    Returns ``(s, o)``, float32 arrays of shape (64, block_k) and (64, d). Raises ValueError naming
    the argument for other shapes, TypeError for other dtypes, RuntimeError as
    :func:`flash_attention_wgmma_gpu` without a device of compute capability 9.0.
    Source: PTX ISA 8.x, wgmma.mma_async (matrix descriptors, register fragments), cp.async.bulk.tensor.
    """
    backend = _check_backend(backend)
    arrays = {"a": a, "b": b, "v": v}
    kind = _check_arrays(arrays)
    bfloat16 = check_flag(bfloat16, "bfloat16")
    for name, x in arrays.items():
        want = np.uint16 if bfloat16 else np.float16
        if np.dtype(x.dtype) != want:
            raise TypeError(f"{name} must hold float16 (or bfloat16 bits, uint16, with bfloat16=True), "
                            f"got {np.dtype(x.dtype)}")
    dtype = _storage_dtype(arrays, bfloat16)
    if a.ndim != 2 or a.shape[0] != 64:
        raise ValueError(f"a must be (64, d), got shape {a.shape}")
    d = int(a.shape[1])
    _, block_k = flash_attention_wgmma_config(d)
    for name, x in (("b", b), ("v", v)):
        if x.shape != (block_k, d):
            raise ValueError(f"{name} must be ({block_k}, {d}) (the key tile at d = {d}), got shape {x.shape}")
    build = flash_attention_wgmma_build(d, dtype)
    run = Runner(backend, kind)
    _require_hopper(run)
    _, maps = _tma_operands(run, dtype, [(a, 1, 64, 128), (b, 1, block_k, block_k), (v, 1, block_k, block_k)])
    s = run.xp.zeros((64, block_k), dtype=np.float32)
    o = run.xp.zeros((64, d), dtype=np.float32)
    run.launch(build, "wgmma_probe", (1,), [*maps, s, o])
    return run.get(s), run.get(o)


def _require_hopper(run) -> None:
    """RuntimeError on a GPU that is not compute capability 9.0: the Hopper rung is compiled for sm_90a."""
    if run.backend != "cupy":
        return
    cc = int(run.xp.cuda.Device().compute_capability)
    if cc != 90:
        raise RuntimeError(f"the Hopper kernel runs only on compute capability 9.0 (H100, H200): wgmma and TMA "
                           f"are compiled for sm_90a; this GPU is {cc // 10}.{cc % 10}. Use "
                           f"flash_attention_mma_fa2_gpu instead.")


def _tma_operands(run, dtype: str, operands) -> tuple[list, list]:
    """Each ``(x, batch_heads, n, box_rows)`` of ``operands`` where a TMA copy reads it: on ``run``'s
    device, C-contiguous, 128-byte aligned (a swizzled copy wants it), seen as (batch_heads, n, d);
    and its tensor map for boxes of ``box_rows`` rows (the driver's on a GPU, the emulator's on the CPU).
    Returns ``(arrays, maps)``; the arrays must outlive the launch."""
    from lessons.gpu.hopper import device_tensor_map, emulated_tensor_map

    arrays, maps = [], []
    for x, batch_heads, n, box_rows in operands:
        x3 = _aligned(run, run.xp.ascontiguousarray(run.put(x)), 128).reshape(batch_heads, n, x.shape[-1])
        arrays.append(x3)
        maps.append(device_tensor_map(x3, box_rows, dtype) if run.backend == "cupy"
                    else emulated_tensor_map(x3, box_rows))
    return arrays, maps


def _require_tensor_cores(run) -> None:
    """RuntimeError on a GPU older than compute capability 8.0 (no mma.m16n8k16 there)."""
    _require_sm80(run, "the tensor-core kernel", "flash_attention_gpu")


def _require_sm80(run, what: str, instead: str) -> None:
    """RuntimeError naming ``what`` and ``instead`` on a GPU older than compute capability 8.0 (no mma.m16n8k16,
    no cp.async there); nothing on the emulator."""
    if run.backend != "cupy":
        return
    cc = int(run.xp.cuda.Device().compute_capability)
    if cc < 80:
        raise RuntimeError(f"{what} needs a GPU of compute capability 8.0 or newer (A100, H100, "
                           f"H200); this one is {cc // 10}.{cc % 10}. Use {instead} instead.")


def _aligned(run, x, align: int = 16):
    """x itself if its data starts on an ``align``-byte boundary (16: the kernels' vector loads; 128: a
    TMA copy with the 128-byte swizzle), else an aligned copy (CuPy allocates on 256-byte boundaries;
    a NumPy copy is placed on purpose)."""
    ptr = x.ctypes.data if isinstance(x, np.ndarray) else x.data.ptr
    if ptr % align == 0:
        return x
    copy = _numpy_aligned(x, align) if isinstance(x, np.ndarray) else run.xp.empty_like(x)
    copy[...] = x
    return copy


def _numpy_aligned(x: np.ndarray, align: int) -> np.ndarray:
    """An uninitialised C-contiguous NumPy array like ``x`` whose data starts on an ``align``-byte boundary."""
    raw = np.empty(x.nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)


def mma_probe_gpu(a, b, *, bfloat16: bool = False, backend: str = "cupy"):
    """One tensor-core instruction on its own: ``a @ b`` by ``mma.sync.m16n8k16``.

    A check of the fragment layout the tensor-core kernel relies on: each lane loads its
    elements of ``a`` and ``b`` by the PTX ISA layout, one warp multiplies, each lane writes
    its four results back where the layout says they belong.

    Parameters: ``a`` (16, 16) and ``b`` (16, 8), float16 (or bfloat16 bits with
    ``bfloat16=True``), C-contiguous; ``backend`` ``"cupy"`` or ``"emulator"``.
    Returns float32 (16, 8). Raises TypeError/ValueError for other shapes or dtypes.
    Source: PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type".
    """
    backend = _check_backend(backend)
    kind = _check_arrays({"a": a, "b": b})
    dtype = _storage_dtype({"a": a, "b": b}, bfloat16)
    if dtype not in MMA_DTYPES:
        raise TypeError(f"a and b must be float16 (or bfloat16 bits with bfloat16=True), got {dtype}")
    if a.shape != (16, 16) or b.shape != (16, 8):
        raise ValueError(f"a must be (16, 16) and b (16, 8), got {a.shape} and {b.shape}")
    run = Runner(backend, kind)
    _require_tensor_cores(run)
    d = run.xp.zeros((16, 8), dtype=np.float32)
    run.launch(flash_attention_mma_build(16, dtype), "mma_probe", (1,), [run.put(a), run.put(b), d])
    return run.get(d)


# ---------------------------------------------------------------------------
# paged decode with GQA, and flash-decoding
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class SplitTraces:
    """Traces of a flash-decoding launch: ``tiles`` (per page, within each split's own
    state, labelled ``(seq, head)``) and ``merge`` (per split folded in by the merge kernel)."""

    tiles: GpuTrace
    merge: GpuTrace


def _tables_checked(check_tables, backend: str) -> bool:
    """Whether to check the block tables on the host: as ``check_tables`` says on a device, always on the
    emulator, where the tables are on the host already and a bad page would read outside the cache in this
    very process (NaN from a stray page, or a crash of the Python process)."""
    return check_flag(check_tables, "check_tables") or backend == "emulator"


def _check_paged(q, k_cache, v_cache, block_tables, seq_lens, bfloat16, check_tables):
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    kind = _check_arrays({**arrays, "block_tables": block_tables, "seq_lens": seq_lens})
    dtype = _storage_dtype(arrays, bfloat16)
    if q.ndim != 3:
        raise ValueError(f"q must be (num_seqs, num_heads, d), got shape {q.shape}")
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be (num_blocks, block_size, num_kv_heads, d), got shape {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache: k_cache {k_cache.shape}, v_cache {v_cache.shape}")
    num_seqs, num_heads, d = q.shape
    num_blocks, block_size, num_kv_heads, d_cache = k_cache.shape
    if d_cache != d:
        raise ValueError(f"q and k_cache must share the head dim d: q {q.shape}, k_cache {k_cache.shape}")
    if block_size < 1 or num_kv_heads < 1:
        raise ValueError(f"k_cache must hold at least one slot per page (block_size) and one KV head, got shape "
                         f"{k_cache.shape} = (num_blocks, block_size, num_kv_heads, d)")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim d must be in 1..{MAX_HEAD_DIM}, got q shape {q.shape}")
    _check_index_array(block_tables, "block_tables", 2)
    _check_index_array(seq_lens, "seq_lens", 1)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must have one row per sequence: q has {num_seqs} sequences, "
                         f"block_tables has shape {block_tables.shape}")
    if seq_lens.shape != (num_seqs,):
        raise ValueError(f"seq_lens must have shape ({num_seqs},), got {seq_lens.shape}")
    if num_seqs > _GRID_YZ_LIMIT:
        raise ValueError(f"num_seqs must be at most {_GRID_YZ_LIMIT}, got {num_seqs}")
    max_blocks = block_tables.shape[1]
    if check_tables and num_seqs:
        lens = np.asarray(seq_lens if isinstance(seq_lens, np.ndarray) else seq_lens.get())
        tables = np.asarray(block_tables if isinstance(block_tables, np.ndarray) else block_tables.get())
        for s, n in enumerate(lens):
            if not 0 <= n <= max_blocks * block_size:
                raise ValueError(f"seq_lens[{s}] = {n} must be in [0, {max_blocks * block_size}] "
                                 f"(max_blocks_per_seq {max_blocks} x block_size {block_size})")
            used = tables[s, :-(-int(n) // block_size)]
            bad = used[(used < 0) | (used >= num_blocks)]
            if bad.size:
                raise ValueError(f"block_tables[{s}] points at pages {bad.tolist()} outside the cache's "
                                 f"{num_blocks} blocks")
            pages, uses = np.unique(used, return_counts=True)
            if (uses > 1).any():
                raise ValueError(f"block_tables[{s}] names pages {pages[uses > 1].tolist()} for two or more of its "
                                 f"blocks: each block of a sequence needs a page of its own (sequences may share one)")
    return kind, dtype, num_seqs, num_heads, d, block_size, num_kv_heads, max_blocks


def paged_decode_gpu(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, bfloat16: bool = False,
                     trace_rows=None, check_tables: bool = True, backend: str = "cupy"):
    """Decoding attention over a paged KV cache with grouped-query heads, in one pass.

    Parameters
    ----------
    q : (num_seqs, num_heads, d), one new query per sequence and head; float32/float16.
    k_cache, v_cache : (num_blocks, block_size, num_kv_heads, d) pages (vLLM layout), q's dtype;
        ``block_size`` <= 32, ``num_heads`` a multiple of ``num_kv_heads``.
    block_tables : int32 (num_seqs, max_blocks_per_seq): page of each logical block.
    seq_lens : int32 (num_seqs,): tokens per sequence; slots at or past it are never read.
    scale : float, default ``1/sqrt(d)``.
    trace_rows : optional ``(seq, head)`` pairs; one record per page absorbed.
    check_tables : check on the host that seq_lens fit, the used pages exist and no page serves two blocks
        of one sequence (copies them back);
        False skips it on a device (for timing), never on the emulator, where the tables are on the
        host already and a bad page would be read outside the cache by the CPU process itself.
    backend : ``"cupy"`` or ``"emulator"``.

    Returns ``(out, lse)`` or ``(out, lse, trace)``: out (num_seqs, num_heads, d) in q's dtype;
    lse float32 (num_seqs, num_heads), -inf (and out 0) for a sequence of length 0.
    Query head h reads kv head ``h // (num_heads // num_kv_heads)``.
    Raises TypeError/ValueError for bad input, RuntimeError with backend "cupy" and no device.
    Source: Kwon et al. 2023 (PagedAttention), Sec. 4; Ainslie et al. 2023 (GQA); Dao 2023, Alg. 1.
    """
    backend = _check_backend(backend)
    kind, dtype, num_seqs, num_heads, d, block_size, num_kv_heads, max_blocks = _check_paged(
        q, k_cache, v_cache, block_tables, seq_lens, bfloat16, _tables_checked(check_tables, backend))
    scale = _kernel_scale(scale, d)
    tracing = trace_rows is not None
    rows = _check_pairs(trace_rows, num_seqs, num_heads) if tracing else []
    build = paged_decode_build(d, block_size, num_heads, num_kv_heads, dtype, tracing)
    hpb = dict(build.defines)["HEADS_PER_BLOCK"]

    run = Runner(backend, kind)
    args_in = [run.put(x) for x in (q, k_cache, v_cache, block_tables, seq_lens)]
    out = run.xp.empty(q.shape, dtype=q.dtype)
    lse = run.xp.empty((num_seqs, num_heads), dtype=np.float32)
    trace = _trace_buffer(run, (len(rows), max_blocks, 3), tracing)
    run.launch(build, "paged_decode", (num_heads // hpb, num_seqs),
               [*args_in, max_blocks, num_heads, num_kv_heads, scale, out, lse,
                _rows_buffer(run, rows), len(rows), trace])
    result = (run.get(out), run.get(lse))
    if tracing:
        labels = tuple(divmod(r, num_heads) for r in rows)
        result += (GpuTrace(labels, run.host(trace)),)
    return result


def flash_decoding_gpu(q, k_cache, v_cache, block_tables, seq_lens, num_splits: int, *, scale=None,
                       bfloat16: bool = False, trace_rows=None, return_partials: bool = False,
                       check_tables: bool = True, backend: str = "cupy"):
    """Flash-decoding: the paged GQA decode split over the keys, then the partial states merged.

    Arguments as :func:`paged_decode_gpu`, plus ``num_splits`` (int, 1..65535): each
    (sequence, head group) is handled by ``num_splits`` blocks, split ``s`` taking pages
    ``[s * per, (s + 1) * per)`` with ``per = ceil(pages / num_splits)``; splits past the end are
    empty and contribute nothing. ``merge_splits`` then folds the partial states in split order.

    Returns ``(out, lse[, partials][, traces])``: as paged_decode_gpu; ``partials`` (with
    ``return_partials``) a dict of float32 ``m``, ``l`` (num_seqs, num_heads, num_splits) and
    ``o`` (..., num_splits, d), unnormalised; ``traces`` a :class:`SplitTraces`.
    Raises TypeError/ValueError for bad input, RuntimeError with backend "cupy" and no device.
    Source: Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference".
    """
    backend = _check_backend(backend)
    kind, dtype, num_seqs, num_heads, d, block_size, num_kv_heads, max_blocks = _check_paged(
        q, k_cache, v_cache, block_tables, seq_lens, bfloat16, _tables_checked(check_tables, backend))
    num_splits = check_int(num_splits, "num_splits")
    if not 1 <= num_splits <= _GRID_YZ_LIMIT:
        raise ValueError(f"num_splits must be in 1..{_GRID_YZ_LIMIT}, got {num_splits}")
    scale = _kernel_scale(scale, d)
    return_partials = check_flag(return_partials, "return_partials")
    tracing = trace_rows is not None
    rows = _check_pairs(trace_rows, num_seqs, num_heads) if tracing else []
    build = paged_decode_build(d, block_size, num_heads, num_kv_heads, dtype, tracing)
    hpb = dict(build.defines)["HEADS_PER_BLOCK"]

    run = Runner(backend, kind)
    args_in = [run.put(x) for x in (q, k_cache, v_cache, block_tables, seq_lens)]
    part_m = run.xp.empty((num_seqs, num_heads, num_splits), dtype=np.float32)
    part_l = run.xp.empty((num_seqs, num_heads, num_splits), dtype=np.float32)
    part_o = run.xp.empty((num_seqs, num_heads, num_splits, d), dtype=np.float32)
    out = run.xp.empty(q.shape, dtype=q.dtype)
    lse = run.xp.empty((num_seqs, num_heads), dtype=np.float32)
    rows_d = _rows_buffer(run, rows)
    tile_trace = _trace_buffer(run, (len(rows), max_blocks, 3), tracing)
    merge_trace = _trace_buffer(run, (len(rows), num_splits, 3), tracing)
    run.launch(build, "paged_decode_split", (num_heads // hpb, num_seqs, num_splits),
               [*args_in, max_blocks, num_heads, num_kv_heads, scale, num_splits, part_m, part_l, part_o,
                rows_d, len(rows), tile_trace])
    run.launch(build, "merge_splits", (num_heads, num_seqs),
               [part_m, part_l, part_o, num_heads, num_splits, out, lse, rows_d, len(rows), merge_trace])
    result = (run.get(out), run.get(lse))
    if return_partials:
        result += ({"m": run.get(part_m), "l": run.get(part_l), "o": run.get(part_o)},)
    if tracing:
        labels = tuple(divmod(r, num_heads) for r in rows)
        result += (SplitTraces(GpuTrace(labels, run.host(tile_trace)),
                               GpuTrace(labels, run.host(merge_trace), unit="split")),)
    return result


def _num_sms(run) -> int:
    """Streaming multiprocessors of the device the runner launches on (the H200's 132 on the emulator)."""
    from lessons.gpu.source import H200_NUM_SMS

    if run.backend != "cupy":
        return H200_NUM_SMS
    from lessons.gpu.compile import _device_properties

    return int(_device_properties()["multiProcessorCount"])      # asked once per process


def paged_decode_split_gpu(q, k_cache, v_cache, block_tables, seq_lens, num_splits: int | None = None, *,
                           scale=None, bfloat16: bool = False, return_partials: bool = False,
                           check_tables: bool = True, prefetch: bool = False, cp_async: bool = False,
                           backend: str = "cupy"):
    """Paged GQA decode at memory speed: one block per (sequence, GQA group, split), 16-byte loads.

    Arguments as :func:`flash_decoding_gpu` (q (num_seqs, num_heads, d); k_cache, v_cache
    (num_blocks, block_size, num_kv_heads, d) in q's dtype, float32/float16, or bfloat16 bits with
    ``bfloat16=True``; int32 block_tables (num_seqs, max_blocks_per_seq) and seq_lens (num_seqs,)),
    except:

    num_splits : int in 1..65535, or None (default) to pick it from the shape with
        :func:`lessons.gpu.source.decode_splits` (the device's SM count, 4 blocks per SM; the
        table width ``max_blocks_per_seq`` stands for the longest sequence, so no copy to the host).
        Split ``s`` takes pages ``[s * per, (s + 1) * per)``, ``per = ceil(pages / num_splits)``,
        as flash_decoding_gpu's; with one split and no ``return_partials`` the block writes the
        output itself and no merge kernel runs.
    prefetch : bool (default False). True runs the ``paged_decode_prefetch`` rung: each lane group issues
        its next step's K and V loads before it absorbs this step's keys (software pipelining in
        registers), built for 3 blocks per SM instead of 4 (:data:`lessons.gpu.source.DECODE_BLOCKS_PER_SM`),
        and the automatic split count fills that wave. Output and lse bitwise those of ``prefetch=False``
        with the same ``num_splits``.
    cp_async : bool (default False). True runs the ``paged_decode_cp_async`` rung: each thread copies its
        16-byte pieces of K and V straight into a ring of :data:`lessons.gpu.source.DECODE_ASYNC_STAGES` steps
        in shared memory (cp.async), two steps ahead of the one it absorbs, so the rows in flight hold no
        registers and 4 blocks fit on an SM of an H100 / H200. Needs compute capability 8.0+ and a head dim
        that is a whole number of 16-byte pieces. Output and lse bitwise those of the plain build. At most
        one of ``prefetch`` and ``cp_async``.
    No ``trace_rows``: the keys of a split are spread over the block's warps, so there is no
    page-by-page state to record (flash_decoding_gpu has the traced version of this schedule).

    Each block serves up to 4 query heads of one group (all 4 at 32 query heads on 8 KV heads), so
    each K/V row is read from HBM once per group; a key row is read by ``lanes`` lanes 16 bytes
    each (:func:`lessons.gpu.source.paged_decode_split_layout`). Returns ``(out, lse)`` or
    ``(out, lse, partials)`` like flash_decoding_gpu: out (num_seqs, num_heads, d) in q's dtype,
    lse float32 (num_seqs, num_heads), 0 and -inf for an empty sequence; partials float32 ``m``,
    ``l`` (num_seqs, num_heads, num_splits) and ``o`` (..., num_splits, d), unnormalised.
    Raises TypeError/ValueError for bad input, RuntimeError with backend "cupy" and no device.
    Source: Dao, Haziza, Massa, Sizov 2023 (Flash-Decoding); Kwon et al. 2023 (PagedAttention),
    Sec. 4; Ainslie et al. 2023 (GQA); the fold of Dao 2023, FA-2 Alg. 1.
    """
    from lessons.gpu.source import paged_decode_split_auto_splits, paged_decode_split_build

    backend = _check_backend(backend)
    kind, dtype, num_seqs, num_heads, d, block_size, num_kv_heads, max_blocks = _check_paged(
        q, k_cache, v_cache, block_tables, seq_lens, bfloat16, _tables_checked(check_tables, backend))
    if num_splits is not None:
        num_splits = check_int(num_splits, "num_splits")
        if not 1 <= num_splits <= _GRID_YZ_LIMIT:
            raise ValueError(f"num_splits must be in 1..{_GRID_YZ_LIMIT} or None (auto), got {num_splits}")
    scale = _kernel_scale(scale, d)
    return_partials = check_flag(return_partials, "return_partials")
    prefetch, cp_async = check_flag(prefetch, "prefetch"), check_flag(cp_async, "cp_async")
    build = paged_decode_split_build(d, block_size, num_heads, num_kv_heads, dtype, prefetch, cp_async)
    hpb = dict(build.defines)["HEADS_PER_BLOCK"]

    run = Runner(backend, kind)
    if cp_async:
        _require_sm80(run, "the cp.async decode kernel", "paged_decode_split_gpu without cp_async")
    if num_splits is None:                 # (at most decode_splits' 65535 = _GRID_YZ_LIMIT)
        num_splits = paged_decode_split_auto_splits(num_seqs, max_blocks * block_size, d, block_size, num_heads,
                                                    num_kv_heads, num_sms=_num_sms(run), prefetch=prefetch,
                                                    cp_async=cp_async)
    q_d, k_d, v_d = (_aligned(run, run.put(x)) for x in (q, k_cache, v_cache))   # 16-byte loads
    tables_d, lens_d = run.put(block_tables), run.put(seq_lens)
    out = run.xp.empty(q.shape, dtype=q.dtype)
    lse = run.xp.empty((num_seqs, num_heads), dtype=np.float32)
    partials = num_splits > 1 or return_partials
    n_states = (num_seqs, num_heads, num_splits) if partials else (1,)
    part_m = run.xp.empty(n_states, dtype=np.float32)
    part_l = run.xp.empty(n_states, dtype=np.float32)
    part_o = run.xp.empty(n_states + ((d,) if partials else ()), dtype=np.float32)
    run.launch(build, "paged_decode_gqa_split", (num_heads // hpb, num_seqs, num_splits),
               [q_d, k_d, v_d, tables_d, lens_d, max_blocks, num_heads, num_kv_heads, scale, num_splits,
                int(partials), part_m, part_l, part_o, out, lse])
    if partials:
        run.launch(build, "merge_split_states", (num_heads, num_seqs),
                   [part_m, part_l, part_o, num_heads, num_splits, out, lse])
    result = (run.get(out), run.get(lse))
    if return_partials:
        result += ({"m": run.get(part_m), "l": run.get(part_l), "o": run.get(part_o)},)
    return result


def open_device(use_device):
    """(a :class:`Runner` on the CUDA device, or None; why not in words, or None): how the notebooks'
    "On the GPU" sections (:mod:`lessons.gpu.harness`) find the device. ``use_device``: None (use one when
    there is one) or False (never); True is the same as None; anything else is a TypeError."""
    if check_flag(use_device, "use_device", none=True) is False:
        return None, "the GPU was not used (use_device=False)"
    if not device_available():
        try:
            import cupy  # noqa: F401
        except ImportError:
            return None, "CuPy is not installed (pip install cupy-cuda12x), so no CUDA device can be used"
        return None, "no CUDA device"
    try:
        return Runner("cupy"), None
    except Exception as err:  # a broken driver or CuPy install
        return None, f"the CUDA device could not be opened ({type(err).__name__}: {err})"


def kernel_row_trace(q, k, v, tile, row, *, causal=False, block_q=64, scale=None, use_device=None):
    """The forward kernel's own trace of one query row, for ``TileStepper(kernel=kernel_row_trace)``.

    ``q`` (Nq, d), ``k``, ``v`` (Nk, d): float (computed in float32); ``tile``: keys per tile (the kernel's
    ``block_k``); ``row``: the row traced; ``causal``, ``block_q``, ``scale``: as :func:`lessons.flash_attention`.
    Without causal masking the trace does not depend on ``block_q``, so when the kernel cannot take it
    with ``block_k = tile`` another is tried; with it, give the stepper's (lesson 3's
    ``block_schedule(16)``: ``functools.partial(kernel_row_trace, block_q=16)``). Runs the trace build on
    the GPU when there is one (and ``use_device`` is not False), else on the emulator. Returns ``(where,
    gpu_row)``: ``"GPU (<name>)"`` or ``"emulator"``, and a :class:`lessons.gpu.GpuRowTrace`. ValueError
    for q, k, v not 2-D, a q without rows, a ``row`` outside ``[0, Nq)``, a ``tile`` or ``block_q`` below 1
    or a ``tile`` no ``block_q`` takes; TypeError for a non-int ``tile``, ``row`` or ``block_q`` or
    non-float q, k, v; RuntimeError when neither a GPU nor
    a C++ compiler for the emulator is there. Source: Dao 2023 (FlashAttention-2), Alg. 1.
    """
    q, k, v = (np.ascontiguousarray(as_float_array(x, name, (2,)), dtype=np.float32)
               for x, name in ((q, "q"), (k, "k"), (v, "v")))
    if q.shape[0] == 0:
        raise ValueError(f"q must hold at least one query row to trace, got shape {q.shape}")
    tile, row = check_positive_int(tile, "tile"), check_int(row, "row", min=0, max=q.shape[0] - 1)
    block_q = check_positive_int(block_q, "block_q")
    config, why = None, None
    for bq in [block_q] + ([] if causal else [b for b in (128, 64, 32, 16, 8, 4) if b != block_q]):
        try:
            config = flash_attention_config(q.shape[1], bq, tile)
            break
        except ValueError as err:
            why = why or err
    if config is None:
        raise ValueError(f"the kernel cannot take tile={tile} keys with d={q.shape[1]}"
                         f"{' and block_q=' + str(block_q) if causal else ''}: {why}")
    device, _ = open_device(use_device)
    if device is None and not emulator_available():
        raise RuntimeError("no CUDA device and no C++ compiler (g++) for the emulator")
    runner = device or Runner("emulator")
    out = runner.kernel(flash_attention_gpu)(*(runner.put(x) for x in (q, k, v)), scale=scale, causal=causal,
                                             block_q=config[0], block_k=config[1], trace_rows=[row])
    return (f"GPU ({device.name})" if device is not None else "emulator"), out[2].row(row)
