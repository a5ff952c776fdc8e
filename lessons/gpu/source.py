"""CUDA C sources of the kernels, and the compile-time configuration of each.

The ``.cu`` files in ``lessons/gpu/kernels/`` are package data. :func:`kernel_source`
returns one of them with ``#include "common.cuh"`` pasted in (with ``#line``
directives, so compiler messages still name the right file and line), which lets
NVRTC compile it with no include path and no CUDA headers.

Every kernel is specialised at compile time (``-D`` options): the head dim, the tile
sizes and the storage dtype are constants, so loops unroll and the state ``o`` stays
in registers. The functions here choose those constants and compute the static
shared memory they imply, in bytes, so the launcher can refuse a configuration
that would not fit before asking the compiler.
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from lessons.core.checks import check_flag, check_int

__all__ = [
    "KERNEL_DIR", "KERNELS", "DTYPES", "STATIC_SMEM_LIMIT", "NUM_THREADS", "MAX_HEAD_DIM",
    "KernelBuild", "kernel_source", "flash_attention_config", "flash_attention_smem_bytes",
    "MMA_BLOCK_Q", "flash_attention_mma_config", "flash_attention_mma_smem_bytes", "flash_attention_mma_build",
    "paged_decode_config", "paged_decode_smem_bytes", "online_softmax_smem_bytes", "default_builds",
    "MAX_BACKWARD_HEAD_DIM", "flash_attention_backward_config", "flash_attention_backward_smem_bytes",
    "flash_attention_backward_build",
    "REGTILE_TILES", "REGTILE_DYNAMIC_LIMIT", "REGTILE_SWEEP", "flash_attention_regtile_config", "flash_attention_regtile_smem_bytes",
    "flash_attention_regtile_build", "REGTILE_LANES", "regtile_legal_tiles", "REGTILE_WIDE_TILES", "REGTILE_WIDE_SWEEP", "flash_attention_regtile_wide_config",
    "flash_attention_regtile_wide_build", "flash_attention_mma_async_config", "flash_attention_mma_async_build",
    "BACKWARD_MMA_HEAD_DIMS", "flash_attention_backward_mma_config", "flash_attention_backward_mma_smem_bytes",
    "flash_attention_backward_mma_build",
    "FA2_CONFIGS", "flash_attention_mma_fa2_config", "flash_attention_mma_fa2_smem_bytes",
    "flash_attention_mma_fa2_build", "fa2_swizzle",
    "FA2_LAZY_CONFIGS", "FA2_LAZY_SWEEP", "flash_attention_mma_fa2_lazy_configs", "flash_attention_mma_fa2_lazy_config",
    "flash_attention_mma_fa2_lazy_build", "KERNEL_FILES", "kernel_file",
    "FA2_WIDE_CONFIGS", "FA2_WIDE_SWEEP", "flash_attention_mma_fa2_wide_configs", "flash_attention_mma_fa2_wide_config",
    "flash_attention_mma_fa2_wide_smem_bytes", "flash_attention_mma_fa2_wide_build",
    "FA2_LEAN_CONFIGS", "FA2_LEAN_SWEEP", "flash_attention_mma_fa2_lean_configs", "flash_attention_mma_fa2_lean_config",
    "flash_attention_mma_fa2_lean_build", "FA2_LEAN_V_FLAGS",
    "WGMMA_CONFIGS", "WGMMA_ARCH", "flash_attention_wgmma_config", "flash_attention_wgmma_smem_bytes",
    "flash_attention_wgmma_build", "wgmma_swizzle", "WGMMA_KERNELS", "WGMMA_OVERLAP_STAGES",
    "flash_attention_wgmma_overlap_build",
    "MAX_SPLIT_HEADS_PER_BLOCK", "paged_decode_split_layout", "paged_decode_split_smem_bytes",
    "paged_decode_split_config", "paged_decode_split_build", "DECODE_BLOCKS_PER_SM", "DECODE_ASYNC_STAGES",
    "DECODE_ASYNC_BLOCKS_PER_SM", "paged_decode_split_auto_splits", "paged_decode_split_blocks_per_sm",
    "decode_splits", "decode_split_cost", "decode_split_terms", "decode_split_sweep", "cheaper_than_pick", "H200_NUM_SMS",
]

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

#: kernel -> the ``extern "C"`` entry points it defines; a kernel is a file of ``KERNEL_DIR`` (``<kernel>.cu``),
#: or another build of one (:data:`KERNEL_FILES`)
KERNELS = {
    "online_softmax": ("online_softmax",),
    "flash_attention": ("flash_attention_forward",),
    "flash_attention_mma": ("flash_attention_mma", "mma_probe"),
    "flash_attention_regtile": ("flash_attention_regtile",),
    "flash_attention_regtile_wide": ("flash_attention_regtile_wide",),
    "flash_attention_mma_async": ("flash_attention_mma_async",),
    "flash_attention_mma_fa2": ("flash_attention_mma_fa2",),
    "flash_attention_mma_fa2_lazy": ("flash_attention_mma_fa2_lazy",),
    "flash_attention_mma_fa2_wide": ("flash_attention_mma_fa2_wide",),
    "flash_attention_mma_fa2_lean": ("flash_attention_mma_fa2_lean", "flash_attention_mma_fa2_lean_v_flags"),
    "flash_attention_wgmma": ("flash_attention_wgmma", "wgmma_probe"),
    "flash_attention_wgmma_overlap": ("flash_attention_wgmma_overlap", "flash_attention_wgmma_pingpong"),
    "paged_decode": ("paged_decode", "paged_decode_split", "merge_splits"),
    "paged_decode_split": ("paged_decode_gqa_split", "merge_split_states"),
    "flash_attention_backward": ("flash_attention_backward_preprocess", "flash_attention_backward_dkdv",
                                 "flash_attention_backward_dq"),
    "flash_attention_backward_mma": ("flash_attention_backward_mma_dkdv", "flash_attention_backward_mma_dq"),
}

#: kernel -> the file it is compiled from, where that is not ``<kernel>.cu``: the lazy-rescaling rung is
#: ``flash_attention_mma_fa2.cu`` with ``LAZY_RESCALE`` and ``FA2_DYNAMIC_SMEM`` set (its entry point is
#: then named ``flash_attention_mma_fa2_lazy``), the wide-warp rung the same with ``WARP_ROWS=32`` as well
#: (entry point ``flash_attention_mma_fa2_wide``), the lean rung that with ``FA2_LEAN=1`` as well (entry points
#: ``flash_attention_mma_fa2_lean`` and its pre-pass ``flash_attention_mma_fa2_lean_v_flags``); the wide
#: register-tiled rung is ``flash_attention_regtile.cu`` with ``REGTILE_WIDE=1`` (entry point
#: ``flash_attention_regtile_wide``)
KERNEL_FILES = {"flash_attention_mma_fa2_lazy": "flash_attention_mma_fa2",
                "flash_attention_mma_fa2_wide": "flash_attention_mma_fa2",
                "flash_attention_mma_fa2_lean": "flash_attention_mma_fa2",
                "flash_attention_regtile_wide": "flash_attention_regtile"}

#: storage dtype name -> value of the FA_DTYPE define (arithmetic is always float32)
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}

#: bytes of static shared memory one block may declare (``__shared__``) on any GPU
STATIC_SMEM_LIMIT = 48 * 1024
#: threads per block of the attention kernels
NUM_THREADS = 128
#: largest head dim the kernels are written for
MAX_HEAD_DIM = 256
#: largest page (block_size) of the decode kernels: one warp lane per token of a page
MAX_BLOCK_SIZE = 32
#: most scores one thread of the forward kernel keeps per tile (block_k // (128 // block_q))
MAX_SCORES_PER_THREAD = 16
#: most query heads one decode block serves
MAX_HEADS_PER_BLOCK = 8

_INCLUDE = re.compile(r"^[ \t]*#include[ \t]+\"([^\"]+)\"[ \t]*$", re.MULTILINE)


@lru_cache(maxsize=None)
def kernel_source(kernel: str) -> str:
    """The CUDA C source of ``kernel`` (a key of :data:`KERNELS`) with its includes inlined.

    Returns a str. Raises ValueError for an unknown kernel name.
    """
    return _inline(kernel_file(kernel), seen=frozenset())


def kernel_file(kernel: str) -> str:
    """The name of the ``.cu`` file in ``KERNEL_DIR`` that ``kernel`` (a key of :data:`KERNELS`) is compiled
    from: ``<kernel>.cu``, or the file :data:`KERNEL_FILES` names. ValueError for an unknown kernel name."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
    return f"{KERNEL_FILES.get(kernel, kernel)}.cu"


def _inline(name: str, seen: frozenset) -> str:
    text = (KERNEL_DIR / name).read_text()
    out, pos = [], 0
    for match in _INCLUDE.finditer(text):
        header = match.group(1)
        out.append(text[pos:match.start()])
        if header not in seen:
            out.append(f'#line 1 "{header}"\n')
            out.append(_inline(header, seen | {name, header}))
            line = text.count("\n", 0, match.end()) + 2
            out.append(f'\n#line {line} "{name}"\n')
        pos = match.end() + 1
    out.append(text[pos:])
    return "".join(out)


# ---------------------------------------------------------------------------
# flash attention forward
# ---------------------------------------------------------------------------

def flash_attention_smem_bytes(head_dim: int, block_q: int, block_k: int) -> int:
    """Static shared memory of ``flash_attention_forward`` in bytes.

    float32 arrays ``q_s[block_q][d+1]``, ``k_s[block_k][d+1]``, ``v_s[block_k][d+1]``,
    ``p_s[block_q][block_k+1]`` (the +1 columns avoid shared-memory bank conflicts).
    """
    return 4 * (block_q * (head_dim + 1) + 2 * block_k * (head_dim + 1) + block_q * (block_k + 1))


def _check_int(value, name: str, lo: int, hi: int) -> int:
    value = check_int(value, name)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {value}")
    return int(value)


def flash_attention_config(head_dim: int, block_q: int | None = None,
                           block_k: int | None = None) -> tuple[int, int]:
    """Tile sizes ``(block_q, block_k)`` (Br, Bc) of the forward kernel for head dim ``d``.

    By default ``block_q`` is 64, 32 or 16 rows for d <= 64, <= 128, <= 256 (so each
    of the 128 threads holds about 32 output columns in registers), and ``block_k`` is the
    largest of 64, 32, 16, 8 keys whose tiles fit in 48 KiB of shared memory and leave each
    thread at most 16 scores in registers (more makes ptxas spill for small d).
    Either may be given instead: ``block_q`` must divide 128 into a power of two number
    of lanes per row (so one of 4, 8, 16, 32, 64, 128) and ``block_k`` must be a positive
    multiple of ``128 // block_q``. Raises ValueError / TypeError naming the argument,
    including when the tiles would need more than 48 KiB of shared memory.
    """
    d = _check_int(head_dim, "head_dim", 1, MAX_HEAD_DIM)
    if block_q is None:
        block_q = 64 if d <= 64 else 32 if d <= 128 else 16
    block_q = _check_int(block_q, "block_q", 4, NUM_THREADS)
    if block_q not in (4, 8, 16, 32, 64, 128):
        raise ValueError(f"block_q must be one of 4, 8, 16, 32, 64, 128 (a power of two dividing 128), got {block_q}")
    lanes = NUM_THREADS // block_q
    if block_k is None:
        fits = [bk for bk in (64, 32, 16, 8) if bk % lanes == 0 and bk // lanes <= MAX_SCORES_PER_THREAD
                and flash_attention_smem_bytes(d, block_q, bk) <= STATIC_SMEM_LIMIT]
        if not fits:
            raise ValueError(f"no block_k fits 48 KiB of shared memory with head_dim={d}, block_q={block_q}")
        block_k = fits[0]
    block_k = _check_int(block_k, "block_k", 1, 1024)
    if block_k % lanes:
        raise ValueError(f"block_k must be a multiple of 128 // block_q = {lanes}, got block_k={block_k}")
    smem = flash_attention_smem_bytes(d, block_q, block_k)
    if smem > STATIC_SMEM_LIMIT:
        raise ValueError(f"block_q={block_q}, block_k={block_k} with head_dim={d} need {smem} bytes of "
                         f"shared memory, more than the {STATIC_SMEM_LIMIT} allowed; use smaller tiles")
    return block_q, block_k


# ---------------------------------------------------------------------------
# flash attention forward on tensor cores (mma.sync)
# ---------------------------------------------------------------------------

#: query rows per block of the tensor-core kernel: 4 warps x 16 rows (the mma tile's M)
MMA_BLOCK_Q = 64
#: storage dtypes the tensor-core instruction takes (m16n8k16 with float32 accumulation)
MMA_DTYPES = ("float16", "bfloat16")


def flash_attention_mma_smem_bytes(head_dim: int, block_k: int) -> int:
    """Static shared memory of ``flash_attention_mma`` in bytes: 16-bit ``k_s`` and ``v_s``,
    ``block_k`` rows of ``head_dim + 8`` values each (8 values of padding against bank conflicts)."""
    return 2 * 2 * block_k * (head_dim + 8)


