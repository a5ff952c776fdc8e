"""The Hopper rungs' plumbing: tensor maps for their TMA copies, the pipeline their mbarriers order,
and the order of one consumer's products and softmax (plain, or softmax overlapped with wgmma).

A Hopper TMA copy names a tensor map and the coordinates of a box; the map says where the
tensor lies, its sizes and strides, the box's shape and how to swizzle it into shared memory.
On a GPU the map is 128 opaque bytes made by the CUDA driver (``cuTensorMapEncodeTiled``) and
passed to the kernel by value. On the CPU emulator it is 16 words in the emulator's own format,
which ``kernels/hopper.cuh`` reads (data address, sizes, strides, box, element size, swizzle).

Every map here is the same kind: a (batch*heads, n, d) tensor of 16-bit values, C-contiguous, seen
as 3-D (d, n, batch*heads) innermost first, a box of 64 columns x ``box_rows`` rows x 1 head, the
128-byte swizzle. Rows past ``n`` read as zeros, within each head.

Source: CUDA driver API, ``cuTensorMapEncodeTiled``; PTX ISA 8.x, ``cp.async.bulk.tensor``.
"""
from __future__ import annotations

import ctypes
import math
import numbers
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from lessons.core.checks import check_flag, check_int

__all__ = ["BOX_COLUMNS", "emulated_tensor_map", "device_tensor_map", "PipelineEvent", "pipeline_schedule",
           "OVERLAP_UNITS", "OverlapEvent", "overlap_schedule"]

#: columns of every box: 64 16-bit values, the 128 bytes of one swizzled row
BOX_COLUMNS = 64
#: CUtensorMapDataType (cuda.h) of the storage dtypes
_DATA_TYPE = {"float16": 6, "bfloat16": 9}
_SWIZZLE_128B = 3                   # CU_TENSOR_MAP_SWIZZLE_128B
_INTERLEAVE_NONE = 0
_L2_PROMOTION_128B = 2
_OOB_FILL_ZEROS = 0                 # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: zeros past the edge


def _check(x, name: str, box_rows) -> tuple[int, int, int]:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 3:
        raise ValueError(f"{name} must be a 3-D (batch*heads, n, d) array, got shape {shape}")
    bh, n, d = (int(s) for s in shape)
    if d < BOX_COLUMNS or d % BOX_COLUMNS:
        raise ValueError(f"{name} must have a head dim that is a positive multiple of {BOX_COLUMNS}, got {d}")
    if np.dtype(x.dtype).itemsize != 2:
        raise TypeError(f"{name} must hold 16-bit values, got {np.dtype(x.dtype)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (a tensor map describes one dense layout)")
    check_int(box_rows, "box_rows", min=1, max=256)
    return bh, n, d


def emulated_tensor_map(x: np.ndarray, box_rows: int) -> np.ndarray:
    """The emulator's tensor map of ``x``, a C-contiguous (batch*heads, n, d) NumPy array of 16-bit
    values (d a multiple of 64), for boxes of 64 x ``box_rows`` x 1 with the 128-byte swizzle.

    Returns 16 uint64 words: the data's address, the sizes (d, n, batch*heads), the strides of
    dims 1 and 2 in bytes, the box, the element size (2) and the swizzle (128 bytes). ``x`` must
    outlive the launch that uses the map. ValueError/TypeError naming the argument for bad input."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a NumPy array (the emulator's memory), got {type(x).__name__}")
    bh, n, d = _check(x, "x", box_rows)
    words = np.zeros(16, dtype=np.uint64)
    words[0] = x.ctypes.data
    words[1:4] = (d, n, bh)
    words[4:6] = (2 * d, 2 * d * n)
    words[6] = BOX_COLUMNS | (box_rows << 16) | (1 << 32)
    words[7] = 2
    words[8] = 128
    return words


@lru_cache(maxsize=1)
def _encode():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


class DeviceTensorMap:
    """A tensor map made by the CUDA driver, ready to pass to a CuPy kernel by value
    (:attr:`arg`, a ``cupy.cuda.function.CPointer`` to its 128 bytes, which this object keeps)."""

    def __init__(self, raw: np.ndarray, offset: int, keep):
        self._raw, self._keep = raw, keep        # the bytes (64-byte aligned at offset) and the data
        from cupy.cuda.function import CPointer

        self.arg = CPointer(raw.ctypes.data + offset)


def device_tensor_map(x, box_rows: int, dtype: str) -> DeviceTensorMap:
    """The driver's tensor map of ``x``, a C-contiguous (batch*heads, n, d) CuPy array of 16-bit
    values (``dtype`` ``'float16'`` or ``'bfloat16'``), for boxes of 64 x ``box_rows`` x 1 with the
    128-byte swizzle and zeros past the edge. An empty ``x`` gets a map of one row of zeros (a
    kernel never reads it). RuntimeError with the driver's error code when the driver refuses."""
    import cupy

    bh, n, d = _check(x, "x", box_rows)
    if dtype not in _DATA_TYPE:
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    if x.size == 0:
        x = cupy.zeros((1, 1, d), dtype=x.dtype)
        bh, n = 1, 1
    raw = np.zeros(128 + 64, dtype=np.uint8)
    offset = (-raw.ctypes.data) % 64              # the driver writes a 64-byte aligned CUtensorMap
    dims = (ctypes.c_uint64 * 3)(d, n, bh)
    strides = (ctypes.c_uint64 * 2)(2 * d, 2 * d * n)
    box = (ctypes.c_uint32 * 3)(BOX_COLUMNS, box_rows, 1)
    steps = (ctypes.c_uint32 * 3)(1, 1, 1)
    err = _encode()(raw.ctypes.data + offset, _DATA_TYPE[dtype], 3, x.data.ptr, dims, strides, box, steps,
                    _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_128B, _OOB_FILL_ZEROS)
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled refused the tensor map of a {tuple(x.shape)} array "
                           f"(CUresult {err})")
    return DeviceTensorMap(raw, offset, x)