def flash_attention_mma_config(head_dim: int, block_k: int | None = None) -> int:
    """``block_k`` (Bc) of the tensor-core kernel for head dim ``d``.

    ``head_dim`` must be a multiple of 16 (the mma tile's K) in 16..256. By default
    ``block_k`` is 64 keys for d <= 128 and 32 above (so a thread's scores and outputs stay
    in registers); a given ``block_k`` must be a multiple of 16 in 16..128 whose K and V tiles
    fit in 48 KiB. Raises TypeError/ValueError naming the argument.
    """
    d = _check_int(head_dim, "head_dim", 16, MAX_HEAD_DIM)
    if d % 16:
        raise ValueError(f"head_dim must be a multiple of 16 for the tensor-core kernel (mma.m16n8k16), got {d}; "
                         f"flash_attention_gpu takes any head dim")
    if block_k is None:
        block_k = 64 if d <= 128 else 32
    block_k = _check_int(block_k, "block_k", 16, 128)
    if block_k % 16:
        raise ValueError(f"block_k must be a multiple of 16 (the mma tile), got {block_k}")
    smem = flash_attention_mma_smem_bytes(d, block_k)
    if smem > STATIC_SMEM_LIMIT:
        raise ValueError(f"block_k={block_k} with head_dim={d} needs {smem} bytes of shared memory, more than "
                         f"the {STATIC_SMEM_LIMIT} allowed; use a smaller block_k")
    return block_k


def flash_attention_mma_build(head_dim: int, dtype: str = "float16", trace: bool = False,
                              block_k: int | None = None) -> KernelBuild:
    """The :class:`KernelBuild` of the tensor-core forward kernel (float16 or bfloat16 storage)."""
    if dtype not in MMA_DTYPES:
        raise ValueError(f"the tensor-core kernel takes dtype float16 or bfloat16, got {dtype!r}; "
                         f"use flash_attention_gpu for float32")
    bk = flash_attention_mma_config(head_dim, block_k)
    return KernelBuild.make("flash_attention_mma", dtype, trace, HEAD_DIM=head_dim, BLOCK_K=bk)


# ---------------------------------------------------------------------------
# flash attention forward, register-tiled (CUDA cores, float32)
# ---------------------------------------------------------------------------

#: (block_q, block_k) of the register-tiled kernel, largest first; the first that fits is taken
REGTILE_TILES = ((64, 64), (64, 32), (32, 32), (32, 16), (16, 16))
#: the most shared memory a register-tiled block may ask for when its tiles are chosen by hand (bytes):
#: past 48 KiB the kernel is built with ``REGTILE_DYNAMIC_SMEM=1`` (its tiles in dynamic shared memory);
#: 99 KiB is what a block may have on every GPU from sm_80 on (sm_86 and sm_89 allow no more)
REGTILE_DYNAMIC_LIMIT = 99 * 1024
#: head dim -> the (block_q, block_k) the tuning sweep times (``scripts/tune_tiles.py --rung regtile``):
#: 4 rows x 8 keys per thread and the default's neighbours, and 8 rows per thread (128-row blocks: one shared
#: load of K feeds twice the FMAs; NVRTC 12.9: 161-168 registers at d = 64, 234-236 for (128, 16) at d = 128,
#: no spills); the ones over 48 KiB use dynamic shared memory
REGTILE_SWEEP = {64: ((64, 64), (64, 32), (32, 64), (32, 32), (64, 16), (128, 32), (128, 16)),
                 128: ((64, 64), (64, 32), (32, 64), (32, 32), (64, 16), (128, 16))}


def flash_attention_regtile_smem_bytes(head_dim: int, block_q: int, block_k: int) -> int:
    """Static shared memory of ``flash_attention_regtile`` in bytes: float32 ``q_s[block_q][d+4]``,
    ``kv_s[block_k][d+4]`` (K, then V, of the tile), ``p_s[block_q][block_k+4]``."""
    return 4 * (block_q * (head_dim + 4) + block_k * (head_dim + 4) + block_q * (block_k + 4))


def flash_attention_regtile_config(head_dim: int, block_q: int | None = None,
                                   block_k: int | None = None) -> tuple[int, int]:
    """Tile sizes ``(block_q, block_k)`` of the register-tiled forward kernel for head dim ``d``.

    ``head_dim`` must be a multiple of 4 in 4..256 (rows are read 16 bytes at a time).
    128 threads = 16 row groups x 8 lanes, so ``block_q`` is 16, 32, 64 or 128 (1, 2, 4 or 8 rows per
    thread; 128 only by hand) and ``block_k`` 8, 16, 32 or 64 (1..8 keys per thread). By default the first pair
    of :data:`REGTILE_TILES` whose tiles fit 48 KiB of static shared memory: (64, 64) up to
    d = 56, (64, 32) up to d = 100, (32, 32) up to d = 168, (32, 16) up to 236, then (16, 16).
    Tiles given by hand may take up to :data:`REGTILE_DYNAMIC_LIMIT` (99 KiB): past 48 KiB the
    build puts them in dynamic shared memory (:func:`flash_attention_regtile_build`).
    Raises TypeError / ValueError naming the argument.
    """
    d = _regtile_head_dim(head_dim)
    if block_q is None and block_k is None:
        fits = [t for t in REGTILE_TILES if flash_attention_regtile_smem_bytes(d, *t) <= STATIC_SMEM_LIMIT]
        return fits[0]
    return _regtile_tiles(d, 32 if block_q is None else block_q, 16 if block_k is None else block_k, False)


def _regtile_head_dim(head_dim) -> int:
    """``head_dim`` checked for the register-tiled builds: an int, a multiple of 4 in 4..256."""
    d = _check_int(head_dim, "head_dim", 4, MAX_HEAD_DIM)
    if d % 4:
        raise ValueError(f"head_dim must be a multiple of 4 for the register-tiled kernel (16-byte loads), "
                         f"got {d}; flash_attention_gpu takes any head dim")
    return d


#: threads per row group of the register-tiled kernel: the plain build (False) and the wide one (True,
#: ``REGTILE_WIDE=1``); its 128 threads (:data:`NUM_THREADS`) make ``128 / lanes`` row groups
REGTILE_LANES = {False: 8, True: 16}