#: the most key tiles the pipeline models take (a sequence of 1M keys in 64-key tiles is 16384)
MAX_MODEL_TILES = 1 << 16


def _check_time(value, name: str) -> float:
    """A positive finite real number (NumPy numbers too) as a float; TypeError/ValueError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------------
# the producer/consumer pipeline, as the mbarriers order it
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineEvent:
    """One bar of the pipeline: ``who`` (``"producer"``: the TMA copy of a tile's K and V;
    ``"consumers"``: S = Q K^T, the softmax step and O += P V on that tile), ``tile``, the
    ``stage`` (shared-memory slot) it occupies, ``start`` and ``end`` (model time units)."""

    who: str
    tile: int
    stage: int
    start: float
    end: float


def pipeline_schedule(n_tiles: int, stages: int = 2, load_time: float = 1.0,
                      compute_time: float = 1.0) -> list[PipelineEvent]:
    """The order that the ``full`` and ``empty`` mbarriers of ``flash_attention_wgmma.cu`` impose
    on the copies and the work, in a model where every tile's copy takes ``load_time`` and the
    consumers' work on a tile ``compute_time`` (any unit, e.g. microseconds), one copy and one
    tile of work at a time:

    * the copy of tile j waits for the copy of tile j - 1 (one copy engine) and for stage
      ``j % stages`` to be empty: the consumers have finished tile ``j - stages``;
    * the work on tile j waits for its copy to land (``full``) and for the work on tile j - 1.

    Returns the ``2 * n_tiles`` events, copies and work of each tile in turn. With one stage
    nothing overlaps (``n_tiles * (load_time + compute_time)``); with two, each copy hides behind
    the previous tile's work (``load_time + n_tiles * max(load_time, compute_time)`` when the two
    times are equal or the work is the longer). TypeError/ValueError naming the argument for a
    non-int, negative or over :data:`MAX_MODEL_TILES` ``n_tiles``, ``stages`` < 1 or a time that is not a positive number.
    Source: Shah et al. 2024 (FlashAttention-3), Sec. 3.1 (producer-consumer with a circular buffer)."""
    n_tiles = check_int(n_tiles, "n_tiles", min=0, max=MAX_MODEL_TILES)
    stages = check_int(stages, "stages", min=1)
    load_time, compute_time = (_check_time(value, name) for name, value in (("load_time", load_time),
                                                                            ("compute_time", compute_time)))
    if not math.isfinite(n_tiles * (load_time + compute_time)):
        raise ValueError(f"n_tiles * (load_time + compute_time) must be finite, got n_tiles={n_tiles}, "
                         f"load_time={load_time}, compute_time={compute_time}")
    load_end, work_end, events = [], [], []
    for j in range(n_tiles):
        start = max(load_end[j - 1] if j else 0.0, work_end[j - stages] if j >= stages else 0.0)
        load_end.append(start + load_time)
        events.append(PipelineEvent("producer", j, j % stages, start, load_end[j]))
        begin = max(load_end[j], work_end[j - 1] if j else 0.0)
        work_end.append(begin + compute_time)
        events.append(PipelineEvent("consumers", j, j % stages, begin, work_end[j]))
    return events


# ---------------------------------------------------------------------------
# one consumer's products and softmax: the plain order and FlashAttention-3's overlapped one
# ---------------------------------------------------------------------------

#: where each step runs: the products on the tensor cores, the softmax on the CUDA cores
OVERLAP_UNITS = {"S": "tensor cores", "softmax": "CUDA cores", "PV": "tensor cores"}


@dataclass(frozen=True)
class OverlapEvent:
    """One step of one consumer warpgroup on one key tile: ``step`` ``"S"`` (S_j = Q K_j^T, on the
    tensor cores), ``"softmax"`` (m, alpha, P_j = exp2(S_j - m) and the row sums l, on the CUDA cores)
    or ``"PV"`` (O += P_j V_j, on the tensor cores); the ``tile`` j, ``start`` and ``end`` (model time
    units). :attr:`unit` says where it runs and :attr:`label` names it (``"S0"``, ``"softmax0"``,
    ``"P0V0"``)."""

    step: str
    tile: int
    start: float
    end: float

    @property
    def unit(self) -> str:
        return OVERLAP_UNITS[self.step]

    @property
    def label(self) -> str:
        return f"P{self.tile}V{self.tile}" if self.step == "PV" else f"{self.step}{self.tile}"


def overlap_schedule(n_tiles: int, *, qk: float = 1.0, softmax: float = 1.0, pv: float = 1.0,
                     overlap: bool) -> list[OverlapEvent]:
    """When one consumer warpgroup's steps run, for ``n_tiles`` key tiles, in the model where
    S_j = Q K_j^T takes ``qk``, the softmax of a tile ``softmax`` and O += P_j V_j ``pv`` (any unit).
    The tensor cores run one product at a time, in the order they were issued; the consumer's threads
    issue products, then wait for them (``wgmma.wait_group``), and compute the softmax themselves.

    * ``overlap=False`` (``flash_attention_wgmma.cu``): per tile, S_j, wait, softmax_j, P_j V_j, wait.
      Nothing overlaps: ``n_tiles * (qk + softmax + pv)``.
    * ``overlap=True`` (``flash_attention_wgmma_overlap.cu``, FlashAttention-3 Alg. 2): S_0, wait,
      softmax_0; then for j = 1 .. n_tiles - 1 the consumer issues S_j and P_{j-1} V_{j-1}, waits for S_j
      only and computes softmax_j while P_{j-1} V_{j-1} is on the tensor cores, then waits for that
      product; the last P V comes at the end. Each tile after the first costs ``qk + max(softmax, pv)``
      instead of ``qk + softmax + pv``: ``qk + softmax + (n_tiles - 1) * (qk + max(softmax, pv)) + pv``.

    Returns the ``3 * n_tiles`` events (S, softmax, PV of each tile in turn); the makespan is the
    largest ``end``. The model leaves out the rescale O = alpha O, the copies (the producer's, as
    :func:`pipeline_schedule`) and the other consumer. TypeError/ValueError naming the argument for a
    non-int, negative or over :data:`MAX_MODEL_TILES` ``n_tiles``, a time that is not a positive finite number, or an ``overlap`` that
    is not a bool. Source: Shah et al. 2024 (FlashAttention-3), Sec. 3.2 and Alg. 2."""
    n_tiles = check_int(n_tiles, "n_tiles", min=0, max=MAX_MODEL_TILES)
    qk, softmax, pv = (_check_time(value, name) for name, value in (("qk", qk), ("softmax", softmax), ("pv", pv)))
    overlap = check_flag(overlap, "overlap")
    if not math.isfinite(n_tiles * (qk + softmax + pv)):
        raise ValueError(f"n_tiles * (qk + softmax + pv) must be finite, got n_tiles={n_tiles}, qk={qk}, "
                         f"softmax={softmax}, pv={pv}")
    events: list[OverlapEvent] = []
    tensor_free = 0.0                               # when the tensor cores finish what was issued so far

    def product(step: str, tile: int, issued: float, time: float) -> OverlapEvent:
        nonlocal tensor_free                        # a product starts once issued and the one before it is done
        start = max(issued, tensor_free)
        e = OverlapEvent(step, tile, start, start + time)
        tensor_free = e.end
        events.append(e)
        return e

    def exp_step(tile: int, start: float) -> OverlapEvent:
        e = OverlapEvent("softmax", tile, start, start + softmax)
        events.append(e)
        return e

    if not overlap:
        now = 0.0                                   # the consumer's threads: issue, wait, compute
        for j in range(n_tiles):
            s = product("S", j, now, qk)
            sm = exp_step(j, s.end)                 # wait_group 0: S_j done
            now = product("PV", j, sm.end, pv).end  # wait_group 0: P_j V_j done
        return events
    if n_tiles == 0:
        return events
    s = product("S", 0, 0.0, qk)
    now = exp_step(0, s.end).end                    # tile 0: nothing to overlap with
    for j in range(1, n_tiles):
        s = product("S", j, now, qk)                # commit group 1
        pv_prev = product("PV", j - 1, now, pv)     # commit group 2, runs after S_j
        sm = exp_step(j, s.end)                     # wait_group 1: S_j done, P_{j-1} V_{j-1} may still run
        now = max(sm.end, pv_prev.end)              # wait_group 0
    product("PV", n_tiles - 1, now, pv)
    events.sort(key=lambda e: (e.tile, ("S", "softmax", "PV").index(e.step)))
    return events