def regtile_legal_tiles(wide: bool = False) -> tuple[tuple, tuple]:
    """``(block_q values, block_k values)`` the register-tiled kernel takes, plain or ``wide``: 1, 2, 4 or 8 rows
    and keys per thread, over ``128 / lanes`` row groups of :data:`REGTILE_LANES` lanes (plain: (16, 32, 64, 128)
    and (8, 16, 32, 64); wide: (8, 16, 32, 64) and (16, 32, 64, 128)). TypeError for a non-bool ``wide``."""
    lanes = REGTILE_LANES[check_flag(wide, "wide")]
    return tuple(NUM_THREADS // lanes * t for t in (1, 2, 4, 8)), tuple(lanes * t for t in (1, 2, 4, 8))


def _regtile_tiles(d: int, block_q, block_k, wide: bool) -> tuple[int, int]:
    """``(block_q, block_k)`` checked for the plain or ``wide`` register-tiled build: a pair of
    :func:`regtile_legal_tiles`, shared memory within :data:`REGTILE_DYNAMIC_LIMIT`."""
    bq, bk = check_int(block_q, "block_q"), check_int(block_k, "block_k")
    legal_q, legal_k = regtile_legal_tiles(wide)
    which = " for the wide register-tiled rung" if wide else ""
    if bq not in legal_q:
        raise ValueError(f"block_q must be {', '.join(map(str, legal_q[:3]))} or {legal_q[3]}{which} "
                         f"(1, 2, 4 or 8 rows per thread), got {bq}")
    if bk not in legal_k:
        raise ValueError(f"block_k must be {', '.join(map(str, legal_k[:3]))} or {legal_k[3]}{which} "
                         f"(1..8 keys per thread), got {bk}")
    smem = flash_attention_regtile_smem_bytes(d, bq, bk)
    if smem > REGTILE_DYNAMIC_LIMIT:
        raise ValueError(f"block_q={bq}, block_k={bk} with head_dim={d} need {smem} bytes of shared memory, "
                         f"more than the {REGTILE_DYNAMIC_LIMIT} bytes every sm_80+ GPU lets a block have; use "
                         f"smaller tiles")
    return bq, bk


def _regtile_build(kernel: str, head_dim: int, dtype: str, trace: bool, bq: int, bk: int, **switches) -> "KernelBuild":
    """The build of a register-tiled ``kernel`` (float32 only) with checked tiles: dynamic shared memory past
    48 KiB (``REGTILE_DYNAMIC_SMEM=1``), else static."""
    if dtype != "float32":
        raise ValueError(f"the register-tiled kernel takes dtype float32, got {dtype!r}; "
                         f"use flash_attention_gpu or flash_attention_mma_gpu for 16-bit inputs")
    dynamic = {"REGTILE_DYNAMIC_SMEM": 1} if flash_attention_regtile_smem_bytes(head_dim, bq, bk) > STATIC_SMEM_LIMIT \
        else {}
    return KernelBuild.make(kernel, dtype, trace, HEAD_DIM=head_dim, BLOCK_Q=bq, BLOCK_K=bk, **switches, **dynamic)


def flash_attention_regtile_build(head_dim: int, dtype: str = "float32", trace: bool = False,
                                  block_q: int | None = None, block_k: int | None = None) -> "KernelBuild":
    """The :class:`KernelBuild` of the register-tiled forward kernel (float32 storage only). Tiles over 48 KiB
    (given by hand) are built with ``REGTILE_DYNAMIC_SMEM=1``: :attr:`KernelBuild.dynamic_smem_bytes` then
    holds all of them."""
    bq, bk = flash_attention_regtile_config(head_dim, block_q, block_k)
    return _regtile_build("flash_attention_regtile", head_dim, dtype, trace, bq, bk)


# the same with 16 lanes per row group and P read 4 keys at a time (flash_attention_regtile_wide)

#: (block_q, block_k) of the wide register-tiled rung, largest first: the first whose tiles fit
#: :data:`REGTILE_DYNAMIC_LIMIT` is the default (8 rows x 4 keys per thread up to d = 160, then 8 x 2 up to
#: d = 236, then 4 x 2)
REGTILE_WIDE_TILES = ((64, 64), (64, 32), (32, 32))
#: head dim -> the (block_q, block_k) the tuning sweep of the wide rung times (``scripts/tune_tiles.py --rung
#: regtile_wide``): the default first, then fewer rows (4 per thread) or more keys (8 per thread) or fewer keys
REGTILE_WIDE_SWEEP = {64: ((64, 64), (64, 128), (32, 128), (32, 64), (64, 32)),
                      128: ((64, 64), (32, 128), (32, 64), (64, 32), (64, 16))}


def flash_attention_regtile_wide_config(head_dim: int, block_q: int | None = None,
                                        block_k: int | None = None) -> tuple[int, int]:
    """Tile sizes ``(block_q, block_k)`` of the wide register-tiled rung at head dim ``d``.

    ``head_dim`` must be a multiple of 4 in 4..256. 128 threads = 8 row groups x 16 lanes, so ``block_q``
    is 8, 16, 32 or 64 (1, 2, 4 or 8 rows per thread) and ``block_k`` 16, 32, 64 or 128 (1..8 keys per
    thread). Both None: the first pair of :data:`REGTILE_WIDE_TILES` that fits :data:`REGTILE_DYNAMIC_LIMIT`
    (99 KiB): (64, 64) up to d = 160, (64, 32) up to d = 236, then (32, 32). One None: the default's value
    for it. The shared memory is :func:`flash_attention_regtile_smem_bytes` (the same three arrays); past
    48 KiB the build puts it in dynamic shared memory. Raises TypeError / ValueError naming the argument.
    """
    d = _regtile_head_dim(head_dim)
    default = next(t for t in REGTILE_WIDE_TILES
                   if flash_attention_regtile_smem_bytes(d, *t) <= REGTILE_DYNAMIC_LIMIT)
    return _regtile_tiles(d, default[0] if block_q is None else block_q, default[1] if block_k is None else block_k,
                          True)


def flash_attention_regtile_wide_build(head_dim: int, dtype: str = "float32", trace: bool = False,
                                       block_q: int | None = None, block_k: int | None = None) -> "KernelBuild":
    """The :class:`KernelBuild` of the wide register-tiled rung: ``flash_attention_regtile.cu`` with
    ``REGTILE_WIDE=1`` (entry point ``flash_attention_regtile_wide``), float32 only, tiles from
    :func:`flash_attention_regtile_wide_config`; tiles over 48 KiB in dynamic shared memory
    (``REGTILE_DYNAMIC_SMEM=1``)."""
    bq, bk = flash_attention_regtile_wide_config(head_dim, block_q, block_k)
    return _regtile_build("flash_attention_regtile_wide", head_dim, dtype, trace, bq, bk, REGTILE_WIDE=1)


def flash_attention_mma_async_config(head_dim: int, block_k: int | None = None) -> int:
    """``block_k`` of the tensor-core kernel with cp.async double buffering and ldmatrix.

    ``head_dim`` a multiple of 16 in 16..256; two stages of 16-bit K and V tiles must fit 48 KiB,
    so by default ``block_k`` is the largest of 64, 32, 16 that fits (64 up to d = 80, 32 up to
    d = 176, then 16); a given one must be 16, 32 or 64 and fit. Raises TypeError/ValueError
    naming the argument."""
    d = _check_int(head_dim, "head_dim", 16, MAX_HEAD_DIM)
    if d % 16:
        raise ValueError(f"head_dim must be a multiple of 16 for the tensor-core kernel (mma.m16n8k16), got {d}")
    if block_k is None:
        block_k = next(bk for bk in (64, 32, 16) if 2 * flash_attention_mma_smem_bytes(d, bk) <= STATIC_SMEM_LIMIT)
    block_k = _check_int(block_k, "block_k", 16, 64)
    if block_k not in (16, 32, 64):
        raise ValueError(f"block_k must be 16, 32 or 64, got {block_k}")
    smem = 2 * flash_attention_mma_smem_bytes(d, block_k)
    if smem > STATIC_SMEM_LIMIT:
        raise ValueError(f"block_k={block_k} with head_dim={d} needs {smem} bytes of shared memory (two stages), "
                         f"more than the {STATIC_SMEM_LIMIT} allowed; use a smaller block_k")
    return block_k


def flash_attention_mma_async_build(head_dim: int, dtype: str = "float16", trace: bool = False,
                                    block_k: int | None = None) -> "KernelBuild":
    """The :class:`KernelBuild` of the cp.async + ldmatrix tensor-core kernel (float16 or bfloat16)."""
    if dtype not in MMA_DTYPES:
        raise ValueError(f"the tensor-core kernel takes dtype float16 or bfloat16, got {dtype!r}")
    bk = flash_attention_mma_async_config(head_dim, block_k)
    return KernelBuild.make("flash_attention_mma_async", dtype, trace, HEAD_DIM=head_dim, BLOCK_K=bk)


# ---------------------------------------------------------------------------
# flash attention forward, tensor cores, FlashAttention-2's recipe (flash_attention_mma_fa2.cu)
# ---------------------------------------------------------------------------

#: head dim -> (block_q, block_k, min_blocks) of ``flash_attention_mma_fa2``: 128 query rows over
#: 8 warps and 64-key tiles at d = 64, 64 rows over 4 warps and 32-key tiles at d = 128;
#: min_blocks is the blocks per SM promised to ptxas (``__launch_bounds__``), which caps the
#: registers per thread at 65536 / (threads * min_blocks): 128 at d = 64, 255 at d = 128
FA2_CONFIGS = {64: (128, 64, 2), 128: (64, 32, 2)}


def flash_attention_mma_fa2_config(head_dim: int) -> tuple[int, int, int]:
    """``(block_q, block_k, min_blocks)`` of the FlashAttention-2-style tensor-core kernel.

    ``head_dim`` must be 64 or 128 (:data:`FA2_CONFIGS`; the tiles, warps and register budget
    are chosen per head dim). Raises TypeError for a non-integer, ValueError naming
    ``head_dim`` otherwise. Source: Dao 2023 (FlashAttention-2), Sec. 3.3 (block sizes)."""
    d = check_int(head_dim, "head_dim")
    if d not in FA2_CONFIGS:
        raise ValueError(f"head_dim must be one of {sorted(FA2_CONFIGS)} for the FlashAttention-2-style "
                         f"tensor-core kernel, got {d}; flash_attention_mma_async_gpu takes any multiple of 16")
    return FA2_CONFIGS[d]


def flash_attention_mma_fa2_smem_bytes(head_dim: int, block_k: int) -> int:
    """Static shared memory of ``flash_attention_mma_fa2`` in bytes: two stages of a 16-bit K and
    V tile of ``block_k`` rows x ``head_dim`` values, no padding (swizzled); the Q tile is
    staged in the second stage before the loop, so it costs nothing extra: ``8 * block_k * d``."""
    return 2 * 2 * 2 * block_k * head_dim


def fa2_swizzle(row: int, chunk: int, head_dim: int) -> int:
    """Element offset of 16-byte chunk ``chunk`` (8 16-bit values) of row ``row`` in a swizzled
    tile of ``head_dim`` values per row, as ``swz`` in ``flash_attention_mma_fa2.cu``: chunk
    ``c`` of row ``r`` is stored at chunk ``c ^ (r % 8)`` of that row. ``head_dim`` a multiple
    of 64 (8 chunks or more per row); ValueError otherwise."""
    if head_dim % 64:
        raise ValueError(f"head_dim must be a multiple of 64 (8 chunks of 8 values per row), got {head_dim}")
    if not 0 <= chunk < head_dim // 8 or row < 0:
        raise ValueError(f"chunk must be in 0..{head_dim // 8 - 1} and row >= 0, got row={row}, chunk={chunk}")
    return row * head_dim + ((chunk ^ (row % 8)) << 3)


def flash_attention_mma_fa2_build(head_dim: int, dtype: str = "float16", trace: bool = False) -> "KernelBuild":
    """The :class:`KernelBuild` of the FlashAttention-2-style tensor-core kernel (float16 or
    bfloat16; head dim 64 or 128, tiles from :func:`flash_attention_mma_fa2_config`)."""
    if dtype not in MMA_DTYPES:
        raise ValueError(f"the tensor-core kernel takes dtype float16 or bfloat16, got {dtype!r}")
    bq, bk, min_blocks = flash_attention_mma_fa2_config(head_dim)
    return KernelBuild.make("flash_attention_mma_fa2", dtype, trace, HEAD_DIM=head_dim, BLOCK_Q=bq, BLOCK_K=bk,
                            MIN_BLOCKS=min_blocks)


# ---------------------------------------------------------------------------
# the same kernel with lazy rescaling and dynamic shared memory (flash_attention_mma_fa2_lazy)
# ---------------------------------------------------------------------------

#: head dim -> default (block_q, block_k, min_blocks) of ``flash_attention_mma_fa2_lazy``: at d = 64 the
#: FA-2 rung's; at d = 128 64-key tiles (64 KiB of shared memory in two stages: dynamic) instead of 32
FA2_LAZY_CONFIGS = {64: (128, 64, 2), 128: (64, 64, 2)}
#: head dim -> every (block_q, block_k, min_blocks) the lazy rung takes (the tuning sweep). The tiles: 64 or
#: 128 query rows (4 or 8 warps), 32 or 64 keys, the Q tile within one K/V stage (block_q <= 2 block_k).
#: min_blocks caps the registers at 65536 / (threads x min_blocks) (255 at most); listed are the values
#: for which NVRTC 12.9 (sm_80 and sm_90, float16 and bfloat16) spills nothing, one per register cap that
#: changes the code: 1 and 2 are the same cap for 4-warp blocks (2 listed), and 3 changes nothing for
#: 4-warp blocks at d = 64 (they use fewer than 168 registers). Registers: d = 64: (64, 32) 134-138 at
#: 2 and 122-128 at 4, (64, 64) 138-146, (128, 64) 137-148 at 1 and 128 at 2; d = 128: (64, 32) 218-224,
#: (64, 64) 242-245, (128, 64) 236-241 (each spills at the next min_blocks up)
FA2_LAZY_SWEEP = {
    64: ((64, 32, 2), (64, 32, 4), (64, 64, 2), (128, 64, 1), (128, 64, 2)),
    128: ((64, 32, 2), (64, 64, 2), (128, 64, 1)),
}


def _tile_head_dim(head_dim, sweep: dict, what: str) -> int:
    d = check_int(head_dim, "head_dim")
    if d not in sweep:
        raise ValueError(f"head_dim must be one of {sorted(sweep)} for the {what} tensor-core "
                         f"kernel, got {d}; flash_attention_mma_async_gpu takes any multiple of 16")
    return d


def _tile_config(head_dim, block_q, block_k, min_blocks, defaults: dict, sweep: dict, what: str,
                 rows_per_warp: int, pair_rule: str) -> tuple[int, int, int]:
    """The ``(block_q, block_k, min_blocks)`` rule shared by the lazy and the wide-warp rung (their docstrings
    say it), over that rung's ``defaults`` and legal ``sweep``; ``pair_rule`` says which pairs are legal."""
    d = _tile_head_dim(head_dim, sweep, what)
    legal = sweep[d]
    pairs = list(dict.fromkeys((bq, bk) for bq, bk, _ in legal))
    if block_q is not None:
        block_q = check_int(block_q, "block_q")
        if block_q not in {bq for bq, _ in pairs}:
            raise ValueError(f"block_q must be one of {sorted({bq for bq, _ in pairs})} (query rows per block, "
                             f"{rows_per_warp} per warp), got {block_q}")
    if block_k is not None:
        block_k = check_int(block_k, "block_k")
        if block_k not in {bk for _, bk in pairs}:
            raise ValueError(f"block_k must be one of {sorted({bk for _, bk in pairs})} (keys per tile), got {block_k}")
    default = defaults[d][:2]
    matching = [p for p in pairs if block_q in (None, p[0]) and block_k in (None, p[1])]
    if not matching:
        raise ValueError(f"block_q={block_q}, block_k={block_k} is not a legal pair at head_dim={d} ({pair_rule}); "
                         f"legal (block_q, block_k): {pairs}")
    filled = (default[0] if block_q is None else block_q, default[1] if block_k is None else block_k)
    bq, bk = filled if filled in matching else matching[0]          # the missing one from the default if legal
    counts = [mb for q_, k_, mb in legal if (q_, k_) == (bq, bk)]
    if min_blocks is None:
        return bq, bk, max(mb for mb in counts if mb <= 2)
    min_blocks = check_int(min_blocks, "min_blocks")
    if min_blocks not in counts:
        raise ValueError(f"min_blocks must be one of {counts} for block_q={bq}, block_k={bk} at head_dim={d} "
                         f"(the values for which nothing spills), got {min_blocks}")
    return bq, bk, min_blocks


def flash_attention_mma_fa2_lazy_configs(head_dim: int) -> list[tuple[int, int, int]]:
    """Every ``(block_q, block_k, min_blocks)`` the lazy-rescaling rung takes at ``head_dim`` (64 or 128), in
    :data:`FA2_LAZY_SWEEP`'s order: what a tuning sweep times. TypeError for a non-integer ``head_dim``
    (bools included), ValueError naming it for another head dim."""
    return list(FA2_LAZY_SWEEP[_tile_head_dim(head_dim, FA2_LAZY_SWEEP, "lazy-rescaling")])


def flash_attention_mma_fa2_lazy_config(head_dim: int, block_q: int | None = None, block_k: int | None = None,
                                        min_blocks: int | None = None) -> tuple[int, int, int]:
    """``(block_q, block_k, min_blocks)`` of the lazy-rescaling rung at ``head_dim`` (64 or 128).

    All None: :data:`FA2_LAZY_CONFIGS` (d = 64: (128, 64, 2); d = 128: (64, 64, 2)). ``block_q`` (64 or
    128) and ``block_k`` (32 or 64) must be a pair of :func:`flash_attention_mma_fa2_lazy_configs` (the Q tile
    must fit in one K/V stage: ``block_q <= 2 * block_k``); one of
    them None takes the default's value where that makes a legal pair, else the first legal pair with the other.
    ``min_blocks`` None: the pair's largest legal value up to 2 (2 blocks per SM, as the FA-2 rung), else
    one listed for that pair. Raises TypeError for a non-integer (bools included), ValueError naming the
    argument and listing what it may be otherwise."""
    return _tile_config(head_dim, block_q, block_k, min_blocks, FA2_LAZY_CONFIGS, FA2_LAZY_SWEEP,
                        "lazy-rescaling", 16, "the Q tile must fit in one K/V stage: block_q <= 2 * block_k")


def flash_attention_mma_fa2_lazy_build(head_dim: int, dtype: str = "float16", trace: bool = False,
                                       block_q: int | None = None, block_k: int | None = None,
                                       min_blocks: int | None = None) -> "KernelBuild":
    """The :class:`KernelBuild` of the lazy-rescaling rung: ``flash_attention_mma_fa2.cu`` with
    ``LAZY_RESCALE=1`` and ``FA2_DYNAMIC_SMEM=1`` (entry point ``flash_attention_mma_fa2_lazy``), float16 or
    bfloat16, tiles from :func:`flash_attention_mma_fa2_lazy_config`. Its two K/V stages are dynamic
    shared memory (:attr:`KernelBuild.dynamic_smem_bytes`, ``8 * block_k * head_dim`` bytes)."""
    if dtype not in MMA_DTYPES:
        raise ValueError(f"the tensor-core kernel takes dtype float16 or bfloat16, got {dtype!r}")
    bq, bk, mb = flash_attention_mma_fa2_lazy_config(head_dim, block_q, block_k, min_blocks)
    return KernelBuild.make("flash_attention_mma_fa2_lazy", dtype, trace, HEAD_DIM=head_dim, BLOCK_Q=bq, BLOCK_K=bk,
                            MIN_BLOCKS=mb, LAZY_RESCALE=1, FA2_DYNAMIC_SMEM=1)


# ---------------------------------------------------------------------------
# the same with FlashAttention-2's warp shape: 32 query rows per warp (flash_attention_mma_fa2_wide)
# ---------------------------------------------------------------------------

#: head dim -> default (block_q, block_k, min_blocks) of ``flash_attention_mma_fa2_wide``: 128 query rows over
#: 4 warps of 32; 64-key tiles at d = 64, 32 at d = 128 (FlashAttention-2's forward tile on sm_86 / sm_89 GPUs;
#: the 64 it takes on an A100 and an H100 is in the sweep: it spills on sm_80, and 128 keys at d = 64, which it
#: takes on both, spill everywhere)
FA2_WIDE_CONFIGS = {64: (128, 64, 2), 128: (128, 32, 2)}
#: head dim -> every (block_q, block_k, min_blocks) the wide-warp rung takes (its tuning sweep): 64 or 128 query
#: rows (2 or 4 warps of 32 rows), 32 or 64 keys, and the values of min_blocks for which NVRTC 12.9 spills
#: nothing on sm_90 (the GPUs the rung is timed on), one per register cap that changes the code (1 and 2 are
#: the same cap for blocks of 4 warps or fewer: 2 listed). Registers on sm_90 (float16): d = 64: (128, 64) 223,
#: (128, 32) 187 at 2 and 168 at 3, (64, 64) 241, (64, 32) 184; d = 128: 255 for all three. On sm_80 the
#: two d = 128 tiles spill a little: (128, 64) 120 bytes, (64, 32) 36 bytes (float16; 8 stored and 48 loaded in
#: bfloat16), and (128, 64) at d = 128 (96 KiB) fits one block per SM there (164 KiB), not two.
FA2_WIDE_SWEEP = {
    64: ((128, 64, 2), (128, 32, 2), (128, 32, 3), (64, 64, 2), (64, 32, 2)),
    128: ((128, 32, 2), (128, 64, 2), (64, 32, 2)),
}


def flash_attention_mma_fa2_wide_configs(head_dim: int) -> list[tuple[int, int, int]]:
    """Every ``(block_q, block_k, min_blocks)`` the wide-warp rung takes at ``head_dim`` (64 or 128), in
    :data:`FA2_WIDE_SWEEP`'s order (the default first): what a tuning sweep times. TypeError for a
    non-integer ``head_dim`` (bools included), ValueError naming it for another head dim."""
    return list(FA2_WIDE_SWEEP[_tile_head_dim(head_dim, FA2_WIDE_SWEEP, "wide-warp")])


def flash_attention_mma_fa2_wide_config(head_dim: int, block_q: int | None = None, block_k: int | None = None,
                                        min_blocks: int | None = None) -> tuple[int, int, int]:
    """``(block_q, block_k, min_blocks)`` of the wide-warp rung (32 query rows per warp) at ``head_dim``.

    All None: :data:`FA2_WIDE_CONFIGS` (d = 64: (128, 64, 2); d = 128: (128, 32, 2)). Otherwise ``block_q``
    and ``block_k`` must be a pair of :func:`flash_attention_mma_fa2_wide_configs`, with the same rules for a
    missing one and for ``min_blocks`` as :func:`flash_attention_mma_fa2_lazy_config`. Raises TypeError for a
    non-integer (bools included), ValueError naming the argument and listing what it may be otherwise.
    Source: Dao 2023 (FlashAttention-2), Sec. 3.3; its forward kernel's blocks of 128 query rows over 4 warps
    (flash-attention repository, ``flash_fwd_launch_template.h``)."""
    return _tile_config(head_dim, block_q, block_k, min_blocks, FA2_WIDE_CONFIGS, FA2_WIDE_SWEEP, "wide-warp", 32,
                        "the others spill on sm_90")


def flash_attention_mma_fa2_wide_smem_bytes(head_dim: int, block_q: int, block_k: int) -> int:
    """Dynamic shared memory of ``flash_attention_mma_fa2_wide`` in bytes: the two K/V stages of
    :func:`flash_attention_mma_fa2_smem_bytes` (``8 * block_k * d``) and the block's Q tile, which keeps
    its own region (``2 * block_q * d``): 64 KiB at d = 128 with 128 x 32 tiles, 96 KiB with 128 x 64."""
    return flash_attention_mma_fa2_smem_bytes(head_dim, block_k) + 2 * block_q * head_dim


def flash_attention_mma_fa2_wide_build(head_dim: int, dtype: str = "float16", trace: bool = False,
                                       block_q: int | None = None, block_k: int | None = None,
                                       min_blocks: int | None = None) -> "KernelBuild":
    """The :class:`KernelBuild` of the wide-warp rung: ``flash_attention_mma_fa2.cu`` with ``LAZY_RESCALE=1``,
    ``FA2_DYNAMIC_SMEM=1`` and ``WARP_ROWS=32`` (entry point ``flash_attention_mma_fa2_wide``), float16 or
    bfloat16, tiles from :func:`flash_attention_mma_fa2_wide_config`; all its shared memory is dynamic
    (:func:`flash_attention_mma_fa2_wide_smem_bytes`)."""
    if dtype not in MMA_DTYPES:
        raise ValueError(f"the tensor-core kernel takes dtype float16 or bfloat16, got {dtype!r}")
    bq, bk, mb = flash_attention_mma_fa2_wide_config(head_dim, block_q, block_k, min_blocks)
    return KernelBuild.make("flash_attention_mma_fa2_wide", dtype, trace, HEAD_DIM=head_dim, BLOCK_Q=bq, BLOCK_K=bk,
                            MIN_BLOCKS=mb, LAZY_RESCALE=1, FA2_DYNAMIC_SMEM=1, WARP_ROWS=32)


# ---------------------------------------------------------------------------
# the wide rung whose interior key tiles issue only what they need (flash_attention_mma_fa2_lean)
# ---------------------------------------------------------------------------

#: head dim -> default (block_q, block_k, min_blocks) of ``flash_attention_mma_fa2_lean``: the wide rung's
FA2_LEAN_CONFIGS = dict(FA2_WIDE_CONFIGS)
#: head dim -> every (block_q, block_k, min_blocks) the lean rung takes: the wide rung's less those where the lean
#: build spills on sm_90 (NVRTC 12.9) and the wide one does not: d = 64 (128, 32, 3) (float16) and (64, 64, 2);
#: d = 128 (128, 64, 2) (bfloat16: 8 bytes) and (64, 32, 2). At d = 64 its second loop (the one without masks)
#: costs registers: (128, 64) 242-243 against the wide rung's 223-225; at d = 128 (one loop) 255, as the wide
#: rung's; no spills on sm_80 either
FA2_LEAN_SWEEP = {
    64: ((128, 64, 2), (128, 32, 2), (64, 32, 2)),
    128: ((128, 32, 2),),
}
#: the lean rung's pre-pass: one int32 flag per (batch * heads, key tile of block_k keys), 1 where V's tile holds
#: an inf or NaN
FA2_LEAN_V_FLAGS = "flash_attention_mma_fa2_lean_v_flags"


def flash_attention_mma_fa2_lean_configs(head_dim: int) -> list[tuple[int, int, int]]:
    """Every ``(block_q, block_k, min_blocks)`` the lean rung takes at ``head_dim`` (64 or 128), in
    :data:`FA2_LEAN_SWEEP`'s order (the default first). TypeError for a non-integer ``head_dim`` (bools
    included), ValueError naming it for another head dim."""
    return list(FA2_LEAN_SWEEP[_tile_head_dim(head_dim, FA2_LEAN_SWEEP, "lean")])


def flash_attention_mma_fa2_lean_config(head_dim: int, block_q: int | None = None, block_k: int | None = None,
                                        min_blocks: int | None = None) -> tuple[int, int, int]:
    """``(block_q, block_k, min_blocks)`` of the lean rung at ``head_dim``: the rules and defaults of
    :func:`flash_attention_mma_fa2_wide_config` (d = 64: (128, 64, 2); d = 128: (128, 32, 2)) over
    :data:`FA2_LEAN_SWEEP`. Raises TypeError for a non-integer (bools included), ValueError naming the argument
    and listing what it may be otherwise."""
    return _tile_config(head_dim, block_q, block_k, min_blocks, FA2_LEAN_CONFIGS, FA2_LEAN_SWEEP, "lean", 32,
                        "the others spill on sm_90")


def flash_attention_mma_fa2_lean_build(head_dim: int, dtype: str = "float16", trace: bool = False,
                                       block_q: int | None = None, block_k: int | None = None,
                                       min_blocks: int | None = None) -> "KernelBuild":
    """The :class:`KernelBuild` of the lean rung: the wide rung's build (:func:`flash_attention_mma_fa2_wide_build`)
    with ``FA2_LEAN=1`` (entry points ``flash_attention_mma_fa2_lean`` and the pre-pass
    ``flash_attention_mma_fa2_lean_v_flags``), tiles from :func:`flash_attention_mma_fa2_lean_config`. The main
    kernel's shared memory is the wide rung's, all dynamic; the pre-pass uses none."""
    if dtype not in MMA_DTYPES:
        raise ValueError(f"the tensor-core kernel takes dtype float16 or bfloat16, got {dtype!r}")
    bq, bk, mb = flash_attention_mma_fa2_lean_config(head_dim, block_q, block_k, min_blocks)
    return KernelBuild.make("flash_attention_mma_fa2_lean", dtype, trace, HEAD_DIM=head_dim, BLOCK_Q=bq, BLOCK_K=bk,
                            MIN_BLOCKS=mb, LAZY_RESCALE=1, FA2_DYNAMIC_SMEM=1, WARP_ROWS=32, FA2_LEAN=1)


# ---------------------------------------------------------------------------
# the Hopper rung: TMA, mbarriers, wgmma (sm_90a)
# ---------------------------------------------------------------------------

#: the one architecture the Hopper rung compiles for: wgmma and its descriptors exist only on sm_90a
WGMMA_ARCH = "sm_90a"
#: head dim -> (block_q, block_k): 128 query rows (2 consumer warpgroups of 64) and the key tile;
#: the key tile is the N of the S product (64 x block_k x 16), chosen so that the accumulators of S
#: (block_k / 2 floats a thread), O (d / 2) and P (block_k / 4 registers) fit the 168 registers a
#: thread of a 384-thread block may have
WGMMA_CONFIGS = {64: (128, 128), 128: (128, 64)}
#: threads of a block: one producer warpgroup and two consumer warpgroups
WGMMA_THREADS = 384
#: K/V stages in flight: the plain rung, and the rung that overlaps softmax with the products (a
#: stage is released one iteration later there, so one more keeps the copies an iteration ahead)
WGMMA_STAGES = 2
WGMMA_OVERLAP_STAGES = 3
#: the kernel files of the Hopper rungs (sm_90a, 384 threads, all shared memory dynamic)
WGMMA_KERNELS = ("flash_attention_wgmma", "flash_attention_wgmma_overlap")


def flash_attention_wgmma_config(head_dim: int) -> tuple[int, int]:
    """``(block_q, block_k)`` of the Hopper rungs (:data:`WGMMA_CONFIGS`). ``head_dim`` must be
    64 or 128: TypeError for a non-integer, ValueError naming ``head_dim`` otherwise.
    Source: Shah et al. 2024 (FlashAttention-3), Sec. 3.1 (block sizes)."""
    d = check_int(head_dim, "head_dim")
    if d not in WGMMA_CONFIGS:
        raise ValueError(f"head_dim must be one of {sorted(WGMMA_CONFIGS)} for the Hopper (wgmma) kernel, got {d}")
    return WGMMA_CONFIGS[d]


def flash_attention_wgmma_smem_bytes(head_dim: int, block_k: int, stages: int = WGMMA_STAGES) -> int:
    """Dynamic shared memory of a Hopper rung in bytes: the 128-row Q tile, ``stages`` stages of a K
    and a V tile of ``block_k`` rows (16-bit values, no padding: swizzled), 1 + 3 x stages 8-byte
    mbarriers (Q; full, ready, empty per stage), a 4-byte flag per stage, and 1024 bytes of room to
    start the tiles on a 1024-byte boundary: ``2 * 128 * d + stages * 2 * 2 * block_k * d + 8 (1 + 3
    stages) + 4 stages + 1024``. Two stages at d = 128, block_k = 64: 99,392 bytes; three: 132,188.
    ``head_dim`` in 1..256, ``block_k`` in 1..1024, ``stages`` in 2..4: ints (bools refused), else
    TypeError/ValueError naming the argument."""
    head_dim = check_int(head_dim, "head_dim", min=1, max=MAX_HEAD_DIM)
    block_k = check_int(block_k, "block_k", min=1, max=1024)
    stages = check_int(stages, "stages")
    if not 2 <= stages <= 4:
        raise ValueError(f"stages must be in 2..4, got {stages}")
    return 2 * 128 * head_dim + stages * 2 * 2 * block_k * head_dim + 8 * (1 + 3 * stages) + 4 * stages + 1024


def wgmma_swizzle(row: int, col: int, rows: int, head_dim: int) -> int:
    """Byte offset of element ``(row, col)`` in a tile of ``rows`` x ``head_dim`` 16-bit values as
    TMA writes it and wgmma reads it (128-byte swizzle, ``kernels/hopper.cuh``): 64-column panels
    one after the other, rows of 128 bytes, 16-byte chunk ``c`` of row ``r`` at chunk ``c ^ (r % 8)``.
    ValueError for an element outside the tile or a head dim not a multiple of 64."""
    if head_dim % 64:
        raise ValueError(f"head_dim must be a multiple of 64 (128-byte rows), got {head_dim}")
    if not (0 <= row < rows and 0 <= col < head_dim):
        raise ValueError(f"(row, col) must lie in the {rows} x {head_dim} tile, got ({row}, {col})")
    panel, c = divmod(col, 64)
    return panel * rows * 128 + row * 128 + (((c // 8) ^ (row % 8)) << 4) + 2 * (c % 8)


def flash_attention_wgmma_build(head_dim: int, dtype: str = "float16", trace: bool = False) -> "KernelBuild":
    """The :class:`KernelBuild` of the Hopper rung (float16 or bfloat16; head dim 64 or 128).
    It compiles for :data:`WGMMA_ARCH` only. ValueError for another dtype or head dim."""
    if dtype not in MMA_DTYPES:
        raise ValueError(f"the tensor-core kernel takes dtype float16 or bfloat16, got {dtype!r}")
    _, bk = flash_attention_wgmma_config(head_dim)
    return KernelBuild.make("flash_attention_wgmma", dtype, trace, HEAD_DIM=head_dim, BLOCK_K=bk)


def flash_attention_wgmma_overlap_build(head_dim: int, dtype: str = "float16", trace: bool = False) -> "KernelBuild":
    """The :class:`KernelBuild` of the Hopper rungs that overlap softmax with the products
    (``kernels/flash_attention_wgmma_overlap.cu``, entry points ``flash_attention_wgmma_overlap`` and
    ``flash_attention_wgmma_pingpong``, the second with the consumers taking turns): the tiles of
    :func:`flash_attention_wgmma_build`, :data:`WGMMA_OVERLAP_STAGES` stages. sm_90a only. ValueError
    for another dtype or head dim."""
    if dtype not in MMA_DTYPES:
        raise ValueError(f"the tensor-core kernel takes dtype float16 or bfloat16, got {dtype!r}")
    _, bk = flash_attention_wgmma_config(head_dim)
    return KernelBuild.make("flash_attention_wgmma_overlap", dtype, trace, HEAD_DIM=head_dim, BLOCK_K=bk,
                            STAGES=WGMMA_OVERLAP_STAGES)


# ---------------------------------------------------------------------------
# paged decode (one pass and split-KV)
# ---------------------------------------------------------------------------

def paged_decode_smem_bytes(head_dim: int, block_size: int, heads_per_block: int) -> int:
    """Static shared memory of the paged decode kernels in bytes (the ``DecodeShared`` struct).

    float32 ``q[h][d+1]``, ``k[bs][d+1]``, ``v[bs][d+1]``, ``s[h][bs+1]``, ``m[h]``, ``l[h]``, ``alpha[h]``.
    """
    h, d, bs = heads_per_block, head_dim, block_size
    return 4 * (h * (d + 1) + 2 * bs * (d + 1) + h * (bs + 1) + 3 * h)


def paged_decode_config(head_dim: int, block_size: int, num_heads: int, num_kv_heads: int) -> int:
    """``heads_per_block``: how many query heads of one GQA group a decode block serves.

    The largest divisor of the group size ``num_heads // num_kv_heads`` that is at most
    8 and keeps the shared memory within 48 KiB. Raises ValueError when ``num_heads``
    is not a multiple of ``num_kv_heads``, when ``block_size`` is outside 1..32 or
    ``head_dim`` outside 1..256, or when one page of K and V does not fit.
    """
    d = _check_int(head_dim, "head_dim", 1, MAX_HEAD_DIM)
    bs = _check_int(block_size, "block_size", 1, MAX_BLOCK_SIZE)
    nh = _check_int(num_heads, "num_heads", 1, 1 << 20)
    nkv = _check_int(num_kv_heads, "num_kv_heads", 1, 1 << 20)
    if nh % nkv:
        raise ValueError(f"num_heads must be a multiple of num_kv_heads (GQA groups), got "
                         f"num_heads={nh}, num_kv_heads={nkv}")
    group = nh // nkv
    for hpb in range(min(group, MAX_HEADS_PER_BLOCK), 0, -1):
        if group % hpb == 0 and paged_decode_smem_bytes(d, bs, hpb) <= STATIC_SMEM_LIMIT:
            return hpb
    raise ValueError(f"one page of block_size={bs} tokens with head_dim={d} needs "
                     f"{paged_decode_smem_bytes(d, bs, 1)} bytes of shared memory, more than "
                     f"{STATIC_SMEM_LIMIT}; use a smaller block_size")


# ---------------------------------------------------------------------------
# paged decode, one block per (sequence, GQA group, split), 16-byte loads
# ---------------------------------------------------------------------------

#: most query heads one block of ``paged_decode_gqa_split`` serves (each lane keeps q and o of
#: every head in registers: 2 x 4 heads x 8 values at most)
MAX_SPLIT_HEADS_PER_BLOCK = 4
#: streaming multiprocessors of one NVIDIA H200 (SXM): the default GPU :func:`decode_splits` fills
H200_NUM_SMS = 132


def paged_decode_split_layout(head_dim: int, dtype: str = "float16") -> dict:
    """How ``paged_decode_gqa_split`` spreads a key row over a warp (the kernel's macros, in Python).

    ``vec``: values per load (16 bytes: 8 halves or 4 floats, when ``head_dim`` is a multiple of
    that; else 1); ``lanes``: lanes reading one row (the smallest power of two >= head_dim / vec,
    at most 32); ``chunks``: loads per lane per row; ``keys_per_warp``: rows a warp reads side
    by side (32 / lanes); ``num_states``: running states per block of 4 warps, merged at the end;
    ``unroll``: keys per lane group per step (all their K and V loads issued first; at most 4, and
    2 for bfloat16, whose rows ptxas otherwise holds widened to float32 and spills).
    At d = 128 in float16: vec 8, lanes 16, chunks 1, keys_per_warp 2, num_states 8, unroll 4.
    Raises ValueError for a head dim outside 1..256 or an unknown dtype.
    """
    d = _check_int(head_dim, "head_dim", 1, MAX_HEAD_DIM)
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    vec16 = 4 if dtype == "float32" else 8
    vec = vec16 if d % vec16 == 0 else 1
    n_vec = d // vec
    lanes = 1
    while lanes < min(n_vec, 32):
        lanes *= 2
    chunks = -(-n_vec // lanes)
    words = 1 if vec == 1 else 4
    unroll = max(1, min(2 if dtype == "bfloat16" else 4, 32 // (2 * chunks * words)))
    return dict(vec=vec, lanes=lanes, chunks=chunks, keys_per_warp=32 // lanes,
                num_states=(NUM_THREADS // 32) * (32 // lanes), unroll=unroll)


def paged_decode_split_smem_bytes(head_dim: int, heads_per_block: int, dtype: str = "float16",
                                  async_stages: int = 0) -> int:
    """Static shared memory of ``paged_decode_gqa_split`` in bytes: float32 ``m[S][h]``, ``l[S][h]``,
    ``o[S][h][d]`` for the block's ``S = num_states`` running states (see :func:`paged_decode_split_layout`).
    With ``async_stages`` > 0 (the cp.async build's ``ASYNC_STAGES``) the ring of that many steps shares the
    space (a union: the states are written after the last copy has landed), and the larger of the two counts:
    ``async_stages x unroll x 2 (K, V) x chunks x 128 threads x 16`` bytes."""
    layout = paged_decode_split_layout(head_dim, dtype)
    merge = 4 * layout["num_states"] * heads_per_block * (head_dim + 2)
    ring = async_stages * layout["unroll"] * 2 * layout["chunks"] * NUM_THREADS * 16
    return max(merge, ring)


def paged_decode_split_config(head_dim: int, block_size: int, num_heads: int, num_kv_heads: int) -> int:
    """``heads_per_block`` of ``paged_decode_gqa_split``: the largest divisor of the group size
    ``num_heads // num_kv_heads`` that is at most 4 (so a group of 4, as in 32 query heads on 8 KV
    heads, is one block and each K/V row is read once per group). Raises ValueError when
    ``num_heads`` is not a multiple of ``num_kv_heads``, or ``block_size`` / ``head_dim`` are outside
    1..32 / 1..256."""
    _check_int(head_dim, "head_dim", 1, MAX_HEAD_DIM)
    _check_int(block_size, "block_size", 1, MAX_BLOCK_SIZE)
    nh = _check_int(num_heads, "num_heads", 1, 1 << 20)
    nkv = _check_int(num_kv_heads, "num_kv_heads", 1, 1 << 20)
    if nh % nkv:
        raise ValueError(f"num_heads must be a multiple of num_kv_heads (GQA groups), got "
                         f"num_heads={nh}, num_kv_heads={nkv}")
    group = nh // nkv
    return max(h for h in range(1, MAX_SPLIT_HEADS_PER_BLOCK + 1) if group % h == 0)


#: blocks per SM of ``paged_decode_gqa_split`` without and with ``prefetch``: the launch bounds it is built with
#: and the wave :func:`decode_splits` fills. Prefetching holds two steps' K/V rows in registers (168 registers at
#: d = 128 in float16, NVRTC 12.9; capped at 128 for 4 blocks it would spill 224 / 248 bytes on sm_80 / sm_90),
#: so 3 blocks fit.
DECODE_BLOCKS_PER_SM = {False: 4, True: 3}
#: steps of K/V rows in flight in the ``paged_decode_cp_async`` rung's ring in shared memory (``ASYNC_STAGES``):
#: a thread's copies of the two steps after the one it absorbs are in flight while it absorbs it. The ring takes
#: 16 KiB per step at d = 128 in float16 (128 threads x 4 keys x K and V x 16 bytes), 48 KiB in all, so 4 blocks
#: fit on an H100 / H200 SM (228 KiB) and 3 on an A100's (164 KiB)
DECODE_ASYNC_STAGES = 3
#: blocks per SM the ``paged_decode_cp_async`` build is made for (its launch bounds) and whose wave its automatic
#: split count fills: 4, as the plain build (its rows wait in shared memory, not in registers: 128 registers)
DECODE_ASYNC_BLOCKS_PER_SM = 4


def _split_build_flags(prefetch, cp_async) -> tuple[bool, bool]:
    """``(prefetch, cp_async)`` as bools naming one build of ``paged_decode_split.cu``: TypeError naming either for
    a non-bool, ValueError when both are True (no build does both)."""
    prefetch, cp_async = check_flag(prefetch, "prefetch"), check_flag(cp_async, "cp_async")
    if prefetch and cp_async:
        raise ValueError("prefetch and cp_async are two ways to keep loads in flight (in registers, in shared "
                         "memory): give at most one of them")
    return prefetch, cp_async


def paged_decode_split_build(head_dim: int, block_size: int, num_heads: int, num_kv_heads: int,
                             dtype: str = "float16", prefetch: bool = False, cp_async: bool = False) -> "KernelBuild":
    """The :class:`KernelBuild` of ``paged_decode_split.cu`` (see :func:`paged_decode_split_config`).

    ``prefetch`` (bool): the ``paged_decode_prefetch`` rung's build (``PREFETCH=1``): each lane group issues
    the loads of its next step's K/V rows before it absorbs this step's, so loads stay in flight while it
    computes; built for :data:`DECODE_BLOCKS_PER_SM` ``[True]`` = 3 blocks per SM (``MIN_BLOCKS``).
    ``cp_async`` (bool): the ``paged_decode_cp_async`` rung's build (``ASYNC_STAGES`` =
    :data:`DECODE_ASYNC_STAGES`): each thread copies its 16-byte pieces of K and V straight into a ring in
    shared memory with cp.async (sm_80+), two steps ahead of the step it absorbs, so the rows in flight hold no
    registers; 4 blocks per SM. Either output is bitwise the plain build's (the same keys, in the same order,
    per lane group). TypeError naming ``prefetch`` or ``cp_async`` for a non-bool; ValueError when both are
    True, for a ``dtype`` other than float32 / float16 / bfloat16, or for ``cp_async`` with a ``head_dim`` whose row
    is not a whole number of 16-byte pieces (a multiple of 8 in float16 / bfloat16, of 4 in float32)."""
    hpb = paged_decode_split_config(head_dim, block_size, num_heads, num_kv_heads)
    if not isinstance(dtype, str) or dtype not in DTYPES:     # (before the pieces per row, which depend on it)
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    prefetch, cp_async = _split_build_flags(prefetch, cp_async)
    extra = {}
    if prefetch:
        extra = dict(PREFETCH=1, MIN_BLOCKS=DECODE_BLOCKS_PER_SM[True])
    elif cp_async:
        per_piece = 4 if dtype == "float32" else 8              # values per 16 bytes
        if head_dim % per_piece:
            raise ValueError(f"cp_async copies 16-byte pieces of each row: head_dim must be a multiple of "
                             f"{per_piece} in {dtype}, got {head_dim}")
        extra = dict(ASYNC_STAGES=DECODE_ASYNC_STAGES, MIN_BLOCKS=DECODE_ASYNC_BLOCKS_PER_SM)
    return KernelBuild.make("paged_decode_split", dtype, False, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                            HEADS_PER_BLOCK=hpb, **extra)


def paged_decode_split_auto_splits(num_seqs: int, seq_len: int, head_dim: int, block_size: int, num_heads: int,
                                   num_kv_heads: int, *, num_sms: int = H200_NUM_SMS, prefetch: bool = False,
                                   cp_async: bool = False) -> int:
    """The split count ``paged_decode_split_gpu(..., num_splits=None)`` runs: :func:`decode_splits` for one block per
    ``heads_per_block`` query heads of a group (:func:`paged_decode_split_config`), ``num_sms`` SMs and the build's
    blocks per SM (3 with ``prefetch``, else 4, ``cp_async`` included). ``seq_len``: the longest sequence in tokens (the
    launcher passes its block table's width times ``block_size``). The launcher, the decode benchmark and the split
    sweep all ask this one function. Errors as decode_splits and paged_decode_split_config; TypeError naming
    ``prefetch`` or ``cp_async`` for a non-bool, ValueError when both are True. At 32 query heads on 8 KV heads, d = 128, pages of 16, an H200: 1 x 131072 ->
    66 splits, 49 with prefetch."""
    hpb = paged_decode_split_config(head_dim, block_size, num_heads, num_kv_heads)
    return decode_splits(num_seqs, num_kv_heads, seq_len, block_size=block_size,
                         heads_per_kv_head=num_heads // num_kv_heads // hpb, num_sms=num_sms,
                         blocks_per_sm=paged_decode_split_blocks_per_sm(prefetch=prefetch, cp_async=cp_async))


def paged_decode_split_blocks_per_sm(*, prefetch: bool = False, cp_async: bool = False) -> int:
    """Blocks per SM the split decode build is made for (its launch bounds), and so the wave its automatic split
    count fills: :data:`DECODE_ASYNC_BLOCKS_PER_SM` (4) with ``cp_async``, else :data:`DECODE_BLOCKS_PER_SM`
    (3 with ``prefetch``, 4 without). TypeError naming ``prefetch`` or ``cp_async`` for a non-bool; ValueError when
    both are True, as :func:`paged_decode_split_build` (no build does both)."""
    prefetch, cp_async = _split_build_flags(prefetch, cp_async)
    if cp_async:
        return DECODE_ASYNC_BLOCKS_PER_SM
    return DECODE_BLOCKS_PER_SM[prefetch]


def decode_splits(num_seqs: int, num_kv_heads: int, seq_len: int, *, block_size: int = 16,
                  heads_per_kv_head: int = 1, num_sms: int = H200_NUM_SMS, blocks_per_sm: int = 4,
                  max_splits: int = 65535) -> int:
    """How many splits flash-decoding should cut each sequence into, from the shape: the most whose blocks
    fit in one wave, ``min(pages, max_splits, max(1, wave // blocks_per_split))``.

    The grid has ``blocks_per_split = num_seqs * num_kv_heads * heads_per_kv_head`` blocks per split (one per
    sequence and GQA group; ``heads_per_kv_head`` blocks per group when a group is served by several blocks).
    The GPU runs ``wave = num_sms * blocks_per_sm`` blocks at once (132 SMs x 4 on an H200). Never more splits
    than the ``pages = ceil(seq_len / block_size)`` of the longest sequence (a split of no page does nothing)
    nor than ``max_splits``; never fewer than 1 (a split wider than a wave runs as it is).

    Why not one more: in the wave model (:func:`decode_split_cost`, time = waves x pages per block) the fewest
    splits that fill a wave can spill a few blocks into a second wave as long as the first. At 8 x 32768
    tokens, 9 splits are 576 blocks, 528 + 48: 2 x 228 pages against 8 splits' 1 x 256. It never wins: with
    ``f = wave // blocks_per_split >= 1``, ``f + 1`` splits take two waves, and ``2 ceil(p / (f + 1)) >=
    ceil(p / f)`` (a tie goes to the fewer splits). Counts of several waves can be a few percent cheaper in
    the model (8 x 32768: 41 splits, 5 waves x 50 = 250), but never by more than the pick's distance to
    ``blocks_per_split x pages / wave`` (every slot busy), and they write more partial states to merge and
    assume blocks that finish in lockstep.

    At 32 query heads on 8 KV heads, pages of 16, an H200: 64 x 4096 tokens -> 1, 8 x 32768 -> 8,
    1 x 131072 -> 66, 1 x 100 -> 7 (the pages).
    Integers in, an int out; raises TypeError/ValueError naming a bad argument.
    Source: the split heuristic of Dao, Haziza, Massa, Sizov 2023 ("Flash-Decoding"; FlashAttention-2's
    ``num_splits_heuristic`` weighs the same wave efficiency), reduced to one wave of resident blocks.
    """
    num_seqs = _check_int(num_seqs, "num_seqs", 0, 1 << 31)
    num_kv_heads = _check_int(num_kv_heads, "num_kv_heads", 1, 1 << 20)
    seq_len = _check_int(seq_len, "seq_len", 0, 1 << 40)
    block_size = _check_int(block_size, "block_size", 1, 1 << 20)
    heads_per_kv_head = _check_int(heads_per_kv_head, "heads_per_kv_head", 1, 1 << 20)
    num_sms = _check_int(num_sms, "num_sms", 1, 1 << 20)
    blocks_per_sm = _check_int(blocks_per_sm, "blocks_per_sm", 1, 1 << 10)
    max_splits = _check_int(max_splits, "max_splits", 1, 1 << 31)
    pages = -(-seq_len // block_size)
    per_split = num_seqs * num_kv_heads * heads_per_kv_head
    if per_split == 0 or pages <= 1:
        return 1
    return min(pages, max_splits, max(1, num_sms * blocks_per_sm // per_split))


def decode_split_cost(num_splits: int, blocks_per_split: int, pages: int, wave: int) -> int:
    """The wave model behind :func:`decode_splits`: time in pages read by one block, ``waves * pages_per_block``
    (the two factors: :func:`decode_split_terms`). A model for a kernel bound by memory, whose
    blocks all take about as long: a wave lasts as long as one block, however few blocks it holds.
    Example: 8 sequences x 32768 tokens (2048 pages), 64 blocks per split, a wave of 528 blocks:
    8 splits cost 1 x 256, 9 splits 2 x 228. All arguments positive ints (ValueError/TypeError otherwise)."""
    waves, pages_per_block = decode_split_terms(num_splits, blocks_per_split, pages, wave)
    return waves * pages_per_block


def decode_split_terms(num_splits: int, blocks_per_split: int, pages: int, wave: int) -> tuple[int, int]:
    """The two factors of :func:`decode_split_cost`: ``waves = ceil(num_splits * blocks_per_split / wave)`` (a
    wave: the blocks the GPU runs at once) and ``pages_per_block = ceil(pages / num_splits)``, the pages of the
    longest split. Example: 9 splits of 64 blocks, 2048 pages, a wave of 528 -> (2, 228). All arguments positive
    ints (ValueError/TypeError otherwise)."""
    num_splits = _check_int(num_splits, "num_splits", 1, 1 << 31)
    blocks_per_split = _check_int(blocks_per_split, "blocks_per_split", 1, 1 << 40)
    pages = _check_int(pages, "pages", 1, 1 << 40)
    wave = _check_int(wave, "wave", 1, 1 << 40)
    return -(-num_splits * blocks_per_split // wave), -(-pages // num_splits)


#: the most split counts :func:`decode_split_sweep` costs (a dict of one entry per count)
_MAX_SWEEP_SPLITS = 1 << 20


def decode_split_sweep(num_seqs: int, seq_len: int, *, num_heads: int = 32, num_kv_heads: int = 8,
                       head_dim: int = 128, block_size: int = 16, num_sms: int = H200_NUM_SMS,
                       blocks_per_sm: int = 4, max_splits: int | None = None) -> dict:
    """The wave model of :func:`decode_splits` laid out for one decode shape of ``paged_decode_split``: its pick,
    the count after it, and the modelled time of every split count from 1 to ``max_splits``.

    ``num_seqs`` sequences of ``seq_len`` tokens, ``num_heads`` query heads on ``num_kv_heads`` KV heads of
    ``head_dim`` (the blocks per group from :func:`paged_decode_split_config`), pages of ``block_size`` tokens,
    a wave of ``num_sms x blocks_per_sm`` blocks. ``max_splits``: the last count costed (default: twice the
    fewest that fill the wave, at least 8, at most the pages and 2**20; ``pages`` gives the model's full sweep).
    Returns a dict: ``blocks_per_split``, ``pages``, ``wave``, ``fit`` and ``fill`` (the most splits whose blocks
    fit in one wave and the fewest that fill it, within 1..pages), ``pick`` (:func:`decode_splits` for the
    shape: ``fit``), ``costs`` (``{splits: waves x pages per block}``, :func:`decode_split_cost`, for
    1..max_splits), ``best`` (the count of least modelled time among ``costs``, the fewest splits on a tie:
    it may take several waves) and ``bound`` (``blocks_per_split x pages / wave``: the time in pages if every
    slot of every wave were busy to the end, the least any split count could take); every value a Python int
    (``bound`` a float), whatever ints came in. Raises TypeError/ValueError naming a bad argument (as
    :func:`decode_splits` and :func:`paged_decode_split_config`; ``max_splits`` at most 2**20, the blocks per
    split at most 2**40). Example, 8 x 32768
    tokens on an H200: 64 blocks per split, 2048 pages, a wave of 528; fit 8, fill 9; costs[8] = 256,
    costs[9] = 456; pick 8; with ``max_splits=2048`` best 683 (83 waves x 3 = 249).
    Source: the model of :func:`decode_split_cost`."""
    num_seqs = _check_int(num_seqs, "num_seqs", 1, 1 << 31)
    seq_len = _check_int(seq_len, "seq_len", 1, 1 << 40)
    hpb = paged_decode_split_config(head_dim, block_size, num_heads, num_kv_heads)
    # (validated there; as Python ints here, so that NumPy ints neither overflow nor leak into the result)
    num_heads, num_kv_heads, block_size = int(num_heads), int(num_kv_heads), int(block_size)
    num_sms = _check_int(num_sms, "num_sms", 1, 1 << 20)
    blocks_per_sm = _check_int(blocks_per_sm, "blocks_per_sm", 1, 1 << 10)
    per_split = num_seqs * num_kv_heads * (num_heads // num_kv_heads // hpb)
    if per_split > 1 << 40:
        raise ValueError(f"num_seqs x num_kv_heads x blocks per group must be at most 2**40 blocks per split, got "
                         f"{num_seqs} x {num_kv_heads} x {num_heads // num_kv_heads // hpb} = {per_split}")
    pages = -(-seq_len // block_size)
    wave = num_sms * blocks_per_sm
    fit = max(1, min(wave // per_split, pages))
    fill = max(1, min(-(-wave // per_split), pages))
    if max_splits is None:
        max_splits = min(pages, max(8, 2 * fill), _MAX_SWEEP_SPLITS)
    max_splits = _check_int(max_splits, "max_splits", 1, _MAX_SWEEP_SPLITS)
    pick = decode_splits(num_seqs, num_kv_heads, seq_len, block_size=block_size,
                         heads_per_kv_head=num_heads // num_kv_heads // hpb, num_sms=num_sms,
                         blocks_per_sm=blocks_per_sm)
    costs = {s: decode_split_cost(s, per_split, pages, wave) for s in range(1, max_splits + 1)}
    return dict(blocks_per_split=per_split, pages=pages, wave=wave, fit=fit, fill=fill, pick=pick, costs=costs,
                best=min(costs, key=lambda s: (costs[s], s)), bound=per_split * pages / wave)


#: the keys of a :func:`decode_split_sweep` result
SPLIT_SWEEP_KEYS = ("blocks_per_split", "pages", "wave", "fit", "fill", "pick", "costs", "best", "bound")


def _positive_number(value) -> bool:
    """Whether ``value`` is a real number (NumPy's too, not a bool) above 0 and finite."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0
            and (isinstance(value, numbers.Integral) or math.isfinite(value)))   # (an int of any size is finite)


def check_split_sweep(sweep, where: str) -> dict:
    """``sweep`` if it is a :func:`decode_split_sweep` result that a table or figure of it can be drawn from: a
    dict with every key of :data:`SPLIT_SWEEP_KEYS`; ``blocks_per_split``, ``pages``, ``wave``, ``pick`` and ``best``
    ints of at least 1 (NumPy ints too; bools and floats are not); ``bound`` a positive finite number; ``costs`` a
    non-empty dict of split counts (ints) to positive finite numbers that holds the ``pick`` and the ``best``.
    ``where`` names it in the errors (e.g. ``"sweeps[(8, 32768)]"``). TypeError for a sweep that is not a dict,
    lacks keys (naming them) or holds a value of the wrong type (naming it: costs keyed by strings are a sweep read
    back from JSON), ValueError for a count below 1, a ``bound`` or a cost that is not a positive finite number,
    and costs that leave out the pick (a sweep of ``max_splits`` below the pick: give ``max_splits`` >= the
    pick)."""
    if not isinstance(sweep, dict):
        raise TypeError(f"{where} must be the dict decode_split_sweep(...) returns, got {type(sweep).__name__}")
    missing = [k for k in SPLIT_SWEEP_KEYS if k not in sweep]
    if missing:
        raise TypeError(f"{where} lacks {', '.join(missing)}: expected the dict decode_split_sweep(...) returns "
                        f"(keys {', '.join(SPLIT_SWEEP_KEYS)})")
    for key in ("blocks_per_split", "pages", "wave", "pick", "best"):
        value = sweep[key]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{where}[{key!r}] must be an int of at least 1, got {type(value).__name__} {value!r:.40}")
        if value < 1:
            raise ValueError(f"{where}[{key!r}] must be an int of at least 1, got {type(value).__name__} {value!r}")
    if not _positive_number(sweep["bound"]):
        raise ValueError(f"{where}['bound'] must be a positive finite number, got {sweep['bound']!r:.40}")
    costs = sweep["costs"]
    if not isinstance(costs, dict) or not costs:
        raise ValueError(f"{where}['costs'] must be a non-empty dict {{splits: modelled time}}, got {costs!r:.80}")
    for k, v in costs.items():
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise TypeError(f"{where}['costs'] must be keyed by split counts (ints), got the key {k!r:.40} "
                            f"({type(k).__name__})" + (": a sweep read back from JSON? JSON keys are strings; "
                                                        "compute it again with decode_split_sweep(...)"
                                                        if isinstance(k, str) else ""))
        if not _positive_number(v):
            raise ValueError(f"{where}['costs'][{k!r}] must be a positive finite number, got {v!r:.40}")
    for key in ("pick", "best"):
        if sweep[key] not in costs:
            raise ValueError(f"{where}['costs'] holds {min(costs)}..{max(costs)} splits, not the {key} "
                             f"({sweep[key]!r}): sweep with decode_split_sweep(..., max_splits) >= {sweep[key]!r}")
    return sweep


def cheaper_than_pick(sweep: dict) -> list[int]:
    """The split counts of a :func:`decode_split_sweep` result whose modelled time is below its pick's, ascending
    (all of them take several waves; empty when the pick is the cheapest count costed). TypeError/ValueError as
    :func:`check_split_sweep` for a sweep that is not such a result."""
    costs = check_split_sweep(sweep, "sweep")["costs"]
    return sorted(k for k in costs if costs[k] < costs[sweep["pick"]])


def online_softmax_smem_bytes(tile: int) -> int:
    """Static shared memory of ``online_softmax`` in bytes: one float per warp."""
    return 4 * (tile // 32)


# ---------------------------------------------------------------------------
# flash attention backward (preprocess D, dK/dV, dQ)
# ---------------------------------------------------------------------------

#: largest head dim of the backward kernels (their four float32 tiles must share 48 KiB)
MAX_BACKWARD_HEAD_DIM = 128
#: most (query, key) pairs of a tile one thread of the backward recomputes (block_q * block_k / 128)
MAX_BACKWARD_PAIRS_PER_THREAD = 16
#: default (block_q, block_k) of the backward, largest first; the first that fits is taken
BACKWARD_TILE_PREFERENCE = ((32, 64), (32, 32), (16, 32), (16, 16), (8, 16))
#: most dK_j + dV_j accumulators one thread of the dK/dV kernel holds in registers,
#: 2 * ceil(d / (128 // block_k)); above it ptxas spills (measured: 58 spill at 128 registers/thread)
MAX_BACKWARD_ACCUMULATORS = 56


def _backward_accumulators(head_dim: int, block_k: int) -> int:
    return 2 * -(-head_dim // (NUM_THREADS // block_k))


def _backward_fits(head_dim: int, block_q: int, block_k: int) -> bool:
    return (max(flash_attention_backward_smem_bytes(head_dim, block_q, block_k).values()) <= STATIC_SMEM_LIMIT
            and _backward_accumulators(head_dim, block_k) <= MAX_BACKWARD_ACCUMULATORS)


def flash_attention_backward_smem_bytes(head_dim: int, block_q: int, block_k: int) -> dict:
    """Static shared memory of each backward entry point in bytes, as a dict entry -> bytes.

    ``flash_attention_backward_dkdv``: float32 ``k_s, v_s [block_k][d+1]``, ``q_s, do_s [block_q][d+1]``,
    ``p_s, ds_s [block_k][block_q+1]``, ``lse_s, delta_s [block_q]``;
    ``flash_attention_backward_dq``: ``q_s, do_s [block_q][d+1]``, ``k_s, v_s [block_k][d+1]``,
    ``ds_s [block_q][block_k+1]``; ``flash_attention_backward_preprocess``: none.
    """
    tiles = 2 * (block_q + block_k) * (head_dim + 1)
    return {"flash_attention_backward_preprocess": 0,
            "flash_attention_backward_dkdv": 4 * (tiles + 2 * block_k * (block_q + 1) + 2 * block_q),
            "flash_attention_backward_dq": 4 * (tiles + block_q * (block_k + 1))}


def flash_attention_backward_config(head_dim: int, block_q: int | None = None,
                                    block_k: int | None = None) -> tuple[int, int]:
    """Tile sizes ``(block_q, block_k)`` (Br, Bc) of the backward kernels for head dim ``d``.

    The same two sizes serve both passes: the dK/dV kernel holds ``block_k`` keys and streams
    query blocks of ``block_q`` rows; the dQ kernel holds ``block_q`` rows and streams key blocks
    of ``block_k``. Default: the first of :data:`BACKWARD_TILE_PREFERENCE` (largest tiles first)
    whose tiles fit 48 KiB of static shared memory and whose dK/dV accumulators fit in registers
    (:data:`MAX_BACKWARD_ACCUMULATORS`): (32, 64) for d <= 40, (32, 32) for d <= 78, (16, 32) for
    d <= 112, (16, 16) up to 128. One given alone takes 16 for the other. Given,
    each must be a power of two dividing 128 (4, 8, 16, 32, 64, 128), with
    ``128 <= block_q * block_k <= 2048`` (each thread recomputes 1..16 (query, key) pairs of a tile).
    ``head_dim`` must be in 1..128 (four float32 tiles of d = 256 do not fit).
    Raises TypeError / ValueError naming the argument, also when the tiles need more than 48 KiB
    or more than 56 accumulators per thread.
    """
    d = _check_int(head_dim, "head_dim", 1, 1 << 30)
    if d > MAX_BACKWARD_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_BACKWARD_HEAD_DIM} for the backward kernels "
                         f"(their Q, dO, K, V tiles must fit 48 KiB of shared memory), got {d}")
    if block_q is None and block_k is None:
        block_q, block_k = next((bq, bk) for bq, bk in BACKWARD_TILE_PREFERENCE if _backward_fits(d, bq, bk))
    elif block_q is None:
        block_q = 16
    elif block_k is None:
        block_k = 16
    bq = _check_int(block_q, "block_q", 1, NUM_THREADS)
    bk = _check_int(block_k, "block_k", 1, NUM_THREADS)
    for name, value in (("block_q", bq), ("block_k", bk)):
        if value not in (4, 8, 16, 32, 64, 128):
            raise ValueError(f"{name} must be one of 4, 8, 16, 32, 64, 128 (a power of two dividing 128), "
                             f"got {value}")
    if not NUM_THREADS <= bq * bk <= NUM_THREADS * MAX_BACKWARD_PAIRS_PER_THREAD:
        raise ValueError(f"block_q * block_k must be in {NUM_THREADS}..{NUM_THREADS * MAX_BACKWARD_PAIRS_PER_THREAD} "
                         f"(1..{MAX_BACKWARD_PAIRS_PER_THREAD} pairs per thread), got block_q={bq}, block_k={bk}")
    smem = max(flash_attention_backward_smem_bytes(d, bq, bk).values())
    if smem > STATIC_SMEM_LIMIT:
        raise ValueError(f"block_q={bq}, block_k={bk} with head_dim={d} need {smem} bytes of shared memory, "
                         f"more than the {STATIC_SMEM_LIMIT} allowed; use smaller tiles")
    acc = _backward_accumulators(d, bk)
    if acc > MAX_BACKWARD_ACCUMULATORS:
        raise ValueError(f"block_k={bk} with head_dim={d} leaves each thread {acc} dK/dV accumulators, more than "
                         f"the {MAX_BACKWARD_ACCUMULATORS} that stay in registers; use a smaller block_k")
    return bq, bk


def flash_attention_backward_build(head_dim: int, dtype: str = "float32", trace: bool = False,
                                   block_q: int | None = None, block_k: int | None = None) -> "KernelBuild":
    """The :class:`KernelBuild` of the backward kernels (see :func:`flash_attention_backward_config`)."""
    bq, bk = flash_attention_backward_config(head_dim, block_q, block_k)
    return KernelBuild.make("flash_attention_backward", dtype, trace, HEAD_DIM=head_dim, BLOCK_Q=bq, BLOCK_K=bk)


# ---------------------------------------------------------------------------
# flash attention backward on tensor cores (mma.sync): dK/dV and dQ
# ---------------------------------------------------------------------------

#: head dims the tensor-core backward is written for
BACKWARD_MMA_HEAD_DIMS = (64, 128)
#: keys per block of its dK/dV kernel and query rows per block of its dQ kernel (4 warps x 16)
BACKWARD_MMA_HELD = 64
#: default (dkdv_block_q, dq_block_k) per head dim: the largest tiles that fit 48 KiB of shared
#: memory and leave ptxas no reason to spill
BACKWARD_MMA_TILES = {64: (64, 64), 128: (16, 64)}


def flash_attention_backward_mma_smem_bytes(head_dim: int, dkdv_block_q: int, dq_block_k: int) -> dict:
    """Static shared memory of each tensor-core backward entry point in bytes, entry -> bytes.

    ``flash_attention_backward_mma_dkdv``: 16-bit ``k_s, v_s [64][d+8]``, ``q_s, do_s
    [dkdv_block_q][d+8]``, float32 ``lse_s, delta_s [dkdv_block_q]``;
    ``flash_attention_backward_mma_dq``: 16-bit ``k_s, v_s [dq_block_k][d+8]``.
    """
    pitch = head_dim + 8
    return {"flash_attention_backward_mma_dkdv": 2 * 2 * (BACKWARD_MMA_HELD + dkdv_block_q) * pitch + 2 * 4 * dkdv_block_q,
            "flash_attention_backward_mma_dq": 2 * 2 * dq_block_k * pitch}


def flash_attention_backward_mma_config(head_dim: int, dkdv_block_q: int | None = None,
                                        dq_block_k: int | None = None) -> tuple[int, int]:
    """Tile sizes ``(dkdv_block_q, dq_block_k)`` of the tensor-core backward for head dim ``d``.

    The dK/dV kernel holds 64 keys (4 warps x 16) and streams query blocks of ``dkdv_block_q``
    rows; the dQ kernel holds 64 query rows and streams key blocks of ``dq_block_k`` keys.
    ``head_dim`` must be 64 or 128. Defaults (:data:`BACKWARD_MMA_TILES`): (64, 64) for d = 64,
    (16, 64) for d = 128 (the dK/dV kernel's four tiles of d = 128 leave room for only 16
    query rows in 48 KiB). Given, each must be 16, 32, 48 or 64 and fit 48 KiB.
    Raises TypeError / ValueError naming the argument.
    """
    d = check_int(head_dim, "head_dim")
    if d not in BACKWARD_MMA_HEAD_DIMS:
        raise ValueError(f"head_dim must be 64 or 128 for the tensor-core backward, got {d}; "
                         f"flash_attention_backward_gpu takes any head dim up to {MAX_BACKWARD_HEAD_DIM}")
    default_q, default_k = BACKWARD_MMA_TILES[d]
    bq = default_q if dkdv_block_q is None else _check_int(dkdv_block_q, "dkdv_block_q", 16, 64)
    bk = default_k if dq_block_k is None else _check_int(dq_block_k, "dq_block_k", 16, 64)
    for name, value in (("dkdv_block_q", bq), ("dq_block_k", bk)):
        if value % 16:
            raise ValueError(f"{name} must be a multiple of 16 (the mma tile), got {value}")
    for entry, smem in flash_attention_backward_mma_smem_bytes(d, bq, bk).items():
        if smem > STATIC_SMEM_LIMIT:
            raise ValueError(f"dkdv_block_q={bq}, dq_block_k={bk} with head_dim={d}: {entry} needs {smem} bytes "
                             f"of shared memory, more than the {STATIC_SMEM_LIMIT} allowed; use smaller tiles")
    return bq, bk


def flash_attention_backward_mma_build(head_dim: int, dtype: str = "float16", dkdv_block_q: int | None = None,
                                       dq_block_k: int | None = None) -> "KernelBuild":
    """The :class:`KernelBuild` of the tensor-core backward (float16 or bfloat16 storage; see
    :func:`flash_attention_backward_mma_config`). Raises ValueError for another dtype."""
    if dtype not in MMA_DTYPES:
        raise ValueError(f"the tensor-core backward takes dtype float16 or bfloat16, got {dtype!r}; "
                         f"use flash_attention_backward_gpu for float32")
    bq, bk = flash_attention_backward_mma_config(head_dim, dkdv_block_q, dq_block_k)
    return KernelBuild.make("flash_attention_backward_mma", dtype, False, HEAD_DIM=head_dim, DKDV_BLOCK_Q=bq,
                            DQ_BLOCK_K=bk)


# ---------------------------------------------------------------------------
# builds: one kernel file + its -D options
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelBuild:
    """One compile-time specialisation of a kernel file.

    ``kernel`` is a key of :data:`KERNELS`; ``dtype`` a key of :data:`DTYPES`;
    ``trace`` turns on ``-DFA_TRACE``; ``defines`` holds the other ``-D`` constants
    (HEAD_DIM, BLOCK_Q, BLOCK_K, BLOCK_SIZE, HEADS_PER_BLOCK, TILE).
    """

    kernel: str
    dtype: str = "float32"
    trace: bool = False
    defines: tuple = field(default_factory=tuple)   # sorted (name, int) pairs

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {self.kernel!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @classmethod
    def make(cls, kernel: str, dtype: str = "float32", trace: bool = False, **defines) -> "KernelBuild":
        """A build of ``kernel`` in storage ``dtype`` with integer ``defines``; ``trace`` a bool (TypeError
        naming it otherwise: a string such as "no" would switch the trace build on)."""
        return cls(kernel, dtype, check_flag(trace, "trace"), tuple(sorted((k, int(v)) for k, v in defines.items())))

    @property
    def entries(self) -> tuple:
        return KERNELS[self.kernel]

    @property
    def options(self) -> tuple:
        """The compiler options, e.g. ``('-DFA_DTYPE=1', '-DHEAD_DIM=128', ...)``."""
        opts = [f"-DFA_DTYPE={DTYPES[self.dtype]}"] + [f"-D{k}={v}" for k, v in self.defines]
        if self.trace:
            opts.append("-DFA_TRACE")
        return tuple(opts)

    @property
    def smem_bytes(self) -> int:
        """Static shared memory this build declares, computed from its constants (bytes)."""
        d = dict(self.defines)
        if self.kernel == "flash_attention":
            return flash_attention_smem_bytes(d["HEAD_DIM"], d["BLOCK_Q"], d["BLOCK_K"])
        if self.kernel == "flash_attention_mma":
            return flash_attention_mma_smem_bytes(d["HEAD_DIM"], d["BLOCK_K"])
        if self.kernel == "paged_decode":
            return paged_decode_smem_bytes(d["HEAD_DIM"], d["BLOCK_SIZE"], d["HEADS_PER_BLOCK"])
        if self.kernel == "paged_decode_split":
            return paged_decode_split_smem_bytes(d["HEAD_DIM"], d["HEADS_PER_BLOCK"], self.dtype,
                                                 d.get("ASYNC_STAGES", 0))
        if self.kernel == "flash_attention_mma_async":
            return 2 * flash_attention_mma_smem_bytes(d["HEAD_DIM"], d["BLOCK_K"])
        if self.kernel == "flash_attention_mma_fa2":
            return flash_attention_mma_fa2_smem_bytes(d["HEAD_DIM"], d["BLOCK_K"])
        if self.kernel in WGMMA_KERNELS or self.kernel in ("flash_attention_mma_fa2_lazy", "flash_attention_mma_fa2_wide",
                                                          "flash_attention_mma_fa2_lean"):
            return 0                                         # (all of it dynamic: dynamic_smem_bytes)
        if self.kernel in ("flash_attention_regtile", "flash_attention_regtile_wide"):
            return 0 if d.get("REGTILE_DYNAMIC_SMEM") else flash_attention_regtile_smem_bytes(d["HEAD_DIM"],
                                                                                              d["BLOCK_Q"], d["BLOCK_K"])
        if self.kernel == "flash_attention_backward_mma":
            return max(flash_attention_backward_mma_smem_bytes(d["HEAD_DIM"], d["DKDV_BLOCK_Q"], d["DQ_BLOCK_K"]).values())
        if self.kernel == "flash_attention_backward":
            return max(flash_attention_backward_smem_bytes(d["HEAD_DIM"], d["BLOCK_Q"], d["BLOCK_K"]).values())
        return online_softmax_smem_bytes(d.get("TILE", 256))

    def entry_smem_bytes(self, entry: str) -> int:
        """Static shared memory of one entry point (bytes): :attr:`smem_bytes`, except for the
        backward, whose three entry points declare different tiles."""
        if self.kernel == "flash_attention_backward":
            d = dict(self.defines)
            return flash_attention_backward_smem_bytes(d["HEAD_DIM"], d["BLOCK_Q"], d["BLOCK_K"])[entry]
        if self.kernel == "flash_attention_backward_mma":
            d = dict(self.defines)
            return flash_attention_backward_mma_smem_bytes(d["HEAD_DIM"], d["DKDV_BLOCK_Q"], d["DQ_BLOCK_K"])[entry]
        if self.kernel == "paged_decode_split" and entry == "merge_split_states":
            return 4 * (NUM_THREADS // 32) * (2 + dict(self.defines)["HEAD_DIM"])   # per warp: max of m, l, o
        return self.smem_bytes

    @property
    def dynamic_smem_bytes(self) -> int:
        """Dynamic shared memory a launch of this build asks for (bytes); 0 for the kernels whose
        shared memory is all static."""
        if self.kernel in WGMMA_KERNELS:
            d = dict(self.defines)
            return flash_attention_wgmma_smem_bytes(d["HEAD_DIM"], d["BLOCK_K"], d.get("STAGES", WGMMA_STAGES))
        if self.kernel == "flash_attention_mma_fa2_lazy":
            d = dict(self.defines)
            return flash_attention_mma_fa2_smem_bytes(d["HEAD_DIM"], d["BLOCK_K"])
        if self.kernel in ("flash_attention_mma_fa2_wide", "flash_attention_mma_fa2_lean"):
            d = dict(self.defines)
            return flash_attention_mma_fa2_wide_smem_bytes(d["HEAD_DIM"], d["BLOCK_Q"], d["BLOCK_K"])
        if self.kernel in ("flash_attention_regtile", "flash_attention_regtile_wide") and \
                dict(self.defines).get("REGTILE_DYNAMIC_SMEM"):
            d = dict(self.defines)
            return flash_attention_regtile_smem_bytes(d["HEAD_DIM"], d["BLOCK_Q"], d["BLOCK_K"])
        return 0

    def entry_dynamic_smem_bytes(self, entry: str) -> int:
        """Dynamic shared memory a launch of one entry point asks for (bytes): :attr:`dynamic_smem_bytes`, except
        for the lean rung's pre-pass (``flash_attention_mma_fa2_lean_v_flags``), which uses none."""
        return 0 if entry == FA2_LEAN_V_FLAGS else self.dynamic_smem_bytes

    @property
    def arch(self) -> str | None:
        """The one architecture this build compiles for, or None for any of sm_80 and newer."""
        return WGMMA_ARCH if self.kernel in WGMMA_KERNELS else None

    @property
    def threads_per_block(self) -> int:
        if self.kernel in WGMMA_KERNELS:
            return WGMMA_THREADS
        if self.kernel in ("flash_attention_mma_fa2", "flash_attention_mma_fa2_lazy", "flash_attention_mma_fa2_wide",
                           "flash_attention_mma_fa2_lean"):
            d = dict(self.defines)                   # one warp per WARP_ROWS (16 or 32) query rows
            return 32 * (d["BLOCK_Q"] // d.get("WARP_ROWS", 16))
        return dict(self.defines).get("TILE", 256) if self.kernel == "online_softmax" else NUM_THREADS

    def describe(self) -> str:
        """A short label such as ``flash_attention float16 HEAD_DIM=128 BLOCK_Q=32 BLOCK_K=16``."""
        return " ".join([self.kernel, self.dtype] + [f"{k}={v}" for k, v in self.defines]
                        + (["FA_TRACE"] if self.trace else []))


def flash_attention_build(head_dim: int, dtype: str = "float32", trace: bool = False,
                          block_q: int | None = None, block_k: int | None = None) -> KernelBuild:
    """The :class:`KernelBuild` of the forward kernel for one head dim (see :func:`flash_attention_config`)."""
    bq, bk = flash_attention_config(head_dim, block_q, block_k)
    return KernelBuild.make("flash_attention", dtype, trace, HEAD_DIM=head_dim, BLOCK_Q=bq, BLOCK_K=bk)


def paged_decode_build(head_dim: int, block_size: int, num_heads: int, num_kv_heads: int,
                       dtype: str = "float32", trace: bool = False) -> KernelBuild:
    """The :class:`KernelBuild` of the paged decode kernels (see :func:`paged_decode_config`)."""
    hpb = paged_decode_config(head_dim, block_size, num_heads, num_kv_heads)
    return KernelBuild.make("paged_decode", dtype, trace, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                            HEADS_PER_BLOCK=hpb)


def online_softmax_build(tile: int = 256, dtype: str = "float32", trace: bool = False) -> KernelBuild:
    """The :class:`KernelBuild` of the online softmax kernel; ``tile`` is a multiple of 32 up to 1024."""
    tile = _check_int(tile, "tile", 32, 1024)
    if tile % 32:
        raise ValueError(f"tile must be a multiple of 32 (whole warps), got {tile}")
    return KernelBuild.make("online_softmax", dtype, trace, TILE=tile)


def default_builds(head_dim: int = 128, dtype: str = "float16", trace: bool = False) -> list[KernelBuild]:
    """One representative build per kernel (but the Hopper rungs'): online softmax (tile 256), flash attention
    (``head_dim``), its tensor-core variant (16-bit dtypes and head dims that are multiples of
    16 only), paged decode and the split decode (``head_dim``, block_size 16, 32 query heads on 8 kv
    heads; the split decode has no trace build), the
    backward (head dims up to 128), the register-tiled forward (float32, head dims a multiple of 4),
    the FlashAttention-2-style tensor-core forward and its lazy-rescaling, wide-warp and lean builds (16-bit
    dtypes, head dims 64 and 128, each its default tiles) and the
    tensor-core backward (16-bit dtypes, head dims 64 and 128, no trace build)."""
    builds = [online_softmax_build(256, dtype, trace), flash_attention_build(head_dim, dtype, trace)]
    if dtype in MMA_DTYPES and head_dim % 16 == 0:
        builds.append(flash_attention_mma_build(head_dim, dtype, trace))
    builds.append(paged_decode_build(head_dim, 16, 32, 8, dtype, trace))
    if not trace:                            # (the split decode has no trace build)
        builds.append(paged_decode_split_build(head_dim, 16, 32, 8, dtype))
    if head_dim <= MAX_BACKWARD_HEAD_DIM:
        builds.append(flash_attention_backward_build(head_dim, dtype, trace))
    if dtype in MMA_DTYPES and head_dim % 16 == 0:
        builds.append(flash_attention_mma_async_build(head_dim, dtype, trace))
    if head_dim % 4 == 0:                    # the register-tiled rung (float32 storage whatever dtype says)
        builds.append(flash_attention_regtile_build(head_dim, "float32", trace))
        builds.append(flash_attention_regtile_wide_build(head_dim, "float32", trace))
    if dtype in MMA_DTYPES and head_dim in FA2_CONFIGS:
        builds.append(flash_attention_mma_fa2_build(head_dim, dtype, trace))
    if dtype in MMA_DTYPES and head_dim in FA2_LAZY_CONFIGS:
        builds.append(flash_attention_mma_fa2_lazy_build(head_dim, dtype, trace))
        builds.append(flash_attention_mma_fa2_wide_build(head_dim, dtype, trace))
        builds.append(flash_attention_mma_fa2_lean_build(head_dim, dtype, trace))
    if dtype in MMA_DTYPES and head_dim in BACKWARD_MMA_HEAD_DIMS and not trace:    # (it has no trace build)
        builds.append(flash_attention_backward_mma_build(head_dim, dtype))
    return builds


# ---------------------------------------------------------------------------
# entry-point signatures (so launchers pass each scalar with the C type it expects)
# ---------------------------------------------------------------------------

_SIGNATURE = r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?{name}\s*\(([^)]*)\)'


@lru_cache(maxsize=None)
def kernel_signature(kernel: str, entry: str) -> tuple:
    """Parameters of an entry point as ``((kind, name), ...)``, kind one of
    ``'pointer'``, ``'int'``, ``'float'``, ``'tensormap'`` (a ``TmaDescriptor`` passed by value),
    parsed from the CUDA source.

    Raises ValueError if the entry point is not found or a parameter type is not one of those.
    """
    text = kernel_source(kernel)
    m = re.search(_SIGNATURE.format(name=re.escape(entry)), text)
    if m is None:
        raise ValueError(f"entry point {entry!r} not found in {kernel_file(kernel)}")
    params = []
    for raw in m.group(1).split(","):
        words = raw.replace("*", " * ").split()
        name = words[-1]
        if "*" in words:
            kind = "pointer"
        elif words[-2] == "int":
            kind = "int"
        elif words[-2] == "float":
            kind = "float"
        elif words[-2] == "TmaDescriptor":
            kind = "tensormap"
        else:
            raise ValueError(f"unsupported parameter {raw.strip()!r} of {entry}")
        params.append((kind, name))
    return tuple(params)
